/* decode.cuh: one warp decodes a tile (docs/trellismx.md §2-§4) into MMA operand registers.
 *
 * Lane l owns trellis positions 8l..8l+7: rows g = l/4 and g + 8 of the tile, columns
 * 2q, 2q+1, 2q+8, 2q+9 (q = l%4). Its eight states lie in one window of 16 + 7K bits of the
 * ring; three words hold it wherever it starts, and which three, and the shift, depend on the
 * lane and K alone, so they are computed once per kernel. Per state two shifts (or a shift
 * and a mask) and one multiply; the byte sums (sigma) of a tile's 256 products are two u8
 * MMAs, which leave each lane the sigmas of its own rows in another column order
 * (sum_bytes); from there law e4m3 computes two values per fma.f16x2 and one cvt pair, law
 * e2m1 reads a sigma -> value table in shared memory.
 *
 * The values come out as f16, the A fragment of an m16n8k16 f16 MMA (every E4M3 and E2M1
 * value is an f16): Hopper has no FP8 mma.sync (ptxas turns the m16n8k32 E4M3 form into
 * byte -> f16 conversions and two f16 MMAs), so this is the product the hardware runs either
 * way, minus the conversions. */
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

/* x * m on the multiply pipe: ptxas keeps a shift written as a multiply there (IMAD.SHL) and
 * does not turn it back into an ALU shift. */
__device__ __forceinline__ uint32_t mul_lo(uint32_t x, uint32_t m) {
    uint32_t r;
    asm("mul.lo.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(m));
    return r;
}

/* The lane's eight states from the tile's words w[8K] (shared memory). A state inside whi is
 * (whi << a) >> 16, the left shift as a multiply and no mask: one ALU instruction and, with
 * the hash, two on the multiply pipe, where a shift and a mask would be two on the ALU pipe,
 * which the law's conversions also need (docs/perf/h200-codec.md, "Where the time goes"). */
template <int K>
__device__ __forceinline__ void lane_states(const uint32_t *w, lane_window lw, uint32_t s[8]) {
    const uint32_t hi = w[lw.i0], mid = w[lw.i1], lo = w[lw.i2];
    /* whi:wlo = the 64 ring bits from the window's start, MSB first. */
    const uint32_t whi = __funnelshift_l(mid, hi, lw.off), wlo = __funnelshift_l(lo, mid, lw.off);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        constexpr int top = 48;     /* state 0 is bits 48..63 of whi:wlo */
        const int sh = top - j * K; /* constant after unrolling */
        if (sh == top)
            s[j] = whi >> 16;
        else if (sh > 32)
            s[j] = mul_lo(whi, 1u << (top - sh)) >> 16;
        else
            s[j] = (sh == 32 ? whi : __funnelshift_r(wlo, whi, sh)) & 0xffffu;
    }
}

/* Two E4M3 bytes (low byte first) as f16x2, and back (exact for E4M3 values). */
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bytes) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)bytes));
    return h;
}

/* The four E4M3 bytes of w as two f16x2: bytes 0, 1 in lo, bytes 2, 3 in hi. */
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t &lo, uint32_t &hi) {
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; "
        "cvt.rn.f16x2.e4m3x2 %1, h;}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

__device__ __forceinline__ uint32_t f16x2_to_e4m3x2(uint32_t h) {
    uint16_t b;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(b) : "r"(h));
    return b;
}

/* The value of an E4M3 byte. */
__device__ __forceinline__ float e4m3_value(uint32_t byte) {
    return __half2float(
        __ushort_as_half((unsigned short)(e4m3x2_to_f16x2(byte & 0xffu) & 0xffffu)));
}

/* d = A B + c for one m16n8k32 u8 product (the byte sums below). */
__device__ __forceinline__ void mma_u8(uint32_t d[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, const uint32_t b[2], uint32_t c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[0]), "r"(b[1]), "r"(c));
}

/* sigma (§4) is the byte sum of x = state * 0x83DCD12D. A tile's 256 byte sums are two u8
 * MMAs a warp, with B[k][n] = 1 for k / 4 == n (sum_bytes below): the lane puts x of
 * positions j = 0, 4, 1, 5 (then 2, 6, 3, 7) in a0..a3, and gets back sigma + c of row g
 * (d0, d1) and row g + 8 (d2, d3) at columns 4(q & 1) + (q >> 1) + 2i, i = 0, 1 (then 8 more)
 * - the states of its quad moved between its four lanes, rows kept. So the lane's A fragment
 * holds, at k = 8h + 2q + i, column 8h + 4(q & 1) + (q >> 1) + 2i of its rows ("lambda
 * order"); the activations are staged in that order (mm.cu). */
__device__ __forceinline__ void sum_bytes(uint32_t b[2], int lane) {
    const int g = lane >> 2, q = lane & 3;
    b[0] = q == g ? 0x01010101u : 0u;     /* k = 4q + j, n = g */
    b[1] = q + 4 == g ? 0x01010101u : 0u; /* k = 16 + 4q + j */
}

/* Law e4m3 of two states from their 0x6400 + sigma (the fp16 bits of 1024 + sigma), as the
 * f16x2 of their codes' values, low half h0's: one fma.f16x2 gives both v(sigma) =
 * fma(1024 + sigma, 0x1EEE, 0xC931) and one cvt rounds both to E4M3 (§4, the way the spec
 * says a GPU may compute it). */
__device__ __forceinline__ uint32_t law_e4m3_pair(uint32_t h0, uint32_t h1) {
    const uint32_t h = h1 * 0x10000u + h0;
    uint32_t v;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(h), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    return e4m3x2_to_f16x2(f16x2_to_e4m3x2(v));
}

/* Law e2m1 of two states from their sigmas: the table lut (shared memory) holds the high
 * byte of each value's f16 (every E2M1 value has a zero low byte), a byte table rather than
 * f16 so that the lanes' random reads share more words and conflict less. */
__device__ __forceinline__ uint32_t law_e2m1_pair(const uint8_t *lut, uint32_t s0, uint32_t s1) {
    return __byte_perm(lut[s0], lut[s1], 0x4101); /* f16 bits lut[s0] << 8, lut[s1] << 8 */
}

/* The lane's A fragment a[4] (f16x2, lambda order) of the tile at w. sum: sum_bytes; lut: law
 * e2m1's sigma -> f16 high byte table (shared memory). */
template <int K, bool FP4>
__device__ __forceinline__ void lane_operands(const uint32_t *w, lane_window lw,
                                              const uint32_t sum[2], const uint8_t *lut,
                                              uint32_t a[4]) {
    uint32_t s[8];
    lane_states<K>(w, lw, s);
#pragma unroll
    for (int j = 0; j < 8; j++) s[j] *= TRELLIS_MUL;
    uint32_t d[2][4]; /* 0x6400 + sigma (law e4m3) or sigma (law e2m1) */
    const uint32_t c = FP4 ? 0u : 0x6400u;
    mma_u8(d[0], s[0], s[4], s[1], s[5], sum, c);
    mma_u8(d[1], s[2], s[6], s[3], s[7], sum, c);
#pragma unroll
    for (int i = 0; i < 4; i++) { /* a0 = row g, a1 = row g + 8, a2, a3 = the same 8 on */
        const uint32_t *e = d[i >> 1] + 2 * (i & 1);
        a[i] = FP4 ? law_e2m1_pair(lut, e[0], e[1]) : law_e4m3_pair(e[0], e[1]);
    }
}

/* f16x2 a * b, both halves. */
__device__ __forceinline__ uint32_t h2_mul(uint32_t a, __half2 b) {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2 *>(&a), b);
    return *reinterpret_cast<const uint32_t *>(&r);
}

/* d += A B for one m16n8k16 f16 product with FP32 accumulators. */
__device__ __forceinline__ void mma_f16(float d[4], const uint32_t a[4], uint32_t b0,
                                        uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif
