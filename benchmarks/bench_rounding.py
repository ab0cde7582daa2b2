"""Throughput of ``mixprec.emulate.round_to`` (round to nearest) against torch's own cast, in the same run.

The baseline the verdict uses is ``x.to(dtype).float()``: it gives exactly round_to's result (an fp32 tensor of
values representable in ``dtype``, bit for bit) and, like ``round_to(x, fmt)``, allocates it; so the two do the
same job for a user. The bare ``x.to(dtype)`` is shown too: it writes 1-2 bytes per element instead of 4, a
smaller result that round_to does not produce. round_to is timed on the compiled kernel (``mixprec.native``),
with a preallocated ``out=`` and in place (``round_to_``), and on the torch path (``mixprec.native.disabled()``).
The goal: the compiled round_to at most 1.5x the cast at 1M and 16M elements, 1 and 2 threads. Other inputs and
modes are listed for reference (no torch baseline: torch's fp64 casts round twice, and torch has no toward-zero
or stochastic cast); stochastic rounding draws its fp64 uniforms with ``torch.rand``, timed alone as the floor.

    python benchmarks/bench_rounding.py [--quick] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

import mixprec.native as native
from _common import machine_header, markdown_table
from mixprec.emulate import round_to, round_to_

FORMATS = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
GOAL = 1.5


def _time_per_call(fns: list[Callable[[], object]], *, min_seconds: float, samples: int) -> list[float]:
    """Median seconds per call of each of ``fns``. Each sample calls one function in a loop until ``min_seconds``
    have passed (no sample below the clock's resolution); the functions take turns sample by sample, so that a
    change of machine load falls on all of them alike."""
    per_call: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(samples):
        for fn, out in zip(fns, per_call, strict=True):
            calls = 0
            t0 = time.perf_counter()
            while True:
                fn()
                calls += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= min_seconds:
                    break
            out.append(elapsed / calls)
    return [sorted(v)[len(v) // 2] for v in per_call]


def _torch_path(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with native.disabled():
            return fn()

    return run


def _bench_format(x: torch.Tensor, name: str, dtype: torch.dtype, timer: Callable[..., list[float]]) -> list[object]:
    out = torch.empty_like(x)
    work = round_to(x, name)
    # in place on values that are already representable: the compiled pass and the torch path's ops are the same
    # data-independent passes for any input (only NaN or overflow add passes on the torch path), so no refill has
    # to be timed and subtracted
    t_back, t_bare, t_new, t_out, t_inplace, t_torch = timer(
        [
            lambda: x.to(dtype).float(),
            lambda: x.to(dtype),
            lambda: round_to(x, name),
            lambda: round_to(x, name, out=out),
            lambda: round_to_(work, name),
            _torch_path(lambda: round_to(x, name)),
        ]
    )
    ratio = t_new / t_back
    verdict = f"ok (<= {GOAL}x)" if ratio <= GOAL else f"MISSED (> {GOAL}x)"
    ms = [t * 1e3 for t in (t_back, t_bare, t_new, t_out, t_inplace, t_torch)]
    return [torch.get_num_threads(), name, x.numel(), *ms, ratio, t_out / t_back, t_inplace / t_back,
            t_new / t_bare, t_torch / t_back, t_torch / t_new, verdict]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M elements, fewer repeats (seconds)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch intra-op thread counts (default 1,2)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    sizes = [1 << 20] if args.quick else [1 << 20, 1 << 24]
    # each timing: the median of 3 (quick) or 15 samples of >= 20 ms (quick) or 100 ms of back-to-back calls
    timer = functools.partial(_time_per_call, min_seconds=0.02 if args.quick else 0.1, samples=3 if args.quick else 15)
    print(machine_header("round_to (round to nearest even, fp32 input) vs torch's cast"))
    print(f"- kernels: {native.describe()}")
    if native.library() is None:
        print("- the compiled columns ran the torch path too: no compiled kernels in this process")
    print()
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for n in sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 100
            for name, dtype in FORMATS.items():
                rows.append(_bench_format(x, name, dtype, timer))
    print(
        markdown_table(
            ["threads", "format", "elements", "torch .to().float() ms", "torch .to() ms", "round_to ms",
             "round_to(out=) ms", "round_to_ ms", "torch-path round_to ms", "round_to / cast", "out= / cast",
             "in-place / cast", "round_to / bare .to()", "torch path / cast", "speedup vs torch path",
             f"goal <= {GOAL}x"],
            rows,
        )
    )  # fmt: skip
    print()
    print(machine_header("round_to: other inputs and modes (compiled where it applies; no torch equivalent)"))
    n = sizes[-1]
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 100
    x16, xb = x.half(), x.bfloat16()
    x64 = x.double() * (1 + 1e-9)
    gen = torch.Generator().manual_seed(2)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("fp32 -> fp16 nearest", lambda: round_to(x, "fp16")),
        ("fp32 -> tf32 nearest", lambda: round_to(x, "tf32")),
        ("fp16 input -> bf16 nearest", lambda: round_to(x16, "bf16")),
        ("bf16 input -> fp16 nearest", lambda: round_to(xb, "fp16")),
        ("fp64 -> fp16 nearest (one rounding)", lambda: round_to(x64, "fp16")),
        ("fp32 -> fp16 toward_zero", lambda: round_to(x, "fp16", "toward_zero")),
        ("fp32 -> fp16 stochastic", lambda: round_to(x, "fp16", "stochastic", gen)),
        ("fp32 -> bf16 stochastic", lambda: round_to(x, "bf16", "stochastic", gen)),
        ("fp64 -> fp16 stochastic", lambda: round_to(x64, "fp16", "stochastic", gen)),
        ("its draws alone: torch.rand fp64", lambda: torch.rand(n, generator=gen, dtype=torch.float64)),
    ]
    times = timer(
        [lambda: x.to(torch.float16).float()] + [fn for _, fn in cases] + [_torch_path(fn) for _, fn in cases]
    )
    base, compiled, torch_path = times[0], times[1 : 1 + len(cases)], times[1 + len(cases) :]
    print(
        markdown_table(
            ["operation", "threads", "elements", "ms", "torch-path ms", "time / torch fp32->fp16->fp32 cast"],
            [[label, torch.get_num_threads(), n, t * 1e3, tt * 1e3, t / base]
             for (label, _), t, tt in zip(cases, compiled, torch_path, strict=True)],
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
