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
from mixprec.lab.studies import audit
from mixprec.lab.studies.base import DEFAULT_SEED, default_out_dir


def _size_label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


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
    c.add_argument(
        "--nproc", type=int, default=None, help=f"fork N gloo ranks (default {audit.DEFAULT_NPROC} outside torchrun)"
    )
    c.add_argument("--ops", default=None, help=f"comma-separated operations (default: all {len(audit.AUDIT_OPS)})")
    dtypes = ",".join(audit.AUDIT_DTYPES)
    c.add_argument("--dtypes", default=dtypes, help=f"comma-separated: {dtypes}")
    min_size, max_size = _size_label(audit.DEFAULT_MIN_BYTES), _size_label(audit.DEFAULT_MAX_BYTES)
    c.add_argument("--min-size", default=min_size, help=f"smallest message per rank (default {min_size})")
    c.add_argument("--max-size", default=None, help=f"largest message per rank (default {max_size})")
    c.add_argument(
        "--full",
        action="store_true",
        help=f"sizes up to {_size_label(audit.FULL_MAX_BYTES)} (minutes, and memory)",
    )
    c.add_argument(
        "--factor", type=int, default=audit.DEFAULT_FACTOR, help="ratio between message sizes (default %(default)s)"
    )
    c.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the inputs")
    c.add_argument("--backend", default="auto", help="auto, gloo or nccl (nccl only under torchrun)")
    c.add_argument(
        "--timeout", type=float, default=audit.DEFAULT_TIMEOUT, help="seconds before a hung collective fails"
    )
    c.add_argument("--out-dir", type=Path, default=default_out_dir("audit"), help="where JSON and PNG go")
    c.add_argument("--no-plot", action="store_true", help="skip the PNG")
    c.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument (and how the ranks will be started) before any rank starts."""

    def names(text: str) -> tuple[str, ...]:
        return tuple(v.strip() for v in text.split(",") if v.strip())

    if args.full and args.max_size is not None:
        raise ValueError("--full and --max-size exclude each other")
    if args.full:
        max_bytes = audit.FULL_MAX_BYTES
    else:
        max_bytes = audit.parse_size(args.max_size or audit.DEFAULT_MAX_BYTES, arg="--max-size")
    config = audit.AuditConfig(
        ops=names(args.ops) if args.ops else audit.AUDIT_OPS,
        dtypes=names(args.dtypes),
        min_bytes=audit.parse_size(args.min_size, arg="--min-size"),
        max_bytes=max_bytes,
        factor=args.factor,
        seed=args.seed,
    )
    audit.check_launch(config, nproc=args.nproc, backend=args.backend, timeout=args.timeout)
    check_output_dir("--out-dir", args.out_dir)
    return lambda: _run(args, config)


def _run(args: argparse.Namespace, config: Any) -> int:
    from mixprec.comm.launcher import RanksFailed, Terminated, sigterm_as_interrupt
    from mixprec.core.progress import is_terminal

    start = time.monotonic()
    # the bar only where someone watches it: in a log it is a line of carriage returns per case
    progress = is_terminal()
    try:
        with sigterm_as_interrupt():
            rows = audit.run_audit(
                config, nproc=args.nproc, backend=args.backend, timeout=args.timeout, progress=progress
            )
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
    print(audit.format_table(rows))
    print()
    for line in audit.verdicts(rows):
        print(line)
    json_path = audit.write_json(rows, args.out_dir / "audit_collectives.json", config)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png = audit.plot_rows(rows, args.out_dir / "audit_collectives.png")
        print(f"wrote {png}" if png else "no PNG: matplotlib is not installed (pip install 'mixprec[plot]')")
    print(f"({time.monotonic() - start:.1f} s)")
    return 0
