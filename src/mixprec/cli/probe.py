"""``mixprec probe matmul``: infer how this machine's matmul accumulates, and the emulation model that matches.

For each ``--dtypes`` entry, crafted dot products go through the matmul (torch.matmul, or ``torch._scaled_mm``
for fp8 on a Hopper GPU, or one of mixprec's own emulation presets as a check of the method); prints what was
inferred (product exactness, effective bits and rounding, alignment, k_group, promotion, split-K), the model and
its bit-equal fraction on random data. ``--save DIR`` writes one JSON fingerprint per dtype
(``mixprec.emulate.fingerprints.Fingerprint.load`` reads it back). Methods: docs/audit.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.cli.args import check_output_dir

_DTYPES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="infer how this machine's kernels round")
    probes = p.add_subparsers(dest="probe", metavar="PROBE")
    probes.required = True
    m = probes.add_parser(
        "matmul",
        help="fingerprint the matmul's accumulation and name the emulation model that matches it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("--dtypes", default="fp32,bf16,fp16", help=f"comma-separated, from {', '.join(_DTYPES)}")
    m.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    m.add_argument(
        "--fn",
        default="torch",
        help="what to probe: torch (torch.matmul; fp8 through torch._scaled_mm on CUDA) or emulate:PRESET",
    )
    m.add_argument("--fast-accum", action="store_true", help="fp8: torch._scaled_mm(use_fast_accum=True)")
    m.add_argument("--shape", default="64,64,512", help="M,N,K of the calls (default 64,64,512)")
    m.add_argument("--seed", type=int, default=0, help="seed of the random bit-equal check")
    m.add_argument("--save", type=Path, default=None, metavar="DIR", help="write DIR/matmul_<dtype>.json")
    m.set_defaults(prepare=prepare)


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--shape must be M,N,K (three positive integers); got {text!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument before any matmul runs."""
    import torch

    from mixprec.emulate import MATMUL_PRESETS, matmul

    names = [v.strip() for v in args.dtypes.split(",") if v.strip()]
    bad = [v for v in names if v not in _DTYPES]
    if not names or bad:
        raise ValueError(f"unknown dtype {', '.join(map(repr, bad)) or '(none)'}; choose from {', '.join(_DTYPES)}")
    m, n, k = _shape(args.shape)
    if m < 2 or n < 2 or k < 512:
        raise ValueError(f"--shape needs M, N >= 2 and K >= 512; got {args.shape!r}")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available")
    if args.fn.startswith("emulate:"):
        preset = args.fn.removeprefix("emulate:")
        if preset not in MATMUL_PRESETS:
            raise ValueError(f"--fn emulate:PRESET needs one of {', '.join(MATMUL_PRESETS)}; got {preset!r}")

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return matmul(a, b, mode=preset)
    elif args.fn == "torch":
        fn = None
    else:
        raise ValueError(f"--fn must be 'torch' or 'emulate:PRESET'; got {args.fn!r}")
    fp8 = [v for v in names if v.startswith("fp8")]
    if fn is None and fp8 and args.device != "cuda":
        raise ValueError(f"{', '.join(fp8)} through torch needs --device cuda (torch._scaled_mm)")
    if args.save is not None:
        check_output_dir("--save", args.save)
    return lambda: _run(args, names, (m, n, k), fn)


def _run(args: argparse.Namespace, names: list[str], shape: tuple[int, int, int], fn: Any) -> int:
    import torch

    from mixprec.emulate import fingerprint

    m, n, k = shape
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    for name in names:
        dtype = getattr(torch, _DTYPES[name])
        call = fn
        label = args.fn
        if call is None:
            call, label = _torch_fn(dtype, args.fast_accum), f"torch {args.device}"
        t0 = time.monotonic()
        result = fingerprint(call, dtype, m=m, n=n, k=k, device=args.device, seed=args.seed, label=label, progress=None)
        print(result.summary() + f"\n  ({time.monotonic() - t0:.1f} s)")
        if args.save is not None:
            print(f"  wrote {result.save(args.save / f'matmul_{name}.json')}")
    print(f"({time.monotonic() - start:.1f} s)")
    return 0


def _torch_fn(dtype: Any, fast_accum: bool) -> Callable[..., Any]:
    import torch

    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.matmul

    def scaled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # cuBLASLt's fp8 GEMM wants b column-major; unit scales keep the probes' values as they are
        one = torch.ones((), dtype=torch.float32, device=a.device)
        return torch._scaled_mm(
            a, b.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum
        )

    return scaled_mm
