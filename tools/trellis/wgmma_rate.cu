/* wgmma_rate.cu: what Hopper's tensor cores give the wide GEMM's operand layout
 * (docs/perf/h200-codec.md, "The wide GEMM's bound"): wgmma.m64nNk16 with both operands in
 * 128-byte-swizzled shared memory (wgmma.cuh), four k-steps a chunk of 64 inputs as in the
 * wide GEMM, through a ring of three stages, one CTA an SM and nothing else in the loop.
 * A CTA has WA x WB warpgroups: warpgroup h multiplies A rows 64 (h % WA) .. by B columns
 * N (h / WA) ..; after each chunk it waits until at most PENDING chunks of its wgmmas are
 * in flight, and with BAR the CTA meets at a barrier each chunk (the wide GEMM: 2 x 2, N = 128,
 * PENDING 1, BAR). Prints TFLOP/s and the share of the dense f16 peak at the SM clock the
 * device reports (4096 FLOP a clock an SM). Built as bin/trellis-wgmma-rate; needs sm_90. */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "wgmma.cuh"

#define STAGES 3

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "trellis-wgmma-rate: %s: %s\n", #x, cudaGetErrorString(e_));      \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

template <int N, int WA, int WB, int PENDING, bool BAR>
__global__ void __launch_bounds__(WA * WB * 128, 1) rate_kernel(float *sink, int chunks) {
    constexpr int STAGE = (64 * WA + N * WB) * 128; /* bytes: A rows, then B columns */
    extern __shared__ __align__(16) uint32_t smem[];
    const uint32_t at = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t base = (at + 1023u) & ~1023u;
    uint32_t *s = smem + (base - at) / 4;
    for (int i = threadIdx.x; i < STAGES * STAGE / 4; i += blockDim.x)
        s[i] = i % 9 == 0 ? 0x3c003c00u : 0u; /* some 1.0s: finite sums */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int h = threadIdx.x >> 7;
    const uint64_t da0 = wgmma_desc(base + 64 * (h % WA) * 128),
                   db0 = wgmma_desc(base + 64 * WA * 128 + N * (h / WA) * 128);
    float acc[N / 8][4] = {};
    for (int c = 0, st = 0; c < chunks; c++, st = st + 1 == STAGES ? 0 : st + 1) {
        if (BAR) __syncthreads();
        const uint64_t da = da0 + st * (STAGE / 16), db = db0 + st * (STAGE / 16);
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < 4; u++) wgmma<N>(acc, da + 2 * u, db + 2 * u);
        wgmma_commit();
        wgmma_wait<N, PENDING>(acc);
    }
    wgmma_wait<N, 0>(acc);
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc[0][0] + acc[N / 8 - 1][3];
}

template <int N, int WA, int WB, int PENDING, bool BAR>
static void run(const char *name, int sms, double peak, float *sink) {
    constexpr int STAGE = (64 * WA + N * WB) * 128, CHUNKS = 4096;
    const int smem = STAGES * STAGE + 1024;
    CK(cudaFuncSetAttribute(rate_kernel<N, WA, WB, PENDING, BAR>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    rate_kernel<N, WA, WB, PENDING, BAR><<<sms, WA * WB * 128, smem>>>(sink, 64); /* warm-up */
    CK(cudaGetLastError());
    CK(cudaEventRecord(e0));
    rate_kernel<N, WA, WB, PENDING, BAR><<<sms, WA * WB * 128, smem>>>(sink, CHUNKS);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    const double flop = (double)sms * CHUNKS * WA * WB * 4 * 64.0 * N * 16 * 2;
    const double tflops = flop / (ms * 1e-3) / 1e12;
    printf("  %-44s %8.1f TFLOP/s  %5.1f%% of peak  %8.3f ms\n", name, tflops,
           100.0 * tflops / peak, ms);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
}

int main(void) {
    int dev, sms, khz, major;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    if (major != 9) {
        fprintf(stderr, "trellis-wgmma-rate: needs a Hopper (sm_90), this is sm_%d*\n", major);
        return 1;
    }
    const double peak = sms * 4096.0 * khz * 1e3 / 1e12;
    printf("wgmma m64nNk16 f16 -> f32, both operands in shared memory; %d SMs at %.2f GHz, dense "
           "peak %.0f TFLOP/s\n",
           sms, khz * 1e-6, peak);
    float *sink;
    CK(cudaMalloc(&sink, (size_t)sms * 512 * sizeof(float)));
    run<128, 2, 2, 1, true>("2x2 warpgroups, N 128, 1 in flight, barrier", sms, peak, sink);
    run<128, 2, 2, 1, false>("2x2 warpgroups, N 128, 1 in flight", sms, peak, sink);
    run<128, 2, 2, 2, false>("2x2 warpgroups, N 128, 2 in flight", sms, peak, sink);
    run<256, 2, 1, 1, true>("2x1 warpgroups, N 256, 1 in flight, barrier", sms, peak, sink);
    run<256, 2, 1, 1, false>("2x1 warpgroups, N 256, 1 in flight", sms, peak, sink);
    run<256, 2, 1, 2, false>("2x1 warpgroups, N 256, 2 in flight", sms, peak, sink);
    run<64, 2, 4, 1, false>("2x4 warpgroups, N 64, 1 in flight", sms, peak, sink);
    CK(cudaFree(sink));
    return 0;
}
