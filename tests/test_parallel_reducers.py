"""The reducer registry and the two built-in reducers against the collectives they stand for."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_reference import U32, UBF16, fp32_rank_order_sum, gamma
from mixprec.comm import GradReducer, make_reducer, register_reducer, registered_reducers
from mixprec.comm import reducer as reducer_registry
from mixprec.comm.reducer import bucket_multiple
from mixprec.parallel import FP32AccumulateReducer, NativeReducer


def test_registry_names_and_errors(monkeypatch) -> None:
    assert {"native", "fp32_accumulate"} <= set(registered_reducers())
    assert isinstance(make_reducer("native"), NativeReducer)
    r = make_reducer("fp32_accumulate", rounding="stochastic", seed=3)
    assert isinstance(r, FP32AccumulateReducer) and r.rounding == "stochastic"
    assert isinstance(r, GradReducer)
    with pytest.raises(ValueError, match=r"unknown reducer 'nope'; registered reducers: .*fp32_accumulate.*native"):
        make_reducer("nope")
    with pytest.raises(TypeError, match="rejected its options"):
        make_reducer("native", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding must be one of"):
        make_reducer("fp32_accumulate", rounding="up")
    with pytest.raises(ValueError, match="already registered"):
        register_reducer("native", FP32AccumulateReducer)
    register_reducer("native", NativeReducer)  # the same factory again: fine
    with pytest.raises(TypeError, match="callable"):
        register_reducer("x", 3)  # type: ignore[arg-type]
    monkeypatch.setitem(reducer_registry._REGISTRY, "not_a_reducer", lambda: object())
    with pytest.raises(TypeError, match="not a GradReducer"):
        make_reducer("not_a_reducer")


def test_compressed_names_are_registered_by_importing_mixprec() -> None:
    """mixprec.compress registers its reducers when imported, and importing mixprec imports it."""
    import mixprec  # noqa: F401

    assert {"uint8", "uint8_hierarchical"} <= set(registered_reducers())


def test_a_factory_bug_is_not_reported_as_bad_options(monkeypatch) -> None:
    """Options are checked against the signature; a TypeError raised inside the factory passes through."""

    def buggy(*, block: int = 1) -> GradReducer:
        raise TypeError("internal: unsupported operand")

    monkeypatch.setitem(reducer_registry._REGISTRY, "buggy", buggy)
    with pytest.raises(TypeError, match=r"^internal: unsupported operand$"):
        make_reducer("buggy", block=2)
    with pytest.raises(TypeError, match=r"rejected its options \['blok'\]"):
        make_reducer("buggy", blok=2)


def test_bucket_multiple() -> None:
    assert bucket_multiple(1) == 128
    assert bucket_multiple(3) == 384
    assert bucket_multiple(4) == 128
    assert bucket_multiple(6) == 384
    with pytest.raises(ValueError, match="world_size"):
        bucket_multiple(0)


def _rank_bucket(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))).to(dtype)


def _reducer_case(rank: int, world_size: int, name: str) -> dict[str, object]:
    numel = 3 * bucket_multiple(world_size)
    shard = numel // world_size
    buckets = [_rank_bucket(r, numel, torch.bfloat16) for r in range(world_size)]
    sum32 = fp32_rank_order_sum(buckets)
    mean32 = fp32_rank_order_sum(buckets, average=True)
    abs_sum32 = fp32_rank_order_sum([b.abs() for b in buckets])
    reducer = make_reducer(name, max_in_flight=1) if name == "fp32_accumulate" else make_reducer(name)
    # Several buckets in flight at once, finished out of order.
    ar = [buckets[rank].clone() for _ in range(3)]
    handles = [reducer.all_reduce(b, None, average=True, key=k) for k, b in enumerate(ar)]
    for h in reversed(handles):
        h.wait()
    out16 = torch.empty(shard, dtype=torch.bfloat16)
    out32 = torch.empty(shard, dtype=torch.float32)
    reducer.reduce_scatter(out16, buckets[rank].clone(), None, average=True, key=5).wait()
    reducer.reduce_scatter(out32, buckets[rank].clone(), None, average=False, key=6).wait()
    native_ar = buckets[rank].clone()
    native_ar.div_(world_size)
    dist.all_reduce(native_ar)
    return {
        "ar": ar,
        "rs16": out16,
        "rs32": out32,
        "mean32": mean32,
        "sum32": sum32,
        "abs_sum32": abs_sum32,
        "native_ar": native_ar,
        "scratch_buffers": len(getattr(reducer, "_free", [])),
    }


def test_fp32_accumulate_reducer_matches_the_fp32_reference(dist_run) -> None:
    world_size = 3
    shard = bucket_multiple(world_size)
    results = dist_run(_reducer_case, world_size, "fp32_accumulate", timeout=60)
    for rank, r in enumerate(results):
        expected = r["mean32"].to(torch.bfloat16)
        assert all(torch.equal(b, expected) for b in r["ar"])
        sl = slice(rank * shard, (rank + 1) * shard)
        assert torch.equal(r["rs16"], expected[sl])
        # fp32 shard_out: the fp32 sum itself, no rounding to bf16 at all.
        assert torch.equal(r["rs32"], r["sum32"][sl])
        # max_in_flight=1: one receive buffer served all five reductions.
        assert r["scratch_buffers"] == 1


def test_native_reducer_is_the_backend_collective(dist_run) -> None:
    world_size = 3
    shard = bucket_multiple(world_size)
    results = dist_run(_reducer_case, world_size, "native", timeout=60)
    for rank, r in enumerate(results):
        # Pre-divide then gloo's bf16 SUM: exactly what torch DDP's default hook computes.
        assert all(torch.equal(b, r["native_ar"]) for b in r["ar"])
        sl = slice(rank * shard, (rank + 1) * shard)
        # A bf16 reduce-scatter copied into fp32 differs from the fp32 sum somewhere on random data.
        assert not torch.equal(r["rs32"], r["sum32"][sl])
        # gloo adds the P bf16 values in bf16 (P - 1 roundings, any order): |error| <= gamma_{P-1}(u_bf16) *
        # sum |x_i| (Higham 3.1); the fp32 reference itself is within gamma_{P-1}(u_fp32) * sum |x_i|.
        # (1 + gamma) covers the rounding of the fp32 sum of |x_i| itself.
        abs_sum = r["abs_sum32"][sl] * (1 + gamma(world_size - 1, U32))
        bound = (gamma(world_size - 1, UBF16) + gamma(world_size - 1, U32)) * abs_sum
        assert bool(((r["rs32"] - r["sum32"][sl]).abs() <= bound).all())


def _stochastic_state_case(rank: int, world_size: int) -> bool:
    numel = bucket_multiple(world_size) * 4
    bucket = _rank_bucket(rank, numel, torch.bfloat16)
    a = FP32AccumulateReducer(rounding="stochastic", seed=11)
    b1 = bucket.clone()
    a.all_reduce(b1, None, average=False, key=0).wait()
    saved = a.state_dict()
    b2 = bucket.clone()
    a.all_reduce(b2, None, average=False, key=0).wait()
    resumed = FP32AccumulateReducer(rounding="stochastic", seed=11)
    resumed.load_state_dict(saved)
    b3 = bucket.clone()
    resumed.all_reduce(b3, None, average=False, key=0).wait()
    return torch.equal(b2, b3) and not torch.equal(b1, b2)


def test_stochastic_reducer_state_resumes_the_stream(dist_run) -> None:
    assert all(dist_run(_stochastic_state_case, 2, timeout=60))


def _bad_bucket(rank: int, world_size: int) -> list[str]:
    out = []
    reducer = FP32AccumulateReducer()
    for bucket in (torch.zeros(100, dtype=torch.bfloat16), torch.zeros(2, 128), torch.zeros(128, dtype=torch.float64)):
        try:
            reducer.all_reduce(bucket, None, average=True, key=0)
        except (TypeError, ValueError) as exc:
            out.append(str(exc))
    try:
        reducer.reduce_scatter(
            torch.empty(64, dtype=torch.float16), torch.zeros(128, dtype=torch.bfloat16), None, average=False, key=0
        )
    except TypeError as exc:
        out.append(str(exc))
    return out


def test_bad_buckets_are_refused(dist_run) -> None:
    messages = dist_run(_bad_bucket, 2, timeout=60)[0]
    assert "not a multiple of lcm(world_size=2, 128) = 128" in messages[0]
    assert "1-D contiguous" in messages[1]
    assert "bucket must have dtype torch.float16 or torch.bfloat16 or torch.float32; got torch.float64" in messages[2]
    assert "shard_out must have dtype torch.bfloat16 or torch.float32" in messages[3]
    assert len(messages) == 4


def _group_not_a_process_group(rank: int, world_size: int) -> list[str]:
    from mixprec.comm import agree_any, rank_generator

    out = []
    bucket = torch.zeros(bucket_multiple(world_size))
    for call in (
        lambda: NativeReducer().all_reduce(bucket, "x", average=True, key=0),
        lambda: FP32AccumulateReducer().reduce_scatter(torch.zeros(64), bucket, "x", average=True, key=0),
        lambda: agree_any(True, group="x"),
        lambda: rank_generator(1, group="x"),
    ):
        try:
            call()
            out.append("no error")
        except TypeError as exc:
            out.append(str(exc))
    return out


def test_a_group_that_is_not_a_process_group_is_named(dist_run) -> None:
    for messages in dist_run(_group_not_a_process_group, 2, timeout=60):
        assert len(messages) == 4
        for message in messages:
            assert message.startswith("group must be a torch.distributed ProcessGroup or None; got str"), message
