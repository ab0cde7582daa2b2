"""fp32 accumulation for users who keep torch's DistributedDataParallel: an asynchronous comm hook.

:func:`fp32_accumulate_hook` for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``: a thin
adapter over the ``"fp32_accumulate"`` reducer (:class:`mixprec.parallel.FP32AccumulateReducer`): each
gradient bucket, zero-padded to the reducer's multiple, is averaged by its ``all_reduce`` (wire in the
bucket dtype, fp32 sum in rank order, one rounding), the same call and bits as mixprec's own
``DistributedDataParallel``. The FSDP2 counterpart is in :mod:`mixprec.integrations.fsdp2`.

The hook hands the bucket to one background thread per process and group, which reduces the buckets one
at a time in hook order, so every rank issues the same collectives in the same order, on a second process
group over the same ranks (created at the first bucket, with the default group's timeout) that no other
code uses: torch DDP's own collectives on the DDP group, issued from the autograd thread, cannot
interleave with them. Rules for subgroups: ``docs/comm.md``. With a :class:`mixprec.comm.Topology` (or 2-D
DeviceMesh) as ``state``, the reducer runs the two-stage multi-node scheme of
:mod:`mixprec.comm.hierarchical_fp32` on the topology's subgroups instead.

No ``from __future__ import annotations`` here: torch DDP's ``register_comm_hook`` compares the hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
"""

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.groups import new_group
from mixprec.comm.live_audit import AuditResult, PendingAudit
from mixprec.comm.padding import pad_flat
from mixprec.comm.reducer import bucket_multiple
from mixprec.comm.topology import Topology, check_topology, resolve_topology
from mixprec.core.dtypes import WIRE_DTYPES
from mixprec.core.validate import check_group
from mixprec.integrations.hook_audit import AuditedHookState
from mixprec.parallel.reducers import FP32AccumulateReducer

__all__ = ["FP32HookState", "fp32_accumulate_hook"]


class FP32HookState(AuditedHookState):
    """:func:`fp32_accumulate_hook`'s state when it takes options beyond the group.

    Args:
        process_group: the DDP process group (None = the default group), or for the two-stage scheme a
            :class:`mixprec.comm.Topology` / 2-D DeviceMesh (as the hook's plain ``state``).
        audit_every: None, or an int N >= 1: at synced steps N, 2N, ... one bucket (bucket index
            ``(step // N - 1) mod buckets``) is also reduced exactly, and the error of the fp32-accumulated
            reduction and of the backend's own all-reduce recorded in :attr:`audit_results`
            (:class:`mixprec.comm.live_audit.LiveAudit`). Its collectives run on the autograd thread, on the
            bucket's group (the default group with a topology), before the bucket's own.
        on_audit: called with each audit result as it is recorded (on the hook's background thread).
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        audit_every: int | None = None,
        on_audit: Callable[[AuditResult], None] | None = None,
    ) -> None:
        self._init_audit(audit_every, on_audit)
        self.process_group = process_group

    def _begin(self, bucket: dist.GradBucket, group: dist.ProcessGroup | None) -> PendingAudit | None:
        return self._begin_audit(bucket.buffer(), bucket.index(), is_last=bucket.is_last(), group=group, native=True)


class _Runner:
    """Per process and group (or topology): the reducer, the group it runs on, one padded scratch buffer and the
    thread that reduces the buckets in hook order (one at a time, so one scratch serves them all)."""

    def __init__(self, group: dist.ProcessGroup | None, topology: Any) -> None:
        self.owner: object = None  # the group or mesh this runner belongs to (kept alive: see _runner)
        if topology is not None:
            resolve_topology(topology, None)  # every rank, at its first bucket: creates the subgroups
            self.group = None
            world = dist.get_world_size()
        else:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            # Called on the autograd thread by every rank of the group at its first bucket; a proper subgroup
            # synchronises locally (docs/comm.md). new_group passes the default group's timeout on.
            self.group = new_group(ranks, use_local_synchronization=len(ranks) != dist.get_world_size())
            world = len(ranks)
        self.reducer = FP32AccumulateReducer(topology=topology, max_in_flight=1)
        self.multiple = bucket_multiple(world)
        self._scratch: torch.Tensor | None = None
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="mixprec-fp32-hook", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()

    def _scratch_for(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        s = self._scratch
        if s is None or s.dtype != like.dtype or s.device != like.device or s.numel() < numel:
            s = self._scratch = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    def reduce(self, buffer: torch.Tensor, index: int) -> None:
        """Average ``buffer`` in place (on the runner's thread only)."""
        flat, copy_back = pad_flat(buffer, self.multiple, buffer=lambda n: self._scratch_for(n, buffer))
        self.reducer.all_reduce(flat, self.group, average=True, key=index).wait()
        copy_back()
        if buffer.device.type == "cuda":  # finish on this thread's stream before torch DDP reads the bucket
            torch.cuda.current_stream(buffer.device).synchronize()


_RUNNERS: dict[tuple[int, object], _Runner] = {}
_RUNNERS_LOCK = threading.Lock()


def _runner(group: dist.ProcessGroup | None, topology: Any) -> _Runner:
    # Keyed by pid (a forked child must not inherit its parent's thread or buffers) and by the group object
    # itself, the default one resolved (a re-initialised default group gets a new runner), or the topology (a
    # Topology is a value; a DeviceMesh is keyed by identity). The runner keeps its group or mesh alive, so the
    # id cannot be reused meanwhile.
    if topology is not None:
        owner: object = topology
        key: object = topology if isinstance(topology, Topology) else ("mesh", id(topology))
    else:
        owner = group if group is not None else dist.group.WORLD
        key = ("group", id(owner))
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get((os.getpid(), key))
        if runner is None:
            runner = _RUNNERS[os.getpid(), key] = _Runner(group, topology)
            runner.owner = owner
        return runner


def fp32_accumulate_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket with the wire in its dtype and the sum in fp32.

    ``model.register_comm_hook(state=None, hook=fp32_accumulate_hook)``; ``state`` is the process group
    (None = the default group), an :class:`FP32HookState` (the group plus ``audit_every``), or a
    :class:`mixprec.comm.Topology` / 2-D DeviceMesh with dims ("node", "local") over the default group
    for the two-stage multi-node scheme (node partials rounded to the bucket dtype, then summed across nodes
    in fp32: see :func:`mixprec.comm.reduce_scatter_fp32_accumulate` for the bound).

    What runs: ``FP32AccumulateReducer().all_reduce(bucket, average=True)`` on the bucket zero-padded to a
    multiple of ``lcm(world_size, 128)`` (the reducer's contract; padding changes no sum). Wire dtype: the
    bucket's (an all-to-all, then an all-gather: the bytes of a ring all-reduce). Accumulation: fp32 in rank
    order, one division by the group size in fp32, one rounding to the bucket dtype; every element is rounded
    on one rank and all-gathered, so all ranks hold identical bits.

    Returns at once; the future completes when the hook's background thread has reduced the bucket (torch
    DDP waits for it at the end of backward; the buckets are reduced one after another, overlapping the rest
    of backward). Extra memory, kept between steps: the reducer's receive buffer (one bucket in its dtype),
    one padded copy of the largest bucket whose length is not a multiple, 512 KiB of fp32 blocks while a
    shard is summed (the hierarchical scheme: its receive area instead); and, once per process and group, a
    second process group (see the module docstring). On a subgroup (``state`` not spanning the world), the
    ranks of that group must each belong to the same number of process groups when the hook first runs
    (the extra group is created with local synchronisation, whose rendezvous name depends on that count).
    """
    options = state if isinstance(state, FP32HookState) else None
    if options is not None:
        state = options.process_group
    topology = None
    if state is not None and not isinstance(state, dist.ProcessGroup):
        try:
            topology = check_topology(state)  # sizes against the default group too
        except TypeError:
            raise TypeError(
                "state must be a torch.distributed ProcessGroup or None (or, for the two-stage scheme, a "
                f"mixprec.comm.Topology or 2-D DeviceMesh with dims ('node', 'local')); got {type(state).__name__}"
            ) from None
    group = None if topology is not None else check_group("state", state)
    buffer = bucket.buffer()
    if buffer.dtype not in WIRE_DTYPES:
        # Checked before any collective (the second group included), on every rank: all hold this bucket.
        raise TypeError(
            f"fp32_accumulate_hook sums in fp32, so it takes float16, bfloat16 or float32 gradients; this bucket "
            f"holds {buffer.dtype} (parameters of that dtype): use torch DDP's default hook for them"
        )
    runner = _runner(group, topology)
    audit = options._begin(bucket, group) if options is not None else None
    index = bucket.index()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def job() -> None:
        try:
            runner.reduce(buffer, index)
            if audit is not None:
                audit.finish(buffer)
            result.set_result(buffer)
        except BaseException as exc:  # handed to torch DDP, which raises it where it waits
            result.set_exception(exc)

    runner.jobs.put(job)
    return result
