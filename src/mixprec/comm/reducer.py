"""The gradient-reducer protocol: how one flat gradient bucket is reduced across a data-parallel group.

Implementations live above this module: ``mixprec.parallel`` (``"native"``, ``"fp32_accumulate"``) and
``mixprec.compress`` (the compressed reducers) register theirs by name; the data-parallel wrapper builds
one with :func:`make_reducer` or takes any object that keeps the contract.

The contract every reducer keeps is in :class:`GradReducer`'s docstring; :func:`check_bucket` and
:func:`check_shard_out` check its tensor arguments. Every consumer (the wrapper, the sharded optimizer, the
torch DDP hooks, the simulated data parallelism, the studies) goes through these objects: a reducer's
:meth:`~GradReducer.model` is the bit-exact one-process model of its ``all_reduce``, built from
:mod:`mixprec.comm.models` and the compressed pipelines' models, so a new reducer gets every consumer at once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mixprec.comm.handles import PendingReduction
from mixprec.comm.models import check_rows
from mixprec.core.dtypes import WIRE_DTYPES
from mixprec.core.validate import check_group, check_positive_int, check_tensor

__all__ = [
    "BUCKET_ALIGNMENT",
    "BucketReducer",
    "GradReducer",
    "ReductionHandle",
    "after_work",
    "bucket_multiple",
    "check_bucket",
    "check_model_rows",
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
class BucketReducer(Protocol):
    """The four methods the data-parallel wrapper calls (an object passed to it as ``reduce=`` needs only
    these); a registered reducer is a full :class:`GradReducer`."""

    def all_reduce(
        self, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle: ...

    def reduce_scatter(
        self, shard_out: torch.Tensor, bucket: torch.Tensor, group: ProcessGroup | None, *, average: bool, key: int
    ) -> ReductionHandle: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class GradReducer(BucketReducer, Protocol):
    """Reduces one flat gradient bucket (1-D, contiguous, length a multiple of lcm(world_size, 128)).

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
    * The bucket's padding (the elements after the last parameter) is zero when a reduction starts; a
      reducer may write there, the wrapper zeroes it again.

    ``model(rows, *, average, key=0)``: the P ranks' buckets stacked as ``rows`` [P, n] (rank r's in row r,
    the buckets' dtype, n a multiple of ``lcm(P, 128)``) in, [P, n] out: what each rank's bucket holds after
    ``all_reduce(..., average=average, key=key)`` on a P-rank group, bit for bit, computed in this process
    without a process group (CPU or the rows' device). Since every rank holds the same bits, the result may
    be a broadcast view: read it, copy it before writing. ``rows`` is not modified.

    State while modelling: one reducer object stands for the whole group, so it keeps the state of all P
    simulated ranks, apart from its own rank's state for real calls (:class:`mixprec.comm.models.GroupState`):
    rank r's random stream seeded as ``mixprec.comm.rank_generator`` seeds rank r's (``seed + r``), and per
    bucket key one residual per rank, each advancing exactly as the real ranks' do at each call. The first call
    of a reducer that keeps such state fixes P for that object (a stateless one models any P). Hierarchical
    reducers take their topology as they do for real calls (options, or ``LOCAL_WORLD_SIZE``), and ``P`` must
    be its size. A configuration whose result cannot be modelled
    exactly raises ValueError saying why, before any state changes.
    """

    def model(self, rows: torch.Tensor, *, average: bool, key: int = 0) -> torch.Tensor: ...


def after_work(work: Any, then: Callable[[], None] | None = None, *, keep: Any = None) -> PendingReduction:
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
    """Check a reducer's bucket (see :class:`GradReducer`'s contract); returns the group size.

    TypeError: not a tensor, or not fp16/bf16/fp32; a group that is not a ProcessGroup. ValueError: not 1-D
    contiguous, or a length that is not a multiple of ``lcm(world_size, 128)``.
    """
    check_tensor("bucket", bucket, WIRE_DTYPES)
    if bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(f"bucket must be a 1-D contiguous tensor; got shape {tuple(bucket.shape)}")
    check_group("group", group)
    world_size = dist.get_world_size(group)
    multiple = bucket_multiple(world_size)
    if bucket.numel() % multiple:
        raise ValueError(
            f"bucket length {bucket.numel()} is not a multiple of lcm(world_size={world_size}, "
            f"{BUCKET_ALIGNMENT}) = {multiple}"
        )
    return world_size


def check_model_rows(rows: torch.Tensor, key: int) -> tuple[int, int]:
    """Check :meth:`GradReducer.model`'s arguments; returns (P, n). TypeError: not a tensor of a wire dtype;
    ValueError: not [P, n] with rows contiguous, n not a multiple of ``lcm(P, 128)``, or a bad key."""
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(f"key must be an int >= 0; got {key!r}")
    world, n = check_rows(rows)
    multiple = bucket_multiple(world)
    if n % multiple:
        raise ValueError(
            f"rows hold buckets of {n} elements, not a multiple of lcm(P={world}, {BUCKET_ALIGNMENT}) = {multiple}"
        )
    return world, n


def check_shard_out(shard_out: torch.Tensor, bucket: torch.Tensor, world_size: int) -> None:
    """Check a reduce-scatter's output: dtype ``bucket.dtype`` or fp32 (TypeError), contiguous with
    ``len(bucket) / world_size`` elements (ValueError)."""
    check_tensor("shard_out", shard_out, (bucket.dtype, torch.float32))
    if shard_out.numel() != bucket.numel() // world_size or not shard_out.is_contiguous():
        raise ValueError(
            f"shard_out must be contiguous with len(bucket) / world_size = {bucket.numel() // world_size} "
            f"elements; got {shard_out.numel()}"
        )


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[..., GradReducer]] = {}


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
    rounding="stochastic")``). ``mixprec.parallel`` registers ``"native"`` and ``"fp32_accumulate"``,
    ``mixprec.compress`` the compressed ones; importing ``mixprec`` imports both.

    Option names are checked against the factory's signature (TypeError naming the option); errors the
    factory itself raises pass through unchanged.
    """
    if not isinstance(name, str):
        raise TypeError(f"reducer name must be a str; got {type(name).__name__}")
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown reducer {name!r}; registered reducers: {', '.join(registered_reducers())}")
    signature = inspect.signature(factory)
    try:
        signature.bind(**options)  # only a mismatch of option names is re-worded here
    except TypeError as exc:
        raise TypeError(f"reducer {name!r} rejected its options {sorted(options)}: {exc}") from None
    reducer = factory(**options)
    if not isinstance(reducer, GradReducer):
        why = (
            " (it has no model method: a registered reducer models itself)"
            if isinstance(reducer, BucketReducer)
            else ""
        )
        raise TypeError(f"the factory registered as {name!r} returned {type(reducer).__name__}, not a GradReducer{why}")
    return reducer
