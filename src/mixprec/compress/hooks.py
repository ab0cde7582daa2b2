"""A torch DDP communication hook that all-reduces each gradient bucket with uint8 compression.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = Uint8HookState(error_feedback=True)
    ddp.register_comm_hook(state, uint8_compress_hook)

The hook averages the bucket over the group (like DDP's default hook) with
:func:`mixprec.compress.compressed_all_reduce`. It runs the whole collective inside the hook and returns
an already completed future: simple and safe (every collective is issued from the backward thread, in
bucket order), at the price of not overlapping this bucket's communication with the rest of backward.
"""

# No ``from __future__ import annotations`` here: torch DDP's register_comm_hook checks the hook's
# annotations against the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.fp32_accumulate import DEFAULT_STOCHASTIC_SEED
from mixprec.compress.collectives import CompressionStats, CompressionWorkspace, ErrorFeedback, compressed_all_reduce
from mixprec.compress.quantize import MinMaxUInt8
from mixprec.compress.reducers import rank_seeded_generator

__all__ = ["Uint8HookState", "uint8_compress_hook"]


class Uint8HookState:
    """State of :func:`uint8_compress_hook`: the compressor, per-bucket error feedback, buffers, stats.

    Args:
        process_group: the DDP process group; None = the default group.
        chunk_size, rounding, check_finite, topology: as for :class:`mixprec.compress.Uint8Reducer`
            (``check_finite="flag"`` by default: NaN/Inf reach the gradients, never a finite value).
        error_feedback: keep per-bucket residuals. DDP rebuilds its buckets after the first iteration;
            a bucket index whose size changed starts again from zero residuals.
        seed: stochastic rounding's stream is seeded with ``seed + global rank``.
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
    ) -> None:
        self.process_group = process_group
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool; got {type(error_feedback).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        generator = rank_seeded_generator(seed) if rounding == "stochastic" else None
        # validates chunk_size, rounding and check_finite
        self.compressor = MinMaxUInt8(
            chunk_size=chunk_size, rounding=rounding, generator=generator, check_finite=check_finite
        )
        self.error_feedback = error_feedback
        self.topology = topology
        self.workspace = CompressionWorkspace()
        self._feedback: dict[int, tuple[int, ErrorFeedback]] = {}  # bucket index -> (bucket numel, residuals)
        self.last_stats: dict[int, CompressionStats] = {}
        """Stats of the last reduction of each bucket index."""
        self.bytes_sent_total = 0

    def feedback_for(self, index: int, numel: int) -> ErrorFeedback | None:
        if not self.error_feedback:
            return None
        known = self._feedback.get(index)
        if known is None or known[0] != numel:
            known = self._feedback[index] = (numel, ErrorFeedback())
        return known[1]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "error_feedback": {i: {"numel": n, **fb.state_dict()} for i, (n, fb) in self._feedback.items()}
        }
        if self.compressor.generator is not None:
            state["generator_state"] = self.compressor.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        loaded: dict[int, tuple[int, ErrorFeedback]] = {}
        for index, entry in state.get("error_feedback", {}).items():
            entry = dict(entry)
            numel = entry.pop("numel")
            fb = ErrorFeedback()
            fb.load_state_dict(entry)
            loaded[int(index)] = (int(numel), fb)
        self._feedback = loaded
        if "generator_state" in state and self.compressor.generator is not None:
            self.compressor.generator.set_state(state["generator_state"])


def uint8_compress_hook(state: Uint8HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over ``state.process_group`` with uint8 min-max compression.

    Wire: uint8 codes + fp32 per-chunk headers (~1/4 of fp32's bytes); accumulation: fp32 in rank order;
    extra memory: the buffers in ``state.workspace`` (~3 bytes per bucket element) and, with error
    feedback, fp32 residuals per bucket. Returns a completed future holding the reduced bucket buffer.
    """
    if not isinstance(state, Uint8HookState):
        raise TypeError(f"state must be a Uint8HookState; got {type(state).__name__}")
    buffer = bucket.buffer()
    stats = compressed_all_reduce(
        buffer,
        state.process_group,
        compressor=state.compressor,
        average=True,
        topology=state.topology,
        error_feedback=state.feedback_for(bucket.index(), buffer.numel()),
        workspace=state.workspace,
    )
    state.last_stats[bucket.index()] = stats
    state.bytes_sent_total += stats.bytes_sent
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
