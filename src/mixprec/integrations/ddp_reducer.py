"""One torch DDP communication hook for any registered reducer (``mixprec.comm.make_reducer``).

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(ReducerHookState("uint8", error_feedback=True), reducer_hook)

The hook pads each DDP bucket with zeros into a scratch buffer whose length is a multiple of
``lcm(world_size, 128)`` (the reducer contract), runs ``reducer.all_reduce(..., average=True,
key=bucket.index())``, waits for it and copies the reduced prefix back: the same reducer call, on the same
elements, as mixprec's own ``DistributedDataParallel`` with the same reducer. The trainer adapters
(``mixprec.integrations.accelerate``, ``.lightning``) install it; it has no reduction logic of its own.
``audit_every=N`` runs the live numerics audit (:mod:`mixprec.comm.live_audit`) on one bucket every N
steps; its rows are in ``state.audit_rows`` and go to ``on_audit`` as they come.
"""

# No ``from __future__ import annotations``: torch DDP checks the hook's annotations at registration.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.live_audit import AuditResult
from mixprec.comm.reducer import BucketReducer, bucket_multiple, make_reducer
from mixprec.core.validate import check_group
from mixprec.integrations.hook_audit import AuditedHookState
from mixprec.parallel.reducers import NativeReducer

__all__ = ["ReducerHookState", "reducer_hook"]


class ReducerHookState(AuditedHookState):
    """State of :func:`reducer_hook`: the reducer, the group and one zero-padded scratch buffer per bucket.

    Args:
        reduce: a registered reducer name (``mixprec.comm.registered_reducers()``) or a reducer object
            (the four methods of :class:`mixprec.comm.reducer.BucketReducer`).
        process_group: the DDP process group; None = the default group.
        audit_every: None, or an int N >= 1: at synced steps N, 2N, ... one bucket (index ``(step // N - 1) mod
            buckets``) is also reduced exactly (a sample of at most 65536 elements of it) and the error of the
            reducer's result, and of the backend's own all-reduce beside a non-native reducer, recorded
            (:attr:`audit_results`, :attr:`audit_rows`). Its collectives run on the same group, before the
            bucket's own; the reduction itself is unchanged, bit for bit.
        on_audit: called with each :class:`mixprec.comm.live_audit.AuditResult` as it is recorded, on every
            rank, from inside backward (e.g. ``lambda r: logger.log(r.as_row())`` on rank 0).
        **reducer_options: the reducer factory's options (only with a name).

    Create it after ``torch.distributed.init_process_group`` (RuntimeError otherwise): reducers with
    random streams seed them with the rank.
    """

    def __init__(
        self,
        reduce: Any = "fp32_accumulate",
        *,
        process_group: Any = None,
        audit_every: int | None = None,
        on_audit: Callable[[AuditResult], None] | None = None,
        **reducer_options: Any,
    ) -> None:
        self._init_audit(audit_every, on_audit)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ReducerHookState needs an initialised process group: create it after "
                "torch.distributed.init_process_group (after the framework wrapped the model)"
            )
        self.process_group = check_group("process_group", process_group)
        if isinstance(reduce, str):
            self.reducer: BucketReducer = make_reducer(reduce, **reducer_options)
        elif isinstance(reduce, BucketReducer):
            if reducer_options:
                raise ValueError("reducer options only apply when reduce is a reducer name, not an instance")
            self.reducer = reduce
        else:
            raise TypeError(f"reduce must be a reducer name or a BucketReducer; got {type(reduce).__name__}")
        self.name = reduce if isinstance(reduce, str) else type(reduce).__name__
        self._multiple = bucket_multiple(dist.get_world_size(self.process_group))
        self._scratch: dict[int, torch.Tensor] = {}
        self._numels: dict[int, int] = {}  # bucket index -> its size when last reduced

    def _scratch_for(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        padded = -(-buffer.numel() // self._multiple) * self._multiple
        s = self._scratch.get(index)
        if s is None or s.numel() != padded or s.dtype != buffer.dtype or s.device != buffer.device:
            s = self._scratch[index] = torch.zeros(padded, dtype=buffer.dtype, device=buffer.device)
        return s

    def reduce(self, buffer: torch.Tensor, index: int, *, is_last: bool = False) -> torch.Tensor:
        """Average ``buffer`` (1-D, any length) in place over the group with the reducer; returns it.
        ``is_last``: the step's last bucket (torch DDP's ``bucket.is_last()``: it sizes the audit's rotation)."""
        native = not isinstance(self.reducer, NativeReducer)
        audit = self._begin_audit(buffer, index, is_last=is_last, group=self.process_group, native=native)
        self._reduce(buffer, index)
        if audit is not None:
            audit.finish(buffer)
        return buffer

    def _reduce(self, buffer: torch.Tensor, index: int) -> None:
        # torch DDP rebuilds its buckets after the first iteration: a key whose bucket changed starts afresh.
        forget = getattr(self.reducer, "forget", None)
        if self._numels.get(index, buffer.numel()) != buffer.numel() and callable(forget):
            forget(index)
        self._numels[index] = buffer.numel()
        if buffer.numel() % self._multiple == 0 and buffer.is_contiguous():
            self.reducer.all_reduce(buffer, self.process_group, average=True, key=index).wait()
            return
        scratch = self._scratch_for(index, buffer)
        scratch[: buffer.numel()].copy_(buffer)
        scratch[buffer.numel() :].zero_()  # a reducer may write to the padding: the contract wants it zero
        self.reducer.all_reduce(scratch, self.process_group, average=True, key=index).wait()
        buffer.copy_(scratch[: buffer.numel()])

    def state_dict(self) -> dict[str, Any]:
        return self.reducer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reducer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ReducerHookState({self.name!r})"


def reducer_hook(state: ReducerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` with ``state.reducer`` (key = the bucket's index).

    The reduction finishes inside the hook (a completed future): every collective is issued from the
    backward thread in bucket order, without overlap with the rest of backward.
    """
    if not isinstance(state, ReducerHookState):
        raise TypeError(f"state must be a ReducerHookState; got {type(state).__name__}")
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(state.reduce(bucket.buffer(), bucket.index(), is_last=bucket.is_last()))
    return future
