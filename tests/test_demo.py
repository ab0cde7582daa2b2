"""``mixprec demo --quick``: every available run trains, and report.md's numbers come from the metrics."""

from __future__ import annotations

import json
import re
import time

import pytest

import mixprec.lab.demo as demo
import mixprec.lab.demo.runs as demo_runs
from mixprec.cli.main import main


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


_WALL = re.compile(
    r"^Wall time: (?P<total>\d+) s in total, from the start of the demo to this report: (?P<runs>\d+) s the 5 runs "
    r"and their comparison; (?P<studies>\d+) s the studies at size quick \(simulated-DP bands \d+ s, loss scale "
    r"\d+ s, uint8 offset \d+ s\)\.$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_quick_demo_writes_a_generated_report(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    t0 = time.perf_counter()
    assert main(["demo", "--quick", "--out-dir", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    report = (out / "report.md").read_text()
    # The header's wall time is the whole demo's (runs and studies), measured around all of it: at least its
    # parts, at most what this test measured around the call (each rounded to a second).
    wall = _WALL.search(report)
    assert wall, report[:1000]
    total, runs, studies = (int(wall[k]) for k in ("total", "runs", "studies"))
    assert runs + studies - 1 <= total <= elapsed + 0.5
    # It opens with the three verdicts, in this order, before any table.
    verdicts = [report.index(f"{k}. **{title}**: ") for k, title in enumerate(demo.HEADLINE_TITLES.values(), 1)]
    assert report.index("Wall time:") < report.index("## Verdicts") < verdicts[0] < verdicts[1] < verdicts[2]
    assert verdicts[2] < report.index("| run |") < report.index("## Reduction precision at simulated")
    assert "at simulated DP 16, bf16 gradients summed by the backend's native ring (15 roundings" in report
    assert "misscaled configurations" in report and "`mixprec check-config`" in report
    assert "uint8 - fp32 final validation loss" in report
    printed = capsys.readouterr().out
    for title in demo.HEADLINE_TITLES.values():
        assert f"- {title}: " in printed
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "![loss curves and differences](compare.png)" in report
    available = [run.name for run in demo.DEMO_RUNS]
    assert "fp32" in available
    for name in available:
        rows = _rows(out / "runs" / name / "metrics.jsonl")
        assert len(rows) == demo.QUICK_OVERRIDES["steps"]
        # The table row carries this run's own final loss, formatted from its metrics.
        assert f"| {name}{' (reference)' if name == 'fp32' else ''} | {len(rows)} | {rows[-1]['loss']:.4f} |" in report
        if name != "fp32":
            assert f"- **{name}** (" in report
    if "fp16-dynamic" in available:
        rows = _rows(out / "runs" / "fp16-dynamic" / "metrics.jsonl")
        skipped = sum(r["skipped"] for r in rows)
        assert skipped > 0  # growth every 4 steps from 2**16: it overflows
        assert f"it skipped {skipped} of {len(rows)} steps" in report
    if "bf16-native" in available and "bf16-fp32acc" in available:
        assert "The two bf16 runs" in report
    assert "Closest to the reference in final validation loss" in report
    # the study sections, each with its verdicts, and the measured wall time
    for title in (
        "## Reduction precision at simulated data-parallel sizes",
        "## Loss scale against microbatches and data parallelism",
        "## The uint8 offset: compression or chaos?",
    ):
        assert title in report
    assert report.count("Verdicts:") == 3


def test_report_without_studies_says_where_the_verdicts_would_come_from(tmp_path) -> None:
    out = tmp_path / "demo"
    assert demo.run_demo(out_dir=str(out), overrides=demo.QUICK_OVERRIDES, runs=demo.DEMO_RUNS[:1]) == 0
    report = (out / "report.md").read_text()
    assert re.search(
        r"^Wall time: \d+ s in total, from the start of the demo to this report: \d+ s the 1 run and", report, re.M
    )
    assert report.index("## Verdicts") < report.index("skipped (`--no-studies`)") < report.index("| run |")
    assert "## Reduction precision" not in report


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threshold", "-1"], "threshold must be a number >= 0"),
        (["--threshold", "nan"], "threshold must be a number >= 0"),
        (["--steps", "0"], "steps"),
        (["--nproc", "0"], "nproc"),
        (["--full"], "--quick and --full exclude each other"),
        (["--seed", str(2**64 - 1)], "seed must be at most"),  # the uint8 study trains seed + 1
        (["--seed", str(2**64)], "seed must be at most"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(tmp_path, monkeypatch, capsys, argv, message) -> None:
    monkeypatch.setattr(demo_runs, "launch", lambda *a, **k: pytest.fail("a run started"))
    assert main(["demo", "--quick", "--out-dir", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "d").exists()


def test_dp_band_flag_says_it_is_no_longer_needed(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo_runs, "launch", lambda *a, **k: pytest.fail("a run started"))
    # --steps 0 stops it at the checks: the notice comes first, then the refusal
    assert main(["demo", "--quick", "--dp-band", "--steps", "0", "--out-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--dp-band does nothing" in err[0] and "default demo" in err[0]


def test_out_dir_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo_runs, "launch", lambda *a, **k: pytest.fail("a run started"))
    (tmp_path / "f").write_text("")
    assert main(["demo", "--quick", "--out-dir", str(tmp_path / "f")]) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_run_demo_checks_the_threshold_before_training(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(demo_runs, "launch", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        demo.run_demo(out_dir=str(tmp_path), overrides=demo.QUICK_OVERRIDES, threshold=-1.0)


def test_a_bug_in_a_run_is_not_reported_as_a_failed_run(tmp_path, monkeypatch) -> None:
    """A run that fails (a rank, divergence) is reported and the demo goes on; any other exception is a bug
    and propagates with its traceback."""
    from mixprec.lab.train import TrainingDiverged

    def diverges(cfg, **kwargs):
        raise TrainingDiverged("20 skipped steps in a row")

    monkeypatch.setattr(demo_runs, "launch", diverges)
    assert demo.run_demo(out_dir=str(tmp_path / "a"), overrides=demo.QUICK_OVERRIDES, runs=demo.DEMO_RUNS[:1]) == 1

    def buggy(cfg, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(demo_runs, "launch", buggy)
    with pytest.raises(RuntimeError, match="an internal bug"):
        demo.run_demo(out_dir=str(tmp_path / "b"), overrides=demo.QUICK_OVERRIDES, runs=demo.DEMO_RUNS[:1])
