/* cuda-dev.cuh: device helpers shared by the .cu files: weight loads by dtype, the number
 * formats of the KV cache, warp and block reductions, the device error flag, launch dispatch. */
#ifndef TMX_KERNELS_CUDA_DEV_CUH
#define TMX_KERNELS_CUDA_DEV_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda-set.h"
#include "tmx/cuda-pdl.cuh"

/* Weight dtypes as template arguments: the load compiles to one instruction per dtype. */
template <int DT> __device__ __forceinline__ float load_w(const void *p, int64_t i);

template <> __device__ __forceinline__ float load_w<TMX_DTYPE_F32>(const void *p, int64_t i) {
    return __ldg((const float *)p + i);
}
template <> __device__ __forceinline__ float load_w<TMX_DTYPE_BF16>(const void *p, int64_t i) {
    return __uint_as_float((uint32_t)__ldg((const unsigned short *)p + i) << 16);
}
template <> __device__ __forceinline__ float load_w<TMX_DTYPE_F16>(const void *p, int64_t i) {
    return __half2float(__ldg((const __half *)p + i));
}

/* kernel<<<grid, block, smem, c->stream>>>(args...); in a recorded graph (the core records
 * decode steps) programmatic (c->pdl, tmx/cuda-pdl.cuh): every kernel of this set begins with
 * tmx_pdl_enter. Eager launches (prefill, whose kernels are long) keep the plain order: one
 * muse-mini prefill with every launch programmatic gained nothing (6,819 tok/s against 8,331,
 * within the spread of repeated prefills). cu_check_launch reports a failed launch. */
template <typename... P, typename... A>
static inline void cu_launch(const struct cu_ctx *c, void (*kernel)(P...), dim3 grid,
                             dim3 block, size_t smem, A... args) {
    tmx_cuda_launch(kernel, grid, block, smem, c->stream, c->pdl && c->capturing, args...);
}

/* Calls F<DT>(args...) for a weight dtype known only at run time. */
#define CU_DISPATCH_W(dt, call)                                                               \
    do {                                                                                      \
        switch (dt) {                                                                         \
        case TMX_DTYPE_BF16: { constexpr int DT = TMX_DTYPE_BF16; call; break; }              \
        case TMX_DTYPE_F16: { constexpr int DT = TMX_DTYPE_F16; call; break; }                \
        default: { constexpr int DT = TMX_DTYPE_F32; call; break; }                           \
        }                                                                                     \
    } while (0)

/* f32 -> bf16, round to nearest even, NaN kept quiet: bit for bit tmx_f32_to_bf16. */
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f32 -> E4M3, round to nearest even, saturating at +-448: bit for bit tmx_f32_to_e4m3. */
__device__ __forceinline__ uint8_t f32_to_e4m3_bits(float f) {
    uint32_t u = __float_as_uint(f);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f;
    float a = fabsf(f);
    if (!(a < 464.0f)) return sign | 0x7e;
    if (a < 0.015625f) { /* subnormal: multiples of 2^-9 */
        float q = a * 512.0f;
        float r = (float)(int)q;
        float d = q - r;
        int m = (int)r + (d > 0.5f || (d == 0.5f && ((int)r & 1)));
        return sign | (uint8_t)m;
    }
    u = __float_as_uint(a);
    const uint32_t lsb = (u >> 20) & 1u;
    u += 0x7ffffu + lsb;
    const int e = (int)(u >> 23) - 127 + 7;
    const uint8_t m = (uint8_t)((u >> 20) & 7u);
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(e << 3) | m;
}

/* E4M3 -> f32: bit for bit tmx_e4m3_to_f32. */
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    float v;
    if (exp == 0xf && man == 7)
        v = __int_as_float(0x7fc00000);
    else if (exp == 0)
        v = (float)man * (1.0f / 512.0f);
    else
        v = __uint_as_float(((exp + 120u) << 23) | (man << 20)); /* (1 + man/8) * 2^(exp-7) */
    return (b & 0x80u) ? -v : v;
}

/* Sum / max over the 32 lanes of a warp; every lane gets the result. */
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets
 * the result. `red` is __shared__ T[32]. */
template <typename T> __device__ __forceinline__ T block_sum(T v, T *red) {
    v = warp_sum(v);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    __syncthreads(); /* red may hold a previous call's values */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : T(0);
    return warp_sum(v);
}

/* A block's row xr normed into yr. The row is read twice (sum of squares, then scale): it is
 * in L1/L2 by then, and yr may alias xr since each element is read before it is written by
 * its thread. Thread i takes elements i, i + blockDim.x, ... (add_rmsnorm and qk_norm_rope
 * rely on it). */
template <int DT>
__device__ __forceinline__ void rms_row(float *yr, const float *xr, const void *w, int d,
                                        float eps, float *red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = __fmaf_rn(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        yr[i] = xr[i] * inv * (w ? load_w<DT>(w, i) : 1.0f);
}

/* Threads of a block that norms rows of d. */
static inline int rms_threads(int d) { return d >= 1024 ? 1024 : (d + 31) / 32 * 32; }

/* Flags a bad value found in a device buffer; the first flag wins, sync reports it. */
__device__ __forceinline__ void flag(int *dev_err, enum cu_dev_err code) {
    atomicCAS(dev_err, 0, (int)code);
}

static inline unsigned blocks_for(int64_t count, int per_block) {
    return (unsigned)((count + per_block - 1) / per_block);
}

#endif
