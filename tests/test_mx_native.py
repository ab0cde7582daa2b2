"""The compiled block-scaled quantizer (``csrc/mx.c``) against the torch path of ``mixprec.core.mx``
(``mixprec.native.disabled()``, the oracle), bit for bit: every format, every scale mode, nearest and toward-zero
rounding, fp32/bf16/fp16 inputs, special blocks (NaN of any sign and payload, +-inf, zeros of both signs, fp32
subnormals, E8M0's bottom, values near fp32's maximum, element ties), odd shapes and block sizes, tensors that
cross the kernel's OpenMP slices on 1 and 2 threads, ``out=`` (in place too). Also: where the torch path runs
instead (explicit stream positions, other axes, 2-D tiles, no library), and that the loader knows the new symbol.
Stochastic rounding in the kernel: test_blockscaled_native.py."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec.native as native
from mixprec.core.mx import E8M0_MODES, MX_FORMATS, fake_quantize, mx_quantize, stream_positions
from mixprec.native import kernels
from test_mx import blocks_of_every_kind

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no compiled kernels: {native.describe()}")

CASES = [(f, m) for f, bf in MX_FORMATS.items() for m in (("e4m3",) if bf.scale == "e4m3" else E8M0_MODES)]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the compiled kernel's runs, so that a test comparing both paths knows the kernel ran (and a
    fallback test that it did not)."""
    seen: list[int] = []
    raw = kernels.mx_quantize

    def counted(*args: object) -> None:
        raw(*args)  # type: ignore[arg-type]
        seen.append(1)

    monkeypatch.setattr(kernels, "mx_quantize", counted)
    return seen


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def special_rows(fmt: str, block: int) -> torch.Tensor:
    """test_mx's blocks of every kind plus NaN blocks of each sign and payload (quiet and signalling), inf with
    NaN, inf of both signs alone, fp32's largest values, and every fp32 exponent at once."""
    x = blocks_of_every_kind(fmt, block=block)
    extra = torch.randn(10, block, generator=torch.Generator().manual_seed(1))
    pats = [0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001, 0xFFBFFFFF]
    for r, p in enumerate(pats):
        extra[r].view(torch.int32)[r % block] = torch.tensor(p, dtype=torch.int64).to(torch.int32)
    extra[5, 0], extra[5, 1] = math.inf, math.nan
    extra[6, 2], extra[6, 3] = math.inf, -math.inf
    extra[7] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, block)
    extra[8, 0] = -torch.finfo(torch.float32).max
    exps = torch.arange(block, dtype=torch.int32) * (255 // block) << 23
    extra[9] = (exps | 0x2AAAAA).view(torch.float32) * (1 - 2 * (torch.arange(block) % 2))
    return torch.cat([x, extra])


def boundary_rows(fmt: str, block: int) -> torch.Tensor:
    """One block per amax that sits on a branch of a scale rule: powers of two and their fp32 neighbours (floor,
    ceil, neuron), amax / max_element at 2**-127, between 2**-128 and 2**-127 and at 2**-126 (rceil's subnormal
    quotients), the ``even`` carry into the next binade (a tie of the element's precision) and below it; the rest
    of each block is smaller values of both signs."""
    bf = MX_FORMATS[fmt]
    top, man = bf.max_element, bf.element.man_bits
    up, down = torch.tensor(math.inf), torch.tensor(0.0)
    amaxes: list[float] = []
    for k in (-149, -140, -130, -127, -126, -120, -5, 0, 7, 100, 127):
        p2 = torch.tensor(2.0**k)
        amaxes += [p2.item(), torch.nextafter(p2, up).item(), torch.nextafter(p2, down).item()]
        tie = torch.tensor(2.0**k * (2 - 2.0 ** -(man + 1)))  # rounds up to 2**(k+1) at man fraction bits
        amaxes += [tie.item(), torch.nextafter(tie, down).item()]
    for q in (2.0**-127, 1.5 * 2.0**-128, 2.0**-126, 2.0**-128):
        a = torch.tensor(top * q)
        amaxes += [a.item(), torch.nextafter(a, up).item(), torch.nextafter(a, down).item()]
    amaxes = [a for a in amaxes if 0 < a < math.inf]
    g = torch.Generator().manual_seed(2)
    rows = torch.rand(len(amaxes), block, generator=g) * (
        torch.randint(0, 2, (len(amaxes), block), generator=g) * 2 - 1
    )
    a = torch.tensor(amaxes, dtype=torch.float32).unsqueeze(1)
    rows = rows * a * 0.99
    rows[:, 0] = a[:, 0] * (1 - 2 * (torch.arange(len(amaxes)) % 2))
    return rows


@pytest.mark.parametrize(("fmt", "mode"), CASES)
@pytest.mark.parametrize("block", [None, 8])
def test_scale_rule_boundaries(fmt: str, mode: str, block: int | None, calls: list[int]) -> None:
    """Both the grouped scale loops (blocks of 16 and 32) and the one-block loop (other sizes)."""
    x = boundary_rows(fmt, block or MX_FORMATS[fmt].block_size)
    for rounding in ("nearest", "toward_zero"):
        assert_same(x, fmt, scale_mode=mode, rounding=rounding, block_size=block)
        assert_same(x.bfloat16(), fmt, scale_mode=mode, rounding=rounding, block_size=block)
    assert calls == [1] * 8


def both_paths(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    got = fn(*args, **kwargs)
    with native.disabled():
        want = fn(*args, **kwargs)
    return got, want


def assert_bits(got: torch.Tensor, want: torch.Tensor, loose: torch.Tensor | None, what: str) -> None:
    """Equal bit patterns; where ``loose`` (NaN blocks of NVFP4, or of a non-contiguous input) only both NaN.
    The torch path's NaN pattern there is an artifact of torch's vectorization, not a rule: its vectorized
    clamp/maximum make NaN lanes all ones (0x7FFFFFFF after abs), its scalar tails keep the default NaN, and a
    strided copy can keep an input's payload. The kernel writes the default NaN 0x7FC00000 in every NaN block,
    which is what the torch path gives for contiguous E8M0 inputs (compared exactly)."""
    assert got.shape == want.shape, what
    same = bits(got) == bits(want)
    if loose is not None:
        same |= loose.expand_as(got) & got.isnan() & want.isnan()
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} differ"


def assert_same(x: torch.Tensor, fmt: str, **kw: object) -> None:
    block = kw.get("block_size") or MX_FORMATS[fmt].block_size
    nan_blocks = x.float().reshape(*x.shape[:-1], -1, block).isnan().any(-1)  # type: ignore[misc]
    loose_s = nan_blocks if fmt == "nvfp4" or not x.is_contiguous() else None
    loose_e = None if loose_s is None else loose_s.repeat_interleave(block, dim=-1)  # type: ignore[arg-type]
    got, want = both_paths(fake_quantize, x, fmt, **kw)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_bits(got, want, loose_e, f"fake_quantize {fmt} {kw}")
    q, r = both_paths(mx_quantize, x, fmt, **kw)
    assert_bits(q.elements, r.elements, loose_e, f"elements {fmt} {kw}")
    assert_bits(q.scales, r.scales, loose_s, f"scales {fmt} {kw}")
    assert (q.tensor_scale is None) == (r.tensor_scale is None)
    assert (q.block_size, q.axis, q.scale_mode) == (r.block_size, r.axis, r.scale_mode)


@pytest.mark.parametrize(("fmt", "mode"), CASES)
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_special_blocks_bit_for_bit(fmt: str, mode: str, rounding: str, calls: list[int]) -> None:
    block = MX_FORMATS[fmt].block_size
    x = special_rows(fmt, block)
    assert_same(x, fmt, scale_mode=mode, rounding=rounding)
    assert calls == [1, 1]  # the compiled path ran for fake_quantize and mx_quantize


@pytest.mark.parametrize("tensor_scale", [1e4 / (448 * 6), 2.0**-100, 1e-44, 3.0e38])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_nvfp4_tensor_scales(tensor_scale: float, rounding: str, calls: list[int]) -> None:
    """Two-level NVFP4, including a subnormal tensor scale whose reciprocal is inf (zeros give x86's NaN
    0xFFC00000 there, on both paths) and one near fp32's maximum."""
    x = special_rows("nvfp4", 16)
    assert_same(x, "nvfp4", tensor_scale=tensor_scale, rounding=rounding)
    assert_same(x, "nvfp4", tensor_scale=torch.tensor(tensor_scale), rounding=rounding)
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(MX_FORMATS))
def test_half_precision_inputs(dtype: torch.dtype, fmt: str, calls: list[int]) -> None:
    x = special_rows(fmt, MX_FORMATS[fmt].block_size).to(dtype)
    for mode in ("e4m3",) if fmt == "nvfp4" else ("floor", "rceil", "even"):
        assert_same(x, fmt, scale_mode=mode)
    assert calls and all(calls)


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [((1, 32), None), ((32,), None), ((3, 5, 64), None), ((1000, 32), None), ((7, 96), 48), ((4, 24), 8),
     ((2, 40), 5), ((3, 64), 64), ((9, 1), 1)],
)  # fmt: skip
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4"])
def test_odd_shapes_and_block_sizes(shape: tuple[int, ...], block_size: int | None, fmt: str, calls: list[int]) -> None:
    if block_size is None and shape[-1] % MX_FORMATS[fmt].block_size:
        pytest.skip("the format's block does not divide the last dim")
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 6)
    x.view(-1)[:: max(1, x.numel() // 7)] = torch.tensor([0.0, -0.0, 1e-40, 3e38, math.inf, math.nan]).repeat(8)[
        : len(range(0, x.numel(), max(1, x.numel() // 7)))
    ]
    modes = ("e4m3",) if fmt == "nvfp4" else E8M0_MODES  # sizes other than 16 and 32 take the one-block loop
    for mode in modes:
        for rounding in ("nearest", "toward_zero"):
            assert_same(x, fmt, block_size=block_size, scale_mode=mode, rounding=rounding)
    assert calls == [1, 1] * 2 * len(modes)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_large_tensors_across_threads(threads: int, fmt: str, calls: list[int]) -> None:
    """2**20 + 3 blocks' worth of rows: more than the kernel's grain, slices that end mid-row, on 1 and 2
    threads; a NaN and an inf block placed at the slice boundary of 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = MX_FORMATS[fmt].block_size
        n_blocks = (1 << 16) + 3
        g = torch.Generator().manual_seed(threads)
        x = torch.randn(n_blocks * block // 96 if block == 32 else n_blocks, 96 if block == 32 else block, generator=g)
        x = x * torch.exp(torch.randn(x.shape[0], 1, generator=g) * 8)
        flat = x.view(-1)
        mid = (n_blocks // 2) * block
        flat[mid - 1], flat[mid] = math.nan, math.inf
        assert_same(x, fmt)
        assert_same(x, fmt, rounding="toward_zero")
        assert calls == [1, 1, 1, 1]
    finally:
        torch.set_num_threads(before)


def test_non_contiguous_input_and_out(calls: list[int]) -> None:
    x = special_rows("mxfp8_e5m2", 32)
    xt = x.t().contiguous().t()  # the same values, column-major
    assert not xt.is_contiguous()
    assert_same(xt, "mxfp8_e5m2", scale_mode="even")
    want = fake_quantize(x, "mxfp8_e5m2")
    out = torch.full_like(x, 7.0)
    version = out._version
    assert fake_quantize(x, "mxfp8_e5m2", out=out) is out
    assert torch.equal(bits(out), bits(want)) and out._version > version
    inplace = x.clone()
    assert fake_quantize(inplace, "mxfp8_e5m2", out=inplace) is inplace
    assert torch.equal(bits(inplace), bits(want))
    half = x.to(torch.bfloat16)
    out2 = torch.empty_like(x)
    assert torch.equal(
        bits(fake_quantize(half, "mxfp8_e5m2", out=out2)), bits(fake_quantize(half.float(), "mxfp8_e5m2"))
    )
    with native.disabled():  # the torch path honours out= the same way
        out3 = torch.empty_like(x)
        assert fake_quantize(x, "mxfp8_e5m2", out=out3) is out3
    assert torch.equal(bits(out3), bits(want))
    assert all(calls)


def test_out_is_checked() -> None:
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="out"):
        fake_quantize(x, "mxfp8_e4m3", out=torch.empty(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        fake_quantize(x, "mxfp8_e4m3", out=torch.empty(2, 64))


def test_the_torch_path_runs_where_the_kernel_does_not(calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(0)
    positions = stream_positions(x.shape)
    fake_quantize(x, "mxfp4_e2m1", "stochastic", gen, positions=positions)  # explicit stream positions
    mx_quantize(x, "mxfp8_e4m3", axis=0)  # blocks along another axis
    mx_quantize(x, "nvfp4", block_size=(16, 16))  # 2-D tiles
    fake_quantize(torch.empty(0, 32), "mxfp8_e4m3")  # nothing to do
    with native.disabled():
        fake_quantize(x, "mxfp8_e4m3")
    assert calls == []
    want = fake_quantize(x, "mxfp8_e4m3")
    assert calls == [1]
    monkeypatch.setattr(native, "library", lambda: None)  # no library in this process
    got = fake_quantize(x, "mxfp8_e4m3")
    assert calls == [1] and torch.equal(bits(got), bits(want))


def test_a_process_without_the_library_takes_the_torch_path(tmp_path: Path) -> None:
    env = {**os.environ, "MIXPREC_NATIVE": "0", "MIXPREC_CACHE_DIR": str(tmp_path)}
    code = (
        "import torch, mixprec.native as n\n"
        "from mixprec.core.mx import fake_quantize\n"
        "x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))\n"
        "y = fake_quantize(x, 'mxfp8_e4m3', scale_mode='rceil')\n"
        "print(n.library() is None, y.view(torch.int32).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    here = fake_quantize(x, "mxfp8_e4m3", scale_mode="rceil").view(torch.int32).sum().item()
    assert done.stdout.split() == ["True", str(here)]


def test_the_loader_requires_the_mx_symbol() -> None:
    sources = sorted(Path(native.__file__).with_name("csrc").glob("*.c"))
    names = native._exported(sources)
    assert "mixprec_mx_quantize" in names
    lib = native.library()
    assert all(hasattr(lib, n) for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["avx512f", "avx"])
def test_builds_without_an_instruction_set_extension(flag: str, tmp_path: Path) -> None:
    """The kernel's loops built for AVX2 (-mno-avx512f) and plain C (-mno-avx) give the same bits: this file's
    tests, run in a child whose library is built with the extension off."""
    if shutil.which("gcc") is None or flag not in Path("/proc/cpuinfo").read_text():
        pytest.skip(f"no gcc, or this CPU has no {flag}: the default build already is the fallback")
    env = {k: v for k, v in os.environ.items() if k != "MIXPREC_NATIVE"}
    env.update(CC=f"gcc -mno-{flag}", MIXPREC_CACHE_DIR=str(tmp_path), OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-m", "not slow",
         "-k", "special_blocks or tensor_scales or half_precision or large_tensors"],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    assert list(tmp_path.glob("mixprec_native-*.so"))
