"""``mixprec study matmul-error``: how much error each accumulator model adds to a matmul, emulated.

A, B ~ N(0, 1) rounded to fp16 are the data. For each size M = N = K and each model (fp16/16, two_stage,
fp16/32, fp16/32-h100, bf16/32, fp8/promote128, fp8/nopromote) the emulated product is compared with a
float64 product of the data and with a plain fp32 product (the reference of the two-stage write-up). Large
sizes are computed on a random subset of output rows (--rows).

Outputs: a table, matmul_error.csv (percentiles of |error|), matmul_error_curves.csv and matmul_error.png
(percentile curves), and each published claim beside the measurement, with the tolerance of the check: the
two-stage accumulation write-up ("Improving FP16/16 matmul accuracy with two-stage accumulation",
spatters/mma-matmul) and the DeepSeek-V3 report's fp8 accumulation error. Definitions, the tolerance and
measured results: docs/studies.md.

Run time: --quick about 15 s on 2 busy CPU cores. The defaults (sizes 256, 1024, 4096) do about 240 times
its work, almost all at 4096: about 11 minutes on 2 idle cores; a progress bar counts the rows done.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.core.progress import progress_bar
from mixprec.lab.studies.base import DEFAULT_SEED, StudyOutput, pyplot, save_figure, wrote_lines
from mixprec.lab.studies.base import write_csv as write_table

__all__ = [
    "CLAIM_FACTOR",
    "DEFAULT_DEVICE",
    "DEFAULT_PRESETS",
    "DEFAULT_ROWS",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "ClaimCheck",
    "MatmulErrorConfig",
    "MatmulErrorResult",
    "check_claims",
    "check_study_arguments",
    "format_table",
    "matmul_error_study",
    "plot_curves",
    "run",
    "write_csv",
]

DEFAULT_SIZES = (256, 1024, 4096)
QUICK_SIZES = (128, 256)  # --quick: about 15 s
DEFAULT_ROWS = 256
DEFAULT_DEVICE = "cpu"
DEFAULT_PRESETS = ("fp16/16", "two_stage", "fp16/32", "fp16/32-h100", "bf16/32", "fp8/promote128", "fp8/nopromote")
PERCENTILES = (50.0, 90.0, 99.0, 99.9, 100.0)
CURVE_POINTS = tuple(p / 2 for p in range(0, 201))  # 0, 0.5, ..., 100
_ROWS_PER_CALL = 16  # output rows per emulated matmul call: a progress update every few seconds at K=4096
# A claimed value R ("~R") agrees with a measured m when R / CLAIM_FACTOR <= m <= R * CLAIM_FACTOR. The measured
# ratios are medians over >= 16k outputs (their sampling spread is a few percent), so the factor is the
# claim's own vagueness ("~"): 1.5 still tells "~100x" from the 44x measured, which a factor of 3 did not.
CLAIM_FACTOR = 1.5


@dataclass
class MatmulErrorResult:
    """Error of one model at one size.

    ``abs_vs_f64`` / ``abs_vs_f32``: percentiles (``PERCENTILES``) of ``|y - ref|`` against the float64 and the fp32
    product of the fp16 data (for bf16/fp8 models this includes rounding the data to their input format).
    The accumulation-only measures compare with the float64 product of the model's own rounded inputs
    ``A_r @ B_r``: ``rel_fro = ||y - A_r B_r||_F / ||A_r B_r||_F``, ``rel_max = max|y - A_r B_r| / max|A_r B_r|``
    and ``max_over_abs = max_ij |y - A_r B_r|_ij / (|A_r||B_r|)_ij``, which :func:`mixprec.emulate.bounds` bounds
    (``bound_det``; ``bound_prob`` holds for all outputs at once with probability >= 99%). ``rel_elem_max``: the
    largest elementwise ``|err_ij| / |ref_ij|`` among the outputs with ``|ref_ij|`` at or above the median
    (elementwise relative error is unbounded near zero)."""

    size: int
    rows: int
    preset: str
    seconds: float
    abs_vs_f64: dict[float, float]
    abs_vs_f32: dict[float, float]
    rel_fro: float
    rel_max: float
    max_over_abs: float
    rel_elem_max: float
    bound_det: float
    bound_prob: float | None
    curve_vs_f64: list[float] = field(repr=False, default_factory=list)


def _percentiles(values: torch.Tensor, points: tuple[float, ...]) -> list[float]:
    flat = values.flatten().sort().values
    n = flat.numel()
    return [float(flat[min(n - 1, max(0, math.ceil(p / 100 * n) - 1))]) for p in points]


def matmul_error_study(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    presets: tuple[str, ...] = DEFAULT_PRESETS,
    *,
    rows: int = DEFAULT_ROWS,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = DEFAULT_DEVICE,
    progress: bool | None = False,
) -> list[MatmulErrorResult]:
    """Run the study; returns one result per (size, preset). ``rows``: output rows computed per size (a random
    subset when ``size > rows``). ``progress``: a tqdm bar over the output rows of every (size, model), on stderr
    (None: when stderr is a terminal).

    Raises:
        ValueError: a bad size, row count or preset name, or a device this installation cannot use.
    """
    from mixprec.emulate import bounds, matmul, round_to

    models, dev = check_study_arguments(sizes, presets, rows=rows, device=device)
    total = sum(min(size, rows) for size in sizes) * len(models)
    bar = progress_bar(total=total, unit="row", desc="matmul-error", enabled=progress)
    results: list[MatmulErrorResult] = []
    for size in sizes:
        gen = torch.Generator().manual_seed(seed + size)
        a = torch.randn(size, size, generator=gen).half()
        b = torch.randn(size, size, generator=gen).half()
        if size > rows:
            pick = torch.randperm(size, generator=gen)[:rows].sort().values
            a = a[pick]
        a, b = a.to(dev), b.to(dev)
        ref64 = a.double() @ b.double()
        tf32 = dev.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32, not tf32
        try:
            ref32 = (a.float() @ b.float()).double()
        finally:
            if dev.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = tf32
        for model in models:
            a_r = round_to(a, model.inputs).double()
            b_r = round_to(b, model.inputs).double()
            ref_own = a_r @ b_r
            abs_ab = a_r.abs() @ b_r.abs()
            bar.set_postfix_str(f"M=N=K={size} {model.name}")
            t0 = time.perf_counter()
            # A few output rows at a time, for the progress bar: each output row depends only on its row of
            # A, so the product is the same bits as one call.
            pieces = []
            for start in range(0, a.shape[0], _ROWS_PER_CALL):
                pieces.append(matmul(a[start : start + _ROWS_PER_CALL], b, mode=model))
                bar.update(pieces[-1].shape[0])
            y = torch.cat(pieces).double()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            err = (y - ref64).abs()
            err_own = (y - ref_own).abs()
            bd = bounds(size, model, confidence=1 - 0.01 / y.numel())  # all outputs: 99% by a union bound
            results.append(
                MatmulErrorResult(
                    size=size,
                    rows=a.shape[0],
                    preset=model.name,
                    seconds=seconds,
                    abs_vs_f64=dict(zip(PERCENTILES, _percentiles(err, PERCENTILES))),
                    abs_vs_f32=dict(zip(PERCENTILES, _percentiles((y - ref32).abs(), PERCENTILES))),
                    rel_fro=float(torch.linalg.vector_norm(y - ref_own) / torch.linalg.vector_norm(ref_own)),
                    rel_max=float(err_own.max() / ref_own.abs().max()),
                    max_over_abs=float((err_own / abs_ab.clamp_min(1e-300)).max()),
                    rel_elem_max=float((err_own / ref_own.abs())[ref_own.abs() >= ref_own.abs().median()].max()),
                    bound_det=bd.deterministic,
                    bound_prob=bd.probabilistic,
                    curve_vs_f64=_percentiles(err, CURVE_POINTS),
                )
            )
    bar.close()
    return results


def check_study_arguments(
    sizes: tuple[int, ...], presets: tuple[str, ...], *, rows: int, device: str | torch.device
) -> tuple[list[Any], torch.device]:
    """Check the study's arguments before any work; returns the accumulator models and the device.

    Raises:
        ValueError: a size or ``rows`` that is not a positive int, an unknown preset, or a device that this
            installation cannot use (e.g. ``"cuda"`` on a build or machine without CUDA).
    """
    from mixprec.emulate import get_matmul_model

    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be positive ints; got {sizes!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1; got {rows!r}")
    if not presets:
        raise ValueError("presets must name at least one accumulator model")
    models = [get_matmul_model(p, arg="presets") for p in presets]
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda'; got {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: this installation of torch has no usable CUDA device; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    return models, dev


TWO_STAGE_SOURCE = "two-stage accumulation write-up, spatters/mma-matmul"
DEEPSEEK_SOURCE = "DeepSeek-V3"


@dataclass
class ClaimCheck:
    """A published claim beside the measurement. ``agrees``: within ``CLAIM_FACTOR`` of the claim, or None
    when not measured."""

    claim: str
    source: str
    claimed: str
    measured: str
    agrees: bool | None

    def line(self) -> str:
        verdict = {True: "AGREES", False: "DISAGREES", None: "NOT MEASURED"}[self.agrees]
        if self.agrees is not None:
            verdict += f" (tolerance: within a factor of {CLAIM_FACTOR:g} of the claim)"
        return f"- {self.claim} ({self.source}): claimed {self.claimed}; measured {self.measured}. {verdict}."


def _find(results: list[MatmulErrorResult], size: int, preset: str) -> MatmulErrorResult | None:
    for r in results:
        if r.size == size and r.preset == preset:
            return r
    return None


def _within(measured: float, claimed: float) -> bool:
    return claimed / CLAIM_FACTOR <= measured <= claimed * CLAIM_FACTOR


def check_claims(results: list[MatmulErrorResult]) -> list[ClaimCheck]:
    """Put the published claims beside the measurement at the largest size measured. A ratio claim "~R x"
    agrees when the measured ratio of median |error| (against the fp32 reference, as the two-stage write-up
    measured) is within ``CLAIM_FACTOR`` of R. The DeepSeek-V3 report does not say how its "~2% maximum
    relative error" is normalised: it is read as the largest elementwise |err|/|ref| (over outputs with |ref|
    at or above the median), within ``CLAIM_FACTOR`` of 2%; the normwise max|err|/max|ref| is shown beside it."""
    size = max(r.size for r in results)
    checks: list[ClaimCheck] = []

    def ratio_claim(big: str, small: str, claimed: float, text: str) -> None:
        rb, rs = _find(results, size, big), _find(results, size, small)
        if rb is None or rs is None:
            checks.append(ClaimCheck(text, TWO_STAGE_SOURCE, f"~{claimed:g}x", f"not run at size {size}", None))
            return
        ratio = rb.abs_vs_f32[50.0] / max(rs.abs_vs_f32[50.0], 1e-300)
        checks.append(
            ClaimCheck(
                text,
                TWO_STAGE_SOURCE,
                f"~{claimed:g}x",
                f"{ratio:.3g}x (median |err| vs fp32 ref, M=N=K={size})",
                _within(ratio, claimed),
            )
        )

    # fp16/32 as the hardware does it (alignment model, which matched cuBLAS on an H200) when it was run
    f32 = "fp16/32-h100" if _find(results, size, "fp16/32-h100") is not None else "fp16/32"
    ratio_claim("fp16/16", "two_stage", 10, "two-stage error ~10x smaller than fp16/16")
    ratio_claim("two_stage", f32, 100, f"two-stage error ~100x larger than fp16/32 (model {f32})")
    ratio_claim("fp16/16", f32, 1000, f"fp16/16 error ~1000x that of fp16/32 (model {f32})")
    r8 = _find(results, size, "fp8/nopromote")
    text = "fp8 accumulation without promotion: ~2% maximum relative error at K=4096"
    if r8 is None:
        checks.append(ClaimCheck(text, DEEPSEEK_SOURCE, "~2%", "fp8/nopromote not run", None))
    else:
        note = "" if size == 4096 else f" (at K={size}, not 4096)"
        checks.append(
            ClaimCheck(
                text,
                DEEPSEEK_SOURCE,
                "~2% (their normalisation is not stated)",
                f"accumulation error vs the float64 product of the fp8 inputs: largest elementwise |err|/|ref| "
                f"(|ref| >= median) = {100 * r8.rel_elem_max:.3g}%; normwise max|err|/max|ref| = "
                f"{100 * r8.rel_max:.3g}%, ||err||_F/||ref||_F = {100 * r8.rel_fro:.3g}%{note}",
                _within(r8.rel_elem_max, 0.02) if size == 4096 else None,
            )
        )
    return checks


def format_table(results: list[MatmulErrorResult]) -> str:
    head = (
        "| M=N=K | rows | model | p50 vs f64 | p99 vs f64 | max vs f64 | p50 vs fp32 | max vs fp32 "
        "| acc. err max/(|A||B|) | det. bound | prob. bound (99%) | s |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        prob = "n/a (biased)" if r.bound_prob is None else f"{r.bound_prob:.2e}"
        lines.append(
            f"| {r.size} | {r.rows} | {r.preset} | {r.abs_vs_f64[50.0]:.3e} | {r.abs_vs_f64[99.0]:.3e} "
            f"| {r.abs_vs_f64[100.0]:.3e} | {r.abs_vs_f32[50.0]:.3e} | {r.abs_vs_f32[100.0]:.3e} "
            f"| {r.max_over_abs:.2e} | {r.bound_det:.2e} | {prob} | {r.seconds:.2f} |"
        )
    return "\n".join(lines)


def write_csv(results: list[MatmulErrorResult], out_dir: Path) -> tuple[Path, Path]:
    header = ["size", "rows", "model", "reference", *[f"p{p:g}" for p in PERCENTILES], "rel_fro", "rel_max",
              "rel_elem_max", "max_over_abs", "bound_det", "bound_prob", "seconds"]  # fmt: skip
    table = [
        [r.size, r.rows, r.preset, ref, *[f"{pct[p]:.6e}" for p in PERCENTILES], f"{r.rel_fro:.6e}",
         f"{r.rel_max:.6e}", f"{r.rel_elem_max:.6e}", f"{r.max_over_abs:.6e}", f"{r.bound_det:.6e}",
         "" if r.bound_prob is None else f"{r.bound_prob:.6e}", f"{r.seconds:.3f}"]
        for r in results
        for ref, pct in (("float64", r.abs_vs_f64), ("fp32", r.abs_vs_f32))
    ]  # fmt: skip
    curves = [[r.size, r.preset, p, f"{v:.6e}"] for r in results for p, v in zip(CURVE_POINTS, r.curve_vs_f64)]
    return (
        write_table(out_dir / "matmul_error.csv", header, table),
        write_table(out_dir / "matmul_error_curves.csv", ["size", "model", "percentile", "abs_err_vs_float64"], curves),
    )


def plot_curves(results: list[MatmulErrorResult], path: Path) -> Path:
    """Percentile curves of |error| vs float64, one panel per size (needs matplotlib: ``mixprec[plot]``)."""
    plt = pyplot()
    sizes = sorted({r.size for r in results})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for r in results:
            if r.size == size:
                ax.plot(CURVE_POINTS, [max(v, 1e-12) for v in r.curve_vs_f64], label=r.preset)
        ax.set_yscale("log")
        ax.set_xlabel("percentile")
        ax.set_ylabel("|error| vs float64")
        rows = next(r.rows for r in results if r.size == size)
        ax.set_title(f"M=N=K={size}" + (f" ({rows} random rows)" if rows < size else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class MatmulErrorConfig:
    """The arguments of :func:`matmul_error_study`, checked by :func:`check_study_arguments` at construction
    (``progress``: None draws the bar when stderr is a terminal)."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    presets: tuple[str, ...] = DEFAULT_PRESETS
    rows: int = DEFAULT_ROWS
    seed: int = DEFAULT_SEED
    device: str = DEFAULT_DEVICE
    progress: bool | None = None

    def __post_init__(self) -> None:
        check_study_arguments(self.sizes, self.presets, rows=self.rows, device=self.device)


def run(config: MatmulErrorConfig, output: StudyOutput) -> int:
    """``mixprec study matmul-error``: measure, print the table and the claims beside the measurement, write
    ``matmul_error.csv`` and ``matmul_error_curves.csv`` (and ``matmul_error.png``)."""
    c = config
    print(f"matmul-error: sizes {c.sizes}, rows {c.rows}, device {c.device}, seed {c.seed}", flush=True)
    results = matmul_error_study(c.sizes, c.presets, rows=c.rows, seed=c.seed, device=c.device, progress=c.progress)
    print()
    print(format_table(results))
    print()
    print("Claims:")
    for check in check_claims(results):
        print(check.line())
    written = [*write_csv(results, output.out_dir)]
    if output.plot:
        written.append(plot_curves(results, output.path("matmul_error.png")))
    print(wrote_lines(written))
    return 0
