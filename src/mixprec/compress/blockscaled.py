"""Block-scaled gradients on the wire (MXFP8, MXFP4, NVFP4) with the scales inline: :class:`BlockScaledWire`.

Each row is cut into blocks of the format (32 elements for MX, 16 for NVFP4) quantized by
:func:`mixprec.core.mx.mx_quantize` (the one definition of the formats), and sent as one uint8 buffer: for
NVFP4 first one fp32 power-of-two scale per chunk of ``chunk_size`` elements (the "tensor scale" of the
two-level recipe, carried per chunk: ``32 / chunk_size`` bits per element), then one scale byte per block
(E8M0 for MX, E4M3 for NVFP4), then the element codes (one byte each for MXFP8, two per byte for the 4-bit
grids, element 2i in the low nibble). MXFP8: 8.25 bits per element; NVFP4: 4.5 + 32 / chunk_size. A block
holding NaN/Inf is flagged by its scale byte (the formats' NaN codes, 0xFF E8M0, 0x7F E4M3) and decodes to
NaN. Decoding is exact (element times power of two, or E4M3 times e2m1), so a fp32 sum at the owner sees
exactly what was sent. The class has :class:`~mixprec.compress.ScaledFP8`'s row API, so the flat and
hierarchical pipelines, error feedback and the reducers take it as they take that one. Stochastic rounding
draws element ``(r, j)``'s bits at Philox stream position ``offset + r * row_stride + j`` (as the fp8 wire).
On CPU tensors encode and decode run one compiled pass each (``csrc/mx_wire.c``), and
:meth:`BlockScaledWire.encode_feedback_rows` folds error feedback's add and residual update into the encode;
the torch code below is the fallback and the kernels' oracle (same bits). Layout, bounds and the choice of
scale conventions: ``docs/compress.md``; the kernels: ``docs/mx.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import mixprec.native as native
from mixprec.compress.quantize import FLOAT_DTYPES, CheckFinite, ChunkedCompressor, NonFiniteError
from mixprec.core.dtypes import Rounding
from mixprec.core.mx import E8M0_MODES, MX_FORMATS, BlockFormat, mx_quantize, stream_positions
from mixprec.core.validate import check_choice, check_dtype, check_positive_int, check_tensor
from mixprec.native import kernels, ops

__all__ = ["BLOCK_WIRES", "DEFAULT_SCALE_MODES", "TENSOR_SCALE_BYTES", "BlockScaledWire"]

# wire name -> core.mx format; MXFP6 is left out (6-bit codes pack across bytes; no gradient recipe uses it)
BLOCK_WIRES: tuple[str, ...] = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "nvfp4")
# rceil (cuBLAS, Transformer Engine) never saturates a block's largest element, which OCP's floor may clip by
# up to 1/8 of it: on a gradient that bias would be repaid only through error feedback.
DEFAULT_SCALE_MODES: dict[str, str] = {
    "mxfp8_e4m3": "rceil",
    "mxfp8_e5m2": "rceil",
    "mxfp4_e2m1": "rceil",
    "nvfp4": "e4m3",
}
TENSOR_SCALE_BYTES = 4  # NVFP4: one fp32 power-of-two scale per chunk
# NVFP4's two-level recipe maps the tensor's amax to 6 * 448 (the largest element times the largest E4M3
# scale); here each chunk's power-of-two scale maps its amax into (1344, 2688].
_NVFP4_TOP = 6.0 * 448.0
_K_MIN, _K_MAX = -126, 126  # 2**k and 2**-k both normal fp32 numbers
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class BlockScaledWire(ChunkedCompressor):
    """Block-scaled quantizer of gradients for the wire: ``encode(tensor) -> uint8 buffer``, ``decode(...)``.

    Args:
        fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4_e2m1"`` (E8M0 scale per 32) or ``"nvfp4"`` (E4M3 scale
            per 16 under a power-of-two fp32 scale per chunk).
        scale_mode: the block-scale convention of :func:`mixprec.core.mx.mx_quantize`; None = ``"rceil"`` for
            MX (never saturates), ``"e4m3"`` for NVFP4.
        chunk_size: elements per chunk, a multiple of the block size (NVFP4: elements per fp32 scale).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (one Philox key per encode from
            ``generator``; :mod:`mixprec.core.philox`).
        generator: torch.Generator for stochastic rounding; None = torch's default.
        check_finite: ``"raise"`` a :class:`NonFiniteError` on NaN/Inf, or ``"flag"`` the block (NaN scale).
    """

    def __init__(
        self,
        fmt: str = "mxfp8_e4m3",
        *,
        scale_mode: str | None = None,
        chunk_size: int = 2048,
        rounding: Rounding = "nearest",
        generator: torch.Generator | None = None,
        check_finite: CheckFinite = "raise",
    ) -> None:
        self.fmt: str = check_choice("fmt", fmt, BLOCK_WIRES)
        self.format: BlockFormat = MX_FORMATS[self.fmt]
        nv = self.format.scale == "e4m3"
        allowed = ("e4m3",) if nv else E8M0_MODES
        self.scale_mode: str = check_choice(
            "scale_mode", DEFAULT_SCALE_MODES[self.fmt] if scale_mode is None else scale_mode, allowed
        )
        super().__init__(chunk_size=chunk_size, rounding=rounding, generator=generator, check_finite=check_finite)
        self.block = self.format.block_size
        if self.chunk_size % self.block:
            raise ValueError(f"chunk_size must be a multiple of {self.fmt}'s block size {self.block}; got {chunk_size}")
        self.bits = self.format.element.exp_bits + self.format.element.man_bits + 1  # 8 or 4
        self.HEADER_BYTES = TENSOR_SCALE_BYTES if nv else 0
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._residual: torch.Tensor | None = None  # encode_feedback_rows' residual, for the one call in flight

    def __repr__(self) -> str:
        return (
            f"BlockScaledWire(fmt={self.fmt!r}, scale_mode={self.scale_mode!r}, chunk_size={self.chunk_size}, "
            f"rounding={self.rounding!r}, check_finite={self.check_finite!r})"
        )

    # ------------------------------------------------------------------ sizes
    def num_blocks(self, numel: int) -> int:
        return -(-check_positive_int("numel", numel, minimum=0) // self.block)

    def code_nbytes(self, numel: int) -> int:
        """Bytes of the element codes: one per element (8-bit grids) or one per two (4-bit)."""
        return numel if self.bits == 8 else -(-numel // 2)

    def encoded_nbytes(self, numel: int) -> int:
        """``HEADER_BYTES * num_chunks + num_blocks + code_nbytes``: MXFP8 ``numel * 33 / 32``; NVFP4
        ``numel * 9 / 16 + 4 * num_chunks`` (whole blocks)."""
        return self.HEADER_BYTES * self.num_chunks(numel) + self.num_blocks(numel) + self.code_nbytes(numel)

    def bits_per_element(self, numel: int | None = None) -> float:
        """Bits sent per element: for ``numel`` elements, else the limit of whole chunks."""
        if numel is None:
            return 8.0 * self.HEADER_BYTES / self.chunk_size + 8.0 / self.block + self.bits
        return 8.0 * self.encoded_nbytes(numel) / max(numel, 1)

    def header_nbytes(self, numel: int) -> int:
        """Bytes of scales (tensor and block) in an encoded buffer of ``numel`` elements."""
        return self.encoded_nbytes(numel) - self.code_nbytes(numel)

    # ------------------------------------------------------------------ public API
    def encode(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize ``tensor`` (fp32/fp16/bf16, flattened) into one uint8 buffer (``out`` if given)."""
        x = check_tensor("tensor", tensor, FLOAT_DTYPES).contiguous().view(1, -1)
        numel = x.shape[1]
        if out is None:
            out = torch.empty(self.encoded_nbytes(numel), dtype=torch.uint8, device=x.device)
        self._check_rows("out", out.view(1, -1), (torch.uint8,), (1, self.encoded_nbytes(numel)), x.device)
        bad = self.encode_rows(x, out.view(1, -1))
        if bad and self.check_finite == "raise":
            raise NonFiniteError(
                f"tensor holds NaN or Inf in {bad} of its {self.num_blocks(numel)} blocks of {self.block} elements; "
                "fix the source (e.g. lower the loss scale) or use check_finite='flag'"
            )
        return out

    def decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Invert :meth:`encode`: ``numel`` elements of ``dtype`` (exact in fp32, rounded once to ``dtype``)."""
        numel = check_positive_int("numel", numel, minimum=0)
        dtype = check_dtype("dtype", dtype, FLOAT_DTYPES)
        out = torch.empty(1, numel, dtype=dtype, device=buffer.device)
        self.decode_rows(buffer.view(1, -1), numel, out)
        return out.view(-1)

    def found_nonfinite(self, buffer: torch.Tensor, numel: int) -> bool:
        """Whether any block of an encoded buffer was flagged non-finite (reads only the scale bytes)."""
        h = self.HEADER_BYTES * self.num_chunks(numel)
        scale_bytes = buffer[h : h + self.num_blocks(numel)]
        return bool((scale_bytes == self._nan_code()).any())

    def block_scales(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        """The decoded fp32 scale of each block of an encoded buffer (NVFP4: the chunk's times the block's;
        NaN where flagged): decoded element = element value x this."""
        nb = self.num_blocks(numel)
        _, scale_t = self._value_tables(buffer.device)
        h = self.HEADER_BYTES * self.num_chunks(numel)
        scales = scale_t[buffer[h : h + nb].long()]
        if self.HEADER_BYTES:
            chunk = torch.empty(self.num_chunks(numel), dtype=torch.float32, device=buffer.device)
            chunk.view(torch.uint8).copy_(buffer[:h])
            scales = scales * chunk[torch.arange(nb, device=buffer.device) // (self.chunk_size // self.block)]
        return scales

    def encode_feedback_rows(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        out: torch.Tensor,
        *,
        key: int | None = None,
        offset: int = 0,
        row_stride: int | None = None,
    ) -> int:
        """:meth:`encode_rows` of ``fl32(x + residual)`` with error feedback folded in: afterwards ``residual``
        holds ``fl32(x + residual) - decoded`` (what the quantization lost) in every block that was not flagged;
        a flagged block keeps its residual (the collectives clear every residual after a flagged result).
        ``residual``: fp32 [R, L] on ``x``'s device, rows contiguous, sharing no memory with ``x`` or ``out``.
        One compiled pass on CPU tensors; elsewhere the add, encode, decode and subtract of the torch path,
        with the same bits. Returns the number of flagged blocks."""
        self._check_rows("residual", residual, (torch.float32,), tuple(x.shape) if x.dim() == 2 else None, x.device)
        for name, other in (("x", x), ("out", out)):
            if other.numel() and residual.numel() and _overlap(residual, other):
                raise ValueError(f"residual must not share memory with {name}")
        self._residual = residual
        try:
            bad = self.encode_rows(x, out, key=key, offset=offset, row_stride=row_stride)
        finally:
            self._residual = None
        return bad

    # ------------------------------------------------------------------ row API
    def _nan_code(self) -> int:
        return 0x7F if self.format.scale == "e4m3" else 0xFF

    def _chunk_exponents(self, amax: torch.Tensor) -> torch.Tensor:
        """NVFP4: int ``k`` per chunk (float64) with ``amax * 2**k`` in ``(1344, 2688]``, clamped to
        [-126, 126]; 0 for an all-zero chunk."""
        a = amax.double()
        _, e = torch.frexp(_NVFP4_TOP / torch.where(a > 0, a, torch.ones_like(a)))
        k = e.double() - 1
        k = k - (a * torch.exp2(k) > _NVFP4_TOP).double()  # exact products in fp64
        k = k + (a * torch.exp2(k + 1) <= _NVFP4_TOP).double()
        return torch.where(a > 0, k.clamp(_K_MIN, _K_MAX), torch.zeros_like(k))

    def _encode_rows(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        length = x.shape[1]
        residual = self._residual
        if length == 0:
            return 0
        path = native.route(x, out) if residual is None else native.route(x, out, residual)
        if path is not None:  # the compiled kernel (under a tracer as torch.ops.mixprec.mx_wire_encode)
            grid = self.format.element
            args = (
                (grid.exp_bits, grid.man_bits, self.format.max_element), kernels.MX_SCALE_MODES[self.scale_mode],
                self.block, self.chunk_size, self._nan_code(), key if self.rounding == "stochastic" else None,
                offset, row_stride,
            )  # fmt: skip
            if path == "kernel":
                return kernels.mx_wire_encode(x, residual, out, *args)
            return int(ops.mx_wire_encode(x, residual, out, *args))
        if residual is None:
            return self._encode_torch(x, out, key, offset, row_stride)
        staged = x.float() + residual  # torch.add(x, residual): exact widening, one rounding
        n_bad = self._encode_torch(staged, out, key, offset, row_stride)
        decoded = torch.empty_like(staged)
        self._decode_rows(out, length, decoded, reduce=False)
        # a flagged block decodes to NaN (and only a flagged one): it keeps its residual
        residual.copy_(torch.where(torch.isnan(decoded), residual, staged - decoded))
        return n_bad

    def _encode_torch(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        """The torch path of ``_encode_rows`` (the compiled encoder's oracle)."""
        rows, length = x.shape
        nv = self.format.scale == "e4m3"
        nb = self.num_blocks(length)
        # zero padding to whole blocks (NVFP4: whole chunks) changes no block's amax
        padded = self.num_chunks(length) * self.chunk_size if nv else nb * self.block
        y = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
        y[:, :length].copy_(x)
        blocks = y.view(rows, -1, self.block)
        bad = ~torch.isfinite(blocks).all(dim=-1)
        n_bad = int(bad[:, :nb].sum())
        if n_bad:
            blocks.masked_fill_(bad[:, :, None], 0.0)
        h = 0
        effective = None  # NVFP4: each block's scale times its chunk's
        if nv:
            chunks = y.view(rows, -1, self.chunk_size)
            k = self._chunk_exponents(chunks.abs().amax(dim=-1))
            chunks.mul_(torch.exp2(k).float()[:, :, None])  # exact: powers of two, |y| <= 2688
            h = TENSOR_SCALE_BYTES * chunks.shape[1]
            down = torch.exp2(-k).float()
            out[:, :h].copy_(down.view(torch.uint8))
            effective = down.repeat_interleave(self.chunk_size // self.block, dim=1)
        stream: dict[str, Any] = {}
        if self.rounding == "stochastic":  # element (r, j) at stream position offset + r * row_stride + j
            positions = stream_positions((rows, padded), offset, row_stride, x.device)
            stream = {"rounding": "stochastic", "key": key, "positions": positions}
        q = mx_quantize(y, self.format, scale_mode=self.scale_mode, **stream)  # type: ignore[arg-type]
        scales, elements = q.scales, q.elements
        self._saturate_(elements.view(rows, -1, self.block), scales if effective is None else scales * effective)
        out[:, h : h + nb].copy_(self._scale_codes(scales[:, :nb], bad[:, :nb]))
        out[:, h + nb :].copy_(self._element_codes(elements[:, :length]))
        return n_bad

    def _saturate_(self, elements: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep every decoded value finite: in a block whose largest magnitude is near fp32's max, an element
        rounded up may decode to ``2**128 = inf`` (e.g. MXFP8 e4m3 with rceil: ``3.4e38`` -> 256 x 2**120).
        Such an element becomes the grid value below it, which stays within the round trip's bound
        (docs/compress.md). ``elements`` [rows, blocks, block], ``scale`` [rows, blocks] (decoded scales)."""
        risky = torch.isinf(scale * self.format.max_element)  # only blocks whose scale is near 2**128 / max
        if not bool(risky.any()):
            return
        grid = self._value_tables(elements.device)[0]
        grid = torch.unique(grid[torch.isfinite(grid)].abs())  # sorted non-negative grid values
        w = elements[risky]  # [n, block]
        over = torch.isinf(w * scale[risky][:, None])
        lower = grid[torch.searchsorted(grid, w.abs()) - 1]
        elements[risky] = torch.where(over, lower.copysign(w), w)

    def _scale_codes(self, scales: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        if self.format.scale == "e4m3":
            codes = scales.to(torch.float8_e4m3fn).view(torch.uint8)  # exact: already E4M3 values
        else:
            _, e = torch.frexp(scales)  # scale = 2**(e - 1), 2**-127 included (a subnormal)
            codes = (e + 126).to(torch.uint8)
        return codes.masked_fill_(bad, self._nan_code())

    def _element_codes(self, elements: torch.Tensor) -> torch.Tensor:
        """[rows, length] fp32 grid values -> [rows, code_nbytes] bytes."""
        if self.bits == 8:
            dtype = torch.float8_e4m3fn if self.format.element.exp_bits == 4 else torch.float8_e5m2
            return elements.to(dtype).view(torch.uint8)  # exact: on the grid, within range
        rows, length = elements.shape
        table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=elements.device)
        mag = torch.searchsorted(table, elements.abs().contiguous())  # exact matches: the index is the code
        nib = (mag | (torch.signbit(elements).to(torch.int64) << 3)).to(torch.uint8)
        if length % 2:
            nib = torch.cat([nib, torch.zeros(rows, 1, dtype=torch.uint8, device=nib.device)], dim=1)
        pairs = nib.view(rows, -1, 2)
        return pairs[:, :, 0] | (pairs[:, :, 1] << 4)

    def _value_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(element value per code, scale value per scale byte), fp32."""
        tables = self._tables.get(device)
        if tables is None:
            if self.bits == 8:
                dtype = torch.float8_e4m3fn if self.format.element.exp_bits == 4 else torch.float8_e5m2
                elem = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()
            else:
                mags = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
                elem = torch.cat([mags, -mags])
            if self.format.scale == "e4m3":
                scale = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
            else:
                scale = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(-127, 129)).float()
                scale[255] = math.nan
                scale = scale.to(device)
            tables = self._tables[device] = (elem, scale)
        return tables

    def _decode_rows(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        rows = buf.shape[0]
        nb, bs = self.num_blocks(length), self.block
        elem_t, scale_t = self._value_tables(buf.device)
        path = native.route(buf, out) if length and out.dtype in _KERNEL_DTYPES else None
        if path is not None:  # the compiled kernel (under a tracer as torch.ops.mixprec.mx_wire_decode)
            args = (
                (elem_t, scale_t), (self.format.element.exp_bits, self.format.element.man_bits), bs, self.chunk_size,
                self.format.scale == "e4m3", self._nan_code(), reduce,
            )  # fmt: skip
            if path == "kernel":
                return kernels.mx_wire_decode(buf, length, out, *args)
            return int(ops.mx_wire_decode(buf, length, out, *args))
        h = 0
        if self.format.scale == "e4m3":
            chunks = self.num_chunks(length)
            h = TENSOR_SCALE_BYTES * chunks
            tensor_scale = torch.empty(rows, chunks, dtype=torch.float32, device=buf.device)
            tensor_scale.view(torch.uint8).view(rows, h).copy_(buf[:, :h])
        sbytes = buf[:, h : h + nb]
        n_bad = int((sbytes == self._nan_code()).sum())
        scales = scale_t[sbytes.long()]
        codes = buf[:, h + nb :].long()
        if self.bits == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(rows, -1)
        vals = torch.zeros(rows, nb * bs, dtype=torch.float32, device=buf.device)
        vals[:, :length] = elem_t[codes[:, :length]]
        vals.view(rows, nb, bs).mul_(scales[:, :, None])  # exact: E4M3 x e2m1, or a power of two x fp8
        if self.format.scale == "e4m3":
            per = self.chunk_size // bs
            chunk_of_block = torch.arange(nb, device=buf.device) // per
            vals.view(rows, nb, bs).mul_(tensor_scale[:, chunk_of_block, None])  # a power of two
        vals = vals[:, :length]
        if reduce:
            out.copy_(vals[0])
            for r in range(1, rows):
                out.add_(vals[r])
        else:
            out.copy_(vals)
        return n_bad


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storage spans of two tensors intersect (conservative)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + ((a.shape[0] - 1) * a.stride(0) + a.shape[-1]) * a.element_size() if a.dim() == 2 else a0 + a.nbytes
    b1 = b0 + ((b.shape[0] - 1) * b.stride(0) + b.shape[-1]) * b.element_size() if b.dim() == 2 else b0 + b.nbytes
    return a0 < b1 and b0 < a1


def check_block_wire(wire: str, chunk_size: int) -> None:
    """ValueError unless ``chunk_size`` is a multiple of block wire ``wire``'s block size."""
    block = MX_FORMATS[wire].block_size
    if chunk_size % block:
        raise ValueError(f"chunk_size must be a multiple of {wire}'s block size {block}; got {chunk_size}")
