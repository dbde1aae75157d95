/* pack.c: tmx pack, the per-rank layout of a TrellisMX build (tmx/pack.h, docs/tp.md).
 *
 * The source is verified against its manifest first; then every file of it is copied (the
 * non-expert files to OUT and, as hard links, to every rank folder; coupled/ to every rank
 * folder) or cut (experts/, one cut per rank). A copy is known good when it has the source
 * file's size and hash; a cut file when it has the size and hash OUT/tmx-pack.log recorded for
 * it; either is kept on a rerun. OUT must be new, empty or such an earlier run, and must not be
 * CHECKPOINT or lie inside it: the log claims every file before it is written, and a file OUT
 * holds that no run claimed is never replaced. --full-closure then opens every layer through
 * the codec, whole from the source and as each rank's pack, and compares every decoded slice
 * with the same slice of the whole decode. */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tmx/config.h"
#include "tmx/fs.h"
#include "tmx/loader.h"
#include "tmx/manifest.h"
#include "tmx/model.h"
#include "tmx/pack.h"
#include "tmx/plugin.h"
#include "tmx/safetensors.h"
#include "trellis.h"

#define HEX_LEN 64
#define LOG_NAME "tmx-pack.log"

static const char *const proj_name[3] = {"gate_proj", "up_proj", "down_proj"};

/* --- files --------------------------------------------------------------------------------- */

/* Makes the folders above `path` (its last part is a file). */
static enum tmx_status make_parents(const char *path, char **err) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST)
            return tmx_err(err, TMX_ERR_IO, "%s: %s", buf, strerror(errno));
        *s = '/';
    }
    return TMX_OK;
}

/* dst <- src, through dst.tmp: a hard link when `link_ok`, else (or when linking fails) a copy. */
static enum tmx_status copy_file(const char *src, const char *dst, int link_ok, char **err) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", dst);
    unlink(tmp);
    enum tmx_status st = make_parents(dst, err);
    if (st == TMX_OK && !(link_ok && link(src, tmp) == 0)) {
        FILE *in = fopen(src, "rb"), *out = in ? fopen(tmp, "wb") : NULL;
        char buf[1 << 16];
        size_t n;
        if (!in || !out) st = tmx_err(err, TMX_ERR_IO, "%s: %s", in ? tmp : src, strerror(errno));
        while (st == TMX_OK && (n = fread(buf, 1, sizeof buf, in)) > 0)
            if (fwrite(buf, 1, n, out) != n)
                st = tmx_err(err, TMX_ERR_IO, "%s: %s", tmp, strerror(errno));
        if (st == TMX_OK && ferror(in)) st = tmx_err(err, TMX_ERR_IO, "%s: read error", src);
        if (out && fclose(out) != 0 && st == TMX_OK)
            st = tmx_err(err, TMX_ERR_IO, "%s: %s", tmp, strerror(errno));
        if (in) fclose(in);
    }
    if (st == TMX_OK && rename(tmp, dst) != 0)
        st = tmx_err(err, TMX_ERR_IO, "%s: %s", dst, strerror(errno));
    if (st != TMX_OK) unlink(tmp);
    return st;
}

/* Whether `path` exists with this size and SHA-256. */
static int intact(const char *path, int64_t size, const char *sha) {
    struct stat sb;
    char hex[HEX_LEN + 1];
    return stat(path, &sb) == 0 && sb.st_size == size && tmx_manifest_sha256_file(path, hex, NULL) == TMX_OK &&
           strcmp(hex, sha) == 0;
}

static enum tmx_status write_json(json_t *root, const char *path, char **err) {
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return tmx_err(err, TMX_ERR_INVALID, "%s: path too long", path);
    if (!root || json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0 ||
        rename(tmp, path) != 0) {
        unlink(tmp);
        return tmx_err(err, TMX_ERR_IO, "%s: cannot write", path);
    }
    return TMX_OK;
}

/* --- the source ---------------------------------------------------------------------------- */

struct entry {
    char *path;
    int64_t size;
    char sha[HEX_LEN + 1];
};

struct entries {
    struct entry *e;
    int n, cap;
};

static void entries_free(struct entries *l) {
    for (int i = 0; i < l->n; i++) free(l->e[i].path);
    free(l->e);
}

static enum tmx_status entries_add(struct entries *l, const char *path, int64_t size,
                                   const char *sha, char **err) {
    if (l->n == l->cap) {
        struct entry *p = realloc(l->e, (size_t)(l->cap = l->cap ? 2 * l->cap : 64) * sizeof *p);
        if (!p) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        l->e = p;
    }
    struct entry *e = &l->e[l->n];
    if (!(e->path = strdup(path))) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    e->size = size;
    snprintf(e->sha, sizeof e->sha, "%s", sha);
    l->n++;
    return TMX_OK;
}

static const struct entry *entries_find(const struct entries *l, const char *path) {
    for (int i = l->n - 1; i >= 0; i--) /* the latest record of a path counts */
        if (strcmp(l->e[i].path, path) == 0) return &l->e[i];
    return NULL;
}

/* The manifest's "files" (already verified, so well formed) and the manifest's own hash. */
static enum tmx_status read_manifest(const char *dir, struct entries *files,
                                     char digest[HEX_LEN + 1], char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    json_error_t je;
    json_t *m = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!m) return tmx_err(err, TMX_ERR_INVALID, "%s: %s", path, je.text);
    enum tmx_status st = tmx_manifest_sha256_file(path, digest, err);
    size_t i;
    json_t *f;
    json_array_foreach(json_object_get(m, "files"), i, f) {
        if (st != TMX_OK) break;
        st = entries_add(files, json_string_value(json_object_get(f, "path")),
                         json_integer_value(json_object_get(f, "size")),
                         json_string_value(json_object_get(f, "sha256")), err);
    }
    json_decref(m);
    return st;
}

/* What the cuts need: the layer geometry of config.json and hf_quant_config.json. */
struct geom {
    int64_t inter, latent, part; /* moe_intermediate_size, moe_latent_size, inter / tp */
    int words, block;            /* 32-bit words per tile (8K), block-scale group */
    char codec[64];
};

static enum tmx_status read_geom(const char *dir, int tp, struct tmx_model_config *mc,
                                 struct geom *g, char **err) {
    enum tmx_status st = tmx_model_config_load(dir, mc, err);
    if (st != TMX_OK) return st;
    struct tmx_quant_config q;
    if ((st = tmx_quant_config_load(dir, &q, err)) != TMX_OK) return st;
    if (!q.present || !*q.codec || q.bits < 2 || q.bits > 6 ||
        (q.block_size != 16 && q.block_size != 32))
        st = tmx_err(err, TMX_ERR_INVALID, "%s: not a TrellisMX hf_quant_config.json (\"codec\", "
                     "\"bits\" 2..6 and \"block_size\" 16 or 32 are needed)", q.path);
    if (st == TMX_OK) {
        *g = (struct geom){.inter = mc->moe_intermediate_size, .latent = mc->moe_latent_size,
                           .part = mc->moe_intermediate_size / tp, .words = 8 * q.bits,
                           .block = q.block_size};
        snprintf(g->codec, sizeof g->codec, "%s", q.codec);
        if (g->inter <= 0 || g->inter % (tp * TMX_TRELLIS_HADAMARD))
            st = tmx_err(err, TMX_ERR_INVALID, "%s/config.json: moe_intermediate_size = %lld does "
                         "not split into tp = %d slices of whole 128-wide Hadamard blocks", dir,
                         (long long)g->inter, tp);
    }
    return st;
}

/* --- cutting an experts/ file -------------------------------------------------------------- */

/* Rank r's CSF tensors of one projection: the planes decoded, cut and encoded again. */
struct csf_cut {
    uint8_t *fixed;      /* [E][csf_fixed_size(rows', cols')] */
    uint32_t *exc;       /* [n_exc] */
    int32_t *starts;     /* [E + 1] */
    int64_t n_exc, fixed_size;
};

static enum tmx_status check_shape(const char *path, const char *name, const struct tmx_tensor *t,
                                   enum tmx_dtype dtype, int ndim, const int64_t *shape,
                                   char **err) {
    int ok = t->dtype == dtype && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || t->shape[i] == shape[i];
    return ok ? TMX_OK : tmx_err(err, TMX_ERR_INVALID, "%s: tensor %s does not have the dtype "
                                 "and shape config.json and hf_quant_config.json imply", path,
                                 name);
}

static enum tmx_status cut_csf(const struct tmx_safetensors *sf, const char *path, int p,
                               int64_t n_exp, const struct geom *g, int rank, struct csf_cut *c,
                               char **err) {
    const int64_t rows = p < 2 ? g->inter : g->latent, cols = (p < 2 ? g->latent : g->inter) /
                                                              g->block;
    const int64_t rows2 = p < 2 ? g->part : g->latent, cols2 = (p < 2 ? g->latent : g->part) /
                                                               g->block;
    const int64_t r0 = p < 2 ? g->part * rank : 0, c0 = p < 2 ? 0 : g->part * rank / g->block;
    struct tmx_tensor fixed, exc, starts;
    char name[3][64];
    snprintf(name[0], sizeof name[0], "%s.scale_csf", proj_name[p]);
    snprintf(name[1], sizeof name[1], "%s.scale_csf_exceptions", proj_name[p]);
    snprintf(name[2], sizeof name[2], "%s.scale_csf_starts", proj_name[p]);
    if (tmx_safetensors_find(sf, name[0], &fixed) || tmx_safetensors_find(sf, name[1], &exc) ||
        tmx_safetensors_find(sf, name[2], &starts))
        return tmx_err(err, TMX_ERR_INVALID, "%s: the %s.scale_csf tensors are incomplete", path,
                       proj_name[p]);
    const int64_t fs = tmx_trellis_csf_fixed_size(rows, cols), n1 = n_exp + 1;
    enum tmx_status st = check_shape(path, name[0], &fixed, TMX_DTYPE_U8, 2,
                                     (int64_t[]){n_exp, fs}, err);
    if (st == TMX_OK)
        st = check_shape(path, name[1], &exc, TMX_DTYPE_I32, 1, (int64_t[]){-1}, err);
    if (st == TMX_OK) st = check_shape(path, name[2], &starts, TMX_DTYPE_I32, 1, &n1, err);
    char what[4300];
    snprintf(what, sizeof what, "%s: %s", path, name[2]);
    const int32_t *s = starts.data;
    if (st == TMX_OK) st = tmx_trellis_csf_check_starts(what, s, n_exp, exc.shape[0], err);
    if (st != TMX_OK) return st;
    c->fixed_size = tmx_trellis_csf_fixed_size(rows2, cols2);
    uint8_t *plane = malloc((size_t)(rows * cols)), *cut = malloc((size_t)(rows2 * cols2));
    c->fixed = malloc((size_t)(n_exp * c->fixed_size));
    c->starts = malloc((size_t)n1 * sizeof *c->starts);
    if (!plane || !cut || !c->fixed || !c->starts)
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    else
        c->starts[0] = 0;
    for (int64_t e = 0; st == TMX_OK && e < n_exp; e++) {
        snprintf(what, sizeof what, "%s: %s of expert %lld", path, name[0], (long long)e);
        st = tmx_trellis_csf_decode(what, (const uint8_t *)fixed.data + e * fs, fs,
                                    (const uint32_t *)exc.data + s[e], s[e + 1] - s[e], rows,
                                    cols, plane, err);
        for (int64_t r = 0; st == TMX_OK && r < rows2; r++)
            memcpy(cut + r * cols2, plane + (r0 + r) * cols + c0, (size_t)cols2);
        uint32_t *x = NULL;
        int64_t nx = 0;
        if (st == TMX_OK)
            st = tmx_trellis_csf_encode(cut, rows2, cols2, c->fixed + e * c->fixed_size, &x, &nx,
                                        err);
        if (st == TMX_OK && nx > 0) {
            uint32_t *grown = realloc(c->exc, (size_t)(c->n_exc + nx) * sizeof *grown);
            if (!grown) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
            else memcpy((c->exc = grown) + c->n_exc, x, (size_t)nx * sizeof *x);
        }
        free(x);
        c->n_exc += nx;
        c->starts[e + 1] = (int32_t)c->n_exc;
    }
    free(plane);
    free(cut);
    return st;
}

/* Rank `rank`'s cut of experts/ file src, written to dst in the same tensor order and with the
 * same metadata: gate and up keep tile rows [i0/16, (i0 + part)/16), down tile columns, each
 * with its block scales. */
static enum tmx_status cut_experts(const char *src, const char *dst, const struct geom *g,
                                   int rank, char **err) {
    struct tmx_safetensors *sf;
    enum tmx_status st = tmx_safetensors_open(src, &sf, err);
    if (st != TMX_OK) return st;
    static const char *const keys[5] = {"format", "trellismx_version", "layer", "first_expert",
                                        "last_expert"};
    const char *meta[11] = {0};
    for (int i = 0; st == TMX_OK && i < 5; i++)
        if (!(meta[2 * i + 1] = tmx_safetensors_meta(sf, keys[i])))
            st = tmx_err(err, TMX_ERR_INVALID, "%s: __metadata__ \"%s\" is missing", src, keys[i]);
        else
            meta[2 * i] = keys[i];
    const size_t n = tmx_safetensors_count(sf);
    const char **names = calloc(n ? n : 1, sizeof *names);
    struct tmx_tensor *out = calloc(n ? n : 1, sizeof *out);
    void **owned = calloc(n ? n : 1, sizeof *owned);
    struct csf_cut csf[3] = {{0}};
    int have_csf[3] = {0};
    if (st == TMX_OK && (!names || !out || !owned))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    struct tmx_tensor gate;
    int64_t n_exp = 0;
    if (st == TMX_OK && tmx_safetensors_find(sf, "gate_proj.trellis", &gate) == 0 &&
        gate.ndim == 4)
        n_exp = gate.shape[0];
    else if (st == TMX_OK)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: tensor gate_proj.trellis is missing", src);
    const int64_t i0 = g->part * rank;
    for (size_t i = 0; st == TMX_OK && i < n; i++) {
        struct tmx_tensor t;
        const char *name = names[i] = tmx_safetensors_at(sf, i, &t);
        const char *dot = strchr(name, '.');
        int p = 0;
        while (p < 3 && !(dot && (size_t)(dot - name) == strlen(proj_name[p]) &&
                          strncmp(name, proj_name[p], (size_t)(dot - name)) == 0))
            p++;
        if (p == 3) {
            st = tmx_err(err, TMX_ERR_INVALID, "%s: unexpected tensor %s", src, name);
            break;
        }
        const char *suffix = dot + 1;
        const int64_t rows = p < 2 ? g->inter : g->latent, cols = p < 2 ? g->latent : g->inter;
        if (strcmp(suffix, "trellis") == 0) {
            const int64_t tr = rows / 16, tc = cols / 16, w = g->words;
            if ((st = check_shape(src, name, &t, TMX_DTYPE_I32, 4,
                                  (int64_t[]){n_exp, tr, tc, w}, err)))
                break;
            /* gate, up: [E][part/16][latent/16][w]; down: [E][latent/16][part/16][w] */
            const int64_t tr2 = p < 2 ? g->part / 16 : tr, tc2 = p < 2 ? tc : g->part / 16;
            uint32_t *dstw = owned[i] = malloc((size_t)(n_exp * tr2 * tc2 * w) * 4);
            if (!dstw) {
                st = tmx_err(err, TMX_ERR_NOMEM, "out of memory cutting %s", src);
                break;
            }
            const uint32_t *srcw = t.data;
            for (int64_t e = 0; e < n_exp; e++)
                for (int64_t r = 0; r < tr2; r++) /* one tile row's run of tiles */
                    memcpy(dstw + ((e * tr2 + r) * tc2) * w,
                           srcw + ((e * tr + r + (p < 2 ? i0 / 16 : 0)) * tc +
                                   (p < 2 ? 0 : i0 / 16)) * w,
                           (size_t)(tc2 * w) * 4);
            out[i] = (struct tmx_tensor){TMX_DTYPE_I32, 4, {n_exp, tr2, tc2, w}, dstw};
        } else if (strcmp(suffix, "scale") == 0) {
            if ((st = check_shape(src, name, &t, TMX_DTYPE_F32, 1, &n_exp, err))) break;
            out[i] = t;
        } else if (strncmp(suffix, "scale_csf", 9) == 0) {
            if (!have_csf[p]) {
                have_csf[p] = 1;
                if ((st = cut_csf(sf, src, p, n_exp, g, rank, &csf[p], err))) break;
            }
            if (strcmp(suffix, "scale_csf") == 0)
                out[i] = (struct tmx_tensor){TMX_DTYPE_U8, 2, {n_exp, csf[p].fixed_size},
                                             csf[p].fixed};
            else if (strcmp(suffix, "scale_csf_exceptions") == 0)
                out[i] = (struct tmx_tensor){TMX_DTYPE_I32, 1, {csf[p].n_exc}, csf[p].exc};
            else if (strcmp(suffix, "scale_csf_starts") == 0)
                out[i] = (struct tmx_tensor){TMX_DTYPE_I32, 1, {n_exp + 1}, csf[p].starts};
            else
                st = tmx_err(err, TMX_ERR_INVALID, "%s: unexpected tensor %s", src, name);
        } else {
            st = tmx_err(err, TMX_ERR_INVALID, "%s: unexpected tensor %s", src, name);
        }
    }
    if (st == TMX_OK) st = make_parents(dst, err);
    if (st == TMX_OK) st = tmx_safetensors_write(dst, (int)n, names, out, meta, err);
    for (size_t i = 0; owned && i < n; i++) free(owned[i]);
    for (int p = 0; p < 3; p++) {
        free(csf[p].fixed);
        free(csf[p].exc);
        free(csf[p].starts);
    }
    free(owned);
    free(out);
    free(names);
    tmx_safetensors_free(sf);
    return st;
}

/* --- the pack ------------------------------------------------------------------------------ */

struct packer {
    const struct tmx_pack_options *o;
    struct tmx_pack_report *rep;
    struct geom g;
    struct tmx_model_config mc;
    char digest[HEX_LEN + 1];     /* SHA-256 of the source's manifest */
    struct entries src, log;      /* the source's files; what tmx-pack.log records */
    FILE *logf;
    int64_t done, total;          /* "pack" progress, in source bytes */
};

static void progress(const struct packer *k, const char *phase, int64_t done, int64_t total) {
    if (k->o->progress) k->o->progress(k->o->progress_arg, phase, done, total);
}

/* OUT/tmx-pack.log: a header naming tp and the source's manifest, then "writing PATH" before
 * each file is written and "SHA SIZE PATH" after each file cut. A log of another tp or source
 * means OUT is not this pack: refused. *found: whether OUT has a log. */
static enum tmx_status read_log(struct packer *k, int *found, char **err) {
    char path[4096], line[4600], header[160];
    snprintf(path, sizeof path, "%s/%s", k->o->out, LOG_NAME);
    snprintf(header, sizeof header, "tmx-pack tp=%d source=%s\n", k->o->tp, k->digest);
    FILE *f = fopen(path, "r");
    if (!(*found = f != NULL))
        return errno == ENOENT || errno == ENOTDIR ? TMX_OK : tmx_err(err, TMX_ERR_IO, "%s: %s",
                                                                      path, strerror(errno));
    enum tmx_status st = TMX_OK;
    if (!fgets(line, sizeof line, f) || strcmp(line, header) != 0)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: %s holds a pack of another checkpoint or "
                     "another tp (this one: tp = %d, source manifest %.12s...); use an empty "
                     "folder", path, k->o->out, k->o->tp, k->digest);
    while (st == TMX_OK && fgets(line, sizeof line, f)) {
        char sha[HEX_LEN + 1], rel[4096];
        long long size;
        line[strcspn(line, "\n")] = 0;
        if (sscanf(line, "%64s %lld %4095s", sha, &size, rel) == 3 && strlen(sha) == HEX_LEN)
            st = entries_add(&k->log, rel, size, sha, err);
        else if (strncmp(line, "writing ", 8) == 0) /* size -1: never intact */
            st = entries_add(&k->log, line + 8, -1, "", err);
    }
    fclose(f);
    return st;
}

static enum tmx_status open_log(struct packer *k, int found, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", k->o->out, LOG_NAME);
    if (!(k->logf = fopen(path, "a")))
        return tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
    if (!found) fprintf(k->logf, "tmx-pack tp=%d source=%s\n", k->o->tp, k->digest);
    fflush(k->logf);
    return TMX_OK;
}

static int under(const char *path, const char *folder) {
    return strncmp(path, folder, strlen(folder)) == 0;
}

enum kind { FOREIGN, DATA, META, TEMP };

/* What OUT/rel is to this pack: a file it copies or cuts (*want: the source's entry for a
 * copy, NULL for a cut), one it makes (index, manifest, log), the temporary name of either, or
 * none of these. */
static enum kind kind_of(const struct packer *k, const char *rel, const struct entry **want) {
    const size_t n = strlen(rel);
    if (n > 4 && strcmp(rel + n - 4, ".tmp") == 0) {
        char base[4096];
        snprintf(base, sizeof base, "%.*s", (int)(n - 4), rel);
        return kind_of(k, base, want) == FOREIGN ? FOREIGN : TEMP;
    }
    const char *in = rel;
    int rank = -1, r, at = 0;
    if (sscanf(rel, "rank-%d/%n", &r, &at) == 1 && at > 0) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "rank-%d/", r);
        if (r < 0 || r >= k->o->tp || strncmp(rel, prefix, strlen(prefix)) != 0) return FOREIGN;
        rank = r;
        in = rel + at;
    }
    if (strcmp(in, TMX_PACK_NAME) == 0 || (rank >= 0 && strcmp(in, TMX_MANIFEST_NAME) == 0) ||
        (rank < 0 && strcmp(in, LOG_NAME) == 0))
        return META;
    const struct entry *e = entries_find(&k->src, in);
    if (!e || (rank < 0 && (under(in, "experts/") || under(in, "coupled/")))) return FOREIGN;
    *want = rank >= 0 && under(in, "experts/") ? NULL : e;
    return DATA;
}

/* Every file under OUT/rel must be this pack's: one an earlier run wrote (its log has the path)
 * or one it would write as it is; leftover temporary files go. */
static enum tmx_status check_files(struct packer *k, const char *rel, char **err) {
    char dir[4096];
    snprintf(dir, sizeof dir, rel ? "%s/%s" : "%s", k->o->out, rel);
    DIR *d = opendir(dir);
    if (!d) return tmx_err(err, TMX_ERR_IO, "%s: %s", dir, strerror(errno));
    enum tmx_status st = TMX_OK;
    for (struct dirent *de; st == TMX_OK && (de = readdir(d));) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        char sub[4096], full[4200];
        if (rel) snprintf(sub, sizeof sub, "%s/%s", rel, de->d_name);
        else snprintf(sub, sizeof sub, "%s", de->d_name);
        snprintf(full, sizeof full, "%s/%s", k->o->out, sub);
        struct stat sb;
        const struct entry *want = NULL;
        if (lstat(full, &sb) != 0) {
            st = tmx_err(err, TMX_ERR_IO, "%s: %s", full, strerror(errno));
        } else if (S_ISDIR(sb.st_mode)) {
            st = check_files(k, sub, err);
        } else {
            const enum kind kind = kind_of(k, sub, &want);
            if (kind == TEMP && unlink(full) != 0)
                st = tmx_err(err, TMX_ERR_IO, "%s: %s", full, strerror(errno));
            else if (kind == FOREIGN || (kind == DATA && !entries_find(&k->log, sub) &&
                                         !(want && intact(full, want->size, want->sha))))
                st = tmx_err(err, TMX_ERR_INVALID, "%s: holds %s, which no earlier run of this "
                             "tmx pack wrote; move it away or use an empty folder", k->o->out,
                             sub);
        }
    }
    closedir(d);
    return st;
}

/* OUT must be new, empty, or an earlier run of this pack holding nothing else (`logged`: it
 * has the run's tmx-pack.log): no file is replaced that tmx pack did not write. */
static enum tmx_status check_out(struct packer *k, int logged, char **err) {
    const char *out = k->o->out;
    DIR *d = opendir(out);
    if (!d)
        return errno == ENOENT ? TMX_OK : tmx_err(err, TMX_ERR_IO, "%s: %s", out,
                                                  strerror(errno));
    int empty = 1;
    enum tmx_status st = TMX_OK;
    for (struct dirent *de; empty && (de = readdir(d));) {
        empty = strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0;
        if (!empty && !logged)
            st = tmx_err(err, TMX_ERR_INVALID, "%s: holds %s but no %s of an earlier tmx pack; "
                         "tmx pack writes into a new or empty folder", out, de->d_name, LOG_NAME);
    }
    closedir(d);
    return st == TMX_OK && !empty ? check_files(k, NULL, err) : st;
}

/* One output file, rel under OUT: kept when intact (against `want`, or the log when NULL),
 * else made by cutting (cut_rank >= 0) or copying `from`. */
static enum tmx_status produce(struct packer *k, const char *rel, const struct entry *want,
                               const char *from, int link_ok, int cut_rank, int64_t units,
                               char **err) {
    char dst[4096];
    snprintf(dst, sizeof dst, "%s/%s", k->o->out, rel);
    const struct entry *rec = want ? want : entries_find(&k->log, rel);
    enum tmx_status st = TMX_OK;
    if (rec && intact(dst, rec->size, rec->sha)) {
        k->rep->kept++;
    } else {
        /* claimed first: a rerun after a crash knows the file as this pack's */
        if (fprintf(k->logf, "writing %s\n", rel) < 0 || fflush(k->logf) != 0)
            st = tmx_err(err, TMX_ERR_IO, "%s/%s: cannot write", k->o->out, LOG_NAME);
        if (st == TMX_OK)
            st = cut_rank >= 0 ? cut_experts(from, dst, &k->g, cut_rank, err)
                               : copy_file(from, dst, link_ok, err);
        struct stat sb;
        char hex[HEX_LEN + 1];
        if (st == TMX_OK && stat(dst, &sb) != 0)
            st = tmx_err(err, TMX_ERR_IO, "%s: %s", dst, strerror(errno));
        if (st == TMX_OK) st = tmx_manifest_sha256_file(dst, hex, err);
        if (st == TMX_OK && want && strcmp(hex, want->sha) != 0)
            st = tmx_err(err, TMX_ERR_IO, "%s: the copy differs from %s", dst, from);
        if (st == TMX_OK && !want) {
            fprintf(k->logf, "%s %lld %s\n", hex, (long long)sb.st_size, rel);
            fflush(k->logf);
        }
        if (st == TMX_OK) k->rep->written++;
    }
    k->done += units;
    progress(k, "pack", k->done, k->total);
    return st;
}

/* Every file of the source into OUT and the rank folders. */
static enum tmx_status pack_files(struct packer *k, char **err) {
    const int tp = k->o->tp;
    for (int i = 0; i < k->src.n; i++)
        k->total += k->src.e[i].size * (under(k->src.e[i].path, "experts/") ||
                                        under(k->src.e[i].path, "coupled/") ? tp : tp + 1);
    enum tmx_status st = TMX_OK;
    char from[4096], rel[4200], top[4096];
    for (int i = 0; st == TMX_OK && i < k->src.n; i++) {
        const struct entry *e = &k->src.e[i];
        const int experts = under(e->path, "experts/"), shared = !experts &&
                                                                  !under(e->path, "coupled/");
        snprintf(from, sizeof from, "%s/%s", k->o->checkpoint, e->path);
        snprintf(top, sizeof top, "%s/%s", k->o->out, e->path);
        if (shared) st = produce(k, e->path, e, from, 0, -1, e->size, err);
        for (int r = 0; st == TMX_OK && r < tp; r++) {
            snprintf(rel, sizeof rel, "rank-%d/%s", r, e->path);
            st = produce(k, rel, experts ? NULL : e, shared ? top : from, shared,
                         experts ? r : -1, e->size, err);
        }
    }
    return st;
}

/* rank-R/tmx-pack.json, then rank-R/trellismx-manifest.json over the whole folder. */
static enum tmx_status finish_rank(struct packer *k, int r, json_t *ranks, char **err) {
    char dir[4096], path[4200], hex[HEX_LEN + 1];
    snprintf(dir, sizeof dir, "%s/rank-%d", k->o->out, r);
    snprintf(path, sizeof path, "%s/%s", dir, TMX_PACK_NAME);
    json_t *j = json_pack("{s:s, s:i, s:i, s:i, s:s, s:s, s:I, s:[I, I]}", "format", "tmx-pack",
                          "version", 1, "tp", k->o->tp, "rank", r, "codec", k->g.codec,
                          "source_manifest_sha256", k->digest, "moe_intermediate_size",
                          (json_int_t)k->g.inter, "intermediate_rows",
                          (json_int_t)(k->g.part * r), (json_int_t)(k->g.part * (r + 1)));
    enum tmx_status st = write_json(j, path, err);
    json_decref(j);
    if (st == TMX_OK) st = tmx_manifest_write(dir, err);
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    if (st == TMX_OK) st = tmx_manifest_sha256_file(path, hex, err);
    char name[32];
    snprintf(name, sizeof name, "rank-%d", r);
    if (st == TMX_OK)
        json_array_append_new(ranks, json_pack("{s:i, s:s, s:s}", "rank", r, "path", name,
                                               "manifest_sha256", hex));
    return st;
}

/* --- full closure -------------------------------------------------------------------------- */

/* The first element where a decoded slice differs from the whole decode's, or -1. */
static int64_t compare_slice(const float *whole, const float *slice, int p, const struct geom *g,
                             int rank) {
    const int64_t i0 = g->part * rank;
    if (p < 2) { /* rows [i0, i0 + part) of [inter][latent] */
        const float *w = whole + i0 * g->latent;
        for (int64_t i = 0; i < g->part * g->latent; i++)
            if (memcmp(&w[i], &slice[i], sizeof *w)) return i;
        return -1;
    }
    for (int64_t r = 0; r < g->latent; r++) /* columns [i0, i0 + part) of [latent][inter] */
        for (int64_t c = 0; c < g->part; c++)
            if (memcmp(&whole[r * g->inter + i0 + c], &slice[r * g->part + c], sizeof *whole))
                return r * g->part + c;
    return -1;
}

static enum tmx_status full_closure(struct packer *k, char **err) {
    const struct tmx_pack_options *o = k->o;
    const struct geom *g = &k->g;
    struct tmx_config *cfg = NULL;
    struct tmx_plugins *ps = NULL;
    const struct tmx_plugin *plugin = NULL;
    const struct tmx_codec_i *ops = NULL;
    void *ctx = NULL;
    int started = 0;
    enum tmx_status st = tmx_config_load(NULL, &cfg, err);
    for (int i = 0; st == TMX_OK && i < o->n_overrides; i++)
        st = tmx_config_set(cfg, o->overrides[i], err);
    if (st == TMX_OK) st = tmx_plugins_new(cfg, &ps, err);
    if (st == TMX_OK) st = tmx_plugins_load(ps, TMX_PLUGIN_CODEC, g->codec, &plugin, err);
    if (st == TMX_OK && !TMX_OPS_HAS((ops = plugin->ops), layer_load_slice))
        st = tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s cannot open a rank's slice "
                     "(no layer_load_slice op)", g->codec);
    if (st == TMX_OK) {
        st = ops->init(tmx_host_get(), tmx_plugins_opts(ps, plugin), &ctx, err);
        if (st != TMX_OK) ops->fini(ctx); /* safe after a failed init */
        started = st == TMX_OK;
    }
    const int tp = o->tp, E = k->mc.n_routed_experts;
    int n_moe = 0, n_done = 0;
    for (int l = 0; l < k->mc.n_layers; l++) n_moe += !k->mc.dense[l];
    void **slices = calloc((size_t)tp, sizeof *slices);
    float *whole = malloc((size_t)(g->inter * g->latent) * sizeof *whole);
    float *part = malloc((size_t)(g->part * g->latent) * sizeof *part);
    if (st == TMX_OK && (!slices || !whole || !part))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    char dir[4096];
    for (int l = 0; st == TMX_OK && l < k->mc.n_layers; l++) {
        if (k->mc.dense[l]) continue;
        void *layer = NULL;
        struct tmx_codec_layer_info info = {o->checkpoint, l, E, (int)g->latent, (int)g->inter};
        st = ops->layer_load(ctx, &info, &layer, err);
        for (int r = 0; st == TMX_OK && r < tp; r++) {
            snprintf(dir, sizeof dir, "%s/rank-%d", o->out, r);
            info.model_dir = dir;
            st = ops->layer_load_slice(ctx, &info, r, tp, &slices[r], err);
        }
        for (int e = 0; st == TMX_OK && e < E; e++)
            for (int p = 0; st == TMX_OK && p < 3; p++) {
                st = ops->expert_decode(ctx, layer, e, p, whole, err);
                for (int r = 0; st == TMX_OK && r < tp; r++) {
                    st = ops->expert_decode(ctx, slices[r], e, p, part, err);
                    const int64_t at = st == TMX_OK ? compare_slice(whole, part, p, g, r) : -1;
                    if (at >= 0)
                        st = tmx_err(err, TMX_ERR_INVALID, "full closure: %s/rank-%d: layer %d, "
                                     "expert %d, %s: element %lld of the decoded slice differs "
                                     "from the unsplit decode", o->out, r, l, e, proj_name[p],
                                     (long long)at);
                    if (st == TMX_OK) k->rep->slices_checked++;
                }
            }
        for (int r = 0; r < tp; r++) {
            if (slices[r]) ops->layer_free(ctx, slices[r]);
            slices[r] = NULL;
        }
        if (layer) ops->layer_free(ctx, layer);
        progress(k, "closure", ++n_done, n_moe);
    }
    free(slices);
    free(whole);
    free(part);
    if (started) ops->fini(ctx);
    tmx_plugins_free(ps);
    tmx_config_free(cfg);
    return st;
}

enum tmx_status tmx_pack(const struct tmx_pack_options *o, struct tmx_pack_report *report,
                         char **err) {
    struct tmx_pack_report unused;
    struct packer k = {.o = o, .rep = report ? report : &unused};
    *k.rep = (struct tmx_pack_report){0};
    if (o->tp < 1 || o->tp > 4096)
        return tmx_err(err, TMX_ERR_INVALID, "--tp %d: the ranks must be 1..4096", o->tp);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", o->checkpoint, TMX_MANIFEST_NAME);
    if (access(path, F_OK) != 0)
        return tmx_err(err, TMX_ERR_NOT_FOUND, "%s: missing; tmx pack reads a TrellisMX build "
                       "made by tmx quantize", path);
    const int inside = tmx_path_within(o->out, o->checkpoint);
    if (inside != 0)
        return inside < 0 ? tmx_err(err, TMX_ERR_IO, "%s: %s", o->out, strerror(errno))
                          : tmx_err(err, TMX_ERR_INVALID, "%s: OUT is the checkpoint %s or lies "
                                    "inside it; tmx pack writes into another folder", o->out,
                                    o->checkpoint);
    progress(&k, "verify", 0, 1);
    enum tmx_status st = tmx_manifest_verify(o->checkpoint, 1, err);
    if (st == TMX_OK) progress(&k, "verify", 1, 1);
    if (st == TMX_OK) st = read_geom(o->checkpoint, o->tp, &k.mc, &k.g, err);
    if (st == TMX_OK) st = read_manifest(o->checkpoint, &k.src, k.digest, err);
    int logged = 0;
    if (st == TMX_OK) st = read_log(&k, &logged, err);
    if (st == TMX_OK) st = check_out(&k, logged, err);
    snprintf(path, sizeof path, "%s/%s", o->out, LOG_NAME);
    if (st == TMX_OK) st = make_parents(path, err);
    if (st == TMX_OK) st = open_log(&k, logged, err);
    if (st == TMX_OK) st = pack_files(&k, err);
    json_t *ranks = json_array();
    for (int r = 0; st == TMX_OK && r < o->tp; r++) st = finish_rank(&k, r, ranks, err);
    if (st == TMX_OK) {
        json_t *index = json_pack("{s:s, s:i, s:i, s:s, s:s, s:O}", "format", "tmx-pack",
                                  "version", 1, "tp", o->tp, "codec", k.g.codec,
                                  "source_manifest_sha256", k.digest, "ranks", ranks);
        snprintf(path, sizeof path, "%s/%s", o->out, TMX_PACK_NAME);
        st = write_json(index, path, err);
        json_decref(index);
    }
    json_decref(ranks);
    if (st == TMX_OK && o->full_closure) st = full_closure(&k, err);
    if (k.logf) fclose(k.logf);
    entries_free(&k.src);
    entries_free(&k.log);
    return st;
}

/* --- loading ------------------------------------------------------------------------------- */

enum tmx_status tmx_pack_rank_dir(const char *dir, int rank, int n_ranks, char **rank_dir,
                                  char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TMX_PACK_NAME);
    json_t *j = NULL;
    enum tmx_status st = TMX_OK;
    if (access(path, F_OK) == 0) {
        json_error_t je;
        if (!(j = json_load_file(path, JSON_REJECT_DUPLICATES, &je)))
            return tmx_err(err, TMX_ERR_INVALID, "%s: %s", path, je.text);
    }
    /* a rank folder itself (its codec checks the rank), or no pack at all */
    if (!j || json_object_get(j, "rank")) {
        json_decref(j);
        return (*rank_dir = strdup(dir)) ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    const json_t *tp = json_object_get(j, "tp");
    if (!json_is_integer(tp) || !json_is_array(json_object_get(j, "ranks")))
        st = tmx_err(err, TMX_ERR_INVALID, "%s: not a tmx pack index (\"tp\" and \"ranks\" are "
                     "needed)", path);
    else if (json_integer_value(tp) != n_ranks)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: a pack for tp = %lld, loaded at tp = %d (run it "
                     "with --tp %lld)", path, (long long)json_integer_value(tp), n_ranks,
                     (long long)json_integer_value(tp));
    json_decref(j);
    if (st != TMX_OK) return st;
    if (asprintf(rank_dir, "%s/rank-%d", dir, rank) < 0)
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if ((st = tmx_manifest_verify(*rank_dir, 0, err)) != TMX_OK) {
        free(*rank_dir);
        *rank_dir = NULL;
    }
    return st;
}
