"""Compressed all-reduce and reduce-scatter: uint8 on the wire, fp32 sums, optional error feedback.

Flat scheme (ByteGrad's scatter-reduce / all-gather), on a group of W ranks, for a tensor of N elements cut
into W parts of L = N / W:

1. each rank quantizes each of its W parts with :class:`MinMaxUInt8` (one buffer per part);
2. one ``all_to_all_single`` of the uint8 buffers: rank p receives every rank's buffer of part p (gloo
   refuses float8 tensors but moves uint8);
3. rank p decodes the W buffers and adds them in fp32, in rank order 0, 1, ..., W-1 (deterministic),
   divides by W when averaging (one fp32 division);
4. rank p quantizes its reduced part once more, the buffers are all-gathered, and every rank decodes all
   W of them, its own included, so all ranks end with identical bits.

Steps 1-4 are pipelined over segments of whole chunks (``_SEGMENT_ELEMENTS``): each segment has its own
asynchronous all-to-all and all-gather, so quantizing one segment overlaps sending the previous ones; the
chunk grid, and so the result, is the same as without segments.

Hierarchical scheme (``topology`` given; m nodes of n ranks), pipelined over the same segments:

1. intra-node, full precision: a reduce-scatter that sends the input dtype and adds in fp32
   (:func:`mixprec.comm.reduce_scatter_fp32_accumulate`): local rank l of every node gets slice l
   (N / n elements) summed over its node;
2. inter-node, compressed: the flat scheme above on slice l among the m ranks with local rank l, one per
   node, dividing by m * n when averaging;
3. intra-node: all-gather of the n quantized slices (uint8, as they came out of step 2), which every rank
   decodes: a quarter of the bytes of an fp32 all-gather, and the same bits on every rank.

Compared with ByteGrad's leader scheme (reduce to one leader GPU per node, the leader alone quantizes and
exchanges the whole N elements with the other leaders, then broadcasts in the node): the bytes crossing
each node boundary are the same, ``2 (m-1)/m N`` plus headers, but here they are spread over the n ranks
(n parallel streams, n NICs where a node has several) and each rank quantizes N/n elements instead of one
leader quantizing N while the others wait; the intra-node steps are a balanced reduce-scatter and
all-gather (each rank sends ``(n-1)/n N`` elements) instead of a reduce into and a broadcast out of one
leader, whose link carries ``(n-1) N``. Against the flat uint8 scheme over all m*n ranks, the
hierarchical one moves n times fewer bytes across node boundaries (flat sends ``2 n (m-1)/m N`` per node).

Error: each quantization adds at most half a step of its chunk (one step for stochastic rounding) plus the
fp32 terms of :mod:`mixprec.compress.quantize`; an element of the result carries W worker-side errors
(summed, then divided by W when averaging) and one server-side error. The fp32 sums add
``gamma_{W-1}``-relative rounding. With ``error_feedback``, what each quantization lost is added to the next
call's input (worker side) or reduced part (server side), so summed over many calls the result tracks the
exact sum within one call's error instead of drifting.

Non-finite values: a chunk holding NaN/Inf is flagged in its header (see ``check_finite`` of the
compressor); it reduces and decodes to NaN on every rank (never to a finite value), and every rank
learns it: ``found_nonfinite`` in the returned stats is identical on all ranks. The same holds when every
input is finite but the reduction overflows: the fp32 sum beyond 3.4e38 (the re-quantization flags the
chunk; a reduce-scatter checks its output), or a result beyond the range of an fp16/bf16 tensor. With
the compressor's ``check_finite="raise"`` (its default) every rank then raises :class:`NonFiniteError`
after the collective completes (raising before it would leave the peers waiting), saying which of the two
happened (one extra one-element all-reduce, on this failure path only); ``"flag"`` only reports.
Error-feedback residuals are cleared in that case: the step is skipped, and they would carry part of its
gradient.

One rank: on a group of size 1 nothing is sent and nothing is quantized (it would only lose precision):
the all-reduce leaves the tensor as it is (the mean of one tensor), the reduce-scatter copies it into the
output; NaN/Inf are still detected and reported as above (they stay in place, they are not spread).

Asynchronous use: :func:`start_compressed_all_reduce` / :func:`start_compressed_reduce_scatter` return a
:class:`CompressedReduction`; its ``wait()`` runs the second half of the collective (more collectives). Every
rank must call ``wait()`` on its pending reductions in the same order (and start them in the same order),
like any sequence of collectives; a different order on two ranks deadlocks or, on gloo, mixes up their
messages. Each pending reduction holds its own :class:`CompressionWorkspace` until ``wait()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.agree import agree_any
from mixprec.comm.compat import all_gather_flat, require_initialized
from mixprec.comm.fp32_accumulate import reduce_scatter_fp32_accumulate
from mixprec.comm.padding import pad_flat
from mixprec.comm.topology import HierarchicalGroups, check_topology, resolve_topology
from mixprec.compress._scratch import Scratch
from mixprec.compress.quantize import FLOAT_DTYPES, HEADER_BYTES_PER_CHUNK, MinMaxUInt8, NonFiniteError
from mixprec.core.validate import check_bool, check_tensor

__all__ = [
    "CompressedReduction",
    "CompressionStats",
    "CompressionWorkspace",
    "ErrorFeedback",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
]


@dataclass(frozen=True)
class CompressionStats:
    """What one compressed collective sent from this rank (bytes handed to the backend, payload only).

    Attributes:
        numel: elements reduced (the caller's tensor, before any padding).
        world_size: ranks in the group.
        bytes_sent: all bytes this rank sent, both phases, all links.
        bytes_sent_compressed: bytes of uint8 buffers (codes + headers): the flat scheme's all-to-all and
            all-gather; in the hierarchical scheme the inter-node exchange plus the intra-node relay of the
            quantized slices.
        bytes_sent_full_precision: the hierarchical scheme's intra-node reduce-scatter (tensor dtype); 0 flat.
        bytes_sent_intra_node: the hierarchical scheme's intra-node bytes (that reduce-scatter and the
            relay); 0 in the flat scheme, which does not know the topology.
        header_bytes: the part of ``bytes_sent_compressed`` that is per-chunk (min, max) headers.
        fp32_baseline_bytes: what a ring fp32 collective of the same tensor sends per rank:
            ``2 (W-1)/W * 4N`` for an all-reduce, ``(W-1)/W * 4N`` for a reduce-scatter.
        found_nonfinite: some rank's input held NaN/Inf (identical on every rank).
    """

    numel: int
    world_size: int
    bytes_sent: int
    bytes_sent_compressed: int
    bytes_sent_full_precision: int
    bytes_sent_intra_node: int
    header_bytes: int
    fp32_baseline_bytes: int
    found_nonfinite: bool

    @property
    def bytes_sent_inter_node(self) -> int:
        """``bytes_sent - bytes_sent_intra_node`` (in the flat scheme: everything)."""
        return self.bytes_sent - self.bytes_sent_intra_node

    @property
    def ratio_to_fp32(self) -> float:
        """``bytes_sent / fp32_baseline_bytes`` (about 0.25 plus headers in the flat scheme)."""
        return self.bytes_sent / self.fp32_baseline_bytes if self.fp32_baseline_bytes else 0.0


class ErrorFeedback:
    """Error-feedback residuals of ONE tensor's compressed reductions: keep one per tensor (or bucket).

    ``worker``: fp32, what this rank's quantization of its input lost in the last call (the input's
    length, padded to a multiple of the group size; in hierarchical mode the node slice's length). It is
    added to the next call's input before quantizing. ``server``: fp32, what the re-quantization of the
    reduced part this rank owns lost (one part's length); added to that part next call. Both start at
    zero, are created on first use, and are cleared when a call finds NaN/Inf.
    """

    _SIDES = ("worker", "server")

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    @property
    def worker(self) -> torch.Tensor | None:
        return self._residuals.get("worker")

    @property
    def server(self) -> torch.Tensor | None:
        return self._residuals.get("server")

    def residual(self, side: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of ``side`` ("worker"/"server"), created as zeros on first use."""
        res = self._residuals.get(side)
        if res is None:
            res = self._residuals[side] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif res.numel() != numel:
            raise ValueError(
                f"error_feedback holds a {side} residual of {res.numel()} elements but this call needs {numel}: "
                "use one ErrorFeedback per tensor (the same tensor size, group and topology at every call)"
            )
        elif res.device != device:
            res = self._residuals[side] = res.to(device)
        return res

    def reset(self) -> None:
        """Zero both residuals (keeps their memory)."""
        for res in self._residuals.values():
            res.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"worker": fp32 tensor, "server": fp32 tensor}`` (only those created so far), cloned."""
        return {side: res.detach().clone() for side, res in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the residuals with copies of ``state``'s (a :meth:`state_dict`: keys among "worker" and
        "server", each a 1-D fp32 tensor); sides missing from ``state`` start again from zero on first use.
        Sizes are checked at the next call (they depend on the tensor, group and topology it is used with).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        unknown = set(state) - set(self._SIDES)
        if unknown:
            raise ValueError(f"unknown error-feedback state keys {sorted(unknown)}; expected 'worker', 'server'")
        for side, res in state.items():
            if not isinstance(res, torch.Tensor) or res.dtype != torch.float32 or res.dim() != 1:
                raise TypeError(f"state[{side!r}] must be a 1-D float32 tensor")
        self._residuals = {side: res.detach().clone() for side, res in state.items()}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{side}={res.numel()}" for side, res in self._residuals.items())
        return f"ErrorFeedback({sizes})"


class CompressionWorkspace:
    """Communication and fp32 buffers of compressed collectives, reused across calls.

    Pass the same workspace to repeated calls on same-sized tensors to avoid reallocating (a fresh large
    buffer costs page faults on first touch). One workspace per concurrently pending collective: a started
    collective holds its workspace until its ``wait()`` returns, and starting another one with the same
    workspace meanwhile raises RuntimeError (the second would overwrite buffers the first is still sending).
    Not thread-safe. Holds about ``3 N`` bytes of uint8 buffers plus ``4 N / W`` of fp32 for an N-element
    tensor (more with error feedback, hierarchical mode or padding).
    """

    def __init__(self) -> None:
        self.scratch = Scratch()
        self._busy = False

    def nbytes(self) -> int:
        """Bytes of all buffers this workspace holds now (they grow to the largest call and are kept)."""
        return self.scratch.nbytes()

    def _claim(self, name: str) -> Scratch:
        if self._busy:
            raise RuntimeError(
                f"{name} is still held by a started compressed collective whose wait() has not returned: give "
                "each pending collective its own CompressionWorkspace (start_* with workspace=None makes one)"
            )
        self._busy = True
        return self.scratch

    def _release(self) -> None:
        self._busy = False


class CompressedReduction:
    """A started compressed collective: ``wait()`` finishes it (blocking) and returns its stats.

    Until ``wait()`` returns, do not touch the tensor(s). ``wait()`` runs collectives: every rank must call
    it, for its pending reductions in the same order as the other ranks (see the module docstring).
    ``wait()`` may be called again; it returns the same stats. The workspace the collective was started
    with is released when ``wait()`` returns or raises.
    """

    def __init__(self, finish: Callable[[], CompressionStats], release: Callable[[], None] | None = None) -> None:
        self._finish: Callable[[], CompressionStats] | None = finish
        self._release = release
        self._stats: CompressionStats | None = None

    def wait(self) -> CompressionStats:
        """Finish the collective (blocking) and return this rank's :class:`CompressionStats`.

        Raises:
            NonFiniteError: as the blocking function (the compressor's ``check_finite="raise"``).
            RuntimeError: an earlier ``wait()`` of this handle raised (its result is undefined).
        """
        finish, self._finish = self._finish, None
        if finish is not None:
            try:
                self._stats = finish()
            finally:
                release, self._release = self._release, None
                if release is not None:
                    release()
        if self._stats is None:
            raise RuntimeError("this compressed collective failed in an earlier wait(); its result is undefined")
        return self._stats


_default_compressor: MinMaxUInt8 | None = None
# The blocking functions' buffers when they get no workspace: reused call after call (held only inside one
# call, so never by two pending collectives). start_* with workspace=None get a fresh workspace instead.
_default_workspace = CompressionWorkspace()


def _compressor(compressor: MinMaxUInt8 | None) -> MinMaxUInt8:
    global _default_compressor
    if compressor is None:
        if _default_compressor is None:
            _default_compressor = MinMaxUInt8()
        return _default_compressor
    if not isinstance(compressor, MinMaxUInt8):
        raise TypeError(f"compressor must be a mixprec.compress.MinMaxUInt8 or None; got {type(compressor).__name__}")
    return compressor


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


class _FlatPhase:
    """The flat scheme on one group, pipelined over segments: ``__init__`` quantizes every segment and starts
    its all-to-all; ``reduce`` (reduce-scatter) or ``all_reduce_into`` (re-quantize, all-gather, decode)
    finishes. Rank p owns part p (elements ``[p L, (p+1) L)``); segment s is ``[a_s, b_s)`` of every part.
    """

    def __init__(
        self,
        numel: int,
        source: Callable[[int, int, int], torch.Tensor],
        group: dist.ProcessGroup | None,
        comp: MinMaxUInt8,
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
        self.header = sum(HEADER_BYTES_PER_CHUNK * comp.num_chunks(b - a) for a, b in self.segments)
        first = source(0, *self.segments[0])
        device = first.device
        self.send = self._per_segment(inflight.get(tag + "send", world * self.nbytes, torch.uint8, device))
        self.recv = self._per_segment(inflight.get(tag + "recv", world * self.nbytes, torch.uint8, device))
        worker = staged = None
        if ef is not None:
            worker = ef.residual("worker", numel, device).view(world, part)
            staged = shared.get(tag + "v", numel, torch.float32, device).view(world, part)
        # All draws up front, in element order: the same as one unsegmented encode of the whole input.
        uniforms = self._uniforms("uniform", numel, device)
        self.local_bad = 0
        self._works = []
        for s, ((a, b), send, recv) in enumerate(zip(self.segments, self.send, self.recv)):
            v = first if s == 0 else source(s, a, b)
            if worker is not None and staged is not None:
                v = torch.add(v, worker[:, a:b], out=staged[:, a:b])
            u = None if uniforms is None else uniforms.view(world, part)[:, a:b]
            bad = comp._encode_rows(v, send, uniforms=u)
            self.local_bad += bad
            if worker is not None and not bad:
                res = worker[:, a:b]
                comp._decode_rows(send, b - a, res)
                torch.sub(v, res, out=res)  # what this quantization lost
            self._works.append(dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True))
        self.recv_bad = 0

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        comp: MinMaxUInt8,
        ef: ErrorFeedback | None,
        inflight: Scratch,
        shared: Scratch,
        tag: str,
    ) -> _FlatPhase:
        """The flat scheme on a contiguous tensor ``x`` (rank p owns ``x.view(W, -1)[p]``)."""
        rows = x.view(dist.get_world_size(group), -1)
        return cls(x.numel(), lambda s, a, b: rows[:, a:b], group, comp, ef, inflight, shared, tag)

    def _per_segment(self, flat: torch.Tensor, rows: int | None = None) -> list[torch.Tensor]:
        """Split a buffer of ``rows * nbytes`` bytes (rows: default W) into [rows, segment bytes] views."""
        rows = self.world if rows is None else rows
        views, offset = [], 0
        for nb in self.seg_nbytes:
            views.append(flat[offset : offset + rows * nb].view(rows, nb))
            offset += rows * nb
        return views

    def _uniforms(self, name: str, numel: int, device: torch.device) -> torch.Tensor | None:
        if self.comp.rounding != "stochastic":
            return None
        u = self.shared.get(self.tag + name, numel, torch.float32, device)
        torch.rand(numel, generator=self.comp.generator, out=u)
        return u

    def bytes_per_phase(self) -> tuple[int, int]:
        """(bytes, header bytes) this rank sends in one of the two phases: W-1 buffers per segment."""
        return (self.world - 1) * self.nbytes, (self.world - 1) * self.header

    def _sum_segment(self, s: int, acc: torch.Tensor, divisor: int | None) -> None:
        """Wait for segment s's all-to-all; ``acc`` = fp32 sum of its W decoded buffers (/ divisor)."""
        self._works[s].wait()
        self.recv_bad += self.comp._decode_rows(self.recv[s], acc.numel(), acc, reduce=True)
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
        self.gathered = gathered = self._per_segment(
            self.shared.get(self.tag + "gather", self.world * self.nbytes, torch.uint8, device)
        )
        server = self.ef.residual("server", self.part, device) if self.ef is not None else None
        uniforms = self._uniforms("server_uniform", self.part, device)
        works = []
        for s, (a, b) in enumerate(self.segments):
            acc_s = acc[a:b]
            self._sum_segment(s, acc_s, divisor)
            own = gathered[s][self.rank : self.rank + 1]
            if server is not None:
                acc_s.add_(server[a:b])
            bad = self.comp._encode_rows(
                acc_s.view(1, -1), own, uniforms=None if uniforms is None else uniforms[a:b].view(1, -1)
            )
            if server is not None and not bad:
                self.comp._decode_rows(own, b - a, server[a:b].view(1, -1))
                torch.sub(acc_s, server[a:b], out=server[a:b])
            works.append(all_gather_flat(gathered[s].view(-1), own.view(-1), self.group, async_op=True))
        n_bad = 0
        for s, (a, b) in enumerate(self.segments):
            works[s].wait()
            if relay is not None:
                relay(s)
            elif out is not None:
                n_bad += self.comp._decode_rows(gathered[s], b - a, out.view(self.world, self.part)[:, a:b])
        return n_bad


class _IntraReduceScatter:
    """The hierarchical scheme's step 1, pipelined with step 2: for each segment of the inter-node scheme, a
    full-precision reduce-scatter inside the node (:func:`reduce_scatter_fp32_accumulate`: wire in the tensor
    dtype, fp32 sum in local-rank order), all started at once; ``source`` hands the inter-node phase each
    segment's sum as it completes.

    ``layout`` [n, m, L] (any strides) views the tensor so that row l is what local rank l reduces: the m
    inter-node parts of its slice. Each segment's columns are first copied into a contiguous send buffer.
    """

    def __init__(
        self, layout: torch.Tensor, hier: HierarchicalGroups, comp: MinMaxUInt8, inflight: Scratch, shared: Scratch
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


def _check_common(compressor: MinMaxUInt8 | None, average: bool, error_feedback: ErrorFeedback | None) -> MinMaxUInt8:
    comp = _compressor(compressor)
    check_bool("average", average)
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError(
            f"error_feedback must be a mixprec.compress.ErrorFeedback or None; got {type(error_feedback).__name__}"
        )
    return comp


def _workspace(name: str, workspace: CompressionWorkspace | None) -> CompressionWorkspace:
    """``workspace``, or a fresh one for None: a started collective never shares its buffers by default."""
    if workspace is None:
        return CompressionWorkspace()
    if not isinstance(workspace, CompressionWorkspace):
        raise TypeError(f"{name} must be a CompressionWorkspace or None; got {type(workspace).__name__}")
    return workspace


def _conclude(
    found: bool,
    local_input_bad: Callable[[], bool],
    group: dist.ProcessGroup | None,
    comp: MinMaxUInt8,
    ef: ErrorFeedback | None,
    stats: CompressionStats,
    what: str,
) -> CompressionStats:
    """Clear the residuals and raise (``check_finite="raise"``) when the result holds flagged chunks.

    ``found`` is identical on every rank, so the agreement on ``local_input_bad()`` (did this rank's own input
    hold NaN/Inf?) that tells an input problem from an overflow of the fp32 sum is entered by all ranks.
    """
    if not found:
        return stats
    if ef is not None:
        ef.reset()
    input_bad = agree_any(local_input_bad(), group) if dist.get_world_size(group) > 1 else local_input_bad()
    if comp.check_finite == "raise":
        if input_bad:
            cause = "some rank's input holds NaN or Inf"
        else:
            cause = (
                "every rank's input is finite but the reduction overflowed (the fp32 sum beyond 3.4e38, or the "
                "result beyond the range of the output dtype)"
            )
        raise NonFiniteError(
            f"{what}: {cause} (the affected chunks reduced to NaN on every rank); use a compressor with "
            "check_finite='flag' to get stats.found_nonfinite for the loss scaler instead"
        )
    return stats


def _overflowed_low_precision(result: torch.Tensor) -> int:
    """1 when an fp16/bf16 result holds Inf/NaN that its fp32 chunks did not flag (a decoded value beyond the
    dtype's range), else 0. The decoded bytes are the same on every rank, so is this answer. fp32: 0, free."""
    if result.dtype == torch.float32:
        return 0
    return int(not bool(torch.isfinite(result).all()))


def _single_rank(
    tensor: torch.Tensor,
    output: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    comp: MinMaxUInt8,
    ef: ErrorFeedback | None,
    what: str,
) -> CompressedReduction:
    """A group of one: nothing to send or quantize; ``output`` (reduce-scatter) gets a copy of ``tensor``."""

    def finish() -> CompressionStats:
        if output is not None:
            output.view(-1).copy_(tensor.reshape(-1))
        bad_input = not bool(torch.isfinite(tensor).all())
        # A narrower output (fp32 input, fp16 output) can overflow in the copy: that is overflow, not bad input.
        found = bad_input or (output is not None and not bool(torch.isfinite(output).all()))
        stats = CompressionStats(tensor.numel(), 1, 0, 0, 0, 0, 0, 0, found)
        # group, not None: a one-rank subgroup of a larger world must not enter a world-wide agreement
        return _conclude(found, lambda: bad_input, group, comp, ef, stats, what)

    return CompressedReduction(finish)


def start_compressed_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: MinMaxUInt8 | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
    shared_workspace: CompressionWorkspace | None = None,
) -> CompressedReduction:
    """:func:`compressed_all_reduce`, split: quantizes and starts the first exchange, returns a handle.

    ``workspace`` holds the buffers in flight until ``wait()`` returns (None: a fresh workspace for this
    call; a workspace already held by another pending collective raises RuntimeError);
    ``shared_workspace`` (default: the same) the ones used only inside this call or ``wait()``, which
    concurrently pending collectives may share. Every rank must start its collectives, and ``wait()`` for
    them, in the same order.

    Raises:
        ValueError, TypeError: bad arguments (before anything is sent).
        RuntimeError: no initialised process group, or ``workspace`` is held by a pending collective.
    """
    require_initialized("compressed_all_reduce")
    check_tensor("tensor", tensor, FLOAT_DTYPES)
    comp = _check_common(compressor, average, error_feedback)
    comp._check_generator_device(tensor.device)
    own = _workspace("workspace", workspace)
    shared_ws = own if shared_workspace is None else _workspace("shared_workspace", shared_workspace)
    world = dist.get_world_size(group)
    if world == 1:
        if topology is not None:
            check_topology(topology, group)
        return _single_rank(tensor, None, group, comp, error_feedback, "compressed_all_reduce")
    hier = resolve_topology(topology, group) if topology is not None else None
    return _start_holding(
        own,
        lambda inflight: _start_all_reduce(
            tensor, group, comp, average, hier, error_feedback, inflight, shared_ws.scratch, world
        ),
    )


def _start_holding(own: CompressionWorkspace, start: Callable[[Scratch], CompressedReduction]) -> CompressedReduction:
    """Run ``start`` on ``own``'s in-flight buffers, claimed until the returned reduction's ``wait()`` ends
    (released at once if ``start`` raises)."""
    inflight = own._claim("workspace")
    try:
        reduction = start(inflight)
    except BaseException:
        own._release()
        raise
    reduction._release = own._release
    return reduction


def _start_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    comp: MinMaxUInt8,
    average: bool,
    hier: HierarchicalGroups | None,
    error_feedback: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
    world: int,
) -> CompressedReduction:
    numel = tensor.numel()
    # Zero padding to W equal parts (the zeros join the last part's range).
    padded = -(-numel // world) * world
    flat, copy_back = pad_flat(
        tensor, world, buffer=lambda length: inflight.get("padded", length, tensor.dtype, tensor.device)
    )
    fp32_baseline = 2 * (world - 1) * 4 * numel // world

    if hier is None:
        phase = _FlatPhase.of(flat, group, comp, error_feedback, inflight, shared, "")

        def finish_flat() -> CompressionStats:
            # flagged chunks travel in the gathered headers: no extra collective
            n_bad = phase.all_reduce_into(flat, world if average else None)
            n_bad += _overflowed_low_precision(flat)
            copy_back()
            sent, header = phase.bytes_per_phase()
            stats = CompressionStats(numel, world, 2 * sent, 2 * sent, 0, 0, 2 * header, fp32_baseline, n_bad > 0)
            return _conclude(
                n_bad > 0, lambda: phase.local_bad > 0, group, comp, error_feedback, stats, "compressed_all_reduce"
            )

        return CompressedReduction(finish_flat)

    per_node = hier.ranks_per_node
    slice_len = padded // per_node
    # Local rank l reduces slice l = flat[l S, (l+1) S): in [local, node, part] layout, row l.
    intra = _IntraReduceScatter(flat.view(per_node, hier.nodes, -1), hier, comp, inflight, shared)

    def finish_hierarchical() -> CompressionStats:
        phase = _FlatPhase(slice_len, intra.source, hier.inter, comp, error_feedback, shared, shared, "inter.")
        # Step 3 moves the quantized slices, not decoded ones: 1 byte per element instead of 4 on the
        # intra-node link, and every rank decodes the same bytes (identical bits, flags seen everywhere).
        nodes = hier.nodes
        relayed = shared.get("intra.gather", per_node * nodes * phase.nbytes, torch.uint8, flat.device)
        views = phase._per_segment(relayed, per_node * nodes)
        works: list[Any] = []

        def relay(s: int) -> None:
            works.append(all_gather_flat(views[s].view(-1), phase.gathered[s].view(-1), hier.intra, async_op=True))

        phase.all_reduce_into(None, world if average else None, relay=relay)
        rows = flat.view(per_node * nodes, phase.part)  # row l * nodes + i: node i's part of slice l
        n_bad = 0
        for s, (a, b) in enumerate(phase.segments):
            works[s].wait()
            n_bad += comp._decode_rows(views[s], b - a, rows[:, a:b])
        n_bad += _overflowed_low_precision(flat)
        copy_back()
        sent, header = phase.bytes_per_phase()
        rs_bytes = (per_node - 1) * slice_len * flat.element_size()
        relay_bytes = (per_node - 1) * nodes * phase.nbytes
        stats = CompressionStats(
            numel=numel,
            world_size=world,
            bytes_sent=2 * sent + rs_bytes + relay_bytes,
            bytes_sent_compressed=2 * sent + relay_bytes,
            bytes_sent_full_precision=rs_bytes,
            bytes_sent_intra_node=rs_bytes + relay_bytes,
            header_bytes=2 * header + (per_node - 1) * nodes * phase.header,
            fp32_baseline_bytes=fp32_baseline,
            found_nonfinite=n_bad > 0,
        )
        # The send buffer of step 1 still holds this rank's (padded) input: its own NaN/Inf, not a node sum's.
        return _conclude(
            n_bad > 0,
            lambda: not bool(torch.isfinite(intra.send).all()),
            group,
            comp,
            error_feedback,
            stats,
            "compressed_all_reduce",
        )

    return CompressedReduction(finish_hierarchical)


def compressed_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: MinMaxUInt8 | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
) -> CompressionStats:
    """In-place all-reduce of ``tensor`` with uint8 min-max compression (the schemes of this module).

    Wire dtype: uint8 codes plus fp32 per-chunk (min, max) headers, about ``1/4`` of fp32's bytes:
    flat, each rank sends ``2 (W-1)/W`` of the encoded tensor (``N + 8 N / chunk_size`` bytes); hierarchical,
    the same over the inter-node group of m ranks on ``N / n`` elements, plus, intra-node, ``(n-1)/n N``
    elements in the tensor dtype (reduce-scatter) and ``(n-1)/n`` of the encoded tensor (relay).
    Nothing on a group of one rank.
    Accumulation: fp32, in rank order (hierarchical: local-rank order inside the node, then node order).
    Extra memory: about ``3 N`` bytes of uint8 buffers and ``4 N / W`` bytes of fp32 (the owned part's
    sum), kept in ``workspace``; ``+ 4 N`` with error feedback (worker residual and its staging copy) and,
    hierarchical, ``2 N`` elements of the tensor dtype (intra-node send copy and receive buffer), ``4 N / n``
    of fp32 and ``N`` more bytes (the relayed slices).

    Args:
        tensor: fp32/fp16/bf16, any shape; reduced in place. Identical bits on every rank afterwards.
            If it is not contiguous or its size is not a multiple of the group size, it is copied into a
            zero-padded buffer (and back).
        group: process group; None = the default group.
        compressor: the :class:`MinMaxUInt8` (chunk size, rounding, generator, check_finite); None = a
            shared default instance (chunk_size=2048, nearest, check_finite="raise"). Its generator must be on
            the tensor's device.
        average: divide the fp32 sum by the group size before re-quantizing (else return the sum).
        topology: None (flat), a :class:`Topology` or a 2-D DeviceMesh with dims ("node", "local")
            (hierarchical; needs group=None).
        error_feedback: an :class:`ErrorFeedback` kept for this tensor across calls, or None.
        workspace: a :class:`CompressionWorkspace` to reuse buffers across calls; None = a module default
            (reused by every blocking call that passes None).

    Returns:
        :class:`CompressionStats` of this call (bytes sent by this rank, non-finite flag).

    Raises:
        NonFiniteError: some rank's input held NaN/Inf, or the reduction overflowed, and the compressor has
            ``check_finite="raise"`` (raised on every rank, after the collective completed; affected chunks
            are NaN; the message says which of the two happened).
        ValueError, TypeError: bad arguments, before anything is sent.
        RuntimeError: no initialised process group, or ``workspace`` is held by a pending collective.
    """
    return start_compressed_all_reduce(
        tensor,
        group,
        compressor=compressor,
        average=average,
        topology=topology,
        error_feedback=error_feedback,
        workspace=_default_workspace if workspace is None else workspace,
    ).wait()


def start_compressed_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: MinMaxUInt8 | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
    shared_workspace: CompressionWorkspace | None = None,
) -> CompressedReduction:
    """:func:`compressed_reduce_scatter`, split like :func:`start_compressed_all_reduce` (same workspace rules,
    same requirement that every rank starts and waits in the same order).
    """
    require_initialized("compressed_reduce_scatter")
    check_tensor("tensor", tensor, FLOAT_DTYPES)
    check_tensor("output", output, FLOAT_DTYPES)
    comp = _check_common(compressor, average, error_feedback)
    comp._check_generator_device(tensor.device)
    own = _workspace("workspace", workspace)
    shared_ws = own if shared_workspace is None else _workspace("shared_workspace", shared_workspace)
    world = dist.get_world_size(group)
    numel = tensor.numel()
    if numel % world:
        raise ValueError(
            f"tensor.numel() = {numel} is not divisible by the group size {world}: pad it to a multiple of {world}"
        )
    shard = numel // world
    if output.numel() != shard or not output.is_contiguous():
        raise ValueError(f"output must be contiguous with tensor.numel() / group size = {shard} elements")
    if world == 1:
        if topology is not None:
            check_topology(topology, group)
        return _single_rank(tensor, output, group, comp, error_feedback, "compressed_reduce_scatter")
    hier = resolve_topology(topology, group) if topology is not None else None
    return _start_holding(
        own,
        lambda inflight: _start_reduce_scatter(
            output, tensor, group, comp, average, hier, error_feedback, inflight, shared_ws.scratch, world
        ),
    )


def _start_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    comp: MinMaxUInt8,
    average: bool,
    hier: HierarchicalGroups | None,
    error_feedback: ErrorFeedback | None,
    inflight: Scratch,
    shared: Scratch,
    world: int,
) -> CompressedReduction:
    numel = tensor.numel()
    shard = numel // world
    flat = tensor.reshape(-1)
    fp32_baseline = (world - 1) * 4 * numel // world

    if hier is None:
        phase = _FlatPhase.of(flat, group, comp, error_feedback, inflight, shared, "")

        def finish_flat() -> CompressionStats:
            acc = phase.reduce(world if average else None)
            output.view(-1).copy_(acc)
            # An fp32 sum beyond 3.4e38 (or beyond output's dtype) is inf here, not a flagged chunk.
            overflow = not bool(torch.isfinite(output).all())
            found = agree_any(phase.recv_bad > 0 or phase.local_bad > 0 or overflow, group)
            sent, header = phase.bytes_per_phase()
            stats = CompressionStats(numel, world, sent, sent, 0, 0, header, fp32_baseline, found)
            return _conclude(
                found, lambda: phase.local_bad > 0, group, comp, error_feedback, stats, "compressed_reduce_scatter"
            )

        return CompressedReduction(finish_flat)

    nodes, per_node = hier.nodes, hier.ranks_per_node
    # Local rank l must end up with parts {node * n + l} (in node order), so that the inter-node
    # reduce-scatter hands node i part i * n + l, which is rank i * n + l's: the [local, node, shard] layout.
    intra = _IntraReduceScatter(flat.view(nodes, per_node, shard).transpose(0, 1), hier, comp, inflight, shared)

    def finish_hierarchical() -> CompressionStats:
        phase = _FlatPhase(nodes * shard, intra.source, hier.inter, comp, error_feedback, shared, shared, "inter.")
        acc = phase.reduce(world if average else None)
        output.view(-1).copy_(acc)
        overflow = not bool(torch.isfinite(output).all())
        found = agree_any(phase.recv_bad > 0 or phase.local_bad > 0 or overflow, hier.inter)
        found = agree_any(found, hier.intra) if per_node > 1 else found
        sent, header = phase.bytes_per_phase()
        full = (per_node - 1) * nodes * shard * flat.element_size()
        stats = CompressionStats(numel, world, sent + full, sent, full, full, header, fp32_baseline, found)
        return _conclude(
            found,
            lambda: not bool(torch.isfinite(tensor).all()),  # the input is not modified
            group,
            comp,
            error_feedback,
            stats,
            "compressed_reduce_scatter",
        )

    return CompressedReduction(finish_hierarchical)


def compressed_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: MinMaxUInt8 | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
) -> CompressionStats:
    """Reduce-scatter with uint8 compression: rank r gets elements ``[r S, (r+1) S)`` of the reduced tensor.

    The first half of :func:`compressed_all_reduce` (quantize, all-to-all, fp32 sum in rank order); the
    owned part is not re-quantized, so only worker-side error feedback applies and the result carries W
    quantization errors (averaged) and one rounding to ``output.dtype``. In hierarchical mode the intra-node
    reduce-scatter first gathers parts ``{node * n + l}`` on local rank l, so rank r still gets part r.

    Wire dtype: uint8 + headers, ``(W-1)/W`` of the encoded tensor per rank (hierarchical: over the
    inter-node group, plus the intra-node reduce-scatter in the tensor dtype). Accumulation: fp32.
    Extra memory: about ``2 N`` bytes of uint8 buffers and ``4 N / W`` of fp32; hierarchical adds a re-laid-out
    send copy and a receive buffer of the tensor (``2 N`` elements of its dtype) and ``4 N / n`` of fp32.

    Args:
        output: contiguous, ``tensor.numel() / W`` elements, fp32/fp16/bf16 (rounded to nearest once).
        tensor: fp32/fp16/bf16, ``numel`` divisible by the group size; not modified.
        group, compressor, average, topology, error_feedback, workspace: as in :func:`compressed_all_reduce`.
            The non-finite flag costs one one-element all-reduce here (two in hierarchical mode).

    Returns:
        :class:`CompressionStats` of this call (bytes sent by this rank, non-finite flag).

    Raises:
        NonFiniteError: some rank's input held NaN/Inf, or the reduction overflowed, and the compressor has
            ``check_finite="raise"`` (raised on every rank, after the collective completed).
        ValueError: ``tensor.numel()`` not divisible by the group size, ``output`` of the wrong size or not
            contiguous, or another bad argument (TypeError for a wrong type), before anything is sent.
        RuntimeError: no initialised process group, or ``workspace`` is held by a pending collective.
    """
    return start_compressed_reduce_scatter(
        output,
        tensor,
        group,
        compressor=compressor,
        average=average,
        topology=topology,
        error_feedback=error_feedback,
        workspace=_default_workspace if workspace is None else workspace,
    ).wait()
