"""``mixprec compare RUN...``: align runs by step and compare their loss curves against the first one.

Each RUN is a ``mixprec train`` run directory or any JSONL file with ``step`` and ``loss`` on each line (from
another machine or framework). Prints a markdown table (final and best loss, max absolute and relative
difference to the first run, the first step where the difference exceeds --threshold, skipped steps,
throughput) and writes a PNG of the loss curves and of the differences.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare loss curves of runs (run directories or JSONL with step and loss)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mixprec.lab.compare import compare_runs, format_table, load_run, plot_comparison

    labels = [s.strip() for s in args.labels.split(",")] if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise ValueError(f"--labels names {len(labels)} runs; {len(args.runs)} were given")
    runs = [load_run(path, name) for path, name in zip(args.runs, labels)]
    rows = compare_runs(runs, threshold=args.threshold)
    print(format_table(rows, threshold=args.threshold))
    if not args.no_plot:
        try:
            path = plot_comparison(runs, args.plot, threshold=args.threshold)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from exc
        print(f"\nplot: {path}")
    return 0
