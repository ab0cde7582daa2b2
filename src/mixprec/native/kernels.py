"""Typed wrappers of the compiled CPU kernels: the only place that knows their C signatures.

One function per kernel takes tensors (and plain numbers), checks the kernel's contract (dtypes from
:mod:`mixprec.native.dtypes`, CPU memory, the contiguity the kernel reads with, sizes that agree), calls it through
:mod:`ctypes` and bumps the version counter of every tensor it wrote, as an in-place torch op does. A broken
contract is a bug in the calling mixprec code, not bad user input: :class:`KernelContractError`, before anything is
written. Callers decide whether a kernel may run at all (:func:`mixprec.native.route`) and keep their torch path;
every wrapper here needs :func:`mixprec.native.library` to have returned a library (None otherwise: no kernel ran).
:mod:`mixprec.native.ops` registers the same kernels as ``torch.ops.mixprec`` custom ops for torch.compile and
dispatch modes. Signatures are those of ``csrc/*.c``; ``docs/native.md`` describes each kernel.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from mixprec.native import library, num_threads
from mixprec.native.dtypes import DTYPE_CODES

__all__ = [
    "KernelContractError",
    "fp8_table_format",
    "fp32_sum_rows",
    "MX_SCALE_MODES",
    "matmul_model",
    "mx_quantize",
    "mx_wire_decode",
    "mx_wire_encode",
    "philox_block",
    "philox_bytes",
    "philox_tie_words",
    "quant_decode_fp8",
    "quant_decode_u8",
    "quant_encode_fp8",
    "quant_encode_u8",
    "round_directed",
    "round_nearest",
]

_P, _I, _I64, _U64, _F, _D = (
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_uint64,
    ctypes.c_float,
    ctypes.c_double,
)
_FMT = [_I] * 6  # exp_bits, man_bits, has_inf, saturate, subnormals, threads
# name -> (restype, argtypes), as csrc/*.c declare them
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "mixprec_round_nearest": (_I, [_P, _I, _P, _I64, *_FMT]),
    "mixprec_round_nearest_f64": (_I, [_P, _P, _I, _I64, *_FMT]),
    "mixprec_round_directed": (_I, [_P, _I, _P, _P, _I, _I64, *_FMT]),
    "mixprec_fp32sum_rows": (_I64, [_P, _I, _I64, _I64, _I64, _P, _I, _I, _I, _F, _I]),
    "mixprec_quant_encode_u8": (_I64, [_P, _I, _I64, _I64, _I64, _P, _I64, _I64, _I, _U64, _I64, _I64, _I]),
    "mixprec_quant_decode_u8": (_I64, [_P, _I64, _I64, _I64, _P, _I, _I64, _I64, _I, _I]),
    "mixprec_quant_encode_fp8": (_I64, [_P, _I, _I64, _I64, _I64, _P, _I64, _I64, _I, _I, _U64, _I64, _I64, _I]),
    "mixprec_quant_decode_fp8": (_I64, [_P, _I64, _I64, _I64, _P, _I, _I64, _I64, _P, _I, _I, _I]),
    "mixprec_quant_fp8_table_format": (_I, [_P]),
    "mixprec_quant_philox_block": (None, [_P, _P, _P]),
    "mixprec_quant_philox_bytes": (None, [_U64, _I64, _I64, _P]),
    "mixprec_quant_philox_tie_words": (None, [_U64, _P, _I64, _P]),
    "mixprec_mx_quantize": (_I, [_P, _I, _P, _P, _I64, _I, _I, _I, _F, _I, _I, _F, _I, _I, _I, _U64, _U64, _I]),
    "mixprec_mx_wire_encode": (_I64, [_P, _I, _I64, _P, _I64, _P, _I64, _I64, _I64, _I, _I, _F, _I, _I, _I, _I64,
                                      _I, _I, _U64, _U64, _U64, _I]),
    "mixprec_mx_wire_decode": (_I64, [_P, _I64, _I64, _I64, _P, _I, _I64, _I, _P, _P, _I, _I, _I, _I64, _I, _I,
                                      _I]),
    "mixprec_matmul_model": (_I, [_P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I, _P, _I64, _I64, _I64, _I64,
                                  _I, _I, _I, _I, _I, _I, _D, _D, _D, _I, _I]),
}  # fmt: skip
# csrc/mx.h's scale rules (MX_FLOOR ... MX_E4M3): the block-scaled kernels' scale_mode argument
MX_SCALE_MODES: dict[str, int] = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3, "neuron": 4, "e4m3": 5}
_KEY_MASK = (1 << 64) - 1
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_bound: dict[int, tuple[ctypes.CDLL, dict[str, Any]]] = {}
_last: list[Any] = [None, {}]  # the library bound last and its functions: the common case in one comparison


class KernelContractError(RuntimeError):
    """A mixprec caller passed a compiled kernel what it cannot read or write (a bug in mixprec, not in the
    user's input): raised before the kernel runs."""


def _fn(name: str) -> Any:
    """The kernel ``name`` of the loaded library with its signature bound (once per library object)."""
    lib = library()
    if lib is not None and lib is _last[0]:
        return _last[1][name]
    if lib is None:
        _fail(f"{name} called without a loaded kernel library (check mixprec.native.route)")
    entry = _bound.get(id(lib))
    if entry is None or entry[0] is not lib:
        fns = {}
        for fname, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, fname)
            fn.restype, fn.argtypes = restype, argtypes
            fns[fname] = fn
        entry = _bound[id(lib)] = (lib, fns)
    _last[:] = entry
    return entry[1][name]


def _fail(what: str) -> None:
    """Raise for a broken contract; the callers test their condition first, so that the message (which formats
    tensors and dtypes, microseconds) is only built on the way to the error."""
    raise KernelContractError(f"a compiled kernel's contract was broken: {what} (a bug in mixprec)")


def _cpu(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], contiguous: bool = False) -> None:
    """``t`` is a CPU tensor of ``dtypes`` (and contiguous): one condition on the way in (a call's checks cost
    about a microsecond in all), the reason spelled out only on the way to the error."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and (not contiguous or t.is_contiguous()):
        return
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        _fail(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in dtypes:
        _fail(f"{name} must be one of {dtypes}, got {t.dtype}")
    _fail(f"{name} must be contiguous, got strides {t.stride()}")


def _flat(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    _cpu(name, t, dtypes, True)


def _rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """2-D with contiguous rows and a row stride >= 0."""
    _cpu(name, t, dtypes)
    if t.dim() != 2:
        _fail(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not (t.shape[1] <= 1 or t.stride(1) == 1):
        _fail(f"each row of {name} must be contiguous, got {t.stride()}")
    if not (t.stride(0) >= 0):
        _fail(f"{name} must have a row stride >= 0, got {t.stride()}")


def _same_or_apart(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` is ``src`` itself (in place) or shares no byte with it."""
    a0, b0 = src.data_ptr(), dst.data_ptr()
    apart = a0 >= b0 + dst.numel() * dst.element_size() or b0 >= a0 + src.numel() * src.element_size()
    if not ((a0 == b0 and src.dtype == dst.dtype) or apart):
        _fail("dst must be src itself or not overlap it")


def _status(status: int, what: str) -> None:
    if status != 0:
        _fail(f"{what} rejected its arguments (status {status})")


def round_nearest(
    src: torch.Tensor, dst: torch.Tensor, exp_bits: int, man_bits: int, has_inf: bool, saturate: bool, subnormals: bool
) -> None:
    """``dst = round_to(src, format, "nearest")`` (``csrc/rounding.c``): fp32, fp16, bf16 or fp64 ``src`` into fp32
    ``dst`` (or fp64 from fp64), both contiguous, ``dst`` being ``src`` or apart from it."""
    _flat("src", src, (*_FLOATS, torch.float64))
    _flat("dst", dst, (torch.float32, torch.float64) if src.dtype == torch.float64 else (torch.float32,))
    if dst.numel() != src.numel():
        _fail(f"dst has {dst.numel()} elements, src {src.numel()}")
    _same_or_apart(src, dst)
    args = (src.numel(), exp_bits, man_bits, int(has_inf), int(saturate), int(subnormals), num_threads())
    if src.dtype == torch.float64:
        status = _fn("mixprec_round_nearest_f64")(
            src.data_ptr(), dst.data_ptr(), int(dst.dtype == torch.float64), *args
        )
    else:
        status = _fn("mixprec_round_nearest")(src.data_ptr(), DTYPE_CODES[src.dtype], dst.data_ptr(), *args)
    _status(status, f"mixprec_round_nearest for the format e{exp_bits}m{man_bits}")
    torch.autograd.graph.increment_version(dst)  # a raw-pointer write: tell autograd, as an in-place op would


def round_directed(
    src: torch.Tensor,
    u: torch.Tensor | None,
    dst: torch.Tensor,
    exp_bits: int,
    man_bits: int,
    has_inf: bool,
    saturate: bool,
    subnormals: bool,
) -> None:
    """Toward zero (``u`` None) or stochastic on the fp64 uniforms ``u`` (one per element), ``csrc/rounding.c``:
    fp32, fp16, bf16 or fp64 ``src`` into fp32 or fp64 ``dst``, all contiguous."""
    _flat("src", src, (*_FLOATS, torch.float64))
    _flat("dst", dst, (torch.float32, torch.float64))
    if dst.numel() != src.numel():
        _fail(f"dst has {dst.numel()} elements, src {src.numel()}")
    _same_or_apart(src, dst)
    if u is not None:
        _flat("u", u, (torch.float64,))
        if u.numel() != src.numel():
            _fail(f"u has {u.numel()} elements, src {src.numel()}")
    status = _fn("mixprec_round_directed")(
        src.data_ptr(), DTYPE_CODES[src.dtype], None if u is None else u.data_ptr(), dst.data_ptr(),
        int(dst.dtype == torch.float64), src.numel(), exp_bits, man_bits, int(has_inf), int(saturate),
        int(subnormals), num_threads(),
    )  # fmt: skip
    _status(status, f"mixprec_round_directed for the format e{exp_bits}m{man_bits}")
    torch.autograd.graph.increment_version(dst)


def fp32_sum_rows(shards: torch.Tensor, out: torch.Tensor, average: bool, factor: float | None) -> int:
    """``out = round(sum_r shards[r] (/ rows) (* factor))`` in fp32, rank order (``csrc/fp32sum.c``); returns how
    many results are NaN (their payload is the torch path's to decide). ``shards`` [P, n], rows contiguous."""
    _rows("shards", shards, _FLOATS)
    _flat("out", out, _FLOATS)
    if out.numel() != shards.shape[1]:
        _fail(f"out has {out.numel()} elements, a shard {shards.shape[1]}")
    nans = _fn("mixprec_fp32sum_rows")(
        shards.data_ptr(), DTYPE_CODES[shards.dtype], shards.stride(0), shards.shape[0], shards.shape[1],
        out.data_ptr(), DTYPE_CODES[out.dtype], int(average), int(factor is not None),
        0.0 if factor is None else factor, num_threads(),
    )  # fmt: skip
    if not (nans >= 0):
        _fail(f"mixprec_fp32sum_rows refused the dtypes {shards.dtype} -> {out.dtype}")
    torch.autograd.graph.increment_version(out)
    return int(nans)


def _check_encode(x: torch.Tensor, out: torch.Tensor, header_bytes: int, chunk_size: int) -> None:
    _rows("x", x, _FLOATS)
    _rows("out", out, (torch.uint8,))
    rows, length = x.shape
    want = header_bytes * -(-length // chunk_size) + length
    if not (chunk_size >= 1):
        _fail(f"chunk_size must be >= 1, got {chunk_size}")
    if tuple(out.shape) != (rows, want):
        _fail(f"out must be [{rows}, {want}], got {tuple(out.shape)}")


def quant_encode_u8(
    x: torch.Tensor, out: torch.Tensor, chunk_size: int, stochastic: bool, key: int, offset: int, row_stride: int
) -> int:
    """MinMaxUInt8's encode of the rows of ``x`` into the rows of ``out`` (``csrc/quantize_u8.c``); returns the
    number of chunks flagged non-finite. ``key`` is the Philox key (any int, taken modulo 2**64)."""
    _check_encode(x, out, 8, chunk_size)
    rows, length = x.shape
    bad = _fn("mixprec_quant_encode_u8")(
        x.data_ptr(), DTYPE_CODES[x.dtype], rows, length, x.stride(0), out.data_ptr(), out.stride(0), chunk_size,
        int(stochastic), key & _KEY_MASK, offset, row_stride, num_threads(),
    )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return int(bad)


def quant_encode_fp8(
    x: torch.Tensor,
    out: torch.Tensor,
    chunk_size: int,
    fmt: int,
    stochastic: bool,
    key: int,
    offset: int,
    row_stride: int,
) -> int:
    """ScaledFP8's encode (``fmt`` 0 = e4m3, 1 = e5m2; ``csrc/quantize_fp8.c``); returns the flagged chunks."""
    _check_encode(x, out, 4, chunk_size)
    if fmt not in (0, 1):
        _fail(f"fmt must be 0 (e4m3) or 1 (e5m2), got {fmt}")
    rows, length = x.shape
    bad = _fn("mixprec_quant_encode_fp8")(
        x.data_ptr(), DTYPE_CODES[x.dtype], rows, length, x.stride(0), out.data_ptr(), out.stride(0), chunk_size,
        fmt, int(stochastic), key & _KEY_MASK, offset, row_stride, num_threads(),
    )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return int(bad)


def _check_decode(buf: torch.Tensor, length: int, out: torch.Tensor, header_bytes: int, chunk: int, reduce: bool):
    _rows("buf", buf, (torch.uint8,))
    if not (chunk >= 1):
        _fail(f"chunk_size must be >= 1, got {chunk}")
    want = header_bytes * -(-length // chunk) + length
    if buf.shape[1] != want:
        _fail(f"buf rows must hold {want} bytes, got {buf.shape[1]}")
    if reduce:
        _flat("out", out, (torch.float32,))
        if not (out.numel() == length and buf.shape[0] >= 1):
            _fail(f"out must hold {length} elements and buf a row")
    else:
        _rows("out", out, _FLOATS)
        if tuple(out.shape) != (buf.shape[0], length):
            _fail(f"out must be [{buf.shape[0]}, {length}]")


def quant_decode_u8(buf: torch.Tensor, length: int, out: torch.Tensor, chunk_size: int, reduce: bool) -> int:
    """MinMaxUInt8's decode of the rows of ``buf`` into the rows of ``out`` (or their fp32 sum into the 1-D
    ``out`` with ``reduce``); returns the flagged chunks seen."""
    _check_decode(buf, length, out, 8, chunk_size, reduce)
    bad = _fn("mixprec_quant_decode_u8")(
        buf.data_ptr(), buf.shape[0], length, buf.stride(0), out.data_ptr(), DTYPE_CODES[out.dtype],
        out.stride(0), chunk_size, int(reduce), num_threads(),
    )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return int(bad)


def quant_decode_fp8(
    buf: torch.Tensor,
    length: int,
    out: torch.Tensor,
    chunk_size: int,
    table: torch.Tensor,
    table_fmt: int,
    reduce: bool,
) -> int:
    """ScaledFP8's decode: ``table[code] * scale`` (``table`` the 256 code values in fp32; ``table_fmt`` what
    :func:`fp8_table_format` said of it); returns the flagged chunks seen."""
    _check_decode(buf, length, out, 4, chunk_size, reduce)
    _flat("table", table, (torch.float32,))
    if table.numel() != 256:
        _fail(f"table must hold 256 values, got {table.numel()}")
    bad = _fn("mixprec_quant_decode_fp8")(
        buf.data_ptr(), buf.shape[0], length, buf.stride(0), out.data_ptr(), DTYPE_CODES[out.dtype],
        out.stride(0), chunk_size, table.data_ptr(), table_fmt, int(reduce),
        num_threads(),
    )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return int(bad)


def fp8_table_format(table: torch.Tensor) -> int:
    """Which fp8 format's arithmetic gives the 256 fp32 values of ``table`` (0 = e4m3fn, 1 = e5m2), or -1."""
    _flat("table", table, (torch.float32,))
    if table.numel() != 256:
        _fail(f"table must hold 256 values, got {table.numel()}")
    return int(_fn("mixprec_quant_fp8_table_format")(table.data_ptr()))


def philox_block(counter: torch.Tensor, key: torch.Tensor, out: torch.Tensor) -> None:
    """One Philox4x32-10 block: 4 int32 counter words, 2 key words, 4 output words (the tests' known answers)."""
    for name, t, n in (("counter", counter, 4), ("key", key, 2), ("out", out, 4)):
        _flat(name, t, (torch.int32,))
        if t.numel() != n:
            _fail(f"{name} must hold {n} words, got {t.numel()}")
    _fn("mixprec_quant_philox_block")(counter.data_ptr(), key.data_ptr(), out.data_ptr())
    torch.autograd.graph.increment_version(out)


def philox_bytes(key: int, first: int, out: torch.Tensor) -> None:
    """The primary bytes of stream positions ``[first, first + out.numel())`` of the stream ``key`` into ``out``."""
    _flat("out", out, (torch.uint8,))
    _fn("mixprec_quant_philox_bytes")(key & _KEY_MASK, first, out.numel(), out.data_ptr())
    torch.autograd.graph.increment_version(out)


def philox_tie_words(key: int, positions: torch.Tensor, out: torch.Tensor) -> None:
    """The secondary (tie) words of the int64 stream ``positions`` into int32 ``out``."""
    _flat("positions", positions, (torch.int64,))
    _flat("out", out, (torch.int32,))
    if out.numel() != positions.numel():
        _fail(f"out has {out.numel()} words, positions {positions.numel()}")
    _fn("mixprec_quant_philox_tie_words")(key & _KEY_MASK, positions.data_ptr(), positions.numel(), out.data_ptr())
    torch.autograd.graph.increment_version(out)


def matmul_model(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    k_group: int,
    promote_groups: int,
    mode: int,
    accumulator: tuple[int, int, int, float, float, float, bool],
) -> bool:
    """The emulated matmul of ``a`` [B, M, K] and ``b`` [B or 1, K, N] (fp32, fp16 or bf16, any strides; a batch
    stride of 0 for a shared operand) into the contiguous fp32 ``out`` [B, M, N] (``csrc/matmul.c``).
    ``accumulator``: (man_bits, emin, emax, max_finite, overflow value, min_normal, subnormals); ``mode`` 0 fp32,
    1 fp16, 2 any other accumulator. False when the kernel could not allocate its buffers (nothing usable)."""
    _cpu("a", a, _FLOATS)
    _cpu("b", b, (a.dtype,))
    _flat("out", out, (torch.float32,))
    if not (a.dim() == 3 and b.dim() == 3 and out.dim() == 3):
        _fail("a, b and out must be 3-D")
    nb, rows, k = a.shape
    if not (b.shape[0] in (1, nb) and b.shape[1] == k):
        _fail(f"b {tuple(b.shape)} does not fit a {tuple(a.shape)}")
    if tuple(out.shape) != (nb, rows, b.shape[2]):
        _fail(f"out must be {(nb, rows, b.shape[2])}")
    if not (1 <= k_group < 1 << 30 and mode in (0, 1, 2)):
        _fail(f"k_group {k_group} or mode {mode} out of range")
    man_bits, emin, emax, max_finite, overflow, min_normal, subnormals = accumulator
    sa, sb = a.stride(), b.stride()
    status = _fn("mixprec_matmul_model")(
        a.data_ptr(), sa[0] if nb > 1 else 0, sa[1], sa[2],
        b.data_ptr(), sb[0] if b.shape[0] > 1 else 0, sb[1], sb[2], DTYPE_CODES[a.dtype],
        out.data_ptr(), nb, rows, b.shape[2], k, k_group, promote_groups, mode,
        man_bits, emin, emax, max_finite, overflow, min_normal, int(subnormals), num_threads(),
    )  # fmt: skip
    torch.autograd.graph.increment_version(out)
    return status == 0


def _apart(name: str, a: torch.Tensor, b: torch.Tensor, other: str) -> None:
    """``a`` and ``b`` share no byte (their spans from the first to the last element read or written)."""
    if a.numel() == 0 or b.numel() == 0:
        return
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True)) + 1) * a.element_size()
    b1 = b0 + (sum((n - 1) * s for n, s in zip(b.shape, b.stride(), strict=True)) + 1) * b.element_size()
    if a0 < b1 and b0 < a1:
        _fail(f"{name} must not overlap {other}")


def mx_quantize(
    src: torch.Tensor,
    dst: torch.Tensor,
    scales: torch.Tensor | None,
    block: int,
    grid: tuple[int, int, float],
    scale_mode: int,
    tensor_scale: float | None,
    toward_zero: bool,
    dequantize: bool,
    key: int | None,
) -> None:
    """Block-scaled quantization of the contiguous blocks of ``block`` elements of ``src`` (``csrc/mx.c``): the
    elements (or, with ``dequantize``, their decoded values) into fp32 ``dst`` (``src`` itself when fp32, or apart
    from it), the decoded block scales into fp32 ``scales`` (one per block, or None). ``grid``: the element's
    exp_bits, man_bits and largest value; ``scale_mode`` one of :data:`MX_SCALE_MODES`; ``tensor_scale`` NVFP4's
    second level. ``key``: round stochastically on that Philox stream, element ``i`` at stream position ``i``."""
    _flat("src", src, _FLOATS)
    _flat("dst", dst, (torch.float32,))
    n = src.numel()
    if not (dst.numel() == n and block >= 1 and n % block == 0):
        _fail(f"dst has {dst.numel()} elements, src {n}, not whole blocks of {block}")
    _same_or_apart(src, dst)
    if scales is not None:
        _flat("scales", scales, (torch.float32,))
        if scales.numel() != n // block:
            _fail(f"scales must hold {n // block} values, got {scales.numel()}")
        _apart("scales", scales, src, "src")
        _apart("scales", scales, dst, "dst")
    if scale_mode not in MX_SCALE_MODES.values() or (key is not None and toward_zero):
        _fail(f"scale_mode {scale_mode}, toward_zero {toward_zero} with key {key}")
    exp_bits, man_bits, max_element = grid
    status = _fn("mixprec_mx_quantize")(
        src.data_ptr(), DTYPE_CODES[src.dtype], dst.data_ptr(), None if scales is None else scales.data_ptr(),
        n // block, block, exp_bits, man_bits, max_element, scale_mode, int(tensor_scale is not None),
        1.0 if tensor_scale is None else tensor_scale, int(toward_zero), int(dequantize), int(key is not None),
        0 if key is None else key & _KEY_MASK, 0, num_threads(),
    )  # fmt: skip
    _status(status, f"mixprec_mx_quantize for the grid e{exp_bits}m{man_bits}, block {block}")
    torch.autograd.graph.increment_version(dst)
    if scales is not None:
        torch.autograd.graph.increment_version(scales)


def _wire_nbytes(length: int, bits: int, block: int, chunk: int, nv: bool) -> int:
    """A block-scaled wire row's bytes (``BlockScaledWire.encoded_nbytes``): NVFP4's fp32 chunk scales, one scale
    byte per block, the codes."""
    return 4 * -(-length // chunk) * nv + -(-length // block) + (length if bits == 8 else -(-length // 2))


def mx_wire_encode(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    grid: tuple[int, int, float],
    scale_mode: int,
    block: int,
    chunk: int,
    nan_code: int,
    key: int | None,
    offset: int,
    row_stride: int,
) -> int:
    """``BlockScaledWire``'s encode of the rows of ``x`` (fp32, fp16 or bf16) into the rows of ``out``
    (``csrc/mx_wire.c``); returns the flagged blocks. ``residual`` (fp32, ``x``'s shape, or None): error feedback,
    the rows of ``fl32(x + residual)`` are encoded and ``residual`` gets what the encoding lost (a flagged block
    keeps its own). ``grid``: exp_bits, man_bits, largest element; ``chunk``: NVFP4's elements per fp32 scale
    (a multiple of ``block``); ``key``: stochastic rounding, element (r, j) at stream position
    ``offset + r * row_stride + j``. MemoryError when the kernel cannot allocate its buffers."""
    _rows("x", x, _FLOATS)
    _rows("out", out, (torch.uint8,))
    rows, length = x.shape
    exp_bits, man_bits, max_element = grid
    bits, nv = 1 + exp_bits + man_bits, scale_mode == MX_SCALE_MODES["e4m3"]
    if not (bits in (4, 8) and block >= 2 and chunk >= block and chunk % block == 0):
        _fail(f"grid e{exp_bits}m{man_bits}, block {block}, chunk {chunk}")
    want = _wire_nbytes(length, bits, block, chunk, nv)
    if tuple(out.shape) != (rows, want):
        _fail(f"out must be [{rows}, {want}], got {tuple(out.shape)}")
    if residual is not None:
        _rows("residual", residual, (torch.float32,))
        if residual.shape != x.shape:
            _fail(f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
        _apart("residual", residual, x, "x")
        _apart("residual", residual, out, "out")
    if not (offset >= 0 and row_stride >= 0):
        _fail(f"offset {offset} and row_stride {row_stride} must be >= 0")
    n_bad = _fn("mixprec_mx_wire_encode")(
        x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), out.data_ptr(), out.stride(0), rows, length, exp_bits,
        man_bits, max_element, scale_mode, block, bits, chunk, nan_code, int(key is not None),
        0 if key is None else key & _KEY_MASK, offset, row_stride, num_threads(),
    )  # fmt: skip
    if n_bad == -2:
        raise MemoryError("the compiled block-scaled wire encoder could not allocate its tile buffers")
    if not (n_bad >= 0):
        _fail(f"mixprec_mx_wire_encode rejected its arguments (status {n_bad})")
    torch.autograd.graph.increment_version(out)
    if residual is not None:
        torch.autograd.graph.increment_version(residual)
    return int(n_bad)


def mx_wire_decode(
    buf: torch.Tensor,
    length: int,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    grid: tuple[int, int],
    block: int,
    chunk: int,
    nv: bool,
    nan_code: int,
    reduce: bool,
) -> int:
    """``BlockScaledWire``'s decode of the rows of ``buf`` into the rows of ``out`` (fp32, fp16 or bf16), or with
    ``reduce`` their fp32 sum in row order into the 1-D fp32 ``out`` (``csrc/mx_wire.c``); returns the flagged
    blocks seen. ``tables``: the fp32 value of each element code (256, or 16 for 4-bit codes) and of each scale
    byte (256); ``grid``: the element's exp_bits, man_bits; ``nv``: rows start with NVFP4's chunk scales."""
    exp_bits, man_bits = grid
    bits = 1 + exp_bits + man_bits
    _rows("buf", buf, (torch.uint8,))
    if not (bits in (4, 8) and block >= 2 and chunk >= block and chunk % block == 0):
        _fail(f"grid e{exp_bits}m{man_bits}, block {block}, chunk {chunk}")
    want = _wire_nbytes(length, bits, block, chunk, nv)
    if buf.shape[1] != want:
        _fail(f"buf rows must hold {want} bytes, got {buf.shape[1]}")
    if reduce:
        _flat("out", out, (torch.float32,))
        if out.numel() != length:
            _fail(f"out must hold {length} elements, got {out.numel()}")
    else:
        _rows("out", out, _FLOATS)
        if tuple(out.shape) != (buf.shape[0], length):
            _fail(f"out must be [{buf.shape[0]}, {length}], got {tuple(out.shape)}")
    _apart("out", out, buf, "buf")
    elem_t, scale_t = tables
    for name, t, n in (("element table", elem_t, 256 if bits == 8 else 16), ("scale table", scale_t, 256)):
        _flat(name, t, (torch.float32,))
        if t.numel() != n:
            _fail(f"the {name} must hold {n} values, got {t.numel()}")
    n_bad = _fn("mixprec_mx_wire_decode")(
        buf.data_ptr(), buf.stride(0), buf.shape[0], length, out.data_ptr(), DTYPE_CODES[out.dtype],
        0 if reduce else out.stride(0), int(reduce), elem_t.data_ptr(), scale_t.data_ptr(), exp_bits, man_bits,
        block, chunk, int(nv), nan_code, num_threads(),
    )  # fmt: skip
    if not (n_bad >= 0):
        _fail(f"mixprec_mx_wire_decode rejected its arguments (status {n_bad})")
    torch.autograd.graph.increment_version(out)
    return int(n_bad)
