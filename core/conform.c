/* conform.c: the conformance cases of tmx/conform.h and their float64 references.
 *
 * Each op has a setup, which draws the inputs, uploads them and computes the reference with
 * double accumulation, and a run, which calls the kernel set's op on the uploaded arrays.
 * Weights are drawn in their own dtype, so the reference sees exactly the values the kernel set
 * sees and the only differences left are the kernel set's rounding. KV caches likewise: the
 * caches attention reads hold what kv_store would have stored, and its reference dequantizes
 * those bytes; kv_store's own references are the stored bytes, which must match exactly. The
 * cases themselves are the table in conform-cases.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conform-impl.h"
#include "tmx/conform.h"

/* rmsnorm and moe_experts epsilon */
#define EPS 1e-5f

/* --- a case on a kernel set ------------------------------------------------------------------- */

static void *fail(struct tmx_conform_case *c, enum tmx_status st, const char *what) {
    if (c->status == TMX_OK) {
        c->status = st;
        tmx_err(c->err, st, "conform: %s: %s failed (%s)", c->s->name, what, tmx_status_str(st));
    }
    return NULL;
}

static int push(void ***list, size_t *n, size_t *cap, void *p) {
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 16;
        void **l = realloc(*list, nc * sizeof *l);
        if (!l) return 0;
        *list = l;
        *cap = nc;
    }
    (*list)[(*n)++] = p;
    return 1;
}

/* Zeroed host memory, freed with the case. */
void *cf_host_alloc(struct tmx_conform_case *c, size_t nbytes) {
    void *p = calloc(1, nbytes ? nbytes : 1);
    if (!p || !push(&c->host, &c->n_host, &c->cap_host, p)) {
        free(p);
        return fail(c, TMX_ERR_NOMEM, "host allocation");
    }
    return p;
}

/* A zeroed buffer of the kernel set. */
void *cf_buffer(struct tmx_conform_case *c, size_t nbytes) {
    void *dev = NULL;
    enum tmx_status st = c->ops->buf_alloc(c->ctx, nbytes, &dev);
    if (st != TMX_OK) return fail(c, st, "buf_alloc");
    if (!push(&c->bufs, &c->n_bufs, &c->cap_bufs, dev)) {
        c->ops->buf_free(c->ctx, dev);
        return fail(c, TMX_ERR_NOMEM, "host allocation");
    }
    return dev;
}

void *cf_upload(struct tmx_conform_case *c, const void *host, size_t nbytes) {
    void *dev = host ? cf_buffer(c, nbytes) : NULL;
    if (!dev) return NULL;
    enum tmx_status st = c->ops->buf_write(c->ctx, dev, host, nbytes);
    return st == TMX_OK ? dev : fail(c, st, "buf_write");
}

/* splitmix64: a fixed stream per case name. */
uint64_t cf_next_u64(struct tmx_conform_case *c) {
    uint64_t z = (c->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double cf_uniform(struct tmx_conform_case *c, double lo, double hi) {
    return lo + (hi - lo) * (double)(cf_next_u64(c) >> 11) * 0x1p-53;
}

/* Uniform in [lo, hi]. */
int cf_randint(struct tmx_conform_case *c, int lo, int hi) {
    return lo + (int)(cf_next_u64(c) % (uint64_t)(hi - lo + 1));
}

/* Random F32 values in [lo, hi], uploaded to a new buffer (*dev); returns the host copy. */
float *cf_input(struct tmx_conform_case *c, size_t count, double lo, double hi, void **dev) {
    float *h = cf_host_alloc(c, count * sizeof *h);
    if (!h) return NULL;
    for (size_t i = 0; i < count; i++) h[i] = (float)cf_uniform(c, lo, hi);
    *dev = cf_upload(c, h, count * sizeof *h);
    return *dev ? h : NULL;
}

/* Round to the nearest F16 (ties away from zero); values below 2^-14 flush to zero. */
static uint16_t f16_from(double v) {
    uint16_t sign = v < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(v), &e); /* |v| = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 15;
    if (v == 0 || exp <= 0) return sign;
    long frac = lround((2 * m - 1) * 1024);
    if (frac == 1024) frac = 0, exp++;
    return (uint16_t)(sign | exp << 10 | frac);
}

/* Imports host weight h into *dev as the core imports a weight: an MXFP8 one the set declines
 * (TMX_ERR_UNSUPPORTED) as its BF16 values instead (docs/plugins.md). 0 on failure, recorded. */
static int import(struct tmx_conform_case *c, struct tmx_tensor h, struct tmx_tensor *dev) {
    char *msg = NULL;
    enum tmx_status st = c->ops->weight_import(c->ctx, &h, dev, &msg);
    if (st == TMX_ERR_UNSUPPORTED && h.dtype == TMX_DTYPE_MXFP8) {
        uint16_t *bf16 = cf_host_alloc(c, (size_t)tmx_tensor_numel(&h) * sizeof *bf16);
        if (!bf16) return 0;
        free(msg);
        msg = NULL;
        tmx_mxfp8_to_bf16(&h, bf16);
        h = (struct tmx_tensor){TMX_DTYPE_BF16, 2, {h.shape[0], h.shape[1]}, bf16};
        st = c->ops->weight_import(c->ctx, &h, dev, &msg);
    }
    if (st != TMX_OK) {
        if (c->status == TMX_OK) {
            c->status = st;
            tmx_err(c->err, st, "conform: %s: weight_import: %s", c->s->name, msg ? msg : "");
        }
        free(msg);
        return 0;
    }
    if (!push(&c->imported, &c->n_imported, &c->cap_imported, dev)) {
        c->ops->weight_free(c->ctx, dev);
        fail(c, TMX_ERR_NOMEM, "host allocation");
        return 0;
    }
    return 1;
}

/* A weight of dtype dt holding `vals` (rows x cols; cols 0: a vector of rows), imported into
 * *dev. Rounds vals in place to what the dtype holds. */
static void weight_from(struct tmx_conform_case *c, enum tmx_dtype dt, int64_t rows, int64_t cols,
                        double *vals, struct tmx_tensor *dev) {
    size_t count = (size_t)(rows * (cols ? cols : 1));
    struct tmx_tensor h = {.dtype = dt, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
    h.data = cf_host_alloc(c, count * tmx_dtype_size(dt));
    if (!h.data) return;
    for (size_t i = 0; i < count; i++) {
        if (dt == TMX_DTYPE_BF16) {
            uint16_t b = tmx_f32_to_bf16((float)vals[i]);
            ((uint16_t *)h.data)[i] = b;
            vals[i] = tmx_bf16_to_f32(b);
        } else if (dt == TMX_DTYPE_F16) {
            uint16_t b = f16_from(vals[i]);
            ((uint16_t *)h.data)[i] = b;
            vals[i] = tmx_f16_to_f32(b);
        } else {
            ((float *)h.data)[i] = (float)vals[i];
            vals[i] = (float)vals[i];
        }
    }
    import(c, h, dev);
}

/* A random weight with values in [lo, hi]; returns the values the kernel set sees. */
static const double *weight(struct tmx_conform_case *c, enum tmx_dtype dt, int64_t rows,
                            int64_t cols, double lo, double hi, struct tmx_tensor *dev) {
    size_t count = (size_t)(rows * (cols ? cols : 1));
    double *v = cf_host_alloc(c, count * sizeof *v);
    if (!v) return NULL;
    for (size_t i = 0; i < count; i++) v[i] = cf_uniform(c, lo, hi);
    weight_from(c, dt, rows, cols, v, dev);
    return c->status == TMX_OK ? v : NULL;
}

/* A random MXFP8 weight [rows][cols] (cols a multiple of 32): every E4M3 code but NaN, block
 * scales 2^-12 to 2^-4, imported by import(). Returns the values the set sees. */
static const double *weight_mxfp8(struct tmx_conform_case *c, int64_t rows, int64_t cols,
                                  struct tmx_tensor *dev) {
    const size_t count = (size_t)(rows * cols);
    double *v = cf_host_alloc(c, count * sizeof *v);
    struct tmx_tensor h = {TMX_DTYPE_MXFP8, 2, {rows, cols}, NULL};
    h.data = cf_host_alloc(c, tmx_tensor_nbytes(&h));
    if (!v || !h.data) return NULL;
    uint8_t *q = h.data, *scale = q + count;
    for (size_t b = 0; b < count / 32; b++) scale[b] = (uint8_t)(127 + cf_randint(c, -12, -4));
    for (size_t i = 0; i < count; i++) {
        do {
            q[i] = (uint8_t)cf_randint(c, 0, 255);
        } while ((q[i] & 0x7f) == 0x7f);
        v[i] = ldexp(tmx_e4m3_to_f32(q[i]), scale[i / 32] - 127);
    }
    return import(c, h, dev) ? v : NULL;
}

/* Declares buffer dev ([count] of dt) an output; returns its reference, to be filled. */
double *cf_output(struct tmx_conform_case *c, void *dev, size_t count, enum tmx_dtype dt) {
    double *ref = dev ? cf_host_alloc(c, count * sizeof *ref) : NULL;
    if (!ref) return NULL;
    c->out[c->n_out++] = (struct output){dev, count, dt, ref};
    return ref;
}

/* Element i of an array of dtype dt (a cache's before its row's scale; F64: conform's own). */
double cf_elem(enum tmx_dtype dt, const void *data, size_t i) {
    double f64;
    switch (dt) {
    case F64: return memcpy(&f64, (const double *)data + i, sizeof f64), f64; /* 4-aligned */
    case TMX_DTYPE_BF16: return tmx_bf16_to_f32(((const uint16_t *)data)[i]);
    case TMX_DTYPE_F8_E4M3: return tmx_e4m3_to_f32(((const uint8_t *)data)[i]);
    case TMX_DTYPE_I8: return ((const int8_t *)data)[i];
    case TMX_DTYPE_I32: return ((const int32_t *)data)[i];
    default: return ((const float *)data)[i];
    }
}

/* --- embed ------------------------------------------------------------------------------------ */

static enum tmx_status embed_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const double *table = weight(c, s->dt, s->m, s->d, -1, 1, &c->w);
    int32_t *ids = cf_host_alloc(c, (size_t)s->n * sizeof *ids);
    if (!table || !ids) return c->status;
    for (int t = 0; t < s->n; t++) ids[t] = cf_randint(c, 0, s->m - 1);
    c->arg[0] = cf_upload(c, ids, (size_t)s->n * sizeof *ids);
    c->arg[1] = cf_buffer(c, (size_t)s->n * s->d * sizeof(float));
    double *ref = cf_output(c, c->arg[1], (size_t)s->n * s->d, TMX_DTYPE_F32);
    if (!ref || !c->arg[0]) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int i = 0; i < s->d; i++) ref[t * s->d + i] = table[(size_t)ids[t] * s->d + i];
    return TMX_OK;
}

static void embed_run(struct tmx_conform_case *c) {
    c->ops->embed(c->ctx, c->arg[1], &c->w, c->arg[0], c->s->n);
}

/* --- rmsnorm ---------------------------------------------------------------------------------- */

static enum tmx_status rmsnorm_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t count = (size_t)s->n * s->d;
    double range = s->flags & SMALL ? 1e-2 : 2;
    const float *x = cf_input(c, count, -range, range, &c->arg[0]);
    const double *w = NULL;
    if (!(s->flags & NO_WEIGHT)) w = weight(c, s->dt, s->d, 0, 0.5, 1.5, &c->w);
    c->arg[1] = s->flags & IN_PLACE ? c->arg[0] : cf_buffer(c, count * sizeof(float));
    double *ref = cf_output(c, c->arg[1], count, TMX_DTYPE_F32);
    if (!x || !ref || c->status != TMX_OK) return c->status;
    for (int r = 0; r < s->n; r++) {
        const float *xr = x + (size_t)r * s->d;
        double ss = 0;
        for (int i = 0; i < s->d; i++) ss += (double)xr[i] * xr[i];
        double inv = 1 / sqrt(ss / s->d + EPS);
        for (int i = 0; i < s->d; i++) ref[(size_t)r * s->d + i] = xr[i] * inv * (w ? w[i] : 1);
    }
    return TMX_OK;
}

static void rmsnorm_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->rmsnorm(c->ctx, c->arg[1], c->arg[0], s->flags & NO_WEIGHT ? NULL : &c->w, s->n, s->d,
                    EPS);
}

/* --- matmul ----------------------------------------------------------------------------------- */

/* ref[n][m] = x[n][d] . w[m][d]^T in double. */
static void matmul_ref(double *ref, const double *w, const float *x, int n, int m, int d) {
    for (int t = 0; t < n; t++)
        for (int r = 0; r < m; r++) {
            double acc = 0;
            for (int i = 0; i < d; i++) acc += w[(size_t)r * d + i] * x[(size_t)t * d + i];
            ref[(size_t)t * m + r] = acc;
        }
}

static enum tmx_status matmul_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const float *x = cf_input(c, (size_t)s->n * s->d, -1, 1, &c->arg[0]);
    const double *w = s->dt == TMX_DTYPE_MXFP8 ? weight_mxfp8(c, s->m, s->d, &c->w)
                                               : weight(c, s->dt, s->m, s->d, -1, 1, &c->w);
    c->arg[1] = cf_buffer(c, (size_t)s->n * s->m * sizeof(float));
    double *ref = cf_output(c, c->arg[1], (size_t)s->n * s->m, TMX_DTYPE_F32);
    if (!x || !w || !ref) return c->status;
    matmul_ref(ref, w, x, s->n, s->m, s->d);
    return TMX_OK;
}

static void matmul_run(struct tmx_conform_case *c) {
    c->ops->matmul(c->ctx, c->arg[1], c->arg[0], &c->w, c->s->n);
}

/* --- matmul_multi ----------------------------------------------------------------------------- */

/* Weights of spec rows[] rows sharing x; each output's reference is its own matmul. */
static enum tmx_status matmul_multi_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const float *x = cf_input(c, (size_t)s->n * s->d, -1, 1, &c->arg[0]);
    if (!x) return c->status;
    for (c->n_wm = 0; c->n_wm < 4 && s->rows[c->n_wm] > 0; c->n_wm++) {
        const int i = c->n_wm, m = s->rows[i];
        const enum tmx_dtype dt = s->flags & MIXED && i == 1 ? TMX_DTYPE_F32 : s->dt;
        const double *w = dt == TMX_DTYPE_MXFP8 ? weight_mxfp8(c, m, s->d, &c->wm[i])
                                                : weight(c, dt, m, s->d, -1, 1, &c->wm[i]);
        c->arg[1 + i] = cf_buffer(c, (size_t)s->n * m * sizeof(float));
        double *ref = cf_output(c, c->arg[1 + i], (size_t)s->n * m, TMX_DTYPE_F32);
        if (!w || !ref) return c->status;
        matmul_ref(ref, w, x, s->n, m, s->d);
    }
    return TMX_OK;
}

static void matmul_multi_run(struct tmx_conform_case *c) {
    float *ys[4];
    const struct tmx_tensor *ws[4];
    for (int i = 0; i < c->n_wm; i++) ys[i] = c->arg[1 + i], ws[i] = &c->wm[i];
    c->ops->matmul_multi(c->ctx, ys, c->arg[0], ws, c->n_wm, c->s->n);
}

/* --- rope ------------------------------------------------------------------------------------- */

/* Positions up to 4095: far enough that an angle computed in float would be off. */
static enum tmx_status rope_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int half = s->hd / 2;
    size_t count = (size_t)s->n * s->heads * s->hd;
    const float *x = cf_input(c, count, -1, 1, &c->arg[0]);
    int32_t *pos = cf_host_alloc(c, (size_t)s->n * sizeof *pos);
    float *inv_freq = cf_host_alloc(c, (size_t)half * sizeof *inv_freq);
    if (!x || !pos || !inv_freq) return c->status;
    for (int t = 0; t < s->n; t++) pos[t] = cf_randint(c, 0, 4095);
    for (int i = 0; i < half; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / s->hd);
    c->arg[1] = cf_upload(c, pos, (size_t)s->n * sizeof *pos);
    c->arg[2] = cf_upload(c, inv_freq, (size_t)half * sizeof *inv_freq);
    double *ref = cf_output(c, c->arg[0], count, TMX_DTYPE_F32);
    if (!c->arg[1] || !c->arg[2] || !ref) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int h = 0; h < s->heads; h++) {
            size_t o = ((size_t)t * s->heads + h) * s->hd;
            for (int i = 0; i < half; i++) {
                double a = (double)pos[t] * inv_freq[i], x1 = x[o + i], x2 = x[o + i + half];
                ref[o + i] = x1 * cos(a) - x2 * sin(a);
                ref[o + i + half] = x2 * cos(a) + x1 * sin(a);
            }
        }
    return TMX_OK;
}

/* --- qk_norm_rope ------------------------------------------------------------------------------ */

/* q and k heads (heads, kv_heads), each normed in double by its norm weight (NO_WEIGHT: none),
 * then rotated as rope's reference rotates. */
static enum tmx_status qk_norm_rope_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int half = s->hd / 2, heads[2] = {s->heads, s->kv_heads};
    const int normed = !(s->flags & NO_WEIGHT);
    int32_t *pos = cf_host_alloc(c, (size_t)s->n * sizeof *pos);
    float *inv_freq = cf_host_alloc(c, (size_t)half * sizeof *inv_freq);
    if (!pos || !inv_freq) return c->status;
    for (int t = 0; t < s->n; t++) pos[t] = cf_randint(c, 0, 4095);
    for (int i = 0; i < half; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / s->hd);
    c->arg[2] = cf_upload(c, pos, (size_t)s->n * sizeof *pos);
    c->arg[3] = cf_upload(c, inv_freq, (size_t)half * sizeof *inv_freq);
    for (int qk = 0; qk < 2; qk++) {
        const size_t count = (size_t)s->n * heads[qk] * s->hd;
        const float *x = cf_input(c, count, -2, 2, &c->arg[qk]);
        const double *w = normed ? weight(c, s->dt, s->hd, 0, 0.5, 1.5, qk ? &c->w : &c->wm[0])
                                 : NULL;
        double *ref = cf_output(c, c->arg[qk], count, TMX_DTYPE_F32);
        double *row = cf_host_alloc(c, (size_t)s->hd * sizeof *row);
        if (!x || !ref || !row || !c->arg[2] || !c->arg[3] || c->status != TMX_OK)
            return c->status;
        for (size_t r = 0; r < (size_t)s->n * heads[qk]; r++) {
            const float *xr = x + r * s->hd;
            double ss = 0, inv = 1;
            for (int i = 0; i < s->hd; i++) ss += (double)xr[i] * xr[i];
            if (normed) inv = 1 / sqrt(ss / s->hd + EPS);
            for (int i = 0; i < s->hd; i++) row[i] = xr[i] * inv * (w ? w[i] : 1);
            const double p = pos[r / heads[qk]];
            for (int i = 0; i < half; i++) {
                const double a = p * inv_freq[i];
                ref[r * s->hd + i] = row[i] * cos(a) - row[i + half] * sin(a);
                ref[r * s->hd + i + half] = row[i + half] * cos(a) + row[i] * sin(a);
            }
        }
    }
    return TMX_OK;
}

static void qk_norm_rope_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int none = s->flags & NO_WEIGHT;
    c->ops->qk_norm_rope(c->ctx, c->arg[0], c->arg[1], none ? NULL : &c->wm[0],
                         none ? NULL : &c->w, c->arg[2], c->arg[3], s->n, s->heads, s->kv_heads,
                         s->hd, EPS);
}

static void qk_norm_rope_parts(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    if (!(s->flags & NO_WEIGHT)) {
        c->ops->rmsnorm(c->ctx, c->arg[0], c->arg[0], &c->wm[0], s->n * s->heads, s->hd, EPS);
        c->ops->rmsnorm(c->ctx, c->arg[1], c->arg[1], &c->w, s->n * s->kv_heads, s->hd, EPS);
    }
    c->ops->rope(c->ctx, c->arg[0], c->arg[2], c->arg[3], s->n, s->heads, s->hd);
    c->ops->rope(c->ctx, c->arg[1], c->arg[2], c->arg[3], s->n, s->kv_heads, s->hd);
}

static void rope_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->rope(c->ctx, c->arg[0], c->arg[1], c->arg[2], s->n, s->heads, s->hd);
}

/* --- moe_route -------------------------------------------------------------------------------- */

/* Scores s and keys v = s + bias of one token, and the order the router must pick them in:
 * descending v, ties to the lower id. */
static void route_ref(const struct spec *s, const float *logits, const double *bias, double *sc,
                      double *v, int *order) {
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < s->n_exp; e++) mx = fmax(mx, logits[e]);
    for (int e = 0; e < s->n_exp; e++) {
        sc[e] = s->flags & SOFTMAX ? exp(logits[e] - mx) : 1 / (1 + exp(-(double)logits[e]));
        sum += sc[e];
    }
    for (int e = 0; e < s->n_exp; e++) {
        if (s->flags & SOFTMAX) sc[e] /= sum;
        v[e] = sc[e] + (bias ? bias[e] : 0);
        order[e] = e;
    }
    for (int a = 1; a < s->n_exp; a++) /* insertion sort: stable, so equal keys keep id order */
        for (int b = a; b > 0 && v[order[b]] > v[order[b - 1]]; b--) {
            int tmp = order[b];
            order[b] = order[b - 1];
            order[b - 1] = tmp;
        }
}

/* Whether float rounding cannot change the pick: neighbours up to the (k+1)-th either tie
 * exactly (same logit and bias) or differ by more than 1e-4 relative. */
static int route_robust(const struct spec *s, const float *logits, const double *bias,
                        const double *v, const int *order) {
    for (int q = 0; q < s->top_k && q + 1 < s->n_exp; q++) {
        int a = order[q], b = order[q + 1];
        int same = logits[a] == logits[b] && (!bias || bias[a] == bias[b]);
        if (!same && fabs(v[a] - v[b]) <= 1e-4 * fmax(fabs(v[a]), fabs(v[b]))) return 0;
    }
    return 1;
}

/* Logits on a grid, so that equal scores are exact ties in any precision; a token whose pick
 * could flip under rounding is drawn again. */
static enum tmx_status moe_route_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int ne = s->n_exp, k = s->top_k;
    float *logits = cf_host_alloc(c, (size_t)s->n * ne * sizeof *logits);
    double *sc = cf_host_alloc(c, (size_t)ne * sizeof *sc), *v = cf_host_alloc(c, (size_t)ne * sizeof *v);
    int *order = cf_host_alloc(c, (size_t)ne * sizeof *order);
    double *bias = NULL;
    if (!(s->flags & NO_WEIGHT) && (bias = cf_host_alloc(c, (size_t)ne * sizeof *bias))) {
        for (int e = 0; e < ne; e++) bias[e] = cf_randint(c, -4, 4) / 16.0;
        weight_from(c, TMX_DTYPE_F32, ne, 0, bias, &c->w);
    }
    if (!logits || !sc || !v || !order || c->status != TMX_OK) return c->status;
    c->arg[2] = cf_buffer(c, (size_t)s->n * k * sizeof(int32_t));
    c->arg[3] = cf_buffer(c, (size_t)s->n * k * sizeof(float));
    double *ref_ids = cf_output(c, c->arg[2], (size_t)s->n * k, TMX_DTYPE_I32);
    double *ref_w = cf_output(c, c->arg[3], (size_t)s->n * k, TMX_DTYPE_F32);
    if (!ref_ids || !ref_w) return c->status;
    for (int t = 0; t < s->n; t++) {
        float *lg = logits + (size_t)t * ne;
        do {
            for (int e = 0; e < ne; e++)
                lg[e] = s->flags & TIES ? cf_randint(c, -2, 2) / 2.0f : cf_randint(c, -12, 12) / 4.0f;
            route_ref(s, lg, bias, sc, v, order);
        } while (!route_robust(s, lg, bias, v, order));
        double picked = 0;
        for (int q = 0; q < k; q++) picked += sc[order[q]];
        for (int q = 0; q < k; q++) {
            ref_ids[t * k + q] = order[q];
            ref_w[t * k + q] = sc[order[q]] / (s->flags & NO_NORM_TOPK ? 1 : picked) * s->scale;
        }
    }
    c->arg[0] = cf_upload(c, logits, (size_t)s->n * ne * sizeof *logits);
    return c->status;
}

static void moe_route_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->moe_route(c->ctx, c->arg[2], c->arg[3], c->arg[0], s->flags & NO_WEIGHT ? NULL : &c->w,
                      s->n, s->n_exp, s->top_k,
                      s->flags & SOFTMAX ? TMX_ROUTER_SOFTMAX : TMX_ROUTER_SIGMOID,
                      !(s->flags & NO_NORM_TOPK), s->scale);
}

/* --- moe_experts ------------------------------------------------------------------------------ */

/* Each token picks top_k distinct ids among expert0 + n_exp + 2, so that with expert0 > 0 some
 * fall outside this rank's experts on both sides and must be skipped. moe_experts_partial
 * (no routing weights, no post norm) writes each pair's y_e to its own row: zeros for a
 * skipped pair. */
static enum tmx_status moe_experts_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int partial = s->op == OP_MOE_EXPERTS_PARTIAL;
    int ne = s->n_exp, k = s->top_k, lat = s->latent, inter = s->inter, range = s->expert0 + ne + 2;
    const float *z = cf_input(c, (size_t)s->n * lat, -1, 1, &c->arg[0]);
    const float *pw = partial ? NULL : cf_input(c, (size_t)s->n * k, 0.1, 1, &c->arg[2]);
    int32_t *ids = cf_host_alloc(c, (size_t)s->n * k * sizeof *ids);
    int *pool = cf_host_alloc(c, (size_t)range * sizeof *pool);
    struct tmx_tensor *wt = cf_host_alloc(c, 3 * (size_t)ne * sizeof *wt);
    const double **wv = cf_host_alloc(c, 3 * (size_t)ne * sizeof *wv);
    double *hid = cf_host_alloc(c, (size_t)inter * sizeof *hid), *y = cf_host_alloc(c, lat * sizeof *y);
    if (!z || (!pw && !partial) || !ids || !pool || !wt || !wv || !hid || !y) return c->status;
    for (int t = 0; t < s->n; t++) { /* partial Fisher-Yates over the id range */
        for (int e = 0; e < range; e++) pool[e] = e;
        for (int q = 0; q < k; q++) {
            int r = cf_randint(c, q, range - 1), tmp = pool[q];
            pool[q] = pool[r];
            pool[r] = tmp;
            ids[t * k + q] = pool[q];
        }
    }
    double a_in = 2 / sqrt(lat), a_out = 2 / sqrt(inter);
    for (int e = 0; e < ne && c->status == TMX_OK; e++) {
        wv[e] = weight(c, s->dt, inter, lat, -a_in, a_in, &wt[e]);
        wv[ne + e] = weight(c, s->dt, inter, lat, -a_in, a_in, &wt[ne + e]);
        wv[2 * ne + e] = weight(c, s->dt, lat, inter, -a_out, a_out, &wt[2 * ne + e]);
    }
    const double *post = NULL;
    if (!(s->flags & NO_WEIGHT) && !partial) post = weight(c, s->dt, lat, 0, 0.5, 1.5, &c->w);
    c->arg[1] = cf_upload(c, ids, (size_t)s->n * k * sizeof *ids);
    const size_t rows = (size_t)s->n * (partial ? k : 1);
    c->arg[3] = cf_buffer(c, rows * lat * sizeof(float));
    double *ref = cf_output(c, c->arg[3], rows * lat, TMX_DTYPE_F32);
    if (!ref || c->status != TMX_OK) return c->status;
    c->moe = (struct tmx_moe_weights){ne, s->expert0, lat, inter, wt, wt + ne, wt + 2 * ne,
                                      post ? &c->w : NULL, EPS};

    for (int t = 0; t < s->n; t++)
        for (int q = 0; q < k; q++) {
            int e = ids[t * k + q] - s->expert0;
            if (e < 0 || e >= ne) continue;
            const float *zt = z + (size_t)t * lat;
            const double *gate = wv[e], *up = wv[ne + e], *down = wv[2 * ne + e];
            for (int i = 0; i < inter; i++) {
                double g = 0, u = 0;
                for (int d = 0; d < lat; d++) {
                    g += gate[(size_t)i * lat + d] * zt[d];
                    u += up[(size_t)i * lat + d] * zt[d];
                }
                hid[i] = g / (1 + exp(-g)) * u;
            }
            double ss = 0;
            for (int d = 0; d < lat; d++) {
                y[d] = 0;
                for (int i = 0; i < inter; i++) y[d] += down[(size_t)d * inter + i] * hid[i];
                ss += y[d] * y[d];
            }
            if (partial) {
                memcpy(ref + ((size_t)t * k + q) * lat, y, (size_t)lat * sizeof *y);
                continue;
            }
            double inv = post ? 1 / sqrt(ss / lat + EPS) : 1;
            for (int d = 0; d < lat; d++)
                ref[(size_t)t * lat + d] += pw[t * k + q] * y[d] * inv * (post ? post[d] : 1);
        }
    return TMX_OK;
}

static void moe_experts_run(struct tmx_conform_case *c) {
    c->ops->moe_experts(c->ctx, c->arg[3], c->arg[0], c->arg[1], c->arg[2], c->s->n,
                        c->s->top_k, &c->moe);
}

static void moe_experts_partial_run(struct tmx_conform_case *c) {
    c->ops->moe_experts_partial(c->ctx, c->arg[3], c->arg[0], c->arg[1], c->s->n, c->s->top_k,
                                &c->moe);
}

/* --- moe_combine ------------------------------------------------------------------------------ */

/* Pair rows of several magnitudes (one of them tiny, where eps matters), so that the norm is
 * what brings them together. */
static enum tmx_status moe_combine_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int k = s->top_k, lat = s->latent;
    float *ye = cf_host_alloc(c, (size_t)s->n * k * lat * sizeof *ye);
    const float *pw = cf_input(c, (size_t)s->n * k, 0.1, 1, &c->arg[1]);
    if (!ye || !pw) return c->status;
    for (size_t r = 0; r < (size_t)s->n * k; r++) {
        const double mag = r % 5 == 4 ? 1e-3 : cf_uniform(c, 0.1, 8);
        for (int d = 0; d < lat; d++) ye[r * lat + d] = (float)(mag * cf_uniform(c, -1, 1));
    }
    c->arg[0] = cf_upload(c, ye, (size_t)s->n * k * lat * sizeof *ye);
    const double *post = NULL;
    if (!(s->flags & NO_WEIGHT)) post = weight(c, s->dt, lat, 0, 0.5, 1.5, &c->w);
    c->arg[2] = cf_buffer(c, (size_t)s->n * lat * sizeof(float));
    double *ref = cf_output(c, c->arg[2], (size_t)s->n * lat, TMX_DTYPE_F32);
    if (!ref || !c->arg[0] || c->status != TMX_OK) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int q = 0; q < k; q++) {
            const float *y = ye + ((size_t)t * k + q) * lat;
            double ss = 0;
            for (int d = 0; d < lat; d++) ss += (double)y[d] * y[d];
            double inv = post ? 1 / sqrt(ss / lat + EPS) : 1;
            for (int d = 0; d < lat; d++)
                ref[(size_t)t * lat + d] += pw[t * k + q] * y[d] * inv * (post ? post[d] : 1);
        }
    return TMX_OK;
}

static void moe_combine_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->moe_combine(c->ctx, c->arg[2], c->arg[0], c->arg[1], s->n, s->top_k, s->latent,
                        s->flags & NO_WEIGHT ? NULL : &c->w, EPS);
}

/* --- swiglu ----------------------------------------------------------------------------------- */

static enum tmx_status swiglu_new(struct tmx_conform_case *c) {
    size_t count = (size_t)c->s->n * c->s->d;
    const float *gate = cf_input(c, count, -6, 6, &c->arg[0]);
    const float *up = cf_input(c, count, -1, 1, &c->arg[1]);
    c->arg[2] = c->s->flags & IN_PLACE ? c->arg[0] : cf_buffer(c, count * sizeof(float));
    double *ref = cf_output(c, c->arg[2], count, TMX_DTYPE_F32);
    if (!gate || !up || !ref) return c->status;
    for (size_t i = 0; i < count; i++) ref[i] = gate[i] / (1 + exp(-(double)gate[i])) * up[i];
    return TMX_OK;
}

static void swiglu_run(struct tmx_conform_case *c) {
    c->ops->swiglu(c->ctx, c->arg[2], c->arg[0], c->arg[1], (int64_t)c->s->n * c->s->d);
}

/* --- add_gated -------------------------------------------------------------------------------- */

static enum tmx_status add_gated_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t count = (size_t)s->n * s->d;
    const float *h = cf_input(c, count, -1, 1, &c->arg[0]);
    const float *a = cf_input(c, count, -1, 1, &c->arg[1]);
    const double *g = NULL;
    if (!(s->flags & NO_WEIGHT)) g = weight(c, s->dt, s->d, 0, -1, 1, &c->w);
    double *ref = cf_output(c, c->arg[0], count, TMX_DTYPE_F32);
    if (!h || !a || !ref || c->status != TMX_OK) return c->status;
    for (size_t i = 0; i < count; i++) ref[i] = h[i] + (g ? g[i % s->d] : 1) * a[i];
    return TMX_OK;
}

static void add_gated_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->add_gated(c->ctx, c->arg[0], c->arg[1], s->flags & NO_WEIGHT ? NULL : &c->w, s->n,
                      s->d);
}

/* --- add_rmsnorm ------------------------------------------------------------------------------ */

/* add_gated's inputs and a norm weight: both outputs, h updated and out normed from it. */
static enum tmx_status add_rmsnorm_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t count = (size_t)s->n * s->d;
    const float *h = cf_input(c, count, -1, 1, &c->arg[0]);
    const float *a = cf_input(c, count, -1, 1, &c->arg[1]);
    const double *g = NULL, *w = NULL;
    if (!(s->flags & NO_WEIGHT)) {
        g = weight(c, s->dt, s->d, 0, -1, 1, &c->wm[0]);
        w = weight(c, s->dt, s->d, 0, 0.5, 1.5, &c->w);
    }
    c->arg[2] = cf_buffer(c, count * sizeof(float));
    double *ref_h = cf_output(c, c->arg[0], count, TMX_DTYPE_F32);
    double *ref = cf_output(c, c->arg[2], count, TMX_DTYPE_F32);
    if (!h || !a || !ref_h || !ref || c->status != TMX_OK) return c->status;
    for (int r = 0; r < s->n; r++) {
        double ss = 0;
        for (int i = 0; i < s->d; i++) {
            const size_t at = (size_t)r * s->d + i;
            ref_h[at] = h[at] + (g ? g[i] : 1) * a[at];
            ss += ref_h[at] * ref_h[at];
        }
        const double inv = 1 / sqrt(ss / s->d + EPS);
        for (int i = 0; i < s->d; i++)
            ref[(size_t)r * s->d + i] = ref_h[(size_t)r * s->d + i] * inv * (w ? w[i] : 1);
    }
    return TMX_OK;
}

static void add_rmsnorm_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int none = s->flags & NO_WEIGHT;
    c->ops->add_rmsnorm(c->ctx, c->arg[2], c->arg[0], c->arg[1], none ? NULL : &c->wm[0],
                        none ? NULL : &c->w, s->n, s->d, EPS);
}

static void add_rmsnorm_parts(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int none = s->flags & NO_WEIGHT;
    c->ops->add_gated(c->ctx, c->arg[0], c->arg[1], none ? NULL : &c->wm[0], s->n, s->d);
    c->ops->rmsnorm(c->ctx, c->arg[2], c->arg[0], none ? NULL : &c->w, s->n, s->d, EPS);
}

/* --- gather ----------------------------------------------------------------------------------- */

/* Rows drawn with repeats, in any order. */
static enum tmx_status gather_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const float *x = cf_input(c, (size_t)s->m * s->d, -1, 1, &c->arg[0]);
    int32_t *rows = cf_host_alloc(c, (size_t)s->n * sizeof *rows);
    if (!x || !rows) return c->status;
    for (int i = 0; i < s->n; i++) rows[i] = cf_randint(c, 0, s->m - 1);
    c->arg[1] = cf_upload(c, rows, (size_t)s->n * sizeof *rows);
    c->arg[2] = cf_buffer(c, (size_t)s->n * s->d * sizeof(float));
    double *ref = cf_output(c, c->arg[2], (size_t)s->n * s->d, TMX_DTYPE_F32);
    if (!ref || !c->arg[1]) return c->status;
    for (int i = 0; i < s->n; i++)
        for (int j = 0; j < s->d; j++) ref[(size_t)i * s->d + j] = x[(size_t)rows[i] * s->d + j];
    return TMX_OK;
}

static void gather_run(struct tmx_conform_case *c) {
    c->ops->gather(c->ctx, c->arg[2], c->arg[0], c->arg[1], c->s->n, c->s->d);
}

/* --- the ops ---------------------------------------------------------------------------------- */

/* Tolerances on the normalized max error. Copies are exact; the rest allow F32 rounding with
 * room for other summation orders and exp implementations: kernels.cpu stays 20 to 100 times
 * below them (at most 5e-7), while a wrong mask, index or norm shows up as 1e-2 or more. */
static const struct {
    const char *name;
    size_t member; /* offset in struct tmx_kernels_i */
    double tol;
    enum tmx_status (*setup)(struct tmx_conform_case *c);
    void (*run)(struct tmx_conform_case *c);
} op_defs[N_CONFORM_OPS] = {
    [OP_EMBED] = {"embed", offsetof(struct tmx_kernels_i, embed), 0, embed_new, embed_run},
    [OP_RMSNORM] = {"rmsnorm", offsetof(struct tmx_kernels_i, rmsnorm), 1e-5, rmsnorm_new,
                    rmsnorm_run},
    [OP_MATMUL] = {"matmul", offsetof(struct tmx_kernels_i, matmul), 1e-5, matmul_new,
                   matmul_run},
    [OP_ROPE] = {"rope", offsetof(struct tmx_kernels_i, rope), 1e-5, rope_new, rope_run},
    [OP_KV_STORE] = {"kv_store", offsetof(struct tmx_kernels_i, kv_store), 0, cf_kv_store_new,
                     cf_kv_store_run},
    [OP_ATTENTION] = {"attention", offsetof(struct tmx_kernels_i, attention), 1e-5,
                      cf_attention_new, cf_attention_run},
    [OP_MOE_ROUTE] = {"moe_route", offsetof(struct tmx_kernels_i, moe_route), 1e-5,
                      moe_route_new, moe_route_run},
    [OP_MOE_EXPERTS] = {"moe_experts", offsetof(struct tmx_kernels_i, moe_experts), 2e-5,
                        moe_experts_new, moe_experts_run},
    [OP_SWIGLU] = {"swiglu", offsetof(struct tmx_kernels_i, swiglu), 1e-5, swiglu_new,
                   swiglu_run},
    [OP_ADD_GATED] = {"add_gated", offsetof(struct tmx_kernels_i, add_gated), 1e-6,
                      add_gated_new, add_gated_run},
    [OP_GATHER] = {"gather", offsetof(struct tmx_kernels_i, gather), 0, gather_new, gather_run},
    [OP_MOE_EXPERTS_PARTIAL] = {"moe_experts_partial",
                                offsetof(struct tmx_kernels_i, moe_experts_partial), 2e-5,
                                moe_experts_new, moe_experts_partial_run},
    [OP_MOE_COMBINE] = {"moe_combine", offsetof(struct tmx_kernels_i, moe_combine), 1e-5,
                        moe_combine_new, moe_combine_run},
    [OP_ARGMAX] = {"argmax", offsetof(struct tmx_kernels_i, argmax), 0, cf_argmax_new, cf_argmax_run},
    [OP_MATMUL_MULTI] = {"matmul_multi", offsetof(struct tmx_kernels_i, matmul_multi), 1e-5,
                         matmul_multi_new, matmul_multi_run},
    [OP_TOPK] = {"topk", offsetof(struct tmx_kernels_i, topk), 1e-10, cf_topk_new, cf_topk_run},
    [OP_LOGIT_EDIT] = {"logit_edit", offsetof(struct tmx_kernels_i, logit_edit), 0,
                       cf_logit_edit_new, cf_logit_edit_run},
    [OP_ADD_RMSNORM] = {"add_rmsnorm", offsetof(struct tmx_kernels_i, add_rmsnorm), 1e-5,
                        add_rmsnorm_new, add_rmsnorm_run},
    [OP_QK_NORM_ROPE] = {"qk_norm_rope", offsetof(struct tmx_kernels_i, qk_norm_rope), 1e-5,
                         qk_norm_rope_new, qk_norm_rope_run},
};

/* A fused op's case run as the ops it stands for; NULL for the others. */
static void (*const op_parts[N_CONFORM_OPS])(struct tmx_conform_case *c) = {
    [OP_ADD_RMSNORM] = add_rmsnorm_parts,
    [OP_QK_NORM_ROPE] = qk_norm_rope_parts,
};

/* Whether the set's table is large enough to hold the op and the op is non-NULL. */
static int has_op(const struct tmx_kernels_i *ops, enum conform_op op) {
    size_t at = op_defs[op].member;
    if (ops->struct_size < at + sizeof(void (*)(void))) return 0;
    void (*fn)(void);
    memcpy(&fn, (const char *)ops + at, sizeof fn);
    return fn != NULL;
}

/* --- the public functions --------------------------------------------------------------------- */

size_t tmx_conform_count(void) { return tmx_conform_n_specs; }

const char *tmx_conform_name(size_t i) {
    return i < tmx_conform_n_specs ? tmx_conform_specs[i].name : NULL;
}

const char *tmx_conform_op(size_t i) {
    return i < tmx_conform_n_specs ? op_defs[tmx_conform_specs[i].op].name : NULL;
}

void tmx_conform_case_free(struct tmx_conform_case *c) {
    if (!c) return;
    for (size_t i = c->n_imported; i-- > 0;) c->ops->weight_free(c->ctx, c->imported[i]);
    for (size_t i = c->n_bufs; i-- > 0;) c->ops->buf_free(c->ctx, c->bufs[i]);
    for (size_t i = 0; i < c->n_host; i++) free(c->host[i]);
    free(c->imported);
    free(c->bufs);
    free(c->host);
    free(c->got);
    free(c);
}

enum tmx_status tmx_conform_case_new(size_t i, const struct tmx_kernels_i *ops, void *ctx,
                                     struct tmx_conform_case **out, char **err) {
    *out = NULL;
    if (i >= tmx_conform_n_specs) return tmx_err(err, TMX_ERR_INVALID, "conform: no case %zu", i);
    struct tmx_conform_case *c = calloc(1, sizeof *c);
    if (!c) return tmx_err(err, TMX_ERR_NOMEM, "conform: out of memory");
    c->s = &tmx_conform_specs[i];
    c->ops = ops;
    c->ctx = ctx;
    c->err = err;
    /* seeded by the FNV-1a hash of the name: a case keeps its inputs when the table changes */
    c->rng = 0xcbf29ce484222325ull;
    for (const char *p = c->s->name; *p; p++)
        c->rng = (c->rng ^ (unsigned char)*p) * 0x100000001b3ull;
    enum tmx_status st = op_defs[c->s->op].setup(c);
    if (st != TMX_OK) {
        tmx_conform_case_free(c);
        return st;
    }
    *out = c;
    return TMX_OK;
}

void tmx_conform_case_run(struct tmx_conform_case *c) {
    if (has_op(c->ops, c->s->op)) op_defs[c->s->op].run(c);
}

int tmx_conform_case_run_parts(struct tmx_conform_case *c) {
    if (!op_parts[c->s->op]) return 0;
    op_parts[c->s->op](c);
    return 1;
}

/* max|got - ref| / max|ref| over finite refs, or INFINITY on an unexpected NaN or infinity or
 * an I32 mismatch. got is aligned for its dtype (outputs are read back at offsets that are
 * multiples of 4). */
static double compare(const struct output *o, const unsigned char *got) {
    double diff = 0, mag = 0;
    for (size_t i = 0; i < o->count; i++) {
        double g = cf_elem(o->dt, got, i);
        if (o->dt == TMX_DTYPE_I32) {
            if (g != o->ref[i]) return INFINITY;
            continue;
        }
        if (!isfinite(o->ref[i])) { /* argmax's best of a row of NaN or infinities, topk's -inf */
            if (!(g == o->ref[i] || (isnan(g) && isnan(o->ref[i])))) return INFINITY;
            continue;
        }
        double d = fabs(g - o->ref[i]);
        if (!(d <= diff)) diff = isnan(d) ? INFINITY : d;
        mag = fmax(mag, fabs(o->ref[i]));
    }
    return mag > 0 ? diff / mag : diff;
}

/* An output's bytes rounded up to 4, so that the next one starts aligned in `got`. */
static size_t out_bytes(const struct output *o) {
    return (o->count * (o->dt == F64 ? sizeof(double) : tmx_dtype_size(o->dt)) + 3) &
           ~(size_t)3;
}

enum tmx_status tmx_conform_case_check(struct tmx_conform_case *c, struct tmx_conform_result *res,
                                       char **err) {
    const struct spec *s = c->s;
    *res = (struct tmx_conform_result){s->name, TMX_OK, INFINITY, op_defs[s->op].tol, 0};
    if (!has_op(c->ops, s->op)) {
        res->status = TMX_ERR_UNSUPPORTED;
        return TMX_OK;
    }
    res->status = c->ops->sync(c->ctx);
    size_t bytes = 0;
    for (int i = 0; i < c->n_out; i++) bytes += out_bytes(&c->out[i]);
    if (!c->got && !(c->got = malloc(bytes)))
        return tmx_err(err, TMX_ERR_NOMEM, "conform: %s: out of memory", s->name);
    c->got_bytes = bytes;
    double worst = 0;
    for (size_t i = 0, off = 0; i < (size_t)c->n_out; off += out_bytes(&c->out[i]), i++) {
        enum tmx_status st = c->ops->buf_read(c->ctx, c->got + off, c->out[i].dev,
                                              out_bytes(&c->out[i]));
        if (st != TMX_OK)
            return tmx_err(err, st, "conform: %s: buf_read failed (%s)", s->name,
                           tmx_status_str(st));
        worst = fmax(worst, compare(&c->out[i], c->got + off));
    }
    if (res->status == TMX_OK) res->err = worst;
    res->pass = res->status == TMX_OK && res->err <= res->tol;
    return TMX_OK;
}

const void *tmx_conform_case_output(const struct tmx_conform_case *c, size_t *nbytes) {
    *nbytes = c->got ? c->got_bytes : 0;
    return c->got;
}

enum tmx_status tmx_conform_run(const struct tmx_kernels_i *ops, void *ctx, const char *filter,
                                struct tmx_conform_result *results, int max_results,
                                int *n_results, char **err) {
    *n_results = 0;
    for (size_t i = 0; i < tmx_conform_n_specs; i++) {
        if (filter && !strstr(tmx_conform_specs[i].name, filter)) continue;
        struct tmx_conform_case *c;
        struct tmx_conform_result r;
        enum tmx_status st = tmx_conform_case_new(i, ops, ctx, &c, err);
        if (st != TMX_OK) return st;
        tmx_conform_case_run(c);
        st = tmx_conform_case_check(c, &r, err);
        tmx_conform_case_free(c);
        if (st != TMX_OK) return st;
        if (*n_results < max_results) results[*n_results] = r;
        ++*n_results;
    }
    return TMX_OK;
}
