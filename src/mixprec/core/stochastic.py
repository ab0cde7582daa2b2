"""Rounding fp32 values to fp16/bf16: to nearest (torch's cast) or stochastically (unbiased).

Stochastic rounding sends ``x`` to one of its two neighbours in the target format, ``lo <= x <= hi``
(``lo``, ``hi`` adjacent representable values, ``lo = hi = x`` when ``x`` is representable), rounding up
with probability ``(x - lo) / (hi - lo)``. So ``E[round(x)] = x``: summed over many steps, the rounding
errors cancel instead of drifting the way round-to-nearest's can when the same small residual recurs.

The stochastic rule itself is :func:`mixprec.emulate.round_to`'s (exact float64 work, 53-bit uniform
draws from a seeded ``torch.Generator``, so the bias is below ``2**-53`` of a spacing; results beyond the
target's range overflow to +-inf as the nearest cast would; inf and NaN pass through). This module applies
it block by block and writes the target dtype directly, which is what the collectives need.

Extra memory: the work is done in blocks of ``_BLOCK`` elements, so the float64 temporaries stay at a few
MiB whatever the size of ``x``.
"""

from __future__ import annotations

import torch

from mixprec.core.dtypes import LOW_PRECISION_DTYPES, ROUNDINGS, Rounding
from mixprec.core.rounding import round_to
from mixprec.core.validate import check_choice, check_dtype

__all__ = ["round_into_", "stochastic_round"]

# 2**16 elements: round_to's float64 temporaries stay at a few MiB.
_BLOCK = 1 << 16


def _stochastic_block(out: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None) -> None:
    # round_to returns the rounded values in fp32; they are representable in out.dtype (or +-inf), so
    # the copy is exact.
    out.copy_(round_to(x, out.dtype, "stochastic", generator))


def stochastic_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round fp32 (or fp16/bf16) ``x`` to ``dtype`` in {float16, bfloat16} stochastically; unbiased.

    Args:
        x: floating-point tensor (any shape); values are read as they are (fp32 is the usual input).
        dtype: torch.float16 or torch.bfloat16.
        generator: the random stream (CPU generator for CPU tensors); None uses torch's default one.
            Seed it for reproducible results.
        out: optional destination of dtype ``dtype`` and x's shape; may not overlap ``x``.

    Returns:
        ``out`` (or a new tensor) holding, element by element, one of the two neighbours of ``x`` in ``dtype``.
    """
    check_dtype("dtype", dtype, LOW_PRECISION_DTYPES)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor; got {type(x).__name__}")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.dtype != dtype or out.shape != x.shape:
        raise ValueError(f"out must have dtype {dtype} and shape {tuple(x.shape)}; got {out.dtype} {tuple(out.shape)}")
    round_into_(out, x, rounding="stochastic", generator=generator)
    return out


def round_into_(
    out: torch.Tensor,
    src: torch.Tensor,
    *,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> None:
    """Write ``src`` into ``out`` (same shape), rounding to ``out.dtype``.

    ``rounding="nearest"`` is torch's cast (round to nearest, ties to even). ``"stochastic"`` needs a
    float16/bfloat16 ``out``; see the module docstring for the rule. ``out`` must not overlap ``src``.
    """
    check_choice("rounding", rounding, ROUNDINGS)
    if out.shape != src.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but src has {tuple(src.shape)}")
    if rounding == "nearest" or out.dtype == src.dtype:
        out.copy_(src)
        return
    check_dtype("out.dtype (for stochastic rounding)", out.dtype, LOW_PRECISION_DTYPES)
    flat_src = src.reshape(-1)
    if out.is_contiguous():
        flat_out = out.view(-1)
        for start in range(0, flat_src.numel(), _BLOCK):
            stop = min(start + _BLOCK, flat_src.numel())
            _stochastic_block(flat_out[start:stop], flat_src[start:stop], generator)
    else:
        rounded = torch.empty(flat_src.shape, dtype=out.dtype, device=out.device)
        for start in range(0, flat_src.numel(), _BLOCK):
            stop = min(start + _BLOCK, flat_src.numel())
            _stochastic_block(rounded[start:stop], flat_src[start:stop], generator)
        out.copy_(rounded.view(out.shape))
