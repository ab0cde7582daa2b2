"""``scaler_from(framework, **kwargs)``: the loss scaler another framework would run, from its own settings.

Each framework's argument (or config) names build a :class:`DynamicLossScaler` or :class:`StaticLossScaler`
whose scale trajectory equals that framework's on every overflow sequence, floor error included; ``state_dict=``
loads its saved scaler state so that a run resumes with its scale. Rules reproduced (tests/test_scaling_frameworks.py):

* ``"torch"``: ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py and its ``_amp_update_scale_`` kernel).
* ``"deepspeed"``: the ``fp16`` config section. ZeRO stages 1-3 use ``DynamicLossScaler`` of
  deepspeed/runtime/fp16/loss_scaler.py (hysteresis, raises at its minimum); stage 0 (``FP16_Optimizer``) its
  own ``_update_scale``, which first grows one step later and ignores hysteresis.
* ``"megatron"``: Megatron-LM's ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py).
* ``"nnabla"``: NNabla's ``DynamicLossScalingUpdater`` (nnabla/experimental/mixed_precision_training.py).

The scale is held in fp32 as everywhere in mixprec; frameworks that hold it in fp64 (DeepSpeed, NNabla) agree
exactly while their scale stays an fp32 normal number, i.e. for power-of-two factors within [2**-126, 2**127].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from mixprec.core.validate import check_bool, check_choice, check_positive_float, check_positive_int
from mixprec.scaling.scaler import DynamicLossScaler, LossScaler, StaticLossScaler, _round_to_fp32

__all__ = ["FRAMEWORKS", "scaler_from"]

# framework -> {accepted key: default}. Defaults are the framework's own.
_KEYS: dict[str, dict[str, Any]] = {
    # torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
    "torch": {
        "device": "cuda",
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "enabled": True,
    },
    # DeepSpeed's "fp16" config section (deepspeed/runtime/constants.py) plus zero_optimization.stage
    "deepspeed": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
        "fp16_master_weights_and_grads": False,
        "zero_stage": 0,
    },
    # Megatron-LM's DynamicGradScaler arguments, defaults from its OptimizerConfig; loss_scale: ConstantGradScaler
    "megatron": {
        "initial_scale": 2.0**32,
        "min_scale": 1.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
        "loss_scale": None,
    },
    # NNabla's DynamicLossScalingUpdater(solver, loss, data_feeder, scale, scaling_factor, N, ...)
    "nnabla": {"scale": 8.0, "scaling_factor": 2.0, "N": 2000},
}
FRAMEWORKS: tuple[str, ...] = tuple(_KEYS)

# DeepSpeed builds ZeRO's loss scaler from these keys only when one of them is in the fp16 section; otherwise
# loss_scaler.DynamicLossScaler's own defaults apply (deepspeed/runtime/config.py, get_dynamic_loss_scale_args).
_DS_DYNAMIC_KEYS = (
    "initial_scale_power",
    "loss_scale_window",
    "min_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
)
_DS_ZERO_DEFAULTS = {"initial_scale_power": 32, "loss_scale_window": 1000, "min_loss_scale": 1, "hysteresis": 1}


def scaler_from(
    framework: str,
    *,
    state_dict: Mapping[str, Any] | Any | None = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> LossScaler:
    """The mixprec loss scaler that reproduces ``framework``'s, built from that framework's own names.

    Args:
        framework: ``"torch"``, ``"deepspeed"``, ``"megatron"`` or ``"nnabla"``.
        state_dict: optional saved scaler state of that framework, loaded so the run resumes with its scale:
            torch: ``GradScaler.state_dict()``; megatron: ``DynamicGradScaler.state_dict()`` (``scale``,
            ``growth_tracker``, ``hysteresis_tracker``); deepspeed: the optimizer's state dict (``FP16_Optimizer``:
            ``cur_scale``, ``cur_iter``, ``last_overflow_iter``; ZeRO: its ``loss_scaler`` entry) or the loss
            scaler object / its attribute dict; nnabla: ``{"scale": ..., "_counter": ...}`` (the updater's
            attributes, e.g. ``vars(updater)``).
        group: process group over which overflow is agreed (mixprec's own argument).
        **kwargs: the framework's names, with its defaults:

            * torch: ``init_scale`` (2**16), ``growth_factor`` (2), ``backoff_factor`` (0.5), ``growth_interval``
              (2000), ``enabled`` (True), ``device`` (accepted, unused: mixprec's scalers follow the gradients).
            * deepspeed (the ``fp16`` section): ``loss_scale`` (0 = dynamic, else a static scale),
              ``initial_scale_power`` (16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
              ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1), ``enabled`` (True here: the section is
              assumed on), ``auto_cast`` and ``fp16_master_weights_and_grads`` (accepted, no effect on the
              scale), and ``zero_stage`` (``zero_optimization.stage``, default 0) because the rule depends on it:
              stage 0 grows on the ``(W+1)``-th clean step after the start or an overflow, then every W, with no
              hysteresis and no error at the floor; stages 1-3 grow every W, spend ``hysteresis``, and raise
              :class:`LossScaleFloorError` when a backoff is due at ``min_loss_scale``. As in DeepSpeed, ZeRO uses
              its loss scaler's defaults (2**32, window 1000, hysteresis 1) unless the section sets one of the
              dynamic keys.
            * megatron: ``initial_scale`` (2**32), ``min_scale`` (1), ``growth_factor`` (2), ``backoff_factor``
              (0.5), ``growth_interval`` (1000), ``hysteresis`` (2); ``loss_scale`` (a number: the static
              ``ConstantGradScaler``). Factors are rounded to fp32 as Megatron's fp32 tensors hold them.
            * nnabla: ``scale`` (8), ``scaling_factor`` (2), ``N`` (2000): the scale grows when more than ``N``
              clean steps have passed since the start, an overflow or the last growth, i.e. on the ``(N+2)``-th
              clean step and then every ``N+1``. The scale never hits a floor (mixprec stops at 2**-126) or a
              ceiling. Its retry of an overflowing batch (up to 100 times) is :class:`mixprec.Updater`'s
              ``max_retries=100``, its summed microbatch gradients ``microbatch_reduction="sum"``.

    Raises:
        ValueError: an unknown framework (the message lists them), or a value out of range (named by its key).
        TypeError: an unknown key for the framework (the message lists the accepted ones), or a value of the
            wrong type.
    """
    if not isinstance(framework, str) or framework not in _KEYS:
        raise ValueError(f"framework must be one of {', '.join(map(repr, FRAMEWORKS))}; got {framework!r}")
    accepted = _KEYS[framework]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"unknown {framework} setting(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(accepted)}"
        )
    settings = {**accepted, **kwargs}
    scaler = _BUILDERS[framework](settings, set(kwargs), group)
    if state_dict is not None:
        _LOADERS[framework](scaler, state_dict)
    return scaler


# ---------------------------------------------------------------------------------------------- builders
def _torch(s: dict[str, Any], given: set[str], group: dist.ProcessGroup | None) -> LossScaler:
    if not isinstance(s["device"], str | torch.device):
        raise TypeError(f"device must be a str or torch.device; got {type(s['device']).__name__}")
    return DynamicLossScaler(
        init_scale=s["init_scale"],
        growth_factor=s["growth_factor"],
        backoff_factor=s["backoff_factor"],
        growth_interval=s["growth_interval"],
        hysteresis=1,
        min_scale=None,
        max_scale=None,
        on_min_scale="ignore",
        group=group,
        enabled=check_bool("enabled", s["enabled"]),
    )


def _deepspeed(s: dict[str, Any], given: set[str], group: dist.ProcessGroup | None) -> LossScaler:
    enabled = check_bool("enabled", s["enabled"])
    check_bool("auto_cast", s["auto_cast"])
    check_bool("fp16_master_weights_and_grads", s["fp16_master_weights_and_grads"])
    stage = check_choice("zero_stage", s["zero_stage"], (0, 1, 2, 3))
    loss_scale = check_positive_float("loss_scale", s["loss_scale"], allow_zero=True)
    if loss_scale != 0:
        return StaticLossScaler(loss_scale, enabled=enabled, group=group)
    if stage > 0 and not given & set(_DS_DYNAMIC_KEYS):
        s = {**s, **_DS_ZERO_DEFAULTS}
    power = check_positive_int("initial_scale_power", s["initial_scale_power"], minimum=-126)
    if power > 127:
        raise ValueError(f"initial_scale_power must be <= 127 (2**power is an fp32 scale); got {power}")
    window = check_positive_int("loss_scale_window", s["loss_scale_window"])
    hysteresis = check_positive_int("hysteresis", s["hysteresis"])
    consecutive = check_bool("consecutive_hysteresis", s["consecutive_hysteresis"])
    min_loss_scale = check_positive_float("min_loss_scale", s["min_loss_scale"])
    if 2.0**power < min_loss_scale:
        raise ValueError(f"2**initial_scale_power ({2.0**power}) must be >= min_loss_scale ({min_loss_scale})")
    common = dict(
        init_scale=2.0**power,
        growth_factor=2.0,  # DeepSpeed's scale_factor: fixed at 2 by its config
        backoff_factor=0.5,
        growth_interval=window,
        min_scale=min_loss_scale,
        max_scale=None,
        group=group,
        enabled=enabled,
    )
    if stage == 0:
        # FP16_Optimizer._update_scale: stable_interval = cur_iter - last_overflow_iter - 1, grows when it is a
        # positive multiple of the window; backs off to max(scale / 2, min) on every overflow, never raises
        return DynamicLossScaler(**common, hysteresis=1, on_min_scale="ignore", growth_delay=1)
    # loss_scaler.DynamicLossScaler.update_scale: raises instead of a backoff that finds the scale at its minimum
    return DynamicLossScaler(
        **common,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        on_min_scale="raise",
        min_patience=1,
        floor_counts="backoffs",
    )


def _megatron(s: dict[str, Any], given: set[str], group: dist.ProcessGroup | None) -> LossScaler:
    if s["loss_scale"] is not None:
        return StaticLossScaler(check_positive_float("loss_scale", s["loss_scale"]), group=group)
    # Megatron keeps the factors in fp32 tensors: round them as it does, so each product is one fp32 rounding
    growth = _round_to_fp32(check_positive_float("growth_factor", s["growth_factor"]))
    backoff = _round_to_fp32(check_positive_float("backoff_factor", s["backoff_factor"]))
    min_scale = check_positive_float("min_scale", s["min_scale"])
    initial = check_positive_float("initial_scale", s["initial_scale"])
    if initial < min_scale:
        raise ValueError(f"initial_scale ({initial}) must be >= min_scale ({min_scale})")
    return DynamicLossScaler(
        init_scale=initial,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=s["growth_interval"],
        hysteresis=s["hysteresis"],
        min_scale=min_scale,
        max_scale=None,
        on_min_scale="ignore",
        group=group,
    )


def _nnabla(s: dict[str, Any], given: set[str], group: dist.ProcessGroup | None) -> LossScaler:
    factor = check_positive_float("scaling_factor", s["scaling_factor"])
    if factor <= 1.0:
        raise ValueError(f"scaling_factor must be > 1; got {s['scaling_factor']!r}")
    n = check_positive_int("N", s["N"], minimum=0)
    return DynamicLossScaler(
        init_scale=check_positive_float("scale", s["scale"]),
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=n + 1,
        hysteresis=1,
        min_scale=None,
        max_scale=None,
        on_min_scale="ignore",
        group=group,
        growth_delay=1,
    )


_BUILDERS: dict[str, Callable[[dict[str, Any], set[str], dist.ProcessGroup | None], LossScaler]] = {
    "torch": _torch,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
    "nnabla": _nnabla,
}


# ---------------------------------------------------------------------------------------------- state loaders
def _as_dict(state: Any, what: str) -> dict[str, Any]:
    if isinstance(state, Mapping):
        return dict(state)
    if hasattr(state, "__dict__"):  # DeepSpeed pickles its loss-scaler object into ZeRO checkpoints
        return dict(vars(state))
    raise TypeError(f"state_dict must be {what}; got {type(state).__name__}")


def _only(state: dict[str, Any], keys: tuple[str, ...], framework: str) -> None:
    unknown = sorted(set(state) - set(keys))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in the {framework} scaler state; accepted: "
            f"{', '.join(keys)}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"the {framework} scaler state lacks {', '.join(map(repr, missing))}")


def _scalar(name: str, value: Any) -> float:
    """A saved scale: a number or a one-element tensor (Megatron saves a CUDA tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one element; got shape {tuple(value.shape)}")
        return float(value.detach().cpu().reshape(()).double())
    return check_positive_float(name, value)


def _load_torch(scaler: LossScaler, state: Any) -> None:
    state = _as_dict(state, "GradScaler.state_dict()")
    _only(state, ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"), "torch")
    scaler.load_state_dict(state)


def _load_megatron(scaler: LossScaler, state: Any) -> None:
    state = _as_dict(state, "DynamicGradScaler.state_dict()")
    if isinstance(scaler, StaticLossScaler):
        return  # ConstantGradScaler saves {}: nothing to resume
    _only(state, ("scale", "growth_tracker", "hysteresis_tracker"), "megatron")
    scaler.load_state_dict(
        {
            "scale": _scalar("state_dict['scale']", state["scale"]),
            "_growth_tracker": state["growth_tracker"],
            # Megatron lets its tracker go below zero on repeated overflows; mixprec stops at 0, the same rule
            "hysteresis_left": _int("state_dict['hysteresis_tracker']", state["hysteresis_tracker"]),
        }
    )


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    return value


def _load_deepspeed(scaler: LossScaler, state: Any) -> None:
    state = _as_dict(state, "a DeepSpeed optimizer state dict or loss scaler")
    if "loss_scaler" in state:  # a ZeRO optimizer's state dict
        state = _as_dict(state["loss_scaler"], "a DeepSpeed loss scaler (object or attribute dict)")
    scale_key = "cur_scale"
    if scale_key not in state:
        raise KeyError(
            "the DeepSpeed scaler state lacks 'cur_scale': give the optimizer's state dict (FP16_Optimizer: "
            "cur_scale, cur_iter, last_overflow_iter; ZeRO: its 'loss_scaler' entry) or the loss scaler itself"
        )
    scale = _scalar("state_dict['cur_scale']", state[scale_key])
    if isinstance(scaler, StaticLossScaler):
        scaler.load_state_dict({"scale": scale})
        return
    scaler = cast(DynamicLossScaler, scaler)
    for key in ("cur_iter", "last_overflow_iter"):
        if key not in state:
            raise KeyError(f"the DeepSpeed scaler state lacks {key!r} (saved by a dynamic loss scaler?)")
    cur_iter = _int("state_dict['cur_iter']", state["cur_iter"])
    last = _int("state_dict['last_overflow_iter']", state["last_overflow_iter"])
    if not -1 <= last < cur_iter:
        raise ValueError(f"state_dict['last_overflow_iter'] ({last}) must lie in [-1, cur_iter={cur_iter})")
    clean = cur_iter - last - 1  # clean steps since the last overflow (or the start)
    delay, window = scaler.growth_delay, scaler.growth_interval
    tracker = clean - delay if clean < delay else (clean - delay) % window
    loaded: dict[str, Any] = {"scale": scale, "_growth_tracker": tracker}
    if "cur_hysteresis" in state:
        hysteresis = _int("state_dict['cur_hysteresis']", state["cur_hysteresis"])
        loaded["hysteresis_left"] = min(hysteresis, scaler.hysteresis)
    scaler.load_state_dict(loaded)


def _load_nnabla(scaler: LossScaler, state: Any) -> None:
    state = _as_dict(state, "the DynamicLossScalingUpdater's attributes (e.g. vars(updater))")
    for key in ("scale", "_counter"):
        if key not in state:
            raise KeyError(f"the nnabla updater state lacks {key!r}; give vars(updater) or {{'scale', '_counter'}}")
    scaler = cast(DynamicLossScaler, scaler)
    counter = _int("state_dict['_counter']", state["_counter"])
    if counter < 0:
        raise ValueError(f"state_dict['_counter'] must be >= 0; got {counter}")
    # NNabla grows on the clean step that finds _counter > N, i.e. N + 2 - _counter clean steps from now (0 after
    # an overflow, 1 after a growth); mixprec's tracker t grows W - t = N + 1 - t clean steps from now.
    tracker = min(counter - 1, scaler.growth_interval - 1)
    scaler.load_state_dict({"scale": _scalar("state_dict['scale']", state["scale"]), "_growth_tracker": tracker})


_LOADERS: dict[str, Callable[[LossScaler, Any], None]] = {
    "torch": _load_torch,
    "deepspeed": _load_deepspeed,
    "megatron": _load_megatron,
    "nnabla": _load_nnabla,
}
