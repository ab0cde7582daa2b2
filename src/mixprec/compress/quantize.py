"""8-bit min-max quantization of gradients (after Bagua's ByteGrad), with a documented wire format.

:class:`MinMaxUInt8` cuts a tensor into chunks of ``chunk_size`` elements and encodes each as its fp32
(min, max) and one uint8 code per element: ONE contiguous uint8 buffer of ``8 * C + n`` bytes (all mins,
all maxs, then the codes). Codes round to nearest or stochastically (unbiased, from a given generator).
Per element, ``|decode(encode(x)) - x| <= k * step + 6.1 u R + 1.1 u M + 2**-150`` with ``R`` the chunk's
range, ``step = R / 255``, ``M`` its largest magnitude, ``u = 2**-24``, ``k = 1/2`` (nearest) or 1
(stochastic). A chunk holding NaN/Inf is flagged (``min = max = NaN``) and decodes to NaN.

``encode``/``decode`` work on one tensor; the row API (:meth:`MinMaxUInt8.encode_rows`,
:meth:`MinMaxUInt8.decode_rows`, :meth:`MinMaxUInt8.check_generator_device`, shared with ScaledFP8 in
``compress/_chunked.py``) on the rows of a 2-D view, which is what the compressed collectives are built from.
Both run the compiled kernel of ``mixprec/native/csrc/quant_u8.c`` (:mod:`mixprec.native.kernels`; as a custom op
under torch.compile) on CPU tensors, its Triton twin (:mod:`mixprec.native.gpu`) on CUDA tensors, else the torch
code here, with the same bits. The wire format, the
arithmetic (offset first; a float64 path near the fp32 limits), the Philox streams of stochastic rounding, the
bound and the speed tricks: ``docs/compress.md``.
"""

from __future__ import annotations

import math

import torch

import mixprec.native as native
from mixprec.compress._chunked import CHECK_FINITE as CHECK_FINITE
from mixprec.compress._chunked import FLOAT_DTYPES as FLOAT_DTYPES
from mixprec.compress._chunked import CheckFinite as CheckFinite
from mixprec.compress._chunked import ChunkedCompressor as ChunkedCompressor
from mixprec.compress._chunked import NonFiniteError as NonFiniteError
from mixprec.compress._chunked import check_disjoint as check_disjoint
from mixprec.compress._chunked import check_not_meta as check_not_meta
from mixprec.compress._chunked import check_rows_distinct as check_rows_distinct
from mixprec.compress._scratch import Scratch
from mixprec.core import philox
from mixprec.core.dtypes import Rounding
from mixprec.core.validate import check_dtype, check_positive_int, check_tensor
from mixprec.native import gpu, kernels, ops

__all__ = ["HEADER_BYTES_PER_CHUNK", "ChunkedCompressor", "MinMaxUInt8", "NonFiniteError"]

HEADER_BYTES_PER_CHUNK = 8  # fp32 min + fp32 max
_FP32_MAX = torch.finfo(torch.float32).max
# Below this range the fp32 step R/255 would be subnormal (losing relative precision) and 255/R may overflow.
_WIDE_BELOW = 255.0 * torch.finfo(torch.float32).tiny
_MAGIC = 8388608.0  # 2**23: fl32(q + 2**23) = 2**23 + rne(q) for 0 <= q < 2**22, so the low byte holds rne(q)
# Elements per block of the cache-blocked passes: 512 KiB of fp32 scratch, well inside a 1.25 MiB L2.
_BLOCK = 1 << 17
# Elements per super-block of the encoder: its min/max pass leaves 4 MiB of fp32 input in the last-level
# cache for the code pass (instead of reading it twice from DRAM), and the fp64 per-chunk scalars are
# computed once per super-block (a handful of small ops).
_SUPER = 1 << 20


class MinMaxUInt8(ChunkedCompressor):
    """Per-chunk min-max 8-bit quantizer: ``encode(tensor) -> uint8 buffer``, ``decode(buffer, numel, dtype)``.

    Each chunk's header is an fp32 (min, max) pair (``HEADER_BYTES = 8``).

    The format, the arithmetic and the error bound: ``docs/compress.md``.

    Args:
        chunk_size: elements per (min, max) pair, int >= 1. Smaller chunks track the local range more
            closely (smaller step) at ``8 / chunk_size`` bytes of header per element (0.4% at 2048).
        rounding: ``"nearest"`` (round half to even; biased for a fixed input, error <= step / 2) or
            ``"stochastic"`` (unbiased, error < 1 step; one 64-bit Philox key drawn from ``generator`` per
            encode, element i's random bits at stream position i: :mod:`mixprec.core.philox`, so the codes do not
            depend on the thread count or on how the collectives cut the tensor into segments).
        generator: torch.Generator for stochastic rounding, on the device of the tensors it will encode
            (``encode`` raises ValueError otherwise); None = torch's default generator. In a multi-process
            run, seed each rank differently: :func:`mixprec.comm.rank_generator` (the reducers use it).
        check_finite: what ``encode`` does when the input holds NaN/+-Inf: ``"raise"`` a
            :class:`NonFiniteError`, or ``"flag"``: encode each such chunk as ``min = max = NaN`` (it decodes
            to NaN, so the overflow reaches the loss scaler) and let the caller ask
            :meth:`found_nonfinite`. Never spread as a finite value.

    Speed: with the compiled kernels (:mod:`mixprec.native`) one fused pass per chunk; the torch path (the
    fallback, same bits) keeps scratch buffers: one fp32 block of ``_BLOCK`` elements (plus one more for
    stochastic rounding), fp32/fp64 per-chunk scalars, and for stochastic rounding ``numel`` random
    bytes; kept and reused across calls, so an instance is not thread-safe.
    """

    HEADER_BYTES = HEADER_BYTES_PER_CHUNK

    def __init__(
        self,
        *,
        chunk_size: int = 2048,
        rounding: Rounding = "nearest",
        generator: torch.Generator | None = None,
        check_finite: CheckFinite = "raise",
    ) -> None:
        super().__init__(chunk_size=chunk_size, rounding=rounding, generator=generator, check_finite=check_finite)
        self._scratch = Scratch()

    def __repr__(self) -> str:
        return (
            f"MinMaxUInt8(chunk_size={self.chunk_size}, rounding={self.rounding!r}, check_finite={self.check_finite!r})"
        )

    # ------------------------------------------------------------------ public API
    def encode(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize ``tensor`` (fp32/fp16/bf16, any shape, flattened row-major) into one uint8 buffer.

        Args:
            tensor: the values; not modified.
            out: optional preallocated buffer: 1-D contiguous uint8 of ``encoded_nbytes(tensor.numel())``
                bytes on the tensor's device (reuse it across calls to avoid allocation).

        Returns:
            ``out`` (or a new buffer) holding the header and the codes.

        Raises:
            NonFiniteError: the tensor holds NaN/Inf and ``check_finite="raise"`` (``out`` is then filled
                as in ``"flag"`` mode).
            ValueError: stochastic rounding with a ``generator`` on another device than the tensor.
        """
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
                "elements; fix the source (e.g. lower the loss scale) or use check_finite='flag' to get a flag "
                "(found_nonfinite) for the loss scaler instead"
            )
        return out

    def decode(
        self,
        buffer: torch.Tensor,
        numel: int,
        dtype: torch.dtype = torch.float32,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Invert :meth:`encode`: a 1-D tensor of ``numel`` elements of ``dtype`` (fp32/fp16/bf16).

        Computed in fp32 and rounded once to ``dtype``; chunks flagged non-finite decode to NaN. ``out``
        (optional) is a contiguous tensor of ``numel`` elements and dtype ``dtype`` to write into.
        """
        numel = check_positive_int("numel", numel, minimum=0)
        buffer = self._check_buffer("buffer", buffer, numel, None, allocate=False)
        dtype = check_dtype("dtype", dtype, FLOAT_DTYPES)
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=buffer.device)
        else:
            check_tensor("out", out, FLOAT_DTYPES)
            if out.dtype != dtype or out.numel() != numel or not out.is_contiguous() or out.device != buffer.device:
                raise ValueError(
                    f"out must be a contiguous {dtype} tensor of {numel} elements on {buffer.device}; "
                    f"got {out.dtype} with {out.numel()} elements on {out.device}"
                )
        check_disjoint("out", out, "buffer", buffer)
        self._decode_rows(buffer.view(1, -1), numel, out.view(1, numel), False)
        return out.view(-1)

    def header(self, buffer: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-chunk ``(min, max)`` fp32 tensors stored in an encoded buffer (copies, NaN if flagged)."""
        numel = check_positive_int("numel", numel, minimum=0)
        buffer = self._check_buffer("buffer", buffer, numel, None, allocate=False)
        chunks = self.num_chunks(numel)
        hdr = torch.empty(2 * chunks, dtype=torch.float32, device=buffer.device)
        hdr.view(torch.uint8).copy_(buffer[: HEADER_BYTES_PER_CHUNK * chunks])
        return hdr[:chunks], hdr[chunks:]

    def found_nonfinite(self, buffer: torch.Tensor, numel: int) -> bool:
        """Whether any chunk of an encoded buffer was flagged non-finite (reads only the header)."""
        mins, maxs = self.header(buffer, numel)
        return bool(mins.isnan().any() or maxs.isnan().any())

    # ------------------------------------------------------------------ internals
    def _check_buffer(
        self, name: str, buffer: torch.Tensor | None, numel: int, device: torch.device | None, *, allocate: bool
    ) -> torch.Tensor:
        nbytes = self.encoded_nbytes(numel)
        if buffer is None and allocate:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        check_tensor(name, buffer, (torch.uint8,), contiguous=True)
        check_not_meta(name, buffer)
        if buffer.dim() != 1:
            raise ValueError(f"{name} must be a 1-D uint8 tensor; got shape {tuple(buffer.shape)}")
        if buffer.numel() != nbytes:
            raise ValueError(
                f"{name} must hold encoded_nbytes({numel}) = {nbytes} bytes (8 header bytes per chunk of "
                f"{self.chunk_size} + 1 per element); got {buffer.numel()}"
            )
        if device is not None and buffer.device != device:
            raise ValueError(f"{name} is on {buffer.device} but the tensor is on {device}")
        return buffer

    def _buf(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._scratch.get(name, numel, dtype, device)

    def _blocks(self, t: torch.Tensor, per_block: int) -> list[tuple[int, int, torch.Tensor]]:
        """Cache blocks of ``t`` [R, L] (rows contiguous): ``(first chunk, n chunks, view [R, n, chunk len])``
        covering every chunk of every row, ``per_block`` chunks at a time; a short last chunk is its own block.
        """
        length = t.shape[1]
        c = self.chunk_size
        full, tail = divmod(length, c)
        blocks = []
        if full:
            whole = t[:, : full * c].unflatten(1, (full, c))
            blocks += [(f, min(per_block, full - f), whole[:, f : f + per_block]) for f in range(0, full, per_block)]
        if tail:
            blocks.append((full, 1, t[:, full * c :].unsqueeze(1)))
        return blocks

    def _chunk_bounds(self, chunk: int, length: int) -> tuple[int, int]:
        start = chunk * self.chunk_size
        return start, min(length, start + self.chunk_size)

    @staticmethod
    def _scalars(mins: torch.Tensor, maxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-chunk range ``R = max - min`` (fp64) and whether the chunk needs the float64 path."""
        rng = maxs.double() - mins.double()
        return rng, (rng > _FP32_MAX) | ((rng > 0) & (rng < _WIDE_BELOW))  # NaN: neither

    @classmethod
    def grid(cls, mins: torch.Tensor, maxs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-chunk grid from the fp32 header: ``(rng, wide, sub, scale, zero, step)``.

        ``rng`` (fp64) and ``wide`` as for the float64 path; ``sub``, ``scale``, ``zero``, ``step`` (fp32)
        define ``q = fl32(fl32(fl32(x - sub) * scale) + zero)`` and ``y = fl32(fl32((code - zero) * step) + sub)``.
        A chunk with ``min < 0 <= max`` (fp32 path) is aligned to 0: ``step = fl32(R / 254)``, ``zero`` the
        smallest integer with ``zero * step >= -min`` (exact), ``sub = 0``, ``scale = fl32(1 / step)``, so
        0 encodes to ``zero`` and decodes to exactly 0. Any other chunk: ``sub = min``, ``zero = 0``,
        ``step = fl32(R / 255)``, ``scale = fl32(255 / R)`` (0 when ``R = 0``). See ``docs/compress.md``.
        """
        rng, wide = cls._scalars(mins, maxs)
        lo = mins.double()
        aligned = (lo < 0) & (maxs >= 0) & ~wide  # NaN: False
        step = torch.where(aligned, rng / 254.0, rng / 255.0).float()
        s64 = step.double()
        # torch.div, not ``255.0 / rng``: a scalar over a tensor is reciprocal-then-multiply in torch, two
        # roundings; the documented (and compiled) arithmetic is one correctly rounded fp64 division.
        over = torch.div(torch.full_like(rng, 255.0), rng)
        scale = torch.where(aligned, 1.0 / s64, torch.where(rng > 0, over, torch.zeros_like(rng))).float()
        neg = torch.where(aligned, -lo, torch.zeros_like(lo))
        safe = torch.where(aligned, s64, torch.ones_like(s64))
        zero = torch.ceil(neg / safe)
        # The fp64 quotient may sit one ulp off an integer: make zero the exact ceiling (products are exact:
        # an 8-bit integer times a 24-bit step).
        zero = zero - ((zero - 1) * safe >= neg).double()
        zero = zero + (zero * safe < neg).double()
        sub = torch.where(aligned, torch.zeros_like(mins), mins)
        return rng, wide, sub, scale, zero.float(), step

    def _encode_rows(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        """:meth:`encode_rows` on checked arguments: the compiled kernel when there is one, else torch."""
        stochastic = self.rounding == "stochastic"
        path = native.route(x, out)
        if path == "kernel":
            return kernels.quant_encode_u8(x, out, self.chunk_size, stochastic, key, offset, row_stride)
        if path == "op":
            return int(ops.quant_encode_u8(x, out, self.chunk_size, stochastic, key, offset, row_stride))
        stream = (key, offset, row_stride) if stochastic else None
        if gpu.can_run(x, out):
            stats = gpu.quant_encode_u8(x, out, self.chunk_size, stochastic, key, offset, row_stride)
            n_bad, n_wide = stats.tolist()  # the one synchronization
            if n_wide:
                rows, length = x.shape
                hb = HEADER_BYTES_PER_CHUNK * self.num_chunks(length)
                hdr = out[:, :hb].contiguous().view(torch.float32).view(rows, 2, -1)
                rng, wide = self._scalars(hdr[:, 0], hdr[:, 1])  # flagged chunks hold NaN: neither
                self._encode_wide(x, out[:, hb:], hdr[:, 0], rng, wide, stream)
            return int(n_bad)
        return self._encode_rows_torch(x, out, stream)

    def _encode_wide(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        mins: torch.Tensor,
        rng: torch.Tensor,
        wide: torch.Tensor,
        stream: tuple[int, int, int] | None,
    ) -> None:
        """Codes of the chunks whose range needs float64 arithmetic (rare), chunk by chunk: one division."""
        length = x.shape[1]
        for r, chunk in wide.nonzero().tolist():
            a, b = self._chunk_bounds(chunk, length)
            q = (x[r, a:b].double() - mins[r, chunk].double()) * (255.0 / float(rng[r, chunk]))
            if stream is not None:
                key, offset, row_stride = stream
                first = offset + r * row_stride + a
                primary = philox.stream_bytes(key, first, b - a, x.device)
                fl = q.floor()
                positions = first + torch.arange(b - a, device=x.device)
                q = fl + philox.round_up(key, primary, q - fl, positions).double()
            else:
                q = q.round()
            codes[r, a:b].copy_(q.clamp_(0.0, 255.0))

    def _encode_rows_torch(self, x: torch.Tensor, out: torch.Tensor, stream: tuple[int, int, int] | None) -> int:
        """The torch implementation (the fallback, and the oracle of the compiled kernel).

        Works on super-blocks of about ``_SUPER`` elements (all rows at once): a min/max pass that pulls them
        into the last-level cache, the fp64 chunk scalars, then the code pass block by block in L2.
        ``stream``: stochastic rounding's ``(key, offset, row_stride)``; None for nearest rounding.
        """
        rows, length = x.shape
        chunks = self.num_chunks(length)
        device = x.device
        c = self.chunk_size
        hdr = self._buf("hdr", rows * 2 * chunks, torch.float32, device).view(rows, 2, chunks)
        mins, maxs = hdr[:, 0], hdr[:, 1]  # (R, C) each, rows contiguous
        scale = self._buf("scale", rows * chunks, torch.float32, device).view(rows, chunks)
        sub = self._buf("sub", rows * chunks, torch.float32, device).view(rows, chunks)
        zero = self._buf("zero", rows * chunks, torch.float32, device).view(rows, chunks)
        stochastic = stream is not None
        key, offset, row_stride = stream if stream is not None else (0, 0, 0)
        primary = philox.byte_rows(key, offset, row_stride, rows, length, device) if stochastic else None
        # Stream positions of the elements (broadcast): offset + r * row_stride + j.
        row_pos = offset + row_stride * torch.arange(rows, dtype=torch.int64, device=device)
        per_block = max(1, _BLOCK // (rows * c))
        x_blocks = self._blocks(x, per_block)
        code_blocks = self._blocks(out[:, HEADER_BYTES_PER_CHUNK * chunks :], per_block)
        u_blocks = self._blocks(primary, per_block) if primary is not None else None
        block_elems = rows * per_block * c
        work = self._buf("work", block_elems, torch.float32, device)
        floor = self._buf("floor", block_elems if stochastic else 0, torch.float32, device)
        group = max(1, _SUPER // _BLOCK)

        for g in range(0, len(x_blocks), group):
            members = range(g, min(len(x_blocks), g + group))
            for i in members:  # pass 1: per-chunk min and max (NaN propagates; +-Inf shows up as a bound)
                first, n, xv = x_blocks[i]
                if x.dtype == torch.float32:
                    torch.amin(xv, dim=-1, out=mins[:, first : first + n])
                    torch.amax(xv, dim=-1, out=maxs[:, first : first + n])
                else:  # fp16/bf16 bounds are exact in fp32
                    mins[:, first : first + n].copy_(torch.amin(xv, dim=-1))
                    maxs[:, first : first + n].copy_(torch.amax(xv, dim=-1))
            lo = x_blocks[members[0]][0]
            hi = x_blocks[members[-1]][0] + x_blocks[members[-1]][1]
            _, _, sub_g, scale_g, zero_g, _ = self.grid(mins[:, lo:hi], maxs[:, lo:hi])
            scale[:, lo:hi].copy_(scale_g)
            sub[:, lo:hi].copy_(sub_g)
            zero[:, lo:hi].copy_(zero_g)
            for i in members:  # pass 2: codes
                first, n, xv = x_blocks[i]
                clen = xv.shape[-1]
                w = work[: rows * n * clen].view(rows, n, clen)
                torch.sub(xv, sub[:, first : first + n, None], out=w)
                w.mul_(scale[:, first : first + n, None])
                w.add_(zero[:, first : first + n, None])
                if u_blocks is not None:
                    f = floor[: rows * n * clen].view(rows, n, clen)
                    torch.floor(w, out=f)
                    w.sub_(f)  # frac(q), exact
                    pos = row_pos[:, None, None] + torch.arange(first * c, (first + n) * c, device=device)[: n * clen]
                    up = philox.round_up(key, u_blocks[i][2], w, pos.view(rows, n, clen))  # P = frac(q)
                    w.copy_(up).add_(f).clamp_(0.0, 255.0)  # q may leave [0, 255] by a few ulps
                w.add_(_MAGIC)
                code_blocks[i][2].copy_(w.view(torch.int32))  # int32 -> uint8 keeps the low byte

        rng, wide = self._scalars(mins, maxs)
        finite = torch.isfinite(mins) & torch.isfinite(maxs)
        n_bad = int((~finite).sum())
        if n_bad:
            mins.masked_fill_(~finite, math.nan)
            maxs.masked_fill_(~finite, math.nan)
        out[:, : HEADER_BYTES_PER_CHUNK * chunks].copy_(hdr.view(rows, 2 * chunks).view(torch.uint8))

        # Rare paths, chunk by chunk: float64 arithmetic for extreme ranges; zero codes for flagged chunks.
        codes = out[:, HEADER_BYTES_PER_CHUNK * chunks :]
        self._encode_wide(x, codes, mins, rng, wide & finite, stream)
        if n_bad:
            for r, chunk in (~finite).nonzero().tolist():
                a, b = self._chunk_bounds(chunk, length)
                codes[r, a:b].zero_()
        return n_bad

    def _decode_rows(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        """:meth:`decode_rows` on checked arguments: the compiled kernel when there is one, else torch."""
        if gpu.can_run(buf, out):
            n_bad, n_wide = gpu.quant_decode_u8(buf, length, out, self.chunk_size, reduce).tolist()
            if n_wide:
                hb = HEADER_BYTES_PER_CHUNK * self.num_chunks(length)
                hdr = buf[:, :hb].contiguous().view(torch.float32).view(buf.shape[0], 2, -1)
                rng, wide, sub, _, zero, step = self.grid(hdr[:, 0], hdr[:, 1])
                self._decode_wide(buf[:, hb:], length, out, reduce, hdr[:, 0], rng, wide, sub, zero, step)
            return int(n_bad)
        path = native.route(buf, out)
        if path == "kernel":
            return kernels.quant_decode_u8(buf, length, out, self.chunk_size, reduce)
        if path == "op":
            return int(ops.quant_decode_u8(buf, length, out, self.chunk_size, reduce))
        return self._decode_rows_torch(buf, length, out, reduce)

    def _decode_rows_torch(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        """The torch implementation of :meth:`_decode_rows`."""
        rows = buf.shape[0]
        chunks = self.num_chunks(length)
        device = buf.device
        hb = HEADER_BYTES_PER_CHUNK * chunks
        hdr = self._buf("dhdr", rows * 2 * chunks, torch.float32, device).view(rows, 2, chunks)
        hdr.view(rows, 2 * chunks).view(torch.uint8).copy_(buf[:, :hb])
        mins = hdr[:, 0]
        rng, wide, sub, _, zero, step = self.grid(mins, hdr[:, 1])  # step, sub NaN for flagged chunks
        n_bad = int(mins.isnan().sum())
        per_block = max(1, _BLOCK // (rows * self.chunk_size))
        code_blocks = self._blocks(buf[:, hb:], per_block)
        out_blocks = self._blocks(out.view(1, -1) if reduce else out, per_block)
        # Decode straight into out when nothing is left to do afterwards (no sum, no rounding to fp16/bf16).
        direct = out.dtype == torch.float32 and (not reduce or rows == 1)
        work = self._buf("dwork", 0 if direct else rows * per_block * self.chunk_size, torch.float32, device)
        for (first, n, cv), (_, _, ov) in zip(code_blocks, out_blocks):
            clen = cv.shape[-1]
            w = ov if direct else work[: rows * n * clen].view(rows, n, clen)
            w.copy_(cv)
            w.sub_(zero[:, first : first + n, None])
            w.mul_(step[:, first : first + n, None])
            w.add_(sub[:, first : first + n, None])
            if reduce and rows > 1:
                acc = ov[0]
                torch.add(w[0], w[1], out=acc)
                for r in range(2, rows):
                    acc.add_(w[r])
            elif not direct:
                ov.copy_(w)

        self._decode_wide(buf[:, hb:], length, out, reduce, mins, rng, wide, sub, zero, step)
        return n_bad

    def _decode_wide(
        self,
        codes: torch.Tensor,
        length: int,
        out: torch.Tensor,
        reduce: bool,
        mins: torch.Tensor,
        rng: torch.Tensor,
        wide: torch.Tensor,
        sub: torch.Tensor,
        zero: torch.Tensor,
        step: torch.Tensor,
    ) -> None:
        """Chunks needing float64 arithmetic: recompute them (and, when reducing, their whole sum)."""
        rows = codes.shape[0]
        for chunk in sorted({c for _, c in wide.nonzero().tolist()}):
            a, b = self._chunk_bounds(chunk, length)
            decoded = [
                self._decode_chunk_wide(codes[r, a:b], mins[r, chunk], rng[r, chunk])
                if bool(wide[r, chunk])
                else (codes[r, a:b].float() - zero[r, chunk]) * step[r, chunk] + sub[r, chunk]  # separate fp32 ops
                for r in range(rows)
            ]
            if reduce:
                acc = decoded[0].clone()
                for d in decoded[1:]:
                    acc += d
                out[a:b].copy_(acc)
            else:
                for r in range(rows):
                    if bool(wide[r, chunk]):
                        out[r, a:b].copy_(decoded[r])

    @staticmethod
    def _decode_chunk_wide(codes: torch.Tensor, chunk_min: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
        """One chunk decoded in float64 and rounded once to fp32."""
        return (chunk_min.double() + codes.double() * (rng / 255.0)).float()
