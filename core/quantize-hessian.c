/* quantize-hessian.c: per-expert Hessians from the latents calibration captured.
 *
 * For expert e with inputs z_t (the tokens routed to it): H_in = sum z z^T, shared by gate and
 * up, and H_mid = sum m m^T with m = silu(gate z) * up z, computed here from the original
 * weights. An expert that no calibration token reached would be coded blind; it gets instead
 * the layer's latents sampled evenly (at most SUPPLEMENT_MAX), as if the router had picked it,
 * and the counts say so. Experts are independent: threads take them one at a time. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "quantize-impl.h"

#define SUPPLEMENT_MAX 256

struct hess_run {
    const struct calib_layer *cl;
    int k, E, latent, inter;
    const float *const *gate, *const *up;
    int64_t *start;       /* [E+1] rows routed to e: row[start[e] .. start[e+1]) */
    int64_t *row;         /* [n * k] */
    int64_t *sample;      /* [n_sample] the supplemental rows, evenly spaced */
    int64_t n_sample, max_rows;
    struct layer_hessians *out;
    pthread_mutex_t lock; /* guards next and st */
    int next;
    enum tmx_status st;
};

/* h[d][d] = x^T x for x[n][d], accumulated in double, 32x32 blocks of h at a time so that the
 * block stays in L1 while every row of x streams by once per block. */
static void gram(const float *x, int64_t n, int d, double *h) {
    enum { B = 32 };
    double acc[B][B];
    for (int i0 = 0; i0 < d; i0 += B)
        for (int j0 = i0; j0 < d; j0 += B) {
            const int bi = d - i0 < B ? d - i0 : B, bj = d - j0 < B ? d - j0 : B;
            memset(acc, 0, sizeof acc);
            for (int64_t t = 0; t < n; t++) {
                const float *xi = x + t * d + i0, *xj = x + t * d + j0;
                for (int i = 0; i < bi; i++) {
                    const double a = xi[i];
                    for (int j = 0; j < bj; j++) acc[i][j] += a * xj[j];
                }
            }
            for (int i = 0; i < bi; i++)
                for (int j = 0; j < bj; j++)
                    h[(int64_t)(i0 + i) * d + j0 + j] = h[(int64_t)(j0 + j) * d + i0 + i] =
                        acc[i][j];
        }
}

/* a . b over n floats, eight partial sums. */
static float dotf(const float *a, const float *b, int n) {
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    for (; i < n; i++) s[0] += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Expert e's Hessians from its rows; z [max_rows][latent] and m [max_rows][inter] scratch. */
static enum tmx_status expert_hessians(struct hess_run *r, int e, float *z, float *m) {
    const int lat = r->latent, inter = r->inter;
    const int64_t natural = r->start[e + 1] - r->start[e];
    const int64_t *rows = natural ? r->row + r->start[e] : r->sample;
    const int64_t n = natural ? natural : r->n_sample;
    double *h_in = calloc((size_t)lat * (size_t)lat, sizeof *h_in);
    double *h_mid = calloc((size_t)inter * (size_t)inter, sizeof *h_mid);
    r->out->h_in[e] = h_in;
    r->out->h_mid[e] = h_mid;
    r->out->natural[e] = natural;
    r->out->supplemental[e] = natural ? 0 : n;
    if (!h_in || !h_mid) return TMX_ERR_NOMEM;
    for (int64_t t = 0; t < n; t++) {
        const float *src = r->cl->z + rows[t] * lat;
        float *zt = z + t * lat, *mt = m + t * (int64_t)inter;
        memcpy(zt, src, (size_t)lat * sizeof *zt);
        for (int f = 0; f < inter; f++) {
            const float g = dotf(r->gate[e] + (int64_t)f * lat, zt, lat);
            const float u = dotf(r->up[e] + (int64_t)f * lat, zt, lat);
            mt[f] = g / (1.0f + expf(-g)) * u;
        }
    }
    gram(z, n, lat, h_in);
    gram(m, n, inter, h_mid);
    return TMX_OK;
}

static void *hess_worker(void *arg) {
    struct hess_run *r = arg;
    float *z = malloc((size_t)r->max_rows * (size_t)r->latent * sizeof *z);
    float *m = malloc((size_t)r->max_rows * (size_t)r->inter * sizeof *m);
    for (;;) {
        pthread_mutex_lock(&r->lock);
        int e = -1;
        if (!z || !m) r->st = TMX_ERR_NOMEM;
        else if (r->st == TMX_OK && r->next < r->E) e = r->next++;
        pthread_mutex_unlock(&r->lock);
        if (e < 0) break;
        const enum tmx_status st = expert_hessians(r, e, z, m);
        if (st != TMX_OK) {
            pthread_mutex_lock(&r->lock);
            r->st = st;
            pthread_mutex_unlock(&r->lock);
        }
    }
    free(z);
    free(m);
    return NULL;
}

/* Rows routed to each expert, grouped by expert (counting sort), and the supplemental rows. */
static enum tmx_status route_rows(struct hess_run *r) {
    const struct calib_layer *cl = r->cl;
    const int64_t nk = cl->n * r->k;
    r->start = calloc((size_t)r->E + 1, sizeof *r->start);
    r->row = malloc((size_t)(nk ? nk : 1) * sizeof *r->row);
    r->n_sample = cl->n < SUPPLEMENT_MAX ? cl->n : SUPPLEMENT_MAX;
    r->sample = malloc((size_t)(r->n_sample ? r->n_sample : 1) * sizeof *r->sample);
    int64_t *fill = calloc((size_t)r->E, sizeof *fill);
    if (!r->start || !r->row || !r->sample || !fill) {
        free(fill);
        return TMX_ERR_NOMEM;
    }
    for (int64_t i = 0; i < nk; i++) r->start[cl->ids[i] + 1]++;
    for (int e = 0; e < r->E; e++) r->start[e + 1] += r->start[e];
    for (int64_t i = 0; i < nk; i++) {
        const int e = cl->ids[i];
        r->row[r->start[e] + fill[e]++] = i / r->k;
    }
    free(fill);
    for (int64_t s = 0; s < r->n_sample; s++) r->sample[s] = s * cl->n / r->n_sample;
    r->max_rows = r->n_sample;
    for (int e = 0; e < r->E; e++)
        if (r->start[e + 1] - r->start[e] > r->max_rows) r->max_rows = r->start[e + 1] - r->start[e];
    return TMX_OK;
}

enum tmx_status quantize_hessians(const struct calib_layer *cl, int k, int E, int latent,
                                  int inter, const float *const *gate, const float *const *up,
                                  int n_threads, struct layer_hessians *out, char **err) {
    for (int64_t i = 0; i < cl->n * k; i++)
        if (cl->ids[i] < 0 || cl->ids[i] >= E)
            return tmx_err(err, TMX_ERR_INVALID, "calibration routed a token to expert %d of %d",
                           cl->ids[i], E);
    out->h_in = calloc((size_t)E, sizeof *out->h_in);
    out->h_mid = calloc((size_t)E, sizeof *out->h_mid);
    out->natural = calloc((size_t)E, sizeof *out->natural);
    out->supplemental = calloc((size_t)E, sizeof *out->supplemental);
    struct hess_run r = {.cl = cl, .k = k, .E = E, .latent = latent, .inter = inter,
                         .gate = gate, .up = up, .out = out, .st = TMX_OK};
    enum tmx_status st = out->h_in && out->h_mid && out->natural && out->supplemental
                             ? route_rows(&r) : TMX_ERR_NOMEM;
    if (st == TMX_OK && r.n_sample == 0)
        st = tmx_err(err, TMX_ERR_INVALID, "calibration produced no tokens");
    else if (st == TMX_OK) {
        pthread_mutex_init(&r.lock, NULL);
        const int nt = n_threads < 1 ? 1 : n_threads > E ? E : n_threads;
        pthread_t *tid = calloc((size_t)nt, sizeof *tid);
        int started = 0;
        while (tid && started < nt - 1 &&
               pthread_create(&tid[started], NULL, hess_worker, &r) == 0)
            started++;
        hess_worker(&r);
        for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
        free(tid);
        pthread_mutex_destroy(&r.lock);
        st = r.st;
    }
    if (st == TMX_ERR_NOMEM) tmx_err(err, st, "out of memory computing Hessians");
    free(r.start);
    free(r.row);
    free(r.sample);
    return st;
}

void quantize_hessians_free(struct layer_hessians *h, int E) {
    for (int e = 0; h->h_in && e < E; e++) free(h->h_in[e]);
    for (int e = 0; h->h_mid && e < E; e++) free(h->h_mid[e]);
    free(h->h_in);
    free(h->h_mid);
    free(h->natural);
    free(h->supplemental);
    memset(h, 0, sizeof *h);
}
