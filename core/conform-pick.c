/* conform-pick.c: the conformance cases of what ends a step where the logits are: argmax,
 * topk and logit_edit, with their references (conform.c runs them). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "conform-impl.h"

/* --- argmax ----------------------------------------------------------------------------------- */

/* Uniform rows; TIES: five values, so that the largest repeats across the row; SPECIAL: NaN and
 * infinities sprinkled in, row 0 NaN only, row 1 -inf only, row 2 +inf twice. */
enum tmx_status cf_argmax_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int ld = s->m ? s->m : s->d;
    const size_t count = (size_t)s->n * ld;
    float *x = cf_host_alloc(c, count * sizeof *x);
    if (!x) return c->status;
    for (size_t i = 0; i < count; i++) {
        const size_t r = i / ld;
        float v = s->flags & TIES ? (float)cf_randint(c, 0, 4) : (float)cf_uniform(c, -8, 8);
        if (s->flags & SPECIAL) {
            const int u = cf_randint(c, 0, 99);
            v = r == 0 ? NAN : r == 1 ? -INFINITY : u < 10 ? NAN : u < 13 ? -INFINITY : v;
            if (r == 2 && (i % ld == 77 || i % ld == 5000)) v = INFINITY;
        }
        x[i] = v;
    }
    c->arg[0] = cf_upload(c, x, count * sizeof *x);
    c->arg[1] = cf_buffer(c, (size_t)s->n * sizeof(int32_t));
    c->arg[2] = cf_buffer(c, (size_t)s->n * sizeof(float));
    double *ids = cf_output(c, c->arg[1], (size_t)s->n, TMX_DTYPE_I32);
    double *best = cf_output(c, c->arg[2], (size_t)s->n, TMX_DTYPE_F32);
    if (!ids || !best || !c->arg[0]) return c->status;
    for (int r = 0; r < s->n; r++) {
        const float *xr = x + (size_t)r * ld;
        int at = -1;
        for (int i = 0; i < s->d; i++)
            if (!isnan(xr[i]) && (at < 0 || xr[i] > xr[at])) at = i;
        ids[r] = at < 0 ? 0 : at;
        best[r] = xr[at < 0 ? 0 : at];
    }
    return TMX_OK;
}

void cf_argmax_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->argmax(c->ctx, c->arg[1], c->arg[2], c->arg[0], s->n, s->d, s->m ? s->m : s->d);
}

/* --- topk ------------------------------------------------------------------------------------- */

struct topk_cand {
    float y;
    int32_t id;
};

static int topk_cmp(const void *a, const void *b) {
    const struct topk_cand *x = a, *y = b;
    if (x->y != y->y) return x->y > y->y ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Uniform rows at temperatures in [0.3, 2] (row 0 at 1); TIES: five values; SPECIAL: NaN and
 * -inf sprinkled in, row 0 NaN only, row 1 -inf only, row 2 five candidates. The reference
 * sorts every candidate; xs and ids must match exactly, stats to double rounding. */
enum tmx_status cf_topk_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int ld = s->m ? s->m : s->d, k = s->top_k;
    const size_t count = (size_t)s->n * ld;
    float *x = cf_host_alloc(c, count * sizeof *x), *temps = cf_host_alloc(c, s->n * sizeof *temps);
    struct topk_cand *cand = cf_host_alloc(c, (size_t)s->d * sizeof *cand);
    if (!x || !temps || !cand) return c->status;
    for (size_t i = 0; i < count; i++) {
        const size_t r = i / ld, col = i % ld;
        float v = s->flags & TIES ? (float)cf_randint(c, 0, 4) : (float)cf_uniform(c, -8, 8);
        if (s->flags & SPECIAL) {
            const int u = cf_randint(c, 0, 99);
            v = r == 0 ? NAN : r == 1 ? -INFINITY : u < 10 ? NAN : u < 13 ? -INFINITY : v;
            if (r == 2 && col % 1000 != 7) v = col % 2 ? NAN : -INFINITY;
        }
        x[i] = v;
    }
    for (int r = 0; r < s->n; r++) temps[r] = r == 0 ? 1.0f : (float)cf_uniform(c, 0.3, 2.0);
    c->arg[0] = cf_upload(c, x, count * sizeof *x);
    c->arg[1] = cf_upload(c, temps, s->n * sizeof *temps);
    c->arg[2] = cf_buffer(c, (size_t)s->n * k * sizeof(float));
    c->arg[3] = cf_buffer(c, (size_t)s->n * k * sizeof(int32_t));
    c->arg[4] = cf_buffer(c, (size_t)s->n * 3 * sizeof(double));
    double *xs = cf_output(c, c->arg[2], (size_t)s->n * k, TMX_DTYPE_F32);
    double *ids = cf_output(c, c->arg[3], (size_t)s->n * k, TMX_DTYPE_I32);
    double *stats = cf_output(c, c->arg[4], (size_t)s->n * 3, F64);
    if (!xs || !ids || !stats || !c->arg[0] || !c->arg[1]) return c->status;
    for (int r = 0; r < s->n; r++) {
        const float *xr = x + (size_t)r * ld;
        int n = 0;
        for (int i = 0; i < s->d; i++)
            if (!isnan(xr[i]) && xr[i] != -INFINITY)
                cand[n++] = (struct topk_cand){xr[i] / temps[r], i};
        qsort(cand, (size_t)n, sizeof *cand, topk_cmp);
        double sum = 0, sum1 = 0;
        for (int i = 0; i < n; i++) {
            sum += exp((double)cand[i].y - cand[0].y);
            sum1 += exp((double)xr[cand[i].id] - xr[cand[0].id]);
        }
        for (int i = 0; i < k; i++) {
            xs[(size_t)r * k + i] = i < n ? xr[cand[i].id] : -INFINITY;
            ids[(size_t)r * k + i] = i < n ? cand[i].id : -1;
        }
        stats[3 * r] = sum;
        stats[3 * r + 1] = n;
        stats[3 * r + 2] = sum1;
    }
    return TMX_OK;
}

void cf_topk_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->topk(c->ctx, c->arg[2], c->arg[3], c->arg[4], c->arg[0], c->arg[1], s->n, s->d,
                 s->m ? s->m : s->d, s->top_k);
}

/* --- logit_edit ------------------------------------------------------------------------------ */

/* Rows of uniform logits (SPECIAL: NaN, infinities and signed zeros sprinkled in), each with up
 * to top_k edits of distinct ids drawn around the slice [lo, lo + d), so that some fall outside
 * it: biases, penalties and repetition penalties each present or not. The reference is the
 * header's rule written out; the edited rows must match it exactly, the stride's columns
 * untouched. */
enum tmx_status cf_logit_edit_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const int ld = s->m ? s->m : s->d, lo = s->expert0;
    const int first = lo > 20 ? lo - 20 : 0, span = lo + s->d + 20 - first;
    const size_t count = (size_t)s->n * ld;
    float *x = cf_host_alloc(c, count * sizeof *x);
    int32_t *starts = cf_host_alloc(c, ((size_t)s->n + 1) * sizeof *starts);
    struct tmx_logit_edit *e = cf_host_alloc(c, (size_t)s->n * s->top_k * sizeof *e);
    if (!x || !starts || !e) return c->status;
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f};
    for (size_t i = 0; i < count; i++)
        x[i] = s->flags & SPECIAL && cf_randint(c, 0, 3) == 0 ? specials[cf_randint(c, 0, 4)]
                                                          : (float)cf_uniform(c, -8, 8);
    const float reps[] = {1.0f, 1.3f, 0.75f};
    int n = 0;
    for (int r = 0; r < s->n; r++) {
        starts[r] = n;
        const int want = cf_randint(c, 0, s->top_k);
        for (int id = first; id < first + span && n - starts[r] < want; id++)
            if (cf_randint(c, 0, span - 1) < want)
                e[n++] = (struct tmx_logit_edit){
                    id, cf_randint(c, 0, 2) ? (float)cf_uniform(c, -5, 5) : 0.0f,
                    cf_randint(c, 0, 1) ? (float)cf_uniform(c, 0, 4) : 0.0f, reps[cf_randint(c, 0, 2)]};
    }
    starts[s->n] = n;
    c->arg[0] = cf_upload(c, x, count * sizeof *x);
    c->arg[1] = cf_upload(c, e, (n ? n : 1) * sizeof *e);
    c->arg[2] = cf_upload(c, starts, ((size_t)s->n + 1) * sizeof *starts);
    double *ref = cf_output(c, c->arg[0], count, TMX_DTYPE_F32);
    if (!ref || !c->arg[1] || !c->arg[2]) return c->status;
    for (size_t i = 0; i < count; i++) ref[i] = x[i];
    for (int r = 0; r < s->n; r++)
        for (int i = starts[r]; i < starts[r + 1]; i++) {
            const int col = e[i].id - lo;
            if (col < 0 || col >= s->d) continue;
            const float v = (x[(size_t)r * ld + col] + e[i].bias) - e[i].penalty;
            ref[(size_t)r * ld + col] = v > 0 ? v / e[i].rep : v * e[i].rep;
        }
    return TMX_OK;
}

void cf_logit_edit_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->logit_edit(c->ctx, c->arg[0], c->arg[1], c->arg[2], s->n, s->m ? s->m : s->d,
                       s->expert0, s->d);
}
