"""The comm-cost study: byte counts against the schemes' own arithmetic, the phase arithmetic, the fit
recovering the constants of synthetic benchmark rows, the committed netns measurements within 25% at
1 Gbit/s (fitted rows and a hold-out), and the CLI."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from mixprec.cli.main import main
from mixprec.comm.hierarchical_fp32 import segment_bounds
from mixprec.lab.studies.comm_cost_fit import check_benchmark, compare_with_measurements, fit_calibration, model_ms
from mixprec.lab.studies.comm_cost_model import Calibration, Cluster, Phase, costs, phases

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


def _edited_benchmark(tmp_path: Path, edit) -> Path:
    data = json.loads((CALIBRATION / "netns_fp32_16M.json").read_text())
    edit(data)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # silently fitted before: a 6e23 GB/s memory from one impossible time, sizes no benchmark ran
        (lambda d: d["rows"][0].update(numel=-16), "rows[0].numel must be an int >= 4; got -16"),
        (lambda d: d["rows"][0].update(numel=1e30), "rows[0].numel must be an int >= 4; got float 1e+30"),
        (lambda d: d["rows"][0].update(numel=10**30), "rows[0].numel must be a multiple of the 4 ranks up to 2**40"),
        (lambda d: d["rows"][1].update(numel=2**24 + 2), "rows[1].numel must be a multiple of the 4 ranks"),
        (lambda d: d["rows"][0].update(ms=1e-300), "rows[0].ms is 1e-300, but a 1 Gbit/s link takes 134.218 ms"),
        (lambda d: d["rows"][0].update(ms=math.inf), "rows[0].ms must be a finite number > 0"),
        (lambda d: d["rows"][0].update(hier_segments=[0, 0, 0]), "rows[0].hier_segments must be positive integers"),
        (
            lambda d: d["rows"][0].update(hier_segments=[2**20] * 3),
            "rows[0].hier_segments must be positive integers summing to a rank's shard (4194304 elements)",
        ),
        (lambda d: d["rows"][0].update(native_sum="yes"), "rows[0].native_sum must be true or false"),
        (lambda d: d["rows"][0].update(op="gather"), "rows[0].op must be one of 'rs', 'ar'"),
        (lambda d: d["rows"][0].update(nodes=3), "rows[0].nodes is 3 but the file's nodes is 2"),
        # tracebacks before
        (lambda d: d.update(nodes=0), "nodes must be an int >= 2; got 0"),
        (lambda d: d.update(per_node="two"), "per_node must be an int >= 1; got str 'two'"),
        (lambda d: d["rows"][0].update(rate="fast"), "rows[0].rate must be a real number; got str 'fast'"),
        (lambda d: d.update(rows="x"), "rows must be a list of row objects; got str"),
        (lambda d: d["rows"].append(7), "rows[24] must be an object; got int"),
        (lambda d: d["rows"][0].update(method=["hier"]), "rows[0].method must be a string"),
    ],
)
def test_calibration_files_no_benchmark_writes_are_refused(tmp_path, capsys, edit, message) -> None:
    path = _edited_benchmark(tmp_path, edit)
    for flag in ("--calibration", "--holdout"):
        argv = ["study", "comm-cost", "--no-plot", "--out-dir", str(tmp_path), "--calibration"]
        argv += [str(path)] if flag == "--calibration" else [str(CALIBRATION / "netns_fp32_16M.json"), flag, str(path)]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert f"{flag} {str(path)!r}: {message}" in err, err
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        fit_calibration(json.loads(path.read_text()))


def test_rows_of_other_methods_are_skipped(tmp_path) -> None:
    path = _edited_benchmark(tmp_path, lambda d: d["rows"].append({"method": "gloo-tree", "ms": -1}))
    assert check_benchmark(json.loads(path.read_text())) is None


def test_calibration_must_be_a_regular_file(tmp_path, capsys) -> None:
    """A FIFO would block the read forever (nothing writes to it): refused before it is opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for flag in ("--calibration", "--holdout"):
        argv = ["study", "comm-cost", "--no-plot", "--out-dir", str(tmp_path), "--calibration"]
        argv += [str(fifo)] if flag == "--calibration" else [str(CALIBRATION / "netns_fp32_16M.json"), flag, str(fifo)]
        assert main(argv) == 2
        assert f"{flag}: {str(fifo)!r} is not a regular file" in capsys.readouterr().err
    assert main(["study", "comm-cost", "--no-plot", "--calibration", str(tmp_path)]) == 2
    assert "is not a regular file" in capsys.readouterr().err


def test_deeply_nested_calibration_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["study", "comm-cost", "--no-plot", "--out-dir", str(tmp_path), "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nested too deeply" in err and "Traceback" not in err
