/* model.c: loading a Muse (or Llama) checkpoint onto a kernel set (docs/model.md).
 *
 * Loading binds every tensor by name, checks its shape, and imports it into the kernel set;
 * routed experts go to the checkpoint's codec when it has one (from a rank's folder when the
 * checkpoint is a tmx pack, tmx/pack.h). A rank of a tensor-parallel model binds its slice of
 * each split weight (docs/tp.md): row slices are views of the mmapped tensor, column slices
 * copies the model owns. The KV cache, sequences and the forward step are in forward.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model-impl.h"
#include "pool.h"
#include "tmx/log.h"
#include "tmx/pack.h"

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

/* Frees an array own() gave out that no imported weight uses. */
static void disown(struct tmx_model *m, void *a) {
    for (int i = m->n_owned; i-- > 0;)
        if (m->owned[i] == a) {
            free(a);
            m->owned[i] = m->owned[--m->n_owned];
            return;
        }
}

/* A rank's slice of a 2-D weight: rows [lo, lo + len) or columns [lo, lo + len); zero_row
 * appends a row of zeros (the embedding's, for ids of other ranks). */
struct cut {
    int cols;
    int64_t lo, len;
    int zero_row;
};

/* tmx_checkpoint_find, noting that the graph reads the tensor (tensors it never reads are
 * named once the model is loaded). */
static int find(struct tmx_model *m, const struct tmx_checkpoint *ck, const char *name,
                struct tmx_tensor *t) {
    const int64_t i = tmx_checkpoint_index(ck, name);
    if (i < 0) return -1;
    m->bound[i] = 1;
    return tmx_checkpoint_find(ck, name, t);
}

/* Whether an MXFP8 tensor can be cut as c says: rows, or columns in whole blocks of 32. */
static int mxfp8_cuts(const struct cut *c) {
    return !c || (!c->zero_row && (!c->cols || (c->lo % 32 == 0 && c->len % 32 == 0)));
}

/* MXFP8 tensor `name` (E4M3 codes *t [rows][cols], `name`_scale U8 [rows][cols / 32]) ->
 * *t, one TMX_DTYPE_MXFP8 tensor (tmx/tensor.h) the model owns, cut as c says (NULL: all of
 * it; mxfp8_cuts(c)). */
static enum tmx_status pack_mxfp8(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                  const char *name, const struct cut *c, struct tmx_tensor *t,
                                  char **err) {
    char sname[256];
    struct tmx_tensor sc;
    snprintf(sname, sizeof sname, "%s_scale", name);
    const int64_t rows = t->shape[0], cols = t->ndim == 2 ? t->shape[1] : 1;
    if (find(m, ck, sname, &sc) != 0 || sc.dtype != TMX_DTYPE_U8 || sc.ndim != 2 ||
        t->ndim != 2 || cols % 32 || sc.shape[0] != rows || sc.shape[1] != cols / 32)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: F8_E4M3 tensor %s needs %s, U8 [%lld][%lld] (one UE8M0 scale per 32)",
                       tmx_checkpoint_dir(ck), name, sname, (long long)rows, (long long)(cols / 32));
    int64_t r0 = 0, nr = rows, c0 = 0, nc = cols;
    if (c && c->cols) c0 = c->lo, nc = c->len;
    else if (c) r0 = c->lo, nr = c->len;
    uint8_t *dst = own(m, (size_t)(nr * nc) + (size_t)(nr * nc / 32));
    if (!dst) return tmx_err(err, TMX_ERR_NOMEM, "out of memory packing %s", name);
    const uint8_t *q = t->data, *s = sc.data;
    uint8_t *ds = dst + nr * nc; /* [nr][nc / 32] */
    for (int64_t r = 0; r < nr; r++) {
        memcpy(dst + r * nc, q + (r0 + r) * cols + c0, (size_t)nc);
        memcpy(ds + r * (nc / 32), s + (r0 + r) * (cols / 32) + c0 / 32, (size_t)(nc / 32));
    }
    *t = (struct tmx_tensor){TMX_DTYPE_MXFP8, 2, {nr, nc}, dst};
    return TMX_OK;
}

/* *t (MXFP8, packed by pack_mxfp8) -> its BF16 values, exact, in an array the model owns; the
 * packed array is freed. */
static enum tmx_status expand_mxfp8(struct tmx_model *m, const char *name, struct tmx_tensor *t,
                                    char **err) {
    uint16_t *dst = own(m, (size_t)tmx_tensor_numel(t) * 2);
    if (!dst) return tmx_err(err, TMX_ERR_NOMEM, "out of memory expanding %s", name);
    tmx_mxfp8_to_bf16(t, dst);
    disown(m, t->data);
    *t = (struct tmx_tensor){TMX_DTYPE_BF16, 2, {t->shape[0], t->shape[1]}, dst};
    return TMX_OK;
}

/* host <- the cut of host: rows are a view of the same data, unless a zero row is appended;
 * columns and the zero row make a copy the model owns. */
static enum tmx_status cut_weight(struct tmx_model *m, const char *name, const struct cut *c,
                                  struct tmx_tensor *host, char **err) {
    const size_t es = tmx_dtype_size(host->dtype);
    const int64_t rows = host->shape[0], cols = host->shape[1];
    if (!c->cols && !c->zero_row) {
        host->data = (char *)host->data + (size_t)(c->lo * cols) * es;
        host->shape[0] = c->len;
        return TMX_OK;
    }
    const int64_t out_rows = c->cols ? rows : c->len + c->zero_row, out_cols = c->cols ? c->len
                                                                                        : cols;
    char *dst = own(m, (size_t)(out_rows * out_cols) * es);
    if (!dst) return tmx_err(err, TMX_ERR_NOMEM, "out of memory slicing %s", name);
    const char *src = host->data;
    if (c->cols) {
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + (size_t)(r * out_cols) * es, src + (size_t)(r * cols + c->lo) * es,
                   (size_t)out_cols * es);
    } else {
        memcpy(dst, src + (size_t)(c->lo * cols) * es, (size_t)(c->len * cols) * es);
        memset(dst + (size_t)(c->len * cols) * es, 0, (size_t)cols * es);
    }
    *host = (struct tmx_tensor){host->dtype, 2, {out_rows, out_cols}, dst};
    return TMX_OK;
}

#define SHAPE_STR (TMX_MAX_DIMS * 22 + 3)

/* "[d0, d1, ...]" of every dimension, into buf[SHAPE_STR]. */
static const char *shape_str(char *buf, const int64_t *shape, int ndim) {
    int n = snprintf(buf, SHAPE_STR, "[");
    for (int i = 0; i < ndim && i < TMX_MAX_DIMS; i++)
        n += snprintf(buf + n, SHAPE_STR - (size_t)n, "%s%lld", i ? ", " : "",
                      (long long)shape[i]);
    snprintf(buf + n, SHAPE_STR - (size_t)n, "]");
    return buf;
}

#define BIND_OPTIONAL 1u /* a missing tensor leaves dev->data NULL */
#define BIND_MATMUL 2u   /* a weight of the matmul op: MXFP8 stays MXFP8 where the set takes it */

/* Binds `name` to *dev: looks it up, checks dtype and shape, cuts this rank's slice (cut NULL:
 * all of it), imports it. An MXFP8 tensor is offered to the set as such when it is a matmul
 * weight whose slice keeps whole blocks of 32, else (or when the set declines it) as its BF16
 * values. Shape dims < 0 end the list. */
static enum tmx_status bind_cut(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                struct tmx_tensor *dev, unsigned flags, const struct cut *cut,
                                char **err, const char *name, int64_t d0, int64_t d1) {
    struct tmx_tensor host;
    enum tmx_status st;
    memset(dev, 0, sizeof *dev);
    if (find(m, ck, name, &host) != 0)
        return flags & BIND_OPTIONAL ? TMX_OK
                        : tmx_err(err, TMX_ERR_NOT_FOUND, "%s: tensor %s is missing",
                                  tmx_checkpoint_dir(ck), name);
    int ndim = d1 >= 0 ? 2 : 1;
    if (host.ndim != ndim || host.shape[0] != d0 || (ndim == 2 && host.shape[1] != d1)) {
        const int64_t want[2] = {d0, d1};
        char has[SHAPE_STR], implied[SHAPE_STR];
        return tmx_err(err, TMX_ERR_INVALID, "%s: tensor %s has shape %s, config.json implies %s",
                       tmx_checkpoint_dir(ck), name, shape_str(has, host.shape, host.ndim),
                       shape_str(implied, want, ndim));
    }
    /* sets built before ABI 2.2 do not know the dtype: they get BF16 without being asked */
    const int mm = (flags & BIND_MATMUL) && mxfp8_cuts(cut) && m->k->plugin->abi_minor >= 2;
    if (host.dtype == TMX_DTYPE_F8_E4M3) {
        if ((st = pack_mxfp8(m, ck, name, mm ? cut : NULL, &host, err)) != TMX_OK) return st;
        if (mm)
            cut = NULL; /* cut already */
        else if ((st = expand_mxfp8(m, name, &host, err)) != TMX_OK)
            return st;
    }
    if (host.dtype != TMX_DTYPE_F32 && host.dtype != TMX_DTYPE_BF16 &&
        host.dtype != TMX_DTYPE_F16 && host.dtype != TMX_DTYPE_MXFP8)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: tensor %s is %s; dense weights must be "
                       "F32, BF16, F16 or MXFP8", tmx_checkpoint_dir(ck), name,
                       tmx_dtype_name(host.dtype));
    if (cut && ndim == 2 && (st = cut_weight(m, name, cut, &host, err)) != TMX_OK) return st;
    if (m->n_imported == m->cap_imported) {
        int cap = m->cap_imported ? 2 * m->cap_imported : 256;
        struct tmx_tensor **p = realloc(m->imported, (size_t)cap * sizeof *p);
        if (!p) return tmx_err(err, TMX_ERR_NOMEM, "out of memory binding %s", name);
        m->imported = p;
        m->cap_imported = cap;
    }
    st = m->k->ops->weight_import(m->k->ctx, &host, dev, err);
    if (st == TMX_ERR_UNSUPPORTED && host.dtype == TMX_DTYPE_MXFP8) {
        if (err) {
            free(*err);
            *err = NULL;
        }
        if ((st = expand_mxfp8(m, name, &host, err)) == TMX_OK)
            st = m->k->ops->weight_import(m->k->ctx, &host, dev, err);
    }
    if (st == TMX_OK) m->imported[m->n_imported++] = dev;
    return st;
}

static enum tmx_status bind(struct tmx_model *m, const struct tmx_checkpoint *ck,
                            struct tmx_tensor *dev, unsigned flags, char **err, const char *name,
                            int64_t d0, int64_t d1) {
    return bind_cut(m, ck, dev, flags, NULL, err, name, d0, d1);
}

/* Rank r's part of n equal parts of `width` rows (cols 0) or columns (cols 1); NULL with one
 * rank, which binds the whole weight. */
static const struct cut *part(const struct tmx_model *m, struct cut *c, int cols, int64_t width) {
    if (m->tp.n == 1) return NULL;
    *c = (struct cut){cols, width * m->tp.rank, width, 0};
    return c;
}

#define NAME(buf, ...) (snprintf(buf, sizeof buf, __VA_ARGS__), buf)

/* The router's correction bias is read by moe_route as F32. */
static enum tmx_status bind_bias(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                 struct layer *ly, int l, char **err) {
    char n[256];
    struct tmx_tensor host;
    memset(&ly->router_bias, 0, sizeof ly->router_bias);
    if (find(m, ck, NAME(n, "model.layers.%d.mlp.router.correction_bias", l), &host))
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
    const struct tp_shard *tp = &m->tp;
    struct layer *ly = &m->layers[l];
    const int64_t d = c->hidden, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t qs = (int64_t)tp->hq * c->head_dim, kvs = (int64_t)tp->hkv * c->head_dim;
    char n[256];
    struct cut cut;
    enum tmx_status st;
#define B(t, opt, d0, d1, ...) \
    if ((st = bind(m, ck, &ly->t, opt, err, NAME(n, __VA_ARGS__), d0, d1))) return st
#define C(t, cols, w, d0, d1, ...) \
    if ((st = bind_cut(m, ck, &ly->t, BIND_MATMUL, part(m, &cut, cols, w), err,                \
                       NAME(n, __VA_ARGS__), d0, d1)))                                        \
    return st
    B(attn_norm, 0, d, -1, "model.layers.%d.input_layernorm.weight", l);
    C(wq, 0, qs, qd, d, "model.layers.%d.self_attn.q_proj.weight", l);
    C(wk, 0, kvs, kvd, d, "model.layers.%d.self_attn.k_proj.weight", l);
    C(wv, 0, kvs, kvd, d, "model.layers.%d.self_attn.v_proj.weight", l);
    C(wo, 1, qs, d, qd, "model.layers.%d.self_attn.o_proj.weight", l);
    B(q_norm, 1, c->head_dim, -1, "model.layers.%d.self_attn.q_norm.weight", l);
    B(k_norm, 1, c->head_dim, -1, "model.layers.%d.self_attn.k_norm.weight", l);
    B(mlp_norm, 0, d, -1, "model.layers.%d.post_attention_layernorm.weight", l);
    if (c->residual_gates) {
        B(attn_gate, 0, d, -1, "model.layers.%d.attn_gate", l);
        B(mlp_gate, 0, d, -1, "model.layers.%d.mlp_gate", l);
    }
    if (c->dense[l]) {
        const int64_t f = c->intermediate_size;
        C(gate, 0, tp->ffn, f, d, "model.layers.%d.mlp.gate_proj.weight", l);
        C(up, 0, tp->ffn, f, d, "model.layers.%d.mlp.up_proj.weight", l);
        C(down, 1, tp->ffn, d, f, "model.layers.%d.mlp.down_proj.weight", l);
        return TMX_OK;
    }
    const int64_t E = c->n_routed_experts, lat = c->moe_latent_size,
                  f = c->moe_intermediate_size, fs = (int64_t)c->n_shared_experts * f;
    B(router, 0, E, d, "model.layers.%d.mlp.router.weight", l);
    B(bridge_in, 0, lat, d, "model.layers.%d.mlp.bridge_in.weight", l);
    B(bridge_out, 0, d, lat, "model.layers.%d.mlp.bridge_out.weight", l);
    B(post_norm, 1, lat, -1, "model.layers.%d.mlp.post_expert_norm.weight", l);
    if (fs > 0) {
        C(gate, 0, tp->shared, fs, d, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l);
        C(up, 0, tp->shared, fs, d, "model.layers.%d.mlp.shared_experts.up_proj.weight", l);
        C(down, 1, tp->shared, d, fs, "model.layers.%d.mlp.shared_experts.down_proj.weight", l);
    }
#undef B
#undef C
    if ((st = bind_bias(m, ck, ly, l, err))) return st;
    if (m->codec) {
        const struct tmx_codec_layer_info info = {m->codec_dir, l, (int)E, (int)lat, (int)f};
        st = tp->n > 1 ? m->codec_ops->layer_load_slice(m->codec_ctx, &info, tp->rank, tp->n,
                                                        &ly->codec_layer, err)
                       : m->codec_ops->layer_load(m->codec_ctx, &info, &ly->codec_layer, err);
        if (st == TMX_OK && !(m->k->plugin->caps & TMX_CAP_HOST_MEMORY)) {
            const struct tmx_kernels_i *op = m->k->ops;
            void *stream = TMX_OPS_HAS(op, native_stream) ? op->native_stream(m->k->ctx) : NULL;
            st = m->codec_ops->device_load(m->codec_ctx, ly->codec_layer, m->k->plugin->name,
                                           stream, &ly->codec_dev, err);
        }
        return st;
    }
    ly->experts = calloc((size_t)(3 * E), sizeof *ly->experts);
    if (!ly->experts) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    static const char *proj[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int p = 0; p < 3; p++)
        for (int e = 0; e < E; e++) {
            st = bind_cut(m, ck, &ly->experts[p * E + e], 0, part(m, &cut, p == 2, tp->inter),
                          err, NAME(n, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj[p]),
                          p < 2 ? f : lat, p < 2 ? lat : f);
            if (st) return st;
        }
    ly->moe = (struct tmx_moe_weights){
        .n_experts = (int)E, .expert0 = 0, .latent = (int)lat, .inter = tp->inter,
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
    struct tmx_quant_config q;
    enum tmx_status st = tmx_quant_config_load(dir, &q, err);
    if (st != TMX_OK || !q.present) return st;
    const char *path = q.path, *method = q.quant_method, *name = q.codec;
    if (!*method || !*name)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: fields \"quant_method\" and \"codec\" must be "
                     "strings", path);
    if (st == TMX_OK) st = tmx_plugins_load(ps, TMX_PLUGIN_CODEC, name, &m->codec, err);
    if (st == TMX_OK) {
        m->codec_ops = m->codec->ops;
        if (strcmp(m->codec_ops->quant_method, method) != 0)
            st = tmx_err(err, TMX_ERR_INVALID, "%s: quant_method \"%s\", but codec.%s reads "
                         "\"%s\"", path, method, name, m->codec_ops->quant_method);
        else if (!(m->k->plugin->caps & TMX_CAP_HOST_MEMORY) &&
                 !(TMX_OPS_HAS(m->codec_ops, device_load) &&
                   TMX_OPS_HAS(m->codec_ops, device_free) &&
                   TMX_OPS_HAS(m->codec_ops, device_moe_experts)))
            st = tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s runs on host memory and has no "
                         "kernels for kernel set %s", name, m->k->plugin->name);
    }
    if (st == TMX_OK) {
        st = m->codec_ops->init(tmx_host_get(), tmx_plugins_opts(ps, m->codec), &m->codec_ctx,
                                err);
        if (st != TMX_OK) m->codec_ops->fini(m->codec_ctx); /* safe after a failed init */
    }
    /* A host-memory set lends the codec its threads: two pools on the same cores would take
     * them from each other, the idle one spinning while the other works. */
    struct tmx_threads threads;
    if (st == TMX_OK && TMX_OPS_HAS(m->codec_ops, use_threads) &&
        tmx_model_host_threads(m, &threads)) {
        m->codec_ops->use_threads(m->codec_ctx, &threads);
        tmx_log(TMX_LOG_DEBUG, "codec.%s runs on kernel set %s's %d threads", m->codec->name,
                m->k->plugin->name, threads.n_threads);
    }
    if (st != TMX_OK) m->codec = NULL;
    return st;
}

/* This rank's widths, after checking that every split one divides into the ranks: heads and
 * KV heads, the dense and shared MLPs, and the routed experts along 16-wide tile rows (a
 * codec checks its own boundaries when it opens a layer). The vocabulary goes in parts of
 * ceil(vocab_size / n), the last one shorter. */
static enum tmx_status plan_shard(struct tmx_model *m, const char *dir, int rank, int n,
                                  char **err) {
    const struct tmx_model_config *c = &m->cfg;
    struct tp_shard *tp = &m->tp;
    int has_dense = 0, has_moe = 0;
    for (int l = 0; l < c->n_layers; l++) {
        has_dense |= c->dense[l];
        has_moe |= !c->dense[l];
    }
    const struct {
        const char *field;
        int64_t value, unit; /* value must be a multiple of n * unit */
        int used;
    } split[] = {
        {"num_attention_heads", c->n_heads, 1, 1},
        {"num_key_value_heads", c->n_kv_heads, 1, 1},
        {"intermediate_size", c->intermediate_size, 1, has_dense},
        {"moe_intermediate_size", c->moe_intermediate_size, m->codec ? 1 : 16, has_moe},
    };
    for (size_t i = 0; n > 1 && i < sizeof split / sizeof split[0]; i++)
        if (split[i].used && split[i].value % (n * split[i].unit))
            return tmx_err(err, TMX_ERR_INVALID, "%s/config.json: %s = %lld does not split "
                           "into tp = %d ranks%s", dir, split[i].field,
                           (long long)split[i].value, n,
                           split[i].unit > 1 ? " on 16-wide tile boundaries" : "");
    const int stride = (c->vocab_size + n - 1) / n;
    if (stride * (n - 1) >= c->vocab_size)
        return tmx_err(err, TMX_ERR_INVALID, "%s/config.json: vocab_size = %d is too small for "
                       "tp = %d ranks", dir, c->vocab_size, n);
    *tp = (struct tp_shard){
        .rank = rank, .n = n, .hq = c->n_heads / n, .hkv = c->n_kv_heads / n,
        .ffn = c->intermediate_size / n,
        .shared = c->n_shared_experts * c->moe_intermediate_size / n,
        .inter = c->moe_intermediate_size / n, .vocab0 = stride * rank,
        .vocab_n = rank == n - 1 ? c->vocab_size - stride * rank : stride,
        .vocab_stride = stride};
    if (n == 1 || !has_moe) return TMX_OK;
    const struct tmx_kernels_i *op = m->k->ops;
    if (!TMX_OPS_HAS(op, moe_experts_partial) || !TMX_OPS_HAS(op, moe_combine))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "kernel set %s has no tensor-parallel ops "
                       "(moe_experts_partial, moe_combine): it runs tp = 1 only",
                       m->k->plugin->name);
    if (m->codec && (!TMX_OPS_HAS(m->codec_ops, layer_load_slice) ||
                     !TMX_OPS_HAS(m->codec_ops, moe_experts_partial)))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s has no tensor-parallel path "
                       "(layer_load_slice, moe_experts_partial): it runs tp = 1 only",
                       m->codec->name);
    if (m->codec && !(m->k->plugin->caps & TMX_CAP_HOST_MEMORY))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s has no tensor-parallel device path "
                       "for kernel set %s: it runs tp = 1 there", m->codec->name,
                       m->k->plugin->name);
    return TMX_OK;
}

/* The embedding, the final norm and the lm_head. With several ranks each holds its rows of the
 * vocabulary: the embedding with a zero row appended (ids of other ranks read it, so that the
 * all-reduce of the ranks' lookups is the lookup), the lm_head (a tied one bound from the
 * embedding's rows) for its slice of the logits. */
static enum tmx_status bind_ends(struct tmx_model *m, const struct tmx_checkpoint *ck,
                                 char **err) {
    const struct tmx_model_config *c = &m->cfg;
    const struct tp_shard *tp = &m->tp;
    const char *embed = "model.embed_tokens.weight";
    const struct cut rows = {0, tp->vocab0, tp->vocab_n, 0}, zero = {0, tp->vocab0, tp->vocab_n, 1};
    const int split = tp->n > 1;
    enum tmx_status st = bind_cut(m, ck, &m->embed, 0, split ? &zero : NULL, err, embed,
                                  c->vocab_size, c->hidden);
    if (st == TMX_OK) st = bind(m, ck, &m->final_norm, 0, err, "model.norm.weight", c->hidden,
                                -1);
    if (st == TMX_OK && (split || !c->tie_word_embeddings))
        st = bind_cut(m, ck, &m->lm_head, BIND_MATMUL, split ? &rows : NULL, err,
                      c->tie_word_embeddings ? embed : "lm_head.weight", c->vocab_size,
                      c->hidden);
    return st;
}

/* Tensors of the checkpoint that the graph did not read: config.json may describe another
 * model than the weights (fewer layers, no shared expert, ...), or the checkpoint carries parts
 * tmx does not run (vision towers, a drafter). Named, not refused. */
static void warn_unread(const struct tmx_model *m, const struct tmx_checkpoint *ck) {
    size_t n = 0, first = 0;
    for (size_t i = tmx_checkpoint_count(ck); i-- > 0;)
        if (!m->bound[i]) n++, first = i;
    if (n)
        tmx_log(TMX_LOG_WARN, "%s: %zu tensor%s of the checkpoint %s not used by the model that "
                "config.json describes (the first: %s)", tmx_checkpoint_dir(ck), n,
                n == 1 ? "" : "s", n == 1 ? "is" : "are", tmx_checkpoint_at(ck, first, NULL, NULL));
}

enum tmx_status tmx_model_load_rank(const struct tmx_checkpoint *ck, const struct tmx_kernels *k,
                                    struct tmx_plugins *ps, const struct tmx_model_tp *tp,
                                    struct tmx_model **out, char **err) {
    struct tmx_model *m = calloc(1, sizeof *m);
    if (!m) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    m->k = k;
    m->tp.n = 1;
    const int n = tp && tp->ctl ? tmx_comm_size(tp->ctl) : 1;
    enum tmx_status st = tmx_model_config_load(tmx_checkpoint_dir(ck), &m->cfg, err);
    if (st == TMX_OK) st = open_codec(m, tmx_checkpoint_dir(ck), ps, err);
    if (st == TMX_OK)
        st = plan_shard(m, tmx_checkpoint_dir(ck), n > 1 ? tmx_comm_rank(tp->ctl) : 0, n, err);
    if (st == TMX_OK && m->codec)
        st = tmx_pack_rank_dir(tmx_checkpoint_dir(ck), m->tp.rank, n, &m->codec_dir, err);
    if (n > 1) {
        m->tp.ctl = tp->ctl;
        m->tp.data = tp->data ? tp->data : tp->ctl;
    }
    const struct tmx_model_config *c = &m->cfg;
    if (st == TMX_OK) {
        m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
        if (!m->layers) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    const size_t n_tensors = tmx_checkpoint_count(ck);
    if (st == TMX_OK && !(m->bound = calloc(n_tensors ? n_tensors : 1, 1)))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if (st == TMX_OK) st = bind_ends(m, ck, err);
    for (int l = 0; st == TMX_OK && l < c->n_layers; l++) st = bind_layer(m, ck, l, err);
    if (st == TMX_OK && m->tp.rank == 0) warn_unread(m, ck);
    free(m->bound);
    m->bound = NULL;
    if (st == TMX_OK) st = upload_freqs(m, c->rope_theta, &m->inv_freq_full, err);
    if (st == TMX_OK) st = upload_freqs(m, c->rope_local_theta, &m->inv_freq_local, err);
    if (st != TMX_OK) {
        tmx_model_free(m);
        return st;
    }
    *out = m;
    return TMX_OK;
}

enum tmx_status tmx_model_load(const struct tmx_checkpoint *ck, const struct tmx_kernels *k,
                               struct tmx_plugins *ps, struct tmx_model **out, char **err) {
    return tmx_model_load_rank(ck, k, ps, NULL, out, err);
}

int tmx_model_rank(const struct tmx_model *m) { return m->tp.rank; }
int tmx_model_n_ranks(const struct tmx_model *m) { return m->tp.n; }

void tmx_model_free(struct tmx_model *m) {
    if (!m) return;
    const struct tmx_kernels_i *ops = m->k->ops;
    tmx_model_kv_free(m);
    for (int i = 0; i < m->n_imported; i++) ops->weight_free(m->k->ctx, m->imported[i]);
    if (m->inv_freq_full) ops->buf_free(m->k->ctx, m->inv_freq_full);
    if (m->inv_freq_local) ops->buf_free(m->k->ctx, m->inv_freq_local);
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        free(m->layers[l].experts);
        if (m->layers[l].codec_dev) m->codec_ops->device_free(m->codec_ctx, m->layers[l].codec_dev);
        if (m->layers[l].codec_layer)
            m->codec_ops->layer_free(m->codec_ctx, m->layers[l].codec_layer);
    }
    if (m->codec) m->codec_ops->fini(m->codec_ctx);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->codec_dir);
    free(m->layers);
    free(m->imported);
    free(m);
}

const struct tmx_model_config *tmx_model_cfg(const struct tmx_model *m) { return &m->cfg; }

int tmx_model_host_threads(const struct tmx_model *m, struct tmx_threads *out) {
    const struct tmx_kernels_i *kops = m->k->ops;
    if (!(m->k->plugin->caps & TMX_CAP_HOST_MEMORY) || !TMX_OPS_HAS(kops, host_threads))
        return 0;
    kops->host_threads(m->k->ctx, out);
    return 1;
}

struct tmx_step_threads {
    struct tmx_threads threads;
    struct tmx_pool *own; /* NULL: the kernel set's */
};

enum tmx_status tmx_step_threads_new(const struct tmx_model *m, int n,
                                     struct tmx_step_threads **out, char **err) {
    struct tmx_step_threads *t = calloc(1, sizeof *t);
    if (!t) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if (!tmx_model_host_threads(m, &t->threads)) {
        const long online = sysconf(_SC_NPROCESSORS_ONLN);
        if (n <= 0) n = online > 0 && online < 1024 ? (int)online : 1;
        if (tmx_pool_new(n, TMX_POOL_YIELD, &t->own) != TMX_OK) {
            free(t);
            return tmx_err(err, TMX_ERR_NOMEM, "cannot start %d threads", n);
        }
        t->threads = tmx_pool_as_threads(t->own);
    }
    *out = t;
    return TMX_OK;
}

void tmx_step_threads_free(struct tmx_step_threads *t) {
    if (!t) return;
    tmx_pool_free(t->own);
    free(t);
}

const struct tmx_threads *tmx_step_threads_get(const struct tmx_step_threads *t) {
    return &t->threads;
}
