"""Per-step overhead of loss scaling: mixprec's DynamicLossScaler vs torch.amp.GradScaler.

Times ``unscale_`` + the overflow check (inside ``step``, with an optimizer whose step does nothing, so
only the scaler's own work is measured) + ``update``, on the same fp32 gradients, in the same run. Both scalers
run at scale 1.0, so unscaling multiplies by exactly 1 and the gradients are the same at every iteration (at any
other scale the in-place unscale would shrink them towards subnormals call after call); the multiply still runs.
The two scalers take turns iteration by iteration, so a change of machine load hits both alike.

    python benchmarks/bench_scaler.py [--quick]
"""

from __future__ import annotations

import argparse
import functools

import torch

from _common import machine_header, markdown_table, time_alternating
from mixprec import DynamicLossScaler


class _NoopOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def _one_iteration(scaler, opt, grads):
    # GradScaler needs scale() once per iteration to exist; both scalers get the same call.
    scaler.scale(torch.ones(()))
    for p, g in zip(opt.param_groups[0]["params"], grads):
        p.grad = g
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sizes")
    args = ap.parse_args()
    shapes = {
        "200 x 4K (overhead-bound)": [(4096,)] * 200,
        "20 x 1M": [(1 << 20,)] * 20,
        "12 x 8M": [(1 << 23,)] * 12,
    }
    if args.quick:
        shapes.pop("12 x 8M")
    repeat = 5 if args.quick else 30
    rows = []
    for name, shape_list in shapes.items():
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shape_list]
        grads = [torch.randn(s) for s in shape_list]
        opt = _NoopOptimizer(params)
        # growth_interval large, no overflow: both scalers do the same unscale work every iteration
        ours = DynamicLossScaler(init_scale=1.0, growth_interval=10**9)
        theirs = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
        run_ours = functools.partial(_one_iteration, ours, opt, grads)
        run_theirs = functools.partial(_one_iteration, theirs, opt, grads)
        t_ours, t_theirs = time_alternating(run_ours, run_theirs, repeat=repeat)
        numel = sum(g.numel() for g in grads)
        rows.append([name, numel, t_theirs * 1e3, t_ours * 1e3, t_ours / t_theirs])
    print(machine_header("Loss-scaler per-step overhead (unscale_ + overflow check + update)"))
    print(
        markdown_table(
            ["gradients", "elements", "GradScaler ms", "DynamicLossScaler ms", "ratio (ours / GradScaler)"], rows
        )
    )


if __name__ == "__main__":
    main()
