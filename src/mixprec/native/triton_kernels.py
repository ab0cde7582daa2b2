"""Triton kernels: the GPU twins of ``csrc/rounding.c``, ``csrc/quant_u8.c`` and ``csrc/matmul.c``.

Imported only by :mod:`mixprec.native.gpu`, and only when ``triton`` is installed (it is an optional dependency).
Each kernel does, element by element, the same IEEE operations as the torch path it replaces, so the bits are
the same (the tests compare them); what makes that hold on a GPU:

- every launch passes ``enable_fp_fusion=False``: a fused multiply-add would round once where the torch path
  rounds twice (the quantizer's ``(x - sub) * scale + zero``, the decoder's ``(c - zero) * step + sub``);
- divisions that define a result are fp64 ``/`` (``div.rn.f64``, correctly rounded), never Triton's fast fp32 one;
- stochastic rounding reads the Philox4x32-10 stream of :mod:`mixprec.core.philox` through ``tl.philox`` (the
  Random123 rounds, as in torch's CUDA generator); the 16 counters of a group of 256 elements are computed
  once and spread over the group's elements with broadcasts, not recomputed per element;
- the emulated matmul sums each K group of exact products in fp64 (``tl.dot`` on fp64 tiles) and rounds the
  accumulator after every group, as ``csrc/matmul.c`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------- rounding
ALG_INT, ALG_MAGIC32, ALG_MAGIC64 = 0, 1, 2


# Triton compiles an int argument equal to 1 as a constant (a plain int, which has no .to): the format's
# parameters, and the chunk size below, opt out of that specialisation.
@triton.jit(
    do_not_specialize=["drop", "half_m1", "keep_mask", "lo32", "hi32", "add32", "max_bits", "ovf_bits",
                       "min_normal_bits", "nan_or"]
)  # fmt: skip
def round_nearest_kernel(
    src,
    dst,
    n,
    drop,
    half_m1,
    keep_mask,
    lo32,
    hi32,
    add32,
    lo64,
    hi64,
    add64,
    max_bits,
    ovf_bits,
    min_normal_bits,
    nan_or,
    ALG: tl.constexpr,
    ODD: tl.constexpr,
    NAN_KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """fp32/fp16/bf16 ``src`` -> fp32 bit patterns in ``dst`` (an int32 view), rounding.c's round_bits."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)  # fp16/bf16 widen exactly
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    s = u ^ a
    if ALG == 0:
        inc = half_m1.to(tl.uint32)
        if ODD:
            inc = inc + ((a >> drop.to(tl.uint32)) & 1)
        ra = (a + inc) & keep_mask.to(tl.uint32)
    elif ALG == 1:
        c = u & 0x7F800000
        c = tl.minimum(tl.maximum(c, lo32.to(tl.uint32)), hi32.to(tl.uint32))
        m = (c + add32.to(tl.uint32)).to(tl.float32, bitcast=True)
        r = (x + m) - m
        ra = r.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    else:
        d = x.to(tl.float64)
        c = d.to(tl.int64, bitcast=True) & 0x7FF0000000000000
        c = tl.minimum(tl.maximum(c, lo64), hi64)
        m = (c + add64).to(tl.float64, bitcast=True)
        ra = ((d + m) - m).to(tl.float32).to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    ra = tl.where(ra > max_bits.to(tl.uint32), ovf_bits.to(tl.uint32), ra)
    ra = tl.where(ra < min_normal_bits.to(tl.uint32), 0, ra)
    if NAN_KEEP:
        nan_bits = u | nan_or.to(tl.uint32)
    else:
        nan_bits = tl.zeros_like(u) | nan_or.to(tl.uint32)
    out = tl.where(a > 0x7F800000, nan_bits, s | ra)
    tl.store(dst + offs, out.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def round_nearest_f64_kernel(
    src, dst, n, lo, hi, add, max_bits, ovf_bits, min_normal_bits, DST_F64: tl.constexpr, BLOCK: tl.constexpr
):
    """fp64 ``src`` rounded once to the format, into fp64 or fp32 ``dst`` (rounding.c's round_bits64)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(src + offs, mask=mask, other=0.0)
    u = d.to(tl.int64, bitcast=True)
    a = u & 0x7FFFFFFFFFFFFFFF
    s = u ^ a
    c = tl.minimum(tl.maximum(u & 0x7FF0000000000000, lo), hi)
    m = (c + add).to(tl.float64, bitcast=True)
    ra = ((d + m) - m).to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    ra = tl.where(ra > max_bits, ovf_bits, ra)
    ra = tl.where(ra < min_normal_bits, 0, ra)
    out = tl.where(a > 0x7FF0000000000000, u | 0x0008000000000000, s | ra).to(tl.float64, bitcast=True)
    if DST_F64:
        tl.store(dst + offs, out, mask=mask)
    else:
        tl.store(dst + offs, out.to(tl.float32), mask=mask)


# -------------------------------------------------------------------------------------------- uint8 quantizer
@triton.jit
def _chunk_grid(mn, mx, fp32_max, wide_below):
    """MinMaxUInt8.grid for one chunk: (wide, sub, scale, zero, step) from its fp32 min and max."""
    lo = mn.to(tl.float64)
    rng = mx.to(tl.float64) - lo
    wide = (rng > fp32_max) | ((rng > 0) & (rng < wide_below))
    aligned = (lo < 0) & (mx >= 0) & (wide == 0)
    step = tl.where(aligned, rng / 254.0, rng / 255.0).to(tl.float32)
    s64 = step.to(tl.float64)
    over = 255.0 / rng
    scale = tl.where(aligned, 1.0 / s64, tl.where(rng > 0, over, 0.0)).to(tl.float32)
    neg = tl.where(aligned, -lo, 0.0)
    safe = tl.where(aligned, s64, 1.0)
    zero = tl.math.ceil(neg / safe)
    zero = zero - tl.where((zero - 1) * safe >= neg, 1.0, 0.0)
    zero = zero + tl.where(zero * safe < neg, 1.0, 0.0)
    sub = tl.where(aligned, 0.0, mn)
    return wide, sub, scale, zero.to(tl.float32), step


@triton.jit
def _store_f32_bytes(ptr, value):
    """The 4 little-endian bytes of the fp32 scalar ``value`` at ``ptr`` (rows need not be 4-byte aligned)."""
    k = tl.arange(0, 4)
    bits = value.to(tl.uint32, bitcast=True)
    tl.store(ptr + k, ((bits >> (8 * k).to(tl.uint32)) & 255).to(tl.uint8))


@triton.jit
def _load_f32_bytes(ptr):
    k = tl.arange(0, 4)
    b = tl.load(ptr + k).to(tl.uint32)
    return tl.sum(b << (8 * k).to(tl.uint32), axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _load_f32_lanes(ptr, mask):
    """The fp32 values whose 4 little-endian bytes start at each of the pointers ``ptr`` (masked lanes: 0)."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _primary_bytes(key, first):
    """The primary bytes (as int32) of stream positions ``first + [0, 1024)`` (``first`` a multiple of 256):
    element 256 g + 64 b + 16 w + l is byte b of word w of counter 16 (first / 256 + g) + l."""
    lane = tl.arange(0, 64)
    ctr = ((first >> 8) + (lane >> 4).to(tl.int64)) * 16 + (lane & 15).to(tl.int64)
    c0 = (ctr & 0xFFFFFFFF).to(tl.uint32)
    c1 = (ctr >> 32).to(tl.uint32)
    nil = tl.zeros_like(c0)
    r0, r1, r2, r3 = tl.philox(key, c0, c1, nil, nil, 10)
    r0 = tl.reshape(r0, [4, 1, 16])
    r1 = tl.reshape(r1, [4, 1, 16])
    r2 = tl.reshape(r2, [4, 1, 16])
    r3 = tl.reshape(r3, [4, 1, 16])
    w = tl.arange(0, 4)[None, :, None]
    words = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))  # [g, w, l]
    b = tl.arange(0, 4)[None, :, None, None].to(tl.uint32)
    by = (words[:, None, :, :] >> (8 * b)) & 255  # [g, b, w, l]
    return tl.reshape(by, [1024]).to(tl.int32)


@triton.jit
def _codes_q(x_row, j, m, sub, scale, zero):
    """q = fl32(fl32(fl32(x - sub) * scale) + zero) of the elements j of a chunk (the grid's arithmetic)."""
    v = tl.load(x_row + j, mask=m, other=0.0).to(tl.float32)
    q = (v - sub) * scale
    return q + zero


@triton.jit(do_not_specialize=["k0", "k1", "chunk", "w_row"])
def quant_encode_kernel(
    x,
    out,
    length,
    chunks,
    chunk,
    x_stride,
    out_stride,
    k0,
    k1,
    offset,
    pos_stride,
    stats,
    tie_cnt,
    tie_bits,
    fp32_max,
    wide_below,
    w_row,
    STOCHASTIC: tl.constexpr,
):
    """One (chunk, row) per program: min/max pass, the chunk's grid, then the codes. Counts flagged and wide
    chunks in ``stats[0]``, ``stats[1]``. Stochastic rounding visits windows of 1024 stream positions on a
    grid of the row (``w_row`` of them, from the row's first position rounded down to 256); the ties of a
    window go into its bit mask (32 uint32 words of ``tie_bits``, zeroed by the caller, or-ed in: the chunks
    that share a window own disjoint bits) and set its ``tie_cnt`` flag, for quant_ties_kernel. The scratch
    is one mask per 1024 elements, whatever the chunk size. A 1-D grid of chunks x rows programs (the second
    and third grid axes stop at 65535)."""
    pid = tl.program_id(0).to(tl.int64)
    c = pid % chunks
    r = pid // chunks
    chunk = chunk.to(tl.int64)  # int64 like start: a value keeps one type through the branch
    start = c * chunk
    n = length - start
    if n > chunk:
        n = chunk
    xr = x + r * x_stride + start
    idx = tl.arange(0, 1024)
    mn = tl.full([], float("inf"), tl.float32)  # typed: loop-carried values keep one type
    mx = tl.full([], float("-inf"), tl.float32)
    bad = tl.zeros([], tl.int32)
    t = 0
    while t < n:
        m = t + idx < n
        v = tl.load(xr + t + idx, mask=m, other=0.0).to(tl.float32)
        mn = tl.minimum(mn, tl.min(tl.where(m, v, float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(m, v, float("-inf")), axis=0))
        bad = tl.maximum(bad, tl.max(tl.where(m & ((tl.abs(v) == float("inf")) | (v != v)), 1, 0), axis=0))
        t += 1024
    orow = out + r * out_stride
    codes = orow + 8 * chunks + start
    if bad > 0:
        nan = tl.full([], 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
        _store_f32_bytes(orow + 4 * c, nan)
        _store_f32_bytes(orow + 4 * (chunks + c), nan)
        t = 0
        while t < n:
            tl.store(codes + t + idx, tl.zeros([1024], tl.uint8), mask=t + idx < n)
            t += 1024
        tl.atomic_add(stats, 1)
    else:
        _store_f32_bytes(orow + 4 * c, mn)
        _store_f32_bytes(orow + 4 * (chunks + c), mx)
        wide, sub, scale, zero, _ = _chunk_grid(mn, mx, fp32_max, wide_below)
        if wide:  # the caller recomputes these chunks in float64
            tl.atomic_add(stats + 1, 1)
        elif STOCHASTIC:
            key = (k1.to(tl.uint64) & 0xFFFFFFFF) << 32 | (k0.to(tl.uint64) & 0xFFFFFFFF)
            base = ((offset + r * pos_stride) >> 8) << 8  # the row's window grid
            e0 = offset + r * pos_stride + start  # stream position of the chunk's first element
            win = base + (((e0 - base) >> 10) << 10)  # the first window the chunk touches
            slot = r * w_row + ((win - base) >> 10)
            while win < e0 + n:
                j = win - e0 + idx  # element index within the chunk
                m = (j >= 0) & (j < n)
                q = _codes_q(xr, j, m, sub, scale, zero)
                f = tl.math.floor(q)
                s = (q - f) * 256.0
                f8 = tl.math.floor(s)
                byte = _primary_bytes(key, win).to(tl.float32)
                code = tl.minimum(tl.maximum(f + tl.where(byte < f8, 1.0, 0.0), 0.0), 255.0)
                tl.store(codes + j, (code + 8388608.0).to(tl.uint32, bitcast=True).to(tl.uint8), mask=m)
                tie = (m & (byte == f8)).to(tl.uint32)
                if tl.sum(tie, axis=0) > 0:  # a bit mask of the window's ties: 32 words of 32 elements
                    bits = tl.sum(tl.reshape(tie, [32, 32]) << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)
                    bits = bits.to(tl.int32, bitcast=True)
                    tl.atomic_or(tie_bits + slot * 32 + tl.arange(0, 32), bits, mask=bits != 0)
                    tl.store(tie_cnt + slot, 1)
                win += 1024
                slot += 1
        else:
            t = 0
            while t < n:
                m = t + idx < n
                q = _codes_q(xr, t + idx, m, sub, scale, zero)
                tl.store(codes + t + idx, (q + 8388608.0).to(tl.uint32, bitcast=True).to(tl.uint8), mask=m)
                t += 1024


@triton.jit(do_not_specialize=["k0", "k1", "chunk", "w_row"])
def quant_ties_kernel(
    x,
    out,
    length,
    chunks,
    chunk,
    x_stride,
    out_stride,
    k0,
    k1,
    offset,
    pos_stride,
    tie_cnt,
    tie_bits,
    fp32_max,
    wide_below,
    w_row,
):
    """The ties of one window (program window + w_row * row), 32 at a time (one per mask word): each tie's
    chunk grid from its header, q recomputed from ``x`` as the encoder computed it; up when the secondary word
    (counter (e low, e high, 1, 0)) < remainder * 2**32."""
    slot = tl.program_id(0).to(tl.int64)  # 1-D grid: window + w_row * row
    r = slot // w_row
    if tl.load(tie_cnt + slot) > 0:
        lane = tl.arange(0, 32)
        words = tl.load(tie_bits + slot * 32 + lane).to(tl.uint32, bitcast=True)
        row_e0 = offset + r * pos_stride  # stream position of the row's first element
        first = ((row_e0 >> 8) << 8) + (slot % w_row) * 1024
        orow = out + r * out_stride
        key = (k1.to(tl.uint64) & 0xFFFFFFFF) << 32 | (k0.to(tl.uint64) & 0xFFFFFFFF)
        while tl.max(words, axis=0) > 0:
            valid = words != 0
            rest = words & (words - 1)  # without its lowest set bit
            low = words ^ rest  # the lowest set bit; its index from the exponent of its exact fp32 value
            b = (low.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) - 127
            e = first + (lane * 32).to(tl.int64) + b.to(tl.int64)
            j = e - row_e0  # element of the row
            c = j // chunk.to(tl.int64)
            mn = _load_f32_lanes(orow + 4 * c, valid)
            mx = _load_f32_lanes(orow + 4 * (chunks + c), valid)
            _, sub, scale, zero, _ = _chunk_grid(mn, mx, fp32_max, wide_below)
            q = _codes_q(x + r * x_stride, j, valid, sub, scale, zero)
            f = tl.math.floor(q)
            s = (q - f) * 256.0
            rem = (s - tl.math.floor(s)).to(tl.float64)  # exact
            c0 = (e & 0xFFFFFFFF).to(tl.uint32)
            c1 = (e >> 32).to(tl.uint32)
            w = tl.philox(key, c0, c1, tl.full([32], 1, tl.uint32), tl.zeros([32], tl.uint32), 10)[0]
            up = w.to(tl.float64) < rem * 4294967296.0
            code = tl.minimum(tl.maximum(f + 1.0, 0.0), 255.0)
            byte = (code + 8388608.0).to(tl.uint32, bitcast=True).to(tl.uint8)
            tl.store(orow + 8 * chunks + j, byte, mask=valid & up)
            words = rest


@triton.jit
def _to_bf16_bits(w):
    """fp32 -> bf16 round to nearest even, as int16 bits (Triton's interpreter truncates a plain cast)."""
    u = w.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(w != w, (u >> 16) | 0x40, r)  # NaN stays NaN (quiet)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _count_chunk(stats, first_tile, mn, wide):
    """Once per chunk and row (its first tile): flagged (NaN header) into stats[0], wide into stats[1]."""
    if first_tile:
        if mn != mn:
            tl.atomic_add(stats, 1)
        if wide:
            tl.atomic_add(stats + 1, 1)


@triton.jit(do_not_specialize=["chunk"])
def quant_decode_kernel(
    buf,
    out,
    length,
    chunks,
    chunk,
    tiles,
    rows,
    buf_stride,
    out_stride,
    fp32_max,
    wide_below,
    stats,
    REDUCE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One tile of a chunk of one row per program; REDUCE (fp32 ``out``): one tile of a chunk, the rows summed
    in row order in fp32, as the torch path's ``torch.add`` then ``add_``. OUT_BF16: ``out`` is an int16 view."""
    pid = tl.program_id(0).to(tl.int64)  # 1-D grid: chunk + chunks * (tile + tiles * row)
    c = pid % chunks
    t = (pid // chunks) % tiles * BLOCK
    chunk = chunk.to(tl.int64)  # int64 like start: a value keeps one type through the branch
    start = c * chunk
    n = length - start
    if n > chunk:
        n = chunk
    idx = t + tl.arange(0, BLOCK)
    m = idx < n
    if REDUCE:
        acc = tl.zeros([BLOCK], tl.float32)
        r = tl.zeros([], tl.int64)  # r * buf_stride must not wrap at 2**31 bytes
        while r < rows:
            row = buf + r * buf_stride
            mn = _load_f32_bytes(row + 4 * c)
            mx = _load_f32_bytes(row + 4 * (chunks + c))
            wide, sub, _, zero, step = _chunk_grid(mn, mx, fp32_max, wide_below)
            _count_chunk(stats, t == 0, mn, wide)
            code = tl.load(row + 8 * chunks + start + idx, mask=m, other=0).to(tl.float32)
            w = (code - zero) * step
            w = w + sub
            if r == 0:
                acc = w
            else:
                acc = acc + w
            r += 1
        tl.store(out + start + idx, acc, mask=m)
    else:
        r = pid // chunks // tiles
        row = buf + r * buf_stride
        mn = _load_f32_bytes(row + 4 * c)
        mx = _load_f32_bytes(row + 4 * (chunks + c))
        wide, sub, _, zero, step = _chunk_grid(mn, mx, fp32_max, wide_below)
        _count_chunk(stats, t == 0, mn, wide)
        code = tl.load(row + 8 * chunks + start + idx, mask=m, other=0).to(tl.float32)
        w = (code - zero) * step
        w = w + sub
        if OUT_BF16:
            tl.store(out + r * out_stride + start + idx, _to_bf16_bits(w), mask=m)
        else:
            tl.store(out + r * out_stride + start + idx, w.to(out.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------- emulated matmul
@triton.jit
def _round_acc(x, MODE: tl.constexpr, lo, hi, add, maxv, over, min_normal, SUBNORMALS: tl.constexpr):
    """matmul.c's round_scalar on an fp64 tile: fp32 (MODE 0), or the magic constant with the exponent clamped
    to [emin, emax + 1], then the overflow rule and the flush of results below the normal range."""
    if MODE == 0:
        return x.to(tl.float32).to(tl.float64)
    else:
        e = x.to(tl.int64, bitcast=True) & 0x7FF0000000000000
        e = tl.minimum(tl.maximum(e, lo), hi)
        cst = (e + add).to(tl.float64, bitcast=True)
        x = (x + cst) - cst
        x = tl.where(tl.abs(x) > maxv, tl.where(x < 0, -over, over), x)
        if not SUBNORMALS:
            x = tl.where((tl.abs(x) < min_normal) & (x != 0.0), x * 0.0, x)
        return x


@triton.jit
def matmul_model_kernel(
    a,
    b,
    out,
    M,
    N,
    K,
    sab,
    sam,
    sak,
    sbb,
    sbk,
    sbn,
    groups,
    pg,
    lo,
    hi,
    add,
    maxv,
    over,
    min_normal,
    MODE: tl.constexpr,
    SUBNORMALS: tl.constexpr,
    KG: tl.constexpr,
    KGP: tl.constexpr,
    USE_DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """One BM x BN output tile of batch ``program_id(2)``: acc <- round(acc + group sum) per K group of KG
    products (fp64 sums of exact products), promoted into fp32 every ``pg`` groups (0: never)."""
    n_tiles = (N + BN - 1) // BN
    pid_m = tl.program_id(0) // n_tiles  # the tiles on axis 0, the batch on axis 1: axes 1 and 2 stop at 65535
    pid_n = tl.program_id(0) % n_tiles
    bt = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, KGP)  # KG padded to a power of two >= 16 (tl.dot's minimum) with zero products
    a_row = a + bt * sab + rm[:, None].to(tl.int64) * sam
    b_col = b + bt * sbb + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros([BM, BN], tl.float64)
    prom = tl.zeros([BM, BN], tl.float64)
    g = 0
    while g < groups:
        k = g * KG + rk
        kin = (rk < KG) & (k < K)
        av = tl.load(a_row + k[None, :].to(tl.int64) * sak, mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        bv = tl.load(b_col + k[:, None].to(tl.int64) * sbk, mask=kin[:, None] & (rn[None, :] < N), other=0.0)
        av = av.to(tl.float64)
        bv = bv.to(tl.float64)
        if USE_DOT:
            s = tl.dot(av, bv, input_precision="ieee")
        else:
            s = tl.sum(av[:, :, None] * bv[None, :, :], axis=1)
        fresh = g == 0
        if pg > 0:
            fresh = g % pg == 0
        if fresh:
            acc = s
        else:
            acc = acc + s
        acc = _round_acc(acc, MODE, lo, hi, add, maxv, over, min_normal, SUBNORMALS)
        if pg > 0:  # noqa: SIM102 (nested: Triton's & evaluates both sides, and % 0 is undefined)
            if ((g + 1) % pg == 0) | (g == groups - 1):
                prom = (prom + acc).to(tl.float32).to(tl.float64)
        g += 1
    if pg > 0:
        res = prom
    else:
        res = acc
    o = out + bt * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(o, res.to(tl.float32), mask=(rm[:, None] < M) & (rn[None, :] < N))
