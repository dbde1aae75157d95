/* template-method.c: calls that are not filters: Python's str and dict methods (only those
 * that do not modify anything, as in Jinja's immutable sandbox), the globals range(),
 * namespace(), dict(), raise_exception() and strftime_now(), and argument handling shared
 * with the filters. Case mapping covers ASCII letters only. */
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

/* --- arguments -------------------------------------------------------------------------- */

const struct val *argv_get(const struct argv *a, int pos, const char *name) {
    if (pos >= 0 && pos < a->n_pos) return &a->pos[pos];
    for (int i = 0; name && i < a->n_kw; i++)
        if (strcmp(a->kw_names[i], name) == 0) return &a->kw[i];
    return NULL;
}

int argv_check(struct render *r, const struct srcpos *at, const char *callee,
               const struct argv *a, const char *const *names, int n) {
    if (a->n_pos > n)
        return tpl_fail(r, at, "%s takes at most %d argument(s), got %d", callee, n, a->n_pos);
    for (int k = 0; k < a->n_kw; k++) {
        int i = 0;
        while (i < n && strcmp(names[i], a->kw_names[k]) != 0) i++;
        if (i == n)
            return tpl_fail(r, at, "%s got an unexpected argument '%s'", callee, a->kw_names[k]);
        if (i < a->n_pos)
            return tpl_fail(r, at, "%s got two values for '%s'", callee, a->kw_names[k]);
    }
    return 0;
}

static int ret_json(struct render *r, json_t *j, struct val *out) {
    *out = val_json(j);
    return j ? 0 : tpl_oom(r);
}

/* --- strings and dicts ------------------------------------------------------------------ */

json_t *dict_list(const json_t *d, int which) {
    json_t *list = json_array();
    const char *k;
    json_t *v;
    if (!list) return NULL;
    json_object_foreach((json_t *)d, k, v) {
        json_t *item = which == 0   ? json_string(k)
                       : which == 1 ? json_incref(v)
                                    : json_pack("[sO]", k, v);
        if (json_array_append_new(list, item)) return json_decref(list), NULL;
    }
    return list;
}

json_t *str_chars(const json_t *s) {
    const char *p = json_string_value(s);
    size_t n = json_string_length(s);
    json_t *list = json_array();
    for (size_t i = 0, next; list && i < n; i = next) {
        next = utf8_advance(p, n, i, 1);
        if (json_array_append_new(list, str_new(p + i, next - i))) json_decref(list), list = NULL;
    }
    return list;
}

static int in_chars(uint32_t cp, const json_t *chars) {
    if (!chars) return py_isspace(cp);
    const char *s = json_string_value(chars);
    size_t n = json_string_length(chars);
    for (size_t i = 0; i < n;)
        if (utf8_decode(s, n, &i) == cp) return 1;
    return 0;
}

json_t *str_strip(const json_t *s, const json_t *chars, int left, int right) {
    const char *p = json_string_value(s);
    size_t n = json_string_length(s), start = 0, end = n;
    while (left && start < end) {
        size_t next = start;
        if (!in_chars(utf8_decode(p, end, &next), chars)) break;
        start = next;
    }
    while (right && end > start) {
        size_t at = end - 1, next;
        while (at > start && ((unsigned char)p[at] & 0xc0) == 0x80) at--;
        next = at;
        if (!in_chars(utf8_decode(p, end, &next), chars)) break;
        end = at;
    }
    return str_new(p + start, end - start);
}

json_t *str_replace(const json_t *s, const json_t *old, const json_t *rep, int64_t count) {
    const char *p = json_string_value(s), *o = json_string_value(old), *w = json_string_value(rep);
    size_t n = json_string_length(s), no = json_string_length(old), nw = json_string_length(rep);
    struct sbuf b = {0};
    size_t i = 0;
    for (int64_t done = 0; count < 0 || done < count; done++) {
        if (no == 0) { /* an empty old string matches before every character and at the end */
            sb_put(&b, w, nw);
            if (i >= n) {
                i = n + 1;
                break;
            }
            size_t next = utf8_advance(p, n, i, 1);
            sb_put(&b, p + i, next - i);
            i = next;
            continue;
        }
        const char *hit = memmem(p + i, n - i, o, no);
        if (!hit) break;
        sb_put(&b, p + i, (size_t)(hit - p) - i);
        sb_put(&b, w, nw);
        i = (size_t)(hit - p) + no;
    }
    if (i <= n) sb_put(&b, p + i, n - i);
    return str_from_sbuf(&b);
}

static int is_lower(char c) { return c >= 'a' && c <= 'z'; }
static int is_upper(char c) { return c >= 'A' && c <= 'Z'; }
static char to_upper(char c) { return is_lower(c) ? (char)(c - 32) : c; }
static char to_lower(char c) { return is_upper(c) ? (char)(c + 32) : c; }

/* mode: 'u'pper, 'l'ower, 'c'apitalize, 't'itle (str.title: a letter after a non-letter is
 * upper), 'T'itle (Jinja's title filter: upper after start, whitespace, - ( { [ <). */
json_t *str_case(const json_t *s, int mode) {
    const char *p = json_string_value(s);
    size_t n = json_string_length(s);
    char *q = malloc(n + 1);
    if (!q) return NULL;
    int start = 1;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        int up = mode == 'u' || ((mode == 'c' || mode == 't' || mode == 'T') && start);
        q[i] = up ? to_upper(c) : mode == 'u' ? c : to_lower(c);
        if (mode == 'c') start = 0;
        else if (mode == 't') start = !is_lower(c) && !is_upper(c);
        else if (mode == 'T') start = strchr("-({[< \t\n\r\f\v", c) != NULL && c != 0;
    }
    json_t *out = str_new(q, n);
    free(q);
    return out;
}

/* str.splitlines(): breaks at \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029. */
json_t *str_splitlines(const char *s, size_t n) {
    json_t *lines = json_array();
    size_t start = 0;
    for (size_t i = 0; lines && i < n;) {
        size_t at = i;
        uint32_t c = utf8_decode(s, n, &i);
        if (c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || (c >= 0x1c && c <= 0x1e) ||
            c == 0x85 || c == 0x2028 || c == 0x2029) {
            if (json_array_append_new(lines, str_new(s + start, at - start)))
                json_decref(lines), lines = NULL;
            if (c == '\r' && i < n && s[i] == '\n') i++;
            start = i;
        }
    }
    if (lines && start < n && json_array_append_new(lines, str_new(s + start, n - start)))
        json_decref(lines), lines = NULL;
    return lines;
}

static size_t prev_at(const char *p, size_t at) {
    do at--;
    while (at > 0 && ((unsigned char)p[at] & 0xc0) == 0x80);
    return at;
}

static int space_after(const char *p, size_t n, size_t at) {
    return py_isspace(utf8_decode(p, n, &at));
}

static int space_before(const char *p, size_t at) {
    size_t k = prev_at(p, at);
    return py_isspace(utf8_decode(p, at, &k));
}

static int put_part(json_t *parts, const char *p, size_t from, size_t to, int front) {
    return json_array_insert_new(parts, front ? 0 : json_array_size(parts),
                                 str_new(p + from, to - from));
}

/* str.split(sep, maxsplit), or str.rsplit (from_right). Without sep, runs of whitespace
 * separate and no empty pieces come out; what is left after maxsplit cuts is one piece. */
static json_t *str_split(const json_t *s, const json_t *sep, int64_t maxsplit, int from_right) {
    const char *p = json_string_value(s), *d = sep ? json_string_value(sep) : NULL;
    size_t n = json_string_length(s), nd = sep ? json_string_length(sep) : 0;
    json_t *parts = json_array();
    int bad = !parts;
    int64_t k = 0;
    if (!sep && !from_right) {
        for (size_t i = 0, j; !bad; i = j, k++) {
            while (i < n && space_after(p, n, i)) i = utf8_advance(p, n, i, 1);
            if (i == n) break;
            j = maxsplit < 0 || k < maxsplit ? i : n;
            while (j < n && !space_after(p, n, j)) j = utf8_advance(p, n, j, 1);
            bad = put_part(parts, p, i, j, 0);
        }
    } else if (!sep) {
        for (size_t j = n, i; !bad; j = i, k++) {
            while (j > 0 && space_before(p, j)) j = prev_at(p, j);
            if (j == 0) break;
            i = maxsplit < 0 || k < maxsplit ? j : 0;
            while (i > 0 && !space_before(p, i)) i = prev_at(p, i);
            bad = put_part(parts, p, i, j, 1);
        }
    } else if (!from_right) {
        size_t i = 0;
        for (const char *hit;
             !bad && (maxsplit < 0 || k < maxsplit) && (hit = memmem(p + i, n - i, d, nd)); k++) {
            bad = put_part(parts, p, i, (size_t)(hit - p), 0);
            i = (size_t)(hit - p) + nd;
        }
        bad = bad || put_part(parts, p, i, n, 0);
    } else {
        size_t j = n;
        for (; !bad && (maxsplit < 0 || k < maxsplit) && j >= nd; k++) {
            size_t at = j - nd + 1;
            while (at-- > 0 && memcmp(p + at, d, nd) != 0) continue;
            if (at == (size_t)-1) break;
            bad = put_part(parts, p, at + nd, j, 1);
            j = at;
        }
        bad = bad || put_part(parts, p, 0, j, 1);
    }
    return bad ? (json_decref(parts), NULL) : parts;
}

static int affix(const json_t *s, const json_t *fix, int end) {
    size_t n = json_string_length(s), k = json_string_length(fix);
    return k <= n &&
           memcmp(json_string_value(s) + (end ? n - k : 0), json_string_value(fix), k) == 0;
}

/* The methods of str: each gets its arguments checked against the table below. */
typedef int method_fn(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                      struct argv *a, struct val *out);

static int m_strip(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                   struct argv *a, struct val *out) {
    const struct val *chars = argv_get(a, 0, "chars");
    if (chars && !val_is(chars, JSON_STRING) && !val_is(chars, JSON_NULL))
        return tpl_fail(r, at, "%s arg must be None or str", name);
    int left = name[0] != 'r', right = name[0] != 'l';
    return ret_json(r, str_strip(s, val_is(chars, JSON_STRING) ? chars->j : NULL, left, right),
                    out);
}

static int m_split(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                   struct argv *a, struct val *out) {
    const struct val *sep = argv_get(a, 0, "sep"), *max = argv_get(a, 1, "maxsplit");
    if (sep && !val_is(sep, JSON_STRING) && !val_is(sep, JSON_NULL))
        return tpl_fail(r, at, "%s: sep must be None or str", name);
    if (val_is(sep, JSON_STRING) && json_string_length(sep->j) == 0)
        return tpl_fail(r, at, "%s: empty separator", name);
    int64_t k = max && val_is(max, JSON_INTEGER) ? json_integer_value(max->j) : -1;
    json_t *parts = str_split(s, val_is(sep, JSON_STRING) ? sep->j : NULL, k, name[0] == 'r');
    return ret_json(r, parts, out);
}

/* startswith / endswith, with a string or a tuple of strings. */
static int m_affix(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                   struct argv *a, struct val *out) {
    const struct val *x = argv_get(a, 0, "prefix");
    int end = name[0] == 'e', hit = 0;
    if (val_is(x, JSON_STRING)) {
        hit = affix(s, x->j, end);
    } else if (val_is(x, JSON_ARRAY)) {
        for (size_t i = 0; i < json_array_size(x->j) && !hit; i++) {
            json_t *item = json_array_get(x->j, i);
            hit = json_is_string(item) && affix(s, item, end);
        }
    } else {
        return tpl_fail(r, at, "%s first arg must be str or a tuple of str", name);
    }
    return ret_json(r, json_boolean(hit), out);
}

static int m_replace(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                     struct argv *a, struct val *out) {
    const struct val *old = argv_get(a, 0, "old"), *rep = argv_get(a, 1, "new");
    const struct val *count = argv_get(a, 2, "count");
    if (!val_is(old, JSON_STRING) || !val_is(rep, JSON_STRING))
        return tpl_fail(r, at, "%s needs two strings", name);
    int64_t k = count && val_is(count, JSON_INTEGER) ? json_integer_value(count->j) : -1;
    return ret_json(r, str_replace(s, old->j, rep->j, k), out);
}

static int m_case(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                  struct argv *a, struct val *out) {
    (void)at, (void)a;
    int mode = name[0] == 't' ? 't' : name[0] == 'c' ? 'c' : name[0] == 'u' ? 'u' : 'l';
    return ret_json(r, str_case(s, mode), out);
}

static int m_splitlines(struct render *r, const struct srcpos *at, const char *name,
                        const json_t *s, struct argv *a, struct val *out) {
    (void)at, (void)name, (void)a;
    return ret_json(r, str_splitlines(json_string_value(s), json_string_length(s)), out);
}

/* find (code point index of the first match, or -1) and count (matches that do not overlap). */
static int m_find(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                  struct argv *a, struct val *out) {
    const struct val *x = argv_get(a, 0, "sub");
    if (!val_is(x, JSON_STRING)) return tpl_fail(r, at, "%s needs a string", name);
    const char *p = json_string_value(s), *sub = json_string_value(x->j);
    size_t n = json_string_length(s), k = json_string_length(x->j);
    int64_t found = -1, count = 0;
    if (k == 0) found = 0, count = (int64_t)utf8_count(p, n) + 1; /* between every character */
    for (const char *hit = p; k && (hit = memmem(hit, n - (size_t)(hit - p), sub, k)); hit += k) {
        if (found < 0) found = (int64_t)utf8_count(p, (size_t)(hit - p));
        count++;
    }
    return ret_json(r, json_integer(name[0] == 'f' ? found : count), out);
}

static int m_join(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                  struct argv *a, struct val *out) {
    const struct val *x = argv_get(a, 0, "iterable");
    if (!val_is(x, JSON_ARRAY)) return tpl_fail(r, at, "%s needs a list of strings", name);
    struct sbuf b = {0};
    for (size_t i = 0; i < json_array_size(x->j); i++) {
        json_t *item = json_array_get(x->j, i);
        if (!json_is_string(item))
            return free(b.p), tpl_fail(r, at, "%s: item %zu is not a string", name, i);
        if (i) sb_put(&b, json_string_value(s), json_string_length(s));
        sb_put(&b, json_string_value(item), json_string_length(item));
    }
    return ret_json(r, str_from_sbuf(&b), out);
}

/* isdigit, isspace, isalpha, isalnum (non-empty, every character qualifies), islower, isupper
 * (some cased character, none of the other case); letters and digits are ASCII ones. */
static int m_is(struct render *r, const struct srcpos *at, const char *name, const json_t *s,
                struct argv *a, struct val *out) {
    (void)at, (void)a;
    const char *p = json_string_value(s);
    size_t n = json_string_length(s);
    int all = n > 0, lower = 0, upper = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c = utf8_decode(p, n, &i);
        int digit = c >= '0' && c <= '9', alpha = (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
        lower |= c >= 'a' && c <= 'z', upper |= c >= 'A' && c <= 'Z';
        if (strcmp(name, "isdigit") == 0) all &= digit;
        else if (strcmp(name, "isspace") == 0) all &= py_isspace(c);
        else if (strcmp(name, "isalpha") == 0) all &= alpha;
        else if (strcmp(name, "isalnum") == 0) all &= alpha || digit;
    }
    if (strcmp(name, "islower") == 0) all = lower && !upper;
    if (strcmp(name, "isupper") == 0) all = upper && !lower;
    return ret_json(r, json_boolean(all), out);
}

static const struct method {
    const char *name;
    method_fn *fn;
    const char *params[3];
} str_methods[] = {
    {"strip", m_strip, {"chars"}},
    {"lstrip", m_strip, {"chars"}},
    {"rstrip", m_strip, {"chars"}},
    {"split", m_split, {"sep", "maxsplit"}},
    {"rsplit", m_split, {"sep", "maxsplit"}},
    {"startswith", m_affix, {"prefix"}},
    {"endswith", m_affix, {"suffix"}},
    {"replace", m_replace, {"old", "new", "count"}},
    {"upper", m_case, {0}},
    {"lower", m_case, {0}},
    {"title", m_case, {0}},
    {"capitalize", m_case, {0}},
    {"splitlines", m_splitlines, {0}},
    {"find", m_find, {"sub"}},
    {"count", m_find, {"sub"}},
    {"join", m_join, {"iterable"}},
    {"isdigit", m_is, {0}},
    {"isspace", m_is, {0}},
    {"isalpha", m_is, {0}},
    {"isalnum", m_is, {0}},
    {"islower", m_is, {0}},
    {"isupper", m_is, {0}},
};

static int str_method(struct render *r, const struct srcpos *at, const json_t *s, const char *name,
                      struct argv *a, struct val *out) {
    for (size_t i = 0; i < sizeof str_methods / sizeof str_methods[0]; i++) {
        const struct method *m = &str_methods[i];
        if (strcmp(m->name, name) != 0) continue;
        int n = 0;
        while (n < 3 && m->params[n]) n++;
        if (argv_check(r, at, name, a, m->params, n)) return -1;
        return m->fn(r, at, name, s, a, out);
    }
    return tpl_fail(r, at, "'str' object has no method '%s'", name);
}

static int dict_method(struct render *r, const struct srcpos *at, json_t *d, const char *name,
                       struct argv *a, struct val *out) {
    static const char *const p_get[] = {"key", "default"};
    if (strcmp(name, "get") == 0) {
        if (argv_check(r, at, name, a, p_get, 2)) return -1;
        const struct val *key = argv_get(a, 0, "key"), *dflt = argv_get(a, 1, "default");
        json_t *j =
            key && val_is(key, JSON_STRING) ? json_object_get(d, json_string_value(key->j)) : NULL;
        if (j) return ret_json(r, json_incref(j), out);
        if (dflt) return *out = val_dup(dflt), 0;
        return ret_json(r, json_null(), out);
    }
    int which = strcmp(name, "keys") == 0     ? 0
                : strcmp(name, "values") == 0 ? 1
                : strcmp(name, "items") == 0  ? 2
                                              : -1;
    if (which < 0) return tpl_fail(r, at, "'dict' object has no method '%s'", name);
    if (argv_check(r, at, name, a, NULL, 0)) return -1;
    return ret_json(r, dict_list(d, which), out);
}

int tpl_method(struct render *r, const struct srcpos *at, const struct val *obj,
               const char *name, struct argv *args, struct val *out) {
    *out = val_undef(NULL);
    if (val_is(obj, JSON_STRING)) return str_method(r, at, obj->j, name, args, out);
    if (val_is(obj, JSON_OBJECT)) return dict_method(r, at, obj->j, name, args, out);
    return tpl_fail(r, at, "'%s' object has no method '%s'", val_type_name(obj), name);
}

/* --- globals ---------------------------------------------------------------------------- */

static const char *const global_names[] = {
    [FN_RANGE] = "range", [FN_NAMESPACE] = "namespace", [FN_DICT] = "dict",
    [FN_RAISE] = "raise_exception", [FN_STRFTIME_NOW] = "strftime_now",
};

int tpl_global_find(const char *name, enum tpl_fn *fn) {
    for (size_t i = 0; i < sizeof global_names / sizeof global_names[0]; i++)
        if (strcmp(global_names[i], name) == 0) return *fn = (enum tpl_fn)i, 1;
    return 0;
}

static int range(struct render *r, const struct srcpos *at, struct argv *a, struct val *out) {
    int64_t v[3] = {0, 0, 1};
    if (a->n_kw || a->n_pos < 1 || a->n_pos > 3)
        return tpl_fail(r, at, "range takes 1 to 3 integers");
    for (int i = 0; i < a->n_pos; i++) {
        if (!val_is(&a->pos[i], JSON_INTEGER)) return tpl_fail(r, at, "range takes integers");
        v[a->n_pos == 1 ? 1 : i] = json_integer_value(a->pos[i].j);
    }
    if (v[2] == 0) return tpl_fail(r, at, "range() arg 3 must not be zero");
    double count = v[2] > 0 ? ((double)v[1] - (double)v[0]) / (double)v[2]
                            : ((double)v[0] - (double)v[1]) / -(double)v[2];
    if (count > TPL_MAX_RANGE)
        return tpl_fail(r, at, "range too big, at most %d items", TPL_MAX_RANGE);
    json_t *list = json_array();
    for (int64_t i = v[0]; list && (v[2] > 0 ? i < v[1] : i > v[1]); i += v[2])
        if (json_array_append_new(list, json_integer(i))) json_decref(list), list = NULL;
    return ret_json(r, list, out);
}

/* namespace(mapping?, **attrs) and dict(mapping?, **items). */
static int make_mapping(struct render *r, const struct srcpos *at, int is_ns, struct argv *a,
                        struct val *out) {
    const char *fname = is_ns ? "namespace" : "dict";
    if (a->n_pos > 1 || (a->n_pos == 1 && !val_is(&a->pos[0], JSON_OBJECT)))
        return tpl_fail(r, at, "%s takes one mapping and keyword arguments", fname);
    struct ns *ns = is_ns ? ns_new(r) : NULL;
    json_t *d = is_ns ? NULL : json_object();
    if (is_ns ? !ns : !d) return is_ns ? -1 : tpl_oom(r);
    int rc = 0;
    if (a->n_pos == 1) {
        const char *k;
        json_t *v;
        json_object_foreach(a->pos[0].j, k, v) {
            if (rc == 0 && is_ns) rc = ns_set(r, ns, k, val_json(json_incref(v)));
            else if (rc == 0 && json_object_set(d, k, v)) rc = tpl_oom(r);
        }
    }
    for (int i = 0; i < a->n_kw && rc == 0; i++) {
        if (is_ns) {
            rc = ns_set(r, ns, a->kw_names[i], val_dup(&a->kw[i]));
        } else {
            json_t *j = val_to_json(&a->kw[i]);
            if (!j) rc = tpl_fail(r, at, "dict: a %s cannot be stored", val_type_name(&a->kw[i]));
            else if (json_object_set_new(d, a->kw_names[i], j)) rc = tpl_oom(r);
        }
    }
    if (rc) return json_decref(d), -1;
    *out = is_ns ? (struct val){.kind = V_NS, .ns = ns} : val_json(d);
    return 0;
}

static int strftime_now(struct render *r, const struct srcpos *at, struct argv *a,
                        struct val *out) {
    static const char *const p_fmt[] = {"format"};
    const struct val *fmt = argv_get(a, 0, "format");
    if (argv_check(r, at, "strftime_now", a, p_fmt, 1)) return -1;
    if (!fmt || !val_is(fmt, JSON_STRING))
        return tpl_fail(r, at, "strftime_now needs a format string");
    /* strftime cannot tell an empty result from a short buffer: a marker character tells */
    size_t n = json_string_length(fmt->j);
    char *f = malloc(n + 2);
    if (!f) return tpl_oom(r);
    memcpy(f, json_string_value(fmt->j), n);
    f[n] = 'x', f[n + 1] = 0;
    for (size_t cap = 64; cap <= 65536; cap *= 4) {
        char *buf = malloc(cap);
        size_t k = buf ? strftime(buf, cap, f, &r->now) : 0;
        if (k > 0) {
            free(f);
            json_t *s = str_new(buf, k - 1);
            free(buf);
            return ret_json(r, s, out);
        }
        free(buf);
    }
    free(f);
    return tpl_fail(r, at, "strftime_now: result too long");
}

int tpl_global(struct render *r, const struct srcpos *at, enum tpl_fn fn, struct argv *args,
               struct val *out) {
    *out = val_undef(NULL);
    switch (fn) {
    case FN_RANGE: return range(r, at, args, out);
    case FN_NAMESPACE: return make_mapping(r, at, 1, args, out);
    case FN_DICT: return make_mapping(r, at, 0, args, out);
    case FN_STRFTIME_NOW: return strftime_now(r, at, args, out);
    case FN_RAISE: {
        struct sbuf b = {0};
        const struct val *msg = argv_get(args, 0, "message");
        if (msg) val_str(&b, msg);
        tpl_fail(r, at, "%s", b.p ? b.p : "raise_exception()");
        free(b.p);
        return -1;
    }
    }
    return tpl_fail(r, at, "unknown function");
}
