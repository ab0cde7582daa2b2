"""``mixprec compare RUN...``: align runs by step and compare their loss curves against the first one.

Each RUN is a ``mixprec train`` run directory or any JSONL file with ``step`` and ``loss`` on each line (from
another machine or framework). Prints a markdown table (final and best loss, max absolute and relative
difference to the first run, the first step where the difference exceeds --threshold, skipped steps,
throughput) and writes a PNG of the loss curves and of the differences. A step logged twice in one file is
refused unless --duplicate-steps last is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mixprec.cli.args import check_matplotlib, check_output_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare loss curves of runs (run directories or JSONL with step and loss)",
        description=__doc__,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory or JSONL file; the first is the reference")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="absolute loss difference (nats) whose first crossing is reported (default: 0.05)",
    )
    p.add_argument("--labels", default=None, help="comma-separated names for the runs (default: directory/file names)")
    p.add_argument(
        "--plot", default="compare.png", metavar="PNG", help="where to write the plot (default: compare.png)"
    )
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument(
        "--duplicate-steps",
        choices=("error", "last"),
        default="error",
        help="a step logged twice: refuse the file (error), or keep the later row and say so (last)",
    )
    p.add_argument(
        "--band",
        metavar="DIR",
        default=None,
        help="noise band: the replicas `mixprec train --replicas` wrote to DIR; each RUN is then a variant, judged "
        "against the band instead of against the first run",
    )
    p.add_argument(
        "--band-widen", type=float, default=1.0, help="band = [min - f w, max + f w], w = max - min (default 1)"
    )
    p.add_argument(
        "--band-persist", type=int, default=3, help="consecutive steps outside that count as leaving (default 3)"
    )
    p.add_argument("--band-metric", choices=("loss", "eval_loss"), default="loss", help="the band's metric")
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Read and check every run, the threshold, the labels and the plot path before printing anything."""
    from mixprec.lab.compare import compare_runs, format_table, load_run, plot_comparison

    labels = [s.strip() for s in args.labels.split(",")] if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise ValueError(f"--labels names {len(labels)} runs; {len(args.runs)} were given")
    if not args.threshold >= 0:  # also refuses NaN
        raise ValueError(f"--threshold must be a number >= 0 (an absolute loss difference); got {args.threshold!r}")
    if not args.no_plot:
        check_output_file("--plot", args.plot)
        check_matplotlib()
    runs = [load_run(path, name, duplicates=args.duplicate_steps) for path, name in zip(args.runs, labels)]
    if args.band is not None:
        return _prepare_band(args, runs)

    def work() -> int:
        for run in runs:
            if run.repeated_steps:
                print(f"note: {run.path}: {run.repeated_steps} step(s) logged more than once; the later row is used")
        rows = compare_runs(runs, threshold=args.threshold)
        print(format_table(rows, threshold=args.threshold))
        if not args.no_plot:
            print(f"\nplot: {plot_comparison(runs, args.plot, threshold=args.threshold)}")
        return 0

    return work


def _prepare_band(args: argparse.Namespace, runs: list) -> Callable[[], int]:
    """``--band DIR``: every check (the replicas, the statistic's parameters) before printing anything."""
    from mixprec.lab.band import band_runs, band_verdicts, false_alarms, format_band_table
    from mixprec.lab.compare import load_run

    replicas = [load_run(path, duplicates=args.duplicate_steps) for path in band_runs(args.band)]
    verdicts, spread = band_verdicts(
        replicas, runs, widen=args.band_widen, persist=args.band_persist, metric=args.band_metric
    )
    alarms = false_alarms(replicas, widen=args.band_widen, persist=args.band_persist, metric=args.band_metric)

    def work() -> int:
        print(
            format_band_table(
                verdicts,
                spread,
                replicas=len(replicas),
                widen=args.band_widen,
                persist=args.band_persist,
                alarms=alarms,
            )
        )
        return 0

    return work
