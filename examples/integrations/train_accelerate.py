"""mixprec inside Hugging Face Accelerate: a mixprec reducer as the DDP comm hook, mixprec's loss scaler.

Run: torchrun --nproc-per-node 2 examples/integrations/train_accelerate.py [--reduce uint8] [--out params.pt]
(CPU, gloo, a few seconds; on GPUs the same script runs unchanged, NCCL instead of gloo.)

Two lines after ``accelerator.prepare``: ``apply`` registers the reducer hook on the prepared DDP model,
``use_scaler`` makes a mixprec DynamicLossScaler the accelerator's scaler. Step 2 feeds an inf on rank 0:
the step is skipped on every rank and the prepared LR scheduler does not advance. With ``--out`` rank 0
saves the final parameters, the skips and the scale (tests/test_integrations_accelerate.py compares them
with mixprec's own DistributedDataParallel).
"""

import argparse

import torch

import mixprec
from mixprec.integrations import accelerate as mixprec_accelerate

STEPS = 4
INF_STEP = 2  # rank 0's batch holds an inf at this step
UINT8 = {"chunk_size": 64, "error_feedback": True, "rounding": "stochastic", "seed": 7}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # One 768-element weight: one DDP bucket, the same layout as mixprec's wrapper (a multiple of 128).
    return torch.nn.Sequential(torch.nn.Linear(6, 128, bias=False), torch.nn.Tanh())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 128, generator=g)
    if step == INF_STEP and rank == 0:
        x[0, 0] = float("inf")
    return x, y


def make_scaler() -> mixprec.DynamicLossScaler:
    return mixprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)


def make_schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--reduce", default="uint8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = UINT8 if args.reduce == "uint8" else {}

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    early_calls = (
        lambda: mixprec_accelerate.apply(accelerator, net),
        lambda: mixprec_accelerate.use_scaler(accelerator, make_scaler()),
    )
    for early in early_calls:
        try:  # before prepare(): one clear error, on every rank, before any collective
            early()
        except ValueError as exc:
            accelerator.print(f"before prepare(): ValueError: {exc}")
    model, opt, sched = accelerator.prepare(net, opt, make_schedule(opt))
    mixprec_accelerate.apply(accelerator, model, reduce=args.reduce, **options)  # the comm hook
    scaler = mixprec_accelerate.use_scaler(accelerator, make_scaler())  # mixprec's loss scaler

    rank = accelerator.process_index
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()  # Accelerate skips it when opt.step_was_skipped
        accelerator.print(f"step {step}: skipped {opt.step_was_skipped}, scale {scaler.get_scale()}")
    weight = net[0].weight.detach()
    gathered = accelerator.gather(weight[None])
    accelerator.print(f"replicas identical: {torch.equal(gathered[0], gathered[-1])}")
    accelerator.print(f"steps skipped: {scaler.steps_skipped}, lr {sched.get_last_lr()[0]}")
    if args.out and accelerator.is_main_process:
        torch.save(
            {
                "weight": weight.clone(),
                "skipped": scaler.steps_skipped,
                "scale": scaler.get_scale(),
                "lr": sched.get_last_lr()[0],
            },
            args.out,
        )
    accelerator.print("train_accelerate example: OK")
    # Drop the DDP model before the process group goes (here or at exit): torch 2.13 sometimes aborts a rank
    # ("terminate called without an active exception") when a gloo group is destroyed under a live DDP module.
    del model
    accelerator.free_memory()  # the accelerator's own references to the prepared model, then gc
    accelerator.end_training()


if __name__ == "__main__":
    main()
