"""``EmulatedLinear``: a drop-in ``nn.Linear`` whose three matmuls run through the accumulation model, and
``emulate_linear_layers`` to swap them into a model (and back).

Forward ``y = x W^T + b`` and both backward products, ``grad_x = grad_y W`` (K = out_features) and
``grad_W = grad_y^T x`` (K = the number of rows in the batch), use :func:`mixprec.emulate.matmul` with the layer's
:class:`MatmulModel`: operands rounded to ``inputs``, accumulation modelled, result held in fp32. The bias is
added in fp32 to the accumulator's value and, if the model has an ``output`` format, that sum is rounded to it
once, as a GEMM epilogue does (the product is not rounded to ``output`` before the bias); ``grad_b`` is an fp32
sum over the batch. Outputs and input gradients come back in the input's dtype, parameter gradients in the
parameter's dtype, so fp16/bf16 parameters and inputs work too. The backward is not itself differentiable
(``once_differentiable``: no double backward).

Parameters and ``state_dict`` keys are those of ``nn.Linear`` (``weight``, ``bias``); :meth:`EmulatedLinear.from_linear`
shares the original layer's Parameter objects, so optimizers and tied weights keep working after a swap.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils import parametrize

from mixprec.core.rounding import round_to, round_to_
from mixprec.emulate.matmul import MATMUL_PRESETS, MatmulModel, get_matmul_model, matmul_with_model
from mixprec.emulate.recipes import (
    RECIPES,
    BlockScaledLinearFunction,
    BlockScaledRecipe,
    check_rows,
    check_shapes,
    get_recipe,
)

__all__ = ["EmulatedLinear", "LinearSwap", "emulate_linear_layers", "get_linear_mode"]

LinearMode = MatmulModel | BlockScaledRecipe


def get_linear_mode(mode: object, *, arg: str = "mode") -> LinearMode:
    """A layer's mode: a :class:`MatmulModel` (or ``MATMUL_PRESETS`` name) or a :class:`BlockScaledRecipe` (or
    ``RECIPES`` name: ``"mxfp8"``, ``"nvfp4"``)."""
    if isinstance(mode, MatmulModel | BlockScaledRecipe):
        return mode
    if isinstance(mode, str) and mode in RECIPES:
        return get_recipe(mode)
    if isinstance(mode, str) and mode not in MATMUL_PRESETS:
        names = ", ".join(map(repr, (*MATMUL_PRESETS, *RECIPES)))
        raise ValueError(f"{arg} must be a MatmulModel, a BlockScaledRecipe or one of {names}; got {mode!r}")
    return get_matmul_model(mode, arg=arg)


class _EmulatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, model: MatmulModel
    ) -> torch.Tensor:
        # the operands are rounded once here and saved rounded (fp32), so the backward products reuse them
        # explicit row count, not -1: in_features = 0 leaves -1 undetermined
        x_r = round_to(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), model.inputs)
        w_r = round_to(weight, model.inputs)
        if bias is None or model.output is None:
            y = matmul_with_model(x_r, w_r.t(), model, rounded=True)
            if bias is not None:
                y.add_(bias.float())
        else:
            # GEMM epilogue: fp32 accumulator + bias in fp32, then ONE rounding to the output format (rounding the
            # product to ``output`` before the bias would round twice)
            y = matmul_with_model(x_r, w_r.t(), dataclasses.replace(model, output=None), rounded=True)
            y.add_(bias.float())
            round_to_(y, model.output)
        ctx.save_for_backward(x_r, w_r)
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        ctx.model = model
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    @once_differentiable  # the emulated products are not differentiable: no double backward
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x_r, w_r = ctx.saved_tensors
        model: MatmulModel = ctx.model
        gy = grad_y.reshape(x_r.shape[0], w_r.shape[0])
        gy_r = round_to(gy, model.inputs)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_with_model(gy_r, w_r, model, rounded=True).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = matmul_with_model(gy_r.t(), x_r, model, rounded=True).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class EmulatedLinear(nn.Linear):
    """``nn.Linear`` with forward and backward matmuls emulated by ``mode`` (a preset name or MatmulModel), or run
    as a block-scaled training recipe (``"mxfp8"``, ``"nvfp4"`` or a BlockScaledRecipe: which tensor gets which
    format in each GEMM is tabled in :mod:`mixprec.emulate.recipes`).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        mode: accumulation model, e.g. "fp16/16", "fp16/32", "bf16/32", "two_stage", "fp8/promote128", or a
            recipe. Recipes need in_features and out_features (and, per call, the number of input rows) to be
            multiples of the block size (32 for "mxfp8", 16 for "nvfp4"): ValueError naming the argument otherwise.
        generator: recipes only: the ``torch.Generator`` of stochastic rounding and the random Hadamard signs
            (None: torch's default generator). The same generator state gives the same bits.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        mode: MatmulModel | BlockScaledRecipe | str = "fp16/32",
        generator: torch.Generator | None = None,
    ) -> None:
        resolved = get_linear_mode(mode)
        if isinstance(resolved, BlockScaledRecipe):
            check_shapes(resolved, in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.mode = resolved
        self.generator = _check_generator(generator)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        mode: MatmulModel | BlockScaledRecipe | str,
        *,
        generator: torch.Generator | None = None,
    ) -> EmulatedLinear:
        """An EmulatedLinear sharing ``linear``'s Parameter objects (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear; got {type(linear).__name__}")
        model = get_linear_mode(mode)
        if isinstance(model, BlockScaledRecipe):
            check_shapes(model, linear.in_features, linear.out_features)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        if linear.bias is None:
            new.register_parameter("bias", None)
        else:
            new.bias = linear.bias
        new.mode = model
        new.generator = _check_generator(generator)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"EmulatedLinear expects a tensor input; got {type(x).__name__}")
        if x.dim() == 0:
            # nn.Linear's own error (F.linear) for a 0-d input, so that the swap changes no error a caller handles
            raise RuntimeError("both arguments to linear need to be at least 1D, but they are 0D and 2D")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"EmulatedLinear expects input (..., {self.in_features}); got {tuple(x.shape)}")
        if isinstance(self.mode, BlockScaledRecipe):
            if torch.is_grad_enabled() and self.weight.requires_grad:  # inference needs no whole token blocks
                check_rows(self.mode, x)
            return BlockScaledLinearFunction.apply(x, self.weight, self.bias, self.mode, self.generator)
        return _EmulatedLinearFunction.apply(x, self.weight, self.bias, self.mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode.name!r}"


def _check_generator(generator: object) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    return generator


class LinearSwap:
    """What :func:`emulate_linear_layers` swapped: ``names`` (qualified module names) and what it left alone,
    ``skipped`` (nn.Linear subclasses not in ``include``) and ``kept`` (recipes: layers matching the recipe's
    ``high_precision`` patterns or whose shapes are not whole blocks, left in the model's own precision);
    ``restore()`` puts the original modules back. Usable as a context manager (restores on exit)."""

    def __init__(
        self,
        model: nn.Module,
        swapped: list[tuple[nn.Module, str, nn.Module]],
        skipped: list[str] | None = None,
        kept: list[str] | None = None,
    ) -> None:
        self.model = model
        self._swapped = swapped
        self.names = [name for _, name, _ in swapped]
        self.skipped = list(skipped or [])
        self.kept = list(kept or [])
        self.restored = False

    def restore(self) -> None:
        """Put the original ``nn.Linear`` modules back (they share the parameters, so training carries over)."""
        if self.restored:
            raise RuntimeError("restore() was already called on this LinearSwap")
        for parent, name, original in self._swapped:
            setattr(parent, name.rsplit(".", 1)[-1], original)
        self.restored = True

    def __enter__(self) -> LinearSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.restored:
            self.restore()

    def __len__(self) -> int:
        return len(self._swapped)


def _declared_type(module: nn.Module) -> type:
    """The module's class before ``torch.nn.utils.parametrize`` swapped in its generated ``Parametrized<Class>``
    subclass (whose only base is the original class)."""
    cls = type(module)
    return cls.__bases__[0] if parametrize.is_parametrized(module) else cls


def _select_layers(
    model: nn.Module, swap_types: tuple[type, ...], recipe: BlockScaledRecipe | None
) -> tuple[list[tuple[str, nn.Module]], list[str], list[str], list[str]]:
    """Sort ``model``'s linear layers for :func:`emulate_linear_layers`: (layers to swap as (name, module),
    names skipped, names kept in their precision by ``recipe``, kept ones described as "name (in->out)" because
    their shapes are not whole blocks). ValueError for a layer to swap that has parametrizations."""
    targets: list[tuple[str, nn.Module]] = []
    skipped: list[str] = []
    kept: list[str] = []
    misfit: list[str] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.Linear) or isinstance(module, EmulatedLinear):
            continue
        if _declared_type(module) not in swap_types:
            skipped.append(name)  # keeps its own forward, parametrized or not
            continue
        if recipe is not None:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in recipe.high_precision):
                kept.append(name)
                continue
            try:
                check_shapes(recipe, module.in_features, module.out_features)
            except ValueError:
                kept.append(name)
                misfit.append(f"{name} ({module.in_features}->{module.out_features})")
                continue
        if parametrize.is_parametrized(module):
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has parametrizations: an EmulatedLinear would hold a "
                "frozen snapshot of its weight; remove them first (torch.nn.utils.parametrize.remove_parametrizations)"
            )
        targets.append((name, module))
    return targets, skipped, kept, misfit


def emulate_linear_layers(
    model: nn.Module,
    mode: MatmulModel | BlockScaledRecipe | str,
    *,
    include: tuple[type[nn.Linear], ...] = (),
    generator: torch.Generator | None = None,
) -> LinearSwap:
    """Replace the linear layers of ``model`` by :class:`EmulatedLinear` layers with ``mode`` that share their
    parameters; returns a :class:`LinearSwap` whose ``restore()`` puts the originals back.

    Which layers: modules whose type is exactly ``nn.Linear``, plus those whose type is exactly one of ``include``
    (subclasses of ``nn.Linear`` whose ``forward`` computes ``x W^T + b``, e.g. ``mixprec.lab.model.Linear``, which
    only casts its weights to the input's dtype; EmulatedLinear does that too). Other subclasses keep their own
    ``forward`` (a LoRA layer's, say) and are left alone: their names are in ``LinearSwap.skipped`` and a warning
    lists them (except ``nn.MultiheadAttention``'s ``out_proj``, whose ``forward`` attention never calls: it reads
    ``.weight`` directly, so swapping it would change nothing). Already-emulated layers are left alone. With a
    recipe (``"mxfp8"``, ``"nvfp4"``, a BlockScaledRecipe), layers matching its ``high_precision`` patterns, and
    layers whose in/out features are not multiples of its block (with a warning), keep their precision
    (``LinearSwap.kept``), and ``generator`` (one ``torch.Generator`` shared by the swapped layers; None: torch's
    default generator) feeds their stochastic rounding and Hadamard signs.

    Raises:
        TypeError: ``model`` is not an nn.Module, or ``include`` is not a tuple of nn.Linear subclasses.
        ValueError: ``model`` is itself a Linear (wrap it in a container: it needs a parent), or a layer to swap
            (not a skipped one) has parametrizations (``torch.nn.utils.parametrize``): its weight is computed at
            every access, and an EmulatedLinear would see only a frozen snapshot.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if not isinstance(include, tuple) or not all(
        isinstance(c, type) and issubclass(c, nn.Linear) and not issubclass(c, EmulatedLinear) for c in include
    ):
        raise TypeError(f"include must be a tuple of nn.Linear subclasses (not EmulatedLinear); got {include!r}")
    matmul_model = get_linear_mode(mode)
    _check_generator(generator)
    if isinstance(model, nn.Linear):
        raise ValueError("model is itself an nn.Linear: wrap it (e.g. nn.Sequential(layer)) so it can be swapped")
    recipe = matmul_model if isinstance(matmul_model, BlockScaledRecipe) else None
    targets, skipped, kept, misfit = _select_layers(model, (nn.Linear, *include), recipe)
    quiet = nn.modules.linear.NonDynamicallyQuantizableLinear
    loud = [name for name in skipped if type(model.get_submodule(name)) is not quiet]
    if loud:
        kinds = sorted({type(model.get_submodule(name)).__qualname__ for name in loud})
        warnings.warn(
            f"emulate_linear_layers left {len(loud)} nn.Linear subclass layer(s) with their own forward alone: "
            f"{', '.join(loud[:5])}{' ...' if len(loud) > 5 else ''} ({', '.join(kinds)}); pass include=(TheClass,) "
            "if its forward is x W^T + b",
            stacklevel=2,
        )
    if misfit:
        warnings.warn(
            f"emulate_linear_layers kept {len(misfit)} layer(s) in their own precision: recipe {recipe.name!r} "
            f"needs in/out features that are multiples of its block ({recipe.block}): {', '.join(misfit[:5])}"
            f"{' ...' if len(misfit) > 5 else ''}",
            stacklevel=2,
        )
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        new = EmulatedLinear.from_linear(module, matmul_model, generator=generator)
        setattr(parent, name.rsplit(".", 1)[-1], new)
        swapped.append((parent, name, module))
    return LinearSwap(model, swapped, skipped, kept)
