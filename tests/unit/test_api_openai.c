/* test_api_openai.c: the text side of the openai front end (plugins/api-openai/text.h): the
 * streaming UTF-8 repair, stop-string search and hold-back, the tool-call formats, and the
 * harmony reader, fed whole and in every split a stream can bring. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The stop automata against the plain search, on random texts over two letters (where
 * borders are long) fed in random pieces: the same first match, the same held-back tail. */
static void test_stops_match_search(void **state) {
    (void)state;
    uint64_t rng = 7;
    for (int round = 0; round < 2000; round++) {
        char strs_mem[4][12];
        char *strs[4];
        const int n = 1 + (int)(splitmix(&rng) % 4);
        for (int i = 0; i < n; i++) {
            const int len = 1 + (int)(splitmix(&rng) % 11);
            for (int k = 0; k < len; k++) strs_mem[i][k] = "ab"[splitmix(&rng) % 2];
            strs_mem[i][len] = 0;
            strs[i] = strs_mem[i];
        }
        char text[64];
        const size_t n_text = 1 + splitmix(&rng) % 63;
        for (size_t k = 0; k < n_text; k++) text[k] = "ab"[splitmix(&rng) % 2];
        struct stops s;
        assert_true(stops_init(&s, strs, n));
        struct stops_scan scan = {0};
        size_t fed = 0, at = SIZE_MAX, scanned = 0;
        while (fed < n_text && at == SIZE_MAX) {
            fed += 1 + splitmix(&rng) % 5;
            fed = fed < n_text ? fed : n_text;
            at = stops_feed(&s, &scan, text, fed);
            /* the search gen.c made before: from where no earlier match can begin */
            const size_t want = text_find_any(text, fed, scanned, strs, n);
            assert_true(at == want);
            size_t longest = 0;
            for (int i = 0; i < n; i++)
                if (strlen(strs[i]) > longest) longest = strlen(strs[i]);
            scanned = fed + 1 >= longest ? fed + 1 - longest : 0;
            if (at == SIZE_MAX)
                assert_int_equal(stops_pending(&s, &scan), text_partial_suffix(text, fed, strs, n));
        }
        stops_free(&s);
    }
    /* one string of a megabyte against a text that keeps almost matching it: linear time */
    const size_t big = 1 << 20;
    char *stop = malloc(big + 1), *text = malloc(big);
    memset(stop, ' ', big);
    stop[big] = 0;
    stop[big / 2] = 'x';
    memset(text, ' ', big);
    struct stops s;
    char *strs[] = {stop};
    assert_true(stops_init(&s, strs, 1));
    struct stops_scan scan = {0};
    for (size_t fed = 4096; fed <= big; fed += 4096) {
        assert_true(stops_feed(&s, &scan, text, fed) == SIZE_MAX);
        assert_int_equal(stops_pending(&s, &scan), fed < big / 2 ? fed : big / 2);
    }
    stops_free(&s);
    free(stop);
    free(text);
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

/* --- harmony ---------------------------------------------------------------------------------- */

/* What a harmony reader made of its output: calls as sorted compact JSON ("" when none). */
struct hm_out {
    char content[512], reasoning[512], calls[512];
};

static void hm_collect(const struct harmony *h, struct hm_out *o) {
    snprintf(o->content, sizeof o->content, "%.*s", (int)h->content.n,
             h->content.p ? h->content.p : "");
    snprintf(o->reasoning, sizeof o->reasoning, "%.*s", (int)h->reasoning.n,
             h->reasoning.p ? h->reasoning.p : "");
    char *calls = h->calls ? json_dumps(h->calls, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    snprintf(o->calls, sizeof o->calls, "%s", calls ? calls : "");
    free(calls);
}

static void hm_expect(const struct harmony *h, const char *content, const char *reasoning,
                      const char *calls) {
    struct hm_out o;
    hm_collect(h, &o);
    assert_false(h->oom);
    assert_string_equal(o.content, content);
    assert_string_equal(o.reasoning, reasoning);
    assert_string_equal(o.calls, calls);
}

/* While the output is still growing, what was read is a prefix of what the whole output gives:
 * a stream never sends text it must take back, a partial control token included. */
static void hm_expect_prefix(const struct harmony *h, const char *content, const char *reasoning) {
    struct hm_out o;
    hm_collect(h, &o);
    assert_true(strncmp(o.content, content, strlen(o.content)) == 0);
    assert_true(strncmp(o.reasoning, reasoning, strlen(o.reasoning)) == 0);
}

/* Reads `out` whole, then split in two at every position, then one byte at a time. */
static void hm_check(const char *out, int max_calls, const char *content, const char *reasoning,
                     const char *calls) {
    const size_t n = strlen(out);
    struct harmony h;
    harmony_init(&h, max_calls);
    harmony_read(&h, out, n, 1);
    hm_expect(&h, content, reasoning, calls);
    harmony_read(&h, out, n, 1); /* reading an ended output again changes nothing */
    hm_expect(&h, content, reasoning, calls);
    harmony_fini(&h);
    for (size_t k = 0; k <= n; k++) {
        harmony_init(&h, max_calls);
        harmony_read(&h, out, k, 0);
        hm_expect_prefix(&h, content, reasoning);
        harmony_read(&h, out, n, 1);
        hm_expect(&h, content, reasoning, calls);
        harmony_fini(&h);
    }
    harmony_init(&h, max_calls);
    for (size_t k = 0; k <= n; k++) {
        harmony_read(&h, out, k, 0);
        hm_expect_prefix(&h, content, reasoning);
    }
    harmony_read(&h, out, n, 1);
    hm_expect(&h, content, reasoning, calls);
    harmony_fini(&h);
}

#define MANY 1000000

static void test_harmony_channels(void **state) {
    (void)state;
    /* <|return|> is a stop token, so the output usually lacks it: read with and without it */
    const char *both = "<|channel|>analysis<|message|>User says hi. Greet back.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello! \xC3\xA9t\xC3\xA9";
    hm_check(both, MANY, "Hello! \xC3\xA9t\xC3\xA9", "User says hi. Greet back.", "");
    const char *ret = "<|channel|>analysis<|message|>2+2=4<|end|><|start|>assistant"
                      "<|channel|>final<|message|>4<|return|>";
    hm_check(ret, MANY, "4", "2+2=4", "");
    hm_check("<|channel|>final<|message|>Just the answer.", MANY, "Just the answer.", "", "");
    /* text that only looks like a control token is content: "<|" alone, "<|x|>" */
    hm_check("<|channel|>final<|message|>a <| b <|x|> c", MANY, "a <| b <|x|> c", "", "");
    /* a model that skips the format: plain content */
    hm_check("Hello there", MANY, "Hello there", "", "");
    hm_check("to", MANY, "to", "", "");
    /* two analysis messages go into one reasoning; a preamble on commentary is content */
    const char *pre = "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>"
                      "analysis<|message|>B.<|end|><|start|>assistant<|channel|>commentary"
                      "<|message|>Checking.<|end|>";
    hm_check(pre, MANY, "Checking.", "A.B.", "");
}

static void test_harmony_calls(void **state) {
    (void)state;
    const char *one = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                      "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                      "<|message|>{\"location\": \"Tokyo\", \"days\": 2}<|call|>";
    hm_check(one, MANY, "", "Need weather.",
             "[{\"arguments\":\"{\\\"location\\\":\\\"Tokyo\\\",\\\"days\\\":2}\","
             "\"name\":\"get_weather\"}]");
    /* the recipient before the channel, as the template renders calls, with a bare "json" */
    const char *first = " to=functions.now<|channel|>commentary json<|message|>{}";
    hm_check(first, MANY, "", "", "[{\"arguments\":\"{}\",\"name\":\"now\"}]");
    const char *two = "<|channel|>analysis<|message|>Two lookups.<|end|>"
                      "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>"
                      "{\"a\": 1}<|call|>"
                      "<|start|>assistant to=functions.g<|channel|>commentary json<|message|>"
                      " {\"b\": [true]} <|call|>";
    const char *fg = "[{\"arguments\":\"{\\\"a\\\":1}\",\"name\":\"f\"},"
                     "{\"arguments\":\"{\\\"b\\\":[true]}\",\"name\":\"g\"}]";
    hm_check(two, MANY, "", "Two lookups.", fg);
    /* parallel_tool_calls false keeps the first; no tools offered keeps none */
    hm_check(two, 1, "", "Two lookups.", "[{\"arguments\":\"{\\\"a\\\":1}\",\"name\":\"f\"}]");
    hm_check(two, 0, "", "Two lookups.", "");
    /* arguments that are not a JSON object go out as written; none at all are {} */
    hm_check("<|channel|>commentary to=functions.f<|message|> not json ", MANY, "", "",
             "[{\"arguments\":\"not json\",\"name\":\"f\"}]");
    hm_check("<|channel|>commentary to=functions.f<|message|><|call|>", MANY, "", "",
             "[{\"arguments\":\"{}\",\"name\":\"f\"}]");
    /* a built-in tool (not functions.*) is the model's own working: reasoning, not a call */
    hm_check("<|channel|>analysis to=browser.search code<|message|>{\"q\": 1}<|call|>", MANY,
             "", "{\"q\": 1}", "");
}

static void test_harmony_partial_tokens(void **state) {
    (void)state;
    const char *out = "<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Hi<|end|>";
    struct harmony h;
    harmony_init(&h, MANY);
    const char *cut = strstr(out, "<|end|>") + 3; /* "Hm<|e" */
    harmony_read(&h, out, (size_t)(cut - out), 0);
    hm_expect(&h, "", "Hm", ""); /* "<|e" waits for the next token */
    harmony_read(&h, out, (size_t)(cut - out) + 4, 0);
    hm_expect(&h, "", "Hm", "");
    cut = strstr(out, "final") + 7; /* the header is held until its <|message|> */
    harmony_read(&h, out, (size_t)(cut - out), 0);
    hm_expect(&h, "", "Hm", "");
    harmony_read(&h, out, strlen(out) - 1, 0);
    hm_expect(&h, "Hi", "Hm", "");
    harmony_read(&h, out, strlen(out), 1);
    hm_expect(&h, "Hi", "Hm", "");
    harmony_fini(&h);
    /* a stream that ends on a partial token keeps it as text */
    hm_check("<|channel|>final<|message|>Hi<|e", MANY, "Hi<|e", "", "");
}

static void test_harmony_malformed(void **state) {
    (void)state;
    /* a header without <|message|> is content as written, up to the token that cut it */
    hm_check("<|channel|>final Hello<|end|>", MANY, "<|channel|>final Hello", "", "");
    hm_check("<|channel|>final Hello", MANY, "<|channel|>final Hello", "", "");
    hm_check("<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final Hi",
             MANY, "<|start|>assistant<|channel|>final Hi", "ok", "");
    /* control tokens where they mean nothing are dropped */
    hm_check("<|end|><|message|>x<|constrain|>y<|call|>", MANY, "xy", "", "");
    /* a call cut short by the token budget still is the call the model began */
    hm_check("<|channel|>commentary to=functions.f<|message|>{\"a\":", MANY, "", "",
             "[{\"arguments\":\"{\\\"a\\\":\",\"name\":\"f\"}]");
    /* "header" text longer than any header is content, and is not held back for ever */
    char big[400] = "<|channel|>";
    memset(big + strlen(big), 'x', 300);
    big[311] = 0;
    struct harmony h;
    harmony_init(&h, MANY);
    harmony_read(&h, big, strlen(big), 0);
    assert_int_equal(h.content.n, strlen(big));
    harmony_fini(&h);
    hm_check(big, MANY, big, "", "");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_split_sequences),
        cmocka_unit_test(test_utf8_invalid_bytes),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_stops_match_search),
        cmocka_unit_test(test_tool_call_start),
        cmocka_unit_test(test_hermes_calls),
        cmocka_unit_test(test_llama3_calls),
        cmocka_unit_test(test_buf),
        cmocka_unit_test(test_harmony_channels),
        cmocka_unit_test(test_harmony_calls),
        cmocka_unit_test(test_harmony_partial_tokens),
        cmocka_unit_test(test_harmony_malformed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
