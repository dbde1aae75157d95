/* viterbi.c: the tail-biting Viterbi search that encodes one tile.
 *
 * A path is 256 states in which each state's high 16-K bits are the previous state's low 16-K
 * bits; its cost is the squared error between the target and the law's value of each state.
 * Only a state's low 16-K bits reach its successor, so a step needs, per value h of those bits,
 * just the best cost over the 2^K states that share them (they differ in the top K bits):
 *
 *     m_t[h] = min_j c_t[h | j << (16-K)]        c_t[s] = m_{t-1}[s >> K] + (value[s] - x_t)^2
 *
 * One step is one pass over the 2^16 state values; it keeps m (2^(16-K) floats) and, for the
 * backtrack, the minimizing j of every h (a byte).
 *
 * Tail-biting, as QTIP does it: a first pass over the target rotated by 128 positions, free at
 * both ends, finds a good state for the ring's seam (position 255, now in the middle); a second
 * pass over the target as it is starts and ends on that seam's low 16-K bits, so its best path
 * closes the ring. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "impl.h"

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Start cost of the states a pass may not start from: finite, so that sums stay ordered. */
#define UNREACHABLE 0x1p100f

struct tmx_trellis_viterbi {
    int K;
    float *value;   /* [65536] the law's value of each state */
    float *m[2];    /* [2^(16-K) + 16] m_{t-1} and m_t, swapping roles every step */
    uint32_t *back; /* [256][2^(16-K) / 4] minimizing top bits j, four per word (see step) */
    float x[TMX_TRELLIS_TILE];       /* the target in trellis order, maybe rotated */
    uint16_t path[TMX_TRELLIS_TILE]; /* states of the best path */
};

void tmx_trellis_viterbi_free(struct tmx_trellis_viterbi *vit) {
    if (!vit) return;
    free(vit->value);
    free(vit->m[0]);
    free(vit->m[1]);
    free(vit->back);
    free(vit);
}

enum tmx_status tmx_trellis_viterbi_new(const struct tmx_trellis_law *law, int K,
                                        struct tmx_trellis_viterbi **out, char **err) {
    if (K < TMX_TRELLIS_K_MIN || K > TMX_TRELLIS_K_MAX)
        return trellis_err(err, TMX_ERR_INVALID, "trellis viterbi: K = %d is not in %d..%d", K,
                           TMX_TRELLIS_K_MIN, TMX_TRELLIS_K_MAX);
    struct tmx_trellis_viterbi *vit = calloc(1, sizeof *vit);
    if (!vit) return trellis_err(err, TMX_ERR_NOMEM, "trellis viterbi: out of memory");
    const size_t nh = (size_t)1 << (16 - K);
    vit->K = K;
    vit->value = aligned_alloc(64, 65536 * sizeof(float));
    /* Slack after m: K = 2 loads 8 costs to use the first 2 (16 keeps the size a multiple of
     * the alignment). */
    vit->m[0] = aligned_alloc(64, (nh + 16) * sizeof(float));
    vit->m[1] = aligned_alloc(64, (nh + 16) * sizeof(float));
    vit->back = malloc(TMX_TRELLIS_TILE * nh);
    if (!vit->value || !vit->m[0] || !vit->m[1] || !vit->back) {
        tmx_trellis_viterbi_free(vit);
        return trellis_err(err, TMX_ERR_NOMEM, "trellis viterbi: out of memory");
    }
    for (int i = 0; i < 16; i++) vit->m[0][nh + i] = vit->m[1][nh + i] = UNREACHABLE;
    for (unsigned s = 0; s < 65536; s++) vit->value[s] = law->value[tmx_trellis_sigma((uint16_t)s)];
    *out = vit;
    return TMX_OK;
}

/* m_{t-1}[(s + i) >> K] for the 8 states s..s+7 (s a multiple of 8): one cost for K >= 3,
 * two for K = 2. */
static inline f32x8 prev_costs(const float *prev, size_t s, int K) {
    const float a = prev[s >> K];
    if (K >= 3) return (f32x8){a, a, a, a, a, a, a, a};
    f32x8 p;
    memcpy(&p, prev + (s >> K), sizeof p);
    return __builtin_shufflevector(p, p, 0, 0, 0, 0, 1, 1, 1, 1);
}

/* Lanewise min: one instruction where AVX2 has it. */
static inline i32x8 min_i32(i32x8 a, i32x8 b) {
#ifdef __AVX2__
    return (i32x8)_mm256_min_epi32((__m256i)a, (__m256i)b);
#else
    const i32x8 lt = a < b;
    return (a & lt) | (b & ~lt);
#endif
}

/* Costs are non-negative floats, which order like their bit patterns; a cost with j written
 * into its K lowest mantissa bits carries its argmin through an integer min (the lowest j wins
 * ties). It loses those bits, a relative 2^(K-23), far below what decides a path. */
static inline i32x8 tagged_cost(const float *value, const float *prev, size_t s, f32x8 x,
                                int32_t j, int K) {
    f32x8 v;
    memcpy(&v, value + s, sizeof v);
    const f32x8 d = v - x;
    return ((i32x8)(prev_costs(prev, s, K) + d * d) & ~((1 << K) - 1)) | j;
}

static inline void store8(float *dst, i32x8 v) { memcpy(dst, &v, sizeof v); }

/* One step for target value x: next = m_t from prev = m_{t-1}, and the argmins j into back.
 * Histories go 32 at a time, as four independent vectors, so that their min chains overlap;
 * word 8g + i of back holds in byte k the j of history h = 32g + 8k + i. */
static inline __attribute__((always_inline)) void step(const float *value, const float *prev,
                                                       float *next, uint32_t *back, float x,
                                                       int K) {
    const size_t nh = (size_t)1 << (16 - K);
    const i32x8 none = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,
                        INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
    const i32x8 tag = none & ((1 << K) - 1);
    const f32x8 xv = {x, x, x, x, x, x, x, x};
    for (size_t h = 0; h < nh; h += 32) {
        i32x8 b0 = none, b1 = none, b2 = none, b3 = none;
        for (int32_t j = 0; j < 1 << K; j++) {
            const size_t s = (size_t)j << (16 - K) | h; /* j is the state's top K bits */
            b0 = min_i32(tagged_cost(value, prev, s, xv, j, K), b0);
            b1 = min_i32(tagged_cost(value, prev, s + 8, xv, j, K), b1);
            b2 = min_i32(tagged_cost(value, prev, s + 16, xv, j, K), b2);
            b3 = min_i32(tagged_cost(value, prev, s + 24, xv, j, K), b3);
        }
        store8(next + h, b0);
        store8(next + h + 8, b1);
        store8(next + h + 16, b2);
        store8(next + h + 24, b3);
        const i32x8 bytes = (b0 & tag) | (b1 & tag) << 8 | (b2 & tag) << 16 | (b3 & tag) << 24;
        memcpy(back + h / 4, &bytes, sizeof bytes);
    }
}

static inline unsigned back_at(const uint32_t *back, unsigned h) {
    return back[(h >> 5) * 8 + (h & 7)] >> (8 * ((h >> 3) & 3)) & 0xff;
}

static inline __attribute__((always_inline)) void forward_k(struct tmx_trellis_viterbi *vit,
                                                            int K) {
    const size_t nw = (size_t)1 << (14 - K);
    for (int t = 0; t < TMX_TRELLIS_TILE; t++)
        step(vit->value, vit->m[t & 1], vit->m[(t + 1) & 1], vit->back + t * nw, vit->x[t], K);
}

/* Runs all 256 steps over vit->x from the start costs in m[0]; the last m_t ends in m[0]. K is
 * a constant in each branch, so every inner loop is specialized. */
static void forward(struct tmx_trellis_viterbi *vit) {
    switch (vit->K) {
    case 2: forward_k(vit, 2); break;
    case 3: forward_k(vit, 3); break;
    case 4: forward_k(vit, 4); break;
    case 5: forward_k(vit, 5); break;
    default: forward_k(vit, 6); break;
    }
}

/* Fills path[from..255] backwards from the final state whose low bits are h. */
static void backtrack(struct tmx_trellis_viterbi *vit, unsigned h, int from) {
    const int K = vit->K, hb = 16 - K;
    const size_t nw = (size_t)1 << (14 - K);
    for (int t = TMX_TRELLIS_TILE - 1; t >= from; t--) {
        const unsigned s = h | back_at(vit->back + t * nw, h) << hb;
        vit->path[t] = (uint16_t)s;
        h = s >> K;
    }
}

double tmx_trellis_viterbi_encode(struct tmx_trellis_viterbi *vit, const float *target,
                                  uint32_t *words) {
    const int K = vit->K, half = TMX_TRELLIS_TILE / 2;
    const unsigned nh = 1u << (16 - K);

    /* Pass 1: rotated by half a tile, free ends; read the seam state in the middle. */
    for (int t = 0; t < TMX_TRELLIS_TILE; t++)
        vit->x[t] = target[tmx_trellis_pos((t + half) % TMX_TRELLIS_TILE)];
    memset(vit->m[0], 0, nh * sizeof(float));
    forward(vit);
    unsigned best = 0;
    for (unsigned h = 1; h < nh; h++)
        if (vit->m[0][h] < vit->m[0][best]) best = h;
    backtrack(vit, best, half - 1);
    const unsigned seam = vit->path[half - 1] & (nh - 1);

    /* Pass 2: the target as it is, entering from and returning to the seam. */
    for (int t = 0; t < TMX_TRELLIS_TILE; t++) vit->x[t] = target[tmx_trellis_pos(t)];
    for (unsigned h = 0; h < nh; h++) vit->m[0][h] = UNREACHABLE;
    vit->m[0][seam] = 0.0f;
    forward(vit);
    backtrack(vit, seam, 0);

    uint8_t syms[TMX_TRELLIS_TILE];
    double sse = 0.0;
    for (int t = 0; t < TMX_TRELLIS_TILE; t++) {
        syms[t] = (uint8_t)(vit->path[t] & ((1u << K) - 1));
        const double d = (double)vit->x[t] - vit->value[vit->path[t]];
        sse += d * d;
    }
    tmx_trellis_pack(syms, K, words);
    return sse;
}
