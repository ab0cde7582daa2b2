"""Random differential checks of the compiled CPU kernels against the torch path (``mixprec.native.disabled()``).

The other kernel tests walk fixed grids of sizes, chunk sizes and inputs chosen for each branch. This module
draws the cases at random instead (quantizer encode/decode, ``round_to``, emulated matmul, fp32 sum of
shards), so that combinations nobody listed are tried too: lengths and chunk sizes from 1 to a few thousand,
stream offsets on and off the 256-position grid, row strides, 1 or 2 threads, strided inputs and outputs, and
values mixed from normal data, ties, constants, signed zeros, subnormals, extremes and a few NaN/inf. Each
case must give the torch path's bits (encoded bytes, decoded values, rounded values, matmul results, sums);
the one freedom is the sign of a zero bound in a quantizer header.

``tests/test_native_fuzz.py`` runs a fixed, seeded sample in the suite. For a longer search, under
AddressSanitizer too (``docs/native.md``), run ``python tests/kernel_fuzz.py --minutes 10 --seed 1``: it
prints each failing case with the seed that reproduces it and exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable

import torch

from mixprec import native
from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.compress import MinMaxUInt8, ScaledFP8
from mixprec.emulate import FORMAT_PRESETS, MATMUL_PRESETS, FloatFormat, MatmulModel, matmul, round_to

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}  # same-width ints


def _length(rng: random.Random, top: int) -> int:
    """1 .. top, log-uniform, with a bias to the edges of 16-, 64- and 256-element vectors and groups."""
    n = max(1, round(math.exp(rng.uniform(0.0, math.log(top)))))
    if rng.random() < 0.3:
        n = max(1, rng.choice([16, 64, 256, 1024]) * max(1, n // 256) + rng.choice([-1, 0, 1]))
    return min(n, top)


def _values(rng: random.Random, shape: tuple[int, ...], nonfinite: bool) -> torch.Tensor:
    """fp32 values of one kind per row: normal data at a random scale, ties of the uint8 grid, a constant,
    signed zeros, subnormals, values near the fp32 maximum, a narrow range far from zero, or a mix of all."""
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    rows = []
    for _ in range(shape[0]):
        n = shape[1]
        r = torch.randn(n, generator=g)
        kind = rng.randrange(8)
        if kind == 0:
            row = r * 2.0 ** rng.randint(-40, 40)
        elif kind == 1:
            row = (torch.arange(n, dtype=torch.float32) + rng.randrange(511)) % 511 * 0.5
        elif kind == 2:
            row = torch.full((n,), rng.uniform(-4.0, 4.0))
        elif kind == 3:
            row = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, -0.0) + r * (torch.rand(n, generator=g) < 0.05)
        elif kind == 4:
            row = torch.randint(-300, 300, (n,), generator=g) * 1.401298464324817e-45
        elif kind == 5:
            row = torch.where(r > 0, 1.0, -1.0) * torch.finfo(torch.float32).max * torch.rand(n, generator=g)
        elif kind == 6:
            row = 1e20 * (1 + 1e-4 * torch.rand(n, generator=g))
        else:
            row = r * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
        rows.append(row)
    x = torch.stack(rows)
    if nonfinite and rng.random() < 0.2:
        flat = x.view(-1)
        for _ in range(rng.randint(1, 3)):
            flat[rng.randrange(flat.numel())] = rng.choice([math.nan, math.inf, -math.inf])
    return x


def _strided(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """x, or the same values as rows inside a wider buffer (row-contiguous, rows apart)."""
    if rng.random() < 0.5:
        return x.contiguous()
    pad = rng.randint(1, 17)
    base = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype)
    lead = rng.randint(0, pad)
    base[:, lead : lead + x.shape[1]] = x
    return base[:, lead : lead + x.shape[1]]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, with NaN where NaN (the bits of a NaN are not specified)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    bits = BITS[a.dtype]
    return torch.equal(a.contiguous().view(bits)[~nan_a], b.contiguous().view(bits)[~nan_b])


def _same_encoding(a: torch.Tensor, b: torch.Tensor, header: int) -> bool:
    """Equal codes; equal header words, or both zero (either sign), or both NaN."""
    if not torch.equal(a[:, header:], b[:, header:]):
        return False
    ha, hb = (t[:, :header].flatten().clone().view(torch.float32) for t in (a, b))
    same = (ha.view(torch.int32) == hb.view(torch.int32)) | ((ha == 0) & (hb == 0)) | (ha.isnan() & hb.isnan())
    return bool(same.all())


def _with_threads(n: int, fn: Callable[[], str | None]) -> str | None:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def quantizer_case(rng: random.Random) -> str | None:
    """One MinMaxUInt8 or ScaledFP8 encode (and, for nearest rounding, decode and reduce) on both paths."""
    fp8 = rng.random() < 0.4
    rounding = rng.choice(["nearest", "stochastic"])
    chunk = _length(rng, 5000)
    rows = rng.randint(1, 3)
    length = _length(rng, 40_000 // rows)
    dtype = rng.choice(FLOAT_DTYPES)
    # the compiled stochastic encode of fp32 rows on the 256-position grid scans each chunk for min, max and
    # NaN inside the codes loop of the chunk before it: several such chunks, with a NaN now and then
    ahead = not fp8 and rng.random() < 0.2
    if ahead:
        rounding, dtype, rows = "stochastic", torch.float32, rng.randint(1, 2)
        chunk = rng.choice([512, 1024, 2048, 4096]) + rng.choice([0, 0, 64, 100])
        length = chunk * rng.randint(2, 5) + rng.randrange(chunk)
    q = (
        ScaledFP8(rng.choice(["e4m3", "e5m2"]), chunk_size=chunk, rounding=rounding, check_finite="flag")
        if fp8
        else MinMaxUInt8(chunk_size=chunk, rounding=rounding)
    )
    x = _strided(_values(rng, (rows, length), nonfinite=True).to(dtype), rng)
    offset = rng.choice([0, 256 * rng.randrange(4096), rng.randrange(1 << 20)])
    row_stride = length + rng.choice([0, rng.randrange(300), (-length) % 256])
    if ahead:
        offset, row_stride = 256 * rng.randrange(4096), length + (-length) % 256
        for _ in range(rng.choice([0, 1, 1, 2])):
            x[rng.randrange(rows), rng.randrange(length)] = math.nan
    key = rng.getrandbits(64)
    threads = rng.choice([1, 2])
    what = (
        f"{type(q).__name__}(chunk_size={chunk}, rounding={rounding!r}) rows={rows} length={length} "
        f"dtype={dtype} offset={offset} row_stride={row_stride} threads={threads}"
    )

    def run() -> str | None:
        outs = []
        for disabled in (False, True):
            out = torch.full((rows, q.encoded_nbytes(length)), 0xAB, dtype=torch.uint8)
            with native.disabled() if disabled else contextlib.nullcontext():
                bad = q.encode_rows(x, out, key=key, offset=offset, row_stride=row_stride)
            outs.append((out, bad))
        (fast, bad_fast), (ref, bad_ref) = outs
        # a MinMaxUInt8 header's zero bound may be either zero; ScaledFP8's scales are exact
        same = torch.equal(fast, ref) if fp8 else _same_encoding(fast, ref, 8 * q.num_chunks(length))
        if bad_fast != bad_ref or not same:
            return f"encode differs: {what}"
        if rounding == "stochastic":
            return None
        out_dtype = rng.choice(FLOAT_DTYPES)
        got = torch.empty(rows, length + 3, dtype=out_dtype)[:, 2 : 2 + length]
        want = torch.empty(rows, length, dtype=out_dtype)
        n_fast = q.decode_rows(ref, length, got)
        with native.disabled():
            n_ref = q.decode_rows(ref, length, want)
        if n_fast != n_ref or not _same_values(got, want):
            return f"decode to {out_dtype} differs: {what}"
        order = rng.sample(range(rows), rows)
        s_fast, s_ref = torch.empty(length), torch.empty(length)
        n_fast = q.decode_rows(ref[order], length, s_fast, reduce=True)
        with native.disabled():
            n_ref = q.decode_rows(ref[order], length, s_ref, reduce=True)
        if n_fast != n_ref or not _same_values(s_fast, s_ref):
            return f"decode-sum of rows {order} differs: {what}"
        return None

    return _with_threads(threads, run)


def _random_format(rng: random.Random) -> FloatFormat:
    if rng.random() < 0.5:
        return rng.choice(list(FORMAT_PRESETS.values()))
    exp_bits = rng.randint(2, 8)
    man_bits = rng.randint(1, 23)
    return FloatFormat(
        exp_bits,
        man_bits,
        has_inf=exp_bits == 8 or rng.random() < 0.7,  # an "fn" format with 8 exponent bits exceeds fp32
        saturate=rng.random() < 0.3,
        subnormals=rng.random() < 0.7,
    )


def rounding_case(rng: random.Random) -> str | None:
    """One ``round_to`` (nearest, toward_zero or stochastic from the same seed) on both paths."""
    fmt = _random_format(rng)
    mode = rng.choice(["nearest", "nearest", "toward_zero", "stochastic"])
    n = _length(rng, 70_000)
    x = _strided(_values(rng, (1, n), nonfinite=True), rng)[0]
    if rng.random() < 0.3:
        x = x.to(rng.choice([torch.float16, torch.bfloat16]))
    seed = rng.getrandbits(62)
    threads = rng.choice([1, 2])
    what = f"round_to({fmt}, {mode!r}) n={n} dtype={x.dtype} contiguous={x.is_contiguous()} threads={threads}"

    def run() -> str | None:
        got = round_to(x, fmt, mode, torch.Generator().manual_seed(seed))
        with native.disabled():
            want = round_to(x, fmt, mode, torch.Generator().manual_seed(seed))
        return None if _same_values(got, want) else f"values differ: {what}"

    return _with_threads(threads, run)


def matmul_case(rng: random.Random) -> str | None:
    """One emulated matmul (a preset or a random model) on both paths. The data keeps every K group's fp64 sum
    exact (docs/emulate.md: the kernel may add a group's products in another order): multiples of 2**-9 below
    2**5, so the products are multiples of 2**-18 below 2**10."""
    if rng.random() < 0.5:
        model: MatmulModel | str = rng.choice([m for m, v in MATMUL_PRESETS.items() if v.align_bits is None])
    else:
        k_group = rng.choice([1, 2, 4, 8, 16, 32])
        promote = rng.choice([None, k_group * rng.randint(1, 4)])
        model = MatmulModel(
            inputs=rng.choice(["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]),
            accumulator=rng.choice(["fp16", "bf16", "fp32"]),
            k_group=k_group,
            promote_every=promote,
        )
    m, n, k = _length(rng, 70), _length(rng, 70), _length(rng, 300)
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    shape_a, shape_b = (m, k), (k, n)
    if rng.random() < 0.3:
        batch = rng.randint(2, 3)
        shape_a, shape_b = (batch, m, k), (batch, k, n)

    def data(shape: tuple[int, ...]) -> torch.Tensor:
        ints = torch.randint(-8, 9, shape, generator=g).float()
        pick = torch.randint(0, 3, shape, generator=g)
        normal = torch.round(torch.randn(shape, generator=g).clamp(-3.9, 3.9) * 64) / 64
        x = torch.where(pick == 0, ints * 0.25, normal) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
        x = x.masked_fill(pick == 2, 0.0)
        return x.masked_fill((pick == 2) & (torch.rand(shape, generator=g) < 0.5), -0.0)

    a, b = data(shape_a), data(shape_b)
    if rng.random() < 0.3:
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    threads = rng.choice([1, 2])
    what = f"matmul({model}) a={tuple(a.shape)} b={tuple(b.shape)} threads={threads}"

    def run() -> str | None:
        got = matmul(a, b, mode=model)
        with native.disabled():
            want = matmul(a, b, mode=model)
        return None if _same_values(got, want) else f"values differ: {what}"

    return _with_threads(threads, run)


def sum_case(rng: random.Random) -> str | None:
    """One fp32 sum of shards (``mixprec.comm.fp32_sum``) on both paths: any wire and output dtype, averaging,
    a scale factor, strided shards. The results must have the same bits, NaN payloads included (the compiled
    sum hands a block with NaN back to the torch path)."""
    rows, n = rng.randint(1, 8), _length(rng, 70_000)
    wire, out_dtype = rng.choice(FLOAT_DTYPES), rng.choice(FLOAT_DTYPES)
    shards = _strided(_values(rng, (rows, n), nonfinite=True).to(wire), rng)
    average = rng.random() < 0.5
    factor = rng.choice([None, 2.0 ** rng.randint(-8, 8), rng.uniform(-2.0, 2.0)])
    threads = rng.choice([1, 2])
    what = f"sum of {rows} x {n} {wire} into {out_dtype} average={average} factor={factor} threads={threads}"

    def run() -> str | None:
        outs = []
        for disabled in (False, True):
            out = torch.full((n,), 7.0, dtype=out_dtype)
            with native.disabled() if disabled else contextlib.nullcontext():
                sum_shards_into(out, shards, average=average, rounding="nearest", generator=None, factor=factor)
            outs.append(out.view(BITS[out_dtype]))
        return None if torch.equal(outs[0], outs[1]) else f"values differ: {what}"

    return _with_threads(threads, run)


CASES: list[Callable[[random.Random], str | None]] = [
    quantizer_case,
    quantizer_case,
    rounding_case,
    matmul_case,
    sum_case,
]


def run_case(seed: int) -> str | None:
    """The case of ``seed``: None when both paths agree, else what differs (and the seed)."""
    rng = random.Random(seed)
    failure = rng.choice(CASES)(rng)
    return None if failure is None else f"seed {seed}: {failure}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to draw cases (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="first case seed; case i has seed + i")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    if native.library() is None:
        print(f"nothing to compare: {native.describe()}")
        return 0
    print(native.describe(), flush=True)
    end, i, failures = time.monotonic() + 60.0 * args.minutes, 0, 0
    while time.monotonic() < end:
        failure = run_case(args.seed + i)
        if failure is not None:
            failures += 1
            print(failure, flush=True)
        i += 1
    print(f"{i} cases from seed {args.seed}, {failures} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
