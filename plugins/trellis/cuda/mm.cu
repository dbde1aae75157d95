/* mm.cu: the fused expert matmul and the decode check.
 *
 * A CTA computes MM_WARPS strips of 16 output rows of one expert's matrix for one group of up
 * to 8 * NG tokens. Each warp streams its strip's tiles through shared memory, MM_CHUNK tiles
 * at a time (the next chunk is in flight in registers while this one is decoded), and the
 * CTA stages the group's activations for the same 256 inputs. Per 32 inputs (two tiles) a
 * lane decodes its four A registers once and multiplies them with every 8 tokens of the
 * group: one m16n8k32 E4M3 MMA per 8 tokens, accumulated from zero, then scaled in FP32 by the
 * block scales (law e4m3: one block of 32 per MMA; law e2m1: two MMAs, one per tile, each
 * scaled by the weight's and the activation's block scale of 16). The matrix scale g and the
 * token scale multiply once at the end. */
#include "decode.cuh"
#include "mm.cuh"
#include "trellis_cuda.h"

#include <stdio.h>

#define CHUNK_COLS (16 * MM_CHUNK)
#define X_STRIDE (CHUNK_COLS / 4 + 4) /* words per staged token row; +4 spreads the banks */

struct mm_group {
    int expert, first, count;
};

__device__ __forceinline__ bool group_of(const mm_params &p, int gi, int cap, mm_group &out) {
    if (p.groups) {
        if (gi >= *p.n_groups) return false;
        const int4 g = p.groups[gi];
        out = {g.x, g.y, g.z};
        return true;
    }
    const int per = (p.m + cap - 1) / cap, i = gi % per;
    out = {gi / per, gi / per * p.m + i * cap, min(cap, p.m - i * cap)};
    return true;
}

/* A lane's K uint4 of a chunk of `tiles` tiles (8K words each), zeros past its end. */
template <int K>
__device__ __forceinline__ void load_chunk(uint4 (&pre)[K], const uint4 *src, int tiles,
                                           int lane) {
    const int n = tiles * 2 * K; /* uint4 in the chunk: tiles * 8K words / 4 */
#pragma unroll
    for (int i = 0; i < K; i++)
        pre[i] = i * 32 + lane < n ? src[i * 32 + lane] : make_uint4(0, 0, 0, 0);
}

template <int K, bool FP4, int NG>
__global__ void __launch_bounds__(MM_WARPS * 32) mm_kernel(const mm_params p) {
    constexpr int NW = 8 * K, GT = 8 * NG, BLOCK = FP4 ? 16 : 32;
    constexpr int SW = CHUNK_COLS / BLOCK / 4; /* scale words of a row per chunk: 2 or 4 */
    __shared__ uint4 w_s[MM_WARPS][MM_CHUNK * NW / 4];  /* [warp][tile][8K] words */
    __shared__ __align__(16) uint32_t x_s[GT][X_STRIDE];  /* [token][kappa bytes / 4] */
    __shared__ float xb_s[FP4 ? GT : 1][CHUNK_COLS / 16];
    __shared__ uint8_t lut_s[FP4 ? TRELLIS_LUT : 1];
    __shared__ int row_s[GT];

    mm_group grp;
    if (!group_of(p, blockIdx.y, GT, grp)) return;
    const int z = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int strip = blockIdx.x * MM_WARPS + warp, tiles_c = p.cols / 16;
    for (int t = threadIdx.x; t < GT; t += blockDim.x)
        row_s[t] = t >= grp.count ? -1
                   : p.act_row ? p.act_row[grp.first + t] : grp.first + t;
    if (FP4)
        for (int i = threadIdx.x; i < TRELLIS_LUT; i += blockDim.x) lut_s[i] = p.lut[i];

    const uint4 *wsrc = reinterpret_cast<const uint4 *>(
        p.words[z] + ((size_t)grp.expert * (p.rows / 16) + strip) * tiles_c * NW);
    const int spr = p.cols / BLOCK; /* scales per row */
    const uint32_t *sc0 = reinterpret_cast<const uint32_t *>(
        p.scales[z] + ((size_t)grp.expert * p.rows + 16 * strip + g) * spr);
    const uint32_t *sc1 = sc0 + 8 * spr / 4;
    const lane_window lw = lane_window_of<K>(lane);

    /* The last chunk may be short: cols is a multiple of 128 (the Hadamard blocks), so a
     * chunk holds MM_CHUNK or MM_CHUNK / 2 tiles; nothing past a row's end is read. */
    const int n_chunks = (tiles_c + MM_CHUNK - 1) / MM_CHUNK;
    float acc[NG][4] = {};
    uint4 pre[K]; /* the next chunk of the warp's strip: K uint4 a lane */
    load_chunk<K>(pre, wsrc, min(tiles_c, MM_CHUNK), lane);

    for (int c = 0; c < n_chunks; c++) {
        const int tc = min(MM_CHUNK, tiles_c - c * MM_CHUNK); /* tiles in this chunk */
        __syncthreads(); /* the previous chunk is consumed (and row_s, lut_s are written) */
#pragma unroll
        for (int i = 0; i < K; i++) w_s[warp][i * 32 + lane] = pre[i];
        for (int i = threadIdx.x; i < GT * (CHUNK_COLS / 16); i += blockDim.x) {
            const int t = i / (CHUNK_COLS / 16), u = i % (CHUNK_COLS / 16), r = row_s[t];
            const bool in = r >= 0 && u < tc;
            const uint4 v = !in ? make_uint4(0, 0, 0, 0)
                                : reinterpret_cast<const uint4 *>(
                                      p.x + (size_t)r * p.cols + c * CHUNK_COLS)[u];
            *reinterpret_cast<uint4 *>(&x_s[t][4 * u]) = v;
            if (FP4) xb_s[t][u] = !in ? 0.0f : p.xb[(size_t)r * (p.cols / 16) + c * 16 + u];
        }
        uint32_t s0[SW], s1[SW]; /* block scale bytes of rows g, g + 8 for this chunk */
        const int sw = tc * 16 / BLOCK / 4;                  /* of them in this chunk */
#pragma unroll
        for (int i = 0; i < SW; i++) {
            s0[i] = i < sw ? sc0[c * SW + i] : 0u;
            s1[i] = i < sw ? sc1[c * SW + i] : 0u;
        }
        __syncthreads();
        if (c + 1 < n_chunks)
            load_chunk<K>(pre, wsrc + (size_t)(c + 1) * K * 32,
                          min(MM_CHUNK, tiles_c - (c + 1) * MM_CHUNK), lane);

        const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[warp]);
#pragma unroll
        for (int st = 0; st < MM_CHUNK / 2; st++) { /* 32 inputs: tiles 2st, 2st + 1 */
            if (2 * st >= tc) break;
            uint32_t a0, a1, a2, a3;
            lane_codes<K, FP4>(tw + 2 * st * NW, lw, lut_s, a0, a1);
            lane_codes<K, FP4>(tw + (2 * st + 1) * NW, lw, lut_s, a2, a3);
            if (!FP4) {
                const float w0 = e4m3_value(s0[st >> 2] >> (8 * (st & 3)) & 0xff);
                const float w1 = e4m3_value(s1[st >> 2] >> (8 * (st & 3)) & 0xff);
#pragma unroll
                for (int n = 0; n < NG; n++) {
                    if (8 * n >= grp.count) break; /* no tokens left in the group */
                    float d[4];
                    mma_e4m3(d, a0, a1, a2, a3, x_s[8 * n + g][8 * st + q],
                             x_s[8 * n + g][8 * st + 4 + q]);
                    acc[n][0] += w0 * d[0];
                    acc[n][1] += w0 * d[1];
                    acc[n][2] += w1 * d[2];
                    acc[n][3] += w1 * d[3];
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; h++) { /* tile 2st + h: block 2st + h of 16 */
                    const int b = 2 * st + h;
                    const float w0 = e4m3_value(s0[b >> 2] >> (8 * (b & 3)) & 0xff);
                    const float w1 = e4m3_value(s1[b >> 2] >> (8 * (b & 3)) & 0xff);
#pragma unroll
                    for (int n = 0; n < NG; n++) {
                        if (8 * n >= grp.count) break;
                        float d[4];
                        mma_e4m3(d, h ? 0u : a0, h ? 0u : a1, h ? a2 : 0u, h ? a3 : 0u,
                                 x_s[8 * n + g][8 * st + q], x_s[8 * n + g][8 * st + 4 + q]);
                        const float x0 = xb_s[8 * n + 2 * q][b], x1 = xb_s[8 * n + 2 * q + 1][b];
                        acc[n][0] += w0 * x0 * d[0];
                        acc[n][1] += w0 * x1 * d[1];
                        acc[n][2] += w1 * x0 * d[2];
                        acc[n][3] += w1 * x1 * d[3];
                    }
                }
            }
        }
    }

    const float gs = p.g[z][grp.expert];
    const int r0 = 16 * strip + g;
#pragma unroll
    for (int n = 0; n < NG; n++)
#pragma unroll
        for (int i = 0; i < 2; i++) { /* accumulator columns 2q, 2q + 1: two tokens */
            const int t = 8 * n + 2 * q + i;
            if (t >= grp.count) continue;
            const float s = gs * p.xa[row_s[t]];
            float *y = p.y[z] + (size_t)(grp.first + t) * p.rows;
            y[r0] = acc[n][i] * s;
            y[r0 + 8] = acc[n][2 + i] * s;
        }
}

template <int K, bool FP4>
static cudaError_t launch_k(int group, const mm_params &p, dim3 grid, cudaStream_t stream) {
    if (group == MM_GROUP_SMALL)
        mm_kernel<K, FP4, MM_GROUP_SMALL / 8><<<grid, MM_WARPS * 32, 0, stream>>>(p);
    else
        mm_kernel<K, FP4, MM_GROUP_LARGE / 8><<<grid, MM_WARPS * 32, 0, stream>>>(p);
    return cudaGetLastError();
}

template <bool FP4>
static cudaError_t launch_law(int K, int group, const mm_params &p, dim3 grid,
                              cudaStream_t stream) {
    switch (K) {
    case 2: return launch_k<2, FP4>(group, p, grid, stream);
    case 3: return launch_k<3, FP4>(group, p, grid, stream);
    case 4: return launch_k<4, FP4>(group, p, grid, stream);
    case 5: return launch_k<5, FP4>(group, p, grid, stream);
    case 6: return launch_k<6, FP4>(group, p, grid, stream);
    default: return cudaErrorInvalidValue;
    }
}

cudaError_t trellis_mm_launch(int fp4, int K, int group, const mm_params &p, int n_mats,
                              int max_groups, cudaStream_t stream) {
    if (max_groups <= 0) return cudaSuccess;
    const dim3 grid(p.rows / (16 * MM_WARPS), max_groups, n_mats);
    return fp4 ? launch_law<true>(K, group, p, grid, stream)
               : launch_law<false>(K, group, p, grid, stream);
}

/* --- the decode check ------------------------------------------------------------------- */

template <int K, bool FP4>
__global__ void decode_kernel(const uint32_t *words, int n_tiles, const uint8_t *lut,
                              uint8_t *out) {
    constexpr int NW = 8 * K;
    __shared__ uint32_t w_s[NW];
    __shared__ uint8_t lut_s[FP4 ? TRELLIS_LUT : 1];
    const int lane = threadIdx.x;
    if (FP4)
        for (int i = lane; i < TRELLIS_LUT; i += 32) lut_s[i] = lut[i];
    const lane_window lw = lane_window_of<K>(lane);
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        __syncwarp();
        for (int i = lane; i < NW; i += 32) w_s[i] = words[(size_t)t * NW + i];
        __syncwarp();
        uint32_t a0, a1;
        lane_codes<K, FP4>(w_s, lw, lut_s, a0, a1);
        reinterpret_cast<uint2 *>(out + (size_t)t * 256)[lane] = make_uint2(a0, a1);
    }
}

template <bool FP4>
static cudaError_t decode_law(int K, const uint32_t *words, int n_tiles, const uint8_t *lut,
                              uint8_t *out, cudaStream_t stream) {
    const int blocks = n_tiles < 4096 ? n_tiles : 4096;
    switch (K) {
    case 2: decode_kernel<2, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 3: decode_kernel<3, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 4: decode_kernel<4, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 5: decode_kernel<5, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 6: decode_kernel<6, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

/* Writes "what: CUDA error" to msg and returns 1, or 0 for cudaSuccess. */
static int failed(cudaError_t e, const char *what, char *msg, size_t size) {
    if (e == cudaSuccess) return 0;
    snprintf(msg, size, "%s: %s", what, cudaGetErrorString(e));
    return 1;
}

extern "C" int trellis_cuda_decode_tiles(int fp4, int K, const uint8_t *lut_host,
                                         const uint32_t *words, int n_tiles, uint8_t *out,
                                         void *stream, char *msg, size_t size) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    uint8_t *lut = NULL;
    if (fp4 && (failed(cudaMallocAsync(&lut, TRELLIS_LUT, s), "decode: cudaMallocAsync", msg,
                       size) ||
                failed(cudaMemcpyAsync(lut, lut_host, 1021, cudaMemcpyHostToDevice, s),
                       "decode: copy of the table", msg, size)))
        return 1;
    cudaError_t e = fp4 ? decode_law<true>(K, words, n_tiles, lut, out, s)
                        : decode_law<false>(K, words, n_tiles, lut, out, s);
    if (lut && e == cudaSuccess) e = cudaFreeAsync(lut, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    return failed(e, "decode", msg, size);
}

extern "C" int trellis_cuda_matmul(int fp4, int K, const uint8_t *lut, const uint32_t *words,
                                   const uint8_t *scales, const float *g, int n_experts,
                                   int rows, int cols, const uint8_t *x, const float *a,
                                   const float *xb, int m, float *y, void *stream, char *msg,
                                   size_t size) {
    if (rows % 128 || cols % 128 || m < 1 || n_experts < 1) {
        snprintf(msg, size, "matmul: [%d][%d] x %d tokens of %d experts", rows, cols, m,
                 n_experts);
        return 1;
    }
    mm_params p = {};
    p.words[0] = words;
    p.scales[0] = scales;
    p.g[0] = g;
    p.y[0] = y;
    p.rows = rows;
    p.cols = cols;
    p.m = m;
    p.x = x;
    p.xa = a;
    p.xb = xb;
    p.lut = lut;
    const int group = m <= MM_GROUP_SMALL ? MM_GROUP_SMALL : MM_GROUP_LARGE;
    return failed(trellis_mm_launch(fp4, K, group, p, 1, n_experts * ((m + group - 1) / group),
                                    static_cast<cudaStream_t>(stream)),
                  "matmul", msg, size);
}
