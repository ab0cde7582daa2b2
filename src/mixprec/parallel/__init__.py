"""Data parallelism: the bucketed wrapper, the ZeRO-1 sharded optimizer and the built-in reducers.

* :class:`DistributedDataParallel`: gradients in contiguous buckets, each reduced (``reduce="native"``,
  ``"fp32_accumulate"``, a compressed reducer, or any :class:`mixprec.comm.GradReducer`) as soon as
  backward has produced it.
* :class:`GradBuffer`: the wrapper's flat gradient storage, bucket layout, shards and reduction state.
* :class:`ShardedOptimizer`: fp32 master shards per rank (ZeRO-1), built by ``make_optimizer``.
* :class:`NativeReducer`, :class:`FP32AccumulateReducer`: the reducers registered as ``"native"`` and
  ``"fp32_accumulate"``.

Hooks for torch's own DDP and FSDP2 are in :mod:`mixprec.hooks` and :mod:`mixprec.fsdp`.
"""

from mixprec.parallel.buffer import GradBuffer
from mixprec.parallel.ddp import DistributedDataParallel, NonFiniteBucket, NonFiniteGradientWarning
from mixprec.parallel.reducers import FP32AccumulateReducer, NativeReducer
from mixprec.parallel.zero import ShardedOptimizer

__all__ = [
    "DistributedDataParallel",
    "FP32AccumulateReducer",
    "GradBuffer",
    "NativeReducer",
    "NonFiniteBucket",
    "NonFiniteGradientWarning",
    "ShardedOptimizer",
]
