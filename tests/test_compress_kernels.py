"""The compiled quantizer kernels against the torch path, bit for bit, on adversarial inputs.

The torch path (``mixprec.native.disabled()``) is the oracle: tests/test_compress_quantize.py checks it against
an independent reference. Encoded bytes must be equal, except the sign of a zero bound in a header
(``torch.amin`` over +0.0 and -0.0 may return either; the value, the codes and every decoded bit are the
same); decoded values equal bit for bit, NaN where NaN (the bits of a NaN are not specified).
"""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import native
from mixprec.compress import MinMaxUInt8, ScaledFP8
from mixprec.native import kernels

pytestmark = pytest.mark.skipif(native.library() is None, reason="no compiled kernels on this machine")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32_MAX = torch.finfo(torch.float32).max


def _cases(length: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """[3, length] inputs of ``dtype`` (values beyond its range become +-inf, which is a case too)."""
    g = torch.Generator().manual_seed(length)
    r = torch.randn(3, length, generator=g)
    cases = {
        "random": r,
        "scaled_rows": r * torch.tensor([[1e-30], [1.0], [1e30]]),
        "constant": torch.full((3, length), -2.5),
        "zeros_both_signs": torch.where(torch.rand(3, length, generator=g) < 0.5, 0.0, -0.0),
        "sparse": r * (torch.rand(3, length, generator=g) < 0.1),
        "near_fp32_max": torch.where(r > 0, FP32_MAX, -FP32_MAX) * torch.rand(3, length, generator=g).clamp_min(0.9),
        "tiny_range": 1.0 + (torch.rand(3, length, generator=g) < 0.5) * 2.0**-23,  # R = 1 ulp
        "float64_path_small": torch.randn(3, length, generator=g) * 1e-37,  # R < 255 * fp32 tiny
        "subnormal": torch.randint(-300, 300, (3, length), generator=g) * 1.401298464324817e-45,
        "huge_offset": 1e30 * (1 + 1e-3 * torch.rand(3, length, generator=g)),
        "ties": torch.arange(3 * length, dtype=torch.float32).view(3, length) % 511 * 0.5,  # q = k / 2 exactly
        "logspace": torch.randn(3, length, generator=g) * torch.logspace(-38, 38, length),
    }
    bad = r.clone()
    bad[0, length // 2] = math.nan
    bad[1, 0] = math.inf
    bad[2, length - 1] = -math.inf
    cases["nonfinite"] = bad
    return {k: v.to(dtype) for k, v in cases.items()}


def _encode(q: MinMaxUInt8, x: torch.Tensor, **kw) -> tuple[torch.Tensor, int]:
    out = torch.full((x.shape[0], q.encoded_nbytes(x.shape[1])), 0xAB, dtype=torch.uint8)
    return out, q.encode_rows(x, out, **kw)


def _assert_same_encoding(q: MinMaxUInt8, a: torch.Tensor, b: torch.Tensor, length: int) -> None:
    hb = 8 * q.num_chunks(length)
    assert torch.equal(a[:, hb:], b[:, hb:]), "codes differ"
    ha, hb_ = a[:, :hb].contiguous().view(torch.float32), b[:, :hb].contiguous().view(torch.float32)
    same_bits = ha.view(torch.int32) == hb_.view(torch.int32)
    both_zero = (ha == 0) & (hb_ == 0)
    both_nan = ha.isnan() & hb_.isnan()
    assert (same_bits | both_zero | both_nan).all(), "headers differ"


def _assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = a.isnan(), b.isnan()
    assert torch.equal(nan_a, nan_b), "NaN in different places"
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    assert torch.equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b]), "values differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "chunk, length", [(1, 9), (7, 100), (256, 1000), (100, 12_000), (300, 7000), (511, 2100), (2048, 2048 + 5)]
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compiled_encode_and_decode_equal_torch(dtype: torch.dtype, chunk: int, length: int, rounding: str) -> None:
    q = MinMaxUInt8(chunk_size=chunk, rounding=rounding)
    for name, x in _cases(length, dtype).items():
        base = torch.zeros(3, length + 9, dtype=dtype)
        base[:, 4 : 4 + length] = x
        strided = base[:, 4 : 4 + length]  # rows 9 elements apart, each row contiguous
        kw = {"key": 0xDEADBEEF12345678, "offset": 3, "row_stride": length + 50}
        fast, bad_fast = _encode(q, strided, **kw)
        with native.disabled():
            ref, bad_ref = _encode(q, strided, **kw)
        assert bad_fast == bad_ref, name
        _assert_same_encoding(q, fast, ref, length)
        if rounding == "stochastic":
            # Stream positions on multiples of 256 too (the kernel reads Philox words in registers there).
            kw = {"key": 0xDEADBEEF12345678, "offset": 1280, "row_stride": 256 * (length // 256 + 2)}
            fast, _ = _encode(q, strided, **kw)
            with native.disabled():
                ref, _ = _encode(q, strided, **kw)
            _assert_same_encoding(q, fast, ref, length)
            continue  # decoding does not depend on how the codes were rounded
        for out_dtype in DTYPES:
            out_fast = torch.empty(3, length + 2, dtype=out_dtype)[:, 1 : 1 + length]  # strided rows again
            out_ref = torch.empty(3, length, dtype=out_dtype)
            assert q.decode_rows(ref, length, out_fast) == bad_ref
            with native.disabled():
                q.decode_rows(ref, length, out_ref)
            _assert_same_values(out_fast, out_ref)
        for rows in ([0], [0, 1], [2, 0, 1]):  # the fp32 sum in row order
            s_fast, s_ref = torch.empty(length), torch.empty(length)
            n_fast = q.decode_rows(ref[rows], length, s_fast, reduce=True)
            with native.disabled():
                n_ref = q.decode_rows(ref[rows], length, s_ref, reduce=True)
            assert n_fast == n_ref
            _assert_same_values(s_fast, s_ref)


def test_one_encode_through_the_public_api_on_both_paths() -> None:
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))  # parallel in the kernel
    for rounding in ("nearest", "stochastic"):
        q = MinMaxUInt8(rounding=rounding, generator=torch.Generator().manual_seed(2))
        fast = q.encode(x)
        q.generator.manual_seed(2)
        with native.disabled():
            ref = q.encode(x)
            y_ref = q.decode(ref, x.numel(), torch.bfloat16)
        assert torch.equal(fast, ref)
        _assert_same_values(q.decode(ref, x.numel(), torch.bfloat16), y_ref)


def test_empty_and_single_element() -> None:
    q = MinMaxUInt8(chunk_size=7, rounding="stochastic")
    for length in (0, 1):
        x = torch.full((2, length), 3.0)
        fast, _ = _encode(q, x, key=1)
        with native.disabled():
            ref, _ = _encode(q, x, key=1)
        assert torch.equal(fast, ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("chunk", [7, 40])  # 40: 16-lane groups and a tail in each chunk
def test_compiled_fp8_equals_torch(fmt: str, dtype: torch.dtype, rounding: str, chunk: int) -> None:
    length = 100
    q = ScaledFP8(fmt, chunk_size=chunk, rounding=rounding)
    cases = _cases(length, dtype)
    g = torch.Generator().manual_seed(11)
    cases["fp8_ties"] = (torch.arange(3 * length, dtype=torch.float32).view(3, length) * 0.0625 + 0.03125).to(dtype)
    # magnitudes 2**0 .. 2**-20 below the chunk's largest: the format's subnormals and below, and values just
    # under a power of two, which round up into the next binade
    cases["fp8_subnormal"] = (
        torch.randn(3, length, generator=g) * 2.0 ** -torch.randint(0, 21, (3, length), generator=g)
    ).to(dtype)
    edge = 2.0 ** torch.randint(-8, 8, (3, length), generator=g) * (
        2 - 2.0 ** -torch.randint(1, 8, (3, length), generator=g)
    )
    cases["fp8_binade_edges"] = (edge * torch.where(torch.rand(3, length, generator=g) < 0.5, 1.0, -1.0)).to(dtype)
    for name, x in cases.items():
        base = torch.zeros(3, length + 9, dtype=dtype)
        base[:, 4 : 4 + length] = x
        strided = base[:, 4 : 4 + length]
        kw = {"key": 0x0123456789ABCDEF, "offset": 3, "row_stride": length + 50}
        fast, bad_fast = _encode(q, strided, **kw)
        with native.disabled():
            ref, bad_ref = _encode(q, strided, **kw)
        assert bad_fast == bad_ref, name
        assert torch.equal(fast, ref), name
        if rounding == "stochastic":
            continue
        for out_dtype in DTYPES:
            out_fast = torch.empty(3, length + 2, dtype=out_dtype)[:, 1 : 1 + length]
            out_ref = torch.empty(3, length, dtype=out_dtype)
            assert q.decode_rows(ref, length, out_fast) == bad_ref
            with native.disabled():
                q.decode_rows(ref, length, out_ref)
            _assert_same_values(out_fast, out_ref)
        for rows in ([0], [2, 0, 1]):
            s_fast, s_ref = torch.empty(length), torch.empty(length)
            n_fast = q.decode_rows(ref[rows], length, s_fast, reduce=True)
            with native.disabled():
                n_ref = q.decode_rows(ref[rows], length, s_ref, reduce=True)
            assert n_fast == n_ref
            _assert_same_values(s_fast, s_ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_of_every_code_equals_torch(fmt: str) -> None:
    # All 256 codes (NaN, inf, subnormals, -0 among them) under three scales, through the compiled decode's
    # vector path (16 codes at a time) and its tail, against the torch path's table of torch's own casts.
    q = ScaledFP8(fmt, chunk_size=256)
    length = 3 * 256 - 5
    buf = torch.empty(2, q.encoded_nbytes(length), dtype=torch.uint8)
    scales = torch.tensor([1.0, 2.0**-40, 2.0**60])
    buf[:, :12] = scales.view(torch.uint8)
    buf[:, 12:] = torch.arange(length, dtype=torch.int64).remainder(256).to(torch.uint8)
    buf[1, 12:] = buf[1, 12:].flip(0)
    for out_dtype in DTYPES:
        fast, ref = torch.empty(2, length, dtype=out_dtype), torch.empty(2, length, dtype=out_dtype)
        q.decode_rows(buf, length, fast)
        with native.disabled():
            q.decode_rows(buf, length, ref)
        _assert_same_values(fast, ref)
    fast, ref = torch.empty(length), torch.empty(length)
    q.decode_rows(buf, length, fast, reduce=True)
    with native.disabled():
        q.decode_rows(buf, length, ref, reduce=True)
    _assert_same_values(fast, ref)
    # the check that lets the decode use arithmetic instead of the table: torch's table is recognised, and a
    # table that differs in one code is not (the decode then looks codes up)
    table = torch.arange(256, dtype=torch.uint8).view(q.dtype).float()
    assert kernels.fp8_table_format(table) == {"e4m3": 0, "e5m2": 1}[fmt]
    table[17] = table[18]
    assert kernels.fp8_table_format(table) == -1


def test_fp8_stochastic_codes_are_the_same_on_both_paths() -> None:
    # The compiled encoder and the torch path (whose primary bytes come from the compiled Philox when there is
    # one) draw the same bits and resolve the same ties: the bytes must not depend on the path.
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(6))
    q = ScaledFP8("e5m2", chunk_size=256, rounding="stochastic")
    out = torch.empty(3, q.encoded_nbytes(5000), dtype=torch.uint8)
    ref = torch.empty_like(out)
    q.encode_rows(x, out, key=77, offset=9, row_stride=6000)
    with native.disabled():
        q.encode_rows(x, ref, key=77, offset=9, row_stride=6000)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("codec", [MinMaxUInt8, ScaledFP8])
def test_encode_of_strided_and_expanded_tensors_equals_contiguous(codec: type) -> None:
    q = codec(chunk_size=64)
    base = torch.randn(128, generator=torch.Generator().manual_seed(5))
    for x in (base[::2], base.view(8, 16).t(), torch.tensor(1.5).expand(10_000)):
        assert torch.equal(q.encode(x), q.encode(x.contiguous()))
