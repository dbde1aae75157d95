/* checkpoint.c: Hugging Face checkpoint directories.
 *
 * A directory holds either one model.safetensors or shards named by model.safetensors.index.json,
 * whose "weight_map" says which shard holds each tensor. The index and the shards must agree
 * exactly: a tensor the index names must be in its shard, and a shard may hold nothing the index
 * puts elsewhere or leaves out, so that a half-copied or mixed-up download fails here, by name,
 * and not later as a missing or wrong weight. */
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "tmx/safetensors.h"

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

struct entry {
    const char *name; /* owned by the shard, or by the index JSON while opening */
    size_t shard;
    bool found; /* seen in its shard (while opening an index) */
    struct tmx_tensor t;
};

struct tmx_checkpoint {
    char *dir;
    size_t n_shards;
    struct tmx_safetensors **shards; /* [n_shards] */
    char **files;                    /* [n_shards] shard file names, relative to dir */
    size_t n;
    struct entry *entries; /* [n] sorted by name */
};

void tmx_checkpoint_free(struct tmx_checkpoint *ck) {
    if (!ck) return;
    for (size_t i = 0; i < ck->n_shards; i++) {
        tmx_safetensors_free(ck->shards[i]);
        free(ck->files[i]);
    }
    free(ck->shards);
    free(ck->files);
    free(ck->entries);
    free(ck->dir);
    free(ck);
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}

static struct entry *find_entry(const struct tmx_checkpoint *ck, const char *name) {
    struct entry key = {.name = name};
    return bsearch(&key, ck->entries, ck->n, sizeof key, cmp_entry);
}

/* Room for n shards; open_shard fills each slot. */
static enum tmx_status alloc_shards(struct tmx_checkpoint *ck, size_t n, char **err) {
    ck->shards = calloc(n ? n : 1, sizeof *ck->shards);
    ck->files = calloc(n ? n : 1, sizeof *ck->files);
    if (!ck->shards || !ck->files) return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", ck->dir);
    ck->n_shards = n;
    return TMX_OK;
}

static enum tmx_status open_shard(struct tmx_checkpoint *ck, size_t i, const char *file,
                                  char **err) {
    char *path = NULL;
    ck->files[i] = strdup(file);
    if (!ck->files[i] || asprintf(&path, "%s/%s", ck->dir, file) < 0)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", ck->dir);
    enum tmx_status s = tmx_safetensors_open(path, &ck->shards[i], err);
    free(path);
    return s;
}

/* Shard names come from the index: keep them inside the checkpoint directory. */
static bool is_plain_file_name(const char *s) {
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static enum tmx_status open_index(struct tmx_checkpoint *ck, const char *path, char **err) {
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return jerr.line > 0
                   ? tmx_err(err, TMX_ERR_INVALID, "%s: line %d: %s", path, jerr.line, jerr.text)
                   : tmx_err(err, TMX_ERR_IO, "%s", jerr.text);
    enum tmx_status s = TMX_OK;
    json_t *files = json_object(); /* shard file name -> shard number, in index order */
    json_t *map = json_object_get(root, "weight_map");
    if (!files) {
        s = tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    if (!json_is_object(map)) {
        s = tmx_err(err, TMX_ERR_INVALID, "%s: \"weight_map\" is missing or not an object", path);
        goto out;
    }

    size_t n_map = json_object_size(map);
    ck->entries = calloc(n_map ? n_map : 1, sizeof *ck->entries);
    if (!ck->entries) {
        s = tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(map, name, v) {
        const char *file = json_string_value(v);
        if (!file || !is_plain_file_name(file)) {
            s = tmx_err(err, TMX_ERR_INVALID,
                        "%s: weight_map entry for '%s' is not a file name in the directory", path,
                        name);
            goto out;
        }
        json_t *shard = json_object_get(files, file);
        if (!shard) {
            shard = json_integer((json_int_t)json_object_size(files));
            if (json_object_set_new(files, file, shard) != 0) {
                s = tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
                goto out;
            }
        }
        ck->entries[ck->n++] = (struct entry){.name = name,
                                              .shard = (size_t)json_integer_value(shard)};
    }
    qsort(ck->entries, ck->n, sizeof *ck->entries, cmp_entry);

    if ((s = alloc_shards(ck, json_object_size(files), err)) != TMX_OK) goto out;
    json_object_foreach(files, name, v) {
        if ((s = open_shard(ck, (size_t)json_integer_value(v), name, err)) != TMX_OK) goto out;
    }

    for (size_t k = 0; k < ck->n_shards; k++) {
        const struct tmx_safetensors *sh = ck->shards[k];
        for (size_t i = 0; i < tmx_safetensors_count(sh); i++) {
            struct tmx_tensor t;
            const char *tname = tmx_safetensors_at(sh, i, &t);
            struct entry *e = find_entry(ck, tname);
            if (!e) {
                s = tmx_err(err, TMX_ERR_INVALID, "%s/%s: tensor '%s' is not listed in %s",
                            ck->dir, ck->files[k], tname, INDEX_NAME);
                goto out;
            }
            if (e->shard != k) {
                if (tmx_safetensors_find(ck->shards[e->shard], tname, NULL) == 0)
                    s = tmx_err(err, TMX_ERR_INVALID, "%s: tensor '%s' is in two shards, %s and %s",
                                ck->dir, tname, ck->files[e->shard], ck->files[k]);
                else
                    s = tmx_err(err, TMX_ERR_INVALID,
                                "%s: tensor '%s' is in %s, but %s puts it in %s", ck->dir, tname,
                                ck->files[k], INDEX_NAME, ck->files[e->shard]);
                goto out;
            }
            *e = (struct entry){.name = tname, .shard = k, .found = true, .t = t};
        }
    }
    for (size_t i = 0; i < ck->n; i++) {
        if (!ck->entries[i].found) {
            s = tmx_err(err, TMX_ERR_INVALID, "%s: tensor '%s' is listed in %s, but %s lacks it",
                        ck->dir, ck->entries[i].name, INDEX_NAME, ck->files[ck->entries[i].shard]);
            goto out;
        }
    }
out:
    json_decref(files);
    json_decref(root);
    return s;
}

/* Without an index: model.safetensors, or else the directory's only *.safetensors file. Stores
 * the malloc'd file name in *file. */
static enum tmx_status find_single(const char *dir, char **file, char **err) {
    char *path = NULL;
    if (asprintf(&path, "%s/%s", dir, SINGLE_NAME) < 0)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", dir);
    bool have_single = access(path, F_OK) == 0;
    free(path);
    if (have_single) {
        *file = strdup(SINGLE_NAME);
        return *file ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", dir);
    }

    DIR *d = opendir(dir);
    if (!d)
        return tmx_err(err, errno == ENOENT ? TMX_ERR_NOT_FOUND : TMX_ERR_IO, "%s: %s", dir,
                       strerror(errno));
    const size_t ext = strlen(".safetensors");
    size_t count = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len <= ext || strcmp(de->d_name + len - ext, ".safetensors") != 0) continue;
        if (count++ == 0) *file = strdup(de->d_name);
    }
    closedir(d);
    if (count == 0)
        return tmx_err(err, TMX_ERR_NOT_FOUND, "%s: no %s or %s", dir, SINGLE_NAME, INDEX_NAME);
    if (count > 1) {
        free(*file);
        *file = NULL;
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: %zu .safetensors files and no %s to say which tensors each holds", dir,
                       count, INDEX_NAME);
    }
    return *file ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", dir);
}

static enum tmx_status open_single(struct tmx_checkpoint *ck, char **err) {
    char *file = NULL;
    enum tmx_status s = find_single(ck->dir, &file, err);
    if (s == TMX_OK) s = alloc_shards(ck, 1, err);
    if (s == TMX_OK) s = open_shard(ck, 0, file, err);
    free(file);
    if (s != TMX_OK) return s;

    const struct tmx_safetensors *sh = ck->shards[0];
    size_t n = tmx_safetensors_count(sh);
    ck->entries = calloc(n ? n : 1, sizeof *ck->entries);
    if (!ck->entries) return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", ck->dir);
    for (size_t i = 0; i < n; i++)
        ck->entries[i].name = tmx_safetensors_at(sh, i, &ck->entries[i].t);
    ck->n = n;
    qsort(ck->entries, n, sizeof *ck->entries, cmp_entry);
    return TMX_OK;
}

enum tmx_status tmx_checkpoint_open(const char *dir, struct tmx_checkpoint **out, char **err) {
    struct tmx_checkpoint *ck = calloc(1, sizeof *ck);
    char *index = NULL;
    if (!ck || !(ck->dir = strdup(dir)) || asprintf(&index, "%s/%s", dir, INDEX_NAME) < 0) {
        tmx_checkpoint_free(ck);
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", dir);
    }
    enum tmx_status s = access(index, F_OK) == 0 ? open_index(ck, index, err)
                                                 : open_single(ck, err);
    free(index);
    if (s != TMX_OK) {
        tmx_checkpoint_free(ck);
        return s;
    }
    *out = ck;
    return TMX_OK;
}

const char *tmx_checkpoint_dir(const struct tmx_checkpoint *ck) { return ck->dir; }

size_t tmx_checkpoint_count(const struct tmx_checkpoint *ck) { return ck->n; }

const char *tmx_checkpoint_at(const struct tmx_checkpoint *ck, size_t i, struct tmx_tensor *t,
                              const char **file) {
    const struct entry *e = &ck->entries[i];
    if (t) *t = e->t;
    if (file) *file = ck->files[e->shard];
    return e->name;
}

int64_t tmx_checkpoint_index(const struct tmx_checkpoint *ck, const char *name) {
    const struct entry *e = find_entry(ck, name);
    return e ? e - ck->entries : -1;
}

int tmx_checkpoint_find(const struct tmx_checkpoint *ck, const char *name, struct tmx_tensor *t) {
    const struct entry *e = find_entry(ck, name);
    if (!e) return -1;
    if (t) *t = e->t;
    return 0;
}
