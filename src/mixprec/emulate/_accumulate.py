"""The torch implementation of the emulated matmul's accumulation loop (:func:`mixprec.emulate.matmul`).

:func:`accumulate` sums fp64 operand tiles group by group (``k_group`` exact products per fp64 ``baddbmm``), rounds
the running accumulator to its format after each group, promotes into fp32 every ``promote_every`` products, and
models tensor-core alignment (``align_bits``) where asked. It is the fallback where no compiled kernel runs and the
oracle of ``native/csrc/matmul.c`` and its Triton twin. Tiles are planned so that small elementwise ops stay on one
thread (``_plan_tiles``); the exactness argument and the cost model are in ``docs/emulate.md``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mixprec.core.formats import FORMAT_PRESETS, FloatFormat
from mixprec.core.rounding import apply_overflow_, flush_subnormals_, round_directed_, round_nearest_grid_

if TYPE_CHECKING:
    from mixprec.emulate.matmul import MatmulModel

__all__ = ["accumulate"]

_FP64_EXP_MASK = 0x7FF0000000000000


# Elementwise ops on fewer elements than this run inline in the calling thread (ATen's intra-op grain size).
_ATEN_GRAIN = 32768


def _plan_tiles(nb: int, m: int, n: int, kg: int, aligned: bool, device: torch.device) -> tuple[int, int]:
    """(rows per tile, worker threads).

    CPU, no alignment model: tiles below ATen's grain size, so each elementwise op runs single-threaded in the
    thread that issued it, and ``torch.get_num_threads()`` Python threads work on different tiles (torch releases
    the GIL inside ops). This avoids an OpenMP fork/join per small op: the loop issues ~7 ops per group and tile,
    and with one barrier each it slowed 5-20x whenever other processes competed for the cores. Each tile stays in
    its core's L2. Wide outputs (``nb * n`` at or above the grain size) and other devices take the plain loop.
    The alignment model's products are large per op: plain loop with intra-op threads."""
    if device.type != "cpu":
        budget = (1 << 26) // kg if aligned else 1 << 24
        return max(1, min(m, budget // max(1, nb * n))), 1
    if aligned:
        return max(1, min(m, (1 << 21) // max(1, nb * n * kg))), 1
    workers = torch.get_num_threads()
    width = nb * n
    if workers > 1 and width < _ATEN_GRAIN and m > 1:
        rows = max(1, min(m, (_ATEN_GRAIN - 1) // width))
        if -(-m // rows) > 1:
            return rows, workers
    return max(1, min(m, (1 << 17) // max(1, width))), 1


def accumulate(a3: torch.Tensor, b3: torch.Tensor, model: MatmulModel) -> torch.Tensor:
    """The accumulation loop on fp64 operands ``a3 (B, M, K)``, ``b3 (B, K, N)``; returns fp32 ``(B, M, N)``."""
    nb, m, k = a3.shape
    n = b3.shape[-1]
    dev = a3.device
    out = torch.zeros(nb, m, n, dtype=torch.float32, device=dev)
    if k == 0 or m == 0 or n == 0:
        return out
    kg = model.k_group
    groups = -(-k // kg)
    if groups * kg != k:  # zero products change no exact sum and no aligned maximum
        a3 = torch.nn.functional.pad(a3, (0, groups * kg - k))
        b3 = torch.nn.functional.pad(b3, (0, 0, 0, groups * kg - k))
    # Overflow of the accumulator needs a per-step check (one min/max pass per group) only when it could reach the
    # format's max. The bound costs 4 passes over the operands, worth it only when they are smaller than the
    # per-step checks.
    check_overflow = True
    if 2 * (a3.numel() + b3.numel()) < groups * nb * m * n:
        row_sum = torch.linalg.vector_norm(a3, ord=1, dim=-1).amax().item()
        col_sum = torch.linalg.vector_norm(b3, ord=1, dim=-2).amax().item()
        a_max = torch.linalg.vector_norm(a3, ord=math.inf).item()
        b_max = torch.linalg.vector_norm(b3, ord=math.inf).item()
        sum_abs = min(row_sum * b_max, a_max * col_sum)  # >= sum_k |a_k b_k| for every output
        bound = _accumulator_growth_bound(model, groups, groups * kg, sum_abs)
        check_overflow = not (bound < model.accumulator.max_finite)
    aligned = model.align_bits is not None
    rows, workers = _plan_tiles(nb, m, n, kg, aligned, dev)
    tiles = [(r0, min(m, r0 + rows)) for r0 in range(0, m, rows)]
    if workers > 1:
        # a pool per call: no idle threads outlive it, so a later fork (gloo ranks, DataLoader workers) is clean
        with ThreadPoolExecutor(workers, thread_name_prefix="mixprec-emulate") as pool:
            futures = [pool.submit(_tile, a3, b3, r0, r1, model, groups, check_overflow, out) for r0, r1 in tiles]
            for future in futures:
                future.result()
    else:
        for r0, r1 in tiles:
            _tile(a3, b3, r0, r1, model, groups, check_overflow, out)
    return out


def _accumulator_growth_bound(model: MatmulModel, groups: int, k: int, sum_abs: float) -> float:
    """An upper bound on every ``|acc|`` the low-precision chain can reach, given ``sum_abs >= sum_k |a_k b_k|``.

    One step is an fp64 ``baddbmm`` of ``k_group + 1`` terms (relative error <= gamma_{k_group+1}(2**-53) of
    ``|acc| + sum|p|``) then one rounding to the accumulator (relative error <= u, plus at most half a subnormal
    spacing < min_normal absolute). So each step grows the running bound by a factor <= 1 + u' with
    ``u' = u + (1 + u) gamma_{k_group+1}(2**-53)``, and after ``n`` steps (Higham, Lemma 3.1)
    ``|acc_n| <= (1 + gamma_n(u')) (sum|p| + n min_normal)``. The chain is at most ``n = groups`` steps long
    (fewer with promotion, which resets it). ``sum_abs`` itself comes from fp64 sums of ``k`` terms and one product:
    relative error <= gamma_{k+3}(2**-53) with the final multiplication. ``inf`` when ``n u' >= 1``."""
    acc = model.accumulator
    u64 = 2.0**-53
    n = groups if model.promote_every is None else min(groups, model.promote_every // model.k_group)
    u_step = acc.unit_roundoff + (1 + acc.unit_roundoff) * _gamma(model.k_group + 1, u64)
    return (1 + _gamma(n, u_step)) * (sum_abs * (1 + _gamma(k + 3, u64)) + n * acc.min_normal)


def _tile(
    a3: torch.Tensor,
    b3: torch.Tensor,
    r0: int,
    r1: int,
    model: MatmulModel,
    groups: int,
    check_overflow: bool,
    out: torch.Tensor,
) -> None:
    """All K groups for output rows ``r0:r1``, written into ``out``."""
    nb, n, kg, dev = a3.shape[0], b3.shape[-1], model.k_group, a3.device
    acc_fmt = model.accumulator
    promote_groups = None if model.promote_every is None else model.promote_every // kg
    aligned = model.align_bits is not None
    # toward-zero rounding of aligned sums by clearing bits is exact when every non-zero sum is a normal number
    # of the accumulator: sums are multiples of 2**(e - F) with e >= the exponent of the smallest product
    fast_rz = aligned and 2 * (model.inputs.emin - model.inputs.man_bits) - model.align_bits >= acc_fmt.emin
    acc = torch.empty(nb, r1 - r0, n, dtype=torch.float64, device=dev)
    work = torch.empty_like(acc, dtype=torch.int64)
    scratch32 = torch.empty_like(acc, dtype=torch.float32)
    promoted = torch.zeros_like(acc) if promote_groups is not None else None
    products = torch.empty(nb, r1 - r0, kg, n, dtype=torch.float64, device=dev) if aligned else None
    for g in range(groups):
        a_g = a3[:, r0:r1, g * kg : (g + 1) * kg]  # strided views: BLAS reads them in place
        b_g = b3[:, g * kg : (g + 1) * kg]
        fresh = g == 0 or (promote_groups is not None and g % promote_groups == 0)  # accumulator is zero
        if aligned:
            if fresh:
                acc.zero_()
            _aligned_step_(acc, a_g, b_g, model, products, fast_rz)
        else:
            if fresh:
                # +0 + products, as an MMA's zeroed accumulator: bmm alone gives -0 for a sum of -0 products
                # in some BLAS kernels (MKL's for one-product groups) and +0 in others
                acc.zero_()
            acc.baddbmm_(a_g, b_g)  # exact in fp64 (see the module docstring)
            _round_acc_(acc, acc_fmt, work, scratch32, check_overflow)
        if promoted is not None and ((g + 1) % promote_groups == 0 or g == groups - 1):
            # fp64 then fp32 rounding of a sum of two <=24-bit values equals one rounding (53 >= 2*24 + 2)
            promoted.add_(acc)
            _round_acc_(promoted, FORMAT_PRESETS["fp32"], work, scratch32, True)
    out[:, r0:r1] = promoted if promoted is not None else acc


def _round_acc_(
    acc: torch.Tensor, fmt: FloatFormat, work: torch.Tensor, scratch32: torch.Tensor, check_overflow: bool
) -> None:
    """Round the fp64 accumulator tile in place to ``fmt`` (nearest even), the hot path. ``work`` (int64) and
    ``scratch32`` (fp32) are preallocated tiles of ``acc``'s shape."""
    if fmt.is_fp32:
        scratch32.copy_(acc)  # torch's fp64 -> fp32 cast rounds to nearest even (one rounding), inf on overflow
        acc.copy_(scratch32)
        return
    round_nearest_grid_(acc, fmt, work, keep_zero_sign=False)
    if check_overflow or fmt.saturate:
        apply_overflow_(acc, fmt)
    flush_subnormals_(acc, fmt)


def _aligned_step_(
    acc: torch.Tensor, a_g: torch.Tensor, b_g: torch.Tensor, model: MatmulModel, products: torch.Tensor, fast_rz: bool
) -> None:
    """One MMA of the alignment model, in place on the fp64 accumulator tile ``acc (B, R, N)``; ``products`` is a
    preallocated ``(B, R, kg, N)`` fp64 buffer. 4 passes over the products (form, min/max, divide, sum)."""
    torch.mul(a_g.unsqueeze(-1), b_g.unsqueeze(1), out=products)  # exact
    p_min, p_max = torch.aminmax(products, dim=2)
    largest = torch.maximum(p_max, p_min.neg_())
    torch.maximum(largest, acc.abs(), out=largest)
    exp_field = largest.view(torch.int64).bitwise_and_(_FP64_EXP_MASK)  # 2**e_max as bits
    # spacing of the aligned terms, 2**(e_max - F); all-zero steps get a harmless tiny spacing
    exp_field.sub_(model.align_bits << 52).clamp_(min=1 << 52)
    spacing = exp_field.view(torch.float64)
    torch.div(products, spacing.unsqueeze(2), rounding_mode="trunc", out=products)  # exact: power-of-two divisor
    torch.div(acc, spacing, rounding_mode="trunc", out=acc)
    acc.add_(products.sum(dim=2)).mul_(spacing)  # integer multiples of the spacing: exact in fp64
    fmt = model.accumulator
    if model.align_rounding == "nearest":
        work, scratch32 = torch.empty_like(acc, dtype=torch.int64), torch.empty_like(acc, dtype=torch.float32)
        _round_acc_(acc, fmt, work, scratch32, True)
    elif fast_rz:
        _truncate_normal_(acc, fmt)
    else:
        round_directed_(acc, fmt, "toward_zero", None)


def _truncate_normal_(acc: torch.Tensor, fmt: FloatFormat) -> None:
    """Round fp64 ``acc`` toward zero to ``fmt`` when no non-zero value can lie below ``fmt``'s normal range:
    clearing the low fraction bits is exact truncation there. Magnitudes above max go to +-max (IEEE RZ)."""
    acc.view(torch.int64).bitwise_and_(~((1 << (52 - fmt.man_bits)) - 1))
    if acc.numel():
        lo, hi = torch.aminmax(acc)
        if not (bool(lo >= -fmt.max_finite) and bool(hi <= fmt.max_finite)):
            finite = torch.isfinite(acc)
            acc.copy_(torch.where(finite, acc.clamp(-fmt.max_finite, fmt.max_finite), acc))
            apply_overflow_(acc, fmt)  # what is still above max is +-inf: the format's rule for inf


def _gamma(n: int, u: float) -> float:
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)
