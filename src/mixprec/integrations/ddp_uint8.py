"""A torch DDP communication hook that all-reduces each gradient bucket with 8-bit compression.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = Uint8HookState(error_feedback=True)
    ddp.register_comm_hook(state, uint8_compress_hook)

The hook averages the bucket over the group (like DDP's default hook) with
:func:`mixprec.compress.compressed_all_reduce`. It runs the whole collective inside the hook and returns
an already completed future: simple and safe (every collective is issued from the backward thread, in
bucket order), at the price of not overlapping this bucket's communication with the rest of backward.
``Uint8HookState(wire="e4m3")`` sends fp8; ``wire="auto"`` picks full precision, uint8 or fp8 per bucket.
"""

# No ``from __future__ import annotations`` here: torch DDP's register_comm_hook checks the hook's
# annotations against the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate
from mixprec.comm.topology import check_topology
from mixprec.compress import auto
from mixprec.compress.collectives import compressed_all_reduce
from mixprec.compress.fp8 import Compressor
from mixprec.compress.options import RankCompressors, Uint8Options, check_feedback_entry, load_feedback
from mixprec.compress.state import CompressionStats, CompressionWorkspace, ErrorFeedback
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED
from mixprec.core.validate import check_group, check_positive_int

__all__ = ["Uint8HookState", "uint8_compress_hook"]


class Uint8HookState:
    """State of :func:`uint8_compress_hook`: its options, per-bucket error feedback, buffers, stats.

    Create it after ``torch.distributed.init_process_group`` (RuntimeError otherwise), like the DDP model.

    Args:
        process_group: the DDP process group; None = the default group.
        chunk_size, rounding, check_finite, topology: as for :class:`mixprec.compress.Uint8Reducer`
            (``check_finite="flag"`` by default: NaN/Inf reach the gradients, never a finite value).
        error_feedback: keep per-bucket residuals. DDP rebuilds its buckets after the first iteration;
            a bucket index whose size changed starts again from zero residuals.
        seed: stochastic rounding's generator is ``mixprec.comm.rank_generator(seed, bucket device)``: seeded
            with ``seed + global rank``, on the gradients' device, created at the first hook call; each
            reduction draws one 64-bit Philox key from it (``docs/compress.md``).
        wire, link_gbps: ``"uint8"``, ``"e4m3"``, ``"e5m2"`` or ``"auto"`` (see
            :class:`mixprec.compress.Uint8Options`); with ``"auto"`` the choice of each bucket index is
            made at its first call and kept (:attr:`choices`).

    Raises:
        RuntimeError: torch.distributed is not initialised (every rank would otherwise share one stream).
        TypeError, ValueError: a bad option (before any hook runs).
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        chunk_size: int = 2048,
        rounding: str = "nearest",
        error_feedback: bool = False,
        check_finite: str = "flag",
        topology: Any = None,
        seed: int = DEFAULT_STOCHASTIC_SEED,
        wire: str = "uint8",
        link_gbps: float | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Uint8HookState needs an initialised process group: call torch.distributed.init_process_group "
                "first (as for torch's DistributedDataParallel)"
            )
        self.process_group = check_group("process_group", process_group)
        self.options = Uint8Options(
            chunk_size=chunk_size,
            rounding=rounding,
            error_feedback=error_feedback,
            check_finite=check_finite,
            topology=topology,
            seed=seed,
            wire=wire,
            link_gbps=link_gbps,
        )
        if topology is not None:
            check_topology(topology, process_group)  # the hierarchical scheme needs the default group
        self.workspace = CompressionWorkspace()
        self._compressors = RankCompressors(self.options)
        self._feedback: dict[int, tuple[int, ErrorFeedback]] = {}  # bucket index -> (bucket numel, residuals)
        self.last_stats: dict[int, CompressionStats] = {}
        """Stats of the last reduction of each bucket index."""
        self.bytes_sent_total = 0
        self.choices: dict[int, auto.AutoChoice] = {}
        self._costs: auto.LinkCosts | None = None

    def compressor_for(self, device: torch.device, wire: str | None = None) -> Compressor:
        """The compressor for buckets on ``device``: the options' (or ``wire``'s) compressor, with stochastic
        rounding's rank-seeded generator on that device (created on first use)."""
        return self._compressors.for_device(device, wire)

    def wire_for(self, index: int, buffer: torch.Tensor) -> str:
        """Bucket ``index``'s wire: the options', or with ``"auto"`` the cost model's (chosen once, logged)."""
        if self.options.wire != "auto":
            return self.options.wire
        choice = self.choices.get(index)
        if choice is None or choice.numel != buffer.numel():  # DDP rebuilds its buckets after one iteration
            if self._costs is None:
                self._costs = auto.agree_costs(self.process_group, buffer.device, self.options.link_gbps)
            world = dist.get_world_size(self.process_group)
            choice = auto.choose(self._costs, buffer.numel(), buffer.element_size(), world, self.options.chunk_size)
            self.choices[index] = choice
            auto.logger.info(
                "bucket %d (%d x %s): %s; %s",
                index,
                buffer.numel(),
                buffer.dtype,
                choice.wire,
                choice.reason(self._costs.link_bytes_per_s),
            )
        return choice.wire

    def feedback_for(self, index: int, numel: int) -> ErrorFeedback | None:
        """The residuals of bucket ``index`` (None without error feedback); fresh ones when its size changed."""
        if not self.options.error_feedback:
            return None
        known = self._feedback.get(index)
        if known is None or known[0] != numel:
            known = self._feedback[index] = (numel, ErrorFeedback())
        return known[1]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: options that change results (rounding, chunk_size, check_finite, topology),
        per-bucket residuals (``{index: {"numel": n, "worker": ..., "server": ...}}``), the stochastic
        stream's state and device."""
        return {
            **self.options.saved(),
            "error_feedback": {i: {"numel": n, **fb.state_dict()} for i, (n, fb) in self._feedback.items()},
            **self._compressors.saved(),
        }

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
        loaded: dict[int, tuple[int, ErrorFeedback]] = {}
        for index, entry in feedback.items():
            entry = dict(check_feedback_entry("state['error_feedback']", index, entry))
            if "numel" not in entry:
                raise ValueError(f"state['error_feedback'][{index}] lacks 'numel' (the bucket's size)")
            numel = check_positive_int(f"state['error_feedback'][{index}]['numel']", entry.pop("numel"), minimum=0)
            loaded[index] = (numel, load_feedback(entry))
        generator = self._compressors.check_saved(state, "hook state")
        self._compressors.load(generator)
        self._feedback = loaded


def uint8_compress_hook(state: Uint8HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over ``state.process_group`` with uint8 min-max compression.

    Wire: uint8 codes + fp32 per-chunk headers (~1/4 of fp32's bytes); accumulation: fp32 in rank order;
    extra memory: the buffers in ``state.workspace`` (~3 bytes per bucket element) and, with error
    feedback, fp32 residuals per bucket. Returns a completed future holding the reduced bucket buffer.
    """
    if not isinstance(state, Uint8HookState):
        raise TypeError(f"state must be a Uint8HookState; got {type(state).__name__}")
    buffer = bucket.buffer()
    wire = state.wire_for(bucket.index(), buffer)
    future: torch.futures.Future = torch.futures.Future()
    if wire == "full":
        all_reduce_fp32_accumulate(buffer, state.process_group, average=True)
        future.set_result(buffer)
        return future
    stats = compressed_all_reduce(
        buffer,
        state.process_group,
        compressor=state.compressor_for(buffer.device, wire),
        average=True,
        topology=state.options.topology,
        error_feedback=state.feedback_for(bucket.index(), buffer.numel()),
        workspace=state.workspace,
    )
    state.last_stats[bucket.index()] = stats
    state.bytes_sent_total += stats.bytes_sent
    future.set_result(buffer)
    return future
