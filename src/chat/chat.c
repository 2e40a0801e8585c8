/* chat: the chat-template API -- load a template (text, file, GGUF), render messages and tools
 * from JSON into the prompt, as transformers' apply_chat_template does.
 *
 * Owns the bridge from JSON (jansson) to the interpreter's values; the interpreter itself is in
 * jinja_*.c. The context matches transformers: `messages`, `tools` (none when absent),
 * `documents` (none), `add_generation_prompt` (false unless given), then every kwargs member.
 * The trap: OpenAI clients send tool-call arguments as a JSON *string*, but templates iterate
 * them as a mapping (`arguments | items`, `arguments | tojson`), so strings that hold a JSON
 * object are decoded before rendering. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "jinja_internal.h"

struct moe_chat_template {
    jinja_template tpl;
    char *source;
};

moe_chat_template *moe_chat_template_parse(const char *source, size_t len, moe_error *err) {
    moe_chat_template *t = moe_xcalloc(1, sizeof *t);
    jinja_arena_init(&t->tpl.arena, (size_t)JINJA_MAX_SOURCE * 64);
    if (!jinja_parse(&t->tpl, source, len, err)) {
        jinja_arena_free(&t->tpl.arena);
        free(t);
        return NULL;
    }
    t->source = moe_xstrndup(source, len);
    return t;
}

moe_chat_template *moe_chat_template_load_file(const char *path, moe_error *err) {
    uint8_t *data;
    size_t size;
    if (moe_file_read(path, &data, &size, err) != MOE_OK) return NULL;
    moe_chat_template *t = moe_chat_template_parse((const char *)data, size, err);
    if (!t) moe_error_prefix(err, "%s", path);
    free(data);
    return t;
}

moe_chat_template *moe_chat_template_from_gguf(const moe_gguf *g, const char *name,
                                               moe_error *err) {
    char key[256];
    if (name)
        snprintf(key, sizeof key, "tokenizer.chat_template.%s", name);
    else
        snprintf(key, sizeof key, "tokenizer.chat_template");
    const char *src = moe_gguf_get_str(g, key);
    if (!src) {
        moe_error_set(err, MOE_ERR_NOT_FOUND, "the model has no %s", key);
        return NULL;
    }
    moe_chat_template *t = moe_chat_template_parse(src, strlen(src), err);
    if (!t) moe_error_prefix(err, "%s", key);
    return t;
}

void moe_chat_template_free(moe_chat_template *t) {
    if (!t) return;
    jinja_arena_free(&t->tpl.arena);
    free(t->source);
    free(t);
}

const char *moe_chat_template_source(const moe_chat_template *t) {
    return t->source;
}

/* ==== JSON to values ==== */

static jinja_value from_json(jinja_ctx *c, const json_t *j, int depth) {
    if (depth > MOE_CHAT_MAX_JSON_DEPTH)
        jinja_raise(c, "JSON nested deeper than %d levels", MOE_CHAT_MAX_JSON_DEPTH);
    switch (json_typeof(j)) {
    case JSON_NULL:
        return jv_none();
    case JSON_TRUE:
        return jv_bool(true);
    case JSON_FALSE:
        return jv_bool(false);
    case JSON_INTEGER:
        return jv_int((int64_t)json_integer_value(j));
    case JSON_REAL:
        return jv_float(json_real_value(j));
    case JSON_STRING:
        return jv_str(c, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        jinja_value l = jv_list(c, n);
        for (size_t i = 0; i < n; i++)
            jv_list_push(c, l.l, from_json(c, json_array_get(j, i), depth + 1));
        return l;
    }
    case JSON_OBJECT: {
        jinja_value d = jv_dict(c, json_object_size(j));
        const char *key;
        json_t *v;
        json_object_foreach((json_t *)j, key, v) {
            jv_dict_set(c, d.d, jv_cstr(c, key), from_json(c, v, depth + 1));
        }
        return d;
    }
    }
    return jv_none();
}

/* tool_calls[].function.arguments (and tool_calls[].arguments): a string holding a JSON object
 * becomes that object. */
static void decode_arguments(json_t *messages) {
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        json_t *calls = json_object_get(m, "tool_calls");
        if (!json_is_array(calls)) continue;
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call) {
            json_t *holders[2] = {json_object_get(call, "function"), call};
            for (int h = 0; h < 2; h++) {
                json_t *args = json_object_get(holders[h], "arguments");
                if (!json_is_string(args)) continue;
                json_t *obj = json_loadb(json_string_value(args), json_string_length(args),
                                         JSON_ALLOW_NUL, NULL);
                if (json_is_object(obj)) json_object_set(holders[h], "arguments", obj);
                json_decref(obj);
            }
        }
    }
}

static json_t *load_json(const char *text, const char *what, moe_error *err) {
    json_error_t je;
    json_t *j = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!j)
        moe_error_set(err, MOE_ERR_ARG, "%s: invalid JSON at line %d column %d: %s", what, je.line,
                      je.column, je.text);
    return j;
}

/* The context as transformers builds it. Raises (longjmp) on a limit. */
static jinja_dict *build_vars(jinja_ctx *c, json_t *messages, json_t *tools, json_t *kwargs) {
    jinja_dict *vars = jv_dict(c, 8).d;
    jv_dict_set(c, vars, jv_cstr(c, "messages"), from_json(c, messages, 0));
    jv_dict_set(c, vars, jv_cstr(c, "tools"), from_json(c, tools, 0));
    jv_dict_set(c, vars, jv_cstr(c, "documents"), jv_none());
    jv_dict_set(c, vars, jv_cstr(c, "add_generation_prompt"), jv_bool(false));
    const char *key;
    json_t *v;
    json_object_foreach(kwargs, key, v) {
        jv_dict_set(c, vars, jv_cstr(c, key), from_json(c, v, 0));
    }
    return vars;
}

static moe_status render_json(const moe_chat_template *t, json_t *messages, json_t *tools,
                              json_t *kwargs, char **out, size_t *out_len, moe_error *err) {
    /* on the heap: both change between setjmp and a longjmp back */
    jinja_arena *arena = moe_xmalloc(sizeof *arena);
    jinja_jump *jump = moe_xmalloc(sizeof *jump);
    jinja_arena_init(arena, JINJA_MAX_MEMORY);
    jump->err = err;
    jinja_ctx c = {.arena = arena, .jump = jump};
    if (setjmp(jump->env)) {
        jinja_arena_free(arena);
        free(arena);
        free(jump);
        return err->code;
    }
    jinja_dict *vars = build_vars(&c, messages, tools, kwargs);
    jinja_render_opts opts = {.fixed_now = getenv("MOE_FIXED_DATE")};
    bool ok = jinja_render(&t->tpl, arena, jump, vars, &opts, out, out_len, err);
    jinja_arena_free(arena);
    free(arena);
    free(jump);
    return ok ? MOE_OK : err->code;
}

moe_status moe_chat_render(const moe_chat_template *t, const char *messages_json,
                           const char *tools_json, const char *kwargs_json, char **out,
                           moe_error *err) {
    size_t len;
    return moe_chat_render_n(t, messages_json, tools_json, kwargs_json, out, &len, err);
}

moe_status moe_chat_render_n(const moe_chat_template *t, const char *messages_json,
                             const char *tools_json, const char *kwargs_json, char **out,
                             size_t *out_len, moe_error *err) {
    *out = NULL;
    *out_len = 0;
    json_t *messages = load_json(messages_json ? messages_json : "[]", "messages", err);
    json_t *tools = tools_json ? load_json(tools_json, "tools", err) : json_null();
    json_t *kwargs = kwargs_json ? load_json(kwargs_json, "kwargs", err) : json_object();
    moe_status st = MOE_OK;
    if (!messages || !tools || !kwargs)
        st = err->code;
    else if (!json_is_array(messages))
        st = moe_error_set(err, MOE_ERR_ARG, "messages must be a JSON array");
    else if (!json_is_array(tools) && !json_is_null(tools))
        st = moe_error_set(err, MOE_ERR_ARG, "tools must be a JSON array or null");
    else if (!json_is_object(kwargs))
        st = moe_error_set(err, MOE_ERR_ARG, "kwargs must be a JSON object");
    if (st == MOE_OK) {
        decode_arguments(messages);
        st = render_json(t, messages, tools, kwargs, out, out_len, err);
    }
    json_decref(messages);
    json_decref(tools);
    json_decref(kwargs);
    return st;
}
