/* moe.cu: a layer's experts on the device and the expert block of docs/trellismx.md §6.
 *
 *     route    pairs (token, expert) sorted into slots by expert, cut into groups   } 1 + n CTAs,
 *     input    z' = H(sign_latent_in . z), quantized per token (§7)                } one launch
 *     gate/up  g', u' = Q_gate act(z'), Q_up act(z')        mm.cu, both in one launch
 *     mid      m' = H(s_mid . silu(s_mid . H g') . (s_mid . H u')), quantized    CTA / slot
 *     down     y' = Q_down act(m')                                                mm.cu
 *     output   rms(y'_j), with a post-norm only                                   CTA / slot
 *              out = (sign_latent_out . H(sum_j w_j y'_j / rms(y'_j))) . post
 *                                                          CTA / (token, 4 blocks of 128)
 *
 * Route and input share a launch (CTA 0 routes, CTA 1 + t rotates token t): neither reads
 * what the other writes, and a launch fewer is a few microseconds at one token. Input and mid
 * need their row's amax, so a CTA owns a row, 1024 threads wide at few rows (row_threads).
 * The output needs no row-wide value but rms(y'_j), which a small kernel computes once per
 * slot, so the sum, the rotation and the norm run a warp per block of 128 outputs.
 *
 * The rotations run in f32 in the spec's butterfly order and the activation formats round
 * each quotient once as act.c does (E4M3 in integers, E2M1 by exact comparisons: the same
 * bytes as its double arithmetic), so z' and its quantized bytes equal the CPU's bit for bit;
 * silu's expf may differ from the host's in the last bit. A pair's slot inside its expert
 * comes from an atomic counter, but no value depends on it: each token is one MMA column. */
#include "decode.cuh"
#include "mm.cuh"
#include "trellis_cuda.h"

#include <math.h>
#include <stdio.h>

#define ROW_THREADS 256       /* a row's CTA once the rows fill the SMs; the rms kernel */
#define ROW_THREADS_WIDE 1024 /* a row's CTA while they do not */
#define OUT_WARPS 4           /* output kernel: blocks of 128 outputs per CTA, a warp each */
#define HADAMARD_NORM 0x1.6a09e6p-4f /* f32(1/sqrt(128)) */

struct trellis_cuda_layer {
    int fp4, K, n_experts, latent, inter;
    int sms;              /* of the device the layer lives on (row_threads) */
    void *base;           /* one allocation: */
    uint32_t *words[3];   /* [E][rows/16][cols/16][8K] of gate, up, down */
    uint8_t *scales[3];   /* [E][rows][cols/block] */
    float *g[3];          /* [E] */
    uint8_t *signs[3];    /* sign_latent_in, sign_intermediate, sign_latent_out */
    uint8_t *lut;         /* [TRELLIS_LUT] law e2m1 */
};

struct trellis_cuda_scratch {
    void *base;
    size_t size;
};

static int failed(cudaError_t e, const char *what, char *msg, size_t size) {
    if (e == cudaSuccess) return 0;
    snprintf(msg, size, "%s: %s", what, cudaGetErrorString(e));
    return 1;
}

/* Hands out 256-byte aligned pieces of one allocation; with base NULL it only counts. */
static void *carve(char *base, size_t *at, size_t bytes) {
    void *p = base ? base + *at : NULL;
    *at += (bytes + 255) & ~(size_t)255;
    return p;
}

/* --- the layer -------------------------------------------------------------------------- */

static size_t layer_layout(trellis_cuda_layer *l, char *base) {
    const int block = l->fp4 ? 16 : 32;
    const size_t E = (size_t)l->n_experts, lat = (size_t)l->latent, inter = (size_t)l->inter;
    const size_t weights = lat * inter; /* every matrix has latent * inter weights */
    size_t at = 0;
    for (int p = 0; p < 3; p++) {
        l->words[p] = (uint32_t *)carve(base, &at, E * weights / 256 * 8 * l->K * 4);
        l->scales[p] = (uint8_t *)carve(base, &at, E * weights / block);
        l->g[p] = (float *)carve(base, &at, E * sizeof(float));
    }
    const size_t sign_bytes[3] = {lat / 8, inter / 8, lat / 8};
    for (int i = 0; i < 3; i++) l->signs[i] = (uint8_t *)carve(base, &at, sign_bytes[i]);
    l->lut = (uint8_t *)carve(base, &at, TRELLIS_LUT);
    return at;
}

static int layer_copy(trellis_cuda_layer *l, const trellis_cuda_layer_desc *d, cudaStream_t s,
                      char *msg, size_t size) {
    const int block = l->fp4 ? 16 : 32;
    const size_t weights = (size_t)l->latent * l->inter, E = (size_t)l->n_experts;
    const size_t wbytes = weights / 256 * 8 * l->K * 4, sbytes = weights / block;
    cudaError_t e = cudaSuccess;
    for (size_t x = 0; x < E && e == cudaSuccess; x++)
        for (int p = 0; p < 3 && e == cudaSuccess; p++) {
            e = cudaMemcpyAsync((char *)l->words[p] + x * wbytes, d->words[x * 3 + p], wbytes,
                                cudaMemcpyHostToDevice, s);
            if (e == cudaSuccess)
                e = cudaMemcpyAsync(l->scales[p] + x * sbytes, d->scales[x * 3 + p], sbytes,
                                    cudaMemcpyHostToDevice, s);
            if (e == cudaSuccess)
                e = cudaMemcpyAsync(l->g[p] + x, &d->g[x * 3 + p], sizeof(float),
                                    cudaMemcpyHostToDevice, s);
        }
    const uint8_t *signs[3] = {d->sign_in, d->sign_mid, d->sign_out};
    const size_t sign_bytes[3] = {(size_t)l->latent / 8, (size_t)l->inter / 8,
                                  (size_t)l->latent / 8};
    for (int i = 0; i < 3 && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(l->signs[i], signs[i], sign_bytes[i], cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess && l->fp4)
        e = cudaMemcpyAsync(l->lut, d->lut, 1021, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    return failed(e, "copy of the experts to the device", msg, size);
}

extern "C" int trellis_cuda_layer_new(const trellis_cuda_layer_desc *d, void *stream,
                                      trellis_cuda_layer **out, char *msg, size_t size) {
    *out = NULL;
    trellis_cuda_layer *l = (trellis_cuda_layer *)calloc(1, sizeof *l);
    if (!l) {
        snprintf(msg, size, "out of memory");
        return 1;
    }
    l->fp4 = d->fp4;
    l->K = d->K;
    l->n_experts = d->n_experts;
    l->latent = d->latent;
    l->inter = d->inter;
    int dev = 0;
    if (failed(cudaGetDevice(&dev), "cudaGetDevice", msg, size) ||
        failed(cudaDeviceGetAttribute(&l->sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute (SM count)", msg, size)) {
        free(l);
        return 1;
    }
    const size_t bytes = layer_layout(l, NULL);
    if (failed(cudaMalloc(&l->base, bytes), "cudaMalloc of the experts", msg, size)) {
        free(l);
        return 1;
    }
    layer_layout(l, (char *)l->base);
    if (layer_copy(l, d, static_cast<cudaStream_t>(stream), msg, size)) {
        trellis_cuda_layer_free(l);
        return 1;
    }
    *out = l;
    return 0;
}

extern "C" void trellis_cuda_layer_free(trellis_cuda_layer *l) {
    if (!l) return;
    cudaFree(l->base);
    free(l);
}

extern "C" void trellis_cuda_scratch_free(trellis_cuda_scratch *s) {
    if (!s) return;
    cudaFree(s->base);
    free(s);
}

/* --- rounding and rotations, as plugins/trellis/laws.c, act.c and hadamard.c ------------- */

/* Magnitude code of RNE(a) in a minifloat (man mantissa bits, smallest normal exponent emin),
 * saturating at max; a >= 0, finite. */
__device__ unsigned minifloat_rne(double a, int man, int emin, unsigned max) {
    if (a == 0.0) return 0;
    int e;
    frexp(a, &e);
    e = e - 1 < emin ? emin : e - 1;
    const double q = ldexp(a, man - e);
    double r = floor(q);
    if (q - r > 0.5 || (q - r == 0.5 && fmod(r, 2.0) == 1.0)) r += 1.0;
    const unsigned code = ((unsigned)(e - emin) << man) + (unsigned)r;
    return code > max ? max : code;
}

__device__ uint8_t e4m3_rne(double x) {
    return (uint8_t)((signbit(x) ? 0x80u : 0u) | minifloat_rne(fabs(x), 3, -6, 0x7e));
}

/* e4m3_rne(x / 2^e) for finite x and e >= -127, in integers: |x| = m 2^X with m its 24-bit
 * significand, so the quotient's rounding is a shift of m with round-half-even, the same
 * steps as minifloat_rne without a floating-point operation. */
__device__ uint8_t e4m3_rne_pow2(float x, int e) {
    const uint32_t bits = __float_as_uint(x), biased = bits >> 23 & 0xffu;
    const uint32_t sign = bits >> 24 & 0x80u;
    const uint32_t m = (bits & 0x7fffffu) | (biased ? 0x800000u : 0u);
    if (m == 0) return (uint8_t)sign;
    const int X = (biased ? (int)biased : 1) - 150 - e;
    const int E = max(31 - __clz((int)m) + X, -6); /* the exponent; subnormals take -6's */
    /* steps of 2^(E - 3): r = RNE(m / 2^sh); sh >= 13 since x >= 2^-149 and e >= -127 */
    const int sh = E - 3 - X;
    uint32_t r = 0;
    if (sh < 32) {
        const uint32_t rest = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        r = (m >> sh) + (rest > half || (rest == half && (m >> sh & 1u)) ? 1u : 0u);
    }
    /* (E + 6) << 3 plus a mantissa with its leading 8: a carry to 16 moves up an exponent */
    const uint32_t code = ((uint32_t)(E + 6) << 3) + r;
    return (uint8_t)(sign | min(code, 0x7eu));
}

/* RNE_E2M1(x / d) as the E4M3 byte of the same value (§1.2), the byte the matmul stages,
 * for finite x and a block step d = e4m3(s_b) 2^e > 0: the code counts the midpoints between
 * E2M1 magnitudes (0.25, 0.75, ..., 5) that |x| / d passes, a tie going to the even code.
 * A midpoint times d has at most 7 significant bits and lies between 2^-138 and the block's
 * amax, so it is exact in f32 and each comparison is the exact quotient's; act.c's double
 * quotient rounds alike (it lies within 2^-53 of x / d, never across a midpoint). */
__device__ uint8_t e2m1_rne_as_e4m3(float x, float d) {
    const uint64_t e4m3 = 0x4C4844403C383000ull; /* byte c: the E4M3 byte of E2M1 code c */
    const float a = fabsf(x);
    const int code = (a > __fmul_rn(0.25f, d)) + (a >= __fmul_rn(0.75f, d)) +
                     (a > __fmul_rn(1.25f, d)) + (a >= __fmul_rn(1.75f, d)) +
                     (a > __fmul_rn(2.5f, d)) + (a >= __fmul_rn(3.5f, d)) +
                     (a > __fmul_rn(5.0f, d));
    return (uint8_t)((signbit(x) ? 0x80u : 0u) | (uint8_t)(e4m3 >> 8 * code));
}

__device__ int pow2_exp(float amax, float max) {
    if (amax == 0.0f) return 0;
    int ea, em;
    frexp(amax, &ea);
    frexp(max, &em);
    int e = ea - em - 1;
    while ((double)amax > ldexp((double)max, e)) e++;
    return e < -127 ? -127 : e > 127 ? 127 : e;
}

/* 2^e as an f32, for -149 <= e <= 127 (2^-127 is subnormal). */
__device__ float pow2f(int e) {
    return __uint_as_float(e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149));
}

/* Where element i of a row goes in kappa order (trellis_cuda.h). */
__device__ __forceinline__ int kappa_of(int i) {
    const int c = i & 15, q = (c & 7) >> 1, j = (c & 1) | (c >> 3) << 1;
    return (i & ~15) + 4 * q + j;
}

__device__ float block_max(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads(); /* red may still be read by an earlier reduction */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < (int)blockDim.x / 32; w++) v = fmaxf(v, red[w]);
    return v;
}

__device__ double block_sum(double v, double *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = 0.0;
    for (int w = 0; w < (int)blockDim.x / 32; w++) v += red[w]; /* same order in every thread */
    return v;
}

__device__ __forceinline__ float absmax4(float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}

/* Elements i .. i + 3 of a vector (i a multiple of 4) times their signs. */
__device__ __forceinline__ float4 signs4(float4 v, const uint8_t *bits, int i) {
    const unsigned b = bits[i >> 3] >> (i & 7);
    return make_float4(b & 1 ? -v.x : v.x, b & 2 ? -v.y : v.y, b & 4 ? -v.z : v.z,
                       b & 8 ? -v.w : v.w);
}

/* H on a block of 128 that a warp holds, elements 4 lane .. 4 lane + 3 in each lane: stages
 * h = 1, 2 in the lane, 4 .. 64 across lanes, then the normalization. The _rn intrinsics keep
 * the compiler from fusing a butterfly with a product around it (the rounding is the spec's). */
__device__ float4 hadamard128(float4 v) {
    const int lane = threadIdx.x & 31;
    const float a0 = __fadd_rn(v.x, v.y), a1 = __fsub_rn(v.x, v.y), a2 = __fadd_rn(v.z, v.w),
                a3 = __fsub_rn(v.z, v.w);
    float r[4] = {__fadd_rn(a0, a2), __fadd_rn(a1, a3), __fsub_rn(a0, a2), __fsub_rn(a1, a3)};
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float o = __shfl_xor_sync(0xffffffffu, r[i], m);
            r[i] = lane & m ? __fsub_rn(o, r[i]) : __fadd_rn(r[i], o);
        }
    return make_float4(__fmul_rn(r[0], HADAMARD_NORM), __fmul_rn(r[1], HADAMARD_NORM),
                       __fmul_rn(r[2], HADAMARD_NORM), __fmul_rn(r[3], HADAMARD_NORM));
}

/* The quantized row of §7 from x[n] (shared, complete): q[n] operand bytes in kappa order,
 * its scale, and for law e2m1 the block scale values qb[n/16]. A thread takes four elements
 * at a time (n / 4 is a multiple of 32, so whole warps), and four neighbouring lanes hold a
 * block of 16: its block scale is rounded from the double quotient, once per lane. */
__device__ void quantize(const float *x, int n, int fp4, uint8_t *q, float *scale, float *qb,
                         float *red) {
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    float m = 0.0f;
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) m = fmaxf(m, absmax4(x4[i]));
    const int e = pow2_exp(block_max(m, red), fp4 ? 2688.0f : 448.0f);
    if (threadIdx.x == 0) *scale = pow2f(e);
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
        const float4 v = x4[i];
        const float c[4] = {v.x, v.y, v.z, v.w};
        uint8_t b[4];
        if (!fp4) {
            for (int j = 0; j < 4; j++) b[j] = e4m3_rne_pow2(c[j], e);
        } else {
            float mb = absmax4(v);
            mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
            mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
            const uint8_t s = e4m3_rne(ldexp((double)mb, -e) / 6.0);
            const float sv = e4m3_value(s), d = __fmul_rn(sv, pow2f(e)); /* exact */
            if ((i & 3) == 0) qb[i >> 2] = sv;
            for (int j = 0; j < 4; j++) b[j] = s ? e2m1_rne_as_e4m3(c[j], d) : 0;
        }
        for (int j = 0; j < 4; j++) q[kappa_of(4 * i + j)] = b[j];
    }
}

/* Threads of a CTA that owns a row (input: a token; mid: a slot). While there are fewer rows
 * than SMs the phase is one row's latency, which 1024 threads cut fourfold; beyond, 256-thread
 * CTAs pack eight to an SM and hide one another's barriers. */
static int row_threads(const trellis_cuda_layer *l, int rows) {
    return rows <= l->sms ? ROW_THREADS_WIDE : ROW_THREADS;
}

/* --- the phases ------------------------------------------------------------------------- */

/* Slots by expert: count[e] pairs of expert e start at slot start[e]; groups of up to `cap`
 * slots of one expert. sm: shared, [2E]. */
__device__ void route(const int32_t *ids, int P, int k, int E, int cap, int *slot, int *act_row,
                      int4 *groups, int *n_groups, int *n_slots, int *sm) {
    int *count = sm, *start = sm + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x)
        if (ids[i] >= 0 && ids[i] < E) atomicAdd(&count[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, ng = 0;
        for (int e = 0; e < E; e++) {
            start[e] = at;
            for (int f = 0; f < count[e]; f += cap)
                groups[ng++] = make_int4(e, at + f, min(cap, count[e] - f), 0);
            at += count[e];
            count[e] = 0;
        }
        *n_groups = ng;
        *n_slots = at;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const int e = ids[i];
        if (e < 0 || e >= E) {
            slot[i] = -1;
            continue;
        }
        const int s = start[e] + atomicAdd(&count[e], 1);
        slot[i] = s;
        act_row[s] = i / k;
    }
}

/* CTA 0 routes; CTA 1 + t rotates and quantizes token t. z is the caller's, of unknown
 * alignment, so it is read a float at a time; the scratch's rows are 16-byte aligned. */
__global__ void __launch_bounds__(ROW_THREADS_WIDE)
    route_input_kernel(const int32_t *ids, int P, int k, int E, int cap, int *slot,
                       int *act_row, int4 *groups, int *n_groups, int *n_slots,
                       const float *__restrict__ z, int latent, const uint8_t *sign_in, int fp4,
                       uint8_t *q, float *qa, float *qb) {
    tmx_pdl_enter();
    extern __shared__ __align__(16) float x[]; /* route: int [2E]; input: z' [latent] */
    __shared__ float red[32];
    if (blockIdx.x == 0) {
        route(ids, P, k, E, cap, slot, act_row, groups, n_groups, n_slots,
              reinterpret_cast<int *>(x));
        return;
    }
    const int t = blockIdx.x - 1, lane = threadIdx.x & 31;
    const float *zt = z + (size_t)t * latent;
    for (int b = threadIdx.x >> 5; b < latent / 128; b += blockDim.x >> 5) {
        const int i = 128 * b + 4 * lane;
        const float4 v = make_float4(zt[i], zt[i + 1], zt[i + 2], zt[i + 3]);
        *reinterpret_cast<float4 *>(x + i) = hadamard128(signs4(v, sign_in, i));
    }
    __syncthreads();
    quantize(x, latent, fp4, q + (size_t)t * latent, qa + t, qb + (size_t)t * (latent / 16),
             red);
}

/* silu(g) u, each step rounded as the CPU's (no contraction with expf or the butterflies) */
__device__ __forceinline__ float silu_times(float g, float u) {
    return __fmul_rn(g / __fadd_rn(1.0f, expf(-g)), u);
}

/* A warp takes block b of g' and of u' and leaves block b of m' in x: the whole chain up to
 * the quantization is elementwise or per block, so it stays in registers. */
__global__ void __launch_bounds__(ROW_THREADS_WIDE)
    mid_kernel(const float *__restrict__ hg, const float *__restrict__ hu, int inter,
               const uint8_t *sign, const int *n_slots, int fp4, uint8_t *q, float *qa,
               float *qb) {
    tmx_pdl_enter();
    extern __shared__ __align__(16) float x[]; /* [inter]: m' */
    __shared__ float red[32];
    const int s = blockIdx.x, lane = threadIdx.x & 31;
    if (s >= *n_slots) return;
    const float4 *g4 = reinterpret_cast<const float4 *>(hg + (size_t)s * inter),
                 *u4 = reinterpret_cast<const float4 *>(hu + (size_t)s * inter);
    for (int b = threadIdx.x >> 5; b < inter / 128; b += blockDim.x >> 5) {
        const int i = 128 * b + 4 * lane;
        const float4 g = signs4(hadamard128(g4[i / 4]), sign, i),
                     u = signs4(hadamard128(u4[i / 4]), sign, i);
        const float4 m = make_float4(silu_times(g.x, u.x), silu_times(g.y, u.y),
                                     silu_times(g.z, u.z), silu_times(g.w, u.w));
        *reinterpret_cast<float4 *>(x + i) = hadamard128(signs4(m, sign, i));
    }
    __syncthreads();
    quantize(x, inter, fp4, q + (size_t)s * inter, qa + s, qb + (size_t)s * (inter / 16), red);
}

/* rms(y'_s) = sqrt(mean(y'^2) + eps) of each slot, once (a CTA per slot), for the output's
 * post-norm; the double sum runs in an order fixed by the launch. */
__global__ void rms_kernel(const float *__restrict__ y, int latent, const int *n_slots,
                           float eps, float *rms) {
    tmx_pdl_enter();
    __shared__ double red[32];
    const int s = blockIdx.x;
    if (s >= *n_slots) return;
    const float4 *y4 = reinterpret_cast<const float4 *>(y + (size_t)s * latent);
    double ss = 0.0;
    for (int i = threadIdx.x; i < latent / 4; i += blockDim.x) {
        const float4 v = y4[i];
        ss += (double)v.x * v.x + (double)v.y * v.y + (double)v.z * v.z + (double)v.w * v.w;
    }
    ss = block_sum(ss, red);
    if (threadIdx.x == 0) rms[s] = sqrtf((float)(ss / (double)latent) + eps);
}

__device__ float norm_weight(const void *post, trellis_cuda_norm norm, int i) {
    if (norm == TRELLIS_CUDA_NORM_F32) return static_cast<const float *>(post)[i];
    const uint16_t h = static_cast<const uint16_t *>(post)[i];
    if (norm == TRELLIS_CUDA_NORM_BF16) return __uint_as_float((uint32_t)h << 16);
    return __half2float(__ushort_as_half(h));
}

/* out[t][block b] for token t = blockIdx.x and b = OUT_WARPS blockIdx.y + warp, a warp per
 * block: the weighted sum, H, the signs and the norm weight all stay in the lane's four
 * elements (out and post, the caller's, a float at a time). Lane j first fetches pair j's
 * slot and weight, so that the loads of the pairs' rows depend on no other load and go out
 * together. */
__global__ void __launch_bounds__(32 * OUT_WARPS)
    output_kernel(const float *__restrict__ y, const int *__restrict__ slot,
                  const float *__restrict__ weights, const float *__restrict__ rms, int k,
                  int latent, const uint8_t *sign_out, const void *post, trellis_cuda_norm norm,
                  float *out) {
    tmx_pdl_enter();
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int b = blockIdx.y * OUT_WARPS + (threadIdx.x >> 5), i = 128 * b + 4 * lane;
    if (b >= latent / 128) return; /* the whole warp */
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j0 = 0; j0 < k; j0 += 32) {
        int sl = -1;
        float wl = 0.0f;
        if (j0 + lane < k) {
            sl = slot[t * k + j0 + lane];
            wl = weights[t * k + j0 + lane];
            if (sl >= 0 && norm != TRELLIS_CUDA_NORM_NONE) wl /= rms[sl];
        }
        const int kk = min(32, k - j0);
#pragma unroll 8
        for (int j = 0; j < kk; j++) {
            const int s = __shfl_sync(0xffffffffu, sl, j);
            const float w = __shfl_sync(0xffffffffu, wl, j);
            /* a skipped pair (s < 0) reads row 0, which exists, and adds nothing */
            const float4 v =
                reinterpret_cast<const float4 *>(y + (size_t)max(s, 0) * latent)[i / 4];
            /* selects, not a branch: the load must not sink below a test of s */
            o.x = s >= 0 ? o.x + w * v.x : o.x;
            o.y = s >= 0 ? o.y + w * v.y : o.y;
            o.z = s >= 0 ? o.z + w * v.z : o.z;
            o.w = s >= 0 ? o.w + w * v.w : o.w;
        }
    }
    o = signs4(hadamard128(o), sign_out, i);
    const float r[4] = {o.x, o.y, o.z, o.w};
    float *ot = out + (size_t)t * latent + i;
    for (int c = 0; c < 4; c++)
        ot[c] = norm != TRELLIS_CUDA_NORM_NONE ? r[c] * norm_weight(post, norm, i + c) : r[c];
}

/* --- one call --------------------------------------------------------------------------- */

/* The buffers of a call with n tokens and P pairs cut into at most G groups. */
struct moe_buffers {
    int *slot, *act_row, *n_groups, *n_slots;
    int4 *groups;
    uint8_t *zq, *mq;
    float *za, *zb, *hg, *hu, *ma, *mb, *y, *rms;
    uint32_t *x16; /* the wide GEMM's staged activations, of gate/up and then of down */
};

static size_t buffers_layout(const trellis_cuda_layer *l, size_t n, size_t P, size_t G,
                             int cap, char *base, moe_buffers *b) {
    const size_t lat = (size_t)l->latent, inter = (size_t)l->inter;
    size_t at = 0;
    b->slot = (int *)carve(base, &at, P * sizeof(int));
    b->act_row = (int *)carve(base, &at, P * sizeof(int));
    b->n_groups = (int *)carve(base, &at, 2 * sizeof(int));
    b->n_slots = b->n_groups ? b->n_groups + 1 : NULL;
    b->groups = (int4 *)carve(base, &at, G * sizeof(int4));
    b->zq = (uint8_t *)carve(base, &at, n * lat);
    b->za = (float *)carve(base, &at, n * sizeof(float));
    b->zb = (float *)carve(base, &at, n * lat / 16 * sizeof(float));
    b->hg = (float *)carve(base, &at, P * inter * sizeof(float));
    b->hu = (float *)carve(base, &at, P * inter * sizeof(float));
    b->mq = (uint8_t *)carve(base, &at, P * inter);
    b->ma = (float *)carve(base, &at, P * sizeof(float));
    b->mb = (float *)carve(base, &at, P * inter / 16 * sizeof(float));
    b->y = (float *)carve(base, &at, P * lat * sizeof(float));
    b->rms = (float *)carve(base, &at, P * sizeof(float));
    const size_t gate_up = trellis_mm_x16_bytes(cap, n, l->latent),
                 down = trellis_mm_x16_bytes(cap, P, l->inter);
    b->x16 = (uint32_t *)carve(base, &at, gate_up > down ? gate_up : down);
    return at;
}

static int scratch_reserve(trellis_cuda_scratch **sp, size_t need, cudaStream_t s, char *msg,
                           size_t size) {
    trellis_cuda_scratch *sc = *sp;
    if (!sc) {
        if (!(sc = (trellis_cuda_scratch *)calloc(1, sizeof *sc))) {
            snprintf(msg, size, "out of memory");
            return 1;
        }
        *sp = sc;
    }
    if (sc->size >= need) return 0;
    if (sc->base && failed(cudaFreeAsync(sc->base, s), "cudaFreeAsync", msg, size)) return 1;
    sc->base = NULL;
    sc->size = 0;
    if (failed(cudaMallocAsync(&sc->base, need, s), "cudaMallocAsync of the expert buffers",
               msg, size))
        return 1;
    sc->size = need;
    return 0;
}

/* Launch with dynamic shared memory above the default 48 KiB where a row needs it. */
template <typename... P, typename... A>
static cudaError_t launch(void (*kernel)(P...), dim3 grid, int threads, size_t smem,
                          cudaStream_t s, A... args) {
    if (smem > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    return trellis_launch(kernel, grid, threads, smem, s, args...);
}

static cudaError_t record(void *const *events, int i, cudaStream_t s) {
    return events ? cudaEventRecord(static_cast<cudaEvent_t>(events[i]), s) : cudaSuccess;
}

extern "C" int trellis_cuda_moe(trellis_cuda_scratch **scratch, const trellis_cuda_layer *l,
                                void *stream, float *out, const float *z, const int32_t *ids,
                                const float *weights, int n, int k, const void *post,
                                trellis_cuda_norm norm, float eps, void *const *events,
                                char *msg, size_t size) {
    if (n <= 0) return 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int E = l->n_experts, P = n * k;
    const int cap = trellis_cuda_group(l->fp4, n, P, E);
    const int G = P < P / cap + E ? P : P / cap + E;
    moe_buffers b;
    const size_t need = buffers_layout(l, n, P, G, cap, NULL, &b);
    if (scratch_reserve(scratch, need, s, msg, size)) return 1;
    buffers_layout(l, n, P, G, cap, (char *)(*scratch)->base, &b);

    /* Routing and the input are one launch: events 0 and 1 both follow it. */
    const size_t route_smem = 2 * E * sizeof(int), input_smem = l->latent * sizeof(float);
    cudaError_t e = launch(route_input_kernel, n + 1, row_threads(l, n),
                           route_smem > input_smem ? route_smem : input_smem, s, ids, P, k, E,
                           cap, b.slot, b.act_row, b.groups, b.n_groups, b.n_slots, z, l->latent,
                           (const uint8_t *)l->signs[0], l->fp4, b.zq, b.za, b.zb);
    if (e == cudaSuccess) e = record(events, 0, s);
    if (e == cudaSuccess) e = record(events, 1, s);
    mm_params p = {};
    p.groups = b.groups;
    p.n_groups = b.n_groups;
    p.lut = l->lut;
    p.x16 = b.x16;
    if (e == cudaSuccess) {
        for (int i = 0; i < 2; i++) {
            p.words[i] = l->words[i];
            p.scales[i] = l->scales[i];
            p.g[i] = l->g[i];
        }
        p.y[0] = b.hg;
        p.y[1] = b.hu;
        p.rows = l->inter;
        p.cols = l->latent;
        p.act_row = b.act_row;
        p.x = b.zq;
        p.xa = b.za;
        p.xb = b.zb;
        p.x_rows = n;
        e = trellis_mm_launch(l->fp4, l->K, cap, p, 2, G, s);
    }
    if (e == cudaSuccess) e = record(events, 2, s);
    if (e == cudaSuccess)
        e = launch(mid_kernel, P, row_threads(l, P), l->inter * sizeof(float), s,
                   (const float *)b.hg, (const float *)b.hu, l->inter,
                   (const uint8_t *)l->signs[1], (const int *)b.n_slots, l->fp4, b.mq, b.ma,
                   b.mb);
    if (e == cudaSuccess) e = record(events, 3, s);
    if (e == cudaSuccess) {
        p.words[0] = l->words[2];
        p.scales[0] = l->scales[2];
        p.g[0] = l->g[2];
        p.y[0] = b.y;
        p.rows = l->latent;
        p.cols = l->inter;
        p.act_row = NULL;
        p.x = b.mq;
        p.xa = b.ma;
        p.xb = b.mb;
        p.x_rows = P;
        e = trellis_mm_launch(l->fp4, l->K, cap, p, 1, G, s);
    }
    if (e == cudaSuccess) e = record(events, 4, s);
    if (e == cudaSuccess && norm != TRELLIS_CUDA_NORM_NONE)
        e = launch(rms_kernel, P, ROW_THREADS, 0, s, (const float *)b.y, l->latent,
                   (const int *)b.n_slots, eps, b.rms);
    const dim3 out_grid(n, (l->latent / 128 + OUT_WARPS - 1) / OUT_WARPS);
    if (e == cudaSuccess)
        e = launch(output_kernel, out_grid, 32 * OUT_WARPS, 0, s, (const float *)b.y,
                   (const int *)b.slot, weights, (const float *)b.rms, k, l->latent,
                   (const uint8_t *)l->signs[2], post, norm, out);
    if (e == cudaSuccess) e = record(events, 5, s);
    return failed(e, "moe_experts", msg, size);
}
