"""GPU kernels (Triton) for the same hot paths as the compiled CPU kernels: rounding, uint8 quantization, the
emulated matmul.

``triton`` is optional and imported only when a CUDA tensor first needs a kernel. :func:`can_run` says whether
the kernels may serve a set of tensors: CUDA tensors with memory behind them, ``triton`` importable, no torch
dispatch mode or ``torch.compile`` trace active, and the kernels not switched off (``MIXPREC_NATIVE=0`` or
:func:`mixprec.native.disabled`, which switch off the CPU kernels too). Otherwise the torch path runs, which
stays the oracle: the kernels give its bits (``tests/test_native_gpu.py`` compares them on a GPU, and in
Triton's CPU interpreter where ``triton`` is installed).

The wrappers below take checked, contiguous arguments from their callers (``mixprec.core.rounding``,
``mixprec.compress.quantize``, ``mixprec.emulate.matmul``); under ``TRITON_INTERPRET=1`` they also accept CPU
tensors, which is how the tests run them without a GPU. How each kernel keeps the torch path's bits:
``docs/native.md``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Any

import torch

import mixprec.native as native

__all__ = [
    "available",
    "can_run",
    "describe",
    "interpreting",
    "matmul_model",
    "quant_decode_u8",
    "quant_encode_u8",
    "round_nearest",
    "round_nearest_f64",
]

_BLOCK = 1024
# Largest K group the matmul kernel holds in registers as one tile; larger groups take the torch path.
MAX_K_GROUP = 128


@functools.cache
def available() -> bool:
    """True when ``triton`` can be imported (``pip install mixprec[gpu]``)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels in its numpy interpreter (any value but "" or
    "0", Triton's own rule). The one place that reads it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_run(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels may serve ``tensors``: all on one CUDA device, not fake, nothing tracing."""
    if not all(t.device.type == "cuda" for t in tensors) or len({t.device.index for t in tensors}) > 1:
        return False  # first: the cheapest answer for the CPU tensors every caller also passes through here
    if native.env_switched_off() or native.is_disabled() or not available():
        return False
    # ROCm builds also call their devices "cuda": the kernels were checked on NVIDIA GPUs only
    if torch.compiler.is_compiling() or torch.version.hip is not None:
        return False
    return native.can_run(*tensors, device_type="cuda")


def describe() -> str:
    """One line naming the GPU path: Triton with its version, or why the torch path runs."""
    if not available():
        return "torch (triton not installed)"
    if native.env_switched_off() or native.is_disabled():
        return "torch (kernels disabled)"
    return f"triton {_kernels().triton.__version__}"


@functools.cache
def _kernels() -> ModuleType:
    from mixprec.native import triton_kernels

    return triton_kernels


def _on(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current device and its current stream: make that ``t``'s device (a device guard
    costs about 2 us of host time, so only when it is another)."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _launch_opts() -> dict[str, object]:
    # a fused multiply-add rounds once where the torch path rounds twice; the interpreter never fuses
    return {} if interpreting() else {"enable_fp_fusion": False}


# ------------------------------------------------------------------------------------------------ rounding
def _round_params(exp_bits: int, man_bits: int, has_inf: bool, saturate: bool, subnormals: bool) -> dict[str, int]:
    """rounding.c's parameters for a format (the same derivation, in Python integers)."""
    bias = (1 << (exp_bits - 1)) - 1
    emin = 1 - bias
    emax = bias if has_inf else (1 << exp_bits) - 1 - bias
    drop = 23 - man_bits
    top_frac = (1 << man_bits) - 1 if has_inf else (1 << man_bits) - 2
    max_bits = ((emax + 127) << 23) | (top_frac << drop)
    return {
        "drop": drop,
        "half_m1": (1 << (drop - 1)) - 1 if drop else 0,
        "keep_mask": 0x7FFFFFFF & ~((1 << drop) - 1),
        "lo32": (emin + 127) << 23,
        "hi32": (emax + 1 + 127) << 23,
        "add32": (drop << 23) | (1 << 22),
        "lo64": (emin + 1023) << 52,
        "hi64": (emax + 1 + 1023) << 52,
        "add64": ((52 - man_bits) << 52) | (1 << 51),
        "max_bits": max_bits,
        "ovf_bits": max_bits if saturate else (0x7F800000 if has_inf else 0x7FC00000),
        "min_normal_bits": 0 if subnormals else (emin + 127) << 23,
    }


@functools.lru_cache(maxsize=64)
def _round_nearest_args(
    exp_bits: int, man_bits: int, has_inf: bool, saturate: bool, subnormals: bool
) -> tuple[tuple[int, ...], dict[str, object]]:
    """round_nearest_kernel's format arguments: the runtime ints and the constexprs (computed once a format)."""
    p = _round_params(exp_bits, man_bits, has_inf, saturate, subnormals)
    alg = 0 if exp_bits == 8 else (1 if man_bits <= 21 else 2)
    if exp_bits == 8 and p["drop"]:
        nan_keep, nan_or = False, 0x7FC00000  # the integer trick writes the default NaN
    else:
        nan_keep, nan_or = True, 0 if (exp_bits == 8 and subnormals) else 0x00400000
    ints = (p["drop"], p["half_m1"], p["keep_mask"], p["lo32"], p["hi32"], p["add32"], p["lo64"], p["hi64"],
            p["add64"], p["max_bits"], p["ovf_bits"], p["min_normal_bits"], nan_or)  # fmt: skip
    return ints, {"ALG": alg, "ODD": bool(p["drop"]), "NAN_KEEP": nan_keep, "BLOCK": _BLOCK}


def round_nearest(src: torch.Tensor, dst: torch.Tensor, fmt: object) -> None:
    """Round contiguous fp32/fp16/bf16 ``src`` to nearest on ``fmt``'s grid into contiguous fp32 ``dst`` (may be
    ``src`` itself), as ``csrc/rounding.c``'s ``mixprec_round_nearest``."""
    n = src.numel()
    if n == 0:
        return
    f: Any = fmt  # a mixprec.core.FloatFormat (this layer sits below core)
    ints, consts = _round_nearest_args(f.exp_bits, f.man_bits, f.has_inf, f.saturate, f.subnormals)
    with _on(src):
        _kernels().round_nearest_kernel[(triton_cdiv(n, _BLOCK),)](
            src, dst.view(torch.int32), n, *ints, **consts, **_launch_opts()
        )
    torch.autograd.graph.increment_version(dst)


def round_nearest_f64(src: torch.Tensor, dst: torch.Tensor, fmt: object) -> None:
    """Round contiguous fp64 ``src`` once to ``fmt`` into contiguous fp64 or fp32 ``dst`` (may be ``src``)."""
    e, mb = fmt.exp_bits, fmt.man_bits  # type: ignore[attr-defined]
    bias = (1 << (e - 1)) - 1
    emin = 1 - bias
    emax = bias if fmt.has_inf else (1 << e) - 1 - bias  # type: ignore[attr-defined]
    top = (1 << mb) - 1 if fmt.has_inf else (1 << mb) - 2  # type: ignore[attr-defined]
    max_bits = ((emax + 1023) << 52) | (top << (52 - mb))
    ovf = max_bits if fmt.saturate else (0x7FF0000000000000 if fmt.has_inf else 0x7FF8000000000000)  # type: ignore[attr-defined]
    n = src.numel()
    if n == 0:
        return
    with _on(src):
        _kernels().round_nearest_f64_kernel[(triton_cdiv(n, _BLOCK),)](
            src, dst, n, (emin + 1023) << 52, (emax + 1 + 1023) << 52, ((52 - mb) << 52) | (1 << 51), max_bits,
            ovf, 0 if fmt.subnormals else (emin + 1023) << 52,  # type: ignore[attr-defined]
            DST_F64=dst.dtype == torch.float64, BLOCK=_BLOCK, **_launch_opts(),
        )  # fmt: skip
    torch.autograd.graph.increment_version(dst)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------ uint8 quantizer
_FP32_MAX = float(torch.finfo(torch.float32).max)
_WIDE_BELOW = 255.0 * float(torch.finfo(torch.float32).tiny)


def _key_args(key: int) -> tuple[int, int]:
    # the key's 32-bit halves, offset by 2**40 so that Triton always types them int64 (one compiled variant)
    return (key & 0xFFFFFFFF) | 1 << 40, (key >> 32) | 1 << 40


def quant_encode_u8(
    x: torch.Tensor, out: torch.Tensor, chunk: int, stochastic: bool, key: int, offset: int, pos_stride: int
) -> torch.Tensor:
    """MinMaxUInt8's encode of the rows of ``x`` [R, L] (rows contiguous) into ``out`` [R, 8 C + L] uint8: the
    header (NaN for non-finite chunks, whose codes are 0) and the codes of every chunk except the "wide" ones
    (fp64 ranges), which the caller recomputes. Stochastic: stream ``key``, position ``offset + r * pos_stride +
    j``; ties are resolved by a second launch. Returns int32 ``[flagged chunks, wide chunks]`` on the device."""
    rows, length = x.shape
    chunks = triton_cdiv(length, chunk) if rows and length else 0
    # the tie windows: 1024 stream positions each, on a grid from the row's first position rounded down to 256
    w_row = triton_cdiv(length + 255, 1024) if stochastic else 1
    slots = rows * w_row if stochastic and chunks else 0
    # one memset: stats, the windows' tie flags, their bit masks (0.13 bytes per element)
    counts = torch.zeros(2 + 33 * slots, dtype=torch.int32, device=x.device)
    stats, tie_cnt, tie_bits = counts[:2], counts[2 : 2 + slots], counts[2 + slots :]
    if chunks == 0:
        return stats
    k0, k1 = _key_args(key)
    k = _kernels()
    opts = _launch_opts()
    common = (x, out, length, chunks, chunk, x.stride(0), out.stride(0), k0, k1, offset, pos_stride)
    with _on(x):
        k.quant_encode_kernel[(chunks * rows,)](
            *common, stats, tie_cnt, tie_bits, _FP32_MAX, _WIDE_BELOW, w_row, STOCHASTIC=stochastic,
            **{**opts, "num_warps": 2},  # measured on an H200 at 64M elements: 2 warps beat 1, 4, 8 and 16
        )  # fmt: skip
        if stochastic:
            k.quant_ties_kernel[(slots,)](
                *common, tie_cnt, tie_bits, _FP32_MAX, _WIDE_BELOW, w_row, **{**opts, "num_warps": 1}
            )
    torch.autograd.graph.increment_version(out)
    return stats


def quant_decode_u8(buf: torch.Tensor, length: int, out: torch.Tensor, chunk: int, reduce: bool) -> torch.Tensor:
    """MinMaxUInt8's decode of the rows of ``buf`` into ``out`` ([R, L], or [L] summed over rows with
    ``reduce``), except the wide chunks, which the caller recomputes. Returns int32 ``[flagged chunks, wide
    chunks]`` (over rows) on the device."""
    rows = buf.shape[0]
    stats = torch.zeros(2, dtype=torch.int32, device=buf.device)
    if rows == 0 or length == 0:
        return stats
    chunks = triton_cdiv(length, chunk)
    block = min(1024, max(16, 1 << (chunk - 1).bit_length()))
    tiles = triton_cdiv(chunk, block)
    bf16 = out.dtype == torch.bfloat16
    with _on(buf):
        _kernels().quant_decode_kernel[(chunks * tiles * (1 if reduce else rows),)](
            buf, out.view(torch.int16) if bf16 else out, length, chunks, chunk, tiles, rows, buf.stride(0),
            0 if reduce else out.stride(0), _FP32_MAX, _WIDE_BELOW, stats,
            REDUCE=reduce, OUT_BF16=bf16, BLOCK=block, **_launch_opts(),
        )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return stats


# ------------------------------------------------------------------------------------------- emulated matmul
_USE_DOT: dict[str, bool] = {}


def matmul_model(
    a3: torch.Tensor,
    b3: torch.Tensor,
    k_group: int,
    pg: int,
    mode: int,
    acc_fmt: object,
    over: float,
) -> torch.Tensor:
    """The emulated product of ``a3`` [B or 1, M, K] and ``b3`` [B or 1, K, N] (operands holding input-format
    values, any float dtype): fp32 [B, M, N]. ``mode`` 0: fp32 accumulator, else the format ``acc_fmt`` rounded
    with the magic constant; ``pg``: groups per promotion into fp32 (0: none)."""
    nb = max(a3.shape[0], b3.shape[0])
    m, k, n = a3.shape[1], a3.shape[2], b3.shape[2]
    out = torch.empty(nb, m, n, dtype=torch.float32, device=a3.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    groups = triton_cdiv(k, k_group)
    f = acc_fmt
    lo = (f.emin + 1023) << 52  # type: ignore[attr-defined]
    hi = (f.emax + 1 + 1023) << 52  # type: ignore[attr-defined]
    add = ((52 - f.man_bits) << 52) | (1 << 51)  # type: ignore[attr-defined]
    # fp32 operands (exact for every input format): Triton 3.6 fails to lower an fp16/bf16 -> fp64 conversion
    # inside tl.dot's operand layout, and fp32 -> fp64 lowers
    a3, b3 = a3.float(), b3.float()
    kgp = max(16, 1 << (k_group - 1).bit_length())
    bm = bn = 64 if kgp <= 32 else 32
    consts = {"MODE": mode, "SUBNORMALS": bool(f.subnormals), "KG": k_group, "KGP": kgp, "BM": bm, "BN": bn}  # type: ignore[attr-defined]
    for b0 in range(0, nb, _MAX_GRID_Y):  # the grid's second axis holds at most 65535 batch entries
        b1 = min(nb, b0 + _MAX_GRID_Y)
        sa3 = a3[b0:b1] if a3.shape[0] > 1 else a3
        sb3 = b3[b0:b1] if b3.shape[0] > 1 else b3
        sa, sb = sa3.stride(), sb3.stride()
        args = (
            sa3, sb3, out[b0:b1], m, n, k, sa[0] if sa3.shape[0] > 1 else 0, sa[1], sa[2],
            sb[0] if sb3.shape[0] > 1 else 0, sb[1], sb[2], groups, pg, lo, hi, add, f.max_finite, over,  # type: ignore[attr-defined]
            f.min_normal,  # type: ignore[attr-defined]
        )  # fmt: skip
        with _on(a3):
            _launch_matmul((triton_cdiv(m, bm) * triton_cdiv(n, bn), b1 - b0), args, consts, str(a3.device))
    return out


_MAX_GRID_Y = 65535


def _compile_failure(exc: Exception) -> bool:
    """Whether ``exc`` is Triton failing to compile (its front end, or an MLIR pass), not a launch or a fault."""
    from triton.compiler.errors import CompilationError

    return isinstance(exc, CompilationError) or "PassManager" in str(exc)


def _launch_matmul(grid: tuple[int, int], args: tuple, consts: dict[str, object], dev: str) -> None:
    kern = _kernels().matmul_model_kernel
    use_dot = _USE_DOT.get(dev, True)
    try:
        kern[grid](*args, **consts, USE_DOT=use_dot, **_launch_opts())
    except Exception as exc:  # an fp64 tl.dot this Triton cannot compile: the broadcast-and-sum form
        if not use_dot or not _compile_failure(exc):
            raise
        warnings.warn(
            f"mixprec: the emulated matmul's fp64 tl.dot failed on {dev} ({exc!r:.200}); using fp64 FMAs "
            "(same bits, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        _USE_DOT[dev] = False
        kern[grid](*args, **consts, USE_DOT=False, **_launch_opts())


def dot_path(device: torch.device | str) -> str:
    """Which group-sum form the matmul kernel used on ``device``: ``"tl.dot fp64"`` or ``"fp64 FMA"``."""
    return "tl.dot fp64" if _USE_DOT.get(str(device), True) else "fp64 FMA"
