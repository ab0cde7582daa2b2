"""``mixprec study NAME``: numerical studies that print a table and write CSV and PNG files.

The one parser of the studies: each subcommand's arguments are declared here, their defaults taken from the
study's own constants (its config's defaults, ``compress.options.DEFAULT_CHUNK_SIZE``,
``parallel.buckets.DEFAULT_BUCKET_SIZE``, ``lab.studies.base.DEFAULT_SEED``), and ``prepare`` turns them into the
study's config (which checks itself) before any work. The work is the study's plain ``run(config, output)``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.cli.args import check_matplotlib, check_output_dir
from mixprec.compress.options import DEFAULT_CHUNK_SIZE
from mixprec.lab.studies import block_scaling, comm_cost, compression_error, matmul_error, reduction_error
from mixprec.lab.studies.base import DEFAULT_SEED, StudyOutput, default_out_dir
from mixprec.lab.studies.comm_cost_fit import read_benchmark
from mixprec.lab.studies.comm_cost_model import Cluster
from mixprec.parallel.buckets import DEFAULT_BUCKET_SIZE


# ---------------------------------------------------------------------------------------------- shared arguments
def _int_list(minimum: int | None = None, what: str = "ints") -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of ints, each >= ``minimum`` when given (else any int; the study checks)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
        if minimum is not None and (not values or any(v < minimum for v in values)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return values

    return parse


def _name_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(allowed)}; got {text!r}")
        return values

    return parse


def _add_output(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out-dir", type=Path, default=default_out_dir(name), help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _add_seed(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of {what}")


# ---------------------------------------------------------------------------------------------- reduction-error
def _reduction_error_arguments(parser: argparse.ArgumentParser) -> None:
    m = reduction_error
    d = m.ReductionErrorConfig()
    parser.add_argument(
        "--dp",
        type=_int_list(2, "data-parallel sizes >= 2"),
        default=d.dp_sizes,
        help="data-parallel sizes, comma-separated",
    )
    parser.add_argument("--elements", type=int, default=d.elements, help="gradient elements per rank")
    parser.add_argument("--wires", type=_name_list(m.WIRES), default=d.wires, help="wire dtypes, comma-separated")
    parser.add_argument(
        "--distributions",
        type=_name_list(m.DISTRIBUTIONS),
        default=d.distributions,
        help="gradient distributions, comma-separated",
    )
    parser.add_argument("--scale", type=float, default=d.scale, help="gradient std (normal) / scale (student-t)")
    quick = ",".join(map(str, m.QUICK_DP_SIZES))
    parser.add_argument("--quick", action="store_true", help=f"DP {quick} and {m.QUICK_ELEMENTS} elements (about 5 s)")
    _add_seed(parser, "the gradients and of stochastic rounding")
    parser.add_argument(
        "--ranks-per-node", type=int, default=d.ranks_per_node, help="ranks per node of the hierarchical rows (0: none)"
    )
    _add_output(parser, "reduction-error")


def _reduction_error_config(args: argparse.Namespace) -> reduction_error.ReductionErrorConfig:
    m = reduction_error
    return m.ReductionErrorConfig(
        dp_sizes=m.QUICK_DP_SIZES if args.quick else args.dp,
        elements=min(args.elements, m.QUICK_ELEMENTS) if args.quick else args.elements,
        wires=args.wires,
        distributions=args.distributions,
        scale=args.scale,
        seed=args.seed,
        ranks_per_node=args.ranks_per_node or None,
    )


# ---------------------------------------------------------------------------------------------- compression-error
def _compression_error_arguments(parser: argparse.ArgumentParser) -> None:
    m = compression_error
    d = m.CompressionErrorConfig()
    parser.add_argument("--world", type=int, default=d.world, help="simulated data-parallel ranks")
    parser.add_argument("--elements", type=int, default=d.elements, help="gradient elements per rank (synthetic)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="elements per chunk (header entry)")
    parser.add_argument("--wires", type=_name_list(m.WIRES), default=d.wires, help="wires, comma-separated")
    parser.add_argument(
        "--distributions", type=_name_list(m.DISTRIBUTIONS), default=d.distributions, help="gradients, comma-separated"
    )
    q = m.QUICK
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{q['world']} ranks, {q['elements']} elements, chunks of {q['chunk_size']} (seconds)",
    )
    _add_seed(parser, "the gradients")
    _add_output(parser, "compression-error")


def _compression_error_config(args: argparse.Namespace) -> compression_error.CompressionErrorConfig:
    m = compression_error
    sizes = dict(m.QUICK) if args.quick else {
        "world": args.world, "elements": args.elements, "chunk_size": args.chunk_size,
        "model_width": m.FULL_MODEL_WIDTH,
    }  # fmt: skip
    return m.CompressionErrorConfig(**sizes, wires=args.wires, distributions=args.distributions, seed=args.seed)


# ---------------------------------------------------------------------------------------------- matmul-error
def _matmul_error_arguments(parser: argparse.ArgumentParser) -> None:
    m = matmul_error
    parser.add_argument(
        "--sizes", type=_int_list(1, "positive ints"), default=m.DEFAULT_SIZES, help="M=N=K sizes, comma-separated"
    )
    quick = ",".join(map(str, m.QUICK_SIZES))
    parser.add_argument("--quick", action="store_true", help=f"sizes {quick} only (about 15 s)")
    parser.add_argument(
        "--rows", type=int, default=m.DEFAULT_ROWS, help="output rows computed per size (random subset)"
    )
    parser.add_argument(
        "--presets", default=",".join(m.DEFAULT_PRESETS), help="accumulator models (mixprec.emulate.MATMUL_PRESETS)"
    )
    _add_seed(parser, "the inputs and the row subset")
    parser.add_argument("--device", default=m.DEFAULT_DEVICE, help="torch device for the emulation (cpu, cuda)")
    _add_output(parser, "matmul-error")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _matmul_error_config(args: argparse.Namespace) -> matmul_error.MatmulErrorConfig:
    m = matmul_error
    return m.MatmulErrorConfig(
        sizes=m.QUICK_SIZES if args.quick else args.sizes,
        presets=tuple(p.strip() for p in args.presets.split(",") if p.strip()),
        rows=args.rows,
        seed=args.seed,
        device=args.device,
        progress=args.progress,
    )


# ---------------------------------------------------------------------------------------------- comm-cost
def _comm_cost_arguments(parser: argparse.ArgumentParser) -> None:
    m = comm_cost
    parser.add_argument("--nodes", type=_int_list(), default=m.DEFAULT_NODES, help="node counts (>= 2)")
    parser.add_argument("--per-node", type=int, default=m.DEFAULT_PER_NODE, help="ranks per node")
    parser.add_argument(
        "--inter-gbit", type=float, default=m.DEFAULT_INTER_GBIT, help="inter-node bandwidth per node, Gbit/s"
    )
    parser.add_argument(
        "--intra-gbit", type=float, default=m.DEFAULT_INTRA_GBIT, help="intra-node bandwidth per rank, Gbit/s"
    )
    parser.add_argument(
        "--inter-latency-us", type=float, default=m.DEFAULT_INTER_LATENCY_US, help="inter-node latency per message, us"
    )
    parser.add_argument(
        "--intra-latency-us", type=float, default=m.DEFAULT_INTRA_LATENCY_US, help="intra-node latency per message, us"
    )
    parser.add_argument(
        "--bucket-m",
        type=float,
        default=None,
        help="bucket size, millions (2**20) of bf16 elements (default: DistributedDataParallel's bucket, "
        f"{DEFAULT_BUCKET_SIZE:,} elements)",
    )
    parser.add_argument("--op", choices=m.OPS, default=m.OPS[0], help="reduce-scatter (ZeRO) or all-reduce")
    parser.add_argument(
        "--memory-gbs",
        type=float,
        default=m.DEFAULT_MEMORY_GBS,
        help="device bandwidth of elementwise passes (sums, copies), GB/s",
    )
    parser.add_argument(
        "--compute",
        choices=m.COMPUTE,
        default=m.COMPUTE[0],
        help="gpu: --memory-gbs and no CPU per socket byte (NVLink/RDMA); calibrated: the fitted CPU costs",
    )
    parser.add_argument("--calibration", type=Path, default=None, help="bench_netns_fp32.py --json output")
    parser.add_argument("--holdout", type=Path, default=None, help="a second such file, predicted, not fitted")
    _add_output(parser, "comm-cost")


def _check_comm_cost_numbers(args: argparse.Namespace) -> None:
    """ValueError naming the flag, for what the Cluster would refuse under its field's name."""
    if not args.nodes or any(m < 2 for m in args.nodes):
        raise ValueError(f"--nodes: every node count must be >= 2; got {args.nodes}")
    if args.per_node < 1:
        raise ValueError(f"--per-node must be >= 1; got {args.per_node}")
    for flag, value in (("--inter-gbit", args.inter_gbit), ("--intra-gbit", args.intra_gbit),
                        ("--bucket-m", args.bucket_m), ("--memory-gbs", args.memory_gbs)):  # fmt: skip
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"{flag} must be a finite number > 0; got {value}")
    for flag, value in (("--inter-latency-us", args.inter_latency_us), ("--intra-latency-us", args.intra_latency_us)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0; got {value}")


def _comm_cost_config(args: argparse.Namespace) -> comm_cost.CommCostConfig:
    _check_comm_cost_numbers(args)
    calibration = None if args.calibration is None else read_benchmark("--calibration", args.calibration)
    holdout = None if args.holdout is None else read_benchmark("--holdout", args.holdout)
    clusters = tuple(
        Cluster(m, args.per_node, args.inter_gbit, args.intra_gbit, args.inter_latency_us * 1e-6,
                args.intra_latency_us * 1e-6)
        for m in args.nodes
    )  # fmt: skip
    return comm_cost.CommCostConfig(
        clusters=clusters,
        numel=DEFAULT_BUCKET_SIZE if args.bucket_m is None else int(args.bucket_m * 2**20),
        op=args.op,
        memory_gbs=args.memory_gbs,
        compute=args.compute,
        calibration=calibration,
        holdout=holdout,
    )


# ---------------------------------------------------------------------------------------------- block-scaling
def _block_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    m = block_scaling
    d = m.BlockScalingConfig()
    parser.add_argument("--formats", type=_name_list(m.FORMATS), default=d.formats, help="formats, comma-separated")
    parser.add_argument(
        "--modes", type=_name_list(m.MODES), default=d.modes,
        help="scale modes, comma-separated (e4m3: NVFP4, with and without its tensor scale)",
    )  # fmt: skip
    parser.add_argument(
        "--tensors", type=_name_list(m.TENSOR_KINDS), default=d.tensors, help="tensor kinds, comma-separated"
    )
    parser.add_argument("--rows", type=int, default=d.rows, help="rows of each synthetic tensor")
    parser.add_argument("--channels", type=int, default=d.channels, help="channels (blocked) of each synthetic tensor")
    parser.add_argument("--dof", type=int, default=d.dof, help="degrees of freedom of the Student-t tensor")
    parser.add_argument("--outlier-channels", type=int, default=d.outlier_channels, help="channels x100 (outliers)")
    parser.add_argument("--model-width", type=int, default=d.model_width, help="width of the GPT captured")
    parser.add_argument("--model-steps", type=int, default=d.model_steps, help="training steps before the capture")
    q = m.QUICK
    parser.add_argument(
        "--quick", action="store_true",
        help=f"synthetic tensors {q['rows']} x {q['channels']}, GPT width {q['model_width']} after "
        f"{q['model_steps']} steps (seconds)",
    )  # fmt: skip
    _add_seed(parser, "the synthetic tensors, the GPT and its batches")
    _add_output(parser, "block-scaling")


def _block_scaling_config(args: argparse.Namespace) -> block_scaling.BlockScalingConfig:
    sizes = dict(block_scaling.QUICK) if args.quick else {
        "rows": args.rows, "channels": args.channels, "model_width": args.model_width, "model_steps": args.model_steps,
    }  # fmt: skip
    return block_scaling.BlockScalingConfig(
        **sizes, formats=args.formats, modes=args.modes, tensors=args.tensors, dof=args.dof,
        outlier_channels=args.outlier_channels, seed=args.seed,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- the subcommands
@dataclass(frozen=True)
class _Study:
    module: Any  # the study's module: its docstring is the subcommand's description, its run(config, output)
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    config: Callable[[argparse.Namespace], Any]


# Modules are imported when the parser is built (their constants are the defaults), so keep their imports light.
_STUDIES: dict[str, _Study] = {
    "block-scaling": _Study(
        block_scaling,
        "error of each MX/NVFP4 format and scale mode on synthetic and captured tensors, beside bounds; which mode",
        _block_scaling_arguments,
        _block_scaling_config,
    ),
    "comm-cost": _Study(
        comm_cost,
        "time and bytes of ring, flat and hierarchical reductions on large clusters, and which to pick",
        _comm_cost_arguments,
        _comm_cost_config,
    ),
    "compression-error": _Study(
        compression_error,
        "error of uint8, fp8 and bf16 gradient wires vs float64, on synthetic and real gradients, beside bounds",
        _compression_error_arguments,
        _compression_error_config,
    ),
    "matmul-error": _Study(
        matmul_error,
        "error of emulated matmul accumulators vs float64, beside the two-stage write-up's and DeepSeek-V3's claims",
        _matmul_error_arguments,
        _matmul_error_config,
    ),
    "reduction-error": _Study(
        reduction_error,
        "error of fp16/bf16 gradient reduction vs DP size, beside a published table for Megatron-LM's fp32 sums",
        _reduction_error_arguments,
        _reduction_error_config,
    ),
}


def _prepare(study: _Study) -> Callable[[argparse.Namespace], Callable[[], int]]:
    def prepare(args: argparse.Namespace) -> Callable[[], int]:
        config = study.config(args)
        check_output_dir("--out-dir", args.out_dir)
        if not args.no_plot:
            check_matplotlib()
        output = StudyOutput(args.out_dir, plot=not args.no_plot)
        return lambda: study.module.run(config, output)

    return prepare


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="numerical studies (tables, CSV, plots)")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    for name, study in _STUDIES.items():
        sp = studies.add_parser(name, help=study.help, description=study.module.__doc__)
        study.add_arguments(sp)
        sp.set_defaults(prepare=_prepare(study))
