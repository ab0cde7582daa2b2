"""One call per optimizer step: gradient accumulation over microbatches with loss scaling (after NNabla's
``DynamicLossScalingUpdater`` from its mixed-precision training tutorial), with a bounded retry where NNabla
recurses.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.scaling.master import clip_grad_norm_, grad_norm
from mixprec.scaling.scaler import LossScaler, StaticLossScaler

__all__ = ["UpdateResult", "Updater"]


@dataclass(frozen=True)
class UpdateResult:
    """What one :meth:`Updater.step` did.

    Attributes:
        loss: mean unscaled loss over the microbatches of the last attempt (fp64 Python float), whatever the
            ``microbatch_reduction``.
        skipped: True when the last attempt overflowed and no optimizer step was taken.
        scale: the loss scale the last attempt used.
        grad_norm: global gradient norm after unscaling, before clipping (fp32 accumulation);
            None when the step was skipped.
        retries: how many extra attempts were made at a smaller scale (0 when the first one was clean).
        culprits: when the last attempt overflowed, the names of the parameters whose gradients held inf/NaN
            on any rank (the same on every rank); empty otherwise.
    """

    loss: float
    skipped: bool
    scale: float
    grad_norm: float | None
    retries: int
    culprits: tuple[str, ...] = ()


def _check_not_empty(name: str, microbatch: Any) -> None:
    """Refuse a microbatch whose tensors have no rows: the mean loss over it is NaN while its gradients are zero,
    so the step would look clean and the optimizer (weight decay, momentum) would still move the weights."""
    items = (
        microbatch.values()
        if isinstance(microbatch, dict)
        else (microbatch if isinstance(microbatch, list | tuple) else (microbatch,))
    )
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 1 and item.shape[0] == 0:
            raise ValueError(
                f"{name} is empty (a tensor of shape {tuple(item.shape)}): a microbatch needs at least one row "
                "(drop the empty one and lower num_microbatches, or use drop_last=True in the DataLoader)"
            )


class Updater:
    """Zero-grad, accumulate over microbatches, reduce, check overflow, then skip or unscale/clip/decay/step.

    Each microbatch's loss is divided by ``num_microbatches`` and multiplied by the loss scale before its
    backward, so the accumulated gradient is the mean over the whole batch (the practitioners' rule for gradient
    accumulation: ``loss / num_microbatches * loss_scale``). ``microbatch_reduction="sum"`` skips the division,
    as NNabla's ``DynamicLossScalingUpdater`` does: the gradient is then ``num_microbatches`` times the mean.
    For SGD (and momentum) that multiplies the effective learning rate by ``num_microbatches``: divide ``lr`` by
    it to match a "mean" run. Adam and AdamW normalise the gradient, so their steps barely change (only the
    ``eps`` term and coupled L2 ``weight_decay`` see the factor), but ``clip_grad_norm`` acts on the summed norm.
    In fp16 a sum needs a loss scale ``num_microbatches`` times smaller for the same overflow headroom.

    When ``model`` has ``no_sync()`` (torch DDP, mixprec's DistributedDataParallel) every microbatch but the last
    runs under it, so gradients are reduced once.

    Args:
        model: the module (its parameters get gradients).
        optimizer: a torch optimizer or :class:`MasterWeightOptimizer`.
        loss_fn: ``loss_fn(model, microbatch) -> scalar loss tensor`` (the mean over the microbatch).
        scaler: a loss scaler; default ``StaticLossScaler(1.0)``, which still detects inf/NaN and skips.
        num_microbatches: microbatches per step, int >= 1; ``step`` checks it gets that many.
        grad_reduce: ``grad_reduce(params)`` called once after the last backward and before the overflow
            check, to reduce ``.grad`` in place (e.g. an all-reduce); None when the model reduces itself.
        clip_grad_norm: clip the global norm (fp32) to this value after unscaling; None or 0 disables.
        weight_decay: L2 coefficient added to the gradient (``grad += weight_decay * param``) after
            clipping, as NNabla's ``DynamicLossScalingUpdater`` does; 0 disables. Prefer the optimizer's own
            decoupled decay (AdamW).
        max_retries: on overflow, redo the same microbatches at the backed-off scale up to this many times
            (0 = just skip, as GradScaler does). Only useful with a dynamic scaler.
        microbatch_reduction: ``"mean"`` (default: divide each loss by ``num_microbatches``) or ``"sum"``
            (NNabla's accumulation); see above for how it interacts with the learning rate.

    The model's parameter names are given to the scaler (:meth:`LossScaler.name_parameters`), so an overflow
    is reported by name in ``UpdateResult.culprits`` and in the floor error.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        *,
        scaler: LossScaler | None = None,
        num_microbatches: int = 1,
        grad_reduce: Callable[[list[torch.Tensor]], None] | None = None,
        clip_grad_norm: float | None = None,
        weight_decay: float = 0.0,
        max_retries: int = 0,
        microbatch_reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, microbatch)")
        if not all(callable(getattr(optimizer, name, None)) for name in ("step", "zero_grad")) or not hasattr(
            optimizer, "param_groups"
        ):
            raise TypeError(
                "optimizer must be a torch optimizer (or MasterWeightOptimizer / ShardedOptimizer) with "
                f"param_groups, step() and zero_grad(); got {type(optimizer).__name__}"
            )
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                "scaler must be a mixprec loss scaler (DynamicLossScaler or StaticLossScaler) or None; got "
                f"{type(scaler).__name__} (torch.amp.GradScaler's state_dict loads into DynamicLossScaler)"
            )
        if grad_reduce is not None and not callable(grad_reduce):
            raise TypeError(
                f"grad_reduce must be callable as grad_reduce(grads) or None; got {type(grad_reduce).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler if scaler is not None else StaticLossScaler(1.0)
        self.num_microbatches = check_positive_int("num_microbatches", num_microbatches)
        self.grad_reduce = grad_reduce
        self.clip_grad_norm = None if not clip_grad_norm else check_positive_float("clip_grad_norm", clip_grad_norm)
        self.weight_decay = check_positive_float("weight_decay", weight_decay, allow_zero=True)
        self.max_retries = check_positive_int("max_retries", max_retries, minimum=0)
        self.microbatch_reduction = check_choice("microbatch_reduction", microbatch_reduction, ("mean", "sum"))
        self.scaler.name_parameters(model)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, microbatches: Sequence[Any]) -> UpdateResult:
        """Run one optimizer step over ``microbatches`` (exactly ``num_microbatches`` of them)."""
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"microbatches holds {len(microbatches)} items; num_microbatches is {self.num_microbatches}"
            )
        for i, mb in enumerate(microbatches):
            _check_not_empty(f"microbatches[{i}]", mb)
        retries = 0
        while True:
            scale = self.scaler.get_scale()
            loss = self._forward_backward(microbatches)
            if self.grad_reduce is not None:
                self.grad_reduce([p.grad for p in self.model.parameters() if p.grad is not None])
            self.scaler.unscale_(self.optimizer)
            if self.scaler.has_overflow(self.optimizer):
                self.scaler.update()
                if retries < self.max_retries:
                    retries += 1
                    continue
                return UpdateResult(
                    loss=loss,
                    skipped=True,
                    scale=scale,
                    grad_norm=None,
                    retries=retries,
                    culprits=self.scaler.last_culprits,
                )
            norm = self._clip_and_decay()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return UpdateResult(loss=loss, skipped=False, scale=scale, grad_norm=norm, retries=retries)

    def _forward_backward(self, microbatches: Sequence[Any]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        no_sync = getattr(self.model, "no_sync", None)
        n = self.num_microbatches
        divisor = n if self.microbatch_reduction == "mean" else 1
        total: torch.Tensor | None = None
        for i, mb in enumerate(microbatches):
            ctx = no_sync() if (callable(no_sync) and i < n - 1) else contextlib.nullcontext()
            with ctx:
                loss = self.loss_fn(self.model, mb)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError("loss_fn must return a scalar (one-element) tensor")
                self.scaler.scale(loss.float() / divisor).backward()
            # Summed in fp64 on the loss's device: one host sync per step, not one per microbatch.
            term = loss.detach().reshape(()).double()
            total = term if total is None else total + term
        return float(total) / n if total is not None else 0.0

    @torch.no_grad()
    def _clip_and_decay(self) -> float:
        prepare = getattr(self.optimizer, "mixprec_prepare_grads_", None)
        if callable(prepare):
            prepare()
        params = [p for p in self._params() if p.grad is not None]
        # An optimizer that holds only a shard of the gradients (mixprec.parallel.ShardedOptimizer) knows the
        # global norm; the norm of its local pieces alone would clip each rank differently.
        own_clip = getattr(self.optimizer, "clip_grad_norm_", None)
        own_norm = getattr(self.optimizer, "grad_norm", None)
        if self.clip_grad_norm is not None:
            clip = own_clip if callable(own_clip) else lambda max_norm: clip_grad_norm_(params, max_norm)
            norm = float(clip(self.clip_grad_norm))
        else:
            norm = float(own_norm() if callable(own_norm) else grad_norm(params))
        if self.weight_decay:
            for p in params:
                p.grad.add_(p, alpha=self.weight_decay)
        return norm if math.isfinite(norm) else math.nan
