"""mixprec against Megatron-Core itself (the ``peers`` extra, ``pip install -e '.[dev,peers]'``).

* ``scaler_from("megatron")`` against ``megatron.core.optimizer.grad_scaler.DynamicGradScaler`` (and
  ``ConstantGradScaler``) on random and adversarial overflow sequences, and resumed from its ``state_dict()``.
  Megatron puts its scale, floor and factors on ``device='cuda'``; here a torch function mode creates them on the
  CPU instead (and makes ``Tensor.cuda`` a no-op for ``load_state_dict``): the same fp32 arithmetic.
* ``reduce_scatter_fp32_accumulate`` against ``megatron.core.distributed.reduce_scatter_with_fp32_accumulation``
  on 2-4 gloo ranks: identical bits for fp16, bf16 and fp32 inputs, inf and NaN included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from mixprec.comm import reduce_scatter_fp32_accumulate
from mixprec.scaling import StaticLossScaler, scaler_from
from scaling_reference import CUT, PEERS_MISSING, adversarial, compare, importing_peer, random_sequences, run_ours

with importing_peer():
    pytest.importorskip("megatron.core", reason=PEERS_MISSING)
    from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
        reduce_scatter_with_fp32_accumulation,
    )
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


@pytest.fixture(autouse=True)
def _most_sequences_compared_in_full():
    CUT.update(sequences=0, cut=0)
    yield
    assert CUT["cut"] <= 0.3 * CUT["sequences"], CUT


class _CudaOnCpu(TorchFunctionMode):
    """Factory calls that ask for ``device='cuda'`` get the CPU; ``Tensor.cuda(...)`` returns the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # only an argument of Tensor.cuda here
    with _CudaOnCpu():
        yield


def _drive(scaler, seq):
    scales = []
    for overflow in seq:
        scaler.update(overflow)
        scales.append(float(scaler.scale.item()))
    return scales, None


MEGATRON_CONFIGS = [
    # initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
    (2.0**16, 1.0, 2.0, 0.5, 3, 2),
    (2.0**12, 4.0, 2.0, 0.5, 1, 1),
    (1000.0, 1.0, 1.5, 0.3, 2, 3),  # non-power-of-two factors: fp32 arithmetic on both sides
    (2.0**20, 0.5, 4.0, 0.25, 5, 2),
    (2.0**32, 1.0, 2.0, 0.5, 4, 2),  # Megatron's OptimizerConfig defaults, with a short interval
]


@pytest.mark.parametrize(("initial", "min_scale", "growth", "backoff", "interval", "hysteresis"), MEGATRON_CONFIGS)
def test_dynamic_grad_scaler_itself(on_cpu, initial, min_scale, growth, backoff, interval, hysteresis):
    kw = dict(
        initial_scale=initial,
        min_scale=min_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
    )
    floors = 0
    for seq in random_sequences(24, 150, seed=interval) + adversarial(interval, hysteresis):
        theirs = DynamicGradScaler(**kw)
        assert theirs.scale.device.type == "cpu"
        want = _drive(theirs, seq)
        floors += want[0][-1] == _f32(min_scale)
        assert compare(want, scaler_from("megatron", **kw), seq)[1] is None
    assert floors >= 3  # not vacuous: the floor is reached, and held, on several sequences


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def test_resume_from_dynamic_grad_scaler_state(on_cpu):
    kw = dict(initial_scale=2.0**14, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    seqs = random_sequences(16, 90, seed=21)
    negative = 0
    for seq in seqs:
        theirs = DynamicGradScaler(**kw, hysteresis=2)
        _drive(theirs, seq[:40])
        state = theirs.state_dict()
        negative += state["hysteresis_tracker"] < 0  # Megatron lets it go below zero on overflows in a row
        ours = scaler_from("megatron", state_dict=state, **kw, hysteresis=2)
        want = _drive(theirs, seq[40:])
        compare(want, ours, seq[40:])
        again = DynamicGradScaler(**kw, hysteresis=2)  # Megatron resuming from the same state: the same reference
        again.load_state_dict(state)
        assert _drive(again, seq[40:]) == want
    assert negative >= 1


def test_constant_grad_scaler(on_cpu):
    theirs = ConstantGradScaler(1024.0)
    ours = scaler_from("megatron", loss_scale=1024.0, state_dict=theirs.state_dict())
    assert isinstance(ours, StaticLossScaler)
    seq = [True, False, True]
    assert _drive(theirs, seq) == run_ours(ours, seq) == ([1024.0] * 3, None)


# ---------------------------------------------------------------------------------------------- collectives
def _reduce_scatter_both(rank, world_size, dtype, out_dtype, shard, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = shard * world_size
    # magnitudes over many binades, so that the order and precision of the additions show in the low bits
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float())).to(dtype)
    for start in range(0, n, shard):  # in every rank's shard: this rank's inf and NaN
        x[start + 3 * rank] = float("inf")
        x[start + 3 * rank + 1] = float("nan")
        if rank == 1:
            x[start] = -float("inf")  # meets rank 0's +inf: NaN
    theirs = torch.empty(shard, dtype=out_dtype)
    reduce_scatter_with_fp32_accumulation(theirs, x.clone(), dist.ReduceOp.SUM, None, False)
    theirs_async = torch.empty(shard, dtype=out_dtype)
    reduce_scatter_with_fp32_accumulation(theirs_async, x.clone(), dist.ReduceOp.SUM, None, True).wait()
    ours = torch.empty(shard, dtype=out_dtype)
    reduce_scatter_fp32_accumulate(ours, x.clone())
    # the wire-dtype sum of a backend's reduce-scatter, rounded after every addition: must differ somewhere
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(gathered, x)
    wire = gathered[0][rank * shard : (rank + 1) * shard].clone()
    for q in range(1, world_size):
        wire = wire + gathered[q][rank * shard : (rank + 1) * shard]
    return theirs, theirs_async, ours, wire.to(out_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    as_int = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(as_int)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_reduce_scatter_with_fp32_accumulation_itself(dist_run, world_size, dtype, out_dtype):
    results = dist_run(_reduce_scatter_both, world_size, dtype, out_dtype, 4099, world_size)
    differs = 0
    for theirs, theirs_async, ours, wire in results:
        assert torch.equal(_bits(theirs), _bits(theirs_async))
        nan = torch.isnan(theirs)
        assert torch.equal(nan, torch.isnan(ours)) and nan.any()
        assert torch.equal(_bits(theirs[~nan]), _bits(ours[~nan]))  # inf included, by sign
        assert torch.isinf(theirs).any()
        differs += int((wire[~nan] != theirs[~nan]).sum())
    if world_size >= 3 and dtype != torch.float32:
        assert differs > 0  # not vacuous: rounding after every addition would have shown
