"""The hierarchical compressed scheme: full precision inside a node, uint8 between nodes.

On m nodes of n ranks (a :class:`~mixprec.comm.topology.HierarchicalGroups`), pipelined over the flat
scheme's segments:

1. intra-node reduce-scatter in the tensor dtype with fp32 sums
   (:func:`mixprec.comm.reduce_scatter_fp32_accumulate`): local rank l gets slice l summed over its node;
2. inter-node: the flat scheme (:class:`~mixprec.compress.flat.FlatPhase`) on slice l among the m ranks
   with local rank l;
3. intra-node all-gather of the quantized slices (uint8), which every rank decodes: identical bits.

The reduce-scatter stops after step 2. Byte counts against the flat scheme and ByteGrad's leader scheme:
``docs/compress.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.comm.agree import agree_any
from mixprec.comm.compat import all_gather_flat
from mixprec.comm.fp32_accumulate import reduce_scatter_fp32_accumulate
from mixprec.comm.topology import HierarchicalGroups
from mixprec.compress._scratch import Scratch
from mixprec.compress.flat import FlatPhase, overflowed_low_precision, segment_bounds
from mixprec.compress.fp8 import Compressor
from mixprec.compress.state import ErrorFeedback, Traffic

__all__ = ["IntraReduceScatter", "start_all_reduce", "start_reduce_scatter"]


class IntraReduceScatter:
    """Step 1, pipelined with step 2: for each segment of the inter-node scheme, a full-precision
    reduce-scatter inside the node (wire in the tensor dtype, fp32 sum in local-rank order), all started at
    once; ``source`` hands the inter-node phase each segment's sum as it completes.

    ``layout`` [n, m, L] (any strides) views the tensor so that row l is what local rank l reduces: the m
    inter-node parts of its slice. Each segment's columns are first copied into a contiguous send buffer.
    """

    def __init__(
        self, layout: torch.Tensor, hier: HierarchicalGroups, comp: Compressor, inflight: Scratch, shared: Scratch
    ) -> None:
        per_node, nodes, part = layout.shape
        numel = layout.numel()
        dtype, device = layout.dtype, layout.device
        self.segments = segment_bounds(part, nodes, comp.chunk_size)  # the inter-node phase's segments
        self.send = send = inflight.get("intra.send", numel, dtype, device)  # this rank's input, re-laid out
        recv = inflight.get("intra.recv", numel, dtype, device)
        # Written only inside wait(), so concurrently pending collectives may share it.
        self._sums = shared.get("intra.sum", nodes * part, torch.float32, device)
        self._pending: list[Any] = []
        self._outs: list[torch.Tensor] = []
        offset = 0
        for a, b in self.segments:
            size = per_node * nodes * (b - a)
            staged = send[offset : offset + size].view(per_node, nodes, b - a)
            staged.copy_(layout[:, :, a:b])
            out = self._sums[offset // per_node : (offset + size) // per_node]
            self._pending.append(
                reduce_scatter_fp32_accumulate(
                    out, staged.view(-1), hier.intra, average=False, async_op=True, scratch=recv[offset : offset + size]
                )
            )
            self._outs.append(out.view(nodes, b - a))
            offset += size

    def source(self, s: int, a: int, b: int) -> torch.Tensor:
        """Segment s's node sum, [m, b - a] fp32, once its reduce-scatter has finished."""
        pending = self._pending[s]
        if pending is not None:
            pending.wait()
        return self._outs[s]


def start_all_reduce(
    flat: torch.Tensor,
    hier: HierarchicalGroups,
    comp: Compressor,
    divisor: int | None,
    ef: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
) -> Callable[[], Traffic]:
    """Start the all-reduce of ``flat`` (contiguous, numel a multiple of the world size), reduced in place by
    the returned finishing work (steps 2 and 3 run there)."""
    nodes, per_node = hier.nodes, hier.ranks_per_node
    slice_len = flat.numel() // per_node
    # Local rank l reduces slice l = flat[l S, (l+1) S): in [local, node, part] layout, row l.
    intra = IntraReduceScatter(flat.view(per_node, nodes, -1), hier, comp, inflight, shared)

    def finish() -> Traffic:
        phase = FlatPhase(slice_len, intra.source, hier.inter, comp, ef, shared, shared, "inter.")
        # Step 3 moves the quantized slices, not decoded ones: 1 byte per element instead of 4 on the
        # intra-node link, and every rank decodes the same bytes (identical bits, flags seen everywhere).
        relayed = shared.get("intra.gather", per_node * nodes * phase.nbytes, torch.uint8, flat.device)
        views = phase.per_segment(relayed, per_node * nodes)
        works: list[Any] = []

        def relay(s: int) -> None:
            works.append(all_gather_flat(views[s].view(-1), phase.gathered[s].view(-1), hier.intra, async_op=True))

        phase.all_reduce_into(None, divisor, relay=relay)
        rows = flat.view(per_node * nodes, phase.part)  # row l * nodes + i: node i's part of slice l
        n_bad = 0
        for s, (a, b) in enumerate(phase.segments):
            works[s].wait()
            n_bad += comp.decode_rows(views[s], b - a, rows[:, a:b])
        n_bad += overflowed_low_precision(flat)
        sent, header = phase.bytes_per_phase()
        rs_bytes = (per_node - 1) * slice_len * flat.element_size()
        relay_bytes = (per_node - 1) * nodes * phase.nbytes
        return Traffic(
            n_bad > 0,
            # The send buffer of step 1 still holds this rank's (padded) input: its own NaN/Inf, not a node sum's.
            lambda: not bool(torch.isfinite(intra.send).all()),
            compressed=2 * sent + relay_bytes,
            header=2 * header + (per_node - 1) * nodes * phase.header,
            full_precision=rs_bytes,
            intra_node=rs_bytes + relay_bytes,
        )

    return finish


def start_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    hier: HierarchicalGroups,
    comp: Compressor,
    divisor: int | None,
    ef: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
) -> Callable[[], Traffic]:
    """Start the reduce-scatter of ``tensor`` into ``output``: rank ``node * n + l`` gets part ``node * n + l``.
    The finishing work agrees on the non-finite flag (one one-element all-reduce per subgroup)."""
    nodes, per_node = hier.nodes, hier.ranks_per_node
    flat = tensor.reshape(-1)
    shard = flat.numel() // (nodes * per_node)
    # Local rank l must end up with parts {node * n + l} (in node order), so that the inter-node
    # reduce-scatter hands node i part i * n + l, which is rank i * n + l's: the [local, node, shard] layout.
    intra = IntraReduceScatter(flat.view(nodes, per_node, shard).transpose(0, 1), hier, comp, inflight, shared)

    def finish() -> Traffic:
        phase = FlatPhase(nodes * shard, intra.source, hier.inter, comp, ef, shared, shared, "inter.")
        acc = phase.reduce(divisor)
        output.view(-1).copy_(acc)
        overflow = not bool(torch.isfinite(output).all())
        found = agree_any(phase.recv_bad > 0 or phase.local_bad > 0 or overflow, hier.inter)
        found = agree_any(found, hier.intra) if per_node > 1 else found
        sent, header = phase.bytes_per_phase()
        full = (per_node - 1) * nodes * shard * flat.element_size()
        return Traffic(
            found,
            lambda: not bool(torch.isfinite(tensor).all()),  # the input is not modified
            compressed=sent,
            header=header,
            full_precision=full,
            intra_node=full,
        )

    return finish
