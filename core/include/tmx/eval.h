/* tmx/eval.h: the scoring and statistics of `tmx eval-kld` (docs/fidelity.md) — the KL
 * divergence of one next-token row in FP64, the Wilson interval of an agreement rate, the
 * window-block bootstrap (BCa) of a row-weighted mean, and the n-gram overlap screen against
 * calibration text. Pure functions, except the n-gram set, which owns its hashes. */
#ifndef TMX_EVAL_H
#define TMX_EVAL_H

#include <stddef.h>
#include <stdint.h>

#include "tmx/status.h"

/* One next-token row of a teacher and a model, both over the same n_vocab logits. */
struct tmx_eval_row {
    double kld;              /* KL(softmax(teacher) || softmax(model)) in nats */
    int teacher_top1;        /* argmax, the lowest id on ties */
    int model_top1;
    double teacher_logp;     /* log-probability of the target token */
    double model_logp;
};

/* Scores teacher[n_vocab] against model[n_vocab] in FP64 (log-softmax with the maximum
 * subtracted). Equal inputs give kld exactly 0. target: the token that follows. */
void tmx_eval_score_row(const float *teacher, const float *model, int n_vocab, int target,
                        struct tmx_eval_row *out);

/* Wilson score interval of k successes in n trials at normal quantile z (1.959963984540054
 * for 95%); n = 0 gives [0, 1]. */
void tmx_eval_wilson(int64_t k, int64_t n, double z, double *lo, double *hi);

/* The standard normal distribution function and its inverse (p in (0, 1)). */
double tmx_eval_normal_cdf(double x);
double tmx_eval_normal_quantile(double p);

/* The random stream of the bootstrap: splitmix64, so that a script can reproduce it. */
uint64_t tmx_eval_splitmix64(uint64_t *state);

struct tmx_eval_interval {
    double est, lo, hi;
};

/* Window-block bootstrap of the row-weighted mean est = sum(sum[i]) / sum(rows[i]) over n
 * windows (rows[i] > 0): n_resamples draws of n windows with replacement, window index
 * ((splitmix64() >> 32) * n) >> 32 in draw order from state `seed`; the BCa interval at
 * `level` (bias from the mid-rank of est among the resamples, clamped to [1/2B, 1 - 1/2B];
 * acceleration from the leave-one-window-out jackknife, 0 when that has no spread), read off
 * the sorted resamples with linear interpolation. One window gives [est, est]. */
enum tmx_status tmx_eval_bootstrap(const double *sum, const double *rows, int n, int n_resamples,
                                   uint64_t seed, double level, struct tmx_eval_interval *out,
                                   char **err);

/* The set of n-grams (of `order` token ids) of a text, as 64-bit hashes. */
struct tmx_ngram_set;

enum tmx_status tmx_ngram_set_new(const int32_t *ids, size_t n, int order,
                                  struct tmx_ngram_set **out, char **err);
void tmx_ngram_set_free(struct tmx_ngram_set *s);
/* Of the n - order + 1 n-grams of ids[0..n) (every position, repeats counted), the fraction
 * found in the set; 0 when n < order. */
double tmx_ngram_set_overlap(const struct tmx_ngram_set *s, const int32_t *ids, size_t n);

#endif
