"""Run a function on N gloo ranks, each in its own forked process, and collect what each returns.

This is the harness behind mixprec's multi-process tests and benchmarks. It is public so that users can
check their own reductions against a single-process reference the same way.

Why fork: a forked group costs ~0.1 s on a small CPU machine, against ~4.5 s for spawn and ~8 s for
torchrun. Why ``torch.set_num_threads(1)`` first in every child: intra-op thread pools inherited through
fork can deadlock, and N ranks on a 2-core machine gain nothing from more threads anyway. Where torch sees a
GPU, a parent that has run a backward pass has started autograd's device threads, and its forked children
cannot run one (torch raises; "Autograd and Fork" on the PyTorch wiki): run such checks in a fresh process,
or hide the GPUs (``CUDA_VISIBLE_DEVICES=``) from a CPU-only test session.

Results and exceptions travel back as plain pickles over a pipe (not torch's shared-memory pickler,
whose file descriptors die with the child), so a child may return tensors, numbers or any picklable
object.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mixprec.comm.launcher import GRACE_S, RanksFailed, rank_exit_code, rank_process, rendezvous_dir, run_ranks
from mixprec.core.validate import check_positive_float, check_positive_int

__all__ = ["RankFailedError", "run_distributed"]


class RankFailedError(RanksFailed):
    """One or more ranks raised, crashed or hung; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str], *, summary: str | None = None, **blame: Any) -> None:
        self.failures = dict(sorted(failures.items()))
        parts = [f"--- rank {r} ---\n{msg}" for r, msg in self.failures.items()]
        summary = summary or f"{len(failures)} rank(s) failed"
        super().__init__(summary, **blame)
        self.args = (f"{summary}\n" + "\n".join(parts),)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: Any,
) -> None:
    import torch.distributed as dist

    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    code = 0
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            # gloo's connectFullMesh can return on one rank before its peer's side of the handshake is done;
            # a rank whose fn needs no collective would then exit and fail the peer's init with "Connection
            # closed by peer" (seen about once in 200 groups). No rank leaves this barrier before all have
            # finished init.
            dist.barrier()
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            # A failing rank must not leave its peers waiting on a barrier that never comes; tearing
            # the group down makes their next collective raise instead of hang.
            dist.destroy_process_group()
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # report everything, including SystemExit from user code
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        code = rank_exit_code(exc)  # tells the launcher whether this rank failed on its own or by a peer
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
        # Skip interpreter teardown (atexit handlers inherited from the parent, e.g. pytest's).
        os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks; return their results.

    The ranks are started as those of ``mixprec train --nproc`` are (:mod:`mixprec.comm.launcher`): they die
    with the calling process, and once one fails the others get a few seconds before they are stopped.

    Args:
        fn: a module-level or closure function; with fork it need not be picklable, only its return
            value must be.
        world_size: number of ranks, >= 1.
        backend: ``torch.distributed`` backend, ``"gloo"`` on CPU.
        timeout: seconds. Passed to ``init_process_group`` (so a collective waiting on a dead peer
            raises) and used as the overall deadline; ranks still running after it are killed.

    Returns:
        ``[result_of_rank_0, ..., result_of_rank_{N-1}]``.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message), exited without a result,
            or was still running at the deadline. Its ``summary`` is one line naming the rank that failed on
            its own (not as a peer's victim) or the ranks that hung.
    """
    check_positive_int("world_size", world_size)
    timeout = check_positive_float("timeout", timeout)
    ctx = mp.get_context("fork")
    with rendezvous_dir("mixprec-dist-") as tmpdir:
        init_file = os.path.join(tmpdir, "rendezvous")
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            rank_process(ctx, _child, (fn, rank, world_size, init_file, backend, timeout, args, kwargs, pipes[rank][1]))
            for rank in range(world_size)
        ]
        try:
            messages = run_ranks(procs, deadline=time.monotonic() + timeout, pipes=pipes)
            failure = None
        except RanksFailed as exc:
            messages, failure = exc.messages, exc
        finally:
            for read, _ in pipes:
                read.close()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    hung = failure.hung if failure is not None else []
    # Ranks stopped at the deadline, or because another rank had failed GRACE_S seconds before?
    others_failed = any(code not in (None, 0) for r, code in enumerate(p.exitcode for p in procs) if r not in hung)
    for rank in range(world_size):
        if rank in messages:
            status, value = pickle.loads(messages[rank])
            (results if status == "ok" else failures)[rank] = value
        elif rank in hung:
            failures[rank] = (
                f"still running {GRACE_S:g} s after another rank failed; stopped"
                if others_failed
                else f"still running after the {timeout:.0f} s deadline (hung?)"
            )
        else:
            failures[rank] = f"exited with code {procs[rank].exitcode} before returning a result"
    if failure is not None:
        raise RankFailedError(
            failures, summary=failure.summary, rank=failure.rank, exit_codes=failure.exit_codes, hung=hung
        )
    if failures:  # every rank exited 0, yet one sent no result
        raise RankFailedError(failures)
    return [results[r] for r in range(world_size)]
