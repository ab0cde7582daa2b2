"""Agreement of per-rank flags (e.g. "my gradients overflowed") across a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mixprec.core.validate import check_group

__all__ = ["agree_any", "collective_device", "is_distributed"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a small collective on ``group`` must use: CUDA for NCCL, CPU otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_any(flag: torch.Tensor | bool, group: dist.ProcessGroup | None = None) -> bool:
    """Return True on every rank of ``group`` if ``flag`` is true on any rank (for a tensor: any element non-zero).

    One all-reduce(MAX) of a single fp32 element, then a host sync. Outside a distributed run it is
    just ``bool(flag)``. ``group=None`` means the default (world) group.
    """
    check_group("group", group)
    if isinstance(flag, torch.Tensor):
        # Any non-zero (or NaN) element counts: a multi-element flag is never read through its first element.
        local = flag.detach().ne(0).any().reshape(1)
    else:
        local = torch.tensor([bool(flag)])
    if not is_distributed():
        return bool(local.item())
    t = local.to(device=collective_device(group), dtype=torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() != 0.0)
