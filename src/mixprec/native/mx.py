"""The block-scaled (MX, NVFP4) kernels: quantization (``csrc/mx.c``) and the gradient wire (``csrc/mx_wire.c``).

Pointers and sizes in, no torch semantics: :mod:`mixprec.core.mx` decides when the quantization kernel may run
(CPU, contiguous blocks along the last axis) and :class:`mixprec.compress.BlockScaledWire` when the wire's may;
both keep their torch path as the fallback and the oracle (docs/mx.md, "Compiled kernel").
"""

from __future__ import annotations

import ctypes

from mixprec.native import library, num_threads

__all__ = ["SCALE_MODE_CODES", "SRC_KINDS", "mx_quantize_raw", "wire_decode_raw", "wire_encode_raw"]

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
    ctypes.c_int,  # stochastic
    ctypes.c_uint64,  # Philox key
    ctypes.c_uint64,  # stream position of the first element
    ctypes.c_int,  # threads
]
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# mixprec_mx_wire_encode(src, kind, src_stride, residual, res_stride, out, out_stride, rows, length, exp_bits,
# man_bits, max_element, mode, block, bits, chunk, nan_code, stochastic, key, offset, pos_stride, threads)
_ENCODE_ARGTYPES = [_PTR, _INT, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _INT, ctypes.c_float, _INT, _INT,
                    _INT, _I64, _INT, _INT, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, _INT]  # fmt: skip
# mixprec_mx_wire_decode(buf, buf_stride, rows, length, out, out_kind, out_stride, reduce, elem_t, scale_t, exp_bits,
# man_bits, block, chunk, nv, nan_code, threads)
_DECODE_ARGTYPES = [_PTR, _I64, _I64, _I64, _PTR, _INT, _I64, _INT, _PTR, _PTR, _INT, _INT, _INT, _I64, _INT, _INT,
                    _INT]  # fmt: skip


def _kernel(name: str = "mixprec_mx_quantize") -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        if name == "mixprec_mx_quantize":
            fn.restype, fn.argtypes = ctypes.c_int, _ARGTYPES
        else:
            fn.restype = ctypes.c_int64
            fn.argtypes = _ENCODE_ARGTYPES if name == "mixprec_mx_wire_encode" else _DECODE_ARGTYPES
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
    stochastic_key: int | None = None,
) -> bool:
    """Run ``mixprec_mx_quantize`` on raw addresses (``n_blocks * block`` elements); False when no library is
    loaded (the caller's torch path runs). ``stochastic_key``: round stochastically on that Philox stream, element
    ``i`` at position ``i``. A rejected argument is a bug in the caller: RuntimeError."""
    fn = _kernel()
    if fn is None:
        return False
    status = fn(
        src, SRC_KINDS[src_kind], dst, scales, n_blocks, block, exp_bits, man_bits, max_element,
        SCALE_MODE_CODES[scale_mode], int(tensor_scale is not None), 1.0 if tensor_scale is None else tensor_scale,
        int(toward_zero), int(dequantize), int(stochastic_key is not None), stochastic_key or 0, 0, num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the compiled MX kernel rejected its arguments (status {status}): a bug in mixprec")
    return True


def wire_encode_raw(
    src: int,
    src_kind: str,
    src_stride: int,
    residual: int | None,
    res_stride: int,
    out: int,
    out_stride: int,
    rows: int,
    length: int,
    grid: tuple[int, int, float],
    scale_mode: str,
    block: int,
    chunk: int,
    nan_code: int,
    stochastic_key: int | None,
    offset: int,
    pos_stride: int,
) -> int | None:
    """Run ``mixprec_mx_wire_encode`` (``grid``: exp_bits, man_bits, max_element); the flagged blocks, or None when
    no library is loaded. A rejected argument is a bug in the caller: RuntimeError."""
    fn = _kernel("mixprec_mx_wire_encode")
    if fn is None:
        return None
    exp_bits, man_bits, max_element = grid
    n_bad = fn(
        src, SRC_KINDS[src_kind], src_stride, residual, res_stride, out, out_stride, rows, length, exp_bits, man_bits,
        max_element, SCALE_MODE_CODES[scale_mode], block, 1 + exp_bits + man_bits, chunk, nan_code,
        int(stochastic_key is not None), stochastic_key or 0, offset, pos_stride, num_threads(),
    )  # fmt: skip
    if n_bad < 0:
        why = "out of memory" if n_bad == -2 else "rejected arguments: a bug in mixprec"
        raise RuntimeError(f"the compiled MX wire encoder failed (status {n_bad}, {why})")
    return int(n_bad)


def wire_decode_raw(
    buf: int,
    buf_stride: int,
    rows: int,
    length: int,
    out: int,
    out_kind: str,
    out_stride: int,
    reduce: bool,
    tables: tuple[int, int],
    grid: tuple[int, int],
    block: int,
    chunk: int,
    nv: bool,
    nan_code: int,
) -> int | None:
    """Run ``mixprec_mx_wire_decode`` (``tables``: addresses of the fp32 element and scale value tables; ``grid``:
    the element's exp_bits, man_bits); the flagged blocks, or None when no library is loaded. A rejected argument
    is a bug in the caller: RuntimeError."""
    fn = _kernel("mixprec_mx_wire_decode")
    if fn is None:
        return None
    n_bad = fn(
        buf, buf_stride, rows, length, out, SRC_KINDS[out_kind], out_stride, int(reduce), tables[0], tables[1],
        grid[0], grid[1], block, chunk, int(nv), nan_code, num_threads(),
    )  # fmt: skip
    if n_bad < 0:
        raise RuntimeError(f"the compiled MX wire decoder rejected its arguments (status {n_bad}): a bug in mixprec")
    return int(n_bad)
