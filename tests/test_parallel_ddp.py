"""mixprec.parallel.DistributedDataParallel on gloo ranks.

Two kinds of reference:
* exact: every rank recomputes every rank's local gradient itself (same model, same microbatch, one
  thread: the same bits), then sums them in fp32 in rank order and divides, which is what the
  "fp32_accumulate" reducer must produce, bit for bit, whatever the bucketing, unused or tied parameters;
* the single-process large-batch gradient, within an error bound derived below for a linear model.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch

from dist_reference import fp32_rank_order_sum, gamma, neighbours
from mixprec.comm.reducer import bucket_multiple
from mixprec.parallel import DistributedDataParallel, FP32AccumulateReducer, NonFiniteGradientWarning
from mixprec.parallel.buckets import build_layout
from mixprec.scaling import DynamicLossScaler


@pytest.fixture(autouse=True, scope="module")
def _import_optimizer_machinery_before_forking() -> None:
    """The first torch optimizer built in a process imports torch._dynamo (seconds). Build one here, in
    the parent, so that the forked ranks inherit the imported modules instead of each paying again."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


class TiedNet(torch.nn.Module):
    """Embedding tied to the output layer, a layer no rank uses, and one only rank 0 uses."""

    def __init__(self, vocab: int = 11, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.unused = torch.nn.Linear(width, 3)
        self.rank0_only = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, use_rank0_layer: bool) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens)))
        if use_rank0_layer:
            h = h + torch.tanh(self.rank0_only(h))
        return self.out(h)


def _tokens(rank: int, microbatch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + microbatch)
    return torch.randint(0, 11, (6,), generator=gen), torch.randint(0, 11, (6,), generator=gen)


def _local_loss(model: torch.nn.Module, rank: int, microbatch: int = 0) -> torch.Tensor:
    x, y = _tokens(rank, microbatch)
    return torch.nn.functional.cross_entropy(model(x, use_rank0_layer=(rank == 0)), y)


def _fp32_mean(per_rank: list[torch.Tensor], wire: torch.dtype) -> torch.Tensor:
    """What fp32_accumulate computes: local grads in the wire dtype, numpy float32 sum in rank order,
    fp32 division by the world size, one rounding to the wire dtype."""
    return fp32_rank_order_sum([g.to(wire) for g in per_rank], average=True).to(wire)


def _exact_case(rank: int, world_size: int, grad_dtype: torch.dtype | None, microbatches: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TiedNet()
    reference_model = copy.deepcopy(model)
    # Small buckets: several per backward, some parameters split off, padding everywhere.
    ddp = DistributedDataParallel(model, bucket_size=200, grad_dtype=grad_dtype)
    launches: list[int] = []
    inner = ddp.reducer

    class Counting:
        def all_reduce(self, bucket, group, *, average, key):
            launches.append(key)
            return inner.all_reduce(bucket, group, average=average, key=key)

        def reduce_scatter(self, shard_out, bucket, group, *, average, key):  # pragma: no cover
            raise AssertionError("not sharded")

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            return None

    ddp.reducer = Counting()
    for mb in range(microbatches):
        if mb < microbatches - 1:
            with ddp.no_sync():
                x, y = _tokens(rank, mb)
                torch.nn.functional.cross_entropy(ddp(x, use_rank0_layer=(rank == 0)), y).backward()
            launched_during_no_sync = len(launches)
        else:
            x, y = _tokens(rank, mb)
            torch.nn.functional.cross_entropy(ddp(x, use_rank0_layer=(rank == 0)), y).backward()
    # Reference: every rank's local gradient (sum over its microbatches), recomputed here.
    wire = grad_dtype or torch.float32
    per_rank: dict[str, list[torch.Tensor]] = {}
    for r in range(world_size):
        ref = copy.deepcopy(reference_model)
        for mb in range(microbatches):
            _local_loss(ref, r, mb).backward()
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            per_rank.setdefault(name, []).append(g.to(wire) if microbatches == 1 or wire == torch.float32 else g)
    return {
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "expected": {name: _fp32_mean(gs, wire).to(torch.float32) for name, gs in per_rank.items()},
        "launches": launches,
        "no_sync_launches": launched_during_no_sync if microbatches > 1 else 0,
        "buckets": ddp.bucket_params(),
        "tied_same_grad": model.out.weight.grad is model.embed.weight.grad,
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_grads_are_the_fp32_mean_of_local_grads_bit_for_bit(dist_run, world_size: int) -> None:
    results = dist_run(_exact_case, world_size, None, 1, timeout=120)
    for r in results:
        for name, g in r["grads"].items():
            assert torch.equal(g, r["expected"][name]), name
        assert r["launches"] == list(range(len(r["buckets"])))  # every bucket once, in order
        assert r["tied_same_grad"]
    # The layer no rank used has a zero gradient; the rank-0-only layer gets rank 0's gradient / P.
    assert float(results[0]["grads"]["unused.weight"].abs().max()) == 0.0
    assert float(results[0]["grads"]["rank0_only.weight"].abs().max()) > 0.0
    # The tied weight appears once, under both names.
    assert any("embed.weight = out.weight" in names for names in results[0]["buckets"])


def test_bf16_wire_for_fp32_params(dist_run) -> None:
    """grad_dtype=bfloat16: local grads rounded to bf16, fp32 sum, one rounding to bf16."""
    for r in dist_run(_exact_case, 3, torch.bfloat16, 1, timeout=120):
        for name, g in r["grads"].items():
            assert g.dtype == torch.float32
            assert torch.equal(g, r["expected"][name]), name


def test_no_sync_accumulates_locally_and_reduces_once(dist_run) -> None:
    for r in dist_run(_exact_case, 2, None, 3, timeout=120):
        assert r["no_sync_launches"] == 0
        assert r["launches"] == list(range(len(r["buckets"])))
        for name, g in r["grads"].items():
            # fp32 microbatch sums: the same additions in the same order as the reference's backward.
            assert torch.equal(g, r["expected"][name]), name


def _linear_case(rank: int, world_size: int, batch: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = torch.nn.Linear(24, 5)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(batch, 24, generator=gen), torch.randn(batch, 5, generator=gen)
    ddp = DistributedDataParallel(model, bucket_size=64)
    rows = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    loss = ((ddp(x[rows]) - y[rows]) ** 2).sum() / (batch // world_size)
    loss.backward()
    return {"w": model.weight.grad.clone(), "b": model.bias.grad.clone()}


def test_grads_match_the_large_batch_reference_within_the_fp32_bound(dist_run) -> None:
    """Linear model, loss (1/B) sum_i |W x_i + b - y_i|^2, gradient (2/B) sum_i r_i x_i^T.

    Error bound (Higham, ch. 3), elementwise, d = 24 inputs, B = 48 samples, P = 3 ranks:
    * the residual r_i = W x_i + b - y_i: a dot product of d + 2 terms, |r^_i - r_i| <= gamma_{d+2} s_i
      with s_i = |W| |x_i| + |b| + |y_i|;
    * each term r_i x_i^T: one more rounding; the local sum of B/P terms and the fp32 sum of P local
      means and the division: at most gamma_{B/P + P + 2} on the absolute sum.
    So |g^ - g| <= (2/B) sum_i (gamma_{d+3} s_i + gamma_{B/P+P+2} |r_i|) |x_i|, computed here in float64.
    The single-process fp32 gradient obeys the same bound with B instead of B/P + P.
    """
    world_size, batch = 3, 48
    results = dist_run(_linear_case, world_size, batch, timeout=60)
    torch.manual_seed(1)
    model = torch.nn.Linear(24, 5)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(batch, 24, generator=gen), torch.randn(batch, 5, generator=gen)
    w, b = model.weight.detach().double(), model.bias.detach().double()
    x64, y64 = x.double(), y.double()
    r = x64 @ w.T + b - y64  # (B, 5)
    exact_w = 2 / batch * r.T @ x64
    exact_b = 2 / batch * r.sum(0)
    s = x64.abs() @ w.abs().T + b.abs() + y64.abs()  # (B, 5)
    g_res, g_sum = gamma(24 + 3), gamma(batch + 2)
    bound_w = 2 / batch * ((g_res * s + g_sum * r.abs()).T @ x64.abs())
    bound_b = 2 / batch * (g_res * s + g_sum * r.abs()).sum(0)
    for res in results:
        assert bool(((res["w"].double() - exact_w).abs() <= bound_w).all())
        assert bool(((res["b"].double() - exact_b).abs() <= bound_b).all())
        assert torch.equal(res["w"], results[0]["w"])
    # The bound is not vacuous: a bf16 reduction's error (rounding the exact gradient to bf16) breaks it.
    bf16_err = (exact_w.to(torch.bfloat16).double() - exact_w).abs()
    assert bool((bf16_err > bound_w).any())


def _broadcast_case(rank: int, world_size: int) -> list[torch.Tensor]:
    torch.manual_seed(rank)  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean.fill_(rank)
    DistributedDataParallel(model)
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def test_parameters_and_buffers_are_broadcast_from_rank0(dist_run) -> None:
    results = dist_run(_broadcast_case, 3, timeout=60)
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    expected[1].running_mean.fill_(0)
    rank0 = [t.detach() for t in [*expected.parameters(), *expected.buffers()]]
    assert len(rank0) == 7  # Linear weight, bias; BatchNorm weight, bias; running_mean, running_var, count
    for rank_tensors in results:
        assert len(rank_tensors) == len(rank0)
        for t, e in zip(rank_tensors, rank0, strict=True):
            assert torch.equal(t, e)
    # Rank 1 started from other weights: the broadcast really replaced them.
    torch.manual_seed(1)
    assert not torch.equal(torch.nn.Linear(4, 4).weight.detach(), results[1][0])


def _events_case(rank: int, world_size: int, overlap: bool) -> list[tuple[str, int]]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    log: list[tuple[str, int]] = []

    def mark_output(j: int):
        def forward_hook(mod: torch.nn.Module, inp: object, out: torch.Tensor) -> None:
            # When the gradient reaches layer j's output, backward is about to run through layer j.
            out.register_hook(lambda g: log.append(("reach", j)))

        return forward_hook

    for j, layer in enumerate(layers):
        layer.register_forward_hook(mark_output(j))
    inner = FP32AccumulateReducer()

    class Recording:
        def all_reduce(self, bucket, group, *, average, key):
            log.append(("launch", key))
            return inner.all_reduce(bucket, group, average=average, key=key)

        def reduce_scatter(self, shard_out, bucket, group, *, average, key):  # pragma: no cover
            raise AssertionError

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            return None

    # One bucket per layer (16*16 + 16 = 272 elements): bucket k holds layer 3 - k.
    ddp = DistributedDataParallel(model, bucket_size=272, reduce=Recording(), overlap=overlap)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    log.append(("backward returned", -1))
    assert ddp.bucket_params()[0] == ("6.bias", "6.weight")
    return log


def test_reductions_start_during_backward(dist_run) -> None:
    """Instrumented, not timed: the order of events "bucket k launched" and "backward reached layer j"."""
    log = dist_run(_events_case, 2, True, timeout=60)[0]
    assert [e for e in log if e[0] == "launch"] == [("launch", k) for k in range(4)]
    # Bucket 0 (the last layer) starts before backward even reaches the first layer, and each bucket
    # k < 3 starts before backward reaches layer 2 - k's predecessor: interleaved, not after.
    assert log.index(("launch", 0)) < log.index(("reach", 0))
    assert log.index(("launch", 1)) < log.index(("reach", 0))
    assert log.index(("launch", 2)) < log.index(("reach", 0))
    assert log[-1] == ("backward returned", -1)
    # Control: with overlap=False every launch comes after backward has passed the first layer.
    log = dist_run(_events_case, 2, False, timeout=60)[0]
    first_launch = next(i for i, e in enumerate(log) if e[0] == "launch")
    assert first_launch > log.index(("reach", 0))


def _overflow_case(rank: int, world_size: int, sharded: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).half()
    ddp = DistributedDataParallel(model, bucket_size=80, sharded_optimizer=sharded)
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        loss = ddp(x).float().square().mean()
        if rank == 1:
            loss = loss * 1e6  # this rank's scaled fp16 gradients overflow; rank 0's do not
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    stepped = scaler.step(opt)
    scaler.update()
    after = [p.detach().clone() for p in model.parameters()]
    return {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)],
        "nonfinite": ddp.last_nonfinite,
        "skipped": scaler.steps_skipped,
        "stepped": stepped,
        "scale": scaler.get_scale(),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


@pytest.mark.parametrize("sharded", [False, True])
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(dist_run, sharded: bool) -> None:
    results = dist_run(_overflow_case, 2, sharded, timeout=60)
    assert results[0]["warnings"] == [] and results[0]["nonfinite"] == []
    assert len(results[1]["nonfinite"]) >= 1
    named = {name for b in results[1]["nonfinite"] for name in b.params}
    assert "0.weight" in named  # the first layer's weight gradient holds the inf
    assert any("holds inf/NaN before reduction" in w and "0.weight" in w for w in results[1]["warnings"])
    for r in results:
        assert r["skipped"] == 1 and r["stepped"] is None
        assert r["unchanged"]
        assert r["scale"] == 2.0**9  # backed off together


class _Checkpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.outer(checkpoint(self.inner, x, use_reentrant=self.use_reentrant))


def _reentrant_checkpoint(rank: int, world_size: int, use_reentrant: bool) -> str:
    torch.manual_seed(0)
    model = _Checkpointed(use_reentrant)
    ddp = DistributedDataParallel(model, bucket_size=20)
    x = torch.randn(2, 4, requires_grad=True)
    try:
        ddp(x).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    ddp(x).sum().backward()  # and the next backward works too
    return "ok"


def test_reentrant_checkpointing_is_refused_with_a_clear_error(dist_run) -> None:
    # The first checkpoint() call in a process costs seconds of lazy imports: pay it once here, before
    # the ranks fork, instead of in every rank of both runs.
    _Checkpointed(False)(torch.randn(1, 4, requires_grad=True)).sum().backward()
    for message in dist_run(_reentrant_checkpoint, 2, True, timeout=60):
        assert "use_reentrant=False" in message
    assert dist_run(_reentrant_checkpoint, 2, False, timeout=60) == ["ok", "ok"]


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    out = []
    model = torch.nn.Linear(2, 2)
    for kwargs in (
        {"bucket_size": 0},
        {"grad_dtype": torch.float64},
        {"grad_dtype": "bf16"},
        {"reduce": "bogus"},
        {"reduce": FP32AccumulateReducer(), "reduce_options": {"rounding": "stochastic"}},
        {"reduce": 3},
        {"overlap": 1},
    ):
        try:
            DistributedDataParallel(model, **kwargs)
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    try:
        DistributedDataParallel(torch.nn.ReLU())
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_bad_arguments_raise_clear_errors(dist_run) -> None:
    messages = dist_run(_bad_arguments, 2, timeout=60)[0]
    fragments = [
        "bucket_size must be an int >= 1",
        "grad_dtype must be one of",
        "grad_dtype must be a torch.dtype",
        "unknown reducer 'bogus'",
        "reduce_options only apply",
        "reduce must be a reducer name or a GradReducer",
        "overlap must be a bool",
        "no parameters that require grad",
    ]
    for message, fragment in zip(messages, fragments, strict=True):
        assert fragment in message, (fragment, message)


def _sparse_grad(rank: int, world_size: int) -> str:
    model = torch.nn.Embedding(10, 4, sparse=True)
    ddp = DistributedDataParallel(model)
    try:
        ddp(torch.tensor([1, 2])).sum().backward()
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_sparse_gradients_are_refused(dist_run) -> None:
    for message in dist_run(_sparse_grad, 2, timeout=60):
        assert "weight has a sparse gradient" in message


def test_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


def test_layout_pads_buckets_and_shards_cover_each_parameter_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.Linear(30, 7), torch.nn.Linear(7, 1000))
    named = list(model.named_parameters())
    for world_size in (1, 2, 3, 4, 6):
        layout = build_layout(named, world_size=world_size, bucket_size=500, grad_dtype=None)
        multiple = bucket_multiple(world_size)
        assert all(b.numel % multiple == 0 and b.numel >= b.used for b in layout.buckets)
        # Reverse registration order: the first bucket holds the last layer (7000 elements, alone).
        assert [s.name for s in layout.buckets[0].slots] == ["2.bias"]
        assert [s.name for s in layout.buckets[1].slots] == ["2.weight"]
        covered = {s.name: torch.zeros(s.numel, dtype=torch.int32) for s in layout.slots}
        for bucket in layout.buckets:
            for rank in range(world_size):
                for piece in layout.pieces(bucket, rank):
                    covered[piece.slot.name][piece.param_start : piece.param_stop] += 1
        assert all(bool((c == 1).all()) for c in covered.values())
        assert sum(layout.group_numel) == sum(b.numel for b in layout.buckets)
    mixed = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),
        ("b", torch.zeros(5)),
        ("c", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    layout = build_layout(mixed, world_size=2, bucket_size=100, grad_dtype=None)
    assert layout.groups == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["c", "a"], ["b"]]
    layout = build_layout(mixed, world_size=2, bucket_size=100, grad_dtype=torch.float32)
    assert layout.groups == [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    assert math.lcm(2, 128) == layout.buckets[0].numel


def _stochastic_ddp_case(rank: int, world_size: int) -> dict[str, object]:
    """fp32 model, bf16 wire, stochastic rounding of the fp32 mean; then the per-rank reducer state resumes
    the stream exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    reference_model = copy.deepcopy(model)
    options = {"rounding": "stochastic", "seed": 77}
    ddp = DistributedDataParallel(model, bucket_size=400, grad_dtype=torch.bfloat16, reduce_options=options)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(rank))

    def backward(wrapper: DistributedDataParallel) -> list[torch.Tensor]:
        wrapper.module.zero_grad(set_to_none=True)
        wrapper(x).square().mean().backward()
        return [p.grad.clone() for p in wrapper.module.parameters()]

    first = backward(ddp)
    saved = ddp.reducer_state_dict()
    second = backward(ddp)
    # A fresh wrapper on the same model: load this rank's state and draw the second step's bits again.
    ddp.remove_hooks()
    resumed = DistributedDataParallel(model, bucket_size=400, grad_dtype=torch.bfloat16, reduce_options=options)
    resumed.load_reducer_state_dict(saved)
    again = backward(resumed)
    errors = []
    other = dict(saved, rank=1 - rank)
    for bad in ({"format": "x"}, other, dict(saved, world_size=world_size + 1)):
        try:
            resumed.load_reducer_state_dict(bad)
        except ValueError as exc:
            errors.append(str(exc))
    per_rank = []
    for r in range(world_size):
        m = copy.deepcopy(reference_model)
        m(torch.randn(6, 24, generator=torch.Generator().manual_seed(r))).square().mean().backward()
        per_rank.append([p.grad.to(torch.bfloat16) for p in m.parameters()])
    exact = [fp32_rank_order_sum([g[i] for g in per_rank], average=True) for i in range(len(per_rank[0]))]
    return {"first": first, "second": second, "again": again, "exact": exact, "errors": errors, "saved": saved}


def test_stochastic_reducer_through_ddp_and_its_per_rank_state(dist_run) -> None:
    results = dist_run(_stochastic_ddp_case, 2, timeout=60)
    for r in results:
        assert r["saved"]["state"]["rounding"] == "stochastic" and "generator_state" in r["saved"]["state"]
        for g1, g2, g3, exact in zip(r["first"], r["second"], r["again"], r["exact"], strict=True):
            lo, hi = neighbours(exact, torch.bfloat16)
            for g in (g1, g2):
                # Each element is one of the two bf16 neighbours of the exact fp32 mean...
                assert bool(((g == lo.float()) | (g == hi.float())).all())
            assert torch.equal(g2, g3)  # ...and the loaded state replays the stream bit for bit
        # Stochastic, not nearest in disguise: over ~1.1k elements some round away from the nearest value.
        assert any(
            not torch.equal(g, e.to(torch.bfloat16).float()) for g, e in zip(r["first"], r["exact"], strict=True)
        )
        assert any(not torch.equal(a, b) for a, b in zip(r["first"], r["second"], strict=True))
        fragments = ["must come from DistributedDataParallel.reducer_state_dict()", "saved by rank", "world size 3"]
        for message, fragment in zip(r["errors"], fragments, strict=True):
            assert fragment in message, (fragment, message)
    # Ranks hold identical reduced gradients (all-gathered), but their generator states differ.
    assert all(torch.equal(a, b) for a, b in zip(results[0]["first"], results[1]["first"], strict=True))
    assert not torch.equal(
        results[0]["saved"]["state"]["generator_state"], results[1]["saved"]["state"]["generator_state"]
    )


def test_no_sync_with_a_bf16_wire_accumulates_in_the_parameter_dtype(dist_run) -> None:
    """Narrower wire: fp32 parameters, bf16 wire, 4 microbatches. The microbatches add up in fp32 in param.grad (the
    same additions, in the same order, as the reference's backward), the window's total is rounded to bf16
    once, then summed in fp32 and rounded once: equal bit for bit to that reference. Accumulating in the
    bf16 buffer instead rounds 3 more times per element and fails this on random data."""
    for r in dist_run(_exact_case, 2, torch.bfloat16, 4, timeout=120):
        assert r["no_sync_launches"] == 0
        for name, g in r["grads"].items():
            assert g.dtype == torch.float32
            assert torch.equal(g, r["expected"][name]), name


class _FailingReducer:
    """fp32_accumulate, except that the handle of bucket ``fail_key`` raises after its reduction finished."""

    def __init__(self, fail_key: int) -> None:
        from mixprec.comm import make_reducer

        self.inner = make_reducer("fp32_accumulate")
        self.fail_key = fail_key
        self.inject = True
        self.handles: list = []

    def all_reduce(self, bucket, group, *, average, key):
        inner = self.inner.all_reduce(bucket, group, average=average, key=key)
        self.handles.append(inner)
        if key != self.fail_key or not self.inject:
            return inner

        class Failing:
            def wait(self) -> None:
                inner.wait()
                raise RuntimeError("injected wait failure")

        return Failing()

    def reduce_scatter(self, shard_out, bucket, group, *, average, key):  # pragma: no cover
        raise AssertionError("not sharded")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


def _failing_wait_case(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TiedNet()
    reference_model = copy.deepcopy(model)
    reducer = _FailingReducer(fail_key=0)  # the first bucket: every later one is still to be waited for
    ddp = DistributedDataParallel(model, bucket_size=200, reduce=reducer)
    n_buckets = len(ddp.layout.buckets)
    try:
        _local_loss(ddp, rank).backward()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    all_finished = all(h.is_completed() for h in reducer.handles)
    left_in_pool_queue = len(reducer.inner._pending)
    # The next iteration starts clean and reduces correctly.
    reducer.inject = False
    reducer.handles.clear()
    model.zero_grad(set_to_none=True)
    _local_loss(ddp, rank, microbatch=1).backward()
    per_rank: dict[str, list[torch.Tensor]] = {}
    for r in range(world_size):
        ref = copy.deepcopy(reference_model)
        _local_loss(ref, r, 1).backward()
        for name, p in ref.named_parameters():
            per_rank.setdefault(name, []).append(p.grad if p.grad is not None else torch.zeros_like(p))
    exact = all(torch.equal(p.grad, _fp32_mean(per_rank[name], torch.float32)) for name, p in model.named_parameters())
    return {
        "error": error,
        "buckets": n_buckets,
        "all_finished": all_finished,
        "left": left_in_pool_queue,
        "exact": exact,
    }


def test_a_failing_wait_still_finishes_every_other_reduction(dist_run) -> None:
    """When one bucket's wait() raises at the end of backward, the wrapper still waits for every other
    started reduction before resetting (none is left to finish later, out of step with the other ranks),
    the error reaches the caller, and the next backward reduces correctly."""
    for r in dist_run(_failing_wait_case, 2, timeout=120):
        assert r["buckets"] >= 3
        assert "injected wait failure" in r["error"]
        assert r["all_finished"]
        assert r["left"] == 0
        assert r["exact"]


def _native_sharded_local_grads(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = TiedNet()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size=200, reduce="native", sharded_optimizer=True)
    _local_loss(ddp, rank).backward()
    _local_loss(reference, rank).backward()
    return all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if q.grad is not None
    )


def test_native_reducer_leaves_the_local_gradient_in_sharded_mode(dist_run) -> None:
    """param.grad views the bucket in sharded mode and must keep the local, unreduced gradient, so the
    native reducer pre-divides a copy, not the bucket."""
    assert all(dist_run(_native_sharded_local_grads, 2, timeout=60))


def _widening_case(rank: int, world_size: int, microbatches: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TiedNet().to(torch.bfloat16)
    reference_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size=200, grad_dtype=torch.float32)
    for mb in range(microbatches):
        ctx = ddp.no_sync() if mb < microbatches - 1 else contextlib.nullcontext()
        with ctx:
            _local_loss(ddp, rank, mb).backward()
    # Reference: each microbatch's bf16 gradient on its own, widened and added in fp32 in microbatch order
    # (the buffer), then the fp32 rank-order mean, rounded once to bf16.
    per_rank: dict[str, list[torch.Tensor]] = {}
    for r in range(world_size):
        window: dict[str, list[torch.Tensor]] = {}
        for mb in range(microbatches):
            ref = copy.deepcopy(reference_model)
            _local_loss(ref, r, mb).backward()
            for name, p in ref.named_parameters():
                window.setdefault(name, []).append(p.grad if p.grad is not None else torch.zeros_like(p))
        for name, grads in window.items():
            per_rank.setdefault(name, []).append(fp32_rank_order_sum(grads))
    expected = {name: fp32_rank_order_sum(gs, average=True).to(torch.bfloat16) for name, gs in per_rank.items()}
    return {
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "expected": expected,
    }


def test_no_sync_with_fp32_buffers_for_bf16_params_accumulates_in_fp32(dist_run) -> None:
    """Wider buffer, the other direction: bf16 parameters with grad_dtype=float32 accumulate the microbatches in the
    fp32 buffer (the wider dtype), not in bf16 param.grad: equal bit for bit to the fp32 reference."""
    for r in dist_run(_widening_case, 2, 3, timeout=120):
        for name, g in r["grads"].items():
            assert g.dtype == torch.bfloat16
            assert torch.equal(g, r["expected"][name]), name


# ---------------------------------------------------------------------- bucket padding
def _padded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 10*7 + 7 + 7*3 + 3 = 101 elements in one bucket of 128 at 2 ranks: 27 elements of padding.
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _padded_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(10 * step + rank))


def _padding(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    buffer = ddp.grad_buffer
    return [buffer.bucket(k)[b.used :].clone() for k, b in enumerate(buffer.layout.buckets)]


class _PaddingVandal:
    """fp32_accumulate, then writes NaN (first call of each bucket) or huge finite garbage (later calls) into
    the bucket's padding, as a reducer may: the contract does not forbid writing there."""

    def __init__(self, used: dict[int, int]) -> None:
        from mixprec.comm import make_reducer

        self.inner = make_reducer("fp32_accumulate")
        self.used = used
        self.calls: dict[int, int] = {}

    def _spoil(self, bucket: torch.Tensor, key: int) -> None:
        first = self.calls.get(key, 0) == 0
        self.calls[key] = self.calls.get(key, 0) + 1
        bucket[self.used[key] :] = math.nan if first else 1e30

    def all_reduce(self, bucket, group, *, average, key):
        handle = self.inner.all_reduce(bucket, group, average=average, key=key)

        class Spoiling:
            def wait(inner_self) -> None:
                handle.wait()
                self._spoil(bucket, key)

        return Spoiling()

    def reduce_scatter(self, shard_out, bucket, group, *, average, key):
        handle = self.inner.reduce_scatter(shard_out, bucket, group, average=average, key=key)

        class Spoiling:
            def wait(inner_self) -> None:
                handle.wait()
                self._spoil(bucket, key)  # the contract lets reduce_scatter use the bucket as scratch

        return Spoiling()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


def _vandal_case(rank: int, world_size: int, sharded: bool) -> dict[str, object]:
    model = _padded_model()
    reference_model = copy.deepcopy(model)
    layout = build_layout(
        [(n, p) for n, p in model.named_parameters()], world_size=world_size, bucket_size=10_000, grad_dtype=None
    )
    reducer = _PaddingVandal({b.index: b.used for b in layout.buckets})
    ddp = DistributedDataParallel(model, bucket_size=10_000, reduce=reducer, sharded_optimizer=sharded)
    steps = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp(_padded_batch(rank, step)).square().mean().backward()
        per_rank = []
        for r in range(world_size):
            ref = copy.deepcopy(reference_model)
            ref(_padded_batch(r, step)).square().mean().backward()
            per_rank.append([p.grad for p in ref.parameters()])
        expected = [fp32_rank_order_sum([g[i] for g in per_rank], average=True) for i in range(len(per_rank[0]))]
        shard = ddp.shard_grads
        steps.append(
            {
                "padding_zero": all(bool((pad == 0).all()) for pad in _padding(ddp)),
                "warned": [str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)],
                "nonfinite": list(ddp.last_nonfinite),
                "exact": sharded
                or all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True)),
                "shard_finite": shard is None or bool(torch.isfinite(shard).all()),
            }
        )
    return {"steps": steps}


@pytest.mark.parametrize("sharded", [False, True])
def test_whatever_a_reducer_leaves_in_the_padding_never_reaches_the_next_step(dist_run, sharded: bool) -> None:
    """A reducer that writes NaN, then huge values, into the bucket padding: the buffer zeroes the padding,
    so every step's gradients stay the exact fp32 mean, no later bucket is reported non-finite and the
    padding is zero between steps."""
    for r in dist_run(_vandal_case, 2, sharded, timeout=60):
        for step in r["steps"]:
            assert step["padding_zero"], step
            assert step["warned"] == [] and step["nonfinite"] == [], step
            assert step["exact"] and step["shard_finite"], step


def _uint8_nan_case(rank: int, world_size: int, check_finite: str) -> dict[str, object]:
    model = _padded_model()
    clean_model = copy.deepcopy(model)
    options = {"chunk_size": 128, "check_finite": check_finite}
    ddp = DistributedDataParallel(model, bucket_size=10_000, reduce="uint8", reduce_options=options, check_finite=False)
    clean = DistributedDataParallel(clean_model, bucket_size=10_000, reduce="uint8", reduce_options=options)
    out: dict[str, object] = {"errors": [], "finite": [], "padding_zero": [], "same_as_clean": []}
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = ddp(_padded_batch(rank, step)).square().mean()
        if step == 0 and rank == 1:
            loss = loss * math.nan  # one NaN batch on one rank
        try:
            loss.backward()
            out["errors"].append("")
        except ValueError as exc:
            out["errors"].append(str(exc))
        out["padding_zero"].append(all(bool((pad == 0).all()) for pad in _padding(ddp)))
        if step > 0:
            out["finite"].append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            # A wrapper that never saw the NaN step reduces the same local gradients to the same bits.
            clean_model.zero_grad(set_to_none=True)
            clean(_padded_batch(rank, step)).square().mean().backward()
            out["same_as_clean"].append(
                all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), clean_model.parameters()))
            )
    return out


@pytest.mark.parametrize("check_finite", ["flag", "raise"])
def test_uint8_training_recovers_from_one_nan_step(dist_run, check_finite: str) -> None:
    """The "uint8" reducer decodes whole chunks, padding included; a NaN step used to leave NaN there for good
    (every later step non-finite, or raising with check_finite="raise")."""
    for r in dist_run(_uint8_nan_case, 2, check_finite, timeout=120):
        if check_finite == "raise":
            assert "NaN or Inf" in r["errors"][0], r["errors"]
        assert r["errors"][1:] == ["", ""], r["errors"]
        assert r["finite"] == [True, True]
        assert r["same_as_clean"] == [True, True]
        assert r["padding_zero"] == [True, True, True]


# ---------------------------------------------------------------------- construction checks
def _mismatch_case(rank: int, world_size: int, kind: str) -> str:
    width = 4
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, width)]
    if rank == 1:
        if kind == "shape":
            layers = [torch.nn.Linear(4, width + 1)]
        elif kind == "count":
            layers.append(torch.nn.Linear(width, width))
    model = torch.nn.Sequential(*layers)
    if rank == 1 and kind == "dtype":
        model = model.to(torch.bfloat16)
    if rank == 1 and kind == "refused_dtype":  # a dtype the buffer refuses, on one rank only
        model = model.double()
    try:
        DistributedDataParallel(model, bucket_size=10)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("shape", "rank 0 has parameter 0.weight of shape (4, 4), torch.float32, requires_grad; rank 1 has "),
        ("count", "rank 0 has 2 parameters and buffers, rank 1 has 4"),
        ("dtype", "rank 1 has parameter 0.weight of shape (4, 4), torch.bfloat16"),
        ("refused_dtype", "rank 1 has parameter 0.weight of shape (4, 4), torch.float64"),
    ],
)
def test_different_models_on_different_ranks_are_refused_on_every_rank(dist_run, kind: str, fragment: str) -> None:
    """As torch DDP's _verify_param_shape_across_processes: one clear ValueError on every rank, not a broadcast
    that mixes shapes (it used to return without a word)."""
    for message in dist_run(_mismatch_case, 2, kind, timeout=60):
        assert "same module on every rank" in message and fragment in message, message
        assert "\n" not in message


def _bad_parameter_dtypes(rank: int, world_size: int) -> list[str]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that complex modules are experimental
        cases = [
            ({}, torch.nn.Linear(2, 2).to(torch.float8_e4m3fn)),
            ({}, torch.nn.Linear(2, 2).to(torch.complex64)),
            ({}, torch.nn.Linear(2, 2).double()),
            ({"group": "x"}, torch.nn.Linear(2, 2)),
        ]
        for kwargs, model in cases:
            try:
                DistributedDataParallel(model, **kwargs)
                out.append("no error")
            except (TypeError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_parameter_dtypes_and_group_are_checked_before_any_collective(dist_run) -> None:
    fragments = [
        "TypeError: parameter weight has dtype torch.float8_e4m3fn: DistributedDataParallel reduces float16",
        "TypeError: parameter weight has dtype torch.complex64",
        "TypeError: parameter weight has dtype torch.float64 and grad_dtype=None",
        "TypeError: group must be a torch.distributed ProcessGroup or None; got str",
    ]
    for messages in dist_run(_bad_parameter_dtypes, 2, timeout=60):
        assert len(messages) == len(fragments)
        for message, fragment in zip(messages, fragments, strict=True):
            assert message.startswith(fragment) and "\n" not in message, (fragment, message)


def _fp64_with_grad_dtype(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    ddp = DistributedDataParallel(model, grad_dtype=torch.float32)
    ddp(torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))).sum().backward()
    return model.weight.grad.dtype == torch.float64 and bool(torch.isfinite(model.weight.grad).all())


def test_fp64_parameters_reduce_through_an_explicit_grad_dtype(dist_run) -> None:
    assert dist_run(_fp64_with_grad_dtype, 2, timeout=60) == [True, True]


def _uint8_resume_case(rank: int, world_size: int, error_feedback: bool) -> bool:
    """Stochastic uint8: the reducer state saved after step 0 replays step 1 bit for bit in a fresh wrapper,
    which starts with zero padding; leftovers in the running wrapper's padding used to make it differ."""
    torch.manual_seed(0)
    # 160 elements in a bucket of 256 at 2 ranks: the second 128-element chunk holds 32 weights of both signs
    # (so zero is not on its grid and the decoded padding is not zero) and 96 elements of padding.
    model = torch.nn.Linear(159, 1)
    resumed_model = copy.deepcopy(model)
    options = {"chunk_size": 128, "rounding": "stochastic", "seed": 5, "error_feedback": error_feedback}
    ddp = DistributedDataParallel(model, bucket_size=10_000, reduce="uint8", reduce_options=options)

    def backward(wrapper: DistributedDataParallel, step: int) -> None:
        x = torch.randn(4, 159, generator=torch.Generator().manual_seed(10 * step + rank))
        # Step 1's gradients are 1e-6 of step 0's: a leftover of step 0 in the padding would set the range.
        (wrapper(x).square().mean() * (1.0 if step == 0 else 1e-6)).backward()

    backward(ddp, 0)
    saved = copy.deepcopy(ddp.reducer_state_dict())
    model.zero_grad(set_to_none=True)
    backward(ddp, 1)
    resumed = DistributedDataParallel(resumed_model, bucket_size=10_000, reduce="uint8", reduce_options=options)
    resumed.load_reducer_state_dict(saved)
    backward(resumed, 1)
    return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("error_feedback", [False, True])
def test_stochastic_uint8_resumes_bit_for_bit(dist_run, error_feedback: bool) -> None:
    assert dist_run(_uint8_resume_case, 2, error_feedback, timeout=120) == [True, True]
