/* conform-cache.c: the conformance cases of the paged KV cache's ops, kv_store and attention,
 * and the caches they read and write, with their float64 references (conform.c runs them). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "conform-impl.h"

/* --- the paged KV cache ----------------------------------------------------------------------- */

/* kv_store's rounding as tmx/kernels.h states it, in F32 like the op: row x[hd] becomes codes
 * of dt at dst (element `at` on) and, for F8_E4M3 and I8, *scale = amax / 448 or amax / 127
 * with the row divided by it. Shared by the kv_store reference and the caches attention reads,
 * so both hold exactly the bytes a kernel set must produce. */
static void quantize_row(enum tmx_dtype dt, const float *x, int hd, void *dst, size_t at,
                         float *scale) {
    float amax = 0;
    for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
    float s = amax / (dt == TMX_DTYPE_I8 ? 127.0f : 448.0f);
    if (scale) *scale = s;
    for (int i = 0; i < hd; i++) {
        size_t e = at + (size_t)i;
        switch (dt) {
        case TMX_DTYPE_BF16: ((uint16_t *)dst)[e] = tmx_f32_to_bf16(x[i]); break;
        case TMX_DTYPE_F8_E4M3: ((uint8_t *)dst)[e] = s > 0 ? tmx_f32_to_e4m3(x[i] / s) : 0; break;
        case TMX_DTYPE_I8:
            ((int8_t *)dst)[e] = (int8_t)(s > 0 ? fminf(fmaxf(rintf(x[i] / s), -127), 127) : 0);
            break;
        default: ((float *)dst)[e] = x[i]; break;
        }
    }
}

/* Host copies of a cache: k, v [n_blocks * block][hkv][hd] of dt, scales [..][hkv] or NULL. */
struct cache_host {
    void *k, *v;
    float *k_scale, *v_scale;
};

/* The case's cache, c->kv: n_blocks blocks every row of which holds random keys and values in
 * [-1, 1] as kv_store would have stored them (so unread rows hold plausible data too), uploaded
 * to the kernel set. */
static enum tmx_status cache_new(struct tmx_conform_case *c, int n_blocks, struct cache_host *h) {
    const struct spec *s = c->s;
    int hd = s->hd, quantized = s->dt == TMX_DTYPE_F8_E4M3 || s->dt == TMX_DTYPE_I8;
    size_t rows = (size_t)n_blocks * s->block * s->kv_heads;
    size_t bytes = rows * hd * tmx_dtype_size(s->dt);
    float *x = cf_host_alloc(c, (size_t)hd * sizeof *x);
    h->k = cf_host_alloc(c, bytes);
    h->v = cf_host_alloc(c, bytes);
    h->k_scale = quantized ? cf_host_alloc(c, rows * sizeof(float)) : NULL;
    h->v_scale = quantized ? cf_host_alloc(c, rows * sizeof(float)) : NULL;
    if (!x || c->status != TMX_OK) return c->status;
    for (size_t r = 0; r < rows; r++)
        for (int side = 0; side < 2; side++) {
            for (int i = 0; i < hd; i++) x[i] = (float)cf_uniform(c, -1, 1);
            float *sc = side ? h->v_scale : h->k_scale;
            quantize_row(s->dt, x, hd, side ? h->v : h->k, r * hd, sc ? sc + r : NULL);
        }
    c->kv = (struct tmx_kv_cache){s->dt, n_blocks, s->block, s->kv_heads, hd,
                                  cf_upload(c, h->k, bytes), cf_upload(c, h->v, bytes), NULL, NULL};
    if (quantized) {
        c->kv.k_scale = cf_upload(c, h->k_scale, rows * sizeof(float));
        c->kv.v_scale = cf_upload(c, h->v_scale, rows * sizeof(float));
    }
    return c->status;
}

/* Where n tokens of `seqs` sequences sit in a paged cache. */
struct paged {
    int n_blocks, max_blocks;
    int32_t *tables;    /* [seqs][max_blocks]: block ids, -1 where no block is needed */
    int32_t *seq, *pos; /* [n], tokens of the sequences interleaved */
    int32_t *slots;     /* [n]: block * block_size + row of each token's position */
};

/* Sequence 0 is ctx positions long, the others between their token count and ctx; each
 * sequence's tokens are its last positions (a prefill chunk or a decode step). A table entry
 * stays -1 past the sequence's end and where the block lies wholly before the window of every
 * token of the sequence; the other entries get distinct ids in shuffled order from a pool two
 * blocks larger than needed. */
static enum tmx_status paged_new(struct tmx_conform_case *c, struct paged *pg) {
    const struct spec *s = c->s;
    int S = s->seqs, bs = s->block, *count = cf_host_alloc(c, (size_t)S * sizeof *count);
    pg->max_blocks = (s->ctx + bs - 1) / bs + 1;
    pg->tables = cf_host_alloc(c, (size_t)S * pg->max_blocks * sizeof *pg->tables);
    pg->seq = cf_host_alloc(c, (size_t)s->n * sizeof *pg->seq);
    pg->pos = cf_host_alloc(c, (size_t)s->n * sizeof *pg->pos);
    pg->slots = cf_host_alloc(c, (size_t)s->n * sizeof *pg->slots);
    int *ids = cf_host_alloc(c, ((size_t)S * pg->max_blocks + 2) * sizeof *ids);
    if (!count || !ids || c->status != TMX_OK) return c->status;
    for (int q = 0; q < S; q++) count[q] = 1;
    for (int t = S; t < s->n; t++) count[cf_randint(c, 0, S - 1)]++;
    int used = 0;
    for (int q = 0, t = 0; q < S; q++) {
        int len = q ? cf_randint(c, count[q], s->ctx) : s->ctx, first = len - count[q];
        int lo = s->window && first - s->window + 1 > 0 ? first - s->window + 1 : 0;
        for (int i = 0; i < count[q]; i++, t++) pg->seq[t] = q, pg->pos[t] = first + i;
        for (int b = 0; b < pg->max_blocks; b++) {
            int needed = b * bs < len && (b + 1) * bs > lo;
            pg->tables[q * pg->max_blocks + b] = needed ? used++ : -1;
        }
    }
    pg->n_blocks = used + 2;
    for (int b = 0; b < pg->n_blocks; b++) ids[b] = b; /* then shuffled: */
    for (int b = pg->n_blocks - 1; b > 0; b--) {
        int r = cf_randint(c, 0, b), tmp = ids[b];
        ids[b] = ids[r], ids[r] = tmp;
    }
    for (int i = 0; i < S * pg->max_blocks; i++)
        if (pg->tables[i] >= 0) pg->tables[i] = ids[pg->tables[i]];
    for (int t = s->n - 1; t > 0; t--) { /* interleave the sequences' tokens */
        int r = cf_randint(c, 0, t);
        int32_t q = pg->seq[t], p = pg->pos[t];
        pg->seq[t] = pg->seq[r], pg->pos[t] = pg->pos[r];
        pg->seq[r] = q, pg->pos[r] = p;
    }
    for (int t = 0; t < s->n; t++)
        pg->slots[t] = pg->tables[pg->seq[t] * pg->max_blocks + pg->pos[t] / bs] * bs +
                       pg->pos[t] % bs;
    return TMX_OK;
}

/* --- kv_store --------------------------------------------------------------------------------- */

/* One value of a kv_store input row at index i. WIDE spreads values over 2^-21 .. 2, so that F8
 * rows reach subnormal codes and zero. TIES puts them halfway between two codes: the row's amax
 * (element 0) is 448 for F8 and 127 for I8, so the scale is 1 and x / scale is x. */
static float store_value(struct tmx_conform_case *c, int i) {
    enum tmx_dtype dt = c->s->dt;
    double x = cf_uniform(c, -1, 1);
    if (c->s->flags & WIDE) x = ldexp(cf_uniform(c, 1, 2), cf_randint(c, -21, 0));
    if (c->s->flags & TIES && dt == TMX_DTYPE_I8) x = i ? cf_randint(c, -254, 254) / 2.0 : 127;
    if (c->s->flags & TIES && dt == TMX_DTYPE_F8_E4M3) {
        int code = cf_randint(c, 0, 0x7d);
        x = i ? (tmx_e4m3_to_f32((uint8_t)code) + tmx_e4m3_to_f32((uint8_t)(code + 1))) / 2 : 448;
    }
    if (c->s->flags & TIES && dt == TMX_DTYPE_BF16) {
        uint32_t u = (uint32_t)tmx_f32_to_bf16((float)x) << 16 | 0x8000u;
        float f;
        memcpy(&f, &u, sizeof f);
        x = f;
    }
    return (float)(cf_next_u64(c) & 1 ? -x : x);
}

/* About one token in four is skipped (slot -1); token 0 is stored and its head-0 key row is all
 * zeros (scale 0). The references are the whole cache after the store, down to the bytes: rows
 * that no stored token names keep their old contents. */
enum tmx_status cf_kv_store_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int hkv = s->kv_heads, hd = s->hd;
    size_t row = (size_t)hkv * hd, count = (size_t)s->n * row;
    struct paged pg;
    struct cache_host h;
    float *k = cf_host_alloc(c, count * sizeof *k), *v = cf_host_alloc(c, count * sizeof *v);
    if (!k || !v || paged_new(c, &pg) != TMX_OK || cache_new(c, pg.n_blocks, &h) != TMX_OK)
        return c->status;
    for (size_t i = 0; i < count; i++) k[i] = store_value(c, (int)(i % hd));
    for (size_t i = 0; i < count; i++) v[i] = store_value(c, (int)(i % hd));
    for (int t = 0; t < s->n; t++)
        if (t && cf_randint(c, 0, 3) == 0) pg.slots[t] = -1;
    memset(k, 0, (size_t)hd * sizeof *k);
    c->arg[0] = cf_upload(c, k, count * sizeof *k);
    c->arg[1] = cf_upload(c, v, count * sizeof *v);
    c->arg[2] = cf_upload(c, pg.slots, (size_t)s->n * sizeof *pg.slots);
    size_t rows = (size_t)pg.n_blocks * s->block * hkv;
    double *ref_k = cf_output(c, c->kv.k, rows * hd, s->dt);
    double *ref_v = cf_output(c, c->kv.v, rows * hd, s->dt);
    double *ref_ks = h.k_scale ? cf_output(c, c->kv.k_scale, rows, TMX_DTYPE_F32) : NULL;
    double *ref_vs = h.k_scale ? cf_output(c, c->kv.v_scale, rows, TMX_DTYPE_F32) : NULL;
    if (!ref_k || !ref_v || (h.k_scale && (!ref_ks || !ref_vs)) || c->status != TMX_OK)
        return c->status;
    for (int t = 0; t < s->n; t++)
        for (int head = 0; head < hkv && pg.slots[t] >= 0; head++) {
            size_t r = (size_t)pg.slots[t] * hkv + head, x = ((size_t)t * hkv + head) * hd;
            quantize_row(s->dt, k + x, hd, h.k, r * hd, h.k_scale ? h.k_scale + r : NULL);
            quantize_row(s->dt, v + x, hd, h.v, r * hd, h.v_scale ? h.v_scale + r : NULL);
        }
    for (size_t i = 0; i < rows * hd; i++) {
        ref_k[i] = cf_elem(s->dt, h.k, i);
        ref_v[i] = cf_elem(s->dt, h.v, i);
    }
    for (size_t r = 0; ref_ks && r < rows; r++) ref_ks[r] = h.k_scale[r], ref_vs[r] = h.v_scale[r];
    return TMX_OK;
}

void cf_kv_store_run(struct tmx_conform_case *c) {
    c->ops->kv_store(c->ctx, &c->kv, c->arg[0], c->arg[1], c->arg[2], c->s->n);
}

/* --- attention -------------------------------------------------------------------------------- */

/* The reference dequantizes the cache's bytes in double: what the op reads, exactly. */
enum tmx_status cf_attention_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int hq = s->heads, hkv = s->kv_heads, hd = s->hd, bs = s->block;
    size_t q_count = (size_t)s->n * hq * hd;
    struct paged pg;
    struct cache_host h;
    const float *q = cf_input(c, q_count, -2, 2, &c->arg[0]);
    double *score = cf_host_alloc(c, (size_t)s->ctx * sizeof *score);
    if (!q || !score || paged_new(c, &pg) != TMX_OK || cache_new(c, pg.n_blocks, &h) != TMX_OK)
        return c->status;
    c->max_blocks = pg.max_blocks;
    c->arg[1] = cf_upload(c, pg.tables, (size_t)s->seqs * pg.max_blocks * sizeof *pg.tables);
    c->arg[2] = cf_upload(c, pg.seq, (size_t)s->n * sizeof *pg.seq);
    c->arg[3] = cf_upload(c, pg.pos, (size_t)s->n * sizeof *pg.pos);
    c->arg[4] = cf_buffer(c, q_count * sizeof(float));
    double *ref = cf_output(c, c->arg[4], q_count, TMX_DTYPE_F32);
    if (!ref || c->status != TMX_OK) return c->status;
    float scale = 1 / sqrtf((float)hd);
    for (int t = 0; t < s->n; t++)
        for (int head = 0; head < hq; head++) {
            const float *qh = q + ((size_t)t * hq + head) * hd;
            const int32_t *table = pg.tables + pg.seq[t] * pg.max_blocks;
            int p = pg.pos[t], lo = s->window && p - s->window + 1 > 0 ? p - s->window + 1 : 0;
            double mx = -INFINITY, sum = 0;
            for (int j = lo; j <= p; j++) {
                size_t r = ((size_t)table[j / bs] * bs + j % bs) * hkv + head / (hq / hkv);
                double dot = 0;
                for (int i = 0; i < hd; i++) dot += qh[i] * cf_elem(s->dt, h.k, r * hd + i);
                score[j] = dot * (h.k_scale ? h.k_scale[r] : 1) * scale;
                mx = fmax(mx, score[j]);
            }
            double *o = ref + ((size_t)t * hq + head) * hd;
            for (int j = lo; j <= p; j++) {
                size_t r = ((size_t)table[j / bs] * bs + j % bs) * hkv + head / (hq / hkv);
                double e = exp(score[j] - mx), w = e * (h.v_scale ? h.v_scale[r] : 1);
                sum += e;
                for (int i = 0; i < hd; i++) o[i] += w * cf_elem(s->dt, h.v, r * hd + i);
            }
            for (int i = 0; i < hd; i++) o[i] /= sum;
        }
    return TMX_OK;
}

void cf_attention_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->attention(c->ctx, c->arg[4], c->arg[0], &c->kv, c->arg[1], c->max_blocks, c->arg[2],
                      c->arg[3], s->n, s->heads, s->window, 1 / sqrtf((float)s->hd));
}
