/* attention.cu: rope, qk_norm_rope, kv_store and causal GQA attention over the paged KV cache.
 *
 * The cache holds F32, BF16, F8_E4M3 or I8 rows; the two 8-bit formats carry one F32 scale per
 * (slot, KV head). A warp owns one head row of hd <= CU_MAX_HEAD_DIM elements, lane l holding
 * elements l, l + 32, ...: kv_store quantizes a row with a warp-wide amax; attention keeps q
 * and a partial output accumulator of one (token, query head) in registers, several warps
 * sharing its positions. */
#include "cuda-dev.cuh"

#define PER_LANE (CU_MAX_HEAD_DIM / 32)
#define WARPS 4 /* rows per block */

static int check_heads(struct cu_ctx *c, const char *op, int n, int heads, int hd) {
    if (n >= 0 && heads > 0 && hd > 0 && hd <= CU_MAX_HEAD_DIM) return 1;
    cu_fail(c, TMX_ERR_INVALID, "%s: n = %d, heads = %d, head_dim = %d (at most %d)", op, n,
            heads, hd, CU_MAX_HEAD_DIM);
    return 0;
}

/* --- rope ----------------------------------------------------------------------------------- */

/* Pair i of position p's rotation: the angle in double (pos * inv_freq reaches thousands of
 * radians, where a float angle is off by 1e-4), its cosine and sine rounded to float. */
__device__ __forceinline__ void rope_angle(int32_t p, float inv_freq, float *cs, float *sn) {
    double s, co;
    sincos((double)p * inv_freq, &s, &co);
    *cs = (float)co;
    *sn = (float)s;
}

/* Pair (v[i], v[i + half]) rotated, each product rounded before the sum (rope and
 * qk_norm_rope give the same bits). */
__device__ __forceinline__ void rope_pair(float *v, int i, int half, float cs, float sn) {
    float a = v[i], b = v[i + half];
    v[i] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    v[i + half] = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
}

/* A thread per (token, pair i): pair i of every head rotated. */
__global__ void rope_kernel(float *x, const int32_t *pos, const float *inv_freq, int n, int heads,
                            int hd, int *dev_err) {
    tmx_pdl_enter();
    int half = hd / 2;
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)n * half) return;
    int t = (int)(idx / half), i = (int)(idx % half);
    if (pos[t] < 0) {
        flag(dev_err, CU_DEV_POSITION);
        return;
    }
    float cs, sn;
    rope_angle(pos[t], inv_freq[i], &cs, &sn);
    for (int h = 0; h < heads; h++) rope_pair(x + ((int64_t)t * heads + h) * hd, i, half, cs, sn);
}

extern "C" void cu_rope(void *ctx, float *x, const int32_t *pos, const float *inv_freq, int n,
                        int heads, int hd) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "rope") || !check_heads(c, "rope", n, heads, hd)) return;
    if (hd % 2) {
        cu_fail(c, TMX_ERR_INVALID, "rope: head_dim %d is odd", hd);
        return;
    }
    if (n == 0) return;
    int64_t count = (int64_t)n * (hd / 2);
    cu_launch(c, rope_kernel, blocks_for(count, 128), 128, 0, x, pos, inv_freq, n, heads, hd,
              c->dev_err);
    cu_check_launch(c, "rope");
}

/* --- qk_norm_rope ------------------------------------------------------------------------------ */

/* A block per (token, head) of q then k: the head's row normed as rmsnorm_kernel norms a row
 * (same threads, so the same sums), then its pairs rotated as rope_kernel rotates them. */
template <int DT>
__global__ void qk_norm_rope_kernel(float *q, float *k, const void *qw, const void *kw,
                                    int q_normed, int k_normed, const int32_t *pos,
                                    const float *inv_freq, int hq, int hkv, int hd, float eps,
                                    int *dev_err) {
    tmx_pdl_enter();
    __shared__ float red[32];
    const int t = blockIdx.x / (hq + hkv), h = blockIdx.x % (hq + hkv), half = hd / 2;
    const int is_q = h < hq;
    float *v = is_q ? q + ((int64_t)t * hq + h) * hd : k + ((int64_t)t * hkv + h - hq) * hd;
    if (is_q ? q_normed : k_normed) {
        rms_row<DT>(v, v, is_q ? qw : kw, hd, eps, red);
        __syncthreads(); /* a pair's two elements belong to different threads */
    }
    if (pos[t] < 0) {
        if (threadIdx.x == 0) flag(dev_err, CU_DEV_POSITION);
        return;
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float cs, sn;
        rope_angle(pos[t], inv_freq[i], &cs, &sn);
        rope_pair(v, i, half, cs, sn);
    }
}

extern "C" void cu_qk_norm_rope(void *ctx, float *q, float *k, const struct tmx_tensor *q_norm,
                                const struct tmx_tensor *k_norm, const int32_t *pos,
                                const float *inv_freq, int n, int hq, int hkv, int hd,
                                float eps) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (q_norm && k_norm && q_norm->dtype != k_norm->dtype) { /* one weight dtype a kernel */
        cu_rmsnorm(ctx, q, q, q_norm, n * hq, hd, eps);
        cu_rmsnorm(ctx, k, k, k_norm, n * hkv, hd, eps);
        cu_rope(ctx, q, pos, inv_freq, n, hq, hd);
        cu_rope(ctx, k, pos, inv_freq, n, hkv, hd);
        return;
    }
    if (!cu_enter(c, "qk_norm_rope") || !check_heads(c, "qk_norm_rope", n, hq, hd) ||
        !check_heads(c, "qk_norm_rope", n, hkv, hd) ||
        (q_norm && !cu_check_weight(c, "qk_norm_rope", "q_norm", q_norm, 1, hd, 0)) ||
        (k_norm && !cu_check_weight(c, "qk_norm_rope", "k_norm", k_norm, 1, hd, 0)))
        return;
    if (hd % 2) {
        cu_fail(c, TMX_ERR_INVALID, "qk_norm_rope: head_dim %d is odd", hd);
        return;
    }
    if (n == 0) return;
    const unsigned blocks = (unsigned)((int64_t)n * (hq + hkv));
    CU_DISPATCH_W(q_norm ? q_norm->dtype : k_norm ? k_norm->dtype : TMX_DTYPE_F32,
                  (cu_launch(c, qk_norm_rope_kernel<DT>, blocks, rms_threads(hd), 0, q, k,
                             q_norm ? q_norm->data : NULL, k_norm ? k_norm->data : NULL,
                             q_norm != NULL, k_norm != NULL, pos, inv_freq, hq, hkv, hd, eps,
                             c->dev_err)));
    cu_check_launch(c, "qk_norm_rope");
}

/* --- the cache's number formats ------------------------------------------------------------- */

#define CU_DISPATCH_KV(dt, call)                                                              \
    do {                                                                                      \
        switch (dt) {                                                                         \
        case TMX_DTYPE_BF16: { constexpr int KT = TMX_DTYPE_BF16; call; break; }              \
        case TMX_DTYPE_F8_E4M3: { constexpr int KT = TMX_DTYPE_F8_E4M3; call; break; }        \
        case TMX_DTYPE_I8: { constexpr int KT = TMX_DTYPE_I8; call; break; }                  \
        default: { constexpr int KT = TMX_DTYPE_F32; call; break; }                           \
        }                                                                                     \
    } while (0)

/* Element i of a cache array, before its row's scale. */
template <int KT> __device__ __forceinline__ float kv_load(const void *p, int64_t i) {
    if (KT == TMX_DTYPE_F32) return ((const float *)p)[i];
    if (KT == TMX_DTYPE_BF16) return __uint_as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    if (KT == TMX_DTYPE_F8_E4M3) return e4m3_to_f32(((const uint8_t *)p)[i]);
    return (float)((const int8_t *)p)[i];
}

template <int KT> __device__ __forceinline__ void kv_put(void *p, int64_t i, float v) {
    if (KT == TMX_DTYPE_F32) ((float *)p)[i] = v;
    if (KT == TMX_DTYPE_BF16) ((uint16_t *)p)[i] = f32_to_bf16_bits(v);
    if (KT == TMX_DTYPE_F8_E4M3) ((uint8_t *)p)[i] = f32_to_e4m3_bits(v);
    if (KT == TMX_DTYPE_I8) ((int8_t *)p)[i] = (int8_t)fminf(fmaxf(rintf(v), -127.0f), 127.0f);
}

static bool kv_scaled(enum tmx_dtype dt) {
    return dt == TMX_DTYPE_F8_E4M3 || dt == TMX_DTYPE_I8;
}

static int check_cache(struct cu_ctx *c, const char *op, const struct tmx_kv_cache *kv) {
    bool dt_ok = kv && (kv->dtype == TMX_DTYPE_F32 || kv->dtype == TMX_DTYPE_BF16 ||
                        kv_scaled(kv->dtype));
    if (!dt_ok) {
        cu_fail(c, kv ? TMX_ERR_UNSUPPORTED : TMX_ERR_INVALID,
                "%s: KV cache dtype must be F32, BF16, F8_E4M3 or I8", op);
        return 0;
    }
    if (kv->n_blocks <= 0 || kv->block_size <= 0 || !kv->k || !kv->v ||
        (kv_scaled(kv->dtype) && (!kv->k_scale || !kv->v_scale))) {
        cu_fail(c, TMX_ERR_INVALID, "%s: KV cache of %d blocks of %d rows, buffers %s", op,
                kv->n_blocks, kv->block_size, kv->k && kv->v ? "without scales" : "missing");
        return 0;
    }
    return 1;
}

/* --- kv_store ------------------------------------------------------------------------------- */

/* One row (hd elements) of token t, KV head kvh into slot: scaled formats divide by
 * amax / qmax (0 for an all-zero row, which stores zeros). */
template <int KT>
__device__ void store_row(void *cache, float *scales, const float *src, int64_t slot, int kvh,
                          int hkv, int hd) {
    int lane = threadIdx.x % 32;
    int64_t at = (slot * hkv + kvh) * hd;
    float v[PER_LANE], amax = 0.0f;
    for (int j = 0; j < PER_LANE; j++) {
        int i = lane + 32 * j;
        v[j] = i < hd ? src[i] : 0.0f;
        amax = fmaxf(amax, fabsf(v[j]));
    }
    float scale = 1.0f;
    if (KT == TMX_DTYPE_F8_E4M3 || KT == TMX_DTYPE_I8) {
        amax = warp_max(amax);
        scale = amax / (KT == TMX_DTYPE_I8 ? 127.0f : 448.0f);
        if (lane == 0) scales[slot * hkv + kvh] = scale;
    }
    for (int j = 0; j < PER_LANE; j++) {
        int i = lane + 32 * j;
        if (i >= hd) break;
        float q = v[j];
        if (KT == TMX_DTYPE_F8_E4M3 || KT == TMX_DTYPE_I8) q = scale == 0.0f ? 0.0f : v[j] / scale;
        kv_put<KT>(cache, at + i, q);
    }
}

/* A warp per (token, KV head). */
template <int KT>
__global__ void __launch_bounds__(WARPS * 32)
kv_store_kernel(struct tmx_kv_cache kv, const float *k, const float *v, const int32_t *slots,
                int n, int *dev_err) {
    tmx_pdl_enter();
    int64_t row = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= (int64_t)n * kv.hkv) return;
    int t = (int)(row / kv.hkv), kvh = (int)(row % kv.hkv);
    int32_t slot = slots[t];
    if (slot < 0) return;
    if (slot >= (int64_t)kv.n_blocks * kv.block_size) {
        flag(dev_err, CU_DEV_SLOT);
        return;
    }
    store_row<KT>(kv.k, kv.k_scale, k + row * kv.hd, slot, kvh, kv.hkv, kv.hd);
    store_row<KT>(kv.v, kv.v_scale, v + row * kv.hd, slot, kvh, kv.hkv, kv.hd);
}

extern "C" void cu_kv_store(void *ctx, const struct tmx_kv_cache *kv, const float *k,
                            const float *v, const int32_t *slots, int n) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "kv_store") || !check_cache(c, "kv_store", kv) ||
        !check_heads(c, "kv_store", n, kv->hkv, kv->hd) || n == 0)
        return;
    int64_t rows = (int64_t)n * kv->hkv;
    CU_DISPATCH_KV(kv->dtype, (cu_launch(c, kv_store_kernel<KT>, blocks_for(rows, WARPS),
                                         WARPS * 32, 0, *kv, k, v, slots, n, c->dev_err)));
    cu_check_launch(c, "kv_store");
}

/* --- attention ------------------------------------------------------------------------------ */

struct attn_args {
    float *out;            /* [n][hq][hd] */
    const float *q;        /* [n][hq][hd] */
    const int32_t *tables; /* [n_seq][max_blocks] */
    const int32_t *seq, *pos;
    int max_blocks, n, hq, window;
    float scale;
};

/* Warps sharing the positions of one (token, query head): 32 when the step's blocks are few
 * (a decode step: each warp's positions are a chain of dependent sums, and the SMs are
 * otherwise idle; muse-mini's decode 1.11x faster than with 8), 8 when they are many. */
#define ATT_WARPS_FEW 32
#define ATT_WARPS_MANY 8
#define ATT_FEW_TASKS 256 /* (token, head) blocks that still count as few */

/* A block per (token, query head); warp w of W takes the visible positions lo + w, lo + w + W,
 * ... in one pass with an online softmax: the running max m and sum l are rescaled when a
 * score raises the max, so every exponent is at most 0. The warps' partial (m, l, acc) then
 * merge in shared memory, rescaled to the common max: the exact softmax up to rounding, with
 * the positions of a long context spread over W warps instead of one. */
template <int KT, int W>
__global__ void __launch_bounds__(W * 32)
attention_kernel(struct tmx_kv_cache kv, struct attn_args a, int *dev_err) {
    tmx_pdl_enter();
    __shared__ float s_m[W], s_l[W];
    __shared__ float s_acc[W][CU_MAX_HEAD_DIM]; /* [warp][hd] */
    const int64_t task = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = kv.hd;
    const int t = (int)(task / a.hq), h = (int)(task % a.hq), kvh = h / (a.hq / kv.hkv);
    const int s = a.seq[t], p = a.pos[t];
    float *out = a.out + task * hd;
    if (s < 0 || p < 0) { /* the whole block leaves */
        if (threadIdx.x == 0) flag(dev_err, s < 0 ? CU_DEV_BLOCK : CU_DEV_POSITION);
        return;
    }
    float qv[PER_LANE], acc[PER_LANE];
    for (int j = 0; j < PER_LANE; j++) {
        int i = lane + 32 * j;
        qv[j] = i < hd ? a.q[task * hd + i] : 0.0f;
        acc[j] = 0.0f;
    }
    int lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
    const int32_t *table = a.tables + (int64_t)s * a.max_blocks;
    const bool scaled = KT == TMX_DTYPE_F8_E4M3 || KT == TMX_DTYPE_I8;
    float m = -INFINITY, l = 0.0f;
    for (int j = lo + warp; j <= p; j += W) {
        int bi = j / kv.block_size;
        int blk = bi < a.max_blocks ? table[bi] : -1;
        if (blk < 0 || blk >= kv.n_blocks) { /* stop, but stay for the merge's barrier */
            flag(dev_err, CU_DEV_BLOCK);
            break;
        }
        int64_t row = ((int64_t)blk * kv.block_size + j % kv.block_size) * kv.hkv + kvh;
        float ks = scaled ? kv.k_scale[row] : 1.0f, vs = scaled ? kv.v_scale[row] : 1.0f;
        float dot = 0.0f;
        for (int jj = 0; jj < PER_LANE; jj++) {
            int i = lane + 32 * jj;
            if (i < hd) dot += qv[jj] * (kv_load<KT>(kv.k, row * hd + i) * ks);
        }
        float sc = warp_sum(dot) * a.scale;
        if (sc > m) {
            float r = expf(m - sc);
            l *= r;
            for (int jj = 0; jj < PER_LANE; jj++) acc[jj] *= r;
            m = sc;
        }
        float e = expf(sc - m);
        l += e;
        for (int jj = 0; jj < PER_LANE; jj++) {
            int i = lane + 32 * jj;
            if (i < hd) acc[jj] += e * (kv_load<KT>(kv.v, row * hd + i) * vs);
        }
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    for (int jj = 0; jj < PER_LANE; jj++) {
        int i = lane + 32 * jj;
        if (i < hd) s_acc[warp][i] = acc[jj];
    }
    __syncthreads();
    if (warp != 0) return;
    float mx = -INFINITY, sum = 0.0f, o[PER_LANE] = {};
    for (int w = 0; w < W; w++) mx = fmaxf(mx, s_m[w]);
    for (int w = 0; w < W; w++) {
        if (s_m[w] == -INFINITY) continue; /* a warp that saw no position */
        float r = expf(s_m[w] - mx);
        sum += s_l[w] * r;
        for (int jj = 0; jj < PER_LANE; jj++) {
            int i = lane + 32 * jj;
            if (i < hd) o[jj] += s_acc[w][i] * r;
        }
    }
    for (int jj = 0; jj < PER_LANE; jj++) {
        int i = lane + 32 * jj;
        if (i < hd) out[i] = o[jj] / sum;
    }
}

extern "C" void cu_attention(void *ctx, float *out, const float *q, const struct tmx_kv_cache *kv,
                             const int32_t *tables, int max_blocks, const int32_t *seq,
                             const int32_t *pos, int n, int hq, int window, float scale) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "attention") || !check_cache(c, "attention", kv) ||
        !check_heads(c, "attention", n, hq, kv->hd))
        return;
    if (kv->hkv <= 0 || hq % kv->hkv || max_blocks <= 0 || window < 0) {
        cu_fail(c, TMX_ERR_INVALID,
                "attention: %d query heads over %d KV heads, %d blocks per sequence, window %d",
                hq, kv->hkv, max_blocks, window);
        return;
    }
    if (n == 0) return;
    struct attn_args a = {out, q, tables, seq, pos, max_blocks, n, hq, window, scale};
    const unsigned tasks = (unsigned)((int64_t)n * hq); /* a block each */
    if (tasks <= ATT_FEW_TASKS)
        CU_DISPATCH_KV(kv->dtype, (cu_launch(c, attention_kernel<KT, ATT_WARPS_FEW>, tasks,
                                             ATT_WARPS_FEW * 32, 0, *kv, a, c->dev_err)));
    else
        CU_DISPATCH_KV(kv->dtype, (cu_launch(c, attention_kernel<KT, ATT_WARPS_MANY>, tasks,
                                             ATT_WARPS_MANY * 32, 0, *kv, a, c->dev_err)));
    cu_check_launch(c, "attention");
}
