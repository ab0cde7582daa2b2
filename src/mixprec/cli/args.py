"""Checks of command-line arguments that argparse cannot express, shared by the subcommands (the output
paths and input files are checked by :mod:`mixprec.lab.paths`, as ``mixprec train`` checks its run directory)."""

from __future__ import annotations

import importlib.util

from mixprec.lab.paths import check_input_file, check_output_dir, check_output_file

__all__ = ["check_input_file", "check_matplotlib", "check_output_dir", "check_output_file"]


def check_matplotlib() -> None:
    """Refuse a plot when matplotlib is missing, before the work whose result it would draw."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("plotting needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)")
