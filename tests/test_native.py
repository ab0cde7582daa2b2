"""The compiled-kernel library: built and cached once, switchable off, and a clean fallback without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_compiler_arguments_are_part_of_the_cache_key(tmp_path) -> None:
    """Two $CC commands that differ only in their arguments build two libraries, not one reused: next to this
    process's library (built with its own $CC), ``CC="env gcc"`` builds a second one."""
    if shutil.which("env") is None or shutil.which("gcc") is None or native.library() is None:
        pytest.skip("needs env, gcc and the compiled library")
    if os.environ.get("CC", "gcc") == "env gcc":
        pytest.skip("this process's own $CC is the one tested")
    built = Path(native.describe().rsplit(", ", 1)[1].rstrip(")"))
    shutil.copy(built, tmp_path / built.name)
    assert _run({"CC": "env gcc"}, tmp_path).returncode == 0
    assert len(list(tmp_path.glob("mixprec_native-*.so"))) == 2


def _x86_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    words = {w for line in text.splitlines() if line.startswith("flags") for w in line.split()}
    return words & {"avx512f", "avx512vbmi", "avx"}


@pytest.mark.parametrize("flag", ["avx512vbmi", "avx512f", "avx"])
def test_kernels_without_an_instruction_set_extension(tmp_path, flag: str) -> None:
    """The kernels' fallbacks give the torch path's bits: for CPUs without AVX-512 VBMI, without AVX-512 (the AVX2
    kernels) and without AVX (-mno-avx also drops AVX2, FMA and F16C: the plain C loops that other architectures
    compile). The bit-exactness tests of the quantizer, rounding and matmul kernels, with the extension off."""
    if flag not in _x86_flags() or shutil.which("gcc") is None:
        pytest.skip(f"this CPU has no {flag}: the default build already is the fallback")
    tests = ["test_native_quantize.py", "test_native_rounding.py", "test_native_matmul.py", "test_compress_kernels.py"]
    env = {k: v for k, v in os.environ.items() if k != "MIXPREC_NATIVE"}
    env.update(CC=f"gcc -mno-{flag}", MIXPREC_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *[os.path.join(os.path.dirname(__file__), t) for t in tests], "-k", "not fake_tensors"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    assert list(tmp_path.glob("mixprec_native-*.so"))  # the children ran the library built without the extension
