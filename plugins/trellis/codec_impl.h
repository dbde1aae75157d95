/* codec_impl.h: what the files behind codec.h share (layer.c, experts.c, tiles.c), and what
 * the codec's test and benchmark reach inside. */
#ifndef TMX_TRELLIS_CODEC_IMPL_H
#define TMX_TRELLIS_CODEC_IMPL_H

#include "codec.h"
#include "pool.h"

#define TRELLIS_GROUP 32 /* tokens one work item multiplies with each decoded tile */
#define TRELLIS_CHUNK 4  /* tiles decoded at a time, then multiplied with every token */
/* moe_experts' buffers; longer steps go in token chunks. Each chunk decodes its experts'
 * weights anew, so the budget holds a 512-token step of the full-size model (latent = inter =
 * 4096, top 8: 425 KiB a token) in one. */
#define TRELLIS_SCRATCH_BUDGET ((size_t)256 << 20)

/* A ctx: one per plugin init. */
struct trellis_codec {
    const struct tmx_host *host;
    const struct tmx_trellis_codec_spec *spec;
    enum tmx_trellis_codec_id id;
    int serving;                 /* 1: activations in the serving formats (§7); 0: F32 */
    struct tmx_pool *own;        /* threads of its own; NULL once a kernel set lends its */
    struct tmx_threads threads;  /* where moe_experts' work runs: own's, or the lent ones */
    size_t budget;               /* TRELLIS_SCRATCH_BUDGET (tests lower it) */
    void *scratch;               /* moe_experts' buffers, grown on demand up to the budget */
    size_t scratch_size;
    void *device;                /* the device path's buffers (cuda/codec_device.c), or NULL */
};

/* What tmx_trellis_codec_init makes of its options (threads >= 1); free with
 * tmx_trellis_codec_fini. */
enum tmx_status trellis_codec_new(const struct tmx_host *host, enum tmx_trellis_codec_id id,
                                  int threads, int serving, struct trellis_codec **out);

/* The routed experts of one MoE layer. Matrices are views: words into the mmapped experts/
 * files, scales into `scales`, signs into the mmapped coupled file. */
struct trellis_layer {
    int layer, n_experts, latent, inter;
    struct tmx_trellis_law law;
    struct tmx_trellis_matrix *mat;   /* [n_experts][3]: gate, up, down */
    uint8_t *scales;                  /* every matrix's expanded block scales, owned */
    const uint8_t *sign_in;           /* [latent/8] sign_latent_in */
    const uint8_t *sign_mid;          /* [inter/8] sign_intermediate */
    const uint8_t *sign_out;          /* [latent/8] sign_latent_out */
    struct tmx_safetensors *coupled;
    int n_files;
    struct tmx_safetensors **files;   /* [n_files] experts/ chunks */
    /* A tensor-parallel rank's slice (docs/tp.md): inter and sign_mid above are the slice's,
     * gate and up are row views of the files; down's columns are copied here. NULL: whole. */
    uint32_t *down_words;             /* [n_experts][latent/16][inter/16][8K] */
    uint8_t *down_scales;             /* [n_experts][latent][inter/block] */
};

/* --- tiles.c: decoded tiles times activations ---------------------------------------------- */

/* Per-thread scratch of trellis_rows_mul. */
struct trellis_tiles_scratch {
    float tiles[TRELLIS_CHUNK][TMX_TRELLIS_TILE] __attribute__((aligned(32)));
    float acc[TRELLIS_GROUP][64] __attribute__((aligned(32)));
};

/* An activation vector x[cols] in the order a decoded tile multiplies it: xp[cols/16][4][8],
 * for tile column j and k-quad q the eight values x[c], x[c+1], x[c+8], x[c+9] twice over,
 * c = 16j + 2q (the columns of one B fragment, §2). */
void trellis_operands_lay(const float *x, int64_t cols, float *xp);

/* One tile (tile row tr, column tc) decoded and scaled: out[256] in trellis order, position t
 * holding B[r][b] * C[r][c] for its row r and column c (exact in f32, §5). */
void trellis_tile_operands(const struct tmx_trellis_matrix *m, int64_t tr, int64_t tc,
                           float *out);

/* y[i][r] = g * xscale[i] * sum_c (B . C)[r][c] * x_i[c] for rows r0 <= r < r1 (multiples of
 * 16) and n <= TRELLIS_GROUP vectors x[i], laid out by trellis_operands_lay. Each tile is
 * decoded once for all n. A row's sum runs in a fixed order whatever n, the rows or the
 * thread. */
void trellis_rows_mul(const struct tmx_trellis_matrix *m, int64_t r0, int64_t r1, int n,
                      const float *const *x, const float *xscale, float *const *y,
                      struct trellis_tiles_scratch *s);

#endif
