/* test_api_openai.c: the text side of the openai front end (plugins/api-openai/text.h): the
 * streaming UTF-8 repair, stop-string search and hold-back, and the tool-call formats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "text.h"

/* Pushes each piece in turn and returns everything emitted (static storage). */
static const char *repair(const char *const *pieces, int n, int flush) {
    static char out[256];
    struct utf8_dec d = {0};
    struct buf b = {0};
    for (int i = 0; i < n; i++) utf8_push(&d, pieces[i], strlen(pieces[i]), &b);
    if (flush) utf8_flush(&d, &b);
    snprintf(out, sizeof out, "%s", b.p ? b.p : "");
    buf_free(&b);
    return out;
}

#define FFFD "\xEF\xBF\xBD"

static void test_utf8_split_sequences(void **state) {
    (void)state;
    const char *e_acute[] = {"caf\xC3", "\xA9!"};
    assert_string_equal(repair(e_acute, 2, 0), "caf\xC3\xA9!");
    const char *emoji[] = {"\xF0", "\x9F", "\x98", "\x80"};
    assert_string_equal(repair(emoji, 4, 0), "\xF0\x9F\x98\x80");
    /* nothing of an incomplete sequence comes out before it completes */
    const char *half[] = {"ab\xE2\x82"};
    assert_string_equal(repair(half, 1, 0), "ab");
    assert_string_equal(repair(half, 1, 1), "ab" FFFD);
}

static void test_utf8_invalid_bytes(void **state) {
    (void)state;
    const char *lone[] = {"a\xFF" "b\x80"};
    assert_string_equal(repair(lone, 1, 1), "a" FFFD "b" FFFD);
    const char *cut[] = {"\xE2\x82", "A"}; /* a sequence broken by ASCII: one U+FFFD, then A */
    assert_string_equal(repair(cut, 2, 1), FFFD "A");
    const char *overlong[] = {"\xC0\xAF"};
    assert_string_equal(repair(overlong, 1, 1), FFFD FFFD);
    const char *surrogate[] = {"\xED\xA0\x80"};
    assert_string_equal(repair(surrogate, 1, 1), FFFD FFFD FFFD);
    const char *too_big[] = {"\xF4\x90\x80\x80"};
    assert_string_equal(repair(too_big, 1, 1), FFFD FFFD FFFD FFFD);
    const char *max[] = {"\xF4\x8F\xBF\xBF"};
    assert_string_equal(repair(max, 1, 1), "\xF4\x8F\xBF\xBF");
}

static void test_stop_strings(void **state) {
    (void)state;
    char *stops[] = {"world", "lo w", "zz"};
    const char *t = "hello world";
    assert_int_equal(text_find_any(t, strlen(t), 0, stops, 3), 3); /* "lo w" comes first */
    assert_int_equal(text_find_any(t, strlen(t), 4, stops, 3), 6);
    assert_true(text_find_any(t, strlen(t), 0, stops + 2, 1) == SIZE_MAX);
    assert_int_equal(text_partial_suffix("say wor", 7, stops, 3), 3);
    assert_int_equal(text_partial_suffix("say z", 5, stops, 3), 1);
    /* a whole match is no proper prefix: "z" is the longest */
    assert_int_equal(text_partial_suffix("say zz", 6, stops, 3), 1);
    assert_int_equal(text_partial_suffix("abc", 3, stops, 3), 0);
    assert_int_equal(text_partial_suffix("", 0, stops, 3), 0);
    char *empty[] = {""};
    assert_int_equal(text_partial_suffix("abc", 3, empty, 1), 0);
}

static void test_tool_call_start(void **state) {
    (void)state;
    size_t hold;
    const char *h = "Sure. <tool_call>{\"name\": \"f\"}";
    assert_int_equal(tool_starts_at(TOOL_FORMAT_HERMES, h, strlen(h), &hold), 6);
    assert_true(tool_starts_at(TOOL_FORMAT_HERMES, "Sure <tool_", 11, &hold) == SIZE_MAX);
    assert_int_equal(hold, 6);
    assert_int_equal(tool_starts_at(TOOL_FORMAT_LLAMA3, "  {\"na", 6, &hold), 2);
    assert_true(tool_starts_at(TOOL_FORMAT_LLAMA3, " \n", 2, &hold) == SIZE_MAX);
    assert_int_equal(hold, 2);
    const char *l = "Let me check.<|python_tag|>{";
    assert_int_equal(tool_starts_at(TOOL_FORMAT_LLAMA3, l, strlen(l), &hold), 13);
    assert_true(tool_starts_at(TOOL_FORMAT_LLAMA3, "Hi {", 4, &hold) == SIZE_MAX);
    assert_int_equal(hold, 0);
}

static void check_call(const json_t *calls, size_t i, const char *name, const char *args) {
    json_t *c = json_array_get(calls, i);
    assert_non_null(c);
    assert_string_equal(json_string_value(json_object_get(c, "name")), name);
    assert_string_equal(json_string_value(json_object_get(c, "arguments")), args);
}

static void test_hermes_calls(void **state) {
    (void)state;
    const char *t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
                    "\n</tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call>\n";
    json_t *calls = tool_calls_parse(TOOL_FORMAT_HERMES, t, strlen(t));
    assert_non_null(calls);
    assert_int_equal(json_array_size(calls), 2);
    check_call(calls, 0, "get_weather", "{\"city\":\"Paris\"}");
    check_call(calls, 1, "now", "{}");
    json_decref(calls);
    const char *open = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}";
    calls = tool_calls_parse(TOOL_FORMAT_HERMES, open, strlen(open)); /* no closing tag */
    assert_non_null(calls);
    check_call(calls, 0, "f", "{\"a\": 1}");
    json_decref(calls);
    const char *bad[] = {"<tool_call>{\"name\": \"f\"",
                         "<tool_call>{\"arguments\": {}}</tool_call>",
                         "<tool_call>{\"name\": \"f\"}</tool_call> and then some text",
                         "<tool_call>[1, 2]</tool_call>"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_null(tool_calls_parse(TOOL_FORMAT_HERMES, bad[i], strlen(bad[i])));
}

static void test_llama3_calls(void **state) {
    (void)state;
    const char *t = "{\"name\": \"f\", \"parameters\": {\"x\": [1, 2]}}; "
                    "{\"name\": \"g\", \"parameters\": {}}";
    json_t *calls = tool_calls_parse(TOOL_FORMAT_LLAMA3, t, strlen(t));
    assert_non_null(calls);
    assert_int_equal(json_array_size(calls), 2);
    check_call(calls, 0, "f", "{\"x\":[1,2]}");
    check_call(calls, 1, "g", "{}");
    json_decref(calls);
    const char *tagged = "<|python_tag|>{\"name\": \"search\", \"arguments\": {\"q\": \"tmx\"}}";
    calls = tool_calls_parse(TOOL_FORMAT_LLAMA3, tagged, strlen(tagged));
    assert_non_null(calls);
    check_call(calls, 0, "search", "{\"q\":\"tmx\"}");
    json_decref(calls);
    const char *prose = "{\"name\": \"f\"} is how you would call it";
    assert_null(tool_calls_parse(TOOL_FORMAT_LLAMA3, prose, strlen(prose)));
    assert_null(tool_calls_parse(TOOL_FORMAT_NONE, t, strlen(t)));
}

static void test_buf(void **state) {
    (void)state;
    struct buf b = {0};
    buf_addf(&b, "%d-%s", 42, "x");
    buf_adds(&b, "yz");
    assert_string_equal(b.p, "42-xyz");
    buf_clear(&b);
    assert_int_equal(b.n, 0);
    for (int i = 0; i < 1000; i++) buf_add(&b, "abcd", 4);
    assert_int_equal(b.n, 4000);
    assert_false(b.oom);
    buf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_split_sequences),
        cmocka_unit_test(test_utf8_invalid_bytes),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_tool_call_start),
        cmocka_unit_test(test_hermes_calls),
        cmocka_unit_test(test_llama3_calls),
        cmocka_unit_test(test_buf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
