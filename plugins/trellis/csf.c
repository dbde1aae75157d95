/* csf.c: CSF, the lossless compressed form of a plane of E4M3 block scales.
 *
 * Scales of one row sit close together (they track the row's norm), so a row stores a base
 * code and each scale as a 4-bit offset from it: the window [base, base + 15] spans two
 * octaves of E4M3. Rows come in slabs of 16: the 16 bases, then the 16 rows of nibbles (column
 * 2c in the low nibble of byte c, 2c + 1 in the high one). A scale outside its row's window is
 * an exception: nibble 0 in the fixed stream and a uint32 `position | byte << 24` in a list
 * sorted by position (= row * cols + col). The encoder picks the base that leaves the fewest
 * exceptions (the lowest on ties), so a plane has exactly one encoding. */
#include <stdlib.h>
#include <string.h>

#include "impl.h"

#define WINDOW 16
#define POS_LIMIT (1ll << 24) /* positions are 24 bits */

static int64_t slab_size(int64_t cols) { return 16 + 8 * cols; }

static enum tmx_status check_geometry(const char *name, int64_t rows, int64_t cols, char **err) {
    if (rows <= 0 || rows % 16 != 0 || cols <= 0 || cols % 2 != 0)
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: a [%lld][%lld] scale plane: CSF needs rows a multiple of 16 and "
                           "an even, non-zero column count",
                           name, (long long)rows, (long long)cols);
    if (rows > POS_LIMIT / cols)
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: a [%lld][%lld] scale plane has more than 2^24 scales", name,
                           (long long)rows, (long long)cols);
    return TMX_OK;
}

/* The base whose window holds the most of row[cols] (the lowest such base). */
static unsigned pick_base(const uint8_t *row, int64_t cols) {
    int64_t hist[TMX_TRELLIS_SCALE_MAX + 1] = {0};
    for (int64_t c = 0; c < cols; c++) hist[row[c]]++;
    int64_t in = 0;
    for (int v = 0; v < WINDOW; v++) in += hist[v];
    int64_t best_in = in;
    unsigned best = 0;
    for (unsigned b = 1; b <= TMX_TRELLIS_CSF_BASE_MAX; b++) {
        in += hist[b + WINDOW - 1] - hist[b - 1];
        if (in > best_in) best_in = in, best = b;
    }
    return best;
}

static int in_window(unsigned v, unsigned base) { return v >= base && v < base + WINDOW; }

enum tmx_status tmx_trellis_csf_encode(const uint8_t *scales, int64_t rows, int64_t cols,
                                       uint8_t *fixed, uint32_t **exceptions,
                                       int64_t *n_exceptions, char **err) {
    *exceptions = NULL;
    *n_exceptions = 0;
    enum tmx_status st = check_geometry("csf encode", rows, cols, err);
    if (st != TMX_OK) return st;
    for (int64_t i = 0; i < rows * cols; i++)
        if (scales[i] > TMX_TRELLIS_SCALE_MAX)
            return trellis_err(err, TMX_ERR_INVALID,
                               "csf encode: scale [%lld][%lld] = 0x%02x is not a legal block "
                               "scale (0x00..0x7e)",
                               (long long)(i / cols), (long long)(i % cols), scales[i]);

    /* Fixed stream first; exceptions are counted on the way and listed in a second sweep. */
    int64_t n_ex = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = scales + r * cols;
        uint8_t *slab = fixed + (r / 16) * slab_size(cols);
        uint8_t *nib = slab + 16 + (r % 16) * (cols / 2);
        const unsigned base = pick_base(row, cols);
        slab[r % 16] = (uint8_t)base;
        memset(nib, 0, (size_t)(cols / 2));
        for (int64_t c = 0; c < cols; c++) {
            if (in_window(row[c], base))
                nib[c / 2] |= (uint8_t)((row[c] - base) << (4 * (c & 1)));
            else
                n_ex++;
        }
    }
    if (n_ex == 0) return TMX_OK;
    uint32_t *ex = malloc((size_t)n_ex * sizeof *ex);
    if (!ex) return trellis_err(err, TMX_ERR_NOMEM, "csf encode: out of memory");
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++) {
        const unsigned base = fixed[(r / 16) * slab_size(cols) + r % 16];
        for (int64_t c = 0; c < cols; c++)
            if (!in_window(scales[r * cols + c], base))
                ex[k++] = (uint32_t)(r * cols + c) | (uint32_t)scales[r * cols + c] << 24;
    }
    *exceptions = ex;
    *n_exceptions = n_ex;
    return TMX_OK;
}

enum tmx_status tmx_trellis_csf_decode(const char *name, const uint8_t *fixed, int64_t fixed_size,
                                       const uint32_t *exceptions, int64_t n_exceptions,
                                       int64_t rows, int64_t cols, uint8_t *scales, char **err) {
    enum tmx_status st = check_geometry(name, rows, cols, err);
    if (st != TMX_OK) return st;
    const int64_t want = tmx_trellis_csf_fixed_size(rows, cols);
    if (fixed_size != want)
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: fixed stream is %lld bytes, a [%lld][%lld] plane needs %lld",
                           name, (long long)fixed_size, (long long)rows, (long long)cols,
                           (long long)want);
    if (n_exceptions < 0 || n_exceptions > rows * cols)
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: %lld exceptions for a plane of %lld scales", name,
                           (long long)n_exceptions, (long long)(rows * cols));

    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *slab = fixed + (r / 16) * slab_size(cols);
        const uint8_t *nib = slab + 16 + (r % 16) * (cols / 2);
        const unsigned base = slab[r % 16];
        if (base > TMX_TRELLIS_CSF_BASE_MAX)
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: row %lld: base 0x%02x is above 0x%02x", name, (long long)r,
                               base, TMX_TRELLIS_CSF_BASE_MAX);
        for (int64_t c = 0; c < cols; c++)
            scales[r * cols + c] = (uint8_t)(base + (nib[c / 2] >> (4 * (c & 1)) & 0xf));
    }

    int64_t prev = -1;
    for (int64_t i = 0; i < n_exceptions; i++) {
        const int64_t pos = exceptions[i] & 0xffffff;
        const unsigned byte = exceptions[i] >> 24;
        if (pos >= rows * cols)
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: exception %lld: position %lld is past the plane's %lld "
                               "scales",
                               name, (long long)i, (long long)pos, (long long)(rows * cols));
        if (pos <= prev)
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: exception %lld: position %lld does not follow %lld "
                               "(positions must increase)",
                               name, (long long)i, (long long)pos, (long long)prev);
        const int64_t r = pos / cols, c = pos % cols;
        const unsigned base = fixed[(r / 16) * slab_size(cols) + r % 16];
        if (byte > TMX_TRELLIS_SCALE_MAX)
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: exception %lld at [%lld][%lld]: 0x%02x is not a legal block "
                               "scale (0x00..0x7e)",
                               name, (long long)i, (long long)r, (long long)c, byte);
        if (in_window(byte, base))
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: exception %lld at [%lld][%lld]: 0x%02x is inside the row's "
                               "window 0x%02x..0x%02x",
                               name, (long long)i, (long long)r, (long long)c, byte, base,
                               base + WINDOW - 1);
        if (scales[pos] != base)
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: exception %lld at [%lld][%lld]: the nibble under it is %u, "
                               "not 0",
                               name, (long long)i, (long long)r, (long long)c,
                               scales[pos] - base);
        scales[pos] = (uint8_t)byte;
        prev = pos;
    }
    return TMX_OK;
}

enum tmx_status tmx_trellis_csf_check_starts(const char *name, const int32_t *starts,
                                             int64_t n_experts, int64_t n_exceptions,
                                             char **err) {
    if (starts[0] != 0)
        return trellis_err(err, TMX_ERR_INVALID, "%s: starts[0] is %d, not 0", name, starts[0]);
    for (int64_t e = 0; e < n_experts; e++)
        if (starts[e + 1] < starts[e])
            return trellis_err(err, TMX_ERR_INVALID,
                               "%s: starts[%lld] = %d is below starts[%lld] = %d", name,
                               (long long)(e + 1), starts[e + 1], (long long)e, starts[e]);
    if (starts[n_experts] != n_exceptions)
        return trellis_err(err, TMX_ERR_INVALID,
                           "%s: starts[%lld] = %d, but the list holds %lld exceptions", name,
                           (long long)n_experts, starts[n_experts], (long long)n_exceptions);
    return TMX_OK;
}
