"""``mixprec demo``: what the package can show on built-in defaults, in seconds, on a CPU."""

from __future__ import annotations

import torch

from mixprec.scaling import DynamicLossScaler, MasterWeightOptimizer, Updater, advise, rescale_for_dp


def run_demo(steps: int = 60, seed: int = 0) -> int:
    print("== Loss-scale advisor (seed 002's example: GBS 1024, MBS 4, DP 64, loss_scale 256)")
    print(advise(1024, 4, 64, 256).format())
    new_scale = rescale_for_dp(256, 64, 128)
    print(f"\nDP 64 -> 128 keeps loss_scale / num_microbatches with loss_scale {new_scale:g}:")
    print(advise(1024, 4, 128, new_scale).format())

    print("\n== fp16 model + fp32 master weights + dynamic loss scaling, 4 microbatches per step")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=gen)
    w_true = torch.randn(16, 1, generator=gen)
    y = x @ w_true
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).half()
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    # A deliberately huge initial scale: the first steps overflow fp16 and are skipped, then it settles.
    scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=20)

    def loss_fn(m: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = mb
        return torch.nn.functional.mse_loss(m(xb.half()).float(), yb)

    updater = Updater(model, opt, loss_fn, scaler=scaler, num_microbatches=4, clip_grad_norm=1.0)
    for step in range(steps):
        idx = torch.randint(0, 512, (64,), generator=gen)
        mbs = [(x[i], y[i]) for i in idx.chunk(4)]
        r = updater.step(mbs)
        if step % 10 == 0 or r.skipped:
            print(
                f"step {step:3d} loss {r.loss:9.5f} scale {r.scale:10.0f} "
                f"{'SKIPPED (overflow)' if r.skipped else f'grad_norm {r.grad_norm:.4f}'}"
            )
    print(f"steps taken {scaler.steps_taken}, skipped {scaler.steps_skipped}, final scale {scaler.get_scale():g}")
    return 0
