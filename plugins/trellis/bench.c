/* bench.c: trellis-bench, the codec core's quality and speed figures as Markdown.
 *
 *     trellis-bench [--tiles N] [--seed S] [--alpha A] [--alpha-sweep]
 *
 * Prints the relative MSE of both laws and of the experimental law e4m3-pair (§14) on i.i.d.
 * N(0,1) data at K = 2, 3, 4 (N tiles, 200 by default, best scale), checks the K = 3 bars of
 * docs/trellismx.md (e4m3's for e4m3-pair, which only reports it), times the Viterbi encoder
 * on one core and measures CSF on the block scales of Gaussian rows. --alpha-sweep adds
 * the e2m1 K = 3 error for alpha = 30/64 .. 40/64. Exits 1 when a bar is missed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "trellis.h"

#define BAR_E4M3 0.0180
#define BAR_E2M1 0.0205
#define DEFAULT_ALPHA 0.5625f

/* CPU seconds of this process: other work on the machine does not count against it. */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int fail(char *err) {
    fprintf(stderr, "trellis-bench: %s\n", err ? err : "out of memory");
    free(err);
    return 2;
}

/* Tiles per CPU second of the encoder, over at least one CPU second. */
static int viterbi_speed(const struct tmx_trellis_law *law, int K, double *tiles_s) {
    struct tmx_trellis_viterbi *vit;
    char *err = NULL;
    if (tmx_trellis_viterbi_new(law, K, &vit, &err) != TMX_OK) return fail(err);
    float target[TMX_TRELLIS_TILE];
    uint32_t words[8 * TMX_TRELLIS_K_MAX];
    uint64_t s = 3;
    int n = 0;
    const double t0 = cpu_now();
    double t;
    do {
        tmx_trellis_gauss_fill(&s, target, TMX_TRELLIS_TILE);
        tmx_trellis_viterbi_encode(vit, target, words);
        n++;
    } while ((t = cpu_now() - t0) < 1.0);
    *tiles_s = n / t;
    tmx_trellis_viterbi_free(vit);
    return 0;
}

/* CSF size of the block scales of a [1024][4096] matrix of Gaussian rows whose norms spread
 * log-normally (standard deviation sd of the log): each block's scale is its max magnitude in
 * units that put the largest at 448. */
static int csf_size(int block, double sd, double *bits, double *ex_rate) {
    enum { ROWS = 1024, COLS = 4096 };
    const int nb = COLS / block;
    float row[COLS], z;
    float *amax = malloc(sizeof(float) * ROWS * (size_t)nb); /* [ROWS][nb] */
    uint8_t *scales = malloc((size_t)ROWS * (size_t)nb);
    uint8_t *fixed = malloc((size_t)tmx_trellis_csf_fixed_size(ROWS, nb));
    if (!amax || !scales || !fixed) return fail(NULL);
    uint64_t s = 7;
    float top = 0.0f;
    for (int r = 0; r < ROWS; r++) {
        tmx_trellis_gauss_fill(&s, &z, 1);
        tmx_trellis_gauss_fill(&s, row, COLS);
        const float norm = (float)exp(sd * z);
        for (int b = 0; b < nb; b++) {
            float m = 0.0f;
            for (int i = 0; i < block; i++) m = fmaxf(m, fabsf(row[b * block + i]) * norm);
            amax[r * nb + b] = m;
            top = fmaxf(top, m);
        }
    }
    for (int i = 0; i < ROWS * nb; i++) scales[i] = tmx_trellis_e4m3_round(amax[i] * 448.0f / top);
    uint32_t *ex;
    int64_t n_ex;
    char *err = NULL;
    if (tmx_trellis_csf_encode(scales, ROWS, nb, fixed, &ex, &n_ex, &err) != TMX_OK)
        return fail(err);
    *bits = 8.0 * (double)(tmx_trellis_csf_fixed_size(ROWS, nb) + 4 * n_ex) / (ROWS * nb);
    *ex_rate = (double)n_ex / (ROWS * nb);
    free(ex);
    free(amax);
    free(scales);
    free(fixed);
    return 0;
}

int main(int argc, char **argv) {
    int tiles = 200, sweep = 0;
    uint64_t seed = 1;
    float alpha = DEFAULT_ALPHA;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tiles") == 0 && i + 1 < argc) {
            tiles = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 0);
        } else if (strcmp(argv[i], "--alpha") == 0 && i + 1 < argc) {
            alpha = strtof(argv[++i], NULL);
        } else if (strcmp(argv[i], "--alpha-sweep") == 0) {
            sweep = 1;
        } else {
            fprintf(stderr, "usage: trellis-bench [--tiles N] [--seed S] [--alpha A] "
                            "[--alpha-sweep]\n");
            return 2;
        }
    }

    struct tmx_trellis_law laws[3];
    char *err = NULL;
    if (tmx_trellis_law_init(&laws[0], TMX_TRELLIS_LAW_E4M3, 1.0f, &err) != TMX_OK ||
        tmx_trellis_law_init(&laws[1], TMX_TRELLIS_LAW_E2M1, alpha, &err) != TMX_OK ||
        tmx_trellis_law_init(&laws[2], TMX_TRELLIS_LAW_PAIR, 1.0f, &err) != TMX_OK)
        return fail(err);

    printf("Relative MSE on i.i.d. N(0,1), %d tiles (seed %llu), best scale c; "
           "e2m1 alpha = %.9g. R(D) = 2^(-2K).\n\n",
           tiles, (unsigned long long)seed, (double)alpha);
    printf("| law | K | rel. MSE | SNR dB | c | R(D) | bar |\n|---|---|---|---|---|---|---|\n");
    int missed = 0;
    for (int l = 0; l < 3; l++)
        for (int K = 2; K <= 4; K++) {
            double mse, c;
            if (tmx_trellis_gauss_mse(&laws[l], K, tiles, seed, &mse, &c, &err) != TMX_OK)
                return fail(err);
            const double bar = l == 1 ? BAR_E2M1 : BAR_E4M3;
            const char *verdict = K != 3 ? "" : mse <= bar ? "pass" : "MISSED";
            if (K == 3 && mse > bar && l != 2) missed = 1; /* e4m3-pair: measured, not held */
            printf("| %s | %d | %.5f | %.2f | %.4f | %.5f | %s |\n",
                   tmx_trellis_law_name(laws[l].id), K, mse, -10.0 * log10(mse), c,
                   1.0 / (double)(1 << (2 * K)), verdict);
            fflush(stdout);
        }

    printf("\nViterbi encoder on N(0,1) targets, per CPU second of one core (two passes per "
           "tile):\n\n");
    printf("| law | K | tiles/s | weights/s |\n|---|---|---|---|\n");
    for (int l = 0; l < 3; l++)
        for (int K = 2; K <= 4; K++) {
            double tps;
            int rc = viterbi_speed(&laws[l], K, &tps);
            if (rc) return rc;
            printf("| %s | %d | %.0f | %.0f |\n", tmx_trellis_law_name(laws[l].id), K, tps,
                   tps * TMX_TRELLIS_TILE);
            fflush(stdout);
        }

    printf("\nCSF on the block scales of a [1024][4096] matrix of Gaussian rows, row norms "
           "log-normal:\n\n");
    printf("| block | sd of log row norm | exceptions | bits/scale | bits/weight |\n"
           "|---|---|---|---|---|\n");
    for (int block = 32; block >= 16; block /= 2)
        for (int i = 0; i < 3; i++) {
            double bits, rate;
            int rc = csf_size(block, 0.5 * i, &bits, &rate);
            if (rc) return rc;
            printf("| %d | %.1f | %.3f%% | %.3f | %.4f |\n", block, 0.5 * i, 100.0 * rate, bits,
                   bits / block);
        }

    if (sweep) {
        printf("\nLaw e2m1, K = 3, over alpha (%d tiles):\n\n", tiles);
        printf("| alpha | rel. MSE | c |\n|---|---|---|\n");
        for (int i = 30; i <= 40; i++) {
            const float a = (float)i / 64.0f;
            struct tmx_trellis_law law;
            double mse, c;
            if (tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_E2M1, a, &err) != TMX_OK ||
                tmx_trellis_gauss_mse(&law, 3, tiles, seed, &mse, &c, &err) != TMX_OK)
                return fail(err);
            printf("| %.3f | %.5f | %.4f |\n", (double)a, mse, c);
            fflush(stdout);
        }
    }
    return missed;
}
