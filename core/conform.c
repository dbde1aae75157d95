/* conform.c: the conformance cases of tmx/conform.h and their float64 references.
 *
 * Each op has a setup, which draws the inputs, uploads them and computes the reference with
 * double accumulation, and a run, which calls the kernel set's op on the uploaded arrays.
 * Weights are drawn in their own dtype, so the reference sees exactly the values the kernel set
 * sees and the only differences left are the kernel set's rounding. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/conform.h"

/* --- the case table --------------------------------------------------------------------------- */

enum conform_op {
    OP_EMBED, OP_RMSNORM, OP_MATMUL, OP_ROPE, OP_KV_STORE, OP_ATTENTION, OP_MOE_ROUTE,
    OP_MOE_EXPERTS, OP_SWIGLU, OP_ADD_GATED,
};

/* Variant flags. */
#define NO_WEIGHT 1u    /* rmsnorm, add_gated: no weight; moe_route: no bias; moe_experts: no
                           post norm */
#define IN_PLACE 2u     /* rmsnorm: out = x; swiglu: out = gate */
#define SOFTMAX 4u      /* moe_route: softmax scores (default sigmoid) */
#define NO_NORM_TOPK 8u /* moe_route: weights not divided by their sum */
#define TIES 16u        /* moe_route: logits from five values, so that many scores tie */
#define SMALL 32u       /* rmsnorm: inputs near zero, where eps matters */

struct spec {
    const char *name;
    enum conform_op op;
    enum tmx_dtype dt;         /* weight dtype */
    unsigned flags;
    int n;                     /* token rows */
    int m, d;                  /* matmul: w [m][d]; embed: table [m][d]; others: rows of width d */
    int heads, kv_heads, hd;   /* rope (heads), kv_store (kv_heads), attention */
    int cap, window, p0;       /* KV cache slots, sliding window (0: full), first position */
    int n_exp, top_k, expert0; /* moe_route, moe_experts */
    int latent, inter;         /* moe_experts */
    float scale;               /* moe_route: routed_scaling_factor */
};

#define F32 TMX_DTYPE_F32
#define BF16 TMX_DTYPE_BF16
#define F16 TMX_DTYPE_F16

static const struct spec specs[] = {
    {"embed/f32/n3-v50-d40", OP_EMBED, F32, 0, .n = 3, .m = 50, .d = 40},
    {"embed/bf16/n7-v100-d64", OP_EMBED, BF16, 0, .n = 7, .m = 100, .d = 64},
    {"embed/f16/n1-v33-d19", OP_EMBED, F16, 0, .n = 1, .m = 33, .d = 19},

    {"rmsnorm/f32/n4-d64", OP_RMSNORM, F32, 0, .n = 4, .d = 64},
    {"rmsnorm/bf16/n3-d100", OP_RMSNORM, BF16, 0, .n = 3, .d = 100},
    {"rmsnorm/f16/n2-d37", OP_RMSNORM, F16, 0, .n = 2, .d = 37},
    {"rmsnorm/none/n5-d24", OP_RMSNORM, F32, NO_WEIGHT, .n = 5, .d = 24},
    {"rmsnorm/inplace/n3-d128", OP_RMSNORM, F32, IN_PLACE, .n = 3, .d = 128},
    {"rmsnorm/heads/n16-d32", OP_RMSNORM, BF16, IN_PLACE, .n = 16, .d = 32},
    {"rmsnorm/small/n2-d48", OP_RMSNORM, F32, SMALL, .n = 2, .d = 48},

    {"matmul/f32/n1-m64-k128", OP_MATMUL, F32, 0, .n = 1, .m = 64, .d = 128},
    {"matmul/f32/n1-m37-k61", OP_MATMUL, F32, 0, .n = 1, .m = 37, .d = 61},
    {"matmul/f32/n3-m100-k200", OP_MATMUL, F32, 0, .n = 3, .m = 100, .d = 200},
    {"matmul/f32/n17-m67-k131", OP_MATMUL, F32, 0, .n = 17, .m = 67, .d = 131},
    {"matmul/f32/n64-m96-k256", OP_MATMUL, F32, 0, .n = 64, .m = 96, .d = 256},
    {"matmul/bf16/n1-m64-k128", OP_MATMUL, BF16, 0, .n = 1, .m = 64, .d = 128},
    {"matmul/bf16/n1-m37-k61", OP_MATMUL, BF16, 0, .n = 1, .m = 37, .d = 61},
    {"matmul/bf16/n3-m100-k200", OP_MATMUL, BF16, 0, .n = 3, .m = 100, .d = 200},
    {"matmul/bf16/n17-m67-k131", OP_MATMUL, BF16, 0, .n = 17, .m = 67, .d = 131},
    {"matmul/bf16/n64-m96-k256", OP_MATMUL, BF16, 0, .n = 64, .m = 96, .d = 256},
    {"matmul/f16/n1-m64-k128", OP_MATMUL, F16, 0, .n = 1, .m = 64, .d = 128},
    {"matmul/f16/n1-m37-k61", OP_MATMUL, F16, 0, .n = 1, .m = 37, .d = 61},
    {"matmul/f16/n3-m100-k200", OP_MATMUL, F16, 0, .n = 3, .m = 100, .d = 200},
    {"matmul/f16/n17-m67-k131", OP_MATMUL, F16, 0, .n = 17, .m = 67, .d = 131},
    {"matmul/f16/n64-m96-k256", OP_MATMUL, F16, 0, .n = 64, .m = 96, .d = 256},
    {"matmul/bf16/n70-m1000-k300", OP_MATMUL, BF16, 0, .n = 70, .m = 1000, .d = 300},
    {"matmul/f32/n2-m1000-k300", OP_MATMUL, F32, 0, .n = 2, .m = 1000, .d = 300},

    {"rope/n1-h4-hd64", OP_ROPE, F32, 0, .n = 1, .heads = 4, .hd = 64},
    {"rope/n5-h3-hd32", OP_ROPE, F32, 0, .n = 5, .heads = 3, .hd = 32},
    {"rope/n3-h2-hd6", OP_ROPE, F32, 0, .n = 3, .heads = 2, .hd = 6},

    {"kv_store/n1-hkv2-hd16-cap8", OP_KV_STORE, F32, 0, .n = 1, .kv_heads = 2, .hd = 16,
     .cap = 8, .p0 = 5},
    {"kv_store/wrap/n5-hkv1-hd24-cap8", OP_KV_STORE, F32, 0, .n = 5, .kv_heads = 1, .hd = 24,
     .cap = 8, .p0 = 6},

    {"attention/mha/n1-hq8-hkv8-hd32-p40", OP_ATTENTION, F32, 0, .n = 1, .heads = 8,
     .kv_heads = 8, .hd = 32, .cap = 64, .p0 = 40},
    {"attention/gqa4/n1-hq8-hkv2-hd64-p63", OP_ATTENTION, F32, 0, .n = 1, .heads = 8,
     .kv_heads = 2, .hd = 64, .cap = 64, .p0 = 63},
    {"attention/gqa2/n7-hq4-hkv2-hd16-p0", OP_ATTENTION, F32, 0, .n = 7, .heads = 4,
     .kv_heads = 2, .hd = 16, .cap = 32, .p0 = 0},
    {"attention/long/n4-hq4-hkv4-hd8-p290", OP_ATTENTION, F32, 0, .n = 4, .heads = 4,
     .kv_heads = 4, .hd = 8, .cap = 300, .p0 = 290},
    {"attention/sliding-ring/n5-hq6-hkv1-hd24-w8-p30", OP_ATTENTION, F32, 0, .n = 5, .heads = 6,
     .kv_heads = 1, .hd = 24, .cap = 16, .window = 8, .p0 = 30},
    {"attention/sliding-start/n3-hq2-hkv1-hd40-w4-p1", OP_ATTENTION, F32, 0, .n = 3, .heads = 2,
     .kv_heads = 1, .hd = 40, .cap = 6, .window = 4, .p0 = 1},

    {"moe_route/sigmoid-bias/n4-e32-k4", OP_MOE_ROUTE, F32, 0, .n = 4, .n_exp = 32, .top_k = 4,
     .scale = 2.5f},
    {"moe_route/sigmoid-nonorm/n3-e16-k2", OP_MOE_ROUTE, F32, NO_WEIGHT | NO_NORM_TOPK, .n = 3,
     .n_exp = 16, .top_k = 2, .scale = 1.0f},
    {"moe_route/softmax-bias/n5-e64-k8", OP_MOE_ROUTE, F32, SOFTMAX, .n = 5, .n_exp = 64,
     .top_k = 8, .scale = 1.0f},
    {"moe_route/softmax-nonorm/n2-e8-k3", OP_MOE_ROUTE, F32, SOFTMAX | NO_WEIGHT | NO_NORM_TOPK,
     .n = 2, .n_exp = 8, .top_k = 3, .scale = 1.5f},
    {"moe_route/ties/n6-e16-k4", OP_MOE_ROUTE, F32, TIES | NO_WEIGHT, .n = 6, .n_exp = 16,
     .top_k = 4, .scale = 1.0f},

    {"moe_experts/f32/n1-e8-k4-l32-i48", OP_MOE_EXPERTS, F32, 0, .n = 1, .n_exp = 8, .top_k = 4,
     .latent = 32, .inter = 48},
    {"moe_experts/bf16-rank/n5-e6-k3-l40-i24", OP_MOE_EXPERTS, BF16, 0, .n = 5, .n_exp = 6,
     .top_k = 3, .expert0 = 2, .latent = 40, .inter = 24},
    {"moe_experts/f16/n9-e4-k2-l16-i64", OP_MOE_EXPERTS, F16, 0, .n = 9, .n_exp = 4, .top_k = 2,
     .latent = 16, .inter = 64},
    {"moe_experts/bf16-nopost/n3-e5-k2-l24-i16", OP_MOE_EXPERTS, BF16, NO_WEIGHT, .n = 3,
     .n_exp = 5, .top_k = 2, .latent = 24, .inter = 16},
    {"moe_experts/f32/n20-e8-k4-l64-i32", OP_MOE_EXPERTS, F32, 0, .n = 20, .n_exp = 8,
     .top_k = 4, .latent = 64, .inter = 32},
    {"moe_experts/bf16/n48-e16-k4-l64-i96", OP_MOE_EXPERTS, BF16, 0, .n = 48, .n_exp = 16,
     .top_k = 4, .latent = 64, .inter = 96},

    {"swiglu/n1-d1000", OP_SWIGLU, F32, 0, .n = 1, .d = 1000},
    {"swiglu/inplace/n3-d37", OP_SWIGLU, F32, IN_PLACE, .n = 3, .d = 37},

    {"add_gated/f32/n3-d64", OP_ADD_GATED, F32, 0, .n = 3, .d = 64},
    {"add_gated/bf16/n2-d33", OP_ADD_GATED, BF16, 0, .n = 2, .d = 33},
    {"add_gated/f16/n1-d8", OP_ADD_GATED, F16, 0, .n = 1, .d = 8},
    {"add_gated/none/n4-d17", OP_ADD_GATED, F32, NO_WEIGHT, .n = 4, .d = 17},
};

#undef F32
#undef BF16
#undef F16

#define N_SPECS (sizeof specs / sizeof specs[0])

/* rmsnorm and moe_experts epsilon */
#define EPS 1e-5f

/* --- a case on a kernel set ------------------------------------------------------------------- */

struct output {
    void *dev;     /* the kernel set's buffer */
    size_t count;  /* elements: F32, or I32 when is_int */
    int is_int;
    double *ref;   /* [count] */
};

struct tmx_conform_case {
    const struct spec *s;
    const struct tmx_kernels_i *ops;
    void *ctx;
    uint64_t rng;
    enum tmx_status status; /* first setup failure */
    char **err;

    void **host; /* what the case malloc'd */
    size_t n_host, cap_host;
    void **bufs; /* the kernel set's buffers */
    size_t n_bufs, cap_bufs;
    void **imported; /* struct tmx_tensor device views to weight_free */
    size_t n_imported, cap_imported;

    void *arg[5];             /* device addresses of the op's arrays, in the setup's order */
    struct tmx_tensor w;      /* the op's weight, when it has one */
    struct tmx_moe_weights moe;
    struct output out[2];
    int n_out;
    unsigned char *got; /* outputs read by the last check */
    size_t got_bytes;
};

static void *fail(struct tmx_conform_case *c, enum tmx_status st, const char *what) {
    if (c->status == TMX_OK) {
        c->status = st;
        tmx_err(c->err, st, "conform: %s: %s failed (%s)", c->s->name, what, tmx_status_str(st));
    }
    return NULL;
}

static int push(void ***list, size_t *n, size_t *cap, void *p) {
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 16;
        void **l = realloc(*list, nc * sizeof *l);
        if (!l) return 0;
        *list = l;
        *cap = nc;
    }
    (*list)[(*n)++] = p;
    return 1;
}

/* Zeroed host memory, freed with the case. */
static void *host_alloc(struct tmx_conform_case *c, size_t nbytes) {
    void *p = calloc(1, nbytes ? nbytes : 1);
    if (!p || !push(&c->host, &c->n_host, &c->cap_host, p)) {
        free(p);
        return fail(c, TMX_ERR_NOMEM, "host allocation");
    }
    return p;
}

/* A zeroed buffer of the kernel set. */
static void *buffer(struct tmx_conform_case *c, size_t nbytes) {
    void *dev = NULL;
    enum tmx_status st = c->ops->buf_alloc(c->ctx, nbytes, &dev);
    if (st != TMX_OK) return fail(c, st, "buf_alloc");
    if (!push(&c->bufs, &c->n_bufs, &c->cap_bufs, dev)) {
        c->ops->buf_free(c->ctx, dev);
        return fail(c, TMX_ERR_NOMEM, "host allocation");
    }
    return dev;
}

static void *upload(struct tmx_conform_case *c, const void *host, size_t nbytes) {
    void *dev = host ? buffer(c, nbytes) : NULL;
    if (!dev) return NULL;
    enum tmx_status st = c->ops->buf_write(c->ctx, dev, host, nbytes);
    return st == TMX_OK ? dev : fail(c, st, "buf_write");
}

/* splitmix64: a fixed stream per case name. */
static uint64_t next_u64(struct tmx_conform_case *c) {
    uint64_t z = (c->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform(struct tmx_conform_case *c, double lo, double hi) {
    return lo + (hi - lo) * (double)(next_u64(c) >> 11) * 0x1p-53;
}

/* Uniform in [lo, hi]. */
static int randint(struct tmx_conform_case *c, int lo, int hi) {
    return lo + (int)(next_u64(c) % (uint64_t)(hi - lo + 1));
}

/* Random F32 values in [lo, hi], uploaded to a new buffer (*dev); returns the host copy. */
static float *input(struct tmx_conform_case *c, size_t count, double lo, double hi, void **dev) {
    float *h = host_alloc(c, count * sizeof *h);
    if (!h) return NULL;
    for (size_t i = 0; i < count; i++) h[i] = (float)uniform(c, lo, hi);
    *dev = upload(c, h, count * sizeof *h);
    return *dev ? h : NULL;
}

/* Round to the nearest F16 (ties away from zero); values below 2^-14 flush to zero. */
static uint16_t f16_from(double v) {
    uint16_t sign = v < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(v), &e); /* |v| = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 15;
    if (v == 0 || exp <= 0) return sign;
    long frac = lround((2 * m - 1) * 1024);
    if (frac == 1024) frac = 0, exp++;
    return (uint16_t)(sign | exp << 10 | frac);
}

/* A weight of dtype dt holding `vals` (rows x cols; cols 0: a vector of rows), imported into
 * *dev. Rounds vals in place to what the dtype holds. */
static void weight_from(struct tmx_conform_case *c, enum tmx_dtype dt, int64_t rows, int64_t cols,
                        double *vals, struct tmx_tensor *dev) {
    size_t count = (size_t)(rows * (cols ? cols : 1));
    struct tmx_tensor h = {.dtype = dt, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
    h.data = host_alloc(c, count * tmx_dtype_size(dt));
    if (!h.data) return;
    for (size_t i = 0; i < count; i++) {
        if (dt == TMX_DTYPE_BF16) {
            uint16_t b = tmx_f32_to_bf16((float)vals[i]);
            ((uint16_t *)h.data)[i] = b;
            vals[i] = tmx_bf16_to_f32(b);
        } else if (dt == TMX_DTYPE_F16) {
            uint16_t b = f16_from(vals[i]);
            ((uint16_t *)h.data)[i] = b;
            vals[i] = tmx_f16_to_f32(b);
        } else {
            ((float *)h.data)[i] = (float)vals[i];
            vals[i] = (float)vals[i];
        }
    }
    char *msg = NULL;
    enum tmx_status st = c->ops->weight_import(c->ctx, &h, dev, &msg);
    if (st != TMX_OK) {
        if (c->status == TMX_OK) {
            c->status = st;
            tmx_err(c->err, st, "conform: %s: weight_import: %s", c->s->name, msg ? msg : "");
        }
        free(msg);
        return;
    }
    if (!push(&c->imported, &c->n_imported, &c->cap_imported, dev)) {
        c->ops->weight_free(c->ctx, dev);
        fail(c, TMX_ERR_NOMEM, "host allocation");
    }
}

/* A random weight with values in [lo, hi]; returns the values the kernel set sees. */
static const double *weight(struct tmx_conform_case *c, enum tmx_dtype dt, int64_t rows,
                            int64_t cols, double lo, double hi, struct tmx_tensor *dev) {
    size_t count = (size_t)(rows * (cols ? cols : 1));
    double *v = host_alloc(c, count * sizeof *v);
    if (!v) return NULL;
    for (size_t i = 0; i < count; i++) v[i] = uniform(c, lo, hi);
    weight_from(c, dt, rows, cols, v, dev);
    return c->status == TMX_OK ? v : NULL;
}

/* Declares buffer dev ([count] F32, or I32) an output; returns its reference, to be filled. */
static double *output(struct tmx_conform_case *c, void *dev, size_t count, int is_int) {
    double *ref = dev ? host_alloc(c, count * sizeof *ref) : NULL;
    if (!ref) return NULL;
    c->out[c->n_out++] = (struct output){dev, count, is_int, ref};
    return ref;
}

/* --- embed ------------------------------------------------------------------------------------ */

static enum tmx_status embed_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const double *table = weight(c, s->dt, s->m, s->d, -1, 1, &c->w);
    int32_t *ids = host_alloc(c, (size_t)s->n * sizeof *ids);
    if (!table || !ids) return c->status;
    for (int t = 0; t < s->n; t++) ids[t] = randint(c, 0, s->m - 1);
    c->arg[0] = upload(c, ids, (size_t)s->n * sizeof *ids);
    c->arg[1] = buffer(c, (size_t)s->n * s->d * sizeof(float));
    double *ref = output(c, c->arg[1], (size_t)s->n * s->d, 0);
    if (!ref || !c->arg[0]) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int i = 0; i < s->d; i++) ref[t * s->d + i] = table[(size_t)ids[t] * s->d + i];
    return TMX_OK;
}

static void embed_run(struct tmx_conform_case *c) {
    c->ops->embed(c->ctx, c->arg[1], &c->w, c->arg[0], c->s->n);
}

/* --- rmsnorm ---------------------------------------------------------------------------------- */

static enum tmx_status rmsnorm_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t count = (size_t)s->n * s->d;
    double range = s->flags & SMALL ? 1e-2 : 2;
    const float *x = input(c, count, -range, range, &c->arg[0]);
    const double *w = NULL;
    if (!(s->flags & NO_WEIGHT)) w = weight(c, s->dt, s->d, 0, 0.5, 1.5, &c->w);
    c->arg[1] = s->flags & IN_PLACE ? c->arg[0] : buffer(c, count * sizeof(float));
    double *ref = output(c, c->arg[1], count, 0);
    if (!x || !ref || c->status != TMX_OK) return c->status;
    for (int r = 0; r < s->n; r++) {
        const float *xr = x + (size_t)r * s->d;
        double ss = 0;
        for (int i = 0; i < s->d; i++) ss += (double)xr[i] * xr[i];
        double inv = 1 / sqrt(ss / s->d + EPS);
        for (int i = 0; i < s->d; i++) ref[(size_t)r * s->d + i] = xr[i] * inv * (w ? w[i] : 1);
    }
    return TMX_OK;
}

static void rmsnorm_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->rmsnorm(c->ctx, c->arg[1], c->arg[0], s->flags & NO_WEIGHT ? NULL : &c->w, s->n, s->d,
                    EPS);
}

/* --- matmul ----------------------------------------------------------------------------------- */

static enum tmx_status matmul_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    const float *x = input(c, (size_t)s->n * s->d, -1, 1, &c->arg[0]);
    const double *w = weight(c, s->dt, s->m, s->d, -1, 1, &c->w);
    c->arg[1] = buffer(c, (size_t)s->n * s->m * sizeof(float));
    double *ref = output(c, c->arg[1], (size_t)s->n * s->m, 0);
    if (!x || !w || !ref) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int r = 0; r < s->m; r++) {
            double acc = 0;
            for (int i = 0; i < s->d; i++) acc += w[(size_t)r * s->d + i] * x[(size_t)t * s->d + i];
            ref[(size_t)t * s->m + r] = acc;
        }
    return TMX_OK;
}

static void matmul_run(struct tmx_conform_case *c) {
    c->ops->matmul(c->ctx, c->arg[1], c->arg[0], &c->w, c->s->n);
}

/* --- rope ------------------------------------------------------------------------------------- */

/* Positions up to 4095: far enough that an angle computed in float would be off. */
static enum tmx_status rope_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int half = s->hd / 2;
    size_t count = (size_t)s->n * s->heads * s->hd;
    const float *x = input(c, count, -1, 1, &c->arg[0]);
    int32_t *pos = host_alloc(c, (size_t)s->n * sizeof *pos);
    float *inv_freq = host_alloc(c, (size_t)half * sizeof *inv_freq);
    if (!x || !pos || !inv_freq) return c->status;
    for (int t = 0; t < s->n; t++) pos[t] = randint(c, 0, 4095);
    for (int i = 0; i < half; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / s->hd);
    c->arg[1] = upload(c, pos, (size_t)s->n * sizeof *pos);
    c->arg[2] = upload(c, inv_freq, (size_t)half * sizeof *inv_freq);
    double *ref = output(c, c->arg[0], count, 0);
    if (!c->arg[1] || !c->arg[2] || !ref) return c->status;
    for (int t = 0; t < s->n; t++)
        for (int h = 0; h < s->heads; h++) {
            size_t o = ((size_t)t * s->heads + h) * s->hd;
            for (int i = 0; i < half; i++) {
                double a = (double)pos[t] * inv_freq[i], x1 = x[o + i], x2 = x[o + i + half];
                ref[o + i] = x1 * cos(a) - x2 * sin(a);
                ref[o + i + half] = x2 * cos(a) + x1 * sin(a);
            }
        }
    return TMX_OK;
}

static void rope_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->rope(c->ctx, c->arg[0], c->arg[1], c->arg[2], s->n, s->heads, s->hd);
}

/* --- kv_store --------------------------------------------------------------------------------- */

/* Positions p0 .. p0 + n - 1 over a cache already full of other values, which must survive. */
static enum tmx_status kv_store_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t row = (size_t)s->kv_heads * s->hd;
    const float *kc = input(c, s->cap * row, -1, 1, &c->arg[0]);
    const float *vc = input(c, s->cap * row, -1, 1, &c->arg[1]);
    const float *k = input(c, s->n * row, -1, 1, &c->arg[2]);
    const float *v = input(c, s->n * row, -1, 1, &c->arg[3]);
    int32_t *pos = host_alloc(c, (size_t)s->n * sizeof *pos);
    if (!kc || !vc || !k || !v || !pos) return c->status;
    for (int t = 0; t < s->n; t++) pos[t] = s->p0 + t;
    c->arg[4] = upload(c, pos, (size_t)s->n * sizeof *pos);
    double *ref_k = output(c, c->arg[0], s->cap * row, 0);
    double *ref_v = output(c, c->arg[1], s->cap * row, 0);
    if (!c->arg[4] || !ref_k || !ref_v) return c->status;
    for (size_t i = 0; i < s->cap * row; i++) ref_k[i] = kc[i], ref_v[i] = vc[i];
    for (int t = 0; t < s->n; t++)
        for (size_t i = 0; i < row; i++) {
            ref_k[(size_t)(pos[t] % s->cap) * row + i] = k[t * row + i];
            ref_v[(size_t)(pos[t] % s->cap) * row + i] = v[t * row + i];
        }
    return TMX_OK;
}

static void kv_store_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->kv_store(c->ctx, c->arg[0], c->arg[1], s->cap, c->arg[2], c->arg[3], c->arg[4], s->n,
                     s->kv_heads, s->hd);
}

/* --- attention -------------------------------------------------------------------------------- */

/* Queries at positions p0 .. p0 + n - 1 over a cache of random keys and values; slot j % cap
 * stands for position j. */
static enum tmx_status attention_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int hq = s->heads, hkv = s->kv_heads, hd = s->hd;
    size_t q_count = (size_t)s->n * hq * hd, slot = (size_t)hkv * hd;
    const float *q = input(c, q_count, -2, 2, &c->arg[0]);
    const float *kc = input(c, s->cap * slot, -1, 1, &c->arg[1]);
    const float *vc = input(c, s->cap * slot, -1, 1, &c->arg[2]);
    int32_t *pos = host_alloc(c, (size_t)s->n * sizeof *pos);
    double *score = host_alloc(c, (size_t)(s->p0 + s->n) * sizeof *score);
    if (!q || !kc || !vc || !pos || !score) return c->status;
    for (int t = 0; t < s->n; t++) pos[t] = s->p0 + t;
    c->arg[3] = upload(c, pos, (size_t)s->n * sizeof *pos);
    c->arg[4] = buffer(c, q_count * sizeof(float));
    double *ref = output(c, c->arg[4], q_count, 0);
    if (!c->arg[3] || !ref) return c->status;
    float scale = 1 / sqrtf((float)hd);
    for (int t = 0; t < s->n; t++)
        for (int h = 0; h < hq; h++) {
            const float *qh = q + ((size_t)t * hq + h) * hd;
            size_t kv = (size_t)(h / (hq / hkv)) * hd;
            int p = pos[t], lo = s->window && p - s->window + 1 > 0 ? p - s->window + 1 : 0;
            double mx = -INFINITY, sum = 0;
            for (int j = lo; j <= p; j++) {
                const float *key = kc + (size_t)(j % s->cap) * slot + kv;
                double dot = 0;
                for (int i = 0; i < hd; i++) dot += (double)qh[i] * key[i];
                score[j] = dot * scale;
                mx = fmax(mx, score[j]);
            }
            double *o = ref + ((size_t)t * hq + h) * hd;
            for (int j = lo; j <= p; j++) {
                const float *val = vc + (size_t)(j % s->cap) * slot + kv;
                double e = exp(score[j] - mx);
                sum += e;
                for (int i = 0; i < hd; i++) o[i] += e * val[i];
            }
            for (int i = 0; i < hd; i++) o[i] /= sum;
        }
    return TMX_OK;
}

static void attention_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->attention(c->ctx, c->arg[4], c->arg[0], c->arg[1], c->arg[2], s->cap, c->arg[3], s->n,
                      s->heads, s->kv_heads, s->hd, s->window, 1 / sqrtf((float)s->hd));
}

/* --- moe_route -------------------------------------------------------------------------------- */

/* Scores s and keys v = s + bias of one token, and the order the router must pick them in:
 * descending v, ties to the lower id. */
static void route_ref(const struct spec *s, const float *logits, const double *bias, double *sc,
                      double *v, int *order) {
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < s->n_exp; e++) mx = fmax(mx, logits[e]);
    for (int e = 0; e < s->n_exp; e++) {
        sc[e] = s->flags & SOFTMAX ? exp(logits[e] - mx) : 1 / (1 + exp(-(double)logits[e]));
        sum += sc[e];
    }
    for (int e = 0; e < s->n_exp; e++) {
        if (s->flags & SOFTMAX) sc[e] /= sum;
        v[e] = sc[e] + (bias ? bias[e] : 0);
        order[e] = e;
    }
    for (int a = 1; a < s->n_exp; a++) /* insertion sort: stable, so equal keys keep id order */
        for (int b = a; b > 0 && v[order[b]] > v[order[b - 1]]; b--) {
            int tmp = order[b];
            order[b] = order[b - 1];
            order[b - 1] = tmp;
        }
}

/* Whether float rounding cannot change the pick: neighbours up to the (k+1)-th either tie
 * exactly (same logit and bias) or differ by more than 1e-4 relative. */
static int route_robust(const struct spec *s, const float *logits, const double *bias,
                        const double *v, const int *order) {
    for (int q = 0; q < s->top_k && q + 1 < s->n_exp; q++) {
        int a = order[q], b = order[q + 1];
        int same = logits[a] == logits[b] && (!bias || bias[a] == bias[b]);
        if (!same && fabs(v[a] - v[b]) <= 1e-4 * fmax(fabs(v[a]), fabs(v[b]))) return 0;
    }
    return 1;
}

/* Logits on a grid, so that equal scores are exact ties in any precision; a token whose pick
 * could flip under rounding is drawn again. */
static enum tmx_status moe_route_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int ne = s->n_exp, k = s->top_k;
    float *logits = host_alloc(c, (size_t)s->n * ne * sizeof *logits);
    double *sc = host_alloc(c, (size_t)ne * sizeof *sc), *v = host_alloc(c, (size_t)ne * sizeof *v);
    int *order = host_alloc(c, (size_t)ne * sizeof *order);
    double *bias = NULL;
    if (!(s->flags & NO_WEIGHT) && (bias = host_alloc(c, (size_t)ne * sizeof *bias))) {
        for (int e = 0; e < ne; e++) bias[e] = randint(c, -4, 4) / 16.0;
        weight_from(c, TMX_DTYPE_F32, ne, 0, bias, &c->w);
    }
    if (!logits || !sc || !v || !order || c->status != TMX_OK) return c->status;
    c->arg[2] = buffer(c, (size_t)s->n * k * sizeof(int32_t));
    c->arg[3] = buffer(c, (size_t)s->n * k * sizeof(float));
    double *ref_ids = output(c, c->arg[2], (size_t)s->n * k, 1);
    double *ref_w = output(c, c->arg[3], (size_t)s->n * k, 0);
    if (!ref_ids || !ref_w) return c->status;
    for (int t = 0; t < s->n; t++) {
        float *lg = logits + (size_t)t * ne;
        do {
            for (int e = 0; e < ne; e++)
                lg[e] = s->flags & TIES ? randint(c, -2, 2) / 2.0f : randint(c, -12, 12) / 4.0f;
            route_ref(s, lg, bias, sc, v, order);
        } while (!route_robust(s, lg, bias, v, order));
        double picked = 0;
        for (int q = 0; q < k; q++) picked += sc[order[q]];
        for (int q = 0; q < k; q++) {
            ref_ids[t * k + q] = order[q];
            ref_w[t * k + q] = sc[order[q]] / (s->flags & NO_NORM_TOPK ? 1 : picked) * s->scale;
        }
    }
    c->arg[0] = upload(c, logits, (size_t)s->n * ne * sizeof *logits);
    return c->status;
}

static void moe_route_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->moe_route(c->ctx, c->arg[2], c->arg[3], c->arg[0], s->flags & NO_WEIGHT ? NULL : &c->w,
                      s->n, s->n_exp, s->top_k,
                      s->flags & SOFTMAX ? TMX_ROUTER_SOFTMAX : TMX_ROUTER_SIGMOID,
                      !(s->flags & NO_NORM_TOPK), s->scale);
}

/* --- moe_experts ------------------------------------------------------------------------------ */

/* Each token picks top_k distinct ids among expert0 + n_exp + 2, so that with expert0 > 0 some
 * fall outside this rank's experts on both sides and must be skipped. */
static enum tmx_status moe_experts_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    int ne = s->n_exp, k = s->top_k, lat = s->latent, inter = s->inter, range = s->expert0 + ne + 2;
    const float *z = input(c, (size_t)s->n * lat, -1, 1, &c->arg[0]);
    const float *pw = input(c, (size_t)s->n * k, 0.1, 1, &c->arg[2]);
    int32_t *ids = host_alloc(c, (size_t)s->n * k * sizeof *ids);
    int *pool = host_alloc(c, (size_t)range * sizeof *pool);
    struct tmx_tensor *wt = host_alloc(c, 3 * (size_t)ne * sizeof *wt);
    const double **wv = host_alloc(c, 3 * (size_t)ne * sizeof *wv);
    double *hid = host_alloc(c, (size_t)inter * sizeof *hid), *y = host_alloc(c, lat * sizeof *y);
    if (!z || !pw || !ids || !pool || !wt || !wv || !hid || !y) return c->status;
    for (int t = 0; t < s->n; t++) { /* partial Fisher-Yates over the id range */
        for (int e = 0; e < range; e++) pool[e] = e;
        for (int q = 0; q < k; q++) {
            int r = randint(c, q, range - 1), tmp = pool[q];
            pool[q] = pool[r];
            pool[r] = tmp;
            ids[t * k + q] = pool[q];
        }
    }
    double a_in = 2 / sqrt(lat), a_out = 2 / sqrt(inter);
    for (int e = 0; e < ne && c->status == TMX_OK; e++) {
        wv[e] = weight(c, s->dt, inter, lat, -a_in, a_in, &wt[e]);
        wv[ne + e] = weight(c, s->dt, inter, lat, -a_in, a_in, &wt[ne + e]);
        wv[2 * ne + e] = weight(c, s->dt, lat, inter, -a_out, a_out, &wt[2 * ne + e]);
    }
    const double *post = NULL;
    if (!(s->flags & NO_WEIGHT)) post = weight(c, s->dt, lat, 0, 0.5, 1.5, &c->w);
    c->arg[1] = upload(c, ids, (size_t)s->n * k * sizeof *ids);
    c->arg[3] = buffer(c, (size_t)s->n * lat * sizeof(float));
    double *ref = output(c, c->arg[3], (size_t)s->n * lat, 0);
    if (!ref || c->status != TMX_OK) return c->status;
    c->moe = (struct tmx_moe_weights){ne, s->expert0, lat, inter, wt, wt + ne, wt + 2 * ne,
                                      post ? &c->w : NULL, EPS};

    for (int t = 0; t < s->n; t++)
        for (int q = 0; q < k; q++) {
            int e = ids[t * k + q] - s->expert0;
            if (e < 0 || e >= ne) continue;
            const float *zt = z + (size_t)t * lat;
            const double *gate = wv[e], *up = wv[ne + e], *down = wv[2 * ne + e];
            for (int i = 0; i < inter; i++) {
                double g = 0, u = 0;
                for (int d = 0; d < lat; d++) {
                    g += gate[(size_t)i * lat + d] * zt[d];
                    u += up[(size_t)i * lat + d] * zt[d];
                }
                hid[i] = g / (1 + exp(-g)) * u;
            }
            double ss = 0;
            for (int d = 0; d < lat; d++) {
                y[d] = 0;
                for (int i = 0; i < inter; i++) y[d] += down[(size_t)d * inter + i] * hid[i];
                ss += y[d] * y[d];
            }
            double inv = post ? 1 / sqrt(ss / lat + EPS) : 1;
            for (int d = 0; d < lat; d++)
                ref[(size_t)t * lat + d] += pw[t * k + q] * y[d] * inv * (post ? post[d] : 1);
        }
    return TMX_OK;
}

static void moe_experts_run(struct tmx_conform_case *c) {
    c->ops->moe_experts(c->ctx, c->arg[3], c->arg[0], c->arg[1], c->arg[2], c->s->n,
                        c->s->top_k, &c->moe);
}

/* --- swiglu ----------------------------------------------------------------------------------- */

static enum tmx_status swiglu_new(struct tmx_conform_case *c) {
    size_t count = (size_t)c->s->n * c->s->d;
    const float *gate = input(c, count, -6, 6, &c->arg[0]);
    const float *up = input(c, count, -1, 1, &c->arg[1]);
    c->arg[2] = c->s->flags & IN_PLACE ? c->arg[0] : buffer(c, count * sizeof(float));
    double *ref = output(c, c->arg[2], count, 0);
    if (!gate || !up || !ref) return c->status;
    for (size_t i = 0; i < count; i++) ref[i] = gate[i] / (1 + exp(-(double)gate[i])) * up[i];
    return TMX_OK;
}

static void swiglu_run(struct tmx_conform_case *c) {
    c->ops->swiglu(c->ctx, c->arg[2], c->arg[0], c->arg[1], (int64_t)c->s->n * c->s->d);
}

/* --- add_gated -------------------------------------------------------------------------------- */

static enum tmx_status add_gated_new(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    size_t count = (size_t)s->n * s->d;
    const float *h = input(c, count, -1, 1, &c->arg[0]);
    const float *a = input(c, count, -1, 1, &c->arg[1]);
    const double *g = NULL;
    if (!(s->flags & NO_WEIGHT)) g = weight(c, s->dt, s->d, 0, -1, 1, &c->w);
    double *ref = output(c, c->arg[0], count, 0);
    if (!h || !a || !ref || c->status != TMX_OK) return c->status;
    for (size_t i = 0; i < count; i++) ref[i] = h[i] + (g ? g[i % s->d] : 1) * a[i];
    return TMX_OK;
}

static void add_gated_run(struct tmx_conform_case *c) {
    const struct spec *s = c->s;
    c->ops->add_gated(c->ctx, c->arg[0], c->arg[1], s->flags & NO_WEIGHT ? NULL : &c->w, s->n,
                      s->d);
}

/* --- the ops ---------------------------------------------------------------------------------- */

/* Tolerances on the normalized max error. Copies are exact; the rest allow F32 rounding with
 * room for other summation orders and exp implementations: kernels.cpu stays 20 to 100 times
 * below them (at most 5e-7), while a wrong mask, index or norm shows up as 1e-2 or more. */
static const struct {
    const char *name;
    size_t member; /* offset in struct tmx_kernels_i */
    double tol;
    enum tmx_status (*setup)(struct tmx_conform_case *c);
    void (*run)(struct tmx_conform_case *c);
} op_defs[] = {
    [OP_EMBED] = {"embed", offsetof(struct tmx_kernels_i, embed), 0, embed_new, embed_run},
    [OP_RMSNORM] = {"rmsnorm", offsetof(struct tmx_kernels_i, rmsnorm), 1e-5, rmsnorm_new,
                    rmsnorm_run},
    [OP_MATMUL] = {"matmul", offsetof(struct tmx_kernels_i, matmul), 1e-5, matmul_new,
                   matmul_run},
    [OP_ROPE] = {"rope", offsetof(struct tmx_kernels_i, rope), 1e-5, rope_new, rope_run},
    [OP_KV_STORE] = {"kv_store", offsetof(struct tmx_kernels_i, kv_store), 0, kv_store_new,
                     kv_store_run},
    [OP_ATTENTION] = {"attention", offsetof(struct tmx_kernels_i, attention), 1e-5,
                      attention_new, attention_run},
    [OP_MOE_ROUTE] = {"moe_route", offsetof(struct tmx_kernels_i, moe_route), 1e-5,
                      moe_route_new, moe_route_run},
    [OP_MOE_EXPERTS] = {"moe_experts", offsetof(struct tmx_kernels_i, moe_experts), 2e-5,
                        moe_experts_new, moe_experts_run},
    [OP_SWIGLU] = {"swiglu", offsetof(struct tmx_kernels_i, swiglu), 1e-5, swiglu_new,
                   swiglu_run},
    [OP_ADD_GATED] = {"add_gated", offsetof(struct tmx_kernels_i, add_gated), 1e-6,
                      add_gated_new, add_gated_run},
};

/* Whether the set's table is large enough to hold the op and the op is non-NULL. */
static int has_op(const struct tmx_kernels_i *ops, enum conform_op op) {
    size_t at = op_defs[op].member;
    if (ops->struct_size < at + sizeof(void (*)(void))) return 0;
    void (*fn)(void);
    memcpy(&fn, (const char *)ops + at, sizeof fn);
    return fn != NULL;
}

/* --- the public functions --------------------------------------------------------------------- */

size_t tmx_conform_count(void) { return N_SPECS; }

const char *tmx_conform_name(size_t i) { return i < N_SPECS ? specs[i].name : NULL; }

const char *tmx_conform_op(size_t i) { return i < N_SPECS ? op_defs[specs[i].op].name : NULL; }

void tmx_conform_case_free(struct tmx_conform_case *c) {
    if (!c) return;
    for (size_t i = c->n_imported; i-- > 0;) c->ops->weight_free(c->ctx, c->imported[i]);
    for (size_t i = c->n_bufs; i-- > 0;) c->ops->buf_free(c->ctx, c->bufs[i]);
    for (size_t i = 0; i < c->n_host; i++) free(c->host[i]);
    free(c->imported);
    free(c->bufs);
    free(c->host);
    free(c->got);
    free(c);
}

enum tmx_status tmx_conform_case_new(size_t i, const struct tmx_kernels_i *ops, void *ctx,
                                     struct tmx_conform_case **out, char **err) {
    *out = NULL;
    if (i >= N_SPECS) return tmx_err(err, TMX_ERR_INVALID, "conform: no case %zu", i);
    struct tmx_conform_case *c = calloc(1, sizeof *c);
    if (!c) return tmx_err(err, TMX_ERR_NOMEM, "conform: out of memory");
    c->s = &specs[i];
    c->ops = ops;
    c->ctx = ctx;
    c->err = err;
    /* seeded by the FNV-1a hash of the name: a case keeps its inputs when the table changes */
    c->rng = 0xcbf29ce484222325ull;
    for (const char *p = c->s->name; *p; p++)
        c->rng = (c->rng ^ (unsigned char)*p) * 0x100000001b3ull;
    enum tmx_status st = op_defs[c->s->op].setup(c);
    if (st != TMX_OK) {
        tmx_conform_case_free(c);
        return st;
    }
    *out = c;
    return TMX_OK;
}

void tmx_conform_case_run(struct tmx_conform_case *c) {
    if (has_op(c->ops, c->s->op)) op_defs[c->s->op].run(c);
}

/* max|got - ref| / max|ref|, or INFINITY on a NaN or an integer mismatch. */
static double compare(const struct output *o, const unsigned char *got) {
    double diff = 0, mag = 0;
    for (size_t i = 0; i < o->count; i++) {
        if (o->is_int) {
            int32_t g;
            memcpy(&g, got + i * sizeof g, sizeof g);
            if (g != o->ref[i]) return INFINITY;
            continue;
        }
        float g;
        memcpy(&g, got + i * sizeof g, sizeof g);
        double d = fabs(g - o->ref[i]);
        if (!(d <= diff)) diff = isnan(d) ? INFINITY : d;
        mag = fmax(mag, fabs(o->ref[i]));
    }
    return mag > 0 ? diff / mag : diff;
}

enum tmx_status tmx_conform_case_check(struct tmx_conform_case *c, struct tmx_conform_result *res,
                                       char **err) {
    const struct spec *s = c->s;
    *res = (struct tmx_conform_result){s->name, TMX_OK, INFINITY, op_defs[s->op].tol, 0};
    if (!has_op(c->ops, s->op)) {
        res->status = TMX_ERR_UNSUPPORTED;
        return TMX_OK;
    }
    res->status = c->ops->sync(c->ctx);
    size_t bytes = 0;
    for (int i = 0; i < c->n_out; i++) bytes += c->out[i].count * 4;
    if (!c->got && !(c->got = malloc(bytes)))
        return tmx_err(err, TMX_ERR_NOMEM, "conform: %s: out of memory", s->name);
    c->got_bytes = bytes;
    double worst = 0;
    for (size_t i = 0, off = 0; i < (size_t)c->n_out; off += c->out[i].count * 4, i++) {
        enum tmx_status st = c->ops->buf_read(c->ctx, c->got + off, c->out[i].dev,
                                              c->out[i].count * 4);
        if (st != TMX_OK)
            return tmx_err(err, st, "conform: %s: buf_read failed (%s)", s->name,
                           tmx_status_str(st));
        worst = fmax(worst, compare(&c->out[i], c->got + off));
    }
    if (res->status == TMX_OK) res->err = worst;
    res->pass = res->status == TMX_OK && res->err <= res->tol;
    return TMX_OK;
}

const void *tmx_conform_case_output(const struct tmx_conform_case *c, size_t *nbytes) {
    *nbytes = c->got ? c->got_bytes : 0;
    return c->got;
}

enum tmx_status tmx_conform_run(const struct tmx_kernels_i *ops, void *ctx, const char *filter,
                                struct tmx_conform_result *results, int max_results,
                                int *n_results, char **err) {
    *n_results = 0;
    for (size_t i = 0; i < N_SPECS; i++) {
        if (filter && !strstr(specs[i].name, filter)) continue;
        struct tmx_conform_case *c;
        struct tmx_conform_result r;
        enum tmx_status st = tmx_conform_case_new(i, ops, ctx, &c, err);
        if (st != TMX_OK) return st;
        tmx_conform_case_run(c);
        st = tmx_conform_case_check(c, &r, err);
        tmx_conform_case_free(c);
        if (st != TMX_OK) return st;
        if (*n_results < max_results) results[*n_results] = r;
        ++*n_results;
    }
    return TMX_OK;
}
