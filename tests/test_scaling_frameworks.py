"""scaler_from: each framework's loss-scale trajectory, floor error included, against an independent
transcription of that framework's update rule (tests/scaling_reference.py, each citing its source), on random and
adversarial overflow sequences; DeepSpeed's release lines (``version=``) and their defaults; resuming from each
framework's saved scaler state, and saved states that are refused; bad framework names and keys.

The packages themselves, where they install on CPU, are run against scaler_from in tests/test_peers_*.py.
"""

from __future__ import annotations

import random
from importlib import metadata

import pytest
import torch

from mixprec.scaling import DynamicLossScaler, StaticLossScaler, scaler_from
from scaling_reference import (
    CUT,
    DeepSpeedFP16OptimizerRule,
    DeepSpeedZeroRule,
    MegatronRule,
    NNablaRule,
    TorchGradScalerRule,
    adversarial,
    check_same,
    drive_grad_scaler,
    random_sequences,
    run_ours,
    run_rule,
)


@pytest.fixture(autouse=True)
def _most_sequences_compared_in_full():
    CUT.update(sequences=0, cut=0)
    yield
    assert CUT["cut"] <= 0.3 * CUT["sequences"], CUT


# ---------------------------------------------------------------------------------------------- torch
TORCH_CONFIGS = [(2.0**16, 2.0, 0.5, 1), (2.0**10, 2.0, 0.5, 3), (512.0, 1.7, 0.37, 2), (2.0**20, 3.0, 0.9, 5)]


@pytest.mark.parametrize(("init", "growth", "backoff", "interval"), TORCH_CONFIGS)
def test_torch_matches_grad_scaler_rule_and_grad_scaler_itself(init, growth, backoff, interval):
    seqs = random_sequences(24, 150, seed=interval) + adversarial(interval)
    kw = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    for seq in seqs:
        want = check_same(TorchGradScalerRule(**kw), scaler_from("torch", **kw), seq)
        assert want[1] is None  # torch never gives up
        # torch is always installed: its own GradScaler, not only the transcription, is the reference (up to
        # where the scale leaves fp32's normal range, as for the transcription)
        assert drive_grad_scaler(torch.amp.GradScaler("cpu", **kw), seq)[: len(want[0])] == want[0]


# ---------------------------------------------------------------------------------------------- deepspeed
# DeepSpeed release lines: the last one before PR #6976 and the one on PyPI when this was written
OLD, NEW = "0.16.9", "0.19.8"
ZERO_CONFIGS = [
    # initial_scale_power, loss_scale_window, min_loss_scale, hysteresis, consecutive_hysteresis
    (16, 2, 1, 2, False),
    (8, 3, 1, 2, True),
    (4, 1, 1, 1, False),
    (12, 5, 4, 3, True),
    (10, 4, 2, 3, False),
]
ZERO_CASES = [(*config, version) for config in ZERO_CONFIGS for version in (OLD, NEW)]
ZERO_CASES.append((4, 1, 0.25, 1, False, OLD))  # a fractional floor: only the old config reader takes one


@pytest.mark.parametrize(("power", "window", "min_scale", "hysteresis", "consecutive", "version"), ZERO_CASES)
def test_deepspeed_zero_matches_its_loss_scaler_floor_error_included(
    power, window, min_scale, hysteresis, consecutive, version
):
    seqs = random_sequences(24, 150, seed=power) + adversarial(window, hysteresis)
    raised = 0
    for seq in seqs:
        rule = DeepSpeedZeroRule(2.0**power, window, min_scale, hysteresis, consecutive, since_0_17_1=version == NEW)
        ours = scaler_from(
            "deepspeed",
            zero_stage=2,
            initial_scale_power=power,
            loss_scale_window=window,
            min_loss_scale=min_scale,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
            version=version,
        )
        raised += check_same(rule, ours, seq)[1] is not None
    assert raised >= 5  # not vacuous: the floor error is reached and reproduced on several sequences


@pytest.mark.parametrize("version", [OLD, NEW])
def test_deepspeed_zero_floor_example_raises_at_its_own_count(version):
    # hysteresis 2, consecutive hysteresis, floor 1, start 2: DeepSpeed raises at the 7th iteration (index 6);
    # counting the overflows that hysteresis absorbs would raise at index 3
    seq = [True, True, False, True, False, True, True]
    rule = DeepSpeedZeroRule(2.0, 1000, 1, 2, True, since_0_17_1=version == NEW)
    kw = dict(initial_scale_power=1, hysteresis=2, consecutive_hysteresis=True, min_loss_scale=1, version=version)
    assert check_same(rule, scaler_from("deepspeed", zero_stage=1, **kw), seq) == ([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], 6)


@pytest.mark.parametrize("version", [OLD, NEW])
def test_deepspeed_zero_without_the_floor_error_backs_off_to_the_floor_and_goes_on(version):
    seqs = random_sequences(12, 100, seed=5) + adversarial(3, 2)
    for seq in seqs:
        rule = DeepSpeedZeroRule(8.0, 3, 1, 2, False, since_0_17_1=version == NEW, raise_error_at_min_scale=False)
        ours = scaler_from(
            "deepspeed",
            zero_stage=3,
            initial_scale_power=3,
            loss_scale_window=3,
            hysteresis=2,
            raise_error_at_min_scale=False,
            version=version,
        )
        assert check_same(rule, ours, seq)[1] is None
    assert check_same(rule, ours, [True] * 10)[0][-1] == 1.0  # stays at its floor


def test_deepspeed_zero_growth_step_depends_on_the_release_line():
    # initial_scale_power=8, loss_scale_window=5, hysteresis=1, five clean steps: DeepSpeed 0.19.8's ZeRO scaler
    # stays at 256 (it grows on the sixth), the rule before 0.17.1 grows on the fifth
    kw = dict(zero_stage=2, initial_scale_power=8, loss_scale_window=5, hysteresis=1)
    assert run_ours(scaler_from("deepspeed", version=NEW, **kw), [False] * 6)[0] == [256] * 5 + [512]
    assert run_ours(scaler_from("deepspeed", version="0.17.1", **kw), [False] * 6)[0] == [256] * 5 + [512]
    assert run_ours(scaler_from("deepspeed", version=OLD, **kw), [False] * 6)[0] == [256] * 4 + [512] * 2
    assert run_ours(scaler_from("deepspeed", version="0.17.0", **kw), [False] * 6)[0] == [256] * 4 + [512] * 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_defaults_of_each_release_line(stage):
    # an fp16 section with only enabled and loss_scale 0: before 0.17.1 ZeRO's loss scaler keeps its own defaults
    # (2**32, window 1000, hysteresis 1); from 0.17.1 the config model's defaults apply (2**16, hysteresis 2)
    old = scaler_from("deepspeed", zero_stage=stage, enabled=True, loss_scale=0, version=OLD)
    new = scaler_from("deepspeed", zero_stage=stage, enabled=True, loss_scale=0, version=NEW)
    assert (old.get_scale(), old.growth_interval, old.hysteresis, old.min_scale) == (2.0**32, 1000, 1, 1.0)
    assert (new.get_scale(), new.growth_interval, new.hysteresis, new.min_scale) == (2.0**16, 1000, 2, 1.0)
    for seq in random_sequences(4, 60, seed=7):
        check_same(
            DeepSpeedZeroRule(2.0**32, 1000, 1, 1, False, since_0_17_1=False),
            scaler_from("deepspeed", zero_stage=stage, version=OLD),
            seq,
        )
        check_same(
            DeepSpeedZeroRule(2.0**16, 1000, 1, 2, False, since_0_17_1=True),
            scaler_from("deepspeed", zero_stage=stage, version=NEW),
            seq,
        )
    # one dynamic key in the section makes the old reader take the section's defaults for the others
    assert scaler_from("deepspeed", zero_stage=stage, hysteresis=3, version=OLD).get_scale() == 2.0**16


FP16_OPTIMIZER_CONFIGS = [(8, 2, 1), (16, 1, 1), (6, 3, 0.5), (10, 7, 8)]


@pytest.mark.parametrize("version", [OLD, NEW])
@pytest.mark.parametrize(("power", "window", "min_scale"), FP16_OPTIMIZER_CONFIGS)
def test_deepspeed_stage0_matches_fp16_optimizer(power, window, min_scale, version):
    if version == NEW and not float(min_scale).is_integer():
        min_scale = 1  # the config model reads an int
    seqs = random_sequences(24, 150, seed=window) + adversarial(window)
    kw = dict(initial_scale_power=power, loss_scale_window=window, min_loss_scale=min_scale, version=version)
    for seq in seqs:
        rule = DeepSpeedFP16OptimizerRule(2.0**power, window, min_scale)
        assert check_same(rule, scaler_from("deepspeed", **kw), seq)[1] is None


def test_deepspeed_stage0_grows_on_the_step_after_the_window():
    # W = 2, three clean steps from 256: DeepSpeed's FP16_Optimizer gives [256, 256, 512]; the default dynamic
    # scaler (growth every W) gives [256, 512, 512]
    seq = [False] * 3
    for version in (OLD, NEW):
        ours = scaler_from("deepspeed", initial_scale_power=8, loss_scale_window=2, version=version)
        assert run_ours(ours, seq)[0] == [256, 256, 512]
    assert run_ours(DynamicLossScaler(init_scale=256.0, growth_interval=2), seq)[0] == [256, 512, 512]
    assert run_rule(DeepSpeedFP16OptimizerRule(256.0, 2, 1), seq)[0] == [256, 256, 512]


def test_deepspeed_stage0_floor_of_an_unfused_optimizer_before_0_17_1():
    # no dynamic key in the section: before 0.17.1 FP16_UnfusedOptimizer (any optimizer but FusedAdam) keeps its
    # own floor 0.25, FP16_Optimizer the section's 1; from 0.17.1 both get the section's
    seq = [True] * 20
    floors = {
        (version, fused): run_ours(scaler_from("deepspeed", fused_optimizer=fused, version=version), seq)[0][-1]
        for version in (OLD, NEW)
        for fused in (True, False)
    }
    assert floors == {(OLD, True): 1.0, (OLD, False): 0.25, (NEW, True): 1.0, (NEW, False): 1.0}
    assert run_rule(DeepSpeedFP16OptimizerRule(2.0**16, 1000, 0.25), seq)[0][-1] == 0.25
    # a dynamic key in the section: both take the section's floor
    assert scaler_from("deepspeed", loss_scale_window=1000, fused_optimizer=False, version=OLD).min_scale == 1.0


def test_deepspeed_static_loss_scale():
    for version in (OLD, NEW):
        s = scaler_from("deepspeed", loss_scale=128, version=version)
        assert isinstance(s, StaticLossScaler) and s.get_scale() == 128.0


def test_deepspeed_min_loss_scale_is_an_int_from_0_17_1():
    assert scaler_from("deepspeed", zero_stage=1, min_loss_scale=0.25, initial_scale_power=2, version=OLD)
    assert scaler_from("deepspeed", zero_stage=1, min_loss_scale=2.0, version=NEW).min_scale == 2.0
    for kw in ({}, {"loss_scale": 128}):  # the config model checks the type even when the scale is static
        with pytest.raises(ValueError, match=r"min_loss_scale must be an integer from DeepSpeed 0\.17\.1 on"):
            scaler_from("deepspeed", zero_stage=1, min_loss_scale=0.25, version=NEW, **kw)


# ---------------------------------------------------------------------------------------------- deepspeed versions
def _fake_installed(monkeypatch, version):
    real = metadata.version

    def version_of(name):
        if name != "deepspeed":
            return real(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", version_of)


def _grows_on(scaler) -> int:
    """The clean step (1-based) on which a fresh scaler first grows."""
    scales = run_ours(scaler, [False] * (scaler.growth_interval + 2))[0]
    return next(i for i, s in enumerate(scales, start=1) if s > scales[0])


@pytest.mark.parametrize(
    ("installed", "grows_on"),
    [("0.16.9", 5), ("0.17.0", 5), ("0.17.1", 6), ("0.19.8", 6), ("0.17.1+cpu", 6), (None, 6)],
)
def test_deepspeed_version_defaults_to_the_installed_one_else_the_newest(monkeypatch, installed, grows_on):
    _fake_installed(monkeypatch, installed)
    kw = dict(zero_stage=2, initial_scale_power=8, loss_scale_window=5, hysteresis=1)
    assert _grows_on(scaler_from("deepspeed", **kw)) == grows_on
    # an explicit version wins over the installed one
    assert _grows_on(scaler_from("deepspeed", version=OLD, **kw)) == 5
    assert _grows_on(scaler_from("deepspeed", version=NEW, **kw)) == 6


def test_deepspeed_bad_versions_are_named(monkeypatch):
    for bad in ("latest", "", "zero.1"):
        with pytest.raises(ValueError, match=r"version must be a DeepSpeed release such as '0\.16\.9'"):
            scaler_from("deepspeed", version=bad)
    with pytest.raises(TypeError, match="version must be a str"):
        scaler_from("deepspeed", version=0.16)
    with pytest.raises(ValueError, match=r"version is '0\.8\.3': mixprec reproduces DeepSpeed 0\.9\.3 and later"):
        scaler_from("deepspeed", version="0.8.3")
    _fake_installed(monkeypatch, "0.9.2")
    with pytest.raises(ValueError, match=r"the installed deepspeed's version .*is '0\.9\.2'"):
        scaler_from("deepspeed")
    assert scaler_from("deepspeed", version="v0.9.3", zero_stage=1).growth_delay == 0


def test_deepspeed_keys_of_one_stage_are_refused_for_the_other():
    with pytest.raises(ValueError, match="raise_error_at_min_scale is an argument of ZeRO's loss scaler"):
        scaler_from("deepspeed", zero_stage=0, raise_error_at_min_scale=True)
    with pytest.raises(ValueError, match="fused_optimizer only matters for zero_stage=0"):
        scaler_from("deepspeed", zero_stage=2, fused_optimizer=False)
    with pytest.raises(TypeError, match="zero_stage"):
        scaler_from("deepspeed", zero_stage=True)


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
    for seq in random_sequences(24, 150, seed=interval) + adversarial(interval, hysteresis):
        assert check_same(MegatronRule(**kw), scaler_from("megatron", **kw), seq)[1] is None


# ---------------------------------------------------------------------------------------------- nnabla
NNABLA_CONFIGS = [(8.0, 2.0, 0), (8.0, 2.0, 1), (2.0**10, 2.0, 3), (2.0**15, 4.0, 6)]


@pytest.mark.parametrize(("scale", "factor", "n"), NNABLA_CONFIGS)
def test_nnabla_matches_dynamic_loss_scaling_updater(scale, factor, n):
    for seq in random_sequences(24, 150, seed=n) + adversarial(n + 1):
        rule = NNablaRule(scale, factor, n)
        assert check_same(rule, scaler_from("nnabla", scale=scale, scaling_factor=factor, N=n), seq)[1] is None


# ---------------------------------------------------------------------------------------------- resume
def _resume_case(make_rule, state_of, make_ours, framework, seed):
    rng = random.Random(seed)
    for _trial in range(12):
        prefix = [rng.random() < 0.35 for _ in range(rng.randrange(0, 40))]
        suffix = [rng.random() < 0.35 for _ in range(60)]
        rule = make_rule()
        if run_rule(rule, prefix)[1] is not None:
            continue
        ours = scaler_from(framework, state_dict=state_of(rule), **make_ours)
        assert ours.get_scale() == float(rule.scale)
        check_same(rule, ours, suffix)


def test_resume_from_grad_scaler_state_and_back():
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    rng = random.Random(3)
    for _ in range(12):
        prefix = [rng.random() < 0.35 for _ in range(rng.randrange(1, 30))]
        suffix = [rng.random() < 0.35 for _ in range(60)]
        real = torch.amp.GradScaler("cpu", **kw)
        drive_grad_scaler(real, prefix)
        rule = TorchGradScalerRule(**kw)
        run_rule(rule, prefix)
        # saved by GradScaler, resumed by mixprec
        want = check_same(rule, scaler_from("torch", state_dict=real.state_dict(), **kw), suffix)
        # saved by mixprec, resumed by GradScaler (it loads mixprec's state dict, a superset of its own)
        ours = scaler_from("torch", **kw)
        run_ours(ours, prefix)
        back = torch.amp.GradScaler("cpu", **kw)
        back.load_state_dict(ours.state_dict())
        assert drive_grad_scaler(back, suffix) == want[0]


@pytest.mark.parametrize("version", [OLD, NEW])
def test_resume_from_deepspeed_zero_loss_scaler(version):
    # ZeRO's optimizer state dict holds the loss-scaler object itself; its attribute dict loads too
    since = version == NEW
    _resume_case(
        lambda: DeepSpeedZeroRule(2.0**10, 3, 1, 2, False, since_0_17_1=since),
        lambda rule: {"loss_scaler": rule, "dynamic_loss_scale": True, "overflow": False},
        dict(zero_stage=2, initial_scale_power=10, loss_scale_window=3, hysteresis=2, version=version),
        "deepspeed",
        seed=11,
    )
    _resume_case(
        lambda: DeepSpeedZeroRule(2.0**10, 4, 1, 3, True, since_0_17_1=since),
        lambda rule: rule.saved(),
        dict(
            zero_stage=1,
            initial_scale_power=10,
            loss_scale_window=4,
            hysteresis=3,
            consecutive_hysteresis=True,
            version=version,
        ),
        "deepspeed",
        seed=12,
    )


@pytest.mark.parametrize("version", [OLD, NEW])
def test_resume_from_deepspeed_fp16_optimizer_state(version):
    _resume_case(
        lambda: DeepSpeedFP16OptimizerRule(2.0**12, 3, 1),
        lambda rule: rule.state_dict(),
        dict(initial_scale_power=12, loss_scale_window=3, version=version),
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


def _zero_state(**changes):
    """A ZeRO loss scaler saved after 7 iterations (the last overflow at iteration 4), hysteresis 2."""
    rule = DeepSpeedZeroRule(2.0**10, 3, 1, 2, False, since_0_17_1=True)
    run_rule(rule, [False, True, False, False, True, False, False])
    return {**rule.saved(), **changes}


ZERO_KW = dict(zero_stage=1, initial_scale_power=10, loss_scale_window=3, hysteresis=2, version=NEW)


@pytest.mark.parametrize(
    ("changes", "exc", "match"),
    [
        # DeepSpeed's cur_hysteresis lies in [1, delayed_shift]: it backs off when an overflow finds it at 1
        ({"cur_hysteresis": -5}, ValueError, r"state_dict\['cur_hysteresis'\] must lie in \[1, hysteresis=2\]; got -5"),
        ({"cur_hysteresis": 0}, ValueError, r"state_dict\['cur_hysteresis'\] must lie in \[1, hysteresis=2\]; got 0"),
        ({"cur_hysteresis": 3}, ValueError, r"state_dict\['cur_hysteresis'\] must lie in \[1, hysteresis=2\]; got 3"),
        ({"cur_hysteresis": 1.0}, TypeError, r"state_dict\['cur_hysteresis'\] must be an int"),
        # the scale: the key the user gave, never mixprec's own state_dict['scale']
        ({"cur_scale": 0.5}, ValueError, r"state_dict\['cur_scale'\] \(0\.5\) must be >= min_loss_scale \(1\.0\)"),
        ({"cur_scale": 1e39}, ValueError, r"state_dict\['cur_scale'\] must be a normal fp32 number"),
        ({"cur_scale": -4.0}, ValueError, r"state_dict\['cur_scale'\] must be a finite number > 0"),
        ({"cur_scale": "1024"}, TypeError, r"state_dict\['cur_scale'\] must be a real number"),
        ({"cur_iter": -1}, ValueError, r"state_dict\['cur_iter'\] must be an int >= 0"),
        (
            {"last_overflow_iter": 7},
            ValueError,
            r"state_dict\['last_overflow_iter'\] \(7\) must lie in \[-1, cur_iter=7\)",
        ),
        ({"last_overflow_iter": -2}, ValueError, r"state_dict\['last_overflow_iter'\] \(-2\) must lie in"),
        # DeepSpeed resumes with the saved rule: a state that contradicts the settings is refused, naming both
        (
            {"scale_window": 5},
            ValueError,
            r"state_dict\['scale_window'\] is 5 but loss_scale_window=3: .*pass loss_scale_window=5",
        ),
        ({"delayed_shift": 3}, ValueError, r"state_dict\['delayed_shift'\] is 3 but hysteresis=2"),
        ({"min_scale": 4}, ValueError, r"state_dict\['min_scale'\] is 4 but min_loss_scale=1\.0"),
        (
            {"consecutive_hysteresis": True},
            ValueError,
            r"state_dict\['consecutive_hysteresis'\] is True but consecutive",
        ),
        ({"raise_error_at_min_scale": False}, ValueError, r"state_dict\['raise_error_at_min_scale'\] is False but"),
        ({"scale_factor": 3.0}, ValueError, r"state_dict\['scale_factor'\] must be 2"),
        ({"dynamic": False}, ValueError, r"state_dict\['dynamic'\] is False but loss_scale=0 \(dynamic\)"),
    ],
)
def test_bad_deepspeed_state_is_refused_naming_the_key_given(changes, exc, match):
    with pytest.raises(exc, match=match) as info:
        scaler_from("deepspeed", state_dict=_zero_state(**changes), **ZERO_KW)
    assert "state_dict['scale']" not in str(info.value)


def test_bad_deepspeed_state_is_named_where_it_was_given():
    class LossScaler:  # what ZeRO pickles: an object, inside the optimizer's state dict
        def __init__(self, entries):
            self.__dict__.update(entries)

    nested = {"loss_scaler": LossScaler(_zero_state(cur_hysteresis=-5)), "dynamic_loss_scale": True}
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler'\]\.cur_hysteresis must lie in \[1, "):
        scaler_from("deepspeed", state_dict=nested, **ZERO_KW)
    nested = {"loss_scaler": _zero_state(cur_scale=0.5)}
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler'\]\['cur_scale'\] \(0\.5\) must be >="):
        scaler_from("deepspeed", state_dict=nested, **ZERO_KW)
    with pytest.raises(ValueError, match=r"state_dict\.cur_scale \(0\.5\) must be >="):
        scaler_from("deepspeed", state_dict=LossScaler(_zero_state(cur_scale=0.5)), **ZERO_KW)
    with pytest.raises(TypeError, match=r"state_dict\['loss_scaler'\] must be DeepSpeed's loss scaler"):
        scaler_from("deepspeed", state_dict={"loss_scaler": 3}, **ZERO_KW)
    # the valid state loads, with the hysteresis it saved (one overflow from a backoff: DeepSpeed refills it only
    # on growth)
    assert scaler_from("deepspeed", state_dict=_zero_state(), **ZERO_KW).state_dict()["hysteresis_left"] == 1
    assert (
        scaler_from("deepspeed", state_dict=_zero_state(cur_hysteresis=2), **ZERO_KW).state_dict()["hysteresis_left"]
        == 2
    )


def test_deepspeed_state_of_another_stage_or_kind_is_refused():
    stage0 = DeepSpeedFP16OptimizerRule(2.0**10, 3, 1).state_dict()
    with pytest.raises(ValueError, match=r"stage-0 optimizer's .* but zero_stage=2"):
        scaler_from("deepspeed", state_dict=stage0, zero_stage=2, version=NEW)
    with pytest.raises(ValueError, match="holds a ZeRO loss scaler but zero_stage=0"):
        scaler_from("deepspeed", state_dict={"loss_scaler": _zero_state()}, version=NEW)
    with pytest.raises(ValueError, match=r"state_dict\['dynamic_loss_scale'\] is True but loss_scale=128"):
        scaler_from("deepspeed", state_dict=stage0, loss_scale=128, version=NEW)
    with pytest.raises(ValueError, match=r"state_dict\['scale_window'\] is 3 but loss_scale_window=1000"):
        scaler_from("deepspeed", state_dict=stage0, version=NEW)
    # a static scaler's state: the scale only
    static = scaler_from(
        "deepspeed", state_dict={"loss_scaler": {"cur_scale": 64.0, "dynamic": False}}, loss_scale=128, zero_stage=2
    )
    assert static.get_scale() == 64.0


def test_bad_saved_state_is_named():
    with pytest.raises(ValueError, match=r"unknown key.*'cur_scale'.*accepted: scale"):
        scaler_from("torch", state_dict={"cur_scale": 1.0})
    with pytest.raises(KeyError, match="cur_scale"):
        scaler_from("deepspeed", state_dict={"scale": 1.0})
    with pytest.raises(KeyError, match=r"lacks 'cur_scale'.*the 'optimizer_state_dict' entry"):  # a whole checkpoint
        scaler_from("deepspeed", zero_stage=2, state_dict={"optimizer_state_dict": {}, "ds_version": "0.19.8"})
    with pytest.raises(ValueError, match="scale"):
        scaler_from(
            "megatron", state_dict={"scale": torch.tensor([float("inf")]), "growth_tracker": 0, "hysteresis_tracker": 2}
        )
