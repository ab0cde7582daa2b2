"""Counter-based uniforms for stochastic rounding: Philox4x32-10 in torch int64 arithmetic.

Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
generator of Random123 and of torch's CUDA backend) maps a 128-bit counter and a 64-bit key to four 32-bit
words. A stream is one key; element ``e`` of it takes word ``(e >> 4) & 3`` of the block with counter
``((e >> 6) << 4) | (e & 15)`` (counter words: low 32 bits, high 32 bits, 0, 0), and its uniform is
``(word >> 8) * 2**-24`` in [0, 1). A draw depends only on (key, e): not on threads, blocking or segments.

This is the torch (fallback) implementation; ``mixprec/native/csrc/philox.h`` is the compiled one and gives
the same bits. Every product is split so that no int64 operation overflows. The layout and why it is
vector-friendly: ``docs/compress.md``.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_POSITION", "draw_key", "philox4x32_10", "uniform_rows", "uniforms"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
# Element positions stay below 2**62, so that counters ((e >> 6) << 4) fit in 64 bits with room.
MAX_POSITION = 1 << 62
_GROUPS = 1 << 11  # groups of 64 elements per block of work: 32768 counters, 256 KiB per int64 word


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product ``a * b`` (``a`` a 32-bit constant, ``b`` in [0, 2**32))."""
    t1 = b * (a >> 16)  # < 2**48
    s = b * (a & 0xFFFF)  # < 2**48
    s += (t1 & 0xFFFF) << 16  # < 2**49: a * b = (t1 >> 16) * 2**32 + s
    hi = (t1 >> 16).add_(s >> 32)
    return hi, s.bitwise_and_(_MASK32)


def _rounds(x: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The 10 rounds on the four counter words (contiguous int64 tensors of 32-bit values)."""
    x0, x1, x2, x3 = x
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, x0)
        hi1, lo1 = _mulhilo(_M1, x2)
        x0, x1, x2, x3 = hi1.bitwise_xor_(x1).bitwise_xor_(k0), lo1, hi0.bitwise_xor_(x3).bitwise_xor_(k1), lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return [x0, x1, x2, x3]


def philox4x32_10(counter: torch.Tensor, key: int) -> torch.Tensor:
    """Philox4x32-10 of int64 ``counter`` [..., 4] (32-bit words in [0, 2**32)) under the 64-bit ``key``
    (its low word is key word 0): int64 [..., 4], each word in [0, 2**32)."""
    words = _rounds([counter[..., i].contiguous() for i in range(4)], key)
    return torch.stack(words, dim=-1)


def uniforms(
    key: int,
    first: int,
    count: int,
    device: torch.device | str | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 uniforms in [0, 1) of elements ``[first, first + count)`` of the stream ``key`` (24-bit grid),
    into ``out`` (a contiguous fp32 tensor of ``count`` elements) if given."""
    if out is None:
        out = torch.empty(max(count, 0), dtype=torch.float32, device=device)
    # Blocks of _GROUPS groups (64 elements each): the int64 temporaries stay in the L2 cache.
    for lo in range(first, first + count, 64 * _GROUPS):
        hi = min(first + count, lo + 64 * _GROUPS)
        g0, g1 = lo >> 6, (hi - 1) >> 6  # groups of 64 elements = 16 counters
        blocks = torch.arange(g0 << 4, (g1 + 1) << 4, dtype=torch.int64, device=out.device)
        zero = torch.zeros_like(blocks)
        words = _rounds([blocks & _MASK32, blocks >> 32, zero, zero], key)
        # Element 64 g + 16 w + l is word w of counter 16 g + l.
        flat = torch.stack([w.view(-1, 16) for w in words], dim=1).view(-1)
        start = lo - (g0 << 6)
        torch.mul((flat[start : start + hi - lo] >> 8).to(torch.float32), 2.0**-24, out=out[lo - first : hi - first])
    return out


def uniform_rows(
    key: int, offset: int, row_stride: int, rows: int, length: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[rows, length] fp32 uniforms: element (r, j) is stream position ``offset + r * row_stride + j``."""
    out = torch.empty(rows, length, dtype=torch.float32, device=device)
    for r in range(rows):
        uniforms(key, offset + r * row_stride, length, out=out[r])
    return out


def draw_key(generator: torch.Generator | None) -> int:
    """One 64-bit key from ``generator`` (None: torch's default CPU generator): two 32-bit draws, low first.

    Advances the generator by one ``torch.randint`` call of two elements, so a generator seeded with
    ``mixprec.comm.rank_generator`` gives each rank, and each call, its own stream.
    """
    device = generator.device if generator is not None else "cpu"
    lo, hi = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=generator, device=device).tolist()
    return lo | (hi << 32)
