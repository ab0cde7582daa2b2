"""mixprec inside PyTorch Lightning: MixprecDDPStrategy (a mixprec reducer as DDP's comm hook) and
MixprecPrecision (mixprec's loss scaler; LR schedulers do not step on skipped steps).

Run: python examples/integrations/train_lightning.py [--reduce uint8] [--out params.pt]
(2 CPU processes on gloo, Lightning starts the second; tens of seconds, mostly Lightning's start-up.)

Step 2 feeds an inf on rank 0: the optimizer step is skipped on both ranks, the loss scale backs off and
the step-interval scheduler does not advance. With ``--out`` rank 0 saves the final parameters, skips, scale
and learning rate (tests/test_integrations_lightning.py compares them with mixprec's own DistributedDataParallel).
"""

import argparse

import torch

import mixprec
from mixprec.integrations.lightning import MixprecDDPStrategy, MixprecPrecision

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
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, index: torch.Tensor, batch_idx: int) -> torch.Tensor:
            x, y = batch(batch_idx, self.global_rank)  # each rank's own batches, as the tests' reference
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> dict:
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": make_schedule(opt), "interval": "step"}}

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.arange(STEPS), batch_size=None)

    parser = argparse.ArgumentParser()
    parser.add_argument("--reduce", default="uint8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = UINT8 if args.reduce == "uint8" else {}

    torch.set_num_threads(1)
    scaler = make_scaler()
    strategy = MixprecDDPStrategy(args.reduce, strategy_options={"process_group_backend": "gloo"}, **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[MixprecPrecision(scaler)],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = Module()
    trainer.fit(module)
    weight = module.net[0].weight.detach()
    lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    gathered = trainer.strategy.all_gather(weight)
    if trainer.is_global_zero:
        print(f"replicas identical: {torch.equal(gathered[0], gathered[1])}")
        print(f"steps skipped: {scaler.steps_skipped}, scale {scaler.get_scale()}, lr {lr}")
        if args.out:
            torch.save(
                {"weight": weight.clone(), "skipped": scaler.steps_skipped, "scale": scaler.get_scale(), "lr": lr},
                args.out,
            )
        print("train_lightning example: OK")


if __name__ == "__main__":
    main()
