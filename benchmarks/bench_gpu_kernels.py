"""The Triton kernels (mixprec.native.gpu) on a CUDA device, each against what a user would otherwise run.

One run times, with ``triton.testing.do_bench`` (median; CUDA events), in the same process:

1. ``round_to`` to fp16, bf16, fp8 e4m3 and e5m2 (nearest) against torch's cast ``x.to(dtype).float()``, and the
   torch path (``mixprec.native.disabled()``), at 1M and 16M fp32 elements;
2. MinMaxUInt8 encode + decode against ``copy_`` of the fp32 tensor, stochastic against nearest encode, and the
   torch path, at 1M, 16M and 64M elements (chunk 2048);
3. the emulated matmul (fp16/16, fp16/32, bf16/32, two_stage) at 1024^3 and 4096 x 4096 x 1024 against cuBLAS
   fp32 ``torch.matmul`` (TF32 off) and fp16 ``torch.matmul``, and the torch path at 1024^3.

``do_bench`` times the device. Small calls are bound by the host instead (Python and Triton's launch): the
"back to back" columns give the wall time per call of a loop of calls, as a training step sees it.

Each section checks the kernel's bits against the torch path on the same inputs before timing it. Writes
``gpu_kernels.json`` and ``gpu_kernels.md`` to ``--out`` after every section.

    PYTHONPATH=src python benchmarks/bench_gpu_kernels.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from _common import markdown_table
from mixprec import native
from mixprec.compress import MinMaxUInt8
from mixprec.core.rounding import round_to
from mixprec.emulate.matmul import MATMUL_PRESETS, matmul_with_model
from mixprec.native import gpu


def bench(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def back_to_back_us(fn: Any, calls: int = 300) -> float:
    """Wall time per call, in microseconds, of ``calls`` calls in a row and one synchronisation."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / calls


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        eq = a.view(torch.int32) == b.view(torch.int32)
    else:
        eq = a == b
    if a.is_floating_point():
        eq = eq | (a.isnan() & b.isnan())
    return bool(eq.all())


def differing(a: torch.Tensor, b: torch.Tensor) -> str:
    """How many results differ in bits (NaN matching NaN), with the first input that differs."""
    eq = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    bad = (~eq).nonzero()
    return "0" if bad.numel() == 0 else f"{bad.numel()} (first at {bad[0].item()})"


def rounding_row(x: torch.Tensor, name: str, dt: torch.dtype) -> list[object]:
    out = torch.empty_like(x)
    t_cast = bench(lambda: x.to(dt).float())
    t_k = bench(lambda: round_to(x, name, out=out))
    y = round_to(x, name)
    with native.disabled():
        t_torch = bench(lambda: round_to(x, name, out=out))
        vs_torch = differing(y, round_to(x, name))
    cast = x.to(dt).float()
    vs_cast = differing(y, cast)
    if vs_cast != "0":
        i = int(vs_cast.split("at ")[1].rstrip(")"))
        vs_cast += f": x={x[i].item():.9g} -> {y[i].item():.9g}, cast {cast[i].item():.9g}"
    b_cast = back_to_back_us(lambda: x.to(dt).float())
    b_k = back_to_back_us(lambda: round_to(x, name, out=out))
    return [f"{x.numel() >> 20}M", name, f"{t_cast:.4g}", f"{t_k:.4g}", f"{t_k / t_cast:.2f}x", f"{t_torch:.4g}",
            f"{b_cast:.0f} / {b_k:.0f}", vs_torch, vs_cast]  # fmt: skip


def section_rounding(sizes: list[int]) -> tuple[list[str], list[list[object]]]:
    head = ["elements", "format", "torch cast ms", "triton round_to ms", "ratio (goal <= 1.5x)", "torch path ms",
            "back to back us/call: cast / round_to", "differ from torch path",
            "differ from torch's CUDA cast"]  # fmt: skip
    formats = [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn),
               ("fp8_e5m2", torch.float8_e5m2)]  # fmt: skip
    return head, [rounding_row(torch.randn(n, device="cuda") * 100, nm, dt) for n in sizes for nm, dt in formats]


def quantize_row(n: int) -> list[object]:
    x = torch.randn(n, device="cuda") * 3 + 1
    dst = torch.empty_like(x)
    q = MinMaxUInt8(chunk_size=2048)
    qs = MinMaxUInt8(chunk_size=2048, rounding="stochastic", generator=torch.Generator(device="cuda").manual_seed(0))
    buf = q.encode(x)

    def both() -> None:
        q.encode(x, out=buf)
        q.decode(buf, n, out=dst)

    t_copy = bench(lambda: dst.copy_(x))
    t_enc = bench(lambda: q.encode(x, out=buf))
    t_dec = bench(lambda: q.decode(buf, n, out=dst))
    t_both = bench(both)
    t_st = bench(lambda: qs.encode(x, out=buf))
    b_copy, b_both = back_to_back_us(lambda: dst.copy_(x)), back_to_back_us(both)
    key = 12345
    got = torch.empty(1, q.encoded_nbytes(n), dtype=torch.uint8, device="cuda")
    qs.encode_rows(x[None], got, key=key)
    with native.disabled():
        t_torch = bench(both)
        ref = torch.empty_like(got)
        qs.encode_rows(x[None], ref, key=key)
    return [f"{n >> 20}M", f"{t_copy:.4g}", f"{t_enc:.4g}", f"{t_dec:.4g}", f"{t_both / t_copy:.2f}x",
            f"{t_st:.4g}", f"{t_st / t_enc:.2f}x", f"{t_torch:.4g}", f"{t_torch / t_both:.1f}x",
            f"{b_copy:.0f} / {b_both:.0f}", torch.equal(got, ref)]  # fmt: skip


def section_quantize(sizes: list[int]) -> tuple[list[str], list[list[object]]]:
    head = ["elements", "copy_ ms", "encode ms", "decode ms", "enc+dec / copy_", "stochastic encode ms",
            "stochastic / nearest", "torch path enc+dec ms", "speedup", "back to back us/call: copy_ / enc+dec",
            "same bits"]  # fmt: skip
    return head, [quantize_row(n) for n in sizes]


def matmul_rows(m: int, n: int, k: int, torch_path_max: int) -> list[list[object]]:
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    a16, b16 = a.half(), b.half()
    t32 = bench(lambda: torch.matmul(a, b))
    t16 = bench(lambda: torch.matmul(a16, b16))
    rows: list[list[object]] = []
    for name in ["fp16/16", "fp16/32", "bf16/32", "two_stage"]:
        model = MATMUL_PRESETS[name]

        def emulated(model: Any = model) -> torch.Tensor:
            return matmul_with_model(a, b, model)

        t_k = bench(emulated)
        y = emulated()
        t_torch, ok = float("nan"), "-"
        if m * n * k <= torch_path_max:
            with native.disabled():
                t_torch = bench(emulated)
                ok = same_bits(y, emulated())
        rows.append([f"{m}x{n}x{k}", name, f"{t32:.4g}", f"{t16:.4g}", f"{t_k:.4g}", f"{t_k / t32:.2f}x",
                     f"{t_torch:.4g}", f"{t_torch / t_k:.1f}x", gpu.dot_path("cuda"), ok])  # fmt: skip
    return rows


def section_matmul(shapes: list[tuple[int, int, int]], torch_path_max: int) -> tuple[list[str], list[list[object]]]:
    head = ["M x N x K", "model", "cuBLAS fp32 ms", "cuBLAS fp16 ms", "triton emulated ms", "emulated / fp32",
            "torch path ms", "speedup", "group sum", "same bits"]  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = False
    return head, [row for m, n, k in shapes for row in matmul_rows(m, n, k, torch_path_max)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    args = ap.parse_args()
    if not torch.cuda.is_available() or not gpu.available():
        print("needs a CUDA device and triton")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    header = (
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n"
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
        f"Python {sys.version.split()[0]}\n- path: {gpu.describe()}\n"
        f"- command: `python benchmarks/bench_gpu_kernels.py{' --quick' if args.quick else ''}`\n"
    )
    # warm the device (clocks, context, the kernels' first compilation) before anything is timed
    w = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        w @ w
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        round_to(w, name)
    torch.cuda.synchronize()
    md = [header]
    results: dict[str, Any] = {"header": header}
    sizes = [1 << 20, 1 << 24] if args.quick else [1 << 20, 1 << 24, 1 << 26]
    shapes = [(1024, 1024, 1024)] if args.quick else [(1024, 1024, 1024), (4096, 4096, 1024)]
    sections = [
        ("round_to (nearest) vs torch's cast", lambda: section_rounding(sizes[:2])),
        ("MinMaxUInt8 (chunk 2048)", lambda: section_quantize(sizes)),
        ("Emulated matmul vs cuBLAS (fp32 inputs rounded by the model)", lambda: section_matmul(shapes, 1 << 30)),
    ]
    for title, fn in sections:
        t0 = time.time()
        try:
            head, rows = fn()
        except Exception as exc:  # keep what the other sections measure
            print(f"## {title}: FAILED {exc!r}", flush=True)
            md.append(f"### {title}\n\nFAILED: {exc!r}\n")
            continue
        table = markdown_table(head, rows)
        print(f"### {title} ({time.time() - t0:.0f} s)\n\n{table}\n", flush=True)
        md.append(f"### {title}\n\n{table}\n")
        results[title] = {"head": head, "rows": [[str(c) for c in r] for r in rows]}
        (out / "gpu_kernels.md").write_text("\n".join(md))
        (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
