"""Checkpoint files: checksums refuse damaged files in one line; unreadable files are a ValueError; a torn last
line of metrics.jsonl does not stop --resume."""

from __future__ import annotations

import os

import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.checkpoint import load_checkpoint, save_checkpoint

TINY = ["--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
        "--data.global-batch-size", "4",
        "--data.micro-batch-size", "2", "--training.eval-interval", "0", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize("content", [b"garbage", b"PK\x03\x04truncated zip"])
def test_unreadable_checkpoint_is_a_value_error(tmp_path, content: bytes) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    for mmap in (False, True):
        with pytest.raises(ValueError, match="not a readable mixprec train checkpoint"):
            load_checkpoint(str(path), mmap=mmap)


def _damage(path, where: float, *, zeros: int = 0) -> None:
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    if zeros:
        data[at : at + zeros] = bytes(zeros)
    else:
        data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", [0.01, 0.3, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("zeros", [0, 4096])
def test_a_flipped_byte_or_zeroed_block_anywhere_is_refused(tmp_path, where, zeros) -> None:
    path = tmp_path / "checkpoint.pt"
    state = {"step": 3, "format": 2, "w": torch.randn(8192), "m": {"a": torch.arange(100.0)}}
    save_checkpoint(state, str(path))
    assert torch.equal(load_checkpoint(str(path))["w"], state["w"])
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])  # still a plain torch file
    _damage(path, where, zeros=zeros)
    with pytest.raises(ValueError, match=r"(corrupt: its sha256 checksum does not match|not a readable)"):
        load_checkpoint(str(path))


def test_resume_from_a_damaged_checkpoint_exits_2_in_one_line(tmp_path, capsys) -> None:
    run = tmp_path / "r"
    assert main(["train", "--training.out-dir", str(run), *TINY, "--training.steps", "2"]) == 0
    _damage(run / "checkpoint.pt", 0.5)
    capsys.readouterr()
    assert main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "checksum does not match" in err and len(err.strip().splitlines()) == 1


def test_resume_after_a_torn_metrics_line(tmp_path, capsys) -> None:
    """A crash while writing a metrics row leaves half a line: resume drops it (with a notice) and continues;
    the log then equals an uninterrupted run's."""
    whole, run = tmp_path / "whole", tmp_path / "r"
    assert main(["train", "--training.out-dir", str(whole), *TINY, "--training.steps", "4"]) == 0
    assert main(["train", "--training.out-dir", str(run), *TINY, "--training.steps", "2"]) == 0
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "loss": 4.12')  # torn: no end, no newline
    capsys.readouterr()
    assert main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "4"]) == 0
    assert "dropped a torn last line" in capsys.readouterr().err

    def numbers(d):
        from mixprec.lab.metrics import read_rows

        return [(r["step"], r["loss"], r["grad_norm"]) for r in read_rows(os.path.join(d, "metrics.jsonl"))]

    assert numbers(run) == numbers(whole)
