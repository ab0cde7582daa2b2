"""Start a ``mixprec train`` run: in this process, as ``--nproc N`` ranks started and watched here, or as one
rank of a ``torchrun`` job.

The ``--nproc`` launcher watches its children: when one exits non-zero it gives the others ``GRACE_S`` seconds,
terminates them, and raises :class:`TrainingFailed` naming the rank that failed first on its own (a rank whose
collective failed because a peer died or hung exits with :data:`PEER_FAILURE_EXIT`). A hung rank is detected
after ``parallel.timeout`` seconds. The ranks die with the launcher (a parent-death signal), and SIGTERM stops a
run as SIGINT does. docs/lab.md has the time bounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.objects import is_peer_failure
from mixprec.lab.build import gpt_config
from mixprec.lab.checkpoint import CHECKPOINT_NAME, CheckpointWriteError, check_resume, remove_stale_temporaries
from mixprec.lab.config import TrainConfig, config_to_toml
from mixprec.lab.corpus import Corpus, check_corpus_source, load_corpus
from mixprec.lab.data import check_corpus_fits
from mixprec.lab.metrics import METRICS_NAME, SUMMARY_NAME, decode_row
from mixprec.lab.paths import check_output_dir
from mixprec.lab.train import TrainingDiverged, train_rank
from mixprec.scaling import LossScaleFloorError

__all__ = [
    "GRACE_S",
    "PEER_FAILURE_EXIT",
    "Terminated",
    "TrainingFailed",
    "check_run",
    "preflight",
    "launch",
    "sigterm_as_interrupt",
    "torchrun_env",
]

GRACE_S = 5.0
# Exit code of a --nproc child whose failure was caused by another rank (see the module docstring).
PEER_FAILURE_EXIT = 3
CONFIG_NAME = "config.toml"
_RUN_FILES = (CONFIG_NAME, METRICS_NAME, CHECKPOINT_NAME, SUMMARY_NAME)


class TrainingFailed(RuntimeError):
    """A rank failed; the message says which, how, and what happened to the others."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run stops as on Ctrl-C (children stopped, checkpoint kept)."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the launcher dies (Linux; as torch elastic does), and exit now
    if it died before that was set up (this process was then re-parented)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE when started by torchrun (or any launcher setting them)."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    except ValueError as exc:
        raise ValueError(f"torchrun environment variables must be integers ({exc})") from None
    return env


def resolve_device(cfg: TrainConfig) -> str:
    if cfg.training.device == "cpu" or cfg.parallel.simulate_dp:  # simulated ranks: the CPU (config refuses cuda)
        return "cpu"
    available = torch.cuda.is_available()
    if cfg.training.device == "cuda" and not available:
        raise ValueError("device='cuda' but no CUDA device is available; use device = 'cpu' or 'auto'")
    return "cuda" if available else "cpu"


def check_run(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> None:
    """Every check a run's configuration can fail, before anything is written (ValueError, exit code 2): the
    corpus exists and is long enough for ``block_size`` in both splits, the model's own configuration, the run
    directory, and on ``resume`` the checkpoint (its checksum, configuration and corpus). (The loss scaler is
    built by TrainConfig's own validation.)"""
    check_corpus_source(cfg.data.corpus)
    corpus = load_corpus(cfg.data.corpus)
    check_corpus_fits(corpus, block_size=cfg.model.block_size)
    gpt_config(cfg, corpus.vocab_size)
    check_run_dir(cfg, resume=resume, overwrite=overwrite, corpus=corpus)


def check_run_dir(cfg: TrainConfig, *, resume: bool, overwrite: bool, corpus: Corpus | None = None) -> None:
    """Refuse to clobber an existing run unless asked; refuse to resume a run that has no checkpoint, or one
    whose configuration (or, given ``corpus``, corpus) differs."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    check_output_dir("out_dir", cfg.training.out_dir)
    if resume:
        check_resume(cfg, corpus)
        return
    existing = [f for f in _RUN_FILES if os.path.exists(os.path.join(cfg.training.out_dir, f))]
    if existing and not overwrite:
        raise ValueError(
            f"out_dir {cfg.training.out_dir!r} already holds a run ({', '.join(existing)}); pass --resume to "
            "continue it, --overwrite to replace it, or choose another out_dir"
        )


def prepare_run_dir(cfg: TrainConfig, *, resume: bool, overwrite: bool) -> None:
    """Create ``out_dir`` and write the resolved ``config.toml`` (after :func:`check_run_dir`)."""
    out_dir = cfg.training.out_dir
    os.makedirs(out_dir, exist_ok=True)
    remove_stale_temporaries(os.path.join(out_dir, CHECKPOINT_NAME))
    if overwrite:
        for f in _RUN_FILES:
            path = os.path.join(out_dir, f)
            if os.path.exists(path):
                os.unlink(path)
    header = (
        f"Resolved configuration of a mixprec train run (torch {torch.__version__}).\n"
        f"Rerun: mixprec train --config {os.path.join(out_dir, CONFIG_NAME)} --overwrite"
    )
    tmp = os.path.join(out_dir, CONFIG_NAME + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(config_to_toml(cfg, header))
    os.replace(tmp, os.path.join(out_dir, CONFIG_NAME))


def _resolve(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> TrainConfig:
    """Fill in what the defaults leave open: the world size, an absolute out_dir, the loss scaler, and for
    the hierarchical reductions the ranks per node (torchrun's LOCAL_WORLD_SIZE, else two simulated nodes)."""
    ranks_per_node = cfg.parallel.ranks_per_node
    if cfg.parallel.reduce.endswith("_hierarchical") and not ranks_per_node:
        ranks = cfg.parallel.simulate_dp or world_size
        ranks_per_node = local_world_size if local_world_size is not None else max(1, ranks // 2)
    return cfg.replace(
        parallel={"nproc": world_size, "ranks_per_node": ranks_per_node},
        training={"out_dir": os.path.abspath(cfg.training.out_dir)},
        scaler={"kind": cfg.resolved_loss_scaler},
    )


def _check_local_gpu(local_rank: int) -> None:
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} needs CUDA device {local_rank}, but this machine has {count}: start at most "
            f"{count} rank(s) per machine (NCCL cannot share a GPU between ranks), or use device = 'cpu'"
        )


def run_rank(
    cfg: TrainConfig,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    device_type: str,
    resume: bool,
    progress: bool | None,
    init_method: str,
) -> dict[str, Any] | None:
    """Join the process group at ``init_method`` (a ``file://`` rendezvous), train, leave."""
    if device_type == "cuda":
        _check_local_gpu(local_rank)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=cfg.parallel.timeout)  # every group mixprec creates inherits it
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    try:
        return train_rank(cfg, rank=rank, world_size=world_size, device=device, resume=resume, progress=progress)
    except BaseException as exc:
        if is_peer_failure(exc):
            print(f"mixprec train: rank {rank} stopped: another rank failed ({exc})", file=sys.stderr, flush=True)
        else:
            print(f"mixprec train: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        # Tearing the group down makes peers blocked on this rank fail now instead of at the timeout.
        dist.destroy_process_group()


def _child(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    init_method: str,
    device_type: str,
    resume: bool,
    fork: bool,
    parent_pid: int,
) -> None:
    # The launcher's SIGTERM handler (inherited through fork) is the launcher's: a rank it terminates just stops.
    # Reset it first, so that no SIGTERM can reach the inherited handler once the rank runs.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    if fork:
        # Intra-op thread pools inherited through fork can deadlock; and N ranks share the cores anyway.
        torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    try:
        run_rank(
            cfg,
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            device_type=device_type,
            resume=resume,
            progress=None if rank == 0 else False,
            init_method=init_method,
        )
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as exc:
        if is_peer_failure(exc):
            sys.exit(PEER_FAILURE_EXIT)  # run_rank said so in one line; the culprit's traceback is the useful one
        if isinstance(exc, TrainingDiverged | LossScaleFloorError | CheckpointWriteError):
            sys.exit(1)  # the run's numerics or the disk failed, not the code: run_rank's one line says why
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS):
            sys.exit(1)  # the disk refused a write: run_rank's one line says which
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def _watch(procs: list[Any], timeout: float) -> None:
    """Wait for all ranks; on the first non-zero exit stop the others and blame the right rank (see the module
    docstring)."""
    observed: list[int] = []  # ranks in the order their non-zero exits were seen
    while True:
        # One read of each exit code per round: a rank exiting between two reads must not be seen as still
        # running by one and as exited (and not failed) by the other.
        codes = [p.exitcode for p in procs]
        observed += [r for r, code in enumerate(codes) if code not in (None, 0) and r not in observed]
        running = [p for p, code in zip(procs, codes, strict=True) if code is None]
        if observed or not running:
            break
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=1.0)
    if not observed:
        return
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0) and rank not in observed:
            observed.append(rank)
    stopped = [r for r, p in enumerate(procs) if p.exitcode is None]
    for r in stopped:
        procs[r].terminate()
    for r in stopped:
        procs[r].join(5.0)
        if procs[r].exitcode is None:
            procs[r].kill()
            procs[r].join(5.0)
    raise TrainingFailed(_blame([p.exitcode for p in procs], observed, stopped, timeout))


def _blame(codes: list[int | None], observed: list[int], stopped: list[int], timeout: float) -> str:
    """The failure message: the first rank seen failing on its own (not as a peer's victim); else, when every
    failure was a peer's, the ranks that had to be terminated (they hung); else the first seen."""
    own = [r for r in observed if codes[r] != PEER_FAILURE_EXIT]
    if own:
        rank = own[0]
        code = codes[rank]
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        what = f"rank {rank} {how}"
    elif stopped:
        rank = stopped[0]
        names = ", ".join(str(r) for r in stopped)
        what = (
            f"rank(s) {names} stopped responding (hung): their peers' collectives failed or timed out, and the "
            "launcher terminated them"
        )
    else:
        rank = observed[0]
        what = f"rank {rank} exited with code {codes[rank]}"
    others = []
    for r, code in enumerate(codes):
        if r == rank:
            continue
        if r in stopped:
            others.append(f"rank {r}: terminated by the launcher")
        elif code == PEER_FAILURE_EXIT:
            others.append(f"rank {r}: stopped, a peer failed")
        else:
            others.append(f"rank {r}: exit code {code}")
    return (
        f"{what}; the other ranks were stopped ({'; '.join(others)}). The last checkpoint, if any, is intact; "
        f"continue with --resume. (A rank that hangs is detected after timeout = {timeout:g} s.)"
    )


def _spawn(cfg: TrainConfig, device_type: str, resume: bool) -> None:
    # fork is ~40x faster to start than spawn on a small CPU machine; CUDA cannot survive a fork.
    fork = device_type == "cpu"
    ctx = mp.get_context("fork" if fork else "spawn")
    # A file rendezvous: no free-port race (a port probed free can be taken before the ranks bind it).
    rendezvous = tempfile.mkdtemp(prefix="mixprec-train-")
    init_method = "file://" + os.path.join(rendezvous, "store")
    procs = [
        ctx.Process(
            target=_child,
            args=(cfg, r, cfg.parallel.nproc, init_method, device_type, resume, fork, os.getpid()),
            daemon=True,
        )
        for r in range(cfg.parallel.nproc)
    ]
    try:
        for p in procs:
            p.start()
        _watch(procs, cfg.parallel.timeout)
    except KeyboardInterrupt:
        # The signal may come while the ranks are still being started: only started ones can be stopped.
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.exitcode is None:
                p.terminate()
        for p in started:
            p.join(5.0)
        raise
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def preflight(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> TrainConfig:
    """Every check ``launch(cfg, ...)`` makes before it writes anything or starts a rank, with the configuration
    resolved as the run will save it (world size from torchrun when set); returns that resolved configuration.
    ValueError names what is wrong (exit code 2 in the CLI)."""
    env = torchrun_env()
    if env is not None:
        resolved = _resolve(cfg, env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"])
    else:
        resolved = _resolve(cfg, cfg.parallel.nproc)
    check_run(resolved, resume=resume, overwrite=overwrite)
    resolve_device(resolved)
    return resolved


def launch(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    checked: bool = False,
) -> dict[str, Any] | None:
    """Run ``cfg``: here when ``nproc == 1``, as ``nproc`` watched child ranks otherwise, or as this process's
    rank when torchrun's variables are set. Returns the run summary (None on ranks other than 0 under torchrun).
    ``checked=True``: ``cfg`` is what :func:`preflight` returned for the same ``resume``/``overwrite``, so its
    checks (the corpus, the checkpoint's checksum) are not made a second time.

    Raises:
        ValueError: a bad configuration, a missing corpus, an unwritable or existing run directory
            (without ``resume``/``overwrite``), or a checkpoint that does not match (exit code 2 in the CLI).
        TrainingFailed: a rank failed; the others were stopped.
    """
    env = torchrun_env()
    if env is not None:
        return _launch_torchrun(cfg, env, resume=resume, overwrite=overwrite, progress=progress, checked=checked)
    if not checked:
        cfg = preflight(cfg, resume=resume, overwrite=overwrite)
    device_type = resolve_device(cfg)
    if device_type == "cuda":
        _check_local_gpu(cfg.parallel.nproc - 1)
    prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
    if cfg.parallel.nproc == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        return train_rank(cfg, device=device, resume=resume, progress=progress)
    _spawn(cfg, device_type, resume)
    return read_summary(cfg.training.out_dir)


def _launch_torchrun(
    cfg: TrainConfig, env: dict[str, int], *, resume: bool, overwrite: bool, progress: bool | None, checked: bool
) -> dict[str, Any] | None:
    rank = env["RANK"]
    # Every rank validates before anything is written, so all of them refuse a bad run together.
    if not checked:
        cfg = preflight(cfg, resume=resume, overwrite=overwrite)
    device_type = resolve_device(cfg)
    if device_type == "cuda":
        _check_local_gpu(env["LOCAL_RANK"])
        torch.cuda.set_device(env["LOCAL_RANK"])
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout))
    try:
        # Every rank has run its checks above before rank 0 writes config.toml: else a fast rank 0 could write it
        # before a slow rank checks the directory, which would then refuse it as "already holds a run".
        dist.barrier()
        if rank == 0:
            prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        dist.barrier()
        device = torch.device("cuda", env["LOCAL_RANK"]) if device_type == "cuda" else torch.device("cpu")
        return train_rank(
            cfg,
            rank=rank,
            world_size=env["WORLD_SIZE"],
            device=device,
            resume=resume,
            progress=progress if rank == 0 else False,
        )
    finally:
        dist.destroy_process_group()


def read_summary(out_dir: str) -> dict[str, Any]:
    import json

    with open(os.path.join(out_dir, SUMMARY_NAME)) as fh:
        return decode_row(json.load(fh), os.path.join(out_dir, SUMMARY_NAME))
