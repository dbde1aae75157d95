/* test_encode.c: the TrellisMX encoder (plugins/trellis/encode.c, ldlq.c).
 *
 * - Rotations: a matrix and its Hessian rotated alike keep tr(W H W^T); the proxy error is
 *   tr(E H E^T) / tr(W H W^T).
 * - LDLQ: on inputs with correlated features, coding with the Hessian's feedback gives a lower
 *   proxy error tr(E H E^T) / tr(W H W^T) than coding each tile for plain squared error.
 * - The stream is what the decoder reads: the encoder's reconstruction equals
 *   tmx_trellis_matrix_operands of the words, scales and g it wrote, bit for bit.
 * - A whole layer: the files of §10.2/§10.3 with their tensors, shapes and metadata, the CSF
 *   scales expanding losslessly, and every expert decoding to its weights within the proxy
 *   error the encoder reported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <math.h>

#include "encode.h"
#include "tmx/loader.h"
#include "tmx/safetensors.h"

enum { N = 128, T = 512 }; /* matrix side, calibration inputs */

/* x[T][N]: AR(1) features (rho = 0.95) plus a shared factor, so that inputs are strongly
 * correlated, as real activations are. */
static void correlated_inputs(uint64_t seed, float *x) {
    float g[N + 1];
    for (int t = 0; t < T; t++) {
        tmx_trellis_gauss_fill(&seed, g, N + 1);
        float prev = g[0];
        for (int i = 0; i < N; i++) {
            prev = 0.95f * prev + 0.31f * g[i + 1];
            x[t * N + i] = prev + 0.5f * g[0];
        }
    }
}

static void hessian(const float *x, double *h) {
    memset(h, 0, sizeof(double) * N * N);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++) h[i * N + j] += (double)x[t * N + i] * x[t * N + j];
}

static double trace_whw(const float *w, const double *h) {
    double s = 0.0;
    for (int r = 0; r < N; r++)
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++) s += w[r * N + i] * h[i * N + j] * w[r * N + j];
    return s;
}

static void test_rotations_agree(void **state) {
    (void)state;
    float *x = malloc(sizeof(float) * T * N), *w = malloc(sizeof(float) * N * N);
    double *h = malloc(sizeof(double) * N * N);
    uint8_t s_in[N / 8], s_out[N / 8];
    uint64_t seed = 5;
    correlated_inputs(11, x);
    hessian(x, h);
    tmx_trellis_gauss_fill(&seed, w, N * N);
    tmx_trellis_signs_random(1, s_in, N);
    tmx_trellis_signs_random(2, s_out, N);
    const double before = trace_whw(w, h);
    tmx_trellis_rotate_matrix(w, N, N, s_out, s_in);
    tmx_trellis_rotate_hessian(h, N, s_in);
    assert_true(fabs(trace_whw(w, h) - before) <= 1e-5 * before);
    free(x), free(w), free(h);
}

/* Codes w[N][N] (rotated basis) with feedback a (or none) and returns the proxy under h; also
 * checks that the reconstruction is what the decoder computes from the stream. */
static double encode_proxy(const struct tmx_trellis_law *law, const float *w, const double *a,
                           const double *h) {
    const int K = 3, block = tmx_trellis_law_block(law->id);
    struct tmx_trellis_viterbi *vit;
    assert_int_equal(tmx_trellis_viterbi_new(law, K, &vit, NULL), TMX_OK);
    uint32_t *words = malloc(sizeof(uint32_t) * N * N / 256 * 8 * K);
    uint8_t *scales = malloc(N * N / block);
    float *q = malloc(sizeof(float) * N * N), *dec = malloc(sizeof(float) * N * N);
    struct tmx_trellis_encode_io io = {.rows = N, .cols = N, .w = w, .a = a, .words = words,
                                       .scales = scales, .q = q};
    assert_int_equal(tmx_trellis_matrix_encode(vit, law, K, &io, NULL), TMX_OK);
    const struct tmx_trellis_matrix m = {law, K, block, N, N, words, scales, io.scale, NULL, NULL};
    assert_int_equal(tmx_trellis_matrix_check(&m, NULL), TMX_OK);
    tmx_trellis_matrix_operands(&m, dec);
    assert_memory_equal(dec, q, sizeof(float) * N * N);
    double proxy;
    assert_int_equal(tmx_trellis_proxy_error(w, q, N, N, h, &proxy, NULL), TMX_OK);
    tmx_trellis_viterbi_free(vit);
    free(words), free(scales), free(q), free(dec);
    return proxy;
}

static void test_ldlq_beats_plain(void **state) {
    (void)state;
    float *x = malloc(sizeof(float) * T * N), *w = malloc(sizeof(float) * N * N);
    double *h = malloc(sizeof(double) * N * N), *a = malloc(sizeof(double) * N * N), lambda;
    uint64_t seed = 9;
    correlated_inputs(3, x);
    hessian(x, h);
    tmx_trellis_gauss_fill(&seed, w, N * N);
    assert_int_equal(tmx_trellis_ldlq_factor(h, N, a, &lambda, NULL), TMX_OK);
    assert_true(lambda > 0.0);
    for (int i = 0; i < N; i++) /* strictly block-lower */
        for (int j = i / 16 * 16; j < N; j++) assert_true(a[i * N + j] == 0.0);
    for (int l = 0; l < 2; l++) {
        struct tmx_trellis_law law;
        assert_int_equal(tmx_trellis_law_init(&law, (enum tmx_trellis_law_id)l, 0.5625f, NULL),
                         TMX_OK);
        const double with = encode_proxy(&law, w, a, h), plain = encode_proxy(&law, w, NULL, h);
        const double mse = encode_proxy(&law, w, NULL, NULL);
        print_message("law %s: proxy with LDLQ %.5f, without %.5f; plain relative MSE %.5f\n",
                      tmx_trellis_law_name(law.id), with, plain, mse);
        assert_true(with < 0.7 * plain);
        assert_true(mse < 0.03); /* K = 3 on Gaussian weights: about the Gaussian figure */
    }
    free(x), free(w), free(h), free(a);
}

static void test_proxy_error(void **state) {
    (void)state;
    float *x = malloc(sizeof(float) * T * N), *w = malloc(sizeof(float) * N * N),
          *q = malloc(sizeof(float) * N * N), *e = malloc(sizeof(float) * N * N);
    double *h = malloc(sizeof(double) * N * N), got;
    uint64_t seed = 13;
    correlated_inputs(17, x);
    hessian(x, h);
    tmx_trellis_gauss_fill(&seed, w, N * N);
    tmx_trellis_gauss_fill(&seed, q, N * N);
    for (int i = 0; i < N * N; i++) q[i] = w[i] + 0.1f * q[i], e[i] = w[i] - q[i];
    assert_int_equal(tmx_trellis_proxy_error(w, q, N, N, h, &got, NULL), TMX_OK);
    const double want = trace_whw(e, h) / trace_whw(w, h);
    assert_true(fabs(got - want) <= 1e-9 * want);
    assert_int_equal(tmx_trellis_proxy_error(w, w, N, N, h, &got, NULL), TMX_OK);
    assert_true(got == 0.0);
    free(x), free(w), free(q), free(e), free(h);
}

static void test_ldlq_rejects(void **state) {
    (void)state;
    double h[16 * 16] = {0}, a[16 * 16], lambda;
    char *err = NULL;
    assert_int_equal(tmx_trellis_ldlq_factor(h, 16, a, &lambda, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "no inputs"));
    free(err), err = NULL;
    h[0] = NAN;
    assert_int_equal(tmx_trellis_ldlq_factor(h, 16, a, &lambda, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "not finite"));
    free(err);
}

/* --- a whole layer ------------------------------------------------------------------------- */

enum { E = 3, LAT = 128, INTER = 256, K3 = 3 };

static void expect_tensor(const struct tmx_safetensors *st, const char *name, enum tmx_dtype dt,
                          int ndim, const int64_t *shape, struct tmx_tensor *t) {
    if (tmx_safetensors_find(st, name, t) != 0) fail_msg("tensor %s is missing", name);
    assert_int_equal(t->dtype, dt);
    assert_int_equal(t->ndim, ndim);
    for (int d = 0; d < ndim; d++) assert_int_equal(t->shape[d], shape[d]);
}

static void test_layer_files(void **state) {
    (void)state;
    char dir[] = "/tmp/tmx-encode-XXXXXX", path[512];
    assert_non_null(mkdtemp(dir));
    float *w[3][E];
    double *h_in[E], *h_mid[E], proxy[E][3];
    int64_t n_tok[E] = {T, 0, T};
    uint64_t seed = 21;
    float *x = malloc(sizeof(float) * T * INTER);
    for (int e = 0; e < E; e++) {
        for (int p = 0; p < 3; p++) {
            w[p][e] = malloc(sizeof(float) * LAT * INTER);
            tmx_trellis_gauss_fill(&seed, w[p][e], LAT * INTER);
            for (int i = 0; i < LAT * INTER; i++) w[p][e][i] *= 0.05f * (float)(e + 1);
        }
        h_in[e] = calloc(LAT * LAT, sizeof(double));
        h_mid[e] = calloc((size_t)INTER * INTER, sizeof(double));
        tmx_trellis_gauss_fill(&seed, x, T * INTER);
        for (int t = 0; t < T && n_tok[e]; t++)
            for (int i = 0; i < INTER; i++)
                for (int j = 0; j < INTER; j++) {
                    const double v = (double)x[t * INTER + i] * x[t * INTER + j];
                    h_mid[e][i * INTER + j] += v;
                    if (i < LAT && j < LAT) h_in[e][i * LAT + j] += v;
                }
    }
    const double *hi[E] = {h_in[0], NULL, h_in[2]}, *hm[E] = {h_mid[0], NULL, h_mid[2]};
    const struct tmx_codec_encode_job job = {
        .out_dir = dir, .layer = 7, .n_experts = E, .latent = LAT, .inter = INTER,
        .gate = (const float *const *)w[0], .up = (const float *const *)w[1],
        .down = (const float *const *)w[2], .h_in = hi, .h_mid = hm, .n_tokens = n_tok,
        .bits = K3, .n_threads = 2, .proxy_err = &proxy[0][0]};

    for (int l = 0; l < 2; l++) {
        const enum tmx_trellis_law_id id = (enum tmx_trellis_law_id)l;
        const int block = tmx_trellis_law_block(id);
        char *err = NULL;
        if (tmx_trellis_layer_encode(tmx_host_get(), id, 0.5625f, &job, &err) != TMX_OK)
            fail_msg("%s", err);
        struct tmx_trellis_law law;
        assert_int_equal(tmx_trellis_law_init(&law, id, 0.5625f, NULL), TMX_OK);

        struct tmx_safetensors *cp, *ex;
        snprintf(path, sizeof path, "%s/coupled/layer-007.safetensors", dir);
        assert_int_equal(tmx_safetensors_open(path, &cp, NULL), TMX_OK);
        assert_string_equal(tmx_safetensors_meta(cp, "format"), "trellismx-coupled");
        assert_string_equal(tmx_safetensors_meta(cp, "layer"), "7");
        struct tmx_tensor sv[3];
        const int64_t lat8 = LAT / 8, inter8 = INTER / 8;
        expect_tensor(cp, "sign_latent_in", TMX_DTYPE_U8, 1, &lat8, &sv[0]);
        expect_tensor(cp, "sign_intermediate", TMX_DTYPE_U8, 1, &inter8, &sv[1]);
        expect_tensor(cp, "sign_latent_out", TMX_DTYPE_U8, 1, &lat8, &sv[2]);
        uint8_t want[INTER / 8];
        tmx_trellis_signs_random(tmx_trellis_sign_seed(7, 1), want, INTER);
        assert_memory_equal(sv[1].data, want, INTER / 8);

        snprintf(path, sizeof path, "%s/experts/layer-007-000-002.safetensors", dir);
        assert_int_equal(tmx_safetensors_open(path, &ex, NULL), TMX_OK);
        assert_string_equal(tmx_safetensors_meta(ex, "format"), "trellismx-experts");
        assert_string_equal(tmx_safetensors_meta(ex, "trellismx_version"), "1");
        assert_string_equal(tmx_safetensors_meta(ex, "first_expert"), "0");
        assert_string_equal(tmx_safetensors_meta(ex, "last_expert"), "2");
        static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
        for (int p = 0; p < 3; p++) {
            const int64_t rows = p < 2 ? INTER : LAT, cols = p < 2 ? LAT : INTER;
            const int64_t fixed = tmx_trellis_csf_fixed_size(rows, cols / block);
            char name[64];
            struct tmx_tensor tw, tg, tc, tx, ts;
            const int64_t sw[4] = {E, rows / 16, cols / 16, 8 * K3}, se[1] = {E},
                          sc[2] = {E, fixed}, ss[1] = {E + 1};
            snprintf(name, sizeof name, "%s.trellis", proj[p]);
            expect_tensor(ex, name, TMX_DTYPE_I32, 4, sw, &tw);
            snprintf(name, sizeof name, "%s.scale", proj[p]);
            expect_tensor(ex, name, TMX_DTYPE_F32, 1, se, &tg);
            snprintf(name, sizeof name, "%s.scale_csf", proj[p]);
            expect_tensor(ex, name, TMX_DTYPE_U8, 2, sc, &tc);
            snprintf(name, sizeof name, "%s.scale_csf_starts", proj[p]);
            expect_tensor(ex, name, TMX_DTYPE_I32, 1, ss, &ts);
            snprintf(name, sizeof name, "%s.scale_csf_exceptions", proj[p]);
            assert_int_equal(tmx_safetensors_find(ex, name, &tx), 0);
            const int32_t *starts = ts.data;
            assert_int_equal(tmx_trellis_csf_check_starts(name, starts, E, tx.shape[0], NULL),
                             TMX_OK);
            uint8_t *scales = malloc((size_t)(rows * cols / block));
            float *dec = malloc(sizeof(float) * (size_t)(rows * cols));
            for (int e = 0; e < E; e++) {
                char *err2 = NULL;
                if (tmx_trellis_csf_decode(name, (const uint8_t *)tc.data + e * fixed, fixed,
                                           (const uint32_t *)tx.data + starts[e],
                                           starts[e + 1] - starts[e], rows, cols / block, scales,
                                           &err2) != TMX_OK)
                    fail_msg("%s", err2);
                const struct tmx_trellis_matrix m = {
                    &law, K3, block, rows, cols,
                    (const uint32_t *)tw.data + e * (rows * cols / 256) * 8 * K3, scales,
                    ((const float *)tg.data)[e], sv[p < 2 ? 0 : 1].data,
                    sv[p < 2 ? 1 : 2].data};
                assert_int_equal(tmx_trellis_matrix_check(&m, NULL), TMX_OK);
                tmx_trellis_matrix_dequant(&m, dec);
                double se2 = 0.0, sw2 = 0.0;
                for (int64_t i = 0; i < rows * cols; i++) {
                    se2 += (dec[i] - w[p][e][i]) * (double)(dec[i] - w[p][e][i]);
                    sw2 += (double)w[p][e][i] * w[p][e][i];
                }
                /* the relative error is the proxy where the Hessian is the identity (expert 1),
                 * and of the same size elsewhere */
                if (e == 1) assert_true(fabs(se2 / sw2 - proxy[e][p]) < 1e-4);
                assert_true(se2 / sw2 < 0.05);
                assert_true(proxy[e][p] > 0.0 && proxy[e][p] < 0.05);
            }
            free(scales);
            free(dec);
        }
        tmx_safetensors_free(ex);
        tmx_safetensors_free(cp);
    }
    for (int e = 0; e < E; e++) {
        for (int p = 0; p < 3; p++) free(w[p][e]);
        free(h_in[e]);
        free(h_mid[e]);
    }
    free(x);
    snprintf(path, sizeof path, "rm -rf '%s'", dir);
    assert_int_equal(system(path), 0);
}

static void test_quant_config(void **state) {
    (void)state;
    char buf[512];
    assert_true(tmx_trellis_quant_config(TMX_TRELLIS_LAW_E2M1, 0.5625f, 3, buf, sizeof buf) > 0);
    assert_string_equal(buf, "{\"trellismx_version\": 1, \"law\": \"e2m1\", \"bits\": 3, "
                             "\"alpha\": 0.5625, \"block_size\": 16, \"activation\": "
                             "\"nvfp4-token\", \"hadamard_block\": 128, \"experts_per_file\": 32}");
    assert_true(tmx_trellis_quant_config(TMX_TRELLIS_LAW_E4M3, 1.0f, 4, buf, sizeof buf) > 0);
    assert_null(strstr(buf, "alpha"));
    assert_non_null(strstr(buf, "\"block_size\": 32, \"activation\": \"e4m3-token\""));
    assert_int_equal(tmx_trellis_quant_config(TMX_TRELLIS_LAW_E4M3, 1.0f, 7, buf, sizeof buf),
                     -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rotations_agree),
        cmocka_unit_test(test_ldlq_beats_plain),
        cmocka_unit_test(test_proxy_error),
        cmocka_unit_test(test_ldlq_rejects),
        cmocka_unit_test(test_layer_files),
        cmocka_unit_test(test_quant_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
