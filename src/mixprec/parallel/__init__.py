"""Data parallelism: gradient reducers, the bucketed wrapper and the sharded optimizer."""

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

__all__ = [
    "BUCKET_ALIGNMENT",
    "FP32AccumulateReducer",
    "GradReducer",
    "NativeReducer",
    "ReductionHandle",
    "bucket_multiple",
    "make_reducer",
    "register_reducer",
    "registered_reducers",
]
