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
from torch.distributed import ProcessGroup

from mixprec._validate import check_bool, check_choice, check_positive_int
from mixprec.comm.fp32_accumulate import DEFAULT_STOCHASTIC_SEED
from mixprec.comm.random import rank_generator
from mixprec.compress.collectives import (
    CompressedReduction,
    CompressionStats,
    CompressionWorkspace,
    ErrorFeedback,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.quantize import MinMaxUInt8
from mixprec.compress.topology import Topology, check_topology
from mixprec.parallel.reducers import _check_bucket, _check_shard_out, register_reducer

__all__ = ["Uint8Reducer"]


def topology_key(topology: Any) -> list[int] | None:
    """What of a topology changes results and residual sizes: None (flat) or [nodes, ranks_per_node]."""
    if topology is None:
        return None
    if isinstance(topology, Topology):
        return [topology.nodes, topology.ranks_per_node]
    return [int(n) for n in topology.mesh.shape]  # a DeviceMesh, validated by check_topology


def check_generator_state(state: Any) -> torch.Tensor:
    """A saved ``torch.Generator.get_state()``: a 1-D uint8 tensor (TypeError otherwise)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        got = (
            f"{state.dtype} tensor of shape {tuple(state.shape)}"
            if isinstance(state, torch.Tensor)
            else type(state).__name__
        )
        raise TypeError(f"generator_state must be a 1-D uint8 tensor (torch.Generator.get_state()); got {got}")
    return state


def apply_generator_state(generator: torch.Generator, state: torch.Tensor, saved_device: Any) -> None:
    """``generator.set_state(state)``, refusing a state saved from a generator on another device type."""
    if saved_device is not None and torch.device(saved_device).type != generator.device.type:
        raise ValueError(
            f"generator_state was saved from a generator on {saved_device}; this run draws on {generator.device}"
        )
    generator.set_state(state)


class Uint8Reducer:
    """GradReducer with 8-bit min-max compression on the wire and fp32 sums (see mixprec.compress).

    Args:
        chunk_size: elements per (min, max) header pair, int >= 1.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; the stream is
            ``mixprec.comm.rank_generator(seed, bucket.device)``: seeded with ``seed + global rank``, on the
            bucket's device, created at the first reduction, when the process group is initialised).
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
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.check_finite = check_choice("check_finite", check_finite, ("raise", "flag"))
        # Validated here, not first inside a backward hook (sizes against the group once it is initialised).
        self.topology = None if topology is None else check_topology(topology)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        self.seed = seed
        self.max_in_flight = check_positive_int("max_in_flight", max_in_flight)
        self._compressors: dict[torch.device, MinMaxUInt8] = {}  # one per device (its generator lives there)
        self._generator: torch.Generator | None = None  # the stream last drawn from
        self._generator_state: tuple[torch.Tensor, Any] | None = None  # (state, device) loaded before first use
        self._feedback: dict[int, ErrorFeedback] = {}
        self._shared = CompressionWorkspace()
        self._free: list[CompressionWorkspace] = []
        self._pending: deque[_PendingBucket] = deque()
        self.last_stats: dict[int, CompressionStats] = {}
        """The stats of the last finished reduction of each bucket (key)."""
        self.bytes_sent_total = 0
        """Bytes this rank sent in all finished reductions."""

    # ------------------------------------------------------------------ helpers
    def _comp(self, device: torch.device) -> MinMaxUInt8:
        comp = self._compressors.get(device)
        if comp is None:
            generator = None
            if self.rounding == "stochastic":
                generator = rank_generator(self.seed, device)
                if self._generator_state is not None:  # a state loaded before the first reduction
                    apply_generator_state(generator, *self._generator_state)
                    self._generator_state = None
            comp = self._compressors[device] = MinMaxUInt8(
                chunk_size=self.chunk_size, rounding=self.rounding, generator=generator, check_finite=self.check_finite
            )
        self._generator = comp.generator
        return comp

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
            compressor=self._comp(bucket.device),
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
            compressor=self._comp(bucket.device),
            average=average,
            topology=self.topology,
            error_feedback=feedback,
            workspace=workspace,
            shared_workspace=self._shared,
        )
        return self._track(reduction, workspace, key)

    def state_dict(self) -> dict[str, Any]:
        """Options that change results (rounding, chunk_size, check_finite, topology as [nodes, ranks_per_node]
        or None), per-bucket error-feedback residuals, the stochastic stream's state and device. Per rank."""
        state: dict[str, Any] = {
            "rounding": self.rounding,
            "chunk_size": self.chunk_size,
            "check_finite": self.check_finite,
            "topology": topology_key(self.topology),
            "error_feedback": {key: fb.state_dict() for key, fb in self._feedback.items()},
        }
        if self._generator is not None:
            state["generator_state"] = self._generator.get_state()
            state["generator_device"] = str(self._generator.device)
        elif self._generator_state is not None:
            state["generator_state"] = self._generator_state[0].clone()
            if self._generator_state[1] is not None:
                state["generator_device"] = str(self._generator_state[1])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of this rank. Everything is checked before anything changes.

        Raises:
            TypeError: ``state`` or one of its entries has the wrong type.
            ValueError: it was saved with other options (rounding, chunk_size, check_finite, topology), holds
                residuals while this reducer has ``error_feedback=False``, or a generator state from another
                device type.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        mine = {
            "rounding": self.rounding,
            "chunk_size": self.chunk_size,
            "check_finite": self.check_finite,
            "topology": topology_key(self.topology),
        }
        for name, value in mine.items():
            if name in state and state[name] != value:
                raise ValueError(f"state was saved with {name}={state[name]!r}; this reducer uses {value!r}")
        feedback = state.get("error_feedback", {})
        if not isinstance(feedback, dict):
            raise TypeError(f"state['error_feedback'] must be a dict; got {type(feedback).__name__}")
        if feedback and not self.error_feedback:
            raise ValueError("state holds error-feedback residuals but this reducer has error_feedback=False")
        loaded: dict[int, ErrorFeedback] = {}
        for key, fb_state in feedback.items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise TypeError(f"state['error_feedback'] keys must be bucket keys, ints >= 0; got {key!r}")
            loaded[key] = ErrorFeedback()
            loaded[key].load_state_dict(fb_state)
        gen_state = state.get("generator_state")
        saved_device = state.get("generator_device")
        if gen_state is not None:
            check_generator_state(gen_state)
            if saved_device is not None and not isinstance(saved_device, str):
                raise TypeError(f"state['generator_device'] must be a str; got {type(saved_device).__name__}")
            if self.rounding != "stochastic":
                raise ValueError("state holds a generator state but this reducer rounds to nearest")
            if self._generator is not None:
                apply_generator_state(self._generator, gen_state, saved_device)
            else:
                if saved_device is not None:
                    torch.device(saved_device)  # a malformed device string fails here, not at first use
                self._generator_state = (gen_state.clone(), saved_device)
        self._feedback = loaded

    def __repr__(self) -> str:
        kind = "flat" if self.topology is None else f"hierarchical {self.topology!r}"
        return (
            f"Uint8Reducer({kind}, chunk_size={self.chunk_size}, rounding={self.rounding!r}, "
            f"error_feedback={self.error_feedback}, check_finite={self.check_finite!r})"
        )


class _PendingBucket:
    """A started bucket reduction holding one of the reducer's in-flight workspaces until it finishes."""

    def __init__(
        self, reduction: CompressedReduction, workspace: CompressionWorkspace, key: int, owner: Uint8Reducer
    ) -> None:
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
