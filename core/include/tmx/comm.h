/* tmx/comm.h: collectives between the ranks of a tensor-parallel model.
 *
 * A rank is one copy of the model graph holding its slice of the weights (docs/tp.md). Ranks
 * talk through a communicator with one of three backends:
 *   threads  in-process ranks on threads sharing memory (CPU kernel set, tests, a CPU "TP" that
 *            uses the cores): tmx_comm_group_new makes N communicators at once.
 *   mpi      one rank per process, launched by `mpirun -np N` (Open MPI), possibly on several
 *            machines; buffers are host memory.
 *   nccl     one rank per GPU (libnccl.so.2 opened with dlopen, so CPU-only machines need no
 *            NCCL); buffers are device memory and collectives are queued on the caller's stream.
 *            The ncclUniqueId travels from rank 0 through MPI under mpirun, or through the
 *            threads group when the ranks are threads of one process.
 *
 * Every rank calls the same collectives in the same order with the same sizes. Sums are
 * deterministic: every rank ends with bit-identical results. threads and mpi add in rank order,
 * ((x0 + x1) + x2) + ..., in F32 and round BF16 once, so the order depends only on the number
 * of ranks (TP = 2 runs are reproducible, not equal to TP = 1 bit for bit) and the two backends
 * agree bit for bit; nccl adds in its own algorithm's order (the same on every rank, and from
 * run to run for the same machine, NCCL version and NCCL_ALGO/NCCL_PROTO).
 *
 * Errors: a collective that fails on one rank fails on every rank of threads (the ranks check
 * each other's calls, so mismatched sizes or ops are reported, not hung on); under mpi and nccl
 * a failed communicator should be freed. Environment: TMX_COMM_SPIN_US (threads: how long a
 * waiting rank spins before it sleeps, default 20 microseconds, 0 when the ranks outnumber the
 * CPUs), TMX_NCCL_LIBRARY (the NCCL library to open, default libnccl.so.2); docs/tp.md says
 * more.
 *
 * Ownership: a communicator is owned by its caller and freed with tmx_comm_free; a threads group
 * owns its communicators (tmx_comm_group_free frees them, after every rank has stopped using
 * them). Thread safety: one communicator is used by one thread at a time. */
#ifndef TMX_COMM_H
#define TMX_COMM_H

#include <stddef.h>

#include "tmx/status.h"
#include "tmx/tensor.h"

typedef struct tmx_comm tmx_comm_t;
typedef struct tmx_comm_group tmx_comm_group_t;

enum tmx_comm_backend { TMX_COMM_THREADS = 0, TMX_COMM_MPI = 1, TMX_COMM_NCCL = 2 };

/* "threads", "mpi", "nccl". */
const char *tmx_comm_backend_name(enum tmx_comm_backend b);

/* --- threads ---------------------------------------------------------------------------------
 * n communicators of one group (1 <= n <= 1024); rank r's is tmx_comm_group_rank(g, r) (NULL
 * for a rank outside 0..n-1). Each rank's communicator is then used by that rank's thread. */
enum tmx_status tmx_comm_group_new(int n, tmx_comm_group_t **out, char **err);
tmx_comm_t *tmx_comm_group_rank(tmx_comm_group_t *g, int rank);
void tmx_comm_group_free(tmx_comm_group_t *g); /* safe with NULL */

/* --- mpi ---------------------------------------------------------------------------------------
 * 1 when this process was started by mpirun (the launcher's environment says so) and tmx was
 * built with MPI; then tmx_comm_mpi_new initializes MPI and returns this process's rank of
 * MPI_COMM_WORLD. A build without MPI returns TMX_ERR_UNSUPPORTED with a message. */
int tmx_comm_mpi_launched(void);
enum tmx_status tmx_comm_mpi_new(tmx_comm_t **out, char **err);

/* --- nccl --------------------------------------------------------------------------------------
 * An NCCL communicator with boot's rank and size on the calling thread's current CUDA device,
 * its unique id shared through `boot` (an mpi or threads communicator of the same ranks: rank 0
 * makes the id and broadcasts it; every rank calls this at once). libnccl.so.2 is opened on
 * first use; without it, TMX_ERR_UNSUPPORTED naming the library (on every rank: the ranks tell
 * each other before any waits on NCCL). The NCCL communicator does not own boot. */
enum tmx_status tmx_comm_nccl_new(tmx_comm_t *boot, tmx_comm_t **out, char **err);

/* --- every backend ------------------------------------------------------------------------- */
/* Safe with NULL; does nothing to a group's communicators (tmx_comm_group_free frees them).
 * nccl: the caller's stream must have finished the communicator's work. */
void tmx_comm_free(tmx_comm_t *c);
int tmx_comm_rank(const tmx_comm_t *c);
int tmx_comm_size(const tmx_comm_t *c);
enum tmx_comm_backend tmx_comm_backend(const tmx_comm_t *c);

/* The stream that nccl collectives are queued on (a cudaStream_t; NULL: the default stream).
 * nccl calls return once queued: their results (and a barrier's passing) are there when the
 * stream has reached them, so the caller synchronizes the stream before reading on the host.
 * The other backends ignore it: they complete before returning. */
void tmx_comm_set_stream(tmx_comm_t *c, void *stream);

/* buf[count] of dtype (F32 or BF16) <- the element-wise sum over ranks, in place. */
enum tmx_status tmx_comm_allreduce_sum(tmx_comm_t *c, void *buf, size_t count,
                                       enum tmx_dtype dtype, char **err);
/* recv[size][nbytes] <- every rank's send[nbytes], in rank order. send may be
 * recv + rank * nbytes (in place); otherwise the two do not overlap. */
enum tmx_status tmx_comm_allgather(tmx_comm_t *c, const void *send, void *recv, size_t nbytes,
                                   char **err);
/* buf[nbytes] <- root's buf. */
enum tmx_status tmx_comm_broadcast(tmx_comm_t *c, void *buf, size_t nbytes, int root,
                                   char **err);
enum tmx_status tmx_comm_barrier(tmx_comm_t *c, char **err);

#endif
