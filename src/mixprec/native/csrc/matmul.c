/* Emulated matmul (mixprec.emulate.matmul): the low-precision accumulation model on a cache-blocked, register-
 * blocked fp64 kernel. See docs/emulate.md, "The compiled kernel", for the blocking and why its bits equal the
 * torch path's wherever the fp64 group sums are exact.
 *
 * Per output element: acc <- round_acc(acc + sum of one K-group's products), the products formed and added in
 * fp64 (exact products: inputs have <= 24-bit significands); with promotion, prom <- fp32(prom + acc) and
 * acc <- 0 every `pg` groups. A 12 x 16 tile of accumulators stays in AVX-512 registers across a whole K block;
 * it is rounded after every group while in registers. Blocks: A (MC x KC) and B (KC x NC) are packed into
 * per-thread buffers (zero-padded to whole tiles and whole groups: zero products change no sum), the
 * accumulator state of an MC x NC output block lives in a per-thread buffer for the whole K, and OpenMP
 * distributes the output blocks. */
#include <math.h>
#include <stdlib.h>
#include "common.h"
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define MR 12
#define NR 16
#define MC 192
#define NC 256
#define KC_TARGET 256

enum { ROUND_FP32 = 0, ROUND_FP16 = 1, ROUND_GENERIC = 2 };

typedef struct {
    int mode;
    int64_t lo, hi, add;  /* exponent clamp (fp64 bit patterns of 2**emin, 2**(emax+1)) and magic offset */
    double maxv, over, min_normal;
    int subnormals;
} rfmt;

/* ------------------------------------------------------------------------------------------ micro-kernels */
/* acc (MR x NR, row stride NCP) and prom (same layout, or NULL) hold the state of one output tile; ap is a
 * packed A panel (k-major, MR per k), bp a packed B panel (k-major, NR per k) of the products k0 .. k0+kk-1
 * (zero-padded K). A block may start or end inside a group: the unrounded fp64 partial sum then waits in acc,
 * exactly as in a register. groups is the total, pg the groups per promotion (0: none). */
#define NCP NC

/* round_vec and round_v4d round fp64 lanes to the accumulator format, nearest even, exactly as
 * core/rounding.py does on fp64 work (magic constant with the exponent clamped to [emin, emax + 1]), then the
 * overflow rule and the flush of subnormals. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512d round_vec(__m512d x, int mode, const rfmt *f) {
    if (mode == ROUND_FP32) return _mm512_cvtps_pd(_mm512_cvtpd_ps(x));
#ifdef __AVX512FP16__
    if (mode == ROUND_FP16) /* IEEE fp64 -> fp16 is one nearest-even rounding; -0 is made +0 at the end */
        return _mm512_cvtph_pd(_mm512_cvtpd_ph(x));
#endif
    __m512i e = _mm512_and_si512(_mm512_castpd_si512(x), _mm512_set1_epi64(0x7FF0000000000000LL));
    e = _mm512_min_epi64(_mm512_max_epi64(e, _mm512_set1_epi64(f->lo)), _mm512_set1_epi64(f->hi));
    __m512d c = _mm512_castsi512_pd(_mm512_add_epi64(e, _mm512_set1_epi64(f->add)));
    x = _mm512_sub_pd(_mm512_add_pd(x, c), c);
    __m512d ax = _mm512_abs_pd(x);
    __mmask8 over = _mm512_cmp_pd_mask(ax, _mm512_set1_pd(f->maxv), _CMP_GT_OQ);
    __m512d sign = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(x), _mm512_set1_epi64(INT64_MIN)));
    __m512d ov = _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(_mm512_set1_pd(f->over)),
                                                     _mm512_castpd_si512(sign)));
    x = _mm512_mask_blend_pd(over, x, ov);
    if (!f->subnormals) {
        __m512d ax2 = _mm512_abs_pd(x);
        __mmask8 tiny = _mm512_cmp_pd_mask(ax2, _mm512_set1_pd(f->min_normal), _CMP_LT_OQ) &
                        _mm512_cmp_pd_mask(ax2, _mm512_setzero_pd(), _CMP_NEQ_OQ);
        x = _mm512_mask_mul_pd(x, tiny, x, _mm512_setzero_pd());
    }
    return x;
}

static inline __attribute__((always_inline)) void tile_avx512(const double *ap, const double *bp, int64_t k0,
                                                              int64_t kk, int kg, double *acc, float *prom,
                                                              int64_t groups, int pg, const rfmt *f, int mode) {
    __m512d c[MR][2];
    for (int i = 0; i < MR; i++) {
        c[i][0] = _mm512_loadu_pd(acc + i * NCP);
        c[i][1] = _mm512_loadu_pd(acc + i * NCP + 8);
    }
    const double *a = ap, *b = bp;
    for (int64_t k = k0, kend = k0 + kk; k < kend;) {
        const int64_t gend = (k / kg + 1) * kg < kend ? (k / kg + 1) * kg : kend;
        for (; k < gend; k++, a += MR, b += NR) {
            __m512d b0 = _mm512_load_pd(b), b1 = _mm512_load_pd(b + 8);
            for (int i = 0; i < MR; i++) {
                __m512d ai = _mm512_set1_pd(a[i]);
                c[i][0] = _mm512_fmadd_pd(ai, b0, c[i][0]);
                c[i][1] = _mm512_fmadd_pd(ai, b1, c[i][1]);
            }
        }
        if (k % kg) continue; /* the group goes on in the next K block */
        for (int i = 0; i < MR; i++) {
            c[i][0] = round_vec(c[i][0], mode, f);
            c[i][1] = round_vec(c[i][1], mode, f);
        }
        const int64_t g = k / kg - 1;
        if (pg && ((g + 1) % pg == 0 || g == groups - 1)) {
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) {
                    float *p = prom + i * NCP + 8 * h;
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm512_cvtpd_ps(c[i][h])));
                    c[i][h] = _mm512_setzero_pd();
                }
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_pd(acc + i * NCP, c[i][0]);
        _mm512_storeu_pd(acc + i * NCP + 8, c[i][1]);
    }
}

#define TILE_VARIANT(NAME, MODE)                                                                                     \
    static void NAME(const double *ap, const double *bp, int64_t k0, int64_t kk, int kg, double *acc, float *prom,  \
                     int64_t groups, int pg, const rfmt *f) {                                                        \
        tile_avx512(ap, bp, k0, kk, kg, acc, prom, groups, pg, f, MODE);                                             \
    }
TILE_VARIANT(tile_fp32, ROUND_FP32)
TILE_VARIANT(tile_fp16, ROUND_FP16)
TILE_VARIANT(tile_generic, ROUND_GENERIC)
#else
/* Without AVX-512: the same tile in GCC vector types of 4 doubles (one AVX2 register, two NEON ones), as 4
 * sub-tiles of SR x 4 SC, each with its 2 SC B vectors and one broadcast A value in registers (15 of AVX2's
 * 16). A sub-tile runs the whole K block, so each element sees the same operations in the same order as in
 * tile_avx512: the same bits. (A plain C tile, its 192 accumulators in memory and a branch per element in the
 * rounding, ran 6x slower than the torch path with AVX2.) */
/* static functions only: their ABI for 32-byte vectors without AVX (gcc's -Wpsabi notes) does not matter */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
#define SR 6
#define SC 2

static inline __attribute__((always_inline)) v4d v4d_load(const double *p) {
    v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void v4d_store(double *p, v4d v) { memcpy(p, &v, sizeof v); }

/* a b + c with the product exact (inputs of <= 24 significant bits): fused or not, one rounding. */
static inline __attribute__((always_inline)) v4d v4d_fma(v4d a, v4d b, v4d c) {
#if defined(__FMA__)
    return (v4d)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}

static inline __attribute__((always_inline)) v4d v4d_pick(v4l m, v4d a, v4d b) { /* m ? a : b */
    return (v4d)((m & (v4l)a) | (~m & (v4l)b));
}

/* round_vec on 4 lanes, with the same fp64 operations. */
static inline __attribute__((always_inline)) v4d round_v4d(v4d x, int mode, const rfmt *f) {
    if (mode == ROUND_FP32) return __builtin_convertvector(__builtin_convertvector(x, v4f), v4d);
    const v4l sign = (v4l){0, 0, 0, 0} + INT64_MIN;
    v4l e = (v4l)x & 0x7FF0000000000000LL;
    v4l lo = e < f->lo, hi = e > f->hi; /* GCC's vector ?: is C++ only: masks */
    e = (lo & f->lo) | (hi & f->hi) | (~(lo | hi) & e);
    v4d c = (v4d)(e + f->add);
    x = (x + c) - c;
    v4d ax = (v4d)((v4l)x & ~sign);
    x = v4d_pick(ax > f->maxv, (v4d)(((v4l){0, 0, 0, 0} + f64_bits(f->over)) | ((v4l)x & sign)), x);
    if (!f->subnormals) {
        ax = (v4d)((v4l)x & ~sign);
        x = v4d_pick((ax < f->min_normal) & (ax != 0.0), (v4d)((v4l)x & sign), x); /* x * 0 */
    }
    return x;
}

static inline __attribute__((always_inline)) void subtile_v4d(const double *ap, const double *bp, int r0, int c0,
                                                              int64_t k0, int64_t kk, int kg, double *acc,
                                                              float *prom, int64_t groups, int pg, const rfmt *f,
                                                              int mode) {
    v4d c[SR][SC];
    for (int i = 0; i < SR; i++)
        for (int h = 0; h < SC; h++) c[i][h] = v4d_load(acc + (r0 + i) * NCP + c0 + 4 * h);
    const double *a = ap + r0, *b = bp + c0;
    for (int64_t k = k0, kend = k0 + kk; k < kend;) {
        const int64_t gend = (k / kg + 1) * kg < kend ? (k / kg + 1) * kg : kend;
        for (; k < gend; k++, a += MR, b += NR) {
            v4d bv[SC];
            for (int h = 0; h < SC; h++) bv[h] = v4d_load(b + 4 * h);
            for (int i = 0; i < SR; i++) {
                const v4d ai = (v4d){a[i], a[i], a[i], a[i]};
                for (int h = 0; h < SC; h++) c[i][h] = v4d_fma(ai, bv[h], c[i][h]);
            }
        }
        if (k % kg) continue; /* the group goes on in the next K block */
        for (int i = 0; i < SR; i++)
            for (int h = 0; h < SC; h++) c[i][h] = round_v4d(c[i][h], mode, f);
        const int64_t g = k / kg - 1;
        if (pg && ((g + 1) % pg == 0 || g == groups - 1)) {
            for (int i = 0; i < SR; i++)
                for (int h = 0; h < SC; h++) {
                    float *p = prom + (r0 + i) * NCP + c0 + 4 * h;
                    v4f s;
                    memcpy(&s, p, sizeof s);
                    s = s + __builtin_convertvector(c[i][h], v4f); /* exact widening; one fp32 rounding */
                    memcpy(p, &s, sizeof s);
                    c[i][h] = (v4d){0, 0, 0, 0};
                }
        }
    }
    for (int i = 0; i < SR; i++)
        for (int h = 0; h < SC; h++) v4d_store(acc + (r0 + i) * NCP + c0 + 4 * h, c[i][h]);
}

#define TILE_VARIANT(NAME, MODE)                                                                                     \
    static void NAME(const double *ap, const double *bp, int64_t k0, int64_t kk, int kg, double *acc, float *prom,  \
                     int64_t groups, int pg, const rfmt *f) {                                                        \
        for (int r0 = 0; r0 < MR; r0 += SR)                                                                          \
            for (int c0 = 0; c0 < NR; c0 += 4 * SC)                                                                  \
                subtile_v4d(ap, bp, r0, c0, k0, kk, kg, acc, prom, groups, pg, f, MODE);                             \
    }
TILE_VARIANT(tile_fp32, ROUND_FP32)
TILE_VARIANT(tile_generic, ROUND_GENERIC)
#endif

typedef void (*tile_fn)(const double *, const double *, int64_t, int64_t, int, double *, float *, int64_t, int,
                        const rfmt *);

/* ------------------------------------------------------------------------------------------------ packing */
enum { DT_FP32 = MIXPREC_F32, DT_FP16 = MIXPREC_F16, DT_BF16 = MIXPREC_BF16 }; /* dtypes.h */

static inline __attribute__((always_inline)) double load_elem(const void *p, int64_t idx, int dt) {
    if (dt == DT_FP32) return (double)((const float *)p)[idx];
    if (dt == DT_BF16) return (double)bits_f32((uint32_t)((const uint16_t *)p)[idx] << 16);
    return (double)f16_to_f32(((const uint16_t *)p)[idx]);
}

#if defined(__AVX2__) && defined(__F16C__)
/* src[idx..idx+8) as fp32 (exact widening of fp16 and bf16). */
static inline __attribute__((always_inline)) __m256 load8_f32(const void *src, int64_t idx, int dt) {
    if (dt == DT_FP32) return _mm256_loadu_ps((const float *)src + idx);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + idx));
    if (dt == DT_FP16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* dst[0..count) = src[idx..idx+count) widened to fp64; vector conversions (no scalar chain through a merged
 * register: vcvtsh2sd/vcvtss2sd depend on their destination's previous value). */
static inline __attribute__((always_inline)) void convert_run(double *dst, const void *src, int64_t idx,
                                                              int64_t count, int dt) {
    int64_t q = 0;
#if defined(__AVX512F__) && defined(__F16C__)
    for (; q + 8 <= count; q += 8) _mm512_storeu_pd(dst + q, _mm512_cvtps_pd(load8_f32(src, idx + q, dt)));
#elif defined(__AVX2__) && defined(__F16C__)
    for (; q + 8 <= count; q += 8) {
        __m256 v = load8_f32(src, idx + q, dt);
        _mm256_storeu_pd(dst + q, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        _mm256_storeu_pd(dst + q + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
#endif
    for (; q < count; q++) dst[q] = load_elem(src, idx + q, dt);
}

/* Panels of `width` (MR or NR) lines, k-major: dst[t][q][r] = src[line t*width + r, k k0 + q], zero outside
 * `lines` x `k`. Element (line, kk) is at src[line * sl + kk * sk]. */
static inline __attribute__((always_inline)) void pack_panels(double *dst, const void *src, int64_t sl, int64_t sk,
                                                              int64_t lines, int64_t k0, int64_t kk, int64_t k,
                                                              int64_t kc, int width, int dt) {
    const int64_t panels = (lines + width - 1) / width, kin = k - k0 < kk ? k - k0 : kk;
    if (sk == 1) { /* contiguous along k (row-major A): read each line, write strided */
        for (int64_t t = 0; t < panels; t++) {
            double *d = dst + t * width * kc;
            const int64_t l0 = t * width, nl = lines - l0 < width ? lines - l0 : width;
            if (nl < width || kin < kk) memset(d, 0, sizeof(double) * width * kk);
            double tmp[NR][64]; /* convert a 64-wide strip of each line, then transpose it */
            for (int64_t q0 = 0; q0 < kin; q0 += 64) {
                const int64_t qn = kin - q0 < 64 ? kin - q0 : 64;
                for (int r = 0; r < nl; r++) convert_run(tmp[r], src, (l0 + r) * sl + k0 + q0, qn, dt);
                for (int64_t q = 0; q < qn; q++)
                    for (int r = 0; r < nl; r++) d[(q0 + q) * width + r] = tmp[r][q];
            }
        }
        return;
    }
    /* contiguous across lines (row-major B): one k row at a time, into every panel */
    for (int64_t t = 0; t < panels; t++)
        if ((t + 1) * width > lines || kin < kk) memset(dst + t * width * kc, 0, sizeof(double) * width * kk);
    for (int64_t q = 0; q < kin; q++) {
        const int64_t base = (k0 + q) * sk;
        for (int64_t t = 0; t < panels; t++) {
            double *d = dst + t * width * kc + q * width;
            const int64_t l0 = t * width, nl = lines - l0 < width ? lines - l0 : width;
            if (nl == width && sl == 1) {
                convert_run(d, src, base + l0, width, dt);
            } else {
                for (int r = 0; r < nl; r++) d[r] = load_elem(src, base + (l0 + r) * sl, dt);
            }
        }
    }
}

static void pack(double *dst, const void *src, int64_t sl, int64_t sk, int64_t lines, int64_t k0, int64_t kk,
                 int64_t k, int64_t kc, int width, int dt) {
    if (dt == DT_FP32)
        pack_panels(dst, src, sl, sk, lines, k0, kk, k, kc, width, DT_FP32);
    else if (dt == DT_FP16)
        pack_panels(dst, src, sl, sk, lines, k0, kk, k, kc, width, DT_FP16);
    else
        pack_panels(dst, src, sl, sk, lines, k0, kk, k, kc, width, DT_BF16);
}

/* ------------------------------------------------------------------------------------------------ driver */
static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* out[b, i, j] (fp32, contiguous B x M x N) = the model's result for a[b] (M x K) @ b[b] (K x N). Operands hold
 * values of the input format as fp32, fp16 or bf16 (dt), addressed by element strides (batch stride 0
 * broadcasts). Returns 0, or -1 when a buffer could not be allocated (the caller then runs the torch path). */
int mixprec_matmul_model(const void *a, int64_t sab, int64_t sam, int64_t sak, const void *b, int64_t sbb,
                         int64_t sbk, int64_t sbn, int dt, float *out, int64_t nb, int64_t m, int64_t n, int64_t k, int kg,
                         int pg, int mode, int acc_man, int acc_emin, int acc_emax, double acc_max, double acc_over,
                         double acc_min_normal, int acc_subnormals, int nthreads) {
    rfmt f = {mode,
              (int64_t)(acc_emin + 1023) << 52,
              (int64_t)(acc_emax + 1 + 1023) << 52,
              ((int64_t)(52 - acc_man) << 52) | ((int64_t)1 << 51),
              acc_max,
              acc_over,
              acc_min_normal,
              acc_subnormals};
    tile_fn tile = mode == ROUND_FP32 ? tile_fp32 : tile_generic;
#if defined(__AVX512F__) && defined(__AVX512FP16__)
    if (mode == ROUND_FP16) tile = tile_fp16;
#endif
    if (mode == ROUND_FP16) f.mode = ROUND_GENERIC; /* the scalar tiles round fp16 with the magic constant */
    const int64_t groups = (k + kg - 1) / kg;
    /* K blocks of whole groups near KC_TARGET, or of KC_TARGET when one group is longer (bounded buffers) */
    const int64_t kpad = groups * kg, kc0 = kg >= KC_TARGET ? KC_TARGET : KC_TARGET / kg * kg;
    const int64_t kc = kc0 < kpad ? kc0 : kpad;
    const int64_t nblocks = (n + NC - 1) / NC;
    /* rows per block: MC, or fewer (a multiple of MR) so that small products still give every thread work */
    int64_t mcb = MC;
    if (nthreads > 1) {
        const int64_t want = 4 * (int64_t)nthreads, per = nb * nblocks, split = (want + per - 1) / per;
        const int64_t rows = ((m + split - 1) / split + MR - 1) / MR * MR;
        mcb = rows < MC ? (rows > MR ? rows : MR) : MC;
    }
    const int64_t mblocks = (m + mcb - 1) / mcb;
    const int64_t blocks = nb * mblocks * nblocks;
    /* buffers sized for the largest block of this product (small products touch little memory) */
    const int64_t rows = ((m < mcb ? m : mcb) + MR - 1) / MR * MR, cols = ((n < NC ? n : NC) + NR - 1) / NR * NR;
    int failed = 0;
    /* threads only for at least ~2M multiply-adds (an OpenMP fork/join costs microseconds) */
#pragma omp parallel num_threads(nthreads) if (nb * m * n * k >= MIXPREC_GRAIN * 64 && blocks > 1)
    {
        double *ap = alloc64(sizeof(double) * rows * kc);
        double *bp = alloc64(sizeof(double) * cols * kc);
        double *acc = alloc64(sizeof(double) * rows * NC);
        float *prom = pg ? alloc64(sizeof(float) * rows * NC) : NULL;
        int ok = ap && bp && acc && (prom || !pg);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (!ok) continue;
            const int64_t bi = blk / (mblocks * nblocks), rest = blk % (mblocks * nblocks);
            const int64_t i0 = rest / nblocks * mcb, j0 = rest % nblocks * NC;
            const int64_t mc = m - i0 < mcb ? m - i0 : mcb, nc = n - j0 < NC ? n - j0 : NC;
            const int64_t mt = (mc + MR - 1) / MR, nt = (nc + NR - 1) / NR;
            const size_t esz = dt == DT_FP32 ? 4 : 2;
            const void *ab = (const char *)a + (bi * sab + i0 * sam) * esz;
            const void *bb = (const char *)b + (bi * sbb + j0 * sbn) * esz;
            memset(acc, 0, sizeof(double) * mt * MR * NC);
            if (prom) memset(prom, 0, sizeof(float) * mt * MR * NC);
            for (int64_t k0 = 0; k0 < kpad; k0 += kc) {
                const int64_t kk = kpad - k0 < kc ? kpad - k0 : kc;
                pack(ap, ab, sam, sak, mc, k0, kk, k, kc, MR, dt);
                pack(bp, bb, sbn, sbk, nc, k0, kk, k, kc, NR, dt);
                for (int64_t tj = 0; tj < nt; tj++)
                    for (int64_t ti = 0; ti < mt; ti++) {
                        const int64_t off = ti * MR * NC + tj * NR;
                        tile(ap + ti * MR * kc, bp + tj * NR * kc, k0, kk, kg, acc + off, prom ? prom + off : NULL,
                             groups, pg, &f);
                    }
            }
            /* The torch path's rounding gives +0 for every zero; here the fp16 conversion keeps -0 for negative
             * sums that round to zero. Only the sign of a zero differs, which no later step can see except
             * the output (a promotion adds into a sum that is never -0, and rounds again), so + 0 here. */
            float *o = out + bi * m * n + i0 * n + j0;
            if (prom) {
                for (int64_t i = 0; i < mc; i++) memcpy(o + i * n, prom + i * NC, sizeof(float) * nc);
            } else {
                const double fix = mode == ROUND_FP16 ? 0.0 : -0.0; /* x + -0 = x for every x */
                for (int64_t i = 0; i < mc; i++)
                    for (int64_t j = 0; j < nc; j++) o[i * n + j] = (float)(acc[i * NC + j] + fix);
            }
        }
        free(ap);
        free(bp);
        free(acc);
        free(prom);
    }
    return failed ? -1 : 0;
}
