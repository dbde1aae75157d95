/* bench_sampler.c: time per sampled token of core/sampler.c over a large vocabulary.
 *
 * Not part of the build or the tests: compile it with the sampler to measure, e.g. the tree's
 * against the last commit's:
 *
 *   cc -O3 -DNDEBUG -std=c11 -D_GNU_SOURCE -Icore/include tools/bench_sampler.c core/sampler.c \
 *      core/status.c -lm -o /tmp/bench_sampler
 *   git show HEAD:core/sampler.c > /tmp/sampler-head.c
 *   cc ... tools/bench_sampler.c /tmp/sampler-head.c core/status.c -lm -o /tmp/bench_sampler_head
 *   /tmp/bench_sampler [n_vocab=200000] [draws=300]
 *
 * Two kinds of logits, 8 fixed arrays of each (a seeded generator, the same every run):
 * "peaked", N(0, 2.5) with ten tokens 8-17 above the rest (a model that is fairly sure), and
 * "flat", N(0, 1) alone (the nucleus spans thousands of tokens). For each sampler setting it
 * prints the median and mean thread CPU time of one tmx_sampler_sample call and a checksum of
 * the tokens drawn: two samplers that agree on every draw print the same checksum. A second
 * table times a top step's draw as tmx serve makes it: tmx_sampler_sample_top from the row's
 * first 256 candidates and their sum (as kernels.cpu's topk gives them, made untimed), then for
 * a draw that needs more of the row either tmx_sampler_sample (the row drawn from anew) or
 * tmx_sampler_sample_rest (the draw finished from it), each with its own sampler of one seed:
 * equal checksums, the same draws. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tmx/sampler.h"

enum { N_ARRAYS = 8 };

/* CPU time of this thread: on a shared machine it moves less with the load than wall time. */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t next(uint64_t *x) { /* splitmix64 */
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double normal(uint64_t *x) { /* Box-Muller */
    const double u = ((double)(next(x) >> 11) + 0.5) * 0x1.0p-53;
    const double v = (double)(next(x) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct cand {
    float y;
    int32_t id;
};

static int cmp_cand(const void *a, const void *b) { /* logit down, then id up */
    const struct cand *x = a, *y = b;
    return x->y != y->y ? (x->y < y->y) - (x->y > y->y) : (x->id > y->id) - (x->id < y->id);
}

/* The first TOP candidates of x[n] at temperature t and their sums, as kernels.cpu's topk
 * gives them: xs, ids, sum (over all candidates, in id order) and the count. */
enum { TOP = 256 };

static void first_candidates(const float *x, int n, float t, struct cand *c, float *xs,
                             int32_t *ids, double *sum) {
    for (int i = 0; i < n; i++) c[i] = (struct cand){x[i] / t, i};
    qsort(c, (size_t)n, sizeof *c, cmp_cand);
    *sum = 0.0;
    for (int i = 0; i < n; i++) *sum += exp((double)(x[i] / t) - c[0].y);
    for (int i = 0; i < TOP; i++) {
        xs[i] = x[c[i].id];
        ids[i] = c[i].id;
    }
}

/* Median and mean of t[draws] (sorted in place), in microseconds. */
static void stats(double *t, int draws, double *median, double *mean) {
    *mean = 0.0;
    for (int d = 0; d < draws; d++) *mean += t[d] / draws * 1e6;
    qsort(t, (size_t)draws, sizeof *t, cmp_double);
    *median = t[draws / 2] * 1e6;
}

int main(int argc, char **argv) {
    const int n_vocab = argc > 1 ? atoi(argv[1]) : 200000;
    const int draws = argc > 2 ? atoi(argv[2]) : 300;
    if (n_vocab < 100 || draws < 1) {
        fprintf(stderr, "usage: bench_sampler [n_vocab >= 100] [draws >= 1]\n");
        return 2;
    }
    static const struct {
        const char *name;
        struct tmx_sampler_params p;
    } settings[] = {
        {"T=0.8", {0.8f, 0, 1.0f, 0.0f, 1}},
        {"T=0.8 top_k=40", {0.8f, 40, 1.0f, 0.0f, 1}},
        {"T=0.8 top_p=0.95", {0.8f, 0, 0.95f, 0.0f, 1}},
        {"T=0.8 min_p=0.05", {0.8f, 0, 1.0f, 0.05f, 1}},
        {"T=0.8 top_k=40 top_p=0.95", {0.8f, 40, 0.95f, 0.0f, 1}},
        {"T=1 top_p=0.9 min_p=0.02", {1.0f, 0, 0.9f, 0.02f, 1}},
    };
    static const char *shapes[] = {"peaked", "flat"};
    float *logits = malloc((size_t)2 * N_ARRAYS * n_vocab * sizeof *logits); /* [2][8][n_vocab] */
    double *t = malloc((size_t)draws * sizeof *t);
    if (!logits || !t) return 1;
    uint64_t rng = 12345;
    for (int shape = 0; shape < 2; shape++)
        for (int a = 0; a < N_ARRAYS; a++) {
            float *x = logits + ((size_t)shape * N_ARRAYS + a) * n_vocab;
            for (int i = 0; i < n_vocab; i++) x[i] = (float)(normal(&rng) * (shape ? 1.0 : 2.5));
            for (int j = 0; shape == 0 && j < 10; j++)
                x[next(&rng) % (uint64_t)n_vocab] += 8.0f + (float)j;
        }
    printf("n_vocab %d, %d draws per row (median / mean CPU microseconds per sampled token)\n",
           n_vocab, draws);
    printf("| logits | sampler | median us | mean us | token checksum |\n|---|---|---|---|---|\n");
    for (int shape = 0; shape < 2; shape++)
        for (size_t k = 0; k < sizeof settings / sizeof settings[0]; k++) {
            struct tmx_sampler *s = NULL;
            char *err = NULL;
            if (tmx_sampler_new(&settings[k].p, n_vocab, &s, &err) != TMX_OK) {
                fprintf(stderr, "%s\n", err);
                return 1;
            }
            uint64_t sum = 1469598103934665603ull; /* FNV-1a over the drawn ids */
            for (int d = -3; d < draws; d++) { /* three warm-up draws */
                const float *x = logits + ((size_t)shape * N_ARRAYS + (d + 3) % N_ARRAYS) * n_vocab;
                const double t0 = now();
                const int32_t tok = tmx_sampler_sample(s, x);
                const double dt = now() - t0;
                if (d < 0) continue;
                t[d] = dt;
                sum = (sum ^ (uint64_t)tok) * 1099511628211ull;
            }
            double median, mean;
            stats(t, draws, &median, &mean);
            printf("| %s | %s | %.1f | %.1f | %016llx |\n", shapes[shape], settings[k].name,
                   median, mean, (unsigned long long)sum);
            tmx_sampler_free(s);
        }

    /* [2][8] rows of first candidates, at temperature 0.8 (every setting's but the last) */
    float *top_x = malloc((size_t)2 * N_ARRAYS * TOP * sizeof *top_x);
    int32_t *top_id = malloc((size_t)2 * N_ARRAYS * TOP * sizeof *top_id);
    double top_sum[2 * N_ARRAYS];
    struct cand *c = malloc((size_t)n_vocab * sizeof *c);
    double *t_rest = malloc((size_t)draws * sizeof *t_rest);
    if (!top_x || !top_id || !c || !t_rest) return 1;
    printf("\nTop draws, temperature 0.8 (median / mean CPU microseconds per sampled token)\n");
    printf("| logits | sampler | draws past 256 | then the row: median us | mean us | then the "
           "rest: median us | mean us | checksums |\n|---|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < 2 * N_ARRAYS; r++)
        first_candidates(logits + (size_t)r * n_vocab, n_vocab, 0.8f, c, top_x + r * TOP,
                         top_id + r * TOP, &top_sum[r]);
    for (int shape = 0; shape < 2; shape++)
        for (size_t k = 0; k + 1 < sizeof settings / sizeof settings[0]; k++) {
            struct tmx_sampler *whole = NULL, *rest = NULL;
            char *err = NULL;
            if (tmx_sampler_new(&settings[k].p, n_vocab, &whole, &err) != TMX_OK ||
                tmx_sampler_new(&settings[k].p, n_vocab, &rest, &err) != TMX_OK) {
                fprintf(stderr, "%s\n", err);
                return 1;
            }
            uint64_t sum_whole = 1469598103934665603ull, sum_rest = sum_whole;
            int past = 0;
            for (int d = -3; d < draws; d++) {
                const int r = shape * N_ARRAYS + (d + 3) % N_ARRAYS;
                const float *x = logits + (size_t)r * n_vocab;
                const struct tmx_sampler_top top = {TOP, top_x + r * TOP, top_id + r * TOP,
                                                    top_sum[r], n_vocab};
                double t0 = now();
                int32_t tok = tmx_sampler_sample_top(whole, &top);
                const int needs_row = tok < 0;
                if (needs_row) tok = tmx_sampler_sample(whole, x);
                const double dt = now() - t0;
                t0 = now();
                int32_t tok_rest = tmx_sampler_sample_top(rest, &top);
                if (tok_rest < 0) tok_rest = tmx_sampler_sample_rest(rest, &top, x);
                const double dt_rest = now() - t0;
                if (d < 0) continue;
                past += needs_row;
                t[d] = dt;
                t_rest[d] = dt_rest;
                sum_whole = (sum_whole ^ (uint64_t)tok) * 1099511628211ull;
                sum_rest = (sum_rest ^ (uint64_t)tok_rest) * 1099511628211ull;
            }
            double median, mean, median_rest, mean_rest;
            stats(t, draws, &median, &mean);
            stats(t_rest, draws, &median_rest, &mean_rest);
            printf("| %s | %s | %d of %d | %.1f | %.1f | %.1f | %.1f | %s |\n", shapes[shape],
                   settings[k].name, past, draws, median, mean, median_rest, mean_rest,
                   sum_whole == sum_rest ? "equal" : "DIFFER");
            tmx_sampler_free(whole);
            tmx_sampler_free(rest);
        }
    free(top_x);
    free(top_id);
    free(c);
    free(t_rest);
    free(logits);
    free(t);
    return 0;
}
