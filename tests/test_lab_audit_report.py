"""``mixprec train --parallel.audit-every N`` writes the live audit's ``audit_*`` keys on the audited steps' rows, and
``mixprec report`` quotes them and plots them (effective bits, mixprec's and the backend's own; rel_l2, log axis).

The bound: fp32 parameters averaged by fp32_accumulate over 2 ranks are one fp32 addition rounded once (u = 2^-24
relative to the exact sum, Higham's gamma_1) and an exact halving: rel_l2 <= 2^-24, so >= 24 effective bits.
"""

from __future__ import annotations

import json
import os

import pytest

from mixprec.cli.main import main
from mixprec.lab.metrics import METRICS_NAME, read_rows

TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "8", "--data.micro-batch-size", "2", "--data.eval-sequences", "8",
    "--training.eval-interval", "0", "--optimizer.lr", "0.01", "--parallel.timeout", "60",
]  # fmt: skip


def _rows(run) -> list[dict]:
    return list(read_rows(os.path.join(run, METRICS_NAME)))


def test_train_audit_every_writes_rows_and_report_plots_them(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    args = ["train", *TINY, "--parallel.nproc", "2", "--training.steps", "5", "--parallel.reduce", "fp32_accumulate"]
    assert main([*args, "--training.out-dir", str(run), "--parallel.audit-every", "2"]) == 0
    rows = _rows(run)
    audited = [r for r in rows if "audit_rel_l2" in r]
    # Synced steps are counted from 1: steps 2 and 4 of the audit are rows 1 and 3.
    assert [r["step"] for r in audited] == [1, 3] and [r["audit_step"] for r in audited] == [2, 4]
    for r in audited:
        assert r["audit_wire_dtype"] == "float32" and r["audit_numel"] > 0
        assert 0 <= r["audit_rel_l2"] <= 2.0**-24 and r["audit_effective_bits"] >= 24
        assert "audit_native_rel_l2" in r and r["audit_nonfinite_results"] == 0
        assert r["audit_sample_count"] >= 1 and r["audit_bucket_numel"] >= r["audit_numel"]

    plain = tmp_path / "plain"
    assert main([*args, "--training.out-dir", str(plain)]) == 0
    assert not any(k.startswith("audit_") for r in _rows(plain) for k in r)
    loss = [(r["step"], r["loss"], r["grad_norm"]) for r in rows]
    assert loss == [(r["step"], r["loss"], r["grad_norm"]) for r in _rows(plain)]  # the audit changes no bit
    capsys.readouterr()

    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "live audit: 2 audit(s), steps 1..3: effective bits" in out and "the backend's own reduction" in out
    png = (run / "audit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert main(["report", str(plain)]) == 0
    assert "audit plot" not in capsys.readouterr().out and not (plain / "audit.png").exists()


def test_report_refuses_a_malformed_audit_field(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    row = {"step": 0, "loss": 1.0, "loss_scale": 1.0, "skipped": False, "audit_rel_l2": "tiny"}
    (run / METRICS_NAME).write_text(json.dumps(row) + "\n")
    assert main(["report", str(run), "--no-plot"]) == 2
    assert "'audit_rel_l2' must be a number" in capsys.readouterr().err


def test_audit_every_must_be_a_count(tmp_path, capsys) -> None:
    assert main(["train", *TINY, "--training.out-dir", str(tmp_path / "r"), "--parallel.audit-every", "-1"]) == 2
    assert "audit_every" in capsys.readouterr().err
