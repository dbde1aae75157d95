/* fuzz_template.c: libFuzzer target for the chat-template parser and renderer.
 *
 * The input is a template, optionally followed by a NUL byte and a JSON render context (a
 * fixed conversation with tools is used when there is none or it is not an object). Every
 * input must either fail with a one-line message naming the template, or render valid UTF-8.
 * ASan and UBSan catch the rest; the renderer's own limits keep each run short. Build with
 * -DTMX_FUZZ=ON and clang, as tools/fuzz.sh does for the safetensors target. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tmx/template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char default_context[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"},"
    " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi \\u00e9\"}]},"
    " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"abc123def\", "
    "\"type\": \"function\","
    "   \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1.5, \"y\": [true, null]}}}]},"
    " {\"role\": \"tool\", \"tool_call_id\": \"abc123def\", \"content\": \"42\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "
    "{\"type\": \"object\","
    "   \"properties\": {\"x\": {\"type\": \"number\"}}, \"required\": [\"x\"]}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

static int valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80             ? 1
                   : (c & 0xe0) == 0xc0 ? 2
                   : (c & 0xf0) == 0xe0 ? 3
                   : (c & 0xf8) == 0xf0 ? 4
                                        : 0;
        if (k == 0 || i + k > n) return 0;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

static void check_error(char *err) {
    if (!err || strchr(err, '\n') || strncmp(err, "fuzz", 4) != 0) abort();
    free(err);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t n = nul ? (size_t)(nul - data) : size;
    json_t *ctx = nul ? json_loadb((const char *)nul + 1, size - n - 1, 0, NULL) : NULL;
    if (!json_is_object(ctx)) {
        json_decref(ctx);
        ctx = json_loads(default_context, 0, NULL);
    }
    struct tm now = {.tm_year = 125, .tm_mon = 5, .tm_mday = 28, .tm_hour = 12};
    struct tmx_template *t = NULL;
    char *err = NULL, *out = NULL;
    size_t len = 0;
    if (tmx_template_parse((const char *)data, n, "fuzz", &t, &err) != TMX_OK) {
        check_error(err);
    } else if (tmx_template_render(t, ctx, &now, &out, &len, &err) != TMX_OK) {
        check_error(err);
    } else {
        if (strlen(out) > len || !valid_utf8((const unsigned char *)out, len)) abort();
        free(out);
    }
    tmx_template_free(t);
    json_decref(ctx);
    return 0;
}
