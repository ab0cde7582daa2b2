"""The block-scaled gradient wire (MXFP8, MXFP4, NVFP4: mixprec.compress.BlockScaledWire) and its reducers.

The oracle is a float64/numpy transcription of the formats written here from their specifications (OCP MX
v1.0 for the element grids and E8M0 scales; cuBLAS's and Transformer Engine's ``rceil`` rule; NVFP4's E4M3
block scale of ``amax / 6`` and the product with its reciprocal), not calling the codec or mixprec.core.mx.
Decode(encode(x)) must match it bit for bit, and so must the whole flat reduction at 2, 3 and 4 gloo ranks
(encoded parts, fp32 sums at the owner in rank order, re-encode, decode); with error feedback and stochastic
rounding, flat and hierarchical (2 x 2), the real runs must match the reducers' one-process models.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

import mixprec  # noqa: F401  (registers the reducers)
from mixprec.comm import make_reducer
from mixprec.comm.reducer import bucket_multiple
from mixprec.compress import BlockScaledWire, CompressionOptions, NonFiniteError
from mixprec.core.mx import mx_quantize, stream_positions
from mixprec.testing import run_distributed

# name -> (exponent bits, fraction bits, largest element, block size, scale type)
SPEC = {
    "mxfp8_e4m3": (4, 3, 448.0, 32, "e8m0"),
    "mxfp8_e5m2": (5, 2, 57344.0, 32, "e8m0"),
    "mxfp4_e2m1": (2, 1, 6.0, 32, "e8m0"),
    "nvfp4": (2, 1, 6.0, 16, "e4m3"),
}
WIRES = tuple(SPEC)


# ---------------------------------------------------------------------------- the float64 reference
def _round_grid(v: np.ndarray, ebits: int, mbits: int, top: float) -> np.ndarray:
    """Round float64 ``v`` to nearest (ties to even) on the grid of 1/ebits/mbits with subnormals, saturating at
    +-top (NaN stays NaN)."""
    v = np.clip(v, -top, top)
    emin = 2 - 2 ** (ebits - 1)
    mag = np.abs(v)
    _, e = np.frexp(np.where(mag > 0, mag, 1.0))
    spacing = np.ldexp(1.0, np.maximum(e - 1, emin) - mbits)
    return np.rint(v / spacing) * spacing  # exact division and product: powers of two; rint is ties-to-even


def _grid(ebits: int, mbits: int, top: float) -> np.ndarray:
    """Every non-negative value of the element grid, ascending."""
    emin = 2 - 2 ** (ebits - 1)
    sub = [j * 2.0 ** (emin - mbits) for j in range(2**mbits)]
    normal = [(1 + j / 2**mbits) * 2.0**e for e in range(emin, 20) for j in range(2**mbits)]
    return np.array([v for v in sub + normal if v <= top])


def _saturate(q: np.ndarray, scale: np.ndarray, spec: tuple) -> np.ndarray:
    """An element whose decoded value overflows fp32 (2**128) steps down to the grid value below it."""
    grid = _grid(*spec[:3])
    over = np.isinf(_f32(q * scale))
    lower = np.copysign(grid[np.maximum(np.searchsorted(grid, np.abs(q)) - 1, 0)], q)
    return np.where(over, lower, q)


def _f32(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is part of what is compared
        return np.asarray(a, dtype=np.float32)


def _ref_chunk(x: np.ndarray, wire: str, mode: str) -> np.ndarray:
    """Decode(encode(x)) of one chunk (fp32 values in, fp32 values out), round to nearest."""
    ebits, mbits, top, block, scale_type = SPEC[wire]
    n = x.size
    nb = -(-n // block)
    xp = np.zeros(nb * block, dtype=np.float32)
    xp[:n] = x
    blocks = xp.reshape(nb, block)
    bad = ~np.isfinite(blocks).all(axis=1)
    blocks = np.where(bad[:, None], np.float32(0), blocks)
    out = np.empty_like(blocks, dtype=np.float64)
    if scale_type == "e4m3":
        amax = float(np.abs(blocks).max()) if blocks.size else 0.0
        k = 0
        if amax > 0:  # a power of two 2**k with amax 2**k in (1344, 2688]
            k = math.floor(math.log2(2688.0 / amax))
            while amax * 2.0**k > 2688.0:
                k -= 1
            while amax * 2.0 ** (k + 1) <= 2688.0:
                k += 1
            k = max(-126, min(126, k))
        y = _f32(blocks.astype(np.float64) * 2.0**k)  # exact
        b = np.abs(y).max(axis=1)
        s = _round_grid(np.clip(_f32(b) / np.float32(6.0), 2.0**-6, 448.0).astype(np.float64), 4, 3, 448.0)
        rcp = _f32(1.0 / s)
        v = _f32(y * rcp[:, None])  # the fp32 product with the fp32 reciprocal (NVIDIA's kernels)
        q = _round_grid(v.astype(np.float64), ebits, mbits, top)
        q = _saturate(q, s[:, None] * 2.0**-k, SPEC[wire])
        out = _f32(_f32(q * s[:, None]) * np.float32(2.0**-k))
    else:
        amax = np.abs(blocks).max(axis=1).astype(np.float64)
        if mode == "rceil":  # ceil(log2(fp32(amax / max)))
            d = (_f32(amax) / np.float32(top)).astype(np.float64)
            # log2 of a power of two (mantissa 1/2) is exact; ceil of the rest is frexp's exponent
            m, ex = np.frexp(np.where(d > 0, d, 1.0))
            e = np.where(d > 0, np.where(m == 0.5, ex - 1, ex), -127)
        else:  # OCP v1.0 floor: floor(log2 amax) - emax_elem
            m, ex = np.frexp(np.where(amax > 0, amax, 1.0))
            e = np.where(amax > 0, ex - 1 - math.floor(math.log2(top)), -127)
        e = np.clip(e, -127, 127)
        scale = np.ldexp(1.0, e.astype(np.int64))
        mult = np.where((e == -127) & (mode == "rceil"), 1.0, 1.0 / scale)  # TE: the reciprocal of 2**-127 is 1
        v = _f32(blocks.astype(np.float64) * mult[:, None])  # the fp32 product (may round below 2**-126)
        q = _round_grid(v.astype(np.float64), ebits, mbits, top)
        q = _saturate(q, scale[:, None], SPEC[wire])
        out = _f32(q * scale[:, None])
    out = np.where(bad[:, None], np.nan, out)
    return _f32(out).reshape(-1)[:n]


def ref_roundtrip(x: np.ndarray, wire: str, chunk: int, mode: str | None = None) -> np.ndarray:
    mode = mode or ("e4m3" if wire == "nvfp4" else "rceil")
    x = _f32(x)
    return np.concatenate([_ref_chunk(x[a : a + chunk], wire, mode) for a in range(0, x.size, chunk)] or [x[:0]])


def _wire_roundtrip(comp: BlockScaledWire, x: torch.Tensor, key: int = 0) -> tuple[torch.Tensor, int]:
    codes = torch.empty(1, comp.encoded_nbytes(x.numel()), dtype=torch.uint8)
    bad = comp.encode_rows(x.view(1, -1), codes, key=key)
    out = torch.empty(1, x.numel())
    comp.decode_rows(codes, x.numel(), out)
    return out.view(-1), bad


def _samples(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    x[:40] *= 2.0**-100  # blocks deep in fp32's subnormal-making range of the scales
    x[64:96] = torch.tensor([448.0, 480.0, 464.0, 6.0, 5.0, 3.5, 2688.0, 2689.0] * 4)  # ties and saturation
    x[96:128] = 0.0
    x[200] = 3.0e38  # near fp32's max: the scales' top end
    x[232:240] = torch.tensor([3.4e38, -3.39e38, 3.2e38, 3.35e38, 1.0, 2.0e38, 3.0e38, 3.3e38])  # saturated
    return x


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and np.array_equal(np.isnan(a), np.isnan(b))
        and np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))
    )


# ---------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("mode", [None, "floor"])
def test_roundtrip_matches_the_float64_reference(wire: str, mode: str | None) -> None:
    if mode == "floor" and wire == "nvfp4":
        pytest.skip("NVFP4 has one scale rule")
    comp = BlockScaledWire(wire, scale_mode=mode, chunk_size=256, check_finite="flag")
    for n, seed in ((4096, 0), (1000, 1), (7, 2)):  # whole chunks; a partial block; less than a block
        x = _samples(max(n, 256), seed)[:n]
        got, bad = _wire_roundtrip(comp, x)
        assert bad == 0
        assert _same(got.numpy(), ref_roundtrip(x.numpy(), wire, 256, mode)), (wire, mode, n)


@pytest.mark.parametrize("wire", WIRES)
def test_bits_per_element(wire: str) -> None:
    comp = BlockScaledWire(wire, chunk_size=2048)
    want = {"mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp4_e2m1": 4.25, "nvfp4": 4.5 + 32 / 2048}[wire]
    assert comp.bits_per_element() == want
    assert comp.encoded_nbytes(4096) * 8 == want * 4096
    assert comp.header_nbytes(4096) + comp.code_nbytes(4096) == comp.encoded_nbytes(4096)


def test_wire_layout_bytes() -> None:
    """Scales inline before the codes: MXFP8 one E8M0 byte per block (bias 127), then e4m3 bytes; NVFP4 the
    chunk's fp32 scale (little-endian), one E4M3 byte per block, then codes two per byte, element 2i low."""
    x = torch.zeros(32)
    x[0], x[1] = 1.0, 0.5  # rceil: scale 2**ceil(log2(1/448)) = 2**-8, elements 256 and 128
    buf = BlockScaledWire("mxfp8_e4m3").encode(x)
    assert buf.numel() == 33 and buf[0] == 127 - 8 and buf[1] == 0x78 and buf[2] == 0x70 and not buf[3:].any()
    x = torch.zeros(16)
    x[0], x[1] = 0.75, -0.25  # chunk scale 2**-11 (1536 = 6 x 256): elements 6 and -2, block scale 256
    buf = BlockScaledWire("nvfp4", chunk_size=16).encode(x)
    assert buf.numel() == 4 + 1 + 8
    assert buf[:4].tolist() == [0, 0, 0, 0x3A] and buf[4] == 0x78  # fp32 2**-11; E4M3 256
    assert buf[5] == 0x7 | (0x8 | 0x4) << 4 and not buf[6:].any()  # 6 = code 7; -2 = sign | code 4


@pytest.mark.parametrize("wire", WIRES)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(wire: str) -> None:
    block = SPEC[wire][3]
    comp = BlockScaledWire(wire, chunk_size=block, rounding="stochastic", check_finite="flag")
    # one block: its largest element fixes the scale, the others sit between grid points
    x = torch.full((block,), 0.3)
    x[0] = 0.75  # scaled onto the grid by every format's scale rule (NVFP4: 6 x an E4M3 scale of 256)
    trials = torch.stack([_wire_roundtrip(comp, x, key=k)[0] for k in range(400)])
    lo = torch.tensor(ref_roundtrip(x.numpy(), wire, block))  # nearest: one of the two neighbours
    assert torch.equal(trials[:, 0], torch.full((400,), 0.75))  # on the grid: never moved
    vals = set(trials[:, 1].tolist())
    assert len(vals) == 2 and float(lo[1]) in vals  # the two neighbours of 0.3, both drawn
    mean = trials[:, 1:].double().mean()
    step = max(vals) - min(vals)
    # unbiased: the mean of 400 * (block - 1) Bernoulli draws, within 5 standard deviations
    assert abs(float(mean) - 0.3) <= 5 * step * 0.5 / math.sqrt(400 * (block - 1))


@pytest.mark.parametrize("wire", WIRES)
def test_stochastic_elements_are_mx_quantizes_on_the_wires_stream(wire: str) -> None:
    """The wire rounds stochastically through mx_quantize's key/positions API: element (r, j) at stream position
    offset + r * row_stride + j. Rows scaled so that NVFP4's chunk scale is 1 decode to mx_quantize's values."""
    comp = BlockScaledWire(wire, rounding="stochastic", check_finite="flag")
    x = _samples(4096, 3).view(-1, 2048)
    x = x / x.abs().amax(dim=1, keepdim=True) * 2000.0  # NVFP4: amax in (1344, 2688], chunk scale 2**0
    codes = torch.empty(2, comp.encoded_nbytes(2048), dtype=torch.uint8)
    comp.encode_rows(x, codes, key=77, offset=5, row_stride=3000)
    got = torch.empty(2, 2048)
    comp.decode_rows(codes, 2048, got)
    q = mx_quantize(x, comp.format, scale_mode=comp.scale_mode, rounding="stochastic", key=77,
                    positions=stream_positions(x.shape, 5, 3000))  # fmt: skip
    assert torch.equal(got, q.dequantize())
    nearest = mx_quantize(x, comp.format, scale_mode=comp.scale_mode).dequantize()
    assert not torch.equal(got, nearest)  # the draws moved some elements


@pytest.mark.parametrize("wire", WIRES)
def test_blocks_near_fp32s_max_decode_finite(wire: str) -> None:
    """An element rounded up next to fp32's max would decode to 2**128 = inf: it is lowered to the grid value
    below. MX keeps the round trip's bound u |x|; NVFP4 (its E4M3 scale rounded up too) errs by up to 1/3."""
    comp = BlockScaledWire(wire, chunk_size=comp_block(wire), check_finite="flag")
    u = 2.0 ** -(SPEC[wire][1] + 1)
    for a in (3.0e38, 3.35e38, 3.4e38, 3.4028e38):
        x = torch.zeros(comp.block)
        x[0], x[1] = a, -a * 0.999
        got, bad = _wire_roundtrip(comp, x)
        assert bad == 0 and torch.isfinite(got).all(), (wire, a)
        rel = float(((got[:2].double() - x[:2].double()).abs() / x[:2].double().abs()).max())
        assert rel <= (1 / 3 if wire == "nvfp4" else u), (wire, a, rel)


def comp_block(wire: str) -> int:
    return SPEC[wire][3]


@pytest.mark.parametrize("wire", WIRES)
def test_nonfinite_blocks_are_flagged_and_decode_to_nan(wire: str) -> None:
    comp = BlockScaledWire(wire, chunk_size=256, check_finite="flag")
    block = comp.block
    x = torch.randn(512)
    x[3] = float("nan")
    x[5 * block + 1] = float("inf")
    x[511] = float("-inf")
    got, bad = _wire_roundtrip(comp, x)
    assert bad == 3
    nan = torch.isnan(got)
    want = torch.zeros(512, dtype=torch.bool)
    for b in (0, 5, 511 // block):
        want[b * block : (b + 1) * block] = True
    assert torch.equal(nan, want)  # only the flagged blocks; the rest of the chunk decodes as usual
    assert _same(got.numpy(), ref_roundtrip(x.numpy(), wire, 256))
    assert comp.found_nonfinite(comp.encode(x), 512) if comp.check_finite == "flag" else True
    with pytest.raises(NonFiniteError, match="NaN or Inf in 3 of its"):
        BlockScaledWire(wire, chunk_size=256).encode(x)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="fmt"):
        BlockScaledWire("mxfp6_e2m3")
    with pytest.raises(ValueError, match="chunk_size must be a multiple of nvfp4's block size 16"):
        BlockScaledWire("nvfp4", chunk_size=100)
    with pytest.raises(ValueError, match="scale_mode"):
        BlockScaledWire("nvfp4", scale_mode="floor")
    with pytest.raises(ValueError, match="chunk_size must be a multiple of mxfp8_e4m3's block size 32"):
        CompressionOptions(wire="mxfp8_e4m3", chunk_size=48)
    with pytest.raises(ValueError, match="wire must be one of"):
        make_reducer("mxfp8", wire="nvfp4")


# ---------------------------------------------------------------------------- the reduction on gloo
CALLS = ((0, 0), (0, 1), (1, 0), (2, 0))  # (step, key); step 1 holds a NaN on rank 0; step 2 sums
NUMEL_MIN = 5000


def _numel(world: int) -> int:
    multiple = bucket_multiple(world)
    return multiple * -(-NUMEL_MIN // multiple)


def _bucket(rank: int, step: int, key: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * key + rank)
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-8, 8, (numel,), generator=g).float())
    if step == 1 and rank == 0:
        x[5] = float("nan")
    return x


CASES = (
    ("mxfp8", {}),
    ("nvfp4", {}),
    ("mxfp8", {"error_feedback": True, "rounding": "stochastic", "seed": 5, "wire": "mxfp8_e5m2"}),
    ("nvfp4", {"error_feedback": True, "rounding": "stochastic", "seed": 9}),
    ("mxfp8_hierarchical", {"error_feedback": True, "rounding": "stochastic", "seed": 13}),
    ("nvfp4_hierarchical", {"error_feedback": True, "rounding": "stochastic", "seed": 17}),
)


def _real(rank: int, world: int, local: int) -> list[list[torch.Tensor]]:
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    numel = _numel(world)
    out = []
    for name, opts in CASES:
        if name.endswith("_hierarchical") and local == world:
            out.append([])
            continue
        reducer = make_reducer(name, **opts)
        results = []
        for step, key in CALLS:
            bucket = _bucket(rank, step, key, numel)
            reducer.all_reduce(bucket, None, average=step != 2, key=key).wait()
            results.append(bucket)
        out.append(results)
    return out


def _ref_flat(rows: np.ndarray, wire: str, chunk: int, average: bool) -> np.ndarray:
    """The flat pipeline on the reference codec: owner p sums the decoded parts p in rank order in fp32."""
    world, numel = rows.shape
    part = numel // world
    out = np.empty(numel, dtype=np.float32)
    for p in range(world):
        sl = slice(p * part, (p + 1) * part)
        acc = ref_roundtrip(rows[0, sl], wire, chunk)
        for r in range(1, world):
            acc = _f32(acc + ref_roundtrip(rows[r, sl], wire, chunk))
        if average:
            acc = _f32(acc / np.float32(world))
        out[sl] = ref_roundtrip(acc, wire, chunk)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world", "local"), [(2, 2), (3, 3), (4, 4), (4, 2)])
def test_reduction_on_gloo_matches_the_references(monkeypatch, world: int, local: int) -> None:
    per_rank = run_distributed(_real, world, local, timeout=300)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    numel = _numel(world)
    for c, (name, opts) in enumerate(CASES):
        if not per_rank[0][c]:
            continue
        reducer = make_reducer(name, **opts)
        for i, (step, key) in enumerate(CALLS):
            rows = torch.stack([_bucket(r, step, key, numel) for r in range(world)])
            model = reducer.model(rows, average=step != 2, key=key)
            for r in range(world):
                assert _same(per_rank[r][c][i].numpy(), model[r].numpy()), (name, opts, step, key, r)
            if step == 1 and key == 0:
                assert torch.isnan(model[0, 5])  # NaN in one rank's bucket: NaN in the result
            if not opts:  # nearest, flat: the independent reference
                wire = "nvfp4" if name == "nvfp4" else "mxfp8_e4m3"
                ref = _ref_flat(rows.numpy(), wire, 2048, step != 2)
                assert _same(per_rank[0][c][i].numpy(), ref), (name, step, key)
        # error feedback resets after the NaN step, as the other wires' do: the residuals are zero or finite
        for residual in reducer.model_state.tensors.get(0, {}).values():
            assert torch.isfinite(residual).all()


def _scatter(rank: int, world: int) -> list[torch.Tensor]:
    """ZeRO-1's path: each rank's fp32 shard of the averaged bucket (the owner's fp32 sum, no re-encode)."""
    torch.set_num_threads(1)
    numel = _numel(world)
    out = []
    for name in ("mxfp8", "nvfp4"):
        shard = torch.empty(numel // world)
        make_reducer(name).reduce_scatter(shard, _bucket(rank, 0, 0, numel), None, average=True, key=0).wait()
        out.append(shard)
    return out


def test_reduce_scatter_gives_each_owner_its_fp32_sum() -> None:
    world = 3
    per_rank = run_distributed(_scatter, world, timeout=300)
    numel = _numel(world)
    part = numel // world
    rows = torch.stack([_bucket(r, 0, 0, numel) for r in range(world)]).numpy()
    for i, wire in enumerate(("mxfp8_e4m3", "nvfp4")):
        for p in range(world):
            sl = slice(p * part, (p + 1) * part)
            acc = ref_roundtrip(rows[0, sl], wire, 2048)
            for r in range(1, world):
                acc = _f32(acc + ref_roundtrip(rows[r, sl], wire, 2048))
            assert _same(per_rank[p][i].numpy(), _f32(acc / np.float32(world))), (wire, p)


def _hooked(rank: int, world: int) -> dict:
    """Three SGD steps under torch DDP with mixprec's compress hook on the block-scaled wires, and under mixprec's
    wrapper with the matching reducer: every step's gradients of both."""
    from mixprec.hooks import CompressedHookState, compressed_hook
    from mixprec.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    out: dict = {}
    for name, opts in (("mxfp8", {"wire": "mxfp8_e4m3"}), ("nvfp4", {"wire": "nvfp4", "error_feedback": True})):
        opts = {"chunk_size": 64, **opts}
        grads: dict[str, list] = {"torch": [], "mixprec": [], "plain": []}
        for consumer in grads:
            torch.manual_seed(0)
            # one parameter of 768 elements, a multiple of lcm(P, 128): one bucket, the same layout in both
            net = torch.nn.Sequential(torch.nn.Linear(6, 128, bias=False), torch.nn.Tanh())
            if consumer == "plain":  # torch DDP without a hook: the uncompressed gradients
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
            elif consumer == "torch":
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
                wrapped.register_comm_hook(CompressedHookState(**opts), compressed_hook)
            else:
                wrapped = DistributedDataParallel(net, reduce=name, reduce_options=opts)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 128, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(wrapped(x), y).backward()
                grads[consumer].append([p.grad.clone() for p in net.parameters()])
                opt.step()
        out[name] = grads
    return out


def test_torch_ddp_hook_gives_the_wrappers_bits() -> None:
    results = run_distributed(_hooked, 2, timeout=300)
    for name, grads in results[0].items():
        for step, (hooked, wrapped) in enumerate(zip(grads["torch"], grads["mixprec"], strict=True)):
            for a, b in zip(hooked, wrapped, strict=True):
                assert torch.equal(a, b), (name, step)
        # not vacuous: the wire changed the gradients
        assert not torch.equal(grads["torch"][0][0], grads["plain"][0][0]), name


# ---------------------------------------------------------------------------- convergence
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

BLOCK_VARIANTS = {
    "fp32": ("native", {}),
    "mxfp8 e4m3": ("mxfp8", {}),
    "mxfp8 e4m3 stochastic + EF": ("mxfp8", {"rounding": "stochastic", "error_feedback": True}),
    "nvfp4": ("nvfp4", {}),
    "nvfp4 stochastic + EF": ("nvfp4", {"rounding": "stochastic", "error_feedback": True}),
}


@pytest.mark.slow
def test_block_scaled_training_stays_within_the_uint8_margin_of_fp32(dist_run) -> None:
    pytest.importorskip("sklearn.datasets")
    import bench_compress_convergence as conv

    steps = 40  # the run and the margin of the uint8 test (tests/test_compress_convergence.py)
    data = conv.prepare_parent()
    runs = {
        name: dist_run(conv.train_digits, 2, reduce, options, data, steps=steps, timeout=300)[0]
        for name, (reduce, options) in BLOCK_VARIANTS.items()
    }
    base = runs["fp32"]
    for name, res in runs.items():
        assert abs(res["test_acc"] - base["test_acc"]) <= conv.ACC_MARGIN, name
        assert conv.final_loss(res["losses"]) <= conv.final_loss(base["losses"]) * (1 + conv.LOSS_MARGIN), name
        if name != "fp32":
            assert res["bytes_sent"] > 0
            assert sum(a != b for a, b in zip(res["losses"][1:], base["losses"][1:])) >= steps // 2, name
