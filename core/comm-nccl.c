/* comm-nccl.c: the nccl backend of tmx/comm.h, one rank per GPU.
 *
 * libnccl.so.2 (or $TMX_NCCL_LIBRARY) is opened with dlopen on the first tmx_comm_nccl_new, so
 * that neither building nor running tmx needs NCCL or CUDA headers: streams are void * and
 * buffers are whatever device addresses the caller passes. Every collective is queued on the
 * communicator's stream and returns at once; its result is there when the stream has reached
 * it (cudaStreamSynchronize, or later work on the same stream).
 *
 * Sums are NCCL's own: each element is reduced once and the result sent to every rank (ring
 * and tree alike), so all ranks hold the same bits; the order of the additions is NCCL's
 * algorithm's, which depends on the size, the topology and NCCL_ALGO / NCCL_PROTO, and BF16 is
 * rounded after each addition. Same machine, same NCCL, same settings: same results, but not
 * the threads and mpi backends' rank-order F32 sum. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm-impl.h"

/* The part of nccl.h used here, with its values (stable through NCCL 2.x; BF16 since 2.10):
 * ncclUniqueId is 128 bytes (NCCL_UNIQUE_ID_BYTES); ncclResult_t ncclSuccess = 0; ncclRedOp_t
 * ncclSum = 0; ncclDataType_t ncclUint8 = 1, ncclFloat32 = 7, ncclBfloat16 = 9. NCCL's enums
 * are int-sized, so they pass as int. */
typedef struct {
    char internal[128];
} nccl_unique_id;
typedef struct nccl_comm *nccl_comm_t;
enum { NCCL_SUCCESS = 0, NCCL_SUM = 0, NCCL_UINT8 = 1, NCCL_FLOAT32 = 7, NCCL_BFLOAT16 = 9 };

static struct {
    int (*get_unique_id)(nccl_unique_id *id);
    int (*comm_init_rank)(nccl_comm_t *comm, int nranks, nccl_unique_id id, int rank);
    int (*comm_destroy)(nccl_comm_t comm);
    int (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op,
                      nccl_comm_t comm, void *stream);
    int (*all_gather)(const void *send, void *recv, size_t count, int dtype, nccl_comm_t comm,
                      void *stream);
    int (*broadcast)(const void *send, void *recv, size_t count, int dtype, int root,
                     nccl_comm_t comm, void *stream);
    const char *(*get_error_string)(int result);
    const char *(*get_last_error)(nccl_comm_t comm); /* NCCL >= 2.13; else NULL */
    int (*mem_alloc)(void **ptr, size_t size);       /* NCCL >= 2.19; else NULL */
    int (*mem_free)(void *ptr);
} nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_missing[512]; /* why NCCL could not be loaded; empty once it is */

static void nccl_load(void) {
    const char *env = getenv("TMX_NCCL_LIBRARY");
    const char *name = env && *env ? env : "libnccl.so.2";
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(nccl_missing, sizeof nccl_missing,
                 "comm (nccl): cannot open %s (install NCCL or set TMX_NCCL_LIBRARY): %s", name,
                 why ? why : "unknown reason");
        return;
    }
    const struct {
        const char *name;
        void *slot;
        int required;
    } syms[] = {
        {"ncclGetUniqueId", &nccl.get_unique_id, 1},
        {"ncclCommInitRank", &nccl.comm_init_rank, 1},
        {"ncclCommDestroy", &nccl.comm_destroy, 1},
        {"ncclAllReduce", &nccl.all_reduce, 1},
        {"ncclAllGather", &nccl.all_gather, 1},
        {"ncclBroadcast", &nccl.broadcast, 1},
        {"ncclGetErrorString", &nccl.get_error_string, 1},
        {"ncclGetLastError", &nccl.get_last_error, 0},
        {"ncclMemAlloc", &nccl.mem_alloc, 0},
        {"ncclMemFree", &nccl.mem_free, 0},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *sym = dlsym(lib, syms[i].name);
        if (!sym && syms[i].required) {
            snprintf(nccl_missing, sizeof nccl_missing, "comm (nccl): %s has no %s", name,
                     syms[i].name);
            memset(&nccl, 0, sizeof nccl);
            dlclose(lib);
            return;
        }
        memcpy(syms[i].slot, &sym, sizeof sym); /* object to function pointer, as POSIX allows */
    }
    if (!nccl.mem_free) nccl.mem_alloc = NULL;
}

struct ncomm {
    struct tmx_comm base;
    nccl_comm_t comm;
    void *one; /* [1] device byte that barriers all-reduce; NULL without ncclMemAlloc */
};

static enum tmx_status nccl_fail(nccl_comm_t comm, int rc, const char *what, char **err) {
    const char *last = nccl.get_last_error ? nccl.get_last_error(comm) : NULL;
    return tmx_err(err, TMX_ERR_DEVICE, "comm (nccl): %s: %s%s%s", what,
                   nccl.get_error_string(rc), last && *last ? ": " : "", last ? last : "");
}

static enum tmx_status n_allreduce(tmx_comm_t *c, void *buf, size_t count, enum tmx_dtype dtype,
                                   char **err) {
    struct ncomm *nc = (struct ncomm *)c;
    if (!count) return TMX_OK;
    int rc = nccl.all_reduce(buf, buf, count,
                             dtype == TMX_DTYPE_F32 ? NCCL_FLOAT32 : NCCL_BFLOAT16, NCCL_SUM,
                             nc->comm, c->stream);
    return rc == NCCL_SUCCESS ? TMX_OK : nccl_fail(nc->comm, rc, "ncclAllReduce", err);
}

static enum tmx_status n_allgather(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                   char **err) {
    struct ncomm *nc = (struct ncomm *)c;
    if (!nbytes) return TMX_OK;
    int rc = nccl.all_gather(send, recv, nbytes, NCCL_UINT8, nc->comm, c->stream);
    return rc == NCCL_SUCCESS ? TMX_OK : nccl_fail(nc->comm, rc, "ncclAllGather", err);
}

static enum tmx_status n_broadcast(tmx_comm_t *c, void *buf, size_t nbytes, int root,
                                   char **err) {
    struct ncomm *nc = (struct ncomm *)c;
    if (!nbytes) return TMX_OK;
    int rc = nccl.broadcast(buf, buf, nbytes, NCCL_UINT8, root, nc->comm, c->stream);
    return rc == NCCL_SUCCESS ? TMX_OK : nccl_fail(nc->comm, rc, "ncclBroadcast", err);
}

/* A one-byte all-reduce: queued like the others, passed when the stream reaches it. */
static enum tmx_status n_barrier(tmx_comm_t *c, char **err) {
    struct ncomm *nc = (struct ncomm *)c;
    if (!nc->one)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "comm (nccl): barrier needs ncclMemAlloc (NCCL 2.19 or later)");
    int rc = nccl.all_reduce(nc->one, nc->one, 1, NCCL_UINT8, NCCL_SUM, nc->comm, c->stream);
    return rc == NCCL_SUCCESS ? TMX_OK : nccl_fail(nc->comm, rc, "ncclAllReduce (barrier)", err);
}

static void n_free(tmx_comm_t *c) {
    struct ncomm *nc = (struct ncomm *)c;
    nccl.comm_destroy(nc->comm);
    if (nc->one) nccl.mem_free(nc->one);
    free(nc);
}

static const struct tmx_comm_ops nccl_ops = {n_allreduce, n_allgather, n_broadcast, n_barrier,
                                             n_free};

enum tmx_status tmx_comm_nccl_new(tmx_comm_t *boot, tmx_comm_t **out, char **err) {
    *out = NULL;
    if (!boot || boot->backend == TMX_COMM_NCCL)
        return tmx_err(err, TMX_ERR_INVALID,
                       "comm (nccl): the boot communicator must be an mpi or threads one");
    pthread_once(&nccl_once, nccl_load);

    /* Local preparation, then every rank learns whether any failed, so that none is left
     * waiting for the id or in ncclCommInitRank. */
    char why[600] = "";
    enum tmx_status why_st = TMX_OK;
    void *one = NULL;
    if (nccl_missing[0]) {
        snprintf(why, sizeof why, "%s", nccl_missing);
        why_st = TMX_ERR_UNSUPPORTED;
    } else if (nccl.mem_alloc) {
        int rc = nccl.mem_alloc(&one, 1);
        if (rc != NCCL_SUCCESS) {
            const char *last = nccl.get_last_error ? nccl.get_last_error(NULL) : NULL;
            snprintf(why, sizeof why, "comm (nccl): ncclMemAlloc on rank %d: %s%s%s", boot->rank,
                     nccl.get_error_string(rc), last && *last ? ": " : "", last ? last : "");
            why_st = TMX_ERR_DEVICE;
            one = NULL;
        }
    }
    float failed[2] = {why_st == TMX_ERR_UNSUPPORTED, why_st == TMX_ERR_DEVICE}; /* ranks */
    enum tmx_status st = tmx_comm_allreduce_sum(boot, failed, 2, TMX_DTYPE_F32, err);
    if (st == TMX_OK && (failed[0] > 0 || failed[1] > 0)) {
        st = why_st != TMX_OK ? tmx_err(err, why_st, "%s", why)
                              : tmx_err(err, failed[0] > 0 ? TMX_ERR_UNSUPPORTED : TMX_ERR_DEVICE,
                                        "comm (nccl): %d other rank(s) could not start NCCL",
                                        (int)(failed[0] + failed[1]));
    }

    /* Rank 0 makes the id; its success travels with it. */
    struct {
        int32_t ok;
        nccl_unique_id id;
    } msg;
    memset(&msg, 0, sizeof msg);
    int rc = NCCL_SUCCESS;
    if (st == TMX_OK && boot->rank == 0) {
        rc = nccl.get_unique_id(&msg.id);
        msg.ok = rc == NCCL_SUCCESS;
    }
    if (st == TMX_OK) st = tmx_comm_broadcast(boot, &msg, sizeof msg, 0, err);
    if (st == TMX_OK && !msg.ok)
        st = boot->rank == 0 ? nccl_fail(NULL, rc, "ncclGetUniqueId", err)
                             : tmx_err(err, TMX_ERR_DEVICE,
                                       "comm (nccl): rank 0 could not make an NCCL unique id");

    nccl_comm_t comm = NULL;
    if (st == TMX_OK) {
        rc = nccl.comm_init_rank(&comm, boot->size, msg.id, boot->rank);
        if (rc != NCCL_SUCCESS) st = nccl_fail(NULL, rc, "ncclCommInitRank", err);
    }
    struct ncomm *nc = st == TMX_OK ? calloc(1, sizeof *nc) : NULL;
    if (st == TMX_OK && !nc) {
        nccl.comm_destroy(comm);
        st = tmx_err(err, TMX_ERR_NOMEM, "comm (nccl): out of memory");
    }
    if (st != TMX_OK) {
        if (one) nccl.mem_free(one);
        return st;
    }
    nc->base = (struct tmx_comm){&nccl_ops, TMX_COMM_NCCL, boot->rank, boot->size, NULL};
    nc->comm = comm;
    nc->one = one;
    *out = &nc->base;
    return TMX_OK;
}
