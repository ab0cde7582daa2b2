"""``mixprec study NAME``: numerical studies that print a table and write CSV and PNG files.

Each study module provides ``add_arguments(parser)`` (with ``--out-dir`` and ``--no-plot``) and
``prepare(args) -> work``, which checks the study's arguments before any work.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from types import ModuleType

from mixprec.cli.args import check_matplotlib, check_output_dir

# name -> (module, one-line help). Modules are imported when the parser is built, so keep their
# top-level imports light.
_STUDIES: dict[str, tuple[str, str]] = {
    "comm-cost": (
        "mixprec.lab.comm_cost",
        "time and bytes of ring, flat and hierarchical reductions on large clusters, and which to pick",
    ),
    "compression-error": (
        "mixprec.lab.compression_error",
        "error of uint8, fp8 and bf16 gradient wires vs float64, on synthetic and real gradients, beside bounds",
    ),
    "matmul-error": (
        "mixprec.lab.matmul_error",
        "error of emulated matmul accumulators vs float64, beside the two-stage write-up's and DeepSeek-V3's claims",
    ),
    "reduction-error": (
        "mixprec.lab.reduction_error",
        "error of fp16/bf16 gradient reduction vs DP size, beside a published table for Megatron-LM's fp32 sums",
    ),
}


def _prepare(module: ModuleType) -> Callable[[argparse.Namespace], Callable[[], int]]:
    def prepare(args: argparse.Namespace) -> Callable[[], int]:
        work = module.prepare(args)
        check_output_dir("--out-dir", args.out_dir)
        if not args.no_plot:
            check_matplotlib()
        return work

    return prepare


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="numerical studies (tables, CSV, plots)")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    for name, (module_name, help_text) in _STUDIES.items():
        module = importlib.import_module(module_name)
        sp = studies.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sp)
        sp.set_defaults(prepare=_prepare(module))
