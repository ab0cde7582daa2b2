"""Bit-exact rounding of tensors to a :class:`FloatFormat`: ``round_to`` and its in-place twin ``round_to_``.

Results are held in fp32 (every supported format is a subset of fp32) and are bit-exact with torch's own casts
``x.to(dtype).float()`` for fp16, bf16, float8_e4m3fn and float8_e5m2 on fp32/fp16/bf16 inputs: ties to even,
subnormals, overflow, signed zeros and NaN (NaN payloads are not reproduced). torch before 2.13 casts e4m3fn
overflow to NaN rather than 448: ``FloatFormat(4, 3, has_inf=False)`` matches those versions. fp64 inputs are
rounded once, directly from fp64. Modes: ``"nearest"`` (ties to even), ``"toward_zero"`` and ``"stochastic"``
(unbiased).

Overflow: nearest and stochastic give +-max if ``fmt.saturate``, else +-inf (NaN for formats without inf);
toward_zero sends finite inputs to +-max. ``fmt.subnormals=False`` flushes results below the smallest normal.

Round to nearest runs as one compiled pass when a kernel is available (``mixprec.native``'s ``rounding.c`` on
CPU tensors, its Triton twin on CUDA ones), toward_zero and stochastic as one compiled pass on CPU tensors (on
the torch path's own uniforms), else as the torch ops below, which stay the fallback and the oracle (same bits,
NaN payloads aside; docs/native.md).
The in-place work-tensor primitives (``round_nearest_grid_``, ``apply_overflow_``, ``flush_subnormals_``,
``round_directed_``) are public for the matmul emulator's hot loop. How each rounding is computed (the integer
trick, the "magic constant" addition, stochastic draws) is derived in ``docs/emulate.md``.
"""

from __future__ import annotations

from typing import Literal

import torch

import mixprec.native as native
from mixprec.core.formats import FloatFormat, get_format
from mixprec.core.validate import check_choice, check_tensor
from mixprec.native import gpu, kernels, ops

__all__ = ["ROUNDING_MODES", "Rounding", "round_to", "round_to_"]

Rounding = Literal["nearest", "toward_zero", "stochastic"]
ROUNDING_MODES: tuple[str, ...] = ("nearest", "toward_zero", "stochastic")

_INPUT_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

# work dtype -> (int view dtype, fraction bits M, exponent bias, exponent-field mask, sign mask)
_WORK = {
    torch.float32: (torch.int32, 23, 127, 0x7F800000, -(1 << 31)),
    torch.float64: (torch.int64, 52, 1023, 0x7FF0000000000000, -(1 << 63)),
}


def _pow2_bits(e: int, work: torch.dtype) -> int:
    """Bit pattern of ``2**e`` in the work dtype (normal range)."""
    _, m_bits, bias, _, _ = _WORK[work]
    return (e + bias) << m_bits


def _magic_ok(fmt: FloatFormat, work: torch.dtype) -> bool:
    m_bits = _WORK[work][1]
    return m_bits - fmt.man_bits >= 2 and (fmt.exp_bits <= 7 or work == torch.float64)


def round_nearest_grid_(w: torch.Tensor, fmt: FloatFormat, c: torch.Tensor, *, keep_zero_sign: bool = True) -> None:
    """Round ``w`` (fp32/fp64, in place) to nearest-even on ``fmt``'s grid, exponent range unbounded above
    (overflow is left to the caller). ``c`` is an int workspace shaped like ``w``.

    5 passes over memory (and, clamp, add on the int workspace; add and subtract on ``w``), plus 2 to keep the
    sign of results that round to zero (``x + C - C`` gives +0)."""
    int_dtype, m_bits, _, exp_mask, sign_mask = _WORK[w.dtype]
    bits = w.view(int_dtype)
    sign = torch.bitwise_and(bits, sign_mask) if keep_zero_sign else None
    torch.bitwise_and(bits, exp_mask, out=c)
    c.clamp_(_pow2_bits(fmt.emin, w.dtype), _pow2_bits(fmt.emax + 1, w.dtype))
    c.add_(((m_bits - fmt.man_bits) << m_bits) | (1 << (m_bits - 1)))
    magic = c.view(w.dtype)
    w.add_(magic).sub_(magic)
    if sign is not None:
        bits.bitwise_or_(sign)


def _nearest_int_trick_(w: torch.Tensor, fmt: FloatFormat) -> None:
    """Round fp32 ``w`` in place to nearest-even for a format with 8 exponent bits (fp32's own range)."""
    drop = 23 - fmt.man_bits
    if drop == 0:
        return
    nan = torch.isnan(w)
    has_nan = bool(nan.any())
    if has_nan:
        w.masked_fill_(nan, 0.0)  # a NaN pattern plus the rounding increment could wrap into the sign bit
    bits = w.view(torch.int32)
    inc = torch.bitwise_right_shift(bits, drop)
    inc.bitwise_and_(1).add_((1 << (drop - 1)) - 1)
    bits.add_(inc).bitwise_and_(~((1 << drop) - 1))
    if has_nan:
        w.masked_fill_(nan, float("nan"))


def _overflow_value(fmt: FloatFormat) -> float:
    if fmt.saturate:
        return fmt.max_finite
    return float("inf") if fmt.has_inf else float("nan")


def apply_overflow_(w: torch.Tensor, fmt: FloatFormat) -> None:
    """Map magnitudes above ``fmt.max_finite`` (inf included) to +-max, +-inf or NaN per ``fmt``, in place."""
    if w.numel() == 0:
        return
    big = fmt.max_finite
    if fmt.saturate:
        w.clamp_(-big, big)  # NaN stays NaN
        return
    lo, hi = torch.aminmax(w)
    if bool(lo >= -big) and bool(hi <= big):  # False with a NaN anywhere: then check element by element
        return
    over = w.abs() > big
    if bool(over.any()):
        value = _overflow_value(fmt)
        w.copy_(torch.where(over, torch.copysign(torch.full_like(w, value), w), w))


def flush_subnormals_(w: torch.Tensor, fmt: FloatFormat) -> None:
    if fmt.subnormals:
        return
    tiny = (w.abs() < fmt.min_normal) & (w != 0)
    w.mul_(~tiny)  # x * 0 keeps the sign of x


def _round_nearest_work_(w: torch.Tensor, fmt: FloatFormat) -> None:
    """Round to nearest in place; ``w`` is fp32 (with a format it can handle) or fp64."""
    if fmt.is_fp32 and w.dtype == torch.float32:
        return
    if w.dtype == torch.float32 and fmt.exp_bits == 8:
        _nearest_int_trick_(w, fmt)
    else:
        round_nearest_grid_(w, fmt, torch.empty_like(w.view(_WORK[w.dtype][0])))
    apply_overflow_(w, fmt)
    flush_subnormals_(w, fmt)


def round_directed_(w: torch.Tensor, fmt: FloatFormat, rounding: str, generator: torch.Generator | None) -> None:
    """toward_zero / stochastic in place on fp64 ``w``."""
    int_dtype, m_bits, _, exp_mask, _ = _WORK[torch.float64]
    x0 = w.clone()
    c = torch.bitwise_and(w.view(int_dtype), exp_mask)
    c.clamp_(_pow2_bits(fmt.emin, torch.float64), _pow2_bits(fmt.emax + 1, torch.float64))
    spacing = (c - (fmt.man_bits << m_bits)).view(torch.float64)  # 2**(e - man_bits): the grid at x
    round_nearest_grid_(w, fmt, torch.empty_like(c), keep_zero_sign=False)
    rounded_away = w.abs() > x0.abs()
    trunc = torch.where(rounded_away, w - torch.copysign(spacing, x0), w)
    if rounding == "toward_zero":
        result = trunc
        finite_over = torch.isfinite(x0) & (result.abs() > fmt.max_finite)
        result = torch.where(finite_over, torch.copysign(torch.full_like(result, fmt.max_finite), x0), result)
    else:
        frac = (x0.abs() - trunc.abs()) / spacing  # exact: Sterbenz, and a power-of-two divisor
        u = torch.rand(x0.shape, generator=generator, dtype=torch.float64, device=x0.device)
        result = trunc + torch.copysign(spacing, x0) * (u < frac)
    w.copy_(torch.copysign(result, x0))  # zeros keep the input's sign
    apply_overflow_(w, fmt)
    flush_subnormals_(w, fmt)


# source dtypes the kernels read directly; float8 is widened to fp32 by torch's (exact) cast first
_KERNEL_SRC = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _path(x: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """What rounds ``x`` (into ``out``, if given): ``"kernel"`` (the compiled CPU kernel, called directly),
    ``"op"`` (the same kernel as ``torch.ops.mixprec``, under torch.compile or a dispatch mode:
    :func:`mixprec.native.route`), ``"gpu"`` (Triton, :mod:`mixprec.native.gpu`) or None (the torch path). Never
    a kernel while autograd records: the torch path's result tracks ``x``'s graph, a kernel's cannot. One call
    for all the tensors: on the GPU these checks are a good part of a small call's host time."""
    ts = (x,) if out is None else (x, out)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None
    if x.device.type == "cpu":
        return native.route(*ts)
    return "gpu" if not torch.compiler.is_compiling() and gpu.can_run(*ts) else None


def _fmt_args(fmt: FloatFormat) -> tuple[int, int, bool, bool, bool]:
    return fmt.exp_bits, fmt.man_bits, fmt.has_inf, fmt.saturate, fmt.subnormals


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors intersects."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _native_round_nearest(path: str, src: torch.Tensor, dst: torch.Tensor, fmt: FloatFormat) -> None:
    """Round contiguous ``src`` to nearest into contiguous ``dst`` (``src`` itself or disjoint from it) with the
    compiled kernel (``path`` "kernel" or "gpu"): fp32/fp16/bf16 into fp32, or fp64 into fp64 or fp32."""
    if path == "gpu":
        (gpu.round_nearest_f64 if src.dtype == torch.float64 else gpu.round_nearest)(src, dst, fmt)
    else:
        kernels.round_nearest(src, dst, *_fmt_args(fmt))


def _kernel_buffers(
    x: torch.Tensor, out: torch.Tensor | None, writable: tuple[torch.dtype, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous source a kernel reads (``x``, or float8 widened exactly by torch's cast) and the
    contiguous buffer it writes: ``out`` when it is of a ``writable`` dtype and is the source itself or does not
    overlap it, else a temporary (our own fp32 source is rounded in place) that the caller copies to ``out``."""
    if x.dtype in _KERNEL_SRC:
        src = x.contiguous()
    else:
        src = x.to(torch.float32, memory_format=torch.contiguous_format)
    if out is not None and out.dtype in writable:
        if out.is_contiguous() and out.data_ptr() == src.data_ptr() and out.dtype == src.dtype:
            return src, out  # out is x: in place
        if out.is_contiguous() and not _overlap(out, src):
            return src, out
        return src, torch.empty(x.shape, dtype=out.dtype, device=x.device)
    if src is not x and src.dtype == torch.float32:
        return src, src
    return src, torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _round_op(
    x: torch.Tensor, fmt: FloatFormat, rounding: str, generator: torch.Generator | None, out: torch.Tensor | None
) -> torch.Tensor:
    """round_to through the ``torch.ops.mixprec`` ops (torch.compile, dispatch modes): traceable, no pointers;
    the same kernels and the same uniforms as the direct calls, so the same bits."""
    src = x if x.dtype in _KERNEL_SRC else x.to(torch.float32)
    f64_out = out is not None and out.dtype == torch.float64 and (rounding != "nearest" or x.dtype == torch.float64)
    if rounding == "nearest":
        y = ops.round_nearest(src, _fmt_args(fmt), f64_out)
    else:
        u = None
        if rounding == "stochastic":
            u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
        y = ops.round_directed(src, u, _fmt_args(fmt), f64_out)
    return y if out is None else out.copy_(y)


def _round_to_native(x: torch.Tensor, fmt: FloatFormat, out: torch.Tensor | None) -> torch.Tensor | None:
    """round_to(x, fmt, "nearest", out=out) through a compiled kernel; None when none can run here (no library,
    autograd), and the torch path must."""
    path = _path(x, out)  # also None for an out on another device
    if path is None:
        return None
    if path == "op":
        return _round_op(x, fmt, "nearest", None, out)
    fp64 = x.dtype == torch.float64  # only fp64 input has an fp64 kernel output
    src, dst = _kernel_buffers(x, out, (torch.float32, torch.float64) if fp64 else (torch.float32,))
    _native_round_nearest(path, src, dst, fmt)
    if out is None or dst is out:
        return dst
    return out.copy_(dst)


def _round_directed_native(
    x: torch.Tensor, fmt: FloatFormat, rounding: str, generator: torch.Generator | None, out: torch.Tensor | None
) -> torch.Tensor | None:
    """round_to(x, fmt, rounding, generator, out=out) for toward_zero / stochastic through the compiled kernel,
    on the torch path's own uniforms (the same ``torch.rand`` call, so the same draws from ``generator``); None
    where it cannot run (no library, not a CPU tensor, autograd), and the torch path must."""
    path = _path(x, out)
    if path == "op":
        return _round_op(x, fmt, rounding, generator, out)
    if path != "kernel":  # CUDA tensors keep the torch path for these modes
        return None
    src, dst = _kernel_buffers(x, out, (torch.float32, torch.float64))
    u = None
    if rounding == "stochastic":
        u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
    kernels.round_directed(src, u, dst, *_fmt_args(fmt))
    if out is None or dst is out:
        return dst
    return out.copy_(dst)


def _check_input(x: object, name: str) -> torch.Tensor:
    return check_tensor(name, x, _INPUT_DTYPES)


def _check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")


def round_to(
    x: torch.Tensor,
    fmt: FloatFormat | str | torch.dtype,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` to the format ``fmt``; returns an fp32 tensor (or ``out``) holding representable values.

    Args:
        x: fp32, fp16, bf16, float8 (widened to fp32 exactly) or fp64 (rounded once, directly from fp64).
        fmt: a :class:`FloatFormat`, a preset name (``"fp16"``, ``"bf16"``, ``"tf32"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``, ``"fp32"``), a torch dtype that has a preset, or a block-scaled format name
            (``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4_e2m1"``, ``"nvfp4"``:
            the fake-quant shorthand for ``mx_quantize(x, fmt, rounding=...).dequantize()``, blocks along the
            last axis with the format's default scale mode; see docs/mx.md).
        rounding: ``"nearest"`` (ties to even), ``"toward_zero"`` or ``"stochastic"`` (unbiased; one of the two
            neighbours, drawn from ``generator`` or torch's global generator).
        generator: a ``torch.Generator`` on ``x``'s device, used by ``"stochastic"`` only.
        out: optional fp32 or fp64 tensor of ``x``'s shape and device to write into (may be ``x`` itself).

    Error: round to nearest is within ``fmt.unit_roundoff`` relative (normal range; half a subnormal spacing
    absolute below it), toward_zero within ``fmt.eps``; stochastic within ``fmt.eps`` with zero mean.
    """
    _check_input(x, "x")
    block_scaled = isinstance(fmt, str) and fmt.startswith(("mxfp", "nvfp"))
    if not block_scaled:
        fmt = get_format(fmt)
    check_choice("rounding", rounding, ROUNDING_MODES)
    _check_generator(generator)
    if out is not None:
        check_tensor("out", out, (torch.float32, torch.float64))
        if out.shape != x.shape or out.device != x.device:
            raise ValueError(f"out must have x's shape {tuple(x.shape)} and device {x.device}; got {tuple(out.shape)}")
    if block_scaled:
        from mixprec.core import mx  # function-level: core.mx builds on this module

        if out is None or out.dtype == torch.float32:
            return mx.fake_quantize(x, fmt, rounding, generator, out=out)
        return out.copy_(mx.fake_quantize(x, fmt, rounding, generator))
    if x.device.type == "meta":  # shape and dtype only, as torch's ops give on meta tensors
        return torch.empty_like(x, dtype=torch.float32) if out is None else out
    done = (
        _round_to_native(x, fmt, out)
        if rounding == "nearest"
        else _round_directed_native(x, fmt, rounding, generator, out)
    )
    if done is not None:
        return done
    if x.dtype == torch.float64 or rounding != "nearest" or not _magic_or_trick_ok(fmt):
        w = x.to(torch.float64, copy=True, memory_format=torch.contiguous_format)
    elif out is not None and out.dtype == torch.float32 and out.is_contiguous():
        w = out.copy_(x)  # round in the caller's buffer: no temporary
    else:
        w = x.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    if rounding == "nearest":
        _round_nearest_work_(w, fmt)
    else:
        round_directed_(w, fmt, rounding, generator)
    if out is None:
        return w.to(torch.float32)
    if w is not out:
        out.copy_(w)
    return out


def _magic_or_trick_ok(fmt: FloatFormat) -> bool:
    """True when round to nearest can work in fp32 (int trick for 8 exponent bits, else the magic constant)."""
    return fmt.exp_bits == 8 or _magic_ok(fmt, torch.float32)


def round_to_(
    x: torch.Tensor,
    fmt: FloatFormat | str | torch.dtype,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """In-place :func:`round_to` on an fp32 or fp64 tensor ``x`` (which keeps its dtype); returns ``x``.

    fp32 with round to nearest works in place without an fp64 copy; an fp64 ``x`` is rounded directly from
    its fp64 values (one rounding)."""
    _check_input(x, "x")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"round_to_ needs an fp32 or fp64 tensor to round in place; got {x.dtype} (use round_to)")
    fmt = get_format(fmt)
    check_choice("rounding", rounding, ROUNDING_MODES)
    _check_generator(generator)
    if x.is_leaf and x.requires_grad and torch.is_grad_enabled():  # torch's own rule (and words) for in-place ops
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    if x.device.type == "meta":  # no values to round: the result is x, as an in-place torch op gives
        return x
    if rounding == "nearest" and (path := _path(x)) is not None:
        if fmt.is_fp32 and x.dtype == torch.float32:
            return x
        if path == "op":
            return _round_op(x, fmt, "nearest", None, x)
        w = x if x.is_contiguous() else x.contiguous()
        _native_round_nearest(path, w, w, fmt)
        if w is not x:
            x.copy_(w)
        return x
    if rounding == "nearest" and (x.dtype == torch.float64 or _magic_or_trick_ok(fmt)):
        if x.is_contiguous():
            _round_nearest_work_(x, fmt)
        else:
            w = x.contiguous()
            _round_nearest_work_(w, fmt)
            x.copy_(w)
        return x
    if rounding != "nearest" and _round_directed_native(x, fmt, rounding, generator, x) is not None:
        return x
    w = x.to(torch.float64, copy=True, memory_format=torch.contiguous_format)
    if rounding == "nearest":
        _round_nearest_work_(w, fmt)
    else:
        round_directed_(w, fmt, rounding, generator)
    x.copy_(w)
    return x
