/* codec-int8.c: per-row absmax int8 experts, the smallest codec that does real work.
 *
 * What it is: a codec (kind "codec", ops table struct tmx_codec_i in tmx/plugin.h) for
 * hf_quant_config.json {"quant_method": "int8_absmax", "codec": "int8"}. Layer L's experts live
 * in int8/layer-LLL.safetensors: for expert e and projection p (gate, up, down) a U8 tensor
 * "e.p.q" [rows][cols] of int8 values and an F32 "e.p.scale" [rows], so w ~ q * scale.
 *
 * Build: the tree builds every tests/plugins/<kind>-<name>.c into libtmx-<kind>-<name>.so; in
 * your own CMake project, tmx_add_plugin(KIND codec NAME int8 SOURCES codec-int8.c LIBS m).
 *
 * What it shows: encode (layer_encode writes the files through host->st_write) and load
 * (host->st_open mmaps them) as two halves of one format; shapes checked before a byte is read;
 * the expert block's contract (post-expert norm before the routing weight); errors made with
 * host->err. It is deliberately naive: no threads, no fused kernels. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "tmx/plugin.h"

static const struct tmx_host *host;
static const char *const proj_name[3] = {"gate", "up", "down"};

struct layer {
    struct tmx_safetensors *file;
    int n_experts, latent, inter;
    struct tmx_tensor t[]; /* [n_experts][3 projections][q, scale] */
};

static enum tmx_status int8_init(const struct tmx_host *h, const struct tmx_opts *opts,
                                 void **ctx, char **err) {
    (void)opts, (void)err;
    host = h;
    *ctx = NULL;
    return TMX_OK;
}

static void int8_fini(void *ctx) { (void)ctx; }

static void mat_shape(const struct layer *l, int p, int64_t *rows, int64_t *cols) {
    *rows = p < 2 ? l->inter : l->latent;
    *cols = p < 2 ? l->latent : l->inter;
}

static enum tmx_status int8_layer_load(void *ctx, const struct tmx_codec_layer_info *in,
                                       void **out, char **err) {
    (void)ctx;
    char path[4096], name[64];
    snprintf(path, sizeof path, "%s/int8/layer-%03d.safetensors", in->model_dir, in->layer);
    struct layer *l = calloc(1, sizeof *l + (size_t)in->n_experts * 6 * sizeof(struct tmx_tensor));
    if (!l) return host->err(err, TMX_ERR_NOMEM, "codec int8: out of memory");
    *l = (struct layer){NULL, in->n_experts, in->latent, in->inter};
    enum tmx_status st = host->st_open(path, &l->file, err);
    for (int e = 0; st == TMX_OK && e < in->n_experts; e++)
        for (int p = 0; st == TMX_OK && p < 3; p++) {
            int64_t rows, cols;
            mat_shape(l, p, &rows, &cols);
            struct tmx_tensor *q = &l->t[(e * 3 + p) * 2], *s = q + 1;
            snprintf(name, sizeof name, "%d.%s.q", e, proj_name[p]);
            int ok = host->st_find(l->file, name, q) == 0 && q->dtype == TMX_DTYPE_U8 &&
                     q->shape[0] == rows && q->shape[1] == cols;
            snprintf(name, sizeof name, "%d.%s.scale", e, proj_name[p]);
            ok = ok && host->st_find(l->file, name, s) == 0 && s->dtype == TMX_DTYPE_F32 &&
                 s->shape[0] == rows;
            if (!ok)
                st = host->err(err, TMX_ERR_INVALID, "%s: expert %d %s: missing or mis-shaped",
                               path, e, proj_name[p]);
        }
    if (st != TMX_OK) {
        if (l->file) host->st_free(l->file);
        free(l);
        return st;
    }
    *out = l;
    return TMX_OK;
}

static void int8_layer_free(void *ctx, void *layer) {
    (void)ctx;
    struct layer *l = layer;
    host->st_free(l->file);
    free(l);
}

/* y[rows] = W x with W the int8 matrix p of expert e. */
static void matvec(const struct layer *l, int e, int p, const float *x, float *y) {
    int64_t rows, cols;
    mat_shape(l, p, &rows, &cols);
    const int8_t *q = l->t[(e * 3 + p) * 2].data;
    const float *s = l->t[(e * 3 + p) * 2 + 1].data;
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t c = 0; c < cols; c++) acc += (float)q[r * cols + c] * x[c];
        y[r] = acc * s[r];
    }
}

static enum tmx_status int8_moe_experts(void *ctx, void *layer, float *out, const float *z,
                                        const int32_t *ids, const float *weights, int n, int k,
                                        const struct tmx_tensor *post_norm, float eps,
                                        char **err) {
    (void)ctx;
    const struct layer *l = layer;
    if (post_norm && post_norm->dtype != TMX_DTYPE_F32)
        return host->err(err, TMX_ERR_UNSUPPORTED, "codec int8: post-expert norm must be F32");
    float *g = malloc(sizeof(float) * (size_t)(2 * l->inter + l->latent)), *u = g + l->inter,
          *y = u + l->inter;
    if (!g) return host->err(err, TMX_ERR_NOMEM, "codec int8: out of memory");
    for (int t = 0; t < n; t++) {
        float *o = out + (size_t)t * l->latent;
        for (int i = 0; i < l->latent; i++) o[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            const int e = ids[t * k + j];
            const float *x = z + (size_t)t * l->latent;
            matvec(l, e, 0, x, g);
            matvec(l, e, 1, x, u);
            for (int i = 0; i < l->inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            matvec(l, e, 2, g, y);
            double ss = 0.0; /* post-expert RMSNorm (if the layer has one), then the weight */
            for (int i = 0; i < l->latent; i++) ss += (double)y[i] * y[i];
            const float *w = post_norm ? post_norm->data : NULL;
            const float r = weights[t * k + j] / (w ? sqrtf((float)(ss / l->latent) + eps) : 1.0f);
            for (int i = 0; i < l->latent; i++) o[i] += r * y[i] * (w ? w[i] : 1.0f);
        }
    }
    free(g);
    return TMX_OK;
}

static enum tmx_status int8_expert_decode(void *ctx, void *layer, int e, int p, float *w,
                                          char **err) {
    (void)ctx, (void)err;
    const struct layer *l = layer;
    int64_t rows, cols;
    mat_shape(l, p, &rows, &cols);
    const int8_t *q = l->t[(e * 3 + p) * 2].data;
    const float *s = l->t[(e * 3 + p) * 2 + 1].data;
    for (int64_t i = 0; i < rows * cols; i++) w[i] = (float)q[i] * s[i / cols];
    return TMX_OK;
}

/* Per-row absmax: scale = max|w| / 127, q = round(w / scale). One file per layer. */
static enum tmx_status int8_layer_encode(void *ctx, const struct tmx_codec_encode_job *job,
                                         char **err) {
    (void)ctx;
    const int n = job->n_experts * 3 * 2;
    struct layer l = {NULL, job->n_experts, job->latent, job->inter};
    struct tmx_tensor *t = calloc((size_t)n, sizeof *t);
    char **names = calloc((size_t)n, sizeof *names), path[4096];
    enum tmx_status st = t && names ? TMX_OK : host->err(err, TMX_ERR_NOMEM, "out of memory");
    for (int i = 0; st == TMX_OK && i < n; i += 2) {
        const int e = i / 6, p = i / 2 % 3;
        const float *w = (p == 0 ? job->gate : p == 1 ? job->up : job->down)[e];
        int64_t rows, cols;
        mat_shape(&l, p, &rows, &cols);
        int8_t *q = malloc((size_t)(rows * cols));
        float *s = malloc((size_t)rows * sizeof *s);
        names[i] = malloc(64), names[i + 1] = malloc(64);
        t[i] = (struct tmx_tensor){TMX_DTYPE_U8, 2, {rows, cols}, q};
        t[i + 1] = (struct tmx_tensor){TMX_DTYPE_F32, 1, {rows}, s};
        if (!q || !s || !names[i] || !names[i + 1]) {
            st = host->err(err, TMX_ERR_NOMEM, "out of memory");
            break;
        }
        snprintf(names[i], 64, "%d.%s.q", e, proj_name[p]);
        snprintf(names[i + 1], 64, "%d.%s.scale", e, proj_name[p]);
        double se = 0.0, sw = 0.0; /* proxy error: relative squared error of the weights */
        for (int64_t r = 0; r < rows; r++) {
            float amax = 0.0f;
            for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(w[r * cols + c]));
            s[r] = amax / 127.0f;
            for (int64_t c = 0; c < cols; c++) { /* an all-zero row keeps q = 0 */
                const float x = w[r * cols + c];
                q[r * cols + c] = (int8_t)(s[r] > 0.0f ? rintf(x / s[r]) : 0.0f);
                se += (x - q[r * cols + c] * s[r]) * (x - q[r * cols + c] * s[r]);
                sw += (double)x * x;
            }
        }
        if (job->proxy_err) job->proxy_err[e * 3 + p] = sw > 0.0 ? se / sw : 0.0;
    }
    snprintf(path, sizeof path, "%s/int8", job->out_dir);
    if (st == TMX_OK && mkdir(path, 0777) != 0 && errno != EEXIST)
        st = host->err(err, TMX_ERR_IO, "%s: cannot create", path);
    snprintf(path, sizeof path, "%s/int8/layer-%03d.safetensors", job->out_dir, job->layer);
    if (st == TMX_OK)
        st = host->st_write(path, n, (const char *const *)names, t, NULL, err);
    for (int i = 0; t && names && i < n; i++) free(t[i].data), free(names[i]);
    free(t);
    free(names);
    return st;
}

static const struct tmx_codec_i int8_ops = {
    .struct_size = sizeof(struct tmx_codec_i),
    .quant_method = "int8_absmax",
    .init = int8_init,
    .fini = int8_fini,
    .layer_load = int8_layer_load,
    .layer_free = int8_layer_free,
    .moe_experts = int8_moe_experts,
    .expert_decode = int8_expert_decode,
    .layer_encode = int8_layer_encode,
};

static const struct tmx_plugin int8_plugin = {
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .struct_size = sizeof(struct tmx_plugin),
    .name = "int8",
    .kind = TMX_PLUGIN_CODEC,
    .version = "1.0.0",
    .ops = &int8_ops,
};

TMX_PLUGIN_EXPORT const struct tmx_plugin *tmx_plugin_entry(const struct tmx_host *h,
                                                            char **err) {
    (void)h, (void)err;
    return &int8_plugin;
}
