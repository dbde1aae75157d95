/* test_kvcache.c: the KV block pool — allocation, reference counts, publishing and lookup by
 * hash, the eviction order of cached blocks, and the dtype names of the config key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tmx/kvcache.h"

enum { BS = 4 };

static struct tmx_kv_pool *make(int n_blocks) {
    struct tmx_kv_pool *p = NULL;
    assert_int_equal(tmx_kv_pool_new(n_blocks, BS, &p, NULL), TMX_OK);
    return p;
}

static void test_alloc_until_empty_and_release(void **state) {
    (void)state;
    struct tmx_kv_pool *p = make(3);
    int seen[3] = {0};
    for (int i = 0; i < 3; i++) {
        const int b = tmx_kv_pool_alloc(p);
        assert_true(b >= 0 && b < 3);
        assert_false(seen[b]);
        seen[b] = 1;
    }
    assert_int_equal(tmx_kv_pool_n_free(p), 0);
    assert_int_equal(tmx_kv_pool_alloc(p), -1);
    tmx_kv_pool_release(p, 1);
    assert_int_equal(tmx_kv_pool_n_free(p), 1);
    assert_int_equal(tmx_kv_pool_alloc(p), 1);
    tmx_kv_pool_free(p);
}

static void test_published_block_is_found_by_its_tokens(void **state) {
    (void)state;
    struct tmx_kv_pool *p = make(4);
    const int32_t a[BS] = {1, 2, 3, 4}, b[BS] = {1, 2, 3, 5};
    const uint64_t ha = tmx_kv_block_hash(0, a, BS);
    assert_int_not_equal(ha, 0);
    assert_int_equal(ha, tmx_kv_block_hash(0, a, BS));
    assert_int_not_equal(ha, tmx_kv_block_hash(0, b, BS));
    assert_int_not_equal(ha, tmx_kv_block_hash(ha, a, BS)); /* the parent counts */

    const int blk = tmx_kv_pool_alloc(p);
    tmx_kv_pool_publish(p, blk, ha, 0, a);
    assert_int_equal(tmx_kv_pool_lookup(p, ha, 0, a), blk); /* now held twice */
    tmx_kv_pool_release(p, blk);
    tmx_kv_pool_release(p, blk);
    assert_int_equal(tmx_kv_pool_n_free(p), 4);
    /* free, but still cached: a lookup takes it back off the free list */
    assert_int_equal(tmx_kv_pool_lookup(p, ha, 0, a), blk);
    assert_int_equal(tmx_kv_pool_n_free(p), 3);
    /* the same hash with other tokens or another parent is no hit */
    assert_int_equal(tmx_kv_pool_lookup(p, ha, 0, b), -1);
    assert_int_equal(tmx_kv_pool_lookup(p, ha, 7, a), -1);
    tmx_kv_pool_free(p);
}

static void test_duplicate_publish_keeps_the_first(void **state) {
    (void)state;
    struct tmx_kv_pool *p = make(2);
    const int32_t a[BS] = {9, 9, 9, 9};
    const uint64_t h = tmx_kv_block_hash(0, a, BS);
    const int b0 = tmx_kv_pool_alloc(p), b1 = tmx_kv_pool_alloc(p);
    tmx_kv_pool_publish(p, b0, h, 0, a);
    tmx_kv_pool_publish(p, b1, h, 0, a);
    assert_int_equal(tmx_kv_pool_lookup(p, h, 0, a), b0);
    tmx_kv_pool_free(p);
}

/* Unpublished blocks are reused before cached ones, and cached ones least recently released
 * first; reusing a cached block makes it unfindable. */
static void test_eviction_order(void **state) {
    (void)state;
    struct tmx_kv_pool *p = make(3);
    int32_t t[3][BS] = {{1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}};
    uint64_t h[3];
    int b[3];
    for (int i = 0; i < 3; i++) {
        b[i] = tmx_kv_pool_alloc(p);
        h[i] = tmx_kv_block_hash(0, t[i], BS);
    }
    tmx_kv_pool_publish(p, b[0], h[0], 0, t[0]);
    tmx_kv_pool_publish(p, b[2], h[2], 0, t[2]);
    tmx_kv_pool_release(p, b[2]); /* cached, released first */
    tmx_kv_pool_release(p, b[0]); /* cached, released second */
    tmx_kv_pool_release(p, b[1]); /* nothing cached: goes first */
    assert_int_equal(tmx_kv_pool_alloc(p), b[1]);
    assert_int_equal(tmx_kv_pool_alloc(p), b[2]);
    assert_int_equal(tmx_kv_pool_lookup(p, h[2], 0, t[2]), -1); /* evicted */
    assert_int_equal(tmx_kv_pool_lookup(p, h[0], 0, t[0]), b[0]);
    tmx_kv_pool_free(p);
}

static void test_bad_sizes_and_dtype_names(void **state) {
    (void)state;
    struct tmx_kv_pool *p = NULL;
    char *err = NULL;
    assert_int_equal(tmx_kv_pool_new(0, 16, &p, &err), TMX_ERR_INVALID);
    assert_non_null(strstr(err, "KV pool"));
    free(err);
    static const char *names[] = {"f32", "bf16", "fp8", "int8"};
    static const enum tmx_dtype dts[] = {TMX_DTYPE_F32, TMX_DTYPE_BF16, TMX_DTYPE_F8_E4M3,
                                         TMX_DTYPE_I8};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(tmx_kv_dtype_parse(names[i]), dts[i]);
        assert_string_equal(tmx_kv_dtype_name(dts[i]), names[i]);
    }
    assert_int_equal(tmx_kv_dtype_parse("f16"), TMX_DTYPE_COUNT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_until_empty_and_release),
        cmocka_unit_test(test_published_block_is_found_by_its_tokens),
        cmocka_unit_test(test_duplicate_publish_keeps_the_first),
        cmocka_unit_test(test_eviction_order),
        cmocka_unit_test(test_bad_sizes_and_dtype_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
