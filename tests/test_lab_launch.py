"""Atomic checkpoints and their stale temporaries, the strict-JSON metrics log, and the torchrun path."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from mixprec.lab.checkpoint import load_checkpoint, remove_stale_temporaries, save_checkpoint
from mixprec.lab.metrics import NONFINITE_KEY, encode_row, read_rows


def test_checkpoint_write_failing_midway_keeps_the_old_one_and_no_temporary(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint({"step": 1, "w": torch.arange(4.0)}, path)
    real_save = torch.save

    def broken_save(obj, fh, *args, **kwargs):
        real_save(obj, fh, *args, **kwargs)  # the bytes are in the temporary file...
        fh.flush()
        raise OSError("disk full")  # ...when the write fails, before the rename

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 2, "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(4.0))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_stale_temporaries_are_removed(tmp_path) -> None:
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint({"step": 1}, path)
    stale = [tmp_path / "checkpoint.pt.abc123.tmp", tmp_path / "checkpoint.pt.x.tmp"]
    for f in stale:
        f.write_bytes(b"torn")
    (tmp_path / "other.tmp").write_bytes(b"not ours")
    assert sorted(remove_stale_temporaries(path)) == sorted(str(f) for f in stale)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "other.tmp"]
    assert load_checkpoint(path)["step"] == 1


def test_resume_removes_a_killed_writers_temporary(tmp_path) -> None:
    from mixprec.cli.main import main

    run = tmp_path / "r"
    tiny = ["--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
            "--data.global-batch-size", "4",
            "--data.micro-batch-size", "2", "--training.eval-interval", "0"]  # fmt: skip
    assert main(["train", "--training.out-dir", str(run), *tiny, "--training.steps", "1"]) == 0
    (run / "checkpoint.pt.k1ll3d.tmp").write_bytes(b"torn")
    assert main(["train", "--training.out-dir", str(run), "--resume", "--training.steps", "2"]) == 0
    assert not (run / "checkpoint.pt.k1ll3d.tmp").exists()


def test_metrics_rows_are_strict_json_and_read_back(tmp_path) -> None:
    row = {"step": 3, "loss": math.nan, "grad_norm": math.inf, "eval_loss": None, "scale": -math.inf, "ok": 1.5}
    line = encode_row(row)
    raw = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert raw["loss"] is None and raw["grad_norm"] is None and raw["scale"] is None and raw["eval_loss"] is None
    assert raw[NONFINITE_KEY] == {"loss": "nan", "grad_norm": "inf", "scale": "-inf"}
    path = tmp_path / "m.jsonl"
    # An old log with bare NaN (Python's json default) still reads.
    path.write_text(line + "\n\n" + json.dumps({"step": 4, "loss": math.nan}) + "\n")
    back = list(read_rows(str(path)))
    assert math.isnan(back[0]["loss"]) and back[0]["grad_norm"] == math.inf and back[0]["scale"] == -math.inf
    assert back[0]["eval_loss"] is None and back[0]["ok"] == 1.5 and NONFINITE_KEY not in back[0]
    assert back[1]["step"] == 4 and math.isnan(back[1]["loss"])


@pytest.mark.parametrize(
    ("text", "match"),
    [("[1, 2]\n", "expected a JSON object"), ("{oops\n", "not a JSON object"),
     ('{"step": 1, "nonfinite": {"loss": "huge"}}\n', "'nonfinite' must map")],
)  # fmt: skip
def test_metrics_reader_names_the_bad_line(tmp_path, text, match) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n' + text)
    with pytest.raises(ValueError, match=match) as info:
        list(read_rows(str(path)))
    assert f"{path}:2:" in str(info.value)


def test_resume_accepts_a_checkpoint_from_before_a_field_existed() -> None:
    """A field added later (absent from an older checkpoint's config) counts as its default, the old behaviour;
    a field that is present and differs is still refused."""
    from mixprec.lab.checkpoint import check_resume_compatible
    from mixprec.lab.config import TrainConfig, TrainingConfig

    cfg = TrainConfig()
    saved = cfg.to_dict()
    del saved["training"]["max_consecutive_skips"], saved["scaler"]["min_patience"]
    check_resume_compatible(saved, cfg)
    with pytest.raises(ValueError, match="max_consecutive_skips: checkpoint 20, now 5"):
        check_resume_compatible(saved, TrainConfig(training=TrainingConfig(max_consecutive_skips=5)))


def test_torchrun_ranks_meet_at_a_barrier_before_rank_0_writes_the_run_dir(tmp_path, monkeypatch) -> None:
    """Under torchrun every rank checks the run directory before init_process_group; rank 0 must not write
    config.toml until all of them are past init (NCCL's init does not wait for every rank): the order of calls
    on rank 0 must be init, barrier, prepare_run_dir. One real gloo rank, torchrun's environment."""
    import socket

    import torch.distributed as dist

    import mixprec.lab.launch as launch_mod
    from mixprec.lab.config import merge_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls: list[str] = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(dist, "init_process_group", spy("init", dist.init_process_group))
    monkeypatch.setattr(dist, "barrier", spy("barrier", dist.barrier))
    monkeypatch.setattr(launch_mod, "prepare_run_dir", spy("prepare", launch_mod.prepare_run_dir))
    monkeypatch.setattr(launch_mod, "train_rank", lambda *a, **k: calls.append("train"))
    cfg = merge_config(
        {
            "training": {"out_dir": str(tmp_path / "r")},
            "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
        }
    )
    launch_mod.launch(cfg)
    assert calls[:4] == ["init", "barrier", "prepare", "barrier"] and calls[-1] == "train"
    assert (tmp_path / "r" / "config.toml").exists()


def test_the_timeout_reaches_every_group_mixprec_creates(tmp_path, monkeypatch) -> None:
    """parallel.timeout goes into init_process_group, so mixprec.comm.groups.new_group (which the hierarchical
    topology and the hook's extra group use) inherits it instead of the backend's 30-minute default."""
    from datetime import timedelta

    import mixprec.lab.launch as launch_mod
    from mixprec.comm.groups import group_timeout, new_group
    from mixprec.lab.config import merge_config

    seen: dict[str, timedelta | None] = {}

    def fake_train_rank(*args, **kwargs):
        seen["default"] = group_timeout()
        seen["new_group"] = group_timeout(new_group([0]))

    monkeypatch.setattr(launch_mod, "train_rank", fake_train_rank)
    cfg = merge_config({"parallel": {"timeout": 7.0}})
    launch_mod.run_rank(
        cfg, rank=0, world_size=1, local_rank=0, device_type="cpu", resume=False, progress=False,
        init_method=f"file://{tmp_path / 'store'}",
    )  # fmt: skip
    assert seen == {"default": timedelta(seconds=7), "new_group": timedelta(seconds=7)}
