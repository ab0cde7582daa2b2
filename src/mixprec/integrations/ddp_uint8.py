"""A torch DDP communication hook that all-reduces each gradient bucket on a compressed wire.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = CompressedHookState(error_feedback=True)
    ddp.register_comm_hook(state, compressed_hook)

The hook averages the bucket over the group (like DDP's default hook) with the state's
:class:`mixprec.compress.CompressedReducer`: the same reduction, wire and bits as mixprec's own
``DistributedDataParallel(reduce=...)`` on the same bucket. It runs the whole collective inside the hook and
returns an already completed future: simple and safe (every collective is issued from the backward thread, in
bucket order), at the price of not overlapping this bucket's communication with the rest of backward.
``wire=`` picks what is sent: ``"uint8"`` (default), fp8 ``"e4m3"`` / ``"e5m2"``, block-scaled ``"mxfp8_e4m3"``,
``"nvfp4"`` ..., or ``"auto"`` (full precision, uint8 or fp8 per bucket). ``audit_every=N`` runs the live
numerics audit (:mod:`mixprec.comm.live_audit`). Formerly ``Uint8HookState`` / ``uint8_compress_hook``
(deprecated aliases in :mod:`mixprec.hooks`).
"""

# No ``from __future__ import annotations`` here: torch DDP's register_comm_hook checks the hook's
# annotations against the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.live_audit import AuditResult
from mixprec.comm.topology import check_topology
from mixprec.compress import auto
from mixprec.compress.fp8 import Compressor
from mixprec.compress.options import DEFAULT_CHUNK_SIZE, CompressionOptions, check_feedback_entry
from mixprec.compress.reducers import CompressedReducer
from mixprec.compress.state import CompressionStats, ErrorFeedback
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED
from mixprec.core.validate import check_group, check_positive_int
from mixprec.integrations.hook_audit import AuditedHookState

__all__ = ["CompressedHookState", "compressed_hook"]


class CompressedHookState(AuditedHookState):
    """State of :func:`compressed_hook`: a :class:`mixprec.compress.CompressedReducer` (options, per-bucket error
    feedback, streams, buffers, stats), the size of each torch DDP bucket it has seen and the live audit.

    Create it after ``torch.distributed.init_process_group`` (RuntimeError otherwise), like the DDP model.

    Args:
        process_group: the DDP process group; None = the default group.
        chunk_size, rounding, check_finite, topology: as for :class:`mixprec.compress.CompressedReducer`
            (``check_finite="flag"`` by default: NaN/Inf reach the gradients, never a finite value).
        error_feedback: keep per-bucket residuals. DDP rebuilds its buckets after the first iteration;
            a bucket index whose size changed starts again from zero residuals.
        seed: stochastic rounding's generator is ``mixprec.comm.rank_generator(seed, bucket device)``: seeded
            with ``seed + global rank``, on the gradients' device, created at the first hook call; each
            reduction draws one 64-bit Philox key from it (``docs/compress.md``).
        wire, link_gbps: any wire of :class:`mixprec.compress.CompressionOptions`: ``"uint8"``, ``"e4m3"``,
            ``"e5m2"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4_e2m1"``, ``"nvfp4"`` (block-scaled:
            ``chunk_size`` a multiple of the block) or ``"auto"``; with ``"auto"`` the choice of each bucket
            index is made at its first call and kept (:attr:`choices`).
        audit_every: None, or an int N >= 1: at synced steps N, 2N, ... one bucket (index ``(step // N - 1) mod
            buckets``) is also reduced exactly (a sample of at most 65536 elements of it) and the error of the
            compressed reduction and of the backend's own all-reduce recorded (:attr:`audit_results`,
            :attr:`audit_rows`). Its collectives run on the same group, before the bucket's own; the
            reduction itself is unchanged, bit for bit.
        on_audit: called with each :class:`mixprec.comm.live_audit.AuditResult` as it is recorded, on every
            rank, from inside backward (e.g. ``lambda r: logger.log(r.as_row())`` on rank 0).

    Raises:
        RuntimeError: torch.distributed is not initialised (every rank would otherwise share one stream).
        TypeError, ValueError: a bad option (before any hook runs).
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        rounding: str = "nearest",
        error_feedback: bool = False,
        check_finite: str = "flag",
        topology: Any = None,
        seed: int = DEFAULT_STOCHASTIC_SEED,
        wire: str = "uint8",
        link_gbps: float | None = None,
        audit_every: int | None = None,
        on_audit: Callable[[AuditResult], None] | None = None,
    ) -> None:
        self._init_audit(audit_every, on_audit)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "CompressedHookState needs an initialised process group: call torch.distributed.init_process_group "
                "first (as for torch's DistributedDataParallel)"
            )
        self.process_group = check_group("process_group", process_group)
        self.reducer = CompressedReducer(
            chunk_size=chunk_size,
            rounding=rounding,
            error_feedback=error_feedback,
            check_finite=check_finite,
            topology=topology,
            seed=seed,
            wire=wire,
            link_gbps=link_gbps,
            max_in_flight=1,  # the hook finishes each bucket before it returns
        )
        """The reducer the hook runs: every bucket is its ``all_reduce_any_length`` with key = bucket index."""
        if topology is not None:
            check_topology(topology, process_group)  # the hierarchical scheme needs the default group
        self._numels: dict[int, int] = {}  # bucket index -> its size when last reduced

    @property
    def options(self) -> CompressionOptions:
        return self.reducer.options

    @property
    def last_stats(self) -> dict[int, CompressionStats]:
        """Stats of the last reduction of each bucket index."""
        return self.reducer.last_stats

    @property
    def bytes_sent_total(self) -> int:
        return self.reducer.bytes_sent_total

    @property
    def choices(self) -> dict[int, auto.AutoChoice]:
        return self.reducer.choices

    def compressor_for(self, device: torch.device, wire: str | None = None) -> Compressor:
        """The compressor for buckets on ``device``: the options' (or ``wire``'s) compressor, with stochastic
        rounding's rank-seeded generator on that device (created on first use)."""
        return self.reducer.compressor_for(device, wire)

    def _seen(self, index: int, numel: int) -> None:
        """DDP rebuilds its buckets after one iteration: an index whose size changed starts afresh."""
        if self._numels.get(index, numel) != numel:
            self.reducer.forget(index)
        self._numels[index] = numel

    def wire_for(self, index: int, buffer: torch.Tensor) -> str:
        """Bucket ``index``'s wire: the options', or with ``"auto"`` the cost model's (chosen once, logged)."""
        self._seen(index, buffer.numel())
        return self.reducer.wire_for(index, buffer, self.process_group)

    def feedback_for(self, index: int, numel: int) -> ErrorFeedback | None:
        """The residuals of bucket ``index`` (None without error feedback); fresh ones when its size changed."""
        self._seen(index, numel)
        return self.reducer.feedback_for(index)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: options that change results (rounding, chunk_size, check_finite, topology),
        per-bucket residuals (``{index: {"numel": n, "worker": ..., "server": ...}}``), the stochastic
        stream's state and device."""
        state = self.reducer.state_dict()
        state["error_feedback"] = {i: {"numel": self._numels[i], **fb} for i, fb in state["error_feedback"].items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of this rank; everything is checked before anything changes.

        Raises:
            TypeError: ``state`` or an entry of it has the wrong type.
            ValueError: saved with other options, residuals without ``error_feedback``, a bucket entry
                without ``numel``, or a generator state saved on another device type.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        self.options.check_saved(state, "hook state")
        feedback = state.get("error_feedback", {})
        if not isinstance(feedback, dict):
            raise TypeError(f"state['error_feedback'] must be a dict; got {type(feedback).__name__}")
        if feedback and not self.options.error_feedback:
            raise ValueError("state holds error-feedback residuals but this hook state has error_feedback=False")
        numels: dict[int, int] = {}
        residuals: dict[int, dict[str, Any]] = {}
        for index, entry in feedback.items():
            entry = dict(check_feedback_entry("state['error_feedback']", index, entry))
            if "numel" not in entry:
                raise ValueError(f"state['error_feedback'][{index}] lacks 'numel' (the bucket's size)")
            numels[index] = check_positive_int(
                f"state['error_feedback'][{index}]['numel']", entry.pop("numel"), minimum=0
            )
            residuals[index] = entry
        self.reducer.load_state_dict({**state, "error_feedback": residuals}, owner="hook state")
        self._numels = numels


def compressed_hook(state: CompressedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over ``state.process_group`` on the state's compressed wire.

    A thin adapter: ``state.reducer.all_reduce_any_length(buffer, group, average=True, key=bucket.index())``
    (:class:`mixprec.compress.CompressedReducer`, so the same bits as mixprec's wrapper on the same bucket).
    Wire: the state's (uint8 codes + fp32 per-chunk headers, ~1/4 of fp32's bytes, by default); accumulation:
    fp32 in rank order; extra memory: the reducer's buffers (a few bytes per bucket element) and, with error
    feedback, fp32 residuals per bucket. Returns a completed future holding the reduced bucket buffer. With
    ``audit_every``, the audited bucket's collectives run first, on the same group (module
    :mod:`mixprec.comm.live_audit`).
    """
    if not isinstance(state, CompressedHookState):
        raise TypeError(f"state must be a CompressedHookState; got {type(state).__name__}")
    buffer = bucket.buffer()
    index = bucket.index()
    state._seen(index, buffer.numel())
    audit = state._begin_audit(buffer, index, is_last=bucket.is_last(), group=state.process_group, native=True)
    state.reducer.all_reduce_any_length(buffer, state.process_group, average=True, key=index)
    if audit is not None:
        audit.finish(buffer)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
