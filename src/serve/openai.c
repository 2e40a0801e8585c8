/* openai.c: the OpenAI adapters -- /v1/chat/completions, /v1/completions, /v1/models and
 * /apply-template: request JSON to a serve_gen (messages through the chat template), engine
 * events to OpenAI's response objects and stream chunks.
 *
 * One output path for stream and non-stream: engine events go through the output parser
 * (content / reasoning_content / tool calls) into either chunks (stream) or an accumulator.
 * The trap: the request JSON is the client's -- every field is type-checked before use and a
 * bad one is a 400 naming it (`param`), never a crash or a silent default. */
#include "serve_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ==== Request parsing ==== */

#define BAD(h, field, ...) SERVE_BAD(h, SERVE_API_OPENAI, field, __VA_ARGS__)

/* content: a string, null, or an array of parts ({"type":"text","text":...}); Chat Completions'
 * and Responses' part names both (image, audio and file parts are refused by name). */
bool serve_openai_content_text(serve_http *h, json_t *content, const char *field, moe_strbuf *out) {
    if (!content || json_is_null(content)) {
        moe_strbuf_put(out, "", 0);
        return true;
    }
    if (json_is_string(content)) {
        moe_strbuf_put(out, json_string_value(content), json_string_length(content));
        return true;
    }
    if (!json_is_array(content)) BAD(h, field, "%s: expected a string or an array of parts", field);
    moe_strbuf_put(out, "", 0);
    size_t i;
    json_t *part;
    json_array_foreach(content, i, part) {
        const char *type = json_string_value(json_object_get(part, "type"));
        json_t *text = json_object_get(part, "text");
        if (type && (strcmp(type, "image_url") == 0 || strcmp(type, "input_image") == 0 ||
                     strcmp(type, "input_audio") == 0 || strcmp(type, "file") == 0 ||
                     strcmp(type, "input_file") == 0))
            BAD(h, field, "%s[%zu]: %s parts are not supported: this server takes text only", field,
                i, type);
        if (!json_is_string(text))
            BAD(h, field, "%s[%zu]: expected a text part with a string 'text'", field, i);
        moe_strbuf_put(out, json_string_value(text), json_string_length(text));
    }
    return true;
}

static bool parse_tools(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *tools = json_object_get(body, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools) || json_array_size(tools) > SERVE_MAX_TOOLS)
            BAD(h, "tools", "tools: expected an array of at most %d tools", SERVE_MAX_TOOLS);
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            json_t *fn = json_object_get(t, "function");
            const char *type = json_string_value(json_object_get(t, "type"));
            if (!type || strcmp(type, "function") != 0 || !json_is_object(fn) ||
                !json_is_string(json_object_get(fn, "name")))
                BAD(h, "tools",
                    "tools[%zu]: expected {\"type\": \"function\", \"function\": "
                    "{\"name\": ..., \"parameters\": ...}}",
                    i);
        }
        if (json_array_size(tools)) chat->tools = json_incref(tools);
    }
    json_t *choice = json_object_get(body, "tool_choice");
    if (json_is_string(choice)) {
        const char *c = json_string_value(choice);
        if (strcmp(c, "none") && strcmp(c, "auto") && strcmp(c, "required"))
            BAD(h, "tool_choice", "tool_choice: expected none, auto, required or a function");
        chat->tool_choice_none = strcmp(c, "none") == 0;
        if (strcmp(c, "required") == 0 &&
            !serve_chat_force_tool(h, SERVE_API_OPENAI, chat, NULL, "tool_choice"))
            return false;
    } else if (json_is_object(choice)) {
        const char *name =
            json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        if (!name) name = json_string_value(json_object_get(choice, "name"));
        if (!name)
            BAD(h, "tool_choice",
                "tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}");
        if (!serve_chat_force_tool(h, SERVE_API_OPENAI, chat, name, "tool_choice")) return false;
    } else if (choice && !json_is_null(choice)) {
        BAD(h, "tool_choice", "tool_choice: expected a string or an object");
    }
    if (!serve_parse_response_format(h, SERVE_API_OPENAI, json_object_get(body, "response_format"),
                                     "response_format", chat))
        return false;
    json_t *ptc = json_object_get(body, "parallel_tool_calls");
    if (ptc && !json_is_boolean(ptc) && !json_is_null(ptc))
        BAD(h, "parallel_tool_calls", "parallel_tool_calls: expected a boolean");
    return true;
}

static bool parse_messages(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *msgs = json_object_get(body, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        BAD(h, "messages", "messages: expected a non-empty array");
    if (json_array_size(msgs) > SERVE_MAX_MESSAGES)
        BAD(h, "messages", "messages: more than %d", SERVE_MAX_MESSAGES);
    size_t i;
    json_t *m;
    char field[64];
    json_array_foreach(msgs, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        snprintf(field, sizeof field, "messages[%zu].role", i);
        if (!json_is_object(m) || !role) BAD(h, field, "%s: expected a message with a role", field);
        if (strcmp(role, "developer") == 0) role = "system";
        if (strcmp(role, "function") == 0) role = "tool";
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
            strcmp(role, "tool"))
            BAD(h, field, "%s: '%s' is not one of system, developer, user, assistant, tool", field,
                role);
        serve_message *msg = serve_chat_add(chat, role);
        snprintf(field, sizeof field, "messages[%zu].content", i);
        if (!serve_openai_content_text(h, json_object_get(m, "content"), field, &msg->content))
            return false;
        json_t *rc = json_object_get(m, "reasoning_content");
        if (json_is_string(rc))
            moe_strbuf_put(&msg->reasoning, json_string_value(rc), json_string_length(rc));
        json_t *id = json_object_get(m, "tool_call_id");
        if (json_is_string(id)) msg->tool_call_id = moe_xstrdup(json_string_value(id));
        json_t *name = json_object_get(m, "name");
        if (json_is_string(name)) msg->name = moe_xstrdup(json_string_value(name));
        json_t *calls = json_object_get(m, "tool_calls");
        if (calls && !json_is_null(calls)) {
            snprintf(field, sizeof field, "messages[%zu].tool_calls", i);
            if (!json_is_array(calls)) BAD(h, field, "%s: expected an array", field);
            msg->tool_calls = moe_xcalloc(json_array_size(calls) + 1, sizeof *msg->tool_calls);
            size_t k;
            json_t *c;
            json_array_foreach(calls, k, c) {
                json_t *fn = json_object_get(c, "function");
                json_t *fname = json_object_get(fn, "name"),
                       *args = json_object_get(fn, "arguments");
                if (!json_is_string(fname) || (args && !json_is_string(args)))
                    BAD(h, field,
                        "%s[%zu]: expected {\"id\", \"type\": \"function\", \"function\": "
                        "{\"name\": string, \"arguments\": string}}",
                        field, k);
                serve_tool_call *tc = &msg->tool_calls[msg->n_tool_calls++];
                const char *cid = json_string_value(json_object_get(c, "id"));
                tc->id = moe_xstrdup(cid ? cid : "");
                tc->name = moe_xstrdup(json_string_value(fname));
                tc->arguments = moe_xstrdup(args ? json_string_value(args) : "{}");
            }
        }
    }
    return true;
}

/* max_tokens / max_completion_tokens, n, logprobs: the fields chat and completions share */
static bool parse_limits(serve_http *h, json_t *body, serve_gen *g, const char *max_field2,
                         int min_tokens) {
    const char *fields[2] = {"max_tokens", max_field2};
    for (int f = 0; f < 2; f++) {
        if (!fields[f]) continue;
        json_t *v = json_object_get(body, fields[f]);
        if (!v || json_is_null(v)) continue;
        if (!json_is_integer(v) || json_integer_value(v) < min_tokens)
            BAD(h, fields[f], "%s: expected an integer >= %d%s", fields[f], min_tokens,
                min_tokens ? " (0 only with echo)" : "");
        g->max_tokens = json_integer_value(v);
    }
    json_t *n = json_object_get(body, "n");
    if (n && !json_is_null(n) && (!json_is_integer(n) || json_integer_value(n) != 1))
        BAD(h, "n", "n: only 1 choice per request is supported");
    json_t *ie = json_object_get(body, "ignore_eos");
    g->ignore_eos = json_is_true(ie);
    return true;
}

/* ==== Accumulating and streaming output ==== */

typedef struct oa_state {
    serve_answer answer; /* first: the skeleton's part */
    const moe_tokenizer *tok;
    bool chat; /* chat.completion(s) vs text_completion */
    bool include_usage;
    bool logprobs;
    uint32_t n_top;
    /* non-stream accumulation */
    moe_strbuf content, reasoning;
    moe_sample *samples;
    size_t n_samples;
    /* stream */
    bool role_sent;
    const moe_sample *pending_sample; /* logprobs to attach to the next chunk */
    /* completions logprobs: text offsets */
    size_t text_offset;
    /* completions echo: the prompt's text before the completion's (samples then start with the
     * prompt's tokens, the first one's logprob NaN: null in JSON) */
    char *echo_text;
    size_t echo_len;
} oa_state;

static void oa_state_clear(void *p) {
    oa_state *s = p;
    moe_strbuf_free(&s->content);
    moe_strbuf_free(&s->reasoning);
    free(s->samples);
    free(s->echo_text);
}

static void json_logprob_entry(moe_json *j, const moe_tokenizer *tok, const moe_sample *smp,
                               uint32_t n_top) {
    moe_json_object_begin(j);
    moe_json_key(j, "token");
    serve_json_token_piece(j, tok, smp->token);
    moe_json_kv_double(j, "logprob", smp->logprob);
    moe_json_key(j, "bytes");
    serve_json_token_bytes(j, tok, smp->token);
    moe_json_key(j, "top_logprobs");
    moe_json_array_begin(j);
    for (uint32_t k = 0; k < smp->n_top && k < n_top; k++) {
        moe_json_object_begin(j);
        moe_json_key(j, "token");
        serve_json_token_piece(j, tok, smp->top_tokens[k]);
        moe_json_kv_double(j, "logprob", smp->top_logprobs[k]);
        moe_json_key(j, "bytes");
        serve_json_token_bytes(j, tok, smp->top_tokens[k]);
        moe_json_object_end(j);
    }
    moe_json_array_end(j);
    moe_json_object_end(j);
}

/* completions' legacy logprobs object for a run of samples */
static void json_legacy_logprobs(moe_json *j, const moe_tokenizer *tok, const moe_sample *smp,
                                 size_t n, uint32_t n_top, size_t *text_offset) {
    moe_json_object_begin(j);
    moe_json_key(j, "tokens");
    moe_json_array_begin(j);
    for (size_t i = 0; i < n; i++) serve_json_token_piece(j, tok, smp[i].token);
    moe_json_array_end(j);
    moe_json_key(j, "token_logprobs");
    moe_json_array_begin(j);
    for (size_t i = 0; i < n; i++) moe_json_double(j, smp[i].logprob);
    moe_json_array_end(j);
    moe_json_key(j, "top_logprobs");
    moe_json_array_begin(j);
    for (size_t i = 0; i < n; i++) {
        if (isnan(smp[i].logprob)) { /* the first prompt token: nothing predicted it */
            moe_json_null(j);
            continue;
        }
        moe_json_object_begin(j);
        for (uint32_t k = 0; k < smp[i].n_top && k < n_top; k++) {
            size_t len;
            const char *p = moe_tokenizer_token_piece(tok, smp[i].top_tokens[k], true, &len);
            char key[256];
            snprintf(key, sizeof key, "%.*s", (int)(len < 255 ? len : 255), p);
            moe_json_key(j, key);
            moe_json_double(j, smp[i].top_logprobs[k]);
        }
        moe_json_object_end(j);
    }
    moe_json_array_end(j);
    moe_json_key(j, "text_offset");
    moe_json_array_begin(j);
    for (size_t i = 0; i < n; i++) {
        moe_json_uint(j, *text_offset);
        size_t len;
        moe_tokenizer_token_piece(tok, smp[i].token, false, &len);
        *text_offset += len;
    }
    moe_json_array_end(j);
    moe_json_object_end(j);
}

/* A response object's fields up to its open "choices" array. */
static void json_head(oa_state *s, moe_json *j, const char *object) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "id", s->answer.id);
    moe_json_kv_string(j, "object", object);
    moe_json_kv_int(j, "created", s->answer.created);
    moe_json_kv_string(j, "model", s->answer.srv->model_id);
    moe_json_kv_string(j, "system_fingerprint", "moe-" MOE_VERSION_STRING);
    moe_json_key(j, "choices");
    moe_json_array_begin(j);
}

static void chunk_begin(oa_state *s, moe_json *j) {
    json_head(s, j, s->chat ? "chat.completion.chunk" : "text_completion");
}

static void chunk_end(oa_state *s, moe_json *j) {
    moe_json_array_end(j);
    if (s->include_usage) {
        moe_json_key(j, "usage");
        moe_json_null(j);
    }
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, NULL);
}

/* one streamed chunk; kind < 0: an empty delta (logprobs carrier) */
static void stream_delta(oa_state *s, const serve_segment *seg) {
    moe_json *j = &s->answer.sse->j;
    chunk_begin(s, j);
    moe_json_object_begin(j);
    moe_json_kv_int(j, "index", 0);
    if (s->chat) {
        moe_json_key(j, "delta");
        moe_json_object_begin(j);
        if (!s->role_sent) {
            moe_json_kv_string(j, "role", "assistant");
            s->role_sent = true;
        }
        if (!seg) {
            moe_json_kv_string(j, "content", "");
        } else if (seg->kind == SERVE_SEG_CONTENT) {
            moe_json_key(j, "content");
            moe_json_string_n(j, seg->text, seg->len);
        } else if (seg->kind == SERVE_SEG_REASONING) {
            moe_json_key(j, "reasoning_content");
            moe_json_string_n(j, seg->text, seg->len);
        } else {
            const serve_tool_call *c = serve_answer_call(&s->answer, "call_", seg);
            moe_json_key(j, "tool_calls");
            moe_json_array_begin(j);
            moe_json_object_begin(j);
            moe_json_kv_uint(j, "index", s->answer.n_calls - 1);
            moe_json_kv_string(j, "id", c->id);
            moe_json_kv_string(j, "type", "function");
            moe_json_key(j, "function");
            moe_json_object_begin(j);
            moe_json_kv_string(j, "name", seg->name);
            moe_json_kv_string(j, "arguments", seg->arguments);
            moe_json_object_end(j);
            moe_json_object_end(j);
            moe_json_array_end(j);
        }
        moe_json_object_end(j);
    } else {
        moe_json_key(j, "text");
        if (seg)
            moe_json_string_n(j, seg->text, seg->len);
        else
            moe_json_string(j, "");
    }
    moe_json_key(j, "logprobs");
    if (s->pending_sample) {
        if (s->chat) {
            moe_json_object_begin(j);
            moe_json_key(j, "content");
            moe_json_array_begin(j);
            json_logprob_entry(j, s->tok, s->pending_sample, s->n_top);
            moe_json_array_end(j);
            moe_json_object_end(j);
        } else {
            json_legacy_logprobs(j, s->tok, s->pending_sample, 1, s->n_top, &s->text_offset);
        }
        s->pending_sample = NULL;
    } else {
        moe_json_null(j);
    }
    moe_json_key(j, "finish_reason");
    moe_json_null(j);
    moe_json_object_end(j);
    chunk_end(s, j);
}

static void on_segment(void *ud, const serve_segment *seg) {
    oa_state *s = ud;
    if (s->answer.sse) {
        stream_delta(s, seg);
        return;
    }
    if (seg->kind == SERVE_SEG_CONTENT)
        moe_strbuf_put(&s->content, seg->text, seg->len);
    else if (seg->kind == SERVE_SEG_REASONING)
        moe_strbuf_put(&s->reasoning, seg->text, seg->len);
    else {
        serve_answer_call(&s->answer, "call_", seg);
    }
}

static void push_sample(oa_state *s, const moe_sample *smp) {
    s->samples = moe_xrealloc(s->samples, (s->n_samples + 1) * sizeof *s->samples);
    s->samples[s->n_samples++] = *smp;
}

static void feed_events(void *ud, const serve_taken *t) {
    oa_state *s = ud;
    for (size_t i = 0; i < t->n_events; i++) {
        const serve_event *e = &t->events[i];
        if (e->kind == SERVE_EV_PROMPT) { /* echo: a prompt token's logprob, no text */
            if (s->logprobs) push_sample(s, &e->sample);
            continue;
        }
        if (e->kind == SERVE_EV_TOKEN && s->logprobs) {
            if (s->answer.sse) {
                s->pending_sample = &e->sample;
            } else {
                push_sample(s, &e->sample);
            }
        }
        serve_output_feed(&s->answer.out, t->text.s + e->text_off, e->text_len, on_segment, s);
        if (s->answer.sse && s->pending_sample)
            stream_delta(s, NULL); /* held text: logprobs alone */
    }
    if (t->done) serve_output_finish(&s->answer.out, on_segment, s);
}

static const char *finish_reason(const serve_req *r, size_t n_calls) {
    if (r->finish == SERVE_FINISH_LENGTH) return "length";
    if (n_calls) return "tool_calls";
    return "stop";
}

static void json_usage(moe_json *j, const serve_req *r) {
    moe_json_object_begin(j);
    moe_json_kv_uint(j, "prompt_tokens", r->gen.n_prompt);
    moe_json_kv_uint(j, "completion_tokens", r->n_generated);
    moe_json_kv_uint(j, "total_tokens", (uint64_t)r->gen.n_prompt + r->n_generated);
    moe_json_key(j, "prompt_tokens_details");
    moe_json_object_begin(j);
    moe_json_kv_uint(j, "cached_tokens", r->n_cached);
    moe_json_kv_string(j, "cache_source", serve_cache_source_name(r->cached_from));
    moe_json_object_end(j);
    moe_json_key(j, "completion_tokens_details");
    moe_json_object_begin(j);
    moe_json_kv_uint(j, "reasoning_tokens", r->n_reasoning);
    moe_json_object_end(j);
    moe_json_object_end(j);
}

static void stream_begin(void *state, const serve_req *r) {
    (void)r;
    oa_state *s = state;
    /* the first chunk: the role and empty content, as OpenAI sends it */
    if (s->chat) stream_delta(s, &(serve_segment){.kind = SERVE_SEG_CONTENT, .text = ""});
}

static void stream_error(void *state, const char *why) {
    oa_state *s = state;
    moe_json *j = &s->answer.sse->j;
    moe_json_object_begin(j);
    moe_json_key(j, "error");
    moe_json_object_begin(j);
    moe_json_kv_string(j, "message", why);
    moe_json_kv_string(j, "type", "server_error");
    moe_json_object_end(j);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, NULL);
    moe_strbuf_puts(&s->answer.sse->out, "data: [DONE]\n\n");
}

static void stream_end(void *state, const serve_req *r) {
    oa_state *s = state;
    moe_json *j = &s->answer.sse->j;
    chunk_begin(s, j);
    moe_json_object_begin(j);
    moe_json_kv_int(j, "index", 0);
    if (s->chat) {
        moe_json_key(j, "delta");
        moe_json_object_begin(j);
        moe_json_object_end(j);
    } else {
        moe_json_kv_string(j, "text", "");
    }
    moe_json_key(j, "logprobs");
    moe_json_null(j);
    moe_json_kv_string(j, "finish_reason", finish_reason(r, s->answer.n_calls));
    moe_json_object_end(j);
    chunk_end(s, j);
    if (s->include_usage) {
        chunk_begin(s, j);
        moe_json_array_end(j);
        moe_json_key(j, "usage");
        json_usage(j, r);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, NULL);
    }
    moe_strbuf_puts(&s->answer.sse->out, "data: [DONE]\n\n");
}

/* The whole response of a finished generation. */
static void json_whole(moe_json *j, void *state, const serve_req *r) {
    oa_state *s = state;
    json_head(s, j, s->chat ? "chat.completion" : "text_completion");
    moe_json_object_begin(j);
    moe_json_kv_int(j, "index", 0);
    if (s->chat) {
        moe_json_key(j, "message");
        moe_json_object_begin(j);
        moe_json_kv_string(j, "role", "assistant");
        moe_json_key(j, "content");
        bool blank = true;
        for (size_t i = 0; i < s->content.len; i++)
            blank &= s->content.s[i] == ' ' || s->content.s[i] == '\n';
        if (s->answer.n_calls && blank)
            moe_json_null(j);
        else
            moe_json_string_n(j, s->content.s ? s->content.s : "", s->content.len);
        if (s->reasoning.len) {
            moe_json_key(j, "reasoning_content");
            moe_json_string_n(j, s->reasoning.s, s->reasoning.len);
        }
        if (s->answer.n_calls) {
            moe_json_key(j, "tool_calls");
            moe_json_array_begin(j);
            for (size_t i = 0; i < s->answer.n_calls; i++) {
                moe_json_object_begin(j);
                moe_json_kv_string(j, "id", s->answer.calls[i].id);
                moe_json_kv_string(j, "type", "function");
                moe_json_key(j, "function");
                moe_json_object_begin(j);
                moe_json_kv_string(j, "name", s->answer.calls[i].name);
                moe_json_kv_string(j, "arguments", s->answer.calls[i].arguments);
                moe_json_object_end(j);
                moe_json_object_end(j);
            }
            moe_json_array_end(j);
        }
        moe_json_key(j, "refusal");
        moe_json_null(j);
        moe_json_object_end(j);
        moe_json_key(j, "logprobs");
        if (s->logprobs) {
            moe_json_object_begin(j);
            moe_json_key(j, "content");
            moe_json_array_begin(j);
            for (size_t i = 0; i < s->n_samples; i++)
                json_logprob_entry(j, s->tok, &s->samples[i], s->n_top);
            moe_json_array_end(j);
            moe_json_key(j, "refusal");
            moe_json_null(j);
            moe_json_object_end(j);
        } else {
            moe_json_null(j);
        }
    } else {
        moe_json_key(j, "text");
        if (s->echo_text) { /* the prompt, then the completion */
            moe_strbuf both = {0};
            moe_strbuf_put(&both, s->echo_text, s->echo_len);
            moe_strbuf_put(&both, s->content.s ? s->content.s : "", s->content.len);
            moe_json_string_n(j, both.s, both.len);
            moe_strbuf_free(&both);
        } else {
            moe_json_string_n(j, s->content.s ? s->content.s : "", s->content.len);
        }
        moe_json_key(j, "logprobs");
        if (s->logprobs)
            json_legacy_logprobs(j, s->tok, s->samples, s->n_samples, s->n_top, &s->text_offset);
        else
            moe_json_null(j);
    }
    moe_json_kv_string(j, "finish_reason", finish_reason(r, s->answer.n_calls));
    moe_json_object_end(j);
    moe_json_array_end(j);
    moe_json_key(j, "usage");
    json_usage(j, r);
    moe_json_object_end(j);
}

static const serve_adapter openai_adapter = {
    .api = SERVE_API_OPENAI,
    .keepalive = ": keep-alive\n\n",
    .stream_begin = stream_begin,
    .feed = feed_events,
    .stream_end = stream_end,
    .stream_error = stream_error,
    .whole = json_whole,
    .clear = oa_state_clear,
};

static oa_state *oa_state_new(bool chat) {
    oa_state *s = serve_answer_new(&openai_adapter, sizeof *s, chat ? "chatcmpl-" : "cmpl-");
    s->chat = chat;
    return s;
}

/* Chat and completions alike once parsed: the stream options, then the skeleton. */
static void generate(serve_http *h, json_t *body, oa_state *s, serve_req *req,
                     const serve_chat *chat, const char *prompt, bool ok) {
    s->tok = serve_sched_tokenizer(h->srv->sched);
    json_t *opts = json_object_get(body, "stream_options");
    s->include_usage = json_is_true(json_object_get(opts, "include_usage"));
    serve_generate(h, &s->answer, req, chat, prompt, ok,
                   json_is_true(json_object_get(body, "stream")));
}

/* ==== /v1/chat/completions ==== */

void serve_openai_chat(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    serve_chat chat = {0};
    serve_req *req = serve_req_new();
    oa_state *s = oa_state_new(true);
    bool ok = parse_messages(h, body, &chat) && parse_tools(h, body, &chat) &&
              parse_limits(h, body, &req->gen, "max_completion_tokens", 1) &&
              serve_parse_sampling(h, SERVE_API_OPENAI, body, &req->gen, "stop");
    if (ok) {
        json_t *lp = json_object_get(body, "logprobs"),
               *top = json_object_get(body, "top_logprobs");
        if (lp && !json_is_boolean(lp) && !json_is_null(lp)) {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "logprobs", NULL,
                              "logprobs: expected a boolean");
            ok = false;
        } else if (top && !json_is_null(top) &&
                   (!json_is_integer(top) || json_integer_value(top) < 0 ||
                    json_integer_value(top) > MOE_SAMPLER_MAX_TOP)) {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "top_logprobs", NULL,
                              "top_logprobs: expected an integer in 0..%d", MOE_SAMPLER_MAX_TOP);
            ok = false;
        } else if (top && json_is_integer(top) && !json_is_true(lp)) {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "top_logprobs", NULL,
                              "top_logprobs: requires logprobs to be true");
            ok = false;
        } else {
            s->logprobs = req->gen.logprobs = json_is_true(lp);
            s->n_top = top ? (uint32_t)json_integer_value(top) : 0;
            req->gen.sampling.n_top_logprobs = s->n_top;
        }
    }
    char *prompt = NULL;
    ok = ok && serve_parse_template_kwargs(h, SERVE_API_OPENAI, body, &chat) &&
         serve_chat_prompt(h, SERVE_API_OPENAI, &chat, &req->gen, &prompt, NULL);
    generate(h, body, s, req, &chat, prompt, ok);
    free(prompt);
    serve_chat_free(&chat);
    json_decref(body);
}

void serve_openai_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                         const char *text, size_t chunk, bool stream, moe_strbuf *out) {
    serve_replay(&oa_state_new(true)->answer, srv, chat, prompt, text, chunk, stream, out);
}

/* ==== /v1/completions ==== */

/* echo: the prompt's text goes before the completion's -- a string prompt as sent, token ids
 * as their pieces (the bytes text_offset counts) -- and with logprobs, every prompt token's
 * log-probability goes before the completion's (the first one's null). */
static void echo_prompt(serve_http *h, json_t *body, oa_state *s, serve_gen *g) {
    const moe_tokenizer *tok = serve_sched_tokenizer(h->srv->sched);
    json_t *prompt = json_object_get(body, "prompt");
    if (json_is_array(prompt) && json_is_string(json_array_get(prompt, 0)))
        prompt = json_array_get(prompt, 0);
    moe_strbuf text = {0};
    if (json_is_string(prompt)) {
        moe_strbuf_put(&text, json_string_value(prompt), json_string_length(prompt));
    } else {
        for (uint32_t i = 0; i < g->n_prompt; i++) {
            size_t len;
            const char *p = moe_tokenizer_token_piece(tok, g->prompt[i], false, &len);
            moe_strbuf_put(&text, p, len);
        }
    }
    s->echo_len = text.len;
    s->echo_text = text.s ? moe_strbuf_take(&text) : moe_xstrdup("");
    if (!s->logprobs) return;
    g->prompt_logprobs = true;
    push_sample(s, &(moe_sample){.token = g->prompt[0], .logprob = NAN});
}

void serve_openai_completions(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    serve_req *req = serve_req_new();
    oa_state *s = oa_state_new(false);
    json_t *echo = json_object_get(body, "echo");
    bool ok = true;
    if (echo && !json_is_boolean(echo) && !json_is_null(echo)) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "echo", NULL, "echo: expected a boolean");
        ok = false;
    } else if (json_is_true(echo) && json_is_true(json_object_get(body, "stream"))) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "echo", NULL,
                          "echo: not supported with stream (ask without streaming)");
        ok = false;
    }
    ok = ok && parse_limits(h, body, &req->gen, NULL, json_is_true(echo) ? 0 : 1) &&
         serve_parse_sampling(h, SERVE_API_OPENAI, body, &req->gen, "stop");
    if (ok && json_object_get(body, "max_tokens") == NULL) req->gen.max_tokens = 16; /* OpenAI's */
    json_t *lp = json_object_get(body, "logprobs");
    if (ok && lp && !json_is_null(lp)) {
        if (!json_is_integer(lp) || json_integer_value(lp) < 0 || json_integer_value(lp) > 5) {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "logprobs", NULL,
                              "logprobs: expected an integer in 0..5");
            ok = false;
        } else {
            s->logprobs = req->gen.logprobs = true;
            s->n_top = (uint32_t)json_integer_value(lp);
            req->gen.sampling.n_top_logprobs = s->n_top;
        }
    }
    if (ok) {
        json_t *prompt = json_object_get(body, "prompt");
        if (json_is_array(prompt) && json_array_size(prompt) == 1 &&
            json_is_string(json_array_get(prompt, 0)))
            prompt = json_array_get(prompt, 0);
        if (json_is_string(prompt)) {
            ok = serve_tokenize_prompt(h, SERVE_API_OPENAI, json_string_value(prompt),
                                       json_string_length(prompt), &req->gen);
        } else if (json_is_array(prompt) && json_array_size(prompt) &&
                   json_is_integer(json_array_get(prompt, 0))) {
            /* token ids */
            const size_t n = json_array_size(prompt);
            const uint32_t n_vocab = moe_tokenizer_n_vocab(serve_sched_tokenizer(h->srv->sched));
            const uint32_t n_ctx = serve_sched_n_ctx(h->srv->sched);
            req->gen.prompt = moe_xmalloc(sizeof(int32_t) * n);
            for (size_t i = 0; ok && i < n; i++) {
                json_t *v = json_array_get(prompt, i);
                if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                    json_integer_value(v) >= (json_int_t)n_vocab) {
                    serve_reply_error(h, SERVE_API_OPENAI, 400, "prompt", NULL,
                                      "prompt[%zu]: expected a token id below %u", i, n_vocab);
                    ok = false;
                } else {
                    req->gen.prompt[i] = (int32_t)json_integer_value(v);
                }
            }
            if (ok && n >= n_ctx) {
                serve_reply_error(h, SERVE_API_OPENAI, 400, "prompt", "context_length_exceeded",
                                  "the prompt is too long: %zu tokens of %u (this model's maximum "
                                  "context length is %u tokens)",
                                  n, n_ctx, n_ctx);
                ok = false;
            }
            req->gen.n_prompt = (uint32_t)n;
            h->log_prompt = (uint32_t)n;
        } else {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "prompt", NULL,
                              "prompt: expected a string, one string in an array, or token ids");
            ok = false;
        }
    }
    if (ok && json_is_true(echo)) echo_prompt(h, body, s, &req->gen);
    generate(h, body, s, req, NULL, NULL, ok);
    json_decref(body);
}

/* ==== /apply-template ==== */

/* The prompt a chat request would get, without generating (llama-server's endpoint): the body
 * is a /v1/chat/completions request; the reply {"prompt": TEXT, "tokens": [ids]}. */
void serve_openai_apply_template(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    serve_chat chat = {0};
    serve_gen gen = {0};
    char *prompt = NULL;
    size_t prompt_len = 0;
    if (parse_messages(h, body, &chat) && parse_tools(h, body, &chat) &&
        serve_parse_template_kwargs(h, SERVE_API_OPENAI, body, &chat) &&
        serve_chat_prompt(h, SERVE_API_OPENAI, &chat, &gen, &prompt, &prompt_len)) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_key(&j, "prompt");
        moe_json_string_n(&j, prompt, prompt_len);
        moe_json_key(&j, "tokens");
        moe_json_array_begin(&j);
        for (uint32_t i = 0; i < gen.n_prompt; i++) moe_json_int(&j, gen.prompt[i]);
        moe_json_array_end(&j);
        moe_json_object_end(&j);
        serve_reply_json(h, 200, &j);
        moe_json_free(&j);
    }
    free(prompt);
    serve_gen_free(&gen);
    serve_chat_free(&chat);
    json_decref(body);
}

/* ==== /v1/models ==== */

void serve_openai_models(serve_http *h) {
    moe_json j;
    moe_json_init(&j, false);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "object", "list");
    moe_json_key(&j, "data");
    moe_json_array_begin(&j);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "id", h->srv->model_id);
    moe_json_kv_string(&j, "object", "model");
    moe_json_kv_int(&j, "created", (int64_t)time(NULL));
    moe_json_kv_string(&j, "owned_by", "moe");
    moe_json_kv_uint(&j, "max_model_len", serve_sched_n_ctx(h->srv->sched));
    moe_json_kv_uint(&j, "context_length", serve_sched_n_ctx(h->srv->sched));
    moe_json_object_end(&j);
    moe_json_array_end(&j);
    moe_json_object_end(&j);
    serve_reply_json(h, 200, &j);
    moe_json_free(&j);
}
