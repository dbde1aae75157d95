/* tmx/plan.h: the memory plan of a model on tensor-parallel GPUs, before loading it.
 *
 * tmx_plan_compute reads config.json, hf_quant_config.json (if present) and the safetensors
 * headers of the checkpoint, its experts/ and its coupled/ files, never tensor data, and says
 * what one rank holds on its GPU: weights split into sharded and replicated parts, the runtime
 * allowance, and the KV cache exactly as core/forward.c allocates it; then whether that fits and
 * how far context or concurrency can go. With `virtual` set it needs only config.json: the
 * tensors are those docs/model.md lists, in BF16, with the routed experts in the codec asked
 * for (docs/trellismx.md §10), so a plan for a model too large to download costs nothing.
 *
 * Sharding (GitHub issue 7): attention by heads (the KV heads must divide evenly over the
 * ranks), routed experts and dense/shared MLPs in 16x16-tile slices (gate/up by output rows,
 * down by input columns), embedding and lm_head by vocabulary rows; routers, bridges, norms,
 * residual gates and the codec's per-layer vectors are replicated. Where a slice does not divide
 * evenly the plan is for rank 0, which gets the larger share. docs/plan.md explains every
 * constant. */
#ifndef TMX_PLAN_H
#define TMX_PLAN_H

#include <stdint.h>

#include "tmx/model.h"
#include "tmx/status.h"
#include "tmx/tensor.h"

/* What tmx_plan_compute is asked. Zeroed fields take the defaults noted. */
struct tmx_plan_options {
    int tp;                 /* ranks, one GPU each; 0: n_gpus, or 1 */
    int n_gpus;             /* 0: GPU memory not given (no fit, no capacity) */
    uint64_t gpu_bytes;     /* memory of one GPU */
    int context;            /* positions per sequence; 0: max_position_embeddings */
    int seqs;               /* sequences held at once (config key max_running); 0: 1 */
    int batch;              /* tokens per step (config key batch); 0: 512 */
    int block_size;         /* KV block (config key kv_block_size); 0: 16 */
    enum tmx_dtype kv_dtype; /* F32, BF16, F8_E4M3 or I8 */
    uint64_t reserve;       /* fixed per-GPU allowance; 0: TMX_PLAN_RESERVE */
    int virtual_model;      /* plan from config.json alone */
    const char *experts;    /* virtual only: "bf16", "trellis-e4m3" or "trellis-fp4"; NULL:
                               hf_quant_config.json's codec, else bf16 */
    int bits;               /* virtual only: bits per weight of a trellis codec; 0: the quant
                               config's, else 3 */
};

/* CUDA context, cuBLASLt workspace, NCCL buffers and allocator slack (docs/plan.md). */
#define TMX_PLAN_RESERVE ((uint64_t)1 << 30)

/* The parts of the weights. The first four are sharded, the rest replicated. */
enum tmx_plan_part {
    TMX_PLAN_ATTENTION = 0, /* q/k/v/o projections, by heads */
    TMX_PLAN_EXPERTS,       /* routed experts: tiles and expanded block scales, by tile slices */
    TMX_PLAN_MLP,           /* dense and shared-expert SwiGLU MLPs, by tile slices */
    TMX_PLAN_VOCAB,         /* embedding and lm_head, by vocabulary rows */
    TMX_PLAN_ROUTERS,       /* router weights and correction biases */
    TMX_PLAN_BRIDGES,       /* bridge_in, bridge_out */
    TMX_PLAN_NORMS,         /* RMSNorm weights and residual gates */
    TMX_PLAN_CODEC,         /* matrix scales g and sign vectors of a trellis codec */
    TMX_PLAN_N_PARTS
};
#define TMX_PLAN_N_SHARDED 4

const char *tmx_plan_part_name(enum tmx_plan_part p);

/* The answer. Byte counts are device bytes on rank 0 unless named otherwise. */
struct tmx_plan {
    struct tmx_model_config cfg;
    struct tmx_plan_options opt;  /* with defaults applied */
    char experts_codec[16];       /* "bf16", "trellis-e4m3", "trellis-fp4" */
    int experts_bits, experts_block;
    int attention_mxfp8;          /* attention stored MXFP8 (kept MXFP8 on the device) */
    /* the checkpoint as stored */
    int n_files;                  /* safetensors files read (0 when virtual) */
    int64_t n_tensors;
    uint64_t file_bytes;          /* tensor payloads, all files */
    int64_t n_unused;             /* tensors the graph does not load (towers, drafter, ...) */
    uint64_t unused_bytes;
    /* weights */
    uint64_t part_model[TMX_PLAN_N_PARTS]; /* all ranks together, each replicated part once */
    uint64_t part_rank[TMX_PLAN_N_PARTS];
    uint64_t sharded, replicated, weights;
    /* runtime allowance */
    int batch, seqs;              /* after forward.c's clamps (batch <= context, seqs <= batch) */
    uint64_t step_buffers;        /* forward.c step_buffers_init, rank's heads */
    uint64_t kernel_scratch;      /* kernels.cuda: BF16 matmul split (+ MXFP8 expansion) or BF16
                                     experts, x2 growth */
    uint64_t codec_scratch;       /* trellis device path: the expert block's buffers */
    uint64_t reserve;
    uint64_t runtime;
    /* KV cache */
    int n_full, n_sliding;        /* layers of each kind */
    uint64_t kv_full_token;       /* bytes per cached position, all full layers */
    uint64_t kv_sliding_token;    /* bytes per cached position, all sliding layers */
    int full_blocks, sliding_blocks; /* pool sizes, forward.c pool_blocks */
    uint64_t kv_full, kv_sliding, kv;
    /* verdict (n_gpus > 0) */
    uint64_t total;               /* weights + runtime + kv */
    int fits;
    int64_t headroom;             /* gpu_bytes - total; negative: short by that much */
    int max_context;              /* longest context for `seqs` sequences that fits; 0: none */
    int max_context_capped;       /* memory allows more than max_position_embeddings */
    int max_seqs;                 /* most sequences at `context` that fit; 0: none */
    int max_seqs_capped;          /* memory allows more than the batch lets a step hold */
};

/* Plans model directory `dir` under *o. Errors are one line naming the file or the option
 * (`--tp`, `--context`, ...): a TP that does not divide the KV heads, unreadable headers, a
 * quant config a trellis build needs, an option out of range. */
enum tmx_status tmx_plan_compute(const char *dir, const struct tmx_plan_options *o,
                                 struct tmx_plan *p, char **err);

/* "96GiB", "80GB", "512MiB", "1.5TiB": bytes (binary and decimal units, B alone). */
enum tmx_status tmx_plan_parse_size(const char *s, uint64_t *bytes, char **err);
/* "4x96GiB" (or one size: one GPU): count and bytes of each. */
enum tmx_status tmx_plan_parse_gpus(const char *s, int *n, uint64_t *bytes, char **err);

#endif
