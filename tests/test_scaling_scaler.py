"""Loss scalers: the update rule against torch.amp.GradScaler and hand-worked sequences, call order,
state_dict, argument checks, and overflow agreement across gloo ranks."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from mixprec import DynamicLossScaler, LossScaleFloorError, MasterWeightOptimizer, StaticLossScaler


def _one_param_optimizer() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.zeros(4))
    return p, torch.optim.SGD([p], lr=0.1)


def _drive(scaler, overflows: list[bool]) -> list[float]:
    """Run one iteration per entry; an overflowing one gets an inf gradient. Returns the scale after each."""
    p, opt = _one_param_optimizer()
    scales = []
    for overflow in overflows:
        scaler.scale(torch.tensor(1.0))  # GradScaler creates its scale lazily here
        p.grad = torch.full_like(p, float("inf") if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("growth_factor", "backoff_factor", "interval"),
    [(2.0, 0.5, 3), (1.7, 0.37, 2), (3.0, 0.9, 1)],  # non-powers of two exercise the fp32 rounding
)
def test_trajectory_equals_torch_grad_scaler(seed, growth_factor, backoff_factor, interval):
    rng = random.Random(seed)
    overflows = [rng.random() < 0.3 for _ in range(400)]
    kwargs = dict(
        init_scale=2.0**10, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=interval
    )
    ours = DynamicLossScaler(**kwargs, hysteresis=1, min_scale=None, max_scale=None)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    assert _drive(ours, overflows) == _drive(theirs, overflows)


def test_growth_stops_at_fp32_overflow_like_grad_scaler():
    kwargs = dict(init_scale=2.0**120, growth_factor=2.0**4, backoff_factor=0.5, growth_interval=1)
    ours = DynamicLossScaler(**kwargs, min_scale=None, max_scale=None)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    assert (
        _drive(ours, [False] * 5) == _drive(theirs, [False] * 5) == [2.0**124, 2.0**124, 2.0**124, 2.0**124, 2.0**124]
    )


def test_hysteresis_hand_worked():
    s = DynamicLossScaler(init_scale=1024, growth_interval=3, hysteresis=2, min_scale=None, max_scale=None)
    #          O     O    C    O    C    C    C     O     O
    seq = [True, True, False, True, False, False, False, True, True]
    # first overflow spends hysteresis (2 -> 1), the second backs off; hysteresis stays spent (<= 0)
    # so the next overflow backs off at once; three clean steps grow and refill hysteresis to 2.
    assert _drive(s, seq) == [1024, 512, 512, 256, 256, 256, 512, 512, 256]


def test_consecutive_hysteresis_hand_worked():
    s = DynamicLossScaler(
        init_scale=1024, growth_interval=100, hysteresis=2, consecutive_hysteresis=True, min_scale=None, max_scale=None
    )
    #          O     C     O     O     O     C     O
    seq = [True, False, True, True, True, False, True]
    # every clean step refills hysteresis, so only two overflows in a row back off
    assert _drive(s, seq) == [1024, 1024, 1024, 512, 256, 256, 256]


def test_without_consecutive_hysteresis_isolated_overflows_accumulate():
    s = DynamicLossScaler(init_scale=1024, growth_interval=100, hysteresis=2, min_scale=None, max_scale=None)
    assert _drive(s, [True, False, True, False, True]) == [1024, 1024, 512, 512, 256]


def test_floor_ceiling_and_patience_raise():
    s = DynamicLossScaler(init_scale=4, growth_interval=1, min_scale=1.0, max_scale=8.0, min_patience=3)
    assert _drive(s, [False, False, False]) == [8.0, 8.0, 8.0]  # clamped at the ceiling
    p, opt = _one_param_optimizer()
    scales = []
    with pytest.raises(LossScaleFloorError, match="stuck at its floor"):
        for _ in range(20):
            p.grad = torch.full_like(p, float("nan"))
            scaler_step_update(s, opt)
            scales.append(s.get_scale())
    # 8 -> 4 -> 2 -> 1 (reaching the floor), then three overflows at the floor raise
    assert scales == [4.0, 2.0, 1.0, 1.0, 1.0]
    assert s.overflows_at_floor == 3 and s.steps_skipped == 6


def scaler_step_update(scaler, opt):
    scaler.step(opt)
    scaler.update()


def test_floor_patience_resets_on_clean_step_and_warn_mode():
    s = DynamicLossScaler(init_scale=1.0, min_scale=1.0, min_patience=2, on_min_scale="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _drive(s, [True, False, True, False, True])
        assert not caught  # never two in a row
        _drive(s, [True, True])
        assert len(caught) == 1 and "stuck at its floor" in str(caught[0].message)
    s_ignore = DynamicLossScaler(init_scale=1.0, min_scale=1.0, min_patience=1, on_min_scale="ignore")
    assert _drive(s_ignore, [True] * 5) == [1.0] * 5
    assert s_ignore.total_overflows_at_floor == 5


def test_step_skips_on_overflow_and_counts():
    s = StaticLossScaler(128.0)
    p, opt = _one_param_optimizer()
    p.grad = torch.full_like(p, 128.0)
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.full((4,), -0.1))  # unscaled grad 1.0, lr 0.1
    p.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    before = p.detach().clone()
    assert s.step(opt) is None
    s.update()
    assert torch.equal(p.detach(), before)
    assert (s.steps_taken, s.steps_skipped, s.get_scale(), s.last_found_inf) == (1, 1, 128.0, True)


def test_unscale_divides_with_fp64_reciprocal():
    s = StaticLossScaler(3.0)
    p, opt = _one_param_optimizer()
    p.grad = torch.full_like(p, 3.0)
    s.unscale_(opt)
    expected = torch.tensor(3.0, dtype=torch.float32) * torch.tensor(1.0 / 3.0, dtype=torch.float32)
    assert torch.equal(p.grad, torch.full((4,), expected.item()))


def test_call_order_errors():
    s = DynamicLossScaler()
    p, opt = _one_param_optimizer()
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="no overflow checks"):
        s.update()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt)
    s.update()
    s.unscale_(opt)  # a new iteration starts fresh


def test_update_with_explicit_flag():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=1, min_scale=None)
    s.update(found_inf=True)
    assert s.get_scale() == 4.0
    s.update(found_inf=torch.tensor([0.0]))
    assert s.get_scale() == 8.0
    with pytest.raises(TypeError, match="found_inf"):
        s.update(found_inf="yes")


def test_fp16_gradients_are_refused():
    s = DynamicLossScaler()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="fp16 gradients"):
        s.unscale_(opt)


def test_scale_keeps_dtype_and_handles_sequences():
    s = DynamicLossScaler(init_scale=4.0)
    loss = torch.tensor(1.5, dtype=torch.float16)
    assert s.scale(loss).dtype == torch.float16 and s.scale(loss).item() == 6.0
    a, b = s.scale((torch.tensor(1.0), torch.tensor(2.0)))
    assert (a.item(), b.item()) == (4.0, 8.0)
    with pytest.raises(TypeError, match="outputs"):
        s.scale(3.0)


def test_disabled_scaler_is_a_pass_through():
    s = DynamicLossScaler(enabled=False)
    p, opt = _one_param_optimizer()
    p.grad = torch.full_like(p, float("inf"))
    loss = torch.tensor(2.0)
    assert s.scale(loss) is loss and s.get_scale() == 1.0
    s.step(opt)  # steps even with inf: disabled means no checks, like GradScaler(enabled=False)
    s.update()
    assert torch.isinf(p.detach()).all()
    assert s.state_dict() == {}


def test_state_dict_round_trip_and_grad_scaler_interop():
    s = DynamicLossScaler(init_scale=256.0, growth_interval=5, hysteresis=3, min_scale=2.0, on_min_scale="ignore")
    _drive(s, [False, True, False, False, True])
    sd = s.state_dict()
    assert all(isinstance(v, int | float | bool | type(None)) for v in sd.values())
    t = DynamicLossScaler(on_min_scale="ignore")  # policy is configuration, not state
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    seq = [random.Random(1).random() < 0.4 for _ in range(50)]
    assert _drive(s, seq) == _drive(t, seq)
    # torch's GradScaler loads our state and vice versa
    g = torch.amp.GradScaler("cpu")
    g.load_state_dict(sd)
    assert g.get_scale() == sd["scale"] and g.get_growth_interval() == 5
    g2 = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    u = DynamicLossScaler()
    u.load_state_dict(g2.state_dict())
    assert u.get_scale() == 512.0 and u.growth_interval == 7


def test_load_state_dict_refuses_empty_and_foreign():
    s = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    with pytest.raises(KeyError, match="scale"):
        s.load_state_dict({"foo": 1})
    with pytest.raises(TypeError, match="dict"):
        s.load_state_dict([("scale", 1.0)])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(init_scale=0.0), ValueError, "init_scale"),
        (dict(init_scale=float("inf")), ValueError, "init_scale"),
        (dict(growth_factor=1.0), ValueError, "growth_factor"),
        (dict(backoff_factor=1.0), ValueError, "backoff_factor"),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor"),
        (dict(growth_interval=0), ValueError, "growth_interval"),
        (dict(growth_interval=2.5), TypeError, "growth_interval"),
        (dict(hysteresis=0), ValueError, "hysteresis"),
        (dict(min_scale=-1.0), ValueError, "min_scale"),
        (dict(min_scale=4.0, max_scale=2.0, init_scale=4.0), ValueError, "max_scale"),
        (dict(init_scale=0.5, min_scale=1.0), ValueError, "init_scale"),
        (dict(init_scale=2.0**30), ValueError, "max_scale"),
        (dict(on_min_scale="explode"), ValueError, "on_min_scale"),
        (dict(min_patience=0), ValueError, "min_patience"),
        (dict(consecutive_hysteresis="yes"), TypeError, "consecutive_hysteresis"),
    ],
)
def test_invalid_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DynamicLossScaler(**kwargs)


def test_static_invalid():
    with pytest.raises(ValueError, match="init_scale"):
        StaticLossScaler(-2.0)


# ---------------------------------------------------------------------------------- distributed
def _overflow_on_one_rank(rank: int, world_size: int, bad_rank: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).half()
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1000)
    per_step = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = model(torch.ones(2, 8, dtype=torch.float16)).float().sum()
        scaler.scale(loss).backward()
        if rank == bad_rank and step == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        per_step.append((changed, scaler.get_scale(), scaler.last_found_inf))
    return per_step, scaler.steps_skipped


@pytest.mark.parametrize("world_size", [2, 4])
def test_overflow_on_one_rank_skips_on_every_rank(dist_run, world_size):
    out = dist_run(_overflow_on_one_rank, world_size, world_size - 1, timeout=90)
    for per_step, skipped in out:
        # step 1 overflowed on the last rank only: every rank's parameters stay bit-identical through it
        assert [all(changed) for changed, _, _ in per_step] == [True, False, True]
        assert [any(changed) for changed, _, _ in per_step] == [True, False, True]
        assert [scale for _, scale, _ in per_step] == [1024.0, 512.0, 512.0]
        assert [found for _, _, found in per_step] == [False, True, False]
        assert skipped == 1


def test_stale_master_grads_after_a_skip_are_not_reused():
    """A skipped step's inf master gradients must not leak into the next iteration, even when the user clears
    gradients with model.zero_grad() instead of the optimizer's zero_grad()."""
    model = torch.nn.Linear(2, 1).half()
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    s = DynamicLossScaler(init_scale=8.0, growth_interval=100)
    model(torch.ones(1, 2, dtype=torch.float16)).float().sum().backward()
    model.weight.grad.fill_(float("inf"))
    s.step(opt)
    s.update()
    assert s.last_found_inf
    model.zero_grad()
    s.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    assert not s.has_overflow(opt)
    before = model.weight.detach().clone()
    s.step(opt)
    s.update()
    assert not s.last_found_inf and not torch.equal(before, model.weight.detach())


def test_no_floor_still_stops_at_fp32_smallest_normal():
    s = DynamicLossScaler(init_scale=1.0, min_scale=None, min_patience=5, on_min_scale="ignore")
    scales = _drive(s, [True] * 140)
    assert min(scales) == 2.0**-126 and all(x > 0 for x in scales)
    assert s.total_overflows_at_floor == 140 - 126
    with pytest.raises(LossScaleFloorError, match="smallest normal"):
        _drive(DynamicLossScaler(init_scale=2.0**-125, min_scale=None, min_patience=2), [True] * 4)
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=1e-40, min_scale=None)


def test_update_flag_tensor_any_element_counts():
    s = DynamicLossScaler(init_scale=8.0, min_scale=None)
    s.update(found_inf=torch.tensor([0.0, 1.0]))
    assert s.last_found_inf and s.get_scale() == 4.0
    s.update(found_inf=torch.tensor([0.0, float("nan")]))
    assert s.last_found_inf
    s.update(found_inf=torch.zeros(3))
    assert not s.last_found_inf


def test_load_state_dict_validates_values():
    s = DynamicLossScaler()
    sd = s.state_dict()
    with pytest.raises(ValueError, match="growth_factor"):
        s.load_state_dict({**sd, "growth_factor": 0.5})
    with pytest.raises(ValueError, match="min_scale"):
        s.load_state_dict({**sd, "min_scale": -1.0})
    with pytest.raises(ValueError, match="scale"):
        s.load_state_dict({**sd, "scale": float("nan")})
