/* rows.cu: the row-wise ops: embed, rmsnorm, swiglu, add_gated, add_rmsnorm, gather, argmax,
 * topk, logit_edit.
 *
 * Each is memory bound and cheap per element: a thread per element (embed, swiglu, add_gated,
 * gather), a block per row (rmsnorm, which needs the row's sum of squares; logit_edit, whose
 * number of edits only the device knows) or blocks per piece of a row (argmax and topk, whose
 * rows are a vocabulary long). */
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
    tmx_pdl_enter();
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
    CU_DISPATCH_W(table->dtype,
                  (cu_launch(c, embed_kernel<DT>, blocks_for(count, 256), 256, 0, out, table->data,
                             ids, table->shape[0], d, count, c->dev_err)));
    cu_check_launch(c, "embed");
}

/* --- rmsnorm -------------------------------------------------------------------------------- */

/* One block per row. */
template <int DT>
__global__ void rmsnorm_kernel(float *out, const float *x, const void *w, int d, float eps) {
    tmx_pdl_enter();
    __shared__ float red[32];
    rms_row<DT>(out + (int64_t)blockIdx.x * d, x + (int64_t)blockIdx.x * d, w, d, eps, red);
}

extern "C" void cu_rmsnorm(void *ctx, float *out, const float *x, const struct tmx_tensor *w,
                           int rows, int d, float eps) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "rmsnorm") || !check_rows(c, "rmsnorm", rows, d) ||
        (w && !cu_check_weight(c, "rmsnorm", "weight", w, 1, d, 0)) || rows == 0)
        return;
    CU_DISPATCH_W(w ? w->dtype : TMX_DTYPE_F32,
                  (cu_launch(c, rmsnorm_kernel<DT>, rows, rms_threads(d), 0, out, x,
                             w ? w->data : NULL, d, eps)));
    cu_check_launch(c, "rmsnorm");
}

/* --- swiglu --------------------------------------------------------------------------------- */

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t count) {
    tmx_pdl_enter();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

extern "C" void cu_swiglu(void *ctx, float *out, const float *gate, const float *up,
                          int64_t count) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "swiglu") || count <= 0) return;
    cu_launch(c, swiglu_kernel, blocks_for(count, 256), 256, 0, out, gate, up, count);
    cu_check_launch(c, "swiglu");
}

/* --- add_gated ------------------------------------------------------------------------------ */

/* h + g * a in one rounding, as add_gated and add_rmsnorm both compute it. */
template <int DT>
__device__ __forceinline__ float gated(float h, float a, const void *g, int64_t i) {
    return __fmaf_rn(g ? load_w<DT>(g, i) : 1.0f, a, h);
}

template <int DT>
__global__ void add_gated_kernel(float *h, const float *a, const void *g, int64_t d,
                                 int64_t count) {
    tmx_pdl_enter();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    h[i] = gated<DT>(h[i], a[i], g, i % d);
}

/* One block per row: the row's update, then its norm, each thread on its own elements (so no
 * barrier between the two), as add_gated_kernel and rmsnorm_kernel compute them. */
template <int DT>
__global__ void add_rmsnorm_kernel(float *out, float *h, const float *a, const void *g,
                                   const void *w, int d, float eps) {
    tmx_pdl_enter();
    __shared__ float red[32];
    float *hr = h + (int64_t)blockIdx.x * d;
    const float *ar = a + (int64_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) hr[i] = gated<DT>(hr[i], ar[i], g, i);
    rms_row<DT>(out + (int64_t)blockIdx.x * d, hr, w, d, eps, red);
}

extern "C" void cu_add_gated(void *ctx, float *h, const float *a, const struct tmx_tensor *g,
                             int rows, int d) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "add_gated") || !check_rows(c, "add_gated", rows, d) ||
        (g && !cu_check_weight(c, "add_gated", "gate", g, 1, d, 0)) || rows == 0)
        return;
    int64_t count = (int64_t)rows * d;
    CU_DISPATCH_W(g ? g->dtype : TMX_DTYPE_F32,
                  (cu_launch(c, add_gated_kernel<DT>, blocks_for(count, 256), 256, 0, h, a,
                             g ? g->data : NULL, d, count)));
    cu_check_launch(c, "add_gated");
}

extern "C" void cu_add_rmsnorm(void *ctx, float *out, float *h, const float *a,
                               const struct tmx_tensor *g, const struct tmx_tensor *w, int rows,
                               int d, float eps) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (g && w && g->dtype != w->dtype) { /* one kernel reads one weight dtype: two launches */
        cu_add_gated(ctx, h, a, g, rows, d);
        cu_rmsnorm(ctx, out, h, w, rows, d, eps);
        return;
    }
    if (!cu_enter(c, "add_rmsnorm") || !check_rows(c, "add_rmsnorm", rows, d) ||
        (g && !cu_check_weight(c, "add_rmsnorm", "gate", g, 1, d, 0)) ||
        (w && !cu_check_weight(c, "add_rmsnorm", "weight", w, 1, d, 0)) || rows == 0)
        return;
    CU_DISPATCH_W(g ? g->dtype : w ? w->dtype : TMX_DTYPE_F32,
                  (cu_launch(c, add_rmsnorm_kernel<DT>, rows, rms_threads(d), 0, out, h, a,
                             g ? g->data : NULL, w ? w->data : NULL, d, eps)));
    cu_check_launch(c, "add_rmsnorm");
}

/* --- gather --------------------------------------------------------------------------------- */

__global__ void gather_kernel(float *out, const float *x, const int32_t *rows, int64_t d,
                              int64_t count, int *dev_err) {
    tmx_pdl_enter();
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
    cu_launch(c, gather_kernel, blocks_for(count, 256), 256, 0, out, x, rows, d, count, c->dev_err);
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
    tmx_pdl_enter();
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
    tmx_pdl_enter();
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
        cu_launch(c, argmax_piece_kernel, dim3(pieces, nr), ARGMAX_THREADS, 0, part, xr, d, ld);
        if (!cu_check_launch(c, "argmax")) return;
        cu_launch(c, argmax_row_kernel, nr, 32, 0, ids + r0, best + r0, part, pieces, xr, ld);
        if (!cu_check_launch(c, "argmax")) return;
    }
}

/* --- topk ----------------------------------------------------------------------------------- */

/* A row's candidates are keys: argmax's key of y = x / t (the larger y, then the lower column,
 * is the larger key), 0 for a column that is none. A block holds up to TOPK_N keys, 4 a thread
 * in registers (up to TOPK_THREADS threads, fewer for fewer keys: its barriers cost less):
 * first those of a piece of TOPK_N columns (a row of up to TOPK_WIDE_N, 8 a thread, is one
 * piece: muse-mini's 8,192 logits take one block and no merge; longer rows keep pieces of
 * TOPK_N, which their merges take faster than fewer, longer ones), then, level by level,
 * the first k of up to TOPK_N / k pieces (or groups), until one list a row is left. Of its keys a block keeps the k
 * largest, found by a radix select on their bytes from the top (a histogram a byte, until the
 * byte that holds the k-th largest holds no more than the rest of k), then sorts those k. */
#define TOPK_THREADS 1024
#define TOPK_N (4 * TOPK_THREADS)
#define TOPK_WIDE_N (8 * TOPK_THREADS)

/* What a list of keys stands for, over all the candidates of its piece or group: their number,
 * the first one's y and x, and the sums of exp(y - its y) and of exp(x - its x). */
struct topk_stat {
    double sum, sum1;
    float first, first_x;
    int count;
};

/* The block's shared memory. */
struct topk_smem {
    unsigned long long top[TMX_TOPK_MAX]; /* the k largest keys, then sorted */
    int hist[256];
    int digit, above, at, n_top;
    double red_sum[32], red_sum1[32];
    int red_count[32];
    unsigned long long red_key[32];
};

__device__ __forceinline__ float key_y(unsigned long long k) {
    const uint32_t u = (uint32_t)(k >> 32);
    return __uint_as_float(u & 0x80000000u ? u ^ 0x80000000u : ~u);
}

__device__ __forceinline__ int32_t key_col(unsigned long long k) {
    return (int32_t)(0xffffffffu - (uint32_t)k);
}

static __host__ __device__ int pow2_at_least(int n) {
    int p = 1;
    while (p < n) p *= 2;
    return p;
}

/* Threads of a block that holds `keys` keys, `per` a thread: at least 64 (sorting k <= 256). */
static int topk_threads(int keys, int per) {
    const int t = pow2_at_least((keys + per - 1) / per);
    return t < 64 ? 64 : t > TOPK_THREADS ? TOPK_THREADS : t;
}

/* keys[0..n) descending, n a power of two up to 4 * blockDim.x: a bitonic sort by the whole
 * block. Compare-exchanges of elements 128 or more apart go through shared memory between
 * barriers; the closer ones in registers, a thread holding 4 consecutive keys and a warp 128,
 * through shuffles (the partner of element e at distance s is e ^ s: the same slot of lane
 * lane ^ s / 4). Element e keeps the larger of its pair when it is the pair's lower one in a
 * run that descends, where e's `size` bit is 0. */
__device__ void sort_keys_desc(unsigned long long *keys, int n) {
    const int base = 4 * threadIdx.x;
    const bool warp_in = (base & ~127) < n; /* whole warps shuffle; lanes past n do not store */
    for (int size = 2; size <= n; size *= 2) {
        int stride = size / 2;
        for (; stride >= 128; stride /= 2) {
            __syncthreads();
            for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const unsigned long long a = keys[lo], b = keys[hi];
                if ((a < b) == ((lo & size) == 0)) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
        }
        __syncthreads();
        if (warp_in) {
            unsigned long long v[4];
            for (int j = 0; j < 4; j++) v[j] = base + j < n ? keys[base + j] : 0;
            for (; stride >= 4; stride /= 2)
                for (int j = 0; j < 4; j++) {
                    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v[j], stride / 4);
                    const int e = base + j;
                    const bool keep_max = ((e & stride) == 0) == ((e & size) == 0);
                    v[j] = keep_max == (o > v[j]) ? o : v[j];
                }
            for (; stride >= 1; stride /= 2)
                for (int j = 0; j < 4; j++)
                    if ((j & stride) == 0) {
                        const unsigned long long a = v[j], b = v[j | stride];
                        if ((a < b) == (((base + j) & size) == 0)) {
                            v[j] = b;
                            v[j | stride] = a;
                        }
                    }
            for (int j = 0; j < 4; j++)
                if (base + j < n) keys[base + j] = v[j];
        }
    }
    __syncthreads();
}

/* The k largest nonzero keys of v (PER a thread) into sm->top, sorted; their number (fewer
 * than k when fewer are nonzero) into sm->n_top. */
template <int PER>
__device__ void block_top(const unsigned long long (&v)[PER], int k, topk_smem *sm) {
    const int lane = threadIdx.x % 32;
    unsigned long long prefix = 0, mask = 0; /* the bytes of the k-th largest found so far */
    int want = k;                            /* of the keys under prefix, how many are kept */
    int nonzero = 0;
    for (int j = 0; j < PER; j++) nonzero += v[j] != 0;
    nonzero = block_sum(nonzero, sm->red_count);
    if (nonzero > k) {
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) sm->hist[i] = 0;
            __syncthreads();
            for (int j = 0; j < PER; j++) { /* one atomic a byte value a warp */
                const int b = v[j] && (v[j] & mask) == prefix ? (int)(v[j] >> shift & 255) : -1;
                const unsigned peers = __match_any_sync(0xffffffffu, b);
                if (b >= 0 && lane == __ffs(peers) - 1) atomicAdd(&sm->hist[b], __popc(peers));
            }
            __syncthreads();
            if (threadIdx.x < 32) { /* lane l: byte values 255 - 8l down to 248 - 8l */
                int c[8], mine = 0;
                for (int i = 0; i < 8; i++) mine += c[i] = sm->hist[255 - 8 * lane - i];
                int incl = mine;
                for (int o = 1; o < 32; o *= 2) {
                    const int t = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += t;
                }
                int above = incl - mine;
                if (above < want && want <= incl)
                    for (int i = 0; i < 8; i++) {
                        if (above + c[i] >= want) {
                            sm->digit = 255 - 8 * lane - i;
                            sm->above = above;
                            sm->at = c[i];
                            break;
                        }
                        above += c[i];
                    }
            }
            __syncthreads();
            want -= sm->above;
            prefix |= (unsigned long long)sm->digit << shift;
            mask |= 255ull << shift;
            if (sm->at == want) break; /* every key under prefix is kept */
        }
    }
    if (threadIdx.x == 0) sm->n_top = 0;
    __syncthreads();
    for (int j = 0; j < PER; j++) /* kept: under prefix or above it, in the bytes decided */
        if (v[j] && (v[j] & mask) >= prefix) sm->top[atomicAdd(&sm->n_top, 1)] = v[j];
    __syncthreads();
    const int n = sm->n_top, np = pow2_at_least(n);
    for (int i = n + threadIdx.x; i < np; i += blockDim.x) sm->top[i] = 0;
    sort_keys_desc(sm->top, np);
}

/* The block's list: sm->top and its stat, into the next level's lists, or, when it is the
 * row's last (one block a row), into the op's outputs (xr: the row's logits). */
__device__ void topk_emit(unsigned long long *out, topk_stat *st_out, float *xs, int32_t *ids,
                          double *stats, const float *xr, const topk_smem *sm, int k,
                          topk_stat st) {
    const int row = blockIdx.y, n = sm->n_top;
    if (gridDim.x == 1) {
        for (int i = threadIdx.x; i < k; i += blockDim.x) {
            const unsigned long long key = i < n ? sm->top[i] : 0;
            xs[(int64_t)row * k + i] = key ? xr[key_col(key)] : -INFINITY;
            ids[(int64_t)row * k + i] = key ? key_col(key) : -1;
        }
        if (threadIdx.x == 0) {
            stats[3 * (int64_t)row] = st.count ? st.sum : 0.0;
            stats[3 * (int64_t)row + 1] = st.count;
            stats[3 * (int64_t)row + 2] = st.count ? st.sum1 : 0.0;
        }
        return;
    }
    const int64_t list = (int64_t)row * gridDim.x + blockIdx.x;
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[list * k + i] = i < n ? sm->top[i] : 0;
    if (threadIdx.x == 0) st_out[list] = st;
}

/* First level, grid (pieces, rows): pieces of PER keys a thread. */
template <int PER>
__global__ void __launch_bounds__(TOPK_THREADS)
topk_piece_kernel(unsigned long long *out, topk_stat *st_out, float *xs, int32_t *ids,
                  double *stats, const float *x, const float *temps, int d, int ld, int k) {
    tmx_pdl_enter();
    __shared__ topk_smem sm;
    const float *xr = x + (int64_t)blockIdx.y * ld;
    const float t = temps[blockIdx.y];
    const int base = blockIdx.x * PER * blockDim.x;
    unsigned long long v[PER];
    float xv[PER];
    for (int j = 0; j < PER; j++) {
        const int col = base + j * blockDim.x + threadIdx.x;
        xv[j] = col < d ? xr[col] : NAN;
        v[j] = isnan(xv[j]) || xv[j] == -INFINITY ? 0 : argmax_key(xv[j] / t, col);
    }
    block_top(v, k, &sm);
    const unsigned long long top = sm.top[0];
    const float first = sm.n_top ? key_y(top) : -INFINITY;
    const float first_x = sm.n_top ? xr[key_col(top)] : -INFINITY;
    double sum = 0.0, sum1 = 0.0;
    int count = 0;
    for (int j = 0; j < PER; j++)
        if (v[j]) {
            sum += exp((double)key_y(v[j]) - first);
            sum1 += exp((double)xv[j] - first_x);
            count++;
        }
    sum = block_sum(sum, sm.red_sum);
    sum1 = block_sum(sum1, sm.red_sum1);
    count = block_sum(count, sm.red_count);
    topk_emit(out, st_out, xs, ids, stats, xr, &sm, k,
              topk_stat{sum, sum1, first, first_x, count});
}

/* Next levels, grid (groups, rows): group g merges lists [g * per, (g + 1) * per) of the
 * n_in lists of k keys a row. */
__global__ void __launch_bounds__(TOPK_THREADS)
topk_merge_kernel(unsigned long long *out, topk_stat *st_out, float *xs, int32_t *ids,
                  double *stats, const float *x, int ld, const unsigned long long *in,
                  const topk_stat *st_in, int n_in, int per, int k) {
    tmx_pdl_enter();
    __shared__ topk_smem sm;
    const int l0 = blockIdx.x * per, nl = min(per, n_in - l0);
    const unsigned long long *src = in + ((int64_t)blockIdx.y * n_in + l0) * k;
    const topk_stat *st = st_in + (int64_t)blockIdx.y * n_in + l0;
    unsigned long long v[4];
    for (int j = 0; j < 4; j++) {
        const int i = j * blockDim.x + threadIdx.x;
        v[j] = i < nl * k ? src[i] : 0;
    }
    /* the group's first: the list with the largest first y, the lower list (column) on a tie */
    unsigned long long best = 0;
    for (int i = threadIdx.x; i < nl; i += blockDim.x)
        if (st[i].count) {
            const unsigned long long key = argmax_key(st[i].first, i);
            best = key > best ? key : best;
        }
    best = warp_max_key(best);
    if (threadIdx.x % 32 == 0) sm.red_key[threadIdx.x / 32] = best;
    __syncthreads();
    best = threadIdx.x % 32 < blockDim.x / 32 ? sm.red_key[threadIdx.x % 32] : 0;
    best = warp_max_key(best);
    const float first = best ? st[key_col(best)].first : -INFINITY;
    const float first_x = best ? st[key_col(best)].first_x : -INFINITY;
    double sum = 0.0, sum1 = 0.0;
    int count = 0;
    for (int i = threadIdx.x; i < nl; i += blockDim.x)
        if (st[i].count) {
            sum += st[i].sum * exp((double)st[i].first - first);
            sum1 += st[i].sum1 * exp((double)st[i].first_x - first_x);
            count += st[i].count;
        }
    sum = block_sum(sum, sm.red_sum);
    sum1 = block_sum(sum1, sm.red_sum1);
    count = block_sum(count, sm.red_count);
    block_top(v, k, &sm);
    topk_emit(out, st_out, xs, ids, stats, x + (int64_t)blockIdx.y * ld, &sm, k,
              topk_stat{sum, sum1, first, first_x, count});
}

extern "C" void cu_topk(void *ctx, float *xs, int32_t *ids, double *stats, const float *x,
                        const float *temps, int rows, int d, int ld, int k) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "topk") || !check_rows(c, "topk", rows, d) || rows == 0) return;
    if (ld < d || k < 1 || k > TMX_TOPK_MAX) {
        cu_fail(c, TMX_ERR_INVALID, "topk: row stride %d, width %d, k %d (at most %d)", ld, d,
                k, TMX_TOPK_MAX);
        return;
    }
    const int wide = d > TOPK_N && d <= TOPK_WIDE_N, piece = wide ? TOPK_WIDE_N : TOPK_N;
    const int pieces = (d + piece - 1) / piece, per = TOPK_N / k;
    const int groups = pieces > 1 ? (pieces + per - 1) / per : 0; /* lists after level 1 */
    const int chunk = rows < 65535 ? rows : 65535;             /* rows a grid's y holds */
    const size_t lists = (size_t)chunk * (pieces + groups);
    char *scratch = (char *)cu_scratch(
        c, lists * ((size_t)k * sizeof(unsigned long long) + sizeof(topk_stat)), "topk");
    if (!scratch) return;
    unsigned long long *keys[2] = {(unsigned long long *)scratch,
                                   (unsigned long long *)scratch + (size_t)chunk * pieces * k};
    topk_stat *st[2] = {(topk_stat *)(keys[1] + (size_t)chunk * groups * k), NULL};
    st[1] = st[0] + (size_t)chunk * pieces;
    for (int r0 = 0; r0 < rows; r0 += chunk) {
        const int nr = rows - r0 < chunk ? rows - r0 : chunk;
        float *xo = xs + (int64_t)r0 * k;
        int32_t *ir = ids + (int64_t)r0 * k;
        double *sr = stats + 3 * (int64_t)r0;
        const float *xr = x + (int64_t)r0 * ld;
        const int threads = topk_threads(d < piece ? d : piece, wide ? 8 : 4);
        cu_launch(c, wide ? topk_piece_kernel<8> : topk_piece_kernel<4>, dim3(pieces, nr),
                  threads, 0, keys[0], st[0], xo, ir, sr, xr, temps + r0, d, ld, k);
        if (!cu_check_launch(c, "topk")) return;
        for (int n_in = pieces, at = 0; n_in > 1; n_in = (n_in + per - 1) / per, at ^= 1) {
            const int threads = topk_threads((n_in < per ? n_in : per) * k, 4);
            cu_launch(c, topk_merge_kernel, dim3((n_in + per - 1) / per, nr), threads, 0,
                      keys[at ^ 1], st[at ^ 1], xo, ir, sr, xr, ld, keys[at], st[at], n_in, per, k);
            if (!cu_check_launch(c, "topk")) return;
        }
    }
}

/* --- logit_edit ----------------------------------------------------------------------------- */

/* A block per row, a thread per edit: a row has at most one edit of an id, so no two threads
 * write one logit. The counts come from the device, so that a recorded graph replays any. */
__global__ void logit_edit_kernel(float *x, const tmx_logit_edit *edits, const int32_t *starts,
                                  int ld, int lo, int d) {
    tmx_pdl_enter();
    float *xr = x + (int64_t)blockIdx.x * ld;
    for (int32_t i = starts[blockIdx.x] + threadIdx.x; i < starts[blockIdx.x + 1];
         i += blockDim.x) {
        const tmx_logit_edit e = edits[i];
        const int32_t col = e.id - lo;
        if (col >= 0 && col < d) xr[col] = tmx_logit_edit_apply(&e, xr[col]);
    }
}

extern "C" void cu_logit_edit(void *ctx, float *x, const struct tmx_logit_edit *edits,
                              const int32_t *starts, int rows, int ld, int lo, int d) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "logit_edit") || !check_rows(c, "logit_edit", rows, d) || rows == 0) return;
    if (ld < d) {
        cu_fail(c, TMX_ERR_INVALID, "logit_edit: row stride %d, width %d", ld, d);
        return;
    }
    cu_launch(c, logit_edit_kernel, rows, 256, 0, x, edits, starts, ld, lo, d);
    cu_check_launch(c, "logit_edit");
}
