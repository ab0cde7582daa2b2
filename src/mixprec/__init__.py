"""mixprec: numerically robust low-precision training for PyTorch.

Subpackages, one per concern: ``scaling`` (loss scaling, master weights, the advisor), ``comm``
(fp32-accumulating collectives), ``parallel`` (bucketed data parallel, sharded optimizer),
``compress`` (8-bit gradient compression), ``emulate`` (bit-exact rounding, modelled matmuls),
``lab`` (training and studies), ``cli``.
"""

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

__all__ = [
    "Advice",
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
