"""Process groups that mixprec creates inherit the timeout the user gave ``init_process_group``.

``torch.distributed.new_group`` without ``timeout=`` falls back to the backend's default (30 minutes for
gloo, 10 for NCCL), not to the default group's timeout. A hung peer would then block a subgroup collective
long after the run's own ``--timeout`` should have stopped it. Every group mixprec creates goes through
:func:`new_group`, which passes the default group's timeout on.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["group_timeout", "new_group"]


def group_timeout(group: ProcessGroup | None = None) -> timedelta | None:
    """The timeout of ``group``'s backend (None = the default group), or None if the backend does not say."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except (RuntimeError, ValueError):
            continue
        options = getattr(backend, "options", None)
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    timeout: timedelta | None = None,
    use_local_synchronization: bool = False,
) -> ProcessGroup:
    """``torch.distributed.new_group(ranks)`` with ``timeout`` defaulting to the default group's timeout.

    A collective call: every rank of the default group calls it, with the same ``ranks``, in the same order;
    with ``use_local_synchronization=True`` only the ranks in ``ranks`` do (torch's option of that name).
    """
    if timeout is None:
        timeout = group_timeout()
    return dist.new_group(
        ranks=None if ranks is None else list(ranks),
        timeout=timeout,
        use_local_synchronization=use_local_synchronization,
    )
