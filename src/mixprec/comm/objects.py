"""Small host-side collectives of Python values, and telling a lost peer from a rank's own error.

These carry bookkeeping, not gradients: a few floats summed for a log line, one picklable object per rank
gathered for a checkpoint. Each works outside a process group too (as the identity on one rank), so callers
need no ``if distributed`` branches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.agree import collective_device, is_distributed

__all__ = ["all_reduce_sum_fp64", "gather_objects", "is_peer_failure"]

# What gloo's transport says when the other end of a pair went away or stopped answering (torch 2.x raises
# these as plain RuntimeError, not as torch.distributed.DistError). "Application timeout caused pair closure"
# comes without a source location: a pair that an earlier operation's timeout closed fails the next operation
# on it, as in the second stage of a two-stage reduction when a peer of the first stage stopped.
_PEER_FAILURE_MARKERS = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "Timed out waiting",
    "Socket Timeout",
    "Application timeout caused pair closure",
)


def all_reduce_sum_fp64(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """The sum over the ranks of ``group`` of each of ``values`` (Python floats), accumulated in fp64.

    Wire dtype: fp64; accumulation dtype: fp64 (the backend's SUM in the wire dtype). Extra memory: one fp64
    tensor of ``len(values)`` elements on the collective device. Over W ranks the result is within
    gamma_{W-1} (fp64 unit roundoff 2**-53) relative to the sum of absolute values, in the backend's order.
    Outside a process group the values come back unchanged.
    """
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return t.tolist()


def gather_objects(obj: Any, *, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Gather one picklable object per rank onto global rank ``dst``: the list (indexed by group rank) there,
    None on every other rank.

    Wire: the pickled bytes (uint8), padded to the longest; no accumulation. Extra memory: on ``dst`` the sum
    of all ranks' pickles, elsewhere one's own; unlike ``all_gather_object`` the other ranks never hold the
    world's objects. Tensors in ``obj`` should be on the CPU (a CUDA tensor is unpickled onto its device on
    ``dst``). Outside a process group: ``[obj]``.
    """
    if not is_distributed():
        return [obj]
    world = dist.get_world_size(group)
    out: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says a collective failed because another rank died, hung or closed its connection
    (``torch.distributed.DistError`` and its subclasses, or gloo's transport errors), as opposed to an error
    of this rank's own making. A launcher uses it to blame the rank that failed first, not its victims."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_FAILURE_MARKERS)
