/* step-impl.h: a forward step's private state, shared by forward.c (the cache, sequences and
 * the step) and step-out.c (what a step hands back: logits, greedy picks, candidates). */
#ifndef TMX_STEP_IMPL_H
#define TMX_STEP_IMPL_H

#include "model-impl.h"

enum { FULL = 0, SLIDING = 1, N_GROUPS = 2 };

struct group {
    struct tmx_kv_pool *pool; /* NULL: the model has no layers of this kind */
    int window;               /* positions a query sees; 0: all */
    int32_t *slot;            /* device [n_batch] cache row of each token of the step */
    int32_t *tables;          /* device [max_seqs][max_blocks] block tables of the step */
};

/* What rank 0 broadcasts before each step's arrays (CMD_ROW: no arrays; every rank sends its
 * slice of row n of the last step's logits, tmx_model_read_logits). */
enum { CMD_STEP = 1, CMD_QUIT = 2, CMD_ROW = 3 };
/* What a step hands back of each row: its logits, its argmax, or its first candidates for a
 * sampler (tmx/kernels.h, topk), the last two over ids [0, n_vocab). */
enum { PICK_LOGITS = 0, PICK_GREEDY = 1, PICK_TOP = 2, N_PICKS = 3 };
/* Decode graphs: one kind for each pick the set makes, and one for top steps whose logits are
 * edited first (tmx/kernels.h, logit_edit). */
enum { GRAPH_TOP_EDITED = N_PICKS, N_GRAPHS };
struct step_head {
    int32_t cmd, n, n_seqs, n_rows; /* tokens, sequences, rows whose logits are read */
    int32_t pick, n_vocab;
    int32_t n_edits; /* a top step's logit edits, in kv->edit_msg (0: none) */
};

/* A step's host arrays, views of kv->msg packed in this order so that one broadcast carries
 * them all: tok, pos, seq [n]; the groups' slots [n]; rows [n_rows]; the groups' tables
 * [n_seqs][max_blocks]; with PICK_TOP the rows' temperatures [n_rows]. */
struct step_arrays {
    int32_t *tok, *pos, *seq, *slot[N_GROUPS], *rows, *tables[N_GROUPS];
    float *temps;
};

struct kv_state {
    struct tmx_kv_options opt;
    int max_blocks;              /* table entries of a sequence: ceil(n_ctx / block_size) */
    struct group g[N_GROUPS];
    struct tmx_kv_cache *cache;  /* [n_layers] */
    /* the step's device buffers, n_batch token rows each */
    int32_t *tok, *pos, *seq;    /* [B] */
    int32_t *rows;               /* [max_seqs] rows whose logits the step reads */
    float *h, *x, *o;            /* [B][hidden] residual stream, normed input, block output */
    float *q, *att;              /* [B][n_heads*head_dim] */
    float *kk, *vv;              /* [B][n_kv_heads*head_dim] */
    float *f1, *f2;              /* [B][max(intermediate, shared width)] */
    float *rl, *rw;              /* [B][n_experts] router logits, [B][top_k] routing weights */
    int32_t *rid;                /* [B][top_k] routed expert ids */
    float *z, *y;                /* [B][moe_latent] */
    float *hn, *logits;          /* [max_seqs][hidden], [max_seqs][vocab slice] */
    float *part;                 /* TP: [B][top_k * moe_latent + hidden] each pair's partial
                                    y_e, then the shared expert's partial output */
    float *logits_all;           /* TP: [ranks][max_seqs][vocab_stride] gathered logits */
    int32_t *pick;               /* [2][max_seqs] a greedy step's ids, then their logits */
    float *temps;                /* [max_seqs] a top step's temperatures (with topk, one rank) */
    void *top;                   /* a top step of r rows, packed so that one read takes them:
                                    x [r][TMX_TOPK_MAX] float, ids [r][TMX_TOPK_MAX] int32,
                                    stats [r][3] double; room for max_seqs rows */
    void *top_host;              /* host: the same, read back */
    void *top_all;               /* TP: [ranks][max_seqs * TOP_ROW_BYTES] gathered kv->top */
    void *top_gathered;          /* host TP, rank 0: top_all read back */
    struct top_list *top_lists;  /* host TP, rank 0: [ranks] a merge's lists */
    int n_rows_read;             /* rows of kv->logits the last step left */
    int32_t *msg;                /* host: the step's arrays (struct step_arrays) */
    int32_t *tok_host;           /* host TP: [B] token ids as rows of this rank's embedding */
    float *gathered;             /* host TP, rank 0: logits_all read back */
    int32_t *status;             /* host TP: [ranks] each rank's status after a step */
    float *host_logits;          /* host [max_seqs][vocab_size]: greedy steps on a set without
                                    argmax, made by the first one */
    int32_t *edit_msg;           /* host: a top step's logit edits, as edit_dev */
    void *edit_dev;              /* the edits the step uploads, starts [max_seqs + 1] (int32)
                                    then edits [edit_cap] (struct tmx_logit_edit); NULL
                                    before the first edited step */
    int edit_cap;                /* edits edit_msg and edit_dev hold */
    unsigned char *edit_seen;    /* host [vocab_size]: one row's edited ids, zero between
                                    checks */
    void **graphs;               /* [N_GRAPHS][max_seqs + 1] decode step of n sequences,
                                    recorded once for each kind the set makes */
    int graph_vocab[N_GRAPHS];   /* the n_vocab each kind of graph was recorded with */
};

/* Bytes of kv->top a row takes. */
#define TOP_ROW_BYTES (TMX_TOPK_MAX * (sizeof(float) + sizeof(int32_t)) + 3 * sizeof(double))

/* Views of a packed top buffer of r rows (kv->top): x [r][TMX_TOPK_MAX], ids [r][TMX_TOPK_MAX],
 * stats [r][3]. */
struct top_view {
    float *x;
    int32_t *ids;
    double *stats;
};

/* One rank's list in rank 0's merge of a TP top step. */
struct top_list {
    struct top_view v;
    int at; /* its next candidate; TMX_TOPK_MAX: none left */
};

/* What a step hands back (all NULL on a follower): logits[n_rows][vocab_size]; with
 * PICK_GREEDY the rows' argmax next[n_rows]; with PICK_TOP their first candidates at temps[]
 * after the edits (NULL: none): top_x and top_id [n_rows][TMX_TOPK_MAX], top_stat [n_rows][3]
 * (tmx_model_step_top). */
struct step_out {
    float *logits;
    int32_t *next;
    const float *temps;
    const int32_t *edit_starts;
    const struct tmx_logit_edit *edits;
    float *top_x;
    int32_t *top_id;
    double *top_stat;
};

/* --- forward.c ------------------------------------------------------------------------------ */

/* Frees the decode graphs of one kind (the next step of that kind records them again). */
void tmx_step_graphs_drop(struct tmx_model *m, int kind);

/* --- step-edit.c ---------------------------------------------------------------------------- */

/* Whether the set can edit a top step's logits (topk and logit_edit). */
int tmx_step_can_edit(const struct tmx_model *m);

/* Bytes of kv->edit_msg (and edit_dev) that n edits take, their starts included. */
size_t tmx_step_edit_bytes(const struct kv_state *kv, int n);

/* Room for n edits in kv->edit_msg and kv->edit_dev (each rank), grown by doubling; the edited
 * graphs go when edit_dev moves. */
enum tmx_status tmx_step_edits_reserve(struct tmx_model *m, int n, char **err);

/* Rank 0, a top step's edits (tmx_model_step_top): starts ascending from 0, ids in [0,
 * n_vocab), none twice in a sequence; makes room for them (the followers make theirs when the
 * step comes). */
enum tmx_status tmx_step_edits_check(struct tmx_model *m, const int32_t *starts,
                                     const struct tmx_logit_edit *edits, int n_seqs,
                                     int n_vocab, char **err);

/* A step's edits (kv->edit_msg) from rank 0 to the followers, which made room for them. */
enum tmx_status tmx_step_edits_broadcast(struct tmx_model *m, const struct step_head *h,
                                         char **err);

/* --- step-out.c ----------------------------------------------------------------------------- */

/* Reads the r rows of kv->logits (the step's rows from `done` on) out as h and out ask: logits,
 * each row's argmax, or its first candidates (queued here), with every rank's part (TP). */
enum tmx_status tmx_step_read(struct tmx_model *m, const struct step_head *h, int r, int done,
                              const struct step_out *out, char **err);

/* Where kv->edit_dev's (and kv->edit_msg's) edits start: after max_seqs + 1 starts. */
#define EDITS_AT(kv, p) ((struct tmx_logit_edit *)((int32_t *)(p) + (kv)->opt.max_seqs + 1))

/* Queues (or records) the set's topk over kv->logits of r rows into kv->top, after the
 * step's logit edits. */
void tmx_step_top_queue(struct tmx_model *m, const struct step_head *h, int r);

/* One rank: kv->top of r rows -> out's arrays, in one read. */
enum tmx_status tmx_step_top_read(struct tmx_model *m, int r, const struct step_out *out);

/* Row i of the last step's logits (several ranks: each sends its slice, and logits NULL on a
 * follower) into logits[vocab_size]. */
enum tmx_status tmx_step_row_read(struct tmx_model *m, int i, float *logits, char **err);

#endif
