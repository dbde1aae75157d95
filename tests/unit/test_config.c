/* test_config.c: the configuration file, its environment and command-line overrides, and the
 * messages for every kind of bad input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tmx/config.h"

static const char *const core_env[] = {"TMX_PLUGIN_DIR", "TMX_KERNELS", "TMX_LOAD",
                                       "TMX_THREADS",    "TMX_CONTEXT", "TMX_BATCH",
                                       "TMX_SEED",       "TMX_LOG_LEVEL"};

static int clear_env(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof core_env / sizeof core_env[0]; i++) unsetenv(core_env[i]);
    return 0;
}

/* Writes `text` to a new temporary file; the caller unlinks and frees the path. */
static char *write_temp(const char *text) {
    char *path = strdup("/tmp/tmx-test-config-XXXXXX.json");
    int fd = mkstemps(path, 5);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

/* A refusal: status st and one line that names every string in the NULL-terminated list. */
static void assert_message(const char *err, ...) {
    assert_non_null(err);
    assert_null(strchr(err, '\n'));
    va_list ap;
    va_start(ap, err);
    for (const char *s; (s = va_arg(ap, const char *));) {
        if (!strstr(err, s)) fail_msg("message \"%s\" lacks \"%s\"", err, s);
    }
    va_end(ap);
}

/* Loads a file holding `text` and expects it refused with st, naming the file and `what`. */
static void expect_refused(const char *text, enum tmx_status st, const char *what) {
    char *path = write_temp(text), *err = NULL;
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(path, &cfg, &err), st);
    assert_null(cfg);
    assert_message(err, path, what, NULL);
    free(err);
    unlink(path);
    free(path);
}

static void test_defaults(void **state) {
    (void)state;
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    assert_string_equal(tmx_config_str(cfg, "plugin_dir"), "");
    assert_string_equal(tmx_config_str(cfg, "kernels"), "cpu");
    assert_int_equal(tmx_config_load_count(cfg), 0);
    assert_int_equal(tmx_config_int(cfg, "threads"), 0);
    assert_int_equal(tmx_config_int(cfg, "context"), 4096);
    assert_int_equal(tmx_config_int(cfg, "batch"), 512);
    assert_int_equal(tmx_config_int(cfg, "seed"), -1);
    assert_string_equal(tmx_config_str(cfg, "log_level"), "info");
    tmx_config_free(cfg);
}

static void test_file_values(void **state) {
    (void)state;
    char *path = write_temp("{\"plugin_dir\": \"/opt/p\", \"kernels\": \"cuda\",\n"
                            " \"load\": [\"codec.int8\", \"drafter.repeat\"], \"threads\": 3,\n"
                            " \"context\": 8192, \"batch\": 64, \"seed\": 42,\n"
                            " \"log_level\": \"debug\",\n"
                            " \"plugins\": {\"drafter.repeat\": {\"ngram\": 2}}}\n");
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(path, &cfg, NULL), TMX_OK);
    assert_string_equal(tmx_config_str(cfg, "plugin_dir"), "/opt/p");
    assert_string_equal(tmx_config_str(cfg, "kernels"), "cuda");
    assert_int_equal(tmx_config_load_count(cfg), 2);
    assert_string_equal(tmx_config_load_at(cfg, 0), "codec.int8");
    assert_string_equal(tmx_config_load_at(cfg, 1), "drafter.repeat");
    assert_null(tmx_config_load_at(cfg, 2));
    assert_int_equal(tmx_config_int(cfg, "threads"), 3);
    assert_int_equal(tmx_config_int(cfg, "context"), 8192);
    assert_int_equal(tmx_config_int(cfg, "batch"), 64);
    assert_int_equal(tmx_config_int(cfg, "seed"), 42);
    assert_string_equal(tmx_config_str(cfg, "log_level"), "debug");
    tmx_config_free(cfg);
    unlink(path);
    free(path);
}

static void test_env_override(void **state) {
    (void)state;
    char *path = write_temp("{\"threads\": 3, \"kernels\": \"cuda\", \"seed\": 5}");
    setenv("TMX_THREADS", "7", 1);
    setenv("TMX_LOAD", " codec.int8 ,, media.bytes", 1);
    setenv("TMX_LOG_LEVEL", "warn", 1);
    setenv("TMX_KERNELS", "", 1); /* empty: unset, the file's value stays */
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(path, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_int(cfg, "threads"), 7);
    assert_int_equal(tmx_config_int(cfg, "seed"), 5);
    assert_string_equal(tmx_config_str(cfg, "kernels"), "cuda");
    assert_string_equal(tmx_config_str(cfg, "log_level"), "warn");
    assert_int_equal(tmx_config_load_count(cfg), 2);
    assert_string_equal(tmx_config_load_at(cfg, 0), "codec.int8");
    assert_string_equal(tmx_config_load_at(cfg, 1), "media.bytes");
    tmx_config_free(cfg);

    char *err = NULL;
    setenv("TMX_THREADS", "lots", 1);
    assert_int_equal(tmx_config_load(path, &cfg, &err), TMX_ERR_INVALID);
    assert_message(err, "TMX_THREADS", "threads", "'lots'", "integer", NULL);
    free(err);
    err = NULL;
    unsetenv("TMX_THREADS");
    setenv("TMX_LOAD", "codec", 1);
    assert_int_equal(tmx_config_load(path, &cfg, &err), TMX_ERR_INVALID);
    assert_message(err, "TMX_LOAD", "load[0]", "'codec'", "<kind>.<name>", NULL);
    free(err);
    unlink(path);
    free(path);
}

static void test_cli_override(void **state) {
    (void)state;
    setenv("TMX_THREADS", "7", 1);
    struct tmx_config *cfg = NULL;
    char *err = NULL;
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "threads=9", NULL), TMX_OK);
    assert_int_equal(tmx_config_int(cfg, "threads"), 9);
    assert_int_equal(tmx_config_set(cfg, "load=codec.int8,api.null", NULL), TMX_OK);
    assert_int_equal(tmx_config_load_count(cfg), 2);
    assert_string_equal(tmx_config_load_at(cfg, 1), "api.null");
    assert_int_equal(tmx_config_set(cfg, "load=", NULL), TMX_OK);
    assert_int_equal(tmx_config_load_count(cfg), 0);
    assert_int_equal(tmx_config_set(cfg, "plugin_dir=", NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "kernels=example", NULL), TMX_OK);
    assert_string_equal(tmx_config_str(cfg, "kernels"), "example");
    /* Plugin options are kept for the plugin's table to check. */
    assert_int_equal(tmx_config_set(cfg, "kernels.cpu.threads=4", NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "codec.trellis-e4m3.block.size=x", NULL), TMX_OK);

    static const struct {
        const char *set, *what;
    } bad[] = {
        {"threads", "key=value"},
        {"=4", "key=value"},
        {"thread=4", "unknown key 'thread'"},
        {"plugins=1", "unknown key 'plugins'"},
        {"threads=four", "'four' is not an integer"},
        {"threads=-1", "at least 0"},
        {"batch=0", "at least 1"},
        {"context=99999999999", "at most"},
        {"log_level=loud", "'loud'"},
        {"kernels=", "kernels"},
        {"kernels=../x", "'../x' is not a plugin name"},
        {"api=Open AI", "api: 'Open AI' is not a plugin name"},
        {"load=codec.int8,bogus.x", "load[1]"},
        {"kernelz.cpu.threads=1", "<kind>.<name>.<option>"},
        {"kernels.threads=1", "<kind>.<name>.<option>"},
        {"kernels.cpu.=1", "<kind>.<name>.<option>"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(tmx_config_set(cfg, bad[i].set, &err), TMX_ERR_INVALID);
        assert_message(err, "command line", bad[i].what, NULL);
        free(err);
        err = NULL;
    }
    /* A refused value leaves the previous one. */
    assert_int_equal(tmx_config_int(cfg, "threads"), 9);
    assert_string_equal(tmx_config_str(cfg, "kernels"), "example");
    tmx_config_free(cfg);
}

static void test_wrong_types(void **state) {
    (void)state;
    expect_refused("{\"threads\": \"4\"}", TMX_ERR_INVALID, "threads: must be an integer, got a string");
    expect_refused("{\"threads\": 4.0}", TMX_ERR_INVALID, "threads: must be an integer, got a real");
    expect_refused("{\"seed\": true}", TMX_ERR_INVALID, "seed: must be an integer, got a boolean");
    expect_refused("{\"kernels\": 1}", TMX_ERR_INVALID, "kernels: must be a string, got an integer");
    expect_refused("{\"plugin_dir\": null}", TMX_ERR_INVALID, "plugin_dir: must be a string");
    expect_refused("{\"load\": \"codec.int8\"}", TMX_ERR_INVALID,
                   "load: must be an array of strings, got a string");
    expect_refused("{\"load\": [\"codec.int8\", 3]}", TMX_ERR_INVALID, "load[1]: must be a string");
    expect_refused("{\"load\": [\"codec\"]}", TMX_ERR_INVALID, "load[0]: 'codec' is not");
    expect_refused("{\"plugins\": []}", TMX_ERR_INVALID, "plugins: must be an object");
    expect_refused("{\"plugins\": {\"codec.int8\": 3}}", TMX_ERR_INVALID,
                   "codec.int8: must be an object, got an integer");
    expect_refused("{\"plugins\": {\"kernelz.cpu\": {}}}", TMX_ERR_INVALID, "'kernelz.cpu'");
    expect_refused("{\"plugins\": {\"kernels.cpu\": {\"threads\": [1]}}}", TMX_ERR_INVALID,
                   "kernels.cpu option 'threads'");
    expect_refused("{\"context\": 0}", TMX_ERR_INVALID, "context: must be at least 1, got 0");
    expect_refused("{\"seed\": -2}", TMX_ERR_INVALID, "seed: must be at least -1");
    expect_refused("{\"log_level\": \"verbose\"}", TMX_ERR_INVALID, "'verbose'");
    expect_refused("[1, 2]", TMX_ERR_INVALID, "must hold a JSON object, got an array");
}

static void test_unknown_keys(void **state) {
    (void)state;
    expect_refused("{\"threads\": 2, \"thread\": 4}", TMX_ERR_INVALID, "unknown key 'thread'");
    expect_refused("{\"Kernels\": \"cpu\"}", TMX_ERR_INVALID, "unknown key 'Kernels'");
}

static void test_malformed_json(void **state) {
    (void)state;
    /* jansson's position: line 3, the column where the bad token ends. */
    char *path = write_temp("{\n  \"threads\": 4,\n  oops\n}\n"), *err = NULL;
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(path, &cfg, &err), TMX_ERR_INVALID);
    char where[300];
    snprintf(where, sizeof where, "%s:3:", path);
    assert_message(err, where, NULL);
    free(err);
    unlink(path);
    free(path);

    expect_refused("{\"threads\": 1, \"threads\": 2}", TMX_ERR_INVALID, "duplicate");
    expect_refused("", TMX_ERR_INVALID, ":1:");

    err = NULL;
    assert_int_equal(tmx_config_load("/nonexistent/tmx.json", &cfg, &err), TMX_ERR_IO);
    assert_message(err, "/nonexistent/tmx.json", NULL);
    free(err);
}

/* Runs tmx_config_print with stdout sent to a file, and parses what it wrote. */
static json_t *printed(const struct tmx_config *cfg) {
    char *path = write_temp("");
    fflush(stdout);
    int saved = dup(STDOUT_FILENO), fd = open(path, O_WRONLY | O_TRUNC);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, STDOUT_FILENO);
    close(fd);
    tmx_config_print(cfg);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) fail_msg("printed config does not parse: %s", je.text);
    unlink(path);
    free(path);
    return j;
}

static void test_print(void **state) {
    (void)state;
    char *path = write_temp("{\"threads\": 3, \"load\": [\"codec.int8\"],\n"
                            " \"plugins\": {\"drafter.repeat\": {\"ngram\": 2}}}");
    setenv("TMX_BATCH", "32", 1);
    struct tmx_config *cfg = NULL;
    assert_int_equal(tmx_config_load(path, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "seed=11", NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "drafter.repeat.ngram=4", NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "kernels.cpu.label=fast", NULL), TMX_OK);
    json_t *j = printed(cfg);
    assert_string_equal(json_string_value(json_object_get(j, "kernels")), "cpu");
    assert_string_equal(json_string_value(json_object_get(j, "plugin_dir")), "");
    assert_int_equal(json_integer_value(json_object_get(j, "threads")), 3);
    assert_int_equal(json_integer_value(json_object_get(j, "batch")), 32);
    assert_int_equal(json_integer_value(json_object_get(j, "seed")), 11);
    assert_int_equal(json_integer_value(json_object_get(j, "context")), 4096);
    assert_string_equal(json_string_value(json_object_get(j, "log_level")), "info");
    assert_true(json_is_true(json_object_get(j, "warmup")));
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "load"), 0)),
                        "codec.int8");
    json_t *plugins = json_object_get(j, "plugins");
    assert_int_equal(json_integer_value(json_object_get(json_object_get(plugins, "drafter.repeat"),
                                                        "ngram")),
                     4);
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(plugins, "kernels.cpu"), "label")),
        "fast");
    assert_int_equal(json_object_size(j), 22); /* every core key and "plugins" */
    json_decref(j);
    tmx_config_free(cfg);
    unlink(path);
    free(path);

    /* What it prints loads back as the same configuration. */
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    j = printed(cfg);
    char *text = json_dumps(j, 0);
    path = write_temp(text);
    struct tmx_config *again = NULL;
    assert_int_equal(tmx_config_load(path, &again, NULL), TMX_OK);
    assert_int_equal(tmx_config_int(again, "batch"), 32);
    tmx_config_free(again);
    free(text);
    json_decref(j);
    tmx_config_free(cfg);
    unlink(path);
    free(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_defaults, clear_env),
        cmocka_unit_test_setup(test_file_values, clear_env),
        cmocka_unit_test_setup(test_env_override, clear_env),
        cmocka_unit_test_setup(test_cli_override, clear_env),
        cmocka_unit_test_setup(test_wrong_types, clear_env),
        cmocka_unit_test_setup(test_unknown_keys, clear_env),
        cmocka_unit_test_setup(test_malformed_json, clear_env),
        cmocka_unit_test_setup(test_print, clear_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
