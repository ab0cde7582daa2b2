"""Simulated data parallelism: the reduction models against the real collectives, a simulated run against the
real ``--nproc P`` run bit for bit, resume, and bad input refused before anything is written."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mixprec.cli.main import main
from mixprec.comm.models import binary_tree_sum, gloo_ring_sum
from mixprec.lab.metrics import METRICS_NAME, read_rows
from mixprec.testing import run_distributed

# 1 layer, width 16, 16 characters of context: ~7k parameters; GBS 24 divides over 2, 3 and 4 ranks.
TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "24", "--data.micro-batch-size", "2", "--data.eval-sequences", "8",
    "--training.eval-interval", "2",
    "--optimizer.lr", "0.01", "--training.steps", "4", "--training.checkpoint-interval", "0",
]  # fmt: skip


def numerics(run_dir) -> list[tuple]:
    rows = read_rows(os.path.join(run_dir, METRICS_NAME))
    return [(r["step"], r["loss"], r["eval_loss"], r["loss_scale"], r["skipped"], r["grad_norm"]) for r in rows]


def train(run_dir, *args: str) -> int:
    return main(["train", "--training.out-dir", str(run_dir), *TINY, *args])


def _gloo_all_reduce(rank: int, world: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    # Magnitudes spread over ~2**8 so that the order of the additions shows in the low bits.
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-4, 4, (n,), generator=g).float())).to(dtype)
    mine = x.clone()
    dist.all_reduce(x)
    return mine, x


def _gloo_all_reduce_marked(rank: int, world: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Element i is 1 on rank i mod P and half an ulp of 1 elsewhere: its sum is 1 + ulp exactly when the rank
    # holding the 1 adds last (e.g. at P = 3, rank c for chunk c), else 1: the result shows which chunk it is in.
    half_ulp = torch.finfo(dtype).eps / 2
    x = torch.where(torch.arange(n) % world == rank, 1.0, half_ulp).to(dtype)
    mine = x.clone()
    dist.all_reduce(x)
    return mine, x


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_model_is_gloos_all_reduce_bit_for_bit(world: int) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        for n in (1, 7, 1001):
            results = run_distributed(_gloo_all_reduce, world, n, dtype)
            rows = torch.stack([mine for mine, _ in results])
            model = gloo_ring_sum(rows)
            assert torch.equal(model, results[0][1]), (dtype, n)
    if world == 3:
        # Above 2P MiB gloo caps a segment at 1 MiB: 9 segments, not 6, and neither size divides evenly.
        for dtype, n in ((torch.bfloat16, 3_500_001), (torch.float64, 1_000_001)):
            results = run_distributed(_gloo_all_reduce_marked, world, n, dtype)
            model = gloo_ring_sum(torch.stack([mine for mine, _ in results]))
            assert torch.equal(model, results[0][1]), (dtype, n)
            # Every chunk's order differs, so at P >= 3 some element must disagree with a plain rank-order sum.
    if world >= 3:
        rows = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)[:world]
        # ring, chunk 0: (x2 + x1) + x0 = 2**-7 + 1 exact in bf16; rank order (1 + 2**-8) + 2**-8 rounds twice to 1
        assert float(gloo_ring_sum(rows)[0]) == 1.0 + 2.0**-7


def test_tree_rounds_pairwise() -> None:
    rows = torch.tensor([[1.0], [2.0**-8], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)
    # (1 + 2**-8) -> 1 (tie to even), (2**-8 + 2**-8) = 2**-7, 1 + 2**-7 exact
    assert float(binary_tree_sum(rows)[0]) == 1.0 + 2.0**-7


@pytest.mark.parametrize(
    ("world", "reduce", "precision", "extra"),
    [
        (2, "fp32_accumulate", "bf16", ()),
        (3, "fp32_accumulate", "bf16", ()),
        (4, "fp32_accumulate", "bf16", ()),
        (3, "uint8", "bf16", ()),
        (4, "uint8", "fp32", ()),
        (3, "native", "bf16", ()),
        (4, "native", "bf16", ()),
        (3, "fp32_accumulate", "fp16", ()),  # dynamic loss scale from 2**22: overflows, skipped steps, back-offs
        (2, "uint8", "fp32", ("--parallel.error-feedback",)),
        (3, "uint8", "bf16", ("--parallel.error-feedback",)),
        (2, "uint8_hierarchical", "fp32", ()),  # two nodes of one rank
        (4, "uint8_hierarchical", "bf16", ()),  # two nodes of two ranks
        (4, "uint8_hierarchical", "fp32", ("--parallel.error-feedback",)),
        (4, "fp32_accumulate_hierarchical", "bf16", ()),  # two nodes of two: two roundings to bf16
        (6, "fp32_accumulate_hierarchical", "bf16", ("--parallel.ranks-per-node", "3")),  # / 3 is inexact
        (3, "uint8", "bf16", ("--parallel.rounding", "stochastic")),  # each rank's Philox stream
        (4, "uint8_hierarchical", "fp32", ("--parallel.rounding", "stochastic", "--parallel.error-feedback")),
        (2, "fp8", "bf16", ("--parallel.fp8-format", "e5m2")),
        (2, "nvfp4", "fp32", ("--parallel.rounding", "stochastic")),
        pytest.param(4, "mxfp8_hierarchical", "bf16", ("--parallel.error-feedback",), marks=pytest.mark.slow),
    ],
)
def test_simulated_run_is_the_real_run_bit_for_bit(
    tmp_path, world: int, reduce: str, precision: str, extra: tuple[str, ...]
) -> None:
    common = ("--parallel.reduce", reduce, "--model.precision", precision, *extra)
    if precision == "fp16":
        common += ("--scaler.kind", "dynamic", "--scaler.init-scale", str(2.0**22), "--training.steps", "8")
    assert train(tmp_path / "real", "--parallel.nproc", str(world), *common) == 0
    assert train(tmp_path / "sim", "--parallel.simulate-dp", str(world), *common) == 0
    real, sim = numerics(tmp_path / "real"), numerics(tmp_path / "sim")
    assert len(real) == (8 if precision == "fp16" else 4)
    if precision == "fp16":
        assert any(r[4] for r in real) and not all(r[4] for r in real)  # some steps skipped, some taken
    assert sim == real  # losses, validation losses and gradient norms, every bit
    if "stochastic" in extra:  # the random streams do change the run
        nearest = tuple(a for a in common if a not in ("--parallel.rounding", "stochastic"))
        assert train(tmp_path / "nearest", "--parallel.simulate-dp", str(world), *nearest) == 0
        assert numerics(tmp_path / "nearest")[1:] != sim[1:]
    elif "--parallel.error-feedback" in extra:  # the residuals do change the run
        plain = tuple(a for a in common if a != "--parallel.error-feedback")
        assert train(tmp_path / "plain", "--parallel.simulate-dp", str(world), *plain) == 0
        assert numerics(tmp_path / "plain")[1:] != sim[1:]


def test_simulated_mxfp8_run_ends_with_the_real_runs_parameters(tmp_path) -> None:
    common = ("--parallel.reduce", "mxfp8", "--model.precision", "bf16", "--training.steps", "3")
    assert train(tmp_path / "real", "--parallel.nproc", "2", *common) == 0
    assert train(tmp_path / "sim", "--parallel.simulate-dp", "2", *common) == 0
    real, sim = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in ("real", "sim"))
    assert real["model"].keys() == sim["model"].keys()
    for name, tensor in real["model"].items():
        assert torch.equal(sim["model"][name], tensor), name
    assert numerics(tmp_path / "sim") == numerics(tmp_path / "real")
    # The wire does change the run: fp32_accumulate (no quantization) ends elsewhere.
    assert train(tmp_path / "fp32acc", "--parallel.simulate-dp", "2", *common[2:]) == 0
    plain = torch.load(tmp_path / "fp32acc" / "checkpoint.pt", weights_only=True)
    assert any(not torch.equal(plain["model"][k], v) for k, v in real["model"].items())


def test_simulated_headroom_telemetry_is_the_real_runs(tmp_path) -> None:
    common = ("--parallel.reduce", "fp32_accumulate", "--model.precision", "fp16", "--training.headroom-interval", "2")
    assert train(tmp_path / "real", "--parallel.nproc", "2", *common) == 0
    assert train(tmp_path / "sim", "--parallel.simulate-dp", "2", *common) == 0
    real, sim = (read_rows(os.path.join(tmp_path / d, METRICS_NAME)) for d in ("real", "sim"))
    headroom = [(r["step"], r.get("headroom")) for r in real]
    assert [h for _, h in headroom if h is not None]  # captured at step 2
    assert [(r["step"], r.get("headroom")) for r in sim] == headroom


@pytest.mark.parametrize(
    "common",
    [
        ("--parallel.simulate-dp", "3", "--model.precision", "bf16", "--parallel.reduce", "native"),
        (
            "--parallel.simulate-dp",
            "2",
            "--model.precision",
            "fp32",
            "--parallel.reduce",
            "uint8",
            "--parallel.error-feedback",
        ),  # residuals saved
        (
            "--parallel.simulate-dp",
            "2",
            "--model.precision",
            "fp32",
            "--parallel.reduce",
            "uint8",
            "--parallel.rounding",
            "stochastic",
        ),
    ],
)
def test_simulated_run_resumes_bit_for_bit(tmp_path, common: tuple[str, ...]) -> None:
    assert train(tmp_path / "whole", *common) == 0
    assert train(tmp_path / "split", *common, "--training.steps", "2") == 0
    assert main(["train", "--training.out-dir", str(tmp_path / "split"), "--resume", "--training.steps", "4"]) == 0
    split, whole = numerics(tmp_path / "split"), numerics(tmp_path / "whole")
    # The 2-step run evaluated its last step (1) after the update; everything else is the same, every bit.
    assert [r[:2] + r[3:] for r in split] == [r[:2] + r[3:] for r in whole]
    assert split[2:] == whole[2:]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--parallel.simulate-dp", "-1"), "simulate_dp"),
        (("--parallel.simulate-dp", "5"), "global_batch_size"),  # 24 sequences over 5 ranks
        (("--parallel.simulate-dp", "5000"), "4096"),
        (("--parallel.simulate-dp", "2", "--parallel.nproc", "2"), "nproc"),
        (
            ("--parallel.simulate-dp", "2", "--parallel.reduce", "auto", "--parallel.link-gbps", "1"),
            "reduce",
        ),  # its choice is timed
        (
            (
                "--parallel.simulate-dp",
                "2",
                "--parallel.reduce",
                "fp32_accumulate",
                "--parallel.rounding",
                "stochastic",
            ),
            "stochastic",
        ),
        (("--parallel.simulate-dp", "2", "--parallel.sharded-optimizer"), "sharded_optimizer"),
        (("--parallel.simulate-dp", "1", "--parallel.reduce", "uint8"), "simulate_dp 1"),
        (("--parallel.simulate-dp", "1", "--parallel.reduce", "uint8_hierarchical"), "simulate_dp 1"),
        (
            (
                "--parallel.simulate-dp",
                "4",
                "--parallel.reduce",
                "uint8_hierarchical",
                "--parallel.ranks-per-node",
                "3",
            ),
            "ranks_per_node",
        ),
        (("--parallel.simulate-dp", "2", "--parallel.simulate-algorithm", "butterfly"), "simulate_algorithm"),
        (("--parallel.simulate-dp", "2", "--training.device", "cuda"), "CPU"),
    ],
)
def test_bad_simulation_input_exits_2_before_writing(tmp_path, capsys, args: tuple[str, ...], words: str) -> None:
    out = tmp_path / "run"
    assert train(out, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()
