/* matmul.c: y[n][m] = x[n][k] . w[m][k]^T, weights F32, BF16 or F16.
 *
 * Both operands run along k, so every output is a dot product. A tile keeps R weight rows x
 * T token rows of 8-lane accumulators in registers: each weight vector is loaded (and converted
 * from BF16/F16) once per T tokens, each x vector once per R rows.
 * - Decode (fewer than 4 tokens) is a GEMV bound by memory: 8-row tiles give 8 independent FMA
 *   chains, enough to keep loads in flight.
 * - Prefill is a GEMM: 3x4 tiles use 12 accumulators + 3 weight vectors + 1 x vector, the 16
 *   AVX2 registers. A block of token rows whose x fits in L2 is swept for each 3-row weight
 *   tile, so a weight row comes from memory once per block.
 * Every output is one lane set accumulated over k in order, the zero-padded tail included,
 * then reduced by v8_sum: the same bits whichever tile or thread computes it. */
#include "cpu.h"

#define GEMM_MIN_TOKENS 4
#define X_BLOCK_BYTES (1 << 20) /* x rows of one token block: fits in L2 */
#define ROW_ALIGN 24            /* row blocks are a multiple of both tile heights (8 and 3) */
#define TASKS_PER_THREAD 4      /* row blocks per thread, for balance */
#define MIN_TASK_MACS (1 << 16) /* smaller tasks cost more to hand out than they save */

/* y[t][r] for t < T, r < R: x rows t (stride k), weight rows r0 + r. R, T, dt are constants
 * where this is inlined, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(int R, int T, enum tmx_dtype dt, float *y,
                                                       int64_t ldy, const float *x, const void *w,
                                                       int64_t k, int64_t r0) {
    f32x8 acc[4][8];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) acc[t][r] = v8_splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        f32x8 wv[8];
        for (int r = 0; r < R; r++) wv[r] = v8_load_w(w, dt, (r0 + r) * k + i);
        for (int t = 0; t < T; t++) {
            f32x8 xv = v8_load(x + t * k + i);
            for (int r = 0; r < R; r++) acc[t][r] += wv[r] * xv;
        }
    }
    if (i < k) {
        int rest = (int)(k - i);
        f32x8 wv[8];
        for (int r = 0; r < R; r++) wv[r] = v8_load_w_part(w, dt, (r0 + r) * k + i, rest);
        for (int t = 0; t < T; t++) {
            f32x8 xv = v8_load_part(x + t * k + i, rest);
            for (int r = 0; r < R; r++) acc[t][r] += wv[r] * xv;
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) y[t * ldy + r] = v8_sum(acc[t][r]);
}

static inline __attribute__((always_inline)) void block(enum tmx_dtype dt, float *y, int64_t ldy,
                                                        const float *x, const void *w, int64_t k,
                                                        int64_t r0, int64_t r1, int64_t t0,
                                                        int64_t t1) {
    int64_t r = r0, t;
    if (t1 - t0 < GEMM_MIN_TOKENS) {
        for (; r + 8 <= r1; r += 8)
            for (t = t0; t < t1; t++) tile(8, 1, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
        for (; r < r1; r++)
            for (t = t0; t < t1; t++) tile(1, 1, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
        return;
    }
    for (; r + 3 <= r1; r += 3) {
        for (t = t0; t + 4 <= t1; t += 4) tile(3, 4, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
        for (; t < t1; t++) tile(3, 1, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
    }
    for (; r < r1; r++) {
        for (t = t0; t + 4 <= t1; t += 4) tile(1, 4, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
        for (; t < t1; t++) tile(1, 1, dt, y + t * ldy + r, ldy, x + t * k, w, k, r);
    }
}

void cpu_matmul_block(float *y, int64_t ldy, const float *x, const void *w, enum tmx_dtype dt,
                      int64_t k, int64_t r0, int64_t r1, int64_t t0, int64_t t1) {
    switch (dt) {
    case TMX_DTYPE_BF16: block(TMX_DTYPE_BF16, y, ldy, x, w, k, r0, r1, t0, t1); break;
    case TMX_DTYPE_F16: block(TMX_DTYPE_F16, y, ldy, x, w, k, r0, r1, t0, t1); break;
    default: block(TMX_DTYPE_F32, y, ldy, x, w, k, r0, r1, t0, t1); break;
    }
}

struct matmul_job {
    float *y;
    const float *x;
    const void *w;
    enum tmx_dtype dt;
    int64_t n, m, k;
    int64_t rows_per_task, tokens_per_task, token_tasks;
};

static void matmul_task(void *arg, int64_t task) {
    const struct matmul_job *j = arg;
    int64_t r0 = task / j->token_tasks * j->rows_per_task;
    int64_t t0 = task % j->token_tasks * j->tokens_per_task;
    int64_t r1 = r0 + j->rows_per_task < j->m ? r0 + j->rows_per_task : j->m;
    int64_t t1 = t0 + j->tokens_per_task < j->n ? t0 + j->tokens_per_task : j->n;
    cpu_matmul_block(j->y, j->m, j->x, j->w, j->dt, j->k, r0, r1, t0, t1);
}

void cpu_matmul(void *ctx, float *y, const float *x, const struct tmx_tensor *w, int n) {
    struct cpu_ctx *c = ctx;
    if (!cpu_check_weight(c, "matmul", "weight", w, 2, 0, 0)) return;
    if (n <= 0) return;
    struct matmul_job j = {.y = y, .x = x, .w = w->data, .dt = w->dtype, .n = n,
                           .m = w->shape[0], .k = w->shape[1]};
    /* Token blocks: as many whole 4-token tiles as fit X_BLOCK_BYTES. */
    int64_t tokens = X_BLOCK_BYTES / (j.k * (int64_t)sizeof(float)) / 4 * 4;
    j.tokens_per_task = tokens < GEMM_MIN_TOKENS ? GEMM_MIN_TOKENS : tokens;
    if (j.tokens_per_task > n) j.tokens_per_task = n;
    j.token_tasks = (n + j.tokens_per_task - 1) / j.tokens_per_task;
    /* Row blocks: about TASKS_PER_THREAD per thread, each worth handing out, whole tiles. */
    int64_t row_tasks = (int64_t)tmx_pool_threads(c->pool) * TASKS_PER_THREAD;
    int64_t rows = (j.m + row_tasks - 1) / row_tasks;
    int64_t min_rows = MIN_TASK_MACS / (j.k * j.tokens_per_task);
    if (rows < min_rows) rows = min_rows;
    j.rows_per_task = (rows + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    int64_t tasks = (j.m + j.rows_per_task - 1) / j.rows_per_task * j.token_tasks;
    cpu_pool_run(c->pool, tasks, matmul_task, &j);
}

/* One after another: each matmul already spreads its row blocks over the pool. */
void cpu_matmul_multi(void *ctx, float *const *ys, const float *x,
                      const struct tmx_tensor *const *ws, int count, int n) {
    struct cpu_ctx *c = ctx;
    if (count < 1 || count > 4) {
        cpu_fail(c, TMX_ERR_INVALID, "matmul_multi: %d weights, want 1 to 4", count);
        return;
    }
    if (!cpu_check_weight(c, "matmul_multi", "weight", ws[0], 2, 0, 0)) return;
    for (int i = 1; i < count; i++)
        if (!cpu_check_weight(c, "matmul_multi", "weight", ws[i], 2, 0, ws[0]->shape[1])) return;
    for (int i = 0; i < count; i++) cpu_matmul(ctx, ys[i], x, ws[i], n);
}
