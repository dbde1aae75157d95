/* mm.cuh: the fused expert matmul (decode + block scales + MMA) and its launch, shared by
 * mm.cu (the kernels) and moe.cu (the expert block). */
#ifndef TMX_TRELLIS_MM_CUH
#define TMX_TRELLIS_MM_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "tmx/cuda-pdl.cuh"

/* kernel<<<grid, block, smem, s>>>(args...), programmatic (tmx/cuda-pdl.cuh) while s is being
 * recorded into a graph (a decode step), as the CUDA kernel set launches: every kernel of the
 * expert block begins with tmx_pdl_enter. Eager launches keep the plain order. */
template <typename... P, typename... A>
static inline cudaError_t trellis_launch(void (*kernel)(P...), dim3 grid, dim3 block,
                                         size_t smem, cudaStream_t s, A... args) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    const cudaError_t e = cudaStreamIsCapturing(s, &capturing);
    if (e != cudaSuccess) return e;
    return tmx_cuda_launch(kernel, grid, block, smem, s,
                           capturing == cudaStreamCaptureStatusActive, args...);
}

#define MM_WARPS 4  /* strips of 16 rows per CTA, one per warp */
#define MM_CHUNK 16 /* tiles of a strip staged at a time: 256 inputs */

/* One launch: y = Q x for the groups of tokens of one or two matrices (blockIdx.z: gate and
 * up share their inputs). A group is up to MM_GROUP_* tokens of one expert. */
struct mm_params {
    const uint32_t *words[2]; /* [E][rows/16][cols/16][8K] */
    const uint8_t *scales[2]; /* [E][rows][cols/block] E4M3 */
    const float *g[2];        /* [E] */
    float *y[2];              /* [slots][rows] */
    int rows, cols;
    /* Groups: groups[*n_groups] (expert, first slot, count); or, groups NULL, every expert
     * has m slots in a row (slot = expert * m + i). */
    const int4 *groups;
    const int *n_groups;
    int m;
    const int *act_row;       /* [slots]: the activation row of each slot; NULL: the slot */
    const uint8_t *x;         /* [rows of x][cols] kappa order */
    const float *xa;          /* [rows of x] token scales */
    const float *xb;          /* law e2m1: [rows of x][cols/16] block scale values */
    const uint8_t *lut;       /* law e2m1: [TRELLIS_LUT] */
    /* The wide GEMM: scratch the launch fills with x staged as f16 first (stage_kernel). */
    uint32_t *x16;            /* [x_rows][cols / 2] */
    int x_rows;
};

/* Tokens per group: the GEMV (mm_kernel, NG = 1), the grouped GEMM (NG = 8) and the wide
 * GEMM (mm_wide_kernel, each tile decoded once for 128 or 256 tokens). */
#define MM_GROUP_SMALL 8
#define MM_GROUP_LARGE 64
#define MM_GROUP_WIDE 128
#define MM_GROUP_WIDER 256
#define MM_WIDE_FROM 128  /* tokens an expert on average from which the wide GEMM runs */
#define MM_WIDE_FROM_E2M1 64 /* law e2m1's: the --groups table's crossover is lower */
#define MM_WIDER_FROM 256 /* and its groups of 256 */

/* Bytes of the scratch x16 for x_rows rows of `cols` inputs in groups of `group` tokens. */
static inline size_t trellis_mm_x16_bytes(int group, size_t x_rows, int cols) {
    return group >= MM_GROUP_WIDE ? x_rows * (size_t)cols * 2 : 0;
}

/* Queues y = Q x on `stream` for n_mats (1, 2) matrices and up to max_groups groups of
 * `group` (MM_GROUP_SMALL, _LARGE, _WIDE or _WIDER) tokens. */
cudaError_t trellis_mm_launch(int fp4, int K, int group, const mm_params &p, int n_mats,
                              int max_groups, cudaStream_t stream);

#endif
