/* conform-impl.h: the conformance cases' table (conform-cases.c), which conform.c sets up,
 * runs and checks. */
#ifndef TMX_CONFORM_IMPL_H
#define TMX_CONFORM_IMPL_H

#include <stddef.h>

#include "tmx/tensor.h"

enum conform_op {
    OP_EMBED, OP_RMSNORM, OP_MATMUL, OP_ROPE, OP_KV_STORE, OP_ATTENTION, OP_MOE_ROUTE,
    OP_MOE_EXPERTS, OP_SWIGLU, OP_ADD_GATED, OP_GATHER, OP_MOE_EXPERTS_PARTIAL, OP_MOE_COMBINE, OP_ARGMAX,
    OP_MATMUL_MULTI, OP_TOPK, OP_LOGIT_EDIT, OP_ADD_RMSNORM, OP_QK_NORM_ROPE,
};

/* Variant flags. */
#define NO_WEIGHT 1u    /* rmsnorm, add_gated: no weight; add_rmsnorm: neither gate nor
                           weight; qk_norm_rope: no norms; moe_route: no bias; moe_experts,
                           moe_combine: no post norm */
#define IN_PLACE 2u     /* rmsnorm: out = x; swiglu: out = gate */
#define SOFTMAX 4u      /* moe_route: softmax scores (default sigmoid) */
#define NO_NORM_TOPK 8u /* moe_route: weights not divided by their sum */
#define TIES 16u        /* moe_route: logits from five values, so that many scores tie;
                           kv_store: values halfway between two codes; argmax, topk: five
                           values */
#define SMALL 32u       /* rmsnorm: inputs near zero, where eps matters */
#define WIDE 64u        /* kv_store: inputs over many binades, down to F8 subnormals */
#define SPECIAL 128u    /* argmax: NaN and infinities, rows of NaN only and of -inf only;
                           topk: NaN and -inf, rows of NaN only, of -inf only, of 5 candidates;
                           logit_edit: NaN, infinities and zeros of both signs */
#define MIXED 256u      /* matmul_multi: weight 1 in F32, the others in dt */

struct spec {
    const char *name;
    enum conform_op op;
    enum tmx_dtype dt;         /* weight dtype; kv_store, attention: the cache's */
    unsigned flags;
    int n;                     /* token rows */
    int m, d;                  /* matmul: w [m][d]; embed: table [m][d]; gather: x [m][d];
                                  argmax, topk, logit_edit: rows of d values m apart (m 0:
                                  d); others: rows of width d */
    int heads, kv_heads, hd;   /* rope (heads), kv_store (kv_heads), attention */
    int block, window;         /* cache block size, sliding window (0: full) */
    int seqs, ctx;             /* sequences in the step, the longest one's length */
    int n_exp, top_k, expert0; /* moe_route, moe_experts; topk: top_k is its k; logit_edit:
                                  the most edits a row, expert0 its lo */
    int latent, inter;         /* moe_experts */
    float scale;               /* moe_route: routed_scaling_factor */
    int rows[4];               /* matmul_multi: rows of each weight (0: no more), d columns */
};

extern const struct spec tmx_conform_specs[];
extern const size_t tmx_conform_n_specs;

#endif
