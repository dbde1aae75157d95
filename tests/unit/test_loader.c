/* test_loader.c: the plugin loader. Every refusal (status and one-line message naming the
 * file), the search order, option resolution and its errors, and each example plugin loaded
 * and exercised through its ops table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tmx/loader.h"

#define PLUGIN(file) TMX_TEST_PLUGIN_DIR "/libtmx-" file ".so"

static const char *const env_vars[] = {
    "TMX_PLUGIN_DIR", "TMX_KERNELS",   "TMX_LOAD",     "TMX_THREADS",     "TMX_CONTEXT",
    "TMX_BATCH",      "TMX_SEED",      "TMX_LOG_LEVEL", "TMX_PLUGIN_PATH", "TMX_KERNELS_OPTS_THREADS",
    "TMX_KERNELS_OPTS_SCALE", "TMX_KERNELS_OPTS_FAST_MATH", "TMX_KERNELS_OPTS_LABEL",
    "TMX_DRAFTER_REPEAT_NGRAM", "TMX_BENCH_MEMCPY_MIN_TIME_MS",
};

static int clear_env(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof env_vars / sizeof env_vars[0]; i++) unsetenv(env_vars[i]);
    return 0;
}

/* A config (optionally from a file holding `json`) with plugin_dir set to the test plugins,
 * then the NULL-terminated command-line overrides, and an empty registry. */
struct fixture {
    char *cfg_path;
    struct tmx_config *cfg;
    struct tmx_plugins *ps;
};

static char *write_temp(const char *text) {
    char *path = strdup("/tmp/tmx-test-loader-XXXXXX.json");
    int fd = mkstemps(path, 5);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void fx_open(struct fixture *f, const char *json, ...) {
    memset(f, 0, sizeof *f);
    if (json) f->cfg_path = write_temp(json);
    char *err = NULL;
    if (tmx_config_load(f->cfg_path, &f->cfg, &err) != TMX_OK) fail_msg("%s", err);
    assert_int_equal(tmx_config_set(f->cfg, "plugin_dir=" TMX_TEST_PLUGIN_DIR, NULL), TMX_OK);
    va_list ap;
    va_start(ap, json);
    for (const char *s; (s = va_arg(ap, const char *));)
        if (tmx_config_set(f->cfg, s, &err) != TMX_OK) fail_msg("%s", err);
    va_end(ap);
    assert_int_equal(tmx_plugins_new(f->cfg, &f->ps, NULL), TMX_OK);
}

static void fx_close(struct fixture *f) {
    tmx_plugins_free(f->ps);
    tmx_config_free(f->cfg);
    if (f->cfg_path) unlink(f->cfg_path);
    free(f->cfg_path);
}

/* One line that contains every string of the NULL-terminated list. */
static void assert_message(const char *err, ...) {
    assert_non_null(err);
    assert_null(strchr(err, '\n'));
    va_list ap;
    va_start(ap, err);
    for (const char *s; (s = va_arg(ap, const char *));)
        if (!strstr(err, s)) fail_msg("message \"%s\" lacks \"%s\"", err, s);
    va_end(ap);
}

static const struct tmx_plugin *load_ok(struct fixture *f, enum tmx_plugin_kind kind,
                                        const char *name) {
    const struct tmx_plugin *p = NULL;
    char *err = NULL;
    if (tmx_plugins_load(f->ps, kind, name, &p, &err) != TMX_OK) fail_msg("%s", err);
    return p;
}

/* --- refusals ------------------------------------------------------------------------------ */

static void test_refusals(void **state) {
    (void)state;
    static const struct {
        enum tmx_plugin_kind kind;
        const char *name, *path;
        enum tmx_status st;
        const char *what1, *what2;
    } cases[] = {
        {TMX_PLUGIN_KERNELS, "badabi", PLUGIN("kernels-badabi"), TMX_ERR_ABI, "plugin ABI 99.0",
         "core supports 2.0"},
        {TMX_PLUGIN_CODEC, "newminor", PLUGIN("codec-newminor"), TMX_ERR_ABI, "plugin ABI 2.99",
         "core supports 2.0"},
        {TMX_PLUGIN_API, "nosym", PLUGIN("api-nosym"), TMX_ERR_NOT_FOUND, "no tmx_plugin_entry",
         "not a tmx plugin"},
        {TMX_PLUGIN_DRAFTER, "null", PLUGIN("drafter-null"), TMX_ERR_UNSUPPORTED, "declined",
         "needs a feature this machine lacks"},
        {TMX_PLUGIN_MEDIA, "small", PLUGIN("media-small"), TMX_ERR_ABI, "struct_size",
         "ABI 2.0"},
        {TMX_PLUGIN_BENCH, "badkind", PLUGIN("bench-badkind"), TMX_ERR_INVALID,
         "unknown plugin kind 42", ""},
        {TMX_PLUGIN_BENCH, "badopt", PLUGIN("bench-badopt"), TMX_ERR_INVALID, "option 'repeats'",
         "default 'many' is not an integer"},
        {TMX_PLUGIN_CODEC, "int8copy", PLUGIN("codec-int8copy"), TMX_ERR_INVALID,
         "declares codec.int8", "expected codec.int8copy"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct fixture f;
        fx_open(&f, NULL, NULL);
        const struct tmx_plugin *p = NULL;
        char *err = NULL;
        /* Found by kind and name in plugin_dir ... */
        assert_int_equal(tmx_plugins_load(f.ps, cases[i].kind, cases[i].name, &p, &err),
                         cases[i].st);
        assert_message(err, cases[i].path, cases[i].what1, cases[i].what2, NULL);
        free(err);
        err = NULL;
        /* ... or named by path: the same refusal (a name mismatch aside: no name was asked). */
        if (strcmp(cases[i].name, "int8copy") != 0) {
            assert_int_equal(tmx_plugins_load_file(f.ps, cases[i].path, &p, &err), cases[i].st);
            assert_message(err, cases[i].path, cases[i].what1, cases[i].what2, NULL);
            free(err);
        }
        assert_int_equal(tmx_plugins_count(f.ps), 0);
        fx_close(&f);
    }
}

static void test_refuse_missing_file(void **state) {
    (void)state;
    setenv("TMX_PLUGIN_PATH", "/nonexistent/one::/nonexistent/two", 1);
    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_plugin *p;
    char *err = NULL;
    assert_int_equal(tmx_plugins_load(f.ps, TMX_PLUGIN_CODEC, "nothere", &p, &err),
                     TMX_ERR_NOT_FOUND);
    assert_message(err, "codec.nothere", "libtmx-codec-nothere.so", NULL);
    /* Every folder, in search order: plugin_dir, TMX_PLUGIN_PATH, the executable's folder. */
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    assert_true(n > 0);
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0';
    const char *a = strstr(err, TMX_TEST_PLUGIN_DIR ","), *b = strstr(err, "/nonexistent/one, ");
    const char *c = strstr(err, "/nonexistent/two, "), *d = strstr(err, exe);
    assert_true(a && b && c && d && a < b && b < c && c < d);
    free(err);
    err = NULL;

    assert_int_equal(tmx_plugins_load_file(f.ps, "/nonexistent/libtmx-codec-x.so", &p, &err),
                     TMX_ERR_NOT_FOUND);
    assert_message(err, "/nonexistent/libtmx-codec-x.so", NULL);
    free(err);
    err = NULL;
    assert_int_equal(tmx_plugins_load(f.ps, TMX_PLUGIN_CODEC, "../int8", &p, &err),
                     TMX_ERR_INVALID);
    assert_message(err, "'../int8'", NULL);
    free(err);
    fx_close(&f);
}

static void test_refuse_dlopen_error(void **state) {
    (void)state;
    char dir[] = "/tmp/tmx-test-loader-XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/libtmx-codec-junk.so", dir);
    FILE *fp = fopen(path, "w");
    fputs("not an ELF file\n", fp);
    fclose(fp);

    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_plugin *p;
    char *err = NULL;
    assert_int_equal(tmx_plugins_load_file(f.ps, path, &p, &err), TMX_ERR_INVALID);
    assert_message(err, path, "cannot load", NULL);
    free(err);
    fx_close(&f);
    unlink(path);
    rmdir(dir);
}

static void test_refuse_duplicate(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_plugin *p = load_ok(&f, TMX_PLUGIN_CODEC, "int8"), *q;
    char *err = NULL;
    assert_int_equal(tmx_plugins_load_file(f.ps, PLUGIN("codec-int8copy"), &q, &err),
                     TMX_ERR_INVALID);
    assert_message(err, PLUGIN("codec-int8copy"), "codec.int8 is already loaded from",
                   PLUGIN("codec-int8"), NULL);
    free(err);
    /* The same file or name again is no duplicate: it is the plugin already loaded. */
    assert_int_equal(tmx_plugins_load_file(f.ps, PLUGIN("codec-int8"), &q, NULL), TMX_OK);
    assert_ptr_equal(q, p);
    assert_ptr_equal(load_ok(&f, TMX_PLUGIN_CODEC, "int8"), p);
    assert_int_equal(tmx_plugins_count(f.ps), 1);
    const char *path;
    assert_ptr_equal(tmx_plugins_at(f.ps, 0, &path), p);
    assert_string_equal(path, PLUGIN("codec-int8"));
    assert_null(tmx_plugins_at(f.ps, 1, NULL));
    fx_close(&f);

    /* Alone, the twin passes every check up to its empty ops table. */
    fx_open(&f, NULL, NULL);
    err = NULL;
    assert_int_equal(tmx_plugins_load_file(f.ps, PLUGIN("codec-int8copy"), &q, &err),
                     TMX_ERR_INVALID);
    assert_message(err, PLUGIN("codec-int8copy"), "ops table lacks 'quant_method'", NULL);
    free(err);
    fx_close(&f);
}

/* --- search order -------------------------------------------------------------------------- */

/* A temporary folder holding a link named libtmx-codec-int8.so to the real one. */
static void make_plugin_folder(char *dir) {
    assert_non_null(mkdtemp(dir));
    char link[128];
    snprintf(link, sizeof link, "%s/libtmx-codec-int8.so", dir);
    assert_int_equal(symlink(PLUGIN("codec-int8"), link), 0);
}

static void remove_plugin_folder(const char *dir) {
    char link[128];
    snprintf(link, sizeof link, "%s/libtmx-codec-int8.so", dir);
    unlink(link);
    rmdir(dir);
}

/* Loads codec.int8 with the given plugin_dir and TMX_PLUGIN_PATH; checks the folder used. */
static void expect_found_in(const char *plugin_dir, const char *path_env, const char *dir) {
    setenv("TMX_PLUGIN_PATH", path_env, 1);
    char set[256], want[256];
    snprintf(set, sizeof set, "plugin_dir=%s", plugin_dir);
    snprintf(want, sizeof want, "%s/libtmx-codec-int8.so", dir);
    struct fixture f;
    fx_open(&f, NULL, set, NULL);
    load_ok(&f, TMX_PLUGIN_CODEC, "int8");
    const char *path;
    tmx_plugins_at(f.ps, 0, &path);
    assert_string_equal(path, want);
    fx_close(&f);
}

static void test_search_order(void **state) {
    (void)state;
    char a[] = "/tmp/tmx-test-loader-XXXXXX", b[] = "/tmp/tmx-test-loader-XXXXXX";
    make_plugin_folder(a);
    make_plugin_folder(b);
    char path[256];
    snprintf(path, sizeof path, "%s:%s", b, a);
    expect_found_in(a, path, a); /* plugin_dir before TMX_PLUGIN_PATH */
    expect_found_in("", path, b); /* TMX_PLUGIN_PATH in order */
    snprintf(path, sizeof path, "/nonexistent::%s", a);
    expect_found_in("/nonexistent", path, a); /* folders without the file are passed over */
    remove_plugin_folder(a);
    remove_plugin_folder(b);
}

/* --- options ------------------------------------------------------------------------------- */

static void test_option_precedence(void **state) {
    (void)state;
    const struct tmx_host *host = tmx_host_get();
    struct fixture f;

    /* Defaults; a kernel set's "threads" defaults to the core key "threads". */
    fx_open(&f, NULL, "threads=6", NULL);
    const struct tmx_opts *o = tmx_plugins_opts(f.ps, load_ok(&f, TMX_PLUGIN_KERNELS, "opts"));
    assert_int_equal(host->opt_int(o, "threads"), 6);
    assert_true(host->opt_float(o, "scale") == 0.5);
    assert_int_equal(host->opt_bool(o, "fast-math"), 0);
    assert_string_equal(host->opt_str(o, "label"), "none");
    /* Where each value came from, for the plugin's own range errors. */
    assert_string_equal(tmx_opt_where(host, o, "threads"),
                        "kernels.opts.threads (the core key threads)");
    assert_string_equal(tmx_opt_where(host, o, "label"), "kernels.opts.label (default)");
    assert_string_equal(tmx_opt_where(host, o, "nope"), "nope");
    /* Undeclared, or declared with another type: NULL / 0. */
    assert_null(host->opt_str(o, "nope"));
    assert_int_equal(host->opt_int(o, "scale"), 0);
    fx_close(&f);

    /* file > default */
    const char *json = "{\"threads\": 6, \"plugins\": {\"kernels.opts\": {\"threads\": 2, "
                       "\"scale\": 1, \"fast-math\": true, \"label\": \"file\"}}}";
    fx_open(&f, json, NULL);
    o = tmx_plugins_opts(f.ps, load_ok(&f, TMX_PLUGIN_KERNELS, "opts"));
    assert_int_equal(host->opt_int(o, "threads"), 2);
    assert_true(host->opt_float(o, "scale") == 1.0);
    assert_int_equal(host->opt_bool(o, "fast-math"), 1);
    assert_string_equal(host->opt_str(o, "label"), "file");
    char where[4200];
    snprintf(where, sizeof where, "%s: plugins: kernels.opts.threads", f.cfg_path);
    assert_string_equal(tmx_opt_where(host, o, "threads"), where);
    fx_close(&f);

    /* env > file; the variable's name upper-cases and turns '-' into '_'. */
    setenv("TMX_KERNELS_OPTS_SCALE", "2.5", 1);
    setenv("TMX_KERNELS_OPTS_FAST_MATH", "false", 1);
    setenv("TMX_KERNELS_OPTS_LABEL", "env", 1);
    fx_open(&f, json, NULL);
    o = tmx_plugins_opts(f.ps, load_ok(&f, TMX_PLUGIN_KERNELS, "opts"));
    assert_int_equal(host->opt_int(o, "threads"), 2);
    assert_true(host->opt_float(o, "scale") == 2.5);
    assert_int_equal(host->opt_bool(o, "fast-math"), 0);
    assert_string_equal(host->opt_str(o, "label"), "env");
    assert_string_equal(tmx_opt_where(host, o, "fast-math"),
                        "TMX_KERNELS_OPTS_FAST_MATH: kernels.opts.fast-math");
    fx_close(&f);

    /* command line > env; the last --set wins. */
    fx_open(&f, json, "kernels.opts.scale=3.5", "kernels.opts.label=one",
            "kernels.opts.label=two", NULL);
    o = tmx_plugins_opts(f.ps, load_ok(&f, TMX_PLUGIN_KERNELS, "opts"));
    assert_true(host->opt_float(o, "scale") == 3.5);
    assert_string_equal(host->opt_str(o, "label"), "two");
    assert_int_equal(host->opt_bool(o, "fast-math"), 0);
    assert_string_equal(tmx_opt_where(host, o, "label"), "command line: kernels.opts.label");
    fx_close(&f);
}

/* Loading kernels.opts with this file and these overrides is refused naming every `what`. */
static void expect_option_refused(const char *json, const char *set, const char *what1,
                                  const char *what2) {
    struct fixture f;
    fx_open(&f, json, set, NULL);
    const struct tmx_plugin *p;
    char *err = NULL;
    assert_int_equal(tmx_plugins_load(f.ps, TMX_PLUGIN_KERNELS, "opts", &p, &err),
                     TMX_ERR_INVALID);
    assert_message(err, "kernels.opts", what1, what2, f.cfg_path ? f.cfg_path : "", NULL);
    assert_int_equal(tmx_plugins_count(f.ps), 0);
    free(err);
    fx_close(&f);
}

static void test_option_errors(void **state) {
    (void)state;
    expect_option_refused("{\"plugins\": {\"kernels.opts\": {\"thread\": 2}}}", NULL,
                          "has no option 'thread'", "options: threads, scale");
    expect_option_refused("{\"plugins\": {\"kernels.opts\": {\"threads\": \"2\"}}}", NULL,
                          "option 'threads'", "must be an integer, got a string");
    expect_option_refused("{\"plugins\": {\"kernels.opts\": {\"label\": 2}}}", NULL,
                          "option 'label'", "must be a string");
    expect_option_refused(NULL, "kernels.opts.nope=1", "command line", "has no option 'nope'");
    expect_option_refused(NULL, "kernels.opts.fast-math=maybe", "command line",
                          "'maybe' is not a boolean");
    expect_option_refused(NULL, "kernels.opts.threads=1.5", "command line",
                          "'1.5' is not an integer");
    setenv("TMX_KERNELS_OPTS_SCALE", "fast", 1);
    expect_option_refused(NULL, NULL, "TMX_KERNELS_OPTS_SCALE", "'fast' is not a number");
    unsetenv("TMX_KERNELS_OPTS_SCALE");

    /* The brief's own case: an unknown option of an example plugin in a config file. */
    struct fixture f;
    fx_open(&f, "{\"plugins\": {\"codec.int8\": {\"bits\": 4}}}", NULL);
    const struct tmx_plugin *p;
    char *err = NULL;
    assert_int_equal(tmx_plugins_load(f.ps, TMX_PLUGIN_CODEC, "int8", &p, &err), TMX_ERR_INVALID);
    assert_message(err, f.cfg_path, "codec.int8", "'bits'", "no options", NULL);
    free(err);
    fx_close(&f);
}

static void test_load_configured(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, "{\"load\": [\"codec.int8\", \"media.bytes\", \"codec.int8\"]}", NULL);
    assert_int_equal(tmx_plugins_load_configured(f.ps, NULL), TMX_OK);
    assert_int_equal(tmx_plugins_count(f.ps), 2);
    assert_string_equal(tmx_plugins_at(f.ps, 1, NULL)->name, "bytes");
    fx_close(&f);

    fx_open(&f, NULL, "load=media.bytes,drafter.absent", NULL);
    char *err = NULL;
    assert_int_equal(tmx_plugins_load_configured(f.ps, &err), TMX_ERR_NOT_FOUND);
    assert_message(err, "drafter.absent", NULL);
    free(err);
    fx_close(&f);
}

/* --- the example plugins ------------------------------------------------------------------- */

static void test_kernels_example(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, "kernels=example", NULL);
    struct tmx_kernels k;
    char *err = NULL;
    assert_int_equal(tmx_kernels_open(f.ps, NULL, &k, &err), TMX_ERR_UNSUPPORTED);
    assert_message(err, PLUGIN("kernels-example"), "'embed'", NULL);
    assert_null(k.ops);
    free(err);
    err = NULL;
    assert_int_equal(tmx_kernels_open(f.ps, "short", &k, &err), TMX_ERR_UNSUPPORTED);
    assert_message(err, PLUGIN("kernels-short"), "'init'", NULL);
    free(err);

    /* What it does implement works: y[2][3] = x[2][4] . w[3][4]^T. */
    const struct tmx_kernels_i *ops = load_ok(&f, TMX_PLUGIN_KERNELS, "example")->ops;
    void *ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), NULL, &ctx, NULL), TMX_OK);
    const float x[2][4] = {{1, 2, 3, 4}, {-1, 0.5f, 0, 2}};
    float w[3][4] = {{1, 0, 0, 0}, {0.5f, 0.5f, 0.5f, 0.5f}, {-2, 1, 0, 0.25f}};
    uint16_t w16[3][4];
    for (int i = 0; i < 12; i++) w16[i / 4][i % 4] = tmx_f32_to_bf16(w[i / 4][i % 4]);
    const float want[2][3] = {{1, 5, 1}, {-1, 0.75f, 3}};
    float *dx, *dy;
    assert_int_equal(ops->buf_alloc(ctx, sizeof x, (void **)&dx), TMX_OK);
    assert_int_equal(ops->buf_alloc(ctx, sizeof want, (void **)&dy), TMX_OK);
    assert_int_equal(ops->buf_write(ctx, dx, x, sizeof x), TMX_OK);
    struct tmx_tensor hosts[2] = {{TMX_DTYPE_F32, 2, {3, 4}, w}, {TMX_DTYPE_BF16, 2, {3, 4}, w16}};
    for (int t = 0; t < 2; t++) {
        struct tmx_tensor dev;
        float y[2][3];
        assert_int_equal(ops->weight_import(ctx, &hosts[t], &dev, NULL), TMX_OK);
        ops->matmul(ctx, dy, dx, &dev, 2);
        assert_int_equal(ops->sync(ctx), TMX_OK);
        assert_int_equal(ops->buf_read(ctx, y, dy, sizeof y), TMX_OK);
        for (int i = 0; i < 6; i++) assert_true(y[i / 3][i % 3] == want[i / 3][i % 3]);
        ops->weight_free(ctx, &dev);
    }
    /* An op that cannot run records the failure for the next sync. */
    struct tmx_tensor bad = {TMX_DTYPE_U8, 2, {3, 4}, w};
    ops->matmul(ctx, dy, dx, &bad, 2);
    assert_int_equal(ops->sync(ctx), TMX_ERR_UNSUPPORTED);
    ops->buf_free(ctx, dx);
    ops->buf_free(ctx, dy);
    ops->fini(ctx);
    fx_close(&f);
}

static void test_kernels_cpu(void **state) {
    (void)state;
    if (access(TMX_BIN_DIR "/libtmx-kernels-cpu.so", F_OK) != 0) {
        print_message("skipped: %s not built yet\n", TMX_BIN_DIR "/libtmx-kernels-cpu.so");
        skip();
    }
    struct fixture f;
    fx_open(&f, NULL, "plugin_dir=" TMX_BIN_DIR, NULL);
    struct tmx_kernels k;
    char *err = NULL;
    if (tmx_kernels_open(f.ps, NULL, &k, &err) != TMX_OK) fail_msg("%s", err);
    assert_string_equal(k.plugin->name, "cpu");
    assert_ptr_equal(k.ops, k.plugin->ops);
    tmx_kernels_close(&k);
    assert_null(k.ops);
    fx_close(&f);
}

/* Reproducible uniform numbers in [-1, 1). */
static float next_uniform(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / (float)(1u << 23) - 1.0f;
}

static void test_codec_int8(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_plugin *p = load_ok(&f, TMX_PLUGIN_CODEC, "int8");
    const struct tmx_codec_i *ops = p->ops;
    assert_string_equal(ops->quant_method, "int8_absmax");
    void *ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), tmx_plugins_opts(f.ps, p), &ctx, NULL), TMX_OK);

    /* a layer of 3 experts, latent 8, inter 12; expert 1's gate has an all-zero row */
    enum { E = 3, LAT = 8, INTER = 12 };
    static float gate[E][INTER][LAT], up[E][INTER][LAT], down[E][LAT][INTER];
    uint32_t seed = 7;
    for (int e = 0; e < E; e++)
        for (int i = 0; i < INTER * LAT; i++) {
            gate[e][i / LAT][i % LAT] = e == 1 && i / LAT == 4 ? 0.0f : next_uniform(&seed);
            up[e][i / LAT][i % LAT] = next_uniform(&seed);
            down[e][i / INTER][i % INTER] = next_uniform(&seed) * (float)(e + 1);
        }
    const float *g[E], *u[E], *d[E];
    for (int e = 0; e < E; e++) g[e] = &gate[e][0][0], u[e] = &up[e][0][0], d[e] = &down[e][0][0];
    char dir[] = "/tmp/tmx-int8-XXXXXX", sub[64], path[96];
    assert_non_null(mkdtemp(dir));
    snprintf(sub, sizeof sub, "%s/int8", dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    double proxy[E * 3];
    struct tmx_codec_encode_job job = {.out_dir = dir, .layer = 2, .n_experts = E, .latent = LAT,
                                       .inter = INTER, .gate = g, .up = u, .down = d, .bits = 8,
                                       .n_threads = 1, .proxy_err = proxy};
    assert_int_equal(ops->layer_encode(ctx, &job, NULL), TMX_OK);
    for (int i = 0; i < E * 3; i++) assert_true(proxy[i] > 0.0 && proxy[i] < 1e-3);

    void *layer = NULL;
    struct tmx_codec_layer_info info = {dir, 2, E, LAT, INTER};
    assert_int_equal(ops->layer_load(ctx, &info, &layer, NULL), TMX_OK);
    float back[INTER * LAT];
    assert_int_equal(ops->expert_decode(ctx, layer, 1, 0, back, NULL), TMX_OK);
    for (int r = 0; r < INTER; r++) {
        float absmax = 0.0f;
        for (int c = 0; c < LAT; c++) absmax = fmaxf(absmax, fabsf(gate[1][r][c]));
        for (int c = 0; c < LAT; c++)
            assert_true(fabsf(back[r * LAT + c] - gate[1][r][c]) <= absmax / 127.0f * 0.5001f);
    }
    for (int c = 0; c < LAT; c++) assert_true(back[4 * LAT + c] == 0.0f);

    /* one token routed to experts 2 and 0: the expert block against the decoded weights */
    float z[LAT], out[LAT], want[LAT] = {0}, wg[INTER * LAT], wu[INTER * LAT], wd[LAT * INTER];
    for (int i = 0; i < LAT; i++) z[i] = next_uniform(&seed);
    const int32_t ids[2] = {2, 0};
    const float rw[2] = {0.7f, 0.3f};
    for (int j = 0; j < 2; j++) {
        ops->expert_decode(ctx, layer, ids[j], 0, wg, NULL);
        ops->expert_decode(ctx, layer, ids[j], 1, wu, NULL);
        ops->expert_decode(ctx, layer, ids[j], 2, wd, NULL);
        double h[INTER], y[LAT], ss = 0.0;
        for (int r = 0; r < INTER; r++) {
            double a = 0.0, b = 0.0;
            for (int c = 0; c < LAT; c++) a += wg[r * LAT + c] * z[c], b += wu[r * LAT + c] * z[c];
            h[r] = a / (1.0 + exp(-a)) * b;
        }
        for (int r = 0; r < LAT; r++) {
            y[r] = 0.0;
            for (int c = 0; c < INTER; c++) y[r] += wd[r * INTER + c] * h[c];
            ss += y[r] * y[r];
        }
        for (int r = 0; r < LAT; r++)
            want[r] += (float)(rw[j] * y[r] / sqrt(ss / LAT + 1e-6) * (0.5 + r / 16.0));
    }
    float pn[LAT];
    for (int r = 0; r < LAT; r++) pn[r] = 0.5f + (float)r / 16.0f;
    const struct tmx_tensor post_norm = {TMX_DTYPE_F32, 1, {LAT}, pn};
    assert_int_equal(ops->moe_experts(ctx, layer, out, z, ids, rw, 1, 2, &post_norm, 1e-6f, NULL),
                     TMX_OK);
    for (int r = 0; r < LAT; r++) assert_true(fabsf(out[r] - want[r]) <= 1e-4f);
    ops->layer_free(ctx, layer);

    char *err = NULL; /* a layer whose file is missing */
    info.layer = 3;
    assert_int_equal(ops->layer_load(ctx, &info, &layer, &err), TMX_ERR_NOT_FOUND);
    assert_message(err, "layer-003.safetensors", NULL);
    free(err);
    ops->fini(ctx);
    snprintf(path, sizeof path, "%s/layer-002.safetensors", sub);
    remove(path);
    rmdir(sub);
    rmdir(dir);
    fx_close(&f);
}

static void test_drafter_repeat(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_plugin *p = load_ok(&f, TMX_PLUGIN_DRAFTER, "repeat");
    const struct tmx_drafter_i *ops = p->ops;
    void *ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), tmx_plugins_opts(f.ps, p), &ctx, NULL), TMX_OK);
    int32_t draft[8];
    /* "5 6 7" occurred before, followed by 8 9 1 2 ... */
    const int32_t a[] = {5, 6, 7, 8, 9, 1, 2, 5, 6, 7};
    assert_int_equal(ops->propose(ctx, a, 10, draft, 4), 4);
    assert_memory_equal(draft, ((int32_t[]){8, 9, 1, 2}), 4 * sizeof(int32_t));
    /* The most recent occurrence wins; the continuation may run up to the end. */
    const int32_t b[] = {3, 4, 1, 3, 4, 2, 0, 3, 4};
    assert_int_equal(ops->propose(ctx, b, 9, draft, 8), 4);
    assert_memory_equal(draft, ((int32_t[]){2, 0, 3, 4}), 4 * sizeof(int32_t));
    /* Only the last token matches: the 1-gram fallback. */
    const int32_t c[] = {1, 2, 3, 9, 3};
    assert_int_equal(ops->propose(ctx, c, 5, draft, 8), 2);
    assert_memory_equal(draft, ((int32_t[]){9, 3}), 2 * sizeof(int32_t));
    const int32_t d[] = {1, 2, 3, 4};
    assert_int_equal(ops->propose(ctx, d, 4, draft, 8), 0);
    assert_int_equal(ops->propose(ctx, d, 1, draft, 8), 0);
    assert_int_equal(ops->propose(ctx, a, 10, draft, 0), 0);
    ops->fini(ctx);
    fx_close(&f);

    /* Its option reaches init, which checks it. */
    fx_open(&f, NULL, "drafter.repeat.ngram=0", NULL);
    p = load_ok(&f, TMX_PLUGIN_DRAFTER, "repeat");
    char *err = NULL;
    ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), tmx_plugins_opts(f.ps, p), &ctx, &err),
                     TMX_ERR_INVALID);
    assert_message(err, "ngram", "got 0", NULL);
    free(err);
    ops->fini(ctx);
    fx_close(&f);
}

static void test_media_bytes(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, NULL);
    const struct tmx_media_i *ops = load_ok(&f, TMX_PLUGIN_MEDIA, "bytes")->ops;
    assert_string_equal(ops->mime_types[0], "application/octet-stream");
    assert_null(ops->mime_types[1]);
    void *ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), NULL, &ctx, NULL), TMX_OK);
    uint8_t bytes[40];
    for (int i = 0; i < 40; i++) bytes[i] = (uint8_t)(i * 37);
    float *emb = NULL;
    int n = 0;
    assert_int_equal(ops->embed(ctx, "application/octet-stream", bytes, 40, 20, &emb, &n, NULL),
                     TMX_OK);
    assert_int_equal(n, 3); /* 16 + 16 + 8 bytes */
    for (int t = 0; t < 3; t++) {
        const int len = t < 2 ? 16 : 8;
        for (int i = 0; i < 20; i++)
            assert_true(emb[t * 20 + i] == (float)bytes[t * 16 + i % len] / 127.5f - 1.0f);
    }
    free(emb);
    char *err = NULL;
    assert_int_equal(ops->embed(ctx, "image/png", bytes, 40, 20, &emb, &n, &err),
                     TMX_ERR_UNSUPPORTED);
    assert_message(err, "image/png", NULL);
    free(err);
    err = NULL;
    assert_int_equal(ops->embed(ctx, "application/octet-stream", bytes, 0, 20, &emb, &n, &err),
                     TMX_ERR_INVALID);
    free(err);
    ops->fini(ctx);
    fx_close(&f);
}

struct api_run {
    const struct tmx_api_i *ops;
    void *ctx;
    enum tmx_status st;
};

static void *api_thread(void *arg) {
    struct api_run *r = arg;
    r->st = r->ops->run(r->ctx, NULL);
    return NULL;
}

static void test_api_null(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, "log_level=warn", NULL);
    const struct tmx_api_i *ops = load_ok(&f, TMX_PLUGIN_API, "null")->ops;
    /* run blocks in its own thread until stop; then a stop that comes before run. */
    for (int stop_first = 0; stop_first < 2; stop_first++) {
        struct api_run r = {ops, NULL, TMX_ERR_INVALID};
        assert_int_equal(ops->init(tmx_host_get(), NULL, NULL, &r.ctx, NULL), TMX_OK);
        pthread_t th;
        if (stop_first) ops->stop(r.ctx);
        assert_int_equal(pthread_create(&th, NULL, api_thread, &r), 0);
        if (!stop_first) ops->stop(r.ctx);
        assert_int_equal(pthread_join(th, NULL), 0);
        assert_int_equal(r.st, TMX_OK);
        ops->fini(r.ctx);
    }
    ops->fini(NULL);
    fx_close(&f);
}

/* Runs the bench with `filter` into a temporary file; returns its JSON lines, checked. */
static int bench_lines(const struct tmx_bench_i *ops, void *ctx, const char *filter) {
    FILE *out = tmpfile();
    assert_int_equal(ops->run(ctx, filter, fileno(out), NULL), TMX_OK);
    rewind(out);
    char line[512];
    int n = 0;
    for (; fgets(line, sizeof line, out); n++) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        if (!j) fail_msg("bench line \"%s\" is not JSON: %s", line, je.text);
        assert_non_null(strstr(json_string_value(json_object_get(j, "case")), "memcpy-"));
        assert_true(json_integer_value(json_object_get(j, "bytes")) >= 4096);
        assert_true(json_integer_value(json_object_get(j, "iters")) >= 1);
        assert_true(json_number_value(json_object_get(j, "ns_per_iter")) > 0);
        assert_true(json_number_value(json_object_get(j, "gb_per_s")) > 0);
        json_decref(j);
    }
    fclose(out);
    return n;
}

static void test_bench_memcpy(void **state) {
    (void)state;
    struct fixture f;
    fx_open(&f, NULL, "bench.memcpy.min_time_ms=1", NULL);
    const struct tmx_plugin *p = load_ok(&f, TMX_PLUGIN_BENCH, "memcpy");
    const struct tmx_bench_i *ops = p->ops;
    void *ctx = NULL;
    assert_int_equal(ops->init(tmx_host_get(), tmx_plugins_opts(f.ps, p), &ctx, NULL), TMX_OK);
    assert_int_equal(bench_lines(ops, ctx, NULL), 3);
    assert_int_equal(bench_lines(ops, ctx, "4KiB"), 1);
    assert_int_equal(bench_lines(ops, ctx, "nothing"), 0);
    ops->fini(ctx);
    fx_close(&f);
}

static void test_host_table(void **state) {
    (void)state;
    const struct tmx_host *h = tmx_host_get();
    assert_int_equal(h->struct_size, sizeof(struct tmx_host));
    assert_int_equal(h->abi_major, TMX_ABI_MAJOR);
    assert_int_equal(h->abi_minor, TMX_ABI_MINOR);
    assert_non_null(h->log);
    char *err = NULL;
    assert_int_equal(h->err(&err, TMX_ERR_IO, "%s: %d", "x", 3), TMX_ERR_IO);
    assert_string_equal(err, "x: 3");
    free(err);
    assert_string_equal(tmx_plugin_kind_name(TMX_PLUGIN_BENCH), "bench");
    assert_int_equal(tmx_plugin_kind_from_name("drafter"), TMX_PLUGIN_DRAFTER);
    assert_int_equal(tmx_plugin_kind_from_name("drafters"), TMX_PLUGIN_KIND_COUNT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_refusals, clear_env),
        cmocka_unit_test_setup(test_refuse_missing_file, clear_env),
        cmocka_unit_test_setup(test_refuse_dlopen_error, clear_env),
        cmocka_unit_test_setup(test_refuse_duplicate, clear_env),
        cmocka_unit_test_setup(test_search_order, clear_env),
        cmocka_unit_test_setup(test_option_precedence, clear_env),
        cmocka_unit_test_setup(test_option_errors, clear_env),
        cmocka_unit_test_setup(test_load_configured, clear_env),
        cmocka_unit_test_setup(test_kernels_example, clear_env),
        cmocka_unit_test_setup(test_kernels_cpu, clear_env),
        cmocka_unit_test_setup(test_codec_int8, clear_env),
        cmocka_unit_test_setup(test_drafter_repeat, clear_env),
        cmocka_unit_test_setup(test_media_bytes, clear_env),
        cmocka_unit_test_setup(test_api_null, clear_env),
        cmocka_unit_test_setup(test_bench_memcpy, clear_env),
        cmocka_unit_test_setup(test_host_table, clear_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
