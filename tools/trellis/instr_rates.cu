/* instr_rates.cu: throughput of the instructions of the trellis decode loop on this GPU
 * (docs/perf/h200-codec.md, "Where the time goes"): each op followed by an xor (LOP3) in
 * eight independent chains per thread, 8 CTAs of 256 threads per SM; printed as (op + xor)
 * pairs per clock per SM at the reported clock. An op that shares the ALU pipe with the xor
 * shows about 1, a full-rate op on another pipe up to 2, slower ops less. Built as
 * bin/trellis-instr-rates (plugins/trellis/cuda/CMakeLists.txt); run it on a GPU machine. */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define N_ITER 4096
enum {
    F2E,
    E2F,
    LOP,
    SHF,
    IMAD,
    IADD,
    PRMT,
    HFMA2,
    HMUL2,
    MULHI,
    DP4A,
    FFMA,
    FUNNEL,
    LDSB,
    LDS32,
    POPC,
    NOPS
};
static const char *names[] = {"cvt f16x2->e4m3x2",
                              "cvt e4m3x2->f16x2",
                              "lop3",
                              "shf.r",
                              "imad",
                              "iadd3",
                              "prmt",
                              "hfma2",
                              "hmul2",
                              "mul.hi",
                              "dp4a",
                              "ffma",
                              "shf.funnel",
                              "lds u8 rand",
                              "lds u32 rand",
                              "popc"};
template <int OP> __global__ void k(uint32_t *out, uint32_t seed) {
    __shared__ uint32_t tab[1024];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x)
        tab[i] = i * 2654435761u;
    __syncthreads();
    uint32_t v[8];
    for (int j = 0; j < 8; j++)
        v[j] = seed ^ (threadIdx.x * 8 + j) * 0x9e3779b9u;
    for (int it = 0; it < N_ITER; it++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint32_t x = v[j], r;
            if (OP == F2E) {
                uint16_t b;
                asm volatile("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;"
                             : "=h"(b)
                             : "r"(x & 0x3fff3fffu));
                r = x + b;
            }
            if (OP == E2F) {
                asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((uint16_t)x));
            }
            if (OP == LOP)
                asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;"
                             : "=r"(r)
                             : "r"(x), "r"(0x1234u), "r"(x));
            if (OP == SHF)
                asm volatile("shr.b32 %0, %1, 7;" : "=r"(r) : "r"(x));
            if (OP == IMAD)
                asm volatile("mad.lo.u32 %0, %1, %2, %3;"
                             : "=r"(r)
                             : "r"(x), "r"(0x83DCD12Du), "r"(x));
            if (OP == IADD)
                asm volatile("add.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x1234567u));
            if (OP == PRMT)
                asm volatile("prmt.b32 %0, %1, %2, 0x6240;" : "=r"(r) : "r"(x), "r"(0x1234567u));
            if (OP == HFMA2)
                asm volatile("fma.rn.f16x2 %0, %1, %2, %3;"
                             : "=r"(r)
                             : "r"(x & 0x3bff3bffu), "r"(0x3c003c00u), "r"(0x1u));
            if (OP == HMUL2)
                asm volatile("mul.rn.f16x2 %0, %1, %2;"
                             : "=r"(r)
                             : "r"(x & 0x3bff3bffu), "r"(0x3c013c01u));
            if (OP == MULHI)
                asm volatile("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x10000u));
            if (OP == DP4A)
                asm volatile("dp4a.u32.u32 %0, %1, %2, %3;"
                             : "=r"(r)
                             : "r"(x), "r"(0x01010101u), "r"(x));
            if (OP == FFMA)
                asm volatile("fma.rn.f32 %0, %1, %2, %3;"
                             : "=r"(r)
                             : "r"(x & 0x3fffffffu), "r"(0x3f800000u), "r"(0x1u));
            if (OP == FUNNEL)
                asm volatile("shf.r.wrap.b32 %0, %1, %2, 5;" : "=r"(r) : "r"(x), "r"(x ^ 0x55u));
            if (OP == LDSB) {
                r = x + ((const uint8_t *)tab)[x & 1023];
            }
            if (OP == LDS32) {
                r = x + tab[x & 1023];
            }
            if (OP == POPC) {
                r = x + __popc(x);
            }
            v[j] = r ^ it;
        }
    }
    uint32_t s = 0;
    for (int j = 0; j < 8; j++)
        s ^= v[j];
    if (s == 0x12345678u)
        out[0] = s;
}
template <int OP> float run(uint32_t *out, int blocks) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    k<OP><<<blocks, 256>>>(out, 1);
    cudaEventRecord(a);
    k<OP><<<blocks, 256>>>(out, 2);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "instr_rates: %s\n", cudaGetErrorString(e));
        exit(1);
    }
    return ms;
}
template <int OP> void one(uint32_t *out, int sms, int clk_khz) {
    const int blocks = sms * 8;
    float ms = run<OP>(out, blocks);
    double instr = (double)blocks * 8 /*warps*/ * N_ITER * 8; // warp-level ops of interest
    double per = instr / (ms * 1e-3 * clk_khz * 1e3 * sms);
    printf("%-20s %8.3f ms  %6.2f (op + xor) pairs per clock per SM\n", names[OP], ms, per);
}
int main() {
    int sms, clk;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
    printf("%d SMs, clock %d kHz (each op followed by an xor)\n", sms,
           clk);
    uint32_t *out;
    cudaMalloc(&out, 4);
    one<F2E>(out, sms, clk);
    one<E2F>(out, sms, clk);
    one<LOP>(out, sms, clk);
    one<SHF>(out, sms, clk);
    one<IMAD>(out, sms, clk);
    one<IADD>(out, sms, clk);
    one<PRMT>(out, sms, clk);
    one<HFMA2>(out, sms, clk);
    one<HMUL2>(out, sms, clk);
    one<MULHI>(out, sms, clk);
    one<DP4A>(out, sms, clk);
    one<FFMA>(out, sms, clk);
    one<FUNNEL>(out, sms, clk);
    one<LDSB>(out, sms, clk);
    one<LDS32>(out, sms, clk);
    one<POPC>(out, sms, clk);
    return 0;
}
