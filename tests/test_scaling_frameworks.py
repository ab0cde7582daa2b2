"""scaler_from: each framework's loss-scale trajectory, floor error included, against an independent
transcription of that framework's update rule, on random and adversarial overflow sequences; resuming from each
framework's saved scaler state; bad framework names and keys.

The transcriptions below are written from the public sources cited on each class (repository, file, lines at the
commit read), in the frameworks' own arithmetic: Python floats (fp64) for DeepSpeed and NNabla, fp32 for torch's
kernel and Megatron's fp32 tensors. They share no code with mixprec.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mixprec.scaling import DynamicLossScaler, LossScaleFloorError, StaticLossScaler, scaler_from


class FloorReached(Exception):
    """A transcription's own "cannot decrease the scale any more" error."""


def _f32(x: float) -> float:
    with np.errstate(over="ignore"):  # C's float cast: overflow gives inf
        return float(np.float32(x))


class TorchGradScalerRule:
    """pytorch/pytorch, aten/src/ATen/native/cuda/AmpKernels.cu, ``amp_update_scale_cuda_kernel`` (lines 181-207
    on main: the grown scale is kept only when finite), called by torch/amp/grad_scaler.py ``update()`` (lines
    484-560 in torch 2.13). The scale is an fp32 tensor; the factors are doubles."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = _f32(init_scale)
        self.growth_tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = _f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            if np.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful


class DeepSpeedZeroRule:
    """microsoft/DeepSpeed (commit 38327e07), deepspeed/runtime/fp16/loss_scaler.py: ``DynamicLossScaler.__init__``
    (lines 118-138) and ``update_scale`` (lines 170-203), used by ZeRO stages 1-3 (stage_1_and_2.py line 2077,
    stage3.py line 2464). Built from the fp16 config by deepspeed/runtime/config.py lines 215-241."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloorReached
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class DeepSpeedFP16OptimizerRule:
    """microsoft/DeepSpeed (commit 38327e07), deepspeed/runtime/fp16/fused_optimizer.py: dynamic-scale set-up
    (lines 89-103: scale_factor 2, the window and the minimum from the config) and ``_update_scale`` (lines
    385-407); unfused_optimizer.py lines 275-297 is the same rule. ZeRO stage 0."""

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


# ---------------------------------------------------------------------------------------------- drivers
def _run_rule(rule, seq):
    """Scales after each iteration, and the index of the iteration that raised at the floor (or None)."""
    scales = []
    for i, overflow in enumerate(seq):
        try:
            rule.update(overflow)
        except FloorReached:
            return scales, i
        scales.append(float(rule.scale))
    return scales, None


def _run_ours(scaler, seq):
    scales = []
    for i, overflow in enumerate(seq):
        try:
            scaler.update(found_inf=overflow)
        except LossScaleFloorError:
            return scales, i
        scales.append(scaler.get_scale())
    return scales, None


def _random_sequences(count: int, length: int, seed: int) -> list[list[bool]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p = (0.1, 0.3, 0.5, 0.7)[i % 4]
        out.append([rng.random() < p for _ in range(length)])
    return out


def _adversarial(window: int, hysteresis: int = 1) -> list[list[bool]]:
    """Runs of clean steps just below, at and just above the growth window (and its +1 variant), overflow bursts
    just below, at and above the hysteresis, all-overflow and all-clean sequences, and alternation."""
    seqs = [[True] * 40, [False] * (4 * window + 3), [True, False] * 20, [False, True] * 20]
    for clean in (window - 1, window, window + 1, window + 2, 2 * window, 2 * window + 1):
        for burst in {1, max(1, hysteresis - 1), hysteresis, hysteresis + 1}:
            seqs.append(([True] * burst + [False] * max(clean, 0)) * 4)
            seqs.append(([False] * max(clean, 0) + [True] * burst) * 4)
    return seqs


_FP32_NORMAL = (2.0**-126, 2.0**127)
CUT = {"sequences": 0, "cut": 0}  # how many compared sequences were cut short (see _check_same)


def _check_same(rule, scaler, seq):
    """Equal trajectories (scale after every iteration, and the iteration that raises at the floor).

    mixprec holds the scale as a normal fp32 number: the comparison stops where the reference's scale leaves
    [2**-126, 2**127] (subnormal: its reciprocal overflows and every later step is inf anyway; above: fp32
    overflows). ``CUT`` counts how often that happens, so the tests can check they are not vacuous."""
    want = _run_rule(rule, seq)
    in_range = [i for i, x in enumerate(want[0]) if not _FP32_NORMAL[0] <= x <= _FP32_NORMAL[1]]
    CUT["sequences"] += 1
    if in_range:
        CUT["cut"] += 1
        seq = seq[: in_range[0]]
        want = (want[0][: in_range[0]], None)
    got = _run_ours(scaler, seq)
    assert got == want, (seq, want, got)
    return want


@pytest.fixture(autouse=True)
def _most_sequences_compared_in_full():
    CUT.update(sequences=0, cut=0)
    yield
    assert CUT["cut"] <= 0.3 * CUT["sequences"], CUT


# ---------------------------------------------------------------------------------------------- torch
TORCH_CONFIGS = [(2.0**16, 2.0, 0.5, 1), (2.0**10, 2.0, 0.5, 3), (512.0, 1.7, 0.37, 2), (2.0**20, 3.0, 0.9, 5)]


@pytest.mark.parametrize(("init", "growth", "backoff", "interval"), TORCH_CONFIGS)
def test_torch_matches_grad_scaler_rule_and_grad_scaler_itself(init, growth, backoff, interval):
    seqs = _random_sequences(24, 150, seed=interval) + _adversarial(interval)
    kw = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    for seq in seqs:
        want = _check_same(TorchGradScalerRule(**kw), scaler_from("torch", **kw), seq)
        assert want[1] is None  # torch never gives up
    # and the real GradScaler agrees with the transcription (so the transcription is a faithful oracle)
    for seq in seqs[:6]:
        real = torch.amp.GradScaler("cpu", **kw)
        assert _drive_grad_scaler(real, seq) == _run_rule(TorchGradScalerRule(**kw), seq)[0]


def _drive_grad_scaler(real: torch.amp.GradScaler, seq) -> list[float]:
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


# ---------------------------------------------------------------------------------------------- deepspeed
ZERO_CONFIGS = [
    # initial_scale_power, loss_scale_window, min_loss_scale, hysteresis, consecutive_hysteresis
    (16, 2, 1, 2, False),
    (8, 3, 1, 2, True),
    (4, 1, 0.25, 1, False),
    (12, 5, 4, 3, True),
    (10, 4, 2, 3, False),
]


@pytest.mark.parametrize(("power", "window", "min_scale", "hysteresis", "consecutive"), ZERO_CONFIGS)
def test_deepspeed_zero_matches_its_loss_scaler_floor_error_included(power, window, min_scale, hysteresis, consecutive):
    seqs = _random_sequences(24, 150, seed=power) + _adversarial(window, hysteresis)
    raised = 0
    for seq in seqs:
        rule = DeepSpeedZeroRule(2.0**power, window, min_scale, hysteresis, consecutive)
        ours = scaler_from(
            "deepspeed",
            zero_stage=2,
            initial_scale_power=power,
            loss_scale_window=window,
            min_loss_scale=min_scale,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
        )
        raised += _check_same(rule, ours, seq)[1] is not None
    assert raised >= 5  # not vacuous: the floor error is reached and reproduced on several sequences


def test_deepspeed_zero_floor_example_raises_at_its_own_count():
    # hysteresis 2, consecutive hysteresis, floor 1, start 2: DeepSpeed raises at the 7th iteration (index 6);
    # counting the overflows that hysteresis absorbs would raise at index 3
    seq = [True, True, False, True, False, True, True]
    rule = DeepSpeedZeroRule(2.0, 1000, 1, 2, True)
    ours = scaler_from(
        "deepspeed",
        zero_stage=1,
        initial_scale_power=1,
        hysteresis=2,
        consecutive_hysteresis=True,
        min_loss_scale=1,
    )
    assert _check_same(rule, ours, seq) == ([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 6)


def test_deepspeed_zero_without_dynamic_keys_uses_its_loss_scaler_defaults():
    ours = scaler_from("deepspeed", zero_stage=3)
    rule = DeepSpeedZeroRule(2.0**32, 1000, 1, 1, False)
    assert ours.get_scale() == 2.0**32 and ours.hysteresis == 1
    for seq in _random_sequences(4, 60, seed=7):
        _check_same(rule, scaler_from("deepspeed", zero_stage=3), seq)
        rule = DeepSpeedZeroRule(2.0**32, 1000, 1, 1, False)


FP16_OPTIMIZER_CONFIGS = [(8, 2, 1), (16, 1, 1), (6, 3, 0.5), (10, 7, 8)]


@pytest.mark.parametrize(("power", "window", "min_scale"), FP16_OPTIMIZER_CONFIGS)
def test_deepspeed_stage0_matches_fp16_optimizer(power, window, min_scale):
    seqs = _random_sequences(24, 150, seed=window) + _adversarial(window)
    for seq in seqs:
        rule = DeepSpeedFP16OptimizerRule(2.0**power, window, min_scale)
        ours = scaler_from("deepspeed", initial_scale_power=power, loss_scale_window=window, min_loss_scale=min_scale)
        assert _check_same(rule, ours, seq)[1] is None


def test_deepspeed_stage0_grows_on_the_step_after_the_window():
    # W = 2, three clean steps from 256: DeepSpeed's FP16_Optimizer gives [256, 256, 512]; the default dynamic
    # scaler (growth every W) gives [256, 512, 512]
    seq = [False] * 3
    assert _run_ours(scaler_from("deepspeed", initial_scale_power=8, loss_scale_window=2), seq)[0] == [256, 256, 512]
    assert _run_ours(DynamicLossScaler(init_scale=256.0, growth_interval=2), seq)[0] == [256, 512, 512]
    assert _run_rule(DeepSpeedFP16OptimizerRule(256.0, 2, 1), seq)[0] == [256, 256, 512]


def test_deepspeed_static_loss_scale():
    s = scaler_from("deepspeed", loss_scale=128)
    assert isinstance(s, StaticLossScaler) and s.get_scale() == 128.0


# ---------------------------------------------------------------------------------------------- megatron
MEGATRON_CONFIGS = [
    # initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
    (2.0**16, 1.0, 2.0, 0.5, 3, 2),
    (2.0**12, 4.0, 2.0, 0.5, 1, 1),
    (1000.0, 1.0, 1.5, 0.3, 2, 3),  # non-power-of-two factors: fp32 arithmetic on both sides
    (2.0**20, 0.5, 4.0, 0.25, 5, 2),
]


@pytest.mark.parametrize(("initial", "min_scale", "growth", "backoff", "interval", "hysteresis"), MEGATRON_CONFIGS)
def test_megatron_matches_dynamic_grad_scaler(initial, min_scale, growth, backoff, interval, hysteresis):
    kw = dict(
        initial_scale=initial,
        min_scale=min_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
    )
    for seq in _random_sequences(24, 150, seed=interval) + _adversarial(interval, hysteresis):
        assert _check_same(MegatronRule(**kw), scaler_from("megatron", **kw), seq)[1] is None


# ---------------------------------------------------------------------------------------------- nnabla
NNABLA_CONFIGS = [(8.0, 2.0, 0), (8.0, 2.0, 1), (2.0**10, 2.0, 3), (2.0**15, 4.0, 6)]


@pytest.mark.parametrize(("scale", "factor", "n"), NNABLA_CONFIGS)
def test_nnabla_matches_dynamic_loss_scaling_updater(scale, factor, n):
    for seq in _random_sequences(24, 150, seed=n) + _adversarial(n + 1):
        rule = NNablaRule(scale, factor, n)
        assert _check_same(rule, scaler_from("nnabla", scale=scale, scaling_factor=factor, N=n), seq)[1] is None


# ---------------------------------------------------------------------------------------------- resume
def _resume_case(make_rule, state_of, make_ours, framework, seed):
    rng = random.Random(seed)
    for _trial in range(12):
        prefix = [rng.random() < 0.35 for _ in range(rng.randrange(0, 40))]
        suffix = [rng.random() < 0.35 for _ in range(60)]
        rule = make_rule()
        if _run_rule(rule, prefix)[1] is not None:
            continue
        ours = scaler_from(framework, state_dict=state_of(rule), **make_ours)
        assert ours.get_scale() == float(rule.scale)
        _check_same(rule, ours, suffix)


def test_resume_from_grad_scaler_state():
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    rng = random.Random(3)
    for _ in range(12):
        prefix = [rng.random() < 0.35 for _ in range(rng.randrange(1, 30))]
        real = torch.amp.GradScaler("cpu", **kw)
        _drive_grad_scaler(real, prefix)
        rule = TorchGradScalerRule(**kw)
        _run_rule(rule, prefix)
        ours = scaler_from("torch", state_dict=real.state_dict(), **kw)
        _check_same(rule, ours, [rng.random() < 0.35 for _ in range(60)])


def test_resume_from_deepspeed_zero_loss_scaler():
    # ZeRO's optimizer state dict holds the loss-scaler object itself; its attribute dict loads too
    _resume_case(
        lambda: DeepSpeedZeroRule(2.0**10, 3, 1, 2, False),
        lambda rule: {"loss_scaler": rule, "dynamic_loss_scale": True, "overflow": False},
        dict(zero_stage=2, initial_scale_power=10, loss_scale_window=3, hysteresis=2),
        "deepspeed",
        seed=11,
    )
    _resume_case(
        lambda: DeepSpeedZeroRule(2.0**10, 4, 1, 3, True),
        vars,
        dict(zero_stage=1, initial_scale_power=10, loss_scale_window=4, hysteresis=3, consecutive_hysteresis=True),
        "deepspeed",
        seed=12,
    )


def test_resume_from_deepspeed_fp16_optimizer_state():
    _resume_case(
        lambda: DeepSpeedFP16OptimizerRule(2.0**12, 3, 1),
        lambda rule: rule.state_dict(),
        dict(initial_scale_power=12, loss_scale_window=3),
        "deepspeed",
        seed=13,
    )


def test_resume_from_megatron_state():
    kw = dict(initial_scale=2.0**14, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    _resume_case(
        lambda: MegatronRule(**kw, hysteresis=2),
        lambda rule: rule.state_dict(),
        dict(**kw, hysteresis=2),
        "megatron",
        seed=14,
    )


def test_resume_from_nnabla_updater():
    _resume_case(
        lambda: NNablaRule(2.0**10, 2.0, 2),
        lambda rule: vars(rule),
        dict(scale=2.0**10, scaling_factor=2.0, N=2),
        "nnabla",
        seed=15,
    )


# ---------------------------------------------------------------------------------------------- bad input
def test_unknown_framework_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="'torch', 'deepspeed', 'megatron', 'nnabla'; got 'jax'"):
        scaler_from("jax")


@pytest.mark.parametrize(
    ("framework", "key"),
    [("deepspeed", "loss_scale_windw"), ("torch", "initial_scale"), ("megatron", "init_scale"), ("nnabla", "n")],
)
def test_unknown_key_lists_the_accepted_ones(framework, key):
    with pytest.raises(TypeError, match=f"unknown {framework} setting.*'{key}'.*accepted: ") as info:
        scaler_from(framework, **{key: 1})
    accepted = str(info.value).split("accepted: ")[1]
    assert len(accepted.split(", ")) >= 3


@pytest.mark.parametrize(
    ("framework", "kwargs", "exc", "match"),
    [
        ("deepspeed", {"hysteresis": 0}, ValueError, "hysteresis"),
        ("deepspeed", {"consecutive_hysteresis": "false"}, TypeError, "consecutive_hysteresis"),
        ("deepspeed", {"zero_stage": 4}, ValueError, "zero_stage"),
        ("deepspeed", {"initial_scale_power": 0, "min_loss_scale": 2}, ValueError, "min_loss_scale"),
        ("torch", {"enabled": "false"}, TypeError, "enabled"),
        ("megatron", {"initial_scale": 0.5}, ValueError, "initial_scale"),
        ("nnabla", {"scaling_factor": 1.0}, ValueError, "scaling_factor"),
        ("nnabla", {"N": -1}, ValueError, "N"),
    ],
)
def test_bad_values_are_named_by_the_frameworks_key(framework, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        scaler_from(framework, **kwargs)


def test_bad_saved_state_is_named():
    with pytest.raises(ValueError, match=r"unknown key.*'cur_scale'.*accepted: scale"):
        scaler_from("torch", state_dict={"cur_scale": 1.0})
    with pytest.raises(KeyError, match="cur_scale"):
        scaler_from("deepspeed", state_dict={"scale": 1.0})
    with pytest.raises(ValueError, match="scale"):
        scaler_from(
            "megatron", state_dict={"scale": torch.tensor([float("inf")]), "growth_tracker": 0, "hysteresis_tracker": 2}
        )
