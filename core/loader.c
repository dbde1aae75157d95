/* loader.c: the host table, finding and loading plugins, and opening a kernel set.
 *
 * A plugin is refused as soon as one check fails, with one line that names its file: the file
 * is missing, dlopen fails, there is no entry symbol, the entry returns NULL, the ABI version
 * or descriptor size is wrong, the kind is unknown, the descriptor is not the plugin asked for
 * or duplicates one already loaded, its option table or option values are wrong, or its ops
 * table lacks a member the core calls. */
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tmx/loader.h"
#include "tmx/log.h"

/* Set by core/CMakeLists.txt; sources compiled directly (the fuzzers) get the default prefix. */
#ifndef TMX_PLUGIN_INSTALL_DIR
#define TMX_PLUGIN_INSTALL_DIR "/usr/local/lib/tmx"
#endif

/* The descriptor as ABI 1.0 laid it out; later minor versions append after `ops`. */
#define TMX_PLUGIN_SIZE_MIN (offsetof(struct tmx_plugin, ops) + sizeof(const void *))

#define TMX_PLUGIN_NAME_MAX 64

static const char *const kind_names[TMX_PLUGIN_KIND_COUNT] = {
    [TMX_PLUGIN_KERNELS] = "kernels", [TMX_PLUGIN_CODEC] = "codec", [TMX_PLUGIN_DRAFTER] = "drafter",
    [TMX_PLUGIN_MEDIA] = "media",     [TMX_PLUGIN_API] = "api",     [TMX_PLUGIN_BENCH] = "bench",
};

const char *tmx_plugin_kind_name(enum tmx_plugin_kind kind) {
    return (unsigned)kind < TMX_PLUGIN_KIND_COUNT ? kind_names[kind] : "?";
}

enum tmx_plugin_kind tmx_plugin_kind_from_name(const char *name) {
    for (int k = 0; k < TMX_PLUGIN_KIND_COUNT; k++)
        if (strcmp(kind_names[k], name) == 0) return (enum tmx_plugin_kind)k;
    return TMX_PLUGIN_KIND_COUNT;
}

/* --- the host table ------------------------------------------------------------------------ */

static const struct tmx_host host = {
    .struct_size = sizeof(struct tmx_host),
    .abi_major = TMX_ABI_MAJOR,
    .abi_minor = TMX_ABI_MINOR,
    .log = tmx_log,
    .err = tmx_err,
    .opt_str = tmx_opts_str,
    .opt_int = tmx_opts_int,
    .opt_float = tmx_opts_float,
    .opt_bool = tmx_opts_bool,
    .st_open = tmx_safetensors_open,
    .st_free = tmx_safetensors_free,
    .st_find = tmx_safetensors_find,
    .st_meta = tmx_safetensors_meta,
    .st_write = tmx_safetensors_write,
    .opt_where = tmx_opts_where,
};

const struct tmx_host *tmx_host_get(void) { return &host; }

/* --- ops tables ---------------------------------------------------------------------------- */

#define HAS(t, m) TMX_OPS_HAS(t, m)

/* The first member the core calls that `ops` lacks, or NULL. A kernel set needs every op the
 * model graph calls (graph capture is optional); the other kinds need what their header does
 * not mark (optional). */
static const char *missing_op(enum tmx_plugin_kind kind, const void *ops) {
#define NEED(m)                                                                                   \
    do {                                                                                          \
        if (!HAS(t, m)) return #m;                                                                \
    } while (0)
    switch (kind) {
    case TMX_PLUGIN_KERNELS: {
        const struct tmx_kernels_i *t = ops;
        NEED(init); NEED(fini);
        NEED(buf_alloc); NEED(buf_free); NEED(buf_write); NEED(buf_read);
        NEED(weight_import); NEED(weight_free); NEED(sync);
        NEED(embed); NEED(rmsnorm); NEED(matmul); NEED(rope); NEED(kv_store); NEED(attention);
        NEED(moe_route); NEED(moe_experts); NEED(swiglu); NEED(add_gated); NEED(gather);
        break;
    }
    case TMX_PLUGIN_CODEC: {
        const struct tmx_codec_i *t = ops;
        NEED(quant_method); NEED(init); NEED(fini);
        NEED(layer_load); NEED(layer_free); NEED(moe_experts); NEED(expert_decode);
        break;
    }
    case TMX_PLUGIN_DRAFTER: {
        const struct tmx_drafter_i *t = ops;
        NEED(init); NEED(fini); NEED(propose);
        break;
    }
    case TMX_PLUGIN_MEDIA: {
        const struct tmx_media_i *t = ops;
        NEED(mime_types); NEED(init); NEED(fini); NEED(embed);
        break;
    }
    case TMX_PLUGIN_API: {
        const struct tmx_api_i *t = ops;
        NEED(init); NEED(fini); NEED(run); NEED(stop);
        break;
    }
    case TMX_PLUGIN_BENCH: {
        const struct tmx_bench_i *t = ops;
        NEED(init); NEED(fini); NEED(run);
        break;
    }
    case TMX_PLUGIN_KIND_COUNT: break;
    }
#undef NEED
    return NULL;
}

/* --- the registry -------------------------------------------------------------------------- */

struct loaded {
    void *handle;
    char *path;
    const struct tmx_plugin *plugin;
    struct tmx_opts *opts;
};

struct tmx_plugins {
    const struct tmx_config *cfg;
    struct loaded *v; /* [n], in load order */
    size_t n;
};

enum tmx_status tmx_plugins_new(const struct tmx_config *cfg, struct tmx_plugins **out,
                                char **err) {
    struct tmx_plugins *ps = calloc(1, sizeof *ps);
    if (!ps) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    ps->cfg = cfg;
    enum tmx_log_level level;
    if (tmx_log_level_parse(tmx_config_str(cfg, "log_level"), &level) == TMX_OK)
        tmx_log_set_level(level);
    *out = ps;
    return TMX_OK;
}

void tmx_plugins_free(struct tmx_plugins *ps) {
    if (!ps) return;
    for (size_t i = ps->n; i-- > 0;) {
        tmx_opts_free(ps->v[i].opts);
        dlclose(ps->v[i].handle);
        free(ps->v[i].path);
    }
    free(ps->v);
    free(ps);
}

static const struct loaded *find_loaded(const struct tmx_plugins *ps, enum tmx_plugin_kind kind,
                                        const char *name) {
    for (size_t i = 0; i < ps->n; i++)
        if (ps->v[i].plugin->kind == kind && strcmp(ps->v[i].plugin->name, name) == 0)
            return &ps->v[i];
    return NULL;
}

/* [a-z0-9_-], 1 to 64 characters: it becomes part of a file name and of config keys. */
static int is_plugin_name(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > TMX_PLUGIN_NAME_MAX) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_' || *s == '-'))
            return 0;
    return 1;
}

/* dlerror() without the "<path>: " glibc starts it with, so that the path is said once. */
static const char *dl_reason(const char *path) {
    const char *e = dlerror();
    if (!e) return "unknown error";
    size_t n = strlen(path);
    return strncmp(e, path, n) == 0 && strncmp(e + n, ": ", 2) == 0 ? e + n + 2 : e;
}

/* The descriptor's own fields, version first: it says how to read the rest. */
static enum tmx_status check_descriptor(const struct tmx_plugin *p, const char *path,
                                        char **err) {
    if (p->abi_major != TMX_ABI_MAJOR || p->abi_minor > TMX_ABI_MINOR) {
        char supported[32];
        if (TMX_ABI_MINOR == 0) snprintf(supported, sizeof supported, "%d.0", TMX_ABI_MAJOR);
        else
            snprintf(supported, sizeof supported, "%d.0 to %d.%d", TMX_ABI_MAJOR, TMX_ABI_MAJOR,
                     TMX_ABI_MINOR);
        return tmx_err(err, TMX_ERR_ABI, "%s: plugin ABI %u.%u, core supports %s", path,
                       p->abi_major, p->abi_minor, supported);
    }
    if (p->struct_size < TMX_PLUGIN_SIZE_MIN)
        return tmx_err(err, TMX_ERR_ABI,
                       "%s: descriptor struct_size %u is smaller than ABI %d.0's %zu bytes", path,
                       p->struct_size, TMX_ABI_MAJOR, TMX_PLUGIN_SIZE_MIN);
    if ((unsigned)p->kind >= TMX_PLUGIN_KIND_COUNT)
        return tmx_err(err, TMX_ERR_INVALID, "%s: unknown plugin kind %d", path, (int)p->kind);
    if (!is_plugin_name(p->name))
        return tmx_err(err, TMX_ERR_INVALID, "%s: plugin name '%s' is not 1 to %d of [a-z0-9_-]",
                       path, p->name ? p->name : "(null)", TMX_PLUGIN_NAME_MAX);
    if (!p->version)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s.%s has no version string", path,
                       kind_names[p->kind], p->name);
    if (!p->ops)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s.%s has no ops table", path,
                       kind_names[p->kind], p->name);
    return TMX_OK;
}

/* Loads `path`; want_name (with want_kind) is the plugin the caller looked for, NULL for an
 * explicit file. */
static enum tmx_status load(struct tmx_plugins *ps, const char *path,
                            enum tmx_plugin_kind want_kind, const char *want_name,
                            const struct tmx_plugin **out, char **err) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) return tmx_err(err, TMX_ERR_INVALID, "%s: cannot load: %s", path, dl_reason(path));

    enum tmx_status st;
    const struct tmx_plugin *p;
    const struct loaded *prev;
    const char *kind, *op;
    char *why = NULL, *copy;
    struct tmx_opts *opts = NULL;
    struct loaded *grown;
    void *sym = dlsym(handle, TMX_PLUGIN_ENTRY_SYMBOL);
    tmx_plugin_entry_fn entry;
    memcpy(&entry, &sym, sizeof entry);
    if (!sym) {
        st = tmx_err(err, TMX_ERR_NOT_FOUND, "%s: no %s symbol: not a tmx plugin", path,
                     TMX_PLUGIN_ENTRY_SYMBOL);
        goto refuse;
    }
    p = entry(&host, &why);
    if (!p) {
        st = tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: the plugin declined to load: %s", path,
                     why ? why : "no reason given");
        free(why);
        goto refuse;
    }
    free(why);
    if ((st = check_descriptor(p, path, err)) != TMX_OK) goto refuse;
    kind = kind_names[p->kind];
    if (want_name && (p->kind != want_kind || strcmp(p->name, want_name) != 0)) {
        st = tmx_err(err, TMX_ERR_INVALID, "%s: declares %s.%s, expected %s.%s", path, kind,
                     p->name, kind_names[want_kind], want_name);
        goto refuse;
    }
    if ((prev = find_loaded(ps, p->kind, p->name))) {
        if (prev->handle == handle) { /* the same file again: dlopen only counted a reference */
            dlclose(handle);
            *out = prev->plugin;
            return TMX_OK;
        }
        st = tmx_err(err, TMX_ERR_INVALID, "%s: %s.%s is already loaded from %s", path, kind,
                     p->name, prev->path);
        goto refuse;
    }
    if ((st = tmx_config_plugin_opts(ps->cfg, p, path, &opts, err)) != TMX_OK) goto refuse;
    if (p->kind != TMX_PLUGIN_KERNELS && (op = missing_op(p->kind, p->ops))) {
        st = tmx_err(err, TMX_ERR_INVALID, "%s: %s.%s: ops table lacks '%s'", path, kind,
                     p->name, op);
        goto refuse;
    }

    copy = strdup(path);
    grown = copy ? realloc(ps->v, (ps->n + 1) * sizeof *grown) : NULL;
    if (!grown) {
        free(copy);
        st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        goto refuse;
    }
    ps->v = grown;
    ps->v[ps->n++] = (struct loaded){handle, copy, p, opts};
    tmx_log(TMX_LOG_DEBUG, "loaded %s.%s %s from %s", kind, p->name, p->version, path);
    *out = p;
    return TMX_OK;

refuse:
    tmx_opts_free(opts);
    dlclose(handle);
    return st;
}

/* Appends dir/file's dir to `tried` (for the not-found message) and says whether the file is
 * there; *found gets the path when it is. */
/* Whether dir[0..n) is an entry of the ", "-separated list. */
static int listed(const char *list, const char *dir, size_t n) {
    for (const char *p = list; *p; p += strspn(p, ", ")) {
        const size_t len = strcspn(p, ",");
        if (len == n && memcmp(p, dir, n) == 0) return 1;
        p += len;
    }
    return 0;
}

static int look_in(const char *dir, size_t dir_len, const char *file, char *tried, size_t size,
                   char **found) {
    if (dir_len == 0 || listed(tried, dir, dir_len)) return 0; /* libtmx beside the program */
    size_t len = strlen(tried);
    snprintf(tried + len, size - len, "%s%.*s", len ? ", " : "", (int)dir_len, dir);
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%.*s/%s", (int)dir_len, dir, file) >= (int)sizeof path)
        return 0;
    if (access(path, F_OK) != 0) return 0;
    *found = strdup(path);
    return 1;
}

/* Looks in the folder of `path` (a file). */
static int look_beside(const char *path, const char *file, char *tried, size_t size,
                       char **found) {
    const char *slash = strrchr(path, '/');
    return slash && look_in(path, (size_t)(slash - path), file, tried, size, found);
}

/* The search order of tmx/loader.h: plugin_dir, TMX_PLUGIN_PATH, the executable's folder,
 * libtmx's folder (for programs that embed the library), the install folder. */
static enum tmx_status find_file(const struct tmx_plugins *ps, const char *ref, const char *file,
                                 char **found, char **err) {
    char tried[4096] = "";
    const char *dir = tmx_config_str(ps->cfg, "plugin_dir");
    if (look_in(dir, strlen(dir), file, tried, sizeof tried, found)) goto done;
    for (const char *p = getenv("TMX_PLUGIN_PATH"); p && *p; p += *p == ':') {
        size_t n = strcspn(p, ":");
        if (look_in(p, n, file, tried, sizeof tried, found)) goto done;
        p += n;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        if (look_beside(exe, file, tried, sizeof tried, found)) goto done;
    }
    Dl_info self;
    if (dladdr((void *)tmx_plugins_load, &self) && self.dli_fname && strcmp(self.dli_fname, exe) &&
        look_beside(self.dli_fname, file, tried, sizeof tried, found))
        goto done;
    dir = TMX_PLUGIN_INSTALL_DIR;
    if (look_in(dir, strlen(dir), file, tried, sizeof tried, found)) goto done;
    return tmx_err(err, TMX_ERR_NOT_FOUND, "plugin %s: %s not found in %s", ref, file, tried);
done:
    return *found ? TMX_OK : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
}

enum tmx_status tmx_plugins_load(struct tmx_plugins *ps, enum tmx_plugin_kind kind,
                                 const char *name, const struct tmx_plugin **out, char **err) {
    if ((unsigned)kind >= TMX_PLUGIN_KIND_COUNT)
        return tmx_err(err, TMX_ERR_INVALID, "unknown plugin kind %d", (int)kind);
    if (!is_plugin_name(name))
        return tmx_err(err, TMX_ERR_INVALID, "plugin name '%s' is not 1 to %d of [a-z0-9_-]",
                       name ? name : "(null)", TMX_PLUGIN_NAME_MAX);
    const struct loaded *l = find_loaded(ps, kind, name);
    if (l) {
        *out = l->plugin;
        return TMX_OK;
    }
    char ref[TMX_PLUGIN_NAME_MAX + 16], file[TMX_PLUGIN_NAME_MAX + 32];
    snprintf(ref, sizeof ref, "%s.%s", kind_names[kind], name);
    snprintf(file, sizeof file, "libtmx-%s-%s.so", kind_names[kind], name);
    char *path = NULL;
    enum tmx_status st = find_file(ps, ref, file, &path, err);
    if (st == TMX_OK) st = load(ps, path, kind, name, out, err);
    free(path);
    return st;
}

enum tmx_status tmx_plugins_load_file(struct tmx_plugins *ps, const char *path,
                                      const struct tmx_plugin **out, char **err) {
    if (access(path, F_OK) != 0)
        return tmx_err(err, TMX_ERR_NOT_FOUND, "%s: no such plugin file", path);
    return load(ps, path, TMX_PLUGIN_KIND_COUNT, NULL, out, err);
}

enum tmx_status tmx_plugins_load_configured(struct tmx_plugins *ps, char **err) {
    for (int i = 0; i < tmx_config_load_count(ps->cfg); i++) {
        /* The config checked the form "<kind>.<name>" and the kind. */
        const char *ref = tmx_config_load_at(ps->cfg, i), *dot = strchr(ref, '.');
        char kind[16];
        snprintf(kind, sizeof kind, "%.*s", (int)(dot - ref), ref);
        const struct tmx_plugin *p;
        enum tmx_status st = tmx_plugins_load(ps, tmx_plugin_kind_from_name(kind), dot + 1, &p, err);
        if (st != TMX_OK) return st;
    }
    return TMX_OK;
}

size_t tmx_plugins_count(const struct tmx_plugins *ps) { return ps->n; }

const struct tmx_plugin *tmx_plugins_at(const struct tmx_plugins *ps, size_t i, const char **path) {
    if (i >= ps->n) return NULL;
    if (path) *path = ps->v[i].path;
    return ps->v[i].plugin;
}

static const struct loaded *loaded_of(const struct tmx_plugins *ps, const struct tmx_plugin *p) {
    for (size_t i = 0; i < ps->n; i++)
        if (ps->v[i].plugin == p) return &ps->v[i];
    return NULL;
}

const struct tmx_opts *tmx_plugins_opts(const struct tmx_plugins *ps, const struct tmx_plugin *p) {
    const struct loaded *l = loaded_of(ps, p);
    return l ? l->opts : NULL;
}

/* --- kernel sets --------------------------------------------------------------------------- */

enum tmx_status tmx_kernels_open(struct tmx_plugins *ps, const char *name, struct tmx_kernels *out,
                                 char **err) {
    memset(out, 0, sizeof *out);
    if (!name) name = tmx_config_str(ps->cfg, "kernels");
    const struct tmx_plugin *p;
    enum tmx_status st = tmx_plugins_load(ps, TMX_PLUGIN_KERNELS, name, &p, err);
    if (st != TMX_OK) return st;
    const struct loaded *l = loaded_of(ps, p);
    const struct tmx_kernels_i *ops = p->ops;
    const char *op = missing_op(TMX_PLUGIN_KERNELS, ops);
    if (op)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "%s: kernel set %s lacks op '%s', which the model graph calls", l->path,
                       name, op);
    void *ctx = NULL;
    char *why = NULL;
    if ((st = ops->init(&host, l->opts, &ctx, &why)) != TMX_OK) {
        ops->fini(ctx);
        tmx_err(err, st, "kernels.%s: %s", name, why ? why : tmx_status_str(st));
        free(why);
        return st;
    }
    *out = (struct tmx_kernels){p, ops, ctx};
    return TMX_OK;
}

void tmx_kernels_close(struct tmx_kernels *k) {
    if (!k || !k->ops) return;
    k->ops->fini(k->ctx);
    memset(k, 0, sizeof *k);
}
