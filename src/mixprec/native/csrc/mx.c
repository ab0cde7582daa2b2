/* Block-scaled quantization (OCP MX, NVFP4) along contiguous blocks, one pass: mixprec.core.mx's torch path
 * (the oracle, docs/mx.md) fused per block.
 *
 * Per block of `block` consecutive elements: amax as the largest |x| bit pattern (non-negative fp32 values order
 * as their patterns; a pattern above inf's is a NaN block), the scale by the mode's rule (E8M0: floor, ceil, even,
 * rceil, neuron; E4M3: NVFP4's with an optional tensor scale), then per element v = fl32(x * mult), clamped to
 * +-max_element, rounded to the element grid (nearest even by the magic constant x + C - C, or toward zero by
 * masking the fraction), the input's sign kept, and optionally multiplied back by the decoded scale (fake
 * quantization). The same IEEE fp32 operations as the torch path, in the same order, so the same bits; a NaN
 * block gives the default NaN everywhere, as the torch path does. The loops are plain C that gcc vectorizes
 * (16 lanes with AVX-512, 8 with AVX2, scalar without), as rounding.c's round to nearest: no selects between
 * floats, only integer blends. Stochastic rounding stays on the torch path.
 */
#include <omp.h>
#include <stdint.h>

#include "common.h"

enum { MX_FLOOR = 0, MX_CEIL = 1, MX_EVEN = 2, MX_RCEIL = 3, MX_NEURON = 4, MX_E4M3 = 5 };
enum { MX_SRC_F32 = 0, MX_SRC_F16 = 1, MX_SRC_BF16 = 2 };
#define MX_NAN 0x7FC00000u
#define GROUP 16 /* blocks whose scales are computed together */

typedef struct {
    int mode, emax, has_ts, toward_zero;
    float max_element, ts, rts; /* rts = fl32(1 / ts) */
    uint32_t even_inc;          /* half a unit of the element's precision, for "even" */
    uint32_t max_bits, lo, hi, add, keep_mask, min_normal_bits;
    float up, down; /* 2**(man - emin) and its inverse: toward zero below the element's smallest normal */
} mxparams;

static inline uint32_t pow2_bits(int k) { return k >= -126 ? (uint32_t)(k + 127) << 23 : 0x00400000u; }

/* The block's decoded scale (what .scales holds), its element multiplier and the dequantization factor. */
static inline void block_scale(uint32_t amaxb, const mxparams *p, float *scale, float *mult, float *deq) {
    if (amaxb > 0x7F800000u) {
        *scale = *mult = *deq = bits_f32(MX_NAN);
        return;
    }
    if (p->mode == MX_E4M3) {
        float bs = bits_f32(amaxb) / p->max_element;
        if (p->has_ts) bs = bs / p->ts;
        bs = bs < 0x1p-6f ? 0x1p-6f : (bs > 448.0f ? 448.0f : bs);
        /* E4M3 round to nearest even of a normal in [2**-6, 448] (448 is on the grid) */
        const float m = bits_f32((f32_bits(bs) & 0x7F800000u) + ((20u << 23) | (1u << 22)));
        const float s = (bs + m) - m;
        *scale = s;
        *mult = p->has_ts ? p->rts / s : 1.0f / s;
        *deq = p->has_ts ? p->ts * s : s;
        return;
    }
    int e;
    if (p->mode == MX_RCEIL) {
        const uint32_t d = f32_bits(bits_f32(amaxb) / p->max_element); /* cuBLAS's fp32 quotient */
        e = (int)((d >> 23) & 0xFFu) - 127 + ((d & 0x7FFFFFu) != 0);
        if (d < 0x00800000u) e = d > 0x00400000u ? -126 : -127;
    } else {
        const uint32_t b = p->mode == MX_EVEN ? amaxb + p->even_inc : amaxb;
        e = (int)((b >> 23) & 0xFFu) - 127;
        if (p->mode == MX_CEIL) e += (b & 0x7FFFFFu) != 0;
        e -= p->emax;
        if (p->mode == MX_NEURON) e += 1;
    }
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    *scale = *deq = bits_f32(pow2_bits(e));
    *mult = (p->mode == MX_RCEIL && e == -127) ? 1.0f : bits_f32(pow2_bits(-e)); /* TE's exp2f_rcp */
}

/* block_scale for g blocks at once, in loops gcc vectorizes across blocks (integer selects only; dividing by 1
 * and multiplying by 1 are exact, so one loop serves NVFP4 with and without a tensor scale). */
static void block_scales(const uint32_t *am, int g, const mxparams *p, float *sc, float *mu, float *dq) {
    uint32_t *scb = (uint32_t *)sc, *mub = (uint32_t *)mu, *dqb = (uint32_t *)dq;
    if (p->mode == MX_E4M3) {
        const float maxe = p->max_element, tsd = p->has_ts ? p->ts : 1.0f, rtsd = p->has_ts ? p->rts : 1.0f;
#pragma omp simd
        for (int i = 0; i < g; i++) {
            uint32_t b = f32_bits((bits_f32(am[i]) / maxe) / tsd);
            b = b < 0x3C800000u ? 0x3C800000u : (b > 0x43E00000u ? 0x43E00000u : b); /* [2**-6, 448] */
            const float m = bits_f32((b & 0x7F800000u) + ((20u << 23) | (1u << 22)));
            const float s = (bits_f32(b) + m) - m;
            const uint32_t nan = 0u - (uint32_t)(am[i] > 0x7F800000u);
            scb[i] = (f32_bits(s) & ~nan) | (MX_NAN & nan);
            mub[i] = (f32_bits(rtsd / s) & ~nan) | (MX_NAN & nan);
            dqb[i] = (f32_bits(tsd * s) & ~nan) | (MX_NAN & nan);
        }
        return;
    }
    int32_t e[GROUP];
    if (p->mode == MX_RCEIL) {
        const float maxe = p->max_element;
#pragma omp simd
        for (int i = 0; i < g; i++) {
            const uint32_t d = f32_bits(bits_f32(am[i]) / maxe);
            const int32_t en = (int32_t)((d >> 23) & 0xFFu) - 127 + (int32_t)((d & 0x7FFFFFu) != 0);
            const int32_t es = d > 0x00400000u ? -126 : -127;
            e[i] = d < 0x00800000u ? es : en;
        }
    } else {
        const uint32_t inc = p->mode == MX_EVEN ? p->even_inc : 0u;
        const int32_t ceil = p->mode == MX_CEIL, off = -p->emax + (p->mode == MX_NEURON);
#pragma omp simd
        for (int i = 0; i < g; i++) {
            const uint32_t b = am[i] + inc;
            e[i] = (int32_t)((b >> 23) & 0xFFu) - 127 + (ceil & (int32_t)((b & 0x7FFFFFu) != 0)) + off;
        }
    }
    const uint32_t one_if_rceil = p->mode == MX_RCEIL ? 0x3F800000u : 0u;
#pragma omp simd
    for (int i = 0; i < g; i++) {
        int32_t k = e[i] < -127 ? -127 : (e[i] > 127 ? 127 : e[i]);
        const uint32_t sb = k >= -126 ? (uint32_t)(k + 127) << 23 : 0x00400000u;
        uint32_t mb = -k >= -126 ? (uint32_t)(127 - k) << 23 : 0x00400000u;
        mb = (k == -127 && one_if_rceil) ? one_if_rceil : mb; /* TE's exp2f_rcp */
        const uint32_t nan = 0u - (uint32_t)(am[i] > 0x7F800000u);
        scb[i] = dqb[i] = (sb & ~nan) | (MX_NAN & nan);
        mub[i] = (mb & ~nan) | (MX_NAN & nan);
    }
}

static inline __attribute__((always_inline)) uint32_t element(uint32_t xb, float mult, const mxparams *p) {
    const uint32_t vb = f32_bits(bits_f32(xb) * mult);
    const uint32_t sign = vb & 0x80000000u, a = vb & 0x7FFFFFFFu;
    const uint32_t ac = a > p->max_bits ? p->max_bits : a; /* saturate (inf too; NaN is handled last) */
    uint32_t r;
    if (!p->toward_zero) {
        uint32_t c = ac & 0x7F800000u;
        c = c < p->lo ? p->lo : c;
        c = c > p->hi ? p->hi : c;
        const float m = bits_f32(c + p->add);
        r = f32_bits((bits_f32(ac) + m) - m);
    } else {
        /* floor(|v| / spacing) * spacing: drop the fraction bits in the normal range, an integer conversion
         * (exact, |v| * 2**(man - emin) < 2**man) below it */
        const uint32_t small = f32_bits((float)(int32_t)(bits_f32(ac) * p->up) * p->down);
        const uint32_t is_small = 0u - (uint32_t)(ac < p->min_normal_bits);
        r = (small & is_small) | (ac & p->keep_mask & ~is_small);
    }
    return a > 0x7F800000u ? (vb | 0x00400000u) : (sign | r);
}

/* One block: amax, scale, elements (times deq when dequantizing) into dst, the scale into *scale_out. */
#define DEFINE_BLOCK(NAME, SRC_T, LOAD)                                                                        \
    static inline __attribute__((always_inline)) void NAME(const SRC_T *src, float *dst,                      \
                                                           int64_t nb, const int block, const int dequant,    \
                                                           const mxparams *p, float *scale_out) {             \
        uint32_t amaxb = 0;                                                                                    \
        _Pragma("omp simd reduction(max : amaxb)") for (int64_t i = 0; i < nb; i++) {                          \
            const uint32_t a = LOAD(src[i]) & 0x7FFFFFFFu;                                                     \
            amaxb = a > amaxb ? a : amaxb;                                                                     \
        }                                                                                                      \
        (void)block;                                                                                           \
        float scale, mult, deq;                                                                                \
        block_scale(amaxb, p, &scale, &mult, &deq);                                                            \
        if (scale_out) *scale_out = scale;                                                                     \
        uint32_t *d = (uint32_t *)dst;                                                                         \
        if (amaxb > 0x7F800000u) {                                                                             \
            for (int64_t i = 0; i < nb; i++) d[i] = MX_NAN;                                                    \
            return;                                                                                            \
        }                                                                                                      \
        const mxparams q = *p;                                                                                 \
        if (dequant) {                                                                                         \
            _Pragma("omp simd") for (int64_t i = 0; i < nb; i++) dst[i] =                                      \
                bits_f32(element(LOAD(src[i]), mult, &q)) * deq;                                               \
        } else {                                                                                               \
            _Pragma("omp simd") for (int64_t i = 0; i < nb; i++) d[i] = element(LOAD(src[i]), mult, &q);       \
        }                                                                                                      \
    }
#define MX_LOAD_F32(v) (v)
#define MX_LOAD_BF16(v) ((uint32_t)(v) << 16)
#define MX_LOAD_F16(v) f32_bits(f16_to_f32(v))
DEFINE_BLOCK(block_f32, uint32_t, MX_LOAD_F32)
DEFINE_BLOCK(block_bf16, uint16_t, MX_LOAD_BF16)
DEFINE_BLOCK(block_f16, uint16_t, MX_LOAD_F16)

/* Blocks [b0, b1). The common block sizes go in groups of 16 blocks: amax per block (a loop of a constant trip
 * count), the 16 scales in vectorized loops, then the elements; other sizes one block at a time. */
#define DEFINE_GROUPED(NAME, SRC_T, LOAD, B)                                                                   \
    static void NAME(const SRC_T *src, float *dst, float *scales, int64_t b0, int64_t b1, int dequant,         \
                     const mxparams *p) {                                                                      \
        uint32_t am[GROUP];                                                                                    \
        float sc[GROUP], mu[GROUP], dq[GROUP];                                                                 \
        const mxparams q = *p;                                                                                 \
        for (int64_t g0 = b0; g0 < b1; g0 += GROUP) {                                                          \
            const int g = b1 - g0 < GROUP ? (int)(b1 - g0) : GROUP;                                            \
            for (int j = 0; j < g; j++) {                                                                      \
                const SRC_T *s = src + (g0 + j) * B;                                                           \
                uint32_t m = 0;                                                                                \
                _Pragma("omp simd reduction(max : m)") for (int i = 0; i < B; i++) {                           \
                    const uint32_t a = LOAD(s[i]) & 0x7FFFFFFFu;                                               \
                    m = a > m ? a : m;                                                                         \
                }                                                                                              \
                am[j] = m;                                                                                     \
            }                                                                                                  \
            block_scales(am, g, p, sc, mu, dq);                                                                \
            if (scales) memcpy(scales + g0, sc, (size_t)g * sizeof(float));                                    \
            for (int j = 0; j < g; j++) {                                                                      \
                const SRC_T *s = src + (g0 + j) * B;                                                           \
                float *o = dst + (g0 + j) * B;                                                                 \
                uint32_t *ob = (uint32_t *)o;                                                                  \
                const float mult = mu[j], deq = dq[j];                                                         \
                if (am[j] > 0x7F800000u) {                                                                     \
                    for (int i = 0; i < B; i++) ob[i] = MX_NAN;                                                \
                } else if (dequant) {                                                                          \
                    _Pragma("omp simd") for (int i = 0; i < B; i++) o[i] = bits_f32(element(LOAD(s[i]), mult, &q)) * deq; \
                } else {                                                                                       \
                    _Pragma("omp simd") for (int i = 0; i < B; i++) ob[i] = element(LOAD(s[i]), mult, &q);     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_GROUPED(grouped32_f32, uint32_t, MX_LOAD_F32, 32)
DEFINE_GROUPED(grouped16_f32, uint32_t, MX_LOAD_F32, 16)
DEFINE_GROUPED(grouped32_bf16, uint16_t, MX_LOAD_BF16, 32)
DEFINE_GROUPED(grouped16_bf16, uint16_t, MX_LOAD_BF16, 16)
DEFINE_GROUPED(grouped32_f16, uint16_t, MX_LOAD_F16, 32)
DEFINE_GROUPED(grouped16_f16, uint16_t, MX_LOAD_F16, 16)

#define DEFINE_RANGE(NAME, SRC_T, BLOCK_FN, G32, G16)                                                          \
    static void NAME(const void *src_, float *dst, float *scales, int64_t b0, int64_t b1, int block,           \
                     int dequant, const mxparams *p) {                                                         \
        const SRC_T *src = (const SRC_T *)src_;                                                                \
        if (block == 32)                                                                                       \
            G32(src, dst, scales, b0, b1, dequant, p);                                                         \
        else if (block == 16)                                                                                  \
            G16(src, dst, scales, b0, b1, dequant, p);                                                         \
        else                                                                                                   \
            for (int64_t b = b0; b < b1; b++)                                                                  \
                BLOCK_FN(src + b * block, dst + b * block, block, block, dequant, p, scales ? scales + b : 0); \
    }
DEFINE_RANGE(range_f32, uint32_t, block_f32, grouped32_f32, grouped16_f32)
DEFINE_RANGE(range_bf16, uint16_t, block_bf16, grouped32_bf16, grouped16_bf16)
DEFINE_RANGE(range_f16, uint16_t, block_f16, grouped32_f16, grouped16_f16)

/* Quantize n_blocks contiguous blocks of `block` elements of src (MX_SRC_* kind) to the block-scaled format
 * (element: exp_bits, man_bits, largest value max_element with exponent emax; scale rule mode; NVFP4's tensor
 * scale ts when has_ts). dst (fp32, n_blocks * block) gets the elements, or with dequant != 0 the elements
 * times their block's scale; scales (n_blocks fp32, may be NULL) the decoded scales. dst may be src itself when
 * src is fp32 (each block is read whole before it is written). Returns 0, or -1 for bad arguments. */
int mixprec_mx_quantize(const void *src, int src_kind, float *dst, float *scales, int64_t n_blocks, int block,
                        int exp_bits, int man_bits, float max_element, int mode, int has_ts, float ts,
                        int toward_zero, int dequant, int nthreads) {
    if (src_kind < 0 || src_kind > 2 || n_blocks < 0 || block < 1 || exp_bits < 2 || exp_bits > 7 ||
        man_bits < 1 || man_bits > 21 || mode < 0 || mode > MX_E4M3 || !(max_element > 0.0f) ||
        (has_ts && !(ts > 0.0f && ts < 0x1p127f * 2.0f)))
        return -1;
    const uint32_t mb = f32_bits(max_element);
    const int emin = 2 - (1 << (exp_bits - 1)), emax = (int)((mb >> 23) & 0xFFu) - 127;
    mxparams p = {0};
    p.mode = mode;
    p.emax = emax;
    p.has_ts = has_ts;
    p.toward_zero = toward_zero != 0;
    p.max_element = max_element;
    p.ts = ts;
    p.rts = has_ts ? 1.0f / ts : 1.0f;
    p.even_inc = 1u << (22 - man_bits);
    p.max_bits = mb;
    p.lo = (uint32_t)(emin + 127) << 23;
    p.hi = (uint32_t)(emax + 1 + 127) << 23;
    p.add = ((uint32_t)(23 - man_bits) << 23) | (1u << 22);
    p.keep_mask = ~((1u << (23 - man_bits)) - 1u);
    p.min_normal_bits = p.lo;
    p.up = bits_f32((uint32_t)(man_bits - emin + 127) << 23);
    p.down = bits_f32((uint32_t)(emin - man_bits + 127) << 23);
    void (*fn)(const void *, float *, float *, int64_t, int64_t, int, int, const mxparams *) =
        src_kind == MX_SRC_F32 ? range_f32 : (src_kind == MX_SRC_BF16 ? range_bf16 : range_f16);
    const int64_t n = n_blocks * block;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (n >= MIXPREC_GRAIN)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* whole blocks, at least 16 of them a slice: a thread's slice of dst starts on a 64-byte line as often
         * as the block size allows */
        const int64_t per = ((n_blocks + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t lo = t * per < n_blocks ? t * per : n_blocks, hi = lo + per < n_blocks ? lo + per : n_blocks;
        if (hi > lo) fn(src, dst, scales, lo, hi, block, dequant != 0, &p);
    }
    return 0;
}
