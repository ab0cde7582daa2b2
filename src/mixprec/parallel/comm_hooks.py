"""fp32 accumulation for users who keep torch's DistributedDataParallel: a comm hook.

:func:`fp32_accumulate_hook` for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``: each
gradient bucket is all-reduced with :func:`mixprec.comm.all_reduce_fp32_accumulate` (wire in the bucket
dtype, fp32 sum, one rounding) and averaged, as torch's default hook averages. The FSDP2 counterpart is in
:mod:`mixprec.parallel.fsdp2`.

No ``from __future__ import annotations`` here: torch DDP's ``register_comm_hook`` compares the hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
"""

import torch
import torch.distributed as dist

from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate

__all__ = ["fp32_accumulate_hook"]


def fp32_accumulate_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket with the wire in its dtype and the sum in fp32.

    ``model.register_comm_hook(state=None, hook=fp32_accumulate_hook)``; ``state`` is the process group
    (None = the default group). A bucket whose length is not a multiple of the group size is copied into
    a zero-padded buffer first (extra memory: that buffer, at most one bucket). Besides, the extra memory
    is that of :func:`mixprec.comm.all_reduce_fp32_accumulate`: a receive buffer of the bucket's size and
    512 KiB of fp32 blocks.

    The reduction runs inside the hook (the returned future is already complete): torch DDP still calls
    the hook for each bucket as soon as backward has produced it, but backward waits for that bucket's
    reduction before continuing.
    """
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"state must be a torch.distributed ProcessGroup or None; got {type(state).__name__}")
    buffer = bucket.buffer()
    world_size = dist.get_world_size(state)
    numel = buffer.numel()
    padded = -(-numel // world_size) * world_size
    if padded == numel and buffer.is_contiguous():
        work = buffer
    else:
        work = torch.zeros(padded, dtype=buffer.dtype, device=buffer.device)
        work[:numel].copy_(buffer.view(-1))
    all_reduce_fp32_accumulate(work, state, average=True)
    if work is not buffer:
        buffer.view(-1).copy_(work[:numel])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
