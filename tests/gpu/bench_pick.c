/* bench_pick.c: the end of a decode step on a kernel set, the ways the core can take it
 * (core/forward.c). Greedy: the set's argmax, then n ids read back, against n rows of logits
 * read back and their argmax on the host (what a set without argmax gets, and every step
 * before ABI 2.3). Sampled: the set's topk, n rows of first candidates read back and drawn from
 * (tmx_sampler_sample_top; a row read back for a draw past them, and the draw finished from it
 * by tmx_sampler_sample_rest), against n rows of logits read back and drawn from
 * (tmx_sampler_sample; a set without topk, and every step before ABI 2.4);
 * one setting with 1,000 edits a row (logit_edit, ABI 2.5) against the same edits on the host.
 * Vocabularies: muse-mini's (8,192), the reconstructed 816B model's (202,048) and its slice
 * on a rank of TP 4 (50,512). Built by kernels/cuda/CMakeLists.txt as bin/tmx-bench-pick;
 * needs a device, so it is no ctest case; tests/gpu/run.sh runs it.
 *
 *     tmx-bench-pick [KERNELS [OUT.json]]      (default cuda)
 *
 * Greedy logits are random in [-8, 8]. Sampled ones: the same plus 16 on 64 random ids, a head
 * that holds nearly all the mass (a confident model: no draw walks past the candidates), and
 * the flat ones at temperature 1 (most draws do, and read their row back). Each way runs
 * REPEAT times (sampled: REPEAT_SAMPLED), each a full round trip (the read waits for the
 * device, as a step's does); the tables give microseconds a step. A last table gives the set's
 * copies between the device and pageable host memory, which the logits ride on: buf_write and
 * buf_read of 64 KiB to 256 MiB, and weight_import of a 1 GiB BF16 weight, in GB/s. Exits 1 if
 * two ways pick different ids, a copy comes back changed or an op fails. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "set.h"
#include "tmx/sampler.h"

#define REPEAT 200
#define REPEAT_SAMPLED 50

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The host's pick, as core/forward.c's host_argmax. */
static int32_t host_argmax(const float *x, int d) {
    int32_t at = -1;
    for (int32_t i = 0; i < d; i++)
        if (!isnan(x[i]) && (at < 0 || x[i] > x[at])) at = i;
    return at < 0 ? 0 : at;
}

/* GB/s of buf_write and buf_read at several sizes and of one weight_import; 1 on a failure or
 * a copy that comes back different. */
static int copies(const struct tmx_kernels *k, FILE *json) {
    static const size_t sizes[] = {(size_t)64 << 10, (size_t)1 << 20, (size_t)16 << 20,
                                   (size_t)256 << 20};
    const size_t max = (size_t)1 << 30;
    unsigned char *a = malloc(max), *b = malloc(max);
    void *dev = NULL;
    int failed = !a || !b || k->ops->buf_alloc(k->ctx, max, &dev) != TMX_OK;
    for (size_t i = 0; !failed && i < max; i++) a[i] = (unsigned char)(i * 2654435761u >> 13);
    printf("\n%11s  %9s %9s\n", "copy bytes", "write GB/s", "read GB/s");
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0] && !failed; s++) {
        const size_t n = sizes[s];
        const int reps = n <= ((size_t)1 << 20) ? 200 : n <= ((size_t)16 << 20) ? 20 : 3;
        double t0 = now_s();
        for (int r = 0; r < reps && !failed; r++)
            failed |= k->ops->buf_write(k->ctx, dev, a, n) != TMX_OK;
        failed |= k->ops->sync(k->ctx) != TMX_OK;
        const double tw = (now_s() - t0) / reps;
        t0 = now_s();
        for (int r = 0; r < reps && !failed; r++)
            failed |= k->ops->buf_read(k->ctx, b, dev, n) != TMX_OK;
        const double tr = (now_s() - t0) / reps;
        failed |= memcmp(a, b, n) != 0;
        printf("%11zu  %9.2f %9.2f%s\n", n, n / tw * 1e-9, n / tr * 1e-9,
               failed ? "  FAIL" : "");
        if (json)
            fprintf(json, "%s\n {\"bytes\": %zu, \"write_gb_s\": %.3f, \"read_gb_s\": %.3f}",
                    s ? "," : "", n, n / tw * 1e-9, n / tr * 1e-9);
    }
    struct tmx_tensor host = {TMX_DTYPE_BF16, 2, {(int64_t)(max / 2 / 16384), 16384}, a}, w;
    char *err = NULL;
    const double t0 = now_s();
    if (!failed && k->ops->weight_import(k->ctx, &host, &w, &err) == TMX_OK) {
        const double t = now_s() - t0;
        failed |= k->ops->buf_read(k->ctx, b, w.data, max) != TMX_OK || memcmp(a, b, max) != 0;
        printf("weight_import of %zu bytes: %.2f GB/s%s\n", max, max / t * 1e-9,
               failed ? "  FAIL" : "");
        if (json) fprintf(json, ",\n {\"weight_import_bytes\": %zu, \"gb_s\": %.3f}", max,
                          max / t * 1e-9);
        k->ops->weight_free(k->ctx, &w);
    } else if (!failed) {
        fprintf(stderr, "tmx-bench-pick: weight_import: %s\n", err ? err : "failed");
        failed = 1;
    }
    free(err);
    if (dev) k->ops->buf_free(k->ctx, dev);
    free(a);
    free(b);
    return failed;
}

enum { NMAX = 16, VMAX = 202048 };
static const int vocabs[] = {8192, 50512, 202048};
static const int rows[] = {1, 4, 16};

/* Fills xh[NMAX][V] and the device's x with logits: uniform in [-8, 8], plus 16 on 64 ids a
 * row when `head`. */
static int logits(const struct tmx_kernels *k, void *x, float *xh, int V, int head,
                  uint64_t *rng) {
    for (size_t i = 0; i < (size_t)NMAX * V; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        xh[i] = (float)((double)(*rng >> 11) * 0x1p-53 * 16.0 - 8.0);
    }
    for (int r = 0; head && r < NMAX; r++)
        for (int j = 0; j < 64; j++) {
            *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
            xh[(size_t)r * V + (*rng >> 33) % V] += 16.0f;
        }
    return k->ops->buf_write(k->ctx, x, xh, (size_t)NMAX * V * sizeof *xh) == TMX_OK;
}

/* Edits of `per` distinct ids a row (ids 197 apart, a step prime to every vocabulary here)
 * into e and starts, uploaded to the set's buffers: what a repetition penalty over `per`
 * tokens costs. Their values leave a logit as it is (x + 0 - 0, times 1), so that the logits
 * stay the same over the repeats; the op's work does not depend on them. */
static int edits(const struct tmx_kernels *k, struct tmx_logit_edit *e, int32_t *starts,
                 void *e_dev, void *starts_dev, int n, int per, int V) {
    for (int j = 0; j <= n; j++) starts[j] = j * per;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < per; i++)
            e[j * per + i] = (struct tmx_logit_edit){(int32_t)(((int64_t)i * 197 + j) % V),
                                                      0.0f, 0.0f, 1.0f};
    return k->ops->buf_write(k->ctx, starts_dev, starts, (size_t)(n + 1) * sizeof *starts) ==
               TMX_OK &&
           k->ops->buf_write(k->ctx, e_dev, e, (size_t)n * per * sizeof *e) == TMX_OK;
}

/* The sampled table: both ways draw with samplers of the same seed and must draw the same
 * tokens (the device's softmax denominator is summed in another order than the host's, so a
 * draw could differ if its number fell within rounding of a boundary: not in these runs).
 * Settings with edits (a request's logit bias and penalties; sets with logit_edit) apply them
 * first: on the device before topk, on the host to the rows read back. */
static int sampled(const struct tmx_kernels *k, void *x, float *xh, FILE *json) {
    enum { EMAX = 1000 };
    static const struct {
        struct tmx_sampler_params p;
        int head;  /* logits with a head, or flat */
        int edits; /* a row's */
    } settings[] = {{{1.0f, 0, 1.0f, 0.0f, 1}, 1, 0},
                    {{0.8f, 0, 0.95f, 0.0f, 2}, 1, 0},
                    {{1.0f, 0, 1.0f, 0.0f, 3}, 0, 0},
                    {{0.8f, 0, 0.95f, 0.0f, 4}, 1, EMAX}};
    enum { K = TMX_TOPK_MAX, ROW = K * 8 + 24 }; /* a row's x, ids and stats, packed as the
                                                    core packs them for one read */
    float *top = NULL, *temps = NULL, *row = malloc((size_t)VMAX * sizeof *row), th[NMAX];
    unsigned char *host = malloc((size_t)NMAX * ROW);
    struct tmx_logit_edit *e = malloc((size_t)NMAX * EMAX * sizeof *e), *e_dev = NULL;
    int32_t starts[NMAX + 1], *starts_dev = NULL;
    struct tmx_sampler *a[NMAX] = {0}, *b[NMAX] = {0};
    const int can_edit = TMX_OPS_HAS(k->ops, logit_edit);
    int failed = !host || !row || !e ||
                 k->ops->buf_alloc(k->ctx, (size_t)NMAX * ROW, (void **)&top) != TMX_OK ||
                 k->ops->buf_alloc(k->ctx, NMAX * sizeof *temps, (void **)&temps) != TMX_OK ||
                 k->ops->buf_alloc(k->ctx, (size_t)NMAX * EMAX * sizeof *e, (void **)&e_dev) !=
                     TMX_OK ||
                 k->ops->buf_alloc(k->ctx, sizeof starts, (void **)&starts_dev) != TMX_OK;
    uint64_t rng = 2;
    printf("\n%7s %3s %5s %5s %5s %5s  %10s %10s  %7s  %s\n", "vocab", "n", "head", "temp",
           "top_p", "edits", "topk us", "read us", "saved", "rows read back");
    for (size_t v = 0; v < sizeof vocabs / sizeof vocabs[0] && !failed; v++)
        for (size_t c = 0; c < sizeof settings / sizeof settings[0] && !failed; c++) {
            const int V = vocabs[v], E = settings[c].edits;
            if (E && !can_edit) continue;
            failed |= !logits(k, x, xh, V, settings[c].head, &rng);
            for (size_t r = 0; r < sizeof rows / sizeof rows[0] && !failed; r++) {
                const struct tmx_sampler_params *p = &settings[c].p;
                const int n = rows[r];
                for (int j = 0; j < n && !failed; j++) {
                    th[j] = p->temperature;
                    failed |= tmx_sampler_new(p, V, &a[j], NULL) != TMX_OK ||
                              tmx_sampler_new(p, V, &b[j], NULL) != TMX_OK;
                }
                failed |= k->ops->buf_write(k->ctx, temps, th, n * sizeof *th) != TMX_OK ||
                          (E && !edits(k, e, starts, e_dev, starts_dev, n, E, V));
                int32_t got[REPEAT_SAMPLED][NMAX], want[REPEAT_SAMPLED][NMAX];
                int32_t *ids = (int32_t *)(top + (size_t)n * K);
                const float *xs = (const float *)host;
                const int32_t *idh = (const int32_t *)(xs + (size_t)n * K);
                const double *sth = (const double *)(idh + (size_t)n * K);
                int fallbacks = 0;
                double t0 = now_s();
                for (int i = 0; i < REPEAT_SAMPLED && !failed; i++) {
                    if (E) k->ops->logit_edit(k->ctx, x, e_dev, starts_dev, n, V, 0, V);
                    k->ops->topk(k->ctx, top, ids, (double *)(ids + (size_t)n * K), x, temps, n,
                                 V, V, K);
                    failed |= k->ops->buf_read(k->ctx, host, top, (size_t)n * ROW) != TMX_OK;
                    for (int j = 0; j < n && !failed; j++) {
                        const struct tmx_sampler_top t = {K, xs + (size_t)j * K,
                                                          idh + (size_t)j * K, sth[3 * j],
                                                          (int)sth[3 * j + 1]};
                        got[i][j] = tmx_sampler_sample_top(a[j], &t);
                        if (got[i][j] >= 0) continue;
                        fallbacks++;
                        failed |= k->ops->buf_read(k->ctx, row, (float *)x + (size_t)j * V,
                                                   (size_t)V * sizeof *row) != TMX_OK;
                        got[i][j] = tmx_sampler_sample_rest(a[j], &t, row);
                    }
                }
                const double t_dev = (now_s() - t0) / REPEAT_SAMPLED;
                t0 = now_s();
                for (int i = 0; i < REPEAT_SAMPLED && !failed; i++) {
                    failed |= k->ops->buf_read(k->ctx, xh, x, (size_t)n * V * sizeof *xh) != TMX_OK;
                    for (int j = 0; j < n; j++) {
                        float *xr = xh + (size_t)j * V;
                        for (int q = starts[j]; E && q < starts[j + 1]; q++)
                            xr[e[q].id] = tmx_logit_edit_apply(&e[q], xr[e[q].id]);
                        want[i][j] = tmx_sampler_sample(b[j], xr);
                    }
                }
                const double t_host = (now_s() - t0) / REPEAT_SAMPLED;
                int same = !failed;
                for (int i = 0; i < REPEAT_SAMPLED && same; i++)
                    for (int j = 0; j < n && same; j++) same = got[i][j] == want[i][j];
                failed |= !same;
                printf("%7d %3d %5s %5.2f %5.2f %5d  %10.2f %10.2f  %6.2fx  %d of %d%s\n", V, n,
                       settings[c].head ? "yes" : "flat", p->temperature, p->top_p, E, t_dev * 1e6,
                       t_host * 1e6, t_host / t_dev, fallbacks, n * REPEAT_SAMPLED,
                       same ? "" : "  FAIL: the draws differ");
                if (json)
                    fprintf(json, "%s\n {\"vocab\": %d, \"n\": %d, \"head\": %s, "
                            "\"temperature\": %.2f, \"top_p\": %.2f, \"edits\": %d, "
                            "\"topk_us\": %.3f, \"read_host_us\": %.3f, \"rows_read_back\": %d, "
                            "\"draws\": %d, \"same\": %s}", v || c || r ? "," : "", V, n,
                            settings[c].head ? "true" : "false", p->temperature, p->top_p, E,
                            t_dev * 1e6, t_host * 1e6, fallbacks, n * REPEAT_SAMPLED,
                            same ? "true" : "false");
                for (int j = 0; j < n; j++) {
                    tmx_sampler_free(a[j]);
                    tmx_sampler_free(b[j]);
                    a[j] = b[j] = NULL;
                }
            }
    }
    if (top) k->ops->buf_free(k->ctx, top);
    if (temps) k->ops->buf_free(k->ctx, temps);
    if (e_dev) k->ops->buf_free(k->ctx, e_dev);
    if (starts_dev) k->ops->buf_free(k->ctx, starts_dev);
    free(e);
    free(host);
    free(row);
    return failed;
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : "cuda";
    FILE *json = argc > 2 ? fopen(argv[2], "w") : NULL;
    if (argc > 2 && !json) {
        fprintf(stderr, "tmx-bench-pick: cannot write %s\n", argv[2]);
        return 1;
    }
    struct tool_set set;
    if (!tool_set_open(&set, "tmx-bench-pick", name)) return 1;
    const struct tmx_kernels k = set.k;
    if (!TMX_OPS_HAS(k.ops, argmax) || !TMX_OPS_HAS(k.ops, topk)) {
        fprintf(stderr, "tmx-bench-pick: kernel set %s has no argmax or topk\n", name);
        return 1;
    }
    float *xh = malloc((size_t)NMAX * VMAX * sizeof *xh), *best = NULL;
    int32_t dev_ids[NMAX], host_ids[NMAX], *ids = NULL;
    void *x = NULL;
    uint64_t rng = 1;
    if (!xh || k.ops->buf_alloc(k.ctx, (size_t)NMAX * VMAX * sizeof *xh, &x) != TMX_OK ||
        k.ops->buf_alloc(k.ctx, NMAX * sizeof *ids, (void **)&ids) != TMX_OK ||
        k.ops->buf_alloc(k.ctx, NMAX * sizeof *best, (void **)&best) != TMX_OK) {
        fprintf(stderr, "tmx-bench-pick: out of memory\n");
        return 1;
    }
    int failed = 0;
    if (json) fprintf(json, "{\"kernels\": \"%s\", \"repeat\": %d, \"runs\": [", name, REPEAT);
    printf("%7s %3s  %10s %10s  %7s\n", "vocab", "n", "argmax us", "read us", "saved");
    for (size_t v = 0; v < sizeof vocabs / sizeof vocabs[0]; v++) {
        const int V = vocabs[v];
        failed |= !logits(&k, x, xh, V, 0, &rng);
        for (size_t r = 0; r < sizeof rows / sizeof rows[0] && !failed; r++) {
            const int n = rows[r];
            double t0 = now_s();
            for (int i = 0; i < REPEAT && !failed; i++) {
                k.ops->argmax(k.ctx, ids, best, x, n, V, V);
                failed |= k.ops->buf_read(k.ctx, dev_ids, ids, (size_t)n * sizeof *ids) != TMX_OK;
            }
            const double t_dev = (now_s() - t0) / REPEAT;
            t0 = now_s();
            for (int i = 0; i < REPEAT && !failed; i++) {
                failed |= k.ops->buf_read(k.ctx, xh, x, (size_t)n * V * sizeof *xh) != TMX_OK;
                for (int j = 0; j < n; j++) host_ids[j] = host_argmax(xh + (size_t)j * V, V);
            }
            const double t_host = (now_s() - t0) / REPEAT;
            failed |= k.ops->sync(k.ctx) != TMX_OK;
            int same = !failed;
            for (int j = 0; j < n && same; j++) same = dev_ids[j] == host_ids[j];
            failed |= !same;
            printf("%7d %3d  %10.2f %10.2f  %6.2fx%s\n", V, n, t_dev * 1e6, t_host * 1e6,
                   t_host / t_dev, same ? "" : "  FAIL: the picks differ");
            if (json)
                fprintf(json, "%s\n {\"vocab\": %d, \"n\": %d, \"argmax_us\": %.3f, "
                        "\"read_host_us\": %.3f, \"same\": %s}", v || r ? "," : "", V, n,
                        t_dev * 1e6, t_host * 1e6, same ? "true" : "false");
        }
    }
    if (json) fprintf(json, "\n], \"sampled\": [");
    failed |= sampled(&k, x, xh, json);
    if (json) fprintf(json, "\n], \"copies\": [");
    failed |= copies(&k, json);
    if (json) {
        fprintf(json, "\n]}\n");
        fclose(json);
    }
    k.ops->buf_free(k.ctx, best);
    k.ops->buf_free(k.ctx, ids);
    k.ops->buf_free(k.ctx, x);
    free(xh);
    tool_set_close(&set);
    return failed;
}
