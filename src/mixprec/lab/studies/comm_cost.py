"""``mixprec study comm-cost``: time and bytes of gradient reductions on clusters this machine cannot hold.

A bucket of N elements on m nodes of n ranks, for a bf16 ring (NCCL's, gloo's), the flat fp32-accumulating
all-to-all (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``), the hierarchical fp32-accumulating
scheme (``topology=``; node partials in bf16 or fp32 across nodes) and the hierarchical uint8 scheme of
``mixprec.compress``. Each scheme is a few phases; a phase uses three resources, each node's NIC (bytes /
(rate x wire efficiency)), each rank's intra-node link, and compute (CPU per byte sent through a socket,
plus memory passes: copies, widenings, fp32 adds, roundings, counted in bytes from the code). Within a phase
the resources overlap: its time is the slowest one plus the others' share of the pipeline's fill and drain,
plus per-message latency (:mod:`mixprec.lab.studies.comm_cost_model`). ``--calibration FILE``
(``benchmarks/bench_netns_fp32.py --json``) fits wire efficiency and the two CPU costs by least squares and
prints model vs measured for every row (:mod:`mixprec.lab.studies.comm_cost_fit`). Then a table per node count,
which reduction to pick and why, and a plot. Formulas: ``docs/comm.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.lab.studies.base import StudyOutput, pyplot, save_figure
from mixprec.lab.studies.comm_cost_fit import compare_with_measurements, fit_calibration
from mixprec.lab.studies.comm_cost_model import SCHEMES, Calibration, Cluster, Cost, costs, recommend
from mixprec.parallel.buckets import DEFAULT_BUCKET_SIZE

__all__ = [
    "COMPUTE",
    "DEFAULT_INTER_GBIT",
    "DEFAULT_INTER_LATENCY_US",
    "DEFAULT_INTRA_GBIT",
    "DEFAULT_INTRA_LATENCY_US",
    "DEFAULT_MEMORY_GBS",
    "DEFAULT_NODES",
    "DEFAULT_PER_NODE",
    "OPS",
    "CommCostConfig",
    "format_costs",
    "plot_costs",
    "run",
]

# The default cluster: nodes of 8 GPUs on a 400 Gbit/s NIC each and a 2400 Gbit/s link per GPU inside.
DEFAULT_NODES = (2, 4, 16, 64, 256, 1024)
DEFAULT_PER_NODE = 8
DEFAULT_INTER_GBIT = 400.0
DEFAULT_INTRA_GBIT = 2400.0
DEFAULT_INTER_LATENCY_US = 10.0
DEFAULT_INTRA_LATENCY_US = 3.0
DEFAULT_MEMORY_GBS = 1000.0  # about a GPU's HBM under elementwise kernels
OPS = ("rs", "ar")
# gpu: DEFAULT_MEMORY_GBS-like passes and no CPU per socket byte (NVLink/RDMA); calibrated: the fitted CPU costs.
COMPUTE = ("gpu", "calibrated")
_WHY = (
    "\nWhy: the ring's error grows like sqrt(DP) (reduction-error study); the fp32-accumulating schemes "
    "round once (flat, hier_fp32_inter) or twice (hier_fp32) whatever DP. The flat all-to-all sends n "
    "times the ring's bytes across each node's NIC and sums only once they are in; hier_fp32 sends "
    "(m-1)/m N, at most the ring's, and sums segment by segment while the next is on the wire, so it is "
    "the fastest accurate choice once the NIC is the bottleneck; hier_fp32_inter doubles those bytes "
    "for one rounding."
)


@dataclass(frozen=True)
class CommCostConfig:
    """What the study projects: one cluster per node count, a bucket of ``numel`` bf16 elements reduced by
    ``op`` ("rs" or "ar"), elementwise passes at ``memory_gbs`` GB/s; ``calibration`` and ``holdout``: checked
    ``bench_netns_fp32.py --json`` data (:func:`~mixprec.lab.studies.comm_cost_fit.read_benchmark`), the first
    fitted, the second only predicted; ``compute`` "calibrated" takes the fitted CPU costs for the projection."""

    clusters: tuple[Cluster, ...]
    numel: int = DEFAULT_BUCKET_SIZE
    op: str = "rs"
    memory_gbs: float = DEFAULT_MEMORY_GBS
    compute: str = "gpu"
    calibration: dict | None = None
    holdout: dict | None = None

    def __post_init__(self) -> None:
        if not self.clusters:
            raise ValueError("clusters must hold at least one cluster")
        check_positive_int("numel", self.numel)
        check_choice("op", self.op, OPS)
        check_positive_float("memory_gbs", self.memory_gbs)
        check_choice("compute", self.compute, COMPUTE)
        if self.holdout is not None and self.calibration is None:
            raise ValueError("--holdout needs --calibration (the file the constants are fitted on)")
        if self.compute == "calibrated" and self.calibration is None:
            raise ValueError("--compute calibrated needs --calibration")


def _calibration(config: CommCostConfig) -> Calibration:
    """The constants of the projection; with a benchmark file, the fit printed beside every measured row."""
    calib = Calibration(memory_ns_per_byte=1 / config.memory_gbs)
    if config.calibration is None:
        return calib
    fitted = fit_calibration(config.calibration)
    print(compare_with_measurements(config.calibration, config.holdout, calib=fitted)[0] + "\n")
    # The wire efficiency carries over to any TCP link; the CPU costs are the benchmark machine's.
    return fitted if config.compute == "calibrated" else replace(calib, wire_efficiency=fitted.wire_efficiency)


def format_costs(clusters: Sequence[Cluster], results: Sequence[dict[str, Cost]]) -> str:
    """Markdown: one line per node count, each scheme's milliseconds and MiB per node across nodes."""
    header = "| nodes | " + " | ".join(f"{s} ms | {s} MiB/node" for s in SCHEMES) + " |"
    lines = [header, "|---:|" + "---:|---:|" * len(SCHEMES)]
    for cluster, c in zip(clusters, results, strict=True):
        cells = [f"{1e3 * c[s].seconds:.2f} | {c[s].inter_bytes_per_node / 2**20:.1f}" for s in SCHEMES]
        lines.append(f"| {cluster.nodes} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(config: CommCostConfig, output: StudyOutput) -> int:
    """``mixprec study comm-cost``: (the calibration,) the cost table, the pick per node count and why, and
    ``comm_cost.png``."""
    calib = _calibration(config)
    first = config.clusters[0]
    print(
        f"comm-cost: {config.op}, bucket {config.numel} bf16 elements, {first.per_node} ranks per node, inter-node "
        f"{first.inter_gbit:g} Gbit/s + {first.inter_latency_s * 1e6:g} us, intra-node {first.intra_gbit:g} Gbit/s + "
        f"{first.intra_latency_s * 1e6:g} us, wire efficiency {calib.wire_efficiency:.2f}, memory passes "
        f"{1 / calib.memory_ns_per_byte:g} GB/s, socket CPU {calib.socket_ns_per_byte:g} ns/byte\n"
    )
    results = [costs(cluster, config.numel, config.op, calib) for cluster in config.clusters]
    print(format_costs(config.clusters, results))
    print()
    for cluster in config.clusters:
        print(f"{cluster.nodes} nodes: {recommend(cluster, config.numel, config.op, calib)}")
    print(_WHY)
    if output.plot:
        print(f"wrote {plot_costs(config.clusters, results, output.path('comm_cost.png'))}")
    return 0


def plot_costs(clusters: Sequence[Cluster], results: Sequence[dict[str, Cost]], path: Path) -> Path:
    """Milliseconds per bucket against the node count, one line per scheme, log-log (needs matplotlib)."""
    plt = pyplot()
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
    return save_figure(fig, path)
