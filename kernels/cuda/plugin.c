/* plugin.c: the CUDA kernel set, kernels.cuda (libtmx-kernels-cuda.so).
 *
 * One NVIDIA GPU, one stream per ctx. Buffers and imported weights are device memory from
 * cudaMalloc (never managed memory), so the set does not declare TMX_CAP_HOST_MEMORY. Ops only
 * queue kernels; a failure is recorded in the ctx (host-side checks, launch errors, cuBLAS
 * statuses) or, for bad values inside device buffers (ids, positions, block tables), in a
 * device flag that sync reads back. Graphs are CUDA graphs captured from the stream. This file
 * holds the context, memory, graphs, the ops table and the entry point; the ops live in
 * rows.cu, matmul.cu, attention.cu and moe.cu. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-set.h"

/* cuBLASLt's workspace: what NVIDIA recommends for Hopper. */
#define LT_WORKSPACE ((size_t)32 << 20)

/* --- context helpers ------------------------------------------------------------------------ */

void cu_fail(struct cu_ctx *c, enum tmx_status st, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->host->log) c->host->log(TMX_LOG_ERROR, "kernels.cuda: %s", msg);
    if (c->status == TMX_OK) c->status = st;
}

int cu_check_launch(struct cu_ctx *c, const char *op) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 1;
    cu_fail(c, TMX_ERR_DEVICE, "%s: launch failed: %s", op, cudaGetErrorString(e));
    return 0;
}

void *cu_scratch(struct cu_ctx *c, size_t nbytes, const char *op) {
    if (nbytes <= c->scratch_size) return c->scratch;
    if (c->n_retired == (int)(sizeof c->retired / sizeof c->retired[0])) {
        cu_fail(c, TMX_ERR_NOMEM, "%s: scratch grew too many times", op);
        return NULL;
    }
    size_t size = c->scratch_size * 2 > nbytes ? c->scratch_size * 2 : nbytes;
    size = (size + 255) & ~(size_t)255;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, size);
    if (e != cudaSuccess) {
        cu_fail(c, TMX_ERR_NOMEM, "%s: cannot allocate %zu bytes of scratch: %s", op, size,
                cudaGetErrorString(e));
        return NULL;
    }
    if (c->scratch) c->retired[c->n_retired++] = c->scratch;
    c->scratch = p;
    c->scratch_size = size;
    return p;
}

static const char *dtype_name(enum tmx_dtype dt) {
    static const char *const names[TMX_DTYPE_COUNT] = {
        [TMX_DTYPE_F32] = "F32", [TMX_DTYPE_BF16] = "BF16", [TMX_DTYPE_F16] = "F16",
        [TMX_DTYPE_F8_E4M3] = "F8_E4M3", [TMX_DTYPE_U8] = "U8", [TMX_DTYPE_I32] = "I32",
        [TMX_DTYPE_I8] = "I8", [TMX_DTYPE_MXFP8] = "MXFP8",
    };
    return (unsigned)dt < TMX_DTYPE_COUNT ? names[dt] : "?";
}

static int weight_dtype_ok(enum tmx_dtype dt) {
    return dt == TMX_DTYPE_F32 || dt == TMX_DTYPE_BF16 || dt == TMX_DTYPE_F16;
}

int cu_check_weight(struct cu_ctx *c, const char *op, const char *what,
                    const struct tmx_tensor *w, int ndim, int64_t rows, int64_t cols) {
    if (!w || !w->data) {
        cu_fail(c, TMX_ERR_INVALID, "%s: %s is missing", op, what);
        return 0;
    }
    if (!weight_dtype_ok(w->dtype)) {
        cu_fail(c, TMX_ERR_UNSUPPORTED, "%s: %s dtype %s not supported (F32, BF16 or F16)", op,
                what, dtype_name(w->dtype));
        return 0;
    }
    if (w->ndim != ndim || w->shape[0] <= 0 || (ndim == 2 && w->shape[1] <= 0) ||
        (rows > 0 && w->shape[0] != rows) || (ndim == 2 && cols > 0 && w->shape[1] != cols)) {
        cu_fail(c, TMX_ERR_INVALID, "%s: %s is %d-D [%lld][%lld], want %d-D [%lld][%lld]", op,
                what, w->ndim, (long long)w->shape[0], (long long)(w->ndim > 1 ? w->shape[1] : 0),
                ndim, (long long)rows, (long long)cols);
        return 0;
    }
    return 1;
}

int cu_enter(struct cu_ctx *c, const char *op) {
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) return 1;
    cu_fail(c, TMX_ERR_DEVICE, "%s: cudaSetDevice(%d): %s", op, c->device, cudaGetErrorString(e));
    return 0;
}

/* --- lifecycle ------------------------------------------------------------------------------ */

static void cu_fini(void *ctx) {
    struct cu_ctx *c = ctx;
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->stream) cudaStreamSynchronize(c->stream);
    for (int i = 0; i < c->n_retired; i++) cudaFree(c->retired[i]);
    cudaFree(c->scratch);
    cudaFree(c->lt_ws);
    cudaFree(c->dev_err);
    cudaFreeHost(c->dev_err_host);
    cu_lt_plans_free(c);
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

static enum tmx_status cu_init(const struct tmx_host *host, const struct tmx_opts *opts,
                               void **ctx, char **err) {
    *ctx = NULL;
    int64_t device = host->opt_int ? host->opt_int(opts, "device") : 0;
    const int64_t gemv_max = host->opt_int ? host->opt_int(opts, "gemv_max") : 3;
    if (gemv_max < 1 || gemv_max > 8)
        return host->err(err, TMX_ERR_INVALID, "%s = %lld: want 1 to 8",
                         tmx_opt_where(host, opts, "gemv_max"), (long long)gemv_max);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return host->err(err, TMX_ERR_UNSUPPORTED, "no CUDA device: %s",
                         cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return host->err(err, TMX_ERR_INVALID, "%s = %lld: want 0 to %d",
                         tmx_opt_where(host, opts, "device"), (long long)device, count - 1);
    struct cu_ctx *c = calloc(1, sizeof *c);
    if (!c) return host->err(err, TMX_ERR_NOMEM, "out of memory");
    c->host = host;
    c->device = (int)device;
    const char *step = "cudaSetDevice";
    if ((e = cudaSetDevice(c->device)) != cudaSuccess ||
        (step = "cudaStreamCreate",
         (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) ||
        (step = "cudaMalloc", (e = cudaMalloc((void **)&c->dev_err, sizeof(int))) != cudaSuccess) ||
        (e = cudaMalloc(&c->lt_ws, LT_WORKSPACE)) != cudaSuccess ||
        (step = "cudaMallocHost",
         (e = cudaMallocHost((void **)&c->dev_err_host, sizeof(int))) != cudaSuccess) ||
        (step = "cudaMemset", (e = cudaMemset(c->dev_err, 0, sizeof(int))) != cudaSuccess)) {
        cu_fini(c);
        return host->err(err, TMX_ERR_DEVICE, "device %lld: %s: %s", (long long)device,
                         step, cudaGetErrorString(e));
    }
    c->lt_ws_size = LT_WORKSPACE;
    cublasStatus_t bs = cublasLtCreate(&c->lt);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        c->lt = NULL;
        cu_fini(c);
        return host->err(err, TMX_ERR_DEVICE, "cublasLtCreate: %s",
                         cublasLtGetStatusString(bs));
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, c->device) != cudaSuccess) prop.major = 0;
    c->pdl = prop.major >= 9 && (!host->opt_bool || host->opt_bool(opts, "pdl"));
    c->bf16_mma = !host->opt_bool || host->opt_bool(opts, "bf16_mma");
    c->gemv_max = (int)gemv_max;
    c->bf16_mv = !host->opt_bool || host->opt_bool(opts, "bf16_mv");
    c->mx_mv = !host->opt_bool || host->opt_bool(opts, "mx_mv");
    c->lt_buckets = !host->opt_bool || host->opt_bool(opts, "lt_buckets");
    if (host->log && prop.major)
        host->log(TMX_LOG_INFO, "kernels.cuda: device %d: %s (sm_%d%d, %d SMs)%s", c->device,
                  prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                  c->pdl ? ", programmatic dependent launch" : "");
    *ctx = c;
    return TMX_OK;
}

/* --- memory --------------------------------------------------------------------------------- */

static enum tmx_status cu_buf_alloc(void *ctx, size_t nbytes, void **buf) {
    struct cu_ctx *c = ctx;
    *buf = NULL;
    if (!cu_enter(c, "buf_alloc")) return TMX_ERR_DEVICE;
    size_t size = nbytes ? (nbytes + 255) & ~(size_t)255 : 256;
    if (cudaMalloc(buf, size) != cudaSuccess) {
        *buf = NULL;
        return TMX_ERR_NOMEM;
    }
    if (cudaMemsetAsync(*buf, 0, size, c->stream) != cudaSuccess) {
        cudaFree(*buf);
        *buf = NULL;
        return TMX_ERR_DEVICE;
    }
    return TMX_OK;
}

/* cudaFree waits for the device, so queued ops that still read the buffer finish first. */
static void cu_buf_free(void *ctx, void *buf) {
    struct cu_ctx *c = ctx;
    if (buf && cu_enter(c, "buf_free")) cudaFree(buf);
}

/* From pageable memory the copy returns once the source is staged, so the caller may reuse it. */
static enum tmx_status cu_buf_write(void *ctx, void *dst, const void *host_src, size_t nbytes) {
    struct cu_ctx *c = ctx;
    if (!cu_enter(c, "buf_write")) return TMX_ERR_DEVICE;
    cudaError_t e = cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) return TMX_OK;
    cu_fail(c, TMX_ERR_DEVICE, "buf_write: %s", cudaGetErrorString(e));
    return TMX_ERR_DEVICE;
}

static enum tmx_status cu_buf_read(void *ctx, void *host_dst, const void *src, size_t nbytes) {
    struct cu_ctx *c = ctx;
    if (!cu_enter(c, "buf_read")) return TMX_ERR_DEVICE;
    cudaError_t e = cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e == cudaSuccess) return TMX_OK;
    cu_fail(c, TMX_ERR_DEVICE, "buf_read: %s", cudaGetErrorString(e));
    return TMX_ERR_DEVICE;
}

static enum tmx_status cu_weight_import(void *ctx, const struct tmx_tensor *host,
                                        struct tmx_tensor *dev, char **err) {
    struct cu_ctx *c = ctx;
    const int mx = host->dtype == TMX_DTYPE_MXFP8; /* a matmul weight: codes, then scales */
    if (!weight_dtype_ok(host->dtype) && !mx)
        return c->host->err(err, TMX_ERR_UNSUPPORTED,
                            "kernels.cuda: weight dtype %s not supported (F32, BF16, F16 or "
                            "MXFP8)", dtype_name(host->dtype));
    if (mx && (host->ndim != 2 || host->shape[0] <= 0 || host->shape[1] <= 0 ||
               host->shape[1] % 32))
        return c->host->err(err, TMX_ERR_INVALID,
                            "kernels.cuda: MXFP8 weight must be 2-D with a multiple of 32 columns");
    if (!cu_enter(c, "weight_import"))
        return c->host->err(err, TMX_ERR_DEVICE, "kernels.cuda: cannot select device %d", c->device);
    size_t nbytes = 1;
    for (int d = 0; d < host->ndim; d++) nbytes *= (size_t)host->shape[d];
    nbytes = mx ? nbytes + nbytes / 32 : nbytes * (host->dtype == TMX_DTYPE_F32 ? 4 : 2);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (e != cudaSuccess)
        return c->host->err(err, TMX_ERR_NOMEM, "kernels.cuda: weight of %zu bytes: %s", nbytes,
                            cudaGetErrorString(e));
    e = cudaMemcpyAsync(p, host->data, nbytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaFree(p);
        return c->host->err(err, TMX_ERR_DEVICE, "kernels.cuda: weight upload of %zu bytes: %s",
                            nbytes, cudaGetErrorString(e));
    }
    *dev = *host;
    dev->data = p;
    return TMX_OK;
}

static void cu_weight_free(void *ctx, struct tmx_tensor *dev) {
    struct cu_ctx *c = ctx;
    if (dev->data && cu_enter(c, "weight_free")) cudaFree(dev->data);
    dev->data = NULL;
}

static const char *dev_err_text(int code) {
    static const char *const text[CU_DEV_COUNT] = {
        [CU_DEV_EMBED_ID] = "embed: an id is outside the table",
        [CU_DEV_POSITION] = "rope/attention: a position is negative",
        [CU_DEV_SLOT] = "kv_store: a slot is outside the cache",
        [CU_DEV_BLOCK] = "attention: a block table entry or sequence is outside the cache",
        [CU_DEV_GATHER_ROW] = "gather: a row index is negative",
    };
    return code > 0 && code < CU_DEV_COUNT ? text[code] : "unknown device-side error";
}

/* Waits for the stream; returns the first failure since the last sync: host-side, then the
 * stream's own (a faulting kernel), then what kernels flagged in their inputs. */
static enum tmx_status cu_sync(void *ctx) {
    struct cu_ctx *c = ctx;
    if (cu_enter(c, "sync")) {
        cudaError_t e = cudaMemcpyAsync(c->dev_err_host, c->dev_err, sizeof(int),
                                        cudaMemcpyDeviceToHost, c->stream);
        if (e == cudaSuccess) e = cudaMemsetAsync(c->dev_err, 0, sizeof(int), c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess)
            cu_fail(c, TMX_ERR_DEVICE, "sync: %s", cudaGetErrorString(e));
        else if (*c->dev_err_host)
            cu_fail(c, TMX_ERR_INVALID, "%s", dev_err_text(*c->dev_err_host));
    }
    enum tmx_status st = c->status;
    c->status = TMX_OK;
    return st;
}

/* --- graphs ---------------------------------------------------------------------------------
 * Relaxed capture, so that an op may grow the scratch (cudaMalloc) while it is recorded: the
 * graph keeps the new block's address and the old one is retired, not freed. Ops check their
 * host-side arguments while they are recorded; a failure recorded during the capture fails
 * graph_end. */

static enum tmx_status cu_graph_begin(void *ctx) {
    struct cu_ctx *c = ctx;
    if (!cu_enter(c, "graph_begin")) return TMX_ERR_DEVICE;
    if (c->capturing) {
        cu_fail(c, TMX_ERR_INVALID, "graph_begin: already capturing");
        return TMX_ERR_INVALID;
    }
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed);
    if (e != cudaSuccess) {
        cu_fail(c, TMX_ERR_DEVICE, "graph_begin: %s", cudaGetErrorString(e));
        return TMX_ERR_DEVICE;
    }
    c->capturing = 1;
    return TMX_OK;
}

static enum tmx_status cu_graph_end(void *ctx, void **graph) {
    struct cu_ctx *c = ctx;
    *graph = NULL;
    if (!cu_enter(c, "graph_end")) return TMX_ERR_DEVICE;
    if (!c->capturing) {
        cu_fail(c, TMX_ERR_INVALID, "graph_end: no graph_begin");
        return TMX_ERR_INVALID;
    }
    c->capturing = 0;
    cudaGraph_t g = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e == cudaSuccess && c->status == TMX_OK) e = cudaGraphInstantiate(&exec, g, 0);
    if (g) cudaGraphDestroy(g);
    if (e != cudaSuccess) cu_fail(c, TMX_ERR_DEVICE, "graph_end: %s", cudaGetErrorString(e));
    if (c->status != TMX_OK) {
        if (exec) cudaGraphExecDestroy(exec);
        enum tmx_status st = c->status;
        c->status = TMX_OK;
        return st;
    }
    *graph = exec;
    return TMX_OK;
}

static enum tmx_status cu_graph_launch(void *ctx, void *graph) {
    struct cu_ctx *c = ctx;
    if (!cu_enter(c, "graph_launch")) return TMX_ERR_DEVICE;
    cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, c->stream);
    if (e == cudaSuccess) return TMX_OK;
    cu_fail(c, TMX_ERR_DEVICE, "graph_launch: %s", cudaGetErrorString(e));
    return TMX_ERR_DEVICE;
}

static void cu_graph_free(void *ctx, void *graph) {
    struct cu_ctx *c = ctx;
    if (graph && cu_enter(c, "graph_free")) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

static void *cu_native_stream(void *ctx) { return ((struct cu_ctx *)ctx)->stream; }

/* --- the plugin ----------------------------------------------------------------------------- */

static const struct tmx_kernels_i cu_ops = {
    .struct_size = sizeof(struct tmx_kernels_i),
    .init = cu_init,
    .fini = cu_fini,
    .buf_alloc = cu_buf_alloc,
    .buf_free = cu_buf_free,
    .buf_write = cu_buf_write,
    .buf_read = cu_buf_read,
    .weight_import = cu_weight_import,
    .weight_free = cu_weight_free,
    .sync = cu_sync,
    .graph_begin = cu_graph_begin,
    .graph_end = cu_graph_end,
    .graph_launch = cu_graph_launch,
    .graph_free = cu_graph_free,
    .embed = cu_embed,
    .rmsnorm = cu_rmsnorm,
    .matmul = cu_matmul,
    .rope = cu_rope,
    .kv_store = cu_kv_store,
    .attention = cu_attention,
    .moe_route = cu_moe_route,
    .moe_experts = cu_moe_experts,
    .swiglu = cu_swiglu,
    .add_gated = cu_add_gated,
    .gather = cu_gather,
    .native_stream = cu_native_stream,
    .moe_experts_partial = cu_moe_experts_partial,
    .moe_combine = cu_moe_combine,
    .argmax = cu_argmax,
    .matmul_multi = cu_matmul_multi,
    .topk = cu_topk,
    .logit_edit = cu_logit_edit,
    .add_rmsnorm = cu_add_rmsnorm,
    .qk_norm_rope = cu_qk_norm_rope,
};

static const struct tmx_option cu_options[] = {
    {"device", TMX_OPT_INT, "0", "CUDA device ordinal the set runs on"},
    {"pdl", TMX_OPT_BOOL, "true", "programmatic dependent launch: in a recorded graph (a decode "
     "step), a kernel may start while the one before it finishes (sm_90 and later)"},
    {"bf16_mma", TMX_OPT_BOOL, "true", "BF16 matmuls of 9 to 64 tokens with weights of at most "
     "1,024 columns in one tensor-core kernel of the set's own instead of cuBLASLt's two split "
     "GEMMs"},
    {"gemv_max", TMX_OPT_INT, "3", "BF16 matmuls of weights of at least 4,096 rows and 2,048 "
     "columns that bf16_mv does not take (it off, or its alignment unmet) take the GEMV kernels "
     "up to this many tokens (1 to 8) and cuBLASLt's split GEMMs beyond; other weights take the "
     "GEMV up to 8 tokens"},
    {"bf16_mv", TMX_OPT_BOOL, "true", "BF16 matmuls of 2 to 8 tokens with weights of at least "
     "4,096 rows and 2,048 columns on the tensor cores (mv_kernel) instead of the GEMV or "
     "cuBLASLt's split GEMMs"},
    {"mx_mv", TMX_OPT_BOOL, "true", "the same for MXFP8 weights, in place of their GEMV"},
    {"lt_buckets", TMX_OPT_BOOL, "true", "cuBLASLt matmuls take the algorithm chosen for their "
     "tokens rounded up to a power of two (those the warm-up runs), where it runs at theirs"},
    {0},
};

static const struct tmx_plugin cu_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "cuda",
    .kind = TMX_PLUGIN_KERNELS,
    .version = "0.1.0",
    .caps = 0, /* device memory: no TMX_CAP_HOST_MEMORY */
    .opts = cu_options,
    .ops = &cu_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host;
    (void)err;
    return &cu_plugin;
}
