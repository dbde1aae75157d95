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
 * Law e4m3-pair codes two positions by one state (of the odd one), so its path is the 128
 * states of positions 1, 3, ..., 255, each shifted 2K bits from the last, and a step's cost is
 * the squared error of both positions: the same search with KV = 2K bits a step in place of K
 * (K <= 4, so that j fits the byte and the tag below).
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
    int K, V;       /* bits a position; positions a state (2: law e4m3-pair) */
    float *value;   /* [65536] the law's value of each state (of its first position) */
    float *value2;  /* [65536] law e4m3-pair: the value of its second position */
    float *m[2];    /* [2^(16-K) + 16] m_{t-1} and m_t, swapping roles every step */
    uint32_t *back; /* [256][2^(16-K) / 4] minimizing top bits j, four per word (see step) */
    float x[TMX_TRELLIS_TILE];       /* the target in trellis order, maybe rotated */
    uint16_t path[TMX_TRELLIS_TILE]; /* states of the best path */
};

void tmx_trellis_viterbi_free(struct tmx_trellis_viterbi *vit) {
    if (!vit) return;
    free(vit->value);
    free(vit->value2);
    free(vit->m[0]);
    free(vit->m[1]);
    free(vit->back);
    free(vit);
}

enum tmx_status tmx_trellis_viterbi_new(const struct tmx_trellis_law *law, int K,
                                        struct tmx_trellis_viterbi **out, char **err) {
    const int pair = law->id == TMX_TRELLIS_LAW_PAIR, k_max = tmx_trellis_k_max(law->id);
    if (K < TMX_TRELLIS_K_MIN || K > k_max)
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis viterbi: K = %d is not in %d..%d for law %s", K,
                           TMX_TRELLIS_K_MIN, k_max, tmx_trellis_law_name(law->id));
    struct tmx_trellis_viterbi *vit = calloc(1, sizeof *vit);
    if (!vit) return trellis_err(err, TMX_ERR_NOMEM, "trellis viterbi: out of memory");
    const size_t nh = (size_t)1 << (16 - K); /* the most histories a step keeps (V = 1) */
    vit->K = K;
    vit->V = pair ? 2 : 1;
    vit->value = aligned_alloc(64, 65536 * sizeof(float));
    if (pair) vit->value2 = aligned_alloc(64, 65536 * sizeof(float));
    /* Slack after m: K = 2 loads 8 costs to use the first 2 (16 keeps the size a multiple of
     * the alignment). */
    vit->m[0] = aligned_alloc(64, (nh + 16) * sizeof(float));
    vit->m[1] = aligned_alloc(64, (nh + 16) * sizeof(float));
    vit->back = malloc(TMX_TRELLIS_TILE * nh);
    if (!vit->value || (pair && !vit->value2) || !vit->m[0] || !vit->m[1] || !vit->back) {
        tmx_trellis_viterbi_free(vit);
        return trellis_err(err, TMX_ERR_NOMEM, "trellis viterbi: out of memory");
    }
    for (int i = 0; i < 16; i++) vit->m[0][nh + i] = vit->m[1][nh + i] = UNREACHABLE;
    tmx_trellis_state_values(law, vit->value, vit->value2);
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
 * ties). It loses those bits, a relative 2^(K-23) (2^-15 at most), far below what decides a
 * path. value2 and x2: the second position of a pair (law e4m3-pair), else NULL. */
static inline i32x8 tagged_cost(const float *value, const float *value2, const float *prev,
                                size_t s, f32x8 x, f32x8 x2, int32_t j, int K) {
    f32x8 v;
    memcpy(&v, value + s, sizeof v);
    const f32x8 d = v - x;
    f32x8 c = prev_costs(prev, s, K) + d * d;
    if (value2) {
        memcpy(&v, value2 + s, sizeof v);
        const f32x8 d2 = v - x2;
        c += d2 * d2;
    }
    return ((i32x8)c & ~((1 << K) - 1)) | j;
}

static inline void store8(float *dst, i32x8 v) { memcpy(dst, &v, sizeof v); }

/* One step for target value x (and x2, law e4m3-pair): next = m_t from prev = m_{t-1}, and
 * the argmins j into back. K is the bits a step (2K for pairs). Histories go 32 at a time, as
 * four independent vectors, so that their min chains overlap; word 8g + i of back holds in
 * byte k the j of history h = 32g + 8k + i. */
static inline __attribute__((always_inline)) void step(const float *value, const float *value2,
                                                       const float *prev, float *next,
                                                       uint32_t *back, float x, float x2, int K) {
    const size_t nh = (size_t)1 << (16 - K);
    const i32x8 none = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX,
                        INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
    const i32x8 tag = none & ((1 << K) - 1);
    const f32x8 xv = {x, x, x, x, x, x, x, x}, xv2 = {x2, x2, x2, x2, x2, x2, x2, x2};
    for (size_t h = 0; h < nh; h += 32) {
        i32x8 b0 = none, b1 = none, b2 = none, b3 = none;
        for (int32_t j = 0; j < 1 << K; j++) {
            const size_t s = (size_t)j << (16 - K) | h; /* j is the state's top K bits */
            b0 = min_i32(tagged_cost(value, value2, prev, s, xv, xv2, j, K), b0);
            b1 = min_i32(tagged_cost(value, value2, prev, s + 8, xv, xv2, j, K), b1);
            b2 = min_i32(tagged_cost(value, value2, prev, s + 16, xv, xv2, j, K), b2);
            b3 = min_i32(tagged_cost(value, value2, prev, s + 24, xv, xv2, j, K), b3);
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

/* V = 1: one step a position, KV = K. V = 2: one step a pair of positions, KV = 2K. */
static inline __attribute__((always_inline)) void forward_k(struct tmx_trellis_viterbi *vit,
                                                            int KV, int V) {
    const size_t nw = (size_t)1 << (14 - KV);
    for (int t = 0; t < TMX_TRELLIS_TILE / V; t++)
        step(vit->value, V == 2 ? vit->value2 : NULL, vit->m[t & 1], vit->m[(t + 1) & 1],
             vit->back + t * nw, vit->x[V * t], V == 2 ? vit->x[V * t + 1] : 0.0f, KV);
}

/* Runs every step over vit->x from the start costs in m[0]; the last m_t ends in m[0] (there
 * is an even number of steps). The bits a step are a constant in each branch, so every inner
 * loop is specialized. */
static void forward(struct tmx_trellis_viterbi *vit) {
    switch (vit->V * 8 + vit->K) {
    case 8 + 2: forward_k(vit, 2, 1); break;
    case 8 + 3: forward_k(vit, 3, 1); break;
    case 8 + 4: forward_k(vit, 4, 1); break;
    case 8 + 5: forward_k(vit, 5, 1); break;
    case 8 + 6: forward_k(vit, 6, 1); break;
    case 16 + 2: forward_k(vit, 4, 2); break;
    case 16 + 3: forward_k(vit, 6, 2); break;
    default: forward_k(vit, 8, 2); break;
    }
}

/* Fills path[from..] (steps) backwards from the final state whose low bits are h. */
static void backtrack(struct tmx_trellis_viterbi *vit, unsigned h, int from) {
    const int KV = vit->V * vit->K, hb = 16 - KV;
    const size_t nw = (size_t)1 << (14 - KV);
    for (int t = TMX_TRELLIS_TILE / vit->V - 1; t >= from; t--) {
        const unsigned s = h | back_at(vit->back + t * nw, h) << hb;
        vit->path[t] = (uint16_t)s;
        h = s >> KV;
    }
}

double tmx_trellis_viterbi_encode(struct tmx_trellis_viterbi *vit, const float *target,
                                  uint32_t *words) {
    const int K = vit->K, V = vit->V, KV = V * K, steps = TMX_TRELLIS_TILE / V;
    const int half = steps / 2; /* steps; 128 positions either way */
    const unsigned nh = 1u << (16 - KV);

    /* Pass 1: rotated by half a tile, free ends; read the seam state in the middle. */
    for (int t = 0; t < TMX_TRELLIS_TILE; t++)
        vit->x[t] = target[tmx_trellis_pos((t + TMX_TRELLIS_TILE / 2) % TMX_TRELLIS_TILE)];
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

    /* A step's state ends in its positions' symbols, the last position's lowest. */
    uint8_t syms[TMX_TRELLIS_TILE];
    double sse = 0.0;
    const unsigned mask = (1u << K) - 1;
    for (int t = 0; t < steps; t++) {
        const unsigned s = vit->path[t];
        for (int v = 0; v < V; v++) {
            const int p = V * t + v;
            syms[p] = (uint8_t)(s >> (K * (V - 1 - v)) & mask);
            const double d = (double)vit->x[p] - (v ? vit->value2[s] : vit->value[s]);
            sse += d * d;
        }
    }
    tmx_trellis_pack(syms, K, words);
    return sse;
}
