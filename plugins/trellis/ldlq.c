/* ldlq.c: what the encoder does with a Hessian: rotate it into the coded basis, factor it into
 * LDLQ error feedback, and weigh an error with it.
 *
 * LDLQ (QuIP's "LDL quantization", blockwise as QTIP and EXL3 run it): code the 16-column
 * blocks of W from last to first, each with target_j = w_j + sum_{i>j} e_i a_ij, e = w - w^.
 * Then e (I + A) = d, d the blocks' own coding errors, and with h = (I + A) D (I + A)^T the
 * proxy tr(e h e^T) is sum_j tr(d_j D_j d_j^T): the feedback makes each block absorb the
 * errors of those coded before it, as far as the inputs' correlations let it. The Cholesky
 * factor gives that form directly: h = L L^T = (L Ld^-1) (Ld Ld^T) (L Ld^-1)^T. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "encode.h"
#include "impl.h"

#define LDLQ_DAMP 0.025 /* regularization: this fraction of the mean diagonal */
#define LDLQ_RETRIES 10 /* doublings of it before giving up */

/* --- rotations ----------------------------------------------------------------------------- */

/* Butterflies between whole rows of w[rows][cols] (float or double: `T`), 128 rows at a time:
 * the left multiplication by the blockwise Hadamard, with the stage order of hadamard.c. */
#define HADAMARD_ROWS(T, w, rows, cols, norm)                                                 \
    for (int64_t b = 0; b < (rows); b += TMX_TRELLIS_HADAMARD) {                              \
        T *blk = (w) + b * (cols); /* [128][cols] */                                          \
        for (int h = 1; h < TMX_TRELLIS_HADAMARD; h <<= 1)                                    \
            for (int i = 0; i < TMX_TRELLIS_HADAMARD; i += 2 * h)                             \
                for (int j = i; j < i + h; j++) {                                             \
                    T *p = blk + j * (cols), *q = blk + (j + h) * (cols);                     \
                    for (int64_t c = 0; c < (cols); c++) {                                    \
                        const T x = p[c], y = q[c];                                           \
                        p[c] = x + y;                                                         \
                        q[c] = x - y;                                                         \
                    }                                                                         \
                }                                                                             \
        for (int64_t i = 0; i < TMX_TRELLIS_HADAMARD * (cols); i++) blk[i] *= (norm);         \
    }

static inline int sign_bit(const uint8_t *s, int64_t i) { return s[i >> 3] >> (i & 7) & 1; }

void tmx_trellis_rotate_matrix(float *w, int64_t rows, int64_t cols, const uint8_t *sign_out,
                               const uint8_t *sign_in) {
    /* Right: row r of W S_in H is H (s_in . w_r), H being symmetric. */
    for (int64_t r = 0; r < rows; r++) tmx_trellis_rotate(sign_in, w + r * cols, cols);
    /* Left: H S_out negates the rows s_out marks, then mixes rows. */
    for (int64_t r = 0; r < rows; r++)
        if (sign_bit(sign_out, r))
            for (int64_t c = 0; c < cols; c++) w[r * cols + c] = -w[r * cols + c];
    HADAMARD_ROWS(float, w, rows, cols, TRELLIS_HADAMARD_NORM)
}

/* x[n] <- H (s . x) in double, blockwise. */
static void rotate_vec(double *x, int64_t n, const uint8_t *s) {
    for (int64_t i = 0; i < n; i++)
        if (sign_bit(s, i)) x[i] = -x[i];
    for (int64_t b = 0; b < n; b += TMX_TRELLIS_HADAMARD) {
        double *y = x + b; /* [128] */
        for (int h = 1; h < TMX_TRELLIS_HADAMARD; h <<= 1)
            for (int i = 0; i < TMX_TRELLIS_HADAMARD; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const double p = y[j], q = y[j + h];
                    y[j] = p + q;
                    y[j + h] = p - q;
                }
        for (int i = 0; i < TMX_TRELLIS_HADAMARD; i++) y[i] *= M_SQRT1_2 / 8.0; /* 1/sqrt(128) */
    }
}

void tmx_trellis_rotate_hessian(double *h, int64_t n, const uint8_t *sign) {
    for (int64_t r = 0; r < n; r++) rotate_vec(h + r * n, n, sign);
    for (int64_t r = 0; r < n; r++)
        if (sign_bit(sign, r))
            for (int64_t c = 0; c < n; c++) h[r * n + c] = -h[r * n + c];
    HADAMARD_ROWS(double, h, n, n, M_SQRT1_2 / 8.0)
}

/* --- the factorization --------------------------------------------------------------------- */

/* x . y over n doubles, four partial sums so that the loop pipelines. */
static double dot(const double *x, const double *y, int64_t n) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += x[i] * y[i];
        s1 += x[i + 1] * y[i + 1];
        s2 += x[i + 2] * y[i + 2];
        s3 += x[i + 3] * y[i + 3];
    }
    for (; i < n; i++) s0 += x[i] * y[i];
    return (s0 + s1) + (s2 + s3);
}

/* In place, row by row: the lower triangle of a[n][n] becomes L with L L^T = a (the upper
 * triangle is not read). Returns 0 when a pivot is not positive: a is not positive definite. */
static int cholesky(double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double *li = a + i * n;
        for (int64_t j = 0; j < i; j++) {
            const double *lj = a + j * n;
            li[j] = (li[j] - dot(li, lj, j)) / lj[j];
        }
        const double d = li[i] - dot(li, li, i);
        if (!(d > 0.0)) return 0;
        li[i] = sqrt(d);
    }
    return 1;
}

enum tmx_status tmx_trellis_ldlq_factor(const double *h, int64_t n, double *a, double *lambda,
                                        char **err) {
    if (n <= 0 || n % TMX_TRELLIS_LDLQ_BLOCK)
        return trellis_err(err, TMX_ERR_INVALID, "ldlq: size %lld is not a multiple of %d",
                           (long long)n, TMX_TRELLIS_LDLQ_BLOCK);
    double mean = 0.0;
    for (int64_t i = 0; i < n; i++) mean += h[i * n + i];
    mean /= (double)n;
    if (!isfinite(mean))
        return trellis_err(err, TMX_ERR_INVALID, "ldlq: the Hessian is not finite");
    if (!(mean > 0.0))
        return trellis_err(err, TMX_ERR_INVALID, "ldlq: the Hessian's diagonal is zero (no "
                           "inputs)");
    double damp = LDLQ_DAMP * mean;
    int ok = 0;
    for (int t = 0; !ok && t <= LDLQ_RETRIES; t++, damp *= 2.0) {
        memcpy(a, h, (size_t)(n * n) * sizeof *a);
        for (int64_t i = 0; i < n; i++) a[i * n + i] += damp;
        if ((ok = cholesky(a, n))) *lambda = damp;
    }
    if (!ok)
        return trellis_err(err, TMX_ERR_INVALID, "ldlq: the Hessian stays indefinite with %g "
                           "added to its diagonal", damp / 2.0);

    /* a[i][block] <- L[i][block] Ld^-1 below each diagonal block: solve x Ld = L[i][block] with
     * Ld lower triangular, last column first. The diagonal blocks, read by every solve of their
     * column, are cleared only afterwards. */
    const int B = TMX_TRELLIS_LDLQ_BLOCK;
    for (int64_t c0 = 0; c0 < n; c0 += B) {
        const double *ld = a + c0 * n + c0; /* Ld[r][c] = ld[r * n + c] */
        for (int64_t i = c0 + B; i < n; i++) {
            double *x = a + i * n + c0;
            for (int c = B - 1; c >= 0; c--) {
                double s = x[c];
                for (int k = c + 1; k < B; k++) s -= x[k] * ld[k * n + c];
                x[c] = s / ld[c * n + c];
            }
        }
    }
    for (int64_t i = 0; i < n; i++) /* keep the strictly block-lower part */
        for (int64_t j = i / B * B; j < n; j++) a[i * n + j] = 0.0;
    return TMX_OK;
}

/* --- the proxy error ----------------------------------------------------------------------- */

typedef double f64x4 __attribute__((vector_size(32)));

static inline f64x4 load4(const double *p) {
    f64x4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline double sum4(f64x4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* For rows i..i+3 of h[n][n] (n % 4 == 0): *num += sum_k e[i+k] (h_{i+k} . e) and likewise
 * *den for w: eight dot products that share every load. */
static void rows4(const double *h, int64_t i, const double *e, const double *w, int64_t n,
                  double *num, double *den) {
    f64x4 ae[4] = {{0}}, aw[4] = {{0}};
    for (int64_t j = 0; j < n; j += 4) {
        const f64x4 ev = load4(e + j), wv = load4(w + j);
        for (int k = 0; k < 4; k++) {
            const f64x4 hv = load4(h + (i + k) * n + j);
            ae[k] += hv * ev;
            aw[k] += hv * wv;
        }
    }
    for (int k = 0; k < 4; k++) {
        *num += e[i + k] * sum4(ae[k]);
        *den += w[i + k] * sum4(aw[k]);
    }
}

enum tmx_status tmx_trellis_proxy_error(const float *w, const float *q, int64_t rows,
                                        int64_t cols, const double *h, double *out, char **err) {
    double num = 0.0, den = 0.0;
    if (!h) {
        for (int64_t i = 0; i < rows * cols; i++) {
            const double e = (double)w[i] - q[i];
            num += e * e;
            den += (double)w[i] * w[i];
        }
        *out = den > 0.0 ? num / den : 0.0;
        return TMX_OK;
    }
    /* 16 rows at a time, so that each row of h is read once per strip: sum_r x_r^T h x_r with
     * x_r = e_r and w_r. */
    enum { S = 16 };
    double *x = malloc((size_t)(2 * S * cols) * sizeof *x); /* [2][S][cols]: e, then w */
    if (!x) return trellis_err(err, TMX_ERR_NOMEM, "trellis proxy error: out of memory");
    for (int64_t r0 = 0; r0 < rows; r0 += S) {
        const int n = rows - r0 < S ? (int)(rows - r0) : S;
        for (int r = 0; r < n; r++)
            for (int64_t c = 0; c < cols; c++) {
                const int64_t k = (r0 + r) * cols + c;
                x[r * cols + c] = (double)w[k] - q[k];
                x[(S + r) * cols + c] = w[k];
            }
        for (int64_t i = 0; i < cols; i += 4) /* cols % 128 == 0 */
            for (int r = 0; r < n; r++)
                rows4(h, i, x + r * cols, x + (S + r) * cols, cols, &num, &den);
    }
    free(x);
    *out = den > 0.0 ? num / den : 0.0;
    return TMX_OK;
}
