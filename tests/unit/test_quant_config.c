/* test_quant_config.c: hf_quant_config.json as the core reads it (tmx_quant_config_load,
 * core/model-config.c): a missing file is no codec, a build's file gives its members, and
 * every malformed file or member is refused in one line naming the file and the member. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/model.h"

static char dir[] = "/tmp/tmx-quant-config-XXXXXX";
static char path[600];

static int setup(void **state) {
    (void)state;
    strcpy(dir, "/tmp/tmx-quant-config-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    unlink(path);
    rmdir(dir);
    return 0;
}

static void put(const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_missing_file(void **state) {
    (void)state;
    struct tmx_quant_config q;
    assert_int_equal(tmx_quant_config_load(dir, &q, NULL), TMX_OK);
    assert_int_equal(q.present, 0);
    assert_string_equal(q.codec, "");
    assert_string_equal(q.path, path);
}

static void test_build(void **state) {
    (void)state;
    put("{\"quant_method\": \"trellismx\", \"codec\": \"trellis-fp4\", \"bits\": 3, "
        "\"block_size\": 16, \"experts_per_file\": 8, \"alpha\": 0.5625, "
        "\"mxfp8_tensors\": [\"model.layers.0.self_attn.q_proj.weight\"]}\n");
    struct tmx_quant_config q;
    assert_int_equal(tmx_quant_config_load(dir, &q, NULL), TMX_OK);
    assert_int_equal(q.present, 1);
    assert_string_equal(q.quant_method, "trellismx");
    assert_string_equal(q.codec, "trellis-fp4");
    assert_int_equal(q.bits, 3);
    assert_int_equal(q.block_size, 16);
    assert_int_equal(q.experts_per_file, 8);
    assert_int_equal(q.mxfp8, 1);

    put("{\"quant_method\": \"int8_absmax\", \"codec\": \"int8\", \"mxfp8_tensors\": []}");
    assert_int_equal(tmx_quant_config_load(dir, &q, NULL), TMX_OK);
    assert_string_equal(q.codec, "int8");
    assert_int_equal(q.bits, 0); /* absent members stay empty: the caller decides */
    assert_int_equal(q.mxfp8, 0);
}

/* `text` must be refused with TMX_ERR_INVALID in one line naming the file and `what`. */
static void expect_refused(const char *text, const char *what) {
    put(text);
    struct tmx_quant_config q;
    char *err = NULL;
    assert_int_equal(tmx_quant_config_load(dir, &q, &err), TMX_ERR_INVALID);
    assert_non_null(err);
    if (!strstr(err, path) || !strstr(err, what) || strchr(err, '\n'))
        fail_msg("message \"%s\" lacks \"%s\" or \"%s\"", err, path, what);
    assert_int_equal(q.present, 0);
    free(err);
}

static void test_refused(void **state) {
    (void)state;
    expect_refused("{\"codec\": \"trellis-e4m3\",", ":1:"); /* where jansson stopped */
    expect_refused("[\"trellis-e4m3\"]", "not a JSON object");
    expect_refused("{\"codec\": \"a\", \"codec\": \"b\"}", "duplicate");
    expect_refused("{\"codec\": 3}", "\"codec\"");
    expect_refused("{\"quant_method\": [\"trellismx\"]}", "\"quant_method\"");
    expect_refused("{\"codec\": \"trellis-e4m3\", \"bits\": \"3\"}", "\"bits\"");
    expect_refused("{\"block_size\": -16}", "\"block_size\"");
    expect_refused("{\"experts_per_file\": 2.5}", "\"experts_per_file\"");
    expect_refused("{\"mxfp8_tensors\": \"all\"}", "\"mxfp8_tensors\"");
    char long_name[200] = "{\"codec\": \"";
    memset(long_name + strlen(long_name), 'x', 100);
    strcpy(long_name + strlen(long_name), "\"}");
    expect_refused(long_name, "\"codec\"");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_missing_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_build, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refused, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
