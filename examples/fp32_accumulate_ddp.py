"""Data parallelism with fp16 on the wire and fp32 sums: the collective, mixprec's DDP wrapper, torch DDP's hook.

Run: python examples/fp32_accumulate_ddp.py   (starts 2 CPU ranks on gloo itself; a few seconds)

This script forks its own ranks with mixprec.testing.run_distributed, so it runs anywhere. In your own
training script the ranks come from torchrun instead (torchrun --nproc-per-node 8 train.py, with
torch.distributed.init_process_group("nccl") at the top); everything inside `rank_main` stays the same.

1. all_reduce_fp32_accumulate on an fp16 tensor: one rounding per element and identical bits on every rank.
   (With 2 ranks the backend's fp16 all-reduce also rounds once; with P ranks its ring rounds P-1 times and
   its error grows like sqrt(P): `mixprec study reduction-error`.)
2. mixprec.DistributedDataParallel(reduce="fp32_accumulate", sharded_optimizer=True): ZeRO-1 training of an
   fp16 model with a dynamic loss scaler; the replicas stay identical.
3. torch.nn.parallel.DistributedDataParallel with mixprec.hooks.fp32_accumulate_hook.
"""

import torch
import torch.distributed as dist

import mixprec
import mixprec.hooks
from mixprec.testing import run_distributed

WORLD_SIZE = 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (the wrappers also broadcast rank 0's)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a regression task y = sum(x) (a different batch on every rank)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def rank_main(rank: int, world_size: int) -> dict:
    out: dict = {}

    # 1. The collective: fp16 values, summed in fp32 on the rank that owns each element, rounded once.
    gen = torch.Generator().manual_seed(rank)
    values = (torch.randn(4096, generator=gen) * 1e-3).half()
    exact = torch.zeros(4096, dtype=torch.float64)
    for r in range(world_size):  # the exact sum, for comparison (every rank can draw every rank's values)
        exact += (torch.randn(4096, generator=torch.Generator().manual_seed(r)) * 1e-3).half().double()
    ours, native = values.clone(), values.clone()
    mixprec.all_reduce_fp32_accumulate(ours)
    dist.all_reduce(native)  # the backend's fp16 sum
    out["err_fp32_accumulate"] = float((ours.double() - exact).norm() / exact.norm())
    out["err_native"] = float((native.double() - exact).norm() / exact.norm())
    out["reduced"] = ours

    # 2. mixprec's DDP wrapper: fp16 parameters, gradients reduced in buckets during backward, ZeRO-1.
    model = make_model().half()
    ddp = mixprec.DistributedDataParallel(model, reduce="fp32_accumulate", sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.AdamW, lr=1e-2)  # fp32 masters and state for this rank's shard
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**12)
    losses = []
    for step in range(30):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x.half()).float(), y)
        scaler.scale(loss).backward()  # buckets reduce during backward
        scaler.unscale_(opt)
        opt.clip_grad_norm_(10.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    out["ddp_losses"] = (losses[0], losses[-1])
    out["ddp_params"] = torch.cat([p.detach().flatten().float() for p in model.parameters()])

    # 3. torch's own DDP with the fp32-accumulating comm hook (bf16 here; the hook keeps the bucket's dtype).
    model = make_model().bfloat16()
    torch_ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch_ddp.register_comm_hook(None, mixprec.hooks.fp32_accumulate_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(5):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(torch_ddp(x.bfloat16()).float(), y).backward()
        opt.step()
    out["torch_ddp_params"] = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    return out


if __name__ == "__main__":
    results = run_distributed(rank_main, WORLD_SIZE)
    r0 = results[0]
    same = all(torch.equal(r["reduced"], r0["reduced"]) for r in results)
    print(
        f"all_reduce_fp32_accumulate: relative error {r0['err_fp32_accumulate']:.2e} against the exact sum "
        f"(the backend's fp16 all-reduce on {WORLD_SIZE} ranks: {r0['err_native']:.2e}); "
        f"identical on every rank: {same}"
    )
    first, last = r0["ddp_losses"]
    ddp_same = all(torch.equal(r["ddp_params"], r0["ddp_params"]) for r in results)
    print(
        f"DistributedDataParallel(fp32_accumulate, ZeRO-1): loss {first:.3f} -> {last:.3f}; "
        f"replicas identical: {ddp_same}"
    )
    hook_same = all(torch.equal(r["torch_ddp_params"], r0["torch_ddp_params"]) for r in results)
    print(f"torch DDP + fp32_accumulate_hook: replicas identical: {hook_same}")
    assert same and ddp_same and hook_same and last < 0.5 * first
    assert r0["err_fp32_accumulate"] <= r0["err_native"]
    print("fp32_accumulate_ddp example: OK")
