"""Throughput of ``mixprec.emulate.round_to`` against torch's own cast, in the same run.

The baseline is what a user would write for formats torch has: ``x.to(dtype).float()`` (round, then back to
fp32, the form round_to returns), and the bare ``x.to(dtype)``. round_to is timed with a preallocated ``out=``
and in place (``round_to_``); fp64 input (direct rounding from fp64) and the other rounding modes are listed
for reference (no torch baseline: torch's fp64 casts round twice, and torch has no toward-zero or stochastic
cast).

    python benchmarks/bench_rounding.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from _common import machine_header, markdown_table
from mixprec.emulate import round_to, round_to_

FORMATS = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _time_per_call(fn: Callable[[], object], *, min_seconds: float, samples: int) -> float:
    """Median seconds per call over ``samples`` samples; each sample calls ``fn`` in a loop until ``min_seconds``
    have passed, so that no sample is below the clock's resolution (a 1M-element cast takes ~0.1-1 ms)."""
    fn()  # warm-up
    per_call = []
    for _ in range(samples):
        calls = 0
        t0 = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        per_call.append(elapsed / calls)
    per_call.sort()
    return per_call[len(per_call) // 2]


def _bench_format(x: torch.Tensor, name: str, dtype: torch.dtype, timer: Callable[..., float]) -> list[object]:
    n = x.numel()
    out = torch.empty_like(x)
    work = round_to(x, name)
    t_cast = timer(lambda: x.to(dtype))
    t_back = timer(lambda: x.to(dtype).float())
    t_out = timer(lambda: round_to(x, name, out=out))
    # in place on values that are already representable: the rounding's ops are the same data-independent passes
    # for any input (only NaN or overflow take extra passes, and there are none here after the first rounding),
    # so no refill has to be timed and subtracted
    t_inplace = timer(lambda: round_to_(work, name))
    return [name, n, n / t_back / 1e6, n / t_out / 1e6, n / t_inplace / 1e6, t_out / t_back, t_inplace / t_back,
            t_out / t_cast]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M elements, fewer repeats (seconds)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [1 << 20] if args.quick else [1 << 20, 1 << 24]
    # each timing: the median of 5 (quick) or 15 samples of >= 20 ms (quick) or 100 ms of back-to-back calls
    timer = functools.partial(_time_per_call, min_seconds=0.02 if args.quick else 0.1, samples=5 if args.quick else 15)
    print(machine_header("round_to vs torch's cast (fp32 input, round to nearest even)"))
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 100
        for name, dtype in FORMATS.items():
            rows.append(_bench_format(x, name, dtype, timer))
    print(
        markdown_table(
            ["format", "elements", "torch .to().float() Melem/s", "round_to(out=) Melem/s", "round_to_ Melem/s",
             "ratio out= / torch", "ratio in-place / torch", "ratio out= / bare .to()"],
            rows,
        )
    )  # fmt: skip
    print()
    print(machine_header("round_to: other inputs and modes (no torch equivalent)"))
    n = sizes[-1]
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 100
    x64 = x.double() * (1 + 1e-9)
    gen = torch.Generator().manual_seed(2)
    base = timer(lambda: x.to(torch.float16).float())
    other = [
        ("fp32 -> fp16 nearest", timer(lambda: round_to(x, "fp16"))),
        ("fp64 -> fp16 nearest (one rounding)", timer(lambda: round_to(x64, "fp16"))),
        ("fp32 -> fp16 toward_zero", timer(lambda: round_to(x, "fp16", "toward_zero"))),
        ("fp32 -> fp16 stochastic", timer(lambda: round_to(x, "fp16", "stochastic", gen))),
        ("fp32 -> tf32 nearest", timer(lambda: round_to(x, "tf32"))),
    ]
    print(
        markdown_table(
            ["operation", "elements", "Melem/s", "time / torch fp32->fp16->fp32 cast"],
            [[label, n, n / t / 1e6, t / base] for label, t in other],
        )
    )


if __name__ == "__main__":
    main()
