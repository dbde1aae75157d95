/* config.c: the engine configuration, and the resolution of one plugin's options.
 *
 * Values are applied in rising precedence — default, file, environment, command line — so the
 * last writer wins. Plugin options cannot be typed until the plugin's table is known, so the
 * file's "plugins" section and the command line's "<kind>.<name>.<option>=VALUE" are kept as
 * given and resolved when the plugin loads (tmx_config_plugin_opts). */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tmx/config.h"
#include "tmx/kvcache.h"
#include "tmx/log.h"
#include "tmx/plugin.h"

/* --- core keys ---------------------------------------------------------------------------- */

enum key_type { KEY_STR, KEY_INT, KEY_LIST, KEY_BOOL };

static const struct core_key {
    const char *name;
    enum key_type type;
    const char *env;
    const char *def;  /* as the environment spells it */
    int64_t min, max; /* KEY_INT only */
} core_keys[] = {
    {"plugin_dir", KEY_STR, "TMX_PLUGIN_DIR", "", 0, 0},
    {"kernels", KEY_STR, "TMX_KERNELS", "cpu", 0, 0},
    {"load", KEY_LIST, "TMX_LOAD", "", 0, 0},
    {"threads", KEY_INT, "TMX_THREADS", "0", 0, INT_MAX},
    {"context", KEY_INT, "TMX_CONTEXT", "4096", 1, INT_MAX},
    {"batch", KEY_INT, "TMX_BATCH", "512", 1, INT_MAX},
    {"seed", KEY_INT, "TMX_SEED", "-1", -1, INT64_MAX},
    {"api", KEY_STR, "TMX_API", "openai", 0, 0},
    {"model_name", KEY_STR, "TMX_MODEL_NAME", "", 0, 0},
    {"max_running", KEY_INT, "TMX_MAX_RUNNING", "8", 1, 4096},
    {"max_waiting", KEY_INT, "TMX_MAX_WAITING", "64", 0, 1 << 20},
    {"generation_config", KEY_BOOL, "TMX_GENERATION_CONFIG", "true", 0, 0},
    {"log_level", KEY_STR, "TMX_LOG_LEVEL", "info", 0, 0},
    {"verify", KEY_BOOL, "TMX_VERIFY", "true", 0, 0},
    {"kv_dtype", KEY_STR, "TMX_KV_DTYPE", "f32", 0, 0},
    {"kv_block_size", KEY_INT, "TMX_KV_BLOCK_SIZE", "16", 1, 4096},
    {"kv_tokens", KEY_INT, "TMX_KV_TOKENS", "0", 0, INT_MAX},
    {"prefix_cache", KEY_BOOL, "TMX_PREFIX_CACHE", "true", 0, 0},
    {"graphs", KEY_BOOL, "TMX_GRAPHS", "true", 0, 0},
    {"warmup", KEY_BOOL, "TMX_WARMUP", "true", 0, 0},
    {"tp", KEY_INT, "TMX_TP", "1", 1, 1024},
};
#define N_CORE_KEYS (sizeof core_keys / sizeof core_keys[0])

struct value {
    char *str;   /* KEY_STR */
    int64_t i;   /* KEY_INT, KEY_BOOL (0 or 1) */
    char **list; /* KEY_LIST: [n_list] */
    int n_list;
};

/* A plugin option from the command line, text until the plugin's table gives it a type. */
struct plugin_set {
    char *plugin; /* "<kind>.<name>" */
    char *option;
    char *value;
};

struct tmx_config {
    char *path; /* the file read, or NULL */
    struct value v[N_CORE_KEYS];
    json_t *plugins; /* the file's {"<kind>.<name>": {"<option>": value}}, checked for shape */
    struct plugin_set *sets; /* [n_sets], in command-line order: later ones win */
    int n_sets;
};

static int find_key(const char *name) {
    for (size_t k = 0; k < N_CORE_KEYS; k++)
        if (strcmp(core_keys[k].name, name) == 0) return (int)k;
    return -1;
}

static void free_list(char **list, int n) {
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
}

/* Whole-string base-10 integer; 0 when `s` is not one. */
static int parse_int(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno == ERANGE) return 0;
    *out = v;
    return 1;
}

static int parse_float(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !isfinite(v)) return 0;
    *out = v;
    return 1;
}

static int parse_bool(const char *s, int *out) {
    int yes = strcmp(s, "true") == 0 || strcmp(s, "1") == 0;
    int no = strcmp(s, "false") == 0 || strcmp(s, "0") == 0;
    if (yes || no) *out = yes;
    return yes || no;
}

static const char *json_kind(const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* "<kind>.<name>" with a known kind and a non-empty name (the loader checks the name's
 * characters when it looks for the file). */
static int is_plugin_ref(const char *s) {
    const char *dot = strchr(s, '.');
    if (!dot || !dot[1]) return 0;
    char kind[16];
    size_t n = (size_t)(dot - s);
    if (n >= sizeof kind) return 0;
    memcpy(kind, s, n);
    kind[n] = '\0';
    return tmx_plugin_kind_from_name(kind) != TMX_PLUGIN_KIND_COUNT;
}

/* Each setter checks a value for key k and stores it; `src` (file, variable or "command line")
 * starts the message when it is refused. */
/* A plugin's name as the loader takes it: 1 to 64 of [a-z0-9_-] (part of a file name). */
static int is_plugin_name(const char *s) {
    const size_t n = strlen(s);
    return n >= 1 && n <= 64 && strspn(s, "abcdefghijklmnopqrstuvwxyz0123456789_-") == n;
}

static enum tmx_status set_str(struct tmx_config *cfg, int k, const char *s, const char *src,
                               char **err) {
    const char *key = core_keys[k].name;
    enum tmx_log_level level;
    if ((strcmp(key, "kernels") == 0 || strcmp(key, "api") == 0) && !is_plugin_name(s))
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s: '%.80s' is not a plugin name (1 to 64 of "
                       "[a-z0-9_-])", src, key, s);
    if (strcmp(key, "log_level") == 0 && tmx_log_level_parse(s, &level) != TMX_OK)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: log_level: '%s' is not one of error, warn, info, debug", src, s);
    if (strcmp(key, "kv_dtype") == 0 && tmx_kv_dtype_parse(s) == TMX_DTYPE_COUNT)
        return tmx_err(err, TMX_ERR_INVALID,
                       "%s: kv_dtype: '%s' is not one of f32, bf16, fp8, int8", src, s);
    char *copy = strdup(s);
    if (!copy) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    free(cfg->v[k].str);
    cfg->v[k].str = copy;
    return TMX_OK;
}

static enum tmx_status set_int(struct tmx_config *cfg, int k, int64_t v, const char *src,
                               char **err) {
    const struct core_key *key = &core_keys[k];
    if (v < key->min)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s: must be at least %lld, got %lld", src,
                       key->name, (long long)key->min, (long long)v);
    if (v > key->max)
        return tmx_err(err, TMX_ERR_INVALID, "%s: %s: must be at most %lld, got %lld", src,
                       key->name, (long long)key->max, (long long)v);
    cfg->v[k].i = v;
    return TMX_OK;
}

/* Takes ownership of list[n] whether it succeeds or not. */
static enum tmx_status set_list(struct tmx_config *cfg, int k, char **list, int n,
                                const char *src, char **err) {
    for (int i = 0; i < n; i++) {
        if (!is_plugin_ref(list[i])) {
            tmx_err(err, TMX_ERR_INVALID, "%s: %s[%d]: '%s' is not <kind>.<name>", src,
                    core_keys[k].name, i, list[i]);
            free_list(list, n);
            return TMX_ERR_INVALID;
        }
    }
    free_list(cfg->v[k].list, cfg->v[k].n_list);
    cfg->v[k].list = list;
    cfg->v[k].n_list = n;
    return TMX_OK;
}

static enum tmx_status list_push(char ***list, int *n, const char *s, size_t len) {
    char **grown = realloc(*list, (size_t)(*n + 1) * sizeof *grown);
    if (!grown) return TMX_ERR_NOMEM;
    *list = grown;
    if (!(grown[*n] = strndup(s, len))) return TMX_ERR_NOMEM;
    (*n)++;
    return TMX_OK;
}

/* A value in text form (default, environment, command line); lists are comma-separated. */
static enum tmx_status set_text(struct tmx_config *cfg, int k, const char *text, const char *src,
                                char **err) {
    const struct core_key *key = &core_keys[k];
    switch (key->type) {
    case KEY_STR: return set_str(cfg, k, text, src, err);
    case KEY_INT: {
        int64_t v;
        if (!parse_int(text, &v))
            return tmx_err(err, TMX_ERR_INVALID, "%s: %s: '%s' is not an integer", src, key->name,
                           text);
        return set_int(cfg, k, v, src, err);
    }
    case KEY_LIST: {
        char **list = NULL;
        int n = 0;
        for (const char *p = text; *p;) {
            p += strspn(p, " ,");
            size_t len = strcspn(p, ",");
            while (len && p[len - 1] == ' ') len--;
            if (len && list_push(&list, &n, p, len) != TMX_OK) {
                free_list(list, n);
                return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
            }
            p += len;
        }
        return set_list(cfg, k, list, n, src, err);
    }
    case KEY_BOOL: {
        int b;
        if (!parse_bool(text, &b))
            return tmx_err(err, TMX_ERR_INVALID, "%s: %s: '%s' is not true, false, 1 or 0", src,
                           key->name, text);
        cfg->v[k].i = b;
        return TMX_OK;
    }
    }
    return TMX_ERR_INVALID;
}

/* --- the file ------------------------------------------------------------------------------ */

/* "plugins": {"<kind>.<name>": {"<option>": scalar}}. Option names and types wait for the
 * plugin's table. */
static enum tmx_status read_plugins(struct tmx_config *cfg, const char *path, json_t *plugins,
                                    char **err) {
    if (!json_is_object(plugins))
        return tmx_err(err, TMX_ERR_INVALID, "%s: plugins: must be an object, got %s", path,
                       json_kind(plugins));
    const char *ref, *opt;
    json_t *section, *val;
    json_object_foreach(plugins, ref, section) {
        if (!is_plugin_ref(ref))
            return tmx_err(err, TMX_ERR_INVALID, "%s: plugins: '%s' is not <kind>.<name>", path,
                           ref);
        if (!json_is_object(section))
            return tmx_err(err, TMX_ERR_INVALID, "%s: plugins: %s: must be an object, got %s",
                           path, ref, json_kind(section));
        json_object_foreach(section, opt, val) {
            if (json_is_object(val) || json_is_array(val) || json_is_null(val))
                return tmx_err(err, TMX_ERR_INVALID,
                               "%s: plugins: %s option '%s': must be a string, number or "
                               "boolean, got %s",
                               path, ref, opt, json_kind(val));
        }
    }
    json_decref(cfg->plugins);
    cfg->plugins = json_incref(plugins);
    return TMX_OK;
}

static enum tmx_status read_key(struct tmx_config *cfg, const char *path, const char *name,
                                json_t *val, char **err) {
    if (strcmp(name, "plugins") == 0) return read_plugins(cfg, path, val, err);
    int k = find_key(name);
    if (k < 0) return tmx_err(err, TMX_ERR_INVALID, "%s: unknown key '%s'", path, name);
    switch (core_keys[k].type) {
    case KEY_STR:
        if (!json_is_string(val)) break;
        return set_str(cfg, k, json_string_value(val), path, err);
    case KEY_INT:
        if (!json_is_integer(val)) break;
        return set_int(cfg, k, json_integer_value(val), path, err);
    case KEY_LIST: {
        if (!json_is_array(val)) break;
        char **list = NULL;
        int n = 0;
        size_t i;
        json_t *item;
        json_array_foreach(val, i, item) {
            if (!json_is_string(item)) {
                free_list(list, n);
                return tmx_err(err, TMX_ERR_INVALID, "%s: %s[%zu]: must be a string, got %s",
                               path, name, i, json_kind(item));
            }
            const char *s = json_string_value(item);
            if (list_push(&list, &n, s, strlen(s)) != TMX_OK) {
                free_list(list, n);
                return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
            }
        }
        return set_list(cfg, k, list, n, path, err);
    }
    case KEY_BOOL:
        if (!json_is_boolean(val)) break;
        cfg->v[k].i = json_is_true(val);
        return TMX_OK;
    }
    static const char *const expected[] = {"a string", "an integer", "an array of strings",
                                           "a boolean"};
    return tmx_err(err, TMX_ERR_INVALID, "%s: %s: must be %s, got %s", path, name,
                   expected[core_keys[k].type], json_kind(val));
}

static enum tmx_status read_file(struct tmx_config *cfg, const char *path, char **err) {
    FILE *f = fopen(path, "r");
    if (!f) return tmx_err(err, TMX_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) { /* fopen takes a folder */
        fclose(f);
        return tmx_err(err, TMX_ERR_INVALID, "%s: is a folder, not a configuration file", path);
    }
    json_error_t je;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!root)
        return tmx_err(err, TMX_ERR_INVALID, "%s:%d:%d: %s", path, je.line, je.column, je.text);
    enum tmx_status st = TMX_OK;
    if (!json_is_object(root)) {
        st = tmx_err(err, TMX_ERR_INVALID, "%s: must hold a JSON object, got %s", path,
                     json_kind(root));
    } else {
        const char *name;
        json_t *val;
        json_object_foreach(root, name, val) {
            if ((st = read_key(cfg, path, name, val, err)) != TMX_OK) break;
        }
    }
    json_decref(root);
    return st;
}

/* --- load, set, read ----------------------------------------------------------------------- */

enum tmx_status tmx_config_load(const char *path, struct tmx_config **out, char **err) {
    struct tmx_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    enum tmx_status st = TMX_OK;
    for (size_t k = 0; k < N_CORE_KEYS && st == TMX_OK; k++)
        st = set_text(cfg, (int)k, core_keys[k].def, "default", err);
    if (st == TMX_OK && path) {
        if (!(cfg->path = strdup(path))) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        else st = read_file(cfg, path, err);
    }
    /* An empty variable counts as unset, so `TMX_THREADS= tmx ...` falls back to the file. */
    for (size_t k = 0; k < N_CORE_KEYS && st == TMX_OK; k++) {
        const char *env = getenv(core_keys[k].env);
        if (env && *env) st = set_text(cfg, (int)k, env, core_keys[k].env, err);
    }
    if (st != TMX_OK) {
        tmx_config_free(cfg);
        return st;
    }
    *out = cfg;
    return TMX_OK;
}

void tmx_config_free(struct tmx_config *cfg) {
    if (!cfg) return;
    for (size_t k = 0; k < N_CORE_KEYS; k++) {
        free(cfg->v[k].str);
        free_list(cfg->v[k].list, cfg->v[k].n_list);
    }
    for (int i = 0; i < cfg->n_sets; i++) {
        free(cfg->sets[i].plugin);
        free(cfg->sets[i].option);
        free(cfg->sets[i].value);
    }
    free(cfg->sets);
    json_decref(cfg->plugins);
    free(cfg->path);
    free(cfg);
}

/* "<kind>.<name>.<option>=VALUE": the kind is checked now, the option when the plugin loads. */
static enum tmx_status set_plugin_option(struct tmx_config *cfg, const char *key, size_t key_len,
                                         const char *value, char **err) {
    const char *last = memrchr(key, '.', key_len);
    size_t ref_len = (size_t)(last - key);
    char *ref = strndup(key, ref_len);
    if (!ref) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if (!is_plugin_ref(ref) || last + 1 == key + key_len) {
        tmx_err(err, TMX_ERR_INVALID, "command line: '%.*s' is not <kind>.<name>.<option>",
                (int)key_len, key);
        free(ref);
        return TMX_ERR_INVALID;
    }
    struct plugin_set s = {ref, strndup(last + 1, key_len - ref_len - 1), strdup(value)};
    struct plugin_set *grown = realloc(cfg->sets, (size_t)(cfg->n_sets + 1) * sizeof *grown);
    if (!s.option || !s.value || !grown) {
        free(s.plugin);
        free(s.option);
        free(s.value);
        if (grown) cfg->sets = grown;
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    cfg->sets = grown;
    cfg->sets[cfg->n_sets++] = s;
    return TMX_OK;
}

enum tmx_status tmx_config_set(struct tmx_config *cfg, const char *assignment, char **err) {
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment)
        return tmx_err(err, TMX_ERR_INVALID, "command line: '%s' is not key=value", assignment);
    size_t key_len = (size_t)(eq - assignment);
    if (memchr(assignment, '.', key_len))
        return set_plugin_option(cfg, assignment, key_len, eq + 1, err);
    for (size_t k = 0; k < N_CORE_KEYS; k++) {
        if (strlen(core_keys[k].name) == key_len &&
            strncmp(core_keys[k].name, assignment, key_len) == 0)
            return set_text(cfg, (int)k, eq + 1, "command line", err);
    }
    return tmx_err(err, TMX_ERR_INVALID, "command line: unknown key '%.*s'", (int)key_len,
                   assignment);
}

/* Asking for a key that is not a core key of that type is a bug in the caller. */
static int core_key_of(const char *key, enum key_type type) {
    int k = find_key(key);
    if (k < 0 || core_keys[k].type != type) {
        tmx_log(TMX_LOG_ERROR, "config: '%s' is not a core key of the type asked for", key);
        abort();
    }
    return k;
}

const char *tmx_config_str(const struct tmx_config *cfg, const char *key) {
    return cfg->v[core_key_of(key, KEY_STR)].str;
}

int64_t tmx_config_int(const struct tmx_config *cfg, const char *key) {
    return cfg->v[core_key_of(key, KEY_INT)].i;
}

int tmx_config_bool(const struct tmx_config *cfg, const char *key) {
    return (int)cfg->v[core_key_of(key, KEY_BOOL)].i;
}

int tmx_config_load_count(const struct tmx_config *cfg) {
    return cfg->v[core_key_of("load", KEY_LIST)].n_list;
}

const char *tmx_config_load_at(const struct tmx_config *cfg, int i) {
    const struct value *v = &cfg->v[core_key_of("load", KEY_LIST)];
    return i >= 0 && i < v->n_list ? v->list[i] : NULL;
}

/* A command-line plugin value is text; printed as the JSON it would be written as in a file
 * (4, 0.5, true) when it reads as one, else as a string. */
static json_t *json_from_text(const char *text) {
    json_t *j = json_loads(text, JSON_DECODE_ANY, NULL);
    if (j && (json_is_number(j) || json_is_boolean(j))) return j;
    json_decref(j);
    return json_string(text);
}

void tmx_config_print(const struct tmx_config *cfg) {
    json_t *root = json_object();
    for (size_t k = 0; k < N_CORE_KEYS; k++) {
        const struct value *v = &cfg->v[k];
        json_t *j = NULL;
        switch (core_keys[k].type) {
        case KEY_STR: j = json_string(v->str); break;
        case KEY_INT: j = json_integer(v->i); break;
        case KEY_BOOL: j = json_boolean(v->i); break;
        case KEY_LIST:
            j = json_array();
            for (int i = 0; i < v->n_list; i++) json_array_append_new(j, json_string(v->list[i]));
            break;
        }
        json_object_set_new(root, core_keys[k].name, j);
    }
    json_t *plugins = cfg->plugins ? json_deep_copy(cfg->plugins) : json_object();
    for (int i = 0; i < cfg->n_sets; i++) {
        const struct plugin_set *s = &cfg->sets[i];
        json_t *section = json_object_get(plugins, s->plugin);
        if (!section) json_object_set_new(plugins, s->plugin, section = json_object());
        json_object_set_new(section, s->option, json_from_text(s->value));
    }
    json_object_set_new(root, "plugins", plugins);
    json_dumpf(root, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    fputc('\n', stdout);
    fflush(stdout);
    json_decref(root);
}

/* --- plugin options ------------------------------------------------------------------------ */

struct opt_value {
    const char *name; /* the plugin's table entry, which outlives the opts */
    enum tmx_opt_type type;
    char *where; /* where the value came from, for a plugin's range errors (tmx_opts_where) */
    union {
        int64_t i;
        double f;
        int b;
        char *s;
    } u;
};

struct tmx_opts {
    int n;
    struct opt_value v[]; /* [n], in table order */
};

static const char *const opt_type_names[] = {"an integer", "a number", "a boolean", "a string"};

/* Text -> value of type t: TMX_ERR_INVALID when it does not parse. */
static enum tmx_status opt_from_text(struct opt_value *v, const char *text) {
    switch (v->type) {
    case TMX_OPT_INT: return parse_int(text, &v->u.i) ? TMX_OK : TMX_ERR_INVALID;
    case TMX_OPT_FLOAT: return parse_float(text, &v->u.f) ? TMX_OK : TMX_ERR_INVALID;
    case TMX_OPT_BOOL: return parse_bool(text, &v->u.b) ? TMX_OK : TMX_ERR_INVALID;
    case TMX_OPT_STRING:
        free(v->u.s);
        return (v->u.s = strdup(text)) ? TMX_OK : TMX_ERR_NOMEM;
    }
    return TMX_ERR_INVALID;
}

static enum tmx_status opt_from_json(struct opt_value *v, const json_t *j) {
    switch (v->type) {
    case TMX_OPT_INT:
        if (!json_is_integer(j)) return TMX_ERR_INVALID;
        v->u.i = json_integer_value(j);
        return TMX_OK;
    case TMX_OPT_FLOAT:
        if (!json_is_number(j)) return TMX_ERR_INVALID;
        v->u.f = json_number_value(j);
        return TMX_OK;
    case TMX_OPT_BOOL:
        if (!json_is_boolean(j)) return TMX_ERR_INVALID;
        v->u.b = json_is_true(j);
        return TMX_OK;
    case TMX_OPT_STRING:
        if (!json_is_string(j)) return TMX_ERR_INVALID;
        return opt_from_text(v, json_string_value(j));
    }
    return TMX_ERR_INVALID;
}

static int is_option_name(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_' || *s == '-'))
            return 0;
    return 1;
}

/* The table's own mistakes, before any value is looked at: *n gets its length. */
static enum tmx_status check_table(const struct tmx_plugin *p, const char *path, int *n,
                                   char **err) {
    int i = 0;
    for (const struct tmx_option *o = p->opts; o && o->name; o++, i++) {
        if (!is_option_name(o->name))
            return tmx_err(err, TMX_ERR_INVALID, "%s: option %d: name '%s' is not [a-z0-9_-]+",
                           path, i, o->name);
        for (int j = 0; j < i; j++)
            if (strcmp(p->opts[j].name, o->name) == 0)
                return tmx_err(err, TMX_ERR_INVALID, "%s: option '%s' is declared twice", path,
                               o->name);
        if ((unsigned)o->type > TMX_OPT_STRING)
            return tmx_err(err, TMX_ERR_INVALID, "%s: option '%s': unknown type %d", path,
                           o->name, (int)o->type);
        if (!o->def)
            return tmx_err(err, TMX_ERR_INVALID, "%s: option '%s': no default", path, o->name);
        struct opt_value v = {.type = o->type};
        enum tmx_status st = opt_from_text(&v, o->def);
        if (o->type == TMX_OPT_STRING) free(v.u.s);
        if (st == TMX_ERR_NOMEM) return tmx_err(err, st, "out of memory");
        if (st != TMX_OK)
            return tmx_err(err, TMX_ERR_INVALID, "%s: option '%s': default '%s' is not %s", path,
                           o->name, o->def, opt_type_names[o->type]);
    }
    *n = i;
    return TMX_OK;
}

static int table_index(const struct tmx_plugin *p, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(p->opts[i].name, name) == 0) return i;
    return -1;
}

/* ", a, b" of the declared names, for "has no option" messages. */
static void list_options(const struct tmx_plugin *p, int n, char *buf, size_t size) {
    size_t len = (size_t)snprintf(buf, size, "%s", n ? "options:" : "no options");
    for (int i = 0; i < n && len < size; i++)
        len += (size_t)snprintf(buf + len, size - len, "%s %s", i ? "," : "", p->opts[i].name);
}

/* TMX_<KIND>_<NAME>_<OPTION>, upper case, '-' -> '_'. */
static char *env_name(const char *kind, const char *name, const char *option) {
    size_t size = strlen("TMX___") + strlen(kind) + strlen(name) + strlen(option) + 1;
    char *s = malloc(size);
    if (!s) return NULL;
    snprintf(s, size, "TMX_%s_%s_%s", kind, name, option);
    for (char *c = s; *c; c++) {
        if (*c >= 'a' && *c <= 'z') *c = (char)(*c - 'a' + 'A');
        else if (*c == '-') *c = '_';
    }
    return s;
}

/* Where an option's value came from, malloc'd (NULL when out of memory):
 * "SOURCE: kind.name.option" for a value someone set, "kind.name.option (SOURCE)" for one the
 * core supplied. */
static char *opt_where(const char *source, const char *ref, const char *option, int set) {
    size_t size = strlen(source) + strlen(ref) + strlen(option) + 8;
    char *s = malloc(size);
    if (!s) return NULL;
    if (set) snprintf(s, size, "%s: %s.%s", source, ref, option);
    else snprintf(s, size, "%s.%s (%s)", ref, option, source);
    return s;
}

/* One option, highest precedence first. `ref` is "<kind>.<name>". A refused value gets a
 * message; running out of memory is left to the caller to report. */
static enum tmx_status resolve(const struct tmx_config *cfg, const struct tmx_plugin *p,
                               const char *ref, const json_t *section, const struct tmx_option *o,
                               struct opt_value *v, char **err) {
    const char *type = opt_type_names[o->type];
    enum tmx_status st;
    for (int i = cfg->n_sets - 1; i >= 0; i--) {
        const struct plugin_set *s = &cfg->sets[i];
        if (strcmp(s->plugin, ref) != 0 || strcmp(s->option, o->name) != 0) continue;
        if ((st = opt_from_text(v, s->value)) == TMX_ERR_INVALID)
            tmx_err(err, st, "command line: %s.%s: '%s' is not %s", ref, o->name, s->value, type);
        v->where = opt_where("command line", ref, o->name, 1);
        return st;
    }
    char *var = env_name(tmx_plugin_kind_name(p->kind), p->name, o->name);
    if (!var) return TMX_ERR_NOMEM;
    const char *env = getenv(var);
    if (env && *env) {
        if ((st = opt_from_text(v, env)) == TMX_ERR_INVALID)
            tmx_err(err, st, "%s: %s option '%s': '%s' is not %s", var, ref, o->name, env, type);
        v->where = opt_where(var, ref, o->name, 1);
        free(var);
        return st;
    }
    free(var);
    const json_t *j = json_object_get(section, o->name);
    if (j) {
        if ((st = opt_from_json(v, j)) == TMX_ERR_INVALID)
            tmx_err(err, st, "%s: plugins: %s option '%s': must be %s, got %s", cfg->path, ref,
                    o->name, type, json_kind(j));
        char source[4096];
        snprintf(source, sizeof source, "%s: plugins", cfg->path);
        v->where = opt_where(source, ref, o->name, 1);
        return st;
    }
    if ((p->kind == TMX_PLUGIN_KERNELS || p->kind == TMX_PLUGIN_CODEC) &&
        o->type == TMX_OPT_INT && strcmp(o->name, "threads") == 0) {
        v->u.i = tmx_config_int(cfg, "threads");
        v->where = opt_where("the core key threads", ref, o->name, 0);
        return TMX_OK;
    }
    v->where = opt_where("default", ref, o->name, 0);
    return opt_from_text(v, o->def);
}

enum tmx_status tmx_config_plugin_opts(const struct tmx_config *cfg, const struct tmx_plugin *p,
                                       const char *path, struct tmx_opts **out, char **err) {
    int n = 0;
    enum tmx_status st = check_table(p, path, &n, err);
    if (st != TMX_OK) return st;

    char ref[128], have[512];
    snprintf(ref, sizeof ref, "%s.%s", tmx_plugin_kind_name(p->kind), p->name);
    list_options(p, n, have, sizeof have);
    /* Options the table does not declare: a typo must not pass silently. */
    json_t *section = json_object_get(cfg->plugins, ref), *val;
    const char *key;
    json_object_foreach(section, key, val) {
        if (table_index(p, n, key) < 0)
            return tmx_err(err, TMX_ERR_INVALID, "%s: plugins: %s has no option '%s' (%s)",
                           cfg->path, ref, key, have);
    }
    for (int i = 0; i < cfg->n_sets; i++) {
        const struct plugin_set *s = &cfg->sets[i];
        if (strcmp(s->plugin, ref) == 0 && table_index(p, n, s->option) < 0)
            return tmx_err(err, TMX_ERR_INVALID, "command line: %s has no option '%s' (%s)",
                           ref, s->option, have);
    }

    struct tmx_opts *opts = calloc(1, sizeof *opts + (size_t)n * sizeof opts->v[0]);
    if (!opts) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    opts->n = n;
    for (int i = 0; i < n && st == TMX_OK; i++) {
        opts->v[i].name = p->opts[i].name;
        opts->v[i].type = p->opts[i].type;
        st = resolve(cfg, p, ref, section, &p->opts[i], &opts->v[i], err);
        if (st == TMX_OK && !opts->v[i].where) st = TMX_ERR_NOMEM;
        if (st == TMX_ERR_NOMEM) tmx_err(err, st, "out of memory");
    }
    if (st != TMX_OK) {
        tmx_opts_free(opts);
        return st;
    }
    *out = opts;
    return TMX_OK;
}

void tmx_opts_free(struct tmx_opts *opts) {
    if (!opts) return;
    for (int i = 0; i < opts->n; i++) {
        if (opts->v[i].type == TMX_OPT_STRING) free(opts->v[i].u.s);
        free(opts->v[i].where);
    }
    free(opts);
}

static const struct opt_value *opt_find(const struct tmx_opts *opts, const char *name,
                                        enum tmx_opt_type type) {
    for (int i = 0; opts && i < opts->n; i++)
        if (opts->v[i].type == type && strcmp(opts->v[i].name, name) == 0) return &opts->v[i];
    return NULL;
}

const char *tmx_opts_str(const struct tmx_opts *opts, const char *name) {
    const struct opt_value *v = opt_find(opts, name, TMX_OPT_STRING);
    return v ? v->u.s : NULL;
}

int64_t tmx_opts_int(const struct tmx_opts *opts, const char *name) {
    const struct opt_value *v = opt_find(opts, name, TMX_OPT_INT);
    return v ? v->u.i : 0;
}

double tmx_opts_float(const struct tmx_opts *opts, const char *name) {
    const struct opt_value *v = opt_find(opts, name, TMX_OPT_FLOAT);
    return v ? v->u.f : 0.0;
}

int tmx_opts_bool(const struct tmx_opts *opts, const char *name) {
    const struct opt_value *v = opt_find(opts, name, TMX_OPT_BOOL);
    return v ? v->u.b : 0;
}

const char *tmx_opts_where(const struct tmx_opts *opts, const char *name) {
    for (int i = 0; opts && i < opts->n; i++)
        if (strcmp(opts->v[i].name, name) == 0) return opts->v[i].where;
    return name;
}

int tmx_opts_set_int(struct tmx_opts *opts, const char *name, int64_t value) {
    struct opt_value *v = (struct opt_value *)opt_find(opts, name, TMX_OPT_INT);
    if (v) v->u.i = value;
    return v != NULL;
}
