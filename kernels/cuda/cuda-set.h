/* cuda-set.h: internals shared by the files of the CUDA kernel set: its context, error
 * recording, device scratch, and the ops that plugin.c puts in its table.
 *
 * Included from C (plugin.c) and from CUDA C++ (the .cu files); everything here has C linkage. */
#ifndef TMX_KERNELS_CUDA_SET_H
#define TMX_KERNELS_CUDA_SET_H

#include <stddef.h>
#include <stdint.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "tmx/kernels.h"
#include "tmx/plugin.h"
#include "tmx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Longest head_dim rope, kv_store and attention accept: a warp keeps a head's row in registers,
 * CU_MAX_HEAD_DIM / 32 floats a lane. */
#define CU_MAX_HEAD_DIM 256

/* Most routed experts one moe_experts call takes: their weight addresses travel as a kernel
 * parameter (3 * 256 pointers, 6 KiB), so that the call can be captured into a graph. */
#define CU_MAX_EXPERTS 256

/* What a kernel found wrong in its device-side inputs (ids, positions, block tables). Kernels
 * write the first one into ctx->dev_err; sync reads it back and reports it. */
enum cu_dev_err {
    CU_DEV_OK = 0,
    CU_DEV_EMBED_ID,     /* embed: id outside the table */
    CU_DEV_POSITION,     /* rope, attention: negative position */
    CU_DEV_SLOT,         /* kv_store: slot outside the cache */
    CU_DEV_BLOCK,        /* attention: block table entry outside the cache, or seq < 0 */
    CU_DEV_GATHER_ROW,   /* gather: negative row */
    CU_DEV_COUNT
};

/* cuBLASLt's descriptors and algorithm for one matmul shape, kept: making them again (a
 * heuristic query among them) costs tens of microseconds of host time a call, and a prefill
 * step of a model makes tens of calls. */
#define CU_LT_PLANS 64
struct cu_lt_plan {
    cudaDataType_t ab; /* the operands' type */
    int n, m, k;       /* -1 in n: an empty slot */
    int found;         /* 0: cuBLASLt has no algorithm for the shape */
    uint64_t used;     /* lt_clock at its last use: the least recent is replaced */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
};

struct cu_ctx {
    const struct tmx_host *host;
    int device;
    cudaStream_t stream;       /* every op of this ctx runs on it */
    cublasLtHandle_t lt;
    void *lt_ws;               /* cuBLASLt workspace, fixed: graphs capture its address */
    size_t lt_ws_size;
    struct cu_lt_plan lt_plans[CU_LT_PLANS];
    int n_lt_plans;
    uint64_t lt_clock;
    enum tmx_status status;    /* first host-side failure since the last sync */
    int *dev_err;              /* [1] device: first enum cu_dev_err a kernel met */
    int *dev_err_host;         /* [1] pinned copy read by sync */
    void *scratch;             /* device scratch, grown on demand; one op at a time uses it */
    size_t scratch_size;
    void *retired[48];         /* outgrown scratch blocks, freed by fini: a graph may use them */
    int n_retired;
    int capturing;             /* between graph_begin and graph_end */
    int pdl;                   /* kernels of a graph may start while the one before runs
                                  (option pdl) */
    int bf16_mma;              /* 9-64 token BF16 matmuls in bf16_mma_kernel (option bf16_mma) */
    int gemv_max;              /* large BF16 weights past this many tokens go to cuBLASLt (1-8;
                                  option gemv_max) */
    int bf16_mv;               /* 2-8 token BF16 matmuls of large weights in mv_kernel
                                  (option bf16_mv) */
    int mx_mv;                 /* the same for MXFP8 weights (option mx_mv) */
    int lt_buckets;            /* cuBLASLt algorithms chosen at widths rounded up to powers
                                  of two (option lt_buckets) */
};

/* Records a failure (the first one since the last sync wins) and logs its message. */
void cu_fail(struct cu_ctx *c, enum tmx_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Makes the ctx's device current; every entry point calls it first, since ops may come from
 * another thread than init and CUDA's current device is per thread. 0 (failure recorded) when
 * it cannot. */
int cu_enter(struct cu_ctx *c, const char *op);

/* Records a failed launch (cudaGetLastError) of `op`; returns 1 when the launch went well. */
int cu_check_launch(struct cu_ctx *c, const char *op);

/* At least nbytes of 256-byte aligned device scratch, valid until the next call; NULL (failure
 * recorded against `op`) when out of memory. */
void *cu_scratch(struct cu_ctx *c, size_t nbytes, const char *op);

/* 1 if a weight is non-empty, F32/BF16/F16 and ndim-dimensional, with shape[0] == rows when
 * rows > 0 and (2-D) shape[1] == cols when cols > 0; else records a failure naming op and what. */
int cu_check_weight(struct cu_ctx *c, const char *op, const char *what,
                    const struct tmx_tensor *w, int ndim, int64_t rows, int64_t cols);

/* --- ops (one definition each, in the file of their family) --------------------------------- */

/* rows.cu */
void cu_embed(void *ctx, float *out, const struct tmx_tensor *table, const int32_t *ids, int n);
void cu_rmsnorm(void *ctx, float *out, const float *x, const struct tmx_tensor *w, int rows, int d,
                float eps);
void cu_swiglu(void *ctx, float *out, const float *gate, const float *up, int64_t count);
void cu_add_gated(void *ctx, float *h, const float *a, const struct tmx_tensor *g, int rows,
                  int d);
void cu_gather(void *ctx, float *out, const float *x, const int32_t *rows, int n, int d);
void cu_argmax(void *ctx, int32_t *ids, float *best, const float *x, int rows, int d, int ld);
void cu_topk(void *ctx, float *xs, int32_t *ids, double *stats, const float *x,
             const float *temps, int rows, int d, int ld, int k);
void cu_logit_edit(void *ctx, float *x, const struct tmx_logit_edit *edits,
                   const int32_t *starts, int rows, int ld, int lo, int d);
void cu_add_rmsnorm(void *ctx, float *out, float *h, const float *a, const struct tmx_tensor *g,
                    const struct tmx_tensor *w, int rows, int d, float eps);
void cu_qk_norm_rope(void *ctx, float *q, float *k, const struct tmx_tensor *q_norm,
                     const struct tmx_tensor *k_norm, const int32_t *pos, const float *inv_freq,
                     int n, int hq, int hkv, int hd, float eps);

/* matmul.cu */
/* Frees the kept cuBLASLt plans (fini, before the handle goes). */
void cu_lt_plans_free(struct cu_ctx *c);
void cu_matmul(void *ctx, float *y, const float *x, const struct tmx_tensor *w, int n);
void cu_matmul_multi(void *ctx, float *const *ys, const float *x,
                     const struct tmx_tensor *const *ws, int count, int n);

/* attention.cu */
void cu_rope(void *ctx, float *x, const int32_t *pos, const float *inv_freq, int n, int heads,
             int hd);
void cu_kv_store(void *ctx, const struct tmx_kv_cache *kv, const float *k, const float *v,
                 const int32_t *slots, int n);
void cu_attention(void *ctx, float *out, const float *q, const struct tmx_kv_cache *kv,
                  const int32_t *tables, int max_blocks, const int32_t *seq, const int32_t *pos,
                  int n, int hq, int window, float scale);

/* moe.cu */
void cu_moe_route(void *ctx, int32_t *ids, float *weights, const float *logits,
                  const struct tmx_tensor *bias, int n, int n_exp, int k,
                  enum tmx_router_score score, int norm_topk, float scale);
void cu_moe_experts(void *ctx, float *out, const float *z, const int32_t *ids,
                    const float *weights, int n, int k, const struct tmx_moe_weights *w);
void cu_moe_experts_partial(void *ctx, float *ye, const float *z, const int32_t *ids, int n,
                            int k, const struct tmx_moe_weights *w);
void cu_moe_combine(void *ctx, float *out, const float *ye, const float *weights, int n, int k,
                    int latent, const struct tmx_tensor *post_norm, float eps);

#ifdef __cplusplus
}
#endif

#endif
