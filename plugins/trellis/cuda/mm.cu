/* mm.cu: the fused expert matmul and the decode check.
 *
 * A CTA computes MM_WARPS strips of 16 output rows of one expert's matrix for one group of up
 * to 8 * NG tokens. Each warp streams its strip's tiles into its own piece of shared memory
 * with cp.async, MM_CHUNK tiles at a time, two chunks deep (the next one lands while this one
 * is decoded), and the CTA stages the group's activations for the same 256 inputs as the f16
 * B fragments of its lanes. Per tile a lane decodes its A fragment of an m16n8k16 f16 product
 * (decode.cuh), multiplies it by its rows' block scales (every code value times an E4M3 scale
 * is exact in f16: at most 8 significant bits, 2^-18 to 1568 for law e4m3, 2^-10 to 2688 for
 * law e2m1) and issues one MMA per 8 tokens into the FP32 accumulators. Law e2m1's
 * activations are staged already multiplied by their block scales (exact in f16 the same way),
 * so both laws sum Q x in the MMA's accumulators; the matrix scale g and the token scale
 * multiply once at the end.
 *
 * The GEMV (NG = 1, up to 8 tokens) stages its activations two buffers deep, from registers
 * loaded a chunk ahead: one barrier per chunk; it is held to 64 registers so that 8 CTAs fit
 * an SM (gate and up of 8 experts at 4096 rows are 1024 CTAs: one wave on 132 SMs). The
 * grouped GEMM (NG = 8, 64 tokens) stages a chunk's activations in one buffer between two
 * barriers, its loads in batches (a chunk ahead they would not fit its registers), and is held
 * to 128 registers for 4 CTAs an SM. A group of 128 tokens in one warp's accumulators,
 * decoding each tile half as often, ran slower: 2 CTAs an SM hid the staging's loads worse.
 * The wide GEMM (mm_wide_kernel, below) gets there another way: its warps decode a chunk's
 * tiles into shared memory once for 128 or 256 tokens and share them, multiplied by wgmma on
 * Hopper (docs/perf/h200-codec.md). */
#include "decode.cuh"
#include "mm.cuh"
#include "trellis_cuda.h"
#include "wgmma.cuh"

#include <stdio.h>

#define CHUNK_COLS (16 * MM_CHUNK)
#define X16_STRIDE (CHUNK_COLS / 2 + 16) /* words per token row; +16 (64 B) spreads the banks */

/* Bytes of dynamic shared memory of a group of `group` tokens: the activation buffers. */
static size_t x_smem(int group) {
    return (size_t)(group == MM_GROUP_SMALL ? 2 : 1) * group * X16_STRIDE * sizeof(uint32_t);
}

struct mm_group {
    int expert, first, count;
};

__device__ __forceinline__ bool group_of(const mm_params &p, int gi, int cap, mm_group &out) {
    if (p.groups) {
        if (gi >= *p.n_groups) return false;
        const int4 g = p.groups[gi];
        out = {g.x, g.y, g.z};
        return true;
    }
    const int per = (p.m + cap - 1) / cap, i = gi % per;
    out = {gi / per, gi / per * p.m + i * cap, min(cap, p.m - i * cap)};
    return true;
}

/* By the whole CTA: the activation row of each of the group's gt slots (-1 past its tokens)
 * into row_s[gt], and law e2m1's sigma -> f16 high byte table into lut_s (NATIVE: sigma ->
 * E2M1 code). */
template <bool FP4, bool NATIVE = false>
__device__ __forceinline__ void group_tables(const mm_params &p, const mm_group &grp, int gt,
                                             int *row_s, uint8_t *lut_s) {
    for (int t = threadIdx.x; t < gt; t += blockDim.x)
        row_s[t] = t >= grp.count ? -1
                   : p.act_row ? p.act_row[grp.first + t] : grp.first + t;
    if (FP4)
        for (int i = threadIdx.x; i < TRELLIS_LUT; i += blockDim.x)
            lut_s[i] = (uint8_t)(NATIVE ? e2m1x4_of_e4m3x4(p.lut[i])
                                        : e4m3x2_to_f16x2(p.lut[i]) >> 8);
}

/* Starts copying a lane's part of a chunk of `tiles` tiles (8K words each) from src to dst
 * (shared memory, room for CAP tiles), zeros past its end, as one cp.async group. */
template <int K, int CAP = MM_CHUNK>
__device__ __forceinline__ void load_chunk(uint4 *dst, const uint4 *src, int tiles, int lane) {
    constexpr int room = CAP * 2 * K; /* uint4 of dst */
    const int n = tiles * 2 * K;      /* uint4 in the chunk: tiles * 8K words / 4 */
#pragma unroll
    for (int i = 0; i < (room + 31) / 32; i++) {
        const int at = i * 32 + lane;
        if (room % 32 && at >= room) break;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                         (uint32_t)__cvta_generic_to_shared(dst + at)),
                     "l"(src + (at < n ? at : 0)), "r"(at < n ? 16 : 0)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Waits for this thread's cp.async groups but the latest. */
__device__ __forceinline__ void wait_chunk() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

/* A tile's 16 activation bytes, kappa words q = 0..3 (columns 2q, 2q+1, 2q+8, 2q+9), as the
 * four words of lambda order (decode.cuh): word q = the B fragment bytes of lanes with that q,
 * columns 4(q & 1) + (q >> 1) + {0, 2, 8, 10}. */
__device__ __forceinline__ uint4 lambda_words(uint4 v) {
    return make_uint4(__byte_perm(v.x, v.y, 0x6240), __byte_perm(v.z, v.w, 0x6240),
                      __byte_perm(v.x, v.y, 0x7351), __byte_perm(v.z, v.w, 0x7351));
}

/* Block scale b of a chunk, from its scales as f16 pairs h[b / 2], broadcast to both halves
 * of an f16x2. */
template <int SH>
__device__ __forceinline__ __half2 scale_h2(const uint32_t (&h)[SH], int b) {
    const __half2 v = *reinterpret_cast<const __half2 *>(&h[b >> 1]);
    return b & 1 ? __high2half2(v) : __low2half2(v);
}

/* Where the B fragments of lanes with q = lane % 4 for step st (32 inputs, two tiles) begin
 * in a staged token row: 16 words a step, [q][tile of the step][b0, b1]. */
__device__ __forceinline__ int x_word(int st, int q) {
    return st * 16 + q * 4;
}

/* The f16 B fragments of a tile from its 16 kappa bytes v, b0[q] and b1[q] for the lanes with
 * q = lane % 4 (inputs 2q, 2q + 1 and 2q + 8, 2q + 9 of the tile's lambda order); law e2m1
 * multiplies them by their block scale xb. */
template <bool FP4>
__device__ __forceinline__ void tile_fragments(uint4 v, float xb, uint32_t (&b0)[4],
                                               uint32_t (&b1)[4]) {
    const uint4 n = lambda_words(v);
    const uint32_t w[4] = {n.x, n.y, n.z, n.w};
    const __half2 s = __float2half2_rn(xb);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        e4m3x4_to_f16x2(w[i], b0[i], b1[i]);
        if (FP4) {
            b0[i] = h2_mul(b0[i], s);
            b1[i] = h2_mul(b1[i], s);
        }
    }
}

/* x through a shuffle, which ptxas does not recompute: a per-lane constant so passed stays
 * in a register through the chunk loop rather than being remade from the thread index. */
__device__ __forceinline__ uint32_t kept(uint32_t x) {
    return __shfl_sync(0xffffffffu, x, threadIdx.x & 31);
}

/* Where token row t of a group begins past t * X16_STRIDE: rows 2k and 2k + 1 (the lanes of a
 * quarter-warp's B loads) move by 4 words a pair, so that the 4 tokens x_slot gives a
 * half-warp meet the banks at 4 offsets. */
__device__ __forceinline__ int x_skew(int t) {
    return 4 * ((t >> 1) & 3);
}

/* The token t (0..7) and tile u that thread i of a CTA stages of a chunk, and tokens t + 8n
 * after it for a group of more: a half-warp takes tiles u0..u0 + 3 of tokens t0 + 2j (j =
 * 0..3), so that for each of stage_tile's stores its 16 lanes write 16 different bank pairs
 * (one token's 16 tiles would write 4, 4 lanes each); x_skew(t + 8n) = x_skew(t). */
__device__ __forceinline__ void x_slot(int i, int &t, int &u) {
    static_assert(MM_CHUNK == 16 && MM_WARPS * 32 == 8 * MM_CHUNK, "8 tokens' tiles a pass");
    const int h = i >> 4, l = i & 15;
    t = 2 * (l >> 2) + (h & 1);
    u = (l & 3) + 4 * ((h >> 1) & 3);
}

/* Where tile u's fragments for q = 0 begin in a token row (x_word's layout): those of q on
 * are 4 q words on. */
__device__ __forceinline__ int x_tile(int u) {
    return x_word(u >> 1, 0) + (u & 1) * 2;
}

/* Stages a tile into a token row at xs = row + x_tile(u) (f16, x_word's layout). */
template <bool FP4>
__device__ __forceinline__ void stage_tile(uint32_t *xs, uint4 v, float xb) {
    uint32_t b0[4], b1[4];
    tile_fragments<FP4>(v, xb, b0, b1);
#pragma unroll
    for (int q = 0; q < 4; q++)
        *reinterpret_cast<uint2 *>(&xs[4 * q]) = make_uint2(b0[q], b1[q]);
}

/* The native FP4 form's staging (NATIVE in mm_kernel): a token row of x_s holds, for each
 * step of 64 inputs st (tiles 4st..4st + 3 of the chunk), the B fragments b0, b1 of lanes
 * q = 0..3 (words 8st + 2q, + 1: E2M1 codes in nu order, decode.cuh), and from word NX_SCALES
 * on the step's four block scales (UE4M3 bytes, a word a step). XN_STRIDE words a token: the
 * 8-byte loads of a half-warp (4 tokens) cover the 32 banks once. */
#define NX_SCALES 32
#define XN_STRIDE 40

/* Stages tile u of a chunk (16 kappa bytes v: E4M3 bytes of E2M1 values; block scale value
 * xb) into token row xs. Tile u is u0..u3 of its step by u % 4, so lanes q = 2 (u & 1) + e
 * take it, e = 0 the tile's kappa bytes 0..7, e = 1 bytes 8..15; in nu order their codes
 * pair up bytes m and 4 + m (kappa word 2e and 2e + 1) in byte m. */
__device__ __forceinline__ void stage_tile_native(uint32_t *xs, int u, uint4 v, float xb) {
    const int st = u >> 2, uu = u & 3;
    uint32_t *b = xs + 8 * st + 4 * (uu & 1) + (uu >> 1); /* lane 2 (u & 1), b0 or b1 */
    b[0] = e2m1x4_of_e4m3x4(v.x) + e2m1x4_of_e4m3x4(v.y) * 16u;
    b[2] = e2m1x4_of_e4m3x4(v.z) + e2m1x4_of_e4m3x4(v.w) * 16u;
    reinterpret_cast<uint8_t *>(xs + NX_SCALES + st)[uu] = (uint8_t)f16x2_to_e4m3x2(
        __half_as_ushort(__float2half_rn(xb)));
}

/* acc[s][n + j] += A_s B_j over the 32 inputs of a step for S strips of 16 rows (the lane's A
 * fragments a[s][tile] of its two tiles) and N columns of 8 tokens from column n, B_j the
 * lane's fragments at x + 8 j stride. The N loads go first and the MMAs after, so that no MMA
 * waits for the one before it (same accumulator) or a load for an MMA to free its registers;
 * with two strips each B fragment feeds two MMAs. */
template <int N, int S, int C>
__device__ __forceinline__ void mma_step(float (*acc)[C][4], int n, const uint32_t (*a)[2][4],
                                         const uint32_t *x, int stride) {
    uint4 b[N];
#pragma unroll
    for (int j = 0; j < N; j++) b[j] = *reinterpret_cast<const uint4 *>(x + 8 * j * stride);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < N; j++)
#pragma unroll
            for (int s = 0; s < S; s++)
                mma_f16(acc[s][n + j], a[s][h], h ? b[j].z : b[j].x, h ? b[j].w : b[j].y);
}

/* NATIVE (law e2m1 only): Blackwell's block-scaled FP4 MMA takes the place of the f16 one: a
 * step is 64 inputs, four tiles whose codes (lane_codes_e2m1) and block scales go to the
 * MMA as they are, one m16n8k64 a step and 8 tokens, the activations staged as E2M1 codes
 * with their block scales (stage_tile_native). */
template <int K, bool FP4, int NG, bool NATIVE>
__global__ void __launch_bounds__(MM_WARPS * 32, NG == 1 ? 8 : 4) mm_kernel(const mm_params p) {
    tmx_pdl_enter();
    static_assert(FP4 || !NATIVE, "the native FP4 form is law e2m1's");
    constexpr int NW = 8 * K, GT = 8 * NG, BLOCK = FP4 ? 16 : 32;
    constexpr int SW = CHUNK_COLS / BLOCK / 4; /* scale words of a row per chunk: 2 or 4 */
    constexpr bool PRE = NG == 1;              /* activations a chunk ahead, double-buffered */
    constexpr int XB = PRE ? 2 : 1, XS = NATIVE ? XN_STRIDE : X16_STRIDE;
    constexpr bool SKEW = !PRE && !NATIVE; /* token rows moved by x_skew */
    static_assert(!PRE || GT * MM_CHUNK == MM_WARPS * 32, "a thread stages one tile of a token");
    __shared__ uint4 w_s[2][MM_WARPS][MM_CHUNK * NW / 4]; /* [chunk % 2][warp][tile][8K] */
    /* [buffer][token][XS]: f16: [step of 32 inputs][q][tile of the step][b0, b1] f16x2, the B
     * fragments of a lane (q = lane % 4) for both tiles of a step in one 16-byte load (SKEW:
     * row t x_skew(t) words into its padding); NATIVE: stage_tile_native's layout (x_smem
     * bytes hold either). */
    extern __shared__ __align__(16) uint32_t x_dyn[];
    auto x_row = [&](int buf, int t) {
        return x_dyn + (buf * GT + t) * XS + (SKEW ? x_skew(t) : 0);
    };
    /* law e2m1: sigma -> value's f16 >> 8 (NATIVE: -> code) */
    __shared__ uint8_t lut_s[FP4 ? TRELLIS_LUT : 1];
    __shared__ int row_s[GT];

    mm_group grp;
    if (!group_of(p, blockIdx.y, GT, grp)) return;
    const int z = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int strip = blockIdx.x * MM_WARPS + warp, tiles_c = p.cols / 16;
    group_tables<FP4, NATIVE>(p, grp, GT, row_s, lut_s);

    const uint4 *wsrc = reinterpret_cast<const uint4 *>(
        p.words[z] + ((size_t)grp.expert * (p.rows / 16) + strip) * tiles_c * NW);
    const int spr = p.cols / BLOCK; /* scales per row */
    const uint32_t *sc0 = reinterpret_cast<const uint32_t *>(
        p.scales[z] + ((size_t)grp.expert * p.rows + 16 * strip + g) * spr);
    const uint32_t *sc1 = sc0 + 8 * spr / 4;
    const lane_window lw = lane_window_of<K>(lane);
    uint32_t sum[2];
    sum_bytes(sum, lane);

    /* The last chunk may be short: cols is a multiple of 128 (the Hadamard blocks), so a
     * chunk holds MM_CHUNK or MM_CHUNK / 2 tiles; nothing past a row's end is read. */
    const int n_chunks = (tiles_c + MM_CHUNK - 1) / MM_CHUNK;
    auto chunk_tiles = [&](int c) { return min(MM_CHUNK, tiles_c - c * MM_CHUNK); };
    float acc[1][NG][4] = {}; /* one strip */
    load_chunk<K>(w_s[0][warp], wsrc, chunk_tiles(0), lane); /* the warp's own piece */
    uint32_t sn0[SW], sn1[SW]; /* block scale bytes of rows g, g + 8 for the next chunk */
    auto load_scales = [&](int c) {
        const int sw = chunk_tiles(c) * 16 / BLOCK / 4;
#pragma unroll
        for (int i = 0; i < SW; i++) {
            sn0[i] = i < sw ? sc0[c * SW + i] : 0u;
            sn1[i] = i < sw ? sc1[c * SW + i] : 0u;
        }
    };
    load_scales(0);

    /* A token the group lacks stays zero: nothing stages it. */
    for (int i = threadIdx.x; i < XB * GT * X16_STRIDE; i += blockDim.x) x_dyn[i] = 0u;
    __syncthreads(); /* row_s, lut_s, x_dyn */
    /* The tile u of token t (its 16 kappa bytes) of chunk c, and law e2m1's block scale. */
    auto load_x = [&](int c, int t, int u, uint4 &v, float &xb) {
        const int r = row_s[t];
        v = reinterpret_cast<const uint4 *>(p.x + (size_t)r * p.cols + c * CHUNK_COLS)[u];
        xb = FP4 ? p.xb[(size_t)r * (p.cols / 16) + c * MM_CHUNK + u] : 0.0f;
    };
    /* Thread i stages tile xu of tokens xt + 8n: in the grouped GEMM a half-warp takes four
     * tokens by four tiles (x_slot, stores free of bank conflicts), in the GEMV one token's 16
     * (it stages a tile a thread a chunk; x_slot with a kept xs_at measured 6% slower there).
     * xs_at: where its tile of token xt goes in buffer 0, in words; the grouped GEMM keeps it
     * (ptxas would remake it from the thread index for every tile staged, 14 instructions). */
    int xt = threadIdx.x / MM_CHUNK, xu = threadIdx.x % MM_CHUNK;
    if (SKEW) x_slot(threadIdx.x, xt, xu);
    uint32_t xs_at = (uint32_t)(x_row(0, xt) - x_dyn) + (NATIVE ? 0 : x_tile(xu));
    if (!PRE) xs_at = kept(xs_at);
    const bool x_mine = PRE && row_s[xt] >= 0;
    uint4 xn = make_uint4(0, 0, 0, 0);
    float xbn = 0.0f;
    auto load_next = [&](int c) { /* zeros past a short chunk's end */
        if (!x_mine) return;
        if (xu < chunk_tiles(c)) {
            load_x(c, xt, xu, xn, xbn);
        } else {
            xn = make_uint4(0, 0, 0, 0);
            xbn = 0.0f;
        }
    };
    auto stage = [&](int buf, int n, uint4 v, float xb) { /* token xt + 8 n */
        uint32_t *xs = x_dyn + (buf * GT + 8 * n) * XS + xs_at;
        if (NATIVE)
            stage_tile_native(xs, xu, v, xb);
        else
            stage_tile<FP4>(xs, v, xb);
    };
    if (PRE) {
        load_next(0);
        if (x_mine) stage(0, 0, xn, xbn);
        if (n_chunks > 1) load_next(1);
    }

    for (int c = 0; c < n_chunks; c++) {
        const int tc = chunk_tiles(c);
        /* this chunk's block scales as f16 pairs; NATIVE: as they are (a word a step) */
        uint32_t s0[2 * SW], s1[2 * SW];
#pragma unroll
        for (int i = 0; i < SW; i++) {
            if (NATIVE) {
                s0[i] = sn0[i];
                s1[i] = sn1[i];
            } else {
                e4m3x4_to_f16x2(sn0[i], s0[2 * i], s0[2 * i + 1]);
                e4m3x4_to_f16x2(sn1[i], s1[2 * i], s1[2 * i + 1]);
            }
        }
        __syncthreads(); /* chunk c - 1 is consumed; PRE: chunk c's activations are staged */
        if (PRE) {
            if (c + 1 < n_chunks) {
                if (x_mine) stage((c + 1) & 1, 0, xn, xbn);
                if (c + 2 < n_chunks) load_next(c + 2);
            }
        } else { /* loads in batches of 4 tiles a thread: one wait for memory per batch */
            constexpr int PER = GT * MM_CHUNK / (MM_WARPS * 32), BATCH = PER < 4 ? PER : 4;
#pragma unroll
            for (int b = 0; b < PER; b += BATCH) {
                uint4 v[BATCH];
                float xb[BATCH];
#pragma unroll
                for (int j = 0; j < BATCH; j++) {
                    const int t = xt + 8 * (b + j);
                    if (row_s[t] >= 0 && xu < tc) load_x(c, t, xu, v[j], xb[j]);
                }
#pragma unroll
                for (int j = 0; j < BATCH; j++) {
                    const int t = xt + 8 * (b + j);
                    if (row_s[t] >= 0 && xu < tc) stage(0, b + j, v[j], xb[j]);
                }
            }
        }
        if (c + 1 < n_chunks)
            load_chunk<K>(w_s[(c + 1) & 1][warp], wsrc + (size_t)(c + 1) * K * 32,
                          chunk_tiles(c + 1), lane);
        else
            asm volatile("cp.async.commit_group;" ::: "memory"); /* keeps wait_chunk's count */
        wait_chunk(); /* chunk c's words, this lane's copies */
        if (PRE)
            __syncwarp(); /* all the warp's copies */
        else
            __syncthreads(); /* and the activations */
        if (c + 1 < n_chunks) load_scales(c + 1);

        const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[c & 1][warp]);
        const uint32_t *xq = x_row(c % XB, g); /* the lane's token row of the first column */
        /* A step: 32 inputs, tiles 2st and 2st + 1 (NATIVE: 64, tiles 4st .. 4st + 3). */
        auto step = [&](int st) {
            if constexpr (NATIVE) {
                uint32_t a[4];
                lane_codes_e2m1<K>(tw + 4 * st * NW, tw + (4 * st + 1) * NW, lw, sum, lut_s,
                                   a[0], a[1]);
                lane_codes_e2m1<K>(tw + (4 * st + 2) * NW, tw + (4 * st + 3) * NW, lw, sum,
                                   lut_s, a[2], a[3]);
                const uint32_t sa = q & 1 ? s1[st] : s0[st]; /* lanes 0, 1: rows g, g + 8 */
#pragma unroll
                for (int n = 0; n < NG; n++) {
                    if (n && 8 * n >= grp.count) break;
                    const uint32_t *xn = xq + 8 * n * XS;
                    const uint2 b = *reinterpret_cast<const uint2 *>(xn + 8 * st + 2 * q);
                    mma_e2m1(acc[0][n], a, b.x, b.y, sa, xn[NX_SCALES + st]);
                }
            } else {
                uint32_t a[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    lane_operands<K, FP4>(tw + (2 * st + h) * NW, lw, sum, lut_s, a[h]);
                    const int b = FP4 ? 2 * st + h : st; /* the tile's block in the chunk */
                    const __half2 w0 = scale_h2(s0, b), w1 = scale_h2(s1, b);
                    a[h][0] = h2_mul(a[h][0], w0);
                    a[h][2] = h2_mul(a[h][2], w0);
                    a[h][1] = h2_mul(a[h][1], w1);
                    a[h][3] = h2_mul(a[h][3], w1);
                }
                /* law e4m3's groups take their columns in pairs (tokens past the group's end
                 * are zeros); law e2m1's, short of registers, one by one */
                constexpr int N = FP4 || NG == 1 ? 1 : 2;
#pragma unroll
                for (int n = 0; n < NG; n += N) {
                    if (n && 8 * n >= grp.count) break; /* no tokens left in the group */
                    mma_step<N, 1>(acc, n, &a, xq + 8 * n * XS + x_word(st, q), XS);
                }
            }
        };
        constexpr int STEPS = MM_CHUNK / (NATIVE ? 8 : 4); /* steps of half a chunk */
#pragma unroll
        for (int half = 0; half < 2; half++) { /* a short chunk is its first half */
            if (half && tc < MM_CHUNK) break;
#pragma unroll
            for (int st = 0; st < STEPS; st++) step(half * STEPS + st);
        }
    }

    const float gs = p.g[z][grp.expert];
    const int r0 = 16 * strip + g;
#pragma unroll
    for (int n = 0; n < NG; n++)
#pragma unroll
        for (int i = 0; i < 2; i++) { /* accumulator columns 2q, 2q + 1: two tokens */
            const int t = 8 * n + 2 * q + i;
            if (t >= grp.count) continue;
            const float s = gs * p.xa[row_s[t]];
            float *y = p.y[z] + (size_t)(grp.first + t) * p.rows;
            y[r0] = acc[0][n][i] * s;
            y[r0 + 8] = acc[0][n][2 + i] * s;
        }
}

/* The wide GEMM (groups of MM_GROUP_WIDE or MM_GROUP_WIDER tokens): a CTA computes
 * WIDE_STRIPS strips of 16 rows for the whole group and decodes each of their tiles once. A
 * chunk is 64 inputs (WIDE_KT tiles a strip); two warps a strip each decode 2 of its tiles into
 * shared memory, already times their block scales. The activations, staged as f16 in memory
 * once per call (stage_kernel), come in by cp.async a chunk ahead with the words; one barrier
 * a chunk. Two forms multiply them:
 *
 * - mma.sync (any sm_80 on; Blackwell's sm_120a runs it): 4 strips, 8 warps, A fragments
 *   (a_s, the m16n8k16 layout) and activations two chunks deep; each warp multiplies all 16
 *   tiles into its warp tile of 32 rows by GT / 4 tokens, so that each A fragment it loads
 *   feeds GT / 32 MMAs and each B fragment two; the decode of chunk c + 1 comes first, then
 *   the MMAs of chunk c.
 * - wgmma (Hopper, sm_90a): 8 strips, 16 warps, so that the activations, which every CTA of a
 *   group reads, come in half as often (12% faster than 4 strips at 256-512 tokens an expert).
 *   Warpgroup h (warps 4h..4h + 3) multiplies strips 4 (h & 1) on by the GT / 2 tokens from
 *   GT / 2 (h >> 1) on, the tensor cores reading both operands from shared memory, K-major
 *   with the 128-byte swizzle: a row's (or a token's) 64 inputs of a chunk are one 128-byte
 *   row whose 16-byte pieces are XORed by row % 8. The wgmmas of chunk c are issued right
 *   after the barrier and run while the warps copy and decode chunk c + 1 and on across the
 *   next barrier (each warpgroup waits only for chunk c - 1's), so A and activations are three
 *   chunks deep. The warps issue no MMA and no operand load (docs/perf/h200-codec.md, "The
 *   wide GEMM on wgmma"). */
#define WIDE_KT 4                  /* tiles of a strip a chunk: 64 inputs */
#define WIDE_STRIPS(wg) ((wg) ? 8 : 4)
#define WIDE_STAGES(wg) ((wg) ? 3 : 2)
#define WIDE_XW (WIDE_KT * 8)      /* staged f16x2 words of a token a chunk: two steps */

/* cp.async of 16 bytes from word `off` of src to shared address dst when `pred`, the address
 * made in one IMAD.WIDE.U32 (ptxas makes a 64-bit add of src + 4 off in four). */
__device__ __forceinline__ void copy_if(uint32_t dst, const uint32_t *src, uint32_t off,
                                        bool pred) {
    asm volatile("{.reg .pred p; .reg .b64 a; setp.ne.b32 p, %3, 0;\n\t"
                 "mad.wide.u32 a, %2, 4, %1;\n\t"
                 "@p cp.async.cg.shared.global [%0], [a], 16;}" ::"r"(dst),
                 "l"(src), "r"(off), "r"((int)pred)
                 : "memory");
}

/* mma.sync: the staged activations of a token take WIDE_XW words of shared memory with no
 * padding; odd tokens swap their two steps, so that the 8 lanes of a quarter-warp's B loads
 * (two tokens, the same step) cover all 32 banks. */
__device__ __forceinline__ int wide_word(int t, int w) {
    return w ^ (t & 1) << 4;
}

template <int K, bool FP4, int GT, bool WG>
__global__ void __launch_bounds__(WIDE_STRIPS(WG) * 64, WG ? 1 : 2)
    mm_wide_kernel(const mm_params p) {
    tmx_pdl_enter();
    constexpr int NW = 8 * K, BLOCK = FP4 ? 16 : 32, STRIPS = WIDE_STRIPS(WG);
    constexpr int THREADS = STRIPS * 64;
    /* Copies of a chunk's activations: lanes a token, tokens a round, rounds, pieces a round.
     * By eight lanes a token a copy a warp issues reads 4 tokens' 128-byte lines and writes
     * them to shared memory in 4 wavefronts; by two, as wgmma's groups of 256 once did, it
     * read 16 lines and took 16 (Nsight Compute, docs/perf/h200-codec.md, "The wide GEMM's
     * copies and constants"). wgmma's groups of 128 keep four lanes in one round: by eight in
     * two rounds they ran 2-3% slower. mma.sync's need eight (their rows of x_s are swizzled
     * only by token % 2). */
    constexpr int XL = WG && GT == MM_GROUP_WIDE ? 4 : 8, XT = THREADS / XL, XR = GT / XT,
                  XP = 8 / XL;
    /* A warp's accumulators: S strips of 16 rows by NC columns of 8 tokens (mma.sync: 32 rows
     * by GT / 4 tokens; wgmma: 16 rows by GT / 2 tokens, the warpgroup's) */
    constexpr int S = WG ? 1 : 2, NC = WG ? GT / 16 : GT / 32;
    constexpr int CW = GT == MM_GROUP_WIDER ? 4 : 2; /* mma.sync: MMA columns a step loads */
    /* Stages: wgmma's run a chunk behind the barrier (the tensor cores are fed across it), so
     * its A fragments and activations are three chunks deep; mma.sync's two. */
    constexpr int XS = WIDE_STAGES(WG), AW = 16 * STRIPS * WIDE_XW; /* AW: words of a stage of A */
    __shared__ uint4 w_s[2][THREADS / 32][2 * NW / 4]; /* [chunk % 2][warp][2 tiles' words] */
    /* mma.sync: A fragments [chunk % 2][strip][tile][lane] */
    __shared__ uint4 a_s[WG ? 1 : 2][STRIPS][WIDE_KT][32];
    /* From a 1024-byte boundary (the swizzle's) on: activations [chunk % XS][GT][WIDE_XW], and
     * wgmma's A [chunk % XS][16 STRIPS rows][WIDE_XW] (K-major, swizzled like the activations). */
    extern __shared__ __align__(16) uint32_t x_dyn[];
    __shared__ uint8_t lut_s[FP4 ? TRELLIS_LUT : 1];
    __shared__ int row_s[GT];
    __shared__ uint32_t off_s[GT]; /* where row_s[t] begins in x16, in words */

    mm_group grp;
    if (!group_of(p, blockIdx.y, GT, grp)) return;
    const int z = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3, tiles_c = p.cols / 16, n_chunks = tiles_c / WIDE_KT;
    const uint32_t x_at = ((uint32_t)__cvta_generic_to_shared(x_dyn) + 1023u) & ~1023u;
    uint32_t *x_s = x_dyn + (x_at - (uint32_t)__cvta_generic_to_shared(x_dyn)) / 4;
    const uint32_t a_at = x_at + XS * GT * WIDE_XW * 4; /* wgmma's A */
    group_tables<FP4>(p, grp, GT, row_s, lut_s);
    for (int t = threadIdx.x; t < grp.count; t += blockDim.x) /* row_s[t] is this thread's */
        off_s[t] = (uint32_t)row_s[t] * (p.cols / 2);
    __syncthreads(); /* row_s, off_s, lut_s */

    /* Decoding: tiles 2 dh, 2 dh + 1 of strip ds in every chunk, and their rows' scales (law
     * e4m3: one block, law e2m1: two). */
    const int ds = warp >> 1, dh = warp & 1, strip = blockIdx.x * STRIPS + ds;
    const uint4 *wsrc = reinterpret_cast<const uint4 *>(
        p.words[z] + (((size_t)grp.expert * (p.rows / 16) + strip) * tiles_c + 2 * dh) * NW);
    const int spr = p.cols / BLOCK;
    const uint8_t *sc0 = p.scales[z] + ((size_t)grp.expert * p.rows + 16 * strip + g) * spr +
                         32 / BLOCK * dh;
    const uint8_t *sc1 = sc0 + 8 * spr;
    auto scale_bytes = [&](const uint8_t *sc, int c) -> uint32_t {
        const uint8_t *b = sc + c * (16 * WIDE_KT / BLOCK);
        return FP4 ? *reinterpret_cast<const uint16_t *>(b) : *b;
    };
    /* The lane's constants go through kept(), and its A stores and word copies take shared
     * addresses kept the same way: remade from the thread index every chunk, they cost 42 of
     * the 299 instructions a warp issued a chunk (wgmma, groups of 256; 44 of 290 for groups
     * of 128), 3-7% of the time (docs/perf/h200-codec.md). */
    lane_window lw = lane_window_of<K>(lane);
    lw = {(int)kept(lw.i0), (int)kept(lw.i1), (int)kept(lw.i2), (int)kept(lw.off)};
    uint32_t sum[2];
    sum_bytes(sum, lane);
    sum[0] = kept(sum[0]);
    sum[1] = kept(sum[1]);
    /* wgmma: where the lane's words a0 and a2 of tile 2 dh go in a stage of A (row g of strip
     * ds, the tile's input pairs 2q and 2q + 8: words 16 dh + q and + 4 of the row, swizzled),
     * in bytes from the stage's start. Tile 2 dh + 1's are 8 words on, which the swizzle makes
     * a XOR by 32 bytes (it XORs bits 2-4 of a word index, and those of 16 dh + q are 0; rows
     * are 128-byte aligned). */
    const uint32_t ai = (16 * ds + g) * WIDE_XW + wgmma_word(g, 16 * dh + q);
    const uint32_t ab[2] = {kept(4 * ai), kept(4 * (ai ^ 4))};
    /* The warp's two tiles of chunk c into stage `stage` of a_s (wgmma: of A at a_at, a
     * fragment's four words to their places: a0, a2 row g, inputs 2q and 2q + 8, a1, a3 row
     * g + 8), times their rows' block scales (n0, n1: the scales' E4M3 bytes of rows g and
     * g + 8). */
    auto decode = [&](int c, int stage, uint32_t n0, uint32_t n1) {
        const uint32_t s0[1] = {e4m3x2_to_f16x2(n0)}, s1[1] = {e4m3x2_to_f16x2(n1)};
        const uint32_t *tw = reinterpret_cast<const uint32_t *>(w_s[c & 1][warp]);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            uint32_t a[4];
            lane_operands<K, FP4>(tw + u * NW, lw, sum, lut_s, a);
            const __half2 w0 = scale_h2(s0, FP4 ? u : 0), w1 = scale_h2(s1, FP4 ? u : 0);
            const uint4 v = make_uint4(h2_mul(a[0], w0), h2_mul(a[1], w1), h2_mul(a[2], w0),
                                       h2_mul(a[3], w1));
            if constexpr (WG) {
                const uint32_t r = a_at + stage * AW * 4, r0 = (r + ab[0]) ^ 32 * u,
                               r2 = (r + ab[1]) ^ 32 * u;
                asm volatile("st.shared.u32 [%0], %2;\n\t"
                             "st.shared.u32 [%1], %3;\n\t"
                             "st.shared.u32 [%0+%6], %4;\n\t" /* (g + 8) % 8 == g */
                             "st.shared.u32 [%1+%6], %5;" ::"r"(r0),
                             "r"(r2), "r"(v.x), "r"(v.z), "r"(v.y), "r"(v.w),
                             "n"(8 * WIDE_XW * 4)
                             : "memory");
            } else {
                a_s[stage][ds][2 * dh + u][lane] = v;
            }
        }
    };
    /* The warp's words of chunk c (2 tiles, 2 NW / 4 pieces of 16 bytes, a lane each), as one
     * cp.async group with the activations issued before. */
    const uint32_t wd = kept((uint32_t)__cvta_generic_to_shared(&w_s[0][warp][lane]));
    auto load_words = [&](int c) {
        copy_if(wd + (c & 1) * (uint32_t)sizeof w_s[0], reinterpret_cast<const uint32_t *>(wsrc),
                4 * (c * NW + lane), lane < 2 * NW / 4);
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    /* Copies: XL lanes a token, each XP of its 8 pieces (16 bytes) of a chunk, pieces xa + XL i
     * of tokens xt + XT r, to their swizzled places in x_s (piece j ^ sw). Tokens the group
     * lacks are not copied: their rows of x_s hold whatever was there, which reaches only their
     * own MMA columns, never stored. */
    const int xt = threadIdx.x / XL, xa = threadIdx.x % XL;
    const int sw = WG ? xt & 7 : (xt & 1) << 2;
    const uint32_t xd = x_at + 4 * xt * WIDE_XW + 16 * (xa ^ sw % XL) + 16 * XL * (sw / XL);
    /* wgmma's copies keep their tokens' offsets in registers (3% faster than reading them
     * every chunk); mma.sync's, short of registers, read theirs. A thread's copies stop at the
     * group's end, except those of wgmma's groups of 256 (four rounds), predicated off from
     * round nx on instead, so that ptxas issues them back to back (copy_if); predicated, the
     * one round of the groups of 128 ran 3% slower. */
    constexpr bool PRED = WG && XR > 1;
    const int nx = (grp.count - xt + XT - 1) / XT;
    uint32_t xoff[WG ? XR : 1];
#pragma unroll
    for (int r = 0; r < (WG ? XR : 1); r++) xoff[r] = r < nx ? off_s[xt + XT * r] + 4 * xa : 0u;
    auto load_x = [&](int c, int stage) {
#pragma unroll
        for (int r = 0; r < XR; r++) {
            if (!PRED && xt + XT * r >= grp.count) break;
            const uint32_t dst = xd + (stage * GT + XT * r) * WIDE_XW * 4;
            const uint32_t off = WG ? xoff[WG ? r : 0] : off_s[xt + XT * r] + 4 * xa;
#pragma unroll
            for (int i = 0; i < XP; i++) {
                if (PRED)
                    copy_if(dst ^ 16 * XL * i, p.x16 + c * WIDE_XW, off + 4 * XL * i, r < nx);
                else
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                                     dst ^ 16 * XL * i),
                                 "l"(p.x16 + off + c * WIDE_XW + 4 * XL * i)
                                 : "memory");
            }
        }
    };

    load_x(0, 0);
    load_words(0);
    if (n_chunks > 1)
        load_words(1);
    uint32_t n0 = scale_bytes(sc0, 0), n1 = scale_bytes(sc1, 0);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    decode(0, 0, n0, n1);
    if (n_chunks > 1) {
        n0 = scale_bytes(sc0, 1);
        n1 = scale_bytes(sc1, 1);
    }

    /* The warp's accumulators: strips rs + s, tokens t0 on (wgmma: warpgroup h has strips
     * 4 (h & 1) on and tokens GT / 2 (h >> 1) on). */
    const int h = warp >> 2;
    const int rs = WG ? 4 * (h & 1) + (warp & 3) : 2 * (warp & 1);
    const int t0 = WG ? GT / 2 * (h >> 1) : GT / 4 * (warp >> 1);
    const bool wg_any = t0 < grp.count; /* wgmma: the warpgroup has tokens */
    /* wgmma's descriptors of chunk 0's A (the warpgroup's 64 rows) and B (its tokens); a stage
     * on moves them AW or GT rows of 128 bytes */
    const uint64_t da0 = wgmma_desc(a_at + 64 * (h & 1) * WIDE_XW * 4),
                   db0 = wgmma_desc(x_at + t0 * WIDE_XW * 4);
    float acc[S][NC][4] = {};
    for (int c = 0, stage = 0, next = 1; c < n_chunks; /* stage, next: chunk c's, c + 1's */
         c++, stage = next, next = next + 1 == XS ? 0 : next + 1) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        if constexpr (WG) /* the copies and A stores are read next by the tensor cores */
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads(); /* chunk c's activations and A fragments; chunk c - 1 is consumed */
        if constexpr (WG) {
            if (wg_any) {
                const uint64_t da = da0 + stage * (AW * 4 / 16),
                               db = db0 + stage * (GT * WIDE_XW * 4 / 16);
                wgmma_fence();
#pragma unroll
                for (int u = 0; u < WIDE_KT; u++) wgmma<GT / 2>(acc[0], da + 2 * u, db + 2 * u);
                wgmma_commit();
            }
        }
        if (c + 1 < n_chunks) {
            load_x(c + 1, next);
            if (c + 2 < n_chunks)
                load_words(c + 2);
            else
                asm volatile("cp.async.commit_group;" ::: "memory");
            decode(c + 1, next, n0, n1);
            if (c + 2 < n_chunks) {
                n0 = scale_bytes(sc0, c + 2);
                n1 = scale_bytes(sc1, c + 2);
            }
        }
        if constexpr (WG) {
            wgmma_wait<GT / 2, 1>(acc[0]); /* chunk c - 1's: its buffers are free */
            continue;
        }
        const uint32_t *xq = x_s + (stage * GT + t0 + g) * WIDE_XW;
#pragma unroll
        for (int st = 0; st < WIDE_KT / 2; st++) { /* 32 inputs: tiles 2st, 2st + 1 */
            uint32_t a[2][2][4]; /* [strip][tile] */
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint4 v = a_s[stage][rs + (i >> 1)][2 * st + (i & 1)][lane];
                a[i >> 1][i & 1][0] = v.x;
                a[i >> 1][i & 1][1] = v.y;
                a[i >> 1][i & 1][2] = v.z;
                a[i >> 1][i & 1][3] = v.w;
            }
            const int col = wide_word(g, x_word(st, q));
            /* CW columns a step (groups of 256 took 3% less time by 4 than by 2, groups of 128
             * 12% more). Sets of columns past the group's end are skipped (a test per 8 CW
             * tokens keeps the branches out of the MMA sequence); columns of tokens the group
             * lacks are computed from whatever their rows hold and never stored. */
#pragma unroll
            for (int n = 0; n < NC; n += CW) {
                if (t0 + 8 * n >= grp.count) break;
                mma_step<CW, 2>(acc, n, a, xq + 8 * n * WIDE_XW + col, WIDE_XW);
            }
        }
    }

    if constexpr (WG) wgmma_wait<GT / 2, 0>(acc[0]);
    const float gs = p.g[z][grp.expert];
#pragma unroll
    for (int s = 0; s < S; s++) {
        const int r0 = 16 * (blockIdx.x * STRIPS + rs + s) + g;
#pragma unroll
        for (int n = 0; n < NC; n++)
#pragma unroll
            for (int i = 0; i < 2; i++) { /* accumulator columns 2q, 2q + 1: two tokens */
                const int t = t0 + 8 * n + 2 * q + i;
                if (t >= grp.count) continue;
                const float sc = gs * p.xa[row_s[t]];
                float *y = p.y[z] + (size_t)(grp.first + t) * p.rows;
                y[r0] = acc[s][n][i] * sc;
                y[r0 + 8] = acc[s][n][2 + i] * sc;
            }
    }
}

/* x16[r] <- row r of x as the wide GEMM's B operand: f16, law e2m1's already times their block
 * scales; mma.sync's in x_word's order along the whole row, wgmma's in k order (a tile's
 * inputs as its B fragments number them: word j of tile u = b0 of q = j, then the b1). A
 * thread per tile of a row. */
template <bool FP4, bool WG>
__global__ void stage_kernel(const mm_params p) {
    tmx_pdl_enter();
    const int tiles = p.cols / 16;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)p.x_rows * tiles) return;
    const long r = i / tiles;
    const int u = (int)(i % tiles);
    const uint4 v = reinterpret_cast<const uint4 *>(p.x + r * p.cols)[u];
    const float xb = FP4 ? p.xb[r * tiles + u] : 0.0f;
    uint32_t *xs = p.x16 + r * (p.cols / 2);
    if (WG) {
        uint32_t b0[4], b1[4];
        tile_fragments<FP4>(v, xb, b0, b1);
        uint4 *t = reinterpret_cast<uint4 *>(xs + 8 * u);
        t[0] = make_uint4(b0[0], b0[1], b0[2], b0[3]);
        t[1] = make_uint4(b1[0], b1[1], b1[2], b1[3]);
    } else {
        stage_tile<FP4>(xs + x_tile(u), v, xb);
    }
}

/* One group size's kernel with its dynamic shared memory. With the static part it passes the
 * default 48 KB at 64 tokens, which needs the attribute; the GEMV's stays under 36 KB, so the
 * decode step makes no extra host call. */
template <int K, bool FP4, int NG, bool NATIVE>
static cudaError_t launch_ng(const mm_params &p, dim3 grid, cudaStream_t stream) {
    const size_t smem = x_smem(8 * NG);
    if (NG > 1) {
        const cudaError_t e =
            cudaFuncSetAttribute(mm_kernel<K, FP4, NG, NATIVE>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    return trellis_launch(mm_kernel<K, FP4, NG, NATIVE>, grid, MM_WARPS * 32, smem, stream, p);
}

/* The wide GEMM: the activations staged as f16 first, then the GEMM, whose double-buffered
 * activations (32 or 64 KB, and 1 KB to align them) pass the 48 KB default with its 20-27 KB
 * of static shared memory. */
template <int K, bool FP4, int GT, bool WG>
static cudaError_t launch_wide(const mm_params &p, dim3 grid, cudaStream_t stream) {
    if ((size_t)p.x_rows * p.cols / 2 > UINT32_MAX) return cudaErrorInvalidValue; /* off_s */
    const long tiles = (long)p.x_rows * (p.cols / 16);
    cudaError_t e = trellis_launch(stage_kernel<FP4, WG>, (unsigned)((tiles + 255) / 256), 256,
                                   0, stream, p);
    const size_t rows_s = GT + (WG ? 16 * WIDE_STRIPS(WG) : 0); /* a stage's x and A rows */
    const size_t smem = WIDE_STAGES(WG) * rows_s * WIDE_XW * sizeof(uint32_t) + 1024;
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(mm_wide_kernel<K, FP4, GT, WG>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const dim3 cta_grid(p.rows / (16 * WIDE_STRIPS(WG)), grid.y, grid.z);
    return trellis_launch(mm_wide_kernel<K, FP4, GT, WG>, cta_grid, WIDE_STRIPS(WG) * 64, smem,
                          stream, p);
}

/* The current device's compute capability major, 0 if it cannot be had. */
static int device_major() {
    int dev = 0, major = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
                   cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ==
                       cudaSuccess
               ? major
               : 0;
}

/* Whether the wide GEMM takes its wgmma form: on Hopper (sm_90a code), unless asked for the
 * mma.sync form (TRELLIS_CUDA_MMA_SYNC). */
static bool wide_wgmma(int group) {
    return !(group & TRELLIS_CUDA_MMA_SYNC) && device_major() == 9;
}

/* Whether law e2m1's GEMV and grouped GEMM take the native FP4 form: only when asked
 * (TRELLIS_CUDA_NATIVE_FP4). It has run only as the emulation, and on sm_120a it issues as many
 * instructions a tile as the f16 form (docs/perf/h200-codec.md), so it waits for a Blackwell
 * to be timed on before the expert block takes it. */
static bool fp4_native(int group) {
    return !(group & TRELLIS_CUDA_MMA_SYNC) && group & TRELLIS_CUDA_NATIVE_FP4;
}

template <int K, bool FP4, int NG>
static cudaError_t launch_grouped(int group, const mm_params &p, dim3 grid,
                                  cudaStream_t stream) {
    if constexpr (FP4)
        if (fp4_native(group)) return launch_ng<K, FP4, NG, true>(p, grid, stream);
    return launch_ng<K, FP4, NG, false>(p, grid, stream);
}

template <int K, bool FP4>
static cudaError_t launch_k(int group, const mm_params &p, dim3 grid, cudaStream_t stream) {
    switch (group & ~TRELLIS_CUDA_FORMS) {
    case MM_GROUP_SMALL: return launch_grouped<K, FP4, MM_GROUP_SMALL / 8>(group, p, grid, stream);
    case MM_GROUP_LARGE: return launch_grouped<K, FP4, MM_GROUP_LARGE / 8>(group, p, grid, stream);
    case MM_GROUP_WIDE:
        return wide_wgmma(group) ? launch_wide<K, FP4, MM_GROUP_WIDE, true>(p, grid, stream)
                                 : launch_wide<K, FP4, MM_GROUP_WIDE, false>(p, grid, stream);
    case MM_GROUP_WIDER:
        return wide_wgmma(group) ? launch_wide<K, FP4, MM_GROUP_WIDER, true>(p, grid, stream)
                                 : launch_wide<K, FP4, MM_GROUP_WIDER, false>(p, grid, stream);
    default: return cudaErrorInvalidValue;
    }
}

template <bool FP4>
static cudaError_t launch_law(int K, int group, const mm_params &p, dim3 grid,
                              cudaStream_t stream) {
    switch (K) {
    case 2: return launch_k<2, FP4>(group, p, grid, stream);
    case 3: return launch_k<3, FP4>(group, p, grid, stream);
    case 4: return launch_k<4, FP4>(group, p, grid, stream);
    case 5: return launch_k<5, FP4>(group, p, grid, stream);
    case 6: return launch_k<6, FP4>(group, p, grid, stream);
    default: return cudaErrorInvalidValue;
    }
}

cudaError_t trellis_mm_launch(int fp4, int K, int group, const mm_params &p, int n_mats,
                              int max_groups, cudaStream_t stream) {
    if (max_groups <= 0) return cudaSuccess;
    const dim3 grid(p.rows / (16 * MM_WARPS), max_groups, n_mats);
    return fp4 ? launch_law<true>(K, group, p, grid, stream)
               : launch_law<false>(K, group, p, grid, stream);
}

/* --- the decode check ------------------------------------------------------------------- */

/* The E4M3 byte of an f16 operand value; 0x7F (NaN, never a code) where it is not an E4M3
 * value, so that the check sees it. */
__device__ __forceinline__ uint8_t operand_byte(uint32_t h) {
    const uint32_t b = f16x2_to_e4m3x2(h) & 0xffu;
    return (e4m3x2_to_f16x2(b) & 0xffffu) == h ? (uint8_t)b : 0x7F;
}

template <int K, bool FP4>
__global__ void decode_kernel(const uint32_t *words, int n_tiles, const uint8_t *lut,
                              uint8_t *out) {
    constexpr int NW = 8 * K;
    __shared__ uint32_t w_s[NW];
    __shared__ uint8_t lut_s[FP4 ? TRELLIS_LUT : 1];
    const int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
    if (FP4)
        for (int i = lane; i < TRELLIS_LUT; i += 32)
            lut_s[i] = (uint8_t)(e4m3x2_to_f16x2(lut[i]) >> 8);
    const lane_window lw = lane_window_of<K>(lane);
    uint32_t sum[2];
    sum_bytes(sum, lane);
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        __syncwarp();
        for (int i = lane; i < NW; i += 32) w_s[i] = words[(size_t)t * NW + i];
        __syncwarp();
        uint32_t a[4];
        lane_operands<K, FP4>(w_s, lw, sum, lut_s, a);
        /* a_i half e: row g + 8(i & 1), column 8(i >> 1) + 4(q & 1) + (q >> 1) + 2e, which is
         * trellis position 8(4 (row % 8) + (column % 8) / 2) + (column & 1) + 2 (column / 8)
         * + 4 (row / 8) (§2) */
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * (i >> 1) + 4 * (q & 1) + (q >> 1) + 2 * e;
                const int pos = 8 * (4 * g + (col & 7) / 2) + (col & 1) + 2 * (col >> 3) +
                                4 * (i & 1);
                out[(size_t)t * 256 + pos] = operand_byte(a[i] >> (16 * e) & 0xffffu);
            }
    }
}

/* The E4M3 byte of an E2M1 code's value (§1.2). */
__device__ __forceinline__ uint8_t e4m3_of_e2m1(uint32_t c) {
    const uint32_t m = c & 7u;
    return (uint8_t)((c & 8u) << 4 | (m < 2 ? 0x30u * m : 4u * m + 48u));
}

/* The native form's check: tiles 2i, 2i + 1 as the pair (u0, u1) of lane_codes_e2m1, each
 * lane's codes back to their trellis positions (nu order) as the E4M3 bytes of their values. */
template <int K>
__global__ void decode_native_kernel(const uint32_t *words, int n_tiles, const uint8_t *lut,
                                     uint8_t *out) {
    constexpr int NW = 8 * K;
    __shared__ uint32_t w_s[2 * NW];
    __shared__ uint8_t nib_s[TRELLIS_LUT];
    const int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
    for (int i = lane; i < TRELLIS_LUT; i += 32) nib_s[i] = (uint8_t)e2m1x4_of_e4m3x4(lut[i]);
    const lane_window lw = lane_window_of<K>(lane);
    uint32_t sum[2];
    sum_bytes(sum, lane);
    for (int t = 2 * blockIdx.x; t < n_tiles; t += 2 * gridDim.x) {
        __syncwarp();
        for (int i = lane; i < 2 * NW; i += 32) w_s[i] = words[(size_t)t * NW + i];
        __syncwarp();
        uint32_t r[2];
        lane_codes_e2m1<K>(w_s, w_s + NW, lw, sum, nib_s, r[0], r[1]);
        uint8_t *o = out + (size_t)(t + (q >> 1)) * 256;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int pos = 8 * (4 * g + 2 * (q & 1) + (i & 1)) + (i >> 1);
            o[pos] = e4m3_of_e2m1(r[0] >> 4 * i);
            o[pos + 4] = e4m3_of_e2m1(r[1] >> 4 * i);
        }
    }
}

template <bool FP4>
static cudaError_t decode_law(int K, const uint32_t *words, int n_tiles, const uint8_t *lut,
                              uint8_t *out, cudaStream_t stream) {
    const int blocks = n_tiles < 4096 ? n_tiles : 4096;
    switch (K) {
    case 2: decode_kernel<2, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 3: decode_kernel<3, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 4: decode_kernel<4, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 5: decode_kernel<5, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 6: decode_kernel<6, FP4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

static cudaError_t decode_native(int K, const uint32_t *words, int n_tiles, const uint8_t *lut,
                                 uint8_t *out, cudaStream_t stream) {
    const int blocks = n_tiles / 2 < 4096 ? n_tiles / 2 : 4096;
    switch (K) {
    case 2: decode_native_kernel<2><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 3: decode_native_kernel<3><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 4: decode_native_kernel<4><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 5: decode_native_kernel<5><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    case 6: decode_native_kernel<6><<<blocks, 32, 0, stream>>>(words, n_tiles, lut, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

/* Writes "what: CUDA error" to msg and returns 1, or 0 for cudaSuccess. */
static int failed(cudaError_t e, const char *what, char *msg, size_t size) {
    if (e == cudaSuccess) return 0;
    snprintf(msg, size, "%s: %s", what, cudaGetErrorString(e));
    return 1;
}

extern "C" int trellis_cuda_decode_tiles(int fp4, int K, const uint8_t *lut_host,
                                         const uint32_t *words, int n_tiles, uint8_t *out,
                                         void *stream, char *msg, size_t size) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool native = fp4 & TRELLIS_CUDA_NATIVE_FP4;
    fp4 &= ~TRELLIS_CUDA_NATIVE_FP4;
    if (native && (!fp4 || n_tiles % 2)) {
        snprintf(msg, size, "decode: the native form is law e2m1's, tiles in pairs (%d tiles)",
                 n_tiles);
        return 1;
    }
    uint8_t *lut = NULL;
    if (fp4 && (failed(cudaMallocAsync(&lut, TRELLIS_LUT, s), "decode: cudaMallocAsync", msg,
                       size) ||
                failed(cudaMemcpyAsync(lut, lut_host, 1021, cudaMemcpyHostToDevice, s),
                       "decode: copy of the table", msg, size)))
        return 1;
    cudaError_t e = native ? decode_native(K, words, n_tiles, lut, out, s)
                    : fp4  ? decode_law<true>(K, words, n_tiles, lut, out, s)
                           : decode_law<false>(K, words, n_tiles, lut, out, s);
    if (lut && e == cudaSuccess) e = cudaFreeAsync(lut, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    return failed(e, "decode", msg, size);
}

/* A decode step (at most 8 tokens, so at most 8 an expert) takes the GEMV; the wide GEMM from
 * MM_WIDE_FROM tokens an expert on average (law e2m1: MM_WIDE_FROM_E2M1), its groups of 256
 * from MM_WIDER_FROM (the crossovers measured by trellis-gpu-bench --groups,
 * docs/perf/h200-codec.md). */
extern "C" int trellis_cuda_group(int fp4, int tokens, long pairs, int experts) {
    if (tokens <= MM_GROUP_SMALL || pairs <= (long)MM_GROUP_SMALL * experts)
        return MM_GROUP_SMALL;
    if (pairs < (long)(fp4 ? MM_WIDE_FROM_E2M1 : MM_WIDE_FROM) * experts) return MM_GROUP_LARGE;
    return pairs < (long)MM_WIDER_FROM * experts ? MM_GROUP_WIDE : MM_GROUP_WIDER;
}

/* The group's size (its tokens), the forms asked for aside. */
static int matmul_group(int fp4, int group, int m, int n_experts) {
    group &= ~TRELLIS_CUDA_FORMS;
    return group ? group : trellis_cuda_group(fp4, m, (long)m * n_experts, n_experts);
}

extern "C" size_t trellis_cuda_matmul_work(int fp4, int n_experts, int cols, int m, int group) {
    return trellis_mm_x16_bytes(matmul_group(fp4, group, m, n_experts), (size_t)n_experts * m,
                                cols);
}

extern "C" const char *trellis_cuda_matmul_form(int fp4, int group, int m, int n_experts) {
    if (matmul_group(fp4, group, m, n_experts) >= MM_GROUP_WIDE)
        return wide_wgmma(group) ? "wgmma" : "mma.sync";
    if (fp4 && fp4_native(group))
        return device_major() == 12 ? "fp4-mma" : "fp4-mma (emulated)";
    return "mma.sync";
}

extern "C" int trellis_cuda_matmul(int fp4, int K, const uint8_t *lut, const uint32_t *words,
                                   const uint8_t *scales, const float *g, int n_experts,
                                   int rows, int cols, const uint8_t *x, const float *a,
                                   const float *xb, int m, int group, void *work, float *y,
                                   void *stream, char *msg, size_t size) {
    const int form = group & TRELLIS_CUDA_FORMS;
    group = matmul_group(fp4, group, m, n_experts);
    if (rows % 128 || cols % 128 || m < 1 || n_experts < 1) {
        snprintf(msg, size, "matmul: [%d][%d] x %d tokens of %d experts", rows, cols, m,
                 n_experts);
        return 1;
    }
    if (trellis_mm_x16_bytes(group, 1, cols) && !work) {
        snprintf(msg, size, "matmul: groups of %d tokens need work (trellis_cuda_matmul_work)",
                 group);
        return 1;
    }
    mm_params p = {};
    p.words[0] = words;
    p.scales[0] = scales;
    p.g[0] = g;
    p.y[0] = y;
    p.rows = rows;
    p.cols = cols;
    p.m = m;
    p.x = x;
    p.xa = a;
    p.xb = xb;
    p.lut = lut;
    p.x16 = static_cast<uint32_t *>(work);
    p.x_rows = n_experts * m;
    return failed(trellis_mm_launch(fp4, K, group | form, p, 1,
                                    n_experts * ((m + group - 1) / group),
                                    static_cast<cudaStream_t>(stream)),
                  "matmul", msg, size);
}
