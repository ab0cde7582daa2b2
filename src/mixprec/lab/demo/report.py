"""``report.md`` of ``mixprec demo``: every sentence computed from the runs' metrics and the studies' measurements,
nothing canned. The header with the demo's wall time, the studies' verdicts, the runs' table and what differed,
the study sections, the runs not run, this machine's audit, and how to reproduce.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from collections.abc import Sequence

import torch

from mixprec.lab.compare import RunComparison, RunLog, compare_runs, format_table
from mixprec.lab.config import TrainConfig
from mixprec.lab.demo.plan import RunOutcome
from mixprec.lab.demo.sections import Studies
from mixprec.lab.metrics import read_rows

__all__ = ["table_with_descriptions", "write_report"]


def _scale_story(log_path: str) -> str | None:
    """What the loss scaler did, from a run's metrics (None when it never skipped a step)."""
    rows = list(read_rows(log_path))
    skipped = [r["step"] for r in rows if r.get("skipped")]
    if not skipped:
        return None
    scales = [r["loss_scale"] for r in rows]
    shown = ", ".join(str(s) for s in skipped[:8]) + (", ..." if len(skipped) > 8 else "")
    return (
        f"it skipped {len(skipped)} of {len(rows)} steps on inf/NaN gradients (steps {shown}); the loss scale it "
        f"used ranged from {min(scales):g} to {max(scales):g} ({scales[0]:g} at the first step, {scales[-1]:g} at the "
        "last)"
    )


def _tail_offset(run: RunLog, ref: RunLog, blocks: int = 5) -> tuple[float, float, int] | None:
    """Mean of (loss - reference loss) over the last quarter of the common steps, with a batch-means standard
    error: the tail is cut into ``blocks`` consecutive blocks and the error is taken from the block means, since
    the differences at neighbouring steps are correlated (the parameters drift slowly)."""
    common = [s for s in run.steps if s in ref.loss]
    tail = common[len(common) - max(2 * blocks, len(common) // 4) :]
    diffs = [run.loss[s] - ref.loss[s] for s in tail if math.isfinite(run.loss[s] - ref.loss[s])]
    size = len(diffs) // blocks
    if size < 1:
        return None
    diffs = diffs[len(diffs) - size * blocks :]
    means = [statistics.fmean(diffs[k * size : (k + 1) * size]) for k in range(blocks)]
    return statistics.fmean(diffs), statistics.stdev(means) / math.sqrt(blocks), len(diffs)


def _first_difference(run: RunLog, ref: RunLog) -> int | None:
    return next((s for s in run.steps if s in ref.loss and run.loss[s] != ref.loss[s]), None)


def _run_sentences(
    run: RunLog, row: RunComparison, ref: RunLog, ref_row: RunComparison, threshold: float, precision: str
) -> str:
    parts = []
    first_diff = _first_difference(run, ref)
    if first_diff is None:
        parts.append(f"its loss equalled {ref.name}'s bit for bit at all {row.common_steps} common steps")
    else:
        why = f" (its initial weights are the fp32 ones rounded to {precision})" if first_diff == 0 else ""
        delta = row.final_loss - ref_row.final_loss
        parts.append(
            f"its loss first differed from {ref.name}'s at step {first_diff}{why}; at the last step it was "
            f"{row.final_loss:.4f} ({delta:+.4f}, {delta / ref_row.final_loss:+.2%})"
        )
        if row.final_eval_loss is not None and ref_row.final_eval_loss is not None:
            ev = row.final_eval_loss - ref_row.final_eval_loss
            parts.append(f"the final validation loss was {row.final_eval_loss:.4f} ({ev:+.4f})")
        over = (
            f"first exceeded {threshold:g} at step {row.first_step_over}"
            if row.first_step_over is not None
            else f"never exceeded {threshold:g}"
        )
        parts.append(f"the per-step difference reached {row.max_abs_diff:.4f} at most and {over}")
        tail = _tail_offset(run, ref)
        if tail is not None:
            mean, se, n = tail
            if abs(mean) > 3 * se:
                verdict = f"consistently {'above' if mean > 0 else 'below'} {ref.name} (more than 3 standard errors)"
            else:
                verdict = "not distinguishable from zero (within 3 standard errors)"
            parts.append(
                f"over the last {n} steps it averaged {mean:+.4f} (batch-means standard error {se:.4f}), {verdict}"
            )
    story = _scale_story(run.path)
    if story:
        parts.append(story)
    if row.tokens_per_s and ref_row.tokens_per_s:
        parts.append(f"it ran at {row.tokens_per_s / ref_row.tokens_per_s:.2f}x the reference's tokens/s")
    return "; ".join(parts) + "."


def _header(
    outcomes: Sequence[RunOutcome], total: float, runs_seconds: float | None, studies: Studies | None
) -> list[str]:
    """The title, the machine, the wall time and the studies' verdicts (or why there are none)."""
    lines = [
        "# mixprec demo report",
        "",
        f"{datetime.date.today().isoformat()}, {platform.node() or 'unknown host'}: {os.cpu_count()} CPU cores "
        f"({_cpu_model()}), torch {torch.__version__}, Python {platform.python_version()}.",
        "",
        _wall_time_line(len(outcomes), total, runs_seconds, studies),
        "",
        "## Verdicts",
        "",
    ]
    if studies is not None:
        lines += [f"{k}. **{title}**: {sentence}." for k, (title, sentence) in enumerate(studies.headlines, 1)]
        lines += ["", "Each is measured in its study section below, with its band, table and every verdict line."]
    else:
        lines.append(
            "The three verdicts (reduction precision at large DP, the loss-scale rule, uint8 compression or chaos) "
            "come from the studies, which this demo skipped (`--no-studies`): the runs below are compared step by "
            "step only."
        )
    return [*lines, ""]


def _closest_and_furthest(rows: Sequence[RunComparison]) -> list[str]:
    ref_eval = rows[0].final_eval_loss
    if ref_eval is None:
        return []
    ranked = sorted(
        ((r.name, r.final_eval_loss - ref_eval) for r in rows[1:] if r.final_eval_loss is not None),
        key=lambda item: abs(item[1]),
    )
    if len(ranked) < 2:
        return []
    return [
        "",
        f"Closest to the reference in final validation loss: **{ranked[0][0]}** ({ranked[0][1]:+.4f}); furthest: "
        f"**{ranked[-1][0]}** ({ranked[-1][1]:+.4f}).",
    ]


def _runs_section(
    outcomes: Sequence[RunOutcome],
    logs: Sequence[RunLog],
    rows: Sequence[RunComparison],
    cfg: TrainConfig,
    threshold: float,
    png: str | None,
) -> list[str]:
    """The runs' setting, their table and plot, and what differed in each against the reference."""
    by_name = {o.run.name: o for o in outcomes}
    m, d, t = cfg.model, cfg.data, cfg.training
    ref, ref_row = logs[0], rows[0]
    lines = [
        f"## {len(outcomes)} runs of one model",
        "",
        f"Every run trains the same {m.n_layer}-layer GPT (n_embd {m.n_embd}, context {m.block_size} "
        f"characters) from the same seed ({t.seed}) on the same batches of Python's standard library sources, "
        f"for {t.steps} steps of {d.global_batch_size} sequences ({d.global_batch_size * m.block_size} "
        f"characters) on {cfg.parallel.nproc} gloo ranks, AdamW at lr {cfg.optimizer.lr:g}, gradient clipping "
        f"at {t.clip_grad_norm:g}. "
        f"Only the precision and the gradient reduction change. Differences are taken against `{ref.name}` at "
        "each step (same batch), so they show what the numerics did, not sampling noise.",
        "",
        table_with_descriptions(rows, by_name, threshold),
        "",
        f"![loss curves and differences]({png})",
        "",
        "### What differed",
        "",
    ]
    for log, row in zip(logs[1:], rows[1:]):
        demo_run = by_name[log.name].run
        precision = str(demo_run.overrides.get("precision", cfg.model.precision))
        sentences = _run_sentences(log, row, ref, ref_row, threshold, precision)
        lines.append(f"- **{log.name}** ({demo_run.description}): {sentences}")
    pair = _pair_sentence(logs)
    if pair:
        lines += ["", pair]
    return [*lines, *_closest_and_furthest(rows), ""]


def _closing(
    outcomes: Sequence[RunOutcome], logs: Sequence[RunLog], out_dir: str, audit_lines: Sequence[str]
) -> list[str]:
    """The runs not run, this machine's audit, and how to reproduce."""
    lines: list[str] = []
    skipped = [o for o in outcomes if o.status != "ok"]
    if skipped:
        lines += ["## Not run", ""]
        lines += [f"- **{o.run.name}** ({o.run.description}): {o.status}: {o.detail}" for o in skipped]
        lines.append("")
    if audit_lines:
        lines += ["## This machine's collectives (mixprec audit collectives)", "", *audit_lines, ""]
    if logs:
        lines += [
            "## Reproduce",
            "",
            "Each run directory holds its resolved `config.toml`; rerun one with "
            f"`mixprec train --config {os.path.join(out_dir, 'runs', logs[0].name, 'config.toml')} --overwrite`, "
            f"and compare any runs with `mixprec compare {os.path.join(out_dir, 'runs', '*')}`.",
            "",
        ]
    return lines


def write_report(
    outcomes: Sequence[RunOutcome],
    logs: Sequence[RunLog],
    rows: Sequence[RunComparison],
    *,
    cfg: TrainConfig,
    threshold: float,
    png: str | None,
    total_seconds: float,
    runs_seconds: float | None = None,
    studies: Studies | None = None,
    audit_lines: Sequence[str] = (),
) -> str:
    """The text of ``report.md``, every sentence computed from the runs' metrics and the studies' measurements:
    the header with the whole demo's wall time, the studies' three verdicts, then the runs' table and sections,
    then the study sections."""
    lines = _header(outcomes, total_seconds, runs_seconds, studies)
    if logs:
        lines += _runs_section(outcomes, logs, rows, cfg, threshold, png)
    if studies is not None:
        lines.append(studies.sections)
    lines += _closing(outcomes, logs, cfg.training.out_dir, audit_lines)
    return "\n".join(lines)


def _wall_time_line(runs: int, total: float, runs_seconds: float | None, studies: Studies | None) -> str:
    """The whole demo's wall time, and what it went to."""
    parts = []
    if runs_seconds is not None:
        parts.append(f"{runs_seconds:.0f} s the {runs} run{'s' if runs != 1 else ''} and their comparison")
    if studies is not None:
        each = ", ".join(f"{name} {sec:.0f} s" for name, sec in studies.seconds.items())
        parts.append(f"{sum(studies.seconds.values()):.0f} s the studies at size {studies.size} ({each})")
    detail = f": {'; '.join(parts)}" if parts else ""
    return f"Wall time: {total:.0f} s in total, from the start of the demo to this report{detail}."


def table_with_descriptions(rows: Sequence[RunComparison], by_name: dict[str, RunOutcome], threshold: float) -> str:
    return (
        format_table(rows, threshold=threshold)
        + "\n\n"
        + "; ".join(f"`{r.name}`: {by_name[r.name].run.description}" for r in rows)
        + "."
    )


def _pair_sentence(logs: Sequence[RunLog]) -> str | None:
    """The two bf16 runs differ only in how the gradient sum is rounded (a last-bit perturbation): how far apart
    they end is the size of difference any tiny perturbation of the trajectory produces here."""
    names = {log.name: log for log in logs}
    if "bf16-native" not in names or "bf16-fp32acc" not in names:
        return None
    acc, native = names["bf16-fp32acc"], names["bf16-native"]
    row = compare_runs([acc, native], threshold=math.inf)[1]
    first = _first_difference(native, acc)
    if first is None:
        return (
            "The two bf16 runs, which differ only in how the gradient sum is rounded, were identical bit for bit at "
            f"every step: with {_nproc_of(acc)} ranks the backend's bf16 sum rounded like one fp32 sum."
        )
    last = max(s for s in native.steps if s in acc.loss)
    text = (
        "The two bf16 runs differ only in how the gradient sum is rounded (in bf16 at every addition, or in fp32 "
        f"and once at the end): their losses were bit-identical before step {first}, where they first differed; "
        f"the largest per-step difference between them was {row.max_abs_diff:.4f}, and at the last common step "
        f"native minus fp32-accumulate was {native.loss[last] - acc.loss[last]:+.4f}"
    )
    if native.eval_loss and acc.eval_loss:
        ev = native.eval_loss[max(native.eval_loss)] - acc.eval_loss[max(acc.eval_loss)]
        text += (
            f", {ev:+.4f} in final validation loss. Since that perturbation is in the last bits, a gap of this size "
            "is what any perturbation of the trajectory grows into over these steps: differences to the reference "
            "that are not clearly larger are not evidence of a precision effect"
        )
    return text + "."


def _nproc_of(log: RunLog) -> str:
    import tomllib

    try:
        with open(os.path.join(os.path.dirname(log.path), "config.toml"), "rb") as fh:
            return str(tomllib.load(fh)["nproc"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "these"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
