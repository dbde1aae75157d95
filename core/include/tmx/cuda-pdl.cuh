/* tmx/cuda-pdl.cuh: programmatic dependent launch (sm_90 and later) for CUDA code that runs on
 * a kernel set's stream: the CUDA kernel set's kernels and a codec's device path.
 *
 * A decode step is a chain of short kernels recorded in a graph, and each one's launch used to
 * start only when the one before it had ended. Launched with the programmatic attribute, a
 * kernel may be scheduled while the one before it still runs; it then waits (tmx_pdl_enter,
 * its first statement) until that grid has finished and its writes are visible. Every kernel
 * launched programmatically must begin with tmx_pdl_enter; launched plainly, it is a no-op. */
#ifndef TMX_CUDA_PDL_CUH
#define TMX_CUDA_PDL_CUH

#include <cuda_runtime.h>

/* Waits for the grid before this one on the stream, then lets the next one be scheduled. */
__device__ __forceinline__ void tmx_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/* kernel<<<grid, block, smem, s>>>(args...), with the programmatic attribute when
 * `programmatic`. Returns the launch's status. */
template <typename... P, typename... A>
static inline cudaError_t tmx_cuda_launch(void (*kernel)(P...), dim3 grid, dim3 block,
                                          size_t smem, cudaStream_t s, int programmatic,
                                          A... args) {
    cudaLaunchAttribute pdl;
    pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = &pdl;
    cfg.numAttrs = programmatic ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

#endif
