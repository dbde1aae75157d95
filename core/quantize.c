/* quantize.c: tmx quantize, top to bottom: open the model and the codec, calibrate, write the
 * non-expert shards, code every MoE layer, then the build's small files and its manifest
 * (tmx/quantize.h lists the steps; quantize-hessian.c and quantize-write.c hold two of them).
 * All of it goes into OUT.partial-PID, renamed to OUT when complete: OUT never holds half a
 * build.
 *
 * Memory: calibration keeps every MoE layer's latents and routing ([tokens][latent] F32 each);
 * a layer's expert weights (F32) and Hessians (F64) exist only while it is coded. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "quantize-impl.h"
#include "tmx/fs.h"
#include "tmx/log.h"
#include "tmx/manifest.h"
#include "tmx/quantize.h"
#include "tmx/tmx.h"

#define DEFAULT_TOKENS 8192
#define DEFAULT_WINDOW 512
#define PARTIAL ".partial-" /* OUT.partial-PID: the build until it is complete */

struct quant {
    const struct tmx_quantize_params *p;
    struct tmx_engine *eng;
    const struct tmx_model_config *mc;
    struct tmx_checkpoint *ck;        /* the same files, for the expert weights */
    struct tmx_plugins *ps;           /* the codec's registry */
    const struct tmx_plugin *codec;
    const struct tmx_codec_i *ops;
    void *ctx;
    int started;                      /* ops->init succeeded */
    int n_threads;
    struct calib_layer *calib;        /* [n_layers]; empty for dense layers */
    int64_t n_calib, n_windows;       /* calibration tokens (BOS included) and windows */
    int n_moe, moe_index, layer;      /* MoE layers, which one is being coded, its id */
    json_t *layers;                   /* the report's per-layer entries */
    char *target, *work;              /* OUT resolved; the folder the build is made in */
};

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double now(void) { return clock_s(CLOCK_MONOTONIC); }
/* CPU seconds of every thread of the process: throughput that other load does not skew. */
static double cpu_now(void) { return clock_s(CLOCK_PROCESS_CPUTIME_ID); }

static void emit(const struct quant *q, struct tmx_quantize_progress pr) {
    pr.n_moe = q->n_moe;
    pr.moe_index = q->moe_index;
    pr.layer = q->layer;
    if (q->p->progress) q->p->progress(q->p->progress_arg, &pr);
}

/* JSON number, or null for what JSON cannot hold. */
static json_t *json_num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* --- opening ------------------------------------------------------------------------------- */

/* An optional op the codec's table is long enough to hold and sets (tmx/plugin.h). */
#define CODEC_HAS(ops, member)                                                                \
    ((ops)->struct_size >= offsetof(struct tmx_codec_i, member) + sizeof((ops)->member) &&    \
     (ops)->member)

static enum tmx_status open_all(struct quant *q, char **err) {
    const struct tmx_quantize_params *p = q->p;
    char path[4096];
    snprintf(path, sizeof path, "%s/hf_quant_config.json", p->model_dir);
    if (access(path, F_OK) == 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s: the model is already quantized; tmx quantize "
                       "reads BF16, F16 or F32 checkpoints", path);
    enum tmx_status st = tmx_engine_open(p->model_dir, p->config_path, p->n_overrides,
                                         p->overrides, &q->eng, err);
    if (st == TMX_OK) st = tmx_checkpoint_open(p->model_dir, &q->ck, err);
    if (st == TMX_OK) st = tmx_plugins_new(tmx_engine_config(q->eng), &q->ps, err);
    if (st == TMX_OK) st = tmx_plugins_load(q->ps, TMX_PLUGIN_CODEC, p->codec, &q->codec, err);
    if (st != TMX_OK) return st;
    q->mc = tmx_model_cfg(tmx_engine_model(q->eng));
    q->ops = q->codec->ops;
    if (!CODEC_HAS(q->ops, layer_encode))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "codec.%s cannot encode (no layer_encode op)",
                       p->codec);
    st = q->ops->init(tmx_host_get(), tmx_plugins_opts(q->ps, q->codec), &q->ctx, err);
    if (st != TMX_OK) {
        q->ops->fini(q->ctx); /* safe after a failed init */
        return st;
    }
    q->started = 1;
    const int64_t threads = tmx_config_int(tmx_engine_config(q->eng), "threads");
    q->n_threads = threads > 0 ? (int)threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (q->n_threads < 1) q->n_threads = 1;
    for (int l = 0; l < q->mc->n_layers; l++) q->n_moe += !q->mc->dense[l];
    return TMX_OK;
}

/* Removes the TARGET.partial-PID folders beside TARGET of runs that died (a signal, a crash)
 * before they could remove their own: PID is gone, or is this process, which made none yet. */
static enum tmx_status remove_stale(const char *target, char **err) {
    const char *slash = strrchr(target, '/'), *base = slash + 1;
    char parent[4096], prefix[4096], path[8200];
    snprintf(parent, sizeof parent, "%.*s", slash == target ? 1 : (int)(slash - target), target);
    snprintf(prefix, sizeof prefix, "%s" PARTIAL, base);
    DIR *d = opendir(parent);
    if (!d) return tmx_err(err, TMX_ERR_IO, "%s: %s", parent, strerror(errno));
    enum tmx_status st = TMX_OK;
    for (struct dirent *de; st == TMX_OK && (de = readdir(d));) {
        if (strncmp(de->d_name, prefix, strlen(prefix)) != 0) continue;
        const char *tail = de->d_name + strlen(prefix);
        char *end;
        if (*tail < '0' || *tail > '9') continue;
        const long pid = strtol(tail, &end, 10);
        if (*end || (pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno != ESRCH)))
            continue;
        snprintf(path, sizeof path, "%s/%s", slash == target ? "" : parent, de->d_name);
        st = tmx_remove_tree(path, err);
        if (st == TMX_OK)
            tmx_log(TMX_LOG_INFO, "%s: removed the unfinished build of an interrupted run "
                    "(process %ld)", path, pid);
    }
    closedir(d);
    return st;
}

/* OUT must be absent or an empty folder (a build is the whole folder); the build is made in
 * q->work, TARGET.partial-PID beside it (TARGET: OUT resolved), made fresh here. */
static enum tmx_status prepare_out(struct quant *q, char **err) {
    const char *dir = q->p->out_dir;
    DIR *d = opendir(dir);
    if (!d && errno != ENOENT) return tmx_err(err, TMX_ERR_IO, "%s: %s", dir, strerror(errno));
    int empty = 1;
    for (struct dirent *de; d && empty && (de = readdir(d));)
        empty = strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0;
    if (d) closedir(d);
    if (!empty)
        return tmx_err(err, TMX_ERR_INVALID, "%s: not empty; tmx quantize writes a whole build "
                       "into an empty folder", dir);
    if (!(q->target = tmx_path_resolve(dir)) ||
        asprintf(&q->work, "%s" PARTIAL "%ld", q->target, (long)getpid()) < 0) {
        q->work = NULL;
        return tmx_err(err, TMX_ERR_IO, "%s: %s", dir, strerror(errno));
    }
    enum tmx_status st = remove_stale(q->target, err);
    if (st == TMX_OK && mkdir(q->work, 0777) != 0)
        st = tmx_err(err, TMX_ERR_IO, "%s: cannot create %s: %s", dir, q->work, strerror(errno));
    if (st != TMX_OK) {
        free(q->work);
        q->work = NULL; /* nothing of this run's to remove */
    }
    return st;
}

/* --- calibration --------------------------------------------------------------------------- */

/* Appends a step's latents and routing to the layer's rows. */
static enum tmx_status on_capture(void *arg, const struct tmx_moe_capture *cap, char **err) {
    struct quant *q = arg;
    struct calib_layer *cl = &q->calib[cap->layer];
    const int lat = q->mc->moe_latent_size;
    if (cl->n + cap->n > q->n_calib)
        return tmx_err(err, TMX_ERR_INVALID, "calibration: layer %d captured more rows than "
                       "tokens run", cap->layer);
    memcpy(cl->z + cl->n * lat, cap->z, (size_t)cap->n * (size_t)lat * sizeof *cl->z);
    memcpy(cl->ids + cl->n * cap->k, cap->ids, (size_t)cap->n * (size_t)cap->k * sizeof *cl->ids);
    cl->n += cap->n;
    return TMX_OK;
}

/* Text tokens in the window at text offset off: up to `per`, and no more than `room` tokens with
 * the BOS; 0 when nothing fits. */
static int64_t window_text(int64_t n_ids, int64_t off, int64_t per, int bos, int64_t room) {
    int64_t n = n_ids - off < per ? n_ids - off : per;
    if (n + bos > room) n = room - bos;
    return n > 0 ? n : 0;
}

/* Windows of `window` tokens (BOS first when the model has one) over the tokenized text, up to
 * max_tokens in all, each run in a fresh sequence. */
static enum tmx_status calibrate(struct quant *q, char **err) {
    const struct tmx_quantize_params *p = q->p;
    const char *text = p->calib_text ? p->calib_text : tmx_quantize_builtin_calib;
    const size_t len = p->calib_text ? p->calib_len : strlen(tmx_quantize_builtin_calib);
    const int bos = q->mc->bos_token_id >= 0;
    const int64_t max_tokens = p->max_tokens > 0 ? p->max_tokens : DEFAULT_TOKENS;
    int window = p->window > 0 ? p->window : DEFAULT_WINDOW;
    if (window > tmx_engine_n_ctx(q->eng)) window = tmx_engine_n_ctx(q->eng);
    if (window < 2 + bos)
        return tmx_err(err, TMX_ERR_INVALID, "calibration window %d is too short", window);
    int32_t *ids = NULL, *buf = malloc((size_t)window * sizeof *buf);
    size_t n_ids = 0;
    enum tmx_status st = buf ? tmx_tokenizer_encode(tmx_engine_tokenizer(q->eng), text, len, 0,
                                                    &ids, &n_ids, err)
                             : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    /* Plan the windows first: the capture buffers are sized by the token count. */
    const int64_t per = window - bos;
    int64_t total = 0, windows = 0;
    for (int64_t off = 0, n; st == TMX_OK && off < (int64_t)n_ids; off += per, windows++) {
        if (!(n = window_text((int64_t)n_ids, off, per, bos, max_tokens - total))) break;
        total += n + bos;
    }
    if (st == TMX_OK && windows == 0)
        st = tmx_err(err, TMX_ERR_INVALID, "calibration text: %zu tokens, too few for a window",
                     n_ids);
    q->n_calib = total;
    q->n_windows = windows;
    q->calib = calloc((size_t)q->mc->n_layers, sizeof *q->calib);
    if (st == TMX_OK && !q->calib) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    for (int l = 0; st == TMX_OK && l < q->mc->n_layers; l++) {
        if (q->mc->dense[l]) continue;
        q->calib[l].z = malloc((size_t)total * (size_t)q->mc->moe_latent_size * sizeof(float));
        q->calib[l].ids = malloc((size_t)total * (size_t)q->mc->n_experts_per_tok * 4);
        if (!q->calib[l].z || !q->calib[l].ids)
            st = tmx_err(err, TMX_ERR_NOMEM, "out of memory for %lld calibration tokens",
                         (long long)total);
    }
    struct tmx_seq *seq = NULL;
    float *logits = malloc((size_t)q->mc->vocab_size * sizeof *logits);
    if (st == TMX_OK && !logits) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if (st == TMX_OK)
        st = tmx_seq_new(tmx_engine_model(q->eng), window, &seq, err);
    if (st == TMX_OK) st = tmx_model_set_capture(tmx_engine_model(q->eng), on_capture, q, err);
    int64_t done = 0;
    for (int64_t w = 0; st == TMX_OK && w < windows; w++) {
        const int64_t n = window_text((int64_t)n_ids, w * per, per, bos, total - done);
        if (bos) buf[0] = q->mc->bos_token_id;
        memcpy(buf + bos, ids + w * per, (size_t)n * sizeof *buf);
        tmx_seq_reset(seq);
        st = tmx_seq_forward(seq, buf, (int)(n + bos), logits, 0, err);
        done += n + bos;
        emit(q, (struct tmx_quantize_progress){.stage = TMX_QUANTIZE_CALIBRATE, .done = done,
                                               .total = total});
    }
    tmx_model_set_capture(tmx_engine_model(q->eng), NULL, NULL, NULL);
    tmx_seq_free(seq);
    free(logits);
    free(ids);
    free(buf);
    return st;
}

/* --- one MoE layer ------------------------------------------------------------------------- */

/* w[p][e]: F32 copies of expert e's projection p (gate, up, down) of layer l. */
static enum tmx_status load_experts(struct quant *q, int l, float **w[3], char **err) {
    static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
    const int E = q->mc->n_routed_experts;
    const int64_t lat = q->mc->moe_latent_size, inter = q->mc->moe_intermediate_size;
    for (int p = 0; p < 3; p++)
        for (int e = 0; e < E; e++) {
            char name[256];
            struct tmx_tensor t;
            const int64_t rows = p < 2 ? inter : lat, cols = p < 2 ? lat : inter;
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj[p]);
            if (tmx_checkpoint_find(q->ck, name, &t) != 0 || t.ndim != 2 ||
                t.shape[0] != rows || t.shape[1] != cols ||
                (t.dtype != TMX_DTYPE_F32 && t.dtype != TMX_DTYPE_BF16 &&
                 t.dtype != TMX_DTYPE_F16))
                return tmx_err(err, TMX_ERR_INVALID, "%s: tensor %s must be [%lld][%lld] F32, "
                               "BF16 or F16", q->p->model_dir, name, (long long)rows,
                               (long long)cols);
            float *dst = w[p][e] = malloc((size_t)(rows * cols) * sizeof *dst);
            if (!dst) return tmx_err(err, TMX_ERR_NOMEM, "out of memory loading %s", name);
            const uint16_t *h = t.data;
            for (int64_t i = 0; i < rows * cols; i++)
                dst[i] = t.dtype == TMX_DTYPE_F32  ? ((const float *)t.data)[i]
                         : t.dtype == TMX_DTYPE_BF16 ? tmx_bf16_to_f32(h[i])
                                                     : tmx_f16_to_f32(h[i]);
        }
    return TMX_OK;
}

static void on_tiles(void *arg, int64_t done, int64_t total) {
    const struct quant *q = arg;
    emit(q, (struct tmx_quantize_progress){.stage = TMX_QUANTIZE_ENCODE,
                                           .done = q->moe_index * total + done,
                                           .total = q->n_moe * total});
}

static json_t *int_array(const int64_t *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

/* Hessians, then the codec; appends the layer's entry to the report. */
static enum tmx_status encode_layer(struct quant *q, int l, char **err) {
    const struct tmx_model_config *mc = q->mc;
    const int E = mc->n_routed_experts, lat = mc->moe_latent_size,
              inter = mc->moe_intermediate_size;
    float **w[3] = {calloc((size_t)E, sizeof(float *)), calloc((size_t)E, sizeof(float *)),
                    calloc((size_t)E, sizeof(float *))};
    double *proxy = calloc((size_t)E * 3, sizeof *proxy); /* [E][3] */
    struct layer_hessians h = {0};
    const double t0 = now();
    enum tmx_status st = w[0] && w[1] && w[2] && proxy
                             ? load_experts(q, l, w, err)
                             : tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    if (st == TMX_OK)
        st = quantize_hessians(&q->calib[l], mc->n_experts_per_tok, E, lat, inter,
                               (const float *const *)w[0], (const float *const *)w[1],
                               q->n_threads, &h, err);
    int64_t *used = calloc((size_t)E, sizeof *used);
    if (st == TMX_OK && !used) st = tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    const double t1 = now(), c1 = cpu_now();
    if (st == TMX_OK) {
        for (int e = 0; e < E; e++) used[e] = h.natural[e] + h.supplemental[e];
        const struct tmx_codec_encode_job job = {
            .out_dir = q->work, .layer = l, .n_experts = E, .latent = lat, .inter = inter,
            .gate = (const float *const *)w[0], .up = (const float *const *)w[1],
            .down = (const float *const *)w[2], .h_in = (const double *const *)h.h_in,
            .h_mid = (const double *const *)h.h_mid, .n_tokens = used, .bits = q->p->bits,
            .n_threads = q->n_threads, .progress = on_tiles, .progress_arg = q,
            .proxy_err = proxy};
        st = q->ops->layer_encode(q->ctx, &job, err);
    }
    const double t2 = now(), c2 = cpu_now();
    if (st == TMX_OK) {
        int n_supp = 0;
        double mean = 0.0;
        json_t *pe = json_array();
        for (int e = 0; e < E; e++) {
            n_supp += h.natural[e] == 0;
            json_array_append_new(pe, json_pack("[o, o, o]", json_num(proxy[3 * e]),
                                                json_num(proxy[3 * e + 1]),
                                                json_num(proxy[3 * e + 2])));
            mean += (proxy[3 * e] + proxy[3 * e + 1] + proxy[3 * e + 2]) / (3.0 * E);
        }
        json_array_append_new(q->layers, json_pack(
            "{s:i, s:i, s:o, s:o, s:i, s:o, s:o, s:{s:o, s:o, s:o}}", "layer", l, "experts", E,
            "routed_tokens", int_array(h.natural, E), "supplemental_tokens",
            int_array(h.supplemental, E), "experts_supplemented", n_supp, "proxy_error", pe,
            "proxy_error_mean", json_num(mean), "seconds", "hessians", json_num(t1 - t0),
            "encode", json_num(t2 - t1), "encode_cpu", json_num(c2 - c1)));
        emit(q, (struct tmx_quantize_progress){.stage = TMX_QUANTIZE_LAYER_DONE,
                                               .seconds = t2 - t0, .n_supplemented = n_supp,
                                               .proxy_mean = mean});
    }
    quantize_hessians_free(&h, E);
    for (int p = 0; p < 3; p++) {
        for (int e = 0; w[p] && e < E; e++) free(w[p][e]);
        free(w[p]);
    }
    free(used);
    free(proxy);
    return st;
}

/* --- the small files ----------------------------------------------------------------------- */

/* quant_method and codec, the codec's own members, then the MXFP8 tensors and the producer. */
static enum tmx_status write_quant_config(struct quant *q, json_t *mxfp8_names, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/hf_quant_config.json", q->work);
    json_t *cfg = json_pack("{s:s, s:s}", "quant_method", q->ops->quant_method, "codec",
                            q->codec->name);
    enum tmx_status st = TMX_OK;
    if (CODEC_HAS(q->ops, quant_config)) {
        const int n = q->ops->quant_config(q->ctx, q->p->bits, NULL, 0);
        char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
        json_t *own = text && q->ops->quant_config(q->ctx, q->p->bits, text, (size_t)n + 1) == n
                          ? json_loads(text, 0, NULL) : NULL;
        if (!json_is_object(own))
            st = tmx_err(err, TMX_ERR_INVALID, "codec.%s: no hf_quant_config.json members for "
                         "--bits %d", q->codec->name, q->p->bits);
        else
            json_object_update_missing(cfg, own);
        json_decref(own);
        free(text);
    }
    if (st == TMX_OK) {
        json_object_set(cfg, "mxfp8_tensors", mxfp8_names);
        json_object_set_new(cfg, "producer", json_pack("{s:s, s:s}", "name", "tmx", "version",
                                                       TMX_VERSION));
        if (json_dump_file(cfg, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0)
            st = tmx_err(err, TMX_ERR_IO, "%s: cannot write", path);
    }
    json_decref(cfg);
    return st;
}

static enum tmx_status write_report(struct quant *q, json_t *seconds, int n_mxfp8, char **err) {
    const struct tmx_quantize_params *p = q->p;
    char path[4096];
    snprintf(path, sizeof path, "%s/quantize-report.json", q->work);
    json_t *r = json_pack(
        "{s:s, s:s, s:i, s:i, s:{s:s, s:I, s:I}, s:O, s:{s:i}, s:O}", "model", p->model_dir,
        "codec", p->codec, "bits", p->bits, "threads", q->n_threads, "calibration", "source",
        p->calib_name ? p->calib_name : "built-in", "tokens", (json_int_t)q->n_calib, "windows",
        (json_int_t)q->n_windows, "layers", q->layers, "non_expert", "mxfp8_tensors", n_mxfp8,
        "seconds", seconds);
    enum tmx_status st = TMX_OK;
    if (!r || json_dump_file(r, path, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0)
        st = tmx_err(err, TMX_ERR_IO, "%s: cannot write", path);
    json_decref(r);
    return st;
}

/* --- the whole run ------------------------------------------------------------------------- */

enum tmx_status tmx_quantize(const struct tmx_quantize_params *p, char **err) {
    struct quant q = {.p = p, .layers = json_array()};
    json_t *mxfp8_names = json_array(), *seconds = json_object();
    const double t0 = now();
    enum tmx_status st = open_all(&q, err);
    if (st == TMX_OK && CODEC_HAS(q.ops, quant_config) &&
        q.ops->quant_config(q.ctx, p->bits, NULL, 0) < 0)
        st = tmx_err(err, TMX_ERR_INVALID, "codec.%s cannot build at --bits %d", p->codec,
                     p->bits);
    if (st == TMX_OK) st = prepare_out(&q, err);
    const double t1 = now();
    if (st == TMX_OK) st = calibrate(&q, err);
    const double t2 = now();
    if (st == TMX_OK) {
        emit(&q, (struct tmx_quantize_progress){.stage = TMX_QUANTIZE_WRITE});
        st = quantize_write_dense(q.ck, q.work, mxfp8_names, err);
    }
    const double t3 = now();
    for (int l = 0; st == TMX_OK && l < q.mc->n_layers; l++) {
        if (q.mc->dense[l]) continue;
        q.layer = l;
        st = encode_layer(&q, l, err);
        q.moe_index++;
    }
    const double t4 = now();
    if (st == TMX_OK) {
        emit(&q, (struct tmx_quantize_progress){.stage = TMX_QUANTIZE_WRITE});
        st = quantize_copy_files(p->model_dir, q.work, err);
    }
    if (st == TMX_OK) st = write_quant_config(&q, mxfp8_names, err);
    if (st == TMX_OK) {
        json_object_set_new(seconds, "load", json_num(t1 - t0));
        json_object_set_new(seconds, "calibration", json_num(t2 - t1));
        json_object_set_new(seconds, "non_expert", json_num(t3 - t2));
        json_object_set_new(seconds, "layers", json_num(t4 - t3));
        json_object_set_new(seconds, "total", json_num(now() - t0));
        st = write_report(&q, seconds, (int)json_array_size(mxfp8_names), err);
    }
    if (st == TMX_OK) st = tmx_manifest_write(q.work, err);
    if (st == TMX_OK && rename(q.work, q.target) != 0)
        st = tmx_err(err, TMX_ERR_IO, "%s: cannot move the finished build %s there: %s",
                     p->out_dir, q.work, strerror(errno));
    if (st != TMX_OK && q.work) tmx_remove_tree(q.work, NULL);
    free(q.work);
    free(q.target);

    for (int l = 0; q.calib && l < q.mc->n_layers; l++) {
        free(q.calib[l].z);
        free(q.calib[l].ids);
    }
    free(q.calib);
    if (q.started) q.ops->fini(q.ctx);
    tmx_plugins_free(q.ps);
    tmx_checkpoint_free(q.ck);
    tmx_engine_free(q.eng);
    json_decref(q.layers);
    json_decref(mxfp8_names);
    json_decref(seconds);
    return st;
}
