/* test_template.c: the chat-template renderer.
 *
 * Goldens: every template of ../shared/data/templates rendered over the conversations in
 * tests/fixtures/templates/<template>.json (written by tools/template_goldens.py with Python
 * jinja2, configured as transformers configures it) must come out byte for byte; so must the
 * openai/harmony vectors listed in harmony.json. Without ../shared/data those tests skip.
 * The rest checks language features one by one (expected values are jinja2's), the errors
 * (syntax errors with line:column, raise_exception, runtime type errors) and the loader. */
#include <dirent.h>
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/template.h"

#define FIXTURES TMX_SOURCE_DIR "/tests/fixtures/templates"
#define TEMPLATES TMX_SOURCE_DIR "/../shared/data/templates"

/* ---- helpers ------------------------------------------------------------------------------ */

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) free(buf), buf = NULL;
    fclose(f);
    if (buf) buf[n] = 0;
    if (len) *len = (size_t)n;
    return buf;
}

/* 2025-06-28T12:00:00 into a struct tm with its weekday and day of year filled in. */
static struct tm parse_now(const char *iso) {
    struct tm tm = {0};
    sscanf(iso, "%d-%d-%dT%d:%d:%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
           &tm.tm_sec);
    tm.tm_year -= 1900, tm.tm_mon -= 1;
    time_t t = timegm(&tm);
    gmtime_r(&t, &tm);
    return tm;
}

/* Renders src with the JSON context ctx; returns the output (caller frees) or NULL with *err. */
static char *render_err(const char *src, const char *ctx, enum tmx_status *st, char **err) {
    struct tmx_template *t = NULL;
    json_error_t jerr;
    json_t *context = json_loads(ctx ? ctx : "{}", 0, &jerr);
    char *out = NULL;
    assert_non_null(context);
    struct tm now = parse_now("2025-06-28T12:00:00");
    *st = tmx_template_parse(src, strlen(src), "t", &t, err);
    if (*st == TMX_OK) *st = tmx_template_render(t, context, &now, &out, NULL, err);
    tmx_template_free(t);
    json_decref(context);
    return out;
}

static void check(const char *src, const char *ctx, const char *want) {
    enum tmx_status st;
    char *err = NULL, *out = render_err(src, ctx, &st, &err);
    if (st != TMX_OK) fail_msg("%s: %s", src, err);
    if (strcmp(out, want) != 0) fail_msg("%s\n  got  [%s]\n  want [%s]", src, out, want);
    free(out);
}

/* The render (or parse) fails with st and a message containing want. */
static void check_error(const char *src, const char *ctx, enum tmx_status want_st,
                        const char *want) {
    enum tmx_status st;
    char *err = NULL, *out = render_err(src, ctx, &st, &err);
    if (st == TMX_OK) fail_msg("%s: rendered [%s], want an error", src, out);
    assert_int_equal(st, want_st);
    if (!err || !strstr(err, want)) fail_msg("%s: error [%s], want [%s]", src, err, want);
    free(err);
}

/* ---- language ----------------------------------------------------------------------------- */

struct feature {
    const char *src, *ctx, *want;
};

static void run_features(const struct feature *f, size_t n) {
    for (size_t i = 0; i < n; i++) check(f[i].src, f[i].ctx, f[i].want);
}

static void test_whitespace(void **state) {
    (void)state;
    const struct feature f[] = {
        {"a  {{- 'b' -}}  c", 0, "abc"},
        {"a\n  {% if true %}\n  x\n  {% endif %}\nb", 0, "a\n  x\nb"},
        {"{% if true %}x{% endif %}\n", 0, "x"},
        {"x\n\n", 0, "x\n"},
        {"  {%+ if true %}x{% endif %}", 0, "  x"},
        {"{% if true +%}\nx{% endif %}", 0, "\nx"},
        {"a {# note #} b", 0, "a  b"},
        {"a\n  {# note #}\nb", 0, "a\nb"},
        {"a {#- note -#} b", 0, "ab"},
        {"{{ 'x' }}\ny", 0, "x\ny"},
        {"  {{ 'x' }}", 0, "  x"},
        {"a\r\n{% if true %}\r\nb{% endif %}\rc", 0, "a\nbc"},
        {"{%- if true -%}\n\n  x  \n\n{%- endif -%}", 0, "x"},
        {"{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}", 0, "  1\n  2\n"},
        {"x {% if true %} y{% endif %}", 0, "x  y"},
        {"\t {% set a = 1 %}{{ a }}", 0, "1"},
        {"{{ {'a': {'b': 1}} }}", 0, "{'a': {'b': 1}}"},
        {"{ {x} %}", 0, "{ {x} %}"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_literals_and_operators(void **state) {
    (void)state;
    const struct feature f[] = {
        {"{{ \"a\\tb\\n\\u00e9\\x41\\\\\" }}", 0, "a\tb\n\xc3\xa9" "A\\"},
        {"{{ 'it\\'s' ~ \"\\\"q\\\"\" ~ '\\d' }}", 0, "it's\"q\"\\d"},
        {"{{ 'a' 'b' }}", 0, "ab"},
        {"{{ 1_000 + 0 }} {{ 1.5e3 }} {{ 2E-3 }}", 0, "1000 1500.0 0.002"},
        {"{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 1e-5 }} {{ 0.0001 }} {{ -0.0 }} {{ 1/3 }}", 0,
         "0.30000000000000004 1e+16 1000000000000000.0 1e-05 0.0001 -0.0 0.3333333333333333"},
        {"{{ 10 / 4 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7.5 // 2 }} "
         "{{ -7.5 % 2 }}", 0, "2.5 3 -4 2 -2 3.0 0.5"},
        {"{{ 2 ** 10 }} {{ 2 ** 3 ** 2 }} {{ 2 ** -1 }} {{ -2 ** 2 }} {{ 1 ** 1000000000000 }} "
         "{{ (-3) ** 3 }} {{ 2.0 ** 0.5 }}", 0, "1024 64 0.5 4 1 -27 1.4142135623730951"},
        {"{{ -7.5 // 2 }} {{ 7.5 % -2 }} {{ -7.5 % -2.5 }} {{ 0.0 // -3 }} "
         "{{ 1e308 // 1e-10 is number }}", 0, "-4.0 -0.5 -0.0 -0.0 1e+308"},
        {"{{ 3 * 'ab' }}{{ 'c' * 2 }} {{ [1, 2] + [3] }} {{ [0] * 3 }} "
         "{{ [] * 4611686018427387904 }} [{{ '' * 4611686018427387904 }}{{ 'x' * -2 }}]", 0,
         "abababcc [1, 2, 3] [0, 0, 0] [] []"},
        {"{{ true + 1 }} {{ 1 + 2.5 }} {{ 4 - 1 * 2 }} {{ (4 - 1) * 2 }}", 0, "2 3.5 2 6"},
        {"{{ {'a': 1, \"b\": [true, none, 1.0, 'x\\'y']} }}", 0,
         "{'a': 1, 'b': [True, None, 1.0, \"x'y\"]}"},
        {"{{ none }} {{ True }} {{ false }} {{ \"a\" ~ 1 ~ none ~ 2.0 }}", 0,
         "None True False a1None2.0"},
        {"{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' == 'a' }} {{ [1, 'a'] == [1.0, 'a'] }} "
         "{{ {'a': 1} == {'a': 1} }}", 0, "True True True True True"},
        {"{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'b' > 'a' }} {{ 'B' < 'a' }} {{ [1, 2] < [1, 3] }} "
         "{{ 2 >= 2.0 }}", 0, "True False True True True True"},
        {"{{ 'a' in 'cat' }} {{ 'x' not in ['y'] }} {{ 'k' in {'k': 1} }} {{ 1 in [1.0] }} "
         "{{ '' in 'x' }}", 0, "True True True True True"},
        {"{{ 0 or 'd' }} {{ 1 and 2 }} {{ none or [] }} {{ not none }} {{ not 'x' }} "
         "{{ 'a' and '' }}.", 0, "d 2 [] True False ."},
        {"{{ 'y' if false }}|{{ 'y' if 1 else 'n' }}|"
         "{{ 'a' if false else 'b' if true else 'c' }}", 0, "|y|b"},
        {"{{ -x }} {{ +x }} {{ - -3 }} {{ -1.5 }}", "{\"x\": 4}", "-4 4 3 -1.5"},
        {"{{ 'é' < 'z' }} {{ 'ß' > 'z' }} {{ 9007199254740993 == 9007199254740992.0 }} "
         "{{ 9007199254740993 > 9007199254740992.0 }} {{ 2 < 2.5 }} {{ -3 < -2.5 }}", 0,
         "False True False True True True"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_access(void **state) {
    (void)state;
    static const char *ctx = "{\"d\": {\"a\": {\"b\": 5}, \"k\": \"v\"}, \"l\": [1, 2, 3, 4], "
                             "\"s\": \"h\\u00e9llo\", \"e\": []}";
    const struct feature f[] = {
        {"{{ d.a.b }} {{ d['a']['b'] }} {{ d.a['b'] }} {{ d['k'] }}", ctx, "5 5 5 v"},
        {"{{ l[0] }} {{ l[-1] }} {{ l.1 }} {{ l[1:] }} {{ l[:-2] }} {{ l[::2] }} {{ l[::-1] }} "
         "{{ l[3:1:-1] }}", ctx, "1 4 2 [2, 3, 4] [1, 2] [1, 3] [4, 3, 2, 1] [4, 3]"},
        {"{{ l[10:] }} {{ l[-10:2] }} {{ l[2:2] }} {{ e[::-1] }} {{ l[-100:100:-1] }} "
         "{{ l[5:-100:-2] }} {{ l[2::-1] }} {{ l[:-1:-1] }} {{ s[::-2] }} {{ s[-2:] }}", ctx,
         "[] [1, 2] [] [] [] [4, 2] [3, 2, 1] [] olh lo"},
        {"{{ s[0] }}{{ s[1] }} {{ s[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s|length }} "
         "{{ s[:100] }}", ctx, "h\xc3\xa9 o \xc3\xa9l oll\xc3\xa9h 5 h\xc3\xa9llo"},
        {"[{{ d.x }}{{ l[9] }}{{ none.x }}{{ d['x'] }}]", ctx, "[]"},
        {"{{ d.x is defined }} {{ d.a is defined }} {{ l[9] is defined }} "
         "{{ s.x is undefined }}", ctx, "False True False True"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_statements(void **state) {
    (void)state;
    static const char *ctx = "{\"l\": [1, 2, 3], \"d\": {\"a\": 1, \"b\": 2}, \"e\": []}";
    const struct feature f[] = {
        {"{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
         "{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}", ctx,
         "1032TrueFalse3|2121FalseFalse3|3210FalseTrue3|"},
        {"{% for x in l %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }} {% endfor %}", ctx,
         "<1>2 1<2>3 2<3> "},
        {"{% for x in e %}x{% else %}empty{% endfor %}", ctx, "empty"},
        {"{% for x in l if x > 1 %}{{ x }}{{ loop.index }}{{ loop.last }} {% else %}"
         "none{% endfor %}", ctx, "21False 32True "},
        {"{% for x in l if x > 5 %}{{ x }}{% else %}none{% endfor %}", ctx, "none"},
        {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}"
         "{% endfor %}", ctx, "a=1;b=2;ab"},
        {"{% for (k, v) in d|items %}{{ k }}{{ v }}{% endfor %}{% for c in 'h\xc3\xa9' %}"
         "[{{ c }}]{% endfor %}", ctx, "a1b2[h][\xc3\xa9]"},
        {"{% for x in l %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}"
         "{% endif %}{{ x }}{% endfor %}", ctx, "1"},
        {"{% for x in l %}{% for y in l %}{{ loop.index }}{% endfor %}"
         "{{ loop.index }} {% endfor %}", ctx, "1231 1232 1233 "},
        {"{% for x in nothing %}x{% endfor %}{% for x in nothing %}{% else %}e{% endfor %}", ctx,
         "e"},
        {"{% set x = 1 %}{% for i in l %}{% set x = i %}{{ x }}{% endfor %}{{ x }}", ctx, "1231"},
        {"{% set ns = namespace(x=1, y='a') %}{% for i in l %}{% set ns.x = ns.x + i %}{% endfor %}"
         "{{ ns.x }}{{ ns.y }}", ctx, "7a"},
        {"{% set ns = namespace() %}{% set ns.found = true %}{{ ns.found }}"
         "{{ ns.missing is defined }}", ctx, "TrueFalse"},
        {"{% set ns = namespace(d) %}{{ ns.b }}", ctx, "2"},
        /* a namespace that holds itself prints once (fuzz_template: the printing recursed) */
        {"{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}", ctx,
         "<Namespace {'a': 1, 'me': <Namespace {...}>}>"},
        {"{% set b %}hi {{ 1 }}{% endset %}[{{ b }}]{% set c | upper | replace('I', '!') %}"
         "hi{% endset %}{{ c }}", ctx, "[hi 1]H!"},
        {"{% set a, b = [1, 2] %}{{ b }}{{ a }}{% set t = (3, 4) %}{{ t[1] }}", ctx, "214"},
        {"{% if 0 %}a{% elif '' %}b{% elif l %}c{% else %}d{% endif %}{% if e %}x{% else %}"
         "y{% endif %}", ctx, "cy"},
        {"{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
         "{{ greet('Bo') }} {{ greet('Al', '?') }} {{ greet(punct='.', name='Cy') }} "
         "{{ greet() }}", ctx, "Hi Bo! Hi Al? Hi Cy. Hi !"},
        {"{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"
         "{{ f(2)|length }}", ctx, "3212"},
        {"{% set top = 'T' %}{% macro m() %}{{ top }}{{ l|length }}{% set top = 'M' %}{{ top }}"
         "{% endmacro %}{{ m() }}{{ top }}", ctx, "T3MT"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_filters(void **state) {
    (void)state;
    static const char *ctx = "{\"msgs\": [{\"role\": \"user\", \"n\": 3}, {\"role\": "
                             "\"assistant\", \"n\": 1}, {\"role\": \"user\", \"n\": 2}],"
                             " \"obj\": {\"b\": [1, 2.5, {\"c\": null}], \"a\": "
                             "\"\\u00e9\\\"\\\\\\n\\u0001\\u007f\\u2028\\ud83d\\ude00\"},"
                             " \"words\": [\"b\", \"A\", \"c\", \"a\"]}";
    const struct feature f[] = {
        {"[{{ '  a b \\n'|trim }}][{{ 'xxaxx'|trim('x') }}][{{ none|trim }}]", ctx,
         "[a b][a][None]"},
        {"{{ msgs|length }} {{ 'h\xc3\xa9'|length }} {{ obj|length }} {{ nothing|length }} "
         "{{ msgs|count }}", ctx, "3 2 2 0 3"},
        {"{{ obj|tojson }}", ctx,
         "{\"b\": [1, 2.5, {\"c\": null}], \"a\": "
         "\"\xc3\xa9\\\"\\\\\\n\\u0001\x7f\xe2\x80\xa8\xf0\x9f\x98\x80\"}"},
        {"{{ obj.b|tojson(indent=2) }}", ctx, "[\n  1,\n  2.5,\n  {\n    \"c\": null\n  }\n]"},
        {"{{ {'b': 1, 'a': [], 'c': {}}|tojson(sort_keys=true, separators=(',', ':')) }}", ctx,
         "{\"a\":[],\"b\":1,\"c\":{}}"},
        {"{{ 'é'|tojson(ensure_ascii=true) }} {{ '😀'|tojson(ensure_ascii=true) }} "
         "{{ 1e100|tojson }} {{ 3|tojson }}", ctx, "\"\\u00e9\" \"\\ud83d\\ude00\" 1e+100 3"},
        {"{{ 1|string ~ none|string ~ [1]|string }}|{{ nothing|string }}|", ctx, "1None[1]||"},
        {"{{ 'hello wORLD'|upper }} {{ 'HeLLo'|lower }} {{ 'hello wORLD'|capitalize }} "
         "{{ 'hello-wORLD it\\'s(x'|title }}", ctx,
         "HELLO WORLD hello Hello world Hello-World It's(X"},
        {"{{ 'aaa'|replace('a', 'b', 2) }} {{ 'ab'|replace('', '-') }} "
         "{{ 1.5|replace('.', ',') }}", ctx, "bba -a-b- 1,5"},
        {"{{ nothing|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} "
         "{{ nothing|d }}|", ctx, "d  d |"},
        {"{{ msgs|first }} {{ msgs|last }} {{ 'abc'|first }}{{ 'abc'|last }} "
         "{{ []|first is defined }}", ctx,
         "{'role': 'user', 'n': 3} {'role': 'user', 'n': 2} ac False"},
        {"{{ words|join }} {{ words|join(', ') }} {{ msgs|join('/', attribute='role') }} "
         "{{ [1, none]|join('-') }}", ctx, "bAca b, A, c, a user/assistant/user 1-None"},
        {"{% for k, v in obj|items %}{{ k }}{{ v|length }}{% endfor %} {{ [obj.a] }} "
         "{{ 'ab'|list }} {{ {'x': 1}|list }} {{ nothing|items|list }}", ctx,
         "b3a8 ['\xc3\xa9\"\\\\\\n\\x01\\x7f\\u2028\xf0\x9f\x98\x80'] ['a', 'b'] ['x'] []"},
        {"{{ msgs|map(attribute='role')|list }} {{ words|map('upper')|join }} "
         "{{ msgs|map(attribute='x', default=0)|list }}", ctx,
         "['user', 'assistant', 'user'] BACA [0, 0, 0]"},
        {"{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='n')|list }} "
         "{{ msgs|rejectattr('role', 'eq', 'user')|list|length }} {{ [0, 1, 2, '']|select|list }} "
         "{{ [1, 2, 3, 4]|reject('odd')|list }} {{ msgs|selectattr('n')|list|length }}", ctx,
         "[3, 2] 1 [1, 2] [2, 4] 3"},
        {"{{ '<b>'|safe }} {{ '<a href=\"x\">&\\''|e }} {{ '<'|escape }}", ctx,
         "<b> &lt;a href=&#34;x&#34;&gt;&amp;&#39; &lt;"},
        {"{{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} "
         "{{ '0x1f'|int(base=16) }} {{ '7'|int(base=47) }} {{ '2.5'|float }} {{ 'x'|float }} "
         "{{ 3|float }} {{ -3|abs }} {{ -2.5|abs }}", ctx, "43 4 0 7 3 31 7 2.5 0.0 3.0 3 2.5"},
        {"{{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 3|round }} "
         "{{ 2.1|round(0, 'ceil') }} {{ -2.1|round(method='floor') }} {{ 1234.5|round(-2) }}", ctx,
         "2.0 4.0 2.67 3 3.0 -3.0 1200.0"},
        {"[{{ 'a\\nb\\n\\nc'|indent }}][{{ 'a\\nb'|indent(2, true) }}]"
         "[{{ 'a\\n\\nb'|indent('> ', blank=true) }}]", ctx,
         "[a\n    b\n\n    c][  a\n  b][a\n> \n> b]"},
        {"{{ 'one two  three,four'|wordcount }} {{ 'h\xc3\xa9llo w\xc3\xb6rld'|wordcount }}", ctx,
         "4 2"},
        {"{{ words|sort }} {{ words|sort(case_sensitive=true) }} {{ words|sort(reverse=true) }} "
         "{{ msgs|sort(attribute='n')|map(attribute='n')|list }} {{ [3, 1.5, 2]|sort }}", ctx,
         "['A', 'a', 'b', 'c'] ['A', 'a', 'b', 'c'] ['c', 'b', 'A', 'a'] [1, 2, 3] [1.5, 2, 3]"},
        {"{{ words|unique|list }} {{ words|unique(case_sensitive=true)|list }} {{ words|min }} "
         "{{ words|max }} {{ msgs|max(attribute='n') }}", ctx,
         "['b', 'A', 'c'] ['b', 'A', 'c', 'a'] A c {'role': 'user', 'n': 3}"},
        {"{{ [1, 2, 3]|sum }} {{ msgs|sum(attribute='n') }} {{ [1, 0.5]|sum }} "
         "{{ []|sum(start=10) }}", ctx, "6 6 1.5 10"},
        {"{{ words|reverse|list }} {{ 'abc'|reverse }} "
         "{{ {'b': 1, 'a': 2}|dictsort|map('first')|list }} "
         "{{ {'b': 1, 'a': 2, 'c': 0}|dictsort(by='value', reverse=true)|map('last')|list }}", ctx,
         "['a', 'c', 'A', 'b'] cba ['a', 'b'] [2, 1, 0]"},
        {"{{ obj|attr('b') is defined }} {{ loop_msgs|default(msgs)|length }}", ctx, "False 3"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_tests(void **state) {
    (void)state;
    static const char *ctx =
        "{\"s\": \"x\", \"n\": 3, \"f\": 1.5, \"l\": [1], \"d\": {}, \"z\": null, \"t\": true}";
    const struct feature f[] = {
        {"{{ s is defined }}{{ q is defined }}{{ q is undefined }}{{ s is not defined }}", ctx,
         "TrueFalseTrueFalse"},
        {"{{ z is none }}{{ s is none }}{{ z is not none }}{{ t is true }}{{ t is false }}"
         "{{ t is boolean }}", ctx, "TrueFalseFalseTrueFalseTrue"},
        {"{{ s is string }}{{ n is string }}{{ d is mapping }}{{ l is mapping }}{{ n is number }}"
         "{{ f is number }}{{ t is number }}{{ n is integer }}{{ t is integer }}"
         "{{ f is float }}", ctx, "TrueFalseTrueFalseTrueTrueTrueTrueFalseTrue"},
        {"{{ s is iterable }}{{ l is iterable }}{{ d is iterable }}{{ n is iterable }}"
         "{{ q is iterable }}{{ l is sequence }}{{ n is sequence }}", ctx,
         "TrueTrueTrueFalseTrueTrueFalse"},
        {"{{ n is odd }}{{ n is even }}{{ n is divisibleby 3 }}{{ n is divisibleby(2) }}", ctx,
         "TrueFalseTrueFalse"},
        {"{{ s is equalto 'x' }}{{ n is eq 3.0 }}{{ n is ne 3 }}{{ n is lt 4 }}{{ n is ge 4 }}"
         "{{ n is in [3] }}{{ s is in 'xyz' }}{{ z is sameas none }}{{ t is sameas true }}"
         "{{ l is sameas l }}{{ [1] is sameas [1] }}", ctx,
         "TrueTrueFalseTrueFalseTrueTrueTrueTrueTrueFalse"},
        {"{{ 'abc' is lower }}{{ 'aBc' is lower }}{{ 'AB1' is upper }}{{ range is callable }}"
         "{{ s is callable }}", ctx, "TrueFalseTrueTrueFalse"},
        {"{% if not s is none and n is number and not q is defined %}ok{% endif %}", ctx, "ok"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

static void test_methods_and_globals(void **state) {
    (void)state;
    static const char *ctx = "{\"d\": {\"a\": 1, \"b\": null}, \"s\": \"  a b  c \"}";
    const struct feature f[] = {
        {"[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}]"
         "[{{ '\\n\\nx\\n'.strip('\\n') }}][{{ 'xyhix'.strip('xy') }}]", ctx,
         "[a b  c][a b  c ][  a b  c][x][hi]"},
        {"{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith(('x', 'a')) }}"
         "{{ 'a'.endswith('ba') }}", ctx, "TrueTrueTrueFalse"},
        {"{{ s.split() }} {{ s.split(' ') }} {{ 'a,b,,c'.split(',', 2) }} {{ s.split(none, 1) }} "
         "{{ ''.split() }} {{ ''.split(',') }}", ctx,
         "['a', 'b', 'c'] ['', '', 'a', 'b', '', 'c', ''] ['a', 'b', ',c'] ['a', 'b  c '] [] ['']"},
        {"{{ 'a,b,c'.rsplit(',', 1) }} {{ s.rsplit(none, 1) }} "
         "{{ 'x</think>y</think>z'.split('</think>')[-1] }}", ctx, "['a,b', 'c'] ['  a b', 'c'] z"},
        {"{{ 'aXbX'.replace('X', '-') }} {{ 'hello world'.title() }} {{ \"it's\".title() }} "
         "{{ 'abC'.capitalize() }} {{ 'aB'.upper() }}{{ 'aB'.lower() }}", ctx,
         "a-b- Hello World It'S Abc ABab"},
        {"{{ 'banana'.find('an') }} {{ 'banana'.find('x') }} {{ 'banana'.count('a') }} "
         "{{ '-'.join(['a', 'b']) }} {{ 'a\\nb\\r\\nc'.splitlines() }} {{ '12'.isdigit() }}"
         "{{ ' '.isspace() }}", ctx, "1 -1 3 a-b ['a', 'b', 'c'] TrueTrue"},
        {"{{ 'h\xc3\xa9llo'.find('l') }} {{ 'ab'.count('') }} {{ 'aaaa'.count('aa') }} "
         "{{ 'x'.find('') }} {{ 'a1'.isalnum() }}{{ 'ab'.islower() }}{{ ''.isdigit() }}", ctx,
         "2 3 2 0 TrueTrueFalse"},
        {"{{ d.get('a') }} {{ d.get('x') }} {{ d.get('x', 5) }} {{ d.get('b', 5) }} "
         "{{ d.keys()|list }} {{ d.values()|list }} {% for k, v in d.items() %}{{ k }}{{ v }}"
         "{% endfor %}", ctx, "1 None 5 None ['a', 'b'] [1, None] a1bNone"},
        {"{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} "
         "{{ range(0)|list }}", ctx, "[0, 1, 2] [1, 3, 5] [3, 2, 1] []"},
        {"{{ dict(a=1, b='x') }} {{ dict(d, c=2)|length }}", ctx, "{'a': 1, 'b': 'x'} 3"},
        {"{{ strftime_now('%Y-%m-%d') }} {{ strftime_now('%d %b %Y, %A') }} "
         "[{{ strftime_now('') }}]", ctx, "2025-06-28 28 Jun 2025, Saturday []"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

/* Where the renderer departs from jinja2 on purpose: attributes and items of undefined values
 * are undefined (jinja2 raises), and transformers' {% generation %} block is understood. */
static void test_undefined_chains(void **state) {
    (void)state;
    static const char *ctx = "{\"d\": {\"a\": 1}, \"e\": []}";
    const struct feature f[] = {
        {"[{{ d.x.y.z }}{{ nothing.foo['bar'][0] }}{{ e[0].role }}]", ctx, "[]"},
        {"{{ nothing.x is undefined }} {{ e[0].role is defined }} {{ e[0].role == 'user' }}", ctx,
         "True False False"},
        {"{% generation %}kept{% endgeneration %}", ctx, "kept"},
    };
    run_features(f, sizeof f / sizeof f[0]);
}

/* ---- errors ------------------------------------------------------------------------------- */

static void test_syntax_errors(void **state) {
    (void)state;
    check_error("{{ 1 + }}", 0, TMX_ERR_INVALID, "t:1:8: unexpected '}}'");
    check_error("ok\n{% if x %}\nnever closed", 0, TMX_ERR_INVALID,
                "t:3:13: unexpected end of template, expected 'endif'");
    check_error("line 1\n  {% endfor %}", 0, TMX_ERR_INVALID,
                "t:2:6: unknown or unexpected tag 'endfor'");
    check_error("{{ 'abc }}", 0, TMX_ERR_INVALID, "t:1:4: unterminated string literal");
    check_error("{% frobnicate %}", 0, TMX_ERR_INVALID,
                "t:1:4: unknown or unexpected tag 'frobnicate'");
    check_error("a {{ x", 0, TMX_ERR_INVALID, "t:1:5: missing '}}'");
    check_error("a {# x", 0, TMX_ERR_INVALID, "t:1:3: missing '#}'");
    check_error("{{ (1 ] }}", 0, TMX_ERR_INVALID, "t:1:7: unbalanced bracket");
    check_error("{% break %}", 0, TMX_ERR_INVALID, "'break' outside a loop");
    check_error("{% if x %}{% macro m() %}{% endmacro %}{% endif %}", 0, TMX_ERR_INVALID,
                "macros must be defined at the top level");
    check_error("{% for x in l recursive %}{% endfor %}", 0, TMX_ERR_INVALID, "not supported");
    check_error("{{ 99999999999999999999 }}", 0, TMX_ERR_INVALID, "integer literal out of range");
    check_error("{{ 'bad \\u12' }}", 0, TMX_ERR_INVALID, "bad escape");
    check_error("{{ '\xff' }}", 0, TMX_ERR_INVALID, "t:1:5: invalid UTF-8");
    /* deep nesting is an error, not a stack overflow */
    char deep[4096] = "{{ ";
    for (int i = 0; i < 1000; i++) strcat(deep, "(");
    check_error(deep, 0, TMX_ERR_INVALID, "nested too deeply");
    strcpy(deep, "{{ ");
    for (int i = 0; i < 1000; i++) strcat(deep, "-");
    strcat(deep, "1 }}");
    check_error(deep, 0, TMX_ERR_INVALID, "nested too deeply");
    strcpy(deep, "{{ 1");
    for (int i = 0; i < 200; i++) strcat(deep, " + 1");
    strcat(deep, " }}");
    check_error(deep, 0, TMX_ERR_INVALID, "nested too deeply");
    strcpy(deep, "{% if 0 %}");
    for (int i = 0; i < 200; i++) strcat(deep, "{% elif 0 %}");
    strcat(deep, "{% endif %}");
    check_error(deep, 0, TMX_ERR_INVALID, "blocks nested too deeply");
    check_error("{{ a b }}", 0, TMX_ERR_INVALID, "t:1:6: expected '}}', got 'b'");
    check_error("{{ f(a=1 b) }}", 0, TMX_ERR_INVALID, "t:1:10: expected ',', got 'b'");
}

static void test_runtime_errors(void **state) {
    (void)state;
    check_error("{% if true %}\n  {{ raise_exception('Roles must alternate') }}{% endif %}", 0,
                TMX_ERR_INVALID, "t:2:6: Roles must alternate");
    check_error("{{ 1 + 'a' }}", 0, TMX_ERR_INVALID,
                "t:1:6: unsupported operand type(s) for +: 'int' and 'str'");
    check_error("{{ x + 1 }}", 0, TMX_ERR_INVALID, "'x' is undefined");
    check_error("{{ d.x + 1 }}", "{\"d\": {}}", TMX_ERR_INVALID, "'x' is undefined");
    /* Undefined values looked up by a computed key or attr(): the key is gone by the time the
     * value is used, so the message names nothing (fuzz_template found the name read after the
     * key was freed). */
    check_error("{{ d['a' ~ 'b'] * 2 }}", "{\"d\": {}}", TMX_ERR_INVALID, "t:1:17: undefined value");
    check_error("{% set n = namespace() %}{{ (n | attr('z' ~ 'y')) * 2 }}", 0, TMX_ERR_INVALID,
                "undefined value");
    check_error("{{ nofn() }}", 0, TMX_ERR_INVALID, "t:1:4: 'nofn' is undefined");
    check_error("{{ x | nosuch }}", 0, TMX_ERR_INVALID, "t:1:6: no filter named 'nosuch'");
    check_error("{{ x is nosuch }}", 0, TMX_ERR_INVALID, "no test named 'nosuch'");
    check_error("{{ 1 / 0 }}", 0, TMX_ERR_INVALID, "division by zero");
    check_error("{{ 'a' < 1 }}", 0, TMX_ERR_INVALID,
                "'<' not supported between instances of 'str' and 'int'");
    check_error("{{ 1 in 'abc' }}", 0, TMX_ERR_INVALID, "requires string as left operand");
    check_error("{{ 9223372036854775807 + 1 }}", 0, TMX_ERR_INVALID, "integer overflow");
    check_error("{% for x in 3 %}{% endfor %}", 0, TMX_ERR_INVALID, "'int' object is not iterable");
    check_error("{% for k, v in 'ab' %}{% endfor %}", 0, TMX_ERR_INVALID, "cannot unpack str into 2");
    check_error("{{ 'x'.nomethod() }}", 0, TMX_ERR_INVALID,
                "'str' object has no method 'nomethod'");
    check_error("{{ 'x'|trim(1, 2) }}", 0, TMX_ERR_INVALID, "trim takes at most 1 argument(s)");
    check_error("{{ nothing|tojson }}", 0, TMX_ERR_INVALID,
                "Object of type Undefined is not JSON serializable");
    check_error("{% set x = 1 %}{% set x.a = 2 %}", 0, TMX_ERR_INVALID, "non-namespace");
    check_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", 0, TMX_ERR_INVALID,
                "nested too deeply");
    check_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", 0, TMX_ERR_INVALID,
                "takes not more than 1");
    check_error("{{ range(1000000)|length }}", 0, TMX_ERR_INVALID, "range too big");
    check_error("{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}", 0,
                TMX_ERR_INVALID, "template runs too long");
    check_error("{{ 'x' * 100000000 }}", 0, TMX_ERR_INVALID, "string too long");

    struct tmx_template *t = NULL;
    char *err = NULL, *out = NULL;
    assert_int_equal(tmx_template_parse("x", 1, "t", &t, &err), TMX_OK);
    json_t *list = json_array();
    assert_int_equal(tmx_template_render(t, list, NULL, &out, NULL, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "must be a JSON object"));
    free(err);
    json_decref(list);
    tmx_template_free(t);
}

/* ---- loader ------------------------------------------------------------------------------- */

static char model_dir[] = "/tmp/tmx-test-template-XXXXXX";

static void put_file(const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", model_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void drop_file(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", model_dir, name);
    unlink(path);
}

/* Loads model_dir's template and renders it over {"messages": [{"content": "hi"}]} plus the
 * special tokens; returns the output or NULL with *st and *err. */
static char *load_and_render(enum tmx_status *st, char **err) {
    struct tmx_template *t = NULL;
    json_t *special = NULL, *ctx = json_pack("{s[{ss}]}", "messages", "content", "hi");
    char *out = NULL;
    *st = tmx_chat_template_load(model_dir, &t, &special, err);
    if (*st == TMX_OK) {
        json_object_update(ctx, special);
        *st = tmx_template_render(t, ctx, NULL, &out, NULL, err);
    }
    json_decref(special);
    json_decref(ctx);
    tmx_template_free(t);
    return out;
}

static void test_loader(void **state) {
    (void)state;
    enum tmx_status st;
    char *err = NULL, *out;
    assert_non_null(mkdtemp(model_dir));

    out = load_and_render(&st, &err); /* an empty directory */
    assert_int_equal(st, TMX_ERR_NOT_FOUND);
    assert_non_null(strstr(err, "no chat template"));
    free(err), err = NULL;

    put_file("tokenizer_config.json", "{\"eos_token\": \"</s>\"}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_NOT_FOUND);
    free(err), err = NULL;

    /* a string template; bos as a string, eos as an AddedToken */
    put_file("tokenizer_config.json", "{\"bos_token\": \"<s>\", \"eos_token\": {\"__type\": "
                                      "\"AddedToken\", \"content\": \"</s>\"},"
                                      " \"chat_template\": \"{{ bos_token }}{% for m in messages "
                                      "%}[{{ m.content }}]{% endfor %}{{ eos_token }}\"}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_OK);
    assert_string_equal(out, "<s>[hi]</s>");
    free(out);

    /* the list form: "default" is taken */
    put_file("tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
             " {\"name\": \"default\", \"template\": \"D{{ messages|length }}\"}]}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_OK);
    assert_string_equal(out, "D1");
    free(out);

    put_file("tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_NOT_FOUND);
    free(err), err = NULL;

    /* chat_template.jinja wins over tokenizer_config.json; parse errors name the file */
    put_file("chat_template.jinja", "J{{ messages[0].content }}\n");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_OK);
    assert_string_equal(out, "Jhi");
    free(out);
    put_file("chat_template.jinja", "\n{% if %}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_INVALID);
    assert_non_null(strstr(err, "chat_template.jinja:2:7:"));
    free(err), err = NULL;
    drop_file("chat_template.jinja");

    put_file("tokenizer_config.json", "{\"chat_template\": ");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_INVALID);
    assert_non_null(strstr(err, "tokenizer_config.json"));
    free(err), err = NULL;
    put_file("tokenizer_config.json", "{\"chat_template\": 5}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_INVALID);
    assert_non_null(strstr(err, "tokenizer_config.json: field \"chat_template\" must be"));
    free(err), err = NULL;
    put_file("tokenizer_config.json",
             "{\"chat_template\": \"x\", \"eos_token\": {\"content\": 2}}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_ERR_INVALID);
    assert_non_null(strstr(err, "tokenizer_config.json: field \"eos_token\" must be a string"));
    free(err), err = NULL;
    put_file("tokenizer_config.json", "{\"chat_template\": \"{{ bos_token }}x\", "
                                      "\"bos_token\": null, \"eos_token\": \"</s>\"}");
    out = load_and_render(&st, &err);
    assert_int_equal(st, TMX_OK);
    assert_string_equal(out, "x");
    free(out);

    drop_file("tokenizer_config.json");
    rmdir(model_dir);
}

/* ---- goldens ------------------------------------------------------------------------------ */

static int shared_data_present(void) {
    struct stat st;
    return stat(TEMPLATES, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Byte offset of the first difference, for failure messages. */
static size_t first_diff(const char *a, const char *b) {
    size_t i = 0;
    while (a[i] && a[i] == b[i]) i++;
    return i;
}

/* Renders every case of one fixture file; returns the number of failures (each printed). */
static int run_fixture(const char *fixture) {
    json_error_t jerr;
    json_t *fx = json_load_file(fixture, 0, &jerr);
    if (!fx) fail_msg("%s:%d: %s", fixture, jerr.line, jerr.text);
    const char *name = json_string_value(json_object_get(fx, "template"));
    struct tm now = parse_now(json_string_value(json_object_get(fx, "now")));
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", TEMPLATES, name);
    size_t len;
    char *src = slurp(path, &len), *err = NULL;
    if (!src) fail_msg("%s: cannot read", path);
    struct tmx_template *t = NULL;
    if (tmx_template_parse(src, len, name, &t, &err) != TMX_OK) fail_msg("%s", err);
    int failures = 0;
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(fx, "cases"), i, c) {
        const char *cname = json_string_value(json_object_get(c, "name"));
        const char *want = json_string_value(json_object_get(c, "output"));
        const char *want_err = json_string_value(json_object_get(c, "error"));
        const char *file = json_string_value(json_object_get(c, "file"));
        char *expected = NULL, *out = NULL;
        if (file) { /* a harmony vector, compared as upstream does */
            snprintf(path, sizeof path, "%s/%s", TEMPLATES, file);
            if (!(expected = slurp(path, NULL))) fail_msg("%s: cannot read", path);
            size_t w = 0, n = strlen(expected);
            for (size_t k = 0; k < n; k++)
                if (!(expected[k] == '\r' && expected[k + 1] == '\n')) expected[w++] = expected[k];
            while (w > 0 && strchr(" \t\n\r", expected[w - 1])) w--;
            expected[w] = 0;
            want = expected;
        }
        enum tmx_status st =
            tmx_template_render(t, json_object_get(c, "context"), &now, &out, NULL, &err);
        int ok;
        if (want_err) {
            ok = st == TMX_ERR_INVALID && strstr(err, want_err);
            if (!ok)
                printf("  %s / %s: want error [%s], got %s\n", name, cname, want_err,
                       err ? err : out);
        } else if (st != TMX_OK) {
            ok = 0;
            printf("  %s / %s: %s\n", name, cname, err);
        } else {
            size_t n = strlen(out), w = strlen(want);
            if (file) {
                while (n > 0 && strchr(" \t\n\r", out[n - 1])) n--;
                out[n] = 0;
            }
            const char *cmp =
                file && strcmp(json_string_value(json_object_get(c, "match")), "suffix") == 0 &&
                        n >= w
                    ? out + n - w
                    : out;
            ok = strcmp(cmp, want) == 0;
            if (!ok) {
                size_t at = first_diff(cmp, want);
                printf("  %s / %s: differs at byte %zu\n    got  ...%.60s\n    want ...%.60s\n",
                       name, cname, at, cmp + (at > 20 ? at - 20 : 0),
                       want + (at > 20 ? at - 20 : 0));
            }
        }
        failures += !ok;
        free(out), free(err), free(expected);
        err = NULL;
    }
    printf("%s: %zu cases, %d failed\n", name, json_array_size(json_object_get(fx, "cases")),
           failures);
    tmx_template_free(t);
    free(src);
    json_decref(fx);
    return failures;
}

static void test_goldens(void **state) {
    (void)state;
    if (!shared_data_present()) {
        printf("skipped: %s is absent\n", TEMPLATES);
        skip();
    }
    DIR *d = opendir(FIXTURES);
    assert_non_null(d);
    struct dirent *e;
    int failures = 0, files = 0;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 5, ".json") != 0) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", FIXTURES, e->d_name);
        failures += run_fixture(path);
        files++;
    }
    closedir(d);
    assert_int_equal(files, 12); /* eleven templates and the harmony vectors */
    assert_int_equal(failures, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whitespace),
        cmocka_unit_test(test_literals_and_operators),
        cmocka_unit_test(test_access),
        cmocka_unit_test(test_statements),
        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_tests),
        cmocka_unit_test(test_methods_and_globals),
        cmocka_unit_test(test_undefined_chains),
        cmocka_unit_test(test_syntax_errors),
        cmocka_unit_test(test_runtime_errors),
        cmocka_unit_test(test_loader),
        cmocka_unit_test(test_goldens),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
