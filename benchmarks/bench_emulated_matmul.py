"""Time of ``mixprec.emulate.matmul`` per preset against a plain fp32 ``torch.matmul`` of the same shape, in the
same run (the emulator's cost is a multiple of what the fp32 product costs; the issue asks "fp16/16" to stay
within 10x at M=N=K=1024). torch's own fp16 matmul on the CPU (the naive way to "try fp16") is listed at the
smallest size for reference: it is not a model of any GPU accumulator and runs at ~1 GFLOP/s.

    python benchmarks/bench_emulated_matmul.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from _common import machine_header, markdown_table, time_it
from mixprec.emulate import MATMUL_PRESETS, matmul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M=N=K=256 only, fewer repeats (seconds)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [256] if args.quick else [256, 512, 1024]
    repeat = 3 if args.quick else 5
    print(machine_header("emulated matmul vs fp32 torch.matmul (M=N=K, N(0,1) inputs)"))
    rows = []
    for size in sizes:
        gen = torch.Generator().manual_seed(size)
        a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
        t32 = time_it(lambda a=a, b=b: a @ b, repeat=max(repeat, 10))
        flops = 2 * size**3
        rows.append([size, "torch fp32 (baseline)", t32 * 1e3, flops / t32 / 1e9, 1.0])
        if size == sizes[0]:
            a16, b16 = a.half(), b.half()
            t16 = time_it(lambda a16=a16, b16=b16: a16 @ b16, warmup=1, repeat=2)
            rows.append([size, "torch fp16 on CPU", t16 * 1e3, flops / t16 / 1e9, t16 / t32])
        for name in MATMUL_PRESETS:
            # the alignment model materialises every group's products: time it on 1/8 of the rows, scaled up
            frac = 8 if MATMUL_PRESETS[name].align_bits is not None else 1
            aa = a[: size // frac]
            t = time_it(lambda aa=aa, b=b, name=name: matmul(aa, b, mode=name), warmup=1, repeat=repeat) * frac
            label = name + (f" (timed on {size // frac} rows, x{frac})" if frac > 1 else "")
            rows.append([size, label, t * 1e3, flops / t / 1e9, t / t32])
    print(markdown_table(["M=N=K", "matmul", "ms", "GFLOP/s", "time / fp32 matmul"], rows))


if __name__ == "__main__":
    main()
