"""The comm-cost study: byte counts against the schemes' own arithmetic, the calibration round trip on
synthetic benchmark rows, and the CLI."""

from __future__ import annotations

import json

import pytest

from mixprec.cli.main import main
from mixprec.lab.comm_cost import Calibration, Cluster, compare_with_measurements, costs, fit_calibration

N = 2**24


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (2, 8), (64, 8), (1024, 8), (16, 1)])
def test_inter_node_bytes(nodes: int, per_node: int) -> None:
    c = costs(Cluster(nodes, per_node, 100.0, 1000.0, 1e-5, 1e-6), N, "rs", Calibration())
    world = nodes * per_node
    assert c["ring"].inter_bytes_per_node == pytest.approx((world - 1) / world * N * 2)
    assert c["hier_fp32"].inter_bytes_per_node == pytest.approx((nodes - 1) / nodes * N * 2)
    assert c["hier_fp32"].inter_bytes_per_node <= c["ring"].inter_bytes_per_node
    assert c["flat_a2a"].inter_bytes_per_node == pytest.approx(per_node * c["hier_fp32"].inter_bytes_per_node)
    assert c["hier_fp32_inter"].inter_bytes_per_node == pytest.approx(2 * c["hier_fp32"].inter_bytes_per_node)
    ar = costs(Cluster(nodes, per_node, 100.0, 1000.0, 1e-5, 1e-6), N, "ar", Calibration())
    assert ar["hier_fp32"].inter_bytes_per_node == pytest.approx(2 * c["hier_fp32"].inter_bytes_per_node)


def _synthetic_benchmark(calib: Calibration, intra: float, latency: float) -> dict:
    rows = []
    for rate in (1.0, 2.5, 10.0):
        for op in ("rs", "ar"):
            cluster = Cluster(2, 2, rate, intra, latency, latency)
            model = costs(cluster, N, op, calib)
            for method, scheme in (("hier", "hier_fp32"), ("flat", "flat_a2a"), ("bf16", "ring")):
                rows.append(
                    {"rate": rate, "op": op, "method": method, "numel": N, "ms": 1e3 * model[scheme].seconds,
                     "veth_tx_per_node": model[scheme].inter_bytes_per_node,
                     "accounted_inter_node_per_node": model[scheme].inter_bytes_per_node}
                )  # fmt: skip
    return {"nodes": 2, "per_node": 2, "rows": rows}


def test_calibration_recovers_the_model_it_was_made_with() -> None:
    data = _synthetic_benchmark(Calibration(0.8, 2.0), 10.0, 1e-4)
    calib, intra, latency = fit_calibration(data)
    assert (calib.wire_efficiency, calib.sum_ns, intra, latency) == (0.8, 2.0, 10.0, 1e-4)
    table, ok = compare_with_measurements(data)
    assert ok and "hier_fp32" in table


def test_cli_prints_costs_pick_and_calibration(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_synthetic_benchmark(Calibration(0.9, 1.0), 20.0, 0.0)))
    argv = ["study", "comm-cost", "--nodes", "2,1024", "--calibration", str(path), "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model within 25% of every measurement at 1 Gbit/s: yes" in out
    assert "1024 nodes: pick hier_fp32" in out
    assert (tmp_path / "comm_cost.png").stat().st_size > 5_000


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nodes", "1,4"], "--nodes"),
        (["--inter-gbit", "0"], "--inter-gbit"),
        (["--inter-latency-us", "-1"], "--inter-latency-us"),
        (["--calibration", "/nonexistent/x.json"], "--calibration"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], flag: str, capsys) -> None:
    assert main(["study", "comm-cost", "--no-plot", *argv]) == 2
    assert flag in capsys.readouterr().err
