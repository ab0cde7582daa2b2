"""Block-scaled formats (OCP MX, NVFP4): bit-exact quantization with every scale convention in use.

:func:`mx_quantize` cuts a tensor into blocks (``block_size`` elements along ``axis``, or 2-D tiles such as
16x16), gives each block one scale and rounds ``x / scale`` to the element grid: MXFP8 (e4m3, e5m2), MXFP6
(e2m3, e3m2) and MXFP4 (e2m1) with a power-of-two E8M0 scale per 32 elements, and NVFP4 (e2m1, an E4M3 scale per
16 elements, optionally under an fp32 tensor scale). Elements are held as fp32 values on the element grid and
saturate at the element's largest value, as every reference does. Scale conventions (``SCALE_MODES``):
``floor`` (OCP MX v1.0), ``ceil``, ``even`` and ``rceil`` (torchao's ``ScaleCalculationMode``; ``rceil`` is
cuBLAS's and Transformer Engine's), ``neuron`` (AWS Neuron's doubled scale) and ``e4m3`` (NVFP4). Rounding is to
nearest (ties to even), toward zero, or stochastic on mixprec's Philox stream (:mod:`mixprec.core.philox`):
one key per call from ``generator``, or a caller's ``key`` and stream ``positions`` (what a wire that encodes a
tensor in pieces passes, so that every piece draws the bits of one encode of the whole).
:func:`hadamard_transform` (from :mod:`mixprec.core.hadamard`) is the NVFP4 recipe's random Hadamard transform.

Blocks along the last axis of a CPU tensor go through one compiled pass (``mixprec.native``'s ``mx.c``) when the
kernel library is loaded; everything else (other axes, 2-D tiles, explicit stream ``positions``, CUDA) is
vectorised torch code on one fp32 copy of ``x``, which is also the kernel's oracle.
Formulas, sources, special values and where the references disagree: ``docs/mx.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

import mixprec.native as native
from mixprec.core.formats import FloatFormat
from mixprec.core.hadamard import hadamard_matrix, hadamard_transform, random_signs
from mixprec.core.philox import draw_key, round_up, stream_bytes
from mixprec.core.rounding import ROUNDING_MODES, round_nearest_grid_, round_to_
from mixprec.core.validate import check_choice, check_positive_int, check_tensor
from mixprec.native import kernels, ops

__all__ = [
    "MX_FORMATS",
    "SCALE_MODES",
    "BlockFormat",
    "BlockScaled",
    "fake_quantize",
    "get_block_format",
    "hadamard_matrix",
    "hadamard_transform",
    "mx_quantize",
    "random_signs",
    "round_elements",
    "stream_positions",
]

ScaleMode = Literal["floor", "ceil", "even", "rceil", "neuron", "e4m3"]
E8M0_MODES: tuple[str, ...] = ("floor", "ceil", "even", "rceil", "neuron")
SCALE_MODES: tuple[str, ...] = (*E8M0_MODES, "e4m3")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: element grid, its largest value, the scale type and the default block size."""

    name: str
    element: FloatFormat  # the element grid; its own overflow rule is unused (elements saturate at max_element)
    max_element: float
    scale: Literal["e8m0", "e4m3"]
    block_size: int

    @property
    def emax(self) -> int:
        """Exponent of the largest element (``floor(log2(max_element))``), the ``emax_elem`` of OCP MX."""
        return math.frexp(self.max_element)[1] - 1


# Element grids: 1 sign, e exponent and m fraction bits, bias 2**(e-1) - 1, subnormals. fp6/fp4 have no inf and
# no NaN (every pattern is finite); has_inf=True below only fixes emin and leaves the top binade open, and
# round_elements clamps to max_element first, so the FloatFormat's own max_finite never applies.
MX_FORMATS: dict[str, BlockFormat] = {
    "mxfp8_e4m3": BlockFormat("mxfp8_e4m3", FloatFormat(4, 3, has_inf=False, saturate=True), 448.0, "e8m0", 32),
    "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", FloatFormat(5, 2, saturate=True), 57344.0, "e8m0", 32),
    "mxfp6_e2m3": BlockFormat("mxfp6_e2m3", FloatFormat(2, 3), 7.5, "e8m0", 32),
    "mxfp6_e3m2": BlockFormat("mxfp6_e3m2", FloatFormat(3, 2), 28.0, "e8m0", 32),
    "mxfp4_e2m1": BlockFormat("mxfp4_e2m1", FloatFormat(2, 1), 6.0, "e8m0", 32),
    "nvfp4": BlockFormat("nvfp4", FloatFormat(2, 1), 6.0, "e4m3", 16),
}

_E4M3 = FloatFormat(4, 3, has_inf=False, saturate=True)
_E4M3_MIN_NORMAL = 2.0**-6  # NVFP4 block scales are clamped to [2**-6, 448] before the E4M3 cast
_E4M3_MAX = 448.0


def get_block_format(fmt: object, *, arg: str = "fmt") -> BlockFormat:
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str) and fmt in MX_FORMATS:
        return MX_FORMATS[fmt]
    raise ValueError(f"{arg} must be one of {', '.join(map(repr, MX_FORMATS))}; got {fmt!r}")


# ------------------------------------------------------------------------------------------------ layout
class _Layout:
    """Maps a tensor to ``[..., n_blocks, block]`` (blocks on the last dim) and back."""

    def __init__(self, shape: torch.Size, block: tuple[int, ...], dims: tuple[int, ...]) -> None:
        self.shape, self.block, self.dims = shape, block, dims
        nd = len(shape)
        self.dst = tuple(range(nd - len(dims), nd))

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        t = t.movedim(self.dims, self.dst)
        lead = t.shape[: t.dim() - len(self.dims)]
        if len(self.block) == 1:
            return t.reshape(*lead, t.shape[-1] // self.block[0], self.block[0])
        (b0, b1), (m, n) = self.block, t.shape[-2:]
        t = t.reshape(*lead, m // b0, b0, n // b1, b1).transpose(-3, -2)
        return t.reshape(*lead, m // b0, n // b1, b0 * b1)

    def from_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of to_blocks for element tensors (a view where possible)."""
        lead = t.shape[: t.dim() - 1 - len(self.block)]
        if len(self.block) == 1:
            t = t.reshape(*lead, t.shape[-2] * t.shape[-1])
        else:
            (b0, b1), (mb, nb) = self.block, t.shape[-3:-1]
            t = t.reshape(*lead, mb, nb, b0, b1).transpose(-3, -2).reshape(*lead, mb * b0, nb * b1)
        return t.movedim(self.dst, self.dims)

    def scales_from_blocks(self, s: torch.Tensor) -> torch.Tensor:
        return s.movedim(self.dst, self.dims)


def _layout(x: torch.Tensor, block_size: object, axis: object, default: int) -> _Layout:
    if block_size is None:
        block: tuple[int, ...] = (default,)
    elif isinstance(block_size, int) and not isinstance(block_size, bool):
        block = (check_positive_int("block_size", block_size),)
    elif isinstance(block_size, tuple | list) and len(block_size) == 2:
        block = tuple(check_positive_int("block_size", b) for b in block_size)
    else:
        raise TypeError(f"block_size must be None, an int or a pair of ints (2-D blocks); got {block_size!r}")
    if len(block) == 2 and axis == -1:
        axis = (-2, -1)
    raw = (axis,) if isinstance(axis, int) and not isinstance(axis, bool) else axis
    if not isinstance(raw, tuple | list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in raw):
        raise TypeError(f"axis must be an int (or a pair of ints for 2-D blocks); got {axis!r}")
    if len(raw) != len(block):
        raise ValueError(f"axis must name {len(block)} dimension(s) for block_size {block_size!r}; got {axis!r}")
    nd = x.dim()
    dims = []
    for a in raw:
        if not -nd <= a < nd:
            raise ValueError(f"axis {axis!r} is out of range for x with {nd} dimensions")
        dims.append(a % nd)
    if len(set(dims)) != len(dims):
        raise ValueError(f"axis must name distinct dimensions; got {axis!r}")
    for d, b in zip(dims, block, strict=True):
        if x.shape[d] % b:
            raise ValueError(
                f"block_size {b} does not divide dimension {d} of x (size {x.shape[d]}, shape {tuple(x.shape)})"
            )
    return _Layout(x.shape, block, tuple(dims))


# ------------------------------------------------------------------------------------------------ scales
def _exponent(bits: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of non-negative fp32 bit patterns (-127 for zeros and subnormals, 128 for inf)."""
    return torch.bitwise_right_shift(bits, 23).bitwise_and_(0xFF).sub_(127)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**k`` for int32 ``k`` in [-127, 127] (2**-127 is the fp32 subnormal 0x00400000)."""
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 0x00400000))
    return bits.view(torch.float32)


def _e8m0_exponent(amax: torch.Tensor, fmt: BlockFormat, mode: str) -> torch.Tensor:
    """Unbiased E8M0 scale exponent per block (int32, in [-127, 127]) from the block's fp32 absolute maximum.
    NaN blocks are handled by the caller."""
    if mode == "rceil":
        d = amax / fmt.max_element  # the fp32 division of cuBLAS's recipe: its rounding is part of the result
        bits = d.view(torch.int32)
        e = _exponent(bits)
        e += (bits & 0x7FFFFF) != 0  # ceil(log2(d)) for normal d
        # subnormal d: ceil(log2(d)) is -126 above 2**-127 and <= -127 below (then clamped)
        e = torch.where(bits < 0x00800000, torch.where(bits > 0x00400000, -126, -127), e)
        return e.clamp_(-127, 127).to(torch.int32)
    bits = amax.view(torch.int32)
    if mode == "even":
        # round amax to the element's precision (half-ulp up, as an integer add into the exponent) first
        bits = bits + (1 << (22 - fmt.element.man_bits))
    e = _exponent(bits)
    if mode == "ceil":
        e += (bits & 0x7FFFFF) != 0
    e -= fmt.emax
    if mode == "neuron":
        e += 1
    return e.clamp_(-127, 127).to(torch.int32)


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    """Absolute maximum over the last dim (NaN if the block holds a NaN), without a full-size |w| temporary."""
    lo, hi = torch.aminmax(w, dim=-1)
    return torch.maximum(hi, lo.neg_()).abs_()


def _scale_blocks(
    w: torch.Tensor, fmt: BlockFormat, mode: str, tensor_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, multipliers) per block of ``w`` ([..., block]): the decoded scale (fp32) and what the elements are
    multiplied by before rounding, both shaped ``w.shape[:-1]``."""
    amax = _block_amax(w)
    if fmt.scale == "e4m3":
        block_scale = amax / fmt.max_element
        if tensor_scale is not None:
            block_scale = block_scale / tensor_scale
        # E4M3 cast of the clamped fp32 scale (round to nearest even; NaN stays NaN)
        s = round_to_(block_scale.clamp_(_E4M3_MIN_NORMAL, _E4M3_MAX), _E4M3)
        # reciprocal, then a product: the fp32 roundings of the NVFP4 reference kernels (docs/mx.md)
        rcp = torch.reciprocal(s) if tensor_scale is None else torch.reciprocal(tensor_scale) / s
        return s, rcp
    nan = torch.isnan(amax)
    e = _e8m0_exponent(amax.masked_fill(nan, 0.0), fmt, mode)
    scale = _pow2(e)
    mult = _pow2(-e)
    if mode == "rceil":
        mult.masked_fill_(e == -127, 1.0)  # Transformer Engine's exp2f_rcp: the reciprocal of 2**-127 is 1
    scale.masked_fill_(nan, float("nan"))
    mult.masked_fill_(nan, float("nan"))
    return scale, mult


# ------------------------------------------------------------------------------------------------ elements
def round_elements(
    v: torch.Tensor,
    fmt: BlockFormat | str,
    rounding: str = "nearest",
    *,
    key: int = 0,
    primary: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round fp32 ``v`` in place to ``fmt``'s element grid, saturating at +-``max_element``; returns ``v``.

    ``"stochastic"`` needs the Philox ``key``, the elements' ``primary`` bytes and stream ``positions``
    (:func:`mixprec.core.philox.round_up`). NaN stays NaN (also for fp6/fp4, which have no NaN: see docs/mx.md).
    """
    fmt = get_block_format(fmt)
    grid = fmt.element
    if rounding == "nearest" and grid.exp_bits >= 4:
        # fp8: round_to's compiled kernel with a saturating format (max_finite is max_element): rounding, then
        # sending overflow to +-max, equals clamping first, and saves a pass
        return round_to_(v, grid)
    v.clamp_(-fmt.max_element, fmt.max_element)  # NaN stays NaN
    if rounding == "nearest":
        round_nearest_grid_(v, grid, torch.empty_like(v, dtype=torch.int32))
        return v
    # the grid spacing at |v|: 2**(max(exponent, emin) - man_bits), and |v| in spacings (exact: power-of-two divisor)
    mag = v.abs()
    e = _exponent(mag.view(torch.int32)).clamp_(min=grid.emin).sub_(grid.man_bits)
    spacing = _pow2(e)
    steps = mag.div_(spacing)
    low = torch.floor(steps)
    if rounding == "stochastic":
        if primary is None or positions is None:
            raise RuntimeError("round_elements: stochastic rounding needs primary bytes and positions")
        low += round_up(key, primary, steps.sub_(low), positions)
    elif rounding != "toward_zero":
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDING_MODES))}; got {rounding!r}")
    return v.copy_(low.mul_(spacing).copysign_(v))


# ------------------------------------------------------------------------------------------------ the result
@dataclass(frozen=True, eq=False)
class BlockScaled:
    """A block-scaled tensor: ``elements`` (fp32 values on the element grid, ``x``'s shape), ``scales`` (fp32,
    one per block, shaped like ``x`` with each blocked dimension divided by its block size) and, for NVFP4 with
    two-level scaling, ``tensor_scale`` (fp32, 0-d; else None). ``dequantize()`` returns ``elements * scale``."""

    elements: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: BlockFormat
    block_size: tuple[int, ...]
    axis: tuple[int, ...]
    scale_mode: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``elements * scale`` in fp32 (for NVFP4 with a tensor scale: ``elements * (tensor_scale * scale)``,
        the product rounded to fp32 first, as torchao's ``NVFP4Tensor.dequantize``), cast to ``dtype``."""
        layout = _Layout(self.elements.shape, self.block_size, self.axis)
        s = self.scales if self.tensor_scale is None else self.tensor_scale * self.scales
        s = s.movedim(self.axis, layout.dst).unsqueeze(-1)
        out = layout.to_blocks(self.elements) * s
        return layout.from_blocks(out).to(dtype, memory_format=torch.contiguous_format)


def _tensor_scale(value: object, fmt: BlockFormat, device: torch.device) -> torch.Tensor | None:
    if value is None:
        return None
    if fmt.scale != "e4m3":
        raise ValueError(f"tensor_scale: format {fmt.name!r} has no tensor scale (only 'nvfp4' has one); got {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"tensor_scale must be a positive finite float or a one-element float tensor; got {value!r}"
            )
        t = value.detach().reshape(()).to(device=device, dtype=torch.float32)
    elif isinstance(value, float | int) and not isinstance(value, bool):
        t = torch.tensor(float(value), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"tensor_scale must be None, a float or a one-element tensor; got {type(value).__name__}")
    if not (bool(torch.isfinite(t)) and float(t) > 0.0):
        raise ValueError(f"tensor_scale must be positive and finite; got {float(t)!r}")
    return t


def mx_quantize(
    x: torch.Tensor,
    fmt: BlockFormat | str,
    *,
    block_size: int | tuple[int, int] | None = None,
    scale_mode: ScaleMode | None = None,
    axis: int | tuple[int, int] = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    tensor_scale: float | torch.Tensor | None = None,
    key: int | None = None,
    positions: torch.Tensor | None = None,
) -> BlockScaled:
    """Quantize ``x`` to a block-scaled format (MXFP8, MXFP6, MXFP4, NVFP4); returns a :class:`BlockScaled`.

    Args:
        x: fp32, bf16 or fp16 tensor (read exactly as fp32).
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4_e2m1"`` (E8M0 scale,
            block 32) or ``"nvfp4"`` (E4M3 scale, block 16).
        block_size: elements per block along ``axis`` (must divide it; default: the format's), or a pair for 2-D
            tiles (e.g. ``(16, 16)``) over the two dims of ``axis`` (default the last two).
        scale_mode: E8M0 formats: ``"floor"`` (the default, OCP MX v1.0), ``"ceil"``, ``"even"``, ``"rceil"``,
            ``"neuron"``; NVFP4: ``"e4m3"`` (its only rule, the default). Formulas in docs/mx.md.
        axis: the dimension the blocks run along (a pair for 2-D blocks).
        rounding: ``"nearest"`` (ties to even), ``"toward_zero"`` or ``"stochastic"`` (unbiased, Philox stream
            keyed by one draw from ``generator``; element ``i`` of ``x`` in row-major order is stream position ``i``).
        generator: the ``torch.Generator`` for ``"stochastic"`` (None: torch's default generator).
        tensor_scale: NVFP4 only: fp32 tensor scale for two-level scaling (block scales are E4M3 values of
            ``amax / 6 / tensor_scale``); e.g. ``amax(x) / (448 * 6)``.
        key: ``"stochastic"`` only: the 64-bit Philox stream key (an int in [0, 2**64)) instead of one drawn from
            ``generator``.
        positions: ``"stochastic"`` only: int64 stream positions of the elements, broadcastable to ``x``'s shape
            (default: element ``i`` in row-major order at ``i``); see :func:`stream_positions`.
    """
    bf, mode, ts, layout = _prepare(x, fmt, block_size, scale_mode, axis, rounding, generator, tensor_scale)
    key, positions = _stream(x, rounding, generator, key, positions)
    done = _native_quantize(x, bf, mode, ts, layout, rounding, dequantize=False, out=None, key=key, positions=positions)
    if done is not None:
        elements, block_scales = done
        return BlockScaled(elements, block_scales, ts, bf, layout.block, layout.dims, mode)
    w, scales = _quantize(x, bf, mode, ts, layout, rounding, key, positions)
    return BlockScaled(
        elements=layout.from_blocks(w).contiguous(),
        scales=layout.scales_from_blocks(scales).contiguous(),
        tensor_scale=ts,
        fmt=bf,
        block_size=layout.block,
        axis=layout.dims,
        scale_mode=mode,
    )


def _prepare(
    x: torch.Tensor,
    fmt: object,
    block_size: object,
    scale_mode: object,
    axis: object,
    rounding: str,
    generator: torch.Generator | None,
    tensor_scale: object,
) -> tuple[BlockFormat, str, torch.Tensor | None, _Layout]:
    """Checks; returns (format, scale mode, tensor scale, layout)."""
    check_tensor("x", x, _INPUT_DTYPES)
    bf = get_block_format(fmt)
    if scale_mode is None:
        scale_mode = "e4m3" if bf.scale == "e4m3" else "floor"
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if (scale_mode == "e4m3") != (bf.scale == "e4m3"):
        allowed = "'e4m3'" if bf.scale == "e4m3" else ", ".join(map(repr, E8M0_MODES))
        raise ValueError(f"scale_mode {scale_mode!r} does not apply to {bf.name!r} (its modes: {allowed})")
    check_choice("rounding", rounding, ROUNDING_MODES)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    ts = _tensor_scale(tensor_scale, bf, x.device)
    return bf, str(scale_mode), ts, _layout(x, block_size, axis, bf.block_size)


def stream_positions(
    shape: tuple[int, ...] | torch.Size,
    offset: int = 0,
    row_stride: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """int64 stream positions for ``mx_quantize(..., positions=...)``: element ``(r, j)`` of a 2-D ``shape``
    ``[R, L]`` at ``offset + r * row_stride + j`` (``row_stride`` default ``L``: rows back to back); any other
    shape row-major from ``offset``. The wires' ``encode_rows`` convention (:mod:`mixprec.core.philox`)."""
    shape = tuple(shape)
    offset = check_positive_int("offset", offset, minimum=0)
    if len(shape) != 2 or row_stride is None:
        return torch.arange(offset, offset + math.prod(shape), device=device).view(shape)
    rows, length = shape
    row_stride = check_positive_int("row_stride", row_stride, minimum=0)
    cols = torch.arange(length, device=device)
    return offset + cols + row_stride * torch.arange(rows, device=device)[:, None]


def _stream(
    x: torch.Tensor, rounding: str, generator: torch.Generator | None, key: object, positions: object
) -> tuple[int | None, torch.Tensor | None]:
    """(key, positions) of a stochastic call: the caller's, or one key drawn from ``generator`` (positions None:
    row-major); (None, None) for the other roundings, which take neither."""
    if rounding != "stochastic":
        if key is not None or positions is not None:
            raise ValueError(f"key and positions apply to rounding='stochastic' only; got rounding={rounding!r}")
        return None, None
    if key is None:
        key = draw_key(generator)
    elif isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"key must be an int in [0, 2**64); got {type(key).__name__}")
    elif not 0 <= key < 1 << 64:
        raise ValueError(f"key must be an int in [0, 2**64); got {key}")
    if positions is not None:
        check_tensor("positions", positions, (torch.int64,))
        try:
            positions = positions.to(x.device).expand(x.shape)
        except RuntimeError:
            raise ValueError(
                f"positions (shape {tuple(positions.shape)}) must broadcast to x's shape {tuple(x.shape)}"
            ) from None
    return key, positions


def _native_quantize(
    x: torch.Tensor,
    bf: BlockFormat,
    mode: str,
    ts: torch.Tensor | None,
    layout: _Layout,
    rounding: str,
    *,
    dequantize: bool,
    out: torch.Tensor | None,
    key: int | None,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The compiled pass (csrc/mx.c): (elements or, with ``dequantize``, their decoded values, in ``x``'s shape;
    the scales, or None when dequantizing), or None where it cannot run and the torch path must: explicit
    stream positions, blocks not along the last axis, a tensor not on the CPU, or no kernel library. Under
    torch.compile, a dispatch mode or fake tensors the kernel runs as ``torch.ops.mixprec.mx_quantize``
    (:func:`mixprec.native.route`). ``out`` (fp32, ``x``'s shape) receives the result if given."""
    last = x.dim() - 1
    if positions is not None or len(layout.block) != 1 or layout.dims != (last,) or x.numel() == 0:
        return None
    path = native.route(x) if out is None else native.route(x, out)
    if path is None:
        return None
    block, grid = layout.block[0], bf.element
    args = (block, (grid.exp_bits, grid.man_bits, bf.max_element), kernels.MX_SCALE_MODES[mode])
    if path == "op":
        values, scales = ops.mx_quantize(x.detach(), *args, ts, rounding == "toward_zero", dequantize, key)
        return (values if out is None else out.copy_(values)), (None if dequantize else scales)
    src = x.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    # the kernel writes into out when out is the fp32 source itself (each block is read whole before it is
    # written) or shares no memory with it; otherwise into a fresh buffer that is copied to out
    direct = (
        out is not None
        and out.is_contiguous()
        and ((out.data_ptr() == src.data_ptr() and src.dtype == torch.float32) or not _shares_memory(out, src))
    )
    dst = out if direct else torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scales = None if dequantize else torch.empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.float32)
    ts_ = None if ts is None else float(ts)
    kernels.mx_quantize(src, dst, scales, *args, ts_, rounding == "toward_zero", dequantize, key)
    if out is not None and dst is not out:
        dst = out.copy_(dst)
    return dst, scales


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storage spans of two tensors intersect (a conservative overlap test)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _quantize(
    x: torch.Tensor,
    bf: BlockFormat,
    scale_mode: str,
    ts: torch.Tensor | None,
    layout: _Layout,
    rounding: str,
    key: int | None,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: (elements [..., blocks, block], scales [..., blocks]); ``key`` (and ``positions``, None:
    row-major) for stochastic rounding."""
    blocks = layout.to_blocks(x.detach())
    w = blocks.to(torch.float32, memory_format=torch.contiguous_format)
    if w.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        w = w.clone()  # a view of x: never round the caller's tensor
    scales, mult = _scale_blocks(w, bf, scale_mode, ts)
    w.mul_(mult.unsqueeze(-1))
    if rounding == "stochastic":
        assert key is not None
        n = x.numel()
        if positions is None:
            primary = stream_bytes(key, 0, n, x.device).view(x.shape)
            positions = torch.arange(n, device=x.device).view(x.shape)
        else:
            primary = _bytes_at(key, positions)
        primary, positions = layout.to_blocks(primary), layout.to_blocks(positions)
        round_elements(w, bf, rounding, key=key, primary=primary, positions=positions)
    else:
        round_elements(w, bf, rounding)
    return w, scales


def _bytes_at(key: int, positions: torch.Tensor) -> torch.Tensor:
    """The primary bytes of arbitrary stream positions (int64, any shape): each row of the last dim drawn as one
    contiguous run when its positions are (the wire's rows), else the span from the smallest to the largest."""
    flat = positions.reshape(-1, positions.shape[-1]) if positions.dim() else positions.reshape(1, 1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=positions.device)
    for r in range(flat.shape[0]):
        row = flat[r]
        if row.numel() == 0:
            continue
        lo, hi = int(row.min()), int(row.max())
        span = stream_bytes(key, lo, hi - lo + 1, positions.device)
        out[r] = span[row - lo]
    return out.view(positions.shape)


def fake_quantize(
    x: torch.Tensor,
    fmt: BlockFormat | str,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    *,
    block_size: int | tuple[int, int] | None = None,
    scale_mode: ScaleMode | None = None,
    axis: int | tuple[int, int] = -1,
    tensor_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    key: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mx_quantize(x, fmt, ...).dequantize()`` (the same bits) without the intermediate tensors: ``x`` rounded
    to the block-scaled format, in fp32 (the fake quantization of ``round_to(x, "mxfp8_e4m3")``).

    ``out``: an fp32 tensor of ``x``'s shape and device to write into (may be ``x`` itself); returned. ``key``,
    ``positions``: as :func:`mx_quantize`'s."""
    bf, mode, ts, layout = _prepare(x, fmt, block_size, scale_mode, axis, rounding, generator, tensor_scale)
    if out is not None:
        check_tensor("out", out, (torch.float32,))
        if out.shape != x.shape or out.device != x.device:
            raise ValueError(f"out must have x's shape {tuple(x.shape)} and device {x.device}; got {tuple(out.shape)}")
    key, positions = _stream(x, rounding, generator, key, positions)
    done = _native_quantize(x, bf, mode, ts, layout, rounding, dequantize=True, out=out, key=key, positions=positions)
    if done is not None:
        return done[0]
    w, scales = _quantize(x, bf, mode, ts, layout, rounding, key, positions)
    s = scales if ts is None else ts * scales
    w.mul_(s.unsqueeze(-1))
    result = layout.from_blocks(w)
    return result.contiguous() if out is None else out.copy_(result)
