/* test_codec_trellis.c: the TrellisMX codec plugins, codec.trellis-e4m3 and codec.trellis-fp4
 * (and the experimental codec.trellis-e4m3-pair), loaded from the build's bin/ as the engine
 * loads them.
 *
 * Each test writes a random layer in a temporary folder, as docs/trellismx.md §10 lays it out:
 * random tile words (every stream is valid), random block scales through CSF with exceptions,
 * random matrix scales and sign vectors, 20 experts in three experts/ files. Then:
 * - tiles decode to the operand values of the reference decoder, bit for bit (K = 2..6;
 *   e4m3-pair 2..4);
 * - expert_decode is tmx_trellis_matrix_dequant of the data written, bit for bit;
 * - moe_experts with F32 activations matches a float64 expert block on the decoded weights,
 *   within 1e-5 of the output's largest magnitude (F32 sums; measured about 5e-7);
 * - moe_experts in the serving formats matches a float64 expert block that quantizes the
 *   rotated activations with the spec's quantizers (tmx_trellis_act_e4m3 / _nvfp4) and
 *   multiplies the operand matrices Q = g B . C: the quantized inputs of gate and up are the
 *   same bytes, so within 1e-5 as well, except where an intermediate activation lies so close
 *   to a rounding boundary that F32 sums in another order may round it the other way (§7
 *   leaves the order free): such a token may differ by that rounding's effect, bounded per
 *   token (boundary_slack), and every token stays within 1e-3;
 * - 1 and 2 threads give the same bits, and so does a step cut into token chunks;
 * - damaged builds are refused with a message naming the file (and the field);
 * - the options: threads defaults to the core key, a wrong activations value is refused;
 * - the plugin's encoder (tmx quantize's layer_encode) and its reader agree. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>

#include "codec_impl.h"
#include "tmx/config.h"
#include "tmx/loader.h"
#include "tmx/safetensors.h"

enum { LAYER = 7, E = 20, PER_FILE = 8, LAT = 256, INTER = 384, TOPK = 4, NTOK = 37 };

static const char *const proj_name[3] = {"gate_proj", "up_proj", "down_proj"};

static uint64_t rng = 0x5eed;
static uint32_t rnd(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}
static float uniform(void) { return (float)(rnd() >> 8) * 0x1p-24f; } /* [0, 1) */

/* --- a layer's files ---------------------------------------------------------------------- */

enum damage { INTACT, SHORT_TRELLIS, CSF_POSITION, META_LAYER, STARTS };

struct build {
    enum tmx_trellis_codec_id id;
    const struct tmx_trellis_codec_spec *spec;
    int K;
    float alpha;
    char dir[64];
    struct tmx_trellis_law law;
    uint8_t sign[3][INTER / 8];        /* latent_in, intermediate, latent_out */
    uint32_t *words[E][3];             /* [rows/16][cols/16][8K] */
    uint8_t *scales[E][3];             /* [rows][cols/block] */
    float g[E][3];
};

static int64_t rows_of(int p) { return p < 2 ? INTER : LAT; }
static int64_t cols_of(int p) { return p < 2 ? LAT : INTER; }

static struct tmx_trellis_matrix matrix(const struct build *b, int e, int p) {
    return (struct tmx_trellis_matrix){&b->law, b->K, b->spec->block, rows_of(p), cols_of(p),
                                       b->words[e][p], b->scales[e][p], b->g[e][p],
                                       b->sign[p < 2 ? 0 : 1], b->sign[p < 2 ? 1 : 2]};
}

static void write_json(const struct build *b, json_t *q) {
    char path[128];
    snprintf(path, sizeof path, "%s/hf_quant_config.json", b->dir);
    assert_int_equal(json_dump_file(q, path, JSON_INDENT(2)), 0);
}

/* hf_quant_config.json as §10.4 writes it for the build. */
static json_t *quant_config(const struct build *b) {
    json_t *q = json_pack("{s:s, s:i, s:s, s:s, s:i, s:i, s:s, s:i, s:i, s:[], s:{s:s}}",
                          "quant_method", "trellismx", "trellismx_version", 1, "codec",
                          b->spec->name, "law", tmx_trellis_law_name(b->spec->law), "bits", b->K,
                          "block_size", b->spec->block, "activation", b->spec->activation,
                          "hadamard_block", 128, "experts_per_file", PER_FILE, "mxfp8_tensors",
                          "producer", "name", "test");
    if (b->id == TMX_TRELLIS_CODEC_FP4) json_object_set_new(q, "alpha", json_real(b->alpha));
    return q;
}

static void write_coupled(const struct build *b) {
    char path[128];
    snprintf(path, sizeof path, "%s/coupled/layer-%03d.safetensors", b->dir, LAYER);
    const char *names[3] = {"sign_latent_in", "sign_intermediate", "sign_latent_out"};
    struct tmx_tensor t[3] = {{TMX_DTYPE_U8, 1, {LAT / 8}, (void *)b->sign[0]},
                              {TMX_DTYPE_U8, 1, {INTER / 8}, (void *)b->sign[1]},
                              {TMX_DTYPE_U8, 1, {LAT / 8}, (void *)b->sign[2]}};
    const char *meta[] = {"format", "trellismx-coupled", "trellismx_version", "1", "layer", "7",
                          NULL};
    char *err = NULL;
    if (tmx_safetensors_write(path, 3, names, t, meta, &err) != TMX_OK) fail_msg("%s", err);
}

/* experts/ file f, with `damage` done to it. */
static void write_chunk(const struct build *b, int f, enum damage damage) {
    const int first = f * PER_FILE, last = first + PER_FILE > E ? E - 1 : first + PER_FILE - 1,
              n = last - first + 1, nw = tmx_trellis_words(b->K), block = b->spec->block;
    char names[15][48], path[128], s_first[16], s_last[16];
    const char *name_ptrs[15];
    struct tmx_tensor t[15];
    void *bufs[15];
    for (int p = 0; p < 3; p++) {
        const int64_t rows = rows_of(p), cols = cols_of(p), tiles = rows * cols / 256;
        const int64_t fixed = tmx_trellis_csf_fixed_size(rows, cols / block);
        uint32_t *words = malloc((size_t)(n * tiles * nw) * 4);
        float *g = malloc((size_t)n * 4);
        uint8_t *csf = malloc((size_t)(n * fixed));
        int32_t *starts = malloc((size_t)(n + 1) * 4);
        uint32_t *ex = NULL;
        starts[0] = 0;
        for (int e = 0; e < n; e++) {
            memcpy(words + e * tiles * nw, b->words[first + e][p], (size_t)(tiles * nw) * 4);
            g[e] = b->g[first + e][p];
            uint32_t *ex_e;
            int64_t n_ex;
            assert_int_equal(tmx_trellis_csf_encode(b->scales[first + e][p], rows, cols / block,
                                                    csf + e * fixed, &ex_e, &n_ex, NULL),
                             TMX_OK);
            assert_true(n_ex > 0); /* the planes are made to have some */
            ex = realloc(ex, (size_t)(starts[e] + n_ex) * 4);
            memcpy(ex + starts[e], ex_e, (size_t)n_ex * 4);
            starts[e + 1] = starts[e] + (int32_t)n_ex;
            free(ex_e);
        }
        if (damage == CSF_POSITION && p == 2) { /* expert first's last exception: off the plane */
            const uint32_t byte = ex[starts[1] - 1] >> 24;
            ex[starts[1] - 1] = (uint32_t)(rows * (cols / block) + 5) | byte << 24;
        }
        if (damage == STARTS && p == 1) starts[n] -= 1;
        const int64_t words_last = damage == SHORT_TRELLIS && p == 1 ? nw - 1 : nw;
        const struct tmx_tensor pt[5] = {
            {TMX_DTYPE_I32, 4, {n, rows / 16, cols / 16, words_last}, words},
            {TMX_DTYPE_F32, 1, {n}, g},
            {TMX_DTYPE_U8, 2, {n, fixed}, csf},
            {TMX_DTYPE_I32, 1, {starts[n] + (damage == STARTS && p == 1)}, ex},
            {TMX_DTYPE_I32, 1, {n + 1}, starts}};
        static const char *const suffix[5] = {"trellis", "scale", "scale_csf",
                                              "scale_csf_exceptions", "scale_csf_starts"};
        for (int i = 0; i < 5; i++) {
            snprintf(names[5 * p + i], sizeof names[0], "%s.%s", proj_name[p], suffix[i]);
            name_ptrs[5 * p + i] = names[5 * p + i];
            t[5 * p + i] = pt[i];
            bufs[5 * p + i] = pt[i].data;
        }
    }
    snprintf(path, sizeof path, "%s/experts/layer-%03d-%03d-%03d.safetensors", b->dir, LAYER,
             first, last);
    snprintf(s_first, sizeof s_first, "%d", first);
    snprintf(s_last, sizeof s_last, "%d", last);
    const char *meta[] = {"format", "trellismx-experts", "trellismx_version", "1", "layer",
                          damage == META_LAYER ? "8" : "7", "first_expert", s_first,
                          "last_expert", s_last, NULL};
    char *err = NULL;
    if (tmx_safetensors_write(path, 15, name_ptrs, t, meta, &err) != TMX_OK) fail_msg("%s", err);
    for (int i = 0; i < 15; i++) free(bufs[i]);
}

/* A random layer for codec `id` at K bits, written to a new temporary folder. Each row's
 * block scales sit in a window of two octaves, but about one in 40 lies up to one octave
 * outside it: a CSF exception. */
static void build_make(struct build *b, enum tmx_trellis_codec_id id, int K) {
    memset(b, 0, sizeof *b);
    b->id = id;
    b->spec = tmx_trellis_codec_spec(id);
    b->K = K;
    b->alpha = 0.5625f;
    assert_int_equal(tmx_trellis_law_init(&b->law, b->spec->law, b->alpha, NULL), TMX_OK);
    strcpy(b->dir, "/tmp/tmx-codec-XXXXXX");
    assert_non_null(mkdtemp(b->dir));
    char sub[96];
    snprintf(sub, sizeof sub, "%s/experts", b->dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    snprintf(sub, sizeof sub, "%s/coupled", b->dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    for (int v = 0; v < 3; v++) tmx_trellis_signs_random(rnd(), b->sign[v], v == 1 ? INTER : LAT);
    const int nw = tmx_trellis_words(K);
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            const int64_t rows = rows_of(p), cols = cols_of(p), per_row = cols / b->spec->block;
            b->words[e][p] = malloc((size_t)(rows * cols / 256 * nw) * 4);
            for (int64_t i = 0; i < rows * cols / 256 * nw; i++) b->words[e][p][i] = rnd();
            b->scales[e][p] = malloc((size_t)(rows * per_row));
            for (int64_t r = 0; r < rows; r++) {
                const uint32_t base = 0x28 + rnd() % 0x18;
                for (int64_t c = 0; c < per_row; c++)
                    b->scales[e][p][r * per_row + c] =
                        (uint8_t)(rnd() % 40 ? base + rnd() % 16
                                  : rnd() % 2 ? base - 1 - rnd() % 8 : base + 16 + rnd() % 8);
            }
            b->g[e][p] = (0.5f + uniform()) / sqrtf((float)cols);
        }
    json_t *q = quant_config(b);
    write_json(b, q);
    json_decref(q);
    write_coupled(b);
    for (int f = 0; f * PER_FILE < E; f++) write_chunk(b, f, INTACT);
}

static void build_free(struct build *b) {
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) free(b->words[e][p]), free(b->scales[e][p]);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", b->dir);
    assert_int_equal(system(cmd), 0);
}

/* --- the plugins ------------------------------------------------------------------------- */

struct codec {
    struct tmx_config *cfg;
    struct tmx_plugins *ps;
    const struct tmx_codec_i *ops;
    void *ctx;
};

/* codec.<name> from bin/ with its options set as given; returns init's status (message in
 * *err). */
static enum tmx_status codec_open(struct codec *c, const char *name, const char *threads,
                                  const char *activations, char **err) {
    char set[96];
    const struct tmx_plugin *p;
    assert_int_equal(tmx_config_load(NULL, &c->cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_set(c->cfg, "plugin_dir=" TMX_BIN_DIR, NULL), TMX_OK);
    snprintf(set, sizeof set, "codec.%s.threads=%s", name, threads);
    assert_int_equal(tmx_config_set(c->cfg, set, NULL), TMX_OK);
    snprintf(set, sizeof set, "codec.%s.activations=%s", name, activations);
    assert_int_equal(tmx_config_set(c->cfg, set, NULL), TMX_OK);
    assert_int_equal(tmx_plugins_new(c->cfg, &c->ps, NULL), TMX_OK);
    char *lerr = NULL;
    if (tmx_plugins_load(c->ps, TMX_PLUGIN_CODEC, name, &p, &lerr) != TMX_OK)
        fail_msg("%s", lerr);
    c->ops = p->ops;
    assert_string_equal(c->ops->quant_method, "trellismx");
    return c->ops->init(tmx_host_get(), tmx_plugins_opts(c->ps, p), &c->ctx, err);
}

static void codec_close(struct codec *c) {
    c->ops->fini(c->ctx);
    tmx_plugins_free(c->ps);
    tmx_config_free(c->cfg);
}

static void *layer_load(struct codec *c, const struct build *b) {
    const struct tmx_codec_layer_info info = {b->dir, LAYER, E, LAT, INTER};
    void *layer = NULL;
    char *err = NULL;
    if (c->ops->layer_load(c->ctx, &info, &layer, &err) != TMX_OK) fail_msg("%s", err);
    return layer;
}

/* --- references ----------------------------------------------------------------------------- */

/* Routing of n tokens: distinct experts per token, every token's first one expert 3 (so that
 * it has more tokens than one work group), one skipped pair (-1). */
static void route(int n, int32_t *ids, float *w) {
    for (int t = 0; t < n; t++)
        for (int j = 0; j < TOPK; j++) {
            int e, dup;
            do {
                e = j == 0 ? 3 : (int)(rnd() % E);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= ids[t * TOPK + i] == e;
            } while (dup);
            ids[t * TOPK + j] = e;
            w[t * TOPK + j] = 0.1f + uniform();
        }
    if (n > 5) ids[5 * TOPK + 2] = -1;
}

static double silu(double x) { return x / (1.0 + exp(-x)); }

/* y[rows] = scale * mat[rows][cols] . x[cols] in float64. */
static void matvec(const float *mat, int64_t rows, int64_t cols, const float *x, double scale,
                   double *y) {
    for (int64_t r = 0; r < rows; r++) {
        double s = 0.0;
        for (int64_t c = 0; c < cols; c++) s += (double)mat[r * cols + c] * x[c];
        y[r] = scale * s;
    }
}

/* The values one activation vector takes in the serving format (§7), and their scale. */
static double quantized(const struct build *b, const float *x, int64_t n, float *v) {
    uint8_t q[INTER], s[INTER / 16];
    if (b->id != TMX_TRELLIS_CODEC_FP4) {
        const float a = tmx_trellis_act_e4m3(x, n, q);
        for (int64_t i = 0; i < n; i++) v[i] = tmx_e4m3_to_f32(q[i]);
        return a;
    }
    const float t = tmx_trellis_act_nvfp4(x, n, q, s);
    for (int64_t i = 0; i < n; i++)
        v[i] = tmx_e4m3_to_f32(s[i / 16]) * tmx_trellis_e2m1_to_f32(q[i / 2] >> (4 * (i & 1)) & 15);
    return t;
}

/* How far the serving-format values of m'[n] (scale included, into delta[n]) can move when
 * every element moves by up to 2^-18 max|m'|: an F32 m' computed with other summation orders
 * (§7 leaves them free) may round the other way where it lies that close to a rounding
 * boundary, and nowhere else. */
static void boundary_slack(const struct build *b, const float *m, int64_t n, const float *v,
                           double scale, double *delta) {
    static float shifted[INTER], vs[INTER];
    double amax = 0.0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(m[i]));
    memset(delta, 0, (size_t)n * sizeof *delta);
    for (int sign = -1; sign <= 1; sign += 2) {
        for (int64_t i = 0; i < n; i++) shifted[i] = (float)(m[i] + sign * amax * 0x1p-18);
        const double ss = quantized(b, shifted, n, vs);
        for (int64_t i = 0; i < n; i++) delta[i] = fmax(delta[i], fabs(vs[i] * ss - v[i] * scale));
    }
}

/* The expert block (docs/model.md) in float64. serving = 0: on the decoded weights mats
 * ([E][3] of W); serving = 1: in the rotated basis of §6 on mats = operand matrices Q, with
 * the rotated activations quantized as §7 says (rotations in F32, as the spec fixes them), and
 * slack[t] (if not NULL) bounds how far token t's output may move where an intermediate
 * activation lies at a rounding boundary (boundary_slack; usually 0). */
static void reference(const struct build *b, float *const *mats, int serving, const float *z,
                      const int32_t *ids, const float *rw, int n, const float *post, float eps,
                      float *out, double *slack) {
    static double g[INTER], u[INTER], y[LAT], acc[LAT], delta[INTER];
    static float x[LAT], m[INTER], mr[INTER], gf[INTER], uf[INTER], o[LAT];
    double post_max = 1.0;
    for (int i = 0; post && i < LAT; i++) post_max = fmax(post_max, fabs(post[i]));
    for (int t = 0; t < n; t++) {
        memcpy(x, z + t * LAT, sizeof x);
        double xs = 1.0;
        if (serving) {
            tmx_trellis_rotate(b->sign[0], x, LAT);
            xs = quantized(b, x, LAT, x);
        }
        memset(acc, 0, sizeof acc);
        if (slack) slack[t] = 0.0;
        for (int j = 0; j < TOPK; j++) {
            const int e = ids[t * TOPK + j];
            if (e < 0) continue;
            matvec(mats[e * 3 + 0], INTER, LAT, x, xs, g);
            matvec(mats[e * 3 + 1], INTER, LAT, x, xs, u);
            double ms = 1.0;
            if (serving) {
                for (int i = 0; i < INTER; i++) gf[i] = (float)g[i], uf[i] = (float)u[i];
                tmx_trellis_unrotate(b->sign[1], gf, INTER);
                tmx_trellis_unrotate(b->sign[1], uf, INTER);
                for (int i = 0; i < INTER; i++) mr[i] = (float)(silu(gf[i]) * uf[i]);
                tmx_trellis_rotate(b->sign[1], mr, INTER);
                ms = quantized(b, mr, INTER, m);
                boundary_slack(b, mr, INTER, m, ms, delta);
            } else {
                for (int i = 0; i < INTER; i++) m[i] = (float)(silu(g[i]) * u[i]);
            }
            matvec(mats[e * 3 + 2], LAT, INTER, m, ms, y);
            double ss = 0.0;
            for (int i = 0; i < LAT; i++) ss += y[i] * y[i];
            const double r = post ? rw[t * TOPK + j] / sqrt(ss / LAT + eps) : rw[t * TOPK + j];
            for (int i = 0; i < LAT; i++) acc[i] += r * y[i];
            if (serving && slack) { /* |Q| delta in L2; H keeps it, post scales it */
                double l2 = 0.0;
                for (int row = 0; row < LAT; row++) {
                    double d = 0.0;
                    for (int i = 0; i < INTER; i++)
                        d += fabs(mats[e * 3 + 2][row * INTER + i]) * delta[i];
                    l2 += d * d;
                }
                slack[t] += 2.0 * r * sqrt(l2) * post_max; /* 2: rms(y') moves too */
            }
        }
        for (int i = 0; i < LAT; i++) o[i] = (float)acc[i];
        if (serving) tmx_trellis_unrotate(b->sign[2], o, LAT);
        for (int i = 0; i < LAT; i++) out[t * LAT + i] = post ? o[i] * post[i] : o[i];
    }
}

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return d / m;
}

/* max over tokens of (max |a - b| - slack) / max |b|; *n_tight counts the tokens whose slack
 * is below 1e-5 max |b|, where no activation near a boundary moves the output by more. */
static double rel_diff_slack(const float *a, const float *b, int n, const double *slack,
                             int *n_tight) {
    double d = 0.0, m = 0.0;
    for (int i = 0; i < n * LAT; i++) m = fmax(m, fabs((double)b[i]));
    *n_tight = 0;
    for (int t = 0; t < n; t++) {
        double dt = 0.0;
        for (int i = 0; i < LAT; i++) dt = fmax(dt, fabs((double)a[t * LAT + i] - b[t * LAT + i]));
        d = fmax(d, fmax(dt - slack[t], 0.0));
        *n_tight += slack[t] < 1e-5 * m;
    }
    return d / m;
}

/* --- tests ------------------------------------------------------------------------------------ */

/* The CPU decoder against the reference one: every operand is the code's value times its
 * row's block scale, in trellis order. */
static void test_tile_operands(void **state) {
    (void)state;
    for (int id = 0; id < 3; id++) {
        struct build b = {.id = (enum tmx_trellis_codec_id)id};
        b.spec = tmx_trellis_codec_spec(b.id);
        assert_int_equal(tmx_trellis_law_init(&b.law, b.spec->law, 0.5625f, NULL), TMX_OK);
        const int fp4 = id == TMX_TRELLIS_CODEC_FP4;
        for (int K = TMX_TRELLIS_K_MIN; K <= tmx_trellis_k_max(b.spec->law); K++) {
            const int nw = tmx_trellis_words(K), per_row = 128 / b.spec->block;
            uint32_t words[64 * 8 * TMX_TRELLIS_K_MAX];
            uint8_t scales[128 * 8], codes[256];
            for (int i = 0; i < 64 * nw; i++) words[i] = rnd();
            for (int i = 0; i < 128 * per_row; i++) scales[i] = (uint8_t)(rnd() % 0x7f);
            const struct tmx_trellis_matrix m = {&b.law, K, b.spec->block, 128, 128, words,
                                                 scales, 1.0f, NULL, NULL};
            float ops[256];
            for (int tr = 0; tr < 8; tr++)
                for (int tc = 0; tc < 8; tc++) {
                    trellis_tile_operands(&m, tr, tc, ops);
                    tmx_trellis_decode_codes(&b.law, words + (tr * 8 + tc) * nw, K, codes);
                    for (int t = 0; t < 256; t++) {
                        const int r = 16 * tr + tmx_trellis_pos(t) / 16,
                                  c = 16 * tc + tmx_trellis_pos(t) % 16;
                        const uint8_t code = !fp4 ? codes[t] : codes[t / 2] >> (4 * (t & 1)) & 15;
                        const float v =
                            !fp4 ? tmx_e4m3_to_f32(code) : tmx_trellis_e2m1_to_f32(code);
                        const uint8_t s = scales[r * per_row + c / b.spec->block];
                        const float want = tmx_e4m3_to_f32(s) * v;
                        if (memcmp(&ops[t], &want, 4) != 0)
                            fail_msg("law %d K %d tile (%d, %d) position %d: %g, want %g", id, K,
                                     tr, tc, t, (double)ops[t], (double)want);
                    }
                }
        }
    }
}

/* expert_decode, moe_experts in both activation modes, thread counts, for one codec. */
static void check_codec(enum tmx_trellis_codec_id id, int K) {
    struct build b;
    build_make(&b, id, K);
    struct codec f32, serving;
    char *err = NULL;
    if (codec_open(&f32, b.spec->name, "1", "f32", &err) != TMX_OK) fail_msg("%s", err);
    if (codec_open(&serving, b.spec->name, "2", "serving", &err) != TMX_OK) fail_msg("%s", err);
    void *lf = layer_load(&f32, &b), *ls = layer_load(&serving, &b);

    /* expert_decode: the loaded words, scales, g and signs, exactly */
    float *w[E * 3], *q[E * 3];
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            const size_t n = (size_t)(rows_of(p) * cols_of(p));
            float *want = malloc(n * sizeof *want);
            w[e * 3 + p] = malloc(n * sizeof *w[0]);
            q[e * 3 + p] = malloc(n * sizeof *q[0]);
            const struct tmx_trellis_matrix m = matrix(&b, e, p);
            tmx_trellis_matrix_dequant(&m, want);
            tmx_trellis_matrix_operands(&m, q[e * 3 + p]);
            assert_int_equal(f32.ops->expert_decode(f32.ctx, lf, e, p, w[e * 3 + p], NULL), TMX_OK);
            assert_memory_equal(w[e * 3 + p], want, n * sizeof *want);
            free(want);
        }

    float *z = malloc(sizeof(float) * NTOK * LAT), post[LAT], rw[NTOK * TOPK];
    float *out = malloc(sizeof(float) * NTOK * LAT), *want = malloc(sizeof(float) * NTOK * LAT);
    float *out_f32 = malloc(sizeof(float) * NTOK * LAT);
    double slack[NTOK];
    int32_t ids[NTOK * TOPK];
    for (int i = 0; i < NTOK * LAT; i++) z[i] = 2.0f * uniform() - 1.0f;
    for (int i = 0; i < LAT; i++) post[i] = 0.5f + uniform();
    route(NTOK, ids, rw);
    const float eps = 1e-6f;
    const struct tmx_tensor norm = {TMX_DTYPE_F32, 1, {LAT}, post};

    /* F32 activations: the decoded weights' expert block, F32 sums against float64 */
    assert_int_equal(f32.ops->moe_experts(f32.ctx, lf, out_f32, z, ids, rw, NTOK, TOPK, &norm, eps,
                                          NULL), TMX_OK);
    reference(&b, w, 0, z, ids, rw, NTOK, post, eps, want, NULL);
    const double d_f32 = rel_diff(out_f32, want, NTOK * LAT);
    print_message("%s K=%d f32: max rel. diff %.3g\n", b.spec->name, K, d_f32);
    assert_true(d_f32 < 1e-5);

    /* serving formats: the same operand values, F32 sums against float64; beyond 1e-5 only by
     * the slack of intermediate activations that sit at a rounding boundary (a few per token:
     * within 1e-3 all told) */
    int n_tight;
    assert_int_equal(serving.ops->moe_experts(serving.ctx, ls, out, z, ids, rw, NTOK, TOPK, &norm,
                                              eps, NULL), TMX_OK);
    reference(&b, q, 1, z, ids, rw, NTOK, post, eps, want, slack);
    const double d_serving = rel_diff_slack(out, want, NTOK, slack, &n_tight),
                 d_formats = rel_diff(out, out_f32, NTOK * LAT);
    print_message("%s K=%d serving: max rel. diff %.3g beyond the slack, %d of %d tokens "
                  "with slack < 1e-5 (%.3g with none; to f32 activations: %.3g)\n", b.spec->name, K,
                  d_serving, n_tight, NTOK, rel_diff(out, want, NTOK * LAT), d_formats);
    assert_true(d_serving < 1e-5);
    assert_true(rel_diff(out, want, NTOK * LAT) < 1e-3);
    assert_true(d_formats > 1e-3); /* the activations are quantized */

    /* no post-expert norm; a BF16 one */
    assert_int_equal(serving.ops->moe_experts(serving.ctx, ls, out, z, ids, rw, NTOK, TOPK, NULL,
                                              eps, NULL), TMX_OK);
    reference(&b, q, 1, z, ids, rw, NTOK, NULL, eps, want, slack);
    assert_true(rel_diff_slack(out, want, NTOK, slack, &n_tight) < 1e-5);
    uint16_t post16[LAT];
    for (int i = 0; i < LAT; i++) {
        post16[i] = tmx_f32_to_bf16(post[i]);
        post[i] = tmx_bf16_to_f32(post16[i]);
    }
    const struct tmx_tensor norm16 = {TMX_DTYPE_BF16, 1, {LAT}, post16};
    assert_int_equal(serving.ops->moe_experts(serving.ctx, ls, out, z, ids, rw, NTOK, TOPK,
                                              &norm16, eps, NULL), TMX_OK);
    reference(&b, q, 1, z, ids, rw, NTOK, post, eps, want, slack);
    assert_true(rel_diff_slack(out, want, NTOK, slack, &n_tight) < 1e-5);

    for (int i = 0; i < E * 3; i++) free(w[i]), free(q[i]);
    free(z), free(out), free(want), free(out_f32);
    f32.ops->layer_free(f32.ctx, lf);
    serving.ops->layer_free(serving.ctx, ls);
    codec_close(&f32);
    codec_close(&serving);
    build_free(&b);
}

static void test_e4m3(void **state) {
    (void)state;
    check_codec(TMX_TRELLIS_CODEC_E4M3, 3);
}

static void test_fp4(void **state) {
    (void)state;
    check_codec(TMX_TRELLIS_CODEC_FP4, 4);
}

static void test_pair(void **state) {
    (void)state;
    check_codec(TMX_TRELLIS_CODEC_PAIR, 3);
}

/* Threads lent to the codec (tmx_codec_i.use_threads), as a kernel set would lend them: three
 * threads, items run last first with the thread index going round, every call counted. */
struct lent_threads {
    int calls;
    int64_t items;
};

static void lent_run(void *pool, int64_t n_items, tmx_threads_fn fn, void *arg) {
    struct lent_threads *t = pool;
    t->calls++;
    t->items += n_items;
    for (int64_t i = n_items - 1; i >= 0; i--) fn(arg, i, (int)(i % 3));
}

/* 1 and 2 threads give the same bits; so do steps cut into token chunks (the codec's buffer
 * budget lowered in-process), a slice of the tokens run alone, and threads a kernel set
 * lends. */
static void test_threads(void **state) {
    (void)state;
    enum { N = 300, SLICE0 = 250, SLICE = 40 };
    struct build b;
    build_make(&b, TMX_TRELLIS_CODEC_E4M3, 3);
    struct codec one, two;
    assert_int_equal(codec_open(&one, b.spec->name, "1", "serving", NULL), TMX_OK);
    assert_int_equal(codec_open(&two, b.spec->name, "2", "serving", NULL), TMX_OK);
    void *l1 = layer_load(&one, &b), *l2 = layer_load(&two, &b);
    float *z = malloc(sizeof(float) * N * LAT), *o1 = malloc(sizeof(float) * N * LAT),
          *o2 = malloc(sizeof(float) * N * LAT), post[LAT], rw[N * TOPK];
    int32_t ids[N * TOPK];
    for (int i = 0; i < N * LAT; i++) z[i] = 2.0f * uniform() - 1.0f;
    for (int i = 0; i < LAT; i++) post[i] = 0.5f + uniform();
    route(N, ids, rw);
    const struct tmx_tensor norm = {TMX_DTYPE_F32, 1, {LAT}, post};
    assert_int_equal(one.ops->moe_experts(one.ctx, l1, o1, z, ids, rw, N, TOPK, &norm, 1e-6f, NULL),
                     TMX_OK);
    assert_int_equal(two.ops->moe_experts(two.ctx, l2, o2, z, ids, rw, N, TOPK, &norm, 1e-6f, NULL),
                     TMX_OK);
    assert_memory_equal(o1, o2, sizeof(float) * N * LAT);
    assert_int_equal(two.ops->moe_experts(two.ctx, l2, o2, z + SLICE0 * LAT, ids + SLICE0 * TOPK,
                                          rw + SLICE0 * TOPK, SLICE, TOPK, &norm, 1e-6f, NULL),
                     TMX_OK);
    assert_memory_equal(o1 + SLICE0 * LAT, o2, sizeof(float) * SLICE * LAT);

    struct lent_threads lent = {0};
    two.ops->use_threads(two.ctx, &(struct tmx_threads){&lent, 3, lent_run});
    memset(o2, 0, sizeof(float) * N * LAT);
    assert_int_equal(two.ops->moe_experts(two.ctx, l2, o2, z, ids, rw, N, TOPK, &norm, 1e-6f, NULL),
                     TMX_OK);
    assert_memory_equal(o1, o2, sizeof(float) * N * LAT);
    assert_int_equal(lent.calls, 5); /* the five phases of one chunk, all on the lent threads */
    assert_true(lent.items >= 2 * N);

    /* the library linked into this test, on a budget of about 20 tokens a chunk (the
     * buffers of all 300 would take 5.5 MiB) */
    struct trellis_codec *c;
    assert_int_equal(trellis_codec_new(tmx_host_get(), TMX_TRELLIS_CODEC_E4M3, 2, 1, &c), TMX_OK);
    c->budget = 400 << 10;
    const struct tmx_codec_layer_info info = {b.dir, LAYER, E, LAT, INTER};
    void *lc = NULL;
    assert_int_equal(tmx_trellis_codec_layer_load(c, &info, &lc, NULL), TMX_OK);
    memset(o2, 0, sizeof(float) * N * LAT);
    assert_int_equal(tmx_trellis_codec_moe_experts(c, lc, o2, z, ids, rw, N, TOPK, &norm, 1e-6f,
                                                   NULL), TMX_OK);
    assert_true(c->scratch_size <= c->budget);
    assert_memory_equal(o1, o2, sizeof(float) * N * LAT);
    tmx_trellis_codec_layer_free(c, lc);
    tmx_trellis_codec_fini(c);

    free(z), free(o1), free(o2);
    one.ops->layer_free(one.ctx, l1);
    two.ops->layer_free(two.ctx, l2);
    codec_close(&one);
    codec_close(&two);
    build_free(&b);
}

/* layer_load of b must fail with a message holding `what1` and `what2`. */
static void expect_refused(struct codec *c, const struct build *b, const char *what1,
                           const char *what2) {
    const struct tmx_codec_layer_info info = {b->dir, LAYER, E, LAT, INTER};
    void *layer = NULL;
    char *err = NULL;
    assert_int_not_equal(c->ops->layer_load(c->ctx, &info, &layer, &err), TMX_OK);
    assert_null(layer);
    assert_non_null(err);
    if (!strstr(err, what1) || !strstr(err, what2))
        fail_msg("message \"%s\" does not name %s and %s", err, what1, what2);
    print_message("refused: %s\n", err);
    free(err);
}

static void test_damaged(void **state) {
    (void)state;
    struct build b;
    build_make(&b, TMX_TRELLIS_CODEC_E4M3, 3);
    struct codec c;
    assert_int_equal(codec_open(&c, "trellis-e4m3", "1", "serving", NULL), TMX_OK);
    c.ops->layer_free(c.ctx, layer_load(&c, &b)); /* intact, it loads */

    write_chunk(&b, 1, SHORT_TRELLIS);
    expect_refused(&c, &b, "experts/layer-007-008-015.safetensors", "up_proj.trellis");
    write_chunk(&b, 1, INTACT);

    char path[128];
    snprintf(path, sizeof path, "%s/experts/layer-007-016-019.safetensors", b.dir);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, sb.st_size - 100), 0);
    expect_refused(&c, &b, "experts/layer-007-016-019.safetensors", "");
    write_chunk(&b, 2, INTACT);

    write_chunk(&b, 0, CSF_POSITION);
    expect_refused(&c, &b, "experts/layer-007-000-007.safetensors", "down_proj.scale_csf");
    write_chunk(&b, 0, STARTS);
    expect_refused(&c, &b, "experts/layer-007-000-007.safetensors", "up_proj.scale_csf_starts");
    write_chunk(&b, 0, META_LAYER);
    expect_refused(&c, &b, "experts/layer-007-000-007.safetensors", "\"layer\"");
    write_chunk(&b, 0, INTACT);

    snprintf(path, sizeof path, "%s/experts/layer-007-016-019.safetensors", b.dir);
    char moved[160];
    snprintf(moved, sizeof moved, "%s/experts/layer-007-016-020.safetensors", b.dir);
    assert_int_equal(rename(path, moved), 0); /* not the name the rule gives */
    expect_refused(&c, &b, "experts/layer-007-016-019.safetensors", "");
    assert_int_equal(rename(moved, path), 0);

    snprintf(path, sizeof path, "%s/coupled/layer-007.safetensors", b.dir);
    assert_int_equal(unlink(path), 0);
    expect_refused(&c, &b, "coupled/layer-007.safetensors", "");
    write_coupled(&b);

    /* hf_quant_config.json: each field out of §10.4's table */
    static const struct {
        const char *key, *json; /* json NULL: remove the field */
    } bad[] = {
        {"bits", "9"}, {"bits", "\"3\""}, {"block_size", "16"}, {"law", "\"e2m1\""},
        {"codec", "\"trellis-fp4\""}, {"activation", "\"nvfp4-token\""},
        {"trellismx_version", "2"}, {"quant_method", "\"int8\""}, {"hadamard_block", "64"},
        {"experts_per_file", "0"}, {"alpha", "0.5625"}, {"mxfp8_tensors", "[1]"},
        {"experts_per_file", NULL}, {"mxfp8_tensors", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *q = quant_config(&b);
        if (bad[i].json)
            json_object_set_new(q, bad[i].key, json_loads(bad[i].json, JSON_DECODE_ANY, NULL));
        else
            json_object_del(q, bad[i].key);
        write_json(&b, q);
        json_decref(q);
        char field[32];
        snprintf(field, sizeof field, "\"%s\"", bad[i].key);
        expect_refused(&c, &b, "hf_quant_config.json", field);
    }
    codec_close(&c);

    /* law e2m1: alpha is required, and a binary32 number */
    struct build b4 = b;
    b4.id = TMX_TRELLIS_CODEC_FP4;
    b4.spec = tmx_trellis_codec_spec(b4.id);
    assert_int_equal(codec_open(&c, "trellis-fp4", "1", "serving", NULL), TMX_OK);
    json_t *q = quant_config(&b4);
    json_object_set_new(q, "alpha", json_real(0.1));
    write_json(&b4, q);
    expect_refused(&c, &b4, "hf_quant_config.json", "\"alpha\"");
    json_object_del(q, "alpha");
    write_json(&b4, q);
    expect_refused(&c, &b4, "hf_quant_config.json", "\"alpha\"");
    json_decref(q);
    codec_close(&c);
    build_free(&b);

}

/* The options: threads defaults to the core key `threads`; an unknown activations value is
 * refused by init, naming the option. */
static void test_options(void **state) {
    (void)state;
    struct tmx_config *cfg;
    struct tmx_plugins *ps;
    const struct tmx_plugin *p;
    assert_int_equal(tmx_config_load(NULL, &cfg, NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "plugin_dir=" TMX_BIN_DIR, NULL), TMX_OK);
    assert_int_equal(tmx_config_set(cfg, "threads=3", NULL), TMX_OK);
    assert_int_equal(tmx_plugins_new(cfg, &ps, NULL), TMX_OK);
    assert_int_equal(tmx_plugins_load(ps, TMX_PLUGIN_CODEC, "trellis-fp4", &p, NULL), TMX_OK);
    assert_int_equal(tmx_opts_int(tmx_plugins_opts(ps, p), "threads"), 3);
    assert_string_equal(tmx_opts_str(tmx_plugins_opts(ps, p), "activations"), "serving");
    tmx_plugins_free(ps);
    tmx_config_free(cfg);

    char *err = NULL;
    struct codec c;
    assert_int_not_equal(codec_open(&c, "trellis-e4m3", "1", "int8", &err), TMX_OK);
    if (!strstr(err, "activations")) fail_msg("message \"%s\" does not name the option", err);
    free(err);
    codec_close(&c);
}

/* The plugin's own encoder (layer_encode, quant_config) and its reader agree: a layer of
 * Gaussian weights encoded and loaded back decodes to them within the K = 3 error. */
static void test_encoded_layer(void **state) {
    (void)state;
    enum { NE = 2, L2 = 128, I2 = 128 };
    for (int id = 0; id < 2; id++) {
        const struct tmx_trellis_codec_spec *spec = tmx_trellis_codec_spec(id);
        struct codec c;
        assert_int_equal(codec_open(&c, spec->name, "2", "f32", NULL), TMX_OK);
        static float w[3][NE][L2 * I2];
        const float *pw[3][NE];
        for (int p = 0; p < 3; p++)
            for (int e = 0; e < NE; e++) {
                for (int i = 0; i < L2 * I2; i++) { /* sum of uniforms: near-Gaussian */
                    const float u = uniform() + uniform() + uniform() + uniform() - 2.0f;
                    w[p][e][i] = 0.05f * u;
                }
                pw[p][e] = w[p][e];
            }
        char dir[] = "/tmp/tmx-codec-enc-XXXXXX", path[96], cfg[512];
        assert_non_null(mkdtemp(dir));
        const int64_t n_tok[NE] = {0, 0};
        const double *no_h[NE] = {NULL, NULL};
        const struct tmx_codec_encode_job job = {
            .out_dir = dir, .layer = 3, .n_experts = NE, .latent = L2, .inter = I2,
            .gate = pw[0], .up = pw[1], .down = pw[2], .h_in = no_h, .h_mid = no_h,
            .n_tokens = n_tok, .bits = 3, .n_threads = 2};
        char *err = NULL;
        if (c.ops->layer_encode(c.ctx, &job, &err) != TMX_OK) fail_msg("%s", err);
        const int n = c.ops->quant_config(c.ctx, 3, cfg, sizeof cfg);
        assert_true(n > 0 && n < (int)sizeof cfg);
        json_t *q = json_loads(cfg, 0, NULL);
        assert_non_null(q);
        json_object_set_new(q, "quant_method", json_string("trellismx"));
        json_object_set_new(q, "codec", json_string(spec->name));
        json_object_set_new(q, "mxfp8_tensors", json_array());
        snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
        assert_int_equal(json_dump_file(q, path, 0), 0);
        json_decref(q);

        const struct tmx_codec_layer_info info = {dir, 3, NE, L2, I2};
        void *layer = NULL;
        if (c.ops->layer_load(c.ctx, &info, &layer, &err) != TMX_OK) fail_msg("%s", err);
        static float back[L2 * I2];
        for (int p = 0; p < 3; p++)
            for (int e = 0; e < NE; e++) {
                assert_int_equal(c.ops->expert_decode(c.ctx, layer, e, p, back, NULL), TMX_OK);
                double se = 0.0, sw = 0.0;
                for (int i = 0; i < L2 * I2; i++) {
                    se += (back[i] - w[p][e][i]) * (double)(back[i] - w[p][e][i]);
                    sw += (double)w[p][e][i] * w[p][e][i];
                }
                print_message("%s expert %d %s: relative squared error %.4f\n", spec->name, e,
                              proj_name[p], se / sw);
                assert_true(se / sw < 0.03);
            }
        c.ops->layer_free(c.ctx, layer);
        codec_close(&c);
        snprintf(path, sizeof path, "rm -rf '%s'", dir);
        assert_int_equal(system(path), 0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tile_operands),
        cmocka_unit_test(test_e4m3),
        cmocka_unit_test(test_fp4),
        cmocka_unit_test(test_pair),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_damaged),
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_encoded_layer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
