/* bench_matmul.c: a kernel set's dense matmul with BF16 weights against the same weights as
 * MXFP8 (docs/plugins.md), at the attention projections and the lm_head of the reconstructed
 * 816B model (docs/plan/muse-816b: hidden 7168, 64 query and 16 KV heads of 128, vocabulary
 * 202,048), whole and per rank of TP 4. Built by kernels/cuda/CMakeLists.txt as bin/tmx-bench-matmul; needs a device, so it is
 * no ctest case; tests/gpu/run.sh runs it.
 *
 *     tmx-bench-matmul [KERNELS [OUT.json]]      (default cuda)
 *
 * Each weight is random MXFP8 (every E4M3 code but NaN, scales 2^-12 to 2^-4), imported once
 * as it is and once as its BF16 values, which are the same numbers; x is random in [-1, 1].
 * For n = 1, 2, 4, 6, 8 and 64 token rows, each form runs REPEAT times queued with one sync: the
 * table gives microseconds a call, the weight bytes over that time, and the largest difference
 * between the two forms' outputs over the largest output (summation order, and where one form
 * splits the activations into BF16 halves and the other does not, the split's 2^-17 relative a
 * product). Exits 1 if a difference passes 3e-5 or an op fails. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "set.h"

#define REPEAT 200

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Mean seconds of one call of matmul over REPEAT queued calls; < 0 if the set fails. */
static double time_matmul(const struct tmx_kernels *k, float *y, const float *x,
                          const struct tmx_tensor *w, int n) {
    k->ops->matmul(k->ctx, y, x, w, n); /* grows the set's scratch, outside the timing */
    if (k->ops->sync(k->ctx) != TMX_OK) return -1;
    const double t0 = now_s();
    for (int i = 0; i < REPEAT; i++) k->ops->matmul(k->ctx, y, x, w, n);
    if (k->ops->sync(k->ctx) != TMX_OK) return -1;
    return (now_s() - t0) / REPEAT;
}

/* q, k and v of a TP-4 rank (2048, 512 and 512 rows of 7168), BF16 and MXFP8, as three
 * matmuls and as one matmul_multi, at 1, 2, 4 and 8 tokens: µs a step of each, and the largest
 * difference between the two over the largest output. 1 if it passes 1e-5 or an op fails. */
static int qkv(const struct tmx_kernels *k, FILE *json) {
    enum { K = 7168, NMAX = 8 };
    static const int rows[3] = {2048, 512, 512}, tokens[] = {1, 2, 4, 8};
    struct tmx_tensor mx[3] = {{0}}, bf[3] = {{0}}, dmx[3] = {{0}}, dbf[3] = {{0}};
    float *x = NULL, *y[2][3] = {{0}};
    float *xh = malloc((size_t)NMAX * K * sizeof *xh), *ya = malloc((size_t)NMAX * 2048 * 4),
          *yb = malloc((size_t)NMAX * 2048 * 4);
    uint64_t rng = 7;
    int failed = !xh || !ya || !yb || !TMX_OPS_HAS(k->ops, matmul_multi);
    for (int i = 0; i < 3 && !failed; i++) {
        const size_t count = (size_t)rows[i] * K;
        mx[i] = (struct tmx_tensor){TMX_DTYPE_MXFP8, 2, {rows[i], K}, NULL};
        bf[i] = mx[i];
        bf[i].dtype = TMX_DTYPE_BF16;
        uint8_t *q = malloc(tmx_tensor_nbytes(&mx[i]));
        uint16_t *b = malloc(count * 2);
        mx[i].data = q; /* both kept until the weights are freed: a set may alias them */
        bf[i].data = b;
        if (!q || !b) {
            failed = 1;
            break;
        }
        for (size_t j = 0; j < count; j++) {
            do {
                q[j] = (uint8_t)next(&rng);
            } while ((q[j] & 0x7f) == 0x7f);
        }
        for (size_t j = 0; j < count / 32; j++) q[count + j] = (uint8_t)(115 + next(&rng) % 9);
        tmx_mxfp8_to_bf16(&mx[i], b);
        char *err = NULL;
        failed |= k->ops->weight_import(k->ctx, &mx[i], &dmx[i], &err) != TMX_OK ||
                  k->ops->weight_import(k->ctx, &bf[i], &dbf[i], &err) != TMX_OK ||
                  k->ops->buf_alloc(k->ctx, (size_t)NMAX * rows[i] * 4, (void **)&y[0][i]) !=
                      TMX_OK ||
                  k->ops->buf_alloc(k->ctx, (size_t)NMAX * rows[i] * 4, (void **)&y[1][i]) !=
                      TMX_OK;
        free(err);
    }
    for (size_t i = 0; i < (size_t)NMAX * K && !failed; i++)
        xh[i] = (float)((double)(next(&rng) >> 11) * 0x1p-52 - 1.0);
    failed = failed || k->ops->buf_alloc(k->ctx, (size_t)NMAX * K * 4, (void **)&x) != TMX_OK ||
             k->ops->buf_write(k->ctx, x, xh, (size_t)NMAX * K * 4) != TMX_OK;
    printf("\nq, k, v of a TP-4 rank: three matmuls against one matmul_multi (us a step)\n");
    printf("%-6s %3s  %9s %9s  %7s  %s\n", "weight", "n", "three", "multi", "speedup", "max diff");
    for (int f = 0; f < 2 && !failed; f++) {
        const struct tmx_tensor *ws[3] = {f ? &dmx[0] : &dbf[0], f ? &dmx[1] : &dbf[1],
                                          f ? &dmx[2] : &dbf[2]};
        for (size_t t = 0; t < sizeof tokens / sizeof tokens[0] && !failed; t++) {
            const int n = tokens[t];
            double t3 = 0;
            for (int i = 0; i < 3; i++) t3 += time_matmul(k, y[0][i], x, ws[i], n);
            k->ops->matmul_multi(k->ctx, y[1], x, ws, 3, n);
            failed |= k->ops->sync(k->ctx) != TMX_OK;
            double t0 = now_s();
            for (int r = 0; r < REPEAT; r++) k->ops->matmul_multi(k->ctx, y[1], x, ws, 3, n);
            failed |= k->ops->sync(k->ctx) != TMX_OK;
            const double t1 = (now_s() - t0) / REPEAT;
            double diff = 0, mag = 0;
            for (int i = 0; i < 3 && !failed; i++) {
                const size_t cnt = (size_t)n * rows[i];
                failed |= k->ops->buf_read(k->ctx, ya, y[0][i], cnt * 4) != TMX_OK ||
                          k->ops->buf_read(k->ctx, yb, y[1][i], cnt * 4) != TMX_OK;
                for (size_t j = 0; j < cnt && !failed; j++) {
                    diff = fmax(diff, fabs((double)ya[j] - yb[j]));
                    mag = fmax(mag, fabs((double)ya[j]));
                }
            }
            diff = mag > 0 ? diff / mag : diff;
            failed |= !(diff <= 1e-5) || t3 < 0;
            printf("%-6s %3d  %9.2f %9.2f  %6.2fx  %.2e%s\n", f ? "mxfp8" : "bf16", n, t3 * 1e6,
                   t1 * 1e6, t3 / t1, diff, failed ? "  FAIL" : "");
            if (json)
                fprintf(json, ",\n {\"weight\": \"qkv/4 %s\", \"n\": %d, \"three_us\": %.3f, "
                        "\"multi_us\": %.3f, \"max_rel_diff\": %.3e}", f ? "mxfp8" : "bf16", n,
                        t3 * 1e6, t1 * 1e6, diff);
        }
    }
    for (int i = 0; i < 3; i++) {
        if (y[0][i]) k->ops->buf_free(k->ctx, y[0][i]);
        if (y[1][i]) k->ops->buf_free(k->ctx, y[1][i]);
        if (dbf[i].data) k->ops->weight_free(k->ctx, &dbf[i]);
        if (dmx[i].data) k->ops->weight_free(k->ctx, &dmx[i]);
        free(mx[i].data);
        free(bf[i].data);
    }
    if (x) k->ops->buf_free(k->ctx, x);
    free(xh);
    free(ya);
    free(yb);
    return failed;
}

int main(int argc, char **argv) {
    static const struct {
        const char *name;
        int m, k;
    } shapes[] = {
        {"q_proj", 8192, 7168},     {"o_proj", 7168, 8192},     {"q_proj/4", 2048, 7168},
        {"o_proj/4", 7168, 2048},   {"k_proj/4", 512, 7168},   {"lm_head", 202048, 7168},
        {"lm_head/4", 50512, 7168},
    };
    static const int tokens[] = {1, 2, 4, 6, 8, 64};
    const char *name = argc > 1 ? argv[1] : "cuda";
    FILE *json = argc > 2 ? fopen(argv[2], "w") : NULL;
    if (argc > 2 && !json) {
        fprintf(stderr, "tmx-bench-matmul: cannot write %s\n", argv[2]);
        return 1;
    }
    struct tool_set set;
    if (!tool_set_open(&set, "tmx-bench-matmul", name)) return 1;
    const struct tmx_kernels k = set.k;
    char *err = NULL;
    int failed = 0;
    uint64_t rng = 1;
    if (json) fprintf(json, "{\"kernels\": \"%s\", \"repeat\": %d, \"runs\": [", name, REPEAT);
    printf("%-9s %5s %5s %3s  %9s %9s  %8s %8s  %7s  %s\n", "weight", "rows", "cols", "n",
           "bf16 us", "mxfp8 us", "bf16 GB/s", "mx GB/s", "speedup", "max diff");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int m = shapes[s].m, kk = shapes[s].k,
                  nmax = tokens[sizeof tokens / sizeof tokens[0] - 1];
        const size_t count = (size_t)m * kk;
        struct tmx_tensor mx = {TMX_DTYPE_MXFP8, 2, {m, kk}, NULL}, bf = mx, dmx, dbf;
        bf.dtype = TMX_DTYPE_BF16;
        uint8_t *q = malloc(tmx_tensor_nbytes(&mx));
        uint16_t *b = malloc(count * 2);
        float *xh = malloc((size_t)nmax * kk * sizeof *xh);
        float *ya = malloc((size_t)nmax * m * sizeof *ya);
        float *yb = malloc((size_t)nmax * m * sizeof *yb);
        void *x = NULL, *y0 = NULL, *y1 = NULL;
        if (!q || !b || !xh || !ya || !yb) {
            fprintf(stderr, "tmx-bench-matmul: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < count; i++) {
            do {
                q[i] = (uint8_t)next(&rng);
            } while ((q[i] & 0x7f) == 0x7f);
        }
        for (size_t i = 0; i < count / 32; i++) q[count + i] = (uint8_t)(115 + next(&rng) % 9);
        for (size_t i = 0; i < (size_t)nmax * kk; i++)
            xh[i] = (float)((double)(next(&rng) >> 11) * 0x1p-52 - 1.0);
        mx.data = q;
        bf.data = b;
        tmx_mxfp8_to_bf16(&mx, b);
        if (k.ops->weight_import(k.ctx, &mx, &dmx, &err) != TMX_OK ||
            k.ops->weight_import(k.ctx, &bf, &dbf, &err) != TMX_OK ||
            k.ops->buf_alloc(k.ctx, (size_t)nmax * kk * 4, &x) != TMX_OK ||
            k.ops->buf_alloc(k.ctx, (size_t)nmax * m * 4, &y0) != TMX_OK ||
            k.ops->buf_alloc(k.ctx, (size_t)nmax * m * 4, &y1) != TMX_OK ||
            k.ops->buf_write(k.ctx, x, xh, (size_t)nmax * kk * 4) != TMX_OK) {
            fprintf(stderr, "tmx-bench-matmul: %s: %s\n", shapes[s].name, err ? err : "setup");
            return 1;
        }
        for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
            const int n = tokens[t];
            const double tb = time_matmul(&k, y0, x, &dbf, n);
            const double tm = time_matmul(&k, y1, x, &dmx, n);
            double diff = INFINITY, mag = 0;
            if (tb > 0 && tm > 0 && k.ops->buf_read(k.ctx, ya, y0, (size_t)n * m * 4) == TMX_OK &&
                k.ops->buf_read(k.ctx, yb, y1, (size_t)n * m * 4) == TMX_OK) {
                diff = 0;
                for (size_t i = 0; i < (size_t)n * m; i++) {
                    diff = fmax(diff, fabs((double)ya[i] - yb[i]));
                    mag = fmax(mag, fabs((double)ya[i]));
                }
                diff = mag > 0 ? diff / mag : diff;
            }
            const int ok = diff <= 3e-5;
            failed |= !ok;
            const double gb = (double)count * 2 / tb * 1e-9;
            const double gm = (double)count * 33 / 32 / tm * 1e-9;
            printf("%-9s %5d %5d %3d  %9.2f %9.2f  %8.0f %8.0f  %6.2fx  %.2e%s\n", shapes[s].name,
                   m, kk, n, tb * 1e6, tm * 1e6, gb, gm, tb / tm, diff, ok ? "" : "  FAIL");
            if (json)
                fprintf(json, "%s\n {\"weight\": \"%s\", \"rows\": %d, \"cols\": %d, \"n\": %d, "
                        "\"bf16_us\": %.3f, \"mxfp8_us\": %.3f, \"max_rel_diff\": %.3e}",
                        s || t ? "," : "", shapes[s].name, m, kk, n, tb * 1e6, tm * 1e6, diff);
        }
        k.ops->buf_free(k.ctx, y1);
        k.ops->buf_free(k.ctx, y0);
        k.ops->buf_free(k.ctx, x);
        k.ops->weight_free(k.ctx, &dbf);
        k.ops->weight_free(k.ctx, &dmx);
        free(q);
        free(b);
        free(xh);
        free(ya);
        free(yb);
    }
    failed |= qkv(&k, json);
    if (json) {
        fprintf(json, "\n]}\n");
        fclose(json);
    }
    tool_set_close(&set);
    return failed;
}
