"""Block-scaled matmuls (MXFP8/6/4, NVFP4): ``a @ b`` with each operand quantized along K and an accumulator model.

``a (..., M, K)`` is blocked along K (its last dim), ``b (..., K, N)`` along K (its dim -2). The product of block
``k`` of a row and a column is ``(sum over the block of a_e b_e) * sa * sb``: the element products are exact and
their in-block sum is exact (an fp8/fp6/fp4 product has at most 8 significant bits; docs/emulate.md, "Block-scaled
matmuls"). How the block products are summed is the accumulator model (``BLOCK_ACCUMULATORS``):

* ``"fp32"``: every block product is added to an fp32 accumulator in K order, one rounding (nearest even) each.
* ``"fp8/promote128"``: Hopper's fp8 WGMMA model (``MATMUL_PRESETS["fp8/promote128"]``: 13 fraction bits kept
  after alignment, truncation, promotion into fp32 every 128).
* ``"blackwell"``: the ``tcgen05.mma`` block-scaled MMA as measured by MMA-Sim (Xie et al. 2025, arXiv
  2511.10909; ``TCGen05MMASim``): per instruction (K = 32 for MX fp8/fp6, 64 for fp4) the scaled products and
  the accumulator are aligned to the largest exponent, truncated to 25 (fp8/fp6) or 35 (fp4) fraction bits,
  summed, and the sum truncated to fp32.

NVFP4's fp32 tensor scales multiply the result once at the end (``fl32(ta * tb)``, a GEMM epilogue's alpha).
"""

from __future__ import annotations

import dataclasses

import torch

from mixprec.core.mx import BlockFormat, BlockScaled, get_block_format, mx_quantize
from mixprec.core.validate import check_tensor
from mixprec.emulate.matmul import TENSOR_CORE_ALIGN_BITS, MatmulModel, get_matmul_model, matmul_with_model

__all__ = [
    "BLACKWELL_ALIGN_BITS",
    "BLOCK_ACCUMULATORS",
    "block_accumulator_model",
    "block_scaled_matmul",
    "matmul_block_scaled",
    "scaled_elements",
]

BLOCK_ACCUMULATORS: tuple[str, ...] = ("fp32", "fp8/promote128", "blackwell")

# tcgen05.mma (sm_100a) fraction bits after alignment, and the K of one instruction, per MMA kind: MMA-Sim
# (microsoft/MMA-Sim, mmasim/simulator/nv.py, TCGen05MMASim: 25 bits, 35 for kind::mxf4*; functions.py,
# nv_fused_dot_add / nv_fused_dot_add_with_block_scale: truncation, then round toward zero to fp32).
BLACKWELL_ALIGN_BITS: dict[str, int] = {"mxf8f6f4": TENSOR_CORE_ALIGN_BITS["h100"], "mxf4": 35}
_BLACKWELL_K: dict[str, int] = {"mxf8f6f4": 32, "mxf4": 64}


def _blackwell_kind(fmt: BlockFormat) -> str:
    """The tcgen05 MMA kind that runs ``fmt`` x ``fmt``: fp4 elements go to kind::mxf4 / mxf4nvf4 (K = 64), fp8 and
    fp6 to kind::mxf8f6f4 (K = 32)."""
    return "mxf4" if fmt.element.exp_bits == 2 and fmt.element.man_bits == 1 else "mxf8f6f4"


def block_accumulator_model(accumulator: MatmulModel | str, fmt: BlockFormat | str) -> MatmulModel:
    """The :class:`MatmulModel` that sums the block products of ``fmt`` operands for ``accumulator`` (a name in
    ``BLOCK_ACCUMULATORS`` or a MatmulModel). Its ``inputs`` is fp32: the operands it sees are elements times block
    scales, exact values that are never rounded again."""
    bf = get_block_format(fmt, arg="inputs")
    if isinstance(accumulator, MatmulModel):
        model = accumulator
    elif accumulator == "fp32":
        model = MatmulModel(inputs="fp32", accumulator="fp32", k_group=bf.block_size, name=f"{bf.name}/fp32")
    elif accumulator == "fp8/promote128":
        model = get_matmul_model("fp8/promote128")
    elif accumulator == "blackwell":
        kind = _blackwell_kind(bf)
        model = MatmulModel(
            inputs="fp32",
            accumulator="fp32",
            k_group=_BLACKWELL_K[kind],
            align_bits=BLACKWELL_ALIGN_BITS[kind],
            align_rounding="toward_zero",
            name=f"{bf.name}/blackwell",
        )
    else:
        raise ValueError(
            f"accumulator must be a MatmulModel or one of {', '.join(map(repr, BLOCK_ACCUMULATORS))} for "
            f"block-scaled inputs; got {accumulator!r}"
        )
    # fp32 inputs: no rounding of the scaled operands, and no assumption that they lie in the element's range
    # (the alignment model's fast truncation path assumes that)
    return dataclasses.replace(model, inputs="fp32", name=model.name)


def scaled_elements(q: BlockScaled) -> torch.Tensor:
    """``q.elements`` times the block scales (not the tensor scale), fp32: exact, since an element has at most 4
    significant bits and a scale is a power of two (E8M0) or has 4 (E4M3), inside fp32's range for finite scales."""
    s = q.scales
    for d, b in zip(q.axis, q.block_size, strict=True):
        s = s.repeat_interleave(b, dim=d)
    return q.elements * s


def _k_block(q: BlockScaled, dim: int, name: str) -> int:
    """The block size of ``q`` along ``dim`` (its K), or ValueError when ``q`` is not blocked along it."""
    if q.elements.dim() != 2:
        raise ValueError(f"{name} must be 2-D; got shape {tuple(q.elements.shape)}")
    if dim not in q.axis:
        raise ValueError(f"{name} must be blocked along its K dimension ({dim}); its blocks run along {q.axis}")
    return q.block_size[q.axis.index(dim)]


def matmul_block_scaled(qa: BlockScaled, qb: BlockScaled, accumulator: MatmulModel | str = "fp32") -> torch.Tensor:
    """``qa @ qb`` for already quantized 2-D operands: ``qa (M, K)`` blocked along K (dim 1), ``qb (K, N)`` blocked
    along K (dim 0), in 1-D blocks or 2-D tiles whose K extent is the block; returns fp32 ``(M, N)``. The tensor
    scales, if any, multiply the result once (``fl32(ta * tb)``, the epilogue's alpha)."""
    kb = _k_block(qa, 1, "qa")
    if _k_block(qb, 0, "qb") != kb or qa.elements.shape[1] != qb.elements.shape[0]:
        raise ValueError(
            f"qa {tuple(qa.elements.shape)} and qb {tuple(qb.elements.shape)} must agree on K and on its block size"
        )
    model = block_accumulator_model(accumulator, dataclasses.replace(qa.fmt, block_size=kb))
    y = matmul_with_model(scaled_elements(qa), scaled_elements(qb), model, rounded=True)
    alpha = _alpha(qa.tensor_scale, qb.tensor_scale)
    if alpha is not None:
        y.mul_(alpha.to(y.device))
    return y


def _alpha(ta: torch.Tensor | None, tb: torch.Tensor | None) -> torch.Tensor | None:
    if ta is None and tb is None:
        return None
    one = torch.ones((), dtype=torch.float32)
    ta = one if ta is None else ta.to(torch.float32).cpu()
    tb = one if tb is None else tb.to(torch.float32).cpu()
    return ta * tb


def block_scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    inputs: BlockFormat | str,
    accumulator: MatmulModel | str = "fp32",
    *,
    scale_mode: str | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``a @ b`` with both operands quantized to the block-scaled format ``inputs`` along K (``a (..., M, K)`` along
    its last dim, ``b (..., K, N)`` along dim -2) and the block products summed by ``accumulator``; fp32 result.

    ``scale_mode``, ``rounding`` and ``generator`` go to :func:`mixprec.emulate.mx_quantize` (for ``"stochastic"``,
    ``a`` is quantized first, then ``b``, from the same generator). K must be a multiple of the block size
    (ValueError naming K otherwise). Batch dims broadcast as in ``torch.matmul``."""
    bf = get_block_format(inputs, arg="inputs")
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, (torch.float32, torch.bfloat16, torch.float16))
        if t.dim() < 2:
            raise ValueError(f"{name} must be at least 2-D (..., rows, cols); got shape {tuple(t.shape)}")
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but emulate.matmul records no autograd graph: pass {name}.detach()"
            )
    k = a.shape[-1]
    if k != b.shape[-2]:
        raise ValueError(f"a (..., M, K) and b (..., K, N) must agree on K; got {tuple(a.shape)} and {tuple(b.shape)}")
    if k % bf.block_size:
        raise ValueError(f"K ({k}) must be a multiple of {bf.name}'s block size {bf.block_size}")
    model = block_accumulator_model(accumulator, bf)
    qa = mx_quantize(a, bf, scale_mode=scale_mode, axis=-1, rounding=rounding, generator=generator)
    qb = mx_quantize(b, bf, scale_mode=scale_mode, axis=-2, rounding=rounding, generator=generator)
    return matmul_with_model(scaled_elements(qa), scaled_elements(qb), model, rounded=True)
