"""The compiled block-scaled wire (``csrc/mx_wire.c``) and the compiled stochastic rounding of ``csrc/mx.c``
against their torch paths (``mixprec.native.disabled()``, the oracles), bit for bit.

Wire: every wire format, nearest and stochastic rounding (stream offsets and row strides), fp32/bf16/fp16 rows,
strided rows, lengths that are not whole blocks or chunks, special blocks (zeros, -0, fp32 subnormals, E8M0's
bottom, element ties, values at the element maximum and near fp32's maximum, NaN and +-inf), decoding into
fp32/bf16/fp16 rows and summing rows, arbitrary byte buffers, error feedback folded into the encode, and 1 and 2
threads. mx_quantize / fake_quantize: stochastic rounding in the kernel equals the torch path for every format and
scale mode, and the key/positions API gives the same bits on both paths. The torch paths themselves are checked
against float64 references in test_compress_blockscaled.py and test_mx.py.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec.core.mx as mx_mod
import mixprec.native as native
from mixprec.compress import BlockScaledWire
from mixprec.compress.blockscaled import BLOCK_WIRES
from mixprec.core.mx import E8M0_MODES, MX_FORMATS, fake_quantize, mx_quantize, stream_positions
from mixprec.native import kernels
from test_mx import blocks_of_every_kind

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no compiled kernels: {native.describe()}")


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the compiled wire kernels' runs, so that a comparison knows the kernel ran."""
    seen: list[str] = []
    enc, dec = kernels.mx_wire_encode, kernels.mx_wire_decode

    def encode(*args: object) -> int:
        seen.append("encode")
        return enc(*args)  # type: ignore[arg-type]

    def decode(*args: object) -> int:
        seen.append("decode")
        return dec(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "mx_wire_encode", encode)
    monkeypatch.setattr(kernels, "mx_wire_decode", decode)
    return seen


def rows_of_every_kind(wire: str, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] fp32: random magnitudes per row, with test_mx's special blocks spliced in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 6)
    special = blocks_of_every_kind(wire, block=MX_FORMATS[wire].block_size, seed=seed).reshape(-1)
    flat = x.view(-1)
    k = min(flat.numel(), special.numel())
    start = int(torch.randint(0, flat.numel() - k + 1, (1,), generator=g))
    flat[start : start + k] = special[:k]
    return x


def encode_both(comp: BlockScaledWire, x: torch.Tensor, **kw: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    rows, length = x.shape
    a = torch.full((rows, comp.encoded_nbytes(length)), 0xAB, dtype=torch.uint8)
    b = a.clone()
    bad_a = comp.encode_rows(x, a, **kw)
    with native.disabled():
        bad_b = comp.encode_rows(x, b, **kw)
    return a, b, bad_a, bad_b


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where not NaN, NaN at the same places (a NaN's payload depends on torch's vectorization)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ia = a.masked_fill(nan_a, 0).contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.masked_fill(nan_b, 0).contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    return torch.equal(ia, ib)


@pytest.mark.parametrize("wire", BLOCK_WIRES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("length", [1, 15, 33, 2048, 5001])
def test_encode_and_decode_bit_for_bit(wire: str, rounding: str, length: int, ran: list[str]) -> None:
    comp = BlockScaledWire(wire, chunk_size=256, rounding=rounding, check_finite="flag")
    x = rows_of_every_kind(wire, 3, length, seed=length)
    a, b, bad_a, bad_b = encode_both(comp, x, key=0x1234_5678_9ABC_DEF0, offset=77, row_stride=length + 5)
    assert "encode" in ran and bad_a == bad_b and torch.equal(a, b)
    if length >= 2048:
        assert bad_a > 0  # the special blocks' NaN and inf were flagged
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got, want = torch.empty(3, length, dtype=dtype), torch.empty(3, length, dtype=dtype)
        n_got = comp.decode_rows(a, length, got)
        with native.disabled():
            n_want = comp.decode_rows(a, length, want)
        assert n_got == n_want == bad_a and same_bits(got, want), dtype
    got, want = torch.empty(length), torch.empty(length)
    assert comp.decode_rows(a, length, got, reduce=True) == bad_a
    with native.disabled():
        comp.decode_rows(a, length, want, reduce=True)
    assert "decode" in ran and same_bits(got, want)


@pytest.mark.parametrize("wire", BLOCK_WIRES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_strided_rows(wire: str, dtype: torch.dtype, ran: list[str]) -> None:
    comp = BlockScaledWire(wire, chunk_size=512, rounding="stochastic", check_finite="flag")
    base = rows_of_every_kind(wire, 4, 1200, seed=5).to(dtype)
    x = base[:, 100:1100]  # strided rows, each contiguous
    out = torch.zeros(4, comp.encoded_nbytes(1000) + 9, dtype=torch.uint8)
    a, b = out[:, 3 : 3 + comp.encoded_nbytes(1000)], out.clone()[:, 3 : 3 + comp.encoded_nbytes(1000)]
    bad_a = comp.encode_rows(x, a, key=99, offset=5)
    with native.disabled():
        bad_b = comp.encode_rows(x, b, key=99, offset=5)
    assert ran == ["encode"] and bad_a == bad_b and torch.equal(a, b)
    wide = torch.empty(4, 1300, dtype=dtype)
    got, want = wide[:, 200:1200], torch.empty(4, 1000, dtype=dtype)
    comp.decode_rows(a, 1000, got)
    with native.disabled():
        comp.decode_rows(a, 1000, want)
    assert same_bits(got, want)


@pytest.mark.parametrize("wire", BLOCK_WIRES)
def test_scale_modes_and_fp32_extremes(wire: str, ran: list[str]) -> None:
    modes = ("e4m3",) if wire == "nvfp4" else E8M0_MODES
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 640, generator=g)
    x[0] *= 3.4e38 / x[0].abs().max()  # decoded values next to fp32's max: the saturation step
    x[1] *= 1e-39  # subnormal rows
    x[2, :64] = 0.0
    x[2, 64:96] = -0.0
    x[3] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, 640)
    x[4, 1::2] = math.inf
    x[5] = x[5].sign() * 2.0 ** torch.randint(-140, 127, (640,), generator=g).float()
    for mode in modes:
        for rounding in ("nearest", "stochastic"):
            comp = BlockScaledWire(wire, scale_mode=mode, chunk_size=128, rounding=rounding, check_finite="flag")
            a, b, bad_a, bad_b = encode_both(comp, x, key=7)
            assert bad_a == bad_b and torch.equal(a, b), (mode, rounding)
            got = comp.decode(a[0], 640)
            assert torch.isfinite(got).all()  # the saturation step keeps every decoded value finite
    assert ran


def test_arbitrary_bytes_decode_as_the_torch_path(ran: list[str]) -> None:
    g = torch.Generator().manual_seed(11)
    for wire in BLOCK_WIRES:
        comp = BlockScaledWire(wire, chunk_size=64, check_finite="flag")
        buf = torch.randint(0, 256, (3, comp.encoded_nbytes(333)), generator=g, dtype=torch.uint8)
        if wire == "nvfp4":  # chunk scales: fp32 powers of two, as an encoder writes them
            k = torch.randint(-126, 127, (3, comp.num_chunks(333)), generator=g)
            buf[:, : 4 * k.shape[1]] = torch.ldexp(torch.ones(k.shape), k).float().view(torch.uint8).view(3, -1)
        for reduce in (False, True):
            got = torch.empty(333) if reduce else torch.empty(3, 333)
            want = torch.empty_like(got)
            n_got = comp.decode_rows(buf, 333, got, reduce=reduce)
            with native.disabled():
                n_want = comp.decode_rows(buf, 333, want, reduce=reduce)
            assert n_got == n_want and same_bits(got, want), (wire, reduce)
    assert "decode" in ran


@pytest.mark.parametrize("wire", BLOCK_WIRES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_folded_into_the_encode(wire: str, rounding: str, dtype: torch.dtype, ran: list[str]) -> None:
    """encode_feedback_rows equals the separate add, encode, decode and subtract that the pipelines do, bit for
    bit, in the kernel and on the torch path; a flagged block keeps its residual."""
    comp = BlockScaledWire(wire, chunk_size=256, rounding=rounding, check_finite="flag")
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 1000, generator=g) * 10).to(dtype)
    residual = torch.randn(2, 1000, generator=g) * 0.1
    # the separate steps, as compress/flat.py runs them
    staged = x.float() + residual
    want_codes = torch.empty(2, comp.encoded_nbytes(1000), dtype=torch.uint8)
    with native.disabled():
        comp.encode_rows(staged, want_codes, key=5, offset=3)
        decoded = torch.empty(2, 1000)
        comp.decode_rows(want_codes, 1000, decoded)
    want_res = staged - decoded
    for disabled in (False, True):
        res = residual.clone()
        codes = torch.empty_like(want_codes)
        if disabled:
            with native.disabled():
                bad = comp.encode_feedback_rows(x, res, codes, key=5, offset=3)
        else:
            bad = comp.encode_feedback_rows(x, res, codes, key=5, offset=3)
        assert bad == 0 and torch.equal(codes, want_codes) and same_bits(res, want_res), disabled
    assert "encode" in ran
    # a flagged block keeps its residual, the others are updated
    x[0, 40] = math.nan
    for disabled in (False, True):
        res = residual.clone()
        codes = torch.empty_like(want_codes)
        if disabled:
            with native.disabled():
                bad = comp.encode_feedback_rows(x, res, codes, key=5, offset=3)
        else:
            bad = comp.encode_feedback_rows(x, res, codes, key=5, offset=3)
        blk = slice(40 // comp.block * comp.block, (40 // comp.block + 1) * comp.block)
        assert bad == 1 and torch.equal(res[0, blk], residual[0, blk]), disabled
        keep = torch.ones(2, 1000, dtype=torch.bool)
        keep[0, blk] = False
        if comp.format.scale == "e8m0":  # NVFP4: the flagged block's chunk scale excludes it, others differ
            assert same_bits(res[keep], want_res[keep])
    with pytest.raises(ValueError, match="residual"):
        comp.encode_feedback_rows(x, torch.zeros(2, 999), codes)
    storage = torch.empty(2 * 1000 * 4, dtype=torch.uint8)
    nbytes = comp.encoded_nbytes(1000)
    with pytest.raises(ValueError, match="residual must not share memory with out"):
        comp.encode_feedback_rows(x, storage.view(torch.float32).view(2, 1000), storage[: 2 * nbytes].view(2, nbytes))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wire", ["mxfp8_e4m3", "nvfp4"])
def test_large_rows_across_threads(threads: int, wire: str) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        comp = BlockScaledWire(wire, rounding="stochastic", check_finite="flag")
        x = rows_of_every_kind(wire, 2, 70001, seed=threads)
        a, b, bad_a, bad_b = encode_both(comp, x, key=3)
        assert bad_a == bad_b and torch.equal(a, b)
        got, want = torch.empty(70001), torch.empty(70001)
        comp.decode_rows(a, 70001, got, reduce=True)
        with native.disabled():
            comp.decode_rows(a, 70001, want, reduce=True)
        assert same_bits(got, want)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------- mx_quantize's stochastic rounding
CASES = [(f, m) for f, bf in MX_FORMATS.items() for m in (("e4m3",) if bf.scale == "e4m3" else E8M0_MODES)]


@pytest.fixture
def quantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    raw = kernels.mx_quantize

    def counted(*args: object) -> None:
        raw(*args)  # type: ignore[arg-type]
        seen.append(1)

    monkeypatch.setattr(kernels, "mx_quantize", counted)
    return seen


@pytest.mark.parametrize(("fmt", "mode"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stochastic_mx_quantize_in_the_kernel(
    fmt: str, mode: str, dtype: torch.dtype, quantize_calls: list[int]
) -> None:
    block = MX_FORMATS[fmt].block_size
    x = blocks_of_every_kind(fmt, block=block).to(dtype)
    ts = 0.37 if fmt == "nvfp4" else None
    q = mx_quantize(x, fmt, scale_mode=mode, rounding="stochastic", key=2**63 + 5, tensor_scale=ts)
    d = fake_quantize(x, fmt, "stochastic", scale_mode=mode, key=2**63 + 5, tensor_scale=ts)
    assert quantize_calls == [1, 1]
    with native.disabled():
        q2 = mx_quantize(x, fmt, scale_mode=mode, rounding="stochastic", key=2**63 + 5, tensor_scale=ts)
        d2 = fake_quantize(x, fmt, "stochastic", scale_mode=mode, key=2**63 + 5, tensor_scale=ts)
    assert same_bits(q.elements, q2.elements) and same_bits(q.scales, q2.scales) and same_bits(d, d2)


@pytest.mark.parametrize("block_size", [3, 24, 40, 5000])
def test_stochastic_odd_blocks_generators_and_positions(block_size: int, quantize_calls: list[int]) -> None:
    """Odd block sizes (the kernel's scalar tail, blocks longer than its tile), the generator's draw (one key per
    call on both paths), and explicit positions (the torch path) that spell the default ones."""
    x = torch.randn(3, 15000, generator=torch.Generator().manual_seed(block_size))
    got = mx_quantize(
        x, "mxfp8_e5m2", block_size=block_size, rounding="stochastic", generator=torch.Generator().manual_seed(1)
    )
    with native.disabled():
        want = mx_quantize(
            x, "mxfp8_e5m2", block_size=block_size, rounding="stochastic", generator=torch.Generator().manual_seed(1)
        )
    key = mx_mod.draw_key(torch.Generator().manual_seed(1))
    spelled = mx_quantize(
        x, "mxfp8_e5m2", block_size=block_size, rounding="stochastic", key=key, positions=stream_positions(x.shape)
    )
    assert quantize_calls == [1]  # explicit positions: the torch path
    assert torch.equal(got.elements, want.elements) and torch.equal(got.elements, spelled.elements)


def test_key_and_positions_are_checked() -> None:
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="key and positions apply to rounding='stochastic' only"):
        mx_quantize(x, "mxfp8_e4m3", key=1)
    with pytest.raises(ValueError, match="key must be an int in"):
        mx_quantize(x, "mxfp8_e4m3", rounding="stochastic", key=2**64)
    with pytest.raises(TypeError, match="key must be an int"):
        mx_quantize(x, "mxfp8_e4m3", rounding="stochastic", key=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positions"):
        mx_quantize(x, "mxfp8_e4m3", rounding="stochastic", key=1, positions=torch.arange(3))
    with pytest.raises(TypeError, match="positions"):
        mx_quantize(x, "mxfp8_e4m3", rounding="stochastic", key=1, positions=torch.zeros(2, 32))
    pos = stream_positions((2, 3), offset=10, row_stride=7)
    assert pos.tolist() == [[10, 11, 12], [17, 18, 19]]


def test_the_loader_requires_the_wire_symbols() -> None:
    names = native._exported(sorted(Path(native.__file__).with_name("csrc").glob("*.c")))
    assert {"mixprec_mx_wire_encode", "mixprec_mx_wire_decode"} <= set(names)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["avx512f", "avx"])
def test_builds_without_an_instruction_set_extension(flag: str, tmp_path: Path) -> None:
    """The scalar stochastic loop and gcc's AVX2 / plain-C loops give the same bits: this file's tests in a child
    whose library is built with the extension off."""
    if shutil.which("gcc") is None or flag not in Path("/proc/cpuinfo").read_text():
        pytest.skip(f"no gcc, or this CPU has no {flag}: the default build already is the fallback")
    env = {k: v for k, v in os.environ.items() if k != "MIXPREC_NATIVE"}
    env.update(CC=f"gcc -mno-{flag}", MIXPREC_CACHE_DIR=str(tmp_path), OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-m", "not slow",
         "-k", "bit_for_bit or feedback or stochastic_mx_quantize"],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
