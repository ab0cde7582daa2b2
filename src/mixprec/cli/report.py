"""mixprec report RUN: the loss scale, skipped steps and per-layer fp16 headroom of a ``mixprec train`` run.

Prints a short summary (where the scale went, which layers' gradients underflow or overflow in fp16 and whether
that is rising, the overflowing parameters) and draws ``RUN/report.png`` (or --out). The headroom comes from the
rows written every ``training.headroom_interval`` steps. A run with the live numerics audit
(``parallel.audit_every``) also gets ``audit.png`` beside the plot (``<PNG stem>_audit.png`` with --out): the
reduction's effective bits, and the backend's own beside them, and rel_l2 on a log axis, over the steps.
Without matplotlib the plots are skipped with a note.

Exit codes: 0 done; 2 RUN is not a run directory or its metrics.jsonl is malformed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from mixprec.cli.args import check_output_file

if TYPE_CHECKING:
    from mixprec.lab.report import RunTelemetry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="plot and summarise a run's loss scale, skipped steps and per-layer fp16 headroom",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="a mixprec train run directory (holding metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="PNG", help="where the plot goes (default: RUN/report.png)")
    p.add_argument("--no-plot", action="store_true", help="print the summary only")
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    from mixprec.lab.report import load_telemetry

    telemetry = load_telemetry(args.run)
    out = args.out or os.path.join(args.run, "report.png")
    if not args.no_plot:
        check_output_file("--out", out)
    return lambda: run(telemetry, None if args.no_plot else out)


def run(telemetry: RunTelemetry, out: str | None) -> int:
    from mixprec.lab.report import plot_audit, plot_telemetry, summary_lines

    for line in summary_lines(telemetry):
        print(line)
    if out is None:
        return 0
    if importlib.util.find_spec("matplotlib") is None:
        print("mixprec report: no plot: matplotlib is not installed (pip install 'mixprec[plot]')", file=sys.stderr)
        return 0
    print(f"plot: {plot_telemetry(telemetry, out)}")
    if telemetry.audit_steps:
        print(f"audit plot: {plot_audit(telemetry, audit_plot_path(out))}")
    return 0


def audit_plot_path(out: str) -> str:
    """Where the audit plot goes: ``audit.png`` beside the default ``report.png``, else ``<stem>_audit.png``."""
    head, name = os.path.split(out)
    if name == "report.png":
        return os.path.join(head, "audit.png")
    stem, ext = os.path.splitext(name)
    return os.path.join(head, f"{stem}_audit{ext or '.png'}")
