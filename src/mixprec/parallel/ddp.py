"""Bucketed data parallelism whose gradient reduction sends bf16/fp16 and sums in fp32.

Typical loop (one process per rank, ``torch.distributed`` initialised)::

    ddp = DistributedDataParallel(model, reduce="fp32_accumulate", sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    scaler = mixprec.DynamicLossScaler()
    for batch in loader:
        opt.zero_grad()
        loss = loss_fn(ddp(batch))                 # mean over this rank's batch
        scaler.scale(loss).backward()             # buckets are reduced while backward runs
        scaler.unscale_(opt)
        opt.clip_grad_norm_(1.0)                  # global norm, fp32, agreed over the group
        scaler.step(opt)                          # skipped on every rank if any rank overflowed
        scaler.update()

How gradients move. All parameters that require grad get their gradient a fixed place in a flat buffer
(one per (parameter dtype, gradient dtype); see :mod:`mixprec.parallel.buckets`), cut into buckets padded
to a multiple of ``lcm(world_size, 128)``. A post-accumulate-grad hook on every parameter puts its
gradient in place (when ``param.grad`` is not already a view of the buffer it is copied in, and, when the
dtypes agree, ``param.grad`` becomes that view so later microbatches accumulate straight into the
buffer). When every parameter of a bucket is ready, the bucket's reduction starts asynchronously
(``overlap=True``), buckets strictly in index order so that every rank issues the same collectives in the
same order. At the end of backward (an autograd engine callback), parameters that got no gradient are
marked ready (their slots hold zero, or what ``param.grad`` already held), the remaining buckets start,
and all reductions are waited for, so gradients are final when ``backward()`` returns.

Result: gradients are averaged over the group (the mean of the ranks' gradients), reduced by the chosen
reducer. With ``sharded_optimizer=False`` each ``param.grad`` holds the reduced gradient (in the
parameter's dtype; a view of the buffer when ``grad_dtype`` is the parameter's dtype). With
``sharded_optimizer=True`` buckets are reduce-scattered straight into this rank's fp32 gradient shard
(no rounding to the wire dtype at all with ``"fp32_accumulate"``) and ``param.grad`` keeps the local,
unreduced gradient (with the built-in ``"native"`` and ``"fp32_accumulate"`` reducers; the reducer contract
lets another reducer's ``reduce_scatter`` use the bucket as scratch); the optimizer from
:meth:`make_optimizer` steps fp32 master weights of the shard and all-gathers the parameters.

Memory: the gradient buffers (one element of ``grad_dtype`` per parameter element, plus bucket padding);
the reducer's receive buffers ("fp32_accumulate": at most ``max_in_flight``, default 2, buffers of one
bucket each in the wire dtype) and 512 KiB of fp32 blocks while a bucket is summed; with ``grad_dtype`` different
from the parameter dtype, ``param.grad`` is a separate tensor in the parameter dtype. Sharded: the
parameters become views of flat buffers (do not call ``.to()``/``.half()`` on the module afterwards) and
the fp32 gradient shard holds ``1/world_size`` of the elements.

With ``grad_dtype`` different from the parameter dtype, microbatches under ``no_sync()`` accumulate in the
wider of the two dtypes. A narrower wire (fp32 parameters, bf16 ``grad_dtype``): in ``param.grad``, in the
parameter's dtype, as without the wrapper; the synced backward rounds the window's total into the bucket
once (one rounding to the wire dtype per step, not one per microbatch). A wider buffer (bf16 parameters,
fp32 ``grad_dtype``): in the buffer, in fp32; ``param.grad`` is None between microbatches, so
``optimizer.zero_grad()`` does not discard them before the window's synced backward, and
``ddp.zero_grad_buffers()`` does (the sharded optimizer's ``zero_grad`` calls it). Without sharding,
``param.grad`` then receives the reduced gradient in the parameter's dtype, in a tensor reused from step to
step.

Not supported: reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``; a
clear error says so), sparse gradients, parameters on several devices.

Non-finite gradients (``check_finite=True``): before a bucket is sent, ``torch.aminmax`` over it (one pass,
no allocation, one host sync per bucket) tells whether it holds inf/NaN; if so, the parameters holding
them are named in a :class:`NonFiniteGradientWarning` and recorded in :attr:`last_nonfinite`. The bucket
is still sent (every rank must take part in the collective) and the reducers propagate inf/NaN, so a
loss scaler's overflow check after backward, which is agreed across ranks, skips the step on every rank.
Without a loss scaler the warning is the report; the gradients stay non-finite, as they are.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.compat import require_initialized
from mixprec.comm.handles import wait_all
from mixprec.comm.reducer import GradReducer, ReductionHandle, make_reducer
from mixprec.core.dtypes import LOW_PRECISION_DTYPES, WIRE_DTYPES
from mixprec.core.validate import check_bool, check_dtype, check_positive_int
from mixprec.parallel.buckets import BucketLayout, build_layout

__all__ = ["REDUCER_STATE_FORMAT", "DistributedDataParallel", "NonFiniteBucket", "NonFiniteGradientWarning"]

REDUCER_STATE_FORMAT = "mixprec.ddp_reducer/1"

_GRAD_DTYPES = WIRE_DTYPES


class NonFiniteGradientWarning(RuntimeWarning):
    """A gradient bucket held inf/NaN before it was sent (see ``DistributedDataParallel.last_nonfinite``)."""


@dataclass(frozen=True)
class NonFiniteBucket:
    """A bucket found to hold inf/NaN on this rank, before reduction, and the parameters responsible."""

    rank: int
    bucket: int
    params: tuple[str, ...]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper with bucketed, overlapped, fp32-accumulating gradient reduction.

    Args:
        module: the model; its parameters and buffers are broadcast from rank 0 of ``group`` here.
        group: the data-parallel process group; None = the default group.
        bucket_size: parameter elements per bucket, int >= 1 (default 40M, Megatron's); a larger
            parameter gets a bucket of its own. Smaller buckets start reducing earlier in backward.
        reduce: a registered reducer name (``"fp32_accumulate"``, ``"native"``, or ``"uint8"`` /
            ``"uint8_hierarchical"`` from mixprec.compress) or a :class:`GradReducer` instance.
        reduce_options: keyword options for the reducer's factory (only with a name).
        grad_dtype: dtype of the gradient buffers and so of the wire: float16, bfloat16 or float32;
            None = each parameter's dtype. E.g. fp32 parameters with ``grad_dtype=torch.bfloat16`` send
            half the bytes; bf16 parameters with ``torch.float32`` accumulate microbatches in fp32.
        overlap: start each bucket's reduction during backward as soon as it is complete; False starts
            them all at the end of backward.
        sharded_optimizer: ZeRO-1: reduce-scatter into fp32 shards and use :meth:`make_optimizer`.
        check_finite: check every bucket for inf/NaN before sending it (see the module docstring).

    The gradients are averaged over the group. Parameters that no rank used get a zero gradient.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_size: int = 40_000_000,
        reduce: str | GradReducer = "fp32_accumulate",
        reduce_options: dict[str, Any] | None = None,
        grad_dtype: torch.dtype | None = None,
        overlap: bool = True,
        sharded_optimizer: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        require_initialized("DistributedDataParallel")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        check_positive_int("bucket_size", bucket_size)
        if grad_dtype is not None:
            check_dtype("grad_dtype", grad_dtype, _GRAD_DTYPES)
        check_bool("overlap", overlap)
        check_bool("sharded_optimizer", sharded_optimizer)
        check_bool("check_finite", check_finite)
        if isinstance(reduce, str):
            self.reducer: GradReducer = make_reducer(reduce, **(reduce_options or {}))
        elif isinstance(reduce, GradReducer):
            if reduce_options:
                raise ValueError("reduce_options only apply when reduce is a reducer name, not an instance")
            self.reducer = reduce
        else:
            raise TypeError(f"reduce must be a reducer name or a GradReducer; got {type(reduce).__name__}")

        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        self.sharded = sharded_optimizer
        self.check_finite = check_finite
        self._broadcast_from_rank0()

        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("module has no parameters that require grad: nothing to reduce")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device; found {sorted(str(d) for d in devices)}")
        self._params: list[torch.Tensor] = [p for _, p in named]
        # Tied parameters are one tensor under several names: report them all.
        self._names = [" = ".join(aliases[id(p)]) for _, p in named]
        self.layout: BucketLayout = build_layout(
            named, world_size=self.world_size, bucket_size=bucket_size, grad_dtype=grad_dtype
        )
        device = next(iter(devices))
        self._grad_buffers = [
            torch.zeros(n, dtype=gdt, device=device)
            for (_, gdt), n in zip(self.layout.groups, self.layout.group_numel, strict=True)
        ]
        self._bucket_tensors = [self._grad_buffers[b.group][b.offset : b.offset + b.numel] for b in self.layout.buckets]
        self._grad_views: list[torch.Tensor] = []
        for slot in self.layout.slots:
            b = self.layout.buckets[slot.bucket]
            start = b.offset + slot.start
            self._grad_views.append(self._grad_buffers[b.group][start : start + slot.numel].view(slot.shape))
        self._direct = [p.dtype == v.dtype for p, v in zip(self._params, self._grad_views, strict=True)]
        # A gradient buffer wider than the parameter (fp32 for fp16/bf16 parameters) accumulates the microbatches
        # itself, in its dtype; otherwise param.grad accumulates them in the parameter's dtype and the synced
        # backward rounds the total into the buffer once. Either way, the wider of the two dtypes accumulates.
        self._widen = [
            not d and v.dtype.itemsize > p.dtype.itemsize
            for p, v, d in zip(self._params, self._grad_views, self._direct, strict=True)
        ]
        # Reused param.grad tensors for the reduced gradient when it is not a view of the buffer.
        self._grad_out: list[torch.Tensor | None] = [None] * len(self._params)

        # Sharded mode: parameters become views of flat buffers laid out like the gradients, so the
        # all-gather after the optimizer step writes straight into them; fp32 gradient shards receive
        # the reduce-scatter.
        self._param_buffers: list[torch.Tensor] = []
        self._shard_base: list[int] = []
        self.shard_grads: torch.Tensor | None = None
        if self.sharded:
            self._flatten_params(device)
            base = 0
            for b in self.layout.buckets:
                self._shard_base.append(base)
                base += b.numel // self.world_size
            self.shard_grads = torch.zeros(base, dtype=torch.float32, device=device)

        with torch.no_grad():
            for i, p in enumerate(self._params):
                if p.grad is not None and self._direct[i]:
                    self._grad_views[i].copy_(p.grad)
                    p.grad = self._grad_views[i]

        n_params, n_buckets = len(self._params), len(self.layout.buckets)
        self._fresh = [True] * n_params  # slot does not hold this accumulation window's gradient yet
        self._ready = [False] * n_params
        self._missing = [len(b.slots) for b in self.layout.buckets]
        self._next_bucket = 0
        self._handles: list[ReductionHandle | None] = [None] * n_buckets
        self._callback_queued = False
        self._graph_task = -1
        self._no_sync_depth = 0
        self._require_sync = True
        self._grads_reduced = False
        self.last_nonfinite: list[NonFiniteBucket] = []

        self_ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)) for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if self.world_size > 1:
                dist.broadcast(t.data, src=src, group=self.group)

    @torch.no_grad()
    def _flatten_params(self, device: torch.device) -> None:
        self._param_buffers = [
            torch.zeros(n, dtype=pdt, device=device)
            for (pdt, _), n in zip(self.layout.groups, self.layout.group_numel, strict=True)
        ]
        for slot, p in zip(self.layout.slots, self._params, strict=True):
            b = self.layout.buckets[slot.bucket]
            start = b.offset + slot.start
            flat = self._param_buffers[b.group][start : start + slot.numel]
            flat.copy_(p.detach().reshape(-1))
            p.data = flat.view(slot.shape)

    # ------------------------------------------------------------------ forward / no_sync
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module. Whether the next backward reduces is decided here, as in torch DDP."""
        if self._callback_queued:
            self._abandon_backward()
        self._require_sync = self._no_sync_depth == 0
        return self.module(*args, **kwargs)

    def _abandon_backward(self) -> None:
        """A backward raised before its end: finish what it launched (every rank launched the same
        buckets, in order) and start clean, rather than never reducing again."""
        try:
            wait_all(self._handles)
        finally:
            self._reset_backward_state()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward passes run inside accumulate gradients locally; the next synced backward reduces them all."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # ------------------------------------------------------------------ backward machinery
    @torch.no_grad()
    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        view = self._grad_views[i]
        grad = param.grad
        if grad is not None and grad.is_sparse:
            raise TypeError(f"parameter {self._names[i]} has a sparse gradient; the wrapper reduces dense ones only")
        if grad is not None:
            if self._direct[i]:
                if not _same_memory(grad, view):
                    view.copy_(grad)
                    param.grad = view
            elif self._widen[i]:
                if self._fresh[i]:
                    view.copy_(grad)  # exact widening
                else:
                    view.add_(grad)  # microbatch accumulation in the wider buffer dtype
                param.grad = None
            elif self._require_sync:
                # param.grad holds the whole accumulation window in the parameter's dtype (autograd added the
                # microbatches there): one rounding to the wire dtype per step, not one per microbatch.
                view.copy_(grad)
        self._fresh[i] = False
        if not self._require_sync:
            return
        task = torch._C._current_graph_task_id()
        if not self._callback_queued:
            self._callback_queued = True
            self._graph_task = task
            self.last_nonfinite = []
            torch.autograd.Variable._execution_engine.queue_callback(_make_finalizer(weakref.ref(self)))
        elif task != self._graph_task:
            # A nested backward (reentrant checkpointing) would finish before the outer one and end the
            # reduction early, with the outer backward's gradients still missing.
            raise RuntimeError(
                "a nested backward pass (torch.utils.checkpoint with use_reentrant=True?) produced gradients "
                "inside a synced backward; DistributedDataParallel needs use_reentrant=False"
            )
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self._names[i]} received its gradient twice in one synced backward (several "
                "backward() calls on one forward?). Accumulate microbatches under no_sync() instead."
            )
        self._ready[i] = True
        bucket = self.layout.slots[i].bucket
        self._missing[bucket] -= 1
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self._missing) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, k: int) -> None:
        bucket = self._bucket_tensors[k]
        if self.check_finite:
            self._check_bucket_finite(k)
        if self.sharded:
            shard = self._shard_grad(k)
            self._handles[k] = self.reducer.reduce_scatter(shard, bucket, self.group, average=True, key=k)
        else:
            self._handles[k] = self.reducer.all_reduce(bucket, self.group, average=True, key=k)

    def _shard_grad(self, k: int) -> torch.Tensor:
        if self.shard_grads is None:
            raise RuntimeError("internal error: shard gradients exist only with sharded_optimizer=True")
        size = self.layout.buckets[k].numel // self.world_size
        return self.shard_grads[self._shard_base[k] : self._shard_base[k] + size]

    def _check_bucket_finite(self, k: int) -> None:
        lo, hi = torch.aminmax(self._bucket_tensors[k])  # NaN propagates into both; one pass, no temporaries
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
        names = tuple(
            self._names[s.index]
            for s in self.layout.buckets[k].slots
            if not bool(torch.isfinite(self._grad_views[s.index]).all())
        )
        self.last_nonfinite.append(NonFiniteBucket(self.rank, k, names))
        warnings.warn(
            f"rank {self.rank}: gradient bucket {k} holds inf/NaN before reduction, in {', '.join(names)}. "
            "It is reduced anyway (inf/NaN propagate); a loss scaler's agreed overflow check skips this "
            "step on every rank.",
            NonFiniteGradientWarning,
            stacklevel=2,
        )

    @torch.no_grad()
    def _finalize_backward(self) -> None:
        finished = False
        try:
            for i, param in enumerate(self._params):
                if self._ready[i]:
                    continue
                self._fill_unused(i, param)
                self._ready[i] = True
                self._missing[self.layout.slots[i].bucket] -= 1
            for k in range(self._next_bucket, len(self._missing)):
                self._launch(k)
            self._next_bucket = len(self._missing)
            wait_all(self._handles)
            if not self.sharded:
                for i, param in enumerate(self._params):
                    view = self._grad_views[i]
                    grad = param.grad
                    if self._direct[i]:
                        if grad is None or not _same_memory(grad, view):
                            param.grad = view
                    elif grad is not None and grad.shape == view.shape and grad.is_contiguous():
                        grad.copy_(view)  # the reduced gradient, in the parameter's dtype, in the same tensor
                    else:
                        out = self._grad_out[i]
                        if out is None:
                            out = self._grad_out[i] = view.to(param.dtype)
                        else:
                            out.copy_(view)
                        param.grad = out
            self._grads_reduced = True
            self._fresh = [True] * len(self._params)
            finished = True
        finally:
            if not finished:
                # A launch or a wait raised: still finish every reduction this rank started (the other
                # ranks started the same ones), so none is left to complete later at a point where the
                # other ranks issue different collectives. The first error is already propagating.
                with contextlib.suppress(Exception):
                    wait_all(self._handles)
            self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        self._ready = [False] * len(self._params)
        self._missing = [len(b.slots) for b in self.layout.buckets]
        self._next_bucket = 0
        self._handles = [None] * len(self._missing)
        self._callback_queued = False

    def _fill_unused(self, i: int, param: torch.Tensor) -> None:
        """A parameter that got no gradient in this backward: its slot must still hold a defined value."""
        view = self._grad_views[i]
        grad = param.grad
        if self._direct[i]:
            if grad is None:
                view.zero_()
            elif not _same_memory(grad, view):
                view.copy_(grad)
                param.grad = view
        elif self._widen[i]:
            if self._fresh[i]:
                # Nothing accumulated in this window: the slot takes what param.grad holds (torch semantics:
                # an un-zeroed gradient is reduced again), or zero.
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                param.grad = None
        elif grad is None:
            view.zero_()
        else:
            # What param.grad holds: microbatches of this window accumulated under no_sync(), or an un-zeroed
            # gradient (torch semantics: it is reduced again).
            view.copy_(grad)

    # ------------------------------------------------------------------ optimizer support
    def make_optimizer(
        self,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        /,
        param_groups: Iterable[dict[str, Any]] | None = None,
        **optimizer_kwargs: Any,
    ) -> Any:
        """The optimizer to use with this wrapper.

        With ``sharded_optimizer=True``: a :class:`mixprec.parallel.ShardedOptimizer` (fp32 masters and
        optimizer state for this rank's shard only). Otherwise: ``optimizer_cls`` itself on the module's
        parameters, wrapped in :class:`mixprec.MasterWeightOptimizer` when any parameter is fp16/bf16.

        Args:
            optimizer_cls: a torch optimizer class (or a callable taking param groups and kwargs).
            param_groups: optional list of dicts ``{"params": [module parameters], **options}``;
                None = one group with every parameter that requires grad.
            **optimizer_kwargs: lr, betas, weight_decay, ...
        """
        groups = list(param_groups) if param_groups is not None else [{"params": list(self._params)}]
        if self.sharded:
            from mixprec.parallel.zero import ShardedOptimizer

            return ShardedOptimizer(self, optimizer_cls, groups, **optimizer_kwargs)
        if any(p.dtype in LOW_PRECISION_DTYPES for g in groups for p in g["params"]):
            from mixprec.scaling import MasterWeightOptimizer

            return MasterWeightOptimizer(groups, optimizer_cls, **optimizer_kwargs)
        return optimizer_cls(groups, **optimizer_kwargs)

    @torch.no_grad()
    def zero_grad_buffers(self) -> None:
        """Zero every gradient buffer in place (``param.grad`` views stay valid)."""
        for buf in self._grad_buffers:
            buf.zero_()
        for i, p in enumerate(self._params):
            if not self._direct[i]:
                p.grad = None
        self._fresh = [True] * len(self._params)

    # ------------------------------------------------------------------ reducer state (per rank)
    def reducer_state_dict(self) -> dict[str, Any]:
        """This rank's reducer state, for checkpoints: it differs from rank to rank, so save one per rank.

        What it holds depends on the reducer: ``"fp32_accumulate"`` with stochastic rounding, the rank's
        generator state; ``"uint8"`` with error feedback, the rank's per-bucket residuals (``4 x bucket
        length`` bytes each). Returns ``{"format", "rank", "world_size", "reducer", "state"}``: plain
        tensors and Python scalars, loadable with ``torch.load(..., weights_only=True)``. Tensors are the
        reducer's own (not copied to the CPU). Local: no collective.

        Typical use: ``torch.save(ddp.reducer_state_dict(), f"reducer_rank{rank}.pt")`` on every rank, or
        ``dist.all_gather_object`` the dicts to one rank and save the list.
        """
        return {
            "format": REDUCER_STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "reducer": type(self.reducer).__name__,
            "state": self.reducer.state_dict(),
        }

    def load_reducer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`reducer_state_dict` returned on this same rank, at the same world size.

        Refused (ValueError) when it was saved by another rank, at another world size (the residuals follow
        the bucket layout, which depends on it; start such a run without reducer state), or by another
        reducer type; RuntimeError while a backward's reductions are in flight. Local: no collective.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != REDUCER_STATE_FORMAT:
            raise ValueError(
                f"state_dict must come from DistributedDataParallel.reducer_state_dict() (format "
                f"{REDUCER_STATE_FORMAT!r})"
            )
        if self._callback_queued:
            raise RuntimeError("load_reducer_state_dict() during a backward pass; call it between steps")
        if state_dict.get("world_size") != self.world_size:
            raise ValueError(
                f"reducer state was saved at world size {state_dict.get('world_size')}, this run has "
                f"{self.world_size}: per-rank reducer state does not carry over; start without it"
            )
        if state_dict.get("rank") != self.rank:
            raise ValueError(
                f"reducer state was saved by rank {state_dict.get('rank')}; this is rank {self.rank} "
                "(load each rank's own state)"
            )
        if state_dict.get("reducer") != type(self.reducer).__name__:
            raise ValueError(
                f"reducer state was saved by a {state_dict.get('reducer')}; this wrapper uses a "
                f"{type(self.reducer).__name__}"
            )
        self.reducer.load_state_dict(state_dict["state"])

    # ------------------------------------------------------------------ introspection
    @property
    def found_nonfinite(self) -> bool:
        """Whether this rank's last synced backward sent a bucket holding inf/NaN."""
        return bool(self.last_nonfinite)

    def bucket_params(self) -> list[tuple[str, ...]]:
        """Names of the parameters in each bucket, in bucket (launch) order."""
        return [tuple(self._names[s.index] for s in b.slots) for b in self.layout.buckets]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module keeps working, without reduction)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, buckets={len(self.layout.buckets)}, reducer={self.reducer!r}, "
            f"sharded_optimizer={self.sharded}, overlap={self.overlap}"
        )


def _make_hook(ref: weakref.ref[DistributedDataParallel], i: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: a dropped wrapper must not keep reducing through hooks left on the module.
    def hook(param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad_ready(i, param)

    return hook


def _make_finalizer(ref: weakref.ref[DistributedDataParallel]) -> Callable[[], None]:
    def finalize() -> None:
        ddp = ref()
        if ddp is not None:
            ddp._finalize_backward()

    return finalize
