/* moe.cu: a layer's experts on the device and the expert block of docs/trellismx.md §6.
 *
 *     route    pairs (token, expert) sorted into slots by expert, cut into groups   1 CTA
 *     input    z' = H(sign_latent_in . z), quantized per token (§7)              CTA / token
 *     gate/up  g', u' = Q_gate act(z'), Q_up act(z')        mm_kernel, both in one launch
 *     mid      m' = H(s_mid . silu(s_mid . H g') . (s_mid . H u')), quantized    CTA / slot
 *     down     y' = Q_down act(m')                                                mm_kernel
 *     output   out = (sign_latent_out . H(sum_j w_j y'_j / rms(y'_j))) . post     CTA / token
 *
 * The rotations run in f32 in the spec's butterfly order and the activation formats round
 * each quotient once as act.c does, so z' and its quantized bytes equal the CPU's bit for bit;
 * silu's expf may differ from the host's in the last bit. A pair's slot inside its expert
 * comes from an atomic counter, but no value depends on it: each token is one MMA column. */
#include "decode.cuh"
#include "mm.cuh"
#include "trellis_cuda.h"

#include <math.h>
#include <stdio.h>

#define ROW_THREADS 256
#define HADAMARD_NORM 0x1.6a09e6p-4f /* f32(1/sqrt(128)) */

struct trellis_cuda_layer {
    int fp4, K, n_experts, latent, inter;
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

/* RNE_E2M1(x) as the E4M3 byte of the same value (§1.2), the operand the FP8 MMA takes. */
__device__ uint8_t e2m1_rne_as_e4m3(double x) {
    const uint8_t e4m3[8] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C};
    return (uint8_t)((signbit(x) ? 0x80u : 0u) | e4m3[minifloat_rne(fabs(x), 1, 0, 7)]);
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

__device__ void signs_apply(float *x, int n, const uint8_t *bits) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (bits[i >> 3] >> (i & 7) & 1) x[i] = -x[i];
    __syncthreads();
}

/* x <- H x on every 128 of x[n] (shared memory): a warp per block of 128, four elements a
 * lane; stages h = 1, 2 in the lane, 4 .. 64 across lanes, then the normalization. */
__device__ void hadamard(float *x, int n) {
    const int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < n / 128; b += blockDim.x / 32) {
        float4 *p = reinterpret_cast<float4 *>(x + 128 * b) + lane;
        const float4 v = *p;
        const float a0 = v.x + v.y, a1 = v.x - v.y, a2 = v.z + v.w, a3 = v.z - v.w;
        float r[4] = {a0 + a2, a1 + a3, a0 - a2, a1 - a3};
        for (int m = 1; m < 32; m <<= 1)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float o = __shfl_xor_sync(0xffffffffu, r[i], m);
                r[i] = lane & m ? o - r[i] : r[i] + o;
            }
        *p = make_float4(r[0] * HADAMARD_NORM, r[1] * HADAMARD_NORM, r[2] * HADAMARD_NORM,
                         r[3] * HADAMARD_NORM);
    }
    __syncthreads();
}

/* The quantized row of §7 from x[n] (shared): q[n] operand bytes in kappa order, its scale,
 * and for law e2m1 the block scale values qb[n/16]. */
__device__ void quantize(const float *x, int n, int fp4, uint8_t *q, float *scale, float *qb,
                         float *red) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, fabsf(x[i]));
    const int e = pow2_exp(block_max(m, red), fp4 ? 2688.0f : 448.0f);
    if (threadIdx.x == 0) *scale = ldexpf(1.0f, e);
    if (!fp4) {
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            q[kappa_of(i)] = e4m3_rne(ldexp((double)x[i], -e));
        return;
    }
    for (int b = threadIdx.x; b < n / 16; b += blockDim.x) {
        const float *xb = x + 16 * b;
        float mb = 0.0f;
        for (int i = 0; i < 16; i++) mb = fmaxf(mb, fabsf(xb[i]));
        const uint8_t s = e4m3_rne(ldexp((double)mb, -e) / 6.0);
        const float sv = e4m3_value(s);
        const double d = ldexp((double)sv, e);
        qb[b] = sv;
        for (int i = 0; i < 16; i++) q[kappa_of(16 * b + i)] = s ? e2m1_rne_as_e4m3(xb[i] / d) : 0;
    }
}

/* --- the phases ------------------------------------------------------------------------- */

/* Slots by expert: count[e] pairs of expert e start at slot start[e]; groups of up to `cap`
 * slots of one expert. One CTA. */
__global__ void route_kernel(const int32_t *ids, int P, int k, int E, int cap, int *slot,
                             int *act_row, int4 *groups, int *n_groups, int *n_slots) {
    extern __shared__ int sm[]; /* count[E], start[E] */
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

__global__ void input_kernel(const float *z, int latent, const uint8_t *sign_in, int fp4,
                             uint8_t *q, float *qa, float *qb) {
    extern __shared__ float x[]; /* [latent] */
    __shared__ float red[32];
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < latent; i += blockDim.x) x[i] = z[(size_t)t * latent + i];
    __syncthreads();
    signs_apply(x, latent, sign_in);
    hadamard(x, latent);
    quantize(x, latent, fp4, q + (size_t)t * latent, qa + t, qb + (size_t)t * (latent / 16),
             red);
}

__global__ void mid_kernel(const float *hg, const float *hu, int inter, const uint8_t *sign,
                           const int *n_slots, int fp4, uint8_t *q, float *qa, float *qb) {
    extern __shared__ float x[]; /* [2][inter]: g, then u */
    __shared__ float red[32];
    const int s = blockIdx.x;
    if (s >= *n_slots) return;
    float *gv = x, *uv = x + inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        gv[i] = hg[(size_t)s * inter + i];
        uv[i] = hu[(size_t)s * inter + i];
    }
    __syncthreads();
    hadamard(x, 2 * inter);
    signs_apply(gv, inter, sign);
    signs_apply(uv, inter, sign);
    for (int i = threadIdx.x; i < inter; i += blockDim.x)
        gv[i] = gv[i] / (1.0f + expf(-gv[i])) * uv[i];
    __syncthreads();
    signs_apply(gv, inter, sign);
    hadamard(gv, inter);
    quantize(gv, inter, fp4, q + (size_t)s * inter, qa + s, qb + (size_t)s * (inter / 16), red);
}

__device__ float norm_weight(const void *post, trellis_cuda_norm norm, int i) {
    if (norm == TRELLIS_CUDA_NORM_F32) return static_cast<const float *>(post)[i];
    const uint16_t h = static_cast<const uint16_t *>(post)[i];
    if (norm == TRELLIS_CUDA_NORM_BF16) return __uint_as_float((uint32_t)h << 16);
    return __half2float(__ushort_as_half(h));
}

__global__ void output_kernel(const float *y, const int *slot, const float *weights, int k,
                              int latent, const uint8_t *sign_out, const void *post,
                              trellis_cuda_norm norm, float eps, float *out) {
    extern __shared__ float o[]; /* [latent] */
    __shared__ double red[32];
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < latent; i += blockDim.x) o[i] = 0.0f;
    for (int j = 0; j < k; j++) {
        const int s = slot[t * k + j];
        if (s < 0) continue;
        const float *ys = y + (size_t)s * latent;
        float w = weights[t * k + j];
        if (norm != TRELLIS_CUDA_NORM_NONE) { /* rms(y') = rms(y): H is orthonormal */
            double ss = 0.0;
            for (int i = threadIdx.x; i < latent; i += blockDim.x) ss += (double)ys[i] * ys[i];
            w /= sqrtf((float)(block_sum(ss, red) / (double)latent) + eps);
        }
        for (int i = threadIdx.x; i < latent; i += blockDim.x) o[i] += w * ys[i];
    }
    __syncthreads();
    hadamard(o, latent);
    signs_apply(o, latent, sign_out);
    for (int i = threadIdx.x; i < latent; i += blockDim.x)
        out[(size_t)t * latent + i] =
            norm != TRELLIS_CUDA_NORM_NONE ? o[i] * norm_weight(post, norm, i) : o[i];
}

/* --- one call --------------------------------------------------------------------------- */

/* The buffers of a call with n tokens and P pairs cut into at most G groups. */
struct moe_buffers {
    int *slot, *act_row, *n_groups, *n_slots;
    int4 *groups;
    uint8_t *zq, *mq;
    float *za, *zb, *hg, *hu, *ma, *mb, *y;
};

static size_t buffers_layout(const trellis_cuda_layer *l, size_t n, size_t P, size_t G,
                             char *base, moe_buffers *b) {
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
static cudaError_t launch_rows(void (*kernel)(P...), int grid, size_t smem, cudaStream_t s,
                               A... args) {
    if (smem > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    kernel<<<grid, ROW_THREADS, smem, s>>>(args...);
    return cudaGetLastError();
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
    /* Decode steps see at most 8 tokens an expert; wider steps use groups of 64 when the
     * experts average more than 8 tokens. */
    const int cap = n <= MM_GROUP_SMALL || P <= MM_GROUP_SMALL * E ? MM_GROUP_SMALL
                                                                    : MM_GROUP_LARGE;
    const int G = P < P / cap + E ? P : P / cap + E;
    moe_buffers b;
    const size_t need = buffers_layout(l, n, P, G, NULL, &b);
    if (scratch_reserve(scratch, need, s, msg, size)) return 1;
    buffers_layout(l, n, P, G, (char *)(*scratch)->base, &b);

    cudaError_t e = cudaSuccess;
    route_kernel<<<1, 1024, 2 * E * sizeof(int), s>>>(ids, P, k, E, cap, b.slot, b.act_row,
                                                     b.groups, b.n_groups, b.n_slots);
    if ((e = cudaGetLastError()) == cudaSuccess) e = record(events, 0, s);
    if (e == cudaSuccess)
        e = launch_rows(input_kernel, n, l->latent * sizeof(float), s, z, l->latent,
                        (const uint8_t *)l->signs[0], l->fp4, b.zq, b.za, b.zb);
    if (e == cudaSuccess) e = record(events, 1, s);
    mm_params p = {};
    p.groups = b.groups;
    p.n_groups = b.n_groups;
    p.lut = l->lut;
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
        e = trellis_mm_launch(l->fp4, l->K, cap, p, 2, G, s);
    }
    if (e == cudaSuccess) e = record(events, 2, s);
    if (e == cudaSuccess)
        e = launch_rows(mid_kernel, P, 2 * l->inter * sizeof(float), s, (const float *)b.hg,
                        (const float *)b.hu, l->inter, (const uint8_t *)l->signs[1],
                        (const int *)b.n_slots, l->fp4, b.mq, b.ma, b.mb);
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
        e = trellis_mm_launch(l->fp4, l->K, cap, p, 1, G, s);
    }
    if (e == cudaSuccess) e = record(events, 4, s);
    if (e == cudaSuccess)
        e = launch_rows(output_kernel, n, l->latent * sizeof(float), s, (const float *)b.y,
                        (const int *)b.slot, weights, k, l->latent,
                        (const uint8_t *)l->signs[2], post, norm, eps, out);
    if (e == cudaSuccess) e = record(events, 5, s);
    return failed(e, "moe_experts", msg, size);
}
