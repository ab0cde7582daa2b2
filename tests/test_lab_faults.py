"""``mixprec train`` against a hostile environment: the launcher killed or terminated, a rank stopped, an out_dir
that cannot be written, a file-size limit while writing a checkpoint. Each runs the real command in a subprocess."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mixprec.lab.checkpoint import load_checkpoint

TINY = ["--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
        "--data.global-batch-size", "4",
        "--data.micro-batch-size", "2", "--training.eval-interval", "0", "--no-progress"]  # fmt: skip
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _command(run_dir, *args: str) -> list[str]:
    return [sys.executable, "-m", "mixprec", "train", "--training.out-dir", str(run_dir), *TINY, *args]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_long_run(run_dir, **env: str) -> subprocess.Popen:
    """A 2-rank run that would take minutes, in its own process group; returns once a checkpoint exists."""
    proc = subprocess.Popen(
        _command(run_dir, "--parallel.nproc", "2", "--training.steps", "100000", "--training.checkpoint-interval", "2"),
        env=_env(**env),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not reach its first checkpoint: {proc.communicate()}")
        time.sleep(0.2)
    return proc


def _wait_group_gone(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _group_alive(pgid)


def test_sigterm_to_the_launcher_stops_the_run_like_sigint(tmp_path) -> None:
    run = tmp_path / "r"
    proc = _start_long_run(run)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert "terminated (SIGTERM); the last checkpoint is intact" in err and "Traceback" not in err
        assert _wait_group_gone(proc.pid, 10), "ranks outlived the launcher"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert load_checkpoint(str(run / "checkpoint.pt"))["step"] >= 2


def test_ranks_die_with_a_killed_launcher_and_the_next_run_removes_its_rendezvous(tmp_path, monkeypatch) -> None:
    """kill -9 of the launcher: its ranks die with it, its rendezvous directory stays behind, and the next run
    (here, in this process) removes it when it starts."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start_long_run(tmp_path / "r", TMPDIR=str(tmp))
    try:
        proc.kill()
        proc.wait(10)
        assert _wait_group_gone(proc.pid, 5), "ranks kept running after their launcher was killed"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    left = [name for name in os.listdir(tmp) if name.startswith("mixprec-")]  # torch may leave its own caches
    assert len(left) == 1 and left[0].startswith("mixprec-train-"), left
    from mixprec.cli.main import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert (
        main(
            [
                "train",
                "--training.out-dir",
                str(tmp_path / "next"),
                *TINY,
                "--parallel.nproc",
                "2",
                "--training.steps",
                "1",
            ]
        )
        == 0
    )
    assert not [name for name in os.listdir(tmp) if name.startswith("mixprec-")]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda tmp: tmp / "file", "is not a directory"),
        (lambda tmp: tmp / "file" / "sub", "is a file, not a directory"),
        (lambda tmp: "/proc/sys/mixprec-run", "cannot be created in '/proc/sys'"),
        (lambda tmp: "/proc/sys", "is not writable"),
    ],
)
def test_an_out_dir_that_cannot_be_written_exits_2_in_one_line(tmp_path, make, words) -> None:
    (tmp_path / "file").write_text("not a directory")
    out = make(tmp_path)
    done = subprocess.run(
        _command(out, "--training.steps", "1"), env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_file_size_limit_while_checkpointing_is_one_line_not_a_traceback(tmp_path) -> None:
    """The checkpoint (about 100 KiB) exceeds a 64 KiB file-size limit: one line, exit 1, no temporary left."""
    run = tmp_path / "r"
    done = subprocess.run(
        _command(run, "--training.steps", "2"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size,
    )
    assert done.returncode == 1, done.stderr
    assert "cannot write the checkpoint" in done.stderr and "File too large" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(run)) == ["config.toml", "metrics.jsonl"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(c) for c in fh.read().split()]


def _wait_blocked(pid: int, seconds: float) -> None:
    """Wait (up to ``seconds``) until the main thread of ``pid`` was seen sleeping three times in a row: most
    likely blocked in a collective, where a SIGSTOP leaves its peers mid-reduction: the closed pairs of the
    two-stage case below then show more often than after a SIGSTOP at any moment (about 2 runs in 3, not 1 in 3)."""
    deadline, seen = time.monotonic() + seconds, 0
    while seen < 3 and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        seen = seen + 1 if state == "S" else 0


# The two-stage reduction's second stage fails on healthy ranks with "Application timeout caused pair closure": they
# must not be blamed (nor print a traceback) for the rank that stopped.
HIERARCHICAL = ["--parallel.nproc", "4", "--data.micro-batch-size", "1", "--parallel.ranks-per-node", "2",
                "--parallel.reduce", "fp32_accumulate_hierarchical"]  # fmt: skip


@pytest.mark.slow  # the peers' timeout, the launcher's grace period: about 20 s each
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.nproc", "2"],
        HIERARCHICAL,
    ],
    ids=["flat", "hierarchical"],
)
def test_a_stopped_rank_is_detected_by_the_timeout_and_blamed(tmp_path, layout) -> None:
    """SIGSTOP on rank 1 (a frozen machine, a debugger): its peers' next collective times out after --timeout, the
    launcher terminates the stopped rank and names it."""
    from mixprec.lab.launch import GRACE_S

    timeout = 4.0
    run = tmp_path / "r"
    proc = subprocess.Popen(
        _command(
            run,
            *layout,
            "--training.steps",
            "100000",
            "--training.checkpoint-interval",
            "2",
            "--parallel.timeout",
            str(timeout),
        ),
        env=_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(run / "checkpoint.pt") and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) == int(layout[1]), ranks
        _wait_blocked(ranks[1], 30)
        os.kill(ranks[1], signal.SIGSTOP)
        start = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - start
        assert proc.returncode == 1, err
        assert "rank(s) 1 stopped responding (hung)" in err and "Traceback" not in err
        # timeout, then GRACE_S, SIGTERM and at most 5 s to SIGKILL; 15 s for a loaded machine.
        assert elapsed < timeout + GRACE_S + 5 + 15
        assert _wait_group_gone(proc.pid, 10)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
    assert load_checkpoint(str(run / "checkpoint.pt"))["step"] >= 2


def test_an_interrupt_while_the_ranks_start_stops_the_started_ones(tmp_path, monkeypatch) -> None:
    """A SIGINT/SIGTERM that lands between two Process.start() calls: the started ranks are stopped and the
    interrupt propagates (it used to end in an AttributeError from terminating an unstarted process)."""
    import multiprocessing as mp

    from mixprec.lab import launch as launch_module
    from mixprec.lab.config import TrainConfig

    real = mp.get_context("fork")
    started: list = []

    class Ctx:
        @staticmethod
        def get_start_method() -> str:
            return "fork"

        class Process(real.Process):  # type: ignore[name-defined, misc]
            def start(self) -> None:
                if started:
                    raise KeyboardInterrupt  # the signal arrives before the second rank starts
                super().start()
                started.append(self)

    monkeypatch.setattr(launch_module.mp, "get_context", lambda method: Ctx)
    monkeypatch.setattr(launch_module, "_child", lambda *args: time.sleep(60))
    cfg = TrainConfig.from_fields({"nproc": 2, "out_dir": str(tmp_path / "r")})
    with pytest.raises(KeyboardInterrupt):
        launch_module._spawn(cfg, "cpu", False)
    assert len(started) == 1 and not started[0].is_alive()
