/* MinMaxUInt8's encode and decode (mixprec.compress.quantize), fused and cache-blocked.
 *
 * Encode: one task per (row, chunk). The chunk is read once from memory for its min/max (and NaN check),
 * stays in L1/L2 while the fp64 per-chunk scalars are computed, and is read again from cache for the codes,
 * so DRAM sees 4 bytes in and 1 byte out per element. Decode: one task per (row, chunk), or per chunk over
 * all rows when summing (row order, fp32). The arithmetic is the torch path's, operation by operation, in
 * the same precision (-ffp-contract=off: no fused multiply-add): docs/compress.md says why each step rounds
 * where it does. Stochastic rounding takes its random bits from Philox4x32-10 (philox.h) at the element's
 * stream position, so the result does not depend on the thread count or the blocking: one primary byte per
 * element in the vectorized loop, and a secondary word for the few ties (1 in 256) in a batched fix-up. For
 * fp32 input each thread pipelines its chunks (encode_u8_pipelined): the next chunk's min/max scan and
 * Philox words run inside the current chunk's codes loop, so its loads overlap the stochastic arithmetic. */
#include "quant_common.h"

typedef struct {
    double rng; /* max - min in fp64 */
    float sub, scale, zero, step, mn;
    int wide; /* the chunk takes the float64 path */
} grid_t;

/* MinMaxUInt8.grid for one chunk, on the same fp64 operations (NaN header: wide 0, step NaN, scale 0). */
static inline grid_t grid_of(float mn, float mx) {
    grid_t g;
    double lo = (double)mn, rng = (double)mx - lo;
    int wide = (rng > (double)FLT_MAX) | ((rng > 0) & (rng < 255.0 * (double)FLT_MIN));
    int aligned = (lo < 0) & (mx >= 0) & !wide;
    float step = (float)(aligned ? rng / 254.0 : rng / 255.0);
    double s64 = (double)step;
    g.scale = (float)(aligned ? 1.0 / s64 : (rng > 0 ? 255.0 / rng : 0.0));
    double neg = aligned ? -lo : 0.0, safe = aligned ? s64 : 1.0;
    double zero = ceil(neg / safe);
    zero = zero - (double)((zero - 1) * safe >= neg);
    zero = zero + (double)(zero * safe < neg);
    g.zero = (float)zero;
    g.step = step;
    g.sub = aligned ? 0.0f : mn;
    g.mn = mn;
    g.rng = rng;
    g.wide = wide;
    return g;
}

/* grid_of for chunks [0, n) at once (mn, mx: their bounds; n <= GRID_BATCH): the same fp64 operations,
 * 8 lanes per instruction. Per chunk, grid_of is a chain of three dependent divisions (about 80 cycles of
 * latency), which small chunks pay once per 64-256 elements; side by side the chains overlap. */
#define GRID_BATCH 16
static void grids_of(const float *mn, const float *mx, int n, grid_t *g) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 8 <= n; i += 8) {
        const __m512d one = _mm512_set1_pd(1.0), zero0 = _mm512_setzero_pd();
        __m256 mn8 = _mm256_loadu_ps(mn + i), mx8 = _mm256_loadu_ps(mx + i);
        __m512d lo = _mm512_cvtps_pd(mn8), hi = _mm512_cvtps_pd(mx8), rng = _mm512_sub_pd(hi, lo);
        __mmask8 pos = _mm512_cmp_pd_mask(rng, zero0, _CMP_GT_OQ);
        __mmask8 wide = _mm512_cmp_pd_mask(rng, _mm512_set1_pd((double)FLT_MAX), _CMP_GT_OQ) |
                        (pos & _mm512_cmp_pd_mask(rng, _mm512_set1_pd(255.0 * (double)FLT_MIN), _CMP_LT_OQ));
        __mmask8 al = _mm512_cmp_pd_mask(lo, zero0, _CMP_LT_OQ) & _mm512_cmp_pd_mask(hi, zero0, _CMP_GE_OQ) &
                      (__mmask8)~wide;
        __m512d q = _mm512_div_pd(rng, _mm512_mask_blend_pd(al, _mm512_set1_pd(255.0), _mm512_set1_pd(254.0)));
        __m256 step = _mm512_cvtpd_ps(q);
        __m512d s64 = _mm512_cvtps_pd(step);
        /* scale: 1 / s64 (aligned), 255 / rng (rng > 0), else 0 */
        __m512d num = _mm512_mask_blend_pd(al, _mm512_set1_pd(255.0), one), den = _mm512_mask_blend_pd(al, rng, s64);
        __m512d sc = _mm512_maskz_mov_pd(al | pos, _mm512_div_pd(num, den));
        __m512d neg = _mm512_maskz_sub_pd(al, zero0, lo), safe = _mm512_mask_blend_pd(al, one, s64);
        __m512d z = _mm512_roundscale_pd(_mm512_div_pd(neg, safe), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        /* z - 0.0 and z + 0.0 where the tests fail, as grid_of computes them (unmasked: the same signed zeros) */
        __mmask8 over = _mm512_cmp_pd_mask(_mm512_mul_pd(_mm512_sub_pd(z, one), safe), neg, _CMP_GE_OQ);
        z = _mm512_sub_pd(z, _mm512_maskz_mov_pd(over, one));
        __mmask8 under = _mm512_cmp_pd_mask(_mm512_mul_pd(z, safe), neg, _CMP_LT_OQ);
        z = _mm512_add_pd(z, _mm512_maskz_mov_pd(under, one));
        float f_scale[8], f_zero[8], f_step[8];
        double d_rng[8];
        _mm256_storeu_ps(f_scale, _mm512_cvtpd_ps(sc));
        _mm256_storeu_ps(f_zero, _mm512_cvtpd_ps(z));
        _mm256_storeu_ps(f_step, step);
        _mm512_storeu_pd(d_rng, rng);
        for (int l = 0; l < 8; l++) {
            grid_t *o = g + i + l;
            o->rng = d_rng[l];
            o->sub = (al >> l) & 1 ? 0.0f : mn[i + l];
            o->scale = f_scale[l];
            o->zero = f_zero[l];
            o->step = f_step[l];
            o->mn = mn[i + l];
            o->wide = (wide >> l) & 1;
        }
    }
#endif
    for (; i < n; i++) g[i] = grid_of(mn[i], mx[i]);
}

/* Chunks per batch: `want`, at most GRID_BATCH, and with several threads small enough that each gets about
 * 4 batches or more (a few large batches would split the tasks unevenly between them). */
static inline int64_t batch_size(int64_t want, int64_t tasks) {
#ifdef _OPENMP
    int64_t nth = omp_get_num_threads();
    if (nth > 1 && want > tasks / (4 * nth)) want = tasks / (4 * nth);
#else
    (void)tasks;
#endif
    return want < 1 ? 1 : (want > GRID_BATCH ? GRID_BATCH : want);
}



/* The tie rule (docs/compress.md): 256 frac = s, f8 = floor(s), the primary byte equal to f8; up when the
 * secondary word w < (s - f8) 2**32, in double (exact on both sides). */
static inline int tie_up(uint64_t key, uint64_t e, double s, double f8) {
    return (double)mixprec_philox_tie_word(key, e) < (s - f8) * 0x1p32;
}

/* floor(q) for |q| < 2**24, by truncation, as an integer: floorf does not vectorize without
 * -fno-trapping-math, nor does a conditional float subtraction without AVX-512's masked arithmetic. */
static inline int32_t floor24i(float q) {
    int32_t t = (int32_t)q;
    return t - ((float)t > q);
}

/* Queue the tie of element k of a sub-block (codes c, first stream position e0) by its q, on the vector
 * loops' fp32 operations. */
static inline void queue_tie(ties_t *ties, const float *p, int64_t k, float sub, float scale, float zero, uint8_t *c,
                             uint64_t e0) {
    float q = (p[k] - sub) * scale;
    q = q + zero;
    tie_push_q(ties, c + k, e0 + (uint64_t)k, q);
}

#if defined(__AVX512F__)
/* The grid coordinate s = (x - sub) scale + zero of 16 elements, rounded as the torch path does; where only
 * floor(s) matters, without a subtraction of +0 (an aligned grid: x - 0 = x for every number) or an addition
 * of +0 (zero = 0: q + 0 differs from q only for q = -0, and both floor to 0), so that the stochastic loop
 * spends 3 vector operations per 16 elements, not 4. */
static inline __attribute__((always_inline)) __m512 grid_s16(const float *p, __m512 sub, __m512 scale, __m512 zero,
                                                             int has_sub, int has_zero) {
    __m512 v = _mm512_loadu_ps(p);
    if (has_sub) v = _mm512_sub_ps(v, sub);
    v = _mm512_mul_ps(v, scale);
    return has_zero ? _mm512_add_ps(v, zero) : v;
}


/* S = floor(256 q) = 256 floor(q) + f8 of 16 elements (256 q is exact), in one conversion rounding down. */
static inline __m512i floor256(__m512 q) {
    return _mm512_cvt_roundps_epi32(_mm512_mul_ps(q, _mm512_set1_ps(256.0f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
#endif

#include "quant_u8_avx2.h" /* codes_stochastic_words_avx2, on AVX2 machines without AVX-512 */

/* Stochastic codes of elements [k, m) of a sub-block on the fp32 grid from their primary bytes u: up when
 * u[k] < f8 = floor(256 frac(q)); ties (u[k] == f8) are queued (code c + k, stream position e0 + k). For
 * stream positions off the 256 grid and the last elements of a sub-block: codes_stochastic_aligned does
 * the rest. The vector loop (D = S - B; floor(q) + up = (D + 255) >> 8, a tie is D = 0 mod 256; for q a
 * few ulps below 0 it sees f8 = 255, the plain loop maybe no tie: the code is 0 either way) and the plain
 * loop give the same codes. */
static void codes_stochastic(const float *restrict p, uint8_t *restrict c, int64_t k, int64_t m, float sub,
                             float scale, float zero, const uint8_t *restrict u, ties_t *ties, uint64_t e0) {
#if defined(__AVX512F__)
    const __m512 vsub = _mm512_set1_ps(sub), vscale = _mm512_set1_ps(scale), vzero = _mm512_set1_ps(zero);
    const __m512i c255 = _mm512_set1_epi32(255);
    for (; k + 16 <= m; k += 16) {
        __m512i B = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + k)));
        __m512i d = _mm512_sub_epi32(floor256(grid_s16(p + k, vsub, vscale, vzero, 1, 1)), B);
        __m512i code = _mm512_max_epi32(_mm512_srai_epi32(_mm512_add_epi32(d, c255), 8), _mm512_setzero_si512());
        _mm_storeu_si128((__m128i *)(c + k), _mm512_cvtusepi32_epi8(code)); /* clamps 256 to 255 */
        for (uint32_t t = _mm512_testn_epi32_mask(d, c255); t; t &= t - 1)
            queue_tie(ties, p, k + __builtin_ctz(t), sub, scale, zero, c, e0);
    }
#elif defined(__AVX2__)
    for (; k + 32 <= m; k += 32) {
        __m256i B[4];
        for (int h = 0; h < 4; h++) B[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + k + 8 * h)));
        codes32_avx2(p, c, k, B, sub, scale, zero, ties, e0);
    }
#endif
    /* Without AVX2 this loop does all the work: branch-free, so that the compiler vectorizes it (a branch on
     * u < f8 is a coin flip), with the ties flagged for the pass below. */
    uint8_t tied[SB + 8];
    const int64_t k0 = k;
    for (; k < m; k++) {
        float q = (p[k] - sub) * scale;
        q = q + zero;
        int32_t fi = floor24i(q);
        float sc = (q - (float)fi) * 256.0f; /* exact product */
        int32_t f8 = (int32_t)sc, b = (int32_t)u[k]; /* truncation = floor */
        int32_t code = fi + (b < f8); /* floor(q) + up, clamped below */
        code = code < 0 ? 0 : code;
        c[k] = (uint8_t)(code > 255 ? 255 : code);
        tied[k - k0] = (uint8_t)(b == f8);
    }
    memset(tied + (m - k0), 0, 8);
    for (int64_t j = 0; j < m - k0; j += 8) { /* 8 flags per test: 1 element in 256 ties */
        uint64_t w;
        memcpy(&w, tied + j, 8);
        for (; w; w &= w - 1) {
            int64_t i = k0 + j + (__builtin_ctzll(w) >> 3);
            float q = (p[i] - sub) * scale;
            tie_push_q(ties, c + i, e0 + (uint64_t)i, q + zero); /* tie_of_q: sc - f8, clamped floor(q) + 1 */
        }
    }
}

#include "quant_u8_avx512.h" /* the aligned stochastic path (AVX-512 BW): scan, codes, tie lists */

static void encode_chunk(const void *x, int dt, int64_t a, int64_t n, uint8_t *codes, grid_t g, int stochastic,
                         uint64_t key, uint64_t pos, float *buf, ubytes_t *ubuf, ties_t *ties, const pre_words_t *pre,
                         void *next) {
    (void)pre, (void)next; /* unused without the aligned path */
    for (int64_t s = 0; s < n; s += SB) {
        int64_t m = n - s < SB ? n - s : SB;
        const float *p = as_f32(x, dt, a + s, m, buf);
        uint8_t *c = codes + s;
        uint64_t e0 = pos + (uint64_t)s;
        if (g.wide) { /* float64 path: |x - min| may exceed fp32, or 255 / R overflow */
            const uint8_t *u = stochastic ? stream_bytes(key, e0, m, ubuf) : 0;
            double mul = 255.0 / g.rng, lo = (double)g.mn;
            for (int64_t k = 0; k < m; k++) {
                double q = ((double)p[k] - lo) * mul;
                if (stochastic) {
                    double fl = floor(q), sc = (q - fl) * 256.0, f8 = floor(sc);
                    int up = (double)u[k] < f8 || ((double)u[k] == f8 && tie_up(key, e0 + (uint64_t)k, sc, f8));
                    q = fl + (double)up;
                } else {
                    q = rint(q);
                }
                q = q < 0.0 ? 0.0 : q;
                q = q > 255.0 ? 255.0 : q;
                c[k] = (uint8_t)q;
            }
        } else if (stochastic) {
            const float sub = g.sub, scale = g.scale, zero = g.zero;
            int64_t k = 0;
#if ALIGNED_PATH
            /* Philox words from chunk_minmax, or computed here for 1024 positions: not for a short piece, whose
             * bytes the stream_bytes of the chunks around it share */
            int have_pre = pre && s / SB < pre->subs;
            if ((e0 & 255) == 0 && scale < 0x1p119f && (have_pre || m >= SHORT)) {
                __m512i own[16];
                uint64_t tie[SB / 32];
                const __m512i *w = have_pre ? pre->w + 16 * (s / SB) : own;
                if (w == own) mixprec_philox_words1024(key, e0 >> 8, own);
                k = codes_stochastic_aligned(p, c, m, sub, scale * 256.0f, zero * 256.0f, w, tie, (scan_t *)next, s);
                list_ties(ties, tie, k >> 5, p, c, e0, sub, scale, zero);
                if (ties->subs == TIE_SUBS || p == buf) resolve_ties(ties); /* buf: overwritten by the next */
            }
#elif !defined(__AVX512F__) && defined(__AVX2__)
            if ((e0 & 255) == 0 && m >= SHORT) { /* shorter pieces share stream_bytes with their neighbours */
                __m256i w8[32];
                mixprec_philox_words1024_avx2(key, e0 >> 8, w8);
                k = codes_stochastic_words_avx2(p, c, m, sub, scale, zero, w8, ties, e0);
            }
#endif
            if (k < m) /* the rest: positions off the 256 grid, or the last m % 64 elements */
                codes_stochastic(p + k, c + k, 0, m - k, sub, scale, zero, stream_bytes(key, e0 + (uint64_t)k, m - k, ubuf),
                                 ties, e0 + (uint64_t)k);
            if (ties->n >= TIE_FLUSH) tie_flush(ties, 0);
        } else {
            const float sub = g.sub, scale = g.scale, zero = g.zero;
            for (int64_t k = 0; k < m; k++) {
                float q = (p[k] - sub) * scale;
                q = q + zero;
                c[k] = (uint8_t)f32_bits(q + MAGIC);
            }
        }
    }
}

/* Chunk c's header words (min, max) in a row of `chunks` chunks (o: the row's first byte). */
static inline void put_header(uint8_t *o, int64_t chunks, int64_t c, float mn, float mx) {
    memcpy(o + 4 * c, &mn, 4);
    memcpy(o + 4 * (chunks + c), &mx, 4);
}

/* A non-finite chunk (elements [a, a + n)): NaN header words and zero codes. Returns 1, for the count. */
static inline int flag_chunk(uint8_t *o, int64_t chunks, int64_t c, int64_t a, int64_t n) {
    float q = bits_f32(0x7FC00000u);
    put_header(o, chunks, c, q, q);
    memset(o + 8 * chunks + a, 0, (size_t)n);
    return 1;
}

#if ALIGNED_PATH
/* Tasks [lo, hi) of mixprec_quant_encode_u8 for fp32 rows and stochastic rounding, software-pipelined: the
 * min/max scan (and Philox words) of task t + 1 runs inside the codes loop of task t (scan_t), so that its
 * memory traffic overlaps their arithmetic. pre: two word buffers, the round keys set. Returns the number
 * of flagged chunks. */
static int64_t encode_u8_pipelined(const float *x, int64_t length, int64_t x_stride, uint8_t *out, int64_t out_stride,
                                   int64_t chunk, uint64_t key, int64_t offset, int64_t pos_stride, int64_t lo,
                                   int64_t hi, float *buf, ubytes_t *ubuf, ties_t *ties, pre_words_t pre[2]) {
    int64_t chunks = (length + chunk - 1) / chunk, bad = 0;
    scan_t sc[2];
    float mn, mx;
    int nonfinite = 0, cur = 0;
    for (int64_t t = lo; t < hi; t++) {
        for (int64_t u = t == lo ? t : t + 1; u <= t + 1 && u < hi; u++) { /* start the scan of u */
            int64_t r = u / chunks, a = (u % chunks) * chunk, n = length - a < chunk ? length - a : chunk;
            uint64_t pos = (uint64_t)(offset + r * pos_stride + a);
            pre_words_t *pw = &pre[(u - lo) & 1];
            pw->e0 = pos;
            pw->subs = (pos & 255) == 0 && n >= SHORT ? PRE_SUBS : 0;
            scan_start(&sc[(u - lo) & 1], x + r * x_stride + a, n, pw);
            if (u == lo) nonfinite = scan_finish(&sc[0], &mn, &mx);
        }
        cur = (int)((t - lo) & 1);
        scan_t *next = t + 1 < hi ? &sc[cur ^ 1] : 0;
        int64_t r = t / chunks, c = t % chunks, a = c * chunk, n = length - a < chunk ? length - a : chunk;
        uint8_t *o = out + r * out_stride;
        if (nonfinite) {
            bad += flag_chunk(o, chunks, c, a, n);
        } else {
            put_header(o, chunks, c, mn, mx);
            encode_chunk(x + r * x_stride, DT_F32, a, n, o + 8 * chunks + a, grid_of(mn, mx), 1, key,
                         (uint64_t)(offset + r * pos_stride + a), buf, ubuf, ties, &pre[cur], next);
        }
        if (next) nonfinite = scan_finish(next, &mn, &mx);
    }
    return bad;
}
#endif

/* Encode `rows` rows of `length` elements (row r at x + r * x_stride elements) into out (row r at
 * out + r * out_stride bytes: C mins, C maxs, then the codes). Stochastic: element j of row r is stream
 * position offset + r * pos_stride + j of the Philox stream `key`. Returns the number of flagged chunks. */
int64_t mixprec_quant_encode_u8(const void *x, int dt, int64_t rows, int64_t length, int64_t x_stride, uint8_t *out,
                                int64_t out_stride, int64_t chunk, int stochastic, uint64_t key, int64_t offset,
                                int64_t pos_stride, int nthreads) {
    int64_t chunks = (length + chunk - 1) / chunk, tasks = rows * chunks, bad = 0;
    size_t esize = dt == DT_F32 ? 4 : 2;
#pragma omp parallel num_threads(nthreads) if (rows * length >= MIXPREC_GRAIN) reduction(+ : bad)
    {
        float buf[SB];
        ubytes_t ubytes, *ubuf = &ubytes;
        ubytes.g0 = ubytes.g1 = 0;
        ties_t ties;
        ties_init(&ties, key, 1);
        pre_words_t pre;
#if ALIGNED_PATH
        if (stochastic) memcpy(pre.kv, ties.kv, sizeof pre.kv); /* the round keys, computed once by ties_init */
        if (stochastic && dt == DT_F32 && chunk >= SHORT) {
            pre_words_t two[2];
            memcpy(two[0].kv, ties.kv, sizeof two[0].kv);
            memcpy(two[1].kv, ties.kv, sizeof two[1].kv);
#ifdef _OPENMP
            int64_t me = omp_get_thread_num(), nth = omp_get_num_threads();
#else
            int64_t me = 0, nth = 1;
#endif
            bad += encode_u8_pipelined((const float *)x, length, x_stride, out, out_stride, chunk, key, offset,
                                       pos_stride, tasks * me / nth, tasks * (me + 1) / nth, buf, ubuf, &ties, two);
            resolve_ties(&ties);
            tie_flush(&ties, 1);
        } else
#endif
        {
        /* Chunks go up to GRID_BATCH and 8192 elements at a time: min/max of each, their grids side by side
         * (grids_of), then their codes while the batch is still in L1. Stochastic chunks of SHORT elements
         * and up one at a time: chunk_minmax may leave Philox words in pre for the chunk's codes. */
        int64_t per = stochastic && chunk >= SHORT ? 1 : 8192 / chunk;
        per = batch_size(per, tasks);
        int64_t batches = (tasks + per - 1) / per;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batches; b++) {
            int64_t t0 = b * per, cnt = tasks - t0 < per ? tasks - t0 : per;
            float mn[GRID_BATCH], mx[GRID_BATCH];
            int flagged[GRID_BATCH];
            grid_t g[GRID_BATCH];
            for (int64_t i = 0; i < cnt; i++) {
                int64_t t = t0 + i, r = t / chunks, a = (t % chunks) * chunk;
                int64_t n = length - a < chunk ? length - a : chunk;
                uint64_t pos = (uint64_t)(offset + r * pos_stride + a);
                pre.e0 = pos;
#if ALIGNED_PATH
                pre.subs = stochastic && (pos & 255) == 0 && n >= SHORT ? PRE_SUBS : 0;
#else
                pre.subs = 0;
#endif
                const void *xr = (const char *)x + (size_t)(r * x_stride) * esize;
                flagged[i] = chunk_minmax(xr, dt, a, n, &mn[i], &mx[i], buf, &pre);
            }
            grids_of(mn, mx, (int)cnt, g);
            for (int64_t i = 0; i < cnt; i++) {
                int64_t t = t0 + i, r = t / chunks, c = t % chunks, a = c * chunk;
                int64_t n = length - a < chunk ? length - a : chunk;
                uint8_t *o = out + r * out_stride;
                if (flagged[i]) {
                    bad += flag_chunk(o, chunks, c, a, n);
                    continue;
                }
                put_header(o, chunks, c, mn[i], mx[i]);
                encode_chunk((const char *)x + (size_t)(r * x_stride) * esize, dt, a, n, o + 8 * chunks + a, g[i],
                             stochastic, key, (uint64_t)(offset + r * pos_stride + a), buf, ubuf, &ties, &pre, 0);
            }
        }
#if ALIGNED_PATH
        resolve_ties(&ties);
#endif
        if (stochastic) tie_flush(&ties, 1);
        }
    }
    return bad;
}

/* The fp32 values of codes [a, a + n) of one row (y = fl32(fl32((c - zero) * step) + sub), or float64). */
static inline void decode_block(const uint8_t *c, int64_t n, grid_t g, float *y) {
    if (g.wide) {
        double mul = g.rng / 255.0, lo = (double)g.mn;
        for (int64_t k = 0; k < n; k++) y[k] = (float)(lo + (double)c[k] * mul);
        return;
    }
    const float zero = g.zero, step = g.step, sub = g.sub;
    for (int64_t k = 0; k < n; k++) {
        float v = ((float)c[k] - zero) * step;
        y[k] = v + sub;
    }
}

/* The grids of chunks [c0, c0 + n) of a row (n <= GRID_BATCH) from its headers. */
static inline void header_grids(const uint8_t *row, int64_t chunks, int64_t c0, int n, grid_t *g) {
    float mn[GRID_BATCH], mx[GRID_BATCH];
    for (int i = 0; i < n; i++) { /* fixed-size copies: no memcpy call */
        memcpy(&mn[i], row + 4 * (c0 + i), 4);
        memcpy(&mx[i], row + 4 * (chunks + c0 + i), 4);
    }
    grids_of(mn, mx, n, g);
}

static inline grid_t header_grid(const uint8_t *row, int64_t chunks, int64_t c) {
    float mn, mx;
    memcpy(&mn, row + 4 * c, 4);
    memcpy(&mx, row + 4 * (chunks + c), 4);
    return grid_of(mn, mx);
}

/* Decode `rows` buffers (row r at buf + r * buf_stride bytes) of `length` elements each into out (row r at
 * out + r * out_stride elements of dtype dt), or, with reduce, their fp32 sum in row order into out (fp32).
 * Returns the number of flagged (NaN) chunks over all rows. */
int64_t mixprec_quant_decode_u8(const uint8_t *buf, int64_t rows, int64_t length, int64_t buf_stride, void *out, int dt,
                                int64_t out_stride, int64_t chunk, int reduce, int nthreads) {
    int64_t chunks = (length + chunk - 1) / chunk, bad = count_flagged(buf, rows, chunks, buf_stride);
    int64_t tasks = reduce ? chunks : rows * chunks;
    size_t esize = dt == DT_F32 ? 4 : 2;
#pragma omp parallel num_threads(nthreads) if (rows * length >= MIXPREC_GRAIN)
    {
        float y[SB], acc[SB];
        /* Chunks below 128 elements go up to GRID_BATCH at a time (as in the encode), at most SB elements
         * per batch, so that a batch of the fp32 sum fits acc; larger ones overlap a chunk's grid with the
         * decode of the one before it well enough on their own. */
        if (chunk < 128) {
        int64_t per = batch_size(SB / chunk, tasks);
        int64_t batches = reduce ? (chunks + per - 1) / per : rows * ((chunks + per - 1) / per);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batches; b++) {
            int64_t per_row = (chunks + per - 1) / per;
            int64_t r = reduce ? 0 : b / per_row, c0 = (reduce ? b : b % per_row) * per;
            int64_t cnt = chunks - c0 < per ? chunks - c0 : per, a0 = c0 * chunk;
            int64_t m0 = (length - a0 < cnt * chunk ? length - a0 : cnt * chunk); /* elements of the batch */
            grid_t g[GRID_BATCH];
            if (!reduce) {
                const uint8_t *row = buf + r * buf_stride;
                header_grids(row, chunks, c0, (int)cnt, g);
                void *o = (char *)out + (size_t)(r * out_stride) * esize;
                for (int64_t i = 0; i < cnt; i++) { /* chunk < 128 <= SB: one block each */
                    int64_t a = a0 + i * chunk, n = length - a < chunk ? length - a : chunk;
                    if (dt == DT_F32) {
                        decode_block(row + 8 * chunks + a, n, g[i], (float *)o + a);
                    } else {
                        decode_block(row + 8 * chunks + a, n, g[i], y);
                        store(o, dt, a, y, n);
                    }
                }
                continue;
            }
            float *o = (float *)out; /* the sum: the batch's m0 <= SB elements, row by row */
            for (int64_t q = 0; q < rows; q++) {
                const uint8_t *row = buf + q * buf_stride;
                float *dst = q == 0 ? (rows == 1 ? o + a0 : acc) : y;
                header_grids(row, chunks, c0, (int)cnt, g);
                for (int64_t i = 0; i < cnt; i++) {
                    int64_t a = a0 + i * chunk, n = length - a < chunk ? length - a : chunk;
                    decode_block(row + 8 * chunks + a, n, g[i], dst + i * chunk);
                }
                if (q > 0) {
                    float *d = q == rows - 1 ? o + a0 : acc;
                    for (int64_t k = 0; k < m0; k++) d[k] = acc[k] + y[k];
                }
            }
        }
        } else {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t r = reduce ? 0 : t / chunks, c = reduce ? t : t % chunks, a = c * chunk;
            int64_t n = length - a < chunk ? length - a : chunk;
            if (!reduce) {
                const uint8_t *row = buf + r * buf_stride;
                grid_t g = header_grid(row, chunks, c);
                void *o = (char *)out + (size_t)(r * out_stride) * esize;
                for (int64_t s = 0; s < n; s += SB) {
                    int64_t m = n - s < SB ? n - s : SB;
                    if (dt == DT_F32) {
                        decode_block(row + 8 * chunks + a + s, m, g, (float *)o + a + s);
                    } else {
                        decode_block(row + 8 * chunks + a + s, m, g, y);
                        store(o, dt, a + s, y, m);
                    }
                }
                continue;
            }
            float *o = (float *)out;
            for (int64_t s = 0; s < n; s += SB) {
                int64_t m = n - s < SB ? n - s : SB;
                float *dst = rows == 1 ? o + a + s : acc;
                decode_block(buf + 8 * chunks + a + s, m, header_grid(buf, chunks, c), dst);
                for (int64_t q = 1; q < rows; q++) {
                    const uint8_t *row = buf + q * buf_stride;
                    decode_block(row + 8 * chunks + a + s, m, header_grid(row, chunks, c), y);
                    float *d = q == rows - 1 ? o + a + s : acc;
                    for (int64_t k = 0; k < m; k++) d[k] = acc[k] + y[k];
                }
            }
        }
        }
    }
    return bad;
}
