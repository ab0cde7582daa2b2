"""Data parallelism: gradient reducers, the bucketed wrapper, the sharded optimizer and DDP hooks."""

from mixprec.comm.reducer import (
    BUCKET_ALIGNMENT,
    GradReducer,
    ReductionHandle,
    bucket_multiple,
    check_bucket,
    check_shard_out,
    make_reducer,
    register_reducer,
    registered_reducers,
)
from mixprec.parallel.buckets import Bucket, BucketLayout, ParamSlot, ShardPiece, build_layout
from mixprec.parallel.comm_hooks import fp32_accumulate_hook
from mixprec.parallel.ddp import DistributedDataParallel, NonFiniteBucket, NonFiniteGradientWarning
from mixprec.parallel.reducers import FP32AccumulateReducer, NativeReducer
from mixprec.parallel.zero import CHECKPOINT_FORMAT, ShardedOptimizer

__all__ = [
    "BUCKET_ALIGNMENT",
    "CHECKPOINT_FORMAT",
    "Bucket",
    "BucketLayout",
    "DistributedDataParallel",
    "FP32AccumulateReduceScatter",
    "FP32AccumulateReducer",
    "GradReducer",
    "NativeReducer",
    "NonFiniteBucket",
    "NonFiniteGradientWarning",
    "ParamSlot",
    "ReductionHandle",
    "ShardPiece",
    "ShardedOptimizer",
    "bucket_multiple",
    "build_layout",
    "check_bucket",
    "check_shard_out",
    "fp32_accumulate_hook",
    "make_reducer",
    "register_reducer",
    "registered_reducers",
    "use_fp32_accumulation",
]


def __getattr__(name: str) -> object:
    # The FSDP2 names import torch.distributed.fsdp (~0.7 s): load them on first use only.
    if name in ("FP32AccumulateReduceScatter", "use_fp32_accumulation"):
        from mixprec.parallel import fsdp2

        return getattr(fsdp2, name)
    raise AttributeError(f"module 'mixprec.parallel' has no attribute {name!r}")
