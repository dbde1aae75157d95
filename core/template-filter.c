/* template-filter.c: Jinja's filters, `x | name(args)`, with the arguments and edge cases of
 * jinja2 3.1, and transformers' tojson. Filters that take a string turn their operand into one
 * first (none|trim is "None"), as Jinja does. Where Jinja returns a generator (map, select...)
 * these return a list. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

/* Arguments without their first k positionals: the rest of map('f', ...) and friends. */
static struct argv argv_tail(const struct argv *a, int k) {
    struct argv t = *a;
    k = k < a->n_pos ? k : a->n_pos;
    t.pos += k, t.n_pos -= k;
    return t;
}

static int ret_json(struct render *r, json_t *j, struct val *out) {
    *out = val_json(j);
    return j ? 0 : tpl_oom(r);
}

/* str(v) as a new string value. */
static json_t *to_str(const struct val *v) {
    if (val_is(v, JSON_STRING)) return json_incref(v->j);
    struct sbuf b = {0};
    val_str(&b, v);
    return str_from_sbuf(&b);
}

/* One step of an attribute path: digits index a list, anything else is a key. */
static void path_step(struct val *v, const char *part) {
    struct val next = val_undef(NULL);
    char *end;
    long long i = strtoll(part, &end, 10);
    if (*part >= '0' && *part <= '9' && !*end) {
        if (val_is(v, JSON_ARRAY) && i >= 0 && (size_t)i < json_array_size(v->j))
            next = val_json(json_incref(json_array_get(v->j, (size_t)i)));
    } else {
        tpl_getattr(v, part, &next);
    }
    val_drop(v);
    *v = next;
}

/* Jinja's attribute paths, as in map(attribute=...): an integer, or dotted parts ("a.0.b"). */
static void get_path(const json_t *item, const struct val *path, struct val *out) {
    char part[256];
    *out = val_json(json_incref((json_t *)item));
    if (val_is(path, JSON_INTEGER)) {
        snprintf(part, sizeof part, "%lld", (long long)json_integer_value(path->j));
        return path_step(out, part);
    }
    for (const char *p = val_is(path, JSON_STRING) ? json_string_value(path->j) : ""; *p;) {
        size_t n = strcspn(p, ".");
        snprintf(part, sizeof part, "%.*s", (int)(n < sizeof part - 1 ? n : sizeof part - 1), p);
        path_step(out, part);
        p += n + (p[n] == '.');
    }
}

/* Ordering key for sort, min, max, unique: the item or its attribute, lowercased when a
 * string and not case_sensitive. NULL: out of memory, or not a JSON value. */
static json_t *sort_key(const json_t *item, const struct val *attr, int case_sensitive) {
    struct val k;
    if (attr) get_path(item, attr, &k);
    else k = val_json(json_incref((json_t *)item));
    json_t *j = val_to_json(&k);
    val_drop(&k);
    if (j && json_is_string(j) && !case_sensitive) {
        json_t *low = str_case(j, 'l');
        json_decref(j);
        j = low;
    }
    return j;
}

struct keyed {
    json_t *key, *item;
    size_t order;
};

struct sort_ctx {
    int reverse, failed;
};

/* Stable, and stable under reverse too, as Python's sorted(). */
static int keyed_order(const void *pa, const void *pb, void *pctx) {
    const struct keyed *a = pa, *b = pb;
    struct sort_ctx *ctx = pctx;
    struct val x = val_json(a->key), y = val_json(b->key);
    int lt, gt;
    if (val_less(&x, &y, &lt) || val_less(&y, &x, &gt)) ctx->failed = 1, lt = gt = 0;
    if (lt != gt) return (lt ? -1 : 1) * (ctx->reverse ? -1 : 1);
    return a->order < b->order ? -1 : a->order > b->order;
}

/* items sorted by their key: the item, or its attribute path attr. */
static int sort_items(struct render *r, const struct srcpos *at, const char *name, json_t *items,
                      const struct val *attr, int case_sensitive, int reverse, struct val *out) {
    size_t n = json_array_size(items);
    struct keyed *k = calloc(n + 1, sizeof *k);
    struct sort_ctx ctx = {.reverse = reverse};
    int rc = k ? 0 : tpl_oom(r);
    for (size_t i = 0; i < n && rc == 0; i++) {
        json_t *item = json_array_get(items, i);
        k[i] = (struct keyed){sort_key(item, attr, case_sensitive), item, i};
        if (!k[i].key) rc = tpl_oom(r);
    }
    if (rc == 0) qsort_r(k, n, sizeof *k, keyed_order, &ctx);
    if (rc == 0 && ctx.failed)
        rc = tpl_fail(r, at, "%s: values of these types cannot be ordered", name);
    json_t *list = rc == 0 ? json_array() : NULL;
    for (size_t i = 0; list && i < n; i++)
        if (json_array_append(list, k[i].item)) json_decref(list), list = NULL;
    for (size_t i = 0; k && i < n; i++) json_decref(k[i].key);
    free(k);
    return rc ? -1 : ret_json(r, list, out);
}

/* min / max: the first of the smallest / largest, as Python's min() and max(). */
static int extreme(struct render *r, const struct srcpos *at, json_t *items, const struct val *attr,
                   int case_sensitive, int want_max, struct val *out) {
    json_t *best = NULL, *best_key = NULL;
    int rc = 0;
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        json_t *item = json_array_get(items, i), *key = sort_key(item, attr, case_sensitive);
        struct val x = val_json(key), y = val_json(best_key);
        int better = 0;
        if (!key) rc = tpl_oom(r);
        else if (best && val_less(want_max ? &y : &x, want_max ? &x : &y, &better))
            rc = tpl_fail(r, at, "%s: values of these types cannot be ordered",
                          want_max ? "max" : "min");
        if (rc == 0 && (!best || better)) {
            json_decref(best_key);
            best = item, best_key = key;
        } else {
            json_decref(key);
        }
    }
    json_decref(best_key);
    if (rc) return -1;
    *out = best ? val_json(json_incref(best)) : val_undef(NULL);
    return 0;
}

/* unique: first occurrences, in order. */
static int unique(struct render *r, json_t *items, const struct val *attr, int case_sensitive,
                  struct val *out) {
    json_t *list = json_array(), *keys = json_array();
    for (size_t i = 0; list && keys && i < json_array_size(items); i++) {
        json_t *item = json_array_get(items, i), *key = sort_key(item, attr, case_sensitive);
        int seen = 0;
        for (size_t m = 0; key && m < json_array_size(keys) && !seen; m++)
            seen = json_eq(json_array_get(keys, m), key);
        if (!key || (!seen && (json_array_append_new(keys, key) || json_array_append(list, item))))
            json_decref(list), list = NULL;
        else if (seen) json_decref(key);
    }
    json_decref(keys);
    return ret_json(r, list, out);
}

/* --- filters ---------------------------------------------------------------------------- */

#define A(pos, name) argv_get(args, pos, name)

static int flag(const struct val *v, int dflt) { return v ? val_truthy(v) : dflt; }

static int f_abs(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    (void)args;
    if (val_is(a, JSON_INTEGER) && json_integer_value(a->j) == INT64_MIN)
        return tpl_fail(r, at, "abs: integer overflow");
    if (val_is(a, JSON_INTEGER))
        return ret_json(r, json_integer(llabs(json_integer_value(a->j))), out);
    if (val_is(a, JSON_REAL)) return ret_json(r, json_real(fabs(json_real_value(a->j))), out);
    if (val_is_number(a)) return ret_json(r, json_integer(val_is(a, JSON_TRUE)), out);
    return tpl_fail(r, at, "abs: bad operand type '%s'", val_type_name(a));
}

/* Python attributes only: a namespace's; a dict's keys are items, not attributes. */
static int f_attr(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    const struct val *name = A(0, "name");
    if (!name) return tpl_fail(r, at, "attr: missing name");
    if (a->kind != V_NS || !val_is(name, JSON_STRING)) return 0;
    tpl_getattr(a, json_string_value(name->j), out);
    return 0;
}

static int f_case(struct render *r, const struct val *a, int mode, struct val *out) {
    json_t *s = to_str(a), *c = s ? str_case(s, mode) : NULL;
    json_decref(s);
    return ret_json(r, c, out);
}
static int f_capitalize(struct render *r, const struct srcpos *at, const struct val *a,
                        struct argv *args, struct val *out) {
    (void)at, (void)args;
    return f_case(r, a, 'c', out);
}
static int f_lower(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)at, (void)args;
    return f_case(r, a, 'l', out);
}
static int f_upper(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)at, (void)args;
    return f_case(r, a, 'u', out);
}
static int f_title(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)at, (void)args;
    return f_case(r, a, 'T', out);
}

static int f_length(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    (void)args;
    size_t n;
    if (a->kind == V_UNDEF) n = 0;
    else if (val_is(a, JSON_STRING))
        n = utf8_count(json_string_value(a->j), json_string_length(a->j));
    else if (val_is(a, JSON_ARRAY)) n = json_array_size(a->j);
    else if (val_is(a, JSON_OBJECT)) n = json_object_size(a->j);
    else return tpl_fail(r, at, "object of type '%s' has no len()", val_type_name(a));
    return ret_json(r, json_integer((json_int_t)n), out);
}

static int f_default(struct render *r, const struct srcpos *at, const struct val *a,
                     struct argv *args, struct val *out) {
    (void)at;
    const struct val *dflt = A(0, "default_value");
    if (a->kind == V_UNDEF || (flag(A(1, "boolean"), 0) && !val_truthy(a))) {
        if (dflt) return *out = val_dup(dflt), 0;
        return ret_json(r, json_string(""), out);
    }
    *out = val_dup(a);
    return 0;
}

static int f_dictsort(struct render *r, const struct srcpos *at, const struct val *a,
                      struct argv *args, struct val *out) {
    const struct val *by = A(1, "by");
    if (!val_is(a, JSON_OBJECT))
        return tpl_fail(r, at, "dictsort: expected a mapping, got %s", val_type_name(a));
    int by_value = by && val_is(by, JSON_STRING) && strcmp(json_string_value(by->j), "value") == 0;
    json_t *pairs = dict_list(a->j, 2);
    if (!pairs) return tpl_oom(r);
    struct val which = val_json(json_integer(by_value));
    int rc = which.j ? sort_items(r, at, "dictsort", pairs, &which, flag(A(0, "case_sensitive"), 0),
                                  flag(A(2, "reverse"), 0), out)
                     : tpl_oom(r);
    val_drop(&which);
    json_decref(pairs);
    return rc;
}

static int f_escape(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    (void)at, (void)args;
    json_t *s = to_str(a);
    if (!s) return tpl_oom(r);
    struct sbuf b = {0};
    const char *p = json_string_value(s);
    for (size_t i = 0; i < json_string_length(s); i++) {
        switch (p[i]) {
        case '&': sb_puts(&b, "&amp;"); break;
        case '<': sb_puts(&b, "&lt;"); break;
        case '>': sb_puts(&b, "&gt;"); break;
        case '"': sb_puts(&b, "&#34;"); break;
        case '\'': sb_puts(&b, "&#39;"); break;
        default: sb_putc(&b, p[i]);
        }
    }
    json_decref(s);
    return ret_json(r, str_from_sbuf(&b), out);
}

static int f_first_last(struct render *r, const struct srcpos *at, const struct val *a, int last,
                        struct val *out) {
    json_t *items = tpl_items(r, at, last ? "last" : "first", a);
    if (!items) return -1;
    size_t n = json_array_size(items);
    *out = n ? val_json(json_incref(json_array_get(items, last ? n - 1 : 0))) : val_undef(NULL);
    json_decref(items);
    return 0;
}
static int f_first(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)args;
    return f_first_last(r, at, a, 0, out);
}
static int f_last(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    (void)args;
    return f_first_last(r, at, a, 1, out);
}

/* Python's float() / int() of a string: surrounding whitespace allowed, nothing else. */
static int parse_number(const json_t *s, int as_int, int base, int64_t *i, double *f) {
    char buf[128];
    size_t n = json_string_length(s);
    if (n >= sizeof buf || (as_int && base != 0 && (base < 2 || base > 36))) return -1;
    const char *p = json_string_value(s), *end;
    size_t k = 0;
    for (size_t j = 0; j < n; j++)
        if (p[j] != '_') buf[k++] = p[j];
    buf[k] = 0;
    char *stop = buf;
    errno = 0;
    if (as_int) *i = strtoll(buf, &stop, base);
    else *f = strtod(buf, &stop);
    if (as_int && errno == ERANGE) return -1;
    for (end = stop; *end == ' ' || (*end >= '\t' && *end <= '\r'); end++) continue;
    return stop == buf || *end ? -1 : 0;
}

static int f_int(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    (void)at;
    const struct val *dflt = A(0, "default"), *base = A(1, "base");
    int radix = base && val_is(base, JSON_INTEGER) ? (int)json_integer_value(base->j) : 10;
    int64_t i;
    double f = 0;
    if (val_is(a, JSON_INTEGER)) return *out = val_dup(a), 0;
    if (val_is(a, JSON_TRUE) || val_is(a, JSON_FALSE))
        return ret_json(r, json_integer(val_is(a, JSON_TRUE)), out);
    if (val_is(a, JSON_STRING) && parse_number(a->j, 1, radix, &i, &f) == 0)
        return ret_json(r, json_integer(i), out);
    /* "42.23"|int is 42: through float, as Jinja does */
    int ok = val_is(a, JSON_REAL)
                 ? (f = json_real_value(a->j), 1)
                 : val_is(a, JSON_STRING) && parse_number(a->j, 0, 10, &i, &f) == 0;
    if (ok && isfinite(f) && fabs(f) < 9.2e18) return ret_json(r, json_integer((int64_t)f), out);
    if (dflt) return *out = val_dup(dflt), 0;
    return ret_json(r, json_integer(0), out);
}

static int f_float(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)at;
    const struct val *dflt = A(0, "default");
    double f;
    int64_t i;
    if (val_is_number(a)) return ret_json(r, json_real(val_number(a)), out);
    if (val_is(a, JSON_STRING) && parse_number(a->j, 0, 10, &i, &f) == 0 && isfinite(f))
        return ret_json(r, json_real(f), out);
    if (dflt) return *out = val_dup(dflt), 0;
    return ret_json(r, json_real(0), out);
}

static int f_indent(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    const struct val *width = A(0, "width");
    int first = flag(A(1, "first"), 0), blank = flag(A(2, "blank"), 0);
    struct sbuf pad = {0}, b = {0};
    if (width && val_is(width, JSON_STRING))
        sb_put(&pad, json_string_value(width->j), json_string_length(width->j));
    else if (width && !val_is(width, JSON_INTEGER))
        return tpl_fail(r, at, "indent: width must be an int or a string");
    else
        for (int64_t i = 0, n = width ? json_integer_value(width->j) : 4; i < n && i < 1024; i++)
            sb_putc(&pad, ' ');
    /* Jinja appends a newline, splits lines as str.splitlines() and joins them with "\n" */
    json_t *s = to_str(a), *lines = NULL;
    if (s) {
        struct sbuf t = {0};
        sb_put(&t, json_string_value(s), json_string_length(s));
        sb_putc(&t, '\n');
        lines = t.oom ? NULL : str_splitlines(t.p, t.n);
        free(t.p);
    }
    json_decref(s);
    if (!lines) return free(pad.p), tpl_oom(r);
    if (first) sb_put(&b, pad.p, pad.n);
    for (size_t i = 0; i < json_array_size(lines); i++) {
        json_t *line = json_array_get(lines, i);
        if (i) sb_putc(&b, '\n');
        if (i && (blank || json_string_length(line))) sb_put(&b, pad.p, pad.n);
        sb_put(&b, json_string_value(line), json_string_length(line));
    }
    json_decref(lines);
    free(pad.p);
    return ret_json(r, str_from_sbuf(&b), out);
}

static int f_items(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    (void)args;
    if (a->kind == V_UNDEF) return ret_json(r, json_array(), out);
    if (!val_is(a, JSON_OBJECT))
        return tpl_fail(r, at, "items: expected a mapping, got %s", val_type_name(a));
    return ret_json(r, dict_list(a->j, 2), out);
}

static int f_join(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    const struct val *sep = A(0, "d"), *attr = A(1, "attribute");
    json_t *items = tpl_items(r, at, "join", a);
    if (!items) return -1;
    struct sbuf b = {0};
    for (size_t i = 0; i < json_array_size(items); i++) {
        if (i && sep) val_str(&b, sep);
        struct val item;
        if (attr) get_path(json_array_get(items, i), attr, &item);
        else item = val_json(json_incref(json_array_get(items, i)));
        val_str(&b, &item);
        val_drop(&item);
    }
    json_decref(items);
    return ret_json(r, str_from_sbuf(&b), out);
}

static int f_list(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    (void)args;
    json_t *items = tpl_items(r, at, "list", a);
    if (!items) return -1;
    json_t *copy = json_copy(items);
    json_decref(items);
    return ret_json(r, copy, out);
}

/* map(attribute=...[, default=...]) or map('filter', args...). */
static int f_map(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    const struct val *attr = argv_get(args, -1, "attribute"), *dflt = argv_get(args, -1, "default");
    const struct val *filter = argv_get(args, 0, NULL);
    if (!attr && !(filter && val_is(filter, JSON_STRING)))
        return tpl_fail(r, at, "map: expected a filter name or attribute=");
    json_t *items = tpl_items(r, at, "map", a), *list = items ? json_array() : NULL;
    struct argv rest = argv_tail(args, 1);
    int rc = items && list ? 0 : (items ? tpl_oom(r) : -1);
    for (size_t i = 0; rc == 0 && i < json_array_size(items); i++) {
        struct val item = val_json(json_incref(json_array_get(items, i))), mapped;
        if (attr) {
            get_path(item.j, attr, &mapped);
            if (mapped.kind == V_UNDEF && dflt) mapped = val_dup(dflt);
        } else {
            rc = tpl_filter(r, at, json_string_value(filter->j), &item, &rest, &mapped);
        }
        val_drop(&item);
        if (rc) break;
        json_t *j = val_to_json(&mapped);
        val_drop(&mapped);
        if (!j || json_array_append_new(list, j))
            rc = tpl_fail(r, at, "map: result cannot be stored");
    }
    json_decref(items);
    if (rc) return json_decref(list), -1;
    return ret_json(r, list, out);
}

static int f_minmax(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, int want_max, struct val *out) {
    json_t *items = tpl_items(r, at, want_max ? "max" : "min", a);
    if (!items) return -1;
    int rc =
        extreme(r, at, items, A(1, "attribute"), flag(A(0, "case_sensitive"), 0), want_max, out);
    json_decref(items);
    return rc;
}
static int f_max(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    return f_minmax(r, at, a, args, 1, out);
}
static int f_min(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    return f_minmax(r, at, a, args, 0, out);
}

/* select, reject, selectattr, rejectattr: keep the items whose (attribute's) test is keep. */
static int choose(struct render *r, const struct srcpos *at, const char *name, const struct val *a,
                  struct argv *args, int by_attr, int keep, struct val *out) {
    const struct val *attr = by_attr ? argv_get(args, 0, NULL) : NULL;
    const struct val *test = argv_get(args, by_attr, NULL);
    if (by_attr && !(attr && (val_is(attr, JSON_STRING) || val_is(attr, JSON_INTEGER))))
        return tpl_fail(r, at, "%s: expected an attribute name", name);
    if (test && !val_is(test, JSON_STRING))
        return tpl_fail(r, at, "%s: expected a test name", name);
    struct argv rest = argv_tail(args, by_attr + 1);
    json_t *items = tpl_items(r, at, name, a), *list = items ? json_array() : NULL;
    int rc = items && list ? 0 : (items ? tpl_oom(r) : -1);
    for (size_t i = 0; rc == 0 && i < json_array_size(items); i++) {
        json_t *item = json_array_get(items, i);
        struct val subject;
        int pass = 0;
        if (attr) get_path(item, attr, &subject);
        else subject = val_json(json_incref(item));
        if (test) rc = tpl_test(r, at, json_string_value(test->j), &subject, &rest, &pass);
        else pass = val_truthy(&subject);
        val_drop(&subject);
        if (rc == 0 && pass == keep && json_array_append(list, item)) rc = tpl_oom(r);
    }
    json_decref(items);
    if (rc) return json_decref(list), -1;
    return ret_json(r, list, out);
}
static int f_select(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    return choose(r, at, "select", a, args, 0, 1, out);
}
static int f_reject(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    return choose(r, at, "reject", a, args, 0, 0, out);
}
static int f_selectattr(struct render *r, const struct srcpos *at, const struct val *a,
                        struct argv *args, struct val *out) {
    return choose(r, at, "selectattr", a, args, 1, 1, out);
}
static int f_rejectattr(struct render *r, const struct srcpos *at, const struct val *a,
                        struct argv *args, struct val *out) {
    return choose(r, at, "rejectattr", a, args, 1, 0, out);
}

static int f_replace(struct render *r, const struct srcpos *at, const struct val *a,
                     struct argv *args, struct val *out) {
    const struct val *old = A(0, "old"), *rep = A(1, "new"), *count = A(2, "count");
    if (!old || !rep) return tpl_fail(r, at, "replace: expected old and new");
    json_t *s = to_str(a), *o = to_str(old), *n = to_str(rep);
    int64_t k = count && val_is(count, JSON_INTEGER) ? json_integer_value(count->j) : -1;
    json_t *res = s && o && n ? str_replace(s, o, n, k) : NULL;
    json_decref(s), json_decref(o), json_decref(n);
    return ret_json(r, res, out);
}

static int f_reverse(struct render *r, const struct srcpos *at, const struct val *a,
                     struct argv *args, struct val *out) {
    (void)args;
    json_t *items = tpl_items(r, at, "reverse", a);
    if (!items) return -1;
    size_t n = json_array_size(items);
    struct sbuf b = {0};
    json_t *list = val_is(a, JSON_STRING) ? NULL : json_array();
    for (size_t i = n; i-- > 0;) {
        json_t *item = json_array_get(items, i);
        if (!list) sb_put(&b, json_string_value(item), json_string_length(item));
        else if (json_array_append(list, item)) b.oom = 1;
    }
    json_decref(items);
    if (list && b.oom) json_decref(list), list = NULL;
    return ret_json(r, list ? list : str_from_sbuf(&b), out);
}

static int f_round(struct render *r, const struct srcpos *at, const struct val *a,
                   struct argv *args, struct val *out) {
    const struct val *prec = A(0, "precision"), *method = A(1, "method");
    int64_t p = prec && val_is(prec, JSON_INTEGER) ? json_integer_value(prec->j) : 0;
    const char *m = method && val_is(method, JSON_STRING) ? json_string_value(method->j) : "common";
    if (!val_is_number(a))
        return tpl_fail(r, at, "round: expected a number, got %s", val_type_name(a));
    if (p < -300 || p > 300) return tpl_fail(r, at, "round: precision out of range");
    double x = val_number(a), scale = pow(10, (double)p);
    if (strcmp(m, "common") == 0) {
        if (!val_is(a, JSON_REAL) && p >= 0) return ret_json(r, json_integer((json_int_t)x), out);
        if (p >= 0) { /* printf rounds the exact binary value half-even, as Python's round */
            char buf[400];
            snprintf(buf, sizeof buf, "%.*f", (int)p, x);
            return ret_json(r, json_real(strtod(buf, NULL)), out);
        }
        return ret_json(r, json_real(nearbyint(x * scale) / scale), out);
    }
    if (strcmp(m, "ceil") && strcmp(m, "floor"))
        return tpl_fail(r, at, "round: method must be common, ceil or floor");
    return ret_json(r, json_real((strcmp(m, "ceil") ? floor(x * scale) : ceil(x * scale)) / scale),
                    out);
}

static int f_safe(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    (void)r, (void)at, (void)args;
    *out = val_dup(a);
    return 0;
}

static int f_sort(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    json_t *items = tpl_items(r, at, "sort", a);
    if (!items) return -1;
    int rc = sort_items(r, at, "sort", items, A(2, "attribute"), flag(A(1, "case_sensitive"), 0),
                        flag(A(0, "reverse"), 0), out);
    json_decref(items);
    return rc;
}

static int f_string(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    (void)at, (void)args;
    return ret_json(r, to_str(a), out);
}

static int f_sum(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                 struct val *out) {
    const struct val *attr = A(0, "attribute"), *start = A(1, "start");
    json_t *items = tpl_items(r, at, "sum", a);
    if (!items) return -1;
    int64_t i = start && val_is(start, JSON_INTEGER) ? json_integer_value(start->j) : 0;
    double f = start && val_is(start, JSON_REAL) ? json_real_value(start->j) : (double)i;
    int is_float = start && val_is(start, JSON_REAL), rc = 0;
    for (size_t k = 0; k < json_array_size(items) && rc == 0; k++) {
        struct val x;
        if (attr) get_path(json_array_get(items, k), attr, &x);
        else x = val_json(json_incref(json_array_get(items, k)));
        if (!val_is_number(&x)) rc = tpl_fail(r, at, "sum: cannot add %s", val_type_name(&x));
        else if (val_is(&x, JSON_REAL) || is_float) is_float = 1, f += val_number(&x);
        else if (__builtin_add_overflow(i, (int64_t)val_number(&x), &i))
            rc = tpl_fail(r, at, "sum: integer overflow");
        else f = (double)i;
        val_drop(&x);
    }
    json_decref(items);
    return rc ? -1 : ret_json(r, is_float ? json_real(f) : json_integer(i), out);
}

/* transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
 * sort_keys=False). */
static int f_tojson(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    const struct val *indent = A(1, "indent"), *seps = A(2, "separators");
    struct dump_opts o = {.ensure_ascii = flag(A(0, "ensure_ascii"), 0),
                          .sort_keys = flag(A(3, "sort_keys"), 0)};
    struct sbuf pad = {0}, b = {0};
    if (a->kind != V_JSON)
        return tpl_fail(r, at, "Object of type %s is not JSON serializable", val_type_name(a));
    if (indent && val_is(indent, JSON_STRING))
        sb_put(&pad, json_string_value(indent->j), json_string_length(indent->j));
    else if (indent && val_is(indent, JSON_INTEGER))
        for (int64_t i = 0; i < json_integer_value(indent->j) && i < 1024; i++) sb_putc(&pad, ' ');
    else if (indent && !val_is(indent, JSON_NULL))
        return tpl_fail(r, at, "tojson: indent must be an int or a string");
    if (indent && !val_is(indent, JSON_NULL)) o.indent = pad.p ? pad.p : "";
    if (seps && !val_is(seps, JSON_NULL)) {
        if (!val_is(seps, JSON_ARRAY) || json_array_size(seps->j) != 2 ||
            !json_is_string(json_array_get(seps->j, 0)) ||
            !json_is_string(json_array_get(seps->j, 1)))
            return free(pad.p), tpl_fail(r, at, "tojson: separators must be two strings");
        o.item_sep = json_string_value(json_array_get(seps->j, 0));
        o.key_sep = json_string_value(json_array_get(seps->j, 1));
    }
    json_dump_py(&b, a->j, &o);
    free(pad.p);
    return ret_json(r, str_from_sbuf(&b), out);
}

static int f_trim(struct render *r, const struct srcpos *at, const struct val *a, struct argv *args,
                  struct val *out) {
    (void)at;
    const struct val *chars = A(0, "chars");
    json_t *s = to_str(a), *c = chars && val_is(chars, JSON_STRING) ? chars->j : NULL;
    json_t *res = s ? str_strip(s, c, 1, 1) : NULL;
    json_decref(s);
    return ret_json(r, res, out);
}

static int f_unique(struct render *r, const struct srcpos *at, const struct val *a,
                    struct argv *args, struct val *out) {
    json_t *items = tpl_items(r, at, "unique", a);
    if (!items) return -1;
    int rc = unique(r, items, A(1, "attribute"), flag(A(0, "case_sensitive"), 0), out);
    json_decref(items);
    return rc;
}

/* Runs of word characters (Python's \w: letters, digits, underscore; non-ASCII letters are
 * taken to be anything but whitespace and punctuation blocks). */
static int f_wordcount(struct render *r, const struct srcpos *at, const struct val *a,
                       struct argv *args, struct val *out) {
    (void)at, (void)args;
    json_t *s = to_str(a);
    if (!s) return tpl_oom(r);
    const char *p = json_string_value(s);
    size_t n = json_string_length(s), words = 0;
    int in_word = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c = utf8_decode(p, n, &i);
        int w = c < 0x80 ? (c == '_' || (c >= '0' && c <= '9') ||
                            ((c | 0x20) >= 'a' && (c | 0x20) <= 'z'))
                         : !py_isspace(c) && !(c >= 0x2000 && c <= 0x206f) &&
                               !(c >= 0x3000 && c <= 0x303f) && !(c >= 0x80 && c <= 0xbf) &&
                               c != 0xd7 && c != 0xf7;
        words += w && !in_word;
        in_word = w;
    }
    json_decref(s);
    return ret_json(r, json_integer((json_int_t)words), out);
}

typedef int filter_fn(struct render *r, const struct srcpos *at, const struct val *a,
                      struct argv *args, struct val *out);

static const struct filter {
    const char *name;
    filter_fn *fn;
    const char *params[5]; /* checked against the call; {"*"}: any arguments */
} filters[] = {
    {"abs", f_abs, {0}},
    {"attr", f_attr, {"name"}},
    {"capitalize", f_capitalize, {0}},
    {"count", f_length, {0}},
    {"d", f_default, {"default_value", "boolean"}},
    {"default", f_default, {"default_value", "boolean"}},
    {"dictsort", f_dictsort, {"case_sensitive", "by", "reverse"}},
    {"e", f_escape, {0}},
    {"escape", f_escape, {0}},
    {"first", f_first, {0}},
    {"float", f_float, {"default"}},
    {"indent", f_indent, {"width", "first", "blank"}},
    {"int", f_int, {"default", "base"}},
    {"items", f_items, {0}},
    {"join", f_join, {"d", "attribute"}},
    {"last", f_last, {0}},
    {"length", f_length, {0}},
    {"list", f_list, {0}},
    {"lower", f_lower, {0}},
    {"map", f_map, {"*"}},
    {"max", f_max, {"case_sensitive", "attribute"}},
    {"min", f_min, {"case_sensitive", "attribute"}},
    {"reject", f_reject, {"*"}},
    {"rejectattr", f_rejectattr, {"*"}},
    {"replace", f_replace, {"old", "new", "count"}},
    {"reverse", f_reverse, {0}},
    {"round", f_round, {"precision", "method"}},
    {"safe", f_safe, {0}},
    {"select", f_select, {"*"}},
    {"selectattr", f_selectattr, {"*"}},
    {"sort", f_sort, {"reverse", "case_sensitive", "attribute"}},
    {"string", f_string, {0}},
    {"sum", f_sum, {"attribute", "start"}},
    {"title", f_title, {0}},
    {"tojson", f_tojson, {"ensure_ascii", "indent", "separators", "sort_keys"}},
    {"trim", f_trim, {"chars"}},
    {"unique", f_unique, {"case_sensitive", "attribute"}},
    {"upper", f_upper, {0}},
    {"wordcount", f_wordcount, {0}},
};

int tpl_filter(struct render *r, const struct srcpos *at, const char *name, const struct val *a,
               struct argv *args, struct val *out) {
    *out = val_undef(NULL);
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++) {
        const struct filter *f = &filters[i];
        if (strcmp(f->name, name) != 0) continue;
        int n = 0;
        while (n < 5 && f->params[n]) n++;
        if (!(n == 1 && strcmp(f->params[0], "*") == 0) &&
            argv_check(r, at, name, args, f->params, n))
            return -1;
        return f->fn(r, at, a, args, out);
    }
    return tpl_fail(r, at, "no filter named '%s'", name);
}
