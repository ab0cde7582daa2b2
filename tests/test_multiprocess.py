"""The fork/gloo harness itself: results, exceptions and hangs come back to the parent; the ranks die with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mixprec.testing import RankFailedError, run_distributed


def _sum_ranks(rank: int, world_size: int, offset: float) -> tuple[int, float, int]:
    t = torch.tensor([float(rank) + offset])
    dist.all_reduce(t)
    return rank, t.item(), torch.get_num_threads()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    out = run_distributed(_sum_ranks, world_size, 0.5, timeout=60)
    expected = sum(range(world_size)) + 0.5 * world_size
    assert [r for r, _, _ in out] == list(range(world_size))
    assert all(total == expected for _, total, _ in out)
    assert all(threads == 1 for _, _, threads in out)


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_exception_carries_rank_and_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert 1 in info.value.failures
    assert "boom from rank one" in info.value.failures[1]
    assert "ValueError" in str(info.value)


def _hang_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def test_hung_rank_is_killed_and_reported() -> None:
    # The call returns (with the hung rank named) instead of waiting for the 60 s sleep; no wall-clock assertion.
    with pytest.raises(RankFailedError) as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=3)
    assert "still running" in info.value.failures[0]
    assert set(info.value.failures) == {0}


def test_tensors_survive_the_trip() -> None:
    out = run_distributed(lambda rank, ws: torch.full((3,), rank, dtype=torch.bfloat16), 2, timeout=60)
    assert out[1].dtype == torch.bfloat16 and out[1].tolist() == [1.0, 1.0, 1.0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_sum_ranks, 0, 0.0)
    with pytest.raises(TypeError, match="world_size"):
        run_distributed(_sum_ranks, True, 0.0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_sum_ranks, 2, 0.0, timeout=-1)


def _killed_on_rank_one(rank: int, world_size: int) -> float:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that died
    return t.item()


def test_the_rank_that_died_is_named_not_its_victims() -> None:
    """The summary names the rank killed by a signal, not rank 0 whose all_reduce failed because of it."""
    with pytest.raises(RankFailedError) as info:
        run_distributed(_killed_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert info.value.summary.startswith("rank 1 was killed by signal 9; the other ranks were stopped (rank 0:")
    assert "exited with code -9" in info.value.failures[1]


def _how_a_rank_is_set_up(rank: int, world_size: int) -> tuple[int, object, object]:
    import ctypes

    pdeathsig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return pdeathsig.value, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_are_set_up_to_die_with_the_caller() -> None:
    """SIGKILL when the caller dies; SIGTERM ends a rank at once; SIGINT (Ctrl-C reaches the whole process group)
    is left to the caller, which stops the ranks."""
    for pdeathsig, on_term, on_int in run_distributed(_how_a_rank_is_set_up, 2, timeout=60):
        assert pdeathsig == signal.SIGKILL and on_term == signal.SIG_DFL and on_int == signal.SIG_IGN


_SLEEPING_RANKS = """
import time
from mixprec.testing import run_distributed
run_distributed(lambda rank, world_size: time.sleep(600), 2, timeout=600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by its new parent
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_when_the_caller_is_killed(tmp_path) -> None:
    """kill -9 of a process inside run_distributed (a test runner killed by its own timeout, say): its ranks,
    sleeping for 10 minutes, go with it instead of running on as orphans."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPING_RANKS], env=env, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
                ranks = [int(c) for c in fh.read().split()]
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while not all(_gone(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(r) for r in ranks), "the ranks outlived their killed caller"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
