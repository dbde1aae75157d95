/* engine.c: opening a model directory end to end — config, plugins, kernel set, checkpoint,
 * graph, tokenizer — and closing it in reverse order.
 *
 * Tensor parallelism (config key tp, docs/tp.md). The ranks of one model are N tmx_models, each
 * with its own kernel-set instance. Where they live depends on how tmx was started:
 *   threads  one process: rank 0 on the caller's thread, ranks 1..N-1 on threads of their own
 *            that run tmx_model_follow until the engine closes;
 *   mpi      under mpirun, one rank per process (N = the number of processes): the engine of
 *            rank 0 is the one that answers; the others' callers run tmx_engine_follow.
 * On a GPU kernel set each rank drives the device `device` + its (local) rank, and the step's
 * collectives go through NCCL, booted through the threads or mpi communicator. Every rank
 * starts up in the same phases (kernel set, NCCL, weights, KV cache) and learns after each one
 * whether all ranks got through it, so that a failure on one rank never leaves another waiting
 * in a collective. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tmx/comm.h"
#include "tmx/kvcache.h"
#include "tmx/log.h"
#include "tmx/manifest.h"
#include "tmx/tmx.h"

/* One rank of the model held by this process. */
struct rank {
    struct tmx_engine *e;
    int index;               /* the rank's number among all ranks */
    int device_offset;       /* added to a GPU set's option "device" */
    tmx_comm_t *ctl;         /* borrowed: the group's or the engine's mpi communicator; NULL
                                with one rank */
    tmx_comm_t *nccl;        /* owned: a GPU set's data communicator, or NULL */
    struct tmx_kernels k;    /* this rank's kernel set instance (k.ctx owned unless own_k 0) */
    int own_k;
    struct tmx_opts *opts;   /* owned when own_k: the options k was started with */
    struct tmx_model *model; /* owned */
    pthread_t thread;        /* ranks 1..N-1 of the threads backend */
    int started;
    enum tmx_status st;      /* a thread rank's start-up result, and its message */
    char *err;
    int failed_here;         /* a start-up phase failed on this rank itself (not on another) */
};

struct tmx_engine {
    struct tmx_config *cfg;
    struct tmx_plugins *plugins;
    struct tmx_kernels kernels; /* the configured kernel set; ranks[0] uses it unless moved */
    struct tmx_checkpoint *ck;
    struct tmx_model *model;    /* ranks[0]'s */
    struct tmx_tokenizer *tok;
    int tp;                     /* ranks in all */
    tmx_comm_group_t *group;    /* threads backend */
    tmx_comm_t *mpi;            /* mpi backend */
    struct rank *ranks;         /* [n_local]; ranks[0] runs on the caller's thread */
    int n_local;
    int up;                     /* every rank started: the followers wait for steps */
    pthread_mutex_t load_mu;    /* thread ranks load their weights one at a time (the plugin
                                   registry is not shared between threads) */
};

/* A quantized build vouches for its files (tmx/manifest.h): their sizes and the absence of stray
 * expert files always, their SHA-256 with config key "verify". Checked before any is opened, so
 * that damage is reported by file name rather than as a parse error. */
static enum tmx_status verify_build(const char *dir, const struct tmx_config *cfg, char **err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TMX_MANIFEST_NAME);
    if (access(path, F_OK) != 0) return TMX_OK;
    return tmx_manifest_verify(dir, tmx_config_bool(cfg, "verify"), err);
}

/* Every tokenizer id must index the model's embedding rows; checked once both are read, so that
 * an id the model lacks is named here rather than failing a step that meets it. */
static enum tmx_status check_vocab(const char *dir, const char *tok_path,
                                   const struct tmx_tokenizer *tok, char **err) {
    struct tmx_model_config mc;
    enum tmx_status st = tmx_model_config_load(dir, &mc, err);
    const int n_tok = tmx_tokenizer_n_vocab(tok);
    if (st != TMX_OK || n_tok <= mc.vocab_size) return st;
    return tmx_err(err, TMX_ERR_INVALID, "%s: token id %d is not below the model's vocab_size "
                   "(%d, %s/config.json)", tok_path, n_tok - 1, mc.vocab_size, dir);
}

static int n_ctx_of(const struct tmx_config *cfg, const struct tmx_model *m) {
    const int64_t want = tmx_config_int(cfg, "context");
    const int max = tmx_model_cfg(m)->max_position_embeddings;
    return want > 0 && want < max ? (int)want : max;
}

/* The KV cache from the config: room for max_running sequences of the context by default. Every
 * rank gets the same options. */
static enum tmx_status kv_init(const struct tmx_config *cfg, struct tmx_model *m, char **err) {
    const struct tmx_kv_options o = {
        .n_ctx = n_ctx_of(cfg, m),
        .n_batch = (int)tmx_config_int(cfg, "batch"),
        .max_seqs = (int)tmx_config_int(cfg, "max_running"),
        .block_size = (int)tmx_config_int(cfg, "kv_block_size"),
        .n_tokens = (int)tmx_config_int(cfg, "kv_tokens"),
        .dtype = tmx_kv_dtype_parse(tmx_config_str(cfg, "kv_dtype")),
        .prefix_cache = tmx_config_bool(cfg, "prefix_cache"),
        .graphs = tmx_config_bool(cfg, "graphs"),
    };
    return tmx_model_kv_init(m, &o, err);
}

/* --- ranks --------------------------------------------------------------------------------- */

/* Another instance of the configured kernel set, with option "device" (when the set has one)
 * moved by the rank's offset. */
static enum tmx_status rank_kernels(struct rank *r, char **err) {
    struct tmx_engine *e = r->e;
    const struct tmx_plugin *p = e->kernels.plugin;
    const char *path = NULL;
    for (size_t i = 0; i < tmx_plugins_count(e->plugins); i++)
        if (tmx_plugins_at(e->plugins, i, &path) == p) break;
    enum tmx_status st = tmx_config_plugin_opts(e->cfg, p, path, &r->opts, err);
    if (st != TMX_OK) return st;
    tmx_opts_set_int(r->opts, "device", tmx_opts_int(r->opts, "device") + r->device_offset);
    char *why = NULL;
    void *ctx = NULL;
    if ((st = e->kernels.ops->init(tmx_host_get(), r->opts, &ctx, &why)) != TMX_OK) {
        e->kernels.ops->fini(ctx);
        tmx_err(err, st, "kernels.%s (rank %d): %s", p->name, r->index,
                why ? why : tmx_status_str(st));
        free(why);
        return st;
    }
    r->k = (struct tmx_kernels){p, e->kernels.ops, ctx};
    r->own_k = 1;
    return TMX_OK;
}

/* After a start-up phase: whether every rank got through it. A rank that failed keeps its own
 * message; the others get one naming the first rank that failed. */
static enum tmx_status agree(struct rank *r, enum tmx_status st, char **err) {
    r->failed_here |= st != TMX_OK;
    if (!r->ctl) return st;
    const int n = tmx_comm_size(r->ctl);
    int32_t mine = (int32_t)st, *all = malloc((size_t)n * sizeof *all);
    char *cerr = NULL;
    enum tmx_status cs = all ? tmx_comm_allgather(r->ctl, &mine, all, sizeof mine, &cerr)
                             : TMX_ERR_NOMEM;
    for (int i = 0; cs == TMX_OK && st == TMX_OK && i < n; i++)
        if (all[i] != TMX_OK)
            st = tmx_err(err, (enum tmx_status)all[i], "rank %d of tp = %d failed to start",
                         i, n);
    free(all);
    if (cs != TMX_OK && st == TMX_OK) {
        st = tmx_err(err, cs, "rank %d: %s", r->index, cerr ? cerr : "out of memory");
    }
    free(cerr);
    return st;
}

/* Whether kernel set p has an int option "device" (a GPU set). */
static int has_device(const struct tmx_plugin *p) {
    for (const struct tmx_option *o = p->opts; o && o->name; o++)
        if (o->type == TMX_OPT_INT && strcmp(o->name, "device") == 0) return 1;
    return 0;
}

/* The phases every rank goes through, each followed by agree(). ranks[0] runs on the
 * configured kernel set instance unless its device moves; the others get their own. */
static enum tmx_status rank_up(struct rank *r, char **err) {
    struct tmx_engine *e = r->e;
    enum tmx_status st = TMX_OK;
    if (r != &e->ranks[0] || (r->device_offset && has_device(e->kernels.plugin)))
        st = rank_kernels(r, err);
    else
        r->k = e->kernels;
    if ((st = agree(r, st, err)) != TMX_OK) return st;
    if (r->ctl && !(r->k.plugin->caps & TMX_CAP_HOST_MEMORY)) {
        const struct tmx_kernels_i *op = r->k.ops;
        if ((st = tmx_comm_nccl_new(r->ctl, &r->nccl, err)) != TMX_OK) return st;
        tmx_comm_set_stream(r->nccl, TMX_OPS_HAS(op, native_stream)
                                         ? op->native_stream(r->k.ctx) : NULL);
    }
    const struct tmx_model_tp tp = {r->ctl, r->nccl ? r->nccl : r->ctl};
    if (e->n_local > 1) pthread_mutex_lock(&e->load_mu);
    st = tmx_model_load_rank(e->ck, &r->k, e->plugins, &tp, &r->model, err);
    if (e->n_local > 1) pthread_mutex_unlock(&e->load_mu);
    if ((st = agree(r, st, err)) != TMX_OK) return st;
    return agree(r, kv_init(e->cfg, r->model, err), err);
}

/* Frees what rank_up made, in reverse. */
static void rank_down(struct rank *r) {
    tmx_model_free(r->model);
    r->model = NULL;
    tmx_comm_free(r->nccl);
    r->nccl = NULL;
    if (r->own_k) tmx_kernels_close(&r->k);
    tmx_opts_free(r->opts);
    r->opts = NULL;
    r->own_k = 0;
}

/* A follower thread: starts, follows rank 0's steps until the engine closes, stops. */
static void *rank_main(void *arg) {
    struct rank *r = arg;
    r->st = rank_up(r, &r->err);
    if (r->st == TMX_OK) {
        char *err = NULL;
        if (tmx_model_follow(r->model, &err) != TMX_OK)
            tmx_log(TMX_LOG_ERROR, "rank %d: %s", r->index, err ? err : "out of memory");
        free(err);
    }
    rank_down(r);
    return NULL;
}

/* Threads for 0 (one per core) split between the ranks on this machine, at least one each:
 * the kernel sets' and codecs' pools then share the cores instead of each taking all. */
static enum tmx_status share_cores(struct tmx_config *cfg, int ranks_here, char **err) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (ranks_here < 2 || tmx_config_int(cfg, "threads") != 0 || online < 1) return TMX_OK;
    char set[64];
    snprintf(set, sizeof set, "threads=%ld", online / ranks_here > 0 ? online / ranks_here : 1);
    return tmx_config_set(cfg, set, err);
}

/* Which ranks this process holds: under mpirun its one rank of the processes (config tp must
 * be 1 or their number), else tp ranks on threads. */
static enum tmx_status place_ranks(struct tmx_engine *e, char **err) {
    e->tp = (int)tmx_config_int(e->cfg, "tp");
    int index = 0, offset = 0, ranks_here = e->tp;
    if (tmx_comm_mpi_launched()) {
        enum tmx_status st = tmx_comm_mpi_new(&e->mpi, err);
        if (st != TMX_OK) return st;
        const int size = tmx_comm_size(e->mpi);
        if (e->tp != 1 && e->tp != size)
            return tmx_err(err, TMX_ERR_INVALID, "tp = %d, but mpirun started %d processes "
                           "(one rank each): leave tp at 1 or make them equal", e->tp, size);
        e->tp = size;
        index = tmx_comm_rank(e->mpi);
        const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        const char *local_n = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        offset = local && *local ? atoi(local) : index;
        ranks_here = local_n && *local_n ? atoi(local_n) : 1;
        if (size == 1) {
            tmx_comm_free(e->mpi);
            e->mpi = NULL;
        }
    }
    const int n_local = e->mpi ? 1 : e->tp;
    if (!(e->ranks = calloc((size_t)n_local, sizeof *e->ranks)))
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    e->n_local = n_local;
    if (e->n_local > 1) {
        enum tmx_status st = tmx_comm_group_new(e->n_local, &e->group, err);
        if (st != TMX_OK) return st;
    }
    for (int i = 0; i < e->n_local; i++)
        e->ranks[i] = (struct rank){
            .e = e, .index = e->mpi ? index : i, .device_offset = e->mpi ? offset : i,
            .ctl = e->mpi ? e->mpi : e->group ? tmx_comm_group_rank(e->group, i) : NULL};
    return share_cores(e->cfg, ranks_here, err);
}

/* Starts every rank of this process: the thread ranks on their threads, ranks[0] here. The
 * message of a failure is the failing rank's own when this process knows it. */
static enum tmx_status start_ranks(struct tmx_engine *e, char **err) {
    for (int i = 1; i < e->n_local; i++) {
        struct rank *r = &e->ranks[i];
        if (pthread_create(&r->thread, NULL, rank_main, r) != 0) {
            /* ranks that did start wait for this one in their first agree(): none can go on */
            tmx_log(TMX_LOG_ERROR, "cannot start the thread of rank %d; aborting", i);
            abort();
        }
        r->started = 1;
    }
    char *own = NULL;
    enum tmx_status st = rank_up(&e->ranks[0], &own);
    if (st == TMX_OK) {
        e->model = e->ranks[0].model;
        e->up = 1;
        return TMX_OK;
    }
    rank_down(&e->ranks[0]);
    for (int i = 1; i < e->n_local; i++) { /* they stop after the same agree() */
        pthread_join(e->ranks[i].thread, NULL);
        e->ranks[i].started = 0;
    }
    for (int i = 1; i < e->n_local && !e->ranks[0].failed_here; i++) {
        const struct rank *r = &e->ranks[i]; /* the first that failed by itself */
        if (!r->failed_here) continue;
        free(own);
        return tmx_err(err, r->st, "rank %d: %s", r->index, r->err ? r->err : "out of memory");
    }
    if (err) *err = own;
    else free(own);
    return st;
}

/* --- the engine ---------------------------------------------------------------------------- */

enum tmx_status tmx_engine_open(const char *model_dir, const char *config_path, int n_overrides,
                                const char *const *overrides, struct tmx_engine **out,
                                char **err) {
    struct tmx_engine *e = calloc(1, sizeof *e);
    if (!e) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&e->load_mu, NULL);
    enum tmx_status st = tmx_config_load(config_path, &e->cfg, err);
    for (int i = 0; st == TMX_OK && i < n_overrides; i++)
        st = tmx_config_set(e->cfg, overrides[i], err);
    if (st == TMX_OK) st = place_ranks(e, err);
    /* what a process needs once, whatever ranks it holds */
    if (st == TMX_OK) st = tmx_plugins_new(e->cfg, &e->plugins, err);
    if (st == TMX_OK) st = tmx_plugins_load_configured(e->plugins, err);
    if (st == TMX_OK) st = tmx_kernels_open(e->plugins, NULL, &e->kernels, err);
    if (st == TMX_OK) st = verify_build(model_dir, e->cfg, err);
    if (st == TMX_OK) st = tmx_checkpoint_open(model_dir, &e->ck, err);
    if (st == TMX_OK) {
        char path[4096];
        snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
        st = tmx_tokenizer_load(path, &e->tok, err);
        if (st == TMX_OK) st = check_vocab(model_dir, path, e->tok, err);
    }
    if (e->mpi && e->ranks) { /* the processes learn whether all of them got this far */
        struct rank *r = &e->ranks[0];
        char *mine = NULL;
        enum tmx_status all = agree(r, st, st == TMX_OK ? &mine : NULL);
        if (st == TMX_OK && all != TMX_OK && err) *err = mine;
        else free(mine);
        st = all;
    }
    if (st == TMX_OK) st = start_ranks(e, err);
    if (st != TMX_OK) {
        tmx_engine_free(e);
        return st;
    }
    *out = e;
    return TMX_OK;
}

void tmx_engine_free(struct tmx_engine *e) {
    if (!e) return;
    if (e->up && e->ranks[0].index == 0) { /* the followers return from tmx_model_follow */
        char *err = NULL;
        if (tmx_model_stop(e->model, &err) != TMX_OK)
            tmx_log(TMX_LOG_ERROR, "stopping the ranks: %s", err ? err : "out of memory");
        free(err);
    }
    for (int i = 1; i < e->n_local; i++)
        if (e->ranks[i].started) pthread_join(e->ranks[i].thread, NULL);
    for (int i = 0; i < e->n_local; i++) {
        if (i == 0) rank_down(&e->ranks[0]);
        free(e->ranks[i].err);
    }
    free(e->ranks);
    tmx_tokenizer_free(e->tok);
    tmx_checkpoint_free(e->ck);
    if (e->kernels.ops) tmx_kernels_close(&e->kernels);
    tmx_plugins_free(e->plugins);
    tmx_comm_group_free(e->group);
    tmx_comm_free(e->mpi);
    tmx_config_free(e->cfg);
    pthread_mutex_destroy(&e->load_mu);
    free(e);
}

int tmx_engine_rank(const struct tmx_engine *e) { return e->ranks[0].index; }
int tmx_engine_tp(const struct tmx_engine *e) { return e->tp; }

enum tmx_status tmx_engine_follow(struct tmx_engine *e, char **err) {
    if (e->ranks[0].index == 0)
        return tmx_err(err, TMX_ERR_INVALID, "rank 0 runs the steps; only ranks 1..%d under "
                       "mpirun follow", e->tp - 1);
    return tmx_model_follow(e->model, err);
}

const struct tmx_config *tmx_engine_config(const struct tmx_engine *e) { return e->cfg; }
struct tmx_model *tmx_engine_model(struct tmx_engine *e) { return e->model; }
const struct tmx_tokenizer *tmx_engine_tokenizer(const struct tmx_engine *e) { return e->tok; }
const struct tmx_plugins *tmx_engine_plugins(const struct tmx_engine *e) { return e->plugins; }
struct tmx_plugins *tmx_engine_plugins_mut(struct tmx_engine *e) { return e->plugins; }
const char *tmx_engine_model_dir(const struct tmx_engine *e) { return tmx_checkpoint_dir(e->ck); }

int tmx_engine_n_vocab(const struct tmx_engine *e) {
    const int n_tok = tmx_tokenizer_n_vocab(e->tok), n_model = tmx_model_cfg(e->model)->vocab_size;
    return n_tok < n_model ? n_tok : n_model;
}

int tmx_engine_n_ctx(const struct tmx_engine *e) { return n_ctx_of(e->cfg, e->model); }

void tmx_free(void *p) { free(p); }
