"""The sharded optimizer (ZeRO-1) against unsharded training, clipping, and world-size independent checkpoints.

fp32 models throughout, so that exact comparisons are possible: with "fp32_accumulate" both the all-reduce
(unsharded) and the reduce-scatter into fp32 shards (sharded) compute round_fp32(sum_r g_r / P) with the
sum in rank order, and elementwise optimizers compute each element the same way on a 1-D piece as on the
whole tensor.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from dist_reference import U32, fp32_rank_order_sum, gamma
from mixprec.parallel import DistributedDataParallel, ShardedOptimizer
from mixprec.parallel.zero import CHECKPOINT_FORMAT

GLOBAL_BATCH = 24


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 10, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _rows(rank: int, world_size: int) -> slice:
    per = GLOBAL_BATCH // world_size
    return slice(rank * per, (rank + 1) * per)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(ddp: DistributedDataParallel, opt, rank: int, world_size: int, steps: range, clip: float | None) -> list:
    norms = []
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[_rows(rank, world_size)]), y[_rows(rank, world_size)]).backward()
        if clip is not None:
            if isinstance(opt, ShardedOptimizer):
                norms.append(float(opt.clip_grad_norm_(clip)))
            else:
                from mixprec.scaling import clip_grad_norm_

                norms.append(float(clip_grad_norm_(ddp.module.parameters(), clip)))
        opt.step()
    return norms


def _sharded_vs_unsharded(rank: int, world_size: int, sharded: bool, clip: float | None) -> dict:
    model = _mlp()
    ddp = DistributedDataParallel(model, bucket_size=300, sharded_optimizer=sharded)
    opt = ddp.make_optimizer(torch.optim.AdamW, _groups(model), lr=1e-2)
    norms = _train(ddp, opt, rank, world_size, range(4), clip)
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_and_unsharded_give_the_same_parameters(dist_run, world_size: int) -> None:
    unsharded = dist_run(_sharded_vs_unsharded, world_size, False, None, timeout=120)
    sharded = dist_run(_sharded_vs_unsharded, world_size, True, None, timeout=120)
    for rank in range(world_size):
        for a, b in zip(unsharded[rank]["params"], sharded[rank]["params"], strict=True):
            assert torch.equal(a, b)
        # And every rank holds the same parameters.
        for a, b in zip(sharded[rank]["params"], sharded[0]["params"], strict=True):
            assert torch.equal(a, b)


def test_clipping_takes_the_global_norm_from_the_shards(dist_run) -> None:
    """The norm of the full gradient, from P shards: local fp32 sums of squares, one fp32 all-reduce.

    Tolerances. Norm: both norms are fp32 sums of n squares in different orders, each within gamma_n of the
    exact norm, so they differ by at most ~2 gamma_n relative (n ~ 1.3e3 gradient elements: ~1.6e-4).
    Parameters: the two clip coefficients then differ by delta <= 2 gamma_n relative, so every gradient is
    scaled by (1 + d_i) with |d_i| <= delta. Adam's m_hat / sqrt(v_hat) moves by at most 2 delta times its
    size (m by delta relative to the sum of its |terms|, sqrt(v) by delta), and its size is at most
    (1 - beta1) / sqrt(1 - beta2) = 3.17 (Kingma & Ba 2015, sec. 2.1): per step, per element, at most
    lr * 2 delta * 3.17 apart. The fp32 roundings of the two updates (decay, step) differ by at most
    4 u32 |p| per step. Four steps."""
    world_size = 3
    unsharded = dist_run(_sharded_vs_unsharded, world_size, False, 0.05, timeout=120)
    sharded = dist_run(_sharded_vs_unsharded, world_size, True, 0.05, timeout=120)
    n = sum(p.numel() for p in _mlp().parameters())
    delta = 2 * gamma(n)
    lr, steps = 1e-2, 4
    adam_ratio = (1 - 0.9) / math.sqrt(1 - 0.999)
    for rank in range(world_size):
        assert len(sharded[rank]["norms"]) == steps
        for a, b in zip(unsharded[rank]["norms"], sharded[rank]["norms"], strict=True):
            assert abs(a - b) <= delta * a
            assert a > 0.05  # the clip was active at every step
        for a, b in zip(unsharded[rank]["params"], sharded[rank]["params"], strict=True):
            atol = steps * (lr * 2 * delta * adam_ratio + 4 * U32 * float(a.abs().max()))
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _dp_mean_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """What a world_size-rank fp32_accumulate DDP computes: each rank's local gradient (same batch shapes,
    same bits), summed in numpy float32 in rank order, divided by world_size in fp32."""
    per_rank = []
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x[_rows(r, world_size)]), y[_rows(r, world_size)]).backward()
        per_rank.append([p.grad.detach().clone() for p in model.parameters()])
    return [fp32_rank_order_sum([grads[i] for grads in per_rank], average=True) for i in range(len(per_rank[0]))]


def _save_at_4(rank: int, world_size: int, path: str) -> dict:
    ddp = DistributedDataParallel(_mlp(), bucket_size=300, sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.AdamW, _groups(ddp.module), lr=1e-2)
    _train(ddp, opt, rank, world_size, range(3), None)
    checkpoint = opt.state_dict()  # collective: every rank takes part; None except on rank 0
    if rank == 0:
        tmp = path + ".tmp"
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)  # atomic
    return checkpoint


def _resume_at_2(rank: int, world_size: int, path: str) -> dict:
    ddp = DistributedDataParallel(_mlp(seed=99), bucket_size=300, sharded_optimizer=True)  # other weights
    opt = ddp.make_optimizer(torch.optim.AdamW, _groups(ddp.module), lr=1e-2)
    opt.load_state_dict(torch.load(path, weights_only=True))
    round_trip = opt.state_dict()
    _train(ddp, opt, rank, world_size, range(3, 6), None)
    return {"round_trip": round_trip, "params": [p.detach().clone() for p in ddp.module.parameters()]}


def test_checkpoint_saved_at_4_ranks_resumes_at_2(dist_run, tmp_path) -> None:
    path = str(tmp_path / "zero1.pt")
    saved = dist_run(_save_at_4, 4, path, timeout=120)
    assert saved[0]["format"] == CHECKPOINT_FORMAT and saved[0]["world_size"] == 4
    assert set(saved[0]["elementwise_keys"]) == {"exp_avg", "exp_avg_sq"}
    resumed = dist_run(_resume_at_2, 2, path, timeout=120)

    # The checkpoint is gathered onto rank 0 only; the other ranks never hold the full state.
    assert all(s is None for s in saved[1:]) and resumed[1]["round_trip"] is None
    # 1. Re-sharded at 2 ranks and gathered again: the same checkpoint, bit for bit.
    for r in resumed[:1]:
        rt = r["round_trip"]
        assert rt["param_groups"] == saved[0]["param_groups"]
        for name, tensor in saved[0]["master"].items():
            assert torch.equal(rt["master"][name], tensor)
            for key, value in saved[0]["state"][name].items():
                assert torch.equal(torch.as_tensor(rt["state"][name][key]), torch.as_tensor(value)), (name, key)

    # 2. Continuing at 2 ranks matches a single-process reference that loads the same checkpoint into a
    #    plain torch AdamW and feeds it the 2-rank fp32 mean gradient: exactly.
    model = _mlp(seed=5)
    names = [n for n, _ in model.named_parameters()]
    checkpoint = torch.load(path, weights_only=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(checkpoint["master"][name])
    groups = _groups(model)
    opt = torch.optim.AdamW(groups, lr=1e-2)
    param_index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    name_of = dict(zip((id(p) for p in model.parameters()), names, strict=True))
    opt.load_state_dict(
        {
            "state": {param_index[id(p)]: dict(checkpoint["state"][name_of[id(p)]]) for p in model.parameters()},
            "param_groups": [
                {**{k: v for k, v in sg.items() if k != "params"}, "params": [param_index[id(p)] for p in g["params"]]}
                for sg, g in zip(checkpoint["param_groups"], groups, strict=True)
            ],
        }
    )
    for step in range(3, 6):
        x, y = _batch(step)
        grads = _dp_mean_grads(model, x, y, 2)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step()
    for r in resumed:
        for a, b in zip(r["params"], model.parameters(), strict=True):
            assert torch.equal(a, b.detach())


def _errors(rank: int, world_size: int) -> list[str]:
    out = []
    model = _mlp()
    plain = DistributedDataParallel(model)
    try:
        ShardedOptimizer(plain.grad_buffer, torch.optim.SGD, [{"params": list(model.parameters())}], lr=0.1)
    except ValueError as exc:
        out.append(str(exc))
    ddp = DistributedDataParallel(_mlp(), sharded_optimizer=True)
    for groups in ([{"params": [torch.zeros(3)]}], [{"params": list(ddp.module.parameters())}] * 2):
        try:
            ddp.make_optimizer(torch.optim.SGD, groups, lr=0.1)
        except ValueError as exc:
            out.append(str(exc))
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    try:
        opt.step()
    except RuntimeError as exc:
        out.append(str(exc))
    try:
        opt.load_state_dict({"format": "something else"})
    except ValueError as exc:
        out.append(str(exc))
    sd = {"format": CHECKPOINT_FORMAT, "master": {"nope": torch.zeros(1)}, "state": {}, "param_groups": []}
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        out.append(str(exc))
    try:
        opt.grad_norm(norm_type=-1.0)
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_misuse_raises_clear_errors(dist_run) -> None:
    messages = dist_run(_errors, 2, timeout=60)[0]
    fragments = [
        "needs DistributedDataParallel(..., sharded_optimizer=True)",
        "not a trainable parameter of the module",
        "appears in more than one param group",
        "no reduced gradients since the last step",
        "must come from ShardedOptimizer.state_dict()",
        "checkpoint parameters do not match the model",
        "norm_type must be a positive number",
    ]
    assert len(messages) == len(fragments)
    for message, fragment in zip(messages, fragments, strict=True):
        assert fragment in message, (fragment, message)


def _memory(rank: int, world_size: int) -> tuple[int, int, int]:
    ddp = DistributedDataParallel(_mlp(), bucket_size=300, sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.AdamW, lr=1e-3)
    _train(ddp, opt, rank, world_size, range(1), None)
    state_elems = sum(v.numel() for st in opt.state.values() for v in st.values() if v.dim() == 1)
    return opt.master.numel(), state_elems, len(ddp.layout.buckets)


def test_masters_and_state_are_one_shard_per_rank(dist_run) -> None:
    params = sum(p.numel() for p in _mlp().parameters())
    for masters, state, n_buckets in dist_run(_memory, 4, timeout=60):
        # Each bucket is padded by fewer than lcm(4, 128) = 128 elements, so a rank's share of the padding is
        # under 32 per bucket: the masters are a quarter of the model, not the whole of it.
        assert params / 4 <= masters < params / 4 + 32 * n_buckets
        assert state <= 2 * math.ceil(params / 4) + 2 * 128  # exp_avg + exp_avg_sq of this rank's pieces only


def _partial_groups(rank: int, world_size: int, sharded: bool) -> dict:
    """Only the last layer is in a param group; the first two layers are in none (frozen by omission)."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model, bucket_size=300, sharded_optimizer=sharded)
    opt = ddp.make_optimizer(torch.optim.SGD, [{"params": list(model[4].parameters())}], lr=0.1)
    _train(ddp, opt, rank, world_size, range(3), None)
    out = {"before": before, "params": [p.detach().clone() for p in model.parameters()]}
    if sharded:
        out["checkpoint"] = opt.state_dict()
    return out


def test_parameters_in_no_group_keep_their_values(dist_run) -> None:
    """The all-gather after a step writes the whole master shard back into the parameters, so the
    masters of parameters in no group must hold their values (they used to be zero)."""
    world_size = 2
    sharded = dist_run(_partial_groups, world_size, True, timeout=120)
    unsharded = dist_run(_partial_groups, world_size, False, timeout=120)
    frozen = 4  # Linear 0 and Linear 2: weight and bias each
    for rank in range(world_size):
        res = sharded[rank]
        for a, b in zip(res["before"][:frozen], res["params"][:frozen], strict=True):
            assert torch.equal(a, b)  # bit for bit: never touched
        for a, b in zip(res["before"][frozen:], res["params"][frozen:], strict=True):
            assert not torch.equal(a, b)  # the grouped layer did train
        # fp32 model and fp32 sums in rank order both ways: the trained layer matches unsharded SGD exactly.
        for a, b in zip(unsharded[rank]["params"], res["params"], strict=True):
            assert torch.equal(a, b)
    checkpoint = sharded[0]["checkpoint"]
    names = [n for n, _ in _mlp().named_parameters()]
    for name, value in zip(names, sharded[0]["params"], strict=True):
        assert torch.equal(checkpoint["master"][name], value)


def _stale_shards_after_skip(rank: int, world_size: int) -> list[str]:
    from mixprec.scaling import DynamicLossScaler

    model = _mlp()
    ddp = DistributedDataParallel(model, bucket_size=300, sharded_optimizer=True, check_finite=False)
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    x, y = _batch(0)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x[_rows(rank, world_size)]), y[_rows(rank, world_size)])
    # Rank 0's loss overflows: every rank must skip, and nobody may step on these shards later.
    scaler.scale(loss * (math.inf if rank == 0 else 1.0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    messages = [f"skipped={skipped}"]
    model.zero_grad()  # clears the grads another way than opt.zero_grad(): the shards still hold inf/NaN
    try:
        opt.step()
    except RuntimeError as exc:
        messages.append(str(exc))
    messages.append(f"finite={all(bool(torch.isfinite(p).all()) for p in model.parameters())}")
    return messages


def test_a_skipped_steps_shards_are_discarded_at_update(dist_run) -> None:
    """The scaler's update() calls mixprec_discard_grads_(): a step() without a new synced backward
    is refused instead of applying the skipped step's inf/NaN gradient shards."""
    for messages in dist_run(_stale_shards_after_skip, 2, timeout=60):
        assert messages[0] == "skipped=True"
        assert "no reduced gradients since the last step" in messages[1]
        assert messages[2] == "finite=True"


def _bf16_scaled_clipped(rank: int, world_size: int, steps: int) -> dict:
    """bf16 model, ZeRO-1, loss scaler and clipping for several steps; on rank 0 also an independent
    single-process reference of the same steps (torch SGD on full fp32 masters, numpy fp32 rank-order sums)."""
    from mixprec.scaling import DynamicLossScaler
    from mixprec.scaling.master import clip_coefficient

    model = _mlp().to(torch.bfloat16)
    reference_bf16 = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_size=300, sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    scale = 2.0**12  # a power of two: unscaling is exact
    scaler = DynamicLossScaler(init_scale=scale, growth_interval=10_000)
    max_norm = 0.05
    norms = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        out = ddp(x[_rows(rank, world_size)].to(torch.bfloat16)).float()
        scaler.scale(torch.nn.functional.mse_loss(out, y[_rows(rank, world_size)])).backward()
        scaler.unscale_(opt)
        norms.append(opt.clip_grad_norm_(max_norm))
        scaler.step(opt)
        scaler.update()
    result: dict = {"params": [p.detach().clone() for p in model.parameters()], "norms": norms}
    if rank != 0:
        return result

    masters = [p.detach().float().clone().requires_grad_(True) for p in reference_bf16.parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.05, momentum=0.9)
    ref_norms = []
    for step in range(steps):
        x, y = _batch(step)
        with torch.no_grad():
            for p, m in zip(reference_bf16.parameters(), masters, strict=True):
                p.copy_(m)  # the model the ranks ran: masters rounded once to bf16
        per_rank = []
        for r in range(world_size):
            reference_bf16.zero_grad(set_to_none=True)
            out = reference_bf16(x[_rows(r, world_size)].to(torch.bfloat16)).float()
            (torch.nn.functional.mse_loss(out, y[_rows(r, world_size)]) * scale).backward()
            per_rank.append([p.grad.clone() for p in reference_bf16.parameters()])
        grads = [fp32_rank_order_sum([g[i] for g in per_rank], average=True) for i in range(len(masters))]
        grads = [g * (1.0 / scale) for g in grads]  # exact: a power of two
        exact_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        ref_norms.append(exact_norm)
        # The same coefficient as the ranks' (from the norm they agreed on), so the steps can match exactly;
        # that norm itself is checked against the fp64 norm in the test.
        coef = clip_coefficient(norms[step], max_norm)
        for m, g in zip(masters, grads, strict=True):
            m.grad = g * coef
        ref_opt.step()
    result["reference"] = [m.detach().to(torch.bfloat16) for m in masters]
    result["reference_norms"] = ref_norms
    return result


def test_bf16_sharded_with_scaler_and_clipping_matches_a_reference(dist_run) -> None:
    """4 steps of bf16 ZeRO-1 training with a loss scaler and clipping at 2 ranks equal, bit for bit,
    a single-process reference: local bf16 gradients, fp32 rank-order mean (never rounded to bf16: the
    reduce-scatter writes fp32 shards), exact unscale, the ranks' clip coefficient, torch SGD with momentum
    on fp32 masters, one rounding to bf16. The clip norm is checked separately: an fp32 sum of n squares
    (each exact in fp64 to within u32) is within gamma_n relative of the fp64 norm, so the norm within
    gamma_n as well (sqrt halves the relative error; the bound is loose)."""
    steps = 4
    results = dist_run(_bf16_scaled_clipped, 2, steps, timeout=120)
    n = sum(p.numel() for p in _mlp().parameters())
    r0 = results[0]
    for got, exact in zip(r0["norms"], r0["reference_norms"], strict=True):
        assert abs(float(got) - exact) <= gamma(n + 2) * exact
        assert exact > 0.05  # the clip was active
    initial = [p.detach().to(torch.bfloat16) for p in _mlp().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(r0["params"], initial, strict=True))  # it did train
    for r in results:
        for a, b in zip(r["params"], r0["reference"], strict=True):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b)


def _set_after_build(rank: int, world_size: int) -> list[torch.Tensor]:
    model = _mlp()
    ddp = DistributedDataParallel(model, bucket_size=300, sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.SGD, [{"params": list(model[4].parameters())}], lr=0.1)
    with torch.no_grad():
        model[0].weight.fill_(0.25)  # in no group, changed after the optimizer took its masters
    _train(ddp, opt, rank, world_size, range(2), None)
    return [model[0].weight.detach().clone()]


def test_parameters_in_no_group_keep_values_set_after_the_optimizer_was_built(dist_run) -> None:
    for (weight,) in dist_run(_set_after_build, 2, timeout=60):
        assert bool((weight == 0.25).all())  # the step's all-gather used to write the old snapshot back


def _zero_grad_case(rank: int, world_size: int) -> dict[str, object]:
    ddp = DistributedDataParallel(_mlp(), bucket_size=300, sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.SGD, lr=0.1)
    x, y = _batch(0)

    def backward() -> None:
        torch.nn.functional.mse_loss(ddp(x[_rows(rank, world_size)]), y[_rows(rank, world_size)]).backward()

    backward()
    opt.step()
    opt.zero_grad()  # set_to_none=True, as torch's default
    to_none = [p.grad is None for p in ddp.module.parameters()]
    backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    kept = [p.grad is not None and float(p.grad.abs().max()) == 0.0 for p in ddp.module.parameters()]
    buffers_zero = all(bool((ddp.grad_buffer.bucket(k) == 0).all()) for k in range(ddp.grad_buffer.num_buckets))
    try:
        opt.zero_grad(set_to_none="yes")
        bad = "no error"
    except TypeError as exc:
        bad = str(exc)
    return {"to_none": to_none, "kept": kept, "buffers_zero": buffers_zero, "bad": bad}


def test_zero_grad_honours_set_to_none(dist_run) -> None:
    """True (the default) leaves every .grad None; False keeps the buffer views, zeroed; both zero the
    buffers. The argument used to be ignored."""
    for r in dist_run(_zero_grad_case, 2, timeout=60):
        assert all(r["to_none"]) and all(r["kept"]) and r["buffers_zero"], r
        assert "set_to_none must be a bool" in r["bad"]
