/* comm-impl.h: what the backends of tmx/comm.h share (private to the core).
 *
 * A communicator is a struct tmx_comm at the start of its backend's struct; the public calls in
 * comm.c check their arguments, then go through ops. */
#ifndef TMX_COMM_IMPL_H
#define TMX_COMM_IMPL_H

#include "tmx/comm.h"

struct tmx_comm_ops {
    enum tmx_status (*allreduce_sum)(tmx_comm_t *c, void *buf, size_t count, enum tmx_dtype dtype,
                                     char **err);
    enum tmx_status (*allgather)(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                 char **err);
    enum tmx_status (*broadcast)(tmx_comm_t *c, void *buf, size_t nbytes, int root, char **err);
    enum tmx_status (*barrier)(tmx_comm_t *c, char **err);
    void (*free)(tmx_comm_t *c); /* NULL: the communicator belongs to a group */
};

struct tmx_comm {
    const struct tmx_comm_ops *ops;
    enum tmx_comm_backend backend;
    int rank, size;
    void *stream; /* nccl: cudaStream_t; the others ignore it */
};

/* out[0..count) <- sum over k = 0..n-1 of in[k][offset + i], added in that order in F32 and
 * rounded once to dtype (F32 or BF16). out may be in[k] + offset for one k: each block of
 * elements is read from every input before it is written. */
void tmx_comm_sum(void *out, const void *const *in, int n, size_t offset, size_t count,
                  enum tmx_dtype dtype);

/* The slice of count elements that rank r of n reduces: [*lo, *lo + *len), the first
 * count % n ranks one element longer. */
void tmx_comm_slice(size_t count, int n, int r, size_t *lo, size_t *len);

/* Messages of at most this many bytes are all-reduced by gathering every rank's whole buffer
 * and summing it on every rank (one exchange); larger ones by a reduce-scatter and an
 * all-gather (two exchanges, each rank adding only its slice). Both add in rank order, so the
 * choice never changes a result. */
#define TMX_COMM_SMALL_BYTES ((size_t)32 << 10)

#endif
