/* matrix.c: a whole trellis-coded matrix, decoded to f32 (the reference the codec plugins
 * check their matmuls against, and the encoder its result).
 *
 *     W = diag(s_out) H (g * B . C) H diag(s_in)
 *
 * C holds the decoded code values, B the block scales broadcast over their blocks, g the
 * matrix scale; H is the blockwise Hadamard-128 on each side. */
#include <math.h>
#include <stdlib.h>

#include "impl.h"
#include "tmx/tensor.h"

enum tmx_status tmx_trellis_matrix_check(const struct tmx_trellis_matrix *m, char **err) {
    if (!m->law)
        return trellis_err(err, TMX_ERR_INVALID, "trellis matrix: no decode law");
    const int k_max = tmx_trellis_k_max(m->law->id);
    if (m->K < TMX_TRELLIS_K_MIN || m->K > k_max)
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis matrix: K = %d is not in %d..%d (law %s)", m->K,
                           TMX_TRELLIS_K_MIN, k_max, tmx_trellis_law_name(m->law->id));
    const int block = m->law->id == TMX_TRELLIS_LAW_E2M1 ? 16 : 32;
    if (m->block != block)
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis matrix: block %d, but law %s has block scales per %d inputs",
                           m->block, tmx_trellis_law_name(m->law->id), block);
    if (m->rows <= 0 || m->rows % TMX_TRELLIS_HADAMARD || m->cols <= 0 ||
        m->cols % TMX_TRELLIS_HADAMARD)
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis matrix: [%lld][%lld] is not a multiple of 128 on both sides",
                           (long long)m->rows, (long long)m->cols);
    if (!(m->scale > 0.0f && isfinite(m->scale)))
        return trellis_err(err, TMX_ERR_INVALID,
                           "trellis matrix: scale %g is not a positive finite number",
                           (double)m->scale);
    const int64_t n_scales = m->rows * (m->cols / m->block);
    for (int64_t i = 0; i < n_scales; i++)
        if (m->scales[i] > TMX_TRELLIS_SCALE_MAX)
            return trellis_err(err, TMX_ERR_INVALID,
                               "trellis matrix: block scale %lld is 0x%02x, not a legal block "
                               "scale (0x00..0x7e)",
                               (long long)i, m->scales[i]);
    return TMX_OK;
}

void tmx_trellis_matrix_operands(const struct tmx_trellis_matrix *m, float *q) {
    const int64_t tiles_c = m->cols / 16, n_blocks = m->cols / m->block;
    const int nw = tmx_trellis_words(m->K);
    float tile[TMX_TRELLIS_TILE]; /* [16][16] */
    for (int64_t tr = 0; tr < m->rows / 16; tr++)
        for (int64_t tc = 0; tc < tiles_c; tc++) {
            tmx_trellis_decode_values(m->law, m->words + (tr * tiles_c + tc) * nw, m->K, tile);
            for (int r = 0; r < 16; r++) {
                const int64_t row = 16 * tr + r, col = 16 * tc;
                /* B * C is exact in f32 (at most 8 significant bits); g rounds once. */
                const float b = tmx_e4m3_to_f32(m->scales[row * n_blocks + col / m->block]);
                for (int c = 0; c < 16; c++)
                    q[row * m->cols + col + c] = m->scale * (b * tile[16 * r + c]);
            }
        }
}

/* The left H: butterflies between whole rows, 128 rows at a time, in the same stage order and
 * with the same normalization as tmx_trellis_hadamard applies to one vector. */
static void hadamard_rows(float *w, int64_t rows, int64_t cols) {
    for (int64_t b = 0; b < rows; b += TMX_TRELLIS_HADAMARD) {
        float *blk = w + b * cols; /* [128][cols] */
        for (int h = 1; h < TMX_TRELLIS_HADAMARD; h <<= 1)
            for (int i = 0; i < TMX_TRELLIS_HADAMARD; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    float *p = blk + j * cols, *q = blk + (j + h) * cols;
                    for (int64_t c = 0; c < cols; c++) {
                        const float a = p[c], d = q[c];
                        p[c] = a + d;
                        q[c] = a - d;
                    }
                }
        for (int64_t i = 0; i < TMX_TRELLIS_HADAMARD * cols; i++) blk[i] *= TRELLIS_HADAMARD_NORM;
    }
}

void tmx_trellis_matrix_dequant(const struct tmx_trellis_matrix *m, float *w) {
    tmx_trellis_matrix_operands(m, w);
    /* Right side: row i of Q H diag(s_in) is s_in . (H q_i), H being symmetric. */
    for (int64_t r = 0; r < m->rows; r++)
        tmx_trellis_unrotate(m->sign_in, w + r * m->cols, m->cols);
    /* Left side: diag(s_out) H mixes rows, then negates the rows s_out marks. */
    hadamard_rows(w, m->rows, m->cols);
    for (int64_t r = 0; r < m->rows; r++)
        if (m->sign_out[r >> 3] >> (r & 7) & 1)
            for (int64_t c = 0; c < m->cols; c++) w[r * m->cols + c] = -w[r * m->cols + c];
}
