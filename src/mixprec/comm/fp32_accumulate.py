"""Reduce-scatter and all-reduce that send fp16/bf16 but add in fp32, rounding each result once.

The backends' own collectives add in the wire dtype (NCCL's ring and gloo round the running sum after
every hop, so the error grows with the number of ranks); casting to fp32 first doubles the bytes on the
wire. Here the wire carries the input dtype: one ``all_to_all_single`` brings each rank the world_size
pieces of its own shard, which it adds in fp32 in rank order and rounds once to the output dtype, as
Megatron-LM's ``reduce_scatter_with_fp32_accumulation`` (megatron/core/distributed/) does.

Error: at most ``gamma_{P-1}`` (fp32 unit roundoff ``2**-24``) relative for the sum of P addends, plus one
rounding to fp16/bf16. The sum order is fixed, so results are bit-for-bit reproducible; in the all-reduce
every element is rounded on one rank and all-gathered, so all ranks hold identical bits. inf/NaN
propagate. With ``topology=`` both run the two-stage multi-node scheme of
:mod:`mixprec.comm.hierarchical_fp32` instead. The derivations and memory accounting: ``docs/comm.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm import hierarchical_fp32
from mixprec.comm.compat import all_gather_flat, overlaps, require_initialized
from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.comm.handles import PendingReduction
from mixprec.comm.padding import round_up
from mixprec.comm.topology import Topology, check_topology, resolve_topology
from mixprec.core.dtypes import LOW_PRECISION_DTYPES, ROUNDINGS, WIRE_DTYPES, Rounding
from mixprec.core.random import rounding_generator
from mixprec.core.validate import check_bool, check_choice, check_group, check_tensor

__all__ = [
    "all_reduce_fp32_accumulate",
    "reduce_scatter_fp32_accumulate",
    "reduce_scatter_scaled",
    "sum_shards_into",
]


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


def _check_hierarchical(
    topology: Any, group: dist.ProcessGroup | None, inter_node_dtype: Any, wire: torch.dtype
) -> torch.dtype:
    """Validate the hierarchical arguments (no collective); the inter-node dtype."""
    check_topology(topology, group)
    if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        raise ValueError(
            "group: a hierarchical topology numbers ranks node-major over the default group, so group must "
            "hold every rank in global rank order (or be None)"
        )
    if inter_node_dtype is None:
        return wire
    if not isinstance(inter_node_dtype, torch.dtype):
        raise TypeError(f"inter_node_dtype must be a torch.dtype or None; got {type(inter_node_dtype).__name__}")
    if inter_node_dtype not in (wire, torch.float32):
        raise ValueError(
            f"inter_node_dtype must be None, the wire dtype {wire} or torch.float32; got {inter_node_dtype}"
        )
    return inter_node_dtype


def _check_flat_dtype(inter_node_dtype: Any) -> None:
    if inter_node_dtype is not None:
        raise ValueError("inter_node_dtype applies only to the hierarchical scheme: pass a topology as well")


def _nodes(topology: Any) -> int:
    return topology.nodes if isinstance(topology, Topology) else int(topology.mesh.shape[0])


def _area(
    scratch: torch.Tensor | None,
    like: torch.Tensor,
    shard: int,
    world_size: int,
    avoid: tuple[torch.Tensor, ...],
    nodes: int,
    all_reduce: bool,
) -> tuple[torch.Tensor, int]:
    """The hierarchical receive area (``scratch`` checked, or a fresh one) and its segment length."""
    minimum = hierarchical_fp32.per_segment(world_size, nodes, all_reduce)
    if scratch is None:
        elements = hierarchical_fp32.area_elements(shard, world_size, nodes, all_reduce)
        area = torch.empty(elements, dtype=like.dtype, device=like.device)
    else:
        check_tensor("scratch", scratch, (like.dtype,), contiguous=True, materialized=True)
        if scratch.numel() < minimum or scratch.device != like.device:
            raise ValueError(
                f"scratch (the hierarchical receive area) must hold at least {minimum} elements on {like.device} "
                f"(4 x group size; all-reduce: 8 x group size + 4 x nodes); got {scratch.numel()} on {scratch.device}"
            )
        area = scratch.view(-1)
        if any(overlaps(area, t) for t in avoid):
            raise ValueError("scratch must not overlap the tensors being reduced")
    return area, hierarchical_fp32.segment_length(shard, world_size, area.numel(), nodes, all_reduce)


def _finish_or_return(pending: PendingReduction, async_op: bool) -> PendingReduction | None:
    if async_op:
        return pending
    pending.wait()
    return None


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
    topology: Any = None,
    inter_node_dtype: torch.dtype | None = None,
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
        topology: None (the flat scheme above), or a :class:`mixprec.comm.Topology` / 2-D DeviceMesh
            with dims ("node", "local") for the two-stage scheme of :mod:`mixprec.comm.hierarchical_fp32`
            (``group`` must then span the default group in rank order). Each node sends ``(m-1)/m N``
            elements to other nodes (a ring: ``(W-1)/W N``; the flat all-to-all ``n (m-1)/m N``); the stages
            are pipelined over segments; ``scratch`` is then the receive area, of any length
            ``>= 4 W`` (all-reduce: ``8 W + 4 m``; segments shrink to fit it; None = an area that cuts the
            shard in 4).
        inter_node_dtype: hierarchical only: None (= ``input.dtype``: the node partial is rounded before it
            crosses nodes) or torch.float32 (kept in fp32: twice the inter-node bytes).

    Error (hierarchical, ``u`` the wire's unit roundoff, ``u32 = 2**-24``, n ranks per node, m nodes):
    ``|result - exact| <= (gamma_{n-1}(u32) + u (1 + gamma_{n-1}) + gamma_{m-1}(u32)) sum |x| + u |exact|``
    up to second-order terms: two roundings whatever the data-parallel size; with
    ``inter_node_dtype=torch.float32`` the middle ``u`` term goes (one rounding, as the flat scheme).
    Derivation: ``docs/comm.md``.

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
        topology=topology,
        inter_node_dtype=inter_node_dtype,
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
    topology: Any = None,
    inter_node_dtype: torch.dtype | None = None,
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
    if topology is not None:
        inter = _check_hierarchical(topology, group, inter_node_dtype, input.dtype)
        area, seg = _area(scratch, input, shard, world_size, (input, output), _nodes(topology), False)
        hier = resolve_topology(topology, group)  # creates the subgroups once (a collective): after the checks
        pending = hierarchical_fp32.start_reduce_scatter(
            output,
            input,
            hier,
            area,
            seg,
            inter_dtype=inter,
            average=average,
            factor=factor,
            rounding=rounding,
            generator=rounding_generator(rounding, generator, output.device),
        )
        return _finish_or_return(pending, async_op)
    _check_flat_dtype(inter_node_dtype)
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
    topology: Any = None,
    inter_node_dtype: torch.dtype | None = None,
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
        group, average, async_op, rounding, scratch, generator, topology, inter_node_dtype: as for
            :func:`reduce_scatter_fp32_accumulate`. With ``async_op=True`` the all-gather runs inside
            ``wait()``. Hierarchical: the two-stage reduce-scatter, then an inter-node and an intra-node
            all-gather in the wire dtype, in place; same error bound, identical bits on every rank.
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
    if topology is not None:
        inter = _check_hierarchical(topology, group, inter_node_dtype, tensor.dtype)
        area, seg = _area(scratch, flat, shard, world_size, (flat,), _nodes(topology), True)
        hier = resolve_topology(topology, group)
        pending = hierarchical_fp32.start_all_reduce(
            flat,
            hier,
            area,
            seg,
            inter_dtype=inter,
            average=average,
            rounding=rounding,
            generator=rounding_generator(rounding, generator, tensor.device),
        )
        return _finish_or_return(pending, async_op)
    _check_flat_dtype(inter_node_dtype)
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
