"""torch.distributed names that changed between releases, feature-detected once.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (FutureWarning) in favour of
``all_gather_single``/``reduce_scatter_single``; older releases only have the former. Same arguments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "overlaps", "reduce_scatter_flat", "require_initialized"]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, *, async_op: bool = False
) -> Any:
    """``output[r*n:(r+1)*n] = input`` of rank r, for every rank; ``input`` may be that slice of ``output``."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    op: Any = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Any:
    """The backend's own reduce-scatter (accumulates in the input dtype on gloo and NCCL)."""
    return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)


def require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs an initialised torch.distributed process group (init_process_group)")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two (contiguous) tensors intersects."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1 and a.numel() > 0 and b.numel() > 0
