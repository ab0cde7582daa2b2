"""A live numerics audit of gradient reductions: every N steps one bucket is also reduced exactly.

:class:`LiveAudit` is the one audit object of the data-parallel wrapper (``audit_every=``), the torch DDP
comm hooks and the FSDP2 adapter. On an audited step it picks one bucket (``(step // N - 1) mod buckets``,
so every bucket is audited in turn) and a sample of it: the whole bucket when it holds at most ``sample``
elements (default :data:`AUDIT_SAMPLE_ELEMENTS`), else P equal segments, one at the same offset of each of
the P shards, the offset moving on at each visit of the bucket (:class:`AuditSample`). Right before the
bucket's reduction starts, on the thread that starts it, every rank all-gathers every rank's sample in the
wire dtype (bits preserved) and, when the reducer is not the backend's own, runs the backend's all-reduce on
a copy of it (torch DDP's recipe: pre-divide, SUM in the wire dtype). Both collectives are on the reduction's
group, in the same place of every rank's sequence. The exact reduction is the fp64 sum of the gathered
rows; once the reduction has finished, the error of mixprec's result (and of the backend's) on the sampled
elements is measured locally (:func:`error_metrics`) and recorded as an :class:`AuditResult` (``as_row()``:
the ``audit_*`` keys of ``metrics.jsonl``, the sample included).

Cost of one audit, per rank, for a sample of m elements of b bytes on P ranks: an all-gather receiving
(P - 1) m b bytes, an all-reduce of m b bytes (only beside a non-native reducer), P m b + m b bytes and a
few fp64 vectors of m; O(P m) additions. m <= max(sample, P), whatever the bucket size. Nothing is
allocated on other steps. Exactness and metrics: ``docs/parallel.md`` ("Live numerics audit").
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
    "AUDIT_SAMPLE_ELEMENTS",
    "MAX_EFFECTIVE_BITS",
    "AuditResult",
    "AuditSample",
    "ErrorMetrics",
    "LiveAudit",
    "PendingAudit",
    "check_audit_every",
    "error_metrics",
]

# The fp64 reference is good to about 53 bits: a result equal to it is credited with that many, no more.
MAX_EFFECTIVE_BITS = 53.0
AUDIT_ROW_PREFIX = "audit_"
# Elements one audit reduces exactly, at most (and at least P): 2^16 keep its collectives and fp64 passes
# far below a step's reduction on any bucket, and its rel_l2 a mean over 65536 elements. A bucket holding
# more is sampled, and every element of it is audited in turn over the visits of that bucket.
AUDIT_SAMPLE_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class AuditSample:
    """Which elements of a bucket of ``bucket_numel`` elements an audit reduces exactly: ``count`` segments
    of ``length`` elements, segment c starting at ``c * stride + offset`` (the whole bucket: one segment
    of all of it). In a sampled bucket ``stride`` is ``bucket_numel // P``, the shard of a reduce-scatter,
    so every rank's shard holds one segment at the same offset."""

    bucket_numel: int
    offset: int
    stride: int
    length: int
    count: int

    @property
    def numel(self) -> int:
        return self.length * self.count

    @staticmethod
    def choose(bucket_numel: int, world_size: int, limit: int | None, visit: int) -> AuditSample:
        """The sample of the ``visit``-th audit (from 0) of a bucket: windows of ``limit // P`` elements of
        each shard, in turn from its start, so that successive visits cover the whole bucket."""
        if limit is None or bucket_numel <= limit or bucket_numel < world_size:
            return AuditSample(bucket_numel, 0, bucket_numel, bucket_numel, 1)
        stride = bucket_numel // world_size
        length = min(stride, max(1, limit // world_size))
        windows = -(-stride // length)
        offset = min((visit % windows) * length, stride - length)
        return AuditSample(bucket_numel, offset, stride, length, world_size)

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """The sampled elements of ``flat`` (the bucket, 1-D), contiguous, segment after segment."""
        if self.count == 1:
            return flat[self.offset : self.offset + self.length].contiguous()
        rows = flat[: self.count * self.stride].view(self.count, self.stride)
        return rows[:, self.offset : self.offset + self.length].contiguous().view(-1)

    def overlap(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """(position in the sample, position in ``[start, start + n)``, length) of each sampled run that
        falls in the bucket elements ``[start, start + n)``."""
        runs = []
        for c in range(self.count):
            lo = c * self.stride + self.offset
            a, b = max(lo, start), min(lo + self.length, start + n)
            if a < b:
                runs.append((c * self.length + a - lo, a - start, b - a))
        return runs


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

    ``mixprec``: the reducer's result on the sampled elements this rank holds (``numel`` of them: the whole
    sample, or its segment in this rank's shard after a reduce-scatter) against the exact reduction;
    ``native``: the backend's own all-reduce of the sample beside it (None when the reducer is the
    backend's own). ``sample``: which elements were audited. ``nonfinite_inputs``: elements where some
    rank's bucket held inf/NaN (left out of the metrics, never spread into them); ``nonfinite_results``:
    elements the reducer made non-finite although the exact value is finite. ``seconds``: the audit's own
    time on this rank (its collectives and arithmetic); ``bytes_received``: what its collectives brought.
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
    sample: AuditSample | None = None

    def as_row(self) -> dict[str, Any]:
        """Flat ``audit_*`` fields for a ``metrics.jsonl`` row (``audit_native_*`` only beside a non-native
        reducer; ``audit_sample_*``: :class:`AuditSample`'s offset, stride, length and count)."""
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
        if self.sample is not None:
            row[f"{p}bucket_numel"] = self.sample.bucket_numel
            row.update({f"{p}sample_{k}": getattr(self.sample, k) for k in ("offset", "stride", "length", "count")})
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
        sample: AuditSample | None = None,
    ) -> None:
        self._owner = owner
        self._meta = (step, bucket, rank, world_size, wire_dtype, bytes_received)
        self._exact = exact
        self._native = native
        self._seconds = seconds
        self.sample = sample if sample is not None else AuditSample.choose(exact.numel(), world_size, None, 0)

    @property
    def exact(self) -> torch.Tensor:
        """The exact reduction of the sampled elements (fp64, in :meth:`AuditSample.take`'s order; empty once
        finished)."""
        return self._exact

    @property
    def native(self) -> torch.Tensor | None:
        """The backend's own all-reduce of the sample (wire dtype), or None (empty once finished)."""
        return self._native

    def finish(self, reduced: torch.Tensor, *, offset: int = 0) -> AuditResult:
        """Compare ``reduced`` (elements ``[offset, offset + len)`` of the reduced bucket: the whole bucket, or
        this rank's shard) with the exact reduction on the sampled elements among them; record and return
        the result."""
        t0 = time.perf_counter()
        step, bucket, rank, world, wire_dtype, received = self._meta
        flat = reduced.detach().reshape(-1)
        n = flat.numel()
        if offset < 0 or offset + n > self.sample.bucket_numel:
            raise RuntimeError(f"internal error: audited result of {n} elements at {offset} outside the bucket")
        runs = self.sample.overlap(offset, n)
        exact = torch.cat([self._exact[s : s + k] for s, _, k in runs]) if runs else self._exact[:0]
        ours, lost = error_metrics(torch.cat([flat[r : r + k] for _, r, k in runs]) if runs else flat[:0], exact)
        native = None
        if self._native is not None:
            theirs = torch.cat([self._native[s : s + k] for s, _, k in runs]) if runs else self._native[:0]
            native, _ = error_metrics(theirs, exact)
        result = AuditResult(
            step=step,
            bucket=bucket,
            rank=rank,
            world_size=world,
            numel=exact.numel(),
            wire_dtype=str(wire_dtype).removeprefix("torch."),
            mixprec=ours,
            native=native,
            nonfinite_inputs=0 if math.isfinite(float(exact.sum())) else int((~torch.isfinite(exact)).sum()),
            nonfinite_results=lost,
            seconds=self._seconds + time.perf_counter() - t0,
            bytes_received=received,
            sample=self.sample,
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
        sample: elements reduced exactly per audit, at most (int >= 1; at least one per rank); None = the
            whole bucket (its cost then grows with the bucket: module docstring).

    :attr:`results` holds every result of this rank, oldest first (a few hundred bytes each).
    """

    def __init__(
        self,
        every: int | None,
        *,
        on_audit: Callable[[AuditResult], None] | None = None,
        name: str = "audit_every",
        sample: int | None = AUDIT_SAMPLE_ELEMENTS,
    ) -> None:
        self.every = check_audit_every(every, name)
        self.sample = check_audit_every(sample, "sample")
        if on_audit is not None and not callable(on_audit):
            raise TypeError(f"on_audit must be callable or None; got {type(on_audit).__name__}")
        self.on_audit = on_audit
        self.step = 0
        self.results: list[AuditResult] = []
        self._visits: dict[int, int] = {}  # bucket index -> audits of it so far: picks the sample

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
        """Run the audit's collectives on a sample of ``bucket`` (its pre-reduction contents, not modified)
        before its reduction starts; every rank of ``group`` calls this for the same bucket at the same point.

        ``native``: also run the backend's own all-reduce on a copy of the sample (pre-divided by the group
        size in the wire dtype when ``average``, then SUM, as torch DDP does). ``factor``: a reduction that
        multiplies the sum by it (FSDP2's PREMUL_SUM); the copy is multiplied in the wire dtype before the SUM.
        """
        # Checked identically on every rank (all hold this bucket's dtype and length) before any collective.
        check_tensor("bucket", bucket, WIRE_DTYPES)
        group = check_group("group", group)
        t0 = time.perf_counter()
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        flat = bucket.detach().reshape(-1)
        visit = self._visits.get(index, 0)
        self._visits[index] = visit + 1
        sample = AuditSample.choose(flat.numel(), world, self.sample, visit)
        mine = sample.take(flat)
        m = mine.numel()
        rows = torch.empty(world * m, dtype=mine.dtype, device=mine.device)
        all_gather_flat(rows, mine, group)
        received = (world - 1) * m * mine.element_size()
        native_result = None
        if native:
            native_result = mine if mine.data_ptr() != flat.data_ptr() else mine.clone()
            if average:
                native_result.div_(world)
            if factor is not None:
                native_result.mul_(factor)
            dist.all_reduce(native_result, op=dist.ReduceOp.SUM, group=group)
            received += 2 * (world - 1) * m * mine.element_size() // world  # a ring's share per rank
        # fp64 sum in rank order of P values of <= 24 significand bits: error <= (P - 1) 2^-53 sum |x_i|.
        per_rank = rows.view(world, m)
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
            sample=sample,
        )

    def record(self, result: AuditResult) -> None:
        self.results.append(result)
        if self.on_audit is not None:
            self.on_audit(result)
