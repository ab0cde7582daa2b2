"""What the chunked quantizers share (:class:`ChunkedCompressor`): options, sizes and the validated row API.

:class:`mixprec.compress.MinMaxUInt8` (``compress/quantize.py``) and :class:`mixprec.compress.ScaledFP8`
(``compress/fp8.py``) subclass it; the compressed collectives call only the row API defined here
(``encode_rows``/``decode_rows``), which checks every argument and the memory the kernels will read and write
(``check_disjoint``, ``check_rows_distinct``) before a subclass's ``_encode_rows``/``_decode_rows`` runs.
Every public name here is also importable from :mod:`mixprec.compress.quantize`, where it used to live.
"""

from __future__ import annotations

import abc
from typing import Literal

import torch

import mixprec.native as native
from mixprec.core import philox
from mixprec.core.dtypes import LOW_PRECISION_DTYPES, ROUNDINGS, Rounding
from mixprec.core.validate import check_bool, check_choice, check_positive_int, check_tensor
from mixprec.native import kernels

__all__ = [
    "CHECK_FINITE",
    "FLOAT_DTYPES",
    "CheckFinite",
    "ChunkedCompressor",
    "NonFiniteError",
    "check_disjoint",
    "check_not_meta",
    "check_rows_distinct",
]

CheckFinite = Literal["raise", "flag"]

# What the quantizers encode and decode to; fp32 first, as the error messages list it.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, *LOW_PRECISION_DTYPES)
CHECK_FINITE: tuple[str, ...] = ("raise", "flag")


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
        if device.type != "cpu" or native.route() != "kernel":  # (under torch.compile: the torch ops)
            return philox.byte_rows(key, offset, row_stride, rows, length, device)
        out = torch.empty(rows, length, dtype=torch.uint8)
        for r in range(rows):
            kernels.philox_bytes(key, offset + r * row_stride, out[r])
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
