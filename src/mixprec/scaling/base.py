"""The machinery every loss scaler shares (:class:`LossScaler`): scale, unscale, agree on overflow, step or skip.

A ``torch.amp.GradScaler``-compatible API; the rules that change the scale live in the subclasses
(:class:`mixprec.scaling.StaticLossScaler` here in ``scaler.py``, :class:`mixprec.scaling.DynamicLossScaler` in
``dynamic.py``).

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
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist

from mixprec.comm.agree import agree_any, is_distributed
from mixprec.core.validate import (
    check_bool,
    check_group,
    check_positive_float,
    check_positive_int,
)

__all__ = ["LossScaleFloorError", "LossScaler"]


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
