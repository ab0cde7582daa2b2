"""GPU check of the two-stage fp16 kernel and of the emulator's accumulator models, in one run.

The kernel follows "Improving FP16/16 matmul accuracy with two-stage accumulation" (spatters/mma-matmul).

1. Correctness: ``two_stage_matmul`` with a fixed K block against the emulator's model of that block size
   (fp16 MMAs of K=16 chained in an fp16 accumulator inside a block, promoted to fp32 per block), on odd shapes
   and at 1024 and 4096; also against float64.
2. Speed at M=N=K=4096 and 8192 (fp16 inputs): cuBLAS fp16 with fp32 accumulation (torch.matmul), with
   reduced-precision reductions allowed, cuBLAS fp16/16 (``allow_fp16_accumulation``, when this torch has it),
   and the two-stage kernel (fixed BLOCK_K, M/N tiles autotuned); TFLOP/s from triton.testing.do_bench (median).
3. Error of the real kernels at 4096 (N(0,1) fp16 inputs) against float64 and an fp32 (CUDA-core, no TF32)
   reference: percentiles of |error|, and the seed's ratios; fp8 e4m3 ``torch._scaled_mm`` with and without
   fast accumulation (DeepSeek-V3's ~2% claim), beside the emulator's numbers for the same matrices.
4. The emulator's own study (``mixprec.lab.studies.matmul_error``) on the GPU at 1024 and 4096, all rows.

Writes ``gpu_results.json`` and ``gpu_results.md`` to ``--out`` (default ``$OUT`` or ./gpu_out) after every
section, so a run cut short still leaves what it measured.

    PYTHONPATH=src python benchmarks/bench_two_stage_gpu.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from _common import cpu_model, markdown_table

PCTS = (50.0, 90.0, 99.0, 99.9, 100.0)
DEVICE = "cuda"  # a CPU dry run of the script's logic sets this to "cpu" (see --dry-run-cpu)


def pct(values: torch.Tensor) -> dict[str, float]:
    """Nearest-rank percentiles ``PCTS`` as {"p50": ...} (the study's own helper)."""
    from mixprec.lab.studies.matmul_error import _percentiles

    return {f"p{p:g}": v for p, v in zip(PCTS, _percentiles(values.double(), PCTS))}


@contextlib.contextmanager
def fp16_accumulation(enabled: bool) -> Iterator[None]:
    """cuBLAS fp16 GEMMs accumulating in fp16 while inside, restored after (even on error). Raises RuntimeError
    where this torch has no ``allow_fp16_accumulation``."""
    mm = torch.backends.cuda.matmul
    if not hasattr(mm, "allow_fp16_accumulation"):
        raise RuntimeError("this torch has no torch.backends.cuda.matmul.allow_fp16_accumulation")
    before = mm.allow_fp16_accumulation
    mm.allow_fp16_accumulation = enabled
    try:
        yield
    finally:
        mm.allow_fp16_accumulation = before


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {}
        self.md: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def section(self, key: str, value: Any, md: str) -> None:
        self.data[key] = value
        self.md.append(md)
        print(md, flush=True)
        (self.out / "gpu_results.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "gpu_results.md").write_text("\n\n".join(self.md) + "\n")


def header(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import triton

    props = torch.cuda.get_device_properties(0)
    mm = torch.backends.cuda.matmul
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),  # noqa: UP017 (py3.10 on GPU hosts)
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "host": f"{os.cpu_count()} cores, {cpu_model()}",
        "command": " ".join(["python", *sys.argv]),
        "allow_fp16_reduced_precision_reduction (default)": mm.allow_fp16_reduced_precision_reduction,
        "has allow_fp16_accumulation": hasattr(mm, "allow_fp16_accumulation"),
    }
    md = "### GPU run: two-stage kernel and accumulator models\n\n" + "\n".join(f"- {k}: {v}" for k, v in info.items())
    return info, md


def correctness(quick: bool) -> tuple[list[dict[str, Any]], str]:
    from mixprec.emulate import MatmulModel, matmul
    from mixprec.kernels import two_stage_matmul, two_stage_model

    shapes = [(37, 91, 53), (129, 200, 65), (257, 1000, 130), (1024, 1024, 1024)]
    if not quick:
        shapes.append((4096, 4096, 4096))
    rows, out = [], []
    for m, k, n in shapes:
        gen = torch.Generator().manual_seed(m + k + n)
        a = torch.randn(m, k, generator=gen).half().to(DEVICE)
        b = torch.randn(k, n, generator=gen).half().to(DEVICE)
        ref = a.double() @ b.double()
        absab = a.double().abs() @ b.double().abs()
        for bk in (32, 64):
            got = two_stage_matmul(a, b, out_dtype=torch.float32, block_k=bk).double()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            exact = matmul(a, b, mode=two_stage_model(bk)).double()
            h100 = matmul(
                a,
                b,
                mode=MatmulModel(
                    inputs="fp16",
                    accumulator="fp16",
                    k_group=16,
                    promote_every=bk,
                    align_bits=25,
                    align_rounding="nearest",
                ),
            ).double()
            rec = {
                "shape": [m, k, n],
                "block_k": bk,
                "equal_frac_vs_exact_model": float((got == exact).double().mean()),
                "equal_frac_vs_align25_model": float((got == h100).double().mean()),
                "max_abs_vs_exact_model": float((got - exact).abs().max()),
                "max_norm_vs_exact_model": float(((got - exact).abs() / absab).max()),
                # one fp16 spacing per MMA of the block from the tensor cores' internal rounding, plus fp32
                "max_diff_over_hw_bound": float(
                    ((got - exact).abs() / (((bk / 16) * 2.0**-10 + 2 * (k / bk) * 2.0**-24) * absab)).max()
                ),
                "max_abs_vs_f64": float((got - ref).abs().max()),
                "median_abs_vs_f64": float((got - ref).abs().median()),
                "emulator_median_abs_vs_f64": float((exact - ref).abs().median()),
                "max_norm_vs_f64": float(((got - ref).abs() / absab).max()),
            }
            out.append(rec)
            rows.append([f"{m}x{k}x{n}", bk, rec["equal_frac_vs_exact_model"], rec["equal_frac_vs_align25_model"],
                         rec["max_abs_vs_exact_model"], rec["max_diff_over_hw_bound"], rec["median_abs_vs_f64"],
                         rec["emulator_median_abs_vs_f64"], rec["max_abs_vs_f64"]])  # fmt: skip
    md = "#### Kernel vs emulator (same block size), fp32 output\n\n" + markdown_table(
        ["M x K x N", "block_k", "bit-equal frac (exact-sum model)", "bit-equal frac (align-25 model)",
         "max abs diff", "max diff / bound", "kernel median abs err vs f64", "emulator median abs err vs f64",
         "kernel max abs err vs f64"],
        rows,
    )  # fmt: skip
    return out, md


def bench(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300))


def speed(quick: bool) -> tuple[list[dict[str, Any]], str]:
    from mixprec.kernels import BLOCK_K, two_stage_matmul

    mm = torch.backends.cuda.matmul
    rows, out = [], []
    for size in (4096,) if quick else (4096, 8192):
        a = torch.randn(size, size, device=DEVICE).half()
        b = torch.randn(size, size, device=DEVICE).half()
        flops = 2 * size**3
        variants: list[tuple[str, Any]] = []
        default_rr = mm.allow_fp16_reduced_precision_reduction

        def cublas(
            rr: bool, acc16: bool = False, a: torch.Tensor = a, b: torch.Tensor = b, default_rr: bool = default_rr
        ) -> Any:
            def run() -> torch.Tensor:
                mm.allow_fp16_reduced_precision_reduction = rr
                try:
                    with fp16_accumulation(True) if acc16 else contextlib.nullcontext():
                        return a @ b
                finally:
                    mm.allow_fp16_reduced_precision_reduction = default_rr

            return run

        variants.append(("cuBLAS fp16/32 (torch.matmul, reduced-precision reduction off)", cublas(False)))
        variants.append(("cuBLAS fp16/32 (reduced-precision reduction allowed)", cublas(True)))
        if hasattr(mm, "allow_fp16_accumulation"):
            variants.append(("cuBLAS fp16/16 (allow_fp16_accumulation)", cublas(True, acc16=True)))
        for bk in sorted({BLOCK_K, 32}):
            tag = f"BLOCK_K {bk}{' (default)' if bk == BLOCK_K else ''}, tiles autotuned"
            variants.append(
                (f"two-stage Triton, fp16 out ({tag})", lambda a=a, b=b, bk=bk: two_stage_matmul(a, b, block_k=bk))
            )
        variants.append(
            (
                f"two-stage Triton, fp32 out (BLOCK_K {BLOCK_K})",
                lambda a=a, b=b: two_stage_matmul(a, b, out_dtype=torch.float32),
            )
        )
        for name, fn in variants:
            try:
                ms = bench(fn)
                rec = {"size": size, "kernel": name, "ms": ms, "tflops": flops / ms / 1e9}
            except Exception as exc:  # a variant this torch/GPU lacks must not stop the others
                rec = {"size": size, "kernel": name, "error": repr(exc)}
            out.append(rec)
            rows.append([size, name, rec.get("ms", "-"), rec.get("tflops", rec.get("error", "-"))])
    md = "#### Speed, fp16 inputs, M=N=K\n\n" + markdown_table(["M=N=K", "kernel", "ms (median)", "TFLOP/s"], rows)
    return out, md


def hardware_errors(quick: bool) -> tuple[dict[str, Any], str]:
    from mixprec.emulate import matmul, round_to
    from mixprec.kernels import two_stage_matmul

    size = 1024 if quick else 4096
    gen = torch.Generator().manual_seed(size)
    a = torch.randn(size, size, generator=gen).half().to(DEVICE)
    b = torch.randn(size, size, generator=gen).half().to(DEVICE)
    ref64 = a.double() @ b.double()
    mm = torch.backends.cuda.matmul
    tf32 = mm.allow_tf32
    mm.allow_tf32 = False
    ref32 = (a.float() @ b.float()).double()
    mm.allow_tf32 = tf32
    results: dict[str, Any] = {"size": size}
    outs: dict[str, torch.Tensor] = {}
    outs["cuBLAS fp16/32, fp16 out (torch.matmul)"] = (a @ b).double()
    # fp32 output of the fp16 GEMM, as the two-stage write-up's cublasGemmEx FP16/32 (newer torch: mm(out_dtype=))
    with contextlib.suppress(Exception):
        outs["cuBLAS fp16/32, fp32 out (mm out_dtype)"] = torch.mm(a, b, out_dtype=torch.float32).double()
    # fp16 values are exact in TF32, so a TF32 tensor-core GEMM of the widened data is an fp16/32 GEMM with fp32
    # output: exact products, fp32 accumulation
    mm.allow_tf32 = True
    outs["cuBLAS TF32 on fp16 data, fp32 out"] = (a.float() @ b.float()).double()
    mm.allow_tf32 = tf32
    if hasattr(mm, "allow_fp16_accumulation"):
        with fp16_accumulation(True):
            outs["cuBLAS fp16/16"] = (a @ b).double()
    outs["two-stage kernel (fp16 out)"] = two_stage_matmul(a, b).double()
    outs["two-stage kernel (fp32 out)"] = two_stage_matmul(a, b, out_dtype=torch.float32).double()
    for mode in ("fp16/16", "two_stage", "fp16/32"):
        outs[f"emulator {mode}"] = matmul(a, b, mode=mode).double()
    rows = []
    for name, y in outs.items():
        r = {"vs_f64": pct((y - ref64).abs()), "vs_fp32": pct((y - ref32).abs())}
        results[name] = r
        rows.append(
            [
                name,
                r["vs_f64"]["p50"],
                r["vs_f64"]["p99"],
                r["vs_f64"]["p100"],
                r["vs_fp32"]["p50"],
                r["vs_fp32"]["p100"],
            ]
        )
    med = {k: v["vs_fp32"]["p50"] for k, v in results.items() if isinstance(v, dict)}
    ratios = []
    f32 = "cuBLAS TF32 on fp16 data, fp32 out"
    for big, small, claim in (
        ("cuBLAS fp16/16", "two-stage kernel (fp32 out)", "~10x"),
        ("two-stage kernel (fp32 out)", f32, "~100x"),
        ("cuBLAS fp16/16", f32, "~1000x"),
        ("two-stage kernel (fp32 out)", "cuBLAS fp16/32, fp32 out (mm out_dtype)", "~100x"),
        ("emulator fp16/16", "emulator two_stage", "~10x"),
        ("emulator two_stage", "emulator fp16/32", "~100x"),
    ):
        if big in med and small in med:
            ratios.append([f"{big} / {small}", claim, med[big] / max(med[small], 1e-300)])
    results["median_ratios_vs_fp32_ref"] = ratios
    # fp8: DeepSeek-V3's fp8 GEMM accumulation, on the hardware (cuBLASLt via torch._scaled_mm) and emulated
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn)
    ref8 = a8.double() @ b8.double()
    fp8_rows = []
    one = torch.ones((), device=DEVICE)
    for fast in (True, False):
        try:
            y = torch._scaled_mm(a8, b8.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                 use_fast_accum=fast).double()  # fmt: skip
            err = (y - ref8).abs()
            fp8_rows.append([f"_scaled_mm use_fast_accum={fast}", float(err.max() / ref8.abs().max()),
                             float(err.norm() / ref8.norm()), float(err.median())])  # fmt: skip
        except Exception as exc:
            fp8_rows.append([f"_scaled_mm use_fast_accum={fast}", repr(exc), "-", "-"])
    for mode in ("fp8/nopromote", "fp8/promote128"):
        y = matmul(round_to(a, "fp8_e4m3"), round_to(b, "fp8_e4m3"), mode=mode).double()
        err = (y - ref8).abs()
        fp8_rows.append([f"emulator {mode}", float(err.max() / ref8.abs().max()), float(err.norm() / ref8.norm()),
                         float(err.median())])  # fmt: skip
    results["fp8"] = fp8_rows
    md = (
        f"#### Real kernels' error at M=N=K={size}, N(0,1) fp16 inputs\n\n"
        + markdown_table(
            ["kernel", "p50 vs f64", "p99 vs f64", "max vs f64", "p50 vs fp32 ref", "max vs fp32 ref"], rows
        )
        + "\n\nMedian-error ratios (vs the fp32 reference, as the two-stage write-up measured):\n\n"
        + markdown_table(["ratio", "seed claims", "measured"], ratios)
        + f"\n\nfp8 e4m3 GEMM accumulation error at K={size} (vs float64 of the fp8 inputs; DeepSeek-V3 claims ~2% "
        "maximum relative error without promotion):\n\n"
        + markdown_table(["kernel", "max|err| / max|ref|", "||err||_F / ||ref||_F", "median |err|"], fp8_rows)
    )
    return results, md


def emulator_study(quick: bool) -> tuple[list[dict[str, Any]], str]:
    from mixprec.lab.studies.matmul_error import check_claims, format_table, matmul_error_study

    sizes = (256, 1024) if quick else (1024, 4096)
    res = matmul_error_study(sizes, rows=max(sizes), device=DEVICE)
    data = [{k: v for k, v in r.__dict__.items() if k != "curve_vs_f64"} for r in res]
    md = (
        "#### Emulator study on the GPU (`matmul_error_study`, all rows)\n\n"
        + format_table(res)
        + "\n\n"
        + "\n".join(c.line() for c in check_claims(res))
    )
    return data, md


def interpreter(quick: bool) -> tuple[Any, str]:
    """The kernel in Triton's interpreter (a fresh process with TRITON_INTERPRET=1) on small odd shapes."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.kernels._interpreter_check"], env=env, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}, f"#### Interpreter check FAILED\n\n```\n{proc.stderr[-3000:]}\n```"
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    md = "#### Kernel under TRITON_INTERPRET=1 vs emulator (k_group = block_k)\n\n" + markdown_table(
        ["shape M,K,N", "block_k", "out", "max diff / bound", "bit-equal fraction"],
        [[c["shape"], c["block_k"], c["out"], c["max_ratio"], c["equal_fraction"]] for c in cases],
    )
    return {"cases": cases, "seconds": time.perf_counter() - t0}, md


def hardware_vs_models(quick: bool) -> tuple[Any, str]:
    """How closely each model reproduces the hardware, output by output: bit-equal fractions and median errors of
    cuBLAS fp16/16 vs the fp16/16 model, cuBLAS fp16/32 (fp32 out) vs fp16/32 with and without the H100 alignment
    model (F=25, toward zero), and fp8 _scaled_mm vs the fp8 models; plus the spread of elementwise relative errors
    of fp8 without promotion (for DeepSeek-V3's "maximum relative error")."""
    from mixprec.emulate import MatmulModel, matmul, round_to

    rows, data = [], []
    for size in (1024,) if quick else (1024, 4096):
        gen = torch.Generator().manual_seed(size + 1)
        a = torch.randn(size, size, generator=gen).half().to(DEVICE)
        b = torch.randn(size, size, generator=gen).half().to(DEVICE)
        ref = a.double() @ b.double()
        with fp16_accumulation(True):  # RuntimeError without it: the section is reported as failed
            hw16 = (a @ b).double()
        hw32 = torch.mm(a, b, out_dtype=torch.float32).double()
        align_rz = MatmulModel(inputs="fp16", accumulator="fp32", k_group=16, align_bits=25)
        align_rn = MatmulModel(inputs="fp16", accumulator="fp32", k_group=16, align_bits=25, align_rounding="nearest")
        models = {
            "fp16/16": matmul(a, b, mode="fp16/16", output="fp16").double(),
            "fp16/32 exact sums": matmul(a, b, mode="fp16/32").double(),
            "fp16/32 align 25 toward_zero": matmul(a, b, mode=align_rz).double(),
            "fp16/32 align 25 nearest": matmul(a, b, mode=align_rn).double(),
        }
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEVICE)
        hw8 = torch._scaled_mm(a8, b8.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                               use_fast_accum=True).double()  # fmt: skip
        ref8 = a8.double() @ b8.double()
        emu8 = matmul(round_to(a, "fp8_e4m3"), round_to(b, "fp8_e4m3"), mode="fp8/nopromote").double()
        pairs = [
            ("cuBLAS fp16/16", hw16, "fp16/16", models["fp16/16"], ref),
            ("cuBLAS fp16/32 fp32 out", hw32, "fp16/32 exact sums", models["fp16/32 exact sums"], ref),
            (
                "cuBLAS fp16/32 fp32 out",
                hw32,
                "fp16/32 align 25 toward_zero",
                models["fp16/32 align 25 toward_zero"],
                ref,
            ),
            ("cuBLAS fp16/32 fp32 out", hw32, "fp16/32 align 25 nearest", models["fp16/32 align 25 nearest"], ref),
            ("_scaled_mm fp8 fast accum", hw8, "fp8/nopromote", emu8, ref8),
        ]
        for hw_name, hw, model_name, emu, r in pairs:
            rec = {"size": size, "hardware": hw_name, "model": model_name,
                   "bit_equal": float((hw == emu).double().mean()),
                   "hw_median_abs_err": float((hw - r).abs().median()),
                   "model_median_abs_err": float((emu - r).abs().median())}  # fmt: skip
            data.append(rec)
            rows.append(
                [size, hw_name, model_name, rec["bit_equal"], rec["hw_median_abs_err"], rec["model_median_abs_err"]]
            )
        big = ref8.abs() >= ref8.abs().median()
        rel = ((hw8 - ref8).abs() / ref8.abs())[big]
        data.append({"size": size, "fp8_fast_accum_elementwise_rel_err_upper_half": pct(rel)})
        rows.append([size, "fp8 fast accum: |err|/|ref| where |ref| >= median", "p50 / p99 / max", "-",
                     pct(rel)["p50"], f"{pct(rel)['p99']:.3g} / {pct(rel)['p100']:.3g}"])  # fmt: skip
    md = "#### Hardware vs models, output by output\n\n" + markdown_table(
        [
            "M=N=K",
            "hardware",
            "model",
            "bit-equal fraction",
            "hardware median |err| vs f64",
            "model median |err| vs f64",
        ],
        rows,
    )
    return data, md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    parser.add_argument("--dry-run-cpu", action="store_true", help="check the script's logic on CPU (no speed)")
    parser.add_argument("--sections", default="", help="comma-separated subset of the sections to run")
    args = parser.parse_args()
    global DEVICE
    sections = [("correctness", correctness), ("speed", speed), ("hardware_errors", hardware_errors),
                ("emulator_study", emulator_study), ("interpreter", interpreter),
                ("hardware_vs_models", hardware_vs_models)]  # fmt: skip
    if args.sections:
        sections = [sec for sec in sections if sec[0] in args.sections.split(",")]
    rep = Report(args.out)
    if args.dry_run_cpu:
        DEVICE = "cpu"
        sections = [sec for sec in sections if sec[0] not in ("speed", "interpreter", "hardware_vs_models")]
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        sys.exit(1)
    else:
        info, md = header(args)
        rep.section("info", info, md)
    for key, fn in sections:
        t0 = time.perf_counter()
        try:
            value, md = fn(args.quick)
        except Exception:
            value, md = {"error": traceback.format_exc()}, f"#### {key}: FAILED\n\n```\n{traceback.format_exc()}\n```"
        rep.section(key, value, md + f"\n\n({key}: {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
