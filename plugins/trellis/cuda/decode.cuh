/* decode.cuh: one warp decodes a tile (docs/trellismx.md §2-§4) into MMA operand registers.
 *
 * Lane l owns trellis positions 8l..8l+7: rows g = l/4 and g + 8 of the tile, columns
 * 2q, 2q+1, 2q+8, 2q+9 (q = l%4), exactly the A fragment registers a0 (row g) and a1
 * (row g + 8) of mma.m16n8k32 for a k order in which 4q + i stands for column
 * 2q + (i & 1) + 8(i >> 1) (trellis_cuda.h). Its eight states lie in one window of 16 + 7K
 * bits of the ring; three words hold it wherever it starts, and which three, and the shift,
 * depend on the lane and K alone, so they are computed once per kernel. */
#ifndef TMX_TRELLIS_DECODE_CUH
#define TMX_TRELLIS_DECODE_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#define TRELLIS_MUL 0x83DCD12Du
#define TRELLIS_LUT 1024 /* law e2m1's table, 1021 sigmas padded */

/* Where lane l's window starts: bit `off` of ring word i0, continuing into i1, i2. */
struct lane_window {
    int i0, i1, i2, off;
};

template <int K>
__device__ __forceinline__ lane_window lane_window_of(int lane) {
    constexpr int nw = 8 * K, ring = 256 * K;
    int b = 8 * lane * K + K - 16; /* first bit of position 8l's state; lane 0 wraps */
    if (b < 0) b += ring;
    lane_window w;
    w.i0 = b >> 5;
    w.off = b & 31;
    w.i1 = w.i0 + 1 == nw ? 0 : w.i0 + 1;
    w.i2 = w.i1 + 1 == nw ? 0 : w.i1 + 1;
    return w;
}

/* The lane's eight states from the tile's words w[8K] (shared memory). */
template <int K>
__device__ __forceinline__ void lane_states(const uint32_t *w, lane_window lw, uint32_t s[8]) {
    const uint32_t hi = w[lw.i0], mid = w[lw.i1], lo = w[lw.i2];
    /* whi:wlo = the 64 ring bits from the window's start, MSB first. */
    const uint32_t whi = __funnelshift_l(mid, hi, lw.off), wlo = __funnelshift_l(lo, mid, lw.off);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        constexpr int top = 48;           /* state 0 is bits 48..63 of whi:wlo */
        const int sh = top - j * K;       /* constant after unrolling */
        s[j] = (sh >= 32 ? whi >> (sh - 32) : __funnelshift_r(wlo, whi, sh)) & 0xffffu;
    }
}

/* sigma (§4): the byte sum of state * 0x83DCD12D, one multiply and one dp4a; c is added. */
__device__ __forceinline__ uint32_t sigma_plus(uint32_t s, uint32_t c) {
    return __dp4a(s * TRELLIS_MUL, 0x01010101u, c);
}

/* Law e4m3 of two states: fp16 1024 + sigma is 0x6400 + sigma, so one fma.f16x2 gives both
 * v(sigma) = fma(1024 + sigma, 0x1EEE, 0xC931) and one cvt both E4M3 bytes (§4, the way the
 * spec says a GPU may compute it). Byte 0 is s0's. */
__device__ __forceinline__ uint32_t law_e4m3_pair(uint32_t s0, uint32_t s1) {
    const uint32_t h = sigma_plus(s1, 0u) * 0x10000u + sigma_plus(s0, 0x64006400u);
    uint32_t v;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(h), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    uint16_t b;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(b) : "r"(v));
    return b;
}

/* Lane's two operand registers: a0 (positions 8l..8l+3), a1 (8l+4..8l+7), byte j of a
 * register from position 8l + j. lut: law e2m1's sigma -> E4M3 byte table in shared memory. */
template <int K, bool FP4>
__device__ __forceinline__ void lane_codes(const uint32_t *w, lane_window lw, const uint8_t *lut,
                                           uint32_t &a0, uint32_t &a1) {
    uint32_t s[8];
    lane_states<K>(w, lw, s);
    if (FP4) {
        uint32_t b[8];
#pragma unroll
        for (int j = 0; j < 8; j++) b[j] = lut[sigma_plus(s[j], 0u)];
        a0 = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24;
        a1 = b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24;
    } else {
        a0 = law_e4m3_pair(s[0], s[1]) | law_e4m3_pair(s[2], s[3]) << 16;
        a1 = law_e4m3_pair(s[4], s[5]) | law_e4m3_pair(s[6], s[7]) << 16;
    }
}

/* d = A B for one m16n8k32 E4M3 product, FP32 accumulators from zero. */
__device__ __forceinline__ void mma_e4m3(float d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

/* The value of an E4M3 byte (block scales). */
__device__ __forceinline__ float e4m3_value(uint32_t byte) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)byte));
    return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}

#endif
