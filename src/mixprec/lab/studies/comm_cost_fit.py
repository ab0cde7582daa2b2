"""``mixprec study comm-cost --calibration``: the cost model's constants fitted to measured reductions.

A ``benchmarks/bench_netns_fp32.py --json`` file (netns "nodes" with a rate-limited link each) is checked row by
row (:func:`check_benchmark`), then the wire efficiency and the CPU's costs per socket byte and per byte of memory
passes are fitted by least squares on log time (:func:`fit_calibration`, a Nelder-Mead in pure Python), and the
model is printed beside every measured row (:func:`compare_with_measurements`). Method: ``docs/comm.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mixprec.core.validate import check_choice, check_positive_float, check_positive_int
from mixprec.lab.paths import check_input_file
from mixprec.lab.studies.comm_cost_model import Calibration, Cluster, phases

__all__ = ["check_benchmark", "compare_with_measurements", "fit_calibration", "model_ms", "read_benchmark"]

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


def read_benchmark(flag: str, path: Path) -> dict:
    """The benchmark file ``path`` given as ``flag``, checked (ValueError or TypeError in one line naming both)."""
    check_input_file(flag, path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{flag}: {str(path)!r} holds JSON nested too deeply to be a benchmark file") from None
    check_benchmark(data, f"{flag} {str(path)!r}")
    return data
