/* The Philox pieces of the quantizers on their own, for the tests (tests/test_philox.py). */
#include "quant_common.h"

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
