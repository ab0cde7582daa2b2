"""The compiled-kernel library: built and cached once, switchable off, and a clean fallback without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import mixprec.native as native


def test_library_builds_and_reports_its_path() -> None:
    lib = native.library()
    if lib is None:
        pytest.skip(f"no compiled kernels here: {native.describe()}")
    assert lib.mixprec_abi_version() == native._ABI_VERSION == 2
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
    """$CC may be a command with arguments (``CC="ccache gcc"``): here ``env gcc``. Two $CC commands that differ
    only in their arguments build two libraries, not one reused: next to this process's library (built with its
    own $CC), ``CC="env gcc"`` builds a second one."""
    if shutil.which("env") is None or shutil.which("gcc") is None or native.library() is None:
        pytest.skip("needs env, gcc and the compiled library")
    if os.environ.get("CC", "gcc") == "env gcc":
        pytest.skip("this process's own $CC is the one tested")
    built = Path(native.describe().rsplit(", ", 1)[1].rstrip(")"))
    shutil.copy(built, tmp_path / built.name)
    done = _run({"CC": "env gcc"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "False 0"
    assert "compiled (env gcc" in done.stdout
    assert len(list(tmp_path.glob("mixprec_native-*.so"))) == 2


def _x86_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    words = {w for line in text.splitlines() if line.startswith("flags") for w in line.split()}
    return words & {"avx512f", "avx512vbmi", "avx"}


EXTENSIONS = ["avx512vbmi", "avx512f", "avx"]


@pytest.fixture(scope="module")
def fallback_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """For each extension this CPU has: a child pytest of the kernel tests on a build without it, all started at
    once: each builds for about 12 s on one core, then runs mostly one thread, so side by side on 2 cores they
    take 60 s where one after the other took 110 s. Their idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE)
    instead of spinning on the cores the others need (180 s). Output goes to files, which never fill up as a
    pipe would."""
    tests = ["test_native_quantize.py", "test_native_rounding.py", "test_native_matmul.py", "test_compress_kernels.py"]
    runs: dict[str, tuple[subprocess.Popen, Path]] = {}
    have = _x86_flags() if shutil.which("gcc") else set()
    for flag in [f for f in EXTENSIONS if f in have]:
        where = tmp_path_factory.mktemp(f"no-{flag}")
        env = {k: v for k, v in os.environ.items() if k != "MIXPREC_NATIVE"}
        env.update(CC=f"gcc -mno-{flag}", MIXPREC_CACHE_DIR=str(where), OMP_WAIT_POLICY="PASSIVE")
        with open(where / "out.txt", "w") as out:
            runs[flag] = (subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                 *[os.path.join(os.path.dirname(__file__), t) for t in tests], "-k", "not fake_tensors"],
                env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            ), where)  # fmt: skip
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", EXTENSIONS)
def test_kernels_without_an_instruction_set_extension(fallback_runs, flag: str) -> None:
    """The kernels' fallbacks give the torch path's bits: for CPUs without AVX-512 VBMI, without AVX-512 (the AVX2
    kernels) and without AVX (-mno-avx also drops AVX2, FMA and F16C: the plain C loops that other architectures
    compile). The bit-exactness tests of the quantizer, rounding and matmul kernels, with the extension off."""
    if flag not in fallback_runs:
        pytest.skip(f"this CPU has no {flag} (or no gcc): the default build already is the fallback")
    proc, where = fallback_runs[flag]
    proc.wait(timeout=600)
    out = (where / "out.txt").read_text()
    assert proc.returncode == 0, out[-5000:]
    assert " passed" in out
    assert list(where.glob("mixprec_native-*.so"))  # the children ran the library built without the extension
