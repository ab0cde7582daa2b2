"""ZeRO-1 (Megatron's distributed optimizer): fp32 master weights and optimizer state for one shard per rank.

Each bucket of a sharded :class:`mixprec.parallel.GradBuffer` (``DistributedDataParallel(...,
sharded_optimizer=True)``) splits into ``world_size`` equal shards; rank r owns shard r of every bucket,
keeps fp32 master weights for its elements and runs the inner optimizer on them. The reduce-scatter during
backward writes the averaged gradient of exactly those elements into the buffer's fp32 gradient shards.
After the step each rank rounds its masters to the model dtype (once, to nearest) and the buckets are
all-gathered in the model dtype straight into the parameters.

The inner optimizer sees 1-D pieces, one per parameter part in the shard: elementwise optimizers (SGD,
Adam, AdamW, Adagrad, RMSprop, ...) behave exactly as on full tensors; ones that look at a whole tensor
(LAMB, Adafactor, LBFGS) are not supported. Memory per rank: ``4 * numel / world_size`` bytes each for
masters and gradient shard, plus the inner optimizer's state for the shard. More in ``docs/parallel.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.compat import all_gather_flat
from mixprec.comm.objects import gather_objects
from mixprec.core.validate import check_bool, check_norm_type, check_positive_float
from mixprec.parallel.buckets import ShardPiece
from mixprec.parallel.buffer import GradBuffer
from mixprec.scaling.master import clip_coefficient

__all__ = ["CHECKPOINT_FORMAT", "ShardedOptimizer"]

CHECKPOINT_FORMAT = "mixprec.sharded_optimizer/1"


class ShardedOptimizer:
    """fp32 masters + optimizer state for this rank's shard; build it with ``ddp.make_optimizer(...)``.

    Surface: ``param_groups`` / ``state`` (the inner optimizer's, over fp32 pieces), ``zero_grad``,
    ``step``, ``clip_grad_norm_``, ``grad_norm``, ``state_dict``/``load_state_dict`` (a full, world-size
    independent checkpoint, gathered onto rank 0) and ``mixprec_prepare_grads_`` /
    ``mixprec_discard_grads_`` (called by mixprec's loss scalers). LR
    schedulers take ``opt.optimizer``, the inner torch optimizer.

    With a loss scaler: ``scaler.unscale_(opt)`` unscales this rank's fp32 gradient shard and records
    whether it holds inf/NaN; the scaler agrees on the flag across the group, so every rank skips (or
    steps) together. Clipping takes the global norm from all shards (fp32, one all-reduce).
    """

    def __init__(
        self,
        buffer: GradBuffer,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        **optimizer_kwargs: Any,
    ) -> None:
        """Build the fp32 masters of this rank's shard and the inner optimizer over them (local, no collective).

        Args:
            buffer: the wrapper's gradient buffer (``ddp.grad_buffer``), built with ``sharded_optimizer=True``
                (else ValueError).
            optimizer_cls: a torch optimizer class, or any callable taking param groups and keyword options;
                elementwise optimizers only (see the module docstring).
            param_groups: dicts ``{"params": [module parameters], **options}``; each trainable parameter at
                most once (ValueError otherwise, or for a tensor that is not one of the module's trainable
                parameters). Parameters in no group are not updated: they keep their values.
            **optimizer_kwargs: default options for ``optimizer_cls`` (lr, betas, weight_decay, ...).

        Memory: ``4 * shard`` bytes of fp32 masters (the masters are exact copies of this rank's part of the
        parameters), plus the inner optimizer's state, created on its first step.
        """
        if not isinstance(buffer, GradBuffer):
            raise TypeError(
                "buffer must be a mixprec.parallel.GradBuffer (ddp.grad_buffer), or build the optimizer with "
                f"ddp.make_optimizer(...); got {type(buffer).__name__}"
            )
        if not buffer.sharded or buffer.shard_grads is None:
            raise ValueError("ShardedOptimizer needs DistributedDataParallel(..., sharded_optimizer=True)")
        self.buffer = buffer
        layout = buffer.layout
        rank = buffer.rank
        group_of = _group_of(buffer, param_groups)
        members: list[list[int]] = [[] for _ in param_groups]
        for i, g in sorted(group_of.items()):
            members[g].append(i)
        self._group_names = [[buffer.names[i] for i in idx] for idx in members]

        self.master = torch.zeros_like(buffer.shard_grads)
        # Every piece of this rank's shard, in buffer order. The masters of all of them hold the parameter's
        # value, also for parameters in no group: the all-gather after each step writes the whole shard back
        # into the parameters, so a piece left at zero would zero its parameter.
        self._all_pieces: list[tuple[int, ShardPiece]] = [
            (bucket.index, piece) for bucket in layout.buckets for piece in layout.pieces(bucket, rank)
        ]
        # Pieces of parameters in no group: no optimizer owns them, so before each all-gather their masters are
        # refreshed from the parameters (a value the user set after building the optimizer must survive).
        self._ungrouped = [(k, piece) for k, piece in self._all_pieces if group_of.get(piece.slot.index) is None]
        self._pieces: list[tuple[int, ShardPiece]] = []  # (bucket, piece), in inner-optimizer order
        piece_params: list[list[torch.Tensor]] = [[] for _ in param_groups]
        unsorted: list[tuple[int, int, ShardPiece]] = []
        for k, piece in self._all_pieces:
            g = group_of.get(piece.slot.index)
            if g is not None:
                unsorted.append((g, k, piece))
        # Inner order: by group, then buffer order (stable sort keeps buffer order within a group).
        unsorted.sort(key=lambda t: t[0])
        with torch.no_grad():
            self._refresh_masters_from_params()
            for g, k, piece in unsorted:
                start = buffer.shard_offset(k) + piece.shard_offset
                master_view = self.master[start : start + piece.numel]
                leaf = torch.nn.Parameter(master_view)  # shares memory with self.master
                leaf.grad = buffer.shard_grads[start : start + piece.numel]
                piece_params[g].append(leaf)
                self._pieces.append((k, piece))
        self._leaves = [leaf for group in piece_params for leaf in group]
        inner_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": leaves}
            for group, leaves in zip(param_groups, piece_params, strict=True)
        ]
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)
        self._grads_prepared = False

    def _refresh_masters_from_params(self, pieces: list[tuple[int, ShardPiece]] | None = None) -> None:
        """Copy this rank's part of every parameter, or of ``pieces``, into the masters (exactly: fp32 holds
        fp16/bf16/fp32)."""
        for k, piece in self._all_pieces if pieces is None else pieces:
            start = self.buffer.shard_offset(k) + piece.shard_offset
            param = self.buffer.params[piece.slot.index]
            self.master[start : start + piece.numel].copy_(
                param.detach().reshape(-1)[piece.param_start : piece.param_stop]
            )

    # ------------------------------------------------------------------ optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradient buffers in place and start a new accumulation window (the fp32 shards are
        overwritten by the next reduction).

        Args:
            set_to_none: as torch's: True (default) leaves every parameter's ``.grad`` None until the next
                backward; False keeps the ``.grad`` tensors that are views of the gradient buffer (zeroed),
                the others become None either way (their values live in the buffer).
        """
        check_bool("set_to_none", set_to_none)
        self.buffer.zero_grads(set_to_none=set_to_none)
        self._grads_prepared = False

    def mixprec_prepare_grads_(self) -> None:
        """Check that a synced backward has filled the fp32 gradient shards since the last step."""
        if self._grads_prepared:
            return
        if not self.buffer.grads_reduced:
            raise RuntimeError(
                "no reduced gradients since the last step: run forward and backward through the "
                "DistributedDataParallel wrapper (the last one outside no_sync()) before step()"
            )
        self._grads_prepared = True

    def mixprec_discard_grads_(self) -> None:
        """Forget this iteration's reduced gradient shards: the next ``step``/``unscale_``/clip needs a new
        synced backward first (else RuntimeError), so a skipped step's inf/NaN shards are never reused.

        The loss scalers call it from ``update()``, whatever way the gradients are cleared afterwards.
        """
        self._grads_prepared = False
        self.buffer.clear_reduced()

    def _local_norm_term(self, norm_type: float) -> torch.Tensor:
        grads = [leaf.grad for leaf in self._leaves if leaf.grad is not None and leaf.numel() > 0]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.master.device)
        per_piece = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
        if norm_type == math.inf:
            return per_piece.max()
        return per_piece.pow(norm_type).sum()

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all ranks' shards: local fp32 terms, one fp32 all-reduce (SUM, or MAX
        for the inf-norm). Each parameter element is counted once, tied parameters included."""
        norm_type = check_norm_type("norm_type", norm_type)
        self.mixprec_prepare_grads_()
        term = self._local_norm_term(norm_type).reshape(1).clone()
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(term, op=op, group=self.buffer.group)
        total = term[0]
        return total if norm_type == math.inf else total.pow(1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the fp32 gradient shards so the global norm is at most ``max_norm``; returns the norm before.

        Same rule as :func:`mixprec.scaling.clip_grad_norm_`: a non-finite norm leaves gradients untouched (the
        loss scaler skips that step). Call it after ``scaler.unscale_(opt)``.
        """
        check_positive_float("max_norm", max_norm)
        total = self.grad_norm(norm_type)
        shard_grads = self.buffer.shard_grads
        if torch.isfinite(total) and shard_grads is not None:
            shard_grads.mul_(clip_coefficient(total, max_norm))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step the inner optimizer on the fp32 pieces, then round and all-gather the parameters."""
        if closure is not None:
            raise RuntimeError("ShardedOptimizer.step does not take a closure (it would re-run backward)")
        self.mixprec_prepare_grads_()
        self.optimizer.step()
        self._gather_params()
        self._grads_prepared = False
        self.buffer.clear_reduced()

    @torch.no_grad()
    def _gather_params(self) -> None:
        buffer = self.buffer
        ws, rank = buffer.world_size, buffer.rank
        if self._ungrouped:
            self._refresh_masters_from_params(self._ungrouped)
        works = []
        for b in buffer.layout.buckets:
            size = b.numel // ws
            full = buffer.param_bucket(b.index)
            own = full[rank * size : (rank + 1) * size]
            base = buffer.shard_offset(b.index)
            own.copy_(self.master[base : base + size])  # one rounding
            works.append(all_gather_flat(full, own, buffer.group, async_op=True))
        for w in works:
            w.wait()

    # ------------------------------------------------------------------ checkpoints
    def _root(self) -> int:
        """Global rank of the group's rank 0, where checkpoints are gathered."""
        return dist.get_global_rank(self.buffer.group, 0) if self.buffer.group is not None else 0

    def _gather_flat(self, shard: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """Gather a tensor laid out like ``self.master`` onto the group's rank 0: one full tensor per bucket
        there, None elsewhere. Extra memory: on rank 0 the full tensors; elsewhere nothing."""
        buffer = self.buffer
        is_root = buffer.rank == 0
        out: dict[int, torch.Tensor] = {}
        for b in buffer.layout.buckets:
            size = b.numel // buffer.world_size
            base = buffer.shard_offset(b.index)
            full = torch.empty(b.numel, dtype=shard.dtype, device=shard.device) if is_root else None
            parts = list(full.chunk(buffer.world_size)) if full is not None else None
            dist.gather(shard[base : base + size].contiguous(), parts, dst=self._root(), group=buffer.group)
            if full is not None:
                out[b.index] = full
        return out if is_root else None

    def _per_param(self, full: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = {}
        for slot in self.buffer.layout.slots:
            t = full[slot.bucket][slot.start : slot.start + slot.numel]
            result[slot.name] = t.view(slot.shape).clone()
        return result

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any] | None:
        """A full checkpoint, gathered onto the group's rank 0 (None on the other ranks); collective: every
        rank of the group must call it. Independent of the world size: it loads at any other.

        Keys: ``format``; ``master`` (name -> full fp32 master weight); ``state`` (name -> {key: full
        tensor or scalar}); ``elementwise_keys`` (state keys stored as full tensors); ``param_groups``
        (options and parameter names per group); ``world_size`` (informational). Names are the module's
        parameter names (the first name of a tied parameter). Save it from rank 0 with ``torch.save``.

        Memory: rank 0 ends holding the whole checkpoint, ``4 N (1 + K)`` bytes for N parameter elements
        and K elementwise fp32 state keys (Adam: K = 2), and while one key is gathered another ``N`` bytes
        of presence mask. The other ranks send their shards (``dist.gather``, one bucket at a time) and hold
        at most one key of their own shard extra, ``5 N / world_size`` bytes; they never hold the world's
        state. Wire: the state dtypes (fp32) and uint8 masks; small metadata (key names) is all-gathered.
        """
        buffer = self.buffer
        is_root = buffer.rank == 0
        local_keys: dict[str, str] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for leaf, (_, piece) in zip(self._leaves, self._pieces, strict=True):
            st = self.optimizer.state.get(leaf, {})
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.shape == leaf.shape and leaf.dim() == 1:
                    local_keys[key] = str(value.dtype).removeprefix("torch.")
                else:
                    value = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                    scalars.setdefault(piece.slot.name, {}).setdefault(key, value)
        # Every rank must take part in the gathers of every key: the key names go to all ranks (tiny).
        all_keys: list[Any] = [None] * buffer.world_size
        dist.all_gather_object(all_keys, local_keys, group=buffer.group)
        elementwise: dict[str, str] = {}
        for keys in all_keys:
            elementwise.update(keys)
        gathered_scalars = gather_objects(scalars, dst=self._root(), group=buffer.group)
        merged_scalars: dict[str, dict[str, Any]] = {}
        for sc in gathered_scalars or []:
            for name, entries in sc.items():
                for key, value in entries.items():
                    merged_scalars.setdefault(name, {}).setdefault(key, value)

        gathered_master = self._gather_flat(self.master)
        state: dict[str, dict[str, Any]] = {name: dict(entries) for name, entries in merged_scalars.items()}
        for key in sorted(elementwise):
            dtype = getattr(torch, elementwise[key])
            flat = torch.zeros(self.master.numel(), dtype=dtype, device=self.master.device)
            has = torch.zeros(self.master.numel(), dtype=torch.uint8, device=self.master.device)
            for leaf, (k, piece) in zip(self._leaves, self._pieces, strict=True):
                value = self.optimizer.state.get(leaf, {}).get(key)
                if value is not None:
                    start = buffer.shard_offset(k) + piece.shard_offset
                    flat[start : start + piece.numel] = value
                    has[start : start + piece.numel] = 1
            full = self._gather_flat(flat)
            del flat
            present = self._gather_flat(has)
            del has
            if full is None or present is None:
                continue
            full_by_name, present_by_name = self._per_param(full), self._per_param(present)
            del full, present
            for name, tensor in full_by_name.items():
                if bool(present_by_name[name].all()):
                    state.setdefault(name, {})[key] = tensor
        if not is_root or gathered_master is None:
            return None
        groups = []
        for group, names in zip(self.optimizer.param_groups, self._group_names, strict=True):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})
        return {
            "format": CHECKPOINT_FORMAT,
            "master": self._per_param(gathered_master),
            "state": state,
            "elementwise_keys": sorted(elementwise),
            "param_groups": groups,
            "world_size": buffer.world_size,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint from :meth:`state_dict`, saved at any world size. Sets the model parameters
        too (the masters rounded to the model dtype). Local: no collective."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"state_dict must come from ShardedOptimizer.state_dict() (format {CHECKPOINT_FORMAT!r})")
        buffer = self.buffer
        master = state_dict["master"]
        expected = {slot.name for slot in buffer.layout.slots}
        if set(master) != expected:
            missing, extra = sorted(expected - set(master)), sorted(set(master) - expected)
            raise ValueError(f"checkpoint parameters do not match the model: missing {missing}, unexpected {extra}")
        for slot in buffer.layout.slots:
            if tuple(master[slot.name].shape) != tuple(slot.shape):
                raise ValueError(
                    f"parameter {slot.name}: checkpoint shape {tuple(master[slot.name].shape)} != {tuple(slot.shape)}"
                )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._group_names) or any(
            list(sg["params"]) != names for sg, names in zip(saved_groups, self._group_names, strict=True)
        ):
            raise ValueError("checkpoint param groups do not match this optimizer's (same parameters per group)")
        elementwise = set(state_dict.get("elementwise_keys", ()))
        inner_state: dict[int, dict[str, Any]] = {}
        for idx, (leaf, (_, piece)) in enumerate(zip(self._leaves, self._pieces, strict=True)):
            name = piece.slot.name
            leaf.copy_(master[name].reshape(-1)[piece.param_start : piece.param_stop])
            entries = state_dict["state"].get(name)
            if not entries:
                continue
            inner_state[idx] = {
                key: (
                    value.reshape(-1)[piece.param_start : piece.param_stop].clone()
                    if key in elementwise
                    else (value.clone() if isinstance(value, torch.Tensor) else value)
                )
                for key, value in entries.items()
            }
        inner_groups = []
        next_index = 0
        for saved, group in zip(saved_groups, self.optimizer.param_groups, strict=True):
            n = len(group["params"])
            inner_groups.append(
                {**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(next_index, next_index + n))}
            )
            next_index += n
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for slot, param in zip(buffer.layout.slots, buffer.params, strict=True):
            param.copy_(master[slot.name])  # round to the model dtype, locally (every rank has the full tensor)
        # Parameters in no group have no leaf: their masters follow the loaded parameters here.
        for k, piece in self._all_pieces:
            start = buffer.shard_offset(k) + piece.shard_offset
            self.master[start : start + piece.numel].copy_(
                master[piece.slot.name].reshape(-1)[piece.param_start : piece.param_stop]
            )
        self._grads_prepared = False

    def __repr__(self) -> str:
        return (
            f"ShardedOptimizer({type(self.optimizer).__name__}, rank={self.buffer.rank}/{self.buffer.world_size}, "
            f"shard_elements={self.master.numel()})"
        )


def _group_of(buffer: GradBuffer, param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """{index of a parameter in ``buffer.params``: index of its group} for the parameters ``param_groups`` name;
    TypeError for a group that is no dict with ``"params"``, ValueError for a tensor that is not one of the
    buffer's parameters or one named in two groups."""
    index_of = {id(p): i for i, p in enumerate(buffer.params)}
    group_of: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("param_groups must be dicts with a 'params' entry")
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            i = index_of.get(id(p))
            if i is None:
                raise ValueError("param_groups holds a tensor that is not a trainable parameter of the module")
            if i in group_of:
                raise ValueError(f"parameter {buffer.names[i]} appears in more than one param group")
            group_of[i] = g
    return group_of
