"""Time of ``mixprec.emulate.matmul`` per preset against a plain fp32 ``torch.matmul`` of the same shape, at 1 and 2
threads in the same run: the compiled kernel (``mixprec.native``) and the torch path (``mixprec.native.disabled()``),
with their ratios to fp32 and the verdict against the goal of at most 5x fp32. Shapes are M x N x K (a is M x K,
b is K x N); inputs N(0,1). Calls are interleaved (fp32, compiled, torch path, fp32, ...) so that a change of
machine load falls on all alike; medians are reported. "same bits" compares the two emulated results.

    python benchmarks/bench_emulated_matmul.py [--quick] [--threads 1 2] [--skip-large-torch-path]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import mixprec.native as native
from _common import machine_header, markdown_table
from mixprec.emulate import matmul

GOAL = 5.0
PRESETS = ("fp16/16", "fp16/32", "bf16/32", "two_stage")


def time_interleaved(fns: list[Callable[[], object]], *, warmup: int, repeat: int) -> list[float]:
    """Median seconds per call of each function, called in turns."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [sorted(s)[len(s) // 2] for s in samples]


def torch_path(a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    with native.disabled():
        return matmul(a, b, mode=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256^3 and 512 x 512 x 256 only, fewer repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default: 1 2)")
    parser.add_argument(
        "--skip-large-torch-path", action="store_true", help="do not time the slow torch path at the larger shape"
    )
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per function (default 5, quick 2)")
    args = parser.parse_args()
    shapes = [(256, 256, 256), (512, 512, 256)] if args.quick else [(1024, 1024, 1024), (4096, 4096, 1024)]
    repeat = args.repeat or (2 if args.quick else 5)
    print(machine_header("emulated matmul vs fp32 torch.matmul (M x N x K, N(0,1) inputs)"))
    print(f"- kernels: {native.describe()}")
    print()
    rows = []
    for m, n, k in shapes:
        gen = torch.Generator().manual_seed(m + n + k)
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        with_torch_path = not (args.skip_large_torch_path and (m, n, k) == shapes[-1])
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name in PRESETS:
                fns: list[Callable[[], object]] = [
                    lambda a=a, b=b: a @ b,
                    lambda a=a, b=b, name=name: matmul(a, b, mode=name),
                ]
                if with_torch_path:
                    fns.append(lambda a=a, b=b, name=name: torch_path(a, b, name))
                times = time_interleaved(fns, warmup=1, repeat=repeat)
                t32, tc = times[0], times[1]
                tt = times[2] if with_torch_path else None
                same = "skipped"
                if with_torch_path:
                    got, want = matmul(a, b, mode=name), torch_path(a, b, name)
                    same = "yes" if torch.equal(got.view(torch.int32), want.view(torch.int32)) else "NO"
                rows.append(
                    [
                        f"{m}x{n}x{k}",
                        threads,
                        name,
                        t32 * 1e3,
                        tc * 1e3,
                        "-" if tt is None else tt * 1e3,
                        tc / t32,
                        "-" if tt is None else tt / t32,
                        "-" if tt is None else tt / tc,
                        "yes" if tc / t32 <= GOAL else "NO",
                        same,
                    ]
                )
    header = [
        "M x N x K",
        "threads",
        "preset",
        "fp32 ms",
        "compiled ms",
        "torch path ms",
        "compiled / fp32",
        "torch path / fp32",
        "speed-up",
        f"<= {GOAL:g}x",
        "same bits",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
