"""Loss scalers with a ``torch.amp.GradScaler``-compatible API: dynamic (growth, backoff, hysteresis, floor,
ceiling, abort when stuck) and static. Typical loop::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                      # optional: only needed to clip
    scaler.step(optimizer)                           # skipped when any rank saw inf/NaN
    scaler.update()

Precision: the scale is an fp32 number, like GradScaler's scale tensor; growth and backoff are computed in
fp64 and rounded to fp32, the reciprocal used to unscale is taken in fp64 and rounded to fp32 once.

Synchronisation: ``step`` (or ``has_overflow``) reads the overflow flag on the host once per optimizer per
iteration, after an all-reduce (MAX, one fp32 element) over ``group`` when ``torch.distributed`` is initialised,
so every rank skips or steps together.
"""

from __future__ import annotations

import abc
import enum
import math
import struct
import warnings
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from mixprec.comm.agree import agree_any, is_distributed
from mixprec.core.validate import (
    check_bool,
    check_choice,
    check_fraction,
    check_group,
    check_positive_float,
    check_positive_int,
)

__all__ = ["DynamicLossScaler", "LossScaleFloorError", "LossScaler", "StaticLossScaler"]

OnMinScale = Literal["raise", "warn", "ignore"]


class LossScaleFloorError(RuntimeError):
    """Raised when a dynamic scaler keeps overflowing at its ``min_scale`` floor."""


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerState:
    optimizer: Any = None
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # 1-element fp32, already agreed across ranks
    found_inf_host: bool | None = None
    culprits: tuple[str, ...] = ()  # agreed across ranks, filled only when the step overflowed


# The smallest positive normal fp32 number. A scale below it would be subnormal (its reciprocal overflows fp32
# and the unscaled gradients lose bits), so it is the floor even when a scaler has no min_scale.
_FP32_TINY = 2.0**-126


def _check_scale(name: str, value: Any) -> float:
    """A loss scale: a finite number > 0 that rounds to a normal fp32 number (its reciprocal is then finite)."""
    scale = _round_to_fp32(check_positive_float(name, value))
    if not _FP32_TINY <= scale < math.inf:
        raise ValueError(f"{name} must be a normal fp32 number, in [2**-126, 3.4e38]; got {value!r}")
    return scale


def _check_count(name: str, value: Any) -> int:
    """A counter read from a saved state: an int >= 0 (a float such as 2.0 is refused, as by the constructor)."""
    return check_positive_int(name, value, minimum=0)


def _check_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            "optimizer must be a torch optimizer (or MasterWeightOptimizer / ShardedOptimizer) with param_groups "
            f"and step(); got {type(optimizer).__name__}"
        )


def _round_to_fp32(x: float) -> float:
    """Round a Python float (fp64) to the nearest fp32 value, overflowing to +-inf like a C cast."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


# Gradient dtypes unscale_ accepts (fp16 has its own error message: keep fp32 master gradients instead).
_UNSCALE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


class LossScaler(abc.ABC):
    """Shared machinery of the static and dynamic scalers; use one of those.

    Subclasses implement ``_apply_rule(found_inf)``, which changes ``self._scale`` after an iteration.
    """

    def __init__(self, init_scale: float, *, enabled: bool = True, group: dist.ProcessGroup | None = None):
        self._enabled = check_bool("enabled", enabled)
        self._scale = _check_scale("init_scale", init_scale)
        self._group = check_group("group", group)
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self.steps_taken = 0
        self.steps_skipped = 0
        self.last_found_inf: bool | None = None
        self.last_step_skipped: bool | None = None
        self.last_culprits: tuple[str, ...] = ()
        self._param_names: dict[int, str] = {}

    # ------------------------------------------------------------------ names, for the overflow report
    def name_parameters(self, named: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tell the scaler what the parameters are called, so that an overflow report names them.

        ``named`` is a module (its ``named_parameters()``) or ``(name, tensor)`` pairs. Costs nothing per step:
        names are only looked up when a step overflowed. Parameters without a name are reported as
        ``param_groups[g][i]`` with their shape. :class:`mixprec.Updater` names its model's parameters itself.
        """
        if isinstance(named, torch.nn.Module):
            pairs: Iterable[tuple[str, torch.Tensor]] = named.named_parameters()
        elif isinstance(named, Iterable) and not isinstance(named, str | torch.Tensor):
            pairs = named
        else:
            raise TypeError(f"named must be an nn.Module or (name, tensor) pairs; got {type(named).__name__}")
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"named must hold (name, tensor) pairs; got {item!r:.80}")
            if not isinstance(item[1], torch.Tensor):
                raise TypeError(f"named must hold (name, tensor) pairs; {item[0]!r} is a {type(item[1]).__name__}")
            self._param_names[id(item[1])] = item[0]

    # ------------------------------------------------------------------ queries
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current loss scale (a float exactly representable in fp32); 1.0 when disabled."""
        return self._scale if self._enabled else 1.0

    def _state_of(self, optimizer: Any) -> _OptimizerState:
        state = self._per_optimizer.get(id(optimizer))
        if state is None:
            state = self._per_optimizer[id(optimizer)] = _OptimizerState(optimizer=optimizer)
        return state

    # ------------------------------------------------------------------ verbs
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Any: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or a list/tuple of losses) by the scale. The result keeps the input's dtype."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors; got {type(outputs).__name__}")

    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and record overflow.

        Call at most once per optimizer between ``update()`` calls, and only before ``step()``. Uses
        torch's fused non-finite-check-and-unscale kernel; the reciprocal is taken in fp64, rounded to
        fp32. fp16 gradients are refused (unscaling them in place would flush the small values loss
        scaling exists to protect): keep fp32 master gradients with
        :class:`mixprec.MasterWeightOptimizer`. The overflow flag is agreed across ``group``.
        """
        if not self._enabled:
            return
        _check_optimizer(optimizer)
        state = self._state_of(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call update() to start a new iteration.")
        prepare = getattr(optimizer, "mixprec_prepare_grads_", None)
        if callable(prepare):
            prepare()
        state.found_inf = self._unscale_grads(optimizer)
        state.found_inf_host = None
        state.stage = _Stage.UNSCALED

    def _unscale_grads(self, optimizer: Any) -> torch.Tensor:
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.dtype == torch.float16:
                    raise ValueError(
                        "unscale_() refuses fp16 gradients: unscaling them in place flushes small values to "
                        "zero. Keep fp32 master weights (mixprec.MasterWeightOptimizer) and give their "
                        "optimizer to the scaler."
                    )
                if g.dtype not in _UNSCALE_DTYPES:
                    raise TypeError(
                        f"optimizer's parameters must have float32, float64 or bfloat16 gradients to unscale; got "
                        f"{g.dtype} (shape {tuple(g.shape)}): loss scaling of fp8 or complex gradients is not supported"
                    )
                if g.is_sparse:
                    if g.dtype is not torch.float32 or not g.is_coalesced():
                        p.grad = g = g.coalesce()
                    g = g._values()
                by_device_dtype[(g.device, g.dtype)].append(g)
        inv_scale_64 = 1.0 / self._scale
        found: torch.Tensor | None = None
        for (device, _dtype), grads in by_device_dtype.items():
            found_dev = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), inv_scale_64, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_dev, inv)
            found = found_dev if found is None else found + found_dev.to(found.device)
        if found is None:  # an optimizer with no gradients cannot overflow
            found = torch.zeros(1, dtype=torch.float32)
        return found

    def has_overflow(self, optimizer: Any) -> bool:
        """Whether this iteration's gradients for ``optimizer`` held inf/NaN on any rank of ``group``.

        Unscales first if that has not happened yet. One host sync (and one all-reduce when distributed)
        the first time it is asked per iteration.
        """
        if not self._enabled:
            return False
        _check_optimizer(optimizer)
        state = self._state_of(optimizer)
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        return self._agreed_overflow(state)

    def _agreed_overflow(self, state: _OptimizerState) -> bool:
        """The overflow flag of ``state`` agreed across ``group`` (one all-reduce and host sync, once per
        iteration); on overflow, also the agreed names of the non-finite gradients."""
        if state.found_inf_host is None:
            state.found_inf_host = agree_any(self._recorded_flag(state), self._group)
            if state.found_inf_host:
                state.culprits = self._agreed_culprits(state.optimizer)
        return state.found_inf_host

    def _agreed_culprits(self, optimizer: Any) -> tuple[str, ...]:
        """Names of the parameters whose gradient holds inf/NaN on any rank, sorted; the same on every rank.

        Only called after an agreed overflow, so the fast path pays nothing: here one ``isfinite`` pass per
        gradient, one host sync, and (distributed) one ``all_gather_object`` of the names over ``group``.
        """
        model_param = getattr(optimizer, "model_param", None)
        labels: list[str] = []
        grads: list[torch.Tensor] = []
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    g = g.coalesce()._values()
                name = self._param_names.get(id(p))
                if name is None and callable(model_param):
                    name = self._param_names.get(id(model_param(p)))
                labels.append(name if name is not None else f"param_groups[{gi}][{pi}] {tuple(p.shape)}")
                grads.append(g)
        bad: list[str] = []
        if grads:
            finite = torch.stack([torch.isfinite(g).all().to(grads[0].device) for g in grads]).tolist()
            bad = [label for label, ok in zip(labels, finite, strict=True) if not ok]
        if is_distributed():
            gathered: list[Any] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(gathered, bad, group=self._group)
            bad = [name for names in gathered for name in names]
        return tuple(sorted(set(bad)))

    @staticmethod
    def _recorded_flag(state: _OptimizerState) -> torch.Tensor:
        if state.found_inf is None:
            raise RuntimeError("internal error: no overflow flag recorded for an unscaled optimizer")
        return state.found_inf

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then call ``optimizer.step(*args, **kwargs)`` unless any rank overflowed.

        Returns what ``optimizer.step`` returned, or None when the step was skipped (GradScaler's contract);
        ``last_step_skipped`` then says which it was, also for optimizers whose ``step`` returns None.
        """
        _check_optimizer(optimizer)
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported with loss scaling (the closure would be unscaled).")
        state = self._state_of(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        overflow = self.has_overflow(optimizer)
        state.stage = _Stage.STEPPED
        self.last_step_skipped = overflow
        if overflow:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, found_inf: bool | torch.Tensor | None = None) -> None:
        """End the iteration: feed this iteration's overflow into the scaling rule and reset per-step state.

        Args:
            found_inf: None to use what ``unscale_``/``step`` recorded (any optimizer overflowed), or a
                bool (or a tensor, non-zero meaning overflow) for users who check gradients themselves.
                Either way the flag is agreed across ``group`` before it is used.

        Afterwards ``last_step_skipped`` is True when this iteration overflowed (no optimizer step ran) and
        ``last_culprits`` names the parameters whose gradients were inf/NaN on any rank (empty when clean or
        when ``found_inf`` was given).
        """
        if not self._enabled:
            return
        if found_inf is None:
            states = list(self._per_optimizer.values())
            if not states:
                raise RuntimeError(
                    "update() found no overflow checks for this iteration: call unscale_() or step() first, "
                    "or pass found_inf=True/False."
                )
            overflow = False
            for st in states:
                overflow = self._agreed_overflow(st) or overflow
        elif isinstance(found_inf, bool | torch.Tensor):
            overflow = agree_any(found_inf, self._group)
        else:
            raise TypeError(f"found_inf must be None, a bool or a tensor; got {type(found_inf).__name__}")
        self.last_found_inf = overflow
        self.last_step_skipped = overflow
        self.last_culprits = tuple(sorted({n for st in self._per_optimizer.values() for n in st.culprits}))
        if overflow:
            self.steps_skipped += 1
        else:
            self.steps_taken += 1
        self._record_overflow(overflow)
        self._end_iteration()
        self._apply_rule(overflow)

    def _record_overflow(self, overflow: bool) -> None:
        """Hook for subclasses that keep an overflow history (the dynamic scaler's floor report)."""
        return None

    def _end_iteration(self) -> None:
        # Optimizers that stage gradients (fp32 master grads) must not reuse them in the next iteration, also
        # when the step was skipped and the user clears gradients some other way than optimizer.zero_grad().
        for st in self._per_optimizer.values():
            discard = getattr(st.optimizer, "mixprec_discard_grads_", None)
            if callable(discard):
                discard()
        self._per_optimizer.clear()

    @abc.abstractmethod
    def _apply_rule(self, found_inf: bool) -> None:
        """Change the scale after an iteration whose (agreed) overflow flag is ``found_inf``."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain Python scalars; includes GradScaler's keys (``scale``, ``_growth_tracker``, ...)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "steps_taken": self.steps_taken,
            "steps_skipped": self.steps_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved; every value is checked as the constructor checks its arguments."""
        if not self._enabled:
            return
        scale, taken, skipped = self._check_base_state(state_dict)
        self._scale = scale
        self.steps_taken = taken
        self.steps_skipped = skipped
        self._end_iteration()

    @staticmethod
    def _check_base_state(state_dict: dict[str, Any]) -> tuple[float, int, int]:
        """Validate the keys every scaler saves, as the constructor validates its arguments; change nothing."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled scaler.")
        if "scale" not in state_dict:
            raise KeyError("state_dict has no 'scale' entry; was it saved by a loss scaler?")
        return (
            _check_scale("state_dict['scale']", state_dict["scale"]),
            _check_count("state_dict['steps_taken']", state_dict.get("steps_taken", 0)),
            _check_count("state_dict['steps_skipped']", state_dict.get("steps_skipped", 0)),
        )


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
