/* The fp32 sum of P shards in rank order, scaled and rounded once to the output dtype (mixprec.comm.fp32_sum).
 *
 * Fuses what the torch path does in five or more passes per block (widen, add, divide, multiply, round) into
 * one: acc = x[0]; acc = acc + x[r] for r = 1..P-1 (each an IEEE fp32 add, in order); acc = acc / P when
 * averaging; acc = acc * factor (factor already rounded to fp32, as torch does with a Python scalar); then
 * round to nearest even into bf16/fp16, or store fp32. Widening bf16/fp16 to fp32 is exact, so every finite
 * and infinite result has the torch path's bits. NaN payloads depend on operand order in the x86 add, so the
 * kernel only counts NaN results and the caller reruns the torch path when there are any.
 * dtype codes: dtypes.h (fp32, fp16, bf16). */
#include <stddef.h>
#include "common.h"

static inline float widen(const void *base, ptrdiff_t i, int dt) {
    if (dt == MIXPREC_BF16) return bits_f32((uint32_t)((const uint16_t *)base)[i] << 16);
    if (dt == MIXPREC_F16) return f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline int is_nan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

static inline void store(void *out, ptrdiff_t i, float acc, int dt) {
    if (dt == MIXPREC_BF16) {
        uint32_t u = f32_bits(acc);
        /* ties to even on the 16 dropped bits; carries into the exponent give inf past the largest bf16 */
        ((uint16_t *)out)[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    } else if (dt == MIXPREC_F16) {
        ((uint16_t *)out)[i] = f32_to_f16(acc); /* round to nearest even */
    } else {
        ((float *)out)[i] = acc;
    }
}

/* One block of the sum; always inlined with constant dtypes, so each combination gets its own vector loops. */
static inline __attribute__((always_inline)) int64_t sum_block(const char *base, const int in_dt, size_t row_bytes,
                                                               int64_t P, int64_t b0, int64_t b1, void *out,
                                                               const int out_dt, int average, float divisor,
                                                               int has_factor, float factor) {
    float acc[4096];
    const int64_t len = b1 - b0;
    const size_t esize = in_dt == MIXPREC_F32 ? 4 : 2;
    const char *first = base + (size_t)b0 * esize;
    for (int64_t i = 0; i < len; i++) acc[i] = widen(first, i, in_dt);
    for (int64_t r = 1; r < P; r++) {
        const char *row = first + (size_t)r * row_bytes;
        for (int64_t i = 0; i < len; i++) acc[i] = acc[i] + widen(row, i, in_dt);
    }
    if (average)
        for (int64_t i = 0; i < len; i++) acc[i] = acc[i] / divisor;
    if (has_factor)
        for (int64_t i = 0; i < len; i++) acc[i] = acc[i] * factor;
    int64_t nans = 0;
    char *dst = (char *)out + (size_t)b0 * (out_dt == MIXPREC_F32 ? 4 : 2);
    for (int64_t i = 0; i < len; i++) {
        nans += is_nan(acc[i]);
        store(dst, i, acc[i], out_dt);
    }
    return nans;
}

#define SUM_CASE(IN, OUT)                                                                                      \
    if (in_dt == IN && out_dt == OUT) {                                                                        \
        _Pragma("omp parallel for schedule(static) reduction(+ : nans) num_threads(nthreads) if (work >= MIXPREC_GRAIN)") \
        for (int64_t b0 = 0; b0 < n; b0 += 4096)                                                               \
            nans += sum_block(base, IN, row_bytes, P, b0, b0 + 4096 < n ? b0 + 4096 : n, out, OUT, average,     \
                              divisor, has_factor, factor);                                                    \
        return nans;                                                                                           \
    }

/* shards: P rows of n elements, row r at shards + r * row_stride elements; returns how many results are NaN
 * (-1: an unknown dtype code). */
int64_t mixprec_fp32sum_rows(const void *shards, int in_dt, int64_t row_stride, int64_t P, int64_t n, void *out,
                             int out_dt, int average, int has_factor, float factor, int nthreads) {
    const char *base = (const char *)shards;
    const size_t row_bytes = (size_t)row_stride * (in_dt == MIXPREC_F32 ? 4 : 2);
    const float divisor = (float)P;
    const int64_t work = n * P;
    int64_t nans = 0;
    SUM_CASE(MIXPREC_F32, MIXPREC_F32) SUM_CASE(MIXPREC_F32, MIXPREC_F16) SUM_CASE(MIXPREC_F32, MIXPREC_BF16)
    SUM_CASE(MIXPREC_F16, MIXPREC_F32) SUM_CASE(MIXPREC_F16, MIXPREC_F16) SUM_CASE(MIXPREC_F16, MIXPREC_BF16)
    SUM_CASE(MIXPREC_BF16, MIXPREC_F32) SUM_CASE(MIXPREC_BF16, MIXPREC_F16) SUM_CASE(MIXPREC_BF16, MIXPREC_BF16)
    return -1;
}
