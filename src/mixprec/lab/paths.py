"""Checks of the folders and files the lab writes, and of the files it reads, made before any work starts.

One implementation for every command: ``mixprec train``'s run directory, the demo's and the studies'
``--training.out-dir``, ``compare --plot``; ``study comm-cost --calibration``, ``demo --audit``. Each error names the
argument and says what is wrong.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["check_input_file", "check_output_dir", "check_output_file"]


def check_input_file(name: str, path: str | os.PathLike[str]) -> None:
    """Refuse a file to read that does not exist or is not a regular file, before it is opened: a FIFO would
    block the read until something writes to it, a device might never end it (ValueError naming ``name``)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{name}: no such file: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{name}: {path!r} is not a regular file")


def check_output_dir(name: str, path: str | os.PathLike[str]) -> None:
    """Refuse a folder to write into that is a file, or that this process cannot create or write into
    (ValueError naming ``name``)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is not a directory (a file of that name exists)")
    _check_writable(name, path)


def check_output_file(name: str, path: str | os.PathLike[str]) -> None:
    """Refuse a file to write that is a folder, or whose folder cannot be created or written."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a folder; name the file to write")
    _check_writable(name, os.path.dirname(os.path.abspath(path)))
    if os.path.isfile(path):  # a file that will be replaced: opened for appending, it is left as it is
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise ValueError(f"{name} {path!r} cannot be written ({exc.strerror})") from None


def _check_writable(name: str, folder: str) -> None:
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"cannot create {name} {folder!r}: {existing!r} is a file, not a directory")
    what = "is not writable" if existing == os.path.abspath(folder) else f"cannot be created in {existing!r}"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {folder!r} {what} (permission denied or a read-only file system)")
    # os.access says yes to root everywhere, also where the file system refuses the write itself (a read-only
    # mount, /proc, /sys): create and remove one file to know.
    try:
        fd, probe = tempfile.mkstemp(prefix=".mixprec-write-check-", dir=existing)
    except OSError as exc:
        raise ValueError(f"{name} {folder!r} {what}: creating a file there failed ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
