/* safetensors.c: parsing and mapping safetensors files.
 *
 * Layout: `u64 little-endian N | N bytes of JSON header | data section`. Each header entry is
 * {"dtype", "shape", "data_offsets": [begin, end)} with offsets relative to the data section.
 * The whole header is validated up front, so that every tensor handed out afterwards is known
 * to lie inside the buffer with exactly the bytes its shape needs. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "tmx/safetensors.h"

/* No real checkpoint has a header near this; a larger length means a corrupt or foreign file. */
#define HEADER_MAX (100u * 1000 * 1000)

struct entry {
    const char *name;
    uint64_t begin, end; /* [begin, end) in the data section */
    struct tmx_tensor t;
};

struct tmx_safetensors {
    void *map; /* the whole file when opened from a path; NULL when the caller owns the buffer */
    size_t map_size;
    size_t n, n_meta;
    struct entry *entries;   /* [n] sorted by data offset */
    struct entry **by_name;  /* [n] the same entries, sorted by name */
    const char **meta;       /* [n_meta][2] key, value */
    char *strings;           /* every name, key and value above */
};

void tmx_safetensors_free(struct tmx_safetensors *st) {
    if (!st) return;
    if (st->map) munmap(st->map, st->map_size);
    free(st->entries);
    free(st->by_name);
    free(st->meta);
    free(st->strings);
    free(st);
}

static uint64_t read_u64le(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* A JSON integer in [0, INT64_MAX], or -1. */
static int64_t json_nonneg(const json_t *v) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    return json_integer_value(v);
}

/* Fills e from one header entry; `data_size` bounds the offsets. */
static enum tmx_status parse_entry(const char *file, const char *name, const json_t *v,
                                   uint64_t data_size, struct entry *e, char **err) {
    if (!json_is_object(v))
        return tmx_err(err, TMX_ERR_INVALID, "%s: tensor '%s': entry is not a JSON object", file,
                       name);

    const json_t *dtype = json_object_get(v, "dtype");
    if (!json_is_string(dtype))
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': \"dtype\" is missing or not a string", file, name);
    e->t.dtype = tmx_dtype_from_name(json_string_value(dtype));
    if (e->t.dtype == TMX_DTYPE_COUNT)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: tensor '%s': dtype %s is not one tmx reads "
                       "(F32, BF16, F16, F8_E4M3, U8, I32)",
                       file, name, json_string_value(dtype));

    const json_t *shape = json_object_get(v, "shape");
    if (!json_is_array(shape))
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': \"shape\" is missing or not an array", file, name);
    size_t ndim = json_array_size(shape);
    if (ndim > TMX_MAX_DIMS)
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: tensor '%s': %zu dims, tmx reads at most %d",
                       file, name, ndim, TMX_MAX_DIMS);
    e->t.ndim = (int)ndim;
    /* The byte size is checked against the offsets, so it must not wrap on the way. Zero dims
     * are left out of the product, so that no order of multiplying the dims can overflow. */
    uint64_t nbytes = tmx_dtype_size(e->t.dtype);
    bool empty = false;
    for (size_t i = 0; i < ndim; i++) {
        int64_t d = json_nonneg(json_array_get(shape, i));
        if (d < 0)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: tensor '%s': shape[%zu] is not a non-negative integer", file, name,
                           i);
        e->t.shape[i] = d;
        if (d == 0)
            empty = true;
        else if (__builtin_mul_overflow(nbytes, (uint64_t)d, &nbytes) || nbytes > INT64_MAX)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: tensor '%s': byte size of the shape overflows", file, name);
    }
    if (empty) nbytes = 0;

    const json_t *offs = json_object_get(v, "data_offsets");
    int64_t begin = json_nonneg(json_array_get(offs, 0));
    int64_t end = json_nonneg(json_array_get(offs, 1));
    if (!json_is_array(offs) || json_array_size(offs) != 2 || begin < 0 || end < 0)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': \"data_offsets\" is not [begin, end] of non-negative "
                       "integers",
                       file, name);
    e->begin = (uint64_t)begin;
    e->end = (uint64_t)end;
    if (e->begin > e->end)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': data_offsets begin %llu is after end %llu", file, name,
                       (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': data_offsets end %llu is past the data section "
                       "(%llu bytes)",
                       file, name, (unsigned long long)e->end, (unsigned long long)data_size);
    if (nbytes != e->end - e->begin)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: tensor '%s': shape and dtype %s need %llu bytes but data_offsets span "
                       "%llu",
                       file, name, tmx_dtype_name(e->t.dtype), (unsigned long long)nbytes,
                       (unsigned long long)(e->end - e->begin));
    return TMX_OK;
}

static int cmp_offset(const void *a, const void *b) {
    const struct entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_name(const void *a, const void *b) {
    const struct entry *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Appends s to the string arena at *pos and returns the copy. */
static const char *arena_put(char *arena, size_t *pos, const char *s) {
    size_t len = strlen(s) + 1;
    char *dst = arena + *pos;
    memcpy(dst, s, len);
    *pos += len;
    return dst;
}

/* Builds st from a header already known to be a JSON object. */
static enum tmx_status build(struct tmx_safetensors *st, const char *file, json_t *header,
                             const unsigned char *data, uint64_t data_size, char **err) {
    json_t *meta = json_object_get(header, "__metadata__");
    if (meta && !json_is_object(meta))
        return tmx_err(err, TMX_ERR_INVALID, "%s: \"__metadata__\" is not a JSON object", file);

    /* Sizes first, so that names, keys and values share one allocation. */
    const char *key;
    json_t *v;
    size_t arena_size = 0;
    json_object_foreach(header, key, v) {
        if (v == meta) continue;
        st->n++;
        arena_size += strlen(key) + 1;
    }
    json_object_foreach(meta, key, v) {
        if (!json_is_string(v))
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: \"__metadata__\" value for '%s' is not a string", file, key);
        st->n_meta++;
        arena_size += strlen(key) + 1 + strlen(json_string_value(v)) + 1;
    }
    st->entries = calloc(st->n ? st->n : 1, sizeof *st->entries);
    st->by_name = calloc(st->n ? st->n : 1, sizeof *st->by_name);
    st->meta = calloc(st->n_meta ? 2 * st->n_meta : 1, sizeof *st->meta);
    st->strings = malloc(arena_size ? arena_size : 1);
    if (!st->entries || !st->by_name || !st->meta || !st->strings)
        return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory for %zu tensors", file, st->n);

    size_t pos = 0, i = 0;
    json_object_foreach(header, key, v) {
        if (v == meta) continue;
        struct entry *e = &st->entries[i++];
        enum tmx_status s = parse_entry(file, key, v, data_size, e, err);
        if (s != TMX_OK) return s;
        e->name = arena_put(st->strings, &pos, key);
        e->t.data = (void *)(data + e->begin);
    }
    i = 0;
    json_object_foreach(meta, key, v) {
        st->meta[i++] = arena_put(st->strings, &pos, key);
        st->meta[i++] = arena_put(st->strings, &pos, json_string_value(v));
    }

    /* In offset order, a tensor overlaps another iff it starts before the previous non-empty
     * one ends. Empty tensors occupy no bytes, so they overlap nothing. */
    qsort(st->entries, st->n, sizeof *st->entries, cmp_offset);
    const struct entry *prev = NULL;
    for (i = 0; i < st->n; i++) {
        const struct entry *e = &st->entries[i];
        if (e->begin == e->end) continue;
        if (prev && e->begin < prev->end)
            return tmx_err(err, TMX_ERR_INVALID,
                           "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", file,
                           prev->name, (unsigned long long)prev->begin,
                           (unsigned long long)prev->end, e->name, (unsigned long long)e->begin,
                           (unsigned long long)e->end);
        prev = e;
    }

    for (i = 0; i < st->n; i++) st->by_name[i] = &st->entries[i];
    qsort(st->by_name, st->n, sizeof *st->by_name, cmp_name);
    return TMX_OK;
}

enum tmx_status tmx_safetensors_parse(const void *buf, size_t size, const char *name,
                                      struct tmx_safetensors **out, char **err) {
    const unsigned char *p = buf;
    if (size < 8)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: %zu bytes, too short for the 8-byte header length", name, size);
    uint64_t hlen = read_u64le(p);
    if (hlen > HEADER_MAX)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: header length %llu is absurd (more than %u bytes)", name,
                       (unsigned long long)hlen, HEADER_MAX);
    if (hlen > size - 8)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: header length %llu runs past the end of the file (%zu bytes)", name,
                       (unsigned long long)hlen, size);

    /* Duplicate tensor names are rejected here, with the name in jansson's message. */
    json_error_t jerr;
    json_t *header = json_loadb((const char *)p + 8, hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!header)
        return tmx_err(err, TMX_ERR_INVALID, "%s: header JSON, byte %d: %s", name, jerr.position,
                       jerr.text);
    if (!json_is_object(header)) {
        json_decref(header);
        return tmx_err(err, TMX_ERR_INVALID, "%s: header is not a JSON object", name);
    }

    struct tmx_safetensors *st = calloc(1, sizeof *st);
    enum tmx_status s = st ? build(st, name, header, p + 8 + hlen, size - 8 - hlen, err)
                           : tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", name);
    json_decref(header);
    if (s != TMX_OK) {
        tmx_safetensors_free(st);
        return s;
    }
    *out = st;
    return TMX_OK;
}

enum tmx_status tmx_safetensors_open(const char *path, struct tmx_safetensors **out, char **err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tmx_err(err, errno == ENOENT ? TMX_ERR_NOT_FOUND : TMX_ERR_IO, "%s: %s", path,
                       strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return tmx_err(err, TMX_ERR_IO, "%s: fstat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tmx_err(err, TMX_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)sb.st_size;
    /* mmap refuses an empty length; the parser reports a too-short file itself. */
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return tmx_err(err, TMX_ERR_IO, "%s: mmap: %s", path, strerror(e));
        }
    }
    close(fd);

    enum tmx_status s = tmx_safetensors_parse(map ? map : "", size, path, out, err);
    if (s != TMX_OK) {
        if (map) munmap(map, size);
        return s;
    }
    (*out)->map = map;
    (*out)->map_size = size;
    return TMX_OK;
}

size_t tmx_safetensors_count(const struct tmx_safetensors *st) { return st->n; }

const char *tmx_safetensors_at(const struct tmx_safetensors *st, size_t i, struct tmx_tensor *t) {
    if (t) *t = st->entries[i].t;
    return st->entries[i].name;
}

int tmx_safetensors_find(const struct tmx_safetensors *st, const char *name, struct tmx_tensor *t) {
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, st->by_name[mid]->name);
        if (c == 0) {
            if (t) *t = st->by_name[mid]->t;
            return 0;
        }
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return -1;
}

const char *tmx_safetensors_meta(const struct tmx_safetensors *st, const char *key) {
    for (size_t i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta[2 * i], key) == 0) return st->meta[2 * i + 1];
    return NULL;
}
