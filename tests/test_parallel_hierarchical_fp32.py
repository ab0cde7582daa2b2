"""The ``fp32_accumulate_hierarchical`` reducer: the DDP wrapper with 50+ buckets against the two-stage
reference, identical bits on every rank, and a pooled receive area whose peak stays under two buckets."""

from __future__ import annotations

import pytest
import torch

from mixprec.comm import make_reducer, wait_all
from mixprec.comm.hierarchical_fp32 import segment_length
from mixprec.comm.memory import measure_peak_allocated
from mixprec.comm.topology import Topology
from mixprec.parallel import DistributedDataParallel, FP32AccumulateReducer
from test_comm_hierarchical_fp32 import rank_input, reference

BUCKETS = 52


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 52 linear layers of 16x16 + bias: one bucket each at bucket_size=272.
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(BUCKETS)]).to(torch.bfloat16)


def _ddp_case(rank: int, world: int) -> dict[str, object]:
    model = _model()
    ddp = DistributedDataParallel(
        model, bucket_size=272, reduce="fp32_accumulate_hierarchical", reduce_options={"topology": Topology(2, 2)}
    )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
    ddp(x).float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    # The same local gradients without the wrapper, to rebuild every rank's input of the reference.
    local = _model()
    local(x).float().square().mean().backward()
    local_grads = [p.grad.clone() for p in local.parameters()]
    return {"grads": grads, "local": local_grads, "buckets": ddp.grad_buffer.num_buckets}


def test_ddp_wrapper_reduces_every_bucket_like_the_reference(dist_run) -> None:
    results = dist_run(_ddp_case, 4, timeout=120)
    assert results[0]["buckets"] >= 50
    for r in results[1:]:  # identical bits on every rank
        assert all(torch.equal(a, b) for a, b in zip(r["grads"], results[0]["grads"], strict=True))
    # Each parameter is averaged over 4 ranks: two ranks per node, two nodes. Nearest rounding, so the
    # segment length does not change any bit; check the parameters of the first layer.
    for index in (0, 1):
        inputs = [r["local"][index].reshape(-1) for r in results]
        numel = inputs[0].numel()
        padded = 4 * -(-numel // 4)
        inputs = [torch.cat([x, x.new_zeros(padded - numel)]) for x in inputs]
        ref = reference(
            inputs, 2, 2, padded // 4, average=True, rounding="nearest", out_dtype=torch.bfloat16,
            inter_dtype=torch.bfloat16, seeds=None,
        )  # fmt: skip
        # reference() returns reduce-scatter shards in global rank order; concatenated, the whole tensor.
        expected = torch.cat(ref)[:numel].view_as(results[0]["grads"][index])
        # Within a bucket the parameter sits at an offset, so compare the values through their own
        # element-wise oracle: the two-stage sum does not depend on where an element sits.
        assert torch.equal(results[0]["grads"][index], expected)


@pytest.fixture
def profiler_imported() -> None:
    """Import the profiler once in the parent, before the ranks fork."""
    measure_peak_allocated(torch.empty, 1)


def _memory_case(rank: int, world: int, bucket: int) -> dict[str, int]:
    topo = Topology(2, world // 2)
    hier = make_reducer("fp32_accumulate_hierarchical", topology=topo)
    flat_per_bucket = FP32AccumulateReducer(max_in_flight=BUCKETS)  # one receive buffer per bucket in flight
    buckets = [rank_input(rank + k, bucket, torch.bfloat16) for k in range(BUCKETS)]

    def backward_like(reducer) -> None:
        # As the wrapper does: every bucket started in order, then all waited for at the end of backward.
        wait_all([reducer.all_reduce(b, None, average=True, key=k) for k, b in enumerate(buckets)])

    # A first pass: the pool is allocated in it, so the peak counts it (and gloo's late release of
    # collectives' tensors would show here as growth with the number of buckets).
    _, hier_first = measure_peak_allocated(backward_like, hier)
    _, hier_peak = measure_peak_allocated(backward_like, hier)
    _, flat_peak = measure_peak_allocated(backward_like, flat_per_bucket)
    return {"first": hier_first, "hier": hier_peak, "flat": flat_peak, "pool": hier._pool.numel() * 2}


def test_pooled_area_keeps_peak_memory_under_two_buckets(dist_run, profiler_imported) -> None:
    bucket = 4 * 2048
    results = dist_run(_memory_case, 4, bucket, timeout=120)
    bucket_bytes = bucket * 2
    for r in results:
        assert r["pool"] == bucket_bytes  # one bucket's worth, split between the two reductions in flight
        assert r["first"] <= 2 * bucket_bytes, r  # the pool and everything else of the first pass
        assert r["pool"] + r["hier"] <= 2 * bucket_bytes, r  # a later pass, with the pool held
        # The per-bucket scheme (Megatron-LM PR #4940) holds a buffer for every bucket in flight.
        assert r["flat"] >= BUCKETS * bucket_bytes, r


def test_reducer_options_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="inter_node_dtype"):
        FP32AccumulateReducer(inter_node_dtype=torch.float32)
    with pytest.raises(ValueError, match="inter_node_dtype"):
        FP32AccumulateReducer(topology=Topology(2, 2), inter_node_dtype=torch.float16)
    with pytest.raises(TypeError, match="topology"):
        FP32AccumulateReducer(topology=(2, 2))
    with pytest.raises(ValueError, match="budget"):
        FP32AccumulateReducer(budget=1024)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        make_reducer("fp32_accumulate_hierarchical")
    assert segment_length(2048, 4, 4096) == 256


def _zero_case(rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(
        model,
        bucket_size=300,
        grad_dtype=torch.bfloat16,
        sharded_optimizer=True,
        reduce="fp32_accumulate",
        reduce_options={"topology": Topology(2, 2), "inter_node_dtype": torch.float32},
    )
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_sharded_optimizer_steps_with_the_hierarchical_reducer(dist_run) -> None:
    # reduce="fp32_accumulate" with a topology in reduce_options is the same reducer as the named one;
    # fp32 shards, fp32 across nodes: the parameters stay identical on every rank.
    results = dist_run(_zero_case, 4, timeout=120)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, results[0], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], _initial(), strict=True))


def _initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return [p.detach().clone() for p in model.parameters()]
