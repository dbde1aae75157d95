/* model.c: the Muse forward pass (docs/model.md) as a sequence of kernel-set ops.
 *
 * Loading binds every tensor by name, checks its shape, and imports it into the kernel set.
 * A sequence owns the KV cache and the scratch buffers of one step; tmx_seq_forward runs the
 * graph over a chunk of tokens and reads back logits. Plugins add speed behind the ops and never
 * control flow: everything the step does is in forward_step below, top to bottom. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/model.h"

/* --- weights ------------------------------------------------------------------------------- */

struct layer {
    struct tmx_tensor attn_norm, wq, wk, wv, wo, q_norm, k_norm, attn_gate;
    struct tmx_tensor mlp_norm, mlp_gate;
    struct tmx_tensor gate, up, down;             /* dense MLP, or the shared expert */
    struct tmx_tensor router, router_bias, bridge_in, bridge_out, post_norm;
    struct tmx_tensor *experts;                   /* [3][n_routed_experts]: gate, up, down */
    struct tmx_moe_weights moe;
    void *codec_layer;                            /* the codec's handle when a codec has them */
};

struct tmx_model {
    struct tmx_model_config cfg;
    const struct tmx_kernels *k;
    struct tmx_tensor embed, final_norm, lm_head;
    struct layer *layers;                         /* [n_layers] */
    float *inv_freq_full, *inv_freq_local;        /* device, [head_dim/2] */
    struct tmx_tensor **imported;                 /* every tensor to weight_free */
    int n_imported, cap_imported;
    void **owned;                                 /* host arrays converted at load time */
    int n_owned, cap_owned;
    const struct tmx_plugin *codec;               /* routed experts' codec, or NULL */
    const struct tmx_codec_i *codec_ops;
    void *codec_ctx;
};

/* Keeps a host array the model converted (it must outlive the imported weight). */
static void *own(struct tmx_model *m, size_t nbytes) {
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? 2 * m->cap_owned : 64;
        void **p = realloc(m->owned, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        m->owned = p;
        m->cap_owned = cap;
    }
    void *a = malloc(nbytes);
    if (a) m->owned[m->n_owned++] = a;
    return a;
}

/* MXFP8 -> BF16: value = E4M3(q) * 2^(scale - 127), exact in BF16 for every weight a model
 * holds (E4M3 has 3 mantissa bits; BF16 7). *out is a host tensor owned by the model. */
static enum tmx_status expand_mxfp8(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                    const char *name, const struct tmx_tensor *q,
                                    struct tmx_tensor *out, char **err) {
    char sname[256];
    struct tmx_tensor sc;
    snprintf(sname, sizeof sname, "%s_scale", name);
    const int64_t rows = q->shape[0], cols = q->ndim == 2 ? q->shape[1] : 1;
    if (tmx_checkpoint_find(ck, sname, &sc) != 0 || sc.dtype != TMX_DTYPE_U8 || sc.ndim != 2 ||
        cols % 32 || sc.shape[0] != rows || sc.shape[1] != cols / 32)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: F8_E4M3 tensor %s needs %s, U8 [%lld][%lld] (one UE8M0 scale per 32)",
                       tmx_checkpoint_dir(ck), name, sname, (long long)rows, (long long)(cols / 32));
    uint16_t *dst = own(m, (size_t)(rows * cols) * 2);
    if (!dst) return tmx_err(err, TMX_ERR_NOMEM, "out of memory expanding %s", name);
    const uint8_t *qb = q->data, *sb = sc.data;
    for (int64_t i = 0; i < rows * cols; i++) {
        const int e = (int)sb[i / 32] - 127; /* rows * cols / 32 scales in row-major order */
        dst[i] = tmx_f32_to_bf16(ldexpf(tmx_e4m3_to_f32(qb[i]), e));
    }
    *out = (struct tmx_tensor){TMX_DTYPE_BF16, q->ndim, {q->shape[0], q->shape[1]}, dst};
    return TMX_OK;
}

/* Binds `name` to *dev: looks it up, checks dtype and shape, imports it. A missing optional
 * tensor leaves dev->data NULL. Shape dims < 0 end the list. */
static enum tmx_status bind(struct tmx_model *m, const struct tmx_checkpoint *ck,
                            struct tmx_tensor *dev, int optional, char **err, const char *name,
                            int64_t d0, int64_t d1) {
    struct tmx_tensor host;
    memset(dev, 0, sizeof *dev);
    if (tmx_checkpoint_find(ck, name, &host) != 0)
        return optional ? TMX_OK
                        : tmx_err(err, TMX_ERR_NOT_FOUND, "%s: tensor %s is missing",
                                  tmx_checkpoint_dir(ck), name);
    int ndim = d1 >= 0 ? 2 : 1;
    if (host.ndim != ndim || host.shape[0] != d0 || (ndim == 2 && host.shape[1] != d1))
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor %s has shape [%lld%s%lld], config.json implies [%lld%s%lld]",
                       tmx_checkpoint_dir(ck), name, (long long)host.shape[0],
                       host.ndim > 1 ? ", " : "", host.ndim > 1 ? (long long)host.shape[1] : 0LL,
                       (long long)d0, ndim > 1 ? ", " : "", ndim > 1 ? (long long)d1 : 0LL);
    if (host.dtype == TMX_DTYPE_F8_E4M3) {
        enum tmx_status st = expand_mxfp8(m, ck, name, &host, &host, err);
        if (st != TMX_OK) return st;
    }
    if (host.dtype != TMX_DTYPE_F32 && host.dtype != TMX_DTYPE_BF16 &&
        host.dtype != TMX_DTYPE_F16)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: tensor %s is %s; dense weights must be "
                       "F32, BF16, F16 or MXFP8", tmx_checkpoint_dir(ck), name,
                       tmx_dtype_name(host.dtype));
    if (m->n_imported == m->cap_imported) {
        int cap = m->cap_imported ? 2 * m->cap_imported : 256;
        struct tmx_tensor **p = realloc(m->imported, (size_t)cap * sizeof *p);
        if (!p) return tmx_err(err, TMX_ERR_NOMEM, "out of memory binding %s", name);
        m->imported = p;
        m->cap_imported = cap;
    }
    enum tmx_status st = m->k->ops->weight_import(m->k->ctx, &host, dev, err);
    if (st == TMX_OK) m->imported[m->n_imported++] = dev;
    return st;
}

#define NAME(buf, ...) (snprintf(buf, sizeof buf, __VA_ARGS__), buf)

/* The router's correction bias is read by moe_route as F32. */
static enum tmx_status bind_bias(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                 struct layer *ly, int l, char **err) {
    char n[256];
    struct tmx_tensor host;
    memset(&ly->router_bias, 0, sizeof ly->router_bias);
    if (tmx_checkpoint_find(ck, NAME(n, "model.layers.%d.mlp.router.correction_bias", l), &host))
        return TMX_OK;
    if (host.dtype == TMX_DTYPE_F32) return bind(m, ck, &ly->router_bias, 0, err, n,
                                                 m->cfg.n_routed_experts, -1);
    if (host.ndim != 1 || host.shape[0] != m->cfg.n_routed_experts ||
        (host.dtype != TMX_DTYPE_BF16 && host.dtype != TMX_DTYPE_F16))
        return tmx_err(err, TMX_ERR_INVALID, "%s: tensor %s must be [%d] F32, BF16 or F16",
                       tmx_checkpoint_dir(ck), n, m->cfg.n_routed_experts);
    float *bias = own(m, (size_t)host.shape[0] * sizeof(float));
    if (!bias) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    const uint16_t *src = host.data;
    for (int64_t i = 0; i < host.shape[0]; i++)
        bias[i] = host.dtype == TMX_DTYPE_BF16 ? tmx_bf16_to_f32(src[i]) : tmx_f16_to_f32(src[i]);
    struct tmx_tensor f32 = {TMX_DTYPE_F32, 1, {host.shape[0]}, bias};
    enum tmx_status st = m->k->ops->weight_import(m->k->ctx, &f32, &ly->router_bias, err);
    if (st == TMX_OK) m->imported[m->n_imported++] = &ly->router_bias;
    return st;
}

static enum tmx_status bind_layer(struct tmx_model *m, const struct tmx_checkpoint *ck, int l,
                                  char **err) {
    const struct tmx_model_config *c = &m->cfg;
    struct layer *ly = &m->layers[l];
    const int64_t d = c->hidden, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    char n[256];
    enum tmx_status st;
#define B(t, opt, d0, d1, ...) \
    if ((st = bind(m, ck, &ly->t, opt, err, NAME(n, __VA_ARGS__), d0, d1))) return st
    B(attn_norm, 0, d, -1, "model.layers.%d.input_layernorm.weight", l);
    B(wq, 0, qd, d, "model.layers.%d.self_attn.q_proj.weight", l);
    B(wk, 0, kvd, d, "model.layers.%d.self_attn.k_proj.weight", l);
    B(wv, 0, kvd, d, "model.layers.%d.self_attn.v_proj.weight", l);
    B(wo, 0, d, qd, "model.layers.%d.self_attn.o_proj.weight", l);
    B(q_norm, 1, c->head_dim, -1, "model.layers.%d.self_attn.q_norm.weight", l);
    B(k_norm, 1, c->head_dim, -1, "model.layers.%d.self_attn.k_norm.weight", l);
    B(mlp_norm, 0, d, -1, "model.layers.%d.post_attention_layernorm.weight", l);
    if (c->residual_gates) {
        B(attn_gate, 0, d, -1, "model.layers.%d.attn_gate", l);
        B(mlp_gate, 0, d, -1, "model.layers.%d.mlp_gate", l);
    }
    if (c->dense[l]) {
        const int64_t f = c->intermediate_size;
        B(gate, 0, f, d, "model.layers.%d.mlp.gate_proj.weight", l);
        B(up, 0, f, d, "model.layers.%d.mlp.up_proj.weight", l);
        B(down, 0, d, f, "model.layers.%d.mlp.down_proj.weight", l);
        return TMX_OK;
    }
    const int64_t E = c->n_routed_experts, lat = c->moe_latent_size,
                  f = c->moe_intermediate_size, fs = (int64_t)c->n_shared_experts * f;
    B(router, 0, E, d, "model.layers.%d.mlp.router.weight", l);
    B(bridge_in, 0, lat, d, "model.layers.%d.mlp.bridge_in.weight", l);
    B(bridge_out, 0, d, lat, "model.layers.%d.mlp.bridge_out.weight", l);
    B(post_norm, 1, lat, -1, "model.layers.%d.mlp.post_expert_norm.weight", l);
    if (fs > 0) {
        B(gate, 0, fs, d, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l);
        B(up, 0, fs, d, "model.layers.%d.mlp.shared_experts.up_proj.weight", l);
        B(down, 0, d, fs, "model.layers.%d.mlp.shared_experts.down_proj.weight", l);
    }
#undef B
    if ((st = bind_bias(m, ck, ly, l, err))) return st;
    if (m->codec) {
        const struct tmx_codec_layer_info info = {tmx_checkpoint_dir(ck), l, (int)E, (int)lat,
                                                  (int)f};
        return m->codec_ops->layer_load(m->codec_ctx, &info, &ly->codec_layer, err);
    }
    ly->experts = calloc((size_t)(3 * E), sizeof *ly->experts);
    if (!ly->experts) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    static const char *proj[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < 3; p++)
        for (int e = 0; e < E; e++) {
            st = bind(m, ck, &ly->experts[p * E + e], 0, err,
                      NAME(n, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj[p]),
                      p < 2 ? f : lat, p < 2 ? lat : f);
            if (st) return st;
        }
    ly->moe = (struct tmx_moe_weights){
        .n_experts = (int)E, .expert0 = 0, .latent = (int)lat, .inter = (int)f,
        .gate = ly->experts, .up = ly->experts + E, .down = ly->experts + 2 * E,
        .post_norm = ly->post_norm.data ? &ly->post_norm : NULL, .eps = (float)c->rms_norm_eps};
    return TMX_OK;
}

/* RoPE frequencies θ^(-2i/hd), with the config's scaling (docs/model.md). */
static void rope_freqs(const struct tmx_model_config *c, double theta, float *out) {
    const int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = pow(theta, -2.0 * i / c->head_dim);
        if (c->rope_type == TMX_ROPE_LINEAR) {
            f /= c->rope_factor;
        } else if (c->rope_type == TMX_ROPE_LLAMA3) {
            const double lo_wavelen = c->rope_original_max_pos / c->rope_low_freq_factor;
            const double hi_wavelen = c->rope_original_max_pos / c->rope_high_freq_factor;
            const double wavelen = 2.0 * M_PI / f;
            if (wavelen > lo_wavelen) {
                f /= c->rope_factor;
            } else if (wavelen >= hi_wavelen) {
                double s = (c->rope_original_max_pos / wavelen - c->rope_low_freq_factor) /
                           (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0 - s) * f / c->rope_factor + s * f;
            }
        }
        out[i] = (float)f;
    }
}

static enum tmx_status upload_freqs(struct tmx_model *m, double theta, float **dev, char **err) {
    const size_t nb = (size_t)(m->cfg.head_dim / 2) * sizeof(float);
    float *host = malloc(nb);
    if (!host) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    rope_freqs(&m->cfg, theta, host);
    enum tmx_status st = m->k->ops->buf_alloc(m->k->ctx, nb, (void **)dev);
    if (st == TMX_OK) st = m->k->ops->buf_write(m->k->ctx, *dev, host, nb);
    free(host);
    return st ? tmx_err(err, st, "kernel set %s: cannot upload RoPE tables",
                        m->k->plugin->name) : TMX_OK;
}

/* hf_quant_config.json names the codec of the routed experts: load and start it. No file: the
 * experts are dense tensors. */
static enum tmx_status open_codec(struct tmx_model *m, const char *dir, struct tmx_plugins *ps,
                                  char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    FILE *f = fopen(path, "r");
    if (!f) return TMX_OK;
    json_error_t jerr;
    json_t *q = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!q) return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", path, jerr.line, jerr.column,
                           jerr.text);
    const char *method = json_string_value(json_object_get(q, "quant_method"));
    const char *name = json_string_value(json_object_get(q, "codec"));
    enum tmx_status st = TMX_OK;
    if (!method || !name)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: fields \"quant_method\" and \"codec\" must be "
                     "strings", path);
    if (st == TMX_OK) st = tmx_plugins_load(ps, TMX_PLUGIN_CODEC, name, &m->codec, err);
    if (st == TMX_OK) {
        m->codec_ops = m->codec->ops;
        if (strcmp(m->codec_ops->quant_method, method) != 0)
            st = tmx_err(err, TMX_ERR_INVALID, "%s: quant_method \"%s\", but codec.%s reads "
                         "\"%s\"", path, method, name, m->codec_ops->quant_method);
        else if (!(m->k->plugin->caps & TMX_CAP_HOST_MEMORY))
            st = tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s runs on host memory and has no "
                         "kernels for kernel set %s", name, m->k->plugin->name);
    }
    if (st == TMX_OK) {
        st = m->codec_ops->init(tmx_host_get(), tmx_plugins_opts(ps, m->codec), &m->codec_ctx,
                                err);
        if (st != TMX_OK) m->codec_ops->fini(m->codec_ctx); /* safe after a failed init */
    }
    if (st != TMX_OK) m->codec = NULL;
    json_decref(q);
    return st;
}

enum tmx_status tmx_model_load(const struct tmx_checkpoint *ck, const struct tmx_kernels *k,
                               struct tmx_plugins *ps, struct tmx_model **out, char **err) {
    struct tmx_model *m = calloc(1, sizeof *m);
    if (!m) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    m->k = k;
    enum tmx_status st = tmx_model_config_load(tmx_checkpoint_dir(ck), &m->cfg, err);
    if (st == TMX_OK) st = open_codec(m, tmx_checkpoint_dir(ck), ps, err);
    const struct tmx_model_config *c = &m->cfg;
    if (st == TMX_OK) {
        m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
        if (!m->layers) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    if (st == TMX_OK) st = bind(m, ck, &m->embed, 0, err, "model.embed_tokens.weight",
                                c->vocab_size, c->hidden);
    if (st == TMX_OK) st = bind(m, ck, &m->final_norm, 0, err, "model.norm.weight",
                                c->hidden, -1);
    if (st == TMX_OK && !c->tie_word_embeddings)
        st = bind(m, ck, &m->lm_head, 0, err, "lm_head.weight", c->vocab_size, c->hidden);
    for (int l = 0; st == TMX_OK && l < c->n_layers; l++) st = bind_layer(m, ck, l, err);
    if (st == TMX_OK) st = upload_freqs(m, c->rope_theta, &m->inv_freq_full, err);
    if (st == TMX_OK) st = upload_freqs(m, c->rope_local_theta, &m->inv_freq_local, err);
    if (st != TMX_OK) {
        tmx_model_free(m);
        return st;
    }
    *out = m;
    return TMX_OK;
}

void tmx_model_free(struct tmx_model *m) {
    if (!m) return;
    const struct tmx_kernels_i *ops = m->k->ops;
    for (int i = 0; i < m->n_imported; i++) ops->weight_free(m->k->ctx, m->imported[i]);
    if (m->inv_freq_full) ops->buf_free(m->k->ctx, m->inv_freq_full);
    if (m->inv_freq_local) ops->buf_free(m->k->ctx, m->inv_freq_local);
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        free(m->layers[l].experts);
        if (m->layers[l].codec_layer)
            m->codec_ops->layer_free(m->codec_ctx, m->layers[l].codec_layer);
    }
    if (m->codec) m->codec_ops->fini(m->codec_ctx);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->imported);
    free(m);
}

const struct tmx_model_config *tmx_model_cfg(const struct tmx_model *m) { return &m->cfg; }

/* --- sequences ----------------------------------------------------------------------------- */

struct kv {
    float *k, *v; /* [cap][n_kv_heads][head_dim] */
    int cap;      /* position p lives in slot p % cap */
};

struct tmx_seq {
    struct tmx_model *m;
    int n_ctx, n_batch, n_past;
    struct kv *kv;        /* [n_layers] */
    /* scratch of one step, n_batch rows each (device buffers) */
    int32_t *tok, *pos;   /* [B] */
    float *h, *x, *o;     /* [B][hidden] residual stream, normed input, block output */
    float *q, *att;       /* [B][n_heads*head_dim] */
    float *kk, *vv;       /* [B][n_kv_heads*head_dim] */
    float *f1, *f2;       /* [B][max(intermediate, shared width)] */
    float *rl, *rw;       /* [B][n_experts] router logits, [B][top_k] routing weights */
    int32_t *rid;         /* [B][top_k] routed expert ids */
    float *z, *y;         /* [B][moe_latent] */
    float *logits;        /* [B][vocab_size] */
    int32_t *pos_host;    /* [B] */
    tmx_capture_fn capture; /* calibration hook, or NULL */
    void *capture_arg;
};

/* Allocates one zeroed device buffer of the sequence. */
static enum tmx_status seq_alloc(struct tmx_seq *s, void *pp, size_t nbytes, char **err) {
    const struct tmx_kernels *k = s->m->k;
    enum tmx_status st = k->ops->buf_alloc(k->ctx, nbytes ? nbytes : 1, (void **)pp);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s: cannot allocate %zu bytes for the sequence",
                       k->plugin->name, nbytes);
    return TMX_OK;
}

enum tmx_status tmx_seq_new(struct tmx_model *m, int n_ctx, int n_batch, struct tmx_seq **out,
                            char **err) {
    const struct tmx_model_config *c = &m->cfg;
    if (n_ctx < 1 || n_batch < 1)
        return tmx_err(err, TMX_ERR_INVALID, "context (%d) and batch (%d) must be positive",
                       n_ctx, n_batch);
    if (n_batch > n_ctx) n_batch = n_ctx;
    struct tmx_seq *s = calloc(1, sizeof *s);
    if (!s) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    s->m = m;
    s->n_ctx = n_ctx;
    s->n_batch = n_batch;
    const size_t B = (size_t)n_batch, F = sizeof(float), D = (size_t)c->hidden;
    const size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    size_t ffn = (size_t)c->intermediate_size;
    if ((size_t)c->n_shared_experts * c->moe_intermediate_size > ffn)
        ffn = (size_t)c->n_shared_experts * c->moe_intermediate_size;
    const size_t E = (size_t)c->n_routed_experts, K = (size_t)c->n_experts_per_tok,
                 lat = (size_t)c->moe_latent_size;
    enum tmx_status st = TMX_OK;
    s->kv = calloc((size_t)c->n_layers, sizeof *s->kv);
    s->pos_host = malloc(B * sizeof *s->pos_host);
    if (!s->kv || !s->pos_host) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    /* A sliding layer keeps window + n_batch slots: enough for the oldest position the first
     * query of a step still sees, while the step writes n_batch new ones. */
    for (int l = 0; st == TMX_OK && l < c->n_layers; l++) {
        struct kv *kv = &s->kv[l];
        kv->cap = c->sliding[l] && c->sliding_window + n_batch < n_ctx
                      ? c->sliding_window + n_batch : n_ctx;
        if ((st = seq_alloc(s, &kv->k, (size_t)kv->cap * kvd * F, err)) == TMX_OK)
            st = seq_alloc(s, &kv->v, (size_t)kv->cap * kvd * F, err);
    }
    struct {
        void *pp;
        size_t nbytes;
    } bufs[] = {
        {&s->tok, B * 4},       {&s->pos, B * 4},        {&s->h, B * D * F},
        {&s->x, B * D * F},     {&s->o, B * D * F},      {&s->q, B * qd * F},
        {&s->att, B * qd * F},  {&s->kk, B * kvd * F},   {&s->vv, B * kvd * F},
        {&s->f1, B * ffn * F},  {&s->f2, B * ffn * F},   {&s->rl, B * E * F},
        {&s->rw, B * K * F},    {&s->rid, B * K * 4},    {&s->z, B * lat * F},
        {&s->y, B * lat * F},   {&s->logits, B * (size_t)c->vocab_size * F},
    };
    for (size_t i = 0; st == TMX_OK && i < sizeof bufs / sizeof bufs[0]; i++)
        st = seq_alloc(s, bufs[i].pp, bufs[i].nbytes, err);
    if (st != TMX_OK) {
        tmx_seq_free(s);
        return st;
    }
    *out = s;
    return TMX_OK;
}

void tmx_seq_free(struct tmx_seq *s) {
    if (!s) return;
    const struct tmx_kernels *k = s->m->k;
    void *bufs[] = {s->tok, s->pos, s->h, s->x, s->o, s->q, s->att, s->kk, s->vv,
                    s->f1, s->f2, s->rl, s->rw, s->rid, s->z, s->y, s->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) k->ops->buf_free(k->ctx, bufs[i]);
    for (int l = 0; s->kv && l < s->m->cfg.n_layers; l++) {
        if (s->kv[l].k) k->ops->buf_free(k->ctx, s->kv[l].k);
        if (s->kv[l].v) k->ops->buf_free(k->ctx, s->kv[l].v);
    }
    free(s->kv);
    free(s->pos_host);
    free(s);
}

int tmx_seq_n_past(const struct tmx_seq *s) { return s->n_past; }

/* The cache keeps stale rows; positions decide what attention reads, so resetting is free. */
void tmx_seq_reset(struct tmx_seq *s) { s->n_past = 0; }

static const struct tmx_tensor *opt(const struct tmx_tensor *t) { return t->data ? t : NULL; }

enum tmx_status tmx_seq_set_capture(struct tmx_seq *s, tmx_capture_fn fn, void *arg, char **err) {
    const struct tmx_kernels *k = s->m->k;
    if (fn && !(k->plugin->caps & TMX_CAP_HOST_MEMORY))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "kernel set %s: its buffers are not host "
                       "memory, so a forward pass cannot be captured", k->plugin->name);
    s->capture = fn;
    s->capture_arg = arg;
    return TMX_OK;
}

/* --- the forward pass ---------------------------------------------------------------------- */

/* One step over n <= n_batch tokens already in s->tok / s->pos. Leaves the final hidden states
 * (before the final norm) in s->h. */
static enum tmx_status forward_step(struct tmx_seq *s, int n, char **err) {
    const struct tmx_model *m = s->m;
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    void *kc = m->k->ctx;
    const int D = c->hidden, hq = c->n_heads, hkv = c->n_kv_heads, hd = c->head_dim;
    const float eps = (float)c->rms_norm_eps, scale = 1.0f / sqrtf((float)hd);

    op->embed(kc, s->h, &m->embed, s->tok, n);
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer *ly = &m->layers[l];
        const struct kv *kv = &s->kv[l];

        /* attention */
        op->rmsnorm(kc, s->x, s->h, &ly->attn_norm, n, D, eps);
        op->matmul(kc, s->q, s->x, &ly->wq, n);
        op->matmul(kc, s->kk, s->x, &ly->wk, n);
        op->matmul(kc, s->vv, s->x, &ly->wv, n);
        if (ly->q_norm.data) op->rmsnorm(kc, s->q, s->q, &ly->q_norm, n * hq, hd, eps);
        if (ly->k_norm.data) op->rmsnorm(kc, s->kk, s->kk, &ly->k_norm, n * hkv, hd, eps);
        const float *freqs = c->sliding[l] ? m->inv_freq_local : m->inv_freq_full;
        op->rope(kc, s->q, s->pos, freqs, n, hq, hd);
        op->rope(kc, s->kk, s->pos, freqs, n, hkv, hd);
        op->kv_store(kc, kv->k, kv->v, kv->cap, s->kk, s->vv, s->pos, n, hkv, hd);
        op->attention(kc, s->att, s->q, kv->k, kv->v, kv->cap, s->pos, n, hq, hkv, hd,
                      c->sliding[l] ? c->sliding_window : 0, scale);
        op->matmul(kc, s->o, s->att, &ly->wo, n);
        op->add_gated(kc, s->h, s->o, opt(&ly->attn_gate), n, D);

        /* MLP: dense SwiGLU, or routed experts behind the bridges */
        op->rmsnorm(kc, s->x, s->h, &ly->mlp_norm, n, D, eps);
        if (c->dense[l]) {
            const int64_t f = ly->gate.shape[0];
            op->matmul(kc, s->f1, s->x, &ly->gate, n);
            op->matmul(kc, s->f2, s->x, &ly->up, n);
            op->swiglu(kc, s->f1, s->f1, s->f2, n * f);
            op->matmul(kc, s->o, s->f1, &ly->down, n);
        } else {
            op->matmul(kc, s->rl, s->x, &ly->router, n);
            op->moe_route(kc, s->rid, s->rw, s->rl, opt(&ly->router_bias), n,
                          c->n_routed_experts, c->n_experts_per_tok, c->router_score,
                          c->norm_topk_prob, (float)c->routed_scaling_factor);
            op->matmul(kc, s->z, s->x, &ly->bridge_in, n);
            if (s->capture) { /* calibration: the buffers are host memory (tmx_seq_set_capture) */
                const struct tmx_moe_capture cap = {l, n, c->n_experts_per_tok, s->x, s->z,
                                                    s->rid, s->rw};
                enum tmx_status st = op->sync(kc);
                if (st != TMX_OK)
                    return tmx_err(err, st, "kernel set %s failed during the forward pass",
                                   m->k->plugin->name);
                if ((st = s->capture(s->capture_arg, &cap, err)) != TMX_OK) return st;
            }
            if (!ly->codec_layer) {
                op->moe_experts(kc, s->y, s->z, s->rid, s->rw, n, c->n_experts_per_tok, &ly->moe);
            } else { /* the codec's host path reads the buffers: finish the queued ops first */
                enum tmx_status st = op->sync(kc);
                if (st == TMX_OK)
                    st = m->codec_ops->moe_experts(m->codec_ctx, ly->codec_layer, s->y, s->z,
                                                   s->rid, s->rw, n, c->n_experts_per_tok,
                                                   opt(&ly->post_norm), eps, err);
                if (st != TMX_OK) return st;
            }
            op->matmul(kc, s->o, s->y, &ly->bridge_out, n);
            if (ly->gate.data) { /* shared expert on the hidden state */
                const int64_t f = ly->gate.shape[0];
                op->matmul(kc, s->f1, s->x, &ly->gate, n);
                op->matmul(kc, s->f2, s->x, &ly->up, n);
                op->swiglu(kc, s->f1, s->f1, s->f2, n * f);
                op->matmul(kc, s->x, s->f1, &ly->down, n);
                op->add_gated(kc, s->o, s->x, NULL, n, D);
            }
        }
        op->add_gated(kc, s->h, s->o, opt(&ly->mlp_gate), n, D);
    }
    return TMX_OK;
}

enum tmx_status tmx_seq_forward(struct tmx_seq *s, const int32_t *tokens, int n, float *logits,
                                int all_rows, char **err) {
    const struct tmx_model *m = s->m;
    const struct tmx_model_config *c = &m->cfg;
    const struct tmx_kernels_i *op = m->k->ops;
    void *kc = m->k->ctx;
    const size_t row = (size_t)c->vocab_size * sizeof(float);
    if (n < 1) return tmx_err(err, TMX_ERR_INVALID, "forward: no tokens");
    if (s->n_past + n > s->n_ctx)
        return tmx_err(err, TMX_ERR_INVALID,
                       "context full: %d tokens in the sequence + %d new > context %d",
                       s->n_past, n, s->n_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return tmx_err(err, TMX_ERR_INVALID, "token id %d out of range [0, %d)", tokens[i],
                           c->vocab_size);
    const struct tmx_tensor *head = c->tie_word_embeddings ? &m->embed : &m->lm_head;
    for (int done = 0; done < n;) {
        const int chunk = n - done < s->n_batch ? n - done : s->n_batch;
        for (int i = 0; i < chunk; i++) s->pos_host[i] = s->n_past + i;
        enum tmx_status st = op->buf_write(kc, s->tok, tokens + done, (size_t)chunk * 4);
        if (st == TMX_OK) st = op->buf_write(kc, s->pos, s->pos_host, (size_t)chunk * 4);
        if (st != TMX_OK) return tmx_err(err, st, "kernel set: cannot upload tokens");
        if ((st = forward_step(s, chunk, err)) != TMX_OK) return st;
        /* logits: every row, or only the sequence's last one */
        const int last = done + chunk == n;
        const int rows = all_rows ? chunk : last ? 1 : 0;
        if (rows > 0) {
            const float *hrow = s->h + (size_t)(chunk - rows) * c->hidden;
            op->rmsnorm(kc, s->x, hrow, &m->final_norm, rows, c->hidden, (float)c->rms_norm_eps);
            op->matmul(kc, s->logits, s->x, head, rows);
            float *dst = all_rows ? logits + (size_t)done * c->vocab_size : logits;
            st = op->buf_read(kc, dst, s->logits, (size_t)rows * row);
        }
        if (st == TMX_OK) st = op->sync(kc);
        if (st != TMX_OK)
            return tmx_err(err, st, "kernel set %s failed during the forward pass: %s",
                           m->k->plugin->name, tmx_status_str(st));
        s->n_past += chunk;
        done += chunk;
    }
    return TMX_OK;
}
