"""Skip-aware learning-rate scheduling: advance a scheduler only on iterations whose optimizer step ran.

A loss scaler skips the optimizer step of an overflowing iteration. torch's LR schedulers cannot tell (pytorch
issues #55585 and #67590): they advance anyway, and warn when the first step was skipped. The scalers record
the outcome in ``scaler.last_step_skipped`` (set by ``step()`` and ``update()``); :class:`SkipAwareLR` reads it::

    scheduler = SkipAwareLR(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000), scaler)
    scaler.step(opt)
    scaler.update()
    scheduler.step()          # advances only if the step ran; returns whether it did

The same pattern by hand: ``if not scaler.last_step_skipped: scheduler.step()``.
"""

from __future__ import annotations

from typing import Any

from mixprec.core.validate import check_positive_int
from mixprec.scaling.scaler import LossScaler

__all__ = ["SkipAwareLR"]


class SkipAwareLR:
    """Wrap an LR scheduler so that ``step()`` advances it only when ``scaler``'s last optimizer step ran.

    Args:
        scheduler: any object with ``step()`` (a ``torch.optim.lr_scheduler.LRScheduler``); give
            :class:`mixprec.MasterWeightOptimizer`'s inner ``opt.optimizer`` to the scheduler.
        scaler: the mixprec loss scaler whose ``step``/``update`` (or :class:`mixprec.Updater`) ran this iteration.

    ``steps_skipped`` counts the iterations it did not advance. ``state_dict``/``load_state_dict`` save the
    scheduler's state with that count. Other attributes (``get_last_lr``, ``last_epoch``...) are the scheduler's.
    """

    def __init__(self, scheduler: Any, scaler: LossScaler) -> None:
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method; got {type(scheduler).__name__}")
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                "scaler must be a mixprec loss scaler (DynamicLossScaler or StaticLossScaler); got "
                f"{type(scaler).__name__}"
            )
        self.scheduler = scheduler
        self.scaler = scaler
        self.steps_skipped = 0

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Advance the scheduler unless the scaler's last iteration skipped its optimizer step; True if it did.

        Before any iteration (``last_step_skipped`` is None) the scheduler advances, as it would unwrapped.
        """
        if self.scaler.last_step_skipped:
            self.steps_skipped += 1
            return False
        self.scheduler.step(*args, **kwargs)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "steps_skipped": self.steps_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "scheduler" not in state_dict:
            raise ValueError("state_dict must come from SkipAwareLR.state_dict() (keys: scheduler, steps_skipped)")
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.steps_skipped = check_positive_int(
            "state_dict['steps_skipped']", state_dict.get("steps_skipped", 0), minimum=0
        )

    def __getattr__(self, name: str) -> Any:
        # only reached for names SkipAwareLR lacks: get_last_lr(), last_epoch, optimizer...
        if name in ("scheduler", "scaler", "steps_skipped"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareLR({self.scheduler!r}, skipped={self.steps_skipped})"
