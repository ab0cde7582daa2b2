"""Every registered reducer against real gloo runs: ``model`` gives each rank's bits after ``all_reduce``.

The test walks ``registered_reducers()``: a new reducer is covered as soon as it registers (with its default
options; ``OPTIONS`` below adds the variants whose state a model must carry: error-feedback residuals and
stochastic streams). Each real run reduces three steps of two bucket keys on P = 2, 3, 4 ranks and on two
nodes of two, bf16 and fp32 buckets, the middle step with a NaN on one rank (the residuals' reset), the last
one summing instead of averaging; the model of a fresh reducer of the same name and options, fed the same
buckets in the same order, must give the same bits at every call, or refuse the same configurations.

The consumers that adapt reducers to torch are checked against them too: torch DDP with each mixprec comm hook
gives mixprec's wrapper's bits, and FSDP2's reduce-scatter gives each rank its part of the model.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import mixprec  # noqa: F401  (registers the compressed reducers)
from mixprec.comm import make_reducer, rank_generator, registered_reducers
from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.comm.reducer import bucket_multiple
from mixprec.comm.topology import Topology
from mixprec.testing import run_distributed

DTYPES = (torch.bfloat16, torch.float32)
# (step, key) in call order: two buckets per step; step 1 holds a NaN on rank 0; the last step sums (average=False).
CALLS = ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1))
NAN_STEP = 1
SUM_STEP = 2
# Options beyond the defaults for the reducers whose model carries state; any other name gets [{}].
OPTIONS: dict[str, list[dict]] = {
    "native": [{}, {"algorithm": "ring"}],
    "fp32_accumulate": [{}, {"rounding": "stochastic", "seed": 11}],
    "fp32_accumulate_hierarchical": [{}, {"inter_node_dtype": torch.float32}],
    "auto": [{"link_gbps": 1e6}, {"link_gbps": 1e-6, "error_feedback": True}],  # full precision; uint8
}
for _name in ("uint8", "uint8_hierarchical", "fp8", "fp8_hierarchical"):
    OPTIONS[_name] = [{}, {"error_feedback": True, "rounding": "stochastic", "seed": 5}]
# the block-scaled wires fold error feedback into their encode (BlockScaledWire.encode_feedback_rows), where a
# flagged block keeps its residual: the NaN step, then the clean one, checks that the reset makes that moot
for _name in ("mxfp8", "mxfp8_hierarchical", "nvfp4", "nvfp4_hierarchical"):
    OPTIONS[_name] = [{}, {"error_feedback": True}, {"error_feedback": True, "rounding": "stochastic", "seed": 7}]
# (P, LOCAL_WORLD_SIZE): the hierarchical reducers take their topology from it (flat ones ignore it).
GROUPS = ((2, 1), (3, 3), (4, 4), (4, 2))


def _cases() -> list[tuple[str, int, dict]]:
    return [(name, i, opts) for name in registered_reducers() for i, opts in enumerate(OPTIONS.get(name, [{}]))]


def _options(c: int, opts: dict, dtype: torch.dtype) -> dict:
    """``opts`` with a seed of its own per case and dtype: a process shares one stream per seed
    (mixprec.comm.rank_generator), so two real reducers of one seed would draw from the same stream."""
    if "seed" not in opts:
        return opts
    return {**opts, "seed": opts["seed"] + 100 * c + 10 * DTYPES.index(dtype)}


def _numel(world: int) -> int:
    multiple = bucket_multiple(world)
    return multiple * -(-5000 // multiple)  # several 2048-element chunks per part at P = 2


def _bucket(rank: int, step: int, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * key + rank)
    # Magnitudes spread over ~2**8, so that the order of additions shows in the low bits.
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-4, 4, (numel,), generator=g).float())
    x[-7:] = 0.0  # padding
    if step == NAN_STEP and rank == 0:
        x[5] = float("nan")
    return x.to(dtype)


def _real(rank: int, world: int, local: int, cases: list[tuple[str, int, dict]]) -> dict:
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    numel = _numel(world)
    out: dict = {}
    for c, (name, i, opts) in enumerate(cases):
        for dtype in DTYPES:
            try:
                reducer = make_reducer(name, **_options(c, opts, dtype))
                results = []
                for step, key in CALLS:
                    bucket = _bucket(rank, step, key, numel, dtype)
                    reducer.all_reduce(bucket, None, average=step != SUM_STEP, key=key).wait()
                    results.append(bucket)
                out[name, i, dtype] = results
            except ValueError as exc:  # refused before anything was sent, on every rank alike
                out[name, i, dtype] = f"refused: {exc}"
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN payloads aside (both NaN at the same elements)."""
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@pytest.mark.slow
@pytest.mark.parametrize(("world", "local"), GROUPS)
def test_every_registered_reducer_models_its_gloo_all_reduce(monkeypatch, world: int, local: int) -> None:
    cases = _cases()
    assert {"native", "fp32_accumulate", "uint8", "fp8", "auto"} <= {name for name, _, _ in cases}
    per_rank = run_distributed(_real, world, local, cases, timeout=300)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    numel = _numel(world)
    refused = {key for key, value in per_rank[0].items() if isinstance(value, str)}
    assert refused == {("fp32_accumulate", 1, torch.float32)}, refused  # stochastic rounding to fp32: nothing to round
    for case, (name, i, opts) in enumerate(cases):
        for dtype in DTYPES:
            real = [r[name, i, dtype] for r in per_rank]
            options = _options(case, opts, dtype)
            where = (name, options, dtype, world, local)
            if isinstance(real[0], str):  # the real reducer refused: so must the model
                with pytest.raises(ValueError):
                    reducer = make_reducer(name, **options)
                    for step, key in CALLS:
                        rows = torch.stack([_bucket(r, step, key, numel, dtype) for r in range(world)])
                        reducer.model(rows, average=True, key=key)
                continue
            reducer = make_reducer(name, **options)
            for c, (step, key) in enumerate(CALLS):
                rows = torch.stack([_bucket(r, step, key, numel, dtype) for r in range(world)])
                before = rows.clone()
                model = reducer.model(rows, average=step != SUM_STEP, key=key)
                assert model.shape == (world, numel) and model.dtype == dtype, where
                assert torch.equal(rows.view(torch.uint8), before.view(torch.uint8)), where  # rows not modified
                for r in range(world):
                    assert _same_bits(model[r], real[r][c]), (*where, step, key, r)
                if step == NAN_STEP and key == 0:
                    assert torch.isnan(model[0, 5]), where  # NaN/Inf never becomes finite


def test_a_model_fixes_its_group_size_and_checks_its_rows() -> None:
    reducer = make_reducer("uint8", error_feedback=True)
    rows = torch.zeros(2, 256)
    reducer.model(rows, average=True, key=0)
    with pytest.raises(ValueError, match="models a group of 2 ranks"):
        reducer.model(torch.zeros(4, 256), average=True, key=0)
    with pytest.raises(ValueError, match="multiple of lcm"):
        make_reducer("native").model(torch.zeros(2, 100), average=True)
    with pytest.raises(ValueError, match="key must be an int >= 0"):
        make_reducer("native").model(rows, average=True, key=-1)
    with pytest.raises(TypeError, match="rows"):
        make_reducer("native").model(torch.zeros(2, 256, dtype=torch.int32), average=True)
    with pytest.raises(ValueError, match="link_gbps"):
        make_reducer("auto").model(rows, average=True)
    hierarchical = make_reducer("fp32_accumulate_hierarchical", topology=Topology(2, 1), rounding="stochastic")
    with pytest.raises(ValueError, match="stochastic rounding is not modelled"):
        hierarchical.model(rows.bfloat16(), average=True)
    with pytest.raises(ValueError, match="topology 2 x 1"):
        make_reducer("uint8_hierarchical", topology=Topology(2, 1)).model(torch.zeros(4, 128), average=True)


# ---------------------------------------------------------------------------- the torch DDP hooks
def _hooked(rank: int, world: int, dtype: torch.dtype) -> dict:
    """Three SGD steps of one small model under torch DDP with each mixprec hook, and under mixprec's wrapper
    with the matching reducer; every step's gradients of both."""
    from mixprec.hooks import CompressedHookState, compressed_hook, fp32_accumulate_hook
    from mixprec.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    uint8 = {"chunk_size": 64, "error_feedback": True, "rounding": "stochastic", "seed": 7}
    fp8 = {"chunk_size": 64, "error_feedback": True, "wire": "e4m3"}
    setups = {
        "native": (None, None),  # torch DDP's own hook: pre-divide, then the backend's all-reduce
        "fp32_accumulate": (fp32_accumulate_hook, lambda: None),
        "uint8": (compressed_hook, lambda: CompressedHookState(**uint8)),
        "fp8": (compressed_hook, lambda: CompressedHookState(**fp8)),
    }
    options = {"native": {}, "fp32_accumulate": {}, "uint8": uint8, "fp8": fp8}
    out: dict = {}
    for name, (hook, state) in setups.items():
        grads: dict[str, list] = {"torch": [], "mixprec": []}
        for consumer in grads:
            opts = options[name]
            if "seed" in opts:  # a process shares one stream per seed: start it afresh for each consumer
                rank_generator(opts["seed"]).manual_seed(opts["seed"] + rank)
            torch.manual_seed(0)
            # One parameter of 768 elements, a multiple of lcm(P, 128) at P = 2: one bucket, no padding, the same
            # layout in both wrappers (torch DDP keeps a bucket's parameters in model order, mixprec reversed), so
            # the same chunks.
            net = torch.nn.Sequential(torch.nn.Linear(6, 128, bias=False), torch.nn.Tanh()).to(dtype)
            if consumer == "torch":
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
                if hook is not None:
                    wrapped.register_comm_hook(state(), hook)
            else:
                wrapped = DistributedDataParallel(net, reduce=name, reduce_options=opts)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(8, 6, generator=g).to(dtype)
                y = torch.randn(8, 128, generator=g).to(dtype)
                opt.zero_grad()
                torch.nn.functional.mse_loss(wrapped(x).float(), y.float()).backward()
                grads[consumer].append([p.grad.clone() for p in net.parameters()])
                opt.step()
        out[name] = grads
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_ddp_hooks_give_the_wrappers_bits(dtype: torch.dtype) -> None:
    world = 2
    results = run_distributed(_hooked, world, dtype, timeout=300)
    for name, grads in results[0].items():
        for step, (hooked, wrapped) in enumerate(zip(grads["torch"], grads["mixprec"], strict=True)):
            for a, b in zip(hooked, wrapped, strict=True):
                assert _same_bits(a, b), (name, dtype, step)
        for r in range(1, world):  # and every rank holds them
            assert all(
                _same_bits(a, b)
                for s in range(3)
                for a, b in zip(results[r][name]["torch"][s], grads["torch"][s], strict=True)
            ), (name, r)


def test_stochastic_model_rounds_in_the_real_ranks_blocks() -> None:
    """Shards longer than one block of sum_shards_into (2**16): the model's draws are still the real owner's,
    whose call is sum_shards_into(its shard, the P pieces, generator=its stream)."""
    world, numel = 2, 2 * 70_016
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(world, numel, generator=g) * 1e-2).bfloat16()
    model = make_reducer("fp32_accumulate", rounding="stochastic", seed=21).model(rows, average=True)[0]
    shard = numel // world
    for p in range(world):
        own = torch.empty(shard, dtype=torch.bfloat16)
        stream = torch.Generator().manual_seed(21 + p)
        part = slice(p * shard, (p + 1) * shard)
        sum_shards_into(own, rows[:, part].contiguous(), average=True, rounding="stochastic", generator=stream)
        assert torch.equal(model[part], own), p


def _fsdp_reduce_scatter(rank: int, world: int, rounding: str) -> list[torch.Tensor]:
    from mixprec.fsdp import FP32AccumulateReduceScatter

    torch.set_num_threads(1)
    comm = FP32AccumulateReduceScatter(rounding=rounding)
    shards = []
    for step, key in CALLS[:2]:
        bucket = _bucket(rank, step, key, _numel(world), torch.bfloat16)
        shard = torch.empty(bucket.numel() // world, dtype=torch.bfloat16)
        comm(shard, bucket, dist.group.WORLD, dist.ReduceOp.AVG)
        shards.append(shard)
    return shards


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fsdp2_reduce_scatter_gives_each_rank_its_part_of_the_model(rounding: str) -> None:
    """FSDP2's reduce-scatter adapter runs an FP32AccumulateReducer: rank r's shard is part r of what the
    reducer's model says every rank holds after all_reduce (the same sums, the same owner's rounding and stream)."""
    world = 3
    per_rank = run_distributed(_fsdp_reduce_scatter, world, rounding, timeout=300)
    reducer = make_reducer("fp32_accumulate", rounding=rounding)
    numel = _numel(world)
    shard = numel // world
    for c, (step, key) in enumerate(CALLS[:2]):
        rows = torch.stack([_bucket(r, step, key, numel, torch.bfloat16) for r in range(world)])
        model = reducer.model(rows, average=True, key=key)
        for r in range(world):
            assert _same_bits(per_rank[r][c], model[r, r * shard : (r + 1) * shard]), (rounding, step, r)


def test_a_stateless_reducer_models_any_group_size() -> None:
    reducer = make_reducer("fp32_accumulate")
    for world in (2, 3, 8):
        rows = torch.ones(world, bucket_multiple(world), dtype=torch.bfloat16)
        assert torch.equal(reducer.model(rows, average=True)[0], rows[0])
