"""mixprec inside Hugging Face Accelerate: the reducer hook after ``prepare()`` and mixprec's loss scaler.

``DistributedDataParallelKwargs(comm_hook=...)`` accepts only torch's own hooks, and ``GradScalerKwargs``
configures only torch's ``GradScaler``; both are therefore set after ``prepare()``::

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    mixprec.integrations.accelerate.apply(accelerator, model, reduce="uint8", error_feedback=True)
    mixprec.integrations.accelerate.use_scaler(accelerator, mixprec.DynamicLossScaler(init_scale=2**12))

``apply`` registers :func:`mixprec.integrations.ddp_reducer.reducer_hook` on a DDP model and
:func:`mixprec.fsdp.use_fp32_accumulation` on an FSDP2 one. ``use_scaler`` makes ``accelerator.backward``
scale the loss and every prepared optimizer's ``step`` unscale, check overflow across ranks, step or skip,
and update the scale; Accelerate's prepared schedulers already skip when ``optimizer.step_was_skipped``.
The Hugging Face ``Trainer`` prepares inside ``train()``: :class:`MixprecTrainerCallback` does both at
``on_train_begin`` (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.comm.live_audit import AuditResult
from mixprec.integrations.ddp_reducer import ReducerHookState, reducer_hook
from mixprec.scaling import LossScaler

__all__ = ["MixprecTrainerCallback", "apply", "use_scaler"]  # noqa: F822  (built by __getattr__ on first use)


def _distributed_type(accelerator: Any) -> str:
    try:
        return str(accelerator.distributed_type.value)
    except AttributeError:
        raise TypeError(f"accelerator must be an accelerate.Accelerator; got {type(accelerator).__name__}") from None


def apply(
    accelerator: Any,
    model: Any,
    reduce: Any = "fp32_accumulate",
    *,
    audit_every: int | None = None,
    **reducer_options: Any,
) -> Any:
    """Reduce ``model``'s gradients with a mixprec reducer; ``model`` is what ``accelerator.prepare`` returned.

    DDP (``MULTI_CPU``, ``MULTI_GPU``...): registers :func:`reducer_hook` with a :class:`ReducerHookState`
    of ``reduce`` and ``reducer_options``; returns that state (its ``reducer`` holds stats and residuals).
    FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): ``reduce`` must be ``"fp32_accumulate"``
    (options: ``rounding``, ``topology``, ``inter_node_dtype``); installs FSDP2's custom reduce-scatter and
    returns how many FSDP modules got it. One process (``NO``): nothing to reduce, returns None.

    ``audit_every=N``: the live numerics audit (:mod:`mixprec.comm.live_audit`) every N steps. Each audit's
    numeric ``audit_*`` fields go to ``accelerator.log(row, step=audit_step)`` (the main process's trackers:
    ``Accelerator(log_with=...)`` and ``init_trackers``; nothing is logged without them); with DDP the
    returned state's ``audit_rows`` holds them too, on every rank.

    Raises:
        TypeError: not an Accelerator.
        ValueError: ``model`` was not prepared (a bare module: call ``accelerator.prepare`` first), is wrapped
            by something else (``DataParallel``, DeepSpeed, FSDP1), or the reducer does not fit the strategy.
    """
    kind = _distributed_type(accelerator)
    if isinstance(model, torch.nn.DataParallel):
        raise ValueError("model is a torch.nn.DataParallel: mixprec reducers need one process per rank (torchrun)")
    if kind == "NO":
        return None
    if kind == "DEEPSPEED":
        raise ValueError(
            "apply() does not hook DeepSpeed engines: DeepSpeed reduces gradients itself; use mixprec's "
            "DeepSpeed-compatible scaler (mixprec.scaling.scaler_from('deepspeed', ...)) or a DDP/FSDP2 plugin"
        )
    if kind == "FSDP":
        return _apply_fsdp2(accelerator, model, reduce, {**reducer_options, **_audit_options(accelerator, audit_every)})
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"model is a {type(model).__name__}, not the DistributedDataParallel that accelerator.prepare() "
            f"returns for {kind}: call apply(accelerator, prepared_model, ...) after model = accelerator.prepare(model)"
        )
    state = ReducerHookState(
        reduce, process_group=model.process_group, **_audit_options(accelerator, audit_every), **reducer_options
    )
    model.register_comm_hook(state, reducer_hook)
    return state


def _audit_options(accelerator: Any, audit_every: int | None) -> dict[str, Any]:
    """``audit_every`` and the callback that hands each audit row to ``accelerator.log``."""
    if audit_every is None:
        return {}

    def log(result: AuditResult) -> None:
        row = {k: v for k, v in result.as_row().items() if isinstance(v, int | float)}
        accelerator.log(row, step=result.step)

    return {"audit_every": audit_every, "on_audit": log}


def _apply_fsdp2(accelerator: Any, model: Any, reduce: Any, options: dict[str, Any]) -> int:
    from mixprec.integrations.fsdp2 import use_fp32_accumulation

    if not getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            "apply() supports FSDP2 only (FullyShardedDataParallelPlugin(fsdp_version=2)); FSDP1 has no "
            "custom reduce-scatter"
        )
    if reduce != "fp32_accumulate":
        raise ValueError(
            f"reduce={reduce!r} cannot run as FSDP2's reduce-scatter: only 'fp32_accumulate' can (compressed "
            "reducers need DDP buckets: use Accelerate's DDP instead of the FSDP plugin)"
        )
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model holds no fully_shard-ed module: call apply() on what accelerator.prepare() returned")
    return use_fp32_accumulation(model, **options)


def use_scaler(accelerator: Any, scaler: LossScaler) -> LossScaler:
    """Make ``scaler`` (a :class:`mixprec.DynamicLossScaler`, ``mixprec.scaling.scaler_from(...)``) the
    accelerator's loss scaler, for every optimizer already prepared; returns it.

    Call after ``prepare()`` and without ``mixed_precision="fp16"`` (whose torch GradScaler it would replace
    silently: refused). Then ``accelerator.backward(loss)`` scales, ``optimizer.step()`` unscales, agrees on
    overflow across ranks, steps or skips and updates; ``optimizer.step_was_skipped`` and the scaler's
    ``last_step_skipped``/``steps_skipped`` report skips, and Accelerate's prepared schedulers do not step on
    a skipped step. Gradient clipping: call ``scaler.unscale_(optimizer.optimizer)`` before clipping
    (``accelerator.clip_grad_norm_`` unscales only torch's scaler).
    """
    _distributed_type(accelerator)
    if not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a mixprec loss scaler; got {type(scaler).__name__}")
    if getattr(accelerator, "scaler", None) is not None and not isinstance(accelerator.scaler, LossScaler):
        raise ValueError(
            "the accelerator already has torch's GradScaler (mixed_precision='fp16'): create it with "
            "mixed_precision='no' (or 'bf16') and let use_scaler() do the loss scaling"
        )
    optimizers = list(getattr(accelerator, "_optimizers", []))
    if not optimizers:
        raise ValueError("the accelerator has no prepared optimizer: call use_scaler() after accelerator.prepare()")
    from accelerate.optimizer import patch_optimizer_step

    accelerator.scaler = scaler
    for opt in optimizers:
        # What AcceleratedOptimizer.__init__ sets up when it is given a scaler: its step() tells a skipped
        # step (the scaler did not call optimizer.step) from a taken one through the patched method.
        opt.scaler = scaler
        opt._accelerate_step_called = False
        opt._optimizer_original_step_method = opt.optimizer.step
        opt._optimizer_patched_step_method = patch_optimizer_step(opt, opt.optimizer.step)
    return scaler


def _trainer_callback() -> type:
    """MixprecTrainerCallback, built on first use: importing transformers takes about a second."""
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError("MixprecTrainerCallback needs transformers (pip install transformers)") from exc

    class MixprecTrainerCallback(TrainerCallback):  # type: ignore[misc]
        """Hugging Face ``Trainer`` callback: at ``on_train_begin`` (after the Trainer's ``prepare()``) apply
        ``reduce`` to the wrapped model and, with ``scaler``, make it the accelerator's loss scaler::

            trainer.add_callback(MixprecTrainerCallback(trainer, reduce="uint8", scaler=DynamicLossScaler()))

        Set ``TrainingArguments(max_grad_norm=0)`` or unscale yourself: the Trainer's clipping unscales only
        torch's GradScaler. ``state`` is what :func:`apply` returned.
        """

        def __init__(
            self, trainer: Any, reduce: Any = "fp32_accumulate", scaler: LossScaler | None = None, **options: Any
        ) -> None:
            if scaler is not None and not isinstance(scaler, LossScaler):
                raise TypeError(f"scaler must be a mixprec loss scaler; got {type(scaler).__name__}")
            self.trainer = trainer
            self.reduce = reduce
            self.scaler = scaler
            self.options = options
            self.state: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer = self.trainer
            self.state = apply(trainer.accelerator, trainer.model_wrapped, self.reduce, **self.options)
            if self.scaler is not None:
                use_scaler(trainer.accelerator, self.scaler)

    MixprecTrainerCallback.__module__ = __name__
    return MixprecTrainerCallback


def __getattr__(name: str) -> Any:
    if name == "MixprecTrainerCallback":
        cls = _trainer_callback()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
