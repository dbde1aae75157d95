/* gemv_variants.cu: what bounds the K3 e4m3 trellis GEMV (docs/perf/h200-codec.md, "Where the
 * time goes" and "A cheaper decode"). A reduced copy of mm_kernel<3, e4m3, NG = 1> of
 * plugins/trellis/cuda/mm.cu (one token per expert, whole chunks, no epilogue scales) with
 * compile-time switches for the state extraction, the law, the block scales, the chunk size,
 * the registers and the warps per CTA, and persistent kernels that read the codes from a
 * table in shared memory (v1's law e4m3, or the experimental law e4m3-pair), and a kernel of
 * a law linear in sigma with int8 inputs (gemv_idot: what the cheapest law of this family of
 * codes would buy, "A law linear in sigma" there); 8 experts x [4096][4096] random words, one
 * and two matrices a launch (two: the gate+up launch). Every
 * exact variant is checked against a host decode in double, the v1 ones also bit for bit
 * against the first; ablations (which compute wrong values on purpose, to price a step) are
 * marked. Built as bin/trellis-gemv-variants (plugins/trellis/cuda/CMakeLists.txt); run it on
 * a GPU machine: `trellis-gemv-variants [--json FILE | --profile]` (FILE: the rows and the
 * GPU, for docs/perf; --profile: each kernel once, for Nsight Compute's counters, as
 * tests/gpu/table_laws.sh runs it). Exits 1 when a kernel differs from the host. */
#include "decode.cuh"
extern "C" {
#include "tmx/tensor.h"
#include "trellis.h"
}
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include <vector>
#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            printf("%s:%d %s\n", #x, __LINE__, cudaGetErrorString(e_));                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define KK 3
__device__ __forceinline__ uint32_t shr_mul(uint32_t x, int n) {
    uint32_t r;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << (32 - n)));
    return r;
}

struct P {
    const uint32_t *words;
    const uint8_t *scales;
    float *y;
    int rows, cols;
    const uint8_t *x;
    const uint8_t *table; /* table laws only */
    int experts, mats;
    const uint32_t *xs, *xk; /* gemv_idot only: input splats, and its constants */
};

__device__ __forceinline__ uint32_t hsub2_rn(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ uint32_t hadd2_rn(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ uint32_t hmul2_rn(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ uint32_t hfma2_rn(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

template <int LAW, int PK = 0> __device__ __forceinline__ uint32_t law(uint32_t h0, uint32_t h1) {
    const uint32_t h = PK ? __byte_perm(h0, h1, 0x5410) : h1 * 0x10000u + h0;
    const uint32_t v = hfma2_rn(h, 0x1EEE1EEEu, 0xC931C931u);
    if (LAW == 0)
        return e4m3x2_to_f16x2(f16x2_to_e4m3x2(v));
    if (LAW == 1)
        return v;
    const uint32_t c = hmul2_rn(v, 0x58085808u); /* 129 */
    const uint32_t d = hsub2_rn(c, v);
    const uint32_t hi = hsub2_rn(c, d);
    if (LAW == 3)
        return hi;
    const uint32_t t = hsub2_rn(hadd2_rn(v, 0x42004200u), 0x42004200u); /* (v + 3) - 3 */
    __half2 vh = *reinterpret_cast<const __half2 *>(&v);
    const unsigned m = __hlt2_mask(__habs2(vh), __half2half2(__ushort_as_half(0x2400)));
    return (m & t) | (~m & hi);
}

template <int K, int MH>
__device__ __forceinline__ void states_shf(const uint32_t *w, lane_window lw, uint32_t s[8]) {
    const uint32_t hi = w[lw.i0], mid = w[lw.i1], lo = w[lw.i2];
    const uint32_t whi = __funnelshift_l(mid, hi, lw.off), wlo = __funnelshift_l(lo, mid, lw.off);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int sh = 48 - j * K;
        if (sh >= 32)
            s[j] = ((MH >> j & 1) && sh > 32 ? shr_mul(whi, sh - 32) : whi >> (sh - 32)) & 0xffffu;
        else
            s[j] = __funnelshift_r(wlo, whi, sh) & 0xffffu;
    }
}

/* Where warp strip `strip` of expert e reads: its tile words, and the block scales of its
 * rows g (sc0) and g + 8 (sc1), four E4M3 bytes a word. */
struct strip_src {
    const uint4 *words;
    const uint32_t *sc0, *sc1;
};
__device__ __forceinline__ strip_src strip_of(const P &p, int e, int strip, int g) {
    const int tiles_c = p.cols / 16, spr = p.cols / 32;
    strip_src r;
    r.words = reinterpret_cast<const uint4 *>(
        p.words + ((size_t)e * (p.rows / 16) + strip) * tiles_c * 8 * KK);
    r.sc0 = reinterpret_cast<const uint32_t *>(p.scales +
                                               ((size_t)e * p.rows + 16 * strip + g) * spr);
    r.sc1 = r.sc0 + 8 * spr / 4;
    return r;
}

/* One warp's chunk of tile words into shared memory by cp.async, as one commit group. */
template <int CHUNK>
__device__ __forceinline__ void chunk_async(uint4 *dst, const uint4 *src, int lane) {
#pragma unroll
    for (int i = 0; i < KK * CHUNK / 16; i++) {
        const int at = i * 32 + lane;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                         (uint32_t)__cvta_generic_to_shared(dst + at)),
                     "l"(src + at)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Between chunk c's scales and its decode: the CTA's barrier, then the loads a chunk or two
 * ahead (activations staged for c + 1 and read for c + 2, words and scales for c + 1), then
 * the wait for chunk c's words. The same in both kernels. */
template <int CHUNK, class StageX, class LoadX, class LoadScales>
__device__ __forceinline__ void chunk_next(int c, int n_chunks, uint4 *next_words,
                                           const uint4 *next_src, int lane, StageX stage_x,
                                           LoadX load_x, LoadScales load_scales) {
    __syncthreads();
    if (c + 1 < n_chunks) {
        stage_x((c + 1) & 1);
        if (c + 2 < n_chunks)
            load_x(c + 2);
    }
    if (c + 1 < n_chunks)
        chunk_async<CHUNK>(next_words, next_src, lane);
    else
        asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncwarp();
    if (c + 1 < n_chunks)
        load_scales(c + 1);
}

/* A chunk's block scales of rows g (sn0) and g + 8 (sn1), four E4M3 bytes a word, as f16x2. */
template <int SW>
__device__ __forceinline__ void scales_f16(const uint32_t *sn0, const uint32_t *sn1, uint32_t *s0,
                                           uint32_t *s1) {
#pragma unroll
    for (int i = 0; i < SW; i++) {
        e4m3x4_to_f16x2(sn0[i], s0[2 * i], s0[2 * i + 1]);
        e4m3x4_to_f16x2(sn1[i], s1[2 * i], s1[2 * i + 1]);
    }
}

/* The A fragment a[4] times the block scales of step st (32 inputs): a0, a2 are row g's. */
__device__ __forceinline__ void scale_a(uint32_t a[4], const uint32_t *s0, const uint32_t *s1,
                                        int st) {
    const __half2 sv0 = *reinterpret_cast<const __half2 *>(&s0[st >> 1]),
                  sv1 = *reinterpret_cast<const __half2 *>(&s1[st >> 1]);
    const __half2 w0 = st & 1 ? __high2half2(sv0) : __low2half2(sv0),
                  w1 = st & 1 ? __high2half2(sv1) : __low2half2(sv1);
    a[0] = h2_mul(a[0], w0);
    a[2] = h2_mul(a[2], w0);
    a[1] = h2_mul(a[1], w1);
    a[3] = h2_mul(a[3], w1);
}

template <int LAW, int SC, int EXT, int MINB, int WARPS, int MH = 0, int PK = 0, int CHUNK = 16>
__global__ void __launch_bounds__(WARPS * 32, MINB) gemv(const P p) {
    constexpr int NW = 8 * KK, CHUNK_COLS = 16 * CHUNK, X16_STRIDE = CHUNK_COLS / 2 + 16,
                  SW = CHUNK / 8;
    __shared__ uint4 w_s[2][WARPS][CHUNK * NW / 4];
    __shared__ __align__(16) uint32_t x_s[2][8][X16_STRIDE];
    const int e = blockIdx.y, z = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int strip = blockIdx.x * WARPS + warp, tiles_c = p.cols / 16;
    for (int i = threadIdx.x; i < 2 * 8 * X16_STRIDE; i += blockDim.x)
        (&x_s[0][0][0])[i] = 0;
    const strip_src src = strip_of(p, e, strip, g);
    const uint4 *wsrc = src.words;
    const uint32_t *sc0 = src.sc0, *sc1 = src.sc1;
    const lane_window lw = lane_window_of<KK>(lane);
    uint32_t sum[2];
    sum_bytes(sum, lane);
    const int n_chunks = tiles_c / CHUNK;
    float acc[4] = {};
    chunk_async<CHUNK>(w_s[0][warp], wsrc, lane);
    uint32_t sn0[SW], sn1[SW];
    auto load_scales = [&](int c) {
#pragma unroll
        for (int i = 0; i < SW; i++) {
            sn0[i] = sc0[c * SW + i];
            sn1[i] = sc1[c * SW + i];
        }
    };
    load_scales(0);
    const bool stager = threadIdx.x < CHUNK; /* token 0, tile threadIdx.x */
    uint4 xn = make_uint4(0, 0, 0, 0);
    auto load_x = [&](int c) {
        if (stager)
            xn = reinterpret_cast<const uint4 *>(p.x + (size_t)e * p.cols +
                                                 c * CHUNK_COLS)[threadIdx.x];
    };
    auto stage_x = [&](int buf) {
        if (!stager)
            return;
        const int xu = threadIdx.x;
        const uint4 v = xn;
        const uint4 n = make_uint4(__byte_perm(v.x, v.y, 0x6240), __byte_perm(v.z, v.w, 0x6240),
                                   __byte_perm(v.x, v.y, 0x7351), __byte_perm(v.z, v.w, 0x7351));
        const uint32_t vv[4] = {n.x, n.y, n.z, n.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t b0, b1;
            e4m3x4_to_f16x2(vv[i], b0, b1);
            *reinterpret_cast<uint2 *>(&x_s[buf][0][(xu >> 1) * 16 + i * 4 + (xu & 1) * 2]) =
                make_uint2(b0, b1);
        }
    };
    __syncthreads();
    load_x(0);
    stage_x(0);
    if (n_chunks > 1)
        load_x(1);
    for (int c = 0; c < n_chunks; c++) {
        uint32_t s0[2 * SW], s1[2 * SW];
        scales_f16<SW>(sn0, sn1, s0, s1);
        chunk_next<CHUNK>(c, n_chunks, w_s[(c + 1) & 1][warp],
                          wsrc + (size_t)(c + 1) * KK * 2 * CHUNK, lane, stage_x, load_x,
                          load_scales);
        const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[c & 1][warp]);
        const uint32_t *xq = &x_s[c & 1][g][q * 4];
#pragma unroll
        for (int st = 0; st < CHUNK / 2; st++) {
            uint32_t a[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t s[8];
                if (EXT == 0)
                    lane_states<KK>(tw + (2 * st + h) * NW, lw, s);
                else
                    states_shf<KK, MH>(tw + (2 * st + h) * NW, lw, s);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    s[j] *= TRELLIS_MUL;
                uint32_t d[2][4];
                mma_u8(d[0], s[0], s[4], s[1], s[5], sum, 0x6400u);
                mma_u8(d[1], s[2], s[6], s[3], s[7], sum, 0x6400u);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint32_t *ee = d[i >> 1] + 2 * (i & 1);
                    a[h][i] = law<LAW, PK>(ee[0], ee[1]);
                }
                if (SC)
                    scale_a(a[h], s0, s1, st);
            }
            const uint4 bx = *reinterpret_cast<const uint4 *>(xq + st * 16);
            mma_f16(acc, a[0], bx.x, bx.y);
            mma_f16(acc, a[1], bx.z, bx.w);
        }
    }
    if (q == 0) {
        float *y = p.y + ((size_t)z * gridDim.y + e) * p.rows;
        y[16 * strip + g] = acc[0];
        y[16 * strip + g + 8] = acc[2];
    }
}

/* --- Table laws: the codes read from a table in shared memory ------------------------------
 *
 * TAB = 1: TrellisMX v1's law e4m3 as it stands, read from a 64 KB table of every state's code
 * (LUT_E4M3[sigma(s)]): no hash, no byte sums, no rounding; exact, the same format.
 * TAB = 2: law e4m3-pair (docs/trellismx.md §14, not TrellisMX v1): one 16-bit state per two
 * weights (positions 2t, 2t+1, one f16x2 register of the A fragment; the state of 2t + 1), the
 * ring advancing 2K bits a state; its two E4M3 codes read from the 128 KB table of 65536 pairs.
 * TAB = 3: law e4m3-pair computed: code i = Q[s * M_i >> 22], a multiply, a shift and a read
 * of the 1 KB Q per code, no big table.
 * The big tables fill most of an SM's shared memory, so these kernels are persistent: a CTA
 * loads its table once and loops over strip groups. Lanes keep the spec's natural order (no
 * byte-sum MMA moves states between them), so the activations are staged in natural order. */

/* Lane l's four pair states (TAB = 2, 3) are steps 4l..4l+3, ending at ring bits 2K(4l + 1)
 * .. 2K(4l + 4): its window is lane_window_of<K, 2K>, its states lane_states<K, 4, 2K>. Here
 * the same four states as byte offsets into a table of u16 pairs (2s): a shift and a mask
 * each, where s * 2 after lane_states costs a third instruction. */
template <int K>
__device__ __forceinline__ void pair_offsets(const uint32_t *w, lane_window lw, uint32_t o[4]) {
    const uint32_t hi = w[lw.i0], mid = w[lw.i1], lo = w[lw.i2];
    const uint32_t whi = __funnelshift_l(mid, hi, lw.off), wlo = __funnelshift_l(lo, mid, lw.off);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int sh = 47 - 2 * K * j; /* state j, one bit up */
        o[j] = (sh >= 32 ? whi >> (sh - 32) : __funnelshift_r(wlo, whi, sh)) & 0x1fffeu;
    }
}

template <int TAB> constexpr int table_bytes() { /* in dynamic shared memory (TAB 3: none) */
    return TAB == 1 ? 65536 : TAB == 2 ? 131072 : 0;
}

template <int TAB, int WARPS> constexpr int table_smem() {
    return table_bytes<TAB>() + 2 * WARPS * 16 * 8 * KK * 4 + 2 * 8 * (128 + 16) * 4;
}

/* OFS: the pair law's states as byte offsets (pair_offsets). SCF: the block scales multiply
 * each block's two MMA sums in f32 instead of the A fragments in f16 (one FFMA per row and 32
 * inputs instead of four HMUL2 a tile). */
template <int TAB, int WARPS, int OFS = 0, int SCF = 0, int MINB = 1>
__global__ void __launch_bounds__(WARPS * 32, MINB) gemv_table(const P p) {
    constexpr int NW = 8 * KK, CHUNK = 16, CHUNK_COLS = 16 * CHUNK,
                  X16_STRIDE = CHUNK_COLS / 2 + 16,
                  SW = CHUNK / 8, TB = table_bytes<TAB>();
    extern __shared__ __align__(16) uint8_t smem[];
    /* [65536] codes or [65536][2] pairs; Q[1024] in static shared memory, so that its reads
     * take their base as an immediate */
    __shared__ __align__(16) uint8_t q_s[TAB == 3 ? 1024 : 16];
    uint8_t *tab = TAB == 3 ? q_s : smem;
    uint4(*w_s)[WARPS][CHUNK * NW / 4] =              /* [2][WARPS] chunks of words */
        reinterpret_cast<uint4(*)[WARPS][CHUNK * NW / 4]>(smem + TB);
    uint32_t(*x_s)[8][X16_STRIDE] =                   /* [2][8 tokens] f16x2, natural order */
        reinterpret_cast<uint32_t(*)[8][X16_STRIDE]>(
            smem + TB + sizeof(uint4) * 2 * WARPS * CHUNK * NW / 4);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    for (int i = threadIdx.x; i < (TAB == 3 ? 1024 : TB) / 16; i += blockDim.x)
        reinterpret_cast<uint4 *>(tab)[i] = reinterpret_cast<const uint4 *>(p.table)[i];
    for (int i = threadIdx.x; i < 2 * 8 * X16_STRIDE; i += blockDim.x)
        (&x_s[0][0][0])[i] = 0;
    const lane_window lw =
        TAB == 1 ? lane_window_of<KK>(lane) : lane_window_of<KK, 2 * KK>(lane);
    const int tiles_c = p.cols / 16, n_chunks = tiles_c / CHUNK;
    const int groups = p.rows / (16 * WARPS), items = p.mats * p.experts * groups;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int z = item / (p.experts * groups), e = item / groups % p.experts;
        const int strip = item % groups * WARPS + warp;
        const strip_src src = strip_of(p, e, strip, g);
        const uint4 *wsrc = src.words;
        const uint32_t *sc0 = src.sc0, *sc1 = src.sc1;
        float acc[4] = {};
        uint32_t sn0[SW], sn1[SW];
        auto load_scales = [&](int c) {
#pragma unroll
            for (int i = 0; i < SW; i++) {
                sn0[i] = sc0[c * SW + i];
                sn1[i] = sc1[c * SW + i];
            }
        };
        /* Thread u < 16 stages tile u of a chunk: word 16(u / 2) + 4q + 2(u % 2) + h holds
         * columns 2q + 8h, + 1 of tile u, so a lane's B fragments of a step are one uint4. */
        const bool stager = threadIdx.x < CHUNK;
        uint4 xn = make_uint4(0, 0, 0, 0);
        auto load_x = [&](int c) {
            if (stager)
                xn = reinterpret_cast<const uint4 *>(p.x + (size_t)e * p.cols +
                                                     c * CHUNK_COLS)[threadIdx.x];
        };
        auto stage_x = [&](int buf) {
            if (!stager)
                return;
            const int u = threadIdx.x;
            uint32_t f[8]; /* f16x2 of columns 2m, 2m + 1 */
            e4m3x4_to_f16x2(xn.x, f[0], f[1]);
            e4m3x4_to_f16x2(xn.y, f[2], f[3]);
            e4m3x4_to_f16x2(xn.z, f[4], f[5]);
            e4m3x4_to_f16x2(xn.w, f[6], f[7]);
#pragma unroll
            for (int qq = 0; qq < 4; qq++)
                *reinterpret_cast<uint2 *>(&x_s[buf][0][16 * (u >> 1) + 4 * qq + 2 * (u & 1)]) =
                    make_uint2(f[qq], f[qq + 4]);
        };
        __syncthreads(); /* the table, and the previous item's last reads of x_s */
        chunk_async<CHUNK>(w_s[0][warp], wsrc, lane);
        load_scales(0);
        load_x(0);
        stage_x(0);
        if (n_chunks > 1)
            load_x(1);
        for (int c = 0; c < n_chunks; c++) {
            uint32_t s0[2 * SW], s1[2 * SW];
            scales_f16<SW>(sn0, sn1, s0, s1);
            chunk_next<CHUNK>(c, n_chunks, w_s[(c + 1) & 1][warp],
                              wsrc + (size_t)(c + 1) * KK * 2 * CHUNK, lane, stage_x, load_x,
                              load_scales);
            const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[c & 1][warp]);
            const uint32_t *xq = &x_s[c & 1][g][q * 4];
#pragma unroll
            for (int st = 0; st < CHUNK / 2; st++) {
                uint32_t a[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t *w = tw + (2 * st + h) * NW;
                    if (TAB == 1) { /* pairs j = 0, 1 -> a0; 2, 3 -> a2; 4, 5 -> a1; 6, 7 -> a3 */
                        uint32_t s[8];
                        lane_states<KK>(w, lw, s);
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            a[h][(i & 1) * 2 + (i >> 1)] =
                                e4m3x2_to_f16x2(
                                    __byte_perm(tab[s[2 * i]], tab[s[2 * i + 1]], 0x0040));
                    } else if (TAB == 3) {
                        uint32_t s[4];
                        lane_states<KK, 4, 2 * KK>(w, lw, s);
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            a[h][(i & 1) * 2 + (i >> 1)] = e4m3x2_to_f16x2(
                                __byte_perm(tab[s[i] * TMX_TRELLIS_PAIR_M0 >> 22],
                                            tab[s[i] * TMX_TRELLIS_PAIR_M1 >> 22], 0x0040));
                    } else if (!OFS) {
                        uint32_t s[4];
                        lane_states<KK, 4, 2 * KK>(w, lw, s);
                        const uint16_t *t16 = reinterpret_cast<const uint16_t *>(tab);
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            a[h][(i & 1) * 2 + (i >> 1)] = e4m3x2_to_f16x2(t16[s[i]]);
                    } else {
                        uint32_t o[4];
                        pair_offsets<KK>(w, lw, o);
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            a[h][(i & 1) * 2 + (i >> 1)] =
                                e4m3x2_to_f16x2(*reinterpret_cast<const uint16_t *>(tab + o[i]));
                    }
                    if (!SCF)
                        scale_a(a[h], s0, s1, st);
                }
                const uint4 bx = *reinterpret_cast<const uint4 *>(xq + st * 16);
                if (SCF) {
                    float blk[4] = {};
                    mma_f16(blk, a[0], bx.x, bx.y);
                    mma_f16(blk, a[1], bx.z, bx.w);
                    const __half2 sv0 = *reinterpret_cast<const __half2 *>(&s0[st >> 1]),
                                  sv1 = *reinterpret_cast<const __half2 *>(&s1[st >> 1]);
                    acc[0] = fmaf(blk[0], st & 1 ? __high2float(sv0) : __low2float(sv0), acc[0]);
                    acc[2] = fmaf(blk[2], st & 1 ? __high2float(sv1) : __low2float(sv1), acc[2]);
                } else {
                    mma_f16(acc, a[0], bx.x, bx.y);
                    mma_f16(acc, a[1], bx.z, bx.w);
                }
            }
        }
        if (q == 0) {
            float *y = p.y + ((size_t)z * p.experts + e) * p.rows;
            y[16 * strip + g] = acc[0];
            y[16 * strip + g + 8] = acc[2];
        }
    }
}

/* --- A law linear in sigma (not TrellisMX v1): what it would buy ---------------------------
 *
 * The candidate: w = sw (sigma - 510) / 128, EXL3's mul1 values without a rounding, with E4M3
 * block scales sw per 32 inputs (SC = 1) or none (SC = 0), and int8 inputs q times an f32
 * scale per 32 inputs (SC = 1) or per row (SC = 0). A weight's four hash bytes times its
 * input splatted four times sums to sigma q, so one u8 x s8 MMA a tile half gives a lane's
 * rows their sums of sigma q directly (EXL3's int8 GEMV, on the tensor cores): no byte-sum
 * packing, no law, no f16 MMA. The -510 sum q of a block rides in the MMA's accumulator
 * input; the scales multiply once a block (SC = 1) or once a row. One token. */
__device__ __forceinline__ void mma_u8s8(uint32_t d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int SC> __global__ void __launch_bounds__(128, 8) gemv_idot(const P p) {
    constexpr int WARPS = 4, CHUNK = 16, NW = 8 * KK, SW = CHUNK / 8;
    __shared__ uint4 w_s[2][WARPS][CHUNK * NW / 4];
    /* [token 0, then zeros for the lanes of other tokens][tile][q]: the splats of token 0's
     * inputs 2q, 2q + 1, 2q + 8, 2q + 9 of the tile, the B fragments of a lane's two MMAs */
    __shared__ uint4 x_s[2][2][CHUNK][4];
    __shared__ uint4 k_s[2][4]; /* SC: a block's -510 sum q (int32 [8]), then sx / 128 ([8]) */
    const int e = blockIdx.y, z = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int strip = blockIdx.x * WARPS + warp, tiles_c = p.cols / 16, n_chunks = tiles_c / CHUNK;
    for (int i = threadIdx.x; i < 2 * 2 * CHUNK * 4; i += blockDim.x)
        (&x_s[0][0][0][0])[i] = make_uint4(0, 0, 0, 0);
    const strip_src src = strip_of(p, e, strip, g);
    const uint4 *wsrc = src.words;
    const uint32_t *sc0 = src.sc0, *sc1 = src.sc1;
    const uint4 *xsrc = reinterpret_cast<const uint4 *>(p.xs) + (size_t)e * tiles_c * 4;
    const uint4 *ksrc = reinterpret_cast<const uint4 *>(p.xk) + (size_t)e * n_chunks * 4;
    const lane_window lw = lane_window_of<KK>(lane);
    chunk_async<CHUNK>(w_s[0][warp], wsrc, lane);
    uint32_t sn0[SW], sn1[SW];
    auto load_scales = [&](int c) {
        if (SC)
#pragma unroll
            for (int i = 0; i < SW; i++) {
                sn0[i] = sc0[c * SW + i];
                sn1[i] = sc1[c * SW + i];
            }
    };
    load_scales(0);
    const bool xt = threadIdx.x < CHUNK * 4, kt = SC && threadIdx.x >= 64 && threadIdx.x < 68;
    uint4 xn = make_uint4(0, 0, 0, 0);
    auto load_x = [&](int c) {
        if (xt)
            xn = xsrc[c * CHUNK * 4 + threadIdx.x];
        else if (kt)
            xn = ksrc[c * 4 + threadIdx.x - 64];
    };
    auto stage_x = [&](int buf) {
        if (xt)
            (&x_s[buf][0][0][0])[threadIdx.x] = xn;
        else if (kt)
            k_s[buf][threadIdx.x - 64] = xn;
    };
    __syncthreads();
    load_x(0);
    stage_x(0);
    if (n_chunks > 1)
        load_x(1);
    uint32_t dr[4]; /* SC = 0: the row's sums, from -510 sum q of the row */
    if (!SC)
        dr[0] = dr[1] = dr[2] = dr[3] = p.xk[2 * e];
    float acc0 = 0.0f, acc2 = 0.0f;
    for (int c = 0; c < n_chunks; c++) {
        uint32_t s0[2 * SW], s1[2 * SW];
        if (SC)
            scales_f16<SW>(sn0, sn1, s0, s1);
        chunk_next<CHUNK>(c, n_chunks, w_s[(c + 1) & 1][warp],
                          wsrc + (size_t)(c + 1) * KK * 2 * CHUNK, lane, stage_x, load_x,
                          load_scales);
        const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[c & 1][warp]);
        const uint4 *xq = &x_s[c & 1][g ? 1 : 0][0][q];
        const int32_t *kc = reinterpret_cast<const int32_t *>(&k_s[c & 1][0]);
        const float *kf = reinterpret_cast<const float *>(&k_s[c & 1][2]);
#pragma unroll
        for (int st = 0; st < CHUNK / 2; st++) {
            uint32_t db[4];
            uint32_t *d = SC ? db : dr;
            if (SC)
                db[0] = db[1] = db[2] = db[3] = kc[st];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t s[8];
                lane_states<KK>(tw + (2 * st + h) * NW, lw, s);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    s[j] *= TRELLIS_MUL;
                const uint4 b = xq[(2 * st + h) * 4];
                mma_u8s8(d, s[0], s[4], s[1], s[5], b.x, b.y);
                mma_u8s8(d, s[2], s[6], s[3], s[7], b.z, b.w);
            }
            if (SC) {
                const __half2 sv0 = *reinterpret_cast<const __half2 *>(&s0[st >> 1]),
                              sv1 = *reinterpret_cast<const __half2 *>(&s1[st >> 1]);
                const float t = kf[st];
                const float w0 = st & 1 ? __high2float(sv0) : __low2float(sv0),
                            w1 = st & 1 ? __high2float(sv1) : __low2float(sv1);
                acc0 = fmaf(w0 * t, (float)(int32_t)db[0], acc0);
                acc2 = fmaf(w1 * t, (float)(int32_t)db[2], acc2);
            }
        }
    }
    if (!SC) {
        const float t = __int_as_float((int)p.xk[2 * e + 1]);
        acc0 = t * (float)(int32_t)dr[0];
        acc2 = t * (float)(int32_t)dr[2];
    }
    if (q == 0) {
        float *y = p.y + ((size_t)z * gridDim.y + e) * p.rows;
        y[16 * strip + g] = acc0;
        y[16 * strip + g + 8] = acc2;
    }
}

/* every sigma through each law: out[v][sigma] f16 bits */
template <int LAW> __global__ void law_table(uint16_t *out) {
    const int s = threadIdx.x + blockIdx.x * blockDim.x;
    if (s >= 1021)
        return;
    const uint32_t r = law<LAW>(0x6400 + s, 0x6400 + 1020 - s);
    out[s] = r & 0xffff;
    out[1024 + (1020 - s)] = r >> 16;
}

typedef void (*kern)(const P);
struct V {
    const char *name;
    kern k;
    int warps;
    int exact; /* 0: ablation; 1: TrellisMX v1 law e4m3; 2: law e4m3-pair; 3, 4: the linear
                * law with block scales, without (gemv_idot) */
    int smem;  /* dynamic shared memory of a persistent kernel (table laws), else 0 */
    const uint8_t *const *table; /* its table: codes, pairs or Q */
};

/* y[e][r] = sum_k W[r][k] s[r][k / 32] x[k] in double, W decoded on the host by tmx-trellis's
 * decoder of `law`, and sum |terms| for the tolerance. */
static void host_gemv(const struct tmx_trellis_law *law, const uint32_t *w, const uint8_t *sc,
                      const uint8_t *x, int E, int R, int C, std::vector<double> &y,
                      std::vector<double> &mag) {
    const int NW = 8 * KK, tc = C / 16;
    std::vector<float> tile(256);
    y.assign((size_t)E * R, 0.0);
    mag.assign((size_t)E * R, 0.0);
    for (int e = 0; e < E; e++)
        for (int ti = 0; ti < R / 16; ti++)
            for (int tj = 0; tj < tc; tj++) {
                const uint32_t *tw = w + (((size_t)e * (R / 16) + ti) * tc + tj) * NW;
                tmx_trellis_decode_values(law, tw, KK, tile.data());
                for (int r = 0; r < 16; r++) {
                    const size_t row = (size_t)e * R + 16 * ti + r;
                    const double bs = tmx_e4m3_to_f32(sc[row * (C / 32) + tj / 2]);
                    for (int c = 0; c < 16; c++) {
                        const double v =
                            tile[16 * r + c] * bs * tmx_e4m3_to_f32(x[(size_t)e * C + 16 * tj + c]);
                        y[row] += v;
                        mag[row] += fabs(v);
                    }
                }
            }
}

/* The same for gemv_idot's linear law: W = sw (sigma - 510) / 128 (sw = 1 without block
 * scales), x = q sx, sx per 32 inputs (sx[e][k / 32]) or per row (sx[e][0]). */
static void host_idot(bool blocks, const uint32_t *w, const uint8_t *sc, const int8_t *xq,
                      const float *sx, int E, int R, int C, std::vector<double> &y,
                      std::vector<double> &mag) {
    const int NW = 8 * KK, tc = C / 16;
    uint16_t states[256];
    y.assign((size_t)E * R, 0.0);
    mag.assign((size_t)E * R, 0.0);
    for (int e = 0; e < E; e++)
        for (int ti = 0; ti < R / 16; ti++)
            for (int tj = 0; tj < tc; tj++) {
                tmx_trellis_states(w + (((size_t)e * (R / 16) + ti) * tc + tj) * NW, KK, states);
                for (int t = 0; t < 256; t++) {
                    const int pos = tmx_trellis_pos(t), r = pos / 16, k = 16 * tj + pos % 16;
                    const size_t row = (size_t)e * R + 16 * ti + r;
                    const double sw = blocks ? tmx_e4m3_to_f32(sc[row * (C / 32) + k / 32]) : 1.0;
                    const double v = sw * (tmx_trellis_sigma(states[t]) - 510) / 128.0 *
                                     xq[(size_t)e * C + k] *
                                     sx[(size_t)e * (C / 32) + (blocks ? k / 32 : 0)];
                    y[row] += v;
                    mag[row] += fabs(v);
                }
            }
}

int main(int argc, char **argv) {
    FILE *json = NULL;
    int warm = 3, reps = 20; /* --profile: one of each, for a profiler's counters */
    if (argc == 3 && strcmp(argv[1], "--json") == 0) {
        if (!(json = fopen(argv[2], "w"))) {
            printf("gemv_variants: %s: cannot write\n", argv[2]);
            return 2;
        }
    } else if (argc == 2 && strcmp(argv[1], "--profile") == 0) {
        warm = 0;
        reps = 1;
    } else if (argc != 1) {
        printf("usage: trellis-gemv-variants [--json FILE | --profile]\n");
        return 2;
    }
    const int E = 8, R = 4096, C = 4096;
    const size_t tiles = (size_t)R * C / 256, nw = tiles * 8 * KK;
    std::vector<uint32_t> hw(nw * E);
    std::vector<uint8_t> hs((size_t)R * C / 32 * E), hx((size_t)E * C);
    uint64_t st = 88172645463325252ull;
    auto rnd = [&]() {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        return (uint32_t)st;
    };
    for (auto &v : hw)
        v = rnd();
    for (auto &v : hs)
        v = 0x30 + rnd() % 16;
    for (auto &v : hx)
        v = (rnd() % 2 ? 0x80 : 0) | (0x30 + rnd() % 16);
    /* The table laws' tables: v1's code of every state, and law e4m3-pair's pairs. */
    struct tmx_trellis_law l1, l2;
    char *err = NULL;
    if (tmx_trellis_law_init(&l1, TMX_TRELLIS_LAW_E4M3, 1.0f, &err) != TMX_OK ||
        tmx_trellis_law_init(&l2, TMX_TRELLIS_LAW_PAIR, 1.0f, &err) != TMX_OK) {
        printf("gemv_variants: %s\n", err);
        return 1;
    }
    std::vector<uint8_t> codes(65536);
    for (int s = 0; s < 65536; s++)
        codes[s] = l1.code[tmx_trellis_sigma((uint16_t)s)];
    std::vector<uint16_t> pairs(l2.pairs, l2.pairs + 65536);
    /* gemv_idot's inputs: int8 q and f32 scales sx (per 32 inputs; the per-row variant takes
     * each row's first), staged as the splats its lanes read ([e][tile][q][4]) and its
     * constants: per chunk of 256 inputs the blocks' -510 sum q then sx / 128 (blocks), or
     * per row -510 sum q and sx / 128 (no blocks). */
    std::vector<int8_t> hq((size_t)E * C);
    std::vector<float> hsx((size_t)E * C / 32);
    for (auto &v : hq)
        v = (int8_t)(rnd() % 255 - 127);
    for (auto &v : hsx)
        v = 0.5f + (rnd() % 1024) / 2048.0f;
    std::vector<uint32_t> xsplat((size_t)E * C / 16 * 16), xk1((size_t)E * C / 256 * 16),
        xk0((size_t)E * 2);
    auto splat = [](int8_t v) { return (uint32_t)(uint8_t)v * 0x01010101u; };
    for (int e = 0; e < E; e++) {
        const int8_t *qe = &hq[(size_t)e * C];
        for (int tj = 0; tj < C / 16; tj++)
            for (int qq = 0; qq < 4; qq++) {
                uint32_t *o = &xsplat[(((size_t)e * (C / 16) + tj) * 4 + qq) * 4];
                const int k = 16 * tj + 2 * qq;
                o[0] = splat(qe[k]);
                o[1] = splat(qe[k + 1]);
                o[2] = splat(qe[k + 8]);
                o[3] = splat(qe[k + 9]);
            }
        int row_sum = 0;
        for (int b = 0; b < C / 32; b++) {
            int sum = 0;
            for (int k = 0; k < 32; k++)
                sum += qe[32 * b + k];
            row_sum += sum;
            uint32_t *o = &xk1[((size_t)e * (C / 256) + b / 8) * 16];
            o[b % 8] = (uint32_t)(-510 * sum);
            const float t = hsx[(size_t)e * (C / 32) + b] / 128.0f;
            memcpy(&o[8 + b % 8], &t, 4);
        }
        xk0[2 * e] = (uint32_t)(-510 * row_sum);
        const float t = hsx[(size_t)e * (C / 32)] / 128.0f;
        memcpy(&xk0[2 * e + 1], &t, 4);
    }
    std::vector<double> yref[5], mag[5];
    host_gemv(&l1, hw.data(), hs.data(), hx.data(), E, R, C, yref[1], mag[1]);
    host_gemv(&l2, hw.data(), hs.data(), hx.data(), E, R, C, yref[2], mag[2]);
    host_idot(true, hw.data(), hs.data(), hq.data(), hsx.data(), E, R, C, yref[3], mag[3]);
    host_idot(false, hw.data(), hs.data(), hq.data(), hsx.data(), E, R, C, yref[4], mag[4]);
    uint32_t *dxs, *dxk1, *dxk0;
    CK(cudaMalloc(&dxs, xsplat.size() * 4));
    CK(cudaMalloc(&dxk1, xk1.size() * 4));
    CK(cudaMalloc(&dxk0, xk0.size() * 4));
    CK(cudaMemcpy(dxs, xsplat.data(), xsplat.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dxk1, xk1.data(), xk1.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dxk0, xk0.data(), xk0.size() * 4, cudaMemcpyHostToDevice));
    uint32_t *dw;
    uint8_t *ds, *dx, *dxk, *dcodes, *dpairs, *dq;
    float *dy;
    CK(cudaMalloc(&dw, hw.size() * 4));
    CK(cudaMalloc(&ds, hs.size()));
    CK(cudaMalloc(&dx, hx.size()));
    CK(cudaMalloc(&dy, (size_t)2 * E * R * 4));
    CK(cudaMalloc(&dcodes, codes.size()));
    CK(cudaMalloc(&dpairs, pairs.size() * 2));
    CK(cudaMalloc(&dq, 1024));
    CK(cudaMemcpy(dw, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds, hs.data(), hs.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, hx.data(), hx.size(), cudaMemcpyHostToDevice));
    /* The mm.cu copies read x in kappa order (trellis_cuda.h): within 32 inputs, k = 16h + 4q
     * + i holds input 16h + 2q + (i & 1) + 8(i >> 1); the table kernels read natural order. */
    std::vector<uint8_t> hxk(hx.size());
    for (size_t b = 0; b < hx.size(); b += 32)
        for (int k = 0; k < 32; k++)
            hxk[b + k] = hx[b + (k & 16) + 2 * (k >> 2 & 3) + (k & 1) + 8 * (k >> 1 & 1)];
    CK(cudaMalloc(&dxk, hxk.size()));
    CK(cudaMemcpy(dxk, hxk.data(), hxk.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dcodes, codes.data(), codes.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpairs, pairs.data(), pairs.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dq, l2.quantiles, 1024, cudaMemcpyHostToDevice));
    // law check: every sigma, both halves
    {
        uint16_t *dt;
        CK(cudaMalloc(&dt, 4 * 2048 * 2));
        law_table<0><<<4, 256>>>(dt);
        law_table<1><<<4, 256>>>(dt + 2048);
        law_table<2><<<4, 256>>>(dt + 4096);
        law_table<3><<<4, 256>>>(dt + 6144);
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> t(4 * 2048);
        CK(cudaMemcpy(t.data(), dt, t.size() * 2, cudaMemcpyDeviceToHost));
        for (int l = 1; l < 4; l++) {
            int bad = 0;
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 1021; s++)
                    bad += t[l * 2048 + h * 1024 + s] != t[h * 1024 + s];
            printf("law %d: %d of 2042 differ from law 0 (F2FP)\n", l, bad);
        }
    }
    V vs[] = {
        {"states as in decode.cuh (IMAD.SHL + shift)", gemv<0, 1, 0, 8, 4>, 4, 1, 0, NULL},
        {"states by mul.hi + mask (ab44059)", gemv<0, 1, 1, 8, 4, 0x3f>, 4, 1, 0, NULL},
        {"states by shift + mask", gemv<0, 1, 1, 8, 4>, 4, 1, 0, NULL},
        {"shift + mask, 2 of 6 by mul.hi", gemv<0, 1, 1, 8, 4, 0x06>, 4, 1, 0, NULL},
        {"decode.cuh, pack by PRMT", gemv<0, 1, 0, 8, 4, 0, 1>, 4, 1, 0, NULL},
        {"decode.cuh, chunk 32, 5 CTA/SM", gemv<0, 1, 0, 5, 4, 0, 0, 32>, 4, 1, 0, NULL},
        {"decode.cuh, 4 CTA/SM (128 regs)", gemv<0, 1, 0, 4, 4>, 4, 1, 0, NULL},
        {"decode.cuh, 8 warps/CTA", gemv<0, 1, 0, 4, 8>, 8, 1, 0, NULL},
        {"law by Veltkamp split + fix, no cvt", gemv<2, 1, 0, 8, 4>, 4, 1, 0, NULL},
        {"v1 law by 64 KB state table, 16 warps", gemv_table<1, 16>, 16, 1, table_smem<1, 16>(),
         &dcodes},
        {"v1 law by 64 KB state table, 32 warps", gemv_table<1, 32>, 32, 1, table_smem<1, 32>(),
         &dcodes},
        {"v1 law by state table, f32 block scales", gemv_table<1, 16, 0, 1>, 16, 1,
         table_smem<1, 16>(), &dcodes},
        {"e4m3-pair, 128 KB table, 16 warps", gemv_table<2, 16>, 16, 2, table_smem<2, 16>(),
         &dpairs},
        {"e4m3-pair, byte offsets", gemv_table<2, 16, 1>, 16, 2, table_smem<2, 16>(), &dpairs},
        {"e4m3-pair, byte offsets, f32 block scales", gemv_table<2, 16, 1, 1>, 16, 2,
         table_smem<2, 16>(), &dpairs},
        {"e4m3-pair, byte offsets, 8 warps", gemv_table<2, 8, 1>, 8, 2, table_smem<2, 8>(),
         &dpairs},
        {"e4m3-pair computed, 8 warps x 4 CTAs", gemv_table<3, 8, 0, 0, 4>, 8, 2,
         table_smem<3, 8>(), &dq},
        {"e4m3-pair computed, f32 block scales", gemv_table<3, 8, 0, 1, 4>, 8, 2,
         table_smem<3, 8>(), &dq},
        {"linear law, int8 inputs, u8 x s8 MMA, blocks", gemv_idot<1>, 4, 3, 0, NULL},
        {"linear law, int8 inputs, no block scales", gemv_idot<0>, 4, 4, 0, NULL},
        {"ABL: law without its cvt pair", gemv<1, 1, 0, 8, 4>, 4, 0, 0, NULL},
        {"ABL: no block scales", gemv<0, 0, 0, 8, 4>, 4, 0, 0, NULL},
        {"ABL: neither", gemv<1, 0, 0, 8, 4>, 4, 0, 0, NULL},
    };
    const int NV = sizeof vs / sizeof vs[0];
    std::vector<float> ref((size_t)2 * E * R), out((size_t)2 * E * R);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("%-46s %9s %9s %12s %9s %s\n", "variant", "1 mat ms", "2 mats ms", "weights/s(2)",
           "max err", "check");
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (json)
        fprintf(json, "{\"gpu\": \"%s\", \"sms\": %d, \"experts\": %d, \"rows\": %d, "
                      "\"cols\": %d, \"K\": %d, \"variants\": [",
                prop.name, sms, E, R, C, KK);
    int bugs = 0;
    for (int i = 0; i < NV; i++) {
        P p = {dw, ds, dy, R, C, vs[i].smem ? dx : dxk, vs[i].table ? *vs[i].table : NULL, E, 1,
               dxs, vs[i].exact == 4 ? dxk0 : dxk1};
        if (vs[i].smem)
            CK(cudaFuncSetAttribute(vs[i].k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    vs[i].smem));
        float ms[2];
        for (int nm = 1; nm <= 2; nm++) {
            p.mats = nm;
            int per_sm = 1; /* persistent kernels: as many CTAs as fit */
            if (vs[i].smem)
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, vs[i].k,
                                                                 vs[i].warps * 32, vs[i].smem));
            const dim3 grid =
                vs[i].smem ? dim3(sms * per_sm) : dim3(R / (16 * vs[i].warps), E, nm);
            for (int r = 0; r < warm; r++)
                vs[i].k<<<grid, vs[i].warps * 32, vs[i].smem>>>(p);
            CK(cudaGetLastError());
            CK(cudaEventRecord(a));
            for (int r = 0; r < reps; r++)
                vs[i].k<<<grid, vs[i].warps * 32, vs[i].smem>>>(p);
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            CK(cudaEventElapsedTime(&ms[nm - 1], a, b));
            ms[nm - 1] /= reps;
        }
        CK(cudaMemcpy(i == 0 ? ref.data() : out.data(), dy, out.size() * 4,
                      cudaMemcpyDeviceToHost));
        const float *o = i == 0 ? ref.data() : out.data();
        /* Against the host: |y - y_host| <= 2^-16 sum |terms| (f32 sums of exact products). */
        double worst = 0.0;
        if (vs[i].exact)
            for (size_t j = 0; j < out.size(); j++) {
                const size_t r = j % ((size_t)E * R);
                const int x = vs[i].exact;
                worst = fmax(worst, fabs(o[j] - yref[x][r]) / (mag[x][r] + 1e-30));
            }
        const bool host_ok = !vs[i].exact || worst <= 0x1p-16;
        int diff = 0;
        if (i)
            for (size_t j = 0; j < out.size(); j++)
                diff += memcmp(&out[j], &ref[j], 4) != 0;
        const char *check = !host_ok              ? "DIFFERS FROM THE HOST (BUG)"
                            : i == 0              ? "reference, matches the host"
                            : vs[i].exact == 2    ? "e4m3-pair, matches the host"
                            : vs[i].exact >= 3    ? "linear law, matches the host"
                            : !diff               ? "bitwise equal"
                            : vs[i].exact         ? "matches the host, not bitwise"
                                                  : "differs (ablation)";
        bugs += !host_ok;
        const double wps = 2.0 * E * R * C / (ms[1] * 1e-3);
        printf("%-46s %9.4f %9.4f %12.3g %9.2g %s\n", vs[i].name, ms[0], ms[1], wps, worst,
               check);
        if (json)
            fprintf(json, "%s\n  {\"variant\": \"%s\", \"ms_one_matrix\": %.5f, "
                          "\"ms_two_matrices\": %.5f, \"weights_per_s\": %.4g, "
                          "\"max_rel_err\": %.3g, \"check\": \"%s\"}",
                    i ? "," : "", vs[i].name, ms[0], ms[1], wps, worst, check);
    }
    if (json) {
        fprintf(json, "\n]}\n");
        fclose(json);
    }
    return bugs ? 1 : 0;
}
