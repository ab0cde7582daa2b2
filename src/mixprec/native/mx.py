"""The block-scaled (MX, NVFP4) quantization kernel of ``csrc/mx.c``: argument types and one call.

Pointers and sizes in, no torch semantics: :mod:`mixprec.core.mx` decides when the kernel may run (CPU,
contiguous blocks along the last axis, nearest or toward-zero rounding) and keeps its torch path as the fallback
and the oracle (docs/mx.md, "Compiled kernel").
"""

from __future__ import annotations

import ctypes

from mixprec.native import library, num_threads

__all__ = ["SCALE_MODE_CODES", "SRC_KINDS", "mx_quantize_raw"]

# csrc/mx.c's enums
SCALE_MODE_CODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3, "neuron": 4, "e4m3": 5}
SRC_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}

_ARGTYPES = [
    ctypes.c_void_p,  # src
    ctypes.c_int,  # src kind
    ctypes.c_void_p,  # dst (fp32)
    ctypes.c_void_p,  # scales (fp32) or NULL
    ctypes.c_int64,  # blocks
    ctypes.c_int,  # block size
    ctypes.c_int,  # element exp_bits
    ctypes.c_int,  # element man_bits
    ctypes.c_float,  # max_element
    ctypes.c_int,  # scale mode
    ctypes.c_int,  # has a tensor scale
    ctypes.c_float,  # tensor scale
    ctypes.c_int,  # toward zero (else nearest)
    ctypes.c_int,  # dequantize
    ctypes.c_int,  # threads
]


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = library()
    if lib is None:
        return None
    fn = lib.mixprec_mx_quantize
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGTYPES
    return fn


def available() -> bool:
    """Whether the compiled library (and so this kernel) is loaded in this process."""
    return library() is not None


def mx_quantize_raw(
    src: int,
    src_kind: str,
    dst: int,
    scales: int | None,
    n_blocks: int,
    block: int,
    exp_bits: int,
    man_bits: int,
    max_element: float,
    scale_mode: str,
    tensor_scale: float | None,
    toward_zero: bool,
    dequantize: bool,
) -> bool:
    """Run ``mixprec_mx_quantize`` on raw addresses (``n_blocks * block`` elements); False when no library is
    loaded (the caller's torch path runs). A rejected argument is a bug in the caller: RuntimeError."""
    fn = _kernel()
    if fn is None:
        return False
    status = fn(
        src, SRC_KINDS[src_kind], dst, scales, n_blocks, block, exp_bits, man_bits, max_element,
        SCALE_MODE_CODES[scale_mode], int(tensor_scale is not None), 1.0 if tensor_scale is None else tensor_scale,
        int(toward_zero), int(dequantize), num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the compiled MX kernel rejected its arguments (status {status}): a bug in mixprec")
    return True
