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
 * ones, whose sequences give blocks back once every position in them has left the window.
 *
 * Tensor parallelism (docs/tp.md). Every rank runs forward_step on its slice of the weights
 * with the same tokens; the step's host arrays travel from rank 0 in one message, and the
 * ranks meet in one all-reduce after the embedding, after each attention block and after each
 * MLP, and in an all-gather of the logits. Block management stays on rank 0: the others only
 * ever see block tables. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "step-impl.h"
#include "tmx/log.h"

struct tmx_seq {
    struct tmx_model *m;
    int n_ctx, n_past;
    int32_t *tokens;             /* [n_ctx] every token in the cache */
    int32_t *table[N_GROUPS];    /* [max_blocks] block ids, -1: none */
    uint64_t *hash;              /* [max_blocks] chained hash of each full block */
    int n_hashed;                /* full blocks hashed (and published) so far */
};

static int div_up(int a, int b) { return (a + b - 1) / b; }

/* Points a into kv->msg for a step of h; returns the int32 count. */
static size_t step_arrays(const struct kv_state *kv, const struct step_head *h,
                          struct step_arrays *a) {
    const size_t n = (size_t)h->n, tables = (size_t)h->n_seqs * kv->max_blocks;
    int32_t *p = kv->msg;
    a->tok = p;
    a->pos = p + n;
    a->seq = p + 2 * n;
    a->slot[FULL] = p + 3 * n;
    a->slot[SLIDING] = p + 4 * n;
    a->rows = p + 5 * n;
    a->tables[FULL] = a->rows + h->n_rows;
    a->tables[SLIDING] = a->tables[FULL] + tables;
    a->temps = (float *)(a->tables[SLIDING] + tables);
    return 5 * n + (size_t)h->n_rows * (h->pick == PICK_TOP ? 2 : 1) + 2 * tables;
}

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
                                    .block_size = o->block_size, .hkv = m->tp.hkv,
                                    .hd = c->head_dim};
        const size_t rows = (size_t)kc->n_blocks * o->block_size * m->tp.hkv;
        const size_t nb = rows * c->head_dim * tmx_dtype_size(o->dtype);
        if ((st = dev_alloc(m, &kc->k, nb, err)) == TMX_OK) st = dev_alloc(m, &kc->v, nb, err);
        if (st == TMX_OK && scaled && (st = dev_alloc(m, &kc->k_scale, rows * 4, err)) == TMX_OK)
            st = dev_alloc(m, &kc->v_scale, rows * 4, err);
    }
    return st;
}

/* Whether a step can hand back each row's first candidates (the set's topk) instead of its
 * logits. */
static int top_on_set(const struct tmx_model *m) { return TMX_OPS_HAS(m->k->ops, topk); }

void tmx_step_graphs_drop(struct tmx_model *m, int kind) {
    struct kv_state *kv = m->kv;
    const int G = kv->opt.max_seqs + 1;
    for (int i = kind * G; kv->graphs && i < (kind + 1) * G; i++)
        if (kv->graphs[i]) m->k->ops->graph_free(m->k->ctx, kv->graphs[i]);
    if (kv->graphs) memset(kv->graphs + kind * G, 0, (size_t)G * sizeof *kv->graphs);
}

static enum tmx_status step_buffers_init(struct tmx_model *m, struct kv_state *kv, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tp_shard *tp = &m->tp;
    const size_t B = (size_t)kv->opt.n_batch, S = (size_t)kv->opt.max_seqs, F = sizeof(float);
    const size_t D = (size_t)c->hidden, V = (size_t)tp->vocab_stride, R = (size_t)tp->n;
    const size_t qd = (size_t)tp->hq * c->head_dim, kvd = (size_t)tp->hkv * c->head_dim;
    const size_t ffn = (size_t)(tp->ffn > tp->shared ? tp->ffn : tp->shared);
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
        {&kv->hn, S * D * F},  {&kv->logits, S * V * F}, {&kv->pick, 2 * S * 4},
        {&kv->g[FULL].slot, B * 4}, {&kv->g[FULL].tables, T},
        {&kv->g[SLIDING].slot, B * 4}, {&kv->g[SLIDING].tables, T},
    };
    enum tmx_status st = TMX_OK;
    for (size_t i = 0; st == TMX_OK && i < sizeof bufs / sizeof bufs[0]; i++)
        st = dev_alloc(m, bufs[i].pp, bufs[i].nbytes, err);
    if (st == TMX_OK && top_on_set(m)) {
        const size_t bytes = S * TOP_ROW_BYTES;
        if ((st = dev_alloc(m, &kv->temps, S * F, err)) == TMX_OK &&
            (st = dev_alloc(m, &kv->top, bytes, err)) == TMX_OK &&
            !(kv->top_host = malloc(bytes)))
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        if (st == TMX_OK && R > 1 && (st = dev_alloc(m, &kv->top_all, R * bytes, err)) == TMX_OK &&
            (!(kv->top_gathered = malloc(R * bytes)) ||
             !(kv->top_lists = malloc(R * sizeof *kv->top_lists))))
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    if (st == TMX_OK && R > 1) {
        st = dev_alloc(m, &kv->part, B * (K * lat + D) * F, err);
        if (st == TMX_OK) st = dev_alloc(m, &kv->logits_all, R * S * V * F, err);
        kv->tok_host = malloc(B * 4);
        kv->gathered = malloc(R * S * V * F);
        kv->status = malloc(R * 4);
        if (st == TMX_OK && (!kv->tok_host || !kv->gathered || !kv->status))
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    kv->msg = malloc(7 * B * 4 + 2 * T);
    if (st == TMX_OK && !kv->msg) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    return st;
}

/* Decode steps are recorded once per batch size and replayed when the kernel set can record
 * them, no layer needs the host between ops (a codec without a device path) and the model is
 * one rank (collectives stay outside recorded graphs). */
static int graphs_usable(const struct tmx_model *m) {
    const struct tmx_kernels_i *op = m->k->ops;
    if (m->tp.n > 1) return 0;
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
        kv->graphs = calloc(N_GRAPHS * ((size_t)o.max_seqs + 1), sizeof *kv->graphs);
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
    for (int kind = 0; kind < N_GRAPHS; kind++) tmx_step_graphs_drop(m, kind);
    free(kv->graphs);
    void *bufs[] = {kv->tok, kv->pos, kv->seq, kv->rows, kv->h, kv->x, kv->o, kv->q, kv->att,
                    kv->kk, kv->vv, kv->f1, kv->f2, kv->rl, kv->rw, kv->rid, kv->z, kv->y,
                    kv->hn, kv->logits, kv->g[0].slot, kv->g[0].tables, kv->g[1].slot,
                    kv->g[1].tables, kv->part, kv->logits_all, kv->pick, kv->temps, kv->top,
                    kv->top_all, kv->edit_dev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) dev_free(m, bufs[i]);
    for (int g = 0; g < N_GROUPS; g++) tmx_kv_pool_free(kv->g[g].pool);
    free(kv->msg);
    free(kv->tok_host);
    free(kv->gathered);
    free(kv->status);
    free(kv->host_logits);
    free(kv->top_host);
    free(kv->top_gathered);
    free(kv->top_lists);
    free(kv->edit_msg);
    free(kv->edit_seen);
    free(kv->cache);
    free(kv);
    m->kv = NULL;
}

void tmx_model_kv_options(const struct tmx_model *m, struct tmx_kv_options *o) {
    if (m->kv) *o = m->kv->opt;
    else memset(o, 0, sizeof *o);
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
    if (fn && m->tp.n > 1)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "a model of tp = %d ranks cannot be captured: "
                       "calibrate at tp = 1", m->tp.n);
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

/* buf[count] (a kernel-set buffer) <- its sum over the ranks; nothing with one rank. */
static enum tmx_status reduce(struct tmx_model *m, float *buf, size_t count, char **err) {
    if (m->tp.n == 1) return TMX_OK;
    return tmx_comm_allreduce_sum(m->tp.data, buf, count, TMX_DTYPE_F32, err);
}

/* ys[i][n][..] = x . ws[i]^T for the count weights that share x: one matmul_multi where the
 * kernel set has it, so that it may run them as one. */
static void matmuls(struct tmx_model *m, float *const *ys, const float *x,
                    const struct tmx_tensor *const *ws, int count, int n) {
    const struct tmx_kernels_i *op = m->k->ops;
    if (TMX_OPS_HAS(op, matmul_multi)) {
        op->matmul_multi(m->k->ctx, ys, x, ws, count, n);
        return;
    }
    for (int i = 0; i < count; i++) op->matmul(m->k->ctx, ys[i], x, ws[i], n);
}

/* The routed experts of layer l: dense experts through the kernel set, or the codec's, on the
 * device or on host memory, into kv->y. With several ranks, each pair's partial y_e into
 * kv->part [n][k][latent] instead (the load refused a codec device path then). */
static enum tmx_status experts(struct tmx_model *m, const struct layer *ly, int n, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const float eps = (float)c->rms_norm_eps;
    const int K = c->n_experts_per_tok, tp = m->tp.n > 1;
    if (!ly->codec_layer) {
        if (tp) op->moe_experts_partial(kc, kv->part, kv->z, kv->rid, n, K, &ly->moe);
        else op->moe_experts(kc, kv->y, kv->z, kv->rid, kv->rw, n, K, &ly->moe);
        return TMX_OK;
    }
    if (ly->codec_dev) {
        void *stream = TMX_OPS_HAS(op, native_stream) ? op->native_stream(kc) : NULL;
        return m->codec_ops->device_moe_experts(m->codec_ctx, ly->codec_dev, stream, kv->y,
                                                kv->z, kv->rid, kv->rw, n, K,
                                                opt(&ly->post_norm), eps, err);
    }
    /* the codec's host path reads the buffers: finish the queued ops first */
    enum tmx_status st = op->sync(kc);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s failed during the forward pass",
                       m->k->plugin->name);
    if (tp)
        return m->codec_ops->moe_experts_partial(m->codec_ctx, ly->codec_layer, kv->part, kv->z,
                                                 kv->rid, n, K, err);
    return m->codec_ops->moe_experts(m->codec_ctx, ly->codec_layer, kv->y, kv->z, kv->rid,
                                     kv->rw, n, K, opt(&ly->post_norm), eps, err);
}

/* The MoE block of layer ly on kv->x into kv->o. One rank: the experts' weighted sum, through
 * bridge_out, plus the shared expert. Several: each rank's partial pair outputs and partial
 * shared-expert output, side by side in kv->part, are summed in one all-reduce; then every rank
 * applies the post-expert norm and the routing weights (nonlinear in y_e, so only after the
 * sum), bridge_out and the shared expert's addition to the same numbers. */
static enum tmx_status moe_block(struct tmx_model *m, const struct layer *ly, int l, int n,
                                 enum tmx_status *failed, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int D = c->hidden, K = c->n_experts_per_tok, lat = c->moe_latent_size;
    const int tp = m->tp.n > 1;
    /* the router, the bridge in and the shared expert's gate and up all read x */
    matmuls(m, (float *[]){kv->rl, kv->z, kv->f1, kv->f2}, kv->x,
            (const struct tmx_tensor *[]){&ly->router, &ly->bridge_in, &ly->gate, &ly->up},
            ly->gate.data ? 4 : 2, n);
    op->moe_route(kc, kv->rid, kv->rw, kv->rl, opt(&ly->router_bias), n, c->n_routed_experts, K,
                  c->router_score, c->norm_topk_prob, (float)c->routed_scaling_factor);
    if (m->capture) { /* calibration, one rank: the buffers are host memory (set_capture) */
        const struct tmx_moe_capture cap = {l, n, K, kv->x, kv->z, kv->rid, kv->rw};
        enum tmx_status st = op->sync(kc);
        if (st != TMX_OK)
            return tmx_err(err, st, "kernel set %s failed during the forward pass",
                           m->k->plugin->name);
        if ((st = m->capture(m->capture_arg, &cap, err)) != TMX_OK) return st;
    }
    /* A failure of this rank's own work stops one rank at once; with several the step goes on
     * to its end, so that every rank makes the same collectives, and reports the first. */
    enum tmx_status st = experts(m, ly, n, *failed ? NULL : err);
    if (st != TMX_OK && !tp) return st;
    if (st != TMX_OK && *failed == TMX_OK) *failed = st;
    if (*failed) err = NULL; /* the message is the first failure's */
    float *shared = tp ? kv->part + (size_t)n * K * lat : kv->x; /* [n][D] */
    if (ly->gate.data) { /* shared expert on the hidden state, its gate and up done above */
        const int64_t f = ly->gate.shape[0];
        op->swiglu(kc, kv->f1, kv->f1, kv->f2, n * f);
        op->matmul(kc, shared, kv->f1, &ly->down, n);
    }
    if (tp) {
        const size_t count = (size_t)n * K * lat + (ly->gate.data ? (size_t)n * D : 0);
        if ((st = reduce(m, kv->part, count, err)) != TMX_OK) return st;
        op->moe_combine(kc, kv->y, kv->part, kv->rw, n, K, lat, opt(&ly->post_norm),
                        (float)c->rms_norm_eps);
    }
    op->matmul(kc, kv->o, kv->y, &ly->bridge_out, n);
    if (ly->gate.data) op->add_gated(kc, kv->o, shared, NULL, n, D);
    return TMX_OK;
}

/* kv->h += g * a (g NULL: 1), then kv->x = RMSNorm(kv->h) * w: a block's residual update and
 * the next block's input, in one op where the set has add_rmsnorm. */
static void add_norm(struct tmx_model *m, const float *a, const struct tmx_tensor *g,
                     const struct tmx_tensor *w, int n) {
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    const int D = m->cfg.hidden;
    const float eps = (float)m->cfg.rms_norm_eps;
    if (TMX_OPS_HAS(op, add_rmsnorm)) {
        op->add_rmsnorm(m->k->ctx, kv->x, kv->h, a, g, w, n, D, eps);
        return;
    }
    op->add_gated(m->k->ctx, kv->h, a, g, n, D);
    op->rmsnorm(m->k->ctx, kv->x, kv->h, w, n, D, eps);
}

/* Attention's input heads of layer ly in place: kv->q and kv->kk normed per head (where the
 * layer has q_norm / k_norm), then rotated at kv->pos; one op where the set has qk_norm_rope. */
static void qk_rope(struct tmx_model *m, const struct layer *ly, const float *freqs, int n) {
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int hq = m->tp.hq, hkv = m->tp.hkv, hd = m->cfg.head_dim;
    const float eps = (float)m->cfg.rms_norm_eps;
    if (TMX_OPS_HAS(op, qk_norm_rope)) {
        op->qk_norm_rope(kc, kv->q, kv->kk, opt(&ly->q_norm), opt(&ly->k_norm), kv->pos, freqs,
                         n, hq, hkv, hd, eps);
        return;
    }
    if (ly->q_norm.data) op->rmsnorm(kc, kv->q, kv->q, &ly->q_norm, n * hq, hd, eps);
    if (ly->k_norm.data) op->rmsnorm(kc, kv->kk, kv->kk, &ly->k_norm, n * hkv, hd, eps);
    op->rope(kc, kv->q, kv->pos, freqs, n, hq, hd);
    op->rope(kc, kv->kk, kv->pos, freqs, n, hkv, hd);
}

/* One step over n tokens already in kv->tok, pos, seq and the groups' slots and tables, from
 * n_seqs sequences. Leaves the final hidden states (before the final norm) in kv->h. Each
 * all-reduce sums the ranks' partial results of a split weight: the embedding's rows, the
 * attention output projection's columns, the MLP's down projection's columns. Returns a
 * failure that ends the step; *failed gets one that lets it run on (a codec's, with several
 * ranks), with its message in *err. */
static enum tmx_status forward_step(struct tmx_model *m, int n, enum tmx_status *failed,
                                    char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int D = c->hidden, hq = m->tp.hq, hd = c->head_dim;
    const float eps = (float)c->rms_norm_eps, scale = 1.0f / sqrtf((float)hd);
    enum tmx_status st;

    *failed = TMX_OK;
    op->embed(kc, kv->h, &m->embed, kv->tok, n);
    if ((st = reduce(m, kv->h, (size_t)n * D, err)) != TMX_OK) return st;
    op->rmsnorm(kc, kv->x, kv->h, &m->layers[0].attn_norm, n, D, eps);
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer *ly = &m->layers[l];
        const struct group *gr = &kv->g[c->sliding[l] ? SLIDING : FULL];

        /* attention over this rank's heads, on kv->x = its input norm of kv->h */
        matmuls(m, (float *[]){kv->q, kv->kk, kv->vv}, kv->x,
                (const struct tmx_tensor *[]){&ly->wq, &ly->wk, &ly->wv}, 3, n);
        qk_rope(m, ly, c->sliding[l] ? m->inv_freq_local : m->inv_freq_full, n);
        op->kv_store(kc, &kv->cache[l], kv->kk, kv->vv, gr->slot, n);
        op->attention(kc, kv->att, kv->q, &kv->cache[l], gr->tables, kv->max_blocks, kv->seq,
                      kv->pos, n, hq, gr->window, scale);
        op->matmul(kc, kv->o, kv->att, &ly->wo, n);
        if ((st = reduce(m, kv->o, (size_t)n * D, *failed ? NULL : err)) != TMX_OK) return st;
        add_norm(m, kv->o, opt(&ly->attn_gate), &ly->mlp_norm, n);

        /* MLP: dense SwiGLU, or routed experts behind the bridges */
        if (c->dense[l]) {
            const int64_t f = ly->gate.shape[0];
            matmuls(m, (float *[]){kv->f1, kv->f2}, kv->x,
                    (const struct tmx_tensor *[]){&ly->gate, &ly->up}, 2, n);
            op->swiglu(kc, kv->f1, kv->f1, kv->f2, n * f);
            op->matmul(kc, kv->o, kv->f1, &ly->down, n);
            st = reduce(m, kv->o, (size_t)n * D, *failed ? NULL : err);
        } else {
            st = moe_block(m, ly, l, n, failed, err);
        }
        if (st != TMX_OK) return st;
        if (l + 1 < c->n_layers) add_norm(m, kv->o, opt(&ly->mlp_gate), &ly[1].attn_norm, n);
        else op->add_gated(kc, kv->h, kv->o, opt(&ly->mlp_gate), n, D);
    }
    return TMX_OK;
}

/* Logits of the r token rows of kv->h listed in kv->rows into kv->logits[r][vocab slice]. */
static void logits_rows(struct tmx_model *m, int r) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const struct tmx_tensor *head = m->lm_head.data ? &m->lm_head : &m->embed;
    op->gather(kc, kv->hn, kv->h, kv->rows, r, c->hidden);
    op->rmsnorm(kc, kv->hn, kv->hn, &m->final_norm, r, c->hidden, (float)c->rms_norm_eps);
    op->matmul(kc, kv->logits, kv->hn, head, r);
}

/* The whole step on h->n tokens with the output of h->n_rows rows (rows), eagerly or, for a
 * decode step of n sequences, through the graph recorded for n and the pick the set makes. */
static enum tmx_status run_step(struct tmx_model *m, const struct step_head *h, int decode,
                                const struct step_arrays *a, const struct step_out *out,
                                char **err) {
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int n = h->n, n_rows = h->n_rows;
    const int on_set = h->pick == PICK_TOP || (h->pick == PICK_GREEDY && TMX_OPS_HAS(op, argmax));
    enum tmx_status st, failed;
    kv->n_rows_read = n_rows <= kv->opt.max_seqs ? n_rows : 0; /* kv->logits holds them all */
    if (h->pick == PICK_TOP) {
        st = op->buf_write(kc, kv->temps, a->temps, (size_t)n_rows * sizeof *a->temps);
        if (st == TMX_OK && h->n_edits)
            st = op->buf_write(kc, kv->edit_dev, kv->edit_msg, tmx_step_edit_bytes(kv, h->n_edits));
        if (st != TMX_OK) return st;
    }
    if (decode && kv->graphs) { /* one rank: nothing fails and runs on */
        const int G = kv->opt.max_seqs + 1;
        const int kind = !on_set ? PICK_LOGITS : h->n_edits ? GRAPH_TOP_EDITED : h->pick;
        if (on_set && kv->graph_vocab[kind] != h->n_vocab) { /* another tokenizer's width */
            tmx_step_graphs_drop(m, kind);
            kv->graph_vocab[kind] = h->n_vocab;
        }
        void **graph = &kv->graphs[n + kind * G];
        if ((st = op->buf_write(kc, kv->rows, a->rows, (size_t)n * 4)) != TMX_OK) return st;
        if (!*graph) {
            if ((st = op->graph_begin(kc)) != TMX_OK) return st;
            st = forward_step(m, n, &failed, err);
            if (st == TMX_OK) logits_rows(m, n);
            if (st == TMX_OK && kind == PICK_GREEDY)
                op->argmax(kc, kv->pick, (float *)(kv->pick + kv->opt.max_seqs), kv->logits, n,
                           h->n_vocab, m->tp.vocab_n);
            if (st == TMX_OK && h->pick == PICK_TOP) tmx_step_top_queue(m, h, n);
            enum tmx_status end = op->graph_end(kc, graph);
            if (st != TMX_OK) return st;
            if (end != TMX_OK) return end;
        }
        if ((st = op->graph_launch(kc, *graph)) != TMX_OK) return st;
        if (kind == PICK_GREEDY)
            return op->buf_read(kc, out->next, kv->pick, (size_t)n * sizeof *out->next);
        if (h->pick == PICK_TOP) return tmx_step_top_read(m, n, out);
        return tmx_step_read(m, h, n, 0, out, err);
    }
    /* a failure of this rank's own work comes back after the step's collectives (TP) */
    if ((st = forward_step(m, n, &failed, err)) != TMX_OK) return st;
    for (int done = 0; done < n_rows; done += kv->opt.max_seqs) { /* max_seqs rows at a time */
        const int r = n_rows - done < kv->opt.max_seqs ? n_rows - done : kv->opt.max_seqs;
        if ((st = op->buf_write(kc, kv->rows, a->rows + done, (size_t)r * 4)) != TMX_OK)
            return st;
        logits_rows(m, r);
        if ((st = tmx_step_read(m, h, r, done, out, failed ? NULL : err)) != TMX_OK) return st;
    }
    return failed;
}

/* The step described by h and kv->msg, on every rank: uploads, runs, syncs (out's arrays NULL
 * on a follower). Every failure comes with a message. */
static enum tmx_status run_shared(struct tmx_model *m, const struct step_head *h,
                                  const struct step_out *out, char **err) {
    const struct tmx_kernels_i *op = m->k->ops;
    const struct tp_shard *tp = &m->tp;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int N = h->n, mb = kv->max_blocks;
    struct step_arrays a;
    step_arrays(kv, h, &a);
    const int32_t *tok = a.tok;
    if (tp->n > 1) { /* ids of other ranks read this rank's zero row */
        for (int i = 0; i < N; i++) {
            const int32_t t = a.tok[i] - tp->vocab0;
            kv->tok_host[i] = t >= 0 && t < tp->vocab_n ? t : tp->vocab_n;
        }
        tok = kv->tok_host;
    }
    enum tmx_status st = op->buf_write(kc, kv->tok, tok, (size_t)N * 4);
    if (st == TMX_OK) st = op->buf_write(kc, kv->pos, a.pos, (size_t)N * 4);
    if (st == TMX_OK) st = op->buf_write(kc, kv->seq, a.seq, (size_t)N * 4);
    for (int g = 0; st == TMX_OK && g < N_GROUPS; g++) {
        if (!kv->g[g].pool) continue;
        st = op->buf_write(kc, kv->g[g].slot, a.slot[g], (size_t)N * 4);
        if (st == TMX_OK)
            st = op->buf_write(kc, kv->g[g].tables, a.tables[g], (size_t)h->n_seqs * mb * 4);
    }
    if (st != TMX_OK) return tmx_err(err, st, "kernel set: cannot upload the step's tokens");
    const int decode = N == h->n_seqs && h->n_rows == h->n_seqs && !m->capture;
    char *ferr = NULL; /* set only by a failure that has its own message */
    st = run_step(m, h, decode, &a, out, &ferr);
    if (ferr) {
        if (err) *err = ferr;
        else free(ferr);
        return st;
    }
    if (st == TMX_OK) st = op->sync(kc);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s failed during the forward pass: %s",
                       m->k->plugin->name, tmx_status_str(st));
    return TMX_OK;
}

/* Rank 0 after a step: learns every rank's status (the followers send theirs in
 * tmx_model_follow) and reports a follower's failure when it has none of its own (the
 * follower logged its message). One rank: st. */
static enum tmx_status agree(struct tmx_model *m, enum tmx_status st, char **err) {
    const struct tp_shard *tp = &m->tp;
    if (tp->n == 1) return st;
    const int32_t mine = (int32_t)st;
    char *cerr = NULL;
    enum tmx_status cs = tmx_comm_allgather(tp->ctl, &mine, m->kv->status, sizeof mine, &cerr);
    if (cs != TMX_OK) {
        if (st == TMX_OK && err) *err = cerr;
        else free(cerr);
        return st != TMX_OK ? st : cs;
    }
    for (int r = 0; st == TMX_OK && r < tp->n; r++)
        if (m->kv->status[r] != TMX_OK)
            return tmx_err(err, (enum tmx_status)m->kv->status[r], "rank %d of tp = %d failed "
                           "during the forward pass: %s (its message is in the log)", r, tp->n,
                           tmx_status_str((enum tmx_status)m->kv->status[r]));
    return st;
}

/* Rank 0 hands the step in h and kv->msg to the followers. */
static enum tmx_status share(struct tmx_model *m, struct step_head *h, char **err) {
    if (m->tp.n == 1) return TMX_OK;
    struct step_arrays a;
    const size_t count = step_arrays(m->kv, h, &a);
    enum tmx_status st = tmx_comm_broadcast(m->tp.ctl, h, sizeof *h, 0, err);
    if (st == TMX_OK && h->cmd == CMD_STEP)
        st = tmx_comm_broadcast(m->tp.ctl, m->kv->msg, count * 4, 0, err);
    if (st == TMX_OK && h->cmd == CMD_STEP && h->n_edits)
        st = tmx_step_edits_broadcast(m, h, err);
    return st;
}

/* tmx_model_step, with the logits of every token instead when all_rows, or each sequence's
 * pick over ids [0, n_vocab) into out (step_out). */
static enum tmx_status step(struct tmx_model *m, struct tmx_seq *const *seqs,
                            const int32_t *const *tokens, const int *n, int n_seqs, int all_rows,
                            int pick, int n_vocab, const struct step_out *out, char **err) {
    const struct tmx_model_config *c = &m->cfg;
    struct kv_state *kv = m->kv;
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
        N += n[i];
    }
    const int n_edits = out->edit_starts ? out->edit_starts[n_seqs] : 0;
    struct step_head h = {CMD_STEP, N, n_seqs, all_rows ? N : n_seqs, pick, n_vocab, n_edits};
    struct step_arrays a;
    step_arrays(kv, &h, &a);
    for (int i = 0, at = 0; i < n_seqs; at += n[i++]) {
        const struct tmx_seq *s = seqs[i];
        for (int j = 0; j < n[i]; j++) {
            const int32_t t = tokens[i][j], p = s->n_past + j;
            if (t < 0 || t >= c->vocab_size)
                return tmx_err(err, TMX_ERR_INVALID, "token id %d out of range [0, %d)", t,
                               c->vocab_size);
            for (int g = 0; g < N_GROUPS; g++) {
                a.slot[g][at + j] = -1;
                if (!kv->g[g].pool) continue;
                const int b = s->table[g][p / bs];
                if (b < 0)
                    return tmx_err(err, TMX_ERR_INVALID, "step: position %d has no KV block "
                                   "(tmx_seq_reserve first)", p);
                a.slot[g][at + j] = b * bs + p % bs;
            }
            a.tok[at + j] = t;
            a.pos[at + j] = p;
            a.seq[at + j] = i;
        }
        for (int g = 0; g < N_GROUPS; g++)
            memcpy(a.tables[g] + (size_t)i * mb, s->table[g], (size_t)mb * 4);
        if (!all_rows) a.rows[i] = at + n[i] - 1;
    }
    for (int j = 0; all_rows && j < N; j++) a.rows[j] = j;
    if (pick == PICK_TOP) memcpy(a.temps, out->temps, (size_t)n_seqs * sizeof *a.temps);
    if (n_edits) { /* tmx_model_step_top checked them and made room */
        memcpy(kv->edit_msg, out->edit_starts, ((size_t)n_seqs + 1) * sizeof *out->edit_starts);
        memcpy(EDITS_AT(kv, kv->edit_msg), out->edits, (size_t)n_edits * sizeof *out->edits);
    }

    char *ferr = NULL;
    enum tmx_status st = share(m, &h, &ferr);
    if (st == TMX_OK) {
        st = run_shared(m, &h, out, &ferr);
        st = agree(m, st, ferr ? NULL : &ferr);
    }
    if (st != TMX_OK) {
        if (err) *err = ferr;
        else free(ferr);
        return st;
    }
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
    if (m->tp.rank != 0)
        return tmx_err(err, TMX_ERR_INVALID, "step: rank %d follows rank 0's steps "
                       "(tmx_model_follow)", m->tp.rank);
    const struct step_out out = {.logits = logits};
    return step(m, seqs, tokens, n, n_seqs, 0, PICK_LOGITS, 0, &out, err);
}

enum tmx_status tmx_model_step_greedy(struct tmx_model *m, struct tmx_seq *const *seqs,
                                      const int32_t *const *tokens, const int *n, int n_seqs,
                                      int n_vocab, int32_t *next, char **err) {
    if (m->tp.rank != 0)
        return tmx_err(err, TMX_ERR_INVALID, "step: rank %d follows rank 0's steps "
                       "(tmx_model_follow)", m->tp.rank);
    if (n_vocab < 1 || n_vocab > m->cfg.vocab_size)
        return tmx_err(err, TMX_ERR_INVALID, "greedy step: n_vocab %d outside [1, %d]", n_vocab,
                       m->cfg.vocab_size);
    const struct step_out out = {.next = next};
    return step(m, seqs, tokens, n, n_seqs, 0, PICK_GREEDY, n_vocab, &out, err);
}

int tmx_model_on_device(const struct tmx_model *m) {
    return !(m->k->plugin->caps & TMX_CAP_HOST_MEMORY);
}

int tmx_model_can_top(const struct tmx_model *m) {
    return m->kv && top_on_set(m) && (m->tp.n > 1 || tmx_model_on_device(m));
}

int tmx_model_can_edit(const struct tmx_model *m) {
    return tmx_model_can_top(m) && tmx_step_can_edit(m);
}

enum tmx_status tmx_model_step_top(struct tmx_model *m, struct tmx_seq *const *seqs,
                                   const int32_t *const *tokens, const int *n, int n_seqs,
                                   int n_vocab, const float *temps, const int32_t *edit_starts,
                                   const struct tmx_logit_edit *edits, float *xs, int32_t *ids,
                                   double *stats, char **err) {
    if (!m->kv || !top_on_set(m))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "top step: kernel set %s has no topk (ABI 2.4)",
                       m->k->plugin->name);
    if (n_vocab < 1 || n_vocab > m->cfg.vocab_size)
        return tmx_err(err, TMX_ERR_INVALID, "top step: n_vocab %d outside [1, %d]", n_vocab,
                       m->cfg.vocab_size);
    for (int i = 0; i < n_seqs; i++)
        if (!(temps[i] > 0) || !isfinite(temps[i]))
            return tmx_err(err, TMX_ERR_INVALID, "top step: temperature %g of sequence %d is "
                           "not positive", temps[i], i);
    if (edit_starts && n_seqs >= 1 && n_seqs <= m->kv->opt.max_seqs) {
        enum tmx_status st = tmx_step_edits_check(m, edit_starts, edits, n_seqs, n_vocab, err);
        if (st != TMX_OK) return st;
    }
    const struct step_out out = {.temps = temps, .edit_starts = edit_starts, .edits = edits,
                                 .top_x = xs, .top_id = ids, .top_stat = stats};
    return step(m, seqs, tokens, n, n_seqs, 0, PICK_TOP, n_vocab, &out, err);
}

enum tmx_status tmx_model_read_logits(struct tmx_model *m, int i, float *logits, char **err) {
    const struct kv_state *kv = m->kv;
    if (m->tp.rank != 0)
        return tmx_err(err, TMX_ERR_INVALID, "logits: rank %d follows rank 0 "
                       "(tmx_model_follow)", m->tp.rank);
    if (!kv || i < 0 || i >= kv->n_rows_read)
        return tmx_err(err, TMX_ERR_INVALID, "logits: row %d of the last step's %d", i,
                       kv ? kv->n_rows_read : 0);
    struct step_head h = {CMD_ROW, i, 0, 0, 0, 0, 0};
    char *ferr = NULL;
    enum tmx_status st = share(m, &h, &ferr);
    if (st == TMX_OK) st = tmx_step_row_read(m, i, logits, &ferr);
    if (st != TMX_OK) {
        tmx_err(err, st, "kernel set %s: cannot read the logits back: %s", m->k->plugin->name,
                ferr ? ferr : tmx_status_str(st));
        free(ferr);
    }
    return st;
}

enum tmx_status tmx_seq_forward(struct tmx_seq *s, const int32_t *tokens, int n, float *logits,
                                int all_rows, char **err) {
    const struct kv_state *kv = s->m->kv;
    const int V = s->m->cfg.vocab_size;
    if (s->m->tp.rank != 0)
        return tmx_err(err, TMX_ERR_INVALID, "forward: rank %d follows rank 0's steps "
                       "(tmx_model_follow)", s->m->tp.rank);
    if (n < 1) return tmx_err(err, TMX_ERR_INVALID, "forward: no tokens");
    if (s->n_past + n > s->n_ctx)
        return tmx_err(err, TMX_ERR_INVALID, "context full: %d tokens in the sequence + %d new "
                       "> context %d", s->n_past, n, s->n_ctx);
    for (int done = 0; done < n;) {
        const int chunk = n - done < kv->opt.n_batch ? n - done : kv->opt.n_batch;
        enum tmx_status st = tmx_seq_reserve(s, chunk, err);
        if (st != TMX_OK) return st;
        const int32_t *t = tokens + done;
        const struct step_out out = {.logits = all_rows ? logits + (size_t)done * V : logits};
        if ((st = step(s->m, &s, &t, &chunk, 1, all_rows, PICK_LOGITS, 0, &out, err)) != TMX_OK)
            return st;
        done += chunk;
    }
    return TMX_OK;
}

/* --- the followers ------------------------------------------------------------------------- */

enum tmx_status tmx_model_follow(struct tmx_model *m, char **err) {
    struct kv_state *kv = m->kv;
    if (m->tp.rank == 0 || !kv)
        return tmx_err(err, TMX_ERR_INVALID, "follow: only ranks 1..%d with a KV cache follow "
                       "rank 0", m->tp.n - 1);
    for (;;) {
        struct step_head h;
        enum tmx_status st = tmx_comm_broadcast(m->tp.ctl, &h, sizeof h, 0, err);
        if (st != TMX_OK || h.cmd == CMD_QUIT) return st;
        if (h.cmd == CMD_ROW) { /* rank 0 checked the row against the same last step */
            if ((st = tmx_step_row_read(m, h.n, NULL, err)) != TMX_OK) return st;
            continue;
        }
        if (h.cmd != CMD_STEP || h.n < 1 || h.n > kv->opt.n_batch || h.n_seqs < 1 ||
            h.n_seqs > kv->opt.max_seqs || h.n_rows < 1 || h.n_rows > h.n || h.pick < 0 ||
            h.pick >= N_PICKS || (h.pick == PICK_TOP && !top_on_set(m)) || h.n_vocab < 0 ||
            h.n_vocab > m->cfg.vocab_size || h.n_edits < 0 ||
            (h.n_edits && (h.pick != PICK_TOP || !tmx_step_can_edit(m))))
            return tmx_err(err, TMX_ERR_INVALID, "rank %d: a step from rank 0 with command "
                           "%d, %d tokens, %d sequences, %d rows does not fit this rank's "
                           "cache (were all ranks set up alike?)", m->tp.rank, (int)h.cmd,
                           (int)h.n, (int)h.n_seqs, (int)h.n_rows);
        struct step_arrays a;
        const size_t count = step_arrays(kv, &h, &a);
        if ((st = tmx_comm_broadcast(m->tp.ctl, kv->msg, count * 4, 0, err)) != TMX_OK)
            return st;
        if (h.n_edits && ((st = tmx_step_edits_reserve(m, h.n_edits, err)) != TMX_OK ||
                          (st = tmx_step_edits_broadcast(m, &h, err)) != TMX_OK))
            return st;
        char *ferr = NULL;
        const struct step_out none = {0};
        st = run_shared(m, &h, &none, &ferr);
        if (st != TMX_OK) tmx_log(TMX_LOG_ERROR, "rank %d: %s", m->tp.rank, ferr ? ferr : "?");
        free(ferr);
        const int32_t mine = (int32_t)st; /* to rank 0's agree() */
        if ((st = tmx_comm_allgather(m->tp.ctl, &mine, kv->status, sizeof mine, err)) != TMX_OK)
            return st;
    }
}

enum tmx_status tmx_model_stop(struct tmx_model *m, char **err) {
    if (m->tp.n == 1 || m->tp.rank != 0) return TMX_OK;
    struct step_head h = {CMD_QUIT, 0, 0, 0, 0, 0, 0};
    return share(m, &h, err);
}
