/* template-test.c: Jinja's tests, `x is name`, `x is not name(arg)` or `x is name arg`, as
 * jinja2 3.1 defines them (undefined counts as iterable; a bool is a number but not an
 * integer). */
#include <string.h>

#include "template-impl.h"

enum test {
    IS_DEFINED,
    IS_UNDEFINED,
    IS_NONE,
    IS_BOOLEAN,
    IS_TRUE,
    IS_FALSE,
    IS_INTEGER,
    IS_FLOAT,
    IS_NUMBER,
    IS_STRING,
    IS_MAPPING,
    IS_ITERABLE,
    IS_CALLABLE,
    IS_LOWER,
    IS_UPPER,
    IS_ESCAPED,
    IS_ODD,
    IS_EVEN,
    IS_DIVISIBLEBY,
    IS_SAMEAS,
    IS_EQ,
    IS_NE,
    IS_LT,
    IS_LE,
    IS_GT,
    IS_GE,
    IS_IN,
};

static const struct {
    const char *name;
    enum test test;
} tests[] = {
    {"defined", IS_DEFINED},   {"undefined", IS_UNDEFINED}, {"none", IS_NONE},
    {"boolean", IS_BOOLEAN},   {"true", IS_TRUE},           {"false", IS_FALSE},
    {"integer", IS_INTEGER},   {"float", IS_FLOAT},         {"number", IS_NUMBER},
    {"string", IS_STRING},     {"mapping", IS_MAPPING},     {"iterable", IS_ITERABLE},
    {"sequence", IS_ITERABLE}, {"callable", IS_CALLABLE},   {"lower", IS_LOWER},
    {"upper", IS_UPPER},       {"escaped", IS_ESCAPED},     {"odd", IS_ODD},
    {"even", IS_EVEN},         {"divisibleby", IS_DIVISIBLEBY}, {"sameas", IS_SAMEAS},
    {"equalto", IS_EQ},        {"eq", IS_EQ},               {"==", IS_EQ},
    {"ne", IS_NE},             {"!=", IS_NE},               {"lt", IS_LT},
    {"lessthan", IS_LT},       {"<", IS_LT},                {"le", IS_LE},
    {"<=", IS_LE},             {"gt", IS_GT},               {"greaterthan", IS_GT},
    {">", IS_GT},              {"ge", IS_GE},               {">=", IS_GE},
    {"in", IS_IN},
};

/* str.islower() / str.isupper() over ASCII letters: some cased character, none of the other
 * case. */
static int has_case(const struct val *a, int upper) {
    if (!val_is(a, JSON_STRING)) return 0;
    const char *s = json_string_value(a->j);
    int cased = 0;
    for (size_t i = 0; i < json_string_length(a->j); i++) {
        int lo = s[i] >= 'a' && s[i] <= 'z', up = s[i] >= 'A' && s[i] <= 'Z';
        if ((lo && upper) || (up && !upper)) return 0;
        cased |= lo | up;
    }
    return cased;
}

static int in(const struct val *a, const struct val *hay) {
    if (val_is(hay, JSON_STRING) && val_is(a, JSON_STRING))
        return memmem(json_string_value(hay->j), json_string_length(hay->j),
                      json_string_value(a->j), json_string_length(a->j)) != NULL;
    if (val_is(hay, JSON_ARRAY) && a->kind == V_JSON) {
        for (size_t i = 0; i < json_array_size(hay->j); i++)
            if (json_eq(json_array_get(hay->j, i), a->j)) return 1;
    }
    if (val_is(hay, JSON_OBJECT))
        return val_is(a, JSON_STRING) && json_object_get(hay->j, json_string_value(a->j));
    return 0;
}

int tpl_test(struct render *r, const struct srcpos *at, const char *name, const struct val *a,
             struct argv *args, int *result) {
    static const char *const param[] = {"other"};
    size_t i = 0;
    while (i < sizeof tests / sizeof tests[0] && strcmp(tests[i].name, name) != 0) i++;
    if (i == sizeof tests / sizeof tests[0]) return tpl_fail(r, at, "no test named '%s'", name);
    enum test t = tests[i].test;
    int arity = t >= IS_DIVISIBLEBY;
    if (argv_check(r, at, name, args, param, arity)) return -1;
    const struct val *other = argv_get(args, 0, "other");
    if (arity && !other) return tpl_fail(r, at, "test '%s' needs an argument", name);
    int k = a->kind == V_JSON ? (int)json_typeof(a->j) : -1, less;
    switch (t) {
    case IS_DEFINED: *result = a->kind != V_UNDEF; break;
    case IS_UNDEFINED: *result = a->kind == V_UNDEF; break;
    case IS_NONE: *result = k == JSON_NULL; break;
    case IS_BOOLEAN: *result = k == JSON_TRUE || k == JSON_FALSE; break;
    case IS_TRUE: *result = k == JSON_TRUE; break;
    case IS_FALSE: *result = k == JSON_FALSE; break;
    case IS_INTEGER: *result = k == JSON_INTEGER; break;
    case IS_FLOAT: *result = k == JSON_REAL; break;
    case IS_NUMBER: *result = val_is_number(a); break;
    case IS_STRING: *result = k == JSON_STRING; break;
    case IS_MAPPING: *result = k == JSON_OBJECT; break;
    case IS_ITERABLE:
        *result = a->kind == V_UNDEF || k == JSON_STRING || k == JSON_ARRAY || k == JSON_OBJECT;
        break;
    case IS_CALLABLE: *result = a->kind == V_MACRO || a->kind == V_FUNC; break;
    case IS_LOWER: case IS_UPPER: *result = has_case(a, t == IS_UPPER); break;
    case IS_ESCAPED: *result = 0; break;
    case IS_ODD: case IS_EVEN: case IS_DIVISIBLEBY: {
        int64_t d = t == IS_DIVISIBLEBY
                        ? (val_is(other, JSON_INTEGER) ? json_integer_value(other->j) : 0)
                        : 2;
        if (k != JSON_INTEGER || d == 0) return tpl_fail(r, at, "test '%s' needs integers", name);
        *result = (json_integer_value(a->j) % d != 0) == (t == IS_ODD);
        break;
    }
    case IS_SAMEAS: /* identity: the singletons None, True, False, or the very same value */
        *result = a->kind == V_JSON && other->kind == V_JSON &&
                  (a->j == other->j || (json_typeof(a->j) == json_typeof(other->j) &&
                                        (k == JSON_NULL || k == JSON_TRUE || k == JSON_FALSE)));
        break;
    case IS_EQ: *result = val_eq(a, other); break;
    case IS_NE: *result = !val_eq(a, other); break;
    case IS_IN: *result = in(a, other); break;
    case IS_LT: case IS_LE: case IS_GT: case IS_GE: {
        int swap = t == IS_GT || t == IS_LE, negate = t == IS_LE || t == IS_GE;
        if (val_less(swap ? other : a, swap ? a : other, &less))
            return tpl_fail(r, at, "test '%s': %s and %s cannot be compared", name,
                            val_type_name(a), val_type_name(other));
        *result = less != negate;
        break;
    }
    }
    return 0;
}
