/* The AVX2 form of MinMaxUInt8's stochastic codes loop (quant_u8.c includes it before codes_stochastic, which
 * calls it on AVX2 machines without AVX-512). */
#ifndef MIXPREC_QUANT_U8_AVX2_H
#define MIXPREC_QUANT_U8_AVX2_H
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
#endif
