/* template-json.c: JSON text and float text exactly as Python writes them.
 *
 * Chat templates put tool schemas and arguments into prompts with tojson, which transformers
 * defines as json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...). A
 * model was trained on those bytes, so they are reproduced exactly: ", " and ": " separators
 * ("," with an indent), only control characters, '"' and '\' escaped, floats as Python's
 * repr() (the shortest text that reads back to the same double). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

/* Python's repr(float): shortest round-trip digits, positional notation when the decimal
 * exponent is in [-4, 16), otherwise d.ddde+XX; always a '.' or an 'e' (1.0, 1e+16). */
void float_repr(struct sbuf *b, double x) {
    if (isnan(x)) return sb_puts(b, "nan");
    if (isinf(x)) return sb_puts(b, x > 0 ? "inf" : "-inf");
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    /* buf is [-]d[.ddd]e(+|-)XX: split it into sign, digits and exponent */
    char digits[24];
    int nd = 0, neg = buf[0] == '-';
    const char *p = buf + neg;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    if (neg) sb_putc(b, '-');
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            sb_puts(b, "0.");
            for (int i = 0; i < -exp10 - 1; i++) sb_putc(b, '0');
            sb_put(b, digits, (size_t)nd);
            return;
        }
        for (int i = 0; i <= exp10; i++) sb_putc(b, i < nd ? digits[i] : '0');
        sb_putc(b, '.');
        if (nd > exp10 + 1) sb_put(b, digits + exp10 + 1, (size_t)(nd - exp10 - 1));
        else sb_putc(b, '0');
        return;
    }
    sb_putc(b, digits[0]);
    if (nd > 1) sb_putc(b, '.'), sb_put(b, digits + 1, (size_t)nd - 1);
    sb_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
}

static void dump_string(struct sbuf *b, const char *s, size_t n, int ensure_ascii) {
    sb_putc(b, '"');
    size_t run = 0; /* start of the bytes not yet written */
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\' && (c < 0x7f || (c >= 0x80 && !ensure_ascii))) {
            i++;
            continue;
        }
        sb_put(b, s + run, i - run);
        size_t at = i;
        uint32_t cp = utf8_decode(s, n, &i);
        switch (cp) {
        case '"': sb_puts(b, "\\\""); break;
        case '\\': sb_puts(b, "\\\\"); break;
        case '\b': sb_puts(b, "\\b"); break;
        case '\f': sb_puts(b, "\\f"); break;
        case '\n': sb_puts(b, "\\n"); break;
        case '\r': sb_puts(b, "\\r"); break;
        case '\t': sb_puts(b, "\\t"); break;
        default:
            if (cp == 0x7f && !ensure_ascii) {
                sb_put(b, s + at, 1);
            } else if (cp >= 0x10000) { /* a surrogate pair, as Python writes it */
                cp -= 0x10000;
                sb_printf(b, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
            } else {
                sb_printf(b, "\\u%04x", cp);
            }
        }
        run = i;
    }
    sb_put(b, s + run, n - run);
    sb_putc(b, '"');
}

static void newline(struct sbuf *b, const struct dump_opts *o, int level) {
    sb_putc(b, '\n');
    for (int i = 0; i < level; i++) sb_puts(b, o->indent);
}

static int key_order(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void dump(struct sbuf *b, const json_t *v, const struct dump_opts *o, int level) {
    const char *item_sep = o->item_sep ? o->item_sep : o->indent ? "," : ", ";
    const char *key_sep = o->key_sep ? o->key_sep : ": ";
    switch (json_typeof(v)) {
    case JSON_NULL: sb_puts(b, "null"); break;
    case JSON_TRUE: sb_puts(b, "true"); break;
    case JSON_FALSE: sb_puts(b, "false"); break;
    case JSON_INTEGER: sb_printf(b, "%" PRId64, (int64_t)json_integer_value(v)); break;
    case JSON_REAL: float_repr(b, json_real_value(v)); break;
    case JSON_STRING:
        dump_string(b, json_string_value(v), json_string_length(v), o->ensure_ascii);
        break;
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        if (n == 0) return sb_puts(b, "[]");
        sb_putc(b, '[');
        for (size_t i = 0; i < n; i++) {
            if (i) sb_puts(b, item_sep);
            if (o->indent) newline(b, o, level + 1);
            dump(b, json_array_get(v, i), o, level + 1);
        }
        if (o->indent) newline(b, o, level);
        sb_putc(b, ']');
        break;
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(v), k = 0;
        if (n == 0) return sb_puts(b, "{}");
        const char **keys = malloc(n * sizeof *keys);
        if (!keys) {
            b->oom = 1;
            return;
        }
        const char *key;
        json_t *item;
        json_object_foreach((json_t *)v, key, item) keys[k++] = key;
        if (o->sort_keys) qsort(keys, n, sizeof *keys, key_order);
        sb_putc(b, '{');
        for (size_t i = 0; i < n; i++) {
            if (i) sb_puts(b, item_sep);
            if (o->indent) newline(b, o, level + 1);
            dump_string(b, keys[i], strlen(keys[i]), o->ensure_ascii);
            sb_puts(b, key_sep);
            dump(b, json_object_get(v, keys[i]), o, level + 1);
        }
        free(keys);
        if (o->indent) newline(b, o, level);
        sb_putc(b, '}');
        break;
    }
    }
}

void json_dump_py(struct sbuf *b, const json_t *v, const struct dump_opts *o) { dump(b, v, o, 0); }
