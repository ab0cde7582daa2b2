"""mixprec inside PyTorch Lightning: a DDP strategy with a mixprec reducer, a precision plugin with its scaler.

::

    trainer = lightning.pytorch.Trainer(
        strategy=MixprecDDPStrategy("uint8", error_feedback=True),
        plugins=[MixprecPrecision(mixprec.DynamicLossScaler(init_scale=2**12))],
    )

:class:`MixprecDDPStrategy` is Lightning's ``DDPStrategy`` that registers
:func:`mixprec.integrations.ddp_reducer.reducer_hook` on the DDP model it builds, on every device type
(Lightning registers its own ``ddp_comm_hook`` only on CUDA). :class:`MixprecPrecision` scales the loss with
a mixprec loss scaler, unscales before gradient clipping, agrees on overflow across ranks, skips the
optimizer step and the step-interval LR schedulers on an overflowing step (Lightning #21339, torch #55585)
and saves the scaler's state in checkpoints. FSDP2: apply ``fully_shard`` in ``configure_model`` and call
:func:`mixprec.fsdp.use_fp32_accumulation` there (docs/integrations.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from mixprec.comm.live_audit import AuditResult, check_audit_every
from mixprec.comm.reducer import BucketReducer, registered_reducers
from mixprec.integrations.ddp_reducer import ReducerHookState, reducer_hook
from mixprec.scaling import DynamicLossScaler, LossScaler, SkipAwareLR

__all__ = ["MixprecDDPStrategy", "MixprecPrecision"]

_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class MixprecDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose gradient buckets are averaged by a mixprec reducer.

    Args:
        reduce: a registered reducer name (``mixprec.comm.registered_reducers()``) or a reducer object.
        strategy_options: keyword arguments for ``DDPStrategy`` (``process_group_backend``, ``timeout``,
            ``start_method``, ``find_unused_parameters``...), not its comm-hook arguments.
        audit_every: None, or an int N >= 1: the live numerics audit (:mod:`mixprec.comm.live_audit`) every N
            steps. Each audit's numeric ``audit_*`` fields go to the trainer's loggers
            (``logger.log_metrics(row, step=trainer.global_step)``, rank 0 only, as Lightning's loggers do)
            and stay in ``hook_state.audit_rows`` on every rank.
        **reducer_options: the reducer's options (``error_feedback=True``, ``rounding="stochastic"``, ``seed``...).

    :attr:`hook_state` (a :class:`ReducerHookState`) exists once the model is wrapped. ValueError: an
    unknown reducer name, or comm-hook arguments in ``strategy_options`` (the reducer is the hook).
    """

    strategy_name = "mixprec_ddp"

    def __init__(
        self,
        reduce: str | BucketReducer = "fp32_accumulate",
        *,
        strategy_options: dict[str, Any] | None = None,
        audit_every: int | None = None,
        **reducer_options: Any,
    ) -> None:
        check_audit_every(audit_every)
        if isinstance(reduce, str):
            if reduce not in registered_reducers():
                raise ValueError(f"unknown reducer {reduce!r}; registered reducers: {', '.join(registered_reducers())}")
        elif not isinstance(reduce, BucketReducer):
            raise TypeError(f"reduce must be a reducer name or a BucketReducer; got {type(reduce).__name__}")
        options = dict(strategy_options or {})
        clash = sorted(set(options) & set(_HOOK_ARGS))
        if clash:
            raise ValueError(
                f"strategy_options {clash} would replace the mixprec reducer hook: use DDPStrategy for a "
                "hook of your own"
            )
        super().__init__(**options)
        self.mixprec_reduce = reduce  # not "reduce": DDPStrategy.reduce is its collective
        self.reducer_options = reducer_options
        self.audit_every = audit_every
        self.hook_state: ReducerHookState | None = None

    def _register_ddp_hooks(self) -> None:
        model = self.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(f"internal error: DDPStrategy built a {type(model).__name__}, not a DDP model")
        self.hook_state = ReducerHookState(
            self.mixprec_reduce,
            process_group=model.process_group,
            audit_every=self.audit_every,
            on_audit=self._log_audit,
            **self.reducer_options,
        )
        model.register_comm_hook(self.hook_state, reducer_hook)

    def _log_audit(self, result: AuditResult) -> None:
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        if trainer is None:
            return
        row = {k: float(v) for k, v in result.as_row().items() if isinstance(v, int | float)}
        for logger in trainer.loggers:
            logger.log_metrics(row, step=trainer.global_step)


class _SkipAwareScheduler(SkipAwareLR):
    """SkipAwareLR whose checkpoint state is the scheduler's own: a checkpoint loads with or without it."""

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class MixprecPrecision(Precision):
    """Lightning precision plugin that runs a mixprec loss scaler.

    Args:
        scaler: a :class:`mixprec.DynamicLossScaler` (default: ``DynamicLossScaler()``), a
            ``StaticLossScaler`` or ``mixprec.scaling.scaler_from(...)``.
        autocast_dtype: None (no autocast: the model's own dtypes), ``torch.bfloat16`` or ``torch.float16``
            (``torch.autocast`` on ``device`` around forward).
        device: the autocast device type, ``"cpu"`` or ``"cuda"``.

    After each optimizer step: ``scaler.last_step_skipped``, ``scaler.steps_skipped``; the step-interval
    schedulers of ``configure_optimizers`` advance only on steps that ran (their ``steps_skipped`` counts
    the others). Gradients stay fp32 (mixprec's scaler refuses to unscale fp16 gradients in place).
    """

    precision = "32-true"

    def __init__(
        self, scaler: LossScaler | None = None, *, autocast_dtype: torch.dtype | None = None, device: str = "cpu"
    ) -> None:
        if scaler is None:
            scaler = DynamicLossScaler()
        if not isinstance(scaler, LossScaler):
            raise TypeError(
                f"scaler must be a mixprec loss scaler (DynamicLossScaler, StaticLossScaler, scaler_from(...)); "
                f"got {type(scaler).__name__}: torch's GradScaler goes to Lightning's MixedPrecision plugin"
            )
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16; got {autocast_dtype}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype
        self.device = device

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        self._skip_aware_schedulers(model)
        closure_result = closure()
        skipped_backward = closure_result is None and getattr(model, "automatic_optimization", True)
        if skipped_backward:
            return closure_result
        self.scaler.unscale_(optimizer)  # before on_before_optimizer_step and gradient clipping
        self._after_closure(model, optimizer)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def _skip_aware_schedulers(self, model: Any) -> None:
        trainer = getattr(model, "_trainer", None)
        for config in getattr(trainer, "lr_scheduler_configs", ()):
            if config.interval == "step" and not isinstance(config.scheduler, SkipAwareLR):
                config.scheduler = _SkipAwareScheduler(config.scheduler, self.scaler)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device, dtype=self.autocast_dtype, cache_enabled=False):
            yield

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
