"""Rounding fp32 values to fp16/bf16: to nearest (torch's cast) or stochastically (unbiased).

Stochastic rounding sends ``x`` to one of its two neighbours in the target format, ``lo <= x <= hi``
(``lo``, ``hi`` adjacent representable values, ``lo = hi = x`` when ``x`` is representable), rounding up
with probability ``(x - lo) / (hi - lo)``. So ``E[round(x)] = x``: summed over many steps, the rounding
errors cancel instead of drifting the way round-to-nearest's can when the same small residual recurs.

How it is computed (float64, exact): ``e = floor(log2|x|)`` from ``frexp``; the target's spacing at ``x`` is
``ulp = 2**(max(e, emin) - p)`` (``p`` fraction bits: 10 for fp16, 7 for bf16; ``emin`` the smallest normal
exponent, so the subnormal range keeps the fixed spacing); ``y = x / ulp`` and ``frac = y - floor(y)`` are
exact in float64 for an fp32 ``x``; the result is ``(floor(y) + [u < frac]) * ulp`` with ``u`` uniform on
[0, 1) from a seeded ``torch.Generator`` (53-bit float64 draws), cast to the target exactly (or to +-inf when
it lies beyond the target's range, as the nearest cast would overflow). The bias is below ``2**-53`` ulp per
element (the resolution of ``u``), i.e. zero for all practical purposes. inf and NaN pass through unchanged.

Extra memory: the work is done in blocks of ``_BLOCK`` elements, so the float64 temporaries stay at a few
MiB whatever the size of ``x``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from mixprec._validate import check_choice, check_dtype

__all__ = ["Rounding", "round_into_", "stochastic_round"]

Rounding = Literal["nearest", "stochastic"]
_ROUNDINGS = ("nearest", "stochastic")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# 2**16 elements: the float64 temporaries (about six of them) stay around 3 MiB.
_BLOCK = 1 << 16


def _format_constants(dtype: torch.dtype) -> tuple[int, int]:
    """(fraction bits p, smallest normal exponent emin) of ``dtype``, from torch.finfo."""
    info = torch.finfo(dtype)
    return round(-math.log2(info.eps)), round(math.log2(info.tiny))


def _stochastic_block(out: torch.Tensor, x: torch.Tensor, generator: torch.Generator, p: int, emin: int) -> None:
    x64 = x.to(torch.float64)
    _, exponent = torch.frexp(x64)  # |x| = m * 2**exponent, m in [0.5, 1): floor(log2|x|) = exponent - 1
    ulp_exponent = torch.clamp_min(exponent - 1, emin) - p
    ulp = torch.ldexp(torch.ones_like(x64), ulp_exponent)
    y = x64 / ulp  # exact: division by a power of two
    lo = torch.floor(y)
    frac = y - lo  # exact, in [0, 1)
    u = torch.rand(x64.shape, generator=generator, dtype=torch.float64, device=x64.device)
    lo.add_((u < frac).to(torch.float64)).mul_(ulp)
    # copysign: a negative value that rounds to zero gives -0.0, as the nearest cast does (floor + 1
    # would give +0.0). inf/NaN: frac is NaN for them, so nothing is added; keep x explicitly anyway.
    result = torch.where(torch.isfinite(x64), torch.copysign(lo, x64), x64)
    out.copy_(result)


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
    check_dtype("dtype", dtype, _LOW_PRECISION)
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
    check_choice("rounding", rounding, _ROUNDINGS)
    if out.shape != src.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but src has {tuple(src.shape)}")
    if rounding == "nearest" or out.dtype == src.dtype:
        out.copy_(src)
        return
    check_dtype("out.dtype (for stochastic rounding)", out.dtype, _LOW_PRECISION)
    p, emin = _format_constants(out.dtype)
    flat_src = src.reshape(-1)
    if out.is_contiguous():
        flat_out = out.view(-1)
        for start in range(0, flat_src.numel(), _BLOCK):
            stop = min(start + _BLOCK, flat_src.numel())
            _stochastic_block(flat_out[start:stop], flat_src[start:stop], generator, p, emin)
    else:
        rounded = torch.empty(flat_src.shape, dtype=out.dtype, device=out.device)
        for start in range(0, flat_src.numel(), _BLOCK):
            stop = min(start + _BLOCK, flat_src.numel())
            _stochastic_block(rounded[start:stop], flat_src[start:stop], generator, p, emin)
        out.copy_(rounded.view(out.shape))
