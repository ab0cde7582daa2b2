"""Measuring the extra memory a collective allocates, from torch's own allocation events.

``tracemalloc`` does not see torch's allocator and the CPU allocator keeps no peak statistics, so this
runs the function under ``torch.profiler`` with ``profile_memory=True`` and reads the allocator's running
total (``total_allocated``) from every allocation and free event it records. The peak of that running
total, relative to its value before the first event, is the peak extra memory the function held through
torch: every tensor it allocated, including temporaries inside single ops. Memory a backend allocates
outside torch (gloo's internal transport buffers) is not visible here; benchmarks report the process's
peak RSS beside it for that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["measure_peak_allocated"]

T = TypeVar("T")


def _allocation_totals(nodes: Any) -> list[tuple[int, int, int]]:
    """(time ns, alloc size, running total) of every allocator event in an event tree, unsorted."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            out.append((node.start_time_ns, int(fields.alloc_size), int(fields.total_allocated)))
        stack.extend(node.children)
    return out


def measure_peak_allocated(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(its result, peak extra bytes allocated through torch)``.

    Extra means above what was allocated when ``fn`` started; memory ``fn`` still holds at the end (its
    result) counts towards the peak. Only the calling process's CPU (and, where the profiler records it,
    CUDA) allocations are seen. Costs a profiler session: for tests and benchmarks, not hot paths.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    try:
        tree = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError as exc:  # private API: say so rather than report a wrong number
        raise RuntimeError(f"this torch ({torch.__version__}) does not expose the profiler's event tree") from exc
    events = sorted(_allocation_totals(tree))
    if not events:
        return result, 0
    # The running total before the first event is that event's total minus its own size.
    baseline = events[0][2] - events[0][1]
    return result, max(0, max(total for _, _, total in events) - baseline)
