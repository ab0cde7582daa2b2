"""Compressed all-reduce and reduce-scatter: uint8 on the wire, fp32 sums, optional error feedback.

The public entry points. Each validates its arguments through one shared preamble (on every rank, before
anything is sent), then starts the flat scheme (:mod:`mixprec.compress.flat`, after Bagua's ByteGrad) or,
with a ``topology``, the hierarchical one (:mod:`mixprec.compress.hierarchical`), and returns a
:class:`mixprec.comm.PendingReduction` whose ``wait()`` finishes the collective and returns its
:class:`~mixprec.compress.state.CompressionStats`. The blocking functions are ``start_*(...).wait()``.

Non-finite inputs, or a reduction that overflows, reduce to NaN on every rank and set
``found_nonfinite`` identically everywhere; with the compressor's ``check_finite="raise"`` every rank then
raises :class:`~mixprec.compress.NonFiniteError` after the collective has completed, and error-feedback
residuals are cleared. A group of one rank sends and quantizes nothing. Every rank must start its pending
collectives, and wait for them, in the same order. Schemes, wire format and error bounds: ``docs/compress.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.agree import agree_any
from mixprec.comm.compat import require_initialized
from mixprec.comm.handles import PendingReduction
from mixprec.comm.padding import pad_flat
from mixprec.comm.topology import HierarchicalGroups, check_topology, resolve_topology
from mixprec.compress import flat, hierarchical
from mixprec.compress._scratch import Scratch
from mixprec.compress.fp8 import COMPRESSORS, FP8_FORMATS, Compressor
from mixprec.compress.quantize import FLOAT_DTYPES, MinMaxUInt8, NonFiniteError
from mixprec.compress.state import CompressionStats, CompressionWorkspace, ErrorFeedback, Traffic
from mixprec.core.validate import check_bool, check_group, check_tensor

__all__ = [
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "start_compressed_all_reduce",
    "start_compressed_reduce_scatter",
]

_default_compressor: Compressor | None = None
# The blocking functions' buffers when they get no workspace: reused call after call (held only inside one
# call, so never by two pending collectives). start_* with workspace=None get a fresh workspace instead.
_default_workspace = CompressionWorkspace()


@dataclass(frozen=True)
class _Call:
    """One validated call of a public function: what the pipelines and the conclusion need."""

    what: str
    group: dist.ProcessGroup | None
    comp: Compressor
    divisor: int | None  # the group size when averaging
    error_feedback: ErrorFeedback | None
    workspace: CompressionWorkspace  # held by the pending collective until wait() returns
    shared: Scratch  # used only inside start and wait(): pending collectives may share it
    world: int
    hier: HierarchicalGroups | None

    def start(
        self,
        numel: int,
        fp32_baseline: int,
        pipeline: Callable[[Scratch], Callable[[], Traffic]],
    ) -> PendingReduction:
        """Run ``pipeline`` on the workspace's buffers, claimed until the returned handle's ``wait()`` ends
        (released at once if ``pipeline`` raises); ``wait()`` finishes it and concludes."""
        inflight = self.workspace.claim("workspace")
        try:
            with torch.no_grad():  # a tensor that requires grad is reduced like any other, as dist.all_reduce does
                finish = pipeline(inflight)
        except BaseException:
            self.workspace.release()
            raise

        def wait() -> CompressionStats:
            try:
                with torch.no_grad():
                    traffic = finish()
            finally:
                self.workspace.release()
            return self.conclude(traffic, numel, fp32_baseline)

        return PendingReduction(wait)

    def conclude(self, traffic: Traffic, numel: int, fp32_baseline: int) -> CompressionStats:
        """The call's stats; when the result holds flagged chunks, clear the residuals and raise
        (``check_finite="raise"``).

        ``found_nonfinite`` is identical on every rank, so the agreement on ``local_input_bad()`` (did this
        rank's own input hold NaN/Inf?) that tells an input problem from an overflow of the fp32 sum is
        entered by all ranks (of ``group``, not the world: a one-rank subgroup must not wait for others).
        """
        stats = traffic.stats(numel, self.world, fp32_baseline)
        if not stats.found_nonfinite:
            return stats
        if self.error_feedback is not None:
            self.error_feedback.reset()
        local = traffic.local_input_bad()
        input_bad = agree_any(local, self.group) if self.world > 1 else local
        if self.comp.check_finite == "raise":
            if input_bad:
                cause = "some rank's input holds NaN or Inf"
            else:
                cause = (
                    "every rank's input is finite but the reduction overflowed (the fp32 sum beyond 3.4e38, or the "
                    "result beyond the range of the output dtype)"
                )
            raise NonFiniteError(
                f"{self.what}: {cause} (the affected chunks reduced to NaN on every rank); use a compressor with "
                "check_finite='flag' to get stats.found_nonfinite for the loss scaler instead"
            )
        return stats

    def single_rank(self, tensor: torch.Tensor, output: torch.Tensor | None) -> PendingReduction:
        """A group of one: nothing to send or quantize; ``output`` (reduce-scatter) gets a copy of ``tensor``."""

        def wait() -> CompressionStats:
            if output is not None:
                with torch.no_grad():
                    output.view(-1).copy_(tensor.reshape(-1))
            bad_input = not bool(torch.isfinite(tensor).all())
            # A narrower output (fp32 input, fp16 output) can overflow in the copy: overflow, not bad input.
            found = bad_input or (output is not None and not bool(torch.isfinite(output).all()))
            return self.conclude(Traffic(found, lambda: bad_input), tensor.numel(), 0)

        return PendingReduction(wait)


def _preamble(
    what: str,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    output: torch.Tensor | None,
    scatter: bool,
    compressor: Compressor | None,
    average: bool,
    topology: Any,
    error_feedback: ErrorFeedback | None,
    workspace: CompressionWorkspace | None,
    shared_workspace: CompressionWorkspace | None,
) -> _Call:
    """Validate a call (ValueError/TypeError naming the argument; RuntimeError without a process group) and
    resolve its compressor, workspaces and topology. ``output`` is checked for a reduce-scatter (``scatter``)."""
    require_initialized(what)
    _check_data("tensor", tensor)
    if scatter:
        _check_data("output", output)
    comp = _compressor(compressor)
    check_bool("average", average)
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError(
            f"error_feedback must be a mixprec.compress.ErrorFeedback or None; got {type(error_feedback).__name__}"
        )
    comp.check_generator_device(tensor.device)
    own = _workspace("workspace", workspace)
    shared = own if shared_workspace is None else _workspace("shared_workspace", shared_workspace)
    world = dist.get_world_size(check_group("group", group))
    if scatter:
        numel = tensor.numel()
        if numel % world:
            raise ValueError(
                f"tensor.numel() = {numel} is not divisible by the group size {world}: pad it to a multiple of {world}"
            )
        if output.numel() != numel // world or not output.is_contiguous():
            raise ValueError(f"output must be contiguous with tensor.numel() / group size = {numel // world} elements")
    hier = None
    if world == 1:
        if topology is not None:
            check_topology(topology, group)
    elif topology is not None:
        hier = resolve_topology(topology, group)
    return _Call(what, group, comp, world if average else None, error_feedback, own, shared.scratch, world, hier)


def _check_data(name: str, tensor: Any) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_FORMATS.values():
        allowed = " or ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(
            f"{name} must have dtype {allowed}; got {tensor.dtype} (gloo cannot move float8 tensors, and fp8 values "
            "need their scales: pass the fp32/fp16/bf16 tensor with compressor=mixprec.compress.ScaledFP8(...))"
        )
    check_tensor(name, tensor, FLOAT_DTYPES)
    if tensor.is_meta:
        raise ValueError(f"{name} is on the meta device: it holds no data to reduce (materialize it first)")


def _compressor(compressor: Compressor | None) -> Compressor:
    global _default_compressor
    if compressor is None:
        if _default_compressor is None:
            _default_compressor = MinMaxUInt8()
        return _default_compressor
    if not isinstance(compressor, COMPRESSORS):
        raise TypeError(
            "compressor must be a mixprec.compress.MinMaxUInt8, a mixprec.compress.ScaledFP8 or None; "
            f"got {type(compressor).__name__}"
        )
    return compressor


def _workspace(name: str, workspace: CompressionWorkspace | None) -> CompressionWorkspace:
    """``workspace``, or a fresh one for None: a started collective never shares its buffers by default."""
    if workspace is None:
        return CompressionWorkspace()
    if not isinstance(workspace, CompressionWorkspace):
        raise TypeError(f"{name} must be a CompressionWorkspace or None; got {type(workspace).__name__}")
    return workspace


def start_compressed_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: Compressor | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
    shared_workspace: CompressionWorkspace | None = None,
) -> PendingReduction:
    """:func:`compressed_all_reduce`, split: quantizes and starts the first exchange, returns a handle whose
    ``wait()`` finishes the collective (more collectives) and returns its :class:`CompressionStats`.

    ``workspace`` holds the buffers in flight until ``wait()`` returns (None: a fresh workspace for this
    call; a workspace already held by another pending collective raises RuntimeError);
    ``shared_workspace`` (default: the same) the ones used only inside this call or ``wait()``, which
    concurrently pending collectives may share. Every rank must start its collectives, and ``wait()`` for
    them, in the same order. After a failed ``wait()`` every later one raises the same exception.

    Raises:
        ValueError, TypeError: bad arguments (before anything is sent).
        RuntimeError: no initialised process group, or ``workspace`` is held by a pending collective.
    """
    call = _preamble(
        "compressed_all_reduce",
        tensor,
        group,
        output=None,
        scatter=False,
        compressor=compressor,
        average=average,
        topology=topology,
        error_feedback=error_feedback,
        workspace=workspace,
        shared_workspace=shared_workspace,
    )
    if call.world == 1:
        return call.single_rank(tensor, None)

    def pipeline(inflight: Scratch) -> Callable[[], Traffic]:
        # Zero padding to W equal parts (the zeros join the last part's range).
        padded, copy_back = pad_flat(
            tensor, call.world, buffer=lambda length: inflight.get("padded", length, tensor.dtype, tensor.device)
        )
        if call.hier is None:
            finish = flat.start_all_reduce(
                padded, call.group, call.comp, call.divisor, call.error_feedback, inflight, call.shared
            )
        else:
            finish = hierarchical.start_all_reduce(
                padded, call.hier, call.comp, call.divisor, call.error_feedback, inflight, call.shared
            )

        def finish_and_copy_back() -> Traffic:
            traffic = finish()
            copy_back()  # before the conclusion may raise: flagged chunks are NaN in the tensor too
            return traffic

        return finish_and_copy_back

    numel, world = tensor.numel(), call.world
    return call.start(numel, 2 * (world - 1) * 4 * numel // world, pipeline)


def compressed_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: Compressor | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
) -> CompressionStats:
    """In-place all-reduce of ``tensor`` with uint8 min-max compression (flat or hierarchical scheme).

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
        compressor: the :class:`MinMaxUInt8` or :class:`ScaledFP8` (chunk size, rounding, generator,
            check_finite); None = a shared default MinMaxUInt8 (chunk_size=2048, nearest,
            check_finite="raise"). Its generator must be on the tensor's device.
        average: divide the fp32 sum by the group size before re-quantizing (else return the sum).
        topology: None (flat), a :class:`Topology` or a 2-D DeviceMesh with dims ("node", "local")
            (hierarchical; needs group=None).
        error_feedback: an :class:`ErrorFeedback` kept for this tensor across calls, or None.
        workspace: a :class:`~mixprec.compress.state.CompressionWorkspace` to reuse buffers across calls;
            None = a module default (reused by every blocking call that passes None).

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
    compressor: Compressor | None = None,
    average: bool = True,
    topology: Any = None,
    error_feedback: ErrorFeedback | None = None,
    workspace: CompressionWorkspace | None = None,
    shared_workspace: CompressionWorkspace | None = None,
) -> PendingReduction:
    """:func:`compressed_reduce_scatter`, split like :func:`start_compressed_all_reduce` (same workspace rules,
    same requirement that every rank starts and waits in the same order).
    """
    call = _preamble(
        "compressed_reduce_scatter",
        tensor,
        group,
        output=output,
        scatter=True,
        compressor=compressor,
        average=average,
        topology=topology,
        error_feedback=error_feedback,
        workspace=workspace,
        shared_workspace=shared_workspace,
    )
    if call.world == 1:
        return call.single_rank(tensor, output)

    def pipeline(inflight: Scratch) -> Callable[[], Traffic]:
        if call.hier is None:
            return flat.start_reduce_scatter(
                output, tensor, call.group, call.comp, call.divisor, call.error_feedback, inflight, call.shared
            )
        return hierarchical.start_reduce_scatter(
            output, tensor, call.hier, call.comp, call.divisor, call.error_feedback, inflight, call.shared
        )

    numel, world = tensor.numel(), call.world
    return call.start(numel, (world - 1) * 4 * numel // world, pipeline)


def compressed_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    compressor: Compressor | None = None,
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
