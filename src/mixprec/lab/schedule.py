"""The learning-rate schedule of ``mixprec train`` ([optimizer] schedule), advanced only on steps taken.

'warmup_cosine' is the common shape: linear warmup from lr / warmup_steps to lr over ``warmup_steps``, then a
cosine from lr down to ``min_lr`` at ``training.steps``. It is a ``torch.optim.lr_scheduler.LambdaLR`` on the
torch optimizer that holds the learning rate (the fp32-master one inside MasterWeightOptimizer or
ShardedOptimizer), wrapped in :class:`mixprec.scaling.SkipAwareLR`: a step the loss scaler skipped (inf/NaN
gradients) does not advance it, so the schedule counts optimizer steps taken, as torch's own schedulers cannot.

Nothing new is checkpointed: the schedule's position is the scaler's ``steps_taken``, which the checkpoint
already holds, so a resumed run continues on the same learning rate bit for bit. 'constant' builds nothing
(the run is exactly that of a build without schedules).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from mixprec.lab.config import TrainConfig
from mixprec.scaling import LossScaler, SkipAwareLR

__all__ = ["build_schedule", "current_lr", "lr_factor"]


def lr_factor(cfg: TrainConfig, taken: int) -> float:
    """The multiplier of ``optimizer.lr`` after ``taken`` optimizer steps (1.0 for 'constant')."""
    o = cfg.optimizer
    if o.schedule == "constant":
        return 1.0
    if taken < o.warmup_steps:
        return (taken + 1) / o.warmup_steps
    span = max(1, cfg.training.steps - o.warmup_steps)
    progress = min(1.0, (taken - o.warmup_steps) / span)
    floor = o.min_lr / o.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _torch_optimizer(optimizer: Any) -> Any:
    # MasterWeightOptimizer and ShardedOptimizer step an inner torch optimizer whose groups hold the lr in use.
    return getattr(optimizer, "optimizer", optimizer)


def build_schedule(cfg: TrainConfig, optimizer: Any, scaler: LossScaler) -> SkipAwareLR | None:
    """The run's schedule positioned at ``scaler.steps_taken`` (0 for a new run, the checkpoint's on resume), or
    None for 'constant'."""
    if cfg.optimizer.schedule == "constant":
        return None
    inner = _torch_optimizer(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda k: lr_factor(cfg, k))
    with warnings.catch_warnings():
        # Fast-forwarding on resume, before any optimizer.step() of this process: torch's order warning is moot.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(scaler.steps_taken):
            scheduler.step()
    return SkipAwareLR(scheduler, scaler)


def current_lr(optimizer: Any) -> float:
    """The learning rate the next optimizer step uses (that of the first parameter group)."""
    return float(_torch_optimizer(optimizer).param_groups[0]["lr"])
