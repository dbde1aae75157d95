/* pair_law.c: how well the candidate pair law (pair_law.h) codes i.i.d. N(0,1) data, beside
 * TrellisMX v1's law e4m3 through the same search (docs/perf/h200-codec.md, "A cheaper
 * decode"). Built as bin/trellis-pair-law; minutes of one core at 1000 tiles.
 *
 *     trellis-pair-law LAW K TILES [ALPHA]
 *
 * LAW: v1 (law e4m3, one state a weight), pair (pair law, E4M3 codes) or pair-e2m1 (the same
 * quantiles rounded to E2M1 after dividing by ALPHA, 0.5625 by default, as law e2m1 does).
 * Prints the relative MSE at the best global scale (a grid over 0.84..1.10 times the table's
 * RMS, searched on the first 32 tiles), the figure of docs/trellismx.md §11.
 *
 * The search is a plain tail-biting Viterbi over the 2^16 states, as plugins/trellis/viterbi.c
 * does it (a pass over the target rotated by half a tile finds the seam, a second pass closes
 * the ring there), written for V = 1 or 2 weights a state and left unvectorized: it is a
 * measurement, not the encoder. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pair_law.h"
#include "tmx/tensor.h"
#include "trellis.h"

#define TILE 256
#define STATES 65536

struct search {
    int V, KV;             /* weights a state, ring bits a state (V K) */
    float *value[2];       /* [65536] value of each state's weight 0 and 1 (V = 2) */
    float *m[2];           /* [2^(16 - KV)] best cost by the low 16 - KV bits of the state */
    uint8_t *back;         /* [TILE / V][2^(16 - KV)] the top KV bits of the best predecessor */
    uint16_t path[TILE];   /* states of the best path */
};

/* Runs the steps over x[TILE] from the costs in m[0]; the final costs end in m[0]. */
static void forward(struct search *sr, const float *x) {
    const int steps = TILE / sr->V, nh = 1 << (16 - sr->KV), nj = 1 << sr->KV;
    float *prev = sr->m[0], *next = sr->m[1];
    for (int t = 0; t < steps; t++) {
        const float x0 = x[t * sr->V], x1 = sr->V == 2 ? x[t * sr->V + 1] : 0.0f;
        uint8_t *back = sr->back + (size_t)t * nh;
        for (int h = 0; h < nh; h++) next[h] = INFINITY;
        for (int j = 0; j < nj; j++) { /* j: the state's top KV bits, h its low 16 - KV */
            const float *v0 = sr->value[0] + ((size_t)j << (16 - sr->KV));
            const float *v1 = sr->value[1] + ((size_t)j << (16 - sr->KV));
            for (int h = 0; h < nh; h++) {
                const int s = j << (16 - sr->KV) | h;
                const float d0 = v0[h] - x0, d1 = sr->V == 2 ? v1[h] - x1 : 0.0f;
                const float c = prev[s >> sr->KV] + d0 * d0 + d1 * d1;
                if (c < next[h]) next[h] = c, back[h] = (uint8_t)j;
            }
        }
        float *swap = prev;
        prev = next, next = swap;
    }
    if (prev != sr->m[0]) memcpy(sr->m[0], prev, sizeof(float) << (16 - sr->KV));
}

/* path[from..] backwards from the final state whose low bits are h. */
static void backtrack(struct search *sr, unsigned h, int from) {
    const int steps = TILE / sr->V, nh = 1 << (16 - sr->KV);
    for (int t = steps - 1; t >= from; t--) {
        const unsigned s = h | (unsigned)sr->back[(size_t)t * nh + h] << (16 - sr->KV);
        sr->path[t] = (uint16_t)s;
        h = s >> sr->KV;
    }
}

/* dec[TILE] <- the closest decodable sequence to x[TILE] (in step order). */
static void encode(struct search *sr, const float *x, float *dec) {
    const int steps = TILE / sr->V, half = steps / 2, nh = 1 << (16 - sr->KV);
    float rot[TILE];
    for (int i = 0; i < TILE; i++) rot[i] = x[(i + half * sr->V) % TILE];
    memset(sr->m[0], 0, sizeof(float) * nh);
    forward(sr, rot);
    unsigned best = 0;
    for (unsigned h = 1; h < (unsigned)nh; h++)
        if (sr->m[0][h] < sr->m[0][best]) best = h;
    backtrack(sr, best, half - 1);
    const unsigned seam = sr->path[half - 1] & (nh - 1);
    for (int h = 0; h < nh; h++) sr->m[0][h] = 0x1p100f;
    sr->m[0][seam] = 0.0f;
    forward(sr, x);
    backtrack(sr, seam, 0);
    for (int t = 0; t < steps; t++)
        for (int v = 0; v < sr->V; v++) dec[t * sr->V + v] = sr->value[v][sr->path[t]];
}

static double rel_mse(struct search *sr, const float *x, int n, double c) {
    float target[TILE], dec[TILE];
    double err = 0.0, ref = 0.0;
    for (int i = 0; i < n; i++) {
        const float *xt = x + (size_t)i * TILE;
        for (int j = 0; j < TILE; j++) target[j] = (float)(c * xt[j]);
        encode(sr, target, dec);
        for (int j = 0; j < TILE; j++) {
            const double d = xt[j] - dec[j] / c;
            err += d * d;
            ref += (double)xt[j] * xt[j];
        }
    }
    return err / ref;
}

static double alpha = 0.5625;
static uint8_t e2m1_scaled(float x) { return tmx_trellis_e2m1_round((float)(x / alpha)); }

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: trellis-pair-law v1|pair|pair-e2m1 K TILES [ALPHA]\n");
        return 2;
    }
    const char *law = argv[1];
    const int K = atoi(argv[2]), n = atoi(argv[3]);
    if (argc > 4) alpha = atof(argv[4]);
    const int pair = strcmp(law, "v1") != 0;
    if ((pair && strcmp(law, "pair") && strcmp(law, "pair-e2m1")) || K < 2 || K > 4 || n < 1 ||
        !(alpha > 0)) {
        fprintf(stderr, "trellis-pair-law: bad LAW, K (2..4), TILES or ALPHA\n");
        return 2;
    }
    struct search sr = {.V = pair ? 2 : 1, .KV = (pair ? 2 : 1) * K};
    sr.value[0] = malloc(STATES * sizeof(float));
    sr.value[1] = malloc(STATES * sizeof(float));
    sr.m[0] = malloc(STATES * sizeof(float));
    sr.m[1] = malloc(STATES * sizeof(float));
    sr.back = malloc((size_t)(TILE / sr.V) << (16 - sr.KV));
    float *x = malloc((size_t)n * TILE * sizeof(float)); /* [n][TILE] */
    uint16_t *table = malloc(STATES * sizeof(uint16_t));
    if (!sr.value[0] || !sr.value[1] || !sr.m[0] || !sr.m[1] || !sr.back || !x || !table) {
        fprintf(stderr, "trellis-pair-law: out of memory\n");
        return 1;
    }
    if (!pair) {
        struct tmx_trellis_law l;
        char *err = NULL;
        tmx_trellis_law_init(&l, TMX_TRELLIS_LAW_E4M3, 1.0f, &err);
        for (int s = 0; s < STATES; s++) sr.value[0][s] = l.value[tmx_trellis_sigma((uint16_t)s)];
    } else if (!strcmp(law, "pair")) {
        pair_law_table(table, tmx_trellis_e4m3_round);
        for (int s = 0; s < STATES; s++) {
            sr.value[0][s] = tmx_e4m3_to_f32(table[s] & 0xff);
            sr.value[1][s] = tmx_e4m3_to_f32(table[s] >> 8);
        }
    } else {
        pair_law_table(table, e2m1_scaled);
        for (int s = 0; s < STATES; s++) {
            sr.value[0][s] = tmx_trellis_e2m1_to_f32(table[s] & 0xf);
            sr.value[1][s] = tmx_trellis_e2m1_to_f32(table[s] >> 8 & 0xf);
        }
    }
    double rms = 0.0;
    for (int s = 0; s < STATES; s++) rms += (double)sr.value[0][s] * sr.value[0][s];
    rms = sqrt(rms / STATES);

    uint64_t seed = 1;
    tmx_trellis_gauss_fill(&seed, x, (int64_t)n * TILE);
    double best = INFINITY, scale = rms;
    for (int i = 0; i <= 13; i++) {
        const double c = (0.84 + 0.02 * i) * rms, e = rel_mse(&sr, x, n < 32 ? n : 32, c);
        if (e < best) best = e, scale = c;
    }
    printf("law %s K %d tiles %d: relative MSE %.5f (scale %.2f x RMS)\n", law, K, n,
           rel_mse(&sr, x, n, scale), scale / rms);
    free(sr.value[0]);
    free(sr.value[1]);
    free(sr.m[0]);
    free(sr.m[1]);
    free(sr.back);
    free(x);
    free(table);
    return 0;
}
