/* tmx/plugin.h: the plugin ABI.
 *
 * A plugin is a shared object `libtmx-<kind>-<name>.so` that exports exactly one symbol:
 *
 *     TMX_PLUGIN_EXPORT const struct tmx_plugin *
 *     tmx_plugin_entry(const struct tmx_host *host, char **err);
 *
 * It returns a const descriptor (static storage in the plugin) or NULL with a message made by
 * host->err. The core refuses a descriptor whose abi_major differs from TMX_ABI_MAJOR, whose
 * abi_minor is newer than TMX_ABI_MINOR, whose struct_size is smaller than the ABI 1.0 size,
 * whose kind is unknown or whose name is already loaded for that kind; each refusal is one line
 * naming the file (and both versions for an ABI mismatch).
 *
 * Rules for every struct in this header:
 * - Append-only. New members go at the end and bump TMX_ABI_MINOR; removing or reordering
 *   members bumps TMX_ABI_MAJOR.
 * - Ops tables start with struct_size. The core calls a member only if the table is large
 *   enough to hold it and the pointer is non-NULL; members marked (optional) state their default.
 * - Every init has a fini, and fini is safe after a failed init and with ctx == NULL.
 * - Plugins link nothing of the core: everything they need from it comes through struct tmx_host.
 *   Error strings a plugin returns through `char **err` are made with host->err (the core frees
 *   them). */
#ifndef TMX_PLUGIN_H
#define TMX_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/kernels.h"
#include "tmx/safetensors.h"
#include "tmx/serve.h"
#include "tmx/status.h"
#include "tmx/tensor.h"

#define TMX_ABI_MAJOR 2
#define TMX_ABI_MINOR 9

#define TMX_PLUGIN_EXPORT __attribute__((visibility("default")))

/* Whether ops table t (a pointer) holds member m: inside its struct_size and non-NULL. */
#define TMX_OPS_HAS(t, m)                                                                         \
    ((t)->struct_size >= offsetof(__typeof__(*(t)), m) + sizeof((t)->m) && (t)->m)
#define TMX_PLUGIN_ENTRY_SYMBOL "tmx_plugin_entry"

enum tmx_plugin_kind {
    TMX_PLUGIN_KERNELS = 0, /* the op set the model graph runs on a device: struct tmx_kernels_i */
    TMX_PLUGIN_CODEC,       /* packed expert weights: struct tmx_codec_i */
    TMX_PLUGIN_DRAFTER,     /* proposes tokens for speculative decoding: struct tmx_drafter_i */
    TMX_PLUGIN_MEDIA,       /* image/video/audio bytes -> embeddings: struct tmx_media_i */
    TMX_PLUGIN_API,         /* a front end driving the engine: struct tmx_api_i */
    TMX_PLUGIN_BENCH,       /* A/B runs over kernels and codecs: struct tmx_bench_i */
    TMX_PLUGIN_KIND_COUNT
};

/* "kernels", "codec", ...: the <kind> part of the file name and of config keys. */
const char *tmx_plugin_kind_name(enum tmx_plugin_kind kind);
/* The inverse: TMX_PLUGIN_KIND_COUNT when `name` is no kind. */
enum tmx_plugin_kind tmx_plugin_kind_from_name(const char *name);

/* --- options ------------------------------------------------------------------------------ */

/* A plugin declares its options; the core fills them from the config file, the environment
 * (TMX_<KIND>_<NAME>_<OPTION>, upper case, '-' -> '_') and the command line
 * (--set <kind>.<name>.<option>=VALUE), in that order of precedence (command line wins), checks
 * each value against its type, and rejects keys the table does not list. */
enum tmx_opt_type { TMX_OPT_INT, TMX_OPT_FLOAT, TMX_OPT_BOOL, TMX_OPT_STRING };

struct tmx_option {
    const char *name;
    enum tmx_opt_type type;
    const char *def;  /* default, in the same text form the config accepts */
    const char *help; /* one line */
};

struct tmx_opts; /* opaque: the resolved option values of one plugin instance */

/* --- the host table: how a plugin reaches the core ----------------------------------------- */

enum tmx_log_level { TMX_LOG_ERROR = 0, TMX_LOG_WARN, TMX_LOG_INFO, TMX_LOG_DEBUG };

struct tmx_host {
    uint32_t struct_size;
    uint16_t abi_major, abi_minor;
    void (*log)(enum tmx_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
    /* Same contract as tmx_err() in tmx/status.h. */
    enum tmx_status (*err)(char **err, enum tmx_status st, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
    /* Option values, already validated against the plugin's option table, defaults applied.
     * A name the table does not declare is a programming error: NULL / 0. */
    const char *(*opt_str)(const struct tmx_opts *opts, const char *name);
    int64_t (*opt_int)(const struct tmx_opts *opts, const char *name);
    double (*opt_float)(const struct tmx_opts *opts, const char *name);
    int (*opt_bool)(const struct tmx_opts *opts, const char *name);
    /* Safetensors files (tmx/safetensors.h), for plugins that read or write their own. */
    enum tmx_status (*st_open)(const char *path, struct tmx_safetensors **out, char **err);
    void (*st_free)(struct tmx_safetensors *st);
    int (*st_find)(const struct tmx_safetensors *st, const char *name, struct tmx_tensor *t);
    const char *(*st_meta)(const struct tmx_safetensors *st, const char *key);
    enum tmx_status (*st_write)(const char *path, int n, const char *const *names,
                                const struct tmx_tensor *tensors, const char *const *meta_kv,
                                char **err);
    /* ABI 2.9: where an option's value came from ("models/x/tmx.json: plugins: api.openai.port",
     * "command line: ...", "TMX_API_OPENAI_PORT: ...", "api.openai.port (default)"), for a
     * plugin's own range errors; lives as long as opts. Read it through tmx_opt_where(). */
    const char *(*opt_where)(const struct tmx_opts *opts, const char *name);
};

/* Where option `name` came from, or `name` itself from a host older than ABI 2.9. */
static inline const char *tmx_opt_where(const struct tmx_host *h, const struct tmx_opts *opts,
                                        const char *name) {
    return TMX_OPS_HAS(h, opt_where) ? h->opt_where(opts, name) : name;
}

/* --- the descriptor ------------------------------------------------------------------------ */

#define TMX_CAP_EXPERIMENTAL (1ull << 0) /* chosen only when named explicitly */
#define TMX_CAP_HOST_MEMORY (1ull << 1)  /* kernels: buffers are plain host memory, so a
                                            codec's host path can run on them */

struct tmx_plugin {
    uint16_t abi_major;   /* TMX_ABI_MAJOR at build time */
    uint16_t abi_minor;   /* TMX_ABI_MINOR at build time */
    uint32_t struct_size; /* sizeof(struct tmx_plugin) at build time */
    const char *name;     /* unique per kind: "cpu", "trellis-e4m3", ... */
    enum tmx_plugin_kind kind;
    const char *version;  /* the plugin's own version, informational */
    uint64_t caps;        /* TMX_CAP_* bits */
    const struct tmx_option *opts; /* {0}-terminated, or NULL for none */
    const void *ops;      /* struct tmx_<kind>_i for `kind` */
};

typedef const struct tmx_plugin *(*tmx_plugin_entry_fn)(const struct tmx_host *host, char **err);

/* --- kind: codec ---------------------------------------------------------------------------
 * Packed routed experts. A checkpoint names its codec in hf_quant_config.json ("codec":
 * "<name>" -> plugin codec.<name>); the core then hands each MoE layer's experts to the codec
 * instead of binding expert tensors itself. A codec reads its own files (through the host's
 * safetensors functions) and runs the experts of a layer on host memory, or on a kernel set's
 * device through the optional device path. */

/* One MoE layer as config.json describes it. */
struct tmx_codec_layer_info {
    const char *model_dir; /* the checkpoint folder */
    int layer;             /* layer id */
    int n_experts;         /* n_routed_experts */
    int latent, inter;     /* moe_latent_size, moe_intermediate_size */
};

/* What tmx quantize hands a codec to encode one layer. Weights are F32 host arrays in the
 * checkpoint's [out][in] layout; Hessians are F64 [in][in] sums of x x^T over calibration inputs
 * (an entry may be NULL: no inputs, use the identity); n_tokens counts those inputs. */
struct tmx_codec_encode_job {
    const char *out_dir;              /* the build folder: the codec writes its files under it */
    int layer, n_experts, latent, inter;
    const float *const *gate, *const *up; /* [n_experts] of [inter][latent] */
    const float *const *down;             /* [n_experts] of [latent][inter] */
    const double *const *h_in;            /* [n_experts] of [latent][latent]: gate and up */
    const double *const *h_mid;           /* [n_experts] of [inter][inter]: down */
    const int64_t *n_tokens;              /* [n_experts] */
    int bits;                             /* K */
    int n_threads;
    /* called from the encoding threads, serialized by the codec; may be NULL */
    void (*progress)(void *arg, int64_t tiles_done, int64_t tiles_total);
    void *progress_arg;
    double *proxy_err;                    /* out, [n_experts][3]: per-matrix proxy error */
};

struct tmx_codec_i {
    uint32_t struct_size;
    const char *quant_method; /* the hf_quant_config.json "quant_method" it reads, e.g. "trellismx" */
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts, void **ctx,
                            char **err);
    void (*fini)(void *ctx);
    /* Opens the experts of one layer; the layer keeps what it mmapped until layer_free. */
    enum tmx_status (*layer_load)(void *ctx, const struct tmx_codec_layer_info *info,
                                  void **layer, char **err);
    void (*layer_free)(void *ctx, void *layer);
    /* The contract of tmx_kernels_i.moe_experts (post_norm [latent] F32/BF16/F16 or NULL), on
     * host memory. */
    enum tmx_status (*moe_experts)(void *ctx, void *layer, float *out, const float *z,
                                   const int32_t *ids, const float *weights, int n, int k,
                                   const struct tmx_tensor *post_norm, float eps, char **err);
    /* The F32 matrix one expert's projection (0 gate, 1 up, 2 down) stands for, reconstructed:
     * w[inter][latent] for gate and up, w[latent][inter] for down (caller-owned). */
    enum tmx_status (*expert_decode)(void *ctx, void *layer, int expert, int proj, float *w,
                                     char **err);
    /* (optional; NULL: the codec cannot encode) Encodes one layer and writes its files. */
    enum tmx_status (*layer_encode)(void *ctx, const struct tmx_codec_encode_job *job,
                                    char **err);
    /* (optional; NULL: no members of its own) The codec's members of hf_quant_config.json for a
     * build at `bits` per weight, as the text of one JSON object written to buf[size]
     * snprintf-style: returns the length it needs, or < 0 when it cannot build at `bits`.
     * tmx quantize adds "quant_method", "codec", "mxfp8_tensors" and "producer". */
    int (*quant_config)(void *ctx, int bits, char *buf, size_t size);

    /* --- device path (optional; NULL: host memory only) ---------------------------------
     * For a kernel set without TMX_CAP_HOST_MEMORY, named by `kernels` ("cuda"); a codec
     * refuses a set it has no code for with TMX_ERR_UNSUPPORTED. `stream` is the set's
     * native_stream. device_load copies a layer opened by layer_load to the device (the host
     * layer may be freed afterwards); device_moe_experts has moe_experts' contract on the set's
     * buffers (post_norm imported into the set), queued on `stream`: it returns launch errors,
     * and errors of the queued work surface at the kernel set's next sync. */
    enum tmx_status (*device_load)(void *ctx, void *layer, const char *kernels, void *stream,
                                   void **dev, char **err);
    void (*device_free)(void *ctx, void *dev);
    enum tmx_status (*device_moe_experts)(void *ctx, void *dev, void *stream, float *out,
                                          const float *z, const int32_t *ids,
                                          const float *weights, int n, int k,
                                          const struct tmx_tensor *post_norm, float eps,
                                          char **err);

    /* --- tensor parallelism (optional, both or neither; NULL: models of one rank only; ABI
     * 2.1). A rank of n_ranks holds every expert's intermediate rows [inter * rank / n_ranks,
     * inter * (rank + 1) / n_ranks): gate and up rows, down columns (docs/tp.md).
     * layer_load_slice is layer_load for that slice; it refuses a slice its format cannot cut
     * with a message naming the layer and the boundary. The layer is freed with layer_free;
     * expert_decode gives the slice's matrices. moe_experts_partial has the contract of
     * tmx_kernels_i.moe_experts_partial on host memory: ye[n][k][latent] gets each pair's y_e
     * over the slice, in the model's basis, neither normalized nor weighted. */
    enum tmx_status (*layer_load_slice)(void *ctx, const struct tmx_codec_layer_info *info,
                                        int rank, int n_ranks, void **layer, char **err);
    enum tmx_status (*moe_experts_partial)(void *ctx, void *layer, float *ye, const float *z,
                                           const int32_t *ids, int n, int k, char **err);

    /* --- added in ABI 2.7 (optional; NULL: the host path runs on threads of its own) ------
     * The host path's work runs on `threads` from now on (the kernel set's, lent through
     * tmx_kernels_i.host_threads, valid until the codec's fini), and the codec stops the
     * threads of its own. The core calls it once, after init and before any layer loads. */
    void (*use_threads)(void *ctx, const struct tmx_threads *threads);
};

/* --- kind: drafter ---------------------------------------------------------------------------
 * Proposes up to max_draft tokens that may follow `tokens`; the engine verifies them. */
struct tmx_drafter_i {
    uint32_t struct_size;
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts, void **ctx,
                            char **err);
    void (*fini)(void *ctx);
    /* Writes the proposal to draft[0..n) and returns n (0 = nothing to propose). */
    int (*propose)(void *ctx, const int32_t *tokens, int n_tokens, int32_t *draft, int max_draft);
};

/* --- kind: media ---------------------------------------------------------------------------
 * Turns the bytes of one image/video/audio item into embeddings that replace placeholder
 * tokens in the text stream. */
struct tmx_media_i {
    uint32_t struct_size;
    const char *const *mime_types; /* NULL-terminated: what `embed` accepts */
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts, void **ctx,
                            char **err);
    void (*fini)(void *ctx);
    /* On success *emb is a malloc'd [*n_tokens][dim] F32 array the caller frees. */
    enum tmx_status (*embed)(void *ctx, const char *mime, const void *bytes, size_t n_bytes,
                             int dim, float **emb, int *n_tokens, char **err);
};

/* --- kind: api -----------------------------------------------------------------------------
 * A front end. init gets the engine's serving table (tmx/serve.h), which outlives the plugin
 * instance; `run` blocks serving until `stop` is called from another thread. */
struct tmx_api_i {
    uint32_t struct_size;
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts,
                            const struct tmx_serve_i *serve, void **ctx, char **err);
    void (*fini)(void *ctx);
    enum tmx_status (*run)(void *ctx, char **err);
    void (*stop)(void *ctx);
    /* ABI 2.8 (optional; NULL: init checks them) the options alone, before the model loads, so
     * that a bad one fails at once rather than after minutes of loading */
    enum tmx_status (*check)(const struct tmx_host *host, const struct tmx_opts *opts,
                             char **err);
};

/* --- kind: bench ---------------------------------------------------------------------------
 * A/B timing cases. `run` times every case whose name contains `filter` (NULL: all) and writes
 * one JSON object per case and line to `out_fd`. */
struct tmx_bench_i {
    uint32_t struct_size;
    enum tmx_status (*init)(const struct tmx_host *host, const struct tmx_opts *opts, void **ctx,
                            char **err);
    void (*fini)(void *ctx);
    enum tmx_status (*run)(void *ctx, const char *filter, int out_fd, char **err);
};

#endif
