/* kernels-example.c: the smallest kernel set, to copy when starting a new one.
 *
 * What it is: a kernel set (kind "kernels", ops table struct tmx_kernels_i in tmx/kernels.h)
 * that keeps buffers in host memory and implements the memory ops and a naive matmul, nothing
 * more. Its table is declared with the full ABI 1.0 struct_size and the other ops are left NULL,
 * so the core loads it, but tmx_kernels_open refuses it for the model graph with
 *     <path>: kernel set example lacks op 'embed', which the model graph calls
 * tests/unit/test_loader.c checks that refusal and calls the matmul directly. kernels/cpu is
 * the complete set to read next.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so. In
 * your own CMake project, tmx_add_plugin(KIND kernels NAME example SOURCES kernels-example.c);
 * by hand:
 *     cc -O2 -shared -fPIC -fvisibility=hidden -I core/include \
 *        -o libtmx-kernels-example.so tests/plugins/kernels-example.c
 *
 * Load: put the .so in a folder named by TMX_PLUGIN_PATH or the config's plugin_dir, and pick
 * it with TMX_KERNELS=example (or "kernels": "example" in the config file).
 *
 * What it shows: the one exported symbol and its const descriptor; the host table kept in ctx
 * (plugins link nothing of the core); an op that returns void recording its first failure for
 * the next sync; weight_import aliasing host memory instead of copying it. */
#include <stdlib.h>
#include <string.h>

#include "tmx/plugin.h"

struct example {
    const struct tmx_host *host;
    enum tmx_status status; /* first failure of an op, returned by sync */
};

static enum tmx_status example_init(const struct tmx_host *host, const struct tmx_opts *opts,
                                    void **ctx, char **err) {
    (void)opts;
    struct example *e = calloc(1, sizeof *e);
    if (!e) return host->err(err, TMX_ERR_NOMEM, "kernels example: out of memory");
    e->host = host;
    *ctx = e;
    return TMX_OK;
}

static void example_fini(void *ctx) { free(ctx); }

static enum tmx_status example_buf_alloc(void *ctx, size_t nbytes, void **buf) {
    (void)ctx;
    *buf = calloc(1, nbytes ? nbytes : 1);
    return *buf ? TMX_OK : TMX_ERR_NOMEM;
}

static void example_buf_free(void *ctx, void *buf) {
    (void)ctx;
    free(buf);
}

static enum tmx_status example_buf_write(void *ctx, void *dst, const void *src, size_t nbytes) {
    (void)ctx;
    memcpy(dst, src, nbytes);
    return TMX_OK;
}

static enum tmx_status example_buf_read(void *ctx, void *dst, const void *src, size_t nbytes) {
    (void)ctx;
    memcpy(dst, src, nbytes);
    return TMX_OK;
}

/* Host memory is this set's device memory: the weight is used where it lies. */
static enum tmx_status example_weight_import(void *ctx, const struct tmx_tensor *host,
                                             struct tmx_tensor *dev, char **err) {
    (void)ctx, (void)err;
    *dev = *host;
    return TMX_OK;
}

/* An imported weight aliases the host tensor, so there is nothing to release. */
static void example_weight_free(void *ctx, struct tmx_tensor *dev) { (void)ctx, (void)dev; }

static enum tmx_status example_sync(void *ctx) { return ((struct example *)ctx)->status; }

static float weight_at(const struct tmx_tensor *w, int64_t i) {
    switch (w->dtype) {
    case TMX_DTYPE_BF16: return tmx_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case TMX_DTYPE_F16: return tmx_f16_to_f32(((const uint16_t *)w->data)[i]);
    default: return ((const float *)w->data)[i];
    }
}

/* y[n][m] = x[n][k] . w[m][k]^T, one dot product at a time. */
static void example_matmul(void *ctx, float *y, const float *x, const struct tmx_tensor *w,
                           int n) {
    struct example *e = ctx;
    if (w->ndim != 2 || (w->dtype != TMX_DTYPE_F32 && w->dtype != TMX_DTYPE_BF16 &&
                         w->dtype != TMX_DTYPE_F16)) {
        e->host->log(TMX_LOG_ERROR, "kernels example: matmul: weight must be 2-D F32/BF16/F16");
        if (e->status == TMX_OK) e->status = TMX_ERR_UNSUPPORTED;
        return;
    }
    const int64_t m = w->shape[0], k = w->shape[1];
    for (int i = 0; i < n; i++) {
        for (int64_t j = 0; j < m; j++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < k; c++) acc += x[i * k + c] * weight_at(w, j * k + c);
            y[i * m + j] = acc;
        }
    }
}

static const struct tmx_kernels_i example_ops = {
    .struct_size = sizeof(struct tmx_kernels_i),
    .init = example_init,
    .fini = example_fini,
    .buf_alloc = example_buf_alloc,
    .buf_free = example_buf_free,
    .buf_write = example_buf_write,
    .buf_read = example_buf_read,
    .weight_import = example_weight_import,
    .weight_free = example_weight_free,
    .sync = example_sync,
    .matmul = example_matmul,
};

static const struct tmx_plugin example_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "example",
    .kind = TMX_PLUGIN_KERNELS,
    .version = "1.0.0",
    .ops = &example_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *host,
                                                            char **err) {
    (void)host, (void)err;
    return &example_plugin;
}
