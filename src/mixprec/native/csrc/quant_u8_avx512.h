/* MinMaxUInt8's aligned stochastic path (AVX-512 F and BW; vpermt2b with VBMI): the min/max scan that the
 * codes loop of the chunk before advances, the codes of whole 64-element groups from Philox words in registers,
 * and the tie masks those leave. quant_u8.c includes it after codes_stochastic, before encode_chunk. */
#ifndef MIXPREC_QUANT_U8_AVX512_H
#define MIXPREC_QUANT_U8_AVX512_H
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
#endif
