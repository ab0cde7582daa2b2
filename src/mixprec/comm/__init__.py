"""Collectives with low-precision wire formats and fp32 accumulation, and the gradient-reducer protocol.

* :func:`reduce_scatter_fp32_accumulate` / :func:`all_reduce_fp32_accumulate`: bf16/fp16 on the wire, one
  fp32 sum per element in rank order, one rounding (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``);
  with ``topology=`` the two-stage multi-node scheme of :mod:`mixprec.comm.hierarchical_fp32`.
* :class:`PendingReduction` / :func:`wait_all`: the one handle type of every asynchronous collective here.
* :class:`GradReducer`, :func:`make_reducer`, :func:`register_reducer`: how a data-parallel wrapper reduces a
  bucket, and the registry of named reducers (``mixprec.parallel`` and ``mixprec.compress`` fill it).
* :class:`Topology`: nodes x ranks per node, for the hierarchical (two-stage) schemes here and in
  :mod:`mixprec.compress`.
* :func:`rank_generator`, :func:`stochastic_round`: per-rank random streams and unbiased rounding.
"""

from mixprec.comm.agree import agree_any, is_distributed
from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.comm.handles import PendingReduction, wait_all
from mixprec.comm.reducer import GradReducer, ReductionHandle, make_reducer, register_reducer, registered_reducers
from mixprec.comm.topology import Topology
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED, rank_generator
from mixprec.core.stochastic import stochastic_round

__all__ = [
    "DEFAULT_STOCHASTIC_SEED",
    "GradReducer",
    "PendingReduction",
    "ReductionHandle",
    "Topology",
    "agree_any",
    "all_reduce_fp32_accumulate",
    "is_distributed",
    "make_reducer",
    "rank_generator",
    "reduce_scatter_fp32_accumulate",
    "register_reducer",
    "registered_reducers",
    "stochastic_round",
    "wait_all",
]
