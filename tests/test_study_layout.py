"""The studies' layout: argument parsing only in ``mixprec.cli``, each default from its one constant, and the
shared base (CSV, the closing lines) that every study writes through."""

from __future__ import annotations

import ast
import csv
from dataclasses import dataclass
from pathlib import Path

import pytest

from mixprec.cli.main import build_parser
from mixprec.compress.options import DEFAULT_CHUNK_SIZE
from mixprec.lab.studies.base import DEFAULT_SEED, default_out_dir, write_rows_csv, wrote_lines
from mixprec.parallel.buckets import DEFAULT_BUCKET_SIZE

LAB = Path(__file__).resolve().parents[1] / "src" / "mixprec" / "lab"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", ["studies", "demo"])
def test_no_study_or_demo_module_parses_arguments(folder: str) -> None:
    modules = sorted((LAB / folder).glob("*.py"))
    assert modules
    parsing = [m.name for m in modules if "argparse" in _imports(m)]
    assert not parsing, f"argparse belongs to mixprec.cli, not lab/{folder}: {parsing}"


@pytest.mark.parametrize("study", ["reduction-error", "compression-error", "matmul-error", "comm-cost"])
def test_study_defaults_come_from_the_shared_constants(study: str) -> None:
    args = build_parser().parse_args(["study", study])
    assert args.out_dir == default_out_dir(study)
    assert getattr(args, "seed", DEFAULT_SEED) == DEFAULT_SEED


def test_chunk_and_bucket_defaults_are_the_library_constants() -> None:
    parser = build_parser()
    assert parser.parse_args(["study", "compression-error"]).chunk_size == DEFAULT_CHUNK_SIZE
    from mixprec.cli.study import _comm_cost_config

    config = _comm_cost_config(parser.parse_args(["study", "comm-cost"]))
    assert config.numel == DEFAULT_BUCKET_SIZE


@dataclass
class _Row:
    name: str
    value: float
    count: int


def test_write_rows_csv_formats_only_the_named_fields(tmp_path) -> None:
    path = write_rows_csv(
        [_Row("a", 1 / 3, 2), _Row("b", 2.0, 3)], tmp_path / "x" / "rows.csv", formats={"value": ".3e"}
    )
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {"name": "a", "value": "3.333e-01", "count": "2"},
        {"name": "b", "value": "2.000e+00", "count": "3"},
    ]
    with pytest.raises(ValueError, match="dataclass"):
        write_rows_csv([], tmp_path / "empty.csv")


def test_wrote_lines_skips_what_was_not_written() -> None:
    assert wrote_lines([Path("a.csv"), None, Path("b.png")]) == "\nwrote a.csv\nwrote b.png"
