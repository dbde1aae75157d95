/* encode.c: the TrellisMX encoder: one matrix (scales, LDLQ, Viterbi per tile) and one MoE
 * layer (coupled vectors, threads over experts, CSF, the experts/ and coupled/ files).
 *
 * Everything happens in the rotated basis, where the stream is coded: Q ~ H S_out W S_in H
 * with Hessian H S_in X^T X S_in H (ldlq.c). Rotation is orthonormal, so the proxy error is
 * the same in either basis. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "encode.h"
#include "impl.h"
#include "tmx/tensor.h"

/* c, the scale that codes N(0,1) data best (target = c x), per law and K = 2..6 (e4m3-pair:
 * 2..4): the golden-section optimum of tmx_trellis_gauss_mse (trellis-bench; 64 tiles for
 * K = 5, 6). A block of RMS r is coded at the step r / c. */
static const double best_scale[3][5] = {
    {0.9799, 0.9320, 0.8641, 0.8249, 0.8080}, /* e4m3 */
    {1.7059, 1.7293, 1.9932, 2.0182, 2.0755}, /* e2m1, alpha = 0.5625 */
    {1.0069, 0.9464, 0.9036, 0.0, 0.0},       /* e4m3-pair: K = 2..4 */
};

/* Beyond the law's values (|v| <= 6) a target only needs to stay finite for the search. */
#define TARGET_LIMIT 64.0
#define E4M3_MAX 448.0

/* --- one matrix ---------------------------------------------------------------------------- */

/* Block RMS -> scales. g puts the largest block at E4M3's 448, so that every other block keeps
 * 3 significant bits down to 2^-15 of it. */
static enum tmx_status pick_scales(const struct tmx_trellis_encode_io *io, int block, double c,
                                   float *g, char **err) {
    const int64_t nb = io->cols / block, n = io->rows * nb;
    double *rms = malloc((size_t)n * sizeof *rms); /* [rows][nb] */
    if (!rms) return trellis_err(err, TMX_ERR_NOMEM, "trellis encode: out of memory");
    double top = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float *x = io->w + i * block; /* blocks are consecutive within and across rows */
        double s = 0.0;
        for (int j = 0; j < block; j++) s += (double)x[j] * x[j];
        rms[i] = sqrt(s / block);
        if (!isfinite(rms[i])) {
            free(rms);
            return trellis_err(err, TMX_ERR_INVALID, "trellis encode: row %lld has a weight "
                               "that is not finite", (long long)(i / nb));
        }
        if (rms[i] > top) top = rms[i];
    }
    *g = top > 0.0 ? (float)(top / (c * E4M3_MAX)) : 1.0f;
    if (!(*g >= 0x1p-126f)) *g = 0x1p-126f; /* weights this small code as zero */
    for (int64_t i = 0; i < n; i++)
        io->scales[i] = tmx_trellis_e4m3_round((float)(rms[i] / (c * *g)));
    free(rms);
    return TMX_OK;
}

enum tmx_status tmx_trellis_matrix_encode(struct tmx_trellis_viterbi *vit,
                                          const struct tmx_trellis_law *law, int K,
                                          struct tmx_trellis_encode_io *io, char **err) {
    const int block = tmx_trellis_law_block(law->id), nw = tmx_trellis_words(K);
    const int64_t rows = io->rows, cols = io->cols, nb = cols / block, tiles_c = cols / 16;
    enum tmx_status st = pick_scales(io, block, best_scale[law->id][K - TMX_TRELLIS_K_MIN],
                                     &io->scale, err);
    if (st != TMX_OK) return st;
    const float g = io->scale;
    float *e = malloc((size_t)(16 * cols) * sizeof *e); /* [16][cols] the strip's error */
    if (!e) return trellis_err(err, TMX_ERR_NOMEM, "trellis encode: out of memory");
    float target[TMX_TRELLIS_TILE], vals[TMX_TRELLIS_TILE]; /* [16][16] tile order */
    double fb[16][16];                                       /* feedback into the tile */

    for (int64_t s = 0; s < rows / 16; s++) {
        for (int64_t tc = tiles_c - 1; tc >= 0; tc--) {
            const int64_t c0 = 16 * tc;
            memset(fb, 0, sizeof fb);
            /* A row's 16 sums stay in registers while the feedback rows stream by. */
            for (int r = 0; io->a && r < 16; r++)
                for (int64_t i = c0 + 16; i < cols; i++) {
                    const double ei = e[r * cols + i], *ai = io->a + i * cols + c0; /* [16] */
                    for (int k = 0; k < 16; k++) fb[r][k] += ei * ai[k];
                }
            for (int r = 0; r < 16; r++) {
                const int64_t row = 16 * s + r;
                const double step = (double)g * tmx_e4m3_to_f32(io->scales[row * nb + c0 / block]);
                for (int k = 0; k < 16; k++) {
                    const double t = step > 0.0 ? (io->w[row * cols + c0 + k] + fb[r][k]) / step
                                                : 0.0;
                    target[16 * r + k] = (float)fmax(-TARGET_LIMIT, fmin(TARGET_LIMIT, t));
                }
            }
            uint32_t *words = io->words + (s * tiles_c + tc) * nw;
            tmx_trellis_viterbi_encode(vit, target, words);
            tmx_trellis_decode_values(law, words, K, vals);
            for (int r = 0; r < 16; r++) {
                const int64_t row = 16 * s + r;
                const float b = tmx_e4m3_to_f32(io->scales[row * nb + c0 / block]);
                for (int k = 0; k < 16; k++) {
                    const float q = g * (b * vals[16 * r + k]); /* as the decoder computes it */
                    io->q[row * cols + c0 + k] = q;
                    e[r * cols + c0 + k] = io->w[row * cols + c0 + k] - q;
                }
            }
        }
        if (io->strip_done) io->strip_done(io->strip_arg, tiles_c);
    }
    free(e);
    return TMX_OK;
}

/* --- one layer ----------------------------------------------------------------------------- */

static const char *const proj_name[3] = {"gate_proj", "up_proj", "down_proj"};

/* One projection of every expert of the layer, as the files store it. */
struct proj_out {
    int64_t rows, cols;
    uint32_t *words;   /* [E][rows/16][cols/16][8K] */
    float *scale;      /* [E] g */
    uint8_t *csf;      /* [E][fixed] CSF fixed streams */
    int64_t fixed;     /* bytes of one fixed stream */
    uint32_t **exc;    /* [E] each expert's exceptions (malloc'd, may be NULL) */
    int64_t *n_exc;    /* [E] */
};

struct layer_enc {
    const struct tmx_host *host;
    const struct tmx_codec_encode_job *job;
    struct tmx_trellis_law law;
    int K, block;
    uint8_t *signs[3];          /* sign_latent_in, sign_intermediate, sign_latent_out */
    struct proj_out out[3];     /* gate, up, down */
    pthread_mutex_t lock;       /* guards everything below */
    int next;                   /* next expert to take */
    enum tmx_status st;         /* first failure; workers stop taking experts */
    char *msg;                  /* its message (malloc'd) */
    int64_t tiles_done, tiles_total;
};

/* A worker's buffers, sized for the larger of the two shapes. */
struct worker {
    struct layer_enc *le;
    struct tmx_trellis_viterbi *vit;
    float *w, *q;               /* [rows][cols] */
    double *h, *a;              /* [n][n] rotated Hessian, LDLQ feedback */
    uint8_t *scales;            /* [rows][cols/block] */
};

static void strip_done(void *arg, int64_t tiles) {
    struct layer_enc *le = arg;
    const struct tmx_codec_encode_job *job = le->job;
    pthread_mutex_lock(&le->lock);
    le->tiles_done += tiles;
    if (job->progress) job->progress(job->progress_arg, le->tiles_done, le->tiles_total);
    pthread_mutex_unlock(&le->lock);
}

/* Rotated Hessian and its feedback, or *use = 0 when there is none (no inputs). */
static enum tmx_status prepare_hessian(struct worker *wk, const double *h, int64_t n,
                                       const uint8_t *sign, int *use, char **err) {
    *use = 0;
    if (!h) return TMX_OK;
    double diag = 0.0;
    for (int64_t i = 0; i < n; i++) diag += h[i * n + i];
    if (diag == 0.0) return TMX_OK;
    memcpy(wk->h, h, (size_t)(n * n) * sizeof *wk->h);
    tmx_trellis_rotate_hessian(wk->h, n, sign);
    double lambda;
    enum tmx_status st = tmx_trellis_ldlq_factor(wk->h, n, wk->a, &lambda, err);
    *use = st == TMX_OK;
    return st;
}

/* Codes projection p of expert e; the Hessian is ready in wk (use) or absent. */
static enum tmx_status encode_proj(struct worker *wk, int e, int p, int use, char **err) {
    struct layer_enc *le = wk->le;
    const struct tmx_codec_encode_job *job = le->job;
    struct proj_out *o = &le->out[p];
    const float *src = (p == 0 ? job->gate : p == 1 ? job->up : job->down)[e];
    const int64_t n = o->rows * o->cols;
    memcpy(wk->w, src, (size_t)n * sizeof *wk->w);
    tmx_trellis_rotate_matrix(wk->w, o->rows, o->cols, le->signs[p < 2 ? 1 : 2],
                              le->signs[p < 2 ? 0 : 1]);
    struct tmx_trellis_encode_io io = {
        .rows = o->rows, .cols = o->cols, .w = wk->w, .a = use ? wk->a : NULL,
        .words = o->words + (int64_t)e * (n / TMX_TRELLIS_TILE) * tmx_trellis_words(le->K),
        .scales = wk->scales, .q = wk->q, .strip_done = strip_done, .strip_arg = le};
    enum tmx_status st = tmx_trellis_matrix_encode(wk->vit, &le->law, le->K, &io, err);
    if (st == TMX_OK && job->proxy_err)
        st = tmx_trellis_proxy_error(wk->w, wk->q, o->rows, o->cols, use ? wk->h : NULL,
                                     &job->proxy_err[e * 3 + p], err);
    if (st == TMX_OK) {
        o->scale[e] = io.scale;
        st = tmx_trellis_csf_encode(wk->scales, o->rows, o->cols / le->block,
                                    o->csf + e * o->fixed, &o->exc[e], &o->n_exc[e], err);
    }
    return st;
}

static enum tmx_status encode_expert(struct worker *wk, int e, char **err) {
    struct layer_enc *le = wk->le;
    const struct tmx_codec_encode_job *job = le->job;
    int use;
    enum tmx_status st = prepare_hessian(wk, job->h_in ? job->h_in[e] : NULL, job->latent,
                                         le->signs[0], &use, err);
    for (int p = 0; st == TMX_OK && p < 2; p++) st = encode_proj(wk, e, p, use, err);
    if (st == TMX_OK)
        st = prepare_hessian(wk, job->h_mid ? job->h_mid[e] : NULL, job->inter, le->signs[1],
                             &use, err);
    if (st == TMX_OK) st = encode_proj(wk, e, 2, use, err);
    return st;
}

static void *worker_run(void *arg) {
    struct worker *wk = arg;
    struct layer_enc *le = wk->le;
    for (;;) {
        pthread_mutex_lock(&le->lock);
        const int e = le->st == TMX_OK && le->next < le->job->n_experts ? le->next++ : -1;
        pthread_mutex_unlock(&le->lock);
        if (e < 0) return NULL;
        char *msg = NULL;
        const enum tmx_status st = encode_expert(wk, e, &msg);
        if (st == TMX_OK) continue;
        pthread_mutex_lock(&le->lock);
        if (le->st == TMX_OK) {
            le->st = st;
            if (asprintf(&le->msg, "expert %d: %s", e, msg ? msg : "failed") < 0) le->msg = NULL;
        }
        pthread_mutex_unlock(&le->lock);
        free(msg);
    }
}

static void worker_free(struct worker *wk) {
    tmx_trellis_viterbi_free(wk->vit);
    free(wk->w);
    free(wk->q);
    free(wk->h);
    free(wk->a);
    free(wk->scales);
}

static enum tmx_status worker_init(struct worker *wk, struct layer_enc *le, char **err) {
    const int64_t big = le->job->latent > le->job->inter ? le->job->latent : le->job->inter;
    const size_t nm = (size_t)le->job->latent * (size_t)le->job->inter;
    *wk = (struct worker){.le = le};
    enum tmx_status st = tmx_trellis_viterbi_new(&le->law, le->K, &wk->vit, err);
    if (st != TMX_OK) return st;
    wk->w = malloc(nm * sizeof *wk->w);
    wk->q = malloc(nm * sizeof *wk->q);
    wk->h = malloc((size_t)(big * big) * sizeof *wk->h);
    wk->a = malloc((size_t)(big * big) * sizeof *wk->a);
    wk->scales = malloc(nm / (size_t)le->block);
    if (!wk->w || !wk->q || !wk->h || !wk->a || !wk->scales) {
        worker_free(wk);
        return trellis_err(err, TMX_ERR_NOMEM, "trellis encode: out of memory");
    }
    return TMX_OK;
}

static void outputs_free(struct layer_enc *le) {
    for (int p = 0; p < 3; p++) {
        struct proj_out *o = &le->out[p];
        for (int e = 0; o->exc && e < le->job->n_experts; e++) free(o->exc[e]);
        free(o->words);
        free(o->scale);
        free(o->csf);
        free(o->exc);
        free(o->n_exc);
    }
}

static int outputs_alloc(struct layer_enc *le) {
    const size_t E = (size_t)le->job->n_experts;
    for (int p = 0; p < 3; p++) {
        struct proj_out *o = &le->out[p];
        o->rows = p < 2 ? le->job->inter : le->job->latent;
        o->cols = p < 2 ? le->job->latent : le->job->inter;
        o->fixed = tmx_trellis_csf_fixed_size(o->rows, o->cols / le->block);
        o->words = malloc(E * (size_t)(o->rows * o->cols / 8) * (size_t)le->K); /* K bits each */
        o->scale = malloc(E * sizeof *o->scale);
        o->csf = malloc(E * (size_t)o->fixed);
        o->exc = calloc(E, sizeof *o->exc);
        o->n_exc = calloc(E, sizeof *o->n_exc);
        if (!o->words || !o->scale || !o->csf || !o->exc || !o->n_exc) return 0;
    }
    return 1;
}

/* experts/layer-LLL-SSS-EEE.safetensors: experts first .. first + E - 1 (§10.2). */
static enum tmx_status write_chunk(struct layer_enc *le, int first, int64_t E, char **err) {
    const struct tmx_codec_encode_job *job = le->job;
    char names[15][48], path[4096], layer[16], sfirst[16], slast[16];
    struct tmx_tensor t[15];
    const char *name_ptr[15];
    int32_t *exc[3] = {NULL}, *starts[3] = {NULL};
    enum tmx_status st = TMX_OK;
    for (int p = 0; p < 3; p++) {
        const struct proj_out *o = &le->out[p];
        int64_t total = 0;
        for (int i = 0; i < E; i++) total += o->n_exc[first + i];
        exc[p] = malloc((size_t)(total ? total : 1) * sizeof *exc[p]);
        starts[p] = malloc((size_t)(E + 1) * sizeof *starts[p]);
        if (!exc[p] || !starts[p] || total > INT32_MAX) {
            st = le->host->err(err, TMX_ERR_NOMEM, "trellis encode: out of memory");
            break;
        }
        starts[p][0] = 0;
        for (int i = 0; i < E; i++) { /* uint32 bit patterns, stored as I32 */
            const int64_t n = o->n_exc[first + i];
            if (n) memcpy(exc[p] + starts[p][i], o->exc[first + i], (size_t)n * sizeof(uint32_t));
            starts[p][i + 1] = starts[p][i] + (int32_t)n;
        }
        const int64_t tiles = o->rows * o->cols / TMX_TRELLIS_TILE;
        const struct tmx_tensor pt[5] = {
            {TMX_DTYPE_I32, 4, {E, o->rows / 16, o->cols / 16, tmx_trellis_words(le->K)},
             o->words + first * tiles * tmx_trellis_words(le->K)},
            {TMX_DTYPE_F32, 1, {E}, o->scale + first},
            {TMX_DTYPE_U8, 2, {E, o->fixed}, o->csf + first * o->fixed},
            {TMX_DTYPE_I32, 1, {total}, exc[p]},
            {TMX_DTYPE_I32, 1, {E + 1}, starts[p]},
        };
        static const char *const suffix[5] = {"trellis", "scale", "scale_csf",
                                              "scale_csf_exceptions", "scale_csf_starts"};
        for (int k = 0; k < 5; k++) {
            snprintf(names[5 * p + k], sizeof names[0], "%s.%s", proj_name[p], suffix[k]);
            name_ptr[5 * p + k] = names[5 * p + k];
            t[5 * p + k] = pt[k];
        }
    }
    if (st == TMX_OK) {
        snprintf(layer, sizeof layer, "%d", job->layer);
        snprintf(sfirst, sizeof sfirst, "%d", first);
        snprintf(slast, sizeof slast, "%d", first + (int)E - 1);
        const char *meta[] = {"format", "trellismx-experts", "trellismx_version", "1",
                              "layer", layer, "first_expert", sfirst, "last_expert", slast, NULL};
        snprintf(path, sizeof path, "%s/experts/layer-%03d-%03d-%03d.safetensors", job->out_dir,
                 job->layer, first, first + (int)E - 1);
        st = le->host->st_write(path, 15, name_ptr, t, meta, err);
    }
    for (int p = 0; p < 3; p++) free(exc[p]), free(starts[p]);
    return st;
}

/* coupled/layer-LLL.safetensors (§10.3). */
static enum tmx_status write_coupled(struct layer_enc *le, char **err) {
    const struct tmx_codec_encode_job *job = le->job;
    char path[4096], layer[16];
    snprintf(layer, sizeof layer, "%d", job->layer);
    snprintf(path, sizeof path, "%s/coupled/layer-%03d.safetensors", job->out_dir, job->layer);
    const char *names[3] = {"sign_latent_in", "sign_intermediate", "sign_latent_out"};
    const struct tmx_tensor t[3] = {
        {TMX_DTYPE_U8, 1, {job->latent / 8}, le->signs[0]},
        {TMX_DTYPE_U8, 1, {job->inter / 8}, le->signs[1]},
        {TMX_DTYPE_U8, 1, {job->latent / 8}, le->signs[2]},
    };
    const char *meta[] = {"format", "trellismx-coupled", "trellismx_version", "1", "layer", layer,
                          NULL};
    return le->host->st_write(path, 3, names, t, meta, err);
}

static enum tmx_status make_dir(const struct tmx_host *host, const char *dir, const char *sub,
                                char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    if (mkdir(path, 0777) != 0 && errno != EEXIST)
        return host->err(err, TMX_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    return TMX_OK;
}

/* Codes every expert on n threads, the calling one among them (fewer if some cannot start). */
static void run_workers(struct worker *wk, int n) {
    pthread_t *tid = calloc((size_t)n, sizeof *tid);
    int started = 0;
    while (tid && started < n - 1 &&
           pthread_create(&tid[started], NULL, worker_run, &wk[started + 1]) == 0)
        started++;
    worker_run(&wk[0]);
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    free(tid);
}

enum tmx_status tmx_trellis_layer_encode(const struct tmx_host *host, enum tmx_trellis_law_id law,
                                         float alpha, const struct tmx_codec_encode_job *job,
                                         char **err) {
    const int K = job->bits, lat = job->latent, inter = job->inter;
    const int k_max = tmx_trellis_k_max(law);
    if (K < TMX_TRELLIS_K_MIN || K > k_max)
        return host->err(err, TMX_ERR_INVALID,
                         "trellis encode: bits = %d is not in %d..%d (law %s)", K,
                         TMX_TRELLIS_K_MIN, k_max, tmx_trellis_law_name(law));
    if (lat <= 0 || inter <= 0 || lat % TMX_TRELLIS_HADAMARD || inter % TMX_TRELLIS_HADAMARD)
        return host->err(err, TMX_ERR_INVALID, "trellis encode: layer %d: moe_latent_size %d "
                         "and moe_intermediate_size %d must be multiples of %d", job->layer, lat,
                         inter, TMX_TRELLIS_HADAMARD);
    struct layer_enc le = {.host = host, .job = job, .K = K, .block = tmx_trellis_law_block(law),
                           .st = TMX_OK};
    char *msg = NULL;
    enum tmx_status st = tmx_trellis_law_init(&le.law, law, alpha, &msg);
    const int nt = job->n_threads < 1 ? 1 : job->n_threads < job->n_experts ? job->n_threads
                                                                            : job->n_experts;
    struct worker *wk = calloc((size_t)nt, sizeof *wk);
    int n_init = 0;
    if (st == TMX_OK && !wk) st = trellis_err(&msg, TMX_ERR_NOMEM, "out of memory");
    for (int v = 0; st == TMX_OK && v < 3; v++) {
        const int n = v == 1 ? inter : lat;
        if (!(le.signs[v] = malloc((size_t)n / 8))) {
            st = trellis_err(&msg, TMX_ERR_NOMEM, "out of memory");
            break;
        }
        tmx_trellis_signs_random(tmx_trellis_sign_seed(job->layer, v), le.signs[v], n);
    }
    for (; st == TMX_OK && n_init < nt; n_init++) st = worker_init(&wk[n_init], &le, &msg);
    if (st != TMX_OK) {
        st = host->err(err, st, "trellis encode: layer %d: %s", job->layer, msg ? msg : "failed");
    } else {
        pthread_mutex_init(&le.lock, NULL);
        le.tiles_total = (int64_t)job->n_experts * 3 * (lat / 16) * (inter / 16);
        st = make_dir(host, job->out_dir, "experts", err);
        if (st == TMX_OK) st = make_dir(host, job->out_dir, "coupled", err);
        if (st == TMX_OK) st = write_coupled(&le, err);
        if (st == TMX_OK && !outputs_alloc(&le))
            st = host->err(err, TMX_ERR_NOMEM, "trellis encode: layer %d: out of memory",
                           job->layer);
        if (st == TMX_OK) {
            run_workers(wk, nt);
            if (le.st != TMX_OK)
                st = host->err(err, le.st, "trellis encode: layer %d %s", job->layer,
                               le.msg ? le.msg : "failed");
        }
        for (int f = 0; st == TMX_OK && f < job->n_experts; f += TMX_TRELLIS_EXPERTS_PER_FILE)
            st = write_chunk(&le, f, job->n_experts - f < TMX_TRELLIS_EXPERTS_PER_FILE
                                         ? job->n_experts - f : TMX_TRELLIS_EXPERTS_PER_FILE,
                             err);
        outputs_free(&le);
        pthread_mutex_destroy(&le.lock);
    }
    for (int i = 0; i < n_init; i++) worker_free(&wk[i]);
    for (int v = 0; v < 3; v++) free(le.signs[v]);
    free(wk);
    free(le.msg);
    free(msg);
    return st;
}

/* --- hf_quant_config.json ------------------------------------------------------------------ */

int tmx_trellis_quant_config(enum tmx_trellis_law_id law, float alpha, int bits, char *buf,
                             size_t size) {
    if (bits < TMX_TRELLIS_K_MIN || bits > tmx_trellis_k_max(law)) return -1;
    char a[48] = "";
    if (law == TMX_TRELLIS_LAW_E2M1) /* 17 digits: parses to exactly the binary32 */
        snprintf(a, sizeof a, ", \"alpha\": %.17g", (double)alpha);
    return snprintf(buf, size,
                    "{\"trellismx_version\": %d, \"law\": \"%s\", \"bits\": %d%s, "
                    "\"block_size\": %d, \"activation\": \"%s\", \"hadamard_block\": %d, "
                    "\"experts_per_file\": %d}",
                    TMX_TRELLIS_VERSION, tmx_trellis_law_name(law), bits, a,
                    tmx_trellis_law_block(law),
                    law == TMX_TRELLIS_LAW_E2M1 ? "nvfp4-token" : "e4m3-token",
                    TMX_TRELLIS_HADAMARD, TMX_TRELLIS_EXPERTS_PER_FILE);
}
