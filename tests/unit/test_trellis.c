/* test_trellis.c: the TrellisMX codec core (plugins/trellis) against the spec's test vectors.
 *
 * tests/fixtures/trellismx/ holds vectors that tools/trellis/make_vectors.py computes from
 * docs/trellismx.md in numpy and exact fractions, independently of this library: rounding,
 * decode-law tables, tile states and operand bytes, Hadamard bits, activation formats, CSF
 * streams and two whole matrices. The rest are properties: round trips of every table and of
 * the bitstream, the Viterbi search recovering a decodable target exactly, CSF lossless on
 * random and adversarial planes, and every corruption CSF promises to reject. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "tmx/tensor.h"
#include "trellis.h"

#define FIXTURES TMX_SOURCE_DIR "/tests/fixtures/trellismx/"

static json_t *fixture(const char *name) {
    json_error_t je;
    json_t *j = json_load_file(name, 0, &je);
    if (!j) fail_msg("%s: %s (line %d); regenerate with tools/trellis/make_vectors.py", name,
                     je.text, je.line);
    return j;
}

static int hex_digit(char c) {
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

/* Bytes of a hex string into out; returns the count. */
static size_t hex_bytes(const char *hex, uint8_t *out) {
    size_t n = strlen(hex) / 2;
    for (size_t i = 0; i < n; i++)
        out[i] = (uint8_t)(hex_digit(hex[2 * i]) << 4 | hex_digit(hex[2 * i + 1]));
    return n;
}

static uint32_t hex_u32(const char *hex) { return (uint32_t)strtoul(hex, NULL, 16); }

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* [n] f32 from a JSON array of hex bit patterns. */
static float *f32_array(const json_t *a, size_t *n) {
    *n = json_array_size(a);
    float *x = malloc(*n * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < *n; i++)
        x[i] = bits_f32(hex_u32(json_string_value(json_array_get(a, i))));
    return x;
}

static uint64_t rng_state = 0x5eed;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 32);
}

/* --- number formats ------------------------------------------------------------------------ */

static void test_rounding_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "numbers.json");
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(j, "e4m3_round"), i, c) {
        const float x = bits_f32(hex_u32(json_string_value(json_array_get(c, 0))));
        const int want = (int)json_integer_value(json_array_get(c, 1));
        if (tmx_trellis_e4m3_round(x) != want)
            fail_msg("e4m3(%a) = 0x%02x, want 0x%02x", (double)x, tmx_trellis_e4m3_round(x), want);
    }
    json_array_foreach(json_object_get(j, "e2m1_round"), i, c) {
        const float x = bits_f32(hex_u32(json_string_value(json_array_get(c, 0))));
        const int want = (int)json_integer_value(json_array_get(c, 1));
        if (tmx_trellis_e2m1_round(x) != want)
            fail_msg("e2m1(%a) = 0x%x, want 0x%x", (double)x, tmx_trellis_e2m1_round(x), want);
    }
    json_array_foreach(json_object_get(j, "e4m3_values"), i, c) {
        if (json_is_null(c))
            assert_true(isnan(tmx_e4m3_to_f32((uint8_t)i)));
        else
            assert_true(tmx_e4m3_to_f32((uint8_t)i) == (float)json_real_value(c));
    }
    json_array_foreach(json_object_get(j, "e2m1_values"), i, c)
        assert_true(tmx_trellis_e2m1_to_f32((uint8_t)i) == (float)json_real_value(c));
    json_decref(j);
}

static void test_tables_round_trip(void **state) {
    (void)state;
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f) continue; /* NaN */
        assert_int_equal(tmx_trellis_e4m3_round(tmx_e4m3_to_f32((uint8_t)b)), b);
    }
    assert_int_equal(tmx_trellis_e4m3_round(tmx_e4m3_to_f32(0x7f)), 0x7f);
    for (int n = 0; n < 16; n++)
        assert_int_equal(tmx_trellis_e2m1_round(tmx_trellis_e2m1_to_f32((uint8_t)n)), n);
}

/* --- decode laws --------------------------------------------------------------------------- */

static void test_law_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "laws.json");
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(j, "sigma"), i, c)
        assert_int_equal(tmx_trellis_sigma((uint16_t)json_integer_value(json_array_get(c, 0))),
                         json_integer_value(json_array_get(c, 1)));
    json_array_foreach(json_object_get(j, "v"), i, c)
        assert_true(tmx_trellis_v((int)json_integer_value(json_array_get(c, 0))) ==
                    (float)json_real_value(json_array_get(c, 1)));

    struct tmx_trellis_law law;
    uint8_t want[TMX_TRELLIS_SIGMAS];
    char *err = NULL;
    assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_E4M3, 0.0f, &err), TMX_OK);
    assert_int_equal(hex_bytes(json_string_value(json_object_get(j, "lut_e4m3")), want),
                     TMX_TRELLIS_SIGMAS);
    assert_memory_equal(law.code, want, TMX_TRELLIS_SIGMAS);
    for (int s = 0; s < TMX_TRELLIS_SIGMAS; s++)
        assert_true(law.value[s] == tmx_e4m3_to_f32(law.code[s]));

    const float alpha = (float)json_real_value(json_object_get(j, "alpha"));
    assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_E2M1, alpha, &err), TMX_OK);
    const char *hex = json_string_value(json_object_get(j, "lut_e2m1"));
    assert_int_equal(strlen(hex), TMX_TRELLIS_SIGMAS);
    for (int s = 0; s < TMX_TRELLIS_SIGMAS; s++) {
        assert_int_equal(law.code[s], hex_digit(hex[s]));
        assert_true(law.value[s] == tmx_trellis_e2m1_to_f32(law.code[s]));
    }
    json_decref(j);
}

static void test_law_init_rejects(void **state) {
    (void)state;
    struct tmx_trellis_law law;
    const float bad[] = {0.0f, -0.5f, NAN, INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *err = NULL;
        assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_E2M1, bad[i], &err),
                         TMX_ERR_INVALID);
        assert_non_null(strstr(err, "alpha"));
        free(err);
    }
    char *err = NULL;
    assert_int_equal(tmx_trellis_law_init(&law, (enum tmx_trellis_law_id)7, 1.0f, &err),
                     TMX_ERR_INVALID);
    free(err);
    assert_int_equal(tmx_trellis_law_from_name("e2m1"), TMX_TRELLIS_LAW_E2M1);
    assert_int_equal(tmx_trellis_law_from_name("fp4"), -1);
}

/* --- tiles --------------------------------------------------------------------------------- */

static void test_positions(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "tiles.json");
    int seen[TMX_TRELLIS_TILE] = {0};
    size_t t;
    json_t *c;
    json_array_foreach(json_object_get(j, "positions"), t, c) {
        assert_int_equal(tmx_trellis_pos((int)t), json_integer_value(c));
        seen[tmx_trellis_pos((int)t)]++;
    }
    for (int i = 0; i < TMX_TRELLIS_TILE; i++) assert_int_equal(seen[i], 1);
    json_decref(j);
}

static void test_tile_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "tiles.json");
    struct tmx_trellis_law e4m3, e2m1;
    json_t *laws = fixture(FIXTURES "laws.json");
    const float alpha = (float)json_real_value(json_object_get(laws, "alpha"));
    json_decref(laws);
    assert_int_equal(tmx_trellis_law_init(&e4m3, TMX_TRELLIS_LAW_E4M3, 1.0f, NULL), TMX_OK);
    assert_int_equal(tmx_trellis_law_init(&e2m1, TMX_TRELLIS_LAW_E2M1, alpha, NULL), TMX_OK);
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(j, "tiles"), i, v) {
        const char *name = json_string_value(json_object_get(v, "name"));
        const int K = (int)json_integer_value(json_object_get(v, "K"));
        uint32_t words[8 * TMX_TRELLIS_K_MAX], packed[8 * TMX_TRELLIS_K_MAX];
        uint8_t syms[TMX_TRELLIS_TILE], codes[TMX_TRELLIS_TILE], want[TMX_TRELLIS_TILE];
        uint16_t states[TMX_TRELLIS_TILE];
        float values[TMX_TRELLIS_TILE];
        const json_t *w = json_object_get(v, "words");
        assert_int_equal(json_array_size(w), tmx_trellis_words(K));
        for (int k = 0; k < tmx_trellis_words(K); k++)
            words[k] = hex_u32(json_string_value(json_array_get(w, (size_t)k)));

        tmx_trellis_unpack(words, K, syms);
        tmx_trellis_states(words, K, states);
        for (int t = 0; t < TMX_TRELLIS_TILE; t++) {
            const json_t *sym = json_array_get(json_object_get(v, "symbols"), (size_t)t);
            const json_t *st = json_array_get(json_object_get(v, "states"), (size_t)t);
            if (syms[t] != json_integer_value(sym) || states[t] != json_integer_value(st) ||
                tmx_trellis_state(words, K, t) != json_integer_value(st))
                fail_msg("%s: position %d: symbol %u state %u/%u, want %lld %lld", name, t,
                         syms[t], states[t], tmx_trellis_state(words, K, t),
                         json_integer_value(sym), json_integer_value(st));
        }
        tmx_trellis_pack(syms, K, packed);
        assert_memory_equal(packed, words, sizeof(uint32_t) * (size_t)tmx_trellis_words(K));

        tmx_trellis_decode_codes(&e4m3, words, K, codes);
        hex_bytes(json_string_value(json_object_get(v, "e4m3")), want);
        assert_memory_equal(codes, want, TMX_TRELLIS_TILE);
        tmx_trellis_decode_codes(&e2m1, words, K, codes);
        hex_bytes(json_string_value(json_object_get(v, "e2m1")), want);
        assert_memory_equal(codes, want, TMX_TRELLIS_TILE / 2);
        tmx_trellis_decode_values(&e4m3, words, K, values);
        for (int k = 0; k < TMX_TRELLIS_TILE; k++)
            assert_true(values[k] == (float)json_real_value(
                                         json_array_get(json_object_get(v, "e4m3_values"),
                                                        (size_t)k)));
    }
    json_decref(j);
}

static void test_pack_round_trip(void **state) {
    (void)state;
    for (int K = TMX_TRELLIS_K_MIN; K <= TMX_TRELLIS_K_MAX; K++)
        for (int rep = 0; rep < 20; rep++) {
            uint8_t syms[TMX_TRELLIS_TILE], back[TMX_TRELLIS_TILE];
            uint32_t words[8 * TMX_TRELLIS_K_MAX], again[8 * TMX_TRELLIS_K_MAX];
            for (int t = 0; t < TMX_TRELLIS_TILE; t++) syms[t] = (uint8_t)(rnd() & ((1u << K) - 1));
            tmx_trellis_pack(syms, K, words);
            tmx_trellis_unpack(words, K, back);
            assert_memory_equal(syms, back, sizeof syms);
            for (int w = 0; w < tmx_trellis_words(K); w++) words[w] = rnd();
            tmx_trellis_unpack(words, K, back);
            tmx_trellis_pack(back, K, again);
            assert_memory_equal(words, again, sizeof(uint32_t) * (size_t)tmx_trellis_words(K));
            /* Consecutive states overlap in 16 - K bits, across the seam too. */
            uint16_t st[TMX_TRELLIS_TILE];
            tmx_trellis_states(words, K, st);
            for (int t = 0; t < TMX_TRELLIS_TILE; t++)
                assert_int_equal(st[t] >> K, st[(t + 255) % 256] & ((1u << (16 - K)) - 1));
        }
}

/* --- Viterbi ------------------------------------------------------------------------------- */

/* A target decoded from a random stream has a zero-error stream; the search must find one
 * (maybe another stream with the same values: distinct states share codes, and e2m1's -0 and
 * +0 are equal values). */
static void test_viterbi_exact(void **state) {
    (void)state;
    for (int id = 0; id < 3; id++)
        for (int K = TMX_TRELLIS_K_MIN; K <= tmx_trellis_k_max(id); K++) {
            struct tmx_trellis_law law;
            struct tmx_trellis_viterbi *vit;
            assert_int_equal(tmx_trellis_law_init(&law, id, 0.5625f, NULL), TMX_OK);
            assert_int_equal(tmx_trellis_viterbi_new(&law, K, &vit, NULL), TMX_OK);
            for (int rep = 0; rep < 2; rep++) {
                uint32_t words[8 * TMX_TRELLIS_K_MAX], found[8 * TMX_TRELLIS_K_MAX];
                float target[TMX_TRELLIS_TILE], got[TMX_TRELLIS_TILE];
                for (int w = 0; w < tmx_trellis_words(K); w++) words[w] = rnd();
                tmx_trellis_decode_values(&law, words, K, target);
                const double sse = tmx_trellis_viterbi_encode(vit, target, found);
                tmx_trellis_decode_values(&law, found, K, got);
                if (sse != 0.0)
                    fail_msg("law %s K %d: error %g", tmx_trellis_law_name(law.id), K, sse);
                for (int i = 0; i < TMX_TRELLIS_TILE; i++) assert_true(got[i] == target[i]);
            }
            tmx_trellis_viterbi_free(vit);
        }
}

/* On any target the returned error is that of the packed stream: the best path closes the
 * ring, so decoding the words (whose first states wrap to the last symbols) gives the path. */
static void test_viterbi_closes_ring(void **state) {
    (void)state;
    struct tmx_trellis_law law;
    struct tmx_trellis_viterbi *vit;
    const enum tmx_trellis_law_id ids[] = {TMX_TRELLIS_LAW_E4M3, TMX_TRELLIS_LAW_PAIR};
    for (int l = 0; l < 2; l++) {
        assert_int_equal(tmx_trellis_law_init(&law, ids[l], 1.0f, NULL), TMX_OK);
        for (int K = 2; K <= 4; K++) {
            assert_int_equal(tmx_trellis_viterbi_new(&law, K, &vit, NULL), TMX_OK);
            for (int rep = 0; rep < 3; rep++) {
                float target[TMX_TRELLIS_TILE], got[TMX_TRELLIS_TILE];
                uint32_t words[8 * TMX_TRELLIS_K_MAX];
                double ref = 0.0, again = 0.0;
                for (int i = 0; i < TMX_TRELLIS_TILE; i++) {
                    target[i] = ((float)(rnd() % 2001) - 1000.0f) / 400.0f;
                    ref += (double)target[i] * target[i];
                }
                const double sse = tmx_trellis_viterbi_encode(vit, target, words);
                tmx_trellis_decode_values(&law, words, K, got);
                for (int i = 0; i < TMX_TRELLIS_TILE; i++)
                    again += ((double)target[i] - got[i]) * ((double)target[i] - got[i]);
                assert_true(fabs(sse - again) <= 1e-12 * again);
                assert_true(sse < 0.3 * ref); /* a real code, not noise */
            }
            tmx_trellis_viterbi_free(vit);
        }
    }
    char *err = NULL;
    assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_E4M3, 1.0f, NULL), TMX_OK);
    assert_int_equal(tmx_trellis_viterbi_new(&law, 7, &vit, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "K = 7"));
    free(err);
    /* e4m3-pair steps 2K bits: K = 5 would leave too few to carry over (and to tag). */
    assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_PAIR, 1.0f, NULL), TMX_OK);
    assert_int_equal(tmx_trellis_viterbi_new(&law, 5, &vit, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "K = 5 is not in 2..4 for law e4m3-pair"));
    free(err);
}

/* Law e4m3-pair (§14) against pair.json (tools/trellis/make_vectors.py, in Python): chosen
 * states' pairs, an FNV-1a hash of the whole table, and the codes and values of tiles. */
static void test_pair_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "pair.json");
    struct tmx_trellis_law law;
    assert_int_equal(tmx_trellis_law_init(&law, TMX_TRELLIS_LAW_PAIR, 1.0f, NULL), TMX_OK);
    assert_string_equal(tmx_trellis_law_name(law.id), "e4m3-pair");
    assert_int_equal(tmx_trellis_law_from_name("e4m3-pair"), TMX_TRELLIS_LAW_PAIR);
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(j, "pairs"), i, v) {
        const json_int_t s = json_integer_value(json_array_get(v, 0));
        assert_int_equal(law.pairs[s], json_integer_value(json_array_get(v, 1)));
    }
    uint64_t fnv = 0xcbf29ce484222325ull; /* over the table's bytes, little-endian pairs */
    for (int s = 0; s < 65536; s++)
        for (int b = 0; b < 2; b++)
            fnv = (fnv ^ (uint8_t)(law.pairs[s] >> (8 * b))) * 0x100000001b3ull;
    assert_int_equal(fnv, strtoull(json_string_value(json_object_get(j, "fnv1a64")), NULL, 16));
    json_array_foreach(json_object_get(j, "tiles"), i, v) {
        const int K = (int)json_integer_value(json_object_get(v, "K"));
        uint32_t words[8 * TMX_TRELLIS_PAIR_K_MAX];
        uint8_t codes[TMX_TRELLIS_TILE], want[TMX_TRELLIS_TILE];
        float values[TMX_TRELLIS_TILE];
        const json_t *w = json_object_get(v, "words");
        for (int k = 0; k < tmx_trellis_words(K); k++)
            words[k] = hex_u32(json_string_value(json_array_get(w, (size_t)k)));
        tmx_trellis_decode_codes(&law, words, K, codes);
        hex_bytes(json_string_value(json_object_get(v, "codes")), want);
        assert_memory_equal(codes, want, TMX_TRELLIS_TILE);
        tmx_trellis_decode_values(&law, words, K, values);
        for (int k = 0; k < TMX_TRELLIS_TILE; k++)
            assert_true(values[k] == (float)json_real_value(
                                         json_array_get(json_object_get(v, "values"), (size_t)k)));
    }
    json_decref(j);
}

/* --- Hadamard ------------------------------------------------------------------------------ */

static void test_hadamard_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "hadamard.json");
    size_t n, nh, nr;
    float *x = f32_array(json_object_get(j, "x"), &n);
    float *h = f32_array(json_object_get(j, "h"), &nh);
    float *rot = f32_array(json_object_get(j, "rotated"), &nr);
    assert_int_equal(n, 256);
    float y[256];
    memcpy(y, x, sizeof y);
    tmx_trellis_hadamard(y, 256);
    for (int i = 0; i < 256; i++) assert_int_equal(f32_bits(y[i]), f32_bits(h[i]));
    uint8_t signs[32];
    hex_bytes(json_string_value(json_object_get(j, "signs")), signs);
    memcpy(y, x, sizeof y);
    tmx_trellis_rotate(signs, y, 256);
    for (int i = 0; i < 256; i++) assert_int_equal(f32_bits(y[i]), f32_bits(rot[i]));
    free(x);
    free(h);
    free(rot);
    json_decref(j);
}

static void test_hadamard_orthonormal(void **state) {
    (void)state;
    for (int rep = 0; rep < 10; rep++) {
        float x[512], y[512];
        uint8_t signs[64];
        double norm = 0.0, norm_h = 0.0, dev = 0.0;
        for (int i = 0; i < 512; i++) x[i] = ((float)(rnd() % 20001) - 10000.0f) / 1000.0f;
        tmx_trellis_signs_random((uint64_t)rep, signs, 512);
        memcpy(y, x, sizeof y);
        tmx_trellis_hadamard(y, 512);
        for (int i = 0; i < 512; i++) norm += (double)x[i] * x[i], norm_h += (double)y[i] * y[i];
        tmx_trellis_hadamard(y, 512); /* H H = I */
        for (int i = 0; i < 512; i++) dev = fmax(dev, fabs((double)y[i] - x[i]));
        assert_true(fabs(norm_h - norm) < 1e-5 * norm);
        assert_true(dev < 1e-5);
        memcpy(y, x, sizeof y);
        tmx_trellis_rotate(signs, y, 512);
        tmx_trellis_unrotate(signs, y, 512); /* (s H)(H s) = I */
        for (int i = 0; i < 512; i++) assert_true(fabs((double)y[i] - x[i]) < 1e-5);
    }
    /* One input unit vector gives a column of H: +-1/sqrt(128), signs by popcount(i & j). */
    float e[128] = {0};
    e[37] = 1.0f;
    tmx_trellis_hadamard(e, 128);
    for (int i = 0; i < 128; i++)
        assert_true(e[i] == (__builtin_popcount((unsigned)(i & 37)) & 1 ? -0x1.6a09e6p-4f
                                                                         : 0x1.6a09e6p-4f));
}

/* --- activations --------------------------------------------------------------------------- */

static void test_activation_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "activations.json");
    size_t i, n;
    json_t *v;
    uint8_t q[64], want[64], s[8], want_s[8];
    json_array_foreach(json_object_get(j, "e4m3"), i, v) {
        float *x = f32_array(json_object_get(v, "x"), &n);
        const float scale = tmx_trellis_act_e4m3(x, (int64_t)n, q);
        assert_true(scale == ldexpf(1.0f, (int)json_integer_value(json_object_get(v, "exp"))));
        hex_bytes(json_string_value(json_object_get(v, "q")), want);
        assert_memory_equal(q, want, n);
        free(x);
    }
    json_array_foreach(json_object_get(j, "nvfp4"), i, v) {
        float *x = f32_array(json_object_get(v, "x"), &n);
        const float scale = tmx_trellis_act_nvfp4(x, (int64_t)n, q, s);
        assert_true(scale == ldexpf(1.0f, (int)json_integer_value(json_object_get(v, "exp"))));
        hex_bytes(json_string_value(json_object_get(v, "q")), want);
        hex_bytes(json_string_value(json_object_get(v, "scales")), want_s);
        assert_memory_equal(q, want, n / 2);
        assert_memory_equal(s, want_s, n / 16);
        free(x);
    }
    json_array_foreach(json_object_get(j, "mxfp8"), i, v) {
        float *x = f32_array(json_object_get(v, "x"), &n);
        tmx_trellis_mxfp8_quantize(x, (int64_t)n, q, s);
        hex_bytes(json_string_value(json_object_get(v, "q")), want);
        hex_bytes(json_string_value(json_object_get(v, "scales")), want_s);
        assert_memory_equal(q, want, n);
        assert_memory_equal(s, want_s, n / 32);
        free(x);
    }
    json_decref(j);

    assert_int_equal(tmx_trellis_pow2_exp(0.0f, 448.0f), 0);
    assert_int_equal(tmx_trellis_pow2_exp(448.0f, 448.0f), 0);
    assert_int_equal(tmx_trellis_pow2_exp(448.5f, 448.0f), 1);
    assert_int_equal(tmx_trellis_pow2_exp(224.0f, 448.0f), -1);
    assert_int_equal(tmx_trellis_pow2_exp(0x1p-149f, 448.0f), -127);
    assert_int_equal(tmx_trellis_pow2_exp(0x1.fffffep127f, 448.0f), 120);
}

/* --- CSF ----------------------------------------------------------------------------------- */

static void test_csf_vectors(void **state) {
    (void)state;
    json_t *j = fixture(FIXTURES "csf.json");
    size_t i;
    json_t *v;
    json_array_foreach(j, i, v) {
        const int64_t rows = json_integer_value(json_object_get(v, "rows"));
        const int64_t cols = json_integer_value(json_object_get(v, "cols"));
        const int64_t fsize = tmx_trellis_csf_fixed_size(rows, cols);
        uint8_t *plane = malloc((size_t)(rows * cols)), *fixed = malloc((size_t)fsize);
        uint8_t *want = malloc((size_t)fsize), *back = malloc((size_t)(rows * cols));
        hex_bytes(json_string_value(json_object_get(v, "scales")), plane);
        assert_int_equal(hex_bytes(json_string_value(json_object_get(v, "fixed")), want), fsize);
        uint32_t *ex;
        int64_t n_ex;
        assert_int_equal(tmx_trellis_csf_encode(plane, rows, cols, fixed, &ex, &n_ex, NULL),
                         TMX_OK);
        assert_memory_equal(fixed, want, (size_t)fsize);
        const json_t *wex = json_object_get(v, "exceptions");
        assert_int_equal(n_ex, json_array_size(wex));
        for (int64_t k = 0; k < n_ex; k++)
            assert_int_equal(ex[k], json_integer_value(json_array_get(wex, (size_t)k)));
        assert_int_equal(tmx_trellis_csf_decode("v", fixed, fsize, ex, n_ex, rows, cols, back,
                                                NULL),
                         TMX_OK);
        assert_memory_equal(back, plane, (size_t)(rows * cols));
        free(plane), free(fixed), free(want), free(back), free(ex);
    }
    json_decref(j);
}

/* decode(encode(p)) == p, and encoding is canonical: encode(decode(s)) == s. */
static void check_lossless(const uint8_t *plane, int64_t rows, int64_t cols) {
    const int64_t fsize = tmx_trellis_csf_fixed_size(rows, cols);
    uint8_t *fixed = malloc((size_t)fsize), *fixed2 = malloc((size_t)fsize);
    uint8_t *back = malloc((size_t)(rows * cols));
    uint32_t *ex, *ex2;
    int64_t n_ex, n_ex2;
    char *err = NULL;
    if (tmx_trellis_csf_encode(plane, rows, cols, fixed, &ex, &n_ex, &err) != TMX_OK)
        fail_msg("%s", err);
    if (tmx_trellis_csf_decode("plane", fixed, fsize, ex, n_ex, rows, cols, back, &err) != TMX_OK)
        fail_msg("%s", err);
    assert_memory_equal(back, plane, (size_t)(rows * cols));
    assert_int_equal(tmx_trellis_csf_encode(back, rows, cols, fixed2, &ex2, &n_ex2, NULL), TMX_OK);
    assert_memory_equal(fixed, fixed2, (size_t)fsize);
    assert_int_equal(n_ex, n_ex2);
    if (n_ex) assert_memory_equal(ex, ex2, (size_t)n_ex * sizeof *ex);
    free(fixed), free(fixed2), free(back), free(ex), free(ex2);
}

static void test_csf_lossless(void **state) {
    (void)state;
    const int64_t shapes[][2] = {{16, 2}, {16, 8}, {32, 128}, {64, 4}, {128, 256}};
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        const int64_t rows = shapes[sh][0], cols = shapes[sh][1], n = rows * cols;
        uint8_t *p = malloc((size_t)n);
        for (int kind = 0; kind < 7; kind++) {
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = i / cols, c = i % cols;
                switch (kind) {
                case 0: p[i] = (uint8_t)(0x30 + (int)(r % 20) + (int)(rnd() % 9) - 4); break;
                case 1: p[i] = (uint8_t)(rnd() % 0x7f); break;     /* anything legal */
                case 2: p[i] = 0x38; break;                        /* all equal */
                case 3: p[i] = (uint8_t)((r * 7 + c) % 0x7f); break; /* all distinct in a row */
                case 4: p[i] = rnd() & 1 ? 0x00 : 0x7e; break;     /* the extremes */
                case 5: p[i] = (uint8_t)(c < cols / 2 ? 0x00 : 0x7e); break;
                default: p[i] = (uint8_t)(0x6f + rnd() % 16); break; /* the top window */
                }
            }
            check_lossless(p, rows, cols);
        }
        free(p);
    }
}

/* Encodes a fixed plane; the caller corrupts a copy and expects `what` in the message. */
struct csf_case {
    int64_t rows, cols, fsize, n_ex;
    uint8_t plane[32 * 8], fixed[32 * 5];
    uint32_t ex[32 * 8];
};

static void csf_case_init(struct csf_case *cc) {
    cc->rows = 32, cc->cols = 8;
    cc->fsize = tmx_trellis_csf_fixed_size(cc->rows, cc->cols);
    for (int i = 0; i < 256; i++) cc->plane[i] = (uint8_t)(0x30 + i % 5);
    cc->plane[9] = 0x00, cc->plane[100] = 0x7e, cc->plane[200] = 0x01;
    uint32_t *ex;
    assert_int_equal(tmx_trellis_csf_encode(cc->plane, cc->rows, cc->cols, cc->fixed, &ex,
                                            &cc->n_ex, NULL),
                     TMX_OK);
    assert_int_equal(cc->n_ex, 3);
    memcpy(cc->ex, ex, (size_t)cc->n_ex * sizeof *ex);
    free(ex);
}

static void expect_reject(const struct csf_case *cc, int64_t fsize, int64_t n_ex, int64_t rows,
                          const char *what) {
    uint8_t out[32 * 8 * 2];
    char *err = NULL;
    assert_int_equal(tmx_trellis_csf_decode("layer-003.gate_proj", cc->fixed, fsize, cc->ex, n_ex,
                                            rows, cc->cols, out, &err),
                     TMX_ERR_INVALID);
    if (!strstr(err, "layer-003.gate_proj") || !strstr(err, what))
        fail_msg("message '%s' lacks '%s'", err, what);
    free(err);
}

static void test_csf_rejects(void **state) {
    (void)state;
    struct csf_case good, cc;
    csf_case_init(&good);
    uint8_t out[256];
    assert_int_equal(tmx_trellis_csf_decode("ok", good.fixed, good.fsize, good.ex, good.n_ex, 32,
                                            8, out, NULL),
                     TMX_OK);
    assert_memory_equal(out, good.plane, 256);

    /* Truncated, wrong geometry, more exceptions than scales. */
    expect_reject(&good, good.fsize - 1, good.n_ex, 32, "fixed stream is 159 bytes");
    expect_reject(&good, good.fsize, good.n_ex, 15, "multiple of 16");
    expect_reject(&good, good.fsize, 300, 32, "300 exceptions");
    cc = good, cc.fixed[3] = 112;
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "base 0x70");
    cc = good, cc.ex[2] = (cc.ex[2] & 0xff000000u) | 256;
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "past the plane");
    cc = good, cc.ex[1] = cc.ex[0];
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "must increase");
    cc = good, cc.ex[1] = (cc.ex[1] & 0xffffffu) | 0x7fu << 24;
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "0x7f is not a legal");
    cc = good, cc.ex[1] = (cc.ex[1] & 0xffffffu) | 0xb8u << 24;
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "0xb8 is not a legal");
    cc = good, cc.ex[0] = (cc.ex[0] & 0xffffffu) | 0x31u << 24;
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "inside the row's window");
    cc = good, cc.fixed[16 + 4] |= 0x20; /* row 1, column 1: under exception 0 (position 9) */
    expect_reject(&cc, cc.fsize, cc.n_ex, 32, "nibble under it is 2");

    /* The encoder refuses what no scale may be: NaN codes and negative scales. */
    const uint8_t bad[] = {0x7f, 0x80, 0xb8, 0xff};
    for (size_t i = 0; i < sizeof bad; i++) {
        struct csf_case b = good;
        uint32_t *ex;
        int64_t n;
        char *err = NULL;
        b.plane[77] = bad[i];
        assert_int_equal(tmx_trellis_csf_encode(b.plane, 32, 8, b.fixed, &ex, &n, &err),
                         TMX_ERR_INVALID);
        assert_non_null(strstr(err, "scale [9][5]"));
        free(err);
    }
}

static void test_csf_starts(void **state) {
    (void)state;
    const int32_t ok[] = {0, 0, 3, 3, 7};
    assert_int_equal(tmx_trellis_csf_check_starts("s", ok, 4, 7, NULL), TMX_OK);
    const int32_t first[] = {1, 3}, down[] = {0, 4, 3}, end[] = {0, 2, 5};
    char *err = NULL;
    assert_int_equal(tmx_trellis_csf_check_starts("s", first, 1, 3, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "starts[0]"));
    free(err), err = NULL;
    assert_int_equal(tmx_trellis_csf_check_starts("s", down, 2, 3, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "below"));
    free(err), err = NULL;
    assert_int_equal(tmx_trellis_csf_check_starts("s", end, 2, 6, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "holds 6"));
    free(err);
}

/* --- whole matrices ------------------------------------------------------------------------ */

static void test_matrix_vectors(void **state) {
    (void)state;
    json_t *laws = fixture(FIXTURES "laws.json");
    const float alpha = (float)json_real_value(json_object_get(laws, "alpha"));
    json_decref(laws);
    json_t *j = fixture(FIXTURES "matrices.json");
    size_t i;
    json_t *v;
    json_array_foreach(j, i, v) {
        struct tmx_trellis_law law;
        const int id = tmx_trellis_law_from_name(json_string_value(json_object_get(v, "law")));
        assert_int_equal(tmx_trellis_law_init(&law, id, alpha, NULL), TMX_OK);
        struct tmx_trellis_matrix m = {
            .law = &law,
            .K = (int)json_integer_value(json_object_get(v, "K")),
            .block = (int)json_integer_value(json_object_get(v, "block")),
            .rows = json_integer_value(json_object_get(v, "rows")),
            .cols = json_integer_value(json_object_get(v, "cols")),
            .scale = (float)json_real_value(json_object_get(v, "scale")),
        };
        const char *whex = json_string_value(json_object_get(v, "words"));
        const size_t nw = strlen(whex) / 8;
        uint32_t *words = malloc(nw * sizeof *words);
        uint8_t *scales = malloc((size_t)(m.rows * m.cols / m.block));
        uint8_t sin[64], sout[64];
        for (size_t k = 0; k < nw; k++) {
            char w[9] = {0};
            memcpy(w, whex + 8 * k, 8);
            words[k] = hex_u32(w);
        }
        hex_bytes(json_string_value(json_object_get(v, "scales")), scales);
        hex_bytes(json_string_value(json_object_get(v, "sign_in")), sin);
        hex_bytes(json_string_value(json_object_get(v, "sign_out")), sout);
        m.words = words, m.scales = scales, m.sign_in = sin, m.sign_out = sout;
        char *err = NULL;
        if (tmx_trellis_matrix_check(&m, &err) != TMX_OK) fail_msg("%s", err);

        float *q = malloc((size_t)(m.rows * m.cols) * sizeof *q);
        float *w = malloc((size_t)(m.rows * m.cols) * sizeof *w);
        tmx_trellis_matrix_operands(&m, q);
        tmx_trellis_matrix_dequant(&m, w);
        const double max_abs = json_real_value(json_object_get(v, "max_abs"));
        size_t k;
        json_t *smp;
        json_array_foreach(json_object_get(v, "q_samples"), k, smp) {
            const int64_t p = json_integer_value(json_array_get(smp, 0));
            const double want = json_real_value(json_array_get(smp, 1));
            assert_true(fabs(q[p] - want) <= 1e-6 * fabs(want));
        }
        json_array_foreach(json_object_get(v, "samples"), k, smp) {
            const int64_t p = json_integer_value(json_array_get(smp, 0));
            const double want = json_real_value(json_array_get(smp, 1));
            if (fabs(w[p] - want) > 1e-5 * max_abs)
                fail_msg("law %s: w[%lld] = %g, want %g", tmx_trellis_law_name(law.id),
                         (long long)p, (double)w[p], want);
        }

        /* What check refuses, each named. */
        struct tmx_trellis_matrix b = m;
        b.block = m.block == 32 ? 16 : 32;
        assert_int_equal(tmx_trellis_matrix_check(&b, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, "block")), free(err), err = NULL;
        b = m, b.rows = 144;
        assert_int_equal(tmx_trellis_matrix_check(&b, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, "multiple of 128")), free(err), err = NULL;
        b = m, b.scale = -1.0f;
        assert_int_equal(tmx_trellis_matrix_check(&b, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, "scale -1")), free(err), err = NULL;
        scales[5] = 0x7f;
        assert_int_equal(tmx_trellis_matrix_check(&m, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, "block scale 5")), free(err), err = NULL;
        free(words), free(scales), free(q), free(w);
    }
    json_decref(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rounding_vectors),
        cmocka_unit_test(test_tables_round_trip),
        cmocka_unit_test(test_law_vectors),
        cmocka_unit_test(test_law_init_rejects),
        cmocka_unit_test(test_positions),
        cmocka_unit_test(test_tile_vectors),
        cmocka_unit_test(test_pack_round_trip),
        cmocka_unit_test(test_viterbi_exact),
        cmocka_unit_test(test_viterbi_closes_ring),
        cmocka_unit_test(test_pair_vectors),
        cmocka_unit_test(test_hadamard_vectors),
        cmocka_unit_test(test_hadamard_orthonormal),
        cmocka_unit_test(test_activation_vectors),
        cmocka_unit_test(test_csf_vectors),
        cmocka_unit_test(test_csf_lossless),
        cmocka_unit_test(test_csf_rejects),
        cmocka_unit_test(test_csf_starts),
        cmocka_unit_test(test_matrix_vectors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
