/* conform-impl.h: the conformance cases' table (conform-cases.c), which conform.c sets up,
 * runs and checks; a case's state and the helpers its setups share (conform.c), and the
 * setups and runs kept in files of their own (conform-cache.c, conform-pick.c). */
#ifndef TMX_CONFORM_IMPL_H
#define TMX_CONFORM_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/conform.h"
#include "tmx/kernels.h"
#include "tmx/tensor.h"

enum conform_op {
    OP_EMBED, OP_RMSNORM, OP_MATMUL, OP_ROPE, OP_KV_STORE, OP_ATTENTION, OP_MOE_ROUTE,
    OP_MOE_EXPERTS, OP_SWIGLU, OP_ADD_GATED, OP_GATHER, OP_MOE_EXPERTS_PARTIAL, OP_MOE_COMBINE, OP_ARGMAX,
    OP_MATMUL_MULTI, OP_TOPK, OP_LOGIT_EDIT, OP_ADD_RMSNORM, OP_QK_NORM_ROPE, N_CONFORM_OPS
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

/* --- a case on a kernel set (conform.c) ----------------------------------------------------- */

/* Doubles, an output type of conform's own (no tensor is F64). */
#define F64 TMX_DTYPE_COUNT

struct output {
    void *dev;          /* the kernel set's buffer */
    size_t count;       /* elements of dt */
    enum tmx_dtype dt;  /* F32; I32 (must match exactly); BF16, F8_E4M3 or I8 (a KV cache);
                           F64 (topk's stats) */
    double *ref;        /* [count], as F32 */
};

struct tmx_conform_case {
    const struct spec *s;
    const struct tmx_kernels_i *ops;
    void *ctx;
    uint64_t rng;
    enum tmx_status status; /* first setup failure */
    char **err;

    void **host; /* what the case malloc'd */
    size_t n_host, cap_host;
    void **bufs; /* the kernel set's buffers */
    size_t n_bufs, cap_bufs;
    void **imported; /* struct tmx_tensor device views to weight_free */
    size_t n_imported, cap_imported;

    void *arg[5];             /* device addresses of the op's arrays, in the setup's order */
    struct tmx_tensor w;      /* the op's weight, when it has one */
    struct tmx_tensor wm[4];  /* matmul_multi's weights; add_rmsnorm's gate, qk_norm_rope's
                                 q_norm */
    int n_wm;
    struct tmx_moe_weights moe;
    struct tmx_kv_cache kv;   /* kv_store, attention: device addresses */
    int max_blocks;           /* attention: entries of a block table */
    struct output out[4];
    int n_out;
    unsigned char *got; /* outputs read by the last check */
    size_t got_bytes;
};

/* Zeroed host memory, freed with the case. */
void *cf_host_alloc(struct tmx_conform_case *c, size_t nbytes);
/* A zeroed buffer of the kernel set. */
void *cf_buffer(struct tmx_conform_case *c, size_t nbytes);
/* A buffer of the kernel set holding host[nbytes] (host NULL: none). */
void *cf_upload(struct tmx_conform_case *c, const void *host, size_t nbytes);
/* The case's seeded stream: 64 bits, uniform in [lo, hi), uniform in [lo, hi]. */
uint64_t cf_next_u64(struct tmx_conform_case *c);
double cf_uniform(struct tmx_conform_case *c, double lo, double hi);
int cf_randint(struct tmx_conform_case *c, int lo, int hi);
/* Random F32 values in [lo, hi], uploaded to a new buffer (*dev); returns the host copy. */
float *cf_input(struct tmx_conform_case *c, size_t count, double lo, double hi, void **dev);
/* Registers dev as an output of count elements of dt; returns its reference array to fill. */
double *cf_output(struct tmx_conform_case *c, void *dev, size_t count, enum tmx_dtype dt);
/* Element i of an array of dtype dt (a cache's before its row's scale; F64: conform's own). */
double cf_elem(enum tmx_dtype dt, const void *data, size_t i);

/* --- the paged KV cache (conform-cache.c) --------------------------------------------------- */

enum tmx_status cf_kv_store_new(struct tmx_conform_case *c);
void cf_kv_store_run(struct tmx_conform_case *c);
enum tmx_status cf_attention_new(struct tmx_conform_case *c);
void cf_attention_run(struct tmx_conform_case *c);

/* --- a step's end (conform-pick.c) ---------------------------------------------------------- */

enum tmx_status cf_argmax_new(struct tmx_conform_case *c);
void cf_argmax_run(struct tmx_conform_case *c);
enum tmx_status cf_topk_new(struct tmx_conform_case *c);
void cf_topk_run(struct tmx_conform_case *c);
enum tmx_status cf_logit_edit_new(struct tmx_conform_case *c);
void cf_logit_edit_run(struct tmx_conform_case *c);

#endif
