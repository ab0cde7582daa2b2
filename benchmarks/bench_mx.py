"""MXFP8 (e4m3, floor scale, blocks of 32) fake quantization of 16M fp32 elements on one thread: the compiled
kernel (``csrc/mx.c``) against a copy of the same tensor, mixprec's torch path and torchao's CPU reference.

One thread everywhere (``torch.set_num_threads(1)``; the kernel takes torch's thread count). Outputs are
preallocated: ``fake_quantize(x, "mxfp8_e4m3", out=dst)`` and ``dst.copy_(x)``; ``clone()`` (which allocates
and first-touches 64 MB per call) is shown beside ``copy_``. torchao's reference is ``to_mx`` (fp8 data and E8M0
scales) then ``to_dtype`` back to fp32, its eager CPU path (torchao 0.18; the column is skipped when torchao is not
installed). Pairs that form a ratio are timed in turns (``time_alternating``) in WINDOWS windows and the median
window's ratio is reported, as bench_quantize.py does, so that a burst of load falls on both sides.
Goals (printed as verdicts): compiled at most 2x ``clone()`` (and, the stricter bar, 2x ``copy_``), at least 10x
faster than torchao.

    python benchmarks/bench_mx.py [--quick] [--elements N]
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch

from _common import machine_header, markdown_table, time_alternating, time_it
from mixprec import native
from mixprec.core.mx import fake_quantize

GOAL_VS_CLONE = 2.0
GOAL_VS_TORCHAO = 10.0
WINDOWS = 5


def in_windows(fn_a: Callable[[], object], fn_b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """``time_alternating`` in WINDOWS windows: the times of the window whose ratio b / a is the median."""
    runs = [time_alternating(fn_a, fn_b, repeat=repeat, warmup=1) for _ in range(WINDOWS)]
    return sorted(runs, key=lambda ab: ab[1] / ab[0])[WINDOWS // 2]


def torchao_reference() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchao's MXFP8 e4m3 quantize + dequantize (floor scale), or None when torchao is not installed."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from torchao.prototype.mx_formats import config, mx_tensor
    except ImportError:
        return None
    mode = config.ScaleCalculationMode.FLOOR

    def run(x: torch.Tensor) -> torch.Tensor:
        scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode)
        return mx_tensor.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1M elements, few repetitions: a smoke run")
    ap.add_argument("--elements", type=int, default=1 << 24, help="fp32 elements (a multiple of 4096)")
    args = ap.parse_args()
    n = (1 << 20) if args.quick else args.elements
    repeat = 3 if args.quick else 9
    torch.set_num_threads(1)
    x = torch.randn(n // 4096, 4096, generator=torch.Generator().manual_seed(0))
    x *= torch.exp(torch.randn(x.shape[0], 1, generator=torch.Generator().manual_seed(1)) * 4)
    dst = torch.empty_like(x)

    def compiled() -> None:
        fake_quantize(x, "mxfp8_e4m3", out=dst)

    print(machine_header("MXFP8 e4m3 fake quantization (fp32, one thread): compiled vs copy, torch path, torchao"))
    print(f"- path: {native.describe()}")
    print(f"- {n / 2**20:g}M fp32 elements as [{x.shape[0]}, 4096], blocks of 32 along the last dim, floor scale")
    print(f"- ratios: the median of {WINDOWS} windows of {repeat} calls in turns, with that window's ms")
    print()
    ao = torchao_reference()
    if ao is not None:  # the same values as the compiled kernel, up to torchao's documented 2**-127-scale blocks
        want = fake_quantize(x, "mxfp8_e4m3")
        got = ao(x)
        print(f"- torchao and mixprec agree on {float((got == want).float().mean()) * 100:.4f}% of elements")
    t_copy, t_fq = in_windows(lambda: dst.copy_(x), compiled, repeat)
    t_clone, t_fq2 = in_windows(lambda: x.clone(), compiled, repeat)
    with native.disabled():
        t_torch = time_it(lambda: fake_quantize(x, "mxfp8_e4m3", out=dst), repeat=max(3, repeat // 3))
    row: list[object] = [
        f"{n / 2**20:g}M",
        t_clone * 1e3,
        t_copy * 1e3,
        t_fq * 1e3,
        f"{t_fq2 / t_clone:.2f}x ({'met' if t_fq2 / t_clone <= GOAL_VS_CLONE else 'NOT met'}: <= {GOAL_VS_CLONE}x)",
        f"{t_fq / t_copy:.2f}x",
        t_torch * 1e3,
        f"{t_torch / t_fq:.1f}x",
    ]
    header = ["elements", "clone() ms", "copy_ ms", "compiled ms", "compiled / clone()", "compiled / copy_",
              "torch path ms", "torch path / compiled"]  # fmt: skip
    if ao is not None:
        t_fq3, t_ao = in_windows(compiled, lambda: ao(x), max(1, repeat // 3))
        verdict = "met" if t_ao / t_fq3 >= GOAL_VS_TORCHAO else "NOT met"
        row += [t_ao * 1e3, f"{t_ao / t_fq3:.1f}x ({verdict}: >= {GOAL_VS_TORCHAO:g}x)"]
        header += ["torchao ms", "torchao / compiled"]
    else:
        print("- torchao is not installed: its columns are skipped")
    print(markdown_table(header, [row]))


if __name__ == "__main__":
    main()
