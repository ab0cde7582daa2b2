"""The built-in gradient reducers of :mod:`mixprec.parallel`, registered by name in :mod:`mixprec.comm.reducer`.

* ``"native"``: the backend's own collective in the bucket dtype (what torch DDP does): ``average``
  divides every element by the group size *before* the sum, in the bucket dtype (torch DDP's pre-divide,
  which keeps fp16 sums from overflowing), then SUM. gloo and NCCL add in the wire dtype. Its model follows
  gloo's ring (``algorithm="ring"``, measured) or the shape of NCCL's tree (``algorithm="tree"``).
* ``"fp32_accumulate"``: :func:`mixprec.comm.reduce_scatter_fp32_accumulate` /
  :func:`mixprec.comm.all_reduce_fp32_accumulate`: wire in the bucket dtype, fp32 sum, one rounding.
  Options: ``rounding="nearest"|"stochastic"``, ``seed`` (stochastic rounding's stream, plus the rank),
  ``max_in_flight`` (receive buffers kept; see :class:`FP32AccumulateReducer`), ``topology`` and
  ``inter_node_dtype`` (the two-stage multi-node scheme), ``budget`` (its pooled receive area).
* ``"fp32_accumulate_hierarchical"``: the same with the topology from torchrun's ``LOCAL_WORLD_SIZE``
  when none is given.

All keep the contract of :class:`mixprec.comm.reducer.GradReducer`, ``model`` included (its arithmetic is
:mod:`mixprec.comm.models`').
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mixprec.comm.compat import reduce_scatter_flat
from mixprec.comm.fp32_accumulate import (
    all_reduce_fp32_accumulate,
    reduce_scatter_fp32_accumulate,
    reduce_scatter_scaled,
)
from mixprec.comm.handles import PendingReduction, wait_all
from mixprec.comm.hierarchical_fp32 import per_segment
from mixprec.comm.models import (
    GroupState,
    binary_tree_sum,
    fp32_accumulate_rows,
    gloo_ring_sum,
    hierarchical_fp32_rows,
    same_on_every_rank,
    topology_shape,
)
from mixprec.comm.reducer import (
    ReductionHandle,
    after_work,
    check_bucket,
    check_model_rows,
    check_shard_out,
    register_reducer,
)
from mixprec.comm.topology import Topology, check_topology, local_world_size_from_env
from mixprec.core.dtypes import ROUNDINGS, Rounding
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED, rounding_generator
from mixprec.core.validate import check_choice, check_positive_int

__all__ = ["NATIVE_ALGORITHMS", "FP32AccumulateReducer", "NativeReducer"]

# What NativeReducer.model follows: gloo's ring (measured, bit for bit) or the shape of NCCL's tree.
NATIVE_ALGORITHMS: tuple[str, ...] = ("ring", "tree")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class NativeReducer:
    """The backend's own collective in the bucket dtype (torch DDP's behaviour); stateless.

    Wire and accumulation dtype: the bucket's (gloo and NCCL round the running sum at every step).
    ``average``: the bucket is divided by the group size in its own dtype before the SUM, as torch
    DDP's default hook does. Extra memory: ``all_reduce`` none (it divides the bucket in place);
    ``reduce_scatter`` with ``average`` a pre-divided copy of the bucket (the bucket itself is left as it
    is), plus a bucket-dtype shard when ``shard_out`` is fp32.

    Args:
        algorithm: what :meth:`model` follows: ``"ring"`` (gloo's ring, measured bit for bit) or ``"tree"``
            (a binary tree in rank order, the shape of NCCL's, not its exact order). The collective itself
            runs whatever the backend runs.
    """

    def __init__(self, *, algorithm: str = "ring") -> None:
        self.algorithm = check_choice("algorithm", algorithm, NATIVE_ALGORITHMS)

    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        if average:
            bucket.div_(world_size)
        return after_work(dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group, async_op=True))

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        check_shard_out(shard_out, bucket, world_size)
        # The pre-divided input is a copy: in sharded mode param.grad views the bucket and keeps the local,
        # unreduced gradient.
        source = torch.div(bucket, world_size) if average else bucket
        if shard_out.dtype == bucket.dtype:
            return after_work(reduce_scatter_flat(shard_out, source, group, async_op=True), keep=source)
        staging = torch.empty(shard_out.numel(), dtype=bucket.dtype, device=bucket.device)
        work = reduce_scatter_flat(staging, source, group, async_op=True)
        return after_work(work, lambda: shard_out.copy_(staging), keep=source)

    def model(self, rows: torch.Tensor, *, average: bool, key: int = 0) -> torch.Tensor:
        """Each rank pre-divides its bucket by P in its dtype (``average``), then gloo's ring or the tree SUM,
        rounding to the wire dtype at every hop."""
        world, _ = check_model_rows(rows, key)
        if self.algorithm == "tree":
            return same_on_every_rank(binary_tree_sum(torch.div(rows, world) if average else rows), world)
        return same_on_every_rank(gloo_ring_sum(rows, pre_divide=world if average else None), world)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")

    def __repr__(self) -> str:
        return "NativeReducer()" if self.algorithm == "ring" else f"NativeReducer(algorithm={self.algorithm!r})"


class FP32AccumulateReducer:
    """Wire in the bucket dtype, fp32 sum in rank order, one rounding (mixprec.comm's collectives).

    Args:
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased) for the single rounding to the bucket
            dtype. Nothing is rounded when the output is fp32 (a reduce-scatter into fp32 master gradients).
        seed: stochastic rounding's stream is seeded with ``seed + global rank``.
        generator: a ``torch.Generator`` to draw stochastic rounding from instead (this rank's own stream, as an
            adapter may be handed one); None = the seeded stream above. A model of P ranks needs the seed.
        max_in_flight: receive buffers kept for reuse, int >= 1. Each started reduction holds one (a
            bucket's length in the bucket dtype) until it finishes; starting one more than this first
            finishes the oldest still pending (blocking on it), so the extra memory stays at
            ``max_in_flight`` buckets however many buckets a backward pass starts.

        topology: None (the flat scheme), or a :class:`mixprec.comm.Topology` / 2-D DeviceMesh with dims
            ("node", "local"): the two-stage scheme of :mod:`mixprec.comm.hierarchical_fp32` (the group must
            be the default group).
        inter_node_dtype: with a topology: None (node partials rounded to the bucket dtype before they
            cross nodes: two roundings) or torch.float32 (one rounding, twice the inter-node bytes).
        budget: with a topology: elements (of the bucket dtype) of the one receive area shared by all
            reductions in flight, each using ``budget // max_in_flight``; None = the largest bucket's length.

    Extra memory: flat, up to ``max_in_flight`` receive buffers of the largest bucket, plus 512 KiB of fp32
    blocks while a reduction finishes. Hierarchical: the area (one bucket by default, however many buckets
    the model has: Megatron-LM keeps one buffer per bucket, PR #4940) plus two fp32 blocks of at most a
    segment of node partials each (the 512 KiB cap).
    """

    def __init__(
        self,
        *,
        rounding: Rounding = "nearest",
        seed: int = DEFAULT_STOCHASTIC_SEED,
        max_in_flight: int = 2,
        topology: Any = None,
        inter_node_dtype: torch.dtype | None = None,
        budget: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.rounding = check_choice("rounding", rounding, ROUNDINGS)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
        self.generator = generator
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        self.seed = seed
        self.max_in_flight = check_positive_int("max_in_flight", max_in_flight)
        # Checked here, not first inside a backward hook (sizes too, once the group is initialised).
        self.topology = None if topology is None else check_topology(topology)
        if inter_node_dtype is not None and inter_node_dtype not in (torch.float32,):
            if not isinstance(inter_node_dtype, torch.dtype):
                raise TypeError(
                    f"inter_node_dtype must be None or torch.float32; got {type(inter_node_dtype).__name__}"
                )
            raise ValueError(
                f"inter_node_dtype must be None (the bucket dtype) or torch.float32; got {inter_node_dtype}"
            )
        if inter_node_dtype is not None and topology is None:
            raise ValueError("inter_node_dtype applies only to the hierarchical scheme: pass a topology as well")
        self.inter_node_dtype = inter_node_dtype
        if budget is not None:
            check_positive_int("budget", budget)
            if topology is None:
                raise ValueError("budget applies only to the hierarchical scheme: pass a topology as well")
        self.budget = budget
        self._pool: torch.Tensor | None = None
        self._areas: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._pending: deque[PendingReduction] = deque()
        self._largest: dict[tuple[torch.dtype, torch.device], int] = {}
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None
        self.model_state = GroupState()
        """The simulated ranks' state while :meth:`model` stands for a group (their random streams)."""
        self._nodes_from_world = False  # LOCAL_WORLD_SIZE read before the group size was known

    def _settle_topology(self, world: int) -> None:
        if self._nodes_from_world:
            self.topology = Topology.from_env(world)
            self._nodes_from_world = False

    # ------------------------------------------------------------------ buffers
    def _take_scratch(self, bucket: torch.Tensor) -> torch.Tensor:
        while len(self._pending) >= self.max_in_flight:
            self._pending[0].wait()  # leaves the queue; its buffer goes back to the free list if it succeeded
        for i, buf in enumerate(self._free):
            if buf.dtype == bucket.dtype and buf.device == bucket.device and buf.numel() >= bucket.numel():
                return self._free.pop(i)
        if self._free and len(self._free) + len(self._pending) >= self.max_in_flight:
            self._free.pop(0)  # too small or the wrong dtype: replace it rather than grow the pool
        # Sized for the largest bucket seen so far, so that buckets of mixed sizes stop reallocating after
        # the first backward pass.
        key = (bucket.dtype, bucket.device)
        self._largest[key] = max(self._largest.get(key, 0), bucket.numel())
        return torch.empty(self._largest[key], dtype=bucket.dtype, device=bucket.device)

    def _take_area(self, bucket: torch.Tensor, world_size: int) -> torch.Tensor:
        """One of ``max_in_flight`` equal pieces of the pooled receive area (hierarchical scheme)."""
        while len(self._pending) >= self.max_in_flight:
            self._pending[0].wait()  # its piece goes back to the free list if it succeeded
        # At least one element per segment of an all-reduce on any topology of this group (nodes <= world).
        per = max(per_segment(world_size, world_size, True), (self.budget or bucket.numel()) // self.max_in_flight)
        pool = self._pool
        if (
            pool is None
            or pool.dtype != bucket.dtype
            or pool.device != bucket.device
            or pool.numel() < per * self.max_in_flight
        ):
            # Grown (a larger bucket) only when no reduction holds a piece of the old one.
            wait_all(list(self._pending))
            pool = self._pool = torch.empty(per * self.max_in_flight, dtype=bucket.dtype, device=bucket.device)
            self._areas = [pool[k * per : (k + 1) * per] for k in range(self.max_in_flight)]
        return self._areas.pop()

    def _track(self, pending: PendingReduction | None, scratch: torch.Tensor) -> ReductionHandle:
        if pending is None:  # the async collectives always return a handle; None would skip the reduction
            raise RuntimeError("internal error: an async_op=True collective returned no handle")

        def finish() -> None:
            try:
                pending.wait()
            except BaseException:
                # The communication may still be writing into scratch: drop the buffer, never reuse it.
                self._pending.remove(handle)
                raise
            self._pending.remove(handle)
            if self.topology is None:
                self._free.append(scratch)
            elif (
                self._pool is not None
                and scratch.untyped_storage().data_ptr() == self._pool.untyped_storage().data_ptr()
            ):
                self._areas.append(scratch)

        handle = PendingReduction(finish)
        self._pending.append(handle)
        return handle

    def _rng(self, device: torch.device) -> torch.Generator | None:
        if self.rounding != "stochastic":
            return None
        self._generator = rounding_generator(self.rounding, self.generator, device, self.seed)
        if self._generator_state is not None:  # a state loaded before the first reduction
            self._generator.set_state(self._generator_state)
            self._generator_state = None
        return self._generator

    # ------------------------------------------------------------------ reducer interface
    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        self._settle_topology(world_size)
        scratch = self._take_scratch(bucket) if self.topology is None else self._take_area(bucket, world_size)
        pending = all_reduce_fp32_accumulate(
            bucket,
            group,
            average=average,
            async_op=True,
            rounding=self.rounding,
            scratch=scratch,
            generator=self._rng(bucket.device),
            topology=self.topology,
            inter_node_dtype=self.inter_node_dtype,
        )
        return self._track(pending, scratch)

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        check_shard_out(shard_out, bucket, world_size)
        self._settle_topology(world_size)
        scratch = self._take_scratch(bucket) if self.topology is None else self._take_area(bucket, world_size)
        pending = reduce_scatter_fp32_accumulate(
            shard_out,
            bucket,
            group,
            average=average,
            async_op=True,
            rounding=self.rounding if shard_out.dtype != torch.float32 else "nearest",
            scratch=scratch,
            generator=self._rng(bucket.device),
            topology=self.topology,
            inter_node_dtype=self.inter_node_dtype,
        )
        return self._track(pending, scratch)

    def model(self, rows: torch.Tensor, *, average: bool, key: int = 0) -> torch.Tensor:
        """Flat: the fp32 sum in rank order (/ P), one rounding; stochastic rounding rounds owner p's shard with
        simulated rank p's stream. Hierarchical (round to nearest): the two stages of
        :func:`mixprec.comm.models.hierarchical_fp32_rows`. Stochastic hierarchical rounding is refused: its
        draws follow the segment pipeline, which is not modelled."""
        world, _ = check_model_rows(rows, key)
        self._settle_topology(world)
        if self.topology is not None:
            nodes, per_node = topology_shape(self.topology)
            if nodes * per_node != world:
                raise ValueError(
                    f"rows hold {world} ranks but the topology {nodes} x {per_node} has {nodes * per_node}"
                )
            if self.rounding == "stochastic":
                raise ValueError(
                    "the hierarchical scheme's stochastic rounding is not modelled (its draws follow the segment "
                    "pipeline); model rounding='nearest'"
                )
            return same_on_every_rank(
                hierarchical_fp32_rows(rows, per_node, average=average, inter_dtype=self.inter_node_dtype), world
            )
        stochastic = self.rounding == "stochastic"
        if stochastic and self.generator is not None:
            raise ValueError(
                "this reducer rounds stochastically from a given generator (one rank's stream); a model of P ranks "
                "draws from P streams seeded seed + rank: build it with seed= instead"
            )
        if stochastic and rows.dtype == torch.float32:
            raise ValueError(f"rounding='stochastic' needs a float16/bfloat16 tensor; rows are {rows.dtype}")
        generators = None
        if stochastic:  # per-rank streams: the state that ties this object to one group size
            self.model_state.check_world(world)
            generators = self.model_state.streams(self.seed, rows.device)
        out = fp32_accumulate_rows(rows, average=average, rounding=self.rounding, generators=generators)
        return same_on_every_rank(out, world)

    def reduce_scatter_scaled(
        self,
        shard_out: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        *,
        average: bool,
        factor: float | None,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """Blocking reduce-scatter of a contiguous tensor whose length is any multiple of the group size (an
        adapter's, e.g. torch FSDP2's), with this reducer's rounding, stream and topology, the fp32 sum multiplied
        by ``factor`` before the one rounding (``ReduceOp.PREMUL_SUM``): :func:`mixprec.comm.reduce_scatter_scaled`.
        ``scratch``: the receive buffer (the hierarchical area), reused by the caller across calls."""
        reduce_scatter_scaled(
            shard_out,
            tensor,
            group,
            average=average,
            factor=factor,
            async_op=False,
            rounding=self.rounding,
            scratch=scratch,
            generator=self._rng(tensor.device),
            topology=self.topology,
            inter_node_dtype=self.inter_node_dtype,
        )

    def state_dict(self) -> dict[str, Any]:
        """The rounding mode and, for stochastic rounding, the generator state (a uint8 tensor)."""
        state: dict[str, Any] = {"rounding": self.rounding, "seed": self.seed}
        gen_state = self._generator.get_state() if self._generator is not None else self._generator_state
        if gen_state is not None:
            state["generator_state"] = gen_state.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        if "rounding" in state and state["rounding"] != self.rounding:
            raise ValueError(
                f"state was saved with rounding={state['rounding']!r}; this reducer uses {self.rounding!r}"
            )
        gen_state = state.get("generator_state")
        if gen_state is not None:
            if self._generator is not None:
                self._generator.set_state(gen_state)
            else:
                self._generator_state = gen_state.clone()

    def __repr__(self) -> str:
        extra = "" if self.topology is None else f", topology={self.topology!r}"
        return f"FP32AccumulateReducer(rounding={self.rounding!r}, max_in_flight={self.max_in_flight}{extra})"


def make_hierarchical_fp32_reducer(**options: Any) -> FP32AccumulateReducer:
    """Factory of ``"fp32_accumulate_hierarchical"``: ``topology`` from the options, else from torchrun's
    ``LOCAL_WORLD_SIZE`` (without a process group, as for a model, the node count comes from the group size
    at the first call)."""
    if options.get("topology") is not None:
        return FP32AccumulateReducer(**options)
    if dist.is_available() and dist.is_initialized():
        options["topology"] = Topology.from_env()
        return FP32AccumulateReducer(**options)
    options["topology"] = Topology(1, local_world_size_from_env())  # nodes: set at the first call
    reducer = FP32AccumulateReducer(**options)
    reducer._nodes_from_world = True
    return reducer


make_hierarchical_fp32_reducer.__signature__ = inspect.signature(FP32AccumulateReducer)  # type: ignore[attr-defined]


register_reducer("native", NativeReducer)
register_reducer("fp32_accumulate", FP32AccumulateReducer)
register_reducer("fp32_accumulate_hierarchical", make_hierarchical_fp32_reducer)
