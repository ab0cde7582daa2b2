"""Independent single-process reference of mixprec.compress, for the tests (numpy, one chunk at a time).

Written from the documented format and algorithm, not from the library code: numpy float32 arithmetic
(IEEE, one correct rounding per operation), ``np.rint`` (round half to even) for nearest rounding, plain
Python loops over chunks and ranks. The collectives are simulated on the list of every rank's input.
Stochastic rounding's random bits come from :func:`mixprec.core.philox.philox4x32_10` (checked against
Random123's known answers in tests/test_philox.py), one block per element by the documented stream layout
(:func:`call_randoms`), and decide by the documented rule, element by element (:func:`ref_round_up`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from mixprec.core import philox

FP32_MAX = float(np.finfo(np.float32).max)
WIDE_BELOW = 255.0 * float(np.finfo(np.float32).tiny)
U32 = 2.0**-24


def element_randoms(key: int, positions: np.ndarray) -> np.ndarray:
    """[n, 2] int64: each stream position's primary byte and secondary word, straight from the layout: byte
    ``(e >> 6) & 3`` of word ``(e >> 4) & 3`` of counter ``((e >> 8) << 4) | (e & 15)`` (words lo, hi, 0, 0);
    word 0 of counter ``(e lo, e hi, 1, 0)``."""
    e = torch.from_numpy(np.asarray(positions, dtype=np.int64))
    c = ((e >> 8) << 4) | (e & 15)
    zero = torch.zeros_like(e)
    block = philox.philox4x32_10(torch.stack([c & 0xFFFFFFFF, c >> 32, zero, zero], dim=-1), key)
    word = block.gather(1, ((e >> 4) & 3)[:, None])[:, 0]
    primary = (word >> (8 * ((e >> 6) & 3))) & 0xFF
    secondary = philox.philox4x32_10(torch.stack([e & 0xFFFFFFFF, e >> 32, zero + 1, zero], dim=-1), key)[:, 0]
    return torch.stack([primary, secondary], dim=-1).numpy()


def call_randoms(generator: torch.Generator, *sizes: int) -> list[np.ndarray]:
    """The random bits of one stochastic call: one 64-bit key drawn from ``generator`` (two 32-bit randint
    draws, low word first), and each encode's elements at the next stream positions, back to back (an encode:
    just its elements from 0; a collective: the worker encode of its N elements, then the server re-encode of
    the owned part at positions N, N + 1, ...). Each encode: [size, 2] as :func:`element_randoms`."""
    lo, hi = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=generator).tolist()
    key, pos, out = lo | (hi << 32), 0, []
    for size in sizes:
        out.append(element_randoms(key, np.arange(pos, pos + size)))
        pos += size
    return out


def ref_round_up(randoms: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Whether each element rounds up, from its exact fraction ``frac`` in [0, 1) and its ``randoms`` [n, 2]:
    with ``f8 = floor(256 frac)``, up when the primary byte is below f8; when equal, up when the secondary
    word is below ``(256 frac - f8) * 2**32``. Every value here is exact in float64."""
    up = np.zeros(frac.shape, dtype=bool)
    for i, (f, (byte, word)) in enumerate(zip(np.asarray(frac, dtype=np.float64), randoms)):
        f8 = math.floor(f * 256)
        up[i] = byte < f8 or (byte == f8 and word < (f * 256 - f8) * 2.0**32)
    return up


def as_f32(t: torch.Tensor) -> np.ndarray:
    """Exact fp32 values of a fp32/fp16/bf16 tensor, flattened."""
    return t.detach().reshape(-1).float().numpy().astype(np.float32)


def ref_grid(mn: np.float32, mx: np.float32) -> tuple[bool, bool, float, np.float32, int]:
    """The documented per-chunk grid: (aligned, wide, range R, fp32 step, zero point).

    R = max - min in float64. A chunk with min < 0 <= max that is not on the float64 path is aligned to
    0: step = fl32(R / 254), zero = the smallest integer with zero * step >= -min, found here in exact
    rational arithmetic. Otherwise step = fl32(R / 255) and the zero point is unused (0).
    """
    rng = float(mx) - float(mn)
    wide = rng > FP32_MAX or 0 < rng < WIDE_BELOW
    if float(mn) < 0 <= float(mx) and not wide:
        step = np.float32(rng / 254.0)
        return True, False, rng, step, math.ceil(Fraction(-float(mn)) / Fraction(float(step)))
    return False, wide, rng, np.float32(rng / 255.0), 0


def ref_encode(x: np.ndarray, chunk: int, rounding: str = "nearest", randoms: np.ndarray | None = None) -> bytes:
    """Header (all mins, then all maxs, fp32 little-endian) + one uint8 code per element."""
    n = x.size
    bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    mins, maxs, codes = [], [], np.zeros(n, dtype=np.uint8)
    for a, b in bounds:
        xc = x[a:b]
        if not np.isfinite(xc).all():
            mins.append(np.float32(np.nan))
            maxs.append(np.float32(np.nan))
            continue  # codes stay 0
        mn, mx = np.float32(xc.min()), np.float32(xc.max())
        mins.append(mn)
        maxs.append(mx)
        aligned, wide, rng, step, zero = ref_grid(mn, mx)
        if aligned:  # q = fl32(fl32(x * fl32(1 / step)) + zero)
            scale = np.float32(1.0 / float(step))
            q = ((xc * scale).astype(np.float32) + np.float32(zero)).astype(np.float32)
        elif wide:
            q = (xc.astype(np.float64) - float(mn)) * (255.0 / rng)
        else:  # q = fl32(fl32(x - min) * fl32(255 / R))
            scale = np.float32(255.0 / rng if rng > 0 else 0.0)
            d = (xc - mn).astype(np.float32)
            q = (d * scale).astype(np.float32)
        if rounding == "nearest":
            c = np.rint(q)
        else:
            assert randoms is not None
            fl = np.floor(q)
            c = fl + ref_round_up(randoms[a:b], q - fl)
        codes[a:b] = np.clip(c, 0, 255).astype(np.uint8)
    header = np.array(mins + maxs, dtype="<f4").tobytes()
    return header + codes.tobytes()


def ref_decode(buf: bytes, n: int, chunk: int) -> np.ndarray:
    """fp32 values of an encoded buffer."""
    nchunks = -(-n // chunk)
    hdr = np.frombuffer(buf[: 8 * nchunks], dtype="<f4")
    mins, maxs = hdr[:nchunks], hdr[nchunks:]
    codes = np.frombuffer(buf[8 * nchunks :], dtype=np.uint8)
    out = np.empty(n, dtype=np.float32)
    for i in range(nchunks):
        a, b = i * chunk, min(n, (i + 1) * chunk)
        if np.isnan(mins[i]):
            out[a:b] = np.nan
            continue
        aligned, wide, rng, step, zero = ref_grid(mins[i], maxs[i])
        if aligned:  # one rounding: (code - zero) is an exact small integer
            out[a:b] = ((codes[a:b].astype(np.float32) - np.float32(zero)) * step).astype(np.float32)
        elif wide:
            out[a:b] = (float(mins[i]) + codes[a:b].astype(np.float64) * (rng / 255.0)).astype(np.float32)
        else:
            out[a:b] = ((codes[a:b].astype(np.float32) * step).astype(np.float32) + mins[i]).astype(np.float32)
    return out


def quantizer_bound(
    rng: np.ndarray | float, big: np.ndarray | float, k: float = 0.5, levels: int = 254
) -> np.ndarray | float:
    """quantize.py's per-element error bound for a chunk of range ``rng`` and largest magnitude ``big``:
    ``k`` steps (1/2 nearest, 1 stochastic) of ``step = rng / levels`` plus the fp32 terms on the grid's span
    ``255 step`` and half the smallest subnormal. ``levels``: 254 for a chunk aligned to 0 (and a bound for
    any chunk), 255 for the others."""
    step = np.asarray(rng) / levels * (1 + U32)  # the fp32 step, rounded up at most one ulp
    return k * step + 6.1 * U32 * 255 * step + 1.1 * U32 * big + 2.0**-150


def roundtrip_bound(x: np.ndarray, chunk: int, rounding: str, out_dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Per-element error bound of the module docstring, from each chunk's exact min and max (float64)."""
    k = 0.5 if rounding == "nearest" else 1.0
    bound = np.empty(x.size, dtype=np.float64)
    u_out, tiny_out = {
        torch.float32: (0.0, 0.0),
        torch.bfloat16: (2.0**-8, 2.0**-133),
        torch.float16: (2.0**-11, 2.0**-24),
    }[out_dtype]
    for a in range(0, x.size, chunk):
        xc = x[a : a + chunk].astype(np.float64)
        mn, mx = xc.min(), xc.max()
        rng, big = mx - mn, max(abs(mn), abs(mx))
        aligned = ref_grid(np.float32(mn), np.float32(mx))[0]
        levels = 254 if aligned else 255
        step = rng / levels
        bound[a : a + chunk] = quantizer_bound(rng, big, k, levels) + u_out * (big + step) + tiny_out / 2
    return bound


# fp8 with a power-of-two scale per chunk. Format constants from the OCP fp8 spec (e4m3fn: no inf, max 448).
FP8 = {
    "e4m3": {"dtype": torch.float8_e4m3fn, "max": 448.0, "emin": -6, "man": 3},
    "e5m2": {"dtype": torch.float8_e5m2, "max": 57344.0, "emin": -14, "man": 2},
}


def ref_fp8_exponent(amax: float, fmt: str) -> int:
    """The largest k with amax * 2**k <= the format's max (exact rationals), clamped to [-126, 126]; 0 for 0."""
    if amax == 0:
        return 0
    top, a = Fraction(FP8[fmt]["max"]), Fraction(amax)
    k = math.floor(math.log2(float(top / a)))
    while a * Fraction(2) ** k > top:
        k -= 1
    while a * Fraction(2) ** (k + 1) <= top:
        k += 1
    return max(-126, min(126, k))


def ref_fp8_round(y: np.ndarray, fmt: str, rounding: str, randoms: np.ndarray | None) -> np.ndarray:
    """fp8 values (float64) of ``y`` (float64, |y| <= max): torch's cast for nearest; for stochastic, the
    neighbour away from zero with probability equal to the fraction of the spacing, from the float64 grid."""
    if rounding == "nearest":
        return torch.from_numpy(y.astype(np.float32)).to(FP8[fmt]["dtype"]).double().numpy()
    assert randoms is not None
    mag = np.abs(y)
    _, e = np.frexp(mag)
    spacing = np.ldexp(1.0, np.maximum(e - 1, FP8[fmt]["emin"]) - FP8[fmt]["man"])
    low = np.floor(mag / spacing) * spacing
    up = ref_round_up(randoms, (mag - low) / spacing)
    return np.copysign(low + up * spacing, y)


def ref_fp8_encode(
    x: np.ndarray, chunk: int, fmt: str, rounding: str = "nearest", randoms: np.ndarray | None = None
) -> bytes:
    """fp32 scales 2**-k of every chunk (little-endian; NaN for a chunk with NaN/Inf), then one fp8 byte each."""
    n = x.size
    scales, codes = [], np.zeros(n, dtype=np.uint8)
    for a in range(0, n, chunk):
        xc = x[a : a + chunk].astype(np.float64)
        if not np.isfinite(xc).all():
            scales.append(np.nan)
            continue
        k = ref_fp8_exponent(float(np.abs(xc).max()), fmt)
        scales.append(2.0**-k)
        y = ref_fp8_round(xc * 2.0**k, fmt, rounding, None if randoms is None else randoms[a : a + chunk])
        # Within one spacing of fp32's max, y may round up to 2**(128 + k), which would decode to inf: such a
        # value steps down to the grid's next value below (half the spacing above a power of two).
        over = np.abs(y) * 2.0**-k > np.finfo(np.float32).max
        y[over] -= np.copysign(np.ldexp(np.abs(y[over]), -1 - FP8[fmt]["man"]), y[over])
        codes[a : a + chunk] = torch.from_numpy(y.astype(np.float32)).to(FP8[fmt]["dtype"]).view(torch.uint8).numpy()
    return np.array(scales, dtype="<f4").tobytes() + codes.tobytes()


def ref_fp8_decode(buf: bytes, n: int, chunk: int, fmt: str) -> np.ndarray:
    nchunks = -(-n // chunk)
    scales = np.frombuffer(buf[: 4 * nchunks], dtype="<f4").astype(np.float64)
    codes = torch.frombuffer(bytearray(buf[4 * nchunks :]), dtype=torch.uint8).view(FP8[fmt]["dtype"])
    values = codes.double().numpy() if n else np.zeros(0)
    return (values * np.repeat(scales, chunk)[:n]).astype(np.float32)


def ref_fp8_bound(x: np.ndarray, chunk: int, fmt: str, rounding: str) -> np.ndarray:
    """Per-element bound of one fp8 round trip: u_f |x| (nearest; 2 u_f |x| stochastic), at least half
    (stochastic: one) subnormal spacing times the chunk's scale; decoding is exact."""
    k_mult = 1.0 if rounding == "nearest" else 2.0
    u = 2.0 ** -(FP8[fmt]["man"] + 1)
    sub = 2.0 ** (FP8[fmt]["emin"] - FP8[fmt]["man"])
    bound = np.empty(x.size)
    for a in range(0, x.size, chunk):
        xc = np.abs(x[a : a + chunk].astype(np.float64))
        scale = 2.0 ** -ref_fp8_exponent(float(xc.max()), fmt)
        bound[a : a + chunk] = k_mult * np.maximum(u * xc, sub / 2 * scale)
    return bound


def codec(wire: str) -> tuple:
    """(encode(x, chunk, rounding, randoms), decode(buf, n, chunk), header bytes per chunk) of a wire."""
    if wire == "uint8":
        return ref_encode, ref_decode, 8
    return (
        lambda x, chunk, rounding="nearest", randoms=None: ref_fp8_encode(x, chunk, wire, rounding, randoms),
        lambda buf, n, chunk: ref_fp8_decode(buf, n, chunk, wire),
        4,
    )


def ref_flat_reduce(
    inputs: list[np.ndarray],
    chunk: int,
    *,
    divisor: int | None,
    rounding: str = "nearest",
    randoms: list[np.ndarray] | None = None,
    residuals: dict | None = None,
    wire: str = "uint8",
) -> list[np.ndarray]:
    """First half of ByteGrad's scheme on W simulated ranks: the fp32 reduced part p owned by rank p.

    Rank r quantizes each of the W parts of its input (part p goes to rank p); rank p decodes the W
    messages of part p and adds them in fp32 in rank order 0..W-1, then divides by ``divisor``.
    ``randoms[r]``: rank r's draws for this encode (all parts, element order). ``residuals`` (error
    feedback, updated in place): {"worker": [W arrays], "server": [W arrays]}.
    """
    ref_encode, ref_decode, _ = codec(wire)
    world = len(inputs)
    part = inputs[0].size // world
    send = []
    for r in range(world):
        v = inputs[r].astype(np.float32)
        if residuals is not None:
            v = (v + residuals["worker"][r]).astype(np.float32)
        u = randoms[r] if randoms is not None else None
        msgs = []
        for p in range(world):
            lo, hi = p * part, (p + 1) * part
            msgs.append(ref_encode(v[lo:hi], chunk, rounding, None if u is None else u[lo:hi]))
        if residuals is not None:
            decoded = np.concatenate([ref_decode(m, part, chunk) for m in msgs])
            residuals["worker"][r] = (v - decoded).astype(np.float32)
        send.append(msgs)
    reduced = []
    for p in range(world):
        acc = ref_decode(send[0][p], part, chunk)
        for r in range(1, world):
            acc = (acc + ref_decode(send[r][p], part, chunk)).astype(np.float32)
        if divisor is not None:
            acc = (acc / np.float32(divisor)).astype(np.float32)
        reduced.append(acc)
    return reduced


def ref_flat_all_reduce(
    inputs: list[np.ndarray],
    chunk: int,
    *,
    average: bool = True,
    divisor: int | None = None,
    rounding: str = "nearest",
    randoms: list[list[np.ndarray]] | None = None,
    residuals: dict | None = None,
    wire: str = "uint8",
) -> tuple[list[np.ndarray], bool]:
    """ByteGrad's scheme on W simulated ranks; returns every rank's output (fp32) and the non-finite flag.

    :func:`ref_flat_reduce`, then rank p quantizes its reduced part (after adding its server residual),
    and every rank decodes every rank's result. ``divisor`` defaults to W when ``average``.
    ``randoms[r]`` = [draws of rank r's first encode, draws of its second encode].
    """
    ref_encode, ref_decode, header = codec(wire)
    world = len(inputs)
    part = inputs[0].size // world
    if divisor is None and average:
        divisor = world
    reduced = ref_flat_reduce(
        inputs,
        chunk,
        divisor=divisor,
        rounding=rounding,
        randoms=None if randoms is None else [u[0] for u in randoms],
        residuals=residuals,
        wire=wire,
    )
    results = []
    for p in range(world):
        acc = reduced[p]
        if residuals is not None:
            acc = (acc + residuals["server"][p]).astype(np.float32)
        u = randoms[p][1] if randoms is not None else None
        msg = ref_encode(acc, chunk, rounding, u)
        if residuals is not None:
            residuals["server"][p] = (acc - ref_decode(msg, part, chunk)).astype(np.float32)
        results.append(msg)
    out = np.concatenate([ref_decode(m, part, chunk) for m in results])
    nonfinite = any(np.isnan(np.frombuffer(m[: header * -(-part // chunk)], dtype="<f4")).any() for m in results)
    return [out.copy() for _ in range(world)], nonfinite


def _node_slices(inputs: list[np.ndarray], nodes: int, per_node: int, layout: np.ndarray) -> dict:
    """Intra-node fp32 reduce-scatter: slice l of the node's (re-laid-out) input, summed in local-rank order."""
    slices = {}
    for node in range(nodes):
        for local in range(per_node):
            acc = layout(inputs[node * per_node])[local].astype(np.float32)
            for peer in range(1, per_node):
                acc = (acc + layout(inputs[node * per_node + peer])[local]).astype(np.float32)
            slices[node, local] = acc
    return slices


def ref_hierarchical_all_reduce(
    inputs: list[np.ndarray],
    chunk: int,
    nodes: int,
    per_node: int,
    *,
    average: bool = True,
    rounding: str = "nearest",
    randoms: list[list[np.ndarray]] | None = None,
    residuals: dict | None = None,
    wire: str = "uint8",
) -> list[np.ndarray]:
    """Intra-node fp32 reduce-scatter (local rank l owns slice l; sum in local-rank order), compressed
    all-reduce of slice l among the nodes' local ranks l (divided by the total world size), intra-node
    all-gather. Ranks are node-major: rank = node * per_node + local.

    ``randoms[r]`` = [rank r's draws for its slice's encode, for its part's re-encode]; ``residuals``
    (updated in place): {"worker": [per rank, slice length], "server": [per rank, part length]}.
    """
    world = nodes * per_node
    slices = _node_slices(inputs, nodes, per_node, lambda x: x.reshape(per_node, -1))
    reduced = []
    for local in range(per_node):
        members = [node * per_node + local for node in range(nodes)]  # the inter-node group of local rank l
        sub = None
        if residuals is not None:
            sub = {side: [residuals[side][r] for r in members] for side in ("worker", "server")}
        outs, _ = ref_flat_all_reduce(
            [slices[node, local] for node in range(nodes)],
            chunk,
            average=False,
            divisor=world if average else None,
            rounding=rounding,
            randoms=None if randoms is None else [randoms[r] for r in members],
            residuals=sub,
            wire=wire,
        )
        if residuals is not None and sub is not None:
            for i, r in enumerate(members):
                residuals["worker"][r], residuals["server"][r] = sub["worker"][i], sub["server"][i]
        reduced.append(outs[0])
    full = np.concatenate(reduced)
    return [full.copy() for _ in range(world)]


def ref_hierarchical_reduce_scatter(
    inputs: list[np.ndarray], chunk: int, nodes: int, per_node: int, *, average: bool = True, wire: str = "uint8"
) -> list[np.ndarray]:
    """Rank r = node * n + l gets part r: local rank l's slice holds parts {i * n + l} in node order, summed
    over the node in fp32; the compressed reduce-scatter among the nodes hands node i its part i.
    """
    world = nodes * per_node
    slices = _node_slices(
        inputs, nodes, per_node, lambda x: x.reshape(nodes, per_node, -1).transpose(1, 0, 2).reshape(per_node, -1)
    )
    shards = [None] * world
    for local in range(per_node):
        parts = ref_flat_reduce(
            [slices[node, local] for node in range(nodes)], chunk, divisor=world if average else None, wire=wire
        )
        for node in range(nodes):
            shards[node * per_node + local] = parts[node]
    return shards
