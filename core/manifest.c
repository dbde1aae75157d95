/* manifest.c: trellismx-manifest.json (docs/trellismx.md §10.6), written from a build folder
 * and checked against it.
 *
 * Integrity is by file: size (cheap, always checked) and SHA-256 (OpenSSL libcrypto). The
 * layers section adds the structure a reader relies on without opening every file: which
 * chunk file holds which experts, and the hashes of each layer's coupled sign vectors. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tmx/manifest.h"
#include "tmx/model.h"
#include "tmx/safetensors.h"

#define HEX_LEN 64 /* SHA-256 in lower-case hex */

static const char *const vector_names[3] = {"sign_latent_in", "sign_intermediate",
                                            "sign_latent_out"};

/* --- hashing ------------------------------------------------------------------------------- */

static void to_hex(const unsigned char *md, char out[HEX_LEN + 1]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
}

static enum tmx_status sha256_bytes(const void *p, size_t n, char out[HEX_LEN + 1], char **err) {
    unsigned char md[EVP_MAX_MD_SIZE];
    if (!EVP_Digest(p, n, md, NULL, EVP_sha256(), NULL))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "libcrypto: SHA-256 failed");
    to_hex(md, out);
    return TMX_OK;
}

enum tmx_status tmx_manifest_sha256_file(const char *path, char out[65], char **err) {
    enum { CHUNK = 1 << 20 };
    int fd = open(path, O_RDONLY);
    if (fd < 0) return tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char *buf = malloc(CHUNK), md[EVP_MAX_MD_SIZE];
    enum tmx_status st = TMX_OK;
    if (!ctx || !buf || !EVP_DigestInit_ex(ctx, EVP_sha256(), NULL))
        st = tmx_err(err, TMX_ERR_NOMEM, "%s: cannot start SHA-256", path);
    for (ssize_t n; st == TMX_OK && (n = read(fd, buf, CHUNK)) != 0;) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) st = tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
        else if (!EVP_DigestUpdate(ctx, buf, (size_t)n))
            st = tmx_err(err, TMX_ERR_UNSUPPORTED, "libcrypto: SHA-256 failed");
    }
    if (st == TMX_OK && !EVP_DigestFinal_ex(ctx, md, NULL))
        st = tmx_err(err, TMX_ERR_UNSUPPORTED, "libcrypto: SHA-256 failed");
    if (st == TMX_OK) to_hex(md, out);
    EVP_MD_CTX_free(ctx);
    free(buf);
    close(fd);
    return st;
}

/* --- the files of a build ------------------------------------------------------------------ */

struct file_list {
    char **path; /* [n] relative, '/'-separated, sorted after list_files */
    size_t n, cap;
};

static void file_list_free(struct file_list *fl) {
    for (size_t i = 0; i < fl->n; i++) free(fl->path[i]);
    free(fl->path);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Appends the files under root/rel (rel NULL: root itself) to fl, recursively; the manifest
 * itself is left out. Links are followed; anything but files and folders is an error. */
static enum tmx_status list_files(const char *root, const char *rel, struct file_list *fl,
                                  char **err) {
    char dirpath[4096];
    snprintf(dirpath, sizeof dirpath, rel ? "%s/%s" : "%s", root, rel);
    DIR *d = opendir(dirpath);
    if (!d) return errno == ENOENT && rel ? TMX_OK
                                          : tmx_err(err, TMX_ERR_IO, "%s: %s", dirpath,
                                                    strerror(errno));
    enum tmx_status st = TMX_OK;
    for (struct dirent *de; st == TMX_OK && (de = readdir(d));) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (!rel && strcmp(de->d_name, TMX_MANIFEST_NAME) == 0) continue;
        char *sub = NULL, full[4096];
        if (rel ? asprintf(&sub, "%s/%s", rel, de->d_name) < 0 : !(sub = strdup(de->d_name))) {
            closedir(d);
            return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        }
        snprintf(full, sizeof full, "%s/%s", root, sub);
        struct stat sb;
        if (stat(full, &sb) != 0) {
            st = tmx_err(err, TMX_ERR_IO, "%s: %s", full, strerror(errno));
        } else if (S_ISDIR(sb.st_mode)) {
            st = list_files(root, sub, fl, err);
        } else if (!S_ISREG(sb.st_mode)) {
            st = tmx_err(err, TMX_ERR_INVALID, "%s: not a file or folder", full);
        } else if (fl->n == fl->cap) {
            char **p = realloc(fl->path, (fl->cap = fl->cap ? 2 * fl->cap : 64) * sizeof *p);
            if (!p) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
            else fl->path = p;
        }
        if (st == TMX_OK && S_ISREG(sb.st_mode)) {
            fl->path[fl->n++] = sub;
            sub = NULL;
        }
        free(sub);
    }
    closedir(d);
    if (st == TMX_OK && !rel) qsort(fl->path, fl->n, sizeof *fl->path, cmp_str);
    return st;
}

/* experts/layer-LLL-SSS-EEE.safetensors and coupled/layer-LLL.safetensors, numbers written as
 * §10.1 writes them (so that one chunk has one name). */
static int parse_chunk(const char *rel, int *layer, int *first, int *last) {
    char canon[128];
    if (sscanf(rel, "experts/layer-%d-%d-%d.safetensors", layer, first, last) != 3) return 0;
    snprintf(canon, sizeof canon, "experts/layer-%03d-%03d-%03d.safetensors", *layer, *first,
             *last);
    return strcmp(canon, rel) == 0 && *layer >= 0 && *first >= 0 && *last >= *first;
}

static int parse_coupled(const char *rel, int *layer) {
    char canon[128];
    if (sscanf(rel, "coupled/layer-%d.safetensors", layer) != 1) return 0;
    snprintf(canon, sizeof canon, "coupled/layer-%03d.safetensors", *layer);
    return strcmp(canon, rel) == 0 && *layer >= 0;
}

/* The hashes of a coupled file's three vectors, as {"sign_latent_in": hex, ...}. */
static enum tmx_status vector_hashes(const char *dir, const char *rel, json_t **out, char **err) {
    char path[4096], hex[HEX_LEN + 1];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    struct tmx_safetensors *st;
    enum tmx_status s = tmx_safetensors_open(path, &st, err);
    if (s != TMX_OK) return s;
    json_t *h = json_object();
    for (int v = 0; s == TMX_OK && v < 3; v++) {
        struct tmx_tensor t;
        if (tmx_safetensors_find(st, vector_names[v], &t) != 0 || t.dtype != TMX_DTYPE_U8)
            s = tmx_err(err, TMX_ERR_INVALID, "%s: no U8 tensor %s", path, vector_names[v]);
        else if ((s = sha256_bytes(t.data, tmx_tensor_nbytes(&t), hex, err)) == TMX_OK)
            json_object_set_new(h, vector_names[v], json_string(hex));
    }
    tmx_safetensors_free(st);
    if (s == TMX_OK) *out = h;
    else json_decref(h);
    return s;
}

/* --- writing ------------------------------------------------------------------------------- */

struct chunk {
    int layer, first, last;
    const char *path;
};

static int cmp_chunk(const void *a, const void *b) {
    const struct chunk *x = a, *y = b;
    return x->layer != y->layer ? (x->layer > y->layer) - (x->layer < y->layer)
                                : (x->first > y->first) - (x->first < y->first);
}

/* "layers": one entry per layer that has chunks, checked for coverage of n_experts. */
static enum tmx_status build_layers(const char *dir, const struct file_list *fl, int n_experts,
                                    json_t *layers, char **err) {
    struct chunk *ch = calloc(fl->n ? fl->n : 1, sizeof *ch);
    int *coupled = calloc(fl->n ? fl->n : 1, sizeof *coupled), n_ch = 0, n_cp = 0, l;
    if (!ch || !coupled) {
        free(ch), free(coupled);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    enum tmx_status st = TMX_OK;
    for (size_t i = 0; st == TMX_OK && i < fl->n; i++) {
        const char *p = fl->path[i];
        struct chunk c = {.path = p};
        if (strncmp(p, "experts/", 8) == 0) {
            if (parse_chunk(p, &c.layer, &c.first, &c.last)) ch[n_ch++] = c;
            else st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: not an experts/layer-LLL-SSS-EEE"
                              ".safetensors file", dir, p);
        } else if (strncmp(p, "coupled/", 8) == 0) {
            if (parse_coupled(p, &l)) coupled[n_cp++] = l;
            else st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: not a coupled/layer-LLL.safetensors "
                              "file", dir, p);
        }
    }
    qsort(ch, (size_t)n_ch, sizeof *ch, cmp_chunk);
    int next = 0; /* coupled files come sorted by layer, as their paths are */
    for (int i = 0; st == TMX_OK && i < n_ch; i++) {
        const struct chunk *c = &ch[i];
        const int starts = i == 0 || ch[i - 1].layer != c->layer;
        const int ends = i + 1 == n_ch || ch[i + 1].layer != c->layer;
        if (c->first != (starts ? 0 : ch[i - 1].last + 1))
            st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: layer %d's chunks leave a gap or overlap "
                         "before expert %d", dir, c->path, c->layer, c->first);
        else if (ends && c->last != n_experts - 1)
            st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: layer %d's last chunk ends at expert %d, "
                         "config.json has %d experts", dir, c->path, c->layer, c->last, n_experts);
        if (st != TMX_OK || !starts) continue;
        if (next < n_cp && coupled[next] < c->layer)
            st = tmx_err(err, TMX_ERR_INVALID, "%s/coupled/layer-%03d.safetensors: layer %d has "
                         "no experts/ files", dir, coupled[next], coupled[next]);
        else if (next == n_cp || coupled[next] != c->layer)
            st = tmx_err(err, TMX_ERR_INVALID, "%s/coupled/layer-%03d.safetensors: missing, "
                         "layer %d has experts/ files", dir, c->layer, c->layer);
        if (st != TMX_OK) break;
        next++;
        char cpath[64];
        snprintf(cpath, sizeof cpath, "coupled/layer-%03d.safetensors", c->layer);
        json_t *hashes = NULL, *experts = json_array();
        for (int j = i; j < n_ch && ch[j].layer == c->layer; j++)
            json_array_append_new(experts, json_pack("{s:s, s:i, s:i}", "path", ch[j].path,
                                                     "first", ch[j].first, "last", ch[j].last));
        if ((st = vector_hashes(dir, cpath, &hashes, err)) == TMX_OK)
            json_array_append_new(layers, json_pack("{s:i, s:o, s:{s:s, s:o}}", "layer",
                                                    c->layer, "experts", experts, "coupled",
                                                    "path", cpath, "sha256", hashes));
        else
            json_decref(experts);
    }
    if (st == TMX_OK && next < n_cp)
        st = tmx_err(err, TMX_ERR_INVALID, "%s/coupled/layer-%03d.safetensors: layer %d has no "
                     "experts/ files", dir, coupled[next], coupled[next]);
    free(ch);
    free(coupled);
    return st;
}

/* hf_quant_config.json's "codec", which a build must have. */
static enum tmx_status read_codec(const char *dir, char **codec, char **err) {
    struct tmx_quant_config q;
    enum tmx_status st = tmx_quant_config_load(dir, &q, err);
    if (st == TMX_OK && !q.present)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: missing (a TrellisMX build has one)", q.path);
    if (st == TMX_OK && !*q.codec)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: \"codec\" must be a string", q.path);
    if (st == TMX_OK && !(*codec = strdup(q.codec)))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    return st;
}

enum tmx_status tmx_manifest_write(const char *dir, char **err) {
    struct tmx_model_config mc;
    struct file_list fl = {0};
    char *codec = NULL, path[4096], hex[HEX_LEN + 1];
    enum tmx_status st = tmx_model_config_load(dir, &mc, err);
    if (st == TMX_OK) st = read_codec(dir, &codec, err);
    if (st == TMX_OK) st = list_files(dir, NULL, &fl, err);
    json_t *files = json_array(), *layers = json_array();
    for (size_t i = 0; st == TMX_OK && i < fl.n; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, fl.path[i]);
        struct stat sb;
        if (stat(path, &sb) != 0) st = tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
        if (st == TMX_OK) st = tmx_manifest_sha256_file(path, hex, err);
        if (st == TMX_OK)
            json_array_append_new(files, json_pack("{s:s, s:I, s:s}", "path", fl.path[i], "size",
                                                   (json_int_t)sb.st_size, "sha256", hex));
    }
    if (st == TMX_OK) st = build_layers(dir, &fl, mc.n_routed_experts, layers, err);
    if (st == TMX_OK) {
        json_t *root = json_pack("{s:s, s:i, s:s, s:O, s:O}", "format", "trellismx-manifest",
                                 "trellismx_version", 1, "codec", codec, "files", files,
                                 "layers", layers);
        char tmp[4096];
        snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
        snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TMX_MANIFEST_NAME);
        if (!root || json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0 ||
            rename(tmp, path) != 0) {
            remove(tmp);
            st = tmx_err(err, TMX_ERR_IO, "%s: cannot write", path);
        }
        json_decref(root);
    }
    json_decref(files);
    json_decref(layers);
    file_list_free(&fl);
    free(codec);
    return st;
}

/* --- verifying ----------------------------------------------------------------------------- */

/* Relative, '/'-separated, no empty, "." or ".." parts: it stays inside the build. */
static int is_safe_path(const char *p) {
    if (!*p || *p == '/') return 0;
    for (const char *s = p; *s;) {
        const size_t n = strcspn(s, "/");
        if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.'))
            return 0;
        s += n;
        if (*s == '/' && !*++s) return 0;
    }
    return 1;
}

static int is_hex64(const char *s) {
    if (!s || strlen(s) != HEX_LEN) return 0;
    for (; *s; s++)
        if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'))) return 0;
    return 1;
}

/* One entry of "files": present, of its size, and (hashes) of its SHA-256. */
static enum tmx_status check_file(const char *dir, const char *mpath, json_t *f, int hashes,
                                  const char *prev, char **err) {
    const char *rel = json_string_value(json_object_get(f, "path"));
    const char *sha = json_string_value(json_object_get(f, "sha256"));
    json_t *size = json_object_get(f, "size");
    if (!rel || !is_safe_path(rel) || !json_is_integer(size) || json_integer_value(size) < 0 ||
        !is_hex64(sha))
        return tmx_err(err, TMX_ERR_INVALID, "%s: files: an entry%s%s lacks a relative path, a "
                       "size or a lower-case hex sha256", mpath, rel ? " for " : "",
                       rel ? rel : "");
    if (prev && strcmp(prev, rel) >= 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: files: %s is out of order or listed twice",
                       mpath, rel);
    char path[4096], hex[HEX_LEN + 1];
    snprintf(path, sizeof path, "%s/%s", dir, rel);
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
        return tmx_err(err, TMX_ERR_NOT_FOUND, "%s: missing (listed in %s)", path,
                       TMX_MANIFEST_NAME);
    if ((json_int_t)sb.st_size != json_integer_value(size))
        return tmx_err(err, TMX_ERR_INVALID, "%s: %lld bytes, %s lists %lld (truncated or "
                       "changed)", path, (long long)sb.st_size, TMX_MANIFEST_NAME,
                       (long long)json_integer_value(size));
    if (!hashes) return TMX_OK;
    enum tmx_status st = tmx_manifest_sha256_file(path, hex, err);
    if (st == TMX_OK && strcmp(hex, sha) != 0)
        st = tmx_err(err, TMX_ERR_INVALID, "%s: SHA-256 differs from %s (the file was changed)",
                     path, TMX_MANIFEST_NAME);
    return st;
}

static int is_listed(const struct file_list *listed, const char *rel) {
    return bsearch(&rel, listed->path, listed->n, sizeof rel, cmp_str) != NULL;
}

/* One entry of "layers": an MoE layer of config.json not listed before (seen[n_layers]),
 * chunks from expert 0 to the last without gap or overlap, each file listed and named for its
 * layer and experts (docs/trellismx.md §10.2). */
static enum tmx_status check_layer(const char *dir, const char *mpath, json_t *entry,
                                   const struct file_list *listed, int hashes,
                                   const struct tmx_model_config *mc, unsigned char *seen,
                                   char **err) {
    json_t *experts = json_object_get(entry, "experts"), *coupled = json_object_get(entry,
                                                                                      "coupled");
    const char *cpath = json_string_value(json_object_get(coupled, "path"));
    json_t *chash = json_object_get(coupled, "sha256");
    const int layer = (int)json_integer_value(json_object_get(entry, "layer"));
    if (!json_is_integer(json_object_get(entry, "layer")) || !json_is_array(experts) ||
        !json_array_size(experts) || !cpath || !json_is_object(chash))
        return tmx_err(err, TMX_ERR_INVALID, "%s: layers: an entry lacks \"layer\", \"experts\" "
                       "or \"coupled\"", mpath);
    if (layer < 0 || layer >= mc->n_layers || mc->dense[layer] || seen[layer])
        return tmx_err(err, TMX_ERR_INVALID, "%s: layers: layer %d is not an MoE layer of "
                       "config.json listed once", mpath, layer);
    seen[layer] = 1;
    char name[64];
    snprintf(name, sizeof name, "coupled/layer-%03d.safetensors", layer);
    if (!is_listed(listed, cpath) || strcmp(cpath, name) != 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: layer %d: coupled file %s is not %s listed in "
                       "\"files\"", mpath, layer, cpath, name);
    size_t i;
    json_t *c;
    int next = 0;
    json_array_foreach(experts, i, c) {
        const char *p = json_string_value(json_object_get(c, "path"));
        json_t *first = json_object_get(c, "first"), *last = json_object_get(c, "last");
        if (!p || !is_listed(listed, p) || !json_is_integer(first) || !json_is_integer(last))
            return tmx_err(err, TMX_ERR_INVALID, "%s: layer %d: chunk %zu needs a path listed in "
                           "\"files\", \"first\" and \"last\"", mpath, layer, i);
        if (json_integer_value(first) != next || json_integer_value(last) < next ||
            json_integer_value(last) >= mc->n_routed_experts)
            return tmx_err(err, TMX_ERR_INVALID, "%s: layer %d: chunk %s leaves a gap or overlap "
                           "at expert %d, or passes the last (%d)", mpath, layer, p, next,
                           mc->n_routed_experts - 1);
        snprintf(name, sizeof name, "experts/layer-%03d-%03d-%03d.safetensors", layer, next,
                 (int)json_integer_value(last));
        if (strcmp(p, name) != 0)
            return tmx_err(err, TMX_ERR_INVALID, "%s: layer %d: chunk %s should be %s", mpath,
                           layer, p, name);
        next = (int)json_integer_value(last) + 1;
    }
    if (next != mc->n_routed_experts)
        return tmx_err(err, TMX_ERR_INVALID, "%s: layer %d: its chunks end at expert %d of %d",
                       mpath, layer, next - 1, mc->n_routed_experts);
    if (!hashes) return TMX_OK;
    json_t *want = NULL;
    enum tmx_status st = vector_hashes(dir, cpath, &want, err);
    for (int v = 0; st == TMX_OK && v < 3; v++) {
        const char *a = json_string_value(json_object_get(want, vector_names[v]));
        const char *b = json_string_value(json_object_get(chash, vector_names[v]));
        if (!b || strcmp(a, b) != 0)
            st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: %s's SHA-256 differs from %s", dir, cpath,
                         vector_names[v], TMX_MANIFEST_NAME);
    }
    json_decref(want);
    return st;
}

enum tmx_status tmx_manifest_verify(const char *dir, int hashes, char **err) {
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s/%s", dir, TMX_MANIFEST_NAME);
    if (access(mpath, F_OK) != 0)
        return tmx_err(err, TMX_ERR_NOT_FOUND, "%s: no %s (not a quantized build)", dir,
                       TMX_MANIFEST_NAME);
    json_error_t je;
    json_t *m = json_load_file(mpath, JSON_REJECT_DUPLICATES, &je);
    if (!m)
        return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", mpath, je.line, je.column, je.text);
    json_t *files = json_object_get(m, "files"), *layers = json_object_get(m, "layers");
    enum tmx_status st = TMX_OK;
    if (!json_is_string(json_object_get(m, "format")) ||
        strcmp(json_string_value(json_object_get(m, "format")), "trellismx-manifest") != 0 ||
        json_integer_value(json_object_get(m, "trellismx_version")) != 1 ||
        !json_is_integer(json_object_get(m, "trellismx_version")) ||
        !json_is_string(json_object_get(m, "codec")) || !json_is_array(files) ||
        !json_is_array(layers))
        st = tmx_err(err, TMX_ERR_INVALID, "%s: not a trellismx-manifest of version 1 with "
                     "\"codec\", \"files\" and \"layers\"", mpath);
    struct file_list listed = {0}, found = {0};
    size_t i;
    json_t *f;
    if (st == TMX_OK && !(listed.path = calloc(json_array_size(files) + 1, sizeof(char *))))
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    json_array_foreach(files, i, f) {
        if (st != TMX_OK) break;
        st = check_file(dir, mpath, f, hashes, i ? listed.path[i - 1] : NULL, err);
        listed.path[listed.n++] = (char *)json_string_value(json_object_get(f, "path"));
    }
    /* Nothing may sit among the experts that the manifest does not vouch for. */
    if (st == TMX_OK) st = list_files(dir, "experts", &found, err);
    if (st == TMX_OK) st = list_files(dir, "coupled", &found, err);
    for (size_t k = 0; st == TMX_OK && k < found.n; k++)
        if (!is_listed(&listed, found.path[k]))
            st = tmx_err(err, TMX_ERR_INVALID, "%s/%s: not listed in %s", dir, found.path[k],
                         TMX_MANIFEST_NAME);
    /* The build's config.json and hf_quant_config.json say what "codec" and "layers" must be. */
    struct tmx_model_config mc;
    struct tmx_quant_config q;
    unsigned char seen[TMX_MAX_LAYERS] = {0};
    if (st == TMX_OK) st = tmx_model_config_load(dir, &mc, err);
    if (st == TMX_OK) st = tmx_quant_config_load(dir, &q, err);
    if (st == TMX_OK && (!q.present || strcmp(q.codec, json_string_value(json_object_get(
                                                           m, "codec"))) != 0))
        st = tmx_err(err, TMX_ERR_INVALID, "%s: codec \"%s\" is not hf_quant_config.json's (%s)",
                     mpath, json_string_value(json_object_get(m, "codec")),
                     q.present ? q.codec : "no such file");
    json_array_foreach(layers, i, f) {
        if (st != TMX_OK) break;
        st = check_layer(dir, mpath, f, &listed, hashes, &mc, seen, err);
    }
    /* A codec that keeps its experts elsewhere (not in experts/ chunks) has no layers. */
    int chunked = 0;
    for (size_t k = 0; k < found.n; k++) chunked |= strncmp(found.path[k], "experts/", 8) == 0;
    for (int l = 0; st == TMX_OK && chunked && l < mc.n_layers; l++)
        if (!mc.dense[l] && !seen[l])
            st = tmx_err(err, TMX_ERR_INVALID, "%s: layers: MoE layer %d is missing", mpath, l);
    free(listed.path); /* its strings belong to the JSON */
    file_list_free(&found);
    json_decref(m);
    return st;
}
