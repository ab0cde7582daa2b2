"""Philox4x32-10 streams of stochastic rounding: known answers, C = torch, unbiased, two neighbours only, and
independent of the thread count and of how a tensor is cut into pieces."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mixprec import native
from mixprec.compress import MinMaxUInt8
from mixprec.compress.quantize import _kernels
from mixprec.core import philox

# Random123's tests/kat_vectors (github.com/DEShawResearch/random123), the three "philox4x32 10" lines:
# counter (4 words), key (2 words), expected output (4 words).
KAT = [
    ([0x00000000] * 4, [0x00000000] * 2, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]

needs_kernels = pytest.mark.skipif(_kernels() is None, reason="no compiled kernels on this machine")


@pytest.mark.parametrize("ctr, key, expected", KAT)
def test_torch_philox_matches_random123_known_answers(ctr: list, key: list, expected: list) -> None:
    out = philox.philox4x32_10(torch.tensor(ctr, dtype=torch.int64), key[0] | (key[1] << 32))
    assert out.tolist() == expected


@needs_kernels
@pytest.mark.parametrize("ctr, key, expected", KAT)
def test_compiled_philox_matches_random123_known_answers(ctr: list, key: list, expected: list) -> None:
    c, k, out = (ctypes.c_uint32 * 4)(*ctr), (ctypes.c_uint32 * 2)(*key), (ctypes.c_uint32 * 4)()
    _kernels().philox_block(c, k, out)
    assert list(out) == expected


def test_stream_layout_is_the_documented_one() -> None:
    # Element e: word (e >> 4) & 3 of counter ((e >> 6) << 4) | (e & 15), counter words (lo, hi, 0, 0).
    key = 0x0123456789ABCDEF
    for e in [0, 1, 15, 16, 63, 64, 1000, 2**40 + 77, philox.MAX_POSITION - 1]:
        c = ((e >> 6) << 4) | (e & 15)
        word = philox.philox4x32_10(torch.tensor([c & 0xFFFFFFFF, c >> 32, 0, 0]), key)[(e >> 4) & 3].item()
        assert philox.uniforms(key, e, 1).item() == (word >> 8) * 2.0**-24


@needs_kernels
def test_compiled_uniforms_equal_torch_uniforms() -> None:
    g = torch.Generator().manual_seed(3)
    for first, count in [(0, 1), (0, 64), (5, 1000), (63, 2050), (2**33 - 7, 300), (philox.MAX_POSITION - 500, 500)]:
        key = philox.draw_key(g)
        out = torch.empty(count)
        _kernels().philox_uniforms(key, first, count, out.data_ptr())
        assert torch.equal(out, philox.uniforms(key, first, count)), (first, count)


def test_uniforms_are_24_bit_and_look_uniform() -> None:
    u = philox.uniforms(philox.draw_key(torch.Generator().manual_seed(1)), 0, 1 << 16)
    assert torch.equal(u * 2**24, (u * 2**24).floor()) and u.min() >= 0 and u.max() < 1
    # mean of 65536 uniforms: standard error 1 / sqrt(12 * 65536) = 0.0011
    assert abs(u.double().mean().item() - 0.5) < 5 * 0.0011
    counts = torch.histc(u, bins=16, min=0, max=1)  # 4096 expected per bin, sd 62
    assert (counts - 4096).abs().max() < 5 * 62


def test_draw_key_takes_two_32_bit_words_from_the_generator() -> None:
    g = torch.Generator().manual_seed(11)
    key = philox.draw_key(g)
    lo, hi = torch.randint(0, 1 << 32, (2,), generator=torch.Generator().manual_seed(11)).tolist()
    assert key == lo | (hi << 32)
    assert philox.draw_key(g) != key


def _codes(q: MinMaxUInt8, x: torch.Tensor, key: int, rows: int) -> torch.Tensor:
    """rows stochastic encodes of ``x`` under one key (row r at stream positions r * n ...): [rows, n] codes."""
    n = x.numel()
    out = torch.empty(rows, q.encoded_nbytes(n), dtype=torch.uint8)
    q.encode_rows(x.expand(rows, n), out, key=key)
    return out[:, 8 * q.num_chunks(n) :]


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_stochastic_codes_are_unbiased_and_two_neighbours_only(path: str) -> None:
    # A chunk whose min is 0 and max 255 has scale 1 and step 1: q = x exactly, so each element's exact
    # probability of rounding up is frac(x). Over K draws (many keys, several positions each) the count of
    # ups is Binomial(K, frac): within 5 standard errors. Every code is floor(x) or ceil(x).
    frac = torch.tensor([0.0, 0.5, 0.25, 0.75, 0.125, 2.0**-10, 1 - 2.0**-10, 0.3, 0.9])
    x = torch.cat([torch.tensor([0.0, 255.0]), 17.0 + frac, 200.0 + frac]).float()
    keys, rows = (400, 25) if path == "compiled" else (40, 25)
    q = MinMaxUInt8(chunk_size=x.numel(), rounding="stochastic")
    g = torch.Generator().manual_seed(5)
    total = torch.zeros(x.numel(), dtype=torch.float64)
    ctx = native.disabled() if path == "torch" else torch.no_grad()
    with ctx:
        for _ in range(keys):
            codes = _codes(q, x, philox.draw_key(g), rows).double()
            assert ((codes == x.floor()) | (codes == x.ceil())).all()
            total += codes.sum(0)
    k = keys * rows
    p = (x - x.floor()).double()
    sigma = torch.sqrt(p * (1 - p) / k)
    assert ((total / k - x.floor().double() - p).abs() <= 5 * sigma + 1e-12).all()
    # The test can fail: rounding up with probability 1/2 instead of 1/8 (or 1/4, 3/4) would be caught.
    assert 5 * sigma.max().item() < 0.1


@needs_kernels
def test_stochastic_encode_does_not_depend_on_the_thread_count() -> None:
    x = torch.randn(3, 300_000, generator=torch.Generator().manual_seed(2))  # above the kernels' grain
    q = MinMaxUInt8(rounding="stochastic")
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(3, q.encoded_nbytes(x.shape[1]), dtype=torch.uint8)
            q.encode_rows(x, out, key=12345)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    with native.disabled():
        ref = torch.empty_like(outs[0])
        q.encode_rows(x, ref, key=12345)
    assert torch.equal(outs[0], ref)


@pytest.mark.parametrize("segment", [256, 2048 * 3, 10**9])
def test_stochastic_encode_does_not_depend_on_the_segments(segment: int) -> None:
    # Segments of whole chunks at their stream positions give the codes of one encode of the whole tensor.
    chunk = 256
    x = torch.randn(2, 40 * chunk + 13, generator=torch.Generator().manual_seed(4))
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic")
    n = x.shape[1]
    whole = torch.empty(2, q.encoded_nbytes(n), dtype=torch.uint8)
    q.encode_rows(x, whole, key=99)
    codes = torch.empty(2, n, dtype=torch.uint8)
    for a in range(0, n, segment):
        b = min(n, a + segment)
        out = torch.empty(2, q.encoded_nbytes(b - a), dtype=torch.uint8)
        q.encode_rows(x[:, a:b], out, key=99, offset=a, row_stride=n)
        codes[:, a:b] = out[:, 8 * q.num_chunks(b - a) :]
    assert torch.equal(codes, whole[:, 8 * q.num_chunks(n) :])
    # Another key gives other codes (the key matters), with the same header.
    other = torch.empty_like(whole)
    q.encode_rows(x, other, key=100)
    assert not torch.equal(other, whole) and torch.equal(
        other[:, : 8 * q.num_chunks(n)], whole[:, : 8 * q.num_chunks(n)]
    )


def test_bad_keys_are_refused() -> None:
    q = MinMaxUInt8(rounding="stochastic")
    x, out = torch.randn(1, 10), torch.empty(1, q.encoded_nbytes(10), dtype=torch.uint8)
    for key, exc in [(-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="key must be an int in"):
            q.encode_rows(x, out, key=key)
