/* forward.c: the paged KV cache, sequences, and the forward step (docs/model.md).
 *
 * A step runs the graph once over the new tokens of several sequences, concatenated: every op
 * sees n token rows, and only attention needs to know which sequence a row belongs to (seq[t]
 * and the block tables). Plugins add speed behind the ops and never control flow: everything a
 * step does is in forward_step below, top to bottom.
 *
 * Cache layout. Layers of one attention kind form a group that shares block ids: block b of a
 * full-attention layer and block b of every other full-attention layer hold the same positions
 * of the same sequence. Group 0 holds the full-attention layers, group 1 the sliding-window
 * ones, whose sequences give blocks back once every position in them has left the window. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

enum { FULL = 0, SLIDING = 1, N_GROUPS = 2 };

struct group {
    struct tmx_kv_pool *pool; /* NULL: the model has no layers of this kind */
    int window;               /* positions a query sees; 0: all */
    int32_t *slot;            /* device [n_batch] cache row of each token of the step */
    int32_t *tables;          /* device [max_seqs][max_blocks] block tables of the step */
    int32_t *slot_host, *tables_host;
};

struct kv_state {
    struct tmx_kv_options opt;
    int max_blocks;              /* table entries of a sequence: ceil(n_ctx / block_size) */
    struct group g[N_GROUPS];
    struct tmx_kv_cache *cache;  /* [n_layers] */
    /* the step's device buffers, n_batch token rows each */
    int32_t *tok, *pos, *seq;    /* [B] */
    int32_t *rows;               /* [max_seqs] rows whose logits the step reads */
    float *h, *x, *o;            /* [B][hidden] residual stream, normed input, block output */
    float *q, *att;              /* [B][n_heads*head_dim] */
    float *kk, *vv;              /* [B][n_kv_heads*head_dim] */
    float *f1, *f2;              /* [B][max(intermediate, shared width)] */
    float *rl, *rw;              /* [B][n_experts] router logits, [B][top_k] routing weights */
    int32_t *rid;                /* [B][top_k] routed expert ids */
    float *z, *y;                /* [B][moe_latent] */
    float *hn, *logits;          /* [max_seqs][hidden], [max_seqs][vocab_size] */
    int32_t *pos_host, *seq_host, *rows_host; /* [B], [B], [B] */
    void **graphs;               /* [max_seqs + 1] decode step of n sequences, recorded once */
};

struct tmx_seq {
    struct tmx_model *m;
    int n_ctx, n_past;
    int32_t *tokens;             /* [n_ctx] every token in the cache */
    int32_t *table[N_GROUPS];    /* [max_blocks] block ids, -1: none */
    uint64_t *hash;              /* [max_blocks] chained hash of each full block */
    int n_hashed;                /* full blocks hashed (and published) so far */
};

static int div_up(int a, int b) { return (a + b - 1) / b; }

/* --- the cache ----------------------------------------------------------------------------- */

static enum tmx_status dev_alloc(struct tmx_model *m, void *pp, size_t nbytes, char **err) {
    const struct tmx_kernels *k = m->k;
    enum tmx_status st = k->ops->buf_alloc(k->ctx, nbytes ? nbytes : 1, (void **)pp);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s: cannot allocate %zu bytes for the KV cache and "
                       "step buffers (config keys kv_tokens, kv_dtype, batch)", k->plugin->name,
                       nbytes);
    return TMX_OK;
}

static void dev_free(struct tmx_model *m, void *p) {
    if (p) m->k->ops->buf_free(m->k->ctx, p);
}

/* Blocks of each pool: the full pool holds n_tokens positions; a sliding layer needs at most
 * window - 1 + n_batch positions of a sequence at once (+1 block for alignment), and gets twice
 * that per sequence so that recently released blocks stay around for prefix hits. */
static int pool_blocks(const struct tmx_kv_options *o, int g, int window) {
    const int full = div_up(o->n_tokens, o->block_size);
    if (g == FULL) return full;
    const int per_seq = div_up(window - 1 + o->n_batch, o->block_size) + 1;
    const int64_t want = 2 * (int64_t)o->max_seqs * per_seq;
    return want < full ? (int)want : full;
}

static enum tmx_status cache_init(struct tmx_model *m, struct kv_state *kv, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kv_options *o = &kv->opt;
    const int scaled = o->dtype == TMX_DTYPE_F8_E4M3 || o->dtype == TMX_DTYPE_I8;
    enum tmx_status st = TMX_OK;
    for (int l = 0; st == TMX_OK && l < c->n_layers; l++) {
        const int g = c->sliding[l] ? SLIDING : FULL;
        struct tmx_kv_cache *kc = &kv->cache[l];
        *kc = (struct tmx_kv_cache){.dtype = o->dtype,
                                    .n_blocks = tmx_kv_pool_n_blocks(kv->g[g].pool),
                                    .block_size = o->block_size, .hkv = c->n_kv_heads,
                                    .hd = c->head_dim};
        const size_t rows = (size_t)kc->n_blocks * o->block_size * c->n_kv_heads;
        const size_t nb = rows * c->head_dim * tmx_dtype_size(o->dtype);
        if ((st = dev_alloc(m, &kc->k, nb, err)) == TMX_OK) st = dev_alloc(m, &kc->v, nb, err);
        if (st == TMX_OK && scaled && (st = dev_alloc(m, &kc->k_scale, rows * 4, err)) == TMX_OK)
            st = dev_alloc(m, &kc->v_scale, rows * 4, err);
    }
    return st;
}

static enum tmx_status step_buffers_init(struct tmx_model *m, struct kv_state *kv, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const size_t B = (size_t)kv->opt.n_batch, S = (size_t)kv->opt.max_seqs, F = sizeof(float);
    const size_t D = (size_t)c->hidden, V = (size_t)c->vocab_size;
    const size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    size_t ffn = (size_t)c->intermediate_size;
    if ((size_t)c->n_shared_experts * c->moe_intermediate_size > ffn)
        ffn = (size_t)c->n_shared_experts * c->moe_intermediate_size;
    const size_t E = (size_t)c->n_routed_experts, K = (size_t)c->n_experts_per_tok,
                 lat = (size_t)c->moe_latent_size, T = S * (size_t)kv->max_blocks * 4;
    struct {
        void *pp;
        size_t nbytes;
    } bufs[] = {
        {&kv->tok, B * 4},     {&kv->pos, B * 4},       {&kv->seq, B * 4},
        {&kv->rows, B * 4},    {&kv->h, B * D * F},     {&kv->x, B * D * F},
        {&kv->o, B * D * F},   {&kv->q, B * qd * F},    {&kv->att, B * qd * F},
        {&kv->kk, B * kvd * F}, {&kv->vv, B * kvd * F}, {&kv->f1, B * ffn * F},
        {&kv->f2, B * ffn * F}, {&kv->rl, B * E * F},   {&kv->rw, B * K * F},
        {&kv->rid, B * K * 4}, {&kv->z, B * lat * F},   {&kv->y, B * lat * F},
        {&kv->hn, S * D * F},  {&kv->logits, S * V * F},
        {&kv->g[FULL].slot, B * 4}, {&kv->g[FULL].tables, T},
        {&kv->g[SLIDING].slot, B * 4}, {&kv->g[SLIDING].tables, T},
    };
    enum tmx_status st = TMX_OK;
    for (size_t i = 0; st == TMX_OK && i < sizeof bufs / sizeof bufs[0]; i++)
        st = dev_alloc(m, bufs[i].pp, bufs[i].nbytes, err);
    kv->pos_host = malloc(B * 4);
    kv->seq_host = malloc(B * 4);
    kv->rows_host = malloc(B * 4);
    for (int g = 0; g < N_GROUPS; g++) {
        kv->g[g].slot_host = malloc(B * 4);
        kv->g[g].tables_host = malloc(T);
    }
    if (st == TMX_OK && (!kv->pos_host || !kv->seq_host || !kv->rows_host ||
                         !kv->g[0].slot_host || !kv->g[0].tables_host ||
                         !kv->g[1].slot_host || !kv->g[1].tables_host))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    return st;
}

/* Decode steps are recorded once per batch size and replayed when the kernel set can record
 * them and no layer needs the host between ops (a codec without a device path). */
static int graphs_usable(const struct tmx_model *m) {
    const struct tmx_kernels_i *op = m->k->ops;
    if (!TMX_OPS_HAS(op, graph_begin) || !TMX_OPS_HAS(op, graph_end) ||
        !TMX_OPS_HAS(op, graph_launch) || !TMX_OPS_HAS(op, graph_free))
        return 0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].codec_layer && !m->layers[l].codec_dev) return 0;
    return 1;
}

enum tmx_status tmx_model_kv_init(struct tmx_model *m, const struct tmx_kv_options *opts,
                                  char **err) {
    const struct tmx_model_config *c = &m->cfg;
    if (m->kv) return tmx_err(err, TMX_ERR_INVALID, "the KV cache is already set up");
    struct tmx_kv_options o = *opts;
    if (o.n_ctx < 1 || o.n_batch < 1 || o.max_seqs < 1 || o.block_size < 1)
        return tmx_err(err, TMX_ERR_INVALID, "KV cache: context (%d), batch (%d), sequences "
                       "(%d) and block size (%d) must be positive", o.n_ctx, o.n_batch,
                       o.max_seqs, o.block_size);
    if (tmx_kv_dtype_name(o.dtype)[0] == '?')
        return tmx_err(err, TMX_ERR_INVALID, "KV cache: dtype %s is not f32, bf16, fp8 or int8",
                       tmx_dtype_name(o.dtype));
    if (o.n_batch > o.n_ctx) o.n_batch = o.n_ctx;
    if (o.max_seqs > o.n_batch) o.max_seqs = o.n_batch;
    if (o.n_tokens == 0) o.n_tokens = (int)(o.n_ctx * (int64_t)o.max_seqs < (1 << 30)
                                            ? o.n_ctx * o.max_seqs : 1 << 30);
    if (o.n_tokens < o.n_ctx) /* one full-length sequence must fit */
        return tmx_err(err, TMX_ERR_INVALID, "kv_tokens: %d positions cannot hold one sequence "
                       "of the context, %d", o.n_tokens, o.n_ctx);
    struct kv_state *kv = calloc(1, sizeof *kv);
    if (!kv) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    m->kv = kv;
    kv->opt = o;
    kv->max_blocks = div_up(o.n_ctx, o.block_size);
    kv->g[SLIDING].window = c->sliding_window;
    kv->cache = calloc((size_t)c->n_layers, sizeof *kv->cache);
    enum tmx_status st = kv->cache ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int g = 0; st == TMX_OK && g < N_GROUPS; g++) {
        int used = 0;
        for (int l = 0; l < c->n_layers; l++) used |= (c->sliding[l] ? SLIDING : FULL) == g;
        if (used)
            st = tmx_kv_pool_new(pool_blocks(&o, g, kv->g[g].window), o.block_size,
                                 &kv->g[g].pool, err);
    }
    if (st == TMX_OK) st = cache_init(m, kv, err);
    if (st == TMX_OK) st = step_buffers_init(m, kv, err);
    if (st == TMX_OK && o.graphs && graphs_usable(m)) {
        kv->graphs = calloc((size_t)o.max_seqs + 1, sizeof *kv->graphs);
        if (!kv->graphs) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    if (st != TMX_OK) tmx_model_kv_free(m);
    return st;
}

void tmx_model_kv_free(struct tmx_model *m) {
    struct kv_state *kv = m->kv;
    if (!kv) return;
    for (int l = 0; kv->cache && l < m->cfg.n_layers; l++) {
        dev_free(m, kv->cache[l].k);
        dev_free(m, kv->cache[l].v);
        dev_free(m, kv->cache[l].k_scale);
        dev_free(m, kv->cache[l].v_scale);
    }
    for (int i = 0; kv->graphs && i <= kv->opt.max_seqs; i++)
        if (kv->graphs[i]) m->k->ops->graph_free(m->k->ctx, kv->graphs[i]);
    free(kv->graphs);
    void *bufs[] = {kv->tok, kv->pos, kv->seq, kv->rows, kv->h, kv->x, kv->o, kv->q, kv->att,
                    kv->kk, kv->vv, kv->f1, kv->f2, kv->rl, kv->rw, kv->rid, kv->z, kv->y,
                    kv->hn, kv->logits, kv->g[0].slot, kv->g[0].tables, kv->g[1].slot,
                    kv->g[1].tables};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dev_free(m, bufs[i]);
    for (int g = 0; g < N_GROUPS; g++) {
        tmx_kv_pool_free(kv->g[g].pool);
        free(kv->g[g].slot_host);
        free(kv->g[g].tables_host);
    }
    free(kv->pos_host);
    free(kv->seq_host);
    free(kv->rows_host);
    free(kv->cache);
    free(kv);
    m->kv = NULL;
}

void tmx_model_kv_usage(const struct tmx_model *m, struct tmx_kv_usage *u) {
    memset(u, 0, sizeof *u);
    if (!m->kv) return;
    const struct tmx_kv_pool *f = m->kv->g[FULL].pool, *s = m->kv->g[SLIDING].pool;
    u->block_size = m->kv->opt.block_size;
    if (f) {
        u->full_total = tmx_kv_pool_n_blocks(f);
        u->full_used = u->full_total - tmx_kv_pool_n_free(f);
    }
    if (s) {
        u->sliding_total = tmx_kv_pool_n_blocks(s);
        u->sliding_used = u->sliding_total - tmx_kv_pool_n_free(s);
    }
}

enum tmx_status tmx_model_set_capture(struct tmx_model *m, tmx_capture_fn fn, void *arg,
                                      char **err) {
    if (fn && !(m->k->plugin->caps & TMX_CAP_HOST_MEMORY))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "kernel set %s: its buffers are not host "
                       "memory, so a forward pass cannot be captured", m->k->plugin->name);
    m->capture = fn;
    m->capture_arg = arg;
    return TMX_OK;
}

/* --- sequences ----------------------------------------------------------------------------- */

enum tmx_status tmx_seq_new(struct tmx_model *m, int n_ctx, struct tmx_seq **out, char **err) {
    const struct kv_state *kv = m->kv;
    if (!kv) return tmx_err(err, TMX_ERR_INVALID, "sequence: the model has no KV cache yet");
    if (n_ctx < 1 || n_ctx > kv->opt.n_ctx)
        return tmx_err(err, TMX_ERR_INVALID, "sequence: context %d outside [1, %d]", n_ctx,
                       kv->opt.n_ctx);
    struct tmx_seq *s = calloc(1, sizeof *s);
    if (!s) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    s->m = m;
    s->n_ctx = n_ctx;
    const size_t mb = (size_t)kv->max_blocks;
    s->tokens = malloc((size_t)n_ctx * sizeof *s->tokens);
    s->hash = malloc(mb * sizeof *s->hash);
    for (int g = 0; g < N_GROUPS; g++) s->table[g] = malloc(mb * sizeof *s->table[g]);
    if (!s->tokens || !s->hash || !s->table[0] || !s->table[1]) {
        tmx_seq_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    for (int g = 0; g < N_GROUPS; g++)
        for (size_t i = 0; i < mb; i++) s->table[g][i] = -1;
    *out = s;
    return TMX_OK;
}

void tmx_seq_reset(struct tmx_seq *s) {
    const struct kv_state *kv = s->m->kv;
    for (int g = 0; g < N_GROUPS; g++)
        for (int i = 0; i < kv->max_blocks; i++)
            if (s->table[g][i] >= 0) {
                tmx_kv_pool_release(kv->g[g].pool, s->table[g][i]);
                s->table[g][i] = -1;
            }
    s->n_past = 0;
    s->n_hashed = 0;
}

void tmx_seq_free(struct tmx_seq *s) {
    if (!s) return;
    if (s->table[0] && s->table[1]) tmx_seq_reset(s);
    free(s->tokens);
    free(s->hash);
    free(s->table[0]);
    free(s->table[1]);
    free(s);
}

int tmx_seq_n_past(const struct tmx_seq *s) { return s->n_past; }

/* Gives back the sliding blocks no query from position s->n_past on can see. */
static void slide(struct tmx_seq *s) {
    const struct group *gr = &s->m->kv->g[SLIDING];
    const int bs = s->m->kv->opt.block_size;
    if (!gr->pool || gr->window <= 0) return;
    const int first_seen = s->n_past - gr->window + 1; /* oldest position still visible */
    for (int i = 0; (i + 1) * bs <= first_seen; i++)
        if (s->table[SLIDING][i] >= 0) {
            tmx_kv_pool_release(gr->pool, s->table[SLIDING][i]);
            s->table[SLIDING][i] = -1;
        }
}

/* Hashes and publishes the sequence's newly completed blocks. */
static void publish(struct tmx_seq *s) {
    const struct kv_state *kv = s->m->kv;
    const int bs = kv->opt.block_size;
    for (; (s->n_hashed + 1) * bs <= s->n_past; s->n_hashed++) {
        const int i = s->n_hashed;
        const uint64_t parent = i ? s->hash[i - 1] : 0;
        const int32_t *t = s->tokens + (size_t)i * bs;
        s->hash[i] = tmx_kv_block_hash(parent, t, bs);
        for (int g = 0; kv->opt.prefix_cache && g < N_GROUPS; g++)
            if (s->table[g][i] >= 0) tmx_kv_pool_publish(kv->g[g].pool, s->table[g][i],
                                                          s->hash[i], parent, t);
    }
}

/* First table entry a sequence at n_past holds in group g. */
static int first_block(const struct kv_state *kv, int g, int n_past) {
    const int w = kv->g[g].window, lo = n_past - w + 1;
    return w > 0 && lo > 0 ? lo / kv->opt.block_size : 0;
}

int tmx_seq_prefix(struct tmx_seq *s, const int32_t *tokens, int n) {
    struct kv_state *kv = s->m->kv;
    const int bs = kv->opt.block_size;
    if (!kv->opt.prefix_cache || s->n_past > 0 || n > s->n_ctx) return 0;
    /* Candidate blocks: full ones that leave at least the last token to compute. */
    const int max_c = (n - 1) / bs;
    int c = 0;
    for (uint64_t parent = 0; c < max_c; c++) { /* group FULL decides how far the chain goes */
        s->hash[c] = tmx_kv_block_hash(parent, tokens + (size_t)c * bs, bs);
        if (kv->g[FULL].pool) {
            const int b = tmx_kv_pool_lookup(kv->g[FULL].pool, s->hash[c], parent,
                                             tokens + (size_t)c * bs);
            if (b < 0) break;
            s->table[FULL][c] = b;
        }
        parent = s->hash[c];
    }
    /* The sliding group must hold the window before position c * bs: shrink c until it does. */
    struct tmx_kv_pool *sp = kv->g[SLIDING].pool;
    for (; sp && c > 0; c--) {
        const int lo = first_block(kv, SLIDING, c * bs);
        int i = lo;
        for (; i < c; i++) {
            const int b = tmx_kv_pool_lookup(sp, s->hash[i], i ? s->hash[i - 1] : 0,
                                             tokens + (size_t)i * bs);
            if (b < 0) break;
            s->table[SLIDING][i] = b;
        }
        if (i == c) break;
        for (int j = lo; j < i; j++) {
            tmx_kv_pool_release(sp, s->table[SLIDING][j]);
            s->table[SLIDING][j] = -1;
        }
        if (kv->g[FULL].pool) {
            tmx_kv_pool_release(kv->g[FULL].pool, s->table[FULL][c - 1]);
            s->table[FULL][c - 1] = -1;
        }
    }
    memcpy(s->tokens, tokens, (size_t)c * bs * sizeof *tokens);
    s->n_past = c * bs;
    s->n_hashed = c;
    return s->n_past;
}

enum tmx_status tmx_seq_reserve(struct tmx_seq *s, int n, char **err) {
    struct kv_state *kv = s->m->kv;
    const int bs = kv->opt.block_size;
    if (n < 0 || s->n_past + n > s->n_ctx)
        return tmx_err(err, TMX_ERR_INVALID, "context full: %d tokens in the sequence + %d new "
                       "> context %d", s->n_past, n, s->n_ctx);
    if (n == 0) return TMX_OK;
    slide(s);
    const int last = (s->n_past + n - 1) / bs;
    int need[N_GROUPS] = {0, 0};
    for (int g = 0; g < N_GROUPS; g++) {
        if (!kv->g[g].pool) continue;
        for (int i = first_block(kv, g, s->n_past); i <= last; i++) need[g] += s->table[g][i] < 0;
        if (need[g] > tmx_kv_pool_n_free(kv->g[g].pool))
            return tmx_err(err, TMX_ERR_BUSY, "KV cache full: %d more %s blocks needed, %d free "
                           "of %d (config key kv_tokens)", need[g],
                           g == FULL ? "full-attention" : "sliding-window",
                           tmx_kv_pool_n_free(kv->g[g].pool), tmx_kv_pool_n_blocks(kv->g[g].pool));
    }
    for (int g = 0; g < N_GROUPS; g++)
        for (int i = first_block(kv, g, s->n_past); need[g] && i <= last; i++)
            if (s->table[g][i] < 0) s->table[g][i] = tmx_kv_pool_alloc(kv->g[g].pool);
    return TMX_OK;
}

/* --- the forward pass ---------------------------------------------------------------------- */

static const struct tmx_tensor *opt(const struct tmx_tensor *t) { return t->data ? t : NULL; }

/* The routed experts of layer l: dense experts through the kernel set, or the codec's, on the
 * device or on host memory. */
static enum tmx_status experts(struct tmx_model *m, const struct layer *ly, int n, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const float eps = (float)c->rms_norm_eps;
    if (!ly->codec_layer) {
        op->moe_experts(kc, kv->y, kv->z, kv->rid, kv->rw, n, c->n_experts_per_tok, &ly->moe);
        return TMX_OK;
    }
    if (ly->codec_dev) {
        void *stream = TMX_OPS_HAS(op, native_stream) ? op->native_stream(kc) : NULL;
        return m->codec_ops->device_moe_experts(m->codec_ctx, ly->codec_dev, stream, kv->y,
                                                kv->z, kv->rid, kv->rw, n,
                                                c->n_experts_per_tok, opt(&ly->post_norm), eps,
                                                err);
    }
    /* the codec's host path reads the buffers: finish the queued ops first */
    enum tmx_status st = op->sync(kc);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s failed during the forward pass",
                       m->k->plugin->name);
    return m->codec_ops->moe_experts(m->codec_ctx, ly->codec_layer, kv->y, kv->z, kv->rid,
                                     kv->rw, n, c->n_experts_per_tok, opt(&ly->post_norm), eps,
                                     err);
}

/* One step over n tokens already in kv->tok, pos, seq and the groups' slots and tables, from
 * n_seqs sequences. Leaves the final hidden states (before the final norm) in kv->h. */
static enum tmx_status forward_step(struct tmx_model *m, int n, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int D = c->hidden, hq = c->n_heads, hkv = c->n_kv_heads, hd = c->head_dim;
    const float eps = (float)c->rms_norm_eps, scale = 1.0f / sqrtf((float)hd);

    op->embed(kc, kv->h, &m->embed, kv->tok, n);
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer *ly = &m->layers[l];
        const struct group *gr = &kv->g[c->sliding[l] ? SLIDING : FULL];

        /* attention */
        op->rmsnorm(kc, kv->x, kv->h, &ly->attn_norm, n, D, eps);
        op->matmul(kc, kv->q, kv->x, &ly->wq, n);
        op->matmul(kc, kv->kk, kv->x, &ly->wk, n);
        op->matmul(kc, kv->vv, kv->x, &ly->wv, n);
        if (ly->q_norm.data) op->rmsnorm(kc, kv->q, kv->q, &ly->q_norm, n * hq, hd, eps);
        if (ly->k_norm.data) op->rmsnorm(kc, kv->kk, kv->kk, &ly->k_norm, n * hkv, hd, eps);
        const float *freqs = c->sliding[l] ? m->inv_freq_local : m->inv_freq_full;
        op->rope(kc, kv->q, kv->pos, freqs, n, hq, hd);
        op->rope(kc, kv->kk, kv->pos, freqs, n, hkv, hd);
        op->kv_store(kc, &kv->cache[l], kv->kk, kv->vv, gr->slot, n);
        op->attention(kc, kv->att, kv->q, &kv->cache[l], gr->tables, kv->max_blocks, kv->seq,
                      kv->pos, n, hq, gr->window, scale);
        op->matmul(kc, kv->o, kv->att, &ly->wo, n);
        op->add_gated(kc, kv->h, kv->o, opt(&ly->attn_gate), n, D);

        /* MLP: dense SwiGLU, or routed experts behind the bridges */
        op->rmsnorm(kc, kv->x, kv->h, &ly->mlp_norm, n, D, eps);
        if (c->dense[l]) {
            const int64_t f = ly->gate.shape[0];
            op->matmul(kc, kv->f1, kv->x, &ly->gate, n);
            op->matmul(kc, kv->f2, kv->x, &ly->up, n);
            op->swiglu(kc, kv->f1, kv->f1, kv->f2, n * f);
            op->matmul(kc, kv->o, kv->f1, &ly->down, n);
        } else {
            op->matmul(kc, kv->rl, kv->x, &ly->router, n);
            op->moe_route(kc, kv->rid, kv->rw, kv->rl, opt(&ly->router_bias), n,
                          c->n_routed_experts, c->n_experts_per_tok, c->router_score,
                          c->norm_topk_prob, (float)c->routed_scaling_factor);
            op->matmul(kc, kv->z, kv->x, &ly->bridge_in, n);
            if (m->capture) { /* calibration: the buffers are host memory (set_capture) */
                const struct tmx_moe_capture cap = {l, n, c->n_experts_per_tok, kv->x, kv->z,
                                                    kv->rid, kv->rw};
                enum tmx_status st = op->sync(kc);
                if (st != TMX_OK)
                    return tmx_err(err, st, "kernel set %s failed during the forward pass",
                                   m->k->plugin->name);
                if ((st = m->capture(m->capture_arg, &cap, err)) != TMX_OK) return st;
            }
            enum tmx_status st = experts(m, ly, n, err);
            if (st != TMX_OK) return st;
            op->matmul(kc, kv->o, kv->y, &ly->bridge_out, n);
            if (ly->gate.data) { /* shared expert on the hidden state */
                const int64_t f = ly->gate.shape[0];
                op->matmul(kc, kv->f1, kv->x, &ly->gate, n);
                op->matmul(kc, kv->f2, kv->x, &ly->up, n);
                op->swiglu(kc, kv->f1, kv->f1, kv->f2, n * f);
                op->matmul(kc, kv->x, kv->f1, &ly->down, n);
                op->add_gated(kc, kv->o, kv->x, NULL, n, D);
            }
        }
        op->add_gated(kc, kv->h, kv->o, opt(&ly->mlp_gate), n, D);
    }
    return TMX_OK;
}

/* Logits of the r token rows of kv->h listed in kv->rows into kv->logits[r][vocab_size]. */
static void logits_rows(struct tmx_model *m, int r) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const struct tmx_tensor *head = c->tie_word_embeddings ? &m->embed : &m->lm_head;
    op->gather(kc, kv->hn, kv->h, kv->rows, r, c->hidden);
    op->rmsnorm(kc, kv->hn, kv->hn, &m->final_norm, r, c->hidden, (float)c->rms_norm_eps);
    op->matmul(kc, kv->logits, kv->hn, head, r);
}

/* The whole step on n tokens with logits of n_rows rows (rows_host), eagerly or, for a decode
 * step of n sequences, through the graph recorded for n. */
static enum tmx_status run_step(struct tmx_model *m, int n, int n_rows, int decode,
                                float *logits, char **err) {
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const size_t row = (size_t)m->cfg.vocab_size * sizeof(float);
    enum tmx_status st;
    if (decode && kv->graphs) {
        if ((st = op->buf_write(kc, kv->rows, kv->rows_host, (size_t)n * 4)) != TMX_OK) return st;
        if (!kv->graphs[n]) {
            if ((st = op->graph_begin(kc)) != TMX_OK) return st;
            st = forward_step(m, n, err);
            if (st == TMX_OK) logits_rows(m, n);
            enum tmx_status end = op->graph_end(kc, &kv->graphs[n]);
            if (st != TMX_OK) return st;
            if (end != TMX_OK) return end;
        }
        if ((st = op->graph_launch(kc, kv->graphs[n])) != TMX_OK) return st;
        return op->buf_read(kc, logits, kv->logits, (size_t)n * row);
    }
    if ((st = forward_step(m, n, err)) != TMX_OK) return st;
    for (int done = 0; done < n_rows; done += kv->opt.max_seqs) { /* max_seqs rows at a time */
        const int r = n_rows - done < kv->opt.max_seqs ? n_rows - done : kv->opt.max_seqs;
        st = op->buf_write(kc, kv->rows, kv->rows_host + done, (size_t)r * 4);
        if (st != TMX_OK) return st;
        logits_rows(m, r);
        st = op->buf_read(kc, logits + (size_t)done * m->cfg.vocab_size, kv->logits,
                          (size_t)r * row);
        if (st != TMX_OK) return st;
    }
    return TMX_OK;
}

/* tmx_model_step, with the logits of every token instead when all_rows. */
static enum tmx_status step(struct tmx_model *m, struct tmx_seq *const *seqs,
                            const int32_t *const *tokens, const int *n, int n_seqs, int all_rows,
                            float *logits, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int bs = kv->opt.block_size, mb = kv->max_blocks;
    if (n_seqs < 1 || n_seqs > kv->opt.max_seqs)
        return tmx_err(err, TMX_ERR_INVALID, "step: %d sequences outside [1, %d]", n_seqs,
                       kv->opt.max_seqs);
    int N = 0;
    for (int i = 0; i < n_seqs; i++) {
        const struct tmx_seq *s = seqs[i];
        if (n[i] < 1 || N + n[i] > kv->opt.n_batch)
            return tmx_err(err, TMX_ERR_INVALID, "step: %d tokens beyond the batch of %d",
                           N + n[i], kv->opt.n_batch);
        if (s->n_past + n[i] > s->n_ctx)
            return tmx_err(err, TMX_ERR_INVALID, "context full: %d tokens in the sequence + %d "
                           "new > context %d", s->n_past, n[i], s->n_ctx);
        for (int j = 0; j < n[i]; j++) {
            const int32_t t = tokens[i][j], p = s->n_past + j;
            if (t < 0 || t >= c->vocab_size)
                return tmx_err(err, TMX_ERR_INVALID, "token id %d out of range [0, %d)", t,
                               c->vocab_size);
            for (int g = 0; g < N_GROUPS; g++) {
                if (!kv->g[g].pool) continue;
                const int b = s->table[g][p / bs];
                if (b < 0)
                    return tmx_err(err, TMX_ERR_INVALID, "step: position %d has no KV block "
                                   "(tmx_seq_reserve first)", p);
                kv->g[g].slot_host[N + j] = b * bs + p % bs;
            }
            kv->pos_host[N + j] = p;
            kv->seq_host[N + j] = i;
        }
        for (int g = 0; g < N_GROUPS; g++)
            memcpy(kv->g[g].tables_host + (size_t)i * mb, s->table[g], (size_t)mb * 4);
        if (!all_rows) kv->rows_host[i] = N + n[i] - 1;
        N += n[i];
    }
    for (int j = 0; all_rows && j < N; j++) kv->rows_host[j] = j;

    enum tmx_status st = TMX_OK;
    for (int i = 0, at = 0; st == TMX_OK && i < n_seqs; at += n[i++])
        st = op->buf_write(kc, kv->tok + at, tokens[i], (size_t)n[i] * 4);
    if (st == TMX_OK) st = op->buf_write(kc, kv->pos, kv->pos_host, (size_t)N * 4);
    if (st == TMX_OK) st = op->buf_write(kc, kv->seq, kv->seq_host, (size_t)N * 4);
    for (int g = 0; st == TMX_OK && g < N_GROUPS; g++) {
        if (!kv->g[g].pool) continue;
        st = op->buf_write(kc, kv->g[g].slot, kv->g[g].slot_host, (size_t)N * 4);
        if (st == TMX_OK)
            st = op->buf_write(kc, kv->g[g].tables, kv->g[g].tables_host, (size_t)n_seqs * mb * 4);
    }
    if (st != TMX_OK) return tmx_err(err, st, "kernel set: cannot upload the step's tokens");
    char *ferr = NULL; /* set only by a failure that has its own message */
    st = run_step(m, N, all_rows ? N : n_seqs, N == n_seqs && !all_rows && !m->capture, logits,
                  &ferr);
    if (ferr) {
        if (err) *err = ferr;
        else free(ferr);
        return st;
    }
    if (st == TMX_OK) st = op->sync(kc);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s failed during the forward pass: %s",
                       m->k->plugin->name, tmx_status_str(st));
    for (int i = 0; i < n_seqs; i++) {
        struct tmx_seq *s = seqs[i];
        memcpy(s->tokens + s->n_past, tokens[i], (size_t)n[i] * sizeof *s->tokens);
        s->n_past += n[i];
        publish(s);
        slide(s);
    }
    return TMX_OK;
}

enum tmx_status tmx_model_step(struct tmx_model *m, struct tmx_seq *const *seqs,
                               const int32_t *const *tokens, const int *n, int n_seqs,
                               float *logits, char **err) {
    return step(m, seqs, tokens, n, n_seqs, 0, logits, err);
}

enum tmx_status tmx_seq_forward(struct tmx_seq *s, const int32_t *tokens, int n, float *logits,
                                int all_rows, char **err) {
    const struct kv_state *kv = s->m->kv;
    const int V = s->m->cfg.vocab_size;
    if (n < 1) return tmx_err(err, TMX_ERR_INVALID, "forward: no tokens");
    if (s->n_past + n > s->n_ctx)
        return tmx_err(err, TMX_ERR_INVALID, "context full: %d tokens in the sequence + %d new "
                       "> context %d", s->n_past, n, s->n_ctx);
    for (int done = 0; done < n;) {
        const int chunk = n - done < kv->opt.n_batch ? n - done : kv->opt.n_batch;
        enum tmx_status st = tmx_seq_reserve(s, chunk, err);
        if (st != TMX_OK) return st;
        const int32_t *t = tokens + done;
        float *dst = all_rows ? logits + (size_t)done * V : logits;
        if ((st = step(s->m, &s, &t, &chunk, 1, all_rows, dst, err)) != TMX_OK) return st;
        done += chunk;
    }
    return TMX_OK;
}
