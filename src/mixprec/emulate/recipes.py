"""Block-scaled training recipes for :class:`mixprec.emulate.EmulatedLinear`: ``"mxfp8"`` and ``"nvfp4"``.

A linear layer runs three GEMMs: Fprop ``Y = X W^T`` (K = in_features), Dgrad ``dX = dY W`` (K = out_features) and
Wgrad ``dW = dY^T X`` (K = the tokens). Each GEMM operand is quantized along the dimension that GEMM contracts
(cuBLAS's block-scaled GEMMs take scales along K only), so a tensor used by two GEMMs is quantized twice, along
its rows and along its columns, unless a 2-D tile serves both:

| GEMM operand | "mxfp8" (Transformer Engine ``MXFP8BlockScaling``) | "nvfp4" (arXiv 2509.25149) |
|---|---|---|
| X in Fprop | E4M3, 1x32 along in_features | 1x16 along in_features, nearest |
| W in Fprop | E4M3, 1x32 along in_features | 16x16 tiles, nearest (one copy: Fprop and Dgrad) |
| dY in Dgrad | E4M3 (E5M2: grad_fmt), 1x32 along out_features | 1x16 along out_features, stochastic |
| W in Dgrad | E4M3, 1x32 along out_features (columnwise copy) | the 16x16-tiled copy of Fprop |
| dY in Wgrad | E4M3 (E5M2: grad_fmt), 1x32 along tokens | Hadamard-16 along tokens, 1x16 along tokens, stochastic |
| X in Wgrad | E4M3, 1x32 along tokens (columnwise copy) | Hadamard-16 along tokens, 1x16 along tokens, nearest |

Scales: MXFP8 E8M0 with ``scale_mode="rceil"`` (Transformer Engine's round-up scale); NVFP4 E4M3 block scales
under an fp32 tensor scale ``amax / (448 * 6)`` per quantized tensor. Accumulation: the recipe's ``accumulator``
(default ``"fp32"``; ``"blackwell"``, the hardware both recipes run on, is several times slower on a CPU: see
:mod:`mixprec.emulate.mx_matmul`). Layers the
NVFP4 paper keeps in BF16 (the first and last blocks) are named by ``high_precision`` patterns that
``emulate_linear_layers`` leaves alone. Derivations and sources: docs/emulate.md, "Block-scaled recipes".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from mixprec.core.mx import BlockScaled, get_block_format, hadamard_transform, mx_quantize, random_signs
from mixprec.emulate.matmul import MatmulModel
from mixprec.emulate.mx_matmul import BLOCK_ACCUMULATORS, matmul_block_scaled

__all__ = ["RECIPES", "BlockScaledRecipe", "get_recipe"]

_NVFP4_TENSOR_DENOM = 448.0 * 6.0  # largest E4M3 scale times largest E2M1 element (arXiv 2509.25149, eq. 1)


@dataclass(frozen=True, kw_only=True)
class BlockScaledRecipe:
    """Which block-scaled format each GEMM operand of a linear layer gets (see the module table).

    Args:
        name: label (``EmulatedLinear``'s repr).
        fmt: block format of X and W (and of dY unless ``grad_fmt``).
        grad_fmt: block format of dY (None: ``fmt``).
        scale_mode: :func:`mx_quantize`'s scale rule (None: the format's default).
        weight_tile: None (W quantized twice, 1-D along each GEMM's K) or the 2-D tile (e.g. (16, 16)) of one
            weight copy shared by Fprop and Dgrad.
        grad_rounding: rounding of dY (``"nearest"`` or ``"stochastic"``).
        wgrad_hadamard: None, or the size of the random Hadamard transform applied along the tokens to both Wgrad
            inputs (16 in arXiv 2509.25149).
        tensor_scale: NVFP4 only: two-level scaling with an fp32 tensor scale ``amax / (448 * 6)`` per tensor.
        accumulator: block accumulator model (``BLOCK_ACCUMULATORS`` name or MatmulModel) of all three GEMMs.
        high_precision: ``fnmatch`` patterns of qualified module names that ``emulate_linear_layers`` keeps in the
            model's own precision (e.g. ``("blocks.0.*", "blocks.1.*", "lm_head")``).
    """

    name: str
    fmt: str
    grad_fmt: str | None = None
    scale_mode: str | None = None
    weight_tile: tuple[int, int] | None = None
    grad_rounding: str = "nearest"
    wgrad_hadamard: int | None = None
    tensor_scale: bool = False
    accumulator: MatmulModel | str = "fp32"
    high_precision: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        get_block_format(self.fmt, arg="fmt")
        if self.grad_fmt is not None:
            get_block_format(self.grad_fmt, arg="grad_fmt")
        if not isinstance(self.accumulator, MatmulModel) and self.accumulator not in BLOCK_ACCUMULATORS:
            raise ValueError(
                f"accumulator must be a MatmulModel or one of {', '.join(map(repr, BLOCK_ACCUMULATORS))}; "
                f"got {self.accumulator!r}"
            )
        if self.grad_rounding not in ("nearest", "stochastic"):
            raise ValueError(f"grad_rounding must be 'nearest' or 'stochastic'; got {self.grad_rounding!r}")
        if self.tensor_scale and get_block_format(self.fmt).scale != "e4m3":
            raise ValueError(f"tensor_scale: only NVFP4 has a tensor scale; fmt is {self.fmt!r}")
        if not isinstance(self.high_precision, tuple) or not all(isinstance(p, str) for p in self.high_precision):
            raise TypeError(f"high_precision must be a tuple of strings; got {self.high_precision!r}")

    @property
    def block(self) -> int:
        """Elements per block along K (every quantized dimension must be a multiple of it)."""
        return get_block_format(self.fmt).block_size

    def with_options(self, **changes: Any) -> BlockScaledRecipe:
        """A copy with some fields changed (e.g. ``accumulator="fp32"``, ``high_precision=("lm_head",)``)."""
        return dataclasses.replace(self, **changes)


RECIPES: dict[str, BlockScaledRecipe] = {
    # Transformer Engine's MXFP8BlockScaling(fp8_format=Format.E4M3): E4M3 everywhere, 1x32 blocks, no 2-D scaling,
    # rowwise and columnwise copies (TE docs, "MXFP8" and "Performance considerations: Handling transposes")
    "mxfp8": BlockScaledRecipe(name="mxfp8", fmt="mxfp8_e4m3", scale_mode="rceil"),
    # "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149), section 4
    "nvfp4": BlockScaledRecipe(
        name="nvfp4",
        fmt="nvfp4",
        weight_tile=(16, 16),
        grad_rounding="stochastic",
        wgrad_hadamard=16,
        tensor_scale=True,
        # the paper keeps the output head (and ~15% of the linear layers, mostly the last blocks) in BF16; which
        # blocks is model-specific: add their patterns with with_options(high_precision=...)
        high_precision=("lm_head", "*.lm_head"),
    ),
}


def get_recipe(recipe: BlockScaledRecipe | str, *, arg: str = "recipe") -> BlockScaledRecipe:
    """A :class:`BlockScaledRecipe` from itself or a name in ``RECIPES``."""
    if isinstance(recipe, BlockScaledRecipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"{arg} must be a BlockScaledRecipe or one of {', '.join(map(repr, RECIPES))}; got {recipe!r}")


def check_shapes(recipe: BlockScaledRecipe, in_features: int, out_features: int) -> None:
    """The layer's K dimensions must be whole blocks (ValueError naming the argument); no padding."""
    tile = recipe.weight_tile or (recipe.block, recipe.block)
    for name, size, block in (("in_features", in_features, max(recipe.block, tile[1])),
                              ("out_features", out_features, max(recipe.block, tile[0]))):  # fmt: skip
        if size % block:
            raise ValueError(
                f"{name} ({size}) must be a multiple of {block} for recipe {recipe.name!r} (a GEMM contracts over "
                "it in blocks; no padding)"
            )


def check_rows(recipe: BlockScaledRecipe, x: torch.Tensor) -> None:
    """The weight-gradient GEMM contracts over the rows of ``x`` (the tokens): whole blocks (and whole Hadamard
    blocks), ValueError naming ``x`` otherwise. Callers skip it when no weight gradient is recorded."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    need = max(recipe.block, recipe.wgrad_hadamard or 1)
    if rows % need:
        raise ValueError(
            f"x: the number of rows (tokens, {rows} for shape {tuple(x.shape)}) must be a multiple of {need} for "
            f"recipe {recipe.name!r} when the weight needs a gradient (the weight-gradient GEMM contracts over them "
            "in blocks; no padding)"
        )


def _tensor_scale(t: torch.Tensor, recipe: BlockScaledRecipe) -> torch.Tensor | None:
    """NVFP4's per-tensor fp32 scale ``amax / (448 * 6)``; None (one-level scaling) for an all-zero or non-finite
    tensor, whose block scales then carry the zeros, the NaN or the inf."""
    if not recipe.tensor_scale:
        return None
    amax = t.detach().abs().amax().float()
    if not (bool(torch.isfinite(amax)) and float(amax) > 0.0):
        return None
    return amax / _NVFP4_TENSOR_DENOM


def _quantize(
    t: torch.Tensor,
    recipe: BlockScaledRecipe,
    axis: int,
    *,
    grad: bool = False,
    tile: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
) -> BlockScaled:
    fmt = (recipe.grad_fmt or recipe.fmt) if grad else recipe.fmt
    rounding = recipe.grad_rounding if grad else "nearest"
    t = t.float()
    return mx_quantize(
        t,
        fmt,
        block_size=tile,
        scale_mode=recipe.scale_mode,
        axis=(0, 1) if tile is not None else axis,
        rounding=rounding,
        generator=generator if rounding == "stochastic" else None,
        tensor_scale=_tensor_scale(t, recipe),
    )


def _transposed(q: BlockScaled) -> BlockScaled:
    """``q`` of a 2-D tensor as the quantization of its transpose (the same numbers)."""
    return dataclasses.replace(
        q,
        elements=q.elements.t(),
        scales=q.scales.t(),
        axis=tuple(1 - a for a in q.axis),
    )


class BlockScaledLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with the three GEMMs of a :class:`BlockScaledRecipe` (see the module table)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: BlockScaledRecipe,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        x2 = x.reshape(rows, x.shape[-1])
        if recipe.weight_tile is not None:
            qw = _quantize(weight, recipe, 1, tile=recipe.weight_tile)  # one copy: Fprop (as W^T) and Dgrad
            qw_fprop, qw_dgrad = _transposed(qw), qw
        else:
            qw_fprop = _transposed(_quantize(weight, recipe, 1))  # W^T (K, N) blocked along K = in_features
            qw_dgrad = None  # the columnwise copy, quantized in backward
        y = matmul_block_scaled(_quantize(x2, recipe, 1), qw_fprop, recipe.accumulator)
        if bias is not None:
            y.add_(bias.float())
        ctx.save_for_backward(x2, weight)
        ctx.qw_dgrad = qw_dgrad
        ctx.recipe, ctx.generator = recipe, generator
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        recipe: BlockScaledRecipe = ctx.recipe
        gen = ctx.generator
        gy = grad_y.reshape(x2.shape[0], weight.shape[0]).float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            qw = ctx.qw_dgrad if ctx.qw_dgrad is not None else _quantize(weight, recipe, 0)  # (N, K) along N
            qgy = _quantize(gy, recipe, 1, grad=True, generator=gen)  # (M, N) along N
            grad_x = matmul_block_scaled(qgy, qw, recipe.accumulator).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gy_w, x_w = gy, x2.float()
            if recipe.wgrad_hadamard:
                # the same random orthogonal Q on both inputs along the tokens: (Q dY)^T (Q X) = dY^T X
                signs = random_signs(recipe.wgrad_hadamard, generator=gen)
                gy_w = hadamard_transform(gy_w, signs, axis=0)
                x_w = hadamard_transform(x_w, signs, axis=0)
            qgy_t = _transposed(_quantize(gy_w, recipe, 0, grad=True, generator=gen))  # dY^T (N, M) along M
            qx = _quantize(x_w, recipe, 0)  # X (M, K) along M
            grad_w = matmul_block_scaled(qgy_t, qx, recipe.accumulator).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None
