/* gauss.c: how well a law and K code i.i.d. N(0,1) data, the codec's standard quality figure.
 *
 * The data x is scaled by c into code units, each tile is encoded by the Viterbi search and
 * decoded, and the reconstruction is decoded/c. c is picked by a golden-section search on the
 * first 64 tiles, between 0.8 and 1.25 times the law's RMS value (every law and K measured has
 * its optimum well inside). */
#include <math.h>
#include <stdlib.h>

#include "impl.h"

#define SEARCH_TILES 64
#define SEARCH_STEPS 10

void tmx_trellis_gauss_fill(uint64_t *state, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        /* Box-Muller on two 53-bit uniforms in (0, 1]. */
        const double u1 = ((trellis_splitmix64(state) >> 11) + 1) * 0x1p-53;
        const double u2 = ((trellis_splitmix64(state) >> 11) + 1) * 0x1p-53;
        x[i] = (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
    }
}

/* Relative MSE of the first n tiles of x[n][256] at scale c. */
static double rel_mse_at(struct tmx_trellis_viterbi *vit, const struct tmx_trellis_law *law,
                         int K, const float *x, int n, double c) {
    float target[TMX_TRELLIS_TILE], decoded[TMX_TRELLIS_TILE];
    uint32_t words[8 * TMX_TRELLIS_K_MAX];
    double err = 0.0, ref = 0.0;
    for (int i = 0; i < n; i++) {
        const float *xt = x + (int64_t)i * TMX_TRELLIS_TILE;
        for (int j = 0; j < TMX_TRELLIS_TILE; j++) target[j] = (float)(c * xt[j]);
        tmx_trellis_viterbi_encode(vit, target, words);
        tmx_trellis_decode_values(law, words, K, decoded);
        for (int j = 0; j < TMX_TRELLIS_TILE; j++) {
            const double d = xt[j] - decoded[j] / c;
            err += d * d;
            ref += (double)xt[j] * xt[j];
        }
    }
    return err / ref;
}

enum tmx_status tmx_trellis_gauss_mse(const struct tmx_trellis_law *law, int K, int n_tiles,
                                      uint64_t seed, double *rel_mse, double *scale, char **err) {
    if (n_tiles < 1)
        return trellis_err(err, TMX_ERR_INVALID, "trellis gauss mse: n_tiles = %d", n_tiles);
    struct tmx_trellis_viterbi *vit;
    enum tmx_status st = tmx_trellis_viterbi_new(law, K, &vit, err);
    if (st != TMX_OK) return st;
    float *x = malloc((size_t)n_tiles * TMX_TRELLIS_TILE * sizeof *x); /* [n_tiles][256] */
    if (!x) {
        tmx_trellis_viterbi_free(vit);
        return trellis_err(err, TMX_ERR_NOMEM, "trellis gauss mse: out of memory");
    }
    uint64_t rng = seed;
    tmx_trellis_gauss_fill(&rng, x, (int64_t)n_tiles * TMX_TRELLIS_TILE);

    float *v = malloc(65536 * sizeof *v); /* each state's (first) value */
    if (!v) {
        free(x);
        tmx_trellis_viterbi_free(vit);
        return trellis_err(err, TMX_ERR_NOMEM, "trellis gauss mse: out of memory");
    }
    tmx_trellis_state_values(law, v, NULL);
    double rms = 0.0; /* of the law's values over all states */
    for (unsigned s = 0; s < 65536; s++) rms += (double)v[s] * v[s];
    rms = sqrt(rms / 65536);
    free(v);

    const int m = n_tiles < SEARCH_TILES ? n_tiles : SEARCH_TILES;
    const double g = (sqrt(5.0) - 1) / 2;
    double lo = 0.8 * rms, hi = 1.25 * rms;
    double a = hi - g * (hi - lo), b = lo + g * (hi - lo);
    double fa = rel_mse_at(vit, law, K, x, m, a), fb = rel_mse_at(vit, law, K, x, m, b);
    for (int i = 0; i < SEARCH_STEPS; i++) {
        if (fa < fb) {
            hi = b, b = a, fb = fa;
            a = hi - g * (hi - lo);
            fa = rel_mse_at(vit, law, K, x, m, a);
        } else {
            lo = a, a = b, fa = fb;
            b = lo + g * (hi - lo);
            fb = rel_mse_at(vit, law, K, x, m, b);
        }
    }
    *scale = fa < fb ? a : b;
    *rel_mse = rel_mse_at(vit, law, K, x, n_tiles, *scale);
    free(x);
    tmx_trellis_viterbi_free(vit);
    return TMX_OK;
}
