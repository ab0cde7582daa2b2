"""Checkpoints of ``mixprec train``: atomic, checksummed files that load with ``torch.load(weights_only=True)``.

A checkpoint is serialized in memory, written to a temporary file in the same directory with a trailer holding
the sha256 of the serialized bytes, fsynced, and renamed over the old one (atomic on POSIX): a process killed at
any moment leaves the previous complete checkpoint or the new one. A killed writer's temporary
(``checkpoint.pt.<random>.tmp``) is never read and :func:`remove_stale_temporaries` deletes it. Loading checks
the trailer first, so a flipped byte or a zeroed block anywhere in the file is refused in one line. torch's
reader ignores bytes after the zip archive, so ``torch.load`` still reads the file as it is.

Only tensors and plain containers are stored (what ``weights_only=True`` accepts): loading cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
from dataclasses import MISSING, fields
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.objects import gather_objects
from mixprec.lab.build import Parts
from mixprec.lab.config import RESUMABLE_FIELDS, SECTIONS, TrainConfig
from mixprec.lab.corpus import Corpus

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "CheckpointWriteError",
    "check_resume",
    "check_resume_compatible",
    "checkpoint_state",
    "load_checkpoint",
    "load_into",
    "load_train_checkpoint",
    "remove_stale_temporaries",
    "save_checkpoint",
]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 2  # 2: nested configuration, sha256 trailer (0.1.0)
_TRAILER_TAG = b"\nmixprec-checkpoint-sha256 "
_TRAILER_LEN = len(_TRAILER_TAG) + 64 + 1


class CheckpointWriteError(RuntimeError):
    """The checkpoint could not be written (a full disk, a file-size limit, ...); the previous one is intact."""


# ---------------------------------------------------------------------------------------------- files
def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """Write ``state`` to ``path`` atomically, with its checksum (temp file + fsync + ``os.replace``).

    Raises:
        CheckpointWriteError: the file system refused the write; ``path`` still holds the previous checkpoint.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    trailer = _TRAILER_TAG + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.write(trailer)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
        # Make the rename itself durable.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot write the checkpoint {path!r} ({exc.strerror or exc}); the previous checkpoint is intact"
        ) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


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


def _verify_checksum(path: str) -> None:
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        remaining = size - _TRAILER_LEN
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
        trailer = fh.read()
    if size < _TRAILER_LEN or not trailer.startswith(_TRAILER_TAG):
        raise ValueError(
            f"{path!r} is not a readable mixprec train checkpoint (no checksum: torn, or not written by "
            "mixprec train 0.1.0 or later)"
        )
    if trailer[len(_TRAILER_TAG) : -1] != digest.hexdigest().encode():
        raise ValueError(
            f"{path!r} is corrupt: its sha256 checksum does not match its contents (the file changed after it was "
            "written); restore a copy or start a new run"
        )


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """Verify the checksum, then load with ``weights_only=True`` (memory-mapped with ``mmap``: tensors are read
    when touched). Raises ValueError when the file is missing, corrupt or not a checkpoint."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r}")
    _verify_checksum(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:  # a foreign file with a matching trailer
        raise ValueError(f"{path!r} is not a readable mixprec train checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path!r} is not a mixprec train checkpoint (no 'step' entry)")
    return state


# ---------------------------------------------------------------------------------------------- training state
def load_train_checkpoint(path: str, *, mmap: bool = False) -> dict[str, Any]:
    """A ``mixprec train`` checkpoint of :data:`CHECKPOINT_FORMAT` on the CPU (see :func:`load_checkpoint`)."""
    state = load_checkpoint(path, map_location="cpu", mmap=mmap)
    if state.get("format") != CHECKPOINT_FORMAT or "config" not in state:
        raise ValueError(
            f"{path!r} is a checkpoint of format {state.get('format')!r}, written before mixprec 0.1.0; it cannot "
            f"be resumed (format {CHECKPOINT_FORMAT} needed): start a new run in another --training.out-dir"
        )
    return state


def check_resume_compatible(saved: dict[str, dict[str, Any]], cfg: TrainConfig) -> None:
    """Raise ValueError unless ``cfg`` equals the checkpoint's configuration ``saved`` except for
    :data:`RESUMABLE_FIELDS`. A field absent from ``saved`` (added later) counts as its default."""
    diffs = []
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            key = f"{section}.{f.name}"
            if key in RESUMABLE_FIELDS:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            old = saved.get(section, {}).get(f.name, default)
            new = getattr(getattr(cfg, section), f.name)
            if old != new:
                diffs.append(f"{key}: checkpoint {old!r}, now {new!r}")
    if diffs:
        raise ValueError(
            "cannot resume: the checkpoint was written with a different configuration ("
            + "; ".join(diffs)
            + f"). Only {', '.join(sorted(RESUMABLE_FIELDS))} may change on resume."
        )


def check_same_corpus(state: dict[str, Any], corpus: Corpus) -> None:
    if state.get("corpus_sha256") != corpus.sha256:
        raise ValueError(
            f"cannot resume: the corpus changed (checkpoint sha256 {state.get('corpus_sha256')}, now "
            f"{corpus.sha256}); a custom corpus file was edited, or another Python version reads different "
            "stdlib sources"
        )


def check_resume(cfg: TrainConfig, corpus: Corpus | None = None) -> None:
    """Raise ValueError unless ``out_dir`` holds an intact checkpoint that ``cfg`` may continue (and, given
    ``corpus``, of the same corpus). Reads the file once for its checksum; the tensors are memory-mapped."""
    path = os.path.join(cfg.training.out_dir, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no checkpoint at {path!r}")
    state = load_train_checkpoint(path, mmap=True)
    check_resume_compatible(state["config"], cfg)
    if corpus is not None:
        check_same_corpus(state, corpus)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    """A copy of a (memory-mapped) checkpoint entry on ``device``, so that nothing keeps the mapping alive."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def checkpoint_state(parts: Parts, cfg: TrainConfig, *, next_step: int, wall_time: float, corpus: Corpus) -> Any:
    """The full training state on rank 0 (None elsewhere); collective: every rank calls it.

    Only rank 0 copies the model and optimizer to the CPU (a sharded optimizer's ``state_dict()`` gathers its
    shards, so every rank calls that). Each rank's reducer state (stochastic-rounding generators, error-feedback
    residuals) is gathered to rank 0 and stored as a list indexed by rank.
    """
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    optimizer_state = parts.optimizer.state_dict()
    reducer_states = None
    if parts.wrapper is not None:
        reducer_states = gather_objects(_to_cpu(parts.wrapper.reducer_state_dict()))
    if not is_main:
        return None
    state: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": next_step,
        "wall_time": wall_time,
        "config": cfg.to_dict(),
        "corpus_sha256": corpus.sha256,
        "model": _to_cpu(parts.module.state_dict()),
        "optimizer": _to_cpu(optimizer_state),
        "scaler": parts.scaler.state_dict(),
    }
    if reducer_states is not None:
        state["reducer_states"] = reducer_states
    return state


def load_into(parts: Parts, state: dict[str, Any], rank: int, device: torch.device) -> None:
    """Restore model, optimizer (with its masters), loss scaler and this rank's reducer state."""
    parts.module.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(_to_device(state["optimizer"], device))
    if state["scaler"]:
        parts.scaler.load_state_dict(state["scaler"])
    if parts.wrapper is not None and "reducer_states" in state:
        parts.wrapper.load_reducer_state_dict(_to_device(state["reducer_states"][rank], torch.device("cpu")))
