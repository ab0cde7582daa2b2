"""Runs for tests/test_integrations_audit.py: the Accelerate and Lightning examples' training with ``audit_every``.

``python adapter_audit_runs.py accelerate|lightning --out FILE [--audit-every N]`` (Accelerate under torchrun
--nproc-per-node 2; Lightning starts its second process itself): the model, batches, scaler and schedule of
examples/integrations/train_<name>.py with the fp32_accumulate reducer. Rank 0 saves the final weight and the
audit rows the adapter logged: through a tracker given to ``Accelerator(log_with=...)``, or Lightning's CSVLogger.
"""

import argparse
import csv
import gc
import importlib.util
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "integrations"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accelerate_run(out: str, audit_every: int | None) -> None:
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    from mixprec.integrations import accelerate as mixprec_accelerate

    class Rows(GeneralTracker):
        name = "rows"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        @property
        def tracker(self):
            return self.rows

        def store_init_configuration(self, values: dict) -> None:
            pass

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            self.rows.append({**values, "logged_step": step})

    ex = _example("train_accelerate")
    torch.set_num_threads(1)
    tracker = Rows()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("audit")
    net = ex.make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    model, opt, sched = accelerator.prepare(net, opt, ex.make_schedule(opt))
    state = mixprec_accelerate.apply(accelerator, model, reduce="fp32_accumulate", audit_every=audit_every)
    mixprec_accelerate.use_scaler(accelerator, ex.make_scaler())
    for step in range(ex.STEPS):
        x, y = ex.batch(step, accelerator.process_index)
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
    if accelerator.is_main_process:
        weight = net[0].weight.detach().clone()
        torch.save({"weight": weight, "rows": tracker.rows, "state_rows": state.audit_rows}, out)
    del model
    accelerator.free_memory()
    accelerator.end_training()


def lightning_run(out: str, audit_every: int | None) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from mixprec.integrations.lightning import MixprecDDPStrategy, MixprecPrecision

    ex = _example("train_lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ex.make_model()

        def training_step(self, index: torch.Tensor, batch_idx: int) -> torch.Tensor:
            x, y = ex.batch(batch_idx, self.global_rank)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> dict:
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": ex.make_schedule(opt), "interval": "step"}}

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.arange(ex.STEPS), batch_size=None)

    torch.set_num_threads(1)
    strategy = MixprecDDPStrategy(
        "fp32_accumulate", strategy_options={"process_group_backend": "gloo"}, audit_every=audit_every
    )
    logger = CSVLogger(str(Path(out).parent / "logs"), name="audit")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[MixprecPrecision(ex.make_scaler())],
        max_steps=ex.STEPS,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = Module()
    trainer.fit(module)
    if trainer.is_global_zero:
        logger.finalize("success")
        path = Path(logger.log_dir) / "metrics.csv"
        rows = list(csv.DictReader(path.open())) if path.exists() else []
        state_rows = strategy.hook_state.audit_rows
        torch.save({"weight": module.net[0].weight.detach().clone(), "rows": rows, "state_rows": state_rows}, out)
    # Lightning leaves the gloo group to interpreter shutdown, where torch 2.13 now and then aborts a rank
    # ("terminate called without an active exception"): drop the DDP module, then the group, while alive.
    trainer.strategy.barrier()
    del trainer, module, strategy
    gc.collect()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("adapter", choices=["accelerate", "lightning"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--audit-every", type=int, default=None)
    args = parser.parse_args()
    (accelerate_run if args.adapter == "accelerate" else lightning_run)(args.out, args.audit_every)


if __name__ == "__main__":
    main()
