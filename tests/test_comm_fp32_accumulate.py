"""reduce_scatter_fp32_accumulate / all_reduce_fp32_accumulate on gloo ranks, against a reference written
here: every rank regenerates every rank's input from its seed and sums them in numpy float32, in rank
order, then rounds once with torch's cast. Bit-for-bit, not approximately."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mixprec.native as mixprec_native
from dist_reference import fp32_rank_order_sum, neighbours
from mixprec.comm import all_reduce_fp32_accumulate, compat, reduce_scatter_fp32_accumulate
from mixprec.comm.memory import measure_peak_allocated

WORLD_SIZES = [2, 3, 4]
WIRE = [torch.bfloat16, torch.float16]
# Odd on purpose (not a multiple of the 2**16 summation block, nor of 128): 70_001 crosses a block boundary.
SHARD = 70_001


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gradients-like values over several binades, so that low-precision sums round often."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))
    return x.to(dtype)


def reference_sum(inputs: list[torch.Tensor], *, average: bool) -> np.ndarray:
    """fp32 sum in rank order (numpy float32: one IEEE rounding per addition), fp32 division if averaging."""
    return fp32_rank_order_sum(inputs, average=average).numpy()


def _reduce_scatter_case(
    rank: int, world_size: int, dtype: torch.dtype, average: bool, out_dtype: torch.dtype
) -> dict[str, object]:
    numel = SHARD * world_size
    inputs = [rank_input(r, numel, dtype) for r in range(world_size)]
    mine = inputs[rank].clone()
    out = torch.full((SHARD,), 7.0, dtype=out_dtype)
    reduce_scatter_fp32_accumulate(out, mine, average=average)
    ref32 = reference_sum(inputs, average=average)[rank * SHARD : (rank + 1) * SHARD]
    expected = torch.from_numpy(ref32).to(out_dtype)
    result: dict[str, object] = {
        "bitwise_equal": torch.equal(out, expected),
        "input_untouched": torch.equal(mine, inputs[rank]),
    }
    if out_dtype == dtype and not average:
        native = torch.empty(SHARD, dtype=dtype)
        compat.reduce_scatter_flat(native, inputs[rank].clone(), None)
        result["native_differs"] = int((native != expected).sum())
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", WIRE)
def test_reduce_scatter_is_the_fp32_sum_rounded_once(dist_run, world_size: int, dtype: torch.dtype) -> None:
    results = dist_run(_reduce_scatter_case, world_size, dtype, False, dtype, timeout=120)
    assert all(r["bitwise_equal"] for r in results)
    assert all(r["input_untouched"] for r in results)
    differing = sum(r["native_differs"] for r in results)
    if world_size == 2:
        # One addition of two fp16/bf16 numbers, correctly rounded by gloo too: the same bits.
        assert differing == 0
    else:
        # gloo rounds its running sum at every step: on random data some elements must differ
        # (measured here: 22% of them at 3 ranks, 32% at 4).
        assert differing > 0.01 * SHARD * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_average_and_fp32_output(dist_run, world_size: int) -> None:
    for out_dtype in (torch.bfloat16, torch.float32):
        results = dist_run(_reduce_scatter_case, world_size, torch.bfloat16, True, out_dtype, timeout=120)
        assert all(r["bitwise_equal"] for r in results), out_dtype


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp32_inputs(dist_run, world_size: int) -> None:
    results = dist_run(_reduce_scatter_case, world_size, torch.float32, False, torch.float32, timeout=120)
    assert all(r["bitwise_equal"] for r in results)


def _fp16_average_does_not_overflow(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    # Every rank holds 40000: the sum (160000 at 4 ranks) overflows fp16, the mean does not.
    x = torch.full((4 * world_size,), 40000.0, dtype=torch.float16)
    out = torch.empty(4, dtype=torch.float16)
    reduce_scatter_fp32_accumulate(out, x, average=True)
    native = x.clone()
    dist.all_reduce(native, op=dist.ReduceOp.AVG)  # gloo: fp16 sum, then divide
    return out.tolist(), native.tolist()


def test_fp16_average_is_taken_in_fp32(dist_run) -> None:
    for ours, native in dist_run(_fp16_average_does_not_overflow, 4, timeout=60):
        assert ours == [40000.0] * 4
        assert all(math.isinf(v) for v in native)  # the failure mode this avoids


def _async_case(rank: int, world_size: int) -> dict[str, object]:
    numel = 4096 * world_size
    inputs = [rank_input(r, numel, torch.bfloat16, seed=1) for r in range(world_size)]
    out = torch.full((4096,), 7.0, dtype=torch.bfloat16)
    scratch = torch.empty(numel, dtype=torch.bfloat16)
    handle = reduce_scatter_fp32_accumulate(out, inputs[rank].clone(), async_op=True, scratch=scratch)
    # The sum happens inside wait(): until then the output is untouched, whatever the transfer did.
    before = bool((out == 7.0).all()) and not handle.is_completed()
    handle.wait()
    handle.wait()  # idempotent
    expected = torch.from_numpy(reference_sum(inputs, average=False)[rank * 4096 : (rank + 1) * 4096])
    tensor = inputs[rank].clone()
    ar = all_reduce_fp32_accumulate(tensor, average=True, async_op=True)
    ar.wait()
    return {
        "before": before,
        "rs_equal": torch.equal(out, expected.to(torch.bfloat16)),
        "ar": tensor,
        "ar_expected": torch.from_numpy(reference_sum(inputs, average=True)).to(torch.bfloat16),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_handles_and_all_reduce(dist_run, world_size: int) -> None:
    results = dist_run(_async_case, world_size, timeout=120)
    for r in results:
        assert r["before"]
        assert r["rs_equal"]
        assert torch.equal(r["ar"], r["ar_expected"])
    # All ranks hold identical bits after the all-reduce.
    assert all(torch.equal(r["ar"], results[0]["ar"]) for r in results)


def _all_reduce_sync_no_warnings(rank: int, world_size: int) -> dict[str, object]:
    numel = 384 * world_size
    inputs = [rank_input(r, numel, torch.float16, seed=2) for r in range(world_size)]
    tensor = inputs[rank].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_reduce_fp32_accumulate(tensor)
    expected = torch.from_numpy(reference_sum(inputs, average=False)).to(torch.float16)
    return {"equal": torch.equal(tensor, expected), "warnings": [str(w.message) for w in caught]}


def test_all_reduce_uses_the_non_deprecated_names(dist_run) -> None:
    for r in dist_run(_all_reduce_sync_no_warnings, 3, timeout=60):
        assert r["equal"]
        assert r["warnings"] == []  # no FutureWarning from all_gather_into_tensor on torch >= 2.13


def test_compat_falls_back_to_the_old_names(monkeypatch) -> None:
    import importlib

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    try:
        reloaded = importlib.reload(compat)
        assert reloaded._ALL_GATHER is dist.all_gather_into_tensor
        assert reloaded._REDUCE_SCATTER is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(compat)
    assert compat._ALL_GATHER is dist.all_gather_single


def _stochastic_case(rank: int, world_size: int, draws: int) -> dict[str, torch.Tensor]:
    numel = 2048 * world_size
    inputs = [rank_input(r, numel, torch.bfloat16, seed=3) for r in range(world_size)]
    exact = torch.from_numpy(reference_sum(inputs, average=False)[rank * 2048 : (rank + 1) * 2048])
    gen = torch.Generator().manual_seed(100 + rank)
    out = torch.empty(2048, dtype=torch.bfloat16)
    total_up = torch.zeros(2048, dtype=torch.float64)
    outcomes = []
    for _ in range(draws):
        reduce_scatter_fp32_accumulate(out, inputs[rank], rounding="stochastic", generator=gen)
        outcomes.append(out.clone())
        total_up += out.double()
    return {"exact": exact, "outcomes": torch.stack(outcomes), "mean": total_up / draws}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stochastic_rounding_is_unbiased(dist_run, world_size: int) -> None:
    """Each element is one of the two bf16 neighbours of the fp32 sum s, with mean s. Over K draws the
    mean's error, in ulps, has standard deviation at most 1/(2 sqrt K); summed over M elements the
    z-score sum / (sqrt(M) / (2 sqrt K)) exceeds 5 by chance with probability < 1e-6."""
    draws = 64
    for r in dist_run(_stochastic_case, world_size, draws, timeout=120):
        exact, outcomes = r["exact"], r["outcomes"]
        lo, hi = neighbours(exact, torch.bfloat16)
        assert bool(((outcomes == lo) | (outcomes == hi)).all())
        ulp = (hi.double() - lo.double()).abs()
        varying = ulp > 0
        err_ulps = ((r["mean"] - exact.double()) / ulp)[varying]
        z = float(err_ulps.sum()) / (math.sqrt(err_ulps.numel()) / (2 * math.sqrt(draws)))
        assert abs(z) < 5, f"z = {z:.2f}"
        # And it does vary: not a deterministic rounding in disguise.
        assert bool((outcomes != outcomes[0]).any())


def _memory_case(rank: int, world_size: int, numel: int) -> dict[str, int]:
    x = rank_input(rank, numel, torch.bfloat16, seed=4)
    shard = numel // world_size
    out = torch.empty(shard, dtype=torch.bfloat16)
    scratch = torch.empty(numel, dtype=torch.bfloat16)
    _, with_scratch = measure_peak_allocated(reduce_scatter_fp32_accumulate, out, x, scratch=scratch)
    _, without_scratch = measure_peak_allocated(reduce_scatter_fp32_accumulate, out, x)
    out32 = torch.empty(shard, dtype=torch.float32)
    _, fp32_out = measure_peak_allocated(reduce_scatter_fp32_accumulate, out32, x, scratch=scratch)

    def cast_then_reduce() -> None:
        # What a user does without mixprec: an fp32 copy of the whole input, then fp32 reduce-scatter.
        out_f = torch.empty(shard, dtype=torch.float32)
        compat.reduce_scatter_flat(out_f, x.float(), None)
        out.copy_(out_f)

    _, cast = measure_peak_allocated(cast_then_reduce)
    return {"with": with_scratch, "without": without_scratch, "fp32_out": fp32_out, "cast": cast}


@pytest.fixture
def profiler_imported() -> None:
    """The first profiler session in a process imports seconds' worth of modules: pay it once in the
    parent, before the ranks fork."""
    measure_peak_allocated(torch.empty, 1)


def test_extra_memory_is_the_receive_buffer_and_two_fp32_blocks(dist_run, profiler_imported) -> None:
    """Measured from torch's allocator events (torch.profiler, profile_memory): see mixprec.comm.memory.
    The shard is summed and rounded block by block (2**16 elements): an fp32 accumulator block and an fp32
    block for the widened addend, 512 KiB, whatever the size; the fp32 shard itself never exists. The compiled
    sum (mixprec.native) sums each element in registers and allocates nothing."""
    world_size, numel = 4, 1 << 20
    block = 4 * (1 << 16)
    shard_fp32 = 4 * numel // world_size
    for r in dist_run(_memory_case, world_size, numel, timeout=120):
        # The compiled one-pass sum needs no blocks; the torch path's two blocks bound both paths from above.
        assert (0 if mixprec_native.library() else block) <= r["with"] <= 2 * block + 1024  # 1 KiB: allocator rounding
        assert r["without"] <= 2 * block + 1024 + 2 * numel  # + the bf16 receive buffer
        assert r["fp32_out"] <= block + 1024  # fp32 output: its own accumulator; only the widening block
        assert r["with"] < shard_fp32
        # Never an fp32 copy of the input, which the cast-to-fp32 baseline does allocate.
        assert r["without"] < 4 * numel <= r["cast"]


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    errors: list[str] = []

    def expect(exc_type: type[Exception], fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except exc_type as exc:
            errors.append(f"{exc_type.__name__}: {exc}")
        else:
            errors.append(f"no {exc_type.__name__} raised")

    rs, bf16 = reduce_scatter_fp32_accumulate, torch.bfloat16
    bf = torch.zeros(10, dtype=bf16)
    out5 = torch.empty(5, dtype=bf16)
    expect(ValueError, rs, out5, torch.zeros(11, dtype=bf16))
    expect(ValueError, rs, torch.empty(4, dtype=bf16), bf)
    expect(TypeError, rs, torch.empty(5, dtype=torch.float16), bf)
    expect(TypeError, rs, torch.empty(5, dtype=torch.int32), torch.zeros(10, dtype=torch.int32))
    expect(ValueError, rs, out5, torch.zeros(10, 2, dtype=bf16)[:, 0])
    expect(ValueError, rs, torch.empty(5, dtype=torch.float32), bf, rounding="stochastic")
    expect(ValueError, rs, out5, bf, rounding="up")
    expect(ValueError, rs, out5, bf, scratch=torch.empty(9, dtype=bf16))
    expect(TypeError, rs, out5, bf, scratch=torch.empty(10))
    big = torch.zeros(30, dtype=bf16)
    expect(ValueError, rs, big[:5], big[10:20], scratch=big[15:])
    expect(TypeError, rs, out5, bf, average=1)
    expect(ValueError, all_reduce_fp32_accumulate, torch.zeros(7, dtype=bf16))
    expect(TypeError, all_reduce_fp32_accumulate, torch.zeros(8, dtype=torch.float64))
    # all_reduce's errors name its own argument, tensor, not the reduce-scatter's input/output.
    expect(ValueError, all_reduce_fp32_accumulate, torch.zeros(8), rounding="stochastic")
    expect(ValueError, all_reduce_fp32_accumulate, torch.zeros(8, dtype=bf16), scratch=torch.empty(6, dtype=bf16))
    t8 = torch.zeros(8, dtype=bf16)
    expect(ValueError, all_reduce_fp32_accumulate, t8, scratch=t8)
    return errors


def test_bad_shapes_and_dtypes_raise_clear_errors(dist_run) -> None:
    messages = dist_run(_bad_arguments, 2, timeout=60)[0]
    expected_fragments = [
        "not divisible by the group size 2",
        "output must hold input.numel() / group size = 5",
        "output must have dtype torch.bfloat16 or torch.float32",
        "input must have dtype",
        "input must be contiguous",
        "rounding='stochastic' needs a float16/bfloat16 output",
        "rounding must be one of",
        "scratch must hold at least input.numel() = 10",
        "scratch must have dtype torch.bfloat16",
        "scratch must not overlap",
        "average must be a bool",
        "tensor.numel() = 7 is not divisible by the group size 2",
        "tensor must have dtype",
        "rounding='stochastic' needs a float16/bfloat16 tensor; tensor is torch.float32",
        "scratch must hold at least tensor.numel() = 8",
        "scratch must not overlap tensor",
    ]
    assert len(messages) == len(expected_fragments)
    for message, fragment in zip(messages, expected_fragments, strict=True):
        assert fragment in message, (fragment, message)


def test_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        reduce_scatter_fp32_accumulate(torch.empty(1), torch.zeros(2))


def _misuse(rank: int, world_size: int) -> list[str]:
    out = []
    rs, ar = reduce_scatter_fp32_accumulate, all_reduce_fp32_accumulate
    meta = torch.zeros(4, device="meta")
    for call in (
        lambda: ar(torch.zeros(4), group="x"),
        lambda: rs(torch.zeros(2), torch.zeros(4), group="x"),
        lambda: ar(torch.zeros(4), async_op="False"),
        lambda: rs(torch.zeros(2), torch.zeros(4), async_op="False"),
        lambda: ar(meta),
        lambda: rs(torch.zeros(2, device="meta"), meta),
        lambda: rs(torch.zeros(2, dtype=torch.float16), torch.zeros(4)),
    ):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_misuse_gets_one_line_naming_the_argument(dist_run) -> None:
    messages = dist_run(_misuse, 2, timeout=60)[0]
    expected = [
        "TypeError: group must be a torch.distributed ProcessGroup or None; got str",
        "TypeError: group must be a torch.distributed ProcessGroup or None; got str",
        "TypeError: async_op must be a bool",
        "TypeError: async_op must be a bool",
        "ValueError: tensor is a meta tensor",
        "ValueError: input is a meta tensor",
        "TypeError: output must have dtype torch.float32; got torch.float16",  # not "float32 or float32"
    ]
    assert len(messages) == len(expected)
    for message, fragment in zip(messages, expected, strict=True):
        assert message.startswith(fragment) and "\n" not in message, (fragment, message)
