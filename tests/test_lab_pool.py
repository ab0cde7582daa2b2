"""The worker pool of the studies and the demo: its workers die with the process that started them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
_TWO_LONG_RUNS = """
import sys
from mixprec.lab.config import merge_config
from mixprec.lab.pool import train_all

if __name__ == "__main__":
    model = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}
    configs = [
        merge_config({"model": model, "training": {"out_dir": f"{sys.argv[1]}/run{k}", "steps": 100000,
                      "eval_interval": 0, "seed": k}})
        for k in range(2)
    ]
    train_all(configs, workers=2)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _workers(pid: int) -> list[int]:
    """The pool's workers among the children of ``pid`` (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        children = [int(c) for c in fh.read().split()]
    found = []
    for child in children:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{child}/cmdline", "rb") as fh:
            if b"resource_tracker" not in fh.read():
                found.append(child)
    return found


@pytest.mark.slow  # two spawned workers import torch and start training
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_parent(tmp_path) -> None:
    """kill -9 of the process running train_all while both workers train (for minutes): they go with it."""
    script = tmp_path / "two_runs.py"
    script.write_text(_TWO_LONG_RUNS)
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if all((tmp_path / f"run{k}" / "metrics.jsonl").exists() for k in range(2)):
                break
            time.sleep(0.2)
        workers = _workers(proc.pid)
        assert len(workers) == 2, (workers, proc.poll())
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_state(w) not in (None, "Z") for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_state(w) in (None, "Z") for w in workers), "the workers outlived their killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
