/* pair_law.h: the candidate "pair law" of docs/perf/h200-codec.md, "A cheaper decode": one
 * 16-bit trellis state per two weights (trellis positions 2t, 2t + 1), the ring advancing 2K
 * bits a state, the pair's two E4M3 codes read from a table of 65536 pairs. Not TrellisMX v1;
 * shared by the quality study (pair_law.c) and the GPU variants (gemv_variants.cu).
 *
 * The table: code i of state s is Q[fmix32(s | i << 16) >> 22], where Q[1024] holds the E4M3
 * codes of the standard normal's quantiles at (j + 1/2) / 1024 and fmix32 is MurmurHash3's
 * finalizer. */
#ifndef TMX_TOOLS_PAIR_LAW_H
#define TMX_TOOLS_PAIR_LAW_H

#include <math.h>
#include <stdint.h>

static inline uint32_t pair_law_fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

/* The standard normal quantile at p in (0, 1), by bisection on erfc (a tool, not a kernel). */
static inline double pair_law_quantile(double p) {
    double lo = -10.0, hi = 10.0;
    for (int i = 0; i < 100; i++) {
        const double m = 0.5 * (lo + hi);
        if (0.5 * erfc(-m / sqrt(2.0)) < p) lo = m;
        else hi = m;
    }
    return 0.5 * (lo + hi);
}

/* table[s] = code 0 | code 1 << 8, for the 65536 states; round is the E4M3 rounding to use
 * (tmx_trellis_e4m3_round). */
static inline void pair_law_table(uint16_t *table, uint8_t (*round)(float)) {
    uint8_t q[1024];
    for (int j = 0; j < 1024; j++) q[j] = round((float)pair_law_quantile((j + 0.5) / 1024));
    for (uint32_t s = 0; s < 65536; s++)
        table[s] = (uint16_t)(q[pair_law_fmix32(s) >> 22] |
                              q[pair_law_fmix32(s | 1u << 16) >> 22] << 8);
}

/* The state of pair step t (0..127) of a tile's words[8K]: ring bits [2K(t + 1) - 16,
 * 2K(t + 1)) modulo 256K, MSB-first (docs/trellismx.md §3 with 2K bits a step). */
static inline uint16_t pair_law_state(const uint32_t *words, int K, int t) {
    const int ring = 256 * K;
    uint32_t s = 0;
    for (int i = 0; i < 16; i++) {
        const int b = ((2 * K * (t + 1) - 16 + i) % ring + ring) % ring;
        s = s << 1 | (words[b >> 5] >> (31 - (b & 31)) & 1u);
    }
    return (uint16_t)s;
}

#endif
