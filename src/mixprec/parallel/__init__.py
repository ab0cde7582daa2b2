"""Data parallelism: gradient reducers, the bucketed wrapper, the sharded optimizer and DDP hooks."""

from mixprec.parallel.buckets import Bucket, BucketLayout, ParamSlot, ShardPiece, build_layout
from mixprec.parallel.ddp import DistributedDataParallel, NonFiniteBucket, NonFiniteGradientWarning
from mixprec.parallel.reducers import (
    BUCKET_ALIGNMENT,
    FP32AccumulateReducer,
    GradReducer,
    NativeReducer,
    ReductionHandle,
    bucket_multiple,
    make_reducer,
    register_reducer,
    registered_reducers,
)
from mixprec.parallel.zero import CHECKPOINT_FORMAT, ShardedOptimizer

__all__ = [
    "BUCKET_ALIGNMENT",
    "CHECKPOINT_FORMAT",
    "Bucket",
    "BucketLayout",
    "DistributedDataParallel",
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
    "make_reducer",
    "register_reducer",
    "registered_reducers",
]
