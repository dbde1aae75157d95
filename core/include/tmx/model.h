/* tmx/model.h: the model graph (docs/model.md) on a kernel set, and sequences that run it.
 *
 * Ownership: a tmx_model borrows the checkpoint, the kernel set and the plugin registry given
 * to tmx_model_load (all must outlive it); it owns the weights it imported into the kernel set
 * and the codec instance it opened, and the KV cache and step buffers of tmx_model_kv_init.
 * A tmx_seq owns its block tables and borrows its model (free sequences before the model). */
#ifndef TMX_MODEL_H
#define TMX_MODEL_H

#include <stdint.h>

#include "tmx/comm.h"
#include "tmx/kernels.h"
#include "tmx/loader.h"
#include "tmx/safetensors.h"
#include "tmx/sampler.h"
#include "tmx/status.h"

#define TMX_MAX_LAYERS 256
#define TMX_MAX_EOS 8

enum tmx_model_type { TMX_MODEL_MUSE = 0, TMX_MODEL_LLAMA };
enum tmx_rope_type { TMX_ROPE_DEFAULT = 0, TMX_ROPE_LINEAR, TMX_ROPE_LLAMA3 };

/* config.json, with docs/model.md's defaults applied. */
struct tmx_model_config {
    enum tmx_model_type type;
    int vocab_size, hidden, n_layers, n_heads, n_kv_heads, head_dim;
    int sliding_window;
    unsigned char sliding[TMX_MAX_LAYERS]; /* layer uses sliding-window attention */
    unsigned char dense[TMX_MAX_LAYERS];   /* layer has a dense MLP instead of MoE */
    double rope_theta, rope_local_theta;
    enum tmx_rope_type rope_type;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_pos;
    int max_position_embeddings;
    double rms_norm_eps;
    int tie_word_embeddings;
    int intermediate_size;
    int n_routed_experts, n_experts_per_tok, moe_latent_size, moe_intermediate_size;
    int n_shared_experts;
    double routed_scaling_factor;
    int norm_topk_prob;
    enum tmx_router_score router_score;
    int residual_gates;
    int bos_token_id;                /* -1: none */
    int eos_token_ids[TMX_MAX_EOS];
    int n_eos;
    struct tmx_sampling_defaults gen; /* generation_config.json's sampling values */
};

/* Parses DIR/config.json; every error names the file and the field. */
enum tmx_status tmx_model_config_load(const char *dir, struct tmx_model_config *cfg, char **err);

/* hf_quant_config.json, the members the core reads (the codec checks its own): one reader for
 * the model loader, tmx plan, tmx pack, the manifest and tmx inspect. */
struct tmx_quant_config {
    int present;                        /* 0: no file (dense experts); the rest is empty */
    char path[4096];                    /* the file, for the caller's messages */
    char quant_method[64], codec[64];   /* "" when absent */
    int bits, block_size;               /* 0 when absent */
    int experts_per_file;               /* 0 when absent */
    int mxfp8;                          /* "mxfp8_tensors" names at least one tensor */
};

/* Reads DIR/hf_quant_config.json into *q; a missing file is not an error (q->present = 0). A
 * file that is not one JSON object without duplicate keys, or a member above of the wrong
 * type, is, in one line naming the file and the member. */
enum tmx_status tmx_quant_config_load(const char *dir, struct tmx_quant_config *q, char **err);

struct tmx_model;

/* Binds every tensor docs/model.md lists (a missing or mis-shaped tensor is an error naming it)
 * and imports the weights into the kernel set. MXFP8 weights (F8_E4M3 with a U8 UE8M0
 * "<name>_scale" per 32 inputs) are expanded exactly to BF16. When the checkpoint has an
 * hf_quant_config.json naming a "codec", the routed experts go to plugin codec.<codec>. */
enum tmx_status tmx_model_load(const struct tmx_checkpoint *ck, const struct tmx_kernels *k,
                               struct tmx_plugins *ps, struct tmx_model **out, char **err);
void tmx_model_free(struct tmx_model *m);
const struct tmx_model_config *tmx_model_cfg(const struct tmx_model *m);

/* --- tensor parallelism (docs/tp.md) -------------------------------------------------------
 *
 * A model of N ranks is N tmx_models, one per rank, each holding its slice: query and KV heads,
 * MLP and expert intermediates, embedding and lm_head rows. Rank 0 is the model callers use
 * (tmx_model_step and everything below it work unchanged); each step it broadcasts the step's
 * tokens, positions and block tables, and ranks 1..N-1 run the same step inside
 * tmx_model_follow. Every rank must have the same tmx_model_kv_init options. */
struct tmx_model_tp {
    tmx_comm_t *ctl;  /* host-memory communicator of the ranks (threads or mpi): steps */
    tmx_comm_t *data; /* collectives on the kernel set's buffers: ctl for a host-memory set,
                         an nccl communicator for a GPU set */
};

/* tmx_model_load for rank tmx_comm_rank(tp->ctl) of tmx_comm_size(tp->ctl) (tp NULL or one
 * rank: the whole model). The communicators are borrowed and must outlive the model. Errors,
 * one line each: a config.json field that does not split into the ranks (heads, KV heads,
 * intermediates off the 16-wide tiles), a kernel set or codec without the tensor-parallel ops
 * (naming the plugin). */
enum tmx_status tmx_model_load_rank(const struct tmx_checkpoint *ck, const struct tmx_kernels *k,
                                    struct tmx_plugins *ps, const struct tmx_model_tp *tp,
                                    struct tmx_model **out, char **err);
int tmx_model_rank(const struct tmx_model *m);
int tmx_model_n_ranks(const struct tmx_model *m);

/* Ranks 1..N-1, after tmx_model_kv_init: runs the steps rank 0 broadcasts until rank 0 calls
 * tmx_model_stop. A step that fails on this rank is logged and reported to rank 0, whose
 * tmx_model_step returns the failure; the loop goes on. Returns TMX_OK after the stop, or an
 * error when the communicator fails. */
enum tmx_status tmx_model_follow(struct tmx_model *m, char **err);
/* Rank 0: ends the followers' tmx_model_follow. Once, after the last step and before any rank
 * is freed; nothing with one rank. */
enum tmx_status tmx_model_stop(struct tmx_model *m, char **err);

/* --- the KV cache and steps -------------------------------------------------------------
 *
 * The model owns one paged KV cache (tmx/kvcache.h) for all its sequences and the scratch
 * buffers of a step of up to n_batch tokens drawn from up to max_seqs sequences. Full-attention
 * layers share one block pool and sliding-window layers another, whose blocks a sequence gives
 * back as they leave the window. */
struct tmx_kv_options {
    int n_ctx;            /* longest sequence */
    int n_batch;          /* tokens per step */
    int max_seqs;         /* sequences per step */
    int block_size;       /* positions per block */
    int n_tokens;         /* positions the full-attention pool holds; 0: n_ctx * max_seqs */
    enum tmx_dtype dtype; /* F32, BF16, F8_E4M3 or I8 */
    int prefix_cache;     /* publish full blocks and reuse them */
    int graphs;           /* record decode steps once per batch size and replay them, where
                             the kernel set can (its graph_* ops) */
};

/* Allocates the cache and the step buffers; once, before the first tmx_seq_new. n_batch is
 * capped to n_ctx and max_seqs to n_batch. */
enum tmx_status tmx_model_kv_init(struct tmx_model *m, const struct tmx_kv_options *o,
                                  char **err);
/* The options in effect after tmx_model_kv_init's caps (zeros before it): what a scheduler
 * may put in one step. */
void tmx_model_kv_options(const struct tmx_model *m, struct tmx_kv_options *o);

/* What the cache holds now, in blocks of its full-attention pool and of its sliding pool. */
struct tmx_kv_usage {
    int full_used, full_total;
    int sliding_used, sliding_total;
    int block_size;
};
void tmx_model_kv_usage(const struct tmx_model *m, struct tmx_kv_usage *u);

/* One sequence: its tokens and the blocks of the cache that hold them. */
struct tmx_seq;

/* n_ctx: the sequence's length limit, at most the cache's. */
enum tmx_status tmx_seq_new(struct tmx_model *m, int n_ctx, struct tmx_seq **out, char **err);
void tmx_seq_free(struct tmx_seq *s);
int tmx_seq_n_past(const struct tmx_seq *s);
/* Empties the sequence and gives its blocks back (published ones stay findable). */
void tmx_seq_reset(struct tmx_seq *s);

/* On an empty sequence: takes the cached blocks that hold a prefix of tokens[0..n) and returns
 * how many positions they cover (the sequence's n_past now; always < n, so the last token is
 * left to compute its logits). 0 when prefix caching is off. */
int tmx_seq_prefix(struct tmx_seq *s, const int32_t *tokens, int n);

/* Takes the blocks n more positions need. TMX_ERR_BUSY (message included) when the cache has
 * too few free blocks: nothing changed, and the caller may free blocks (preempt a sequence)
 * and try again. Errors: n beyond the sequence's n_ctx. */
enum tmx_status tmx_seq_reserve(struct tmx_seq *s, int n, char **err);

/* One step: sequence seqs[i] appends tokens[i][0..n[i]), for sum(n) <= n_batch and n_seqs <=
 * max_seqs (distinct sequences), with the blocks reserved. Writes the logits of each
 * sequence's last new token to logits[i][vocab_size]. Errors: token id out of range, a kernel
 * failure (the sequences are then in an undefined state: reset them). */
enum tmx_status tmx_model_step(struct tmx_model *m, struct tmx_seq *const *seqs,
                               const int32_t *const *tokens, const int *n, int n_seqs,
                               float *logits, char **err);

/* tmx_model_step for greedy decoding: next[i] = the argmax of sequence i's logits over ids
 * [0, n_vocab) (the lowest id of the largest logit; NaN never the largest), found where the
 * logits are (the kernel set's argmax, else on the host), so that a GPU or a TP group sends
 * back n_seqs ids instead of n_seqs rows of logits. Errors: tmx_model_step's, and n_vocab
 * outside [1, vocab_size]. */
enum tmx_status tmx_model_step_greedy(struct tmx_model *m, struct tmx_seq *const *seqs,
                                      const int32_t *const *tokens, const int *n, int n_seqs,
                                      int n_vocab, int32_t *next, char **err);

/* Whether sampled steps should be top steps here: the kernel set has topk (ABI 2.4) and the
 * logits would otherwise travel, out of device memory or between ranks (with tensor
 * parallelism each rank finds its vocabulary slice's candidates and rank 0 merges them). A set
 * whose buffers are host memory (kernels.cpu) leaves one rank's logits where the host sampler
 * reads them: its topk would cost as much as the sampler's own pass over the row, and more. */
int tmx_model_can_top(const struct tmx_model *m);

/* Whether the kernel set's buffers are device memory (its plugin lacks TMX_CAP_HOST_MEMORY). */
int tmx_model_on_device(const struct tmx_model *m);

/* The CPU threads a host-memory kernel set lends (its host_threads op), for work the caller runs
 * between steps; *out stays valid as long as the model. 0 when the set lends none. */
int tmx_model_host_threads(const struct tmx_model *m, struct tmx_threads *out);

/* Threads for the host's work between steps (tmx serve's and tmx bench's draws over rows of
 * logits): those the kernel set lends (tmx_model_host_threads), else a pool of its own of n
 * threads (n <= 0: one per online CPU) that gives its cores away when idle, as on a device's
 * host. The caller's thread is thread 0. Free with tmx_step_threads_free, before the model. */
struct tmx_step_threads;
enum tmx_status tmx_step_threads_new(const struct tmx_model *m, int n,
                                     struct tmx_step_threads **out, char **err);
void tmx_step_threads_free(struct tmx_step_threads *t);
const struct tmx_threads *tmx_step_threads_get(const struct tmx_step_threads *t);

/* Whether top steps can carry logit edits here: tmx_model_can_top, and the kernel set has
 * logit_edit (ABI 2.5). */
int tmx_model_can_edit(const struct tmx_model *m);

/* tmx_model_step for sampled decoding: instead of sequence i's logits, the first TMX_TOPK_MAX
 * candidates of its logits over ids [0, n_vocab) for a sampler at temperature temps[i] (> 0;
 * a greedy sequence may pass 1 and take the first candidate), found where the logits are by
 * the kernel set's topk (tmx/kernels.h), after the edits edits[edit_starts[i] ..
 * edit_starts[i + 1]) of sequence i's logits (edit_starts NULL: none; at most one edit of an
 * id a sequence, ids below n_vocab; tmx_model_can_edit): xs[i][TMX_TOPK_MAX] their logits in
 * candidate order
 * (by logit / temperature) and ids[i][TMX_TOPK_MAX] (-1 past the last); over every candidate,
 * stats[i][0] = the softmax denominator at the temperature (the sum of exp(y - y_first), y =
 * logit / temperature), stats[i][1] = their number, stats[i][2] = the denominator at
 * temperature 1 (the sum of exp(x - xs[i][0])): what tmx_sampler_sample_top takes, and log
 * probabilities. When the draw needs more, tmx_model_read_logits gives the row. Errors:
 * tmx_model_step's, TMX_ERR_UNSUPPORTED when the set has no topk, n_vocab outside
 * [1, vocab_size], a temperature not > 0. */
enum tmx_status tmx_model_step_top(struct tmx_model *m, struct tmx_seq *const *seqs,
                                   const int32_t *const *tokens, const int *n, int n_seqs,
                                   int n_vocab, const float *temps, const int32_t *edit_starts,
                                   const struct tmx_logit_edit *edits, float *xs, int32_t *ids,
                                   double *stats, char **err);

/* Row i's logits [vocab_size] of the last step, which left them where they were made (a top
 * step, whose edits they carry; with several ranks, each sends its slice). Rank 0 only. */
enum tmx_status tmx_model_read_logits(struct tmx_model *m, int i, float *logits, char **err);

/* Appends tokens[0..n) to one sequence in steps of at most n_batch, reserving as it goes, and
 * writes logits (vocab_size columns): of the last token to logits[vocab_size], or with all_rows
 * of every token to logits[n][vocab_size]. Errors: context full, KV cache full (TMX_ERR_BUSY),
 * token id out of range, a kernel failure. */
enum tmx_status tmx_seq_forward(struct tmx_seq *s, const int32_t *tokens, int n, float *logits,
                                int all_rows, char **err);

/* --- calibration capture (tmx quantize) ---------------------------------------------------- */

/* One MoE layer of one forward step of n tokens, right after its router and bridge_in: host
 * pointers into the sequence's buffers, valid during the callback only. */
struct tmx_moe_capture {
    int layer;            /* layer id */
    int n, k;             /* token rows in the step, experts per token */
    const float *x;       /* [n][hidden] the MLP's input (post-attention RMSNorm) */
    const float *z;       /* [n][moe_latent_size] post-bridge latents, the experts' input */
    const int32_t *ids;   /* [n][k] routed experts */
    const float *weights; /* [n][k] their routing weights */
};

/* Returns TMX_OK, or a failure that ends the forward pass with it (and its message). */
typedef enum tmx_status (*tmx_capture_fn)(void *arg, const struct tmx_moe_capture *cap,
                                          char **err);

/* From the next step on, calls fn(arg, ...) in every MoE layer (fn NULL: stop). The step syncs
 * the kernel set before each call, so the kernel set's buffers must be host memory
 * (TMX_CAP_HOST_MEMORY) and the model one rank; TMX_ERR_UNSUPPORTED otherwise. */
enum tmx_status tmx_model_set_capture(struct tmx_model *m, tmx_capture_fn fn, void *arg,
                                      char **err);

#endif
