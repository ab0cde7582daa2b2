/* What the block-scaled kernels share (mx.c: quantization and fake quantization; mx_wire.c: the gradient wire):
 * the parameters of a format, a block's scale by each mode's rule, one element's round to nearest or toward zero,
 * and stochastic rounding on mixprec's Philox stream (philox.h; mixprec.core.mx.round_elements and
 * mixprec.core.philox.round_up are the torch oracle). Every function does the torch path's IEEE fp32 operations
 * in its order, so the results are the same bits (docs/mx.md, "Compiled kernel"). */
#ifndef MIXPREC_MX_H
#define MIXPREC_MX_H
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "philox.h"

enum { MX_FLOOR = 0, MX_CEIL = 1, MX_EVEN = 2, MX_RCEIL = 3, MX_NEURON = 4, MX_E4M3 = 5 };
enum { MX_SRC_F32 = 0, MX_SRC_F16 = 1, MX_SRC_BF16 = 2 };
#define MX_NAN 0x7FC00000u

typedef struct {
    int mode, emax, has_ts, toward_zero;
    float max_element, ts, rts; /* rts = fl32(1 / ts) */
    uint32_t even_inc;          /* half a unit of the element's precision, for "even" */
    uint32_t max_bits, lo, hi, add, keep_mask, min_normal_bits;
    float up, down; /* 2**(man - emin) and its inverse: toward zero below the element's smallest normal */
    int emin, man;  /* the element grid's smallest normal exponent and fraction bits (stochastic rounding) */
} mxparams;

static inline uint32_t pow2_bits(int k) { return k >= -126 ? (uint32_t)(k + 127) << 23 : 0x00400000u; }

/* The parameters of an element grid (exp_bits, man_bits, largest value max_element), a scale mode and NVFP4's
 * optional tensor scale; 0, or -1 for arguments out of range. */
static inline int mx_params(mxparams *p, int exp_bits, int man_bits, float max_element, int mode, int has_ts,
                            float ts, int toward_zero) {
    if (exp_bits < 2 || exp_bits > 7 || man_bits < 1 || man_bits > 21 || mode < 0 || mode > MX_E4M3 ||
        !(max_element > 0.0f) || (has_ts && !(ts > 0.0f && ts < 0x1p127f * 2.0f)))
        return -1;
    const uint32_t mb = f32_bits(max_element);
    const int emin = 2 - (1 << (exp_bits - 1)), emax = (int)((mb >> 23) & 0xFFu) - 127;
    memset(p, 0, sizeof *p);
    p->mode = mode;
    p->emax = emax;
    p->has_ts = has_ts;
    p->toward_zero = toward_zero != 0;
    p->max_element = max_element;
    p->ts = ts;
    p->rts = has_ts ? 1.0f / ts : 1.0f;
    p->even_inc = 1u << (22 - man_bits);
    p->max_bits = mb;
    p->lo = (uint32_t)(emin + 127) << 23;
    p->hi = (uint32_t)(emax + 1 + 127) << 23;
    p->add = ((uint32_t)(23 - man_bits) << 23) | (1u << 22);
    p->keep_mask = ~((1u << (23 - man_bits)) - 1u);
    p->min_normal_bits = p->lo;
    p->up = bits_f32((uint32_t)(man_bits - emin + 127) << 23);
    p->down = bits_f32((uint32_t)(emin - man_bits + 127) << 23);
    p->emin = emin;
    p->man = man_bits;
    return 0;
}

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

#define GROUP 16 /* blocks whose scales are computed together */

/* block_scale for g blocks at once, in loops gcc vectorizes across blocks (integer selects only; dividing by 1
 * and multiplying by 1 are exact, so one loop serves NVFP4 with and without a tensor scale). */
static inline __attribute__((always_inline, unused)) void block_scales(const uint32_t *am, int g, const mxparams *p,
                                                                       float *sc, float *mu, float *dq) {
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

/* One element to nearest (ties to even) or toward zero: fl32(x * mult), saturated at +-max_element, rounded to
 * the grid, the sign kept; a NaN stays a (quiet) NaN. */
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

/* ------------------------------------------------------------------------------------------ stochastic rounding */
/* The primary bytes of stream positions [first, first + count) of the stream `key` (philox.h's layout), through
 * whole 1024-element groups (mixprec.core.philox.stream_bytes gives the same bytes). */
static inline void mx_philox_fill(uint64_t key, uint64_t first, int64_t count, uint8_t *out) {
    uint8_t tmp[1024];
    const uint64_t end = first + (uint64_t)count;
    uint64_t e = first;
    while (e < end) {
        const uint64_t base = e & ~(uint64_t)1023;
        const uint64_t lo = e - base, hi = end - base < 1024 ? end - base : 1024;
        if (lo == 0 && hi == 1024) {
            mixprec_philox_bytes1024(key, base >> 8, out + (e - first));
        } else {
            mixprec_philox_bytes1024(key, base >> 8, tmp);
            memcpy(out + (e - first), tmp + lo, (size_t)(hi - lo));
        }
        e = base + hi;
    }
}

/* Stochastic rounding (round_elements' torch code): v = fl32(x * mult) clamped to +-max_element, the grid spacing
 * 2**(max(E(|v|), emin) - man), steps = |v| / spacing (exact), low = floor(steps), and up with probability
 * frac = steps - low by mixprec.core.philox.round_up: s = 256 frac, f8 = floor(s); up when the primary byte
 * u < f8; on a tie (u == f8) when the secondary word of the element's position is below (s - f8) 2**32. sr_span's
 * vector loop flags the ties (about 1 in 256) and sr_tie settles each. */
/* The element of a tie, decided by the secondary word of stream position e. */
static inline uint32_t sr_tie(uint32_t xb, float mult, const mxparams *p, uint64_t key, uint64_t e) {
    const uint32_t vb = f32_bits(bits_f32(xb) * mult);
    const uint32_t sign = vb & 0x80000000u, a = vb & 0x7FFFFFFFu;
    const uint32_t ac = a > p->max_bits ? p->max_bits : a;
    int32_t ex = (int32_t)(ac >> 23) - 127;
    ex = ex < p->emin ? p->emin : ex;
    ex -= p->man;
    const float spacing = bits_f32((uint32_t)(ex + 127) << 23), inv = bits_f32((uint32_t)(127 - ex) << 23);
    const float steps = bits_f32(ac) * inv;
    const float low = __builtin_floorf(steps);
    const float s = (steps - low) * 256.0f, f8 = __builtin_floorf(s);
    const int up = (double)mixprec_philox_tie_word(key, e) < (double)(s - f8) * 0x1p32;
    return sign | f32_bits((low + (float)up) * spacing);
}

/* Stochastic rounding of n elements (fp32 bits x) into r, primary bytes u, stream positions e0 .. e0 + n - 1:
 * the arithmetic above on 16 lanes (AVX-512; gcc left the plain loop scalar: its uint8 bytes set the vector
 * length) or element by element, ties flagged, then sr_tie for each tie. */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
static __attribute__((noinline, unused)) void sr_span(const uint32_t *restrict x, int64_t n, float mult,
                                                      const mxparams *p,
                                            const uint8_t *restrict u, uint64_t key, uint64_t e0,
                                            uint32_t *restrict r) {
    const uint32_t max_bits = p->max_bits;
    const int32_t emin = p->emin, man = p->man;
    int64_t i = 0;
#if defined(__AVX512F__)
    {
        const __m512 mv = _mm512_set1_ps(mult), one = _mm512_set1_ps(1.0f), c256 = _mm512_set1_ps(256.0f);
        const __m512i maxv = _mm512_set1_epi32((int)max_bits), sgn = _mm512_set1_epi32((int)0x80000000u);
        const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
        const __m512i quiet = _mm512_set1_epi32(0x00400000), c127 = _mm512_set1_epi32(127);
        const __m512i eminv = _mm512_set1_epi32(emin), manv = _mm512_set1_epi32(man);
        for (; i + 16 <= n; i += 16) {
            const __m512i vb = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps((const float *)(x + i)), mv));
            const __m512i sign = _mm512_and_si512(vb, sgn), a = _mm512_and_si512(vb, absm);
            const __m512i ac = _mm512_min_epu32(a, maxv);
            __m512i ex = _mm512_sub_epi32(_mm512_srli_epi32(ac, 23), c127);
            ex = _mm512_sub_epi32(_mm512_max_epi32(ex, eminv), manv);
            const __m512 spacing = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ex, c127), 23));
            const __m512 inv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(c127, ex), 23));
            const __m512 steps = _mm512_mul_ps(_mm512_castsi512_ps(ac), inv);
            const __m512 low = _mm512_roundscale_ps(steps, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m512 s = _mm512_mul_ps(_mm512_sub_ps(steps, low), c256);
            const __m512 f8 = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m512 uf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + i))));
            const __mmask16 up = _mm512_cmp_ps_mask(uf, f8, _CMP_LT_OQ), tie = _mm512_cmp_ps_mask(uf, f8, _CMP_EQ_OQ);
            const __m512 q = _mm512_mask_add_ps(low, up, low, one);
            __m512i rr = _mm512_or_si512(sign, _mm512_castps_si512(_mm512_mul_ps(q, spacing)));
            rr = _mm512_mask_mov_epi32(rr, _mm512_cmpgt_epu32_mask(a, inf), _mm512_or_si512(vb, quiet));
            _mm512_storeu_si512((void *)(r + i), rr);
            for (uint32_t t = tie; t; t &= t - 1) {
                const int64_t k = i + __builtin_ctz(t);
                r[k] = sr_tie(x[k], mult, p, key, e0 + (uint64_t)k);
            }
        }
    }
#endif
    for (; i < n; i++) {
        const uint32_t vb = f32_bits(bits_f32(x[i]) * mult);
        const uint32_t sign = vb & 0x80000000u, a = vb & 0x7FFFFFFFu;
        const uint32_t ac = a > max_bits ? max_bits : a;
        int32_t ex = (int32_t)(ac >> 23) - 127;
        ex = (ex < emin ? emin : ex) - man;
        const float spacing = bits_f32((uint32_t)(ex + 127) << 23), inv = bits_f32((uint32_t)(127 - ex) << 23);
        const float steps = bits_f32(ac) * inv;
        const float low = __builtin_floorf(steps);
        const float s = (steps - low) * 256.0f, f8 = __builtin_floorf(s);
        const float uf = (float)(int32_t)u[i];
        const float q = low + (uf < f8 ? 1.0f : 0.0f);
        r[i] = a > 0x7F800000u ? (vb | 0x00400000u) : (sign | f32_bits(q * spacing));
        if (uf == f8) r[i] = sr_tie(x[i], mult, p, key, e0 + (uint64_t)i);
    }
}
#endif
