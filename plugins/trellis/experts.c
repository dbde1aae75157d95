/* experts.c: the codec ctx, the expert block in the rotated basis (moe_experts) and the
 * reconstructed matrices (expert_decode).
 *
 * The expert block of docs/trellismx.md §6, for the tokens of one step:
 *
 *     z'   = H(sign_latent_in . z)                            phase 0, per token
 *     g', u' = Q_gate act(z'), Q_up act(z')                   phase 1, per expert, rows, tokens
 *     m'   = H(s_mid . silu(s_mid . H g') . (s_mid . H u'))   phase 2, per (token, expert) pair
 *     y'   = Q_down act(m')                                   phase 3, per expert, rows, tokens
 *     out  = (sign_latent_out . H(sum_j w_j y'_j / rms(y'_j))) . post_norm   phase 4, per token
 *
 * moe_experts_partial (tensor parallelism, docs/tp.md) stops before phase 4's sum: each pair's
 * y' is unrotated into its own row, neither normalized nor weighted, for the core to all-reduce
 * over the ranks' slices of the intermediate dimension.
 *
 * act() quantizes a rotated vector as §7 says (serving) or leaves it in F32. Pairs are sorted
 * by expert, so that a work item of phases 1 and 3 decodes a block of 128 rows of one expert's
 * matrix once for up to TRELLIS_GROUP of its tokens. Every output element is computed by one
 * item in an order fixed by the data alone, so results do not depend on the thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codec_impl.h"
#include "encode.h"
#include "tmx/tensor.h"

#define ROWS_PER_ITEM 128 /* matrix rows one work item computes */

/* --- ctx ------------------------------------------------------------------------------------ */

enum tmx_status trellis_codec_new(const struct tmx_host *host, enum tmx_trellis_codec_id id,
                                  int threads, int serving, struct trellis_codec **out) {
    struct trellis_codec *c = calloc(1, sizeof *c);
    if (!c || tmx_pool_new(threads, TMX_POOL_YIELD, &c->own) != TMX_OK) {
        free(c);
        return TMX_ERR_NOMEM;
    }
    c->threads = tmx_pool_as_threads(c->own);
    c->host = host;
    c->spec = tmx_trellis_codec_spec(id);
    c->id = id;
    c->serving = serving;
    c->budget = TRELLIS_SCRATCH_BUDGET;
    *out = c;
    return TMX_OK;
}

enum tmx_status tmx_trellis_codec_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                       enum tmx_trellis_codec_id id, void **ctx, char **err) {
    *ctx = NULL;
    const char *name = tmx_trellis_codec_spec(id)->name;
    const char *act = host->opt_str(opts, "activations");
    if (!act || (strcmp(act, "serving") != 0 && strcmp(act, "f32") != 0))
        return host->err(err, TMX_ERR_INVALID, "%s: '%s' is neither \"serving\" nor \"f32\"",
                         tmx_opt_where(host, opts, "activations"), act ? act : "");
    int64_t threads = host->opt_int(opts, "threads");
    if (threads < 0 || threads > 4096)
        return host->err(err, TMX_ERR_INVALID, "%s: %lld is not in 0..4096",
                         tmx_opt_where(host, opts, "threads"), (long long)threads);
    if (threads == 0) threads = sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN)
                                                                 : 1;
    struct trellis_codec *c;
    if (trellis_codec_new(host, id, (int)threads, strcmp(act, "serving") == 0, &c) != TMX_OK)
        return host->err(err, TMX_ERR_NOMEM, "codec.%s: cannot start %lld threads", name,
                         (long long)threads);
    *ctx = c;
    return TMX_OK;
}

void tmx_trellis_codec_use_threads(void *ctx, const struct tmx_threads *threads) {
    struct trellis_codec *c = ctx;
    tmx_pool_free(c->own);
    c->own = NULL;
    c->threads = *threads;
}

void tmx_trellis_codec_fini(void *ctx) {
    struct trellis_codec *c = ctx;
    if (!c) return;
    tmx_pool_free(c->own);
    free(c->scratch);
    free(c);
}

enum tmx_status tmx_trellis_codec_layer_encode(void *ctx, const struct tmx_codec_encode_job *job,
                                               char **err) {
    const struct trellis_codec *c = ctx;
    return tmx_trellis_layer_encode(c->host, c->spec->law, TMX_TRELLIS_ALPHA, job, err);
}

int tmx_trellis_codec_quant_config(void *ctx, int bits, char *buf, size_t size) {
    const struct trellis_codec *c = ctx;
    return tmx_trellis_quant_config(c->spec->law, TMX_TRELLIS_ALPHA, bits, buf, size);
}

/* --- one step's buffers ---------------------------------------------------------------------- */

/* Per thread: tile scratch, a vector being rotated and quantized, its codes. */
struct thread_buf {
    struct trellis_tiles_scratch *tiles;
    float *v;       /* [max(latent, inter)] */
    uint8_t *q;     /* [max(latent, inter)] activation codes */
    uint8_t *s;     /* [max(latent, inter) / 16] NVFP4 block scales */
};

/* A group of one expert's sorted pairs, the unit of phases 1 and 3. */
struct group {
    int32_t expert, first, count;
};

/* What the phases of one chunk of tokens share. */
struct step {
    const struct trellis_codec *c;
    const struct trellis_layer *l;
    int64_t k;
    const float *z;          /* [n][latent] */
    const float *weights;    /* [n][k] */
    const float *post;       /* [latent] F32 post-expert norm weight, or NULL */
    float eps;
    float *out;              /* [n][latent]; partial: [n][k][latent] */
    int32_t *count;          /* [n_experts + 1]: pairs per expert, then where each starts */
    int32_t *slot;           /* [n][k]: the sorted position of each pair, -1: skipped */
    int32_t *pair;           /* [n_pairs]: t * k + j of each sorted pair */
    struct group *groups;    /* [n_groups] */
    float *zp, *za;          /* [n][2 latent] laid-out operands of z', [n] their scales */
    float *h, *ha;           /* [n_pairs][2 inter]: g', u', then m' laid out; [n_pairs] scales */
    float *y;                /* [n_pairs][latent]: y' */
    float *norm;             /* [latent]: the post-expert norm weight converted to F32 */
    struct thread_buf *tb;   /* [threads] */
};

/* The next `size` bytes at *at (64-aligned) of the buffer at base; NULL when only counting. */
static void *carve(char *base, size_t *at, size_t size) {
    void *r = base ? base + *at : NULL;
    *at += (size + 63) & ~(size_t)63;
    return r;
}

/* Bytes of the buffers of a chunk of n tokens; with a base, also points s into it. */
static size_t step_layout(struct step *s, char *base, int64_t n, int threads) {
    const struct trellis_layer *l = s->l;
    const int64_t pairs = n * s->k, dim = l->latent > l->inter ? l->latent : l->inter;
    size_t at = 0;
    s->count = carve(base, &at, (size_t)(l->n_experts + 1) * sizeof *s->count);
    s->slot = carve(base, &at, (size_t)pairs * sizeof *s->slot);
    s->pair = carve(base, &at, (size_t)pairs * sizeof *s->pair);
    s->groups = carve(base, &at, (size_t)pairs * sizeof *s->groups);
    s->zp = carve(base, &at, (size_t)(n * 2 * l->latent) * sizeof *s->zp);
    s->za = carve(base, &at, (size_t)n * sizeof *s->za);
    s->h = carve(base, &at, (size_t)(pairs * 2 * l->inter) * sizeof *s->h);
    s->ha = carve(base, &at, (size_t)pairs * sizeof *s->ha);
    s->y = carve(base, &at, (size_t)(pairs * l->latent) * sizeof *s->y);
    s->norm = carve(base, &at, (size_t)l->latent * sizeof *s->norm);
    s->tb = carve(base, &at, (size_t)threads * sizeof *s->tb);
    for (int i = 0; i < threads; i++) {
        struct thread_buf tb;
        tb.tiles = carve(base, &at, sizeof *tb.tiles);
        tb.v = carve(base, &at, (size_t)dim * sizeof *tb.v);
        tb.q = carve(base, &at, (size_t)dim);
        tb.s = carve(base, &at, (size_t)dim / 16);
        if (base) s->tb[i] = tb;
    }
    return at;
}

/* Sorts the pairs of the chunk's n tokens by expert (ids outside the layer are skipped) and
 * cuts each expert's into groups; returns the number of groups. */
static int64_t sort_pairs(struct step *s, const int32_t *ids, int64_t n, int64_t *n_pairs) {
    const int64_t E = s->l->n_experts, pairs = n * s->k;
    int32_t *count = s->count;
    memset(count, 0, (size_t)(E + 1) * sizeof *count);
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < E) count[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e]; /* count[e]: first slot of e */
    *n_pairs = count[E];
    int64_t n_groups = 0;
    for (int64_t e = 0; e < E; e++)
        for (int32_t p = count[e]; p < count[e + 1]; p += TRELLIS_GROUP)
            s->groups[n_groups++] = (struct group){(int32_t)e, p,
                                                   count[e + 1] - p < TRELLIS_GROUP
                                                       ? count[e + 1] - p : TRELLIS_GROUP};
    for (int64_t i = 0; i < pairs; i++) {
        const int valid = ids[i] >= 0 && ids[i] < E;
        s->slot[i] = valid ? count[ids[i]]++ : -1;
        if (valid) s->pair[s->slot[i]] = (int32_t)i;
    }
    return n_groups;
}

/* v[n] (F32, rotated; overwritten) -> xp, the laid-out values the matmul multiplies; returns
 * the scale that multiplies every product (§7: the token scale a, or t). */
static float activation_operands(const struct trellis_codec *c, struct thread_buf *tb, float *v,
                                 int64_t n, float *xp) {
    float scale = 1.0f;
    if (c->serving && c->id != TMX_TRELLIS_CODEC_FP4) { /* E4M3 per token */
        scale = tmx_trellis_act_e4m3(v, n, tb->q);
        for (int64_t i = 0; i < n; i++) v[i] = tmx_e4m3_to_f32(tb->q[i]);
    } else if (c->serving) {
        scale = tmx_trellis_act_nvfp4(v, n, tb->q, tb->s);
        for (int64_t i = 0; i < n; i++) /* e4m3(s_b) * e2m1(q): exact */
            v[i] = tmx_e4m3_to_f32(tb->s[i / 16]) *
                   tmx_trellis_e2m1_to_f32(tb->q[i / 2] >> (4 * (i & 1)) & 0xf);
    }
    trellis_operands_lay(v, n, xp);
    return scale;
}

/* --- the phases ------------------------------------------------------------------------------ */

static void phase_input(void *arg, int64_t t, int thread) {
    const struct step *s = arg;
    const int64_t latent = s->l->latent;
    struct thread_buf *tb = &s->tb[thread];
    memcpy(tb->v, s->z + t * latent, (size_t)latent * sizeof *tb->v);
    tmx_trellis_rotate(s->l->sign_in, tb->v, latent);
    s->za[t] = activation_operands(s->c, tb, tb->v, latent, s->zp + t * 2 * latent);
}

/* Rows [r0, r0 + ROWS_PER_ITEM) of matrix p for one group's tokens. */
static void group_rows(const struct step *s, int64_t item, int p, int thread) {
    const struct trellis_layer *l = s->l;
    const int64_t rows = p < 2 ? l->inter : l->latent, chunks = rows / ROWS_PER_ITEM;
    const struct group *g = &s->groups[item / chunks];
    const int64_t r0 = item % chunks * ROWS_PER_ITEM;
    const float *x[TRELLIS_GROUP];
    float xs[TRELLIS_GROUP], *y[TRELLIS_GROUP], *y2[TRELLIS_GROUP];
    for (int i = 0; i < g->count; i++) {
        const int64_t pr = g->first + i, t = s->pair[pr] / s->k;
        if (p < 2) { /* gate and up read z' of the token, write g' and u' of the pair */
            x[i] = s->zp + t * 2 * l->latent;
            xs[i] = s->za[t];
            y[i] = s->h + pr * 2 * l->inter;
            y2[i] = y[i] + l->inter;
        } else {     /* down reads m' of the pair, writes y' */
            x[i] = s->h + pr * 2 * l->inter;
            xs[i] = s->ha[pr];
            y[i] = s->y + pr * l->latent;
        }
    }
    const struct tmx_trellis_matrix *m = &l->mat[g->expert * 3];
    struct trellis_tiles_scratch *ts = s->tb[thread].tiles;
    if (p < 2) {
        trellis_rows_mul(&m[0], r0, r0 + ROWS_PER_ITEM, g->count, x, xs, y, ts);
        trellis_rows_mul(&m[1], r0, r0 + ROWS_PER_ITEM, g->count, x, xs, y2, ts);
    } else {
        trellis_rows_mul(&m[2], r0, r0 + ROWS_PER_ITEM, g->count, x, xs, y, ts);
    }
}

static void phase_gate_up(void *arg, int64_t item, int thread) {
    group_rows(arg, item, 0, thread);
}

static void phase_mid(void *arg, int64_t pr, int thread) {
    const struct step *s = arg;
    const int64_t inter = s->l->inter;
    float *g = s->h + pr * 2 * inter, *u = g + inter, *m = s->tb[thread].v;
    tmx_trellis_unrotate(s->l->sign_mid, g, inter);
    tmx_trellis_unrotate(s->l->sign_mid, u, inter);
    for (int64_t i = 0; i < inter; i++) m[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    tmx_trellis_rotate(s->l->sign_mid, m, inter);
    s->ha[pr] = activation_operands(s->c, &s->tb[thread], m, inter, g); /* g, u: done */
}

static void phase_down(void *arg, int64_t item, int thread) {
    group_rows(arg, item, 2, thread);
}

/* moe_experts_partial: each pair's y' unrotated into its own row. */
static void phase_pairs(void *arg, int64_t t, int thread) {
    (void)thread;
    const struct step *s = arg;
    const int64_t latent = s->l->latent;
    for (int64_t j = 0; j < s->k; j++) {
        const int32_t pr = s->slot[t * s->k + j];
        float *o = s->out + (t * s->k + j) * latent;
        if (pr < 0) {
            memset(o, 0, (size_t)latent * sizeof *o);
            continue;
        }
        memcpy(o, s->y + (int64_t)pr * latent, (size_t)latent * sizeof *o);
        tmx_trellis_unrotate(s->l->sign_out, o, latent);
    }
}

static void phase_output(void *arg, int64_t t, int thread) {
    (void)thread;
    const struct step *s = arg;
    const int64_t latent = s->l->latent;
    float *o = s->out + t * latent;
    memset(o, 0, (size_t)latent * sizeof *o);
    for (int64_t j = 0; j < s->k; j++) {
        const int32_t pr = s->slot[t * s->k + j];
        if (pr < 0) continue;
        const float *y = s->y + (int64_t)pr * latent;
        float w = s->weights[t * s->k + j];
        if (s->post) { /* rms(y') = rms(y): H is orthonormal */
            double ss = 0.0;
            for (int64_t i = 0; i < latent; i++) ss += (double)y[i] * y[i];
            w /= sqrtf((float)(ss / (double)latent) + s->eps);
        }
        for (int64_t i = 0; i < latent; i++) o[i] += w * y[i];
    }
    tmx_trellis_unrotate(s->l->sign_out, o, latent);
    if (s->post)
        for (int64_t i = 0; i < latent; i++) o[i] *= s->post[i];
}

/* --- the ops --------------------------------------------------------------------------------- */

/* The post-expert norm weight as F32: its own data, or `buf` filled. */
static const float *norm_f32(const struct tmx_tensor *t, float *buf) {
    if (t->dtype == TMX_DTYPE_F32) return t->data;
    const uint16_t *h = t->data;
    for (int64_t i = 0; i < t->shape[0]; i++)
        buf[i] = t->dtype == TMX_DTYPE_BF16 ? tmx_bf16_to_f32(h[i]) : tmx_f16_to_f32(h[i]);
    return buf;
}

/* Both ops; partial (moe_experts_partial: weights and post_norm NULL) writes out[n][k][latent]
 * of unweighted pair outputs. */
static enum tmx_status run_experts(struct trellis_codec *c, const struct trellis_layer *l,
                                   float *out, const float *z, const int32_t *ids,
                                   const float *weights, int n, int k,
                                   const struct tmx_tensor *post_norm, float eps, int partial,
                                   char **err) {
    const char *name = c->spec->name;
    if (n < 0 || k < 1)
        return c->host->err(err, TMX_ERR_INVALID, "codec.%s: %s: %d tokens, top %d", name,
                            partial ? "moe_experts_partial" : "moe_experts", n, k);
    if (post_norm && (post_norm->ndim != 1 || post_norm->shape[0] != l->latent ||
                      (post_norm->dtype != TMX_DTYPE_F32 && post_norm->dtype != TMX_DTYPE_BF16 &&
                       post_norm->dtype != TMX_DTYPE_F16)))
        return c->host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d: the post-expert norm "
                            "must be F32, BF16 or F16 [%d]", name, l->layer, l->latent);
    if (n == 0) return TMX_OK;

    /* Tokens go in chunks whose buffers fit the budget (at least one token a chunk); the
     * chunking depends on n alone, and no token's arithmetic depends on its chunk. */
    const int threads = c->threads.n_threads;
    struct step s = {.c = c, .l = l, .k = k, .eps = eps};
    const size_t base = step_layout(&s, NULL, 0, threads),
                 per_token = step_layout(&s, NULL, 1, threads) - base;
    int64_t chunk = c->budget > base + per_token ? (c->budget - base) / per_token : 1;
    if (chunk > n) chunk = n;
    const size_t need = step_layout(&s, NULL, chunk, threads);
    if (need > c->scratch_size) {
        free(c->scratch);
        c->scratch_size = 0;
        if (!(c->scratch = aligned_alloc(64, need)))
            return c->host->err(err, TMX_ERR_NOMEM, "codec.%s: out of memory for %zu bytes of "
                                "expert buffers", name, need);
        c->scratch_size = need;
    }
    step_layout(&s, c->scratch, chunk, threads);
    s.post = post_norm ? norm_f32(post_norm, s.norm) : NULL;

    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        const int64_t nt = n - t0 < chunk ? n - t0 : chunk;
        s.z = z + t0 * l->latent;
        s.out = out + t0 * (partial ? k : 1) * l->latent;
        s.weights = partial ? NULL : weights + t0 * k;
        int64_t n_pairs;
        const int64_t n_groups = sort_pairs(&s, ids + t0 * k, nt, &n_pairs);
        const struct tmx_threads *th = &c->threads;
        th->run(th->pool, nt, phase_input, &s);
        th->run(th->pool, n_groups * (l->inter / ROWS_PER_ITEM), phase_gate_up, &s);
        th->run(th->pool, n_pairs, phase_mid, &s);
        th->run(th->pool, n_groups * (l->latent / ROWS_PER_ITEM), phase_down, &s);
        th->run(th->pool, nt, partial ? phase_pairs : phase_output, &s);
    }
    return TMX_OK;
}

enum tmx_status tmx_trellis_codec_moe_experts(void *ctx, void *layer, float *out, const float *z,
                                              const int32_t *ids, const float *weights, int n,
                                              int k, const struct tmx_tensor *post_norm,
                                              float eps, char **err) {
    return run_experts(ctx, layer, out, z, ids, weights, n, k, post_norm, eps, 0, err);
}

enum tmx_status tmx_trellis_codec_moe_experts_partial(void *ctx, void *layer, float *ye,
                                                      const float *z, const int32_t *ids, int n,
                                                      int k, char **err) {
    return run_experts(ctx, layer, ye, z, ids, NULL, n, k, NULL, 0.0f, 1, err);
}

enum tmx_status tmx_trellis_codec_expert_decode(void *ctx, void *layer, int expert, int proj,
                                                float *w, char **err) {
    const struct trellis_codec *c = ctx;
    const struct trellis_layer *l = layer;
    if (expert < 0 || expert >= l->n_experts || proj < 0 || proj > 2)
        return c->host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d has no expert %d "
                            "projection %d", c->spec->name, l->layer, expert, proj);
    tmx_trellis_matrix_dequant(&l->mat[expert * 3 + proj], w);
    return TMX_OK;
}
