"""Checks of command-line arguments that argparse cannot express, shared by the subcommands."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["check_matplotlib", "check_output_dir", "check_output_file"]


def _first_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_output_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """Refuse an output folder that is a file, or that cannot be created or written (ValueError naming ``flag``)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a folder")
    _check_writable(flag, path)


def check_output_file(flag: str, path: str | os.PathLike[str]) -> None:
    """Refuse an output file that is a folder, or whose folder cannot be created or written."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; name the file to write")
    _check_writable(flag, os.path.dirname(os.path.abspath(path)))


def _check_writable(flag: str, folder: str) -> None:
    existing = _first_existing(folder)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag}: cannot create {folder!r}: {existing!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write to {existing!r} (permission denied)")


def check_matplotlib() -> None:
    """Refuse a plot when matplotlib is missing, before the work whose result it would draw."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("plotting needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)")
