"""Block-scaled matmuls (MXFP8/6/4, NVFP4): ``a @ b`` with each operand quantized along K and an accumulator model.

``a (..., M, K)`` is blocked along K (its last dim), ``b (..., K, N)`` along K (its dim -2). The product of block
``k`` of a row and a column is ``(sum over the block of a_e b_e) * sa * sb``: the element products are exact and
their in-block sum is exact (an fp8/fp6/fp4 product has at most 8 significant bits; docs/emulate.md, "Block-scaled
matmuls"). How the block products are summed is the accumulator model (``BLOCK_ACCUMULATORS``):

* ``"fp32"``: every block product is added to an fp32 accumulator in K order, one rounding (nearest even) each.
* ``"fp8/promote128"``: Hopper's fp8 WGMMA model (``MATMUL_PRESETS["fp8/promote128"]``: 13 fraction bits kept
  after alignment, truncation, promotion into fp32 every 128).
* ``"blackwell"``: the ``tcgen05.mma`` block-scaled MMA as MMA-Sim models it (Xie et al. 2025, arXiv
  2511.10909; ``TCGen05MMASim``), chained over K: per instruction (K = 32 for MX fp8/fp6, 64 for fp4) the terms
  (element products, or for fp4 the exact 16-element sub-block dots) and the accumulator are aligned to the
  largest nominal exponent, truncated to 25 (fp8/fp6) or 35 (fp4) fraction bits, summed, and the sum truncated
  to fp32. Bit-exact with a transcription of MMA-Sim's algorithm on finite data (tests/test_mx_matmul.py).

NVFP4's fp32 tensor scales multiply the result once at the end (``fl32(ta * tb)``, a GEMM epilogue's alpha).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mixprec.core.formats import FloatFormat
from mixprec.core.mx import BlockFormat, BlockScaled, get_block_format, mx_quantize
from mixprec.core.rounding import round_directed_
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
    scales, exact values that are never rounded again. For ``"blackwell"`` it is the alignment model with the
    instruction's K and fraction bits, for :func:`bounds` (whose bound covers the nominal-exponent alignment);
    the product itself runs MMA-Sim's algorithm (``_blackwell_accumulate``)."""
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


def _expanded_scales(q: BlockScaled) -> torch.Tensor:
    """The block scale of every element of ``q`` (fp32, ``q.elements``' shape)."""
    s = q.scales
    for d, b in zip(q.axis, q.block_size, strict=True):
        s = s.repeat_interleave(b, dim=d)
    return s


def scaled_elements(q: BlockScaled) -> torch.Tensor:
    """``q.elements`` times the block scales (not the tensor scale), fp32: exact, since an element has at most 4
    significant bits and a scale is a power of two (E8M0) or has 4 (E4M3), inside fp32's range for finite scales."""
    return q.elements * _expanded_scales(q)


# ------------------------------------------------------------------------------------------------ Blackwell
_ZERO_EXP = -(1 << 20)  # nominal exponent of a zero operand: below every other, never the maximum
_FP32 = FloatFormat(8, 23)


def _nominal_exponent(v: torch.Tensor, emin: int) -> torch.Tensor:
    """``floor(log2 |v|)`` of fp32/fp64 ``v``, at least ``emin`` (a subnormal of the format counts at its emin, as
    MMA-Sim's ``extract_significand_exponent``); ``_ZERO_EXP`` for zeros. int64."""
    bits = v.double().abs().view(torch.int64)
    e = torch.bitwise_right_shift(bits, 52).sub_(1023).clamp_(min=emin)
    return e.masked_fill_(v == 0, _ZERO_EXP)


def _blackwell_accumulate(
    ea: torch.Tensor, sa: torch.Tensor, eb: torch.Tensor, sb: torch.Tensor, fmt_a: BlockFormat, fmt_b: BlockFormat
) -> torch.Tensor:
    """MMA-Sim's tcgen05 block-scaled MMA chained over K (module docstring): elements ``ea (M, K)``, ``eb (K, N)``
    and their block scales expanded to the same shapes; fp32 ``(M, N)``."""
    kind = _blackwell_kind(fmt_a)
    bits, kinst = BLACKWELL_ALIGN_BITS[kind], _BLACKWELL_K[kind]
    m, k = ea.shape
    n = eb.shape[1]
    va, vb = ea.double() * sa.double(), eb.double() * sb.double()  # exact
    scale_emin = -6 if fmt_a.scale == "e4m3" else -127  # E4M3's smallest normal exponent; E8M0's smallest value
    if kind == "mxf4":
        # one term per 16-element sub-block: its exact dot times both scales, at the scales' nominal exponent
        sub = 16
        nsub = k // sub
        terms_a, terms_b = va.reshape(m, nsub, sub).transpose(0, 1), vb.reshape(nsub, sub, n)
        exp_a = _nominal_exponent(sa[:, ::sub], scale_emin).t()  # (nsub, M)
        exp_b = _nominal_exponent(sb[::sub], scale_emin)  # (nsub, N)
        per_inst = kinst // sub
    else:
        # one term per element product, at the sum of the operands' and the scales' nominal exponents
        exp_a = _nominal_exponent(ea, fmt_a.element.emin) + _nominal_exponent(sa, scale_emin)
        exp_b = _nominal_exponent(eb, fmt_b.element.emin) + _nominal_exponent(sb, scale_emin)
        exp_a = exp_a.masked_fill_(ea == 0, _ZERO_EXP)
        exp_b = exp_b.masked_fill_(eb == 0, _ZERO_EXP)
        per_inst = kinst
    out = torch.empty(m, n, dtype=torch.float32, device=ea.device)
    width = per_inst * max(1, n)
    rows = max(1, min(m, (1 << 22) // width))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        acc = torch.zeros(r1 - r0, n, dtype=torch.float64, device=ea.device)
        for i0 in range(0, k if kind != "mxf4" else nsub, per_inst):
            if kind == "mxf4":
                i1 = min(nsub, i0 + per_inst)
                # (R, terms, N): exact sub-block dots (16 products each, far below 2**53)
                terms = torch.bmm(terms_a[i0:i1, r0:r1], terms_b[i0:i1]).transpose(0, 1)
                exps = exp_a[i0:i1, r0:r1].t().unsqueeze(-1) + exp_b[i0:i1].unsqueeze(0)
            else:
                i1 = i0 + per_inst
                terms = va[r0:r1, i0:i1].unsqueeze(-1) * vb[i0:i1].unsqueeze(0)  # exact products
                exps = exp_a[r0:r1, i0:i1].unsqueeze(-1) + exp_b[i0:i1].unsqueeze(0)
            top = torch.maximum(exps.amax(dim=1), _nominal_exponent(acc, _FP32.emin)).clamp_(min=-1000)
            spacing = torch.ldexp(torch.ones_like(acc), top - bits)
            # each term truncated to the window: integer multiples of the spacing, summed exactly in fp64
            total = torch.div(terms, spacing.unsqueeze(1), rounding_mode="trunc").sum(dim=1)
            total += torch.div(acc, spacing, rounding_mode="trunc")
            acc = total.mul_(spacing)
            round_directed_(acc, _FP32, "toward_zero", None)  # normalise, truncate to fp32
        out[r0:r1] = acc
    return out


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
    if isinstance(accumulator, str) and accumulator == "blackwell":
        y = _blackwell_accumulate(qa.elements, _expanded_scales(qa), qb.elements, _expanded_scales(qb), qa.fmt, qb.fmt)
    else:
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
    if isinstance(accumulator, str) and accumulator == "blackwell":
        return _blackwell_batched(qa, qb, bf)
    return matmul_with_model(scaled_elements(qa), scaled_elements(qb), model, rounded=True)


def _blackwell_batched(qa: BlockScaled, qb: BlockScaled, bf: BlockFormat) -> torch.Tensor:
    """The Blackwell model on broadcast batches: a shared ``b`` folds the batch into rows, else one product per
    batch entry."""
    ea, sa, eb, sb = qa.elements, _expanded_scales(qa), qb.elements, _expanded_scales(qb)
    batch = torch.broadcast_shapes(ea.shape[:-2], eb.shape[:-2])
    m, k, n = ea.shape[-2], ea.shape[-1], eb.shape[-1]
    if eb.dim() == 2 or math.prod(eb.shape[:-2]) == 1:
        rows = ea.expand(*batch, m, k).reshape(-1, k), sa.expand(*batch, m, k).reshape(-1, k)
        y = _blackwell_accumulate(rows[0], rows[1], eb.reshape(k, n), sb.reshape(k, n), bf, bf)
        return y.reshape(*batch, m, n)
    ea, sa = ea.expand(*batch, m, k).reshape(-1, m, k), sa.expand(*batch, m, k).reshape(-1, m, k)
    eb, sb = eb.expand(*batch, k, n).reshape(-1, k, n), sb.expand(*batch, k, n).reshape(-1, k, n)
    outs = [_blackwell_accumulate(ea[i], sa[i], eb[i], sb[i], bf, bf) for i in range(ea.shape[0])]
    return torch.stack(outs).reshape(*batch, m, n)
