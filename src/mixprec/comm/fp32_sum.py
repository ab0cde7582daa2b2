"""The fp32 sum of P received shards in rank order, scaled and rounded once, block by block.

Shared by the flat collectives of :mod:`mixprec.comm.fp32_accumulate`, both stages of
:mod:`mixprec.comm.hierarchical_fp32` and the torch DDP hook: one place fixes the order of the additions,
which is what makes every path bit-for-bit reproducible. With round-to-nearest on CPU, the compiled kernel
``mixprec_fp32sum_rows`` (``native/csrc/fp32sum.c``) does the same arithmetic in one pass instead of five or
more; results with a NaN are redone by the torch path, which stays the oracle.
"""

from __future__ import annotations

import torch

import mixprec.native as native
from mixprec.core.dtypes import Rounding
from mixprec.core.random import rounding_generator
from mixprec.core.stochastic import round_into_
from mixprec.native import kernels, ops

__all__ = ["round_blocks_into", "sum_shards_into"]

# Elements per block of the fp32 sum (256 KiB of fp32: the accumulator and the widened addend fit in L2).
_SUM_BLOCK = 1 << 16
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _sum_compiled(output: torch.Tensor, shards: torch.Tensor, average: bool, factor: float | None) -> bool:
    """The one-pass kernel for round-to-nearest on CPU; False (nothing usable written) when it does not apply
    or a result is NaN, whose payload the torch path decides."""
    if (
        output.dtype not in _KERNEL_DTYPES
        or shards.dtype not in _KERNEL_DTYPES
        or not output.is_contiguous()
        or shards.dim() != 2
        or shards.stride(1) != 1
        or output.numel() != shards.shape[1]
    ):
        return False
    path = native.route(output, shards)
    if path == "kernel":
        return kernels.fp32_sum_rows(shards, output, average, factor) == 0
    if path == "op":
        return int(ops.fp32_sum_rows(shards, output, average, factor)) == 0
    return False


def sum_shards_into(
    output: torch.Tensor,
    shards: torch.Tensor,
    *,
    average: bool,
    rounding: Rounding,
    generator: torch.Generator | None,
    factor: float | None = None,
) -> None:
    """``output = round(sum_r shards[r] (/ world_size) (* factor))``: fp32 sum in rank order, fp32 scaling,
    one rounding to output.dtype.

    Works block by block (``_SUM_BLOCK`` elements): each block is summed in a small fp32 accumulator,
    scaled and rounded into ``output`` while it is still in cache, so the whole shard never exists in fp32
    (an fp32 ``output`` is its own accumulator). The addends are widened into a second small buffer
    first: on CPU, an in-place fp32 add of an fp16/bf16 operand makes torch allocate an fp32 copy of it.
    Extra memory: two blocks of fp32 (512 KiB); about 3x faster here than whole-shard passes.
    """
    if output.dtype != torch.float32:  # an fp32 output is not rounded: no stream is created
        generator = rounding_generator(rounding, generator, output.device)
    world_size, shard = shards.shape
    if world_size == 0:
        raise ValueError("shards must have at least one row (one per rank); got 0 rows")
    if (rounding == "nearest" or output.dtype == torch.float32) and _sum_compiled(output, shards, average, factor):
        return
    out_flat = output.view(-1)
    in_place = output.dtype == torch.float32
    size = min(_SUM_BLOCK, shard)
    acc_buf = None if in_place else torch.empty(size, dtype=torch.float32, device=output.device)
    widen_buf = torch.empty(size, dtype=torch.float32, device=output.device) if shards.dtype != torch.float32 else None
    for start in range(0, shard, _SUM_BLOCK):
        stop = min(start + _SUM_BLOCK, shard)
        acc = out_flat[start:stop] if acc_buf is None else acc_buf[: stop - start]
        acc.copy_(shards[0, start:stop])
        for r in range(1, world_size):
            addend = shards[r, start:stop]
            if widen_buf is not None:
                addend = widen_buf[: stop - start].copy_(addend)  # exact widening to fp32
            acc.add_(addend)  # one fp32 rounding per addend
        if average:
            acc.div_(world_size)
        if factor is not None:
            acc.mul_(factor)
        if acc_buf is not None:
            round_into_(out_flat[start:stop], acc, rounding=rounding, generator=generator)


def round_blocks_into(
    output: torch.Tensor, sums: torch.Tensor, *, rounding: Rounding, generator: torch.Generator | None
) -> None:
    """Round ``sums`` (fp32, what :func:`sum_shards_into` computes for ``output``'s elements before its rounding)
    into ``output`` block by block as :func:`sum_shards_into` rounds them: the same blocks, so a stochastic
    rounding takes the same draws from ``generator`` (the models of :mod:`mixprec.comm.models` rely on it)."""
    out_flat = output.view(-1)
    for start in range(0, out_flat.numel(), _SUM_BLOCK):
        stop = min(start + _SUM_BLOCK, out_flat.numel())
        round_into_(out_flat[start:stop], sums[start:stop], rounding=rounding, generator=generator)
