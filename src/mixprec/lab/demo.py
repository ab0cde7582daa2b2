"""``mixprec demo``: the same model, seed and batches trained five ways, compared, and explained in ``report.md``.

The runs (same GPT, same seed, same batches, ``nproc`` gloo ranks):

1. ``fp32``: the reference.
2. ``bf16-native``: bf16 parameters and gradients, reduced by the backend's own collective (it sums in bf16).
3. ``bf16-fp32acc``: the same, reduced with a bf16 wire and an fp32 sum (one rounding per element).
4. ``fp16-dynamic``: fp16 parameters and gradients with dynamic loss scaling.
5. ``uint8``: fp32 gradients sent as 8-bit min-max codes.

Runs that need a capability this installation lacks are listed in the report as not run, with the reason. The
report's sentences are generated from the measured metrics; nothing in them is canned. :func:`run_studies` adds
the studies at simulated data-parallel sizes (mixprec.lab.dp_band, scale_study, uint8_study).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.lab.compare import RunComparison, RunLog, compare_runs, format_table, load_run, plot_comparison
from mixprec.lab.config import TrainConfig
from mixprec.lab.launch import TrainingFailed, launch
from mixprec.lab.metrics import METRICS_NAME, read_rows
from mixprec.lab.train import TrainingDiverged
from mixprec.scaling import LossScaleFloorError

__all__ = [
    "DEMO_DEFAULTS",
    "DEMO_RUNS",
    "DemoRun",
    "Studies",
    "plan_demo",
    "plan_studies",
    "run_demo",
    "run_studies",
    "write_report",
]


@dataclass(frozen=True)
class DemoRun:
    """One run of the demo: a name (its directory and label), what it shows, and its TrainConfig overrides."""

    name: str
    description: str
    overrides: dict[str, Any]


DEMO_RUNS: tuple[DemoRun, ...] = (
    DemoRun("fp32", "fp32, the reference", {"precision": "fp32", "reduce": "native"}),
    DemoRun(
        "bf16-native", "bf16, native reduction: the backend sums in bf16", {"precision": "bf16", "reduce": "native"}
    ),
    DemoRun(
        "bf16-fp32acc",
        "bf16, fp32-accumulate reduction: bf16 wire, fp32 sum",
        {"precision": "bf16", "reduce": "fp32_accumulate"},
    ),
    DemoRun("fp16-dynamic", "fp16, dynamic loss scaling", {"precision": "fp16", "loss_scaler": "dynamic"}),
    DemoRun("uint8", "fp32, uint8-compressed reduction: ByteGrad scheme", {"precision": "fp32", "reduce": "uint8"}),
)

# 0.45M parameters, 4 ranks x 2 microbatches x 4 sequences x 64 characters = 2048 tokens per step.
DEMO_DEFAULTS: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 64,
    "global_batch_size": 32,
    "micro_batch_size": 4,
    "nproc": 4,
    "steps": 200,
    "eval_interval": 25,
    "eval_sequences": 64,
    "checkpoint_interval": 0,
    "lr": 2e-3,
    # fp16: start high so that the first steps overflow and the scaler visibly backs off, then grows again.
    "loss_scale": 2.0**16,
    "scale_growth_interval": 50,
    # The demo studies the CPU emulation on gloo ranks, also on a machine that has a GPU.
    "device": "cpu",
}

# A few seconds in total: for tests and a first look.
QUICK_OVERRIDES: dict[str, Any] = {
    "n_layer": 1,
    "n_embd": 32,
    "block_size": 16,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "nproc": 2,
    "steps": 12,
    "eval_interval": 6,
    "eval_sequences": 8,
    "scale_growth_interval": 4,
}


def plan_demo(
    *,
    out_dir: str = "mixprec-demo",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    threshold: float = 0.05,
    runs: Sequence[DemoRun] = DEMO_RUNS,
) -> list[TrainConfig]:
    """The configuration of each of ``runs``, every argument checked before any run starts.

    Raises:
        ValueError, TypeError: a bad threshold, or overrides that make a run's configuration invalid.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (an absolute loss difference); got {threshold!r}")
    if not runs:
        raise ValueError("runs must name at least one demo run")
    base = {**DEMO_DEFAULTS, **(overrides or {}), "seed": seed}
    return [
        TrainConfig.from_dict({**base, **demo_run.overrides, "out_dir": os.path.join(out_dir, "runs", demo_run.name)})
        for demo_run in runs
    ]


@dataclass
class _Outcome:
    run: DemoRun
    status: str  # "ok" or "failed"
    detail: str = ""
    seconds: float = 0.0


def run_demo(
    *,
    out_dir: str = "mixprec-demo",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    threshold: float = 0.05,
    progress: bool | None = None,
    runs: Sequence[DemoRun] = DEMO_RUNS,
    audit_lines: Sequence[str] = (),
    study_size: str | None = None,
    started: float | None = None,
) -> int:
    """Train each of ``runs``, compare them, then (with ``study_size``) run the three studies at that size
    (:func:`run_studies`); write ``out_dir/report.md`` once, at the end, and ``out_dir/compare.png``.

    The report opens with the wall time of the whole demo, measured from ``started`` (a ``time.perf_counter()``
    value; default: this call's start) to the report, and with the studies' three verdicts, before any table.
    Returns 0 when every available run finished, 1 when one failed. Runs needing a missing capability are
    skipped and reported, not failed. Raises what :func:`plan_demo` and :func:`plan_studies` raise, before any
    run starts. ``audit_lines`` (from :func:`mixprec.lab.audit.audit_citation`): a section citing this
    machine's audit.
    """
    configs = plan_demo(out_dir=out_dir, seed=seed, overrides=overrides, threshold=threshold, runs=runs)
    if study_size is not None:
        plan_studies(out_dir, seed, study_size)
    base = {**DEMO_DEFAULTS, **(overrides or {}), "seed": seed}
    t_start = time.perf_counter() if started is None else started
    os.makedirs(out_dir, exist_ok=True)
    t_runs = time.perf_counter()
    outcomes: list[_Outcome] = []
    for i, (demo_run, cfg) in enumerate(zip(runs, configs)):
        print(f"mixprec demo: [{i + 1}/{len(runs)}] {demo_run.name}: {demo_run.description}", flush=True)
        t0 = time.perf_counter()
        try:
            launch(cfg, overwrite=True, progress=progress)
            outcomes.append(_Outcome(demo_run, "ok", seconds=time.perf_counter() - t0))
        except (TrainingFailed, TrainingDiverged, LossScaleFloorError) as exc:
            # The run itself failed (a rank, or divergence): reported, and the others still run. Anything else
            # is a bug and keeps its traceback.
            print(f"mixprec demo: {demo_run.name} failed: {exc}")
            outcomes.append(_Outcome(demo_run, "failed", str(exc), time.perf_counter() - t0))
    finished = [o for o in outcomes if o.status == "ok"]
    report = os.path.join(out_dir, "report.md")
    logs: list[RunLog] = []
    rows: list[RunComparison] = []
    png = None
    if finished:
        logs = [load_run(os.path.join(out_dir, "runs", o.run.name, METRICS_NAME), o.run.name) for o in finished]
        png = plot_comparison(
            logs,
            os.path.join(out_dir, "compare.png"),
            threshold=threshold,
            title="mixprec demo: same model, seed, data",
        )
        rows = compare_runs(logs, threshold=threshold)
        print()
        print(format_table(rows, threshold=threshold))
    else:
        print("mixprec demo: no run finished; nothing to compare")
    runs_seconds = time.perf_counter() - t_runs
    studies = run_studies(out_dir, seed, study_size) if study_size is not None else None
    if finished or studies is not None:
        text = write_report(
            outcomes,
            logs,
            rows,
            cfg=TrainConfig.from_dict({**base, "out_dir": out_dir}),
            threshold=threshold,
            png=os.path.basename(png) if png else None,
            total_seconds=time.perf_counter() - t_start,
            runs_seconds=runs_seconds,
            studies=studies,
            audit_lines=audit_lines,
        )
        with open(report, "w") as fh:
            fh.write(text)
        if studies is not None:
            print("\n".join(["", "mixprec demo: what the studies measured:", *studies.verdicts]))
            print("\nmixprec demo: the verdicts:")
            for title, sentence in studies.headlines:
                print(f"- {title}: {sentence}.")
        where = f"report {report}" + (f", plot {png}" if png else "")
        print(f"\nmixprec demo: {where} ({time.perf_counter() - t_start:.0f} s in total)")
    return 0 if all(o.status != "failed" for o in outcomes) and finished else 1


# ------------------------------------------------------------------------------------------------ the report
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


def write_report(
    outcomes: Sequence[_Outcome],
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
    by_name = {o.run.name: o for o in outcomes}
    cpu = _cpu_model()
    m, d, t = cfg.model, cfg.data, cfg.training
    lines = [
        "# mixprec demo report",
        "",
        f"{datetime.date.today().isoformat()}, {platform.node() or 'unknown host'}: {os.cpu_count()} CPU cores "
        f"({cpu}), torch {torch.__version__}, Python {platform.python_version()}.",
        "",
        _wall_time_line(len(outcomes), total_seconds, runs_seconds, studies),
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
    lines.append("")
    if logs:
        ref, ref_row = logs[0], rows[0]
        lines += [
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
        ranked = sorted(
            (r for r in rows[1:] if r.final_eval_loss is not None and ref_row.final_eval_loss is not None),
            key=lambda r: abs(r.final_eval_loss - ref_row.final_eval_loss),  # type: ignore[operator]
        )
        if len(ranked) >= 2:
            lines += [
                "",
                f"Closest to the reference in final validation loss: **{ranked[0].name}** "
                f"({ranked[0].final_eval_loss - ref_row.final_eval_loss:+.4f}); furthest: **{ranked[-1].name}** "  # type: ignore[operator]
                f"({ranked[-1].final_eval_loss - ref_row.final_eval_loss:+.4f}).",  # type: ignore[operator]
            ]
        lines.append("")
    if studies is not None:
        lines.append(studies.sections)
    skipped = [o for o in outcomes if o.status != "ok"]
    if skipped:
        lines += ["## Not run", ""]
        for o in skipped:
            lines.append(f"- **{o.run.name}** ({o.run.description}): {o.status}: {o.detail}")
        lines.append("")
    if audit_lines:
        lines += ["## This machine's collectives (mixprec audit collectives)", "", *audit_lines, ""]
    if logs:
        lines += [
            "## Reproduce",
            "",
            "Each run directory holds its resolved `config.toml`; rerun one with "
            f"`mixprec train --config {os.path.join(t.out_dir, 'runs', logs[0].name, 'config.toml')} --overwrite`, "
            f"and compare any runs with `mixprec compare {os.path.join(t.out_dir, 'runs', '*')}`.",
            "",
        ]
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


def table_with_descriptions(rows: Sequence[RunComparison], by_name: dict[str, _Outcome], threshold: float) -> str:
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


# ------------------------------------------------------------------------------------------------ the studies
STUDY_SIZES = ("quick", "default", "full")


def _study_settings(size: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, run function, setting) of each study section at ``size``."""
    from mixprec.lab import dp_band, scale_study, uint8_study

    pick = {"quick": 0, "default": 1, "full": 2}[size]
    return [
        (
            "simulated-DP bands",
            dp_band.run_dp_band,
            (dp_band.DP_BAND_QUICK, dp_band.DP_BAND_DEFAULT, dp_band.DP_BAND_FULL)[pick],
        ),
        (
            "loss scale",
            scale_study.run_scale_study,
            (scale_study.SCALE_QUICK, scale_study.SCALE_DEFAULT, scale_study.SCALE_FULL)[pick],
        ),
        (
            "uint8 offset",
            uint8_study.run_uint8_study,
            (uint8_study.UINT8_QUICK, uint8_study.UINT8_DEFAULT, uint8_study.UINT8_FULL)[pick],
        ),
    ]


def plan_studies(out_dir: str, seed: int, size: str) -> None:
    """Check every study run's configuration before the first run starts (ValueError when one is invalid)."""
    from mixprec.lab import dp_band, scale_study, uint8_study

    if size not in STUDY_SIZES:
        raise ValueError(f"study size must be one of {', '.join(STUDY_SIZES)}; got {size!r}")
    for name, _, setting in _study_settings(size):
        if name == "simulated-DP bands":
            dp_band.plan_dp_band(out_dir, seed, setting)
        elif name == "loss scale":
            scale_study.plan_scale_study(out_dir, seed, setting)
        else:
            uint8_study.plan_uint8_study(out_dir, seed, setting)


@dataclass
class Studies:
    """What :func:`run_studies` measured: the report's sections (markdown), every verdict line (prefixed by its
    study), each study's headline (title, sentence) and wall time, at ``size``."""

    size: str
    sections: str
    verdicts: list[str]
    headlines: list[tuple[str, str]]
    seconds: dict[str, float]


# The report's opening verdicts: one per study, under these titles, in the order of _study_settings.
HEADLINE_TITLES = {
    "simulated-DP bands": "Reduction precision at large DP",
    "loss scale": "Loss-scale rule",
    "uint8 offset": "uint8 compression or chaos",
}


def run_studies(out_dir: str, seed: int, size: str) -> Studies:
    """Run the three study sections (reduction precision at simulated DP, the loss-scale rules, the uint8 offset)
    at ``size``; returns their sections, verdict lines, headlines and wall times."""
    sections, verdicts, headlines, seconds = [], [], [], {}
    for name, run, setting in _study_settings(size):
        t0 = time.perf_counter()
        section, said = run(out_dir, seed, setting)
        seconds[name] = time.perf_counter() - t0
        sections.append(section + f"\n({name}: {seconds[name]:.0f} s)\n")
        verdicts += [f"[{name}] {s}" for s in said]
        headlines.append((HEADLINE_TITLES[name], said.headline))
        print(f"mixprec demo: {name}: {seconds[name]:.0f} s", flush=True)
    return Studies(size, "\n".join(sections), verdicts, headlines, seconds)
