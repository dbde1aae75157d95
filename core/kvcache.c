/* kvcache.c: block pools of the paged KV cache (tmx/kvcache.h).
 *
 * Free blocks sit on one doubly linked list: blocks holding nothing findable at the head,
 * published ones appended at the tail as they are released, so allocation from the head
 * evicts the least recently used cached prefix last. Published blocks are chained in a hash
 * table of n_buckets heads. */
#include <stdlib.h>
#include <string.h>

#include "tmx/kvcache.h"

enum tmx_dtype tmx_kv_dtype_parse(const char *name) {
    if (strcmp(name, "f32") == 0) return TMX_DTYPE_F32;
    if (strcmp(name, "bf16") == 0) return TMX_DTYPE_BF16;
    if (strcmp(name, "fp8") == 0) return TMX_DTYPE_F8_E4M3;
    if (strcmp(name, "int8") == 0) return TMX_DTYPE_I8;
    return TMX_DTYPE_COUNT;
}

const char *tmx_kv_dtype_name(enum tmx_dtype dt) {
    switch (dt) {
    case TMX_DTYPE_F32: return "f32";
    case TMX_DTYPE_BF16: return "bf16";
    case TMX_DTYPE_F8_E4M3: return "fp8";
    case TMX_DTYPE_I8: return "int8";
    default: return "?";
    }
}

/* splitmix64's finalizer: every input bit reaches every output bit */
static uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t tmx_kv_block_hash(uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < n; i++) h = mix(h ^ (uint32_t)tokens[i]);
    return h | 1; /* never 0, the parent of a first block */
}

struct tmx_kv_pool {
    int n_blocks, block_size, n_free, n_buckets;
    int *ref;           /* [n_blocks] */
    int *prev, *next;   /* [n_blocks] free list links, -1 ends */
    int head, tail;
    uint64_t *hash;     /* [n_blocks] 0: not published */
    uint64_t *parent;   /* [n_blocks] */
    int32_t *tokens;    /* [n_blocks][block_size] what a published block holds */
    int *chain;         /* [n_blocks] next in the same bucket */
    int *bucket;        /* [n_buckets] first published block, -1: none */
};

static void unlink_free(struct tmx_kv_pool *p, int b) {
    if (p->prev[b] >= 0) p->next[p->prev[b]] = p->next[b];
    else p->head = p->next[b];
    if (p->next[b] >= 0) p->prev[p->next[b]] = p->prev[b];
    else p->tail = p->prev[b];
    p->n_free--;
}

static void link_free(struct tmx_kv_pool *p, int b, int at_head) {
    if (at_head) {
        p->prev[b] = -1;
        p->next[b] = p->head;
        if (p->head >= 0) p->prev[p->head] = b;
        else p->tail = b;
        p->head = b;
    } else {
        p->next[b] = -1;
        p->prev[b] = p->tail;
        if (p->tail >= 0) p->next[p->tail] = b;
        else p->head = b;
        p->tail = b;
    }
    p->n_free++;
}

static int *bucket_of(struct tmx_kv_pool *p, uint64_t hash) {
    return &p->bucket[hash & (uint64_t)(p->n_buckets - 1)];
}

static void unpublish(struct tmx_kv_pool *p, int b) {
    if (!p->hash[b]) return;
    for (int *at = bucket_of(p, p->hash[b]); *at >= 0; at = &p->chain[*at])
        if (*at == b) {
            *at = p->chain[b];
            break;
        }
    p->hash[b] = 0;
}

enum tmx_status tmx_kv_pool_new(int n_blocks, int block_size, struct tmx_kv_pool **out,
                                char **err) {
    if (n_blocks < 1 || block_size < 1)
        return tmx_err(err, TMX_ERR_INVALID, "KV pool: %d blocks of %d positions", n_blocks,
                       block_size);
    struct tmx_kv_pool *p = calloc(1, sizeof *p);
    if (!p) return tmx_err(err, TMX_ERR_NOMEM, "out of memory");
    const size_t n = (size_t)n_blocks;
    p->n_blocks = n_blocks;
    p->block_size = block_size;
    p->n_buckets = 1;
    while (p->n_buckets < 2 * n_blocks) p->n_buckets *= 2;
    p->ref = calloc(n, sizeof *p->ref);
    p->prev = malloc(n * sizeof *p->prev);
    p->next = malloc(n * sizeof *p->next);
    p->hash = calloc(n, sizeof *p->hash);
    p->parent = calloc(n, sizeof *p->parent);
    p->tokens = malloc(n * (size_t)block_size * sizeof *p->tokens);
    p->chain = malloc(n * sizeof *p->chain);
    p->bucket = malloc((size_t)p->n_buckets * sizeof *p->bucket);
    if (!p->ref || !p->prev || !p->next || !p->hash || !p->parent || !p->tokens || !p->chain ||
        !p->bucket) {
        tmx_kv_pool_free(p);
        return tmx_err(err, TMX_ERR_NOMEM, "KV pool: out of memory for %d blocks", n_blocks);
    }
    p->head = p->tail = -1;
    for (int b = 0; b < n_blocks; b++) link_free(p, b, 0);
    for (int i = 0; i < p->n_buckets; i++) p->bucket[i] = -1;
    *out = p;
    return TMX_OK;
}

void tmx_kv_pool_free(struct tmx_kv_pool *p) {
    if (!p) return;
    free(p->ref);
    free(p->prev);
    free(p->next);
    free(p->hash);
    free(p->parent);
    free(p->tokens);
    free(p->chain);
    free(p->bucket);
    free(p);
}

int tmx_kv_pool_n_blocks(const struct tmx_kv_pool *p) { return p->n_blocks; }
int tmx_kv_pool_n_free(const struct tmx_kv_pool *p) { return p->n_free; }

int tmx_kv_pool_alloc(struct tmx_kv_pool *p) {
    const int b = p->head;
    if (b < 0) return -1;
    unlink_free(p, b);
    unpublish(p, b);
    p->ref[b] = 1;
    return b;
}

void tmx_kv_pool_release(struct tmx_kv_pool *p, int b) {
    if (--p->ref[b] == 0) link_free(p, b, !p->hash[b]);
}

int tmx_kv_pool_lookup(struct tmx_kv_pool *p, uint64_t hash, uint64_t parent,
                       const int32_t *tokens) {
    const size_t bs = (size_t)p->block_size;
    for (int b = *bucket_of(p, hash); b >= 0; b = p->chain[b]) {
        if (p->hash[b] != hash || p->parent[b] != parent ||
            memcmp(p->tokens + (size_t)b * bs, tokens, bs * sizeof *tokens) != 0)
            continue;
        if (p->ref[b]++ == 0) unlink_free(p, b);
        return b;
    }
    return -1;
}

void tmx_kv_pool_publish(struct tmx_kv_pool *p, int b, uint64_t hash, uint64_t parent,
                         const int32_t *tokens) {
    const size_t bs = (size_t)p->block_size;
    if (p->hash[b]) return;
    for (int o = *bucket_of(p, hash); o >= 0; o = p->chain[o])
        if (p->hash[o] == hash && p->parent[o] == parent &&
            memcmp(p->tokens + (size_t)o * bs, tokens, bs * sizeof *tokens) == 0)
            return;
    p->hash[b] = hash;
    p->parent[b] = parent;
    memcpy(p->tokens + (size_t)b * bs, tokens, bs * sizeof *tokens);
    int *head = bucket_of(p, hash);
    p->chain[b] = *head;
    *head = b;
}
