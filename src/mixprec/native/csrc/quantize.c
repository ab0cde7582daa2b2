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
#include <float.h>
#include <math.h>

#include "common.h"
#include "philox.h"
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
/* Stochastic codes from Philox words in registers at stream positions on the 256 grid (16-bit lanes: BW;
 * with VBMI, vpermt2b gathers and stores the bytes) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ALIGNED_PATH 1
#else
#define ALIGNED_PATH 0
#endif
#define SB 1024 /* elements per sub-block: 4 KiB of fp32 scratch per thread */
#define SCAN_AHEAD 1024 /* elements between a min/max scan's loads and its prefetches */
#define MAGIC 8388608.0f /* 2**23: bits(fl32(q + 2**23)) & 0xFF = rne(q) for 0 <= q < 256 */

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

/* Elements [i, i + n) of row `x` as fp32: the row itself (fp32) or `buf` (exact widening of fp16/bf16). */
static inline const float *as_f32(const void *x, int dt, int64_t i, int64_t n, float *buf) {
    if (dt == DT_F32) return (const float *)x + i;
    if (dt == DT_F16) {
        const uint16_t *h = (const uint16_t *)x + i;
        int64_t k = 0;
#if defined(__AVX512F__)
        for (; k + 16 <= n; k += 16) /* exact widening */
            _mm512_storeu_ps(buf + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + k))));
#elif defined(__F16C__)
        for (; k + 8 <= n; k += 8)
            _mm256_storeu_ps(buf + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
#endif
        for (; k < n; k++) buf[k] = f16_to_f32(h[k]);
    } else {
        const uint16_t *h = (const uint16_t *)x + i;
        for (int64_t k = 0; k < n; k++) buf[k] = bf16_to_f32(h[k]);
    }
    return buf;
}

#if defined(__AVX512F__)
/* One step of chunk_minmax's lane-wise min, max and NaN check (vminps/vmaxps: v < mn ? v : mn). */
static inline void minmax16(const float *p, __m512 *vmn, __m512 *vmx, __mmask16 *vnan) {
    __m512 v = _mm512_loadu_ps(p);
    *vmn = _mm512_min_ps(v, *vmn);
    *vmx = _mm512_max_ps(v, *vmx);
    *vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}

/* The min (max) over the lanes, as the scalar fold "lo = v[l] < lo ? v[l] : lo" for l = 1 .. 15 gives it:
 * the leftmost lane of the least value (a -0 or +0 bound keeps the sign the fold gives it). An in-order
 * tree, left operand winning ties (vminps returns its second operand unless the first is less): 4 steps of
 * latency instead of 15. NaN lanes may give another result than the fold; the caller flags those chunks. */
static inline float lanes_min(__m512 v) {
    v = _mm512_min_ps(_mm512_movehdup_ps(v), v);                                  /* lane 2k: 2k, 2k + 1 */
    v = _mm512_min_ps(_mm512_permute_ps(v, _MM_SHUFFLE(3, 2, 3, 2)), v);          /* lane 4k: 4k, 4k + 2 */
    v = _mm512_min_ps(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 3, 1, 1)), v);    /* lane 8k: 8k, 8k + 4 */
    return _mm512_cvtss_f32(_mm512_min_ps(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 2, 2, 2)), v));
}
static inline float lanes_max(__m512 v) {
    v = _mm512_max_ps(_mm512_movehdup_ps(v), v);
    v = _mm512_max_ps(_mm512_permute_ps(v, _MM_SHUFFLE(3, 2, 3, 2)), v);
    v = _mm512_max_ps(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 3, 1, 1)), v);
    return _mm512_cvtss_f32(_mm512_max_ps(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 2, 2, 2)), v));
}

/* The last m < 16 elements at p, folded into lane 0 after what it holds (the scalar tail loop's order): their
 * own leftmost min and max, which then win over lane 0 only when strictly beyond it. */
static inline void minmax_tail(const float *p, int64_t m, __m512 *vmn, __m512 *vmx, __mmask16 *vnan) {
    __mmask16 live = (__mmask16)((1u << m) - 1);
    __m512 v = _mm512_maskz_loadu_ps(live, p);
    *vnan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
    __m512 lo = _mm512_set1_ps(lanes_min(_mm512_mask_blend_ps(live, _mm512_set1_ps(INFINITY), v)));
    __m512 hi = _mm512_set1_ps(lanes_max(_mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), v)));
    *vmn = _mm512_mask_min_ps(*vmn, 1, lo, *vmn);
    *vmx = _mm512_mask_max_ps(*vmx, 1, hi, *vmx);
}
#endif

/* Philox words that chunk_minmax computes on the side: those of the first `subs` sub-blocks of a chunk
 * whose first stream position e0 is a multiple of 256, 16 vectors per sub-block (philox.h's layout). */
#define PRE_SUBS 4 /* 4 KiB per thread: the whole of a 4096-element chunk */
#define SHORT 512 /* chunks below this take their Philox bytes from stream_bytes, shared with their neighbours */
typedef struct {
    uint64_t e0;
    int64_t subs;
#if ALIGNED_PATH
    __m512i kv[20]; /* the round keys (philox.h) */
    __m512i w[16 * PRE_SUBS];
#endif
} pre_words_t;

/* min, max over the chunk; returns 1 when it holds NaN or +-Inf. Lane-wise (vminps/vmaxps semantics): the
 * sign of a zero bound is unspecified, as it is for torch.amin/amax. With pre (stochastic rounding), the
 * Philox words of the chunk's first sub-blocks too: the min/max loop waits on memory or on the latency of
 * vminps, and the rounds' independent multiplies fill the idle ports (the codes pass would pay for them). */
static int chunk_minmax(const void *x, int dt, int64_t a, int64_t n, float *pmn, float *pmx, float *buf,
                        pre_words_t *pre) {
    (void)pre; /* unused without the aligned path */
    float lo, hi;
    int bad;
#if defined(__AVX512F__)
    /* the same lane-wise operations as the scalar loops below, spelled out: gcc does not vectorize those */
    __m512 vmn = _mm512_set1_ps(as_f32(x, dt, a, 1, buf)[0]), vmx = vmn;
    __mmask16 vnan = 0;
    for (int64_t s = 0; s < n; s += SB) {
        int64_t m = n - s < SB ? n - s : SB, k = 0;
        const float *p = as_f32(x, dt, a + s, m, buf);
#if ALIGNED_PATH
        __m512i *w = pre && s / SB < pre->subs ? pre->w + 16 * (s / SB) : 0;
        if (w) /* a loop of its own: a test in the plain loop below slows the nearest encode */
            for (; k + 16 <= m; k += 16) {
                if ((k & 255) == 0) /* one group of 256 elements per 16 vectors */
                    mixprec_philox_words256(pre->kv, (pre->e0 + (uint64_t)(s + k)) >> 8, w + (k >> 6));
                minmax16(p + k, &vmn, &vmx, &vnan);
            }
#endif
        /* the lines SCAN_AHEAD elements on, as the stochastic scan asks for them (a prefetch past the end of
         * x or buf is harmless): at 16M fp32 elements the hardware prefetcher alone left this loop waiting on
         * memory (nearest encode 9.7 -> 8.6 ms on one thread, 4.3 -> 3.4 ms on two) */
        for (; k + 16 <= m; k += 16) {
            _mm_prefetch((const char *)(p + k + SCAN_AHEAD), _MM_HINT_T0);
            minmax16(p + k, &vmn, &vmx, &vnan);
        }
        if (k < m) minmax_tail(p + k, m - k, &vmn, &vmx, &vnan); /* only in the last sub-block: SB % 16 == 0 */
    }
    lo = lanes_min(vmn);
    hi = lanes_max(vmx);
    bad = vnan != 0;
#else
    float mn[16], mx[16];
    uint32_t nan[16];
    float first = as_f32(x, dt, a, 1, buf)[0];
    for (int l = 0; l < 16; l++) {
        mn[l] = first;
        mx[l] = first;
        nan[l] = 0;
    }
    for (int64_t s = 0; s < n; s += SB) {
        int64_t m = n - s < SB ? n - s : SB, k = 0;
        const float *p = as_f32(x, dt, a + s, m, buf);
#if defined(__AVX__)
        if (k + 16 <= m) { /* the 16 lanes in two AVX registers: gcc does not vectorize the selects below */
            __m256 mn0 = _mm256_loadu_ps(mn), mn1 = _mm256_loadu_ps(mn + 8);
            __m256 mx0 = _mm256_loadu_ps(mx), mx1 = _mm256_loadu_ps(mx + 8), bad0 = _mm256_setzero_ps(), bad1 = bad0;
            for (; k + 16 <= m; k += 16) { /* vminps(v, mn) = v < mn ? v : mn; vmaxps alike */
                __m256 v0 = _mm256_loadu_ps(p + k), v1 = _mm256_loadu_ps(p + k + 8);
                mn0 = _mm256_min_ps(v0, mn0), mn1 = _mm256_min_ps(v1, mn1);
                mx0 = _mm256_max_ps(v0, mx0), mx1 = _mm256_max_ps(v1, mx1);
                bad0 = _mm256_or_ps(bad0, _mm256_cmp_ps(v0, v0, _CMP_UNORD_Q));
                bad1 = _mm256_or_ps(bad1, _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
            }
            _mm256_storeu_ps(mn, mn0), _mm256_storeu_ps(mn + 8, mn1);
            _mm256_storeu_ps(mx, mx0), _mm256_storeu_ps(mx + 8, mx1);
            uint32_t b0 = (uint32_t)_mm256_movemask_ps(bad0), b1 = (uint32_t)_mm256_movemask_ps(bad1);
            nan[0] |= b0 | b1;
        }
#endif
        for (; k + 16 <= m; k += 16) {
            for (int l = 0; l < 16; l++) {
                float v = p[k + l];
                mn[l] = v < mn[l] ? v : mn[l];
                mx[l] = v > mx[l] ? v : mx[l];
                nan[l] |= (uint32_t)(v != v);
            }
        }
        for (; k < m; k++) {
            float v = p[k];
            mn[0] = v < mn[0] ? v : mn[0];
            mx[0] = v > mx[0] ? v : mx[0];
            nan[0] |= (uint32_t)(v != v);
        }
    }
    lo = mn[0], hi = mx[0];
    bad = nan[0] != 0;
    for (int l = 1; l < 16; l++) {
        lo = mn[l] < lo ? mn[l] : lo;
        hi = mx[l] > hi ? mx[l] : hi;
        bad |= nan[l] != 0;
    }
#endif
    *pmn = lo;
    *pmx = hi;
    return bad || !isfinite(lo) || !isfinite(hi);
}

#if ALIGNED_PATH
/* chunk_minmax of an fp32 chunk (with its Philox words, like pre) as a scan that the codes loop of the chunk
 * before it advances 64 elements at a time (scan_step), finished by scan_finish: the next chunk's loads
 * then overlap the codes' arithmetic instead of waiting in a pass of their own. Same lane-wise operations
 * in the same order as chunk_minmax, so the same bounds. */
typedef struct {
    const float *p;
    int64_t n, k; /* elements; the vectors before k are done */
    __m512 mn, mx;
    __mmask16 nan;
    pre_words_t *pre; /* its words (pre->subs sub-blocks), or none */
} scan_t;

static inline void scan_start(scan_t *sc, const float *p, int64_t n, pre_words_t *pre) {
    sc->p = p;
    sc->n = n;
    sc->k = 0;
    sc->mn = sc->mx = _mm512_set1_ps(p[0]);
    sc->nan = 0;
    sc->pre = pre;
}

/* The Philox words of the 256 elements at element k of a scanned chunk (k a multiple of 256), in a call of its
 * own: inlined, the rounds' registers spill the codes loop's. Two chains per 256 elements rather than eight
 * per 1024: at 1M elements the codes loop waits on the next chunk's loads now and then, and ~130 vector
 * operations every 4 groups of codes fill those gaps, where ~500 every 16 (a reorder buffer's worth) did not
 * (one thread: 388 -> 350 us against a nearest encode of 255-263 us; no change at 256K, in L2). */
static __attribute__((noinline)) void scan_words(pre_words_t *pre, int64_t k) {
    mixprec_philox_words256(pre->kv, (pre->e0 + (uint64_t)k) >> 8, pre->w + (k >> 6));
}

/* The vectors of the scan before element `upto`. */
static inline void scan_step(scan_t *sc, int64_t upto) {
    int64_t end = upto < sc->n ? upto : sc->n, k = sc->k, words = sc->pre ? sc->pre->subs * SB : 0;
    __m512 vmn = sc->mn, vmx = sc->mx;
    __mmask16 vnan = sc->nan;
    for (; k + 16 <= end; k += 16) {
        if ((k & 255) == 0 && k < words) scan_words(sc->pre, k); /* each group of 256 as its scan reaches it */
        __m512 v = _mm512_loadu_ps(sc->p + k);
        vmn = _mm512_min_ps(v, vmn);
        vmx = _mm512_max_ps(v, vmx);
        vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    sc->k = k;
    sc->mn = vmn;
    sc->mx = vmx;
    sc->nan = vnan;
}

/* The rest of the scan, and chunk_minmax's result. */
static int scan_finish(scan_t *sc, float *pmn, float *pmx) {
    scan_step(sc, sc->n);
    if (sc->k < sc->n) minmax_tail(sc->p + sc->k, sc->n - sc->k, &sc->mn, &sc->mx, &sc->nan);
    float lo = lanes_min(sc->mn), hi = lanes_max(sc->mx);
    *pmn = lo;
    *pmx = hi;
    return sc->nan != 0 || !isfinite(lo) || !isfinite(hi);
}
#endif

/* A thread's primary bytes of one stream: groups [g0, g1) of 256 positions in u, computed 4 at a time and
 * kept, because a thread's chunks follow each other in the stream: chunks smaller than 1024 elements read the
 * groups the chunk before them computed instead of computing 1024 positions each. */
#define UBUF (2 * 1024) /* SB elements span at most SB / 256 + 1 groups, computed 4 at a time */
typedef struct {
    uint64_t g0, g1; /* g1 == g0: nothing kept */
    uint8_t u[UBUF];
} ubytes_t;

/* The primary bytes of stream positions [p, p + n) (n <= SB) of the stream `key` (one per ubytes_t). */
static inline const uint8_t *stream_bytes(uint64_t key, uint64_t p, int64_t n, ubytes_t *ub) {
    uint64_t g0 = p >> 8, g1 = ((p + (uint64_t)n - 1) >> 8) + 1;
    if (g0 < ub->g0 || g1 > ub->g1) {
        uint64_t g = g0;
        for (; g < g1; g += 4) mixprec_philox_bytes1024(key, g, ub->u + 256 * (g - g0));
        ub->g0 = g0;
        ub->g1 = g;
    }
    return ub->u + (p - (ub->g0 << 8));
}

/* Ties are flagged in bit masks, 16 elements per uint16_t: the vector loops store a compare mask as is, and
 * bit w of a 64-bit summary nz says whether mask w has any. FOR_EACH_TIE(k, masks, nz) runs its body for
 * each flagged k, in order (about 1 element in 256): one trip per tie, none per empty mask. */
#define TIE_WORDS (SB / 16)
#define FOR_EACH_TIE(k, masks, nz)                                                                                    \
    for (uint64_t n_ = (nz); n_; n_ &= n_ - 1)                                                                        \
        for (uint32_t w_ = (uint32_t)__builtin_ctzll(n_), b_ = (masks)[w_], k;                                       \
             b_ && (k = 16 * w_ + (uint32_t)__builtin_ctz(b_), 1); b_ &= b_ - 1)

/* Pending ties of one thread: where the code is, its stream position, the remainder 256 frac - f8 (exact)
 * and the code if rounded up. Kept across chunks and resolved 32 at a time (tie_flush), so that the
 * secondary words of a batch share the 10 rounds' multiply latency. A flush waits for TIE_FLUSH ties, so
 * that moving the unbatched rest (< 32) to the front is rare; a sub-block adds at most SB ties. */
#define TIE_FLUSH 256
#define TIE_CAP (TIE_FLUSH + SB + 32)
/* The aligned loop (AVX-512) leaves its tie masks in a list that resolve_ties queues with vector code every
 * TIE_SUBS sub-blocks: a scalar loop over about 4 ties per sub-block mispredicted its exit each time. */
#define TIE_SUBS 16
#define TIE_LIST (2 * TIE_SUBS * SB / 32) /* masks: SB / 32 per sub-block at most, and room for the split ones */
_Static_assert(TIE_SUBS <= 16, "resolve_ties looks the slots up in two vectors of 8");
typedef struct {
    int64_t n;
    int of_q; /* rem holds the uint8 grid coordinate q; tie_flush derives remainder and rounded-up code */
    uint64_t key;
#if defined(__AVX512F__)
    __m512i kv[20]; /* the round keys of key (philox.h), set once per thread */
#endif
#if ALIGNED_PATH
    int subs;   /* sub-blocks in the slots below */
    int64_t nl; /* masks in lm */
    uint64_t lm[TIE_LIST + 8], li[TIE_LIST + 8]; /* a mask with ties; 32 slot + its index in the sub-block */
    int64_t sp[TIE_SUBS], sc[TIE_SUBS], se[TIE_SUBS]; /* a slot's x, codes and first stream position */
    float ssub[TIE_SUBS], sscale[TIE_SUBS], szero[TIE_SUBS]; /* and its grid */
#endif
    uint8_t *dst[TIE_CAP];
    uint64_t e[TIE_CAP];
    float rem[TIE_CAP];
    int32_t up[TIE_CAP];
} ties_t;

static inline void ties_init(ties_t *t, uint64_t key, int of_q) {
    t->n = 0;
    t->of_q = of_q;
    t->key = key;
#if defined(__AVX512F__)
    mixprec_philox_round_keys(key, t->kv);
#endif
#if ALIGNED_PATH
    t->subs = 0;
    t->nl = 0;
#endif
}

static inline void tie_push(ties_t *t, uint8_t *dst, uint64_t e, float rem, int32_t up) {
    t->dst[t->n] = dst;
    t->e[t->n] = e;
    t->rem[t->n] = rem;
    t->up[t->n++] = up;
}

/* A tie of the uint8 grid by its q (of_q): the arithmetic waits for tie_flush, 8 ties per vector. */
static inline void tie_push_q(ties_t *t, uint8_t *dst, uint64_t e, float q) {
    t->dst[t->n] = dst;
    t->e[t->n] = e;
    t->rem[t->n++] = q;
}

/* The remainder 256 q - floor(256 q) and the rounded-up code clamp(floor(q) + 1) of a uint8 tie at q, on
 * the vector loops' fp32 operations (S = floor(256 q), floor(q) = S >> 8). */
static inline float tie_of_q(float q, int32_t *up) {
    float s = q * 256.0f, fs = floorf(s);
    int32_t u = ((int32_t)fs >> 8) + 1;
    *up = u < 0 ? 0 : (u > 255 ? 255 : u);
    return s - fs;
}

/* Resolve pending ties, up when the secondary word w < rem 2**32 (both exact in double): every batch of 32,
 * and with `all` the rest too (the end of a thread's work). What is left moves to the front. The choice is
 * a coin flip, so it is made without a branch (a mispredicted one per two ties cost more than the words). */
static void tie_flush(ties_t *t, int all) {
    int64_t i = 0;
    for (; i + 32 <= t->n || (all && i < t->n); i += 32) {
        int cnt = t->n - i < 32 ? (int)(t->n - i) : 32;
        uint64_t e[32];
        uint32_t w[32], up = 0;
        if (cnt < 32) /* a partial batch: repeat its first position */
            for (int j = 0; j < 32; j++) e[j] = t->e[i + (j < cnt ? j : 0)];
#if defined(__AVX512F__)
        mixprec_philox_tie_words32_kv(t->kv, cnt < 32 ? e : t->e + i, w);
#else
        mixprec_philox_tie_words32(t->key, cnt < 32 ? e : t->e + i, w);
#endif
#if defined(__AVX512F__)
        for (int b = 0; b < 32; b += 8) {
            __mmask8 live = (__mmask8)(cnt - b >= 8 ? 0xFF : (cnt > b ? (1u << (cnt - b)) - 1 : 0));
            __m256 rem = _mm256_maskz_loadu_ps(live, t->rem + i + b);
            if (t->of_q) { /* tie_of_q, 8 at a time */
                __m256 s8 = _mm256_mul_ps(rem, _mm256_set1_ps(256.0f));
                __m256 fs = _mm256_round_ps(s8, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                __m256i u = _mm256_add_epi32(_mm256_srai_epi32(_mm256_cvttps_epi32(fs), 8), _mm256_set1_epi32(1));
                u = _mm256_min_epi32(_mm256_max_epi32(u, _mm256_setzero_si256()), _mm256_set1_epi32(255));
                _mm256_storeu_si256((__m256i *)(t->up + i + b), u); /* TIE_CAP leaves room for a batch */
                rem = _mm256_sub_ps(s8, fs);
            }
            __m512d wd = _mm512_cvtepu32_pd(_mm256_loadu_si256((const __m256i *)(w + b)));
            __m512d rd = _mm512_mul_pd(_mm512_cvtps_pd(rem), _mm512_set1_pd(0x1p32));
            up |= (uint32_t)_mm512_mask_cmp_pd_mask(live, wd, rd, _CMP_LT_OQ) << b;
        }
#else
        for (int j = 0; j < cnt; j++) {
            float rem = t->rem[i + j];
            if (t->of_q) rem = tie_of_q(rem, &t->up[i + j]);
            up |= (uint32_t)((double)w[j] < (double)rem * 0x1p32) << j;
        }
#endif
        for (int j = 0; j < cnt; j++) {
            uint8_t *c = t->dst[i + j];
            uint32_t take = 0u - ((up >> j) & 1u);
            *c = (uint8_t)(*c ^ ((*c ^ (uint32_t)t->up[i + j]) & take));
        }
    }
    int64_t left = i < t->n ? t->n - i : 0; /* fewer than 32 */
    for (int64_t j = 0; j < left; j++) {
        t->dst[j] = t->dst[i + j];
        t->e[j] = t->e[i + j];
        t->rem[j] = t->rem[i + j];
        t->up[j] = t->up[i + j];
    }
    t->n = left;
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

#if !defined(__AVX512F__) && defined(__AVX2__)
/* The AVX2 form of codes_stochastic's vector loop: elements k .. k + 31 from their primary bytes B (8 per
 * vector), 32 codes per store; vpackusdw and vpackuswb saturate, so a code below 0 (q a few ulps under 0)
 * becomes 0 and 256 becomes 255, as the clamp does. */
static inline __attribute__((always_inline)) void codes32_avx2(const float *p, uint8_t *c, int64_t k,
                                                               const __m256i B[4], float sub, float scale, float zero,
                                                               ties_t *ties, uint64_t e0) {
    const __m256 vsub = _mm256_set1_ps(sub), vscale = _mm256_set1_ps(scale), vzero = _mm256_set1_ps(zero);
    const __m256i c255 = _mm256_set1_epi32(255), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i d[4];
    uint32_t tied32 = 0;
    for (int h = 0; h < 4; h++) {
        __m256 q = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p + k + 8 * h), vsub), vscale), vzero);
        const int down = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
        __m256 s256 = _mm256_round_ps(_mm256_mul_ps(q, _mm256_set1_ps(256.0f)), down);
        __m256i D = _mm256_sub_epi32(_mm256_cvttps_epi32(s256), B[h]); /* S - B, S = floor(256 q) exactly */
        __m256i tied = _mm256_cmpeq_epi32(_mm256_and_si256(D, c255), _mm256_setzero_si256());
        tied32 |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(tied)) << (8 * h);
        d[h] = _mm256_srai_epi32(_mm256_add_epi32(D, c255), 8);
    }
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(d[0], d[1]), _mm256_packus_epi32(d[2], d[3]));
    _mm256_storeu_si256((__m256i *)(c + k), _mm256_permutevar8x32_epi32(w, order));
    for (; tied32; tied32 &= tied32 - 1) queue_tie(ties, p, k + __builtin_ctz(tied32), sub, scale, zero, c, e0);
}

/* The whole 32-element blocks of a sub-block (m <= SB) whose first stream position is a multiple of 256, the
 * primary bytes straight from the Philox words (mixprec_philox_words1024_avx2); returns the elements done. */
static int64_t codes_stochastic_words_avx2(const float *p, uint8_t *c, int64_t m, float sub, float scale, float zero,
                                           const __m256i w8[32], ties_t *ties, uint64_t e0) {
    const __m256i ff = _mm256_set1_epi32(0xFF);
    int64_t k = 0;
    for (; k + 32 <= m; k += 32) { /* 256 i + 64 b + 16 j0 + (0 .. 31), j0 even: w8[8 i + 2 j0 .. + 3] */
        const __m256i *wk = w8 + 8 * (k >> 8) + 2 * ((k >> 4) & 3);
        const __m128i by = _mm_cvtsi32_si128(8 * (int)((k >> 6) & 3));
        __m256i B[4];
        for (int h = 0; h < 4; h++) B[h] = _mm256_and_si256(_mm256_srl_epi32(wk[h], by), ff);
        codes32_avx2(p, c, k, B, sub, scale, zero, ties, e0);
    }
    return k;
}
#endif

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

#if ALIGNED_PATH
#if defined(__AVX512VBMI__)
/* vpermt2b indices for codes_stochastic_aligned. PICK: the primary byte 0 of the dwords of a word pair
 * (a, b) (b's from 64 on) in the 16-bit lanes where vpackusdw(a, b) puts them (128-bit lane L: a[4 L ..
 * 4 L + 3], then b[4 L .. 4 L + 3]); adding b picks byte b; the odd bytes are zeroed by the mask. HIGH: the
 * high bytes of two such 16-bit vectors (elements 0..31, and 32..63 from 64 on) in element order. */
static const uint8_t PICK[64] __attribute__((aligned(64))) = {
    0,  0, 4,  0, 8,  0, 12, 0, 64, 0, 68,  0, 72,  0, 76,  0, 16, 0, 20, 0, 24, 0, 28,  0, 80,  0, 84,  0, 88,  0, 92,  0,
    32, 0, 36, 0, 40, 0, 44, 0, 96, 0, 100, 0, 104, 0, 108, 0, 48, 0, 52, 0, 56, 0, 60, 0, 112, 0, 116, 0, 120, 0, 124, 0};
static const uint8_t HIGH[64] __attribute__((aligned(64))) = {
    1,  3,  5,  7,  17, 19, 21, 23, 33, 35, 37,  39,  49,  51,  53,  55,  9,  11, 13, 15, 25,  27,  29,  31,  41,  43,  45,  47,  57,  59,  61,  63,
    65, 67, 69, 71, 81, 83, 85, 87, 97, 99, 101, 103, 113, 115, 117, 119, 73, 75, 77, 79, 89, 91, 93, 95, 105, 107, 109, 111, 121, 123, 125, 127};
#endif

#if defined(__AVX512VBMI__)
typedef __m512i byte_sel_t; /* which byte of the Philox words a group reads: vpermt2b indices */
static inline byte_sel_t byte_sel(__m512i pick, int64_t g) {
    return _mm512_add_epi8(pick, _mm512_set1_epi8((char)(g & 3)));
}
#else
typedef __m128i byte_sel_t; /* the shift count */
static inline byte_sel_t byte_sel(__m512i pick, int64_t g) { (void)pick; return _mm_cvtsi32_si128(8 * (int)(g & 3)); }
#endif

/* Group x[0 .. 63]'s codes into c and its two tie masks (one per half, even bits: resolve_ties) into t. */
static inline __attribute__((always_inline)) void group_codes(const float *x, uint8_t *c, const __m512i *wg,
                                                              byte_sel_t sel, __m512 vsub, __m512 vscale,
                                                              __m512 vzero, int has_sub, int has_zero, uint64_t *t) {
    const __m512i c255 = _mm512_set1_epi16(255);
    const __mmask64 low = 0x5555555555555555ull;
    const int down = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
    __m512i e[2];
    for (int h = 0; h < 2; h++) { /* elements 32 h .. 32 h + 31 */
        __m512 s0 = grid_s16(x + 32 * h, vsub, vscale, vzero, has_sub, has_zero);
        __m512 s1 = grid_s16(x + 32 * h + 16, vsub, vscale, vzero, has_sub, has_zero);
        __m512i S = _mm512_packus_epi32(_mm512_cvt_roundps_epi32(s0, down), _mm512_cvt_roundps_epi32(s1, down));
#if defined(__AVX512VBMI__)
        __m512i B = _mm512_maskz_permutex2var_epi8(low, wg[2 * h], sel, wg[2 * h + 1]);
#else
        const __m512i ff = _mm512_set1_epi32(0xFF);
        __m512i B = _mm512_packus_epi32(_mm512_and_si512(_mm512_srl_epi32(wg[2 * h], sel), ff),
                                        _mm512_and_si512(_mm512_srl_epi32(wg[2 * h + 1], sel), ff));
#endif
        _store_mask64((__mmask64 *)(t + h), _mm512_mask_cmpeq_epi8_mask(low, S, B)); /* kmovq to memory: no p0 */
        e[h] = _mm512_adds_epu16(_mm512_subs_epu16(S, B), c255);
    }
#if defined(__AVX512VBMI__)
    _mm512_storeu_si512((void *)c, _mm512_permutex2var_epi8(e[0], _mm512_load_si512((const void *)HIGH), e[1]));
#else
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i hb = _mm512_packus_epi16(_mm512_srli_epi16(e[0], 8), _mm512_srli_epi16(e[1], 8));
    _mm512_storeu_si512((void *)c, _mm512_permutexvar_epi32(order, hb));
#endif
}

/* The scan of the next chunk in registers: 64 elements at sk when that is all scan_step would do (and the
 * Philox words due there), else scan_step itself through the struct. ok: lanes without a NaN so far (a
 * masked compare per vector; OR-ing unordered masks costs a kor on port 0 as well). The scan also asks for
 * the lines SCAN_AHEAD elements on (a prefetch past the end of x is harmless): with the codes' arithmetic
 * between its loads, the hardware prefetcher alone left the 16M-element encode waiting on memory (12.8 ms
 * against 11.5 ms with it, one thread). */
static inline __attribute__((always_inline)) void scan_group(scan_t *sc, int64_t upto, int64_t words, int64_t *sk,
                                                             __m512 *mn, __m512 *mx, __mmask16 *ok) {
    if ((*sk & 63) == 0 && *sk + 64 == upto && upto <= sc->n) {
        if ((*sk & 255) == 0 && *sk < words) scan_words(sc->pre, *sk);
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)(sc->p + *sk + SCAN_AHEAD + 16 * i), _MM_HINT_T0);
            __m512 v = _mm512_loadu_ps(sc->p + *sk + 16 * i);
            *mn = _mm512_min_ps(v, *mn);
            *mx = _mm512_max_ps(v, *mx);
            *ok = _mm512_mask_cmp_ps_mask(*ok, v, v, _CMP_ORD_Q);
        }
        *sk += 64;
    } else {
        sc->k = *sk, sc->mn = *mn, sc->mx = *mx, sc->nan = (__mmask16)~*ok;
        scan_step(sc, upto);
        *sk = sc->k, *mn = sc->mn, *mx = sc->mx, *ok = (__mmask16)~sc->nan;
    }
}

/* codes_stochastic_aligned for one shape of grid (has_sub, has_zero) and with or without a scan. */
static inline __attribute__((always_inline)) int64_t codes_aligned_body(const float *restrict p, uint8_t *restrict c,
                                                                        int64_t m, __m512 vsub, __m512 vscale,
                                                                        __m512 vzero, int has_sub, int has_zero,
                                                                        const __m512i *w, uint64_t *restrict tie,
                                                                        scan_t *next, int64_t base) {
#if defined(__AVX512VBMI__)
    const __m512i pick = _mm512_load_si512((const void *)PICK);
#else
    const __m512i pick = _mm512_setzero_si512();
#endif
    const byte_sel_t sel[4] = {byte_sel(pick, 0), byte_sel(pick, 1), byte_sel(pick, 2), byte_sel(pick, 3)};
    int64_t groups = m >> 6, g = 0, sk = 0, words = 0;
    __m512 mn = _mm512_setzero_ps(), mx = mn;
    __mmask16 ok = 0;
    if (next) {
        sk = next->k, mn = next->mn, mx = next->mx, ok = (__mmask16)~next->nan;
        words = next->pre ? next->pre->subs * SB : 0;
    }
    for (; g + 4 <= groups; g += 4) { /* the four groups of one set of Philox words: constant byte selectors */
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            if (next) scan_group(next, base + 64 * (g + j + 1), words, &sk, &mn, &mx, &ok);
            group_codes(p + 64 * (g + j), c + 64 * (g + j), w + g, sel[j], vsub, vscale, vzero, has_sub, has_zero,
                        tie + 2 * (g + j));
        }
    }
    for (; g < groups; g++) {
        if (next) scan_group(next, base + 64 * (g + 1), words, &sk, &mn, &mx, &ok);
        group_codes(p + 64 * g, c + 64 * g, w + 4 * (g >> 2), byte_sel(pick, g), vsub, vscale, vzero, has_sub, has_zero,
                    tie + 2 * g);
    }
    if (next) next->k = sk, next->mn = mn, next->mx = mx, next->nan = (__mmask16)~ok;
    return 64 * groups;
}

/* Stochastic codes of the whole 64-element groups of a sub-block (m <= SB elements) whose first stream
 * position is a multiple of 256, from the Philox words w of its groups (philox.h: byte b of word j of group
 * i is the 16 elements at 256 i + 64 b + 16 j). Returns the number of elements done (m rounded down to a
 * multiple of 64); the ties of half h of group g are flagged in tie[2 g + h] (bit layout: resolve_ties).
 * scale256 and zero256 are 256 scale and 256 zero (exact; the caller checks that 256 scale is finite), so
 * that s = (x - sub) scale256 + zero256 = 256 q exactly (scaling by 2**8 commutes with the rounding; where q
 * would be subnormal, S below is 0 or -1 either way) and S = floor(256 q) = 256 floor(q) + f8 is one
 * conversion.
 *
 * The rest runs on 32 16-bit lanes per vector: S saturated to [0, 65535] by vpackusdw (S = -1, for q a few
 * ulps below 0, becomes 0: the code is 0 either way, and so is the rounded-up code tie_of_q gives a tie
 * there); B = the primary bytes in the same lanes (one vpermt2b for 32); a tie is f8 = B, equal low bytes
 * (one masked vpcmpeqb); with D = S - B saturated at 0, floor(q) + up = min(D + 255, 65535) >> 8 is
 * already clamped to [0, 255] (D = 0 when S < B, where floor(q) = 0 and f8 < B), and the high bytes of
 * D + 255 for 64 elements are one vpermt2b away from the stored codes. With next, each group also advances
 * the next chunk's scan to element base + 64 (g + 1) (base: the sub-block's first element in the chunk),
 * with the scan's state in registers (scan_group). */
static int64_t codes_stochastic_aligned(const float *restrict p, uint8_t *restrict c, int64_t m, float sub,
                                        float scale256, float zero256, const __m512i *w, uint64_t *restrict tie,
                                        scan_t *next, int64_t base) {
    const __m512 vsub = _mm512_set1_ps(sub), vscale = _mm512_set1_ps(scale256), vzero = _mm512_set1_ps(zero256);
    if (sub == 0.0f) /* an aligned grid (or min = 0) */
        return next ? codes_aligned_body(p, c, m, vsub, vscale, vzero, 0, 1, w, tie, next, base)
                    : codes_aligned_body(p, c, m, vsub, vscale, vzero, 0, 1, w, tie, 0, base);
    if (zero256 == 0.0f) /* min = sub, zero = 0 */
        return next ? codes_aligned_body(p, c, m, vsub, vscale, vzero, 1, 0, w, tie, next, base)
                    : codes_aligned_body(p, c, m, vsub, vscale, vzero, 1, 0, w, tie, 0, base);
    return codes_aligned_body(p, c, m, vsub, vscale, vzero, 1, 1, w, tie, next, base);
}

/* Take the sub-block just coded (x at p, codes at c, first stream position e0, its grid) into the next slot,
 * and its tie masks (tie, `masks` of them) into the list: the non-zero ones, 8 tested and packed at a time. */
static inline void list_ties(ties_t *t, const uint64_t *tie, int64_t masks, const float *p, uint8_t *c, uint64_t e0,
                             float sub, float scale, float zero) {
    int s = t->subs++;
    t->sp[s] = (int64_t)(intptr_t)p, t->sc[s] = (int64_t)(intptr_t)c, t->se[s] = (int64_t)e0;
    t->ssub[s] = sub, t->sscale[s] = scale, t->szero[s] = zero;
    const __m512i id = _mm512_add_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_epi64(32 * s));
    int64_t nl = t->nl;
    for (int64_t i = 0; i < masks; i += 8) {
        __mmask8 live = (__mmask8)(masks - i >= 8 ? 0xFF : (1u << (masks - i)) - 1);
        __m512i v = _mm512_maskz_loadu_epi64(live, (const void *)(tie + i));
        __mmask8 k = _mm512_test_epi64_mask(v, v);
        _mm512_storeu_si512((void *)(t->lm + nl), _mm512_maskz_compress_epi64(k, v)); /* lm has 8 spare */
        __m512i at = _mm512_add_epi64(id, _mm512_set1_epi64(i));
        _mm512_storeu_si512((void *)(t->li + nl), _mm512_maskz_compress_epi64(k, at));
        nl += __builtin_popcount(k);
    }
    t->nl = nl;
}

/* The bit index of a single set bit, per 64-bit lane. */
static inline __m512i bit_index(__m512i b) {
#if defined(__AVX512CD__)
    return _mm512_sub_epi64(_mm512_set1_epi64(63), _mm512_lzcnt_epi64(b));
#else
    static const uint64_t half[6] = {0xFFFFFFFF00000000ull, 0xFFFF0000FFFF0000ull, 0xFF00FF00FF00FF00ull,
                                     0xF0F0F0F0F0F0F0F0ull, 0xCCCCCCCCCCCCCCCCull, 0xAAAAAAAAAAAAAAAAull};
    __m512i r = _mm512_setzero_si512();
    for (int i = 0; i < 6; i++)
        r = _mm512_mask_add_epi64(r, _mm512_test_epi64_mask(b, _mm512_set1_epi64((long long)half[i])), r,
                                  _mm512_set1_epi64(32 >> i));
    return r;
#endif
}

/* Queue (tie_push_q's format, 8 at a time) the ties of the listed masks and empty the list and the slots.
 * Each step takes the lowest tie of 8 masks and puts those with more at the end of the list: about 1 mask
 * in 20 has two. Bit 2 u of the mask of half h of a group flags element 32 h + 16 ((u >> 2) & 1) + 4 (u >> 3)
 * + (u & 3) of the group (16-bit lane u of half h, in vpackusdw's order). */
static void resolve_ties(ties_t *t) {
    if (!t->subs) return;
    const __m512i P0 = _mm512_loadu_si512((const void *)t->sp), P1 = _mm512_loadu_si512((const void *)(t->sp + 8));
    const __m512i C0 = _mm512_loadu_si512((const void *)t->sc), C1 = _mm512_loadu_si512((const void *)(t->sc + 8));
    const __m512i E0 = _mm512_loadu_si512((const void *)t->se), E1 = _mm512_loadu_si512((const void *)(t->se + 8));
    const __m512 SUB = _mm512_loadu_ps(t->ssub), SCALE = _mm512_loadu_ps(t->sscale), ZERO = _mm512_loadu_ps(t->szero);
    const __m512i one = _mm512_set1_epi64(1), c3 = _mm512_set1_epi64(3), c31 = _mm512_set1_epi64(31);
    int64_t n = t->n, b = 0, end, nl = t->nl; /* in registers: the vector stores could alias t's fields */
    /* Rounds over [b, end): the steps of a round do not wait on each other (how many masks a step puts
     * back moves only where the next round starts), so they overlap. */
    for (; (end = nl) > b; b = end) {
        if (end + (end - b) > TIE_LIST) { /* the masks taken so far leave: a round puts back no more than it */
            /* takes (into lm + end, + 8 spare), and the first takes TIE_SUBS * SB / 32 = TIE_LIST / 2 at most */
            memmove(t->lm, t->lm + b, (size_t)(end - b) * sizeof *t->lm);
            memmove(t->li, t->li + b, (size_t)(end - b) * sizeof *t->li);
            end -= b, nl = end, b = 0;
        }
        for (int64_t i = b; i < end; i += 8) {
            __mmask8 live = (__mmask8)(end - i >= 8 ? 0xFF : (1u << (end - i)) - 1);
            __m512i m = _mm512_maskz_loadu_epi64(live, (const void *)(t->lm + i));
            __m512i id = _mm512_maskz_loadu_epi64(live, (const void *)(t->li + i));
            __m512i m1 = _mm512_sub_epi64(m, one), rest = _mm512_and_si512(m, m1);
            __mmask8 more = _mm512_test_epi64_mask(rest, rest);
            _mm512_storeu_si512((void *)(t->lm + nl), _mm512_maskz_compress_epi64(more, rest));
            _mm512_storeu_si512((void *)(t->li + nl), _mm512_maskz_compress_epi64(more, id));
            nl += __builtin_popcount(more);
            __m512i u = _mm512_srli_epi64(bit_index(_mm512_andnot_si512(m1, m)), 1); /* the lowest tie */
            __m512i q = _mm512_and_si512(id, c31), s = _mm512_srli_epi64(id, 5);
            __m512i elem = _mm512_add_epi64(
                _mm512_add_epi64(_mm512_slli_epi64(_mm512_and_si512(q, one), 5),
                                 _mm512_slli_epi64(_mm512_and_si512(_mm512_srli_epi64(u, 2), one), 4)),
                _mm512_add_epi64(_mm512_slli_epi64(_mm512_srli_epi64(u, 3), 2), _mm512_and_si512(u, c3)));
            __m512i k = _mm512_add_epi64(_mm512_slli_epi64(_mm512_srli_epi64(q, 1), 6), elem); /* in the sub-block */
            __m512i at = _mm512_add_epi64(_mm512_permutex2var_epi64(P0, s, P1), _mm512_slli_epi64(k, 2));
            __m256 x = _mm512_mask_i64gather_ps(_mm256_setzero_ps(), live, at, (const void *)0, 1);
            __m512i s32 = _mm512_zextsi256_si512(_mm512_cvtepi64_epi32(s));
            __m256 sub = _mm512_castps512_ps256(_mm512_permutexvar_ps(s32, SUB));
            __m256 scale = _mm512_castps512_ps256(_mm512_permutexvar_ps(s32, SCALE));
            __m256 zero = _mm512_castps512_ps256(_mm512_permutexvar_ps(s32, ZERO));
            if (n >= TIE_FLUSH) {
                t->n = n;
                tie_flush(t, 0);
                n = t->n;
            }
            _mm512_storeu_si512((void *)(t->dst + n), _mm512_add_epi64(_mm512_permutex2var_epi64(C0, s, C1), k));
            _mm512_storeu_si512((void *)(t->e + n), _mm512_add_epi64(_mm512_permutex2var_epi64(E0, s, E1), k));
            _mm256_storeu_ps(t->rem + n, _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(x, sub), scale), zero)); /* q */
            n += end - i >= 8 ? 8 : end - i;
        }
    }
    t->n = n;
    t->nl = 0;
    t->subs = 0;
}
#endif

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

static inline void store(void *out, int dt, int64_t i, const float *y, int64_t n) {
    if (dt == DT_F32) {
        memcpy((float *)out + i, y, (size_t)n * 4);
    } else if (dt == DT_F16) {
        uint16_t *h = (uint16_t *)out + i;
        int64_t k = 0;
#if defined(__AVX512F__)
        for (; k + 16 <= n; k += 16) /* round to nearest even, as f32_to_f16 */
            _mm256_storeu_si256((__m256i *)(h + k),
                                _mm512_cvtps_ph(_mm512_loadu_ps(y + k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; k < n; k++) h[k] = f32_to_f16(y[k]);
    } else {
        uint16_t *h = (uint16_t *)out + i;
        for (int64_t k = 0; k < n; k++) h[k] = f32_to_bf16(y[k]);
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

/* Chunks flagged non-finite: both wires store a NaN first header word (uint8's min, fp8's scale) for them. */
static int64_t count_flagged(const uint8_t *buf, int64_t rows, int64_t chunks, int64_t buf_stride) {
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            float first;
            memcpy(&first, buf + r * buf_stride + 4 * c, 4);
            bad += first != first;
        }
    return bad;
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

/* The Philox pieces on their own, for the tests: one block (Random123's known answers), the primary bytes
 * of stream positions [first, first + count), and the secondary words of n positions. */
void mixprec_quant_philox_block(const uint32_t *ctr, const uint32_t *key, uint32_t *out) {
    mixprec_philox4x32_10(ctr, key, out);
}

void mixprec_quant_philox_bytes(uint64_t key, int64_t first, int64_t count, uint8_t *out) {
    ubytes_t ub;
    ub.g0 = ub.g1 = 0;
    for (int64_t s = 0; s < count; s += SB) {
        int64_t m = count - s < SB ? count - s : SB;
        memcpy(out + s, stream_bytes(key, (uint64_t)(first + s), m, &ub), (size_t)m);
    }
}

void mixprec_quant_philox_tie_words(uint64_t key, const int64_t *pos, int64_t n, uint32_t *out) {
    for (int64_t k = 0; k < n; k++) out[k] = mixprec_philox_tie_word(key, (uint64_t)pos[k]);
}

/* ------------------------------------------------------------------ ScaledFP8 (mixprec.compress.fp8)
 * Per chunk: amax (NaN/Inf flag the chunk), k = the largest integer with amax 2**k <= the format's max
 * (clamped to [-126, 126], 0 for an all-zero chunk), header 2**-k, codes = the fp8 bytes of x 2**k rounded
 * to the format's grid (nearest even, or stochastic as ScaledFP8._round_stochastic_), at most fp8_ceiling(k)
 * in magnitude so that every decoded value is finite. Formats: 0 = e4m3fn
 * (bias 7, 3 fraction bits, max 448), 1 = e5m2 (bias 15, 2 fraction bits, max 57344). */
typedef struct {
    int man, emin, bias;
    double top;
} fp8fmt_t;

static inline fp8fmt_t fp8_format(int fmt) {
    fp8fmt_t f;
    f.man = fmt == 0 ? 3 : 2;
    f.emin = fmt == 0 ? -6 : -14;
    f.bias = fmt == 0 ? 7 : 15;
    f.top = fmt == 0 ? 448.0 : 57344.0;
    return f;
}

static inline double pow2_f64(int k) { /* 2**k exactly, |k| <= 1022: what exp2 returns, without the call */
    uint64_t b = (uint64_t)(k + 1023) << 52;
    double d;
    memcpy(&d, &b, 8);
    return d;
}

/* ScaledFP8.chunk_scales for one finite amax: frexp's estimate of floor(log2(top / a)), then corrected with
 * the exact products a 2**k (the estimate is off by at most one, whatever the rounding of the quotient). */
static inline int fp8_exponent(double a, double top) {
    if (!(a > 0)) return 0;
    /* frexp's exponent of q = top / a, from its bits: q is a normal double (a in (0, FLT_MAX], top in
     * [448, 57344]) */
    double q = top / a;
    uint64_t b;
    memcpy(&b, &q, 8);
    int k = (int)((b >> 52) & 0x7FF) - 1023; /* = frexp's e - 1 */
    k = k - (a * pow2_f64(k) > top);
    k = k + (a * pow2_f64(k + 1) <= top);
    return k < -126 ? -126 : (k > 126 ? 126 : k);
}

/* The format's spacing at a magnitude with fp32 exponent bits e (a power of two, at least the subnormal
 * spacing), and its reciprocal (exact). */
static inline float fp8_spacing(uint32_t e, fp8fmt_t f) {
    e = e < (uint32_t)(f.emin + 127) ? (uint32_t)(f.emin + 127) : e;
    return bits_f32((e - (uint32_t)f.man) << 23);
}

/* The fp8 byte of magnitude w (on the format's grid, w <= max) with sign bit `sign` (0 or 1): branch-free,
 * so that the loop vectorizes. */
static inline uint8_t fp8_code(float w, uint32_t sign, fp8fmt_t f, float inv_smin) {
    uint32_t b = f32_bits(w);
    int32_t e = (int32_t)(b >> 23) - 127;
    uint32_t normal = ((uint32_t)(e + f.bias) << f.man) | ((b >> (23 - f.man)) & ((1u << f.man) - 1));
    uint32_t sub = (uint32_t)(int32_t)(w * inv_smin); /* a multiple of the smallest spacing below 2**emin */
    return (uint8_t)((sign << 7) | (e >= f.emin ? normal : sub));
}

/* v = p times `up` (exact: a power of two, |v| <= max) in units of the format's spacing at |v|: returns
 * q = |v| / spacing (exact), with v's bits and the spacing. */
static inline float fp8_units(float v, fp8fmt_t f, uint32_t *bits, float *spacing) {
    uint32_t b = f32_bits(v);
    *bits = b;
    *spacing = fp8_spacing((b >> 23) & 0xFF, f);
    return bits_f32(b & 0x7FFFFFFFu) / *spacing;
}
#if defined(__AVX512F__)
/* The nearest-even code of 16 magnitudes (fp32 bits b, sign ignored) on the integer form of the same
 * rounding: in the format's normal range, the fraction rounded to f.man bits on the bits (a carry moves
 * into the exponent, as a round up to the next binade does), rebased to the format's exponent bias; below
 * it, |v| in units of the smallest spacing (exact) rounded to an integer, which is the subnormal code (or
 * the smallest normal one, 1 << man, when it rounds up to it). */
static inline __m512i fp8_nearest16(__m512i b, fp8fmt_t f) {
    __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), drop = _mm512_set1_epi32(23 - f.man);
    __m512i odd = _mm512_and_si512(_mm512_srlv_epi32(a, drop), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (22 - f.man)) - 1)), odd);
    __m512i normal = _mm512_sub_epi32(_mm512_srlv_epi32(r, drop), _mm512_set1_epi32((127 - f.bias) << f.man));
    __m512 units = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32((127 + f.man - f.emin) << 23)));
    __m512i sub = _mm512_cvt_roundps_epi32(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((f.emin + 127) << 23));
    return _mm512_mask_blend_epi32(small, normal, sub);
}

/* The stochastic code of 16 magnitudes (fp32 bits b, sign ignored) from their primary bytes ub, on the
 * integer form of fp8_codes' arithmetic: S = floor(256 |v| / spacing) = 256 floor(q) + f8 is, in the
 * normal range, the fraction bits of |v| cut 8 below the kept ones (and floor(q) plus one carries into the
 * exponent), below it the product |v| 2**(man - emin + 8) truncated (exact scaling, so an exact floor).
 * Up when ub < f8; ties (ub == f8) flagged in *tie for fp8_ties. */
static inline __m512i fp8_stochastic16(__m512i b, __m512i ub, fp8fmt_t f, __mmask16 *tie) {
    __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), ff = _mm512_set1_epi32(0xFF);
    __m512i f8 = _mm512_and_si512(_mm512_srlv_epi32(a, _mm512_set1_epi32(15 - f.man)), ff);
    __m512i kept = _mm512_sub_epi32(_mm512_srlv_epi32(a, _mm512_set1_epi32(23 - f.man)),
                                    _mm512_set1_epi32((127 - f.bias) << f.man));
    __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32((135 + f.man - f.emin) << 23)));
    __m512i S = _mm512_cvttps_epi32(scaled); /* 256 q below the normal range, q < 2**man */
    __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((f.emin + 127) << 23));
    f8 = _mm512_mask_and_epi32(f8, small, S, ff);
    kept = _mm512_mask_srli_epi32(kept, small, S, 8);
    *tie = _mm512_cmpeq_epi32_mask(ub, f8);
    return _mm512_mask_add_epi32(kept, _mm512_cmplt_epi32_mask(ub, f8), kept, _mm512_set1_epi32(1));
}

#elif defined(__AVX2__)
/* fp8_nearest16 and fp8_stochastic16 on 8 lanes: blends for the masked operations, signed compares (a is
 * below 2**31), vcvtps2dq under the default rounding mode (nearest even) for the explicit one. */
static inline __m256i fp8_nearest8(__m256i b, fp8fmt_t f) {
    const __m128i drop = _mm_cvtsi32_si128(23 - f.man);
    __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i odd = _mm256_and_si256(_mm256_srl_epi32(a, drop), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (22 - f.man)) - 1)), odd);
    __m256i normal = _mm256_sub_epi32(_mm256_srl_epi32(r, drop), _mm256_set1_epi32((127 - f.bias) << f.man));
    __m256 units = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32((127 + f.man - f.emin) << 23)));
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((f.emin + 127) << 23), a);
    return _mm256_blendv_epi8(normal, _mm256_cvtps_epi32(units), small);
}

static inline __m256i fp8_stochastic8(__m256i b, __m256i ub, fp8fmt_t f, __m256i *tie) {
    __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), ff = _mm256_set1_epi32(0xFF);
    __m256i f8 = _mm256_and_si256(_mm256_srl_epi32(a, _mm_cvtsi32_si128(15 - f.man)), ff);
    __m256i kept = _mm256_sub_epi32(_mm256_srl_epi32(a, _mm_cvtsi32_si128(23 - f.man)),
                                    _mm256_set1_epi32((127 - f.bias) << f.man));
    __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32((135 + f.man - f.emin) << 23)));
    __m256i S = _mm256_cvttps_epi32(scaled);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((f.emin + 127) << 23), a);
    f8 = _mm256_blendv_epi8(f8, _mm256_and_si256(S, ff), small);
    kept = _mm256_blendv_epi8(kept, _mm256_srli_epi32(S, 8), small);
    *tie = _mm256_cmpeq_epi32(ub, f8);
    return _mm256_sub_epi32(kept, _mm256_cmpgt_epi32(f8, ub)); /* + 1 where ub < f8 */
}

/* 16 codes of two 8-lane vectors (each in [0, 255]) as 16 bytes in order. */
static inline __m128i fp8_bytes16(__m256i lo, __m256i hi) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8); /* lo 0-7, hi 0-7 as u16 */
    return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
#endif

/* fp8_codes on the whole 16-element groups of m elements, 16 lanes at a time (fp8_nearest16,
 * fp8_stochastic16: the same codes and tie flags); returns the elements done. */
static int64_t fp8_codes16(const float *restrict p, uint8_t *restrict cd, int64_t m, float up, fp8fmt_t f,
                           const uint8_t *restrict u, uint16_t *restrict tie, uint64_t *restrict nz) {
    int64_t k = 0;
    uint64_t any = 0;
#if defined(__AVX512F__)
    const __m512 vup = _mm512_set1_ps(up);
    for (; k + 16 <= m; k += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(p + k), vup);
        __m512i b = _mm512_castps_si512(v);
        __m512i sign7 = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
        if (!u) {
            _mm_storeu_si128((__m128i *)(cd + k), _mm512_cvtepi32_epi8(_mm512_or_si512(sign7, fp8_nearest16(b, f))));
            continue;
        }
        __m512i ub = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(u + k)));
        __mmask16 tie16;
        __m512i code = fp8_stochastic16(b, ub, f, &tie16);
        tie[k >> 4] = (uint16_t)tie16;
        any |= (uint64_t)(tie16 != 0) << (k >> 4); /* m <= SB: 64 masks */
        _mm_storeu_si128((__m128i *)(cd + k), _mm512_cvtepi32_epi8(_mm512_or_si512(sign7, code)));
    }
#elif defined(__AVX2__)
    const __m256 vup = _mm256_set1_ps(up);
    for (; k + 16 <= m; k += 16) {
        __m256i b[2], code[2], t[2];
        for (int h = 0; h < 2; h++) {
            b[h] = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(p + k + 8 * h), vup));
            __m256i sign7 = _mm256_and_si256(_mm256_srli_epi32(b[h], 24), _mm256_set1_epi32(0x80));
            if (u) {
                __m256i ub = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + k + 8 * h)));
                code[h] = _mm256_or_si256(sign7, fp8_stochastic8(b[h], ub, f, &t[h]));
            } else {
                code[h] = _mm256_or_si256(sign7, fp8_nearest8(b[h], f));
            }
        }
        _mm_storeu_si128((__m128i *)(cd + k), fp8_bytes16(code[0], code[1]));
        if (u) {
            uint32_t tie16 = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(t[0])) |
                             (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(t[1])) << 8;
            tie[k >> 4] = (uint16_t)tie16;
            any |= (uint64_t)(tie16 != 0) << (k >> 4);
        }
    }
#else
    (void)p, (void)cd, (void)m, (void)up, (void)f, (void)u, (void)tie;
#endif
    *nz = any;
    return k;
}

/* Codes of m elements: p times `up` (exact), rounded to the format's grid (stochastically with primary bytes
 * u, flagging ties in `tie`, as codes_stochastic; else to nearest even). A function of its own, with
 * restrict pointers: inside the OpenMP region gcc does not vectorize these loops. */
static void fp8_codes(const float *restrict p, uint8_t *restrict cd, int64_t m, float up, fp8fmt_t f, float inv_smin,
                      const uint8_t *restrict u, uint16_t *restrict tie, uint64_t *restrict nz) {
    int64_t k0 = fp8_codes16(p, cd, m, up, f, u, tie, nz);
    p += k0, cd += k0, m -= k0;
    if (u) {
        u += k0, tie += k0 >> 4;
        for (int64_t k = 0; k < m; k += 16) { /* 16 at a time, so that each group fills its mask */
            int64_t e = m - k < 16 ? m - k : 16;
            uint32_t bits = 0;
            for (int64_t j = 0; j < e; j++) {
                uint32_t b;
                float sp, q = fp8_units(p[k + j] * up, f, &b, &sp);
                float lo = (float)(int32_t)q; /* floor: 0 <= q < 2**24 */
                int32_t f8 = (int32_t)((q - lo) * 256.0f), ub = (int32_t)u[k + j];
                bits |= (uint32_t)(ub == f8) << j;
                float w = (lo + (ub < f8 ? 1.0f : 0.0f)) * sp;
                cd[k + j] = fp8_code(w, b >> 31, f, inv_smin);
            }
            tie[k >> 4] = (uint16_t)bits;
            *nz |= (uint64_t)(bits != 0) << ((k0 + k) >> 4);
        }
        return;
    }
    for (int64_t k = 0; k < m; k++) {
        uint32_t b;
        float sp, q = fp8_units(p[k] * up, f, &b, &sp);
        float w = ((q + MAGIC) - MAGIC) * sp; /* round half to even: q < 2**22 */
        cd[k] = fp8_code(w, b >> 31, f, inv_smin);
    }
}

/* The largest code magnitude whose value times 2**-k is a finite fp32 number: (2 - 2**-man) 2**(127 + k) on
 * the format's grid (ScaledFP8._saturate_), or 0x7F (no limit) where that lies above the format's max. Only a
 * chunk whose amax is within one spacing of FLT_MAX may round up to 2**(128 + k), which decodes to inf. */
static inline uint8_t fp8_ceiling(int k, fp8fmt_t f) {
    int e = 127 + k; /* >= 1: a normal exponent of the format */
    if ((2.0 - 1.0 / (double)(1 << f.man)) * pow2_f64(e) >= f.top) return 0x7F;
    return (uint8_t)(((e + f.bias) << f.man) | ((1 << f.man) - 1));
}

/* Codes above `lim` in magnitude (see fp8_ceiling) lowered to it, signs kept. */
static void fp8_saturate(uint8_t *cd, int64_t m, uint8_t lim) {
    for (int64_t k = 0; k < m; k++)
        if ((cd[k] & 0x7F) > lim) cd[k] = (uint8_t)((cd[k] & 0x80) | lim);
}

/* The ties of fp8_codes (codes cd, first stream position e0): remainder and rounded-up code (at most `lim` in
 * magnitude), for tie_flush. */
static void fp8_ties(const float *p, uint8_t *cd, uint64_t e0, float up, fp8fmt_t f, float inv_smin, uint8_t lim,
                     const uint16_t *tie, uint64_t nz, ties_t *ties) {
    FOR_EACH_TIE(k, tie, nz) {
        uint32_t b;
        float sp, q = fp8_units(p[k] * up, f, &b, &sp);
        float lo = (float)(int32_t)q, sc = (q - lo) * 256.0f;
        uint8_t c = fp8_code((lo + 1.0f) * sp, b >> 31, f, inv_smin);
        if ((c & 0x7F) > lim) c = (uint8_t)((c & 0x80) | lim);
        tie_push(ties, cd + k, e0 + k, sc - (float)(int32_t)sc, c);
    }
}

int64_t mixprec_quant_encode_fp8(const void *x, int dt, int64_t rows, int64_t length, int64_t x_stride, uint8_t *out,
                                 int64_t out_stride, int64_t chunk, int fmt, int stochastic, uint64_t key,
                                 int64_t offset, int64_t pos_stride, int nthreads) {
    int64_t chunks = (length + chunk - 1) / chunk, tasks = rows * chunks, bad = 0;
    size_t esize = dt == DT_F32 ? 4 : 2;
    const fp8fmt_t f = fp8_format(fmt);
    const float inv_smin = bits_f32((uint32_t)(127 - f.emin + f.man) << 23); /* 1 / 2**(emin - man) */
#pragma omp parallel num_threads(nthreads) if (rows * length >= MIXPREC_GRAIN) reduction(+ : bad)
    {
        float buf[SB];
        ubytes_t ubytes, *ubuf = &ubytes;
        ubytes.g0 = ubytes.g1 = 0;
        uint16_t tie[TIE_WORDS];
        ties_t ties;
        ties_init(&ties, key, 0);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t r = t / chunks, c = t % chunks, a = c * chunk;
            int64_t n = length - a < chunk ? length - a : chunk;
            const void *xr = (const char *)x + (size_t)(r * x_stride) * esize;
            uint8_t *o = out + r * out_stride, *codes = o + 4 * chunks + a;
            float mn, mx; /* amax = max(-min, max), exactly; NaN/Inf flag the chunk */
            int nonfinite = chunk_minmax(xr, dt, a, n, &mn, &mx, buf, 0);
            float amax = -mn > mx ? -mn : mx;
            if (nonfinite) {
                float q = bits_f32(0x7FC00000u);
                memcpy(o + 4 * c, &q, 4);
                memset(codes, 0, (size_t)n);
                bad++;
                continue;
            }
            int k = fp8_exponent((double)amax, f.top);
            /* 2**-k and 2**k (|k| <= 126: normal fp32) */
            float scale = bits_f32((uint32_t)(127 - k) << 23), up = bits_f32((uint32_t)(127 + k) << 23);
            memcpy(o + 4 * c, &scale, 4);
            uint64_t pos = (uint64_t)(offset + r * pos_stride + a);
            const uint8_t lim = fp8_ceiling(k, f);
            for (int64_t s = 0; s < n; s += SB) {
                int64_t m = n - s < SB ? n - s : SB;
                const float *p = as_f32(xr, dt, a + s, m, buf);
                const uint8_t *u = stochastic ? stream_bytes(key, pos + (uint64_t)s, m, ubuf) : 0;
                uint64_t nz;
                fp8_codes(p, codes + s, m, up, f, inv_smin, u, tie, &nz);
                if (lim != 0x7F) fp8_saturate(codes + s, m, lim);
                if (!stochastic) continue;
                fp8_ties(p, codes + s, pos + (uint64_t)s, up, f, inv_smin, lim, tie, nz, &ties);
                if (ties.n >= TIE_FLUSH) tie_flush(&ties, 0);
            }
        }
        if (stochastic) tie_flush(&ties, 1);
    }
    return bad;
}

/* The value of fp8 code c by arithmetic instead of a table: e5m2 is the high byte of an IEEE half; e4m3fn's
 * bits moved into a half's fields (exponent bias 15 instead of 7, so the half is 2**-8 of the value, its
 * subnormals included) times 2**8; its codes 0x7F and 0xFF are NaN. */
static inline float fp8_code_value(uint32_t c, int fmt) {
    if (fmt == 1) return f16_to_f32((uint16_t)(c << 8));
    if ((c & 0x7Fu) == 0x7Fu) return bits_f32(0x7FC00000u);
    return f16_to_f32((uint16_t)(((c & 0x7Fu) << 7) | ((c & 0x80u) << 8))) * 256.0f;
}

/* The format (0 = e4m3fn, 1 = e5m2) whose fp8_code_value gives `table`, value for value (NaN where NaN), or
 * -1: the vector decode below runs only for a table it reproduces (the caller asks once per table). */
static int fp8_table_format(const float *table) {
    for (int fmt = 0; fmt < 2; fmt++) {
        int same = 1;
        for (uint32_t c = 0; c < 256 && same; c++) {
            float v = fp8_code_value(c, fmt), t = table[c];
            same = v != v ? t != t : f32_bits(v) == f32_bits(t);
        }
        if (same) return fmt;
    }
    return -1;
}

/* table[code] * scale for m codes (exact: the scale is a power of two, no underflow); with fmt >= 0 (the
 * table is fp8_code_value's), 16 at a time by vcvtph2ps instead of a gather. */
static void fp8_values(const uint8_t *restrict cd, int64_t m, const float *restrict table, int fmt, float sc,
                       float *restrict y) {
    int64_t k = 0;
    (void)fmt;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (fmt >= 0) {
        const __m512 vsc = _mm512_set1_ps(sc), nan = _mm512_set1_ps(bits_f32(0x7FC00000u));
        const __m256i mag = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
        for (; k + 16 <= m; k += 16) {
            __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cd + k)));
            __m512 v;
            if (fmt == 1) {
                v = _mm512_cvtph_ps(_mm256_slli_epi16(c, 8));
            } else {
                __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, mag), 7),
                                            _mm256_slli_epi16(_mm256_and_si256(c, sign), 8));
                v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
                v = _mm512_mask_mov_ps(v, _mm256_cmpeq_epi16_mask(_mm256_and_si256(c, mag), mag), nan);
            }
            _mm512_storeu_ps(y + k, _mm512_mul_ps(v, vsc));
        }
    }
#endif
    for (; k < m; k++) y[k] = table[cd[k]] * sc;
}

/* fp8_table_format for the caller, which checks a table once and passes the answer to every decode. */
int mixprec_quant_fp8_table_format(const float *table) { return fp8_table_format(table); }

/* Decode fp8 rows: table[code] * scale (exact), into out's dtype, or summed over rows in fp32 (row order). fmt:
 * mixprec_quant_fp8_table_format(table), or -1 for the table lookup. */
int64_t mixprec_quant_decode_fp8(const uint8_t *buf, int64_t rows, int64_t length, int64_t buf_stride, void *out,
                                 int dt, int64_t out_stride, int64_t chunk, const float *table, int fmt, int reduce,
                                 int nthreads) {
    int64_t chunks = (length + chunk - 1) / chunk, bad = count_flagged(buf, rows, chunks, buf_stride);
    int64_t tasks = reduce ? chunks : rows * chunks;
    size_t esize = dt == DT_F32 ? 4 : 2;
#pragma omp parallel num_threads(nthreads) if (rows * length >= MIXPREC_GRAIN)
    {
        float y[SB], acc[SB];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t r0 = reduce ? 0 : t / chunks, c = reduce ? t : t % chunks, a = c * chunk;
            int64_t n = length - a < chunk ? length - a : chunk;
            int64_t r1 = reduce ? rows : r0 + 1;
            for (int64_t s = 0; s < n; s += SB) {
                int64_t m = n - s < SB ? n - s : SB;
                if (!reduce && dt == DT_F32) { /* straight into the output: no scratch copy, no memcpy call */
                    const uint8_t *row = buf + r0 * buf_stride;
                    float sc;
                    memcpy(&sc, row + 4 * c, 4);
                    fp8_values(row + 4 * chunks + a + s, m, table, fmt, sc, (float *)out + r0 * out_stride + a + s);
                    continue;
                }
                for (int64_t r = r0; r < r1; r++) {
                    const uint8_t *row = buf + r * buf_stride;
                    float sc;
                    memcpy(&sc, row + 4 * c, 4);
                    fp8_values(row + 4 * chunks + a + s, m, table, fmt, sc, r > r0 ? y : acc);
                    if (r > r0)
                        for (int64_t k = 0; k < m; k++) acc[k] = acc[k] + y[k];
                }
                if (reduce)
                    memcpy((float *)out + a + s, acc, (size_t)m * 4);
                else
                    store((char *)out + (size_t)(r0 * out_stride) * esize, dt, a + s, acc, m);
            }
        }
    }
    return bad;
}
