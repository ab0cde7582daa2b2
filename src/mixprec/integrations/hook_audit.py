"""The live audit as every torch DDP comm hook state of mixprec runs it (one definition for all of them).

torch DDP calls a comm hook once per bucket, in bucket index order, on every synced backward: bucket 0 starts a
step and ``bucket.is_last()`` ends it. :class:`AuditedHookState` turns that into the calls
:class:`mixprec.comm.live_audit.LiveAudit` needs: one :meth:`~LiveAudit.new_step` per step, the number of
buckets once a step has ended (so the audited bucket rotates over all of them), and :meth:`~LiveAudit.begin` on
the one bucket to audit. ``ReducerHookState``, ``CompressedHookState`` and ``FP32HookState`` inherit it; each hook
calls :meth:`AuditedHookState._begin_audit` before it reduces a bucket and finishes the returned audit after.
Cost and what a row holds: ``docs/parallel.md``, "Live numerics audit".
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.live_audit import AuditResult, LiveAudit, PendingAudit

__all__ = ["AuditedHookState"]


class AuditedHookState:
    """Mixin: ``audit`` (the :class:`LiveAudit`), :attr:`audit_results`, :attr:`audit_rows`."""

    audit: LiveAudit

    def _init_audit(self, audit_every: int | None, on_audit: Callable[[AuditResult], None] | None) -> None:
        self.audit = LiveAudit(audit_every, on_audit=on_audit)
        self._num_buckets: int | None = None  # buckets per step, known once a last bucket was seen
        self._audit_bucket: int | None = None

    @property
    def audit_results(self) -> list[AuditResult]:
        """This rank's live-audit results, oldest first (``audit_every``)."""
        return self.audit.results

    @property
    def audit_rows(self) -> list[dict[str, Any]]:
        """:attr:`audit_results` as ``metrics.jsonl`` rows (the ``audit_*`` keys of ``AuditResult.as_row``)."""
        return [r.as_row() for r in self.audit.results]

    def _begin_audit(
        self,
        buffer: torch.Tensor,
        index: int,
        *,
        is_last: bool,
        group: dist.ProcessGroup | None,
        native: bool,
    ) -> PendingAudit | None:
        """Start auditing ``buffer`` (bucket ``index``) if it is this step's audited bucket, else None."""
        if not self.audit.enabled:
            return None
        if index == 0:  # torch DDP runs the hook on its buckets in index order: bucket 0 starts a step
            self._audit_bucket = self.audit.new_step(self._num_buckets)
        if is_last:
            self._num_buckets = index + 1
        if index != self._audit_bucket:
            return None
        return self.audit.begin(buffer, group, average=True, native=native, index=index)
