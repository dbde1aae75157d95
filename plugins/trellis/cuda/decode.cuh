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

/* STEP: the ring bits of the lane's first state past bit 8lK (K: a state a weight). */
template <int K, int STEP = K>
__device__ __forceinline__ lane_window lane_window_of(int lane) {
    constexpr int nw = 8 * K, ring = 256 * K;
    int b = 8 * lane * K + STEP - 16; /* first bit of position 8l's state; lane 0 wraps */
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
template <int K, int N = 8, int STRIDE = K> /* N states STRIDE bits apart (pair laws: 4, 2K) */
__device__ __forceinline__ void lane_states(const uint32_t *w, lane_window lw, uint32_t s[N]) {
    const uint32_t hi = w[lw.i0], mid = w[lw.i1], lo = w[lw.i2];
    /* whi:wlo = the 64 ring bits from the window's start, MSB first. */
    const uint32_t whi = __funnelshift_l(mid, hi, lw.off), wlo = __funnelshift_l(lo, mid, lw.off);
#pragma unroll
    for (int j = 0; j < N; j++) {
        constexpr int top = 48;          /* state 0 is bits 48..63 of whi:wlo */
        const int sh = top - j * STRIDE; /* constant after unrolling */
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

/* --- law e2m1 for Blackwell's block-scaled FP4 MMA (sm_120a) ------------------------------ */

/* The E2M1 codes (sign << 3 | magnitude, §1.2) of four E4M3 bytes that hold E2M1 values, a code
 * a byte: magnitude (byte >> 2) - 12 for 1.0 (0x38) and up, 1 for 0.5 (0x30), 0 for 0. */
__device__ __forceinline__ uint32_t e2m1x4_of_e4m3x4(uint32_t w) {
    const uint32_t mag = w & 0x7f7f7f7fu;
    return (__vsubus4(mag >> 2 & 0x1f1f1f1fu, 0x0c0c0c0cu) +
            (__vcmpeq4(mag, 0x30303030u) & 0x01010101u)) |
           (w >> 4 & 0x08080808u);
}

/* The lane's codes of a tile pair (u0 at w0, u1 at w1) for the native FP4 MMA: r0 holds 8
 * codes of row g, r1 of row g + 8, all of tile u0 for lanes q = 0, 1 and of u1 for q = 2, 3.
 * The MMA (mma_e2m1) scales each 16 of its 64 inputs by one UE4M3 scale, and its 16-input
 * blocks lie in two lanes of a quad (registers a0, a1 of q = 0, 1, of q = 2, 3, then a2, a3
 * the same), so each must hold one tile's 16 columns of a row (TrellisMX's block scales are
 * per 16 inputs, and UE4M3 bytes: §5). The byte sums move them there with no shuffle: a u8
 * MMA takes tile u0's states in a0, a1 and u1's in a2, a3 (the B of sum_bytes), so lanes
 * q = 0, 1 get back sigmas of u0 only, q = 2, 3 of u1 only - four u8 MMAs a pair, as before.
 *
 * "Nu order": code i (bits 4i..4i+3) of either register is column [2t, 2t + 1, 2t + 8,
 * 2t + 9][i >> 1] of its tile and row, t = 2 (q & 1) + (i & 1): trellis position 8 (4g + t) +
 * (i >> 1) (+ 4 for row g + 8). The activations are staged in that order (mm.cu). nib: law
 * e2m1's sigma -> code table (shared memory). */
template <int K>
__device__ __forceinline__ void lane_codes_e2m1(const uint32_t *w0, const uint32_t *w1,
                                                lane_window lw, const uint32_t sum[2],
                                                const uint8_t *nib, uint32_t &r0, uint32_t &r1) {
    uint32_t s0[8], s1[8];
    lane_states<K>(w0, lw, s0);
    lane_states<K>(w1, lw, s1);
    uint32_t b0[4], b1[4]; /* byte j of r0, r1: codes i = 2j, 2j + 1, from u8 MMA j */
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t d[4]; /* sigmas: row g at t = 2 (q & 1), + 1, then row g + 8 */
        mma_u8(d, s0[j] * TRELLIS_MUL, s0[j + 4] * TRELLIS_MUL, s1[j] * TRELLIS_MUL,
               s1[j + 4] * TRELLIS_MUL, sum, 0u);
        b0[j] = nib[d[1]] * 16u + nib[d[0]];
        b1[j] = nib[d[3]] * 16u + nib[d[2]];
    }
    r0 = __byte_perm(__byte_perm(b0[0], b0[1], 0x0040), __byte_perm(b0[2], b0[3], 0x0040), 0x5410);
    r1 = __byte_perm(__byte_perm(b1[0], b1[1], 0x0040), __byte_perm(b1[2], b1[3], 0x0040), 0x5410);
}

#if !defined(__CUDA_ARCH_FEAT_SM120_ALL)
/* The value of an E2M1 code (the low 4 bits of c). */
__device__ __forceinline__ float e2m1_value(uint32_t c) {
    const uint32_t m = c & 7u;
    const float v = m < 2 ? 0.5f * (float)m : ldexpf((float)(2 + (m & 1)), (int)(m >> 1) - 2);
    return c & 8u ? -v : v;
}
#endif

/* d += (A . SA)(B . SB) for one m16n8k64 E2M1 product, FP32 accumulators, UE4M3 scales per 16
 * inputs (kind::mxf4nvf4, scale_vec::4X): a[4], b0, b1 the lane's fragments (8 codes a
 * register: a0, a2 row g, a1, a3 row g + 8, inputs 8q.. and 32 + 8q..; b0, b1 token g at the
 * same inputs); sa: the four scales of row g (lane q = 0) or g + 8 (q = 1), unused in lanes
 * q = 2, 3; sb: token g's four (lane q = 0). sm_120a runs the instruction. Elsewhere this is
 * an emulation of it from the PTX ISA's fragment layouts (shuffles, FP32 sums of exact
 * products), so that the checks can run the native form on a GPU without it. */
__device__ __forceinline__ void mma_e2m1(float d[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1, uint32_t sa, uint32_t sb) {
#if defined(__CUDA_ARCH_FEAT_SM120_ALL)
    asm("mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1."
        "e2m1.f32.ue4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, %10, "
        "{0, 0}, %11, {0, 0};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(sa), "r"(sb));
#else
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    /* outputs d0..d3: rows g, g, g + 8, g + 8 by tokens 2q, 2q + 1, 2q, 2q + 1 */
    const uint32_t sr[2] = {__shfl_sync(all, sa, 4 * g), __shfl_sync(all, sa, 4 * g + 1)};
    const uint32_t st[2] = {__shfl_sync(all, sb, 8 * q), __shfl_sync(all, sb, 8 * q + 4)};
    float part[4][4] = {}; /* [output][scale block] */
    for (int t = 0; t < 4; t++) { /* the quad lane holding inputs 8t.. and 32 + 8t.. */
        uint32_t ar[4], br[2][2];
#pragma unroll
        for (int i = 0; i < 4; i++) ar[i] = __shfl_sync(all, a[i], 4 * g + t);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            br[e][0] = __shfl_sync(all, b0, 4 * (2 * q + e) + t);
            br[e][1] = __shfl_sync(all, b1, 4 * (2 * q + e) + t);
        }
        for (int h = 0; h < 2; h++) /* input 32h + 8t + j, scale block 2h + t / 2 */
            for (int j = 0; j < 8; j++) {
                const float x0 = e2m1_value(ar[2 * h] >> 4 * j),
                            x1 = e2m1_value(ar[2 * h + 1] >> 4 * j),
                            y0 = e2m1_value(br[0][h] >> 4 * j), y1 = e2m1_value(br[1][h] >> 4 * j);
                const int b = 2 * h + (t >> 1);
                part[0][b] += x0 * y0;
                part[1][b] += x0 * y1;
                part[2][b] += x1 * y0;
                part[3][b] += x1 * y1;
            }
    }
    for (int k = 0; k < 4; k++) {
        const float a0 = e4m3_value(sr[0] >> 8 * k), a1 = e4m3_value(sr[1] >> 8 * k),
                    t0 = e4m3_value(st[0] >> 8 * k), t1 = e4m3_value(st[1] >> 8 * k);
        d[0] += part[0][k] * a0 * t0;
        d[1] += part[1][k] * a0 * t1;
        d[2] += part[2][k] * a1 * t0;
        d[3] += part[3][k] * a1 * t1;
    }
#endif
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
