/* attention.c: rope, qk_norm_rope, kv_store and causal GQA attention over the paged KV cache.
 *
 * The cache is a pool of blocks of block_size rows; row r of block b is slot b * block_size + r,
 * and each slot holds [hkv][hd] keys (and values) in F32, BF16, F8_E4M3 or I8. F8 and I8 rows
 * carry one F32 scale per slot and KV head. Attention decodes cached rows as it reads them and
 * computes in F32. */
#include <math.h>

#include "cpu.h"

/* Scores computed before each softmax rescale: a stack array, however long the context. */
#define SCORE_BLOCK 256

static int check_heads(struct cpu_ctx *c, const char *op, int n, int heads, int hd) {
    if (n < 0 || heads <= 0 || hd <= 0 || hd > CPU_MAX_HEAD_DIM) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: n = %d, heads = %d, head_dim = %d (at most %d)", op, n,
                 heads, hd, CPU_MAX_HEAD_DIM);
        return 0;
    }
    return 1;
}

/* --- rope ----------------------------------------------------------------------------------- */

struct rope_job {
    float *x; /* [n][heads][hd] */
    const int32_t *pos;
    const float *inv_freq; /* [hd / 2] */
    int64_t heads, hd;
};

/* One token's heads x [heads][hd] at position pos: the angles in double (pos * inv_freq
 * reaches thousands of radians, where a float angle is off by 1e-4), then each head's pairs
 * (i, i + hd/2) rotated. */
static void rope_token(float *x, int64_t heads, int64_t hd, int32_t pos,
                       const float *inv_freq) {
    int64_t half = hd / 2;
    float cs[CPU_MAX_HEAD_DIM / 2], sn[CPU_MAX_HEAD_DIM / 2];
    for (int64_t i = 0; i < half; i++) {
        double a = (double)pos * inv_freq[i];
        cs[i] = (float)cos(a);
        sn[i] = (float)sin(a);
    }
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cs[i] - b * sn[i];
            v[i + half] = b * cs[i] + a * sn[i];
        }
    }
}

static void rope_task(void *arg, int64_t t) {
    const struct rope_job *j = arg;
    rope_token(j->x + t * j->heads * j->hd, j->heads, j->hd, j->pos[t], j->inv_freq);
}

void cpu_rope(void *ctx, float *x, const int32_t *pos, const float *inv_freq, int n, int heads,
              int hd) {
    struct cpu_ctx *c = ctx;
    if (!check_heads(c, "rope", n, heads, hd)) return;
    if (hd % 2) {
        cpu_fail(c, TMX_ERR_INVALID, "rope: head_dim %d is odd", hd);
        return;
    }
    struct rope_job j = {x, pos, inv_freq, heads, hd};
    cpu_pool_run(c->pool, n, rope_task, &j);
}

/* --- qk_norm_rope: each head's norm, then rope, for q and k -------------------------------- */

struct qk_rope_job {
    float *q, *k;           /* [n][hq][hd], [n][hkv][hd] */
    const float *qw, *kw;   /* [hd] norm weights as F32 (NULL: weight 1) */
    int q_normed, k_normed; /* whether each has a norm */
    const int32_t *pos;
    const float *inv_freq;
    int64_t hq, hkv, hd;
    float eps;
};

/* One token: its heads normed as rmsnorm norms rows, then rotated as rope rotates them. */
static void qk_rope_task(void *arg, int64_t t) {
    const struct qk_rope_job *j = arg;
    float *q = j->q + t * j->hq * j->hd, *k = j->k + t * j->hkv * j->hd;
    for (int64_t h = 0; j->q_normed && h < j->hq; h++)
        cpu_rmsnorm_row(q + h * j->hd, q + h * j->hd, j->qw, (int)j->hd, j->eps);
    for (int64_t h = 0; j->k_normed && h < j->hkv; h++)
        cpu_rmsnorm_row(k + h * j->hd, k + h * j->hd, j->kw, (int)j->hd, j->eps);
    rope_token(q, j->hq, j->hd, j->pos[t], j->inv_freq);
    rope_token(k, j->hkv, j->hd, j->pos[t], j->inv_freq);
}

void cpu_qk_norm_rope(void *ctx, float *q, float *k, const struct tmx_tensor *q_norm,
                      const struct tmx_tensor *k_norm, const int32_t *pos,
                      const float *inv_freq, int n, int hq, int hkv, int hd, float eps) {
    static const char *const what[2] = {"q_norm", "k_norm"};
    struct cpu_ctx *c = ctx;
    const float *qw, *kw;
    if (!check_heads(c, "qk_norm_rope", n, hq, hd) ||
        !check_heads(c, "qk_norm_rope", n, hkv, hd) ||
        !cpu_pair_f32(c, "qk_norm_rope", what, q_norm, k_norm, hd, &qw, &kw))
        return;
    if (hd % 2) {
        cpu_fail(c, TMX_ERR_INVALID, "qk_norm_rope: head_dim %d is odd", hd);
        return;
    }
    struct qk_rope_job j = {q, k, qw, kw, q_norm != NULL, k_norm != NULL, pos, inv_freq,
                            hq, hkv, hd, eps};
    cpu_pool_run(c->pool, n, qk_rope_task, &j);
}

/* --- the paged cache ------------------------------------------------------------------------ */

/* Checks what every paged op relies on; records a failure naming `op` otherwise. */
static int check_cache(struct cpu_ctx *c, const char *op, const struct tmx_kv_cache *kv) {
    if (!check_heads(c, op, 0, kv->hkv, kv->hd)) return 0;
    int quantized = kv->dtype == TMX_DTYPE_F8_E4M3 || kv->dtype == TMX_DTYPE_I8;
    if (!quantized && kv->dtype != TMX_DTYPE_F32 && kv->dtype != TMX_DTYPE_BF16) {
        cpu_fail(c, TMX_ERR_UNSUPPORTED, "%s: cache dtype %s (F32, BF16, F8_E4M3 or I8)", op,
                 cpu_dtype_name(kv->dtype));
        return 0;
    }
    if (kv->n_blocks <= 0 || kv->block_size <= 0 || !kv->k || !kv->v ||
        (quantized && (!kv->k_scale || !kv->v_scale))) {
        cpu_fail(c, TMX_ERR_INVALID, "%s: cache of %d blocks of %d rows, %s", op, kv->n_blocks,
                 kv->block_size, quantized ? "scales missing" : "buffers missing");
        return 0;
    }
    return 1;
}

/* Cached rows are decoded to F32 8 elements at a time inside the dot product and the weighted
 * sum, so no decoded copy of the cache is ever made; dt is a constant where these are inlined.
 * A quantized row's scale is the caller's. An E4M3 code with its exponent and mantissa moved
 * up 7 bits and its sign to bit 15 is the F16 of 2^-8 times its value, subnormals included, so
 * F8 rows go through the F16 conversion (the NaN code 0x7f, never stored, reads as 480). */
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline f32x8 cache_load(enum tmx_dtype dt, const void *row, int64_t i) {
    switch (dt) {
    case TMX_DTYPE_BF16: return v8_load_bf16((const uint16_t *)row + i);
    case TMX_DTYPE_F8_E4M3: {
        const uint8_t *p = (const uint8_t *)row + i;
        u16x8 b = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
        uint16_t h[8];
        b = (b & 0x80) << 8 | (b & 0x7f) << 7;
        memcpy(h, &b, sizeof h);
        return v8_load_f16(h) * v8_splat(256.0f);
    }
    case TMX_DTYPE_I8: {
        const int8_t *p = (const int8_t *)row + i;
        i32x8 v = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
        return __builtin_convertvector(v, f32x8);
    }
    default: return v8_load((const float *)row + i);
    }
}

/* The first n < 8 elements, zero padded. */
static inline f32x8 cache_load_part(enum tmx_dtype dt, const void *row, int64_t i, int n) {
    float t[8] = {0};
    for (int l = 0; l < n; l++) {
        switch (dt) {
        case TMX_DTYPE_BF16: t[l] = tmx_bf16_to_f32(((const uint16_t *)row)[i + l]); break;
        case TMX_DTYPE_F8_E4M3: t[l] = tmx_e4m3_to_f32(((const uint8_t *)row)[i + l]); break;
        case TMX_DTYPE_I8: t[l] = ((const int8_t *)row)[i + l]; break;
        default: t[l] = ((const float *)row)[i + l]; break;
        }
    }
    return v8_load(t);
}

/* q . row over hd elements, in cpu_dot's lane order. */
static inline float cache_dot(enum tmx_dtype dt, const float *q, const void *row, int64_t hd) {
    f32x8 acc = v8_splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8) acc += v8_load(q + i) * cache_load(dt, row, i);
    int rest = (int)(hd - i);
    if (rest) acc += v8_load_part(q + i, rest) * cache_load_part(dt, row, i, rest);
    return v8_sum(acc);
}

/* acc[i] += w * row[i], i < hd; acc has room for hd rounded up to 8. */
static inline void cache_axpy(enum tmx_dtype dt, float *acc, float w, const void *row,
                              int64_t hd) {
    f32x8 wv = v8_splat(w);
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8) v8_store(acc + i, v8_load(acc + i) + wv * cache_load(dt, row, i));
    if (i < hd)
        v8_store(acc + i, v8_load(acc + i) + wv * cache_load_part(dt, row, i, (int)(hd - i)));
}

/* --- kv_store ------------------------------------------------------------------------------- */

/* Below this many floats a store runs inline: a decode step's row is not worth a wake-up. */
#define STORE_GRAIN (1 << 15)

/* tmx_f32_to_e4m3 without data-dependent branches, which cost store_row more than the
 * arithmetic; it returns the same code for every float (compared over all 2^32 when written).
 * Below 2^-6 E4M3 is subnormal, in steps of 2^-9: adding 2^14, whose ulp is 2^-9, rounds |f| to
 * that step (to nearest even, by the FPU) and leaves the step count in the low mantissa bits.
 * Above, the mantissa is rounded to 3 bits in the integer domain and the float exponent
 * rebiased from 127 to 7; codes past 0x7e (448) saturate, NaN stays NaN. */
static inline uint8_t e4m3_from(float f) {
    uint32_t u, sub;
    memcpy(&u, &f, sizeof u);
    uint32_t a = u & 0x7fffffffu;
    float small;
    memcpy(&small, &a, sizeof small);
    small += 16384.0f;
    memcpy(&sub, &small, sizeof sub);
    uint32_t norm = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t code = a < 0x3c800000u ? sub - 0x46800000u : norm > 0x7eu ? 0x7eu : norm;
    return (uint8_t)(((u >> 24) & 0x80u) | (a > 0x7f800000u ? 0x7fu : code));
}

/* One head's row x[hd] into dst in the cache's dtype; F8 and I8 also write *scale. The row is
 * divided by its scale in F32 (a reciprocal would round differently), then rounded to nearest
 * even. amax is taken on the bits of |x| (ordered like the values; NaN ignored) and the I8
 * clamp sends NaN to -127: plain comparisons, so that every loop vectorizes. */
static void store_row(enum tmx_dtype dt, void *dst, float *scale, const float *x, int64_t hd) {
    if (dt == TMX_DTYPE_F32) {
        memcpy(dst, x, (size_t)hd * sizeof *x);
        return;
    }
    if (dt == TMX_DTYPE_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < hd; i++) d[i] = tmx_f32_to_bf16(x[i]);
        return;
    }
    uint32_t amax_bits = 0;
    for (int64_t i = 0; i < hd; i++) {
        uint32_t a;
        memcpy(&a, x + i, sizeof a);
        a &= 0x7fffffffu;
        amax_bits = a > amax_bits && a <= 0x7f800000u ? a : amax_bits;
    }
    float amax, s;
    memcpy(&amax, &amax_bits, sizeof amax);
    *scale = s = amax / (dt == TMX_DTYPE_I8 ? 127.0f : 448.0f);
    if (s == 0) {
        memset(dst, 0, (size_t)hd);
    } else if (dt == TMX_DTYPE_I8) {
        int8_t *d = dst;
        for (int64_t i = 0; i < hd; i++) {
            float r = rintf(x[i] / s);
            r = r >= -127.0f ? r : -127.0f;
            d[i] = (int8_t)(r <= 127.0f ? r : 127.0f);
        }
    } else {
        uint8_t *d = dst;
        for (int64_t i = 0; i < hd; i++) d[i] = e4m3_from(x[i] / s);
    }
}

struct kv_store_job {
    const struct tmx_kv_cache *kv;
    const float *k, *v; /* [n][hkv][hd] */
    const int32_t *slots;
    int64_t n, per; /* per: (side, head) pairs per task */
};

/* Pairs p = side * hkv + head (side 0: keys, 1: values), every token in order: a slot named
 * twice ends up with its last row, as when stored one token at a time. */
static void kv_store_task(void *arg, int64_t task) {
    const struct kv_store_job *j = arg;
    const struct tmx_kv_cache *kv = j->kv;
    int64_t hkv = kv->hkv, hd = kv->hd, size = (int64_t)cpu_kv_elem_size(kv->dtype);
    for (int64_t p = task * j->per; p < 2 * hkv && p < (task + 1) * j->per; p++) {
        int64_t side = p / hkv, h = p % hkv;
        const float *src = side ? j->v : j->k;
        char *cache = side ? kv->v : kv->k;
        float *scales = side ? kv->v_scale : kv->k_scale;
        for (int64_t t = 0; t < j->n; t++) {
            if (j->slots[t] < 0) continue;
            int64_t row = (int64_t)j->slots[t] * hkv + h;
            store_row(kv->dtype, cache + row * hd * size, scales ? scales + row : NULL,
                      src + (t * hkv + h) * hd, hd);
        }
    }
}

void cpu_kv_store(void *ctx, const struct tmx_kv_cache *kv, const float *k, const float *v,
                  const int32_t *slots, int n) {
    struct cpu_ctx *c = ctx;
    if (!check_cache(c, "kv_store", kv) || !check_heads(c, "kv_store", n, kv->hkv, kv->hd))
        return;
    int64_t n_slots = (int64_t)kv->n_blocks * kv->block_size;
    for (int t = 0; t < n; t++)
        if (slots[t] >= n_slots) {
            cpu_fail(c, TMX_ERR_INVALID, "kv_store: slot %d at row %d outside the cache's %lld",
                     slots[t], t, (long long)n_slots);
            return;
        }
    int64_t pairs = 2 * (int64_t)kv->hkv;
    struct kv_store_job j = {kv, k, v, slots, n, pairs};
    if ((int64_t)n * pairs * kv->hd >= STORE_GRAIN) j.per = 1;
    cpu_pool_run(c->pool, (pairs + j.per - 1) / j.per, kv_store_task, &j);
}

/* --- attention ------------------------------------------------------------------------------ */

struct attention_job {
    float *out;     /* [n][hq][hd] */
    const float *q; /* [n][hq][hd] */
    const struct tmx_kv_cache *kv;
    const int32_t *tables; /* [n_seqs][max_blocks] */
    const int32_t *seq, *pos;
    int64_t max_blocks, hq, window;
    float scale;
};

/* One (token, query head): softmax(q.k * scale) v over the window, a block of scores at a time.
 * The running max m and sum l are rescaled when a block raises the max, so every exponent is
 * at most 0 and the result is the exact softmax up to rounding. Positions are walked block by
 * block of the sequence's table; a quantized row's scale multiplies its dot product and its
 * softmax weight rather than each element. dt is a constant where this is inlined. */
static inline __attribute__((always_inline)) void attend(enum tmx_dtype dt,
                                                         const struct attention_job *j,
                                                         int64_t task) {
    const struct tmx_kv_cache *kv = j->kv;
    int64_t t = task / j->hq, hd = kv->hd, hkv = kv->hkv, bs = kv->block_size;
    int64_t head = task % j->hq / (j->hq / hkv);
    int64_t row_bytes = hd * (int64_t)cpu_kv_elem_size(dt);
    int quantized = dt == TMX_DTYPE_F8_E4M3 || dt == TMX_DTYPE_I8;
    const int32_t *table = j->tables + j->seq[t] * j->max_blocks;
    const float *q = j->q + task * hd;
    int64_t p = j->pos[t], lo = j->window > 0 && p - j->window + 1 > 0 ? p - j->window + 1 : 0;
    int64_t blk = lo / bs, r = lo % bs; /* where position j0 + b lives */

    float acc[CPU_MAX_HEAD_DIM], s[SCORE_BLOCK];
    int64_t rows[SCORE_BLOCK]; /* cache row (slot * hkv + head) of each score */
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < (hd + 7) / 8 * 8; i++) acc[i] = 0.0f; /* cache_axpy's tail too */
    for (int64_t j0 = lo; j0 <= p; j0 += SCORE_BLOCK) {
        int64_t nb = p + 1 - j0 < SCORE_BLOCK ? p + 1 - j0 : SCORE_BLOCK;
        float bm = -INFINITY;
        for (int64_t b = 0; b < nb; b++) {
            rows[b] = ((int64_t)table[blk] * bs + r) * hkv + head;
            if (++r == bs) r = 0, blk++;
            float dot = cache_dot(dt, q, (const char *)kv->k + rows[b] * row_bytes, hd);
            s[b] = (quantized ? dot * kv->k_scale[rows[b]] : dot) * j->scale;
            bm = s[b] > bm ? s[b] : bm;
        }
        if (bm > m) {
            float rescale = expf(m - bm);
            l *= rescale;
            for (int64_t i = 0; i < hd; i++) acc[i] *= rescale;
            m = bm;
        }
        for (int64_t b = 0; b < nb; b++) {
            float e = expf(s[b] - m);
            l += e;
            cache_axpy(dt, acc, quantized ? e * kv->v_scale[rows[b]] : e,
                       (const char *)kv->v + rows[b] * row_bytes, hd);
        }
    }
    float *out = j->out + task * hd;
    for (int64_t i = 0; i < hd; i++) out[i] = acc[i] / l;
}

static void attention_task(void *arg, int64_t task) {
    const struct attention_job *j = arg;
    switch (j->kv->dtype) {
    case TMX_DTYPE_BF16: attend(TMX_DTYPE_BF16, j, task); break;
    case TMX_DTYPE_F8_E4M3: attend(TMX_DTYPE_F8_E4M3, j, task); break;
    case TMX_DTYPE_I8: attend(TMX_DTYPE_I8, j, task); break;
    default: attend(TMX_DTYPE_F32, j, task); break;
    }
}

/* Every block a token reads is named in its table and inside the pool. */
static int check_tables(struct cpu_ctx *c, const struct tmx_kv_cache *kv, const int32_t *tables,
                        int max_blocks, const int32_t *seq, const int32_t *pos, int n,
                        int window) {
    for (int t = 0; t < n; t++) {
        if (pos[t] < 0 || seq[t] < 0 || pos[t] / kv->block_size >= max_blocks) {
            cpu_fail(c, TMX_ERR_INVALID,
                     "attention: row %d is sequence %d at position %d (tables of %d blocks of %d)",
                     t, seq[t], pos[t], max_blocks, kv->block_size);
            return 0;
        }
        int lo = window > 0 && pos[t] - window + 1 > 0 ? pos[t] - window + 1 : 0;
        const int32_t *table = tables + (int64_t)seq[t] * max_blocks;
        for (int b = lo / kv->block_size; b <= pos[t] / kv->block_size; b++)
            if (table[b] < 0 || table[b] >= kv->n_blocks) {
                cpu_fail(c, TMX_ERR_INVALID,
                         "attention: row %d reads entry %d of sequence %d's table, block %d, "
                         "outside the cache's %d",
                         t, b, seq[t], table[b], kv->n_blocks);
                return 0;
            }
    }
    return 1;
}

void cpu_attention(void *ctx, float *out, const float *q, const struct tmx_kv_cache *kv,
                   const int32_t *tables, int max_blocks, const int32_t *seq, const int32_t *pos,
                   int n, int hq, int window, float scale) {
    struct cpu_ctx *c = ctx;
    if (!check_cache(c, "attention", kv) || !check_heads(c, "attention", n, hq, kv->hd)) return;
    if (hq % kv->hkv || max_blocks <= 0 || window < 0) {
        cpu_fail(c, TMX_ERR_INVALID,
                 "attention: %d query heads over %d KV heads, tables of %d blocks, window %d", hq,
                 kv->hkv, max_blocks, window);
        return;
    }
    if (!check_tables(c, kv, tables, max_blocks, seq, pos, n, window)) return;
    struct attention_job j = {out, q, kv, tables, seq, pos, max_blocks, hq, window, scale};
    cpu_pool_run(c->pool, (int64_t)n * hq, attention_task, &j);
}
