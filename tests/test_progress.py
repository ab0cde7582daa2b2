"""Progress bars (mixprec.core.progress): drawn on a terminal, never into a log or a pipe unless asked for, and
every command that draws one follows that rule."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import mixprec.lab.studies.audit
from mixprec.cli.main import build_parser, main
from mixprec.core.progress import is_terminal, progress_bar, resolve_progress
from mixprec.lab.studies.matmul_error import matmul_error_study


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Closed(io.StringIO):
    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


def _draw(monkeypatch, stream: io.StringIO, enabled: bool | None) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar(total=3, desc="t", enabled=enabled)
    for _ in range(3):
        bar.update(1)
    bar.close()
    return stream.getvalue()


@pytest.mark.parametrize(
    ("terminal", "enabled", "drawn"),
    [(True, None, True), (False, None, False), (False, True, True), (True, False, False)],
    ids=["terminal", "log", "asked-for-in-a-log", "refused-on-a-terminal"],
)
def test_a_bar_is_drawn_on_a_terminal_or_when_asked(monkeypatch, terminal: bool, enabled, drawn: bool) -> None:
    out = _draw(monkeypatch, _Terminal() if terminal else io.StringIO(), enabled)
    assert ("\r" in out) == drawn and ("3/3" in out) == drawn
    if not drawn:
        assert out == ""


def test_odd_streams_and_values(monkeypatch) -> None:
    assert not is_terminal(_Closed()) and not is_terminal(object())  # type: ignore[arg-type]
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert resolve_progress(None) and not resolve_progress(False)
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        resolve_progress("yes")  # type: ignore[arg-type]


def test_probe_matmul_into_a_log_has_no_carriage_returns(tmp_path) -> None:
    """What a user does: ``mixprec probe matmul > log 2>&1``. The probe drew its bar unconditionally."""
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "mixprec", "probe", "matmul", "--fn", "emulate:fp16/16", "--dtypes", "fp16"]
    with open(log, "w") as fh:
        proc = subprocess.run([*cmd, "--shape", "16,16,512"], stdout=fh, stderr=subprocess.STDOUT, timeout=300)
    raw = log.read_bytes()  # bytes: a text read would turn each carriage return into a newline
    assert proc.returncode == 0, raw
    assert b"model: fp16/16 (fp16/16); bit-equal 100.0%" in raw
    assert b"\r" not in raw


def test_matmul_error_study_by_default_draws_no_bar_into_a_log(capfd) -> None:
    args = build_parser().parse_args(["study", "matmul-error"])
    assert args.progress is None  # the CLI's default: when stderr is a terminal
    matmul_error_study((128,), ("fp16/16",), rows=16, progress=None)
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    matmul_error_study((128,), ("fp16/16",), rows=16, progress=True)
    assert "\r" in capfd.readouterr().err  # asked for: drawn even into a pipe


def test_audit_cli_asks_for_a_bar_only_on_a_terminal(monkeypatch, tmp_path) -> None:
    seen = []

    def run_audit(config, **kwargs):
        seen.append(kwargs["progress"])
        return None  # what a torchrun rank other than 0 gets: nothing to print

    monkeypatch.setattr(mixprec.lab.studies.audit, "run_audit", run_audit)
    argv = ["audit", "collectives", "--nproc", "2", "--max-size", "16KiB", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert main(argv) == 0
    assert seen == [False, True]
