"""Fault injection for testing how ``mixprec train`` handles failures.

``MIXPREC_FAULT=RANK:STEP:MODE`` makes rank RANK, at the start of step STEP, either exit at once with code 13
(``exit``, a crash) or stop responding (``hang``). Unset, :func:`maybe_inject_fault` does nothing.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["FAULT_EXIT_CODE", "maybe_inject_fault"]

FAULT_EXIT_CODE = 13


def maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get("MIXPREC_FAULT")
    if not spec:
        return
    try:
        f_rank, f_step, mode = spec.split(":")
        f_rank_i, f_step_i = int(f_rank), int(f_step)
    except ValueError:
        raise ValueError(f"MIXPREC_FAULT must be RANK:STEP:MODE (MODE exit or hang); got {spec!r}") from None
    if mode not in ("exit", "hang"):
        raise ValueError(f"MIXPREC_FAULT mode must be 'exit' or 'hang'; got {mode!r}")
    if f_rank_i != rank or f_step_i != step:
        return
    print(f"rank {rank}: MIXPREC_FAULT: {mode} at step {step}", file=sys.stderr, flush=True)
    if mode == "exit":
        os._exit(FAULT_EXIT_CODE)
    while True:
        time.sleep(3600)
