/* model-impl.h: the model's private state, shared by model.c (loading), forward.c (the KV
 * cache, sequences and the step) and step-out.c (what a step hands back). */
#ifndef TMX_MODEL_IMPL_H
#define TMX_MODEL_IMPL_H

#include "tmx/kvcache.h"
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
    void *codec_dev;                              /* its device copy (codec device path) */
};

/* This rank's part of a tensor-parallel model (docs/tp.md); n = 1: the whole model. Widths
 * are this rank's: the global ones are in cfg. */
struct tp_shard {
    int rank, n;
    tmx_comm_t *ctl, *data;         /* borrowed; NULL when n = 1 */
    int hq, hkv;                    /* query and KV heads */
    int ffn, shared, inter;         /* dense MLP, shared expert, routed expert intermediates */
    int vocab0, vocab_n;            /* embedding and lm_head rows [vocab0, vocab0 + vocab_n) */
    int vocab_stride;               /* ceil(vocab_size / n): rank r's rows start at r times it */
};

struct tmx_model {
    struct tmx_model_config cfg;
    struct tp_shard tp;
    const struct tmx_kernels *k;
    struct tmx_tensor embed, final_norm, lm_head; /* TP: embed has a zero row appended; a
                                                     tied lm_head is bound too */
    struct layer *layers;                         /* [n_layers] */
    float *inv_freq_full, *inv_freq_local;        /* device, [head_dim/2] */
    struct tmx_tensor **imported;                 /* every tensor to weight_free */
    int n_imported, cap_imported;
    void **owned;                                 /* host arrays converted at load time */
    int n_owned, cap_owned;
    unsigned char *bound;                         /* [checkpoint tensors] while loading: read */
    const struct tmx_plugin *codec;               /* routed experts' codec, or NULL */
    const struct tmx_codec_i *codec_ops;
    void *codec_ctx;
    char *codec_dir;                              /* where the codec reads the experts: the
                                                     checkpoint, or a tmx pack's rank folder */
    struct kv_state *kv;                          /* tmx_model_kv_init: cache and step */
    tmx_capture_fn capture;                       /* calibration hook, or NULL */
    void *capture_arg;
};

/* forward.c */
void tmx_model_kv_free(struct tmx_model *m);

#endif


