"""Compare training runs by their loss curves: a table and a plot, from any JSONL with ``step`` and ``loss``.

A run is a ``mixprec train`` run directory (its ``metrics.jsonl`` is read) or a JSONL file of one object per
line. Only ``step`` (an integer) and ``loss`` (a number) are required; ``eval_loss``, ``skipped`` and
``tokens_per_s`` are used when present, so a log from another machine or framework compares as well. Rows whose
loss is missing or null are ignored. Steps are checked as every reader of a metrics log checks them
(:func:`mixprec.lab.metrics.read_step_rows`): integers in ``0..2**53``, increasing down the file; a step that
appears twice or goes back is refused (``duplicates="error"``, the default: ``mixprec train`` never writes one,
since a resumed run first drops the rows after its checkpoint); with ``duplicates="last"`` the later row wins (a
log that a resumed run appended to without dropping them), and :attr:`RunLog.repeated_steps` counts the steps so
replaced, which ``mixprec compare`` reports.

The table's columns are defined in :class:`RunComparison`.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mixprec.lab.metrics import DUPLICATE_RULES, METRICS_NAME, read_step_rows

__all__ = ["DUPLICATE_RULES", "RunComparison", "RunLog", "compare_runs", "format_table", "load_run", "plot_comparison"]

_LAST_HINT = (
    "; to keep the later row of each repeated step (a log appended to by a resumed run), pass --duplicate-steps last"
)


@dataclass(frozen=True)
class RunLog:
    """One run's per-step records, keyed by step (sorted)."""

    name: str
    path: str
    loss: dict[int, float]
    eval_loss: dict[int, float]
    skipped: int | None
    tokens_per_s: float | None
    repeated_steps: int = 0

    @property
    def steps(self) -> list[int]:
        return sorted(self.loss)


@dataclass(frozen=True)
class RunComparison:
    """One row of the comparison table.

    Definitions (the first run is the reference; differences are taken at the steps both runs logged):

    * ``final loss``: the loss at the run's last step; ``best loss``: its smallest finite loss;
      ``final val loss``: ``eval_loss`` at the last step that has one.
    * ``max abs diff``: max over common steps of ``|loss - loss_ref|``; ``max rel diff``: max of
      ``|loss - loss_ref| / |loss_ref|`` over common steps where ``loss_ref != 0``. A non-finite loss in either run
      makes that step's difference infinite.
    * ``first step > threshold``: the first common step where ``|loss - loss_ref| > threshold`` (absolute, in loss
      units), or none.
    * ``skipped``: rows with ``skipped`` true; ``tokens/s``: median of ``tokens_per_s``.
    """

    name: str
    steps: int
    last_step: int
    final_loss: float
    best_loss: float | None
    final_eval_loss: float | None
    common_steps: int
    max_abs_diff: float | None
    max_rel_diff: float | None
    first_step_over: int | None
    skipped: int | None
    tokens_per_s: float | None


def _metrics_path(path: str) -> str:
    if os.path.isdir(path):
        candidate = os.path.join(path, METRICS_NAME)
        if not os.path.isfile(candidate):
            raise ValueError(f"{path!r} is a directory without {METRICS_NAME} (not a mixprec train run directory)")
        return candidate
    if not os.path.isfile(path):
        raise ValueError(f"no such run directory or JSONL file: {path!r}")
    return path


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number; got {value!r}")
    return float(value)


def load_run(path: str, name: str | None = None, *, duplicates: str = "error") -> RunLog:
    """Read a run directory or JSONL file.

    ``duplicates``: what a step logged on two rows (or going back) means: ``"error"`` refuses it, ``"last"`` keeps
    the later row (counted in :attr:`RunLog.repeated_steps`). Raises ValueError on unreadable lines, on a step
    that is no integer in ``0..2**53``, on a repeated or decreasing step with ``"error"``, or when no row has a
    loss.
    """
    file = _metrics_path(path)
    repeated: set[int] = set()
    loss: dict[int, float] = {}
    eval_loss: dict[int, float] = {}
    skipped: dict[int, bool] = {}
    tps: dict[int, float] = {}
    rows = read_step_rows(file, duplicates=duplicates, counts=lambda row: row.get("loss") is not None, hint=_LAST_HINT)
    for where, step, row, again in rows:
        if again:
            repeated.add(step)
            # The later row replaces the earlier one completely, also where it lacks a field.
            for record in (eval_loss, skipped, tps):
                record.pop(step, None)
        loss[step] = _number(row["loss"], f"{where}: 'loss'")
        if row.get("eval_loss") is not None:
            eval_loss[step] = _number(row["eval_loss"], f"{where}: 'eval_loss'")
        if "skipped" in row:
            skipped[step] = bool(row["skipped"])
        if row.get("tokens_per_s") is not None:
            tps[step] = _number(row["tokens_per_s"], f"{where}: 'tokens_per_s'")
    if not loss:
        raise ValueError(f"{file}: no row with both 'step' and 'loss'")
    label = name or (
        os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else os.path.splitext(os.path.basename(path))[0]
    )
    return RunLog(
        name=label,
        path=file,
        loss=dict(sorted(loss.items())),
        eval_loss=dict(sorted(eval_loss.items())),
        skipped=sum(skipped.values()) if skipped else None,
        tokens_per_s=statistics.median(tps.values()) if tps else None,
        repeated_steps=len(repeated),
    )


def _diff(a: float, b: float) -> float:
    d = abs(a - b)
    return d if math.isfinite(d) else math.inf


def compare_runs(runs: Sequence[RunLog], *, threshold: float) -> list[RunComparison]:
    """One :class:`RunComparison` per run, differences against ``runs[0]``."""
    if not runs:
        raise ValueError("compare needs at least one run")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (an absolute loss difference); got {threshold!r}")
    ref = runs[0]
    out = []
    for run in runs:
        common = [s for s in run.steps if s in ref.loss]
        diffs = [(s, _diff(run.loss[s], ref.loss[s])) for s in common]
        rels = [d / abs(ref.loss[s]) for s, d in diffs if ref.loss[s] != 0 and math.isfinite(ref.loss[s])]
        rels += [math.inf for s, d in diffs if not math.isfinite(ref.loss[s])]
        finite = [v for v in run.loss.values() if math.isfinite(v)]
        last = run.steps[-1]
        out.append(
            RunComparison(
                name=run.name,
                steps=len(run.loss),
                last_step=last,
                final_loss=run.loss[last],
                best_loss=min(finite) if finite else None,
                final_eval_loss=run.eval_loss[max(run.eval_loss)] if run.eval_loss else None,
                common_steps=len(common),
                max_abs_diff=max((d for _, d in diffs), default=None),
                max_rel_diff=max(rels, default=None),
                first_step_over=next((s for s, d in diffs if d > threshold), None),
                skipped=run.skipped,
                tokens_per_s=run.tokens_per_s,
            )
        )
    return out


def _fmt(value: float | int | None, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


def format_table(rows: Sequence[RunComparison], *, threshold: float) -> str:
    """A markdown table of :func:`compare_runs`' result."""
    head = (
        "| run | steps | final loss | best loss | final val loss | max abs diff | max rel diff | "
        f"first step diff > {threshold:g} | skipped | tokens/s |"
    )
    lines = [head, "|" + "---|" * 10]
    for i, r in enumerate(rows):
        ref = i == 0
        lines.append(
            f"| {r.name}{' (reference)' if ref else ''} | {r.steps} | {_fmt(r.final_loss, '.4f')} | "
            f"{_fmt(r.best_loss, '.4f')} | {_fmt(r.final_eval_loss, '.4f')} | "
            f"{'-' if ref else _fmt(r.max_abs_diff, '.4g')} | {'-' if ref else _fmt(r.max_rel_diff, '.3%')} | "
            f"{'-' if ref else (_fmt(r.first_step_over, 'd') if r.first_step_over is not None else 'never')} | "
            f"{_fmt(r.skipped, 'd')} | {_fmt(r.tokens_per_s, ',.0f')} |"
        )
    return "\n".join(lines)


def plot_comparison(runs: Sequence[RunLog], path: str, *, threshold: float, title: str | None = None) -> str:
    """Write a PNG: the loss curves (top) and each run's difference to the first run (bottom). Returns ``path``.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'mixprec[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "the comparison plot needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)"
        ) from exc
    if not runs:
        raise ValueError("plot_comparison needs at least one run")
    ref = runs[0]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 2))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax_loss.plot(run.steps, list(run.loss.values()), color=color, lw=1.0, label=run.name)
        if run.eval_loss:
            ax_loss.plot(list(run.eval_loss), list(run.eval_loss.values()), "o", color=color, ms=3)
        if i:
            common = [s for s in run.steps if s in ref.loss]
            ax_diff.plot(common, [run.loss[s] - ref.loss[s] for s in common], color=color, lw=1.0, label=run.name)
    ax_loss.set_ylabel("training loss (dots: validation)")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_diff.axhline(threshold, color="gray", ls="--", lw=0.8)
    ax_diff.axhline(-threshold, color="gray", ls="--", lw=0.8)
    ax_diff.axhline(0.0, color=f"C{0}", lw=0.8)
    ax_diff.set_ylabel(f"loss - loss of {ref.name}")
    ax_diff.set_xlabel("step")
    ax_diff.grid(alpha=0.3)
    if title:
        ax_loss.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
