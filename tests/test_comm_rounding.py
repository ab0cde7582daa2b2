"""Stochastic rounding fp32 -> fp16/bf16: only ever the two neighbours, unbiased, reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from dist_reference import neighbours
from mixprec.comm import stochastic_round
from mixprec.core.stochastic import round_into_

LOW = [torch.float16, torch.bfloat16]


def _samples(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """fp32 values over many binades, of both signs, none representable in ``dtype`` by construction
    (a random fp32 mantissa almost never is), plus a few that are."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    x[:16] = x[:16].to(dtype).float()  # exactly representable: must come back unchanged
    return x


@pytest.mark.parametrize("dtype", LOW)
def test_only_the_twoneighbours(dtype: torch.dtype) -> None:
    x = _samples(100_000, dtype)
    # Subnormals of the target and values just below its overflow threshold too.
    tiny = torch.finfo(dtype).tiny
    x = torch.cat([x, torch.linspace(-4 * tiny, 4 * tiny, 1001), torch.tensor([torch.finfo(dtype).max * 0.999])])
    gen = torch.Generator().manual_seed(1)
    lo, hi = neighbours(x, dtype)
    for _ in range(3):
        r = stochastic_round(x, dtype, generator=gen)
        assert r.dtype == dtype
        assert bool(((r == lo) | (r == hi)).all())
    assert torch.equal(stochastic_round(x[:16], dtype, generator=gen), x[:16].to(dtype))


@pytest.mark.parametrize("dtype", LOW)
def test_unbiased_over_many_draws(dtype: torch.dtype) -> None:
    """Each draw is lo + ulp * Bernoulli(p) with p = (x - lo) / ulp, so (r - x) / ulp has mean 0 and
    variance p (1 - p) <= 1/4. Summed over M elements and K draws, z = sum / sqrt(M K / 4) is at most a
    standard normal in spread when unbiased; |z| < 5 fails by chance with probability < 1e-6.
    Round-to-nearest, the control, has a systematic error here and must fail the same test.
    """
    m, k = 20_000, 50
    x = _samples(m, dtype, seed=2)[16:]
    lo, hi = neighbours(x, dtype)
    ulp = (hi.float() - lo.float()).abs()
    keep = ulp > 0
    x, lo, ulp = x[keep], lo[keep], ulp[keep]
    # Put every value 1/8 of an ulp above its toward-zero neighbour: nearest always rounds down.
    x = lo.float() + torch.sign(x) * ulp / 8
    # Errors are measured away from zero, so that nearest's bias (always toward zero here) adds up
    # over both signs instead of cancelling.
    sign = torch.sign(x).double()
    gen = torch.Generator().manual_seed(3)
    scaled_err = torch.zeros((), dtype=torch.float64)
    for _ in range(k):
        r = stochastic_round(x, dtype, generator=gen)
        scaled_err += (sign * (r.double() - x.double()) / ulp.double()).sum()
    z = scaled_err / math.sqrt(x.numel() * k / 4)
    assert abs(float(z)) < 5, f"stochastic rounding looks biased: z = {float(z):.2f}"
    nearest_err = (sign * (x.to(dtype).double() - x.double()) / ulp.double()).sum() * k
    z_nearest = nearest_err / math.sqrt(x.numel() * k / 4)
    assert abs(float(z_nearest)) > 100, "control: round-to-nearest should show its bias here"


def test_mean_of_draws_converges_per_element() -> None:
    """For one value p = 0.3 of an ulp above lo: the fraction rounded up over K draws is within
    6 standard deviations (sqrt(p(1-p)/K)) of 0.3."""
    lo = torch.tensor([1.0], dtype=torch.bfloat16)
    ulp = 2.0**-7
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    r = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(4))
    frac_up = float((r.float() > lo.float()).double().mean())
    assert abs(frac_up - 0.3) < 6 * math.sqrt(0.3 * 0.7 / x.numel())


@pytest.mark.parametrize("dtype", LOW)
def test_special_values_and_overflow(dtype: torch.dtype) -> None:
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e30, -1e30])
    r = stochastic_round(x, dtype, generator=torch.Generator().manual_seed(5))
    if dtype == torch.float16:  # 1e30 is beyond fp16's range: inf, as the nearest cast gives
        expected = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, math.inf, -math.inf])
    else:
        expected = x.clone()
        expected[5:] = r[5:].float()  # bf16 holds 1e30: checked by the neighbour test below
        lo, hi = neighbours(x[5:], dtype)
        assert bool(((r[5:] == lo) | (r[5:] == hi)).all())
    assert torch.equal(torch.signbit(r[:2]), torch.tensor([False, True]))
    torch.testing.assert_close(r.float(), expected, equal_nan=True, rtol=0, atol=0)


def test_reproducible_with_a_seed_and_blockwise() -> None:
    x = _samples((1 << 16) + 77, torch.bfloat16, seed=6)  # crosses the 2**16 block boundary
    a = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(7))
    b = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(7))
    c = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    out = torch.empty((x.numel() // 7, 7), dtype=torch.bfloat16).t()  # non-contiguous destination
    src = x[: out.numel()].reshape(out.shape)
    round_into_(out, src, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    lo, hi = neighbours(src.contiguous(), torch.bfloat16)
    assert bool(((out == lo) | (out == hi)).all())


def test_nearest_is_torch_cast() -> None:
    x = _samples(10_000, torch.float16, seed=9)
    out = torch.empty(x.shape, dtype=torch.float16)
    round_into_(out, x, rounding="nearest")
    assert torch.equal(out, x.to(torch.float16))


def test_bad_arguments() -> None:
    x = torch.randn(4)
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(x, torch.float32)
    with pytest.raises(TypeError, match="floating-point"):
        stochastic_round(torch.arange(4), torch.bfloat16)
    with pytest.raises(ValueError, match="rounding"):
        round_into_(torch.empty(4, dtype=torch.bfloat16), x, rounding="up")
    with pytest.raises(ValueError, match="shape"):
        stochastic_round(x, torch.bfloat16, out=torch.empty(5, dtype=torch.bfloat16))
