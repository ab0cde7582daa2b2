"""Shared by the benchmark scripts: a header naming date, machine and command, timing, and tables."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_header(title: str) -> str:
    """Markdown lines: date (UTC), machine, torch version, load average and the exact command."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    cmd = " ".join(["python", *sys.argv])
    return "\n".join(
        [
            f"### {title}",
            "",
            f"- date: {now}",
            f"- machine: {os.cpu_count()} cores, {cpu_model()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads",
            f"- load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
            f"- command: `{cmd}`",
            "",
        ]
    )


def time_it(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 10) -> float:
    """Median seconds per call over ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def time_alternating(
    fn_a: Callable[[], object], fn_b: Callable[[], object], *, warmup: int = 2, repeat: int = 10
) -> tuple[float, float]:
    """Median seconds per call of ``fn_a`` and ``fn_b``, called in turns (a, b, a, b, ...) so that a change of
    machine load during the measurement falls on both alike."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    a, b = [], []
    for _ in range(repeat):
        for fn, out in ((fn_a, a), (fn_b, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    a.sort()
    b.sort()
    return a[len(a) // 2], b[len(b) // 2]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
