"""``mixprec study NAME``: numerical studies that print a table and write CSV and PNG files.

Each study module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help). Modules are imported when the parser is built, so keep their
# top-level imports light.
_STUDIES: dict[str, tuple[str, str]] = {
    "matmul-error": ("mixprec.lab.matmul_error", "error of emulated matmul accumulators vs float64 (seed 003)"),
    "reduction-error": ("mixprec.lab.reduction_error", "error of fp16/bf16 gradient reduction vs DP size (seed 000)"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="numerical studies (tables, CSV, plots)")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    for name, (module_name, help_text) in _STUDIES.items():
        module = importlib.import_module(module_name)
        sp = studies.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)
