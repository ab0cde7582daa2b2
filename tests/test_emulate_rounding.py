"""round_to / round_to_: bit-exact with torch's casts (exhaustively where the format is small), against an exact
rational reference for custom formats and modes, stochastic rounding unbiased, clear errors."""

from __future__ import annotations

import math

import pytest
import torch

import mixprec.native as native
from emulate_reference import ref_neighbours, ref_round
from mixprec.emulate import FORMAT_PRESETS, FloatFormat, get_format, round_to, round_to_

TORCH_FORMATS = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@pytest.fixture(params=["compiled", "torch"])
def path(request):
    """Run the test on the compiled kernel and on the torch path (the fallback), each against torch's casts."""
    if request.param == "torch":
        with native.disabled():
            yield
    elif native.library() is None:
        pytest.skip(f"no compiled kernels: {native.describe()}")
    else:
        yield


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """Bitwise equality of fp32 tensors; NaN positions must match (NaN payload/sign differ between torch's own
    scalar and vectorised paths, so they are not compared)."""
    assert got.dtype == want.dtype == torch.float32
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"NaN mismatch at {x[torch.isnan(got) != nan][:5].tolist()}"
    bad = got.view(torch.int32) != want.view(torch.int32)
    bad &= ~nan
    if bool(bad.any()):
        idx = bad.nonzero()[:5, 0]
        example = f"x={x[idx].tolist()} got={got[idx].tolist()} want={want[idx].tolist()}"
        pytest.fail(f"{int(bad.sum())} mismatches, e.g. {example}")


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit dtype, as fp32."""
    if dtype.itemsize == 2:
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    else:
        bits = torch.arange(-(2**7), 2**7, dtype=torch.int32).to(torch.int8)
    return bits.view(dtype).float()


def midpoints_and_neighbours(dtype: torch.dtype) -> torch.Tensor:
    """Midpoints between consecutive finite values (exact in fp32: at most 12 significant bits), the fp32
    values just below and above each, and the same beyond the largest finite value (overflow threshold)."""
    v = all_values(dtype).double()
    v = torch.unique(v[torch.isfinite(v) & (v >= 0)])  # sorted, +0 once
    top = v[-1:]
    spacing_top = v[-1] - v[-2]
    v = torch.cat([v, top + spacing_top, top + 2 * spacing_top])  # virtual next values past max
    mid64 = (v[:-1] + v[1:]) / 2
    mid = mid64.float()
    mid = mid[mid.double() == mid64]  # exact in fp32 (all but bf16's virtual points past fp32's range)
    assert mid.numel() >= v.numel() - 3
    inf = torch.tensor(math.inf)
    pts = torch.cat([mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])
    return torch.cat([pts, -pts])


@pytest.mark.parametrize("name", list(TORCH_FORMATS))
def test_every_value_is_fixed_point_and_matches_torch(name, path):
    x = all_values(TORCH_FORMATS[name])
    assert_bits_equal(round_to(x, name), x.to(TORCH_FORMATS[name]).float(), x)
    finite = torch.isfinite(x)
    assert_bits_equal(round_to(x, name)[finite], x[finite], x[finite])  # representable values are kept


@pytest.mark.parametrize("name", list(TORCH_FORMATS))
def test_midpoints_ties_to_even_and_overflow_match_torch(name, path):
    x = midpoints_and_neighbours(TORCH_FORMATS[name])
    assert_bits_equal(round_to(x, name), x.to(TORCH_FORMATS[name]).float(), x)


def special_values() -> torch.Tensor:
    vals = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1.17e-38, 3.4e38, -3.4e38, 65504.0, 65519.99,
            65520.0, -65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 448.0, 464.0, 464.01, 480.0, 57344.0,
            61440.0, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 2.0**-133, 2.0**-134]  # fmt: skip
    x = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([x, -x])


@pytest.mark.parametrize("name", list(TORCH_FORMATS))
def test_special_values_match_torch(name, path):
    x = special_values()
    got = round_to(x, name)
    assert_bits_equal(got, x.to(TORCH_FORMATS[name]).float(), x)
    # signed zeros survive (compared bitwise above) and underflow keeps the sign
    assert torch.equal(torch.signbit(got[x == 0]), torch.signbit(x[x == 0]))


def random_fp32(n: int, gen: torch.Generator) -> torch.Tensor:
    """A mix: uniform random bit patterns (all exponents, subnormals, inf, NaN), normals at several scales,
    fp16-subnormal range, values around the fp16 and fp8 overflow thresholds, fp32 subnormals."""
    k = n // 6
    bits = torch.randint(-(2**31), 2**31, (k,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    normal = torch.randn(k, generator=gen) * torch.exp2(torch.randint(-30, 30, (k,), generator=gen).float())
    tiny = torch.rand(k, generator=gen) * 2.0**-13 * torch.sign(torch.randn(k, generator=gen))
    big = (torch.rand(k, generator=gen) * 80000.0) * torch.sign(torch.randn(k, generator=gen))
    fp8 = (torch.rand(k, generator=gen) * 600.0) * torch.sign(torch.randn(k, generator=gen))
    sub32 = torch.randint(-(2**23), 2**23, (n - 5 * k,), generator=gen, dtype=torch.int32).view(torch.float32)
    return torch.cat([bits, normal, tiny, big, fp8, sub32])


@pytest.mark.slow
def test_ten_million_random_fp32_match_torch():
    gen = torch.Generator().manual_seed(1234)
    out = torch.empty(1_000_000)
    for _ in range(10):  # 10M values, in chunks of 1M to keep memory flat
        x = random_fp32(1_000_000, gen)
        for name, dtype in TORCH_FORMATS.items():
            round_to(x, name, out=out)
            assert_bits_equal(out, x.to(dtype).float(), x)


def test_fp16_and_bf16_inputs_are_widened_exactly(path):
    x16 = all_values(torch.float16).half()
    assert_bits_equal(round_to(x16, "bf16"), x16.float().to(torch.bfloat16).float(), x16.float())
    xb = all_values(torch.bfloat16).bfloat16()
    assert_bits_equal(round_to(xb, "fp16"), xb.float().to(torch.float16).float(), xb.float())
    x8 = all_values(torch.float8_e4m3fn).to(torch.float8_e4m3fn)
    assert_bits_equal(round_to(x8, "fp8_e5m2"), x8.float().to(torch.float8_e5m2).float(), x8.float())


def test_fp64_inputs_round_once_not_twice():
    # 1 + 2**-11 + 2**-40: just above the fp16 midpoint between 1 and 1 + 2**-10. Rounding through fp32 first
    # lands exactly on the midpoint and then ties to even (1.0), which is what torch's fp64 -> fp16 cast gives.
    above = 1 + 2.0**-11 + 2.0**-40
    x = torch.tensor([above, -above, 1 + 2.0**-11 - 2.0**-40], dtype=torch.float64)
    assert round_to(x, "fp16").tolist() == [1 + 2.0**-10, -(1 + 2.0**-10), 1.0]
    assert x[:1].to(torch.float16).item() == 1.0  # torch double-rounds: the reason fp64 gets its own path
    y = torch.tensor([1 + 2.0**-8 + 2.0**-40], dtype=torch.float64)
    assert round_to(y, "bf16").item() == 1 + 2.0**-7


CUSTOM_FORMATS = [
    FloatFormat(3, 2),
    FloatFormat(4, 3, has_inf=False),  # OCP e4m3 without saturation: overflow -> NaN
    FloatFormat(5, 2, saturate=True),
    FloatFormat(6, 5),
    FloatFormat(7, 12),
    FloatFormat(5, 22),  # too many fraction bits for the fp32 magic constant: goes through fp64
    FloatFormat(8, 15),  # 8 exponent bits: the integer trick
    FloatFormat(8, 23, saturate=True),
    FloatFormat(4, 3, subnormals=False),
    FloatFormat(5, 10, subnormals=False),
    FORMAT_PRESETS["tf32"],
    FORMAT_PRESETS["fp32"],
]


def sample_for(fmt: FloatFormat, gen: torch.Generator, n: int = 1500) -> torch.Tensor:
    """Values spread over the format's whole range: normal, subnormal, near overflow, exact ties."""
    lo, hi = math.log2(fmt.min_subnormal) - 2, math.log2(fmt.max_finite) + 1.5
    e = torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    x = torch.exp2(e) * torch.sign(torch.randn(n, generator=gen, dtype=torch.float64))
    x = x.float()
    reps = round_to(x, fmt)  # ties: a representable value plus half a spacing (computed by the reference below)
    reps = reps[torch.isfinite(reps) & (reps != 0)][:200]
    ties = torch.tensor(
        [sum(ref_neighbours(float(v), fmt)) / 2 for v in reps.tolist()],
        dtype=torch.float32,
    )
    return torch.cat([x, ties, special_values()])


@pytest.mark.parametrize("fmt", CUSTOM_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
def test_custom_formats_match_exact_reference(fmt, mode):
    gen = torch.Generator().manual_seed(fmt.exp_bits * 100 + fmt.man_bits)
    x = sample_for(fmt, gen)
    want = torch.tensor([ref_round(float(v), fmt, mode) for v in x.tolist()], dtype=torch.float32)
    assert_bits_equal(round_to(x, fmt, mode), want, x)
    # fp64 inputs with bits below fp32 precision, rounded once from fp64
    x64 = x.double() * (1 + 2.0**-30 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    want64 = torch.tensor([ref_round(float(v), fmt, mode) for v in x64.tolist()], dtype=torch.float32)
    assert_bits_equal(round_to(x64, fmt, mode), want64, x64.float())


def test_in_place_and_out_variants_agree(path):
    gen = torch.Generator().manual_seed(3)
    x = random_fp32(60_000, gen)
    for name in ["fp16", "bf16", "fp8_e4m3", "tf32"]:
        want = round_to(x, name)
        y = x.clone()
        assert round_to_(y, name) is y
        assert_bits_equal(y, want, x)
        y64 = x.double()
        round_to_(y64, name)
        assert_bits_equal(y64.float(), want, x)
        out = torch.empty_like(x)
        assert round_to(x, name, out=out) is out
        assert_bits_equal(out, want, x)
        strided = x.clone()[::2]  # non-contiguous in-place
        round_to_(strided, name)
        assert_bits_equal(strided, want[::2], x[::2])


@pytest.mark.parametrize("name", list(TORCH_FORMATS))
def test_stochastic_rounding_is_unbiased_and_picks_neighbours(name):
    fmt = get_format(name)
    # values at known fractions between neighbours (lo = a representable base, hi = the next one away from zero),
    # normal and subnormal ranges, both signs, up to a quarter of the largest binade
    bases = [1.0, 2.0 ** (fmt.emax - 2) * 1.5, -3.0, 3 * 2.0 ** (fmt.emin - fmt.man_bits), -fmt.min_normal]
    fracs = [0.1, 0.25, 0.5, 0.8125]
    pairs = [ref_neighbours(base, fmt) for base in bases]
    x = torch.tensor([lo + f * (hi - lo) for lo, hi in pairs for f in fracs])
    lo = torch.tensor([lo for lo, _ in pairs for _ in fracs])
    hi = torch.tensor([hi for _, hi in pairs for _ in fracs])
    assert torch.equal(lo, torch.tensor(bases).repeat_interleave(len(fracs)))  # bases are representable
    assert bool(((lo.abs() < x.abs()) & (x.abs() < hi.abs())).all())  # strictly between (fp32 holds x)
    n = 20_000
    gen = torch.Generator().manual_seed(7)
    draws = round_to(x.repeat(n, 1), fmt, "stochastic", generator=gen)
    assert bool(((draws == lo) | (draws == hi)).all())  # only ever one of the two neighbours
    # mean of n draws: sd <= |hi - lo| / (2 sqrt(n)); 6 sd keeps a false alarm below 1e-8 per value
    mean = draws.double().mean(0)
    tol = 6 * (hi - lo).abs().double() / (2 * math.sqrt(n))
    assert bool(((mean - x.double()).abs() <= tol).all()), (mean - x.double()).abs() / tol
    # seeded: the same generator state gives the same draws; representable values never move
    again = round_to(x.repeat(n, 1), fmt, "stochastic", generator=torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)
    exact = all_values(TORCH_FORMATS[name])
    exact = exact[torch.isfinite(exact)]
    assert_bits_equal(round_to(exact, fmt, "stochastic"), exact, exact)


def test_stochastic_overflow_follows_the_format():
    x = torch.tensor([65504.0 + 16.0, 1e6, math.inf, math.nan])  # halfway past max, far past, inf, nan
    got = round_to(x.repeat(2000, 1), "fp16", "stochastic", generator=torch.Generator().manual_seed(0))
    assert set(got[:, 0].tolist()) == {65504.0, math.inf}
    assert bool((got[:, 1] == math.inf).all()) and bool((got[:, 2] == math.inf).all())
    assert bool(torch.isnan(got[:, 3]).all())
    sat = round_to(x, "fp8_e4m3", "stochastic")
    assert sat[:3].tolist() == [448.0, 448.0, 448.0]


def test_toward_zero_never_overflows_finite_values():
    x = torch.tensor([1e6, -1e6, math.inf, 65535.0])
    assert round_to(x, "fp16", "toward_zero").tolist() == [65504.0, -65504.0, math.inf, 65504.0]


def test_format_properties():
    fp16, e4m3, bf16 = get_format("fp16"), get_format("fp8_e4m3"), get_format("bf16")
    assert (fp16.max_finite, fp16.min_normal, fp16.min_subnormal, fp16.unit_roundoff) == (
        65504.0, 2.0**-14, 2.0**-24, 2.0**-11)  # fmt: skip
    assert (e4m3.max_finite, e4m3.min_subnormal, e4m3.torch_dtype) == (448.0, 2.0**-9, torch.float8_e4m3fn)
    assert bf16.max_finite == torch.finfo(torch.bfloat16).max
    assert get_format("fp8_e5m2").max_finite == 57344.0
    assert get_format(torch.float16) is FORMAT_PRESETS["fp16"]
    assert FloatFormat(5, 10) == fp16 and FloatFormat(5, 10).name == "fp16"
    assert FloatFormat(4, 3, has_inf=False).torch_dtype is None  # NaN on overflow: not torch's saturating cast


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: FloatFormat(9, 3), ValueError, "exp_bits"),
        (lambda: FloatFormat(4, 0), ValueError, "man_bits"),
        (lambda: FloatFormat(4.0, 3), TypeError, "exp_bits"),
        (lambda: FloatFormat(8, 7, has_inf=False), ValueError, "has_inf"),
        (lambda: FloatFormat(5, 2, saturate=1), TypeError, "saturate"),
        (lambda: get_format("fp12"), ValueError, "fp16"),
        (lambda: get_format(torch.int8), ValueError, "torch dtype"),
        (lambda: get_format(3), TypeError, "FloatFormat"),
        (lambda: round_to([1.0], "fp16"), TypeError, "torch.Tensor"),
        (lambda: round_to(torch.ones(2, dtype=torch.int32), "fp16"), TypeError, "must have dtype"),
        (lambda: round_to(torch.ones(2), "fp16", rounding="up"), ValueError, "rounding"),
        (lambda: round_to(torch.ones(2), "fp16", "stochastic", generator=0), TypeError, "generator"),
        (lambda: round_to(torch.ones(2), "fp16", out=torch.empty(3)), ValueError, "shape"),
        (lambda: round_to(torch.ones(2), "fp16", out=torch.empty(2, dtype=torch.float16)), TypeError, "out"),
        (lambda: round_to_(torch.ones(2, dtype=torch.float16), "fp16"), TypeError, "in place"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3"])  # integer trick, magic constant, narrow format
@pytest.mark.parametrize("mode", ["nearest", "toward_zero", "stochastic"])
def test_round_to__refuses_a_leaf_that_requires_grad(path, fmt, mode):
    """torch refuses an in-place op on a leaf that requires grad (its value would silently leave the graph); so
    does round_to_, on both paths and every mode (bf16 to nearest rounded it in place without a word)."""
    x = torch.tensor([1.1, 2.3, -0.7], requires_grad=True)
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        round_to_(x, fmt, mode)
    assert torch.equal(x.detach(), before)
    with torch.no_grad():  # as torch allows it there (initialising parameters)
        round_to_(x, fmt, mode, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x.detach(), round_to(before, fmt, mode, generator=torch.Generator().manual_seed(0)))


def test_meta_tensors_give_shapes_not_an_item_error(path):
    """A meta tensor has a shape and no values: round_to gives an fp32 meta tensor of its shape, round_to_ returns
    it (the torch path called .item() on it: "Tensor.item() cannot be called on meta tensors")."""
    x = torch.empty(3, 5, device="meta", dtype=torch.float16)
    for mode in ("nearest", "toward_zero", "stochastic"):
        y = round_to(x, "fp8_e4m3", mode)
        assert y.device.type == "meta" and y.shape == (3, 5) and y.dtype == torch.float32
        out = torch.empty(3, 5, device="meta", dtype=torch.float64)
        assert round_to(x, "bf16", mode, out=out) is out
        w = torch.empty(4, device="meta")
        assert round_to_(w, "fp16", mode) is w
