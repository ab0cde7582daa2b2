"""Reduce-scatter and all-reduce that send fp16/bf16 but add in fp32, rounding each result once.

The backends' own collectives add in the wire dtype (NCCL's ring and gloo round the running sum after
every hop, so the error grows with the number of ranks); casting to fp32 first doubles the bytes on the
wire. Here the wire carries the input dtype: one ``all_to_all_single`` brings each rank the world_size
pieces of its own shard, which it adds in fp32 in rank order and rounds once to the output dtype, as
Megatron-LM's ``reduce_scatter_with_fp32_accumulation`` (megatron/core/distributed/) does.

Error: at most ``gamma_{P-1}`` (fp32 unit roundoff ``2**-24``) relative for the sum of P addends, plus one
rounding to fp16/bf16. The sum order is fixed, so results are bit-for-bit reproducible; in the all-reduce
every element is rounded on one rank and all-gathered, so all ranks hold identical bits. inf/NaN
propagate. The derivation and memory accounting are in ``docs/comm.md``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mixprec.comm.compat import all_gather_flat, overlaps, require_initialized
from mixprec.comm.handles import PendingReduction
from mixprec.comm.padding import round_up
from mixprec.core.dtypes import LOW_PRECISION_DTYPES, ROUNDINGS, WIRE_DTYPES, Rounding
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED, rank_generator
from mixprec.core.stochastic import round_into_
from mixprec.core.validate import check_bool, check_choice, check_group, check_tensor

__all__ = [
    "all_reduce_fp32_accumulate",
    "reduce_scatter_fp32_accumulate",
    "reduce_scatter_scaled",
    "sum_shards_into",
]

# Elements per block of the fp32 sum (256 KiB of fp32: the accumulator and the widened addend fit in L2).
_SUM_BLOCK = 1 << 16


def _receive_buffer(
    scratch: torch.Tensor | None, like: torch.Tensor, like_name: str, avoid: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """The all-to-all's receive buffer: ``scratch[:like.numel()]`` after checks (errors name ``like_name``,
    the argument the caller passed), or a fresh one."""
    numel = like.numel()
    if scratch is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    check_tensor("scratch", scratch, (like.dtype,), contiguous=True, materialized=True)
    if scratch.numel() < numel or scratch.device != like.device:
        raise ValueError(
            f"scratch must hold at least {like_name}.numel() = {numel} elements on {like.device}; "
            f"got {scratch.numel()} on {scratch.device}"
        )
    recv = scratch.view(-1)[:numel]
    if any(overlaps(recv, t) for t in avoid):
        raise ValueError(f"scratch must not overlap {like_name}" + (" or output" if len(avoid) > 1 else ""))
    return recv


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
    if rounding == "stochastic" and generator is None and output.dtype != torch.float32:
        generator = rank_generator(DEFAULT_STOCHASTIC_SEED, output.device)
    world_size, shard = shards.shape
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


def reduce_scatter_fp32_accumulate(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    average: bool = False,
    async_op: bool = False,
    rounding: Rounding = "nearest",
    scratch: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PendingReduction | None:
    """Reduce-scatter with the wire in ``input.dtype`` and the sum in fp32; ``output`` = this rank's shard.

    Rank r receives ``output = round(sum_{q=0}^{P-1} input_q[r*S:(r+1)*S])`` where ``P`` is the group size,
    ``S = input.numel() // P`` and ``input_q`` is rank q's input (flattened, row-major).

    Wire dtype: ``input.dtype`` (fp16, bf16 or fp32), one ``all_to_all_single``: each rank sends and
    receives ``(P-1)/P`` of the input, the same bytes as a ring reduce-scatter.
    Accumulation: fp32, in rank order, then one rounding to ``output.dtype`` (none when it is fp32).
    Extra memory: the receive buffer (``input.numel()`` elements of ``input.dtype``; pass ``scratch`` to
    reuse one across calls) plus two fp32 blocks of 2**16 elements (512 KiB) in which the shard is summed
    and rounded block by block, and, for stochastic rounding, about 3 MiB of float64 temporaries. So less
    than one fp32 shard, and never an fp32 copy of the whole input.

    Args:
        output: contiguous, ``S`` elements, dtype ``input.dtype`` or torch.float32 (then nothing is rounded).
            It may be a view into ``input`` (e.g. this rank's own slice): ``input`` is sent before
            ``output`` is written.
        input: contiguous, fp16/bf16/fp32, ``numel`` divisible by the group size (pad it; the bucket
            layer of :class:`mixprec.parallel.DistributedDataParallel` does). Not modified.
        group: process group; None = the default group.
        average: divide the fp32 sum by the group size (in fp32) before the single rounding. Never a
            low-precision average.
        async_op: return a :class:`PendingReduction` at once; its ``wait()`` waits for the all-to-all and
            then sums. Do not touch ``input``, ``output`` or ``scratch`` before ``wait()``.
        rounding: ``"nearest"`` (torch's cast) or ``"stochastic"`` (unbiased; needs an fp16/bf16 output).
        scratch: optional receive buffer: contiguous, dtype ``input.dtype``, at least ``input.numel()``
            elements, not overlapping ``input`` or ``output``.
        generator: random stream for ``rounding="stochastic"``; None = a per-process generator seeded
            with ``DEFAULT_STOCHASTIC_SEED + global rank``.

    Returns:
        None, or a :class:`PendingReduction` when ``async_op=True``.
    """
    return reduce_scatter_scaled(
        output,
        input,
        group,
        average=average,
        factor=None,
        async_op=async_op,
        rounding=rounding,
        scratch=scratch,
        generator=generator,
    )


def reduce_scatter_scaled(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    average: bool,
    factor: float | None,
    async_op: bool,
    rounding: Rounding,
    scratch: torch.Tensor | None,
    generator: torch.Generator | None,
) -> PendingReduction | None:
    """:func:`reduce_scatter_fp32_accumulate` with an optional fp32 multiplier applied to the sum before the
    rounding (``ReduceOp.PREMUL_SUM`` semantics, for the FSDP2 hook): ``round(sum (/ P) * factor)``."""
    require_initialized("reduce_scatter_fp32_accumulate")
    check_tensor("input", input, WIRE_DTYPES, contiguous=True, materialized=True)
    check_tensor("output", output, (input.dtype, torch.float32), contiguous=True, materialized=True)
    check_group("group", group)
    check_choice("rounding", rounding, ROUNDINGS)
    check_bool("average", average)
    check_bool("async_op", async_op)
    if factor is not None and not math.isfinite(factor):
        raise ValueError(f"factor must be finite; got {factor!r}")
    if rounding == "stochastic" and output.dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"rounding='stochastic' needs a float16/bfloat16 output; output is {output.dtype}")
    if output.device != input.device:
        raise ValueError(f"output is on {output.device} but input is on {input.device}")
    world_size = dist.get_world_size(group)
    numel = input.numel()
    if numel % world_size:
        raise ValueError(
            f"input.numel() = {numel} is not divisible by the group size {world_size}: pad the input to a "
            f"multiple of {world_size} (e.g. to {round_up(numel, world_size)})"
        )
    shard = numel // world_size
    if output.numel() != shard:
        raise ValueError(f"output must hold input.numel() / group size = {shard} elements; got {output.numel()}")
    recv = _receive_buffer(scratch, input, "input", (input, output))
    return _start_reduce_scatter(output, input, recv, group, world_size, average, factor, async_op, rounding, generator)


def _start_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    recv: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    average: bool,
    factor: float | None,
    async_op: bool,
    rounding: Rounding,
    generator: torch.Generator | None,
) -> PendingReduction | None:
    """The reduce-scatter itself, on arguments the public functions have checked."""
    work = dist.all_to_all_single(recv, input.view(-1), group=group, async_op=async_op)

    def finish() -> None:
        if work is not None:
            work.wait()
        sum_shards_into(
            output,
            recv.view(world_size, output.numel()),
            average=average,
            rounding=rounding,
            generator=generator,
            factor=factor,
        )

    if async_op:
        return PendingReduction(finish)
    finish()
    return None


def all_reduce_fp32_accumulate(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    average: bool = False,
    async_op: bool = False,
    rounding: Rounding = "nearest",
    scratch: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PendingReduction | None:
    """In-place all-reduce: :func:`reduce_scatter_fp32_accumulate`, then an all-gather in the wire dtype.

    Every element is summed in fp32 on exactly one rank and rounded there once, then all-gathered, so all
    ranks end with identical bits.

    Wire dtype: ``tensor.dtype`` for both phases (an all-to-all and an all-gather: the bytes of a ring
    all-reduce). Accumulation: fp32, rank order, one rounding to ``tensor.dtype``.
    Extra memory: the receive buffer (``tensor.numel()`` elements of ``tensor.dtype``, or ``scratch``) plus
    512 KiB of fp32 blocks. The reduced shard is written into this rank's slice of ``tensor``, which the
    all-gather then sends from, in place.

    Args:
        tensor: contiguous fp16/bf16/fp32, ``numel`` divisible by the group size; reduced in place.
        group, average, async_op, rounding, scratch, generator: as for
            :func:`reduce_scatter_fp32_accumulate`. With ``async_op=True`` the all-gather runs inside
            ``wait()``.
    """
    require_initialized("all_reduce_fp32_accumulate")
    check_tensor("tensor", tensor, WIRE_DTYPES, contiguous=True, materialized=True)
    check_group("group", group)
    check_choice("rounding", rounding, ROUNDINGS)
    check_bool("average", average)
    check_bool("async_op", async_op)
    if rounding == "stochastic" and tensor.dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"rounding='stochastic' needs a float16/bfloat16 tensor; tensor is {tensor.dtype}")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    flat = tensor.view(-1)
    if flat.numel() % world_size:
        raise ValueError(
            f"tensor.numel() = {flat.numel()} is not divisible by the group size {world_size}: pad the "
            f"tensor to a multiple of {world_size}"
        )
    shard = flat.numel() // world_size
    own = flat[rank * shard : (rank + 1) * shard]
    recv = _receive_buffer(scratch, flat, "tensor", (flat,))
    pending = _start_reduce_scatter(own, flat, recv, group, world_size, average, None, async_op, rounding, generator)

    def finish() -> None:
        if pending is not None:
            pending.wait()
        all_gather_flat(flat, own, group)

    if async_op:
        return PendingReduction(finish)
    finish()
    return None
