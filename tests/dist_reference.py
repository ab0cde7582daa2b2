"""Independent references for the gradient-reduction tests (comm, parallel, hooks, fsdp).

The fp32-accumulating collectives must equal, bit for bit, "sum the ranks' inputs in fp32, in rank order,
then divide (or scale) in fp32, then round once". That rule is written here with numpy float32 (one IEEE
rounding per addition, nothing shared with mixprec's code), once, for every test that checks it.

Unit roundoffs and gamma_n (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1):
any order of summing n + 1 terms in a precision with unit roundoff u has absolute error at most
``gamma_n * sum |x_i|`` with ``gamma_n = n u / (1 - n u)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

U32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-11  # fp16
UBF16 = 2.0**-8  # bf16
UNIT_ROUNDOFF = {torch.float32: U32, torch.float16: U16, torch.bfloat16: UBF16}


def gamma(n: int, u: float = U32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n roundings in a row (needs n u < 1)."""
    if n * u >= 1:
        raise ValueError(f"gamma_n needs n u < 1; got n = {n}, u = {u}")
    return n * u / (1 - n * u)


def gradient_like(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over several binades (normal times lognormal), so that low-precision sums round often."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))
    return x.to(dtype)


def fp32_rank_order_sum(
    per_rank: Sequence[torch.Tensor], *, average: bool = False, factor: float | None = None
) -> torch.Tensor:
    """``(sum_r x_r) (/ P) (* factor)`` in fp32: the ranks' tensors widened exactly to fp32, added in rank
    order with numpy float32, then one fp32 division by P and/or one fp32 multiplication. Returns an fp32
    tensor of the first tensor's shape; round it once (``.to(dtype)``) for a low-precision result."""
    shape = per_rank[0].shape
    acc = np.zeros(per_rank[0].numel(), dtype=np.float32)
    for x in per_rank:
        acc = acc + x.detach().float().numpy().reshape(-1)
    if average:
        acc = acc / np.float32(len(per_rank))
    if factor is not None:
        acc = acc * np.float32(factor)
    return torch.from_numpy(acc).reshape(shape)


def fp32_mean_rounded(per_rank: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What an fp32-accumulating average of ``per_rank`` (each already in the wire dtype) must give in
    ``dtype``: the rank-order fp32 mean, rounded once to nearest."""
    return fp32_rank_order_sum(per_rank, average=True).to(dtype)


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(toward-zero, away-from-zero) neighbours of fp32 ``x`` in ``dtype``, from torch's cast and nextafter;
    both equal ``x`` where it is representable. Stochastic rounding must return one of the two."""
    nearest = x.to(dtype)
    zero = torch.zeros_like(nearest)
    overshoot = nearest.float().abs() > x.abs()
    toward = torch.where(overshoot, torch.nextafter(nearest, zero), nearest)
    away_dir = torch.where(x < 0, torch.full_like(nearest, -math.inf), torch.full_like(nearest, math.inf))
    exact = toward.float() == x
    away = torch.where(exact, toward, torch.nextafter(toward, away_dir))
    return toward, away
