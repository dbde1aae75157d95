/* moe.cu: the router (moe_route), the routed experts (moe_experts) and their tensor-parallel
 * halves (moe_experts_partial, moe_combine). */
#include <climits>

#include "cuda-dev.cuh"

/* --- moe_route ------------------------------------------------------------------------------ */

/* (key, id) of a candidate expert; id INT_MAX: none. */
struct pick {
    float v;
    int e;
};

/* a beats b: a larger key, or an equal key and a lower id. */
__device__ __forceinline__ bool beats(pick a, pick b) {
    return a.e != INT_MAX && (b.e == INT_MAX || a.v > b.v || (a.v == b.v && a.e < b.e));
}

/* One warp per token: scores into shared memory, then k passes that each pick the best
 * key s + bias not yet picked, ties to the lower id. */
template <int DT>
__global__ void route_kernel(int32_t *ids, float *weights, const float *logits, const void *bias,
                             int n_exp, int k, int softmax, int norm_topk, float scale) {
    tmx_pdl_enter();
    extern __shared__ float sh[];
    float *s = sh, *key = sh + n_exp;
    unsigned char *used = (unsigned char *)(key + n_exp);
    int t = blockIdx.x, lane = threadIdx.x;
    const float *lg = logits + (int64_t)t * n_exp;
    float mx = -INFINITY, sum = 0.0f;
    if (softmax) {
        for (int e = lane; e < n_exp; e += 32) mx = fmaxf(mx, lg[e]);
        mx = warp_max(mx);
    }
    for (int e = lane; e < n_exp; e += 32) {
        s[e] = softmax ? expf(lg[e] - mx) : 1.0f / (1.0f + expf(-lg[e]));
        sum += s[e];
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n_exp; e += 32) {
        if (softmax) s[e] /= sum;
        key[e] = bias ? s[e] + load_w<DT>(bias, e) : s[e];
        used[e] = 0;
    }
    __syncwarp();
    float picked = 0.0f;
    for (int q = 0; q < k; q++) {
        pick best = {0.0f, INT_MAX};
        for (int e = lane; e < n_exp; e += 32) {
            pick cand = {key[e], e};
            if (!used[e] && beats(cand, best)) best = cand;
        }
        for (int o = 16; o > 0; o >>= 1) {
            pick other = {__shfl_xor_sync(0xffffffffu, best.v, o),
                          __shfl_xor_sync(0xffffffffu, best.e, o)};
            if (beats(other, best)) best = other;
        }
        picked += s[best.e];
        if (lane == 0) {
            used[best.e] = 1;
            ids[(int64_t)t * k + q] = best.e;
            weights[(int64_t)t * k + q] = s[best.e];
        }
        __syncwarp();
    }
    float norm = norm_topk ? scale / picked : scale;
    for (int q = lane; q < k; q += 32) weights[(int64_t)t * k + q] *= norm;
}

extern "C" void cu_moe_route(void *ctx, int32_t *ids, float *weights, const float *logits,
                             const struct tmx_tensor *bias, int n, int n_exp, int k,
                             enum tmx_router_score score, int norm_topk, float scale) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "moe_route")) return;
    if (n < 0 || n_exp <= 0 || k <= 0 || k > n_exp || n_exp > 8192) {
        cu_fail(c, TMX_ERR_INVALID, "moe_route: n = %d, %d experts (at most 8192), top %d", n,
                n_exp, k);
        return;
    }
    if ((bias && !cu_check_weight(c, "moe_route", "bias", bias, 1, n_exp, 0)) || n == 0) return;
    size_t shmem = (size_t)n_exp * (2 * sizeof(float) + 1);
    CU_DISPATCH_W(bias ? bias->dtype : TMX_DTYPE_F32,
                  (cu_launch(c, route_kernel<DT>, n, 32, shmem, ids, weights, logits,
                             bias ? bias->data : NULL, n_exp, k, score == TMX_ROUTER_SOFTMAX,
                             norm_topk, scale)));
    cu_check_launch(c, "moe_route");
}

/* --- moe_experts ----------------------------------------------------------------------------
 * Three kernels over the n * k (token, slot) pairs, each pair's expert read from ids on the
 * device: gate and up with silu into hid, down with the post norm and the routing weight into
 * y, then each token's k rows of y summed in slot order (no atomics: the result does not depend
 * on scheduling). A pair whose expert belongs to another rank is skipped. Expert weight
 * addresses travel by value in the launch, so the op can be captured into a graph. */

struct expert_ptrs {
    const void *gate[CU_MAX_EXPERTS], *up[CU_MAX_EXPERTS], *down[CU_MAX_EXPERTS];
};

struct experts_args {
    const float *z;       /* [n][latent] */
    const int32_t *ids;   /* [n][k] */
    const float *weights; /* [n][k] */
    const void *post;     /* [latent] or NULL */
    int post_dt;
    float *hid;           /* [n * k][inter] scratch */
    float *y;             /* [n * k][latent] scratch */
    float *out;           /* [n][latent] */
    int k, expert0, n_experts, latent, inter;
    float eps;
    int raw; /* moe_experts_partial: y = down_e . hid unnormalized, unweighted, zeros for pairs
              * of other ranks' experts; y is then the op's output */
};

/* Local expert of pair p, or -1 when it is another rank's. */
__device__ __forceinline__ int local_expert(const struct experts_args &a, int64_t p) {
    int e = a.ids[p] - a.expert0;
    return e >= 0 && e < a.n_experts ? e : -1;
}

/* hid[p][i] = silu(gate_e[i] . z) * (up_e[i] . z): a warp per row i, blockIdx.x = pair p. */
template <int DT>
__global__ void __launch_bounds__(256)
experts_up_kernel(struct expert_ptrs w, struct experts_args a) {
    tmx_pdl_enter();
    int64_t p = blockIdx.x;
    int i = blockIdx.y * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    int e = local_expert(a, p);
    if (e < 0 || i >= a.inter) return;
    const float *z = a.z + p / a.k * a.latent;
    int64_t row = (int64_t)i * a.latent;
    float g = 0.0f, u = 0.0f;
    for (int d = lane; d < a.latent; d += 32) {
        g += load_w<DT>(w.gate[e], row + d) * z[d];
        u += load_w<DT>(w.up[e], row + d) * z[d];
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) a.hid[p * a.inter + i] = g / (1.0f + expf(-g)) * u;
}

__device__ __forceinline__ float load_any(const void *p, int dt, int64_t i) {
    if (dt == TMX_DTYPE_BF16) return load_w<TMX_DTYPE_BF16>(p, i);
    if (dt == TMX_DTYPE_F16) return load_w<TMX_DTYPE_F16>(p, i);
    return load_w<TMX_DTYPE_F32>(p, i);
}

/* y[p] = weight_p * RMSNorm_post(down_e . hid[p]): a block per pair, a warp per output row,
 * the row kept in shared memory [latent] for the norm. 32 warps: a decode step has a block
 * for each of its few pairs, and each warp's rows are a chain of dependent sums. */
#define DOWN_THREADS 1024
template <int DT>
__global__ void __launch_bounds__(DOWN_THREADS)
experts_down_kernel(struct expert_ptrs w, struct experts_args a) {
    tmx_pdl_enter();
    extern __shared__ float yrow[];
    __shared__ float red[32];
    int64_t p = blockIdx.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int e = local_expert(a, p);
    if (e < 0) {
        if (a.raw)
            for (int d = threadIdx.x; d < a.latent; d += blockDim.x) a.y[p * a.latent + d] = 0.0f;
        return;
    }
    const float *h = a.hid + p * a.inter;
    for (int d = warp; d < a.latent; d += DOWN_THREADS / 32) {
        int64_t row = (int64_t)d * a.inter;
        float acc = 0.0f;
        for (int i = lane; i < a.inter; i += 32) acc += load_w<DT>(w.down[e], row + i) * h[i];
        acc = warp_sum(acc);
        if (lane == 0) yrow[d] = acc;
    }
    __syncthreads();
    if (a.raw) {
        for (int d = threadIdx.x; d < a.latent; d += blockDim.x) a.y[p * a.latent + d] = yrow[d];
        return;
    }
    float ss = 0.0f;
    if (a.post)
        for (int d = threadIdx.x; d < a.latent; d += blockDim.x) ss += yrow[d] * yrow[d];
    ss = block_sum(ss, red);
    float scale = a.weights[p] * (a.post ? rsqrtf(ss / (float)a.latent + a.eps) : 1.0f);
    for (int d = threadIdx.x; d < a.latent; d += blockDim.x)
        a.y[p * a.latent + d] = yrow[d] * scale * (a.post ? load_any(a.post, a.post_dt, d) : 1.0f);
}

/* out[t][d] = sum over slots j of y[t * k + j][d], in j order. */
__global__ void experts_sum_kernel(struct experts_args a, int64_t count) {
    tmx_pdl_enter();
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= count) return;
    int64_t t = idx / a.latent, d = idx % a.latent;
    float s = 0.0f;
    for (int j = 0; j < a.k; j++) {
        int64_t p = t * a.k + j;
        if (local_expert(a, p) >= 0) s += a.y[p * a.latent + d];
    }
    a.out[idx] = s;
}

/* Every expert's three tensors: one dtype, the layer's shapes. */
static int check_experts(struct cu_ctx *c, const struct tmx_moe_weights *w, struct expert_ptrs *p) {
    if (w->n_experts <= 0 || w->n_experts > CU_MAX_EXPERTS || w->latent <= 0 || w->inter <= 0 ||
        !w->gate || !w->up || !w->down) {
        cu_fail(c, TMX_ERR_INVALID, "moe_experts: %d experts (at most %d), latent %d, inter %d",
                w->n_experts, CU_MAX_EXPERTS, w->latent, w->inter);
        return 0;
    }
    if (w->post_norm && !cu_check_weight(c, "moe_experts", "post_norm", w->post_norm, 1,
                                         w->latent, 0))
        return 0;
    for (int e = 0; e < w->n_experts; e++) {
        if (!cu_check_weight(c, "moe_experts", "gate", &w->gate[e], 2, w->inter, w->latent) ||
            !cu_check_weight(c, "moe_experts", "up", &w->up[e], 2, w->inter, w->latent) ||
            !cu_check_weight(c, "moe_experts", "down", &w->down[e], 2, w->latent, w->inter))
            return 0;
        if (w->gate[e].dtype != w->gate[0].dtype || w->up[e].dtype != w->gate[0].dtype ||
            w->down[e].dtype != w->gate[0].dtype) {
            cu_fail(c, TMX_ERR_UNSUPPORTED, "moe_experts: expert %d mixes weight dtypes", e);
            return 0;
        }
        p->gate[e] = w->gate[e].data;
        p->up[e] = w->up[e].data;
        p->down[e] = w->down[e].data;
    }
    return 1;
}

/* gate/up and down for every pair into a.y (moe_experts: weighted and normed rows, then
 * summed per token; moe_experts_partial: the raw rows are the output). */
static void experts_run(struct cu_ctx *c, const char *op, const int32_t *ids, int n, int k,
                        const struct tmx_moe_weights *w, struct experts_args *a, float **y) {
    struct expert_ptrs ptrs = {};
    if (n < 0 || k <= 0) {
        cu_fail(c, TMX_ERR_INVALID, "%s: n = %d, k = %d", op, n, k);
        return;
    }
    if (!check_experts(c, w, &ptrs) || n == 0) return;
    int64_t pairs = (int64_t)n * k;
    size_t shmem = (size_t)w->latent * sizeof(float);
    if (shmem > 48 * 1024) {
        cu_fail(c, TMX_ERR_UNSUPPORTED, "%s: latent %d (at most 12288)", op, w->latent);
        return;
    }
    /* [pairs][inter] hid, and for moe_experts [pairs][latent] y */
    size_t floats = (size_t)pairs * (w->inter + (*y ? 0 : w->latent));
    float *hid = (float *)cu_scratch(c, floats * sizeof(float), op);
    if (!hid) return;
    if (!*y) *y = hid + pairs * w->inter;
    a->ids = ids;
    a->hid = hid;
    a->y = *y;
    a->k = k;
    a->expert0 = w->expert0;
    a->n_experts = w->n_experts;
    a->latent = w->latent;
    a->inter = w->inter;
    a->eps = w->eps;
    dim3 up_grid((unsigned)pairs, (unsigned)((w->inter + 7) / 8));
    CU_DISPATCH_W(w->gate[0].dtype,
                  (cu_launch(c, experts_up_kernel<DT>, up_grid, 256, 0, ptrs, *a),
                   cu_launch(c, experts_down_kernel<DT>, (unsigned)pairs, DOWN_THREADS, shmem,
                             ptrs, *a)));
}

extern "C" void cu_moe_experts(void *ctx, float *out, const float *z, const int32_t *ids,
                               const float *weights, int n, int k,
                               const struct tmx_moe_weights *w) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "moe_experts")) return;
    struct experts_args a = {};
    a.z = z;
    a.weights = weights;
    a.post = w->post_norm ? w->post_norm->data : NULL;
    a.post_dt = w->post_norm ? (int)w->post_norm->dtype : 0;
    a.out = out;
    float *y = NULL;
    experts_run(c, "moe_experts", ids, n, k, w, &a, &y);
    if (!y) return;
    int64_t count = (int64_t)n * w->latent;
    cu_launch(c, experts_sum_kernel, blocks_for(count, 256), 256, 0, a, count);
    cu_check_launch(c, "moe_experts");
}

extern "C" void cu_moe_experts_partial(void *ctx, float *ye, const float *z, const int32_t *ids,
                                       int n, int k, const struct tmx_moe_weights *w) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "moe_experts_partial")) return;
    struct experts_args a = {};
    a.z = z;
    a.raw = 1;
    experts_run(c, "moe_experts_partial", ids, n, k, w, &a, &ye);
    cu_check_launch(c, "moe_experts_partial");
}

/* --- moe_combine ----------------------------------------------------------------------------
 * The all-reduced pair rows normed, weighted and summed per token in j order, rounding as the
 * CPU set's combine does: 1/rms per pair first (a block each, the sum of squares in double),
 * then every output element's k terms. */

/* inv[p] = 1 / sqrt(mean(ye[p]^2) + eps). */
__global__ void __launch_bounds__(256)
combine_rms_kernel(const float *ye, int latent, float eps, float *inv) {
    tmx_pdl_enter();
    __shared__ double red[32];
    int64_t p = blockIdx.x;
    const float *y = ye + p * latent;
    double ss = 0.0;
    for (int d = threadIdx.x; d < latent; d += blockDim.x) ss += (double)y[d] * y[d];
    ss = block_sum(ss, red);
    if (threadIdx.x == 0) inv[p] = (float)(1.0 / sqrt(ss / latent + eps));
}

/* out[t][d] = sum over j of ye[t][j][d] (* inv[t][j] * post[d]) * weights[t][j]. */
__global__ void combine_kernel(float *out, const float *ye, const float *weights,
                               const float *inv, const void *post, int post_dt, int k,
                               int latent, int64_t count) {
    tmx_pdl_enter();
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= count) return;
    int64_t t = idx / latent, d = idx % latent;
    const float pd = post ? load_any(post, post_dt, d) : 1.0f;
    float s = 0.0f;
    for (int j = 0; j < k; j++) {
        int64_t p = t * k + j;
        const float y = ye[p * latent + d];
        s += post ? y * inv[p] * pd * weights[p] : y * weights[p];
    }
    out[idx] = s;
}

extern "C" void cu_moe_combine(void *ctx, float *out, const float *ye, const float *weights,
                               int n, int k, int latent, const struct tmx_tensor *post_norm,
                               float eps) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "moe_combine")) return;
    if (n < 0 || k <= 0 || latent <= 0) {
        cu_fail(c, TMX_ERR_INVALID, "moe_combine: n = %d, k = %d, latent = %d", n, k, latent);
        return;
    }
    if (post_norm && !cu_check_weight(c, "moe_combine", "post_norm", post_norm, 1, latent, 0))
        return;
    if (n == 0) return;
    int64_t pairs = (int64_t)n * k, count = (int64_t)n * latent;
    float *inv = NULL;
    if (post_norm) {
        if (!(inv = (float *)cu_scratch(c, (size_t)pairs * sizeof(float), "moe_combine"))) return;
        cu_launch(c, combine_rms_kernel, (unsigned)pairs, 256, 0, ye, latent, eps, inv);
    }
    cu_launch(c, combine_kernel, blocks_for(count, 256), 256, 0, out, ye, weights, inv,
              post_norm ? post_norm->data : NULL, post_norm ? (int)post_norm->dtype : 0, k, latent,
              count);
    cu_check_launch(c, "moe_combine");
}
