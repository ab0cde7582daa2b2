/* Shared helpers of the mixprec CPU kernels: bit casts and the thread-count convention. */
#ifndef MIXPREC_COMMON_H
#define MIXPREC_COMMON_H
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint64_t f64_bits(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }
static inline double bits_f64(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }

/* Elements below which a kernel runs on the calling thread only: an OpenMP fork/join costs microseconds. */
#define MIXPREC_GRAIN 32768
#endif
