/* template-ops.c: the operators: attribute and item access, slicing, arithmetic, comparison
 * and membership, with Python's semantics (integer floor division and modulo, exact int/float
 * comparison, code point indexing of strings, sequence repetition). Bools count as the
 * integers 0 and 1. An undefined operand is an error except for ., [] and `in`. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"

/* --- access ----------------------------------------------------------------------------- */

void tpl_getattr(const struct val *obj, const char *name, struct val *out) {
    *out = val_undef(NULL); /* no name: name may not outlive the lookup (a key, a buffer) */
    if (obj->kind == V_NS) {
        for (int i = 0; i < obj->ns->n; i++)
            if (strcmp(obj->ns->vars[i].name, name) == 0) *out = val_dup(&obj->ns->vars[i].v);
    } else if (val_is(obj, JSON_OBJECT)) {
        json_t *j = json_object_get(obj->j, name);
        if (j) *out = val_json(json_incref(j));
    }
}

int tpl_getitem(struct render *r, const struct val *obj, const struct val *key, struct val *out) {
    *out = val_undef(NULL);
    if (val_is(key, JSON_STRING)) return tpl_getattr(obj, json_string_value(key->j), out), 0;
    if (!val_is(key, JSON_INTEGER) && !val_is(key, JSON_TRUE) && !val_is(key, JSON_FALSE)) return 0;
    int64_t i = val_is(key, JSON_INTEGER) ? json_integer_value(key->j) : val_is(key, JSON_TRUE);
    if (val_is(obj, JSON_ARRAY)) {
        int64_t n = (int64_t)json_array_size(obj->j);
        if (i < 0) i += n;
        if (i >= 0 && i < n) *out = val_json(json_incref(json_array_get(obj->j, (size_t)i)));
    } else if (val_is(obj, JSON_STRING)) {
        const char *s = json_string_value(obj->j);
        size_t nb = json_string_length(obj->j);
        int64_t n = (int64_t)utf8_count(s, nb);
        if (i < 0) i += n;
        if (i >= 0 && i < n) {
            size_t at = utf8_advance(s, nb, 0, (size_t)i), end = utf8_advance(s, nb, at, 1);
            if (!(out->j = str_new(s + at, end - at))) return tpl_oom(r);
            out->kind = V_JSON;
        }
    }
    return 0;
}

/* Python's slice.indices() and length: bounds default to the ends the step walks from and
 * to, count from the end when negative, and are clamped. */
static int slice_bounds(struct render *r, const struct srcpos *at, int64_t len,
                        const struct val *bound[3], int64_t *start, int64_t *step, int64_t *count) {
    int64_t v[3];
    int given[3];
    for (int k = 0; k < 3; k++) {
        given[k] = bound[k]->kind != V_UNDEF && !val_is(bound[k], JSON_NULL);
        if (given[k] && !val_is(bound[k], JSON_INTEGER))
            return tpl_fail(r, at, "slice indices must be integers or None");
        v[k] = given[k] ? json_integer_value(bound[k]->j) : 0;
    }
    int64_t st = given[2] ? v[2] : 1;
    if (st == 0) return tpl_fail(r, at, "slice step cannot be zero");
    if (st == INT64_MIN) st = -INT64_MAX;
    int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? len - 1 : len;
    int64_t b[2] = {st < 0 ? hi : lo, st < 0 ? lo : hi};
    for (int k = 0; k < 2; k++) {
        if (!given[k]) continue;
        b[k] = v[k] < 0 ? v[k] + len : v[k];
        b[k] = b[k] < lo ? lo : b[k] > hi ? hi : b[k];
    }
    *start = b[0], *step = st;
    if (st > 0) *count = b[1] > b[0] ? (b[1] - b[0] - 1) / st + 1 : 0;
    else *count = b[1] < b[0] ? (b[0] - b[1] - 1) / -st + 1 : 0;
    return 0;
}

int tpl_slice(struct render *r, const struct srcpos *at, const struct val *obj,
              const struct val *bound[3], struct val *out) {
    int is_str = val_is(obj, JSON_STRING);
    if (!is_str && !val_is(obj, JSON_ARRAY))
        return tpl_fail(r, at, "'%s' object is not subscriptable", val_type_name(obj));
    const char *s = is_str ? json_string_value(obj->j) : NULL;
    size_t nb = is_str ? json_string_length(obj->j) : 0;
    size_t *offs = NULL; /* [len + 1] byte offset of each code point */
    int64_t len = is_str ? (int64_t)utf8_count(s, nb) : (int64_t)json_array_size(obj->j);
    int64_t start = 0, step = 1, count = 0;
    if (slice_bounds(r, at, len, bound, &start, &step, &count)) return -1;
    if (is_str) {
        if (!(offs = malloc(((size_t)len + 1) * sizeof *offs))) return tpl_oom(r);
        for (size_t i = 0, at = 0; i <= (size_t)len; i++, at = utf8_advance(s, nb, at, 1))
            offs[i] = at;
        struct sbuf b = {0};
        for (int64_t k = 0, i = start; k < count; k++, i += step)
            sb_put(&b, s + offs[i], offs[i + 1] - offs[i]);
        free(offs);
        *out = val_json(str_from_sbuf(&b));
    } else {
        json_t *list = json_array();
        for (int64_t k = 0, i = start; list && k < count; k++, i += step)
            if (json_array_append(list, json_array_get(obj->j, (size_t)i)))
                json_decref(list), list = NULL;
        *out = val_json(list);
    }
    return out->j ? 0 : tpl_oom(r);
}

/* --- arithmetic and comparison ---------------------------------------------------------- */

static int is_int(const struct val *v) {
    return val_is(v, JSON_INTEGER) || val_is(v, JSON_TRUE) || val_is(v, JSON_FALSE);
}

static int64_t int_of(const struct val *v) {
    return val_is(v, JSON_INTEGER) ? (int64_t)json_integer_value(v->j) : val_is(v, JSON_TRUE);
}

int tpl_unary(struct render *r, const struct srcpos *at, int negate, const struct val *a,
              struct val *out) {
    if (a->kind == V_UNDEF) return tpl_undefined(r, at, a);
    if (!val_is_number(a))
        return tpl_fail(r, at, "bad operand type for unary %c: '%s'", negate ? '-' : '+',
                        val_type_name(a));
    if (is_int(a) && negate && int_of(a) == INT64_MIN) return tpl_fail(r, at, "integer overflow");
    if (is_int(a)) *out = val_json(json_integer(negate ? -int_of(a) : int_of(a)));
    else *out = val_json(json_real(negate ? -val_number(a) : val_number(a)));
    return out->j ? 0 : tpl_oom(r);
}

/* s * k or list * k. */
static int repeat(struct render *r, const struct srcpos *at, const struct val *seq, int64_t k,
                  struct val *out) {
    int is_str = val_is(seq, JSON_STRING);
    if (k <= 0 || (is_str ? json_string_length(seq->j) : json_array_size(seq->j)) == 0)
        k = 0; /* nothing to repeat */
    if (is_str) {
        size_t n = json_string_length(seq->j);
        if (k > 0 && n > 0 && (uint64_t)k > TPL_MAX_STRING / n)
            return tpl_fail(r, at, "string too long");
        struct sbuf b = {0};
        for (int64_t i = 0; i < k; i++) sb_put(&b, json_string_value(seq->j), n);
        *out = val_json(str_from_sbuf(&b));
    } else {
        size_t n = json_array_size(seq->j);
        if (k > 0 && n > 0 && (uint64_t)k > TPL_MAX_RANGE / n)
            return tpl_fail(r, at, "list too long");
        json_t *list = json_array();
        for (int64_t i = 0; list && i < k; i++)
            if (json_array_extend(list, seq->j)) json_decref(list), list = NULL;
        *out = val_json(list);
    }
    return out->j ? 0 : tpl_oom(r);
}

/* Python's float // and %: the remainder takes the divisor's sign, the quotient is floored
 * and then corrected so that the two stay consistent. */
static double float_divmod(double x, double y, int want_mod) {
    double mod = fmod(x, y), div = (x - mod) / y;
    if (mod != 0) {
        if ((y < 0) != (mod < 0)) mod += y, div -= 1;
    } else {
        mod = copysign(0, y);
    }
    if (want_mod) return mod;
    if (div == 0) return copysign(0, x / y);
    double q = floor(div);
    return div - q > 0.5 ? q + 1 : q;
}

int tpl_arith(struct render *r, const struct srcpos *at, enum tpl_op op, const struct val *a,
              const struct val *b, struct val *out) {
    static const char *const sym[] = {
        [OP_ADD] = "+",       [OP_SUB] = "-", [OP_MUL] = "*", [OP_DIV] = "/",
        [OP_FLOORDIV] = "//", [OP_MOD] = "%", [OP_POW] = "**"};
    if (a->kind == V_UNDEF) return tpl_undefined(r, at, a);
    if (b->kind == V_UNDEF) return tpl_undefined(r, at, b);
    if (val_is_number(a) && val_is_number(b)) {
        if (is_int(a) && is_int(b) && op != OP_DIV && !(op == OP_POW && int_of(b) < 0)) {
            int64_t x = int_of(a), y = int_of(b), z = 0;
            int overflow = 0;
            switch (op) {
            case OP_ADD: overflow = __builtin_add_overflow(x, y, &z); break;
            case OP_SUB: overflow = __builtin_sub_overflow(x, y, &z); break;
            case OP_MUL: overflow = __builtin_mul_overflow(x, y, &z); break;
            case OP_FLOORDIV: case OP_MOD: {
                if (y == 0) return tpl_fail(r, at, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1) {
                    overflow = 1;
                    break;
                }
                int64_t q = x / y, m = x % y;
                if (m != 0 && (m < 0) != (y < 0)) q--, m += y; /* Python floors */
                z = op == OP_FLOORDIV ? q : m;
                break;
            }
            default: /* OP_POW with y >= 0, by squaring */
                z = 1;
                for (int64_t k = y, base = x; k > 0 && !overflow; k >>= 1) {
                    if (k & 1) overflow |= __builtin_mul_overflow(z, base, &z);
                    if (k > 1) overflow |= __builtin_mul_overflow(base, base, &base);
                }
            }
            if (overflow) return tpl_fail(r, at, "integer overflow");
            *out = val_json(json_integer(z));
        } else {
            double x = val_number(a), y = val_number(b), z;
            if (y == 0 && (op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD))
                return tpl_fail(r, at, "division by zero");
            switch (op) {
            case OP_ADD: z = x + y; break;
            case OP_SUB: z = x - y; break;
            case OP_MUL: z = x * y; break;
            case OP_DIV: z = x / y; break;
            case OP_FLOORDIV: case OP_MOD: z = float_divmod(x, y, op == OP_MOD); break;
            default: z = pow(x, y);
            }
            if (!isfinite(z)) return tpl_fail(r, at, "float result out of range");
            *out = val_json(json_real(z));
        }
        return out->j ? 0 : tpl_oom(r);
    }
    if (op == OP_ADD && ((val_is(a, JSON_STRING) && val_is(b, JSON_STRING)) ||
                         (val_is(a, JSON_ARRAY) && val_is(b, JSON_ARRAY)))) {
        if (val_is(a, JSON_ARRAY)) {
            json_t *list = json_copy(a->j);
            if (list && json_array_extend(list, b->j)) json_decref(list), list = NULL;
            *out = val_json(list);
        } else {
            struct sbuf s = {0};
            sb_put(&s, json_string_value(a->j), json_string_length(a->j));
            sb_put(&s, json_string_value(b->j), json_string_length(b->j));
            *out = val_json(str_from_sbuf(&s));
        }
        return out->j ? 0 : tpl_oom(r);
    }
    if (op == OP_MUL && (val_is(a, JSON_STRING) || val_is(a, JSON_ARRAY)) && is_int(b))
        return repeat(r, at, a, int_of(b), out);
    if (op == OP_MUL && (val_is(b, JSON_STRING) || val_is(b, JSON_ARRAY)) && is_int(a))
        return repeat(r, at, b, int_of(a), out);
    if (op == OP_MOD && val_is(a, JSON_STRING))
        return tpl_fail(r, at, "string formatting with %% is not supported");
    return tpl_fail(r, at, "unsupported operand type(s) for %s: '%s' and '%s'", sym[op],
                    val_type_name(a), val_type_name(b));
}

static int contains(struct render *r, const struct srcpos *at, const struct val *hay,
                    const struct val *needle, int *result) {
    *result = 0;
    if (hay->kind == V_UNDEF) return 0;
    if (val_is(hay, JSON_STRING)) {
        if (!val_is(needle, JSON_STRING))
            return tpl_fail(r, at, "'in <string>' requires string as left operand, not %s",
                            val_type_name(needle));
        size_t n = json_string_length(needle->j);
        *result = n == 0 || memmem(json_string_value(hay->j), json_string_length(hay->j),
                                   json_string_value(needle->j), n) != NULL;
        return 0;
    }
    if (val_is(hay, JSON_ARRAY)) {
        if (needle->kind != V_JSON) return 0;
        for (size_t i = 0; i < json_array_size(hay->j) && !*result; i++)
            *result = json_eq(json_array_get(hay->j, i), needle->j);
        return 0;
    }
    if (val_is(hay, JSON_OBJECT)) {
        *result =
            val_is(needle, JSON_STRING) && json_object_get(hay->j, json_string_value(needle->j));
        return 0;
    }
    return tpl_fail(r, at, "argument of type '%s' is not iterable", val_type_name(hay));
}

int tpl_compare(struct render *r, const struct srcpos *at, enum tpl_op op, const struct val *a,
                const struct val *b, int *result) {
    static const char *const sym[] = {[OP_LT] = "<", [OP_LE] = "<=", [OP_GT] = ">", [OP_GE] = ">="};
    int less;
    switch (op) {
    case OP_EQ: *result = val_eq(a, b); return 0;
    case OP_NE: *result = !val_eq(a, b); return 0;
    case OP_IN: return contains(r, at, b, a, result);
    case OP_NOTIN: if (contains(r, at, b, a, result)) return -1; *result = !*result; return 0;
    default: break;
    }
    const struct val *x = op == OP_GT || op == OP_LE ? b : a, *y = x == a ? b : a;
    if (val_less(x, y, &less))
        return tpl_fail(r, at, "'%s' not supported between instances of '%s' and '%s'", sym[op],
                        val_type_name(a), val_type_name(b));
    *result = op == OP_LT || op == OP_GT ? less : !less; /* a <= b is not (b < a) */
    return 0;
}
