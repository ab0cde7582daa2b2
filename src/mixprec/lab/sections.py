"""The sections of a ``mixprec train`` configuration: one keyword-only dataclass per component.

Each section's fields carry the argument names of the component it configures ([model]: GPTConfig and the
emulator's mode; [data]: the batch functions of mixprec.lab.data; [scaler]: DynamicLossScaler; [optimizer]:
torch.optim.AdamW / SGD; [parallel]: DistributedDataParallel, Topology, init_process_group; [training]: the loop
and the Updater), and each section validates itself, so an error names the field as the file spells it.
:class:`mixprec.lab.config.TrainConfig` nests them and checks what spans sections; docs/lab.md lists every field.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from mixprec.core.dtypes import ROUNDINGS
from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.emulate import RECIPES, Fingerprint
from mixprec.lab.reduction import reducer_traits
from mixprec.scaling import DynamicLossScaler, LossScaler, StaticLossScaler

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
    "SECTIONS",
    "SIMULATED_REDUCTIONS",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ScalerConfig",
    "TrainingConfig",
    "check_linear_mode_file",
]

PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_SCALERS = ("auto", "none", "static", "dynamic")
# The reducers of mixprec.comm's registry that a run may name; what each takes is asked of the reducer itself
# (mixprec.lab.reduction), never of its name.
REDUCTIONS = (
    "native",
    "fp32_accumulate",
    "fp32_accumulate_hierarchical",
    "uint8",
    "uint8_hierarchical",
    "fp8",
    "fp8_hierarchical",
    "mxfp8",
    "mxfp8_hierarchical",
    "nvfp4",
    "nvfp4_hierarchical",
    "auto",
)
# The reductions that quantize the wire (mixprec.compress): error feedback and stochastic quantization apply.
COMPRESSED_REDUCTIONS = tuple(r for r in REDUCTIONS if reducer_traits(r).compressed)
# The two-stage reductions: inside each node, then across nodes (they need a Topology).
HIERARCHICAL_REDUCTIONS = tuple(r for r in REDUCTIONS if reducer_traits(r).hierarchical)
# [parallel] fields that only some reductions read -> (those reductions, in words and by name). Set with another
# reduce, the field would change nothing: it is refused, as a mistaken belief about the run.
_REDUCE_ONLY_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "error_feedback": ("the compressed reductions", COMPRESSED_REDUCTIONS),
    "ranks_per_node": ("the hierarchical reductions", HIERARCHICAL_REDUCTIONS),
    "link_gbps": ("the adaptive reduction", tuple(r for r in REDUCTIONS if reducer_traits(r).adaptive)),
}
FP8_FORMATS = ("e4m3", "e5m2")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "warmup_cosine")
# The presets of mixprec.emulate: accumulation models, then the block-scaled training recipes (emulate/recipes.py).
LINEAR_MODES = ("off", "fp16/16", "fp16/32", "bf16/32", "two_stage", "fp8/promote128", *RECIPES)
DEVICES = ("auto", "cpu", "cuda")
REDUCE_ROUNDINGS = ROUNDINGS
# What lab/simulate.py runs through the reducer's own model, bit for bit (tests/test_lab_simulate.py). The adaptive
# reduction is left out: its choice of wire per bucket comes from timing this machine's quantizer.
SIMULATED_REDUCTIONS = tuple(r for r in REDUCTIONS if not reducer_traits(r).adaptive)
NATIVE_ALGORITHMS = ("ring", "tree")
MAX_SIMULATED_RANKS = 4096


def _check_types(section: Any) -> None:
    """Type-check every field of a section from its annotation; ints are accepted (and stored) as floats."""
    for f in fields(section):
        value = getattr(section, f.name)
        kind = str(f.type)
        where = f"{_SECTION_OF[type(section)]}.{f.name}"
        if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(section, f.name, value)
        if kind == "bool" and not isinstance(value, bool):
            raise TypeError(f"{where} must be true or false; got {type(value).__name__} {value!r}")
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{where} must be an integer; got {type(value).__name__} {value!r}")
        if kind == "float" and (not isinstance(value, float) or not math.isfinite(value)):
            raise TypeError(f"{where} must be a finite number; got {type(value).__name__} {value!r}")
        if kind == "str" and not isinstance(value, str):
            raise TypeError(f"{where} must be a string; got {type(value).__name__} {value!r}")
        if kind.startswith("tuple"):
            ok = isinstance(value, list | tuple) and len(value) == 2
            ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            if not ok:
                raise TypeError(f"{where} must be two finite numbers, e.g. [0.9, 0.99]; got {value!r}")
            object.__setattr__(section, f.name, tuple(float(v) for v in value))


def check_linear_mode_file(path: str) -> None:
    """A linear_mode that is no preset must be a readable fingerprint file (ValueError in one line otherwise)."""
    if not os.path.isfile(path):
        raise ValueError(
            f"linear_mode must be one of {', '.join(map(repr, LINEAR_MODES))} or a fingerprint file written by "
            f"'mixprec probe matmul --save'; {path!r} is neither"
        )
    try:
        Fingerprint.load(path)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"linear_mode: {' '.join(str(exc).split())}") from None


# torch.manual_seed takes seeds below 2**64 (the initial weights are seeded with training.seed itself).
MAX_SEED: int = 2**64 - 1


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The GPT (GPTConfig's arguments; the vocabulary comes from the corpus) and the precision it runs in."""

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
    precision: str = "fp32"
    """Parameter and gradient precision: 'fp32', 'bf16' or 'fp16' (low precisions keep fp32 master weights)."""
    linear_mode: str = "off"
    """Emulated accumulation of every linear layer ('fp16/16', 'fp16/32', 'bf16/32', 'two_stage',
    'fp8/promote128'; the mode of mixprec.emulate.emulate_linear_layers), a block-scaled training recipe ('mxfp8':
    n_embd and micro_batch_size x block_size multiples of 32; 'nvfp4': of 16, its gradients rounded
    stochastically from a stream seeded by (seed, step, rank)), a fingerprint file (the JSON of 'mixprec probe
    matmul --save': the accelerator that was measured), or 'off' for the precision's own matmuls."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            check_positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1); got {self.dropout!r}")
        check_choice("precision", self.precision, PRECISIONS)
        if self.linear_mode not in LINEAR_MODES:
            check_linear_mode_file(self.linear_mode)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The corpus and the batches (the arguments of mixprec.lab.data's train_microbatches and eval_chunks)."""

    corpus: str = "stdlib"
    """'stdlib' (Python's own standard library sources, built in) or a path to a UTF-8 text file."""
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over all ranks (GBS)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (MBS); num_microbatches = GBS / (MBS x ranks)."""
    eval_sequences: int = 64
    """Validation sequences (of block_size characters) per evaluation, split over the ranks."""

    def __post_init__(self) -> None:
        _check_types(self)
        if not self.corpus:
            raise ValueError("corpus must be 'stdlib' or a path to a UTF-8 text file; got an empty string")
        for name in ("global_batch_size", "micro_batch_size", "eval_sequences"):
            check_positive_int(name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """The loss scaler: ``kind`` picks it, the other fields are DynamicLossScaler's arguments (init_scale is
    also StaticLossScaler's scale). TOML has no null, so 0 stands for None in min_scale and max_scale."""

    kind: str = "auto"
    """'none' (scale 1, still skips inf/NaN steps), 'static', 'dynamic', or 'auto' (dynamic for fp16, else none)."""
    init_scale: float = 65536.0
    """The static loss scale, or the dynamic scaler's initial scale (a multiplier, no unit)."""
    growth_interval: int = 2000
    """Dynamic: clean steps between two growths of the scale, in steps."""
    growth_factor: float = 2.0
    """Dynamic: multiplier on growth, > 1."""
    backoff_factor: float = 0.5
    """Dynamic: multiplier on overflow, in (0, 1)."""
    hysteresis: int = 1
    """Dynamic: overflows tolerated before backing off, in steps (1 = back off at once)."""
    consecutive_hysteresis: bool = False
    """Dynamic: refill the hysteresis on every clean step, so only consecutive overflows back off (DeepSpeed);
    false refills it only when the scale grows."""
    min_scale: float = 1.0
    """Dynamic: floor of the scale; 0 = none of its own (it still never goes below fp32's smallest normal
    number, 2**-126)."""
    max_scale: float = 0.0
    """Dynamic: ceiling of the scale; 0 = none (as torch's GradScaler)."""
    min_patience: int = 10
    """Dynamic: consecutive overflowing steps at the floor before on_min_scale acts, in steps."""
    on_min_scale: str = "raise"
    """Dynamic scaler stuck at its floor: 'raise' (stop the run with an error, exit code 1), 'warn' or 'ignore'
    (keep skipping steps)."""

    def __post_init__(self) -> None:
        _check_types(self)
        check_choice("kind", self.kind, LOSS_SCALERS)
        check_positive_float("init_scale", self.init_scale)
        check_positive_float("min_scale", self.min_scale, allow_zero=True)
        check_positive_float("max_scale", self.max_scale, allow_zero=True)
        # The dynamic fields are checked whichever kind this run uses (a config file is edited and reused), by
        # the scaler itself, from a start its range admits; init_scale against the range in TrainConfig.
        DynamicLossScaler(**{**self.dynamic_arguments(), "init_scale": self.min_scale or self.max_scale or 1.0})

    def resolved_kind(self, precision: str) -> str:
        """'none', 'static' or 'dynamic' ('auto': dynamic for fp16, else none)."""
        if self.kind != "auto":
            return self.kind
        return "dynamic" if precision == "fp16" else "none"

    def dynamic_arguments(self) -> dict[str, Any]:
        """DynamicLossScaler's keyword arguments (0 -> None for min_scale and max_scale)."""
        args = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kind"}
        args["min_scale"] = self.min_scale or None
        args["max_scale"] = self.max_scale or None
        return args

    def build(self, precision: str) -> LossScaler:
        """``StaticLossScaler(1.0)`` for 'none' (it still detects and skips inf/NaN steps),
        ``StaticLossScaler(init_scale)`` for 'static', else ``DynamicLossScaler(**dynamic_arguments())``."""
        kind = self.resolved_kind(precision)
        if kind == "none":
            return StaticLossScaler(1.0)
        if kind == "static":
            return StaticLossScaler(self.init_scale)
        return DynamicLossScaler(**self.dynamic_arguments())


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The torch optimizer: ``name`` picks torch.optim.AdamW or SGD, the other fields are their arguments."""

    name: str = "adamw"
    """'adamw' or 'sgd' (with momentum)."""
    lr: float = 2e-3
    """Learning rate (the peak learning rate under a schedule)."""
    weight_decay: float = 0.0
    """Decoupled weight decay for AdamW, L2 for SGD; 0 disables."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's first- and second-moment decays."""
    momentum: float = 0.9
    """SGD momentum; 0 disables."""
    schedule: str = "constant"
    """'constant' (lr throughout) or 'warmup_cosine': linear warmup to lr over warmup_steps, then cosine decay to
    min_lr at training.steps. It counts optimizer steps taken: a skipped step (inf/NaN gradients) does not
    advance it."""
    warmup_steps: int = 0
    """warmup_cosine: steps of linear warmup, in optimizer steps taken."""
    min_lr: float = 0.0
    """warmup_cosine: the learning rate the cosine decays to, <= lr."""

    def __post_init__(self) -> None:
        _check_types(self)
        check_choice("name", self.name, OPTIMIZERS)
        check_positive_float("lr", self.lr)
        check_choice("schedule", self.schedule, LR_SCHEDULES)
        check_positive_int("warmup_steps", self.warmup_steps, minimum=0)
        check_positive_float("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr!r}) must not exceed lr ({self.lr!r})")
        check_positive_float("weight_decay", self.weight_decay, allow_zero=True)
        for what, v in (("betas[0]", self.betas[0]), ("betas[1]", self.betas[1]), ("momentum", self.momentum)):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{what} must lie in [0, 1); got {v!r}")

    def arguments(self) -> dict[str, Any]:
        """The chosen optimizer's keyword arguments."""
        if self.name == "adamw":
            return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Data parallelism: the ranks, DistributedDataParallel's reduce / reduce_options / sharded_optimizer,
    Topology's ranks_per_node, and init_process_group's timeout."""

    nproc: int = 1
    """Ranks to start with --parallel.nproc (gloo on CPU, NCCL on GPU); under torchrun its WORLD_SIZE replaces it."""
    reduce: str = "fp32_accumulate"
    """Gradient reduction across ranks: 'fp32_accumulate' (gradient-dtype wire, fp32 sum, one rounding;
    'fp32_accumulate_hierarchical': inside each node, then across nodes, two roundings), 'native'
    (the backend's own collective, summing in the gradient dtype), 'uint8' / 'uint8_hierarchical' (8-bit min-max
    compression), 'fp8' / 'fp8_hierarchical' (fp8 codes with a power-of-two scale per chunk), 'mxfp8' / 'nvfp4'
    (and their '_hierarchical' forms: block-scaled codes with a scale per 32 or 16 elements, mixprec.compress),
    or 'auto' (per bucket: fp32_accumulate, uint8 or fp8 from a cost model of the link rate). No effect with one
    rank."""
    rounding: str = "nearest"
    """'nearest' or 'stochastic' (unbiased): the rounding of fp32_accumulate's result to bf16/fp16, or of uint8's
    quantization. native rounds to nearest only."""
    error_feedback: bool = False
    """Compressed reductions: keep each quantization's residual and add it back at the next step."""
    fp8_format: str = "e4m3"
    """'fp8' and 'mxfp8' (and their hierarchical forms): the fp8 format of the elements on the wire, 'e4m3' (more
    precision) or 'e5m2' (more range)."""
    link_gbps: float = 0.0
    """'auto' only (refused with another reduce): the inter-rank link rate in Gbit/s that the cost model assumes;
    0 = measure it at the start."""
    ranks_per_node: int = 0
    """The hierarchical reductions only (refused with another reduce): ranks per node; 0 = LOCAL_WORLD_SIZE under
    torchrun, else nproc // 2 (two simulated nodes on one machine)."""
    sharded_optimizer: bool = False
    """ZeRO-1: each rank keeps master weights and optimizer state for its shard only."""
    audit_every: int = 0
    """Live numerics audit: every this many steps one bucket (a sample of at most 65536 elements of it) is also
    reduced exactly and the reduction's error goes to metrics.jsonl (audit_* keys; mixprec report plots them);
    0 = off. Needs nproc >= 2 (one rank reduces nothing)."""
    timeout: float = 300.0
    """Process-group timeout, in seconds (every group mixprec creates inherits it): a rank waiting longer than
    this on a collective stops with an error."""
    simulate_dp: int = 0
    """Simulated data parallelism: this many ranks' gradients computed in one process and reduced by a bit-exact
    model of ``reduce`` (mixprec.lab.simulate), up to 4096; 0 = off. Needs nproc = 1."""
    simulate_algorithm: str = "ring"
    """The backend algorithm a simulated 'native' reduction models: 'ring' (gloo's, bit for bit) or 'tree' (a
    binary tree in rank order, rounding after every addition)."""

    def __post_init__(self) -> None:
        _check_types(self)
        check_positive_int("nproc", self.nproc)
        check_positive_int("ranks_per_node", self.ranks_per_node, minimum=0)
        check_positive_int("audit_every", self.audit_every, minimum=0)
        check_choice("reduce", self.reduce, REDUCTIONS)
        check_choice("rounding", self.rounding, REDUCE_ROUNDINGS)
        check_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        check_positive_float("link_gbps", self.link_gbps, allow_zero=True)
        check_positive_float("timeout", self.timeout)
        traits = reducer_traits(self.reduce)
        if "rounding" not in traits.options and self.rounding != "nearest":
            raise ValueError(
                f"rounding='stochastic' needs a reduction that rounds (fp32_accumulate or a compressed one); reduce "
                f"{self.reduce!r} rounds to nearest only"
            )
        for name, (users, reductions) in _REDUCE_ONLY_FIELDS.items():
            if getattr(self, name) and self.reduce not in reductions:
                raise ValueError(
                    f"{name} applies to {users} only ({', '.join(reductions)}); reduce is {self.reduce!r} "
                    f"(leave {name} unset)"
                )
        if self.sharded_optimizer and self.ranks == 1:
            raise ValueError("sharded_optimizer needs nproc >= 2 (with one rank there is nothing to shard)")
        if traits.hierarchical and self.ranks_per_node and self.ranks % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the number of ranks ({self.ranks})")
        self._check_simulation()

    def _check_simulation(self) -> None:
        check_positive_int("simulate_dp", self.simulate_dp, minimum=0)
        check_choice("simulate_algorithm", self.simulate_algorithm, NATIVE_ALGORITHMS)
        if not self.simulate_dp:
            return
        if self.simulate_dp > MAX_SIMULATED_RANKS:
            raise ValueError(f"simulate_dp must be at most {MAX_SIMULATED_RANKS}; got {self.simulate_dp}")
        if self.nproc != 1:
            raise ValueError(f"simulate_dp runs every rank in one process; nproc must be 1, got {self.nproc}")
        if self.reduce not in SIMULATED_REDUCTIONS:
            raise ValueError(f"simulate_dp models reduce {', '.join(SIMULATED_REDUCTIONS)}; got {self.reduce!r}")
        compressed = reducer_traits(self.reduce).compressed
        if self.simulate_dp == 1 and compressed:
            raise ValueError(
                f"simulate_dp 1 with reduce {self.reduce!r} would quantize, but a one-process run has no data-parallel "
                "reduction; use simulate_dp >= 2 or nproc 1 without simulate_dp"
            )
        if self.rounding != "nearest" and not compressed:
            raise ValueError(
                "simulate_dp models rounding='stochastic' for the compressed reductions only (fp32_accumulate's "
                "stochastic result rounding is not modelled); set rounding='nearest'"
            )
        if self.sharded_optimizer:
            raise ValueError("simulate_dp does not model sharded_optimizer; set it to false")

    @property
    def hierarchical(self) -> bool:
        """``reduce`` reduces in two stages, inside each node then across nodes (it needs ranks_per_node)."""
        return reducer_traits(self.reduce).hierarchical

    @property
    def ranks(self) -> int:
        """Data-parallel ranks of the run: simulate_dp when it is set, else nproc."""
        return self.simulate_dp or self.nproc

    def reduce_options(self) -> dict[str, Any]:
        """DistributedDataParallel's ``reduce_options`` but the topology (which needs the world size)."""
        traits = reducer_traits(self.reduce)
        options: dict[str, Any] = {}
        if "rounding" in traits.options:
            options["rounding"] = self.rounding
        if traits.compressed:
            options["error_feedback"] = self.error_feedback
        wire = traits.wire_for(self.fp8_format)
        if wire is not None:
            options["wire"] = wire
        if traits.adaptive and self.link_gbps:
            options["link_gbps"] = self.link_gbps
        if "algorithm" in traits.options and self.simulate_dp:
            options["algorithm"] = self.simulate_algorithm  # what the model follows (mixprec.lab.simulate)
        return options


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The loop: seed, length, device, the Updater's clipping, evaluation, checkpoints and the run directory."""

    seed: int = 0
    """Seed of the initial weights, the batches and dropout. Same seed, same data order in every run."""
    steps: int = 300
    """Optimizer steps (attempts, skipped ones included)."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available)."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient norm (taken in fp32) to this value; 0 disables."""
    max_consecutive_skips: int = 20
    """Static loss scale (and 'none'): stop the run after this many consecutive steps with inf/NaN gradients, in
    steps (such a scale cannot adapt: the run diverged or the scale is too large); 0 never stops."""
    eval_interval: int = 50
    """Validation loss every this many steps (before that step's update) and after the last step's update (the
    final model, reported in summary.json), in steps; 0 disables."""
    checkpoint_interval: int = 100
    """A checkpoint every this many steps, in steps, and always at the end; 0 = only at the end."""
    headroom_interval: int = 50
    """Headroom telemetry every this many steps (steps N, 2N, ...), in steps: per layer, the fractions of rank 0's
    gradients that underflow, are subnormal or overflow in fp16 at the step's loss scale, in metrics.jsonl (see
    'mixprec report'); 0 disables. It only reads the gradients: the run's numbers do not change."""
    out_dir: str = "runs/mixprec"
    """Run directory: config.toml, metrics.jsonl, checkpoint.pt, summary.json."""
    perturb: int = 0
    """Noise-band replica: k > 0 moves every initial weight by one unit in the last place of its dtype, up or
    down by a sign pattern seeded by k (mixprec.lab.band); 0 = unperturbed."""

    def __post_init__(self) -> None:
        _check_types(self)
        check_positive_int("steps", self.steps)
        for name in (
            "seed",
            "max_consecutive_skips",
            "eval_interval",
            "checkpoint_interval",
            "headroom_interval",
            "perturb",
        ):
            check_positive_int(name, getattr(self, name), minimum=0)
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED} (torch's seed range); got {self.seed}")
        check_choice("device", self.device, DEVICES)
        check_positive_float("clip_grad_norm", self.clip_grad_norm, allow_zero=True)
        if not self.out_dir:
            raise ValueError("out_dir must name a directory; got an empty string")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "scaler": ScalerConfig,
    "optimizer": OptimizerConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
}
_SECTION_OF = {cls: name for name, cls in SECTIONS.items()}
