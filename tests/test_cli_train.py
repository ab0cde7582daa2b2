"""``mixprec train`` end to end with tiny settings: precisions, reductions, rank parity, resume, failures."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.metrics import METRICS_NAME, read_rows

# 1 layer, width 16, 16 characters of context: ~7k parameters, a few ms per step.
TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "8", "--data.micro-batch-size", "2", "--data.eval-sequences", "8",
    "--training.eval-interval", "3",
    "--optimizer.lr", "0.01",
]  # fmt: skip
FIELDS = {"step", "loss", "eval_loss", "loss_scale", "skipped", "grad_norm", "tokens_per_s", "wall_time"}
# Fault tests: the collective timeout of a run that must be ended by its launcher, not by a timeout (seconds), and
# the bound on a run whose hung rank must be ended by a 4 s timeout.
SLOW_TIMEOUT_S = 120
HANG_BOUND_S = 120


def rows_of(run_dir) -> list[dict]:
    return list(read_rows(os.path.join(run_dir, METRICS_NAME)))


def train(run_dir, *args: str) -> int:
    return main(["train", "--training.out-dir", str(run_dir), *TINY, *args])


def numerics(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["eval_loss"], r["loss_scale"], r["skipped"], r["grad_norm"]) for r in rows]


# Every precision and every reduction, in four runs.
@pytest.mark.parametrize(
    ("precision", "reduce"),
    [
        ("fp32", "native"),
        ("bf16", "fp32_accumulate"),
        pytest.param("bf16", "fp32_accumulate_hierarchical", marks=pytest.mark.slow),
        ("fp16", "uint8"),
        pytest.param("bf16", "uint8_hierarchical", marks=pytest.mark.slow),
    ],  # 4 ranks, new groups: ~8 s
)
def test_each_precision_and_reduction_runs_and_logs(tmp_path, precision, reduce) -> None:
    run = tmp_path / "run"
    # uint8_hierarchical: 4 ranks as 2 simulated nodes of 2.
    nproc = "4" if reduce.endswith("_hierarchical") else "2"
    args = [
        "--parallel.nproc",
        nproc,
        "--model.precision",
        precision,
        "--parallel.reduce",
        reduce,
        "--training.steps",
        "6",
    ]
    if precision == "fp16":
        args += ["--scaler.growth-interval", "2"]  # grow until it overflows: skips must be handled
    assert train(run, *args) == 0
    rows = rows_of(run)
    assert [r["step"] for r in rows] == list(range(6))
    # An overflowing (skipped) step also names its culprits: the parameters whose gradients were inf/NaN.
    assert all(set(r) == FIELDS | ({"culprits"} if r["skipped"] else set()) for r in rows)
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [0, 3, 5]
    walls = [r["wall_time"] for r in rows]
    assert walls == sorted(walls) and len(set(walls)) == len(walls)  # a clock since the start, one row per step
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns something even in 6 steps
    expected_scale = 65536.0 if precision == "fp16" else 1.0  # 'auto': dynamic from 2**16 for fp16, else none
    assert rows[0]["loss_scale"] == expected_scale
    if precision == "fp16":
        assert any(r["skipped"] for r in rows) and all(r["grad_norm"] is None for r in rows if r["skipped"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == int(nproc)
    config = (run / "config.toml").read_text()
    assert f'precision = "{precision}"' in config and f'reduce = "{reduce}"' in config
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 6
    low = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(t.dtype == low for t in state["model"].values())


@pytest.mark.parametrize(("reduce", "optimizer"), [("native", "adamw"), ("fp32_accumulate", "sgd")])
def test_two_ranks_equal_one_rank_bit_for_bit(tmp_path, one_thread, reduce, optimizer) -> None:
    """GBS 4, MBS 2: one rank accumulates fl(g0/2 + g1/2); two ranks reduce g0 and g1 to (g0 + g1) / 2. Halving is
    exact (no underflow at these magnitudes) and a sum of two fp32 terms is one correctly rounded addition either
    way, so the averaged gradient, and with it every later step, must agree bit for bit (the fp32 tolerance for
    two addends is zero). Losses and eval losses are sums of the same fp32 values in fp64 (exact for 2 terms)."""
    common = [
        "--data.global-batch-size",
        "4",
        "--data.micro-batch-size",
        "2",
        "--training.steps",
        "5",
        "--parallel.reduce",
        reduce,
    ]
    common += ["--optimizer.name", optimizer]
    assert train(tmp_path / "one", "--parallel.nproc", "1", *common) == 0
    assert train(tmp_path / "two", "--parallel.nproc", "2", *common) == 0
    one, two = rows_of(tmp_path / "one"), rows_of(tmp_path / "two")
    assert numerics(one) == numerics(two)
    assert len({r["loss"] for r in one}) == 5  # it trained: the losses change


def test_sharded_optimizer_equals_unsharded_in_fp32(tmp_path) -> None:
    """fp32, no clipping: reduce-scattering into fp32 shards sums exactly as the all-reduce's reduce-scatter does,
    and AdamW is elementwise, so the sharded run's losses equal the unsharded run's bit for bit. The logged grad
    norm sums the same n squares in another order (per-shard vs per-tensor): each fp32 sum of squares is within
    gamma_{n+1} of the exact one (n - 1 additions and one square per term), so the two differ by at most
    2 gamma_{n+1} relative; the square root halves that and adds one rounding to each: <= gamma_{n+3}."""
    common = [
        "--parallel.nproc",
        "2",
        "--parallel.reduce",
        "fp32_accumulate",
        "--training.clip-grad-norm",
        "0",
        "--training.steps",
        "4",
    ]
    assert train(tmp_path / "flat", *common) == 0
    assert train(tmp_path / "sharded", *common, "--parallel.sharded-optimizer") == 0
    flat, sharded = rows_of(tmp_path / "flat"), rows_of(tmp_path / "sharded")
    assert [r["loss"] for r in flat] == [r["loss"] for r in sharded]
    state = torch.load(tmp_path / "sharded" / "checkpoint.pt", weights_only=True)
    n = sum(t.numel() for t in state["model"].values()) + 3
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    for a, b in zip(flat, sharded):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= gamma * a["grad_norm"]
    assert state["optimizer"]["format"].startswith("mixprec.sharded_optimizer")


def test_killed_rank_stops_the_run_and_resume_is_bit_exact(tmp_path, monkeypatch, capsys) -> None:
    """fp16 with dynamic scaling (scale growth every 2 steps, so overflows and skips happen) and dropout: the
    uninterrupted run, and a run whose rank 1 crashes at step 6 (after the checkpoint of step 4) then resumed,
    must log identical numbers at every step."""
    # A collective timeout far above the run's length: only the launcher can end the cut run before it.
    common = ["--parallel.nproc", "2", "--model.precision", "fp16", "--scaler.growth-interval", "2",
              "--model.dropout", "0.1",
              "--training.checkpoint-interval", "4", "--parallel.timeout", str(SLOW_TIMEOUT_S)]  # fmt: skip
    assert train(tmp_path / "whole", *common, "--training.steps", "9") == 0
    whole = rows_of(tmp_path / "whole")
    assert any(r["skipped"] for r in whole)

    monkeypatch.setenv("MIXPREC_FAULT", "1:6:exit")
    start = time.monotonic()
    code = train(tmp_path / "cut", *common, "--training.steps", "9")
    elapsed = time.monotonic() - start
    assert code == 1
    err = capsys.readouterr().err
    assert "rank 1 exited with code 13" in err and "Traceback" not in err.split("mixprec train: error:")[-1]
    # Liveness, not speed: the crash is seen at once, the peers get GRACE_S, then SIGTERM + 5 s (mixprec.lab.launch),
    # seconds even on a loaded machine; a launcher that waited for the peers' collective timeout instead would take
    # SLOW_TIMEOUT_S. The bound separates the two by a factor of 2 either way.
    assert elapsed < SLOW_TIMEOUT_S / 2
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 4
    assert [r["step"] for r in rows_of(tmp_path / "cut")] == list(range(6))
    monkeypatch.delenv("MIXPREC_FAULT")

    assert main(["train", "--training.out-dir", str(tmp_path / "cut"), "--resume"]) == 0
    assert numerics(rows_of(tmp_path / "cut")) == numerics(whole)


@pytest.mark.slow
def test_hung_rank_times_out_and_checkpoint_survives(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MIXPREC_FAULT", "1:3:hang")
    timeout = 4.0
    start = time.monotonic()
    code = train(tmp_path / "hang", "--parallel.nproc", "2", "--training.steps", "8",
                 "--training.checkpoint-interval", "2",
                 "--parallel.timeout", str(timeout))  # fmt: skip
    elapsed = time.monotonic() - start
    assert code == 1
    err = capsys.readouterr().err
    # Rank 0's collective timed out (a peer failure, not its own): the hung rank 1 is blamed.
    assert "rank(s) 1 stopped responding (hung)" in err and "rank 0: stopped, a peer failed" in err
    # Liveness, not speed: the peer's collective times out after `timeout`, the launcher waits GRACE_S, SIGTERM,
    # + 5 s (about 20 s with the ranks' start). Without the run's timeout the peer would wait for torch's 30-minute
    # default, and the hung rank sleeps an hour: HANG_BOUND_S separates these with room for a loaded machine.
    assert elapsed < HANG_BOUND_S
    assert torch.load(tmp_path / "hang" / "checkpoint.pt", weights_only=True)["step"] == 2


def test_existing_run_needs_resume_or_overwrite(tmp_path, capsys) -> None:
    run = tmp_path / "r"
    assert train(run, "--training.steps", "2") == 0
    assert train(run, "--training.steps", "2") == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train(run, "--training.steps", "3", "--overwrite") == 0
    assert len(rows_of(run)) == 3
    assert main(["train", "--training.out-dir", str(tmp_path / "none"), "--resume"]) == 2


def test_resume_refuses_changed_numerics(tmp_path, capsys) -> None:
    run = tmp_path / "r"
    assert train(run, "--training.steps", "2") == 0
    assert (
        main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "4", "--optimizer.lr", "0.5"])
        == 2
    )
    err = capsys.readouterr().err
    assert "lr: checkpoint 0.01, now 0.5" in err
    assert main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "4"]) == 0
    assert [r["step"] for r in rows_of(run)] == [0, 1, 2, 3]


def test_linear_mode(tmp_path) -> None:
    assert train(tmp_path / "emu", "--model.linear-mode", "fp16/16", "--training.steps", "3") == 0
    assert train(tmp_path / "ref", "--training.steps", "3") == 0
    emu, ref = rows_of(tmp_path / "emu"), rows_of(tmp_path / "ref")
    # Same weights at step 0; the emulated fp16 accumulation changes the loss (else the mode did nothing). How
    # close it stays is the emulator's business (tests/test_emulate_*.py bound it per matmul); through a network
    # no bound follows from error theory without assumptions on conditioning, so none is asserted here.
    assert emu[0]["loss"] != ref[0]["loss"]
    assert all(math.isfinite(r["loss"]) for r in emu)


def _torchrun_rank(rank: int, port: int, run_dir: str, conn) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    code = main(["train", "--training.out-dir", run_dir, *TINY, "--training.steps", "3"])
    conn.send(code)
    conn.close()
    os._exit(0)


def test_torchrun_environment(tmp_path) -> None:
    """What torchrun provides is its environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): two processes
    with it must train as one 2-rank job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_torchrun_rank, args=(r, port, str(tmp_path / "tr"), pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    codes = [pipes[r][0].recv() if pipes[r][0].poll(120) else None for r in range(2)]
    for p in procs:
        p.join(10)
    assert codes == [0, 0]
    assert "nproc = 2" in (tmp_path / "tr" / "config.toml").read_text()
    assert [r["step"] for r in rows_of(tmp_path / "tr")] == [0, 1, 2]


def test_resume_restores_each_ranks_reducer_state(tmp_path) -> None:
    """uint8 with error feedback and stochastic rounding keeps per-rank state (residuals, generators): a resumed
    run must still log the uninterrupted run's numbers exactly."""
    common = ["--parallel.nproc", "2", "--parallel.reduce", "uint8", "--parallel.error-feedback",
              "--parallel.rounding", "stochastic",
              "--training.checkpoint-interval", "3"]  # fmt: skip
    assert train(tmp_path / "whole", *common, "--training.steps", "6") == 0
    assert train(tmp_path / "cut", *common, "--training.steps", "3") == 0
    assert main(["train", "--training.out-dir", str(tmp_path / "cut"), "--resume", "--training.steps", "6"]) == 0
    # The first segment also evaluated at its last step (2); training numbers must be identical everywhere.
    cut, whole = rows_of(tmp_path / "cut"), rows_of(tmp_path / "whole")
    assert [(*t[:2], *t[3:]) for t in numerics(cut)] == [(*t[:2], *t[3:]) for t in numerics(whole)]
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert len(state["reducer_states"]) == 2


# ---------------------------------------------------------------- configuration errors (exit 2, nothing written)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_loss_scale_below_the_floor_is_refused_before_anything_is_written(tmp_path, capsys, nproc) -> None:
    """fp16's dynamic scaler refuses init_scale 0.5 below min_scale 1: TrainConfig builds the scaler, so the
    error comes from the parent, once, with exit 2 and no run directory left behind."""
    run = tmp_path / "r"
    assert train(run, "--parallel.nproc", nproc, "--model.precision", "fp16", "--scaler.init-scale", "0.5") == 2
    err = capsys.readouterr().err
    assert "init_scale (0.5) must be >= min_scale (1.0)" in err and "Traceback" not in err
    assert not run.exists()
    assert train(run, "--parallel.nproc", nproc, "--model.precision", "fp16", "--scaler.init-scale", "0.5",
                 "--scaler.min-scale", "0.25",
                 "--training.steps", "1") == 0  # fmt: skip


def _short_corpus(path, lines: int = 600) -> str:
    # ~10,800 characters: three split chunks of 4096, the last (~2,600 characters) is the validation split.
    path.write_text("".join(f"line {i:05d}: the quick brown fox\n" for i in range(lines)), encoding="utf-8")
    return str(path)


def test_block_size_beyond_the_validation_split_exits_2(tmp_path, capsys) -> None:
    corpus = _short_corpus(tmp_path / "c.txt")
    run = tmp_path / "r"
    code = main(
        [
            "train",
            "--training.out-dir",
            str(run),
            *TINY,
            "--data.corpus",
            corpus,
            "--model.block-size",
            "3000",
            "--parallel.nproc",
            "2",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "validation split holds" in err and "block_size 3000" in err and "Traceback" not in err
    assert not run.exists()


def test_resume_with_an_edited_corpus_exits_2(tmp_path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    _short_corpus(corpus)
    run = tmp_path / "r"
    assert train(run, "--data.corpus", str(corpus), "--training.steps", "2") == 0
    before = (run / METRICS_NAME).read_text()
    _short_corpus(corpus, lines=601)
    assert main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "4"]) == 2
    assert "the corpus changed" in capsys.readouterr().err
    assert (run / METRICS_NAME).read_text() == before


def test_config_file_flags_and_resume_layers(tmp_path) -> None:
    """defaults < the run's saved config.toml (--resume) < --config FILE < flags, through main()."""
    from mixprec.lab.config import config_from_toml

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[optimizer]\nlr = 0.02\nname = "sgd"\n[training]\nsteps = 2\nseed = 7\n')
    run = tmp_path / "r"
    assert (
        main(["train", "--training.out-dir", str(run), "--config", str(cfg_file), *TINY, "--training.seed", "3"]) == 0
    )
    saved = config_from_toml(str(run / "config.toml"))
    # TINY sets --optimizer.lr 0.01: the flag wins over the file's 0.02; the file's steps and optimizer win over
    # the defaults.
    got = (saved["training"]["steps"], saved["optimizer"]["lr"], saved["optimizer"]["name"], saved["training"]["seed"])
    assert got == (2, 0.01, "sgd", 3)
    # Resume: the saved config is the base, a --config file above it, flags on top.
    more = tmp_path / "more.toml"
    more.write_text("[training]\nsteps = 3\neval_interval = 2\n")
    assert (
        main(["train", "--training.out-dir", str(run), "--resume", "--config", str(more), "--training.steps", "4"]) == 0
    )
    saved = config_from_toml(str(run / "config.toml"))
    got = (saved["training"]["steps"], saved["training"]["eval_interval"], saved["optimizer"]["lr"])
    assert (*got, saved["training"]["seed"]) == (4, 2, 0.01, 3)
    assert [r["step"] for r in rows_of(run)] == [0, 1, 2, 3]


def test_final_eval_loss_is_that_of_the_final_model(tmp_path) -> None:
    """The last step evaluates after its update: summary.json's final_eval_loss must equal, bit for bit, an
    evaluation of the checkpoint's weights (same process, same thread count, same fp64 sum)."""
    from mixprec.lab.build import build_model
    from mixprec.lab.config import config_from_toml, merge_config
    from mixprec.lab.corpus import load_corpus
    from mixprec.lab.train import evaluate

    run = tmp_path / "r"
    assert train(run, "--training.steps", "3", "--training.eval-interval", "10") == 0
    rows = rows_of(run)
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [0, 2]
    cfg = merge_config(config_from_toml(str(run / "config.toml")))
    corpus = load_corpus(cfg.data.corpus)
    model = build_model(cfg, corpus.vocab_size, torch.device("cpu"))
    initial = evaluate(model, corpus, cfg, rank=0, world_size=1, device=torch.device("cpu"))
    assert initial == rows[0]["eval_loss"]  # step 0 evaluates before its update
    model.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)["model"])
    final = evaluate(model, corpus, cfg, rank=0, world_size=1, device=torch.device("cpu"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_eval_loss"] == final == rows[-1]["eval_loss"]
    assert final != initial


# ---------------------------------------------------------------- runs that diverge (exit 1, a message)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_static_scaler_divergence_stops_with_a_message_and_nan_is_null(tmp_path, capfd, nproc) -> None:
    """lr 1e30 blows the weights up after the first step: the loss becomes NaN and every later step skips. With
    no dynamic scaler the run stops after max_consecutive_skips, exit 1, one line, no traceback. metrics.jsonl
    stays strict JSON: NaN is written as null and named under "nonfinite"."""
    run = tmp_path / "r"
    assert (
        train(
            run,
            "--parallel.nproc",
            nproc,
            "--training.steps",
            "20",
            "--optimizer.lr",
            "1e30",
            "--training.max-consecutive-skips",
            "3",
        )
        == 1
    )
    err = capfd.readouterr().err  # capfd: the forked ranks write to the inherited file descriptor
    assert "3 consecutive steps" in err and "max_consecutive_skips = 3" in err and "Traceback" not in err
    if nproc == "2":  # every rank saw the same (agreed) skips and stopped on its own: exit code 1, not a peer's
        assert "exited with code 1;" in err
    rows = rows_of(run)
    assert len(rows) == 4 and [r["skipped"] for r in rows] == [False, True, True, True]
    assert all(math.isnan(r["loss"]) for r in rows[1:])
    raw = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
           for line in (run / METRICS_NAME).read_text().splitlines()]  # fmt: skip
    assert raw[1]["loss"] is None and raw[1]["nonfinite"]["loss"] == "nan"
    assert "nonfinite" not in raw[0]


def test_dynamic_scaler_stuck_at_its_floor_stops_with_a_message(tmp_path, capsys) -> None:
    """fp16 with a dynamic scaler: NaN gradients back the scale off 4 -> 2 -> 1 (the floor), then after
    scale_min_patience overflowing steps there LossScaleFloorError stops the run: exit 1, no traceback."""
    run = tmp_path / "r"
    args = ["--model.precision", "fp16", "--optimizer.lr", "1e30", "--scaler.init-scale", "4", "--scaler.min-scale",
            "1",
            "--scaler.min-patience", "2", "--training.steps", "20"]  # fmt: skip
    assert train(run, *args) == 1
    err = capsys.readouterr().err
    assert "mixprec train: error:" in err and "Traceback" not in err
    scales = [r["loss_scale"] for r in rows_of(run)]
    assert scales[0] == 4.0 and 1.0 in scales and len(scales) < 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_autocast_run(tmp_path, precision) -> None:
    """The GPU path: real autocast, parameters and checkpoint in the low precision, fp16 with cuBLAS's reduced-
    precision split-K reduction switched off (the docstring's fp32-accumulation promise)."""
    run = tmp_path / "gpu"
    assert train(run, "--training.device", "cuda", "--model.precision", precision, "--training.steps", "4") == 0
    rows = rows_of(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert all(t.dtype == low for t in state["model"].values())
    assert json.loads((run / "summary.json").read_text())["device"].startswith("cuda")
    if precision == "fp16":
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False


def test_a_run_ending_on_nan_writes_strict_json_summary(tmp_path, capsys) -> None:
    """max_consecutive_skips 0 never stops: the run finishes with a NaN loss, and summary.json stays strict JSON
    (null + "nonfinite") while launch's reader gives the NaN back."""
    from mixprec.lab.launch import read_summary

    run = tmp_path / "r"
    assert train(run, "--training.steps", "3", "--optimizer.lr", "1e30", "--training.max-consecutive-skips", "0") == 0
    assert "final loss nan" in capsys.readouterr().out
    raw = json.loads((run / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert raw["final_loss"] is None and raw["nonfinite"]["final_loss"] == "nan"
    assert math.isnan(read_summary(str(run))["final_loss"]) and raw["skipped_steps"] == 2


@pytest.mark.parametrize(
    "extra",
    [
        ["--parallel.reduce", "fp8", "--parallel.fp8-format", "e5m2", "--parallel.error-feedback"],
        ["--parallel.reduce", "auto", "--parallel.link-gbps", "0.5"],
    ],
)
def test_fp8_and_auto_reductions_train(tmp_path, extra) -> None:
    """The compressed reductions beyond uint8 run from the CLI; a resumed run continues them bit for bit."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--parallel.nproc", "2", "--model.precision", "fp32", *extra]
    assert train(full, *common, "--training.steps", "4") == 0
    assert train(part, *common, "--training.steps", "2") == 0
    assert train(part, *common, "--training.steps", "4", "--resume") == 0

    # Training numerics bit for bit (the 2-step run also evaluated at its own last step).
    def train_numerics(rows: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss"], r["loss_scale"], r["skipped"], r["grad_norm"]) for r in rows]

    assert train_numerics(rows_of(part)) == train_numerics(rows_of(full))
    assert rows_of(full)[-1]["loss"] < rows_of(full)[0]["loss"]
    config = (full / "config.toml").read_text()
    assert f'reduce = "{extra[1]}"' in config


def test_fp8_options_are_checked_before_anything_is_written(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own choices check
        main(
            [
                "train",
                *TINY,
                "--parallel.reduce",
                "fp8",
                "--parallel.fp8-format",
                "e3m4",
                "--training.out-dir",
                str(tmp_path / "r"),
            ]
        )
    assert exc.value.code == 2 and "fp8-format" in capsys.readouterr().err
    assert main(["train", *TINY, "--parallel.nproc", "2", "--parallel.reduce", "native", "--parallel.error-feedback",
                 "--training.out-dir", str(tmp_path / "r")]) == 2  # fmt: skip
    assert "error_feedback applies to the compressed reductions only" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                *TINY,
                "--parallel.reduce",
                "auto",
                "--parallel.link-gbps",
                "-1",
                "--training.out-dir",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    assert "link_gbps" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
