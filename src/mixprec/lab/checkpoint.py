"""Atomic checkpoint files that load with ``torch.load(weights_only=True)``.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then renamed over the
old one with ``os.replace`` (atomic on POSIX). A process killed at any moment leaves either the previous complete
checkpoint or the new complete one, never a torn file. The temporary file has a unique name
(``checkpoint.pt.<random>.tmp``); one left behind by a killed process is never read, and
:func:`remove_stale_temporaries` (called when a run directory is prepared, fresh or resumed) deletes it.

Only tensors and plain containers of numbers, strings, booleans and None are stored, which is what
``weights_only=True`` accepts: no pickled classes, so loading a checkpoint cannot run code.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "remove_stale_temporaries", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """Write ``state`` to ``path`` atomically (temp file + fsync + ``os.replace``)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # Make the rename itself durable.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _temporary_prefix(path: str) -> str:
    return os.path.basename(path) + "."


def remove_stale_temporaries(path: str) -> list[str]:
    """Delete the temporary files :func:`save_checkpoint` left next to ``path`` when killed mid-write; returns
    their paths. Call it only while no process is writing this checkpoint."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return []
    prefix = _temporary_prefix(path)
    removed = []
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(".tmp"):
            stale = os.path.join(directory, name)
            os.unlink(stale)
            removed.append(stale)
    return removed


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (memory-mapped with ``mmap``: tensors are read when touched).
    Raises ValueError when it is missing or not a checkpoint."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:  # torn, foreign or not a torch file
        raise ValueError(f"{path!r} is not a readable mixprec train checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path!r} is not a mixprec train checkpoint (no 'step' entry)")
    return state
