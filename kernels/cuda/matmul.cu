/* matmul.cu: y[n][m] = x[n][k] . w[m][k]^T with F32 activations.
 *
 * Decode (n <= 8) is bound by reading the weight once: GEMV kernels that keep up to 8 token
 * rows' sums in registers and read F32/BF16/F16 weights directly, one warp a weight row for one
 * token over many rows, else two rows a block whose warps split k. BF16 weights of 4,096 rows
 * by 2,048 columns and more take the tensor cores from 2 tokens on (mv_kernel, option bf16_mv;
 * with it off, cuBLASLt past option gemv_max tokens), and so do MXFP8 ones (option mx_mv).
 *
 * Prefill (n > 8) goes to cuBLASLt. F32 weights: an F32 GEMM (CUBLAS_COMPUTE_32F, no
 * TF32).
 * BF16 weights: the activations cannot simply be rounded to BF16, which costs ~2^-9 relative
 * error per element and fails the conformance tolerance (1e-5 normalized). Each activation is
 * split instead into x = hi + lo, both BF16 (lo the BF16 rounding of x - hi), and two BF16
 * GEMMs with F32 accumulation add W.hi and W.lo: what is left is ~2^-17 relative per element,
 * at twice the tensor-core work of a plain BF16 GEMM. From 9 to 64 tokens (a decode step of
 * that many sequences) one kernel of our own does the same arithmetic for weights of at most
 * 1,024 columns (bf16_mma_kernel, option bf16_mma). F16 weights would need the
 * same split in F16, whose range (65504) and subnormals break it for real activations, so they
 * take the GEMV kernel over groups of 8 tokens (correct, not fast: F16 checkpoints are rare).
 *
 * MXFP8 weights (E4M3 codes, then a UE8M0 scale per 32: tmx/tensor.h) keep their codes in
 * device memory: decode reads a byte a weight where BF16 reads two (mxfp8_gemv_kernel);
 * prefill expands them into BF16 scratch, exactly, and takes the BF16 path. */
#include <cuda_fp8.h>
#include <string.h>

#include "cuda-dev.cuh"

#define GEMV_WARPS 8 /* warps of a GEMV block */
#define GEMV_MAX 4   /* weights one GEMV launch takes (matmul_multi) */

/* The weights of one GEMV launch, which share x and k: y[i][n][m[i]] = x . w[i]^T, weight i
 * taking the grid's blocks [first[i], first[i + 1]) along x, so that no block straddles two. */
struct gemv_set {
    const void *w[GEMV_MAX];
    float *y[GEMV_MAX];
    int m[GEMV_MAX];
    int first[GEMV_MAX + 1];
    int count;
};

/* The set for a kernel of `rows` weight rows a block. */
static gemv_set gemv_set_of(float *const *y, const void *const *w, const int *m, int count,
                            int rows) {
    gemv_set s = {};
    s.count = count;
    for (int i = 0; i < count; i++) {
        s.w[i] = w[i], s.y[i] = y[i], s.m[i] = m[i];
        s.first[i + 1] = s.first[i] + (m[i] + rows - 1) / rows;
    }
    return s;
}

/* Which weight of s block b computes. */
__device__ __forceinline__ int gemv_which(const gemv_set &s, int b) {
    int i = 0;
    while (i + 1 < s.count && b >= s.first[i + 1]) i++;
    return i;
}

/* One warp per weight row r, for the tokens [t0, t0 + nt) of this block's group, nt <= NT.
 * VEC: 16-byte loads (k a multiple of 8 and x and the weights 16-byte aligned, checked by the
 * caller). */
template <int DT, int NT, bool VEC>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const gemv_set ws, const float *x, int n, int k) {
    tmx_pdl_enter();
    const int i = gemv_which(ws, blockIdx.x), m = ws.m[i];
    const void *w = ws.w[i];
    float *y = ws.y[i];
    int r = (blockIdx.x - ws.first[i]) * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    int t0 = blockIdx.y * NT, nt = n - t0 < NT ? n - t0 : NT;
    if (r >= m) return;
    float acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    const int64_t row = (int64_t)r * k;
    if (VEC) {
        for (int i = lane * 8; i < k; i += 32 * 8) {
            float wv[8];
            if (DT == TMX_DTYPE_F32) {
                float4 a = __ldg((const float4 *)((const float *)w + row + i));
                float4 b = __ldg((const float4 *)((const float *)w + row + i + 4));
                wv[0] = a.x, wv[1] = a.y, wv[2] = a.z, wv[3] = a.w;
                wv[4] = b.x, wv[5] = b.y, wv[6] = b.z, wv[7] = b.w;
            } else {
                uint4 u = __ldg((const uint4 *)((const uint16_t *)w + row + i));
                const uint32_t h[4] = {u.x, u.y, u.z, u.w};
                for (int j = 0; j < 4; j++) {
                    if (DT == TMX_DTYPE_BF16) {
                        wv[2 * j] = __uint_as_float(h[j] << 16);
                        wv[2 * j + 1] = __uint_as_float(h[j] & 0xffff0000u);
                    } else {
                        float2 f = __half22float2(*(const __half2 *)&h[j]);
                        wv[2 * j] = f.x, wv[2 * j + 1] = f.y;
                    }
                }
            }
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float *xt = x + (int64_t)(t0 + t) * k + i;
                float4 a = *(const float4 *)xt, b = *(const float4 *)(xt + 4);
                acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x +
                          wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
            }
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            float wv = load_w<DT>(w, row + i);
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                acc[t] += wv * x[(int64_t)(t0 + t) * k + i];
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (t < nt && lane == 0) y[(int64_t)(t0 + t) * m + r] = s;
    }
}

/* Whether x and every weight are 16-byte aligned. */
static bool aligned16(const float *x, const void *const *w, int count) {
    uintptr_t bits = (uintptr_t)x;
    for (int i = 0; i < count; i++) bits |= (uintptr_t)w[i];
    return (bits & 15) == 0;
}

template <int DT, int NT>
static void gemv_launch(struct cu_ctx *c, float *const *y, const float *x, const void *const *w,
                        const int *m, int count, int n, int k) {
    const gemv_set s = gemv_set_of(y, w, m, count, GEMV_WARPS);
    dim3 grid((unsigned)s.first[count], (unsigned)((n + NT - 1) / NT));
    if (k % 8 == 0 && aligned16(x, w, count))
        cu_launch(c, gemv_kernel<DT, NT, true>, grid, GEMV_WARPS * 32, 0, s, x, n, k);
    else
        cu_launch(c, gemv_kernel<DT, NT, false>, grid, GEMV_WARPS * 32, 0, s, x, n, k);
}

#define SK_ROWS 2    /* weight rows of a split-k block, whose GEMV_WARPS warps split k */
#define SK_STEP 512  /* weights of a row a warp takes at a time: lane l those at 4 l + 128 j */

/* 4 weights as loaded (F32: a float4, BF16 and F16: a uint2) and as f32. */
template <int DT> struct w4 {
    typedef uint2 raw;
    static __device__ __forceinline__ raw load(const void *w, int64_t i) {
        return __ldg((const uint2 *)((const uint16_t *)w + i));
    }
    static __device__ __forceinline__ float4 f32(raw u) {
        if (DT == TMX_DTYPE_BF16)
            return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                               __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
        const float2 a = __half22float2(*(const __half2 *)&u.x);
        const float2 b = __half22float2(*(const __half2 *)&u.y);
        return make_float4(a.x, a.y, b.x, b.y);
    }
};
template <> struct w4<TMX_DTYPE_F32> {
    typedef float4 raw;
    static __device__ __forceinline__ raw load(const void *w, int64_t i) {
        return __ldg((const float4 *)((const float *)w + i));
    }
    static __device__ __forceinline__ float4 f32(raw u) { return u; }
};

/* The end of a split-k GEMV block (gemv_split_kernel, mxfp8_gemv_kernel), whose warps form
 * groups of wpr, group g taking R rows from rb + g R: each warp's sums of R rows and NT tokens
 * meet in red, and y[t0 + t][row] gets their group's total for rows < m and tokens < nt. */
template <int R, int NT>
__device__ __forceinline__ void split_k_store(const float (&acc)[R][NT], float (*red)[R][NT],
                                              float *__restrict__ y, int m, int rb, int wpr,
                                              int t0, int nt) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r][t] = v;
        }
    __syncthreads();
    const int groups = GEMV_WARPS / wpr; /* 1 folds to the one group's indexing */
    for (int i = threadIdx.x; i < groups * R * NT; i += blockDim.x) {
        const int g = groups == 1 ? 0 : i / (R * NT), r = groups == 1 ? i / NT : i / NT % R;
        const int t = i % NT, row = rb + g * R + r;
        if (row >= m || t >= nt) continue;
        float sum = 0.0f;
        for (int v = g * wpr; v < (g + 1) * wpr; v++) sum += red[v][r][t];
        y[(int64_t)(t0 + t) * m + row] = sum;
    }
}

/* What a lane holds of 4 weights of the next step: as loaded (RAW) or already as f32. */
template <int DT, bool RAW> struct held {
    typedef typename w4<DT>::raw type;
    static __device__ __forceinline__ type keep(typename w4<DT>::raw u) { return u; }
    static __device__ __forceinline__ float4 f32(type u) { return w4<DT>::f32(u); }
};
template <int DT> struct held<DT, false> {
    typedef float4 type;
    static __device__ __forceinline__ type keep(typename w4<DT>::raw u) { return w4<DT>::f32(u); }
    static __device__ __forceinline__ float4 f32(type v) { return v; }
};

/* The GEMV of F32, BF16 and F16 weights in mxfp8_gemv_kernel's form, for k a multiple of 4 and
 * x and w 16-byte aligned: the block's warps form groups of wpr, group g computes SK_ROWS rows
 * from its r0 on, and its warp v takes steps v, v + wpr, ... of SK_STEP weights of all of them
 * and loads its next step before it computes this one; every load of a warp, weights or x, is
 * one contiguous piece (x's loaded once a step for the SK_ROWS rows). The groups are one of 8
 * warps, or with SHORT (k under 8 steps) the fewest warps whose steps cover k, so that a short
 * k leaves no warp idle (a run-time wpr costs the long rows 7-10% at 2-4 tokens: H200,
 * docs/perf/h200.md). gemv_kernel's one warp a row gives each lane 8 contiguous weights, so a
 * warp's x loads of a token touch 8 lines each: 1.1-1.3 TB/s at 4 tokens (docs/perf/h200.md).
 * The warps' sums meet in shared memory. Up to 4 tokens the next step's weights stay as loaded
 * (half the registers for 16-bit ones) and 3 blocks share an SM; 8 tokens go faster with them
 * converted as they arrive, 2 blocks an SM (H200, BF16: each form 14-45% faster than the other
 * on the 816B model's projections and lm_head, docs/perf/h200.md). */
template <int DT, int NT, bool SHORT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, NT <= 4 ? 3 : 2)
gemv_split_kernel(const gemv_set ws, const float *__restrict__ x, int n, int k, int wpr_short) {
    tmx_pdl_enter();
    __shared__ float red[GEMV_WARPS][SK_ROWS][NT];
    const int wpr = SHORT ? wpr_short : GEMV_WARPS;
    const int which = gemv_which(ws, blockIdx.x), m = ws.m[which];
    const void *__restrict__ w = ws.w[which];
    float *__restrict__ y = ws.y[which];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int rb = (blockIdx.x - ws.first[which]) * (GEMV_WARPS / wpr) * SK_ROWS;
    const int r0 = rb + warp / wpr * SK_ROWS, first = warp % wpr * SK_STEP;
    const int t0 = blockIdx.y * NT, nt = min(n - t0, NT), rows = min(m - r0, SK_ROWS);
    const int stride = wpr * SK_STEP, end = !SHORT || rows > 0 ? k : 0; /* a group past m:
                                                                            nothing */
    typedef held<DT, NT <= 4> hold;
    float acc[SK_ROWS][NT] = {};
    typename hold::type c[SK_ROWS][4];
    auto load = [&](int base) { /* rows past m read the last one again, never stored */
#pragma unroll
        for (int r = 0; r < SK_ROWS; r++) {
            const int64_t row = (int64_t)(r0 + min(r, rows - 1)) * k;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int p = base + 4 * lane + 128 * j;
                c[r][j] = hold::keep(p < k ? w4<DT>::load(w, row + p) : typename w4<DT>::raw{});
            }
        }
    };
    if (first < end) load(first);
    for (int base = first; base < end; base += stride) {
        float4 q[SK_ROWS][4];
#pragma unroll
        for (int r = 0; r < SK_ROWS; r++)
#pragma unroll
            for (int j = 0; j < 4; j++) q[r][j] = hold::f32(c[r][j]);
        if (base + stride < k) load(base + stride);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const float *xt = x + (int64_t)(t0 + t) * k + base + 4 * lane;
            float4 a[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                a[j] = base + 4 * lane + 128 * j < k ? *(const float4 *)(xt + 128 * j)
                                                     : make_float4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < SK_ROWS; r++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[r][t] += q[r][j].x * a[j].x + q[r][j].y * a[j].y + q[r][j].z * a[j].z +
                                 q[r][j].w * a[j].w;
        }
    }
    split_k_store(acc, red, y, m, rb, wpr, t0, nt);
}

/* One token over enough rows to fill the GPU (1,024: 128 blocks of gemv_kernel) reads the
 * weight at copy speed in gemv_kernel; more tokens, or fewer rows, go faster in
 * gemv_split_kernel (H200: 1.3-3.5x at 4 tokens, 1.4x at one token on 512 rows; 1.3-1.5x
 * slower at one token on 2,048 rows and more: docs/perf/h200.md), where k and the addresses
 * allow it (two tokens over short rows too, since the row groups: o_proj of a TP-4 rank 2%
 * faster than in gemv_kernel, which was 18% faster before them). */
template <int DT, int NT>
static void gemv_pick(struct cu_ctx *c, float *const *y, const float *x, const void *const *w,
                      const int *m, int count, int n, int k) {
    int rows = 0;
    for (int i = 0; i < count; i++) rows += m[i];
    if (!(rows >= 1024 && n == 1) && k % 4 == 0 && aligned16(x, w, count)) {
        int wpr = 1; /* warps a row group: the fewest whose steps cover k */
        while (wpr < GEMV_WARPS && wpr * SK_STEP < k) wpr *= 2;
        const gemv_set s = gemv_set_of(y, w, m, count, GEMV_WARPS / wpr * SK_ROWS);
        dim3 grid((unsigned)s.first[count], (unsigned)((n + NT - 1) / NT));
        if (wpr < GEMV_WARPS)
            cu_launch(c, gemv_split_kernel<DT, NT, true>, grid, GEMV_WARPS * 32, 0, s, x, n, k,
                      wpr);
        else
            cu_launch(c, gemv_split_kernel<DT, NT, false>, grid, GEMV_WARPS * 32, 0, s, x, n, k,
                      wpr);
    } else {
        gemv_launch<DT, NT>(c, y, x, w, m, count, n, k);
    }
}

/* y[i] = x . w[i]^T for the count weights (of one dtype, [m[i]][k] each), in one launch. Token
 * rows go in groups of 1, 2, 4 or 8 (the smallest that holds n, else 8). */
template <int DT>
static void gemv(struct cu_ctx *c, float *const *y, const float *x, const void *const *w,
                 const int *m, int count, int n, int k) {
    if (n == 1) gemv_pick<DT, 1>(c, y, x, w, m, count, n, k);
    else if (n == 2) gemv_pick<DT, 2>(c, y, x, w, m, count, n, k);
    else if (n <= 4) gemv_pick<DT, 4>(c, y, x, w, m, count, n, k);
    else gemv_pick<DT, 8>(c, y, x, w, m, count, n, k);
}

/* 2^(s - 127) for a UE8M0 scale byte s, exact (s = 255, OCP's NaN, is no scale tmx writes). */
__device__ __forceinline__ float ue8m0(uint32_t s) {
    return s ? __uint_as_float(s << 23) : 0x1p-127f;
}

/* The 4 N E4M3 codes of words q (code 4 i + b in byte b of q[i]) -> f32 values v, in pairs
 * through f16 (exact). */
template <int N>
__device__ __forceinline__ void e4m3_to_f32x(const uint32_t (&q)[N], float (&v)[4 * N]) {
#pragma unroll
    for (int j = 0; j < 2 * N; j++) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            (__nv_fp8x2_storage_t)(q[j / 2] >> 16 * (j % 2)), __NV_E4M3);
        const float2 f = __half22float2(*(const __half2 *)&h);
        v[2 * j] = f.x, v[2 * j + 1] = f.y;
    }
}

#define MX_ROWS 2   /* weight rows of a block, whose 8 warps split k (4: up to 43% slower) */
#define MX_STEP 512 /* codes of a row a warp takes at a time: lane l those at 4 l + 128 j */

/* A block computes MX_ROWS rows from r0 on; warp w takes steps w, w + 8, ... of MX_STEP codes
 * of all of them, x loaded once a step for the MX_ROWS rows, and loads its next step before
 * it computes this one: 2 KB of codes in flight a warp. Each load of a warp, codes or x, is one
 * contiguous piece. The warps' sums meet in shared memory. (One warp a row, as gemv_kernel,
 * read the codes at half the rate gemv_kernel reads BF16: docs/perf/h200.md.) A block's sum of
 * codes times x, in f32, is scaled by its 2^(s - 127); the block scales of a step, a lane each,
 * go round by shuffles. w: codes [m][k], then scales [m][k / 32]. VEC: 16-byte loads of x.
 * At 2 tokens 3 blocks share an SM (96 registers -> 80): 10-20% faster on the 816B model's
 * large projections and lm_head; at 1, 4 and 8 tokens a bound measured no better, so there is
 * none (0) (H200, docs/perf/h200.md). */
template <int NT, bool VEC>
__global__ void __launch_bounds__(GEMV_WARPS * 32, NT == 2 ? 3 : 0)
mxfp8_gemv_kernel(const gemv_set ws, const float *__restrict__ x, int n, int k) {
    tmx_pdl_enter();
    __shared__ float red[GEMV_WARPS][MX_ROWS][NT];
    const int which = gemv_which(ws, blockIdx.x), m = ws.m[which];
    const uint8_t *__restrict__ w = (const uint8_t *)ws.w[which];
    float *__restrict__ y = ws.y[which];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x - ws.first[which]) * MX_ROWS;
    const int t0 = blockIdx.y * NT, nt = min(n - t0, NT), rows = min(m - r0, MX_ROWS);
    const int nb = k / 32, stride = GEMV_WARPS * MX_STEP;
    float acc[MX_ROWS][NT] = {};
    uint32_t c[MX_ROWS][4], s[MX_ROWS];
    auto load = [&](int base) { /* rows past m read the last one again, never stored */
#pragma unroll
        for (int r = 0; r < MX_ROWS; r++) {
            const int64_t row = r0 + min(r, rows - 1);
            const uint32_t *cw = (const uint32_t *)(w + row * k);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int p = base + 4 * lane + 128 * j;
                c[r][j] = p < k ? __ldg(cw + p / 4) : 0u;
            }
            const int b = base / 32 + lane % 16;
            s[r] = b < nb ? __ldg(w + (int64_t)m * k + row * nb + b) : 0u;
        }
    };
    if (warp * MX_STEP < k) load(warp * MX_STEP);
    for (int base = warp * MX_STEP; base < k; base += stride) {
        uint32_t q[MX_ROWS][4];
        float f[MX_ROWS][4];
#pragma unroll
        for (int r = 0; r < MX_ROWS; r++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                q[r][j] = c[r][j];
                f[r][j] = ue8m0(__shfl_sync(0xffffffffu, s[r], lane / 8 + 4 * j));
            }
        }
        if (base + stride < k) load(base + stride);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const float *xt = x + (int64_t)(t0 + t) * k + base + 4 * lane;
            float4 a[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const bool in = base + 4 * lane + 128 * j < k;
                a[j] = !in ? make_float4(0, 0, 0, 0)
                     : VEC ? *(const float4 *)(xt + 128 * j)
                           : make_float4(xt[128 * j], xt[128 * j + 1], xt[128 * j + 2],
                                         xt[128 * j + 3]);
            }
#pragma unroll
            for (int r = 0; r < MX_ROWS; r++) {
                float wv[16], d = 0.0f;
                e4m3_to_f32x(q[r], wv);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    d += f[r][j] * (wv[4 * j] * a[j].x + wv[4 * j + 1] * a[j].y +
                                    wv[4 * j + 2] * a[j].z + wv[4 * j + 3] * a[j].w);
                acc[r][t] += d;
            }
        }
    }
    split_k_store(acc, red, y, m, r0, GEMV_WARPS, t0, nt);
}

template <int NT>
static void mxfp8_gemv_launch(struct cu_ctx *c, float *const *y, const float *x,
                              const void *const *w, const int *m, int count, int n, int k) {
    const gemv_set s = gemv_set_of(y, w, m, count, MX_ROWS);
    dim3 grid((unsigned)s.first[count], (unsigned)((n + NT - 1) / NT));
    if (((uintptr_t)x & 15) == 0)
        cu_launch(c, mxfp8_gemv_kernel<NT, true>, grid, GEMV_WARPS * 32, 0, s, x, n, k);
    else
        cu_launch(c, mxfp8_gemv_kernel<NT, false>, grid, GEMV_WARPS * 32, 0, s, x, n, k);
}

/* gemv's for MXFP8 weights. */
static void mxfp8_gemv(struct cu_ctx *c, float *const *y, const float *x, const void *const *w,
                       const int *m, int count, int n, int k) {
    if (n == 1) mxfp8_gemv_launch<1>(c, y, x, w, m, count, n, k);
    else if (n == 2) mxfp8_gemv_launch<2>(c, y, x, w, m, count, n, k);
    else if (n <= 4) mxfp8_gemv_launch<4>(c, y, x, w, m, count, n, k);
    else mxfp8_gemv_launch<8>(c, y, x, w, m, count, n, k);
}

/* MXFP8 [count / k][k] (codes, then scales) -> its BF16 values, as tmx_mxfp8_to_bf16: a thread
 * takes 16 codes (half a block). */
__global__ void mxfp8_to_bf16_kernel(uint4 *out, const uint4 *w, int64_t count) {
    tmx_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count / 16) return;
    const uint4 c = w[i];
    const uint32_t q[4] = {c.x, c.y, c.z, c.w};
    const float f = ue8m0(((const uint8_t *)w)[count + i / 2]);
    float v[16];
    e4m3_to_f32x(q, v);
    uint32_t o[8];
    for (int j = 0; j < 8; j++)
        o[j] = f32_to_bf16_bits(v[2 * j] * f) | (uint32_t)f32_to_bf16_bits(v[2 * j + 1] * f) << 16;
    out[2 * i] = make_uint4(o[0], o[1], o[2], o[3]);
    out[2 * i + 1] = make_uint4(o[4], o[5], o[6], o[7]);
}

/* --- cuBLASLt ------------------------------------------------------------------------------ */

/* x = hi + lo, both BF16: [count] F32 -> [count] BF16 twice. */
__global__ void split_bf16_kernel(__nv_bfloat16 *hi, __nv_bfloat16 *lo, const float *x,
                                  int64_t count) {
    tmx_pdl_enter();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float v = x[i];
    uint16_t h = f32_to_bf16_bits(v);
    uint16_t l = f32_to_bf16_bits(v - __uint_as_float((uint32_t)h << 16));
    hi[i] = __ushort_as_bfloat16(h);
    lo[i] = __ushort_as_bfloat16(l);
}

static void lt_plan_clear(struct cu_lt_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    memset(p, 0, sizeof *p);
    p->n = -1;
}

void cu_lt_plans_free(struct cu_ctx *c) {
    for (int i = 0; i < c->n_lt_plans; i++) lt_plan_clear(&c->lt_plans[i]);
    c->n_lt_plans = 0;
}

/* Asks cuBLASLt for its best algorithm for the layouts within the workspace. Returns 1 and
 * sets *algo when it has one. */
static int lt_heuristic(struct cu_ctx *c, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                        cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                        cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    const int asked =
        cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &c->lt_ws_size, sizeof c->lt_ws_size) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, lc, lc, pref, 1, &res, &found) ==
            CUBLAS_STATUS_SUCCESS;
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!asked || found < 1) return 0;
    *algo = res.algo;
    return 1;
}

/* The algorithm cuBLASLt picks for p's shape at nb tokens in place of p->n, where it runs at
 * p->n within the workspace. Returns 1 and sets p->algo when so. */
static int lt_bucket_algo(struct cu_ctx *c, struct cu_lt_plan *p, int nb) {
    cublasLtMatrixLayout_t lb = NULL, lc = NULL;
    cublasLtMatmulHeuristicResult_t check;
    const int ok =
        cublasLtMatrixLayoutCreate(&lb, p->ab, p->k, nb, p->k) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, p->m, nb, p->m) == CUBLAS_STATUS_SUCCESS &&
        lt_heuristic(c, p->op, p->la, lb, lc, &p->algo) &&
        cublasLtMatmulAlgoCheck(c->lt, p->op, p->la, p->lb, p->lc, p->lc, &p->algo, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= c->lt_ws_size;
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    return ok;
}

/* The smallest power of two at least n, at most 2^30. */
static int pow2_at_least(int n) {
    int b = 1;
    while (b < n && b < 1 << 30) b <<= 1;
    return b;
}

/* Makes p's descriptors for Y = X . W^T of shape (ab, n, m, k) in cuBLASLt's column-major
 * terms: C[m][n] = op(A)[m][k] . B[k][n] with A the row-major W seen as k x m (transposed), B
 * the row-major X seen as k x n, C = Y^T (m x n); then picks an algorithm. With lt_buckets it
 * is the one cuBLASLt picks for n rounded up to a power of two, kept where it runs at n: a
 * server's prompts come in every width, and a width whose algorithm no earlier call used
 * pays milliseconds on its first call (docs/perf/h200.md, "cuBLASLt by buckets"). */
static cublasStatus_t lt_plan_make(struct cu_ctx *c, struct cu_lt_plan *p, cudaDataType_t ab,
                                   int n, int m, int k) {
    memset(p, 0, sizeof *p);
    p->ab = ab, p->n = n, p->m = m, p->k = k;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasStatus_t st;
    if ((st = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        (st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
        (st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) ||
        (st = cublasLtMatrixLayoutCreate(&p->la, ab, k, m, k)) ||
        (st = cublasLtMatrixLayoutCreate(&p->lb, ab, k, n, k)) ||
        (st = cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, m, n, m)))
        return st;
    const int nb = c->lt_buckets ? pow2_at_least(n) : n;
    p->found = (nb != n && lt_bucket_algo(c, p, nb)) ||
               lt_heuristic(c, p->op, p->la, p->lb, p->lc, &p->algo);
    return CUBLAS_STATUS_SUCCESS;
}

/* Y (+)= X . W^T (beta 0 or 1) through cuBLASLt, with the shape's kept plan or a new one in
 * the least recently used slot. Returns 0 (nothing queued) when cuBLASLt has no algorithm for
 * the shape, so the caller can fall back; other failures are recorded. */
static int lt_matmul(struct cu_ctx *c, cudaDataType_t ab, const void *w, const void *x, float *y,
                     int n, int m, int k, float beta) {
    struct cu_lt_plan *p = NULL, *oldest = NULL;
    for (int i = 0; i < c->n_lt_plans && !p; i++) {
        struct cu_lt_plan *q = &c->lt_plans[i];
        if (q->n == n && q->m == m && q->k == k && q->ab == ab) p = q;
        else if (!oldest || q->used < oldest->used) oldest = q;
    }
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (!p) {
        p = c->n_lt_plans < CU_LT_PLANS ? &c->lt_plans[c->n_lt_plans++] : oldest;
        lt_plan_clear(p);
        if ((st = lt_plan_make(c, p, ab, n, m, k)) != CUBLAS_STATUS_SUCCESS) lt_plan_clear(p);
    }
    p->used = ++c->lt_clock;
    if (st == CUBLAS_STATUS_SUCCESS && !p->found) return 0;
    const float alpha = 1.0f;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->la, x, p->lb, &beta, y, p->lc, y, p->lc,
                            &p->algo, c->lt_ws, c->lt_ws_size, c->stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        cu_fail(c, TMX_ERR_DEVICE, "matmul: cuBLASLt: %s", cublasLtGetStatusString(st));
    return 1; /* queued, or the failure recorded: no fallback */
}

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* --- BF16 weights at 9 to 64 tokens: one pass of tensor-core MMAs -------------------------- */

/* A decode step of 9 to 64 sequences is too wide for the GEMV (whose FMAs per weight grow with
 * the tokens) and too narrow for cuBLASLt's split GEMMs, which read the weight twice and cost
 * three launches. Here each weight is read once and multiplied by both halves of the split
 * activations (x = hi + lo, both BF16, as in the GEMMs) with mma.sync m16n8k16, F32 sums.
 *
 * A block of 8 warps computes 32 rows (2 warps along rows, 16 each) for 16 tokens (two n8
 * tiles), its 4 warps along k taking 32 of every 128. Inside a warp's 32, lane (g, t) = (lane
 * / 4, lane % 4) loads 8 contiguous weights of rows g and g + 8 at 8 t, and the k order of the
 * MMA operands is permuted to match: in k-step s, fragment columns 2t, 2t + 1 are weights 8t +
 * 4s + 0, 1 and columns 2t + 8, 2t + 9 are 8t + 4s + 2, 3 (a dot product does not care which
 * order its terms come in, as long as both operands take the same one). The block stages x's
 * fragments in that order, split into hi and lo, once a step in shared memory; the 4 warps
 * along k add their sums in a fixed order, so every run gives the same bits. The grid's x runs
 * over token tiles, so blocks that read the same rows run together and share them in L2. */
#define MMA_ROWS 32   /* weight rows of a block */
#define MMA_TOKENS 16 /* tokens of a block */
#define MMA_KW 4      /* warps along k: a block step takes 32 MMA_KW weights of a row */
#define MMA_MAX_N 64  /* most tokens this path takes */
/* Most columns it takes: on the H200 it made decode steps of 9 to 64 sequences of muse-mini
 * (k <= 1,024) 15-29% faster, and was 2.6-3.5x slower than the split GEMMs at 64 tokens for
 * every weight of 2,048 columns and more (one pass over k per block, no pipelining; the grid's
 * token tiles read the weight again). docs/perf/h200.md, "bf16_mma_kernel and the GEMV's
 * tokens". */
#define MMA_MAX_K 1024

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats' BF16 roundings (hi) and the roundings of what is left (lo), each pair in one
 * word, the first float in the low half: the hardware's paired conversion (round to nearest
 * even, as f32_to_bf16_bits but for NaN payloads), one instruction a pair where the integer
 * rounding took about eight a float and bound the tensor-core GEMV's issue. */
__device__ __forceinline__ void split_pair(float a, float b, uint32_t *hi, uint32_t *lo) {
    uint32_t h, l;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(b), "f"(a));
    const float ra = a - __uint_as_float(h << 16), rb = b - __uint_as_float(h & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(l) : "f"(rb), "f"(ra));
    *hi = h, *lo = l;
}

/* A block step's activations, MMA_XS float4s a thread: element e = threadIdx.x + 256 i is
 * lane e % 32's k-step e / 32 % 2 of tile e / 64 % 2 for warp e / 128 along k. */
#define MMA_XS (MMA_KW * 2 * 2 * 32 / 256)

__device__ __forceinline__ void mma_x_load(float4 (&v)[MMA_XS], const float *x, int n, int k,
                                           int t0, int kb) {
#pragma unroll
    for (int i = 0; i < MMA_XS; i++) {
        const int e = threadIdx.x + 256 * i, el = e % 32, es = e / 32 % 2, ej = e / 64 % 2;
        const int tok = t0 + 8 * ej + el / 4, kx = kb + 32 * (e / 128) + 8 * (el % 4) + 4 * es;
        v[i] = tok < n && kx < k ? *(const float4 *)(x + (int64_t)tok * k + kx)
                                 : make_float4(0, 0, 0, 0);
    }
}

/* The activations of mma_x_load, split into the lanes' B fragments {hi0, hi1, lo0, lo1}. */
__device__ __forceinline__ void mma_x_stage(uint4 (*xb)[2][2][32], const float4 (&v)[MMA_XS]) {
#pragma unroll
    for (int i = 0; i < MMA_XS; i++) {
        const int e = threadIdx.x + 256 * i;
        uint4 f;
        split_pair(v[i].x, v[i].y, &f.x, &f.z);
        split_pair(v[i].z, v[i].w, &f.y, &f.w);
        xb[e / 128][e / 64 % 2][e / 32 % 2][e % 32] = f;
    }
}

/* The lane's 8 weights of rows g and g + 8 in a block step. */
__device__ __forceinline__ void mma_w_load(uint4 &za, uint4 &zb, const uint16_t *wa,
                                           const uint16_t *wb, int k, int kw) {
    za = kw < k ? __ldg((const uint4 *)(wa + kw)) : make_uint4(0, 0, 0, 0);
    zb = kw < k ? __ldg((const uint4 *)(wb + kw)) : make_uint4(0, 0, 0, 0);
}

/* y[n][m] = x[n][k] . w[m][k]^T for BF16 w, k a multiple of 8, x and w 16-byte aligned.
 * Each step's weights and activations are loaded a step ahead, into registers, and the
 * activations staged into one of two buffers, so a step waits at one barrier and its loads'
 * latency passes under the step before (H200, muse-mini's decode at 9-64 sequences: 3-8% more
 * tokens/s than loading and staging each step in turn: docs/perf/h200.md). */
__global__ void __launch_bounds__(256)
bf16_mma_kernel(float *__restrict__ y, const float *__restrict__ x,
                const uint16_t *__restrict__ w, int n, int m, int k) {
    tmx_pdl_enter();
    __shared__ uint4 xb[2][MMA_KW][2][2][32]; /* [buffer][warp along k][tile][k-step][lane] */
    __shared__ float4 red[MMA_KW - 1][2][2][32]; /* [warp along k - 1][warp along rows][tile]
                                                    [lane]: the sums of warps 1.. along k */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int wr = warp % 2, wk = warp / 2;
    const int t0 = blockIdx.x * MMA_TOKENS, r0 = blockIdx.y * MMA_ROWS + 16 * wr;
    /* rows past m read the last one again, never stored */
    const uint16_t *wa = w + (int64_t)min(r0 + g, m - 1) * k;
    const uint16_t *wb = w + (int64_t)min(r0 + g + 8, m - 1) * k;
    const int step = 32 * MMA_KW, kl = 32 * wk + 8 * t; /* the lane's weights in a step */
    float acc[2][4] = {};
    uint4 za, zb, na, nb;
    float4 v[MMA_XS];
    mma_x_load(v, x, n, k, t0, 0);
    mma_w_load(za, zb, wa, wb, k, kl);
    mma_x_stage(xb[0], v);
    mma_x_load(v, x, n, k, t0, step);
    __syncthreads();
    for (int kb = 0, i = 0; kb < k; kb += step, i ^= 1) {
        mma_w_load(na, nb, wa, wb, k, kb + step + kl);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const uint32_t a[4] = {s ? za.z : za.x, s ? zb.z : zb.x, s ? za.w : za.y,
                                   s ? zb.w : zb.y};
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const uint4 b = xb[i][wk][j][s][lane];
                mma_bf16(acc[j], a, b.x, b.y);
                mma_bf16(acc[j], a, b.z, b.w);
            }
        }
        /* the buffer written here was last read a step ago, before its barrier */
        mma_x_stage(xb[i ^ 1], v);
        mma_x_load(v, x, n, k, t0, kb + 2 * step);
        za = na, zb = nb;
        __syncthreads();
    }
    if (wk > 0)
        for (int j = 0; j < 2; j++)
            red[wk - 1][wr][j][lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    __syncthreads();
    if (wk > 0) return;
    for (int j = 0; j < 2; j++) {
        for (int q = 0; q < MMA_KW - 1; q++) {
            const float4 o = red[q][wr][j][lane];
            acc[j][0] += o.x, acc[j][1] += o.y, acc[j][2] += o.z, acc[j][3] += o.w;
        }
        /* c0, c1: row g, tokens 2t and 2t + 1 of the tile; c2, c3: row g + 8 */
        const int tok = t0 + 8 * j + 2 * t;
        for (int h = 0; h < 2; h++) {
            const int row = r0 + g + 8 * h;
            if (row >= m) continue;
            if (tok < n) y[(int64_t)tok * m + row] = acc[j][2 * h];
            if (tok + 1 < n) y[(int64_t)(tok + 1) * m + row] = acc[j][2 * h + 1];
        }
    }
}

/* --- BF16 and MXFP8 weights at 2 to 8 tokens: the GEMV on the tensor cores -------------- */

/* The CUDA-core GEMVs spend an FMA a weight a token, so their time grows with the tokens where
 * the bytes they read do not (q_proj of the 816B model on the H200: 36 us at one token, 92 at
 * eight: docs/perf/h200.md). Here the tensor cores multiply: a block's 8 warps take 16 rows,
 * each warp every 8th chunk of 32 columns, so the block reads 256 contiguous weights of a row
 * a round; lane (g, t) holds 8 contiguous weights of rows g and g + 8 (bf16_mma_kernel's
 * fragment order) and token g's 8 activations at the same columns, split into hi + lo as
 * there, and each chunk is four m16n8k16 MMAs. MXFP8 codes become their BF16 values, exact,
 * and their block's scale (a chunk is one block) multiplies the chunk's sums: a conversion and
 * a byte permute a pair of weights.
 * MV_AHEAD chunks of a lane are loaded before the first is used. The warps' sums meet in
 * shared memory in a fixed order. */
#define MV_WARPS 8 /* warps of a block, all along k */
#define MV_AHEAD 4 /* chunks a lane loads before it multiplies */

/* A lane's weights of one chunk, rows g (a) and g + 8 (b): BF16 as loaded, or MXFP8 codes
 * and the rows' block scales. */
template <bool MX> struct mv_w {
    uint4 a, b;
};
template <> struct mv_w<true> {
    uint2 a, b;
    uint32_t sa, sb;
};

/* The chunk at column c of the lane's rows: BF16 [m][k] from row pointers at the lane's
 * column, or MXFP8 codes likewise and scales [m][k / 32] from the rows' first. */
__device__ __forceinline__ void mv_w_load(mv_w<false> &q, const void *wa, const void *wb,
                                          const uint8_t *, const uint8_t *, int c) {
    q.a = __ldg((const uint4 *)((const uint16_t *)wa + c));
    q.b = __ldg((const uint4 *)((const uint16_t *)wb + c));
}
__device__ __forceinline__ void mv_w_load(mv_w<true> &q, const void *wa, const void *wb,
                                          const uint8_t *sa, const uint8_t *sb, int c) {
    q.a = __ldg((const uint2 *)((const uint8_t *)wa + c));
    q.b = __ldg((const uint2 *)((const uint8_t *)wb + c));
    q.sa = __ldg(sa + c / 32), q.sb = __ldg(sb + c / 32);
}

/* The chunk as BF16 pairs, rows g then g + 8, each pair's first weight in the low half:
 * MXFP8 codes as their values, unscaled (an E4M3 value is an f32 whose low 16 bits are zero, so
 * its BF16 is its top half), the block scales left for the chunk's sums (mv_scale). */
__device__ __forceinline__ void mv_w_bf16(const mv_w<false> &q, uint32_t (&a)[4],
                                          uint32_t (&b)[4]) {
    a[0] = q.a.x, a[1] = q.a.y, a[2] = q.a.z, a[3] = q.a.w;
    b[0] = q.b.x, b[1] = q.b.y, b[2] = q.b.z, b[3] = q.b.w;
}
__device__ __forceinline__ void mv_w_bf16(const mv_w<true> &q, uint32_t (&a)[4],
                                          uint32_t (&b)[4]) {
    const uint32_t codes[4] = {q.a.x, q.a.y, q.b.x, q.b.y};
    float v[16];
    e4m3_to_f32x(codes, v);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        a[j] = __byte_perm(__float_as_uint(v[2 * j]), __float_as_uint(v[2 * j + 1]), 0x7632);
        b[j] = __byte_perm(__float_as_uint(v[8 + 2 * j]), __float_as_uint(v[9 + 2 * j]), 0x7632);
    }
}

/* acc += a chunk's sums s (c0, c1 row g; c2, c3 row g + 8) times the rows' block scales. */
__device__ __forceinline__ void mv_scale(float (&acc)[4], const float (&s)[4],
                                         const mv_w<true> &q) {
    const float fa = ue8m0(q.sa), fb = ue8m0(q.sb);
    acc[0] = fmaf(s[0], fa, acc[0]), acc[1] = fmaf(s[1], fa, acc[1]);
    acc[2] = fmaf(s[2], fb, acc[2]), acc[3] = fmaf(s[3], fb, acc[3]);
}

/* y[n][m] = x[n][k] . w[m][k]^T for 1 <= n <= 8 and BF16 w, k a multiple of 8, or MXFP8 w
 * (codes, then scales: tmx/tensor.h), k a multiple of 32; x and w 16-byte aligned. Its other
 * forms measured on an H100 with BF16 weights (docs/perf/h200.md, "The GEMV on the tensor
 * cores") were each slower on some of the 816B model's weights by 2-50%: 8 chunks ahead and
 * one block an SM, 2 ahead and four blocks, 4 ahead and three blocks, and the next chunks
 * loaded before this batch's MMAs (4 + 4, 2 + 2, 8 + 8). */
template <bool MX>
__global__ void __launch_bounds__(MV_WARPS * 32, 2)
mv_kernel(float *__restrict__ y, const float *__restrict__ x, const void *__restrict__ w, int n,
          int m, int k) {
    tmx_pdl_enter();
    __shared__ float4 red[MV_WARPS - 1][32]; /* [warp - 1][lane]: the sums of warps 1.. */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r0 = blockIdx.x * 16;
    /* rows past m read the last one again, never stored; tokens past n multiply zeros */
    const int64_t ra = min(r0 + g, m - 1), rb = min(r0 + g + 8, m - 1);
    const int size = MX ? 1 : 2; /* bytes a weight */
    const uint8_t *wa = (const uint8_t *)w + (ra * k + 8 * t) * size;
    const uint8_t *wb = (const uint8_t *)w + (rb * k + 8 * t) * size;
    const uint8_t *sc = (const uint8_t *)w + (int64_t)m * k;
    const uint8_t *sa = sc + ra * (k / 32), *sb = sc + rb * (k / 32);
    const float *xg = x + (int64_t)min(g, n - 1) * k + 8 * t;
    const bool tok = g < n;
    const int stride = 32 * MV_WARPS;
    float acc[4] = {};
    for (int kb = 32 * warp; kb < k; kb += MV_AHEAD * stride) {
        mv_w<MX> q[MV_AHEAD];
        float4 x0[MV_AHEAD], x1[MV_AHEAD];
#pragma unroll
        for (int u = 0; u < MV_AHEAD; u++) {
            const int c = kb + u * stride; /* the chunk's first column */
            const bool in = c + 8 * t < k;
            if (in) mv_w_load(q[u], wa, wb, sa, sb, c);
            else q[u] = mv_w<MX>{};
            x0[u] = in && tok ? *(const float4 *)(xg + c) : make_float4(0, 0, 0, 0);
            x1[u] = in && tok ? *(const float4 *)(xg + c + 4) : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < MV_AHEAD; u++) {
            uint32_t za[4], zb[4];
            mv_w_bf16(q[u], za, zb);
            float sums[4] = {}; /* MXFP8: the chunk's, one block a row */
            float(&d)[4] = MX ? sums : acc;
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const float4 v = s ? x1[u] : x0[u];
                uint32_t h01, h23, l01, l23;
                split_pair(v.x, v.y, &h01, &l01);
                split_pair(v.z, v.w, &h23, &l23);
                const uint32_t a[4] = {za[2 * s], zb[2 * s], za[2 * s + 1], zb[2 * s + 1]};
                mma_bf16(d, a, h01, h23);
                mma_bf16(d, a, l01, l23);
            }
            if constexpr (MX) mv_scale(acc, sums, q[u]);
        }
    }
    if (warp > 0) red[warp - 1][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (warp > 0) return;
    for (int q = 0; q < MV_WARPS - 1; q++) {
        const float4 o = red[q][lane];
        acc[0] += o.x, acc[1] += o.y, acc[2] += o.z, acc[3] += o.w;
    }
    /* c0, c1: row g, tokens 2t and 2t + 1; c2, c3: row g + 8 */
    for (int h = 0; h < 2; h++) {
        const int row = r0 + g + 8 * h;
        if (row >= m) continue;
        if (2 * t < n) y[(int64_t)(2 * t) * m + row] = acc[2 * h];
        if (2 * t + 1 < n) y[(int64_t)(2 * t + 1) * m + row] = acc[2 * h + 1];
    }
}

/* A weight large enough to leave the GEMV at a few tokens: at least 4,096 rows (fewer leave
 * SMs idle in the tensor-core GEMV's 16-row blocks and run slower on the split GEMMs) and 2,048
 * columns. */
static bool gemv_large(int m, int k) { return m >= 4096 && k >= 2048; }

/* Whether mv_kernel takes this matmul: 2 to 8 tokens of a weight of at least 4,096 rows and
 * 2,048 columns, BF16 with option bf16_mv or MXFP8 with option mx_mv (both on: on an H200
 * 1.65-2.64x and 1.18-4.1x faster than the GEMV or the split GEMMs for the 816B model's
 * q_proj, o_proj and lm_head, whole and per TP-4 rank: docs/perf/h200.md). One token stays on
 * the GEMVs until a conformance case of one token and such a weight has run this kernel on a
 * GPU (an H100 timed it 1.2-2.7x faster there). */
static bool mv_fits(const struct cu_ctx *c, const float *x, const struct tmx_tensor *w, int n) {
    const int m = (int)w->shape[0], k = (int)w->shape[1];
    const bool on = w->dtype == TMX_DTYPE_BF16    ? c->bf16_mv && k % 8 == 0
                    : w->dtype == TMX_DTYPE_MXFP8 ? c->mx_mv
                                                  : false;
    const void *wd = w->data;
    return on && n >= 2 && n <= 8 && gemv_large(m, k) && k <= INT32_MAX / 2 &&
           aligned16(x, &wd, 1); /* its column indices, ints, run MV_AHEAD rounds past k */
}

static void mv(struct cu_ctx *c, float *y, const float *x, const struct tmx_tensor *w, int n) {
    const int m = (int)w->shape[0], k = (int)w->shape[1];
    const dim3 grid((unsigned)((m + 15) / 16));
    if (w->dtype == TMX_DTYPE_MXFP8)
        cu_launch(c, mv_kernel<true>, grid, MV_WARPS * 32, 0, y, x, w->data, n, m, k);
    else
        cu_launch(c, mv_kernel<false>, grid, MV_WARPS * 32, 0, y, x, w->data, n, m, k);
}

/* Whether bf16_mma_kernel takes this BF16 matmul (option bf16_mma, on). */
static bool bf16_mma_fits(const struct cu_ctx *c, const float *x, const void *w, int n, int k) {
    return c->bf16_mma && n > 8 && n <= MMA_MAX_N && k <= MMA_MAX_K && k % 8 == 0 &&
           aligned16(x, &w, 1);
}

/* Whether a BF16 matmul of n <= 8 tokens leaves the GEMV for the split GEMMs: a weight of at
 * least 4,096 rows and 2,048 columns past option gemv_max tokens (H200, n = 4 and 8: 1.2-1.9x
 * faster for q_proj, o_proj, lm_head and TP-4's o_proj and lm_head; at 2 tokens no faster, for
 * fewer rows slower: docs/perf/h200.md). */
static bool bf16_gemv_leaves(const struct cu_ctx *c, int n, int m, int k) {
    return n > c->gemv_max && gemv_large(m, k);
}

static void bf16_mma(struct cu_ctx *c, float *y, const float *x, const void *w, int n, int m,
                     int k) {
    const dim3 grid((unsigned)((n + MMA_TOKENS - 1) / MMA_TOKENS),
                    (unsigned)((m + MMA_ROWS - 1) / MMA_ROWS));
    cu_launch(c, bf16_mma_kernel, grid, 256, 0, y, x, (const uint16_t *)w, n, m, k);
}

/* BF16 weights, n > 8: the hi/lo split into s (scratch of 2 align256(2 n k) bytes), then two
 * GEMMs into y. */
static int lt_matmul_bf16(struct cu_ctx *c, char *s, float *y, const float *x, const void *w,
                          int n, int m, int k) {
    int64_t count = (int64_t)n * k;
    size_t half = align256((size_t)count * 2);
    __nv_bfloat16 *hi = (__nv_bfloat16 *)s, *lo = (__nv_bfloat16 *)(s + half);
    cu_launch(c, split_bf16_kernel, blocks_for(count, 256), 256, 0, hi, lo, x, count);
    if (!cu_check_launch(c, "matmul")) return 1;
    if (!lt_matmul(c, CUDA_R_16BF, w, hi, y, n, m, k, 0.0f)) return 0;
    if (!lt_matmul(c, CUDA_R_16BF, w, lo, y, n, m, k, 1.0f))
        cu_fail(c, TMX_ERR_DEVICE, "matmul: cuBLASLt has no algorithm for the lo half of a split GEMM");
    return 1;
}

/* A matmul weight: F32/BF16/F16 (cu_check_weight) or one imported as MXFP8, its sizes within an
 * int. 0 (failure recorded against op) otherwise. */
static int check_matmul(struct cu_ctx *c, const char *op, const struct tmx_tensor *w, int n) {
    const int mx = w && w->data && w->dtype == TMX_DTYPE_MXFP8; /* weight_import checked it */
    if (!mx && !cu_check_weight(c, op, "weight", w, 2, 0, 0)) return 0;
    if (n >= 0 && w->shape[0] <= INT32_MAX && w->shape[1] <= INT32_MAX) return 1;
    cu_fail(c, TMX_ERR_INVALID, "%s: n = %d, weight [%lld][%lld]", op, n, (long long)w->shape[0],
            (long long)w->shape[1]);
    return 0;
}

extern "C" void cu_matmul(void *ctx, float *y, const float *x, const struct tmx_tensor *w, int n) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "matmul") || !check_matmul(c, "matmul", w, n) || n == 0) return;
    int m = (int)w->shape[0], k = (int)w->shape[1];
    const void *wd = w->data;
    const size_t split = 2 * align256((size_t)n * k * 2); /* the hi/lo split's scratch */
    if (mv_fits(c, x, w, n)) {
        mv(c, y, x, w, n);
        cu_check_launch(c, "matmul");
        return;
    }
    if (w->dtype == TMX_DTYPE_MXFP8) {
        if (n <= 8) {
            mxfp8_gemv(c, &y, x, &wd, &m, 1, n, k);
        } else { /* the BF16 values after the split's scratch, then as a BF16 weight */
            const int64_t count = (int64_t)m * k;
            char *s = (char *)cu_scratch(c, split + align256((size_t)count * 2), "matmul");
            if (!s) return;
            const void *wb = s + split;
            cu_launch(c, mxfp8_to_bf16_kernel, blocks_for(count / 16, 256), 256, 0, (uint4 *)wb,
                      (const uint4 *)w->data, count);
            if (!cu_check_launch(c, "matmul")) return;
            if (bf16_mma_fits(c, x, wb, n, k)) {
                bf16_mma(c, y, x, wb, n, m, k);
                cu_check_launch(c, "matmul");
                return;
            }
            if (lt_matmul_bf16(c, s, y, x, wb, n, m, k)) return;
            gemv<TMX_DTYPE_BF16>(c, &y, x, &wb, &m, 1, n, k);
        }
        cu_check_launch(c, "matmul");
        return;
    }
    if (n > 8 && w->dtype == TMX_DTYPE_F32 && lt_matmul(c, CUDA_R_32F, wd, x, y, n, m, k, 0))
        return;
    if (w->dtype == TMX_DTYPE_BF16 && bf16_mma_fits(c, x, wd, n, k)) {
        bf16_mma(c, y, x, wd, n, m, k);
        cu_check_launch(c, "matmul");
        return;
    }
    if ((n > 8 || bf16_gemv_leaves(c, n, m, k)) && w->dtype == TMX_DTYPE_BF16) {
        char *s = (char *)cu_scratch(c, split, "matmul");
        if (!s || lt_matmul_bf16(c, s, y, x, wd, n, m, k)) return;
    }
    CU_DISPATCH_W(w->dtype, gemv<DT>(c, &y, x, &wd, &m, 1, n, k));
    cu_check_launch(c, "matmul");
}

/* Decode (n <= 8): the weights the tensor-core GEMV takes one launch each, the others of one
 * dtype one GEMV launch for them all, which saves launches and fills the GPU where each alone
 * would not (a TP rank's k_proj and v_proj, 512 rows each; the full model's k and v beside a
 * q_proj on the tensor cores). Otherwise, and where one of them takes cuBLASLt, one matmul
 * each. */
extern "C" void cu_matmul_multi(void *ctx, float *const *ys, const float *x,
                                const struct tmx_tensor *const *ws, int count, int n) {
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (!cu_enter(c, "matmul_multi")) return;
    if (count < 1 || count > GEMV_MAX) {
        cu_fail(c, TMX_ERR_INVALID, "matmul_multi: %d weights, want 1 to %d", count, GEMV_MAX);
        return;
    }
    int m[GEMV_MAX], rest = 0, one = n > 0 && n <= 8; /* rest: the GEMV's weights, in order */
    bool on_mv[GEMV_MAX];
    const void *w[GEMV_MAX];
    float *yr[GEMV_MAX];
    enum tmx_dtype dt = TMX_DTYPE_F32;
    for (int i = 0; i < count; i++) {
        if (!check_matmul(c, "matmul_multi", ws[i], n)) return;
        if (ws[i]->shape[1] != ws[0]->shape[1]) {
            cu_fail(c, TMX_ERR_INVALID, "matmul_multi: weight %d has %lld columns, weight 0 %lld",
                    i, (long long)ws[i]->shape[1], (long long)ws[0]->shape[1]);
            return;
        }
        if ((on_mv[i] = mv_fits(c, x, ws[i], n))) continue;
        if (rest == 0) dt = ws[i]->dtype;
        m[rest] = (int)ws[i]->shape[0];
        w[rest] = ws[i]->data;
        yr[rest] = ys[i];
        one &= ws[i]->dtype == dt &&
               !(dt == TMX_DTYPE_BF16 && bf16_gemv_leaves(c, n, m[rest], (int)ws[i]->shape[1]));
        rest++;
    }
    if (!one) {
        for (int i = 0; i < count; i++) cu_matmul(ctx, ys[i], x, ws[i], n);
        return;
    }
    for (int i = 0; i < count; i++)
        if (on_mv[i]) mv(c, ys[i], x, ws[i], n);
    const int k = (int)ws[0]->shape[1];
    if (rest && dt == TMX_DTYPE_MXFP8) mxfp8_gemv(c, yr, x, w, m, rest, n, k);
    else if (rest) CU_DISPATCH_W(dt, gemv<DT>(c, yr, x, w, m, rest, n, k));
    cu_check_launch(c, "matmul_multi");
}
