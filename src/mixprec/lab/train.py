"""One rank of ``mixprec train``: a small GPT trained character-level, with the precision under study.

Which precision each tensor has, per ``precision`` (and where the rounding happens):

==========================  ==========  ============================================  ==============================
tensor                      fp32        bf16 / fp16 on a CPU                          bf16 / fp16 on a GPU
==========================  ==========  ============================================  ==============================
model parameters            fp32        bf16/fp16 tensors: the fp32 master rounded    same
                                        to nearest after every optimizer step
master weights, opt. state  (params)    fp32 (MasterWeightOptimizer)                  fp32
residual stream, layer      fp32        fp32                                          fp32 (autocast keeps layer
norm, softmax, loss                                                                   norm, softmax, loss in fp32)
matmul inputs               fp32        fp32: weights upcast exactly, activations     bf16/fp16 (autocast)
                                        not rounded (``linear_mode`` rounds them)
matmul accumulation         fp32        fp32, or the model ``linear_mode`` names      fp32 (fp16: split-K in fp16
                                                                                      disabled, see train_rank)
parameter gradients         fp32        bf16/fp16: each microbatch's fp32 gradient    same
                                        rounded once to nearest, accumulated over
                                        microbatches in bf16/fp16
gradient wire and sum       fp32        bf16/fp16 on the wire, summed as ``reduce``   same
                                        says: native in bf16/fp16, fp32_accumulate
                                        in fp32 then one rounding, uint8 as 8-bit
                                        codes summed in fp32; with sharded_optimizer
                                        the sum lands in fp32 shards (fp32_accumulate
                                        then never rounds it to bf16/fp16)
unscale, inf/NaN check,     fp32        fp32, on exact fp32 copies of the gradients   fp32
grad norm, clipping
==========================  ==========  ============================================  ==============================

Why a CPU does not run real bf16/fp16 matmuls: most CPUs run them far slower than fp32 (on the 2-core development
machine a torch.amp step of this model took 2.4x (bf16) and 25x (fp16) the fp32 time; benchmarks/RESULTS.md), so
the CPU runs compute in fp32 and round exactly where the numerics under study live: the parameters, the
gradients, the wire, and (with ``linear_mode``) the matmuls through mixprec's emulator. What a CPU run therefore
does not model without ``linear_mode``: the rounding of activations to bf16/fp16 and fp16's overflow of large
activations. A GPU run uses real autocast.

Loss and gradient scaling (seed 002): each microbatch's loss is divided by num_microbatches = GBS / (MBS x ranks)
and multiplied by the loss scale before backward (:class:`mixprec.Updater`); the reduction averages over ranks;
the scaler unscales the fp32 master gradients, skips the step on every rank if any rank saw inf/NaN, then the
global norm is clipped in fp32 and the optimizer steps the fp32 masters.

Reproducibility: initial weights depend on ``seed`` only (built in fp32 on the CPU, then moved and rounded);
batches on (seed, step); dropout on (seed, step, rank). So a run resumed from a checkpoint (step, model,
optimizer with its masters, loss scaler, reducer state) reproduces the uninterrupted run's losses bit for bit.

Fault injection, for testing failure handling: ``MIXPREC_FAULT=RANK:STEP:MODE`` makes rank RANK, at the start of
step STEP, either exit at once with code 13 (``exit``, a crash) or stop responding (``hang``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.objects import all_reduce_sum_fp64, gather_objects
from mixprec.lab.capabilities import CapabilityError
from mixprec.lab.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus, load_corpus
from mixprec.lab.data import dropout_seed, eval_chunks, train_microbatches
from mixprec.lab.metrics import METRICS_NAME, encode_row, read_rows, strict_row
from mixprec.lab.model import GPT, GPTConfig, Linear
from mixprec.scaling import MasterWeightOptimizer, StaticLossScaler, Updater
from mixprec.scaling.scaler import LossScaler

__all__ = [
    "METRICS_NAME",
    "RESUMABLE_FIELDS",
    "SUMMARY_NAME",
    "TrainingDiverged",
    "check_resume",
    "load_train_checkpoint",
    "train_rank",
]

SUMMARY_NAME = "summary.json"
CHECKPOINT_FORMAT = 1
# Fields a resumed run may change: none of them touches the numerics of a training step.
RESUMABLE_FIELDS = frozenset({"steps", "eval_interval", "eval_sequences", "checkpoint_interval", "out_dir", "timeout"})
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingDiverged(RuntimeError):
    """A run without a dynamic loss scaler skipped ``max_consecutive_skips`` steps in a row on inf/NaN gradients:
    such a scale cannot adapt, so the run has diverged (or the static scale is too large)."""


@dataclass
class _Parts:
    """What a rank trains with."""

    module: GPT  # the bare model (evaluation, checkpoints)
    model: torch.nn.Module  # what the Updater drives: the bare model, or the data-parallel wrapper around it
    optimizer: Any
    scaler: LossScaler
    updater: Updater
    wrapper: Any | None


# ---------------------------------------------------------------------------------------------- building
def gpt_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model shape of ``cfg`` for a corpus of ``vocab_size`` characters (validated by GPTConfig)."""
    return GPTConfig(
        vocab_size=vocab_size,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        dropout=cfg.dropout,
    )


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> GPT:
    """The GPT of ``cfg``: initialised in fp32 on the CPU from ``seed`` (same weights on every device), then
    moved to ``device``, rounded to the precision's dtype, and given emulated linears when ``linear_mode`` asks."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(cfg, vocab_size))
    torch.random.set_rng_state(gen_state)
    model.to(device=device, dtype=_DTYPES[cfg.precision])
    if cfg.linear_mode != "off":
        try:
            from mixprec.emulate import emulate_linear_layers
        except ImportError as exc:
            raise CapabilityError(f"linear_mode={cfg.linear_mode!r} needs mixprec.emulate ({exc})") from exc
        emulate_linear_layers(model, cfg.linear_mode, include=(Linear,))  # the lab's Linear only casts dtypes
    return model


def _optimizer_factory(cfg: TrainConfig) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay}
    return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}


def _wrap_data_parallel(module: GPT, cfg: TrainConfig, world_size: int) -> Any | None:
    """mixprec's DistributedDataParallel around ``module``, or None when there is nothing to reduce (one rank)."""
    if world_size == 1:
        return None
    try:
        from mixprec.parallel import DistributedDataParallel
    except ImportError:
        raise CapabilityError(
            f"reduce={cfg.reduce!r}"
            + (" with sharded_optimizer" if cfg.sharded_optimizer else "")
            + " needs mixprec.parallel.DistributedDataParallel, which is not available"
        ) from None
    options: dict[str, Any] = {}
    if cfg.reduce != "native":
        options["rounding"] = cfg.reduce_rounding
    if cfg.reduce.startswith("uint8"):
        options["error_feedback"] = cfg.error_feedback
    if cfg.reduce == "uint8_hierarchical":
        from mixprec.compress import Topology

        if not cfg.ranks_per_node:
            raise ValueError("internal error: ranks_per_node must be resolved before training (launch does it)")
        options["topology"] = Topology(nodes=world_size // cfg.ranks_per_node, ranks_per_node=cfg.ranks_per_node)
    return DistributedDataParallel(
        module, reduce=cfg.reduce, reduce_options=options, sharded_optimizer=cfg.sharded_optimizer
    )


def build_parts(cfg: TrainConfig, vocab_size: int, device: torch.device, world_size: int) -> _Parts:
    module = build_model(cfg, vocab_size, device)
    wrapper = _wrap_data_parallel(module, cfg, world_size)
    opt_cls, opt_kwargs = _optimizer_factory(cfg)
    if wrapper is not None:
        # fp32 masters for bf16/fp16 parameters: MasterWeightOptimizer, or ShardedOptimizer's shard of them.
        optimizer: Any = wrapper.make_optimizer(opt_cls, **opt_kwargs)
    elif cfg.precision == "fp32":
        optimizer = opt_cls(module.parameters(), **opt_kwargs)
    else:
        optimizer = MasterWeightOptimizer(module.parameters(), opt_cls, **opt_kwargs)
    scaler = cfg.build_scaler()
    autocast = _autocast(cfg, device)

    def loss_fn(m: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = mb
        with autocast():
            _, loss = m(x, y)
        return loss

    model = wrapper if wrapper is not None else module
    updater = Updater(
        model,
        optimizer,
        loss_fn,
        scaler=scaler,
        num_microbatches=cfg.num_microbatches,
        clip_grad_norm=cfg.grad_clip or None,
    )
    return _Parts(module, model, optimizer, scaler, updater, wrapper)


def _autocast(cfg: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    if device.type == "cuda" and cfg.precision != "fp32":
        dtype = _DTYPES[cfg.precision]
        return lambda: torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext


# ---------------------------------------------------------------------------------------------- helpers
@torch.no_grad()
def evaluate(
    module: GPT, corpus: Corpus, cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device
) -> float:
    """Mean validation loss (nats per character) over the fixed evaluation windows, summed in fp64."""
    autocast = _autocast(cfg, device)
    was_training = module.training
    module.eval()
    total, count = 0.0, 0.0
    chunks = eval_chunks(
        corpus.val,
        seed=cfg.seed,
        eval_sequences=cfg.eval_sequences,
        micro_batch_size=cfg.micro_batch_size,
        block_size=cfg.block_size,
        rank=rank,
        world_size=world_size,
    )
    for x, y in chunks:
        with autocast():
            _, loss = module(x.to(device), y.to(device))
        total += float(loss) * x.shape[0]
        count += x.shape[0]
    module.train(was_training)
    total, count = all_reduce_sum_fp64([total, count])
    return total / count


def _maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get("MIXPREC_FAULT")
    if not spec:
        return
    try:
        f_rank, f_step, mode = spec.split(":")
        f_rank_i, f_step_i = int(f_rank), int(f_step)
    except ValueError:
        raise ValueError(f"MIXPREC_FAULT must be RANK:STEP:MODE (MODE exit or hang); got {spec!r}") from None
    if f_rank_i != rank or f_step_i != step:
        return
    if mode == "exit":
        print(f"rank {rank}: MIXPREC_FAULT: exiting with code 13 at step {step}", file=sys.stderr, flush=True)
        os._exit(13)
    if mode == "hang":
        print(f"rank {rank}: MIXPREC_FAULT: hanging at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    raise ValueError(f"MIXPREC_FAULT mode must be 'exit' or 'hang'; got {mode!r}")


def load_train_checkpoint(path: str, *, mmap: bool = False) -> dict[str, Any]:
    """A ``mixprec train`` checkpoint of :data:`CHECKPOINT_FORMAT` (on the CPU, ``weights_only=True``).

    With ``mmap`` the file is memory-mapped: only the tensors a caller touches are read (a resumed rank reads
    its own reducer state, not its peers'). Raises ValueError when it is missing or of another format.
    """
    state = load_checkpoint(path, map_location="cpu", mmap=mmap)
    if state.get("format") != CHECKPOINT_FORMAT or "config" not in state:
        raise ValueError(
            f"{path!r} is not a mixprec train checkpoint of format {CHECKPOINT_FORMAT} (format {state.get('format')!r})"
        )
    return state


def check_resume(cfg: TrainConfig, corpus: Corpus | None = None) -> None:
    """Raise ValueError unless ``cfg.out_dir`` holds a checkpoint that ``cfg`` may continue: same configuration
    (but :data:`RESUMABLE_FIELDS`) and, when ``corpus`` is given, the same corpus (its sha256). Cheap: the
    checkpoint is memory-mapped and only its metadata is read."""
    path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no checkpoint at {path!r}")
    state = load_train_checkpoint(path, mmap=True)
    _check_resume_compatible(state["config"], cfg)
    for entry in state.get("reducer_states") or []:
        _check_legacy_reducer_state(entry)
    if corpus is not None:
        _check_same_corpus(state, corpus)


def _is_legacy_reducer_state(entry: dict[str, Any]) -> bool:
    """A rank's reducer state as written before DistributedDataParallel.reducer_state_dict() existed (the raw
    reducer dict, without the wrapper's "format" envelope)."""
    return isinstance(entry, dict) and "format" not in entry


def _check_legacy_reducer_state(entry: dict[str, Any]) -> None:
    """Such an old entry is skipped on resume when it holds no state that matters (round-to-nearest, no
    tensors: nothing to restore, the resumed run stays bit-exact); otherwise the resume is refused
    (ValueError), since its generator or residual layout cannot be loaded into the current reducers."""
    if not _is_legacy_reducer_state(entry):
        return
    holds_tensors = any(isinstance(v, torch.Tensor | dict | list) for v in entry.values())
    if entry.get("rounding") != "nearest" or holds_tensors:
        raise ValueError(
            "cannot resume: this checkpoint was written by an older mixprec whose per-rank reducer state "
            "(a stochastic-rounding stream or error-feedback residuals) the current reducers cannot load; "
            "start a new run in another --out-dir"
        )


def _check_same_corpus(state: dict[str, Any], corpus: Corpus) -> None:
    if state.get("corpus_sha256") != corpus.sha256:
        raise ValueError(
            f"cannot resume: the corpus changed (checkpoint sha256 {state.get('corpus_sha256')}, now "
            f"{corpus.sha256}); a custom corpus file was edited, or another Python version reads different "
            "stdlib sources"
        )


def _check_resume_compatible(saved: dict[str, Any], cfg: TrainConfig) -> None:
    diffs = []
    for f in fields(cfg):
        if f.name in RESUMABLE_FIELDS:
            continue
        # A field added after the checkpoint was written is absent there: its default is the old behaviour.
        old = saved.get(f.name, f.default)
        new = getattr(cfg, f.name)
        if old != new:
            diffs.append(f"{f.name}: checkpoint {old!r}, now {new!r}")
    if diffs:
        raise ValueError(
            "cannot resume: the checkpoint was written with a different configuration ("
            + "; ".join(diffs)
            + f"). Only {', '.join(sorted(RESUMABLE_FIELDS))} may change on resume."
        )


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _checkpoint_state(parts: _Parts, cfg: TrainConfig, *, next_step: int, wall_time: float, corpus: Corpus) -> Any:
    """The full training state on rank 0 (None elsewhere); collective: every rank calls it.

    Only rank 0 copies the model and optimizer to the CPU (a sharded optimizer's ``state_dict()`` gathers its
    shards, so every rank calls that). The reducer's state (stochastic-rounding generators, error-feedback
    residuals) differs per rank: each rank's :meth:`DistributedDataParallel.reducer_state_dict` is gathered to
    rank 0 only and stored as a list indexed by rank.
    """
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    optimizer_state = parts.optimizer.state_dict()
    reducer_states = None
    if parts.wrapper is not None:
        reducer_states = gather_objects(_to_cpu(parts.wrapper.reducer_state_dict()))
    if not is_main:
        return None
    state: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": next_step,
        "wall_time": wall_time,
        "config": cfg.to_dict(),
        "corpus_sha256": corpus.sha256,
        "model": _to_cpu(parts.module.state_dict()),
        "optimizer": _to_cpu(optimizer_state),
        "scaler": parts.scaler.state_dict(),
    }
    if reducer_states is not None:
        state["reducer_states"] = reducer_states
    return state


def _to_device(obj: Any, device: torch.device) -> Any:
    """A copy of a (memory-mapped) checkpoint entry on ``device``, so that nothing keeps the mapping alive."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _load_into(parts: _Parts, state: dict[str, Any], rank: int, device: torch.device) -> None:
    parts.module.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(_to_device(state["optimizer"], device))
    if state["scaler"]:
        parts.scaler.load_state_dict(state["scaler"])
    if parts.wrapper is not None and "reducer_states" in state:
        entry = state["reducer_states"][rank]
        _check_legacy_reducer_state(entry)
        if not _is_legacy_reducer_state(entry):  # an old round-to-nearest entry holds nothing to restore
            parts.wrapper.load_reducer_state_dict(_to_device(entry, torch.device("cpu")))


def _truncate_metrics(path: str, before_step: int) -> None:
    """Keep only rows of steps < ``before_step`` (a run killed after its last checkpoint logged more)."""
    if not os.path.exists(path):
        return
    kept = [row for row in read_rows(path) if row.get("step", -1) < before_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        for row in kept:
            fh.write(encode_row(row) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- the loop
def train_rank(
    cfg: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    resume: bool = False,
    progress: bool | None = None,
) -> dict[str, Any] | None:
    """Train on this rank; inside an initialised process group when ``world_size > 1``.

    Rank 0 writes ``metrics.jsonl`` (one row per step, flushed), ``checkpoint.pt`` (atomically) and
    ``summary.json`` under ``cfg.out_dir``, which must exist and hold ``config.toml``. Returns the summary on
    rank 0, None elsewhere.

    Args:
        resume: continue from ``out_dir/checkpoint.pt``; the configuration must match the checkpoint's except for
            :data:`RESUMABLE_FIELDS`.
        progress: tqdm progress bar on rank 0: True, False, or None for "when stderr is a terminal".
    """
    device = torch.device(device)
    if cfg.nproc != world_size:
        raise ValueError(f"cfg.nproc ({cfg.nproc}) must equal the number of ranks ({world_size})")
    is_main = rank == 0
    if device.type == "cuda" and cfg.precision == "fp16":
        # cuBLAS may otherwise reduce split-K partial sums of fp16 GEMMs in fp16; this lab's table promises fp32
        # accumulation. Process-wide (a training process runs one configuration).
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    corpus = load_corpus(cfg.corpus)
    parts = build_parts(cfg, corpus.vocab_size, device, world_size)
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    metrics_path = os.path.join(cfg.out_dir, METRICS_NAME)
    start_step, wall_offset = 0, 0.0
    if resume:
        # Memory-mapped: each rank reads the model, the optimizer and its own reducer state, not its peers'.
        state = load_train_checkpoint(ckpt_path, mmap=True)
        _check_resume_compatible(state["config"], cfg)
        _check_same_corpus(state, corpus)
        _load_into(parts, state, rank, device)
        start_step, wall_offset = int(state["step"]), float(state["wall_time"])
        del state
    if is_main and resume:
        _truncate_metrics(metrics_path, start_step)
    elif is_main:
        open(metrics_path, "w").close()

    tokens_per_step = cfg.global_batch_size * cfg.block_size
    if is_main and start_step < cfg.steps:
        print(
            f"mixprec train: {parts.module.num_parameters():,} parameters, {world_size} rank(s) on {device}, "
            f"precision {cfg.precision}, reduce {cfg.reduce}, loss scaler {cfg.resolved_loss_scaler}, "
            f"{cfg.num_microbatches} microbatch(es) of {cfg.micro_batch_size} per rank, "
            f"{tokens_per_step} tokens/step; corpus {corpus.name} ({corpus.train.numel():,} train characters, "
            f"vocab {corpus.vocab_size}); steps {start_step}..{cfg.steps - 1} -> {cfg.out_dir}",
            flush=True,
        )
        # Seed 002's rules concern a real loss scale; with none (scale 1) there is nothing to advise.
        findings = cfg.advice().findings if cfg.resolved_loss_scaler != "none" else []
        for finding in findings:
            if finding.severity != "info":
                print(f"mixprec train: loss-scale advisor [{finding.severity}] {finding.message}", flush=True)

    bar = None
    if is_main:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=cfg.steps,
            initial=start_step,
            disable=(None if progress is None else not progress),
            unit="step",
            dynamic_ncols=True,
        )
    t_start = time.perf_counter() - wall_offset
    consecutive_skips = 0
    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(open(metrics_path, "a")) if is_main else None
        if bar is not None:
            stack.callback(bar.close)
        if cfg.resolved_loss_scaler == "dynamic" and parts.wrapper is not None:
            # Overflows are how a dynamic scaler finds its scale: each is logged as a skipped step, so the
            # wrapper's per-bucket warning would only repeat it.
            stack.enter_context(warnings.catch_warnings())
            from mixprec.parallel import NonFiniteGradientWarning

            warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for step in range(start_step, cfg.steps):
            _maybe_inject_fault(rank, step)
            eval_loss = None
            is_last = step == cfg.steps - 1
            # The last step evaluates after its update (the final model, in summary.json); others before it.
            if cfg.eval_interval and step % cfg.eval_interval == 0 and not is_last:
                eval_loss = evaluate(parts.module, corpus, cfg, rank=rank, world_size=world_size, device=device)
            if cfg.dropout:
                torch.manual_seed(dropout_seed(cfg.seed, step, rank))
            mbs = [
                (x.to(device), y.to(device))
                for x, y in train_microbatches(
                    corpus.train,
                    seed=cfg.seed,
                    step=step,
                    global_batch_size=cfg.global_batch_size,
                    micro_batch_size=cfg.micro_batch_size,
                    block_size=cfg.block_size,
                    rank=rank,
                    world_size=world_size,
                )
            ]
            t0 = time.perf_counter()
            result = parts.updater.step(mbs)
            (loss_sum,) = all_reduce_sum_fp64([result.loss])
            dt = time.perf_counter() - t0
            loss = loss_sum / world_size
            if cfg.eval_interval and is_last:
                eval_loss = evaluate(parts.module, corpus, cfg, rank=rank, world_size=world_size, device=device)
            consecutive_skips = consecutive_skips + 1 if result.skipped else 0
            if is_main:
                row = {
                    "step": step,
                    "loss": loss,
                    "eval_loss": eval_loss,
                    "loss_scale": result.scale,
                    "skipped": result.skipped,
                    "grad_norm": result.grad_norm,
                    "tokens_per_s": tokens_per_step / dt,
                    "wall_time": time.perf_counter() - t_start,
                }
                metrics.write(encode_row(row) + "\n")
                metrics.flush()
                if bar is not None:
                    bar.set_postfix_str(
                        f"loss {loss:.4f} scale {result.scale:g} {tokens_per_step / dt:,.0f} tok/s", refresh=False
                    )
                    bar.update(1)
                say = bar.write if bar is not None else print
                if result.skipped and cfg.resolved_loss_scaler != "dynamic":
                    say(f"step {step}: inf/NaN gradients at loss scale {result.scale:g}; step skipped on all ranks")
                if eval_loss is not None:
                    say(f"step {step}: train loss {loss:.4f}, val loss {eval_loss:.4f}, loss scale {result.scale:g}")
            # Every rank sees the same (agreed) skip flags, so every rank stops here together.
            limit = cfg.max_consecutive_skips
            if limit and consecutive_skips >= limit and isinstance(parts.scaler, StaticLossScaler):
                raise TrainingDiverged(
                    f"{consecutive_skips} consecutive steps (up to step {step}) had inf/NaN gradients at the static "
                    f"loss scale {result.scale:g} (max_consecutive_skips = {limit}): the run diverged or the scale "
                    "is too large; try loss_scaler = 'dynamic', a smaller loss_scale or a smaller lr"
                )
            done = step + 1
            if done == cfg.steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
                state = _checkpoint_state(
                    parts, cfg, next_step=done, wall_time=time.perf_counter() - t_start, corpus=corpus
                )
                if state is not None:
                    save_checkpoint(state, ckpt_path)
                del state
    if not is_main:
        return None
    summary = summarize_run(cfg, metrics_path, parameters=parts.module.num_parameters(), corpus=corpus)
    summary.update(world_size=world_size, device=str(device))
    with open(os.path.join(cfg.out_dir, SUMMARY_NAME), "w") as fh:
        json.dump(strict_row(summary), fh, indent=2, allow_nan=False)  # a NaN final loss: null + "nonfinite"
        fh.write("\n")
    return summary


def summarize_run(cfg: TrainConfig, metrics_path: str, *, parameters: int, corpus: Corpus) -> dict[str, Any]:
    rows = list(read_rows(metrics_path))
    losses = [r["loss"] for r in rows]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "steps": len(rows),
        "final_loss": losses[-1] if losses else None,
        "best_loss": min(finite) if finite else None,
        "final_eval_loss": evals[-1] if evals else None,
        "skipped_steps": sum(1 for r in rows if r.get("skipped")),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows) if rows else None,
        "wall_time": rows[-1]["wall_time"] if rows else 0.0,
        "parameters": parameters,
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
