"""mixprec.fsdp: FSDP2 (fully_shard, gloo on CPU) reduce-scatters gradients with fp32 accumulation.

Reference: every rank recomputes every rank's local bf16 gradient with a bf16 copy of the model (what
FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes: the same bits), sums them in numpy float32 in
rank order, divides (AVG) or multiplies by FSDP's factor in fp32, and rounds once to bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import mixprec.fsdp
from dist_reference import fp32_rank_order_sum
from mixprec.integrations.fsdp2 import _decode_op


@pytest.fixture(autouse=True, scope="module")
def _import_dynamo_before_forking() -> None:
    """FSDP2 imports torch._dynamo on first use (seconds per rank): import it in the parent instead."""
    import torch._dynamo
    import torch.distributed.fsdp  # noqa: F401


def _fsdp_case(rank: int, world_size: int, custom: bool, divide_factor: float | None) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    # 16 * 33 weights etc.: dim 0 sizes 33 and 8 are not all multiples of 3, so FSDP pads its shards.
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8))
    reference = copy.deepcopy(model).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model[2], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if divide_factor is not None:
        for module in (model[0], model[2]):  # per FSDP module: the root holds no parameters of its own
            module.set_gradient_divide_factor(divide_factor)
    installed = mixprec.fsdp.use_fp32_accumulation(model) if custom else 0
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    model(x).float().square().mean().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]

    per_rank = []
    for r in range(world_size):
        m = copy.deepcopy(reference)
        xr = torch.randn(6, 16, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
        m(xr).float().square().mean().backward()
        per_rank.append([p.grad for p in m.parameters()])
    expected = []
    for i, g in enumerate(grads):
        acc = fp32_rank_order_sum(
            [local[i] for local in per_rank],
            average=divide_factor is None,
            factor=None if divide_factor is None else 1.0 / divide_factor,
        )
        expected.append(acc.to(torch.bfloat16).float().reshape(g.shape))
    return {"installed": installed, "grads": grads, "expected": expected}


@pytest.mark.parametrize("world_size", [3, 4])
def test_fsdp2_reduce_scatter_accumulates_in_fp32(dist_run, world_size: int) -> None:
    results = dist_run(_fsdp_case, world_size, True, None, timeout=120)
    for r in results:
        assert r["installed"] == 3  # the two layers and the root
        for g, e in zip(r["grads"], r["expected"], strict=True):
            assert g.dtype == torch.float32  # FSDP casts the bf16 reduction back to the parameter dtype
            assert torch.equal(g, e)
    # Control: FSDP2's own reduce-scatter (gloo, bf16 sum, then divide) gives other bits.
    default = dist_run(_fsdp_case, world_size, False, None, timeout=120)[0]
    assert any(not torch.equal(g, e) for g, e in zip(default["grads"], default["expected"], strict=True))


def test_gradient_divide_factor_becomes_an_fp32_multiplier(dist_run) -> None:
    """set_gradient_divide_factor(6) at 3 ranks: FSDP passes PREMUL_SUM(1/6); the factor is applied in fp32."""
    for r in dist_run(_fsdp_case, 3, True, 6.0, timeout=120):
        for g, e in zip(r["grads"], r["expected"], strict=True):
            assert torch.equal(g, e)


def test_reduce_ops_are_decoded() -> None:
    assert _decode_op(dist.ReduceOp.SUM) == (False, None)
    assert _decode_op(dist.ReduceOp.AVG) == (True, None)
    assert _decode_op(dist.ReduceOp.PREMUL_SUM(0.25)) == (False, 0.25)
    with pytest.raises(ValueError, match="SUM, AVG and PREMUL_SUM"):
        _decode_op(dist.ReduceOp.MAX)


def test_use_fp32_accumulation_needs_fsdp_modules() -> None:
    with pytest.raises(ValueError, match="no fully_shard-ed submodule"):
        mixprec.fsdp.use_fp32_accumulation(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        mixprec.fsdp.use_fp32_accumulation("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding"):
        mixprec.fsdp.FP32AccumulateReduceScatter(rounding="up")
