"""Precision emulation on a CPU: bit-exact rounding, matmuls with modelled accumulators and their error bounds,
and a model trained with every nn.Linear emulating an fp16-accumulating matmul.

Run: python examples/emulation.py   (a few seconds on a CPU)
"""

import torch

import mixprec
from mixprec.emulate import bounds, matmul

torch.manual_seed(0)

# 1. Rounding: bit-exact with torch's own casts where torch has the format, and formats it lacks.
x = torch.randn(10_000) * 100
assert torch.equal(mixprec.round_to(x, "fp8_e4m3"), x.to(torch.float8_e4m3fn).float())
assert torch.equal(mixprec.round_to(x, "bf16"), x.bfloat16().float())
print("round_to: fp8_e4m3 and bf16 bit-exact with torch's casts")

# 2. Matmuls with modelled accumulators, against a float64 reference of the same fp16 data.
K = 1024
a, b = torch.randn(64, K).half(), torch.randn(K, 64).half()
exact = a.double() @ b.double()
scale = a.double().abs() @ b.double().abs()  # sum |a_i b_i| per output: what the bounds multiply
for mode in ("fp16/16", "two_stage", "fp16/32"):
    y = matmul(a, b, mode=mode).double()  # fp16 inputs; the accumulator the mode names
    worst = float(((y - exact).abs() / scale).max())
    bound = bounds(K, mode, confidence=0.99)
    print(
        f"matmul mode={mode:9s}: median |error| {float((y - exact).abs().median()):.2e}; worst error / sum|ab| "
        f"{worst:.2e} <= deterministic bound {bound.deterministic:.2e}"
    )
    assert worst <= bound.deterministic

# 3. Training with emulated linear layers: forward and backward of every nn.Linear use the fp16/16 model.
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
with mixprec.emulate_linear_layers(model, "fp16/16"):  # swapped back to nn.Linear on exit
    for step in range(30):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
print(f"emulate_linear_layers(model, 'fp16/16'): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < 0.5 * losses[0]
assert isinstance(model[0], torch.nn.Linear)  # restored
print("emulation example: OK")
