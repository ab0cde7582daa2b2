"""Agreement of per-rank flags (e.g. "my gradients overflowed") across a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    """Return True on every rank of ``group`` if ``flag`` is true (non-zero) on any rank.

    One all-reduce(MAX) of a single fp32 element, then a host sync. Outside a distributed run it is
    just ``bool(flag)``. ``group=None`` means the default (world) group.
    """
    if not is_distributed():
        return bool(flag.item()) if isinstance(flag, torch.Tensor) else bool(flag)
    device = collective_device(group)
    if isinstance(flag, torch.Tensor):
        t = flag.detach().reshape(-1)[:1].to(device=device, dtype=torch.float32, copy=True)
    else:
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() != 0.0)
