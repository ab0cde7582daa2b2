"""The compiled-kernel library: built and cached once, switchable off, and a clean fallback without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import mixprec.native as native


def test_library_builds_and_reports_its_path() -> None:
    lib = native.library()
    if lib is None:
        pytest.skip(f"no compiled kernels here: {native.describe()}")
    assert lib.mixprec_abi_version() == 1
    assert native.describe().startswith("compiled")
    with native.disabled():
        assert native.library() is None
        assert native.describe().startswith("torch fallback")
    assert native.library() is lib


def _run(env_extra: dict[str, str], tmp_path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MIXPREC_NATIVE", "CC")}
    env.update({"MIXPREC_CACHE_DIR": str(tmp_path), **env_extra})
    code = (
        "import warnings, mixprec.native as n\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    lib = n.library(); n.library()\n"
        "print(lib is None, len([x for x in w if issubclass(x.category, n.NativeKernelWarning)]))\n"
        "print(n.describe())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_missing_compiler_falls_back_with_one_warning(tmp_path) -> None:
    done = _run({"CC": str(tmp_path / "no-such-cc")}, tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "True 1"
    assert second.startswith("torch fallback (no C compiler")


def test_switch_off_is_silent(tmp_path) -> None:
    done = _run({"MIXPREC_NATIVE": "0"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "True 0"
    assert list(tmp_path.iterdir()) == []  # nothing built


def test_compiler_error_falls_back(tmp_path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake 1.0'; exit 0; fi\necho 'boom' >&2; exit 1\n")
    fake.chmod(0o755)
    done = _run({"CC": str(fake)}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "True 1"
    assert "failed: boom" in done.stdout
    assert not list(tmp_path.glob("*.so"))  # no half-built library left for the next process


def test_compiler_with_arguments(tmp_path) -> None:
    """$CC may be a command with arguments (``CC="ccache gcc"``): here ``env gcc``."""
    if shutil.which("env") is None or shutil.which("gcc") is None:
        pytest.skip("needs env and gcc")
    done = _run({"CC": "env gcc"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "False 0"
    assert "compiled (env gcc" in done.stdout
