"""fp8 gradients on the wire with one power-of-two scale per chunk: :class:`ScaledFP8`.

Each chunk of ``chunk_size`` elements gets a scale ``2**-k`` chosen so that its largest magnitude ``A`` maps
into ``(max/2, max]`` of the format (``max`` = 448 for e4m3, 57344 for e5m2); the codes are the fp8 bytes
of ``x * 2**k`` (round to nearest even, or stochastic), sent as uint8 (gloo refuses float8 tensors). Buffer:
``4 C`` bytes of fp32 scales, then one byte per element. Scaling by a power of two is exact, so decoding
is exact and one round trip errs by at most ``u_f |x|`` (nearest; ``2 u_f |x|`` stochastic) or, below the
format's normal range, half a subnormal spacing times the scale (``u_f = 2**-4`` e4m3, ``2**-3`` e5m2).
MS-AMP sends fp8 with one scale per tensor and its users report overflow and underflow of the sums
(Azure/MS-AMP#41); here every chunk has its own scale and the sums are fp32.

The class has :class:`~mixprec.compress.MinMaxUInt8`'s interface (``encode``/``decode`` and the row API the
collectives are built from), so it goes wherever that one does. A chunk holding NaN/Inf is flagged (scale
NaN) and decodes to NaN. Rounding is :func:`mixprec.core.rounding.round_to`, bit-exact with torch's casts.
Wire format and bounds: ``docs/compress.md``.
"""

from __future__ import annotations

import math

import torch

import mixprec.native as native
from mixprec.compress._scratch import Scratch
from mixprec.compress.blockscaled import BlockScaledWire
from mixprec.compress.quantize import (
    FLOAT_DTYPES,
    CheckFinite,
    ChunkedCompressor,
    MinMaxUInt8,
    NonFiniteError,
    check_disjoint,
    check_not_meta,
)
from mixprec.core import philox
from mixprec.core.dtypes import Rounding
from mixprec.core.formats import get_format
from mixprec.core.rounding import round_to
from mixprec.core.validate import check_choice, check_dtype, check_positive_int, check_tensor
from mixprec.native import kernels, ops

__all__ = ["FP8_FORMATS", "SCALE_BYTES_PER_CHUNK", "ScaledFP8"]

SCALE_BYTES_PER_CHUNK = 4  # one fp32 scale (a power of two, or NaN for a flagged chunk)
# fmt argument -> torch dtype of the codes
FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# The scale exponent k stays where 2**k and 2**-k are both fp32 numbers (normal or subnormal, exact).
_K_MIN, _K_MAX = -126, 126
_FORMAT_CODES = {"e4m3": 0, "e5m2": 1}  # the kernels' format codes (native/csrc/quant_fp8.c)


class ScaledFP8(ChunkedCompressor):
    """Per-chunk power-of-two scaled fp8 quantizer: ``encode(tensor) -> uint8 buffer``, ``decode(...)``.

    Args:
        fmt: ``"e4m3"`` (3 mantissa bits, max 448: finer) or ``"e5m2"`` (2 mantissa bits, max 57344: wider
            range inside a chunk).
        chunk_size: elements per scale, int >= 1 (4 header bytes per chunk).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; one 64-bit Philox key drawn
            from ``generator`` per encode, element i's random bits at stream position i: :mod:`mixprec.core.philox`).
        generator: torch.Generator for stochastic rounding, on the tensors' device; None = torch's default.
        check_finite: ``"raise"`` a :class:`NonFiniteError` on NaN/Inf, or ``"flag"`` the chunk (scale NaN).
    """

    HEADER_BYTES = SCALE_BYTES_PER_CHUNK

    def __init__(
        self,
        fmt: str = "e4m3",
        *,
        chunk_size: int = 2048,
        rounding: Rounding = "nearest",
        generator: torch.Generator | None = None,
        check_finite: CheckFinite = "raise",
    ) -> None:
        self.fmt: str = check_choice("fmt", fmt, tuple(FP8_FORMATS))
        self.dtype = FP8_FORMATS[self.fmt]
        self.format = get_format(self.dtype)
        super().__init__(chunk_size=chunk_size, rounding=rounding, generator=generator, check_finite=check_finite)
        self._scratch = Scratch()
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._table_format: int | None = None  # the compiled decode's check of the CPU table (-1: lookup)

    def __repr__(self) -> str:
        return (
            f"ScaledFP8(fmt={self.fmt!r}, chunk_size={self.chunk_size}, rounding={self.rounding!r}, "
            f"check_finite={self.check_finite!r})"
        )

    # ------------------------------------------------------------------ public API
    def encode(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize ``tensor`` (fp32/fp16/bf16, flattened row-major) into one uint8 buffer (``out`` if given).

        Raises :class:`NonFiniteError` for NaN/Inf with ``check_finite="raise"`` (``out`` is filled as in
        ``"flag"`` mode); ValueError for stochastic rounding with a generator on another device.
        """
        if isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_FORMATS.values():
            raise TypeError(
                f"tensor is already {tensor.dtype}: pass the fp32/fp16/bf16 values, ScaledFP8 chooses the scales"
            )
        x = check_tensor("tensor", tensor, FLOAT_DTYPES).contiguous().view(1, -1)  # the kernel reads it flat
        self.check_generator_device(x.device)
        check_not_meta("tensor", x)
        numel = x.shape[1]
        out = self._check_buffer("out", out, numel, x.device, allocate=True)
        check_disjoint("out", out, "tensor", x)
        bad = self._encode_rows(x, out.view(1, -1), self._fresh_key(), 0, numel)
        if bad and self.check_finite == "raise":
            raise NonFiniteError(
                f"tensor holds NaN or Inf in {bad} of its {self.num_chunks(numel)} chunks of {self.chunk_size} "
                "elements; fix the source (e.g. lower the loss scale) or use check_finite='flag'"
            )
        return out

    def decode(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Invert :meth:`encode`: ``numel`` elements of ``dtype`` (exact in fp32, rounded once to ``dtype``)."""
        numel = check_positive_int("numel", numel, minimum=0)
        buffer = self._check_buffer("buffer", buffer, numel, None, allocate=False)
        dtype = check_dtype("dtype", dtype, FLOAT_DTYPES)
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=buffer.device)
        else:
            check_tensor("out", out, (dtype,), contiguous=True, device=buffer.device)
            if out.numel() != numel:
                raise ValueError(f"out must hold {numel} elements; got {out.numel()}")
        check_disjoint("out", out, "buffer", buffer)
        self._decode_rows(buffer.view(1, -1), numel, out.view(1, numel), False)
        return out.view(-1)

    def scales(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        """The per-chunk fp32 scales of an encoded buffer (decoded = code * scale; NaN if flagged)."""
        numel = check_positive_int("numel", numel, minimum=0)
        buffer = self._check_buffer("buffer", buffer, numel, None, allocate=False)
        chunks = self.num_chunks(numel)
        hdr = torch.empty(chunks, dtype=torch.float32, device=buffer.device)
        hdr.view(torch.uint8).copy_(buffer[: SCALE_BYTES_PER_CHUNK * chunks])
        return hdr

    def found_nonfinite(self, buffer: torch.Tensor, numel: int) -> bool:
        """Whether any chunk of an encoded buffer was flagged non-finite (reads only the scales)."""
        return bool(self.scales(buffer, numel).isnan().any())

    # ------------------------------------------------------------------ internals
    def _check_buffer(
        self, name: str, buffer: torch.Tensor | None, numel: int, device: torch.device | None, *, allocate: bool
    ) -> torch.Tensor:
        nbytes = self.encoded_nbytes(numel)
        if buffer is None and allocate:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        check_tensor(name, buffer, (torch.uint8,), contiguous=True)
        check_not_meta(name, buffer)
        if buffer.dim() != 1 or buffer.numel() != nbytes:
            raise ValueError(
                f"{name} must be a 1-D uint8 tensor of encoded_nbytes({numel}) = {nbytes} bytes; "
                f"got shape {tuple(buffer.shape)}"
            )
        if device is not None and buffer.device != device:
            raise ValueError(f"{name} is on {buffer.device} but the tensor is on {device}")
        return buffer

    def _views(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(first chunk, view [R, n, chunk len])`` covering every chunk of ``t`` [R, L] (rows contiguous)."""
        full, tail = divmod(t.shape[1], self.chunk_size)
        views = []
        if full:
            views.append((0, t[:, : full * self.chunk_size].unflatten(1, (full, self.chunk_size))))
        if tail:
            views.append((full, t[:, full * self.chunk_size :].unsqueeze(1)))
        return views

    def chunk_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """Exponents ``k`` (fp64) with ``amax * 2**k`` in ``(max/2, max]`` of the format, clamped to
        [-126, 126] (0 for an all-zero chunk); NaN where ``amax`` is not finite."""
        a = amax.double()
        top = self.format.max_finite
        _, e = torch.frexp(top / torch.where(a > 0, a, torch.ones_like(a)))
        k = e.double() - 1  # floor(log2(top / a)), up to the rounding of the fp64 quotient
        k = k - (a * torch.exp2(k) > top).double()  # exact products: never above the format's max
        k = k + (a * torch.exp2(k + 1) <= top).double()
        k = torch.where(a > 0, k.clamp(_K_MIN, _K_MAX), torch.zeros_like(k))
        return torch.where(torch.isfinite(a), k, torch.full_like(k, math.nan))

    def _encode_rows(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        path = native.route(x, out)
        if path is None:
            return self._encode_rows_torch(x, out, key, offset, row_stride)
        stochastic = self.rounding == "stochastic"
        args = (x, out, self.chunk_size, _FORMAT_CODES[self.fmt], stochastic, key, offset, row_stride)
        return kernels.quant_encode_fp8(*args) if path == "kernel" else int(ops.quant_encode_fp8(*args))

    def _encode_rows_torch(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        """The torch implementation (the fallback, and the oracle of the compiled kernel)."""
        rows, length = x.shape
        chunks = self.num_chunks(length)
        device = x.device
        hb = SCALE_BYTES_PER_CHUNK * chunks
        amax = self._scratch.get("amax", rows * chunks, torch.float32, device).view(rows, chunks)
        for first, xv in self._views(x):
            amax[:, first : first + xv.shape[1]].copy_(xv.abs().amax(dim=-1))  # NaN propagates
        k = self.chunk_scales(amax)
        finite = ~k.isnan()
        k0 = torch.where(finite, k, torch.zeros_like(k))
        up = torch.exp2(k0).float()  # exact powers of two
        scale = torch.where(finite, torch.exp2(-k0), torch.full_like(k0, math.nan)).float()
        out[:, :hb].copy_(scale.view(torch.uint8))
        stochastic = self.rounding == "stochastic"
        codes = out[:, hb:]
        y = self._scratch.get("y", rows * length, torch.float32, device).view(rows, length)
        for (first, xv), (_, yv) in zip(self._views(x), self._views(y)):
            n = xv.shape[1]
            torch.mul(xv, up[:, first : first + n, None], out=yv)  # exact: a power of two, |y| <= max
            yv.masked_fill_(~finite[:, first : first + n, None], 0.0)
        if stochastic:
            self._round_stochastic_(y, key, offset, row_stride)
        else:
            round_to(y, self.format, "nearest", out=y)
        self._saturate_(y, k0, finite)
        codes.copy_(y.to(self.dtype).view(torch.uint8))  # exact: y is on the format's grid
        return int((~finite).sum())

    def _saturate_(self, y: torch.Tensor, k: torch.Tensor, finite: torch.Tensor) -> None:
        """Keep every decoded value finite: in a chunk whose ``A`` is within one spacing of fp32's max, ``y`` may
        round up to ``2**(128 + k)``, which decodes to ``2**128 = inf``. Such codes become the largest value of
        the format's grid below it, ``(2 - 2**-m) 2**(127 + k)`` (``m`` fraction bits): ``|x|`` is below
        ``2**128``, so the error stays within ``u_f |x|`` (docs/compress.md). Only chunks with ``k`` at
        most ``-120`` (e4m3) or ``-113`` (e5m2) have such a ceiling below the format's max."""
        ceiling = (2.0 - 2.0**-self.format.man_bits) * torch.exp2(127.0 + k)
        low = finite & (ceiling < self.format.max_finite)
        if not bool(low.any()):
            return
        length = y.shape[1]
        for r, chunk in low.nonzero().tolist():
            a = chunk * self.chunk_size
            lim = float(ceiling[r, chunk])
            y[r, a : min(length, a + self.chunk_size)].clamp_(-lim, lim)

    def _round_stochastic_(self, y: torch.Tensor, key: int, offset: int, row_stride: int) -> None:
        """Round ``y`` [R, L] (fp32, within the format's range) in place: up in magnitude with probability equal
        to the fraction of the spacing, by :func:`mixprec.core.philox.round_up` on element (r, j)'s bits at
        stream position ``offset + r * row_stride + j``."""
        fmt = self.format
        rows, length = y.shape
        mag = y.abs()
        # The format's spacing at |y|: 2**(floor(log2 |y|) - man_bits), at least the subnormal spacing, built
        # from the fp32 exponent bits (exact powers of two).
        e = torch.bitwise_right_shift(mag.view(torch.int32), 23).clamp_min_(fmt.emin + 127)
        spacing = torch.bitwise_left_shift(e.sub_(fmt.man_bits), 23).view(torch.float32)
        q = mag.div_(spacing)  # exact: a power of two
        low = torch.floor(q)
        primary = self._byte_rows(key, offset, row_stride, rows, length, y.device)
        positions = (
            offset + torch.arange(length, device=y.device) + row_stride * torch.arange(rows, device=y.device)[:, None]
        )
        up = philox.round_up(key, primary, q.sub_(low), positions).to(torch.float32)  # frac(q), exact
        y.copy_(torch.copysign(low.add_(up).mul_(spacing), y))  # exact: a neighbour on the grid

    def _code_values(self, device: torch.device) -> torch.Tensor:
        """The fp32 value of each of the 256 codes (NaN codes stay NaN; never produced by encode)."""
        return torch.arange(256, dtype=torch.uint8, device=device).view(self.dtype).float()

    def _decode_rows(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        path = native.route(buf, out)
        if path is None:
            return self._decode_rows_torch(buf, length, out, reduce)
        if path == "op":  # traced or fake: a table of its own (none cached), looked up unless already checked
            fmt = -1 if self._table_format is None else self._table_format
            table = self._code_values(buf.device)
            return int(ops.quant_decode_fp8(buf, length, out, self.chunk_size, table, fmt, reduce))
        table = self._tables.get(buf.device)
        if table is None:
            table = self._tables[buf.device] = self._code_values(buf.device)
        if self._table_format is None:
            self._table_format = kernels.fp8_table_format(table)
        return kernels.quant_decode_fp8(buf, length, out, self.chunk_size, table, self._table_format, reduce)

    def _decode_rows_torch(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        """The torch implementation of :meth:`_decode_rows`."""
        rows = buf.shape[0]
        chunks = self.num_chunks(length)
        hb = SCALE_BYTES_PER_CHUNK * chunks
        scale = self._scratch.get("dscale", rows * chunks, torch.float32, buf.device).view(rows, chunks)
        scale.view(torch.uint8).copy_(buf[:, :hb])
        # Code -> value by a 256-entry table: torch's float8 -> fp32 cast is slow on CPU.
        table = self._tables.get(buf.device)
        if table is None:
            table = self._tables[buf.device] = self._code_values(buf.device)
        idx = self._scratch.get("idx", rows * length, torch.int32, buf.device)
        idx.view(rows, length).copy_(buf[:, hb:])
        vals = self._scratch.get("vals", rows * length, torch.float32, buf.device).view(rows, length)
        torch.index_select(table, 0, idx, out=vals.view(-1))  # exact values of the codes
        for first, vv in self._views(vals):
            vv.mul_(scale[:, first : first + vv.shape[1], None])  # exact: powers of two, no underflow
        if reduce:
            out.copy_(vals[0])
            for r in range(1, rows):
                out.add_(vals[r])
        else:
            out.copy_(vals)
        return int(scale.isnan().sum())


# What the compressed collectives accept: the quantizers share the row API (the block-scaled wire sizes its
# buffer itself: scales, then one byte per element or one per two).
Compressor = MinMaxUInt8 | ScaledFP8 | BlockScaledWire
COMPRESSORS: tuple[type, ...] = (MinMaxUInt8, ScaledFP8, BlockScaledWire)
