"""fp16 training on one process: fp32 master weights, a dynamic loss scaler, and the Updater.

Run: python examples/loss_scaling.py   (a few seconds on a CPU)

A small fp16 MLP learns a synthetic classification task twice: first with the step written out
(scale, backward, unscale, clip, step, update), then with mixprec.Updater doing the same step over 4
microbatches. The scaler starts at 2**24 on purpose, so that the first steps overflow fp16 and are
skipped while the scale backs off; the run then trains normally.
"""

import torch

import mixprec

torch.manual_seed(0)
FEATURES, CLASSES, BATCH = 32, 4, 64
teacher = torch.randn(FEATURES, CLASSES)


def batches(n: int):
    """n batches (x, y) of a linearly separable task: y = argmax(x @ teacher)."""
    for _ in range(n):
        x = torch.randn(BATCH, FEATURES)
        yield x, (x @ teacher).argmax(dim=1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))
    return model.half()  # fp16 parameters and gradients


# --- 1. the step written out -----------------------------------------------------------------------
model = make_model()
opt = mixprec.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)  # fp32 masters
scaler = mixprec.DynamicLossScaler(init_scale=2.0**24, hysteresis=1, min_scale=1.0)  # raises if stuck at 1.0

losses, skipped = [], 0
for x, y in batches(40):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x.half()).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # fp16 grads -> fp32 master grads, divided by the scale
    skipped += scaler.has_overflow(opt)
    opt.clip_grad_norm_(1.0)  # global norm taken in fp32
    scaler.step(opt)  # skipped (on every rank) when any rank saw inf/NaN
    scaler.update()
    losses.append(loss.item())

print(
    f"written-out loop: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {skipped} skipped steps, "
    f"final loss scale {scaler.get_scale():g}"
)
assert losses[-1] < 0.5 * losses[0] and skipped > 0

# --- 2. the same with mixprec.Updater (4 microbatches per step) ------------------------------------
model = make_model()
opt = mixprec.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)


def loss_fn(model: torch.nn.Module, microbatch) -> torch.Tensor:
    x, y = microbatch
    return torch.nn.functional.cross_entropy(model(x.half()).float(), y)


updater = mixprec.Updater(
    model,
    opt,
    loss_fn,
    scaler=mixprec.DynamicLossScaler(init_scale=2.0**24, hysteresis=1),
    num_microbatches=4,
    clip_grad_norm=1.0,
)
results = []
for x, y in batches(40):
    microbatches = list(zip(x.chunk(4), y.chunk(4)))  # loss of each divided by 4: the mean over the batch
    results.append(updater.step(microbatches))
print(
    f"Updater: loss {results[0].loss:.3f} -> {results[-1].loss:.3f}, "
    f"{sum(r.skipped for r in results)} skipped steps, final loss scale {results[-1].scale:g}"
)
assert results[-1].loss < 0.5 * results[0].loss
print("loss_scaling example: OK")
