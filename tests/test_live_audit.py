"""The live numerics audit (mixprec.comm.live_audit) on gloo ranks: the wrapper's and the hooks' ``audit_every``.

References: the exact reduction against numpy's fp64 sum of every rank's bucket (each rank regenerates all
ranks' gradients from their seeds); the backend's all-reduce against gloo's ring model; the metrics against
hand-computed values on crafted buckets; fp32 accumulation's error against its bound (one rounding to bf16,
u = 2^-8, plus the fp32 sum's gamma_P of sum |x|, Higham's bound).
"""

from __future__ import annotations

import importlib
import math
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mixprec.hooks
from mixprec.comm.live_audit import MAX_EFFECTIVE_BITS, LiveAudit, check_audit_every, error_metrics
from mixprec.comm.models import gloo_ring_sum
from mixprec.comm.topology import Topology
from mixprec.parallel import DistributedDataParallel, NonFiniteGradientWarning
from mixprec.testing import run_distributed

U_BF16 = 2.0**-8
U_FP32 = 2.0**-24
SIZES = (384, 256)  # two parameters: two buckets with bucket_size=384


@pytest.fixture(autouse=True, scope="module")
def _import_optimizer_machinery_before_forking() -> None:
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    importlib.import_module("torch._dynamo")  # torch DDP imports it: once here, not in every forked rank


class VecNet(torch.nn.Module):
    """loss = sum_i <p_i, c_i>: the gradient of parameter i is the constant c_i, chosen per rank and step."""

    def __init__(self, sizes: tuple[int, ...] = SIZES) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, consts: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.ps, consts, strict=True))


def _grads(rank: int, step: int, sizes: tuple[int, ...] = SIZES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(n, generator=gen) * 2.0 ** torch.randint(-6, 6, (n,), generator=gen) for n in sizes]


def _setup() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)


# ---------------------------------------------------------------------- metrics (no process group)
def test_metrics_on_a_crafted_case() -> None:
    exact = torch.tensor([1.0, 2.0, 0.0, 4.0, -8.0], dtype=torch.float64)
    result = torch.tensor([1.0, 2.5, 0.0, 4.0, -8.0])
    m, lost = error_metrics(result, exact)
    rel = 0.5 / math.sqrt(1 + 4 + 16 + 64)
    assert m.rel_l2 == pytest.approx(rel, rel=1e-15)
    assert (m.max_abs, m.max_rel, lost) == (0.5, 0.25, 0)
    assert m.effective_bits == pytest.approx(-math.log2(rel), rel=1e-15)
    same, _ = error_metrics(exact.float(), exact)
    assert (same.rel_l2, same.max_abs, same.effective_bits) == (0.0, 0.0, MAX_EFFECTIVE_BITS)
    wide = result.double()
    assert error_metrics(wide, exact)[0] == m
    assert torch.equal(wide, result.double()) and exact[1] == 2.0  # neither input is modified


def test_metrics_leave_out_nonfinite_inputs_and_count_overflows() -> None:
    exact = torch.tensor([1.0, math.nan, 2.0, math.inf], dtype=torch.float64)
    result = torch.tensor([1.0, math.nan, math.inf, math.inf])
    m, lost = error_metrics(result, exact)
    assert lost == 1  # element 2: exact 2, reduced inf
    assert (m.rel_l2, m.max_abs) == (0.0, 0.0)  # over element 0 only: finite, not NaN


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_audit_every_value(bad: int) -> None:
    with pytest.raises(ValueError, match="audit_every"):
        check_audit_every(bad)


@pytest.mark.parametrize("bad", [True, 2.0, "10"])
def test_bad_audit_every_type(bad: object) -> None:
    with pytest.raises(TypeError, match="audit_every"):
        LiveAudit(bad)  # type: ignore[arg-type]


def test_schedule_audits_steps_n_2n_and_every_bucket_in_turn() -> None:
    audit = LiveAudit(3)
    picks = [audit.new_step(2) for _ in range(12)]
    assert picks == [None, None, 0, None, None, 1, None, None, 0, None, None, 1]
    assert [LiveAudit(None).new_step(2) for _ in range(3)] == [None] * 3


# ---------------------------------------------------------------------- the audit's collectives
def _begin_case(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    _setup()
    bucket = torch.cat(_grads(rank, 0)).to(torch.bfloat16)
    audit = LiveAudit(1)
    audit.new_step(1)
    pending = audit.begin(bucket, None, average=True, native=True, index=0)
    before = bucket.clone()
    out = {"exact": pending.exact.clone(), "native": pending.native.clone(), "bucket_after": before}
    result = pending.finish(pending.native)  # the backend's result measured as if it were the reducer's
    out["rel_l2"] = torch.tensor(result.mixprec.rel_l2)
    out["native_rel_l2"] = torch.tensor(result.native.rel_l2)
    return out


def test_exact_sum_and_native_all_reduce_match_references() -> None:
    world = 3
    results = run_distributed(_begin_case, world, timeout=120)
    rows = torch.stack([torch.cat(_grads(r, 0)).to(torch.bfloat16) for r in range(world)])
    reference = rows.double().numpy().sum(axis=0, dtype=np.float64) / world
    native = gloo_ring_sum(rows, pre_divide=world)  # gloo's ring, measured bit for bit
    for out in results:
        np.testing.assert_array_equal(out["exact"].numpy(), reference)
        assert torch.equal(out["native"], native)
        assert float(out["rel_l2"]) == float(out["native_rel_l2"]) > 0


# ---------------------------------------------------------------------- the wrapper
class _OffByAQuarter:
    """A reducer whose result is exact but for +0.25 at element 3 (fp32 integers: the sum is exact)."""

    def all_reduce(self, bucket, group, *, average, key):
        dist.all_reduce(bucket, group=group)
        if average:
            bucket.div_(dist.get_world_size(group))
        bucket[3] += 0.25
        return _Done()

    def reduce_scatter(self, shard_out, bucket, group, *, average, key):
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Done:
    def wait(self) -> None:
        pass


def _known_error_case(rank: int, world_size: int) -> dict[str, float]:
    _setup()
    model = VecNet((128,))
    ddp = DistributedDataParallel(model, reduce=_OffByAQuarter(), audit_every=1)
    consts = [torch.arange(128, dtype=torch.float32) * (rank + 1) * 2]  # even integers: exact averages
    ddp(consts).backward()
    (result,) = ddp.audit_results
    return {
        "rel": result.mixprec.rel_l2,
        "abs": result.mixprec.max_abs,
        "max_rel": result.mixprec.max_rel,
        "bits": result.mixprec.effective_bits,
        "native": result.native.rel_l2,
        "step": result.step,
    }


def test_wrapper_metrics_on_a_known_error() -> None:
    world = 2
    out = run_distributed(_known_error_case, world, timeout=120)
    exact = np.arange(128, dtype=np.float64) * (1 * 2 + 2 * 2) / world  # 3 i
    rel = 0.25 / np.linalg.norm(exact)
    for r in out:
        assert r["rel"] == pytest.approx(rel, rel=1e-12)
        assert (r["abs"], r["max_rel"], r["step"]) == (0.25, 0.25 / exact[3], 1)
        assert r["bits"] == pytest.approx(-math.log2(rel), rel=1e-12)
        assert r["native"] == 0.0  # the backend's fp32 sum of even integers / 2 is exact too


def _bf16_case(rank: int, world_size: int, sharded: bool) -> list[dict[str, float]]:
    _setup()
    ddp = DistributedDataParallel(
        VecNet(),
        reduce="fp32_accumulate",
        grad_dtype=torch.bfloat16,
        bucket_size=384,
        sharded_optimizer=sharded,
        audit_every=1,
    )
    assert ddp.grad_buffer.num_buckets == 2
    for step in range(2):
        ddp(_grads(rank, step)).backward()
        ddp.zero_grad_buffers()
    params = [int(names[0].split(".")[-1]) for names in ddp.bucket_params()]
    lengths = [b.numel for b in ddp.layout.buckets]
    return [
        {
            "bucket": r.bucket,
            "param": params[r.bucket],
            "length": lengths[r.bucket],
            "rel": r.mixprec.rel_l2,
            "native": r.native.rel_l2,
            "numel": r.numel,
        }
        for r in ddp.audit_results
    ]


@pytest.mark.parametrize("sharded", [False, True])
def test_fp32_accumulation_beats_the_backends_bf16_sum_within_its_bound(sharded: bool) -> None:
    world = 4
    out = run_distributed(_bf16_case, world, sharded, timeout=180)
    for rank, results in enumerate(out):
        assert [r["bucket"] for r in results] == [0, 1]
        for step, r in enumerate(results):
            rows = torch.stack([_grads(q, step)[r["param"]].to(torch.bfloat16).double() for q in range(world)])
            rows = torch.nn.functional.pad(rows, (0, r["length"] - rows.shape[1]))  # the bucket's zero padding
            if sharded:  # this rank's shard of the bucket
                shard = r["length"] // world
                rows = rows[:, rank * shard : (rank + 1) * shard]
            assert r["numel"] == rows.shape[1]
            exact = rows.sum(0) / world
            cond = float(rows.abs().sum(0).norm() / world / exact.norm())
            # An fp32 sum of P terms and one fp32 division (gamma_{P+1} of sum |x|); unsharded, then one
            # rounding to bf16 (u each element). Sharded, the shard stays fp32.
            fp32_part = (world + 1) * U_FP32 * cond
            bound = fp32_part if sharded else U_BF16 + fp32_part * (1 + U_BF16)
            assert r["rel"] <= bound
            assert r["native"] > max(r["rel"], U_BF16 / 8)  # bf16 sums: errors of order u, not below


def _schedule_case(rank: int, world_size: int) -> dict[str, object]:
    _setup()
    ddp = DistributedDataParallel(VecNet(), bucket_size=384, grad_dtype=torch.bfloat16, audit_every=3)
    plain = DistributedDataParallel(VecNet(), bucket_size=384, grad_dtype=torch.bfloat16)
    same = True
    for step in range(7):
        for wrapper in (ddp, plain):
            if step == 1:
                with wrapper.no_sync():  # not a synced step: not counted
                    wrapper(_grads(rank, step)).backward()
            wrapper(_grads(rank, step)).backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(ddp.parameters(), plain.parameters(), strict=True))
        for wrapper in (ddp, plain):
            wrapper.zero_grad_buffers()
    return {"audits": [(r.step, r.bucket) for r in ddp.audit_results], "same": same}


def test_wrapper_audits_exactly_at_steps_n_2n_and_changes_nothing() -> None:
    out = run_distributed(_schedule_case, 2, timeout=120)
    for r in out:
        assert r["audits"] == [(3, 0), (6, 1)]
        assert r["same"]  # the audited wrapper's gradients are the unaudited one's, bit for bit


def _bad_argument_case(rank: int, world_size: int) -> list[str]:
    _setup()
    errors = []
    for bad in (0, 2.5):
        try:
            DistributedDataParallel(VecNet(), audit_every=bad)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    try:
        mixprec.hooks.CompressedHookState(audit_every=-1)
    except ValueError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    dist.barrier()  # nothing was left half-issued: the group still works
    return errors


def test_bad_audit_every_refused_on_every_rank() -> None:
    out = run_distributed(_bad_argument_case, 2, timeout=120)
    assert out[0] == out[1]
    assert [e.split(":")[0] for e in out[0]] == ["ValueError", "TypeError", "ValueError"]
    assert all("audit_every" in e for e in out[0])


def _nan_case(rank: int, world_size: int) -> list[dict[str, object]]:
    _setup()
    ddp = DistributedDataParallel(VecNet(), bucket_size=384, grad_dtype=torch.bfloat16, audit_every=1)
    for step in range(2):
        grads = _grads(rank, step)
        if step == 0 and rank == 1:
            grads[1][5] = math.nan  # parameter 1: bucket 0 (buckets run last parameter first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteGradientWarning)
            ddp(grads).backward()
        ddp.zero_grad_buffers()
    return [
        {
            "inputs": r.nonfinite_inputs,
            "results": r.nonfinite_results,
            "rel": r.mixprec.rel_l2,
            "native": r.native.rel_l2,
        }
        for r in ddp.audit_results
    ]


def test_nan_in_a_bucket_is_reported_not_spread() -> None:
    out = run_distributed(_nan_case, 2, timeout=120)
    for results in out:
        first, second = results
        assert (first["inputs"], first["results"]) == (1, 0)
        assert math.isfinite(first["rel"]) and math.isfinite(first["native"])
        assert 0 < first["rel"] <= 2 * U_BF16  # measured on the 255 finite elements
        assert (second["inputs"], second["results"]) == (0, 0)  # does not stick after the step


# ---------------------------------------------------------------------- the torch DDP hooks
def _hook_case(rank: int, world_size: int, which: str) -> list[tuple[int, int, float, float]]:
    _setup()
    model = VecNet()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=384 * 4 / 2**20)
    if which == "uint8":
        state = mixprec.hooks.CompressedHookState(audit_every=2)
        ddp.register_comm_hook(state, mixprec.hooks.compressed_hook)
    else:
        state = mixprec.hooks.FP32HookState(audit_every=2)
        ddp.register_comm_hook(state, mixprec.hooks.fp32_accumulate_hook)
    for step in range(5):
        ddp(_grads(rank, step)).backward()
        model.zero_grad()
    return [(r.step, r.numel, r.mixprec.rel_l2, r.native.rel_l2) for r in state.audit_results]


@pytest.mark.parametrize("which", ["uint8", "fp32"])
def test_hooks_audit_at_steps_n_2n(which: str) -> None:
    out = run_distributed(_hook_case, 2, which, timeout=180)
    assert out[0] == out[1]  # identical bits on every rank
    assert [r[0] for r in out[0]] == [2, 4]
    for _, numel, rel, native in out[0]:
        assert numel in (*SIZES, sum(SIZES))  # torch DDP decides its buckets (one, then rebuilt)
        if which == "uint8":
            assert 0 < rel < 2.0**-5  # 8-bit codes: far coarser than fp32, far from garbage
        else:
            # fp32 buckets: the fp32 sum of two values and a division by 2 are one rounding each.
            assert rel <= 2 * U_FP32
            assert native <= 2 * U_FP32


def _hierarchical_hook_case(rank: int, world_size: int) -> dict[str, object]:
    _setup()
    grads = {}
    results = []
    for audited in (True, False):
        model = VecNet().to(torch.bfloat16)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=384 * 2 / 2**20)
        topology = Topology(2, 2)
        state = mixprec.hooks.FP32HookState(topology, audit_every=1) if audited else topology
        ddp.register_comm_hook(state, mixprec.hooks.fp32_accumulate_hook)
        for step in range(2):
            model.zero_grad()
            ddp([g.to(torch.bfloat16) for g in _grads(rank, step)]).backward()
        grads[audited] = [p.grad.clone() for p in model.parameters()]
        if audited:
            results = [(r.step, r.numel, r.mixprec.rel_l2, r.native.rel_l2) for r in state.audit_results]
    return {"same": all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True)), "audits": results}


def _two_stage_bound(step: int, world: int = 4) -> float:
    """rel_l2 bound of the two-stage scheme on step ``step``'s gradients: the result is rounded once
    (u |x_i|) and each node partial p_k once (u |p_k,i|, halved by the division by 2 nodes), after fp32 sums
    (gamma_3 of sum |x| in all); the max over parameters bounds any bucket of them (norms add up in squares)."""
    bounds = []
    for i in range(len(SIZES)):
        rows = torch.stack([_grads(r, step)[i].to(torch.bfloat16).double() for r in range(world)])
        x = rows.sum(0) / world
        partials = (rows[0::2] + rows[1::2]).abs() / 2  # |p_k| before rounding, per node k (ranks 2k, 2k + 1)
        share = float((partials.sum(0) / 2).norm() / x.norm())
        cond = float((rows.abs().sum(0) / world).norm() / x.norm())
        bounds.append(U_BF16 + U_BF16 * (1 + U_BF16) * share * (1 + U_BF16) + 3 * U_FP32 * cond * 2)
    return max(bounds)


def test_fp32_hook_with_a_topology_is_audited_and_unchanged() -> None:
    out = run_distributed(_hierarchical_hook_case, 4, timeout=180)
    for r in out:
        assert r["same"]  # the audit reads the bucket, never writes it
        assert [a[0] for a in r["audits"]] == [1, 2]
        for step, _, rel, native in r["audits"]:
            assert 0 < rel <= _two_stage_bound(step - 1)
            assert native > 0


def _reducer_case(rank: int, world_size: int, reduce: str) -> list[tuple[float, float | None]]:
    _setup()
    ddp = DistributedDataParallel(VecNet(), reduce=reduce, grad_dtype=torch.bfloat16, bucket_size=384, audit_every=1)
    ddp(_grads(rank, 0)).backward()
    return [(r.mixprec.rel_l2, None if r.native is None else r.native.rel_l2) for r in ddp.audit_results]


@pytest.mark.parametrize("reduce", ["native", "uint8"])
def test_any_registered_reducer_is_audited(reduce: str) -> None:
    out = run_distributed(_reducer_case, 3, reduce, timeout=120)
    assert out[0] == out[1] == out[2]
    ((rel, native),) = out[0]
    if reduce == "native":
        assert native is None  # the reducer is the backend's own: nothing to put beside it
        # Pre-divide, then two additions, each rounding to bf16: gamma_3 of sum |x_r| / P (Higham's bound),
        # for every parameter (so for any bucket of them).
        conds = []
        for i in range(len(SIZES)):
            rows = torch.stack([_grads(r, 0)[i].to(torch.bfloat16).double() for r in range(3)])
            conds.append(float((rows.abs().sum(0) / 3).norm() / (rows.sum(0) / 3).norm()))
        assert 0 < rel <= 3 * U_BF16 / (1 - 3 * U_BF16) * max(conds)
    else:
        assert 0 < native < rel < 2.0**-5  # 8-bit codes: coarser than bf16 sums, far from garbage


def _fsdp_case(rank: int, world_size: int, divide_factor: float | None) -> dict[str, object]:
    _setup()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mixprec.fsdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    if divide_factor is not None:
        for module in (model[0], model[2]):
            module.set_gradient_divide_factor(divide_factor)
    comm = mixprec.fsdp.FP32AccumulateReduceScatter(audit_every=2)
    for module in (model[0], model[2], model):
        module.set_custom_reduce_scatter(comm)
    for step in range(5):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).float().square().mean().backward()
        model.zero_grad()
    return [(r.step, r.bucket, r.numel, r.mixprec.rel_l2, r.native.rel_l2) for r in comm.audit_results]


@pytest.mark.parametrize("divide_factor", [None, 6.0])
def test_fsdp2_reduce_scatter_audited_per_backward_pass(divide_factor: float | None) -> None:
    importlib.import_module("torch.distributed.fsdp")
    out = run_distributed(_fsdp_case, 3, divide_factor, timeout=180)
    for results in out:
        # Two reduce-scatters per backward (the root holds no parameters): calls 0, 1 audited in turn.
        assert [(r[0], r[1]) for r in results] == [(2, 0), (4, 1)]
        for _, _, numel, rel, native in results:
            assert numel > 0
            # Each output element is one fp32 sum rounded once to bf16: u relative, so rel_l2 <= u, plus the fp32
            # sum's share 4 * 2^-24 * cond, below u / 2 unless the gradients cancel by more than 2^13 (measured
            # here: rel_l2 about 0.45 u).
            assert 0 <= rel <= 1.5 * U_BF16
            assert native >= 0
