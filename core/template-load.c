/* template-load.c: a model directory's chat template, found where transformers finds it:
 * chat_template.jinja, else the "chat_template" of tokenizer_config.json. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template-impl.h"
#include "tmx/fs.h"

/* bos_token / eos_token: a string, an AddedToken object {"content": ...}, null or absent. */
static enum tmx_status special_tokens(const json_t *config, json_t *special, const char *path,
                                      char **err) {
    static const char *const keys[] = {"bos_token", "eos_token"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(config, keys[i]);
        if (json_is_object(v)) v = json_object_get(v, "content");
        if (v && !json_is_null(v) && !json_is_string(v))
            return tmx_err(err, TMX_ERR_INVALID, "%s: field \"%s\" must be a string or "
                           "{\"content\": string}", path, keys[i]);
        if (json_is_string(v) && json_object_set(special, keys[i], v))
            return tmx_err(err, TMX_ERR_NOMEM, "%s: out of memory", path);
    }
    return TMX_OK;
}

/* tokenizer_config.json's chat_template: a string, or [{"name", "template"}] (the "default"). */
static const char *config_template(const json_t *config) {
    json_t *ct = json_object_get(config, "chat_template"), *item;
    size_t i;
    if (json_is_string(ct)) return json_string_value(ct);
    json_array_foreach(ct, i, item) {
        json_t *name = json_object_get(item, "name"), *tmpl = json_object_get(item, "template");
        if (json_is_string(name) && strcmp(json_string_value(name), "default") == 0 &&
            json_is_string(tmpl))
            return json_string_value(tmpl);
    }
    return NULL;
}

enum tmx_status tmx_chat_template_load(const char *model_dir, struct tmx_template **out,
                                       json_t **special, char **err) {
    size_t dn = strlen(model_dir) + 64;
    char *jinja_path = malloc(dn), *config_path = malloc(dn);
    json_t *config = NULL, *tokens = json_object();
    char *src = NULL;
    size_t len = 0;
    enum tmx_status st = jinja_path && config_path && tokens ? TMX_OK : TMX_ERR_NOMEM;
    if (st != TMX_OK) {
        tmx_err(err, st, "%s: out of memory", model_dir);
        goto done;
    }
    snprintf(jinja_path, dn, "%s/chat_template.jinja", model_dir);
    snprintf(config_path, dn, "%s/tokenizer_config.json", model_dir);

    json_error_t jerr;
    config = json_load_file(config_path, 0, &jerr);
    if (!config && json_error_code(&jerr) != json_error_cannot_open_file) {
        st = tmx_err(err, TMX_ERR_INVALID, "%s:%d: %s", config_path, jerr.line, jerr.text);
        goto done;
    }
    json_t *ct = config ? json_object_get(config, "chat_template") : NULL;
    if (ct && !json_is_null(ct) && !json_is_string(ct) && !json_is_array(ct)) {
        st = tmx_err(err, TMX_ERR_INVALID, "%s: field \"chat_template\" must be a string or a "
                     "list of {\"name\", \"template\"}", config_path);
        goto done;
    }
    if (config && (st = special_tokens(config, tokens, config_path, err)) != TMX_OK) goto done;

    /* The template is named relative to the model (its render errors go to API clients, who
     * need not see the server's paths); a parse error here names the whole path. */
    char *perr = NULL;
    st = tmx_file_read(jinja_path, &src, &len, &perr);
    if (st != TMX_OK && st != TMX_ERR_NOT_FOUND) { /* its message names the whole path */
        tmx_err(err, st, "%s", perr ? perr : "out of memory");
        free(perr);
        goto done;
    }
    free(perr); /* not found: tokenizer_config.json's, then */
    perr = NULL;
    if (st == TMX_OK) {
        st = tmx_template_parse(src, len, "chat_template.jinja", out, &perr);
    } else if (st == TMX_ERR_NOT_FOUND) {
        const char *text = config ? config_template(config) : NULL;
        if (!text) {
            st =
                tmx_err(err, TMX_ERR_NOT_FOUND,
                        "%s: no chat template (neither chat_template.jinja nor a \"chat_template\" "
                        "in tokenizer_config.json)",
                        model_dir);
            goto done;
        }
        st = tmx_template_parse(text, strlen(text), "tokenizer_config.json:chat_template", out,
                                &perr);
    }
    if (perr) {
        tmx_err(err, st, "%s/%s", model_dir, perr);
        free(perr);
    }
    if (st == TMX_OK && special) *special = json_incref(tokens);

done:
    free(src);
    free(jinja_path);
    free(config_path);
    json_decref(config);
    json_decref(tokens);
    return st;
}
