"""MinMaxUInt8: bit-exact against an independent numpy reference, error bounds, unbiasedness, format, errors."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from compress_reference import U32, as_f32, call_randoms, ref_decode, ref_encode, roundtrip_bound
from mixprec import native
from mixprec.compress import MinMaxUInt8, NonFiniteError, ScaledFP8

CHUNK = 256


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    n = 5 * CHUNK + 37  # a short last chunk
    return {
        "random": torch.randn(n, generator=g),
        "constant": torch.full((n,), 3.0517578125e-05),
        "zero": torch.zeros(n),
        "negative_zero": torch.full((n,), -0.0),
        # |min| / R = 1e6: the naive x*s - min*s form loses every code (see test_offset_first_matters)
        "huge_offset": 987654.3 + 1.7 * torch.rand(n, generator=g),
        "huge_offset_1e30": 1e30 * (1 + 1e-3 * torch.rand(n, generator=g)),
        "subnormal": torch.randint(-40, 40, (n,), generator=g).float() * 1.401298464324817e-45,
        "tiny_normal": torch.randn(n, generator=g) * 1e-36,  # R just above the float64 fallback threshold
        "mixed_sign": torch.randn(n, generator=g) * torch.logspace(-20, 20, n),
        "near_fp32_max": torch.tensor([3.0e38, -3.0e38, 0.0, 1.0, -2.5e38] * (n // 5) + [0.0] * (n % 5)),
        "one_outlier": torch.cat([torch.randn(n - 1, generator=g) * 1e-3, torch.tensor([50.0])]),
        # 90% exact zeros (embeddings, masked layers): the grid is aligned to 0 in every chunk
        "sparse": torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.1),
        # large magnitudes on both sides of 0, and 0 at a chunk's maximum
        "offset_1e4_with_zeros": torch.cat([1e4 * torch.randn(n - 3, generator=g), torch.zeros(3)]),
        "nonpositive": -torch.rand(n, generator=g) * (torch.rand(n, generator=g) < 0.5),
    }


CASES = _cases()


@contextlib.contextmanager
def _on(path: str) -> Iterator[None]:
    """Run the block on the compiled kernels (when this machine has them) or on the torch path."""
    if path == "torch":
        with native.disabled():
            yield
    else:
        yield


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encode_decode_bit_exact_against_reference(name: str, rounding: str, path: str) -> None:
    x = CASES[name]
    seed = 7
    q = MinMaxUInt8(chunk_size=CHUNK, rounding=rounding, generator=torch.Generator().manual_seed(seed))
    with _on(path):
        buf = q.encode(x)
        decoded = q.decode(buf, x.numel())
    (randoms,) = call_randoms(torch.Generator().manual_seed(seed), x.numel())
    expected = ref_encode(as_f32(x), CHUNK, rounding, randoms)
    assert buf.numpy().tobytes() == expected
    np.testing.assert_array_equal(decoded.numpy(), ref_decode(expected, x.numel(), CHUNK))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_roundtrip_error_within_bound(name: str, rounding: str) -> None:
    # Bound from the module docstring: k*step + 6.1 u R + 1.1 u M + 2**-150, k = 1/2 or 1.
    x = CASES[name]
    q = MinMaxUInt8(chunk_size=CHUNK, rounding=rounding, generator=torch.Generator().manual_seed(3))
    y = q.decode(q.encode(x), x.numel())
    xf = as_f32(x).astype(np.float64)
    err = np.abs(y.numpy().astype(np.float64) - xf)
    bound = roundtrip_bound(as_f32(x), CHUNK, rounding)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), f"element {worst}: error {err[worst]:.6g} > bound {bound[worst]:.6g}"


def test_bound_is_tight_for_random_data() -> None:
    # The half-step term is attained (nearly): the check above is not vacuous.
    x = CASES["random"]
    q = MinMaxUInt8(chunk_size=CHUNK)
    err = (q.decode(q.encode(x), x.numel()) - x).abs().double().numpy()
    step = np.array([(c.max() - c.min()).item() / 255 for c in x.double().split(CHUNK)])
    per_chunk = np.array([e.max() for e in np.array_split(err, np.arange(CHUNK, x.numel(), CHUNK))])
    assert (per_chunk > 0.45 * step).all()


def test_constant_and_zero_chunks_decode_exactly() -> None:
    q = MinMaxUInt8(chunk_size=CHUNK)
    for value in (0.0, -0.0, 1.0, -7.25e-41, 3.4e38, 1e-45):
        x = torch.full((3 * CHUNK + 5,), value)
        y = q.decode(q.encode(x), x.numel())
        # Exact in value; bitwise too except the sign of a zero (min + 0 * 0 turns -0.0 into +0.0).
        assert torch.equal(y, x), value
        if value != 0.0:
            assert torch.equal(y.view(torch.int32), x.view(torch.int32)), value
    x = torch.zeros(1000)
    buf = q.encode(x)
    assert not buf.any()  # header (0.0, 0.0) and codes 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_and_output(dtype: torch.dtype) -> None:
    x = (torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    q = MinMaxUInt8(chunk_size=CHUNK)
    buf = q.encode(x)
    assert buf.numpy().tobytes() == ref_encode(as_f32(x), CHUNK)  # inputs widen to fp32 exactly
    y = q.decode(buf, x.numel(), dtype)
    assert y.dtype == dtype
    # The fp32 decode rounded once more to dtype: this is what the bound's u_out term covers.
    assert torch.equal(y, q.decode(buf, x.numel()).to(dtype))
    err = (y.double() - x.double()).abs().numpy()
    assert (err <= roundtrip_bound(as_f32(x), CHUNK, "nearest", dtype)).all()


def test_offset_first_matters() -> None:
    # In code space: ours is within 1/2 + 3.01 * 255 u codes of the exact q = (x - min) * 255 / R (the fp32
    # roundings of d, scale and q, 3u relative on q <= 255); the naive form x*s - min*s cancels two numbers
    # of size |min| * s and is off by ~u * |min| * s, about 15 codes here (|min| / R = 1e6).
    x = CASES["huge_offset"][:CHUNK]
    x64 = x.double()
    mn, mx = x64.min(), x64.max()
    exact_q = (x64 - mn) * 255 / (mx - mn)
    q = MinMaxUInt8(chunk_size=CHUNK)
    codes = q.encode(x)[8:].double()
    assert (codes - exact_q).abs().max().item() <= 0.5 + 3.01 * 255 * U32
    s = torch.tensor(255.0 / (mx - mn).item(), dtype=torch.float32)
    naive_codes = (x * s - mn.float() * s).round().clamp(0, 255).double()
    assert (naive_codes - exact_q).abs().max().item() > 5


def test_stochastic_rounding_is_unbiased() -> None:
    # Each element sits at a fractional code position; its mean over n draws must be within 5 sigma of
    # the true value, sigma = (step/2)/sqrt(n) (per-draw variance <= step^2/4), plus the deterministic
    # arithmetic bias 6.1 u R + 1.1 u M. With 64 elements, P(any false alarm) < 64 * 6e-7.
    chunk, n = 64, 4000
    frac = torch.linspace(0.01, 0.99, chunk - 2, dtype=torch.float64)
    x = torch.cat([torch.tensor([0.0]), frac * 10 / 255 * 7.0 + 20 / 255, torch.tensor([10.0])]).float()
    x = x + 100.0  # an offset, so the arithmetic terms are present
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic", generator=torch.Generator().manual_seed(11))
    # n copies of the chunk in one tensor: each copy is its own chunk with its own draws
    draws = q.decode(q.encode(x.repeat(n)), n * chunk).double().view(n, chunk)
    rng, big = 10.0, 110.0
    step = rng / 255
    sigma = step / 2 / math.sqrt(n)
    allowed = 5 * sigma + 6.1 * U32 * rng + 1.1 * U32 * big
    bias = (draws.mean(0) - x.double()).abs()
    assert bias.max().item() <= allowed, bias.max().item() / sigma
    # The same check fails for round-to-nearest (biased for a fixed input): the test can fail.
    qn = MinMaxUInt8(chunk_size=chunk)
    assert (qn.decode(qn.encode(x), chunk).double() - x.double()).abs().max().item() > 10 * allowed
    assert (draws - x.double()).abs().max().item() <= step + 6.1 * U32 * rng + 1.1 * U32 * big


def test_stochastic_draws_one_key_per_encode() -> None:
    # Each encode draws one 64-bit Philox key (two 32-bit randint draws), whatever its size.
    x = torch.randn(1000)
    g = torch.Generator().manual_seed(0)
    q = MinMaxUInt8(chunk_size=100, rounding="stochastic", generator=g)
    q.encode(x)
    q.encode(x[:10])
    after = torch.rand(1, generator=g)
    replay = torch.Generator().manual_seed(0)
    call_randoms(replay, 1000)
    call_randoms(replay, 10)
    assert torch.equal(after, torch.rand(1, generator=replay))
    # Nearest rounding draws nothing.
    g2 = torch.Generator().manual_seed(0)
    MinMaxUInt8(chunk_size=100, generator=g2).encode(x)
    assert torch.equal(torch.rand(1, generator=g2), torch.rand(1, generator=torch.Generator().manual_seed(0)))


def test_header_round_trip_and_layout() -> None:
    x = CASES["mixed_sign"]
    q = MinMaxUInt8(chunk_size=CHUNK)
    buf = q.encode(x)
    chunks = q.num_chunks(x.numel())
    assert chunks == math.ceil(x.numel() / CHUNK)
    assert buf.numel() == 8 * chunks + x.numel() == q.encoded_nbytes(x.numel())
    mins, maxs = q.header(buf, x.numel())
    parts = x.split(CHUNK)
    assert torch.equal(mins, torch.stack([p.min() for p in parts]))
    assert torch.equal(maxs, torch.stack([p.max() for p in parts]))
    raw = np.frombuffer(buf.numpy().tobytes()[: 8 * chunks], dtype="<f4")  # documented: mins then maxs
    np.testing.assert_array_equal(raw[:chunks], mins.numpy())
    np.testing.assert_array_equal(raw[chunks:], maxs.numpy())
    # out= reuse returns the same storage and the same bytes
    out = torch.empty_like(buf)
    assert q.encode(x, out=out).data_ptr() == out.data_ptr() and torch.equal(out, buf)
    dec = torch.empty(x.numel())
    assert q.decode(buf, x.numel(), out=dec).data_ptr() == dec.data_ptr()
    assert q.encode(torch.empty(0)).numel() == 0 and q.decode(torch.empty(0, dtype=torch.uint8), 0).numel() == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_input_is_raised_or_flagged(bad: float) -> None:
    x = torch.randn(4 * CHUNK)
    x[CHUNK + 3] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf in 1 of its 4 chunks"):
        MinMaxUInt8(chunk_size=CHUNK).encode(x)
    q = MinMaxUInt8(chunk_size=CHUNK, check_finite="flag")
    buf = q.encode(x)
    assert q.found_nonfinite(buf, x.numel())
    assert not q.found_nonfinite(q.encode(torch.randn(4 * CHUNK)), 4 * CHUNK)
    y = q.decode(buf, x.numel())
    assert y[CHUNK : 2 * CHUNK].isnan().all()  # the whole flagged chunk, never a finite value
    clean = torch.cat([x[:CHUNK], x[2 * CHUNK :]])
    assert torch.equal(torch.cat([y[:CHUNK], y[2 * CHUNK :]]), q.decode(q.encode(clean), clean.numel()))
    assert not buf[8 * 4 + CHUNK : 8 * 4 + 2 * CHUNK].any()  # flagged chunk's codes are zero


def test_bad_arguments() -> None:
    for kwargs, exc, match in [
        ({"chunk_size": 0}, ValueError, "chunk_size must be an int >= 1"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size"),
        ({"chunk_size": True}, TypeError, "chunk_size"),
        ({"rounding": "up"}, ValueError, "rounding must be one of 'nearest', 'stochastic'"),
        ({"check_finite": "warn"}, ValueError, "check_finite must be one of 'raise', 'flag'"),
        ({"generator": 3}, TypeError, "generator must be a torch.Generator"),
    ]:
        with pytest.raises(exc, match=match):
            MinMaxUInt8(**kwargs)
    with pytest.raises(TypeError):
        MinMaxUInt8(256)  # keyword-only
    q = MinMaxUInt8(chunk_size=CHUNK)
    dtypes = r"torch\.float32 or torch\.float16 or torch\.bfloat16"
    with pytest.raises(TypeError, match=rf"tensor must have dtype {dtypes}; got torch\.int64"):
        q.encode(torch.arange(10))
    with pytest.raises(TypeError, match=r"tensor must have dtype torch\.float32.*got torch\.float64"):
        q.encode(torch.randn(10, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor"):
        q.encode([1.0, 2.0])
    buf = q.encode(torch.randn(300))
    with pytest.raises(ValueError, match=r"buffer must hold encoded_nbytes\(301\) = 317 bytes"):
        q.decode(buf, 301)
    with pytest.raises(TypeError, match=r"buffer must have dtype torch\.uint8; got torch\.int8"):
        q.decode(buf.view(torch.int8), 300)
    with pytest.raises(ValueError, match=r"buffer must be a 1-D uint8 tensor; got shape \(1, 317\)"):
        q.decode(q.encode(torch.randn(301)).view(1, -1), 301)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        q.decode(buf, 300, "float32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        q.decode(buf, 300, torch.float64)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch\.float32 tensor of 300"):
        q.decode(buf, 300, out=torch.empty(299))
    with pytest.raises(ValueError, match="out must hold encoded_nbytes"):
        q.encode(torch.randn(300), out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        q.decode(buf, -1)
    # Stochastic rounding draws on the tensor's device: a generator elsewhere is refused before anything runs.
    sq = MinMaxUInt8(chunk_size=CHUNK, rounding="stochastic", generator=torch.Generator())
    with pytest.raises(ValueError, match="generator is on cpu but the tensor is on meta"):
        sq.encode(torch.empty(10, device="meta"))


def test_row_api_matches_encode_and_decode_row_by_row() -> None:
    rows, length = 3, 2 * CHUNK + 37
    g = torch.Generator().manual_seed(21)
    base = torch.randn(rows, length + 5, generator=g) * torch.tensor([[1.0], [1e3], [1e-3]])
    x = base[:, 2 : 2 + length]  # strided rows, each row contiguous
    q = MinMaxUInt8(chunk_size=CHUNK)
    out = torch.empty(rows, q.encoded_nbytes(length), dtype=torch.uint8)
    x[1, 7] = float("nan")
    assert q.encode_rows(x, out) == 1  # the flagged chunk is counted, not raised
    for r in range(rows):
        expected = MinMaxUInt8(chunk_size=CHUNK, check_finite="flag").encode(x[r])
        assert torch.equal(out[r], expected)
    decoded = torch.empty(rows, length, dtype=torch.bfloat16)
    assert q.decode_rows(out, length, decoded) == 1
    for r in range(rows):
        torch.testing.assert_close(decoded[r], q.decode(out[r], length, torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    # reduce=True: the fp32 sum of the decoded rows, in row order
    keep = out[[0, 2]]
    summed = torch.empty(length)
    assert q.decode_rows(keep, length, summed, reduce=True) == 0
    assert torch.equal(summed, q.decode(keep[0], length) + q.decode(keep[1], length))
    # stochastic rounding with a given key: the same codes as encode drawing that key itself
    sq = MinMaxUInt8(chunk_size=CHUNK, rounding="stochastic", generator=torch.Generator().manual_seed(5))
    key = MinMaxUInt8(rounding="stochastic", generator=torch.Generator().manual_seed(5)).draw_key()
    one = torch.empty(1, q.encoded_nbytes(length), dtype=torch.uint8)
    sq.encode_rows(x[:1], one, key=key)
    assert torch.equal(one[0], sq.encode(x[0]))
    # Rows cut into segments of whole chunks, each encoded at its stream positions (offset + r * row_stride):
    # the same bytes as one encode_rows of the whole rows (what the pipelined collectives rely on).
    whole = torch.randn(rows, 4 * CHUNK + 11, generator=g)
    n = whole.shape[1]
    key = sq.draw_key()
    expected = torch.empty(rows, q.encoded_nbytes(n), dtype=torch.uint8)
    sq.encode_rows(whole, expected, key=key, offset=5, row_stride=n + 3)
    codes = torch.empty(rows, n, dtype=torch.uint8)
    for a, b in [(0, CHUNK), (CHUNK, 3 * CHUNK), (3 * CHUNK, n)]:
        seg = torch.empty(rows, q.encoded_nbytes(b - a), dtype=torch.uint8)
        sq.encode_rows(whole[:, a:b], seg, key=key, offset=5 + a, row_stride=n + 3)
        codes[:, a:b] = seg[:, 8 * q.num_chunks(b - a) :]
    assert torch.equal(codes, expected[:, 8 * q.num_chunks(n) :])


def test_row_api_with_no_rows_does_nothing() -> None:
    q = MinMaxUInt8(chunk_size=CHUNK, rounding="stochastic")
    assert q.encode_rows(torch.empty(0, 300), torch.empty(0, q.encoded_nbytes(300), dtype=torch.uint8)) == 0
    assert q.decode_rows(torch.empty(0, q.encoded_nbytes(300), dtype=torch.uint8), 300, torch.empty(0, 300)) == 0


def test_row_api_refuses_bad_shapes_and_dtypes() -> None:
    q = MinMaxUInt8(chunk_size=CHUNK)
    x = torch.randn(2, 300)
    out = torch.empty(2, q.encoded_nbytes(300), dtype=torch.uint8)
    for call, exc, match in [
        (lambda: q.encode_rows(x[0], out), ValueError, r"x must be 2-D; got shape \(300,\)"),
        (lambda: q.encode_rows(x.double(), out), TypeError, "x must have dtype"),
        (lambda: q.encode_rows(x, out[:1]), ValueError, r"out must be of shape \[2, 316\]"),
        (lambda: q.encode_rows(x.t().contiguous().t(), out), ValueError, "each row of x must be contiguous"),
        (lambda: q.encode_rows(x, out, offset=-1), ValueError, "offset must be an int >= 0"),
        (lambda: q.encode_rows(x, out, row_stride=1.5), TypeError, "row_stride"),
        (lambda: q.encode_rows(x, out, offset=2**62), ValueError, "at most 2\\*\\*62"),
        (lambda: q.decode_rows(out, 301, torch.empty(2, 301)), ValueError, r"buffers must be of shape \[R, 317\]"),
        (lambda: q.decode_rows(out, 300, torch.empty(3, 300)), ValueError, r"out must be of shape \[2, 300\]"),
        (lambda: q.decode_rows(out, 300, torch.empty(300).half(), reduce=True), TypeError, "torch.float32"),
        (lambda: q.decode_rows(out, 300, torch.empty(2, 300), reduce=True), ValueError, "out must be 1-D"),
        (lambda: q.decode_rows(out, 300, torch.empty(300), reduce=1), TypeError, "reduce must be a bool"),
        (lambda: q.decode_rows(out, -1, torch.empty(2, 0)), ValueError, "length must be an int >= 0"),
        (lambda: q.decode_rows(out[:0], 300, torch.empty(300), reduce=True), ValueError, "at least one row to sum"),
    ]:
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_decodes_to_exactly_zero(rounding: str, dtype: torch.dtype) -> None:
    # Every chunk holding 0 between its min and max is aligned to 0 (a zero point on the integer grid).
    g = torch.Generator().manual_seed(9)
    n = 40 * CHUNK
    x = torch.randn(n, generator=g) * torch.logspace(-8, 4, n)
    x[torch.rand(n, generator=g) < 0.9] = 0.0
    x = x.to(dtype)
    q = MinMaxUInt8(chunk_size=CHUNK, rounding=rounding, generator=torch.Generator().manual_seed(4))
    y = q.decode(q.encode(x), n, dtype)
    assert (y[x == 0] == 0).all()
    assert (y[x != 0] != 0).any()


def test_sparse_example_keeps_its_zeros() -> None:
    # [-0.3, 0, 0, 1]: min-offset grid gave 0.000784 for the zeros; the aligned grid (step 1.3 / 254,
    # zero point ceil(0.3 / step) = 59) gives exactly 0 and keeps both ends within half a step.
    q = MinMaxUInt8(chunk_size=4)
    x = torch.tensor([-0.3, 0.0, 0.0, 1.0])
    buf = q.encode(x)
    assert buf[8:].tolist() == [0, 59, 59, 254]
    y = q.decode(buf, 4)
    assert y[1].item() == 0.0 and y[2].item() == 0.0
    assert (y - x).abs().max().item() <= 0.5 * 1.3 / 254 * (1 + 1e-6)


def test_zero_point_is_the_exact_ceiling() -> None:
    # zero * step >= -min > (zero - 1) * step, in exact arithmetic, for chunks whose fp64 quotient -min / step
    # lands on or next to an integer.
    q = MinMaxUInt8(chunk_size=2)
    for lo in [-1.0, -0.5, -1 / 3, -(2.0**-20), -127.0, -0.999999940395]:
        for hi in [1.0, 0.0, 2.0**-20, 3.0, 254.0]:
            x = torch.tensor([lo, hi])
            mins, maxs = q.header(q.encode(x), 2)
            _, _, _, _, zero, step = MinMaxUInt8.grid(mins, maxs)
            z, s = int(zero.item()), float(step.item())
            assert z * s >= -lo > (z - 1) * s, (lo, hi, z, s)
            assert q.decode(q.encode(torch.tensor([lo, 0.0, hi])), 3)[1].item() == 0.0


# ---------------------------------------------------------------------------------------------- memory overlap
N_OV = 64


def _overlap_case(q, case: str):
    """``(call, inputs that must stay untouched)`` for one way an output can share memory: with the input, or
    between its own rows (an expanded or as_strided tensor)."""
    n, nb = N_OV, q.encoded_nbytes(N_OV)
    g = torch.Generator().manual_seed(3)
    buf = q.encode(torch.randn(n, generator=g))
    rows = torch.stack([buf, buf, buf])
    if case == "encode, out overlaps tensor":
        store = torch.randn(n + nb, generator=g)
        return lambda: q.encode(store[:n], out=store.view(torch.uint8)[:nb]), store
    if case == "encode_rows, out rows expanded":
        x = torch.randn(3, n, generator=g)
        return lambda: q.encode_rows(x, torch.empty(1, nb, dtype=torch.uint8).expand(3, nb)), x
    if case == "encode_rows, out rows as_strided":
        x = torch.randn(3, n, generator=g)
        return lambda: q.encode_rows(x, torch.empty(nb + 10, dtype=torch.uint8).as_strided((3, nb), (5, 1))), x
    if case == "encode_rows, out overlaps x":
        store = torch.empty(4 * 3 * n + 3 * nb, dtype=torch.uint8)
        x = store.view(torch.float32)[: 3 * n].view(3, n).normal_(generator=g)
        return lambda: q.encode_rows(x, store[4 * n : 4 * n + 3 * nb].view(3, nb)), store
    if case == "decode, out overlaps buffer":
        store = torch.zeros(nb + 4 * n + 8, dtype=torch.uint8)
        store[:nb] = buf
        return lambda: q.decode(store[:nb], n, out=store[8 : 8 + 4 * n].view(torch.float32)), store
    if case == "decode_rows, out rows expanded":
        return lambda: q.decode_rows(rows, n, torch.empty(1, n).expand(3, n)), rows
    if case == "decode_rows, out rows as_strided":
        return lambda: q.decode_rows(rows, n, torch.empty(n + 10).as_strided((3, n), (5, 1))), rows
    if case == "decode_rows, out overlaps buffers":
        store = torch.zeros(3 * nb + 12 * n + 4, dtype=torch.uint8)
        store[: 3 * nb].view(3, nb).copy_(rows)
        out = store[4 : 4 + 12 * n].view(torch.float32).view(3, n)
        return lambda: q.decode_rows(store[: 3 * nb].view(3, nb), n, out), store
    assert case == "decode_rows reduce, out overlaps buffers"
    store = torch.zeros(4 * nb + 4 * n, dtype=torch.uint8)
    store[: 3 * nb].view(3, nb).copy_(rows)
    out = store[nb : nb + 4 * n].view(torch.float32)
    return lambda: q.decode_rows(store[: 3 * nb].view(3, nb), n, out, reduce=True), store


OVERLAP_CASES = [
    "encode, out overlaps tensor",
    "encode_rows, out rows expanded",
    "encode_rows, out rows as_strided",
    "encode_rows, out overlaps x",
    "decode, out overlaps buffer",
    "decode_rows, out rows expanded",
    "decode_rows, out rows as_strided",
    "decode_rows, out overlaps buffers",
    "decode_rows reduce, out overlaps buffers",
]


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("case", OVERLAP_CASES)
@pytest.mark.parametrize("codec", ["MinMaxUInt8", "ScaledFP8"])
def test_outputs_sharing_memory_are_refused_on_both_paths(codec: str, case: str, path: str) -> None:
    """The kernels wrote wrong bytes into such outputs (decoded values off by up to 4.7 for uint8, 239 for fp8)
    where the torch path raised torch's "refer to a single memory location" in some cases and not in others:
    both paths now refuse every one, before writing anything."""
    if path == "compiled" and native.library() is None:
        pytest.skip("no compiled kernels here")
    q = MinMaxUInt8(chunk_size=16) if codec == "MinMaxUInt8" else ScaledFP8(chunk_size=16)
    call, watched = _overlap_case(q, case)
    before = watched.clone()
    what = "overlap each other" if "rows expanded" in case or "as_strided" in case else "out overlaps"
    with _on(path), pytest.raises(ValueError, match=what):
        call()
    assert torch.equal(watched, before)


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("codec", ["MinMaxUInt8", "ScaledFP8"])
def test_rows_interleaved_in_one_buffer_are_accepted(codec: str, path: str) -> None:
    """Inputs and outputs may share one buffer when no byte is shared: rows interleaved with each other."""
    q = MinMaxUInt8(chunk_size=16) if codec == "MinMaxUInt8" else ScaledFP8(chunk_size=16)
    n, nb = N_OV, q.encoded_nbytes(N_OV)
    pitch = 4 * n + nb  # per row: n fp32 values, then the row's encoded bytes
    store = torch.zeros(3 * pitch, dtype=torch.uint8)
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(4))
    grid = store.view(3, pitch)
    xs = grid[:, : 4 * n].view(torch.float32)
    xs.copy_(x)
    codes = grid[:, 4 * n :]
    with _on(path):
        q.encode_rows(xs, codes)
        expected = torch.empty(3, nb, dtype=torch.uint8)
        q.encode_rows(x, expected)
        assert torch.equal(codes, expected)
        q.decode_rows(codes, n, xs)  # decoded over the values they were encoded from
        want = torch.empty(3, n)
        q.decode_rows(expected, n, want)
    assert torch.equal(xs, want)


@pytest.mark.parametrize("codec", ["MinMaxUInt8", "ScaledFP8"])
def test_meta_tensors_get_one_clear_error(codec: str) -> None:
    """Meta tensors have no values to encode or decode: "Tensor.item() cannot be called on meta tensors" came
    from deep inside; now a ValueError names the argument."""
    q = MinMaxUInt8(chunk_size=16) if codec == "MinMaxUInt8" else ScaledFP8(chunk_size=16)
    n, nb = N_OV, q.encoded_nbytes(N_OV)
    meta_buf = torch.empty(nb, dtype=torch.uint8, device="meta")
    meta_x, meta_out = torch.empty(2, n, device="meta"), torch.empty(2, nb, dtype=torch.uint8, device="meta")
    calls = {
        "tensor": lambda: q.encode(torch.empty(n, device="meta")),
        "x": lambda: q.encode_rows(meta_x, meta_out),
        "buffer": lambda: q.decode(meta_buf, n),
        "buffers": lambda: q.decode_rows(meta_buf.view(1, nb), n, torch.empty(1, n, device="meta")),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{name} is a meta tensor"):
            call()
    with pytest.raises(ValueError, match=r"^buffer is a meta tensor"):
        q.found_nonfinite(meta_buf, n)
