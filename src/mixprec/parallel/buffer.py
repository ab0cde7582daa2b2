"""The gradient buffer of the data-parallel wrapper: where every gradient lives, and its reduction state.

A :class:`GradBuffer` (after Megatron-Core's param-and-grad buffer) owns the bucket layout
(:mod:`mixprec.parallel.buckets`), one flat gradient buffer per (parameter dtype, gradient dtype), with
sharding the flat parameter buffers and this rank's fp32 gradient shards, and whether a synced backward
has reduced the gradients since the last optimizer step. :class:`DistributedDataParallel` only wires the
backward hooks and asks it to start reductions; :class:`ShardedOptimizer` works on it alone.

Each parameter's slot follows one of three accumulation policies, chosen by the two dtypes: *direct*
(same dtype: ``param.grad`` is a view of the buffer), *wider buffer* (e.g. bf16 parameters, fp32 buffer:
microbatches add up in the buffer) and *narrower wire* (e.g. fp32 parameters, bf16 buffer: microbatches add
up in ``param.grad``, the synced backward rounds the total into the buffer once). Bucket padding is zero
before every reduction and after every finished one, whatever the reducer wrote there. See
``docs/parallel.md``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mixprec.comm.reducer import BucketReducer, ReductionHandle
from mixprec.core.dtypes import WIRE_DTYPES
from mixprec.core.validate import check_bool, check_dtype, check_group
from mixprec.parallel.buckets import BucketLayout, build_layout

__all__ = ["GradBuffer"]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


class _Slot(abc.ABC):
    """One parameter's place in the gradient buffer and how a window of microbatches accumulates there.

    ``fresh``: the slot does not hold this accumulation window's gradient yet.
    """

    def __init__(self, param: torch.Tensor, view: torch.Tensor) -> None:
        self.param = param
        self.view = view
        self.fresh = True

    @abc.abstractmethod
    def accumulate(self, sync: bool) -> None:
        """``param.grad`` has just received a microbatch's gradient (the post-accumulate-grad hook)."""

    @abc.abstractmethod
    def fill_unused(self) -> None:
        """No gradient reached the parameter in this synced backward: the slot must still hold a defined value."""

    @abc.abstractmethod
    def publish(self) -> None:
        """After the all-reduce: hand the reduced gradient to ``param.grad``."""

    def forget_grad(self, set_to_none: bool) -> None:
        """The buffer was zeroed: drop what ``param.grad`` holds outside it."""
        self.param.grad = None


class _DirectSlot(_Slot):
    """Parameter and buffer share the dtype: ``param.grad`` is the slot itself, autograd accumulates there."""

    def accumulate(self, sync: bool) -> None:
        grad = self.param.grad
        if grad is not None and not _same_memory(grad, self.view):
            self.view.copy_(grad)
            self.param.grad = self.view
        self.fresh = False

    def fill_unused(self) -> None:
        grad = self.param.grad
        if grad is None:
            self.view.zero_()
        elif not _same_memory(grad, self.view):
            self.view.copy_(grad)
            self.param.grad = self.view

    def publish(self) -> None:
        grad = self.param.grad
        if grad is None or not _same_memory(grad, self.view):
            self.param.grad = self.view

    def forget_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            self.param.grad = None


class _CopiedSlot(_Slot):
    """Parameter and buffer dtypes differ: the reduced gradient is copied back into ``param.grad``."""

    def __init__(self, param: torch.Tensor, view: torch.Tensor) -> None:
        super().__init__(param, view)
        self._out: torch.Tensor | None = None  # reused param.grad for the reduced gradient

    def publish(self) -> None:
        grad = self.param.grad
        if grad is not None and grad.shape == self.view.shape and grad.is_contiguous():
            grad.copy_(self.view)  # the reduced gradient, in the parameter's dtype, in the same tensor
            return
        if self._out is None:
            self._out = self.view.to(self.param.dtype)
        else:
            self._out.copy_(self.view)
        self.param.grad = self._out


class _WiderBufferSlot(_CopiedSlot):
    """A buffer wider than the parameter (fp32 for bf16/fp16): the microbatches add up in the buffer, in its
    dtype; ``param.grad`` is None between them, so ``optimizer.zero_grad()`` cannot discard the window."""

    def accumulate(self, sync: bool) -> None:
        grad = self.param.grad
        if grad is not None:
            if self.fresh:
                self.view.copy_(grad)  # exact widening
            else:
                self.view.add_(grad)  # microbatch accumulation in the wider buffer dtype
            self.param.grad = None
        self.fresh = False

    def fill_unused(self) -> None:
        if not self.fresh:
            return  # the buffer holds this window's microbatches
        # Nothing accumulated in this window: the slot takes what param.grad holds (torch semantics: an
        # un-zeroed gradient is reduced again), or zero.
        grad = self.param.grad
        if grad is None:
            self.view.zero_()
        else:
            self.view.copy_(grad)
        self.param.grad = None


class _NarrowerWireSlot(_CopiedSlot):
    """A buffer narrower than the parameter (bf16 for fp32): the microbatches add up in ``param.grad`` in the
    parameter's dtype (autograd does it), and the synced backward rounds the window's total into the buffer
    once: one rounding to the wire dtype per step, not one per microbatch."""

    def accumulate(self, sync: bool) -> None:
        grad = self.param.grad
        if grad is not None and sync:
            self.view.copy_(grad)
        self.fresh = False

    def fill_unused(self) -> None:
        # What param.grad holds: this window's microbatches accumulated under no_sync(), or an un-zeroed
        # gradient (torch semantics: it is reduced again).
        grad = self.param.grad
        if grad is None:
            self.view.zero_()
        else:
            self.view.copy_(grad)


def _slot_for(param: torch.Tensor, view: torch.Tensor) -> _Slot:
    """The accumulation policy of one slot: whichever of the two dtypes is wider accumulates the microbatches."""
    if param.dtype == view.dtype:
        return _DirectSlot(param, view)
    if view.dtype.itemsize > param.dtype.itemsize:
        return _WiderBufferSlot(param, view)
    return _NarrowerWireSlot(param, view)


class GradBuffer:
    """Flat gradient storage, bucket layout, shards and reduction state of a data-parallel wrapper.

    Built by :class:`mixprec.parallel.DistributedDataParallel` (``ddp.grad_buffer``), which hands it its
    arguments unchecked; the sharded optimizer takes it. Local: building it issues no collective.

    Args:
        named_params: (name, parameter) pairs of the trainable parameters, each parameter once, all on one
            device; dtypes float16, bfloat16 or float32 (float64 too when ``grad_dtype`` is given).
        group: the data-parallel process group (None = the default group).
        bucket_size: parameter elements per bucket, int >= 1 (a larger parameter gets a bucket of its own).
        grad_dtype: dtype of the gradient buffers and so of the wire: float16, bfloat16 or float32; None =
            each parameter's dtype.
        sharded: also flatten the parameters into buffers laid out like the gradients (each parameter
            becomes a view of them) and keep this rank's fp32 gradient shard of every bucket (ZeRO-1).
        display_names: the name of each parameter in messages (e.g. all names of a tied parameter);
            None = the names of ``named_params``.

    Memory: one element of ``grad_dtype`` per parameter element plus bucket padding (fewer than
    ``lcm(world_size, 128)`` elements per bucket); sharded, as much again in the parameter dtype and
    ``4 / world_size`` bytes of fp32 gradient shard per element.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        group: dist.ProcessGroup | None,
        bucket_size: int,
        grad_dtype: torch.dtype | None,
        sharded: bool,
        display_names: Sequence[str] | None = None,
    ) -> None:
        check_group("group", group)
        if grad_dtype is not None:
            check_dtype("grad_dtype", grad_dtype, WIRE_DTYPES)
        check_bool("sharded", sharded)
        named = list(named_params)
        if not named:
            raise ValueError("module has no parameters that require grad: nothing to reduce")
        for name, p in named:
            _check_param_dtype(name, p, grad_dtype)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device; found {sorted(str(d) for d in devices)}")
        device = next(iter(devices))
        self._group = group
        self._world_size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._sharded = sharded
        self._params = tuple(p for _, p in named)
        self._names = tuple(display_names) if display_names is not None else tuple(n for n, _ in named)
        self._layout = build_layout(named, world_size=self._world_size, bucket_size=bucket_size, grad_dtype=grad_dtype)
        layout = self._layout
        self._grad_buffers = [
            torch.zeros(n, dtype=gdt, device=device) for (_, gdt), n in zip(layout.groups, layout.group_numel)
        ]
        self._buckets = [self._grad_buffers[b.group][b.offset : b.offset + b.numel] for b in layout.buckets]
        self._slots = [_slot_for(p, self._slice(self._grad_buffers, i)) for i, p in enumerate(self._params)]

        # Sharded: parameters become views of flat buffers laid out like the gradients, so the all-gather after
        # the optimizer step writes straight into them; the fp32 gradient shards receive the reduce-scatter.
        self._param_buffers: list[torch.Tensor] = []
        self._shard_offsets: list[int] = []
        self._shard_grads: torch.Tensor | None = None
        if sharded:
            self._flatten_params(device)
            base = 0
            for b in layout.buckets:
                self._shard_offsets.append(base)
                base += b.numel // self._world_size
            self._shard_grads = torch.zeros(base, dtype=torch.float32, device=device)

        with torch.no_grad():
            for slot in self._slots:
                if slot.param.grad is not None and isinstance(slot, _DirectSlot):
                    slot.view.copy_(slot.param.grad)
                    slot.param.grad = slot.view
        self._reduced = False

    def _slice(self, buffers: list[torch.Tensor], i: int) -> torch.Tensor:
        slot = self._layout.slots[i]
        b = self._layout.buckets[slot.bucket]
        start = b.offset + slot.start
        return buffers[b.group][start : start + slot.numel].view(slot.shape)

    @torch.no_grad()
    def _flatten_params(self, device: torch.device) -> None:
        layout = self._layout
        self._param_buffers = [
            torch.zeros(n, dtype=pdt, device=device) for (pdt, _), n in zip(layout.groups, layout.group_numel)
        ]
        for i, p in enumerate(self._params):
            flat = self._slice(self._param_buffers, i)
            flat.copy_(p.detach())
            p.data = flat

    # ------------------------------------------------------------------ layout and storage
    @property
    def layout(self) -> BucketLayout:
        """Buckets, slots and shard pieces (:class:`mixprec.parallel.buckets.BucketLayout`); read-only."""
        return self._layout

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def sharded(self) -> bool:
        return self._sharded

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The trainable parameters, in registration order (slot ``i`` belongs to ``params[i]``)."""
        return self._params

    @property
    def names(self) -> tuple[str, ...]:
        """Each parameter's name for messages (``"a = b"`` for a parameter tied under two names)."""
        return self._names

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket ``k`` of the gradient buffer: 1-D, contiguous, padded (the tensor a reducer gets)."""
        return self._buckets[k]

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in the gradient buffer, in the parameter's shape and the buffer's dtype."""
        return self._slots[i].view

    def bucket_names(self, k: int) -> tuple[str, ...]:
        """Names of the parameters in bucket ``k``, in buffer order."""
        return tuple(self._names[s.index] for s in self._layout.buckets[k].slots)

    @property
    def shard_grads(self) -> torch.Tensor | None:
        """This rank's fp32 gradient shards of every bucket, one after the other (None unless sharded)."""
        return self._shard_grads

    def shard_offset(self, k: int) -> int:
        """Where bucket ``k``'s shard starts in :attr:`shard_grads` (and in a tensor laid out like it)."""
        self._require_sharded()
        return self._shard_offsets[k]

    def shard_grad(self, k: int) -> torch.Tensor:
        """This rank's fp32 gradient shard of bucket ``k`` (a view of :attr:`shard_grads`)."""
        shards = self._require_sharded()
        size = self._layout.buckets[k].numel // self._world_size
        return shards[self._shard_offsets[k] : self._shard_offsets[k] + size]

    def param_bucket(self, k: int) -> torch.Tensor:
        """Bucket ``k`` of the flat parameter buffer (sharded only): the all-gather after a step fills it."""
        self._require_sharded()
        b = self._layout.buckets[k]
        return self._param_buffers[b.group][b.offset : b.offset + b.numel]

    def _require_sharded(self) -> torch.Tensor:
        if self._shard_grads is None:
            raise RuntimeError("this GradBuffer is not sharded: build the wrapper with sharded_optimizer=True")
        return self._shard_grads

    # ------------------------------------------------------------------ accumulation (one policy per slot)
    @torch.no_grad()
    def accumulate(self, i: int, *, sync: bool) -> None:
        """Parameter ``i``'s ``.grad`` has just received a microbatch's gradient; ``sync``: this backward reduces."""
        self._slots[i].accumulate(sync)

    @torch.no_grad()
    def fill_unused(self, i: int) -> None:
        """Parameter ``i`` got no gradient in this synced backward: its slot takes ``.grad`` as it is, or zero."""
        self._slots[i].fill_unused()

    # ------------------------------------------------------------------ reduction
    def find_nonfinite(self, k: int) -> tuple[str, ...] | None:
        """None when bucket ``k``'s parameter elements are all finite, else the names of those holding inf/NaN.

        ``torch.aminmax`` over the bucket (one pass, no allocation, one host sync); padding is not looked at.
        """
        b = self._layout.buckets[k]
        if b.used == 0:
            return None
        lo, hi = torch.aminmax(self._buckets[k][: b.used])  # NaN propagates into both
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return None
        return tuple(self._names[s.index] for s in b.slots if not bool(torch.isfinite(self._slots[s.index].view).all()))

    @torch.no_grad()
    def start_reduction(self, k: int, reducer: BucketReducer, *, average: bool = True) -> ReductionHandle:
        """Start bucket ``k``'s reduction with ``reducer``: an all-reduce in place, or with sharding a
        reduce-scatter into this rank's fp32 shard. The padding is zeroed first, so whatever a reducer left
        there (inf/NaN of an earlier step included) never enters a sum. Every rank must start the same
        buckets in the same order."""
        self.clear_padding(k)
        bucket = self._buckets[k]
        if self._sharded:
            return reducer.reduce_scatter(self.shard_grad(k), bucket, self._group, average=average, key=k)
        return reducer.all_reduce(bucket, self._group, average=average, key=k)

    @torch.no_grad()
    def finish_reduction(self) -> None:
        """Every bucket's reduction has finished: zero the padding, hand the reduced gradients to
        ``param.grad`` (not sharded), mark the gradients reduced and start a new accumulation window."""
        self.clear_padding()
        if not self._sharded:
            for slot in self._slots:
                slot.publish()
        self._reduced = True
        for slot in self._slots:
            slot.fresh = True

    @torch.no_grad()
    def clear_padding(self, k: int | None = None) -> None:
        """Zero the padding of bucket ``k`` (of every bucket when None)."""
        for j in range(self.num_buckets) if k is None else (k,):
            self._buckets[j][self._layout.buckets[j].used :].zero_()

    @property
    def grads_reduced(self) -> bool:
        """Whether a synced backward has reduced the gradients since :meth:`clear_reduced` was last called."""
        return self._reduced

    def clear_reduced(self) -> None:
        """Forget the reduced gradients: the optimizer stepped on them, or a skipped step discards them."""
        self._reduced = False

    @torch.no_grad()
    def zero_grads(self, *, set_to_none: bool = False) -> None:
        """Zero the gradient buffers in place and start a new accumulation window.

        ``param.grad`` tensors that are views of the buffer stay (zeroed) unless ``set_to_none``; the others
        become None (what they held lives in the buffer, or is a finished window's copy).
        """
        for buf in self._grad_buffers:
            buf.zero_()
        for slot in self._slots:
            slot.forget_grad(set_to_none)
            slot.fresh = True

    def __repr__(self) -> str:
        return (
            f"GradBuffer(params={len(self._params)}, buckets={self.num_buckets}, "
            f"elements={sum(self._layout.group_numel)}, sharded={self._sharded})"
        )


def _check_param_dtype(name: str, param: torch.Tensor, grad_dtype: torch.dtype | None) -> None:
    if param.dtype in WIRE_DTYPES or (param.dtype == torch.float64 and grad_dtype is not None):
        return
    if param.dtype == torch.float64:
        raise TypeError(
            f"parameter {name} has dtype torch.float64 and grad_dtype=None would reduce its gradient in it; the "
            "reducers take float16, bfloat16 or float32 buckets: pass grad_dtype=torch.float32"
        )
    raise TypeError(
        f"parameter {name} has dtype {param.dtype}: DistributedDataParallel reduces float16, bfloat16 and float32 "
        "parameters (float64 with grad_dtype set)"
    )
