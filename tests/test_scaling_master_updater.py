"""fp32 master weights, fp32 grad-norm clipping, and the microbatch Updater."""

from __future__ import annotations

import io
import math

import pytest
import torch

from mixprec import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler, Updater
from mixprec.scaling import clip_grad_norm_, grad_norm

U32 = 2.0**-24  # unit roundoff of fp32


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the bound on the relative error of an n-term recursive sum."""
    return n * u / (1 - n * u)


# ------------------------------------------------------------------------------- master weights
def test_master_weights_keep_updates_fp16_would_round_away():
    # fp16 has 11 significant bits: at 1.0 the spacing is 2**-10, so an update of 1e-4 (< half a spacing)
    # is rounded away every time when stepping the fp16 parameter directly.
    lr, steps = 1e-4, 100
    plain = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    plain_opt = torch.optim.SGD([plain], lr=lr)
    model_p = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    master_opt = MasterWeightOptimizer([model_p], torch.optim.SGD, lr=lr)
    for _ in range(steps):
        plain.grad = torch.ones_like(plain)
        plain_opt.step()
        model_p.grad = torch.ones_like(model_p)
        master_opt.step()
    assert plain.item() == 1.0
    master = next(master_opt.master_params())
    assert master.dtype == torch.float32
    assert master.item() == pytest.approx(1.0 - lr * steps, rel=0, abs=steps * U32)
    # the model copy is the master rounded to nearest fp16
    assert model_p.item() == master.to(torch.float16).item()


def test_fp32_params_are_their_own_masters_and_groups_pass_through():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}], torch.optim.SGD, lr=0.1)
    masters = list(opt.master_params())
    assert masters[0] is a and masters[1] is not b and masters[1].dtype == torch.float32
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.5]
    a.grad = torch.ones(2)
    b.grad = torch.ones(2, dtype=torch.bfloat16)
    opt.step()
    assert a.tolist() == [-1.0, -1.0] and b.tolist() == [-0.5, -0.5]


def test_master_state_dict_round_trip_restores_masters_and_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).half()
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 5).half()).float().sum().backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model2 = torch.nn.Linear(5, 3).half()
    opt2 = MasterWeightOptimizer(model2.parameters(), torch.optim.Adam, lr=1e-3)
    opt2.load_state_dict(loaded["opt"])
    for m1, m2 in zip(opt.master_params(), opt2.master_params()):
        assert torch.equal(m1, m2)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)  # the model is re-derived from the masters


def test_master_invalid_inputs():
    with pytest.raises(ValueError, match="params is empty"):
        MasterWeightOptimizer([], torch.optim.SGD, lr=1.0)
    with pytest.raises(TypeError, match="floating point"):
        MasterWeightOptimizer([torch.zeros(2, dtype=torch.int64)], torch.optim.SGD, lr=1.0)
    opt = MasterWeightOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD, lr=1.0)
    with pytest.raises(ValueError, match="master_params"):
        opt.load_state_dict({"optimizer": {}})


# ------------------------------------------------------------------------------- clipping
def test_grad_norm_in_fp32_when_fp16_norm_would_overflow():
    # each element 300: squares are 9e4 > fp16 max 65504, so a norm taken in fp16 overflows
    g = torch.full((1000,), 300.0, dtype=torch.float16)
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    p.grad = g.clone()
    exact = math.sqrt(1000) * 300.0
    total = grad_norm([p])
    assert total.dtype == torch.float32
    assert abs(total.item() - exact) <= gamma(1000) * exact
    clipped = clip_grad_norm_([p], max_norm=1.0)
    assert abs(clipped.item() - exact) <= gamma(1000) * exact
    # after clipping the fp16 gradient's norm is 1 up to fp16 rounding of each element (u16 = 2**-11)
    assert abs(grad_norm([p]).item() - 1.0) <= 2.0**-11 + gamma(1000)


def test_clip_leaves_nonfinite_gradients_alone():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    total = clip_grad_norm_([p], 1.0)
    assert math.isnan(total.item()) and p.grad[0].item() == 1.0
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([p], -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm([p], norm_type=-2.0)


# ------------------------------------------------------------------------------- updater
def _grads_via_updater(model, x, y, k: int) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []

    def capture(grads: list[torch.Tensor]) -> None:
        captured.extend(g.clone() for g in grads)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    up = Updater(
        model, opt, lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1]), num_microbatches=k, grad_reduce=capture
    )
    r = up.step(list(zip(x.chunk(k), y.chunk(k))))
    assert not r.skipped
    return captured


def test_microbatches_equal_one_large_batch_linear_componentwise_bound():
    torch.manual_seed(0)
    batch, fan_in, fan_out, k = 64, 16, 8, 4
    model = torch.nn.Linear(fan_in, fan_out)
    x, y = torch.randn(batch, fan_in), torch.randn(batch, fan_out)
    g1 = _grads_via_updater(model, x, y, 1)
    gk = _grads_via_updater(model, x, y, k)
    # Both compute sum_i x_i * r_i * 2/(B*out) with r_i = x_i w + b - y_i; k is a power of two so the
    # 1/k and 1/(B/k) factors are exact. They differ only in summation order and in how the fan-in
    # dot products are blocked, so |dg| <= 2 * gamma_{B + fan_in + 3} * sum_i |x_i| |r|_i-bound, where
    # |r_i| <= |x_i||w| + |b| + |y_i| (computed in float64).
    w, b = model.weight.detach().double(), model.bias.detach().double()
    xd, yd = x.double(), y.double()
    r_bound = (xd.abs() @ w.abs().T + b.abs() + yd.abs()) * 2 / (batch * fan_out)
    n = batch + fan_in + 3
    weight_bound = 2 * gamma(n) * (r_bound.T @ xd.abs())
    bias_bound = 2 * gamma(n) * r_bound.sum(0)
    assert torch.all((g1[0].double() - gk[0].double()).abs() <= weight_bound)
    assert torch.all((g1[1].double() - gk[1].double()).abs() <= bias_bound)
    # and the bound is not vacuous: the gradients are much larger than it
    assert weight_bound.max() < 1e-4 * g1[0].abs().max()


def test_microbatches_match_float64_reference_for_an_mlp():
    torch.manual_seed(1)
    batch, k, fan_in, width, fan_out = 64, 8, 10, 32, 3
    model = torch.nn.Sequential(torch.nn.Linear(fan_in, width), torch.nn.Tanh(), torch.nn.Linear(width, fan_out))
    ref = torch.nn.Sequential(torch.nn.Linear(fan_in, width), torch.nn.Tanh(), torch.nn.Linear(width, fan_out)).double()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(batch, fan_in), torch.randn(batch, fan_out)
    gk = _grads_via_updater(model, x, y, k)
    torch.nn.functional.mse_loss(ref(x.double()), y.double()).backward()
    # First-order componentwise bound, from the "absolute-value network": every fp32 operation errs by at most
    # u times the magnitude it computes, and those magnitudes are bounded by running the network on |W|, |b|,
    # |x|, |y| with |tanh(z)| <= |z| and |tanh'| <= 1. Each gradient element is then off by at most gamma_N times
    # its absolute-network value, N the longest accumulation chain (the batch sum plus the fan-ins plus a few
    # elementwise ops). A perturbed pre-activation h also perturbs tanh'(h) by |tanh''| <= 0.77 times its error,
    # which scales the bound by (1 + 0.77 max|h|).
    w1, b1 = ref[0].weight.detach().abs(), ref[0].bias.detach().abs()
    w2, b2 = ref[2].weight.detach().abs(), ref[2].bias.detach().abs()
    xa, ya = x.double().abs(), y.double().abs()
    h = xa @ w1.T + b1  # (B, width)
    out = h @ w2.T + b2  # (B, fan_out)
    d_out = 2 * (out + ya) / (batch * fan_out)
    d_h = d_out @ w2  # |tanh'| <= 1
    g_abs = [d_h.T @ xa, d_h.sum(0), d_out.T @ h, d_out.sum(0)]
    n = batch + fan_in + width + fan_out + 8
    factor = gamma(n) * (1 + 0.77 * h.max().item())
    for g, p, bound in zip(gk, ref.parameters(), g_abs):
        assert torch.all((g.double() - p.grad).abs() <= factor * bound)
    # not vacuous: the bound is a small fraction of the gradients' size
    assert factor * g_abs[0].max() < 1e-3 * ref[0].weight.grad.abs().max()


def test_updater_skips_and_retries_at_smaller_scale():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).half()
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.01)

    def loss_fn(m, mb):
        # inputs of 256: at scale 2**15 the fp16 backward overflows (256 * 2**15 * ... > 65504)
        return m(mb).float().sum()

    x = torch.full((2, 4), 256.0, dtype=torch.float16)
    no_retry = Updater(model, opt, loss_fn, scaler=DynamicLossScaler(init_scale=2.0**15), num_microbatches=1)
    r = no_retry.step([x])
    assert r.skipped and r.retries == 0 and r.grad_norm is None and r.scale == 2.0**15
    scaler = DynamicLossScaler(init_scale=2.0**15)
    retry = Updater(model, opt, loss_fn, scaler=scaler, num_microbatches=1, max_retries=20, clip_grad_norm=1.0)
    before = model.weight.detach().clone()
    r = retry.step([x])
    assert not r.skipped and r.retries >= 1 and r.scale == 2.0**15 / 2**r.retries
    assert r.grad_norm is not None and math.isfinite(r.grad_norm)
    assert not torch.equal(before, model.weight.detach())
    assert scaler.steps_skipped == r.retries and scaler.steps_taken == 1


def test_updater_reports_nan_loss_as_a_skip_not_a_silent_update():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    up = Updater(model, opt, lambda m, mb: m(mb).sum() * float("nan"))
    before = model.weight.detach().clone()
    r = up.step([torch.ones(2, 3)])
    assert r.skipped and torch.equal(before, model.weight.detach())


def test_updater_weight_decay_is_l2_on_the_gradient():
    p = torch.nn.Parameter(torch.tensor([2.0]))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = p

    m = M()
    opt = torch.optim.SGD([p], lr=0.1)
    up = Updater(m, opt, lambda mod, mb: mod.p.sum() * 0.0, scaler=StaticLossScaler(8.0), weight_decay=0.5)
    up.step([None])
    assert p.item() == pytest.approx(2.0 - 0.1 * 0.5 * 2.0)


def test_updater_argument_checks():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="num_microbatches"):
        Updater(model, opt, lambda m, b: m(b).sum(), num_microbatches=0)
    with pytest.raises(TypeError, match="model"):
        Updater("model", opt, lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="max_retries"):
        Updater(model, opt, lambda m, b: m(b).sum(), max_retries=-1)
    up = Updater(model, opt, lambda m, b: m(b).sum(), num_microbatches=2)
    with pytest.raises(ValueError, match="num_microbatches is 2"):
        up.step([torch.ones(1, 2)])
    up1 = Updater(model, opt, lambda m, b: m(b))
    with pytest.raises(TypeError, match="scalar"):
        up1.step([torch.ones(3, 2)])


class _FakeDDP(torch.nn.Module):
    """Counts which microbatches ran under no_sync()."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.in_no_sync = False
        self.synced_calls: list[bool] = []

    def forward(self, x):
        self.synced_calls.append(not self.in_no_sync)
        return self.inner(x)

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.in_no_sync = True
            try:
                yield
            finally:
                self.in_no_sync = False

        return ctx()


def test_updater_uses_no_sync_for_all_but_the_last_microbatch():
    model = _FakeDDP(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    up = Updater(model, opt, lambda m, b: m(b).sum(), num_microbatches=4)
    up.step([torch.ones(1, 2)] * 4)
    assert model.synced_calls == [False, False, False, True]
