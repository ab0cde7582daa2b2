"""Transcribed loss-scale rules of torch, DeepSpeed, Megatron-LM and NNabla, and the drivers that compare them
with ``scaler_from`` on random and adversarial overflow sequences.

Each transcription is written from the public source cited on its class (repository, tag or commit, file, lines)
in the framework's own arithmetic: Python floats (fp64) for DeepSpeed and NNabla, fp32 for torch's kernel and
Megatron's fp32 tensors. They share no code with mixprec. Where the package itself installs on CPU next to
mixprec's other dependencies (torch, DeepSpeed 0.17.1 and later, Megatron-Core), tests/test_peers_*.py run it
against ``scaler_from`` too; the transcriptions stay for the releases that cannot be installed beside it
(DeepSpeed before 0.17.1, NNabla, which has no wheel for Python 3.11) and for runs without the ``peers`` extra.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from mixprec.scaling import LossScaleFloorError


class FloorReached(Exception):
    """A transcription's own "cannot decrease the scale any more" error."""


def f32(x: float) -> float:
    with np.errstate(over="ignore"):  # C's float cast: overflow gives inf
        return float(np.float32(x))


class TorchGradScalerRule:
    """pytorch/pytorch, aten/src/ATen/native/cuda/AmpKernels.cu, ``amp_update_scale_cuda_kernel`` (lines 181-207
    on main: the grown scale is kept only when finite), called by torch/amp/grad_scaler.py ``update()`` (lines
    484-560 in torch 2.13). The scale is an fp32 tensor; the factors are doubles."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = f32(init_scale)
        self.growth_tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            grown = f32(self.scale * self.growth_factor)
            if np.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful


class DeepSpeedZeroRule:
    """deepspeedai/DeepSpeed, deepspeed/runtime/fp16/loss_scaler.py, ``DynamicLossScaler``, used by ZeRO stages 1-3
    through ``CreateLossScaler`` (stage_1_and_2.py, stage3.py).

    ``since_0_17_1=False``: tag v0.17.0 (the file is unchanged from v0.9.3 and equals commit 38327e07):
    ``__init__`` lines 118-138, ``update_scale`` lines 170-203, growth when ``(cur_iter - last_overflow_iter) %
    scale_window == 0``; built from the fp16 config by deepspeed/runtime/config.py lines 216-242.
    ``since_0_17_1=True``: tag v0.17.1 (commit 2ce55057, after PR #6976), ``update_scale`` lines 171-206:
    ``stable_interval = (cur_iter - last_overflow_iter) - 1``, growth when it is a positive multiple of the window.
    """

    def __init__(
        self,
        init_scale,
        scale_window,
        min_scale,
        delayed_shift,
        consecutive_hysteresis,
        *,
        since_0_17_1: bool,
        raise_error_at_min_scale: bool = True,
    ):
        self.cur_scale = init_scale
        self.dynamic = True
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self._since_0_17_1 = since_0_17_1

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise FloorReached
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if self._since_0_17_1:
                stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
                grow = stable_interval > 0 and stable_interval % self.scale_window == 0
            else:
                grow = (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0
            if grow:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def saved(self) -> dict:
        """What ZeRO pickles into its checkpoint: the scaler object's attributes."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class DeepSpeedFP16OptimizerRule:
    """deepspeedai/DeepSpeed (tag v0.17.0; the same from v0.9.3 to v0.19.8), deepspeed/runtime/fp16/
    fused_optimizer.py: dynamic-scale set-up (lines 89-103: scale_factor 2, the window and the minimum from the
    config) and ``_update_scale`` (lines 385-406); unfused_optimizer.py lines 275-297 is the same rule. ZeRO
    stage 0."""

    def __init__(self, init_scale, scale_window, min_loss_scale):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2
        self.scale_window = scale_window
        self.min_loss_scale = min_loss_scale

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, skip: bool) -> None:
        if skip:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {
            "dynamic_loss_scale": True,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "optimizer_state_dict": {},
            "fp32_groups_flat": [],
            "clip_grad": 0.0,
        }


class MegatronRule:
    """NVIDIA/Megatron-LM (commit d98e8a64), megatron/core/optimizer/grad_scaler.py, ``DynamicGradScaler``:
    ``__init__`` (lines 84-129, factors and minimum held as fp32 tensors), ``update`` (lines 131-153),
    ``state_dict`` (lines 155-160)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @property
    def scale(self) -> float:
        return float(self._scale.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }


class NNablaRule:
    """sony/nnabla (commit 2814df0d), python/src/nnabla/experimental/mixed_precision_training.py,
    ``DynamicLossScalingUpdater``: ``__init__`` (lines 66-84) and ``update`` (lines 86-143). One call of
    ``update`` here is one attempt: an overflowing attempt divides the scale and resets the counter (lines
    119-121) before NNabla retries; a clean one steps, then grows when the counter exceeds N (lines 139-143)."""

    def __init__(self, scale=8.0, scaling_factor=2.0, N=2000):
        self.scale = scale
        self.scaling_factor = scaling_factor
        self.N = N
        self._counter = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale /= self.scaling_factor
            self._counter = 0
            return
        if self._counter > self.N:
            self.scale *= self.scaling_factor
            self._counter = 0
        self._counter += 1


PEERS_MISSING = "the peers extra is not installed: pip install -e '.[dev,peers]'"


@contextlib.contextmanager
def importing_peer(**env: str) -> Iterator[None]:
    """Around a peer package's import: ``env`` set, its warnings silenced ("Transformer Engine and Apex are not
    installed"), and the process environment as it was afterwards (DeepSpeed and Megatron-Core set variables such
    as PYTORCH_NVML_BASED_CUDA_CHECK when imported; the rest of the test session should not inherit them)."""
    saved = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.environ.update(env)
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------------- drivers
def run_rule(rule, seq):
    """Scales after each iteration, and the index of the iteration that raised at the floor (or None)."""
    scales = []
    for i, overflow in enumerate(seq):
        try:
            rule.update(overflow)
        except FloorReached:
            return scales, i
        scales.append(float(rule.scale))
    return scales, None


def run_ours(scaler, seq):
    """The same for a mixprec scaler, driven through ``update(found_inf=...)``."""
    scales = []
    for i, overflow in enumerate(seq):
        try:
            scaler.update(found_inf=overflow)
        except LossScaleFloorError:
            return scales, i
        scales.append(scaler.get_scale())
    return scales, None


def random_sequences(count: int, length: int, seed: int) -> list[list[bool]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p = (0.1, 0.3, 0.5, 0.7)[i % 4]
        out.append([rng.random() < p for _ in range(length)])
    return out


def adversarial(window: int, hysteresis: int = 1) -> list[list[bool]]:
    """Runs of clean steps just below, at and just above the growth window (and its +1 variant), overflow bursts
    just below, at and above the hysteresis, all-overflow and all-clean sequences, and alternation."""
    seqs = [[True] * 40, [False] * (4 * window + 3), [True, False] * 20, [False, True] * 20]
    for clean in (window - 1, window, window + 1, window + 2, 2 * window, 2 * window + 1):
        for burst in {1, max(1, hysteresis - 1), hysteresis, hysteresis + 1}:
            seqs.append(([True] * burst + [False] * max(clean, 0)) * 4)
            seqs.append(([False] * max(clean, 0) + [True] * burst) * 4)
    return seqs


FP32_NORMAL = (2.0**-126, 2.0**127)
CUT = {"sequences": 0, "cut": 0}  # how many compared sequences were cut short (see compare)


def compare(want, scaler, seq):
    """``want`` (scales after every iteration, index of the iteration that raised at the floor) against mixprec's.

    mixprec holds the scale as a normal fp32 number: the comparison stops where the reference's scale leaves
    [2**-126, 2**127] (subnormal: its reciprocal overflows and every later step is inf anyway; above: fp32
    overflows). ``CUT`` counts how often that happens, so the tests can check they are not vacuous."""
    out_of_range = [i for i, x in enumerate(want[0]) if not FP32_NORMAL[0] <= x <= FP32_NORMAL[1]]
    CUT["sequences"] += 1
    if out_of_range:
        CUT["cut"] += 1
        seq = seq[: out_of_range[0]]
        want = (want[0][: out_of_range[0]], None)
    got = run_ours(scaler, seq)
    assert got == want, (seq, want, got)
    return want


def check_same(rule, scaler, seq):
    """Equal trajectories of a transcription and a mixprec scaler (see ``compare``)."""
    return compare(run_rule(rule, seq), scaler, seq)


def drive_grad_scaler(real: torch.amp.GradScaler, seq) -> list[float]:
    """torch's own GradScaler through its public verbs; an overflowing iteration gets an inf gradient."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for overflow in seq:
        real.scale(torch.ones(()))
        p.grad = torch.full_like(p, float("inf") if overflow else 1.0)
        real.step(opt)
        real.update()
        scales.append(real.get_scale())
    return scales
