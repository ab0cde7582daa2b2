"""Local ranks started, watched, blamed and stopped the same way by every launcher mixprec ships.

``mixprec train --nproc``, ``mixprec audit collectives`` and :func:`mixprec.testing.run_distributed` start their
ranks here; the studies' worker pool takes :func:`die_with_launcher`. It sits in comm (layer 2), the lowest layer
both ``testing`` (3) and ``lab`` (7) may import, beside :func:`~mixprec.comm.objects.is_peer_failure` on which the
blame rests. The guarantees (time bounds: docs/lab.md):

* A rank dies with its launcher: :func:`rank_process` asks the kernel for SIGKILL when the launcher dies (Linux
  ``prctl(PR_SET_PDEATHSIG)``, as torch elastic does). SIGTERM ends a rank at once, SIGINT is left to the
  launcher (Ctrl-C reaches the whole process group), and a forked rank runs one intra-op thread.
* A rank whose collective failed because of a peer exits :data:`PEER_FAILURE_EXIT` (:func:`rank_exit_code`).
* :func:`run_ranks` starts and watches them: at the first non-zero exit the others get :data:`GRACE_S` seconds,
  then are stopped, and :class:`RanksFailed` names the rank that failed on its own, else the ranks that hung.
  Any exception in the launcher meanwhile (Ctrl-C; SIGTERM under :func:`sigterm_as_interrupt`) stops every
  started rank before it propagates.
* :func:`rendezvous_dir`: a file-rendezvous directory locked for its launcher's life; the next launcher of the
  same user removes those whose launcher was killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import multiprocessing.connection
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mixprec.comm.objects import is_peer_failure

__all__ = [
    "GRACE_S",
    "PEER_FAILURE_EXIT",
    "RanksFailed",
    "Terminated",
    "die_with_launcher",
    "rank_exit_code",
    "rank_process",
    "remove_stale_rendezvous",
    "rendezvous_dir",
    "run_ranks",
    "sigterm_as_interrupt",
    "stop_ranks",
    "watch_ranks",
]

# Seconds the other ranks get to exit on their own after the first non-zero exit.
GRACE_S = 5.0
# Seconds between SIGTERM and SIGKILL when the launcher stops a rank.
STOP_WAIT_S = 5.0
# Exit code of a rank whose failure was caused by another rank.
PEER_FAILURE_EXIT = 3
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_LOCK_NAME = "launcher.lock"
_STOPPING = (signal.SIGINT, signal.SIGTERM)


class RanksFailed(RuntimeError):
    """A rank failed and the others were stopped.

    ``summary``: one line naming the rank blamed (``rank``), how it failed, and what became of the others;
    ``exit_codes``: per rank (negative: killed by that signal); ``hung``: the ranks the launcher had to stop;
    ``messages``: what the ranks sent before (see :func:`watch_ranks`).
    """

    def __init__(
        self,
        summary: str,
        *,
        rank: int | None = None,
        exit_codes: Sequence[int | None] = (),
        hung: Sequence[int] = (),
        messages: dict[int, bytes] | None = None,
    ) -> None:
        super().__init__(summary)
        self.summary = summary
        self.rank = rank
        self.exit_codes = list(exit_codes)
        self.hung = list(hung)
        self.messages = dict(messages or {})


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a launcher stops as on Ctrl-C (its ranks stopped)."""


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


def rank_exit_code(exc: BaseException) -> int:
    """The exit code of a rank that raised ``exc``: :data:`PEER_FAILURE_EXIT` when a peer caused it, else 1."""
    return PEER_FAILURE_EXIT if is_peer_failure(exc) else 1


def die_with_launcher(parent_pid: int) -> None:
    """Called first in a child of the process ``parent_pid``: have the kernel SIGKILL this process when its parent
    dies (Linux; elsewhere nothing), and exit at once if the parent died before that was asked (this process was
    re-parented). Also a ``multiprocessing.Pool`` initializer."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _prepare_rank(parent_pid: int, fork: bool) -> None:
    # The launcher's handlers came through fork: SIGTERM must end a rank, and SIGINT is the launcher's to act on.
    # Both were blocked across the fork (see _start), so none can reach an inherited handler before this.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)
    die_with_launcher(parent_pid)
    if fork:
        import torch

        # Intra-op thread pools inherited through fork can deadlock; and N ranks share the cores anyway.
        torch.set_num_threads(1)


def _rank_main(target: Callable[..., Any], parent_pid: int, fork: bool, args: tuple[Any, ...]) -> None:
    _prepare_rank(parent_pid, fork)
    target(*args)


def rank_process(ctx: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """A (not yet started) daemon process of the multiprocessing context ``ctx`` that runs ``target(*args)`` as a
    rank of this launcher: dying with it, SIGTERM at its default action, SIGINT ignored, one intra-op thread when
    forked. With spawn, ``target`` and ``args`` must be picklable."""
    fork = ctx.get_start_method() == "fork"
    return ctx.Process(target=_rank_main, args=(target, os.getpid(), fork, args), daemon=True)


def _start(proc: Any) -> None:
    # Blocked across the fork, SIGINT and SIGTERM wait in the child until it has set its own handlers, and in
    # the launcher until the process is recorded as started (so that stop_ranks sees it).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_ranks(procs: Sequence[Any]) -> None:
    """Stop every started rank still running: SIGTERM (with SIGCONT, so that a stopped rank acts on it), then
    SIGKILL for any still running :data:`STOP_WAIT_S` seconds later."""
    live = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in live:
        p.terminate()
        with contextlib.suppress(ProcessLookupError):  # not yet waited for, so the pid is still this process's
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + STOP_WAIT_S
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.exitcode is None:
            p.kill()
            p.join(STOP_WAIT_S)


def _blame(codes: list[int | None], observed: list[int], stopped: list[int]) -> tuple[int, str]:
    """The rank blamed and the summary: the first rank seen failing on its own (not as a peer's victim); else,
    when every failure was a peer's, the ranks that had to be stopped (they hung); else the first seen."""
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
    return rank, f"{what}; the other ranks were stopped ({'; '.join(others)})" if others else what


def watch_ranks(
    procs: Sequence[Any],
    *,
    deadline: float | None = None,
    inbox: dict[int, Any] | None = None,
) -> dict[int, bytes]:
    """Wait for the started ``procs`` to exit; return what they sent when all exited with 0.

    ``inbox`` maps a rank to the read end of a pipe on which it may send one message (read as it comes, so that
    a rank never blocks on a full pipe). At the first non-zero exit the other ranks get :data:`GRACE_S` seconds,
    then are stopped (:func:`stop_ranks`); at ``deadline`` (a ``time.monotonic()`` value) the ranks still running
    are stopped as hung. Either way :class:`RanksFailed` names the rank to blame.
    """
    pending = dict(inbox or {})
    messages: dict[int, bytes] = {}
    observed: list[int] = []  # ranks in the order their non-zero exits were seen
    until = deadline
    grace_started = False
    while True:
        # One read of each exit code per round: a rank exiting between two reads must not be seen as still
        # running by one and as exited (and not failed) by the other.
        codes = [p.exitcode for p in procs]
        observed += [r for r, code in enumerate(codes) if code not in (None, 0) and r not in observed]
        running = [r for r, code in enumerate(codes) if code is None]
        now = time.monotonic()
        if observed and not grace_started:
            grace_started = True
            until = now + GRACE_S if deadline is None else min(deadline, now + GRACE_S)
        if not running or (until is not None and now >= until):
            break
        timeout = 1.0 if until is None else min(1.0, until - now)
        ready = multiprocessing.connection.wait(
            [procs[r].sentinel for r in running] + list(pending.values()), timeout=timeout
        )
        for rank, conn in list(pending.items()):
            if conn in ready:
                _receive(rank, conn, pending, messages)
    for rank, conn in list(pending.items()):  # what exited ranks sent in the last round
        if procs[rank].exitcode is not None and conn.poll(0):
            _receive(rank, conn, pending, messages)
    if not observed and not running:
        return messages
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0) and rank not in observed:
            observed.append(rank)
    stopped = [r for r, p in enumerate(procs) if p.exitcode is None]
    stop_ranks([procs[r] for r in stopped])
    codes = [p.exitcode for p in procs]
    rank, summary = _blame(codes, observed, stopped)
    raise RanksFailed(summary, rank=rank, exit_codes=codes, hung=stopped, messages=messages)


def _receive(rank: int, conn: Any, pending: dict[int, Any], messages: dict[int, bytes]) -> None:
    del pending[rank]
    # EOF: the rank closed its end without a message (it died), and its exit code says how.
    with contextlib.suppress(EOFError, OSError):
        messages[rank] = conn.recv_bytes()


def run_ranks(
    procs: Sequence[Any],
    *,
    deadline: float | None = None,
    pipes: Sequence[tuple[Any, Any]] | None = None,
) -> dict[int, bytes]:
    """Start ``procs`` (from :func:`rank_process`) in rank order and :func:`watch_ranks` them. ``pipes``: per rank
    the (read, write) ends of a one-way pipe whose write end the rank was given; this process's copy of it is
    closed once the rank has started, and the read end is watched. Any exception raised here, KeyboardInterrupt
    and :class:`Terminated` included, stops every started rank at once before it propagates."""
    try:
        for rank, p in enumerate(procs):
            _start(p)
            if pipes is not None:
                pipes[rank][1].close()
        inbox = {rank: read for rank, (read, _) in enumerate(pipes)} if pipes is not None else None
        return watch_ranks(procs, deadline=deadline, inbox=inbox)
    except BaseException:
        stop_ranks(procs)
        raise


def remove_stale_rendezvous(prefix: str) -> list[str]:
    """Remove the directories ``<tempdir>/<prefix>*`` of this user whose launcher (and ranks) are gone: their lock
    file is not locked. Another user's, a live launcher's, and one without a lock file (made by an earlier
    mixprec, or still being made) are left alone. Returns the paths removed."""
    root = tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, _LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: its launcher or one of its ranks lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def rendezvous_dir(prefix: str) -> Iterator[str]:
    """A new directory ``<tempdir>/<prefix>XXXXXXXX`` for a file rendezvous, removed when the block ends, after
    :func:`remove_stale_rendezvous` of the same prefix. Its lock file, holding the launcher's pid, is locked
    (``flock``) for as long as the launcher or a forked rank, which inherits the lock, lives; a SIGKILL of all of
    them releases it, so the directory is known to be stale. The lock file is locked before it gets its name, so
    a directory whose lock file can be locked is never one still being made."""
    remove_stale_rendezvous(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    fd = -1
    try:
        making = os.path.join(path, _LOCK_NAME + ".new")
        fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(making, os.path.join(path, _LOCK_NAME))
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
