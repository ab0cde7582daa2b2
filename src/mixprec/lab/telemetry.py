"""Headroom telemetry of ``mixprec train``: per layer, where the gradients land in fp16 at the loss scale in use.

Every ``training.headroom_interval`` steps (steps N, 2N, ...; 0 = off) rank 0 classifies its gradients with
:func:`mixprec.scaling.grad_range_by_layer` right after the backward (with several ranks: after the wrapper's
reduction, which averages them), before they are unscaled or clipped: they hold ``g * scale`` as the backward
formed them, so the fractions are those of this step's scale. That step's row in ``metrics.jsonl`` gets
``"headroom": {layer: {"zero", "underflow", "subnormal", "overflow", "nonfinite"}}``: fractions of the
layer's elements (finite: strict JSON). In an fp16 run the gradients were already rounded to fp16, so values
that underflowed count as ``zero``; fp32 and bf16 runs show what fp16 would do at that scale.

It only reads the gradients (through the Updater's ``grad_reduce`` hook, unused by the lab otherwise), so a run
with telemetry is bit for bit the run without. ``mixprec report`` plots and summarises the rows.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.scaling import GradRangeReport, Updater, grad_range_by_layer

__all__ = ["HEADROOM_KEY", "HEADROOM_FIELDS", "HeadroomProbe", "headroom_entry"]

HEADROOM_KEY = "headroom"
HEADROOM_FIELDS = ("zero", "underflow", "subnormal", "overflow", "nonfinite")


def headroom_entry(report: GradRangeReport) -> dict[str, float]:
    """The fractions of one layer's report that a metrics row keeps."""
    return {name: float(getattr(report, name)) for name in HEADROOM_FIELDS}


class HeadroomProbe:
    """Captures per-layer fp16 headroom of ``module``'s gradients during the steps it is armed for.

    Args:
        module: the bare model (its parameter names, without a data-parallel wrapper's prefix, name the layers).
        interval: steps between two captures, from step ``interval`` on; 0 never captures.
    """

    def __init__(self, module: torch.nn.Module, interval: int) -> None:
        self.module = module
        self.interval = interval
        self.captured: dict[str, dict[str, float]] | None = None

    def due(self, step: int) -> bool:
        return bool(self.interval) and step > 0 and step % self.interval == 0

    def step(self, updater: Updater, step: int, microbatches: Any) -> Any:
        """``updater.step(microbatches)``, capturing the headroom when ``step`` is due (see :attr:`captured`)."""
        self.captured = None
        if not self.due(step):
            return updater.step(microbatches)
        if updater.grad_reduce is not None:
            raise RuntimeError("headroom telemetry needs the Updater's grad_reduce hook, which is already in use")
        updater.grad_reduce = self._capture
        try:
            return updater.step(microbatches)
        finally:
            updater.grad_reduce = None

    def capture(self) -> None:
        """Classify the module's gradients now, as :meth:`step` does inside the Updater (they must hold
        ``g * scale``, after any reduction): simulated data parallelism calls it after publishing the reduced
        gradients."""
        self._capture([])

    @torch.no_grad()
    def _capture(self, grads: list[torch.Tensor]) -> None:
        del grads  # the module's named parameters carry the same gradients, with their names
        # The gradients hold g * scale already: classify them at scale 1.
        reports = grad_range_by_layer(self.module, 1.0, torch.float16)
        self.captured = {layer: headroom_entry(report) for layer, report in reports.items()}
