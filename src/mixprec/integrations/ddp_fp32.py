"""fp32 accumulation for users who keep torch's DistributedDataParallel: an asynchronous comm hook.

:func:`fp32_accumulate_hook` for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``: each
gradient bucket is all-reduced the way :func:`mixprec.comm.all_reduce_fp32_accumulate` does it (wire in
the bucket dtype, fp32 sum in rank order, one rounding) and averaged, as torch's default hook averages. The
FSDP2 counterpart is in :mod:`mixprec.integrations.fsdp2`.

The hook starts the all-to-all and returns; a callback sums, rounds and starts the all-gather on a second
process group (created on the first call with the default group's timeout), where the all-gathers are
issued in bucket order on every rank. Why, and the rules for subgroups: ``docs/comm.md``. With a
:class:`mixprec.comm.Topology` (or 2-D DeviceMesh) as ``state``, the two-stage multi-node scheme of
:mod:`mixprec.comm.hierarchical_fp32` runs instead, on one background thread per topology that takes the
buckets in hook order (so every rank issues the same collectives in the same order).

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

from mixprec.comm.compat import all_gather_flat
from mixprec.comm.fp32_accumulate import all_reduce_fp32_accumulate
from mixprec.comm.fp32_sum import sum_shards_into
from mixprec.comm.groups import new_group
from mixprec.comm.hierarchical_fp32 import area_elements
from mixprec.comm.live_audit import AuditResult, LiveAudit, PendingAudit
from mixprec.comm.padding import pad_flat
from mixprec.comm.topology import Topology, check_topology, resolve_topology
from mixprec.core.dtypes import WIRE_DTYPES
from mixprec.core.validate import check_group

__all__ = ["FP32HookState", "fp32_accumulate_hook"]


class FP32HookState:
    """:func:`fp32_accumulate_hook`'s state when it takes options beyond the group.

    Args:
        process_group: the DDP process group (None = the default group), or for the two-stage scheme a
            :class:`mixprec.comm.Topology` / 2-D DeviceMesh (as the hook's plain ``state``).
        audit_every: None, or an int N >= 1: at synced steps N, 2N, ... one bucket (bucket index
            ``(step // N - 1) mod buckets``) is also reduced exactly, and the error of the fp32-accumulated
            reduction and of the backend's own all-reduce recorded in :attr:`audit_results`
            (:class:`mixprec.comm.live_audit.LiveAudit`). Its collectives run on the autograd thread, on the
            bucket's group (the default group with a topology), before the bucket's own.
    """

    def __init__(self, process_group: Any = None, *, audit_every: int | None = None) -> None:
        self.audit = LiveAudit(audit_every)
        self.process_group = process_group
        self._num_buckets: int | None = None
        self._audit_bucket: int | None = None

    @property
    def audit_results(self) -> list[AuditResult]:
        """This rank's live-audit results, oldest first."""
        return self.audit.results

    def _begin(self, bucket: dist.GradBucket, group: dist.ProcessGroup | None) -> PendingAudit | None:
        index = bucket.index()
        if index == 0:  # torch DDP runs the hook on its buckets in index order: bucket 0 starts a step
            self._audit_bucket = self.audit.new_step(self._num_buckets)
        if bucket.is_last():
            self._num_buckets = index + 1
        if index != self._audit_bucket:
            return None
        return self.audit.begin(bucket.buffer(), group, average=True, native=True, index=index)


class _BufferPool:
    """Reusable 1-D buffers by (dtype, device, length), shared by the backend's callback threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, torch.device, int], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get((dtype, device, numel))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.dtype, buf.device, buf.numel()), []).append(buf)


class _HookContext:
    """Per process and group: the buffer pool and the in-order issue of the all-gathers."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.owner: object = None  # the group this context belongs to (kept alive: see _context)
        self.pool = _BufferPool()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # Called from the hook on the autograd thread, by every rank of the group at its first bucket; see
        # docs/comm.md for why a proper subgroup needs local synchronisation. new_group passes the default
        # group's timeout on, so a peer that is gone makes this fail within it.
        local = len(ranks) != dist.get_world_size()
        self.gather_group = new_group(ranks, use_local_synchronization=local)
        self._lock = threading.Lock()
        self._calls = 0  # hook calls so far: the sequence number of the next bucket
        self._next_gather = 0  # sequence number of the next all-gather to start
        self._ready: dict[int, Callable[[], None]] = {}

    def next_sequence(self) -> int:
        with self._lock:
            seq = self._calls
            self._calls += 1
            return seq

    def gather_in_order(self, seq: int, start: Callable[[], None]) -> None:
        """Run ``start`` (which issues bucket ``seq``'s all-gather) once every earlier bucket's has run."""
        with self._lock:
            self._ready[seq] = start
            while self._next_gather in self._ready:
                self._ready.pop(self._next_gather)()
                self._next_gather += 1


_CONTEXTS: dict[tuple[int, int], _HookContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def _context(group: dist.ProcessGroup | None) -> _HookContext:
    # Keyed by pid (a forked child must not inherit its parent's sequence numbers or buffers) and by the
    # group object itself, the default one resolved: a re-initialised default group gets a new context. The
    # context keeps its group alive, so the id cannot be reused by another group meanwhile.
    resolved = group if group is not None else dist.group.WORLD
    key = (os.getpid(), id(resolved))
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            ctx = _CONTEXTS[key] = _HookContext(group)
            ctx.owner = resolved
        return ctx


class _HierarchicalContext:
    """Per process and topology: the subgroups, one receive area, and the thread that reduces buckets in
    hook order (one at a time, so one area serves them all)."""

    def __init__(self, topology: Any) -> None:
        self.topology = topology
        self.hier = resolve_topology(topology, None)  # every rank, at its first bucket: creates the subgroups
        self.pool = _BufferPool()
        self.area: torch.Tensor | None = None
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="mixprec-fp32-hierarchical", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()

    def area_for(self, numel: int, world: int, like: torch.Tensor) -> torch.Tensor:
        """Called on the worker thread only."""
        need = area_elements(numel // world, world, self.hier.nodes, all_reduce=True)
        area = self.area
        if area is None or area.dtype != like.dtype or area.device != like.device or area.numel() < need:
            area = self.area = torch.empty(need, dtype=like.dtype, device=like.device)
        return area


_HIER_CONTEXTS: dict[tuple[int, object], _HierarchicalContext] = {}


def _hierarchical_context(topology: Any) -> _HierarchicalContext:
    # A Topology is a value (frozen dataclass); a DeviceMesh is keyed by identity and kept alive by its context.
    key = (os.getpid(), topology if isinstance(topology, Topology) else ("mesh", id(topology)))
    with _CONTEXTS_LOCK:
        ctx = _HIER_CONTEXTS.get(key)
        if ctx is None:
            ctx = _HIER_CONTEXTS[key] = _HierarchicalContext(topology)
        return ctx


def _hierarchical_hook(
    topology: Any, bucket: dist.GradBucket, audit: PendingAudit | None
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    ctx = _hierarchical_context(topology)
    world = dist.get_world_size()
    padded_copy: list[torch.Tensor] = []

    def take_padded(numel: int) -> torch.Tensor:
        padded_copy.append(ctx.pool.take(numel, buffer.dtype, buffer.device))
        return padded_copy[0]

    flat, copy_back = pad_flat(buffer, world, buffer=take_padded)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def job() -> None:
        try:
            all_reduce_fp32_accumulate(
                flat, average=True, topology=topology, scratch=ctx.area_for(flat.numel(), world, flat)
            )
            copy_back()
            _sync_stream(buffer.device)
            for buf in padded_copy:
                ctx.pool.give(buf)
            if audit is not None:
                audit.finish(buffer)
            result.set_result(buffer)
        except BaseException as exc:  # handed to torch DDP, which raises it where it waits
            result.set_exception(exc)

    ctx.jobs.put(job)
    return result


def _sync_stream(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def fp32_accumulate_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket with the wire in its dtype and the sum in fp32.

    ``model.register_comm_hook(state=None, hook=fp32_accumulate_hook)``; ``state`` is the process group
    (None = the default group), an :class:`FP32HookState` (the group plus ``audit_every``), or a
    :class:`mixprec.comm.Topology` / 2-D DeviceMesh with dims ("node", "local") over the default group
    for the two-stage multi-node scheme (node partials rounded to the bucket dtype, then summed across nodes
    in fp32: see
    :func:`mixprec.comm.reduce_scatter_fp32_accumulate` for the bound). It reduces the buckets on a
    background thread, one at a time, with one receive area (a quarter of the largest bucket's shard per
    segment) and a pooled padded copy per bucket in flight.

    Wire dtype: the bucket's (an all-to-all, then an all-gather: the bytes of a ring all-reduce).
    Accumulation: fp32 in rank order, one division by the group size in fp32, one rounding to the bucket
    dtype; every element is rounded on one rank and all-gathered, so all ranks hold identical bits.
    Extra memory, per bucket in flight, taken from a pool kept between steps (no allocation per step once
    warm): a receive buffer of the bucket's length in its dtype (returned to the pool as soon as the shard
    is summed), a zero-padded copy when the length is not a multiple of the group size (returned after the
    all-gather), and 512 KiB of fp32 blocks while the shard is summed; and, once per process and group, a
    second process group for the all-gathers (see the module docstring).

    Returns at once; the future completes when the bucket is reduced (torch DDP waits for it at the end
    of backward).

    On a subgroup (``state`` not spanning the world), the ranks of that group must each belong to the same
    number of process groups when the hook first runs (the extra group is created with local
    synchronisation, whose rendezvous name depends on that count). On CUDA the callbacks synchronise their
    stream before they hand buffers back or complete the future (not yet run on a GPU).
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
    audit = options._begin(bucket, group) if options is not None else None
    if topology is not None:
        return _hierarchical_hook(topology, bucket, audit)
    ctx = _context(group)
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    padded_copy: list[torch.Tensor] = []

    def take_padded(numel: int) -> torch.Tensor:
        padded_copy.append(ctx.pool.take(numel, buffer.dtype, buffer.device))
        return padded_copy[0]

    flat, copy_back = pad_flat(buffer, world_size, buffer=take_padded)
    shard = flat.numel() // world_size
    own = flat[rank * shard : (rank + 1) * shard]
    recv = ctx.pool.take(flat.numel(), flat.dtype, flat.device)
    seq = ctx.next_sequence()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def fail(exc: BaseException) -> None:
        if not result.done():
            result.set_exception(exc)

    def after_gather(fut: torch.futures.Future[Any]) -> None:
        try:
            fut.wait()
            copy_back()
            _sync_stream(buffer.device)  # callbacks run on a pool stream: finish before the buffers are reused
            for buf in padded_copy:
                ctx.pool.give(buf)
            if audit is not None:
                audit.finish(buffer)
            result.set_result(buffer)
        except BaseException as exc:
            fail(exc)

    def after_exchange(fut: torch.futures.Future[Any]) -> None:
        error: BaseException | None = None
        try:
            fut.wait()
            sum_shards_into(own, recv.view(world_size, shard), average=True, rounding="nearest", generator=None)
            _sync_stream(buffer.device)
            ctx.pool.give(recv)
        except BaseException as exc:  # the buffer may still be written: it is not returned to the pool
            error = exc

        def start_gather() -> None:
            if error is not None:
                fail(error)
                return
            try:
                work = all_gather_flat(flat, own, ctx.gather_group, async_op=True)
                work.get_future().then(after_gather)
            except BaseException as exc:
                fail(exc)

        # Even after a failure this bucket takes its turn, so later buckets' all-gathers are not held back.
        ctx.gather_in_order(seq, start_gather)

    work = dist.all_to_all_single(recv, flat, group=group, async_op=True)
    work.get_future().then(after_exchange)
    return result
