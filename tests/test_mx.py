"""mx_quantize against an independent float64/numpy oracle of the formulas in docs/mx.md, plus layouts (axis,
2-D tiles), the random Hadamard transform, stochastic rounding and bad input. The packages we claim to match
(torchao, ml_dtypes) are checked in tests/test_mx_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mixprec.core.mx import fake_quantize, hadamard_matrix, round_elements
from mixprec.emulate import MX_FORMATS, SCALE_MODES, hadamard_transform, mx_quantize, random_signs

E8M0_FORMATS = [name for name, f in MX_FORMATS.items() if f.scale == "e8m0"]
E8M0_MODES = [m for m in SCALE_MODES if m != "e4m3"]
# (exponent bits, fraction bits, largest value) of each element type, from the OCP MX v1.0 tables
ELEMENTS = {
    "mxfp8_e4m3": (4, 3, 448.0),
    "mxfp8_e5m2": (5, 2, 57344.0),
    "mxfp6_e2m3": (2, 3, 7.5),
    "mxfp6_e3m2": (3, 2, 28.0),
    "mxfp4_e2m1": (2, 1, 6.0),
    "nvfp4": (2, 1, 6.0),
}


# ------------------------------------------------------------------------------------------------ the oracle
def grid(ebits: int, mbits: int, top: float) -> np.ndarray:
    """Every non-negative finite value of a binary format with subnormals, up to ``top``, ascending (the bit
    codes in order, so an even index is an even significand)."""
    bias = 2 ** (ebits - 1) - 1
    vals = [k * 2.0 ** (1 - bias - mbits) for k in range(2**mbits)]
    for e in range(1, 2**ebits):
        vals += [(1 + k / 2**mbits) * 2.0 ** (e - bias) for k in range(2**mbits)]
    return np.array([v for v in vals if v <= top])


def round_grid(v: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Round float64 ``v`` to nearest on ``g`` (ties to the even code), saturating at g[-1]; NaN stays NaN."""
    a = np.minimum(np.abs(v), g[-1])
    i = np.clip(np.searchsorted(g, np.nan_to_num(a)), 1, len(g) - 1)
    lo, hi = g[i - 1], g[i]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))
    r = np.where(up, hi, lo)
    return np.where(np.isnan(v), np.nan, np.copysign(r, v))


def log2_floor_ceil(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact floor and ceil of log2 for positive float64 (inf counts as 2**128, its fp32 exponent field)."""
    a = np.where(np.isinf(a), 2.0**128, a)
    m, e = np.frexp(a)
    return e - 1, np.where(m == 0.5, e - 1, e)


def e8m0_exponent(amax: np.ndarray, fmt: str, mode: str) -> np.ndarray:
    _, mbits, top = ELEMENTS[fmt]
    emax = math.floor(math.log2(top))
    pos = np.where(amax > 0, amax, 1.0)
    fl, ce = log2_floor_ceil(pos)
    if mode == "floor":
        e = fl - emax
    elif mode == "neuron":
        e = fl - emax + 1
    elif mode == "ceil":
        e = ce - emax
    elif mode == "even":  # amax rounded half-up to mbits fraction bits, then its floor(log2)
        fin = np.where(np.isinf(pos), 1.0, pos)
        r = np.floor(fin / 2.0**fl * 2**mbits + 0.5) / 2**mbits * 2.0**fl
        e = np.where(np.isinf(pos), 128, log2_floor_ceil(r)[0]) - emax
    else:  # rceil: ceil(log2(fp32(amax / max)))
        d = (amax.astype(np.float32) / np.float32(top)).astype(np.float64)
        e = np.where(d > 0, log2_floor_ceil(np.where(d > 0, d, 1.0))[1], -127)
    e = np.where(amax > 0, e, -127)
    return np.clip(e, -127, 127)


def oracle(x: torch.Tensor, fmt: str, mode: str, tensor_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(elements, scales) of ``x`` [blocks, block] by the definitions, in float64 (fp32 where the recipe says)."""
    with np.errstate(over="ignore"):  # fp32 overflow to inf is part of the recipe (huge tensor_scale ratios)
        return _oracle(x, fmt, mode, tensor_scale)


def _oracle(x: torch.Tensor, fmt: str, mode: str, tensor_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    ebits, mbits, top = ELEMENTS[fmt]
    xs = x.numpy().astype(np.float64)
    amax = np.abs(xs).max(axis=1)
    nan = np.isnan(amax)
    amax = np.where(nan, 0.0, amax)
    if fmt == "nvfp4":
        f32 = np.float32
        bs = amax.astype(f32) / f32(6.0)
        if tensor_scale is not None:
            bs = bs / f32(tensor_scale)
        s = round_grid(np.clip(bs, 2.0**-6, 448.0).astype(np.float64), grid(4, 3, 448.0)).astype(f32)
        rcp = f32(1.0) / s if tensor_scale is None else (f32(1.0) / f32(tensor_scale)) / s
        v = (x.numpy() * rcp[:, None]).astype(np.float64)  # fp32 product, as the recipe
        scales = s.astype(np.float64)
    else:
        e = e8m0_exponent(amax, fmt, mode)
        scales = 2.0 ** e.astype(np.float64)
        mult = np.where((mode == "rceil") & (e == -127), 1.0, 2.0 ** -e.astype(np.float64))
        v = xs * mult[:, None]
    elems = round_grid(v, grid(ebits, mbits, top))
    elems[nan] = np.nan
    scales[nan] = np.nan
    return elems, scales


def assert_bits(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Bit-equal fp32 (zeros' signs included); NaN matches any NaN."""
    with np.errstate(over="ignore"):  # a dequantized 448 * 2**127 is inf in fp32, as in torch
        ref32 = torch.from_numpy(ref.astype(np.float32))
    both_nan = ours.isnan() & ref32.isnan()
    diff = (ours.view(torch.int32) != ref32.view(torch.int32)) & ~both_nan
    assert not bool(diff.any()), (ours[diff][:8].tolist(), ref32[diff][:8].tolist())


# ------------------------------------------------------------------------------------------------ data
def blocks_of_every_kind(fmt: str, block: int = 32, seed: int = 0) -> torch.Tensor:
    """[blocks, block] fp32: normal, heavy-tailed, outliers, zeros, -0, subnormal and tiny blocks, amax at
    (and one ulp above) max * 2**k, element ties, NaN, +-inf, near fp32's max."""
    g = torch.Generator().manual_seed(seed)
    top = ELEMENTS[fmt][2]
    rows = [torch.randn(8, block, generator=g) * torch.exp(torch.randn(8, 1, generator=g) * 4)]
    chi = torch.randn(8, block, 3, generator=g).pow(2).mean(-1)
    rows.append(torch.randn(8, block, generator=g) / chi)  # student-t, 3 degrees of freedom
    out = torch.randn(4, block, generator=g)
    out[:, 5] *= 1e4
    rows += [out, torch.zeros(1, block), torch.full((1, block), -0.0)]
    rows.append(torch.randn(2, block, generator=g) * 1e-40)  # fp32 subnormals
    rows.append(torch.randn(2, block, generator=g) * 2.0**-121)  # scale at the bottom of E8M0
    emax = math.floor(math.log2(top))
    bottom = torch.randn(2, block, generator=g) * 2.0 ** (emax - 129)
    bottom[:, 0] = 2.0 ** (emax - 127) * 0.9  # E8M0 scale 2**-127 in every mode, with elements near 2**emax
    rows.append(bottom)
    for k in (-120, -3, 0, 7, 100):
        b = torch.randn(2, block, generator=g) * top * 2.0**k / 4
        b[0, 1] = top * 2.0**k
        b[1, 1] = torch.nextafter(torch.tensor(top * 2.0**k), torch.tensor(math.inf))
        rows.append(b)
    g_ = torch.from_numpy(grid(*ELEMENTS[fmt]).astype(np.float32))
    mids = (g_[1:] + g_[:-1]) / 2
    ties = torch.cat([mids, -mids])[: block - 1]
    ties = torch.cat([ties, torch.full((block - 1 - ties.numel(),), 0.0), torch.tensor([top])])
    rows += [ties.view(1, -1) * 2.0**-5, ties.view(1, -1) * 2.0**40]
    special = torch.randn(4, block, generator=g)
    special[0, 3] = math.nan
    special[1, 3] = math.inf
    special[2, 3], special[2, 4] = -math.inf, 1e30
    special[3] *= 3.0e38 / special[3].abs().max()
    rows.append(special)
    return torch.cat(rows).float()


# ------------------------------------------------------------------------------------------------ the oracle tests
@pytest.mark.parametrize("fmt", E8M0_FORMATS)
@pytest.mark.parametrize("mode", E8M0_MODES)
def test_e8m0_formats_match_the_oracle(fmt: str, mode: str) -> None:
    x = blocks_of_every_kind(fmt)
    q = mx_quantize(x, fmt, scale_mode=mode)
    elems, scales = oracle(x, fmt, mode)
    assert q.elements.shape == x.shape and q.scales.shape == (x.shape[0], 1)
    assert_bits(q.elements, elems)
    assert_bits(q.scales.view(-1), scales)
    assert_bits(q.dequantize(), elems * scales[:, None])


@pytest.mark.parametrize("tensor_scale", [None, 1e4 / (448 * 6), 2.0**-100])
def test_nvfp4_matches_the_oracle(tensor_scale: float | None) -> None:
    x = blocks_of_every_kind("nvfp4", block=16)
    q = mx_quantize(x, "nvfp4", tensor_scale=tensor_scale)
    elems, scales = oracle(x, "nvfp4", "e4m3", tensor_scale)
    assert_bits(q.elements, elems)
    assert_bits(q.scales.view(-1), scales)
    total = scales.astype(np.float32) * (np.float32(1.0) if tensor_scale is None else np.float32(tensor_scale))
    assert_bits(q.dequantize(), elems * total[:, None].astype(np.float64))


def test_the_default_scale_modes_and_block_sizes() -> None:
    x = torch.randn(4, 64)
    assert mx_quantize(x, "mxfp8_e4m3").scale_mode == "floor"
    assert mx_quantize(x, "mxfp8_e4m3").scales.shape == (4, 2)
    q = mx_quantize(x, "nvfp4")
    assert q.scale_mode == "e4m3" and q.scales.shape == (4, 4) and q.tensor_scale is None


def test_floor_clips_where_ceil_and_rceil_do_not() -> None:
    """floor keeps amax's exponent: a block whose amax has a larger significand than the element's maximum
    saturates (the clipping AITER reported), ceil and rceil leave room for it."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 7.9  # 7.9 = 1.975 * 4 > 6 = 1.5 * 4
    assert mx_quantize(x, "mxfp4_e2m1", scale_mode="floor").dequantize()[0, 0] == 6.0
    for mode in ("ceil", "rceil", "neuron"):
        assert mx_quantize(x, "mxfp4_e2m1", scale_mode=mode).dequantize()[0, 0] == 8.0
    assert mx_quantize(x, "mxfp4_e2m1", scale_mode="even").dequantize()[0, 0] == 8.0  # 7.9 rounds to 8 first


def test_neuron_scale_is_twice_floor() -> None:
    x = torch.randn(16, 64) * 10
    for fmt in E8M0_FORMATS:
        floor = mx_quantize(x, fmt, scale_mode="floor").scales
        assert torch.equal(mx_quantize(x, fmt, scale_mode="neuron").scales, floor * 2)


def test_bf16_and_fp16_inputs_are_read_exactly() -> None:
    x = torch.randn(8, 64) * 100
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.to(dtype)
        for fmt in ("mxfp8_e4m3", "nvfp4"):
            a, b = mx_quantize(xl, fmt), mx_quantize(xl.float(), fmt)
            assert torch.equal(a.elements, b.elements) and torch.equal(a.scales, b.scales)


def test_input_is_not_modified_and_dequantize_casts() -> None:
    x = torch.randn(4, 32)
    before = x.clone()
    q = mx_quantize(x, "mxfp8_e4m3")
    assert torch.equal(x, before)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize().bfloat16())


# ------------------------------------------------------------------------------------------------ layouts
def test_blocks_along_another_axis_equal_the_transposed_quantization() -> None:
    x = torch.randn(64, 3, 5)
    q = mx_quantize(x, "mxfp6_e3m2", axis=0, scale_mode="rceil")
    ref = mx_quantize(x.movedim(0, -1).contiguous(), "mxfp6_e3m2", scale_mode="rceil")
    assert q.scales.shape == (2, 3, 5)
    assert torch.equal(q.elements, ref.elements.movedim(-1, 0))
    assert torch.equal(q.scales, ref.scales.movedim(-1, 0))
    assert torch.equal(q.dequantize(), ref.dequantize().movedim(-1, 0))


def test_two_dimensional_blocks_equal_a_loop_over_tiles() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 48, generator=g) * torch.exp(torch.randn(2, 32, 1, generator=g))
    for fmt, axis in (("nvfp4", -1), ("mxfp8_e4m3", (1, 2)), ("mxfp4_e2m1", (2, 1))):
        q = mx_quantize(x, fmt, block_size=(16, 16), axis=axis)
        assert q.scales.shape == (2, 2, 3)
        for b in range(2):
            for i in range(2):
                for j in range(3):
                    tile = x[b, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
                    one = mx_quantize(tile.reshape(1, 256), fmt, block_size=256)
                    assert torch.equal(q.scales[b, i, j], one.scales[0, 0])
                    assert torch.equal(
                        q.elements[b, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16], one.elements.view(16, 16)
                    )
        assert torch.equal(q.dequantize(), q.elements * q.scales.repeat_interleave(16, 1).repeat_interleave(16, 2))


# ------------------------------------------------------------------------------------------------ rounding
def test_toward_zero_is_the_truncation() -> None:
    x = torch.randn(32, 32) * 3
    for fmt in ("mxfp8_e5m2", "mxfp6_e2m3", "nvfp4"):
        q = mx_quantize(x, fmt, rounding="toward_zero")
        v = (x.view(-1, MX_FORMATS[fmt].block_size) / q.scales.view(-1, 1)).numpy().astype(np.float64)
        g = grid(*ELEMENTS[fmt])
        a = np.minimum(np.abs(v), g[-1])
        ref = np.copysign(g[np.searchsorted(g, a, side="right") - 1], v)
        assert_bits(q.elements.view(v.shape), ref)


def test_stochastic_rounding_is_deterministic_given_a_generator() -> None:
    x = torch.randn(8, 64)
    draws = [
        mx_quantize(x, "mxfp4_e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(s))
        for s in (1, 1, 2)
    ]
    assert torch.equal(draws[0].elements, draws[1].elements)
    assert not torch.equal(draws[0].elements, draws[2].elements)
    assert torch.equal(draws[0].scales, mx_quantize(x, "mxfp4_e2m1").scales)  # the scale does not depend on the draw


def test_stochastic_draws_follow_the_element_not_the_blocking() -> None:
    """Element i of x (row-major) takes stream position i whatever the axis: with every block's scale equal
    (a unit diagonal, |x| < 1 elsewhere), blocks along rows or along columns give the same bits."""
    x = torch.rand(32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    x.diagonal().fill_(1.0)
    rows, cols = (
        mx_quantize(x, "mxfp4_e2m1", axis=a, rounding="stochastic", generator=torch.Generator().manual_seed(9))
        for a in (-1, 0)
    )
    assert torch.equal(rows.scales.view(-1), cols.scales.view(-1))
    assert torch.equal(rows.elements, cols.elements)
    assert not torch.equal(rows.elements, mx_quantize(x, "mxfp4_e2m1").elements)


@pytest.mark.parametrize("fmt", ["mxfp4_e2m1", "mxfp8_e4m3", "nvfp4"])
def test_stochastic_rounding_is_unbiased(fmt: str) -> None:
    """The same block repeated N times: each element is one of its two grid neighbours, and the count of
    rounding up is Binomial(N, frac): within 5 standard deviations (plus one) of N * frac."""
    bs = MX_FORMATS[fmt].block_size
    g = torch.Generator().manual_seed(7)
    row = torch.randn(bs, generator=g) * 3
    row[0] = 4.0 * row.abs().max()  # fixes the scale of every copy
    n = 4000
    q = mx_quantize(row.repeat(n, 1), fmt, rounding="stochastic", generator=g)
    scale = q.scales[0, 0]
    assert bool((q.scales == scale).all())
    v = (row / scale).double() if fmt != "nvfp4" else (row * torch.reciprocal(scale)).double()
    gr = torch.from_numpy(grid(*ELEMENTS[fmt]))
    a = v.abs().clamp(max=float(gr[-1]))
    i = torch.searchsorted(gr, a, right=True) - 1
    lo = gr[i]
    hi = gr[(i + 1).clamp(max=len(gr) - 1)]
    frac = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    e = q.elements.double().abs()
    assert bool(((e == lo) | (e == hi)).all())
    ups = (e == hi).sum(0).double() - (hi == lo).double() * n
    sd = (n * frac * (1 - frac)).sqrt()
    assert bool(((ups - n * frac).abs() <= 5 * sd + 1).all()), (ups - n * frac) / sd
    mean = (q.elements.double() * scale.double()).mean(0)
    exact = torch.where(row.abs() <= gr[-1] * scale, row.double(), row.sign().double() * gr[-1] * scale)
    spacing = (hi - lo) * scale.double()
    assert bool(((mean - exact).abs() <= 5 * spacing / math.sqrt(n) + 1e-12).all())


def test_round_elements_saturates_and_keeps_nan() -> None:
    v = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, -0.0])
    for fmt, (_, _, top) in ELEMENTS.items():
        r = round_elements(v.clone(), fmt)
        assert r[:4].tolist() == [top, -top, top, -top] and math.isnan(r[4]) and str(r[5].item()) == "-0.0"


# ------------------------------------------------------------------------------------------------ Hadamard
def test_hadamard_is_orthogonal_and_undone() -> None:
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))
    signs = random_signs(16, generator=torch.Generator().manual_seed(0)).double()
    assert torch.equal(signs, random_signs(16, generator=torch.Generator().manual_seed(0)).double())
    q = h * signs / 4
    assert torch.equal(q @ q.T, torch.eye(16, dtype=torch.float64))  # entries +-1/4: every sum is exact
    x = torch.randn(3, 64, 5, dtype=torch.float64)
    y = hadamard_transform(x, signs, axis=1)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-15, atol=0)
    back = hadamard_transform(y, signs, axis=1, inverse=True)
    assert (back - x).abs().max() <= 16 * 2.0**-53 * x.abs().max() * 4  # one product and its inverse, n = 16
    block = x[0, :16, 0]
    assert torch.allclose(y[0, :16, 0], q @ block, rtol=0, atol=1e-15)


def test_hadamard_spreads_an_outlier_over_its_block() -> None:
    x = torch.zeros(1, 32)
    x[0, 3] = 8.0
    y = hadamard_transform(x, random_signs(16, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(y[0, :16].abs(), torch.full((16,), 2.0)) and torch.equal(y[0, 16:], torch.zeros(16))


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "exc", "names"),
    [
        ({"fmt": "mxfp7"}, ValueError, "fmt"),
        ({"fmt": "fp8_e4m3"}, ValueError, "fmt"),
        ({"block_size": 24}, ValueError, "block_size"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 32.0}, TypeError, "block_size"),
        ({"scale_mode": "round"}, ValueError, "scale_mode"),
        ({"scale_mode": "e4m3"}, ValueError, "scale_mode"),
        ({"fmt": "nvfp4", "scale_mode": "floor"}, ValueError, "scale_mode"),
        ({"tensor_scale": 2.0}, ValueError, "tensor_scale"),
        ({"fmt": "nvfp4", "tensor_scale": 0.0}, ValueError, "tensor_scale"),
        ({"fmt": "nvfp4", "tensor_scale": math.inf}, ValueError, "tensor_scale"),
        ({"fmt": "nvfp4", "tensor_scale": "auto"}, TypeError, "tensor_scale"),
        ({"axis": 2}, ValueError, "axis"),
        ({"axis": (0, 1)}, ValueError, "axis"),
        ({"block_size": (16, 16), "axis": (1, 1)}, ValueError, "axis"),
        ({"rounding": "up"}, ValueError, "rounding"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_bad_input_names_the_argument(kwargs: dict, exc: type, names: str) -> None:
    kwargs = {"fmt": "mxfp8_e4m3", **kwargs}
    with pytest.raises(exc, match=names):
        mx_quantize(torch.zeros(32, 64), **kwargs)


def test_bad_tensors_name_the_argument() -> None:
    with pytest.raises(TypeError, match="x"):
        mx_quantize(torch.zeros(2, 32, dtype=torch.float64), "mxfp8_e4m3")
    with pytest.raises(TypeError, match="x"):
        mx_quantize([0.0] * 32, "mxfp8_e4m3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signs"):
        hadamard_transform(torch.zeros(2, 16), torch.full((16,), 2.0))
    with pytest.raises(ValueError, match="Hadamard size"):
        hadamard_transform(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


def test_empty_tensors_and_autograd_inputs() -> None:
    for shape, kwargs in (((0, 32), {}), ((4, 0), {}), ((0, 32, 32), {"block_size": (16, 16)})):
        q = mx_quantize(torch.zeros(shape), "nvfp4", rounding="stochastic", **kwargs)
        assert q.elements.shape == shape and q.dequantize().shape == shape
    x = torch.randn(4, 32, requires_grad=True)
    q = mx_quantize(x, "mxfp8_e4m3")  # values only: no graph through the quantizer
    assert not q.elements.requires_grad and torch.equal(q.elements, mx_quantize(x.detach(), "mxfp8_e4m3").elements)


def test_fake_quantize_is_dequantize_of_quantize() -> None:
    """The allocation-light fake-quant path (round_to's shorthand) gives the bits of mx_quantize().dequantize()."""
    flat = blocks_of_every_kind("mxfp8_e4m3", 16).view(-1)
    x = torch.cat([flat, torch.randn(-flat.numel() % 1024)]).view(-1, 32)  # whole 32 x 32 tiles
    for fmt in MX_FORMATS:
        for kwargs in ({}, {"axis": 0}, {"block_size": (16, 16), "axis": (0, 1)}):
            if fmt == "nvfp4":
                kwargs = {**kwargs, "tensor_scale": 0.01}
            ref = mx_quantize(x, fmt, **kwargs).dequantize()
            assert torch.equal(fake_quantize(x, fmt, **kwargs).view(torch.int32), ref.view(torch.int32))
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):  # their rounding relies on it to saturate
        assert MX_FORMATS[fmt].element.max_finite == MX_FORMATS[fmt].max_element
        assert MX_FORMATS[fmt].element.saturate


@pytest.mark.parametrize("fmt", sorted(MX_FORMATS))
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
def test_round_to_is_the_fake_quant_shorthand(fmt: str, rounding: str) -> None:
    from mixprec.core.rounding import round_to

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 100
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    expect = mx_quantize(x, fmt, rounding=rounding, generator=g1).dequantize()
    got = round_to(x, fmt, rounding, g2)
    assert torch.equal(got, expect)
    out = torch.empty(4, 64)
    assert round_to(x, fmt, out=out) is out
    assert torch.equal(out, mx_quantize(x, fmt).dequantize())


def test_round_to_names_an_unknown_block_format() -> None:
    from mixprec.core.rounding import round_to

    with pytest.raises(ValueError, match="fmt"):
        round_to(torch.ones(32), "mxfp9")
