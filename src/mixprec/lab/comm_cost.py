"""``mixprec study comm-cost``: time and bytes of gradient reductions on clusters this machine cannot hold.

An alpha-beta model per bucket of N elements on m nodes of n ranks: a bf16 ring (NCCL's, gloo's), the flat
fp32-accumulating all-to-all (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``), the hierarchical
fp32-accumulating scheme (``topology=``; node partials in bf16 or fp32 across nodes) and the hierarchical uint8
scheme of ``mixprec.compress``. Links: each node's NIC (inter-node bandwidth and latency, shared by its n
ranks) and each rank's intra-node link; the hierarchical schemes are pipelined over segments. The wire
efficiency is calibrated on ``benchmarks/bench_netns_fp32.py --json`` (``--calibration FILE``, which also
prints model vs measured). It prints a table per node count, which reduction to pick and why (speed among the
accurate ones, with the error each costs in units of the wire's u), and a plot. Formulas: ``docs/comm.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mixprec.core.validate import check_choice, check_positive_float, check_positive_int

__all__ = [
    "SCHEMES",
    "Calibration",
    "Cluster",
    "Cost",
    "add_arguments",
    "compare_with_measurements",
    "costs",
    "fit_calibration",
    "prepare",
    "recommend",
]

SCHEMES = ("ring", "flat_a2a", "hier_fp32", "hier_fp32_inter", "hier_uint8")
# RMS relative error in units of the wire's u (reduction-error study, 8 ranks per node): one rounding 0.42;
# two 0.60; a ring's grows like 0.30 sqrt(W). uint8: 1/255 of each 2048-element chunk's range, not a u.
_ROUNDING_RMS = 0.42
# The benchmark's method names -> the model's.
_BENCH = {"hier": "hier_fp32", "flat": "flat_a2a", "bf16": "ring"}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int
    inter_gbit: float  # per node (its NIC), each direction
    intra_gbit: float  # per rank, each direction
    inter_latency_s: float
    intra_latency_s: float

    def __post_init__(self) -> None:
        check_positive_int("nodes", self.nodes, minimum=2)
        check_positive_int("per_node", self.per_node)
        check_positive_float("inter_gbit", self.inter_gbit)
        check_positive_float("intra_gbit", self.intra_gbit)
        check_positive_float("inter_latency_s", self.inter_latency_s, allow_zero=True)
        check_positive_float("intra_latency_s", self.intra_latency_s, allow_zero=True)


@dataclass(frozen=True)
class Calibration:
    """wire_efficiency: payload rate / link rate (Ethernet, IP, TCP headers and ACKs, pacing);
    sum_ns: fp32 sum work per element and addend (a GPU's HBM makes it about 0.01 ns, a CPU core about 1);
    segments: pipeline segments of the hierarchical schemes."""

    wire_efficiency: float = 0.94
    sum_ns: float = 0.01
    segments: int = 4


@dataclass(frozen=True)
class Cost:
    seconds: float
    inter_bytes_per_node: float


def _phase(nbytes: float, gbit: float, eff: float) -> float:
    return nbytes * 8 / (gbit * 1e9 * eff)


def costs(cluster: Cluster, numel: int, op: str, calib: Calibration, wire_bytes: int = 2) -> dict[str, Cost]:
    """Every scheme's time and inter-node bytes per node for one reduce-scatter (``"rs"``) or all-reduce
    (``"ar"``) of ``numel`` elements of ``wire_bytes`` each."""
    check_choice("op", op, ("rs", "ar"))
    m, n = cluster.nodes, cluster.per_node
    w, eff, k = m * n, calib.wire_efficiency, calib.segments
    ar = op == "ar"
    s = wire_bytes
    shard = numel / w
    a_e, a_i = cluster.inter_latency_s, cluster.intra_latency_s
    sum_s = calib.sum_ns * 1e-9
    out: dict[str, Cost] = {}

    # Ring: W-1 steps (2 (W-1) for the all-reduce), each moves a shard over every edge; one edge leaves a node.
    steps = (w - 1) * (2 if ar else 1)
    out["ring"] = Cost(steps * (a_e + _phase(shard * s, cluster.inter_gbit, eff)), steps * shard * s)

    # Flat all-to-all: n ranks of a node each send a shard to each of (m-1) n remote ranks through the NIC.
    inter = n * (m - 1) * n * shard * s
    t = (w - 1) * a_e + max(
        _phase(inter, cluster.inter_gbit, eff), _phase((n - 1) * shard * s, cluster.intra_gbit, eff)
    )
    t += numel * sum_s
    if ar:  # then a ring all-gather
        t += (w - 1) * (a_e + _phase(shard * s, cluster.inter_gbit, eff))
        inter += (w - 1) * shard * s
    out["flat_a2a"] = Cost(t, inter)

    def hierarchical(inter_bytes: float, gather_inter: float, gather_intra: float, work: float) -> Cost:
        stage1 = _phase((n - 1) / n * numel * s, cluster.intra_gbit, eff)
        stage2 = _phase(inter_bytes + gather_inter, cluster.inter_gbit, eff)
        parts = [stage1, stage2, work]
        # Pipelined: the slowest stage, plus one segment of each of the others, plus the latencies.
        t = max(parts) + (sum(parts) - max(parts)) / k + k * ((n - 1) * a_i + (m - 1) * a_e * (2 if ar else 1))
        if ar:
            t += (n - 1) * a_i + _phase(gather_intra, cluster.intra_gbit, eff)
        return Cost(t, inter_bytes + gather_inter)

    node_part = (m - 1) / m * numel  # elements a node sends to other nodes in stage 2
    sums = numel * sum_s + numel / n * sum_s
    gather = node_part * s if ar else 0.0
    intra_gather = (n - 1) / n * numel * s if ar else 0.0
    out["hier_fp32"] = hierarchical(node_part * s, gather, intra_gather, sums)
    out["hier_fp32_inter"] = hierarchical(node_part * 4, gather, intra_gather, sums)
    code = 1 + 8 / 2048  # uint8 codes plus an fp32 (min, max) header per 2048-element chunk
    out["hier_uint8"] = hierarchical(
        node_part * code, node_part * code if ar else 0.0, (n - 1) / n * numel * code if ar else 0.0, 3 * sums
    )
    return out


def error_in_u(scheme: str, world: int) -> str:
    return {
        "ring": f"{0.30 * math.sqrt(world):.1f} u",
        "flat_a2a": f"{_ROUNDING_RMS:.2f} u",
        "hier_fp32": f"{math.sqrt(2) * _ROUNDING_RMS:.2f} u",
        "hier_fp32_inter": f"{_ROUNDING_RMS:.2f} u",
        "hier_uint8": "~1/255 of chunk range",
    }[scheme]


def recommend(cluster: Cluster, numel: int, op: str, calib: Calibration) -> str:
    """Which reduction to pick, and the numbers behind it."""
    c = costs(cluster, numel, op, calib)
    world = cluster.nodes * cluster.per_node
    accurate = ("flat_a2a", "hier_fp32", "hier_fp32_inter")
    pick = min(accurate, key=lambda name: c[name].seconds)
    ring = c["ring"].seconds
    text = (
        f"pick {pick}: {1e3 * c[pick].seconds:.2f} ms, {c[pick].inter_bytes_per_node / 2**20:.1f} MiB per node "
        f"across nodes, error {error_in_u(pick, world)} RMS; the bf16 ring takes {1e3 * ring:.2f} ms with error "
        f"{error_in_u('ring', world)}"
    )
    if c["hier_uint8"].seconds < 0.5 * c[pick].seconds:
        text += (
            f"; hier_uint8 would take {1e3 * c['hier_uint8'].seconds:.2f} ms if the model tolerates 8-bit "
            "gradients (use error feedback)"
        )
    return text


# ---------------------------------------------------------------------------------------------- calibration
def _bench_cluster(data: dict, rate: float, intra_gbit: float) -> Cluster:
    return Cluster(int(data["nodes"]), int(data["per_node"]), rate, intra_gbit, 0.0, 0.0)


def _model_ms(data: dict, row: dict, calib: Calibration, intra_gbit: float, latency: float) -> float:
    cluster = replace(_bench_cluster(data, row["rate"], intra_gbit), inter_latency_s=latency, intra_latency_s=latency)
    op = row["op"]
    if row["method"] == "bf16" and op == "rs" and row["veth_tx_per_node"] > 1.5 * row["accounted_inter_node_per_node"]:
        op = "ar"  # gloo's reduce-scatter moves an all-reduce's bytes (its veth counter says so): model it as one
    return 1e3 * costs(cluster, int(row["numel"]), op, calib)[_BENCH[row["method"]]].seconds


def fit_calibration(data: dict) -> tuple[Calibration, float, float]:
    """Fit wire efficiency, fp32 sum cost, the loopback's bandwidth (the "intra-node" link there) and a
    per-message latency to a benchmark JSON by a grid search minimising the worst relative error;
    returns (calibration, intra_gbit, latency_s)."""
    rows = [r for r in data["rows"] if r["method"] in _BENCH and r["rate"] > 0]
    if not rows:
        raise ValueError("--calibration: the file holds no rows of the methods hier, flat, bf16")
    best: tuple[float, Calibration, float, float] | None = None
    for eff in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.94, 0.97):
        for sum_ns in (0.1, 0.3, 1.0, 2.0, 4.0, 8.0, 16.0):
            for intra in (2.0, 5.0, 10.0, 20.0, 50.0):
                for latency in (0.0, 1e-4, 5e-4, 1e-3):
                    calib = Calibration(eff, sum_ns)
                    worst = max(
                        abs(_model_ms(data, r, calib, intra, latency) / r["ms"] - 1) for r in rows if r["ms"] > 0
                    )
                    if best is None or worst < best[0]:
                        best = (worst, calib, intra, latency)
    assert best is not None
    return best[1], best[2], best[3]


def compare_with_measurements(data: dict, rate: float = 1.0) -> tuple[str, bool]:
    """Model vs measured at ``rate`` Gbit/s for a benchmark JSON; the table and whether every row is within
    25%."""
    calib, intra, latency = fit_calibration(data)
    rows = [r for r in data["rows"] if r["method"] in _BENCH and r["rate"] == rate]
    if not rows:
        raise ValueError(f"--calibration: the file holds no rows at {rate:g} Gbit/s")
    lines = [
        f"Calibration: wire efficiency {calib.wire_efficiency:.2f}, fp32 sum {calib.sum_ns:g} ns per element, "
        f"loopback {intra:g} Gbit/s, latency {1e6 * latency:g} us per message (fitted on all rates).",
        "",
        f"| op | elements | scheme | measured ms | model ms | error | within 25% | ({rate:g} Gbit/s) |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    ok = True
    for r in sorted(rows, key=lambda r: (r["op"], r["numel"], r["method"])):
        model = _model_ms(data, r, calib, intra, latency)
        err = model / r["ms"] - 1
        ok &= abs(err) <= 0.25
        lines.append(
            f"| {r['op']} | {r['numel']} | {_BENCH[r['method']]} | {r['ms']:.1f} | {model:.1f} | {100 * err:+.0f}% "
            f"| {'yes' if abs(err) <= 0.25 else 'NO'} | |"
        )
    return "\n".join(lines), ok


# ---------------------------------------------------------------------------------------------- CLI
def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_int_list, default=(2, 4, 16, 64, 256, 1024), help="node counts (>= 2)")
    parser.add_argument("--per-node", type=int, default=8, help="ranks per node")
    parser.add_argument("--inter-gbit", type=float, default=400.0, help="inter-node bandwidth per node, Gbit/s")
    parser.add_argument("--intra-gbit", type=float, default=2400.0, help="intra-node bandwidth per rank, Gbit/s")
    parser.add_argument("--inter-latency-us", type=float, default=10.0, help="inter-node latency per message, us")
    parser.add_argument("--intra-latency-us", type=float, default=3.0, help="intra-node latency per message, us")
    parser.add_argument("--bucket-m", type=float, default=40.0, help="bucket size, millions of bf16 elements")
    parser.add_argument("--op", choices=("rs", "ar"), default="rs", help="reduce-scatter (ZeRO) or all-reduce")
    parser.add_argument("--sum-ns", type=float, default=0.01, help="fp32 sum work per element and addend, ns")
    parser.add_argument("--calibration", type=Path, default=None, help="bench_netns_fp32.py --json output")
    parser.add_argument("--out-dir", type=Path, default=Path("mixprec_out/comm-cost"), help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument (ValueError naming the flag) before any work; returns the study's run."""
    if not args.nodes or any(m < 2 for m in args.nodes):
        raise ValueError(f"--nodes: every node count must be >= 2; got {args.nodes}")
    for flag, value in (("--per-node", args.per_node),):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1; got {value}")
    for flag, value in (("--inter-gbit", args.inter_gbit), ("--intra-gbit", args.intra_gbit),
                        ("--bucket-m", args.bucket_m), ("--sum-ns", args.sum_ns)):  # fmt: skip
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag} must be a finite number > 0; got {value}")
    for flag, value in (("--inter-latency-us", args.inter_latency_us), ("--intra-latency-us", args.intra_latency_us)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0; got {value}")
    data = None
    if args.calibration is not None:
        try:
            data = json.loads(Path(args.calibration).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--calibration: cannot read {str(args.calibration)!r}: {exc}") from None
        if not isinstance(data, dict) or not {"rows", "nodes", "per_node"} <= set(data):
            raise ValueError("--calibration: not a bench_netns_fp32.py --json file (needs rows, nodes, per_node)")
    numel = int(args.bucket_m * 2**20)
    clusters = [
        Cluster(m, args.per_node, args.inter_gbit, args.intra_gbit, args.inter_latency_us * 1e-6,
                args.intra_latency_us * 1e-6)
        for m in args.nodes
    ]  # fmt: skip

    def work() -> int:
        calib = Calibration(sum_ns=args.sum_ns)
        if data is not None:
            table, ok = compare_with_measurements(data)
            print(table)
            print(f"\nmodel within 25% of every measurement at 1 Gbit/s: {'yes' if ok else 'NO'}\n")
            fitted = fit_calibration(data)[0]
            calib = replace(calib, wire_efficiency=fitted.wire_efficiency)  # the sum cost stays the GPU's
        print(
            f"comm-cost: {args.op}, bucket {numel} bf16 elements, {args.per_node} ranks per node, inter-node "
            f"{args.inter_gbit:g} Gbit/s + {args.inter_latency_us:g} us, intra-node {args.intra_gbit:g} Gbit/s + "
            f"{args.intra_latency_us:g} us, wire efficiency {calib.wire_efficiency:.2f}, sum {calib.sum_ns:g} ns\n"
        )
        header = "| nodes | " + " | ".join(f"{s} ms | {s} MiB/node" for s in SCHEMES) + " |"
        lines = [header, "|---:|" + "---:|---:|" * len(SCHEMES)]
        results = []
        for cluster in clusters:
            c = costs(cluster, numel, args.op, calib)
            results.append(c)
            cells = [f"{1e3 * c[s].seconds:.2f} | {c[s].inter_bytes_per_node / 2**20:.1f}" for s in SCHEMES]
            lines.append(f"| {cluster.nodes} | " + " | ".join(cells) + " |")
        print("\n".join(lines))
        print()
        for cluster in clusters:
            print(f"{cluster.nodes} nodes: {recommend(cluster, numel, args.op, calib)}")
        print(
            "\nWhy: the ring's error grows like sqrt(DP) (reduction-error study); the fp32-accumulating schemes "
            "round once (flat, hier_fp32_inter) or twice (hier_fp32) whatever DP. The flat all-to-all sends n "
            "times the ring's bytes across each node's NIC; hier_fp32 sends (m-1)/m N, at most the ring's, so it "
            "is the fastest accurate choice once the NIC is the bottleneck; hier_fp32_inter doubles those bytes "
            "for one rounding."
        )
        if not args.no_plot:
            print(f"wrote {_plot(clusters, results, args.out_dir / 'comm_cost.png')}")
        return 0

    return work


def _plot(clusters: Sequence[Cluster], results: Sequence[dict[str, Cost]], path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)") from exc
    fig, ax = plt.subplots(figsize=(6, 4))
    nodes = [c.nodes for c in clusters]
    for s in SCHEMES:
        ax.plot(nodes, [1e3 * r[s].seconds for r in results], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("ms per bucket")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
