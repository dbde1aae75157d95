/* step-out.c: what a forward step hands back of its rows (core/forward.c computes their
 * logits in kv->logits): the logits themselves, each row's argmax (a greedy step), or its first
 * candidates for a sampler (a top step), found where the logits are and, with tensor
 * parallelism, gathered from every rank's vocabulary slice and merged on rank 0. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "step-impl.h"

static struct top_view top_view(void *buf, int r) {
    struct top_view v = {buf, NULL, NULL};
    v.ids = (int32_t *)(v.x + (size_t)r * TMX_TOPK_MAX);
    v.stats = (double *)(v.ids + (size_t)r * TMX_TOPK_MAX);
    return v;
}

/* Columns of this rank's vocabulary slice below n_vocab. */
static int slice_width(const struct tp_shard *tp, int n_vocab) {
    const int d = n_vocab - tp->vocab0 < tp->vocab_n ? n_vocab - tp->vocab0 : tp->vocab_n;
    return d > 0 ? d : 0;
}

/* kv->logits of r rows -> logits[r][vocab_size] (NULL: a follower, which only sends). With
 * several ranks each has [r][its vocab rows]; the all-gather puts them side by side. */
static enum tmx_status read_logits(struct tmx_model *m, int r, float *logits, char **err) {
    const struct tmx_kernels_i *op = m->k->ops;
    const struct tp_shard *tp = &m->tp;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int V = m->cfg.vocab_size, stride = tp->vocab_stride;
    if (tp->n == 1) return op->buf_read(kc, logits, kv->logits, (size_t)r * V * sizeof *logits);
    const size_t part = (size_t)r * stride * sizeof(float); /* [r][vocab_n] of each rank */
    enum tmx_status st = tmx_comm_allgather(tp->data, kv->logits, kv->logits_all, part, err);
    if (st != TMX_OK || !logits) return st;
    if ((st = op->buf_read(kc, kv->gathered, kv->logits_all, part * tp->n)) != TMX_OK) return st;
    for (int q = 0; q < tp->n; q++) {
        const int vn = q == tp->n - 1 ? V - stride * q : stride;
        const float *src = kv->gathered + (size_t)q * r * stride;
        for (int i = 0; i < r; i++)
            memcpy(logits + (size_t)i * V + (size_t)q * stride, src + (size_t)i * vn,
                   (size_t)vn * sizeof *logits);
    }
    return TMX_OK;
}

/* The argmax over ids [0, d) of a row of logits, as a kernel set's argmax: the lowest id of
 * the largest value, NaN never the largest (a row of NaN only: 0). */
static int32_t host_argmax(const float *x, int d) {
    int32_t at = -1;
    for (int32_t i = 0; i < d; i++)
        if (!isnan(x[i]) && (at < 0 || x[i] > x[at])) at = i;
    return at < 0 ? 0 : at;
}

/* kv->logits of r rows -> next[r], each row's argmax over ids [0, n_vocab) (next NULL: a
 * follower, which only sends). The kernel set's argmax runs where the logits are: with several
 * ranks each finds the best of its vocabulary slice and rank 0 the best of theirs (the lower
 * rank, so the lower id, on a tie), and only ids and values travel. A set without argmax reads
 * the logits back. */
static enum tmx_status pick_rows(struct tmx_model *m, int r, int n_vocab, int32_t *next,
                                 char **err) {
    const struct tmx_kernels_i *op = m->k->ops;
    const struct tp_shard *tp = &m->tp;
    struct kv_state *kv = m->kv;
    void *kc = m->k->ctx;
    const int S = kv->opt.max_seqs, V = m->cfg.vocab_size;
    if (!TMX_OPS_HAS(op, argmax)) {
        if (next && !kv->host_logits &&
            !(kv->host_logits = malloc((size_t)S * V * sizeof *kv->host_logits)))
            return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
        enum tmx_status st = read_logits(m, r, next ? kv->host_logits : NULL, err);
        for (int i = 0; st == TMX_OK && next && i < r; i++)
            next[i] = host_argmax(kv->host_logits + (size_t)i * V, n_vocab);
        return st;
    }
    int32_t *ids = kv->pick; /* then the values: [2][S] */
    const int d = slice_width(tp, n_vocab);
    enum tmx_status st = TMX_OK;
    if (d > 0) {
        op->argmax(kc, ids, (float *)(kv->pick + S), kv->logits, r, d, tp->vocab_n);
    } else { /* a rank whose ids all lie past n_vocab offers none */
        for (int i = 0; i < r; i++) kv->tok_host[i] = -1;
        st = op->buf_write(kc, ids, kv->tok_host, (size_t)r * sizeof *ids);
    }
    if (st != TMX_OK) return st;
    if (tp->n == 1) return op->buf_read(kc, next, ids, (size_t)r * sizeof *next);
    const size_t part = 2 * (size_t)S * sizeof *ids;
    if ((st = tmx_comm_allgather(tp->data, kv->pick, kv->logits_all, part, err)) != TMX_OK ||
        !next)
        return st;
    int32_t *all = (int32_t *)kv->gathered; /* [ranks][2][S] */
    if ((st = op->buf_read(kc, all, kv->logits_all, part * tp->n)) != TMX_OK) return st;
    for (int i = 0; i < r; i++) {
        int q_best = -1;
        float v_best = 0;
        for (int q = 0; q < tp->n; q++) {
            const int32_t *of_q = all + (size_t)q * 2 * S;
            float v;
            memcpy(&v, of_q + S + i, sizeof v);
            if (of_q[i] >= 0 && !isnan(v) && (q_best < 0 || v > v_best)) q_best = q, v_best = v;
        }
        next[i] = q_best < 0 ? 0 : q_best * tp->vocab_stride + all[(size_t)q_best * 2 * S + i];
    }
    return TMX_OK;
}

/* This rank's slice below h->n_vocab; a rank whose ids all lie past n_vocab has none, and rank
 * 0 skips it. The edits change kv->logits in place: a row read back later is the edited one. */
void tmx_step_top_queue(struct tmx_model *m, const struct step_head *h, int r) {
    const struct tmx_kernels_i *op = m->k->ops;
    struct kv_state *kv = m->kv;
    const int d = slice_width(&m->tp, h->n_vocab);
    const struct top_view v = top_view(kv->top, r);
    if (d == 0) return;
    if (h->n_edits)
        op->logit_edit(m->k->ctx, kv->logits, EDITS_AT(kv, kv->edit_dev), kv->edit_dev, r,
                       m->tp.vocab_n, m->tp.vocab0, d);
    op->topk(m->k->ctx, v.x, v.ids, v.stats, kv->logits, kv->temps, r, d, m->tp.vocab_n,
             TMX_TOPK_MAX);
}

/* TP, rank 0: row i's first candidates at temperature t from every rank's (gathered, rank
 * q's r rows at gathered + q * part): the first TMX_TOPK_MAX of their union in candidate order
 * (by x / t; ranks hold ascending ids, so the lower rank first among equal values), and the
 * sums, each rank's rescaled to the merged first candidate. */
static void merge_top(const struct tmx_model *m, const unsigned char *gathered, size_t part,
                      int r, int i, int n_vocab, float t, const struct step_out *out) {
    const struct tp_shard *tp = &m->tp;
    const size_t at_i = (size_t)i * TMX_TOPK_MAX;
    struct top_list *l = m->kv->top_lists;
    int lead = -1; /* the rank of the first candidate */
    for (int q = 0; q < tp->n; q++) {
        l[q].v = top_view((void *)(gathered + q * part), r);
        const int live = n_vocab > q * tp->vocab_stride && l[q].v.stats[3 * i + 1] > 0;
        l[q].at = live ? 0 : TMX_TOPK_MAX;
        if (live && (lead < 0 || l[q].v.x[at_i] / t > l[lead].v.x[at_i] / t)) lead = q;
    }
    double sum = 0.0, count = 0.0, sum1 = 0.0;
    const float x0 = lead < 0 ? 0.0f : l[lead].v.x[at_i];
    for (int q = 0; q < tp->n; q++)
        if (l[q].at == 0) {
            sum += l[q].v.stats[3 * i] * exp((double)(l[q].v.x[at_i] / t) - x0 / t);
            count += l[q].v.stats[3 * i + 1];
            sum1 += l[q].v.stats[3 * i + 2] * exp((double)l[q].v.x[at_i] - x0);
        }
    for (int j = 0; j < TMX_TOPK_MAX; j++) {
        int best = -1;
        for (int q = 0; q < tp->n; q++) {
            if (l[q].at == TMX_TOPK_MAX || l[q].v.ids[at_i + l[q].at] < 0) continue;
            if (best < 0 || l[q].v.x[at_i + l[q].at] / t > l[best].v.x[at_i + l[best].at] / t)
                best = q;
        }
        out->top_x[at_i + j] = best < 0 ? -INFINITY : l[best].v.x[at_i + l[best].at];
        out->top_id[at_i + j] =
            best < 0 ? -1 : best * tp->vocab_stride + l[best].v.ids[at_i + l[best].at++];
    }
    out->top_stat[3 * i] = count > 0 ? sum : 0.0;
    out->top_stat[3 * i + 1] = count;
    out->top_stat[3 * i + 2] = count > 0 ? sum1 : 0.0;
}

/* TP: every rank's kv->top of r rows to rank 0 (out's arrays NULL: a follower, which only
 * sends), which merges them into out. */
static enum tmx_status gather_top(struct tmx_model *m, const struct step_head *h, int r,
                                  const struct step_out *out, char **err) {
    struct kv_state *kv = m->kv;
    const size_t part = (size_t)r * TOP_ROW_BYTES;
    enum tmx_status st = tmx_comm_allgather(m->tp.data, kv->top, kv->top_all, part, err);
    if (st != TMX_OK || !out->top_x) return st;
    st = m->k->ops->buf_read(m->k->ctx, kv->top_gathered, kv->top_all, part * m->tp.n);
    for (int i = 0; st == TMX_OK && i < r; i++)
        merge_top(m, kv->top_gathered, part, r, i, h->n_vocab, out->temps[i], out);
    return st;
}

enum tmx_status tmx_step_top_read(struct tmx_model *m, int r, const struct step_out *out) {
    struct kv_state *kv = m->kv;
    enum tmx_status st = m->k->ops->buf_read(m->k->ctx, kv->top_host, kv->top,
                                             (size_t)r * TOP_ROW_BYTES);
    if (st != TMX_OK) return st;
    const struct top_view v = top_view(kv->top_host, r);
    const size_t TK = (size_t)r * TMX_TOPK_MAX;
    memcpy(out->top_x, v.x, TK * sizeof *v.x);
    memcpy(out->top_id, v.ids, TK * sizeof *v.ids);
    memcpy(out->top_stat, v.stats, 3 * (size_t)r * sizeof *v.stats);
    return TMX_OK;
}

enum tmx_status tmx_step_read(struct tmx_model *m, const struct step_head *h, int r, int done,
                              const struct step_out *out, char **err) {
    const size_t V = (size_t)m->cfg.vocab_size;
    if (h->pick == PICK_GREEDY)
        return pick_rows(m, r, h->n_vocab, out->next ? out->next + done : NULL, err);
    if (h->pick == PICK_TOP) { /* at most max_seqs rows: done is 0 */
        tmx_step_top_queue(m, h, r);
        return m->tp.n == 1 ? tmx_step_top_read(m, r, out) : gather_top(m, h, r, out, err);
    }
    return read_logits(m, r, out->logits ? out->logits + (size_t)done * V : NULL, err);
}

enum tmx_status tmx_step_row_read(struct tmx_model *m, int i, float *logits, char **err) {
    const struct tp_shard *tp = &m->tp;
    struct kv_state *kv = m->kv;
    const struct tmx_kernels_i *op = m->k->ops;
    const int V = m->cfg.vocab_size, stride = tp->vocab_stride;
    const float *row = kv->logits + (size_t)i * tp->vocab_n;
    if (tp->n == 1) return op->buf_read(m->k->ctx, logits, row, (size_t)V * sizeof *logits);
    const size_t part = (size_t)stride * sizeof(float);
    enum tmx_status st = tmx_comm_allgather(tp->data, row, kv->logits_all, part, err);
    if (st != TMX_OK || !logits) return st;
    if ((st = op->buf_read(m->k->ctx, kv->gathered, kv->logits_all, part * tp->n)) != TMX_OK)
        return st;
    for (int q = 0; q < tp->n; q++)
        memcpy(logits + (size_t)q * stride, kv->gathered + (size_t)q * stride,
               (size_t)(q == tp->n - 1 ? V - stride * q : stride) * sizeof *logits);
    return TMX_OK;
}

