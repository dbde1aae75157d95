/* template-value.c: the values templates compute with, and Python's rules for them.
 *
 * A value is a JSON value (jansson: none, bool, int, float, str, list, dict) or one of the
 * things JSON cannot hold: undefined, a namespace, a macro, a global function. Templates were
 * written against Python, so truth, equality (1 == 1.0 == True), ordering, str() and repr()
 * follow Python here; strings are UTF-8 and counted in code points. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

/* --- arena ------------------------------------------------------------------------------ */

struct tpl_chunk {
    struct tpl_chunk *next;
    size_t size, used;
    _Alignas(max_align_t) unsigned char data[];
};

void *tpl_alloc(struct tpl_arena *a, size_t n) {
    n = (n + _Alignof(max_align_t) - 1) & ~(_Alignof(max_align_t) - 1);
    struct tpl_chunk *c = a->head;
    if (!c || c->size - c->used < n) {
        size_t size = n > 16384 ? n : 16384;
        if (!(c = malloc(sizeof *c + size))) return NULL;
        c->size = size, c->used = 0, c->next = a->head;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *tpl_strndup(struct tpl_arena *a, const char *s, size_t n) {
    char *p = tpl_alloc(a, n + 1);
    if (p) memcpy(p, s, n), p[n] = 0;
    return p;
}

void tpl_arena_free(struct tpl_arena *a) {
    for (struct tpl_chunk *c = a->head, *next; c; c = next) next = c->next, free(c);
    a->head = NULL;
}

/* --- byte strings ----------------------------------------------------------------------- */

void sb_put(struct sbuf *b, const char *s, size_t n) {
    if (b->oom || n == 0) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = b->n + n <= TPL_MAX_STRING ? realloc(b->p, cap) : NULL;
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void sb_puts(struct sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
void sb_putc(struct sbuf *b, char c) { sb_put(b, &c, 1); }

void sb_printf(struct sbuf *b, const char *fmt, ...) {
    char buf[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    sb_put(b, buf, n < 0 ? 0 : (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* --- UTF-8 ------------------------------------------------------------------------------ */

json_t *str_new(const char *s, size_t n) { return json_stringn_nocheck(s, n); }

json_t *str_from_sbuf(struct sbuf *b) {
    json_t *s = b->oom ? NULL : str_new(b->p ? b->p : "", b->n);
    free(b->p);
    b->p = NULL;
    return s;
}

size_t utf8_count(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xc0) != 0x80;
    return k;
}

size_t utf8_advance(const char *s, size_t n, size_t at, size_t k) {
    while (k > 0 && at < n) {
        at++;
        while (at < n && ((unsigned char)s[at] & 0xc0) == 0x80) at++;
        k--;
    }
    return at;
}

uint32_t utf8_decode(const char *s, size_t n, size_t *at) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = *at;
    uint32_t c = u[i];
    size_t k = c < 0x80             ? 1
               : (c & 0xe0) == 0xc0 ? 2
               : (c & 0xf0) == 0xe0 ? 3
               : (c & 0xf8) == 0xf0 ? 4
                                    : 1;
    if (i + k > n) k = 1;
    uint32_t cp = k == 1 ? c : c & (0xffu >> (k + 1));
    for (size_t j = 1; j < k; j++) cp = cp << 6 | (u[i + j] & 0x3f);
    *at = i + k;
    return cp;
}

void utf8_put(struct sbuf *b, uint32_t cp) {
    char out[4];
    if (cp < 0x80) return sb_putc(b, (char)cp);
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3f));
        return sb_put(b, out, 2);
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | cp >> 12), out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return sb_put(b, out, 3);
    }
    out[0] = (char)(0xf0 | cp >> 18), out[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3f)), out[3] = (char)(0x80 | (cp & 0x3f));
    sb_put(b, out, 4);
}

/* Python's str.isspace() for one code point. */
int py_isspace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* Python's str.isprintable() for one code point, for repr(): control, format, separator and
 * private-use characters are escaped. (Unassigned code points are taken as printable.) */
static int py_isprintable(uint32_t cp) {
    static const uint32_t hidden[][2] = {
        {0x00, 0x1f},       {0x7f, 0xa0},       {0xad, 0xad},       {0x600, 0x605},
        {0x61c, 0x61c},     {0x6dd, 0x6dd},     {0x70f, 0x70f},     {0x1680, 0x1680},
        {0x180e, 0x180e},   {0x2000, 0x200f},   {0x2028, 0x202f},   {0x205f, 0x2064},
        {0x2066, 0x206f},   {0x3000, 0x3000},   {0xd800, 0xf8ff},   {0xfeff, 0xfeff},
        {0xfff9, 0xfffb},   {0x110bd, 0x110bd}, {0xe0001, 0xe007f}, {0xf0000, 0x10ffff},
    };
    for (size_t i = 0; i < sizeof hidden / sizeof hidden[0]; i++)
        if (cp >= hidden[i][0] && cp <= hidden[i][1]) return 0;
    return 1;
}

/* --- values ----------------------------------------------------------------------------- */

struct val val_undef(const char *name) { return (struct val){.kind = V_UNDEF, .name = name}; }

struct val val_json(json_t *j) { return (struct val){.kind = V_JSON, .j = j}; }

struct val val_dup(const struct val *v) {
    struct val d = *v;
    if (d.kind == V_JSON) json_incref(d.j);
    return d;
}

void val_drop(struct val *v) {
    if (v->kind == V_JSON) json_decref(v->j);
    *v = val_undef(NULL);
}

int val_is(const struct val *v, json_type type) {
    return v && v->kind == V_JSON && json_typeof(v->j) == type;
}

int val_is_number(const struct val *v) {
    return v->kind == V_JSON && (json_is_number(v->j) || json_is_boolean(v->j));
}

double val_number(const struct val *v) {
    if (json_is_integer(v->j)) return (double)json_integer_value(v->j);
    if (json_is_real(v->j)) return json_real_value(v->j);
    return json_is_true(v->j);
}

int val_truthy(const struct val *v) {
    if (v->kind == V_UNDEF) return 0;
    if (v->kind != V_JSON) return 1;
    const json_t *j = v->j;
    switch (json_typeof(j)) {
    case JSON_NULL: case JSON_FALSE: return 0;
    case JSON_TRUE: return 1;
    case JSON_INTEGER: return json_integer_value(j) != 0;
    case JSON_REAL: return json_real_value(j) != 0;
    case JSON_STRING: return json_string_length(j) > 0;
    case JSON_ARRAY: return json_array_size(j) > 0;
    case JSON_OBJECT: return json_object_size(j) > 0;
    }
    return 0;
}

const char *val_type_name(const struct val *v) {
    switch (v->kind) {
    case V_UNDEF: return "Undefined";
    case V_NS: return "Namespace";
    case V_MACRO: return "Macro";
    case V_FUNC: return "function";
    case V_JSON: break;
    }
    switch (json_typeof(v->j)) {
    case JSON_NULL: return "NoneType";
    case JSON_TRUE: case JSON_FALSE: return "bool";
    case JSON_INTEGER: return "int";
    case JSON_REAL: return "float";
    case JSON_STRING: return "str";
    case JSON_ARRAY: return "list";
    case JSON_OBJECT: return "dict";
    }
    return "object";
}

json_t *val_to_json(const struct val *v) {
    if (v->kind == V_JSON) return json_incref(v->j);
    return v->kind == V_UNDEF ? json_null() : NULL;
}

/* --- equality and order ----------------------------------------------------------------- */

static int is_num(const json_t *j) { return json_is_number(j) || json_is_boolean(j); }

/* A number (bools are the integers 0 and 1, as in Python): 1 with *i for an integer, 0 with
 * *f for a float. */
static int num_of(const json_t *j, int64_t *i, double *f) {
    if (json_is_real(j)) return *i = 0, *f = json_real_value(j), 0;
    *i = json_is_integer(j) ? (int64_t)json_integer_value(j) : json_is_true(j);
    *f = (double)*i;
    return 1;
}

/* An int against a float, exactly (Python does not round the int to a double): -1, 0 or 1. */
static int int_float_cmp(int64_t i, double f) {
    if (f >= 9223372036854775808.0) return -1;
    if (f < -9223372036854775808.0) return 1;
    double t = trunc(f);
    int64_t ti = (int64_t)t;
    if (i != ti) return i < ti ? -1 : 1;
    return t == f ? 0 : f > t ? -1 : 1;
}

static int num_cmp(const json_t *a, const json_t *b) {
    int64_t i, k;
    double x, y;
    int a_int = num_of(a, &i, &x), b_int = num_of(b, &k, &y);
    if (a_int && b_int) return (i > k) - (i < k);
    if (a_int) return int_float_cmp(i, y);
    if (b_int) return -int_float_cmp(k, x);
    return (x > y) - (x < y);
}

int json_eq(const json_t *a, const json_t *b) {
    if (a == b) return 1;
    if (is_num(a) && is_num(b)) return num_cmp(a, b) == 0;
    if (json_typeof(a) != json_typeof(b)) return 0;
    switch (json_typeof(a)) {
    case JSON_STRING:
        return json_string_length(a) == json_string_length(b) &&
               memcmp(json_string_value(a), json_string_value(b), json_string_length(a)) == 0;
    case JSON_ARRAY:
        if (json_array_size(a) != json_array_size(b)) return 0;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!json_eq(json_array_get(a, i), json_array_get(b, i))) return 0;
        return 1;
    case JSON_OBJECT: {
        if (json_object_size(a) != json_object_size(b)) return 0;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)a, k, v) {
            json_t *w = json_object_get(b, k);
            if (!w || !json_eq(v, w)) return 0;
        }
        return 1;
    }
    default: return 1; /* null */
    }
}

int val_eq(const struct val *a, const struct val *b) {
    if (a->kind != b->kind) return 0;
    switch (a->kind) {
    case V_UNDEF: return 1;
    case V_JSON: return json_eq(a->j, b->j);
    case V_NS: return a->ns == b->ns;
    case V_MACRO: return a->macro == b->macro;
    case V_FUNC: return a->fn == b->fn;
    }
    return 0;
}

static int json_less(const json_t *a, const json_t *b, int *less) {
    if (is_num(a) && is_num(b)) {
        *less = num_cmp(a, b) < 0;
        return 0;
    }
    if (json_is_string(a) && json_is_string(b)) { /* byte order is code point order in UTF-8 */
        size_t na = json_string_length(a), nb = json_string_length(b);
        int c = memcmp(json_string_value(a), json_string_value(b), na < nb ? na : nb);
        *less = c < 0 || (c == 0 && na < nb);
        return 0;
    }
    if (json_is_array(a) && json_is_array(b)) {
        size_t na = json_array_size(a), nb = json_array_size(b);
        for (size_t i = 0; i < na && i < nb; i++) {
            json_t *x = json_array_get(a, i), *y = json_array_get(b, i);
            if (!json_eq(x, y)) return json_less(x, y, less);
        }
        *less = na < nb;
        return 0;
    }
    return -1;
}

int val_less(const struct val *a, const struct val *b, int *less) {
    if (a->kind != V_JSON || b->kind != V_JSON) return -1;
    return json_less(a->j, b->j, less);
}

/* --- str() and repr() ------------------------------------------------------------------- */

static void json_repr(struct sbuf *b, const json_t *j);

static void str_repr(struct sbuf *b, const char *s, size_t n) {
    char quote = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    sb_putc(b, quote);
    for (size_t i = 0; i < n;) {
        size_t start = i;
        uint32_t cp = utf8_decode(s, n, &i);
        if (cp == (uint32_t)quote || cp == '\\') sb_putc(b, '\\'), sb_putc(b, (char)cp);
        else if (cp == '\t') sb_puts(b, "\\t");
        else if (cp == '\n') sb_puts(b, "\\n");
        else if (cp == '\r') sb_puts(b, "\\r");
        else if (py_isprintable(cp)) sb_put(b, s + start, i - start);
        else if (cp < 0x100) sb_printf(b, "\\x%02x", cp);
        else if (cp < 0x10000) sb_printf(b, "\\u%04x", cp);
        else sb_printf(b, "\\U%08x", cp);
    }
    sb_putc(b, quote);
}

static void json_str(struct sbuf *b, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_NULL: sb_puts(b, "None"); break;
    case JSON_TRUE: sb_puts(b, "True"); break;
    case JSON_FALSE: sb_puts(b, "False"); break;
    case JSON_INTEGER: sb_printf(b, "%" PRId64, (int64_t)json_integer_value(j)); break;
    case JSON_REAL: float_repr(b, json_real_value(j)); break;
    case JSON_STRING: sb_put(b, json_string_value(j), json_string_length(j)); break;
    case JSON_ARRAY: {
        sb_putc(b, '[');
        for (size_t i = 0; i < json_array_size(j); i++) {
            if (i) sb_puts(b, ", ");
            json_repr(b, json_array_get(j, i));
        }
        sb_putc(b, ']');
        break;
    }
    case JSON_OBJECT: {
        const char *k;
        json_t *v;
        int first = 1;
        sb_putc(b, '{');
        json_object_foreach((json_t *)j, k, v) {
            if (!first) sb_puts(b, ", ");
            first = 0;
            str_repr(b, k, strlen(k));
            sb_puts(b, ": ");
            json_repr(b, v);
        }
        sb_putc(b, '}');
        break;
    }
    }
}

static void json_repr(struct sbuf *b, const json_t *j) {
    if (json_is_string(j)) str_repr(b, json_string_value(j), json_string_length(j));
    else json_str(b, j);
}

static void other_str(struct sbuf *b, const struct val *v) {
    switch (v->kind) {
    case V_NS: {
        if (v->ns->printing) { /* {% set ns.me = ns %}: as Python prints a dict that holds itself */
            sb_puts(b, "<Namespace {...}>");
            break;
        }
        v->ns->printing = 1;
        sb_puts(b, "<Namespace {");
        for (int i = 0; i < v->ns->n; i++) {
            if (i) sb_puts(b, ", ");
            str_repr(b, v->ns->vars[i].name, strlen(v->ns->vars[i].name));
            sb_puts(b, ": ");
            val_repr(b, &v->ns->vars[i].v);
        }
        sb_puts(b, "}>");
        v->ns->printing = 0;
        break;
    }
    case V_MACRO: sb_printf(b, "<Macro '%s'>", v->macro->name); break;
    case V_FUNC: sb_puts(b, "<built-in function>"); break;
    default: break;
    }
}

void val_str(struct sbuf *b, const struct val *v) {
    if (v->kind == V_JSON) json_str(b, v->j);
    else other_str(b, v);
}

void val_repr(struct sbuf *b, const struct val *v) {
    if (v->kind == V_JSON) json_repr(b, v->j);
    else if (v->kind == V_UNDEF) sb_puts(b, "Undefined");
    else other_str(b, v);
}
