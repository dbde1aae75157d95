/* eval-kld.c: the scoring and statistics of `tmx eval-kld` (tmx/eval.h, docs/fidelity.md).
 *
 * Everything is FP64 and deterministic: the bootstrap draws from a seeded splitmix64 stream in
 * a fixed order and sums in that order, so two runs give the same bits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tmx/eval.h"

/* --- one row ------------------------------------------------------------------------------- */

/* log(sum(exp(x - max))) + max over x[n], in FP64. */
static double log_sum_exp(const float *x, int n, double *max_out) {
    double m = -INFINITY, s = 0.0;
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - m);
    *max_out = m;
    return log(s);
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

void tmx_eval_score_row(const float *teacher, const float *model, int n_vocab, int target,
                        struct tmx_eval_row *out) {
    double tm, mm;
    const double tl = log_sum_exp(teacher, n_vocab, &tm), ml = log_sum_exp(model, n_vocab, &mm);
    double kld = 0.0;
    for (int i = 0; i < n_vocab; i++) {
        /* log p and log q; equal inputs give equal terms, so the sum is exactly 0 */
        const double lp = ((double)teacher[i] - tm) - tl, lq = ((double)model[i] - mm) - ml;
        kld += exp(lp) * (lp - lq);
    }
    out->kld = kld;
    out->teacher_top1 = argmax(teacher, n_vocab);
    out->model_top1 = argmax(model, n_vocab);
    out->teacher_logp = ((double)teacher[target] - tm) - tl;
    out->model_logp = ((double)model[target] - mm) - ml;
}

/* --- intervals ----------------------------------------------------------------------------- */

void tmx_eval_wilson(int64_t k, int64_t n, double z, double *lo, double *hi) {
    if (n <= 0) {
        *lo = 0.0;
        *hi = 1.0;
        return;
    }
    const double p = (double)k / (double)n, z2 = z * z, dn = (double)n;
    const double centre = (p + z2 / (2 * dn)) / (1 + z2 / dn);
    const double half = z / (1 + z2 / dn) * sqrt(p * (1 - p) / dn + z2 / (4 * dn * dn));
    *lo = fmax(0.0, centre - half);
    *hi = fmin(1.0, centre + half);
}

double tmx_eval_normal_cdf(double x) { return 0.5 * erfc(-x / sqrt(2.0)); }

/* By bisection on the distribution function: exact to the last bit or two, and called only a
 * few times per interval. */
double tmx_eval_normal_quantile(double p) {
    double lo = -40.0, hi = 40.0;
    for (int i = 0; i < 200; i++) {
        const double mid = 0.5 * (lo + hi);
        if (mid <= lo || mid >= hi) break;
        if (tmx_eval_normal_cdf(mid) < p) lo = mid;
        else hi = mid;
    }
    return 0.5 * (lo + hi);
}

uint64_t tmx_eval_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The q-quantile of sorted[n], linear between order statistics (numpy's default). */
static double quantile(const double *sorted, int n, double q) {
    const double pos = q * (double)(n - 1);
    const int i = (int)floor(pos);
    if (i >= n - 1) return sorted[n - 1];
    if (i < 0) return sorted[0];
    return sorted[i] + (pos - (double)i) * (sorted[i + 1] - sorted[i]);
}

/* Acceleration from the leave-one-window-out estimates jk[n] (n >= 2); 0 when they do not
 * spread. */
static double acceleration(const double *sum, const double *rows, int n, double S, double R,
                           double *jk) {
    double mean = 0.0;
    for (int i = 0; i < n; i++) mean += (jk[i] = (S - sum[i]) / (R - rows[i]));
    mean /= n;
    double num = 0.0, den = 0.0;
    for (int i = 0; i < n; i++) {
        const double d = mean - jk[i];
        num += d * d * d;
        den += d * d;
    }
    return den > 0.0 ? num / (6.0 * pow(den, 1.5)) : 0.0;
}

enum tmx_status tmx_eval_bootstrap(const double *sum, const double *rows, int n, int n_resamples,
                                   uint64_t seed, double level, struct tmx_eval_interval *out,
                                   char **err) {
    if (n < 1 || n_resamples < 1 || !(level > 0.0 && level < 1.0))
        return tmx_err(err, TMX_ERR_INVALID, "bootstrap: %d windows, %d resamples, level %g",
                       n, n_resamples, level);
    double S = 0.0, R = 0.0;
    for (int i = 0; i < n; i++) S += sum[i], R += rows[i];
    out->est = out->lo = out->hi = S / R;
    if (n == 1) return TMX_OK;

    double *theta = malloc((size_t)n_resamples * sizeof *theta); /* [B] resampled estimates */
    double *jk = malloc((size_t)n * sizeof *jk);                   /* [n] jackknife estimates */
    if (!theta || !jk) {
        free(theta);
        free(jk);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    }
    const double a = acceleration(sum, rows, n, S, R, jk);
    free(jk);
    uint64_t state = seed;
    int below = 0, at_or_below = 0;
    for (int b = 0; b < n_resamples; b++) {
        double s = 0.0, r = 0.0;
        for (int j = 0; j < n; j++) {
            const uint64_t i = ((tmx_eval_splitmix64(&state) >> 32) * (uint64_t)n) >> 32;
            s += sum[i];
            r += rows[i];
        }
        theta[b] = s / r;
        below += theta[b] < out->est;
        at_or_below += theta[b] <= out->est;
    }
    qsort(theta, (size_t)n_resamples, sizeof *theta, cmp_double);

    /* bias: the mid-rank of the estimate among the resamples, kept off 0 and 1 */
    const double B = n_resamples, edge = 0.5 / B;
    const double p0 = fmin(fmax((below + at_or_below) / (2.0 * B), edge), 1.0 - edge);
    const double z0 = tmx_eval_normal_quantile(p0);
    const double tail[2] = {0.5 * (1.0 - level), 1.0 - 0.5 * (1.0 - level)};
    double ends[2];
    for (int k = 0; k < 2; k++) {
        const double z = z0 + tmx_eval_normal_quantile(tail[k]), d = 1.0 - a * z;
        /* d <= 0 only for an extreme acceleration: the adjusted tail is then the end */
        const double q = d > 0.0 ? tmx_eval_normal_cdf(z0 + z / d) : k;
        ends[k] = quantile(theta, n_resamples, q);
    }
    out->lo = ends[0];
    out->hi = ends[1];
    free(theta);
    return TMX_OK;
}

/* --- n-gram overlap ------------------------------------------------------------------------ */

struct tmx_ngram_set {
    int order;
    size_t n;
    uint64_t *hash; /* [n] sorted, distinct */
};

/* FNV-1a over the ids' bytes, then a splitmix64 finish: 64-bit, so collisions among the few
 * million n-grams of a calibration set are negligible. */
static uint64_t ngram_hash(const int32_t *ids, int order) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < order; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int b = 0; b < 4; b++, v >>= 8) h = (h ^ (v & 0xff)) * 0x100000001b3ull;
    }
    return tmx_eval_splitmix64(&h);
}

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

enum tmx_status tmx_ngram_set_new(const int32_t *ids, size_t n, int order,
                                  struct tmx_ngram_set **out, char **err) {
    if (order < 1) return tmx_err(err, TMX_ERR_INVALID, "n-gram order %d < 1", order);
    const size_t count = n >= (size_t)order ? n - (size_t)order + 1 : 0;
    struct tmx_ngram_set *s = calloc(1, sizeof *s);
    if (s) s->hash = malloc((count ? count : 1) * sizeof *s->hash);
    if (!s || !s->hash) {
        tmx_ngram_set_free(s);
        return tmx_err(err, TMX_ERR_NOMEM, "out of memory for %zu n-grams", count);
    }
    s->order = order;
    for (size_t i = 0; i < count; i++) s->hash[i] = ngram_hash(ids + i, order);
    qsort(s->hash, count, sizeof *s->hash, cmp_u64);
    for (size_t i = 0; i < count; i++) /* keep one of each */
        if (s->n == 0 || s->hash[s->n - 1] != s->hash[i]) s->hash[s->n++] = s->hash[i];
    *out = s;
    return TMX_OK;
}

void tmx_ngram_set_free(struct tmx_ngram_set *s) {
    if (!s) return;
    free(s->hash);
    free(s);
}

double tmx_ngram_set_overlap(const struct tmx_ngram_set *s, const int32_t *ids, size_t n) {
    if (n < (size_t)s->order) return 0.0;
    const size_t count = n - (size_t)s->order + 1;
    size_t found = 0;
    for (size_t i = 0; i < count; i++) {
        const uint64_t h = ngram_hash(ids + i, s->order);
        found += s->n && bsearch(&h, s->hash, s->n, sizeof h, cmp_u64) != NULL;
    }
    return (double)found / (double)count;
}
