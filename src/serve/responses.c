/* responses.c: the OpenAI Responses API -- POST /v1/responses, stream and not, enough for Codex
 * CLI and the SDK's responses.create / responses.stream.
 *
 * Input items map onto the shared conversation: instructions become the system turn, message
 * items their role's turn, function_call items assistant tool calls, function_call_output items
 * tool turns. Output: the parser's segments become output items in order -- reasoning, message
 * (one output_text part) and function_call -- kept whole so the final response object (the
 * non-stream reply and the stream's response.completed) lists all of them. The trap: every
 * stream event carries a sequence_number, and an item's deltas may only come between its
 * output_item.added and output_item.done (the SDK's accumulator checks). */
#include "serve_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD(h, field, ...) SERVE_BAD(h, SERVE_API_OPENAI, field, __VA_ARGS__)

/* ==== Request ==== */

static bool parse_input(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *instr = json_object_get(body, "instructions");
    if (json_is_string(instr))
        moe_strbuf_put(&serve_chat_add(chat, "system")->content, json_string_value(instr),
                       json_string_length(instr));
    json_t *input = json_object_get(body, "input");
    if (json_is_string(input)) {
        moe_strbuf_put(&serve_chat_add(chat, "user")->content, json_string_value(input),
                       json_string_length(input));
        return true;
    }
    if (!json_is_array(input) || json_array_size(input) == 0)
        BAD(h, "input", "input: expected a string or a non-empty array of items");
    if (json_array_size(input) > SERVE_MAX_MESSAGES)
        BAD(h, "input", "input: more than %d items", SERVE_MAX_MESSAGES);
    size_t i;
    json_t *it;
    char field[64];
    json_array_foreach(input, i, it) {
        snprintf(field, sizeof field, "input[%zu]", i);
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!type || strcmp(type, "message") == 0) {
            if (!role) BAD(h, field, "%s.role: expected a role", field);
            if (strcmp(role, "developer") == 0) role = "system";
            if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant"))
                BAD(h, field, "%s.role: '%s' is not one of system, developer, user, assistant",
                    field, role);
            serve_message *m = serve_chat_add(chat, role);
            char sub[80];
            snprintf(sub, sizeof sub, "%s.content", field);
            if (!serve_openai_content_text(h, json_object_get(it, "content"), sub, &m->content))
                return false;
        } else if (strcmp(type, "function_call") == 0) {
            const char *name = json_string_value(json_object_get(it, "name"));
            const char *args = json_string_value(json_object_get(it, "arguments"));
            const char *id = json_string_value(json_object_get(it, "call_id"));
            if (!name) BAD(h, field, "%s.name: expected a string", field);
            serve_message *m = chat->n_msgs ? &chat->msgs[chat->n_msgs - 1] : NULL;
            if (!m || strcmp(m->role, "assistant") != 0) {
                m = serve_chat_add(chat, "assistant");
                moe_strbuf_put(&m->content, "", 0);
            }
            m->tool_calls =
                moe_xrealloc(m->tool_calls, (m->n_tool_calls + 1) * sizeof *m->tool_calls);
            m->tool_calls[m->n_tool_calls++] = (serve_tool_call){
                moe_xstrdup(id ? id : ""), moe_xstrdup(name), moe_xstrdup(args ? args : "{}")};
        } else if (strcmp(type, "function_call_output") == 0) {
            json_t *out = json_object_get(it, "output");
            const char *id = json_string_value(json_object_get(it, "call_id"));
            serve_message *m = serve_chat_add(chat, "tool");
            m->tool_call_id = moe_xstrdup(id ? id : "");
            char sub[80];
            snprintf(sub, sizeof sub, "%s.output", field);
            if (!serve_openai_content_text(h, out, sub, &m->content)) return false;
        } else if (strcmp(type, "reasoning") == 0) {
            continue; /* our own earlier thinking: not replayed */
        } else {
            BAD(h, field, "%s.type: '%s' items are not supported", field, type);
        }
    }
    return true;
}

static bool parse_tools(serve_http *h, json_t *body, serve_chat *chat) {
    json_t *tools = json_object_get(body, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools) || json_array_size(tools) > SERVE_MAX_TOOLS)
            BAD(h, "tools", "tools: expected an array of at most %d tools", SERVE_MAX_TOOLS);
        size_t bad = 0;
        json_t *oa = serve_tools_from_flat(tools, "function", "parameters", &bad);
        if (!oa) BAD(h, "tools", "tools[%zu].name: expected a string", bad);
        if (json_array_size(oa))
            chat->tools = oa;
        else
            json_decref(oa);
    }
    json_t *choice = json_object_get(body, "tool_choice");
    chat->tool_choice_none =
        json_is_string(choice) && strcmp(json_string_value(choice), "none") == 0;
    if (json_is_string(choice) && strcmp(json_string_value(choice), "required") == 0 &&
        !serve_chat_force_tool(h, SERVE_API_OPENAI, chat, NULL, "tool_choice"))
        return false;
    if (json_is_object(choice)) {
        const char *name = json_string_value(json_object_get(choice, "name"));
        if (!name)
            BAD(h, "tool_choice", "tool_choice: expected {\"type\": \"function\", \"name\": ...}");
        if (!serve_chat_force_tool(h, SERVE_API_OPENAI, chat, name, "tool_choice")) return false;
    }
    return serve_parse_response_format(h, SERVE_API_OPENAI,
                                       json_object_get(json_object_get(body, "text"), "format"),
                                       "text.format", chat);
}

/* ==== Output ==== */

typedef enum item_kind { ITEM_REASONING, ITEM_MESSAGE, ITEM_CALL } item_kind;

typedef struct out_item {
    item_kind kind;
    char id[48], call_id[48];
    moe_strbuf text; /* message / reasoning text, or the call's arguments */
    char *name;
    bool done;
} out_item;

typedef struct rs_state {
    serve_answer answer; /* first: the skeleton's part */
    out_item *items;
    size_t n_items;
    uint64_t seq;
    json_t *echo; /* request fields echoed in the response object */
} rs_state;

static void rs_state_clear(void *p) {
    rs_state *s = p;
    for (size_t i = 0; i < s->n_items; i++) {
        moe_strbuf_free(&s->items[i].text);
        free(s->items[i].name);
    }
    free(s->items);
    json_decref(s->echo);
}

/* The one content part of a message (output_text) or reasoning item (reasoning_text); its text
 * is empty until the item is done. */
static void json_part(moe_json *j, const out_item *it) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "type", it->kind == ITEM_MESSAGE ? "output_text" : "reasoning_text");
    moe_json_key(j, "text");
    moe_json_string_n(j, it->done && it->text.s ? it->text.s : "", it->done ? it->text.len : 0);
    if (it->kind == ITEM_MESSAGE) {
        moe_json_key(j, "annotations");
        moe_json_array_begin(j);
        moe_json_array_end(j);
    }
    moe_json_object_end(j);
}

static void json_item(moe_json *j, const out_item *it) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "id", it->id);
    moe_json_key(j, "type");
    if (it->kind == ITEM_MESSAGE) {
        moe_json_string(j, "message");
        moe_json_kv_string(j, "status", it->done ? "completed" : "in_progress");
        moe_json_kv_string(j, "role", "assistant");
        moe_json_key(j, "content");
        moe_json_array_begin(j);
        if (it->done) json_part(j, it);
        moe_json_array_end(j);
    } else if (it->kind == ITEM_REASONING) {
        moe_json_string(j, "reasoning");
        moe_json_key(j, "summary");
        moe_json_array_begin(j);
        moe_json_array_end(j);
        moe_json_key(j, "content");
        moe_json_array_begin(j);
        if (it->done) json_part(j, it);
        moe_json_array_end(j);
    } else {
        moe_json_string(j, "function_call");
        moe_json_kv_string(j, "status", it->done ? "completed" : "in_progress");
        moe_json_kv_string(j, "call_id", it->call_id);
        moe_json_kv_string(j, "name", it->name);
        moe_json_key(j, "arguments");
        moe_json_string_n(j, it->done && it->text.s ? it->text.s : "", it->done ? it->text.len : 0);
    }
    moe_json_object_end(j);
}

/* The response object; r NULL: still in progress (no usage yet). */
static void json_response(moe_json *j, rs_state *s, const serve_req *r) {
    const bool incomplete = r && r->finish == SERVE_FINISH_LENGTH;
    moe_json_object_begin(j);
    moe_json_kv_string(j, "id", s->answer.id);
    moe_json_kv_string(j, "object", "response");
    moe_json_kv_int(j, "created_at", s->answer.created);
    moe_json_kv_string(j, "status", !r ? "in_progress" : incomplete ? "incomplete" : "completed");
    moe_json_key(j, "error");
    moe_json_null(j);
    moe_json_key(j, "incomplete_details");
    if (incomplete) {
        moe_json_object_begin(j);
        moe_json_kv_string(j, "reason", "max_output_tokens");
        moe_json_object_end(j);
    } else {
        moe_json_null(j);
    }
    moe_json_kv_string(j, "model", s->answer.srv->model_id);
    moe_json_key(j, "output");
    moe_json_array_begin(j);
    for (size_t i = 0; r && i < s->n_items; i++) json_item(j, &s->items[i]);
    moe_json_array_end(j);
    moe_json_kv_bool(j, "parallel_tool_calls", true);
    moe_json_key(j, "previous_response_id");
    moe_json_null(j);
    moe_json_kv_bool(j, "store", false);
    moe_json_kv_string(j, "truncation", "disabled");
    const char *key;
    json_t *val;
    json_object_foreach(s->echo, key, val) {
        moe_json_key(j, key);
        serve_json_value(j, val);
    }
    moe_json_key(j, "usage");
    if (r) {
        moe_json_object_begin(j);
        moe_json_kv_uint(j, "input_tokens", r->gen.n_prompt);
        moe_json_key(j, "input_tokens_details");
        moe_json_object_begin(j);
        moe_json_kv_uint(j, "cached_tokens", r->n_cached);
        moe_json_kv_string(j, "cache_source", serve_cache_source_name(r->cached_from));
        moe_json_object_end(j);
        moe_json_kv_uint(j, "output_tokens", r->n_generated);
        moe_json_key(j, "output_tokens_details");
        moe_json_object_begin(j);
        moe_json_kv_uint(j, "reasoning_tokens", r->n_reasoning);
        moe_json_object_end(j);
        moe_json_kv_uint(j, "total_tokens", (uint64_t)r->gen.n_prompt + r->n_generated);
        moe_json_object_end(j);
    } else {
        moe_json_null(j);
    }
    moe_json_object_end(j);
}

/* stream events: {"type": TYPE, "sequence_number": N, ...}; the caller adds fields and ends */
static void ev_begin(rs_state *s, const char *type) {
    moe_json *j = &s->answer.sse->j;
    moe_json_object_begin(j);
    moe_json_kv_string(j, "type", type);
    moe_json_kv_uint(j, "sequence_number", s->seq++);
}

static void ev_end(rs_state *s, const char *type) {
    moe_json_object_end(&s->answer.sse->j);
    serve_sse_event(s->answer.sse, type);
}

static void ev_item_ref(rs_state *s, size_t index, bool content_index) {
    moe_json *j = &s->answer.sse->j;
    moe_json_kv_string(j, "item_id", s->items[index].id);
    moe_json_kv_uint(j, "output_index", index);
    if (content_index) {
        moe_json_kv_int(j, "content_index", 0);
    }
}

static void item_close(rs_state *s) {
    if (!s->n_items) return;
    out_item *it = &s->items[s->n_items - 1];
    if (it->done) return;
    it->done = true;
    if (!s->answer.sse) return;
    moe_json *j = &s->answer.sse->j;
    const size_t idx = s->n_items - 1;
    if (it->kind != ITEM_CALL) {
        const bool msg = it->kind == ITEM_MESSAGE;
        const char *done = msg ? "response.output_text.done" : "response.reasoning_text.done";
        ev_begin(s, done);
        ev_item_ref(s, idx, true);
        moe_json_key(j, "text");
        moe_json_string_n(j, it->text.s ? it->text.s : "", it->text.len);
        if (msg) {
            moe_json_key(j, "logprobs");
            moe_json_array_begin(j);
            moe_json_array_end(j);
        }
        ev_end(s, done);
        ev_begin(s, "response.content_part.done");
        ev_item_ref(s, idx, true);
        moe_json_key(j, "part");
        json_part(j, it);
        ev_end(s, "response.content_part.done");
    } else {
        ev_begin(s, "response.function_call_arguments.done");
        ev_item_ref(s, idx, false);
        moe_json_key(j, "arguments");
        moe_json_string_n(j, it->text.s ? it->text.s : "", it->text.len);
        ev_end(s, "response.function_call_arguments.done");
    }
    ev_begin(s, "response.output_item.done");
    moe_json_kv_uint(j, "output_index", idx);
    moe_json_key(j, "item");
    json_item(j, it);
    ev_end(s, "response.output_item.done");
}

/* name: a function call's (it is in the output_item.added event already); NULL otherwise */
static out_item *item_open(rs_state *s, item_kind kind, const char *name) {
    item_close(s);
    s->items = moe_xrealloc(s->items, (s->n_items + 1) * sizeof *s->items);
    out_item *it = &s->items[s->n_items++];
    memset(it, 0, sizeof *it);
    it->kind = kind;
    if (kind == ITEM_CALL) {
        it->name = moe_xstrdup(name);
        serve_make_id(s->answer.srv, "call_", it->call_id, sizeof it->call_id);
    }
    serve_make_id(s->answer.srv,
                  kind == ITEM_MESSAGE ? "msg_"
                  : kind == ITEM_CALL  ? "fc_"
                                       : "rs_",
                  it->id, sizeof it->id);
    if (!s->answer.sse) return it;
    moe_json *j = &s->answer.sse->j;
    ev_begin(s, "response.output_item.added");
    moe_json_kv_uint(j, "output_index", s->n_items - 1);
    moe_json_key(j, "item");
    json_item(j, it);
    ev_end(s, "response.output_item.added");
    if (kind != ITEM_CALL) {
        ev_begin(s, "response.content_part.added");
        ev_item_ref(s, s->n_items - 1, true);
        moe_json_key(j, "part");
        json_part(j, it);
        ev_end(s, "response.content_part.added");
    }
    return it;
}

static void on_segment(void *ud, const serve_segment *seg) {
    rs_state *s = ud;
    if (seg->kind == SERVE_SEG_TOOL_CALL) {
        out_item *it = item_open(s, ITEM_CALL, seg->name);
        moe_strbuf_puts(&it->text, seg->arguments);
        if (s->answer.sse) {
            ev_begin(s, "response.function_call_arguments.delta");
            ev_item_ref(s, s->n_items - 1, false);
            moe_json_kv_string(&s->answer.sse->j, "delta", seg->arguments);
            ev_end(s, "response.function_call_arguments.delta");
        }
        item_close(s);
        return;
    }
    if (!seg->len) return;
    const item_kind kind = seg->kind == SERVE_SEG_REASONING ? ITEM_REASONING : ITEM_MESSAGE;
    out_item *it = s->n_items ? &s->items[s->n_items - 1] : NULL;
    if (!it || it->done || it->kind != kind) it = item_open(s, kind, NULL);
    moe_strbuf_put(&it->text, seg->text, seg->len);
    if (!s->answer.sse) return;
    const char *type =
        kind == ITEM_MESSAGE ? "response.output_text.delta" : "response.reasoning_text.delta";
    ev_begin(s, type);
    ev_item_ref(s, s->n_items - 1, true);
    moe_json_key(&s->answer.sse->j, "delta");
    moe_json_string_n(&s->answer.sse->j, seg->text, seg->len);
    if (kind == ITEM_MESSAGE) {
        moe_json_key(&s->answer.sse->j, "logprobs");
        moe_json_array_begin(&s->answer.sse->j);
        moe_json_array_end(&s->answer.sse->j);
    }
    ev_end(s, type);
}

static void feed_events(void *ud, const serve_taken *t) {
    rs_state *s = ud;
    for (size_t i = 0; i < t->n_events; i++)
        serve_output_feed(&s->answer.out, t->text.s + t->events[i].text_off, t->events[i].text_len,
                          on_segment, s);
    if (t->done) {
        serve_output_finish(&s->answer.out, on_segment, s);
        if (!s->n_items) item_open(s, ITEM_MESSAGE, NULL); /* always a message, maybe empty */
        item_close(s);
    }
}

static void stream_begin(void *state, const serve_req *r) {
    (void)r;
    rs_state *s = state;
    moe_json *j = &s->answer.sse->j;
    ev_begin(s, "response.created");
    moe_json_key(j, "response");
    json_response(j, s, NULL);
    ev_end(s, "response.created");
    ev_begin(s, "response.in_progress");
    moe_json_key(j, "response");
    json_response(j, s, NULL);
    ev_end(s, "response.in_progress");
}

static void stream_error(void *state, const char *why) {
    rs_state *s = state;
    moe_json *j = &s->answer.sse->j;
    ev_begin(s, "error");
    moe_json_kv_string(j, "code", "server_error");
    moe_json_kv_string(j, "message", why);
    moe_json_key(j, "param");
    moe_json_null(j);
    ev_end(s, "error");
}

static void stream_end(void *state, const serve_req *r) {
    rs_state *s = state;
    const char *type =
        r->finish == SERVE_FINISH_LENGTH ? "response.incomplete" : "response.completed";
    ev_begin(s, type);
    moe_json_key(&s->answer.sse->j, "response");
    json_response(&s->answer.sse->j, s, r);
    ev_end(s, type);
}

static void json_whole(moe_json *j, void *state, const serve_req *r) {
    json_response(j, state, r);
}

static const serve_adapter responses_adapter = {
    .api = SERVE_API_OPENAI,
    .keepalive = ": keep-alive\n\n",
    .stream_begin = stream_begin,
    .feed = feed_events,
    .stream_end = stream_end,
    .stream_error = stream_error,
    .whole = json_whole,
    .clear = rs_state_clear,
};

static rs_state *rs_state_new(void) {
    rs_state *s = serve_answer_new(&responses_adapter, sizeof *s, "resp_");
    s->echo = json_object();
    return s;
}

void serve_responses_replay(serve_server *srv, const serve_chat *chat, const char *prompt,
                            const char *text, size_t chunk, bool stream, moe_strbuf *out) {
    serve_replay(&rs_state_new()->answer, srv, chat, prompt, text, chunk, stream, out);
}

void serve_openai_responses(serve_http *h) {
    json_t *body = serve_parse_body(h, SERVE_API_OPENAI);
    if (!body) return;
    serve_chat chat = {0};
    serve_req *req = serve_req_new();
    rs_state *s = rs_state_new();
    bool ok = true;
    json_t *prev = json_object_get(body, "previous_response_id");
    if (prev && !json_is_null(prev)) {
        serve_reply_error(h, SERVE_API_OPENAI, 400, "previous_response_id", NULL,
                          "previous_response_id: responses are not stored by this server; send "
                          "the whole conversation as input");
        ok = false;
    }
    json_t *mot = json_object_get(body, "max_output_tokens");
    if (ok && mot && !json_is_null(mot)) {
        if (!json_is_integer(mot) || json_integer_value(mot) < 1) {
            serve_reply_error(h, SERVE_API_OPENAI, 400, "max_output_tokens", NULL,
                              "max_output_tokens: expected an integer >= 1");
            ok = false;
        } else {
            req->gen.max_tokens = json_integer_value(mot);
        }
    }
    ok = ok && parse_input(h, body, &chat) && parse_tools(h, body, &chat) &&
         serve_parse_sampling(h, SERVE_API_OPENAI, body, &req->gen, NULL);
    if (ok) {
        static const char *const echoed[] = {"instructions", "max_output_tokens", "temperature",
                                             "top_p",        "tool_choice",       "tools",
                                             "metadata"};
        for (size_t i = 0; i < sizeof echoed / sizeof echoed[0]; i++) {
            json_t *v = json_object_get(body, echoed[i]);
            json_object_set(s->echo, echoed[i], v ? v : json_null());
        }
        if (json_is_null(json_object_get(s->echo, "tool_choice")))
            json_object_set_new(s->echo, "tool_choice", json_string("auto"));
        if (json_is_null(json_object_get(s->echo, "tools")))
            json_object_set_new(s->echo, "tools", json_array());
        if (json_is_null(json_object_get(s->echo, "metadata")))
            json_object_set_new(s->echo, "metadata", json_object());
    }
    char *prompt = NULL;
    ok = ok && serve_parse_template_kwargs(h, SERVE_API_OPENAI, body, &chat) &&
         serve_chat_prompt(h, SERVE_API_OPENAI, &chat, &req->gen, &prompt, NULL);
    const bool stream = json_is_true(json_object_get(body, "stream"));
    json_decref(body);
    serve_generate(h, &s->answer, req, &chat, prompt, ok, stream);
    free(prompt);
    serve_chat_free(&chat);
}
