/* codec_bench.c: trellis-codec-bench, the CPU speed of the codec plugins' inference side, as
 * Markdown for docs/perf/codec.md.
 *
 *     trellis-codec-bench [--threads N] [--side S]
 *
 * - Decode: every tile of an [S][S] matrix of random words (S = 4096 by default) decoded to
 *   its scaled operand values (trellis_tile_operands), both laws and the experimental
 *   e4m3-pair, K = 2..4, on one thread and on N (2 by default).
 * - Expert block: moe_experts of a layer with one expert, latent = inter = S, on N threads, at
 *   1, 8 and 32 tokens routed to it, serving and F32 activations; the layer is built in memory
 *   (the same structures layer_load fills), so no files are written.
 * Times are wall-clock, the best of three runs of at least 0.5 s; beside each, the process's CPU
 * time over wall time in that run, the cores it actually had. The program links nothing of the
 * core, so that it can be copied to another machine alone. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "codec_impl.h"

/* The host table moe_experts reaches: messages only, printed. */
static enum tmx_status bench_err(char **err, enum tmx_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("trellis-codec-bench: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    if (err) *err = NULL;
    return st;
}

static const struct tmx_host host = {.struct_size = sizeof host, .err = bench_err};

static double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A run's best wall-clock time and the CPU time the process spent in that run: their ratio
 * is how many cores it had (the machine is shared). */
struct timing {
    double wall, cpu;
};

/* Times fn(arg) over three runs of at least 0.5 s each and keeps the fastest per call. */
static struct timing best_of(void (*fn)(void *), void *arg) {
    struct timing best = {1e30, 0.0};
    for (int rep = 0; rep < 3; rep++) {
        int n = 0;
        const double w0 = seconds(CLOCK_MONOTONIC), c0 = seconds(CLOCK_PROCESS_CPUTIME_ID);
        double w;
        do {
            fn(arg);
            n++;
        } while ((w = seconds(CLOCK_MONOTONIC) - w0) < 0.5);
        if (w / n < best.wall)
            best = (struct timing){w / n, (seconds(CLOCK_PROCESS_CPUTIME_ID) - c0) / n};
    }
    return best;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}

/* A random [rows][cols] matrix: words, block scales in a two-octave window, g. */
static struct tmx_trellis_matrix random_matrix(const struct tmx_trellis_law *law, int K,
                                               int block, int64_t rows, int64_t cols,
                                               const uint8_t *sign_in, const uint8_t *sign_out) {
    const int64_t n_words = rows * cols / 256 * tmx_trellis_words(K),
                  n_scales = rows * cols / block;
    uint32_t *words = malloc((size_t)n_words * sizeof *words);
    uint8_t *scales = malloc((size_t)n_scales);
    if (!words || !scales) {
        fprintf(stderr, "trellis-codec-bench: out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < n_words; i++) words[i] = rnd();
    for (int64_t i = 0; i < n_scales; i++) scales[i] = (uint8_t)(0x30 + rnd() % 16);
    return (struct tmx_trellis_matrix){law, K, block, rows, cols, words, scales, 1.0f / 64.0f,
                                       sign_in, sign_out};
}

static void matrix_free(struct tmx_trellis_matrix *m) {
    free((void *)m->words);
    free((void *)m->scales);
}

struct decode_job {
    struct tmx_pool *pool;
    const struct tmx_trellis_matrix *m;
    float (*out)[TMX_TRELLIS_TILE]; /* [threads] */
};

static void decode_strip(void *arg, int64_t tr, int thread) {
    const struct decode_job *j = arg;
    for (int64_t tc = 0; tc < j->m->cols / 16; tc++)
        trellis_tile_operands(j->m, tr, tc, j->out[thread]);
}

static void decode_all(void *arg) {
    struct decode_job *j = arg;
    tmx_pool_run(j->pool, j->m->rows / 16, decode_strip, j);
}

struct block_job {
    struct trellis_codec *c;
    struct trellis_layer *l;
    int n;
    const float *z, *w;
    const int32_t *ids;
    float *out;
};

static void block_run(void *arg) {
    struct block_job *j = arg;
    if (tmx_trellis_codec_moe_experts(j->c, j->l, j->out, j->z, j->ids, j->w, j->n, 1, NULL,
                                      1e-6f, NULL) != TMX_OK)
        exit(2);
}

/* moe_experts of n tokens, all routed to expert 0. */
static struct timing block_time(struct trellis_codec *c, struct trellis_layer *l, int n) {
    float *z = malloc(sizeof(float) * (size_t)(n * l->latent)),
          *out = malloc(sizeof(float) * (size_t)(n * l->latent)), w[32];
    int32_t ids[32] = {0};
    for (int64_t i = 0; i < (int64_t)n * l->latent; i++)
        z[i] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < n; i++) w[i] = 1.0f;
    struct block_job j = {c, l, n, z, w, ids, out};
    const struct timing t = best_of(block_run, &j);
    free(z);
    free(out);
    return t;
}

int main(int argc, char **argv) {
    int threads = 2;
    int64_t side = 4096;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--side") == 0 && i + 1 < argc) {
            side = atoll(argv[++i]);
        } else {
            fprintf(stderr, "usage: trellis-codec-bench [--threads N] [--side S]\n");
            return 2;
        }
    }
    if (threads < 1 || threads > 64 || side < 128 || side % 128) {
        fprintf(stderr, "trellis-codec-bench: threads 1..64, side a multiple of 128\n");
        return 2;
    }
    struct tmx_pool *one, *many;
    if (tmx_pool_new(1, TMX_POOL_SPIN, &one) != TMX_OK || tmx_pool_new(threads, TMX_POOL_SPIN, &many) != TMX_OK) return 2;
    struct tmx_trellis_law laws[3]; /* indexed like the codecs */
    if (tmx_trellis_law_init(&laws[0], TMX_TRELLIS_LAW_E4M3, 1.0f, NULL) != TMX_OK ||
        tmx_trellis_law_init(&laws[1], TMX_TRELLIS_LAW_E2M1, 0.5625f, NULL) != TMX_OK ||
        tmx_trellis_law_init(&laws[2], TMX_TRELLIS_LAW_PAIR, 1.0f, NULL) != TMX_OK)
        return 2;

    printf("Decode of a [%lld][%lld] matrix to scaled operand values: weights per CPU second "
           "on one thread; weights per second on %d (and the cores the run had):\n\n",
           (long long)side, (long long)side, threads);
    printf("| law | K | 1 thread, weights/CPU-s | %d threads, weights/s |\n|---|---|---|---|\n",
           threads);
    float out[64][TMX_TRELLIS_TILE];
    for (int l = 0; l < 3; l++)
        for (int K = 2; K <= 4; K++) {
            const int block = tmx_trellis_codec_spec(l)->block;
            struct tmx_trellis_matrix m = random_matrix(&laws[l], K, block, side, side, NULL, NULL);
            struct decode_job j1 = {one, &m, out}, jn = {many, &m, out};
            const struct timing t1 = best_of(decode_all, &j1), tn = best_of(decode_all, &jn);
            const double w = (double)(side * side);
            printf("| %s | %d | %.3g | %.3g (%.2f) |\n", tmx_trellis_law_name(laws[l].id), K,
                   w / t1.cpu, w / tn.wall, tn.cpu / tn.wall);
            fflush(stdout);
            matrix_free(&m);
        }

    printf("\nExpert block (moe_experts), one expert of latent = inter = %lld, K = 3, %d "
           "threads: ms per call, CPU ms per call:\n\n", (long long)side, threads);
    printf("| codec | activations | 1 token | 8 tokens | 32 tokens |\n|---|---|---|---|---|\n");
    uint8_t *signs = calloc((size_t)side / 8, 1);
    for (int id = 0; id < 3; id++) {
        const struct tmx_trellis_codec_spec *spec = tmx_trellis_codec_spec(id);
        struct trellis_layer l = {.n_experts = 1, .latent = (int)side, .inter = (int)side,
                                  .law = laws[id], .sign_in = signs, .sign_mid = signs,
                                  .sign_out = signs};
        struct tmx_trellis_matrix mats[3];
        for (int p = 0; p < 3; p++)
            mats[p] = random_matrix(&l.law, 3, spec->block, side, side, signs, signs);
        l.mat = mats;
        for (int serving = 1; serving >= 0; serving--) {
            struct trellis_codec *c;
            if (trellis_codec_new(&host, id, threads, serving, &c) != TMX_OK) return 2;
            printf("| %s | %s |", spec->name, serving ? "serving" : "f32");
            for (int n = 1; n <= 32; n *= n == 1 ? 8 : 4) {
                const struct timing t = block_time(c, &l, n);
                printf(" %.2f, %.2f |", 1e3 * t.wall, 1e3 * t.cpu);
            }
            printf("\n");
            fflush(stdout);
            tmx_trellis_codec_fini(c);
        }
        for (int p = 0; p < 3; p++) matrix_free(&mats[p]);
    }
    free(signs);
    tmx_pool_free(one);
    tmx_pool_free(many);
    return 0;
}
