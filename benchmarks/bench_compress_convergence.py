"""Does uint8 gradient compression train as well as fp32? An MLP on scikit-learn's digits (a real dataset that
ships with the package), data-parallel over gloo ranks with mixprec's DistributedDataParallel.

Same model initialisation, same global batches (each rank takes its slice), same optimizer (SGD, momentum
0.9) in every run; only the gradient reduction differs: fp32 (gloo's own all-reduce, the uncompressed
baseline), uint8 with nearest or stochastic rounding, with and without error feedback, and (with 4 ranks)
hierarchical 2 nodes x 2. Margin, stated before measuring: final test accuracy within 1.5 percentage
points of fp32, and final training loss (mean of the last 10% of steps) within 10% of fp32's.

    python benchmarks/bench_compress_convergence.py [--quick] [--world 4] [--plot benchmarks/compress_convergence.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("native", {}),
    "uint8 nearest": ("uint8", {}),
    "uint8 nearest + EF": ("uint8", {"error_feedback": True}),
    "uint8 stochastic": ("uint8", {"rounding": "stochastic"}),
    "uint8 stochastic + EF": ("uint8", {"rounding": "stochastic", "error_feedback": True}),
}
HIERARCHICAL = ("uint8_hierarchical", {"error_feedback": True})

ACC_MARGIN = 0.015  # absolute, test accuracy
LOSS_MARGIN = 0.10  # relative, final training loss


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digits, pixels scaled to [0, 1], shuffled with a fixed seed, split 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def prepare_parent() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load the data and import torch's lazily imported optimizer machinery once, in the parent, so that
    forked ranks inherit both (each would otherwise spend seconds importing sklearn and torch._dynamo).
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return digits()


def train_digits(
    rank: int,
    world: int,
    reduce: str,
    reduce_options: dict[str, Any],
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    steps: int,
    batch: int = 64,
    lr: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]:
    """One data-parallel run (call inside an initialised gloo group); returns per-step losses and test metrics.

    ``batch`` is the global batch; rank r trains on rows [r b/W, (r+1) b/W) of it. The loss logged per step
    is the mean over ranks (the global batch's loss). ``data`` is :func:`digits`'s result.
    """
    from mixprec.parallel import DistributedDataParallel

    xtr, ytr, xte, yte = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    ddp = DistributedDataParallel(model, reduce=reduce, reduce_options=dict(reduce_options), bucket_size=8192)
    opt = ddp.make_optimizer(torch.optim.SGD, lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)  # the same on every rank: the same global batches
    per_rank = batch // world
    order = torch.randperm(len(xtr), generator=gen)
    pos = 0
    losses = []
    for _ in range(steps):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(xtr), generator=gen), 0
        idx = order[pos + rank * per_rank : pos + (rank + 1) * per_rank]
        pos += batch
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    with torch.no_grad():
        logits = model(xte)
        test_loss = torch.nn.functional.cross_entropy(logits, yte).item()
        test_acc = (logits.argmax(1) == yte).float().mean().item()
    bytes_sent = getattr(ddp.reducer, "bytes_sent_total", None)
    return {"losses": losses, "test_loss": test_loss, "test_acc": test_acc, "bytes_sent": bytes_sent}


def final_loss(losses: list[float]) -> float:
    """Mean training loss over the last 10% of steps (smooths minibatch noise)."""
    tail = max(1, len(losses) // 10)
    return statistics.mean(losses[-tail:])


def run_all(world: int, steps: int, *, with_hierarchical: bool) -> dict[str, dict[str, Any]]:
    from mixprec.testing import run_distributed

    data = prepare_parent()
    variants = dict(VARIANTS)
    if with_hierarchical:
        variants["uint8 hierarchical 2x2 + EF"] = HIERARCHICAL
    results = {}
    for name, (reduce, options) in variants.items():
        if reduce == "uint8_hierarchical":
            os.environ["LOCAL_WORLD_SIZE"] = str(world // 2)  # inherited by the forked ranks
        results[name] = run_distributed(train_digits, world, reduce, options, data, steps=steps, timeout=600)[0]
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        print(f"{name}: final loss {final_loss(results[name]['losses']):.4f}", file=sys.stderr, flush=True)
    return results


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install 'mixprec[plot]'): {exc}") from exc
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(6.4, 5.6), dpi=90, sharex=True, height_ratios=(3, 2))
    window = 10

    def smooth(values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64)
        return t.unfold(0, window, 1).mean(1) if len(t) >= window else t

    base = smooth(results["fp32"]["losses"])
    steps = range(window - 1, window - 1 + len(base))
    for name, res in results.items():
        (line,) = ax.plot(steps, smooth(res["losses"]).tolist(), label=name, lw=1.2)
        if name != "fp32":
            diff.plot(steps, (smooth(res["losses"]) - base).tolist(), color=line.get_color(), lw=1.0)
    ax.set_yscale("log")
    ax.set_ylabel(f"training loss\n(global batch, mean of {window} steps)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    diff.axhline(0.0, color="black", lw=0.8)
    diff.set_xlabel("step")
    diff.set_ylabel("loss minus fp32's")
    diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 60 steps")
    ap.add_argument("--world", type=int, default=None, help="gloo ranks (default 4; 2 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 400; 60 with --quick)")
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = ap.parse_args()
    world = args.world or (2 if args.quick else 4)
    steps = args.steps or (60 if args.quick else 400)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_header, markdown_table

    print(machine_header(f"uint8 compression vs fp32 all-reduce: MLP on digits, {world} gloo ranks, {steps} steps"))
    print("- model 64-128-128-10 (ReLU), SGD lr 0.05 momentum 0.9, global batch 64, chunk_size 2048 (default)")
    print(
        f"- margin: test accuracy within {ACC_MARGIN * 100:.1f} points, final loss within {LOSS_MARGIN:.0%} of fp32\n"
    )
    results = run_all(world, steps, with_hierarchical=world % 2 == 0 and world >= 4)
    base = results["fp32"]
    rows = []
    for name, res in results.items():
        loss = final_loss(res["losses"])
        ok = abs(res["test_acc"] - base["test_acc"]) <= ACC_MARGIN and loss <= final_loss(base["losses"]) * (
            1 + LOSS_MARGIN
        )
        at = [res["losses"][min(s, steps) - 1] for s in (steps // 8, steps // 2)]
        rows.append(
            [
                name,
                f"{at[0]:.3f}",
                f"{at[1]:.3f}",
                f"{loss:.4f}",
                f"{loss / final_loss(base['losses']):.3f}",
                f"{res['test_loss']:.4f}",
                f"{res['test_acc'] * 100:.2f}",
                "-" if name == "fp32" else ("yes" if ok else "NO"),
            ]
        )
    print(
        markdown_table(
            [
                "reduction",
                f"loss @ step {steps // 8}",
                f"loss @ step {steps // 2}",
                "final loss (last 10%)",
                "vs fp32",
                "test loss",
                "test acc %",
                "within margin",
            ],
            rows,
        )
    )
    if args.plot:
        plot(results, args.plot, f"MLP on digits, {world} gloo ranks: fp32 vs uint8 gradient all-reduce")


if __name__ == "__main__":
    main()
