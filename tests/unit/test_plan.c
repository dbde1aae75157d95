/* test_plan.c: the memory planner (core/plan.c, tmx/plan.h, docs/plan.md).
 *
 * Sizes and GPU specs parse and are refused by flag name. A small Muse config is planned
 * virtually at TP 4 with trellis-fp4 experts and an int8 KV cache, and every figure is checked
 * against a hand count from docs/model.md, docs/trellismx.md and core/forward.c (written out
 * below, not computed by the planner's code). The capacity answers are the boundary: the
 * longest context and the most sequences fit, one more does not. Bad options fail naming the
 * flag. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tmx/plan.h"

static char dir[] = "/tmp/tmx-plan-XXXXXX";

/* D 256, 4 layers (sliding, full, sliding, full), 8 query / 4 KV heads of 32, vocab 1001 (not
 * a multiple of 4: rank 0 gets 251 rows), layer 0 dense (512 wide), layers 1..3 MoE: 16 experts
 * of latent 128, width 256, top 2, one shared expert (256 wide); residual gates. */
static const char config[] =
    "{\"model_type\": \"muse_spark\", \"vocab_size\": 1001, \"hidden_size\": 256,"
    " \"num_hidden_layers\": 4, \"num_attention_heads\": 8, \"num_key_value_heads\": 4,"
    " \"head_dim\": 32, \"layer_types\": [\"sliding_attention\", \"full_attention\","
    " \"sliding_attention\", \"full_attention\"], \"sliding_window\": 64,"
    " \"max_position_embeddings\": 4096, \"intermediate_size\": 512, \"dense_layers\": [0],"
    " \"n_routed_experts\": 16, \"num_experts_per_tok\": 2, \"moe_latent_size\": 128,"
    " \"moe_intermediate_size\": 256, \"n_shared_experts\": 1, \"residual_gates\": true}\n";

static int setup(void **state) {
    (void)state;
    strcpy(dir, "/tmp/tmx-plan-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(config, f);
    fclose(f);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    return 0;
}

static void test_parse(void **state) {
    (void)state;
    uint64_t b = 0;
    int n = 0;
    char *err = NULL;
    assert_int_equal(tmx_plan_parse_size("96GiB", &b, &err), TMX_OK);
    assert_true(b == (uint64_t)96 << 30);
    assert_int_equal(tmx_plan_parse_size("80GB", &b, &err), TMX_OK);
    assert_true(b == 80000000000ull);
    assert_int_equal(tmx_plan_parse_size("1.5TiB", &b, &err), TMX_OK);
    assert_true(b == (uint64_t)3 << 39);
    assert_int_equal(tmx_plan_parse_size("512B", &b, &err), TMX_OK);
    assert_true(b == 512);
    const char *bad[] = {"96", "GiB", "-1GiB", "96gib", "96 GiB", "nanGiB", ""};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(tmx_plan_parse_size(bad[i], &b, &err), TMX_ERR_INVALID);
        free(err);
        err = NULL;
    }
    assert_int_equal(tmx_plan_parse_gpus("4x96GiB", &n, &b, &err), TMX_OK);
    assert_int_equal(n, 4);
    assert_true(b == (uint64_t)96 << 30);
    assert_int_equal(tmx_plan_parse_gpus("141GB", &n, &b, &err), TMX_OK);
    assert_int_equal(n, 1);
    assert_true(b == 141000000000ull);
    const char *bad_gpus[] = {"4x", "0x96GiB", "x96GiB", "4x96", "fourx96GiB", "4x96GiBx"};
    for (size_t i = 0; i < sizeof bad_gpus / sizeof *bad_gpus; i++) {
        assert_int_equal(tmx_plan_parse_gpus(bad_gpus[i], &n, &b, &err), TMX_ERR_INVALID);
        assert_non_null(strstr(err, "--gpus"));
        assert_null(strchr(err, '\n'));
        free(err);
        err = NULL;
    }
}

static struct tmx_plan_options base(void) {
    return (struct tmx_plan_options){.tp = 4, .context = 2048, .seqs = 2, .batch = 128,
                                     .block_size = 16, .kv_dtype = TMX_DTYPE_I8,
                                     .reserve = 4096, .virtual_model = 1,
                                     .experts = "trellis-fp4", .bits = 3};
}

static void test_virtual_numbers(void **state) {
    (void)state;
    struct tmx_plan_options o = base();
    struct tmx_plan p;
    char *err = NULL;
    assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_OK);
    assert_string_equal(p.experts_codec, "trellis-fp4");
    assert_int_equal(p.experts_block, 16);
    assert_true(p.attention_mxfp8);
    /* attention: q, o 256x256, k, v 128x256 per layer, MXFP8 (a byte a weight and one per 32);
     * 1 of 4 KV heads */
    assert_int_equal(p.part_rank[TMX_PLAN_ATTENTION],
                     4 * (2 * 256 * 256 + 2 * 128 * 256) * 33 / 32 / 4);
    /* experts: 3 layers x 16 experts x 3 matrices of 128x256, 3 bits of tile words + one byte
     * per 16-weight block scale; gate/up 16 row strips, down 16 tile columns: 4 per rank */
    assert_int_equal(p.part_rank[TMX_PLAN_EXPERTS],
                     3 * 16 * 3 * (128 * 256 * 3 / 8 + 128 * 256 / 16) / 4);
    /* MLPs: layer 0 dense (3 x 512x256) and 3 shared experts (3 x 256x256), BF16, quartered */
    assert_int_equal(p.part_rank[TMX_PLAN_MLP], (3 * 512 * 256 * 2 + 3 * 3 * 256 * 256 * 2) / 4);
    /* embedding and lm_head, 251 of 1001 rows of 256 BF16 each */
    assert_int_equal(p.part_rank[TMX_PLAN_VOCAB], 2 * 251 * 256 * 2);
    assert_int_equal(p.part_model[TMX_PLAN_VOCAB], 2 * 1001 * 256 * 2);
    /* replicated: routers 16x256 BF16 + 16 F32 biases; bridges 2 x 128x256 BF16 */
    assert_int_equal(p.part_rank[TMX_PLAN_ROUTERS], 3 * (16 * 256 * 2 + 16 * 4));
    assert_int_equal(p.part_rank[TMX_PLAN_BRIDGES], 3 * 2 * 128 * 256 * 2);
    /* norms: per layer 2 RMSNorms + 2 gates of 256 and q/k norms of 32; 3 post-expert norms
     * of 128; the final norm; all BF16 */
    assert_int_equal(p.part_rank[TMX_PLAN_NORMS],
                     4 * (4 * 256 + 2 * 32) * 2 + 3 * 128 * 2 + 256 * 2);
    /* codec: an F32 g per matrix, and the sign bits of latent, width, latent */
    assert_int_equal(p.part_rank[TMX_PLAN_CODEC], 3 * (3 * 16 * 4 + (128 + 256 + 128) / 8));
    assert_int_equal(p.part_model[TMX_PLAN_CODEC], p.part_rank[TMX_PLAN_CODEC]);
    assert_int_equal(p.weights, 1896128);
    assert_int_equal(p.sharded + p.replicated, p.weights);

    /* KV int8: K and V of 1 head, 32 bytes + an F32 scale each, per layer and position */
    assert_int_equal(p.n_full, 2);
    assert_int_equal(p.n_sliding, 2);
    assert_int_equal(p.kv_full_token, 2 * 2 * 1 * (32 + 4));
    assert_int_equal(p.kv_sliding_token, 2 * 2 * 1 * (32 + 4));
    /* full pool: 2 x 2048 positions; sliding: 2 sequences x 2 x (ceil((63 + 128) / 16) + 1) */
    assert_int_equal(p.full_blocks, 256);
    assert_int_equal(p.sliding_blocks, 52);
    assert_int_equal(p.kv, 256 * 16 * 144 + 52 * 16 * 144);

    /* forward.c step_buffers_init with B 128, S 2 and the rank's 2 query / 1 KV heads and
     * 128 of the 512-wide MLP */
    const int B = 128, S = 2;
    assert_int_equal(p.step_buffers, 4 * B * 4 + 3 * B * 256 * 4 + 2 * B * 64 * 4 +
                                         2 * B * 32 * 4 + 2 * B * 128 * 4 + B * 16 * 4 +
                                         2 * B * 2 * 4 + 2 * B * 128 * 4 + S * 256 * 4 +
                                         S * 1001 * 4 + 2 * B * 4 + 2 * S * 128 * 4);
    /* the widest BF16 matmul input is hidden: hi/lo halves of [128][256] BF16, and q_proj
     * [64][256] (the rank's 2 query heads) expanded to BF16; doubled */
    assert_int_equal(p.kernel_scratch, 2 * (2 * (128 * 256 * 2) + 64 * 256 * 2));
    /* the trellis expert block: 256 pairs of a 64-wide slice, 128 tokens of latent 128 */
    assert_int_equal(p.codec_scratch, 256 * (24 + 2 * 64 * 4 + 64 + 4 + 64 / 16 * 4 + 128 * 4) +
                                          128 * (128 + 4 + 128 / 16 * 4) + 14 * 256);
    assert_int_equal(p.runtime, p.step_buffers + p.kernel_scratch + p.codec_scratch + 4096);
    assert_int_equal(p.total, 4030984);
}

/* The capacity answers sit on the boundary: the answer fits, one more does not. */
static void test_capacity(void **state) {
    (void)state;
    struct tmx_plan_options o = base();
    o.n_gpus = 4;
    o.gpu_bytes = 4030984 + 20000; /* the plan above with a little to spare */
    struct tmx_plan p, q;
    char *err = NULL;
    assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_OK);
    assert_true(p.fits);
    assert_int_equal(p.headroom, 20000);
    assert_true(p.max_context >= 2048 && p.max_context < 4096 && !p.max_context_capped);
    assert_true(p.max_seqs >= 2 && p.max_seqs < 128 && !p.max_seqs_capped);
    struct tmx_plan_options x = o;
    x.context = p.max_context;
    assert_int_equal(tmx_plan_compute(dir, &x, &q, &err), TMX_OK);
    assert_true(q.fits);
    x.context = p.max_context + 1;
    assert_int_equal(tmx_plan_compute(dir, &x, &q, &err), TMX_OK);
    assert_false(q.fits);
    x = o;
    x.seqs = p.max_seqs;
    assert_int_equal(tmx_plan_compute(dir, &x, &q, &err), TMX_OK);
    assert_true(q.fits);
    x.seqs = p.max_seqs + 1;
    assert_int_equal(tmx_plan_compute(dir, &x, &q, &err), TMX_OK);
    assert_false(q.fits);
    /* room for the weights alone: nothing fits (a shorter context would shrink the batch and
     * the step buffers with it, but never below the reserve) */
    o.gpu_bytes = p.weights;
    assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_OK);
    assert_false(p.fits);
    assert_true(p.headroom < 0);
    assert_int_equal(p.max_context, 0);
    assert_int_equal(p.max_seqs, 0);
}

/* The config above with n_routed_experts = `experts`, planned virtually with `codec` experts. */
static struct tmx_plan plan_experts(const char *experts, const char *codec) {
    char other[] = "/tmp/tmx-plan-experts-XXXXXX", path[512], text[sizeof config + 16];
    assert_non_null(mkdtemp(other));
    const char *at = strstr(config, "\"n_routed_experts\": 16");
    assert_non_null(at);
    const int n = snprintf(text, sizeof text, "%.*s\"n_routed_experts\": %s%s",
                           (int)(at - config), config, experts,
                           at + strlen("\"n_routed_experts\": 16"));
    assert_true(n > 0 && (size_t)n < sizeof text);
    snprintf(path, sizeof path, "%s/config.json", other);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    struct tmx_plan_options o = base();
    o.experts = codec;
    o.bits = strcmp(codec, "bf16") ? 3 : 0;
    struct tmx_plan p;
    char *err = NULL;
    if (tmx_plan_compute(other, &o, &p, &err) != TMX_OK) fail_msg("%s", err);
    unlink(path);
    rmdir(other);
    return p;
}

/* Experts are counted without a loop over them: 40 (one experts/ file of 32 and one of 8) add
 * up as 16 do, and the 2^30 that config.json allows plan at once (the alarm fails a planner that
 * walks them, which took minutes). */
static void test_many_experts(void **state) {
    (void)state;
    alarm(20);
    const uint64_t fp4_expert = 3 * (128 * 256 * 3 / 8 + 128 * 256 / 16); /* bytes, 3 matrices */
    const uint64_t bf16_expert = 3 * 128 * 256 * 2;
    struct tmx_plan p = plan_experts("40", "trellis-fp4");
    assert_true(p.part_rank[TMX_PLAN_EXPERTS] == 3 * 40 * fp4_expert / 4);
    assert_true(p.part_rank[TMX_PLAN_CODEC] == 3 * (3 * 40 * 4 + (128 + 256 + 128) / 8));
    /* a layer's experts/ files (1 of 16 experts, 2 of 40) of 5 tensors a matrix, and its 3
     * coupled/ sign vectors; BF16: 3 matrices an expert */
    const int64_t rest = plan_experts("16", "trellis-fp4").n_tensors - 3 * (1 * 15 + 3);
    assert_int_equal(p.n_tensors, rest + 3 * (2 * 15 + 3));
    const int64_t rest_bf16 = plan_experts("16", "bf16").n_tensors - 3 * 16 * 3;
    p = plan_experts("40", "bf16");
    assert_true(p.part_rank[TMX_PLAN_EXPERTS] == 3 * 40 * bf16_expert / 4);
    assert_int_equal(p.n_tensors, rest_bf16 + 3 * 40 * 3);
    p = plan_experts("1073741824", "trellis-fp4");
    assert_true(p.part_rank[TMX_PLAN_EXPERTS] == 3 * ((uint64_t)1 << 30) * fp4_expert / 4);
    p = plan_experts("1073741824", "bf16");
    assert_true(p.part_rank[TMX_PLAN_EXPERTS] == 3 * ((uint64_t)1 << 30) * bf16_expert / 4);
    assert_true(p.part_model[TMX_PLAN_EXPERTS] == 3 * ((uint64_t)1 << 30) * bf16_expert);
    alarm(0);
}

/* Each bad option fails with one line naming it. */
static void test_errors(void **state) {
    (void)state;
    static const struct {
        const char *flag;
        int tp, n_gpus, context, bits;
        const char *experts;
    } cases[] = {
        {"--tp 3", 3, 0, 0, 0, NULL},       {"--tp 8", 8, 0, 0, 0, NULL},
        {"--gpus", 4, 2, 0, 0, NULL},       {"--context 5000", 4, 0, 5000, 0, NULL},
        {"--experts", 4, 0, 0, 0, "int4"},  {"--bits", 4, 0, 0, 7, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct tmx_plan_options o = base();
        o.tp = cases[i].tp;
        o.n_gpus = cases[i].n_gpus;
        o.gpu_bytes = (uint64_t)80 << 30;
        if (cases[i].context) o.context = cases[i].context;
        if (cases[i].bits) o.bits = cases[i].bits;
        if (cases[i].experts) o.experts = cases[i].experts;
        struct tmx_plan p;
        char *err = NULL;
        assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_ERR_INVALID);
        assert_non_null(err);
        if (!strstr(err, cases[i].flag)) fail_msg("\"%s\" does not name %s", err, cases[i].flag);
        assert_null(strchr(err, '\n'));
        free(err);
    }
    /* a KV-head count TP does not divide names config.json's field */
    struct tmx_plan_options o = base();
    o.tp = 3;
    struct tmx_plan p;
    char *err = NULL;
    assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "num_key_value_heads"));
    free(err);
    /* --experts on a real checkpoint; and a real plan of a folder without safetensors */
    o = base();
    o.virtual_model = 0;
    err = NULL;
    assert_int_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "--virtual"));
    free(err);
    o.experts = NULL;
    o.bits = 0;
    err = NULL;
    assert_int_not_equal(tmx_plan_compute(dir, &o, &p, &err), TMX_OK);
    assert_non_null(strstr(err, dir));
    free(err);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test_setup_teardown(test_virtual_numbers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_capacity, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors, setup, teardown),
        cmocka_unit_test(test_many_experts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
