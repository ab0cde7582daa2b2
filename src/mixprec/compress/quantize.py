"""8-bit min-max quantization of gradients (after Bagua's ByteGrad), with a documented wire format.

:class:`MinMaxUInt8` cuts a tensor into chunks of ``chunk_size`` elements and encodes each as its fp32
(min, max) and one uint8 code per element: ONE contiguous uint8 buffer of ``8 * C + n`` bytes (all mins,
all maxs, then the codes). Codes round to nearest or stochastically (unbiased, from a given generator).
Per element, ``|decode(encode(x)) - x| <= k * step + 6.1 u R + 1.1 u M + 2**-150`` with ``R`` the chunk's
range, ``step = R / 255``, ``M`` its largest magnitude, ``u = 2**-24``, ``k = 1/2`` (nearest) or 1
(stochastic). A chunk holding NaN/Inf is flagged (``min = max = NaN``) and decodes to NaN.

``encode``/``decode`` work on one tensor; the row API (:meth:`MinMaxUInt8.encode_rows`,
:meth:`MinMaxUInt8.decode_rows`, :meth:`MinMaxUInt8.check_generator_device`) on the rows of a 2-D view, which
is what the compressed collectives are built from. Both run the compiled kernel of
``mixprec/native/csrc/quantize.c`` when :func:`mixprec.native.library` has one (CPU tensors), its Triton twin
(:mod:`mixprec.native.gpu`) on CUDA tensors, else the torch code here, with the same bits. The wire format, the
arithmetic (offset first; a float64 path near the fp32 limits), the Philox streams of stochastic rounding, the
bound and the speed tricks: ``docs/compress.md``.
"""

from __future__ import annotations

import abc
import ctypes
import math
from typing import Literal

import torch

import mixprec.native as native
from mixprec.compress._scratch import Scratch
from mixprec.core import philox
from mixprec.core.dtypes import LOW_PRECISION_DTYPES, ROUNDINGS, Rounding
from mixprec.core.validate import check_bool, check_choice, check_dtype, check_positive_int, check_tensor
from mixprec.native import gpu

__all__ = ["HEADER_BYTES_PER_CHUNK", "ChunkedCompressor", "MinMaxUInt8", "NonFiniteError"]

CheckFinite = Literal["raise", "flag"]

HEADER_BYTES_PER_CHUNK = 8  # fp32 min + fp32 max
# What the quantizer encodes and decodes to; fp32 first, as the error messages list it.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, *LOW_PRECISION_DTYPES)
CHECK_FINITE: tuple[str, ...] = ("raise", "flag")
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


# The kernels' dtype codes (native/csrc/quantize.c).
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Kernels:
    """The quantizer's functions of one loaded kernel library, with their C signatures bound."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32, u64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
        self.encode = lib.mixprec_quant_encode_u8
        self.encode.argtypes = [ptr, i32, i64, i64, i64, ptr, i64, i64, i32, u64, i64, i64, i32]
        self.encode.restype = i64
        self.decode = lib.mixprec_quant_decode_u8
        self.decode.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, i64, i32, i32]
        self.decode.restype = i64
        self.encode_fp8 = lib.mixprec_quant_encode_fp8
        self.encode_fp8.argtypes = [ptr, i32, i64, i64, i64, ptr, i64, i64, i32, i32, u64, i64, i64, i32]
        self.encode_fp8.restype = i64
        self.decode_fp8 = lib.mixprec_quant_decode_fp8
        self.decode_fp8.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, i64, ptr, i32, i32, i32]
        self.decode_fp8.restype = i64
        self.fp8_table_format = lib.mixprec_quant_fp8_table_format  # which arithmetic reproduces a code table
        self.fp8_table_format.argtypes = [ptr]
        self.fp8_table_format.restype = i32
        # The Philox generator on its own (tests): one block, the primary bytes of a range of stream
        # positions, and the secondary words of given positions.
        self.philox_block = lib.mixprec_quant_philox_block
        self.philox_block.argtypes = [ptr, ptr, ptr]
        self.philox_block.restype = None
        self.philox_bytes = lib.mixprec_quant_philox_bytes
        self.philox_bytes.argtypes = [u64, i64, i64, ptr]
        self.philox_bytes.restype = None
        self.philox_tie_words = lib.mixprec_quant_philox_tie_words
        self.philox_tie_words.argtypes = [u64, ptr, i64, ptr]
        self.philox_tie_words.restype = None


_bound: dict[int, _Kernels] = {}


def _kernels() -> _Kernels | None:
    """The bound kernels, or None when the torch path must run (no compiler, or ``native.disabled()``)."""
    lib = native.library()
    if lib is None:
        return None
    kernels = _bound.get(id(lib))
    if kernels is None:
        kernels = _bound[id(lib)] = _Kernels(lib)
    return kernels


def check_rows_distinct(name: str, t: torch.Tensor) -> None:
    """ValueError when rows of the 2-D ``t`` (rows contiguous) share memory: an ``expand``-ed or ``as_strided``
    output, which a kernel would write twice (torch's own ops refuse some of them: "more than one element of the
    written-to tensor refers to a single memory location")."""
    rows, cols = t.shape
    if rows > 1 and cols > 0 and t.stride(0) < cols:
        raise ValueError(
            f"the rows of {name} overlap each other in memory (row stride {t.stride(0)} < row length {cols}, e.g. "
            f"an expanded or as_strided tensor): every element written needs memory of its own"
        )


def check_disjoint(out_name: str, out: torch.Tensor, in_name: str, inp: torch.Tensor) -> None:
    """ValueError when ``out`` shares memory with ``inp`` (each 2-D with contiguous rows and a row stride >= 0,
    or contiguous of another rank): the kernels read ``inp`` while they write ``out``, so the result would depend
    on the order of the writes. The byte spans decide the common case; rows interleaved in one buffer are
    compared row by row. About 1 us: it runs on every call, compiled or not."""
    if (type(out) is not torch.Tensor or type(inp) is not torch.Tensor) and not native.can_run(
        out, inp, device_type=out.device.type
    ):  # fake tensors, tracing modes: no addresses to compare
        return
    if out.numel() == 0 or inp.numel() == 0:
        return
    spans = []
    for t in (out, inp):
        e = t.element_size()
        if t.dim() != 2:
            spans.append((t.data_ptr(), 0, t.numel() * e, 1))
        else:
            spans.append((t.data_ptr(), t.stride(0) * e, t.shape[1] * e, t.shape[0]))
    (a0, a_stride, a_len, a_rows), (b0, b_stride, b_len, b_rows) = spans
    if a0 >= b0 + (b_rows - 1) * b_stride + b_len or b0 >= a0 + (a_rows - 1) * a_stride + a_len:
        return
    rows = sorted(
        [(a0 + r * a_stride, a0 + r * a_stride + a_len, 0) for r in range(a_rows)]
        + [(b0 + r * b_stride, b0 + r * b_stride + b_len, 1) for r in range(b_rows)]
    )
    reach = [0, 0]  # the furthest end of the rows of out, of inp, seen so far
    for start, end, which in rows:
        if start < reach[1 - which]:
            raise ValueError(
                f"{out_name} overlaps {in_name} in memory: the kernels read {in_name} while they write "
                f"{out_name}; pass an {out_name} that shares no memory with {in_name}"
            )
        reach[which] = max(reach[which], end)


def check_not_meta(name: str, t: torch.Tensor) -> None:
    """ValueError for a meta tensor: it has a shape but no values, and encoding or decoding needs the values
    (the count of non-finite chunks, the scales)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data): the quantizers need real values; got device meta")


class NonFiniteError(ValueError):
    """The tensor to encode holds NaN or +-Inf (``check_finite="raise"``)."""


class ChunkedCompressor(abc.ABC):
    """What the chunked quantizers share (:class:`MinMaxUInt8`, :class:`mixprec.compress.ScaledFP8`): their
    options, the encoded buffer's size (``HEADER_BYTES`` of header per chunk, then one byte per element), and
    the validated row API that the collectives call. A subclass sets ``HEADER_BYTES`` and implements
    ``_encode_rows`` / ``_decode_rows`` on arguments this class has checked."""

    HEADER_BYTES: int

    def __init__(
        self,
        *,
        chunk_size: int,
        rounding: Rounding,
        generator: torch.Generator | None,
        check_finite: CheckFinite,
    ) -> None:
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.rounding: Rounding = check_choice("rounding", rounding, ROUNDINGS)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
        self.generator = generator
        self.check_finite: CheckFinite = check_choice("check_finite", check_finite, CHECK_FINITE)

    # ------------------------------------------------------------------ sizes
    def num_chunks(self, numel: int) -> int:
        """Number of chunks (each with its header) for ``numel`` elements: ``ceil(numel / chunk_size)``."""
        return -(-check_positive_int("numel", numel, minimum=0) // self.chunk_size)

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of the encoded buffer: ``HEADER_BYTES * num_chunks(numel) + numel``."""
        return self.HEADER_BYTES * self.num_chunks(numel) + numel

    def header_nbytes(self, numel: int) -> int:
        """Bytes of the encoded buffer that are not element codes (the chunk headers)."""
        return self.HEADER_BYTES * self.num_chunks(numel)

    # ------------------------------------------------------------------ row API (the collectives' building blocks)
    def check_generator_device(self, device: torch.device) -> None:
        """ValueError unless stochastic rounding's ``generator`` (if any) can draw on ``device``.

        Torch raises an obscure error for a CPU generator and CUDA output, and a CUDA generator cannot draw
        CPU numbers; a collective calls this before it sends anything.
        """
        gen = self.generator
        if gen is None or self.rounding != "stochastic":
            return
        same = gen.device.type == device.type and (
            gen.device.index is None or device.index is None or gen.device.index == device.index
        )
        if not same:
            raise ValueError(
                f"generator is on {gen.device} but the tensor is on {device}: stochastic rounding draws on the "
                "tensor's device; pass a generator created there (e.g. mixprec.comm.rank_generator(seed, device))"
            )

    def encode_rows(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        key: int | None = None,
        offset: int = 0,
        row_stride: int | None = None,
    ) -> int:
        """Encode each row of ``x`` into the matching row of ``out``, each row as :meth:`encode` would.

        Never raises for NaN/Inf: flagged chunks are counted (``check_finite`` is the caller's business).
        Stochastic rounding takes element ``(r, j)``'s bits from position ``offset + r * row_stride + j``
        of the Philox stream ``key`` (:mod:`mixprec.core.philox`), so a caller that encodes a tensor in
        pieces gets the bits of one encode of the whole tensor by passing each piece's positions.

        Args:
            x: [R, L] fp32/fp16/bf16; rows may be strided, each row's elements contiguous. Not modified.
            out: [R, encoded_nbytes(L)] uint8 on ``x``'s device, each row's bytes contiguous.
            key: stochastic rounding's 64-bit stream key, an int in [0, 2**64); None = one fresh key from
                ``generator`` (:func:`mixprec.core.philox.draw_key`). Ignored for nearest rounding.
            offset: stream position of ``x[0, 0]``, int >= 0.
            row_stride: stream positions from one row to the next, int >= 0; None = ``L`` (rows back to back).

        Returns:
            The number of chunks flagged non-finite (over all rows).
        """
        self._check_rows("x", x, FLOAT_DTYPES, None)
        rows, length = x.shape
        self._check_rows("out", out, (torch.uint8,), (rows, self.encoded_nbytes(length)), x.device)
        self.check_generator_device(x.device)
        check_not_meta("x", x)
        check_rows_distinct("out", out)
        check_disjoint("out", out, "x", x)
        offset = check_positive_int("offset", offset, minimum=0)
        row_stride = length if row_stride is None else check_positive_int("row_stride", row_stride, minimum=0)
        if offset + max(rows - 1, 0) * row_stride + length > philox.MAX_POSITION:
            raise ValueError(f"offset + (rows - 1) * row_stride + length must be at most 2**62; got offset {offset}")
        if self.rounding == "stochastic":
            key = philox.draw_key(self.generator) if key is None else self._check_key(key)
        else:
            key = 0
        if rows == 0:
            return 0
        return self._encode_rows(x, out, key, offset, row_stride)

    def draw_key(self) -> int:
        """One 64-bit stream key from ``generator`` (one ``torch.randint`` of two 32-bit words), for callers that
        encode one tensor in several :meth:`encode_rows` calls."""
        return philox.draw_key(self.generator)

    @staticmethod
    def _byte_rows(
        key: int, offset: int, row_stride: int, rows: int, length: int, device: torch.device
    ) -> torch.Tensor:
        """[rows, length] uint8 primary bytes of the stream ``key`` (row r at ``offset + r * row_stride``): the
        compiled generator when there is one, else :func:`mixprec.core.philox.byte_rows` (the same bits)."""
        kernels = _kernels() if device.type == "cpu" and native.can_run() else None
        if kernels is None:
            return philox.byte_rows(key, offset, row_stride, rows, length, device)
        out = torch.empty(rows, length, dtype=torch.uint8)
        for r in range(rows):
            kernels.philox_bytes(key, offset + r * row_stride, length, out[r].data_ptr())
        return out

    def _fresh_key(self) -> int:
        """A key for one stochastic encode (0, drawing nothing, for nearest rounding)."""
        return philox.draw_key(self.generator) if self.rounding == "stochastic" else 0

    @staticmethod
    def _check_key(key: object) -> int:
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"key must be an int in [0, 2**64); got {type(key).__name__}")
        if not 0 <= key < 1 << 64:
            raise ValueError(f"key must be an int in [0, 2**64); got {key}")
        return key

    def decode_rows(self, buffers: torch.Tensor, length: int, out: torch.Tensor, *, reduce: bool = False) -> int:
        """Decode each row of ``buffers`` into the matching row of ``out``, or sum the decoded rows.

        Each decoded row is exactly what :meth:`decode` gives in fp32. With ``reduce=True`` the rows are
        summed in fp32, in row order (``((dec_0 + dec_1) + dec_2) + ...``), into ``out``; else each row is
        rounded once to ``out``'s dtype. Flagged chunks decode to NaN.

        Args:
            buffers: [R, encoded_nbytes(length)] uint8, each row's bytes contiguous.
            length: elements per row, int >= 0.
            out: [R, length] fp32/fp16/bf16 (rows may be strided, each row contiguous); with ``reduce``,
                a contiguous 1-D fp32 tensor of ``length`` elements. On ``buffers``' device.
            reduce: sum the rows instead of decoding each into its own row.

        Returns:
            The number of flagged (non-finite) chunks seen (over all rows).
        """
        length = check_positive_int("length", length, minimum=0)
        self._check_rows("buffers", buffers, (torch.uint8,), (None, self.encoded_nbytes(length)))
        if reduce:
            check_tensor("out", out, (torch.float32,), contiguous=True, device=buffers.device)
            if out.shape != (length,):
                raise ValueError(f"out must be 1-D with {length} elements when reduce=True; got {tuple(out.shape)}")
        else:
            self._check_rows("out", out, FLOAT_DTYPES, (buffers.shape[0], length), buffers.device)
        check_not_meta("buffers", buffers)
        if not reduce:
            check_rows_distinct("out", out)
        check_disjoint("out", out, "buffers", buffers)
        if buffers.shape[0] == 0:
            if check_bool("reduce", reduce):
                raise ValueError("buffers must hold at least one row to sum (reduce=True); got 0 rows")
            return 0
        return self._decode_rows(buffers, length, out, check_bool("reduce", reduce))

    @abc.abstractmethod
    def _encode_rows(self, x: torch.Tensor, out: torch.Tensor, key: int, offset: int, row_stride: int) -> int:
        """:meth:`encode_rows` on checked arguments (``key`` resolved; 0 for nearest rounding)."""

    @abc.abstractmethod
    def _decode_rows(self, buf: torch.Tensor, length: int, out: torch.Tensor, reduce: bool) -> int:
        """:meth:`decode_rows` on checked arguments."""

    @staticmethod
    def _check_rows(
        name: str,
        t: torch.Tensor,
        dtypes: tuple[torch.dtype, ...],
        shape: tuple[int | None, int] | None,
        device: torch.device | None = None,
    ) -> None:
        """``t`` is a 2-D tensor of ``dtypes``, of ``shape`` (None: any rows), whose rows are contiguous."""
        check_tensor(name, t, dtypes, device=device)
        rows, cols = shape if shape is not None else (None, None)
        if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
            want = "2-D" if shape is None else f"of shape [{'R' if rows is None else rows}, {cols}]"
            raise ValueError(f"{name} must be {want}; got shape {tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"each row of {name} must be contiguous; got strides {t.stride()}")


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
        kernels = _kernels() if native.can_run(x, out) else None
        if kernels is not None:
            rows, length = x.shape
            return kernels.encode(
                x.data_ptr(),
                _DTYPE_CODES[x.dtype],
                rows,
                length,
                x.stride(0),
                out.data_ptr(),
                out.stride(0),
                self.chunk_size,
                int(stochastic),
                key,
                offset,
                row_stride,
                native.num_threads(),
            )
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
        kernels = _kernels() if native.can_run(buf, out) else None
        if kernels is None:
            return self._decode_rows_torch(buf, length, out, reduce)
        n_bad = kernels.decode(
            buf.data_ptr(),
            buf.shape[0],
            length,
            buf.stride(0),
            out.data_ptr(),
            _DTYPE_CODES[out.dtype],
            out.stride(0),
            self.chunk_size,
            int(reduce),
            native.num_threads(),
        )
        torch.autograd.graph.increment_version(out)  # a raw-pointer write: tell autograd, as an in-place op would
        return n_bad

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
