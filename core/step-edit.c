/* step-edit.c: a top step's logit edits (a request's logit bias and penalties, tmx/kernels.h
 * logit_edit): checked on rank 0, sent to the followers, uploaded by every rank into room that
 * grows as requests need it. The kernel set applies them before its topk (step-out.c). */
#include <stdlib.h>

#include "step-impl.h"

int tmx_step_can_edit(const struct tmx_model *m) {
    return TMX_OPS_HAS(m->k->ops, topk) && TMX_OPS_HAS(m->k->ops, logit_edit);
}

size_t tmx_step_edit_bytes(const struct kv_state *kv, int n) {
    return ((size_t)kv->opt.max_seqs + 1) * sizeof(int32_t) +
           (size_t)n * sizeof(struct tmx_logit_edit);
}

enum tmx_status tmx_step_edits_reserve(struct tmx_model *m, int n, char **err) {
    const struct tmx_kernels *k = m->k;
    struct kv_state *kv = m->kv;
    if (n <= kv->edit_cap) return TMX_OK;
    int cap = kv->edit_cap ? kv->edit_cap : 1024;
    while (cap < n) cap = cap > INT32_MAX / 2 ? n : 2 * cap;
    const size_t bytes = tmx_step_edit_bytes(kv, cap);
    int32_t *msg = realloc(kv->edit_msg, bytes);
    if (!msg) return tmx_err(err, TMX_ERR_NOMEM, "out of memory for %d logit edits", n);
    kv->edit_msg = msg;
    if (!kv->edit_seen && !(kv->edit_seen = calloc((size_t)m->cfg.vocab_size, 1)))
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    tmx_step_graphs_drop(m, GRAPH_TOP_EDITED); /* they hold edit_dev's address */
    if (kv->edit_dev) k->ops->buf_free(k->ctx, kv->edit_dev);
    kv->edit_dev = NULL;
    kv->edit_cap = 0;
    enum tmx_status st = k->ops->buf_alloc(k->ctx, bytes, &kv->edit_dev);
    if (st != TMX_OK)
        return tmx_err(err, st, "kernel set %s: cannot allocate %zu bytes for %d logit edits",
                       k->plugin->name, bytes, n);
    kv->edit_cap = cap;
    return TMX_OK;
}

enum tmx_status tmx_step_edits_check(struct tmx_model *m, const int32_t *starts,
                                     const struct tmx_logit_edit *edits, int n_seqs,
                                     int n_vocab, char **err) {
    if (!tmx_step_can_edit(m))
        return tmx_err(err, TMX_ERR_UNSUPPORTED, "top step: kernel set %s cannot edit logits "
                       "(logit_edit, ABI 2.5)", m->k->plugin->name);
    if (starts[0] != 0)
        return tmx_err(err, TMX_ERR_INVALID, "top step: edit_starts[0] = %d, not 0", starts[0]);
    for (int i = 0; i < n_seqs; i++)
        if (starts[i + 1] < starts[i])
            return tmx_err(err, TMX_ERR_INVALID, "top step: edit_starts[%d] = %d is below "
                           "edit_starts[%d] = %d", i + 1, starts[i + 1], i, starts[i]);
    enum tmx_status st = tmx_step_edits_reserve(m, starts[n_seqs], err);
    unsigned char *seen = m->kv->edit_seen; /* zero between checks */
    for (int i = 0; st == TMX_OK && i < n_seqs; i++) {
        int j = starts[i];
        for (; j < starts[i + 1]; j++) {
            const int32_t id = edits[j].id;
            if (id < 0 || id >= n_vocab || seen[id]) break;
            seen[id] = 1;
        }
        if (j < starts[i + 1])
            st = tmx_err(err, TMX_ERR_INVALID, "top step: edit %d of sequence %d: id %d %s", j,
                         i, edits[j].id, edits[j].id < 0 || edits[j].id >= n_vocab
                         ? "outside the vocabulary" : "edited twice");
        for (int e = starts[i]; e < j; e++) seen[edits[e].id] = 0;
    }
    return st;
}

enum tmx_status tmx_step_edits_broadcast(struct tmx_model *m, const struct step_head *h,
                                         char **err) {
    struct kv_state *kv = m->kv;
    return tmx_comm_broadcast(m->tp.ctl, kv->edit_msg, tmx_step_edit_bytes(kv, h->n_edits), 0,
                              err);
}
