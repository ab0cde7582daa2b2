"""Skip-aware stepping (the scalers' and the Updater's record of whether the optimizer step ran, SkipAwareLR),
overflow reports that name the parameters (agreed across ranks, free on clean steps), the floor error's list of
the parameters that overflowed most, and the Updater's microbatch sum/mean option."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mixprec import DynamicLossScaler, LossScaleFloorError, MasterWeightOptimizer, StaticLossScaler, Updater
from mixprec.scaling import SkipAwareLR
from mixprec.scaling.scaler import LossScaler


class TwoLayer(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(3, 4).to(dtype)
        self.fc2 = torch.nn.Linear(4, 1).to(dtype)
        self.poison: set[str] = set()  # parameter names whose gradient becomes NaN in the next backward
        for name, p in self.named_parameters():
            p.register_hook(lambda g, name=name: g * math.nan if name in self.poison else g)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _loss(model, mb):
    return model(mb).float().mean()


def _one_step(scaler, opt, model, poison=()):
    model.poison = set(poison)
    opt.zero_grad()
    scaler.scale(_loss(model, torch.ones(2, 3, dtype=model.fc1.weight.dtype))).backward()
    result = scaler.step(opt)
    scaler.update()
    return result


# ---------------------------------------------------------------------------------- skipped or taken
@pytest.mark.parametrize("cls", [DynamicLossScaler, StaticLossScaler])
def test_step_and_update_record_whether_the_step_ran(cls):
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls(8.0) if cls is StaticLossScaler else cls(init_scale=8.0)
    scaler.name_parameters(model)
    assert scaler.last_step_skipped is None
    assert _one_step(scaler, opt, model) is None  # SGD.step returns None: the return value cannot tell
    assert scaler.last_step_skipped is False
    assert _one_step(scaler, opt, model, poison={"fc1.bias"}) is None
    assert scaler.last_step_skipped is True and scaler.last_culprits == ("fc1.bias",)
    _one_step(scaler, opt, model)
    assert scaler.last_step_skipped is False and scaler.last_culprits == ()  # never sticky


def test_skip_aware_lr_advances_only_on_taken_steps_and_does_not_warn():
    model = TwoLayer(torch.float16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=1000)
    scaler.name_parameters(model)
    sched = SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5), scaler)
    lrs = []
    with warnings.catch_warnings():
        # torch warns "Detected call of lr_scheduler.step() before optimizer.step()" when the first step is
        # skipped and the scheduler advances anyway
        warnings.simplefilter("error")
        for poison in ({"fc2.weight"}, set(), {"fc1.weight"}, set(), set()):
            _one_step(scaler, opt, model, poison)
            advanced = sched.step()
            assert advanced == (not poison)
            lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.125]
    assert sched.steps_skipped == 2
    again = SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5), scaler)
    again.load_state_dict(sched.state_dict())
    assert again.steps_skipped == 2 and again.last_epoch == sched.last_epoch


def test_skip_aware_lr_argument_errors():
    scaler = StaticLossScaler(1.0)
    with pytest.raises(TypeError, match="scheduler"):
        SkipAwareLR(object(), scaler)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1)
    with pytest.raises(TypeError, match="scaler must be a mixprec loss scaler"):
        SkipAwareLR(sched, torch.amp.GradScaler("cpu"))


def test_updater_reports_skips_and_culprits_by_module_path():
    model = TwoLayer(torch.float16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    up = Updater(model, opt, _loss, scaler=DynamicLossScaler(init_scale=8.0), num_microbatches=2)
    sched = SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5), up.scaler)
    batch = [torch.ones(2, 3, dtype=torch.float16)] * 2
    model.poison = {"fc2.bias", "fc1.weight"}
    r = up.step(batch)
    assert r.skipped and r.culprits == ("fc1.weight", "fc2.bias") and not sched.step()
    model.poison = set()
    r = up.step(batch)
    assert not r.skipped and r.culprits == () and sched.step()


# ---------------------------------------------------------------------------------- free fast path
def test_clean_steps_never_look_for_culprits(monkeypatch):
    calls = []
    original = LossScaler._agreed_culprits

    def counting(self, optimizer):
        calls.append(1)
        return original(self, optimizer)

    monkeypatch.setattr(LossScaler, "_agreed_culprits", counting)
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.name_parameters(model.named_parameters())
    for _ in range(5):
        _one_step(scaler, opt, model)
    assert calls == []
    _one_step(scaler, opt, model, poison={"fc2.weight"})
    assert calls == [1] and scaler.last_culprits == ("fc2.weight",)


def test_unnamed_parameters_are_reported_by_position():
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    _one_step(scaler, opt, model, poison={"fc2.bias"})
    assert scaler.last_culprits == ("param_groups[0][3] (1,)",)


# ---------------------------------------------------------------------------------- floor error
def test_floor_error_names_the_parameters_that_overflowed_most():
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, min_patience=3, growth_interval=50)
    scaler.name_parameters(model)
    with pytest.raises(LossScaleFloorError) as info:
        for step in range(20):
            _one_step(scaler, opt, model, poison={"fc2.weight"} if step % 3 else {"fc2.weight", "fc1.bias"})
    msg = str(info.value)
    assert "over the last 50 iterations" in msg
    assert msg.index("fc2.weight (5x)") < msg.index("fc1.bias (2x)")


# ---------------------------------------------------------------------------------- across ranks
def _nan_in_one_rank(rank: int, world_size: int):
    model = TwoLayer(torch.float16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    up = Updater(model, opt, _loss, scaler=DynamicLossScaler(init_scale=8.0))
    results = []
    for step in range(3):
        model.poison = {"fc1.weight"} if (rank == 1 and step == 1) else set()
        r = up.step([torch.ones(2, 3, dtype=torch.float16)])
        results.append((r.skipped, r.culprits))
    return results


def test_culprits_are_agreed_across_ranks(dist_run):
    out = dist_run(_nan_in_one_rank, 2, timeout=90)
    want = [(False, ()), (True, ("fc1.weight",)), (False, ())]
    assert out == [want, want]  # rank 0's gradients were finite: it names rank 1's culprit too


# ---------------------------------------------------------------------------------- sum or mean
def test_microbatch_sum_is_num_microbatches_times_the_mean_and_lr_compensates():
    batches = [torch.randn(3, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    weights = {}
    for reduction, lr in (("mean", 0.1), ("sum", 0.1 / 4)):
        model = TwoLayer()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        up = Updater(model, opt, _loss, num_microbatches=4, microbatch_reduction=reduction)
        r = up.step(batches)
        weights[reduction] = ([p.detach().clone() for p in model.parameters()], r.grad_norm, r.loss)
    (w_mean, norm_mean, loss_mean), (w_sum, norm_sum, loss_sum) = weights["mean"], weights["sum"]
    # 4 is a power of two: dividing the loss by it, and lr / 4 * (4 g), are exact, so the weights agree bitwise
    assert all(torch.equal(a, b) for a, b in zip(w_mean, w_sum, strict=True))
    assert norm_sum == pytest.approx(4 * norm_mean, rel=2**-20) and loss_sum == loss_mean
    with pytest.raises(ValueError, match="microbatch_reduction"):
        Updater(TwoLayer(), opt, _loss, microbatch_reduction="average")
