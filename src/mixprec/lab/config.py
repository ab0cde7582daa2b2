"""The configuration of a ``mixprec train`` run: :class:`TrainConfig`, one section per component (the sections
are :mod:`mixprec.lab.sections`, re-exported here), and its TOML files.

TrainConfig checks what spans sections (batch sizes over the ranks, the loss scale against the scaler's range, a
block-scaled recipe's blocks against the model and batch shapes). Precedence: field defaults, then a TOML file
(one table per section), then command-line flags (``--section.field``). Every key lives in its section's table:
a bare top-level ``key = value`` is refused in one line that names the table it belongs in. docs/lab.md lists
every field.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from mixprec.emulate import RECIPES
from mixprec.lab.sections import (
    COMPRESSED_REDUCTIONS,
    DEVICES,
    FP8_FORMATS,
    HIERARCHICAL_REDUCTIONS,
    LINEAR_MODES,
    LOSS_SCALERS,
    LR_SCHEDULES,
    MAX_SEED,
    MAX_SIMULATED_RANKS,
    NATIVE_ALGORITHMS,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_ROUNDINGS,
    REDUCTIONS,
    SECTIONS,
    SIMULATED_REDUCTIONS,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ScalerConfig,
    TrainingConfig,
    check_linear_mode_file,
)
from mixprec.scaling import LossScaler, advise

__all__ = [
    "COMPRESSED_REDUCTIONS",
    "DEVICES",
    "FP8_FORMATS",
    "HIERARCHICAL_REDUCTIONS",
    "LINEAR_MODES",
    "LOSS_SCALERS",
    "LR_SCHEDULES",
    "MAX_SEED",
    "MAX_SIMULATED_RANKS",
    "NATIVE_ALGORITHMS",
    "OPTIMIZERS",
    "PRECISIONS",
    "REDUCE_ROUNDINGS",
    "REDUCTIONS",
    "RESUMABLE_FIELDS",
    "SECTIONS",
    "SIMULATED_REDUCTIONS",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ScalerConfig",
    "TrainConfig",
    "TrainingConfig",
    "builtin_configs",
    "check_linear_mode_file",
    "config_from_toml",
    "config_to_toml",
    "field_docs",
    "flat_fields",
    "merge_config",
    "nest_sections",
]

# Fields a resumed run may change: none of them touches the numerics of a training step.
RESUMABLE_FIELDS = frozenset(
    {
        "training.steps",
        "training.eval_interval",
        "training.checkpoint_interval",
        "training.headroom_interval",
        "training.out_dir",
        "data.eval_sequences",
        "parallel.timeout",
    }
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run, one section per component. The defaults train a 0.45M-parameter
    GPT for 300 steps; tokens per optimizer step = global_batch_size x block_size (32 x 64 = 2048)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}; got {type(getattr(self, name)).__name__}")
        advice = advise(self.data.global_batch_size, self.data.micro_batch_size, self.parallel.ranks, 1.0)
        if advice.num_microbatches is None:
            raise ValueError(
                "global_batch_size: " + "; ".join(f.message for f in advice.findings if f.code == "gbs-not-divisible")
            )
        self.build_scaler()  # init_scale against the dynamic scaler's range, when this run's scaler is dynamic
        self._check_linear_recipe()
        if self.parallel.simulate_dp and self.training.device == "cuda":
            raise ValueError("simulate_dp runs on the CPU (its reduction models are checked there); use device 'cpu'")

    def _check_linear_recipe(self) -> None:
        """A block-scaled recipe contracts every GEMM in whole blocks, without padding: the width (Fprop and Dgrad;
        the LM head, whose vocabulary is known later, is kept in precision when it is not whole blocks) and the
        tokens of a microbatch (Wgrad, and NVFP4's Hadamard transform along them)."""
        if self.model.linear_mode not in RECIPES:
            return
        mode, recipe = self.model.linear_mode, RECIPES[self.model.linear_mode]
        width = max((recipe.block, *(recipe.weight_tile or ())))
        if self.model.n_embd % width:
            raise ValueError(
                f"model.n_embd ({self.model.n_embd}) must be a multiple of {width} with model.linear_mode {mode!r} "
                "(every linear layer's GEMMs contract over it in blocks; no padding)"
            )
        rows = max(recipe.block, recipe.wgrad_hadamard or 1)
        mbs, block = self.data.micro_batch_size, self.model.block_size
        if (mbs * block) % rows:
            raise ValueError(
                f"data.micro_batch_size x model.block_size ({mbs} x {block} = {mbs * block} tokens) must be a "
                f"multiple of {rows} with model.linear_mode {mode!r} (the weight-gradient GEMM contracts over the "
                "tokens in blocks; no padding)"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "configuration") -> TrainConfig:
        """A TrainConfig from ``{section: {field: value}}`` (see :func:`nest_sections`)."""
        return cls(**{name: SECTIONS[name](**values) for name, values in nest_sections(data, where).items()})

    @classmethod
    def from_fields(cls, values: dict[str, Any], where: str = "configuration") -> TrainConfig:
        """A TrainConfig from ``{field: value}`` by the fields' own names, for code that plans many runs (no two
        sections share a field name); an unknown name raises ValueError naming it. Files and flags are always
        sectioned (:meth:`from_dict`)."""
        owner = {f.name: section for section, f in flat_fields()}
        unknown = sorted(k for k in values if k not in owner)
        if unknown:
            hints = [hint for key in unknown if (hint := _hint(key))]
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))}"
                + (f" ({'; '.join(hints)})" if hints else "")
            )
        nested: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            nested[owner[key]][key] = value
        return cls.from_dict(nested, where)

    @property
    def num_microbatches(self) -> int:
        """GBS / (MBS x ranks): microbatches each rank accumulates per optimizer step."""
        return self.data.global_batch_size // (self.data.micro_batch_size * self.parallel.ranks)

    @property
    def resolved_loss_scaler(self) -> str:
        """'none', 'static' or 'dynamic' ('auto' resolved by precision)."""
        return self.scaler.resolved_kind(self.model.precision)

    def build_scaler(self) -> LossScaler:
        """The run's loss scaler (see :meth:`ScalerConfig.build`)."""
        return self.scaler.build(self.model.precision)

    def advice(self) -> Any:
        """The loss-scale advisor's verdict on (GBS, MBS, ranks, loss scale); see :func:`mixprec.scaling.advise`."""
        scale = 1.0 if self.resolved_loss_scaler == "none" else self.scaler.init_scale
        return advise(self.data.global_batch_size, self.data.micro_batch_size, self.parallel.ranks, scale)

    def replace(self, **changes: dict[str, Any]) -> TrainConfig:
        """A copy with some fields of some sections changed: ``cfg.replace(parallel={"nproc": 2})``."""
        return dataclasses.replace(
            self, **{name: dataclasses.replace(getattr(self, name), **values) for name, values in changes.items()}
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def flat_fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """(section name, field) for every field of every section, in order."""
    return [(name, f) for name, cls in SECTIONS.items() for f in fields(cls)]


def nest_sections(data: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """``data`` as ``{section: {field: value}}``. Everything lives in a section's table: a top-level key that is
    not one (a field's bare name among them), or an unknown key inside a table, raises ValueError in one line
    naming it and the sectioned name it resembles."""
    nested: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    unknown = []
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            _check_section_keys(key, value, where)
            nested[key].update(value)
        else:
            unknown.append(key)
    if unknown:
        hints = [hint for key in sorted(unknown) if (hint := _hint(key))]
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(repr(k) for k in sorted(unknown))}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + "; a configuration holds only the tables "
            + ", ".join(f"[{s}]" for s in SECTIONS)
        )
    return nested


def _hint(key: str) -> str | None:
    """Where a bare key probably belongs: the section of a field of that name, or the closest sectioned name."""
    if key in SECTIONS:
        return f"{key!r} is a section: write it as a [{key}] table"
    names = [f"{section}.{f.name}" for section, f in flat_fields()]
    owners = [name for name in names if name.split(".", 1)[1] == key]
    close = owners or difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not close:
        close = [n for n in names if difflib.get_close_matches(key, [n.split(".", 1)[1]], n=1, cutoff=0.6)][:1]
    if not close:
        return None
    section = close[0].split(".", 1)[0]
    return f"{key!r} is {close[0]}: put it in the [{section}] table" if owners else f"did you mean {close[0]}?"


def _check_section_keys(section: str, values: dict[str, Any], where: str) -> None:
    known = [f.name for f in fields(SECTIONS[section])]
    unknown = sorted(k for k in values if k not in known)
    if not unknown:
        return
    hints = [f"{k!r}: did you mean {m[0]!r}?" for k in unknown if (m := difflib.get_close_matches(k, known, n=1))]
    raise ValueError(
        f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)} in [{section}]"
        + (f" ({'; '.join(hints)})" if hints else "")
        + f"; allowed keys: {', '.join(known)}"
    )


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal after it in its class body) by ``section.field``, for --help
    and config.toml. Read from the source with ``ast``; empty when the source is not available."""
    docs: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        try:
            body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError):
            continue
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[f"{section}.{node.target.id}"] = " ".join(nxt.value.value.split())
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


def config_from_toml(path: str) -> dict[str, dict[str, Any]]:
    """Read a TOML file of ``[section]`` tables (or a built-in example by name) as ``{section: {field: value}}``.
    Raises ValueError on unknown keys, bad syntax or a missing file."""
    path = resolve_config_path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path!r}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path!r} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ValueError(f"config file {path!r} nests arrays or tables too deeply to be a configuration") from None
    return nest_sections(data, f"config file {path!r}")


def merge_config(*layers: dict[str, dict[str, Any]]) -> TrainConfig:
    """A TrainConfig from ``{section: {field: value}}`` layers, later layers winning (e.g. TOML, then flags);
    None values are unset."""
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for layer in layers:
        for section, values in nest_sections(layer, "configuration").items():
            merged[section].update({k: v for k, v in values.items() if v is not None})
    return TrainConfig(**{name: SECTIONS[name](**values) for name, values in merged.items()})


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest repr that round-trips, valid TOML for finite floats
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def config_to_toml(cfg: TrainConfig, header: str = "") -> str:
    """The configuration as TOML tables that :func:`config_from_toml` reads back to an equal TrainConfig."""
    docs = field_docs()
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for f in fields(SECTIONS[section]):
            if docs.get(f"{section}.{f.name}"):
                lines.append(f"# {docs[f'{section}.{f.name}']}")
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
    return "\n".join(lines).lstrip("\n") + "\n"
