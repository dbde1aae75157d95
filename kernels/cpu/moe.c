/* moe.c: the router (moe_route), the routed experts (moe_experts), and their tensor-parallel
 * halves (moe_experts_partial, moe_combine). */
#include <math.h>

#include "cpu.h"

/* --- moe_route ------------------------------------------------------------------------------ */

struct route_job {
    int32_t *ids;        /* [n][k] */
    float *weights;      /* [n][k] */
    const float *logits; /* [n][n_exp] */
    const float *bias;   /* [n_exp] or NULL */
    float *s;            /* [n][n_exp] scratch: scores */
    unsigned char *used; /* [n][n_exp] scratch: already picked */
    int64_t n_exp, k;
    enum tmx_router_score score;
    int norm_topk;
    float scale;
};

/* One token: scores, then k passes that each pick the largest s + bias not yet picked; a strict
 * comparison in id order lets the lower id win a tie. */
static void route_task(void *arg, int64_t t) {
    const struct route_job *j = arg;
    const float *lg = j->logits + t * j->n_exp;
    float *s = j->s + t * j->n_exp;
    unsigned char *used = j->used + t * j->n_exp;
    if (j->score == TMX_ROUTER_SOFTMAX) {
        float mx = lg[0];
        for (int64_t e = 1; e < j->n_exp; e++) mx = lg[e] > mx ? lg[e] : mx;
        double sum = 0.0;
        for (int64_t e = 0; e < j->n_exp; e++) {
            s[e] = expf(lg[e] - mx);
            sum += s[e];
        }
        for (int64_t e = 0; e < j->n_exp; e++) s[e] = (float)(s[e] / sum);
    } else {
        for (int64_t e = 0; e < j->n_exp; e++) s[e] = 1.0f / (1.0f + expf(-lg[e]));
    }
    memset(used, 0, (size_t)j->n_exp);
    int32_t *ids = j->ids + t * j->k;
    float *w = j->weights + t * j->k;
    double picked = 0.0;
    for (int64_t q = 0; q < j->k; q++) {
        int64_t best = -1;
        float best_v = 0.0f;
        for (int64_t e = 0; e < j->n_exp; e++) {
            if (used[e]) continue;
            float v = j->bias ? s[e] + j->bias[e] : s[e];
            if (best < 0 || v > best_v) best = e, best_v = v;
        }
        used[best] = 1;
        ids[q] = (int32_t)best;
        w[q] = s[best];
        picked += s[best];
    }
    float norm = j->norm_topk ? (float)(j->scale / picked) : j->scale;
    for (int64_t q = 0; q < j->k; q++) w[q] *= norm;
}

void cpu_moe_route(void *ctx, int32_t *ids, float *weights, const float *logits,
                   const struct tmx_tensor *bias, int n, int n_exp, int k,
                   enum tmx_router_score score, int norm_topk, float scale) {
    struct cpu_ctx *c = ctx;
    if (n < 0 || n_exp <= 0 || k <= 0 || k > n_exp) {
        cpu_fail(c, TMX_ERR_INVALID, "moe_route: n = %d, %d experts, top %d", n, n_exp, k);
        return;
    }
    if (bias && !cpu_check_weight(c, "moe_route", "bias", bias, 1, n_exp, 0)) return;
    size_t per_token = (size_t)n_exp * (sizeof(float) + 1);
    char *scratch = cpu_scratch(c, (size_t)n_exp * sizeof(float) + (size_t)n * per_token,
                                "moe_route");
    if (!scratch) return;
    float *bias_f = NULL;
    if (bias) {
        bias_f = (float *)scratch;
        cpu_to_f32(bias_f, bias->data, bias->dtype, 0, n_exp);
    }
    float *s = (float *)scratch + n_exp;
    struct route_job j = {ids, weights, logits, bias_f, s, (unsigned char *)(s + (size_t)n * n_exp),
                          n_exp, k, score, norm_topk, scale};
    cpu_pool_run(c->pool, n, route_task, &j);
}

/* --- moe_experts ----------------------------------------------------------------------------
 * The n * k (token, expert) pairs are sorted by expert so that each expert's weights stream
 * from memory once per step: a task per active expert gathers its tokens' z rows and runs
 * gate, up and down as small matmuls, writing weight * RMSNorm(y) into one scratch row per
 * pair. Then each token sums its pair rows in j order. No two tasks write the same row and the
 * sum order is fixed, so the result does not depend on the thread count. Tokens go in chunks
 * that bound the scratch; a pair's arithmetic does not depend on its chunk.
 *
 * moe_experts_partial runs the same tasks without the norm and the weight, and each token
 * copies its pair rows out instead of summing them. */

#define SCRATCH_BUDGET ((size_t)64 << 20)

struct experts_job {
    const struct tmx_moe_weights *w;
    const float *z;       /* [n][latent] */
    const float *weights; /* [n][k] */
    const float *post;    /* [latent] F32, or NULL */
    const int32_t *start; /* [n_experts + 1]: the sorted pairs of local expert e */
    const int32_t *pair;  /* [n_pairs]: t * k + j of each sorted pair */
    const int32_t *active; /* local ids of the experts with pairs, one per task */
    float *y;             /* [n_pairs][latent]: gathered z, then weighted y (raw: y) */
    float *g, *u;         /* [n_pairs][inter] */
    int64_t k;
    int raw;              /* moe_experts_partial: leave y unnormalized and unweighted */
};

static void expert_task(void *arg, int64_t task) {
    const struct experts_job *j = arg;
    const struct tmx_moe_weights *w = j->w;
    int64_t e = j->active[task], o = j->start[e], cnt = j->start[e + 1] - o;
    int64_t latent = w->latent, inter = w->inter;
    float *y = j->y + o * latent, *g = j->g + o * inter, *u = j->u + o * inter;
    for (int64_t i = 0; i < cnt; i++)
        memcpy(y + i * latent, j->z + j->pair[o + i] / j->k * latent, (size_t)latent * sizeof *y);
    cpu_matmul_block(g, inter, y, w->gate[e].data, w->gate[e].dtype, latent, 0, inter, 0, cnt);
    cpu_matmul_block(u, inter, y, w->up[e].data, w->up[e].dtype, latent, 0, inter, 0, cnt);
    for (int64_t i = 0; i < cnt * inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    cpu_matmul_block(y, latent, g, w->down[e].data, w->down[e].dtype, inter, 0, latent, 0, cnt);
    for (int64_t i = 0; i < cnt && !j->raw; i++) {
        float *row = y + i * latent, pw = j->weights[j->pair[o + i]];
        if (j->post) cpu_rmsnorm_row(row, row, j->post, (int)latent, w->eps);
        for (int64_t d = 0; d < latent; d++) row[d] *= pw;
    }
}

struct sum_job {
    float *out;         /* [n][latent], or raw: [n][k][latent] */
    const float *y;     /* [n_pairs][latent] */
    const int32_t *slot; /* [n][k]: sorted position of each pair, -1: not this rank's expert */
    int64_t k, latent;
};

static void sum_task(void *arg, int64_t t) {
    const struct sum_job *j = arg;
    float *out = j->out + t * j->latent;
    memset(out, 0, (size_t)j->latent * sizeof *out);
    for (int64_t q = 0; q < j->k; q++) {
        int32_t s = j->slot[t * j->k + q];
        if (s < 0) continue;
        const float *y = j->y + s * j->latent;
        for (int64_t d = 0; d < j->latent; d++) out[d] += y[d];
    }
}

/* moe_experts_partial: token t's pair rows, in j order. */
static void copy_task(void *arg, int64_t t) {
    const struct sum_job *j = arg;
    for (int64_t q = 0; q < j->k; q++) {
        float *out = j->out + (t * j->k + q) * j->latent;
        int32_t s = j->slot[t * j->k + q];
        if (s < 0) memset(out, 0, (size_t)j->latent * sizeof *out);
        else memcpy(out, j->y + s * j->latent, (size_t)j->latent * sizeof *out);
    }
}

static int check_experts(struct cpu_ctx *c, const char *op, const struct tmx_moe_weights *w,
                         const int32_t *ids, int64_t n_pairs, int raw) {
    if (w->n_experts <= 0 || w->latent <= 0 || w->inter <= 0 || !w->gate || !w->up || !w->down) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %d experts, latent %d, inter %d", op, w->n_experts,
                 w->latent, w->inter);
        return 0;
    }
    if (!raw && w->post_norm &&
        !cpu_check_weight(c, op, "post_norm", w->post_norm, 1, w->latent, 0))
        return 0;
    for (int64_t p = 0; p < n_pairs; p++) {
        int64_t e = (int64_t)ids[p] - w->expert0;
        if (e < 0 || e >= w->n_experts) continue;
        if (!cpu_check_weight(c, op, "gate", &w->gate[e], 2, w->inter, w->latent) ||
            !cpu_check_weight(c, op, "up", &w->up[e], 2, w->inter, w->latent) ||
            !cpu_check_weight(c, op, "down", &w->down[e], 2, w->latent, w->inter))
            return 0;
    }
    return 1;
}

/* Both ops: raw (moe_experts_partial) writes out[n][k][latent] of unweighted y_e. */
static void experts(struct cpu_ctx *c, float *out, const float *z, const int32_t *ids,
                    const float *weights, int n, int k, const struct tmx_moe_weights *w,
                    int raw) {
    const char *op = raw ? "moe_experts_partial" : "moe_experts";
    if (n < 0 || k <= 0) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: n = %d, k = %d", op, n, k);
        return;
    }
    if (!check_experts(c, op, w, ids, (int64_t)n * k, raw)) return;
    int64_t latent = w->latent, inter = w->inter, n_exp = w->n_experts;
    size_t pair_bytes = (size_t)(latent + 2 * inter) * sizeof(float) + 2 * sizeof(int32_t);
    int64_t chunk = (int64_t)(SCRATCH_BUDGET / (pair_bytes * (size_t)k));
    if (chunk < 1) chunk = 1;
    if (chunk > n) chunk = n;
    int64_t max_pairs = chunk * k;
    /* floats first, so that every array stays 4-byte aligned after the 64-byte aligned base */
    size_t bytes = (size_t)latent * sizeof(float) + (size_t)max_pairs * pair_bytes +
                   (size_t)(3 * n_exp + 1) * sizeof(int32_t);
    float *post = cpu_scratch(c, bytes, op);
    if (!post) return;
    float *y = post + latent, *g = y + max_pairs * latent, *u = g + max_pairs * inter;
    int32_t *start = (int32_t *)(u + max_pairs * inter), *fill = start + n_exp + 1;
    int32_t *active = fill + n_exp, *pair = active + n_exp, *slot = pair + max_pairs;
    if (w->post_norm && !raw)
        cpu_to_f32(post, w->post_norm->data, w->post_norm->dtype, 0, latent);

    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        int64_t nt = n - t0 < chunk ? n - t0 : chunk, np = nt * k;
        const int32_t *cids = ids + t0 * k;
        /* counting sort of the chunk's pairs by local expert, stable in pair order */
        memset(start, 0, (size_t)(n_exp + 1) * sizeof *start);
        for (int64_t p = 0; p < np; p++) {
            int64_t e = (int64_t)cids[p] - w->expert0;
            if (e >= 0 && e < n_exp) start[e + 1]++;
        }
        int64_t n_active = 0;
        for (int64_t e = 0; e < n_exp; e++) {
            if (start[e + 1]) active[n_active++] = (int32_t)e;
            start[e + 1] += start[e];
            fill[e] = start[e];
        }
        for (int64_t p = 0; p < np; p++) {
            int64_t e = (int64_t)cids[p] - w->expert0;
            slot[p] = e >= 0 && e < n_exp ? fill[e]++ : -1;
            if (slot[p] >= 0) pair[slot[p]] = (int32_t)p;
        }
        struct experts_job ej = {w, z + t0 * latent, raw ? NULL : weights + t0 * k,
                                 w->post_norm && !raw ? post : NULL, start, pair, active, y, g,
                                 u, k, raw};
        cpu_pool_run(c->pool, n_active, expert_task, &ej);
        struct sum_job sj = {out + t0 * (raw ? k : 1) * latent, y, slot, k, latent};
        cpu_pool_run(c->pool, nt, raw ? copy_task : sum_task, &sj);
    }
}

void cpu_moe_experts(void *ctx, float *out, const float *z, const int32_t *ids,
                     const float *weights, int n, int k, const struct tmx_moe_weights *w) {
    experts(ctx, out, z, ids, weights, n, k, w, 0);
}

void cpu_moe_experts_partial(void *ctx, float *ye, const float *z, const int32_t *ids, int n,
                             int k, const struct tmx_moe_weights *w) {
    experts(ctx, ye, z, ids, NULL, n, k, w, 1);
}

/* --- moe_combine ---------------------------------------------------------------------------- */

struct combine_job {
    float *out;           /* [n][latent] */
    const float *ye;      /* [n][k][latent] */
    const float *weights; /* [n][k] */
    const float *post;    /* [latent] F32, or NULL */
    int64_t k, latent;
    float eps;
};

/* Token t: each pair row normed, weighted and added in j order, rounding as moe_experts'
 * expert_task and sum_task do. */
static void combine_task(void *arg, int64_t t) {
    const struct combine_job *j = arg;
    float *out = j->out + t * j->latent;
    memset(out, 0, (size_t)j->latent * sizeof *out);
    for (int64_t q = 0; q < j->k; q++) {
        const float *y = j->ye + (t * j->k + q) * j->latent, pw = j->weights[t * j->k + q];
        if (j->post) {
            const float inv = cpu_rms_inv(y, (int)j->latent, j->eps);
            for (int64_t d = 0; d < j->latent; d++) out[d] += y[d] * inv * j->post[d] * pw;
        } else {
            for (int64_t d = 0; d < j->latent; d++) out[d] += y[d] * pw;
        }
    }
}

void cpu_moe_combine(void *ctx, float *out, const float *ye, const float *weights, int n, int k,
                     int latent, const struct tmx_tensor *post_norm, float eps) {
    struct cpu_ctx *c = ctx;
    if (n < 0 || k <= 0 || latent <= 0) {
        cpu_fail(c, TMX_ERR_INVALID, "moe_combine: n = %d, k = %d, latent = %d", n, k, latent);
        return;
    }
    if (post_norm && !cpu_check_weight(c, "moe_combine", "post_norm", post_norm, 1, latent, 0))
        return;
    float *post = NULL;
    if (post_norm) {
        if (!(post = cpu_scratch(c, (size_t)latent * sizeof *post, "moe_combine"))) return;
        cpu_to_f32(post, post_norm->data, post_norm->dtype, 0, latent);
    }
    struct combine_job j = {out, ye, weights, post, k, latent, eps};
    cpu_pool_run(c->pool, n, combine_task, &j);
}
