"""``mixprec demo --quick``: every available run trains, and report.md's numbers come from the metrics."""

from __future__ import annotations

import json

import pytest

import mixprec.lab.demo as demo
from mixprec.cli.main import main


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_quick_demo_writes_a_generated_report(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out-dir", str(out)]) == 0
    report = (out / "report.md").read_text()
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
