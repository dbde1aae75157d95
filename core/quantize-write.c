/* quantize-write.c: the non-expert part of a build: model shards and the files copied as they
 * are.
 *
 * Routed-expert tensors belong to the codec's files and are left out. The attention
 * projections become MXFP8 (docs/trellismx.md §10.5: NAME F8_E4M3 [n][k] and NAME_scale U8
 * [n][k/32], per row by §7.3), everything else keeps its dtype and bytes. Shards are filled in
 * name order up to SHARD_BYTES each. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "quantize-impl.h"
#include "trellis.h"

#define SHARD_BYTES ((size_t)4 << 30)

static const char *const attention_suffix[] = {".self_attn.q_proj.weight",
                                               ".self_attn.k_proj.weight",
                                               ".self_attn.v_proj.weight",
                                               ".self_attn.o_proj.weight"};

static int ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* One tensor of the shards: copied from the checkpoint, or made MXFP8 from it. */
struct out_tensor {
    const char *name;         /* the checkpoint's */
    struct tmx_tensor src;
    int mxfp8;
    size_t nbytes;            /* in the shard: the MXFP8 pair counts both */
    int shard;
};

static int is_mxfp8_candidate(const char *name, const struct tmx_tensor *t) {
    int attn = 0;
    for (size_t i = 0; i < sizeof attention_suffix / sizeof *attention_suffix; i++)
        attn |= ends_with(name, attention_suffix[i]);
    return attn && t->ndim == 2 && t->shape[1] % 32 == 0 &&
           (t->dtype == TMX_DTYPE_F32 || t->dtype == TMX_DTYPE_BF16 || t->dtype == TMX_DTYPE_F16);
}

static float to_f32(const struct tmx_tensor *t, int64_t i) {
    switch (t->dtype) {
    case TMX_DTYPE_BF16: return tmx_bf16_to_f32(((const uint16_t *)t->data)[i]);
    case TMX_DTYPE_F16: return tmx_f16_to_f32(((const uint16_t *)t->data)[i]);
    default: return ((const float *)t->data)[i];
    }
}

/* q[n][k] E4M3 and scales[n][k/32] UE8M0 of src, row by row. */
static int mxfp8(const struct tmx_tensor *src, uint8_t **q, uint8_t **scales) {
    const int64_t n = src->shape[0], k = src->shape[1];
    float *row = malloc((size_t)k * sizeof *row);
    *q = malloc((size_t)(n * k));
    *scales = malloc((size_t)(n * k / 32));
    if (!row || !*q || !*scales) {
        free(row);
        return 0;
    }
    for (int64_t r = 0; r < n; r++) {
        for (int64_t c = 0; c < k; c++) row[c] = to_f32(src, r * k + c);
        tmx_trellis_mxfp8_quantize(row, k, *q + r * k, *scales + r * k / 32);
    }
    free(row);
    return 1;
}

/* Writes shard s of n_shards: its tensors in name order, MXFP8 ones made now. */
static enum tmx_status write_shard(const struct out_tensor *ot, size_t n, int s, int n_shards,
                                   const char *path, char **err) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += ot[i].shard == s ? 1 + (size_t)ot[i].mxfp8 : 0;
    const char **names = calloc(count ? count : 1, sizeof *names);
    char **scale_names = calloc(count ? count : 1, sizeof *scale_names);
    struct tmx_tensor *t = calloc(count ? count : 1, sizeof *t);
    void **owned = calloc(count ? count : 1, sizeof *owned);
    enum tmx_status st = names && scale_names && t && owned ? TMX_OK : TMX_ERR_NOMEM;
    size_t j = 0;
    for (size_t i = 0; st == TMX_OK && i < n; i++) {
        if (ot[i].shard != s) continue;
        if (!ot[i].mxfp8) {
            names[j] = ot[i].name;
            t[j++] = ot[i].src;
            continue;
        }
        const int64_t rows = ot[i].src.shape[0], cols = ot[i].src.shape[1];
        uint8_t *q, *sc;
        const int ok = mxfp8(&ot[i].src, &q, &sc);
        const size_t len = strlen(ot[i].name) + sizeof "_scale";
        owned[j] = q;
        owned[j + 1] = sc;
        if (!ok || !(scale_names[j] = malloc(len))) {
            st = TMX_ERR_NOMEM;
            break;
        }
        snprintf(scale_names[j], len, "%s_scale", ot[i].name);
        names[j] = ot[i].name;
        t[j++] = (struct tmx_tensor){TMX_DTYPE_F8_E4M3, 2, {rows, cols}, q};
        names[j] = scale_names[j - 1];
        t[j++] = (struct tmx_tensor){TMX_DTYPE_U8, 2, {rows, cols / 32}, sc};
    }
    if (st == TMX_OK) {
        const char *meta[] = {"format", "pt", NULL};
        st = tmx_safetensors_write(path, (int)count, names, t, meta, err);
    } else {
        st = tmx_err(err, st, "out of memory writing shard %d of %d", s + 1, n_shards);
    }
    for (size_t i = 0; owned && i < count; i++) free(owned[i]);
    for (size_t i = 0; scale_names && i < count; i++) free(scale_names[i]);
    free(owned);
    free(scale_names);
    free(names);
    free(t);
    return st;
}

enum tmx_status quantize_write_dense(const struct tmx_checkpoint *ck, const char *out_dir,
                                     json_t *mxfp8_names, char **err) {
    const size_t n_all = tmx_checkpoint_count(ck);
    struct out_tensor *ot = calloc(n_all ? n_all : 1, sizeof *ot);
    if (!ot) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    size_t n = 0, fill = 0, total = 0;
    int shard = 0;
    for (size_t i = 0; i < n_all; i++) {
        struct out_tensor o = {0};
        o.name = tmx_checkpoint_at(ck, i, &o.src, NULL);
        if (strstr(o.name, ".mlp.experts.")) continue; /* the codec's */
        o.mxfp8 = is_mxfp8_candidate(o.name, &o.src);
        o.nbytes = o.mxfp8 ? (size_t)tmx_tensor_numel(&o.src) / 32 * 33 : tmx_tensor_nbytes(&o.src);
        if (fill > 0 && fill + o.nbytes > SHARD_BYTES) shard++, fill = 0;
        o.shard = shard;
        fill += o.nbytes;
        total += o.nbytes;
        ot[n++] = o;
    }
    const int n_shards = shard + 1;
    json_t *map = json_object();
    enum tmx_status st = TMX_OK;
    char path[4096], file[64];
    for (int s = 0; st == TMX_OK && s < n_shards; s++) {
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        snprintf(path, sizeof path, "%s/%s", out_dir, file);
        st = write_shard(ot, n, s, n_shards, path, err);
        for (size_t i = 0; st == TMX_OK && i < n; i++) {
            if (ot[i].shard != s) continue;
            json_object_set_new(map, ot[i].name, json_string(file));
            if (!ot[i].mxfp8) continue;
            char scale[512];
            snprintf(scale, sizeof scale, "%s_scale", ot[i].name);
            json_object_set_new(map, scale, json_string(file));
            json_array_append_new(mxfp8_names, json_string(ot[i].name));
        }
    }
    if (st == TMX_OK) {
        json_t *index = json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total,
                                  "weight_map", map);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", out_dir);
        if (!index || json_dump_file(index, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0)
            st = tmx_err(err, TMX_ERR_IO, "%s: cannot write", path);
        json_decref(index);
    }
    json_decref(map);
    free(ot);
    return st;
}

/* --- files kept as they are ---------------------------------------------------------------- */

static const char *const kept_files[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
    "vocab.json", "merges.txt", "preprocessor_config.json", "processor_config.json",
};

static enum tmx_status copy_file(const char *from, const char *to, char **err) {
    int in = open(from, O_RDONLY), out = -1;
    if (in < 0) return tmx_err(err, TMX_ERR_IO, "%s: %s", from, strerror(errno));
    out = open(to, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    enum tmx_status st = out < 0 ? tmx_err(err, TMX_ERR_IO, "%s: %s", to, strerror(errno))
                                 : TMX_OK;
    char buf[1 << 16];
    for (ssize_t r; st == TMX_OK && (r = read(in, buf, sizeof buf)) != 0;) {
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || write(out, buf, (size_t)r) != r)
            st = tmx_err(err, TMX_ERR_IO, "copying %s to %s: %s", from, to, strerror(errno));
    }
    if (out >= 0 && close(out) != 0 && st == TMX_OK)
        st = tmx_err(err, TMX_ERR_IO, "%s: %s", to, strerror(errno));
    close(in);
    return st;
}

enum tmx_status quantize_copy_files(const char *in_dir, const char *out_dir, char **err) {
    enum tmx_status st = TMX_OK;
    for (size_t i = 0; st == TMX_OK && i < sizeof kept_files / sizeof *kept_files; i++) {
        char from[4096], to[4096];
        snprintf(from, sizeof from, "%s/%s", in_dir, kept_files[i]);
        snprintf(to, sizeof to, "%s/%s", out_dir, kept_files[i]);
        if (access(from, F_OK) == 0) st = copy_file(from, to, err);
    }
    return st;
}
