"""The dynamic loss-scaling rule (:class:`DynamicLossScaler`): growth, backoff, hysteresis, a floor and a ceiling.

One rule with the knobs of torch's ``GradScaler``, Megatron-LM's ``DynamicGradScaler``, DeepSpeed's loss scalers
and NNabla's ``DynamicLossScalingUpdater`` (:func:`mixprec.scaling.scaler_from` sets them per framework); the
shared scale / unscale / overflow machinery is :class:`mixprec.scaling.LossScaler` (``base.py``).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

from mixprec.core.validate import (
    check_bool,
    check_choice,
    check_fraction,
    check_positive_float,
    check_positive_int,
)
from mixprec.scaling.base import _FP32_TINY, LossScaleFloorError, LossScaler, _check_count, _check_scale, _round_to_fp32

__all__ = ["DynamicLossScaler"]

OnMinScale = Literal["raise", "warn", "ignore"]


_RULE_KEYS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
    "growth_delay",
)
FloorCounts = Literal["overflows", "backoffs"]


def _check_rule(
    name: Callable[[str], str],
    *,
    scale: float,
    scale_name: str,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    hysteresis: Any,
    consecutive_hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    growth_delay: Any,
) -> dict[str, Any]:
    """Validate a dynamic scaler's rule; ``name(key)`` is how an error names the argument (the constructor's
    name, or ``state_dict['key']`` when loading). Shared by ``__init__`` and ``load_state_dict``, so a saved
    state is refused exactly where the constructor would refuse the same values."""
    growth = check_positive_float(name("growth_factor"), growth_factor)
    if growth <= 1.0:
        raise ValueError(f"{name('growth_factor')} must be > 1; got {growth_factor!r}")
    lo = None if min_scale is None else _check_scale(name("min_scale"), min_scale)
    hi = None if max_scale is None else _check_scale(name("max_scale"), max_scale)
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"{name('max_scale')} ({max_scale}) must be >= {name('min_scale')} ({min_scale})")
    if lo is not None and scale < lo:
        raise ValueError(f"{scale_name} ({scale}) must be >= {name('min_scale')} ({min_scale})")
    if hi is not None and scale > hi:
        raise ValueError(f"{scale_name} ({scale}) must be <= {name('max_scale')} ({max_scale})")
    return {
        "growth_factor": growth,
        "backoff_factor": check_fraction(name("backoff_factor"), backoff_factor),
        "growth_interval": check_positive_int(name("growth_interval"), growth_interval),
        "hysteresis": check_positive_int(name("hysteresis"), hysteresis),
        "consecutive_hysteresis": check_bool(name("consecutive_hysteresis"), consecutive_hysteresis),
        "min_scale": lo,
        "max_scale": hi,
        "growth_delay": check_positive_int(name("growth_delay"), growth_delay, minimum=0),
    }


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling with hysteresis, a floor and a ceiling (torch GradScaler / Megatron / DeepSpeed).

    Rule, applied by ``update()`` once per iteration:

    * overflow: the growth counter resets and one unit of hysteresis is spent; once hysteresis is spent
      (``<= 0``) the scale is multiplied by ``backoff_factor`` (clamped at ``min_scale``) on this and every
      further overflow until a growth refills it. An overflow while already at the floor counts towards
      ``min_patience``; after that many consecutive ones ``on_min_scale`` decides.
    * clean step: the growth counter increments; when it reaches ``growth_interval`` the scale is
      multiplied by ``growth_factor`` (clamped at ``max_scale``; a result that would overflow fp32 is
      not taken) and hysteresis refills. With ``consecutive_hysteresis=True`` every clean step refills
      hysteresis (DeepSpeed), so only ``hysteresis`` overflows in a row back off. After the start and
      after every overflow the counter starts at ``-growth_delay``, so the first growth comes after
      ``growth_interval + growth_delay`` clean steps and the next ones every ``growth_interval``.

    With ``hysteresis=1``, ``min_scale=None`` and ``max_scale=None`` the trajectory equals
    ``torch.amp.GradScaler``'s for the same overflow sequence; :func:`mixprec.scaling.scaler_from` builds the
    settings that reproduce torch, DeepSpeed, Megatron-LM and NNabla.

    Args:
        init_scale: starting scale, > 0 (default 2**16), within [min_scale, max_scale].
        growth_factor: multiplier on growth, > 1.
        backoff_factor: multiplier on backoff, in (0, 1).
        growth_interval: clean iterations between growths, int >= 1.
        hysteresis: overflows tolerated before backing off, int >= 1 (1 = back off at once).
        consecutive_hysteresis: refill hysteresis on every clean step (only consecutive overflows count).
        min_scale: floor, > 0, or None for no floor of one's own (default 1.0: below 1 loss scaling shrinks
            gradients). Even with None the scale never goes below 2**-126, fp32's smallest normal number,
            and overflows there count towards ``min_patience``.
        max_scale: ceiling, or None for none (default 2**24).
        on_min_scale: ``"raise"`` (LossScaleFloorError), ``"warn"`` (RuntimeWarning) or ``"ignore"``: what
            happens after ``min_patience`` consecutive overflows at the floor.
        min_patience: consecutive overflows at the floor before ``on_min_scale`` acts, int >= 1.
        growth_delay: extra clean steps before the first growth after the start or an overflow, int >= 0
            (default 0; 1 is DeepSpeed's FP16_Optimizer and NNabla's rule).
        floor_counts: which overflows at the floor count towards ``min_patience``: ``"overflows"`` (every
            one, default) or ``"backoffs"`` (only those that would back off, not those hysteresis absorbs:
            DeepSpeed's ZeRO loss scaler, which raises when a due backoff finds the scale at its minimum).
        enabled: False makes every method a pass-through.
        group: process group over which overflow is agreed; None = the default group when distributed.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        on_min_scale: OnMinScale = "raise",
        group: dist.ProcessGroup | None = None,
        *,
        min_patience: int = 10,
        enabled: bool = True,
        growth_delay: int = 0,
        floor_counts: FloorCounts = "overflows",
    ):
        super().__init__(init_scale, enabled=enabled, group=group)
        rule = _check_rule(
            str,
            scale=self._scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            growth_delay=growth_delay,
            scale_name="init_scale",
        )
        self.growth_factor: float = rule["growth_factor"]
        self.backoff_factor: float = rule["backoff_factor"]
        self.growth_interval: int = rule["growth_interval"]
        self.hysteresis: int = rule["hysteresis"]
        self.consecutive_hysteresis: bool = rule["consecutive_hysteresis"]
        self.min_scale: float | None = rule["min_scale"]
        self.max_scale: float | None = rule["max_scale"]
        self.growth_delay: int = rule["growth_delay"]
        # floor policy, like on_min_scale and min_patience: configuration, not saved state
        self.floor_counts: FloorCounts = check_choice("floor_counts", floor_counts, ("overflows", "backoffs"))
        self.on_min_scale: OnMinScale = check_choice("on_min_scale", on_min_scale, ("raise", "warn", "ignore"))
        self.min_patience = check_positive_int("min_patience", min_patience)
        self._growth_tracker = -self.growth_delay
        self._hysteresis_left = self.hysteresis
        self.overflows_at_floor = 0  # consecutive, reset by a clean step
        self.total_overflows_at_floor = 0
        # (iteration, culprits) of the overflowing iterations among the last growth_interval ones
        self._overflow_history: deque[tuple[int, tuple[str, ...]]] = deque()

    def _record_overflow(self, overflow: bool) -> None:
        now = self.steps_taken + self.steps_skipped
        if overflow:
            self._overflow_history.append((now, self.last_culprits))
        while self._overflow_history and self._overflow_history[0][0] <= now - self.growth_interval:
            self._overflow_history.popleft()

    def _apply_rule(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = -self.growth_delay
            floor = self.min_scale if self.min_scale is not None else _FP32_TINY
            # at most 0: any value <= 0 means "back off now", and a bounded counter saves and loads cleanly
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            backoff = self._hysteresis_left <= 0
            counted = self._scale <= floor and (backoff or self.floor_counts == "overflows")
            if counted:
                self.overflows_at_floor += 1
                self.total_overflows_at_floor += 1
            if backoff:
                self._scale = max(_round_to_fp32(self._scale * self.backoff_factor), floor)
            if counted and self.overflows_at_floor % self.min_patience == 0:
                self._stuck_at_floor()
            return
        self.overflows_at_floor = 0
        self._growth_tracker += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_left = self.hysteresis
            new_scale = _round_to_fp32(self._scale * self.growth_factor)
            if math.isfinite(new_scale):
                if self.max_scale is not None:
                    new_scale = min(new_scale, self.max_scale)
                self._scale = new_scale

    def _stuck_at_floor(self) -> None:
        floor = f"min_scale={self.min_scale}" if self.min_scale is not None else "2**-126 (fp32's smallest normal)"
        msg = (
            f"loss scale is stuck at its floor {floor}: {self.overflows_at_floor} "
            f"consecutive iterations overflowed there (min_patience={self.min_patience}). The gradients are "
            "inf/NaN even unscaled: look for a diverged loss, a too-high learning rate, or an fp16 "
            f"activation overflow; or lower min_scale. {self._overflow_summary()}"
        )
        if self.on_min_scale == "raise":
            raise LossScaleFloorError(msg)
        if self.on_min_scale == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _overflow_summary(self) -> str:
        """The parameters whose gradients overflowed most often over the last ``growth_interval`` iterations."""
        counts = Counter(name for _, names in self._overflow_history for name in names)
        if not counts:
            return "No parameter names were recorded (name them with scaler.name_parameters(model))."
        worst = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:8]
        listed = ", ".join(f"{name} ({n}x)" for name, n in worst)
        more = f" and {len(counts) - len(worst)} more" if len(counts) > len(worst) else ""
        return (
            f"Parameters with inf/NaN gradients most often over the last {self.growth_interval} iterations "
            f"({len(self._overflow_history)} overflowed): {listed}{more}."
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain scalars. A superset of ``torch.amp.GradScaler.state_dict()``, which can load it (and vice versa)."""
        if not self._enabled:
            return {}
        sd = super().state_dict()
        sd.update(
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            _growth_tracker=self._growth_tracker,
            hysteresis=self.hysteresis,
            hysteresis_left=self._hysteresis_left,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            growth_delay=self.growth_delay,
            overflows_at_floor=self.overflows_at_floor,
            total_overflows_at_floor=self.total_overflows_at_floor,
        )
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler`` (its keys only: the rest resets).

        As with GradScaler, the saved factors and interval replace the constructor's. Every value is checked as
        the constructor checks its arguments (one error naming the key); nothing changes unless all are valid.
        """
        if not self._enabled:
            return
        scale, taken, skipped = self._check_base_state(state_dict)

        def key(name: str) -> str:
            return f"state_dict[{name!r}]"

        rule = _check_rule(
            key,
            scale=scale,
            scale_name=key("scale"),
            **{name: state_dict.get(name, getattr(self, name)) for name in _RULE_KEYS},
        )
        tracker = state_dict.get("_growth_tracker", -rule["growth_delay"])
        check_positive_int(key("_growth_tracker"), tracker, minimum=-rule["growth_delay"])
        if tracker >= rule["growth_interval"]:
            raise ValueError(
                f"{key('_growth_tracker')} must be < growth_interval ({rule['growth_interval']}); got {tracker}"
            )
        # saved by older versions as low as -(overflows in a row); any value <= 0 means "back off at the next one"
        left = state_dict.get("hysteresis_left", rule["hysteresis"])
        if isinstance(left, bool) or not isinstance(left, int) or left > rule["hysteresis"]:
            raise ValueError(
                f"{key('hysteresis_left')} must be an int <= hysteresis ({rule['hysteresis']}); got {left!r}"
            )
        at_floor = _check_count(key("overflows_at_floor"), state_dict.get("overflows_at_floor", 0))
        total_at_floor = _check_count(key("total_overflows_at_floor"), state_dict.get("total_overflows_at_floor", 0))
        if total_at_floor < at_floor:
            raise ValueError(
                f"{key('total_overflows_at_floor')} ({total_at_floor}) must be >= "
                f"{key('overflows_at_floor')} ({at_floor})"
            )
        self._scale, self.steps_taken, self.steps_skipped = scale, taken, skipped
        for name in _RULE_KEYS:
            setattr(self, name, rule[name])
        self._growth_tracker = tracker
        self._hysteresis_left = max(left, 0)
        self.overflows_at_floor = at_floor
        self.total_overflows_at_floor = total_at_floor
        self._end_iteration()

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale!r}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale}, max_scale={self.max_scale}, "
            f"growth_delay={self.growth_delay})"
        )
