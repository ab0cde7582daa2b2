"""The one launcher mechanism behind mixprec train --nproc, the collective audit and run_distributed: blame,
stopping, peer-failure markers, and the rendezvous directories of killed launchers."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import tempfile
import time

import pytest

from mixprec.comm.launcher import (
    PEER_FAILURE_EXIT,
    RanksFailed,
    remove_stale_rendezvous,
    rendezvous_dir,
    stop_ranks,
    watch_ranks,
)
from mixprec.comm.objects import is_peer_failure


def _exit_after(delay: float, code: int) -> None:
    time.sleep(delay)
    os._exit(code)


def _procs(plan: list[tuple[float, int]]) -> list:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_exit_after, args=p, daemon=True) for p in plan]
    for p in procs:
        p.start()
    return procs


def test_watch_blames_the_rank_that_failed_on_its_own_not_the_first_to_exit() -> None:
    """Rank 0 exits first, as a victim (PEER_FAILURE_EXIT); rank 1 crashes with 13 a moment later: rank 1 is
    the one named."""
    procs = _procs([(0.0, PEER_FAILURE_EXIT), (0.5, 13)])
    with pytest.raises(RanksFailed) as info:
        watch_ranks(procs)
    assert info.value.summary.startswith("rank 1 exited with code 13;") and info.value.rank == 1
    assert "rank 0: stopped, a peer failed" in info.value.summary


@pytest.mark.slow  # GRACE_S (5 s) before the launcher terminates the "hung" rank
def test_watch_blames_the_hung_rank_when_every_exit_was_a_peer_failure() -> None:
    procs = _procs([(0.0, PEER_FAILURE_EXIT), (3600.0, 0)])  # rank 1 "hangs"; the launcher terminates it
    with pytest.raises(RanksFailed) as info:
        watch_ranks(procs)
    assert info.value.summary.startswith("rank(s) 1 stopped responding (hung)") and info.value.hung == [1]
    # Stopped by the launcher's signal (SIGTERM, or SIGKILL after GRACE_S), not by its own exit an hour later:
    # the cause, not the seconds, so the test holds on a loaded machine.
    assert procs[1].exitcode in (-signal.SIGTERM, -signal.SIGKILL)


def test_watch_reports_a_signal() -> None:
    procs = _procs([(3600.0, 0), (0.0, 0)])
    procs[1].join()
    procs[0].kill()
    with pytest.raises(RanksFailed, match=r"^rank 0 was killed by signal 9;"):
        watch_ranks(procs)


def test_watch_stops_the_ranks_still_running_at_the_deadline() -> None:
    procs = _procs([(3600.0, 0), (0.0, 0)])
    with pytest.raises(RanksFailed) as info:
        watch_ranks(procs, deadline=time.monotonic() + 1.0)
    assert info.value.hung == [0] and info.value.exit_codes == [-signal.SIGTERM, 0]


class _ExitsBetweenReads:
    """A rank that is still running at the first read of its exit code and has failed at every later read."""

    pid = None

    def __init__(self, code: int) -> None:
        self.code, self.reads = code, 0
        read_end, write_end = mp.Pipe(duplex=False)
        write_end.close()
        self._conn = read_end  # at EOF: always ready
        self.sentinel = read_end.fileno()

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else self.code

    def join(self, timeout: float | None = None) -> None:
        pass


def test_watch_sees_ranks_that_fail_between_two_reads_of_their_exit_code() -> None:
    """Both ranks exit with 1 just after the launcher looked at them: it must report the failure, not return as
    if the run had finished."""
    with pytest.raises(RanksFailed, match=r"^rank 0 exited with code 1;"):
        watch_ranks([_ExitsBetweenReads(1), _ExitsBetweenReads(1)])


def test_a_stopped_rank_is_ended_by_the_first_sigterm() -> None:
    """SIGTERM waits while a process is stopped: stop_ranks continues it, so it ends without the SIGKILL that
    follows STOP_WAIT_S later (its exit code is SIGTERM's, not SIGKILL's)."""
    (proc,) = _procs([(3600.0, 0)])
    os.kill(proc.pid, signal.SIGSTOP)
    stop_ranks([proc])
    assert proc.exitcode == -signal.SIGTERM


def test_a_closed_pair_after_a_timeout_is_a_peer_failure() -> None:
    """What gloo raises on the healthy ranks of a two-stage reduction when one rank of the first stage is
    stopped: those ranks are victims, not the culprit."""
    assert is_peer_failure(RuntimeError("Application timeout caused pair closure"))
    assert not is_peer_failure(RuntimeError("shape mismatch"))
    assert not is_peer_failure(ValueError("Application timeout caused pair closure"))  # not from the transport


# ---------------------------------------------------------------------------------------------- rendezvous
def _made(root, name: str, *, locked: bool | None) -> tuple[str, int | None]:
    """A rendezvous directory as a launcher leaves it: locked (alive), unlocked (killed), or without a lock
    file (``locked=None``). Returns its path and the descriptor holding the lock."""
    path = os.path.join(root, name)
    os.mkdir(path)
    with open(os.path.join(path, "store"), "w") as fh:
        fh.write("rendezvous")
    if locked is None:
        return path, None
    fd = os.open(os.path.join(path, "launcher.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    if locked:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return path, fd
    os.close(fd)
    return path, None


def test_stale_rendezvous_dirs_are_removed_and_live_ones_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live, fd = _made(tmp_path, "mixprec-train-live", locked=True)
    dead, _ = _made(tmp_path, "mixprec-train-dead", locked=False)
    old, _ = _made(tmp_path, "mixprec-train-old", locked=None)  # no lock file: left alone
    other, _ = _made(tmp_path, "mixprec-dist-dead", locked=False)  # another prefix
    kept = [live, old, other]
    if os.getuid() == 0:  # only root can give a directory to another user
        theirs, _ = _made(tmp_path, "mixprec-train-theirs", locked=False)
        os.chown(theirs, 65534, 65534)
        kept.append(theirs)
    try:
        assert remove_stale_rendezvous("mixprec-train-") == [dead]
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in kept)
    finally:
        os.close(fd)
    assert remove_stale_rendezvous("mixprec-train-") == [live]  # its launcher is gone now


def test_a_rendezvous_dir_is_locked_while_in_use_and_removed_after(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, _ = _made(tmp_path, "mixprec-dist-dead", locked=False)
    with rendezvous_dir("mixprec-dist-") as path:
        assert not os.path.exists(dead)  # removed at start
        assert os.listdir(path) == ["launcher.lock"]
        with open(os.path.join(path, "launcher.lock")) as fh:
            assert fh.read() == f"{os.getpid()}\n"
        assert remove_stale_rendezvous("mixprec-dist-") == []  # another launcher starting now keeps it
    assert os.listdir(tmp_path) == []
