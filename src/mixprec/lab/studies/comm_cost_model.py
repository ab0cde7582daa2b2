"""The cost model of ``mixprec study comm-cost``: time and inter-node bytes of one gradient bucket's reduction.

A bucket of N elements on m nodes of n ranks, for a bf16 ring (NCCL's, gloo's), the flat fp32-accumulating
all-to-all (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``), the hierarchical fp32-accumulating
scheme (``topology=``; node partials in bf16 or fp32 across nodes) and the hierarchical uint8 scheme of
``mixprec.compress``. Each scheme is a few phases; a phase uses three resources, each node's NIC (bytes /
(rate x wire efficiency)), each rank's intra-node link, and compute (CPU per byte sent through a socket,
plus memory passes: copies, widenings, fp32 adds, roundings, counted in bytes from the code). Within a phase
the resources overlap: its time is the slowest one plus the others' share of the pipeline's fill and drain,
plus per-message latency. Formulas: ``docs/comm.md``, "Benchmark and cost model".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mixprec.comm.hierarchical_fp32 import segment_bounds
from mixprec.compress.options import DEFAULT_CHUNK_SIZE
from mixprec.core.validate import check_choice, check_positive_float, check_positive_int

__all__ = [
    "SCHEMES",
    "Calibration",
    "Cluster",
    "Cost",
    "Phase",
    "costs",
    "error_in_u",
    "phases",
    "recommend",
]

SCHEMES = ("ring", "flat_a2a", "hier_fp32", "hier_fp32_inter", "hier_uint8")
# RMS relative error in units of the wire's u (reduction-error study, 8 ranks per node): one rounding 0.42;
# two 0.60; a ring's grows like 0.30 sqrt(W). uint8: 1/255 of each chunk's range, not a u.
_ROUNDING_RMS = 0.42
# hier_uint8's bytes per element: uint8 codes plus an fp32 (min, max) header per chunk of the default size.
_UINT8_CODE_BYTES = 1 + 8 / DEFAULT_CHUNK_SIZE


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
    """wire_efficiency: payload rate / link rate (headers, ACKs, pacing); socket_ns_per_byte: CPU time per
    byte a rank sends through a TCP socket (kernel copies on both ends; 0 for NVLink/RDMA, where copy engines
    or the NIC move the bytes); memory_ns_per_byte: time per byte read or written by an elementwise pass
    (copy, widening, fp32 add, rounding), the inverse of the device's effective memory bandwidth; segments:
    how many the hierarchical schemes cut a shard into (``hierarchical_fp32.area_elements``' default);
    fused_sum: whether the fp32 sums run as one pass (the compiled CPU kernel) or as torch's passes."""

    wire_efficiency: float = 0.94
    socket_ns_per_byte: float = 0.0
    memory_ns_per_byte: float = 0.001  # about 1 TB/s: a GPU's HBM under elementwise kernels
    segments: int = 4
    fused_sum: bool = False  # the compiled one-pass CPU sum (mixprec.native) instead of torch's passes


@dataclass(frozen=True)
class Cost:
    seconds: float
    inter_bytes_per_node: float


@dataclass(frozen=True)
class Phase:
    """One step of a scheme, per node (inter) or per rank (the rest); ``fill`` is the fraction of the
    non-bottleneck resources' time that does not overlap the bottleneck's (a pipeline's first and last
    segment; 1: run one after the other, 0: fully overlapped)."""

    inter_bytes: float = 0.0
    intra_bytes: float = 0.0
    socket_bytes: float = 0.0
    memory_bytes: float = 0.0
    inter_messages: float = 0.0
    intra_messages: float = 0.0
    fill: float = 0.0

    def seconds(self, cluster: Cluster, calib: Calibration) -> float:
        eff = calib.wire_efficiency
        parts = [
            self.inter_bytes * 8 / (cluster.inter_gbit * 1e9 * eff),
            self.intra_bytes * 8 / (cluster.intra_gbit * 1e9 * eff),
            1e-9 * (self.socket_bytes * calib.socket_ns_per_byte + self.memory_bytes * calib.memory_ns_per_byte),
        ]
        slowest = max(parts)
        latency = self.inter_messages * cluster.inter_latency_s + self.intra_messages * cluster.intra_latency_s
        return slowest + self.fill * (sum(parts) - slowest) + latency


def _sum_bytes(addends: int, elements: float, wire: int, out: int, fused: bool, average: bool = True) -> float:
    """Memory traffic of ``fp32_sum.sum_shards_into``. Torch's passes: widen the first addend into the fp32
    accumulator, then per further addend widen it (read ``wire``, write 4) and add (read 8, write 4);
    divide (read 4, write 4) when averaging; round into the output (read 4, write ``out``; none for an fp32
    output). The compiled kernel: read every addend once, write the output once."""
    if fused:
        return (addends * wire + out) * elements
    per = (wire + 4) + (addends - 1) * (wire + 4 + 12) + (8 if average else 0) + (4 + out if out != 4 else 0)
    return per * elements


def _segments(shard: int, segments: int, lengths: Sequence[int] | None) -> tuple[float, int]:
    """The pipeline's fill and drain as a fraction of the whole (the mean of its first and last segment,
    which nothing overlaps) and the number of segments, for ``hierarchical_fp32.segment_bounds``' cut (or
    the segment lengths a benchmark row names)."""
    if lengths is None:
        lengths = [b - a for a, b in segment_bounds(max(1, shard), max(1, -(-shard // segments)))]
    return (lengths[0] + lengths[-1]) / (2 * max(1, sum(lengths))), len(lengths)


def _ring_phases(cluster: Cluster, numel: int, op: str, s: float) -> list[Phase]:
    """Node-major ring: one edge of the ring leaves each node, the others stay inside it."""
    w, n = cluster.nodes * cluster.per_node, cluster.per_node
    shard = numel / w
    passes = 2 if op in ("ar", "gloo_rs") else 1
    moved = passes * (w - 1) * shard * s
    steps = passes * (w - 1)
    ring = Phase(
        inter_bytes=moved,
        intra_bytes=moved if n > 1 else 0.0,
        socket_bytes=moved,
        memory_bytes=3 * (w - 1) * shard * s,  # each received chunk: read it and the local one, write
        inter_messages=steps,
        fill=1 / steps,
    )
    if op == "gloo_rs":
        return [ring, Phase(memory_bytes=2 * numel * s + 2 * shard * s, fill=1.0)]
    return [ring]


def _flat_phases(cluster: Cluster, numel: int, op: str, calib: Calibration, s: float) -> list[Phase]:
    """The flat all-to-all, then the fp32 sum once the data is in; all-reduce: gloo's ring all-gather."""
    m, n = cluster.nodes, cluster.per_node
    w = m * n
    shard = numel / w
    out = [
        Phase(
            inter_bytes=n * (m - 1) * n * shard * s,
            intra_bytes=(n - 1) * shard * s,
            socket_bytes=(w - 1) * shard * s,
            memory_bytes=2 * shard * s,  # its own piece, copied
            inter_messages=(m - 1) * n,  # pairwise exchange: one message per peer (Thakur et al., 2005)
            intra_messages=n - 1,
        ),
        Phase(memory_bytes=_sum_bytes(w, shard, s, s, calib.fused_sum), fill=1.0),  # the sum starts when the data is in
    ]
    if op == "ar":
        moved = (w - 1) * shard * s
        out.append(
            Phase(
                inter_bytes=moved,
                intra_bytes=moved if n > 1 else 0.0,
                socket_bytes=moved,
                inter_messages=w - 1,
                fill=1 / (w - 1),
            )
        )
    return out


def _hier_phase(
    scheme: str, cluster: Cluster, numel: int, op: str, calib: Calibration, s: float, lengths: Sequence[int] | None
) -> Phase:
    """The hierarchical schemes' reduce-scatter: one pipelined phase (stage 1 inside the node, stage 2 across)."""
    m, n = cluster.nodes, cluster.per_node
    shard = numel / (m * n)
    node_part = (m - 1) / m * numel  # elements a node sends to other nodes in stage 2
    if scheme == "hier_uint8":
        inter_s = intra_s = _UINT8_CODE_BYTES
    else:
        inter_s, intra_s = (4 if scheme == "hier_fp32_inter" else s), s
    memory = 2 * numel * s  # stage 1's staging copy of the input
    memory += _sum_bytes(n, numel / n, intra_s, 4 if inter_s == 4 else s, calib.fused_sum)  # node partials
    memory += _sum_bytes(m, shard, inter_s, s, calib.fused_sum)  # across nodes
    if scheme == "hier_uint8":  # encode before and decode after each stage: about two more passes each
        memory *= 3
    fill, count = _segments(int(shard), calib.segments, lengths)
    messages = count * (2 if op == "ar" else 1)  # an all-to-all (and a gather) per segment and stage
    return Phase(
        inter_bytes=node_part * inter_s,
        intra_bytes=(n - 1) / n * numel * intra_s,
        socket_bytes=(n - 1) / n * numel * intra_s + node_part / n * inter_s,
        memory_bytes=memory,
        inter_messages=messages * (m - 1),
        intra_messages=messages * (n - 1),
        fill=fill,
    )


def _with_gathers(phase: Phase, scheme: str, cluster: Cluster, numel: int, s: float) -> Phase:
    """The hierarchical all-reduce: the reduce-scatter's phase plus the inter-node all-gather in the wire dtype,
    then the intra-node one, their staging and landing."""
    m, n = cluster.nodes, cluster.per_node
    shard = numel / (m * n)
    stage_s = _UINT8_CODE_BYTES if scheme == "hier_uint8" else s
    gather = (m - 1) / m * numel * stage_s
    return replace(
        phase,
        inter_bytes=phase.inter_bytes + gather,
        intra_bytes=phase.intra_bytes + (n - 1) / n * numel * stage_s,
        socket_bytes=phase.socket_bytes + gather / n + (n - 1) / n * numel * stage_s,
        # staging of each gather (m and n copies of the piece), and the landing of the intra-node one
        memory_bytes=phase.memory_bytes
        + (1 + m) * shard * stage_s
        + (n + 1) * numel / n * stage_s
        + 2 * numel * stage_s,
    )


def phases(
    scheme: str,
    cluster: Cluster,
    numel: int,
    op: str,
    calib: Calibration,
    wire_bytes: int = 2,
    hier_segments: Sequence[int] | None = None,
) -> list[Phase]:
    """The phases of one reduce-scatter (``"rs"``), all-reduce (``"ar"``) or, for ``ring``, gloo's
    reduce-scatter (``"gloo_rs"``: an all-reduce of a copy, then the shard copied out, as the veth counters
    of ``bench_netns_fp32.py`` show) of ``numel`` elements of ``wire_bytes`` each."""
    if scheme == "ring":
        return _ring_phases(cluster, numel, op, wire_bytes)
    ar = "ar" if op in ("ar", "gloo_rs") else "rs"
    if scheme == "flat_a2a":
        return _flat_phases(cluster, numel, ar, calib, wire_bytes)
    if scheme not in ("hier_fp32", "hier_fp32_inter", "hier_uint8"):
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")
    phase = _hier_phase(scheme, cluster, numel, ar, calib, wire_bytes, hier_segments)
    return [phase] if ar == "rs" else [_with_gathers(phase, scheme, cluster, numel, wire_bytes)]


def costs(
    cluster: Cluster,
    numel: int,
    op: str,
    calib: Calibration,
    wire_bytes: int = 2,
    hier_segments: Sequence[int] | None = None,
) -> dict[str, Cost]:
    """Every scheme's time and inter-node bytes per node for one reduce-scatter (``"rs"``) or all-reduce
    (``"ar"``) of ``numel`` elements of ``wire_bytes`` each."""
    check_choice("op", op, ("rs", "ar"))
    out = {}
    for scheme in SCHEMES:
        ph = phases(scheme, cluster, numel, op, calib, wire_bytes, hier_segments)
        out[scheme] = Cost(sum(p.seconds(cluster, calib) for p in ph), sum(p.inter_bytes for p in ph))
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
