/* What the MinMaxUInt8 (quant_u8.c) and ScaledFP8 (quant_fp8.c) kernels and the Philox entry points
 * (quant_philox.c) share: the element types, the sub-block size, fp16/bf16 rows read as fp32 and fp32 stored back,
 * a chunk's min/max scan (with the Philox words it computes on the side), a thread's primary Philox bytes of
 * one stream (philox.h), the queue of ties that the secondary Philox words resolve, and the count of flagged
 * chunks. Static functions: each unit gets its own inlinable copy. */
#ifndef MIXPREC_QUANT_COMMON_H
#define MIXPREC_QUANT_COMMON_H
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

enum { DT_F32 = MIXPREC_F32, DT_F16 = MIXPREC_F16, DT_BF16 = MIXPREC_BF16 }; /* dtypes.h */
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
__attribute__((unused)) /* not every unit calls it */
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
__attribute__((unused)) /* not every unit calls it */
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

/* Chunks flagged non-finite: both wires store a NaN first header word (uint8's min, fp8's scale) for them. */
__attribute__((unused)) /* not every unit calls it */
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
#endif
