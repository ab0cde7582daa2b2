"""Gradient reducers: how one flat gradient bucket is reduced across a data-parallel group.

A reducer is chosen by name (``make_reducer("fp32_accumulate")``) or passed as an object to
:class:`mixprec.parallel.DistributedDataParallel`. Built in:

* ``"native"``: the backend's own collective in the bucket dtype (what torch DDP does): ``average``
  divides every element by the group size *before* the sum, in the bucket dtype (torch DDP's pre-divide,
  which keeps fp16 sums from overflowing), then SUM. gloo and NCCL add in the wire dtype.
* ``"fp32_accumulate"``: :func:`mixprec.comm.reduce_scatter_fp32_accumulate` /
  :func:`mixprec.comm.all_reduce_fp32_accumulate`: wire in the bucket dtype, fp32 sum, one rounding.
  Options: ``rounding="nearest"|"stochastic"``, ``seed`` (stochastic rounding's stream, plus the rank),
  ``max_in_flight`` (receive buffers kept; see :class:`FP32AccumulateReducer`).

The compression issue registers ``"uint8"`` and ``"uint8_hierarchical"`` from ``mixprec.compress``;
:func:`make_reducer` imports that module on first use of a name starting with ``uint8``.

The contract every reducer keeps (the data-parallel wrapper relies on it):

* ``bucket`` is 1-D, contiguous, fp16/bf16/fp32 (its dtype is the wire dtype), with a length that is a
  multiple of ``lcm(world_size, 128)``; every rank passes a bucket of the same length and dtype, and all
  ranks call the reducer for the same buckets in the same order.
* The call starts the reduction and returns a handle; ``handle.wait()`` finishes it (blocking). Until
  then the caller touches neither ``bucket`` nor ``shard_out``. ``wait()`` may be called again: after
  a success it returns at once, after a failure it raises again (:class:`mixprec.comm.PendingReduction`).
* ``all_reduce`` writes the reduced bucket in place, with identical bits on every rank (replicas must
  not drift apart). ``reduce_scatter`` writes elements ``[r*S, (r+1)*S)`` of the reduced bucket into rank
  r's ``shard_out`` (``S = len(bucket) // world_size``, dtype ``bucket.dtype`` or torch.float32) and may
  use ``bucket`` as scratch (its contents afterwards are unspecified).
* ``average=True`` returns the mean over ranks instead of the sum.
* ``key`` (int >= 0) names the bucket and is the same for the same bucket at every step, so that a
  stateful reducer (error feedback) can keep per-bucket state.
* Non-finite values are never turned into finite ones: where any rank's bucket holds inf/NaN at element
  i, the reduced element i is inf or NaN (other elements may be too). The wrapper also checks buckets
  before sending them, but the loss scaler's overflow check after the reduction relies on this.
* ``state_dict()`` returns plain tensors and Python scalars (saved with ``torch.save``, loadable with
  ``weights_only=True``); ``load_state_dict`` accepts what ``state_dict`` returned.
"""

from __future__ import annotations

import importlib
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mixprec._validate import check_choice, check_positive_int, check_tensor
from mixprec.comm._compat import reduce_scatter_flat
from mixprec.comm.fp32_accumulate import (
    DEFAULT_STOCHASTIC_SEED,
    WIRE_DTYPES,
    all_reduce_fp32_accumulate,
    reduce_scatter_fp32_accumulate,
)
from mixprec.comm.handles import PendingReduction
from mixprec.comm.random import rank_generator
from mixprec.comm.rounding import Rounding

__all__ = [
    "BUCKET_ALIGNMENT",
    "FP32AccumulateReducer",
    "GradReducer",
    "NativeReducer",
    "ReductionHandle",
    "bucket_multiple",
    "check_bucket",
    "check_shard_out",
    "make_reducer",
    "register_reducer",
    "registered_reducers",
]

# Bucket lengths are multiples of lcm(world_size, BUCKET_ALIGNMENT): divisible into equal shards, and each
# shard a whole number of 128-element blocks (the block size of the 8-bit compressors).
BUCKET_ALIGNMENT = 128


def bucket_multiple(world_size: int) -> int:
    """The multiple every bucket length must be: ``lcm(world_size, 128)``."""
    return math.lcm(check_positive_int("world_size", world_size), BUCKET_ALIGNMENT)


class ReductionHandle(Protocol):
    """A started reduction; ``wait()`` finishes it (blocking) and may be called more than once."""

    def wait(self) -> None: ...


@runtime_checkable
class GradReducer(Protocol):
    """Reduces one flat gradient bucket (1-D, contiguous, length a multiple of lcm(world_size, 128)).

    See the module docstring for the full contract (ordering, in-place semantics, non-finite values).
    """

    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle: ...

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _after_work(work: Any, then: Callable[[], None] | None = None, *, keep: Any = None) -> PendingReduction:
    """A handle that waits for a torch ``Work``, then runs ``then``; ``keep`` stays referenced until then
    (a tensor the communication reads)."""

    def finish() -> None:
        if work is not None:
            work.wait()
        if then is not None:
            then()
        del keep_alive[:]

    keep_alive = [keep]
    return PendingReduction(finish)


def check_bucket(bucket: torch.Tensor, group: ProcessGroup | None) -> int:
    """Check a reducer's bucket (see the module docstring's contract); returns the group size.

    TypeError: not a tensor, or not fp16/bf16/fp32. ValueError: not 1-D contiguous, or a length that is not
    a multiple of ``lcm(world_size, 128)``.
    """
    check_tensor("bucket", bucket, WIRE_DTYPES)
    if bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(f"bucket must be a 1-D contiguous tensor; got shape {tuple(bucket.shape)}")
    world_size = dist.get_world_size(group)
    multiple = bucket_multiple(world_size)
    if bucket.numel() % multiple:
        raise ValueError(
            f"bucket length {bucket.numel()} is not a multiple of lcm(world_size={world_size}, "
            f"{BUCKET_ALIGNMENT}) = {multiple}"
        )
    return world_size


def check_shard_out(shard_out: torch.Tensor, bucket: torch.Tensor, world_size: int) -> None:
    """Check a reduce-scatter's output: dtype ``bucket.dtype`` or fp32 (TypeError), contiguous with
    ``len(bucket) / world_size`` elements (ValueError)."""
    check_tensor("shard_out", shard_out, (bucket.dtype, torch.float32))
    if shard_out.numel() != bucket.numel() // world_size or not shard_out.is_contiguous():
        raise ValueError(
            f"shard_out must be contiguous with len(bucket) / world_size = {bucket.numel() // world_size} "
            f"elements; got {shard_out.numel()}"
        )


class NativeReducer:
    """The backend's own collective in the bucket dtype (torch DDP's behaviour); stateless.

    Wire and accumulation dtype: the bucket's (gloo and NCCL round the running sum at every step).
    ``average``: the bucket is divided by the group size in its own dtype before the SUM, as torch
    DDP's default hook does. Extra memory: ``all_reduce`` none (it divides the bucket in place);
    ``reduce_scatter`` with ``average`` a pre-divided copy of the bucket (the bucket itself is left as it
    is), plus a bucket-dtype shard when ``shard_out`` is fp32.
    """

    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        if average:
            bucket.div_(world_size)
        return _after_work(dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group, async_op=True))

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        check_shard_out(shard_out, bucket, world_size)
        # The pre-divided input is a copy: in sharded mode param.grad views the bucket and keeps the local,
        # unreduced gradient.
        source = torch.div(bucket, world_size) if average else bucket
        if shard_out.dtype == bucket.dtype:
            return _after_work(reduce_scatter_flat(shard_out, source, group, async_op=True), keep=source)
        staging = torch.empty(shard_out.numel(), dtype=bucket.dtype, device=bucket.device)
        work = reduce_scatter_flat(staging, source, group, async_op=True)
        return _after_work(work, lambda: shard_out.copy_(staging), keep=source)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")

    def __repr__(self) -> str:
        return "NativeReducer()"


class FP32AccumulateReducer:
    """Wire in the bucket dtype, fp32 sum in rank order, one rounding (mixprec.comm's collectives).

    Args:
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased) for the single rounding to the bucket
            dtype. Nothing is rounded when the output is fp32 (a reduce-scatter into fp32 master gradients).
        seed: stochastic rounding's stream is seeded with ``seed + global rank``.
        max_in_flight: receive buffers kept for reuse, int >= 1. Each started reduction holds one (a
            bucket's length in the bucket dtype) until it finishes; starting one more than this first
            finishes the oldest still pending (blocking on it), so the extra memory stays at
            ``max_in_flight`` buckets however many buckets a backward pass starts.

    Extra memory: up to ``max_in_flight`` receive buffers of the largest bucket, plus 512 KiB of fp32
    blocks while a reduction finishes.
    """

    def __init__(
        self, *, rounding: Rounding = "nearest", seed: int = DEFAULT_STOCHASTIC_SEED, max_in_flight: int = 2
    ) -> None:
        self.rounding = check_choice("rounding", rounding, ("nearest", "stochastic"))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int; got {type(seed).__name__}")
        self.seed = seed
        self.max_in_flight = check_positive_int("max_in_flight", max_in_flight)
        self._free: list[torch.Tensor] = []
        self._pending: deque[PendingReduction] = deque()
        self._largest: dict[tuple[torch.dtype, torch.device], int] = {}
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None

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
            self._free.append(scratch)

        handle = PendingReduction(finish)
        self._pending.append(handle)
        return handle

    def _rng(self, device: torch.device) -> torch.Generator | None:
        if self.rounding != "stochastic":
            return None
        self._generator = rank_generator(self.seed, device)
        if self._generator_state is not None:  # a state loaded before the first reduction
            self._generator.set_state(self._generator_state)
            self._generator_state = None
        return self._generator

    # ------------------------------------------------------------------ reducer interface
    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        check_bucket(bucket, group)
        scratch = self._take_scratch(bucket)
        pending = all_reduce_fp32_accumulate(
            bucket,
            group,
            average=average,
            async_op=True,
            rounding=self.rounding,
            scratch=scratch,
            generator=self._rng(bucket.device),
        )
        return self._track(pending, scratch)

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle:
        world_size = check_bucket(bucket, group)
        check_shard_out(shard_out, bucket, world_size)
        scratch = self._take_scratch(bucket)
        pending = reduce_scatter_fp32_accumulate(
            shard_out,
            bucket,
            group,
            average=average,
            async_op=True,
            rounding=self.rounding if shard_out.dtype != torch.float32 else "nearest",
            scratch=scratch,
            generator=self._rng(bucket.device),
        )
        return self._track(pending, scratch)

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
        return f"FP32AccumulateReducer(rounding={self.rounding!r}, max_in_flight={self.max_in_flight})"


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[..., GradReducer]] = {}
# Names served by an optional module, imported on first use (it registers them itself).
_PROVIDERS: dict[str, str] = {"uint8": "mixprec.compress"}


def register_reducer(name: str, factory: Callable[..., GradReducer]) -> None:
    """Make ``make_reducer(name, **options)`` call ``factory(**options)``.

    Registering the same factory under the same name again is a no-op; a different factory under a
    taken name is refused (ValueError).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str; got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (a class or function returning a GradReducer); got {factory!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not factory:
        raise ValueError(f"a reducer named {name!r} is already registered ({existing!r})")
    _REGISTRY[name] = factory


def registered_reducers() -> tuple[str, ...]:
    """The names :func:`make_reducer` accepts now (optional modules add theirs when imported)."""
    return tuple(sorted(_REGISTRY))


def make_reducer(name: str, **options: Any) -> GradReducer:
    """Build the reducer registered as ``name`` with ``options`` (e.g. ``make_reducer("fp32_accumulate",
    rounding="stochastic")``). Names starting with ``uint8`` come from ``mixprec.compress``, imported here
    on first use.
    """
    if not isinstance(name, str):
        raise TypeError(f"reducer name must be a str; got {type(name).__name__}")
    provider: str | None = None
    if name not in _REGISTRY:
        provider = next((mod for prefix, mod in _PROVIDERS.items() if name.startswith(prefix)), None)
        if provider is not None:
            try:
                importlib.import_module(provider)
            except ImportError as exc:
                raise ValueError(
                    f"reducer {name!r} is provided by {provider}, which could not be imported ({exc}); "
                    f"registered reducers: {', '.join(registered_reducers())}"
                ) from exc
    factory = _REGISTRY.get(name)
    if factory is None:
        hint = f" ({provider} was imported but registers no such name)" if provider is not None else ""
        raise ValueError(f"unknown reducer {name!r}{hint}; registered reducers: {', '.join(registered_reducers())}")
    try:
        reducer = factory(**options)
    except TypeError as exc:
        raise TypeError(f"reducer {name!r} rejected its options {sorted(options)}: {exc}") from exc
    if not isinstance(reducer, GradReducer):
        raise TypeError(f"the factory registered as {name!r} returned {type(reducer).__name__}, not a GradReducer")
    return reducer


register_reducer("native", NativeReducer)
register_reducer("fp32_accumulate", FP32AccumulateReducer)
