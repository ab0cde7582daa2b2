"""Bucketed data parallelism whose gradient reduction sends bf16/fp16 and sums in fp32.

Typical loop (one process per rank, ``torch.distributed`` initialised)::

    ddp = DistributedDataParallel(model, reduce="fp32_accumulate", sharded_optimizer=True)
    opt = ddp.make_optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for batch in loader:
        opt.zero_grad()
        scaler.scale(loss_fn(ddp(batch))).backward()   # buckets are reduced while backward runs
        scaler.unscale_(opt); opt.clip_grad_norm_(1.0); scaler.step(opt); scaler.update()

The gradients live in a :class:`mixprec.parallel.GradBuffer`; a hook on every parameter hands each gradient
to it, and each bucket's reduction starts as soon as the bucket is complete, in bucket order on every rank;
gradients are averaged over the group and final when ``backward()`` returns. Details: ``docs/parallel.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.compat import require_initialized
from mixprec.comm.handles import PendingReduction, wait_all
from mixprec.comm.live_audit import (
    AUDIT_SAMPLE_ELEMENTS,
    AuditResult,
    LiveAudit,
    PendingAudit,
    check_audit_every,
)
from mixprec.comm.reducer import BucketReducer, ReductionHandle, make_reducer
from mixprec.core.dtypes import LOW_PRECISION_DTYPES
from mixprec.core.validate import check_bool, check_group
from mixprec.parallel.buckets import DEFAULT_BUCKET_SIZE, BucketLayout
from mixprec.parallel.buffer import GradBuffer
from mixprec.parallel.reducers import NativeReducer
from mixprec.parallel.zero import ShardedOptimizer
from mixprec.scaling import MasterWeightOptimizer

__all__ = ["REDUCER_STATE_FORMAT", "DistributedDataParallel", "NonFiniteBucket", "NonFiniteGradientWarning"]

REDUCER_STATE_FORMAT = "mixprec.ddp_reducer/1"


class NonFiniteGradientWarning(RuntimeWarning):
    """A gradient bucket held inf/NaN before it was sent (see ``DistributedDataParallel.last_nonfinite``)."""


@dataclass(frozen=True)
class NonFiniteBucket:
    """A bucket found to hold inf/NaN on this rank, before reduction, and the parameters responsible."""

    rank: int
    bucket: int
    params: tuple[str, ...]


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper with bucketed, overlapped, fp32-accumulating gradient reduction.

    Args:
        module: the model; its parameters and buffers are broadcast from rank 0 of ``group`` here, after
            checking that every rank holds the same names, shapes and dtypes (ValueError on every rank
            otherwise). Trainable parameters: float16, bfloat16 or float32 (float64 with ``grad_dtype``).
        group: the data-parallel process group (a ``ProcessGroup``); None = the default group.
        bucket_size: parameter elements per bucket, int >= 1 (default 40M, Megatron's); a larger
            parameter gets a bucket of its own. Smaller buckets start reducing earlier in backward.
        reduce: a registered reducer name (``"fp32_accumulate"``, ``"native"``, or ``"uint8"`` /
            ``"uint8_hierarchical"`` from mixprec.compress) or a reducer instance (any object with the
            four methods of :class:`mixprec.comm.reducer.BucketReducer`; a registered one is a :class:`GradReducer`).
        reduce_options: keyword options for the reducer's factory (only with a name).
        grad_dtype: dtype of the gradient buffers and so of the wire: float16, bfloat16 or float32;
            None = each parameter's dtype. E.g. fp32 parameters with ``grad_dtype=torch.bfloat16`` send
            half the bytes; bf16 parameters with ``torch.float32`` accumulate microbatches in fp32.
        overlap: start each bucket's reduction during backward as soon as it is complete; False starts
            them all at the end of backward.
        sharded_optimizer: ZeRO-1: reduce-scatter into fp32 shards and use :meth:`make_optimizer`.
        check_finite: check every bucket for inf/NaN before sending it, warn with
            :class:`NonFiniteGradientWarning` and record :attr:`last_nonfinite` (see ``docs/parallel.md``).
        audit_every: None, or an int N >= 1: at synced steps N, 2N, ... one bucket (``(step // N - 1) mod
            buckets``) is also reduced exactly on a sample of it and the reduction's error there recorded in
            :attr:`audit_results` (:class:`mixprec.comm.live_audit.LiveAudit`: one all-gather of the sample,
            and one native all-reduce of a copy of it beside a non-native reducer); the gradients are unchanged.
        audit_sample: elements of the audited bucket reduced exactly, at most (int >= 1, default 65536): the
            whole bucket when it holds no more, else one segment at the same offset of each rank's shard,
            moving on at each visit of the bucket; None = always the whole bucket (cost grows with it).

    The gradients are averaged over the group. Parameters that no rank used get a zero gradient.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        reduce: str | BucketReducer = "fp32_accumulate",
        reduce_options: dict[str, Any] | None = None,
        grad_dtype: torch.dtype | None = None,
        overlap: bool = True,
        sharded_optimizer: bool = False,
        check_finite: bool = True,
        audit_every: int | None = None,
        audit_sample: int | None = AUDIT_SAMPLE_ELEMENTS,
    ) -> None:
        super().__init__()
        require_initialized("DistributedDataParallel")
        self.audit = LiveAudit(audit_every, sample=check_audit_every(audit_sample, "audit_sample"))
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        # group, bucket_size, grad_dtype and the parameters are checked by GradBuffer, before any collective.
        check_bool("overlap", overlap)
        check_bool("sharded_optimizer", sharded_optimizer)
        check_bool("check_finite", check_finite)
        if isinstance(reduce, str):
            self.reducer: BucketReducer = make_reducer(reduce, **(reduce_options or {}))
        elif isinstance(reduce, BucketReducer):
            if reduce_options:
                raise ValueError("reduce_options only apply when reduce is a reducer name, not an instance")
            self.reducer = reduce
        else:
            raise TypeError(f"reduce must be a reducer name or a GradReducer; got {type(reduce).__name__}")

        self.module = module
        self.group = group
        self.overlap = overlap
        self.sharded = sharded_optimizer
        self.check_finite = check_finite

        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        # One collective compares the models across ranks before any check that could fail on one rank only
        # (a dtype or device the buffer refuses): a mismatch is one ValueError on every rank, not a rank
        # raising alone while the others wait in the collective. The buffer's own checks then fail alike
        # on every rank.
        _verify_same_model_on_every_rank(module, check_group("group", group))
        self.grad_buffer = GradBuffer(
            named,
            group=group,
            bucket_size=bucket_size,
            grad_dtype=grad_dtype,
            sharded=sharded_optimizer,
            display_names=[" = ".join(aliases[id(p)]) for _, p in named],  # tied parameters: every name
        )
        self.world_size = self.grad_buffer.world_size
        self.rank = self.grad_buffer.rank
        self._broadcast_from_rank0()

        n_params = len(named)
        self._ready = [False] * n_params
        self._missing = [len(b.slots) for b in self.layout.buckets]
        self._next_bucket = 0
        self._handles: list[ReductionHandle | None] = [None] * len(self._missing)
        self._callback_queued = False
        self._graph_task = -1
        self._no_sync_depth = 0
        self._require_sync = True
        self.last_nonfinite: list[NonFiniteBucket] = []
        self._audit_bucket: int | None = None

        self_ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)) for i, p in enumerate(self.grad_buffer.params)
        ]

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if self.world_size > 1:
                dist.broadcast(t.data, src=src, group=self.group)

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
    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.is_sparse:
            raise TypeError(
                f"parameter {self.grad_buffer.names[i]} has a sparse gradient; the wrapper reduces dense ones only"
            )
        self.grad_buffer.accumulate(i, sync=self._require_sync)
        if not self._require_sync:
            return
        task = torch._C._current_graph_task_id()
        if not self._callback_queued:
            self._callback_queued = True
            self._graph_task = task
            self.last_nonfinite = []
            self._audit_bucket = self.audit.new_step(self.grad_buffer.num_buckets)
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
                f"parameter {self.grad_buffer.names[i]} received its gradient twice in one synced backward "
                "(several backward() calls on one forward?). Accumulate microbatches under no_sync() instead."
            )
        self._ready[i] = True
        self._missing[self.layout.slots[i].bucket] -= 1
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self._missing) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, k: int) -> None:
        if self.check_finite:
            self._check_bucket_finite(k)
        if k != self._audit_bucket:
            self._handles[k] = self.grad_buffer.start_reduction(k, self.reducer)
            return
        self.grad_buffer.clear_padding(k)  # the padding enters neither sum
        audit = self.audit.begin(
            self.grad_buffer.bucket(k),
            self.group,
            average=True,
            native=not isinstance(self.reducer, NativeReducer),
            index=k,
        )
        self._handles[k] = self._audited(k, self.grad_buffer.start_reduction(k, self.reducer), audit)

    def _audited(self, k: int, handle: ReductionHandle, audit: PendingAudit) -> PendingReduction:
        def finish() -> None:
            handle.wait()
            if self.sharded:
                shard = self.grad_buffer.shard_grad(k)
                audit.finish(shard, offset=self.rank * shard.numel())
            else:
                audit.finish(self.grad_buffer.bucket(k))

        return PendingReduction(finish)

    def _check_bucket_finite(self, k: int) -> None:
        names = self.grad_buffer.find_nonfinite(k)
        if names is None:
            return
        self.last_nonfinite.append(NonFiniteBucket(self.rank, k, names))
        warnings.warn(
            f"rank {self.rank}: gradient bucket {k} holds inf/NaN before reduction, in {', '.join(names)}. "
            "It is reduced anyway (inf/NaN propagate); a loss scaler's agreed overflow check skips this "
            "step on every rank.",
            NonFiniteGradientWarning,
            stacklevel=2,
        )

    def _finalize_backward(self) -> None:
        finished = False
        try:
            for i, ready in enumerate(self._ready):
                if ready:
                    continue
                self.grad_buffer.fill_unused(i)
                self._ready[i] = True
                self._missing[self.layout.slots[i].bucket] -= 1
            for k in range(self._next_bucket, len(self._missing)):
                self._launch(k)
            self._next_bucket = len(self._missing)
            wait_all(self._handles)
            self.grad_buffer.finish_reduction()
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
        # Every started reduction has been waited for: a failed one (a non-finite bucket refused by the
        # reducer, say) must not leave its leftovers in the padding either.
        self.grad_buffer.clear_padding()
        self._ready = [False] * len(self._ready)
        self._missing = [len(b.slots) for b in self.layout.buckets]
        self._next_bucket = 0
        self._handles = [None] * len(self._missing)
        self._callback_queued = False

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
        groups = list(param_groups) if param_groups is not None else [{"params": list(self.grad_buffer.params)}]
        if self.sharded:
            return ShardedOptimizer(self.grad_buffer, optimizer_cls, groups, **optimizer_kwargs)
        if any(p.dtype in LOW_PRECISION_DTYPES for g in groups for p in g["params"]):
            return MasterWeightOptimizer(groups, optimizer_cls, **optimizer_kwargs)
        return optimizer_cls(groups, **optimizer_kwargs)

    def zero_grad_buffers(self) -> None:
        """Zero every gradient buffer in place (``param.grad`` views stay valid; the other ``param.grad``
        become None) and start a new accumulation window. Discards microbatches accumulated under
        ``no_sync()`` in a wider buffer, which ``optimizer.zero_grad()`` does not see."""
        self.grad_buffer.zero_grads()

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
    def audit_results(self) -> list[AuditResult]:
        """This rank's live-audit results, oldest first (``audit_every``); ``result.as_row()`` gives the
        ``audit_*`` fields of a metrics row."""
        return self.audit.results

    @property
    def found_nonfinite(self) -> bool:
        """Whether this rank's last synced backward sent a bucket holding inf/NaN."""
        return bool(self.last_nonfinite)

    @property
    def layout(self) -> BucketLayout:
        """The bucket layout of :attr:`grad_buffer` (read-only)."""
        return self.grad_buffer.layout

    @property
    def shard_grads(self) -> torch.Tensor | None:
        """This rank's fp32 gradient shards (``sharded_optimizer=True``), else None."""
        return self.grad_buffer.shard_grads

    def bucket_params(self) -> list[tuple[str, ...]]:
        """Names of the parameters in each bucket, in bucket (launch) order."""
        return [self.grad_buffer.bucket_names(k) for k in range(self.grad_buffer.num_buckets)]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module keeps working, without reduction)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, buckets={self.grad_buffer.num_buckets}, reducer={self.reducer!r}, "
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


def _describe(module: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """(kind, name, shape, dtype, requires_grad) of every tensor the wrapper broadcasts and reduces."""
    out = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    out += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return out


def _first_difference(descriptions: list[Any]) -> str:
    """One line naming the first rank whose module differs from rank 0's, and how."""
    ref = descriptions[0]
    for rank, desc in enumerate(descriptions[1:], start=1):
        if desc == ref:
            continue
        prefix = "DistributedDataParallel needs the same module on every rank"
        for a, b in zip(ref, desc, strict=False):
            if a != b:
                return (
                    f"{prefix}: rank 0 has {a[0]} {a[1]} of shape {a[2]}, {a[3]}"
                    f"{', requires_grad' if a[4] else ''}; rank {rank} has {b[0]} {b[1]} of shape {b[2]}, "
                    f"{b[3]}{', requires_grad' if b[4] else ''}"
                )
        return f"{prefix}: rank 0 has {len(ref)} parameters and buffers, rank {rank} has {len(desc)}"
    return "DistributedDataParallel needs the same module on every rank"  # digests differed, descriptions not


def _verify_same_model_on_every_rank(module: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Refuse, on every rank, a module whose parameters or buffers differ between ranks (as torch DDP's
    ``_verify_param_shape_across_processes``): one all-gather of a 32-byte digest; the full descriptions
    are gathered only to name the difference."""
    if not dist.is_initialized():
        return  # the buffer raises the clear "init_process_group first" error
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    description = _describe(module)
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, hashlib.sha256(repr(description).encode()).digest(), group=group)
    if all(d == digests[0] for d in digests):
        return
    descriptions: list[Any] = [None] * world_size
    dist.all_gather_object(descriptions, description, group=group)
    raise ValueError(_first_difference(descriptions))
