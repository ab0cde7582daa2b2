"""The compiled round-to-nearest kernel against the torch path (``mixprec.native.disabled()``, the oracle) and
torch's own casts, bit for bit (NaN payloads included) on adversarial inputs: every fp32 exponent, ties at every
bit position, the overflow threshold, subnormal targets, signed zeros, inf and NaN, for every kind of format;
fp16/bf16/float8 inputs, odd sizes, 1 and 2 threads, non-contiguous tensors and ``out=`` aliasing."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import mixprec.native as native
from mixprec.emulate import FORMAT_PRESETS, FloatFormat, round_to, round_to_
from mixprec.native import kernels

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no compiled kernels: {native.describe()}")

TORCH_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# every branch of the kernel: 8 exponent bits (integer trick), fp32 magic constant, fp64 magic constant
# (man_bits 22 and 23), "fn" formats, saturation, flushed subnormals, and the narrowest format
FORMATS = [
    *FORMAT_PRESETS.values(),
    FloatFormat(2, 1),
    FloatFormat(3, 2),
    FloatFormat(4, 3, has_inf=False),
    FloatFormat(4, 3, has_inf=False, saturate=True, subnormals=False),
    FloatFormat(5, 2, saturate=True),
    FloatFormat(5, 10, subnormals=False),
    FloatFormat(6, 5, has_inf=False),
    FloatFormat(7, 21),
    FloatFormat(7, 21, has_inf=False, saturate=True),
    FloatFormat(5, 22),
    FloatFormat(3, 23, subnormals=False),
    FloatFormat(8, 15, saturate=True),
    FloatFormat(8, 7, subnormals=False),
    FloatFormat(8, 23, saturate=True),
    FloatFormat(8, 23, subnormals=False),
]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def from_bits(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def every_exponent_and_tie() -> torch.Tensor:
    """For each of the 256 fp32 exponent fields: fractions 0, 1, all ones, and for every rounding position d
    (1..23 dropped bits) the tie with an even and an odd kept bit and its two fp32 neighbours; both signs."""
    fracs = [0, 1, 0x7FFFFF, 0x400000]
    for d in range(1, 24):
        half = 1 << (d - 1)
        for kept in (0, 1 << d, 3 << d):
            tie = (kept | half) & 0x7FFFFF
            fracs += [tie, tie - 1, tie + 1]
    fracs = sorted({f & 0x7FFFFF for f in fracs})
    pats = [(e << 23) | f for e in range(256) for f in fracs]
    x = from_bits(pats)
    return torch.cat([x, -x])


def thresholds(fmt: FloatFormat) -> torch.Tensor:
    """Values at and one fp32 ulp around: max_finite, the overflow threshold (max + half a spacing), the
    smallest normal, the smallest subnormal and half of it, the largest subnormal; both signs."""
    spacing_top = math.ldexp(1.0, fmt.emax - fmt.man_bits)
    pts = [fmt.max_finite, fmt.max_finite + spacing_top / 2, fmt.max_finite + spacing_top, fmt.min_normal,
           fmt.min_subnormal, fmt.min_subnormal / 2, fmt.min_subnormal * 1.5, fmt.min_normal - fmt.min_subnormal,
           fmt.min_normal - fmt.min_subnormal / 2]  # fmt: skip
    x = torch.tensor([p for p in pts if p < 3.4e38], dtype=torch.float32)
    inf = torch.tensor(math.inf)
    x = torch.cat([x, torch.nextafter(x, inf), torch.nextafter(x, -inf)])
    return torch.cat([x, -x])


# +-0, +-inf, quiet and signalling NaNs of both signs with payloads, +-fp32 max, fp32 subnormals, min normal
_SPECIAL_BITS = [0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA12345,
                 0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 1, 0x80000001, 0x007FFFFF, 0x00800000]  # fmt: skip
SPECIALS = from_bits(_SPECIAL_BITS)


def adversarial(fmt: FloatFormat) -> torch.Tensor:
    gen = torch.Generator().manual_seed(fmt.exp_bits * 64 + fmt.man_bits)
    rand = torch.randint(-(2**31), 2**31, (5000,), generator=gen, dtype=torch.int64).to(torch.int32)
    return torch.cat([every_exponent_and_tie(), thresholds(fmt), SPECIALS, rand.view(torch.float32)])


def torch_path(fn, *args, **kwargs):
    with native.disabled():
        return fn(*args, **kwargs)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if not torch.equal(bits(got), bits(want)):
        bad = (bits(got) != bits(want)).nonzero()[:5, 0]
        pytest.fail(f"{int((bits(got) != bits(want)).sum())} mismatches at {bad.tolist()}: "
                    f"got {[hex(v & 0xFFFFFFFF) for v in bits(got)[bad].tolist()]}, "
                    f"want {[hex(v & 0xFFFFFFFF) for v in bits(want)[bad].tolist()]}")  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_compiled_matches_torch_path_bit_for_bit(fmt: FloatFormat) -> None:
    x = adversarial(fmt)
    want = torch_path(round_to, x, fmt)
    assert_same_bits(round_to(x, fmt), want)
    y = x.clone()
    assert round_to_(y, fmt) is y
    assert_same_bits(y, want)
    out = torch.empty_like(x)
    assert round_to(x, fmt, out=out) is out
    assert_same_bits(out, want)


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_compiled_matches_torch_casts(name: str) -> None:
    fmt = FORMAT_PRESETS[name]
    if name == "fp8_e4m3" and bool(torch.tensor(500.0).to(torch.float8_e4m3fn).float().isnan()):
        fmt = FloatFormat(4, 3, has_inf=False)  # torch before 2.13 (2.11 measured): overflow -> NaN, not 448
    x = torch.cat([adversarial(fmt), thresholds(fmt)])
    want = x.to(TORCH_DTYPES[name]).float()
    got = round_to(x, fmt)
    nan = torch.isnan(want)  # torch's scalar and vectorized casts disagree on NaN payloads: positions only
    assert torch.equal(torch.isnan(got), nan)
    assert_same_bits(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_inputs_every_pattern(dtype: torch.dtype) -> None:
    """Every bit pattern of the input dtype, rounded to each format: compiled == torch path, and == rounding the
    input widened by torch first (NaN payloads of the widening differ between torch's own code paths)."""
    width = dtype.itemsize * 8
    pats = torch.arange(-(2 ** (width - 1)), 2 ** (width - 1), dtype=torch.int32)
    x = pats.to(torch.int16 if width == 16 else torch.int8).view(dtype)
    for fmt in FORMATS:
        got = round_to(x, fmt)
        assert_same_bits(got, torch_path(round_to, x, fmt))
        widened = round_to(x.float(), fmt)
        nan = torch.isnan(widened)
        assert torch.equal(torch.isnan(got), nan)
        assert_same_bits(got[~nan], widened[~nan])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 15, 17, 33, 32767, 32768, 32769, 100_003])
def test_odd_sizes_and_thread_slices(n: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(n)
        x = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
        for fmt in (FORMAT_PRESETS["fp16"], FORMAT_PRESETS["bf16"], FloatFormat(5, 22)):
            assert_same_bits(round_to(x, fmt), torch_path(round_to, x, fmt))
            assert_same_bits(round_to(x.half(), fmt), torch_path(round_to, x.half(), fmt))
            x64 = x.double() * (1 + 2.0**-40)
            assert_same_bits(round_to(x64, fmt), torch_path(round_to, x64, fmt))
    finally:
        torch.set_num_threads(before)


def test_non_contiguous_and_out_aliasing() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(64, 130, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 130), generator=gen).float())
    for fmt in (FORMAT_PRESETS["fp16"], FORMAT_PRESETS["bf16"], FORMAT_PRESETS["fp8_e4m3"]):
        for view in (base.t(), base[:, ::3], base[::2, 1:]):
            want = torch_path(round_to, view, fmt)
            assert_same_bits(round_to(view, fmt), want)
            assert_same_bits(round_to(view.bfloat16(), fmt), torch_path(round_to, view.bfloat16(), fmt))
            y = view.clone()  # same strides as the view's
            assert_same_bits(round_to_(y, fmt), want)
            strided = base.clone()[:, ::3]
            assert_same_bits(round_to_(strided, fmt), torch_path(round_to, base[:, ::3], fmt))
            x = view.clone()
            assert round_to(x, fmt, out=x) is x  # out is x
            assert_same_bits(x, want)
            out = torch.empty(view.shape[::-1]).t()  # non-contiguous out
            assert_same_bits(round_to(view, fmt, out=out), want)
            out64 = torch.empty(view.shape, dtype=torch.float64)
            assert torch.equal(round_to(view, fmt, out=out64), want.double())
        # out overlapping x shifted by one element: the result is as if x had been read before out was written
        buf = base.flatten().clone()
        x, out = buf[:-1], buf[1:]
        want = torch_path(round_to, x.clone(), fmt)
        assert_same_bits(round_to(x, fmt, out=out), want)


def test_autograd_inputs_keep_the_torch_path() -> None:
    """A tensor that needs grad goes through the torch ops, whose result stays in the graph as it always did."""
    x = torch.randn(40, requires_grad=True)
    y = round_to(x, "fp16")
    assert y.requires_grad
    assert_same_bits(y.detach(), round_to(x.detach(), "fp16"))
    with torch.no_grad():
        assert not round_to(x, "fp16").requires_grad


def test_autograd_out_keeps_the_torch_path() -> None:
    """An ``out`` in an autograd graph is written by a recorded copy, not behind autograd's back."""
    x = torch.randn(40)
    out = torch.zeros(40, requires_grad=True).clone()
    round_to(x, "fp16", out=out)
    assert type(out.grad_fn).__name__ != "CloneBackward0"  # the rounding's ops were recorded
    assert_same_bits(out.detach(), round_to(x, "fp16"))


def test_kernel_rejects_formats_outside_float_format() -> None:
    fn = kernels._fn("mixprec_round_nearest")
    x, out = torch.ones(4), torch.empty(4)
    args = (x.data_ptr(), 0, out.data_ptr(), 4)
    assert fn(*args, 5, 10, 1, 0, 1, 1) == 0
    assert fn(*args, 9, 10, 1, 0, 1, 1) == -1  # exp_bits
    assert fn(*args, 5, 0, 1, 0, 1, 1) == -1  # man_bits
    assert fn(*args, 8, 7, 0, 0, 1, 1) == -1  # 8 exponent bits without inf
    assert fn(x.data_ptr(), 3, out.data_ptr(), 4, 5, 10, 1, 0, 1, 1) == -1  # source kind
    fn64 = kernels._fn("mixprec_round_nearest_f64")
    x64 = x.double()
    assert fn64(x64.data_ptr(), out.data_ptr(), 0, 4, 5, 10, 1, 0, 1, 1) == 0
    assert fn64(x64.data_ptr(), out.data_ptr(), 0, 4, 5, 24, 1, 0, 1, 1) == -1
    # the typed wrapper turns a refusal into an internal error (a bug in mixprec), not a user ValueError
    with pytest.raises(kernels.KernelContractError, match="e9m10"):
        kernels.round_nearest(x, out, 9, 10, True, False, True)


def fp64_inputs(fmt: FloatFormat) -> torch.Tensor:
    """fp32 adversarial values widened and nudged below fp32 precision (so that a rounding through fp32 would
    differ), each format's midpoints one fp64 ulp either side, values beyond fp32's range, fp64 subnormals and
    NaN payloads only fp64 can hold."""
    gen = torch.Generator().manual_seed(fmt.man_bits)
    x = adversarial(fmt).double()
    nudged = x * (1 + 2.0**-30 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    mids = thresholds(fmt).double()
    inf = torch.tensor(math.inf, dtype=torch.float64)
    near = torch.cat([torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    wide = torch.tensor([1e300, -1e300, 2.0**128, 2.0**-1074, -(2.0**-1074), 2.0**-1022, 1e-300, 5e-324])
    nans = torch.tensor([0x7FF0000000000001, 0x7FF8000000000123, -1, 0x7FF4000000000000], dtype=torch.int64)
    return torch.cat([x, nudged, near, wide, nans.view(torch.float64)])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fp64_inputs_round_once_like_the_torch_path(fmt: FloatFormat) -> None:
    x = fp64_inputs(fmt)
    want = torch_path(round_to, x, fmt)
    assert_same_bits(round_to(x, fmt), want)
    out64 = torch.empty_like(x)
    want64 = torch_path(round_to, x, fmt, out=torch.empty_like(x))
    assert torch.equal(round_to(x, fmt, out=out64).view(torch.int64), want64.view(torch.int64))
    y = x.clone()
    assert round_to_(y, fmt) is y
    assert torch.equal(y.view(torch.int64), want64.view(torch.int64))
    strided = x.clone()[::3]
    round_to_(strided, fmt)
    assert torch.equal(strided.view(torch.int64), want64[::3].view(torch.int64))


@pytest.mark.parametrize("mode", ["fp16/32", "bf16/32", "fp8/promote128", "bf16/32+out"])
def test_emulated_linear_is_unchanged_by_the_kernels(mode: str) -> None:
    """EmulatedLinear rounds its operands, gradients and biased output with round_to: forward and backward give
    the same bits with the kernels as on the torch path."""
    import dataclasses

    from mixprec.emulate import EmulatedLinear, get_matmul_model

    gen = torch.Generator().manual_seed(11)
    model = get_matmul_model(mode.removesuffix("+out"))
    if mode.endswith("+out"):  # an output format: the biased result is rounded once more, in place
        model = dataclasses.replace(model, output=FORMAT_PRESETS["bf16"], name="bf16/32+out")
    layer = EmulatedLinear(24, 10, mode=model)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(10, 24, generator=gen))
        layer.bias.copy_(torch.randn(10, generator=gen))
    x = torch.randn(3, 5, 24, generator=gen) * 30

    def run() -> list[torch.Tensor]:
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-2, 2, 10)).sum().backward()
        return [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad]

    for got, want in zip(run(), torch_path(run), strict=True):
        assert_same_bits(got, want)


@pytest.mark.parametrize("how", ["round_to_", "out"])
def test_in_place_rounding_of_a_saved_tensor_makes_backward_raise(how: str) -> None:
    a = torch.randn(5, requires_grad=True)
    x = torch.randn(5)
    y = (a * x).sum()  # saves x for backward
    if how == "round_to_":
        round_to_(x, "fp8_e4m3")
    else:
        round_to(x, "fp8_e4m3", out=x)
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward()


def test_fake_tensors_take_the_torch_path() -> None:
    """Fake tensors have no memory (data pointer 0): the torch path runs, and may raise what torch raises; in a
    subprocess, so that a crash fails this test only."""
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from mixprec.emulate import round_to, round_to_\n"
        "from mixprec.compress import MinMaxUInt8\n"
        "calls = [lambda x: round_to(x, 'bf16'), lambda x: round_to_(x, 'fp8_e4m3'), MinMaxUInt8().encode]\n"
        "for call in calls:\n"
        "    with FakeTensorMode():\n"
        "        try:\n"
        "            call(torch.randn(100))\n"
        "        except Exception:\n"
        "            pass  # what torch's own ops raise on fake tensors (data-dependent control flow)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bits equal except NaN payloads (the directed modes promise NaN where the torch path gives NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN in different places"
    ibits = torch.int64 if got.dtype == torch.float64 else torch.int32
    assert torch.equal(got[~nan].view(ibits), want[~nan].view(ibits)), f"{int((got != want)[~nan].sum())} differ"


def directed(fn, x, fmt, mode, *, seed: int = 7, native_on: bool = True, **kw):
    """``fn(x, fmt, mode, generator)`` with a fresh generator; also returns the generator's next draw, which
    must agree between the paths (both consume the same uniforms)."""
    gen = torch.Generator().manual_seed(seed)
    if native_on:
        y = fn(x, fmt, mode, gen, **kw)
    else:
        with native.disabled():
            y = fn(x, fmt, mode, gen, **kw)
    return y, torch.rand(1, generator=gen, dtype=torch.float64).item()


@pytest.mark.parametrize("mode", ["toward_zero", "stochastic"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_directed_modes_match_the_torch_path(fmt: FloatFormat, mode: str) -> None:
    """toward_zero and stochastic (the same uniforms from the same generator) through the compiled kernel equal
    the fp64 torch path on every exponent and tie, the thresholds and the specials, from fp32 and from fp64
    inputs, into fp32, fp64 and in place."""
    for x in (adversarial(fmt), fp64_inputs(fmt)):
        want, next_want = directed(round_to, x, fmt, mode, native_on=False)
        got, next_got = directed(round_to, x, fmt, mode)
        assert_same_values(got, want)
        assert next_got == next_want
        out64 = torch.empty(x.shape, dtype=torch.float64)
        want64, _ = directed(round_to, x, fmt, mode, native_on=False, out=torch.empty_like(out64))
        assert_same_values(directed(round_to, x, fmt, mode, out=out64)[0], want64)
        y = x.clone()
        assert directed(round_to_, y, fmt, mode)[0] is y
        assert_same_values(y, directed(round_to_, x.clone(), fmt, mode, native_on=False)[0])


@pytest.mark.parametrize("mode", ["toward_zero", "stochastic"])
def test_directed_modes_from_narrow_inputs_and_views(mode: str) -> None:
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(64, 130, generator=gen) * torch.exp2(torch.randint(-30, 30, (64, 130), generator=gen).float())
    for fmt in (FORMAT_PRESETS["fp16"], FORMAT_PRESETS["fp8_e4m3"], FloatFormat(5, 2, subnormals=False)):
        for x in (base.half(), base.bfloat16(), base.to(torch.float8_e5m2), base.t(), base[:, ::3]):
            assert_same_values(
                directed(round_to, x, fmt, mode)[0], directed(round_to, x, fmt, mode, native_on=False)[0]
            )
        x = base.clone()
        assert directed(round_to, x, fmt, mode, out=x)[0] is x  # out is x
        assert_same_values(x, directed(round_to, base, fmt, mode, native_on=False)[0])
        strided = base.clone()[:, ::3]
        directed(round_to_, strided, fmt, mode)
        assert_same_values(strided, directed(round_to, base[:, ::3], fmt, mode, native_on=False)[0])


def test_stochastic_kernel_rounds_up_with_the_probability_of_the_remainder() -> None:
    """Independent of the torch path: 1 + k/8 of the fp16 spacing at 1 rounds up in k/8 of 40000 draws (binomial
    bounds, 6 sigma), and toward_zero rounds down unless the value is on the grid (k = 8)."""
    n, s = 40_000, 2.0**-10
    for k in range(9):
        x = torch.full((n,), 1 + k / 8 * s, dtype=torch.float64)
        up = (round_to(x, "fp16", "stochastic", torch.Generator().manual_seed(k)) > 1).double().mean().item()
        p = k / 8
        assert abs(up - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1e-12
        assert bool((round_to(x, "fp16", "toward_zero") == (1 + s if k == 8 else 1)).all())


def test_directed_kernel_rejects_formats_outside_float_format() -> None:
    fn = kernels._fn("mixprec_round_directed")
    x, out = torch.ones(4), torch.empty(4)
    assert fn(x.data_ptr(), 0, None, out.data_ptr(), 0, 4, 5, 10, 1, 0, 1, 1) == 0
    assert fn(x.data_ptr(), 4, None, out.data_ptr(), 0, 4, 5, 10, 1, 0, 1, 1) == -1  # source kind
    assert fn(x.data_ptr(), 0, None, out.data_ptr(), 0, 4, 8, 7, 0, 0, 1, 1) == -1  # 8 exponent bits without inf
