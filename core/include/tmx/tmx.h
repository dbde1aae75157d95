/* tmx/tmx.h: the engine API — everything a program needs to run a model.
 *
 * An engine bundles the configuration, the loaded plugins, the kernel set, the checkpoint, the
 * model graph and the tokenizer of one model directory. It owns all of them; the pointers its
 * accessors return live until tmx_engine_free. */
#ifndef TMX_TMX_H
#define TMX_TMX_H

#include "tmx/config.h"
#include "tmx/loader.h"
#include "tmx/model.h"
#include "tmx/safetensors.h"
#include "tmx/sampler.h"
#include "tmx/status.h"
#include "tmx/tokenizer.h"

#define TMX_VERSION "0.1.0"

struct tmx_engine;

/* Opens MODEL_DIR (config.json, safetensors, tokenizer.json) with the configuration file
 * config_path (NULL: defaults), then applies the "key=value" overrides in order. A build with a
 * trellismx-manifest.json is checked against it first (tmx/manifest.h; SHA-256 with config key
 * "verify"). */
enum tmx_status tmx_engine_open(const char *model_dir, const char *config_path, int n_overrides,
                                const char *const *overrides, struct tmx_engine **out,
                                char **err);
void tmx_engine_free(struct tmx_engine *e);

const struct tmx_config *tmx_engine_config(const struct tmx_engine *e);
struct tmx_model *tmx_engine_model(struct tmx_engine *e);
const struct tmx_tokenizer *tmx_engine_tokenizer(const struct tmx_engine *e);
const struct tmx_plugins *tmx_engine_plugins(const struct tmx_engine *e);
struct tmx_plugins *tmx_engine_plugins_mut(struct tmx_engine *e); /* to load more plugins */
const char *tmx_engine_model_dir(const struct tmx_engine *e);
/* Ids that have a token: the tokenizer's vocabulary, at most the model's vocab_size. Logits
 * beyond it belong to padded rows and are never sampled. */
int tmx_engine_n_vocab(const struct tmx_engine *e);
/* The sequence length a new sequence gets: config "context", capped by the model's
 * max_position_embeddings. */
int tmx_engine_n_ctx(const struct tmx_engine *e);

/* Tensor parallelism (config key tp, docs/tp.md). With tp > 1 the engine holds rank 0 of the
 * model and runs ranks 1..tp-1 on threads of its own; under mpirun each process holds one rank
 * (tp = the number of processes). Everything above acts on rank 0: tmx_model_step on
 * tmx_engine_model() drives all ranks. tmx_engine_rank: this process's rank (0 but under
 * mpirun); tmx_engine_tp: the number of ranks. */
int tmx_engine_rank(const struct tmx_engine *e);
int tmx_engine_tp(const struct tmx_engine *e);
/* Under mpirun, ranks 1..tp-1: runs the steps rank 0 broadcasts until rank 0's engine closes
 * (tmx_model_follow), then returns TMX_OK; the caller frees the engine and exits quietly. */
enum tmx_status tmx_engine_follow(struct tmx_engine *e, char **err);

/* Frees a string tmx returned through `char **err` (for callers that do not share its libc,
 * e.g. Python through ctypes). */
void tmx_free(void *p);

#endif
