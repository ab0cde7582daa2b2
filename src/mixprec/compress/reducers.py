"""The ``"uint8"`` and ``"uint8_hierarchical"`` gradient reducers for mixprec's DistributedDataParallel.

Registered with :func:`mixprec.parallel.register_reducer` when :mod:`mixprec.compress` is imported (which
``make_reducer`` does on first use of a ``uint8`` name)::

    ddp = DistributedDataParallel(model, reduce="uint8", reduce_options={"error_feedback": True})
    ddp = DistributedDataParallel(model, reduce="uint8_hierarchical")   # topology from LOCAL_WORLD_SIZE

Each bucket goes through :func:`mixprec.compress.start_compressed_all_reduce` (or the reduce-scatter with
``sharded_optimizer=True``): the quantization and the all-to-all start when the bucket is launched, the
fp32 sum, re-quantization and all-gather run in the handle's ``wait()``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mixprec._validate import check_choice, check_positive_int
from mixprec.comm.fp32_accumulate import DEFAULT_STOCHASTIC_SEED
from mixprec.compress.collectives import (
    CompressedReduction,
    CompressionStats,
    CompressionWorkspace,
    ErrorFeedback,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.quantize import MinMaxUInt8
from mixprec.compress.topology import Topology
from mixprec.parallel.reducers import _check_bucket, _check_shard_out, register_reducer

__all__ = ["Uint8Reducer"]


def rank_seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed + global rank``: every rank rounds with its own stream."""
    generator = torch.Generator()
    generator.manual_seed(seed + (dist.get_rank() if dist.is_initialized() else 0))
    return generator


class Uint8Reducer:
    """GradReducer with 8-bit min-max compression on the wire and fp32 sums (see mixprec.compress).

    Args:
        chunk_size: elements per (min, max) header pair, int >= 1.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; stream seeded with ``seed + global rank``).
        error_feedback: keep per-bucket residuals (worker and server side) and add them back next step.
        check_finite: ``"flag"`` (default: non-finite chunks reduce to NaN on every rank, for the loss
            scaler's agreed overflow check; :attr:`last_stats` says so) or ``"raise"`` (every rank raises
            :class:`mixprec.compress.NonFiniteError` from ``wait()``).
        topology: None for the flat scheme, or a :class:`Topology` / 2-D DeviceMesh ("node", "local") for
            the hierarchical one (the group must then be the default group).
        seed: base seed of the stochastic-rounding stream.
        max_in_flight: reductions whose buffers are kept while pending, int >= 1; starting one more first
            finishes the oldest (blocking), so the extra memory stays bounded.

    Extra memory per pending bucket of N elements: ~2N bytes of uint8 buffers (flat), plus N elements of
    the bucket dtype in hierarchical mode; shared across buckets: ~N bytes of uint8 and 4N/W of fp32;
    with error feedback, 4N bytes (worker) + 4N/W (server) of fp32 residuals per bucket, kept.
    """

    def __init__(
        self,
        *,
        chunk_size: int = 2048,
        rounding: str = "nearest",
        error_feedback: bool = False,
        check_finite: str = "flag",
        topology: Any = None,
        seed: int = DEFAULT_STOCHASTIC_SEED,
        max_in_flight: int = 2,
    ) -> None:
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.rounding = check_choice("rounding", rounding, ("nearest", "stochastic"))
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool; got {type(error_feedback).__name__}")
        self.error_feedback = error_feedback
        self.check_finite = check_choice("check_finite", check_finite, ("raise", "flag"))
        self.topology = topology
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        self.seed = seed
        self.max_in_flight = check_positive_int("max_in_flight", max_in_flight)
        self._compressor: MinMaxUInt8 | None = None
        self._generator_state: torch.Tensor | None = None
        self._feedback: dict[int, ErrorFeedback] = {}
        self._shared = CompressionWorkspace()
        self._free: list[CompressionWorkspace] = []
        self._pending: deque[_PendingBucket] = deque()
        self.last_stats: dict[int, CompressionStats] = {}
        """The stats of the last finished reduction of each bucket (key)."""
        self.bytes_sent_total = 0
        """Bytes this rank sent in all finished reductions."""

    # ------------------------------------------------------------------ helpers
    def _comp(self) -> MinMaxUInt8:
        if self._compressor is None:
            generator = None
            if self.rounding == "stochastic":
                generator = rank_seeded_generator(self.seed)
                if self._generator_state is not None:
                    generator.set_state(self._generator_state)
                    self._generator_state = None
            self._compressor = MinMaxUInt8(
                chunk_size=self.chunk_size, rounding=self.rounding, generator=generator, check_finite=self.check_finite
            )
        return self._compressor

    def _take_workspace(self) -> CompressionWorkspace:
        while len(self._pending) >= self.max_in_flight:
            self._pending[0].wait()
        return self._free.pop() if self._free else CompressionWorkspace()

    def _feedback_for(self, key: int) -> ErrorFeedback | None:
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"key must be an int >= 0; got {key!r}")
        if not self.error_feedback:
            return None
        return self._feedback.setdefault(key, ErrorFeedback())

    def _track(self, reduction: CompressedReduction, workspace: CompressionWorkspace, key: int) -> _PendingBucket:
        handle = _PendingBucket(reduction, workspace, key, self)
        self._pending.append(handle)
        return handle

    def _finished(self, handle: _PendingBucket, stats: CompressionStats | None) -> None:
        self._pending.remove(handle)
        self._free.append(handle.workspace)
        if stats is not None:
            self.last_stats[handle.key] = stats
            self.bytes_sent_total += stats.bytes_sent

    # ------------------------------------------------------------------ reducer interface
    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> _PendingBucket:
        _check_bucket(bucket, group)
        feedback = self._feedback_for(key)
        workspace = self._take_workspace()
        reduction = start_compressed_all_reduce(
            bucket,
            group,
            compressor=self._comp(),
            average=average,
            topology=self.topology,
            error_feedback=feedback,
            workspace=workspace,
            shared_workspace=self._shared,
        )
        return self._track(reduction, workspace, key)

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> _PendingBucket:
        world_size = _check_bucket(bucket, group)
        _check_shard_out(shard_out, bucket, world_size)
        feedback = self._feedback_for(key)
        workspace = self._take_workspace()
        reduction = start_compressed_reduce_scatter(
            shard_out,
            bucket,
            group,
            compressor=self._comp(),
            average=average,
            topology=self.topology,
            error_feedback=feedback,
            workspace=workspace,
            shared_workspace=self._shared,
        )
        return self._track(reduction, workspace, key)

    def state_dict(self) -> dict[str, Any]:
        """Options that change results, per-bucket error-feedback residuals, the stochastic stream's state."""
        state: dict[str, Any] = {
            "rounding": self.rounding,
            "chunk_size": self.chunk_size,
            "error_feedback": {key: fb.state_dict() for key, fb in self._feedback.items()},
        }
        generator = self._compressor.generator if self._compressor is not None else None
        gen_state = generator.get_state() if generator is not None else self._generator_state
        if gen_state is not None:
            state["generator_state"] = gen_state.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        for name in ("rounding", "chunk_size"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"state was saved with {name}={state[name]!r}; this reducer uses {getattr(self, name)!r}"
                )
        feedback = state.get("error_feedback", {})
        if feedback and not self.error_feedback:
            raise ValueError("state holds error-feedback residuals but this reducer has error_feedback=False")
        loaded: dict[int, ErrorFeedback] = {}
        for key, fb_state in feedback.items():
            loaded[int(key)] = ErrorFeedback()
            loaded[int(key)].load_state_dict(fb_state)
        self._feedback = loaded
        gen_state = state.get("generator_state")
        if gen_state is not None:
            if self._compressor is not None and self._compressor.generator is not None:
                self._compressor.generator.set_state(gen_state)
            else:
                self._generator_state = gen_state.clone()

    def __repr__(self) -> str:
        kind = "flat" if self.topology is None else f"hierarchical {self.topology!r}"
        return (
            f"Uint8Reducer({kind}, chunk_size={self.chunk_size}, rounding={self.rounding!r}, "
            f"error_feedback={self.error_feedback}, check_finite={self.check_finite!r})"
        )


class _PendingBucket:
    """A started bucket reduction holding one of the reducer's in-flight workspaces until it finishes."""

    def __init__(self, reduction: CompressedReduction, workspace: CompressionWorkspace, key: int, owner: Uint8Reducer):
        self._reduction: CompressedReduction | None = reduction
        self.workspace = workspace
        self.key = key
        self._owner = owner

    def wait(self) -> None:
        reduction, self._reduction = self._reduction, None
        if reduction is None:
            return
        stats = None
        try:
            stats = reduction.wait()
        finally:
            self._owner._finished(self, stats)


def make_flat_uint8_reducer(**options: Any) -> Uint8Reducer:
    """Factory of ``"uint8"``: the flat scheme (``topology`` is refused: use ``"uint8_hierarchical"``)."""
    if options.get("topology") is not None:
        raise ValueError("reducer 'uint8' is flat; for a topology use reduce='uint8_hierarchical'")
    return Uint8Reducer(**options)


def make_hierarchical_uint8_reducer(**options: Any) -> Uint8Reducer:
    """Factory of ``"uint8_hierarchical"``: ``topology`` from the options, else from ``LOCAL_WORLD_SIZE``."""
    if options.get("topology") is None:
        options["topology"] = Topology.from_env()
    return Uint8Reducer(**options)


register_reducer("uint8", make_flat_uint8_reducer)
register_reducer("uint8_hierarchical", make_hierarchical_uint8_reducer)
