/* ScaledFP8 (mixprec.compress.fp8): encode and decode.
 * Per chunk: amax (NaN/Inf flag the chunk), k = the largest integer with amax 2**k <= the format's max
 * (clamped to [-126, 126], 0 for an all-zero chunk), header 2**-k, codes = the fp8 bytes of x 2**k rounded
 * to the format's grid (nearest even, or stochastic as ScaledFP8._round_stochastic_), at most fp8_ceiling(k)
 * in magnitude so that every decoded value is finite. Formats: 0 = e4m3fn
 * (bias 7, 3 fraction bits, max 448), 1 = e5m2 (bias 15, 2 fraction bits, max 57344). */
#include "quant_common.h"

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
