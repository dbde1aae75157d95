/* layer.c: one MoE layer's routed experts from a TrellisMX build (docs/trellismx.md §10).
 *
 * hf_quant_config.json gives K, α and experts_per_file; coupled/layer-LLL.safetensors the
 * three sign vectors; experts/layer-LLL-SSS-EEE.safetensors, found by the naming rule, the
 * experts in chunks. Every name, dtype, shape and metadata field is checked before a byte is
 * used, and every message names the file. The trellis words and signs stay views of the
 * mmapped files; the block scales are expanded from CSF here, once. A rank folder of `tmx pack`
 * (its tmx-pack.json names the rank) holds the rank's slice already cut: it is read as is. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec_impl.h"

static const char *const proj_name[3] = {"gate_proj", "up_proj", "down_proj"};

/* Hands a message of a tmx-trellis function (malloc'd by it) on as one the host made. */
static enum tmx_status relay(const struct tmx_host *host, char **err, enum tmx_status st,
                             char *msg) {
    if (st != TMX_OK) host->err(err, st, "%s", msg ? msg : "out of memory");
    free(msg);
    return st;
}

/* "I32 [4][8][16][24]". Plugins link nothing of the core, so dtype names are spelled here. */
static void shape_text(const struct tmx_tensor *t, char *buf, size_t size) {
    static const char *const dtypes[TMX_DTYPE_COUNT] = {"F32", "BF16", "F16", "F8_E4M3", "U8",
                                                        "I32"};
    int n = snprintf(buf, size, "%s ", (unsigned)t->dtype < TMX_DTYPE_COUNT ? dtypes[t->dtype]
                                                                             : "?");
    for (int i = 0; i < t->ndim && n > 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - (size_t)n, "[%lld]", (long long)t->shape[i]);
}

/* Finds tensor `name` of `file` and checks its dtype and shape against `want` (a shape entry < 0
 * matches any size). Data read as 32-bit words must be 4-byte aligned. */
static enum tmx_status find(const struct tmx_host *host, const struct tmx_safetensors *file,
                            const char *path, const char *name, const struct tmx_tensor *want,
                            struct tmx_tensor *t, char **err) {
    if (host->st_find(file, name, t) != 0)
        return host->err(err, TMX_ERR_INVALID, "%s: tensor \"%s\" is missing", path, name);
    int ok = t->dtype == want->dtype && t->ndim == want->ndim;
    for (int i = 0; ok && i < want->ndim; i++)
        ok = want->shape[i] < 0 || t->shape[i] == want->shape[i];
    if (!ok) {
        char have[96], need[96];
        shape_text(t, have, sizeof have);
        shape_text(want, need, sizeof need);
        return host->err(err, TMX_ERR_INVALID, "%s: tensor \"%s\" is %s, expected %s", path,
                         name, have, need);
    }
    if ((t->dtype == TMX_DTYPE_I32 || t->dtype == TMX_DTYPE_F32) && (uintptr_t)t->data % 4 != 0)
        return host->err(err, TMX_ERR_INVALID, "%s: tensor \"%s\": data is not 4-byte aligned",
                         path, name);
    return TMX_OK;
}

/* A __metadata__ entry that must be `want`, or (want NULL) the decimal number `num`. */
static enum tmx_status meta_is(const struct tmx_host *host, const struct tmx_safetensors *file,
                               const char *path, const char *key, const char *want, long num,
                               char **err) {
    const char *v = host->st_meta(file, key);
    if (!v)
        return host->err(err, TMX_ERR_INVALID, "%s: __metadata__ \"%s\" is missing", path, key);
    if (want) {
        if (strcmp(v, want) != 0)
            return host->err(err, TMX_ERR_INVALID, "%s: __metadata__ \"%s\" is \"%s\", expected "
                             "\"%s\"", path, key, v, want);
        return TMX_OK;
    }
    char *end;
    const long got = strtol(v, &end, 10);
    if (*v < '0' || *v > '9' || *end || got != num)
        return host->err(err, TMX_ERR_INVALID, "%s: __metadata__ \"%s\" is \"%s\", but the file "
                         "name says %ld", path, key, v, num);
    return TMX_OK;
}

static enum tmx_status open_checked(const struct tmx_host *host, const char *path,
                                    const char *format, int layer,
                                    struct tmx_safetensors **file, char **err) {
    enum tmx_status st = host->st_open(path, file, err);
    if (st == TMX_OK &&
        ((st = meta_is(host, *file, path, "format", format, 0, err)) ||
         (st = meta_is(host, *file, path, "trellismx_version", "1", 0, err)) ||
         (st = meta_is(host, *file, path, "layer", NULL, layer, err)))) {
        host->st_free(*file);
        *file = NULL;
    }
    return st;
}

/* coupled/layer-LLL.safetensors (§10.3). */
static enum tmx_status load_coupled(const struct tmx_host *host, const char *dir,
                                    struct trellis_layer *l, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/coupled/layer-%03d.safetensors", dir, l->layer);
    enum tmx_status st = open_checked(host, path, "trellismx-coupled", l->layer, &l->coupled,
                                      err);
    static const char *const names[3] = {"sign_latent_in", "sign_intermediate",
                                         "sign_latent_out"};
    const uint8_t **signs[3] = {&l->sign_in, &l->sign_mid, &l->sign_out};
    const int64_t sizes[3] = {l->latent / 8, l->inter / 8, l->latent / 8};
    for (int i = 0; st == TMX_OK && i < 3; i++) {
        const struct tmx_tensor want = {TMX_DTYPE_U8, 1, {sizes[i]}, NULL};
        struct tmx_tensor t;
        if ((st = find(host, l->coupled, path, names[i], &want, &t, err)) == TMX_OK)
            *signs[i] = t.data;
    }
    return st;
}

/* The five tensors of projection p in one experts/ file of n_exp experts (§10.2). */
struct proj_tensors {
    struct tmx_tensor trellis, scale, csf, exceptions, starts;
};

static enum tmx_status find_proj(const struct tmx_host *host, const struct trellis_layer *l,
                                 const struct tmx_safetensors *file, const char *path, int p,
                                 int64_t n_exp, int K, int block, struct proj_tensors *t,
                                 char **err) {
    const int64_t rows = p < 2 ? l->inter : l->latent, cols = p < 2 ? l->latent : l->inter;
    const struct tmx_tensor want[5] = {
        {TMX_DTYPE_I32, 4, {n_exp, rows / 16, cols / 16, tmx_trellis_words(K)}, NULL},
        {TMX_DTYPE_F32, 1, {n_exp}, NULL},
        {TMX_DTYPE_U8, 2, {n_exp, tmx_trellis_csf_fixed_size(rows, cols / block)}, NULL},
        {TMX_DTYPE_I32, 1, {-1}, NULL},
        {TMX_DTYPE_I32, 1, {n_exp + 1}, NULL},
    };
    static const char *const suffix[5] = {"trellis", "scale", "scale_csf",
                                          "scale_csf_exceptions", "scale_csf_starts"};
    struct tmx_tensor *out[5] = {&t->trellis, &t->scale, &t->csf, &t->exceptions, &t->starts};
    enum tmx_status st = TMX_OK;
    char name[64];
    for (int i = 0; st == TMX_OK && i < 5; i++) {
        snprintf(name, sizeof name, "%s.%s", proj_name[p], suffix[i]);
        st = find(host, file, path, name, &want[i], out[i], err);
    }
    return st;
}

/* Experts first..last of experts/layer-LLL-SSS-EEE.safetensors into l->mat; their expanded
 * scales go to l->scales from *scale_off on. */
static enum tmx_status load_chunk(const struct tmx_host *host, const char *dir, int first,
                                  int last, int K, int block, struct trellis_layer *l,
                                  struct tmx_safetensors **file, int64_t *scale_off, char **err) {
    char path[4096], name[4200];
    snprintf(path, sizeof path, "%s/experts/layer-%03d-%03d-%03d.safetensors", dir, l->layer,
             first, last);
    enum tmx_status st = open_checked(host, path, "trellismx-experts", l->layer, file, err);
    if (st == TMX_OK) st = meta_is(host, *file, path, "first_expert", NULL, first, err);
    if (st == TMX_OK) st = meta_is(host, *file, path, "last_expert", NULL, last, err);
    const int64_t n_exp = last - first + 1;
    for (int p = 0; st == TMX_OK && p < 3; p++) {
        struct proj_tensors t;
        if ((st = find_proj(host, l, *file, path, p, n_exp, K, block, &t, err))) break;
        const int32_t *starts = t.starts.data;
        const uint32_t *exceptions = t.exceptions.data;
        const uint8_t *csf = t.csf.data;
        const float *g = t.scale.data;
        char *msg = NULL;
        snprintf(name, sizeof name, "%s: %s.scale_csf_starts", path, proj_name[p]);
        st = tmx_trellis_csf_check_starts(name, starts, n_exp, t.exceptions.shape[0], &msg);
        st = relay(host, err, st, msg);
        for (int64_t e = 0; st == TMX_OK && e < n_exp; e++) {
            struct tmx_trellis_matrix *m = &l->mat[(first + e) * 3 + p];
            *m = (struct tmx_trellis_matrix){
                .law = &l->law, .K = K, .block = block,
                .rows = p < 2 ? l->inter : l->latent, .cols = p < 2 ? l->latent : l->inter,
                .words = (const uint32_t *)t.trellis.data + e * t.trellis.shape[1] *
                         t.trellis.shape[2] * t.trellis.shape[3],
                .scales = l->scales + *scale_off, .scale = g[e],
                .sign_in = p < 2 ? l->sign_in : l->sign_mid,
                .sign_out = p < 2 ? l->sign_mid : l->sign_out};
            snprintf(name, sizeof name, "%s: %s.scale_csf of expert %d", path, proj_name[p],
                     first + (int)e);
            const int64_t cols = m->cols / block;
            msg = NULL;
            st = tmx_trellis_csf_decode(name, csf + e * t.csf.shape[1], t.csf.shape[1],
                                        exceptions + starts[e], starts[e + 1] - starts[e], m->rows,
                                        cols, l->scales + *scale_off, &msg);
            st = relay(host, err, st, msg);
            if (st == TMX_OK) {
                msg = NULL;
                st = tmx_trellis_matrix_check(m, &msg);
                if (st != TMX_OK) {
                    host->err(err, st, "%s: %s of expert %d: %s", path, proj_name[p],
                              first + (int)e, msg ? msg : "out of memory");
                    free(msg);
                }
            }
            *scale_off += m->rows * cols;
        }
    }
    return st;
}

/* Keeps rank `rank` of n_ranks of every expert's intermediate rows (§10 lays a layer out
 * whole): gate and up become row views, down's column slice is copied tile row by tile row
 * with its block scales. inter / n_ranks is a multiple of 128, so the cut falls between tiles,
 * block-scale groups and Hadamard blocks. */
static enum tmx_status slice_layer(const struct tmx_host *host, const char *name,
                                   struct trellis_layer *l, int rank, int n_ranks, char **err) {
    const int64_t inter = l->inter, part = inter / n_ranks, i0 = part * rank, lat = l->latent;
    const int K = l->mat[0].K, block = l->mat[0].block, words = tmx_trellis_words(K);
    const int64_t tiles_in = inter / 16, tiles_part = part / 16;
    l->down_words = malloc((size_t)(l->n_experts * (lat / 16) * tiles_part * words) * 4);
    l->down_scales = malloc((size_t)(l->n_experts * lat * (part / block)));
    if (!l->down_words || !l->down_scales)
        return host->err(err, TMX_ERR_NOMEM, "codec.%s: layer %d: out of memory for its slice",
                         name, l->layer);
    const uint8_t *sign_mid = l->sign_mid + i0 / 8;
    for (int e = 0; e < l->n_experts; e++) {
        for (int p = 0; p < 2; p++) { /* gate, up: rows [i0, i0 + part) */
            struct tmx_trellis_matrix *m = &l->mat[e * 3 + p];
            m->words += (size_t)((i0 / 16) * (lat / 16) * words);
            m->scales += (size_t)(i0 * (lat / block));
            m->rows = part;
            m->sign_out = sign_mid;
        }
        struct tmx_trellis_matrix *d = &l->mat[e * 3 + 2]; /* down: columns [i0, i0 + part) */
        uint32_t *w = l->down_words + (size_t)(e * (lat / 16) * tiles_part * words);
        uint8_t *sc = l->down_scales + (size_t)(e * lat * (part / block));
        for (int64_t tr = 0; tr < lat / 16; tr++)
            memcpy(w + (size_t)(tr * tiles_part * words),
                   d->words + (size_t)((tr * tiles_in + i0 / 16) * words),
                   (size_t)(tiles_part * words) * 4);
        for (int64_t r = 0; r < lat; r++)
            memcpy(sc + r * (part / block), d->scales + r * (inter / block) + i0 / block,
                   (size_t)(part / block));
        d->words = w;
        d->scales = sc;
        d->cols = part;
        d->sign_in = sign_mid;
    }
    l->inter = (int)part;
    l->sign_mid = sign_mid;
    return TMX_OK;
}

/* Whether `dir` is a rank folder of `tmx pack` (docs/tp.md): *packed 1 when its tmx-pack.json
 * says it holds rank `rank` of n_ranks; an error when it holds another. */
static enum tmx_status packed_rank(const struct trellis_codec *c, const char *dir, int layer,
                                   int rank, int n_ranks, int *packed, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tmx-pack.json", dir);
    *packed = 0;
    FILE *f = fopen(path, "r");
    if (!f) return TMX_OK;
    json_error_t je;
    json_t *j = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!j) return c->host->err(err, TMX_ERR_INVALID, "%s: %s", path, je.text);
    const json_t *tp = json_object_get(j, "tp"), *r = json_object_get(j, "rank");
    enum tmx_status st = TMX_OK;
    /* without "rank" it is a pack's index: the core opens the rank folders below it */
    if (r && (!json_is_integer(tp) || !json_is_integer(r))) {
        st = c->host->err(err, TMX_ERR_INVALID, "%s: \"tp\" and \"rank\" must be integers",
                          path);
    } else if (r && (json_integer_value(tp) != n_ranks || json_integer_value(r) != rank)) {
        st = c->host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d: %s holds rank %lld of "
                          "tp = %lld, loaded as rank %d of tp = %d", c->spec->name, layer, path,
                          (long long)json_integer_value(r), (long long)json_integer_value(tp),
                          rank, n_ranks);
    } else {
        *packed = r != NULL;
    }
    json_decref(j);
    return st;
}

void tmx_trellis_codec_layer_free(void *ctx, void *layer) {
    const struct trellis_codec *c = ctx;
    struct trellis_layer *l = layer;
    if (!l) return;
    for (int f = 0; f < l->n_files; f++)
        if (l->files[f]) c->host->st_free(l->files[f]);
    if (l->coupled) c->host->st_free(l->coupled);
    free(l->files);
    free(l->scales);
    free(l->down_words);
    free(l->down_scales);
    free(l->mat);
    free(l);
}

enum tmx_status tmx_trellis_codec_layer_load(void *ctx, const struct tmx_codec_layer_info *info,
                                             void **out, char **err) {
    return tmx_trellis_codec_layer_load_slice(ctx, info, 0, 1, out, err);
}

enum tmx_status tmx_trellis_codec_layer_load_slice(void *ctx,
                                                   const struct tmx_codec_layer_info *info,
                                                   int rank, int n_ranks, void **out,
                                                   char **err) {
    const struct trellis_codec *c = ctx;
    const struct tmx_host *host = c->host;
    const int block = c->spec->block;
    if (info->n_experts < 1 || info->latent <= 0 || info->latent % TMX_TRELLIS_HADAMARD ||
        info->inter <= 0 || info->inter % TMX_TRELLIS_HADAMARD)
        return host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d: %d experts of latent %d, "
                         "intermediate %d; TrellisMX needs multiples of 128", c->spec->name,
                         info->layer, info->n_experts, info->latent, info->inter);
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks ||
        info->inter % (n_ranks * TMX_TRELLIS_HADAMARD))
        return host->err(err, TMX_ERR_INVALID, "codec.%s: layer %d: intermediate %d does not "
                         "split into tp = %d slices of whole 128-wide Hadamard blocks (rank %d)",
                         c->spec->name, info->layer, info->inter, n_ranks, rank);
    char path[4096];
    snprintf(path, sizeof path, "%s/hf_quant_config.json", info->model_dir);
    struct tmx_trellis_quant_config q;
    char *msg = NULL;
    enum tmx_status st = tmx_trellis_quant_config_read(path, c->id, &q, &msg);
    if ((st = relay(host, err, st, msg)) != TMX_OK) return st;

    int packed;
    if ((st = packed_rank(c, info->model_dir, info->layer, rank, n_ranks, &packed, err)))
        return st;
    /* a packed rank's files hold its slice: [i0, i0 + held) of the intermediate rows */
    const int held = info->inter / n_ranks, i0 = held * rank;
    struct trellis_layer *l = calloc(1, sizeof *l);
    if (!l) return host->err(err, TMX_ERR_NOMEM, "out of memory");
    *l = (struct trellis_layer){.layer = info->layer, .n_experts = info->n_experts,
                                .latent = info->latent, .inter = info->inter};
    const int64_t per_expert = 3 * (int64_t)l->latent * ((packed ? held : l->inter) / block);
    l->n_files = (l->n_experts + q.experts_per_file - 1) / q.experts_per_file;
    l->mat = calloc((size_t)l->n_experts * 3, sizeof *l->mat);
    l->files = calloc((size_t)l->n_files, sizeof *l->files);
    l->scales = malloc((size_t)(l->n_experts * per_expert));
    if (!l->mat || !l->files || !l->scales) {
        tmx_trellis_codec_layer_free(ctx, l);
        return host->err(err, TMX_ERR_NOMEM, "codec.%s: layer %d: out of memory for %lld "
                         "block scales", c->spec->name, info->layer,
                         (long long)(info->n_experts * per_expert));
    }
    msg = NULL;
    st = tmx_trellis_law_init(&l->law, c->spec->law, q.alpha, &msg);
    st = relay(host, err, st, msg);
    if (st == TMX_OK) st = load_coupled(host, info->model_dir, l, err);
    if (st == TMX_OK && packed) { /* sign_intermediate stays whole in every rank folder */
        l->inter = held;
        l->sign_mid += i0 / 8;
    }
    int64_t scale_off = 0;
    for (int f = 0; st == TMX_OK && f < l->n_files; f++) {
        const int first = f * q.experts_per_file;
        const int last = first + q.experts_per_file > l->n_experts
                             ? l->n_experts - 1 : first + q.experts_per_file - 1;
        st = load_chunk(host, info->model_dir, first, last, q.bits, block, l, &l->files[f],
                        &scale_off, err);
    }
    if (st == TMX_OK && n_ranks > 1 && !packed)
        st = slice_layer(host, c->spec->name, l, rank, n_ranks, err);
    if (st != TMX_OK) {
        tmx_trellis_codec_layer_free(ctx, l);
        return st;
    }
    *out = l;
    return TMX_OK;
}
