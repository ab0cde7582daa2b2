"""One-process models of the compressed all-reduce (flat and hierarchical ByteGrad pipelines), bit for bit.

What :meth:`mixprec.compress.CompressedReducer.model` computes: the P ranks' buckets in, every rank's result
out, with the real pipelines' arithmetic (:mod:`mixprec.compress.flat`, :mod:`mixprec.compress.hierarchical`)
replayed sender by sender:

* flat: rank r quantizes its W parts (``encode_rows``, after adding its worker residual under error feedback);
  owner p decodes part p of every rank and sums them in fp32 in rank order, divides by P, adds its server
  residual, re-quantizes; every rank decodes every owner's part.
* hierarchical (m nodes of n ranks, node-major): each node sums its ranks' buckets in fp32 in local-rank order;
  local rank l of node i quantizes slice l of that sum ([m, part] rows); owner (node j, local l) decodes row j
  of every node's slice l, sums in node order, divides by P, re-quantizes; every rank decodes all of them.

Stochastic rounding: rank r's one Philox key per call; a sender's row k takes stream positions ``k part ..``,
an owner's re-encode the positions after the sent ones (``R part ..``), as ``FlatPhase`` does, so the segments
the real pipeline cuts do not matter. Error feedback: worker residuals [P, sent elements] (rank r's in row r)
and the server residuals [W * part] (the owner of result part p in part p), cleared when the result holds
flagged chunks, as the real collective clears them on every rank.
"""

from __future__ import annotations

import torch

from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.compress.flat import encode_with_feedback
from mixprec.compress.fp8 import Compressor

__all__ = ["compressed_all_reduce_rows", "feedback_shapes"]


def feedback_shapes(world: int, numel: int, ranks_per_node: int | None) -> tuple[tuple[int, int], tuple[int]]:
    """Shapes of the simulated ranks' (worker, server) residuals of one bucket: every rank's worker residual
    (its input, or in hierarchical mode its node slice) and the owners' server residuals, part by part."""
    senders = world if ranks_per_node is None else world // ranks_per_node
    return (world, senders * (numel // world)), (numel,)


class _Pipeline:
    def __init__(
        self,
        comp: Compressor,
        world: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        ranks_per_node: int | None,
        keys: list[int] | None,
        worker: torch.Tensor | None,
        server: torch.Tensor | None,
    ) -> None:
        self.comp, self.world, self.keys = comp, world, keys
        self.part = numel // world
        self.per_node = world if ranks_per_node is None else ranks_per_node
        self.nodes = world // self.per_node
        self.hierarchical = ranks_per_node is not None
        self.sender_rows = self.nodes if self.hierarchical else world
        self.codes = torch.empty(world, comp.encoded_nbytes(self.part), dtype=torch.uint8, device=device)
        self.acc = torch.empty(numel, dtype=torch.float32, device=device)
        self.decoded = torch.empty(numel, dtype=torch.float32, device=device)
        self.worker, self.server = worker, server
        self.numel, self.dtype = numel, dtype

    def send(self, sender: int, x: torch.Tensor, owners: slice, *, first: bool) -> None:
        """Sender ``sender`` quantizes ``x`` [R, part] (plus its residual); the owners ``owners`` add its rows."""
        rows = x.shape[0]
        codes = self.codes[:rows]
        # the sender's stream, row r at position r * part: what FlatPhase's first encode takes
        stream: dict[str, int] = {}
        if self.keys is not None:
            stream = {"key": self.keys[sender], "offset": 0, "row_stride": self.part}
        if self.worker is not None:  # FlatPhase's encode (the staging's fp32 add, or the wire's fused pass)
            residual = self.worker[sender].view(rows, self.part)
            encode_with_feedback(self.comp, x, residual, codes, None, **stream)
        else:
            self.comp.encode_rows(x, codes, **stream)
        target = self.acc.view(self.world, self.part)[owners]
        if first:
            self.comp.decode_rows(codes, self.part, target)
        else:  # decode_rows(..., reduce=True) in the real owner: ((dec_0 + dec_1) + dec_2) + ... in fp32
            decoded = self.decoded.view(self.world, self.part)[:rows]
            self.comp.decode_rows(codes, self.part, decoded)
            target.add_(decoded)

    def reencode(self, row: int, x: torch.Tensor, codes: torch.Tensor, server: torch.Tensor | None) -> None:
        """The owner of result part ``row`` re-quantizes it (plus its ``server`` residual, which it updates, as
        FlatPhase does: ``x`` is the staging): with stochastic rounding from its own key, at the positions after
        its sent ones (FlatPhase: ``numel + a``, numel = senders' rows x part)."""
        stream: dict[str, int] = {}
        if self.keys is not None:
            if self.hierarchical:  # part l m + j is owned by local rank l of node j
                local, node = divmod(row, self.nodes)
                owner = node * self.per_node + local
            else:
                owner = row
            stream = {"key": self.keys[owner], "offset": self.sender_rows * self.part}
        if server is None:
            self.comp.encode_rows(x, codes, **stream)
        else:
            encode_with_feedback(self.comp, x, server, codes, x, **stream)

    def run(self, rows: torch.Tensor, average: bool) -> torch.Tensor:
        world, part = self.world, self.part
        if not self.hierarchical:
            for r in range(world):
                self.send(r, rows[r].view(world, part), slice(0, world), first=r == 0)
        else:
            node_sum = torch.empty(self.numel, dtype=torch.float32, device=rows.device)
            for node in range(self.nodes):
                # The intra-node reduce-scatter: fp32 sum in local-rank order, kept in fp32.
                members = rows[node * self.per_node : (node + 1) * self.per_node]
                sum_shards_into(node_sum, members, average=False, rounding="nearest", generator=None)
                slices = node_sum.view(self.per_node, self.nodes, part)
                for lr in range(self.per_node):
                    owners = slice(lr * self.nodes, (lr + 1) * self.nodes)  # (node j, local lr): part lr m + j
                    self.send(node * self.per_node + lr, slices[lr], owners, first=node == 0)
        if average:
            self.acc.div_(world)
        owned = self.acc.view(world, part)
        if self.server is None and self.keys is None:
            self.comp.encode_rows(owned, self.codes)  # each owner re-quantizes its part
        else:
            server = self.server.view(world, part) if self.server is not None else None
            for p in range(world):
                self.reencode(p, owned[p : p + 1], self.codes[p : p + 1], None if server is None else server[p : p + 1])
        out = torch.empty(self.numel, dtype=self.dtype, device=rows.device)
        self.comp.decode_rows(self.codes, part, out.view(world, part))
        return out


def compressed_all_reduce_rows(
    rows: torch.Tensor,
    comp: Compressor,
    *,
    average: bool,
    ranks_per_node: int | None,
    keys: list[int] | None,
    worker: torch.Tensor | None,
    server: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """The compressed all-reduce of ``rows`` [P, n] (n a multiple of P; P >= 2): (every rank's result [n] in
    the rows' dtype, whether it holds non-finite values, i.e. the real call's ``found_nonfinite``).

    Args:
        comp: the compressor (its chunk size, format and rounding; its generator is not used: ``keys``).
        ranks_per_node: None for the flat scheme, else the hierarchical one with nodes of that many ranks.
        keys: stochastic rounding: each rank's Philox key for this call (rank r's in ``keys[r]``); None for
            round to nearest.
        worker, server: error feedback: the residuals of :func:`feedback_shapes`, updated in place (not
            cleared here: the caller clears them when the result is not finite); None without feedback.
    """
    world, numel = rows.shape
    pipeline = _Pipeline(comp, world, numel, rows.dtype, rows.device, ranks_per_node, keys, worker, server)
    out = pipeline.run(rows, average)
    return out, not bool(torch.isfinite(out).all())
