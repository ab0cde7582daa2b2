"""ScaledFP8: bit-exact against an independent reference (one tensor, and the flat and hierarchical collectives at
2, 3, 4 and 2x2 ranks), its error bound, NaN/Inf flags, bad input; and the "fp8" reducers and hook."""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import pytest
import torch

import mixprec.hooks
from compress_reference import (
    as_f32,
    call_randoms,
    ref_flat_all_reduce,
    ref_flat_reduce,
    ref_fp8_bound,
    ref_fp8_decode,
    ref_fp8_encode,
    ref_hierarchical_all_reduce,
    ref_hierarchical_reduce_scatter,
)
from mixprec import native
from mixprec.comm import Topology, make_reducer
from mixprec.compress import (
    ErrorFeedback,
    NonFiniteError,
    ScaledFP8,
    compressed_all_reduce,
    compressed_reduce_scatter,
)

CHUNK = 256
N = 12 * 1024  # divisible by 2, 3 and 4
FMTS = ["e4m3", "e5m2"]


FP32_MAX = torch.finfo(torch.float32).max


def _near_fp32_max(n: int, g: torch.Generator) -> torch.Tensor:
    """Finite values whose fp8 code may round up to 2**128 (= inf in fp32) once scaled back: the last spacings
    below fp32's max, the round-half-even ties there (1.9375 and 1.875 times 2**127: e4m3's and e5m2's, which
    round up to 2**128), and small values beside them in the same chunks."""
    top = torch.tensor([2.0**127 * 1.9375, 2.0**127 * 1.875, FP32_MAX])
    edges = torch.cat([top, torch.nextafter(top, torch.zeros(3)), torch.nextafter(top[:2], torch.full((2,), math.inf))])
    x = torch.randn(n, generator=g)
    big = torch.rand(n, generator=g) < 0.3
    x[big] = torch.copysign(FP32_MAX * (0.8 + 0.2 * torch.rand(int(big.sum()), generator=g)), x[big])
    x[: 2 * edges.numel()] = torch.cat([edges, -edges])
    x[CHUNK : CHUNK + 4] = torch.tensor([3.3e38, 1.0, -2.0, 0.5])
    return x


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    n = 5 * CHUNK + 37
    sparse = torch.randn(n, generator=g)
    sparse[torch.rand(n, generator=g) < 0.9] = 0.0
    return {
        "random": torch.randn(n, generator=g),
        "zero": torch.zeros(n),
        "sparse": sparse,
        "wide_range": torch.randn(n, generator=g) * torch.logspace(-20, 20, n),
        "huge": torch.randn(n, generator=g) * 1e37,
        "tiny": torch.randn(n, generator=g) * 1e-40,  # subnormal fp32: the scale exponent is clamped
        "outlier": torch.cat([torch.randn(n - 1, generator=g) * 1e-3, torch.tensor([50.0])]),
        "student_t": torch.distributions.StudentT(2.0).sample((n,)),
        "near_fp32_max": _near_fp32_max(n, g),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_bit_exact_against_reference_and_within_bound(fmt: str, rounding: str, name: str) -> None:
    x = CASES[name]
    q = ScaledFP8(fmt, chunk_size=CHUNK, rounding=rounding, generator=torch.Generator().manual_seed(5))
    buf = q.encode(x)
    (randoms,) = call_randoms(torch.Generator().manual_seed(5), x.numel())
    expected = ref_fp8_encode(as_f32(x), CHUNK, fmt, rounding, randoms)
    assert buf.numpy().tobytes() == expected
    y = q.decode(buf, x.numel())
    np.testing.assert_array_equal(y.numpy(), ref_fp8_decode(expected, x.numel(), CHUNK, fmt))
    err = np.abs(y.double().numpy() - as_f32(x).astype(np.float64))
    assert (err <= ref_fp8_bound(as_f32(x), CHUNK, fmt, rounding)).all()
    assert (y[x == 0] == 0).all()  # zeros stay exactly zero


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_finite_values_near_fp32_max_decode_finite(fmt: str, rounding: str, path: str) -> None:
    """A code that rounds up to 2**(128 + k) would decode to inf: finite input, found_nonfinite False, an inf out
    (and in training a skipped step). It saturates to the grid's largest value below, within the bound."""
    if path == "compiled" and native.library() is None:
        pytest.skip("no compiled kernels here")
    q = ScaledFP8(fmt, chunk_size=4, rounding=rounding, check_finite="flag")
    with native.disabled() if path == "torch" else contextlib.nullcontext():
        for x in (torch.tensor([3.3e38, 1.0, -2.0, 0.5]), CASES["near_fp32_max"]):
            buf = q.encode(x)
            y = q.decode(buf, x.numel())
            assert not q.found_nonfinite(buf, x.numel())
            assert torch.isfinite(y).all()
            err = np.abs(y.double().numpy() - as_f32(x).astype(np.float64))
            assert (err <= ref_fp8_bound(as_f32(x), 4, fmt, rounding)).all()
            if rounding == "nearest":
                assert buf.numpy().tobytes() == ref_fp8_encode(as_f32(x), 4, fmt)
    if rounding == "nearest":  # the example: 3.3e38 came back as inf
        assert y[CHUNK].item() == (1.875 if fmt == "e4m3" else 1.75) * 2.0**127


def _worker_near_max(rank: int, world: int) -> dict:
    out = {}
    for fmt in FMTS:
        x = _input(rank, n=4 * CHUNK)
        if rank == 0:
            x[3] = 3.35e38  # finite: the step must not be skipped
        stats = compressed_all_reduce(x, compressor=ScaledFP8(fmt, chunk_size=CHUNK, check_finite="flag"))
        out[fmt] = (stats.found_nonfinite, x)
    return out


def test_fp8_all_reduce_of_a_huge_finite_gradient_is_finite(dist_run) -> None:
    """One rank's gradient of 3.35e38: the fp8 all-reduce reported it non-finite (the reducers skip such a step)."""
    for rank_result in dist_run(_worker_near_max, 2, timeout=120):
        for fmt in FMTS:
            flagged, y = rank_result[fmt]
            assert not flagged
            assert torch.isfinite(y).all()
            # two quantizations of 3.35e38 (one per rank's part, one of the half-sum) and a small addend
            assert abs(y[3].item() - 3.35e38 / 2) <= 2 * (2.0**-4 if fmt == "e4m3" else 2.0**-3) * 3.35e38


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_scale_puts_the_chunk_maximum_near_the_format_max(fmt: str) -> None:
    x = torch.randn(4 * CHUNK, generator=torch.Generator().manual_seed(1)) * 1e-3
    q = ScaledFP8(fmt, chunk_size=CHUNK)
    buf = q.encode(x)
    top = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    scaled = x.view(4, CHUNK).abs().amax(1) / q.scales(buf, x.numel())
    assert ((scaled > top / 2) & (scaled <= top)).all()
    assert buf.numel() == 4 * 4 + x.numel()
    assert torch.equal(torch.log2(q.scales(buf, x.numel())), torch.log2(q.scales(buf, x.numel())).round())


def test_fp8_stochastic_rounding_is_unbiased() -> None:
    # Per element the mean of n draws is within 5 sigma of x (sigma <= spacing / 2 / sqrt(n)); decoding is
    # exact, so there is no arithmetic bias term.
    n = 4000
    x = torch.linspace(0.3, 0.9, CHUNK)
    q = ScaledFP8("e4m3", chunk_size=CHUNK, rounding="stochastic", generator=torch.Generator().manual_seed(2))
    draws = q.decode(q.encode(x.repeat(n)), n * CHUNK).double().view(n, CHUNK)
    spacing = 2.0**-4  # x * 2**9 lies in [153, 461): spacing 32 there, i.e. 2**-4 unscaled
    bias = (draws.mean(0) - x.double()).abs()
    assert bias.max().item() <= 5 * spacing / 2 / math.sqrt(n)
    qn = ScaledFP8("e4m3", chunk_size=CHUNK)
    assert (qn.decode(qn.encode(x), CHUNK).double() - x.double()).abs().max().item() > 5 * spacing / 2 / math.sqrt(n)


def test_fp8_nonfinite_chunks_are_flagged_never_finite() -> None:
    x = torch.randn(3 * CHUNK)
    x[CHUNK + 3] = math.inf
    x[2 * CHUNK + 1] = math.nan
    with pytest.raises(NonFiniteError, match="2 of its 3 chunks"):
        ScaledFP8(chunk_size=CHUNK).encode(x)
    q = ScaledFP8(chunk_size=CHUNK, check_finite="flag")
    buf = q.encode(x)
    y = q.decode(buf, x.numel())
    assert q.found_nonfinite(buf, x.numel())
    assert torch.isfinite(y[:CHUNK]).all() and y[CHUNK:].isnan().all()


def test_fp8_bad_input_gets_one_clear_error() -> None:
    with pytest.raises(ValueError, match="fmt"):
        ScaledFP8("e3m4")
    for bad in (0, -5):
        with pytest.raises(ValueError, match="chunk_size"):
            ScaledFP8(chunk_size=bad)
    with pytest.raises(TypeError, match="chunk_size"):
        ScaledFP8(chunk_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding"):
        ScaledFP8(rounding="up")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tensor"):
        ScaledFP8().encode(torch.zeros(4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="wire"):
        make_reducer("fp8", wire="uint8")


# ---------------------------------------------------------------------------------------------- collectives
def _input(rank: int, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g) * (rank + 1) + 0.3 * rank
    x[-700:] *= torch.logspace(-3, 3, 700)
    x[::7] = 0.0
    return x


def _inputs(world: int, n: int = N, seed: int = 0) -> list[np.ndarray]:
    return [_input(r, n, seed).numpy() for r in range(world)]


def _worker(rank: int, world: int, fmt: str, topology: Topology | None) -> dict:
    comp = ScaledFP8(fmt, chunk_size=CHUNK)
    out: dict = {}
    x = _input(rank)
    out["stats"] = compressed_all_reduce(x, compressor=comp, topology=topology)
    out["all_reduce"] = x
    shard = torch.empty(N // world)
    compressed_reduce_scatter(shard, _input(rank), compressor=comp, topology=topology)
    out["reduce_scatter"] = shard
    st = _input(rank, seed=2)
    g = torch.Generator().manual_seed(500 + rank)
    compressed_all_reduce(
        st, compressor=ScaledFP8(fmt, chunk_size=CHUNK, rounding="stochastic", generator=g), topology=topology
    )
    out["stochastic"] = st
    b = _input(rank, seed=3).bfloat16()
    compressed_all_reduce(b, compressor=comp, topology=topology)
    out["bf16"] = b
    ef = ErrorFeedback()
    steps = []
    for t in range(2):
        v = _input(rank, seed=10 + t)
        compressed_all_reduce(v, compressor=comp, error_feedback=ef, topology=topology)
        steps.append(v)
    out["ef_steps"] = steps
    bad = _input(rank, seed=4)
    if rank == world - 1:
        bad[5] = math.nan
    out["nan_stats"] = compressed_all_reduce(
        bad, compressor=ScaledFP8(fmt, chunk_size=CHUNK, check_finite="flag"), topology=topology
    )
    out["nan"] = bad
    return out


@pytest.mark.parametrize("world, hier", [(2, False), (3, False), (4, False), (4, True)])
def test_fp8_collectives_bit_for_bit_against_reference(dist_run, world: int, hier: bool) -> None:
    fmt = "e4m3" if world != 3 else "e5m2"
    topology = Topology(2, 2) if hier else None
    res = dist_run(_worker, world, fmt, topology, timeout=120)
    part = N // world
    if hier:
        ref = ref_hierarchical_all_reduce(_inputs(4), CHUNK, 2, 2, wire=fmt)[0]
        shards = ref_hierarchical_reduce_scatter(_inputs(4), CHUNK, 2, 2, wire=fmt)
        gens = [torch.Generator().manual_seed(500 + r) for r in range(4)]
        randoms = [call_randoms(g, N // 2, N // 4) for g in gens]
        ref_st = ref_hierarchical_all_reduce(
            _inputs(4, seed=2), CHUNK, 2, 2, rounding="stochastic", randoms=randoms, wire=fmt
        )[0]
        bf16 = [_input(r, seed=3).bfloat16().float().numpy() for r in range(4)]
        ref_bf16 = ref_hierarchical_all_reduce(bf16, CHUNK, 2, 2, wire=fmt)[0]
        residuals = {"worker": [np.zeros(N // 2, np.float32)] * 4, "server": [np.zeros(N // 4, np.float32)] * 4}
        residuals = {k: list(v) for k, v in residuals.items()}
        ref_ef = [
            ref_hierarchical_all_reduce(_inputs(4, seed=10 + t), CHUNK, 2, 2, residuals=residuals, wire=fmt)[0]
            for t in range(2)
        ]
    else:
        ref = ref_flat_all_reduce(_inputs(world), CHUNK, wire=fmt)[0][0]
        shards = ref_flat_reduce(_inputs(world), CHUNK, divisor=world, wire=fmt)
        gens = [torch.Generator().manual_seed(500 + r) for r in range(world)]
        randoms = [call_randoms(g, N, part) for g in gens]
        ref_st = ref_flat_all_reduce(_inputs(world, seed=2), CHUNK, rounding="stochastic", randoms=randoms, wire=fmt)[
            0
        ][0]
        bf16 = [_input(r, seed=3).bfloat16().float().numpy() for r in range(world)]
        ref_bf16 = ref_flat_all_reduce(bf16, CHUNK, wire=fmt)[0][0]
        residuals = {"worker": [np.zeros(N, np.float32)] * world, "server": [np.zeros(part, np.float32)] * world}
        residuals = {k: list(v) for k, v in residuals.items()}
        ref_ef = [
            ref_flat_all_reduce(_inputs(world, seed=10 + t), CHUNK, residuals=residuals, wire=fmt)[0][0]
            for t in range(2)
        ]
    for r in range(world):
        np.testing.assert_array_equal(res[r]["all_reduce"].numpy(), ref)
        np.testing.assert_array_equal(res[r]["reduce_scatter"].numpy(), shards[r])
        np.testing.assert_array_equal(res[r]["stochastic"].numpy(), ref_st)
        assert torch.equal(res[r]["bf16"], torch.from_numpy(ref_bf16).bfloat16())
        for t in range(2):
            np.testing.assert_array_equal(res[r]["ef_steps"][t].numpy(), ref_ef[t])
        # NaN on one rank: flagged on every rank, its chunks NaN everywhere, never a finite value
        assert res[r]["nan_stats"].found_nonfinite
        assert res[r]["nan"].isnan().any() and torch.equal(res[r]["nan"].isnan(), res[0]["nan"].isnan())
    stats = res[0]["stats"]
    assert stats.bytes_sent < 0.26 * stats.fp32_baseline_bytes + 1 if not hier else stats.bytes_sent > 0
    # fp32 sums of per-chunk-scaled values: close to the exact mean (relative u_f per quantization)
    exact = np.mean([v.astype(np.float64) for v in _inputs(world)], axis=0)
    u = 2.0**-4 if fmt == "e4m3" else 2.0**-3
    assert np.abs(ref - exact).max() <= 2 * u * np.abs(np.stack(_inputs(world))).max() + 1e-6


# ---------------------------------------------------------------------------------------------- reducers and hook
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _worker_training(rank: int, world: int, mode: str) -> dict:
    from mixprec.parallel import DistributedDataParallel

    x, y = _batch(rank)
    if mode == "torch_hook":
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        state = mixprec.hooks.CompressedHookState(chunk_size=CHUNK, wire="e4m3", error_feedback=True)
        ddp.register_comm_hook(state, mixprec.hooks.compressed_hook)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        return {"grads": [p.grad.clone() for p in ddp.parameters()], "bytes": state.bytes_sent_total}
    if mode == "fp8_hierarchical":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    ddp = DistributedDataParallel(
        _model(),
        reduce="fp8_hierarchical" if mode == "fp8_hierarchical" else "fp8",
        reduce_options={"chunk_size": CHUNK, "wire": "e5m2" if mode == "e5m2" else "e4m3", "rounding": "nearest"},
        sharded_optimizer=mode == "sharded",
        bucket_size=1000,
    )
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in ddp.module.parameters()], "repr": repr(ddp.reducer)}


@pytest.mark.parametrize("mode", ["e4m3", "e5m2", "sharded", "fp8_hierarchical", "torch_hook"])
def test_fp8_in_data_parallel_training(dist_run, mode: str) -> None:
    world = 4 if mode == "fp8_hierarchical" else 2
    res = dist_run(_worker_training, world, mode, timeout=120)
    local = []
    for r in range(world):
        model = _model()
        xb, yb = _batch(r)
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        local.append([p.grad.double() for p in model.parameters()])
    exact = [torch.stack([g[i] for g in local]).mean(0) for i in range(len(local[0]))]
    biggest = max(float(g.abs().max()) for gs in local for g in gs)
    # Each quantization errs by <= u_f |value| <= u_f * (the largest magnitude of its chunk); the worker side
    # (averaged) and the server side (one more), all of size <= biggest: 2 u_f biggest, plus fp32 sums.
    u = 2.0**-3 if mode == "e5m2" else 2.0**-4
    key = "params" if mode == "sharded" else "grads"
    for r in range(1, world):
        for a, b in zip(res[0][key], res[r][key]):
            assert torch.equal(a, b)
    if mode == "sharded":
        for p0, ex, new in zip(_model().parameters(), exact, res[0]["params"]):
            assert (p0.detach().double() - 0.1 * ex - new.double()).abs().max() <= 0.1 * (u * biggest + 1e-6) + 1e-7
    else:
        for got, ex in zip(res[0]["grads"], exact):
            assert (got.double() - ex).abs().max() <= 2 * u * biggest + 1e-6
    if mode == "torch_hook":
        assert res[0]["bytes"] > 0
    else:
        assert "wire=" in res[0]["repr"]
