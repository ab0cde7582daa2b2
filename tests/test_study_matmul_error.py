"""``mixprec study matmul-error``: runs end to end (table, CSV, PNG), row subsets, claim checks, CLI errors."""

from __future__ import annotations

import csv

import pytest

from mixprec.cli.main import main
from mixprec.lab.matmul_error import (
    DEFAULT_PRESETS,
    PERCENTILES,
    MatmulErrorResult,
    check_claims,
    matmul_error_study,
)


def test_quick_study_writes_table_csv_and_png(tmp_path, capsys):
    assert main(["study", "matmul-error", "--quick", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 256 | 256 | two_stage |" in out and "Claims:" in out and "seed 003" in out
    rows = list(csv.DictReader((tmp_path / "matmul_error.csv").open()))
    assert len(rows) == 2 * len(DEFAULT_PRESETS) * 2  # sizes x models x references
    assert {r["model"] for r in rows} == set(DEFAULT_PRESETS)
    issue5 = {"fp16/16", "two_stage", "fp16/32", "bf16/32", "fp8/promote128", "fp8/nopromote"}
    assert issue5 <= set(DEFAULT_PRESETS)
    assert (tmp_path / "matmul_error.png").stat().st_size > 10_000
    curves = list(csv.DictReader((tmp_path / "matmul_error_curves.csv").open()))
    assert len(curves) == 2 * len(DEFAULT_PRESETS) * 201


def test_row_subset_and_error_ordering():
    res = matmul_error_study((512,), ("fp16/16", "two_stage", "fp16/32"), rows=64, seed=3)
    assert [r.rows for r in res] == [64, 64, 64]
    med = {r.preset: r.abs_vs_f64[50.0] for r in res}
    assert med["fp16/16"] > med["two_stage"] > med["fp16/32"]
    for r in res:  # percentiles are monotone and the accumulation error respects the deterministic bound
        values = [r.abs_vs_f64[p] for p in PERCENTILES]
        assert values == sorted(values)
        assert r.max_over_abs <= r.bound_det


def _fake(preset: str, median32: float, rel: float = 0.0) -> MatmulErrorResult:
    pct = dict.fromkeys(PERCENTILES, median32)
    return MatmulErrorResult(4096, 256, preset, 0.0, pct, pct, 0.0, rel / 5, 0.0, rel, 1.0, None)


def test_claim_checks_state_agreement_plainly():
    results = [
        _fake("fp16/16", 1e-2),
        _fake("two_stage", 1e-3),
        _fake("fp16/32", 1e-4),  # two-stage only 10x above fp16/32: disagrees with ~100x
        _fake("fp8/nopromote", 1.0, rel=0.021),
    ]
    checks = {c.claim: c for c in check_claims(results)}
    assert checks["two-stage error ~10x smaller than fp16/16"].agrees is True
    assert checks["two-stage error ~100x larger than fp16/32 (model fp16/32)"].agrees is False
    fp8 = next(c for c in checks.values() if c.source == "DeepSeek-V3")
    assert fp8.agrees is True and "2.1%" in fp8.measured
    assert "DISAGREES" in checks["two-stage error ~100x larger than fp16/32 (model fp16/32)"].line()


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["study", "matmul-error", "--quick", "--presets", "fp16/8", "--out-dir", str(tmp_path)]) == 2
    assert "fp16/16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["study", "matmul-error", "--sizes", "0,12"])
    assert exc.value.code == 2
    assert main(["study", "matmul-error", "--sizes", "16", "--rows", "0", "--out-dir", str(tmp_path)]) == 2
