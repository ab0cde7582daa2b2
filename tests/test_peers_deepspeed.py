"""scaler_from("deepspeed") against DeepSpeed itself (the ``peers`` extra, ``pip install -e '.[dev,peers]'``).

ZeRO stages 1-3: the loss scaler DeepSpeed's ZeRO optimizers build, ``CreateLossScaler`` from the fp16 section's
config model (``DeepSpeedFP16Config(...).dynamic_loss_scale_args()``, deepspeed/runtime/zero/stage_1_and_2.py and
stage3.py), driven through ``update_scale`` on random and adversarial overflow sequences, floor error included,
and resumed in mixprec from the scaler object ZeRO pickles into its checkpoints. Stage 0: ``FP16_Optimizer`` and
``FP16_UnfusedOptimizer``, built on CPU and stepped with inf or finite gradients. End to end (slow): the real
engine (``deepspeed.initialize``, fp16, stages 0-3) on two gloo ranks where one rank overflows, its checkpoint
loaded into mixprec. Each runs in forked ranks that call ``deepspeed.init_distributed`` (DeepSpeed's scaler asks
its communicator for the rank when it logs an overflow).

Two switches make DeepSpeed run here, neither on the loss-scale path: its CPU accelerator, chosen with
``DS_ACCELERATOR=cpu`` while it is imported; and its shared-memory all-reduce op, marked unavailable so that
``init_distributed`` does not compile it (minutes of C++); the engine test also declares fp16 supported by the
CPU accelerator (DeepSpeed asks oneDNN, which says no on CPUs without AVX512-FP16; a 4x4 fp16 layer runs anyway).
"""

from __future__ import annotations

import glob
import os
import pickle
import warnings

import pytest
import torch

from mixprec.scaling import LossScaleFloorError, StaticLossScaler, scaler_from
from mixprec.testing import run_distributed
from scaling_reference import CUT, PEERS_MISSING, adversarial, compare, importing_peer, random_sequences, run_ours

with importing_peer(DS_ACCELERATOR="cpu"):  # DeepSpeed picks its accelerator once, at first use
    deepspeed = pytest.importorskip("deepspeed", reason=PEERS_MISSING)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    get_accelerator()
    precision_config = pytest.importorskip(
        "deepspeed.runtime.precision_config", reason="DeepSpeed before 0.17.1 has no fp16 config model"
    )
DeepSpeedFP16Config = precision_config.DeepSpeedFP16Config

FLOOR_MESSAGE = "Current loss scale already at minimum"


@pytest.fixture(autouse=True)
def _most_sequences_compared_in_full():
    CUT.update(sequences=0, cut=0)
    yield
    assert CUT["cut"] <= 0.3 * CUT["sequences"], CUT


def _in_deepspeed(fn, *args, world_size=1, timeout=240.0):
    """``fn(rank, world_size, *args)`` on forked gloo ranks with DeepSpeed's communicator initialised."""
    return run_distributed(_deepspeed_rank, world_size, fn, args, timeout=timeout)


def _deepspeed_rank(rank, world_size, fn, args):
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deepspeed.init_distributed(dist_backend="gloo")
    return fn(rank, world_size, *args)


def _drive_loss_scaler(scaler, seq):
    """DeepSpeed's loss scaler through ``update_scale``: scales after each iteration, index of the one that raised."""
    scales = []
    for i, overflow in enumerate(seq):
        try:
            scaler.update_scale(overflow)
        except Exception as exc:  # DeepSpeed raises a bare Exception at its floor
            if FLOOR_MESSAGE not in str(exc):
                raise
            return scales, i
        scales.append(float(scaler.cur_scale))
    return scales, None


# ---------------------------------------------------------------------------------------------- ZeRO 1-3
ZERO_SECTIONS = [
    {},  # only "enabled": every default of the config model
    {"loss_scale": 0},
    {"initial_scale_power": 8, "loss_scale_window": 5, "hysteresis": 1},
    {"initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2},
    {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": True},
    {"initial_scale_power": 4, "loss_scale_window": 1, "hysteresis": 1},
    {"initial_scale_power": 12, "loss_scale_window": 5, "hysteresis": 3, "min_loss_scale": 4},
    {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 3, "min_loss_scale": 2},
]


def _sequences(window, hysteresis):
    if window > 16:  # the default window (1000): random sequences and the first growths, not every pattern
        return [*random_sequences(4, 150, seed=window), [False] * (window + 1) + [True] + [False] * (window + 2)]
    return random_sequences(16, 150, seed=window) + adversarial(window, hysteresis)


def _zero_scaler(config, raise_at_min):
    """ZeRO's loss scaler as stage_1_and_2.py and stage3.py build it, or with its floor error switched off."""
    args = config.dynamic_loss_scale_args()
    if raise_at_min:
        return CreateLossScaler(torch.half, config.loss_scale, config.loss_scale == 0, args)
    return DynamicLossScaler(dtype=torch.half, raise_error_at_min_scale=False, **args)


def _zero_trajectories(rank, world_size, sections, raise_at_min):
    """For each fp16 section: DeepSpeed's trajectory on every sequence, and its scaler saved after a prefix
    together with the trajectory that follows it."""
    out = []
    for section in sections:
        config = DeepSpeedFP16Config(enabled=True, **section)
        runs = [
            _drive_loss_scaler(_zero_scaler(config, raise_at_min), seq)
            for seq in _sequences(config.loss_scale_window, config.hysteresis)
        ]
        resumed = []
        for seq in random_sequences(6, 80, seed=3):
            scaler = _zero_scaler(config, raise_at_min)
            prefix, suffix = seq[:30], seq[30:]
            if _drive_loss_scaler(scaler, prefix)[1] is not None:
                continue
            # what ZeRO's state_dict() holds and its checkpoint pickles: the scaler object itself
            saved = pickle.loads(pickle.dumps({"loss_scaler": scaler, "dynamic_loss_scale": scaler.dynamic}))
            resumed.append((saved, suffix, _drive_loss_scaler(scaler, suffix)))
        out.append((runs, resumed))
    return out


def _check_zero(sections, results, **mixprec_kw):
    raised = 0
    for section, (runs, resumed) in zip(sections, results, strict=True):
        config = DeepSpeedFP16Config(enabled=True, **section)
        seqs = _sequences(config.loss_scale_window, config.hysteresis)
        for i, (seq, want) in enumerate(zip(seqs, runs, strict=True)):
            stage = 1 + i % 3  # one scaler class for all three stages
            got = compare(want, scaler_from("deepspeed", zero_stage=stage, **section, **mixprec_kw), seq)
            raised += got[1] is not None
        for saved, suffix, want in resumed:
            ours = scaler_from("deepspeed", zero_stage=2, state_dict=saved, **section, **mixprec_kw)
            compare(want, ours, suffix)
        assert len(resumed) >= 3, "too few resumable prefixes: the resume check would be vacuous"
    return raised


def test_zero_loss_scaler_built_from_its_config_model_floor_error_included():
    results = _in_deepspeed(_zero_trajectories, ZERO_SECTIONS, True)[0]
    raised = _check_zero(ZERO_SECTIONS, results)  # version: the installed deepspeed's
    assert raised >= 10  # not vacuous: DeepSpeed's floor error is reached, and reproduced, on many sequences
    # the installed release, named explicitly, is the same rule
    _check_zero(ZERO_SECTIONS[:3], results[:3], version=deepspeed.__version__)


def test_zero_loss_scaler_without_its_floor_error():
    sections = ZERO_SECTIONS[2:5]
    results = _in_deepspeed(_zero_trajectories, sections, False)[0]
    assert _check_zero(sections, results, raise_error_at_min_scale=False) == 0


def test_zero_issue_example_and_defaults():
    # initial_scale_power=8, loss_scale_window=5, hysteresis=1, five clean steps: DeepSpeed stays at 256
    def run(rank, world_size):
        section = DeepSpeedFP16Config(enabled=True, initial_scale_power=8, loss_scale_window=5, hysteresis=1)
        scaler = CreateLossScaler(torch.half, 0, True, section.dynamic_loss_scale_args())
        defaults = CreateLossScaler(torch.half, 0, True, DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args())
        return _drive_loss_scaler(scaler, [False] * 6)[0], (defaults.cur_scale, defaults.delayed_shift)

    steps, defaults = _in_deepspeed(run)[0]
    assert steps == [256] * 5 + [512]
    ours = scaler_from("deepspeed", zero_stage=2, initial_scale_power=8, loss_scale_window=5, hysteresis=1)
    assert run_ours(ours, [False] * 6)[0] == steps
    plain = scaler_from("deepspeed", zero_stage=2, enabled=True, loss_scale=0)
    assert (plain.get_scale(), plain.hysteresis) == defaults == (2.0**16, 2)


def test_static_loss_scale_and_the_config_models_checks():
    def run(rank, world_size):
        scaler = CreateLossScaler(torch.half, 128.0, False, None)
        refused = []
        for bad in ({"min_loss_scale": 0.25}, {"loss_scale": -1}, {"loss_scale_window": 0}):
            try:
                DeepSpeedFP16Config(enabled=True, **bad)
            except Exception:
                refused.append(bad)
        return float(scaler.cur_scale), refused

    scale, refused = _in_deepspeed(run)[0]
    ours = scaler_from("deepspeed", zero_stage=1, loss_scale=128)
    assert isinstance(ours, StaticLossScaler) and ours.get_scale() == scale == 128.0
    assert refused == [{"min_loss_scale": 0.25}, {"loss_scale": -1}, {"loss_scale_window": 0}]
    for bad in refused:  # what DeepSpeed's config model refuses, mixprec refuses, naming the key
        with pytest.raises(ValueError, match=next(iter(bad))):
            scaler_from("deepspeed", zero_stage=1, **bad)


# ---------------------------------------------------------------------------------------------- stage 0
STAGE0_SECTIONS = [
    {},
    {"initial_scale_power": 8, "loss_scale_window": 2},
    {"initial_scale_power": 6, "loss_scale_window": 3, "min_loss_scale": 2},
    {"initial_scale_power": 10, "loss_scale_window": 7, "min_loss_scale": 8, "hysteresis": 3},
]


def _stage0_trajectories(rank, world_size, sections):
    """Stage 0's two optimizers, built as the engine builds them (engine.py, _configure_fp16_optimizer), stepped
    with inf or finite gradients; each one's state dict after a prefix, with the trajectory that follows."""
    out = []
    for section in sections:
        config = DeepSpeedFP16Config(enabled=True, **section)
        per_kind = {}
        for fused in (True, False):

            def make(fused=fused, config=config):
                p = torch.nn.Parameter(torch.zeros(4, dtype=torch.half))
                sgd = torch.optim.SGD([p], lr=0.0)
                common = dict(
                    static_loss_scale=config.loss_scale,
                    dynamic_loss_scale=config.loss_scale == 0,
                    dynamic_loss_args=config.dynamic_loss_scale_args(),
                    verbose=False,
                )
                if fused:
                    opt = FP16_Optimizer(sgd, initial_dynamic_scale=config.initial_dynamic_scale(), **common)
                else:
                    opt = FP16_UnfusedOptimizer(sgd, **common)
                return p, opt

            def drive(p, opt, seq):
                scales = []
                for overflow in seq:
                    p.grad = torch.full_like(p, float("inf") if overflow else 1.0)
                    opt.step()
                    scales.append(float(opt.loss_scale))
                return scales, None

            seqs = _sequences(config.loss_scale_window, 1)
            runs = [drive(*make(), seq) for seq in seqs]
            p, opt = make()
            prefix = [i % 5 == 3 for i in range(23)]
            drive(p, opt, prefix)
            state = {k: v for k, v in opt.state_dict().items() if k != "optimizer_state_dict"}
            suffix = random_sequences(1, 60, seed=9)[0]
            per_kind[fused] = (seqs, runs, state, suffix, drive(p, opt, suffix))
        out.append(per_kind)
    return out


def test_stage0_fp16_optimizers():
    results = _in_deepspeed(_stage0_trajectories, STAGE0_SECTIONS)[0]
    for section, per_kind in zip(STAGE0_SECTIONS, results, strict=True):
        for fused, (seqs, runs, state, suffix, want) in per_kind.items():
            kw = dict(zero_stage=0, fused_optimizer=fused, **section)
            for seq, run in zip(seqs, runs, strict=True):
                assert compare(run, scaler_from("deepspeed", **kw), seq)[1] is None
            compare(want, scaler_from("deepspeed", state_dict=state, **kw), suffix)


# ---------------------------------------------------------------------------------------------- the engine
ENGINE_SECTION = {"initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 2}
FLOOR_SECTION = {"initial_scale_power": 2, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
SAVE_AT = 14


def _overflows(steps, seed):
    """Which rank (or None) overflows at each step; the other rank stays clean."""
    rng = torch.Generator().manual_seed(seed)
    draws = torch.rand(steps, generator=rng).tolist()
    return [None if d > 0.3 else int(d * 7) % 2 for d in draws]


def _engine(rank, world_size, stages, tmp):
    """Per stage: the real engine's scale after each step, mixprec's (agreed over the same ranks), the step index at
    which each raised at its floor, and the scale trajectory after resuming from DeepSpeed's checkpoint."""
    get_accelerator().is_fp16_supported = lambda: True
    results = {}
    for stage in stages:
        for name, section, steps in (("trajectory", ENGINE_SECTION, 30), ("floor", FLOOR_SECTION, 12)):
            torch.manual_seed(0)
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "fp16": {"enabled": True, **section},
                "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True,
                "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
            ours = scaler_from("deepspeed", zero_stage=stage, **section)
            plan = _overflows(steps, seed=stage) if name == "trajectory" else [rank] * steps
            theirs_scales, ours_scales, raised = [], [], {"deepspeed": None, "mixprec": None}
            resumed, resumed_scales = None, []
            for i, who in enumerate(plan):
                x = torch.ones(1, 4, dtype=torch.half) * (float("inf") if who == rank else 1.0)
                if raised["deepspeed"] is None:
                    try:
                        # small enough that only the planned inf overflows, whatever the scale reaches here
                        engine.backward(engine(x).float().sum() * 2.0**-12)
                        engine.step()
                        theirs_scales.append(float(engine.optimizer.loss_scale))
                    except Exception as exc:
                        if FLOOR_MESSAGE not in str(exc):
                            raise
                        raised["deepspeed"] = i
                if raised["mixprec"] is None:
                    try:
                        ours.update(found_inf=who == rank)  # agreed across the ranks, as DeepSpeed's check
                        ours_scales.append(ours.get_scale())
                    except LossScaleFloorError:
                        raised["mixprec"] = i
                if resumed is not None and raised.get("resumed") is None:
                    try:
                        resumed.update(found_inf=who == rank)
                        resumed_scales.append(resumed.get_scale())
                    except LossScaleFloorError:
                        raised["resumed"] = i
                if name == "trajectory" and i == SAVE_AT:
                    directory = os.path.join(tmp, f"stage{stage}")
                    engine.save_checkpoint(directory, tag="t")
                    if stage == 0:
                        saved = torch.load(
                            os.path.join(directory, "t", "mp_rank_00_model_states.pt"), weights_only=False
                        )["optimizer"]
                    else:
                        (path,) = glob.glob(os.path.join(directory, "t", f"*zero_pp_rank_{rank}_*optim_states.pt"))
                        saved = torch.load(path, weights_only=False)["optimizer_state_dict"]
                    resumed = scaler_from("deepspeed", zero_stage=stage, state_dict=saved, **section)
            results[stage, name] = (theirs_scales, ours_scales, raised, resumed_scales)
    return results


@pytest.mark.slow
def test_engine_end_to_end_on_two_ranks_with_its_checkpoint(tmp_path):
    stages = (0, 1, 2, 3)
    per_rank = _in_deepspeed(_engine, stages, str(tmp_path), world_size=2, timeout=400.0)
    assert per_rank[0] == per_rank[1]  # both ranks agree, in DeepSpeed and in mixprec
    for stage in stages:
        theirs, ours, raised, resumed = per_rank[0][stage, "trajectory"]
        assert ours == theirs and len(set(theirs)) >= 3, (stage, theirs, ours)  # the scale moved both ways
        assert raised == {"deepspeed": None, "mixprec": None}
        assert resumed == theirs[SAVE_AT + 1 :], (stage, resumed, theirs)
        theirs, ours, raised, _ = per_rank[0][stage, "floor"]
        assert ours == theirs
        # ZeRO raises when a backoff finds the scale at its floor; stage 0 stays there
        assert raised == ({"deepspeed": None, "mixprec": None} if stage == 0 else {"deepspeed": 2, "mixprec": 2})
