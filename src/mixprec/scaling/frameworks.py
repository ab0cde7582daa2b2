"""``scaler_from(framework, **kwargs)``: the loss scaler another framework would run, from its own settings.

Each framework's argument (or config) names build a :class:`DynamicLossScaler` or :class:`StaticLossScaler`
whose scale trajectory equals that framework's on every overflow sequence, floor error included; ``state_dict=``
loads its saved scaler state so that a run resumes with its scale. Rules reproduced (the table of versions,
rules and the sources they were checked against is in docs/scaling.md):

* ``"torch"``: ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py and its ``_amp_update_scale_`` kernel).
* ``"deepspeed"``: the ``fp16`` config section, per release line (``version=``): ZeRO stages 1-3 run
  ``DynamicLossScaler`` of deepspeed/runtime/fp16/loss_scaler.py (hysteresis, raises at its minimum), which
  grows one step later from 0.17.1 on (PR #6976); stage 0 runs ``FP16_Optimizer._update_scale``.
* ``"megatron"``: Megatron-LM's ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py).
* ``"nnabla"``: NNabla's ``DynamicLossScalingUpdater`` (nnabla/experimental/mixed_precision_training.py).

The scale is held in fp32 as everywhere in mixprec; frameworks that hold it in fp64 (DeepSpeed, NNabla) agree
exactly while their scale stays an fp32 normal number, i.e. for power-of-two factors within [2**-126, 2**127].
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, cast

import torch
import torch.distributed as dist

from mixprec.core.validate import check_bool, check_choice, check_positive_float, check_positive_int
from mixprec.scaling.base import _check_scale, _round_to_fp32
from mixprec.scaling.scaler import DynamicLossScaler, LossScaler, StaticLossScaler

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
    # DeepSpeed's "fp16" config section (deepspeed/runtime/precision_config.py) plus zero_optimization.stage, the
    # release line, ZeRO's loss-scaler argument and, for stage 0, whether the optimizer is a fused one
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
        "version": None,
        "raise_error_at_min_scale": True,
        "fused_optimizer": True,
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

# DeepSpeed release lines. Before 0.17.1 the optimizers get dynamic-scaling arguments only when the fp16 section
# sets one of _DS_DYNAMIC_KEYS (deepspeed/runtime/config.py, get_dynamic_loss_scale_args); otherwise ZeRO's
# loss_scaler.DynamicLossScaler and stage 0's unfused optimizer use their own defaults. From 0.17.1 (PR #6976) the
# section is a pydantic model whose defaults always apply, min_loss_scale is an int, and ZeRO's scaler grows on the
# (W+1)-th clean step instead of the W-th. 0.9.3 (PR #3553) is the first release that reads consecutive_hysteresis;
# the rules are unchanged from it to 0.17.0.
_DS_OLDEST = (0, 9, 3)
_DS_PR_6976 = (0, 17, 1)
_DS_DYNAMIC_KEYS = (
    "initial_scale_power",
    "loss_scale_window",
    "min_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
)
_DS_ZERO_DEFAULTS = {"initial_scale_power": 32, "loss_scale_window": 1000, "min_loss_scale": 1, "hysteresis": 1}
_DS_UNFUSED_MIN_LOSS_SCALE = 0.25  # FP16_UnfusedOptimizer's own floor before 0.17.1


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
            ``growth_tracker``, ``hysteresis_tracker``); deepspeed: the optimizer's state dict (stage 0: ``cur_scale``,
            ``cur_iter``, ``last_overflow_iter``, ..., the ``optimizer`` entry of ``mp_rank_00_model_states.pt``;
            ZeRO: the ``optimizer_state_dict`` entry of ``zero_pp_rank_0_mp_rank_00_optim_states.pt``, whose
            ``loss_scaler`` entry is the pickled scaler) or the loss scaler object / its attribute dict. The saved
            window, hysteresis, floor and factor must equal the settings (DeepSpeed resumes with the saved ones); a
            mismatch is refused, naming both. nnabla: ``{"scale": ..., "_counter": ...}`` (the updater's
            attributes, e.g. ``vars(updater)``).
        group: process group over which overflow is agreed (mixprec's own argument).
        **kwargs: the framework's names, with its defaults:

            * torch: ``init_scale`` (2**16), ``growth_factor`` (2), ``backoff_factor`` (0.5), ``growth_interval``
              (2000), ``enabled`` (True), ``device`` (accepted, unused: mixprec's scalers follow the gradients).
            * deepspeed (the ``fp16`` section): ``loss_scale`` (0 = dynamic, else a static scale),
              ``initial_scale_power`` (16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
              ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1), ``enabled`` (True here: the section is
              assumed on), ``auto_cast`` and ``fp16_master_weights_and_grads`` (accepted, no effect on the
              scale); ``zero_stage`` (``zero_optimization.stage``, default 0) because the rule depends on it;
              ``version``, the DeepSpeed release whose rule to run (a string such as ``"0.16.9"``, 0.9.3 or
              later; default: the installed ``deepspeed``'s version, read from its package metadata without
              importing it, else the newest rule); ``raise_error_at_min_scale`` (True, ZeRO's loss-scaler
              argument; False backs off to the floor and goes on); ``fused_optimizer`` (True; stage 0 only:
              whether the optimizer is DeepSpeed's or Apex's ``FusedAdam``, which before 0.17.1 decides the
              floor when the section sets no dynamic key). The rules: stage 0 grows on the ``(W+1)``-th clean
              step after the start or an overflow, then every W, with no hysteresis and no error at the floor;
              stages 1-3 grow on the W-th clean step before 0.17.1 and on the ``(W+1)``-th from 0.17.1 on, then
              every W, spend ``hysteresis``, and raise :class:`LossScaleFloorError` when a backoff is due at
              ``min_loss_scale``. Defaults before 0.17.1, when the section sets none of the dynamic keys: ZeRO
              uses its loss scaler's own (2**32, window 1000, hysteresis 1, floor 1), stage 0 the section's
              (2**16, window 1000, floor 1; 0.25 with ``fused_optimizer=False``). From 0.17.1 on the section's
              defaults always apply, and ``min_loss_scale`` must be an integer.
            * megatron: ``initial_scale`` (2**32), ``min_scale`` (1), ``growth_factor`` (2), ``backoff_factor``
              (0.5), ``growth_interval`` (1000), ``hysteresis`` (2); ``loss_scale`` (a number: the static
              ``ConstantGradScaler``). Factors are rounded to fp32 as Megatron's fp32 tensors hold them.
            * nnabla: ``scale`` (8), ``scaling_factor`` (2), ``N`` (2000): the scale grows when more than ``N``
              clean steps have passed since the start, an overflow or the last growth, i.e. on the ``(N+2)``-th
              clean step and then every ``N+1``. The scale never hits a floor (mixprec stops at 2**-126) or a
              ceiling. Its retry of an overflowing batch (up to 100 times) is :class:`mixprec.Updater`'s
              ``max_retries=100``, its summed microbatch gradients ``microbatch_reduction="sum"``.

    Raises:
        ValueError: an unknown framework (the message lists them), a value out of range (named by its key), or
            a saved state that the settings contradict (named by its entry).
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
        _LOADERS[framework](scaler, state_dict, settings)
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


def _deepspeed_release(version: Any) -> tuple[int, int, int]:
    """The release line to reproduce: ``version``, else the installed deepspeed's, else the newest."""
    what = "version"
    if version is None:
        try:
            version = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            return _DS_PR_6976
        what = "the installed deepspeed's version (give version= to choose another)"
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as '0.16.9'; got {type(version).__name__} {version!r}")
    # a local or pre-release tag (0.17.1+cpu, 0.18.0rc1) counts as the release it names
    found = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"{what} must be a DeepSpeed release such as '0.16.9' or '0.19.8'; got {version!r}")
    release = (int(found[1]), int(found[2]), int(found[3] or 0))
    if release < _DS_OLDEST:
        raise ValueError(
            f"{what} is {version!r}: mixprec reproduces DeepSpeed 0.9.3 and later (the first release that reads "
            "consecutive_hysteresis)"
        )
    return release


def _deepspeed(s: dict[str, Any], given: set[str], group: dist.ProcessGroup | None) -> LossScaler:
    enabled = check_bool("enabled", s["enabled"])
    check_bool("auto_cast", s["auto_cast"])
    check_bool("fp16_master_weights_and_grads", s["fp16_master_weights_and_grads"])
    stage = check_choice("zero_stage", check_positive_int("zero_stage", s["zero_stage"], minimum=0), (0, 1, 2, 3))
    config_model = _deepspeed_release(s["version"]) >= _DS_PR_6976
    raise_at_min = check_bool("raise_error_at_min_scale", s["raise_error_at_min_scale"])
    fused = check_bool("fused_optimizer", s["fused_optimizer"])
    if stage == 0 and "raise_error_at_min_scale" in given:
        raise ValueError(
            "raise_error_at_min_scale is an argument of ZeRO's loss scaler (zero_stage 1-3); stage 0 "
            "never raises at its floor"
        )
    if stage > 0 and "fused_optimizer" in given:
        raise ValueError("fused_optimizer only matters for zero_stage=0 (ZeRO builds its own loss scaler)")
    if config_model and isinstance(s["min_loss_scale"], float) and not s["min_loss_scale"].is_integer():
        raise ValueError(
            f"min_loss_scale must be an integer from DeepSpeed 0.17.1 on (its fp16 config model reads an int); got "
            f"{s['min_loss_scale']!r}"
        )
    loss_scale = check_positive_float("loss_scale", s["loss_scale"], allow_zero=True)
    if loss_scale != 0:
        return StaticLossScaler(loss_scale, enabled=enabled, group=group)
    if not config_model and not given & set(_DS_DYNAMIC_KEYS):
        if stage > 0:
            s = {**s, **_DS_ZERO_DEFAULTS}
        elif not fused:
            s = {**s, "min_loss_scale": _DS_UNFUSED_MIN_LOSS_SCALE}
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
    # loss_scaler.DynamicLossScaler.update_scale: raises (raise_error_at_min_scale) instead of a backoff that finds
    # the scale at its minimum; from 0.17.1 it grows on FP16_Optimizer's schedule, before on the W-th clean step
    return DynamicLossScaler(
        **common,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        on_min_scale="raise" if raise_at_min else "ignore",
        min_patience=1,
        floor_counts="backoffs",
        growth_delay=1 if config_model else 0,
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
    if hasattr(state, "__dict__"):  # an updater or scaler object: its attributes
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


def _load_torch(scaler: LossScaler, state: Any, settings: dict[str, Any]) -> None:
    state = _as_dict(state, "GradScaler.state_dict()")
    _only(state, ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"), "torch")
    scaler.load_state_dict(state)


def _load_megatron(scaler: LossScaler, state: Any, settings: dict[str, Any]) -> None:
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


def _deepspeed_entries(state: Any) -> tuple[dict[str, Any], Callable[[str], str], str | None]:
    """A DeepSpeed scaler state as given: its entries, how an error names one (as the caller wrote it), and
    whose it is: ``"zero"`` (ZeRO's loss scaler), ``"stage0"`` (FP16_Optimizer's state dict) or None (unknown)."""
    if isinstance(state, Mapping) and "loss_scaler" in state:  # a ZeRO optimizer's state dict
        inner = state["loss_scaler"]
        if isinstance(inner, Mapping):
            return dict(inner), lambda key: f"state_dict['loss_scaler'][{key!r}]", "zero"
        if hasattr(inner, "__dict__"):  # DeepSpeed pickles its loss-scaler object into ZeRO checkpoints
            return dict(vars(inner)), lambda key: f"state_dict['loss_scaler'].{key}", "zero"
        raise TypeError(
            f"state_dict['loss_scaler'] must be DeepSpeed's loss scaler (object or attribute dict); got "
            f"{type(inner).__name__}"
        )
    if isinstance(state, Mapping):
        entries, name = dict(state), (lambda key: f"state_dict[{key!r}]")
    elif hasattr(state, "__dict__"):
        entries, name = dict(vars(state)), (lambda key: f"state_dict.{key}")
    else:
        raise TypeError(
            f"state_dict must be a DeepSpeed optimizer state dict or loss scaler; got {type(state).__name__}"
        )
    kind = "zero" if "dynamic" in entries else "stage0" if "dynamic_loss_scale" in entries else None
    return entries, name, kind


def _load_deepspeed(scaler: LossScaler, state: Any, settings: dict[str, Any]) -> None:
    entries, name, kind = _deepspeed_entries(state)
    stage = settings["zero_stage"]
    if kind == "zero" and stage == 0:
        raise ValueError("state_dict holds a ZeRO loss scaler but zero_stage=0: give the stage of the saving run")
    if kind == "stage0" and stage > 0:
        raise ValueError(
            f"state_dict is a stage-0 optimizer's (it has 'dynamic_loss_scale' and no 'loss_scaler') but "
            f"zero_stage={stage}: give the stage of the saving run"
        )
    if "cur_scale" not in entries:
        raise KeyError(
            "the DeepSpeed scaler state lacks 'cur_scale': give the optimizer's state dict (stage 0: cur_scale, "
            "cur_iter, last_overflow_iter, the 'optimizer' entry of a checkpoint file; ZeRO: the one holding "
            "'loss_scaler', the 'optimizer_state_dict' entry) or the loss scaler itself"
        )
    dynamic = isinstance(scaler, DynamicLossScaler)
    for flag in ("dynamic", "dynamic_loss_scale"):
        if flag in entries and check_bool(name(flag), entries[flag]) is not dynamic:
            raise ValueError(
                f"{name(flag)} is {entries[flag]!r} but loss_scale={settings['loss_scale']!r} "
                f"({'dynamic' if dynamic else 'static'}): DeepSpeed resumes with the saved scaler"
            )
    scale = _saved_scale(name("cur_scale"), entries["cur_scale"])
    if not dynamic:
        scaler.load_state_dict({"scale": scale})
        return
    scaler = cast(DynamicLossScaler, scaler)
    _check_saved_rule(scaler, entries, name)
    floor = cast(float, scaler.min_scale)
    if scale < floor:
        raise ValueError(f"{name('cur_scale')} ({scale}) must be >= min_loss_scale ({floor})")
    for key in ("cur_iter", "last_overflow_iter"):
        if key not in entries:
            raise KeyError(f"the DeepSpeed scaler state lacks {key!r} (saved by a dynamic loss scaler?)")
    cur_iter = check_positive_int(name("cur_iter"), entries["cur_iter"], minimum=0)
    last = _int(name("last_overflow_iter"), entries["last_overflow_iter"])
    if not -1 <= last < cur_iter:
        raise ValueError(f"{name('last_overflow_iter')} ({last}) must lie in [-1, cur_iter={cur_iter})")
    clean = cur_iter - last - 1  # clean steps since the last overflow (or the start)
    delay, window = scaler.growth_delay, scaler.growth_interval
    tracker = clean - delay if clean < delay else (clean - delay) % window
    loaded: dict[str, Any] = {"scale": scale, "_growth_tracker": tracker}
    if "cur_hysteresis" in entries:
        # DeepSpeed backs off when an overflow finds cur_hysteresis at 1 and never lets it below 1
        hysteresis = _int(name("cur_hysteresis"), entries["cur_hysteresis"])
        if not 1 <= hysteresis <= scaler.hysteresis:
            raise ValueError(
                f"{name('cur_hysteresis')} must lie in [1, hysteresis={scaler.hysteresis}]; got {hysteresis}"
            )
        loaded["hysteresis_left"] = hysteresis
    scaler.load_state_dict(loaded)


def _saved_scale(name: str, value: Any) -> float:
    """A saved DeepSpeed scale: a number (or one-element tensor) that is a normal fp32 number."""
    return _check_scale(name, _scalar(name, value))


def _check_saved_rule(scaler: DynamicLossScaler, entries: dict[str, Any], name: Callable[[str], str]) -> None:
    """DeepSpeed resumes with the window, hysteresis and floor it saved, whatever its config says now: refuse a
    state whose saved rule differs from the settings, naming both."""
    if "scale_factor" in entries and _saved_number(name("scale_factor"), entries["scale_factor"]) != 2.0:
        raise ValueError(
            f"{name('scale_factor')} must be 2 (DeepSpeed's config fixes it); got {entries['scale_factor']!r}"
        )
    # saved entry -> (the setting that must equal it, its value here)
    rule: dict[str, tuple[str, Any]] = {
        "scale_window": ("loss_scale_window", scaler.growth_interval),
        "min_scale": ("min_loss_scale", scaler.min_scale),
        "delayed_shift": ("hysteresis", scaler.hysteresis),
        "consecutive_hysteresis": ("consecutive_hysteresis", scaler.consecutive_hysteresis),
        "raise_error_at_min_scale": ("raise_error_at_min_scale", scaler.on_min_scale == "raise"),
    }
    for key, (setting, ours) in rule.items():
        if key not in entries:
            continue
        saved = entries[key]
        if isinstance(ours, bool):
            same = check_bool(name(key), saved) == ours
        else:  # DeepSpeed's numbers are Python floats or ints; mixprec's floor is rounded to fp32
            same = _round_to_fp32(_saved_number(name(key), saved)) == ours
        if not same:
            raise ValueError(
                f"{name(key)} is {saved!r} but {setting}={ours!r}: DeepSpeed resumes with the saved value, so pass "
                f"{setting}={saved!r}"
            )


def _saved_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}")
    return float(value)


def _load_nnabla(scaler: LossScaler, state: Any, settings: dict[str, Any]) -> None:
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


_LOADERS: dict[str, Callable[[LossScaler, Any, dict[str, Any]], None]] = {
    "torch": _load_torch,
    "deepspeed": _load_deepspeed,
    "megatron": _load_megatron,
    "nnabla": _load_nnabla,
}
