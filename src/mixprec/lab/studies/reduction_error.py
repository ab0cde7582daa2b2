"""``mixprec study reduction-error``: the error of reducing fp16/bf16 gradients over P data-parallel ranks.

Simulated ranks in one process. Every rank holds N gradient elements already in the wire dtype, and each
method's sum is compared with the exact (float64) sum of those same values:

* ring: gloo's ring all-reduce as measured (``make_reducer("native")``'s model), the partial sum rounded to the
  wire dtype at each of P-1 hops.
* tree: pairwise reduction in rank order (``NativeReducer(algorithm="tree")``: the shape of NCCL's tree), rounded
  to the wire dtype at each of log2(P) levels.
* fp32_accumulate: wire-dtype values summed in fp32, rounded once (mixprec; Megatron-LM's
  reduce_scatter_with_fp32_accumulation).
* fp32_accumulate_sr: the same with one stochastic rounding.
* fp32_sum_fp32_out: the fp32 sum kept in fp32 (what the sharded optimizer receives).
* hierarchical rows (``--ranks-per-node``, default 8; their own table and CSV): the two-stage scheme of
  mixprec.comm.hierarchical_fp32, node partials rounded to the wire (``hierarchical``) or kept in fp32
  (``hierarchical_fp32_inter``).

Every method is the ``model`` of the reducer it names (:mod:`mixprec.comm.models`), summing (no average);
buckets are zero-padded to the reducers' multiple of ``lcm(P, 128)`` and the errors taken on the N elements.
Errors: rel_error = ||r - s|| / ||s|| and max_error = max|r - s| / max|s| (s the float64 sum), beside the
error table of a public write-up of Megatron-LM's fp32-accumulating reduce-scatter. Gradients: normal or
Student-t (3 degrees of freedom). The model of a hop, the gradients and the measured results: docs/studies.md.
Run time on 2 busy CPU cores: --quick about 5 s, the defaults about a minute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mixprec.comm import GradReducer, make_reducer
from mixprec.comm.models import fp32_accumulate_rows
from mixprec.comm.reducer import bucket_multiple
from mixprec.comm.topology import Topology
from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.lab.studies.base import DEFAULT_SEED, StudyOutput, pyplot, save_figure, write_rows_csv, wrote_lines

__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "PUBLISHED_ERROR_TABLE",
    "QUICK_DP_SIZES",
    "QUICK_ELEMENTS",
    "WIRES",
    "ReductionErrorConfig",
    "ReductionErrorRow",
    "compare_with_published_table",
    "draw_gradients",
    "HIERARCHICAL_METHODS",
    "format_hierarchical_table",
    "format_table",
    "fp32_accumulate_reduce",
    "hierarchical_reduce",
    "plot_errors",
    "ring_reduce",
    "run",
    "run_study",
    "tree_reduce",
    "write_csv",
]

METHODS = ("ring", "tree", "fp32_accumulate", "fp32_accumulate_sr", "fp32_sum_fp32_out")
HIERARCHICAL_METHODS = ("hierarchical", "hierarchical_fp32_inter")
DISTRIBUTIONS = ("normal", "student-t")
_WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}
WIRES = tuple(_WIRES)
# --quick: the published table's sizes, fewer elements (about 5 s on 2 busy cores).
QUICK_DP_SIZES = (8, 64, 512)
QUICK_ELEMENTS = 2048

# The "Gradient Error" table (fp16 reduction) of a public write-up of Megatron-LM's fp32-accumulating
# reduce-scatter, as printed there: DP -> (FP16 accumulation, FP32 accumulation). The write-up does not say what
# "error" measures; it is compared here with the relative error.
PUBLISHED_ERROR_TABLE: dict[int, tuple[float, float]] = {8: (1e-5, 1e-7), 64: (8e-5, 8e-7), 512: (6e-4, 6e-6)}
# RMS relative error of one round-to-nearest, in units of u, for magnitudes log-uniform over a binade:
# the error is uniform on +-ulp/2, so E[(err/x)^2] = ulp^2 E[x^-2] / 12 with E[x^-2] = 3 / (8 ln 2) on [1, 2)
# and ulp = 2u there: sqrt(4 * 3 / (8 ln 2) / 12) = 0.42.
_RMS_ROUNDING = math.sqrt(4 * 3 / (8 * math.log(2)) / 12)


@dataclass(frozen=True)
class ReductionErrorConfig:
    """What the study simulates.

    Attributes:
        dp_sizes: data-parallel sizes P, each >= 2.
        elements: gradient elements per rank N, >= 1 (the error statistics are over these).
        wires: wire dtypes, names from ``"fp16"``, ``"bf16"``.
        distributions: from ``"normal"``, ``"student-t"``.
        scale: standard deviation of the normal gradients, and the scale of the t ones (> 0).
        seed: seed of the gradients and of the stochastic rounding.
        ranks_per_node: ranks per node of the hierarchical rows (None: no such rows); a DP size it does
            not divide gets none.
    """

    dp_sizes: tuple[int, ...] = (8, 64, 512, 4096)
    elements: int = 8192
    wires: tuple[str, ...] = ("fp16", "bf16")
    distributions: tuple[str, ...] = DISTRIBUTIONS
    scale: float = 1e-3
    seed: int = DEFAULT_SEED
    ranks_per_node: int | None = 8

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None:
            check_positive_int("ranks_per_node", self.ranks_per_node)
        if not self.dp_sizes:
            raise ValueError("dp_sizes must name at least one data-parallel size")
        for p in self.dp_sizes:
            check_positive_int("dp_sizes entry", p, minimum=2)
        check_positive_int("elements", self.elements)
        for w in self.wires:
            check_choice("wire", w, tuple(_WIRES))
        for d in self.distributions:
            check_choice("distribution", d, DISTRIBUTIONS)
        check_positive_float("scale", self.scale)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int; got {type(self.seed).__name__}")


@dataclass(frozen=True)
class ReductionErrorRow:
    wire: str
    distribution: str
    dp: int
    method: str
    rel_error: float
    max_error: float


# ---------------------------------------------------------------------------------------------- numerics
def draw_gradients(
    dp: int, elements: int, *, distribution: str, scale: float, wire: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """(dp, elements) gradients, rounded to ``wire`` (nearest) and held exactly in fp32."""
    check_choice("distribution", distribution, DISTRIBUTIONS)
    out = torch.empty(dp, elements, dtype=torch.float32)
    # Rows in blocks, so that the float64 draws stay small whatever dp is.
    block = max(1, (1 << 20) // elements)
    for start in range(0, dp, block):
        stop = min(dp, start + block)
        z = torch.randn(stop - start, elements, generator=generator, dtype=torch.float64)
        if distribution == "student-t":
            # t_3 = Z / sqrt(chi2_3 / 3), chi2_3 the sum of three squared normals.
            chi2 = torch.randn(3, stop - start, elements, generator=generator, dtype=torch.float64).square().sum(0)
            z = z / torch.sqrt(chi2 / 3)
        out[start:stop] = (z * scale).to(wire).float()
    return out


def exact_sum(g: torch.Tensor) -> torch.Tensor:
    """float64 sum over ranks (error ~ P * 2**-53 relative to sum |g|, negligible here), in row blocks."""
    total = torch.zeros(g.shape[1], dtype=torch.float64)
    for start in range(0, g.shape[0], 256):
        total += g[start : start + 256].double().sum(0)
    return total


def _as_buckets(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` (P, N) in ``dtype`` (exact: the values are wire values), zero-padded to the reducers' bucket multiple."""
    dp, n = g.shape
    rows = torch.zeros(dp, -(-n // bucket_multiple(dp)) * bucket_multiple(dp), dtype=dtype)
    rows[:, :n] = g
    return rows


def _model(reducer: GradReducer, g: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``reducer``'s model of the sum over ranks of ``g`` (P, N) sent in ``wire``; (N,) fp32."""
    return reducer.model(_as_buckets(g, wire), average=False)[0, : g.shape[1]].float()


def ring_reduce(g: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """gloo's ring all-reduce of ``g`` (P, N) in ``wire`` (:func:`mixprec.comm.models.gloo_ring_sum`, through
    ``make_reducer("native")``), the partial sum rounded at every hop; returns (N,) fp32. Chunk c of the padded
    tensor starts at rank c-1 and travels down the ring: ``((x[c-1] + x[c-2]) + ...) + x[c]``."""
    return _model(make_reducer("native"), g, wire)


def tree_reduce(g: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """Binary-tree reduction over ranks in rank order, rounding at each level (an odd last row waits a level):
    ``make_reducer("native", algorithm="tree")``, the shape of NCCL's tree."""
    return _model(make_reducer("native", algorithm="tree"), g, wire)


def fp32_accumulate_reduce(
    g: torch.Tensor,
    wire: torch.dtype | None,
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """fp32 sum over ranks in rank order (``make_reducer("fp32_accumulate")``'s model), then one rounding to
    ``wire`` (nearest, or stochastic: each owner rounds its shard with its rank's stream, the streams seeded
    from one draw of ``generator``); ``wire=None`` keeps the fp32 sum (what the sharded optimizer receives)."""
    if wire is None:
        return fp32_accumulate_rows(_as_buckets(g, torch.float32), average=False)[: g.shape[1]]
    if rounding == "stochastic":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return _model(make_reducer("fp32_accumulate", rounding="stochastic", seed=seed), g, wire)
    return _model(make_reducer("fp32_accumulate"), g, wire)


def hierarchical_reduce(
    g: torch.Tensor, wire: torch.dtype, ranks_per_node: int, *, fp32_inter: bool = False
) -> torch.Tensor:
    """Two-stage sum (``make_reducer("fp32_accumulate_hierarchical")``'s model): each node's ``ranks_per_node``
    rows summed in fp32 in rank order and rounded to ``wire`` (kept in fp32 with ``fp32_inter``), then the node
    partials summed in fp32 in node order and rounded to ``wire``. Ranks are numbered node-major."""
    dp = g.shape[0]
    reducer = make_reducer(
        "fp32_accumulate_hierarchical",
        topology=Topology(dp // ranks_per_node, ranks_per_node),
        inter_node_dtype=torch.float32 if fp32_inter else None,
    )
    return _model(reducer, g, wire)


def _errors(result: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    err = result.double() - exact
    rel = float(torch.linalg.vector_norm(err) / torch.linalg.vector_norm(exact))
    worst = float(err.abs().max() / exact.abs().max())
    return rel, worst


def run_study(config: ReductionErrorConfig, *, progress: bool = False) -> list[ReductionErrorRow]:
    """Every (wire, distribution, DP, method) of ``config``; deterministic for a given seed."""
    rows: list[ReductionErrorRow] = []
    for wire_name in config.wires:
        wire = _WIRES[wire_name]
        for dist_name in config.distributions:
            for dp in config.dp_sizes:
                gen = torch.Generator().manual_seed(config.seed * 1_000_003 + dp)
                g = draw_gradients(
                    dp, config.elements, distribution=dist_name, scale=config.scale, wire=wire, generator=gen
                )
                exact = exact_sum(g)
                results = {
                    "ring": ring_reduce(g, wire),
                    "tree": tree_reduce(g, wire),
                    "fp32_accumulate": fp32_accumulate_reduce(g, wire),
                    "fp32_accumulate_sr": fp32_accumulate_reduce(g, wire, rounding="stochastic", generator=gen),
                    "fp32_sum_fp32_out": fp32_accumulate_reduce(g, None),
                }
                per_node = config.ranks_per_node
                if per_node is not None and dp % per_node == 0:
                    results["hierarchical"] = hierarchical_reduce(g, wire, per_node)
                    results["hierarchical_fp32_inter"] = hierarchical_reduce(g, wire, per_node, fp32_inter=True)
                for method in (*METHODS, *HIERARCHICAL_METHODS):
                    if method in results:
                        rel, worst = _errors(results[method], exact)
                        rows.append(ReductionErrorRow(wire_name, dist_name, dp, method, rel, worst))
                if progress:
                    print(f"  {wire_name} {dist_name:9s} DP={dp:5d} done", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- reporting
def format_table(rows: list[ReductionErrorRow], metric: str = "rel_error") -> str:
    """Markdown table: one row per (wire, distribution, DP), one column per method."""
    check_choice("metric", metric, ("rel_error", "max_error"))
    keys = sorted({(r.wire, r.distribution, r.dp) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    by_key = {(r.wire, r.distribution, r.dp, r.method): getattr(r, metric) for r in rows}
    lines = ["| wire | gradients | DP | " + " | ".join(METHODS) + " |", "|---|---|---:|" + "---:|" * len(METHODS)]
    for wire, dist_name, dp in keys:
        cells = [f"{by_key[(wire, dist_name, dp, m)]:.2e}" for m in METHODS]
        lines.append(f"| {wire} | {dist_name} | {dp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_hierarchical_table(rows: list[ReductionErrorRow], ranks_per_node: int) -> str:
    """The hierarchical rows beside ring and flat fp32_accumulate, relative error in units of the wire's u."""
    units = {"fp16": 2.0**-11, "bf16": 2.0**-8}
    by_key = {(r.wire, r.distribution, r.dp, r.method): r.rel_error for r in rows}
    keys = sorted({(r.wire, r.distribution, r.dp) for r in rows if r.method == "hierarchical"})
    methods = ("ring", "fp32_accumulate", *HIERARCHICAL_METHODS)
    lines = [
        f"Hierarchical ({ranks_per_node} ranks per node), relative error in units of the wire's u (fp16 2^-11, "
        "bf16 2^-8). Two roundings, flat in DP: sqrt(2) x 0.42 u RMS; fp32 across nodes: one, as flat:",
        "",
        "| wire | gradients | DP | nodes | " + " | ".join(methods) + " |",
        "|---|---|---:|---:|" + "---:|" * len(methods),
    ]
    for wire, dist_name, dp in keys:
        cells = [f"{by_key[(wire, dist_name, dp, m)] / units[wire]:.2f}" for m in methods]
        lines.append(f"| {wire} | {dist_name} | {dp} | {dp // ranks_per_node} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _growth_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(error) against log(DP)."""
    xs = [math.log(p) for p, _ in points]
    ys = [math.log(max(e, 1e-300)) for _, e in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    denom = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / denom if denom else float("nan")


def compare_with_published_table(rows: list[ReductionErrorRow]) -> str:
    """The published error table beside the measured fp16 / normal-gradient relative errors, and where they
    disagree."""
    measured = {(r.dp, r.method): r.rel_error for r in rows if r.wire == "fp16" and r.distribution == "normal"}
    dps = [dp for dp in PUBLISHED_ERROR_TABLE if (dp, "ring") in measured]
    if not dps:
        return "Published table comparison: needs fp16 wire, normal gradients and DP in {8, 64, 512}."
    lines = [
        "The published claim (the error table of a public write-up of Megatron-LM's fp32-accumulating "
        "reduce-scatter; fp16 reduction, 'error' undefined there) beside the measured relative error (fp16 wire, "
        "normal gradients):",
        "",
        "| DP | claimed: FP16 accumulation | measured: ring | claimed: FP32 accumulation | "
        "measured: fp32_accumulate (fp16 out) | measured: fp32 sum, fp32 out |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for dp in dps:
        s16, s32 = PUBLISHED_ERROR_TABLE[dp]
        lines.append(
            f"| {dp} | {s16:.0e} | {measured[(dp, 'ring')]:.2e} | {s32:.0e} | "
            f"{measured[(dp, 'fp32_accumulate')]:.2e} | {measured[(dp, 'fp32_sum_fp32_out')]:.2e} |"
        )
    all_dps = sorted({dp for dp, m in measured if m == "ring"})
    ring_growth = _growth_exponent([(dp, measured[(dp, "ring")]) for dp in all_dps])
    claim_growth = _growth_exponent([(dp, v[0]) for dp, v in PUBLISHED_ERROR_TABLE.items()])
    acc = [measured[(dp, "fp32_accumulate")] for dp in all_dps]
    fp32_out = [measured[(dp, "fp32_sum_fp32_out")] for dp in all_dps]
    u16 = 2.0**-11
    below_u = [dp for dp in dps if PUBLISHED_ERROR_TABLE[dp][0] < u16]
    lines += [
        "",
        "Where the measurement disagrees with the published claim:",
        f"* Ring (rounding at every hop): the error grows like DP^{ring_growth:.2f} here (random rounding errors "
        f"add up like sqrt(DP)), not like DP^{claim_growth:.2f} as claimed, and it is "
        f"{measured[(dps[0], 'ring')] / PUBLISHED_ERROR_TABLE[dps[0]][0]:.0f}x the claimed value at DP={dps[0]}.",
    ]
    if below_u:
        lines.append(
            f"* The claimed fp16 numbers at DP {', '.join(map(str, below_u))} lie below fp16's unit roundoff "
            f"u = {u16:.1e}: on random data a result stored in fp16 cannot be that accurate (its final rounding "
            f"alone costs about {_RMS_ROUNDING * u16:.1e} RMS)."
        )
    lines.append(
        f"* fp32 accumulation with an fp16 result: {min(acc):.2e} to {max(acc):.2e} across DP "
        f"{all_dps[0]}-{all_dps[-1]}: flat, and equal to the RMS error of the single final rounding "
        f"({_RMS_ROUNDING:.2f} u = {_RMS_ROUNDING * u16:.1e} for log-uniform magnitudes). The claimed 1e-7 to 6e-6, "
        "growing with DP, does not describe it."
    )
    if max(fp32_out) == 0.0:
        lines.append(
            "* The fp32 sum kept in fp32 (the sharded optimizer's fp32 gradient shards) is exact here: fp16 "
            "values of these magnitudes fit fp32's 24-bit significand with room for the carries, so no addition "
            "rounds. The claimed FP32 column (1e-7 to 6e-6) describes no measured configuration."
        )
    else:
        lines.append(
            f"* Only the fp32 sum kept in fp32 (the sharded optimizer's fp32 gradient shards) has errors near the "
            f"claimed FP32 column: {min(fp32_out):.2e} to {max(fp32_out):.2e}, growing like "
            f"DP^{_growth_exponent(list(zip(all_dps, fp32_out, strict=True))):.2f}."
        )
    lines.append(
        "* What the claim gets right: rounding at every hop is worse than one fp32 sum, and the gap widens with DP "
        f"(ring / fp32_accumulate: {measured[(all_dps[0], 'ring')] / acc[0]:.1f}x at DP={all_dps[0]}, "
        f"{measured[(all_dps[-1], 'ring')] / acc[-1]:.1f}x at DP={all_dps[-1]})."
    )
    return "\n".join(lines)


def write_csv(rows: list[ReductionErrorRow], path: Path) -> Path:
    return write_rows_csv(rows, path, formats={"rel_error": ".6e", "max_error": ".6e"})


def plot_errors(rows: list[ReductionErrorRow], path: Path) -> Path:
    """Relative error vs DP, log-log, one panel per (wire, distribution) (needs matplotlib: ``mixprec[plot]``)."""
    plt = pyplot()
    panels = sorted({(r.wire, r.distribution) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (wire, dist_name) in zip(axes[0], panels, strict=True):
        for method in METHODS:
            pts = sorted(
                (r.dp, r.rel_error) for r in rows if (r.wire, r.distribution, r.method) == (wire, dist_name, method)
            )
            shown = [(p, e) for p, e in pts if e > 0]  # an exact result (error 0) has no place on a log axis
            label = method if len(shown) == len(pts) else f"{method} (exact at {len(pts) - len(shown)} DP)"
            ax.plot([p for p, _ in shown], [e for _, e in shown], marker="o", label=label)
        if (wire, dist_name) == ("fp16", "normal"):
            claim_dps = sorted(PUBLISHED_ERROR_TABLE)
            for col, name in ((0, "published claim: FP16 acc."), (1, "published claim: FP32 acc.")):
                ax.plot(claim_dps, [PUBLISHED_ERROR_TABLE[d][col] for d in claim_dps], "x--", color="gray", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel size")
        ax.set_ylabel("relative error vs float64")
        ax.set_title(f"{wire} wire, {dist_name} gradients")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- the run
def run(config: ReductionErrorConfig, output: StudyOutput) -> int:
    """``mixprec study reduction-error``: measure, print the tables and the comparison with the published one,
    write ``reduction_error.csv`` (and ``reduction_error_hierarchical.csv``, ``reduction_error.png``)."""
    print(
        f"reduction-error: DP {config.dp_sizes}, {config.elements} elements per rank, wires {config.wires}, "
        f"gradients {config.distributions} (scale {config.scale:g}), seed {config.seed}",
        flush=True,
    )
    all_rows = run_study(config, progress=True)
    rows = [r for r in all_rows if r.method in METHODS]
    hier_rows = [r for r in all_rows if r.method not in METHODS]
    print("\nRelative error ||r - s|| / ||s|| against the float64 sum s:\n")
    print(format_table(rows, "rel_error"))
    print("\nMax error max|r - s| / max|s|:\n")
    print(format_table(rows, "max_error"))
    print()
    print(compare_with_published_table(rows))
    written = [write_csv(rows, output.path("reduction_error.csv"))]
    if hier_rows:
        print()
        print(format_hierarchical_table(all_rows, config.ranks_per_node or 1))
        written.append(write_csv(hier_rows, output.path("reduction_error_hierarchical.csv")))
    if output.plot:
        written.append(plot_errors(rows, output.path("reduction_error.png")))
    print(wrote_lines(written))
    return 0
