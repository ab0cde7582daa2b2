"""The configuration of a ``mixprec train`` run: one validated, keyword-only dataclass.

Precedence: field defaults, then a TOML file (flat ``key = value`` pairs, the field names), then command-line
flags. Unknown keys and wrong types are errors (``ValueError``/``TypeError``; exit code 2 in the CLI). A run saves
its resolved configuration as ``config.toml`` in its directory, which ``--config`` accepts back.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass, fields
from typing import Any

from mixprec.core.dtypes import Rounding
from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.scaling.advisor import advise
from mixprec.scaling.scaler import DynamicLossScaler, LossScaler, OnMinScale, StaticLossScaler

__all__ = [
    "DEVICES",
    "LINEAR_MODES",
    "LOSS_SCALERS",
    "ON_MIN_LOSS_SCALE",
    "OPTIMIZERS",
    "PRECISIONS",
    "REDUCE_ROUNDINGS",
    "REDUCTIONS",
    "TrainConfig",
    "builtin_configs",
    "config_from_toml",
    "config_to_toml",
    "field_docs",
    "merge_config",
]

PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_SCALERS = ("auto", "none", "static", "dynamic")
REDUCTIONS = ("native", "fp32_accumulate", "uint8", "uint8_hierarchical")
OPTIMIZERS = ("adamw", "sgd")
LINEAR_MODES = ("off", "fp16/16", "fp16/32", "bf16/32", "two_stage", "fp8/promote128")
DEVICES = ("auto", "cpu", "cuda")
REDUCE_ROUNDINGS: tuple[str, ...] = typing.get_args(Rounding)  # mixprec.comm's roundings
ON_MIN_LOSS_SCALE: tuple[str, ...] = typing.get_args(OnMinScale)  # the dynamic scaler's choices

# TrainConfig field -> the loss scaler's argument it fills (the scaler's own errors name the argument).
_SCALER_ARGUMENTS = {
    "loss_scale": "init_scale",
    "scale_growth_factor": "growth_factor",
    "scale_backoff_factor": "backoff_factor",
    "scale_growth_interval": "growth_interval",
    "scale_hysteresis": "hysteresis",
    "scale_consecutive_hysteresis": "consecutive_hysteresis",
    "min_loss_scale": "min_scale",
    "max_loss_scale": "max_scale",
    "on_min_loss_scale": "on_min_scale",
    "scale_min_patience": "min_patience",
}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run. The defaults train a 0.45M-parameter GPT for 300 steps.

    Tokens per optimizer step = global_batch_size x block_size (32 x 64 = 2048 with the defaults).
    """

    # ---------------------------------------------------------------- model
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream, in channels."""
    block_size: int = 64
    """Context length, in characters (tokens)."""
    dropout: float = 0.0
    """Dropout probability; 0 disables. Its randomness is a function of (seed, step, rank), so resume is exact."""

    # ---------------------------------------------------------------- data
    corpus: str = "stdlib"
    """'stdlib' (Python's own standard library sources, built in) or a path to a UTF-8 text file."""

    # ---------------------------------------------------------------- batch
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over all ranks (GBS)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (MBS); num_microbatches = GBS / (MBS x ranks)."""

    # ---------------------------------------------------------------- precision
    precision: str = "fp32"
    """Parameter and gradient precision: 'fp32', 'bf16' or 'fp16' (low precisions keep fp32 master weights)."""
    loss_scaler: str = "auto"
    """'none' (scale 1, still skips inf/NaN steps), 'static', 'dynamic', or 'auto' (dynamic for fp16, else none)."""
    loss_scale: float = 65536.0
    """The static loss scale, or the dynamic scaler's initial scale (a multiplier, no unit)."""
    scale_growth_interval: int = 2000
    """Dynamic scaler: clean steps between two growths of the scale, in steps."""
    scale_growth_factor: float = 2.0
    """Dynamic scaler: multiplier on growth, > 1."""
    scale_backoff_factor: float = 0.5
    """Dynamic scaler: multiplier on overflow, in (0, 1)."""
    scale_hysteresis: int = 1
    """Dynamic scaler: overflows tolerated before backing off, in steps (1 = back off at once)."""
    scale_consecutive_hysteresis: bool = False
    """Dynamic scaler: refill the hysteresis on every clean step, so only consecutive overflows back off
    (DeepSpeed); false refills it only when the scale grows."""
    min_loss_scale: float = 1.0
    """Dynamic scaler: floor of the scale; 0 = none of its own (it still never goes below fp32's smallest normal
    number, 2**-126)."""
    max_loss_scale: float = 0.0
    """Dynamic scaler: ceiling of the scale; 0 = none (as torch's GradScaler)."""
    scale_min_patience: int = 10
    """Dynamic scaler: consecutive overflowing steps at the floor before on_min_loss_scale acts, in steps."""
    on_min_loss_scale: str = "raise"
    """Dynamic scaler stuck at its floor: 'raise' (stop the run with an error, exit code 1), 'warn' or 'ignore'
    (keep skipping steps)."""
    max_consecutive_skips: int = 20
    """Static scaler (and 'none'): stop the run after this many consecutive steps with inf/NaN gradients, in
    steps (such a scale cannot adapt: the run diverged or the scale is too large); 0 never stops."""
    linear_mode: str = "off"
    """Emulated accumulation of every linear layer ('fp16/16', 'fp16/32', 'bf16/32', 'two_stage',
    'fp8/promote128'; mixprec.emulate), or 'off' for the precision's own matmuls."""

    # ---------------------------------------------------------------- data parallel
    nproc: int = 1
    """Ranks to start with --nproc (gloo on CPU, NCCL on GPU); under torchrun its WORLD_SIZE replaces it."""
    reduce: str = "fp32_accumulate"
    """Gradient reduction across ranks: 'fp32_accumulate' (gradient-dtype wire, fp32 sum, one rounding), 'native'
    (the backend's own collective, summing in the gradient dtype), 'uint8' or 'uint8_hierarchical' (8-bit
    compression). No effect with one rank."""
    reduce_rounding: str = "nearest"
    """'nearest' or 'stochastic' (unbiased): the rounding of fp32_accumulate's result to bf16/fp16, or of uint8's
    quantization. native rounds to nearest only."""
    error_feedback: bool = False
    """uint8 reductions: keep each quantization's residual and add it back at the next step."""
    ranks_per_node: int = 0
    """Ranks per node for 'uint8_hierarchical'; 0 = LOCAL_WORLD_SIZE under torchrun, else nproc // 2 (two
    simulated nodes on one machine)."""
    sharded_optimizer: bool = False
    """ZeRO-1: each rank keeps master weights and optimizer state for its shard only."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available)."""
    timeout: float = 300.0
    """Process-group timeout, in seconds: a rank waiting longer than this on a collective stops with an error."""

    # ---------------------------------------------------------------- optimizer
    optimizer: str = "adamw"
    """'adamw' or 'sgd' (with momentum)."""
    lr: float = 2e-3
    """Learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled weight decay for AdamW, L2 for SGD; 0 disables."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.99
    """AdamW's second-moment decay."""
    momentum: float = 0.9
    """SGD momentum; 0 disables."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (taken in fp32) to this value; 0 disables."""

    # ---------------------------------------------------------------- run
    seed: int = 0
    """Seed of the initial weights, the batches and dropout. Same seed, same data order in every run."""
    steps: int = 300
    """Optimizer steps (attempts, skipped ones included)."""
    eval_interval: int = 50
    """Validation loss every this many steps (before that step's update) and after the last step's update (the
    final model, reported in summary.json), in steps; 0 disables."""
    eval_sequences: int = 64
    """Validation sequences (of block_size characters) per evaluation, split over the ranks."""
    checkpoint_interval: int = 100
    """A checkpoint every this many steps, in steps, and always at the end; 0 = only at the end."""
    out_dir: str = "runs/mixprec"
    """Run directory: config.toml, metrics.jsonl, checkpoint.pt, summary.json."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _FIELD_TYPES[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                value = float(value)
            if kind is bool:
                if not isinstance(value, bool):
                    raise TypeError(f"{f.name} must be true or false; got {type(value).__name__} {value!r}")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{f.name} must be an integer; got {type(value).__name__} {value!r}")
            elif kind is float:
                if not isinstance(value, float) or not math.isfinite(value):
                    raise TypeError(f"{f.name} must be a finite number; got {type(value).__name__} {value!r}")
            elif not isinstance(value, str):
                raise TypeError(f"{f.name} must be a string; got {type(value).__name__} {value!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "global_batch_size", "micro_batch_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("nproc", "steps", "eval_sequences"):
            check_positive_int(name, getattr(self, name))
        for name in ("eval_interval", "checkpoint_interval", "seed", "ranks_per_node", "max_consecutive_skips"):
            check_positive_int(name, getattr(self, name), minimum=0)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1); got {self.dropout!r}")
        if not self.corpus:
            raise ValueError("corpus must be 'stdlib' or a path to a UTF-8 text file; got an empty string")
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("loss_scaler", self.loss_scaler, LOSS_SCALERS)
        check_choice("reduce", self.reduce, REDUCTIONS)
        check_choice("reduce_rounding", self.reduce_rounding, REDUCE_ROUNDINGS)
        if self.reduce == "native" and self.reduce_rounding != "nearest":
            raise ValueError(
                "reduce_rounding='stochastic' needs reduce 'fp32_accumulate', 'uint8' or 'uint8_hierarchical'"
            )
        if self.error_feedback and not self.reduce.startswith("uint8"):
            raise ValueError(f"error_feedback applies to the uint8 reductions only; reduce is {self.reduce!r}")
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("linear_mode", self.linear_mode, LINEAR_MODES)
        check_choice("device", self.device, DEVICES)
        self._check_scaler_fields()
        check_positive_float("timeout", self.timeout)
        check_positive_float("lr", self.lr)
        check_positive_float("weight_decay", self.weight_decay, allow_zero=True)
        check_positive_float("grad_clip", self.grad_clip, allow_zero=True)
        for name in ("beta1", "beta2", "momentum"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must lie in [0, 1); got {v!r}")
        if self.sharded_optimizer and self.nproc == 1:
            raise ValueError("sharded_optimizer needs nproc >= 2 (with one rank there is nothing to shard)")
        if not self.out_dir:
            raise ValueError("out_dir must name a directory; got an empty string")
        advice = advise(self.global_batch_size, self.micro_batch_size, self.nproc, self.loss_scale)
        if advice.num_microbatches is None:
            raise ValueError(
                "global_batch_size: " + "; ".join(f.message for f in advice.findings if f.code == "gbs-not-divisible")
            )
        if self.reduce == "uint8_hierarchical" and self.ranks_per_node and self.nproc % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of ranks ({self.nproc})")

    def _check_scaler_fields(self) -> None:
        """The loss scalers validate their own arguments: build them (cheap, no tensors) and translate their
        errors' argument names into this configuration's field names."""
        try:
            for m in ("min_loss_scale", "max_loss_scale"):
                check_positive_float(m, getattr(self, m), allow_zero=True)
            StaticLossScaler(self.loss_scale)
            if self.resolved_loss_scaler == "dynamic":
                self.build_scaler()
            else:
                # Unused by this run, but a config file is edited and reused: check the fields on their own,
                # from a start the scaler's range admits.
                start = self.min_loss_scale or self.max_loss_scale or 1.0
                DynamicLossScaler(**self._dynamic_scaler_arguments(), init_scale=start)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            named = [
                f"{arg} is {field}" for field, arg in _SCALER_ARGUMENTS.items() if re.search(rf"\b{arg}\b", message)
            ]
            hint = f" (in this configuration {', '.join(named)})" if named else ""
            raise type(exc)(f"loss scaler: {message}{hint}") from None

    def _dynamic_scaler_arguments(self) -> dict[str, Any]:
        return {
            "growth_factor": self.scale_growth_factor,
            "backoff_factor": self.scale_backoff_factor,
            "growth_interval": self.scale_growth_interval,
            "hysteresis": self.scale_hysteresis,
            "consecutive_hysteresis": self.scale_consecutive_hysteresis,
            "min_scale": self.min_loss_scale or None,
            "max_scale": self.max_loss_scale or None,
            "on_min_scale": self.on_min_loss_scale,
            "min_patience": self.scale_min_patience,
        }

    def build_scaler(self) -> LossScaler:
        """The run's loss scaler: ``StaticLossScaler(1.0)`` for 'none' (it still detects and skips inf/NaN
        steps), ``StaticLossScaler(loss_scale)``, or a DynamicLossScaler from the scale_*/loss-scale fields."""
        kind = self.resolved_loss_scaler
        if kind == "none":
            return StaticLossScaler(1.0)
        if kind == "static":
            return StaticLossScaler(self.loss_scale)
        return DynamicLossScaler(init_scale=self.loss_scale, **self._dynamic_scaler_arguments())

    # ---------------------------------------------------------------- derived
    @property
    def num_microbatches(self) -> int:
        """GBS / (MBS x ranks): microbatches each rank accumulates per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.nproc)

    @property
    def resolved_loss_scaler(self) -> str:
        """'none', 'static' or 'dynamic' ('auto' resolved by precision)."""
        if self.loss_scaler != "auto":
            return self.loss_scaler
        return "dynamic" if self.precision == "fp16" else "none"

    def advice(self) -> Any:
        """The loss-scale advisor's verdict on (GBS, MBS, ranks, loss scale); see :func:`mixprec.scaling.advise`."""
        scale = 1.0 if self.resolved_loss_scaler == "none" else self.loss_scale
        return advise(self.global_batch_size, self.micro_batch_size, self.nproc, scale)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_TYPES: dict[str, type] = {
    f.name: {"int": int, "float": float, "bool": bool, "str": str}[str(f.type)] for f in fields(TrainConfig)
}


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal after it in the class body), for ``--help``.

    Read from the source with ``ast``; empty strings when the source is not available (e.g. a .pyc-only install).
    """
    try:
        tree = ast.parse(inspect.getsource(TrainConfig))
    except (OSError, TypeError):
        return {f.name: "" for f in fields(TrainConfig)}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def builtin_configs() -> list[str]:
    """Names of the example configurations shipped in ``mixprec/lab/configs`` (``--config NAME`` finds them)."""
    if not os.path.isdir(CONFIGS_DIR):
        return []
    return sorted(f.removesuffix(".toml") for f in os.listdir(CONFIGS_DIR) if f.endswith(".toml"))


def resolve_config_path(name_or_path: str) -> str:
    """An existing file, else a built-in example's path by name (with or without ``.toml``)."""
    if os.path.isfile(name_or_path):
        return name_or_path
    candidate = os.path.join(CONFIGS_DIR, name_or_path.removesuffix(".toml") + ".toml")
    if os.sep not in name_or_path and os.path.isfile(candidate):
        return candidate
    raise ValueError(
        f"config file not found: {name_or_path!r} (built-in examples: {', '.join(builtin_configs()) or 'none'})"
    )


def config_from_toml(path: str) -> dict[str, Any]:
    """Read a flat TOML file of TrainConfig fields (or a built-in example by name). Raises ValueError on unknown
    keys, tables, bad syntax or a missing file."""
    path = resolve_config_path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path!r}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise ValueError(
            f"config file {path!r}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed keys: {', '.join(sorted(known))}"
        )
    return data


def merge_config(*layers: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from dicts of field values, later layers winning (e.g. TOML, then flags)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown configuration key(s): {', '.join(unknown)}")
    return TrainConfig(**merged)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest repr that round-trips, valid TOML for finite floats
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def config_to_toml(cfg: TrainConfig, header: str = "") -> str:
    """The configuration as flat TOML that :func:`config_from_toml` reads back to an equal TrainConfig."""
    docs = field_docs()
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for f in fields(cfg):
        if docs.get(f.name):
            lines.append(f"# {docs[f.name]}")
        lines.append(f"{f.name} = {_toml_value(getattr(cfg, f.name))}")
    return "\n".join(lines) + "\n"
