/* gemv_variants.cu: what bounds the K3 e4m3 trellis GEMV (docs/perf/h200-codec.md, "Where the
 * time goes"). A reduced copy of mm_kernel<3, e4m3, NG = 1> of plugins/trellis/cuda/mm.cu
 * (one token per expert, whole chunks, no epilogue scales) with compile-time switches for the
 * state extraction, the law, the block scales, the chunk size, the registers and the warps
 * per CTA; 8 experts x [4096][4096] random words, one and two matrices a launch (two: the
 * gate+up launch). Exact variants must equal the first bit for bit; ablations (which compute
 * wrong values on purpose, to price a step) are marked. Built as bin/trellis-gemv-variants
 * (plugins/trellis/cuda/CMakeLists.txt); run it on a GPU machine, no arguments. */
#include "decode.cuh"
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
    const uint4 *wsrc = reinterpret_cast<const uint4 *>(
        p.words + ((size_t)e * (p.rows / 16) + strip) * tiles_c * NW);
    const int spr = p.cols / 32;
    const uint32_t *sc0 =
        reinterpret_cast<const uint32_t *>(p.scales + ((size_t)e * p.rows + 16 * strip + g) * spr);
    const uint32_t *sc1 = sc0 + 8 * spr / 4;
    const lane_window lw = lane_window_of<KK>(lane);
    uint32_t sum[2];
    sum_bytes(sum, lane);
    const int n_chunks = tiles_c / CHUNK;
    float acc[4] = {};
    auto load_chunk = [&](uint4 *dst, const uint4 *src) {
#pragma unroll
        for (int i = 0; i < KK * CHUNK / 16; i++) {
            const int at = i * 32 + lane;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                             (uint32_t)__cvta_generic_to_shared(dst + at)),
                         "l"(src + at)
                         : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    load_chunk(w_s[0][warp], wsrc);
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
#pragma unroll
        for (int i = 0; i < SW; i++) {
            e4m3x4_to_f16x2(sn0[i], s0[2 * i], s0[2 * i + 1]);
            e4m3x4_to_f16x2(sn1[i], s1[2 * i], s1[2 * i + 1]);
        }
        __syncthreads();
        if (c + 1 < n_chunks) {
            stage_x((c + 1) & 1);
            if (c + 2 < n_chunks)
                load_x(c + 2);
        }
        if (c + 1 < n_chunks)
            load_chunk(w_s[(c + 1) & 1][warp], wsrc + (size_t)(c + 1) * KK * 2 * CHUNK);
        else
            asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        if (c + 1 < n_chunks)
            load_scales(c + 1);
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
                if (SC) {
                    const __half2 sv0 = *reinterpret_cast<const __half2 *>(&s0[st >> 1]),
                                  sv1 = *reinterpret_cast<const __half2 *>(&s1[st >> 1]);
                    const __half2 w0 = st & 1 ? __high2half2(sv0) : __low2half2(sv0),
                                  w1 = st & 1 ? __high2half2(sv1) : __low2half2(sv1);
                    a[h][0] = h2_mul(a[h][0], w0);
                    a[h][2] = h2_mul(a[h][2], w0);
                    a[h][1] = h2_mul(a[h][1], w1);
                    a[h][3] = h2_mul(a[h][3], w1);
                }
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
    int exact;
};

int main() {
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
    uint32_t *dw;
    uint8_t *ds, *dx;
    float *dy;
    CK(cudaMalloc(&dw, hw.size() * 4));
    CK(cudaMalloc(&ds, hs.size()));
    CK(cudaMalloc(&dx, hx.size()));
    CK(cudaMalloc(&dy, (size_t)2 * E * R * 4));
    CK(cudaMemcpy(dw, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds, hs.data(), hs.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, hx.data(), hx.size(), cudaMemcpyHostToDevice));
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
        {"states as in decode.cuh (IMAD.SHL + shift)", gemv<0, 1, 0, 8, 4>, 4, 1},
        {"states by mul.hi + mask (ab44059)", gemv<0, 1, 1, 8, 4, 0x3f>, 4, 1},
        {"states by shift + mask", gemv<0, 1, 1, 8, 4>, 4, 1},
        {"shift + mask, 2 of 6 by mul.hi", gemv<0, 1, 1, 8, 4, 0x06>, 4, 1},
        {"decode.cuh, pack by PRMT", gemv<0, 1, 0, 8, 4, 0, 1>, 4, 1},
        {"decode.cuh, chunk 32, 5 CTA/SM", gemv<0, 1, 0, 5, 4, 0, 0, 32>, 4, 1},
        {"decode.cuh, 4 CTA/SM (128 regs)", gemv<0, 1, 0, 4, 4>, 4, 1},
        {"decode.cuh, 8 warps/CTA", gemv<0, 1, 0, 4, 8>, 8, 1},
        {"law by Veltkamp split + fix, no cvt", gemv<2, 1, 0, 8, 4>, 4, 1},
        {"ABL: law without its cvt pair", gemv<1, 1, 0, 8, 4>, 4, 0},
        {"ABL: no block scales", gemv<0, 0, 0, 8, 4>, 4, 0},
        {"ABL: neither", gemv<1, 0, 0, 8, 4>, 4, 0},
    };
    const int NV = sizeof vs / sizeof vs[0];
    std::vector<float> ref((size_t)E * R), out((size_t)E * R);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("%-46s %9s %9s %12s %s\n", "variant", "1 mat ms", "2 mats ms", "weights/s(2)", "check");
    for (int i = 0; i < NV; i++) {
        P p = {dw, ds, dy, R, C, dx};
        float ms[2];
        for (int nm = 1; nm <= 2; nm++) {
            dim3 grid(R / (16 * vs[i].warps), E, nm);
            for (int r = 0; r < 3; r++)
                vs[i].k<<<grid, vs[i].warps * 32>>>(p);
            CK(cudaGetLastError());
            CK(cudaEventRecord(a));
            for (int r = 0; r < 20; r++)
                vs[i].k<<<grid, vs[i].warps * 32>>>(p);
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            CK(cudaEventElapsedTime(&ms[nm - 1], a, b));
            ms[nm - 1] /= 20;
        }
        CK(cudaMemcpy(i == 0 ? ref.data() : out.data(), dy, out.size() * 4,
                      cudaMemcpyDeviceToHost));
        int diff = 0;
        if (i)
            for (size_t j = 0; j < out.size(); j++)
                diff += memcmp(&out[j], &ref[j], 4) != 0;
        printf("%-46s %9.4f %9.4f %12.3g %s\n", vs[i].name, ms[0], ms[1],
               2.0 * E * R * C / (ms[1] * 1e-3),
               i == 0 ? "reference"
               : diff ? (vs[i].exact ? "DIFFERS (BUG)" : "differs (ablation)")
                      : "bitwise equal");
    }
    return 0;
}
