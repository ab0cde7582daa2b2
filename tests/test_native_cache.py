"""The compiled-kernel cache under attack and damage: a planted library, a truncated, damaged or foreign file under
the cached name, a wrong library from the compiler, a compiler that hangs, and ranks that build at once.

Each case runs in a child process with its own ``MIXPREC_CACHE_DIR`` and a stand-in compiler (a shell script) that
copies this process's library, fails, or hangs: the cache logic runs for real without a real compile per case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec.native as native

FAKE_CC = """#!/bin/sh
if [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi
case "$FAKE_CC_MODE" in
  fail) echo "boom" >&2; exit 1;;
  hang) sleep 1000 & echo $! > "$FAKE_CC_PIDFILE"; wait; exit 0;;
esac
out=""
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then out="$2"; fi; shift; done
sleep "${FAKE_CC_SLEEP:-0}"
cp "$FAKE_CC_LIB" "$out"
"""

CHILD = """
import json, warnings, torch, mixprec.native as n
from mixprec.core.rounding import round_to
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    lib = n.library(); n.library()
    y = round_to(torch.tensor([1.1, -3.3]), "bf16").tolist()  # a kernel call when compiled
print(json.dumps({"compiled": lib is not None, "warnings": [str(x.message) for x in w
                  if issubclass(x.category, n.NativeKernelWarning)], "describe": n.describe(), "y": y}))
"""
BF16 = [1.1015625, -3.296875]  # round_to's answer on either path


@pytest.fixture
def real_library() -> Path:
    lib = native.library()
    if lib is None or shutil.which("gcc") is None:
        pytest.skip(f"needs gcc and the compiled library: {native.describe()}")
    return Path(native.describe().rsplit(", ", 1)[1].rstrip(")"))


def _fake_cc(where: Path) -> Path:
    cc = where / "fakecc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    return cc


def _start(cache: Path, cc: Path, **env_extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MIXPREC_NATIVE", "MIXPREC_BUILD_TIMEOUT")}
    env.update({"MIXPREC_CACHE_DIR": str(cache), "CC": str(cc), **env_extra})
    return subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _child(cache: Path, cc: Path, **env_extra: str) -> dict:
    proc = _start(cache, cc, **env_extra)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"child died ({proc.returncode}): {err[-3000:]}"
    report = json.loads(out.splitlines()[-1])
    assert report["y"] == BF16
    return report


def _cached(report: dict) -> Path:
    assert report["compiled"] and report["warnings"] == [], report
    return Path(report["describe"].rsplit(", ", 1)[1].rstrip(")"))


def _falls_back(report: dict, *words: str) -> str:
    """The child ran the torch path after one warning that holds ``words``."""
    assert not report["compiled"], report
    assert len(report["warnings"]) == 1, report
    message = report["warnings"][0]
    assert all(w in message for w in words), message
    return message


def _gcc(where: Path, name: str, code: str) -> Path:
    src = where / f"{name}.c"
    src.write_text(code)
    lib = where / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return lib


PLANTED = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("PLANT_MARKER");
    FILE *f = p ? fopen(p, "w") : 0;
    if (f) { fputs("ran", f); fclose(f); }
}
int mixprec_abi_version(void) { return ABI; }
""".replace("ABI", str(native._ABI_VERSION))


def test_cache_directory_is_created_private(tmp_path, real_library) -> None:
    cache = tmp_path / "new" / "cache"
    report = _child(cache, _fake_cc(tmp_path), FAKE_CC_LIB=str(real_library))
    assert _cached(report).parent == cache
    assert cache.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in cache.iterdir()] == [_cached(report).name]  # no temporary left


def _tamper(path: Path, how: str, tmp_path: Path) -> None:
    data = path.read_bytes()
    if how == "truncated":  # a copy cut short: mapping it raised SIGBUS inside ctypes.CDLL
        path.write_bytes(data[: min(len(data) // 2, 150_000)])
    elif how == "flipped":  # damaged sectors: code bytes changed in the middle of the file
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 4096]) + data[mid + 4096 :])
    else:  # another valid library under the name: it lacked the kernels (AttributeError at the first call)
        shutil.copy(_gcc(tmp_path, "other", "int other(void) { return 7; }\n"), path)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "flipped", "foreign"])
def test_damaged_library_is_rebuilt_or_refused(tmp_path, real_library, how: str) -> None:
    """The cached file fails its checksum before anything maps it: rebuilt when the compiler works, else the
    torch path with one warning that says why."""
    cache, cc = tmp_path / "cache", _fake_cc(tmp_path)
    path = _cached(_child(cache, cc, FAKE_CC_LIB=str(real_library)))
    _tamper(path, how, tmp_path)
    message = _falls_back(_child(cache, cc, FAKE_CC_MODE="fail"), "checksum does not match", "failed: boom")
    assert str(path) in message
    assert _cached(_child(cache, cc, FAKE_CC_LIB=str(real_library))) == path  # rebuilt in place
    assert path.read_bytes().startswith(real_library.read_bytes())
    if how == "truncated":
        assert _cached(_child(cache, cc, FAKE_CC_MODE="fail")) == path  # and kept: loaded with no build


@pytest.fixture(scope="module")
def planted_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(stand-in compiler, a cached library holding PLANTED): the compiler "builds" the planted library, so the
    file carries the checksum of a real build under its cache key (refused after loading: it lacks the kernels)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    where = tmp_path_factory.mktemp("planted")
    cc, lib = _fake_cc(where), _gcc(where, "planted", PLANTED)
    _falls_back(_child(where / "probe", cc, FAKE_CC_LIB=str(lib), PLANT_MARKER=str(where / "probe-ran")), "lacks")
    (built,) = (where / "probe").glob("mixprec_native-*.so")
    return cc, built


@pytest.mark.parametrize("where", ["dir 0777", "dir 0770", "dir of another user", "lib of another user", "lib 0666"])
def test_planted_library_is_never_loaded(tmp_path, planted_build: tuple[Path, Path], where: str) -> None:
    """A library at the cached name, in a directory others may write or in a file not this user's own, is
    refused before it is mapped: its constructor never runs. The planted file even carries a valid checksum
    (whoever can write the file can compute one): only the ownership checks stand in its way."""
    if "another user" in where and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    cc, built = planted_build
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = cache / built.name
    shutil.copy(built, planted)
    if where.startswith("dir 0"):
        cache.chmod(int(where[4:], 8))
    elif where == "dir of another user":
        os.chown(cache, 65534, 65534)
    elif where == "lib of another user":
        os.chown(planted, 65534, 65534)
    else:
        planted.chmod(0o666)
    marker = tmp_path / "constructor-ran"
    report = _child(cache, cc, FAKE_CC_MODE="fail", PLANT_MARKER=str(marker))
    _falls_back(report, "belongs to uid 65534" if "another user" in where else "writable by group or others")
    assert not marker.exists()
    assert planted.read_bytes() == built.read_bytes()  # left alone for the user to look at


@pytest.mark.parametrize(
    "code, words",
    [
        ("int other(void) { return 7; }\n", "has no mixprec_abi_version"),
        ("int mixprec_abi_version(void) { return 1; }\n", "ABI version 1, this mixprec needs 2"),
        ("int mixprec_abi_version(void) { return 2; }\n", "lacks mixprec_fp32sum_rows"),
    ],
)
def test_wrong_library_from_the_compiler_falls_back(tmp_path, code: str, words: str) -> None:
    """A library that passes its checksum (the build's own output) but is not this version's kernels: refused
    after loading by its ABI version and symbols, with one warning, instead of failing at the first call."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    lib = _gcc(tmp_path, "wrong", code)
    _falls_back(_child(tmp_path / "cache", _fake_cc(tmp_path), FAKE_CC_LIB=str(lib)), words)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie whose parent has not reaped it yet: no longer running


@pytest.mark.slow
def test_hanging_compiler_is_killed_with_its_children(tmp_path) -> None:
    """A compiler that never finishes: past MIXPREC_BUILD_TIMEOUT its whole process group is killed (a child of
    the compiler outlived the old timeout) and the torch path runs after one warning."""
    pidfile = tmp_path / "pid"
    report = _child(
        tmp_path / "cache", _fake_cc(tmp_path), FAKE_CC_MODE="hang", FAKE_CC_PIDFILE=str(pidfile),
        MIXPREC_BUILD_TIMEOUT="5",
    )  # fmt: skip
    _falls_back(report, "did not finish within 5 s", "MIXPREC_BUILD_TIMEOUT")
    assert pidfile.exists()
    assert _gone(int(pidfile.read_text()))
    assert not list((tmp_path / "cache").iterdir())  # no half-built file


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_bad_build_timeout_falls_back(tmp_path, value: str) -> None:
    report = _child(tmp_path / "cache", _fake_cc(tmp_path), MIXPREC_BUILD_TIMEOUT=value)
    _falls_back(report, "MIXPREC_BUILD_TIMEOUT must be a number of seconds > 0", repr(value))


@pytest.mark.slow
def test_ranks_building_at_once_agree(tmp_path, real_library) -> None:
    """Four processes that find the cache empty build at once (each compile takes a second): every one loads a
    checked library, the same file, and no temporary is left behind."""
    cache, cc = tmp_path / "cache", _fake_cc(tmp_path)
    procs = [_start(cache, cc, FAKE_CC_LIB=str(real_library), FAKE_CC_SLEEP="1") for _ in range(4)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.splitlines()[-1]))
    paths = {_cached(r) for r in reports}
    assert len(paths) == 1
    assert [p.name for p in cache.iterdir()] == [paths.pop().name]
    assert all(r["y"] == BF16 for r in reports)
