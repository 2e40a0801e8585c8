/* prompt.c: conversations to prompt tokens through the model's chat template, and model text
 * back to content, reasoning and tool calls through the chat layer's parsers -- the two seams
 * between the API adapters and src/chat/ (with src/text/'s tokenizer).
 *
 * The template is chosen once at start-up: --chat-template-file, else the GGUF's
 * tokenizer.chat_template, else the built-in ChatML. Each API's request becomes one OpenAI-style
 * conversation (serve_chat), rendered with the request's tools and template kwargs
 * (chat_template_kwargs, enable_thinking, reasoning_effort, Anthropic `thinking`, Responses
 * `reasoning.effort`) and tokenized so that a client's text never becomes a control token
 * (moe_chat_render_tokens). Reasoning controls the template has no switch for become a
 * thinking-token budget the scheduler enforces (reasoning_controls). The output parser is the
 * template's format (Hermes when unknown);
 * without tools in the request, call markup stays content. The trap: a template may raise on a
 * conversation it does not accept (roles out of order, no user turn); that is the client's
 * request failing, a 400 with the template's own message, not a server error. */
#include "serve_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Conversations ==== */

serve_message *serve_chat_add(serve_chat *c, const char *role) {
    if (c->n_msgs == c->cap_msgs) {
        c->cap_msgs = c->cap_msgs ? c->cap_msgs * 2 : 8;
        c->msgs = moe_xrealloc(c->msgs, c->cap_msgs * sizeof *c->msgs);
    }
    serve_message *m = &c->msgs[c->n_msgs++];
    memset(m, 0, sizeof *m);
    m->role = moe_xstrdup(role);
    return m;
}

void serve_tool_calls_free(serve_tool_call *calls, size_t n) {
    for (size_t k = 0; k < n; k++) {
        free(calls[k].id);
        free(calls[k].name);
        free(calls[k].arguments);
    }
    free(calls);
}

void serve_chat_free(serve_chat *c) {
    for (size_t i = 0; i < c->n_msgs; i++) {
        serve_message *m = &c->msgs[i];
        free(m->role);
        moe_strbuf_free(&m->content);
        moe_strbuf_free(&m->reasoning);
        free(m->tool_call_id);
        free(m->name);
        serve_tool_calls_free(m->tool_calls, m->n_tool_calls);
    }
    free(c->msgs);
    json_decref(c->tools);
    json_decref(c->kwargs);
    json_decref(c->response_schema);
    free(c->tool_name);
    memset(c, 0, sizeof *c);
}

static bool chat_has_tools(const serve_chat *c) {
    return c && c->tools && json_array_size(c->tools) && !c->tool_choice_none;
}

/* The conversation as the template sees it: OpenAI's messages. */
static json_t *chat_messages_json(const serve_chat *c) {
    json_t *msgs = json_array();
    for (size_t i = 0; i < c->n_msgs; i++) {
        const serve_message *m = &c->msgs[i];
        json_t *j = json_object();
        json_object_set_new(j, "role", json_string(m->role));
        json_object_set_new(j, "content",
                            json_stringn(m->content.s ? m->content.s : "", m->content.len));
        if (m->reasoning.s)
            json_object_set_new(j, "reasoning_content",
                                json_stringn(m->reasoning.s, m->reasoning.len));
        if (m->n_tool_calls) {
            json_t *calls = json_array();
            for (size_t k = 0; k < m->n_tool_calls; k++) {
                const serve_tool_call *tc = &m->tool_calls[k];
                json_t *fn = json_object();
                json_object_set_new(fn, "name", json_string(tc->name));
                json_object_set_new(fn, "arguments", json_string(tc->arguments));
                json_t *call = json_object();
                json_object_set_new(call, "id", json_string(tc->id));
                json_object_set_new(call, "type", json_string("function"));
                json_object_set_new(call, "function", fn);
                json_array_append_new(calls, call);
            }
            json_object_set_new(j, "tool_calls", calls);
        }
        if (m->tool_call_id) json_object_set_new(j, "tool_call_id", json_string(m->tool_call_id));
        if (m->name) json_object_set_new(j, "name", json_string(m->name));
        json_array_append_new(msgs, j);
    }
    return msgs;
}

/* ==== Template kwargs from the request ==== */

bool serve_parse_template_kwargs(serve_http *h, serve_api api, json_t *body, serve_chat *chat) {
    json_t *kw = json_object();
    chat->kwargs = kw;
    chat->think_budget = -1;
    json_object_set_new(kw, "add_generation_prompt", json_true());
    json_t *v = json_object_get(body, "enable_thinking");
    if (v && !json_is_null(v)) {
        if (!json_is_boolean(v))
            SERVE_BAD(h, api, "enable_thinking", "enable_thinking: expected a boolean");
        json_object_set(kw, "enable_thinking", v);
    }
    v = json_object_get(body, "reasoning_effort");                             /* OpenAI chat */
    if (!v) v = json_object_get(json_object_get(body, "reasoning"), "effort"); /* Responses */
    if (v && !json_is_null(v)) {
        if (!json_is_string(v))
            SERVE_BAD(h, api, "reasoning_effort", "reasoning_effort: expected a string");
        json_object_set(kw, "reasoning_effort", v);
        if (!strcmp(json_string_value(v), "none")) /* OpenAI: no reasoning at all */
            json_object_set_new(kw, "enable_thinking", json_false());
    }
    json_t *thinking = json_object_get(body, "thinking");
    const char *type = json_string_value(json_object_get(thinking, "type"));
    if (type) /* Anthropic: {"type": "enabled" | "disabled" | "adaptive", "budget_tokens": N} */
        json_object_set_new(kw, "enable_thinking", json_boolean(strcmp(type, "disabled") != 0));
    v = json_object_get(thinking, "budget_tokens");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            SERVE_BAD(h, api, "thinking.budget_tokens",
                      "thinking.budget_tokens: expected a non-negative integer");
        chat->think_budget = json_integer_value(v);
    }
    v = json_object_get(body, "chat_template_kwargs"); /* vLLM and llama-server's extension */
    if (v && !json_is_null(v)) {
        if (!json_is_object(v))
            SERVE_BAD(h, api, "chat_template_kwargs", "chat_template_kwargs: expected an object");
        json_object_update(kw, v);
    }
    return true;
}

/* ==== The template ==== */

bool serve_template_load(serve_server *srv, char *err_out, size_t err_size) {
    moe_error err = {0};
    const char *path = srv->p.chat_template_file;
    if (path) {
        srv->tmpl = moe_chat_template_load_file(path, &err);
        snprintf(srv->tmpl_origin, sizeof srv->tmpl_origin, "%s", path);
    } else {
        moe_gguf *g = moe_st_is_checkpoint(srv->p.model_path)
                          ? moe_hf_open(srv->p.model_path, true, &err)
                          : moe_gguf_open(srv->p.model_path, &err);
        if (g) {
            srv->tmpl = moe_chat_template_from_gguf(g, NULL, &err);
            moe_gguf_close(g);
            snprintf(srv->tmpl_origin, sizeof srv->tmpl_origin, "the model's");
            if (!srv->tmpl && err.code == MOE_ERR_NOT_FOUND) err.code = MOE_OK;
        } else {
            err.code = MOE_OK; /* the scheduler reports why the model does not load */
        }
    }
    if (err.code) {
        snprintf(err_out, err_size,
                 "chat template: %s (--chat-template-file FILE.jinja gives "
                 "another)",
                 err.msg);
        return false;
    }
    if (!srv->tmpl) {
        srv->tmpl = moe_chat_template_parse(moe_chat_template_chatml,
                                            strlen(moe_chat_template_chatml), &err);
        if (!srv->tmpl) moe_die("the built-in ChatML template: %s", err.msg);
        snprintf(srv->tmpl_origin, sizeof srv->tmpl_origin, "built-in ChatML (none in the model)");
    }
    moe_chat_parse_options o;
    moe_chat_parse_options_detect(moe_chat_template_source(srv->tmpl), NULL, &o);
    snprintf(srv->tmpl_origin + strlen(srv->tmpl_origin),
             sizeof srv->tmpl_origin - strlen(srv->tmpl_origin), ", tool calls %s%s%s",
             moe_chat_format_name(o.format), o.think_open ? ", reasoning " : "",
             o.think_open ? o.think_open : "");
    if (o.think_open && srv->p.reasoning_budget >= 0)
        snprintf(srv->tmpl_origin + strlen(srv->tmpl_origin),
                 sizeof srv->tmpl_origin - strlen(srv->tmpl_origin), " at most %lld tokens",
                 (long long)srv->p.reasoning_budget);
    return true;
}

/* ==== Structured output: grammars for forced tool calls and JSON replies ==== */

bool serve_chat_force_tool(serve_http *h, serve_api api, serve_chat *chat, const char *name,
                           const char *field) {
    if (!chat->tools || !json_array_size(chat->tools))
        SERVE_BAD(h, api, field, "%s: a tool call is required but the request has no tools", field);
    if (name) {
        bool found = false;
        size_t i;
        json_t *t;
        json_array_foreach(chat->tools, i, t) {
            const char *n =
                json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            found = found || (n && strcmp(n, name) == 0);
        }
        if (!found) SERVE_BAD(h, api, field, "%s: there is no tool named '%s'", field, name);
        free(chat->tool_name);
        chat->tool_name = moe_xstrdup(name);
    }
    chat->tool_required = true;
    return true;
}

bool serve_parse_response_format(serve_http *h, serve_api api, json_t *format, const char *field,
                                 serve_chat *chat) {
    if (!format || json_is_null(format)) return true;
    const char *type = json_string_value(json_object_get(format, "type"));
    if (!json_is_object(format) || !type)
        SERVE_BAD(h, api, field,
                  "%s: expected {\"type\": \"text\" | \"json_object\" | \"json_schema\"}", field);
    if (strcmp(type, "text") == 0) return true;
    json_decref(chat->response_schema);
    chat->response_schema = NULL;
    if (strcmp(type, "json_object") == 0) {
        chat->response_schema = json_pack("{s:s}", "type", "object");
        return true;
    }
    if (strcmp(type, "json_schema") != 0)
        SERVE_BAD(h, api, field, "%s.type: '%s' is not text, json_object or json_schema", field,
                  type);
    json_t *schema = json_object_get(json_object_get(format, "json_schema"), "schema"); /* chat */
    if (!schema) schema = json_object_get(format, "schema"); /* Responses */
    if (!json_is_object(schema) && !json_is_boolean(schema))
        SERVE_BAD(h, api, field, "%s: json_schema needs a schema object", field);
    chat->response_schema = json_incref(schema);
    return true;
}

/* The request's structured-output grammar into g (none asked: nothing to do). A reply that
 * would open with reasoning (the prompt left it open) closes it first. */
static bool chat_grammar(serve_http *h, serve_api api, const serve_chat *chat, serve_gen *g,
                         const char *prompt) {
    const bool tool = chat->tool_required && chat_has_tools(chat);
    if (!tool && !chat->response_schema) return true;
    if (g->grammar && g->grammar_is_default) {
        moe_grammar_free(g->grammar);
        g->grammar = NULL;
    }
    if (g->grammar)
        SERVE_BAD(h, api, "grammar",
                  "grammar: cannot be combined with a forced tool call or a response format");
    moe_chat_parse_options opts;
    moe_chat_parse_options_detect(moe_chat_template_source(h->srv->tmpl), prompt, &opts);
    moe_strbuf prefix = {0};
    if (opts.reasoning_open && opts.think_close) {
        moe_strbuf_putc(&prefix, '"');
        for (const char *s = opts.think_close; *s; s++) {
            if (*s == '"' || *s == '\\') moe_strbuf_putc(&prefix, '\\');
            moe_strbuf_putc(&prefix, *s);
        }
        moe_strbuf_puts(&prefix, "\" "); /* no whitespace after it: that would be content */
    }
    moe_error err = {0};
    char *src = NULL;
    if (tool) {
        char *tools = json_dumps(chat->tools, JSON_COMPACT);
        src = moe_chat_tool_grammar(&opts, tools, chat->tool_name, prefix.s, &err);
        free(tools);
    } else {
        char *schema = json_dumps(chat->response_schema, JSON_COMPACT | JSON_ENCODE_ANY);
        src = moe_chat_schema_grammar(schema, prefix.s, &err);
        free(schema);
    }
    moe_strbuf_free(&prefix);
    if (src) g->grammar = moe_grammar_parse(src, strlen(src), NULL, &err);
    free(src);
    if (!g->grammar)
        SERVE_BAD(h, api, tool ? "tool_choice" : "response_format", "%s: %s",
                  tool ? "tool_choice" : "response_format", err.msg);
    return true;
}

/* ==== Reasoning controls ==== */

/* Budgets for a reasoning_effort the template has no switch for: OpenAI's lowest settings mean
 * few reasoning tokens; "medium" (many clients' default) and above leave the model alone. */
#define SERVE_EFFORT_MINIMAL_TOKENS 256
#define SERVE_EFFORT_LOW_TOKENS     1024

static int64_t budget_min(int64_t a, int64_t b) {
    return a < 0 ? b : b < 0 ? a : a < b ? a : b;
}

/* The reply's reasoning budget (-1: none): the server's, the request's, and what its switches
 * mean for a template that does not read them. */
static int64_t think_budget(const serve_server *srv, const serve_chat *chat, const char *src) {
    int64_t b = budget_min(srv->p.reasoning_budget, chat ? chat->think_budget : -1);
    json_t *kw = chat ? chat->kwargs : NULL;
    if (json_is_false(json_object_get(kw, "enable_thinking")) && !strstr(src, "enable_thinking"))
        b = 0;
    const char *effort = json_string_value(json_object_get(kw, "reasoning_effort"));
    if (effort && !strstr(src, "reasoning_effort")) {
        if (!strcmp(effort, "none"))
            b = 0;
        else if (!strcmp(effort, "minimal"))
            b = budget_min(b, SERVE_EFFORT_MINIMAL_TOKENS);
        else if (!strcmp(effort, "low"))
            b = budget_min(b, SERVE_EFFORT_LOW_TOKENS);
    }
    return b;
}

/* A reasoning tag as tokens where it follows other text (its own control token where it has
 * one); false when it is empty, does not tokenize or is longer than SERVE_MAX_THINK_TAG tokens. */
static bool tag_tokens(const moe_tokenizer *tok, const char *tag, int32_t *out, uint32_t *n_out) {
    int32_t *ids = NULL;
    size_t n = 0;
    moe_error err = {0};
    *n_out = 0;
    if (moe_tokenizer_encode(tok, tag, strlen(tag),
                             MOE_ENCODE_PARSE_SPECIAL | MOE_ENCODE_CONTINUATION, &ids, &n,
                             &err) != MOE_OK ||
        n == 0 || n > SERVE_MAX_THINK_TAG) {
        free(ids);
        return false;
    }
    memcpy(out, ids, n * sizeof *ids);
    *n_out = (uint32_t)n;
    free(ids);
    return true;
}

/* After rendering: the tags and budget into g; a budget of 0 inside an open block closes it in
 * the prompt (*text and *ids grow by the closing tag). */
static void reasoning_controls(const serve_server *srv, const serve_chat *chat, serve_gen *g,
                               char **text, size_t *text_len, int32_t **ids, size_t *n_ids) {
    const moe_tokenizer *tok = serve_sched_tokenizer(srv->sched);
    const char *src = moe_chat_template_source(srv->tmpl);
    moe_chat_parse_options o;
    moe_chat_parse_options_detect(src, *text, &o);
    g->think_budget = -1;
    g->n_think_open = g->n_think_close = 0;
    if (!o.think_open || !tag_tokens(tok, o.think_close, g->think_close, &g->n_think_close)) return;
    tag_tokens(tok, o.think_open, g->think_open, &g->n_think_open);
    g->think_open_text[0] = g->think_close_text[0] = '\0';
    if (strlen(o.think_open) < SERVE_MAX_THINK_TEXT &&
        strlen(o.think_close) < SERVE_MAX_THINK_TEXT) {
        snprintf(g->think_open_text, sizeof g->think_open_text, "%s", o.think_open);
        snprintf(g->think_close_text, sizeof g->think_close_text, "%s", o.think_close);
    }
    g->think_at_start = o.reasoning_open;
    g->think_budget = think_budget(srv, chat, src);
    if (g->think_budget != 0 || !o.reasoning_open) return;
    size_t tl = *text_len, cl = strlen(o.think_close);
    *text = moe_xrealloc(*text, tl + cl + 1);
    memcpy(*text + tl, o.think_close, cl + 1);
    *text_len = tl + cl;
    *ids = moe_xrealloc(*ids, (*n_ids + g->n_think_close) * sizeof **ids);
    memcpy(*ids + *n_ids, g->think_close, g->n_think_close * sizeof **ids);
    *n_ids += g->n_think_close;
    g->think_at_start = false;
}

bool serve_chat_prompt(serve_http *h, serve_api api, const serve_chat *chat, serve_gen *g,
                       char **text, size_t *text_len) {
    json_t *msgs = chat_messages_json(chat);
    char *messages = json_dumps(msgs, JSON_COMPACT);
    json_decref(msgs);
    char *tools = chat_has_tools(chat) ? json_dumps(chat->tools, JSON_COMPACT) : NULL;
    char *kwargs = chat->kwargs ? json_dumps(chat->kwargs, JSON_COMPACT)
                                : moe_xstrdup("{\"add_generation_prompt\":true}");
    moe_error err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    char *rendered = NULL;
    size_t rendered_len = 0;
    const moe_status st =
        moe_chat_render_tokens(h->srv->tmpl, serve_sched_tokenizer(h->srv->sched), messages, tools,
                               kwargs, &rendered, &rendered_len, &ids, &n, &err);
    free(messages);
    free(tools);
    free(kwargs);
    if (st != MOE_OK) {
        serve_reply_error(h, api, 400, "messages", NULL,
                          "the chat template refused the request: %s", err.msg);
        return false;
    }
    reasoning_controls(h->srv, chat, g, &rendered, &rendered_len, &ids, &n);
    if (text_len) *text_len = rendered_len;
    /* the grammar reads the prompt as sent: did it leave a reasoning block open? */
    const bool ok = serve_set_prompt(h, api, ids, n, g) && chat_grammar(h, api, chat, g, rendered);
    if (text) *text = ok ? rendered : NULL;
    if (!ok || !text) free(rendered);
    return ok;
}

/* ==== Output ==== */

void serve_output_init(serve_output *o, const serve_server *srv, const serve_chat *chat,
                       const char *prompt) {
    memset(o, 0, sizeof *o);
    if (!chat) return; /* plain completions: all content */
    moe_chat_parse_options opts;
    moe_chat_parse_options_detect(moe_chat_template_source(srv->tmpl), prompt, &opts);
    char *tools = chat_has_tools(chat) ? json_dumps(chat->tools, JSON_COMPACT) : NULL;
    opts.tools_json = tools;
    opts.no_tool_calls = tools == NULL;
    moe_error err = {0};
    o->parser = moe_chat_parser_new(&opts, &err);
    if (!o->parser) moe_die("output parser: %s", err.msg); /* options come from detect */
    free(tools);
}

/* Everything the last feed settled, in the order the model wrote it. */
static void emit(serve_output *o, serve_segment_fn fn, void *ud) {
    moe_chat_delta *d = &o->delta;
    size_t content = 0, reasoning = 0, call = 0;
    for (size_t i = 0; i < d->n_parts; i++) {
        const moe_chat_delta_part *p = &d->parts[i];
        if (p->kind == 't' && call < d->n_calls) {
            fn(ud, &(serve_segment){.kind = SERVE_SEG_TOOL_CALL,
                                    .name = d->calls[call].name,
                                    .arguments = d->calls[call].arguments});
            call++;
        } else if (p->kind == 'r') {
            fn(ud, &(serve_segment){.kind = SERVE_SEG_REASONING,
                                    .text = d->reasoning + reasoning,
                                    .len = p->len});
            reasoning += p->len;
        } else if (p->kind == 'c') {
            fn(ud, &(serve_segment){
                       .kind = SERVE_SEG_CONTENT, .text = d->content + content, .len = p->len});
            content += p->len;
        }
    }
    moe_chat_delta_clear(d);
}

void serve_output_feed(serve_output *o, const char *text, size_t len, serve_segment_fn fn,
                       void *ud) {
    if (!len) return;
    if (!o->parser) {
        fn(ud, &(serve_segment){.kind = SERVE_SEG_CONTENT, .text = text, .len = len});
        return;
    }
    moe_error err = {0};
    moe_chat_parser_feed(o->parser, text, len, &o->delta, &err);
    emit(o, fn, ud);
}

void serve_output_finish(serve_output *o, serve_segment_fn fn, void *ud) {
    if (!o->parser) return;
    moe_error err = {0};
    moe_chat_parser_finish(o->parser, &o->delta, &err);
    emit(o, fn, ud);
}

void serve_output_free(serve_output *o) {
    moe_chat_parser_free(o->parser);
    moe_chat_delta_clear(&o->delta);
    memset(o, 0, sizeof *o);
}

/* ==== Flat tool definitions ==== */

json_t *serve_tools_from_flat(json_t *tools, const char *keep_type, const char *schema_key,
                              size_t *bad) {
    json_t *oa = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *type = json_string_value(json_object_get(t, "type"));
        const bool keep =
            keep_type ? type && strcmp(type, keep_type) == 0 : !type || strcmp(type, "custom") == 0;
        if (!keep) continue; /* the provider's built-in tools: not ours to run */
        json_t *name = json_object_get(t, "name");
        if (!json_is_string(name)) {
            json_decref(oa);
            *bad = i;
            return NULL;
        }
        json_t *fn = json_object();
        json_object_set(fn, "name", name);
        json_t *desc = json_object_get(t, "description");
        if (json_is_string(desc)) json_object_set(fn, "description", desc);
        json_t *schema = json_object_get(t, schema_key);
        if (schema)
            json_object_set(fn, "parameters", schema);
        else
            json_object_set_new(fn, "parameters", json_object()); /* (set would leak it) */
        json_t *wrap = json_object();
        json_object_set_new(wrap, "type", json_string("function"));
        json_object_set_new(wrap, "function", fn);
        json_array_append_new(oa, wrap);
    }
    return oa;
}
