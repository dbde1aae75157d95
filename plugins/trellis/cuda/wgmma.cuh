/* wgmma.cuh: Hopper's warpgroup MMA (sm_90a) from shared memory, K-major operands with the
 * 128-byte swizzle, f16 in, FP32 accumulators: the layout, the descriptor and the instruction
 * steps, shared by the wide GEMM (mm.cu) and tools/trellis/wgmma_rate.cu. */
#ifndef TMX_TRELLIS_WGMMA_CUH
#define TMX_TRELLIS_WGMMA_CUH

#include <stdint.h>

/* wgmma: word w (k order, 2 inputs) of token t's 128-byte row, its 16-byte piece swizzled. */
__device__ __forceinline__ int wgmma_word(int t, int w) {
    return w ^ (t & 7) << 2;
}

/* A wgmma descriptor of a K-major operand at shared address `at` (1024-byte aligned):
 * 128-byte swizzle (mode 1 in bits 62-63), 8-row groups 1024 bytes apart (the stride, bits
 * 32-45, in 16 bytes); the leading offset is unused with this swizzle (1). Adding 2 moves it
 * 16 inputs (32 bytes) along K. */
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t at) {
    return (uint64_t)((at & 0x3FFFF) >> 4) | 1ull << 16 | 64ull << 32 | 1ull << 62;
}

#define WG_ACC8(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WG_ACC32(d, i) WG_ACC8(d, i), WG_ACC8(d, i + 1), WG_ACC8(d, i + 2), WG_ACC8(d, i + 3), \
    WG_ACC8(d, i + 4), WG_ACC8(d, i + 5), WG_ACC8(d, i + 6), WG_ACC8(d, i + 7)

/* d += A B for one wgmma m64nNk16, f16 in, FP32 accumulators: A the 64 rows x 16 inputs at
 * desc_a, B the N tokens x 16 inputs at desc_b (both K-major, wgmma_desc); d[N / 8][4] in the
 * m16n8k16 C layout for each 8 tokens of the warp's 16 rows. Asynchronous: d stays untouched
 * until wgmma_wait. */
template <int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(N == 64 || N == 128 || N == 256, "wgmma takes 64, 128 or 256 columns here");
    if constexpr (N == 64)
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, "
                     "%5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, "
                     "0, 0;"
                     : WG_ACC32(d, 0)
                     : "l"(desc_a), "l"(desc_b));
    else if constexpr (N == 128)
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, "
                     "%5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
                     "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
                     "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "
                     "1, 1, 1, 0, 0;"
                     : WG_ACC32(d, 0), WG_ACC32(d, 8)
                     : "l"(desc_a), "l"(desc_b));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, "
                     "%5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
                     "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
                     "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
                     "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, "
                     "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, "
                     "%90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, "
                     "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, "
                     "%116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
                     "%127}, %128, %129, 1, 1, 1, 0, 0;"
                     : WG_ACC32(d, 0), WG_ACC32(d, 8), WG_ACC32(d, 16), WG_ACC32(d, 24)
                     : "l"(desc_a), "l"(desc_b));
#else
    __trap(); /* callers run wgmma on sm_90a only */
#endif
}

/* The warpgroup's wgmma steps: fence (the accumulators' registers as written before), commit
 * (the steps issued since form a group), wait (all groups but the latest PENDING done, their
 * accumulators final). */
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N, int PENDING>
__device__ __forceinline__ void wgmma_wait(float (&d)[N / 8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %32;" : WG_ACC32(d, 0) : "n"(PENDING) : "memory");
#pragma unroll
    for (int i = 8; i < N / 8; i += 8) asm volatile("" : WG_ACC32(d, i) :: "memory");
#endif
}

#endif
