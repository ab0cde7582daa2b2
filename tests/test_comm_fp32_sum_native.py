"""The compiled one-pass fp32 sum of ``mixprec.comm.fp32_sum`` against its torch path, bit for bit, on
adversarial inputs: ties, subnormals, signed zeros, infinities, overflow, NaN (the torch path decides its
payload), odd lengths, strided rows, every pair of wire and output dtypes, averaging and a scale factor."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mixprec import native
from mixprec.comm.fp32_sum import sum_shards_into

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _adversarial(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * torch.exp(3 * torch.randn(rows, n, generator=gen))
    info = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 8, info.max, -info.max, float("inf"), float("-inf"),
         1.0, 1.0 + info.eps / 2, 1.0 + 1.5 * info.eps, 3.0 * 2.0**-130, 2.0**-149]
    )  # fmt: skip
    k = min(n, special.numel())
    for r in range(rows):  # specials at the start of every row, and a random scatter
        x[r, :k] = special[torch.randperm(special.numel(), generator=gen)[:k]]
    idx = torch.randint(0, n, (rows, max(1, n // 16)), generator=gen)
    x.scatter_(1, idx, special[torch.randint(0, special.numel(), idx.shape, generator=gen)])
    return x.to(dtype)


def _both(out_dtype: torch.dtype, shards: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for compiled in (True, False):
        out = torch.full((shards.shape[1],), 7.0, dtype=out_dtype)
        if compiled:
            sum_shards_into(out, shards, rounding="nearest", generator=None, **kw)
        else:
            with native.disabled():
                sum_shards_into(out, shards, rounding="nearest", generator=None, **kw)
        outs.append(out.view(_INT[out_dtype]))
    return outs[0], outs[1]


@pytest.mark.skipif(native.library() is None, reason="no compiled kernels on this machine")
@pytest.mark.parametrize("wire", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_compiled_sum_matches_the_torch_path_bit_for_bit(wire: torch.dtype, out_dtype: torch.dtype) -> None:
    for rows, n, average, factor in [
        (1, 1, False, None), (2, 3, True, None), (3, 4095, True, 0.1), (4, 4097, False, 1.0 / 3.0),
        (7, 70001, True, None), (2, 40000, False, 2.0**-7),
    ]:  # fmt: skip
        shards = _adversarial(rows, n, wire, seed=rows * n)
        got, want = _both(out_dtype, shards, average=average, factor=factor)
        assert torch.equal(got, want), (wire, out_dtype, rows, n, average, factor)
        strided = _adversarial(rows, n + 5, wire, seed=n)[:, 2 : n + 2]  # rows apart by more than their length
        got, want = _both(out_dtype, strided, average=average, factor=factor)
        assert torch.equal(got, want), ("strided", wire, out_dtype, rows, n)


@pytest.mark.skipif(native.library() is None, reason="no compiled kernels on this machine")
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_ties_round_to_even_and_nan_follows_the_torch_path(out_dtype: torch.dtype) -> None:
    # bf16 ties: 1 + 2**-8 lies halfway between 1 and 1 + 2**-7; 1 + 3 * 2**-8 between 1 + 2**-7 and 1 + 2**-6
    a = torch.tensor([1.0, 1.0, -1.0, 2.0**-126, 65504.0, 3.0e38], dtype=torch.float32)
    b = torch.tensor([2.0**-8, 3 * 2.0**-8, -(2.0**-8), 2.0**-134, 16.0, 3.0e38], dtype=torch.float32)
    got, want = _both(out_dtype, torch.stack([a, b]), average=False)
    assert torch.equal(got, want)
    nan = torch.stack([a, torch.tensor([float("nan"), 1.0, float("inf"), -float("inf"), 0.0, 1.0])])
    nan[0, 2] = float("-inf")  # -inf + inf: the default NaN
    got, want = _both(out_dtype, nan, average=True)
    assert torch.equal(got, want)


def test_the_torch_path_runs_without_the_library() -> None:
    shards = _adversarial(3, 100, torch.bfloat16, seed=1)
    with native.disabled():
        out = torch.empty(100, dtype=torch.bfloat16)
        sum_shards_into(out, shards, average=True, rounding="nearest", generator=None)
    reference = (shards.float()[0] + shards.float()[1] + shards.float()[2]) / 3
    assert torch.equal(out.view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))


def test_sum_into_a_tensor_saved_for_backward_makes_backward_raise() -> None:
    a = torch.randn(8, requires_grad=True)
    out = torch.randn(8)
    y = (a * out).sum()
    sum_shards_into(out, torch.randn(3, 8), average=False, rounding="nearest", generator=None)
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward()


def test_zero_shards_raise_on_both_paths() -> None:
    for ctx in (native.disabled, contextlib.nullcontext):
        with ctx(), pytest.raises(ValueError, match="shards"):
            sum_shards_into(torch.empty(10), torch.empty(0, 10), average=False, rounding="nearest", generator=None)
