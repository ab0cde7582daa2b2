"""Entry point of the ``mixprec`` command.

Each subcommand lives in its own module under ``mixprec.cli`` with ``register(subparsers)``, which adds
its parser and sets ``func(args) -> int``. Exit codes: 0 success, 1 a check failed (e.g. a broken
loss-scale rule), 2 invalid input (argparse errors and the library's ValueError/TypeError).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Order is the order of `mixprec --help`.
_SUBCOMMAND_MODULES = (
    "mixprec.cli.demo",
    "mixprec.cli.train",
    "mixprec.cli.compare",
    "mixprec.cli.check_config",
    "mixprec.cli.study",
    "mixprec.cli.audit",
    "mixprec.cli.probe",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Numerically robust low-precision training for PyTorch.",
    )
    from mixprec import __version__

    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"mixprec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
