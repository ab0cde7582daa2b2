"""The compiled CPU kernels as ``torch.ops.mixprec`` custom ops, for torch.compile and torch dispatch modes.

A raw-pointer call is invisible to torch's tracers: under torch.compile (Dynamo, AOTAutograd), a
``TorchDispatchMode`` or a ``FakeTensorMode`` a caller used to take its torch path instead. Registered with
:func:`torch.library.custom_op` (with a fake implementation that gives the output's shape and dtype), a kernel
is one opaque node of the traced graph and runs compiled when the graph runs; a dispatch mode sees the op.
Callers ask :func:`mixprec.native.route`: ``"op"`` calls these functions, ``"kernel"`` the typed wrappers of
:mod:`mixprec.native.kernels` directly (the eager path: a custom op's dispatch costs about 20 us, more than a
small kernel call). Ops that write a caller's buffer declare it in ``mutates_args`` (torch bumps its version
counter and functionalizes the write); counts come back as 0-d int64 tensors. Not registered: the Philox test
helpers and the fp8 table check (no tracing caller).
The ops have no autograd formula: callers keep the torch path for inputs that need grad.
"""

from __future__ import annotations

import torch

from mixprec.native import kernels

__all__ = [
    "fp32_sum_rows",
    "matmul_model",
    "mx_quantize",
    "mx_wire_decode",
    "mx_wire_encode",
    "quant_decode_fp8",
    "quant_decode_u8",
    "quant_encode_fp8",
    "quant_encode_u8",
    "round_directed",
    "round_nearest",
]

_Tensor = torch.Tensor


def _signed(key: int) -> int:
    """A 64-bit key as the int64 a schema's ``int`` holds (the wrapper takes it back modulo 2**64)."""
    key &= (1 << 64) - 1
    return key - (1 << 64) if key >= 1 << 63 else key


def _count(n: int) -> _Tensor:
    return torch.tensor(n, dtype=torch.int64)


def _fake_count(t: _Tensor) -> _Tensor:
    return t.new_empty((), dtype=torch.int64)


@torch.library.custom_op("mixprec::round_nearest", device_types="cpu", mutates_args=())
def _round_nearest(
    x: _Tensor, exp_bits: int, man_bits: int, has_inf: bool, saturate: bool, subnormals: bool, f64_out: bool
) -> _Tensor:
    dst = torch.empty(x.shape, dtype=torch.float64 if f64_out else torch.float32)
    kernels.round_nearest(x.contiguous(), dst, exp_bits, man_bits, has_inf, saturate, subnormals)
    return dst


@_round_nearest.register_fake
def _(x, exp_bits, man_bits, has_inf, saturate, subnormals, f64_out):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape, dtype=torch.float64 if f64_out else torch.float32)


@torch.library.custom_op("mixprec::round_directed", device_types="cpu", mutates_args=())
def _round_directed(
    x: _Tensor,
    u: _Tensor | None,
    exp_bits: int,
    man_bits: int,
    has_inf: bool,
    saturate: bool,
    subnormals: bool,
    f64_out: bool,
) -> _Tensor:
    dst = torch.empty(x.shape, dtype=torch.float64 if f64_out else torch.float32)
    u = None if u is None else u.contiguous()
    kernels.round_directed(x.contiguous(), u, dst, exp_bits, man_bits, has_inf, saturate, subnormals)
    return dst


@_round_directed.register_fake
def _(x, u, exp_bits, man_bits, has_inf, saturate, subnormals, f64_out):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape, dtype=torch.float64 if f64_out else torch.float32)


@torch.library.custom_op("mixprec::fp32_sum_rows", device_types="cpu", mutates_args=("out",))
def _fp32_sum_rows(shards: _Tensor, out: _Tensor, average: bool, factor: float | None) -> _Tensor:
    return _count(kernels.fp32_sum_rows(shards, out, average, factor))


@_fp32_sum_rows.register_fake
def _(shards, out, average, factor):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::quant_encode_u8", device_types="cpu", mutates_args=("out",))
def _quant_encode_u8(
    x: _Tensor, out: _Tensor, chunk_size: int, stochastic: bool, key: int, offset: int, row_stride: int
) -> _Tensor:
    return _count(kernels.quant_encode_u8(x, out, chunk_size, stochastic, key, offset, row_stride))


@_quant_encode_u8.register_fake
def _(x, out, chunk_size, stochastic, key, offset, row_stride):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::quant_encode_fp8", device_types="cpu", mutates_args=("out",))
def _quant_encode_fp8(
    x: _Tensor, out: _Tensor, chunk_size: int, fmt: int, stochastic: bool, key: int, offset: int, row_stride: int
) -> _Tensor:
    return _count(kernels.quant_encode_fp8(x, out, chunk_size, fmt, stochastic, key, offset, row_stride))


@_quant_encode_fp8.register_fake
def _(x, out, chunk_size, fmt, stochastic, key, offset, row_stride):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::quant_decode_u8", device_types="cpu", mutates_args=("out",))
def _quant_decode_u8(buf: _Tensor, length: int, out: _Tensor, chunk_size: int, reduce: bool) -> _Tensor:
    return _count(kernels.quant_decode_u8(buf, length, out, chunk_size, reduce))


@_quant_decode_u8.register_fake
def _(buf, length, out, chunk_size, reduce):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::quant_decode_fp8", device_types="cpu", mutates_args=("out",))
def _quant_decode_fp8(
    buf: _Tensor, length: int, out: _Tensor, chunk_size: int, table: _Tensor, table_fmt: int, reduce: bool
) -> _Tensor:
    return _count(kernels.quant_decode_fp8(buf, length, out, chunk_size, table, table_fmt, reduce))


@_quant_decode_fp8.register_fake
def _(buf, length, out, chunk_size, table, table_fmt, reduce):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::matmul_model", device_types="cpu", mutates_args=())
def _matmul_model(
    a: _Tensor,
    b: _Tensor,
    k_group: int,
    promote_groups: int,
    mode: int,
    man_bits: int,
    emin: int,
    emax: int,
    max_finite: float,
    overflow: float,
    min_normal: float,
    subnormals: bool,
) -> _Tensor:
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    acc = (man_bits, emin, emax, max_finite, overflow, min_normal, subnormals)
    if not kernels.matmul_model(a, b, out, k_group, promote_groups, mode, acc):
        # no torch path to fall back to inside a traced graph
        raise MemoryError("the compiled emulated matmul could not allocate its packing buffers")
    return out


@_matmul_model.register_fake
def _(a, b, k_group, promote_groups, mode, man_bits, emin, emax, max_finite, overflow, min_normal, subnormals):  # type: ignore[no-untyped-def]
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.float32)


@torch.library.custom_op("mixprec::mx_quantize", device_types="cpu", mutates_args=())
def _mx_quantize(
    x: _Tensor,
    block: int,
    exp_bits: int,
    man_bits: int,
    max_element: float,
    scale_mode: int,
    tensor_scale: _Tensor | None,
    toward_zero: bool,
    dequantize: bool,
    stochastic: bool,
    key: int,
) -> tuple[_Tensor, _Tensor]:
    dst = torch.empty(x.shape, dtype=torch.float32)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32)
    ts = None if tensor_scale is None else float(tensor_scale)
    grid = (exp_bits, man_bits, max_element)
    key_ = key if stochastic else None
    kernels.mx_quantize(x.contiguous(), dst, scales, block, grid, scale_mode, ts, toward_zero, dequantize, key_)
    return dst, scales


@_mx_quantize.register_fake
def _(x, block, exp_bits, man_bits, max_element, scale_mode, tensor_scale, toward_zero, dequantize, stochastic, key):  # type: ignore[no-untyped-def]
    scales = x.new_empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float32), scales


@torch.library.custom_op("mixprec::mx_wire_encode", device_types="cpu", mutates_args=("out", "residual"))
def _mx_wire_encode(
    x: _Tensor,
    residual: _Tensor | None,
    out: _Tensor,
    exp_bits: int,
    man_bits: int,
    max_element: float,
    scale_mode: int,
    block: int,
    chunk: int,
    nan_code: int,
    stochastic: bool,
    key: int,
    offset: int,
    row_stride: int,
) -> _Tensor:
    grid = (exp_bits, man_bits, max_element)
    key_ = key if stochastic else None
    return _count(
        kernels.mx_wire_encode(x, residual, out, grid, scale_mode, block, chunk, nan_code, key_, offset, row_stride)
    )


@_mx_wire_encode.register_fake
def _(x, residual, out, *args):  # type: ignore[no-untyped-def]
    return _fake_count(out)


@torch.library.custom_op("mixprec::mx_wire_decode", device_types="cpu", mutates_args=("out",))
def _mx_wire_decode(
    buf: _Tensor,
    length: int,
    out: _Tensor,
    elem_table: _Tensor,
    scale_table: _Tensor,
    exp_bits: int,
    man_bits: int,
    block: int,
    chunk: int,
    nv: bool,
    nan_code: int,
    reduce: bool,
) -> _Tensor:
    tables = (elem_table, scale_table)
    return _count(
        kernels.mx_wire_decode(buf, length, out, tables, (exp_bits, man_bits), block, chunk, nv, nan_code, reduce)
    )


@_mx_wire_decode.register_fake
def _(buf, length, out, elem_table, scale_table, exp_bits, man_bits, block, chunk, nv, nan_code, reduce):  # type: ignore[no-untyped-def]
    return _fake_count(out)


# The callers' entry points: each calls its op through torch.ops, which Dynamo puts in the graph as one node.
def round_nearest(x: _Tensor, fmt: tuple[int, int, bool, bool, bool], f64_out: bool) -> _Tensor:
    """``round_to(x, fmt, "nearest")`` into a new fp32 (fp64 with ``f64_out``, fp64 ``x`` only) tensor.
    ``fmt``: (exp_bits, man_bits, has_inf, saturate, subnormals)."""
    return torch.ops.mixprec.round_nearest(x, *fmt, f64_out)


def round_directed(x: _Tensor, u: _Tensor | None, fmt: tuple[int, int, bool, bool, bool], f64_out: bool) -> _Tensor:
    """Toward zero (``u`` None) or stochastic on the fp64 uniforms ``u``, into a new tensor."""
    return torch.ops.mixprec.round_directed(x, u, *fmt, f64_out)


def fp32_sum_rows(shards: _Tensor, out: _Tensor, average: bool, factor: float | None) -> _Tensor:
    """:func:`mixprec.native.kernels.fp32_sum_rows`; the NaN count as a 0-d tensor."""
    return torch.ops.mixprec.fp32_sum_rows(shards, out, average, factor)


def quant_encode_u8(
    x: _Tensor, out: _Tensor, chunk_size: int, stochastic: bool, key: int, offset: int, row_stride: int
) -> _Tensor:
    """:func:`mixprec.native.kernels.quant_encode_u8`; the flagged chunks as a 0-d tensor."""
    return torch.ops.mixprec.quant_encode_u8(x, out, chunk_size, stochastic, _signed(key), offset, row_stride)


def quant_encode_fp8(
    x: _Tensor, out: _Tensor, chunk_size: int, fmt: int, stochastic: bool, key: int, offset: int, row_stride: int
) -> _Tensor:
    """:func:`mixprec.native.kernels.quant_encode_fp8`; the flagged chunks as a 0-d tensor."""
    return torch.ops.mixprec.quant_encode_fp8(x, out, chunk_size, fmt, stochastic, _signed(key), offset, row_stride)


def quant_decode_u8(buf: _Tensor, length: int, out: _Tensor, chunk_size: int, reduce: bool) -> _Tensor:
    """:func:`mixprec.native.kernels.quant_decode_u8`; the flagged chunks as a 0-d tensor."""
    return torch.ops.mixprec.quant_decode_u8(buf, length, out, chunk_size, reduce)


def quant_decode_fp8(
    buf: _Tensor, length: int, out: _Tensor, chunk_size: int, table: _Tensor, table_fmt: int, reduce: bool
) -> _Tensor:
    """:func:`mixprec.native.kernels.quant_decode_fp8`; the flagged chunks as a 0-d tensor."""
    return torch.ops.mixprec.quant_decode_fp8(buf, length, out, chunk_size, table, table_fmt, reduce)


def matmul_model(
    a: _Tensor,
    b: _Tensor,
    k_group: int,
    promote_groups: int,
    mode: int,
    accumulator: tuple[int, int, int, float, float, float, bool],
) -> _Tensor:
    """:func:`mixprec.native.kernels.matmul_model` into a new fp32 [B, M, N] tensor (MemoryError when the kernel
    cannot allocate: a traced graph has no torch path to fall back to)."""
    return torch.ops.mixprec.matmul_model(a, b, k_group, promote_groups, mode, *accumulator)


def mx_quantize(
    x: _Tensor,
    block: int,
    grid: tuple[int, int, float],
    scale_mode: int,
    tensor_scale: _Tensor | None,
    toward_zero: bool,
    dequantize: bool,
    key: int | None,
) -> tuple[_Tensor, _Tensor]:
    """:func:`mixprec.native.kernels.mx_quantize` of ``x`` (blocks along its last axis) into new tensors: (the
    elements or their decoded values, fp32 in ``x``'s shape; the block scales, [..., blocks])."""
    return torch.ops.mixprec.mx_quantize(
        x, block, *grid, scale_mode, tensor_scale, toward_zero, dequantize, key is not None, _signed(key or 0)
    )


def mx_wire_encode(
    x: _Tensor,
    residual: _Tensor | None,
    out: _Tensor,
    grid: tuple[int, int, float],
    scale_mode: int,
    block: int,
    chunk: int,
    nan_code: int,
    key: int | None,
    offset: int,
    row_stride: int,
) -> _Tensor:
    """:func:`mixprec.native.kernels.mx_wire_encode`; the flagged blocks as a 0-d tensor."""
    return torch.ops.mixprec.mx_wire_encode(
        x, residual, out, *grid, scale_mode, block, chunk, nan_code, key is not None, _signed(key or 0), offset,
        row_stride,
    )  # fmt: skip


def mx_wire_decode(
    buf: _Tensor,
    length: int,
    out: _Tensor,
    tables: tuple[_Tensor, _Tensor],
    grid: tuple[int, int],
    block: int,
    chunk: int,
    nv: bool,
    nan_code: int,
    reduce: bool,
) -> _Tensor:
    """:func:`mixprec.native.kernels.mx_wire_decode`; the flagged blocks as a 0-d tensor."""
    return torch.ops.mixprec.mx_wire_decode(buf, length, out, *tables, *grid, block, chunk, nv, nan_code, reduce)
