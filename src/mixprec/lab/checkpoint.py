"""Atomic checkpoint files that load with ``torch.load(weights_only=True)``.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then renamed over the
old one with ``os.replace`` (atomic on POSIX). A process killed at any moment leaves either the previous complete
checkpoint or the new complete one, never a torn file; a stale temporary file is ignored and overwritten.

Only tensors and plain containers of numbers, strings, booleans and None are stored, which is what
``weights_only=True`` accepts: no pickled classes, so loading a checkpoint cannot run code.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """Write ``state`` to ``path`` atomically (temp file + fsync + ``os.replace``)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
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


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``. Raises ValueError when it is missing or not a checkpoint."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r}")
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path!r} is not a mixprec train checkpoint (no 'step' entry)")
    return state
