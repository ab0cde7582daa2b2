"""Compiled CPU kernels for the numerics hot paths, built on first use with the system C compiler.

The C sources in ``csrc/`` (plain C11 with OpenMP, no Python or torch headers) are compiled once per
machine into one shared library, cached under ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``) by a
hash of the sources, the flags, the compiler's version and the CPU's feature flags (the build uses
``-march=native``), and loaded with :mod:`ctypes`, which releases the GIL during each call. Kernels take raw
pointers from ``tensor.data_ptr()`` and the thread count ``torch.get_num_threads()``; the library links
the same ``libgomp.so.1`` that torch already loaded, so one OpenMP runtime serves both.

A cached library is mapped only from a directory of this user's that nobody else may write (created 0700),
from a file of this user's, after the checksum the build appended to it matches (a damaged file is rebuilt);
then its ABI version and functions are checked. A compiler past ``MIXPREC_BUILD_TIMEOUT`` (120 s) is killed
with its children. After a load, other builds in the cache not loaded for ``MIXPREC_CACHE_KEEP_DAYS`` days (30)
and half-written files of builds that died are deleted. Callers keep their torch implementation and use a kernel
only when :func:`library` returns one: with no compiler (or ``MIXPREC_NATIVE=0``), everything runs as before and
one :class:`NativeKernelWarning` says so, once per process. :func:`route` says how a kernel may serve given
tensors: called directly (:mod:`mixprec.native.kernels`, the typed wrappers), as a ``torch.ops.mixprec`` custom op
under torch.compile or a dispatch mode (:mod:`mixprec.native.ops`), or not at all. :func:`describe` names the
path that runs. Results are the same on both paths bit for bit (the tests run both); ``docs/native.md`` says how.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import threading
import time
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
    "route",
]

_CSRC = Path(__file__).with_name("csrc")
# -O3 without -ffast-math: the kernels must round exactly as IEEE fp32/fp64 arithmetic does; -ffp-contract=off
# keeps the compiler from fusing a*b+c where the torch path rounds the product first.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno"]
_ENV_SWITCH = "MIXPREC_NATIVE"
_CACHE_ENV = "MIXPREC_CACHE_DIR"
_TIMEOUT_ENV = "MIXPREC_BUILD_TIMEOUT"
# A build takes 1-10 s (a sanitizer build, or several ranks building at once on few cores, longer); a compiler
# that hangs must not hold up the first kernel call much longer than that.
_BUILD_TIMEOUT_S = 120.0
_ABI_VERSION = 2  # csrc/abi.c's mixprec_abi_version()
_KEEP_ENV = "MIXPREC_CACHE_KEEP_DAYS"
# A library of another build (other sources, flags, compiler or CPU) that no process loaded for this long is deleted
# from the cache; a load refreshes its file's time. Deleting a file that a running process has mapped is safe on
# Linux: the mapping keeps the inode.
_KEEP_DAYS = 30.0
# A half-written build (a compiler killed with its process) this old is dead: a build is bounded by the timeout.
_TMP_KEEP_S = 86400.0
_LIB_NAME = re.compile(r"mixprec_native-[0-9a-f]{20}\.so\Z")
_TMP_NAME = re.compile(r"\.mixprec_native-[0-9a-f]{20}\.so\.[0-9]+\.[0-9a-f]{12}\.tmp\Z")
# What the build appends to the library (the ELF loader ignores bytes past its sections): this tag, then the
# sha256 of the cache key and the library's bytes. A truncated, damaged or foreign file fails it.
_MAGIC = b"\0mixprec-sha256\0"
# Function definitions with external linkage, at the start of a line in csrc/*.c.
_EXPORTED = re.compile(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(mixprec_\w+)\s*\(", re.MULTILINE)


class NativeKernelWarning(RuntimeWarning):
    """The compiled kernels could not be built or loaded; the torch implementation runs instead."""


_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL | None, "why": str, "pid": build process
_disabled_depth = 0


def _cache_dir() -> Path:
    root = os.environ.get(_CACHE_ENV)
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


def _build_timeout() -> float | None:
    """Seconds a compiler command may run (``MIXPREC_BUILD_TIMEOUT``, default 120); None for a bad value."""
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    if not raw:
        return _BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def _run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own; past ``timeout`` seconds kill the whole process group (the compiler
    driver's cc1, as and ld children too, which ``subprocess.run`` would leave running) and raise
    ``subprocess.TimeoutExpired``."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # the timeout, or KeyboardInterrupt: nothing of the build may outlive this call
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):  # not read: a child that left the group could hold them open
            if pipe is not None:
                pipe.close()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _exported(sources: list[Path]) -> list[str]:
    """The ``mixprec_*`` functions the sources define with external linkage: what a loaded library must hold."""
    names: set[str] = set()
    for path in sources:
        names.update(_EXPORTED.findall(path.read_text()))
    return sorted(names)


def _open_private_dir(cache: Path) -> tuple[int | None, str]:
    """An open descriptor of the cache directory, created 0700 if missing, when this user owns it and nobody
    else may write it (else None and the reason). Everything after this goes through the descriptor, so a
    directory swapped in under the same path later is never read from."""
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        dfd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"cannot use the cache directory {cache}: {exc}"
    st = os.fstat(dfd)
    euid = os.geteuid()
    why = ""
    if st.st_uid != euid:
        why = f"the cache directory {cache} belongs to uid {st.st_uid}, not to this user (uid {euid})"
    elif st.st_mode & 0o022:
        why = f"the cache directory {cache} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        os.close(dfd)
        return None, f"{why}: a library there could run another user's code; set {_CACHE_ENV} to a private directory"
    return dfd, ""


def _trailer(body: bytes, key: bytes) -> bytes:
    """What the build appends to a library: a tag and the sha256 of the cache key and the library's bytes."""
    return _MAGIC + hashlib.sha256(key + body).digest()


def _open_verified(dfd: int, name: str, key: bytes) -> tuple[int | None, str]:
    """Open the cached library ``name`` and check it before anything maps it: a regular file of this user's that
    nobody else may write, ending in the trailer of its bytes under this ``key``. Returns (descriptor, "") or
    (None, "absent" | "corrupt: ..." | "refused: ...")."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None, "absent"
    except OSError as exc:  # a symbolic link (ELOOP) or unreadable: replaced by a fresh build
        return None, f"corrupt: cannot open it ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "corrupt: not a regular file"
        if st.st_uid != os.geteuid():
            return None, f"refused: it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        if st.st_mode & 0o022:
            return None, f"refused: it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        n = len(_MAGIC) + 32
        if len(data) <= n or data[-n:] != _trailer(data[:-n], key):
            return None, f"corrupt: its checksum does not match its {len(data)} bytes"
        fd, kept = -1, fd
        return kept, ""
    finally:
        if fd >= 0:
            os.close(fd)


def _compile(
    cc: list[str], sources: list[Path], cache: Path, dfd: int, name: str, key: bytes, timeout: float
) -> tuple[int | None, str]:
    """Build the library beside ``name``, append its trailer and rename it into place; the built file stays open
    (its descriptor is returned), so this process loads the bytes it checked whatever the name holds by then."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = -1
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dfd))
        cmd = [*cc, *_FLAGS, "-I", str(_CSRC), *map(str, sources), "-o", str(cache / tmp), "-lm"]
        try:
            done = _run_bounded(cmd, timeout)
        except subprocess.TimeoutExpired:
            return None, f"{cc[0]} did not finish within {timeout:g} s (set {_TIMEOUT_ENV} to wait longer)"
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            return None, f"{' '.join([os.path.basename(cc[0]), *cc[1:]])} failed: {first}"
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with open(fd, "rb", closefd=False) as f:
            body = f.read()
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, _trailer(body, key))
        os.fchmod(fd, 0o755)
        os.fsync(fd)  # a crash after the rename leaves the whole file or the old one, never a short one
        # Built beside the target and renamed: ranks that build at once never load a half-written file.
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        fd, kept = -1, fd
        return kept, ""
    except OSError as exc:
        return None, f"building the kernels in {cache} failed: {exc}"
    finally:  # also on KeyboardInterrupt: no half-built file left in the cache
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)


def _load(fd: int, target: Path, exported: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """Load the checked library open at ``fd`` (through /proc, so that the file mapped is the file checked) and
    check its ABI version and that it defines every function the sources export."""
    proc_path = f"/proc/self/fd/{fd}"
    try:
        lib = ctypes.CDLL(proc_path if os.path.exists(proc_path) else str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    try:
        abi = lib.mixprec_abi_version
    except AttributeError:
        return None, f"{target} has no mixprec_abi_version: not a mixprec kernel library"
    abi.restype, abi.argtypes = ctypes.c_int, []
    if abi() != _ABI_VERSION:
        return None, f"{target} has ABI version {abi()}, this mixprec needs {_ABI_VERSION}"
    missing = [s for s in exported if not hasattr(lib, s)]
    if missing:
        return None, f"{target} lacks {', '.join(missing)}"
    return lib, ""


def _build() -> tuple[ctypes.CDLL | None, str]:
    if env_switched_off():
        return None, f"{_ENV_SWITCH}=0"
    if platform.system() != "Linux":
        return None, f"compiled kernels are built on Linux only (this is {platform.system()})"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (gcc or $CC)"
    timeout = _build_timeout()
    if timeout is None:
        return None, f"{_TIMEOUT_ENV} must be a number of seconds > 0; got {os.environ.get(_TIMEOUT_ENV)!r}"
    sources = sorted(_CSRC.glob("*.c"))
    headers = sorted(_CSRC.glob("*.h"))
    try:
        version = _run_bounded([*cc, "--version"], min(timeout, 30.0)).stdout
    except subprocess.TimeoutExpired:
        return None, f"{shlex.join(cc)} --version did not finish within {min(timeout, 30.0):g} s"
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
    dfd, why = _open_private_dir(cache)
    if dfd is None:
        return None, why
    try:
        fd, state = _open_verified(dfd, target.name, digest.digest())
        if state.startswith("refused"):
            return None, f"{target} {state.removeprefix('refused: ')}: not loaded"
        if fd is None:  # absent, or corrupt (truncated, damaged, another library): build it afresh
            fd, why = _compile(cc, sources, cache, dfd, target.name, digest.digest(), timeout)
            if fd is None:
                return None, why if state == "absent" else f"{target} is {state}, and rebuilding it failed: {why}"
        try:
            lib, why = _load(fd, target, _exported(sources))
            if lib is not None:
                with contextlib.suppress(OSError):  # a read-only cache: nothing to refresh or prune
                    os.utime(fd)
                    prune_cache(dfd, target.name)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    if lib is None:
        return None, why
    return lib, f"compiled ({name} {version.splitlines()[0].split()[-1] if version else ''}, {target})"


def _keep_days() -> float:
    raw = os.environ.get(_KEEP_ENV, "").strip()
    try:
        days = float(raw) if raw else _KEEP_DAYS
    except ValueError:
        days = _KEEP_DAYS
    return days if days >= 0 else _KEEP_DAYS


def prune_cache(dfd: int, current: str, now: float | None = None) -> list[str]:
    """Delete, from the cache directory open at ``dfd``, the libraries of other builds not loaded for
    ``MIXPREC_CACHE_KEEP_DAYS`` days and the half-written files of builds older than a day; returns their names.

    Only names this module creates, regular files (no links) owned by this user, and never ``current`` (the
    library this process loaded) are touched. A library another process loads meanwhile is at most rebuilt."""
    now = time.time() if now is None else now
    keep_s = _keep_days() * 86400.0
    removed = []
    with os.scandir(dfd) as entries:
        names = [e.name for e in entries]
    for name in sorted(names):
        if name == current:
            continue
        if _LIB_NAME.match(name):
            limit = keep_s
        elif _TMP_NAME.match(name):
            limit = _TMP_KEEP_S
        else:
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > limit:
                os.unlink(name, dir_fd=dfd)
                removed.append(name)
        except OSError:  # gone already (another process pruned it), or not ours to delete
            continue
    return removed


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


def route(*tensors: torch.Tensor) -> str | None:
    """How a compiled CPU kernel may serve ``tensors``: ``"kernel"`` (call :mod:`mixprec.native.kernels`
    directly), ``"op"`` (call it as its ``torch.ops.mixprec`` custom op, :mod:`mixprec.native.ops`: under
    torch.compile, a torch dispatch mode or on fake tensors, which must see the op and not a raw pointer), or None
    (no library, :func:`disabled`, or a tensor not on the CPU: the caller's torch path runs)."""
    if _disabled_depth or FakeTensor is None:
        return None  # (FakeTensor None: a torch release that moved the names route relies on)
    traced = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    for t in tensors:  # a loop, not all(...): this runs on every small kernel call
        if not t.is_cpu:
            return None
        traced = traced or isinstance(t, FakeTensor)
    if library() is None:
        return None
    return "op" if traced else "kernel"


def is_disabled() -> bool:
    """True inside :func:`disabled`: every kernel (CPU and GPU) steps aside for the torch path."""
    return _disabled_depth > 0


def num_threads() -> int:
    """Threads a kernel may use: torch's intra-op setting, so ``torch.set_num_threads`` governs both."""
    return max(1, torch.get_num_threads())
