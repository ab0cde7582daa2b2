/* The block-scaled gradient wire (mixprec.compress.BlockScaledWire): encode rows of fp32/bf16/fp16 values (plus an
 * optional error-feedback residual) into its byte layout, and decode (or sum) encoded rows, in one pass each.
 *
 * Row layout (docs/compress.md): NVFP4 first one fp32 power-of-two scale per chunk, then one scale byte per block
 * (E8M0, or E4M3 for NVFP4), then the element codes (a byte each for fp8, two per byte for e2m1, element 2i in the
 * low nibble). Per block the encoder does what the wire's torch path does with mixprec.core.mx (its oracle, kept
 * as the fallback): a block holding NaN/Inf is flagged (the NaN scale byte, zero codes) and counted; NVFP4 scales a
 * chunk by 2**k with its finite amax * 2**k in (1344, 2688] (the fp64 rule of _chunk_exponents); the block scale and
 * the elements are mx.h's (round to nearest even, or stochastic at Philox stream position
 * offset + row * pos_stride + column); an element whose decoded value would overflow to inf steps one grid value
 * down (the wire's _saturate_). With a residual, the value encoded is fl32(x + residual) and the residual of every
 * finite block becomes fl32(value - decoded), what the quantization lost (error feedback; a flagged block keeps
 * its residual: the collectives clear all residuals after a flagged result). Decoding multiplies element and
 * scale values from the caller's tables (the wire's torch tables) in the torch path's order; summing adds the
 * decoded rows in row order in fp32. Work is split over rows and tiles of WIRE_TILE elements with OpenMP.
 */
/* gcc's cost model for some CPUs (AMD Zen 4) picks 256-bit vectors; these loops are compute-bound */
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "mx.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define WIRE_TILE 2048 /* elements of one row handled together: their values, codes and bytes stay in L1 */

typedef struct {
    mxparams p;
    int block, bits, nv, man, bias;
    int64_t chunk, length, nb, header;
    uint32_t elem_min_normal; /* the element grid's smallest normal, fp32 bits */
    float sub_mult;           /* 2**(bias - 1 + man): a subnormal grid value times this is its code */
    uint8_t nan_code;
    int src_f32;
} wire_t;

/* What code_of needs, in registers (a code store may alias a struct field: the loops take these by value). */
typedef struct {
    uint32_t shift, off, min_normal, sign_shift;
    float sub_mult;
} codec_t;

static inline codec_t codec_of(const wire_t *w) {
    codec_t c = {(uint32_t)(23 - w->man), (uint32_t)(127 - w->bias) << w->man, w->elem_min_normal,
                 (uint32_t)(w->bits - 1), w->sub_mult};
    return c;
}

/* The code of a grid value (fp32 bits): sign in the top bit of the code, then the exponent and fraction fields. */
static inline __attribute__((always_inline)) uint32_t code_of(uint32_t rb, const codec_t c) {
    const uint32_t a = rb & 0x7FFFFFFFu, sign = rb >> 31;
    const uint32_t normal = (a >> c.shift) - c.off;
    const uint32_t sub = (uint32_t)(int32_t)(bits_f32(a) * c.sub_mult);
    return (a < c.min_normal ? sub : normal) | (sign << c.sign_shift);
}

#if defined(__AVX512F__)
/* The codes of 16 grid values (fp32 bits with their signs) into out (bytes, or nibble pairs). */
static inline __attribute__((always_inline)) void store_codes16(__m512i rr, const codec_t cd, uint8_t *out,
                                                                int nibbles) {
    const __m512i rb = _mm512_and_si512(rr, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i normal = _mm512_sub_epi32(_mm512_srlv_epi32(rb, _mm512_set1_epi32((int)cd.shift)),
                                            _mm512_set1_epi32((int)cd.off));
    const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(rb), _mm512_set1_ps(cd.sub_mult)));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(rb, _mm512_set1_epi32((int)cd.min_normal)),
                                           normal, sub);
    code = _mm512_or_si512(code, _mm512_sllv_epi32(_mm512_srli_epi32(rr, 31), _mm512_set1_epi32((int)cd.sign_shift)));
    if (nibbles)
        _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
    else
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(code));
}

/* element() for 16 finite values x (a block without NaN/Inf), to nearest: the magnitude rounded by the magic
 * constant, the sign put back; returns the grid values (fp32 bits). */
static inline __attribute__((always_inline)) __m512i nearest16(const uint32_t *x, float mult, const mxparams *q) {
    const __m512i vb = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps((const float *)x), _mm512_set1_ps(mult)));
    const __m512i a = _mm512_and_si512(vb, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i ac = _mm512_min_epu32(a, _mm512_set1_epi32((int)q->max_bits));
    __m512i c = _mm512_and_si512(ac, _mm512_set1_epi32(0x7F800000));
    c = _mm512_min_epu32(_mm512_max_epu32(c, _mm512_set1_epi32((int)q->lo)), _mm512_set1_epi32((int)q->hi));
    const __m512 m = _mm512_castsi512_ps(_mm512_add_epi32(c, _mm512_set1_epi32((int)q->add)));
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(ac), m), m);
    return _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(vb, _mm512_set1_epi32((int)0x80000000u)));
}

/* What nearest_codes16 needs, per call: the grid's rebias, its rounding shift and its subnormal magic. */
typedef struct {
    __m512i max_bits, rebias, half, one, min_normal, magic_bits, absm, keep;
    __m512 magic;
    uint32_t shift, sign_shift;
} rne_t;

static inline rne_t rne_of(const wire_t *w) {
    const int man = w->man, bias = w->bias;
    rne_t k;
    k.max_bits = _mm512_set1_epi32((int)w->p.max_bits);
    k.rebias = _mm512_set1_epi32((int)((uint32_t)(127 - bias) << 23));
    k.half = _mm512_set1_epi32((int)((1u << (22 - man)) - 1u));
    k.one = _mm512_set1_epi32(1);
    k.min_normal = _mm512_set1_epi32((int)w->elem_min_normal);
    /* 2**(1 - bias - man + 23): below the grid's smallest normal, |v| + magic rounds |v| to a multiple of the
     * subnormal spacing (ties to even, the fp32 add) and the low bits of the sum are the code */
    const uint32_t mb = (uint32_t)(1 - bias - man + 23 + 127) << 23;
    k.magic_bits = _mm512_set1_epi32((int)mb);
    k.magic = _mm512_castsi512_ps(k.magic_bits);
    k.absm = _mm512_set1_epi32(0x7FFFFFFF);
    k.keep = _mm512_set1_epi32((int)~((1u << (23 - man)) - 1u));
    k.shift = (uint32_t)(23 - man);
    k.sign_shift = (uint32_t)(w->bits - 1);
    return k;
}

/* code_of(element(x, mult)) for 16 finite values x, to nearest, without the grid value: v = fl32(x * mult)
 * saturated at max_bits (a grid value), then round to nearest even on the bits: above the grid's smallest normal
 * the fp32 bits rebiased, plus half an element ulp less one plus the kept lsb, shifted down (a carry into the
 * exponent is the next binade's code); below it the magic add. Returns the codes (sign included), one a lane. */
static inline __attribute__((always_inline)) __m512i nearest_codes16(__m512 xv, __m512 mult, const rne_t *k) {
    const __m512i vb = _mm512_castps_si512(_mm512_mul_ps(xv, mult));
    const __m512i ac = _mm512_min_epu32(_mm512_and_si512(vb, k->absm), k->max_bits);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ac, (unsigned)k->shift), k->one);
    const __m512i t = _mm512_add_epi32(_mm512_sub_epi32(ac, k->rebias), _mm512_add_epi32(k->half, lsb));
    __m512i code = _mm512_srli_epi32(t, (unsigned)k->shift);
    const __mmask16 small = _mm512_cmplt_epu32_mask(ac, k->min_normal);
    const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(ac), k->magic)),
                                         k->magic_bits);
    code = _mm512_mask_mov_epi32(code, small, sub);
    return _mm512_or_si512(code, _mm512_slli_epi32(_mm512_srli_epi32(vb, 31), (unsigned)k->sign_shift));
}

/* nearest_codes16 for error feedback: also the grid values (the rounded |v| has the same bits above the grid's
 * smallest normal, with the fraction bits past the grid's cleared; the magic sum less the magic below it), and
 * into res the value val (xv before NVFP4's 2**k) less its decoded value (grid * scale, NVFP4: * the chunk's 2**-k, the decode's products). */
static inline __attribute__((always_inline)) __m512i nearest_codes_res16(__m512 xv, __m512 mult, const rne_t *k,
                                                                        __m512 val, __m512 scale, __m512 down,
                                                                        const int nv, float *res) {
    const __m512i vb = _mm512_castps_si512(_mm512_mul_ps(xv, mult));
    const __m512i ac = _mm512_min_epu32(_mm512_and_si512(vb, k->absm), k->max_bits);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ac, (unsigned)k->shift), k->one);
    const __m512i up = _mm512_add_epi32(ac, _mm512_add_epi32(k->half, lsb));
    __m512i code = _mm512_srli_epi32(_mm512_sub_epi32(up, k->rebias), (unsigned)k->shift);
    __m512i grid = _mm512_and_si512(up, k->keep);
    const __mmask16 small = _mm512_cmplt_epu32_mask(ac, k->min_normal);
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(ac), k->magic);
    code = _mm512_mask_sub_epi32(code, small, _mm512_castps_si512(sum), k->magic_bits);
    grid = _mm512_mask_mov_epi32(grid, small, _mm512_castps_si512(_mm512_sub_ps(sum, k->magic)));
    const __m512i sign = _mm512_and_si512(vb, _mm512_set1_epi32((int)0x80000000u));
    __m512 dec = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(grid, sign)), scale);
    if (nv) dec = _mm512_mul_ps(dec, down);
    _mm512_storeu_ps(res, _mm512_sub_ps(val, dec));
    return _mm512_or_si512(code, _mm512_slli_epi32(_mm512_srli_epi32(vb, 31), (unsigned)k->sign_shift));
}

/* 16 codes (one a lane) into out: bytes, or nibble pairs (element 2i in the low nibble). */
static inline __attribute__((always_inline)) void put_codes16(__m512i code, uint8_t *out, int nibbles) {
    if (nibbles)
        _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28))));
    else
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(code));
}

/* The codes of a tile's nbt full blocks of x, every one finite and none at risk of overflow when decoded, to
 * nearest: block j scaled by mult[j] (NVFP4, nv: the values times the chunk's 2**k first, as the torch path). */
static inline __attribute__((always_inline)) void nearest_blocks(const uint32_t *x, int nbt, const int B,
                                                                 const float *mult, float up, const int nv,
                                                                 const rne_t *k, uint8_t *codes, const int bits8,
                                                                 const float *scale, float down, float *res) {
    const __m512 upv = _mm512_set1_ps(up), dnv = _mm512_set1_ps(down);
    for (int j = 0; j < nbt; j++) {
        const __m512 mv = _mm512_set1_ps(mult[j]);
        for (int i = 0; i < B; i += 16) {
            const int64_t e = (int64_t)j * B + i;
            const __m512 xv = _mm512_loadu_ps((const float *)(x + e));
            const __m512 xs = nv ? _mm512_mul_ps(xv, upv) : xv;
            const __m512i code = res ? nearest_codes_res16(xs, mv, k, xv, _mm512_set1_ps(scale[j]), dnv, nv, res + e)
                                     : nearest_codes16(xs, mv, k);
            put_codes16(code, codes + (bits8 ? e : e / 2), !bits8);
        }
    }
}

/* sr_span's arithmetic for 16 finite values x with primary bytes u at stream positions e0 .. e0 + 15, the ties
 * (about 1 in 256) settled by sr_tie; returns the grid values (fp32 bits). */
static inline __attribute__((always_inline)) __m512i stochastic16(const uint32_t *x, float mult, const mxparams *q,
                                                                  const uint8_t *u, uint64_t key, uint64_t e0) {
    const __m512i vb = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps((const float *)x), _mm512_set1_ps(mult)));
    const __m512i sign = _mm512_and_si512(vb, _mm512_set1_epi32((int)0x80000000u));
    const __m512i ac = _mm512_min_epu32(_mm512_and_si512(vb, _mm512_set1_epi32(0x7FFFFFFF)),
                                        _mm512_set1_epi32((int)q->max_bits));
    const __m512i c127 = _mm512_set1_epi32(127);
    __m512i ex = _mm512_sub_epi32(_mm512_srli_epi32(ac, 23), c127);
    ex = _mm512_sub_epi32(_mm512_max_epi32(ex, _mm512_set1_epi32(q->emin)), _mm512_set1_epi32(q->man));
    const __m512 spacing = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ex, c127), 23));
    const __m512 inv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(c127, ex), 23));
    const __m512 steps = _mm512_mul_ps(_mm512_castsi512_ps(ac), inv);
    const __m512 low = _mm512_roundscale_ps(steps, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 s = _mm512_mul_ps(_mm512_sub_ps(steps, low), _mm512_set1_ps(256.0f));
    const __m512 f8 = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 uf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
    const __mmask16 up = _mm512_cmp_ps_mask(uf, f8, _CMP_LT_OQ), tie = _mm512_cmp_ps_mask(uf, f8, _CMP_EQ_OQ);
    const __m512 qv = _mm512_mask_add_ps(low, up, low, _mm512_set1_ps(1.0f));
    __m512i rr = _mm512_or_si512(sign, _mm512_castps_si512(_mm512_mul_ps(qv, spacing)));
    if (tie) {
        uint32_t t[16];
        _mm512_storeu_si512((void *)t, rr);
        for (uint32_t m = tie; m; m &= m - 1) {
            const int k = __builtin_ctz(m);
            t[k] = sr_tie(x[k], mult, q, key, e0 + (uint64_t)k);
        }
        rr = _mm512_loadu_si512((const void *)t);
    }
    return rr;
}

/* nearest_blocks' loop for stochastic rounding: block j's codes by stochastic16 with mult[j], primary bytes u and
 * stream positions e0 + element (NVFP4: the values times the chunk's 2**k first); out of line, where it leaves
 * the registers of encode_unit's nearest loops alone (inlined, it cost NVFP4 nearest ~10%). */
static __attribute__((noinline)) void stochastic_blocks(const uint32_t *x, int nbt, const int B, const float *mult,
                                                        float up, const int nv, const mxparams *q, const codec_t cd,
                                                        const uint8_t *u, uint64_t key, uint64_t e0, uint8_t *codes,
                                                        const int bits8) {
    const __m512 upv = _mm512_set1_ps(up);
    uint32_t xs[16];
    for (int j = 0; j < nbt; j++) {
        for (int i = 0; i < B; i += 16) {
            const int64_t e = (int64_t)j * B + i;
            const uint32_t *xe = x + e;
            if (nv) {
                _mm512_storeu_ps((float *)xs, _mm512_mul_ps(_mm512_loadu_ps((const float *)xe), upv));
                xe = xs;
            }
            store_codes16(stochastic16(xe, mult[j], q, u + e, key, e0 + (uint64_t)e), cd, codes + (bits8 ? e : e / 2),
                          !bits8);
        }
    }
}
#endif

/* The grid value (fp32 bits) of a non-negative code magnitude. */
static inline uint32_t value_of(uint32_t mag, const wire_t *w) {
    const uint32_t ef = mag >> w->man, frac = mag & ((1u << w->man) - 1u);
    if (ef == 0) return f32_bits((float)frac / w->sub_mult);
    return ((ef - (uint32_t)w->bias + 127u) << 23) | (frac << (23 - w->man));
}

/* NVFP4's chunk exponent: k with amax * 2**k in (1344, 2688], clamped to [-126, 126]; 0 for amax = 0 (fp64, as
 * the torch path's _chunk_exponents). */
static inline int chunk_exponent(float amax) {
    const double a = amax, top = 6.0 * 448.0;
    if (!(a > 0.0)) return 0;
    int e;
    (void)frexp(top / a, &e);
    double k = (double)e - 1.0;
    k -= (double)(a * ldexp(1.0, (int)k) > top);
    k += (double)(a * ldexp(1.0, (int)k + 1) <= top);
    k = k < -126.0 ? -126.0 : (k > 126.0 ? 126.0 : k);
    return (int)k;
}

#define LOAD_F32(v) (v)
#define LOAD_BF16(v) ((uint32_t)(v) << 16)
#define LOAD_F16(v) f32_bits(f16_to_f32(v))

/* Values [j0, j0 + n) of a row (+ residual) as fp32 bits into v, zeros up to n_pad. */
#define DEFINE_LOAD(NAME, SRC_T, LOAD)                                                                         \
    static inline void NAME(const void *src, int64_t j0, int64_t n, int64_t n_pad, const float *res,           \
                            uint32_t *v) {                                                                     \
        const SRC_T *s = (const SRC_T *)src + j0;                                                              \
        if (res) {                                                                                             \
            const float *r = res + j0;                                                                         \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) v[i] = f32_bits(bits_f32(LOAD(s[i])) + r[i]);  \
        } else {                                                                                               \
            _Pragma("omp simd") for (int64_t i = 0; i < n; i++) v[i] = LOAD(s[i]);                             \
        }                                                                                                      \
        for (int64_t i = n; i < n_pad; i++) v[i] = 0u;                                                         \
    }
DEFINE_LOAD(load_f32, uint32_t, LOAD_F32)
DEFINE_LOAD(load_bf16, uint16_t, LOAD_BF16)
DEFINE_LOAD(load_f16, uint16_t, LOAD_F16)

typedef void (*load_fn)(const void *, int64_t, int64_t, int64_t, const float *, uint32_t *);

static inline uint32_t amax_bits(const uint32_t *v, int n) {
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int i = 0; i < n; i++) {
        const uint32_t a = v[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* Encode elements [j0, j1) of one row (j0 a multiple of the block; NVFP4: of the chunk, and j1 - j0 at most one
 * chunk), in tiles. Returns the flagged blocks. */
static inline __attribute__((always_inline)) int64_t
encode_unit(const void *src, load_fn load, float *res, uint8_t *o, int64_t j0, int64_t j1, const wire_t *w,
            int stochastic, uint64_t key, uint64_t pos0, uint32_t *v, uint32_t *r, uint8_t *u, uint32_t *am,
            const int B) {
    const int direct = w->src_f32 && !res;
    const mxparams q = w->p;
    const codec_t cd = codec_of(w);
#if defined(__AVX512F__)
    const rne_t rk = rne_of(w);
#endif
    const uint8_t nan_code = w->nan_code;
    const int bits8 = w->bits == 8, nv = w->nv;
    const float max_element = q.max_element;
    int64_t n_bad = 0;
    float up = 1.0f, down = 1.0f; /* NVFP4: the chunk's 2**k and 2**-k */
    uint8_t *sbytes = o + w->header, *codes = sbytes + w->nb;
    if (nv) { /* the chunk's finite amax first: every block of it, then k */
        uint32_t cm = 0;
        int64_t i = 0;
        for (int64_t t0 = j0; t0 < j1; t0 += WIRE_TILE) {
            const int64_t n = j1 - t0 < WIRE_TILE ? j1 - t0 : WIRE_TILE, n_pad = (n + B - 1) / B * B;
            const uint32_t *xv = v;
            if (direct && n == n_pad)
                xv = (const uint32_t *)src + t0; /* fp32 without a residual: read in place */
            else
                load(src, t0, n, n_pad, res, v);
            for (int64_t b = 0; b < n_pad; b += B, i++) {
                const uint32_t m = amax_bits(xv + b, B);
                am[i] = m;
                if (m < 0x7F800000u && m > cm) cm = m;
            }
        }
        const int k = chunk_exponent(bits_f32(cm));
        up = bits_f32((uint32_t)(k + 127) << 23);
        down = bits_f32((uint32_t)(127 - k) << 23);
        memcpy(o + 4 * (j0 / w->chunk), &down, 4);
    }
    int64_t bi = 0; /* block index within the unit */
    uint32_t amx[WIRE_TILE / 2];
    float sc[WIRE_TILE / 2], mu[WIRE_TILE / 2], dq[WIRE_TILE / 2];
    for (int64_t t0 = j0; t0 < j1; t0 += WIRE_TILE) {
        const int64_t n = j1 - t0 < WIRE_TILE ? j1 - t0 : WIRE_TILE, n_pad = (n + B - 1) / B * B;
        const int nbt = (int)(n_pad / B);
        const uint32_t *xv = v;
        if (direct && n == n_pad)
            xv = (const uint32_t *)src + t0; /* fp32 without a residual: read in place */
        else
            load(src, t0, n, n_pad, res, v);
        if (stochastic) mx_philox_fill(key, pos0 + (uint64_t)t0, n_pad, u);
        /* the tile's block amaxes (NVFP4: of the values times 2**k), then their scales 16 at a time */
        for (int j = 0; j < nbt; j++)
            amx[j] = nv ? f32_bits(bits_f32(am[bi + j]) * up) : amax_bits(xv + (int64_t)j * B, B);
        int g0 = 0;
        for (; g0 + GROUP <= nbt; g0 += GROUP) /* a constant count: the loops inline without remainders */
            block_scales(amx + g0, GROUP, &q, sc + g0, mu + g0, dq + g0);
        if (g0 < nbt) block_scales(amx + g0, nbt - g0, &q, sc + g0, mu + g0, dq + g0);
#if defined(__AVX512F__)
        if (n == n_pad && !(stochastic && res) && B % 16 == 0) {
            /* the hot case, one tight loop (nearest with or without error feedback, or stochastic): every block of the tile finite, and
             * none whose decoded values could overflow (the _saturate_ step below) */
            uint32_t bad = 0;
            const float dn = nv ? down : 1.0f;
            for (int j = 0; j < nbt; j++) {
                const uint32_t a = nv ? am[bi + j] : amx[j];
                bad |= (uint32_t)(a >= 0x7F800000u) |
                       (uint32_t)((f32_bits(max_element * (sc[j] * dn)) & 0x7FFFFFFFu) == 0x7F800000u);
            }
            if (!bad) {
                uint8_t *sb = sbytes + t0 / B;
                for (int j = 0; j < nbt; j++) {
                    const uint32_t sbits = f32_bits(sc[j]);
                    sb[j] = nv ? (uint8_t)((((sbits >> 23) - 120u) << 3) | ((sbits >> 20) & 7u))
                               : (uint8_t)(sbits >= 0x00800000u ? sbits >> 23 : 0u);
                }
                uint8_t *ct = codes + (bits8 ? t0 : t0 / 2);
                float *rt = res ? res + t0 : 0; /* error feedback: the residual, rewritten in the same pass */
                if (stochastic) {
                    const uint64_t e0 = pos0 + (uint64_t)t0;
                    if (nv)
                        stochastic_blocks(xv, nbt, B, mu, up, 1, &q, cd, u, key, e0, ct, bits8);
                    else
                        stochastic_blocks(xv, nbt, B, mu, 1.0f, 0, &q, cd, u, key, e0, ct, bits8);
                } else if (rt) {
                    if (nv)
                        nearest_blocks(xv, nbt, B, mu, up, 1, &rk, ct, bits8, sc, down, rt);
                    else
                        nearest_blocks(xv, nbt, B, mu, 1.0f, 0, &rk, ct, bits8, sc, 1.0f, rt);
                } else if (nv && bits8)
                    nearest_blocks(xv, nbt, B, mu, up, 1, &rk, ct, 1, sc, down, 0);
                else if (nv)
                    nearest_blocks(xv, nbt, B, mu, up, 1, &rk, ct, 0, sc, down, 0);
                else if (bits8)
                    nearest_blocks(xv, nbt, B, mu, 1.0f, 0, &rk, ct, 1, sc, 1.0f, 0);
                else
                    nearest_blocks(xv, nbt, B, mu, 1.0f, 0, &rk, ct, 0, sc, 1.0f, 0);
                bi += nbt;
                continue;
            }
        }
#endif
        for (int j = 0; j < nbt; j++, bi++) {
            const int64_t b = (int64_t)j * B, jb = t0 + b, nb_real = n - b < B ? n - b : B;
            const uint32_t *vb = xv + b;
            uint32_t *rb = r + b;
            if ((nv ? am[bi] : amx[j]) >= 0x7F800000u) { /* NaN or Inf: flagged, zero codes, residual kept */
                n_bad++;
                sbytes[jb / B] = nan_code;
                if (bits8)
                    memset(codes + jb, 0, (size_t)nb_real);
                else
                    memset(codes + jb / 2, 0, (size_t)((nb_real + 1) / 2));
                continue;
            }
            const float scale = sc[j], mult = mu[j];
            const uint32_t sbits = f32_bits(scale);
            uint32_t xs[64]; /* NVFP4: the block's values times the chunk's 2**k (exact unless they underflow) */
            const uint32_t *x = vb;
            float eff = scale;
            if (nv) {
#pragma omp simd
                for (int i = 0; i < B; i++) xs[i] = f32_bits(bits_f32(vb[i]) * up);
                x = xs;
                eff = scale * down;
                sbytes[jb / B] = (uint8_t)((((sbits >> 23) - 120u) << 3) | ((sbits >> 20) & 7u));
            } else {
                sbytes[jb / B] = (uint8_t)(sbits >= 0x00800000u ? sbits >> 23 : 0u);
            }
            const int risky = isinf(max_element * eff); /* a decoded value could overflow: _saturate_ */
#if defined(__AVX512F__)
            if (!risky && nb_real == B && B % 16 == 0 && !stochastic && !res) { /* the hot case: codes by bits */
                for (int i = 0; i < B; i += 16)
                    put_codes16(nearest_codes16(_mm512_loadu_ps((const float *)(x + i)), _mm512_set1_ps(mult), &rk),
                                codes + (bits8 ? jb + i : (jb + i) / 2), !bits8);
                continue;
            }
            if (!risky && nb_real == B && B % 16 == 0) { /* the common case: 16 lanes, the codes straight out */
                for (int i = 0; i < B; i += 16) {
                    const uint64_t e = pos0 + (uint64_t)(jb + i);
                    const __m512i rr = stochastic ? stochastic16(x + i, mult, &q, u + b + i, key, e)
                                                  : nearest16(x + i, mult, &q);
                    store_codes16(rr, cd, codes + (bits8 ? jb + i : (jb + i) / 2), !bits8);
                    if (res) { /* value - decoded, the decode's fp32 products in order */
                        __m512 dec = _mm512_mul_ps(_mm512_castsi512_ps(rr), _mm512_set1_ps(scale));
                        if (nv) dec = _mm512_mul_ps(dec, _mm512_set1_ps(down));
                        _mm512_storeu_ps(res + jb + i, _mm512_sub_ps(_mm512_loadu_ps((const float *)(vb + i)), dec));
                    }
                }
                continue;
            }
#else
            if (bits8 && !stochastic && !risky && !res && nb_real == B) { /* the common case, one loop */
                uint8_t *c = codes + jb;
#pragma omp simd
                for (int i = 0; i < B; i++) c[i] = (uint8_t)code_of(element(x[i], mult, &q), cd);
                continue;
            }
#endif
            if (stochastic) {
                sr_span(x, B, mult, &q, u + b, key, pos0 + (uint64_t)jb, rb);
            } else {
#pragma omp simd
                for (int i = 0; i < B; i++) rb[i] = element(x[i], mult, &q);
            }
            if (risky) /* the wire's _saturate_: keep every decoded value finite */
                for (int i = 0; i < B; i++)
                    if (isinf(bits_f32(rb[i]) * eff)) {
                        const uint32_t c = code_of(rb[i], cd), sign = c >> (w->bits - 1);
                        const uint32_t mag = (c & ((1u << (w->bits - 1)) - 1u)) - 1u;
                        rb[i] = value_of(mag, w) | (sign << 31);
                    }
            if (bits8) {
                uint8_t *c = codes + jb;
                if (nb_real == B) {
#pragma omp simd
                    for (int i = 0; i < B; i++) c[i] = (uint8_t)code_of(rb[i], cd);
                } else { /* the row's last block: its codes end with the row */
                    for (int64_t i = 0; i < nb_real; i++) c[i] = (uint8_t)code_of(rb[i], cd);
                }
            } else {
                uint8_t cc[64];
#pragma omp simd
                for (int i = 0; i < B; i++) cc[i] = (uint8_t)code_of(rb[i], cd);
                for (int64_t i = nb_real; i < B; i++) cc[i] = 0;
                uint8_t *c = codes + jb / 2;
                const int64_t nbytes = (nb_real + 1) / 2;
#pragma omp simd
                for (int64_t i = 0; i < nbytes; i++) c[i] = (uint8_t)(cc[2 * i] | (cc[2 * i + 1] << 4));
            }
            if (res) { /* what this quantization lost: value - decoded, the decode's fp32 products in order */
                float *rr = res + jb;
                if (nv) {
#pragma omp simd
                    for (int64_t i = 0; i < nb_real; i++)
                        rr[i] = bits_f32(vb[i]) - (bits_f32(rb[i]) * scale) * down;
                } else {
#pragma omp simd
                    for (int64_t i = 0; i < nb_real; i++) rr[i] = bits_f32(vb[i]) - bits_f32(rb[i]) * scale;
                }
            }
        }
    }
    return n_bad;
}

#define DEFINE_ENCODE(NAME, BLOCK)                                                                             \
    static int64_t NAME(const void *src, load_fn load, float *res, uint8_t *o, int64_t j0, int64_t j1,         \
                        const wire_t *w, int stochastic, uint64_t key, uint64_t pos0, uint32_t *v, uint32_t *r,  \
                        uint8_t *u, uint32_t *am) {                                                            \
        return encode_unit(src, load, res, o, j0, j1, w, stochastic, key, pos0, v, r, u, am, BLOCK);          \
    }
DEFINE_ENCODE(encode32, 32)
DEFINE_ENCODE(encode16, 16)
DEFINE_ENCODE(encode_any, w->block)

/* Encode `rows` rows of `length` elements of src (MX_SRC_* kind, row r at src + r * src_stride elements) into out
 * (row r at out + r * out_stride bytes, the wire's encoded_nbytes(length) each). residual (fp32, row stride
 * res_stride, may be NULL): error feedback, see above. Element grid exp_bits/man_bits/max_element, scale mode,
 * block (16 or 32), bits (8 or 4 per code), chunk (NVFP4's elements per fp32 scale: mode MX_E4M3), nan_code
 * (the scale byte of a flagged block). stochastic != 0: element (r, j) at stream position
 * offset + r * pos_stride + j of the Philox stream key. Returns the flagged blocks, or -1 for bad arguments. */
int64_t mixprec_mx_wire_encode(const void *src, int src_kind, int64_t src_stride, float *residual,
                               int64_t res_stride, uint8_t *out, int64_t out_stride, int64_t rows, int64_t length,
                               int exp_bits, int man_bits, float max_element, int mode, int block, int bits,
                               int64_t chunk, int nan_code, int stochastic, uint64_t key, uint64_t offset,
                               uint64_t pos_stride, int nthreads) {
    wire_t w;
    if (src_kind < 0 || src_kind > 2 || rows < 0 || length < 0 || block < 2 || block > 64 || block % 2 ||
        (bits != 8 && bits != 4) || 1 + exp_bits + man_bits != bits || chunk < block || chunk % block ||
        nan_code < 0 || nan_code > 255 || mx_params(&w.p, exp_bits, man_bits, max_element, mode, 0, 1.0f, 0) != 0)
        return -1;
    w.block = block;
    w.bits = bits;
    w.nv = mode == MX_E4M3;
    w.man = man_bits;
    w.bias = (1 << (exp_bits - 1)) - 1;
    w.chunk = chunk;
    w.length = length;
    w.nb = (length + block - 1) / block;
    w.header = w.nv ? 4 * ((length + chunk - 1) / chunk) : 0;
    w.elem_min_normal = (uint32_t)(1 - w.bias + 127) << 23;
    w.sub_mult = bits_f32((uint32_t)(w.bias - 1 + man_bits + 127) << 23);
    w.nan_code = (uint8_t)nan_code;
    w.src_f32 = src_kind == MX_SRC_F32;
    if (rows == 0 || length == 0) return 0;
    const load_fn load = src_kind == MX_SRC_F32 ? load_f32 : (src_kind == MX_SRC_BF16 ? load_bf16 : load_f16);
    const size_t elem = src_kind == MX_SRC_F32 ? 4 : 2;
    /* units: NVFP4 chunks (the chunk scale needs the whole chunk), else tiles */
    const int64_t unit = w.nv ? chunk : WIRE_TILE;
    const int64_t per_row = (length + unit - 1) / unit, units = rows * per_row;
    int64_t n_bad = 0, failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (rows * length >= MIXPREC_GRAIN) \
    reduction(+ : n_bad, failed)
    {
        uint32_t *v = malloc(sizeof(uint32_t) * WIRE_TILE), *r = malloc(sizeof(uint32_t) * WIRE_TILE);
        uint8_t *u = malloc(WIRE_TILE);
        uint32_t *am = w.nv ? malloc(sizeof(uint32_t) * (size_t)(chunk / block + 1)) : 0;
        if (!v || !r || !u || (w.nv && !am)) {
            failed++;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < units; i++) {
                const int64_t row = i / per_row, j0 = (i % per_row) * unit;
                const int64_t j1 = j0 + unit < length ? j0 + unit : length;
                const void *s = (const char *)src + (size_t)(row * src_stride) * elem;
                float *res = residual ? residual + row * res_stride : 0;
                const uint64_t pos0 = offset + (uint64_t)row * pos_stride;
                n_bad += block == 32   ? encode32(s, load, res, out + row * out_stride, j0, j1, &w, stochastic, key,
                                                  pos0, v, r, u, am)
                         : block == 16 ? encode16(s, load, res, out + row * out_stride, j0, j1, &w, stochastic, key,
                                                  pos0, v, r, u, am)
                                       : encode_any(s, load, res, out + row * out_stride, j0, j1, &w, stochastic,
                                                    key, pos0, v, r, u, am);
            }
        }
        free(v);
        free(r);
        free(u);
        free(am);
    }
    return failed ? -2 : n_bad; /* -2: out of memory */
}

/* Decode `rows` encoded rows (row r at buf + r * buf_stride bytes) of `length` elements: each into row r of out
 * (out_kind MX_SRC_*: fp32, fp16 or bf16, row stride out_stride elements), or with reduce != 0 their fp32 sum in
 * row order into out (fp32, length elements). elem_t: the fp32 value of each element code (256, or 16 for 4-bit
 * codes) of the grid exp_bits/man_bits; scale_t: the fp32 value of each scale byte; nv: rows start with fp32
 * chunk scales (one per chunk elements). Returns the flagged blocks (scale byte nan_code) over all rows, or -1
 * for bad arguments. */
int64_t mixprec_mx_wire_decode(const uint8_t *buf, int64_t buf_stride, int64_t rows, int64_t length, void *out,
                               int out_kind, int64_t out_stride, int reduce, const float *elem_t,
                               const float *scale_t, int exp_bits, int man_bits, int block, int64_t chunk, int nv,
                               int nan_code, int nthreads) {
    const int bits = 1 + exp_bits + man_bits;
    if (exp_bits < 2 || exp_bits > 5 || man_bits < 1 || man_bits > 3 || rows < 0 || length < 0 || block < 2 ||
        block > 64 || block % 2 || (bits != 8 && bits != 4) ||
        chunk < block || chunk % block || out_kind < 0 || out_kind > 2 || (reduce && out_kind != MX_SRC_F32) ||
        nan_code < 0 || nan_code > 255)
        return -1;
    if (rows == 0 || length == 0) return 0;
    const int bias = (1 << (exp_bits - 1)) - 1;
    const struct {
        int shift;
        uint32_t adj, min_normal, special;
        float sub;
    } dc = {23 - man_bits, (uint32_t)(127 - bias) << 23, 1u << man_bits,
            /* e4m3fn: only S.1111.111 is NaN; IEEE-like grids: the top exponent is inf/NaN */
            exp_bits == 4 && man_bits == 3 ? 0x7Fu : ((1u << exp_bits) - 1u) << man_bits,
            bits_f32((uint32_t)(1 - bias - man_bits + 127) << 23)};
    const int64_t nb = (length + block - 1) / block, header = nv ? 4 * ((length + chunk - 1) / chunk) : 0;
    const int64_t tiles = (length + WIRE_TILE - 1) / WIRE_TILE, units = reduce ? tiles : rows * tiles;
    int64_t n_bad = 0;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (rows * length >= MIXPREC_GRAIN) \
    schedule(static) reduction(+ : n_bad)
    for (int64_t i = 0; i < units; i++) {
        const int64_t t = i % tiles, r0 = reduce ? 0 : i / tiles, r1 = reduce ? rows : r0 + 1;
        const int64_t j0 = t * WIRE_TILE, j1 = j0 + WIRE_TILE < length ? j0 + WIRE_TILE : length;
        float vals[WIRE_TILE];
        for (int64_t row = r0; row < r1; row++) {
            const uint8_t *o = buf + row * buf_stride, *sbytes = o + header, *codes = sbytes + nb;
            /* fp32 rows decode in place; a sum or a narrower row goes through the tile's buffer */
            const int direct = !reduce && out_kind == MX_SRC_F32;
            float *tile = direct ? (float *)out + row * out_stride + j0 : vals;
            int64_t jb = j0;
#if defined(__AVX512F__)
            if (bits == 4 && block == 16 && (j1 - j0) % 16 == 0 && (!nv || chunk % WIRE_TILE == 0)) {
                /* 4-bit codes in 16-element blocks (NVFP4): one vector a block, the tile in one chunk */
                const int64_t nbk = (j1 - j0) / 16;
                const uint8_t *sbt = sbytes + j0 / 16, *c = codes + j0 / 2;
                for (int64_t k = 0; k < nbk; k++) n_bad += sbt[k] == nan_code;
                float ts = 1.0f;
                if (nv) memcpy(&ts, o + 4 * (j0 / chunk), 4);
                const __m512 tv = _mm512_loadu_ps(elem_t), tsv = _mm512_set1_ps(ts);
                const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
                for (int64_t k = 0; k < nbk; k++) {
                    const __m128i b = _mm_loadl_epi64((const __m128i *)(c + 8 * k));
                    const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
                    const __m512 e = _mm512_permutexvar_ps(_mm512_and_si512(idx, _mm512_set1_epi32(15)), tv);
                    __m512 val = _mm512_mul_ps(e, _mm512_set1_ps(scale_t[sbt[k]]));
                    if (nv) val = _mm512_mul_ps(val, tsv);
                    _mm512_storeu_ps(tile + 16 * k, val);
                }
                jb = j1;
            }
#endif
            for (; jb < j1; jb += block) {
                const int64_t n = j1 - jb < block ? j1 - jb : block;
                const uint8_t sb = sbytes[jb / block];
                n_bad += sb == nan_code;
                const float s = scale_t[sb];
                float *d = tile + (jb - j0);
                float ts = 1.0f; /* NVFP4: the chunk's fp32 scale, applied after the block's (the torch order) */
                if (nv) memcpy(&ts, o + 4 * (jb / chunk), 4);
                int64_t k = 0;
                if (bits == 8) {
                    const uint8_t *c = codes + jb;
#if defined(__AVX512F__)
                    /* fp8 codes to fp32 by their fields (AVX-512 gathers from the table measured slower on Zen 4):
                     * normal codes shift into place, subnormal ones are mag * 2**(1 - bias - man); the codes at or
                     * above special (e5m2's inf and NaN, e4m3's NaN) are then read from the table */
                    const __m512 sv = _mm512_set1_ps(s), sub = _mm512_set1_ps(dc.sub), tsv = _mm512_set1_ps(ts);
                    const __m512i m7f = _mm512_set1_epi32(0x7F), minn = _mm512_set1_epi32((int)dc.min_normal);
                    const __m512i adj = _mm512_set1_epi32((int)dc.adj), spec = _mm512_set1_epi32((int)dc.special);
                    const __m512i sgn = _mm512_set1_epi32((int)0x80000000u);
                    for (; k + 16 <= n; k += 16) {
                        const __m512i cv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + k)));
                        const __m512i mag = _mm512_and_si512(cv, m7f);
                        __m512i bitsv = _mm512_add_epi32(_mm512_sllv_epi32(mag, _mm512_set1_epi32(dc.shift)), adj);
                        bitsv = _mm512_mask_mov_epi32(bitsv, _mm512_cmplt_epu32_mask(mag, minn),
                                                      _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), sub)));
                        bitsv = _mm512_ternarylogic_epi32(bitsv, _mm512_slli_epi32(cv, 24), sgn, 0xF8); /* | sign */
                        __m512 val = _mm512_mul_ps(_mm512_castsi512_ps(bitsv), sv);
                        const __mmask16 sp = _mm512_cmpge_epu32_mask(mag, spec);
                        if (sp) {
                            float tmp[16];
                            _mm512_storeu_ps(tmp, val);
                            for (uint32_t t = sp; t; t &= t - 1) {
                                const int q = __builtin_ctz(t);
                                tmp[q] = elem_t[c[k + q]] * s;
                            }
                            val = _mm512_loadu_ps(tmp);
                        }
                        if (nv) val = _mm512_mul_ps(val, tsv);
                        _mm512_storeu_ps(d + k, val);
                    }
#endif
                    for (int64_t q = k; q < n; q++) d[q] = elem_t[c[q]] * s;
                } else {
                    const uint8_t *c = codes + jb / 2;
#if defined(__AVX512F__)
                    /* 16 nibbles: each byte twice, the high nibble of odd lanes shifted down, looked up in-register */
                    const __m512 tv = _mm512_loadu_ps(elem_t), sv = _mm512_set1_ps(s), tsv = _mm512_set1_ps(ts);
                    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
                    for (; k + 16 <= n; k += 16) {
                        const __m128i b = _mm_loadl_epi64((const __m128i *)(c + (k >> 1)));
                        const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
                        const __m512 e = _mm512_permutexvar_ps(_mm512_and_si512(idx, _mm512_set1_epi32(15)), tv);
                        __m512 val = _mm512_mul_ps(e, sv);
                        if (nv) val = _mm512_mul_ps(val, tsv);
                        _mm512_storeu_ps(d + k, val);
                    }
#endif
                    for (int64_t q = k; q < n; q++) d[q] = elem_t[(c[q >> 1] >> (4 * (q & 1))) & 15u] * s;
                }
                if (nv) { /* the elements the vector loops left */
#pragma omp simd
                    for (int64_t q = k; q < n; q++) d[q] = d[q] * ts;
                }
            }
            const int64_t n = j1 - j0;
            if (reduce) {
                float *acc = (float *)out + j0;
                if (row == 0)
                    memcpy(acc, vals, (size_t)n * sizeof(float));
                else {
#pragma omp simd
                    for (int64_t k = 0; k < n; k++) acc[k] = acc[k] + vals[k];
                }
            } else if (out_kind == MX_SRC_BF16) {
                uint16_t *d = (uint16_t *)out + row * out_stride + j0;
                for (int64_t k = 0; k < n; k++) d[k] = f32_to_bf16(vals[k]);
            } else if (out_kind == MX_SRC_F16) {
                uint16_t *d = (uint16_t *)out + row * out_stride + j0;
                for (int64_t k = 0; k < n; k++) d[k] = f32_to_f16(vals[k]);
            } /* fp32: decoded in place */
        }
    }
    return n_bad;
}
