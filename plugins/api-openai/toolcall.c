/* toolcall.c: finding and parsing the function calls a model writes into its output (text.h).
 *
 * Both formats carry each call as one JSON object; jansson reads an object off the front of the
 * remaining text (JSON_DISABLE_EOF_CHECK reports how many bytes it took), and the code between
 * objects only skips the separators the format defines. Anything unexpected makes the whole
 * output plain content again: a server must not invent calls the model did not write. */
#include <stdlib.h>
#include <string.h>

#include "text.h"

char *const tool_markers_hermes[] = {"<tool_call>", NULL};
char *const tool_markers_llama3[] = {"<|python_tag|>", NULL};

static size_t skip_space(const char *s, size_t i, size_t n) {
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++;
    return i;
}

static int starts_with(const char *s, size_t i, size_t n, const char *lit) {
    const size_t len = strlen(lit);
    return n - i >= len && memcmp(s + i, lit, len) == 0;
}

size_t tool_starts_at(enum tool_format format, const char *text, size_t n, size_t *hold) {
    *hold = 0;
    if (format == TOOL_FORMAT_HERMES) {
        const size_t at = text_find_any(text, n, 0, tool_markers_hermes, 1);
        if (at == SIZE_MAX) *hold = text_partial_suffix(text, n, tool_markers_hermes, 1);
        return at;
    }
    if (format == TOOL_FORMAT_LLAMA3) {
        const size_t first = skip_space(text, 0, n);
        if (first == n) { /* only spaces so far: a '{' may still come */
            *hold = n;
            return SIZE_MAX;
        }
        if (text[first] == '{') return first;
        const size_t at = text_find_any(text, n, 0, tool_markers_llama3, 1);
        if (at == SIZE_MAX) *hold = text_partial_suffix(text, n, tool_markers_llama3, 1);
        return at;
    }
    return SIZE_MAX;
}

/* Reads one call object at text[*i..n) and appends {"name", "arguments"} to calls; the arguments
 * member is `args_key` (or "arguments") and must be an object (a string holding one is taken as
 * is: some templates show arguments that way). */
static int read_call(const char *text, size_t *i, size_t n, const char *args_key, json_t *calls) {
    json_error_t jerr;
    json_t *obj = json_loadb(text + *i, n - *i, JSON_DISABLE_EOF_CHECK, &jerr);
    if (!obj) return 0;
    *i += (size_t)jerr.position;
    json_t *name = json_object_get(obj, "name");
    json_t *args = json_object_get(obj, args_key);
    if (!args) args = json_object_get(obj, "arguments");
    char *args_text = NULL;
    if (!args) args_text = strdup("{}");
    else if (json_is_object(args)) args_text = json_dumps(args, JSON_COMPACT);
    else if (json_is_string(args)) args_text = strdup(json_string_value(args));
    int ok = json_is_string(name) && args_text &&
             json_array_append_new(calls, json_pack("{s:O,s:s}", "name", name, "arguments",
                                                    args_text)) == 0;
    free(args_text);
    json_decref(obj);
    return ok;
}

static json_t *parse_hermes(const char *text, size_t n, json_t *calls) {
    size_t i = skip_space(text, 0, n);
    while (i < n) {
        if (!starts_with(text, i, n, "<tool_call>")) return NULL;
        i = skip_space(text, i + strlen("<tool_call>"), n);
        if (!read_call(text, &i, n, "arguments", calls)) return NULL;
        i = skip_space(text, i, n);
        if (starts_with(text, i, n, "</tool_call>")) /* the last one may end without it */
            i = skip_space(text, i + strlen("</tool_call>"), n);
    }
    return calls;
}

static json_t *parse_llama3(const char *text, size_t n, json_t *calls) {
    size_t i = skip_space(text, 0, n);
    if (starts_with(text, i, n, "<|python_tag|>")) i += strlen("<|python_tag|>");
    for (;;) {
        i = skip_space(text, i, n);
        if (!read_call(text, &i, n, "parameters", calls)) return NULL;
        i = skip_space(text, i, n);
        if (i == n) return calls;
        if (text[i] != ';') return NULL;
        i++;
    }
}

json_t *tool_calls_parse(enum tool_format format, const char *text, size_t n) {
    json_t *calls = json_array();
    if (!calls) return NULL;
    json_t *got = format == TOOL_FORMAT_HERMES ? parse_hermes(text, n, calls)
                : format == TOOL_FORMAT_LLAMA3 ? parse_llama3(text, n, calls) : NULL;
    if (!got || json_array_size(calls) == 0) {
        json_decref(calls);
        return NULL;
    }
    return calls;
}
