"""``mixprec study comm-cost``: time and bytes of gradient reductions on clusters this machine cannot hold.

A bucket of N elements on m nodes of n ranks, for a bf16 ring (NCCL's, gloo's), the flat fp32-accumulating
all-to-all (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``), the hierarchical fp32-accumulating
scheme (``topology=``; node partials in bf16 or fp32 across nodes) and the hierarchical uint8 scheme of
``mixprec.compress``. Each scheme is a few phases; a phase uses three resources, each node's NIC (bytes /
(rate x wire efficiency)), each rank's intra-node link, and compute (CPU per byte sent through a socket,
plus memory passes: copies, widenings, fp32 adds, roundings, counted in bytes from the code). Within a phase
the resources overlap: its time is the slowest one plus the others' share of the pipeline's fill and drain,
plus per-message latency. ``--calibration FILE`` (``benchmarks/bench_netns_fp32.py --json``) fits wire
efficiency and the two CPU costs by least squares and prints model vs measured for every row. Then a table
per node count, which reduction to pick and why, and a plot. Formulas: ``docs/comm.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mixprec.comm.hierarchical_fp32 import segment_bounds
from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.lab.paths import check_input_file

__all__ = [
    "SCHEMES",
    "Calibration",
    "Cluster",
    "Cost",
    "Phase",
    "add_arguments",
    "check_benchmark",
    "compare_with_measurements",
    "costs",
    "fit_calibration",
    "model_ms",
    "prepare",
    "recommend",
]

SCHEMES = ("ring", "flat_a2a", "hier_fp32", "hier_fp32_inter", "hier_uint8")
# RMS relative error in units of the wire's u (reduction-error study, 8 ranks per node): one rounding 0.42;
# two 0.60; a ring's grows like 0.30 sqrt(W). uint8: 1/255 of each 2048-element chunk's range, not a u.
_ROUNDING_RMS = 0.42
# The benchmark's method names -> the model's scheme and wire bytes ("fp32": gloo's ring on an fp32 tensor).
_BENCH = {"hier": ("hier_fp32", 2), "flat": ("flat_a2a", 2), "bf16": ("ring", 2), "fp32": ("ring", 4)}
# The loopback between the ranks of a netns "node" has no rate limit: only its CPU cost (per socket byte).
_LOOPBACK_GBIT = 1e6
# A benchmark row's size, in elements: at most 2**40 (4 TiB of fp32 per rank, more than a machine that runs the
# benchmark holds).
_MAX_BENCH_NUMEL = 2**40
# A measured time below this fraction of the rate-limited link's time for the bytes that must leave a node is
# impossible (the fraction leaves room for the shaper's burst allowance).
_LINK_FLOOR = 0.5


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
    m, n = cluster.nodes, cluster.per_node
    w, s = m * n, wire_bytes
    shard = numel / w
    ar = op in ("ar", "gloo_rs")
    if scheme == "ring":  # node-major: one edge of the ring leaves each node, the others stay inside it
        passes = 2 if ar else 1
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
    if scheme == "flat_a2a":
        out = [
            Phase(
                inter_bytes=n * (m - 1) * n * shard * s,
                intra_bytes=(n - 1) * shard * s,
                socket_bytes=(w - 1) * shard * s,
                memory_bytes=2 * shard * s,  # its own piece, copied
                inter_messages=(m - 1) * n,  # pairwise exchange: one message per peer (Thakur et al., 2005)
                intra_messages=n - 1,
            ),
            Phase(
                memory_bytes=_sum_bytes(w, shard, s, s, calib.fused_sum), fill=1.0
            ),  # the sum starts when the data is in
        ]
        if ar:  # gloo's all-gather: a ring
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
    if scheme not in ("hier_fp32", "hier_fp32_inter", "hier_uint8"):
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")
    node_part = (m - 1) / m * numel  # elements a node sends to other nodes in stage 2
    if scheme == "hier_uint8":
        code = 1 + 8 / 2048  # uint8 codes plus an fp32 (min, max) header per 2048-element chunk
        inter_s, intra_s, stage_s = code, code, code
    else:
        inter_s, intra_s, stage_s = (4 if scheme == "hier_fp32_inter" else s), s, s
    memory = 2 * numel * s  # stage 1's staging copy of the input
    memory += _sum_bytes(n, numel / n, intra_s, 4 if inter_s == 4 else s, calib.fused_sum)  # node partials
    memory += _sum_bytes(m, shard, inter_s, s, calib.fused_sum)  # across nodes
    if scheme == "hier_uint8":  # encode before and decode after each stage: about two more passes each
        memory *= 3
    fill, count = _segments(int(shard), calib.segments, hier_segments)
    messages = count * (2 if ar else 1)  # an all-to-all (and a gather) per segment and stage
    phase = Phase(
        inter_bytes=node_part * inter_s,
        intra_bytes=(n - 1) / n * numel * intra_s,
        socket_bytes=(n - 1) / n * numel * intra_s + node_part / n * inter_s,
        memory_bytes=memory,
        inter_messages=messages * (m - 1),
        intra_messages=messages * (n - 1),
        fill=fill,
    )
    if not ar:
        return [phase]
    gather = node_part * stage_s  # inter-node all-gather in the wire dtype, then the intra-node one
    return [
        replace(
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
    ]


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


# ---------------------------------------------------------------------------------------------- calibration
def check_benchmark(data: object, where: str = "benchmark data") -> None:
    """Refuse what ``bench_netns_fp32.py --json`` cannot have written (ValueError or TypeError naming ``where``
    and the field), before a fit would take it for a measurement: ``nodes`` an int >= 2, ``per_node`` an int >=
    1; each row of a fitted method (hier, flat, bf16, fp32; rows of other methods are skipped) with ``op`` 'rs' or
    'ar', a finite ``rate`` > 0 (Gbit/s), an integer ``numel`` that ``nodes x per_node`` ranks divide, up to
    2**40, a finite ``ms`` no less than half the link's time for the bytes that must leave a node, and, where
    present, ``hier_segments`` (positive lengths summing to a rank's shard), ``native_sum`` (a bool), the
    byte counters (finite, >= 0) and the row's own ``nodes`` and ``per_node`` (the file's)."""
    if not isinstance(data, dict) or not {"rows", "nodes", "per_node"} <= set(data):
        raise ValueError(f"{where}: not a bench_netns_fp32.py --json file (needs rows, nodes, per_node)")
    nodes = check_positive_int(f"{where}: nodes", data["nodes"], minimum=2)
    per_node = check_positive_int(f"{where}: per_node", data["per_node"])
    world = nodes * per_node
    if not isinstance(data["rows"], list):
        raise TypeError(f"{where}: rows must be a list of row objects; got {type(data['rows']).__name__}")
    for i, row in enumerate(data["rows"]):
        at = f"{where}: rows[{i}]"
        if not isinstance(row, dict):
            raise TypeError(f"{at} must be an object; got {type(row).__name__}")
        method = row.get("method")
        if not isinstance(method, str):
            raise TypeError(f"{at}.method must be a string; got {method!r}")
        if method not in _BENCH:
            continue
        for key, value in (("nodes", nodes), ("per_node", per_node)):
            if key in row and row[key] != value:
                raise ValueError(f"{at}.{key} is {row[key]!r} but the file's {key} is {value}")
        check_choice(f"{at}.op", row.get("op"), ("rs", "ar"))
        rate = check_positive_float(f"{at}.rate", row.get("rate"))
        numel = check_positive_int(f"{at}.numel", row.get("numel"), minimum=world)
        if numel > _MAX_BENCH_NUMEL or numel % world:
            raise ValueError(f"{at}.numel must be a multiple of the {world} ranks up to 2**40; got {numel}")
        ms = check_positive_float(f"{at}.ms", row.get("ms"))
        floor = 1e3 * (nodes - 1) / nodes * numel * _BENCH[method][1] * 8 / (rate * 1e9)
        if ms < _LINK_FLOOR * floor:
            raise ValueError(
                f"{at}.ms is {ms:g}, but a {rate:g} Gbit/s link takes {floor:g} ms for the bytes that must leave "
                "a node: not a measurement"
            )
        for key in ("veth_tx_per_node", "accounted_inter_node_per_node"):
            if row.get(key) is not None:
                check_positive_float(f"{at}.{key}", row[key], allow_zero=True)
        if "native_sum" in row and not isinstance(row["native_sum"], bool):
            raise TypeError(f"{at}.native_sum must be true or false; got {row['native_sum']!r}")
        lengths = row.get("hier_segments")
        if lengths is not None:
            ok = isinstance(lengths, list) and lengths
            ok = ok and all(not isinstance(v, bool) and isinstance(v, int) and v > 0 for v in lengths)
            if not ok or sum(lengths) != numel // world:
                raise ValueError(
                    f"{at}.hier_segments must be positive integers summing to a rank's shard "
                    f"({numel // world} elements); got {lengths!r}"
                )


def _rows(data: dict) -> list[dict]:
    check_benchmark(data)
    return [r for r in data["rows"] if r["method"] in _BENCH]


def model_ms(data: dict, row: dict, calib: Calibration) -> float:
    """The model's time for one row of a ``bench_netns_fp32.py --json`` file: the netns "nodes" have a
    rate-limited link each and an unlimited loopback inside (its cost is the CPU's, per socket byte); no
    latency is modelled (tens of microseconds against calls of 100 ms and more)."""
    cluster = Cluster(int(data["nodes"]), int(data["per_node"]), float(row["rate"]), _LOOPBACK_GBIT, 0.0, 0.0)
    scheme, wire = _BENCH[row["method"]]
    op = row["op"]
    veth, accounted = row.get("veth_tx_per_node"), row.get("accounted_inter_node_per_node")
    if scheme == "ring" and op == "rs" and (veth is None or accounted is None or veth > 1.5 * accounted):
        op = "gloo_rs"  # gloo's reduce-scatter moves an all-reduce's bytes (the veth counter says so)
    # Rows without the segment lengths were measured before the ramp: calib.segments equal segments.
    lengths = row.get("hier_segments")
    if lengths is None:
        shard = int(row["numel"]) // (cluster.nodes * cluster.per_node)
        lengths = [shard // calib.segments] * calib.segments
    # Rows without "native_sum" were measured before the compiled sum existed: torch's passes.
    calib = replace(calib, fused_sum=bool(row.get("native_sum", False)))
    ph = phases(scheme, cluster, int(row["numel"]), op, calib, wire, lengths)
    return 1e3 * sum(p.seconds(cluster, calib) for p in ph)


def _nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float, iters: int) -> list[float]:
    """Minimise ``f`` from ``x0`` (Nelder and Mead, Computer Journal 7, 1965): a few parameters, no numpy."""
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        worst = simplex[-1]

        def toward(t: float, worst: list[float] = worst, centre: list[float] = centre) -> list[float]:
            return [c + t * (c - w) for c, w in zip(centre, worst, strict=True)]

        reflected = toward(1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(-0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [
                    [(a + b) / 2 for a, b in zip(simplex[0], x, strict=True)] for x in simplex[1:]
                ]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit_calibration(data: dict) -> Calibration:
    """Least squares on log time over every row of a benchmark JSON (all rates, all four methods) for
    three parameters: the wire efficiency (in (0, 1]) and the CPU's socket and memory costs per byte."""
    rows = _rows(data)
    if not rows:
        raise ValueError("--calibration: the file holds no timed rows of the methods hier, flat, bf16, fp32")

    def unpack(x: list[float]) -> Calibration:
        eff = 1 / (1 + math.exp(-x[0]))  # a logistic keeps it in (0, 1)
        return Calibration(eff, math.exp(x[1]), math.exp(x[2]))

    def loss(x: list[float]) -> float:
        calib = unpack(x)
        return sum(math.log(model_ms(data, r, calib) / r["ms"]) ** 2 for r in rows)

    starts = ([2.0, 0.0, -1.0], [1.0, -1.0, 0.0], [3.0, -3.0, -3.0])
    best = min((_nelder_mead(loss, list(x0), 0.5, 300) for x0 in starts), key=loss)
    return unpack(_nelder_mead(loss, best, 0.05, 200))


def _table(data: dict, calib: Calibration, rate: float) -> tuple[list[str], bool]:
    lines = [
        "| Gbit/s | op | elements | method (scheme) | measured ms | model ms | error | within 25% |",
        "|---:|---|---:|---|---:|---:|---:|---|",
    ]
    ok, seen = True, False
    for r in sorted(_rows(data), key=lambda r: (r["rate"], r["op"], r["numel"], r["method"])):
        model = model_ms(data, r, calib)
        err = model / r["ms"] - 1
        verdict = "-"
        if r["rate"] == rate:
            seen = True
            ok &= abs(err) <= 0.25
            verdict = "yes" if abs(err) <= 0.25 else "NO"
        scheme, wire = _BENCH[r["method"]]
        name = f"{r['method']} ({scheme}{', fp32' if wire == 4 else ''})"
        lines.append(
            f"| {r['rate']:g} | {r['op']} | {r['numel'] / 2**20:g}M | {name} | {r['ms']:.1f} | {model:.1f} | "
            f"{100 * err:+.0f}% | {verdict} |"
        )
    return lines, ok and seen


def compare_with_measurements(
    data: dict, holdout: dict | None = None, rate: float = 1.0, calib: Calibration | None = None
) -> tuple[str, bool]:
    """Fit on ``data`` (unless ``calib`` is that fit) and print model vs measured for every row; the verdict:
    every row at ``rate`` Gbit/s within 25%. ``holdout`` (same format, not fitted on) is predicted with the
    same constants."""
    calib = calib or fit_calibration(data)
    lines, ok = _table(data, calib, rate)
    if not any(r["rate"] == rate for r in _rows(data)):
        raise ValueError(f"--calibration: the file holds no rows at {rate:g} Gbit/s")
    count = len(_rows(data))
    text = [
        f"Calibration, fitted on all {count} rows below (least squares on log time): wire efficiency "
        f"{calib.wire_efficiency:.3f}, socket {calib.socket_ns_per_byte:.3f} ns per byte sent, memory passes "
        f"{calib.memory_ns_per_byte:.3f} ns per byte ({1 / calib.memory_ns_per_byte:.2f} GB/s; 4 ranks share "
        "the benchmark's cores, so these are wall-clock costs per rank).",
        "",
        *lines,
        "",
        f"model within 25% of every measurement at {rate:g} Gbit/s: {'yes' if ok else 'NO'}",
    ]
    if holdout is not None:
        held, held_ok = _table(holdout, calib, rate)
        text += [
            "",
            "Hold-out (not fitted on), predicted with the constants above:",
            "",
            *held,
            "",
            f"hold-out within 25% at {rate:g} Gbit/s: {'yes' if held_ok else 'NO'}",
        ]
    return "\n".join(text), ok


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
    parser.add_argument(
        "--memory-gbs", type=float, default=1000.0, help="device bandwidth of elementwise passes (sums, copies), GB/s"
    )
    parser.add_argument(
        "--compute",
        choices=("gpu", "calibrated"),
        default="gpu",
        help="gpu: --memory-gbs and no CPU per socket byte (NVLink/RDMA); calibrated: the fitted CPU costs",
    )
    parser.add_argument("--calibration", type=Path, default=None, help="bench_netns_fp32.py --json output")
    parser.add_argument("--holdout", type=Path, default=None, help="a second such file, predicted, not fitted")
    parser.add_argument("--out-dir", type=Path, default=Path("mixprec_out/comm-cost"), help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _read_bench(flag: str, path: Path) -> dict:
    check_input_file(flag, path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{flag}: {str(path)!r} holds JSON nested too deeply to be a benchmark file") from None
    check_benchmark(data, f"{flag} {str(path)!r}")
    return data


def prepare(args: argparse.Namespace) -> Callable[[], int]:
    """Check every argument (ValueError naming the flag) before any work; returns the study's run."""
    if not args.nodes or any(m < 2 for m in args.nodes):
        raise ValueError(f"--nodes: every node count must be >= 2; got {args.nodes}")
    for flag, value in (("--per-node", args.per_node),):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1; got {value}")
    for flag, value in (("--inter-gbit", args.inter_gbit), ("--intra-gbit", args.intra_gbit),
                        ("--bucket-m", args.bucket_m), ("--memory-gbs", args.memory_gbs)):  # fmt: skip
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag} must be a finite number > 0; got {value}")
    for flag, value in (("--inter-latency-us", args.inter_latency_us), ("--intra-latency-us", args.intra_latency_us)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0; got {value}")
    data = None if args.calibration is None else _read_bench("--calibration", args.calibration)
    holdout = None if args.holdout is None else _read_bench("--holdout", args.holdout)
    if holdout is not None and data is None:
        raise ValueError("--holdout needs --calibration (the file the constants are fitted on)")
    if args.compute == "calibrated" and data is None:
        raise ValueError("--compute calibrated needs --calibration")
    numel = int(args.bucket_m * 2**20)
    clusters = [
        Cluster(m, args.per_node, args.inter_gbit, args.intra_gbit, args.inter_latency_us * 1e-6,
                args.intra_latency_us * 1e-6)
        for m in args.nodes
    ]  # fmt: skip

    def work() -> int:
        calib = Calibration(memory_ns_per_byte=1 / args.memory_gbs)
        if data is not None:
            fitted = fit_calibration(data)
            print(compare_with_measurements(data, holdout, calib=fitted)[0] + "\n")
            # The wire efficiency carries over to any TCP link; the CPU costs are the benchmark machine's.
            calib = fitted if args.compute == "calibrated" else replace(calib, wire_efficiency=fitted.wire_efficiency)
        print(
            f"comm-cost: {args.op}, bucket {numel} bf16 elements, {args.per_node} ranks per node, inter-node "
            f"{args.inter_gbit:g} Gbit/s + {args.inter_latency_us:g} us, intra-node {args.intra_gbit:g} Gbit/s + "
            f"{args.intra_latency_us:g} us, wire efficiency {calib.wire_efficiency:.2f}, memory passes "
            f"{1 / calib.memory_ns_per_byte:g} GB/s, socket CPU {calib.socket_ns_per_byte:g} ns/byte\n"
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
            "times the ring's bytes across each node's NIC and sums only once they are in; hier_fp32 sends "
            "(m-1)/m N, at most the ring's, and sums segment by segment while the next is on the wire, so it is "
            "the fastest accurate choice once the NIC is the bottleneck; hier_fp32_inter doubles those bytes "
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
