/* Block-scaled quantization (OCP MX, NVFP4) along contiguous blocks, one pass: mixprec.core.mx's torch path
 * (the oracle, docs/mx.md) fused per block.
 *
 * Per block of `block` consecutive elements: amax as the largest |x| bit pattern (non-negative fp32 values order
 * as their patterns; a pattern above inf's is a NaN block), the scale by the mode's rule (E8M0: floor, ceil, even,
 * rceil, neuron; E4M3: NVFP4's with an optional tensor scale), then per element v = fl32(x * mult), clamped to
 * +-max_element, rounded to the element grid (nearest even by the magic constant x + C - C, or toward zero by
 * masking the fraction), the input's sign kept, and optionally multiplied back by the decoded scale (fake
 * quantization). The same IEEE fp32 operations as the torch path, in the same order, so the same bits; a NaN
 * block gives the default NaN everywhere, as the torch path does. The loops are plain C that gcc vectorizes
 * (16 lanes with AVX-512, 8 with AVX2, scalar without), as rounding.c's round to nearest: no selects between
 * floats, only integer blends. Stochastic rounding (mx.h's sr_span) takes element i's bits at Philox stream
 * position first + i, in tiles of whole blocks whose primary bytes are drawn together.
 */
#include <omp.h>
#include <stdint.h>

#include "dtypes.h"
#include "mx.h"

/* mx.h's MX_SRC_* names predate the shared table; until they go, they must be its codes */
_Static_assert(MX_SRC_F32 == MIXPREC_F32 && MX_SRC_F16 == MIXPREC_F16 && MX_SRC_BF16 == MIXPREC_BF16,
               "mx.h's element codes must be dtypes.h's");

/* One block: amax, scale, elements (times deq when dequantizing) into dst, the scale into *scale_out. */
#define DEFINE_BLOCK(NAME, SRC_T, LOAD)                                                                        \
    static inline __attribute__((always_inline)) void NAME(const SRC_T *src, float *dst,                      \
                                                           int64_t nb, const int block, const int dequant,    \
                                                           const mxparams *p, float *scale_out) {             \
        uint32_t amaxb = 0;                                                                                    \
        _Pragma("omp simd reduction(max : amaxb)") for (int64_t i = 0; i < nb; i++) {                          \
            const uint32_t a = LOAD(src[i]) & 0x7FFFFFFFu;                                                     \
            amaxb = a > amaxb ? a : amaxb;                                                                     \
        }                                                                                                      \
        (void)block;                                                                                           \
        float scale, mult, deq;                                                                                \
        block_scale(amaxb, p, &scale, &mult, &deq);                                                            \
        if (scale_out) *scale_out = scale;                                                                     \
        uint32_t *d = (uint32_t *)dst;                                                                         \
        if (amaxb > 0x7F800000u) {                                                                             \
            for (int64_t i = 0; i < nb; i++) d[i] = MX_NAN;                                                    \
            return;                                                                                            \
        }                                                                                                      \
        const mxparams q = *p;                                                                                 \
        if (dequant) {                                                                                         \
            _Pragma("omp simd") for (int64_t i = 0; i < nb; i++) dst[i] =                                      \
                bits_f32(element(LOAD(src[i]), mult, &q)) * deq;                                               \
        } else {                                                                                               \
            _Pragma("omp simd") for (int64_t i = 0; i < nb; i++) d[i] = element(LOAD(src[i]), mult, &q);       \
        }                                                                                                      \
    }
#define MX_LOAD_F32(v) (v)
#define MX_LOAD_BF16(v) ((uint32_t)(v) << 16)
#define MX_LOAD_F16(v) f32_bits(f16_to_f32(v))
DEFINE_BLOCK(block_f32, uint32_t, MX_LOAD_F32)
DEFINE_BLOCK(block_bf16, uint16_t, MX_LOAD_BF16)
DEFINE_BLOCK(block_f16, uint16_t, MX_LOAD_F16)

/* Blocks [b0, b1). The common block sizes go in groups of 16 blocks: amax per block (a loop of a constant trip
 * count), the 16 scales in vectorized loops, then the elements; other sizes one block at a time. */
#define DEFINE_GROUPED(NAME, SRC_T, LOAD, B)                                                                   \
    static void NAME(const SRC_T *src, float *dst, float *scales, int64_t b0, int64_t b1, int dequant,         \
                     const mxparams *p) {                                                                      \
        uint32_t am[GROUP];                                                                                    \
        float sc[GROUP], mu[GROUP], dq[GROUP];                                                                 \
        const mxparams q = *p;                                                                                 \
        for (int64_t g0 = b0; g0 < b1; g0 += GROUP) {                                                          \
            const int g = b1 - g0 < GROUP ? (int)(b1 - g0) : GROUP;                                            \
            for (int j = 0; j < g; j++) {                                                                      \
                const SRC_T *s = src + (g0 + j) * B;                                                           \
                uint32_t m = 0;                                                                                \
                _Pragma("omp simd reduction(max : m)") for (int i = 0; i < B; i++) {                           \
                    const uint32_t a = LOAD(s[i]) & 0x7FFFFFFFu;                                               \
                    m = a > m ? a : m;                                                                         \
                }                                                                                              \
                am[j] = m;                                                                                     \
            }                                                                                                  \
            block_scales(am, g, p, sc, mu, dq);                                                                \
            if (scales) memcpy(scales + g0, sc, (size_t)g * sizeof(float));                                    \
            for (int j = 0; j < g; j++) {                                                                      \
                const SRC_T *s = src + (g0 + j) * B;                                                           \
                float *o = dst + (g0 + j) * B;                                                                 \
                uint32_t *ob = (uint32_t *)o;                                                                  \
                const float mult = mu[j], deq = dq[j];                                                         \
                if (am[j] > 0x7F800000u) {                                                                     \
                    for (int i = 0; i < B; i++) ob[i] = MX_NAN;                                                \
                } else if (dequant) {                                                                          \
                    _Pragma("omp simd") for (int i = 0; i < B; i++) o[i] = bits_f32(element(LOAD(s[i]), mult, &q)) * deq; \
                } else {                                                                                       \
                    _Pragma("omp simd") for (int i = 0; i < B; i++) ob[i] = element(LOAD(s[i]), mult, &q);     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_GROUPED(grouped32_f32, uint32_t, MX_LOAD_F32, 32)
DEFINE_GROUPED(grouped16_f32, uint32_t, MX_LOAD_F32, 16)
DEFINE_GROUPED(grouped32_bf16, uint16_t, MX_LOAD_BF16, 32)
DEFINE_GROUPED(grouped16_bf16, uint16_t, MX_LOAD_BF16, 16)
DEFINE_GROUPED(grouped32_f16, uint16_t, MX_LOAD_F16, 32)
DEFINE_GROUPED(grouped16_f16, uint16_t, MX_LOAD_F16, 16)

#define DEFINE_RANGE(NAME, SRC_T, BLOCK_FN, G32, G16)                                                          \
    static void NAME(const void *src_, float *dst, float *scales, int64_t b0, int64_t b1, int block,           \
                     int dequant, const mxparams *p) {                                                         \
        const SRC_T *src = (const SRC_T *)src_;                                                                \
        if (block == 32)                                                                                       \
            G32(src, dst, scales, b0, b1, dequant, p);                                                         \
        else if (block == 16)                                                                                  \
            G16(src, dst, scales, b0, b1, dequant, p);                                                         \
        else                                                                                                   \
            for (int64_t b = b0; b < b1; b++)                                                                  \
                BLOCK_FN(src + b * block, dst + b * block, block, block, dequant, p, scales ? scales + b : 0); \
    }
DEFINE_RANGE(range_f32, uint32_t, block_f32, grouped32_f32, grouped16_f32)
DEFINE_RANGE(range_bf16, uint16_t, block_bf16, grouped32_bf16, grouped16_bf16)
DEFINE_RANGE(range_f16, uint16_t, block_f16, grouped32_f16, grouped16_f16)

/* Stochastic rounding over blocks [b0, b1): tiles of whole blocks (or of one block's SR_TILE elements) whose
 * primary bytes are drawn at once; element i of src is stream position first + i. */
#define SR_TILE 4096
#define DEFINE_SR_RANGE(NAME, SRC_T, LOAD)                                                                     \
    static void NAME(const void *src_, float *dst, float *scales, int64_t b0, int64_t b1, int block,           \
                     int dequant, const mxparams *p, uint64_t key, uint64_t first) {                           \
        const SRC_T *src = (const SRC_T *)src_;                                                                \
        uint8_t u[SR_TILE];                                                                                    \
        uint32_t xb[SR_TILE], r[SR_TILE];                                                                      \
        const int64_t per = block <= SR_TILE ? SR_TILE / block : 1; /* blocks per tile */                     \
        for (int64_t t0 = b0; t0 < b1; t0 += per) {                                                            \
            const int64_t t1 = t0 + per < b1 ? t0 + per : b1;                                                  \
            if (block <= SR_TILE) mx_philox_fill(key, first + (uint64_t)(t0 * block), (t1 - t0) * block, u);   \
            for (int64_t b = t0; b < t1; b++) {                                                                \
                const SRC_T *s = src + b * block;                                                              \
                uint32_t *d = (uint32_t *)(dst + b * block);                                                   \
                uint32_t amaxb = 0;                                                                            \
                _Pragma("omp simd reduction(max : amaxb)") for (int64_t i = 0; i < block; i++) {               \
                    const uint32_t a = LOAD(s[i]) & 0x7FFFFFFFu;                                               \
                    amaxb = a > amaxb ? a : amaxb;                                                             \
                }                                                                                              \
                float scale, mult, deq;                                                                        \
                block_scale(amaxb, p, &scale, &mult, &deq);                                                    \
                if (scales) scales[b] = scale;                                                                 \
                if (amaxb > 0x7F800000u) {                                                                     \
                    for (int64_t i = 0; i < block; i++) d[i] = MX_NAN;                                         \
                    continue;                                                                                  \
                }                                                                                              \
                for (int64_t i0 = 0; i0 < block; i0 += SR_TILE) {                                              \
                    const int64_t n = block - i0 < SR_TILE ? block - i0 : SR_TILE;                             \
                    const uint64_t e0 = first + (uint64_t)(b * block + i0);                                    \
                    const uint8_t *ub = u + (b - t0) * block;                                                  \
                    if (block > SR_TILE) {                                                                     \
                        mx_philox_fill(key, e0, n, u);                                                         \
                        ub = u;                                                                                \
                    }                                                                                          \
                    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) xb[i] = LOAD(s[i0 + i]);               \
                    sr_span(xb, n, mult, p, ub, key, e0, r);                                                   \
                    if (dequant) {                                                                             \
                        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) dst[b * block + i0 + i] =          \
                            bits_f32(r[i]) * deq;                                                              \
                    } else {                                                                                   \
                        memcpy(d + i0, r, (size_t)n * sizeof(uint32_t));                                       \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_SR_RANGE(sr_range_f32, uint32_t, MX_LOAD_F32)
DEFINE_SR_RANGE(sr_range_bf16, uint16_t, MX_LOAD_BF16)
DEFINE_SR_RANGE(sr_range_f16, uint16_t, MX_LOAD_F16)

/* Quantize n_blocks contiguous blocks of `block` elements of src (element type src_kind: MIXPREC_F32, MIXPREC_F16
 * or MIXPREC_BF16, dtypes.h) to the block-scaled format (element: exp_bits, man_bits, largest value max_element
 * with exponent emax; scale rule mode; NVFP4's tensor scale ts when has_ts). dst (fp32, n_blocks * block) gets
 * the elements, or with dequant != 0 the elements times their block's scale; scales (n_blocks fp32, may be NULL)
 * the decoded scales. dst may be src itself when src is fp32 (each block is read whole before it is written).
 * stochastic != 0 rounds stochastically instead, element i at stream position first + i of the Philox stream
 * key. Returns 0, or -1 for bad arguments. */
int mixprec_mx_quantize(const void *src, int src_kind, float *dst, float *scales, int64_t n_blocks, int block,
                        int exp_bits, int man_bits, float max_element, int mode, int has_ts, float ts,
                        int toward_zero, int dequant, int stochastic, uint64_t key, uint64_t first, int nthreads) {
    mxparams p;
    if ((src_kind != MIXPREC_F32 && src_kind != MIXPREC_F16 && src_kind != MIXPREC_BF16) || n_blocks < 0 ||
        block < 1 || mx_params(&p, exp_bits, man_bits, max_element, mode, has_ts, ts, toward_zero) != 0 ||
        (stochastic && toward_zero))
        return -1;
    void (*fn)(const void *, float *, float *, int64_t, int64_t, int, int, const mxparams *) =
        src_kind == MIXPREC_F32 ? range_f32 : (src_kind == MIXPREC_BF16 ? range_bf16 : range_f16);
    const int64_t n = n_blocks * block;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (n >= MIXPREC_GRAIN)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* whole blocks, at least 16 of them a slice: a thread's slice of dst starts on a 64-byte line as often
         * as the block size allows */
        const int64_t per = ((n_blocks + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t lo = t * per < n_blocks ? t * per : n_blocks, hi = lo + per < n_blocks ? lo + per : n_blocks;
        if (hi > lo && stochastic)
            (src_kind == MIXPREC_F32 ? sr_range_f32 : (src_kind == MIXPREC_BF16 ? sr_range_bf16 : sr_range_f16))(
                src, dst, scales, lo, hi, block, dequant != 0, &p, key, first);
        else if (hi > lo)
            fn(src, dst, scales, lo, hi, block, dequant != 0, &p);
    }
    return 0;
}
