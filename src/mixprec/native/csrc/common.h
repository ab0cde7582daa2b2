/* Shared helpers of the mixprec CPU kernels: bit casts, fp16/bf16 conversions and the thread-count convention. */
#ifndef MIXPREC_COMMON_H
#define MIXPREC_COMMON_H
#include <stdint.h>
#include <string.h>
#include "dtypes.h"

static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint64_t f64_bits(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }
static inline double bits_f64(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* IEEE half <-> fp32 on the bits (no _Float16: older compilers lack it, and one failed build would cost
 * every kernel of the library). Widening is exact; narrowing rounds to nearest even, overflow to +-inf. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13)); /* inf, NaN */
    if (e == 0) return bits_f32(sign | f32_bits((float)man * 0x1p-24f)); /* zero, subnormal: exact */
    return bits_f32(sign | ((e + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, b = u & 0x7FFFFFFFu;
    float a = bits_f32(b);
    if (a != a) return (uint16_t)(sign | 0x7E00u | ((b >> 13) & 0x1FFu)); /* NaN stays NaN (quiet) */
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7C00u); /* at or beyond the midpoint above 65504 */
    if (a < 0x1p-14f) /* subnormal half: a multiple of 2**-24, rounded half to even (1024 = smallest normal) */
        return (uint16_t)(sign | (uint32_t)((a * 0x1p24f + 0x1p23f) - 0x1p23f));
    b = b + 0xFFFu + ((b >> 13) & 1u); /* round the 23-bit fraction to 10 bits, half to even */
    return (uint16_t)(sign | ((b >> 13) - (112u << 10)));
}

/* Round to nearest even, as torch's fp32 -> bf16 cast; NaN -> a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if (f != f) return (uint16_t)0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Elements below which a kernel runs on the calling thread only: an OpenMP fork/join costs microseconds. */
#define MIXPREC_GRAIN 32768
#endif
