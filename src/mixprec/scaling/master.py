"""fp32 master weights for fp16/bf16 models, and gradient clipping with the norm taken in fp32.

Why master weights: an fp16 parameter has 11 significant bits, so an update smaller than 2**-11 of the
weight is rounded away (lost); bf16 (8 bits) loses updates below 2**-8. Keeping an fp32 copy, stepping
the optimizer on it and rounding back to the model dtype after every step keeps the small updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mixprec.core.dtypes import LOW_PRECISION_DTYPES
from mixprec.core.validate import check_norm_type, check_positive_float

__all__ = ["MasterWeightOptimizer", "clip_coefficient", "clip_grad_norm_", "grad_norm"]

# float32/float64 parameters are their own masters; the low-precision ones get an fp32 master copy
_PARAM_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION_DTYPES)


def grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Global norm of the gradients of ``params``, accumulated in fp32 whatever the gradients' dtype.

    Returns a 0-dim fp32 tensor on the first gradient's device (0.0 when there are no gradients); it is
    inf/NaN when any gradient is. ``norm_type`` is a p > 0 or ``math.inf``.
    """
    return _norm_of([p.grad for p in params if p.grad is not None], norm_type)


def _norm_of(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    norm_type = check_norm_type("norm_type", norm_type)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    per_tensor = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
    return torch.linalg.vector_norm(per_tensor, norm_type)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` in fp32, torch's own clipping rule (the 1e-6 avoids 0/0)."""
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most ``max_norm``; return the norm before.

    The norm is accumulated in fp32 (torch's own clip takes it in the gradients' dtype, which overflows
    for fp16 gradients with a norm above 65504). A non-finite norm leaves the gradients untouched: the
    overflow is the loss scaler's to handle. Call it after unscaling.
    """
    check_positive_float("max_norm", max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total = _norm_of(grads, norm_type)
    if not grads or not torch.isfinite(total):
        return total
    coef = clip_coefficient(total, max_norm)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total


class MasterWeightOptimizer:
    """Wrap a torch optimizer so that it steps fp32 master copies of low-precision model parameters.

    Example::

        model = MLP().half()
        opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
        scaler = DynamicLossScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)          # copies fp16 grads into fp32 master grads, then unscales those
        opt.clip_grad_norm_(1.0)      # norm in fp32
        scaler.step(opt)              # inner optimizer steps the masters, then rounds them into the model
        scaler.update()

    fp32 parameters are used as their own masters (no copy). fp16/bf16 ones get an fp32 clone whose
    ``.grad`` is a preallocated fp32 buffer filled from the model gradient (exact: fp16/bf16 -> fp32 is
    lossless). After ``step`` each master is rounded to nearest into its model parameter.

    Extra memory: 4 bytes of master weight + 4 bytes of master gradient per low-precision parameter,
    plus the inner optimizer's state (which it keeps in fp32 because it sees fp32 parameters).

    Args:
        params: model parameters, or param-group dicts as for any torch optimizer.
        optimizer_cls: the torch optimizer class (or any callable taking param groups and ``**kwargs``).
        **optimizer_kwargs: passed on (lr, betas, weight_decay, ...).

    ``param_groups`` and ``state`` are the inner optimizer's. LR schedulers need a real
    ``torch.optim.Optimizer``: give them ``opt.optimizer``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        /,
        **optimizer_kwargs: Any,
    ) -> None:
        if isinstance(optimizer_cls, str) or not callable(optimizer_cls):
            raise TypeError(
                "optimizer_cls must be a torch optimizer class (or a callable taking param groups), e.g. "
                f"torch.optim.AdamW; got {type(optimizer_cls).__name__} {optimizer_cls!r}"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or param-group dicts; got a single tensor")
        groups = list(params)
        if not groups:
            raise ValueError("params is empty: the optimizer would have nothing to step")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        master_groups = []
        for g in groups:
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError("params must be tensors or dicts with a 'params' entry (param groups)")
            plist = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            masters = []
            for p in plist:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"params must hold tensors; got {type(p).__name__}")
                if p.dtype not in _PARAM_DTYPES:
                    raise TypeError(
                        f"params must be floating point: float32, float64, float16 or bfloat16; got {p.dtype} (shape "
                        f"{tuple(p.shape)}): fp8 and complex parameters have no fp32 master weight here"
                    )
                if p.dtype in LOW_PRECISION_DTYPES:
                    m = p.detach().clone().float()
                    m.requires_grad_(p.requires_grad)
                else:
                    m = p
                self._model_params.append(p)
                self._master_params.append(m)
                masters.append(m)
            master_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        self.optimizer = optimizer_cls(master_groups, **optimizer_kwargs)
        self._low = [(p, m) for p, m in zip(self._model_params, self._master_params, strict=True) if p is not m]
        self._model_of = {id(m): p for p, m in zip(self._model_params, self._master_params, strict=True)}
        self._grads_ready = False

    # ------------------------------------------------------------------ optimizer-like surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def master_params(self) -> Iterator[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps (model parameters themselves where those are fp32)."""
        return iter(self._master_params)

    def model_params(self) -> Iterator[torch.Tensor]:
        return iter(self._model_params)

    def model_param(self, master: torch.Tensor) -> torch.Tensor:
        """The model parameter whose fp32 master is ``master`` (itself for fp32/fp64 parameters); used to name
        the parameters of an overflowing step."""
        model = self._model_of.get(id(master))
        if model is None:
            raise KeyError("master is not one of this optimizer's master parameters")
        return model

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model gradients; master gradients are refilled from them before every step."""
        for p in self._model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
        self._grads_ready = False

    @torch.no_grad()
    def mixprec_prepare_grads_(self) -> None:
        """Copy the model's low-precision gradients into the fp32 master gradients (exactly).

        Called by the loss scaler's ``unscale_`` and by ``step``; at most once per iteration, so gradients
        unscaled or clipped in between are not overwritten.
        """
        if self._grads_ready:
            return
        for p, m in self._low:
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            m.grad.copy_(p.grad)
        self._grads_ready = True

    def mixprec_discard_grads_(self) -> None:
        """Forget this iteration's master gradients: the next unscale or step copies the model's afresh.

        The loss scalers call it from ``update()``, so a skipped step's inf/NaN master gradients are never
        reused, however the model gradients are cleared afterwards.
        """
        self._grads_ready = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the master gradients by global norm (taken in fp32); returns the norm before clipping."""
        self.mixprec_prepare_grads_()
        return clip_grad_norm_(self._master_params, max_norm, norm_type)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer on the masters, then round each master into its model parameter."""
        self.mixprec_prepare_grads_()
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self._copy_masters_to_model()
        self._grads_ready = False
        return result

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        for p, m in self._low:
            p.copy_(m)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the fp32 masters (the model's own weights are rounded copies)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_params": [m.detach().clone() for m in self._master_params],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "optimizer" not in state_dict or "master_params" not in state_dict:
            raise ValueError(
                "state_dict must come from MasterWeightOptimizer.state_dict() (keys: optimizer, master_params)"
            )
        masters = state_dict["master_params"]
        if len(masters) != len(self._master_params):
            raise ValueError(
                f"state_dict holds {len(masters)} master parameters; this optimizer has {len(self._master_params)}"
            )
        for i, (dst, src) in enumerate(zip(self._master_params, masters, strict=True)):
            if dst.shape != src.shape:
                raise ValueError(f"master parameter {i}: saved shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._copy_masters_to_model()

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r}, low_precision_params={len(self._low)})"
