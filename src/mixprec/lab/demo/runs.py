"""``mixprec demo``'s main job: train the five runs, compare them, run the study sections, write ``report.md``.

Each run either finishes, fails (a rank failed, the run diverged, the loss scale hit its floor: reported, and
the other runs still go), or raises a bug with its traceback. The comparison table and ``compare.png`` cover
the finished runs; the report is written once, at the end (:mod:`mixprec.lab.demo.report`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from mixprec.lab.compare import RunComparison, RunLog, compare_runs, format_table, load_run, plot_comparison
from mixprec.lab.config import TrainConfig
from mixprec.lab.demo.plan import (
    DEFAULT_OUT_DIR,
    DEFAULT_THRESHOLD,
    DEMO_DEFAULTS,
    DEMO_RUNS,
    DemoRun,
    RunOutcome,
    plan_demo,
)
from mixprec.lab.demo.report import write_report
from mixprec.lab.demo.sections import Studies, plan_studies, run_studies
from mixprec.lab.launch import TrainingFailed, launch
from mixprec.lab.metrics import METRICS_NAME
from mixprec.lab.studies.base import DEFAULT_SEED
from mixprec.lab.train import TrainingDiverged
from mixprec.scaling import LossScaleFloorError

__all__ = ["run_demo"]


def _train(runs: Sequence[DemoRun], configs: Sequence[TrainConfig], progress: bool | None) -> list[RunOutcome]:
    outcomes: list[RunOutcome] = []
    for i, (demo_run, cfg) in enumerate(zip(runs, configs)):
        print(f"mixprec demo: [{i + 1}/{len(runs)}] {demo_run.name}: {demo_run.description}", flush=True)
        t0 = time.perf_counter()
        try:
            launch(cfg, overwrite=True, progress=progress)
            outcomes.append(RunOutcome(demo_run, "ok", seconds=time.perf_counter() - t0))
        except (TrainingFailed, TrainingDiverged, LossScaleFloorError) as exc:
            # The run itself failed (a rank, or divergence): reported, and the others still run. Anything else
            # is a bug and keeps its traceback.
            print(f"mixprec demo: {demo_run.name} failed: {exc}")
            outcomes.append(RunOutcome(demo_run, "failed", str(exc), time.perf_counter() - t0))
    return outcomes


def _compare(
    out_dir: str, finished: Sequence[RunOutcome], threshold: float
) -> tuple[list[RunLog], list[RunComparison], str | None]:
    """The finished runs' logs, their comparison with the first (printed) and ``compare.png``."""
    if not finished:
        print("mixprec demo: no run finished; nothing to compare")
        return [], [], None
    logs = [load_run(os.path.join(out_dir, "runs", o.run.name, METRICS_NAME), o.run.name) for o in finished]
    png = plot_comparison(
        logs, os.path.join(out_dir, "compare.png"), threshold=threshold, title="mixprec demo: same model, seed, data"
    )
    rows = compare_runs(logs, threshold=threshold)
    print()
    print(format_table(rows, threshold=threshold))
    return logs, rows, png


def _print_closing(report: str, png: str | None, studies: Studies | None, t_start: float) -> None:
    if studies is not None:
        print("\n".join(["", "mixprec demo: what the studies measured:", *studies.verdicts]))
        print("\nmixprec demo: the verdicts:")
        for title, sentence in studies.headlines:
            print(f"- {title}: {sentence}.")
    where = f"report {report}" + (f", plot {png}" if png else "")
    print(f"\nmixprec demo: {where} ({time.perf_counter() - t_start:.0f} s in total)")


def run_demo(
    *,
    out_dir: str = DEFAULT_OUT_DIR,
    seed: int = DEFAULT_SEED,
    overrides: dict[str, Any] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    progress: bool | None = None,
    runs: Sequence[DemoRun] = DEMO_RUNS,
    audit_lines: Sequence[str] = (),
    study_size: str | None = None,
    started: float | None = None,
) -> int:
    """Train each of ``runs``, compare them, then (with ``study_size``) run the three studies at that size
    (:func:`~mixprec.lab.demo.sections.run_studies`); write ``out_dir/report.md`` once, at the end, and
    ``out_dir/compare.png``.

    The report opens with the wall time of the whole demo, measured from ``started`` (a ``time.perf_counter()``
    value; default: this call's start) to the report, and with the studies' three verdicts, before any table.
    Returns 0 when every available run finished, 1 when one failed. Runs needing a missing capability are
    skipped and reported, not failed. Raises what :func:`~mixprec.lab.demo.plan.plan_demo` and
    :func:`~mixprec.lab.demo.sections.plan_studies` raise, before any run starts. ``audit_lines`` (from
    :func:`mixprec.lab.studies.audit.audit_citation`): a section citing this machine's audit.
    """
    configs = plan_demo(out_dir=out_dir, seed=seed, overrides=overrides, threshold=threshold, runs=runs)
    if study_size is not None:
        plan_studies(out_dir, seed, study_size)
    base = {**DEMO_DEFAULTS, **(overrides or {}), "seed": seed}
    t_start = time.perf_counter() if started is None else started
    os.makedirs(out_dir, exist_ok=True)
    t_runs = time.perf_counter()
    outcomes = _train(runs, configs, progress)
    finished = [o for o in outcomes if o.status == "ok"]
    logs, rows, png = _compare(out_dir, finished, threshold)
    runs_seconds = time.perf_counter() - t_runs
    studies = run_studies(out_dir, seed, study_size) if study_size is not None else None
    if finished or studies is not None:
        report = os.path.join(out_dir, "report.md")
        text = write_report(
            outcomes,
            logs,
            rows,
            cfg=TrainConfig.from_fields({**base, "out_dir": out_dir}),
            threshold=threshold,
            png=os.path.basename(png) if png else None,
            total_seconds=time.perf_counter() - t_start,
            runs_seconds=runs_seconds,
            studies=studies,
            audit_lines=audit_lines,
        )
        with open(report, "w") as fh:
            fh.write(text)
        _print_closing(report, png, studies, t_start)
    return 0 if all(o.status != "failed" for o in outcomes) and finished else 1
