"""The block-scaled gradient wire (``BlockScaledWire``) on one thread: encode + decode of a 16M-element fp32 bucket
by the compiled kernels (``csrc/mx_wire.c``) against ``copy_`` of the same bucket, and against the wire's torch path.

One thread (``torch.set_num_threads(1)``; the kernels take torch's thread count); every buffer preallocated:
``encode_rows(x, codes)`` then ``decode_rows(codes, n, out)`` (the row API the collectives call) against
``out.copy_(x)``. Rows: MXFP8 e4m3 (rceil scale) and NVFP4 (E4M3 block scale, fp32 scale per 2048-element
chunk), round to nearest and stochastic (Philox, bit-identical to the torch path), and MXFP8 with error feedback
folded into the encode (``encode_feedback_rows``: the residual read and rewritten in the same pass). Pairs that
form a ratio are timed in turns (``time_alternating``) in WINDOWS windows and the median window's ratio is
reported, as bench_quantize.py and bench_mx.py do, so that a burst of load falls on both sides. The torch path
runs a few times on the same bucket for scale. Goal (printed as a verdict): encode + decode at most 2.5x ``copy_``.

    python benchmarks/bench_blockscaled_wire.py [--quick] [--elements N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from _common import machine_header, markdown_table, time_alternating, time_it
from mixprec import native
from mixprec.compress import BlockScaledWire

GOAL_VS_COPY = 2.5
WINDOWS = 5


def in_windows(fn_a: Callable[[], object], fn_b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """``time_alternating`` in WINDOWS windows: the times of the window whose ratio b / a is the median."""
    runs = [time_alternating(fn_a, fn_b, repeat=repeat, warmup=1) for _ in range(WINDOWS)]
    return sorted(runs, key=lambda ab: ab[1] / ab[0])[WINDOWS // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1M elements, few repetitions: a smoke run")
    ap.add_argument("--elements", type=int, default=1 << 24, help="fp32 elements in the bucket")
    args = ap.parse_args()
    n = (1 << 20) if args.quick else args.elements
    repeat = 3 if args.quick else 7
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n // 4096, 4096, generator=g) * torch.exp(torch.randn(n // 4096, 1, generator=g) * 4)).view(1, -1)
    out = torch.empty_like(x)
    print(machine_header("Block-scaled wire encode + decode (fp32 bucket, one thread): compiled vs copy_, torch path"))
    print(f"- path: {native.describe()}")
    print(f"- {n / 2**20:g}M fp32 elements, one row; ratios: the median of {WINDOWS} windows of {repeat} turns")
    print()
    rows = []
    cases = [
        ("mxfp8_e4m3", "nearest", False),
        ("mxfp8_e4m3", "stochastic", False),
        ("mxfp8_e4m3", "nearest", True),
        ("nvfp4", "nearest", False),
        ("nvfp4", "stochastic", False),
    ]
    for wire, rounding, feedback in cases:
        comp = BlockScaledWire(wire, rounding=rounding)
        codes = torch.empty(1, comp.encoded_nbytes(n), dtype=torch.uint8)
        residual = torch.zeros_like(x)

        def encode(comp: BlockScaledWire = comp, codes: torch.Tensor = codes, res: torch.Tensor = residual,
                   feedback: bool = feedback) -> None:  # fmt: skip
            if feedback:
                comp.encode_feedback_rows(x, res, codes, key=1)
            else:
                comp.encode_rows(x, codes, key=1)

        def encode_decode(comp: BlockScaledWire = comp, codes: torch.Tensor = codes, encode: Callable = encode) -> None:
            encode()
            comp.decode_rows(codes, n, out)

        t_copy, t_wire = in_windows(lambda: out.copy_(x), encode_decode, repeat)
        t_enc = time_it(encode, repeat=repeat, warmup=1)
        t_dec = time_it(lambda c=comp, b=codes: c.decode_rows(b, n, out), repeat=repeat, warmup=1)
        with native.disabled():
            t_torch = time_it(encode_decode, repeat=max(1, repeat // 3), warmup=1)
        ratio = t_wire / t_copy
        verdict = "met" if ratio <= GOAL_VS_COPY else "NOT met"
        name = f"{wire} {rounding}{' + error feedback' if feedback else ''}"
        verdict = f"{ratio:.2f}x ({verdict}: <= {GOAL_VS_COPY}x)"
        rows.append([name, t_copy * 1e3, t_enc * 1e3, t_dec * 1e3, t_wire * 1e3, verdict, t_torch * 1e3,
                     f"{t_torch / t_wire:.1f}x"])  # fmt: skip
    header = ["wire", "copy_ ms", "encode ms", "decode ms", "encode + decode ms", "(encode + decode) / copy_",
              "torch path ms", "torch path / compiled"]  # fmt: skip
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
