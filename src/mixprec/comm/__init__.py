"""Collectives with low-precision wire formats and fp32 accumulation."""

from mixprec.comm.agree import agree_any, collective_device, is_distributed
from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.comm.handles import PendingReduction, wait_all
from mixprec.comm.memory import measure_peak_allocated
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED, rank_generator
from mixprec.core.stochastic import round_into_, stochastic_round

__all__ = [
    "DEFAULT_STOCHASTIC_SEED",
    "PendingReduction",
    "agree_any",
    "all_reduce_fp32_accumulate",
    "collective_device",
    "is_distributed",
    "measure_peak_allocated",
    "rank_generator",
    "reduce_scatter_fp32_accumulate",
    "round_into_",
    "stochastic_round",
    "wait_all",
]
