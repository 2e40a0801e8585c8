/* anthropic.c: the Anthropic adapters -- /v1/messages (stream and not),
 * /v1/messages/count_tokens and the Anthropic form of /v1/models.
 *
 * Messages map onto the shared conversation: system (string or text blocks) first, tool_use
 * blocks become assistant tool calls, tool_result blocks become tool turns, thinking blocks
 * become reasoning. Claude Code's first system block "x-anthropic-billing-header: ..." changes
 * every request and would defeat prefix reuse, so it is dropped before templating. The stream
 * follows the API's event order exactly: message_start, then per block content_block_start,
 * (a ping after the first start), content_block_delta..., content_block_stop, then
 * message_delta (stop_reason, cumulative usage) and message_stop. The trap: a thinking block
 * always ends with a signature_delta (clients verify the field is present). */
#include "serve_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define THINKING_SIGNATURE                                                                         \
    "bW9lLWxvY2FsLXVuc2lnbmVk" /* "moe-local-unsigned": nothing to verify                          \
                                */

#define BAD(h, field, ...) SERVE_BAD(h, SERVE_API_ANTHROPIC, field, __VA_ARGS__)

/* ==== Request parsing ==== */

/* Text of a string or an array of text blocks; images and documents are refused. */
static bool blocks_text(serve_http *h, json_t *v, const char *field, moe_strbuf *out) {
    if (json_is_string(v)) {
        moe_strbuf_put(out, json_string_value(v), json_string_length(v));
        return true;
    }
    if (!json_is_array(v))
        BAD(h, field, "%s: expected a string or an array of content blocks", field);
    size_t i;
    json_t *b;
    json_array_foreach(v, i, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (type && (strcmp(type, "image") == 0 || strcmp(type, "document") == 0))
            BAD(h, field, "%s.%zu: %s blocks are not supported: this server takes text only", field,
                i, type);
        json_t *text = json_object_get(b, "text");
        if (!type || strcmp(type, "text") != 0 || !json_is_string(text))
            BAD(h, field, "%s.%zu: expected a text block", field, i);
        moe_strbuf_put(out, json_string_value(text), json_string_length(text));
    }
    return true;
}

static bool parse_system(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *sys = json_object_get(body, "system");
    if (!sys || json_is_null(sys)) return true;
    moe_strbuf text = {0};
    if (json_is_array(sys)) {
        size_t i;
        json_t *b;
        json_array_foreach(sys, i, b) {
            json_t *tv = json_object_get(b, "text");
            const char *t = json_string_value(tv);
            const char *type = json_string_value(json_object_get(b, "type"));
            if (!t || !type || strcmp(type, "text") != 0) {
                moe_strbuf_free(&text);
                BAD(h, "system", "system.%zu: expected a text block", i);
            }
            if (i == 0 && strncmp(t, "x-anthropic-billing-header:", 27) == 0) continue;
            if (text.len) moe_strbuf_puts(&text, "\n\n");
            moe_strbuf_put(&text, t, json_string_length(tv));
        }
    } else if (!blocks_text(h, sys, "system", &text)) {
        moe_strbuf_free(&text);
        return false;
    }
    serve_message *m = serve_chat_add(chat, "system");
    m->content = text; /* moved */
    return true;
}

static bool parse_messages(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *msgs = json_object_get(body, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        BAD(h, "messages", "messages: Field required (a non-empty array)");
    if (json_array_size(msgs) > SERVE_MAX_MESSAGES)
        BAD(h, "messages", "messages: more than %d", SERVE_MAX_MESSAGES);
    size_t i;
    json_t *m;
    char field[64];
    json_array_foreach(msgs, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        snprintf(field, sizeof field, "messages.%zu", i);
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant")))
            BAD(h, field, "%s.role: expected 'user' or 'assistant'", field);
        json_t *content = json_object_get(m, "content");
        if (json_is_string(content)) {
            serve_message *msg = serve_chat_add(chat, role);
            moe_strbuf_put(&msg->content, json_string_value(content), json_string_length(content));
            continue;
        }
        if (!json_is_array(content))
            BAD(h, field, "%s.content: expected a string or an array of content blocks", field);
        /* user: tool results become tool turns, then the text; assistant: one turn with its
         * text, thinking and tool calls */
        moe_strbuf text = {0}, thinking = {0};
        serve_message *msg = NULL;
        if (strcmp(role, "assistant") == 0) {
            msg = serve_chat_add(chat, "assistant");
            msg->tool_calls = moe_xcalloc(json_array_size(content) + 1, sizeof *msg->tool_calls);
        }
        size_t k;
        json_t *b;
        bool ok = true;
        json_array_foreach(content, k, b) {
            const char *type = json_string_value(json_object_get(b, "type"));
            if (!type) type = "";
            json_t *t = json_object_get(b, strcmp(type, "text") == 0 ? "text" : "thinking");
            if (strcmp(type, "text") == 0 && json_is_string(t)) {
                moe_strbuf_put(&text, json_string_value(t), json_string_length(t));
            } else if (strcmp(type, "thinking") == 0 || strcmp(type, "redacted_thinking") == 0) {
                if (json_is_string(t))
                    moe_strbuf_put(&thinking, json_string_value(t), json_string_length(t));
            } else if (strcmp(type, "tool_use") == 0 && msg) {
                const char *id = json_string_value(json_object_get(b, "id"));
                const char *name = json_string_value(json_object_get(b, "name"));
                json_t *input = json_object_get(b, "input");
                if (!name) {
                    serve_reply_error(h, SERVE_API_ANTHROPIC, 400, field, NULL,
                                      "%s.content.%zu.name: Field required", field, k);
                    ok = false;
                    break;
                }
                serve_tool_call *tc = &msg->tool_calls[msg->n_tool_calls++];
                tc->id = moe_xstrdup(id ? id : "");
                tc->name = moe_xstrdup(name);
                char *args = input ? json_dumps(input, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
                tc->arguments = args ? args : moe_xstrdup("{}");
            } else if (strcmp(type, "tool_result") == 0 && !msg) {
                serve_message *tm = serve_chat_add(chat, "tool");
                const char *id = json_string_value(json_object_get(b, "tool_use_id"));
                tm->tool_call_id = moe_xstrdup(id ? id : "");
                json_t *c = json_object_get(b, "content");
                moe_strbuf r = {0};
                char sub[160];
                snprintf(sub, sizeof sub, "%s.content.%zu.content", field, k);
                if (c && !json_is_null(c) && !blocks_text(h, c, sub, &r)) ok = false;
                tm->content = r; /* moved */
                if (!ok) break;
            } else {
                serve_reply_error(h, SERVE_API_ANTHROPIC, 400, field, NULL,
                                  "%s.content.%zu: %s blocks are not supported in a %s message%s",
                                  field, k, type[0] ? type : "untyped", role,
                                  strcmp(type, "image") == 0 || strcmp(type, "document") == 0
                                      ? " (this server takes text only)"
                                      : "");
                ok = false;
                break;
            }
        }
        if (msg) {
            moe_strbuf_put(&text, "", 0); /* present, if empty */
            msg->content = text;          /* moved */
            msg->reasoning = thinking;    /* .s NULL when there was none */
            text = thinking = (moe_strbuf){0};
        } else if (text.len) {
            serve_chat_add(chat, "user")->content = text; /* moved */
            text = (moe_strbuf){0};
        }
        moe_strbuf_free(&text);
        moe_strbuf_free(&thinking);
        if (!ok) return false;
    }
    return true;
}

static bool parse_tools(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *tools = json_object_get(body, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools) || json_array_size(tools) > SERVE_MAX_TOOLS)
            BAD(h, "tools", "tools: expected an array of at most %d tools", SERVE_MAX_TOOLS);
        size_t bad = 0;
        json_t *oa = serve_tools_from_flat(tools, NULL, "input_schema", &bad);
        if (!oa) BAD(h, "tools", "tools.%zu.name: Field required", bad);
        if (json_array_size(oa))
            chat->tools = oa;
        else
            json_decref(oa);
    }
    json_t *choice = json_object_get(body, "tool_choice");
    const char *ct = json_string_value(json_object_get(choice, "type"));
    if (choice && !json_is_null(choice) &&
        (!ct ||
         (strcmp(ct, "auto") && strcmp(ct, "any") && strcmp(ct, "tool") && strcmp(ct, "none"))))
        BAD(h, "tool_choice", "tool_choice: expected {\"type\": auto|any|tool|none}");
    chat->tool_choice_none = ct && strcmp(ct, "none") == 0;
    if (ct && (strcmp(ct, "any") == 0 || strcmp(ct, "tool") == 0)) {
        const char *name = json_string_value(json_object_get(choice, "name"));
        if (strcmp(ct, "tool") == 0 && !name)
            BAD(h, "tool_choice", "tool_choice: {\"type\": \"tool\"} needs a name");
        if (!serve_chat_force_tool(h, SERVE_API_ANTHROPIC, chat, strcmp(ct, "tool") ? NULL : name,
                                   "tool_choice"))
            return false;
    }
    return true;
}

/* Everything up to the prompt tokens; shared by messages and count_tokens. *prompt (may be
 * NULL) gets the prompt text. */
static bool parse_request(serve_http *h, json_t *body, serve_req *req, serve_chat *chat,
                          bool need_max_tokens, char **prompt) {
    if (need_max_tokens) {
        json_t *mt = json_object_get(body, "max_tokens");
        if (!mt) BAD(h, "max_tokens", "max_tokens: Field required");
        if (!json_is_integer(mt) || json_integer_value(mt) < 1)
            BAD(h, "max_tokens", "max_tokens: expected an integer >= 1");
        req->gen.max_tokens = json_integer_value(mt);
        if (!serve_parse_sampling(h, SERVE_API_ANTHROPIC, body, &req->gen, "stop_sequences"))
            return false;
    }
    return parse_system(h, body, chat) && parse_messages(h, body, chat) &&
           parse_tools(h, body, chat) &&
           serve_parse_template_kwargs(h, SERVE_API_ANTHROPIC, body, chat) &&
           serve_chat_prompt(h, SERVE_API_ANTHROPIC, chat, &req->gen, prompt, NULL);
}

/* ==== Output ==== */

typedef enum block_kind { BLOCK_NONE, BLOCK_TEXT, BLOCK_THINKING } block_kind;

typedef struct an_state {
    serve_answer answer; /* first: the skeleton's part */
    /* stream */
    block_kind open;
    int index; /* of the open block; next block gets index + 1 */
    bool pinged;
    /* non-stream */
    moe_strbuf text, thinking;
    /* block order, non-stream: 't' thinking, 'x' text, 'c' call */
    moe_strbuf order;
} an_state;

static void an_state_clear(void *p) {
    an_state *s = p;
    moe_strbuf_free(&s->text);
    moe_strbuf_free(&s->thinking);
    moe_strbuf_free(&s->order);
}

static void json_usage(moe_json *j, const serve_req *r, bool with_output) {
    moe_json_object_begin(j);
    moe_json_kv_uint(j, "input_tokens", r->gen.n_prompt - r->n_cached);
    moe_json_kv_uint(j, "cache_creation_input_tokens", 0);
    moe_json_kv_uint(j, "cache_read_input_tokens", r->n_cached);
    moe_json_kv_string(j, "cache_source", serve_cache_source_name(r->cached_from));
    moe_json_kv_uint(j, "output_tokens", with_output ? r->n_generated : 0);
    moe_json_object_end(j);
}

static const char *stop_reason(const serve_req *r, size_t n_calls) {
    if (r->finish == SERVE_FINISH_LENGTH) return "max_tokens";
    if (r->finish == SERVE_FINISH_STOP) return "stop_sequence";
    if (n_calls) return "tool_use";
    return "end_turn";
}

static void json_stop_sequence(moe_json *j, const serve_req *r) {
    if (r->finish == SERVE_FINISH_STOP && r->stop_index >= 0 &&
        (uint32_t)r->stop_index < r->gen.n_stop)
        moe_json_string(j, r->gen.stop[r->stop_index]);
    else
        moe_json_null(j);
}

static void ev_type(moe_json *j, const char *type) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "type", type);
}

static void block_close(an_state *s) {
    moe_json *j = &s->answer.sse->j;
    if (s->open == BLOCK_THINKING) {
        ev_type(j, "content_block_delta");
        moe_json_kv_int(j, "index", s->index);
        moe_json_key(j, "delta");
        moe_json_object_begin(j);
        moe_json_kv_string(j, "type", "signature_delta");
        moe_json_kv_string(j, "signature", THINKING_SIGNATURE);
        moe_json_object_end(j);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, "content_block_delta");
    }
    if (s->open != BLOCK_NONE) {
        ev_type(j, "content_block_stop");
        moe_json_kv_int(j, "index", s->index);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, "content_block_stop");
        s->index++;
    }
    s->open = BLOCK_NONE;
}

static void ping_once(an_state *s) {
    if (s->pinged) return;
    s->pinged = true;
    ev_type(&s->answer.sse->j, "ping");
    moe_json_object_end(&s->answer.sse->j);
    serve_sse_event(s->answer.sse, "ping");
}

static void block_open(an_state *s, block_kind kind) {
    if (s->open == kind) return;
    block_close(s);
    moe_json *j = &s->answer.sse->j;
    ev_type(j, "content_block_start");
    moe_json_kv_int(j, "index", s->index);
    moe_json_key(j, "content_block");
    moe_json_object_begin(j);
    moe_json_key(j, "type");
    if (kind == BLOCK_THINKING) {
        moe_json_string(j, "thinking");
        moe_json_kv_string(j, "thinking", "");
        moe_json_kv_string(j, "signature", "");
    } else {
        moe_json_string(j, "text");
        moe_json_kv_string(j, "text", "");
    }
    moe_json_object_end(j);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "content_block_start");
    s->open = kind;
    ping_once(s);
}

static void on_segment(void *ud, const serve_segment *seg) {
    an_state *s = ud;
    if (!s->answer.sse) {
        if (seg->kind == SERVE_SEG_TOOL_CALL) {
            serve_answer_call(&s->answer, "toolu_", seg);
            moe_strbuf_puts(&s->order, "c");
        } else {
            moe_strbuf *dst = seg->kind == SERVE_SEG_REASONING ? &s->thinking : &s->text;
            const char tag = seg->kind == SERVE_SEG_REASONING ? 't' : 'x';
            if (!dst->len && seg->len) moe_strbuf_put(&s->order, &tag, 1);
            moe_strbuf_put(dst, seg->text, seg->len);
        }
        return;
    }
    moe_json *j = &s->answer.sse->j;
    if (seg->kind == SERVE_SEG_TOOL_CALL) {
        block_close(s);
        const char *id = serve_answer_call(&s->answer, "toolu_", seg)->id;
        ev_type(j, "content_block_start");
        moe_json_kv_int(j, "index", s->index);
        moe_json_key(j, "content_block");
        moe_json_object_begin(j);
        moe_json_kv_string(j, "type", "tool_use");
        moe_json_kv_string(j, "id", id);
        moe_json_kv_string(j, "name", seg->name);
        moe_json_key(j, "input");
        moe_json_object_begin(j);
        moe_json_object_end(j);
        moe_json_object_end(j);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, "content_block_start");
        ping_once(s);
        ev_type(j, "content_block_delta");
        moe_json_kv_int(j, "index", s->index);
        moe_json_key(j, "delta");
        moe_json_object_begin(j);
        moe_json_kv_string(j, "type", "input_json_delta");
        moe_json_kv_string(j, "partial_json", seg->arguments);
        moe_json_object_end(j);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, "content_block_delta");
        ev_type(j, "content_block_stop");
        moe_json_kv_int(j, "index", s->index);
        moe_json_object_end(j);
        serve_sse_event(s->answer.sse, "content_block_stop");
        s->index++;
        return;
    }
    if (!seg->len) return;
    const bool thinking = seg->kind == SERVE_SEG_REASONING;
    block_open(s, thinking ? BLOCK_THINKING : BLOCK_TEXT);
    ev_type(j, "content_block_delta");
    moe_json_kv_int(j, "index", s->index);
    moe_json_key(j, "delta");
    moe_json_object_begin(j);
    moe_json_kv_string(j, "type", thinking ? "thinking_delta" : "text_delta");
    moe_json_key(j, thinking ? "thinking" : "text");
    moe_json_string_n(j, seg->text, seg->len);
    moe_json_object_end(j);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "content_block_delta");
}

static void feed_events(void *ud, const serve_taken *t) {
    an_state *s = ud;
    for (size_t i = 0; i < t->n_events; i++)
        serve_output_feed(&s->answer.out, t->text.s + t->events[i].text_off, t->events[i].text_len,
                          on_segment, s);
    if (t->done) serve_output_finish(&s->answer.out, on_segment, s);
}

static void message_head(moe_json *j, an_state *s) {
    moe_json_kv_string(j, "id", s->answer.id);
    moe_json_kv_string(j, "type", "message");
    moe_json_kv_string(j, "role", "assistant");
    moe_json_kv_string(j, "model", s->answer.srv->model_id);
}

static void stream_begin(void *state, const serve_req *r) {
    an_state *s = state;
    moe_json *j = &s->answer.sse->j;
    ev_type(j, "message_start");
    moe_json_key(j, "message");
    moe_json_object_begin(j);
    message_head(j, s);
    moe_json_key(j, "content");
    moe_json_array_begin(j);
    moe_json_array_end(j);
    moe_json_key(j, "stop_reason");
    moe_json_null(j);
    moe_json_key(j, "stop_sequence");
    moe_json_null(j);
    moe_json_key(j, "usage");
    json_usage(j, r, false);
    moe_json_object_end(j);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "message_start");
}

static void stream_error(void *state, const char *why) {
    an_state *s = state;
    moe_json *j = &s->answer.sse->j;
    ev_type(j, "error");
    moe_json_key(j, "error");
    moe_json_object_begin(j);
    moe_json_kv_string(j, "type", "api_error");
    moe_json_kv_string(j, "message", why);
    moe_json_object_end(j);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "error");
}

static void stream_end(void *state, const serve_req *r) {
    an_state *s = state;
    moe_json *j = &s->answer.sse->j;
    if (s->index == 0 && s->open == BLOCK_NONE) block_open(s, BLOCK_TEXT); /* always one block */
    block_close(s);
    ev_type(j, "message_delta");
    moe_json_key(j, "delta");
    moe_json_object_begin(j);
    moe_json_kv_string(j, "stop_reason", stop_reason(r, s->answer.n_calls));
    moe_json_key(j, "stop_sequence");
    json_stop_sequence(j, r);
    moe_json_object_end(j);
    moe_json_key(j, "usage");
    json_usage(j, r, true);
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "message_delta");
    ev_type(j, "message_stop");
    moe_json_object_end(j);
    serve_sse_event(s->answer.sse, "message_stop");
}

/* The whole response of a finished generation. */
static void json_whole(moe_json *j, void *state, const serve_req *r) {
    an_state *s = state;
    moe_json_object_begin(j);
    message_head(j, s);
    moe_json_key(j, "content");
    moe_json_array_begin(j);
    size_t call = 0;
    for (size_t i = 0; i < s->order.len; i++) {
        moe_json_object_begin(j);
        moe_json_key(j, "type");
        if (s->order.s[i] == 't') {
            moe_json_string(j, "thinking");
            moe_json_key(j, "thinking");
            moe_json_string_n(j, s->thinking.s, s->thinking.len);
            moe_json_kv_string(j, "signature", THINKING_SIGNATURE);
        } else if (s->order.s[i] == 'x') {
            moe_json_string(j, "text");
            moe_json_key(j, "text");
            moe_json_string_n(j, s->text.s, s->text.len);
        } else {
            const serve_tool_call *c = &s->answer.calls[call++];
            moe_json_string(j, "tool_use");
            moe_json_kv_string(j, "id", c->id);
            moe_json_kv_string(j, "name", c->name);
            moe_json_key(j, "input");
            json_t *in = json_loads(c->arguments, JSON_DECODE_ANY, NULL);
            if (json_is_object(in))
                serve_json_value(j, in);
            else {
                moe_json_object_begin(j);
                moe_json_object_end(j);
            }
            json_decref(in);
        }
        moe_json_object_end(j);
    }
    moe_json_array_end(j);
    moe_json_kv_string(j, "stop_reason", stop_reason(r, s->answer.n_calls));
    moe_json_key(j, "stop_sequence");
    json_stop_sequence(j, r);
    moe_json_key(j, "usage");
    json_usage(j, r, true);
    moe_json_object_end(j);
}

static const serve_adapter messages_adapter = {
    .api = SERVE_API_ANTHROPIC,
    .keepalive = "event: ping\ndata: {\"type\": \"ping\"}\n\n",
    .stream_begin = stream_begin,
    .feed = feed_events,
    .stream_end = stream_end,
    .stream_error = stream_error,
    .whole = json_whole,
    .clear = an_state_clear,
};

static an_state *an_state_new(void) {
    return serve_answer_new(&messages_adapter, sizeof(an_state), "msg_");
}

/* ==== Endpoints ==== */

void serve_anthropic_messages(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_ANTHROPIC);
    if (!body) return;
    serve_chat chat = {0};
    serve_req *req = serve_req_new();
    char *prompt = NULL;
    const bool ok = parse_request(h, body, req, &chat, true, &prompt);
    const bool stream = json_is_true(json_object_get(body, "stream"));
    json_decref(body);
    serve_generate(h, &an_state_new()->answer, req, &chat, prompt, ok, stream);
    free(prompt);
    serve_chat_free(&chat);
}

void serve_anthropic_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                            const char *text, size_t chunk, bool stream, moe_strbuf *out) {
    serve_replay(&an_state_new()->answer, srv, chat, prompt, text, chunk, stream, out);
}

void serve_anthropic_count_tokens(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_ANTHROPIC);
    if (!body) return;
    serve_chat chat = {0};
    serve_req *req = serve_req_new();
    if (parse_request(h, body, req, &chat, false, NULL)) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_kv_uint(&j, "input_tokens", req->gen.n_prompt);
        moe_json_object_end(&j);
        serve_reply_json(h, 200, &j);
        moe_json_free(&j);
    }
    serve_chat_free(&chat);
    serve_req_release(req);
    json_decref(body);
}

void serve_anthropic_models(serve_http *h) {
    char created[32];
    const time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(created, sizeof created, "%Y-%m-%dT%H:%M:%SZ", &tm);
    moe_json j;
    moe_json_init(&j, false);
    moe_json_object_begin(&j);
    moe_json_key(&j, "data");
    moe_json_array_begin(&j);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "type", "model");
    moe_json_kv_string(&j, "id", h->srv->model_id);
    moe_json_kv_string(&j, "display_name", h->srv->model_id);
    moe_json_kv_string(&j, "created_at", created);
    moe_json_object_end(&j);
    moe_json_array_end(&j);
    moe_json_kv_bool(&j, "has_more", false);
    moe_json_kv_string(&j, "first_id", h->srv->model_id);
    moe_json_kv_string(&j, "last_id", h->srv->model_id);
    moe_json_object_end(&j);
    serve_reply_json(h, 200, &j);
    moe_json_free(&j);
}
