"""``mixprec demo``: the README's main job. The same small GPT, seed and batches trained in fp32 (reference),
bf16 with native and with fp32-accumulate reduction, fp16 with dynamic loss scaling, and with uint8 gradient
compression, on 4 gloo ranks; then a comparison table, a plot and ``report.md`` saying what differed. Then three
measured studies at simulated data-parallel sizes, each judged against a noise band: reduction precision at DP 4
and 1024, the loss-scale rules (scale vs microbatches vs DP), and the uint8 run's offset. A few minutes on 2 CPU
cores; --quick: seconds; --full: the studies at full size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from mixprec.cli.args import check_input_file, check_matplotlib, check_output_dir
from mixprec.lab.demo.plan import DEFAULT_OUT_DIR, DEFAULT_THRESHOLD, DEMO_DEFAULTS
from mixprec.lab.studies.base import DEFAULT_SEED


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train one model five ways (fp32, bf16 x 2 reductions, fp16, uint8), report what differed, then measure "
        "reduction precision, the loss-scale rules and the uint8 offset at simulated DP against noise bands",
        description=__doc__,
    )
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where runs, plot and report go")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of weights and batches, shared by all runs")
    p.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps per run (default: {DEMO_DEFAULTS['steps']})"
    )
    p.add_argument("--nproc", type=int, default=None, help=f"gloo ranks per run (default: {DEMO_DEFAULTS['nproc']})")
    p.add_argument(
        "--threshold", type=float, default=DEFAULT_THRESHOLD, help="loss difference whose first crossing is reported"
    )
    p.add_argument(
        "--audit",
        metavar="FILE",
        default=None,
        help="audit_collectives.json of 'mixprec audit collectives': the report quotes its verdict lines",
    )
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps: seconds, for a first look")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bars (default: on a terminal)"
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the study sections at full size: more replicas and steps, the fp32 bands (about an hour on 2 cores)",
    )
    p.add_argument(
        "--no-studies",
        action="store_true",
        help="only the five runs and their comparison, without the study sections (simulated-DP bands, loss scale, "
        "uint8 offset)",
    )
    # Before the study sections ran by default, --dp-band asked for the first of them; now it only says so.
    p.add_argument("--dp-band", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument and build every run's configuration before the first run starts."""
    started = time.perf_counter()  # the report's total wall time counts from here
    from mixprec.lab.demo import QUICK_OVERRIDES, plan_demo, plan_studies, run_demo
    from mixprec.lab.studies.audit import audit_citation

    if args.dp_band:
        print("mixprec demo: --dp-band does nothing: the DP bands are now part of the default demo", file=sys.stderr)
    overrides = dict(QUICK_OVERRIDES) if args.quick else {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.nproc is not None:
        overrides["nproc"] = args.nproc
    check_output_dir("--out-dir", args.out_dir)
    check_matplotlib()
    if args.audit:
        check_input_file("--audit", args.audit)
    audit_lines = audit_citation(args.audit) if args.audit else []
    plan_demo(out_dir=args.out_dir, seed=args.seed, overrides=overrides, threshold=args.threshold)
    if args.quick and args.full:
        raise ValueError("--quick and --full exclude each other")
    size = "quick" if args.quick else "full" if args.full else "default"
    if not args.no_studies:
        plan_studies(args.out_dir, args.seed, size)

    def work() -> int:
        return run_demo(
            out_dir=args.out_dir,
            seed=args.seed,
            overrides=overrides,
            threshold=args.threshold,
            progress=args.progress,
            audit_lines=audit_lines,
            study_size=None if args.no_studies else size,
            started=started,
        )

    return work
