"""Compiled CPU kernels for the numerics hot paths, built on first use with the system C compiler.

The C sources in ``csrc/`` (plain C11 with OpenMP, no Python or torch headers) are compiled once per
machine into one shared library, cached under ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``) by a
hash of the sources, the flags, the compiler's version and the CPU's feature flags (the build uses
``-march=native``), and loaded with :mod:`ctypes`, which releases the GIL during each call. Kernels take raw
pointers from ``tensor.data_ptr()`` and the thread count ``torch.get_num_threads()``; the library links
the same ``libgomp.so.1`` that torch already loaded, so one OpenMP runtime serves both.

Callers keep their torch implementation and use a kernel only when :func:`library` returns one: with no
compiler (or ``MIXPREC_NATIVE=0``), everything runs as before and one :class:`NativeKernelWarning` says
so, once per process. :func:`describe` names the path that runs, for benchmark output. Results are the
same on both paths bit for bit (the tests run both); ``docs/native.md`` says how each kernel keeps that.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch  # first: the kernels then link the libgomp.so.1 that torch loaded

try:  # private torch names (present since torch 1.13); if a release moves them, the kernels are not offered
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - depends on the torch release
    FakeTensor = None  # type: ignore[assignment,misc]
    _get_current_dispatch_mode = None  # type: ignore[assignment]

__all__ = [
    "NativeKernelWarning",
    "can_run",
    "describe",
    "disabled",
    "env_switched_off",
    "is_disabled",
    "library",
    "num_threads",
]

_CSRC = Path(__file__).with_name("csrc")
# -O3 without -ffast-math: the kernels must round exactly as IEEE fp32/fp64 arithmetic does; -ffp-contract=off
# keeps the compiler from fusing a*b+c where the torch path rounds the product first.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno"]
_ENV_SWITCH = "MIXPREC_NATIVE"


class NativeKernelWarning(RuntimeWarning):
    """The compiled kernels could not be built or loaded; the torch implementation runs instead."""


_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL | None, "why": str, "pid": build process
_disabled_depth = 0


def _cache_dir() -> Path:
    root = os.environ.get("MIXPREC_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> list[str] | None:
    """The compiler command as words: $CC may hold arguments (``CC="ccache gcc"``); its first word must exist."""
    try:
        words = shlex.split(os.environ.get("CC", "")) or ["gcc"]
    except ValueError:  # unbalanced quotes
        return None
    first = shutil.which(words[0]) or (shutil.which("cc") if "CC" not in os.environ else None)
    return None if first is None else [first, *words[1:]]


def env_switched_off() -> bool:
    """True when ``MIXPREC_NATIVE`` is 0, false, no or off: every kernel, CPU and GPU, steps aside."""
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def _build() -> tuple[ctypes.CDLL | None, str]:
    if env_switched_off():
        return None, f"{_ENV_SWITCH}=0"
    if platform.system() != "Linux":
        return None, f"compiled kernels are built on Linux only (this is {platform.system()})"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (gcc or $CC)"
    sources = sorted(_CSRC.glob("*.c"))
    headers = sorted(_CSRC.glob("*.h"))
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{shlex.join(cc)} --version failed: {exc}"
    name = " ".join([os.path.basename(cc[0]), *cc[1:]])
    digest = hashlib.sha256()
    # the whole compiler command counts: CC="gcc -mno-avx512f" must not load a library built without it
    command = shlex.join([*cc, *_FLAGS]).encode()
    for part in (*[p.read_bytes() for p in sources + headers], command, version.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_flags().encode())
    cache = _cache_dir()
    target = cache / f"mixprec_native-{digest.hexdigest()[:20]}.so"
    if not target.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: ranks that build at once never load a half-written file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            try:
                cmd = [*cc, *_FLAGS, "-I", str(_CSRC), *map(str, sources), "-o", tmp, "-lm"]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
                    return None, f"{name} failed: {first}"
                os.replace(tmp, target)
            finally:  # also on a timeout or KeyboardInterrupt: no half-built file left in the cache
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building the kernels in {cache} failed: {exc}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    return lib, f"compiled ({name} {version.splitlines()[0].split()[-1] if version else ''}, {target})"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on the first call; None when the torch path must run.

    Thread-safe; the build happens once per process (a forked child inherits the loaded library).
    """
    if _disabled_depth:
        return None
    lib = _state.get("lib", _MISSING)
    if lib is _MISSING:
        with _lock:
            if "lib" not in _state:
                lib, why = _build()
                _state["lib"], _state["why"] = lib, why
                if lib is None and not why.startswith(_ENV_SWITCH):
                    warnings.warn(
                        f"mixprec: compiled CPU kernels unavailable ({why}); using the slower torch path",
                        NativeKernelWarning,
                        stacklevel=2,
                    )
            lib = _state["lib"]
    return lib  # type: ignore[return-value]


_MISSING = object()


def describe() -> str:
    """One line naming the path the kernels take in this process: compiled (with the library) or torch."""
    lib = library()
    if lib is None:
        why = "disabled by mixprec.native.disabled()" if _disabled_depth else _state.get("why", "")
        return f"torch fallback ({why})"
    return str(_state["why"])


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, :func:`library` returns None and :func:`mixprec.native.gpu.can_run` False in this
    process: the torch path runs (tests and benchmarks compare both paths with it). Not thread-local: meant
    for single-threaded test code."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


def can_run(*tensors: torch.Tensor, device_type: str = "cpu") -> bool:
    """Whether a kernel may read and write ``tensors`` through their data pointers: tensors on ``device_type``
    (CPU for the compiled kernels, "cuda" for :mod:`mixprec.native.gpu`'s) with memory behind them (not fake or
    meta tensors, whose pointer is 0), and no torch dispatch mode (FakeTensorMode, a tracer, a debug mode)
    active that must see every op, including the buffers the caller would allocate."""
    if FakeTensor is None or _get_current_dispatch_mode is None or _get_current_dispatch_mode() is not None:
        return False
    return all(t.device.type == device_type and not isinstance(t, FakeTensor) for t in tensors)


def is_disabled() -> bool:
    """True inside :func:`disabled`: every kernel (CPU and GPU) steps aside for the torch path."""
    return _disabled_depth > 0


def num_threads() -> int:
    """Threads a kernel may use: torch's intra-op setting, so ``torch.set_num_threads`` governs both."""
    return max(1, torch.get_num_threads())
