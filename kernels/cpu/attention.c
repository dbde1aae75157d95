/* attention.c: rope, kv_store and causal GQA attention over the KV cache. */
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

static int check_positions(struct cpu_ctx *c, const char *op, const int32_t *pos, int n) {
    for (int t = 0; t < n; t++)
        if (pos[t] < 0) {
            cpu_fail(c, TMX_ERR_INVALID, "%s: position %d at row %d", op, pos[t], t);
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

/* One token: the angles in double (pos * inv_freq reaches thousands of radians, where a float
 * angle is off by 1e-4), then each head's pairs (i, i + hd/2) rotated. */
static void rope_task(void *arg, int64_t t) {
    const struct rope_job *j = arg;
    int64_t half = j->hd / 2;
    float cs[CPU_MAX_HEAD_DIM / 2], sn[CPU_MAX_HEAD_DIM / 2];
    for (int64_t i = 0; i < half; i++) {
        double a = (double)j->pos[t] * j->inv_freq[i];
        cs[i] = (float)cos(a);
        sn[i] = (float)sin(a);
    }
    for (int64_t h = 0; h < j->heads; h++) {
        float *v = j->x + (t * j->heads + h) * j->hd;
        for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cs[i] - b * sn[i];
            v[i + half] = b * cs[i] + a * sn[i];
        }
    }
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

/* --- kv_store ------------------------------------------------------------------------------- */

/* A copy of n rows: too little work to share out. */
void cpu_kv_store(void *ctx, float *k_cache, float *v_cache, int cap, const float *k,
                  const float *v, const int32_t *pos, int n, int hkv, int hd) {
    struct cpu_ctx *c = ctx;
    if (!check_heads(c, "kv_store", n, hkv, hd) || !check_positions(c, "kv_store", pos, n)) return;
    if (cap <= 0) {
        cpu_fail(c, TMX_ERR_INVALID, "kv_store: capacity %d", cap);
        return;
    }
    size_t row = (size_t)hkv * hd;
    for (int t = 0; t < n; t++) {
        size_t slot = (size_t)(pos[t] % cap);
        memcpy(k_cache + slot * row, k + t * row, row * sizeof *k);
        memcpy(v_cache + slot * row, v + t * row, row * sizeof *v);
    }
}

/* --- attention ------------------------------------------------------------------------------ */

struct attention_job {
    float *out;           /* [n][hq][hd] */
    const float *q;       /* [n][hq][hd] */
    const float *k_cache; /* [cap][hkv][hd] */
    const float *v_cache; /* [cap][hkv][hd] */
    const int32_t *pos;
    int64_t cap, hq, hkv, hd, window;
    float scale;
};

/* One (token, query head): softmax(q.k * scale) v over the window, a block of scores at a time.
 * The running max m and sum l are rescaled when a block raises the max, so every exponent is
 * at most 0 and the result is the exact softmax up to rounding. */
static void attention_task(void *arg, int64_t task) {
    const struct attention_job *j = arg;
    int64_t t = task / j->hq, h = task % j->hq, hd = j->hd;
    int64_t kv = h / (j->hq / j->hkv), stride = j->hkv * hd;
    const float *q = j->q + task * hd;
    int64_t p = j->pos[t], lo = j->window > 0 && p - j->window + 1 > 0 ? p - j->window + 1 : 0;

    float acc[CPU_MAX_HEAD_DIM], s[SCORE_BLOCK];
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < hd; i++) acc[i] = 0.0f;
    for (int64_t j0 = lo; j0 <= p; j0 += SCORE_BLOCK) {
        int64_t nb = p + 1 - j0 < SCORE_BLOCK ? p + 1 - j0 : SCORE_BLOCK;
        float bm = -INFINITY;
        for (int64_t b = 0; b < nb; b++) {
            const float *key = j->k_cache + (j0 + b) % j->cap * stride + kv * hd;
            s[b] = cpu_dot(q, key, (int)hd) * j->scale;
            bm = s[b] > bm ? s[b] : bm;
        }
        if (bm > m) {
            float r = expf(m - bm);
            l *= r;
            for (int64_t i = 0; i < hd; i++) acc[i] *= r;
            m = bm;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *val = j->v_cache + (j0 + b) % j->cap * stride + kv * hd;
            float e = expf(s[b] - m);
            l += e;
            for (int64_t i = 0; i < hd; i++) acc[i] += e * val[i];
        }
    }
    float *out = j->out + task * hd;
    for (int64_t i = 0; i < hd; i++) out[i] = acc[i] / l;
}

void cpu_attention(void *ctx, float *out, const float *q, const float *k_cache,
                   const float *v_cache, int cap, const int32_t *pos, int n, int hq, int hkv,
                   int hd, int window, float scale) {
    struct cpu_ctx *c = ctx;
    if (!check_heads(c, "attention", n, hq, hd) || !check_positions(c, "attention", pos, n))
        return;
    if (hkv <= 0 || hq % hkv || cap <= 0 || window < 0) {
        cpu_fail(c, TMX_ERR_INVALID,
                 "attention: %d query heads over %d KV heads, capacity %d, window %d", hq, hkv,
                 cap, window);
        return;
    }
    struct attention_job j = {out, q, k_cache, v_cache, pos, cap, hq, hkv, hd, window, scale};
    cpu_pool_run(c->pool, (int64_t)n * hq, attention_task, &j);
}
