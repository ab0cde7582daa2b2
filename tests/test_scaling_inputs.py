"""Bad input to the scalers, MasterWeightOptimizer and Updater: one clear error naming the argument, raised
before anything changes; a saved scaler state is checked exactly as the constructor checks its arguments."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler, Updater


def _saved(**kwargs) -> dict:
    return DynamicLossScaler(**kwargs).state_dict()


@pytest.mark.parametrize(
    ("change", "exc", "key"),
    [
        ({"scale": math.inf}, ValueError, "'scale'"),
        ({"scale": 1e39}, ValueError, "'scale'"),  # finite in fp64, inf once rounded to the fp32 scale
        ({"scale": 2.0**-140}, ValueError, "'scale'"),  # subnormal in fp32: its reciprocal overflows
        ({"scale": 0.5}, ValueError, "'scale'"),  # below min_scale (1.0)
        ({"scale": 2.0**30}, ValueError, "'scale'"),  # above max_scale (2**24)
        ({"max_scale": 0.5, "min_scale": 1.0}, ValueError, "'max_scale'"),
        ({"min_scale": 2.0**-140}, ValueError, "'min_scale'"),
        ({"_growth_tracker": -1}, ValueError, "'_growth_tracker'"),
        ({"_growth_tracker": 2000}, ValueError, "'_growth_tracker'"),  # must be < growth_interval
        ({"steps_taken": -3}, ValueError, "'steps_taken'"),
        ({"steps_skipped": -1}, ValueError, "'steps_skipped'"),
        ({"overflows_at_floor": -1}, ValueError, "'overflows_at_floor'"),
        ({"total_overflows_at_floor": -2}, ValueError, "'total_overflows_at_floor'"),
        ({"growth_interval": 2.7}, TypeError, "'growth_interval'"),
        ({"growth_interval": 0}, ValueError, "'growth_interval'"),
        ({"hysteresis": 1.5}, TypeError, "'hysteresis'"),
        ({"hysteresis_left": 3}, ValueError, "'hysteresis_left'"),  # above hysteresis (1)
        ({"consecutive_hysteresis": "false"}, TypeError, "'consecutive_hysteresis'"),
        ({"backoff_factor": 1.0}, ValueError, "'backoff_factor'"),
        ({"growth_factor": math.nan}, ValueError, "'growth_factor'"),
    ],
)
def test_load_state_dict_refuses_what_the_constructor_refuses(change, exc, key):
    scaler = DynamicLossScaler(init_scale=1024.0)
    before = scaler.state_dict()
    with pytest.raises(exc, match=key.replace("[", r"\[")):
        scaler.load_state_dict({**_saved(), **change})
    assert scaler.state_dict() == before  # nothing half-loaded


def test_loaded_inf_scale_cannot_skip_forever():
    # before the check, 1e39 loaded as an fp32 scale of inf: every step overflowed and was skipped, and the floor
    # was never reached
    scaler = DynamicLossScaler(max_scale=None)
    with pytest.raises(ValueError, match="scale"):
        scaler.load_state_dict({**_saved(max_scale=None), "scale": 1e39})
    assert scaler.get_scale() == 2.0**16


def test_static_scaler_load_checks_scale_and_counters():
    s = StaticLossScaler(8.0)
    with pytest.raises(ValueError, match="scale"):
        s.load_state_dict({"scale": 2.0**-149})
    with pytest.raises(ValueError, match="steps_taken"):
        s.load_state_dict({"scale": 4.0, "steps_taken": -1})
    assert s.get_scale() == 8.0


def test_valid_states_still_load_including_grad_scaler_and_older_hysteresis():
    s = DynamicLossScaler(hysteresis=2)
    s.load_state_dict({**_saved(hysteresis=2), "hysteresis_left": -3})  # older saves went below zero
    assert s.state_dict()["hysteresis_left"] == 0
    g = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=10)
    s.load_state_dict(g.state_dict())
    assert s.get_scale() == 4096.0 and s.growth_interval == 10


@pytest.mark.parametrize("cls", [DynamicLossScaler, StaticLossScaler])
def test_enabled_must_be_a_bool(cls):
    args = () if cls is DynamicLossScaler else (1.0,)
    with pytest.raises(TypeError, match="enabled"):
        cls(*args, enabled="false")  # a non-empty str is truthy: it used to enable the scaler
    with pytest.raises(TypeError, match="enabled"):
        cls(*args, enabled=0)


@pytest.mark.parametrize("cls", [DynamicLossScaler, StaticLossScaler])
def test_group_must_be_a_process_group(cls):
    args = () if cls is DynamicLossScaler else (1.0,)
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup"):
        cls(*args, group="x")  # used to fail only at the first all-reduce, with torch's message


@pytest.mark.parametrize("verb", ["unscale_", "step", "has_overflow"])
def test_scaler_verbs_name_a_missing_optimizer(verb):
    s = DynamicLossScaler()
    with pytest.raises(TypeError, match=r"optimizer must be a torch optimizer.*NoneType"):
        getattr(s, verb)(None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64])
def test_scaler_refuses_fp8_and_complex_gradients_by_name(dtype):
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)
    p.grad = torch.zeros(3, dtype=dtype)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.param_groups[0]["params"].append(p)
    with pytest.raises(TypeError, match=f"gradients.*{dtype}"):
        DynamicLossScaler().unscale_(opt)


def test_master_weight_optimizer_argument_errors():
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]
    with pytest.raises(TypeError, match=r"optimizer_cls must be a torch optimizer class.*'AdamW'"):
        MasterWeightOptimizer(params, "AdamW", lr=1e-3)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64):
        with pytest.raises(TypeError, match=f"params must be floating point.*{dtype}"):
            MasterWeightOptimizer(
                [torch.nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=False)], torch.optim.SGD, lr=0.1
            )
    with pytest.raises(TypeError, match="single tensor"):
        MasterWeightOptimizer(torch.zeros(2), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(
    "empty",
    [torch.zeros(0, 3), (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)), {"x": torch.zeros(0, 3)}],
)
def test_updater_refuses_an_empty_microbatch_before_any_backward(empty):
    # the mean loss over no rows is NaN while the gradients are zero: AdamW's decay used to move the weights
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    calls = []

    def loss_fn(m, mb):
        calls.append(1)
        x = mb[0] if isinstance(mb, tuple) else mb["x"] if isinstance(mb, dict) else mb
        return m(x).mean()

    up = Updater(model, opt, loss_fn, num_microbatches=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"microbatches\[1\] is empty"):
        up.step([torch.ones(2, 3), empty])
    assert not calls
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
