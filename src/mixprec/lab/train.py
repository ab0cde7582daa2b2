"""One rank of ``mixprec train``: a small GPT trained character-level, with the precision under study.

Per step: each rank draws its microbatches (a pure function of seed and step), the Updater divides each
microbatch's loss by num_microbatches and multiplies it by the loss scale before backward, the data-parallel
wrapper reduces the gradients as ``parallel.reduce`` says, the scaler unscales the fp32 master gradients and
skips the step on every rank if any rank saw inf/NaN, the global norm is clipped in fp32 and the optimizer
steps the fp32 masters. Rank 0 logs one metrics row per step and writes the checkpoints.

Initial weights depend on the seed only, batches on (seed, step), dropout on (seed, step, rank): a run resumed
from a checkpoint reproduces the uninterrupted run's numbers bit for bit. docs/lab.md has the table of which
precision each tensor has on a CPU and on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Any

import torch

from mixprec.comm.objects import all_reduce_sum_fp64
from mixprec.core.progress import progress_bar
from mixprec.lab.build import Parts, autocast, build_parts
from mixprec.lab.checkpoint import (
    CHECKPOINT_NAME,
    check_resume_compatible,
    check_same_corpus,
    checkpoint_state,
    load_into,
    load_train_checkpoint,
    save_checkpoint,
)
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus, load_corpus
from mixprec.lab.data import dropout_seed, eval_chunks, train_microbatches
from mixprec.lab.faults import maybe_inject_fault
from mixprec.lab.metrics import METRICS_NAME, SUMMARY_NAME, encode_row, summarize_run, truncate_metrics, write_summary
from mixprec.lab.schedule import build_schedule, current_lr
from mixprec.lab.simulate import SimulatedRanks
from mixprec.lab.telemetry import HEADROOM_KEY, HeadroomProbe
from mixprec.parallel import NonFiniteGradientWarning
from mixprec.scaling import StaticLossScaler

__all__ = ["TrainingDiverged", "evaluate", "train_rank"]


class TrainingDiverged(RuntimeError):
    """A run without a dynamic loss scaler skipped ``max_consecutive_skips`` steps in a row on inf/NaN gradients:
    such a scale cannot adapt, so the run has diverged (or the static scale is too large)."""


@torch.no_grad()
def evaluate(
    module: Any, corpus: Corpus, cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device
) -> float:
    """Mean validation loss (nats per character) over the fixed evaluation windows, summed in fp64."""
    context = autocast(cfg, device)
    was_training = module.training
    module.eval()
    total, count = 0.0, 0.0
    chunks = eval_chunks(
        corpus.val,
        seed=cfg.training.seed,
        eval_sequences=cfg.data.eval_sequences,
        micro_batch_size=cfg.data.micro_batch_size,
        block_size=cfg.model.block_size,
        rank=rank,
        world_size=world_size,
    )
    for x, y in chunks:
        with context():
            _, loss = module(x.to(device), y.to(device))
        total += float(loss) * x.shape[0]
        count += x.shape[0]
    module.train(was_training)
    total, count = all_reduce_sum_fp64([total, count])
    return total / count


def _resume(
    parts: Parts, cfg: TrainConfig, corpus: Corpus, rank: int, device: torch.device
) -> tuple[int, float, dict[str, Any]]:
    """Load the checkpoint into ``parts``; returns (next step, wall time so far, a simulated run's own state)."""
    # Memory-mapped: each rank reads the model, the optimizer and its own reducer state, not its peers'.
    state = load_train_checkpoint(os.path.join(cfg.training.out_dir, CHECKPOINT_NAME), mmap=True)
    check_resume_compatible(state["config"], cfg)
    check_same_corpus(state, corpus)
    load_into(parts, state, rank, device)
    return int(state["step"]), float(state["wall_time"]), state.get("simulated", {})


def _announce(
    parts: Parts, cfg: TrainConfig, corpus: Corpus, world_size: int, device: torch.device, start: int
) -> None:
    print(
        f"mixprec train: {parts.module.num_parameters():,} parameters, {world_size} rank(s) on {device}, "
        f"precision {cfg.model.precision}, reduce {cfg.parallel.reduce}, loss scaler {cfg.resolved_loss_scaler}, "
        f"{cfg.num_microbatches} microbatch(es) of {cfg.data.micro_batch_size} per rank, "
        f"{cfg.data.global_batch_size * cfg.model.block_size} tokens/step; corpus {corpus.name} "
        f"({corpus.train.numel():,} train characters, vocab {corpus.vocab_size}); "
        f"steps {start}..{cfg.training.steps - 1} -> {cfg.training.out_dir}",
        flush=True,
    )
    # The advisor's rules concern a real loss scale; with none (scale 1) there is nothing to advise.
    findings = cfg.advice().findings if cfg.resolved_loss_scaler != "none" else []
    for finding in findings:
        if finding.severity != "info":
            print(f"mixprec train: loss-scale advisor [{finding.severity}] {finding.message}", flush=True)


def _telemetry_fields(parts: Parts, result: Any, lr: float | None, headroom: Any) -> dict[str, Any]:
    """The optional keys of a metrics row: the scheduled lr, an overflow's culprits (parameter names of the bare
    model, as the headroom's layers), the headroom telemetry."""
    fields: dict[str, Any] = {}
    if lr is not None:
        fields["lr"] = lr
    if result.skipped and result.culprits:
        prefix = "module." if parts.wrapper is not None else ""
        fields["culprits"] = [name.removeprefix(prefix) for name in result.culprits]
    if headroom is not None:
        fields[HEADROOM_KEY] = headroom
    return fields


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

    Rank 0 writes ``metrics.jsonl`` (one row per step, flushed), ``checkpoint.pt`` and ``summary.json`` under
    ``out_dir``, which must exist and hold ``config.toml``. Returns the summary on rank 0, None elsewhere.

    Args:
        resume: continue from ``out_dir/checkpoint.pt``; the configuration must match the checkpoint's except for
            :data:`mixprec.lab.config.RESUMABLE_FIELDS`.
        progress: tqdm progress bar on rank 0: True, False, or None for "when stderr is a terminal".
    """
    device = torch.device(device)
    if cfg.parallel.nproc != world_size:
        raise ValueError(f"parallel.nproc ({cfg.parallel.nproc}) must equal the number of ranks ({world_size})")
    t, is_main = cfg.training, rank == 0
    if device.type == "cuda" and cfg.model.precision == "fp16":
        # cuBLAS may otherwise reduce split-K partial sums of fp16 GEMMs in fp16; the lab promises fp32
        # accumulation. Process-wide (a training process runs one configuration).
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    corpus = load_corpus(cfg.data.corpus)
    parts = build_parts(cfg, corpus.vocab_size, device, world_size)
    start_step, wall_offset, sim_state = _resume(parts, cfg, corpus, rank, device) if resume else (0, 0.0, {})
    schedule = build_schedule(cfg, parts.optimizer, parts.scaler)  # after _resume: it starts at steps_taken
    headroom = HeadroomProbe(parts.module, t.headroom_interval if is_main else 0)  # rank 0 logs, rank 0 measures
    metrics_path = os.path.join(t.out_dir, METRICS_NAME)
    if is_main and resume:
        truncate_metrics(metrics_path, start_step)
    elif is_main:
        open(metrics_path, "w").close()
    if is_main and start_step < t.steps:
        _announce(parts, cfg, corpus, world_size, device, start_step)
    sim = SimulatedRanks(parts, cfg, corpus, device) if cfg.parallel.simulate_dp else None
    if sim is not None and resume:
        sim.load_state_dict(sim_state)
    if sim is not None and start_step < t.steps:
        print(f"mixprec train: {sim.describe()}", flush=True)

    def evaluate_now() -> float:
        if sim is not None:
            return sim.evaluate()
        return evaluate(parts.module, corpus, cfg, rank=rank, world_size=world_size, device=device)

    tokens_per_step = cfg.data.global_batch_size * cfg.model.block_size
    t_start = time.perf_counter() - wall_offset
    consecutive_skips = 0
    with contextlib.ExitStack() as stack:
        metrics = stack.enter_context(open(metrics_path, "a")) if is_main else None
        bar = None
        if is_main:
            bar = progress_bar(total=t.steps, initial=start_step, unit="step", enabled=progress)  # rank 0 only
            stack.callback(bar.close)
        if cfg.resolved_loss_scaler == "dynamic" and parts.wrapper is not None:
            # Overflows are how a dynamic scaler finds its scale: each is logged as a skipped step, so the
            # wrapper's per-bucket warning would only repeat it.
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore", NonFiniteGradientWarning)

        for step in range(start_step, t.steps):
            maybe_inject_fault(rank, step)
            is_last = step == t.steps - 1
            eval_loss = None
            # The last step evaluates after its update (the final model, in summary.json); others before it.
            if t.eval_interval and step % t.eval_interval == 0 and not is_last:
                eval_loss = evaluate_now()
            if cfg.model.dropout:
                torch.manual_seed(dropout_seed(t.seed, step, rank))
            microbatches = train_microbatches(
                corpus.train,
                seed=t.seed,
                step=step,
                global_batch_size=cfg.data.global_batch_size,
                micro_batch_size=cfg.data.micro_batch_size,
                block_size=cfg.model.block_size,
                rank=rank,
                world_size=world_size,
            )
            t0 = time.perf_counter()
            lr = current_lr(parts.optimizer) if schedule is not None else None
            if sim is not None:
                result = sim.step(step, headroom)
            else:
                result = headroom.step(parts.updater, step, [(x.to(device), y.to(device)) for x, y in microbatches])
            if schedule is not None:
                schedule.step()  # SkipAwareLR: only when the optimizer step ran
            (loss_sum,) = all_reduce_sum_fp64([result.loss])
            dt = time.perf_counter() - t0
            loss = loss_sum / world_size
            if t.eval_interval and is_last:
                eval_loss = evaluate_now()
            consecutive_skips = consecutive_skips + 1 if result.skipped else 0

            if metrics is not None and bar is not None:
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
                row.update(_telemetry_fields(parts, result, lr, headroom.captured))
                metrics.write(encode_row(row) + "\n")
                metrics.flush()
                postfix = f"loss {loss:.4f} scale {result.scale:g} {row['tokens_per_s']:,.0f} tok/s"
                bar.set_postfix_str(postfix, refresh=False)
                bar.update(1)
                if result.skipped and cfg.resolved_loss_scaler != "dynamic":
                    bar.write(
                        f"step {step}: inf/NaN gradients at loss scale {result.scale:g}; step skipped on all ranks"
                    )
                if eval_loss is not None:
                    bar.write(
                        f"step {step}: train loss {loss:.4f}, val loss {eval_loss:.4f}, loss scale {result.scale:g}"
                    )

            # Every rank sees the same (agreed) skip flags, so every rank stops here together.
            limit = t.max_consecutive_skips
            if limit and consecutive_skips >= limit and isinstance(parts.scaler, StaticLossScaler):
                raise TrainingDiverged(
                    f"{consecutive_skips} consecutive steps (up to step {step}) had inf/NaN gradients at the static "
                    f"loss scale {result.scale:g} (max_consecutive_skips = {limit}): the run diverged or the scale "
                    "is too large; try scaler.kind = 'dynamic', a smaller scaler.init_scale or a smaller optimizer.lr"
                )
            done = step + 1
            if done == t.steps or (t.checkpoint_interval and done % t.checkpoint_interval == 0):
                wall = time.perf_counter() - t_start
                state = checkpoint_state(parts, cfg, next_step=done, wall_time=wall, corpus=corpus)
                if state is not None and sim is not None and (sim_state := sim.state_dict()):
                    state["simulated"] = sim_state
                if state is not None:
                    save_checkpoint(state, os.path.join(t.out_dir, CHECKPOINT_NAME))
                del state

    if not is_main:
        return None
    summary = summarize_run(metrics_path, parameters=parts.module.num_parameters(), corpus=corpus)
    summary.update(world_size=world_size, device=str(device))
    write_summary(summary, os.path.join(t.out_dir, SUMMARY_NAME))
    return summary
