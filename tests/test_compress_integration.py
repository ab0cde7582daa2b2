"""uint8 compression wired into training: the "uint8"/"uint8_hierarchical" reducers (registry, mixprec's
DistributedDataParallel, reduce-scatter for the sharded optimizer, state_dict, bounded in-flight buffers) and
the torch DDP comm hook.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

import mixprec.hooks
from compress_reference import (
    call_randoms,
    ref_flat_all_reduce,
    ref_flat_reduce,
    ref_hierarchical_all_reduce,
    ref_hierarchical_reduce_scatter,
)
from mixprec.comm import Topology, make_reducer
from mixprec.compress import CompressedReducer, CompressionOptions, ErrorFeedback
from mixprec.integrations.ddp_uint8 import compressed_hook
from mixprec.parallel import DistributedDataParallel

CHUNK = 256
BUCKET = 3 * 1024  # a multiple of lcm(world_size, 128) for 2, 3 and 4 ranks


def _bucket(rank: int, key: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * key + rank)
    return torch.randn(BUCKET, generator=g) * (1 + rank)


def _worker_reducer(rank: int, world: int, name: str) -> dict:
    if name == "uint8_hierarchical":
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun would set: 2 ranks per node
    reducer = make_reducer(name, chunk_size=CHUNK, max_in_flight=2)
    buckets = [_bucket(rank, k) for k in range(3)]
    handles = [reducer.all_reduce(b, None, average=True, key=k) for k, b in enumerate(buckets)]  # 3 > max_in_flight
    for h in handles:
        h.wait()
        h.wait()  # idempotent
    shard = torch.empty(BUCKET // world)
    reducer.reduce_scatter(shard, _bucket(rank, 7), None, average=True, key=7).wait()
    return {"buckets": buckets, "shard": shard, "stats": reducer.last_stats, "repr": repr(reducer)}


@pytest.mark.parametrize("world, name", [(3, "uint8"), (4, "uint8_hierarchical")])
def test_registered_reducers_match_the_reference(dist_run, world: int, name: str) -> None:
    res = dist_run(_worker_reducer, world, name, timeout=120)
    for k in range(3):
        inputs = [_bucket(r, k).numpy() for r in range(world)]
        if name == "uint8":
            expected = ref_flat_all_reduce(inputs, CHUNK)[0][0]
        else:
            expected = ref_hierarchical_all_reduce(inputs, CHUNK, 2, 2)[0]
        for r in range(world):
            np.testing.assert_array_equal(res[r]["buckets"][k].numpy(), expected)
    inputs = [_bucket(r, 7).numpy() for r in range(world)]
    if name == "uint8":
        shards = ref_flat_reduce(inputs, CHUNK, divisor=world)
    else:
        shards = ref_hierarchical_reduce_scatter(inputs, CHUNK, 2, 2)
    for r in range(world):
        np.testing.assert_array_equal(res[r]["shard"].numpy(), shards[r])
    assert sorted(res[0]["stats"]) == [0, 1, 2, 7]
    assert ("hierarchical" in res[0]["repr"]) == (name == "uint8_hierarchical")


def _worker_state(rank: int, world: int) -> dict:
    def run(reducer: CompressedReducer, steps: range) -> list[torch.Tensor]:
        outs = []
        for t in steps:
            b = _bucket(rank, 0, step=t)
            reducer.all_reduce(b, None, average=True, key=0).wait()
            outs.append(b)
        return outs

    opts = {"chunk_size": CHUNK, "error_feedback": True, "rounding": "stochastic"}
    first = CompressedReducer(**opts)
    run(first, range(2))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    straight = run(first, range(2, 4))
    buf.seek(0)
    # Same seed, same process: both reducers draw from one rank_generator stream; loading rewinds it.
    resumed = CompressedReducer(**opts)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    errors = []
    for bad_state, reducer in [
        ({"rounding": "nearest"}, CompressedReducer(**opts)),
        ({"error_feedback": {0: {}}}, CompressedReducer(chunk_size=CHUNK)),
        ({"error_feedback": {0: {"worker": torch.zeros(3, dtype=torch.float64)}}}, CompressedReducer(**opts)),
        ({"generator_state": [1, 2]}, CompressedReducer(**opts)),
        ({"generator_state": torch.zeros(4)}, CompressedReducer(**opts)),
        ({"check_finite": "raise"}, CompressedReducer(**opts)),
        ({"topology": [2, 1]}, CompressedReducer(**opts)),
        ({"error_feedback": [0]}, CompressedReducer(**opts)),
        (
            {"generator_state": torch.zeros(8, dtype=torch.uint8), "generator_device": "cuda:0"},
            CompressedReducer(**opts),
        ),
        ({"generator_state": torch.zeros(8, dtype=torch.uint8)}, CompressedReducer(chunk_size=CHUNK)),
    ]:
        try:
            reducer.load_state_dict(bad_state)
            errors.append("no error")
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    # A state saved on CUDA is refused when the first reduction (on CPU) would apply it.
    cuda_state = CompressedReducer(**opts)
    cuda_state.load_state_dict({"generator_state": first.state_dict()["generator_state"], "generator_device": "cuda"})
    try:
        cuda_state.all_reduce(_bucket(rank, 0), None, average=True, key=0).wait()
        errors.append("no error")
    except ValueError as exc:
        errors.append(str(exc))
    return {"straight": straight, "resumed": run(resumed, range(2, 4)), "errors": errors, "saved": first.state_dict()}


def test_reducer_state_dict_resumes_error_feedback_and_stochastic_stream(dist_run) -> None:
    res = dist_run(_worker_state, 2, timeout=120)
    for r in range(2):
        for a, b in zip(res[r]["straight"], res[r]["resumed"]):
            assert torch.equal(a, b)
    expected = [
        "state was saved with rounding='nearest'; this reducer uses 'stochastic'",
        "state holds error-feedback residuals but this reducer has error_feedback=False",
        "state['worker'] must be a 1-D float32 tensor",
        "generator_state must be a 1-D uint8 tensor (torch.Generator.get_state()); got list",
        "generator_state must be a 1-D uint8 tensor (torch.Generator.get_state()); got torch.float32 tensor",
        "state was saved with check_finite='raise'; this reducer uses 'flag'",
        "state was saved with topology=[2, 1]; this reducer uses None",
        "state['error_feedback'] must be a dict; got list",
        "no error",  # a state saved on "cuda:0": refused only when applied, at the first reduction (below)
        "state holds a generator state but this reducer rounds to nearest",
        "generator_state was saved from a generator on cuda; this run draws on cpu",
    ]
    assert len(res[0]["errors"]) == len(expected)
    for got, want in zip(res[0]["errors"], expected):
        assert got.startswith(want), (got, want)
    saved = res[0]["saved"]
    assert saved["rounding"] == "stochastic" and saved["topology"] is None and saved["generator_device"] == "cpu"


def _worker_failed_wait(rank: int, world: int) -> dict:
    from mixprec.compress import NonFiniteError

    reducer = CompressedReducer(chunk_size=CHUNK, check_finite="raise")
    bucket = _bucket(rank, 0)
    bucket[7] = float("nan") if rank == 0 else bucket[7]
    handle = reducer.all_reduce(bucket, None, average=True, key=0)
    raised = []
    for _ in range(2):  # the second wait raises again: the bucket was not reduced
        try:
            handle.wait()
            raised.append("no error")
        except NonFiniteError as exc:
            raised.append(type(exc).__name__)
    ok = _bucket(rank, 1)
    reducer.all_reduce(ok, None, average=True, key=1).wait()  # the reducer still works
    return {"raised": raised, "pending": len(reducer._pending), "ok": ok}


def test_reducer_failed_wait_raises_again_and_the_reducer_recovers(dist_run) -> None:
    res = dist_run(_worker_failed_wait, 2, timeout=60)
    expected = ref_flat_all_reduce([_bucket(r, 1).numpy() for r in range(2)], CHUNK)[0][0]
    for r in res:
        assert r["raised"] == ["NonFiniteError", "NonFiniteError"] and r["pending"] == 0
        np.testing.assert_array_equal(r["ok"].numpy(), expected)


def test_factories_validate_options() -> None:
    with pytest.raises(ValueError, match="reducer 'uint8' is flat"):
        make_reducer("uint8", topology=Topology(2, 2))
    with pytest.raises(ValueError, match="rounding must be one of"):
        make_reducer("uint8", rounding="up")
    with pytest.raises(TypeError, match="rejected its options"):
        make_reducer("uint8", bogus=1)
    with pytest.raises(ValueError, match="check_finite must be one of"):
        CompressedReducer(check_finite="warn")
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        CompressedReducer(error_feedback=1)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set"):
        make_reducer("uint8_hierarchical")
    with pytest.raises(TypeError, match="state must be a CompressedHookState"):
        compressed_hook(object(), None)  # type: ignore[arg-type]
    for kwargs, exc, match in [
        ({"chunk_size": 0}, ValueError, "chunk_size must be an int >= 1"),
        ({"rounding": "up"}, ValueError, "rounding must be one of"),
        ({"error_feedback": "yes"}, TypeError, "error_feedback must be a bool"),
        ({"check_finite": "warn"}, ValueError, "check_finite must be one of"),
        ({"topology": (2, 2)}, TypeError, "topology must be a mixprec.comm.Topology"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
    ]:
        with pytest.raises(exc, match=match):
            CompressionOptions(**kwargs)
        with pytest.raises(exc, match=match):
            CompressedReducer(**kwargs)
    assert CompressionOptions(topology=Topology(2, 2)).saved()["topology"] == [2, 2]


def _worker_rank_streams(rank: int, world: int) -> dict:
    from mixprec.comm import rank_generator

    reducer = make_reducer("uint8", chunk_size=CHUNK, rounding="stochastic", seed=123)
    bucket = _bucket(rank, 0)
    reducer.all_reduce(bucket, None, average=True, key=0).wait()
    state = mixprec.hooks.CompressedHookState(chunk_size=CHUNK, rounding="stochastic", seed=9, error_feedback=True)
    comp = state.compressor_for(torch.device("cpu"))
    same_stream = comp.generator is rank_generator(9, "cpu")
    first_draw = torch.rand(4, generator=comp.generator)
    errors = []
    fb = {"worker": torch.zeros(4)}
    for bad in [
        {"error_feedback": {0: fb}},  # no "numel"
        {"error_feedback": {0: [1]}},
        {"error_feedback": {"0": {"numel": 4, **fb}}},
        {"chunk_size": 2048},
        {"rounding": "nearest"},
        {"topology": [1, 2]},
        {"generator_state": torch.zeros(3)},
        {"error_feedback": {0: {"numel": -1, **fb}}},
    ]:
        try:
            state.load_state_dict(bad)
            errors.append("no error")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    state.load_state_dict({"error_feedback": {0: {"numel": 4, **fb}}, "generator_state": comp.generator.get_state()})
    saved = state.state_dict()
    return {"bucket": bucket, "same_stream": same_stream, "first_draw": first_draw, "errors": errors, "saved": saved}


def test_stochastic_streams_are_rank_seeded_and_hook_state_validates(dist_run) -> None:
    world = 2
    res = dist_run(_worker_rank_streams, world, timeout=120)
    # The reducer's stream is rank_generator(123): CPU generator seeded 123 + rank, one key per reduction.
    gens = [torch.Generator().manual_seed(123 + r) for r in range(world)]
    randoms = [call_randoms(g, BUCKET, BUCKET // world) for g in gens]
    inputs = [_bucket(r, 0).numpy() for r in range(world)]
    expected = ref_flat_all_reduce(inputs, CHUNK, rounding="stochastic", randoms=randoms)[0][0]
    for r in range(world):
        np.testing.assert_array_equal(res[r]["bucket"].numpy(), expected)
        assert res[r]["same_stream"]
    assert not torch.equal(res[0]["first_draw"], res[1]["first_draw"])  # one stream per rank
    assert res[0]["errors"] == [
        "ValueError: state['error_feedback'][0] lacks 'numel' (the bucket's size)",
        "TypeError: state['error_feedback'][0] must be a dict; got list",
        "TypeError: state['error_feedback'] keys must be bucket keys, ints >= 0; got '0'",
        "ValueError: state was saved with chunk_size=2048; this hook state uses 256",
        "ValueError: state was saved with rounding='nearest'; this hook state uses 'stochastic'",
        "ValueError: state was saved with topology=[1, 2]; this hook state uses None",
        "TypeError: generator_state must be a 1-D uint8 tensor (torch.Generator.get_state()); got torch.float32 "
        "tensor of shape (3,)",
        "ValueError: state['error_feedback'][0]['numel'] must be an int >= 0; got -1",
    ]
    saved = res[0]["saved"]
    assert saved["error_feedback"][0]["numel"] == 4 and saved["generator_device"] == "cpu"


def test_hook_state_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match="CompressedHookState needs an initialised process group"):
        mixprec.hooks.CompressedHookState(rounding="stochastic")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _local_grads(rank: int) -> list[torch.Tensor]:
    model = _model()
    x, y = _batch(rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker_ddp(rank: int, world: int, mode: str) -> dict:
    x, y = _batch(rank)
    if mode.startswith("torch_hook"):
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        topology = Topology(2, 2) if mode == "torch_hook_2x2" else None
        state = mixprec.hooks.CompressedHookState(chunk_size=CHUNK, error_feedback=True, topology=topology)
        ddp.register_comm_hook(state, mixprec.hooks.compressed_hook)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        intra = sum(st.bytes_sent_intra_node for st in state.last_stats.values())
        return {"grads": grads, "bytes": state.bytes_sent_total, "state": state.state_dict(), "intra": intra}
    sharded = mode == "mixprec_sharded"
    ddp = DistributedDataParallel(
        _model(), reduce="uint8", reduce_options={"chunk_size": CHUNK}, sharded_optimizer=sharded, bucket_size=1000
    )
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    opt.step()
    params = [p.detach().clone() for p in ddp.module.parameters()]
    return {"grads": grads, "params": params, "stats": ddp.reducer.last_stats}


@pytest.mark.parametrize("mode", ["mixprec", "mixprec_sharded", "torch_hook", "torch_hook_2x2"])
def test_data_parallel_training_step_with_uint8(dist_run, mode: str) -> None:
    world = 4 if mode == "torch_hook_2x2" else 2
    res = dist_run(_worker_ddp, world, mode, timeout=120)
    local = [_local_grads(r) for r in range(world)]
    exact = [torch.stack([g[i].double() for g in local]).mean(0) for i in range(len(local[0]))]
    # A chunk may span several parameters (and zero padding): its range is at most the spread of all of a
    # rank's gradients and 0. Each quantization errs by <= step / 2 = range / 510 (+ fp32 terms, < 1e-6 here).
    spread = max(
        max(float(g.max()) for g in [*gs, torch.zeros(1)]) - min(float(g.min()) for g in [*gs, torch.zeros(1)])
        for gs in local
    )
    key = "grads" if mode != "mixprec_sharded" else "params"
    for r in range(1, world):
        for a, b in zip(res[0][key], res[r][key]):
            assert torch.equal(a, b)  # identical bits on every rank (sharded: after the parameter all-gather)
    if mode == "mixprec_sharded":
        # reduce-scatter: one quantization per rank (averaged), no re-quantization; then SGD with lr 0.1
        for p0, ex, new in zip(_model().parameters(), exact, res[0]["params"]):
            assert (p0.detach().double() - 0.1 * ex - new.double()).abs().max() <= 0.1 * (spread / 510 + 1e-6) + 1e-7
    else:
        # worker + server quantization. 2 x 2: the m = 2 node sums (range <= 2 spread) are quantized and
        # divided by W = 4, so the worker error is again <= spread / 510.
        for got, ex in zip(res[0]["grads"], exact):
            assert (got.double() - ex).abs().max() <= 2 * spread / 510 + 1e-6
    if mode == "torch_hook_2x2":
        # the intra-node reduce-scatter and relay were used: the stats split by link
        assert res[0]["intra"] > 0 and res[0]["bytes"] > res[0]["intra"]
    if mode.startswith("torch_hook"):
        assert res[0]["bytes"] > 0 and res[0]["state"]["error_feedback"]
    else:
        stats = list(res[0]["stats"].values())
        assert stats and all(0.25 < s.ratio_to_fp32 < 0.25 * (1 + 8 / CHUNK) + 0.01 for s in stats)


def test_error_feedback_state_rejects_bad_input() -> None:
    fb = ErrorFeedback()
    with pytest.raises(TypeError, match="state must be a dict"):
        fb.load_state_dict([1])
    with pytest.raises(ValueError, match="unknown error-feedback state keys"):
        fb.load_state_dict({"client": torch.zeros(3)})
    fb.load_state_dict({"worker": torch.ones(4)})
    assert torch.equal(fb.worker, torch.ones(4)) and fb.server is None
    fb.reset()
    assert not fb.worker.any()


def test_seed_outside_torchs_range_is_refused_at_construction() -> None:
    # Not first at the first reduction, inside a backward hook.
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"seed must lie in torch's seed range \[-2\*\*63, 2\*\*64\)"):
            CompressionOptions(seed=seed)
    assert CompressionOptions(seed=2**64 - 1).seed == 2**64 - 1


def _worker_nan_does_not_stick(rank: int, world: int, topology: Topology | None) -> dict:
    def reducer() -> CompressedReducer:
        return CompressedReducer(chunk_size=CHUNK, error_feedback=True, rounding="stochastic", topology=topology)

    used = reducer()
    for step in range(2):  # residuals hold something before the bad step
        used.all_reduce(_bucket(rank, 0, step), None, average=True, key=0).wait()
    bad = _bucket(rank, 0, 2)
    if rank == 0:
        bad[-1] = float("nan")  # where a data-parallel wrapper keeps its bucket padding
    used.all_reduce(bad, None, average=True, key=0).wait()
    flagged = used.last_stats[0].found_nonfinite
    residuals = used.state_dict()["error_feedback"][0]
    # After the bad step the reducer must reduce exactly as a fresh one whose stream is at the same point.
    fresh = reducer()
    fresh.load_state_dict({"generator_state": used.state_dict()["generator_state"]})
    after, expected = _bucket(rank, 0, 3), _bucket(rank, 0, 3)
    used.all_reduce(after, None, average=True, key=0).wait()
    fresh.all_reduce(expected, None, average=True, key=0).wait()
    return {
        "flagged": flagged,
        "zero": all(not r.any() for r in residuals.values()),
        "same": torch.equal(after, expected),
        "finite": bool(torch.isfinite(after).all()) and not used.last_stats[0].found_nonfinite,
    }


@pytest.mark.parametrize("world, topology", [(2, None), (4, Topology(2, 2))])
def test_nan_in_a_bucket_does_not_stick_in_the_reducers_residuals(dist_run, world, topology) -> None:
    for r in dist_run(_worker_nan_does_not_stick, world, topology, timeout=120):
        assert r == {"flagged": True, "zero": True, "same": True, "finite": True}
