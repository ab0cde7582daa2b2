"""The collective audit: validation before any work, error statistics against bounds from unit roundoff, the
determinism / size-invariance / agreement flags (shown not vacuous by injected faults), the CLI and its files."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import mixprec.lab.studies.audit as audit
from mixprec.cli.main import main
from mixprec.lab.studies.audit import AuditConfig, format_table, parse_size, run_audit, verdicts

SMALL = AuditConfig(min_bytes=4096, max_bytes=16384)  # sizes 4 KiB and 16 KiB: seconds


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def test_parse_size():
    assert parse_size("4KiB") == 4096
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1m") == 1 << 20
    assert parse_size(4096) == 4096
    for bad in ("lots", "4XB", "0", ""):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown op 'all_gather'"):
        AuditConfig(ops=("all_gather",))
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        AuditConfig(dtypes=("fp64",))
    with pytest.raises(ValueError, match="max_bytes"):
        AuditConfig(min_bytes=8192, max_bytes=4096)
    with pytest.raises(TypeError, match="factor"):
        AuditConfig(factor=2.5)
    assert AuditConfig(min_bytes=4096, max_bytes=1 << 20).sizes() == [4096, 16384, 65536, 262144, 1048576]
    with pytest.raises(ValueError, match="at least 2"):
        SMALL.check_world_size(1)
    with pytest.raises(ValueError, match="exceeds the 1024 elements"):
        SMALL.check_world_size(2048)
    SMALL.check_world_size(3)


def test_run_audit_validates_before_forking(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("no rank may start on bad input")

    monkeypatch.setattr(audit, "run_distributed", fail)
    with pytest.raises(ValueError, match="at least 2"):
        run_audit(SMALL, nproc=1)
    with pytest.raises(ValueError, match="torchrun for NCCL"):
        run_audit(SMALL, nproc=2, backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        run_audit(SMALL, nproc=2, backend="mpi")
    with pytest.raises(ValueError, match="at most 64 ranks"):
        run_audit(SMALL, nproc=65)


def test_three_gloo_ranks_against_fp64_bounds():
    rows = run_audit(SMALL, nproc=3, timeout=120)
    assert len(rows) == len(SMALL.ops) * len(SMALL.dtypes) * len(SMALL.sizes())
    u = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
    for r in rows:
        assert r.world_size == 3 and r.backend == "gloo"
        assert r.elements == r.bytes // torch.tensor([], dtype=audit.AUDIT_DTYPES[r.dtype]).element_size() // 3 * 3
        assert r.bits == pytest.approx(-math.log2(r.rel_l2))
        assert r.deterministic
        if r.op.startswith("all_reduce"):
            assert r.ranks_agree is True and r.matches_all_reduce is None
        else:
            assert r.ranks_agree is None and r.matches_all_reduce is True
        if r.op.endswith("fp32_accumulate"):
            assert r.size_invariant  # rank order, whatever the position of an element
            # an fp32 sum of 3 addends (2 roundings of 2**-24) then one rounding to the dtype
            bound = (1 + _gamma(2, 2.0**-24)) * (1 + u[r.dtype]) - 1 if r.dtype != "fp32" else _gamma(2, u["fp32"])
            if r.dtype != "fp32":
                # with 3 addends of 8/11 bits the fp32 sum is exact unless exponents differ by > 13 bits: almost
                # every element is then the correctly rounded sum
                assert r.correctly_rounded > 0.999
        else:
            bound = _gamma(2, u[r.dtype])  # two additions in the wire dtype
        assert 0 < r.rel_l2 <= bound
        assert r.max_rel <= bound * 3  # max|err| / max|s| <= gamma_2 * max(sum |x|) / max|s|, |x| ~ N(0,1)
    # gloo adds bf16/fp16 in the wire dtype: about a third of the 3-rank sums are not correctly rounded, and the
    # fp32-accumulating all-reduce keeps more bits than the native one
    native = {r.dtype: r for r in rows if r.op == "all_reduce" and r.bytes == 16384}
    fp32acc = {r.dtype: r for r in rows if r.op == "all_reduce_fp32_accumulate" and r.bytes == 16384}
    for dtype in ("bf16", "fp16"):
        assert native[dtype].correctly_rounded < 0.9
        assert fp32acc[dtype].bits > native[dtype].bits + 0.3
    lines = verdicts(rows)
    assert len(lines) == 4
    assert "summed in the wire dtype" in lines[0] and "one rounding of an fp32 sum" in lines[2]
    assert format_table(rows).count("\n") == len(rows) + 1


def _faulty_run_op(real):
    """Wraps audit._run_op: all_reduce differs on every second call, reduce_scatter's last element depends on the
    message size, all_reduce_fp32_accumulate differs on rank 1."""
    calls = {"n": 0}

    def run_op(op, x, world_size):
        out = real(op, x, world_size)
        if op == "all_reduce":
            calls["n"] += 1
            if calls["n"] % 2 == 0:
                out[-1] = out[-1] + 1
        elif op == "reduce_scatter":
            out[-1] = float(x.numel() % 7)
        elif op == "all_reduce_fp32_accumulate" and torch.distributed.get_rank() == 1:
            out[0] = out[0] + 1
        return out

    return run_op


def test_flags_catch_injected_faults(monkeypatch):
    monkeypatch.setattr(audit, "_run_op", _faulty_run_op(audit._run_op))
    config = AuditConfig(dtypes=("fp32",), min_bytes=4096, max_bytes=16384)
    rows = run_audit(config, nproc=2, timeout=120)
    by_op = {op: [r for r in rows if r.op == op] for op in config.ops}
    assert not any(r.deterministic for r in by_op["all_reduce"])
    assert all(r.deterministic for r in by_op["reduce_scatter"])
    assert not any(r.size_invariant for r in by_op["reduce_scatter"])
    assert all(r.size_invariant for r in by_op["all_reduce_fp32_accumulate"])
    assert not any(r.ranks_agree for r in by_op["all_reduce_fp32_accumulate"])
    assert all(r.matches_all_reduce for r in by_op["reduce_scatter_fp32_accumulate"])
    text = "\n".join(verdicts(rows))
    assert "NOT deterministic" in text and "NOT size-invariant" in text and "ranks DISAGREE" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtypes", "fp64"], "unknown dtype 'fp64'"),
        (["--ops", "all_gather"], "unknown op 'all_gather'"),
        (["--nproc", "1"], "world size of at least 2"),
        (["--max-size", "big"], "--max-size must be a size"),
        (["--full", "--max-size", "1MiB"], "exclude each other"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    assert main(["audit", "collectives", "--out-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
    assert not any(tmp_path.iterdir())


def test_cli_writes_table_json_and_plot(capsys, tmp_path):
    argv = ["audit", "collectives", "--nproc", "2", "--max-size", "16KiB", "--dtypes", "bf16", "--out-dir"]
    assert main([*argv, str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("[gloo, 2 ranks]") == 4 and "cannot be told from an fp32 one" in out
    data = json.loads((tmp_path / "audit_collectives.json").read_text())
    assert len(data["rows"]) == 8 and len(data["verdicts"]) == 4
    assert data["config"]["max_bytes"] == 16384
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no PNG" in out
    else:
        assert (tmp_path / "audit_collectives.png").stat().st_size > 0


@pytest.mark.parametrize("n", [1023, 4096, 3 * 1_000_003])
def test_probe_positions_are_distinct_and_move_with_the_size(n):
    positions = audit._probe_positions(1023, n, salt=12345)
    assert positions.unique().numel() == 1023 and int(positions.min()) >= 0 and int(positions.max()) < n
    if n > 1023:
        # the same probe value lands in a different quarter of the message than at the smallest size
        small = audit._probe_positions(1023, 1023, salt=999)
        assert bool(((positions * 4 // n) != (small * 4 // 1023)).any())


# ---------------------------------------------------------------------------------------------- the launcher
def _stat_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _all_gone(pids: list[int], seconds: float) -> bool:
    """Every pid exited within ``seconds`` (a zombie not yet reaped by its new parent counts as exited)."""
    deadline = time.monotonic() + seconds
    while any(_stat_state(p) not in (None, "Z") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_stat_state(p) in (None, "Z") for p in pids)


# gloo's transport logger ("[.../gloo/transport/tcp/debug_logger.cc:9] ERROR ...") and c10's log lines
# ("[E1128 12:58:52.912941755 ProcessGroupGloo.cpp:67] ...")
_GLOO_LOG = re.compile(r"^\[(\S*/gloo/\S+:\d+\]|[EWI]\d{4} \S+ \S+\.cpp:\d+\])")


@pytest.mark.slow  # a subprocess that imports torch and forks 4 ranks, each case
@pytest.mark.parametrize(
    ("how", "code", "stderr"),
    [
        ("sigterm", 143, "mixprec audit: terminated (SIGTERM)"),
        ("ctrl-c", 130, "mixprec audit: interrupted"),  # SIGINT to the whole process group, as a terminal sends
        ("kill -9", -9, ""),
        ("kill -9 rank 2", 1, "mixprec audit: error: rank 2 was killed by signal 9; the other ranks were stopped ("),
    ],
    ids=["sigterm", "ctrl-c", "kill-launcher", "kill-rank"],
)
def test_the_audit_launcher_stops_dies_and_blames_as_mixprec_train(tmp_path, how, code, stderr):
    """SIGTERM and Ctrl-C stop the ranks and exit 143 / 130 in one line; kill -9 of the launcher takes its ranks
    with it; a rank killed is named in one line, not in a traceback per rank. The audit (up to 256 MiB) would
    run for minutes."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": str(tmp_path)}
    argv = ["audit", "collectives", "--nproc", "4", "--full", "--dtypes", "fp32", "--ops", "all_reduce"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec", *argv, "--no-plot", "--out-dir", str(tmp_path / "out")],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
                ranks = [int(c) for c in fh.read().split()]
        assert len(ranks) == 4, (ranks, proc.poll())
        if how == "sigterm":
            proc.terminate()
        elif how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "kill -9":
            proc.kill()
        else:
            os.kill(ranks[2], signal.SIGKILL)
        proc.wait(60)
        assert _all_gone(ranks, 10), "ranks outlived their launcher"
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == code, err
        # A rank killed while the group is still connecting makes gloo's C++ logger (not mixprec) print its
        # connect retries on the peers' stderr; mixprec's own output is what must be one line.
        err = "".join(line for line in err.splitlines(keepends=True) if not _GLOO_LOG.match(line))
        assert "Traceback" not in err and err.count("\n") == (1 if stderr else 0) and err.startswith(stderr), err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
