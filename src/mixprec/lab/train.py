"""One rank of ``mixprec train``: a small GPT trained character-level, with the precision under study.

Per step: each rank draws its microbatches (a pure function of seed and step), the Updater divides each
microbatch's loss by num_microbatches and multiplies it by the loss scale before backward, the data-parallel
wrapper reduces the gradients as ``parallel.reduce`` says, the scaler unscales the fp32 master gradients and
skips the step on every rank if any rank saw inf/NaN, the global norm is clipped in fp32 and the optimizer
steps the fp32 masters. Rank 0 logs one metrics row per step and writes the checkpoints. The loop steps a
:class:`Stepper`: this real rank (:class:`DataParallelStepper`) or, with ``parallel.simulate_dp``, all the
simulated ranks in this process (:class:`mixprec.lab.simulate.SimulatedRanks`).

Initial weights depend on the seed only, batches on (seed, step), dropout and a block-scaled recipe's stochastic
rounding on (seed, step, rank): a run resumed from a checkpoint reproduces the uninterrupted run's numbers bit for
bit. docs/lab.md has the table of which
precision each tensor has on a CPU and on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Protocol

import torch

from mixprec.comm.objects import all_reduce_sum_fp64
from mixprec.core.progress import progress_bar
from mixprec.lab.build import Parts, autocast, build_parts, seed_step
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
from mixprec.lab.data import eval_chunks, train_microbatches
from mixprec.lab.faults import maybe_inject_fault
from mixprec.lab.metrics import METRICS_NAME, SUMMARY_NAME, encode_row, summarize_run, truncate_metrics, write_summary
from mixprec.lab.schedule import build_schedule, current_lr
from mixprec.lab.simulate import SimulatedRanks
from mixprec.lab.telemetry import HEADROOM_KEY, HeadroomProbe
from mixprec.parallel import NonFiniteGradientWarning
from mixprec.scaling import StaticLossScaler, UpdateResult

__all__ = ["DataParallelStepper", "Stepper", "TrainingDiverged", "evaluate", "make_stepper", "train_rank"]


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
    audits = parts.wrapper.audit_results if parts.wrapper is not None else []
    if audits and audits[-1].step == parts.wrapper.audit.step:  # audited in this step's synced backward
        fields.update(audits[-1].as_row())
    return fields


class Stepper(Protocol):
    """What the loop steps: a real data-parallel rank (:class:`DataParallelStepper`) or all the simulated ranks of
    ``parallel.simulate_dp`` in this process (:class:`mixprec.lab.simulate.SimulatedRanks`)."""

    def step(self, step: int, headroom: HeadroomProbe) -> UpdateResult:
        """Step ``step`` of training; ``result.loss`` is the mean over the ranks, as the run logs it."""
        ...

    def evaluate(self) -> float: ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds beyond the model, optimizer and scaler (``"simulated"``); may be empty."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def describe(self) -> str | None: ...


class DataParallelStepper:
    """Rank ``rank`` of ``world_size`` real ranks: its microbatches through the Updater (and the data-parallel
    wrapper), the logged loss summed over the ranks in fp64."""

    def __init__(
        self, parts: Parts, cfg: TrainConfig, corpus: Corpus, *, rank: int, world_size: int, device: torch.device
    ) -> None:
        self.parts, self.cfg, self.corpus = parts, cfg, corpus
        self.rank, self.world_size, self.device = rank, world_size, device

    def step(self, step: int, headroom: HeadroomProbe) -> UpdateResult:
        cfg = self.cfg
        seed_step(self.parts, cfg, step, self.rank)
        microbatches = train_microbatches(
            self.corpus.train,
            seed=cfg.training.seed,
            step=step,
            global_batch_size=cfg.data.global_batch_size,
            micro_batch_size=cfg.data.micro_batch_size,
            block_size=cfg.model.block_size,
            rank=self.rank,
            world_size=self.world_size,
        )
        on_device = [(x.to(self.device), y.to(self.device)) for x, y in microbatches]
        result = headroom.step(self.parts.updater, step, on_device)
        (loss_sum,) = all_reduce_sum_fp64([result.loss])
        return dataclasses.replace(result, loss=loss_sum / self.world_size)

    def evaluate(self) -> float:
        return evaluate(
            self.parts.module, self.corpus, self.cfg, rank=self.rank, world_size=self.world_size, device=self.device
        )

    def state_dict(self) -> dict[str, Any]:
        return {}  # the wrapper's reducer state is in the checkpoint's own entry

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> str | None:
        return None


def make_stepper(
    parts: Parts, cfg: TrainConfig, corpus: Corpus, *, rank: int, world_size: int, device: torch.device
) -> Stepper:
    if cfg.parallel.simulate_dp:
        return SimulatedRanks(parts, cfg, corpus, device)
    return DataParallelStepper(parts, cfg, corpus, rank=rank, world_size=world_size, device=device)


class _RunLog:
    """Rank 0's record of the run: ``metrics.jsonl`` (one row per step, flushed) and the progress bar."""

    def __init__(
        self, stack: contextlib.ExitStack, parts: Parts, cfg: TrainConfig, start: int, *, resume: bool, progress: Any
    ) -> None:
        self.parts, self.cfg = parts, cfg
        self.path = os.path.join(cfg.training.out_dir, METRICS_NAME)
        if resume:
            truncate_metrics(self.path, start)
        else:
            open(self.path, "w").close()
        self.file = stack.enter_context(open(self.path, "a"))  # noqa: SIM115 (the stack closes it)
        self.bar = progress_bar(total=cfg.training.steps, initial=start, unit="step", enabled=progress)
        stack.callback(self.bar.close)

    def write(self, step: int, result: UpdateResult, eval_loss: float | None, extra: dict[str, Any]) -> None:
        row = {
            "step": step,
            "loss": result.loss,
            "eval_loss": eval_loss,
            "loss_scale": result.scale,
            "skipped": result.skipped,
            "grad_norm": result.grad_norm,
            **extra,
        }
        self.file.write(encode_row(row) + "\n")
        self.file.flush()
        postfix = f"loss {result.loss:.4f} scale {result.scale:g} {row['tokens_per_s']:,.0f} tok/s"
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(1)
        if result.skipped and self.cfg.resolved_loss_scaler != "dynamic":
            self.bar.write(f"step {step}: inf/NaN gradients at loss scale {result.scale:g}; step skipped on all ranks")
        if eval_loss is not None:
            self.bar.write(
                f"step {step}: train loss {result.loss:.4f}, val loss {eval_loss:.4f}, loss scale {result.scale:g}"
            )


def _check_diverged(parts: Parts, cfg: TrainConfig, consecutive_skips: int, step: int, scale: float) -> None:
    """Every rank sees the same (agreed) skip flags, so every rank stops here together."""
    limit = cfg.training.max_consecutive_skips
    if limit and consecutive_skips >= limit and isinstance(parts.scaler, StaticLossScaler):
        raise TrainingDiverged(
            f"{consecutive_skips} consecutive steps (up to step {step}) had inf/NaN gradients at the static "
            f"loss scale {scale:g} (max_consecutive_skips = {limit}): the run diverged or the scale "
            "is too large; try scaler.kind = 'dynamic', a smaller scaler.init_scale or a smaller optimizer.lr"
        )


def _save(parts: Parts, cfg: TrainConfig, corpus: Corpus, stepper: Stepper, done: int, wall: float) -> None:
    """The checkpoint after ``done`` steps (collective: every rank calls it; rank 0 writes)."""
    state = checkpoint_state(parts, cfg, next_step=done, wall_time=wall, corpus=corpus)
    if state is not None and (extra := stepper.state_dict()):
        state["simulated"] = extra
    if state is not None:
        save_checkpoint(state, os.path.join(cfg.training.out_dir, CHECKPOINT_NAME))


def _prepare_device(cfg: TrainConfig, device: torch.device) -> None:
    if device.type == "cuda" and cfg.model.precision == "fp16":
        # cuBLAS may otherwise reduce split-K partial sums of fp16 GEMMs in fp16; the lab promises fp32
        # accumulation. Process-wide (a training process runs one configuration).
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def _quiet_overflow_warnings(stack: contextlib.ExitStack, cfg: TrainConfig, parts: Parts) -> None:
    if cfg.resolved_loss_scaler == "dynamic" and parts.wrapper is not None:
        # Overflows are how a dynamic scaler finds its scale: each is logged as a skipped step, so the
        # wrapper's per-bucket warning would only repeat it.
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", NonFiniteGradientWarning)


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
    _prepare_device(cfg, device)
    corpus = load_corpus(cfg.data.corpus)
    parts = build_parts(cfg, corpus.vocab_size, device, world_size)
    start, wall_offset, saved = _resume(parts, cfg, corpus, rank, device) if resume else (0, 0.0, {})
    schedule = build_schedule(cfg, parts.optimizer, parts.scaler)  # after _resume: it starts at steps_taken
    headroom = HeadroomProbe(parts.module, t.headroom_interval if is_main else 0)  # rank 0 logs, rank 0 measures
    stepper = make_stepper(parts, cfg, corpus, rank=rank, world_size=world_size, device=device)
    if resume:
        stepper.load_state_dict(saved)
    tokens_per_step = cfg.data.global_batch_size * cfg.model.block_size
    with contextlib.ExitStack() as stack:
        log = _RunLog(stack, parts, cfg, start, resume=resume, progress=progress) if is_main else None
        if is_main and start < t.steps:
            _announce(parts, cfg, corpus, world_size, device, start)
            if (description := stepper.describe()) is not None:
                print(f"mixprec train: {description}", flush=True)
        _quiet_overflow_warnings(stack, cfg, parts)
        t_start = time.perf_counter() - wall_offset
        consecutive_skips = 0
        for step in range(start, t.steps):
            maybe_inject_fault(rank, step)
            is_last = step == t.steps - 1
            # The last step evaluates after its update (the final model, in summary.json); others before it.
            due = bool(t.eval_interval) and (is_last or step % t.eval_interval == 0)
            eval_loss = stepper.evaluate() if due and not is_last else None
            lr = current_lr(parts.optimizer) if schedule is not None else None
            t0 = time.perf_counter()
            result = stepper.step(step, headroom)
            if schedule is not None:
                schedule.step()  # SkipAwareLR: only when the optimizer step ran
            dt = time.perf_counter() - t0
            if due and is_last:
                eval_loss = stepper.evaluate()
            if log is not None:
                timing = {"tokens_per_s": tokens_per_step / dt, "wall_time": time.perf_counter() - t_start}
                log.write(step, result, eval_loss, timing | _telemetry_fields(parts, result, lr, headroom.captured))
            consecutive_skips = consecutive_skips + 1 if result.skipped else 0
            _check_diverged(parts, cfg, consecutive_skips, step, result.scale)
            done = step + 1
            if done == t.steps or (t.checkpoint_interval and done % t.checkpoint_interval == 0):
                _save(parts, cfg, corpus, stepper, done, time.perf_counter() - t_start)
    if not is_main:
        return None
    metrics_path = os.path.join(t.out_dir, METRICS_NAME)
    summary = summarize_run(metrics_path, parameters=parts.module.num_parameters(), corpus=corpus)
    summary.update(world_size=world_size, device=str(device))
    write_summary(summary, os.path.join(t.out_dir, SUMMARY_NAME))
    return summary
