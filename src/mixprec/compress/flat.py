"""The flat compressed scheme (Bagua's ByteGrad scatter-reduce / all-gather) on one group of W ranks.

Rank p owns part p of the tensor (``N / W`` elements). Every rank quantizes its W parts, one
``all_to_all_single`` of the uint8 buffers brings rank p every rank's part p, rank p decodes and sums them
in fp32 in rank order (the reduce-scatter stops here), re-quantizes its part, and the parts are
all-gathered and decoded by every rank: identical bits everywhere. The work is pipelined over segments of
whole chunks, each with its own asynchronous all-to-all and all-gather, so the chunk grid and every result
bit are the same as without segments. Diagram and error bound: ``docs/compress.md``.

:func:`start_all_reduce` / :func:`start_reduce_scatter` quantize and start the first exchange and return
the finishing work, which reports a :class:`~mixprec.compress.state.Traffic`; the public functions of
:mod:`mixprec.compress.collectives` validate, pad and conclude around them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.agree import agree_any
from mixprec.comm.compat import all_gather_flat
from mixprec.compress._scratch import Scratch
from mixprec.compress.blockscaled import BlockScaledWire
from mixprec.compress.fp8 import Compressor
from mixprec.compress.state import ErrorFeedback, Traffic

__all__ = [
    "FlatPhase",
    "encode_with_feedback",
    "overflowed_low_precision",
    "segment_bounds",
    "start_all_reduce",
    "start_reduce_scatter",
]

# Elements of the tensor per pipeline segment (all ranks' sub-parts together). Each segment gets its own
# all-to-all and all-gather, started asynchronously, so quantizing segment k+1 overlaps sending segment k, and
# several collectives are in flight at once: on gloo over TCP a single large all-to-all or all-gather reached
# about half the link rate on a rate-limited link in benchmarks/bench_netns.py, several concurrent ones nearly
# all of it. Sub-parts are whole chunks, so the chunk grid, and hence every result bit, is the same as without
# segments.
_SEGMENT_ELEMENTS = 1 << 21


def segment_bounds(part: int, world: int, chunk: int) -> list[tuple[int, int]]:
    """Pipeline segments ``[a, b)`` of each rank's part: whole chunks, about ``_SEGMENT_ELEMENTS / world``."""
    sub = max(chunk, -(-_SEGMENT_ELEMENTS // (world * chunk)) * chunk)
    return [(a, min(part, a + sub)) for a in range(0, part, sub)] or [(0, 0)]


def encode_with_feedback(
    comp: Compressor,
    x: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    staging: torch.Tensor | None,
    *,
    key: int | None = None,
    offset: int = 0,
    row_stride: int | None = None,
) -> int:
    """Error feedback's encode: the rows of ``fl32(x + residual)`` into ``out``, and ``residual`` becomes what the
    quantization lost; returns the flagged chunks. ``residual`` fp32, ``x``'s shape, rows contiguous.

    A :class:`BlockScaledWire` does it in one pass (:meth:`~BlockScaledWire.encode_feedback_rows`: no staging
    copy, no decode). The others add into ``staging`` (fp32, ``x``'s shape; may be ``x`` itself; None: a new
    tensor), encode, decode and subtract. Both give the same codes, and the same residuals when nothing is
    flagged; with a flagged chunk the staged path keeps every residual and the fused one updates the unflagged
    blocks', but then the result is flagged on every rank and the collective clears all residuals
    (``CompressedCollectives.conclude``), so the state after the call is the same too.
    """
    if isinstance(comp, BlockScaledWire):
        return comp.encode_feedback_rows(x, residual, out, key=key, offset=offset, row_stride=row_stride)
    v = x.float() + residual if staging is None else torch.add(x, residual, out=staging)
    bad = comp.encode_rows(v, out, key=key, offset=offset, row_stride=row_stride)
    if not bad:
        comp.decode_rows(out, x.shape[1], residual)
        torch.sub(v, residual, out=residual)
    return bad


class FlatPhase:
    """The flat scheme on one group, pipelined over segments: ``__init__`` quantizes every segment and starts
    its all-to-all; ``reduce`` (reduce-scatter) or ``all_reduce_into`` (re-quantize, all-gather, decode)
    finishes. Rank p owns part p (elements ``[p L, (p+1) L)``); segment s is ``[a_s, b_s)`` of every part.
    """

    def __init__(
        self,
        numel: int,
        source: Callable[[int, int, int], torch.Tensor],
        group: dist.ProcessGroup | None,
        comp: Compressor,
        ef: ErrorFeedback | None,
        inflight: Scratch,
        shared: Scratch,
        tag: str,
    ) -> None:
        """``source(s, a, b)`` returns segment s of every part, a [W, b - a] tensor (rows contiguous), waiting
        for it if it is still being produced (the hierarchical scheme's intra-node reduce-scatter).
        """
        self.group, self.comp, self.ef, self.shared, self.tag = group, comp, ef, shared, tag
        self.world = world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.part = part = numel // world
        self.segments = segment_bounds(part, world, comp.chunk_size)
        self.seg_nbytes = [comp.encoded_nbytes(b - a) for a, b in self.segments]
        self.nbytes = sum(self.seg_nbytes)
        self.header = sum(comp.header_nbytes(b - a) for a, b in self.segments)
        first = source(0, *self.segments[0])
        device = first.device
        self.send = self.per_segment(inflight.get(tag + "send", world * self.nbytes, torch.uint8, device))
        self.recv = self.per_segment(inflight.get(tag + "recv", world * self.nbytes, torch.uint8, device))
        worker = staged = None
        if ef is not None:
            worker = ef.residual("worker", numel, device).view(world, part)
            if not isinstance(comp, BlockScaledWire):  # its encode adds the residual itself
                staged = shared.get(tag + "v", numel, torch.float32, device).view(world, part)
        # Stochastic rounding: one Philox key per call; the worker encode takes stream positions [0, numel) (the
        # element's index in the input), the server re-encode [numel, numel + part): every bit is the same
        # whatever the segments.
        self.key = comp.draw_key() if comp.rounding == "stochastic" else 0
        self.numel = numel
        self.local_bad = 0
        self._works: list[Any] = []
        for s, ((a, b), send, recv) in enumerate(zip(self.segments, self.send, self.recv)):
            v = first if s == 0 else source(s, a, b)
            if worker is not None:
                stage = None if staged is None else staged[:, a:b]
                bad = encode_with_feedback(
                    comp, v, worker[:, a:b], send, stage, key=self.key, offset=a, row_stride=part
                )
            else:
                bad = comp.encode_rows(v, send, key=self.key, offset=a, row_stride=part)
            self.local_bad += bad
            self._works.append(dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True))
        self.recv_bad = 0

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        comp: Compressor,
        ef: ErrorFeedback | None,
        inflight: Scratch,
        shared: Scratch,
        tag: str,
    ) -> FlatPhase:
        """The flat scheme on a contiguous tensor ``x`` (rank p owns ``x.view(W, -1)[p]``)."""
        rows = x.view(dist.get_world_size(group), -1)
        return cls(x.numel(), lambda s, a, b: rows[:, a:b], group, comp, ef, inflight, shared, tag)

    def per_segment(self, flat: torch.Tensor, rows: int | None = None) -> list[torch.Tensor]:
        """Split a buffer of ``rows * nbytes`` bytes (rows: default W) into [rows, segment bytes] views."""
        rows = self.world if rows is None else rows
        views, offset = [], 0
        for nb in self.seg_nbytes:
            views.append(flat[offset : offset + rows * nb].view(rows, nb))
            offset += rows * nb
        return views

    def bytes_per_phase(self) -> tuple[int, int]:
        """(bytes, header bytes) this rank sends in one of the two phases: W-1 buffers per segment."""
        return (self.world - 1) * self.nbytes, (self.world - 1) * self.header

    def _sum_segment(self, s: int, acc: torch.Tensor, divisor: int | None) -> None:
        """Wait for segment s's all-to-all; ``acc`` = fp32 sum of its W decoded buffers (/ divisor)."""
        self._works[s].wait()
        self.recv_bad += self.comp.decode_rows(self.recv[s], acc.numel(), acc, reduce=True)
        if divisor is not None:
            acc.div_(divisor)

    def reduce(self, divisor: int | None) -> torch.Tensor:
        """The fp32 sum (divided by ``divisor``) of this rank's part: the reduce-scatter result."""
        acc = self.shared.get(self.tag + "acc", self.part, torch.float32, self.recv[0].device)
        for s, (a, b) in enumerate(self.segments):
            self._sum_segment(s, acc[a:b], divisor)
        return acc

    def all_reduce_into(
        self, out: torch.Tensor | None, divisor: int | None, *, relay: Callable[[int], None] | None = None
    ) -> int:
        """Sum, re-quantize the owned part (+ server residual), all-gather and decode every part into ``out``
        [W * part], segment by segment. Returns the number of flagged chunks seen in the gathered buffers
        (the same on every rank). With ``relay``, nothing is decoded here: ``relay(s)`` is called as soon as
        segment s's all-gather is done (its buffers are ``self.gathered[s]``).
        """
        device = self.recv[0].device
        acc = self.shared.get(self.tag + "acc", self.part, torch.float32, device)
        self.gathered = gathered = self.per_segment(
            self.shared.get(self.tag + "gather", self.world * self.nbytes, torch.uint8, device)
        )
        server = self.ef.residual("server", self.part, device) if self.ef is not None else None
        works = []
        for s, (a, b) in enumerate(self.segments):
            acc_s = acc[a:b]
            self._sum_segment(s, acc_s, divisor)
            own = gathered[s][self.rank : self.rank + 1]
            if server is not None:  # acc_s is the staging buffer: nothing reads it after this encode
                row = acc_s.view(1, -1)
                encode_with_feedback(
                    self.comp, row, server[a:b].view(1, -1), own, row, key=self.key, offset=self.numel + a
                )
            else:
                self.comp.encode_rows(acc_s.view(1, -1), own, key=self.key, offset=self.numel + a)
            works.append(all_gather_flat(gathered[s].view(-1), own.view(-1), self.group, async_op=True))
        n_bad = 0
        for s, (a, b) in enumerate(self.segments):
            works[s].wait()
            if relay is not None:
                relay(s)
            elif out is not None:
                n_bad += self.comp.decode_rows(gathered[s], b - a, out.view(self.world, self.part)[:, a:b])
        return n_bad


def overflowed_low_precision(result: torch.Tensor) -> int:
    """1 when an fp16/bf16 result holds Inf/NaN that its fp32 chunks did not flag (a decoded value beyond the
    dtype's range), else 0. The decoded bytes are the same on every rank, so is this answer. fp32: 0, free."""
    if result.dtype == torch.float32:
        return 0
    return int(not bool(torch.isfinite(result).all()))


def start_all_reduce(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    comp: Compressor,
    divisor: int | None,
    ef: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
) -> Callable[[], Traffic]:
    """Start the all-reduce of ``flat`` (contiguous, numel a multiple of the group size), reduced in place
    by the returned finishing work. The non-finite flag travels in the gathered headers: no extra collective.
    """
    phase = FlatPhase.of(flat, group, comp, ef, inflight, shared, "")

    def finish() -> Traffic:
        n_bad = phase.all_reduce_into(flat, divisor)
        n_bad += overflowed_low_precision(flat)
        sent, header = phase.bytes_per_phase()
        return Traffic(n_bad > 0, lambda: phase.local_bad > 0, compressed=2 * sent, header=2 * header)

    return finish


def start_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    comp: Compressor,
    divisor: int | None,
    ef: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
) -> Callable[[], Traffic]:
    """Start the reduce-scatter of ``tensor`` into ``output`` (this rank's part); the finishing work sums
    and agrees on the non-finite flag (one one-element all-reduce)."""
    phase = FlatPhase.of(tensor.reshape(-1), group, comp, ef, inflight, shared, "")

    def finish() -> Traffic:
        acc = phase.reduce(divisor)
        output.view(-1).copy_(acc)
        # An fp32 sum beyond 3.4e38 (or beyond output's dtype) is inf here, not a flagged chunk.
        overflow = not bool(torch.isfinite(output).all())
        found = agree_any(phase.recv_bad > 0 or phase.local_bad > 0 or overflow, group)
        sent, header = phase.bytes_per_phase()
        return Traffic(found, lambda: phase.local_bad > 0, compressed=sent, header=header)

    return finish
