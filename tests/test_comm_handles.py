"""The one handle type of the async collectives: state changes only after the finishing work returns."""

from __future__ import annotations

import pytest
import torch

from mixprec.comm import PendingReduction
from mixprec.comm.handles import wait_all


def test_a_failed_wait_raises_again_on_every_later_wait() -> None:
    calls = []

    def finish() -> None:
        calls.append(1)
        raise RuntimeError("boom")

    handle = PendingReduction(finish)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="boom"):
            handle.wait()
    assert len(calls) == 1  # the work ran once; its error is kept
    assert handle.failed() and not handle.is_completed()


def test_a_successful_wait_runs_once() -> None:
    calls = []
    handle = PendingReduction(lambda: calls.append(1))
    assert not handle.is_completed()
    handle.wait()
    handle.wait()
    assert calls == [1] and handle.is_completed() and not handle.failed()
    assert PendingReduction.completed().is_completed()


def test_wait_all_waits_for_every_handle_then_raises_the_first_error() -> None:
    done = []

    def failing(tag: str):
        def finish() -> None:
            done.append(tag)
            raise ValueError(tag)

        return finish

    handles = [
        PendingReduction(lambda: done.append("a")),
        PendingReduction(failing("b")),
        None,
        PendingReduction(failing("c")),
        PendingReduction(lambda: done.append("d")),
    ]
    with pytest.raises(ValueError, match="b"):
        wait_all(handles)
    assert done == ["a", "b", "c", "d"]


def _pool_case(rank: int, world_size: int) -> dict[str, object]:
    from mixprec.parallel import reducers as reducers_module

    reducer = reducers_module.FP32AccumulateReducer(max_in_flight=2)
    real = reducers_module.all_reduce_fp32_accumulate

    def failing_all_reduce(*args, **kwargs):
        pending = real(*args, **kwargs)

        def finish() -> None:
            pending.wait()
            raise RuntimeError("injected")

        return PendingReduction(finish)

    reducers_module.all_reduce_fp32_accumulate = failing_all_reduce
    try:
        bucket = torch.full((256,), float(rank + 1))
        handle = reducer.all_reduce(bucket, None, average=False, key=0)
        errors = []
        for _ in range(2):
            try:
                handle.wait()
            except RuntimeError as exc:
                errors.append(str(exc))
    finally:
        reducers_module.all_reduce_fp32_accumulate = real
    out = {"errors": errors, "free_after_failure": len(reducer._free), "pending": len(reducer._pending)}
    # The reducer keeps working; a successful reduction returns its buffer to the pool.
    bucket = torch.full((256,), float(rank + 1))
    reducer.all_reduce(bucket, None, average=False, key=0).wait()
    out["sum_ok"] = bool((bucket == sum(range(1, world_size + 1))).all())
    out["free_after_success"] = len(reducer._free)
    return out


def test_a_failed_pooled_reduction_never_returns_its_buffer(dist_run) -> None:
    """The receive buffer of a reduction whose wait failed may still be written by the backend: it must not
    go back to the pool (it is dropped), and the handle leaves the in-flight queue."""
    for r in dist_run(_pool_case, 2, timeout=60):
        assert r["errors"] == ["injected", "injected"]
        assert r["free_after_failure"] == 0
        assert r["pending"] == 0
        assert r["sum_ok"]
        assert r["free_after_success"] == 1
