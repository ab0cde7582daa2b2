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
 * into fp64 or fp32.
 */
#include <omp.h>
#include <stdint.h>

#include "common.h"

enum { SRC_F32 = 0, SRC_F16 = 1, SRC_BF16 = 2 };
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

/* Round n fp64 values to the format into dst: fp64 (dst_f64 != 0; may be src itself) or fp32. Returns 0, or -1
 * for arguments outside what FloatFormat allows. */
int mixprec_round_nearest_f64(const double *src, void *dst, int dst_f64, int64_t n, int exp_bits, int man_bits,
                              int has_inf, int saturate, int subnormals, int nthreads) {
    if (exp_bits < 2 || exp_bits > 8 || man_bits < 1 || man_bits > 23 || (exp_bits == 8 && !has_inf) || n < 0)
        return -1;
    const int bias = (1 << (exp_bits - 1)) - 1, emin = 1 - bias;
    const int emax = has_inf ? bias : (1 << exp_bits) - 1 - bias;
    const uint64_t top_frac = has_inf ? (1ull << man_bits) - 1u : (1ull << man_bits) - 2u;
    rparams64 p;
    p.lo = (uint64_t)(emin + 1023) << 52;
    p.hi = (uint64_t)(emax + 1 + 1023) << 52;
    p.add = ((uint64_t)(52 - man_bits) << 52) | (1ull << 51);
    p.max_bits = ((uint64_t)(emax + 1023) << 52) | (top_frac << (52 - man_bits));
    p.ovf_bits = saturate ? p.max_bits : (has_inf ? 0x7FF0000000000000ull : 0x7FF8000000000000ull);
    p.min_normal_bits = subnormals ? 0u : (uint64_t)(emin + 1023) << 52;
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
