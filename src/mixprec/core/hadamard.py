"""The random Hadamard transform of the NVFP4 training recipe (arXiv 2509.25149).

Before a weight-gradient GEMM the recipe multiplies both inputs, in blocks of 16 along the reduction axis, by
``Q = H diag(s) / sqrt(16)``: ``H`` the Sylvester Hadamard matrix and ``s`` a seeded vector of random signs. ``Q`` is
orthogonal, so ``(Q a)^T (Q b) = a^T b`` in exact arithmetic, while outliers spread over their block and the
block scales of the 4-bit elements waste less range. :func:`hadamard_transform` applies ``Q`` (or ``Q^T`` with
``inverse=True``); :func:`random_signs` draws ``s`` from a generator so that both operands and the inverse use
the same transform. Used by :mod:`mixprec.emulate.recipes`; re-exported by :mod:`mixprec.core.mx` and
:mod:`mixprec.emulate`. Derivation and where the recipe applies it: ``docs/mx.md``.
"""

from __future__ import annotations

import math

import torch

from mixprec.core.validate import check_positive_int, check_tensor

__all__ = ["hadamard_matrix", "hadamard_transform", "random_signs"]


def hadamard_matrix(n: int = 16, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two), entries +-1, unnormalised."""
    check_positive_int("n", n)
    if n & (n - 1):
        raise ValueError(f"n must be a power of two; got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_signs(n: int = 16, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` independent random signs (fp32 +-1) from ``generator``: the diagonal of the random Hadamard
    transform. Seed the generator to rebuild the same transform for its inverse."""
    check_positive_int("n", n)
    return torch.randint(0, 2, (n,), generator=generator).mul_(2).sub_(1).to(torch.float32)


def hadamard_transform(
    x: torch.Tensor, signs: torch.Tensor | None = None, *, axis: int = -1, inverse: bool = False
) -> torch.Tensor:
    """Random Hadamard transform of ``x`` in blocks of ``n = len(signs)`` (default 16, no signs) along ``axis``.

    Each block ``v`` becomes ``Q v`` with ``Q = H diag(signs) / sqrt(n)`` (orthogonal); ``inverse=True`` applies
    ``Q^T``, undoing it. Computed in ``x``'s dtype (fp32 or fp64): exact up to one matmul's rounding.
    """
    check_tensor("x", x, (torch.float32, torch.float64))
    if signs is None:
        signs = torch.ones(16, dtype=x.dtype, device=x.device)
    check_tensor("signs", signs)
    if signs.dim() != 1 or not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError("signs must be a 1-D tensor of +-1 (see random_signs)")
    n = signs.numel()
    if not isinstance(axis, int) or isinstance(axis, bool) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis!r} is out of range for x with {x.dim()} dimensions")
    if x.shape[axis] % n:
        raise ValueError(f"the Hadamard size {n} does not divide dimension {axis} of x (shape {tuple(x.shape)})")
    q = hadamard_matrix(n, dtype=torch.float64) * signs.to(torch.float64) / math.sqrt(n)  # Q = H D / sqrt(n)
    q = q.to(x.dtype).to(x.device)
    t = x.movedim(axis, -1)
    blocks = t.reshape(*t.shape[:-1], -1, n)
    # row vectors: Q v is v @ Q^T, Q^T y is y @ Q
    out = blocks @ (q if inverse else q.T)
    return out.reshape(t.shape).movedim(-1, axis)
