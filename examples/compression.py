"""8-bit gradient compression: the compressed all-reduce (flat and hierarchical), error feedback, and DDP.

Run: python examples/compression.py   (starts 4 CPU ranks on gloo itself, as 2 simulated nodes x 2; seconds)

This script forks its own ranks with mixprec.testing.run_distributed. On a cluster the same code runs under
torchrun (torchrun --nnodes 2 --nproc-per-node 8 ... train.py), and the hierarchical topology can then be
left out: the reducer "uint8_hierarchical" reads it from torchrun's LOCAL_WORLD_SIZE.

1. mixprec.compressed_all_reduce: uint8 codes with one fp32 (min, max) pair per chunk on the wire, fp32 sums,
   about a quarter of fp32's bytes; identical bits on every rank.
2. ErrorFeedback: the quantization error of one call is added back at the next, so that the average of the
   compressed results over many calls converges to the true average.
3. The hierarchical scheme (Topology): full precision inside a node, uint8 between nodes.
4. mixprec.DistributedDataParallel(reduce="uint8_hierarchical") training, and torch DDP with the uint8 hook.
"""

import torch

import mixprec
import mixprec.hooks
from mixprec.comm import Topology
from mixprec.compress import ErrorFeedback
from mixprec.testing import run_distributed

WORLD_SIZE = 4
TOPOLOGY = Topology(nodes=2, ranks_per_node=2)  # 2 simulated nodes of 2 ranks


def gradient(rank: int, call: int) -> torch.Tensor:
    return torch.randn(8192, generator=torch.Generator().manual_seed(100 * call + rank))


def true_average(call: int) -> torch.Tensor:
    return torch.stack([gradient(r, call) for r in range(WORLD_SIZE)]).double().mean(0)


def rank_main(rank: int, world_size: int) -> dict:
    out: dict = {}
    # 1. Flat compressed all-reduce (average of the ranks' tensors).
    grad = gradient(rank, 0)
    stats = mixprec.compressed_all_reduce(grad)
    out["flat"] = grad
    out["flat_error"] = float((grad.double() - true_average(0)).abs().max())
    out["ratio_to_fp32"] = stats.ratio_to_fp32

    # 2. Error feedback: the same gradient reduced 50 times; the running mean of the results approaches the
    #    true average, which it cannot without feedback (the same codes come back every time).
    for feedback in (None, ErrorFeedback()):
        total = torch.zeros(8192, dtype=torch.float64)
        for _ in range(50):
            g = gradient(rank, 0)
            mixprec.compressed_all_reduce(g, error_feedback=feedback)
            total += g.double()
        key = "mean_error_with_feedback" if feedback else "mean_error_without_feedback"
        out[key] = float((total / 50 - true_average(0)).abs().max())

    # 3. Hierarchical: reduce-scatter in fp32 inside each node, uint8 between nodes, relay inside the node.
    grad = gradient(rank, 1)
    stats = mixprec.compressed_all_reduce(grad, topology=TOPOLOGY)
    out["hier_error"] = float((grad.double() - true_average(1)).abs().max())
    out["hier_inter_node_bytes"] = stats.bytes_sent_inter_node

    # 4a. mixprec's DDP wrapper with the hierarchical uint8 reducer and error feedback.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    ddp = mixprec.DistributedDataParallel(
        model, reduce="uint8_hierarchical", reduce_options={"error_feedback": True, "topology": TOPOLOGY}
    )
    opt = ddp.make_optimizer(torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(30):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["ddp_losses"] = (losses[0], losses[-1])
    out["ddp_params"] = torch.cat([p.detach().flatten() for p in model.parameters()])

    # 4b. torch's own DDP with the uint8 comm hook (create the state after init_process_group).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    torch_ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch_ddp.register_comm_hook(mixprec.hooks.CompressedHookState(error_feedback=True), mixprec.hooks.compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(5):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        opt.zero_grad()
        torch.nn.functional.mse_loss(torch_ddp(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
    out["hook_params"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return out


if __name__ == "__main__":
    results = run_distributed(rank_main, WORLD_SIZE)
    r0 = results[0]
    same = all(torch.equal(r["flat"], r0["flat"]) for r in results)
    print(
        f"flat compressed all-reduce: max error {r0['flat_error']:.2e}, {r0['ratio_to_fp32']:.2f}x the bytes of "
        f"an fp32 all-reduce, identical on every rank: {same}"
    )
    print(
        f"mean of 50 compressed averages: max error {r0['mean_error_without_feedback']:.2e} without error "
        f"feedback, {r0['mean_error_with_feedback']:.2e} with it"
    )
    print(
        f"hierarchical (2 nodes x 2 ranks): max error {r0['hier_error']:.2e}, "
        f"{r0['hier_inter_node_bytes']} bytes sent between nodes by rank 0"
    )
    first, last = r0["ddp_losses"]
    ddp_same = all(torch.equal(r["ddp_params"], r0["ddp_params"]) for r in results)
    hook_same = all(torch.equal(r["hook_params"], r0["hook_params"]) for r in results)
    print(
        f"DistributedDataParallel(uint8_hierarchical, error feedback): loss {first:.3f} -> {last:.3f}; "
        f"replicas identical: {ddp_same}"
    )
    print(f"torch DDP + compressed_hook: replicas identical: {hook_same}")
    assert same and ddp_same and hook_same and last < 0.5 * first
    assert r0["ratio_to_fp32"] < 0.3
    assert r0["mean_error_with_feedback"] < 0.5 * r0["mean_error_without_feedback"]
    print("compression example: OK")
