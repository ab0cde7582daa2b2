"""Where would gradients land in fp16 (or bf16) at a given loss scale: zero, subnormal, normal, or inf?

Two entry points (and :func:`grad_range_by_layer`, the first one per layer):

* :func:`grad_range_report` on the gradients themselves: exact for the model it states, because it forms
  ``g * scale`` in fp32 (as a backward computed in fp32 would) and rounds that with torch's own cast (round to
  nearest even). For a power-of-two scale the fp32 product is exact, so this is the rounding of the exact
  ``g * scale``; for other scales the fp32 product is itself rounded first (a double rounding that can move a
  value lying within an fp32 ulp of a boundary).
* :class:`GradientStats` + :meth:`GradientStats.report`: a log2-magnitude histogram that can be
  collected cheaply during training (or on another machine) and evaluated at any scale later. A bin
  covers one binade [2**e, 2**(e+1)); it is classified by where the scaled binade lies, and a binade
  that straddles a boundary is split by the fraction of its log2 range on each side, so the answer is
  approximate within one binade of each boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from mixprec.core.dtypes import LOW_PRECISION_DTYPES
from mixprec.core.validate import check_choice, check_dtype, check_positive_float

__all__ = ["GradRangeReport", "GradientStats", "grad_range_by_layer", "grad_range_report"]

_CHUNK = 1 << 22  # elements per cast; bounds the temporary memory at 4M * (4 + 2) bytes


@dataclass(frozen=True)
class GradRangeReport:
    """Fractions of all gradient elements (each in [0, 1]; they sum to 1).

    Attributes:
        zero: exactly zero before scaling.
        underflow: non-zero, but ``g * scale`` rounds to zero in ``dtype`` (lost).
        subnormal: ``g * scale`` lands in ``dtype``'s subnormal range (fewer significant bits).
        normal: lands in the normal range.
        overflow: finite, but ``g * scale`` rounds to +-inf (the step will be skipped).
        nonfinite: already inf/NaN before scaling.
    """

    dtype: torch.dtype
    scale: float
    count: int
    zero: float
    underflow: float
    subnormal: float
    normal: float
    overflow: float
    nonfinite: float

    def format(self) -> str:
        rows = [
            ("zero before scaling", self.zero),
            ("underflow to zero", self.underflow),
            ("subnormal", self.subnormal),
            ("normal", self.normal),
            ("overflow to inf", self.overflow),
            ("inf/NaN already", self.nonfinite),
        ]
        head = f"{self.count} gradient elements, scale {self.scale:g}, target {self.dtype}"
        return "\n".join([head, *(f"  {name:<20} {100 * v:9.4f} %" for name, v in rows)])


def grad_range_report(
    grads: Iterable[torch.Tensor], scale: float, dtype: torch.dtype = torch.float16
) -> GradRangeReport:
    """Classify every element of ``grads`` (any float dtype) after multiplying by ``scale`` and rounding
    to ``dtype`` (fp16 or bf16). The product is formed in fp32 (exact for power-of-two scales), then rounded
    once to ``dtype`` by torch's cast; see the module docstring."""
    check_positive_float("scale", scale)
    check_dtype("dtype", dtype, LOW_PRECISION_DTYPES)
    tiny = torch.finfo(dtype).tiny
    counts = dict(nonfinite=0, zero=0, underflow=0, subnormal=0, overflow=0, normal=0)
    total = 0
    for g in grads:
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError("grads must be floating-point tensors")
        flat = g.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            x = flat[start : start + _CHUNK].float()
            finite = torch.isfinite(x)
            y = (x * scale).to(dtype)
            ay = y.abs()
            nz = x != 0
            masks = (
                ~finite,
                ~nz,
                nz & (y == 0),
                (ay > 0) & (ay < tiny),
                finite & torch.isinf(y),
                torch.isfinite(y) & (ay >= tiny),
            )
            # one host sync per chunk for all six counts
            for key, n in zip(counts, torch.stack([m.sum() for m in masks]).tolist(), strict=True):
                counts[key] += int(n)
            total += x.numel()
    denom = max(total, 1)
    return GradRangeReport(dtype, float(scale), total, **{k: v / denom for k, v in counts.items()})


def grad_range_by_layer(
    named: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
    scale: float,
    dtype: torch.dtype = torch.float16,
    *,
    per: Literal["module", "parameter"] = "module",
) -> dict[str, GradRangeReport]:
    """:func:`grad_range_report` of the gradients of each layer: ``{module path: report}`` (or one entry per
    parameter with ``per="parameter"``), in the order the parameters come. Parameters without a gradient are left
    out. ``named`` is a module (its ``named_parameters()``) or ``(name, parameter)`` pairs. For headroom
    telemetry: which layer's gradients are about to underflow or overflow at the current scale."""
    check_choice("per", per, ("module", "parameter"))
    if isinstance(named, torch.nn.Module):
        pairs: Iterable[tuple[str, torch.Tensor]] = named.named_parameters()
    elif isinstance(named, Iterable) and not isinstance(named, str | torch.Tensor):
        pairs = named
    else:
        raise TypeError(f"named must be an nn.Module or (name, parameter) pairs; got {type(named).__name__}")
    groups: dict[str, list[torch.Tensor]] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"named must hold (name, parameter) pairs; got {item!r:.80}")
        name, p = item
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"named must hold (name, parameter) pairs; {name!r} is a {type(p).__name__}")
        if p.grad is None:
            continue
        key = (name.rpartition(".")[0] or name) if per == "module" else name
        groups.setdefault(key, []).append(p.grad)
    return {key: grad_range_report(grads, scale, dtype) for key, grads in groups.items()}


@dataclass
class GradientStats:
    """A histogram of gradient magnitudes by binary exponent, mergeable across steps and ranks.

    ``bins[e]`` counts finite non-zero elements with 2**e <= |g| < 2**(e+1).
    """

    bins: dict[int, int] = field(default_factory=dict)
    zeros: int = 0
    nonfinite: int = 0

    @classmethod
    def from_tensors(cls, grads: Iterable[torch.Tensor]) -> GradientStats:
        stats = cls()
        stats.add(grads)
        return stats

    def add(self, grads: Iterable[torch.Tensor]) -> None:
        for g in grads:
            x = g.detach().reshape(-1).double()  # fp64: exact exponents for every fp32/fp16/bf16 value
            finite = torch.isfinite(x)
            self.nonfinite += int((~finite).sum())
            nz = finite & (x != 0)
            self.zeros += int((finite & (x == 0)).sum())
            _, exp = torch.frexp(x[nz])  # |x| = m * 2**exp with m in [0.5, 1)
            values, counts = torch.unique(exp - 1, return_counts=True)
            for e, c in zip(values.tolist(), counts.tolist(), strict=True):
                self.bins[e] = self.bins.get(e, 0) + c

    def merge(self, other: GradientStats) -> GradientStats:
        out = GradientStats(dict(self.bins), self.zeros + other.zeros, self.nonfinite + other.nonfinite)
        for e, c in other.bins.items():
            out.bins[e] = out.bins.get(e, 0) + c
        return out

    def report(self, scale: float, dtype: torch.dtype = torch.float16) -> GradRangeReport:
        """Approximate classification at ``scale`` (see the module docstring for the error)."""
        check_positive_float("scale", scale)
        check_dtype("dtype", dtype, LOW_PRECISION_DTYPES)
        fi = torch.finfo(dtype)
        log_tiny = math.log2(fi.tiny)
        log_sub = log_tiny - _mantissa_bits(dtype)  # smallest subnormal
        # Round-to-nearest: values below half the smallest subnormal vanish, values at or above
        # max + half an ulp become inf.
        log_zero = log_sub - 1
        log_inf = math.log2(fi.max + 2.0 ** (math.floor(math.log2(fi.max)) - _mantissa_bits(dtype) - 1))
        shift = math.log2(scale)
        counts = dict(underflow=0.0, subnormal=0.0, normal=0.0, overflow=0.0)
        for e, c in self.bins.items():
            lo, hi = e + shift, e + 1 + shift
            for name, a, b in (
                ("underflow", -math.inf, log_zero),
                ("subnormal", log_zero, log_tiny),
                ("normal", log_tiny, log_inf),
                ("overflow", log_inf, math.inf),
            ):
                overlap = max(0.0, min(hi, b) - max(lo, a))
                counts[name] += c * overlap
        total = sum(self.bins.values()) + self.zeros + self.nonfinite
        denom = max(total, 1)
        return GradRangeReport(
            dtype,
            float(scale),
            total,
            zero=self.zeros / denom,
            nonfinite=self.nonfinite / denom,
            **{k: v / denom for k, v in counts.items()},
        )


def _mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.float16: 10, torch.bfloat16: 7}[dtype]
