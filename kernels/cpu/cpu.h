/* cpu.h: internals shared by the files of the CPU kernel set: its context, error recording,
 * scratch memory, 8-wide float vectors with weight loads, and the ops plugin.c puts in its table.
 *
 * Vectors are GNU C vector extensions (GCC and Clang, any target): with plain arrays GCC keeps
 * a matmul tile's accumulators in memory (measured 21 against 55 GFLOP/s on one core), while
 * vector types stay in registers and lower to AVX2/FMA under -march=x86-64-v3. */
#ifndef TMX_KERNELS_CPU_H
#define TMX_KERNELS_CPU_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tmx/kernels.h"
#include "tmx/plugin.h"
#include "tmx/tensor.h"

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "pool.h"

/* Longest head_dim rope and attention accept: they keep a head's row on the stack. */
#define CPU_MAX_HEAD_DIM 1024

struct cpu_ctx {
    const struct tmx_host *host;
    struct tmx_pool *pool;
    enum tmx_status status; /* first failure since the last sync */
    void *scratch;          /* grown on demand; one op at a time uses it */
    size_t scratch_size;
};

/* A task of an op: tmx_pool_fn without the thread index, which the ops do not need. */
typedef void (*cpu_task_fn)(void *arg, int64_t task);

/* tmx_pool_run for such tasks. */
void cpu_pool_run(struct tmx_pool *pool, int64_t n_tasks, cpu_task_fn fn, void *arg);

/* Records a failure (the first one since the last sync wins) and logs its message. */
void cpu_fail(struct cpu_ctx *c, enum tmx_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* At least nbytes of 64-byte aligned scratch, valid until the next call; NULL (failure
 * recorded against `op`) when out of memory. */
void *cpu_scratch(struct cpu_ctx *c, size_t nbytes, const char *op);

const char *cpu_dtype_name(enum tmx_dtype dt);

/* 1 if dt is a weight dtype the ops read (F32, BF16, F16). */
static inline int cpu_dtype_ok(enum tmx_dtype dt) {
    return dt == TMX_DTYPE_F32 || dt == TMX_DTYPE_BF16 || dt == TMX_DTYPE_F16;
}

/* Bytes per element of a KV cache dtype (F32, BF16, F8_E4M3 or I8). */
static inline size_t cpu_kv_elem_size(enum tmx_dtype dt) {
    return dt == TMX_DTYPE_F32 ? 4 : dt == TMX_DTYPE_BF16 ? 2 : 1;
}

/* Checks that a weight is non-empty, F32/BF16/F16 and ndim-dimensional, with shape[0] == rows
 * when rows > 0 and (2-D) shape[1] == cols when cols > 0; records a failure naming `op` and
 * `what` otherwise. */
int cpu_check_weight(struct cpu_ctx *c, const char *op, const char *what,
                     const struct tmx_tensor *w, int ndim, int64_t rows, int64_t cols);

/* dst[i] = src[off + i] as F32, i < count; src is F32, BF16 or F16. */
void cpu_to_f32(float *dst, const void *src, enum tmx_dtype dt, int64_t off, int64_t count);

/* --- 8-wide vectors ------------------------------------------------------------------------ */

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 v8_load(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8_store(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

static inline f32x8 v8_splat(float f) { return (f32x8){f, f, f, f, f, f, f, f}; }

/* bf16 is the top half of an f32: widen and shift. Written element-wise because GCC turns this
 * into one vpmovzxwd from memory, while __builtin_convertvector costs four shuffles. */
static inline f32x8 v8_load_bf16(const uint16_t *p) {
    u32x8 u = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    return (f32x8)(u << 16);
}

static inline f32x8 v8_load_f16(const uint16_t *p) {
#ifdef __F16C__
    return (f32x8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    f32x8 v;
    for (int l = 0; l < 8; l++) v[l] = tmx_f16_to_f32(p[l]);
    return v;
#endif
}

/* Elements i .. i+7 of a weight as F32. dt is a constant where this is inlined. */
static inline f32x8 v8_load_w(const void *w, enum tmx_dtype dt, int64_t i) {
    switch (dt) {
    case TMX_DTYPE_BF16: return v8_load_bf16((const uint16_t *)w + i);
    case TMX_DTYPE_F16: return v8_load_f16((const uint16_t *)w + i);
    default: return v8_load((const float *)w + i);
    }
}

/* The first n < 8 elements, zero padded: tails go through the same vector arithmetic. */
static inline f32x8 v8_load_part(const float *p, int n) {
    float t[8] = {0};
    memcpy(t, p, (size_t)n * sizeof *t);
    return v8_load(t);
}

static inline f32x8 v8_load_w_part(const void *w, enum tmx_dtype dt, int64_t i, int n) {
    float t[8] = {0};
    cpu_to_f32(t, w, dt, i, n);
    return v8_load(t);
}

/* A fixed pairwise order, so that every kernel reduces a lane set to the same bits. */
static inline float v8_sum(f32x8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static inline float cpu_dot(const float *a, const float *b, int n) {
    f32x8 acc = v8_splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += v8_load(a + i) * v8_load(b + i);
    if (i < n) acc += v8_load_part(a + i, n - i) * v8_load_part(b + i, n - i);
    return v8_sum(acc);
}

/* --- ops (one definition each, in the file of their family) --------------------------------- */

/* matmul.c. cpu_matmul_block is the single-threaded core other ops reuse: y[t][r] for tokens
 * [t0, t1) and weight rows [r0, r1); ldy is y's row stride, k the length of x rows and w rows.
 * Every element is computed with the same arithmetic whatever the block, so results do not
 * depend on how work is split. */
void cpu_matmul_block(float *y, int64_t ldy, const float *x, const void *w, enum tmx_dtype dt,
                      int64_t k, int64_t r0, int64_t r1, int64_t t0, int64_t t1);
void cpu_matmul(void *ctx, float *y, const float *x, const struct tmx_tensor *w, int n);
void cpu_matmul_multi(void *ctx, float *const *ys, const float *x,
                      const struct tmx_tensor *const *ws, int count, int n);

/* rows.c */
void cpu_embed(void *ctx, float *out, const struct tmx_tensor *table, const int32_t *ids, int n);
void cpu_rmsnorm(void *ctx, float *out, const float *x, const struct tmx_tensor *w, int rows,
                 int d, float eps);
/* 1 / sqrt(mean(x^2) + eps), accumulated in double in a fixed order. */
float cpu_rms_inv(const float *x, int d, float eps);
void cpu_rmsnorm_row(float *out, const float *x, const float *w, int d, float eps);
/* The F32 views of two weight vectors of d (either NULL; what[] names them in messages), as
 * rmsnorm's weight gets one: converted copies share one scratch block. 0 (failure recorded) on
 * a bad weight. */
int cpu_pair_f32(struct cpu_ctx *c, const char *op, const char *const what[2],
                 const struct tmx_tensor *g, const struct tmx_tensor *w, int64_t d,
                 const float **gf, const float **wf);
void cpu_swiglu(void *ctx, float *out, const float *gate, const float *up, int64_t count);
void cpu_add_gated(void *ctx, float *h, const float *a, const struct tmx_tensor *g, int rows,
                   int d);
void cpu_gather(void *ctx, float *out, const float *x, const int32_t *rows, int n, int d);
void cpu_argmax(void *ctx, int32_t *ids, float *best, const float *x, int rows, int d, int ld);
void cpu_topk(void *ctx, float *xs, int32_t *ids, double *stats, const float *x,
              const float *temps, int rows, int d, int ld, int k);
void cpu_logit_edit(void *ctx, float *x, const struct tmx_logit_edit *edits,
                    const int32_t *starts, int rows, int ld, int lo, int d);
void cpu_add_rmsnorm(void *ctx, float *out, float *h, const float *a, const struct tmx_tensor *g,
                     const struct tmx_tensor *w, int rows, int d, float eps);
void cpu_qk_norm_rope(void *ctx, float *q, float *k, const struct tmx_tensor *q_norm,
                      const struct tmx_tensor *k_norm, const int32_t *pos,
                      const float *inv_freq, int n, int hq, int hkv, int hd, float eps);

/* attention.c */
void cpu_rope(void *ctx, float *x, const int32_t *pos, const float *inv_freq, int n, int heads,
              int hd);
void cpu_kv_store(void *ctx, const struct tmx_kv_cache *kv, const float *k, const float *v,
                  const int32_t *slots, int n);
void cpu_attention(void *ctx, float *out, const float *q, const struct tmx_kv_cache *kv,
                   const int32_t *tables, int max_blocks, const int32_t *seq, const int32_t *pos,
                   int n, int hq, int window, float scale);

/* moe.c */
void cpu_moe_route(void *ctx, int32_t *ids, float *weights, const float *logits,
                   const struct tmx_tensor *bias, int n, int n_exp, int k,
                   enum tmx_router_score score, int norm_topk, float scale);
void cpu_moe_experts(void *ctx, float *out, const float *z, const int32_t *ids,
                     const float *weights, int n, int k, const struct tmx_moe_weights *w);
void cpu_moe_experts_partial(void *ctx, float *ye, const float *z, const int32_t *ids, int n,
                             int k, const struct tmx_moe_weights *w);
void cpu_moe_combine(void *ctx, float *out, const float *ye, const float *weights, int n, int k,
                     int latent, const struct tmx_tensor *post_norm, float eps);

#endif
