"""Skip-aware LR schedule, overflow culprits, headroom telemetry and fingerprint linear modes in mixprec train."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from mixprec.cli.main import main
from mixprec.emulate import Fingerprint, get_matmul_model
from mixprec.lab.build import build_parts
from mixprec.lab.config import config_from_toml, merge_config
from mixprec.lab.corpus import load_corpus
from mixprec.lab.data import train_microbatches
from mixprec.lab.metrics import METRICS_NAME, encode_row, read_rows
from mixprec.lab.schedule import lr_factor
from mixprec.lab.telemetry import HEADROOM_FIELDS
from mixprec.scaling import grad_range_by_layer

TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "8", "--data.micro-batch-size", "2", "--data.eval-sequences", "8",
    "--training.eval-interval", "0",
    "--optimizer.lr", "0.01",
]  # fmt: skip
# fp16 whose dynamic scale grows every 2 steps until it overflows: skipped steps within a few steps.
OVERFLOWING = ["--model.precision", "fp16", "--scaler.growth-interval", "2"]


def rows_of(run_dir) -> list[dict]:
    return list(read_rows(os.path.join(run_dir, METRICS_NAME)))


def train(run_dir, *args: str) -> int:
    return main(["train", "--training.out-dir", str(run_dir), *TINY, *args])


def numerics(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["loss_scale"], r["skipped"], r["grad_norm"]) for r in rows]


def config_of(run_dir):
    return merge_config(config_from_toml(os.path.join(run_dir, "config.toml")))


# ------------------------------------------------------------------------------------------- skip-aware stepping
def test_schedule_advances_only_on_steps_taken_and_skips_name_their_culprits(tmp_path) -> None:
    run = tmp_path / "run"
    args = [
        *OVERFLOWING,
        "--training.steps",
        "8",
        "--optimizer.schedule",
        "warmup_cosine",
        "--optimizer.warmup-steps",
        "2",
    ]
    assert train(run, *args, "--optimizer.min-lr", "0.001") == 0
    rows, cfg = rows_of(run), config_of(run)
    assert any(r["skipped"] for r in rows) and not all(r["skipped"] for r in rows)
    taken = 0
    for r in rows:
        # The lr a step used is the schedule's after the steps taken before it: skipped ones do not count.
        assert r["lr"] == pytest.approx(0.01 * lr_factor(cfg, taken), rel=1e-15)
        taken += not r["skipped"]
    assert rows[0]["lr"] == pytest.approx(0.005) and lr_factor(cfg, 10**6) == pytest.approx(0.1)
    names = {name for name, _ in torch.nn.Module.named_parameters(build_parts(cfg, 96, torch.device("cpu"), 1).module)}
    for r in rows:
        if r["skipped"]:
            assert r["culprits"] and set(r["culprits"]) <= names
        else:
            assert "culprits" not in r


def test_default_run_logs_no_lr_and_telemetry_leaves_the_numbers_alone(tmp_path) -> None:
    assert train(tmp_path / "off", *OVERFLOWING, "--training.steps", "5", "--training.headroom-interval", "0") == 0
    assert train(tmp_path / "on", *OVERFLOWING, "--training.steps", "5", "--training.headroom-interval", "1") == 0
    off, on = rows_of(tmp_path / "off"), rows_of(tmp_path / "on")
    assert numerics(on) == numerics(off)
    assert all("lr" not in r and "headroom" not in r for r in off)
    assert ["headroom" in r for r in on] == [False, True, True, True, True]


def test_schedule_resumes_bit_exact(tmp_path, monkeypatch) -> None:
    common = [*OVERFLOWING, "--parallel.nproc", "2", "--training.steps", "8", "--training.checkpoint-interval", "4",
              "--parallel.timeout", "30",
              "--optimizer.schedule", "warmup_cosine", "--optimizer.warmup-steps", "3",
              "--training.headroom-interval", "3"]  # fmt: skip
    assert train(tmp_path / "whole", *common) == 0
    monkeypatch.setenv("MIXPREC_FAULT", "1:6:exit")
    assert train(tmp_path / "cut", *common) == 1
    monkeypatch.delenv("MIXPREC_FAULT")
    assert main(["train", "--training.out-dir", str(tmp_path / "cut"), "--resume"]) == 0
    whole, cut = rows_of(tmp_path / "whole"), rows_of(tmp_path / "cut")
    assert any(r["skipped"] for r in whole[4:])  # the resumed part has skips to carry over
    assert [r.get("headroom") for r in cut] == [r.get("headroom") for r in whole]
    assert [r["step"] for r in whole if "headroom" in r] == [3, 6]
    assert [(*n, r["lr"]) for n, r in zip(numerics(cut), cut, strict=True)] == [
        (*n, r["lr"]) for n, r in zip(numerics(whole), whole, strict=True)
    ]


def test_bad_schedule_options_exit_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's choices
        train(tmp_path / "a", "--optimizer.schedule", "linear")
    assert exc.value.code == 2
    assert train(tmp_path / "b", "--optimizer.schedule", "warmup_cosine", "--optimizer.min-lr", "0.1") == 2
    assert "min_lr" in capsys.readouterr().err
    assert train(tmp_path / "c", "--training.headroom-interval", "-1") == 2
    assert not os.path.exists(tmp_path / "b")


# ---------------------------------------------------------------------------------------------------- headroom
def test_headroom_rows_equal_grad_range_report_of_the_same_gradients(tmp_path) -> None:
    """1 rank, fp32, static scale 2**10: the row of step 2 against grad_range_by_layer of the unscaled gradients of
    step 2 at that scale, recomputed here from the same weights (steps 0 and 1 replayed) and the same batches."""
    run = tmp_path / "run"
    static = ["--scaler.kind", "static", "--scaler.init-scale", "1024"]
    assert train(run, "--training.steps", "3", "--training.headroom-interval", "2", *static) == 0
    rows, cfg = rows_of(run), config_of(run)
    assert [("headroom" in r) for r in rows] == [False, False, True]

    corpus = load_corpus(cfg.data.corpus)
    parts = build_parts(cfg, corpus.vocab_size, torch.device("cpu"), 1)

    def batches(step):
        return train_microbatches(
            corpus.train, seed=cfg.training.seed, step=step, global_batch_size=cfg.data.global_batch_size,
            micro_batch_size=cfg.data.micro_batch_size, block_size=cfg.model.block_size, rank=0, world_size=1,
        )  # fmt: skip

    for step in (0, 1):
        parts.updater.step(batches(step))
    parts.module.zero_grad(set_to_none=True)
    for x, y in batches(2):
        _, loss = parts.module(x, y)
        (loss / cfg.num_microbatches).backward()
    expected = grad_range_by_layer(parts.module, 1024.0, torch.float16)
    got = rows[2]["headroom"]
    assert list(got) == list(expected)
    for layer, report in expected.items():
        assert got[layer] == {name: getattr(report, name) for name in HEADROOM_FIELDS}, layer
    assert rows[2]["loss_scale"] == 1024.0
    # strict JSON on disk (no NaN/Infinity tokens), one object per line
    for line in (run / METRICS_NAME).read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_headroom_shows_underflow_at_a_tiny_scale(tmp_path) -> None:
    run = tmp_path / "run"
    args = [
        "--training.steps",
        "2",
        "--training.headroom-interval",
        "1",
        "--scaler.kind",
        "static",
        "--scaler.init-scale",
        str(2.0**-20),
    ]
    assert train(run, *args) == 0
    headroom = rows_of(run)[1]["headroom"]
    assert max(h["underflow"] for h in headroom.values()) > 0.5
    assert all(0.0 <= sum(h.values()) <= 1.0 + 1e-12 for h in headroom.values())  # "normal" is the rest


# ------------------------------------------------------------------------------------------ fingerprint as mode
def _fingerprint_file(path, preset: str = "fp16/16") -> str:
    fp = Fingerprint(
        inputs="fp16", output=None, m=64, n=64, k=512, products_exact=True, effective_bits=11, rounding="nearest",
        align_bits=None, k_group=16, promote_every=None, split_k=None, model=get_matmul_model(preset),
        preset=preset, closest_preset=preset, bit_equal=1.0, probe_agreement=1.0, label="test",
    )  # fmt: skip
    return fp.save(path)


def test_linear_mode_fingerprint_file_emulates_the_measured_model(tmp_path) -> None:
    path = _fingerprint_file(tmp_path / "matmul_fp16.json")
    assert train(tmp_path / "file", "--model.linear-mode", path, "--training.steps", "2") == 0
    assert train(tmp_path / "preset", "--model.linear-mode", "fp16/16", "--training.steps", "2") == 0
    assert numerics(rows_of(tmp_path / "file")) == numerics(rows_of(tmp_path / "preset"))
    assert path in (tmp_path / "file" / "config.toml").read_text()


@pytest.mark.parametrize("content", [None, "{not json", '{"format": "something else"}'])
def test_linear_mode_bad_file_exits_2_in_one_line(tmp_path, capsys, content) -> None:
    path = tmp_path / "fp.json"
    if content is not None:
        path.write_text(content)
    assert train(tmp_path / "run", "--model.linear-mode", str(path), "--training.steps", "2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "linear_mode" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # each emulated matmul summed 2**29 products per group: one step of this model took over 600 s
        (lambda d: d.update(k_group=2**29), "field k_group must be in 1..257 (what the probe can report)"),
        (lambda d: d["model"].update(k_group=2**29), "field model.k_group must be in 1..257"),
        (lambda d: d["model"].update(promote_every=2**30), "field model.promote_every must be in 1..1023"),
        (lambda d: d.update(k="512"), "field k must be an integer; got str '512'"),
    ],
)
def test_linear_mode_fingerprint_out_of_the_probes_range_exits_2(tmp_path, capsys, edit, message) -> None:
    path = _fingerprint_file(tmp_path / "fp.json")
    with open(path) as fh:
        data = json.load(fh)
    edit(data)
    with open(path, "w") as fh:
        json.dump(data, fh)
    assert train(tmp_path / "run", "--model.linear-mode", path, "--training.steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"linear_mode: {path!r}: fingerprint {message}" in err, err
    assert not os.path.exists(tmp_path / "run")


def test_linear_mode_deeply_nested_json_exits_2_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert train(tmp_path / "run", "--model.linear-mode", str(path), "--training.steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "JSON nested too deeply" in err and str(path) in err, err


# ------------------------------------------------------------------------------------------------ mixprec report
def _write_rows(run_dir, rows: list[dict]) -> None:
    run_dir.mkdir()
    (run_dir / METRICS_NAME).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _headroom(underflow: float) -> dict:
    return {"h.0.mlp": {"zero": 0.0, "underflow": underflow, "subnormal": 0.01, "overflow": 0.0, "nonfinite": 0.0}}


def test_report_plots_and_says_the_scale_is_about_to_collapse(tmp_path, capsys) -> None:
    rows = [
        {"step": 0, "loss_scale": 1024.0, "skipped": False},
        {"step": 1, "loss_scale": 1024.0, "skipped": True, "culprits": ["h.0.mlp.weight"], "headroom": _headroom(0.02)},
        {"step": 2, "loss_scale": 512.0, "skipped": False, "headroom": _headroom(0.05)},
        {"step": 3, "loss_scale": 512.0, "skipped": True, "culprits": ["h.0.mlp.weight"]},
        {"step": 4, "loss_scale": 256.0, "skipped": False, "headroom": _headroom(0.12)},
    ]
    _write_rows(tmp_path / "run", rows)
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "loss scale 1024 -> 256" in out and "2 skipped step(s), the last at step 3" in out
    assert "h.0.mlp.weight (2)" in out
    assert "layer h.0.mlp: 12% of gradients would underflow in fp16 at step 4, rising (from 2% at step 1)" in out
    assert "heading for collapse" in out
    png = (tmp_path / "run" / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_report_of_a_real_run(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(run, *OVERFLOWING, "--training.steps", "5", "--training.headroom-interval", "2") == 0
    capsys.readouterr()
    out_png = tmp_path / "plots" / "r.png"
    assert main(["report", str(run), "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("steps 0..4: loss scale 65536") and out_png.is_file()
    assert main(["report", str(run), "--no-plot"]) == 0
    assert "plot:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "not a directory"),
        (lambda d: d.mkdir(), "holds no metrics.jsonl"),
        (lambda d: _write_rows(d, []), "holds no rows"),
        (lambda d: _write_rows(d, [{"step": 0, "loss": 1.0}]), "loss_scale"),
        (lambda d: _write_rows(d, [{"step": 0, "loss_scale": 1.0, "skipped": False, "headroom": [1]}]), "headroom"),
    ],
)
def test_report_bad_input_exits_2_in_one_line(tmp_path, capsys, make, message) -> None:
    make(tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def _row(step: object, scale: object = 1024.0) -> dict:
    return {"step": step, "loss": 2.0, "loss_scale": scale, "skipped": False}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([_row(3), _row(3)], "metrics.jsonl:2: step 3 is logged again (first at line 1)"),
        ([_row(3), _row(2)], "metrics.jsonl:2: step 2 follows step 3: the steps of a log must increase"),
        ([_row(-1)], "metrics.jsonl:1: 'step' must lie in 0..2**53"),
        ([_row(0), _row(10**30)], "metrics.jsonl:2: 'step' must lie in 0..2**53"),
        ([_row(True)], "metrics.jsonl:1: 'step' must be an integer"),
    ],
)
def test_report_refuses_the_steps_compare_refuses(tmp_path, capsys, rows, message) -> None:
    """One check of a log's steps (mixprec.lab.metrics.read_step_rows) for both readers: the same file gets the
    same one-line error from report and from compare, instead of a summary of "steps 3..2"."""
    _write_rows(tmp_path / "run", rows)
    for argv in (["report", str(tmp_path / "run")], ["compare", str(tmp_path / "run"), "--no-plot"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)


@pytest.mark.parametrize("scale", [0, -4, 0.0, None, "big"])
def test_report_refuses_a_loss_scale_no_scaler_keeps(tmp_path, capsys, scale) -> None:
    _write_rows(tmp_path / "run", [_row(0), _row(1, scale)])
    assert main(["report", str(tmp_path / "run"), "--no-plot"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "metrics.jsonl:2:" in err and "loss_scale" in err


def test_report_refuses_a_nonfinite_loss_scale(tmp_path, capsys) -> None:
    # The strict encoding of the metrics log: an inf loss scale is null plus a "nonfinite" entry.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_NAME).write_text(encode_row(_row(0, math.inf)) + "\n")
    assert main(["report", str(tmp_path / "run"), "--no-plot"]) == 2
    assert "'loss_scale' must be a finite number > 0; got inf" in capsys.readouterr().err


def test_report_and_compare_name_a_binary_file(tmp_path, capsys) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_NAME).write_bytes(json.dumps(_row(0)).encode() + b"\n\xc9\x00\xff\xfe garbage\n")
    for argv in (["report", str(tmp_path / "run")], ["compare", str(tmp_path / "run"), "--no-plot"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{tmp_path / 'run' / METRICS_NAME}:2: not UTF-8 text" in err, err


def test_report_and_compare_refuse_deeply_nested_json_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_NAME).write_text('{"step": 0, "a": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    for argv in (["report", str(tmp_path / "run")], ["compare", str(tmp_path / "run"), "--no-plot"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "metrics.jsonl:1: JSON nested too deeply" in err, err


def test_report_refuses_malformed_culprits(tmp_path, capsys) -> None:
    _write_rows(tmp_path / "run", [{**_row(0), "skipped": True, "culprits": 7}])
    assert main(["report", str(tmp_path / "run"), "--no-plot"]) == 2
    assert "metrics.jsonl:1: 'culprits' must be a list of parameter names; got 7" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ demo --audit FILE
def test_demo_report_cites_the_machines_audit(tmp_path, capsys) -> None:
    from mixprec.lab import demo
    from mixprec.lab.studies.audit import audit_citation

    argv = [
        "audit",
        "collectives",
        "--nproc",
        "2",
        "--max-size",
        "4KiB",
        "--dtypes",
        "bf16",
        "--out-dir",
    ]
    assert main([*argv, str(tmp_path / "audit")]) == 0
    path = tmp_path / "audit" / "audit_collectives.json"
    verdicts = json.loads(path.read_text())["verdicts"]
    lines = audit_citation(path)
    assert lines[0].startswith("From `audit_collectives.json` (backend gloo, 2 ranks, torch ")
    assert lines[2:] == [f"- {v}" for v in verdicts]
    out = tmp_path / "demo"
    overrides = {**demo.QUICK_OVERRIDES, "steps": 2, "nproc": 1}
    assert demo.run_demo(out_dir=str(out), overrides=overrides, runs=demo.DEMO_RUNS[:1], audit_lines=lines) == 0
    report = (out / "report.md").read_text()
    assert "## This machine's collectives (mixprec audit collectives)" in report
    assert all(v in report for v in verdicts)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--audit: no such file"),
        ("fifo", "--audit: {path!r} is not a regular file"),  # the read blocked until something wrote to it
        ("{not json", "cannot read an audit"),
        ("[1, 2]", "no list of verdicts"),
        ('{"verdicts": []}', "no list of verdicts"),
    ],
)
def test_demo_audit_bad_file_exits_2_before_any_run(tmp_path, monkeypatch, capsys, content, message) -> None:
    from mixprec.lab.demo import runs as demo_runs

    monkeypatch.setattr(demo_runs, "launch", lambda *a, **k: pytest.fail("a run started"))
    path = tmp_path / "audit.json"
    message = message.format(path=str(path))
    if content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_text(content)
    assert main(["demo", "--quick", "--out-dir", str(tmp_path / "d"), "--audit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
