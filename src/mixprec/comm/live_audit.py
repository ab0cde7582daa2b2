"""A live numerics audit of gradient reductions: every N steps one bucket is also reduced exactly.

:class:`LiveAudit` is the one audit object of the data-parallel wrapper (``audit_every=``), the torch DDP
comm hooks and the FSDP2 adapter. On an audited step it picks one bucket (``(step // N - 1) mod buckets``,
so every bucket is audited in turn) and, right before that bucket's reduction starts, on the thread that
starts it: all-gathers every rank's pre-reduction bucket in the wire dtype (bits preserved) and, when the
reducer is not the backend's own, runs the backend's all-reduce on a copy (torch DDP's recipe: pre-divide,
SUM in the wire dtype). Both collectives are on the reduction's group, in the same place of every rank's
sequence. The exact reduction is the fp64 sum of the gathered rows; once the reduction has finished, the
error of mixprec's result (and of the backend's) against it is measured locally (:func:`error_metrics`) and
recorded as an :class:`AuditResult` (``as_row()``: the ``audit_*`` keys of ``metrics.jsonl``).

Cost of one audit, per rank, for a bucket of n elements of b bytes on P ranks: an all-gather receiving
(P - 1) n b bytes and an all-reduce of n b bytes (the latter only beside a non-native reducer); memory
P n b + n b, plus a few fp64 vectors of n; O(P n) additions. Nothing is allocated on other steps.
Exactness of the reference and the metric definitions: ``docs/parallel.md`` ("Live numerics audit").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.compat import all_gather_flat
from mixprec.core.dtypes import WIRE_DTYPES
from mixprec.core.validate import check_group, check_tensor

__all__ = [
    "AUDIT_ROW_PREFIX",
    "MAX_EFFECTIVE_BITS",
    "AuditResult",
    "ErrorMetrics",
    "LiveAudit",
    "PendingAudit",
    "check_audit_every",
    "error_metrics",
]

# The fp64 reference is good to about 53 bits: a result equal to it is credited with that many, no more.
MAX_EFFECTIVE_BITS = 53.0
AUDIT_ROW_PREFIX = "audit_"


def check_audit_every(value: Any, name: str = "audit_every") -> int | None:
    """``value`` is None (no audit) or an int >= 1 (audit every that many synced steps); TypeError /
    ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1 or None; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None; got {value}")
    return value


@dataclass(frozen=True)
class ErrorMetrics:
    """Error of a reduced bucket ``y`` against the exact (fp64) reduction ``x``, over the elements where both
    are finite.

    * ``rel_l2`` = ||y - x||_2 / ||x||_2 (0 when y = x; inf when x = 0 and y != x);
    * ``max_abs`` = max_i |y_i - x_i|;
    * ``max_rel`` = max_i |y_i - x_i| / |x_i| over the elements with x_i != 0;
    * ``effective_bits`` = -log2(rel_l2), clamped to [0, 53]: the bits of agreement with the exact sum in
      the L2 sense (one correct rounding to bf16 gives about 9, to fp16 12, to fp32 25).
    """

    rel_l2: float
    max_abs: float
    max_rel: float
    effective_bits: float


def error_metrics(result: torch.Tensor, exact: torch.Tensor) -> tuple[ErrorMetrics, int]:
    """(:class:`ErrorMetrics` of ``result`` against ``exact`` [fp64, same length], the number of elements
    where ``exact`` is finite but ``result`` is not: an overflow of the reduction itself). Elements where
    ``exact`` is inf/NaN (some rank sent one) are left out; they are counted by the caller."""
    y = result.reshape(-1).to(torch.float64, copy=True)  # a scratch copy: worked on in place below
    x = exact.reshape(-1)
    lost = 0
    # One sum each tells whether anything is non-finite (inf/NaN propagate; finite fp64 sums of these
    # magnitudes cannot overflow); only then the masks, which cost several passes.
    if not (math.isfinite(float(x.sum())) and math.isfinite(float(y.sum()))):
        finite_x = torch.isfinite(x)
        finite_y = torch.isfinite(y)
        lost = int((finite_x & ~finite_y).sum())
        both = finite_x & finite_y
        x, y = x[both], y[both]
    err = y.sub_(x).abs_()
    if err.numel() == 0:
        return ErrorMetrics(rel_l2=0.0, max_abs=0.0, max_rel=0.0, effective_bits=MAX_EFFECTIVE_BITS), lost
    err_norm = float(torch.linalg.vector_norm(err))
    ref_norm = float(torch.linalg.vector_norm(x))
    if err_norm == 0.0:
        rel_l2 = 0.0
    elif ref_norm == 0.0:
        rel_l2 = math.inf
    else:
        rel_l2 = err_norm / ref_norm
    max_abs = float(err.max())
    magnitude = x.abs()
    zero = magnitude == 0
    max_rel = float(err.masked_fill_(zero, 0.0).div_(magnitude.masked_fill_(zero, 1.0)).max())
    bits = MAX_EFFECTIVE_BITS if rel_l2 == 0.0 else min(MAX_EFFECTIVE_BITS, max(0.0, -math.log2(rel_l2)))
    return ErrorMetrics(rel_l2=rel_l2, max_abs=max_abs, max_rel=max_rel, effective_bits=bits), lost


@dataclass(frozen=True)
class AuditResult:
    """One audit on one rank: bucket ``bucket`` at synced step ``step`` (1-based).

    ``mixprec``: the reducer's result (this rank's whole bucket, or its shard after a reduce-scatter)
    against the exact reduction; ``native``: the backend's own all-reduce of the same bucket beside it
    (None when the reducer is the backend's own). ``nonfinite_inputs``: elements where some rank's bucket
    held inf/NaN (left out of the metrics, never spread into them); ``nonfinite_results``: elements the
    reducer made non-finite although the exact value is finite. ``seconds``: the audit's own time on this
    rank (its collectives and arithmetic); ``bytes_received``: what its collectives brought to this rank.
    """

    step: int
    bucket: int
    rank: int
    world_size: int
    numel: int
    wire_dtype: str
    mixprec: ErrorMetrics
    native: ErrorMetrics | None
    nonfinite_inputs: int
    nonfinite_results: int
    seconds: float
    bytes_received: int

    def as_row(self) -> dict[str, Any]:
        """Flat ``audit_*`` fields for a ``metrics.jsonl`` row (``audit_native_*`` only beside a non-native
        reducer)."""
        p = AUDIT_ROW_PREFIX
        row: dict[str, Any] = {
            f"{p}step": self.step,
            f"{p}bucket": self.bucket,
            f"{p}numel": self.numel,
            f"{p}wire_dtype": self.wire_dtype,
            **{f"{p}{k}": v for k, v in asdict(self.mixprec).items()},
            f"{p}nonfinite_inputs": self.nonfinite_inputs,
            f"{p}nonfinite_results": self.nonfinite_results,
            f"{p}seconds": self.seconds,
        }
        if self.native is not None:
            row.update({f"{p}native_{k}": v for k, v in asdict(self.native).items()})
        return row


class PendingAudit:
    """An audit whose collectives are done; :meth:`finish` measures the reduced result (local, no collective)."""

    def __init__(
        self,
        owner: LiveAudit,
        *,
        step: int,
        bucket: int,
        rank: int,
        world_size: int,
        exact: torch.Tensor,
        native: torch.Tensor | None,
        wire_dtype: torch.dtype,
        seconds: float,
        bytes_received: int,
    ) -> None:
        self._owner = owner
        self._meta = (step, bucket, rank, world_size, wire_dtype, bytes_received)
        self._exact = exact
        self._native = native
        self._seconds = seconds

    @property
    def exact(self) -> torch.Tensor:
        """The exact reduction of the whole bucket (fp64; empty once finished)."""
        return self._exact

    @property
    def native(self) -> torch.Tensor | None:
        """The backend's own all-reduce of the bucket (wire dtype), or None (empty once finished)."""
        return self._native

    def finish(self, reduced: torch.Tensor, *, offset: int = 0) -> AuditResult:
        """Compare ``reduced`` (elements ``[offset, offset + len)`` of the reduced bucket: the whole bucket, or
        this rank's shard) with the exact reduction; record and return the result."""
        t0 = time.perf_counter()
        step, bucket, rank, world, wire_dtype, received = self._meta
        n = reduced.numel()
        exact = self._exact[offset : offset + n]
        if exact.numel() != n:
            raise RuntimeError(f"internal error: audited result of {n} elements at {offset} outside the bucket")
        ours, lost = error_metrics(reduced.detach(), exact)
        native = None
        if self._native is not None:
            native, _ = error_metrics(self._native[offset : offset + n], exact)
        result = AuditResult(
            step=step,
            bucket=bucket,
            rank=rank,
            world_size=world,
            numel=n,
            wire_dtype=str(wire_dtype).removeprefix("torch."),
            mixprec=ours,
            native=native,
            nonfinite_inputs=0 if math.isfinite(float(exact.sum())) else int((~torch.isfinite(exact)).sum()),
            nonfinite_results=lost,
            seconds=self._seconds + time.perf_counter() - t0,
            bytes_received=received,
        )
        self._exact = self._native = torch.empty(0)
        self._owner.record(result)
        return result


class LiveAudit:
    """Every ``every`` synced steps, one bucket reduced exactly beside the real reduction (module docstring).

    Args:
        every: int >= 1, or None (never audit: :meth:`new_step` always returns None).
        on_audit: called with each :class:`AuditResult` as it is recorded (e.g. to log it).
        name: the argument name in error messages (``audit_every``).

    :attr:`results` holds every result of this rank, oldest first (a few hundred bytes each).
    """

    def __init__(
        self,
        every: int | None,
        *,
        on_audit: Callable[[AuditResult], None] | None = None,
        name: str = "audit_every",
    ) -> None:
        self.every = check_audit_every(every, name)
        if on_audit is not None and not callable(on_audit):
            raise TypeError(f"on_audit must be callable or None; got {type(on_audit).__name__}")
        self.on_audit = on_audit
        self.step = 0
        self.results: list[AuditResult] = []

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def new_step(self, num_buckets: int | None) -> int | None:
        """Count one synced step; return the bucket to audit in it, or None. ``num_buckets``: the buckets of
        this step (None when not yet known: bucket 0 is audited)."""
        if self.every is None:
            return None
        self.step += 1
        if self.step % self.every:
            return None
        return (self.step // self.every - 1) % num_buckets if num_buckets else 0

    def begin(
        self,
        bucket: torch.Tensor,
        group: dist.ProcessGroup | None,
        *,
        average: bool,
        native: bool,
        index: int,
        factor: float | None = None,
    ) -> PendingAudit:
        """Run the audit's collectives on ``bucket`` (its pre-reduction contents, not modified) before its
        reduction starts; every rank of ``group`` calls this for the same bucket at the same point.

        ``native``: also run the backend's own all-reduce on a copy (pre-divided by the group size in the
        wire dtype when ``average``, then SUM, as torch DDP does). ``factor``: a reduction that multiplies
        the sum by it (FSDP2's PREMUL_SUM); the copy is multiplied in the wire dtype before the SUM.
        """
        # Checked identically on every rank (all hold this bucket's dtype and length) before any collective.
        check_tensor("bucket", bucket, WIRE_DTYPES)
        group = check_group("group", group)
        t0 = time.perf_counter()
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        flat = bucket.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        n = flat.numel()
        rows = torch.empty(world * n, dtype=flat.dtype, device=flat.device)
        all_gather_flat(rows, flat, group)
        received = (world - 1) * n * flat.element_size()
        native_result = None
        if native:
            native_result = flat.clone()
            if average:
                native_result.div_(world)
            if factor is not None:
                native_result.mul_(factor)
            dist.all_reduce(native_result, op=dist.ReduceOp.SUM, group=group)
            received += 2 * (world - 1) * n * flat.element_size() // world  # a ring's share per rank
        # fp64 sum in rank order of P values of <= 24 significand bits: error <= (P - 1) 2^-53 sum |x_i|.
        per_rank = rows.view(world, n)
        exact = per_rank[0].to(torch.float64, copy=True)
        for r in range(1, world):
            exact += per_rank[r]
        if average:
            exact /= world
        if factor is not None:
            exact *= factor
        del rows
        return PendingAudit(
            self,
            step=self.step,
            bucket=index,
            rank=rank,
            world_size=world,
            exact=exact,
            native=native_result,
            wire_dtype=flat.dtype,
            seconds=time.perf_counter() - t0,
            bytes_received=received,
        )

    def record(self, result: AuditResult) -> None:
        self.results.append(result)
        if self.on_audit is not None:
            self.on_audit(result)
