"""The comm-cost study: byte counts against the schemes' own arithmetic, the phase arithmetic, the fit
recovering the constants of synthetic benchmark rows, the committed netns measurements within 25% at
1 Gbit/s (fitted rows and a hold-out), and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixprec.cli.main import main
from mixprec.comm.hierarchical_fp32 import segment_bounds
from mixprec.lab.comm_cost import (
    Calibration,
    Cluster,
    Phase,
    compare_with_measurements,
    costs,
    fit_calibration,
    model_ms,
    phases,
)

N = 2**24
CALIBRATION = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration"


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


def replace_latency(cluster: Cluster, latency: float) -> Cluster:
    return Cluster(cluster.nodes, cluster.per_node, cluster.inter_gbit, cluster.intra_gbit, latency, latency)


def test_a_phase_overlaps_its_resources_but_for_the_fill() -> None:
    cluster = Cluster(2, 1, 8.0, 8.0, 0.0, 0.0)  # 1 GB/s each way
    calib = Calibration(wire_efficiency=1.0, socket_ns_per_byte=0.0, memory_ns_per_byte=0.5)
    wire, memory = 1e9, 1e9  # one second on the wire, half a second of memory passes
    assert Phase(inter_bytes=wire, memory_bytes=memory).seconds(cluster, calib) == pytest.approx(1.0)
    assert Phase(inter_bytes=wire, memory_bytes=memory, fill=1.0).seconds(cluster, calib) == pytest.approx(1.5)
    assert Phase(inter_bytes=wire, memory_bytes=memory, fill=0.25).seconds(cluster, calib) == pytest.approx(1.125)
    with_latency = Phase(inter_bytes=wire, inter_messages=3)
    assert with_latency.seconds(replace_latency(cluster, 1e-3), calib) == pytest.approx(1.003)


def test_the_hierarchical_fill_is_the_pipelines_first_and_last_segment() -> None:
    cluster = Cluster(2, 2, 1.0, 100.0, 0.0, 0.0)
    shard = N // 4
    (phase,) = phases("hier_fp32", cluster, N, "rs", Calibration(segments=4))
    lengths = [b - a for a, b in segment_bounds(shard, shard // 4)]
    assert phase.fill == pytest.approx((lengths[0] + lengths[-1]) / (2 * shard))
    assert phase.inter_messages == len(lengths)
    (even,) = phases("hier_fp32", cluster, N, "rs", Calibration(segments=4), hier_segments=[shard // 4] * 4)
    assert even.fill == pytest.approx(0.25) and even.fill > phase.fill


def test_the_compiled_sum_is_one_pass_in_the_model() -> None:
    data = {"nodes": 2, "per_node": 2}
    calib = Calibration(wire_efficiency=0.9, socket_ns_per_byte=1.0, memory_ns_per_byte=0.2)
    row = {"rate": 1.0, "op": "rs", "method": "flat", "numel": N}
    torch_passes, one_pass = model_ms(data, row, calib), model_ms(data, {**row, "native_sum": True}, calib)
    # the flat scheme's serial sum of 4 shards: 74 bytes per output element in torch's passes, 10 in one
    assert torch_passes - one_pass == pytest.approx(1e3 * 1e-9 * 0.2 * (74 - 10) * N / 4)


def _synthetic_benchmark(calib: Calibration) -> dict:
    data: dict = {"nodes": 2, "per_node": 2, "rows": []}
    for rate in (1.0, 2.5, 10.0):
        for op in ("rs", "ar"):
            for method in ("hier", "flat", "bf16", "fp32"):
                row = {"rate": rate, "op": op, "method": method, "numel": N}
                row["ms"] = model_ms(data, row, calib)
                data["rows"].append(row)
    return data


def test_calibration_recovers_the_constants_it_was_made_with() -> None:
    truth = Calibration(wire_efficiency=0.85, socket_ns_per_byte=0.7, memory_ns_per_byte=0.2)
    data = _synthetic_benchmark(truth)
    fitted = fit_calibration(data)
    assert fitted.wire_efficiency == pytest.approx(truth.wire_efficiency, rel=1e-3)
    assert fitted.socket_ns_per_byte == pytest.approx(truth.socket_ns_per_byte, rel=1e-2)
    assert fitted.memory_ns_per_byte == pytest.approx(truth.memory_ns_per_byte, rel=1e-2)
    table, ok = compare_with_measurements(data)
    assert ok and "hier (hier_fp32)" in table and "fp32 (ring, fp32)" in table


def test_the_netns_measurements_agree_within_25_percent_at_1_gbit() -> None:
    """The benchmark's JSON (2 nodes x 2 ranks, 1, 2.5 and 10 Gbit/s, 16M elements) fitted, and the 64M
    run at 1 Gbit/s predicted from that fit."""
    data = json.loads((CALIBRATION / "netns_fp32_16M.json").read_text())
    holdout = json.loads((CALIBRATION / "netns_fp32_64M_1gbit.json").read_text())
    table, ok = compare_with_measurements(data, holdout)
    assert ok, table
    assert "hold-out within 25% at 1 Gbit/s: yes" in table
    assert table.count("| 1 | ") == 16  # eight fitted rows and eight hold-out rows at 1 Gbit/s, each shown


def test_cli_prints_costs_pick_and_calibration(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_synthetic_benchmark(Calibration(0.9, 1.0, 0.3))))
    argv = ["study", "comm-cost", "--nodes", "2,1024", "--calibration", str(path), "--holdout", str(path)]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "model within 25% of every measurement at 1 Gbit/s: yes" in out
    assert "hold-out within 25% at 1 Gbit/s: yes" in out
    assert "1024 nodes: pick hier_fp32" in out
    assert "wire efficiency 0.90" in out
    assert (tmp_path / "comm_cost.png").stat().st_size > 5_000
    assert main([*argv, "--no-plot", "--compute", "calibrated"]) == 0
    assert "socket CPU 1 ns/byte" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nodes", "1,4"], "--nodes"),
        (["--inter-gbit", "0"], "--inter-gbit"),
        (["--memory-gbs", "0"], "--memory-gbs"),
        (["--inter-latency-us", "-1"], "--inter-latency-us"),
        (["--calibration", "/nonexistent/x.json"], "--calibration"),
        (["--holdout", "/nonexistent/x.json"], "--holdout"),
        (["--compute", "calibrated"], "--compute"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], flag: str, capsys) -> None:
    assert main(["study", "comm-cost", "--no-plot", *argv]) == 2
    assert flag in capsys.readouterr().err
