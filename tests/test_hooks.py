"""mixprec.hooks.fp32_accumulate_hook inside torch's own DistributedDataParallel (gloo, bf16 model).

Reference: every rank recomputes every rank's local bf16 gradient (same model and microbatch, one thread:
the same bits), sums them in numpy float32 in rank order, divides by the world size and rounds once to
bf16. With the hook torch DDP must produce exactly that; with torch's default hook (pre-divide in bf16,
gloo's bf16 sum) it does not.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import mixprec.hooks


@pytest.fixture(autouse=True, scope="module")
def _import_dynamo_before_forking() -> None:
    """torch DDP's constructor imports torch._dynamo (about 3 s, 10 s with 4 ranks on 2 cores): import it
    in the parent so that the forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


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
    expected = []
    for i, p in enumerate(model.parameters()):
        acc = np.zeros(p.numel(), dtype=np.float32)
        for grads in per_rank:
            acc = acc + grads[i].float().numpy().reshape(-1)
        expected.append(torch.from_numpy(acc / np.float32(world_size)).to(torch.bfloat16).reshape(p.shape))
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
