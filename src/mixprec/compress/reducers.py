"""The compressed gradient reducers for mixprec's DistributedDataParallel.

Registered with :func:`mixprec.comm.register_reducer` when :mod:`mixprec.compress` is imported (importing
``mixprec`` does): ``"uint8"``, ``"fp8"`` (``wire="e4m3"`` or ``"e5m2"``), ``"mxfp8"`` (``wire="mxfp8_e4m3"``
or ``"mxfp8_e5m2"``), ``"nvfp4"`` (block-scaled: :mod:`mixprec.compress.blockscaled`), their ``"_hierarchical"``
twins, and ``"auto"`` (full precision, uint8 or fp8 per bucket: :mod:`mixprec.compress.auto`)::

    ddp = DistributedDataParallel(model, reduce="uint8", reduce_options={"error_feedback": True})
    ddp = DistributedDataParallel(model, reduce="uint8_hierarchical")   # topology from LOCAL_WORLD_SIZE
    ddp = DistributedDataParallel(model, reduce="auto", reduce_options={"link_gbps": 1.0})

Each bucket goes through :func:`mixprec.compress.start_compressed_all_reduce` (or the reduce-scatter with
``sharded_optimizer=True``): the quantization and the all-to-all start when the bucket is launched, the
fp32 sum, re-quantization and all-gather run in the handle's ``wait()``. ``model`` replays the same
pipelines for P ranks in one process (:mod:`mixprec.compress.models`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.comm.handles import PendingReduction
from mixprec.comm.models import GroupState, fp32_accumulate_rows, same_on_every_rank, topology_shape
from mixprec.comm.reducer import check_bucket, check_model_rows, check_shard_out, register_reducer
from mixprec.comm.topology import Topology, local_world_size_from_env
from mixprec.compress import auto
from mixprec.compress.collectives import start_compressed_all_reduce, start_compressed_reduce_scatter
from mixprec.compress.models import compressed_all_reduce_rows, feedback_shapes
from mixprec.compress.options import (
    DEFAULT_CHUNK_SIZE,
    CompressionOptions,
    RankCompressors,
    build_compressor,
    check_feedback_entry,
    load_feedback,
)
from mixprec.compress.quantize import NonFiniteError
from mixprec.compress.state import CompressionStats, CompressionWorkspace, ErrorFeedback
from mixprec.core.philox import draw_key
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED
from mixprec.core.validate import check_positive_int

__all__ = ["CompressedReducer"]


class CompressedReducer:
    """GradReducer with a compressed wire (uint8, fp8, MX / NVFP4, or chosen per bucket) and fp32 sums.

    One class for every compressed reducer of the registry (``"uint8"``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``,
    their ``"_hierarchical"`` forms, ``"auto"``): the wire is an option, not the class (formerly
    ``Uint8Reducer``, still importable from :mod:`mixprec.compress` with a DeprecationWarning).

    Args:
        chunk_size, rounding, error_feedback, check_finite, topology, seed, wire, link_gbps: see
            :class:`mixprec.compress.CompressionOptions` (validated there; kept as :attr:`options`). With
            ``check_finite="flag"`` (default) :attr:`last_stats` reports non-finite buckets; ``"raise"``
            raises :class:`mixprec.compress.NonFiniteError` from ``wait()`` on every rank.
        max_in_flight: reductions whose buffers are kept while pending, int >= 1; starting one more first
            finishes the oldest (blocking), so the extra memory stays bounded.

    Extra memory per pending bucket of N elements: ~2N bytes of uint8 buffers (flat), plus N elements of
    the bucket dtype in hierarchical mode; shared across buckets: ~N bytes of uint8 and 4N/W of fp32;
    with error feedback, 4N bytes (worker) + 4N/W (server) of fp32 residuals per bucket, kept.
    """

    def __init__(
        self,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        rounding: str = "nearest",
        error_feedback: bool = False,
        check_finite: str = "flag",
        topology: Any = None,
        seed: int = DEFAULT_STOCHASTIC_SEED,
        max_in_flight: int = 2,
        wire: str = "uint8",
        link_gbps: float | None = None,
    ) -> None:
        # Validated here, not first inside a backward hook (topology sizes too, once the group is initialised).
        self.options = CompressionOptions(
            chunk_size=chunk_size,
            rounding=rounding,
            error_feedback=error_feedback,
            check_finite=check_finite,
            topology=topology,
            seed=seed,
            wire=wire,
            link_gbps=link_gbps,
        )
        self.max_in_flight = check_positive_int("max_in_flight", max_in_flight)
        self._compressors = RankCompressors(self.options)
        self._feedback: dict[int, ErrorFeedback] = {}
        self._shared = CompressionWorkspace()
        self._free: list[CompressionWorkspace] = []
        self._pending: deque[_PendingBucket] = deque()
        self.last_stats: dict[int, CompressionStats] = {}
        """The stats of the last finished reduction of each bucket (key)."""
        self.bytes_sent_total = 0
        """Bytes this rank sent in all finished reductions."""
        self.choices: dict[int, auto.AutoChoice] = {}
        """``wire="auto"``: each bucket's choice (made at its first reduction, then kept)."""
        self._costs: auto.LinkCosts | None = None
        self.model_state = GroupState()
        """The simulated ranks' state while :meth:`model` stands for a group: their random streams and, per
        bucket key, their error-feedback residuals (``worker`` [P, sent elements], ``server`` [n])."""
        self._model_choices: dict[int, auto.AutoChoice] = {}
        self._nodes_from_world = False  # LOCAL_WORLD_SIZE read before the group size was known

    def _settle_topology(self, world: int) -> None:
        if self._nodes_from_world:
            self.options = dataclasses.replace(self.options, topology=Topology.from_env(world))
            self._compressors.options = self.options
            self._nodes_from_world = False

    @property
    def link_costs(self) -> auto.LinkCosts | None:
        """``wire="auto"``: the agreed link rate and quantizing costs (None before the first reduction)."""
        return self._costs

    # ------------------------------------------------------------------ for adapters (the torch DDP hook)
    def compressor_for(self, device: torch.device, wire: str | None = None) -> Any:
        """The compressor for buckets on ``device``: the options' (or ``wire``'s), with stochastic rounding's
        rank-seeded generator on that device (created on first use)."""
        return self._compressors.for_device(device, wire)

    def wire_for(self, key: int, bucket: torch.Tensor, group: ProcessGroup | None) -> str:
        """Bucket ``key``'s wire: the options', or with ``"auto"`` the cost model's (chosen once, logged)."""
        return self._wire_for(key, bucket, group)

    def feedback_for(self, key: int) -> ErrorFeedback | None:
        """Bucket ``key``'s residuals (None without error feedback), created on first use."""
        return self._feedback_for(key)

    def forget(self, key: int) -> None:
        """Drop bucket ``key``'s residuals and ``"auto"`` choice: the bucket behind the key has changed (torch DDP
        rebuilds its buckets after the first iteration); the next reduction starts it afresh."""
        self._feedback.pop(key, None)
        self.choices.pop(key, None)

    def all_reduce_any_length(
        self, tensor: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> None:
        """Blocking :meth:`all_reduce` of a 1-D contiguous tensor of any length (an adapter's bucket, e.g. torch
        DDP's): the collective zero-pads it to a multiple of the group size itself, as
        :func:`mixprec.compress.compressed_all_reduce` does. Same wire choice, residuals, streams and stats."""
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"tensor must be 1-D and contiguous; got shape {tuple(tensor.shape)}")
        if self._wire_for(key, tensor, group) == "full":
            self._start_full(
                key, lambda: all_reduce_fp32_accumulate(tensor, group, average=average, async_op=True)
            ).wait()
            return
        self._start(key, tensor, group, average, lambda **kw: start_compressed_all_reduce(tensor, group, **kw)).wait()

    # ------------------------------------------------------------------ helpers
    def _take_workspace(self) -> CompressionWorkspace:
        while len(self._pending) >= self.max_in_flight:
            self._pending[0].wait()
        return self._free.pop() if self._free else CompressionWorkspace()

    def _feedback_for(self, key: int) -> ErrorFeedback | None:
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"key must be an int >= 0; got {key!r}")
        if not self.options.error_feedback:
            return None
        return self._feedback.setdefault(key, ErrorFeedback())

    def _track(self, reduction: PendingReduction, workspace: CompressionWorkspace, key: int) -> _PendingBucket:
        handle = _PendingBucket(reduction, workspace, key, self)
        self._pending.append(handle)
        return handle

    def _finished(self, handle: _PendingBucket, stats: CompressionStats | None, ok: bool) -> None:
        self._pending.remove(handle)
        if ok:  # on failure the workspace is dropped (see _PendingBucket)
            self._free.append(handle.workspace)
        if stats is not None:
            self.last_stats[handle.key] = stats
            self.bytes_sent_total += stats.bytes_sent

    def _wire_for(self, key: int, bucket: torch.Tensor, group: ProcessGroup | None) -> str:
        """The bucket's wire: the options', or with ``"auto"`` the cost model's choice (once per bucket)."""
        if self.options.wire != "auto":
            return self.options.wire
        choice = self.choices.get(key)
        if choice is None:
            if self._costs is None:  # every rank reaches its first bucket at the same point
                self._costs = auto.agree_costs(group, bucket.device, self.options.link_gbps)
            world = dist.get_world_size(group)
            choice = auto.choose(self._costs, bucket.numel(), bucket.element_size(), world, self.options.chunk_size)
            self.choices[key] = choice
            auto.logger.info(
                "bucket %d (%d x %s): %s; %s",
                key,
                bucket.numel(),
                bucket.dtype,
                choice.wire,
                choice.reason(self._costs.link_bytes_per_s),
            )
        return choice.wire

    # ------------------------------------------------------------------ reducer interface
    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> _PendingBucket:
        self._settle_topology(check_bucket(bucket, group))
        if self._wire_for(key, bucket, group) == "full":
            return self._start_full(
                key, lambda: all_reduce_fp32_accumulate(bucket, group, average=average, async_op=True)
            )
        return self._start(key, bucket, group, average, lambda **kw: start_compressed_all_reduce(bucket, group, **kw))

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> _PendingBucket:
        world_size = check_bucket(bucket, group)
        check_shard_out(shard_out, bucket, world_size)
        self._settle_topology(world_size)
        if self._wire_for(key, bucket, group) == "full":
            return self._start_full(
                key,
                lambda: reduce_scatter_fp32_accumulate(
                    shard_out.view(-1), bucket.view(-1), group, average=average, async_op=True
                ),
            )
        return self._start(
            key, bucket, group, average, lambda **kw: start_compressed_reduce_scatter(shard_out, bucket, group, **kw)
        )

    def _start_full(self, key: int, start: Callable[[], PendingReduction | None]) -> _PendingBucket:
        """``wire="auto"`` chose full precision: the fp32-accumulating collective of :mod:`mixprec.comm`."""
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"key must be an int >= 0; got {key!r}")
        workspace = self._take_workspace()
        reduction = start()
        assert reduction is not None  # async_op=True
        return self._track(reduction, workspace, key)

    def _start(
        self,
        key: int,
        bucket: torch.Tensor,
        group: ProcessGroup | None,
        average: bool,
        start: Callable[..., PendingReduction],
    ) -> _PendingBucket:
        """Start one bucket's collective with this reducer's options, feedback and a pooled workspace."""
        feedback = self._feedback_for(key)
        workspace = self._take_workspace()
        try:
            reduction = start(
                compressor=self._compressors.for_device(bucket.device, self._wire_for(key, bucket, group)),
                average=average,
                topology=self.options.topology,
                error_feedback=feedback,
                workspace=workspace,
                shared_workspace=self._shared,
            )
        except (TypeError, ValueError):
            self._free.append(workspace)  # refused before anything was sent: the buffers are idle
            raise
        return self._track(reduction, workspace, key)

    def model(self, rows: torch.Tensor, *, average: bool, key: int = 0) -> torch.Tensor:
        """The compressed all-reduce of the P buckets ``rows`` (see :class:`mixprec.comm.GradReducer`): the flat
        or hierarchical pipeline of :mod:`mixprec.compress.models`, with the simulated ranks' residuals and
        streams in :attr:`model_state`. ``wire="auto"`` uses the bucket's choice of a real call of this reducer,
        else chooses as a real rank would with this process's quantizing costs and ``link_gbps`` (a model
        has no link to probe: without ``link_gbps`` it refuses). Not modelled: :attr:`last_stats` and the
        byte counts (nothing is sent). ``check_finite="raise"`` raises NonFiniteError as every real rank does.
        """
        world, n = check_model_rows(rows, key)
        self._settle_topology(world)
        per_node = None
        if self.options.topology is not None:
            nodes, per_node = topology_shape(self.options.topology)
            if nodes * per_node != world:
                raise ValueError(
                    f"rows hold {world} ranks but the topology {nodes} x {per_node} has {nodes * per_node}"
                )
        wire = self._model_wire(key, rows)
        if self.options.rounding == "stochastic" or self.options.error_feedback:
            self.model_state.check_world(world)  # per-rank streams and residuals: sized for one group
        if wire == "full":  # what _start_full runs: the flat fp32-accumulating all-reduce, round to nearest
            return same_on_every_rank(fp32_accumulate_rows(rows, average=average), world)
        if world == 1:  # nothing is quantized or sent on one rank
            out, found = rows[0].clone(), not bool(torch.isfinite(rows).all())
        else:
            comp = build_compressor(self.options, wire, None)
            keys = None
            if self.options.rounding == "stochastic":
                keys = [draw_key(g) for g in self.model_state.streams(self.options.seed, rows.device)]
            worker = server = None
            if self.options.error_feedback:
                worker_shape, server_shape = feedback_shapes(world, n, per_node)
                worker = self.model_state.tensor(key, "worker", worker_shape, rows.device)
                server = self.model_state.tensor(key, "server", server_shape, rows.device)
            out, found = compressed_all_reduce_rows(
                rows, comp, average=average, ranks_per_node=per_node, keys=keys, worker=worker, server=server
            )
        if found:
            for residual in self.model_state.tensors.get(key, {}).values():
                residual.zero_()  # what every real rank's ErrorFeedback.reset() does
            if self.options.check_finite == "raise":
                raise NonFiniteError(
                    "model: some rank's bucket holds NaN or Inf, or the reduction overflowed (the affected chunks "
                    "reduced to NaN on every rank)"
                )
        return same_on_every_rank(out, world)

    def _model_wire(self, key: int, rows: torch.Tensor) -> str:
        if self.options.wire != "auto":
            return self.options.wire
        choice = self.choices.get(key) or self._model_choices.get(key)
        if choice is None:
            if self.options.link_gbps is None:
                raise ValueError(
                    "wire='auto' chooses each bucket's wire from the link rate, which a one-process model cannot "
                    "probe: give link_gbps (or model after a real reduction of this bucket, whose choice is kept)"
                )
            world, n = rows.shape
            costs = auto.LinkCosts(self.options.link_gbps * 1e9 / 8, *auto.measure_quantize_cost(rows.device))
            choice = auto.choose(costs, n, rows.element_size(), world, self.options.chunk_size)
            self._model_choices[key] = choice
        return choice.wire

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the options that change results (rounding, chunk_size, check_finite, topology as
        [nodes, ranks_per_node] or None), per-bucket error-feedback residuals, the stochastic stream's state
        and device."""
        return {
            **self.options.saved(),
            "error_feedback": {key: fb.state_dict() for key, fb in self._feedback.items()},
            **self._compressors.saved(),
        }

    def load_state_dict(self, state: dict[str, Any], *, owner: str = "reducer") -> None:
        """Load a :meth:`state_dict` of this rank. Everything is checked before anything changes (``owner``: what
        the messages call this object, e.g. an adapter's "hook state").

        Raises:
            TypeError: ``state`` or one of its entries has the wrong type.
            ValueError: it was saved with other options (rounding, chunk_size, check_finite, topology), holds
                residuals while this reducer has ``error_feedback=False``, or a generator state from another
                device type.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        self.options.check_saved(state, owner)
        feedback = state.get("error_feedback", {})
        if not isinstance(feedback, dict):
            raise TypeError(f"state['error_feedback'] must be a dict; got {type(feedback).__name__}")
        if feedback and not self.options.error_feedback:
            raise ValueError(f"state holds error-feedback residuals but this {owner} has error_feedback=False")
        loaded = {
            key: load_feedback(check_feedback_entry("state['error_feedback']", key, entry))
            for key, entry in feedback.items()
        }
        generator = self._compressors.check_saved(state, owner)
        self._compressors.load(generator)
        self._feedback = loaded

    def __repr__(self) -> str:
        opts = self.options
        kind = "flat" if opts.topology is None else f"hierarchical {opts.topology!r}"
        return (
            f"CompressedReducer({kind}, wire={opts.wire!r}, chunk_size={opts.chunk_size}, rounding={opts.rounding!r}, "
            f"error_feedback={opts.error_feedback}, check_finite={opts.check_finite!r})"
        )


class _PendingBucket(PendingReduction):
    """A started bucket reduction holding one of the reducer's in-flight workspaces until it finishes.

    A :class:`mixprec.comm.PendingReduction`: after a failed ``wait()`` every later one raises again (the
    bucket is not reduced), and the workspace is dropped, never reused (the failed communication may still
    be writing into it).
    """

    def __init__(
        self, reduction: PendingReduction, workspace: CompressionWorkspace, key: int, owner: CompressedReducer
    ) -> None:
        self.workspace = workspace
        self.key = key

        def finish() -> None:
            stats, ok = None, False
            try:
                stats = reduction.wait()
                ok = True
            finally:
                owner._finished(self, stats if isinstance(stats, CompressionStats) else None, ok)

        super().__init__(finish)


def _factory(name: str, wires: tuple[str, ...], hierarchical: bool) -> Callable[..., CompressedReducer]:
    """A registry factory: ``wire`` defaults to ``wires[0]`` and must be one of ``wires``; a flat reducer
    refuses a topology, a hierarchical one takes it from the options, else from ``LOCAL_WORLD_SIZE``."""

    def make(**options: Any) -> CompressedReducer:
        wire = options.setdefault("wire", wires[0])
        if wire not in wires:
            raise ValueError(f"reducer {name!r}: wire must be one of {', '.join(map(repr, wires))}; got {wire!r}")
        deferred = False
        if hierarchical and options.get("topology") is None:
            if dist.is_available() and dist.is_initialized():
                options["topology"] = Topology.from_env()
            else:  # no group yet (a model): the node count comes from the group size at the first call
                options["topology"] = Topology(1, local_world_size_from_env())
                deferred = True
        elif not hierarchical and options.get("topology") is not None:
            raise ValueError(f"reducer {name!r} is flat; for a topology use reduce={name + '_hierarchical'!r}")
        reducer = CompressedReducer(**options)
        reducer._nodes_from_world = deferred
        return reducer

    # The factory takes CompressedReducer's keywords; its signature says so, so that make_reducer can name a
    # wrong option before any reducer is built.
    make.__signature__ = inspect.signature(CompressedReducer)  # type: ignore[attr-defined]
    make.__name__ = make.__qualname__ = f"make_{name}_reducer"
    return make


for _name, _wires in (
    ("uint8", ("uint8",)),
    ("fp8", ("e4m3", "e5m2")),
    ("mxfp8", ("mxfp8_e4m3", "mxfp8_e5m2")),
    ("nvfp4", ("nvfp4",)),
    ("auto", ("auto",)),
):
    register_reducer(_name, _factory(_name, _wires, hierarchical=False))
    if _name != "auto":
        register_reducer(_name + "_hierarchical", _factory(_name, _wires, hierarchical=True))
