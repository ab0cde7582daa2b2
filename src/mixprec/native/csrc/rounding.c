/* Round to nearest (ties to even) onto a FloatFormat's grid, one pass, results as fp32 bit patterns.
 *
 * The same IEEE operations as mixprec.core.rounding's torch path, fused per element (docs/native.md):
 *   - 8 exponent bits (bf16, tf32): round the fp32 pattern itself at bit 23 - man_bits (integer add + mask);
 *   - fewer exponent bits: x + C - C with C = 1.5 * 2**(e + 23 - man_bits), e = x's exponent clamped to
 *     [emin, emax + 1] (so subnormal targets get the fixed spacing 2**(emin - man_bits)); in fp64 when
 *     man_bits > 21 (fp32 then lacks the two guard bits the trick needs);
 * then the epilogue: magnitudes above max_finite -> +-max / +-inf / NaN, results below min_normal -> signed
 * zero when the format has no subnormals, and NaN handled as the torch path leaves it. Sources: fp32, fp16
 * (widened as vcvtph2ps does) or bf16 (a shift); dst may be src itself (in place) but not overlap it otherwise.
 * mixprec_round_nearest_f64 rounds fp64 input directly (one rounding, the fp64 magic constant for every format)
 * into fp64 or fp32. mixprec_round_directed rounds toward zero or stochastically (uniforms from the caller).
 */
#include <omp.h>
#include <stdint.h>

#include "common.h"

enum { SRC_F32 = MIXPREC_F32, SRC_F16 = MIXPREC_F16, SRC_BF16 = MIXPREC_BF16 }; /* dtypes.h */
enum { ALG_INT = 0, ALG_MAGIC32 = 1, ALG_MAGIC64 = 2 };

typedef struct {
    uint32_t drop, odd_mask, half_m1, keep_mask;  /* ALG_INT */
    uint32_t lo32, hi32, add32;                   /* ALG_MAGIC32: exponent clamp and magic offset */
    uint64_t lo64, hi64, add64;                   /* ALG_MAGIC64 */
    uint32_t max_bits, ovf_bits, min_normal_bits; /* epilogue (min_normal_bits = 0: keep subnormals) */
    uint32_t nan_and, nan_or;                     /* NaN result = (input & nan_and) | nan_or */
} rparams;

static inline __attribute__((always_inline)) uint32_t round_bits(uint32_t u, const rparams *p, const int alg) {
    const uint32_t s = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    uint32_t ra;
    if (alg == ALG_INT) {
        /* a <= 0x7F800000 for non-NaN, so the carry of a tie rounded up stays below the sign bit; inf has zero
         * low bits and is masked back to itself */
        ra = (a + (((a >> p->drop) & p->odd_mask) + p->half_m1)) & p->keep_mask;
    } else if (alg == ALG_MAGIC32) {
        uint32_t c = u & 0x7F800000u;
        c = c < p->lo32 ? p->lo32 : c;
        c = c > p->hi32 ? p->hi32 : c;
        const float m = bits_f32(c + p->add32);
        const float r = (bits_f32(u) + m) - m; /* -ffp-contract=off: two roundings, as in the torch path */
        ra = f32_bits(r) & 0x7FFFFFFFu;
    } else {
        const double d = (double)bits_f32(u);
        uint64_t c = f64_bits(d) & 0x7FF0000000000000ull;
        c = c < p->lo64 ? p->lo64 : c;
        c = c > p->hi64 ? p->hi64 : c;
        const double m = bits_f64(c + p->add64);
        /* on the grid: exact in fp32 below 2**(emax + 2) (man_bits <= 23, |e| < 64), else above max anyway */
        ra = f32_bits((float)((d + m) - m)) & 0x7FFFFFFFu;
    }
    ra = ra > p->max_bits ? p->ovf_bits : ra; /* inf inputs included: inf > max_bits */
    ra = ra < p->min_normal_bits ? 0u : ra;   /* tininess after rounding; x * 0 keeps the sign in torch too */
    return a > 0x7F800000u ? ((u & p->nan_and) | p->nan_or) : (s | ra);
}

/* fp16 -> fp32 exactly, NaN quieted with its payload kept (what vcvtph2ps, torch's vectorized cast, gives).
 * Bitwise blends rather than ?: so that gcc if-converts and vectorizes the loop. */
static inline __attribute__((always_inline)) uint32_t widen_f16(uint16_t h) {
    const uint32_t x = h;
    const uint32_t s = (x & 0x8000u) << 16, em = x & 0x7FFFu;
    const uint32_t normal = (em << 13) + (112u << 23); /* rebias 15 -> 127 */
    const uint32_t special = ((em << 13) + (224u << 23)) | ((uint32_t)(em > 0x7C00u) << 22);
    const uint32_t sub = f32_bits((float)(int32_t)em * 0x1p-24f); /* em * 2**-24: exact, an fp32 normal */
    const uint32_t is_sub = 0u - (uint32_t)(em < 0x0400u), is_special = 0u - (uint32_t)(em >= 0x7C00u);
    return s | (sub & is_sub) | (special & is_special) | (normal & ~(is_sub | is_special));
}

#define DEFINE_LOOP(NAME, SRC_T, LOAD, ALG)                                                             \
    static void NAME(const void *src_, uint32_t *dst, int64_t n, const rparams *pp) {                   \
        const SRC_T *src = (const SRC_T *)src_;                                                         \
        const rparams p = *pp;                                                                          \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) dst[i] = round_bits(LOAD(src[i]), &p, ALG); \
    }
#define LOAD_F32(v) (v)
#define LOAD_BF16(v) ((uint32_t)(v) << 16)
#define LOAD_F16(v) widen_f16(v)
DEFINE_LOOP(loop_f32_int, uint32_t, LOAD_F32, ALG_INT)
DEFINE_LOOP(loop_f32_m32, uint32_t, LOAD_F32, ALG_MAGIC32)
DEFINE_LOOP(loop_f32_m64, uint32_t, LOAD_F32, ALG_MAGIC64)
DEFINE_LOOP(loop_f16_int, uint16_t, LOAD_F16, ALG_INT)
DEFINE_LOOP(loop_f16_m32, uint16_t, LOAD_F16, ALG_MAGIC32)
DEFINE_LOOP(loop_f16_m64, uint16_t, LOAD_F16, ALG_MAGIC64)
DEFINE_LOOP(loop_bf16_int, uint16_t, LOAD_BF16, ALG_INT)
DEFINE_LOOP(loop_bf16_m32, uint16_t, LOAD_BF16, ALG_MAGIC32)
DEFINE_LOOP(loop_bf16_m64, uint16_t, LOAD_BF16, ALG_MAGIC64)

typedef void (*loop_fn)(const void *, uint32_t *, int64_t, const rparams *);
static const loop_fn LOOPS[3][3] = {
    {loop_f32_int, loop_f32_m32, loop_f32_m64},
    {loop_f16_int, loop_f16_m32, loop_f16_m64},
    {loop_bf16_int, loop_bf16_m32, loop_bf16_m64},
};

/* Round n elements of src (kind SRC_*) to the format (exp_bits, man_bits, has_inf, saturate, subnormals) into the
 * fp32 array dst. Returns 0, or -1 for arguments outside what FloatFormat allows. */
int mixprec_round_nearest(const void *src, int src_kind, float *dst, int64_t n, int exp_bits, int man_bits,
                          int has_inf, int saturate, int subnormals, int nthreads) {
    if (src_kind < 0 || src_kind > 2 || exp_bits < 2 || exp_bits > 8 || man_bits < 1 || man_bits > 23 ||
        (exp_bits == 8 && !has_inf) || n < 0)
        return -1;
    const int bias = (1 << (exp_bits - 1)) - 1, emin = 1 - bias;
    const int emax = has_inf ? bias : (1 << exp_bits) - 1 - bias;
    const uint32_t drop = 23u - (uint32_t)man_bits;
    const uint32_t top_frac = has_inf ? (1u << man_bits) - 1u : (1u << man_bits) - 2u; /* fn: all-ones is NaN */
    rparams p = {0};
    int alg;
    if (exp_bits == 8) {
        alg = ALG_INT;
        p.drop = drop;
        p.odd_mask = drop ? 1u : 0u;
        p.half_m1 = drop ? (1u << (drop - 1)) - 1u : 0u;
        p.keep_mask = 0x7FFFFFFFu & ~((1u << drop) - 1u);
    } else if (man_bits <= 21) {
        alg = ALG_MAGIC32;
        p.lo32 = (uint32_t)(emin + 127) << 23;
        p.hi32 = (uint32_t)(emax + 1 + 127) << 23;
        p.add32 = (drop << 23) | (1u << 22);
    } else {
        alg = ALG_MAGIC64;
        p.lo64 = (uint64_t)(emin + 1023) << 52;
        p.hi64 = (uint64_t)(emax + 1 + 1023) << 52;
        p.add64 = ((uint64_t)(52 - man_bits) << 52) | (1ull << 51);
    }
    p.max_bits = ((uint32_t)(emax + 127) << 23) | (top_frac << drop);
    p.ovf_bits = saturate ? p.max_bits : (has_inf ? 0x7F800000u : 0x7FC00000u);
    p.min_normal_bits = subnormals ? 0u : (uint32_t)(emin + 127) << 23;
    /* NaN as the torch path leaves it: the integer trick writes the default NaN back; with nothing to round
     * (8 exponent, 23 fraction bits) the input NaN survives a clamp but is quieted by the flush's multiply;
     * the additions (and the fp64 round trip) quiet it, keeping sign and payload */
    if (exp_bits == 8 && drop) {
        p.nan_and = 0u;
        p.nan_or = 0x7FC00000u;
    } else {
        p.nan_and = 0xFFFFFFFFu;
        p.nan_or = (exp_bits == 8 && subnormals) ? 0u : 0x00400000u;
    }
    const loop_fn fn = LOOPS[src_kind][alg];
    const int64_t elem = src_kind == SRC_F32 ? 4 : 2;
    const char *s = (const char *)src;
    uint32_t *d = (uint32_t *)dst;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (n >= MIXPREC_GRAIN)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* contiguous slices of whole 64-byte lines of dst: no false sharing between threads */
        const int64_t per = ((n + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        if (hi > lo) fn(s + lo * elem, d + lo, hi - lo, &p);
    }
    return 0;
}

/* ---------------------------------------------------------------- fp64 input: one rounding, from fp64 */
typedef struct {
    uint64_t lo, hi, add;                      /* exponent clamp and magic offset, fp64 patterns */
    uint64_t max_bits, ovf_bits, min_normal_bits;
} rparams64;

static inline __attribute__((always_inline)) uint64_t round_bits64(uint64_t u, const rparams64 *p) {
    const uint64_t s = u & 0x8000000000000000ull, a = u & 0x7FFFFFFFFFFFFFFFull;
    uint64_t c = u & 0x7FF0000000000000ull;
    c = c < p->lo ? p->lo : c;
    c = c > p->hi ? p->hi : c;
    const double m = bits_f64(c + p->add);
    uint64_t ra = f64_bits((bits_f64(u) + m) - m) & 0x7FFFFFFFFFFFFFFFull;
    ra = ra > p->max_bits ? p->ovf_bits : ra;
    ra = ra < p->min_normal_bits ? 0u : ra;
    return a > 0x7FF0000000000000ull ? (u | 0x0008000000000000ull) : (s | ra); /* NaN quieted by the additions */
}

static void loop64_f64(const double *src, void *dst_, int64_t n, const rparams64 *pp) {
    uint64_t *dst = (uint64_t *)dst_;
    const rparams64 p = *pp;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = round_bits64(f64_bits(src[i]), &p);
}

/* The rounded value is on the format's grid, so the narrowing is exact; NaN narrows as torch's cast does. */
static void loop64_f32(const double *src, void *dst_, int64_t n, const rparams64 *pp) {
    float *dst = (float *)dst_;
    const rparams64 p = *pp;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = (float)bits_f64(round_bits64(f64_bits(src[i]), &p));
}

/* A format's fp64 patterns: 2**emin and 2**(emax + 1) (the exponent clamp), max_finite, what overflow gives
 * (+-max, inf or NaN), and the flush threshold (0: subnormals kept). Returns 0, or -1 for arguments outside
 * what FloatFormat allows. */
typedef struct {
    uint64_t lo, hi, max_bits, ovf_bits, min_bits;
} fmt64_t;

static int fmt64_of(int exp_bits, int man_bits, int has_inf, int saturate, int subnormals, fmt64_t *f) {
    if (exp_bits < 2 || exp_bits > 8 || man_bits < 1 || man_bits > 23 || (exp_bits == 8 && !has_inf)) return -1;
    const int bias = (1 << (exp_bits - 1)) - 1, emin = 1 - bias;
    const int emax = has_inf ? bias : (1 << exp_bits) - 1 - bias;
    const uint64_t top_frac = has_inf ? (1ull << man_bits) - 1u : (1ull << man_bits) - 2u;
    f->lo = (uint64_t)(emin + 1023) << 52;
    f->hi = (uint64_t)(emax + 1 + 1023) << 52;
    f->max_bits = ((uint64_t)(emax + 1023) << 52) | (top_frac << (52 - man_bits));
    f->ovf_bits = saturate ? f->max_bits : (has_inf ? 0x7FF0000000000000ull : 0x7FF8000000000000ull);
    f->min_bits = subnormals ? 0u : f->lo;
    return 0;
}

/* Round n fp64 values to the format into dst: fp64 (dst_f64 != 0; may be src itself) or fp32. Returns 0, or -1
 * for arguments outside what FloatFormat allows. */
int mixprec_round_nearest_f64(const double *src, void *dst, int dst_f64, int64_t n, int exp_bits, int man_bits,
                              int has_inf, int saturate, int subnormals, int nthreads) {
    fmt64_t f;
    if (fmt64_of(exp_bits, man_bits, has_inf, saturate, subnormals, &f) || n < 0) return -1;
    rparams64 p;
    p.lo = f.lo;
    p.hi = f.hi;
    p.add = ((uint64_t)(52 - man_bits) << 52) | (1ull << 51);
    p.max_bits = f.max_bits;
    p.ovf_bits = f.ovf_bits;
    p.min_normal_bits = f.min_bits;
    const int64_t esize = dst_f64 ? 8 : 4;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (n >= MIXPREC_GRAIN)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = ((n + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        if (hi > lo) {
            if (dst_f64)
                loop64_f64(src + lo, (char *)dst + lo * esize, hi - lo, &p);
            else
                loop64_f32(src + lo, (char *)dst + lo * esize, hi - lo, &p);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- toward zero and stochastic, in fp64
 * mixprec.core.rounding.round_directed_'s arithmetic per element: the spacing s = 2**(e - man_bits) at x's
 * exponent e clamped to [emin, emax + 1], the truncation t = floor(|x| / s) s (the torch path rounds to nearest
 * and steps back a spacing where that rounded away: the same value wherever the result can be finite), then
 * toward zero t (finite inputs above max -> max), or stochastic t + s when u < (|x| - t) / s with u the torch
 * path's own fp64 uniform, drawn by the caller; x's sign; overflow and flushing as the torch path does them.
 * Dividing by s and multiplying by 1 / s are both exact. NaN in gives NaN out (its payload is not kept). */
typedef struct {
    uint64_t lo, hi, man;                /* exponent clamp (fp64 patterns of 2**emin, 2**(emax + 1)); man_bits << 52 */
    uint64_t max_bits, ovf_bits, min_bits; /* above max -> ovf (+-max, inf or NaN); below min_bits (0: none) -> 0 */
} dparams;

/* On bit patterns and integer compares, which directed8 repeats lane for lane: non-negative doubles order as
 * their patterns, and NaN patterns lie above inf's (INF below). */
#define INF 0x7FF0000000000000ull
static inline __attribute__((always_inline)) uint64_t directed_one(double x, double u, const int stochastic,
                                                                   const dparams *p) {
    const uint64_t xb = f64_bits(x), sign = xb & 0x8000000000000000ull, ab = xb & ~0x8000000000000000ull;
    uint64_t c = xb & INF;
    c = c < p->lo ? p->lo : c;
    c = c > p->hi ? p->hi : c;
    const uint64_t e = c - p->man;
    const double sp = bits_f64(e), inv = bits_f64(0x7FE0000000000000ull - e); /* 2**k and 2**-k */
    const double a = bits_f64(ab), y = a * inv;
    const uint64_t yb = f64_bits(y), big = 0x4330000000000000ull; /* 2**52: from there on y is an integer */
    const double fl = yb < big ? (double)(int64_t)bits_f64(yb < big ? yb : big) : y; /* floor; NaN, inf pass */
    const double t = fl * sp;
    uint64_t rb = f64_bits(t);
    if (stochastic) {
        /* frac is NaN exactly where t is inf or NaN, which adding the spacing leaves as they are */
        const uint64_t fb = f64_bits((a - t) * inv), ub = f64_bits(u);
        rb = f64_bits(t + bits_f64(ub < fb ? e : 0));
    } else {
        rb = ab < INF && rb > p->max_bits ? p->max_bits : rb; /* finite inputs above max -> max */
    }
    rb = rb > p->max_bits && rb <= INF ? p->ovf_bits : rb;
    rb = rb < p->min_bits ? 0 : rb;
    return rb | sign;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
/* directed_one on 8 lanes, the same patterns, compares and operations (gcc leaves that loop scalar). */
static inline __attribute__((always_inline)) __m512i directed8(__m512d x, __m512d u, const int stochastic,
                                                               const dparams *p) {
    const __m512i signm = _mm512_set1_epi64((long long)0x8000000000000000ull), inf = _mm512_set1_epi64((long long)INF);
    const __m512i maxb = _mm512_set1_epi64((long long)p->max_bits), zero = _mm512_setzero_si512();
    const __m512i xb = _mm512_castpd_si512(x), sign = _mm512_and_si512(xb, signm), ab = _mm512_andnot_si512(signm, xb);
    __m512i c = _mm512_max_epu64(_mm512_and_si512(xb, inf), _mm512_set1_epi64((long long)p->lo));
    c = _mm512_min_epu64(c, _mm512_set1_epi64((long long)p->hi));
    const __m512i e = _mm512_sub_epi64(c, _mm512_set1_epi64((long long)p->man));
    const __m512d sp = _mm512_castsi512_pd(e);
    const __m512d inv = _mm512_castsi512_pd(_mm512_sub_epi64(_mm512_set1_epi64(0x7FE0000000000000ll), e));
    const __m512d a = _mm512_castsi512_pd(ab), y = _mm512_mul_pd(a, inv);
    const __mmask8 small = _mm512_cmplt_epu64_mask(_mm512_castpd_si512(y), _mm512_set1_epi64(0x4330000000000000ll));
    const __m512d fl = _mm512_mask_mov_pd(y, small, _mm512_cvtepi64_pd(_mm512_cvttpd_epi64(y)));
    const __m512d t = _mm512_mul_pd(fl, sp);
    __m512i rb = _mm512_castpd_si512(t);
    if (stochastic) {
        const __m512i fb = _mm512_castpd_si512(_mm512_mul_pd(_mm512_sub_pd(a, t), inv));
        const __mmask8 up = _mm512_cmplt_epu64_mask(_mm512_castpd_si512(u), fb);
        rb = _mm512_castpd_si512(_mm512_add_pd(t, _mm512_castsi512_pd(_mm512_maskz_mov_epi64(up, e))));
    } else {
        const __mmask8 over = _mm512_cmplt_epu64_mask(ab, inf) & _mm512_cmpgt_epu64_mask(rb, maxb);
        rb = _mm512_mask_mov_epi64(rb, over, maxb);
    }
    const __mmask8 ovf = _mm512_cmpgt_epu64_mask(rb, maxb) & _mm512_cmple_epu64_mask(rb, inf);
    rb = _mm512_mask_mov_epi64(rb, ovf, _mm512_set1_epi64((long long)p->ovf_bits));
    const __mmask8 tiny = _mm512_cmplt_epu64_mask(rb, _mm512_set1_epi64((long long)p->min_bits));
    return _mm512_or_si512(_mm512_mask_mov_epi64(rb, tiny, zero), sign);
}

static inline __attribute__((always_inline)) __m512d dload8(const void *src, int64_t i, const int kind) {
    if (kind == 0) return _mm512_cvtps_pd(_mm256_loadu_ps((const float *)src + i));
    if (kind == 1) return _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
    if (kind == 2)
        return _mm512_cvtps_pd(_mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16)));
    return _mm512_loadu_pd((const double *)src + i);
}
#define DIRECTED_VECTOR 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
/* directed_one on 4 lanes with AVX2 (gcc leaves that loop scalar): unsigned 64-bit compares as signed ones on
 * patterns with the top bit flipped, and floor(y) for y >= 0 as vroundpd toward zero, which also leaves
 * integers from 2**52 on, inf and NaN as they are: the scalar code's cases in one instruction. */
static inline __m256i ltu64(__m256i a, __m256i b) { /* a < b, unsigned */
    const __m256i flip = _mm256_set1_epi64x((long long)0x8000000000000000ull);
    return _mm256_cmpgt_epi64(_mm256_xor_si256(b, flip), _mm256_xor_si256(a, flip));
}

static inline __attribute__((always_inline)) __m256i directed4(__m256d x, __m256d u, const int stochastic,
                                                               const dparams *p) {
    const __m256i signm = _mm256_set1_epi64x((long long)0x8000000000000000ull);
    const __m256i inf = _mm256_set1_epi64x((long long)INF);
    const __m256i maxb = _mm256_set1_epi64x((long long)p->max_bits);
    const __m256i lo = _mm256_set1_epi64x((long long)p->lo), hi = _mm256_set1_epi64x((long long)p->hi);
    const __m256i xb = _mm256_castpd_si256(x), sign = _mm256_and_si256(xb, signm), ab = _mm256_andnot_si256(signm, xb);
    __m256i c = _mm256_and_si256(xb, inf);
    c = _mm256_blendv_epi8(c, lo, ltu64(c, lo));
    c = _mm256_blendv_epi8(c, hi, ltu64(hi, c));
    const __m256i e = _mm256_sub_epi64(c, _mm256_set1_epi64x((long long)p->man));
    const __m256d sp = _mm256_castsi256_pd(e);
    const __m256d inv = _mm256_castsi256_pd(_mm256_sub_epi64(_mm256_set1_epi64x(0x7FE0000000000000ll), e));
    const __m256d a = _mm256_castsi256_pd(ab), y = _mm256_mul_pd(a, inv);
    const __m256d t = _mm256_mul_pd(_mm256_round_pd(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), sp);
    __m256i rb = _mm256_castpd_si256(t);
    if (stochastic) {
        const __m256i fb = _mm256_castpd_si256(_mm256_mul_pd(_mm256_sub_pd(a, t), inv));
        const __m256i up = ltu64(_mm256_castpd_si256(u), fb);
        rb = _mm256_castpd_si256(_mm256_add_pd(t, _mm256_castsi256_pd(_mm256_and_si256(up, e))));
    } else {
        const __m256i over = _mm256_and_si256(ltu64(ab, inf), ltu64(maxb, rb));
        rb = _mm256_blendv_epi8(rb, maxb, over);
    }
    const __m256i ovf = _mm256_andnot_si256(ltu64(inf, rb), ltu64(maxb, rb)); /* max < rb <= inf */
    rb = _mm256_blendv_epi8(rb, _mm256_set1_epi64x((long long)p->ovf_bits), ovf);
    rb = _mm256_andnot_si256(ltu64(rb, _mm256_set1_epi64x((long long)p->min_bits)), rb);
    return _mm256_or_si256(rb, sign);
}

static inline __attribute__((always_inline)) __m256d dload4(const void *src, int64_t i, const int kind) {
    if (kind == 0) return _mm256_cvtps_pd(_mm_loadu_ps((const float *)src + i));
    if (kind == 1) return _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)src + i))));
    if (kind == 2)
        return _mm256_cvtps_pd(_mm_castsi128_ps(
            _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)((const uint16_t *)src + i)))));
    return _mm256_loadu_pd((const double *)src + i);
}
#define DIRECTED_VECTOR 2
#else
#define DIRECTED_VECTOR 0
#endif

#define DEFINE_DLOOP(NAME, KIND, SRC_T, LOAD, DST_T, STOCH)                                                \
    static void NAME(const void *src_, const double *u, void *dst_, int64_t n, const dparams *pp) {        \
        const SRC_T *src = (const SRC_T *)src_;                                                            \
        DST_T *dst = (DST_T *)dst_;                                                                        \
        const dparams p = *pp;                                                                             \
        int64_t i = 0;                                                                                     \
        (void)u;                                                                                           \
        DVEC(KIND, DST_T, STOCH)                                                                           \
        for (; i < n; i++) dst[i] = (DST_T)bits_f64(directed_one(LOAD(src[i]), STOCH ? u[i] : 0.0, STOCH, &p)); \
    }
#if DIRECTED_VECTOR == 1
#define DVEC(KIND, DST_T, STOCH)                                                                           \
    for (; i + 8 <= n; i += 8) {                                                                           \
        __m512i r = directed8(dload8(src, i, KIND), STOCH ? _mm512_loadu_pd(u + i) : _mm512_setzero_pd(), STOCH, &p); \
        if (sizeof(DST_T) == 8)                                                                            \
            _mm512_storeu_si512((void *)(dst + i), r);                                                     \
        else                                                                                               \
            _mm256_storeu_ps((float *)(dst + i), _mm512_cvtpd_ps(_mm512_castsi512_pd(r)));                 \
    }
#elif DIRECTED_VECTOR == 2
#define DVEC(KIND, DST_T, STOCH)                                                                           \
    for (; i + 4 <= n; i += 4) {                                                                           \
        __m256i r = directed4(dload4(src, i, KIND), STOCH ? _mm256_loadu_pd(u + i) : _mm256_setzero_pd(), STOCH, &p); \
        if (sizeof(DST_T) == 8)                                                                            \
            _mm256_storeu_si256((__m256i *)(void *)(dst + i), r);                                          \
        else                                                                                               \
            _mm_storeu_ps((float *)(dst + i), _mm256_cvtpd_ps(_mm256_castsi256_pd(r)));                    \
    }
#else
#define DVEC(KIND, DST_T, STOCH)
#endif
#define DLOAD_F32(v) ((double)(v))
#define DLOAD_F16(v) ((double)bits_f32(widen_f16(v)))
#define DLOAD_BF16(v) ((double)bits_f32((uint32_t)(v) << 16))
#define DLOAD_F64(v) (v)
#define DEFINE_DLOOPS(KIND, K, SRC_T, LOAD)                                  \
    DEFINE_DLOOP(dloop_##KIND##_tz_f32, K, SRC_T, LOAD, float, 0)            \
    DEFINE_DLOOP(dloop_##KIND##_sr_f32, K, SRC_T, LOAD, float, 1)            \
    DEFINE_DLOOP(dloop_##KIND##_tz_f64, K, SRC_T, LOAD, double, 0)           \
    DEFINE_DLOOP(dloop_##KIND##_sr_f64, K, SRC_T, LOAD, double, 1)
DEFINE_DLOOPS(f32, 0, float, DLOAD_F32)
DEFINE_DLOOPS(f16, 1, uint16_t, DLOAD_F16)
DEFINE_DLOOPS(bf16, 2, uint16_t, DLOAD_BF16)
DEFINE_DLOOPS(f64, 3, double, DLOAD_F64)

typedef void (*dloop_fn)(const void *, const double *, void *, int64_t, const dparams *);
static const dloop_fn DLOOPS[4][2][2] = { /* [src kind][stochastic][dst fp64] */
    {{dloop_f32_tz_f32, dloop_f32_tz_f64}, {dloop_f32_sr_f32, dloop_f32_sr_f64}},
    {{dloop_f16_tz_f32, dloop_f16_tz_f64}, {dloop_f16_sr_f32, dloop_f16_sr_f64}},
    {{dloop_bf16_tz_f32, dloop_bf16_tz_f64}, {dloop_bf16_sr_f32, dloop_bf16_sr_f64}},
    {{dloop_f64_tz_f32, dloop_f64_tz_f64}, {dloop_f64_sr_f32, dloop_f64_sr_f64}},
};

/* Round n elements of src (SRC_* kinds, or 3 = fp64) to the format toward zero (u NULL) or stochastically with
 * the uniforms u into dst: fp64 (dst_f64 != 0) or fp32 (exact: results are on the format's grid). dst may be src
 * itself when both are fp32 or both fp64. Returns 0, or -1 for arguments outside what FloatFormat allows. */
int mixprec_round_directed(const void *src, int src_kind, const double *u, void *dst, int dst_f64, int64_t n,
                           int exp_bits, int man_bits, int has_inf, int saturate, int subnormals, int nthreads) {
    fmt64_t f;
    if (src_kind < 0 || src_kind > MIXPREC_F64 || fmt64_of(exp_bits, man_bits, has_inf, saturate, subnormals, &f) || n < 0)
        return -1;
    const dparams p = {f.lo, f.hi, (uint64_t)man_bits << 52, f.max_bits, f.ovf_bits, f.min_bits};
    const dloop_fn fn = DLOOPS[src_kind][u != 0][dst_f64 != 0];
    const int64_t in = src_kind == MIXPREC_F64 ? 8 : (src_kind == SRC_F32 ? 4 : 2), out = dst_f64 ? 8 : 4;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (n >= MIXPREC_GRAIN)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = ((n + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        if (hi > lo) fn((const char *)src + lo * in, u ? u + lo : 0, (char *)dst + lo * out, hi - lo, &p);
    }
    return 0;
}
