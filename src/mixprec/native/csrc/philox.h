/* Philox4x32-10, the counter-based generator of Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
 * as easy as 1, 2, 3" (SC'11), as in Random123 and torch's CUDA generator: a 128-bit counter and a 64-bit
 * key give four 32-bit words, 10 rounds. mixprec.core.philox computes the same bits with torch int64 ops.
 *
 * Element layout of a stream (docs/compress.md): element e's primary byte is byte (e >> 6) & 3 of word
 * (e >> 4) & 3 of the block whose counter is ((e >> 8) << 4) | (e & 15), counter words (lo, hi, 0, 0). So
 * 256 consecutive elements come from 16 consecutive counters, and one shift of a 16-lane word vector gives
 * 16 consecutive elements' bytes: no shuffles. Its secondary word (ties only): mixprec_philox_tie_word. */
#ifndef MIXPREC_PHILOX_H
#define MIXPREC_PHILOX_H
#include <stdint.h>

#define MIXPREC_PHILOX_M0 0xD2511F53u
#define MIXPREC_PHILOX_M1 0xCD9E8D57u
#define MIXPREC_PHILOX_W0 0x9E3779B9u
#define MIXPREC_PHILOX_W1 0xBB67AE85u

/* One Philox4x32-10 block: ctr[4], key[2] -> out[4] (the Random123 known-answer tests check this). */
static inline void mixprec_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)MIXPREC_PHILOX_M0 * x0, p1 = (uint64_t)MIXPREC_PHILOX_M1 * x2;
        uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
        x0 = y0; x1 = (uint32_t)p1; x2 = y2; x3 = (uint32_t)p0;
        k0 += MIXPREC_PHILOX_W0; k1 += MIXPREC_PHILOX_W1;
    }
    out[0] = x0; out[1] = x1; out[2] = x2; out[3] = x3;
}

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* The round keys of `key` in every lane, kv[2 r] = k0 + r W0 and kv[2 r + 1] = k1 + r W1: computed once
 * per key and read from memory by the rounds (a broadcast from a register takes a shuffle-port uop). */
static inline void mixprec_philox_round_keys(uint64_t key, __m512i kv[20]) {
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        kv[2 * r] = _mm512_set1_epi64(k0);
        kv[2 * r + 1] = _mm512_set1_epi64(k1);
        k0 += MIXPREC_PHILOX_W0;
        k1 += MIXPREC_PHILOX_W1;
    }
}

/* The 10 rounds on n chains of 8 counters each, one counter per 64-bit lane with its words in the low
 * halves: vpmuludq reads only those, so the high halves may hold garbage until the words are packed. The
 * chains are independent, which hides the latency of the multiplies. */
static inline void mixprec_philox_rounds(const __m512i kv[20], int r0, int n, __m512i x0[], __m512i x1[],
                                         __m512i x2[], __m512i x3[]) {
    const __m512i m0 = _mm512_set1_epi64(MIXPREC_PHILOX_M0), m1 = _mm512_set1_epi64(MIXPREC_PHILOX_M1);
    for (int r = r0; r < 10; r++) { /* rounds r0 .. 9 */
        for (int i = 0; i < n; i++) {
            __m512i p0 = _mm512_mul_epu32(x0[i], m0), p1 = _mm512_mul_epu32(x2[i], m1);
            /* hi(p) to the low half by vpshufd (port 5) rather than vpsrlq, which shares port 0 with vpmuludq */
            __m512i h0 = _mm512_shuffle_epi32(p0, _MM_SHUFFLE(3, 3, 1, 1));
            __m512i h1 = _mm512_shuffle_epi32(p1, _MM_SHUFFLE(3, 3, 1, 1));
            x0[i] = _mm512_ternarylogic_epi64(h1, x1[i], kv[2 * r], 0x96); /* three-way xor */
            x2[i] = _mm512_ternarylogic_epi64(h0, x3[i], kv[2 * r + 1], 0x96);
            x1[i] = p1; /* low word: the product's low half */
            x3[i] = p0;
        }
    }
}

/* The words of n / 2 groups from g (16 counters each) after the rounds on n chains: w[4 i + j] holds word j
 * of counter 16 (g + i) + l in lane l. One vpermt2d joins the low dwords of two chains (vpmovqd +
 * vinserti64x4 take 5 uops).
 *
 * The first two rounds are spelled out: with counter words (lo + l, hi, 0, 0), round 1 multiplies only
 * word 0, M0 (lo + l) = M0 lo + M0 l (no carry out of 32 bits: lo is a multiple of 8), and leaves a word 0
 * that is the same in every lane (hi ^ k0), so round 2 multiplies it once, in a scalar register. Two
 * vector multiplies of the twenty are left out, with the same bits. */
static inline void mixprec_philox_words(const __m512i kv[20], uint64_t g, int n, __m512i w[]) {
    __m512i x0[8], x1[8], x2[8], x3[8];
    const uint64_t M0 = MIXPREC_PHILOX_M0;
    const __m512i m1 = _mm512_set1_epi64(MIXPREC_PHILOX_M1);
    const __m512i m0_lane = _mm512_setr_epi64(0, M0, 2 * M0, 3 * M0, 4 * M0, 5 * M0, 6 * M0, 7 * M0);
    const uint32_t k0 = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(kv[0]));
    const uint32_t k1b = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(kv[3]));
    for (int i = 0; i < n; i++) {
        uint64_t c = ((g + (uint64_t)(i >> 1)) << 4) + (uint64_t)(8 * (i & 1)); /* + lane: no carry */
        __m512i p0 = _mm512_add_epi64(_mm512_set1_epi64((long long)(M0 * (uint32_t)c)), m0_lane);
        /* round 1: (hi(M1 0) ^ hi ^ k0, lo(M1 0), hi(p0) ^ 0 ^ k1, lo(p0)) */
        __m512i y2 = _mm512_xor_si512(_mm512_shuffle_epi32(p0, _MM_SHUFFLE(3, 3, 1, 1)), kv[1]);
        uint64_t P = M0 * (uint32_t)((uint32_t)(c >> 32) ^ k0); /* round 2's product of word 0 */
        __m512i p1 = _mm512_mul_epu32(y2, m1);
        x0[i] = _mm512_xor_si512(_mm512_shuffle_epi32(p1, _MM_SHUFFLE(3, 3, 1, 1)), kv[2]); /* hi(p1) ^ 0 ^ k0' */
        x1[i] = p1;
        x2[i] = _mm512_xor_si512(p0, _mm512_set1_epi64((long long)((uint32_t)(P >> 32) ^ k1b)));
        x3[i] = _mm512_set1_epi64((long long)(uint32_t)P);
    }
    mixprec_philox_rounds(kv, 2, n, x0, x1, x2, x3);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int i = 0; i < n; i += 2) {
        __m512i *x[4] = {x0, x1, x2, x3};
        for (int j = 0; j < 4; j++) w[2 * i + j] = _mm512_permutex2var_epi32(x[j][i], even, x[j][i + 1]);
    }
}

/* The words of group g (256 elements): w[j] holds word j of counter 16 g + l in lane l. */
static inline void mixprec_philox_words256(const __m512i kv[20], uint64_t g, __m512i w[4]) {
    mixprec_philox_words(kv, g, 2, w);
}

/* The words of groups g .. g + 3 (1024 elements), 8 chains side by side. */
static inline void mixprec_philox_words1024(uint64_t key, uint64_t g, __m512i w[16]) {
    __m512i kv[20];
    mixprec_philox_round_keys(key, kv);
    mixprec_philox_words(kv, g, 8, w);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
/* Without AVX-512: the 10 rounds on n chains of 4 counters, one per 64-bit lane with its words in the low
 * halves (vpmuludq reads only those), as the AVX-512 rounds with half the lanes and no three-way xor. */
static inline __attribute__((always_inline)) void mixprec_philox_rounds_avx2(uint64_t key, int n, __m256i x0[],
                                                                             __m256i x1[], __m256i x2[], __m256i x3[]) {
    const __m256i m0 = _mm256_set1_epi64x(MIXPREC_PHILOX_M0), m1 = _mm256_set1_epi64x(MIXPREC_PHILOX_M1);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        const __m256i v0 = _mm256_set1_epi64x(k0), v1 = _mm256_set1_epi64x(k1);
        for (int i = 0; i < n; i++) {
            __m256i p0 = _mm256_mul_epu32(x0[i], m0), p1 = _mm256_mul_epu32(x2[i], m1);
            x0[i] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), x1[i]), v0);
            x2[i] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), x3[i]), v1);
            x1[i] = p1;
            x3[i] = p0;
        }
        k0 += MIXPREC_PHILOX_W0;
        k1 += MIXPREC_PHILOX_W1;
    }
}

/* The words of groups g .. g + 3 (1024 elements) as 8-lane vectors: w8[8 i + 2 j + h] holds word j of
 * counters 16 (g + i) + 8 h .. + 7 in order, so byte b of its lanes is the 8 elements at 256 i + 64 b + 16 j + 8 h. */
static inline void mixprec_philox_words1024_avx2(uint64_t key, uint64_t g, __m256i w8[32]) {
    __m256i x0[16], x1[16], x2[16], x3[16];
    for (int v = 0; v < 16; v++) { /* counters 4 v .. 4 v + 3: 16 (g + (v >> 2)) + 4 (v & 3) + lane */
        uint64_t c = ((g + (uint64_t)(v >> 2)) << 4) + (uint64_t)(4 * (v & 3));
        x0[v] = _mm256_add_epi64(_mm256_set1_epi64x((long long)c), _mm256_setr_epi64x(0, 1, 2, 3)); /* no carry */
        x1[v] = _mm256_set1_epi64x((long long)(c >> 32));
        x2[v] = x3[v] = _mm256_setzero_si256();
    }
    for (int v = 0; v < 16; v += 4) /* 4 chains at a time: their 16 words fit AVX2's registers */
        mixprec_philox_rounds_avx2(key, 4, x0 + v, x1 + v, x2 + v, x3 + v);
    for (int v = 0; v < 16; v += 2) { /* chains v, v + 1: counters 16 (v >> 2) + 8 ((v >> 1) & 1) + 0..7 */
        __m256i *x[4] = {x0, x1, x2, x3};
        for (int j = 0; j < 4; j++) { /* the low dwords of both, then in order */
            __m256 lo = _mm256_shuffle_ps(_mm256_castsi256_ps(x[j][v]), _mm256_castsi256_ps(x[j][v + 1]), 0x88);
            w8[8 * (v >> 2) + 2 * j + ((v >> 1) & 1)] = _mm256_permute4x64_epi64(_mm256_castps_si256(lo), 0xD8);
        }
    }
}
#endif

/* The primary bytes of the 1024 elements of groups g .. g + 3 (elements 256 g .. 256 g + 1023) of the
 * stream with key `key`: out[256 i + 64 b + 16 w + l] = byte b of word w of counter 16 (g + i) + l. */
static inline void mixprec_philox_bytes1024(uint64_t key, uint64_t g, uint8_t out[1024]) {
#if defined(__AVX512F__)
    __m512i w[16];
    mixprec_philox_words1024(key, g, w);
    for (int i = 0; i < 16; i++) /* vpmovdb keeps the low byte */
        for (int b = 0; b < 4; b++)
            _mm_storeu_si128((__m128i *)(out + 256 * (i >> 2) + 64 * b + 16 * (i & 3)),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(w[i], 8 * b)));
#elif defined(__AVX2__)
    __m256i w8[32];
    mixprec_philox_words1024_avx2(key, g, w8);
    uint32_t wd[4][64]; /* wd[j][l]: word j of counter 16 g + l */
    for (int v = 0; v < 32; v++) /* w8[8 i + 2 j + h]: counters 16 i + 8 h + lane */
        _mm256_storeu_si256((__m256i *)(wd[(v >> 1) & 3] + 16 * (v >> 3) + 8 * (v & 1)), w8[v]);
    for (int i = 0; i < 4; i++) /* contiguous inner loops: the compiler vectorizes them */
        for (int by = 0; by < 4; by++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 16; l++)
                    out[256 * i + 64 * by + 16 * j + l] = (uint8_t)(wd[j][16 * i + l] >> (8 * by));
#else
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int l = 0; l < 64; l++) { /* lanes are independent: the vectorizer runs them side by side */
        uint64_t c = ((g + (uint64_t)(l >> 4)) << 4) + (uint64_t)(l & 15);
        uint32_t x0 = (uint32_t)c, x1 = (uint32_t)(c >> 32), x2 = 0, x3 = 0, a = k0, b = k1;
        for (int r = 0; r < 10; r++) {
            uint64_t p0 = (uint64_t)MIXPREC_PHILOX_M0 * x0, p1 = (uint64_t)MIXPREC_PHILOX_M1 * x2;
            uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ a, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ b;
            x0 = y0;
            x1 = (uint32_t)p1;
            x2 = y2;
            x3 = (uint32_t)p0;
            a += MIXPREC_PHILOX_W0;
            b += MIXPREC_PHILOX_W1;
        }
        uint8_t *v = out + 256 * (l >> 4) + (l & 15);
        uint32_t w[4] = {x0, x1, x2, x3};
        for (int j = 0; j < 4; j++)
            for (int by = 0; by < 4; by++) v[64 * by + 16 * j] = (uint8_t)(w[j] >> (8 * by));
    }
#endif
}

/* The secondary word of stream position e (read only when its primary byte ties): word 0 of the block with
 * counter (e low, e high, 1, 0). Primary counters have word 2 = 0, so the two never share a block. */
static inline uint32_t mixprec_philox_tie_word(uint64_t key, uint64_t e) {
    const uint32_t ctr[4] = {(uint32_t)e, (uint32_t)(e >> 32), 1u, 0u}, k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    uint32_t out[4];
    mixprec_philox4x32_10(ctr, k, out);
    return out[0];
}

/* The secondary words of 32 stream positions at once: four chains of 8 independent lanes, so that the
 * multiply latency of the 10 rounds is paid once per batch of ties rather than once per tie. */
#if defined(__AVX512F__)
static inline void mixprec_philox_tie_words32_kv(const __m512i kv[20], const uint64_t e[32], uint32_t out[32]) {
    __m512i x0[4], x1[4], x2[4], x3[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_loadu_si512((const void *)(e + 8 * i));
        x0[i] = v; /* the low words; vpmuludq ignores the high halves */
        x1[i] = _mm512_srli_epi64(v, 32);
        x2[i] = _mm512_set1_epi64(1);
        x3[i] = _mm512_setzero_si512();
    }
    mixprec_philox_rounds(kv, 0, 4, x0, x1, x2, x3);
    for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm512_cvtepi64_epi32(x0[i]));
}
#endif

/* The same for a key whose round keys are not at hand. */
static inline void mixprec_philox_tie_words32(uint64_t key, const uint64_t e[32], uint32_t out[32]) {
#if defined(__AVX512F__)
    __m512i kv[20];
    mixprec_philox_round_keys(key, kv);
    mixprec_philox_tie_words32_kv(kv, e, out);
#elif defined(__AVX2__)
    __m256i x0[8], x1[8], x2[8], x3[8];
    for (int i = 0; i < 8; i++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(e + 4 * i));
        x0[i] = v;
        x1[i] = _mm256_srli_epi64(v, 32);
        x2[i] = _mm256_set1_epi64x(1);
        x3[i] = _mm256_setzero_si256();
    }
    for (int i = 0; i < 8; i += 4) mixprec_philox_rounds_avx2(key, 4, x0 + i, x1 + i, x2 + i, x3 + i);
    uint64_t w[32];
    for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(w + 4 * i), x0[i]);
    for (int l = 0; l < 32; l++) out[l] = (uint32_t)w[l];
#else
    for (int l = 0; l < 32; l++) out[l] = mixprec_philox_tie_word(key, e[l]);
#endif
}
#endif
