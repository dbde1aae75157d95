/* plugin.c: the CPU kernel set, kernels.cpu (libtmx-kernels-cpu.so).
 *
 * C with 8-wide vectors and a thread pool: the reference every other kernel set is checked against.
 * Buffers are host memory, weights are the host tensors themselves (no copy), and every op
 * runs eagerly when called, so there is nothing to queue and no graph to record: the graph_*
 * members stay NULL. Ops spread their work over the pool in tasks whose results do not depend
 * on the thread count (see pool.h). This file holds the context, memory, the ops table and the
 * entry point; the ops live in matmul.c, rows.c, attention.c and moe.c. It has the optional
 * tensor-parallel ops (moe_experts_partial, moe_combine), so it runs ranks of any TP size. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu.h"

/* --- context helpers ------------------------------------------------------------------------ */

void cpu_fail(struct cpu_ctx *c, enum tmx_status st, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->host->log) c->host->log(TMX_LOG_ERROR, "kernels.cpu: %s", msg);
    if (c->status == TMX_OK) c->status = st;
}

void *cpu_scratch(struct cpu_ctx *c, size_t nbytes, const char *op) {
    if (nbytes <= c->scratch_size) return c->scratch;
    size_t size = (nbytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, size);
    if (!p) {
        cpu_fail(c, TMX_ERR_NOMEM, "%s: cannot allocate %zu bytes of scratch", op, size);
        return NULL;
    }
    free(c->scratch);
    c->scratch = p;
    c->scratch_size = size;
    return p;
}

const char *cpu_dtype_name(enum tmx_dtype dt) {
    static const char *const names[TMX_DTYPE_COUNT] = {
        [TMX_DTYPE_F32] = "F32", [TMX_DTYPE_BF16] = "BF16", [TMX_DTYPE_F16] = "F16",
        [TMX_DTYPE_F8_E4M3] = "F8_E4M3", [TMX_DTYPE_U8] = "U8", [TMX_DTYPE_I32] = "I32",
        [TMX_DTYPE_I8] = "I8", [TMX_DTYPE_MXFP8] = "MXFP8",
    };
    return (unsigned)dt < TMX_DTYPE_COUNT ? names[dt] : "?";
}

int cpu_check_weight(struct cpu_ctx *c, const char *op, const char *what,
                     const struct tmx_tensor *w, int ndim, int64_t rows, int64_t cols) {
    if (!w || !w->data) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %s is missing", op, what);
        return 0;
    }
    if (!cpu_dtype_ok(w->dtype)) {
        cpu_fail(c, TMX_ERR_UNSUPPORTED, "%s: %s dtype %s not supported (F32, BF16 or F16)", op,
                 what, cpu_dtype_name(w->dtype));
        return 0;
    }
    if (w->ndim != ndim) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %s is %d-D, want %d-D", op, what, w->ndim, ndim);
        return 0;
    }
    if (w->shape[0] <= 0 || (ndim == 2 && w->shape[1] <= 0)) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %s has an empty dimension", op, what);
        return 0;
    }
    if (ndim == 1 && rows > 0 && w->shape[0] != rows) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %s has %lld elements, want %lld", op, what,
                 (long long)w->shape[0], (long long)rows);
        return 0;
    }
    if (ndim == 2 && ((rows > 0 && w->shape[0] != rows) || (cols > 0 && w->shape[1] != cols))) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: %s has shape [%lld][%lld], want [%lld][%lld]", op, what,
                 (long long)w->shape[0], (long long)w->shape[1], (long long)rows, (long long)cols);
        return 0;
    }
    return 1;
}

void cpu_to_f32(float *dst, const void *src, enum tmx_dtype dt, int64_t off, int64_t count) {
    switch (dt) {
    case TMX_DTYPE_BF16: {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < count; i++) dst[i] = tmx_bf16_to_f32(s[i]);
        break;
    }
    case TMX_DTYPE_F16: {
        const uint16_t *s = (const uint16_t *)src + off;
        int64_t i = 0;
        for (; i + 8 <= count; i += 8) v8_store(dst + i, v8_load_f16(s + i));
        for (; i < count; i++) dst[i] = tmx_f16_to_f32(s[i]);
        break;
    }
    default: memcpy(dst, (const float *)src + off, (size_t)count * sizeof *dst); break;
    }
}

struct cpu_task {
    cpu_task_fn fn;
    void *arg;
};

static void run_task(void *arg, int64_t task, int thread) {
    const struct cpu_task *t = arg;
    (void)thread;
    t->fn(t->arg, task);
}

void cpu_pool_run(struct tmx_pool *pool, int64_t n_tasks, cpu_task_fn fn, void *arg) {
    struct cpu_task t = {fn, arg};
    tmx_pool_run(pool, n_tasks, run_task, &t);
}

/* The set's pool lent to a codec's host path (tmx_codec_i.use_threads): the codec's work then
 * runs on these threads between the set's ops, instead of on threads of its own that would
 * share the cores with them. */
static void cpu_host_threads(void *ctx, struct tmx_threads *out) {
    struct cpu_ctx *c = ctx;
    *out = tmx_pool_as_threads(c->pool);
}

/* --- lifecycle ------------------------------------------------------------------------------ */

static void cpu_fini(void *ctx) {
    struct cpu_ctx *c = ctx;
    if (!c) return;
    tmx_pool_free(c->pool);
    free(c->scratch);
    free(c);
}

static enum tmx_status cpu_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                void **ctx, char **err) {
    *ctx = NULL;
    int64_t threads = host->opt_int ? host->opt_int(opts, "threads") : 0;
    if (threads < 0 || threads > 1024)
        return host->err(err, TMX_ERR_INVALID, "%s = %lld: want 0 (one per online CPU) to 1024",
                         tmx_opt_where(host, opts, "threads"), (long long)threads);
    if (threads == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        threads = online > 0 ? online : 1;
    }
    struct cpu_ctx *c = calloc(1, sizeof *c);
    if (!c) return host->err(err, TMX_ERR_NOMEM, "kernels.cpu: out of memory");
    c->host = host;
    if (tmx_pool_new((int)threads, TMX_POOL_SPIN, &c->pool) != TMX_OK) {
        cpu_fini(c);
        return host->err(err, TMX_ERR_NOMEM, "kernels.cpu: cannot start %lld threads",
                         (long long)threads);
    }
    if (host->log) host->log(TMX_LOG_DEBUG, "kernels.cpu: %lld threads", (long long)threads);
    *ctx = c;
    return TMX_OK;
}

/* --- memory --------------------------------------------------------------------------------- */

/* Large buffers come from mmap: zero pages that cost nothing until written, so a KV cache sized
 * for the worst case only takes the memory its sequences fill. Small ones come from the heap,
 * where the sanitizers watch their edges. The length sits in a 64-byte header, which keeps the
 * buffer 64-byte aligned. */
#define BUF_HEADER 64
#define BUF_LAZY (1u << 20)

static enum tmx_status cpu_buf_alloc(void *ctx, size_t nbytes, void **buf) {
    (void)ctx;
    const size_t len = BUF_HEADER + ((nbytes + 63) & ~(size_t)63);
    char *p;
    if (len >= BUF_LAZY) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return TMX_ERR_NOMEM;
    } else {
        if (!(p = aligned_alloc(64, len))) return TMX_ERR_NOMEM;
        memset(p, 0, len);
    }
    memcpy(p, &len, sizeof len);
    *buf = p + BUF_HEADER;
    return TMX_OK;
}

static void cpu_buf_free(void *ctx, void *buf) {
    (void)ctx;
    char *p = (char *)buf - BUF_HEADER;
    size_t len;
    memcpy(&len, p, sizeof len);
    if (len >= BUF_LAZY) munmap(p, len);
    else free(p);
}

static enum tmx_status cpu_buf_write(void *ctx, void *dst, const void *host_src, size_t nbytes) {
    (void)ctx;
    memcpy(dst, host_src, nbytes);
    return TMX_OK;
}

static enum tmx_status cpu_buf_read(void *ctx, void *host_dst, const void *src, size_t nbytes) {
    (void)ctx;
    memcpy(host_dst, src, nbytes);
    return TMX_OK;
}

/* The host tensor is already in host memory: `dev` aliases it. Data must be aligned to its
 * element size, as safetensors data is. */
static enum tmx_status cpu_weight_import(void *ctx, const struct tmx_tensor *host,
                                         struct tmx_tensor *dev, char **err) {
    struct cpu_ctx *c = ctx;
    if (!cpu_dtype_ok(host->dtype))
        return c->host->err(err, TMX_ERR_UNSUPPORTED,
                            "kernels.cpu: weight dtype %s not supported (F32, BF16 or F16)",
                            cpu_dtype_name(host->dtype));
    *dev = *host;
    return TMX_OK;
}

/* The data belongs to the host tensor. */
static void cpu_weight_free(void *ctx, struct tmx_tensor *dev) {
    (void)ctx;
    dev->data = NULL;
}

/* Ops ran when called; what is left is the first failure since the last sync. */
static enum tmx_status cpu_sync(void *ctx) {
    struct cpu_ctx *c = ctx;
    enum tmx_status st = c->status;
    c->status = TMX_OK;
    return st;
}

/* --- the plugin ----------------------------------------------------------------------------- */

static const struct tmx_kernels_i cpu_ops = {
    .struct_size = sizeof(struct tmx_kernels_i),
    .init = cpu_init,
    .fini = cpu_fini,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .buf_write = cpu_buf_write,
    .buf_read = cpu_buf_read,
    .weight_import = cpu_weight_import,
    .weight_free = cpu_weight_free,
    .sync = cpu_sync,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .moe_route = cpu_moe_route,
    .moe_experts = cpu_moe_experts,
    .swiglu = cpu_swiglu,
    .add_gated = cpu_add_gated,
    .gather = cpu_gather,
    .moe_experts_partial = cpu_moe_experts_partial,
    .moe_combine = cpu_moe_combine,
    .argmax = cpu_argmax,
    .matmul_multi = cpu_matmul_multi,
    .topk = cpu_topk,
    .logit_edit = cpu_logit_edit,
    .add_rmsnorm = cpu_add_rmsnorm,
    .qk_norm_rope = cpu_qk_norm_rope,
    .host_threads = cpu_host_threads,
};

static const struct tmx_option cpu_options[] = {
    {"threads", TMX_OPT_INT, "0", "threads running ops, the caller's included (0: one per CPU)"},
    {0},
};

static const struct tmx_plugin cpu_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "cpu",
    .kind = TMX_PLUGIN_KERNELS,
    .caps = TMX_CAP_HOST_MEMORY,
    .version = "0.1.0",
    .opts = cpu_options,
    .ops = &cpu_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host;
    (void)err;
    return &cpu_plugin;
}
