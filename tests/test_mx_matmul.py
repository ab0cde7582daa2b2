"""Block-scaled matmuls and the MXFP8 / NVFP4 recipes of EmulatedLinear: bit-exact against an independent loop over
block products (exact rationals), within gamma_n of a float64 reference, accumulator models that differ where they
should, and recipe GEMMs rebuilt operand by operand from the documented axes, tiles, Hadamard and rounding."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch
from torch import nn

from emulate_reference import ref_matmul_element, ref_round
from mixprec.emulate import (
    EmulatedLinear,
    FloatFormat,
    bounds,
    emulate_linear_layers,
    get_matmul_model,
    get_recipe,
    hadamard_transform,
    matmul,
    matmul_block_scaled,
    mx_quantize,
    random_signs,
)
from mixprec.emulate.mx_matmul import block_accumulator_model

FP32 = FloatFormat(8, 23)
U32 = 2.0**-24


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _expand(q) -> torch.Tensor:
    s = q.scales.double()
    for d, b in zip(q.axis, q.block_size, strict=True):
        s = s.repeat_interleave(b, dim=d)
    return s


def _deq64(q) -> torch.Tensor:
    """elements * block scale * tensor scale, exactly, in fp64 (no fp32 rounding of the two-level scale)."""
    out = q.elements.double() * _expand(q)
    return out if q.tensor_scale is None else out * q.tensor_scale.double()


def _data(shape, gen, spread=6.0):
    """Normal values times per-element magnitudes spread over 2**-spread..2**spread (blocks get different scales)."""
    return torch.randn(shape, generator=gen) * torch.exp2(torch.empty(shape).uniform_(-spread, spread, generator=gen))


# ------------------------------------------------------------------------------------------------ bit-exact
def _ref_block_fp32(qa, qb, kb: int) -> list[list[float]]:
    """Independent loop: block products from raw elements and scales as exact rationals, each added to an fp32
    accumulator in K order with one rounding (nearest even)."""
    ea, eb = qa.elements.tolist(), qb.elements.tolist()
    sa, sb = qa.scales.tolist(), qb.scales.tolist()
    m, k = len(ea), len(ea[0])
    n = len(eb[0])
    out = []
    for i in range(m):
        row = []
        for j in range(n):
            acc = 0.0
            for blk in range(k // kb):
                dot = sum(Fraction(ea[i][e]) * Fraction(eb[e][j]) for e in range(blk * kb, (blk + 1) * kb))
                acc = ref_round(Fraction(acc) + dot * Fraction(sa[i][blk]) * Fraction(sb[blk][j]), FP32)
            row.append(acc)
        out.append(row)
    return out


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4_e2m1", "nvfp4"])
def test_fp32_accumulator_is_bit_exact_with_an_independent_block_loop(fmt):
    gen = torch.Generator().manual_seed(1)
    kb = 16 if fmt == "nvfp4" else 32
    a, b = _data((5, 6 * kb), gen), _data((6 * kb, 4), gen)
    qa = mx_quantize(a, fmt, axis=-1)
    qb = mx_quantize(b, fmt, axis=0)
    y = matmul_block_scaled(qa, qb, "fp32")
    ref = torch.tensor(_ref_block_fp32(qa, qb, kb), dtype=torch.float32)
    assert torch.equal(y, ref)
    # the public entry point quantizes the same way (default scale mode) and gives the same bits
    assert torch.equal(matmul(a, b, inputs=fmt, accumulator="fp32"), y)
    assert torch.equal(matmul(a, b, inputs=fmt), y)


def test_scales_are_applied_per_block_product():
    # block 0 of the row has scale 2**-20 against the column's 1; block 1 the reverse: dequantize-free sums differ
    a = torch.cat([torch.full((1, 32), 2.0**-20), torch.full((1, 32), 1.0)], 1)
    b = torch.cat([torch.full((32, 1), 1.0), torch.full((32, 1), 2.0**-20)], 0)
    qa, qb = mx_quantize(a, "mxfp8_e4m3"), mx_quantize(b, "mxfp8_e4m3", axis=0)
    assert qa.scales.tolist()[0] != qb.scales[:, 0].tolist()
    y = matmul_block_scaled(qa, qb)
    assert y.item() == 64 * 2.0**-20


def test_nvfp4_tensor_scales_multiply_the_result_once():
    gen = torch.Generator().manual_seed(2)
    a, b = _data((4, 64), gen, 3), _data((64, 3), gen, 3)
    ta, tb = a.abs().max() / 2688, b.abs().max() / 2688
    qa = mx_quantize(a, "nvfp4", tensor_scale=ta)
    qb = mx_quantize(b, "nvfp4", axis=0, tensor_scale=tb)
    y = matmul_block_scaled(qa, qb, "fp32")
    one_a = type(qa)(qa.elements, qa.scales, None, qa.fmt, qa.block_size, qa.axis, qa.scale_mode)
    one_b = type(qb)(qb.elements, qb.scales, None, qb.fmt, qb.block_size, qb.axis, qb.scale_mode)
    inner = matmul_block_scaled(one_a, one_b, "fp32")
    assert torch.equal(y, inner * (qa.tensor_scale * qb.tensor_scale))


# ------------------------------------------------------------------------------------------------ fp64 oracle
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"])
@pytest.mark.parametrize("acc", ["fp32", "fp8/promote128", "blackwell"])
def test_within_the_error_bound_of_a_float64_reference(fmt, acc):
    gen = torch.Generator().manual_seed(3)
    k = 512
    a, b = _data((12, k), gen), _data((k, 10), gen)
    qa, qb = mx_quantize(a, fmt), mx_quantize(b, fmt, axis=0)
    y = matmul_block_scaled(qa, qb, acc).double()
    da, db = _deq64(qa), _deq64(qb)
    ref, mag = da @ db, da.abs() @ db.abs()
    model = block_accumulator_model(acc, fmt)
    det = bounds(k, model).deterministic
    if acc == "fp32":
        # gamma_n for the n = K / block block products added in fp32 (Higham, eq. 3.5)
        assert det == pytest.approx(_gamma(k // qa.block_size[0], U32), rel=1e-12)
    err = (y - ref).abs()
    assert bool((err <= det * mag).all()), float((err / mag).max())
    if fmt == "mxfp8_e4m3":  # fp4 block products of this data are coarse enough to sum exactly in fp32
        assert float((err / mag).max()) > det / 1e4  # the check sees the rounding (not vacuous)


def test_hopper_promotion_loses_bits_that_fp32_keeps():
    # one large block, then 3 blocks of small products: inside Hopper's 13-bit fp8 accumulator (promoted every 128)
    # the small products fall below the alignment window; fp32 keeps them
    a = torch.ones(1, 128)
    b = torch.cat([torch.full((32, 1), 256.0), torch.full((96, 1), 2.0**-6 * 1.125)])
    qa, qb = mx_quantize(a, "mxfp8_e4m3"), mx_quantize(b, "mxfp8_e4m3", axis=0)
    exact = float((_deq64(qa) @ _deq64(qb)).item())
    fp32 = matmul_block_scaled(qa, qb, "fp32").item()
    hopper = matmul_block_scaled(qa, qb, "fp8/promote128").item()
    assert fp32 == exact  # 8192 + 96 * 2**-6 * 1.125: exact in fp32
    assert abs(hopper - exact) > 1.0  # the small blocks are lost
    # and it is the existing Hopper model applied to the block products, step for step
    model = block_accumulator_model("fp8/promote128", "mxfp8_e4m3")
    ea = (qa.elements.double() * _expand(qa))[0].tolist()
    eb = (qb.elements.double() * _expand(qb))[:, 0].tolist()
    ref = ref_matmul_element(ea, eb, acc=FP32, k_group=32, promote_every=128, align_bits=model.align_bits)
    assert hopper == ref


def test_promotion_every_128_recovers_what_one_long_chain_loses():
    # 4 windows of 128: the large block sits in the first; later windows start from zero in the limited accumulator
    a = torch.ones(1, 512)
    b = torch.cat([torch.full((32, 1), 256.0), torch.full((480, 1), 2.0**-6 * 1.125)])
    qa, qb = mx_quantize(a, "mxfp8_e4m3"), mx_quantize(b, "mxfp8_e4m3", axis=0)
    exact = float((_deq64(qa) @ _deq64(qb)).item())
    hopper = matmul_block_scaled(qa, qb, "fp8/promote128").item()
    nopromote = matmul_block_scaled(qa, qb, get_matmul_model("fp8/nopromote")).item()
    assert abs(hopper - exact) < abs(nopromote - exact)


def test_blackwell_truncates_where_fp32_rounds_to_nearest():
    gen = torch.Generator().manual_seed(4)
    a, b = _data((16, 256), gen, 2), _data((256, 16), gen, 2)
    qa, qb = mx_quantize(a, "mxfp8_e4m3"), mx_quantize(b, "mxfp8_e4m3", axis=0)
    fp32 = matmul_block_scaled(qa, qb, "fp32")
    bw = matmul_block_scaled(qa, qb, "blackwell")
    assert not torch.equal(fp32, bw)
    # round toward zero each instruction: |blackwell| <= |fp32 result| more often than not
    shrink = (bw.abs() < fp32.abs()).sum().item()
    grow = (bw.abs() > fp32.abs()).sum().item()
    assert shrink > 3 * grow


# An independent transcription (exact rationals, one output at a time) of MMA-Sim's tcgen05 block-scaled MMA
# (microsoft/MMA-Sim, commit 16a01880, mmasim/simulator/functions.py: nv_fused_dot_add for kind::mxf8f6f4 and
# nv_fused_dot_add_with_block_scale for kind::mxf4*; nv.py: TCGen05MMASim, 25 and 35 fraction bits), chained
# over K through the fp32 accumulator.
def _sig_exp(x: float, emin: int) -> tuple[Fraction, int]:
    if x == 0:
        return Fraction(0), -999
    m, e = math.frexp(abs(x))
    e -= 1
    sig = Fraction(m) * 2
    if e < emin:
        sig, e = sig * Fraction(2) ** (e - emin), emin
    return (sig if x > 0 else -sig), e


def _fused(sigs, exps, bits: int) -> Fraction:
    top = max(exps)
    total = sum(Fraction(math.trunc(sg * Fraction(2) ** (bits + ex - top))) for sg, ex in zip(sigs, exps, strict=True))
    return total * Fraction(2) ** (top - bits)


def _rz32(v: Fraction) -> float:
    if v == 0:
        return 0.0
    sig, e = _sig_exp(float(v), -126)  # v has at most ~50 significant bits here: float(v) is exact
    return float(Fraction(math.trunc(sig * 2**23), 2**23) * Fraction(2) ** e)


def _mmasim_element(ea, eb, sa, sb, fmt) -> float:
    elem_emin = {"mxfp8_e4m3": -6, "mxfp8_e5m2": -14, "mxfp6_e2m3": 0, "mxfp6_e3m2": -2}.get(fmt)
    scale_emin = -6 if fmt == "nvfp4" else -127
    acc = 0.0
    if elem_emin is not None:  # kind::mxf8f6f4: K = 32 (one block), element products at nominal exponents
        for blk in range(len(ea) // 32):
            sig_c, e_c = _sig_exp(acc, -126)
            _, e_sa = _sig_exp(sa[blk * 32], scale_emin)
            _, e_sb = _sig_exp(sb[blk * 32], scale_emin)
            sigs, exps = [sig_c], [e_c]
            for i in range(blk * 32, blk * 32 + 32):
                s1, e1 = _sig_exp(ea[i], elem_emin)
                s2, e2 = _sig_exp(eb[i], elem_emin)
                sigs.append(s1 * s2)
                exps.append(e1 + e2 + e_sa + e_sb)
            acc = _rz32(_fused(sigs, exps, 25))
        return acc
    for inst in range(0, len(ea), 64):  # kind::mxf4 / mxf4nvf4: K = 64, 16-element sub-block sums
        sig_c, e_c = _sig_exp(acc, -126)
        sigs, exps = [sig_c], [e_c]
        for k0 in range(inst, min(inst + 64, len(ea)), 16):
            dot = sum(Fraction(ea[i]) * Fraction(eb[i]) for i in range(k0, k0 + 16))
            s0, e0 = _sig_exp(sa[k0], scale_emin)
            s1, e1 = _sig_exp(sb[k0], scale_emin)
            sigs.append(dot * s0 * s1)
            exps.append(e0 + e1)
        acc = _rz32(_fused(sigs, exps, 35))
    return acc


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4_e2m1", "nvfp4"])
@pytest.mark.parametrize("spread", [2, 30])
def test_blackwell_is_bit_exact_with_a_transcription_of_mma_sim(fmt, spread):
    gen = torch.Generator().manual_seed(12)
    k = 208 if fmt == "nvfp4" else 192  # NVFP4: 13 sub-blocks, the last mxf4 instruction partial
    a, b = _data((6, k), gen, spread), _data((k, 5), gen, spread)
    qa, qb = mx_quantize(a, fmt), mx_quantize(b, fmt, axis=0)
    bw = matmul_block_scaled(qa, qb, "blackwell")
    sa, sb = _expand(qa), _expand(qb)
    ea, eb = qa.elements.tolist(), qb.elements.t().tolist()
    sa, sb = sa.tolist(), sb.t().tolist()
    ref = [[_mmasim_element(ea[i], eb[j], sa[i], sb[j], fmt) for j in range(5)] for i in range(6)]
    assert torch.equal(bw, torch.tensor(ref, dtype=torch.float32))
    # the same model through the public entry point, with a batch
    out = matmul(torch.stack([a, a]), b, inputs=fmt, accumulator="blackwell")
    assert torch.equal(out, torch.stack([bw, bw]))


# ------------------------------------------------------------------------------------------------ API errors
def test_matmul_refuses_bad_block_arguments():
    a, b = torch.randn(2, 48), torch.randn(48, 3)
    with pytest.raises(ValueError, match="K"):
        matmul(a, b, inputs="mxfp8_e4m3")
    with pytest.raises(ValueError, match="mode"):
        matmul(torch.randn(2, 64), torch.randn(64, 3), inputs="mxfp8_e4m3", mode="fp16/32")
    with pytest.raises(ValueError, match="accumulator"):
        matmul(torch.randn(2, 64), torch.randn(64, 3), inputs="mxfp8_e4m3", accumulator="fp16")


# ------------------------------------------------------------------------------------------------ recipes
def _run(layer, x, c):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * c).sum().backward()
    return y.detach(), x.grad.clone(), layer.weight.grad.clone()


def _within(got, ref, mag, det):
    err = (got.double() - ref).abs()
    assert bool((err <= det * mag + 1e-300).all()), float((err / mag).max())


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_recipe_gemms_are_the_documented_quantized_products(name):
    recipe = get_recipe(name)
    m, k, n = 64, 64, 96
    gen = torch.Generator().manual_seed(5)
    x, c = _data((m, k), gen, 3), _data((m, n), gen, 3)
    torch.manual_seed(0)
    layer = EmulatedLinear(k, n, bias=False, mode=name, generator=torch.Generator().manual_seed(9))
    y, gx, gw = _run(layer, x, c)
    w = layer.weight.detach()

    # rebuild every operand from the table in mixprec.emulate.recipes, drawing in the same order
    g = torch.Generator().manual_seed(9)
    fmt, sm = recipe.fmt, recipe.scale_mode
    two = name == "nvfp4"

    def ts(t):
        return t.abs().max() / 2688 if two else None

    sr = "stochastic" if two else "nearest"
    qx = mx_quantize(x, fmt, scale_mode=sm, axis=1, tensor_scale=ts(x))
    if two:
        qw_f = qw_d = mx_quantize(w, fmt, block_size=(16, 16), tensor_scale=ts(w))
    else:
        qw_f, qw_d = mx_quantize(w, fmt, scale_mode=sm, axis=1), mx_quantize(w, fmt, scale_mode=sm, axis=0)
    qgy = mx_quantize(c, fmt, scale_mode=sm, axis=1, rounding=sr, generator=g, tensor_scale=ts(c))
    cw, xw = c, x
    if two:
        signs = random_signs(16, generator=g)
        cw, xw = hadamard_transform(c, signs, axis=0), hadamard_transform(x, signs, axis=0)
    qgy_w = mx_quantize(cw, fmt, scale_mode=sm, axis=0, rounding=sr, generator=g, tensor_scale=ts(cw))
    qx_w = mx_quantize(xw, fmt, scale_mode=sm, axis=0, tensor_scale=ts(xw))

    u_alpha = 2 * U32 if two else 0.0  # fl32(ta * tb) and the product by it
    for got, a64, b64, kk in (
        (y, _deq64(qx), _deq64(qw_f).T, k),
        (gx, _deq64(qgy), _deq64(qw_d), n),
        (gw, _deq64(qgy_w).T, _deq64(qx_w), m),
    ):
        det = (1 + bounds(kk, block_accumulator_model("fp32", fmt)).deterministic) * (1 + u_alpha) ** 2 - 1
        _within(got, a64 @ b64, a64.abs() @ b64.abs(), det)


def test_mxfp8_gradients_within_the_quantization_bound_of_fp64_autograd():
    # e4m3 with a round-up (rceil) scale: |q(v) - v| <= 2**-4 |v| + 2**-10 X per element (half a unit at 3
    # fraction bits; half the subnormal spacing 2**-9 X), X <= 2 amax / 448 the block scale
    m, k, n = 64, 96, 64
    gen = torch.Generator().manual_seed(6)
    x, c = _data((m, k), gen, 4), _data((m, n), gen, 4)
    torch.manual_seed(1)
    layer = EmulatedLinear(k, n, mode="mxfp8")
    y, gx, gw = _run(layer, x, c)
    w64, x64, c64, b64 = layer.weight.double().detach(), x.double(), c.double(), layer.bias.double().detach()

    def err(t):
        return 2.0**-4 * t.abs() + 2.0**-10 * 2 * t.abs().max() / 448

    def bound(p, q, kk):
        ep, eq = err(p), err(q)
        quant = ep @ q.abs() + p.abs() @ eq + ep @ eq
        return quant + _gamma(kk // 32, U32) * (p.abs() + ep) @ (q.abs() + eq)

    _within(y, x64 @ w64.T + b64, bound(x64, w64.T, k), 1.0)
    _within(gx, c64 @ w64, bound(c64, w64, n), 1.0)
    _within(gw, c64.T @ x64, bound(c64.T, x64, m), 1.0)
    rel = ((gw.double() - c64.T @ x64).norm() / (c64.T @ x64).norm()).item()
    assert 1e-4 < rel < 2.0**-4  # quantized, and not by much


def test_nvfp4_stochastic_gradient_is_unbiased():
    # E[Q_sr(v)] = v for v inside the element range, and the scales do not depend on the draws; a block maximum
    # can exceed 6 scale units (the E4M3 scale rounds to nearest, possibly down) and is clipped first. So the mean
    # Dgrad over seeds tends to clip(dY) Q(W), clip at +-6 block-scale units.
    m, k, n = 16, 16, 32
    gen = torch.Generator().manual_seed(7)
    x, c = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    layer = EmulatedLinear(k, n, bias=False, mode="nvfp4")
    w = layer.weight.detach()
    qw = mx_quantize(w, "nvfp4", block_size=(16, 16), tensor_scale=w.abs().max() / 2688)
    nearest = mx_quantize(c, "nvfp4", tensor_scale=c.abs().max() / 2688)
    unit = _expand(nearest) * nearest.tensor_scale.double()
    clipped = (c.double() / unit).clamp(-6, 6) * unit
    target = clipped @ _deq64(qw)
    draws = 200
    total = torch.zeros(m, k, dtype=torch.float64)
    spread = torch.zeros(m, k, dtype=torch.float64)
    for s in range(draws):
        layer.generator = torch.Generator().manual_seed(100 + s)
        _, gx, _ = _run(layer, x, c)
        total += gx.double()
        spread += (gx.double() - target) ** 2
    mean = total / draws
    sd = (spread / draws).sqrt()
    # each mean within 5 standard errors (the per-element SR error is bounded, so this is a loose CLT check)
    assert bool(((mean - target).abs() <= 5 * sd / math.sqrt(draws) + 1e-6).all())
    biased = _deq64(nearest) @ _deq64(qw)
    assert (mean - target).abs().mean() < (biased - target).abs().mean()


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_recipe_is_bit_for_bit_deterministic_with_a_seeded_generator(name):
    gen = torch.Generator().manual_seed(8)
    x, c = torch.randn(2, 16, 64, generator=gen), torch.randn(2, 16, 32, generator=gen)
    torch.manual_seed(2)
    layer = EmulatedLinear(64, 32, mode=name)
    runs = []
    for seed in (11, 11, 12):
        layer.generator = torch.Generator().manual_seed(seed)
        layer.weight.grad = None
        layer.bias.grad = None
        runs.append(_run(layer, x, c))
    assert all(torch.equal(p, q) for p, q in zip(runs[0], runs[1], strict=True))
    differs = any(not torch.equal(p, q) for p, q in zip(runs[0][1:], runs[2][1:], strict=True))
    assert differs == (name == "nvfp4")  # only NVFP4 draws (stochastic rounding, Hadamard signs)


def test_recipe_refuses_shapes_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="in_features"):
        EmulatedLinear(48, 32, mode="mxfp8")
    with pytest.raises(ValueError, match="out_features"):
        EmulatedLinear(32, 24, mode="nvfp4")
    layer = EmulatedLinear(32, 32, mode="mxfp8")
    with pytest.raises(ValueError, match="x: the number of rows"):
        layer(torch.randn(3, 32))
    with torch.no_grad():  # inference contracts over in_features only: any number of rows
        assert layer(torch.randn(3, 32)).shape == (3, 32)
    with pytest.raises(ValueError, match=r"mode must be .*'nvfp4'; got 'mxfp9'"):
        EmulatedLinear(32, 32, mode="mxfp9")


def test_emulate_linear_layers_keeps_high_precision_and_misfit_layers():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 10))
    recipe = get_recipe("nvfp4").with_options(high_precision=("0",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swap = emulate_linear_layers(model, recipe)
    assert swap.names == ["2"]
    assert swap.kept == ["0", "3"]
    assert any("3 (32->10)" in str(w.message) for w in caught)
    assert isinstance(model[2], EmulatedLinear) and model[2].mode is recipe
    swap.restore()
    assert type(model[2]) is nn.Linear


def test_nvfp4_keeps_the_output_head_in_its_own_precision_by_default():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 64)

    model = Tiny()
    assert emulate_linear_layers(model, "nvfp4").kept == ["lm_head"]
    assert emulate_linear_layers(Tiny(), "mxfp8").names == ["body", "lm_head"]


def test_recipe_options_are_checked_and_hybrid_uses_e5m2_gradients():
    with pytest.raises(ValueError, match="accumulator"):
        get_recipe("mxfp8").with_options(accumulator="fp16")
    with pytest.raises(ValueError, match="grad_fmt"):
        get_recipe("mxfp8").with_options(grad_fmt="fp8_e5m2")
    with pytest.raises(ValueError, match="tensor_scale"):
        get_recipe("mxfp8").with_options(tensor_scale=True)
    with pytest.raises(TypeError, match="generator"):
        emulate_linear_layers(nn.Sequential(nn.Linear(32, 32)), "nvfp4", generator=0)
    gen = torch.Generator().manual_seed(10)
    x, c = torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)
    torch.manual_seed(3)
    e4m3 = EmulatedLinear(32, 32, mode="mxfp8")
    hybrid = EmulatedLinear(32, 32, mode=get_recipe("mxfp8").with_options(grad_fmt="mxfp8_e5m2"))
    hybrid.load_state_dict(e4m3.state_dict())
    y1, gx1, _ = _run(e4m3, x, c)
    y2, gx2, _ = _run(hybrid, x, c)
    assert torch.equal(y1, y2) and not torch.equal(gx1, gx2)  # forward E4M3 in both; dY in E5M2 only in hybrid
    w = e4m3.weight.detach()
    qg = mx_quantize(c, "mxfp8_e5m2", scale_mode="rceil", axis=1)
    qw = mx_quantize(w, "mxfp8_e4m3", scale_mode="rceil", axis=0)
    assert torch.equal(gx2, matmul_block_scaled(qg, qw, "fp32"))


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_recipe_reports_nan_instead_of_hiding_it(name):
    x = torch.randn(32, 32)
    x[3, 5] = float("nan")
    layer = EmulatedLinear(32, 32, mode=name)
    x.requires_grad_(True)
    y = layer(x)
    y.sum().backward()
    assert bool(torch.isnan(y[3]).all()) and bool(torch.isfinite(y[torch.arange(32) != 3]).all())
    assert bool(torch.isnan(layer.weight.grad).any())
