"""``mixprec train --model.linear-mode mxfp8|nvfp4``: the block-scaled recipes of EmulatedLinear in the training
loop. Their shapes are checked up front; NVFP4's stochastic rounding draws from a stream seeded by (seed, step,
rank), so a resumed run and a simulated rank reproduce the uninterrupted real run bit for bit."""

from __future__ import annotations

import math
import os
import warnings

import pytest

from mixprec.cli.main import main
from mixprec.lab.metrics import METRICS_NAME, read_rows

# 1 layer, width 32 (one MXFP8 block, two NVFP4 tiles), 16 characters of context, 2 x 16 = 32 tokens per
# microbatch: whole blocks for both recipes.
TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "32", "--model.block-size", "16",
    "--data.global-batch-size", "4", "--data.micro-batch-size", "2", "--data.eval-sequences", "4",
    "--training.eval-interval", "2", "--optimizer.lr", "0.01", "--training.checkpoint-interval", "0",
]  # fmt: skip


def train(run_dir, *args: str) -> int:
    return main(["train", "--training.out-dir", str(run_dir), *TINY, *args])


def numerics(run_dir) -> list[tuple]:
    rows = read_rows(os.path.join(run_dir, METRICS_NAME))
    return [(r["step"], r["loss"], r["eval_loss"], r["skipped"], r["grad_norm"]) for r in rows]


def test_each_recipe_trains_and_differs_from_fp32(tmp_path) -> None:
    assert train(tmp_path / "fp32", "--training.steps", "2") == 0
    plain = numerics(tmp_path / "fp32")
    for mode in ("mxfp8", "nvfp4"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert train(tmp_path / mode, "--training.steps", "2", "--model.linear-mode", mode) == 0
        # MXFP8 keeps the LM head (a vocabulary that is not a multiple of 32) in fp32 and says so; NVFP4 keeps it
        # by its recipe (arXiv 2509.25149), silently.
        kept = [w for w in caught if "kept" in str(w.message)]
        assert [("lm_head" in str(w.message)) for w in kept] == ([True] if mode == "mxfp8" else [])
        rows = numerics(tmp_path / mode)
        assert len(rows) == 2 and not any(r[3] for r in rows)
        assert all(math.isfinite(r[1]) and math.isfinite(r[4]) for r in rows)
        # Step 0's loss is the forward of the same initial weights: quantized operands change its low bits.
        assert rows[0][1] != plain[0][1] and abs(rows[0][1] - plain[0][1]) < 0.05, (mode, rows[0], plain[0])
        assert rows[1][4] != plain[1][4]


def test_nvfp4_resumed_run_is_the_whole_run_bit_for_bit(tmp_path) -> None:
    nvfp4 = ("--model.linear-mode", "nvfp4")
    assert train(tmp_path / "whole", *nvfp4, "--training.steps", "3") == 0
    assert train(tmp_path / "split", *nvfp4, "--training.steps", "2") == 0
    assert main(["train", "--training.out-dir", str(tmp_path / "split"), "--resume", "--training.steps", "3"]) == 0
    whole, split = numerics(tmp_path / "whole"), numerics(tmp_path / "split")
    # The 2-step run evaluated its last step (1) after the update: compare all but that evaluation.
    assert [r[:2] + r[3:] for r in split] == [r[:2] + r[3:] for r in whole]
    assert split[2:] == whole[2:]
    # The stream is the run's: another seed draws other roundings (and batches) from step 0 on.
    assert train(tmp_path / "seed1", *nvfp4, "--training.steps", "1", "--training.seed", "1") == 0
    assert numerics(tmp_path / "seed1")[0][1] != whole[0][1]


@pytest.mark.slow
def test_nvfp4_simulated_ranks_draw_the_real_ranks_streams(tmp_path) -> None:
    common = ("--model.linear-mode", "nvfp4", "--training.steps", "2")
    assert train(tmp_path / "real", "--parallel.nproc", "2", *common) == 0
    assert train(tmp_path / "sim", "--parallel.simulate-dp", "2", *common) == 0
    assert numerics(tmp_path / "sim") == numerics(tmp_path / "real")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--model.linear-mode", "mxfp8", "--model.n-embd", "48", "--model.n-head", "2"), "model.n_embd (48)"),
        (("--model.linear-mode", "nvfp4", "--model.n-embd", "24", "--model.n-head", "2"), "model.n_embd (24)"),
        (("--model.linear-mode", "nvfp4", "--model.block-size", "12"), "data.micro_batch_size x model.block_size"),
        (("--model.linear-mode", "mxfp8", "--model.block-size", "8"), "multiple of 32"),
    ],
)
def test_recipe_shapes_are_checked_before_writing(tmp_path, capsys, args: tuple[str, ...], words: str) -> None:
    out = tmp_path / "run"
    assert train(out, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()
