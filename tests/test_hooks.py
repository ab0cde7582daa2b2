"""mixprec.hooks.fp32_accumulate_hook inside torch's own DistributedDataParallel (gloo, bf16 model).

Reference: every rank recomputes every rank's local bf16 gradient (same model and microbatch, one thread:
the same bits), sums them in numpy float32 in rank order, divides by the world size and rounds once to
bf16. With the hook torch DDP must produce exactly that; with torch's default hook (pre-divide in bf16,
gloo's bf16 sum) it does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import mixprec.hooks
from dist_reference import fp32_rank_order_sum


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 33 * 40 + 40 + 40 * 7 + 7 = 1647 gradient elements: not a multiple of 3, so the hook pads.
    return torch.nn.Sequential(torch.nn.Linear(33, 40), torch.nn.Tanh(), torch.nn.Linear(40, 7)).to(torch.bfloat16)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 33, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)


def _local_grads(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    m = copy.deepcopy(model)
    m(_batch(rank)).float().square().mean().backward()
    return [p.grad for p in m.parameters()]


def _torch_ddp_case(rank: int, world_size: int, use_hook: bool) -> dict[str, object]:
    model = _model()
    reference_model = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    if use_hook:
        ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)
    ddp(_batch(rank)).float().square().mean().backward()
    per_rank = [_local_grads(reference_model, r) for r in range(world_size)]
    expected = [
        fp32_rank_order_sum([grads[i] for grads in per_rank], average=True).to(torch.bfloat16)
        for i in range(len(per_rank[0]))
    ]
    return {"grads": [p.grad.clone() for p in model.parameters()], "expected": expected}


@pytest.mark.parametrize("world_size", [3, 4])
def test_hook_makes_torch_ddp_reduce_in_fp32(dist_run, world_size: int) -> None:
    for r in dist_run(_torch_ddp_case, world_size, True, timeout=120):
        for g, e in zip(r["grads"], r["expected"], strict=True):
            assert g.dtype == torch.bfloat16
            assert torch.equal(g, e)
    # Control: torch's default reduction gives other bits on the same data.
    default = dist_run(_torch_ddp_case, world_size, False, timeout=120)[0]
    assert any(not torch.equal(g, e) for g, e in zip(default["grads"], default["expected"], strict=True))


def _bad_state(rank: int, world_size: int) -> str:
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    ddp.register_comm_hook(state="not a group", hook=mixprec.hooks.fp32_accumulate_hook)
    try:
        ddp(torch.randn(1, 2)).sum().backward()
    except Exception as exc:  # torch DDP may wrap the hook's error
        return str(exc)
    return "no error"


def test_bad_state_is_refused(dist_run) -> None:
    for message in dist_run(_bad_state, 2, timeout=60):
        assert "state must be a torch.distributed ProcessGroup or None" in message


def _async_case(rank: int, world_size: int) -> dict[str, object]:
    """At step 1, rank 1 starts its backward only after rank 0 has looked at the future its first hook call of
    that step returned: a hook that reduced synchronously would block there forever (the test would time
    out); an asynchronous one has returned a future that cannot be complete yet. (Not at step 0: the first
    call sets up the hook's all-gather group, which every rank must join.)"""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    model = _model()
    reference_model = copy.deepcopy(model)
    # find_unused_parameters keeps torch's small first-iteration buckets: two buckets per step here (327 and
    # 1320 elements; 327 is padded at 4 ranks), so all-to-alls and all-gathers of two buckets interleave.
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002, find_unused_parameters=True)
    done_at_return: list[bool] = []

    # No annotations: with postponed evaluation (this file) torch DDP would see strings and refuse them.
    def observed_hook(state, bucket):
        fut = mixprec.hooks.fp32_accumulate_hook(state, bucket)
        done_at_return.append(fut.done())
        if rank == 0 and len(done_at_return) == 3:
            store.set("hook_test_first_future_checked", "1")
        return fut

    ddp.register_comm_hook(state=None, hook=observed_hook)
    grads, expected = [], []
    for step in range(4):  # later steps reuse the pooled buffers
        if rank == 1 and step == 1:
            store.wait(["hook_test_first_future_checked"])
        model.zero_grad(set_to_none=True)
        ddp(_batch(rank + 10 * step)).float().square().mean().backward()
        per_rank = [_local_grads(reference_model, r + 10 * step) for r in range(world_size)]
        grads.append([p.grad.clone() for p in model.parameters()])
        expected.append(
            [
                fp32_rank_order_sum([g[i] for g in per_rank], average=True).to(torch.bfloat16)
                for i in range(len(per_rank[0]))
            ]
        )
        with torch.no_grad():  # the same update everywhere, so that step 1's reference model is the same
            for p, q, g in zip(model.parameters(), reference_model.parameters(), grads[-1], strict=True):
                p.sub_(g)
                q.sub_(g)
    return {"done_at_return": done_at_return, "grads": grads, "expected": expected}


def test_hook_is_asynchronous_and_exact_over_steps(dist_run) -> None:
    results = dist_run(_async_case, 4, timeout=120)
    assert results[0]["done_at_return"][2] is False
    for r in results:
        assert len(r["done_at_return"]) == 8  # two buckets per step, four steps
        for grads, expected in zip(r["grads"], r["expected"], strict=True):
            for g, e in zip(grads, expected, strict=True):
                assert torch.equal(g, e)


def _after_a_subgroup_case(rank: int, world_size: int) -> dict[str, object]:
    # Rank 2 is not in this subgroup, so ranks hold different numbers of process groups: the hook's own extra
    # group for the world must still rendezvous (a hashed, count-dependent name hung here).
    dist.new_group(ranks=[0, 1])
    return _torch_ddp_case(rank, world_size, True)


def test_hook_works_when_ranks_hold_different_numbers_of_groups(dist_run) -> None:
    for r in dist_run(_after_a_subgroup_case, 3, timeout=60):
        for g, e in zip(r["grads"], r["expected"], strict=True):
            assert torch.equal(g, e)


def _reinit(path: str, rank: int, world_size: int, seconds: float) -> None:
    """Replace the harness's default group by one with a short timeout (the harness uses its deadline as the
    group timeout, so a failure after that timeout would race the harness's own deadline)."""
    from datetime import timedelta

    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world_size, timeout=timedelta(seconds=seconds)
    )


def _hook_group_timeout_case(rank: int, world_size: int, path: str) -> float:
    from mixprec.comm.groups import group_timeout
    from mixprec.integrations.ddp_fp32 import _runner

    _reinit(path, rank, world_size, 7.0)
    _torch_ddp_case(rank, world_size, True)
    timeout = group_timeout(_runner(None, None).group)
    assert timeout is not None
    return timeout.total_seconds()


def test_the_hooks_extra_group_inherits_the_default_groups_timeout(dist_run, tmp_path) -> None:
    """torch's new_group falls back to a 30-minute timeout; the hook's all-gather group must take the 7 s
    given to init_process_group."""
    assert dist_run(_hook_group_timeout_case, 2, str(tmp_path / "store"), timeout=60) == [7.0, 7.0]


def _dead_peer_case(rank: int, world_size: int, path: str) -> dict[str, object]:
    import time

    _reinit(path, rank, world_size, 3.0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)
    if rank == 1:
        return {"left": True}  # gone before the hook's first call
    start = time.monotonic()
    try:
        ddp(torch.randn(3, 4)).sum().backward()
        error = "no error"
    except Exception as exc:  # torch DDP may wrap the hook's error
        error = f"{type(exc).__name__}: {exc}"
    return {"seconds": time.monotonic() - start, "error": error}


def test_a_peer_gone_before_the_first_hook_call_fails_within_the_timeout(dist_run, tmp_path) -> None:
    """Rank 1 leaves after building torch DDP; rank 0's first hook call must fail by the 3 s group timeout (it
    waited for torch's 30-minute default, so this harness's 25 s deadline killed it). The cause is asserted, not
    the seconds: a timeout ended the wait, and one shorter than the harness's deadline (which raises otherwise);
    that the hook's group gets the default group's timeout is checked exactly above."""
    result = dist_run(_dead_peer_case, 2, str(tmp_path / "store"), timeout=25)[0]
    assert "timeout" in result["error"].lower(), result


def _fp64_case(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(4, 2).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)
    try:
        ddp(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    except Exception as exc:  # torch DDP may wrap the hook's error
        return str(exc)
    return "no error"


def test_fp64_gradients_are_refused_not_summed_in_fp32(dist_run) -> None:
    for message in dist_run(_fp64_case, 2, timeout=60):
        assert "fp32_accumulate_hook sums in fp32" in message and "torch.float64" in message, message
