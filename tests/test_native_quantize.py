"""The compiled stochastic MinMaxUInt8 encode at stream positions on multiples of 256, against the torch path.

There the kernel takes its Philox words from the min/max pass (the first chunk sub-blocks) or computes them
in the codes pass (later ones), runs the codes on 16-bit lanes and resolves ties in batches that span
chunks; elsewhere, or for the last ``length % 64`` elements of a sub-block, it reads stored primary bytes.
Every one of these must give the torch path's bits, whatever the chunk size, dtype and thread count.
"""

from __future__ import annotations

import pytest
import torch

from mixprec import native
from mixprec.compress import MinMaxUInt8
from mixprec.core import philox

pytestmark = pytest.mark.skipif(native.library() is None, reason="no compiled kernels on this machine")

KEY = 0x0123456789ABCDEF


def _inputs(length: int) -> dict[str, torch.Tensor]:
    """[2, length] fp32 inputs without zeros (the sign of a zero bound in a header is unspecified)."""
    g = torch.Generator().manual_seed(length)
    r = torch.randn(2, length, generator=g) + 0.01
    return {
        "random": r,
        # q = k / 2 exactly: f8 = 128 or 0, so 1 element in 256 ties with its primary byte
        "ties": (torch.arange(2 * length, dtype=torch.float32).view(2, length) % 511 + 1) * 0.5,
        # range ~1e-35: 256 * scale overflows fp32, so the kernel must not pre-scale the grid constants
        "tiny_range": r * 1e-35,
        "one_sign": r.abs() + 3.0,  # min > 0: the unaligned grid, q = (x - min) * scale
    }


def _encode(q: MinMaxUInt8, x: torch.Tensor, offset: int, row_stride: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0], q.encoded_nbytes(x.shape[1]), dtype=torch.uint8)
    q.encode_rows(x, out, key=KEY, offset=offset, row_stride=row_stride)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk, length", [(1024, 3000), (8192, 9000 + 37), (320, 1000)])
def test_aligned_stochastic_encode_equals_torch(dtype: torch.dtype, chunk: int, length: int) -> None:
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic")
    header = 8 * q.num_chunks(length)
    for name, x in _inputs(length).items():
        if name == "tiny_range" and dtype == torch.float16:
            continue  # zeros in fp16
        x = x.to(dtype)
        for offset, row_stride in ((512, 256 * (length // 256 + 1)), (512, length)):  # row 1 off the grid too
            fast = _encode(q, x, offset, row_stride)
            with native.disabled():
                ref = _encode(q, x, offset, row_stride)
            assert torch.equal(fast[:, header:], ref[:, header:]), f"{name}: codes differ"
            assert torch.equal(fast[:, :header], ref[:, :header]), f"{name}: headers differ"


def test_ties_resolved_across_chunks_and_threads() -> None:
    """Ties wait in a per-thread queue across chunks: the codes do not depend on the thread count."""
    x = (torch.arange(2 * 40_000, dtype=torch.float32).view(2, -1) % 511 + 1) * 0.5
    q = MinMaxUInt8(chunk_size=2048, rounding="stochastic")
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(_encode(q, x, 0, x.shape[1]))
    finally:
        torch.set_num_threads(threads)
    with native.disabled():
        ref = _encode(q, x, 0, x.shape[1])
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_element_a_tie(threads: int) -> None:
    """x = i + (u + 1/2) / 256 on a grid with q = x, u the element's own primary byte: every element ties, so
    every tie mask is full. The kernel lists the masks with ties and takes one tie of each per step, putting
    the rest back at the end of its list: here 32 steps per mask, with the list compacted on the way and the
    queue flushed many times in one go. Codes are i or i + 1, as the torch path's."""
    rows, length, chunk = 2, 40_000, 2048
    stride = 256 * (length // 256 + 1)  # both rows on the 256 grid
    u = philox.byte_rows(KEY, 0, stride, rows, length)
    i = torch.arange(rows * length).view(rows, length) % 200
    x = i + (u.float() + 0.5) / 256
    x[:, ::chunk] = 0.0  # min 0 and max 255 in every chunk: scale 1, q = x
    x[:, 1::chunk] = 255.0
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        fast = _encode(q, x, 0, stride)
    finally:
        torch.set_num_threads(old)
    with native.disabled():
        ref = _encode(q, x, 0, stride)
    assert torch.equal(fast, ref)
    up = fast[:, 8 * q.num_chunks(length) :].long() - i
    tie = torch.ones_like(up, dtype=torch.bool)
    tie[:, ::chunk] = tie[:, 1::chunk] = False
    assert ((up[tie] == 0) | (up[tie] == 1)).all()
    assert 0.45 < up[tie].float().mean() < 0.55  # up with probability 1/2 each: sd 0.002 for 80,000


@pytest.mark.parametrize("threads", [1, 2])
def test_nan_in_a_pipelined_chunk_flags_it(threads: int) -> None:
    """fp32 chunks after a thread's first are scanned for min, max and NaN inside the codes loop of the chunk
    before them. vminps/vmaxps drop a NaN operand, so only the scan's NaN check can flag such a chunk: a NaN
    at the start, in the middle (the scan's 64-element steps) or in the tail of later chunks, in either row,
    must give the torch path's NaN header and zero codes, and leave the other chunks as they were."""
    length, chunk = 9 * 2048 + 100, 2048
    stride = 256 * (length // 256 + 1)  # both rows on the 256 grid: the loop that scans ahead
    q = MinMaxUInt8(chunk_size=chunk, rounding="stochastic")
    chunks = q.num_chunks(length)
    header = 8 * chunks
    base = torch.randn(2, length, generator=torch.Generator().manual_seed(5))
    clean = _encode(q, base, 0, stride)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for row, at in ((0, 2048), (0, 2048 * 3 + 64), (0, 2048 * 4 + 1000), (1, 2048 * 6 + 2047), (1, 2048 * 9 + 99)):
            x = base.clone()
            x[row, at] = float("nan")
            fast = _encode(q, x, 0, stride)
            with native.disabled():
                ref = _encode(q, x, 0, stride)
            c = at // chunk
            assert torch.equal(fast[:, header:], ref[:, header:]), f"NaN at {row, at}: codes differ"
            words = fast[row, :header].view(torch.float32)
            assert words[c].isnan() and words[chunks + c].isnan(), f"NaN at {row, at}: chunk not flagged"
            assert not fast[row, header + c * chunk : header + (c + 1) * chunk].any()
            keep = torch.ones(2, length, dtype=torch.bool)
            keep[row, c * chunk : (c + 1) * chunk] = False
            assert torch.equal(fast[:, header:][keep], clean[:, header:][keep]), f"NaN at {row, at}: others moved"
    finally:
        torch.set_num_threads(old)
