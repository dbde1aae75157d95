/* rows.c: the row-wise ops: embed, rmsnorm, swiglu, add_gated, add_rmsnorm, gather, argmax,
 * topk, logit_edit.
 *
 * Each is cheap per element, so work is cut into tasks of about GRAIN floats: a decode step's
 * single row runs inline on the caller instead of paying for a pool wake-up. Small weight
 * vectors (norm and gate weights) are converted to F32 once per call, into scratch. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

#define GRAIN (1 << 15)

/* Items per task when each item touches `width` floats. */
static int64_t per_task(int64_t width) { return width >= GRAIN ? 1 : GRAIN / width; }

static int64_t n_tasks(int64_t items, int64_t per) { return (items + per - 1) / per; }

static int check_rows(struct cpu_ctx *c, const char *op, int64_t rows, int64_t d) {
    if (rows < 0 || d <= 0) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %lld rows of width %lld", op, (long long)rows,
                 (long long)d);
        return 0;
    }
    return 1;
}

/* The [count] F32 view of a weight vector: its data when F32, else a copy in scratch. */
static const float *weight_f32(struct cpu_ctx *c, const char *op, const char *what,
                               const struct tmx_tensor *w, int64_t count) {
    if (!cpu_check_weight(c, op, what, w, 1, count, 0)) return NULL;
    if (w->dtype == TMX_DTYPE_F32) return w->data;
    float *f = cpu_scratch(c, (size_t)count * sizeof *f, op);
    if (f) cpu_to_f32(f, w->data, w->dtype, 0, count);
    return f;
}

/* --- embed ---------------------------------------------------------------------------------- */

struct embed_job {
    float *out;
    const struct tmx_tensor *table;
    const int32_t *ids;
    int64_t n, d, per;
};

static void embed_task(void *arg, int64_t task) {
    const struct embed_job *j = arg;
    for (int64_t t = task * j->per; t < j->n && t < (task + 1) * j->per; t++)
        cpu_to_f32(j->out + t * j->d, j->table->data, j->table->dtype, j->ids[t] * j->d, j->d);
}

void cpu_embed(void *ctx, float *out, const struct tmx_tensor *table, const int32_t *ids, int n) {
    struct cpu_ctx *c = ctx;
    if (!cpu_check_weight(c, "embed", "table", table, 2, 0, 0) ||
        !check_rows(c, "embed", n, table->shape[1]))
        return;
    int64_t vocab = table->shape[0];
    for (int t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= vocab) {
            cpu_fail(c, TMX_ERR_INVALID, "embed: id %d at row %d outside [0, %lld)", ids[t], t,
                     (long long)vocab);
            return;
        }
    struct embed_job j = {out, table, ids, n, table->shape[1], per_task(table->shape[1])};
    cpu_pool_run(c->pool, n_tasks(n, j.per), embed_task, &j);
}

/* --- rmsnorm -------------------------------------------------------------------------------- */

/* The sum of squares in double: four partial sums keep it vectorizable and cheap. */
float cpu_rms_inv(const float *x, int d, float eps) {
    double ss[4] = {0};
    int i = 0;
    for (; i + 4 <= d; i += 4)
        for (int l = 0; l < 4; l++) ss[l] += (double)x[i + l] * x[i + l];
    for (; i < d; i++) ss[0] += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(((ss[0] + ss[1]) + (ss[2] + ss[3])) / d + eps));
}

void cpu_rmsnorm_row(float *out, const float *x, const float *w, int d, float eps) {
    const float inv = cpu_rms_inv(x, d, eps);
    int i;
    if (w)
        for (i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
    else
        for (i = 0; i < d; i++) out[i] = x[i] * inv;
}

struct rmsnorm_job {
    float *out;
    const float *x, *w;
    int64_t rows, d, per;
    float eps;
};

static void rmsnorm_task(void *arg, int64_t task) {
    const struct rmsnorm_job *j = arg;
    for (int64_t r = task * j->per; r < j->rows && r < (task + 1) * j->per; r++)
        cpu_rmsnorm_row(j->out + r * j->d, j->x + r * j->d, j->w, (int)j->d, j->eps);
}

void cpu_rmsnorm(void *ctx, float *out, const float *x, const struct tmx_tensor *w, int rows,
                 int d, float eps) {
    struct cpu_ctx *c = ctx;
    const float *wf = NULL;
    if (!check_rows(c, "rmsnorm", rows, d) ||
        (w && !(wf = weight_f32(c, "rmsnorm", "weight", w, d))))
        return;
    struct rmsnorm_job j = {out, x, wf, rows, d, per_task(d), eps};
    cpu_pool_run(c->pool, n_tasks(rows, j.per), rmsnorm_task, &j);
}

/* --- swiglu --------------------------------------------------------------------------------- */

struct swiglu_job {
    float *out;
    const float *gate, *up;
    int64_t count;
};

static void swiglu_task(void *arg, int64_t task) {
    const struct swiglu_job *j = arg;
    for (int64_t i = task * GRAIN; i < j->count && i < (task + 1) * GRAIN; i++) {
        float g = j->gate[i];
        j->out[i] = g / (1.0f + expf(-g)) * j->up[i];
    }
}

void cpu_swiglu(void *ctx, float *out, const float *gate, const float *up, int64_t count) {
    struct cpu_ctx *c = ctx;
    struct swiglu_job j = {out, gate, up, count};
    cpu_pool_run(c->pool, n_tasks(count, GRAIN), swiglu_task, &j);
}

/* --- add_gated ------------------------------------------------------------------------------ */

struct add_gated_job {
    float *h;
    const float *a, *g;
    int64_t rows, d, per;
    float *out;     /* add_rmsnorm: each row normed into out[r] (NULL: add_gated) */
    const float *w; /* its norm weight, or NULL */
    float eps;
};

static void add_gated_task(void *arg, int64_t task) {
    const struct add_gated_job *j = arg;
    for (int64_t r = task * j->per; r < j->rows && r < (task + 1) * j->per; r++) {
        float *h = j->h + r * j->d;
        const float *a = j->a + r * j->d;
        if (j->g)
            for (int64_t i = 0; i < j->d; i++) h[i] += j->g[i] * a[i];
        else
            for (int64_t i = 0; i < j->d; i++) h[i] += a[i];
        if (j->out) cpu_rmsnorm_row(j->out + r * j->d, h, j->w, (int)j->d, j->eps);
    }
}

void cpu_add_gated(void *ctx, float *h, const float *a, const struct tmx_tensor *g, int rows,
                   int d) {
    struct cpu_ctx *c = ctx;
    const float *gf = NULL;
    if (!check_rows(c, "add_gated", rows, d) ||
        (g && !(gf = weight_f32(c, "add_gated", "gate", g, d))))
        return;
    struct add_gated_job j = {h, a, gf, rows, d, per_task(d), NULL, NULL, 0};
    cpu_pool_run(c->pool, n_tasks(rows, j.per), add_gated_task, &j);
}

int cpu_pair_f32(struct cpu_ctx *c, const char *op, const char *const what[2],
                 const struct tmx_tensor *g, const struct tmx_tensor *w, int64_t d,
                 const float **gf, const float **wf) {
    const struct tmx_tensor *t[2] = {g, w};
    const float **view[2] = {gf, wf};
    float *f = NULL;
    for (int i = 0; i < 2; i++) {
        *view[i] = NULL;
        if (!t[i]) continue;
        if (!cpu_check_weight(c, op, what[i], t[i], 1, d, 0)) return 0;
        if (t[i]->dtype == TMX_DTYPE_F32) {
            *view[i] = t[i]->data;
            continue;
        }
        if (!f && !(f = cpu_scratch(c, (size_t)2 * d * sizeof *f, op))) return 0;
        cpu_to_f32(f + i * d, t[i]->data, t[i]->dtype, 0, d);
        *view[i] = f + i * d;
    }
    return 1;
}

/* add_gated's rows, each normed into out while it is in cache. */
void cpu_add_rmsnorm(void *ctx, float *out, float *h, const float *a, const struct tmx_tensor *g,
                     const struct tmx_tensor *w, int rows, int d, float eps) {
    struct cpu_ctx *c = ctx;
    const float *gf, *wf;
    static const char *const what[2] = {"gate", "weight"};
    if (!check_rows(c, "add_rmsnorm", rows, d) ||
        !cpu_pair_f32(c, "add_rmsnorm", what, g, w, d, &gf, &wf))
        return;
    struct add_gated_job j = {h, a, gf, rows, d, per_task(d), out, wf, eps};
    cpu_pool_run(c->pool, n_tasks(rows, j.per), add_gated_task, &j);
}

/* --- gather --------------------------------------------------------------------------------- */

struct gather_job {
    float *out;        /* [n][d] */
    const float *x;    /* [rows named][d] */
    const int32_t *rows;
    int64_t n, d, per;
};

static void gather_task(void *arg, int64_t task) {
    const struct gather_job *j = arg;
    for (int64_t i = task * j->per; i < j->n && i < (task + 1) * j->per; i++)
        memcpy(j->out + i * j->d, j->x + j->rows[i] * j->d, (size_t)j->d * sizeof *j->out);
}

void cpu_gather(void *ctx, float *out, const float *x, const int32_t *rows, int n, int d) {
    struct cpu_ctx *c = ctx;
    if (!check_rows(c, "gather", n, d)) return;
    for (int i = 0; i < n; i++)
        if (rows[i] < 0) {
            cpu_fail(c, TMX_ERR_INVALID, "gather: row %d at %d", rows[i], i);
            return;
        }
    struct gather_job j = {out, x, rows, n, d, per_task(d)};
    cpu_pool_run(c->pool, n_tasks(n, j.per), gather_task, &j);
}

/* --- argmax --------------------------------------------------------------------------------- */

struct argmax_job {
    int32_t *ids;
    float *best;
    const float *x;
    int rows, d, ld;
    int64_t per;
};

/* The first column of x[0..d) holding its largest value (NaN never the largest; a row of NaN
 * only: 0). Two passes: the largest value 8 lanes at a time (x > m ? x : m never takes a NaN),
 * then the first column that holds it. */
static int32_t row_argmax(const float *x, int d) {
    f32x8 m8 = v8_splat(-INFINITY);
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        const f32x8 v = v8_load(x + i);
        const u32x8 gt = (u32x8)(v > m8);
        m8 = (f32x8)(((u32x8)v & gt) | ((u32x8)m8 & ~gt));
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
    for (; i < d; i++) m = x[i] > m ? x[i] : m;
    for (i = 0; i < d; i++)
        if (x[i] == m) return i;
    return 0;
}

static void argmax_task(void *arg, int64_t task) {
    const struct argmax_job *j = arg;
    for (int64_t r = task * j->per; r < j->rows && r < (task + 1) * j->per; r++) {
        const float *xr = j->x + r * j->ld;
        j->ids[r] = row_argmax(xr, j->d);
        j->best[r] = xr[j->ids[r]];
    }
}

void cpu_argmax(void *ctx, int32_t *ids, float *best, const float *x, int rows, int d, int ld) {
    struct cpu_ctx *c = ctx;
    if (!check_rows(c, "argmax", rows, d)) return;
    if (ld < d) {
        cpu_fail(c, TMX_ERR_INVALID, "argmax: row stride %d below the width %d", ld, d);
        return;
    }
    struct argmax_job j = {ids, best, x, rows, d, ld, per_task(d)};
    cpu_pool_run(c->pool, n_tasks(rows, j.per), argmax_task, &j);
}

/* --- topk ----------------------------------------------------------------------------------- */

struct topk_job {
    float *xs;
    int32_t *ids;
    double *stats;
    const float *x, *temps;
    int rows, d, ld, k;
    int64_t per;
};

struct cand {
    float y;
    int32_t id;
};

/* Candidate order: the larger y, then the lower column. */
static int cand_before(struct cand a, struct cand b) {
    return a.y > b.y || (a.y == b.y && a.id < b.id);
}

static int cand_cmp(const void *a, const void *b) {
    const struct cand *x = a, *y = b;
    return cand_before(*x, *y) ? -1 : cand_before(*y, *x);
}

/* Restores the heap below h[i]: every entry comes after (in candidate order) its children, so
 * h[0] is the last of the k kept. */
static void heap_down(struct cand *h, int n, int i) {
    for (;;) {
        int last = i;
        const int l = 2 * i + 1, r = l + 1;
        if (l < n && cand_before(h[last], h[l])) last = l;
        if (r < n && cand_before(h[last], h[r])) last = r;
        if (last == i) return;
        const struct cand t = h[i];
        h[i] = h[last];
        h[last] = t;
        i = last;
    }
}

/* Offers column i to the heap h of the first n <= k candidates so far (columns come in
 * ascending order, so a candidate equal to the last kept one comes after it). */
static void heap_offer(struct cand *h, int *n, int k, const float *x, float t, int i) {
    if (isnan(x[i]) || x[i] == -INFINITY) return;
    const struct cand c = {x[i] / t, i};
    if (*n < k) {
        h[(*n)++] = c;
        for (int j = *n - 1; j > 0 && cand_before(h[(j - 1) / 2], h[j]); j = (j - 1) / 2) {
            const struct cand p = h[(j - 1) / 2];
            h[(j - 1) / 2] = h[j];
            h[j] = p;
        }
    } else if (cand_before(c, h[0])) {
        h[0] = c;
        heap_down(h, *n, 0);
    }
}

/* One row: the first k candidates kept in a heap of k (8 columns at a time pass by when none
 * beats the last kept one, which is most of them), sorted at the end; then the sums over all
 * candidates in column order, as the host sampler (and tmx serve's log probabilities) sum
 * them, so that its draws equal this set's exactly. */
static void row_topk(float *xs, int32_t *ids, double *stats, const float *x, float t, int d,
                     int k) {
    struct cand h[TMX_TOPK_MAX];
    int n = 0, i = 0;
    for (; i + 8 <= d; i += 8) {
        if (n == k) { /* y > the last kept y, lane by lane (NaN compares false) */
            const u32x8 beats = (u32x8)(v8_load(x + i) / v8_splat(t) > v8_splat(h[0].y));
            int hit = 0;
            for (int l = 0; l < 8; l++) hit |= beats[l] != 0;
            if (!hit) continue;
        }
        for (int j = i; j < i + 8; j++) heap_offer(h, &n, k, x, t, j);
    }
    for (; i < d; i++) heap_offer(h, &n, k, x, t, i);
    qsort(h, (size_t)n, sizeof *h, cand_cmp);
    for (int i = 0; i < k; i++) {
        xs[i] = i < n ? x[h[i].id] : -INFINITY;
        ids[i] = i < n ? h[i].id : -1;
    }
    double sum = 0.0, count = 0.0, sum1 = 0.0;
    for (int i = 0; n > 0 && i < d; i++)
        if (!isnan(x[i]) && x[i] != -INFINITY) {
            sum += exp((double)(x[i] / t) - h[0].y);
            if (t != 1.0f) sum1 += exp((double)x[i] - x[h[0].id]);
            count++;
        }
    stats[0] = sum;
    stats[1] = count;
    stats[2] = t != 1.0f ? sum1 : sum; /* at 1, y is x */
}

static void topk_task(void *arg, int64_t task) {
    const struct topk_job *j = arg;
    for (int64_t r = task * j->per; r < j->rows && r < (task + 1) * j->per; r++)
        row_topk(j->xs + r * j->k, j->ids + r * j->k, j->stats + 3 * r, j->x + r * j->ld,
                 j->temps[r], j->d, j->k);
}

void cpu_topk(void *ctx, float *xs, int32_t *ids, double *stats, const float *x,
              const float *temps, int rows, int d, int ld, int k) {
    struct cpu_ctx *c = ctx;
    if (!check_rows(c, "topk", rows, d)) return;
    if (ld < d || k < 1 || k > TMX_TOPK_MAX) {
        cpu_fail(c, TMX_ERR_INVALID, "topk: row stride %d, width %d, k %d (at most %d)", ld, d,
                 k, TMX_TOPK_MAX);
        return;
    }
    for (int r = 0; r < rows; r++)
        if (!(temps[r] > 0) || !isfinite(temps[r])) {
            cpu_fail(c, TMX_ERR_INVALID, "topk: temperature %g of row %d", temps[r], r);
            return;
        }
    struct topk_job j = {xs, ids, stats, x, temps, rows, d, ld, k, per_task(d)};
    cpu_pool_run(c->pool, n_tasks(rows, j.per), topk_task, &j);
}

/* --- logit_edit ----------------------------------------------------------------------------- */

void cpu_logit_edit(void *ctx, float *x, const struct tmx_logit_edit *edits,
                    const int32_t *starts, int rows, int ld, int lo, int d) {
    struct cpu_ctx *c = ctx;
    if (!check_rows(c, "logit_edit", rows, d)) return;
    if (ld < d) {
        cpu_fail(c, TMX_ERR_INVALID, "logit_edit: row stride %d, width %d", ld, d);
        return;
    }
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * ld;
        for (int32_t i = starts[r]; i < starts[r + 1]; i++) {
            const int32_t col = edits[i].id - lo;
            if (col >= 0 && col < d) xr[col] = tmx_logit_edit_apply(&edits[i], xr[col]);
        }
    }
}
