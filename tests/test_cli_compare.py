"""``mixprec compare`` on handmade JSONL whose table values are known exactly (binary-exact losses)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli.main import main
from mixprec.lab.compare import compare_runs, format_table, load_run

SRC = Path(__file__).resolve().parents[1] / "src"


def write_jsonl(path, rows, extra_lines=()) -> str:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return str(path)


@pytest.fixture
def runs(tmp_path):
    ref = write_jsonl(
        tmp_path / "ref.jsonl",
        [
            {"step": s, "loss": loss, "eval_loss": ev, "skipped": False, "tokens_per_s": tps}
            for s, loss, ev, tps in zip(
                range(5), [4.0, 3.5, 3.0, 2.5, 2.0], [4.125, None, None, None, 2.125], [100, 200, 300, 400, 500]
            )
        ],
    )
    other = write_jsonl(
        tmp_path / "other.jsonl",
        [
            {"step": s, "loss": loss, "eval_loss": ev, "skipped": sk, "tokens_per_s": tps}
            for s, loss, ev, sk, tps in zip(
                range(5),
                [4.0, 3.75, 3.25, 2.25, 2.5],
                [None, None, None, None, 2.25],
                [False, True, False, False, False],
                [50, 50, 150, 150, 150],
            )
        ],
    )
    # Another machine's log: only step and loss, a step the reference lacks, a null loss, a blank line and a
    # repeated step (refused by default; with duplicates="last" the later row wins).
    foreign = write_jsonl(
        tmp_path / "foreign.jsonl",
        [
            {"step": 0, "loss": 4.0},
            {"step": 2, "loss": 3.0},
            {"step": 4, "loss": 1.0},
            {"step": 6, "loss": 0.5},
            {"step": 5, "loss": None},
        ],
        extra_lines=["", json.dumps({"step": 2, "loss": 2.5})],
    )
    return ref, other, foreign


def test_table_values_are_exact(runs) -> None:
    ref, other, foreign = (load_run(p, duplicates="last") for p in runs)
    assert (ref.repeated_steps, foreign.repeated_steps) == (0, 1)
    rows = compare_runs([ref, other, foreign], threshold=0.3)
    r0, r1, r2 = rows
    assert (r0.name, r0.steps, r0.final_loss, r0.best_loss, r0.final_eval_loss) == ("ref", 5, 2.0, 2.0, 2.125)
    assert (r0.max_abs_diff, r0.max_rel_diff, r0.first_step_over, r0.skipped, r0.tokens_per_s) == (0, 0, None, 0, 300)
    # other - ref = 0, .25, .25, -.25, .5; relative: .25/3.5, .25/3, .25/2.5, .5/2
    assert (r1.final_loss, r1.best_loss, r1.final_eval_loss) == (2.5, 2.25, 2.25)
    assert (r1.max_abs_diff, r1.max_rel_diff, r1.first_step_over) == (0.5, 0.25, 4)
    assert (r1.skipped, r1.tokens_per_s, r1.common_steps) == (1, 150, 5)
    # foreign at common steps 0, 2, 4: 4 - 4, 2.5 - 3, 1 - 2 -> 0, .5, 1; relative 1/2
    assert (r2.steps, r2.last_step, r2.final_loss, r2.best_loss, r2.final_eval_loss) == (4, 6, 0.5, 0.5, None)
    assert (r2.common_steps, r2.max_abs_diff, r2.max_rel_diff, r2.first_step_over) == (3, 1.0, 0.5, 2)
    assert (r2.skipped, r2.tokens_per_s) == (None, None)
    assert compare_runs([ref, other], threshold=0.2)[1].first_step_over == 1
    assert compare_runs([ref, other], threshold=0.5)[1].first_step_over is None  # strictly greater


def test_nonfinite_loss_is_an_infinite_difference(tmp_path, runs) -> None:
    ref = load_run(runs[0])
    bad = load_run(write_jsonl(tmp_path / "nan.jsonl", [{"step": 0, "loss": 4.0}, {"step": 1, "loss": math.nan}]))
    row = compare_runs([ref, bad], threshold=10.0)[1]
    assert row.max_abs_diff == math.inf and row.first_step_over == 1
    assert row.final_loss != row.final_loss and row.best_loss == 4.0


def test_cli_prints_table_and_writes_png(runs, tmp_path, capsys) -> None:
    png = tmp_path / "out" / "cmp.png"
    argv = ["compare", *runs, "--threshold", "0.3", "--plot", str(png), "--labels", "a,b,c"]
    argv += ["--duplicate-steps", "last"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"note: {runs[2]}: 1 step(s) logged more than once; the later row is used"
    lines = lines[1:]
    assert lines[0].startswith("| run | steps | final loss | best loss | final val loss | max abs diff")
    assert "| a (reference) | 5 | 2.0000 | 2.0000 | 2.1250 | - | - | - | 0 | 300 |" in lines
    assert "| b | 5 | 2.5000 | 2.2500 | 2.2500 | 0.5 | 25.000% | 4 | 1 | 150 |" in lines
    assert "| c | 4 | 0.5000 | 0.5000 | - | 1 | 50.000% | 2 | - | - |" in lines
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_directory_is_read(tmp_path, runs, capsys) -> None:
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(Path(runs[1]).read_text())
    assert main(["compare", runs[0], str(run_dir), "--no-plot"]) == 0
    assert "| myrun | 5 |" in capsys.readouterr().out


def test_repeated_step_is_refused_naming_file_and_step(runs, capsys) -> None:
    with pytest.raises(ValueError, match=r"foreign.jsonl:7: step 2 is logged again \(first at line 2\)"):
        load_run(runs[2])
    assert main(["compare", *runs, "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "foreign.jsonl:7: step 2 is logged again" in err and "--duplicate-steps" in err


def test_later_row_of_a_repeated_step_replaces_every_field(tmp_path) -> None:
    path = write_jsonl(
        tmp_path / "resumed.jsonl",
        [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.5, "eval_loss": 1.75}, {"step": 1, "loss": 1.25}],
    )
    log = load_run(path, duplicates="last")
    assert (log.loss, log.eval_loss, log.repeated_steps) == ({0: 2.0, 1: 1.25}, {}, 1)
    with pytest.raises(ValueError, match="duplicates must be one of"):
        load_run(path, duplicates="first")


def test_never_crossing_is_reported(runs) -> None:
    ref, other = load_run(runs[0]), load_run(runs[1])
    table = format_table(compare_runs([ref, other], threshold=1.0), threshold=1.0)
    assert "| never |" in table and "first step diff > 1 |" in table


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step": 0, "loss": 1.0}\nnot json\n', ":2: not a JSON object"),
        ('{"loss": 1.0}\n', "no 'step' field"),
        ('{"step": 1.5, "loss": 1.0}\n', "'step' must be an integer"),
        ('{"step": 1, "loss": "low"}\n', "'loss' must be a number"),
        ('{"step": 1, "eval_loss": 2.0}\n', "no row with both 'step' and 'loss'"),
    ],
)
def test_bad_jsonl_exits_2(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["compare", str(path), "--no-plot"]) == 2
    assert message in capsys.readouterr().err


def test_bad_arguments_exit_2(tmp_path, runs, capsys) -> None:
    assert main(["compare", str(tmp_path / "missing"), "--no-plot"]) == 2
    assert "no such run directory or JSONL file" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), "--no-plot"]) == 2
    assert "without metrics.jsonl" in capsys.readouterr().err
    assert main(["compare", *runs, "--labels", "x,y", "--no-plot"]) == 2
    assert "--labels names 2 runs; 3 were given" in capsys.readouterr().err
    assert main(["compare", *runs, "--threshold", "-1", "--no-plot"]) == 2
    assert "threshold must be a number >= 0" in capsys.readouterr().err


def test_internal_error_is_not_reported_as_bad_input(runs, monkeypatch) -> None:
    """A ValueError raised by a bug while the work runs (here injected into compare_runs) propagates with its
    traceback; only the argument checks before the work map to exit 2."""
    import mixprec.lab.compare as lab_compare

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(lab_compare, "compare_runs", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["compare", runs[0], runs[1], "--no-plot"])


def test_internal_error_exits_1_with_a_traceback(runs) -> None:
    code = (
        "import sys, mixprec.lab.compare as c\n"
        "def broken(*a, **k): raise TypeError('an internal bug')\n"
        "c.compare_runs = broken\n"
        "from mixprec.cli.main import main\n"
        f"sys.exit(main(['compare', {runs[0]!r}, {runs[1]!r}, '--no-plot']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "TypeError: an internal bug" in proc.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("plot", ["/proc/cmp.png", "/proc/new/cmp.png", "/proc/version"])
def test_plot_on_a_file_system_that_refuses_writes_is_refused_before_the_table(runs, capsys, plot) -> None:
    """/proc refuses new files even to root, whom os.access lets through: the check creates a file to know
    (before, root got the table and then a FileNotFoundError traceback from savefig)."""
    assert main(["compare", runs[0], runs[1], "--plot", plot]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--plot '/proc" in err and "creating a file there failed" in err, err


def test_bad_plot_path_is_refused_before_the_table(runs, tmp_path, capsys) -> None:
    assert main(["compare", runs[0], runs[1], "--plot", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--plot" in err and "is a folder" in err
    (tmp_path / "file").write_text("")
    assert main(["compare", runs[0], runs[1], "--plot", str(tmp_path / "file" / "cmp.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is a file" in err
