/* comm-mpi.c: the mpi backend of tmx/comm.h, one rank per process of MPI_COMM_WORLD.
 *
 * Sums do not use MPI_Allreduce: Open MPI picks its algorithm by message size and process count
 * (and by tuning parameters), so neither the order of the additions nor, for some algorithms,
 * equality across ranks is promised; and MPI has no BF16 type. Instead every byte travels
 * verbatim (MPI_BYTE) and the additions are tmx_comm_sum's, in rank order, in F32:
 *   up to TMX_COMM_SMALL_BYTES  MPI_Allgather of every rank's buffer, then each rank sums all n
 *                               (one exchange, latency-bound messages);
 *   above                       MPI_Alltoallv hands rank r slice r of every buffer, rank r sums
 *                               it, MPI_Allgatherv returns the summed slices to everyone (each
 *                               rank sends and receives about 2 m bytes instead of n m).
 * Either way rank r's sums equal the threads backend's bit for bit, on every rank.
 *
 * The communicator is a duplicate of MPI_COMM_WORLD (its traffic never meets the caller's) with
 * errors returned, not fatal. MPI is initialized by the first tmx_comm_mpi_new (unless the
 * program did it) and finalized when the last communicator is freed; it cannot start again
 * after that. An error in a collective leaves the communicator unusable: ranks may disagree on
 * where they stopped. */
#include <limits.h>
#include <stdlib.h>

#include "comm-impl.h"

int tmx_comm_mpi_launched(void) {
#ifdef TMX_HAVE_MPI
    const char *size = getenv("OMPI_COMM_WORLD_SIZE"), *pmix = getenv("PMIX_RANK");
    return (size && *size) || (pmix && *pmix);
#else
    return 0;
#endif
}

#ifndef TMX_HAVE_MPI

enum tmx_status tmx_comm_mpi_new(tmx_comm_t **out, char **err) {
    *out = NULL;
    return tmx_err(err, TMX_ERR_UNSUPPORTED,
                   "comm (mpi): this tmx was built without MPI (install libopenmpi-dev and "
                   "rebuild)");
}

#else

#include <pthread.h>
#include <stdio.h>

#include <mpi.h>

struct mcomm {
    struct tmx_comm base;
    MPI_Comm comm;
    int broken;               /* an earlier collective failed */
    unsigned char *scratch;   /* [cap] the other ranks' buffers or slices */
    size_t cap;
    const void **rows;        /* [n] into scratch, for tmx_comm_sum */
    int *sc, *sd, *rc, *rd;   /* [n] byte counts and displacements for the v-collectives */
};

static pthread_mutex_t mpi_mu = PTHREAD_MUTEX_INITIALIZER;
static int mpi_live, mpi_ours; /* communicators alive; whether tmx called MPI_Init_thread */

static enum tmx_status mpi_fail(struct mcomm *m, int rc, const char *what, char **err) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "error %d", rc);
    if (m) m->broken = 1;
    return tmx_err(err, TMX_ERR_IO, "comm (mpi): %s failed: %.*s", what, len, msg);
}

static enum tmx_status check(struct mcomm *m, size_t bytes, const char *what, char **err) {
    if (m->broken)
        return tmx_err(err, TMX_ERR_INVALID, "comm (mpi): %s on a communicator that failed "
                       "before", what);
    if (bytes > INT_MAX)
        return tmx_err(err, TMX_ERR_INVALID, "comm (mpi): %s of %zu bytes exceeds MPI's int "
                       "counts", what, bytes);
    return TMX_OK;
}

/* Grows scratch to bytes. Every rank makes the same calls, so every rank grows at the same
 * call; the ranks agree on the outcome, so a rank that cannot allocate stops the others
 * instead of leaving them in a collective it never joins. */
static enum tmx_status grow(struct mcomm *m, size_t bytes, char **err) {
    if (m->cap >= bytes) return TMX_OK;
    unsigned char *buf = malloc(bytes);
    int ok = buf != NULL, all;
    int rc = MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, m->comm);
    if (rc != MPI_SUCCESS) {
        free(buf);
        return mpi_fail(m, rc, "MPI_Allreduce (agreeing on scratch)", err);
    }
    if (!all) {
        free(buf);
        m->broken = 1;
        return tmx_err(err, TMX_ERR_NOMEM, "comm (mpi): a rank could not allocate %zu bytes",
                       bytes);
    }
    free(m->scratch);
    m->scratch = buf, m->cap = bytes;
    return TMX_OK;
}

static enum tmx_status m_allreduce(tmx_comm_t *c, void *buf, size_t count, enum tmx_dtype dtype,
                                   char **err) {
    struct mcomm *m = (struct mcomm *)c;
    const int n = c->size;
    size_t es = tmx_dtype_size(dtype), bytes = count * es;
    enum tmx_status st = check(m, bytes, "allreduce", err);
    if (st != TMX_OK || n == 1 || !count) return st;
    if (bytes <= TMX_COMM_SMALL_BYTES) {
        if ((st = grow(m, (size_t)n * bytes, err)) != TMX_OK) return st;
        int rc = MPI_Allgather(buf, (int)bytes, MPI_BYTE, m->scratch, (int)bytes, MPI_BYTE,
                               m->comm);
        if (rc != MPI_SUCCESS) return mpi_fail(m, rc, "MPI_Allgather", err);
        for (int k = 0; k < n; k++) m->rows[k] = m->scratch + (size_t)k * bytes;
        tmx_comm_sum(buf, m->rows, n, 0, count, dtype);
        return TMX_OK;
    }
    size_t lo, len;
    tmx_comm_slice(count, n, c->rank, &lo, &len);
    if ((st = grow(m, (size_t)n * len * es, err)) != TMX_OK) return st;
    for (int k = 0; k < n; k++) {
        size_t klo, klen;
        tmx_comm_slice(count, n, k, &klo, &klen);
        m->sc[k] = (int)(klen * es), m->sd[k] = (int)(klo * es);
        m->rc[k] = (int)(len * es), m->rd[k] = (int)((size_t)k * len * es);
        m->rows[k] = m->scratch + (size_t)k * len * es;
    }
    int rc = MPI_Alltoallv(buf, m->sc, m->sd, MPI_BYTE, m->scratch, m->rc, m->rd, MPI_BYTE,
                           m->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(m, rc, "MPI_Alltoallv", err);
    tmx_comm_sum((unsigned char *)buf + lo * es, m->rows, n, 0, len, dtype);
    rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, m->sc, m->sd, MPI_BYTE, m->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(m, rc, "MPI_Allgatherv", err);
    return TMX_OK;
}

static enum tmx_status m_allgather(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                   char **err) {
    struct mcomm *m = (struct mcomm *)c;
    enum tmx_status st = check(m, nbytes * (size_t)c->size, "allgather", err);
    if (st != TMX_OK || !nbytes) return st;
    /* MPI forbids send overlapping recv; a rank's own block in place is MPI_IN_PLACE. */
    const void *src = send == (unsigned char *)recv + (size_t)c->rank * nbytes ? MPI_IN_PLACE
                                                                               : send;
    int rc = MPI_Allgather(src, (int)nbytes, MPI_BYTE, recv, (int)nbytes, MPI_BYTE, m->comm);
    return rc == MPI_SUCCESS ? TMX_OK : mpi_fail(m, rc, "MPI_Allgather", err);
}

static enum tmx_status m_broadcast(tmx_comm_t *c, void *buf, size_t nbytes, int root,
                                   char **err) {
    struct mcomm *m = (struct mcomm *)c;
    enum tmx_status st = check(m, nbytes, "broadcast", err);
    if (st != TMX_OK || !nbytes) return st;
    int rc = MPI_Bcast(buf, (int)nbytes, MPI_BYTE, root, m->comm);
    return rc == MPI_SUCCESS ? TMX_OK : mpi_fail(m, rc, "MPI_Bcast", err);
}

static enum tmx_status m_barrier(tmx_comm_t *c, char **err) {
    struct mcomm *m = (struct mcomm *)c;
    enum tmx_status st = check(m, 0, "barrier", err);
    if (st != TMX_OK) return st;
    int rc = MPI_Barrier(m->comm);
    return rc == MPI_SUCCESS ? TMX_OK : mpi_fail(m, rc, "MPI_Barrier", err);
}

/* Uncounts a communicator; the last one out finalizes MPI if tmx initialized it. */
static void mpi_stop(void) {
    pthread_mutex_lock(&mpi_mu);
    if (--mpi_live == 0 && mpi_ours) MPI_Finalize();
    pthread_mutex_unlock(&mpi_mu);
}

static void m_free(tmx_comm_t *c) {
    struct mcomm *m = (struct mcomm *)c;
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    free(m->scratch);
    free(m->rows);
    free(m->sc);
    free(m->sd);
    free(m->rc);
    free(m->rd);
    free(m);
    mpi_stop();
}

static const struct tmx_comm_ops mpi_ops = {m_allreduce, m_allgather, m_broadcast, m_barrier,
                                            m_free};

/* Initializes MPI unless the program did; counts the new communicator. */
static enum tmx_status mpi_start(char **err) {
    int done = 0, up = 0;
    MPI_Finalized(&done);
    if (done)
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "comm (mpi): MPI was finalized in this process and cannot start again");
    MPI_Initialized(&up);
    if (!up) {
        /* Serialized: the engine may call from a thread other than the one that started. */
        int provided, rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(NULL, rc, "MPI_Init_thread", err);
        mpi_ours = 1;
    }
    mpi_live++;
    return TMX_OK;
}

enum tmx_status tmx_comm_mpi_new(tmx_comm_t **out, char **err) {
    *out = NULL;
    if (!tmx_comm_mpi_launched())
        return tmx_err(err, TMX_ERR_UNSUPPORTED,
                       "comm (mpi): not started by mpirun (neither OMPI_COMM_WORLD_SIZE nor "
                       "PMIX_RANK is set)");
    pthread_mutex_lock(&mpi_mu);
    enum tmx_status st = mpi_start(err);
    pthread_mutex_unlock(&mpi_mu);
    if (st != TMX_OK) return st;
    struct mcomm *m = calloc(1, sizeof *m);
    if (!m) {
        mpi_stop();
        return tmx_err(err, TMX_ERR_NOMEM, "comm (mpi): out of memory");
    }
    m->comm = MPI_COMM_NULL;
    m->base = (struct tmx_comm){&mpi_ops, TMX_COMM_MPI, 0, 1, NULL};
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->comm, &m->base.rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->comm, &m->base.size);
    if (rc != MPI_SUCCESS) {
        st = mpi_fail(m, rc, "duplicating MPI_COMM_WORLD", err);
        m_free(&m->base);
        return st;
    }
    size_t n = (size_t)m->base.size;
    m->rows = malloc(n * sizeof *m->rows);
    m->sc = malloc(n * sizeof(int)), m->sd = malloc(n * sizeof(int));
    m->rc = malloc(n * sizeof(int)), m->rd = malloc(n * sizeof(int));
    if (!m->rows || !m->sc || !m->sd || !m->rc || !m->rd) {
        m_free(&m->base);
        return tmx_err(err, TMX_ERR_NOMEM, "comm (mpi): out of memory for %zu ranks", n);
    }
    *out = &m->base;
    return TMX_OK;
}

#endif
