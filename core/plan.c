/* plan.c: the memory plan of a model on tensor-parallel GPUs (tmx/plan.h, docs/plan.md).
 *
 * Three steps, top to bottom: the weights one rank holds, from every tensor's name, dtype and
 * shape (safetensors headers, or the tensor list of docs/model.md when virtual); the runtime
 * allowance and KV cache for a context and a number of sequences, by the formulas of
 * core/forward.c; and the searches for the longest context and the most sequences that fit.
 * Sizes are what the engine allocates on the device, which is not always what the files hold:
 * a trellis codec decodes its CSF block scales to one byte per block, the correction bias
 * becomes F32 (MXFP8 weights stay MXFP8: kernels.cuda imports them as they are). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/kvcache.h"
#include "tmx/plan.h"
#include "tmx/safetensors.h"

/* CSF exception rates measured on Gaussian block scales (docs/perf/codec.md), rounded up: only
 * a virtual build's file size uses them (exceptions are decoded away on the device). */
#define EXC_RATE_BLOCK32 0.00005
#define EXC_RATE_BLOCK16 0.0025
#define TILE 16

static const char *const part_names[TMX_PLAN_N_PARTS] = {
    "attention", "experts", "mlp", "vocab", "routers", "bridges", "norms", "codec"};

const char *tmx_plan_part_name(enum tmx_plan_part p) {
    return p < TMX_PLAN_N_PARTS ? part_names[p] : "?";
}

static int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
static uint64_t align256(uint64_t n) { return (n + 255) & ~(uint64_t)255; }

static int ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* --- sizes on the command line --------------------------------------------------------------- */

enum tmx_status tmx_plan_parse_size(const char *s, uint64_t *bytes, char **err) {
    static const struct {
        const char *unit;
        double mult;
    } units[] = {{"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0},
                 {"KiB", 1024.0}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3},
                 {"B", 1.0}};
    char *end = NULL;
    errno = 0;
    const double v = strtod(s, &end);
    if (end != s && errno == 0 && v > 0)
        for (size_t i = 0; i < sizeof units / sizeof *units; i++)
            if (strcmp(end, units[i].unit) == 0 && v * units[i].mult < 1.8e19) {
                *bytes = (uint64_t)(v * units[i].mult + 0.5);
                return TMX_OK;
            }
    return tmx_err(err, TMX_ERR_INVALID, "\"%s\" is not a size such as 96GiB, 80GB or 512MiB",
                   s);
}

enum tmx_status tmx_plan_parse_gpus(const char *s, int *n, uint64_t *bytes, char **err) {
    const char *x = strchr(s, 'x');
    char *end = NULL;
    long count = 1;
    if (x) {
        count = strtol(s, &end, 10);
        if (end != x || count < 1 || count > 4096)
            return tmx_err(err, TMX_ERR_INVALID,
                           "--gpus: \"%s\" is not COUNTxSIZE such as 4x96GiB", s);
    }
    char *msg = NULL;
    if (tmx_plan_parse_size(x ? x + 1 : s, bytes, &msg) != TMX_OK) {
        free(msg);
        return tmx_err(err, TMX_ERR_INVALID, "--gpus: \"%s\" is not COUNTxSIZE such as 4x96GiB "
                       "or 8x80GB (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s);
    }
    *n = (int)count;
    return TMX_OK;
}

/* --- what the build is ----------------------------------------------------------------------- */

/* hf_quant_config.json's fields the plan needs; codec "bf16" when there is none. */
struct quant {
    char codec[16];
    int bits, block, per_file, mxfp8;
};

static enum tmx_status quant_load(const char *dir, struct quant *q, char **err) {
    *q = (struct quant){.codec = "bf16", .per_file = 32};
    struct tmx_quant_config qc;
    enum tmx_status st = tmx_quant_config_load(dir, &qc, err);
    if (st != TMX_OK || !qc.present) return st;
    const char *path = qc.path;
    const int fp4 = strcmp(qc.codec, "trellis-fp4") == 0, block = fp4 ? 16 : 32;
    if (!fp4 && strcmp(qc.codec, "trellis-e4m3"))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "%s: field \"codec\" must be trellis-e4m3 or "
                       "trellis-fp4 (the plan knows the TrellisMX layout only)", path);
    const char *codec = fp4 ? "trellis-fp4" : "trellis-e4m3"; /* fits q->codec */
    if (qc.bits < 2 || qc.bits > 6)
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"bits\" must be 2..6", path);
    if (qc.block_size != block)
        return tmx_err(err, TMX_ERR_INVALID, "%s: field \"block_size\" must be %d for %s", path,
                       block, codec);
    snprintf(q->codec, sizeof q->codec, "%s", codec);
    q->bits = qc.bits;
    q->block = qc.block_size;
    if (qc.experts_per_file > 0) q->per_file = qc.experts_per_file;
    q->mxfp8 = qc.mxfp8;
    return TMX_OK;
}

/* A virtual model's codec: --experts/--bits over the quant config. */
static enum tmx_status quant_override(const struct tmx_plan_options *o, struct quant *q,
                                      char **err) {
    if (o->experts) {
        if (strcmp(o->experts, "bf16") == 0) {
            *q = (struct quant){.codec = "bf16", .per_file = q->per_file};
        } else if (strcmp(o->experts, "trellis-e4m3") == 0 ||
                   strcmp(o->experts, "trellis-fp4") == 0) {
            snprintf(q->codec, sizeof q->codec, "%s", o->experts);
            q->block = strcmp(o->experts, "trellis-fp4") ? 32 : 16;
            q->mxfp8 = 1; /* tmx quantize makes the attention projections MXFP8 */
            if (!q->bits) q->bits = 3;
        } else {
            return tmx_err(err, TMX_ERR_INVALID,
                           "--experts: \"%s\" is not bf16, trellis-e4m3 or trellis-fp4",
                           o->experts);
        }
    }
    if (o->bits) {
        if (strcmp(q->codec, "bf16") == 0)
            return tmx_err(err, TMX_ERR_INVALID, "--bits: BF16 experts have no bit width");
        if (o->bits < 2 || o->bits > 6)
            return tmx_err(err, TMX_ERR_INVALID, "--bits: %d is not 2..6", o->bits);
        q->bits = o->bits;
    }
    return TMX_OK;
}

/* --- weights --------------------------------------------------------------------------------- */

struct acc {
    struct tmx_plan *p;
    int tp;
    int block;                     /* the codec's block scale width */
    uint64_t copies;               /* identical tensors each one accounted stands for */
};

/* Rank 0's share of `len` elements cut into slices of `unit`: the first ranks get one slice
 * more when they do not divide evenly. */
static int64_t rank_extent(int64_t len, int64_t unit, int tp) {
    const int64_t e = div_up(div_up(len, unit), tp) * unit;
    return e < len ? e : len;
}

/* Adds `bytes` of device memory to a part; len > 0: sharded along an axis of len elements. */
static void add(struct acc *a, enum tmx_plan_part part, uint64_t bytes, int64_t len,
                int64_t unit) {
    a->p->part_model[part] += bytes * a->copies;
    a->p->part_rank[part] +=
        (len > 0 ? bytes / (uint64_t)len * (uint64_t)rank_extent(len, unit, a->tp) : bytes) *
        a->copies;
}

static void add_file(struct acc *a, const struct tmx_tensor *t) {
    a->p->n_tensors += (int64_t)a->copies;
    a->p->file_bytes += tmx_tensor_nbytes(t) * a->copies;
}

static void unused(struct acc *a, const struct tmx_tensor *t) {
    a->p->n_unused += (int64_t)a->copies;
    a->p->unused_bytes += tmx_tensor_nbytes(t) * a->copies;
}

/* Where a model-shard tensor goes: its part, and the axis length and slice unit it is sharded
 * by (len 0: replicated); part -1: the graph does not load it. */
struct where {
    int part;
    int64_t len, unit;
};

static struct where classify(const char *name, const struct tmx_tensor *t, int64_t hd) {
    const struct where none = {-1, 0, 0};
    if (strcmp(name, "model.embed_tokens.weight") == 0 || strcmp(name, "lm_head.weight") == 0)
        return (struct where){TMX_PLAN_VOCAB, t->shape[0], 1};
    if (strcmp(name, "model.norm.weight") == 0) return (struct where){TMX_PLAN_NORMS, 0, 0};
    if (strncmp(name, "model.layers.", 13) != 0) return none;
    if (ends_with(name, ".self_attn.q_proj.weight") ||
        ends_with(name, ".self_attn.k_proj.weight") ||
        ends_with(name, ".self_attn.v_proj.weight"))
        return (struct where){TMX_PLAN_ATTENTION, t->shape[0], hd};
    if (ends_with(name, ".self_attn.o_proj.weight") && t->ndim == 2)
        return (struct where){TMX_PLAN_ATTENTION, t->shape[1], hd};
    const int proj = ends_with(name, ".gate_proj.weight") || ends_with(name, ".up_proj.weight")
                         ? 0 : ends_with(name, ".down_proj.weight") ? 1 : -1;
    if (proj >= 0 && t->ndim == 2 && strstr(name, ".mlp."))
        return (struct where){strstr(name, ".mlp.experts.") ? TMX_PLAN_EXPERTS : TMX_PLAN_MLP,
                              t->shape[proj], TILE};
    if (ends_with(name, ".mlp.router.weight") || ends_with(name, ".mlp.router.correction_bias"))
        return (struct where){TMX_PLAN_ROUTERS, 0, 0};
    if (ends_with(name, ".mlp.bridge_in.weight") || ends_with(name, ".mlp.bridge_out.weight"))
        return (struct where){TMX_PLAN_BRIDGES, 0, 0};
    if (ends_with(name, "layernorm.weight") || ends_with(name, ".q_norm.weight") ||
        ends_with(name, ".k_norm.weight") || ends_with(name, ".post_expert_norm.weight") ||
        ends_with(name, ".attn_gate") || ends_with(name, ".mlp_gate"))
        return (struct where){TMX_PLAN_NORMS, 0, 0};
    return none;
}

/* mx: 0 a plain tensor, 1 an MXFP8 value tensor (the codes, counted with their scales: they
 * are sharded alike; as BF16 where a rank's columns would split a block of 32, as
 * core/model.c binds it), 2 its UE8M0 scales. The router's correction bias is read as F32
 * (core/model.c). */
static void account_model(struct acc *a, const char *name, const struct tmx_tensor *t, int mx) {
    add_file(a, t);
    if (mx == 2) return;
    const struct where w = classify(name, t, a->p->cfg.head_dim);
    if (w.part < 0) {
        unused(a, t);
        return;
    }
    const int64_t n = tmx_tensor_numel(t);
    const int bf16 = mx && a->tp > 1 && ends_with(name, ".o_proj.weight") &&
                     rank_extent(w.len, w.unit, a->tp) % 32;
    uint64_t nb = bf16 ? (uint64_t)n * 2 : tmx_tensor_nbytes(t) + (mx ? (uint64_t)n / 32 : 0);
    if (ends_with(name, ".mlp.router.correction_bias")) nb = (uint64_t)tmx_tensor_numel(t) * 4;
    add(a, (enum tmx_plan_part)w.part, nb, w.len, w.unit);
}

/* One tensor of experts/layer-LLL-SSS-EEE.safetensors (docs/trellismx.md §10.2). The device
 * keeps the tile words and the block scales expanded to a byte each (plugins/trellis/cuda:
 * [E][rows][cols/block]), sliced like the matrix: gate/up by strips of 16 output rows, down by
 * columns of 16-wide tiles; the matrix scales g are replicated, the CSF streams stay on disk. */
static void account_experts(struct acc *a, const char *name, const struct tmx_tensor *t) {
    add_file(a, t);
    const int down = strncmp(name, "down_proj.", 10) == 0;
    if (ends_with(name, ".trellis") && t->ndim == 4) {
        const int axis = down ? 2 : 1;
        const uint64_t scales = (uint64_t)t->shape[0] * (uint64_t)(t->shape[1] * TILE) *
                                (uint64_t)(t->shape[2] * TILE) / (uint64_t)a->block;
        add(a, TMX_PLAN_EXPERTS, tmx_tensor_nbytes(t), t->shape[axis], 1);
        add(a, TMX_PLAN_EXPERTS, scales, t->shape[axis], 1);
    } else if (ends_with(name, ".scale")) {
        add(a, TMX_PLAN_CODEC, tmx_tensor_nbytes(t), 0, 0);
    } else if (!strstr(name, ".scale_csf")) {
        unused(a, t);
    }
}

/* A safetensors file under experts/ or coupled/: every tensor, from the header. */
static enum tmx_status account_file(struct acc *a, const char *path, int experts, char **err) {
    struct tmx_safetensors *st = NULL;
    enum tmx_status s = tmx_safetensors_open(path, &st, err);
    if (s != TMX_OK) return s;
    a->p->n_files++;
    for (size_t i = 0; i < tmx_safetensors_count(st); i++) {
        struct tmx_tensor t;
        const char *name = tmx_safetensors_at(st, i, &t);
        if (experts) account_experts(a, name, &t);
        else {
            add_file(a, &t);
            add(a, TMX_PLAN_CODEC, tmx_tensor_nbytes(&t), 0, 0);
        }
    }
    tmx_safetensors_free(st);
    return TMX_OK;
}

/* Every *.safetensors in dir/sub (experts/ or coupled/); absent: nothing. */
static enum tmx_status account_folder(struct acc *a, const char *dir, const char *sub,
                                      int *found, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    DIR *d = opendir(path);
    if (!d) return TMX_OK;
    enum tmx_status st = TMX_OK;
    struct dirent *e;
    while (st == TMX_OK && (e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".safetensors")) continue;
        snprintf(path, sizeof path, "%s/%s/%s", dir, sub, e->d_name);
        st = account_file(a, path, strcmp(sub, "experts") == 0, err);
        *found = 1;
    }
    closedir(d);
    return st;
}

static int cmp_str(const void *x, const void *y) {
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

/* The distinct shard files of a checkpoint. */
static int count_files(const struct tmx_checkpoint *ck) {
    const size_t n = tmx_checkpoint_count(ck);
    const char **files = malloc((n ? n : 1) * sizeof *files);
    if (!files) return 0;
    for (size_t i = 0; i < n; i++) {
        struct tmx_tensor t;
        tmx_checkpoint_at(ck, i, &t, &files[i]);
    }
    qsort(files, n, sizeof *files, cmp_str);
    int distinct = 0;
    for (size_t i = 0; i < n; i++) distinct += i == 0 || strcmp(files[i], files[i - 1]) != 0;
    free(files);
    return distinct;
}

static enum tmx_status weights_from_files(struct acc *a, const char *dir, const struct quant *q,
                                          char **err) {
    struct tmx_checkpoint *ck = NULL;
    enum tmx_status st = tmx_checkpoint_open(dir, &ck, err);
    if (st != TMX_OK) return st;
    char scale_name[512];
    for (size_t i = 0; i < tmx_checkpoint_count(ck); i++) {
        struct tmx_tensor t, s;
        const char *name = tmx_checkpoint_at(ck, i, &t, NULL);
        int mx = 0;
        snprintf(scale_name, sizeof scale_name, "%s_scale", name);
        if (t.dtype == TMX_DTYPE_F8_E4M3 && tmx_checkpoint_find(ck, scale_name, &s) == 0) mx = 1;
        const size_t n = strlen(name);
        if (t.dtype == TMX_DTYPE_U8 && n > 6 && ends_with(name, "_scale") && n - 6 < 512) {
            memcpy(scale_name, name, n - 6);
            scale_name[n - 6] = '\0';
            if (tmx_checkpoint_find(ck, scale_name, &s) == 0 && s.dtype == TMX_DTYPE_F8_E4M3)
                mx = 2;
        }
        account_model(a, name, &t, mx);
    }
    a->p->n_files += count_files(ck);
    tmx_checkpoint_free(ck);
    int found = 0;
    if ((st = account_folder(a, dir, "experts", &found, err)) != TMX_OK ||
        (st = account_folder(a, dir, "coupled", &found, err)) != TMX_OK)
        return st;
    if (found && strcmp(q->codec, "bf16") == 0)
        return tmx_err(err, TMX_ERR_INVALID, "%s/hf_quant_config.json: missing, but the build "
                       "has experts/ files (their block scales need the codec)", dir);
    return TMX_OK;
}

/* --- the virtual model: docs/model.md's tensors, BF16, experts in the codec ------------------- */

static void vt(struct acc *a, const char *name, enum tmx_dtype dt, int64_t rows, int64_t cols,
               int mx) {
    struct tmx_tensor t = {dt, cols ? 2 : 1, {rows, cols}, NULL};
    account_model(a, name, &t, mx);
}

/* A BF16 matrix, or an MXFP8 pair when the build quantizes attention. */
static void vmat(struct acc *a, const char *name, int64_t rows, int64_t cols, int mxfp8) {
    if (!mxfp8) {
        vt(a, name, TMX_DTYPE_BF16, rows, cols, 0);
        return;
    }
    char scale[320];
    snprintf(scale, sizeof scale, "%s_scale", name);
    vt(a, name, TMX_DTYPE_F8_E4M3, rows, cols, 1);
    vt(a, scale, TMX_DTYPE_U8, rows, cols / 32, 2);
}

/* Experts first..last of a layer as one experts/ file of the codec (§10.2). */
static void vexperts_file(struct acc *a, const struct tmx_model_config *c, const struct quant *q,
                          int64_t n_exp) {
    static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
    const int64_t lat = c->moe_latent_size, inter = c->moe_intermediate_size;
    const double rate = q->block == 32 ? EXC_RATE_BLOCK32 : EXC_RATE_BLOCK16;
    char name[64];
    for (int p = 0; p < 3; p++) {
        const int64_t rows = p < 2 ? inter : lat, cols = p < 2 ? lat : inter;
        const int64_t exc = (int64_t)((double)(n_exp * rows * cols / q->block) * rate + 0.5);
        const struct tmx_tensor ts[5] = {
            {TMX_DTYPE_I32, 4, {n_exp, rows / TILE, cols / TILE, 8 * q->bits}, NULL},
            {TMX_DTYPE_F32, 1, {n_exp}, NULL},
            {TMX_DTYPE_U8, 2, {n_exp, rows * (1 + cols / (2 * q->block))}, NULL},
            {TMX_DTYPE_I32, 1, {exc}, NULL},
            {TMX_DTYPE_I32, 1, {n_exp + 1}, NULL}};
        static const char *const sfx[5] = {"trellis", "scale", "scale_csf",
                                           "scale_csf_exceptions", "scale_csf_starts"};
        for (int i = 0; i < 5; i++) {
            snprintf(name, sizeof name, "%s.%s", proj[p], sfx[i]);
            account_experts(a, name, &ts[i]);
        }
    }
}

static void vlayer_moe(struct acc *a, const char *pre, const struct tmx_model_config *c,
                       const struct quant *q) {
    const int64_t D = c->hidden, lat = c->moe_latent_size, inter = c->moe_intermediate_size;
    const int64_t E = c->n_routed_experts, shared = (int64_t)c->n_shared_experts * inter;
    char name[256];
    snprintf(name, sizeof name, "%smlp.router.weight", pre);
    vt(a, name, TMX_DTYPE_BF16, E, D, 0);
    snprintf(name, sizeof name, "%smlp.router.correction_bias", pre);
    vt(a, name, TMX_DTYPE_F32, E, 0, 0);
    snprintf(name, sizeof name, "%smlp.bridge_in.weight", pre);
    vt(a, name, TMX_DTYPE_BF16, lat, D, 0);
    snprintf(name, sizeof name, "%smlp.bridge_out.weight", pre);
    vt(a, name, TMX_DTYPE_BF16, D, lat, 0);
    snprintf(name, sizeof name, "%smlp.post_expert_norm.weight", pre);
    vt(a, name, TMX_DTYPE_BF16, lat, 0, 0);
    if (shared) {
        snprintf(name, sizeof name, "%smlp.shared_experts.gate_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, shared, D, 0);
        snprintf(name, sizeof name, "%smlp.shared_experts.up_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, shared, D, 0);
        snprintf(name, sizeof name, "%smlp.shared_experts.down_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, D, shared, 0);
    }
    /* Every expert, and every full experts/ file, is alike: one of each is accounted for all,
     * as a loop over up to 2^30 experts (config.json allows) would take minutes. */
    if (strcmp(q->codec, "bf16") != 0) {
        a->copies = (uint64_t)(E / q->per_file);
        if (a->copies) vexperts_file(a, c, q, q->per_file);
        a->copies = 1;
        if (E % q->per_file) vexperts_file(a, c, q, E % q->per_file);
        const int64_t signs[3] = {lat / 8, inter / 8, lat / 8}; /* coupled/ (§10.3) */
        for (int i = 0; i < 3; i++) {
            const struct tmx_tensor t = {TMX_DTYPE_U8, 1, {signs[i]}, NULL};
            add_file(a, &t);
            add(a, TMX_PLAN_CODEC, (uint64_t)signs[i], 0, 0);
        }
        return;
    }
    static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
    a->copies = (uint64_t)E;
    for (int p = 0; p < 3; p++) {
        snprintf(name, sizeof name, "%smlp.experts.0.%s.weight", pre, proj[p]);
        vt(a, name, TMX_DTYPE_BF16, p < 2 ? inter : lat, p < 2 ? lat : inter, 0);
    }
    a->copies = 1;
}

/* q_norm/k_norm are optional in docs/model.md; a Muse model is taken to have them. */
static void weights_virtual(struct acc *a, const struct tmx_model_config *c,
                            const struct quant *q) {
    const int64_t D = c->hidden, hd = c->head_dim, qd = (int64_t)c->n_heads * hd,
                  kvd = (int64_t)c->n_kv_heads * hd;
    const int muse = c->type == TMX_MODEL_MUSE;
    char pre[64], name[256];
    vt(a, "model.embed_tokens.weight", TMX_DTYPE_BF16, c->vocab_size, D, 0);
    for (int l = 0; l < c->n_layers; l++) {
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
        static const char *const norms[2] = {"input_layernorm.weight",
                                             "post_attention_layernorm.weight"};
        for (int i = 0; i < 2; i++) {
            snprintf(name, sizeof name, "%s%s", pre, norms[i]);
            vt(a, name, TMX_DTYPE_BF16, D, 0, 0);
        }
        static const char *const attn[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
        const int64_t rows[4] = {qd, kvd, kvd, D}, cols[4] = {D, D, D, qd};
        for (int i = 0; i < 4; i++) {
            snprintf(name, sizeof name, "%sself_attn.%s.weight", pre, attn[i]);
            vmat(a, name, rows[i], cols[i], q->mxfp8);
        }
        if (muse) {
            snprintf(name, sizeof name, "%sself_attn.q_norm.weight", pre);
            vt(a, name, TMX_DTYPE_BF16, hd, 0, 0);
            snprintf(name, sizeof name, "%sself_attn.k_norm.weight", pre);
            vt(a, name, TMX_DTYPE_BF16, hd, 0, 0);
        }
        if (c->residual_gates) {
            snprintf(name, sizeof name, "%sattn_gate", pre);
            vt(a, name, TMX_DTYPE_BF16, D, 0, 0);
            snprintf(name, sizeof name, "%smlp_gate", pre);
            vt(a, name, TMX_DTYPE_BF16, D, 0, 0);
        }
        if (!c->dense[l]) {
            vlayer_moe(a, pre, c, q);
            continue;
        }
        const int64_t I = c->intermediate_size;
        snprintf(name, sizeof name, "%smlp.gate_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, I, D, 0);
        snprintf(name, sizeof name, "%smlp.up_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, I, D, 0);
        snprintf(name, sizeof name, "%smlp.down_proj.weight", pre);
        vt(a, name, TMX_DTYPE_BF16, D, I, 0);
    }
    vt(a, "model.norm.weight", TMX_DTYPE_BF16, D, 0, 0);
    if (!c->tie_word_embeddings) vt(a, "lm_head.weight", TMX_DTYPE_BF16, c->vocab_size, D, 0);
}

/* --- runtime and KV cache for a context and a number of sequences ----------------------------- */

/* forward.c's view of one configuration: tmx_model_kv_init's clamps applied. */
struct shape {
    int ctx, batch, seqs, n_tokens, max_blocks, full_blocks, sliding_blocks;
};

static struct shape shape_of(const struct tmx_plan *p, int ctx, int seqs) {
    const int bs = p->opt.block_size;
    struct shape s = {.ctx = ctx, .batch = p->opt.batch, .seqs = seqs};
    if (s.batch > ctx) s.batch = ctx;
    if (s.seqs > s.batch) s.seqs = s.batch;
    const int64_t tok = (int64_t)ctx * s.seqs;
    s.n_tokens = tok < (1 << 30) ? (int)tok : 1 << 30;
    s.max_blocks = (int)div_up(ctx, bs);
    s.full_blocks = (int)div_up(s.n_tokens, bs);
    /* pool_blocks: a sequence needs window - 1 + batch positions of a sliding layer (+1 block),
     * and the pool keeps twice that per sequence for prefix hits, at most the full pool */
    const int64_t per_seq = div_up(p->cfg.sliding_window - 1 + s.batch, bs) + 1;
    const int64_t want = 2 * (int64_t)s.seqs * per_seq;
    s.sliding_blocks = want < s.full_blocks ? (int)want : s.full_blocks;
    return s;
}

/* step_buffers_init with the rank's heads and MLP slice; the residual stream, latent, router
 * and the gathered logits are whole on every rank. */
static uint64_t step_buffers(const struct tmx_plan *p, const struct shape *s) {
    const struct tmx_model_config *c = &p->cfg;
    const int tp = p->opt.tp;
    const uint64_t B = (uint64_t)s->batch, S = (uint64_t)s->seqs, F = 4;
    const uint64_t D = (uint64_t)c->hidden, V = (uint64_t)c->vocab_size;
    const uint64_t qd = (uint64_t)(c->n_heads / tp) * (uint64_t)c->head_dim;
    const uint64_t kvd = (uint64_t)(c->n_kv_heads / tp) * (uint64_t)c->head_dim;
    int64_t ffn = c->intermediate_size;
    if ((int64_t)c->n_shared_experts * c->moe_intermediate_size > ffn)
        ffn = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
    const uint64_t ffn_r = (uint64_t)rank_extent(ffn, TILE, tp);
    const uint64_t E = (uint64_t)c->n_routed_experts, K = (uint64_t)c->n_experts_per_tok;
    const uint64_t lat = (uint64_t)c->moe_latent_size, T = S * (uint64_t)s->max_blocks * 4;
    return 4 * B * 4 + 3 * B * D * F + 2 * B * qd * F + 2 * B * kvd * F + 2 * B * ffn_r * F +
           B * E * F + 2 * B * K * 4 + 2 * B * lat * F + S * D * F + S * V * F + 2 * B * 4 +
           2 * T;
}

/* kernels.cuda's scratch: the largest request (a BF16 matmul of more than 8 rows splits its
 * input into hi/lo BF16 halves, and an MXFP8 one also expands its weight to BF16 there; BF16
 * experts keep [pairs][inter + latent] F32), twice, because the set grows it by doubling and
 * keeps the outgrown blocks for recorded graphs. */
static uint64_t kernel_scratch(const struct tmx_plan *p, int batch) {
    const struct tmx_model_config *c = &p->cfg;
    const int tp = p->opt.tp;
    int64_t k = c->hidden;
    const int64_t qd_r = (int64_t)(c->n_heads / tp) * c->head_dim;
    int64_t ffn = c->intermediate_size;
    if ((int64_t)c->n_shared_experts * c->moe_intermediate_size > ffn)
        ffn = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
    const int64_t widths[3] = {qd_r, c->moe_latent_size, rank_extent(ffn, TILE, tp)};
    for (int i = 0; i < 3; i++)
        if (widths[i] > k) k = widths[i];
    uint64_t need = 2 * align256((uint64_t)batch * (uint64_t)k * 2);
    if (p->attention_mxfp8 && batch > 8) /* q_proj and o_proj: the largest, [qd_r][hidden] */
        need += align256((uint64_t)qd_r * (uint64_t)c->hidden * 2);
    if (strcmp(p->experts_codec, "bf16") == 0 && c->n_routed_experts) {
        const uint64_t pairs = (uint64_t)batch * (uint64_t)c->n_experts_per_tok;
        const uint64_t inter_r = (uint64_t)rank_extent(c->moe_intermediate_size, TILE, tp);
        const uint64_t moe = pairs * (inter_r + (uint64_t)c->moe_latent_size) * 4;
        if (moe > need) need = moe;
    }
    return 2 * need;
}

/* plugins/trellis/cuda buffers_layout for n tokens, P = n * top_k pairs (groups <= P), with the
 * rank's slice of the expert width. */
static uint64_t codec_scratch(const struct tmx_plan *p, int batch) {
    const struct tmx_model_config *c = &p->cfg;
    if (strcmp(p->experts_codec, "bf16") == 0 || !c->n_routed_experts) return 0;
    const uint64_t n = (uint64_t)batch, P = n * (uint64_t)c->n_experts_per_tok;
    const uint64_t lat = (uint64_t)c->moe_latent_size;
    const uint64_t inter = (uint64_t)rank_extent(c->moe_intermediate_size, TILE, p->opt.tp);
    const uint64_t per_pair = 4 + 4 + 16 + 2 * inter * 4 + inter + 4 + inter / 16 * 4 + lat * 4;
    return P * per_pair + n * (lat + 4 + lat / 16 * 4) + 14 * 256;
}

struct fill {
    uint64_t step, scratch, codec, kv_full, kv_sliding, total;
};

static struct fill fill_of(const struct tmx_plan *p, const struct shape *s) {
    const uint64_t bs = (uint64_t)p->opt.block_size;
    struct fill f = {.step = step_buffers(p, s), .scratch = kernel_scratch(p, s->batch),
                     .codec = codec_scratch(p, s->batch)};
    f.kv_full = p->n_full ? (uint64_t)s->full_blocks * bs * p->kv_full_token : 0;
    f.kv_sliding = p->n_sliding ? (uint64_t)s->sliding_blocks * bs * p->kv_sliding_token : 0;
    f.total = p->weights + f.step + f.scratch + f.codec + p->reserve + f.kv_full + f.kv_sliding;
    return f;
}

static int fits(const struct tmx_plan *p, int ctx, int seqs) {
    const struct shape s = shape_of(p, ctx, seqs);
    return fill_of(p, &s).total <= p->opt.gpu_bytes;
}

/* The largest x in [1, hi] with ok(x), given ok is monotone (more never fits better); 0: none. */
static int search(const struct tmx_plan *p, int hi, int fixed, int by_ctx) {
    int lo = 0; /* ok(lo) holds, or lo = 0 */
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (by_ctx ? fits(p, mid, fixed) : fits(p, fixed, mid)) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* --- the plan --------------------------------------------------------------------------------- */

static enum tmx_status options(const struct tmx_model_config *c, struct tmx_plan_options *o,
                               char **err) {
    if (o->tp < 0 || o->n_gpus < 0 || o->context < 0 || o->seqs < 0 || o->batch < 0 ||
        o->block_size < 0)
        return tmx_err(err, TMX_ERR_INVALID, "--tp, --gpus, --context, --seqs, --batch and "
                       "--block-size must be positive");
    if (!o->tp) o->tp = o->n_gpus ? o->n_gpus : 1;
    if (o->n_gpus && o->n_gpus != o->tp)
        return tmx_err(err, TMX_ERR_INVALID, "--gpus: %d GPUs for --tp %d (one rank per GPU; "
                       "tmx has no pipeline or data parallelism)", o->n_gpus, o->tp);
    if (c->n_kv_heads % o->tp)
        return tmx_err(err, TMX_ERR_INVALID, "--tp %d: the model's %d KV heads "
                       "(config.json num_key_value_heads) do not split evenly over %d ranks",
                       o->tp, c->n_kv_heads, o->tp);
    if (!o->context) o->context = c->max_position_embeddings;
    if (o->context > c->max_position_embeddings)
        return tmx_err(err, TMX_ERR_INVALID, "--context %d: above the model's "
                       "max_position_embeddings, %d (config.json)", o->context,
                       c->max_position_embeddings);
    if (!o->seqs) o->seqs = 1;
    if (o->seqs > 4096)
        return tmx_err(err, TMX_ERR_INVALID, "--seqs %d: at most 4096 (config key max_running)",
                       o->seqs);
    if (!o->batch) o->batch = 512;
    if (!o->block_size) o->block_size = 16;
    if (o->block_size > 4096)
        return tmx_err(err, TMX_ERR_INVALID, "--block-size %d: at most 4096", o->block_size);
    if ((int64_t)o->context * (o->seqs < o->batch ? o->seqs : o->batch) > (1 << 30))
        return tmx_err(err, TMX_ERR_INVALID, "--context x --seqs: %lld positions, more than the "
                       "cache's 2^30", (long long)o->context * o->seqs);
    if (tmx_kv_dtype_name(o->kv_dtype)[0] == '?')
        return tmx_err(err, TMX_ERR_INVALID, "--kv: not f32, bf16, fp8 or int8");
    if (!o->reserve) o->reserve = TMX_PLAN_RESERVE;
    return TMX_OK;
}

static enum tmx_status weights(const char *dir, struct tmx_plan *p, char **err) {
    struct quant q;
    enum tmx_status st = quant_load(dir, &q, err);
    if (st == TMX_OK && p->opt.virtual_model) st = quant_override(&p->opt, &q, err);
    else if (st == TMX_OK && (p->opt.experts || p->opt.bits))
        st = tmx_err(err, TMX_ERR_INVALID, "--experts and --bits describe a --virtual model; "
                     "a real checkpoint's headers say what it holds");
    if (st != TMX_OK) return st;
    snprintf(p->experts_codec, sizeof p->experts_codec, "%s", q.codec);
    p->experts_bits = q.bits;
    p->experts_block = q.block;
    p->attention_mxfp8 = q.mxfp8;
    const struct tmx_model_config *c = &p->cfg;
    if (p->opt.virtual_model && strcmp(q.codec, "bf16") != 0 && c->n_routed_experts &&
        (c->moe_latent_size % 128 || c->moe_intermediate_size % 128))
        return tmx_err(err, TMX_ERR_INVALID, "%s/config.json: %s needs moe_latent_size and "
                       "moe_intermediate_size that are multiples of 128", dir, q.codec);
    struct acc a = {.p = p, .tp = p->opt.tp, .block = q.block ? q.block : 32, .copies = 1};
    if (p->opt.virtual_model) weights_virtual(&a, &p->cfg, &q);
    else if ((st = weights_from_files(&a, dir, &q, err)) != TMX_OK) return st;
    for (int i = 0; i < TMX_PLAN_N_PARTS; i++) {
        if (i < TMX_PLAN_N_SHARDED) p->sharded += p->part_rank[i];
        else p->replicated += p->part_rank[i];
    }
    p->weights = p->sharded + p->replicated;
    return TMX_OK;
}

/* Bytes per cached position of all layers of one kind: K and V of the rank's KV heads, plus one
 * F32 scale per head each for fp8/int8 (forward.c cache_init). */
static void kv_per_token(struct tmx_plan *p) {
    const struct tmx_model_config *c = &p->cfg;
    const enum tmx_dtype dt = p->opt.kv_dtype;
    const int scaled = dt == TMX_DTYPE_F8_E4M3 || dt == TMX_DTYPE_I8;
    const uint64_t per_layer = 2 * (uint64_t)(c->n_kv_heads / p->opt.tp) *
                               ((uint64_t)c->head_dim * tmx_dtype_size(dt) + (scaled ? 4 : 0));
    for (int l = 0; l < c->n_layers; l++) {
        if (c->sliding[l]) p->n_sliding++;
        else p->n_full++;
    }
    p->kv_full_token = (uint64_t)p->n_full * per_layer;
    p->kv_sliding_token = (uint64_t)p->n_sliding * per_layer;
}

enum tmx_status tmx_plan_compute(const char *dir, const struct tmx_plan_options *o,
                                 struct tmx_plan *p, char **err) {
    memset(p, 0, sizeof *p);
    p->opt = *o;
    enum tmx_status st = tmx_model_config_load(dir, &p->cfg, err);
    if (st == TMX_OK) st = options(&p->cfg, &p->opt, err);
    if (st == TMX_OK) st = weights(dir, p, err);
    if (st != TMX_OK) return st;
    kv_per_token(p);
    p->reserve = p->opt.reserve;
    const struct shape s = shape_of(p, p->opt.context, p->opt.seqs);
    const struct fill f = fill_of(p, &s);
    p->batch = s.batch;
    p->seqs = s.seqs;
    p->step_buffers = f.step;
    p->kernel_scratch = f.scratch;
    p->codec_scratch = f.codec;
    p->runtime = f.step + f.scratch + f.codec + p->reserve;
    p->full_blocks = p->n_full ? s.full_blocks : 0;
    p->sliding_blocks = p->n_sliding ? s.sliding_blocks : 0;
    p->kv_full = f.kv_full;
    p->kv_sliding = f.kv_sliding;
    p->kv = f.kv_full + f.kv_sliding;
    p->total = f.total;
    if (!p->opt.n_gpus) return TMX_OK;
    p->fits = f.total <= p->opt.gpu_bytes;
    p->headroom = (int64_t)p->opt.gpu_bytes - (int64_t)f.total;
    const int max_pos = p->cfg.max_position_embeddings;
    const int ctx_hi = (int)((1 << 30) / p->opt.seqs) < max_pos ? (1 << 30) / p->opt.seqs : max_pos;
    p->max_context = search(p, ctx_hi, p->opt.seqs, 1);
    p->max_context_capped = p->max_context == max_pos;
    const int seq_hi = s.batch;
    p->max_seqs = search(p, seq_hi, p->opt.context, 0);
    p->max_seqs_capped = p->max_seqs == seq_hi;
    return TMX_OK;
}
