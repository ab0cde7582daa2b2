"""mixprec study compression-error: the bounds hold on every gradient kind, zeros stay zero on the aligned grid."""

from __future__ import annotations

import math

import pytest

from mixprec.cli.main import main
from mixprec.lab.studies.compression_error import CompressionErrorConfig, run_study


def test_quick_study_holds_its_bounds_and_keeps_zeros() -> None:
    config = CompressionErrorConfig(world=4, elements=8192, chunk_size=256, model_width=32)
    rows = {(r.distribution, r.wire): r for r in run_study(config)}
    assert len(rows) == 45
    for key, row in rows.items():
        assert 0 < row.error_over_bound <= 1, key
    # sparse gradients: the zero-aligned grid keeps every zero and cuts the mean error several times over
    assert rows["sparse", "uint8"].zeros_kept == 1.0 and rows["sparse", "uint8-min-grid"].zeros_kept == 0.0
    assert rows["sparse", "uint8"].mean_error * 4 < rows["sparse", "uint8-min-grid"].mean_error
    for wire in ("e4m3", "e5m2", "bf16"):
        assert rows["sparse", wire].zeros_kept == 1.0
        assert math.isclose(rows["normal", wire].bytes_per_element, 2.0 if wire == "bf16" else 1 + 4 / 256)
    # normal gradients: uint8 beats fp8 at the same bytes; fp8's scale per chunk keeps e4m3 within its u
    assert rows["normal", "uint8"].rel_error < rows["normal", "e4m3"].rel_error < 2**-4


def test_cli_quick_run(tmp_path, capsys) -> None:
    assert main(["study", "compression-error", "--quick", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| sparse | uint8 |" in out and (tmp_path / "compression_error.csv").exists()


def test_bad_arguments_are_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="elements"):
        CompressionErrorConfig(world=4, elements=1000, chunk_size=256)
    with pytest.raises(ValueError, match="wires"):
        CompressionErrorConfig(wires=("int4",))
    with pytest.raises(SystemExit):
        main(["study", "compression-error", "--wires", "int4"])
