"""mixprec: numerically robust low-precision training for PyTorch.

Subpackages, one per concern: ``scaling`` (loss scaling, master weights, the advisor), ``comm``
(fp32-accumulating collectives), ``parallel`` (bucketed data parallel, sharded optimizer),
``compress`` (8-bit gradient compression), ``emulate`` (bit-exact rounding, modelled matmuls),
``lab`` (training and studies), ``cli``.
"""

import importlib
from typing import Any

from mixprec.comm import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.compress import (
    CompressionStats,
    ErrorFeedback,
    MinMaxUInt8,
    Topology,
    Uint8Options,
    compressed_all_reduce,
    compressed_reduce_scatter,
)
from mixprec.emulate import (
    EmulatedLinear,
    FloatFormat,
    MatmulModel,
    bounds,
    emulate_linear_layers,
    matmul,
    round_to,
    round_to_,
)
from mixprec.kernels import two_stage_matmul
from mixprec.parallel import (
    DistributedDataParallel,
    GradReducer,
    NonFiniteGradientWarning,
    ShardedOptimizer,
    make_reducer,
    register_reducer,
)
from mixprec.scaling import (
    Advice,
    DynamicLossScaler,
    Finding,
    GradientStats,
    GradRangeReport,
    LossScaleFloorError,
    LossScaler,
    MasterWeightOptimizer,
    StaticLossScaler,
    Updater,
    UpdateResult,
    advise,
    clip_grad_norm_,
    grad_norm,
    grad_range_report,
    rescale_for_dp,
)

__version__ = "0.1.0"

# ``mixprec.hooks`` and ``mixprec.fsdp`` import torch's DDP/FSDP machinery (about a second): load on first use.
_LAZY_SUBMODULES = ("fsdp", "hooks")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"mixprec.{name}")
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")


__all__ = [
    "Advice",
    "CompressionStats",
    "DistributedDataParallel",
    "EmulatedLinear",
    "ErrorFeedback",
    "FloatFormat",
    "GradReducer",
    "MatmulModel",
    "MinMaxUInt8",
    "NonFiniteGradientWarning",
    "ShardedOptimizer",
    "Topology",
    "Uint8Options",
    "all_reduce_fp32_accumulate",
    "bounds",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "emulate_linear_layers",
    "fsdp",
    "hooks",
    "make_reducer",
    "matmul",
    "reduce_scatter_fp32_accumulate",
    "register_reducer",
    "round_to",
    "round_to_",
    "two_stage_matmul",
    "DynamicLossScaler",
    "Finding",
    "GradRangeReport",
    "GradientStats",
    "LossScaleFloorError",
    "LossScaler",
    "MasterWeightOptimizer",
    "StaticLossScaler",
    "UpdateResult",
    "Updater",
    "__version__",
    "advise",
    "clip_grad_norm_",
    "grad_norm",
    "grad_range_report",
    "rescale_for_dp",
]
