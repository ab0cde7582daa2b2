"""Where each parameter's gradient lives: flat buffers split into padded buckets (pure layout, no I/O).

Parameters are grouped by (parameter dtype, gradient dtype); each group owns one contiguous flat buffer,
cut into buckets of at most ``bucket_size`` elements of parameters (a larger parameter gets a bucket of
its own). Parameters are taken in reverse registration order, which approximates the order in which
backward produces their gradients, so the first bucket fills first. Each bucket's length is padded up to
a multiple of ``lcm(world_size, 128)``: it splits into ``world_size`` equal shards, each a whole number of
128-element blocks. The padding is zero and belongs to no parameter.

Bucket ``k`` is reduced as one collective; rank r owns elements ``[r*S, (r+1)*S)`` of it in the sharded
optimizer (``S = bucket length / world_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mixprec.comm.padding import round_up
from mixprec.comm.reducer import bucket_multiple
from mixprec.core.validate import check_positive_int

__all__ = ["DEFAULT_BUCKET_SIZE", "Bucket", "BucketLayout", "ParamSlot", "ShardPiece", "build_layout"]

# Parameter elements per bucket of DistributedDataParallel (Megatron-LM's default, 40M).
DEFAULT_BUCKET_SIZE = 40_000_000


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place: ``buffer[bucket.offset + start : ... + numel]`` of its group's flat buffer."""

    index: int  # position in the layout's parameter list
    name: str
    shape: torch.Size
    bucket: int
    start: int  # offset within the bucket, elements
    numel: int


@dataclass
class Bucket:
    """A contiguous slice of one group's flat buffer, reduced as one collective."""

    index: int
    group: int  # index into BucketLayout.groups
    offset: int  # start within the group's flat buffer, elements
    numel: int  # padded length, a multiple of lcm(world_size, 128)
    slots: list[ParamSlot] = field(default_factory=list)
    # Elements that belong to parameters (the rest is padding): a running total, kept by build_layout as it
    # adds slots, so that building a layout is linear in the number of parameters.
    used: int = 0

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """[start, stop) of rank's shard, relative to the bucket."""
        size = self.numel // world_size
        return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls in one rank's shard of one bucket.

    ``param_start:param_stop`` indexes the flattened parameter; ``shard_offset`` is where the piece starts
    within the rank's shard of the bucket.
    """

    slot: ParamSlot
    param_start: int
    param_stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


@dataclass
class BucketLayout:
    """Buckets, slots and per-group buffer sizes for one set of parameters."""

    world_size: int
    groups: list[tuple[torch.dtype, torch.dtype]]  # (param dtype, grad dtype) of each flat buffer
    group_numel: list[int]
    buckets: list[Bucket]
    slots: list[ParamSlot]

    def pieces(self, bucket: Bucket, rank: int) -> list[ShardPiece]:
        """The parameter pieces in rank's shard of ``bucket``, in buffer order."""
        lo, hi = bucket.shard_range(rank, self.world_size)
        out = []
        for slot in bucket.slots:
            start, stop = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if start < stop:
                out.append(ShardPiece(slot, start - slot.start, stop - slot.start, start - lo))
        return out


def build_layout(
    named_params: list[tuple[str, torch.Tensor]],
    *,
    world_size: int,
    bucket_size: int,
    grad_dtype: torch.dtype | None,
) -> BucketLayout:
    """Assign ``named_params`` (in registration order) to buckets; see the module docstring.

    Args:
        named_params: (name, parameter) pairs, each parameter once.
        world_size: ranks in the data-parallel group, >= 1.
        bucket_size: elements of parameters per bucket, >= 1 (before padding).
        grad_dtype: dtype of the gradient buffers (and the wire); None = each parameter's own dtype.
    """
    check_positive_int("world_size", world_size)
    check_positive_int("bucket_size", bucket_size)
    multiple = bucket_multiple(world_size)
    groups: list[tuple[torch.dtype, torch.dtype]] = []
    group_numel: list[int] = []
    buckets: list[Bucket] = []
    open_bucket: dict[int, Bucket] = {}
    slots: list[ParamSlot | None] = [None] * len(named_params)

    def close(bucket: Bucket) -> None:
        bucket.numel = max(multiple, round_up(bucket.used, multiple))
        group_numel[bucket.group] += bucket.numel

    for index in reversed(range(len(named_params))):
        name, param = named_params[index]
        key = (param.dtype, grad_dtype or param.dtype)
        if key not in groups:
            groups.append(key)
            group_numel.append(0)
        g = groups.index(key)
        numel = param.numel()
        bucket = open_bucket.get(g)
        if bucket is not None and bucket.used + numel > bucket_size and bucket.slots:
            close(bucket)
            bucket = None
        if bucket is None:
            bucket = Bucket(index=len(buckets), group=g, offset=group_numel[g], numel=0)
            buckets.append(bucket)
            open_bucket[g] = bucket
        slot = ParamSlot(index, name, param.shape, bucket.index, bucket.used, numel)
        bucket.slots.append(slot)
        bucket.used += numel
        slots[index] = slot
    for bucket in open_bucket.values():
        close(bucket)
    return BucketLayout(world_size, groups, group_numel, buckets, [s for s in slots if s is not None])
