"""Start a ``mixprec train`` run: in this process, as ``--parallel.nproc N`` ranks started and watched here, or as one
rank of a ``torchrun`` job.

The ``--parallel.nproc`` ranks are started by :mod:`mixprec.comm.launcher`, as every mixprec launcher's are: when one
exits non-zero the others get ``GRACE_S`` seconds, are terminated, and :class:`TrainingFailed` names the rank that
failed first on its own (a rank whose collective failed because a peer died or hung exits with
:data:`PEER_FAILURE_EXIT`). A hung rank is detected after ``parallel.timeout`` seconds. The ranks die with the
launcher (a parent-death signal), SIGTERM stops a run as SIGINT does, and the rendezvous directory of a launcher
that was killed is removed when the next run starts. docs/lab.md has the time bounds.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import re
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.launcher import (
    GRACE_S,
    PEER_FAILURE_EXIT,
    RanksFailed,
    Terminated,
    rank_exit_code,
    rank_process,
    rendezvous_dir,
    run_ranks,
    sigterm_as_interrupt,
)
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

CONFIG_NAME = "config.toml"
_RUN_FILES = (CONFIG_NAME, METRICS_NAME, CHECKPOINT_NAME, SUMMARY_NAME)


class TrainingFailed(RanksFailed):
    """A rank failed; the message says which, how, and what happened to the others."""


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE when started by torchrun (or any launcher setting them),
    with torchrun's GROUP_RANK and GROUP_WORLD_SIZE (this node's index and the node count) when set.

    Raises:
        ValueError: a variable is not an integer, or GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE is not WORLD_SIZE (nodes
            with different rank counts: the hierarchical reductions need the same count on every node).
    """
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        env.update({k: int(os.environ[k]) for k in ("GROUP_RANK", "GROUP_WORLD_SIZE") if k in os.environ})
    except ValueError as exc:
        raise ValueError(f"torchrun environment variables must be integers ({exc})") from None
    nodes = env.get("GROUP_WORLD_SIZE")
    if nodes is not None and nodes * env["LOCAL_WORLD_SIZE"] != env["WORLD_SIZE"]:
        raise ValueError(
            f"torchrun started {env['LOCAL_WORLD_SIZE']} ranks on this node (LOCAL_WORLD_SIZE) but {env['WORLD_SIZE']}"
            f" ranks on {nodes} nodes (WORLD_SIZE, GROUP_WORLD_SIZE): give every node the same --nproc-per-node"
        )
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
    if cfg.parallel.hierarchical and not ranks_per_node:
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


def _child(cfg: TrainConfig, rank: int, world_size: int, init_method: str, device_type: str, resume: bool) -> None:
    """One ``--parallel.nproc`` rank (started by :func:`mixprec.comm.launcher.rank_process`): train, and exit with a
    code that tells its launcher whether it failed on its own."""
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
    except BaseException as exc:
        code = rank_exit_code(exc)
        if code == PEER_FAILURE_EXIT:
            sys.exit(code)  # run_rank said so in one line; the culprit's traceback is the useful one
        if isinstance(exc, TrainingDiverged | LossScaleFloorError | CheckpointWriteError):
            sys.exit(1)  # the run's numerics or the disk failed, not the code: run_rank's one line says why
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS):
            sys.exit(1)  # the disk refused a write: run_rank's one line says which
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(code)


def _failure(exc: RanksFailed, timeout: float) -> TrainingFailed:
    return TrainingFailed(
        f"{exc.summary}. The last checkpoint, if any, is intact; continue with --resume. (A rank that hangs is "
        f"detected after timeout = {timeout:g} s.)",
        rank=exc.rank,
        exit_codes=exc.exit_codes,
        hung=exc.hung,
    )


def _spawn(cfg: TrainConfig, device_type: str, resume: bool) -> None:
    # fork is ~40x faster to start than spawn on a small CPU machine; CUDA cannot survive a fork.
    ctx = mp.get_context("fork" if device_type == "cpu" else "spawn")
    # A file rendezvous: no free-port race (a port probed free can be taken before the ranks bind it).
    with rendezvous_dir("mixprec-train-") as rendezvous:
        init_method = "file://" + os.path.join(rendezvous, "store")
        world_size = cfg.parallel.nproc
        procs = [
            rank_process(ctx, _child, (cfg, r, world_size, init_method, device_type, resume)) for r in range(world_size)
        ]
        try:
            run_ranks(procs)
        except RanksFailed as exc:
            raise _failure(exc, cfg.parallel.timeout) from None


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
        if rank == 0:
            print(f"mixprec train: torchrun: {_where(env, cfg)}", file=sys.stderr, flush=True)
        device = torch.device("cuda", env["LOCAL_RANK"]) if device_type == "cuda" else torch.device("cpu")
        return train_rank(
            cfg,
            rank=rank,
            world_size=env["WORLD_SIZE"],
            device=device,
            resume=resume,
            progress=progress if rank == 0 else False,
        )
    except BaseException as exc:
        if not is_peer_failure(exc):
            raise
        # One line per surviving rank instead of a traceback, naming the peer's address when the transport gave
        # it (gloo does: a node that died or was cut off). Printed before the group is torn down below: that makes
        # the other local ranks fail, and torchrun may SIGTERM this rank as soon as one of them has exited.
        peer = _PEER_ADDRESS.search(str(exc))
        who = f"the rank at {peer.group(1)} failed or is unreachable" if peer else "another rank failed or hung"
        line = f"rank {rank} (node {_node(env)}, local rank {env['LOCAL_RANK']}) stopped: {who}"
        print(f"mixprec train: {line}", file=sys.stderr, flush=True)
        raise TrainingFailed(
            f"{line} ({exc}). The last checkpoint, if any, is intact; continue with --resume. (A rank that hangs "
            f"is detected after timeout = {cfg.parallel.timeout:g} s.)",
            rank=rank,
        ) from exc
    finally:
        dist.destroy_process_group()


# gloo's transport errors name the peer as "[ADDRESS]:PORT" (e.g. "Read error [10.0.0.2]:37000: Connection reset").
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def _node(env: dict[str, int]) -> int:
    return env.get("GROUP_RANK", env["RANK"] // env["LOCAL_WORLD_SIZE"])


def _where(env: dict[str, int], cfg: TrainConfig) -> str:
    """The job's shape as torchrun's environment gives it, and the topology the hierarchical reductions use."""
    nodes = env.get("GROUP_WORLD_SIZE", env["WORLD_SIZE"] // env["LOCAL_WORLD_SIZE"])
    line = (
        f"{env['WORLD_SIZE']} ranks, {nodes} node(s) x {env['LOCAL_WORLD_SIZE']} (WORLD_SIZE={env['WORLD_SIZE']}, "
        f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}"
        + (f", GROUP_WORLD_SIZE={env['GROUP_WORLD_SIZE']})" if "GROUP_WORLD_SIZE" in env else ")")
    )
    p = cfg.parallel
    if p.hierarchical:
        line += f"; {p.reduce} topology: {env['WORLD_SIZE'] // p.ranks_per_node} nodes x {p.ranks_per_node} ranks"
    return line


def read_summary(out_dir: str) -> dict[str, Any]:
    import json

    with open(os.path.join(out_dir, SUMMARY_NAME)) as fh:
        return decode_row(json.load(fh), os.path.join(out_dir, SUMMARY_NAME))
