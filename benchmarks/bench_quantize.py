"""Throughput of MinMaxUInt8 and ScaledFP8 encode + decode as a fraction of a plain ``copy_`` of the same
fp32 tensor.

``copy_`` (read 4N bytes, write 4N) is the memory-bandwidth limit of any pass over the data. Also timed in
the same run: the straightforward torch version a user would write (fresh tensors, whole-tensor passes,
torch's float->uint8 cast) and torch's own fp32 -> bf16 cast (the cost of the bf16 wire format). The fp8
rows (e4m3, e5m2 with a power-of-two scale per chunk) put torch's fp32 -> float8 cast beside them.

    python benchmarks/bench_quantize.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from _common import machine_header, markdown_table, time_it
from mixprec.compress import MinMaxUInt8, ScaledFP8


def naive_encode(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one would write first: fresh tensors, whole-tensor passes (offset first, for a fair comparison)."""
    x2 = x.view(-1, chunk)
    lo, hi = torch.aminmax(x2, dim=1, keepdim=True)
    scale = 255.0 / (hi - lo).clamp_min(1e-30)
    codes = ((x2 - lo) * scale).round().to(torch.uint8)
    return codes, lo, hi


def naive_decode(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (codes.float() * ((hi - lo) / 255.0) + lo).view(-1)


def measure(n: int, chunk: int, repeat: int) -> list[list[object]]:
    """One table row per rounding mode for an n-element fp32 tensor (all baselines timed in this call)."""
    x = torch.randn(n) * 3 + 1
    dst = torch.empty_like(x)
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    t_copy = time_it(lambda: dst.copy_(x), repeat=repeat)
    t_cast = time_it(lambda: bf16.copy_(x), repeat=repeat)
    t_naive = time_it(lambda: naive_decode(*naive_encode(x, chunk)), repeat=repeat)
    rows: list[list[object]] = []
    for rounding in ("nearest", "stochastic"):
        q = MinMaxUInt8(chunk_size=chunk, rounding=rounding, generator=torch.Generator().manual_seed(0))
        buf = q.encode(x)
        t_enc = time_it(lambda: q.encode(x, out=buf), repeat=repeat)  # noqa: B023 - called right here
        t_dec = time_it(lambda: q.decode(buf, n, out=dst), repeat=repeat)  # noqa: B023
        t_both = t_enc + t_dec
        row: list[object] = [f"{n / 2**20:.0f}M", rounding, t_copy * 1e3, t_enc * 1e3, t_dec * 1e3]
        row += [t_copy / t_both, 4 * n / t_both / 1e9]
        row += [t_naive * 1e3, t_naive / t_both, t_cast * 1e3] if rounding == "nearest" else ["", "", ""]
        rows.append(row)
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        fp8 = torch.empty(n, dtype=dtype)
        t_cast8 = time_it(lambda: fp8.copy_(x), repeat=repeat)  # noqa: B023
        for rounding in ("nearest", "stochastic"):
            f = ScaledFP8(fmt, chunk_size=chunk, rounding=rounding, generator=torch.Generator().manual_seed(0))
            buf = f.encode(x)
            t_enc = time_it(lambda: f.encode(x, out=buf), repeat=repeat)  # noqa: B023
            t_dec = time_it(lambda: f.decode(buf, n, out=dst), repeat=repeat)  # noqa: B023
            t_both = t_enc + t_dec
            row = [f"{n / 2**20:.0f}M", f"fp8 {fmt} {rounding}", t_copy * 1e3, t_enc * 1e3, t_dec * 1e3]
            row += [t_copy / t_both, 4 * n / t_both / 1e9, "", "", f"fp32->{fmt} cast {t_cast8 * 1e3:.3g}"]
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (seconds)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = what each rank uses)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [1 << 20, 1 << 22] if args.quick else [1 << 20, 1 << 24, 1 << 26]
    repeat = 3 if args.quick else 7
    chunk = 2048

    print(machine_header("MinMaxUInt8 and ScaledFP8 encode + decode throughput vs copy_ (fp32 input)"))
    rows = []
    for n in sizes:
        rows += measure(n, chunk, repeat)
    print(
        markdown_table(
            [
                "elements",
                "wire, rounding",
                "copy_ ms",
                "encode ms",
                "decode ms",
                "enc+dec as fraction of copy_",
                "enc+dec GB/s of fp32",
                "naive torch enc+dec ms",
                "speedup vs naive",
                "fp32->bf16 cast ms (fp8 rows: fp32->fp8 cast ms)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
