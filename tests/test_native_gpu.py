"""The Triton kernels (mixprec.native.gpu) against the CPU paths, bit for bit.

Two ways to run them: on a CUDA device through the public entry points (round_to, MinMaxUInt8, the emulated
matmul), compared with the same call on the CPU and with the torch path on the GPU (``native.disabled()``); and,
without a GPU, in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set in a child pytest) by calling the kernel
wrappers on CPU tensors. Both skip where ``triton`` is not installed (it is an optional dependency).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import mixprec.native as native
from mixprec.compress import MinMaxUInt8
from mixprec.core.formats import FloatFormat, get_format
from mixprec.core.rounding import round_to, round_to_
from mixprec.emulate.matmul import MATMUL_PRESETS, matmul_with_model
from mixprec.native import gpu

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton = pytest.mark.skipif(not gpu.available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(
    not (gpu.available() and torch.cuda.is_available()), reason="needs a CUDA device and triton"
)
interp_only = pytest.mark.skipif(not (INTERPRETING and gpu.available()), reason="runs in the child interpreter pytest")

FORMATS = [
    get_format("fp16"),
    get_format("bf16"),
    get_format("tf32"),
    get_format("fp8_e4m3"),
    get_format("fp8_e5m2"),
    FloatFormat(5, 22),  # the fp64 magic-constant path
    FloatFormat(8, 21),  # integer trick with half_m1 = 1: an argument Triton must not turn into a constant
    FloatFormat(8, 22),  # and with drop = 1
    FloatFormat(3, 2, has_inf=False),
    FloatFormat(4, 3, saturate=True, subnormals=False),
]


def _values(n: int = 6000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65520.0, 448.0, 464.0, 1e-8, -1e-8, 3e38, 2**-24]
    x[: len(special)] = torch.tensor(special)
    # exact ties of every format here: odd multiples of half a spacing
    x[100:400] = (torch.randint(-2000, 2000, (300,), generator=g) * 2 + 1).float() * 2.0**-12
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN matching NaN (payloads are not part of the contract)."""
    a, b = a.cpu(), b.cpu()
    bits = a.view(torch.int32) == b.view(torch.int32) if a.dtype == torch.float32 else a == b
    return bool((bits | (a.isnan() & b.isnan())).all())


def _quant_cases() -> list[tuple[torch.Tensor, int, dict]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5000, generator=g) * 3 + 1
    bad = x.clone()
    bad[1, 100] = math.nan
    bad[2, 4999] = math.inf
    grid = torch.randint(-4, 5, (2, 3000), generator=g).float() / 4  # values on the code grid: many ties
    wide = x.clone()
    wide[0, :2048] *= 1e-37  # a range whose step would be subnormal: the float64 path
    return [
        (x, 2048, {}),
        (x, 300, {"offset": 77, "row_stride": 6001}),
        (bad, 1024, {}),
        (grid, 512, {"offset": 300}),
        (grid.half(), 512, {}),
        (wide, 2048, {}),
        (x[:, :40], 1, {"offset": 5}),  # chunk_size 1: an argument Triton must not turn into a constant
    ]


# ------------------------------------------------------------------------------------- interpreter (no GPU)
@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="this is the parent test")
def test_kernels_in_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "test_interp_"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-2000:]


@interp_only
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interp_round_nearest(fmt: FloatFormat) -> None:
    x = _values()
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        xs = x.to(dt)
        dst = torch.empty(xs.shape, dtype=torch.float32)
        gpu.round_nearest(xs, dst, fmt)
        assert _same(dst, round_to(xs, fmt)), (fmt, dt)
    xd = x.double() * (1 + 2.0**-30)  # between fp32 values: one rounding from fp64
    for dst_dtype in (torch.float32, torch.float64):
        dst = torch.empty(xd.shape, dtype=dst_dtype)
        gpu.round_nearest_f64(xd, dst, fmt)
        ref = round_to(xd, fmt, out=torch.empty_like(dst))
        assert _same(
            dst.view(torch.int64) if dst_dtype == torch.float64 else dst,
            ref.view(torch.int64) if dst_dtype == torch.float64 else ref,
        )


@interp_only
@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_interp_uint8(case: int, rounding: str) -> None:
    x, chunk, pos = _quant_cases()[case]
    q = MinMaxUInt8(chunk_size=chunk, rounding=rounding)
    rows, length = x.shape
    ref = torch.empty(rows, q.encoded_nbytes(length), dtype=torch.uint8)
    key = 0xDEADBEEF12345678
    n_bad = q.encode_rows(x, ref, key=key, **pos)
    got = torch.full_like(ref, 7)
    stats = gpu.quant_encode_u8(
        x, got, chunk, rounding == "stochastic", key, pos.get("offset", 0), pos.get("row_stride", length)
    )
    assert stats.tolist() == [n_bad, int(case == 5)]
    hb = 8 * q.num_chunks(length)
    assert torch.equal(got[:, :hb], ref[:, :hb])
    codes_ok = got[:, hb:] == ref[:, hb:]
    if case == 5:  # the wide chunk is left to the caller (the torch float64 path)
        codes_ok[0, :2048] = True
    assert bool(codes_ok.all())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = torch.empty(rows, length, dtype=dtype)
        q.decode_rows(ref, length, want)
        have = torch.empty_like(want)
        assert gpu.quant_decode_u8(ref, length, have, chunk, False).tolist() == [n_bad, int(case == 5)]
        if case == 5:
            have[0, :2048] = want[0, :2048]
        assert _same(have, want), dtype
    want = torch.empty(length)
    q.decode_rows(ref, length, want, reduce=True)
    have = torch.empty(length)
    gpu.quant_decode_u8(ref, length, have, chunk, True)
    if case == 5:
        have[:2048] = want[:2048]
    assert _same(have, want)


@interp_only
@pytest.mark.parametrize("name", ["fp16/16", "fp16/32", "bf16/32", "two_stage"])
def test_interp_matmul(name: str) -> None:
    model = MATMUL_PRESETS[name]
    g = torch.Generator().manual_seed(2)
    for m, k, n in [(33, 70, 17), (64, 256, 64)]:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        want = matmul_with_model(a, b, model)
        acc = model.accumulator
        groups = -(-k // model.k_group)
        pg = 0 if model.promote_every is None else min(model.promote_every // model.k_group, groups)
        over = acc.max_finite if acc.saturate else math.inf
        dt = model.inputs.torch_dtype
        have = gpu.matmul_model(a.to(dt)[None], b.to(dt)[None], model.k_group, pg, 0 if acc.is_fp32 else 2, acc, over)
        assert _same(have[0], want), (m, k, n)


# ---------------------------------------------------------------------------------------------------- GPU
@needs_cuda
def test_gpu_dispatch_and_switch() -> None:
    x = torch.ones(4, device="cuda")
    assert gpu.can_run(x)
    with native.disabled():
        assert not gpu.can_run(x)
    assert not gpu.can_run(torch.ones(4))


@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gpu_round_to(fmt: FloatFormat) -> None:
    x = _values(1 << 16)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        xs = x.to(dt)
        want = round_to(xs, fmt)  # the CPU kernels
        have = round_to(xs.cuda(), fmt)
        with native.disabled():
            torch_path = round_to(xs.cuda(), fmt)
        assert _same(have, want), (fmt, dt)
        assert _same(have, torch_path), (fmt, dt)


@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS[:5], ids=lambda f: f.name)
def test_gpu_directed_round_to_keeps_the_torch_path(fmt: FloatFormat) -> None:
    """toward_zero and stochastic on CUDA tensors stay on the torch ops (the compiled kernel is CPU only):
    toward_zero equals the CPU kernel bit for bit, in round_to and in place; stochastic gives values on the
    grid, never nearer zero than toward_zero, and x itself where x is on the grid."""
    x = _values(1 << 16)
    tz = round_to(x.cuda(), fmt, "toward_zero")
    tz_cpu = round_to(x, fmt, "toward_zero")
    assert _same(tz, tz_cpu)
    sr = round_to(x.cuda(), fmt, "stochastic", torch.Generator(device="cuda").manual_seed(3)).cpu()
    finite = torch.isfinite(sr) & torch.isfinite(tz_cpu)
    assert _same(sr[finite], round_to(sr[finite], fmt))  # on the grid
    assert bool((sr[finite].abs() >= tz_cpu[finite].abs()).all())
    exact = finite & (round_to(x, fmt) == x)
    assert _same(sr[exact], x[exact])
    y = x.cuda()
    round_to_(y, fmt, "toward_zero")
    assert _same(y, tz)


@needs_cuda
@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gpu_uint8(case: int, rounding: str) -> None:
    x, chunk, pos = _quant_cases()[case]
    q = MinMaxUInt8(chunk_size=chunk, rounding=rounding)
    rows, length = x.shape
    key = 0x0123456789ABCDEF
    ref = torch.empty(rows, q.encoded_nbytes(length), dtype=torch.uint8)
    bad_ref = q.encode_rows(x, ref, key=key, **pos)
    got = torch.full_like(ref, 171, device="cuda")  # a byte no write left behind would show
    bad = q.encode_rows(x.cuda(), got, key=key, **pos)
    assert bad == bad_ref
    diff = (got.cpu() != ref).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at (row, byte) {diff[:8].tolist()}"
    with native.disabled():
        got_torch = torch.empty_like(got)
        q.encode_rows(x.cuda(), got_torch, key=key, **pos)
    assert torch.equal(got_torch, got)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = torch.empty(rows, length, dtype=dtype)
        q.decode_rows(ref, length, want)
        have = torch.empty(rows, length, dtype=dtype, device="cuda")
        assert q.decode_rows(got, length, have) == bad_ref
        assert _same(have, want), dtype
    want = torch.empty(length)
    q.decode_rows(ref, length, want, reduce=True)
    have = torch.empty(length, device="cuda")
    q.decode_rows(got, length, have, reduce=True)
    assert _same(have, want)


@needs_cuda
def test_gpu_uint8_large_stochastic_is_unbiased() -> None:
    """16M elements through the kernel: same bits as the CPU, and the mean code error is 0 within 4 sigma."""
    n = 1 << 24
    x = torch.rand(n, generator=torch.Generator().manual_seed(3))
    q = MinMaxUInt8(chunk_size=2048, rounding="stochastic", generator=torch.Generator(device="cuda").manual_seed(0))
    xc = x.cuda()
    buf = q.encode(xc)
    y = q.decode(buf, n)
    err = (y - xc).double()
    step = 1.0 / 255  # at most: each chunk's range is below 1
    # stochastic rounding: zero mean, variance <= step**2 / 4 per element; 4 standard deviations of the mean
    assert abs(float(err.mean())) < 4 * step / (2 * math.sqrt(n))
    keyed = MinMaxUInt8(chunk_size=2048, rounding="stochastic")  # explicit keys: no generator involved
    ref = torch.empty(1, keyed.encoded_nbytes(n), dtype=torch.uint8)
    keyed.encode_rows(x[None], ref, key=99)
    got = torch.empty_like(ref, device="cuda")
    keyed.encode_rows(xc[None], got, key=99)
    assert torch.equal(got.cpu(), ref)


@needs_cuda
@pytest.mark.parametrize("chunk", [1, 64, 2048])
def test_gpu_uint8_stochastic_scratch_does_not_grow_with_chunks(chunk: int) -> None:
    """The tie masks take 33 int32 per 1024 elements whatever the chunk size (they once took 2 x 33 per chunk:
    264 bytes per element at chunk_size 1), and the bits stay the CPU's."""
    n = 1 << 22
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic")
    ref = torch.empty(1, q.encoded_nbytes(n), dtype=torch.uint8)
    q.encode_rows(x[None], ref, key=7, offset=3)
    xc, got = x.cuda(), torch.empty_like(ref, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q.encode_rows(xc[None], got, key=7, offset=3)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - before
    assert scratch <= 4 * (2 + 33 * (n // 1024 + 1)) + 4096, scratch  # + the allocator's rounding
    assert torch.equal(got.cpu(), ref)


@needs_cuda
@pytest.mark.parametrize("name", ["fp16/16", "fp16/32", "bf16/32", "two_stage"])
def test_gpu_emulated_matmul(name: str) -> None:
    model = MATMUL_PRESETS[name]
    g = torch.Generator().manual_seed(4)
    for m, k, n in [(33, 70, 17), (128, 1024, 96)]:
        a, b = torch.randn(2, m, k, generator=g), torch.randn(k, n, generator=g)
        want = matmul_with_model(a, b, model)
        have = matmul_with_model(a.cuda(), b.cuda(), model)
        assert _same(have, want), (m, k, n, gpu.dot_path("cuda"))
        with native.disabled():
            torch_path = matmul_with_model(a.cuda(), b.cuda(), model)
        assert _same(have, torch_path)
