"""mixprec inside the Hugging Face Trainer (which runs on Accelerate): one callback.

Run: torchrun --nproc-per-node 2 examples/integrations/hf_trainer_accelerate.py [--out params.pt]
(CPU, gloo; needs ``transformers``.)

``trainer.add_callback(MixprecTrainerCallback(trainer, reduce="uint8", scaler=...))`` registers the reducer
hook and mixprec's loss scaler when training begins (after the Trainer's ``prepare()``). The same model,
batches, reducer and scaler as train_accelerate.py; the Trainer steps its scheduler only when
``accelerator.optimizer_step_was_skipped`` is False. ``max_grad_norm=0``: the Trainer's clipping unscales only
torch's GradScaler (docs/integrations.md).
"""

import argparse
import tempfile

import torch
import torch.distributed as dist

import mixprec
from mixprec.integrations.accelerate import MixprecTrainerCallback

STEPS = 4
INF_STEP = 2  # rank 0's batch holds an inf at this step
UINT8 = {"chunk_size": 64, "error_feedback": True, "rounding": "stochastic", "seed": 7}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
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


class Model(torch.nn.Module):
    """The Trainer's model: returns {"loss": ...}; each rank draws its own batch of each step, as the
    tests' reference does (the dataset only counts the steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.calls = 0

    def forward(self, i: torch.Tensor) -> dict[str, torch.Tensor]:
        x, y = batch(self.calls, dist.get_rank())
        self.calls += 1
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def main() -> None:
    from transformers import Trainer, TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=1,
        max_steps=STEPS,
        max_grad_norm=0.0,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    data = [{"i": torch.tensor(0)} for _ in range(STEPS * 2)]
    sched = make_schedule(opt)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, optimizers=(opt, sched))
    scaler = make_scaler()
    trainer.add_callback(MixprecTrainerCallback(trainer, reduce="uint8", scaler=scaler, **UINT8))
    trainer.train()
    weight = model.net[0].weight.detach()
    if dist.get_rank() == 0:
        print(f"steps skipped: {scaler.steps_skipped}, scale {scaler.get_scale()}, lr {sched.get_last_lr()[0]}")
        if args.out:
            torch.save(
                {
                    "weight": weight.clone(),
                    "skipped": scaler.steps_skipped,
                    "scale": scaler.get_scale(),
                    "lr": sched.get_last_lr()[0],
                },
                args.out,
            )
        print("hf_trainer_accelerate example: OK")
    # Drop the DDP model before the process group goes, as in train_accelerate.py.
    accelerator = trainer.accelerator
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
