"""The loss-scale advisor: loss_scale vs num_microbatches vs data-parallel size, after the loss-scale rules for
gradient accumulation that practitioners use when matching an accelerator's loss curve to a GPU's.

With gradient accumulation each microbatch's loss is divided by ``num_microbatches`` and multiplied by
``loss_scale`` before backward::

    num_microbatches = GBS / (MBS * DP)
    backward loss    = loss' * loss_scale / num_microbatches = loss' * DP * loss_scale * MBS / GBS

so the factor that actually multiplies each microbatch's gradients is ``loss_scale / num_microbatches``.
It must be >= 1, or the "scaling" shrinks gradients towards fp16's underflow; it is best a power of two
(scaling by a power of two is exact in binary floating point). When DP grows N-fold with GBS and MBS
fixed, num_microbatches shrinks N-fold, so loss_scale must shrink N-fold to keep the factor, and the
loss the backward sees, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from mixprec.core.validate import check_positive_float, check_positive_int

__all__ = ["Advice", "Finding", "advise", "rescale_for_dp"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One observation. ``error`` and ``warning`` are broken rules; ``info`` is context."""

    severity: Severity
    code: str
    message: str


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found.

    Attributes:
        num_microbatches: GBS / (MBS * DP) when that divides, else None.
        effective_scale: loss_scale / num_microbatches, the multiplier each microbatch gradient sees.
        findings: every observation, broken rules first.
        suggested_loss_scale: the nearest loss_scale that satisfies every rule (a power-of-two multiple of
            num_microbatches, >= the requested factor), or None when no valid configuration exists.
    """

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    loss_scale: float
    num_microbatches: int | None
    effective_scale: float | None
    findings: list[Finding] = field(default_factory=list)
    suggested_loss_scale: float | None = None

    @property
    def ok(self) -> bool:
        """True when no rule is broken (only ``info`` findings)."""
        return all(f.severity == "info" for f in self.findings)

    def format(self) -> str:
        lines = [
            f"global_batch_size={self.global_batch_size} micro_batch_size={self.micro_batch_size} "
            f"data_parallel_size={self.data_parallel_size} loss_scale={self.loss_scale:g}",
        ]
        if self.num_microbatches is not None:
            lines.append(
                f"num_microbatches = GBS / (MBS x DP) = {self.num_microbatches}; "
                f"loss_scale / num_microbatches = {self.effective_scale:g}"
            )
        for f in self.findings:
            lines.append(f"[{f.severity}] {f.code}: {f.message}")
        if self.suggested_loss_scale is not None and not self.ok:
            lines.append(f"suggested loss_scale: {self.suggested_loss_scale:g}")
        lines.append("OK: consistent" if self.ok else "NOT OK: a rule is broken")
        return "\n".join(lines)


def _is_power_of_two(x: float) -> bool:
    if x <= 0 or not math.isfinite(x):
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5


def advise(global_batch_size: int, micro_batch_size: int, data_parallel_size: int, loss_scale: float) -> Advice:
    """Check a (GBS, MBS, DP, loss_scale) configuration against the gradient-accumulation loss-scale rules.

    Rules (each broken one is a finding with severity ``error`` or ``warning``):

    * ``gbs-not-divisible`` (error): GBS must be a multiple of MBS x DP.
    * ``scale-below-microbatches`` (error): loss_scale < num_microbatches makes the per-microbatch
      multiplier < 1, which shrinks gradients instead of protecting them from underflow.
    * ``scale-not-pow2-multiple`` (warning): loss_scale / num_microbatches should be a power of two
      (exact scaling, and the relation those practitioners found most stable).

    Raises:
        TypeError, ValueError: a size that is not a positive int, or a loss_scale that is not > 0.
    """
    gbs = check_positive_int("global_batch_size", global_batch_size)
    mbs = check_positive_int("micro_batch_size", micro_batch_size)
    dp = check_positive_int("data_parallel_size", data_parallel_size)
    ls = check_positive_float("loss_scale", loss_scale)
    findings: list[Finding] = []
    per_step = mbs * dp
    if gbs % per_step:
        lo = (gbs // per_step) * per_step
        hi = lo + per_step
        options = f"{lo} or {hi}" if lo else f"{hi}"
        findings.append(
            Finding(
                "error",
                "gbs-not-divisible",
                f"global_batch_size {gbs} is not a multiple of micro_batch_size x data_parallel_size = "
                f"{mbs} x {dp} = {per_step}; use e.g. global_batch_size {options}",
            )
        )
        return Advice(gbs, mbs, dp, ls, None, None, findings, None)
    nmb = gbs // per_step
    factor = ls / nmb
    if factor < 1:
        findings.append(
            Finding(
                "error",
                "scale-below-microbatches",
                f"loss_scale {ls:g} < num_microbatches {nmb}: each microbatch's gradient is multiplied by "
                f"{factor:g} < 1, i.e. shrunk towards fp16 underflow instead of lifted away from it",
            )
        )
    elif not _is_power_of_two(factor):
        findings.append(
            Finding(
                "warning",
                "scale-not-pow2-multiple",
                f"loss_scale / num_microbatches = {ls:g} / {nmb} = {factor:g} is not a power of two; "
                "use a power-of-two multiple (2x, 4x, 8x, ...) of num_microbatches",
            )
        )
    else:
        findings.append(
            Finding(
                "info",
                "per-microbatch-factor",
                f"each microbatch's gradient is scaled by loss_scale / num_microbatches = {factor:g}",
            )
        )
    suggested = nmb * 2.0 ** max(0, math.ceil(math.log2(factor))) if factor > 0 else float(nmb)
    return Advice(gbs, mbs, dp, ls, nmb, factor, findings, suggested)


def rescale_for_dp(loss_scale: float, old_dp: int, new_dp: int) -> float:
    """The loss_scale that keeps ``loss_scale / num_microbatches`` constant when DP goes old_dp -> new_dp.

    With GBS and MBS fixed, num_microbatches scales by old_dp / new_dp, so the loss scale does too:
    ``loss_scale * old_dp / new_dp`` (DP up N-fold -> loss_scale down N-fold). Computed in fp64; exact
    when the ratio is a power of two.
    """
    ls = check_positive_float("loss_scale", loss_scale)
    old = check_positive_int("old_dp", old_dp)
    new = check_positive_int("new_dp", new_dp)
    return ls * old / new
