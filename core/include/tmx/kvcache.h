/* tmx/kvcache.h: the host-side bookkeeping of the paged KV cache.
 *
 * The cache of every attention layer is a pool of fixed-size blocks on the kernel set
 * (struct tmx_kv_cache in tmx/kernels.h). A block pool here tracks which of those blocks are in
 * use: a block has a reference count (one per sequence whose table holds it), and a full block
 * can be published under the hash of the tokens it holds and of every token before them, so a
 * later sequence that starts with the same tokens takes the block instead of recomputing it
 * (prefix caching). A released block keeps its contents and stays findable by hash until the
 * pool hands it out again, least recently released first; blocks that hold nothing findable go
 * first.
 *
 * Ownership: a pool owns its arrays; it knows nothing of the device buffers. Not thread-safe:
 * the scheduler thread owns it. */
#ifndef TMX_KVCACHE_H
#define TMX_KVCACHE_H

#include <stdint.h>

#include "tmx/status.h"
#include "tmx/tensor.h"

/* "f32", "bf16", "fp8" (E4M3 with a scale per token and KV head), "int8" (likewise) -> dtype;
 * TMX_DTYPE_COUNT for any other name. */
enum tmx_dtype tmx_kv_dtype_parse(const char *name);
/* The inverse, for messages and metrics. */
const char *tmx_kv_dtype_name(enum tmx_dtype dt);

/* The hash of a block of tokens following the blocks hashed into `parent` (0 for the first
 * block of a sequence). */
uint64_t tmx_kv_block_hash(uint64_t parent, const int32_t *tokens, int n);

struct tmx_kv_pool;

/* n_blocks blocks of block_size positions each, all free. */
enum tmx_status tmx_kv_pool_new(int n_blocks, int block_size, struct tmx_kv_pool **out,
                                char **err);
void tmx_kv_pool_free(struct tmx_kv_pool *p); /* safe with NULL */

int tmx_kv_pool_n_blocks(const struct tmx_kv_pool *p);
int tmx_kv_pool_n_free(const struct tmx_kv_pool *p); /* blocks no sequence holds */

/* Takes a free block (reference count 1), dropping whatever hash it was findable by; -1 when
 * every block is held. */
int tmx_kv_pool_alloc(struct tmx_kv_pool *p);
/* Drops one reference; at zero the block becomes free but keeps its hash. */
void tmx_kv_pool_release(struct tmx_kv_pool *p, int block);
/* Finds the block published as (parent, tokens[0..block_size)) and takes a reference to it;
 * -1 when there is none. The tokens are compared too, so a hash collision is never a hit. */
int tmx_kv_pool_lookup(struct tmx_kv_pool *p, uint64_t hash, uint64_t parent,
                       const int32_t *tokens);
/* Makes a full block findable. Does nothing when another block is already published under
 * the same hash (two sequences computed the same prefix at once). */
void tmx_kv_pool_publish(struct tmx_kv_pool *p, int block, uint64_t hash, uint64_t parent,
                         const int32_t *tokens);

#endif
