/* trellis_cuda.h: the TrellisMX codecs on a CUDA device (docs/trellismx.md, docs/perf/h200-codec.md).
 *
 * The device path of codec.trellis-e4m3 and codec.trellis-fp4: a layer's experts copied to the
 * GPU, decoded tile by tile inside the expert matmuls, never to memory. Lane l of a warp
 * decodes trellis positions 8l..8l+7 of a tile (§2) straight into its A fragment of an f16
 * mma.m16n8k16 (decode.cuh): a tile's 16 rows are the MMA's 16 rows and up to 8 tokens its 8
 * columns; law e2m1 takes the same path, its E2M1 values being f16 values too. The quantized
 * activations are stored in "kappa order" (within 32 inputs, k = 16h + 4q + i holds input
 * 16h + 2q + (i & 1) + 8(i >> 1), the B-fragment order of an m16n8k32 FP8 MMA), and the
 * matmul stages them into the column order the decoded fragments come out in ("lambda
 * order", decode.cuh), so the weights need no shuffle.
 *
 * C interface for plugins/trellis/cuda/codec_device.c and the bench; the .cu files implement
 * it. Functions that can fail return 0 or 1 with a one-line reason in msg[size]. Pointers
 * named "host" are host memory; every other array is device memory. */
#ifndef TMX_TRELLIS_CUDA_H
#define TMX_TRELLIS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One MoE layer as the host holds it (struct trellis_layer), flattened. */
struct trellis_cuda_layer_desc {
    int fp4;                        /* 0: law e4m3, block 32; 1: law e2m1, block 16 */
    int K;                          /* bits per weight, 2..6 */
    int n_experts, latent, inter;
    const uint8_t *lut;             /* host, law e2m1: [1021] E4M3 byte of each sigma's value */
    const uint32_t *const *words;   /* host, [n_experts * 3] (gate, up, down): tile words */
    const uint8_t *const *scales;   /* host, [n_experts * 3]: expanded block scales */
    const float *g;                 /* host, [n_experts * 3]: matrix scales */
    const uint8_t *sign_in, *sign_mid, *sign_out; /* host sign bits */
};

struct trellis_cuda_layer;   /* the layer's copy on the device */
struct trellis_cuda_scratch; /* moe buffers, grown on demand, shared by a ctx's layers */

/* Copies the layer to the device on `stream` (a cudaStream_t) and waits for the copies. */
int trellis_cuda_layer_new(const struct trellis_cuda_layer_desc *d, void *stream,
                           struct trellis_cuda_layer **out, char *msg, size_t size);
void trellis_cuda_layer_free(struct trellis_cuda_layer *l);
void trellis_cuda_scratch_free(struct trellis_cuda_scratch *s);

enum trellis_cuda_norm { TRELLIS_CUDA_NORM_NONE, TRELLIS_CUDA_NORM_F32, TRELLIS_CUDA_NORM_BF16,
                         TRELLIS_CUDA_NORM_F16 };

/* moe_experts on the device, queued on `stream`: out[n][latent] from z[n][latent],
 * ids[n][k], weights[n][k] (ids outside the layer are skipped), post[latent] of dtype `norm`.
 * *scratch is created or grown as needed (stream-ordered). events: NULL, or six cudaEvent_t
 * recorded after routing, the input rotation, gate/up, the middle, down and the output (the
 * bench's phase times). */
int trellis_cuda_moe(struct trellis_cuda_scratch **scratch, const struct trellis_cuda_layer *l,
                     void *stream, float *out, const float *z, const int32_t *ids,
                     const float *weights, int n, int k, const void *post,
                     enum trellis_cuda_norm norm, float eps, void *const *events, char *msg,
                     size_t size);

/* The bit-exactness check: out[n_tiles][256] <- the operand bytes each lane decodes into its
 * MMA registers (bytes 8l..8l+7 from lane l, trellis order) for the tiles words[n_tiles][8K];
 * law e2m1 gives E4M3 bytes of its values. fp4: 0 (law e4m3), 1 (law e2m1), or
 * 1 | TRELLIS_CUDA_NATIVE_FP4: law e2m1's codes as the native FP4 form puts them in its
 * registers (tiles in pairs: n_tiles even). Waits for the result. */
int trellis_cuda_decode_tiles(int fp4, int K, const uint8_t *lut_host, const uint32_t *words,
                              int n_tiles, uint8_t *out, void *stream, char *msg, size_t size);

/* The group the expert block's matmuls use for `pairs` (token, expert) pairs of `tokens`
 * tokens over `experts` experts, law e2m1 (fp4 = 1) or e4m3: MM_GROUP_SMALL, _LARGE, _WIDE or
 * _WIDER (mm.cuh). */
int trellis_cuda_group(int fp4, int tokens, long pairs, int experts);

/* The expert matmul alone (the bench's GEMV and grouped GEMMs): y[e][m][rows] = g_e * a_m *
 * sum_k (B . C)_e[r][k] x_m[k] for n_experts matrices words[e] ([rows/16][cols/16][8K],
 * e-major) and m tokens per expert, x[e][m][cols] in kappa order with token scales a[e][m]
 * (law e2m1: block scales xb[e][m][cols/16] as f32 values, and lut[1024] its table on the
 * device). group: the kernel's tokens per group (8: the GEMV, 64: the grouped GEMM, 128 or
 * 256: the wide GEMM), or 0 for the one the expert block would pick at m tokens an expert,
 * with the form of the kernels, which the expert block picks by the device, asked for by
 * these flags (the bench checks each form):
 * - TRELLIS_CUDA_MMA_SYNC: f16 mma.sync everywhere (the wide GEMM's mma.sync form on Hopper,
 *   where it would take wgmma);
 * - TRELLIS_CUDA_NATIVE_FP4: law e2m1's GEMV and grouped GEMM in the native form, Blackwell's
 *   block-scaled FP4 mma.m16n8k64 (sm_120a), which the expert block does not take yet: on
 *   sm_120a the instruction (never run: no Blackwell here), elsewhere an emulation of it
 *   (decode.cuh, mma_e2m1) that lets the checks verify the form's layout on any GPU.
 * work: device scratch of trellis_cuda_matmul_work bytes (NULL where that is 0). Queued, no
 * wait. */
#define TRELLIS_CUDA_MMA_SYNC 0x10000
#define TRELLIS_CUDA_NATIVE_FP4 0x20000
#define TRELLIS_CUDA_FORMS (TRELLIS_CUDA_MMA_SYNC | TRELLIS_CUDA_NATIVE_FP4)
size_t trellis_cuda_matmul_work(int fp4, int n_experts, int cols, int m, int group);
/* The form trellis_cuda_matmul runs such a call in on this device: "wgmma", "mma.sync",
 * "fp4-mma" or "fp4-mma (emulated)" (a static string). */
const char *trellis_cuda_matmul_form(int fp4, int group, int m, int n_experts);
int trellis_cuda_matmul(int fp4, int K, const uint8_t *lut, const uint32_t *words,
                        const uint8_t *scales, const float *g, int n_experts, int rows,
                        int cols, const uint8_t *x, const float *a, const float *xb, int m,
                        int group, void *work, float *y, void *stream, char *msg, size_t size);

#ifdef __cplusplus
}
#endif

#endif
