/* trellis_gpu_bench.c: trellis-gpu-bench, the codecs' device path on a GPU, for
 * docs/perf/h200-codec.md.
 *
 *     trellis-gpu-bench [--sweep | --checks] OUT.json
 *
 * --sweep runs only 1 and the matmul-alone sweep of 5 (a short run to time or profile the
 * decode loop); --checks only 1 to 4 (short enough for compute-sanitizer).
 * 1. Copy bandwidth: cudaMemcpy device to device, bytes read + written per second.
 * 2. Decode: random tiles (and all-zero, all-one ones) of every K and both laws decoded by
 *    the device's lanes into their operand bytes, compared with the CPU decoder bit for bit.
 * 3. Matmul: the fused matmul against the CPU's y = g a sum (B . C) x in double, for a small
 *    matrix the Viterbi encoder wrote and random streams of every K, at 1 to 200 tokens.
 * 4. Expert block: the codec's device_moe_experts against its host moe_experts.
 * 5. Timing at the full-size shapes (latent = inter = 4096, 8 routed experts, K = 3):
 *    the expert block at 1 token (GEMV) and at 16 to 256 tokens per expert (grouped GEMM),
 *    per phase; cuBLASLt BF16 and FP8 GEMMs of the same shapes in the same run.
 * Any bit pattern is a valid trellis stream (§3), so the timed layers are random words and
 * block scales; only the small correctness cases use the encoder. Prints a table last and
 * exits 1 if a check fails. */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec_impl.h"
#include "reference.h"
#include "trellis_cuda.h"

#define MATMUL_TOL 1e-3 /* relative L2 error of the fused matmul against the CPU in double */
#define BLOCK_TOL 1e-3  /* relative L2 error of the device expert block against the host's */
#define REPS 20

#define CK(x) check_cuda((x), #x, __LINE__)
static void check_cuda(cudaError_t e, const char *what, int line) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "trellis-gpu-bench:%d: %s: %s\n", line, what, cudaGetErrorString(e));
    exit(2);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "trellis-gpu-bench: out of memory\n");
        exit(2);
    }
    return p;
}

static void *dev_copy(const void *host, size_t n) {
    void *d;
    CK(cudaMalloc(&d, n ? n : 1));
    if (n) CK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    return d;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}

/* --- JSON and the closing table ------------------------------------------------------------ */

static char json[1 << 18], table[1 << 14];
static size_t json_len, table_len;
static int failures;

__attribute__((format(printf, 1, 2))) static void jprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    json_len += (size_t)vsnprintf(json + json_len, sizeof json - json_len, fmt, ap);
    va_end(ap);
}

__attribute__((format(printf, 1, 2))) static void tprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    table_len += (size_t)vsnprintf(table + table_len, sizeof table - table_len, fmt, ap);
    va_end(ap);
}

static const char *law_name(int fp4) { return fp4 ? "e2m1" : "e4m3"; }

/* --- 1. copy bandwidth --------------------------------------------------------------------- */

static float elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

static double copy_bandwidth(cudaStream_t s) {
    const size_t bytes = (size_t)1 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < REPS; i++) CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    const double gbs = 2.0 * bytes * REPS / (elapsed(e0, e1) * 1e-3) / 1e9;
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return gbs;
}

/* --- 2. decode ----------------------------------------------------------------------------- */

static void law_init(struct tmx_trellis_law *law, int fp4) {
    if (tmx_trellis_law_init(law, fp4 ? TMX_TRELLIS_LAW_E2M1 : TMX_TRELLIS_LAW_E4M3,
                             TMX_TRELLIS_ALPHA, NULL) != TMX_OK)
        exit(2);
}

/* law e2m1's sigma -> E4M3 byte table, as codec_device.c builds it. */
static void law_lut(const struct tmx_trellis_law *law, uint8_t lut[1024]) {
    memset(lut, 0, 1024);
    for (int s = 0; s < TMX_TRELLIS_SIGMAS; s++)
        lut[s] = law->id == TMX_TRELLIS_LAW_E2M1 ? trellis_ref_e2m1_as_e4m3(law->code[s])
                                                 : law->code[s];
}

/* Law e4m3, law e2m1 as f16 operands, and law e2m1 as the native FP4 form's codes. */
static void check_decode(cudaStream_t s) {
    enum { TILES = 16384 };
    static const int forms[3] = {0, 1, 1 | TRELLIS_CUDA_NATIVE_FP4};
    jprintf("\"decode\": [");
    tprintf("\ndecode, device lanes vs CPU reference, %d tiles each:\n", TILES);
    for (int f = 0; f < 3; f++) {
        const int fp4 = forms[f] & 1;
        const char *form = f == 2 ? "fp4-mma" : "f16";
        struct tmx_trellis_law law;
        law_init(&law, fp4);
        uint8_t lut[1024];
        law_lut(&law, lut);
        tprintf("  %s %-7s:", law_name(fp4), form);
        for (int K = TMX_TRELLIS_K_MIN; K <= TMX_TRELLIS_K_MAX; K++) {
            const int nw = tmx_trellis_words(K);
            uint32_t *w = xmalloc((size_t)TILES * nw * 4);
            for (int i = 0; i < TILES * nw; i++) w[i] = rnd();
            for (int i = 0; i < nw; i++) { /* tile 0 all zeros, tile 1 all ones */
                w[i] = 0;
                w[nw + i] = 0xffffffffu;
            }
            uint8_t *want = xmalloc((size_t)TILES * 256), *got = xmalloc((size_t)TILES * 256);
            for (int t = 0; t < TILES; t++)
                trellis_ref_operands(&law, w + (size_t)t * nw, K, want + (size_t)t * 256);
            uint32_t *dw = dev_copy(w, (size_t)TILES * nw * 4);
            uint8_t *dout;
            CK(cudaMalloc((void **)&dout, (size_t)TILES * 256));
            char msg[256];
            if (trellis_cuda_decode_tiles(forms[f], K, lut, dw, TILES, dout, s, msg, sizeof msg)) {
                fprintf(stderr, "trellis-gpu-bench: %s\n", msg);
                exit(2);
            }
            CK(cudaMemcpy(got, dout, (size_t)TILES * 256, cudaMemcpyDeviceToHost));
            long bad = 0;
            for (size_t i = 0; i < (size_t)TILES * 256; i++) bad += got[i] != want[i];
            failures += bad != 0;
            jprintf("%s{\"law\": \"%s\", \"form\": \"%s\", \"K\": %d, \"tiles\": %d, "
                    "\"bytes_differing\": %ld}",
                    f || K > 2 ? ", " : "", law_name(fp4), form, K, TILES, bad);
            tprintf(" K%d %s", K, bad ? "DIFFERS" : "equal");
            CK(cudaFree(dw));
            CK(cudaFree(dout));
            free(w);
            free(want);
            free(got);
        }
        tprintf("\n");
    }
    jprintf("],\n");
}

/* --- 3. the fused matmul against the CPU ---------------------------------------------------- */

struct host_matrix {
    int fp4, K, rows, cols;
    uint32_t *words;
    uint8_t *scales;
    float g;
};

static struct host_matrix random_matrix(int fp4, int K, int rows, int cols) {
    const int block = fp4 ? 16 : 32;
    struct host_matrix m = {fp4, K, rows, cols, NULL, NULL, 1.0f / 64.0f};
    const size_t nw = (size_t)rows * cols / 256 * tmx_trellis_words(K),
                 ns = (size_t)rows * cols / block;
    m.words = xmalloc(nw * 4);
    m.scales = xmalloc(ns);
    for (size_t i = 0; i < nw; i++) m.words[i] = rnd();
    for (size_t i = 0; i < ns; i++) m.scales[i] = (uint8_t)(0x30 + rnd() % 16);
    return m;
}

/* A matrix the Viterbi encoder wrote for Gaussian targets (in code units, unit scales). */
static struct host_matrix encoded_matrix(int fp4, int K, int rows, int cols) {
    struct host_matrix m = random_matrix(fp4, K, rows, cols);
    struct tmx_trellis_law law;
    law_init(&law, fp4);
    struct tmx_trellis_viterbi *vit;
    if (tmx_trellis_viterbi_new(&law, K, &vit, NULL) != TMX_OK) exit(2);
    uint64_t seed = 7;
    float target[TMX_TRELLIS_TILE];
    for (int t = 0; t < rows * cols / 256; t++) {
        tmx_trellis_gauss_fill(&seed, target, TMX_TRELLIS_TILE);
        for (int i = 0; i < TMX_TRELLIS_TILE; i++) target[i] *= fp4 ? 1.7f : 0.93f;
        tmx_trellis_viterbi_encode(vit, target, m.words + (size_t)t * tmx_trellis_words(K));
    }
    tmx_trellis_viterbi_free(vit);
    return m;
}

/* Token rows quantized as §7 says: device bytes in kappa order, scales; and their values. */
struct host_acts {
    uint8_t *bytes; /* [m][cols] */
    float *a, *xb;  /* [m], [m][cols/16] */
    float *values;  /* [m][cols] */
};

static struct host_acts quantize_tokens(int fp4, const float *x, int m, int cols) {
    struct host_acts h = {xmalloc((size_t)m * cols), xmalloc((size_t)m * 4),
                          xmalloc((size_t)m * cols / 16 * 4), xmalloc((size_t)m * cols * 4)};
    uint8_t *codes = xmalloc((size_t)cols), *sb = xmalloc((size_t)cols / 16 + 1);
    for (int t = 0; t < m; t++) {
        const float *xt = x + (size_t)t * cols;
        float *v = h.values + (size_t)t * cols;
        if (!fp4) {
            h.a[t] = tmx_trellis_act_e4m3(xt, cols, codes);
            for (int c = 0; c < cols; c++) v[c] = tmx_e4m3_to_f32(codes[c]);
        } else {
            h.a[t] = tmx_trellis_act_nvfp4(xt, cols, codes, sb);
            uint8_t *nib = xmalloc((size_t)cols);
            for (int c = 0; c < cols; c++) nib[c] = codes[c / 2] >> (4 * (c & 1)) & 0xf;
            for (int b = 0; b < cols / 16; b++)
                h.xb[(size_t)t * (cols / 16) + b] = tmx_e4m3_to_f32(sb[b]);
            for (int c = 0; c < cols; c++) {
                v[c] = h.xb[(size_t)t * (cols / 16) + c / 16] * tmx_trellis_e2m1_to_f32(nib[c]);
                nib[c] = trellis_ref_e2m1_as_e4m3(nib[c]);
            }
            memcpy(codes, nib, (size_t)cols);
            free(nib);
        }
        trellis_ref_kappa(codes, cols, h.bytes + (size_t)t * cols);
    }
    free(codes);
    free(sb);
    return h;
}

static void acts_free(struct host_acts *h) {
    free(h->bytes);
    free(h->a);
    free(h->xb);
    free(h->values);
}

/* Relative L2 error of the device's y[m][rows] against the CPU's, in double. */
static double matmul_error(const struct host_matrix *hm, int m, int group, cudaStream_t s) {
    struct tmx_trellis_law law;
    law_init(&law, hm->fp4);
    uint8_t lut[1024];
    law_lut(&law, lut);
    const int rows = hm->rows, cols = hm->cols;
    float *x = xmalloc((size_t)m * cols * 4), *q = xmalloc((size_t)rows * cols * 4);
    uint64_t seed = 11 + (uint64_t)m;
    tmx_trellis_gauss_fill(&seed, x, (int64_t)m * cols);
    struct host_acts h = quantize_tokens(hm->fp4, x, m, cols);
    const struct tmx_trellis_matrix tm = {&law, hm->K, hm->fp4 ? 16 : 32, rows, cols,
                                          hm->words, hm->scales, 1.0f, NULL, NULL};
    tmx_trellis_matrix_operands(&tm, q); /* B . C, exact */

    const size_t nw = (size_t)rows * cols / 256 * tmx_trellis_words(hm->K);
    void *dw = dev_copy(hm->words, nw * 4), *ds = dev_copy(hm->scales, (size_t)rows * cols /
                                                                          (hm->fp4 ? 16 : 32));
    void *dg = dev_copy(&hm->g, 4), *dx = dev_copy(h.bytes, (size_t)m * cols),
         *da = dev_copy(h.a, (size_t)m * 4), *dxb = dev_copy(h.xb, (size_t)m * cols / 16 * 4),
         *dl = dev_copy(lut, 1024), *dy, *work = NULL;
    CK(cudaMalloc(&dy, (size_t)m * rows * 4));
    const size_t work_bytes = trellis_cuda_matmul_work(hm->fp4, 1, cols, m, group);
    if (work_bytes) CK(cudaMalloc(&work, work_bytes));
    char msg[256];
    if (trellis_cuda_matmul(hm->fp4, hm->K, dl, dw, ds, dg, 1, rows, cols, dx, da, dxb, m, group,
                            work, dy, s, msg, sizeof msg)) {
        fprintf(stderr, "trellis-gpu-bench: %s\n", msg);
        exit(2);
    }
    float *y = xmalloc((size_t)m * rows * 4);
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(y, dy, (size_t)m * rows * 4, cudaMemcpyDeviceToHost));
    double num = 0.0, den = 0.0;
    for (int t = 0; t < m; t++)
        for (int r = 0; r < rows; r++) {
            double sum = 0.0;
            for (int c = 0; c < cols; c++)
                sum += (double)q[(size_t)r * cols + c] * h.values[(size_t)t * cols + c];
            const double want = (double)hm->g * h.a[t] * sum, d = y[(size_t)t * rows + r] - want;
            num += d * d;
            den += want * want;
        }
    void *bufs[] = {dw, ds, dg, dx, da, dxb, dl, dy, work};
    for (int i = 0; i < 9; i++) CK(cudaFree(bufs[i]));
    acts_free(&h);
    free(x);
    free(q);
    free(y);
    return sqrt(num / den);
}

/* The matmul's error on hm at every case (printed when `print`), into the JSON list (*first:
 * none written yet) and *worst; frees hm's arrays. */
static void matmul_cases(struct host_matrix *hm, const char *data, int print, int *first,
                         double *worst, cudaStream_t s) {
    /* Every kernel: tokens, and the group (0: the expert block's pick), full and partial groups,
     * several a matrix, and groups with whole warps of MMA columns left empty; the wide GEMM in
     * both forms (wgmma on Hopper, and mma.sync); law e2m1's GEMV and grouped GEMM also in the
     * native FP4 form (emulated off Blackwell). */
    enum { NC = 23, SYNC = TRELLIS_CUDA_MMA_SYNC, NAT = TRELLIS_CUDA_NATIVE_FP4 };
    static const int tokens[NC] = {1,  8,  40, 67, 200, 40, 67, 200, 300, 40, 200, 300,
                                   40, 67, 200, 300, 40, 300, 1, 8, 40, 67, 200};
    static const int groups[NC] = {0, 0, 64, 64, 64, 128, 128, 128, 128, 256, 256, 256,
                                   128 | SYNC, 128 | SYNC, 128 | SYNC, 128 | SYNC,
                                   256 | SYNC, 256 | SYNC, 8 | NAT, 8 | NAT, 64 | NAT,
                                   64 | NAT, 64 | NAT};
    for (int i = 0; i < NC; i++) {
        const int size = groups[i] & ~TRELLIS_CUDA_FORMS;
        if (groups[i] & NAT && !hm->fp4) continue; /* the native form is law e2m1's */
        const char *form = trellis_cuda_matmul_form(hm->fp4, groups[i], tokens[i], 1);
        const double err = matmul_error(hm, tokens[i], groups[i], s);
        *worst = err > *worst ? err : *worst;
        failures += !(err <= MATMUL_TOL);
        jprintf("%s{\"law\": \"%s\", \"K\": %d, \"data\": \"%s\", \"rows\": %d, \"cols\": %d, "
                "\"tokens\": %d, \"group\": %d, \"form\": \"%s\", \"rel_err\": %.3e}",
                *first ? "" : ", ", law_name(hm->fp4), hm->K, data, hm->rows, hm->cols,
                tokens[i], size, form, err);
        *first = 0;
        if (print)
            tprintf("  %s K%d %-7s %dx%d, %3d tokens, group %3d %-8s: %.2e%s\n",
                    law_name(hm->fp4), hm->K, data, hm->rows, hm->cols, tokens[i], size, form,
                    err, err <= MATMUL_TOL ? "" : "  FAIL");
    }
    free(hm->words);
    free(hm->scales);
}

static void check_matmul(cudaStream_t s) {
    jprintf("\"matmul\": {\"tolerance\": %g, \"cases\": [", MATMUL_TOL);
    tprintf("\nfused matmul vs CPU (double), relative L2 error, tolerance %g:\n", MATMUL_TOL);
    int first = 1;
    double worst = 0.0;
    for (int fp4 = 0; fp4 < 2; fp4++)
        for (int K = 1; K <= TMX_TRELLIS_K_MAX; K++) { /* K = 1: the encoded matrix at K = 3 */
            struct host_matrix hm = K == 1 ? encoded_matrix(fp4, 3, 128, 256)
                                           : random_matrix(fp4, K, 512, 1024);
            matmul_cases(&hm, K == 1 ? "viterbi" : "random", K == 1 || K == 3, &first, &worst, s);
        }
    /* rows of fewer than 256 inputs, and a short last chunk after a full one */
    static const int short_shape[2][2] = {{128, 128}, {128, 384}};
    for (int fp4 = 0; fp4 < 2; fp4++)
        for (int sh = 0; sh < 2; sh++) {
            struct host_matrix hm = random_matrix(fp4, 3, short_shape[sh][0], short_shape[sh][1]);
            matmul_cases(&hm, "random", 1, &first, &worst, s);
        }
    jprintf("], \"worst\": %.3e},\n", worst);
    tprintf("  worst over both laws, K = 2..6, every case: %.2e\n", worst);
}

/* --- 4. the expert block: device path against the host path --------------------------------- */

static enum tmx_status bench_err(char **err, enum tmx_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("trellis-gpu-bench: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    if (err) *err = NULL;
    return st;
}

static const struct tmx_host host = {.struct_size = sizeof host, .err = bench_err};

/* A layer of n_experts random matrices, as layer_load would fill it. */
struct host_layer {
    struct trellis_layer l;
    struct host_matrix m[3 * 64];
    uint8_t signs[3][4096 / 8];
};

static void layer_make(struct host_layer *h, int fp4, int K, int E, int latent, int inter) {
    memset(&h->l, 0, sizeof h->l);
    h->l.n_experts = E;
    h->l.latent = latent;
    h->l.inter = inter;
    law_init(&h->l.law, fp4);
    for (int i = 0; i < 3; i++)
        for (size_t b = 0; b < sizeof h->signs[i]; b++) h->signs[i][b] = (uint8_t)rnd();
    h->l.sign_in = h->signs[0];
    h->l.sign_mid = h->signs[1];
    h->l.sign_out = h->signs[2];
    h->l.mat = xmalloc((size_t)E * 3 * sizeof *h->l.mat);
    for (int i = 0; i < 3 * E; i++) {
        const int p = i % 3, rows = p < 2 ? inter : latent, cols = p < 2 ? latent : inter;
        h->m[i] = random_matrix(fp4, K, rows, cols);
        h->m[i].g = 0.02f + 0.001f * (float)(i % 7);
        h->l.mat[i] = (struct tmx_trellis_matrix){&h->l.law, K, fp4 ? 16 : 32, rows, cols,
                                                  h->m[i].words, h->m[i].scales, h->m[i].g,
                                                  p < 2 ? h->l.sign_in : h->l.sign_mid,
                                                  p < 2 ? h->l.sign_mid : h->l.sign_out};
    }
}

static void layer_release(struct host_layer *h) {
    for (int i = 0; i < 3 * h->l.n_experts; i++) {
        free(h->m[i].words);
        free(h->m[i].scales);
    }
    free(h->l.mat);
}

static double block_error(int fp4, struct host_layer *h, int n, int k, int norm,
                          cudaStream_t s) {
    const int latent = h->l.latent;
    float *z = xmalloc((size_t)n * latent * 4), *w = xmalloc((size_t)n * k * 4),
          *want = xmalloc((size_t)n * latent * 4), *got = xmalloc((size_t)n * latent * 4);
    int32_t *ids = xmalloc((size_t)n * k * 4);
    uint64_t seed = 3 + (uint64_t)n;
    tmx_trellis_gauss_fill(&seed, z, (int64_t)n * latent);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            ids[t * k + j] = (t + 3 * j) % h->l.n_experts;
            w[t * k + j] = 0.1f + 0.05f * (float)j;
        }
    if (n > 1) ids[1] = -1, ids[k + 1] = h->l.n_experts + 5; /* skipped pairs */
    float *post = xmalloc((size_t)latent * 4);
    uint16_t *post16 = xmalloc((size_t)latent * 2);
    for (int i = 0; i < latent; i++) {
        post16[i] = (uint16_t)(0x3f80 + rnd() % 64); /* BF16 1.0 .. 1.49 */
        post[i] = tmx_bf16_to_f32(post16[i]);
    }
    const struct tmx_tensor pn = {norm == 2 ? TMX_DTYPE_BF16 : TMX_DTYPE_F32, 1, {latent},
                                  norm == 2 ? (void *)post16 : (void *)post};
    struct trellis_codec *c;
    if (trellis_codec_new(&host, fp4 ? TMX_TRELLIS_CODEC_FP4 : TMX_TRELLIS_CODEC_E4M3, 8, 1,
                          &c) != TMX_OK ||
        tmx_trellis_codec_moe_experts(c, &h->l, want, z, ids, w, n, k, norm ? &pn : NULL, 1e-6f,
                                      NULL) != TMX_OK)
        exit(2);
    void *dev;
    if (tmx_trellis_codec_device_load(c, &h->l, "cuda", s, &dev, NULL) != TMX_OK) exit(2);
    void *dz = dev_copy(z, (size_t)n * latent * 4), *dids = dev_copy(ids, (size_t)n * k * 4),
         *dw = dev_copy(w, (size_t)n * k * 4), *dout,
         *dpost = dev_copy(pn.data, (size_t)latent * (norm == 2 ? 2 : 4));
    CK(cudaMalloc(&dout, (size_t)n * latent * 4));
    struct tmx_tensor dpn = pn;
    dpn.data = dpost;
    if (tmx_trellis_codec_device_moe_experts(c, dev, s, dout, dz, dids, dw, n, k,
                                             norm ? &dpn : NULL, 1e-6f, NULL) != TMX_OK)
        exit(2);
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(got, dout, (size_t)n * latent * 4, cudaMemcpyDeviceToHost));
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < (size_t)n * latent; i++) {
        const double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    tmx_trellis_codec_device_free(c, dev);
    tmx_trellis_codec_device_fini(c);
    void *bufs[] = {dz, dids, dw, dout, dpost};
    for (int i = 0; i < 5; i++) CK(cudaFree(bufs[i]));
    free(z), free(w), free(want), free(got), free(ids), free(post), free(post16);
    return sqrt(num / den);
}

static void check_block(cudaStream_t s) {
    jprintf("\"expert_block\": {\"tolerance\": %g, \"cases\": [", BLOCK_TOL);
    tprintf("\ndevice_moe_experts vs host moe_experts (16 experts, latent 512, inter 1024, "
            "top 4), relative L2 error, tolerance %g:\n", BLOCK_TOL);
    /* 300 tokens: 75 pairs an expert, two groups of each expert; 600: 150, the wide GEMM;
     * 1100: 275, its groups of 256 */
    enum { NB = 6 };
    static const int tokens[NB] = {1, 3, 40, 300, 600, 1100}, norms[NB] = {0, 1, 2, 1, 2, 1};
    static const char *const norm_name[3] = {"none", "F32", "BF16"};
    for (int fp4 = 0; fp4 < 2; fp4++) {
        struct host_layer *h = xmalloc(sizeof *h);
        const int K = fp4 ? 4 : 3;
        layer_make(h, fp4, K, 16, 512, 1024);
        tprintf("  %s K%d:", fp4 ? "trellis-fp4" : "trellis-e4m3", K);
        for (int i = 0; i < NB; i++) {
            const double err = block_error(fp4, h, tokens[i], 4, norms[i], s);
            failures += !(err <= BLOCK_TOL);
            jprintf("%s{\"codec\": \"%s\", \"K\": %d, \"tokens\": %d, \"post_norm\": \"%s\", "
                    "\"rel_err\": %.3e}", fp4 || i ? ", " : "",
                    fp4 ? "trellis-fp4" : "trellis-e4m3", K, tokens[i], norm_name[norms[i]], err);
            tprintf("  %d tok (norm %s) %.2e%s", tokens[i], norm_name[norms[i]], err,
                    err <= BLOCK_TOL ? "" : " FAIL");
        }
        tprintf("\n");
        layer_release(h);
        free(h);
    }
    /* muse-tiny's shapes (latent = inter = 128: every row shorter than one chunk) */
    for (int fp4 = 0; fp4 < 2; fp4++) {
        struct host_layer *h = xmalloc(sizeof *h);
        layer_make(h, fp4, 3, 8, 128, 128);
        const double err = block_error(fp4, h, 5, 2, 1, s);
        failures += !(err <= BLOCK_TOL);
        jprintf(", {\"codec\": \"%s\", \"K\": 3, \"latent\": 128, \"inter\": 128, "
                "\"tokens\": 5, \"post_norm\": \"F32\", \"rel_err\": %.3e}",
                fp4 ? "trellis-fp4" : "trellis-e4m3", err);
        tprintf("  %s K3, 8 experts, latent = inter = 128, 5 tok, top 2: %.2e%s\n",
                fp4 ? "trellis-fp4" : "trellis-e4m3", err, err <= BLOCK_TOL ? "" : " FAIL");
        layer_release(h);
        free(h);
    }
    jprintf("]},\n");
}

/* --- 5. timing ------------------------------------------------------------------------------ */

#define SIDE 4096
#define EXPERTS 8

/* Phase times of the expert block, ms per call: route+input, gate/up, mid, down, output. */
struct phases {
    double pre, gate_up, mid, down, out, total;
};

static struct phases time_block(const struct trellis_cuda_layer *l, int n, int k,
                                cudaStream_t s) {
    float *z, *w, *out;
    int32_t *ids;
    float *hz = xmalloc((size_t)n * SIDE * 4), *hw = xmalloc((size_t)n * k * 4);
    int32_t *hids = xmalloc((size_t)n * k * 4);
    uint64_t seed = 5;
    tmx_trellis_gauss_fill(&seed, hz, (int64_t)n * SIDE);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            hids[t * k + j] = j; /* every token to every one of the 8 experts */
            hw[t * k + j] = 1.0f / k;
        }
    z = dev_copy(hz, (size_t)n * SIDE * 4);
    w = dev_copy(hw, (size_t)n * k * 4);
    ids = dev_copy(hids, (size_t)n * k * 4);
    CK(cudaMalloc((void **)&out, (size_t)n * SIDE * 4));
    cudaEvent_t ev[7];
    for (int i = 0; i < 7; i++) CK(cudaEventCreate(&ev[i]));
    struct trellis_cuda_scratch *scratch = NULL;
    struct phases p = {0};
    char msg[256];
    for (int rep = -3; rep < REPS; rep++) {
        CK(cudaEventRecord(ev[0], s));
        if (trellis_cuda_moe(&scratch, l, s, out, z, ids, w, n, k, NULL, TRELLIS_CUDA_NORM_NONE,
                             0.0f, (void *const *)(ev + 1), msg, sizeof msg)) {
            fprintf(stderr, "trellis-gpu-bench: %s\n", msg);
            exit(2);
        }
        CK(cudaEventSynchronize(ev[6]));
        if (rep < 0) continue;
        p.pre += elapsed(ev[0], ev[2]) / REPS;
        p.gate_up += elapsed(ev[2], ev[3]) / REPS;
        p.mid += elapsed(ev[3], ev[4]) / REPS;
        p.down += elapsed(ev[4], ev[5]) / REPS;
        p.out += elapsed(ev[5], ev[6]) / REPS;
        p.total += elapsed(ev[0], ev[6]) / REPS;
    }
    trellis_cuda_scratch_free(scratch);
    for (int i = 0; i < 7; i++) CK(cudaEventDestroy(ev[i]));
    CK(cudaFree(z));
    CK(cudaFree(w));
    CK(cudaFree(ids));
    CK(cudaFree(out));
    free(hz), free(hw), free(hids);
    return p;
}

/* cuBLASLt: ms of D[b][n][rows] = W[b][rows][cols] X[b][n][cols]^T over `batch` matrices
 * (weights row-major, so op(A) = T: the layout FP8 needs); < 0 when no algorithm fits. */
static double lt_time(cublasLtHandle_t lt, cudaDataType_t ab, int rows, int cols, int n,
                      int batch, const void *A, const void *B, void *D, void *ws,
                      size_t ws_size, cudaStream_t s) {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int64_t sa = (int64_t)rows * cols, sb = (int64_t)cols * n, sc = (int64_t)rows * n;
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ||
        cublasLtMatrixLayoutCreate(&la, ab, cols, rows, cols) ||
        cublasLtMatrixLayoutCreate(&lb, ab, cols, n, cols) ||
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, rows, n, rows))
        return -1.0;
    const cublasLtMatrixLayout_t lays[3] = {la, lb, lc};
    const int64_t strides[3] = {sa, sb, sc};
    for (int i = 0; i < 3; i++)
        if (cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                             sizeof batch) ||
            cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                             &strides[i], sizeof strides[i]))
            return -1.0;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (cublasLtMatmulPreferenceCreate(&pref) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_size, sizeof ws_size) ||
        cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &res, &found) ||
        found == 0)
        return -1.0;
    const float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double ms = -1.0;
    for (int rep = -3; rep < REPS; rep++) {
        if (rep == 0) CK(cudaEventRecord(e0, s));
        if (cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &res.algo, ws,
                           ws_size, s))
            break;
        if (rep == REPS - 1) {
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            ms = elapsed(e0, e1) / REPS;
        }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < 3; i++) cublasLtMatrixLayoutDestroy(lays[i]);
    cublasLtMatmulDescDestroy(op);
    return ms;
}

/* The three projections of 8 experts as cuBLASLt GEMMs: gate and up as one batch of 16,
 * down as a batch of 8; ms, or < 0. */
static double lt_block(cublasLtHandle_t lt, cudaDataType_t ab, int n, void *w, void *x,
                       void *d, void *ws, size_t ws_size, cudaStream_t s) {
    const size_t esize = ab == CUDA_R_16BF ? 2 : 1, mat = (size_t)SIDE * SIDE * esize;
    const double gu = lt_time(lt, ab, SIDE, SIDE, n, 2 * EXPERTS, w, x, d, ws, ws_size, s);
    const double dn = lt_time(lt, ab, SIDE, SIDE, n, EXPERTS, (char *)w + 2 * EXPERTS * mat, x,
                              d, ws, ws_size, s);
    return gu < 0 || dn < 0 ? -1.0 : gu + dn;
}

/* The matmul alone's device operands: 8 experts' [SIDE][SIDE] matrices of random words (`wpt`
 * words a tile, from `words`) and block scales, up to m tokens an expert of E4M3 bytes with
 * unit block scales, g = a = 1/64, law e2m1's table (trellis_cuda_matmul's arguments). */
struct mm_bufs {
    void *w, *s, *g, *a, *x, *xb, *lut, *y, *work;
};

static struct mm_bufs mm_bufs_new(const uint32_t *words, int wpt, const uint8_t *scales, int m) {
    const size_t mat = (size_t)SIDE * SIDE, n = (size_t)EXPERTS * m;
    float g[EXPERTS], *a = xmalloc(n * 4), *xb = xmalloc(n * SIDE / 16 * 4);
    uint8_t *x = xmalloc(n * SIDE);
    for (int e = 0; e < EXPERTS; e++) g[e] = 1.0f / 64.0f;
    for (size_t i = 0; i < n; i++) a[i] = 1.0f / 64.0f;
    for (size_t i = 0; i < n * SIDE; i++) x[i] = (uint8_t)(0x30 + rnd() % 16);
    for (size_t i = 0; i < n * SIDE / 16; i++) xb[i] = 1.0f;
    struct mm_bufs b = {dev_copy(words, mat / 256 * wpt * 4 * EXPERTS),
                        dev_copy(scales, mat / 16 * EXPERTS), dev_copy(g, sizeof g),
                        dev_copy(a, n * 4), dev_copy(x, n * SIDE), dev_copy(xb, n * SIDE / 16 * 4),
                        NULL, NULL, NULL};
    CK(cudaMalloc(&b.lut, 1024));
    CK(cudaMalloc(&b.y, n * SIDE * 4));
    CK(cudaMalloc(&b.work, trellis_cuda_matmul_work(0, EXPERTS, SIDE, m, 256)));
    free(a);
    free(xb);
    free(x);
    return b;
}

static void mm_bufs_free(struct mm_bufs *b) {
    void *bufs[] = {b->w, b->s, b->g, b->a, b->x, b->xb, b->lut, b->y, b->work};
    for (int i = 0; i < 9; i++) CK(cudaFree(bufs[i]));
}

/* Law fp4's table into b->lut. */
static void mm_bufs_law(struct mm_bufs *b, int fp4) {
    struct tmx_trellis_law law;
    law_init(&law, fp4);
    uint8_t lut[1024];
    law_lut(&law, lut);
    CK(cudaMemcpy(b->lut, lut, 1024, cudaMemcpyHostToDevice));
}

/* ms of one trellis_cuda_matmul of the 8 experts at m tokens each (mean of REPS after 3). */
static double mm_time(const struct mm_bufs *b, int fp4, int K, int m, int group,
                      cudaStream_t s) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    char msg[256];
    for (int rep = -3; rep < REPS; rep++) {
        if (rep == 0) CK(cudaEventRecord(e0, s));
        if (trellis_cuda_matmul(fp4, K, b->lut, b->w, b->s, b->g, EXPERTS, SIDE, SIDE, b->x, b->a,
                                b->xb, m, group, b->work, b->y, s, msg, sizeof msg)) {
            fprintf(stderr, "trellis-gpu-bench: %s\n", msg);
            exit(2);
        }
    }
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    const double ms = elapsed(e0, e1) / REPS;
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms;
}

/* The matmul alone at one token per expert, every K (`words` holds K = 6's words a tile).
 * Shows what K costs when decoding bounds it. */
static void sweep_k(const uint32_t *words, const uint8_t *scales, double copy_gbs,
                    cudaStream_t s) {
    const size_t mat = (size_t)SIDE * SIDE;
    struct mm_bufs b = mm_bufs_new(words, 8 * TMX_TRELLIS_K_MAX, scales, 1);
    jprintf(", \"matmul_k_sweep\": [");
    tprintf("\nmatmul alone, 8 experts x [%d][%d], 1 token each: ms, GB/s of words + scales "
            "(share of copy bandwidth), weights/s:\n", SIDE, SIDE);
    for (int fp4 = 0; fp4 < 2; fp4++) {
        mm_bufs_law(&b, fp4);
        for (int K = TMX_TRELLIS_K_MIN; K <= TMX_TRELLIS_K_MAX; K++) {
            const double ms = mm_time(&b, fp4, K, 1, 0, s),
                         bytes = (double)EXPERTS * mat * (K / 8.0 + 1.0 / (fp4 ? 16 : 32)),
                         gbs = bytes / (ms * 1e-3) / 1e9, wps = EXPERTS * mat / (ms * 1e-3);
            jprintf("%s{\"law\": \"%s\", \"K\": %d, \"ms\": %.4f, \"gbs\": %.1f, "
                    "\"weights_per_s\": %.4g}", fp4 || K > 2 ? ", " : "", law_name(fp4), K, ms,
                    gbs, wps);
            tprintf("  %s K%d: %.4f ms, %5.0f GB/s (%2.0f%%), %.3g weights/s\n", law_name(fp4), K,
                    ms, gbs, 100.0 * gbs / copy_gbs, wps);
        }
    }
    jprintf("]");
    mm_bufs_free(&b);
}

/* The matmul alone at K = 3 for each grouped kernel, m tokens an expert (`words` holds K = 3's
 * words a tile at least); what the expert block's choice of group rests on. */
static void time_groups(const uint32_t *words, const uint8_t *scales, cudaStream_t s) {
    enum { NM = 6, NG = 5, MMAX = 512, SYNC = TRELLIS_CUDA_MMA_SYNC };
    static const int tokens[NM] = {16, 32, 64, 128, 256, MMAX};
    static const int groups[NG] = {64, 128, 256, 128 | SYNC, 256 | SYNC};
    const int K = 3;
    const char *wide = trellis_cuda_matmul_form(0, 128, 128, EXPERTS);
    struct mm_bufs b = mm_bufs_new(words, 8 * K, scales, MMAX);
    jprintf(", \"matmul_groups\": {\"K\": 3, \"tokens_per_expert\": [");
    for (int i = 0; i < NM; i++) jprintf("%s%d", i ? ", " : "", tokens[i]);
    jprintf("], \"groups\": [\"64\", \"128 %s\", \"256 %s\", \"128 mma.sync\", "
            "\"256 mma.sync\"], \"ms\": {", wide, wide);
    tprintf("\nmatmul alone by group size (and the wide GEMM's form), 8 experts x [%d][%d], "
            "K = 3: ms (group of the expert block: *)\n  %-6s %6s %9s %9s %9s %9s %9s\n", SIDE,
            SIDE, "law", "tokens", "64", "128", "256", "128 sync", "256 sync");
    for (int fp4 = 0; fp4 < 2; fp4++) {
        mm_bufs_law(&b, fp4);
        jprintf("%s\"%s\": [", fp4 ? ", " : "", law_name(fp4));
        for (int i = 0; i < NM; i++) {
            const int m = tokens[i];
            const int pick = trellis_cuda_group(fp4, m, (long)m * EXPERTS, EXPERTS);
            jprintf("%s[", i ? ", " : "");
            tprintf("  %-6s %6d", law_name(fp4), m);
            for (int j = 0; j < NG; j++) {
                const double ms = mm_time(&b, fp4, K, m, groups[j], s);
                jprintf("%s%.4f", j ? ", " : "", ms);
                tprintf(" %8.4f%s", ms, groups[j] == pick ? "*" : " ");
            }
            jprintf("]");
            tprintf("\n");
        }
        jprintf("]");
    }
    jprintf("}}");
    mm_bufs_free(&b);
}

/* --sweep: the matmul alone at every K, nothing else; --groups: by group size at K = 3. */
static void sweep(int groups, double copy_gbs, cudaStream_t s) {
    const size_t n = (size_t)SIDE * SIDE / 256 * 48 * EXPERTS; /* words of K = 6 */
    uint32_t *words = xmalloc(n * 4);
    uint8_t *scales = xmalloc((size_t)SIDE * SIDE / 16 * EXPERTS);
    for (size_t i = 0; i < n; i++) words[i] = rnd();
    for (size_t i = 0; i < (size_t)SIDE * SIDE / 16 * EXPERTS; i++)
        scales[i] = (uint8_t)(0x30 + rnd() % 16);
    jprintf("\"sweep_only\": true");
    if (groups)
        time_groups(words, scales, s);
    else
        sweep_k(words, scales, copy_gbs, s);
    free(words);
    free(scales);
}

static void timing(cudaStream_t s, double copy_gbs) {
    /* The trellis layers: 8 experts of random words and scales, both laws, K = 3. */
    const int K = 3;
    const size_t tiles = (size_t)SIDE * SIDE / 256, nw = tiles * tmx_trellis_words(K);
    uint32_t *words = xmalloc(nw * 4 * 3 * EXPERTS);
    for (size_t i = 0; i < nw * 3 * EXPERTS; i++) words[i] = rnd();
    uint8_t *scales = xmalloc((size_t)SIDE * SIDE / 16 * 3 * EXPERTS);
    for (size_t i = 0; i < (size_t)SIDE * SIDE / 16 * 3 * EXPERTS; i++)
        scales[i] = (uint8_t)(0x30 + rnd() % 16);
    uint8_t signs[SIDE / 8];
    for (int i = 0; i < SIDE / 8; i++) signs[i] = (uint8_t)rnd();

    /* cuBLASLt operands: 24 random BF16 and FP8 matrices (no NaN), activations, output. */
    const size_t mat = (size_t)SIDE * SIDE;
    void *wb, *wf, *xb, *xf, *d, *ws;
    const size_t ws_size = (size_t)64 << 20;
    uint16_t *host = xmalloc(mat * 3 * EXPERTS * 2);
    for (size_t i = 0; i < mat * 3 * EXPERTS; i++) host[i] = (uint16_t)(rnd() & 0xbfbf);
    CK(cudaMalloc(&wb, mat * 3 * EXPERTS * 2));
    CK(cudaMalloc(&wf, mat * 3 * EXPERTS));
    CK(cudaMemcpy(wb, host, mat * 3 * EXPERTS * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(wf, host, mat * 3 * EXPERTS, cudaMemcpyHostToDevice));
    free(host);
    CK(cudaMalloc(&xb, (size_t)2 * EXPERTS * 256 * SIDE * 2));
    CK(cudaMalloc(&xf, (size_t)2 * EXPERTS * 256 * SIDE));
    CK(cudaMemset(xb, 0x3c, (size_t)2 * EXPERTS * 256 * SIDE * 2));
    CK(cudaMemset(xf, 0x3c, (size_t)2 * EXPERTS * 256 * SIDE));
    CK(cudaMalloc(&d, (size_t)2 * EXPERTS * 256 * SIDE * 2));
    CK(cudaMalloc(&ws, ws_size));
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt)) {
        fprintf(stderr, "trellis-gpu-bench: cublasLtCreate failed\n");
        exit(2);
    }

    enum { NT = 5 };
    static const int tokens[NT] = {1, 16, 64, 128, 256};
    double lt_ms[2][NT];
    for (int i = 0; i < NT; i++) {
        lt_ms[0][i] = lt_block(lt, CUDA_R_16BF, tokens[i], wb, xb, d, ws, ws_size, s);
        lt_ms[1][i] = lt_block(lt, CUDA_R_8F_E4M3, tokens[i], wf, xf, d, ws, ws_size, s);
    }
    const double flops1 = 2.0 * 3 * EXPERTS * (double)mat; /* per token */
    jprintf("\"timing\": {\"experts\": %d, \"latent\": %d, \"inter\": %d, \"K\": %d, "
            "\"reps\": %d, \"tokens_per_expert\": [", EXPERTS, SIDE, SIDE, K, REPS);
    for (int i = 0; i < NT; i++) jprintf("%s%d", i ? ", " : "", tokens[i]);
    jprintf("], \"cublaslt_ms\": {");
    for (int t = 0; t < 2; t++) {
        jprintf("%s\"%s\": [", t ? ", " : "", t ? "fp8" : "bf16");
        for (int i = 0; i < NT; i++) jprintf("%s%.4f", i ? ", " : "", lt_ms[t][i]);
        jprintf("]");
    }
    jprintf("}, \"codecs\": [");
    tprintf("\nfull size: 8 experts, latent = inter = %d, K = %d; ms per call (mean of %d); "
            "copy bandwidth %.0f GB/s\n", SIDE, K, REPS, copy_gbs);
    tprintf("  %-13s %6s %9s %9s %9s %9s %10s %9s %9s\n", "codec", "tokens", "gate+up", "down",
            "matmuls", "block", "eff GB/s", "lt bf16", "lt fp8");
    for (int fp4 = 0; fp4 < 2; fp4++) {
        const int block = fp4 ? 16 : 32;
        const uint32_t *wp[3 * EXPERTS];
        const uint8_t *sp[3 * EXPERTS];
        float g[3 * EXPERTS];
        for (int i = 0; i < 3 * EXPERTS; i++) {
            wp[i] = words + (size_t)i * nw;
            sp[i] = scales + (size_t)i * mat / block;
            g[i] = 1.0f / 64.0f;
        }
        struct tmx_trellis_law law;
        law_init(&law, fp4);
        uint8_t lut[1024];
        law_lut(&law, lut);
        const struct trellis_cuda_layer_desc desc = {fp4, K, EXPERTS, SIDE, SIDE, lut, wp, sp, g,
                                                     signs, signs, signs};
        struct trellis_cuda_layer *l;
        char msg[256];
        if (trellis_cuda_layer_new(&desc, s, &l, msg, sizeof msg)) {
            fprintf(stderr, "trellis-gpu-bench: %s\n", msg);
            exit(2);
        }
        jprintf("%s{\"codec\": \"%s\", \"runs\": [", fp4 ? ", " : "",
                fp4 ? "trellis-fp4" : "trellis-e4m3");
        for (int i = 0; i < NT; i++) {
            const int n = tokens[i];
            const struct phases p = time_block(l, n, EXPERTS, s);
            /* Bytes the matmuls must read: tile words, expanded block scales, activations. */
            const double bytes = 3.0 * EXPERTS * (nw * 4.0 + (double)mat / block) +
                                 (double)n * SIDE * (1 + EXPERTS) * (1 + 4.0 / 16 * fp4);
            const double mm = p.gate_up + p.down, gbs = bytes / (mm * 1e-3) / 1e9,
                         tflops = flops1 * n / (mm * 1e-3) / 1e12;
            jprintf("%s{\"tokens\": %d, \"ms\": {\"route_input\": %.4f, \"gate_up\": %.4f, "
                    "\"mid\": %.4f, \"down\": %.4f, \"output\": %.4f, \"block\": %.4f}, "
                    "\"matmul_bytes\": %.0f, \"matmul_gbs\": %.1f, \"matmul_tflops\": %.2f}",
                    i ? ", " : "", n, p.pre, p.gate_up, p.mid, p.down, p.out, p.total, bytes,
                    gbs, tflops);
            tprintf("  %-13s %6d %9.4f %9.4f %9.4f %9.4f %10.0f %9.4f %9.4f\n",
                    fp4 ? "trellis-fp4" : "trellis-e4m3", n, p.gate_up, p.down, mm, p.total, gbs,
                    lt_ms[0][i], lt_ms[1][i]);
        }
        jprintf("]}");
        trellis_cuda_layer_free(l);
    }
    jprintf("]");
    tprintf("  (eff GB/s: trellis words + block scales + activations over the matmul time; "
            "cuBLASLt weights read %.0f MB BF16, %.0f MB FP8: at 1 token %.0f and %.0f GB/s)\n",
            3 * EXPERTS * mat * 2 / 1e6, 3 * EXPERTS * mat / 1e6,
            lt_ms[0][0] > 0 ? 3 * EXPERTS * mat * 2 / (lt_ms[0][0] * 1e-3) / 1e9 : 0.0,
            lt_ms[1][0] > 0 ? 3 * EXPERTS * mat / (lt_ms[1][0] * 1e-3) / 1e9 : 0.0);
    sweep_k(words, scales, copy_gbs, s);
    time_groups(words, scales, s);
    jprintf("}\n");
    cublasLtDestroy(lt);
    void *bufs[] = {wb, wf, xb, xf, d, ws};
    for (int i = 0; i < 6; i++) CK(cudaFree(bufs[i]));
    free(words);
    free(scales);
}

int main(int argc, char **argv) {
    const char *mode = argc == 3 ? argv[1] : "";
    const int groups_only = strcmp(mode, "--groups") == 0;
    const int sweep_only = groups_only || strcmp(mode, "--sweep") == 0;
    const int checks_only = strcmp(mode, "--checks") == 0;
    if (argc != 2 + (sweep_only || checks_only)) {
        fprintf(stderr, "usage: trellis-gpu-bench [--sweep | --groups | --checks] OUT.json\n");
        return 2;
    }
    const char *out = argv[argc - 1];
    struct cudaDeviceProp prop;
    int driver = 0, runtime = 0;
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaDriverGetVersion(&driver));
    CK(cudaRuntimeGetVersion(&runtime));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    jprintf("{\"device\": \"%s\", \"sms\": %d, \"cuda_driver\": %d, \"cuda_runtime\": %d,\n",
            prop.name, prop.multiProcessorCount, driver, runtime);
    tprintf("%s, %d SMs, CUDA driver %d, runtime %d\n", prop.name, prop.multiProcessorCount,
            driver, runtime);
    const double copy_gbs = copy_bandwidth(s);
    jprintf("\"copy_gbs\": %.1f,\n", copy_gbs);
    if (sweep_only) {
        sweep(groups_only, copy_gbs, s);
    } else {
        check_decode(s);
        check_matmul(s);
        check_block(s);
        if (checks_only)
            jprintf("\"checks_only\": true");
        else
            timing(s, copy_gbs);
    }
    jprintf(", \"failures\": %d}\n", failures);
    FILE *f = fopen(out, "w");
    if (!f || fwrite(json, 1, json_len, f) != json_len || fclose(f) != 0) {
        fprintf(stderr, "trellis-gpu-bench: cannot write %s\n", out);
        return 2;
    }
    CK(cudaStreamDestroy(s));
    fputs(table, stdout);
    printf("\n%s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
