"""EmulatedLinear and emulate_linear_layers: drop-in behaviour, forward and gradients against float64 autograd
within the model's bound, swapping and restoring, and the training-loss gap of FC layers with fp16 accumulation."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from emulate_reference import ref_matmul_element, ref_round
from mixprec.emulate import EmulatedLinear, MatmulModel, bounds, emulate_linear_layers, get_matmul_model, round_to

U32 = 2.0**-24


def test_state_dict_keys_and_from_linear_share_parameters():
    lin = nn.Linear(6, 3)
    emu = EmulatedLinear.from_linear(lin, "fp16/16")
    assert list(emu.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    assert emu.weight is lin.weight and emu.bias is lin.bias
    nobias = EmulatedLinear.from_linear(nn.Linear(6, 3, bias=False), "fp16/32")
    assert nobias.bias is None and list(nobias.state_dict()) == ["weight"]
    fresh = EmulatedLinear(6, 3, mode="bf16/32")
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh.weight, lin.weight)
    assert "mode='bf16/32'" in repr(fresh)


@pytest.mark.parametrize("mode", ["fp16/16", "two_stage", "bf16/32", "fp8/promote128"])
def test_forward_and_gradients_within_the_models_bound(mode):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = EmulatedLinear(40, 24, mode=mode)
    x = torch.randn(8, 3, 40, generator=gen, requires_grad=True)
    c = torch.randn(8, 3, 24, generator=gen)  # grad_y of loss = (y * c).sum()
    (layer(x) * c).sum().backward()

    # float64 autograd of the reference: the same rounded operands, exact arithmetic
    model = get_matmul_model(mode)
    w_r = round_to(layer.weight.detach(), model.inputs).double().requires_grad_()
    x_r = round_to(x.detach(), model.inputs).double().requires_grad_()
    y_ref = x_r @ w_r.t() + layer.bias.detach().double()
    (y_ref * c.double()).sum().backward()

    # |emulated - exact| <= bound(K) * (|A_r| |B_r|) + (rounding of grad_y to the input format: u_in |c| |B_r|)
    #                       + fp32 bias add / fp32 output of the cast (u32)
    u_in = model.inputs.unit_roundoff
    c_r = round_to(c, model.inputs).double()
    with torch.no_grad():
        y = layer(x).double()
        tol_y = bounds(40, mode).deterministic * (x_r.abs() @ w_r.abs().t()) + U32 * (y.abs() + 1e-30)
        assert bool(((y - y_ref).abs() <= tol_y).all())
    tol_x = bounds(24, mode).deterministic * (c_r.abs() @ w_r.abs()) + u_in * (c.double().abs() @ w_r.abs())
    assert bool(((x.grad.double() - x_r.grad).abs() <= tol_x + U32 * x_r.grad.abs()).all())
    c2, x2 = c.reshape(-1, 24).double(), x_r.detach().reshape(-1, 40)
    tol_w = bounds(24, mode).deterministic * (c_r.reshape(-1, 24).abs().t() @ x2.abs()) + u_in * (
        c2.abs().t() @ x2.abs()
    )
    assert bool(((layer.weight.grad.double() - w_r.grad).abs() <= tol_w + U32 * w_r.grad.abs()).all())
    # grad_b: an fp32 sum of the 24 rows of c, in whatever order torch sums: 23 additions, each within u32
    # relative, so |error| <= gamma_23(u32) * sum|c| (Higham, eq. 4.4), for any summation order
    gamma_23 = 23 * U32 / (1 - 23 * U32)
    assert bool(((layer.bias.grad.double() - c2.sum(0)).abs() <= gamma_23 * c2.abs().sum(0)).all())


def test_output_format_with_bias_rounds_once():
    # fp32 accumulator value 1 + 2**-11 (exact), bias 2**-12, fp16 output (spacing 2**-10 at 1):
    # one rounding of 1 + 3 * 2**-12 gives 1 + 2**-10; rounding the product first (1 + 2**-11 is a tie -> 1,
    # even) and then 1 + 2**-12 (-> 1) would give 1.
    layer = EmulatedLinear(2, 1, mode=MatmulModel(inputs="fp16", accumulator="fp32", output="fp16"))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 1.0]]))
        layer.bias.fill_(2.0**-12)
    assert layer(torch.tensor([[1.0, 2.0**-11]])).item() == 1 + 2.0**-10


@pytest.mark.parametrize(
    "model",
    [
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=4, output="bf16"),
        MatmulModel(inputs="bf16", accumulator="fp32", k_group=8, promote_every=16, output="fp16"),
    ],
    ids=lambda m: m.name,
)
def test_output_format_with_bias_matches_an_independent_reference(model):
    # reference: exact rational model of the accumulator (emulate_reference), + bias in numpy fp32 (the epilogue's
    # add), one exact rounding to the output format
    gen = torch.Generator().manual_seed(7)
    layer = EmulatedLinear(40, 6, mode=model)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(6, 40, generator=gen))
        layer.bias.copy_(torch.randn(6, generator=gen) * 3)
    x = torch.randn(5, 40, generator=gen)
    y = layer(x)
    xr, wr = round_to(x, model.inputs), round_to(layer.weight.detach(), model.inputs)
    out_fmt = get_matmul_model(model).output
    for i in range(5):
        for j in range(6):
            acc = ref_matmul_element(
                xr[i].tolist(),
                wr[j].tolist(),
                acc=model.accumulator,
                k_group=model.k_group,
                promote_every=model.promote_every,
            )
            with_bias = np.float32(acc) + np.float32(layer.bias[j].item())
            assert y[i, j].item() == ref_round(float(with_bias), out_fmt), (i, j)


def test_low_precision_parameters_and_inputs_keep_their_dtypes():
    layer = EmulatedLinear(16, 4, mode="fp16/16").half()
    x = torch.randn(5, 16).half().requires_grad_()
    y = layer(x)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float16 and layer.weight.grad.dtype == torch.float16
    # fp32 input with fp16 weights (mixprec.lab's model: fp32 residual stream, fp16 weights)
    assert layer(torch.randn(2, 16)).dtype == torch.float32


def test_emulate_linear_layers_swaps_shares_and_restores():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2, bias=False)))
    keys = list(model.state_dict())
    originals = [model[0], model[2][0], model[2][1]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap: must keep working
    swap = emulate_linear_layers(model, "fp16/32")
    assert swap.names == ["0", "2.0", "2.1"] and len(swap) == 3
    assert all(isinstance(m, EmulatedLinear) for m in (model[0], model[2][0], model[2][1]))
    assert list(model.state_dict()) == keys
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, before)
    swap.restore()
    assert [model[0], model[2][0], model[2][1]] == originals
    assert not torch.equal(originals[0].weight, before)  # the trained values are the originals' too
    with pytest.raises(RuntimeError, match="already"):
        swap.restore()
    with emulate_linear_layers(model, "two_stage") as again:
        assert isinstance(model[2][1], EmulatedLinear) and again.names
    assert type(model[2][1]) is nn.Linear  # restored on exit
    # already-emulated layers are left alone
    emulate_linear_layers(model, "fp16/16")
    assert emulate_linear_layers(model, "fp16/32").names == []


class _LoRALinear(nn.Linear):
    """A subclass with its own forward (an extra low-rank term): swapping it would silently drop that term."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.extra = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.extra


def test_only_exact_linear_by_default_include_for_subclasses():
    from mixprec.lab.model import Linear as LabLinear

    model = nn.Sequential(nn.Linear(4, 4), _LoRALinear(), LabLinear(4, 4))
    with pytest.warns(UserWarning, match=r"left 2 nn.Linear subclass.*_LoRALinear.*include="):
        swap = emulate_linear_layers(model, "fp16/32")
    assert swap.names == ["0"] and swap.skipped == ["1", "2"]
    assert type(model[1]) is _LoRALinear and type(model[2]) is LabLinear
    swap.restore()
    # the lab's Linear only casts its weights to the input's dtype (EmulatedLinear does too): include it
    with pytest.warns(UserWarning, match="left 1 "):
        swap = emulate_linear_layers(model, "fp16/32", include=(LabLinear,))
    assert swap.names == ["0", "2"] and isinstance(model[2], EmulatedLinear)
    swap.restore()
    # nn.MultiheadAttention's out_proj (a Linear subclass attention never calls) is skipped without a warning
    attn = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap = emulate_linear_layers(attn, "fp16/32")
    assert swap.names == ["1"] and swap.skipped == ["0.out_proj"]


def test_parametrized_layers_are_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    nn.utils.parametrizations.weight_norm(model[0])
    with pytest.raises(ValueError, match="parametrizations"):
        emulate_linear_layers(model, "fp16/32")
    assert not isinstance(model[0], EmulatedLinear)


def test_double_backward_is_refused():
    layer = EmulatedLinear(3, 2, mode="fp16/32")
    x = torch.randn(4, 3, requires_grad=True)
    (grad_x,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_x.sum().backward()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: emulate_linear_layers(nn.Linear(2, 2), "fp16/16"), ValueError, "wrap it"),
        (lambda: emulate_linear_layers("model", "fp16/16"), TypeError, "nn.Module"),
        (lambda: emulate_linear_layers(nn.Sequential(nn.Linear(2, 2)), "fp4"), ValueError, "mode"),
        (lambda: EmulatedLinear(3, 2)(torch.ones(2, 4)), ValueError, "expects input"),
        (lambda: EmulatedLinear.from_linear(nn.ReLU(), "fp16/16"), TypeError, "nn.Linear"),
        (
            lambda: emulate_linear_layers(nn.Sequential(nn.Linear(2, 2)), "fp16/16", include=[nn.Linear]),
            TypeError,
            "include",
        ),
        (
            lambda: emulate_linear_layers(nn.Sequential(nn.Linear(2, 2)), "fp16/16", include=(nn.ReLU,)),
            TypeError,
            "include",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _train(mode: str, seed: int) -> float:
    """Full-batch gradient descent on least squares with label noise; mean loss of the last 5 of 10 steps.

    X (n=1024, K=512) = sqrt(n) Q with orthonormal columns Q, rounded to fp16 (the data is fp16, as stored
    activations are): the Hessian 2 X^T X / n is ~2 I, so lr=0.5 reaches the fp32 noise floor
    sigma^2 (1 - K/n) = 3.2e-7 in two steps and the loss measures the floor each accumulator model adds."""
    n, k, sigma = 1024, 512, 8e-4
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    x = (q * math.sqrt(n)).float().half().float()
    w_true = torch.randn(k, 1, generator=gen) / math.sqrt(k)
    y = x @ w_true + sigma * torch.randn(n, 1, generator=gen)
    model = nn.Sequential(nn.Linear(k, 1, bias=False))
    nn.init.zeros_(model[0].weight)
    if mode != "fp32":
        emulate_linear_layers(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(10):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5


@pytest.mark.slow
def test_fp16_accumulation_opens_a_loss_gap_that_fp32_accumulation_closes():
    # Floors each model adds to fp32's sigma^2 (1 - K/n) = 3.2e-7, since X^T X / n = I makes the loss increase
    # |X d|^2 / n = |d|^2 for an error d in the weights and E[e^2] for an error e in the outputs:
    # - fp16/32: the forward rounds the K=512 weights (w ~ N(0, 1/K)) to fp16; errors uniform in +-u|w|,
    #   u = 2**-11: K E[(u w)^2] / 3 = u^2 / 3 = 2**-22 / 3 = 7.9e-8.
    # - fp16/16 adds the fp16 accumulator's 32 roundings (groups of 16) of partial sums acc_g, E[acc_g^2] = g / 32
    #   (|y| ~ 1): each a uniform error of variance spacing^2 / 12, spacing = 2**-10 2**floor(log2|acc|), and
    #   E[4**floor(log2|a|) / a^2] = 0.54 (Benford-distributed mantissa): 2**-20 * 0.54 / 12 * sum_g g / 32.
    # The models ignore the emulated backward products and error correlations: they hold within a factor 2
    # (measured gap / model: fp16/32 1.04, 1.01, 1.20 and fp16/16 1.30, 1.18, 1.26 for seeds 0, 1, 2).
    u = 2.0**-11
    model_32 = u**2 / 3
    model_16 = model_32 + (4 * u * u) * 0.54 / 12 * sum(g / 32 for g in range(1, 33))
    base = _train("fp32", seed=0)
    gap_16 = _train("fp16/16", seed=0) - base
    gap_32 = _train("fp16/32", seed=0) - base
    assert 0.5 * model_16 <= gap_16 <= 2 * model_16
    assert 0.5 * model_32 <= gap_32 <= 2 * model_32  # 10x below fp16/16's: fp32 accumulation closes the gap


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_empty_batch_and_empty_features_behave_as_nn_linear():
    torch.manual_seed(0)
    for shape, (fin, fout) in [((0, 4), (4, 3)), ((2, 0), (0, 3)), ((2, 4), (4, 0)), ((5, 0, 4), (4, 3))]:
        ref = nn.Linear(fin, fout)
        emu = EmulatedLinear.from_linear(ref, "fp16/32")
        x = torch.randn(*shape, requires_grad=True)
        y = emu(x)
        assert y.shape == ref(x).shape
        y.sum().backward()
        assert x.grad.shape == x.shape and emu.weight.grad.shape == emu.weight.shape
        if x.numel() == 0:
            assert torch.equal(emu.weight.grad, torch.zeros_like(emu.weight))


def test_zero_dim_input_raises_what_nn_linear_raises():
    x = torch.tensor(1.0)
    with pytest.raises(RuntimeError) as torch_error:
        nn.Linear(4, 3)(x)
    with pytest.raises(RuntimeError) as ours:
        EmulatedLinear(4, 3)(x)
    assert str(ours.value) == str(torch_error.value)


def test_parametrized_subclass_that_would_be_skipped_is_skipped():
    class Lora(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(Lora(4, 4), nn.Linear(4, 2))
    nn.utils.parametrizations.weight_norm(model[0])
    with pytest.warns(UserWarning, match="left 1"):
        swap = emulate_linear_layers(model, "fp16/32")
    assert swap.names == ["1"] and swap.skipped == ["0"]
