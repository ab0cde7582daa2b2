"""The fork/gloo harness itself: results, exceptions and hangs come back to the parent."""

from __future__ import annotations

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
