/* rows.cu: the row-wise ops: embed, rmsnorm, swiglu, add_gated, gather, argmax.
 *
 * Each is memory bound and cheap per element: a thread per element (embed, swiglu, add_gated,
 * gather), a block per row (rmsnorm, which needs the row's sum of squares) or blocks per piece
 * of a row (argmax, whose rows are a vocabulary long). */
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

/* --- argmax --------------------------------------------------------------------------------- */

/* A value and its column as one integer whose order is argmax's: the larger value, then the
 * lower column. The float's bits are mapped to an unsigned order (negative values reversed);
 * NaN is 0, below every number. */
__device__ __forceinline__ unsigned long long argmax_key(float v, int32_t col) {
    if (isnan(v)) return 0;
    uint32_t u = __float_as_uint(v);
    u ^= (u >> 31) ? 0xffffffffu : 0x80000000u;
    return (unsigned long long)u << 32 | (0xffffffffu - (uint32_t)col);
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, k, o);
        k = other > k ? other : k;
    }
    return k;
}

/* Columns a block of the first pass covers: enough that its 256 threads read 16 values each. */
#define ARGMAX_THREADS 256
#define ARGMAX_PIECE (ARGMAX_THREADS * 16)

/* First pass, grid (pieces, rows): part[row][piece] = the largest key of the piece. */
__global__ void argmax_piece_kernel(unsigned long long *part, const float *x, int d, int ld) {
    __shared__ unsigned long long red[ARGMAX_THREADS / 32];
    const float *xr = x + (int64_t)blockIdx.y * ld;
    const int end = min(d, (int)(blockIdx.x + 1) * ARGMAX_PIECE);
    unsigned long long best = 0;
    for (int i = blockIdx.x * ARGMAX_PIECE + threadIdx.x; i < end; i += ARGMAX_THREADS) {
        unsigned long long k = argmax_key(xr[i], i);
        best = k > best ? k : best;
    }
    best = warp_max_key(best);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        best = threadIdx.x < ARGMAX_THREADS / 32 ? red[threadIdx.x] : 0;
        best = warp_max_key(best);
        if (threadIdx.x == 0) part[(int64_t)blockIdx.y * gridDim.x + blockIdx.x] = best;
    }
}

/* Second pass, a warp per row over its pieces' keys. */
__global__ void argmax_row_kernel(int32_t *ids, float *best, const unsigned long long *part,
                                  int pieces, const float *x, int ld) {
    const unsigned long long *pr = part + (int64_t)blockIdx.x * pieces;
    unsigned long long k = 0;
    for (int i = threadIdx.x; i < pieces; i += 32) k = pr[i] > k ? pr[i] : k;
    k = warp_max_key(k);
    if (threadIdx.x == 0) {
        const int32_t col = k ? (int32_t)(0xffffffffu - (uint32_t)k) : 0;
        ids[blockIdx.x] = col;
        best[blockIdx.x] = x[(int64_t)blockIdx.x * ld + col];
    }
}

extern "C" void cu_argmax(void *ctx, int32_t *ids, float *best, const float *x, int rows, int d,
                          int ld) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "argmax") || !check_rows(c, "argmax", rows, d) || rows == 0) return;
    if (ld < d) {
        cu_fail(c, TMX_ERR_INVALID, "argmax: row stride %d below the width %d", ld, d);
        return;
    }
    const int pieces = (d + ARGMAX_PIECE - 1) / ARGMAX_PIECE;
    unsigned long long *part = (unsigned long long *)cu_scratch(
        c, (size_t)(rows < 65535 ? rows : 65535) * pieces * sizeof *part, "argmax");
    if (!part) return;
    for (int r0 = 0; r0 < rows; r0 += 65535) { /* the most a grid's y may hold */
        const int nr = rows - r0 < 65535 ? rows - r0 : 65535;
        const float *xr = x + (int64_t)r0 * ld;
        argmax_piece_kernel<<<dim3(pieces, nr), ARGMAX_THREADS, 0, c->stream>>>(part, xr, d, ld);
        if (!cu_check_launch(c, "argmax")) return;
        argmax_row_kernel<<<nr, 32, 0, c->stream>>>(ids + r0, best + r0, part, pieces, xr, ld);
        if (!cu_check_launch(c, "argmax")) return;
    }
}
