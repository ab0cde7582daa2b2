"""Train many single-process runs (simulated data parallelism, noise-band replicas) side by side.

A simulated run computes on one thread (mixprec.lab.simulate), so on a machine with C cores up to C of them run
at once in spawned worker processes; the numbers are those of the run trained alone (one thread either way).
A run that fails as runs do (divergence, a loss-scale floor) is reported by its message; anything else is a bug
and propagates at once, as does Ctrl-C: the queued runs are cancelled and the running ones ended. The workers
die with the process that started them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Sequence

from mixprec.comm.launcher import die_with_launcher
from mixprec.lab.config import TrainConfig
from mixprec.lab.launch import launch
from mixprec.lab.train import TrainingDiverged
from mixprec.scaling import LossScaleFloorError

__all__ = ["default_workers", "train_all"]


def default_workers() -> int:
    """Worker processes for :func:`train_all`: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _train_one(cfg: TrainConfig) -> str | None:
    """One run, its stdout (the per-run announcements) silenced; the failure message of a failed run."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        try:
            launch(cfg, overwrite=True, progress=False)
        except (TrainingDiverged, LossScaleFloorError) as exc:
            return str(exc)
    return None


def train_all(configs: Sequence[TrainConfig], *, workers: int | None = None, label: str = "") -> list[str | None]:
    """Train every configuration (each with ``nproc = 1``); returns, per configuration, None when it finished or
    the message of its failure. With one worker (or one run) they train here, one after the other."""
    for cfg in configs:
        if cfg.parallel.nproc != 1:
            raise ValueError(
                f"train_all trains single-process runs; {cfg.training.out_dir} has nproc {cfg.parallel.nproc}"
            )
    workers = min(workers or default_workers(), len(configs))
    prefix = f"mixprec demo: {label}" if label else "mixprec demo:"
    print(f"{prefix} {len(configs)} run(s), {max(workers, 1)} at a time", flush=True)
    if workers <= 1:
        return [_train_one(cfg) for cfg in configs]
    # multiprocessing.Pool, not concurrent.futures: its terminate() ends the running workers at once, and imap
    # hands out one run at a time (chunksize 1), so no queued run has started when an error stops the pool.
    # The workers die with this process, as the ranks of every mixprec launcher do (mixprec.comm.launcher).
    pool = mp.get_context("spawn").Pool(workers, initializer=die_with_launcher, initargs=(os.getpid(),))
    try:
        results = list(pool.imap(_train_one, configs, chunksize=1))  # raises at the first failure, in order
    except BaseException:
        # Ctrl-C or a bug in a run: the queued runs (minutes each) are not waited for, the running ones are ended.
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()
    return results
