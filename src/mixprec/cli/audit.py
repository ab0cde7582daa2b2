"""``mixprec audit collectives``: the error, determinism and agreement of this platform's collectives.

Runs under torchrun (``torchrun --nproc-per-node 8 -m mixprec audit collectives``: NCCL on GPUs) or forks
``--nproc N`` gloo ranks on the CPU. Prints a table and one verdict line per operation, writes JSON and a PNG.
Methods: docs/audit.md.

Exit codes: 0 done; 1 a rank failed (one line names it; the others were stopped); 2 invalid input (checked
before any rank starts); 130 interrupted (SIGINT); 143 terminated (SIGTERM). The forked ranks die with the
command, as those of mixprec train do.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.cli.args import check_output_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="measure the numerics of this platform's collectives")
    audits = p.add_subparsers(dest="audit", metavar="AUDIT")
    audits.required = True
    c = audits.add_parser(
        "collectives",
        help="all-reduce / reduce-scatter (native and fp32-accumulating) against an fp64 reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--nproc", type=int, default=None, help="fork N gloo ranks (default 4 outside torchrun)")
    c.add_argument("--ops", default=None, help="comma-separated operations (default: all four)")
    c.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated: bf16,fp16,fp32")
    c.add_argument("--min-size", default="4KiB", help="smallest message per rank (default 4KiB)")
    c.add_argument("--max-size", default=None, help="largest message per rank (default 16MiB)")
    c.add_argument("--full", action="store_true", help="sizes up to 256MiB (minutes, and memory)")
    c.add_argument("--factor", type=int, default=4, help="ratio between message sizes (default 4)")
    c.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    c.add_argument("--backend", default="auto", help="auto, gloo or nccl (nccl only under torchrun)")
    c.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung collective fails")
    c.add_argument("--out-dir", type=Path, default=Path("mixprec_out/audit"), help="where JSON and PNG go")
    c.add_argument("--no-plot", action="store_true", help="skip the PNG")
    c.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument (and how the ranks will be started) before any rank starts."""
    from mixprec.lab.audit import (
        AUDIT_OPS,
        DEFAULT_MAX_BYTES,
        FULL_MAX_BYTES,
        AuditConfig,
        check_launch,
        parse_size,
    )

    def names(text: str) -> tuple[str, ...]:
        return tuple(v.strip() for v in text.split(",") if v.strip())

    if args.full and args.max_size is not None:
        raise ValueError("--full and --max-size exclude each other")
    max_bytes = FULL_MAX_BYTES if args.full else parse_size(args.max_size or DEFAULT_MAX_BYTES, arg="--max-size")
    config = AuditConfig(
        ops=names(args.ops) if args.ops else AUDIT_OPS,
        dtypes=names(args.dtypes),
        min_bytes=parse_size(args.min_size, arg="--min-size"),
        max_bytes=max_bytes,
        factor=args.factor,
        seed=args.seed,
    )
    check_launch(config, nproc=args.nproc, backend=args.backend, timeout=args.timeout)
    check_output_dir("--out-dir", args.out_dir)
    return lambda: _run(args, config)


def _run(args: argparse.Namespace, config: Any) -> int:
    from mixprec.comm.launcher import RanksFailed, Terminated, sigterm_as_interrupt
    from mixprec.core.progress import is_terminal
    from mixprec.lab.audit import format_table, plot_rows, run_audit, verdicts, write_json

    start = time.monotonic()
    # the bar only where someone watches it: in a log it is a line of carriage returns per case
    progress = is_terminal()
    try:
        with sigterm_as_interrupt():
            rows = run_audit(config, nproc=args.nproc, backend=args.backend, timeout=args.timeout, progress=progress)
    except RanksFailed as exc:
        # Which rank failed first, in one line: the victims' tracebacks ("Connection closed by peer") say nothing.
        print(f"mixprec audit: error: {exc.summary}", file=sys.stderr)
        if exc.rank in exc.messages:  # the rank blamed raised (a bug, not a kill): its traceback is the useful one
            print(getattr(exc, "failures", {}).get(exc.rank, ""), file=sys.stderr, end="")
        return 1
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        print(f"mixprec audit: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    if rows is None:  # a torchrun rank other than 0
        return 0
    print(format_table(rows))
    print()
    for line in verdicts(rows):
        print(line)
    json_path = write_json(rows, args.out_dir / "audit_collectives.json", config)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png = plot_rows(rows, args.out_dir / "audit_collectives.png")
        print(f"wrote {png}" if png else "no PNG: matplotlib is not installed (pip install 'mixprec[plot]')")
    print(f"({time.monotonic() - start:.1f} s)")
    return 0
