// ptx_check.cu: asks a GPU (sm_89 or later) what its conversions give, for the claims of
// docs/trellismx.md that GPU decoders rely on:
//   - law e4m3 is EXL3's mul1 decode (hfma in fp16) followed by cvt.rn.satfinite.e4m3x2.f16x2;
//   - RNE_E4M3 is cvt.rn.satfinite.e4m3x2 on every fp16 and on chosen f32 inputs.
// It writes the GPU's answers to a file; tools/trellis/ptx_check.py compares them with the
// spec's rules (computed independently in Python).
//
//     nvcc -arch=sm_90 -o ptx_check tools/trellis/ptx_check.cu && ./ptx_check out.bin
//     python3 tools/trellis/ptx_check.py out.bin
//
// out.bin: u16[1021] fp16 bits of v(sigma), u8[1021] law bytes, u8[65536] e4m3 of each fp16
// bit pattern, u32 n, f32[n] inputs, u8[n] their e4m3 bytes.
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

__device__ uint8_t e4m3_of_f16(uint16_t h) {
    uint16_t out;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(out) : "r"((uint32_t)h * 0x10001u));
    return (uint8_t)out;
}

__device__ uint8_t e4m3_of_f32(float x) {
    uint16_t out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(x), "f"(x));
    return (uint8_t)out;
}

// sigma -> fp16(fma(1024 + sigma, 0x1EEE, 0xC931)) as EXL3's mul1 computes it, and its byte.
__global__ void law(uint16_t *v, uint8_t *code) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= 1021) return;
    const __half w = __hfma(__ushort_as_half((unsigned short)(0x6400 + s)),
                            __ushort_as_half(0x1EEE), __ushort_as_half(0xC931));
    v[s] = __half_as_ushort(w);
    code[s] = e4m3_of_f16(__half_as_ushort(w));
}

__global__ void all_f16(uint8_t *out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = e4m3_of_f16((uint16_t)i);
}

__global__ void some_f32(const float *x, uint8_t *out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = e4m3_of_f32(x[i]);
}

static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: ptx_check OUT.bin\n");
        return 2;
    }
    // f32 inputs: each E4M3 tie and its f32 neighbours, normal and subnormal, both signs; the
    // edges of the range; and pseudo-random values over 2^-12 .. 2^10.
    std::vector<float> ties;
    for (int e = -6; e <= 8; e++)
        for (int k = 0; k < 8; k++) ties.push_back(ldexpf(1.0f + (2 * k + 1) / 16.0f, e));
    for (int k = 0; k < 8; k++) ties.push_back(ldexpf((float)(2 * k + 1), -10));
    std::vector<float> x;
    for (float tie : ties) {
        uint32_t b;
        memcpy(&b, &tie, sizeof b);
        for (int d = -1; d <= 1; d++) {
            x.push_back(f32_of_bits(b + d));
            x.push_back(-f32_of_bits(b + d));
        }
    }
    const float edges[] = {0.0f, -0.0f, 448.0f, 449.0f, 464.0f, 479.9f, 480.0f, 1e30f,
                           INFINITY, -INFINITY, 1e-40f, -1e-40f, 0x1p-10f, 0x1.000002p-10f};
    for (float v : edges) x.push_back(v);
    uint32_t r = 12345;
    for (int i = 0; i < 200000; i++) {
        r = r * 1664525u + 1013904223u;
        const uint32_t exp = 115 + (r >> 8) % 22; /* 2^-12 .. 2^9 */
        x.push_back(f32_of_bits((r & 0x80000000u) | exp << 23 | (r * 2654435761u) >> 9));
    }
    const int n = (int)x.size();

    uint16_t *v;
    uint8_t *code, *f16, *f32;
    float *xd;
    cudaMallocManaged(&v, 1021 * sizeof *v);
    cudaMallocManaged(&code, 1021);
    cudaMallocManaged(&f16, 65536);
    cudaMallocManaged(&f32, n);
    cudaMallocManaged(&xd, n * sizeof *xd);
    memcpy(xd, x.data(), n * sizeof *xd);
    law<<<4, 256>>>(v, code);
    all_f16<<<256, 256>>>(f16);
    some_f32<<<(n + 255) / 256, 256>>>(xd, f32, n);
    if (cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "ptx_check: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    FILE *f = fopen(argv[1], "wb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    const uint32_t nu = (uint32_t)n;
    fwrite(v, 2, 1021, f);
    fwrite(code, 1, 1021, f);
    fwrite(f16, 1, 65536, f);
    fwrite(&nu, 4, 1, f);
    fwrite(xd, 4, n, f);
    fwrite(f32, 1, n, f);
    fclose(f);
    printf("ptx_check: %d f32 inputs, wrote %s\n", n, argv[1]);
    return 0;
}
