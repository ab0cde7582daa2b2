"""fp32 accumulation for users who keep torch FSDP2 (``fully_shard``): a custom reduce-scatter.

:class:`FP32AccumulateReduceScatter` implements FSDP2's ``ReduceScatter`` comm interface as a thin adapter
over a :class:`mixprec.parallel.FP32AccumulateReducer` (its ``reduce_scatter_scaled``);
:func:`use_fp32_accumulation` installs it on every ``fully_shard``-ed submodule
(``FSDPModule.set_custom_reduce_scatter``, torch 2.13). Importing this module
imports ``torch.distributed.fsdp`` (about 0.7 s), so only ``mixprec.fsdp`` imports it, not ``import mixprec``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.live_audit import AuditResult, LiveAudit
from mixprec.core.dtypes import Rounding
from mixprec.parallel.reducers import FP32AccumulateReducer

__all__ = ["FP32AccumulateReduceScatter", "use_fp32_accumulation"]


def _fsdp_base() -> type:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # a torch without FSDP2's comm interface: still importable, refuses at use
        return object
    return ReduceScatter


def _decode_op(op: Any) -> tuple[bool, float | None]:
    """(average, multiplier) of a reduce op FSDP2 passes: SUM, AVG or PREMUL_SUM(factor)."""
    red = dist.ReduceOp.RedOpType
    kind = getattr(op, "op", op)
    if kind == red.SUM:
        return False, None
    if kind == red.AVG:
        return True, None
    if kind == red.PREMUL_SUM:
        factor = op.factor
        factor = float(factor.item()) if isinstance(factor, torch.Tensor) else float(factor)
        if not math.isfinite(factor):
            raise ValueError(f"PREMUL_SUM factor must be finite; got {factor}")
        return False, factor
    raise ValueError(f"FP32AccumulateReduceScatter supports the reduce ops SUM, AVG and PREMUL_SUM; got {op}")


class FP32AccumulateReduceScatter(_fsdp_base()):  # type: ignore[misc]
    """torch FSDP2 ``ReduceScatter`` that sends the reduce dtype and sums in fp32 (one rounding).

    FSDP2 calls it with the flat gradient input (reduce dtype, padded to a multiple of the shard-group
    size by FSDP) and the output shard. Reduce ops: ``AVG`` becomes a division in fp32 before the single
    rounding; ``PREMUL_SUM(f)`` (from ``set_gradient_divide_factor``) a multiplication by f in fp32;
    ``SUM`` a plain sum. For fp16, FSDP itself divides the input by a pre-factor and the output by a
    post-factor in fp16 around the collective (to avoid overflow); both are powers of two for a
    power-of-two group, so exact away from the subnormal range.

    Wire dtype: FSDP's reduce dtype. Accumulation: fp32. Extra memory: a receive buffer of the input's
    size (kept between calls and reused when large enough) plus 512 KiB of fp32 blocks.

    Args:
        rounding: ``"nearest"`` or ``"stochastic"`` for the single rounding to the reduce dtype.
        generator: random stream for stochastic rounding (None = mixprec's seeded per-process default).
        topology: None (flat), or a :class:`mixprec.comm.Topology` / 2-D DeviceMesh with dims ("node",
            "local"): the two-stage multi-node scheme of :mod:`mixprec.comm.hierarchical_fp32` (the FSDP
            shard group must then hold every rank in global order; the receive buffer becomes its area).
        inter_node_dtype: with a topology: None (node partials rounded to the reduce dtype) or torch.float32.
        audit_every: None, or an int N >= 1: at backward passes N, 2N, ... one reduce-scatter (the k-th of
            the pass, k = ``(step // N - 1) mod calls per pass``) is also reduced exactly and its error, and
            the backend's all-reduce's beside it, recorded in :attr:`audit_results`
            (:class:`mixprec.comm.live_audit.LiveAudit`). A pass is the reduce-scatters of one autograd
            backward (its end is an autograd engine callback).
        on_audit: called with each audit result as it is recorded (e.g. to log ``result.as_row()``).
    """

    def __init__(
        self,
        *,
        rounding: Rounding = "nearest",
        generator: torch.Generator | None = None,
        topology: Any = None,
        inter_node_dtype: torch.dtype | None = None,
        audit_every: int | None = None,
        on_audit: Callable[[AuditResult], None] | None = None,
    ) -> None:
        self.audit = LiveAudit(audit_every, on_audit=on_audit)
        self.reducer = FP32AccumulateReducer(
            rounding=rounding, generator=generator, topology=topology, inter_node_dtype=inter_node_dtype
        )
        """What every call runs: ``reducer.reduce_scatter_scaled`` (options, stream and checks are the reducer's)."""
        self._scratch: torch.Tensor | None = None
        self._calls_in_pass: int | None = None  # None: no backward pass open
        self._calls_per_pass: int | None = None
        self._audit_call: int | None = None

    @property
    def audit_results(self) -> list[AuditResult]:
        """This rank's live-audit results, oldest first (``audit_every``)."""
        return self.audit.results

    def _audit_index(self) -> int | None:
        """This call's index in its backward pass when it is the one to audit, else None."""
        if self._calls_in_pass is None:
            self._calls_in_pass = 0
            self._audit_call = self.audit.new_step(self._calls_per_pass)
            torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
        index = self._calls_in_pass
        self._calls_in_pass += 1
        return index if index == self._audit_call else None

    def _close_pass(self) -> None:
        self._calls_per_pass = self._calls_in_pass
        self._calls_in_pass = None

    @property
    def rounding(self) -> Rounding:
        return self.reducer.rounding

    @property
    def generator(self) -> torch.Generator | None:
        return self.reducer.generator

    @property
    def topology(self) -> Any:
        return self.reducer.topology

    @property
    def inter_node_dtype(self) -> torch.dtype | None:
        return self.reducer.inter_node_dtype

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's hook for allocating the reduce-scatter's input and output buffers: an uninitialised tensor
        of ``size`` (no padding or alignment needed here: the collective takes any contiguous tensor whose
        length FSDP has padded to a multiple of the group size)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def _scratch_for(self, input_tensor: torch.Tensor) -> torch.Tensor:
        s = self._scratch
        if (
            s is None
            or s.dtype != input_tensor.dtype
            or s.device != input_tensor.device
            or s.numel() < input_tensor.numel()
        ):
            s = self._scratch = torch.empty(input_tensor.numel(), dtype=input_tensor.dtype, device=input_tensor.device)
        return s

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        average, factor = _decode_op(op)
        index = self._audit_index() if self.audit.enabled else None
        audit = None
        if index is not None:
            audit = self.audit.begin(input_tensor, group, average=average, native=True, index=index, factor=factor)
        # The receive buffer is reused across calls, so only one reduction may be in flight: finish it here
        # (FSDP2 calls this synchronously anyway).
        self.reducer.reduce_scatter_scaled(
            output_tensor, input_tensor, group, average=average, factor=factor, scratch=self._scratch_for(input_tensor)
        )
        if audit is not None:
            audit.finish(output_tensor, offset=dist.get_rank(group) * output_tensor.numel())
        return _CompletedWork() if async_op else None

    def __repr__(self) -> str:
        extra = "" if self.topology is None else f", topology={self.topology!r}"
        return f"FP32AccumulateReduceScatter(rounding={self.rounding!r}{extra})"


class _CompletedWork:
    """What an async caller waits on: the reduction already finished."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def use_fp32_accumulation(
    module: torch.nn.Module,
    *,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    topology: Any = None,
    inter_node_dtype: torch.dtype | None = None,
    audit_every: int | None = None,
    on_audit: Callable[[AuditResult], None] | None = None,
) -> int:
    """Make every ``fully_shard``-ed submodule of ``module`` (itself included) reduce-scatter its gradients
    with one :class:`FP32AccumulateReduceScatter` (``topology``, ``inter_node_dtype``, ``audit_every``,
    ``on_audit``: as there; the audit's results reach the caller through ``on_audit``). Returns how many
    FSDP modules were set.

    Call it after ``fully_shard``. Raises ValueError when there is no FSDP module, RuntimeError when this
    torch's FSDP2 has no ``set_custom_reduce_scatter``.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:
        raise RuntimeError(
            f"this torch ({torch.__version__}) has no FSDP2 (torch.distributed.fsdp.FSDPModule)"
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    comm = FP32AccumulateReduceScatter(
        rounding=rounding,
        generator=generator,
        topology=topology,
        inter_node_dtype=inter_node_dtype,
        audit_every=audit_every,
        on_audit=on_audit,
    )
    count = 0
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            setter = getattr(sub, "set_custom_reduce_scatter", None)
            if setter is None:
                raise RuntimeError(
                    f"this torch ({torch.__version__}) has no FSDPModule.set_custom_reduce_scatter; "
                    "FP32AccumulateReduceScatter needs torch >= 2.13"
                )
            setter(comm)
            count += 1
    if count == 0:
        raise ValueError("module holds no fully_shard-ed submodule: call torch.distributed.fsdp.fully_shard first")
    return count
