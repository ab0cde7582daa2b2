"""Loss scalers with a ``torch.amp.GradScaler``-compatible API: dynamic (growth, backoff, hysteresis, floor,
ceiling, abort when stuck) and static. Typical loop::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                      # optional: only needed to clip
    scaler.step(optimizer)                           # skipped when any rank saw inf/NaN
    scaler.update()

The scalers' public names all import from here. Where each concern lives: ``base.py`` holds the machinery they
share (:class:`LossScaler`: scale, unscale, the overflow agreed across ranks, step or skip, its precision and
synchronisation rules), ``dynamic.py`` the dynamic rule (:class:`DynamicLossScaler`), this module the static one.
"""

from __future__ import annotations

import torch.distributed as dist

from mixprec.scaling.base import LossScaleFloorError, LossScaler
from mixprec.scaling.dynamic import DynamicLossScaler

__all__ = ["DynamicLossScaler", "LossScaleFloorError", "LossScaler", "StaticLossScaler"]


class StaticLossScaler(LossScaler):
    """A fixed loss scale. Overflowing steps are still detected (and agreed across ranks) and skipped.

    Args:
        scale: the loss multiplier, > 0; rounded to fp32. ``StaticLossScaler(1.0)`` is a pure inf/NaN guard.
        enabled: False makes every method a pass-through (as GradScaler's ``enabled``).
        group: process group over which overflow is agreed; None = the default group when distributed.
    """

    def __init__(self, scale: float, *, enabled: bool = True, group: dist.ProcessGroup | None = None):
        super().__init__(scale, enabled=enabled, group=group)

    def _apply_rule(self, found_inf: bool) -> None:
        return None

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._scale!r})"
