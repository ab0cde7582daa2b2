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

import torch

from _common import machine_header, markdown_table, time_it
from mixprec.emulate import round_to, round_to_

FORMATS = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _bench_format(x: torch.Tensor, name: str, dtype: torch.dtype, repeat: int) -> list[object]:
    n = x.numel()
    out = torch.empty_like(x)
    work = x.clone()
    t_cast = time_it(lambda: x.to(dtype), repeat=repeat)
    t_back = time_it(lambda: x.to(dtype).float(), repeat=repeat)
    t_out = time_it(lambda: round_to(x, name, out=out), repeat=repeat)
    t_inplace = time_it(lambda: round_to_(work.copy_(x), name), repeat=repeat)
    t_copy = time_it(lambda: work.copy_(x), repeat=repeat)
    t_inplace = max(t_inplace - t_copy, 0.0)  # the refill is not part of the rounding
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
    repeat = 5 if args.quick else 15
    print(machine_header("round_to vs torch's cast (fp32 input, round to nearest even)"))
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 100
        for name, dtype in FORMATS.items():
            rows.append(_bench_format(x, name, dtype, repeat))
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
    base = time_it(lambda: x.to(torch.float16).float(), repeat=repeat)
    other = [
        ("fp32 -> fp16 nearest", time_it(lambda: round_to(x, "fp16"), repeat=repeat)),
        ("fp64 -> fp16 nearest (one rounding)", time_it(lambda: round_to(x64, "fp16"), repeat=repeat)),
        ("fp32 -> fp16 toward_zero", time_it(lambda: round_to(x, "fp16", "toward_zero"), repeat=repeat)),
        ("fp32 -> fp16 stochastic", time_it(lambda: round_to(x, "fp16", "stochastic", gen), repeat=repeat)),
        ("fp32 -> tf32 nearest", time_it(lambda: round_to(x, "tf32"), repeat=repeat)),
    ]
    print(
        markdown_table(
            ["operation", "elements", "Melem/s", "time / torch fp32->fp16->fp32 cast"],
            [[label, n, n / t / 1e6, t / base] for label, t in other],
        )
    )


if __name__ == "__main__":
    main()
