"""Philox4x32-10 streams of stochastic rounding: known answers, C = torch, unbiased, two neighbours only, and
independent of the thread count and of how a tensor is cut into pieces."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mixprec import native
from mixprec.compress import MinMaxUInt8, ScaledFP8
from mixprec.core import philox
from mixprec.native import kernels

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

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no compiled kernels on this machine")


@pytest.mark.parametrize("ctr, key, expected", KAT)
def test_torch_philox_matches_random123_known_answers(ctr: list, key: list, expected: list) -> None:
    out = philox.philox4x32_10(torch.tensor(ctr, dtype=torch.int64), key[0] | (key[1] << 32))
    assert out.tolist() == expected


@needs_kernels
@pytest.mark.parametrize("ctr, key, expected", KAT)
def test_compiled_philox_matches_random123_known_answers(ctr: list, key: list, expected: list) -> None:
    words = [torch.tensor(v, dtype=torch.int64).to(torch.int32) for v in (ctr, key)]  # uint32 bits in int32
    out = torch.empty(4, dtype=torch.int32)
    kernels.philox_block(words[0], words[1], out)
    assert (out.long() & 0xFFFFFFFF).tolist() == expected


def test_stream_layout_is_the_documented_one() -> None:
    # Element e: byte (e >> 6) & 3 of word (e >> 4) & 3 of counter ((e >> 8) << 4) | (e & 15), counter words
    # (lo, hi, 0, 0); its secondary word: word 0 of counter (e lo, e hi, 1, 0).
    key = 0x0123456789ABCDEF
    for e in [0, 1, 15, 16, 63, 64, 255, 256, 1000, 2**40 + 77, philox.MAX_POSITION - 1]:
        c = ((e >> 8) << 4) | (e & 15)
        word = philox.philox4x32_10(torch.tensor([c & 0xFFFFFFFF, c >> 32, 0, 0]), key)[(e >> 4) & 3].item()
        assert philox.stream_bytes(key, e, 1).item() == (word >> (8 * ((e >> 6) & 3))) & 0xFF, e
        second = philox.philox4x32_10(torch.tensor([e & 0xFFFFFFFF, e >> 32, 1, 0]), key)[0].item()
        assert philox.tie_words(key, torch.tensor([e])).item() == second, e


@needs_kernels
def test_compiled_bits_equal_torch_bits() -> None:
    g = torch.Generator().manual_seed(3)
    for first, count in [
        (0, 1),
        (0, 1024),
        (5, 1000),
        (255, 2050),
        (2**33 - 7, 3000),
        (philox.MAX_POSITION - 500, 500),
    ]:
        key = philox.draw_key(g)
        out = torch.empty(count, dtype=torch.uint8)
        kernels.philox_bytes(key, first, out)
        assert torch.equal(out, philox.stream_bytes(key, first, count)), (first, count)
        pos = torch.arange(first, first + min(count, 300), dtype=torch.int64)
        words = torch.empty(pos.numel(), dtype=torch.int32)
        kernels.philox_tie_words(key, pos, words)
        assert torch.equal(words.long() & 0xFFFFFFFF, philox.tie_words(key, pos)), (first, count)


def test_primary_bytes_look_uniform() -> None:
    b = philox.stream_bytes(philox.draw_key(torch.Generator().manual_seed(1)), 0, 1 << 18)
    counts = torch.bincount(b.long(), minlength=256).double()  # 1024 expected per value, sd 32
    assert counts.numel() == 256 and (counts - 1024).abs().max() < 5 * 32
    # Neighbours in the stream are not correlated: (b[e], b[e + 1]) pairs fill a 16 x 16 grid evenly.
    pairs = torch.bincount((b[:-1].long() >> 4) * 16 + (b[1:].long() >> 4), minlength=256).double()
    assert (pairs - pairs.mean()).abs().max() < 5 * 32


def test_round_up_resolves_ties_with_the_secondary_word() -> None:
    # Every element ties (its primary byte is floor(256 frac)): up exactly when its secondary word is below
    # (256 frac - floor(256 frac)) 2**32, in fp32 and in fp64.
    key, n = 0xFEEDFACE12345678, 4096
    positions = torch.arange(1000, 1000 + n)
    words = philox.tie_words(key, positions).double()
    for dtype in (torch.float32, torch.float64):
        frac = torch.rand(n, generator=torch.Generator().manual_seed(7), dtype=dtype)
        frac[:8] = torch.tensor([0.0, 2.0**-20, 0.5, 3 / 256, 3 / 256 + 2.0**-9, 1 - 2.0**-20, 255 / 256, 0.25])
        f8 = torch.floor(frac * 256)
        up = philox.round_up(key, f8.to(torch.uint8), frac, positions)
        assert torch.equal(up, words < (frac.double() * 256 - f8.double()) * 2.0**32)
        # Away from ties the primary byte alone decides.
        assert torch.equal(
            philox.round_up(key, (f8 - 1).clamp_min(0).to(torch.uint8), frac, positions)[f8 > 0], (f8 > 0)[f8 > 0]
        )
        assert not philox.round_up(key, (f8 + 1).clamp_max(255).to(torch.uint8), frac, positions)[f8 < 255].any()


def _randint_keys(g: torch.Generator | None, n: int) -> list[int]:
    draws = [torch.randint(0, 1 << 32, (2,), generator=g).tolist() for _ in range(n)]
    return [lo | (hi << 32) for lo, hi in draws]


def test_draw_key_takes_two_32_bit_words_from_the_generator() -> None:
    """Each key is the next torch.randint(0, 2**32, (2,)) of the generator (torch's default one for None),
    also when threads draw at once from generators of their own (draw_key reuses a tensor per thread)."""
    keys = [philox.draw_key(torch.Generator().manual_seed(11)) for _ in range(2)]
    assert keys[0] == keys[1] == _randint_keys(torch.Generator().manual_seed(11), 1)[0]
    g = torch.Generator().manual_seed(11)
    assert [philox.draw_key(g) for _ in range(5)] == _randint_keys(torch.Generator().manual_seed(11), 5)
    torch.manual_seed(12)
    drawn = [philox.draw_key(None) for _ in range(3)]
    torch.manual_seed(12)
    assert drawn == _randint_keys(None, 3)

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [philox.draw_key(gen) for _ in range(300)]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(draw, range(8)))
    assert got == [_randint_keys(torch.Generator().manual_seed(s), 300) for s in range(8)]


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
def test_stochastic_rounding_is_unbiased_through_the_tie_refinement() -> None:
    # As above, on fractions that stress the byte comparison: multiples of 1/256 (they always tie when the
    # byte equals 256 frac, and must then never round up), 2**-20 and 2**-9 above them (the secondary word
    # decides), and near 0 and 1. Integer parts 0..15 keep i + frac exact in fp32. Per fraction, K draws:
    # the up rate is within 5 binomial standard errors of frac; among the ties (primary byte == floor(256
    # frac), about K / 256 of them), the up rate is within 5 standard errors of 256 frac - floor(256 frac).
    fracs = [0.0, 0.5, 3 / 256, 3 / 256 + 2.0**-20, 3 / 256 + 2.0**-9, 200 / 256 + 2.0**-9 + 2.0**-20, 2.0**-20]
    fracs += [1 - 2.0**-20, round(0.3 * 2**20) / 2**20]
    x = torch.cat([torch.tensor([0.0, 255.0]), (torch.arange(16.0)[None] + torch.tensor(fracs)[:, None]).flatten()])
    x = x.float()
    frac = x.double() - x.double().floor()
    groups, group_of = torch.unique(frac, return_inverse=True)
    q = MinMaxUInt8(chunk_size=x.numel(), rounding="stochastic")
    n, rows, keys = x.numel(), 256, 250
    g = torch.Generator().manual_seed(5)
    low, high, f8 = x.floor().to(torch.uint8), x.ceil().to(torch.uint8), torch.floor(frac * 256).to(torch.uint8)
    ups, ties, tie_ups = (torch.zeros(n, dtype=torch.int64) for _ in range(3))  # per element, over all draws
    primary = torch.empty(rows, n, dtype=torch.uint8)
    for _ in range(keys):
        key = philox.draw_key(g)
        codes = _codes(q, x, key, rows)
        assert ((codes == low) | (codes == high)).all()
        up = codes != low
        kernels.philox_bytes(key, 0, primary)
        tie = primary == f8
        ups += up.sum(0, dtype=torch.int64)
        ties += tie.sum(0, dtype=torch.int64)
        tie_ups += (up & tie).sum(0, dtype=torch.int64)
    ups, ties, tie_ups = (
        torch.zeros(groups.numel(), dtype=torch.float64).index_add_(0, group_of, t.double())
        for t in (ups, ties, tie_ups)
    )
    draws = torch.bincount(group_of, minlength=groups.numel()).double() * rows * keys
    sigma = torch.sqrt(groups * (1 - groups) / draws)
    assert ((ups / draws - groups).abs() <= 5 * sigma + 1e-12).all(), (ups / draws - groups) / sigma
    assert 5 * sigma.max().item() < 1 / 256  # rounding every tie up (or down) would be caught
    rem = groups * 256 - torch.floor(groups * 256)
    assert (ties > 1000).all()
    tie_sigma = torch.sqrt(rem * (1 - rem) / ties)
    assert ((tie_ups / ties - rem).abs() <= 5 * tie_sigma + 1e-12).all(), (tie_ups / ties, rem)
    assert 5 * tie_sigma.max().item() < 0.1


@needs_kernels
@pytest.mark.parametrize("wire", ["uint8", "e4m3"])
def test_stochastic_encode_does_not_depend_on_the_thread_count(wire: str) -> None:
    x = torch.randn(3, 300_000, generator=torch.Generator().manual_seed(2))  # above the kernels' grain
    q = MinMaxUInt8(rounding="stochastic") if wire == "uint8" else ScaledFP8(wire, rounding="stochastic")
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
