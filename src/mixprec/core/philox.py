"""Counter-based random bits for stochastic rounding: Philox4x32-10 in torch int64 arithmetic.

Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
generator of Random123 and of torch's CUDA backend) maps a 128-bit counter and a 64-bit key to four 32-bit
words. A stream is one key. Element ``e`` of it has a primary byte: byte ``(e >> 6) & 3`` (0 = least
significant) of word ``(e >> 4) & 3`` of the block with counter ``((e >> 8) << 4) | (e & 15)`` (counter
words: low 32 bits, high 32 bits, 0, 0); and a secondary word, read only on a tie: word 0 of the block with
counter ``(e low, e high, 1, 0)``. :func:`round_up` turns them into an up/down decision with probability
the fraction to within ``2**-40``. A draw depends only on (key, e): not on threads, blocking or segments.

This is the torch (fallback) implementation; ``mixprec/native/csrc/philox.h`` is the compiled one and gives
the same bits. Every product is split so that no int64 operation overflows. The layout, why it is
vector-friendly and the proof of unbiasedness: ``docs/compress.md``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["MAX_POSITION", "byte_rows", "draw_key", "philox4x32_10", "round_up", "stream_bytes", "tie_words"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
# Element positions stay below 2**62: counters ((e >> 8) << 4) and e itself fit in 64 bits with room.
MAX_POSITION = 1 << 62
_CPU = torch.device("cpu")
_GROUPS = 1 << 11  # groups of 256 elements per block of work: 32768 counters, 256 KiB per int64 word


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


def stream_bytes(
    key: int,
    first: int,
    count: int,
    device: torch.device | str | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 primary bytes of elements ``[first, first + count)`` of the stream ``key``, into ``out`` (a
    contiguous uint8 tensor of ``count`` elements) if given."""
    if out is None:
        out = torch.empty(max(count, 0), dtype=torch.uint8, device=device)
    # Blocks of _GROUPS groups (256 elements each): the int64 temporaries stay in the L2 cache.
    for lo in range(first, first + count, 256 * _GROUPS):
        hi = min(first + count, lo + 256 * _GROUPS)
        g0, g1 = lo >> 8, (hi - 1) >> 8  # groups of 256 elements = 16 counters
        blocks = torch.arange(g0 << 4, (g1 + 1) << 4, dtype=torch.int64, device=out.device)
        zero = torch.zeros_like(blocks)
        words = torch.stack([w.view(-1, 16) for w in _rounds([blocks & _MASK32, blocks >> 32, zero, zero], key)], 1)
        # Element 256 g + 64 b + 16 w + l is byte b of word w of counter 16 g + l.
        flat = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=1).view(-1)
        start = lo - (g0 << 8)
        out[lo - first : hi - first].copy_(flat[start : start + hi - lo])
    return out


def byte_rows(
    key: int, offset: int, row_stride: int, rows: int, length: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[rows, length] uint8 primary bytes: element (r, j) is stream position ``offset + r * row_stride + j``."""
    out = torch.empty(rows, length, dtype=torch.uint8, device=device)
    for r in range(rows):
        stream_bytes(key, offset + r * row_stride, length, out=out[r])
    return out


def tie_words(key: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 secondary words (in [0, 2**32)) of the stream positions ``positions`` (int64, any shape): word 0
    of the block with counter ``(e low, e high, 1, 0)``; primary counters have word 2 = 0, so never these."""
    e = positions.reshape(-1)
    ones, zeros = torch.ones_like(e), torch.zeros_like(e)
    return _rounds([e & _MASK32, e >> 32, ones, zeros], key)[0].view(positions.shape)


def round_up(key: int, primary: torch.Tensor, frac: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Whether each element rounds up: bool, True with probability ``frac`` to within ``2**-40``.

    ``frac`` (fp32 or fp64, in [0, 1)) is the exact fraction of the value in steps; ``primary`` (uint8, same
    shape) the elements' primary bytes; ``positions`` (int64, broadcastable) their stream positions. Up when
    the byte is below ``f8 = floor(256 frac)``; on a tie, when the secondary word is below
    ``(256 frac - f8) 2**32`` (every operation exact: docs/compress.md).
    """
    s = frac * 256.0  # exact: a power of two
    f8 = torch.floor(s)
    up = primary < f8
    tie = primary == f8
    if bool(tie.any()):
        words = tie_words(key, positions.expand(frac.shape)[tie])
        up[tie] = words.double() < (s[tie] - f8[tie]).double() * 2.0**32  # exact on both sides
    return up


_draws = threading.local()  # per thread: a 2-element int64 tensor per device, refilled by each draw_key


def draw_key(generator: torch.Generator | None) -> int:
    """One 64-bit key from ``generator`` (None: torch's default CPU generator): two 32-bit draws, low first.

    Advances the generator as one ``torch.randint(0, 2**32, (2,))`` call does, so a generator seeded with
    ``mixprec.comm.rank_generator`` gives each rank, and each call, its own stream. The draws land in a
    tensor kept per thread and device (``randint`` is ``random_`` on a new one): half the time of a
    ``randint`` call, which a stochastic encode of a small tensor pays every time.
    """
    device = generator.device if generator is not None else _CPU
    bufs: dict[torch.device, torch.Tensor] | None = getattr(_draws, "bufs", None)
    if bufs is None:
        bufs = _draws.bufs = {}
    buf = bufs.get(device)
    if buf is None:
        buf = bufs[device] = torch.empty(2, dtype=torch.int64, device=device)
    lo, hi = buf.random_(0, 1 << 32, generator=generator).tolist()
    return lo | (hi << 32)
