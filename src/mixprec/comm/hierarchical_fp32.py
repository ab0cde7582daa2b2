"""Two-stage (node, then across nodes) fp32-accumulating reduce-scatter and all-reduce, pipelined.

On m nodes of n ranks (a :class:`~mixprec.comm.topology.HierarchicalGroups`), for each segment of the shard:
stage 1 is an intra-node all-to-all in the wire dtype and an fp32 sum, in local-rank order, of the node's n
partials; the node partial is rounded to the inter-node dtype (the wire dtype by default, or kept in fp32);
stage 2 is an all-to-all among the m ranks with the same local rank and an fp32 sum in node order, then one
rounding to the output. Each node sends ``(m-1)/m N`` elements across its boundary (a ring: about ``N``), a
flat all-to-all ``n (m-1)/m N``. The all-reduce ends with the all-gathers in reverse (inter, then intra).

Segments go through two slots of one receive area: the fp32 sum of a segment runs while the next segment's
stage 1 and the previous one's stage 2 are on the wire. The area has a fixed length chosen by the caller
(:func:`segment_length`), so memory does not grow with the tensor or with the number of reductions.
Megatron-LM's ``reduce_scatter_with_fp32_accumulation`` (the flat original) holds one buffer per bucket
(Megatron-LM PR #4940) and sums only at ``wait()`` (issue #6199). Bounds and byte counts: ``docs/comm.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.comm.handles import PendingReduction
from mixprec.comm.topology import HierarchicalGroups
from mixprec.core.dtypes import Rounding

__all__ = [
    "RAMP_MIN",
    "SLOTS",
    "area_elements",
    "segment_bounds",
    "segment_length",
    "start_all_reduce",
    "start_reduce_scatter",
]

# Segments in flight per reduction: one summed while the other is on the wire.
SLOTS = 2
# Segment length from which the pipeline's first and last segments are ramped (segment_bounds).
RAMP_MIN = 1 << 16


def per_segment(world: int, nodes: int, all_reduce: bool) -> int:
    """Area elements per element of a segment: SLOTS slots of a send staging and a receive buffer
    (``2 * world`` each), and for the all-reduce the staging of its two gathers (a send and a receive slot
    of ``nodes`` and of ``world`` rows each)."""
    return 2 * SLOTS * world + (2 * SLOTS * (world + nodes) if all_reduce else 0)


def segment_length(shard: int, world: int, area: int, nodes: int = 1, all_reduce: bool = False) -> int:
    """Elements of a shard per segment when the area holds ``area`` elements (at least one)."""
    return max(1, min(shard, area // per_segment(world, nodes, all_reduce)))


def area_elements(shard: int, world: int, nodes: int = 1, all_reduce: bool = False, segments: int = 4) -> int:
    """The area that cuts a shard into about ``segments`` segments (the default when no area is given)."""
    return per_segment(world, nodes, all_reduce) * max(1, -(-shard // segments))


def segment_bounds(shard: int, seg: int) -> list[tuple[int, int]]:
    """Segments of at most ``seg`` elements, the first and last two ramped (``seg // 4``, ``seg // 2``):
    nothing is on the inter-node wire until the first segment has crossed the node and been summed, and
    the last one is summed (and, for the all-reduce, gathered) after the wire is done, so short end
    segments shorten the pipeline's fill and drain. Segments below ``RAMP_MIN`` elements are latency-bound
    (three more segments would cost three more messages to every peer) and shards too short for the ramp
    get plain segments."""
    quarter, half = seg // 4, seg // 2
    ends = [quarter, half] if seg >= RAMP_MIN else []
    if not ends or shard < 2 * sum(ends) + seg:
        return [(a, min(shard, a + seg)) for a in range(0, shard, seg)]
    middle = shard - 2 * sum(ends)
    lengths = ends + [seg] * (middle // seg) + ([middle % seg] if middle % seg else []) + ends[::-1]
    bounds, a = [], 0
    for length in lengths:
        bounds.append((a, a + length))
        a += length
    return bounds


def _as_fp32(region: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` fp32 elements over the start of a 16-bit ``region`` when they fit and are aligned (memory
    already held, which gloo may keep referenced for a while), else a fresh buffer."""
    ratio = 4 // region.element_size()
    if region.numel() >= count * ratio and region.storage_offset() % ratio == 0:
        return region[: count * ratio].view(torch.float32)
    return torch.empty(count, dtype=torch.float32, device=region.device)


class _TwoStage:
    """The pipeline over one ``layout`` [n, m, S] view of the input (row l: what local rank l sums over
    the node; [l, i]: the part node i's rank with local rank l gets). ``sink(a, b, recv)`` finishes
    columns [a, b) from stage 2's receive buffer [m, b - a]."""

    def __init__(
        self,
        layout: torch.Tensor,
        hier: HierarchicalGroups,
        area: torch.Tensor,
        seg: int,
        inter_dtype: torch.dtype,
        average: bool,
        rounding: Rounding,
        generator: torch.Generator | None,
        sink: Callable[[int, int, torch.Tensor], None],
    ) -> None:
        self.layout, self.hier, self.area, self.inter_dtype = layout, hier, area, inter_dtype
        self.average, self.rounding, self.generator, self.sink = average, rounding, generator, sink
        n, m, shard = layout.shape
        self.world = n * m
        self.slot = 2 * self.world * seg
        self.segments = segment_bounds(shard, seg)
        self.works1: dict[int, Any] = {}
        self.works2: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        for s in range(min(SLOTS, len(self.segments))):
            self._stage1(s)

    def _views(self, s: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        a, b = self.segments[s]
        width = self.world * (b - a)
        base = (s % SLOTS) * self.slot
        return self.area[base : base + width], self.area[base + self.slot // 2 : base + self.slot // 2 + width], b - a

    def _stage1(self, s: int) -> None:
        send, recv, _ = self._views(s)
        n, m, _ = self.layout.shape
        a, b = self.segments[s]
        send.view(n, m, b - a).copy_(self.layout[:, :, a:b])
        self.works1[s] = dist.all_to_all_single(recv, send, group=self.hier.intra, async_op=True)

    def _stage2(self, s: int) -> None:
        send, recv, width = self._views(s)
        n, m, _ = self.layout.shape
        self.works1.pop(s).wait()
        if self.inter_dtype == self.area.dtype:
            partial, recv2 = send[: m * width], recv[: m * width]
        else:  # fp32 across nodes: in the slot where it fits (n >= 2, aligned), else buffers of their own
            partial, recv2 = _as_fp32(send, m * width), _as_fp32(recv, m * width)
        # The node partial, rounded once to the inter-node dtype (not at all when that is fp32).
        sum_shards_into(
            partial, recv.view(n, m * width), average=self.average, rounding=self.rounding, generator=self.generator
        )
        work = dist.all_to_all_single(recv2, partial, group=self.hier.inter, async_op=True)
        self.works2[s] = (work, recv2, partial)  # the partial is kept alive until its send is done

    def _finish_segment(self, s: int) -> None:
        work, recv2, _ = self.works2.pop(s)
        work.wait()
        a, b = self.segments[s]
        self.sink(a, b, recv2.view(self.layout.shape[1], b - a))

    def run(self) -> None:
        """The rest of the schedule; its order (stage 1 of s, then the end of s - 1) fixes the order of the
        random draws of stochastic rounding, which a reference must follow."""
        count = len(self.segments)
        for s in range(count):
            self._stage2(s)
            if s >= 1:
                self._finish_segment(s - 1)
                if s + 1 < count:
                    self._stage1(s + 1)  # into the slot segment s - 1 has just freed
        self._finish_segment(count - 1)


def start_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    hier: HierarchicalGroups,
    area: torch.Tensor,
    seg: int,
    *,
    inter_dtype: torch.dtype,
    average: bool,
    factor: float | None,
    rounding: Rounding,
    generator: torch.Generator | None,
) -> PendingReduction:
    """Start the reduce-scatter (checked arguments): global rank ``node * n + l`` gets part ``node * n + l``.
    Stage 1 of the first segments is on the wire when this returns; ``wait()`` runs the rest."""
    n, m = hier.ranks_per_node, hier.nodes
    shard = output.numel()
    out = output.view(-1)
    # Local rank l sums parts {i * n + l}: the [local, node, shard] view of the [node, local, shard] input.
    layout = input.view(m, n, shard).transpose(0, 1)

    def sink(a: int, b: int, recv: torch.Tensor) -> None:
        sum_shards_into(out[a:b], recv, average=average, rounding=rounding, generator=generator, factor=factor)

    pipeline = _TwoStage(layout, hier, area, seg, inter_dtype, average, rounding, generator, sink)
    return PendingReduction(pipeline.run)


def start_all_reduce(
    tensor: torch.Tensor,
    hier: HierarchicalGroups,
    area: torch.Tensor,
    seg: int,
    *,
    inter_dtype: torch.dtype,
    average: bool,
    rounding: Rounding,
    generator: torch.Generator | None,
) -> PendingReduction:
    """Start the in-place all-reduce (checked arguments); ``wait()`` finishes both stages and the gathers.
    The area also holds the staging of the all-gathers, which run segment by segment behind the sums
    (:func:`per_segment`)."""
    n, m = hier.ranks_per_node, hier.nodes
    flat = tensor.view(-1)
    shard = flat.numel() // (n * m)
    # Local rank l owns the contiguous slice l of [n, m * S]; within it node i owns part i.
    layout = flat.view(n, m, shard)
    own = layout[hier.local, hier.node]

    # Both all-gathers run segment by segment behind the sums: a segment's inter-node gather starts as soon
    # as it is summed, its intra-node one at the next segment's sum, each into a staging slot (a segment's
    # columns of the tensor are strided); segment s - 2 lands before its slots are reused. Each gather is an
    # all-to-all of the piece sent to every peer (the bytes of an all-gather): gloo's asynchronous
    # all-gather allocates a temporary of its output and keeps it beyond the call.
    segments: list[tuple[int, int]] = []
    works: dict[tuple[str, int], Any] = {}
    # Staging in the area after the pipeline's slots (persistent memory: gloo releases the tensors of a
    # collective some calls later, so fresh ones per call would pile up).
    offset = 2 * SLOTS * n * m * seg
    staging: dict[str, torch.Tensor] = {}
    for name, rows in (("inter.send", m), ("inter", m), ("intra.send", n * m), ("intra", n * m)):
        staging[name] = area[offset : offset + SLOTS * rows * seg]
        offset += SLOTS * rows * seg

    def slot(name: str, s: int, rows: int) -> torch.Tensor:
        a, b = segments[s]
        base = (s % SLOTS) * rows * seg
        return staging[name][base : base + rows * (b - a)]

    def gather(name: str, s: int, piece: torch.Tensor, peers: int, group: dist.ProcessGroup) -> None:
        send = slot(name + ".send", s, peers * (piece.numel() // (segments[s][1] - segments[s][0])))
        send.view(peers, -1).copy_(piece.view(1, -1).expand(peers, -1))
        recv = slot(name, s, peers * (piece.numel() // (segments[s][1] - segments[s][0])))
        works[name, s] = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def start_intra(s: int) -> None:
        works.pop(("inter", s)).wait()
        gather("intra", s, slot("inter", s, m), n, hier.intra)

    def land(s: int) -> None:
        works.pop(("intra", s)).wait()
        a, b = segments[s]
        layout[:, :, a:b].copy_(slot("intra", s, n * m).view(n, m, b - a))

    def sink(a: int, b: int, recv: torch.Tensor) -> None:
        s = len(segments)
        segments.append((a, b))
        sum_shards_into(own[a:b], recv, average=average, rounding=rounding, generator=generator)
        if s >= SLOTS:
            land(s - SLOTS)
        gather("inter", s, own[a:b], m, hier.inter)
        if s >= 1:
            start_intra(s - 1)

    pipeline = _TwoStage(layout, hier, area, seg, inter_dtype, average, rounding, generator, sink)

    def finish() -> None:
        pipeline.run()
        last = len(segments) - 1
        for s in range(max(0, last - SLOTS + 1), last):
            land(s)
        start_intra(last)
        land(last)

    return PendingReduction(finish)
