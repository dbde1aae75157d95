/* tmx/kernels.h: the kernel-set ops table (plugin kind TMX_PLUGIN_KERNELS).
 *
 * A kernel set runs every op of the model graph on one device. The core owns the graph and
 * calls these ops in order on one stream; a kernel set may run them asynchronously until
 * `sync` (or a buf_read, which synchronizes).
 *
 * Memory. Activation buffers, index arrays and the KV cache live in buffers made by buf_alloc
 * (device memory on a GPU set, host memory on the CPU set); pointers passed to ops point into
 * such buffers, possibly at an offset. Weights are imported once with weight_import from the
 * host (mmapped) tensor; the kernel set owns the imported copy until weight_free. Activations
 * are F32 and row-major; weights are F32, BF16 or F16 unless an op says otherwise; matmul's
 * may also be MXFP8 (ABI 2.2), on sets that import it.
 *
 * Tensor parallelism. An op never knows about ranks: a rank's graph calls the same ops with its
 * slice of heads and experts; communication belongs to the core. Two optional ops at the end
 * of the table split the MoE block around the core's all-reduce.
 *
 * Errors. Ops return nothing so that a step can be queued or captured; a kernel set records
 * the first failure and returns it from the next sync (the core syncs every step).
 *
 * Threading. Ops of one ctx are called from one thread at a time. */
#ifndef TMX_KERNELS_H
#define TMX_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"
#include "tmx/tensor.h"

struct tmx_host;
struct tmx_opts;

enum tmx_router_score { TMX_ROUTER_SIGMOID = 0, TMX_ROUTER_SOFTMAX = 1 };

/* A change to logit `id` of a row: what a request's logit bias and penalties make of it
 * (tmx serve), one edit an id, applied by tmx_logit_edit_apply. */
struct tmx_logit_edit {
    int32_t id;
    float bias;    /* added first (a request's logit_bias; biases of one id summed) */
    float penalty; /* then subtracted (frequency * count + presence) */
    float rep;     /* then x > 0 ? x / rep : x * rep (the repetition penalty; 1: none) */
};

/* A device set's kernels call the header's inline helpers too (CUDA C++). */
#ifdef __CUDACC__
#define TMX_HOST_DEVICE __host__ __device__
#else
#define TMX_HOST_DEVICE
#endif

/* x edited by e, each step rounded to F32 (no step fuses with another): how every kernel set
 * and the host apply an edit, so that a row edited on a device is the row the host would have
 * edited, bit for bit. */
static inline TMX_HOST_DEVICE float tmx_logit_edit_apply(const struct tmx_logit_edit *e, float x) {
    const float v = (x + e->bias) - e->penalty;
    return v > 0 ? v / e->rep : v * e->rep;
}

/* A parallel-for over a pool of CPU threads, lent by a kernel set to a codec's host path so
 * that the two do not each keep threads on the same cores (ABI 2.7). run(pool, n, fn, arg)
 * calls fn(arg, item, thread) once for every item < n on the pool's n_threads threads (thread
 * 0 .. n_threads - 1, 0 being the caller, for per-thread scratch) and returns when every call
 * is done. Which thread runs an item varies, so an item writes only its own outputs. One
 * caller at a time, and fn must not call run. */
typedef void (*tmx_threads_fn)(void *arg, int64_t item, int thread);
struct tmx_threads {
    void *pool;
    int n_threads;
    void (*run)(void *pool, int64_t n_items, tmx_threads_fn fn, void *arg);
};

/* Routed experts of one MoE layer, as seen by moe_experts. All arrays have n_experts entries
 * (a TP rank passes its own experts; ids outside [expert0, expert0 + n_experts) are skipped). */
struct tmx_moe_weights {
    int n_experts;
    int expert0;                       /* global id of gate[0] */
    int latent, inter;                 /* moe_latent_size, moe_intermediate_size (this rank) */
    const struct tmx_tensor *gate;     /* [n_experts] of [inter][latent] */
    const struct tmx_tensor *up;       /* [n_experts] of [inter][latent] */
    const struct tmx_tensor *down;     /* [n_experts] of [latent][inter] */
    const struct tmx_tensor *post_norm; /* [latent] RMSNorm weight of each y_e; NULL: no norm */
    float eps;
};

/* The KV cache of one attention layer: a pool of fixed-size blocks that every sequence draws
 * from (the core's block manager decides which block holds which positions). Row r of block b
 * is slot b * block_size + r. Buffers come from buf_alloc. */
struct tmx_kv_cache {
    enum tmx_dtype dtype;      /* F32, BF16, F8_E4M3 or I8 */
    int n_blocks, block_size;
    int hkv, hd;
    void *k, *v;               /* [n_blocks * block_size][hkv][hd] of dtype */
    float *k_scale, *v_scale;  /* [n_blocks * block_size][hkv]: F8_E4M3 and I8 only, else NULL */
};

struct tmx_kernels_i {
    uint32_t struct_size;

    /* --- lifecycle ---------------------------------------------------------------------- */
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts, void **ctx,
                            char **err);
    void (*fini)(void *ctx);

    /* --- memory ------------------------------------------------------------------------- */
    enum tmx_status (*buf_alloc)(void *ctx, size_t nbytes, void **buf); /* zero-filled */
    void (*buf_free)(void *ctx, void *buf);
    /* dst/src are buffer addresses (with any offset already applied); host side is plain memory. */
    enum tmx_status (*buf_write)(void *ctx, void *dst, const void *host_src, size_t nbytes);
    enum tmx_status (*buf_read)(void *ctx, void *host_dst, const void *src, size_t nbytes);
    /* Makes a host tensor usable as a weight: `dev` gets the same dtype and shape and a device
     * address. The CPU set may alias the host data (no copy); the host data outlives `dev`.
     * The core offers matmul weights stored as MXFP8 in that dtype (ABI 2.2); a set that
     * returns TMX_ERR_UNSUPPORTED for it is offered their exact BF16 values instead. */
    enum tmx_status (*weight_import)(void *ctx, const struct tmx_tensor *host,
                                     struct tmx_tensor *dev, char **err);
    void (*weight_free)(void *ctx, struct tmx_tensor *dev);
    enum tmx_status (*sync)(void *ctx);

    /* --- graphs (optional; all NULL: ops run eagerly every step) -----------------------------
     * Ops called between graph_begin and graph_end are recorded, not run; graph_launch replays
     * them with the same buffers (their contents may change between launches). */
    enum tmx_status (*graph_begin)(void *ctx);
    enum tmx_status (*graph_end)(void *ctx, void **graph);
    enum tmx_status (*graph_launch)(void *ctx, void *graph);
    void (*graph_free)(void *ctx, void *graph);

    /* --- ops -----------------------------------------------------------------------------
     * n = number of token rows in the step. Shapes in comments; out may not alias inputs
     * unless stated. */

    /* out[n][d] = table[ids[i]][:], d = table->shape[1]. ids are in a buffer. */
    void (*embed)(void *ctx, float *out, const struct tmx_tensor *table, const int32_t *ids, int n);

    /* out[r][:] = x[r][:] / sqrt(mean(x[r]^2) + eps) * w (w NULL: 1). rows x d. out may be x.
     * Also used per head for q/k norm (rows = n * heads, d = head_dim). */
    void (*rmsnorm)(void *ctx, float *out, const float *x, const struct tmx_tensor *w, int rows,
                    int d, float eps);

    /* y[n][m] = x[n][k] . w[m][k]^T, m = w->shape[0], k = w->shape[1]; w F32, BF16, F16 or
     * an imported MXFP8 weight. */
    void (*matmul)(void *ctx, float *y, const float *x, const struct tmx_tensor *w, int n);

    /* In place on x[n][heads][hd]: rotate-half RoPE, pairs (i, i + hd/2) rotated by
     * pos[t] * inv_freq[i], i < hd/2. pos and inv_freq[hd/2] are in buffers. */
    void (*rope)(void *ctx, float *x, const int32_t *pos, const float *inv_freq, int n, int heads,
                 int hd);

    /* Stores k, v [n][hkv][hd] of n tokens into the paged cache `kv` (one layer) at slots[n]
     * (slot = block * block_size + row; < 0: skip the row). F8_E4M3 and I8 caches store one
     * F32 scale per token and KV head, amax / 448 or amax / 127 (0 for an all-zero row), and
     * the row divided by it, rounded to nearest even (I8: clamped to +-127); BF16 rounds to
     * nearest even. */
    void (*kv_store)(void *ctx, const struct tmx_kv_cache *kv, const float *k, const float *v,
                     const int32_t *slots, int n);

    /* out[n][hq][hd]: causal GQA attention of q[n][hq][hd] over the paged cache `kv` (one
     * layer). Token t belongs to sequence seq[t] at position p = pos[t] and reads the cached
     * positions j with max(0, p - window + 1) <= j <= p (window 0: all j <= p) of its sequence:
     * position j lives in block tables[seq[t] * max_blocks + j / block_size], row
     * j % block_size. Query head h reads KV head h / (hq / hkv); softmax(q.k * scale) in F32
     * over the dequantized cache. The caller guarantees those blocks hold those positions
     * (written by an earlier kv_store, possibly of this step). seq, pos, tables are buffers. */
    void (*attention)(void *ctx, float *out, const float *q, const struct tmx_kv_cache *kv,
                      const int32_t *tables, int max_blocks, const int32_t *seq,
                      const int32_t *pos, int n, int hq, int window, float scale);

    /* Router: from logits[n][n_exp] computes s = score(logits), picks the top k of s + bias
     * (bias [n_exp] F32 or NULL; ties -> lower id), and writes ids[n][k] (descending by
     * s + bias) and weights[n][k] = s_e (/ sum over the k picked if norm_topk) * scale. */
    void (*moe_route)(void *ctx, int32_t *ids, float *weights, const float *logits,
                      const struct tmx_tensor *bias, int n, int n_exp, int k,
                      enum tmx_router_score score, int norm_topk, float scale);

    /* out[n][latent] = sum over j < k of weights[t][j] * RMSNorm_post(y_e), e = ids[t][j],
     * y_e = down_e(silu(gate_e z) * up_e z), z = z[t] (post-bridge latent). */
    void (*moe_experts)(void *ctx, float *out, const float *z, const int32_t *ids,
                        const float *weights, int n, int k, const struct tmx_moe_weights *w);

    /* out[i] = silu(gate[i]) * up[i], i < count. out may be gate. */
    void (*swiglu)(void *ctx, float *out, const float *gate, const float *up, int64_t count);

    /* h[r][:] += g * a[r][:] (g: [d] weight, NULL: 1). rows x d. */
    void (*add_gated)(void *ctx, float *h, const float *a, const struct tmx_tensor *g, int rows,
                      int d);

    /* out[i][:] = x[rows[i]][:], i < n; d columns. rows is a buffer. */
    void (*gather)(void *ctx, float *out, const float *x, const int32_t *rows, int n, int d);

    /* (optional; NULL: none) The set's native queue, for a codec's device path that must run
     * on the same stream (a cudaStream_t for the CUDA set). */
    void *(*native_stream)(void *ctx);

    /* --- tensor parallelism (optional; both NULL: the set runs models of one rank only) ------
     * A rank holds every routed expert with its slice of the intermediate dimension (gate and
     * up by rows, down by columns), so the y_e it computes is a partial sum. The post-expert
     * norm needs the whole y_e: the core all-reduces the partials of every (token, expert)
     * pair, then every rank combines them (docs/tp.md). Added in ABI 2.1. */

    /* ye[n][k][latent] = y_e of each pair (t, j), e = ids[t][j]: down_e(silu(gate_e z) *
     * up_e z) over this rank's w->inter, neither normalized nor weighted; pairs whose expert
     * is outside [expert0, expert0 + n_experts) get zeros. w->post_norm is not read. */
    void (*moe_experts_partial)(void *ctx, float *ye, const float *z, const int32_t *ids, int n,
                                int k, const struct tmx_moe_weights *w);

    /* out[n][latent] = sum over j < k of weights[t][j] * RMSNorm_post(ye[t][j]), the norm
     * with weight post_norm [latent] and eps (post_norm NULL: no norm). On the all-reduced ye
     * of moe_experts_partial this is moe_experts' output. */
    void (*moe_combine)(void *ctx, float *out, const float *ye, const float *weights, int n,
                        int k, int latent, const struct tmx_tensor *post_norm, float eps);

    /* --- added in ABI 2.3 (optional) -------------------------------------------------- */

    /* (NULL: the core reads the logits back and picks on the host) For each row r < rows of x
     * (rows of ld floats), over its first d columns (0 < d <= ld): ids[r] = the lowest column
     * holding the largest value and best[r] = that value. NaN is never the largest; a row of
     * NaN only gives id 0 and best NaN. */
    void (*argmax)(void *ctx, int32_t *ids, float *best, const float *x, int rows, int d,
                   int ld);

    /* (NULL: matmul once per weight) ys[i][n][m_i] = x[n][k] . ws[i]^T for i < count,
     * 1 <= count <= 4, each ws[i] [m_i][k] as matmul takes it: the matmuls of a layer that
     * share their input (q, k and v; gate and up), which a set may run as one. The ys do not
     * alias x or each other. */
    void (*matmul_multi)(void *ctx, float *const *ys, const float *x,
                         const struct tmx_tensor *const *ws, int count, int n);

    /* --- added in ABI 2.4 (optional) -------------------------------------------------- */

    /* (NULL: the core reads the logits back and samples on the host) The first candidates of
     * each row r < rows of x (rows of ld floats), over its first d columns (0 < d <= ld), for
     * a sampler at temperature temps[r] (a buffer of rows values > 0): with y = x / temps[r]
     * rounded to F32, a column is a candidate unless x is NaN or -inf, and candidates go in
     * order of y, largest first, the lower column first among equal y. xs[r][k] (their x) and
     * ids[r][k] get the first k (1 <= k <= TMX_TOPK_MAX) in that order, then -inf and -1 past
     * the row's last; over all the row's candidates, in double, stats[r][0] = the sum of
     * exp(y - y_first), stats[r][1] = their number, stats[r][2] = the sum of exp(x - x_first)
     * (the softmax denominator at temperature 1, for log probabilities); 0 for a row of none. */
    void (*topk)(void *ctx, float *xs, int32_t *ids, double *stats, const float *x,
                 const float *temps, int rows, int d, int ld, int k);

    /* --- added in ABI 2.5 (optional) -------------------------------------------------- */

    /* (NULL: steps of requests with logit bias or penalties read their logits back) Edits
     * rows of x in place before topk: row r < rows (ld floats) takes the edits
     * edits[starts[r] .. starts[r + 1]) (both buffers; starts ascending from 0), those whose
     * id lies in [lo, lo + d) at column id - lo (a TP rank's vocabulary slice), each by
     * tmx_logit_edit_apply. A row has at most one edit of an id, so their order is free. */
    void (*logit_edit)(void *ctx, float *x, const struct tmx_logit_edit *edits,
                       const int32_t *starts, int rows, int ld, int lo, int d);

    /* --- added in ABI 2.6 (optional) -------------------------------------------------- */

    /* (NULL: add_gated, then rmsnorm) h[r][:] += g * a[r][:] as add_gated computes it, then
     * out[r][:] = RMSNorm(h[r][:]) * w as rmsnorm computes it (both bit for bit): a block's
     * residual update and the next block's input norm in one pass over h. out is not h. */
    void (*add_rmsnorm)(void *ctx, float *out, float *h, const float *a,
                        const struct tmx_tensor *g, const struct tmx_tensor *w, int rows, int d,
                        float eps);

    /* (NULL: rmsnorm of each head, then rope, for q and for k) q [n][hq][hd] and k
     * [n][hkv][hd] in place: each head row normed by q_norm / k_norm as rmsnorm norms it (NULL:
     * not normed), then rotated as rope rotates it, at pos with inv_freq; bit for bit those
     * ops. Attention's input in one launch. */
    void (*qk_norm_rope)(void *ctx, float *q, float *k, const struct tmx_tensor *q_norm,
                         const struct tmx_tensor *k_norm, const int32_t *pos,
                         const float *inv_freq, int n, int hq, int hkv, int hd, float eps);

    /* --- added in ABI 2.7 (optional) -------------------------------------------------- */

    /* (NULL: lends none) The set's own CPU threads, for a codec's host path
     * (tmx_codec_i.use_threads): *out stays valid until fini. Only a set with
     * TMX_CAP_HOST_MEMORY lends them; the core calls them between the set's ops, never
     * during one. */
    void (*host_threads)(void *ctx, struct tmx_threads *out);
};

/* The most candidates topk gives a row. */
#define TMX_TOPK_MAX 256

#endif
