/* prompt.c: conversations to prompt text, and model text back to content, reasoning and tool
 * calls -- the two seams the chat-template work (Jinja renderer, per-model parsers) replaces.
 *
 * Formatting: built-in styles chosen from the model's template text -- ChatML (also for a model
 * without a template, like `moe chat`), Llama-3 headers, and a plain "Role: text" fallback for
 * templates we do not recognise. Tools are described Hermes-style in the system turn and calls
 * are expected back as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
 * Parsing: a streaming splitter that holds back any bytes that may be the start of a marker, so
 * a marker cut across two tokens is still found. The trap: a tool call whose JSON does not
 * parse is given back as plain content, never dropped. */
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

void serve_chat_free(serve_chat *c) {
    for (size_t i = 0; i < c->n_msgs; i++) {
        serve_message *m = &c->msgs[i];
        free(m->role);
        free(m->content);
        free(m->reasoning);
        free(m->tool_call_id);
        free(m->name);
        for (size_t k = 0; k < m->n_tool_calls; k++) {
            free(m->tool_calls[k].id);
            free(m->tool_calls[k].name);
            free(m->tool_calls[k].arguments);
        }
        free(m->tool_calls);
    }
    free(c->msgs);
    json_decref(c->tools);
    memset(c, 0, sizeof *c);
}

/* ==== Formatting ==== */

serve_format serve_format_choose(const char *t) {
    serve_format f = {.style = SERVE_PROMPT_CHATML, .thinks = false};
    if (!t) return f;
    if (strstr(t, "<|start_header_id|>"))
        f.style = SERVE_PROMPT_LLAMA3;
    else if (strstr(t, "<|im_start|>"))
        f.style = SERVE_PROMPT_CHATML;
    else
        f.style = SERVE_PROMPT_PLAIN;
    f.thinks = strstr(t, "<think>") != NULL;
    return f;
}

const char *serve_prompt_style_name(serve_prompt_style s) {
    switch (s) {
    case SERVE_PROMPT_CHATML:
        return "chatml";
    case SERVE_PROMPT_LLAMA3:
        return "llama3";
    case SERVE_PROMPT_PLAIN:
        return "plain";
    }
    return "?";
}

static void tools_text(const serve_chat *chat, serve_buf *out) {
    serve_buf_puts(out, "# Tools\n\nYou may call one or more functions to assist with the user "
                        "query.\n\nYou are provided with function signatures within "
                        "<tools></tools> XML tags:\n<tools>");
    size_t i;
    json_t *tool;
    json_array_foreach(chat->tools, i, tool) {
        char *s = json_dumps(tool, 0); /* ", " and ": " like Jinja's tojson */
        if (!s) continue;
        serve_buf_puts(out, "\n");
        serve_buf_puts(out, s);
        free(s);
    }
    serve_buf_puts(out, "\n</tools>\n\nFor each function call, return a json object with function "
                        "name and arguments within <tool_call></tool_call> XML tags:\n"
                        "<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                        "<args-json-object>}\n</tool_call>");
}

typedef struct style_marks {
    const char *open_pre, *open_post, *close; /* turn = open_pre ROLE open_post TEXT close */
} style_marks;

static style_marks marks_of(serve_prompt_style s) {
    switch (s) {
    case SERVE_PROMPT_LLAMA3:
        return (style_marks){"<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>"};
    case SERVE_PROMPT_PLAIN:
        return (style_marks){"", ": ", "\n\n"};
    case SERVE_PROMPT_CHATML:
        break;
    }
    return (style_marks){"<|im_start|>", "\n", "<|im_end|>\n"};
}

static void turn_open(serve_buf *out, const style_marks *mk, serve_prompt_style st,
                      const char *role) {
    serve_buf_puts(out, mk->open_pre);
    if (st == SERVE_PROMPT_PLAIN) {
        /* "User", "Assistant", "System" */
        char r[32];
        snprintf(r, sizeof r, "%s", role);
        if (r[0] >= 'a' && r[0] <= 'z') r[0] = (char)(r[0] - 'a' + 'A');
        serve_buf_puts(out, r);
    } else {
        serve_buf_puts(out, role);
    }
    serve_buf_puts(out, mk->open_post);
}

void serve_format_prompt(const serve_format *f, const serve_chat *chat, serve_buf *out) {
    const style_marks mk = marks_of(f->style);
    const bool tools = chat->tools && json_array_size(chat->tools) && !chat->tool_choice_none;
    size_t i = 0;
    /* system turn: the first system message, plus the tool descriptions */
    if ((chat->n_msgs && strcmp(chat->msgs[0].role, "system") == 0) || tools) {
        turn_open(out, &mk, f->style, "system");
        if (chat->n_msgs && strcmp(chat->msgs[0].role, "system") == 0) {
            serve_buf_puts(out, chat->msgs[0].content ? chat->msgs[0].content : "");
            if (tools) serve_buf_puts(out, "\n\n");
            i = 1;
        }
        if (tools) tools_text(chat, out);
        serve_buf_puts(out, mk.close);
    }
    const char *tool_role = f->style == SERVE_PROMPT_LLAMA3 ? "ipython" : "user";
    for (; i < chat->n_msgs; i++) {
        const serve_message *m = &chat->msgs[i];
        if (strcmp(m->role, "tool") == 0) {
            /* consecutive tool results share one turn */
            const bool first = i == 0 || strcmp(chat->msgs[i - 1].role, "tool") != 0;
            const bool last = i + 1 == chat->n_msgs || strcmp(chat->msgs[i + 1].role, "tool") != 0;
            if (first)
                turn_open(out, &mk, f->style, tool_role);
            else
                serve_buf_puts(out, "\n");
            serve_buf_puts(out, "<tool_response>\n");
            serve_buf_puts(out, m->content ? m->content : "");
            serve_buf_puts(out, "\n</tool_response>");
            if (last) serve_buf_puts(out, mk.close);
            continue;
        }
        turn_open(out, &mk, f->style, m->role);
        serve_buf_puts(out, m->content ? m->content : "");
        for (size_t k = 0; k < m->n_tool_calls; k++) {
            const serve_tool_call *tc = &m->tool_calls[k];
            if ((m->content && m->content[0]) || k) serve_buf_puts(out, "\n");
            serve_buf_puts(out, "<tool_call>\n{\"name\": ");
            json_t *name = json_string(tc->name ? tc->name : "");
            char *qn = json_dumps(name, JSON_ENCODE_ANY | JSON_ENSURE_ASCII);
            serve_buf_puts(out, qn ? qn : "\"\"");
            free(qn);
            json_decref(name);
            serve_buf_puts(out, ", \"arguments\": ");
            serve_buf_puts(out, tc->arguments && tc->arguments[0] ? tc->arguments : "{}");
            serve_buf_puts(out, "}\n</tool_call>");
        }
        serve_buf_puts(out, mk.close);
    }
    turn_open(out, &mk, f->style, "assistant");
}

/* ==== Output parser ==== */

#define M_THINK_OPEN  "<think>"
#define M_THINK_CLOSE "</think>"
#define M_CALL_OPEN   "<tool_call>"
#define M_CALL_CLOSE  "</tool_call>"

void serve_parser_init(serve_parser *p, bool tools, bool think_markers, bool starts_in_reasoning) {
    memset(p, 0, sizeof *p);
    p->tools = tools;
    p->think_markers = think_markers;
    p->reasoning = starts_in_reasoning;
}

void serve_parser_free(serve_parser *p) {
    serve_buf_free(&p->hold);
    serve_buf_free(&p->call);
}

static void seg_text(serve_parser *p, const char *s, size_t n, serve_segment_fn fn, void *ud) {
    if (!n) return;
    serve_segment seg = {
        .kind = p->reasoning ? SERVE_SEG_REASONING : SERVE_SEG_CONTENT, .text = s, .len = n};
    fn(ud, &seg);
}

/* A complete call body: {"name": ..., "arguments": ...}; content when it does not parse. */
static void seg_call(serve_parser *p, const char *body, size_t n, bool closed, serve_segment_fn fn,
                     void *ud) {
    json_error_t jerr;
    json_t *v = serve_json_depth(body, n) <= SERVE_MAX_CALL_DEPTH
                    ? json_loadb(body, n, JSON_DECODE_ANY, &jerr)
                    : NULL;
    json_t *name = v ? json_object_get(v, "name") : NULL;
    if (json_is_string(name)) {
        json_t *args = json_object_get(v, "arguments");
        if (!args) args = json_object_get(v, "parameters");
        char *a = NULL;
        if (json_is_string(args))
            a = moe_xstrdup(json_string_value(args));
        else
            a = args ? json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY) : moe_xstrdup("{}");
        serve_segment seg = {.kind = SERVE_SEG_TOOL_CALL,
                             .name = json_string_value(name),
                             .arguments = a ? a : "{}"};
        fn(ud, &seg);
        free(a);
    } else {
        const bool was = p->reasoning;
        p->reasoning = false;
        seg_text(p, M_CALL_OPEN, strlen(M_CALL_OPEN), fn, ud);
        seg_text(p, body, n, fn, ud);
        if (closed) seg_text(p, M_CALL_CLOSE, strlen(M_CALL_CLOSE), fn, ud);
        p->reasoning = was;
    }
    json_decref(v);
}

/* Longest suffix of s that is a proper prefix of marker m. */
static size_t partial(const char *s, size_t n, const char *m) {
    const size_t ml = strlen(m);
    for (size_t k = ml - 1 < n ? ml - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, m, k) == 0) return k;
    return 0;
}

void serve_parser_push(serve_parser *p, const char *text, size_t len, serve_segment_fn fn,
                       void *ud) {
    if (p->state == 1)
        serve_buf_put(&p->call, text, len);
    else
        serve_buf_put(&p->hold, text, len);
    for (;;) {
        if (p->state == 1) {
            const char *end =
                p->call.len ? memmem(p->call.p, p->call.len, M_CALL_CLOSE, strlen(M_CALL_CLOSE))
                            : NULL;
            if (!end) return;
            const size_t body = (size_t)(end - p->call.p);
            const size_t after = body + strlen(M_CALL_CLOSE);
            seg_call(p, p->call.p, body, true, fn, ud);
            /* what follows the call goes back through the text state */
            p->hold.len = 0;
            serve_buf_put(&p->hold, p->call.p + after, p->call.len - after);
            p->call.len = 0;
            p->state = 0;
            continue;
        }
        /* text: the markers that can start here */
        const char *marks[3];
        int n_marks = 0;
        if (p->reasoning)
            marks[n_marks++] = M_THINK_CLOSE;
        else {
            if (p->think_markers) marks[n_marks++] = M_THINK_OPEN;
            if (p->tools) marks[n_marks++] = M_CALL_OPEN;
        }
        const char *hit = NULL;
        int which = -1;
        for (int m = 0; m < n_marks; m++) {
            const char *at =
                p->hold.len ? memmem(p->hold.p, p->hold.len, marks[m], strlen(marks[m])) : NULL;
            if (at && (!hit || at < hit)) {
                hit = at;
                which = m;
            }
        }
        if (hit) {
            const size_t before = (size_t)(hit - p->hold.p);
            const size_t after = before + strlen(marks[which]);
            seg_text(p, p->hold.p, before, fn, ud);
            const char *mk = marks[which];
            serve_buf rest = {0};
            serve_buf_put(&rest, p->hold.p + after, p->hold.len - after);
            serve_buf_free(&p->hold);
            if (strcmp(mk, M_CALL_OPEN) == 0) {
                p->state = 1;
                p->call.len = 0;
                serve_buf_put(&p->call, rest.p, rest.len);
                serve_buf_free(&rest);
            } else {
                p->reasoning = strcmp(mk, M_THINK_OPEN) == 0;
                p->hold = rest;
            }
            continue;
        }
        size_t keep = 0;
        for (int m = 0; m < n_marks; m++) {
            const size_t k = partial(p->hold.p ? p->hold.p : "", p->hold.len, marks[m]);
            if (k > keep) keep = k;
        }
        const size_t out = p->hold.len - keep;
        seg_text(p, p->hold.p, out, fn, ud);
        if (out) {
            memmove(p->hold.p, p->hold.p + out, keep);
            p->hold.len = keep;
        }
        return;
    }
}

void serve_parser_finish(serve_parser *p, serve_segment_fn fn, void *ud) {
    if (p->state == 1) {
        seg_call(p, p->call.p ? p->call.p : "", p->call.len, false, fn, ud);
        p->call.len = 0;
        p->state = 0;
    }
    seg_text(p, p->hold.p, p->hold.len, fn, ud);
    p->hold.len = 0;
}
