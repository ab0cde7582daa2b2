"""One handle type for the asynchronous collectives of mixprec.comm and mixprec.parallel.

A :class:`PendingReduction` wraps the work that finishes a started reduction (wait for the communication,
then sum, round, all-gather, ...). Its state changes only once that work has returned:

* success: the handle is done; later ``wait()`` calls return at once;
* failure: the exception is stored and raised again by every later ``wait()``, so a caller that waits a
  second time (or a wrapper that waits on everything in a ``finally``) never takes an unreduced output
  for a reduced one.

:func:`wait_all` waits for every handle of a list even when one fails, so that no started collective is left
behind to be finished later, at a point where the other ranks are issuing different collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["PendingReduction", "wait_all"]


class PendingReduction:
    """Handle of an asynchronous reduction; ``wait()`` finishes it (blocking, on the calling thread).

    Args:
        finish: called once by the first ``wait()``; it blocks until the communication is done and runs the
            local work that completes the result (e.g. the fp32 sum and the rounding). What it returns
            (None for most collectives; per-call statistics for the compressed ones) is what every
            successful ``wait()`` returns.

    ``wait()`` may be called any number of times: after a success it returns the same result at once; after
    a failure it raises the stored exception again (the output is not valid).
    """

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None
        self._error: BaseException | None = None
        self._running = False

    @classmethod
    def completed(cls) -> PendingReduction:
        """A handle of a reduction that has already finished."""
        handle = cls(lambda: None)
        handle._finish = None
        return handle

    def wait(self) -> Any:
        if self._error is not None:
            raise self._error
        finish = self._finish
        if finish is None:
            return self._result
        if self._running:
            raise RuntimeError("PendingReduction.wait() called again from inside its own finishing work")
        self._running = True
        try:
            self._result = finish()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._running = False
        self._finish = None
        return self._result

    def is_completed(self) -> bool:
        """True once ``wait()`` has finished successfully (the local work runs only inside ``wait()``)."""
        return self._finish is None and self._error is None

    def failed(self) -> bool:
        """True when a ``wait()`` raised; every later ``wait()`` raises the same exception."""
        return self._error is not None


def wait_all(handles: Iterable[Any]) -> None:
    """``wait()`` on every handle (None entries skipped), in order, even when some raise; then raise the
    first exception (the later ones are secondary: a failed peer usually fails every collective after it)."""
    first: BaseException | None = None
    for handle in handles:
        if handle is None:
            continue
        try:
            handle.wait()
        except Exception as exc:  # collected and re-raised below; KeyboardInterrupt etc. stop at once
            if first is None:
                first = exc
    if first is not None:
        raise first
