/* rows.cu: the row-wise ops: embed, rmsnorm, swiglu, add_gated, gather.
 *
 * Each is memory bound and cheap per element: a thread per element (embed, swiglu, add_gated,
 * gather) or a block per row (rmsnorm, which needs the row's sum of squares). */
#include "cuda-dev.cuh"

static int check_rows(struct cu_ctx *c, const char *op, int64_t rows, int64_t d) {
    if (rows >= 0 && d > 0) return 1;
    cu_fail(c, TMX_ERR_INVALID, "%s: %lld rows of width %lld", op, (long long)rows, (long long)d);
    return 0;
}

/* --- embed ---------------------------------------------------------------------------------- */

template <int DT>
__global__ void embed_kernel(float *out, const void *table, const int32_t *ids, int64_t vocab,
                             int64_t d, int64_t count, int *dev_err) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    int64_t t = i / d, col = i % d;
    int32_t id = ids[t];
    if (id < 0 || id >= vocab) {
        flag(dev_err, CU_DEV_EMBED_ID);
        out[i] = 0.0f;
        return;
    }
    out[i] = load_w<DT>(table, id * d + col);
}

extern "C" void cu_embed(void *ctx, float *out, const struct tmx_tensor *table, const int32_t *ids,
                         int n) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "embed") || !cu_check_weight(c, "embed", "table", table, 2, 0, 0) ||
        !check_rows(c, "embed", n, table->shape[1]) || n == 0)
        return;
    int64_t d = table->shape[1], count = (int64_t)n * d;
    CU_DISPATCH_W(table->dtype, (embed_kernel<DT><<<blocks_for(count, 256), 256, 0, c->stream>>>(
                                    out, table->data, ids, table->shape[0], d, count,
                                    c->dev_err)));
    cu_check_launch(c, "embed");
}

/* --- rmsnorm -------------------------------------------------------------------------------- */

/* One block per row. The row is read twice (sum of squares, then scale): it is in L1/L2 by
 * then, and out may alias x since each element is read before it is written by its thread. */
template <int DT>
__global__ void rmsnorm_kernel(float *out, const float *x, const void *w, int d, float eps) {
    __shared__ float red[32];
    const float *xr = x + (int64_t)blockIdx.x * d;
    float *yr = out + (int64_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        yr[i] = xr[i] * inv * (w ? load_w<DT>(w, i) : 1.0f);
}

extern "C" void cu_rmsnorm(void *ctx, float *out, const float *x, const struct tmx_tensor *w,
                           int rows, int d, float eps) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "rmsnorm") || !check_rows(c, "rmsnorm", rows, d) ||
        (w && !cu_check_weight(c, "rmsnorm", "weight", w, 1, d, 0)) || rows == 0)
        return;
    int threads = d >= 1024 ? 1024 : (d + 31) / 32 * 32;
    CU_DISPATCH_W(w ? w->dtype : TMX_DTYPE_F32,
                  (rmsnorm_kernel<DT><<<rows, threads, 0, c->stream>>>(out, x, w ? w->data : NULL,
                                                                       d, eps)));
    cu_check_launch(c, "rmsnorm");
}

/* --- swiglu --------------------------------------------------------------------------------- */

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t count) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

extern "C" void cu_swiglu(void *ctx, float *out, const float *gate, const float *up,
                          int64_t count) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "swiglu") || count <= 0) return;
    swiglu_kernel<<<blocks_for(count, 256), 256, 0, c->stream>>>(out, gate, up, count);
    cu_check_launch(c, "swiglu");
}

/* --- add_gated ------------------------------------------------------------------------------ */

template <int DT>
__global__ void add_gated_kernel(float *h, const float *a, const void *g, int64_t d,
                                 int64_t count) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    h[i] += (g ? load_w<DT>(g, i % d) : 1.0f) * a[i];
}

extern "C" void cu_add_gated(void *ctx, float *h, const float *a, const struct tmx_tensor *g,
                             int rows, int d) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "add_gated") || !check_rows(c, "add_gated", rows, d) ||
        (g && !cu_check_weight(c, "add_gated", "gate", g, 1, d, 0)) || rows == 0)
        return;
    int64_t count = (int64_t)rows * d;
    CU_DISPATCH_W(g ? g->dtype : TMX_DTYPE_F32,
                  (add_gated_kernel<DT><<<blocks_for(count, 256), 256, 0, c->stream>>>(
                      h, a, g ? g->data : NULL, d, count)));
    cu_check_launch(c, "add_gated");
}

/* --- gather --------------------------------------------------------------------------------- */

__global__ void gather_kernel(float *out, const float *x, const int32_t *rows, int64_t d,
                              int64_t count, int *dev_err) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    int32_t r = rows[i / d];
    if (r < 0) {
        flag(dev_err, CU_DEV_GATHER_ROW);
        out[i] = 0.0f;
        return;
    }
    out[i] = x[(int64_t)r * d + i % d];
}

extern "C" void cu_gather(void *ctx, float *out, const float *x, const int32_t *rows, int n,
                          int d) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "gather") || !check_rows(c, "gather", n, d) || n == 0) return;
    int64_t count = (int64_t)n * d;
    gather_kernel<<<blocks_for(count, 256), 256, 0, c->stream>>>(out, x, rows, d, count,
                                                                  c->dev_err);
    cu_check_launch(c, "gather");
}
