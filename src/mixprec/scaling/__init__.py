"""Loss scaling (and scalers that reproduce torch, DeepSpeed, Megatron-LM and NNabla), fp32 master weights,
gradient accumulation, skip-aware LR scheduling and the loss-scale advisor."""

from mixprec.scaling.advisor import Advice, Finding, advise, rescale_for_dp
from mixprec.scaling.frameworks import scaler_from
from mixprec.scaling.grad_range import GradientStats, GradRangeReport, grad_range_by_layer, grad_range_report
from mixprec.scaling.master import MasterWeightOptimizer, clip_grad_norm_, grad_norm
from mixprec.scaling.scaler import DynamicLossScaler, LossScaleFloorError, LossScaler, StaticLossScaler
from mixprec.scaling.skips import SkipAwareLR
from mixprec.scaling.updater import Updater, UpdateResult

__all__ = [
    "Advice",
    "DynamicLossScaler",
    "Finding",
    "GradRangeReport",
    "GradientStats",
    "LossScaleFloorError",
    "LossScaler",
    "MasterWeightOptimizer",
    "SkipAwareLR",
    "StaticLossScaler",
    "UpdateResult",
    "Updater",
    "advise",
    "clip_grad_norm_",
    "grad_norm",
    "grad_range_by_layer",
    "grad_range_report",
    "rescale_for_dp",
    "scaler_from",
]
