"""``mixprec demo``: the README's main job. The same small GPT, seed and batches trained in fp32 (reference),
bf16 with native and with fp32-accumulate reduction, fp16 with dynamic loss scaling, and with uint8 gradient
compression, on 4 gloo ranks; then a comparison table, a plot and ``report.md`` saying what differed.
A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mixprec.cli.args import check_matplotlib, check_output_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train one model five ways (fp32, bf16 x 2 reductions, fp16, uint8) and report what differed",
        description=__doc__,
    )
    p.add_argument("--out-dir", default="mixprec-demo", help="where runs, plot and report go (default: mixprec-demo)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches, shared by all runs (default: 0)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 200)")
    p.add_argument("--nproc", type=int, default=None, help="gloo ranks per run (default: 4)")
    p.add_argument(
        "--threshold", type=float, default=0.05, help="loss difference whose first crossing is reported (default: 0.05)"
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
        "--dp-band",
        action="store_true",
        help="also: reduction precision at simulated DP 4 and 1024 (4 and 64 with --quick) against an fp32 noise "
        "band, a report section (about 20 minutes on 2 cores; about 20 s with --quick)",
    )
    p.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument and build every run's configuration before the first run starts."""
    from mixprec.lab.audit import audit_citation
    from mixprec.lab.demo import QUICK_OVERRIDES, plan_demo, run_demo

    overrides = dict(QUICK_OVERRIDES) if args.quick else {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.nproc is not None:
        overrides["nproc"] = args.nproc
    check_output_dir("--out-dir", args.out_dir)
    check_matplotlib()
    audit_lines = audit_citation(args.audit) if args.audit else []
    plan_demo(out_dir=args.out_dir, seed=args.seed, overrides=overrides, threshold=args.threshold)
    if args.dp_band:
        from mixprec.lab.dp_band import DP_BAND_FULL, DP_BAND_QUICK, plan_dp_band

        plan_dp_band(args.out_dir, args.seed, DP_BAND_QUICK if args.quick else DP_BAND_FULL)

    def work() -> int:
        code = run_demo(
            out_dir=args.out_dir,
            seed=args.seed,
            overrides=overrides,
            threshold=args.threshold,
            progress=args.progress,
            audit_lines=audit_lines,
        )
        if args.dp_band:
            code = max(code, _dp_band(args))
        return code

    return work


def _dp_band(args: argparse.Namespace) -> int:
    """Train the simulated-DP band runs and append their section to report.md."""
    import os

    from mixprec.lab.dp_band import DP_BAND_FULL, DP_BAND_QUICK, run_dp_band

    setting = DP_BAND_QUICK if args.quick else DP_BAND_FULL
    section, verdicts = run_dp_band(args.out_dir, args.seed, setting, progress=args.progress)
    with open(os.path.join(args.out_dir, "report.md"), "a") as fh:
        fh.write("\n" + section)
    print("\n".join(["", "mixprec demo: reduction precision at simulated DP:", *verdicts]))
    return 0
