/* tmx/template.h: chat templates, the Jinja programs that models ship to turn a conversation
 * into prompt text.
 *
 * The renderer implements the part of Jinja2 that chat templates use, with the settings of
 * Hugging Face transformers' apply_chat_template: trim_blocks and lstrip_blocks on, a sandbox
 * (no Python objects are reachable), the globals raise_exception(msg) and strftime_now(fmt), the
 * loop controls {% break %} / {% continue %}, and a tojson filter that writes what Python's
 * json.dumps(x, ensure_ascii=False) writes. Values follow Python: strings are indexed by code
 * point, integers and floats print as Python prints them, dicts keep insertion order.
 *
 * Undefined names render as "" and are false, as in Jinja's default Undefined. Unlike it, an
 * attribute or item of an undefined value is undefined again instead of an error.
 *
 * Not implemented: template inheritance and inclusion, {% call %}, {% raw %}, {% with %},
 * {% filter %}, recursive loops, autoescaping, string % formatting and str.format, and macros
 * defined anywhere but at the top level of a template.
 *
 * Errors (syntax, type, raise_exception) are TMX_ERR_INVALID with a message that starts with
 * "NAME:LINE:COL: ", NAME being the name given at parse time. A parsed template is read-only:
 * any number of threads may render it at once. */
#ifndef TMX_TEMPLATE_H
#define TMX_TEMPLATE_H

#include <jansson.h>
#include <stddef.h>
#include <time.h>

#include "tmx/status.h"

struct tmx_template;

/* Parses src[0..len) (UTF-8) into a new template (free with tmx_template_free). name (copied)
 * prefixes error messages, e.g. "chat_template.jinja". */
enum tmx_status tmx_template_parse(const char *src, size_t len, const char *name,
                                   struct tmx_template **out, char **err);
void tmx_template_free(struct tmx_template *t);

/* Renders t with the variables of context, a JSON object (typically "messages", "tools",
 * "add_generation_prompt", "bos_token", "eos_token" and any extra keyword the template reads).
 * context is not modified. now is the time strftime_now() formats (NULL: the local time at the
 * call). On success *out is a new malloc'd NUL-terminated string (caller frees) of *len bytes
 * (len may be NULL). */
enum tmx_status tmx_template_render(const struct tmx_template *t, const json_t *context,
                                    const struct tm *now, char **out, size_t *len, char **err);

/* Loads the chat template of a Hugging Face model directory: chat_template.jinja if present,
 * else tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"} of
 * which the one named "default" is taken). A directory without one is TMX_ERR_NOT_FOUND. If
 * special is non-NULL, *special becomes a new JSON object (caller decrefs) holding the
 * "bos_token" and "eos_token" strings that tokenizer_config.json defines (as a string or as
 * {"content": ...}; absent ones are left out), to be merged into the render context. The
 * template's render errors name it relative to model_dir ("chat_template.jinja:2:7: ..."). */
enum tmx_status tmx_chat_template_load(const char *model_dir, struct tmx_template **out,
                                       json_t **special, char **err);

#endif
