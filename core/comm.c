/* comm.c: the calls every communicator answers (tmx/comm.h): argument checks, then the
 * backend's ops; and the rank-order sum that the threads and mpi backends share. The backends
 * live in comm-threads.c, comm-mpi.c and comm-nccl.c. */
#include <stdint.h>
#include <stdlib.h>

#include "comm-impl.h"

const char *tmx_comm_backend_name(enum tmx_comm_backend b) {
    switch (b) {
    case TMX_COMM_THREADS: return "threads";
    case TMX_COMM_MPI: return "mpi";
    case TMX_COMM_NCCL: return "nccl";
    }
    return "?";
}

void tmx_comm_free(tmx_comm_t *c) {
    if (c && c->ops->free) c->ops->free(c);
}

int tmx_comm_rank(const tmx_comm_t *c) { return c->rank; }
int tmx_comm_size(const tmx_comm_t *c) { return c->size; }
enum tmx_comm_backend tmx_comm_backend(const tmx_comm_t *c) { return c->backend; }
void tmx_comm_set_stream(tmx_comm_t *c, void *stream) { c->stream = stream; }

enum tmx_status tmx_comm_allreduce_sum(tmx_comm_t *c, void *buf, size_t count,
                                       enum tmx_dtype dtype, char **err) {
    if (!c) return tmx_err(err, TMX_ERR_INVALID, "comm allreduce: NULL communicator");
    if (dtype != TMX_DTYPE_F32 && dtype != TMX_DTYPE_BF16)
        return tmx_err(err, TMX_ERR_INVALID, "comm allreduce: dtype %s is not F32 or BF16",
                       dtype < TMX_DTYPE_COUNT ? tmx_dtype_name(dtype) : "?");
    if (!buf && count)
        return tmx_err(err, TMX_ERR_INVALID, "comm allreduce: NULL buffer of %zu elements", count);
    if (count > SIZE_MAX / 4)
        return tmx_err(err, TMX_ERR_INVALID, "comm allreduce: count %zu is too large", count);
    return c->ops->allreduce_sum(c, buf, count, dtype, err);
}

enum tmx_status tmx_comm_allgather(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                   char **err) {
    if (!c) return tmx_err(err, TMX_ERR_INVALID, "comm allgather: NULL communicator");
    if ((!send || !recv) && nbytes)
        return tmx_err(err, TMX_ERR_INVALID, "comm allgather: NULL buffer of %zu bytes", nbytes);
    if (nbytes > SIZE_MAX / (size_t)c->size)
        return tmx_err(err, TMX_ERR_INVALID, "comm allgather: %zu bytes per rank is too large",
                       nbytes);
    return c->ops->allgather(c, send, recv, nbytes, err);
}

enum tmx_status tmx_comm_broadcast(tmx_comm_t *c, void *buf, size_t nbytes, int root,
                                   char **err) {
    if (!c) return tmx_err(err, TMX_ERR_INVALID, "comm broadcast: NULL communicator");
    if (root < 0 || root >= c->size)
        return tmx_err(err, TMX_ERR_INVALID, "comm broadcast: root %d is not a rank of %d", root,
                       c->size);
    if (!buf && nbytes)
        return tmx_err(err, TMX_ERR_INVALID, "comm broadcast: NULL buffer of %zu bytes", nbytes);
    return c->ops->broadcast(c, buf, nbytes, root, err);
}

enum tmx_status tmx_comm_barrier(tmx_comm_t *c, char **err) {
    if (!c) return tmx_err(err, TMX_ERR_INVALID, "comm barrier: NULL communicator");
    return c->ops->barrier(c, err);
}

void tmx_comm_slice(size_t count, int n, int r, size_t *lo, size_t *len) {
    size_t q = count / (size_t)n, rem = count % (size_t)n, ur = (size_t)r;
    *lo = ur * q + (ur < rem ? ur : rem);
    *len = q + (ur < rem);
}

/* Blocks of this many elements keep the F32 partial sums in registers and L1. */
enum { SUM_BLOCK = 256 };

void tmx_comm_sum(void *out, const void *const *in, int n, size_t offset, size_t count,
                  enum tmx_dtype dtype) {
    float acc[SUM_BLOCK];
    for (size_t b = 0; b < count; b += SUM_BLOCK) {
        size_t m = count - b < SUM_BLOCK ? count - b : SUM_BLOCK, at = offset + b;
        if (dtype == TMX_DTYPE_F32) {
            const float *x = (const float *)in[0] + at;
            for (size_t i = 0; i < m; i++) acc[i] = x[i];
            for (int k = 1; k < n; k++) {
                x = (const float *)in[k] + at;
                for (size_t i = 0; i < m; i++) acc[i] += x[i];
            }
            float *y = (float *)out + b;
            for (size_t i = 0; i < m; i++) y[i] = acc[i];
        } else {
            const uint16_t *x = (const uint16_t *)in[0] + at;
            for (size_t i = 0; i < m; i++) acc[i] = tmx_bf16_to_f32(x[i]);
            for (int k = 1; k < n; k++) {
                x = (const uint16_t *)in[k] + at;
                for (size_t i = 0; i < m; i++) acc[i] += tmx_bf16_to_f32(x[i]);
            }
            uint16_t *y = (uint16_t *)out + b;
            for (size_t i = 0; i < m; i++) y[i] = tmx_f32_to_bf16(acc[i]);
        }
    }
}
