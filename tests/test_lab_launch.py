"""The launcher's blame, atomic checkpoints and their stale temporaries, and the strict-JSON metrics log."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import time

import pytest
import torch

from mixprec.lab.checkpoint import load_checkpoint, remove_stale_temporaries, save_checkpoint
from mixprec.lab.launch import PEER_FAILURE_EXIT, TrainingFailed, _watch
from mixprec.lab.metrics import NONFINITE_KEY, encode_row, read_rows


def _exit_after(delay: float, code: int) -> None:
    time.sleep(delay)
    os._exit(code)


def _procs(plan: list[tuple[float, int]]) -> list:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_exit_after, args=p, daemon=True) for p in plan]
    for p in procs:
        p.start()
    return procs


def test_watch_blames_the_rank_that_failed_on_its_own_not_the_first_to_exit() -> None:
    """Rank 0 exits first, as a victim (PEER_FAILURE_EXIT); rank 1 crashes with 13 a moment later: rank 1 is
    the one named."""
    procs = _procs([(0.0, PEER_FAILURE_EXIT), (0.5, 13)])
    with pytest.raises(TrainingFailed) as info:
        _watch(procs, timeout=5.0)
    message = str(info.value)
    assert message.startswith("rank 1 exited with code 13;")
    assert "rank 0: stopped, a peer failed" in message


@pytest.mark.slow  # GRACE_S (5 s) before the launcher terminates the "hung" rank
def test_watch_blames_the_hung_rank_when_every_exit_was_a_peer_failure() -> None:
    procs = _procs([(0.0, PEER_FAILURE_EXIT), (3600.0, 0)])  # rank 1 "hangs"; the launcher terminates it
    start = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        _watch(procs, timeout=5.0)
    assert time.monotonic() - start < 60  # GRACE_S + SIGTERM; generous for a loaded machine
    assert str(info.value).startswith("rank(s) 1 stopped responding (hung)")
    assert procs[1].exitcode is not None


def test_watch_reports_a_signal() -> None:
    procs = _procs([(3600.0, 0), (0.0, 0)])
    procs[1].join()
    procs[0].kill()
    with pytest.raises(TrainingFailed, match=r"^rank 0 was killed by signal 9;"):
        _watch(procs, timeout=5.0)


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
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--eval-interval", "0"]  # fmt: skip
    assert main(["train", "--out-dir", str(run), *tiny, "--steps", "1"]) == 0
    (run / "checkpoint.pt.k1ll3d.tmp").write_bytes(b"torn")
    assert main(["train", "--out-dir", str(run), "--resume", "--steps", "2"]) == 0
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


class _ExitsBetweenReads:
    """A rank that is still running at the first read of its exit code and has failed at every later read."""

    def __init__(self, code: int) -> None:
        self.code, self.reads = code, 0
        read_end, write_end = mp.Pipe(duplex=False)
        write_end.close()
        self._conn = read_end  # at EOF: always ready
        self.sentinel = read_end.fileno()

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else self.code

    def join(self, timeout: float | None = None) -> None:
        pass


def test_watch_sees_ranks_that_fail_between_two_reads_of_their_exit_code() -> None:
    """Both ranks exit with 1 just after the launcher looked at them: it must report the failure, not return as
    if the run had finished."""
    with pytest.raises(TrainingFailed, match=r"^rank 0 exited with code 1;"):
        _watch([_ExitsBetweenReads(1), _ExitsBetweenReads(1)], timeout=5.0)
