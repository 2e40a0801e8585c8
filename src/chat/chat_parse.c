/* chat_parse: what a model writes, split into reasoning, content and tool calls -- incrementally,
 * so a server can stream the parts as they settle.
 *
 * One engine serves every format: plain text is content; a reasoning tag switches to reasoning
 * until its closing tag; a tool-call block is buffered from its opening marker to its closing
 * one (or to the end of output for formats without one) and then parsed by the format's block
 * parser. gpt-oss's harmony channels have their own small state machine beside it. Text that
 * could be the start of a marker is held back until the next bytes decide, so feeding the output
 * in any chunks gives the same result as feeding it whole. Arguments written as text (XML-ish
 * formats) are typed by the tool's JSON schema: a "string" parameter stays raw, others are
 * decoded as JSON when they parse. The trap: a block that does not parse is not an error -- a
 * model may write "<tool_call>" in prose -- so its raw text goes back to the content. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"

/* ==== Formats ==== */

static const char *const format_names[MOE_CHAT_FORMAT_COUNT] = {
    [MOE_CHAT_FORMAT_HERMES] = "hermes",
    [MOE_CHAT_FORMAT_QWEN3_CODER] = "qwen3-coder",
    [MOE_CHAT_FORMAT_GLM] = "glm",
    [MOE_CHAT_FORMAT_MINIMAX_M2] = "minimax-m2",
    [MOE_CHAT_FORMAT_DEEPSEEK_V3] = "deepseek-v3",
    [MOE_CHAT_FORMAT_DEEPSEEK_V31] = "deepseek-v3.1",
    [MOE_CHAT_FORMAT_DSML] = "dsml",
    [MOE_CHAT_FORMAT_KIMI_K2] = "kimi-k2",
    [MOE_CHAT_FORMAT_LLAMA3] = "llama3",
    [MOE_CHAT_FORMAT_MISTRAL] = "mistral",
    [MOE_CHAT_FORMAT_HARMONY] = "harmony",
    [MOE_CHAT_FORMAT_GEMMA4] = "gemma4",
};

const char *moe_chat_format_name(moe_chat_format f) {
    return (unsigned)f < MOE_CHAT_FORMAT_COUNT ? format_names[f] : "unknown";
}

bool moe_chat_format_from_name(const char *name, moe_chat_format *out) {
    for (int i = 0; i < MOE_CHAT_FORMAT_COUNT; i++)
        if (!strcmp(format_names[i], name)) {
            *out = (moe_chat_format)i;
            return true;
        }
    return false;
}

/* Markers, in UTF-8 as the tokenizers spell them. */
#define DS_CALLS_BEGIN                                                                             \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "begin\xef\xbd\x9c>"
#define DS_CALLS_END                                                                               \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN                                                                              \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "begin\xef\xbd\x9c>"
#define DS_CALL_END                                                                                \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>"
#define DSML                                                                                       \
    "\xef\xbd\x9c"                                                                                 \
    "DSML\xef\xbd\x9c" /* ｜DSML｜ */

typedef struct block_marker {
    const char *open, *close; /* close NULL: the block runs to the end of the output */
} block_marker;

static const block_marker markers_tool_call[] = {{"<tool_call>", "</tool_call>"}, {NULL, NULL}};
static const block_marker markers_qwen3_coder[] = {
    {"<tool_call>", "</tool_call>"}, {"<function=", "</function>"}, {NULL, NULL}};
static const block_marker markers_minimax[] = {{"<minimax:tool_call>", "</minimax:tool_call>"},
                                               {NULL, NULL}};
static const block_marker markers_deepseek[] = {{DS_CALLS_BEGIN, DS_CALLS_END}, {NULL, NULL}};
static const block_marker markers_dsml[] = {
    {"<" DSML "function_calls>", "</" DSML "function_calls>"},
    {"<" DSML "tool_calls>", "</" DSML "tool_calls>"},
    {NULL, NULL}};
static const block_marker markers_kimi[] = {
    {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"}, {NULL, NULL}};
static const block_marker markers_llama3[] = {{"<|python_tag|>", NULL}, {NULL, NULL}};
static const block_marker markers_mistral[] = {{"[TOOL_CALLS]", NULL}, {NULL, NULL}};
static const block_marker markers_gemma4[] = {{"<|tool_call>", "<tool_call|>"}, {NULL, NULL}};
static const block_marker markers_none[] = {{NULL, NULL}};

static const block_marker *format_markers(moe_chat_format f) {
    switch (f) {
    case MOE_CHAT_FORMAT_HERMES:
    case MOE_CHAT_FORMAT_GLM:
        return markers_tool_call;
    case MOE_CHAT_FORMAT_QWEN3_CODER:
        return markers_qwen3_coder;
    case MOE_CHAT_FORMAT_MINIMAX_M2:
        return markers_minimax;
    case MOE_CHAT_FORMAT_DEEPSEEK_V3:
    case MOE_CHAT_FORMAT_DEEPSEEK_V31:
        return markers_deepseek;
    case MOE_CHAT_FORMAT_DSML:
        return markers_dsml;
    case MOE_CHAT_FORMAT_KIMI_K2:
        return markers_kimi;
    case MOE_CHAT_FORMAT_LLAMA3:
        return markers_llama3;
    case MOE_CHAT_FORMAT_MISTRAL:
        return markers_mistral;
    case MOE_CHAT_FORMAT_GEMMA4:
        return markers_gemma4;
    default:
        return markers_none;
    }
}

/* ==== How a call is written, for forcing one (grammar.c) ==== */

#define GEMMA4_QUOTE "<|\"|>" /* strings are <|"|>text<|"|>, with no escapes */

bool moe_chat_call_shape_of(moe_chat_format f, moe_chat_call_shape *out) {
    switch (f) {
    case MOE_CHAT_FORMAT_HERMES:
        *out = (moe_chat_call_shape){.open = "<tool_call>\n{\"name\": ",
                                     .mid = ", \"arguments\": ",
                                     .close = "}\n</tool_call>",
                                     .name_json = true};
        return true;
    case MOE_CHAT_FORMAT_LLAMA3:
        *out = (moe_chat_call_shape){
            .open = "{\"name\": ", .mid = ", \"parameters\": ", .close = "}", .name_json = true};
        return true;
    case MOE_CHAT_FORMAT_MISTRAL:
        *out = (moe_chat_call_shape){.open = "[TOOL_CALLS][{\"name\": ",
                                     .mid = ", \"arguments\": ",
                                     .close = "}]",
                                     .name_json = true};
        return true;
    case MOE_CHAT_FORMAT_DEEPSEEK_V3:
        *out = (moe_chat_call_shape){.open = DS_CALLS_BEGIN DS_CALL_BEGIN "function" DS_SEP,
                                     .mid = "\n```json\n",
                                     .close = "\n```" DS_CALL_END DS_CALLS_END};
        return true;
    case MOE_CHAT_FORMAT_DEEPSEEK_V31:
        *out = (moe_chat_call_shape){
            .open = DS_CALLS_BEGIN DS_CALL_BEGIN, .mid = DS_SEP, .close = DS_CALL_END DS_CALLS_END};
        return true;
    case MOE_CHAT_FORMAT_KIMI_K2:
        *out = (moe_chat_call_shape){
            .open = "<|tool_calls_section_begin|><|tool_call_begin|>functions.",
            .mid = ":0<|tool_call_argument_begin|>",
            .close = "<|tool_call_end|><|tool_calls_section_end|>"};
        return true;
    case MOE_CHAT_FORMAT_HARMONY: /* after the prompt's <|start|>assistant */
        *out = (moe_chat_call_shape){.open = "<|channel|>commentary to=functions.",
                                     .mid = " <|constrain|>json<|message|>",
                                     .close = "<|call|>"};
        return true;
    case MOE_CHAT_FORMAT_QWEN3_CODER:
        *out = (moe_chat_call_shape){.open = "<tool_call>\n<function=",
                                     .mid = ">\n",
                                     .close = "</function>\n</tool_call>",
                                     .key_open = "<parameter=",
                                     .key_mid = ">\n",
                                     .key_close = "\n</parameter>\n"};
        break;
    case MOE_CHAT_FORMAT_GLM:
        *out = (moe_chat_call_shape){.open = "<tool_call>",
                                     .mid = "\n",
                                     .close = "</tool_call>",
                                     .key_open = "<arg_key>",
                                     .key_mid = "</arg_key>\n<arg_value>",
                                     .key_close = "</arg_value>\n"};
        break;
    case MOE_CHAT_FORMAT_MINIMAX_M2:
        *out = (moe_chat_call_shape){.open = "<minimax:tool_call>\n<invoke name=\"",
                                     .mid = "\">\n",
                                     .close = "</invoke>\n</minimax:tool_call>",
                                     .key_open = "<parameter name=\"",
                                     .key_mid = "\">",
                                     .key_close = "</parameter>\n"};
        break;
    case MOE_CHAT_FORMAT_DSML:
        *out = (moe_chat_call_shape){.open = "<" DSML "function_calls>\n<" DSML "invoke name=\"",
                                     .mid = "\">\n",
                                     .close = "</" DSML "invoke>\n</" DSML "function_calls>",
                                     .key_open = "<" DSML "parameter name=\"",
                                     .key_mid = "\" string=\"false\">",
                                     .key_mid_string = "\" string=\"true\">",
                                     .key_close = "</" DSML "parameter>\n"};
        break;
    case MOE_CHAT_FORMAT_GEMMA4:
        *out = (moe_chat_call_shape){.open = "<|tool_call>call:",
                                     .mid = "{",
                                     .close = "}<tool_call|>",
                                     .key_open = "",
                                     .key_mid = ":",
                                     .key_close = "",
                                     .sep = ",",
                                     .str_open = GEMMA4_QUOTE,
                                     .str_close = GEMMA4_QUOTE,
                                     .raw_stop = '|'};
        return true;
    default:
        return false;
    }
    /* the XML-ish formats */
    out->sep = out->str_open = out->str_close = "";
    out->raw_stop = '/';
    out->nested_json = true;
    return true;
}

/* ==== Detection from the template ==== */

void moe_chat_parse_options_detect(const char *src, const char *prompt, moe_chat_parse_options *o) {
    *o = (moe_chat_parse_options){.format = MOE_CHAT_FORMAT_HERMES};
    if (!src) src = "";
    if (strstr(src, "<|channel|>") && strstr(src, "<|start|>"))
        o->format = MOE_CHAT_FORMAT_HARMONY;
    else if (strstr(src, "<|tool_call>call:"))
        o->format = MOE_CHAT_FORMAT_GEMMA4;
    else if (strstr(src, DSML))
        o->format = MOE_CHAT_FORMAT_DSML;
    else if (strstr(src, "<|tool_call_begin|>"))
        o->format = MOE_CHAT_FORMAT_KIMI_K2;
    else if (strstr(src, DS_CALL_BEGIN))
        o->format =
            strstr(src, "```json") ? MOE_CHAT_FORMAT_DEEPSEEK_V3 : MOE_CHAT_FORMAT_DEEPSEEK_V31;
    else if (strstr(src, "<minimax:tool_call>"))
        o->format = MOE_CHAT_FORMAT_MINIMAX_M2;
    else if (strstr(src, "<arg_key>"))
        o->format = MOE_CHAT_FORMAT_GLM;
    else if (strstr(src, "<function=") && strstr(src, "<parameter="))
        o->format = MOE_CHAT_FORMAT_QWEN3_CODER;
    else if (strstr(src, "[TOOL_CALLS]"))
        o->format = MOE_CHAT_FORMAT_MISTRAL;
    else if (strstr(src, "<|python_tag|>") ||
             (strstr(src, "<|start_header_id|>") && strstr(src, "\"parameters\"")))
        o->format = MOE_CHAT_FORMAT_LLAMA3;

    if (o->format == MOE_CHAT_FORMAT_HARMONY) {
        /* reasoning is the analysis channel */
    } else if (o->format == MOE_CHAT_FORMAT_GEMMA4) { /* the thought channel */
        o->think_open = "<|channel>thought";
        o->think_close = "<channel|>";
    } else if (strstr(src, "<seed:think>")) {
        o->think_open = "<seed:think>";
        o->think_close = "</seed:think>";
    } else if (strstr(src, "[THINK]")) {
        o->think_open = "[THINK]";
        o->think_close = "[/THINK]";
    } else if (strstr(src, "<think>") || strstr(src, "</think>")) {
        o->think_open = "<think>";
        o->think_close = "</think>";
    }
    if (prompt && o->think_open) {
        size_t n = strlen(prompt), k = strlen(o->think_open);
        while (n && (prompt[n - 1] == '\n' || prompt[n - 1] == ' ')) n--;
        o->reasoning_open = n >= k && memcmp(prompt + n - k, o->think_open, k) == 0;
    }
}

/* ==== Small text helpers over (pointer, length) ==== */

static const char *find(const char *h, size_t hn, const char *needle) {
    size_t nn = strlen(needle);
    if (nn == 0) return h;
    if (hn < nn) return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == needle[0] && memcmp(h + i, needle, nn) == 0) return h + i;
    return NULL;
}

static bool starts(const char *s, size_t n, const char *prefix) {
    size_t k = strlen(prefix);
    return n >= k && memcmp(s, prefix, k) == 0;
}

static void trim(const char **s, size_t *n) {
    while (*n && strchr(" \t\r\n", (*s)[0])) {
        (*s)++;
        (*n)--;
    }
    while (*n && strchr(" \t\r\n", (*s)[*n - 1])) (*n)--;
}

/* Longest suffix of s that is a proper prefix of marker. */
static size_t partial_suffix(const char *s, size_t n, const char *marker) {
    size_t m = strlen(marker);
    size_t k = m - 1 < n ? m - 1 : n;
    for (; k > 0; k--)
        if (memcmp(s + n - k, marker, k) == 0) return k;
    return 0;
}

/* ==== Deltas ==== */

static void append(char **dst, size_t *len, const char *s, size_t n) {
    if (!n) return;
    *dst = moe_xrealloc(*dst, *len + n + 1);
    memcpy(*dst + *len, s, n);
    *len += n;
    (*dst)[*len] = '\0';
}

/* Note that n more bytes of `kind` (or one more call) came, merging with the run before. */
static void note_part(moe_chat_delta *d, char kind, size_t n) {
    if (!n) return;
    if (d->n_parts && d->parts[d->n_parts - 1].kind == kind && kind != 't') {
        d->parts[d->n_parts - 1].len += n;
        return;
    }
    d->parts = moe_xrealloc(d->parts, (d->n_parts + 1) * sizeof *d->parts);
    d->parts[d->n_parts++] = (moe_chat_delta_part){kind, n};
}

void moe_chat_delta_clear(moe_chat_delta *d) {
    free(d->parts);
    free(d->content);
    free(d->reasoning);
    for (size_t i = 0; i < d->n_calls; i++) {
        free(d->calls[i].name);
        free(d->calls[i].arguments);
    }
    free(d->calls);
    *d = (moe_chat_delta){0};
}

/* ==== Parser state ==== */

typedef enum mode {
    MODE_CONTENT,
    MODE_REASONING,
    MODE_BLOCK,        /* inside a tool-call block, waiting for its end */
    MODE_HARMONY_HEAD, /* harmony: before <|message|> */
    MODE_HARMONY_BODY, /* harmony: message text until <|end|>, <|call|> or <|return|> */
} mode;

struct moe_chat_parser {
    moe_chat_format format;
    char *think_open, *think_close;
    json_t *tools;
    const block_marker *markers;
    char *in; /* unsettled input */
    size_t len, cap;
    mode mode;
    const block_marker *block; /* MODE_BLOCK: which one (open == "" for a bare Llama-3 JSON) */
    bool seen_text;            /* something other than whitespace has been settled */
    int harmony_kind;          /* 0 content, 1 reasoning, 2 tool call */
    char *harmony_recipient;   /* the tool name of a commentary message */
};

static const block_marker bare_json = {"", NULL};

moe_chat_parser *moe_chat_parser_new(const moe_chat_parse_options *o, moe_error *err) {
    if ((unsigned)o->format >= MOE_CHAT_FORMAT_COUNT) {
        moe_error_set(err, MOE_ERR_ARG, "unknown tool-call format %d", (int)o->format);
        return NULL;
    }
    if (!o->think_open != !o->think_close ||
        (o->think_open && (!o->think_open[0] || !o->think_close[0]))) {
        moe_error_set(err, MOE_ERR_ARG, "reasoning tags must both be given and non-empty");
        return NULL;
    }
    json_t *tools = NULL;
    if (o->tools_json) {
        json_error_t je;
        tools = json_loads(o->tools_json, JSON_DECODE_ANY, &je);
        if (!tools) {
            moe_error_set(err, MOE_ERR_ARG, "tools: invalid JSON at line %d column %d: %s", je.line,
                          je.column, je.text);
            return NULL;
        }
    }
    moe_chat_parser *p = moe_xcalloc(1, sizeof *p);
    p->format = o->format;
    p->think_open = o->think_open ? moe_xstrdup(o->think_open) : NULL;
    p->think_close = o->think_close ? moe_xstrdup(o->think_close) : NULL;
    p->tools = tools;
    p->markers = o->no_tool_calls ? markers_none : format_markers(o->format);
    p->mode = o->format == MOE_CHAT_FORMAT_HARMONY ? MODE_HARMONY_HEAD
              : o->reasoning_open && p->think_open ? MODE_REASONING
                                                   : MODE_CONTENT;
    return p;
}

void moe_chat_parser_free(moe_chat_parser *p) {
    if (!p) return;
    free(p->think_open);
    free(p->think_close);
    json_decref(p->tools);
    free(p->in);
    free(p->harmony_recipient);
    free(p);
}

static void consume(moe_chat_parser *p, size_t n) {
    if (!n) return; /* p->in may still be NULL */
    memmove(p->in, p->in + n, p->len - n);
    p->len -= n;
}

static void emit_content(moe_chat_parser *p, moe_chat_delta *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\r\n", s[i])) p->seen_text = true;
    append(&d->content, &d->content_len, s, n);
    note_part(d, 'c', n);
}

static void emit_reasoning(moe_chat_delta *d, const char *s, size_t n) {
    append(&d->reasoning, &d->reasoning_len, s, n);
    note_part(d, 'r', n);
}

static void emit_call(moe_chat_delta *d, const char *name, size_t name_len, json_t *args) {
    d->calls = moe_xrealloc(d->calls, (d->n_calls + 1) * sizeof *d->calls);
    moe_chat_tool_call *c = &d->calls[d->n_calls++];
    c->name = moe_xstrndup(name, name_len);
    c->arguments = json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!c->arguments) c->arguments = moe_xstrdup("{}");
    note_part(d, 't', 1);
}

/* ==== Arguments typed by schema ==== */

const char *moe_chat_schema_type(const json_t *schema) {
    json_t *type = json_object_get(schema, "type");
    if (json_is_string(type)) return json_string_value(type);
    if (json_is_array(type)) { /* ["string", "null"]: string wins, else the first non-null */
        const char *first = NULL;
        size_t k;
        json_t *ty;
        json_array_foreach(type, k, ty) {
            const char *s = json_string_value(ty);
            if (!s) continue;
            if (!strcmp(s, "string")) return "string";
            if (!first && strcmp(s, "null")) first = s;
        }
        return first;
    }
    return NULL; /* enum without type, anyOf, ...: decode as JSON when it parses */
}

/* The JSON-schema type of parameter `key` of tool `name`, or NULL when unknown. */
static const char *param_type(const moe_chat_parser *p, const char *name, size_t name_len,
                              const char *key) {
    if (!json_is_array(p->tools)) return NULL;
    size_t i;
    json_t *t;
    json_array_foreach(p->tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        if (!fn) fn = t;
        const char *fname = json_string_value(json_object_get(fn, "name"));
        if (!fname || strlen(fname) != name_len || memcmp(fname, name, name_len)) continue;
        return moe_chat_schema_type(
            json_object_get(json_object_get(json_object_get(fn, "parameters"), "properties"), key));
    }
    return NULL;
}

static json_t *typed_value(const char *type, const char *s, size_t n, bool force_string) {
    if (force_string || (type && !strcmp(type, "string"))) return json_stringn(s, n);
    if (type && !strcmp(type, "boolean")) { /* templates print Python's True/False too */
        if ((n == 4 && !memcmp(s, "True", 4)) || (n == 4 && !memcmp(s, "true", 4)))
            return json_true();
        if ((n == 5 && !memcmp(s, "False", 5)) || (n == 5 && !memcmp(s, "false", 5)))
            return json_false();
    }
    if (n == 4 && !memcmp(s, "None", 4) && type && strcmp(type, "string")) return json_null();
    json_t *j = json_loadb(s, n, JSON_DECODE_ANY, NULL);
    return j ? j : json_stringn(s, n);
}

static void add_param(const moe_chat_parser *p, json_t *args, const char *fname, size_t fname_len,
                      const char *key, size_t key_len, const char *val, size_t val_len,
                      bool force_string) {
    char *k = moe_xstrndup(key, key_len);
    json_object_set_new(
        args, k, typed_value(param_type(p, fname, fname_len, k), val, val_len, force_string));
    free(k);
}

/* A JSON object (or a string holding one) as arguments; NULL when it is neither. */
static json_t *json_arguments(json_t *v) {
    if (json_is_object(v)) return json_incref(v);
    if (json_is_string(v)) {
        json_t *j = json_loads(json_string_value(v), 0, NULL);
        if (json_is_object(j)) return j;
        json_decref(j);
    }
    return NULL;
}

/* ==== Block parsers: raw text of one block (markers included) -> calls; false if malformed ==== */

typedef bool (*block_parser)(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d);

/* {"name": .., "arguments"|"parameters": {..}} */
static bool call_from_json_object(json_t *o, moe_chat_delta *d) {
    const char *name = json_string_value(json_object_get(o, "name"));
    if (!name) {
        json_t *fn = json_object_get(o, "function");
        name = json_string_value(json_object_get(fn, "name"));
        if (name) o = fn;
    }
    if (!name) return false;
    json_t *args = json_object_get(o, "arguments");
    if (!args) args = json_object_get(o, "parameters");
    json_t *a = args ? json_arguments(args) : json_object();
    if (!a) return false;
    emit_call(d, name, strlen(name), a);
    json_decref(a);
    return true;
}

static bool parse_hermes(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    const char *a = memchr(s, '{', n);
    const char *b = NULL;
    for (size_t i = n; i > 0; i--)
        if (s[i - 1] == '}') {
            b = s + i;
            break;
        }
    if (!a || !b || b <= a) return false;
    json_t *o = json_loadb(a, (size_t)(b - a), 0, NULL);
    bool ok = json_is_object(o) && call_from_json_object(o, d);
    json_decref(o);
    return ok;
}

/* <function=NAME> <parameter=KEY>\nVALUE\n</parameter> ... </function> (one or more) */
static bool parse_qwen3_coder(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    const char *end = s + n, *f;
    size_t before = d->n_calls;
    while ((f = find(s, (size_t)(end - s), "<function="))) {
        const char *name = f + 10, *gt = memchr(name, '>', (size_t)(end - name));
        if (!gt) return false;
        const char *fend = find(gt, (size_t)(end - gt), "</function>");
        if (!fend) fend = end;
        json_t *args = json_object();
        const char *q = gt + 1, *pp;
        while ((pp = find(q, (size_t)(fend - q), "<parameter="))) {
            const char *key = pp + 11, *kgt = memchr(key, '>', (size_t)(fend - key));
            if (!kgt) break;
            const char *val = kgt + 1, *vend = find(val, (size_t)(fend - val), "</parameter>");
            const char *next = vend ? vend + 12 : fend;
            if (!vend) { /* tolerate a missing close: up to the next parameter */
                vend = find(val, (size_t)(fend - val), "<parameter=");
                if (!vend) vend = fend;
                next = vend;
            }
            size_t vn = (size_t)(vend - val);
            if (vn && val[0] == '\n') val++, vn--;
            if (vn && val[vn - 1] == '\n') vn--;
            add_param(p, args, name, (size_t)(gt - name), key, (size_t)(kgt - key), val, vn, false);
            q = next;
        }
        emit_call(d, name, (size_t)(gt - name), args);
        json_decref(args);
        s = fend < end ? fend + 11 : end;
        if (s > end) s = end;
    }
    return d->n_calls > before;
}

/* <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call> */
static bool parse_glm(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    const char *end = s + n;
    if (starts(s, n, "<tool_call>")) s += 11;
    const char *close = find(s, (size_t)(end - s), "</tool_call>");
    if (close) end = close;
    const char *first = find(s, (size_t)(end - s), "<arg_key>");
    const char *name = s;
    size_t name_len = (size_t)((first ? first : end) - s);
    trim(&name, &name_len);
    if (!name_len) return false;
    json_t *args = json_object();
    const char *q = first;
    while (q && q < end) {
        const char *k = q + 9, *kend = find(k, (size_t)(end - k), "</arg_key>");
        if (!kend) break;
        const char *v = find(kend, (size_t)(end - kend), "<arg_value>");
        if (!v) break;
        v += 11;
        const char *vend = find(v, (size_t)(end - v), "</arg_value>");
        if (!vend) vend = end;
        const char *key = k;
        size_t key_len = (size_t)(kend - k);
        trim(&key, &key_len);
        add_param(p, args, name, name_len, key, key_len, v, (size_t)(vend - v), false);
        q = vend < end ? find(vend, (size_t)(end - vend), "<arg_key>") : NULL;
    }
    emit_call(d, name, name_len, args);
    json_decref(args);
    return true;
}

/* <invoke name="NAME"><parameter name="K" [string="true"]>V</parameter>...</invoke>, with tag
 * names prefixed (DSML) or not (MiniMax) */
static bool parse_invokes(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d,
                          const char *invoke_open, const char *invoke_close, const char *param_open,
                          const char *param_close) {
    const char *end = s + n, *iv;
    size_t before = d->n_calls;
    size_t io = strlen(invoke_open), po = strlen(param_open), pc = strlen(param_close);
    while ((iv = find(s, (size_t)(end - s), invoke_open))) {
        const char *name = iv + io, *q = memchr(name, '"', (size_t)(end - name));
        if (!q) return false;
        size_t name_len = (size_t)(q - name);
        const char *iend = find(q, (size_t)(end - q), invoke_close);
        if (!iend) iend = end;
        json_t *args = json_object();
        const char *pp;
        const char *cur = q;
        while ((pp = find(cur, (size_t)(iend - cur), param_open))) {
            const char *key = pp + po, *kq = memchr(key, '"', (size_t)(iend - key));
            if (!kq) break;
            const char *gt = memchr(kq, '>', (size_t)(iend - kq));
            if (!gt) break;
            bool is_string = find(kq, (size_t)(gt - kq), "string=\"true\"") != NULL;
            bool typed = find(kq, (size_t)(gt - kq), "string=\"false\"") != NULL;
            const char *val = gt + 1, *vend = find(val, (size_t)(iend - val), param_close);
            if (!vend) vend = iend;
            size_t vn = (size_t)(vend - val);
            if (typed) {
                json_t *j = json_loadb(val, vn, JSON_DECODE_ANY, NULL);
                char *k = moe_xstrndup(key, (size_t)(kq - key));
                json_object_set_new(args, k, j ? j : json_stringn(val, vn));
                free(k);
            } else {
                add_param(p, args, name, name_len, key, (size_t)(kq - key), val, vn, is_string);
            }
            cur = vend < iend ? vend + pc : iend;
        }
        emit_call(d, name, name_len, args);
        json_decref(args);
        s = iend < end ? iend + strlen(invoke_close) : end;
    }
    return d->n_calls > before;
}

static bool parse_minimax(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    return parse_invokes(p, s, n, d, "<invoke name=\"", "</invoke>", "<parameter name=\"",
                         "</parameter>");
}

static bool parse_dsml(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    return parse_invokes(p, s, n, d, "<" DSML "invoke name=\"", "</" DSML "invoke>",
                         "<" DSML "parameter name=\"", "</" DSML "parameter>");
}

/* <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜> (V3.1), or
 * <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{..}\n```<｜tool▁call▁end｜> (V3, R1)
 */
static bool parse_deepseek(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    const char *end = s + n, *c;
    size_t before = d->n_calls;
    size_t cb = strlen(DS_CALL_BEGIN), sep = strlen(DS_SEP), ce = strlen(DS_CALL_END);
    while ((c = find(s, (size_t)(end - s), DS_CALL_BEGIN))) {
        const char *head = c + cb, *sp = find(head, (size_t)(end - head), DS_SEP);
        if (!sp) return false;
        const char *body = sp + sep, *cend = find(body, (size_t)(end - body), DS_CALL_END);
        if (!cend) cend = end;
        const char *name = head, *args = body;
        size_t name_len = (size_t)(sp - head), args_len = (size_t)(cend - body);
        const char *fence = find(body, args_len, "```json");
        if (fence) { /* V3: the name follows the separator, the arguments are fenced */
            name = body;
            name_len = (size_t)(fence - body);
            args = fence + 7;
            const char *close = find(args, (size_t)(cend - args), "```");
            args_len = (size_t)((close ? close : cend) - args);
        }
        trim(&name, &name_len);
        trim(&args, &args_len);
        json_t *j = json_loadb(args, args_len, 0, NULL);
        json_t *a = j ? json_arguments(j) : NULL;
        json_decref(j);
        if (!a || !name_len) {
            json_decref(a);
            return false;
        }
        emit_call(d, name, name_len, a);
        json_decref(a);
        s = cend < end ? cend + ce : end;
    }
    return d->n_calls > before;
}

/* <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{..}<|tool_call_end|> */
static bool parse_kimi(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    const char *end = s + n, *c;
    size_t before = d->n_calls;
    while ((c = find(s, (size_t)(end - s), "<|tool_call_begin|>"))) {
        const char *id = c + 19, *ab = find(id, (size_t)(end - id), "<|tool_call_argument_begin|>");
        if (!ab) return false;
        const char *args = ab + 28, *cend = find(args, (size_t)(end - args), "<|tool_call_end|>");
        if (!cend) cend = end;
        const char *name = id;
        size_t name_len = (size_t)(ab - id);
        trim(&name, &name_len);
        if (starts(name, name_len, "functions.")) name += 10, name_len -= 10;
        for (size_t i = name_len; i > 0; i--)
            if (name[i - 1] == ':') {
                name_len = i - 1;
                break;
            }
        json_t *j = json_loadb(args, (size_t)(cend - args), 0, NULL);
        json_t *a = j ? json_arguments(j) : NULL;
        json_decref(j);
        if (!a || !name_len) {
            json_decref(a);
            return false;
        }
        emit_call(d, name, name_len, a);
        json_decref(a);
        s = cend < end ? cend + 17 : end;
    }
    return d->n_calls > before;
}

/* the whole rest: one {"name":..,"parameters":..} or several separated by ';' */
static bool parse_llama3(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    if (starts(s, n, "<|python_tag|>")) s += 14, n -= 14;
    trim(&s, &n);
    size_t before = d->n_calls;
    while (n) {
        json_error_t je;
        json_t *o = json_loadb(s, n, JSON_DISABLE_EOF_CHECK, &je);
        if (!json_is_object(o) || !call_from_json_object(o, d)) {
            json_decref(o);
            return false;
        }
        json_decref(o);
        size_t used = (size_t)je.position;
        if (used > n) used = n;
        s += used;
        n -= used;
        trim(&s, &n);
        if (n && s[0] == ';') {
            s++;
            n--;
            trim(&s, &n);
        } else if (n) {
            return false;
        }
    }
    return d->n_calls > before;
}

/* [TOOL_CALLS]NAME[ARGS]{..} repeated, or [TOOL_CALLS][{"name":..,"arguments":..}, ...] */
static bool parse_mistral(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    const char *end = s + n;
    size_t before = d->n_calls;
    while (s < end) {
        if (starts(s, (size_t)(end - s), "[TOOL_CALLS]")) s += 12;
        const char *next = find(s, (size_t)(end - s), "[TOOL_CALLS]");
        if (!next) next = end;
        const char *part = s;
        size_t part_len = (size_t)(next - s);
        trim(&part, &part_len);
        const char *args = find(part, part_len, "[ARGS]");
        if (args) {
            const char *name = part;
            size_t name_len = (size_t)(args - part);
            trim(&name, &name_len);
            const char *a = args + 6;
            size_t an = (size_t)(part + part_len - a);
            json_t *j = json_loadb(a, an, 0, NULL);
            json_t *obj = j ? json_arguments(j) : NULL;
            json_decref(j);
            if (!obj || !name_len) {
                json_decref(obj);
                return false;
            }
            emit_call(d, name, name_len, obj);
            json_decref(obj);
        } else if (part_len) {
            json_t *j = json_loadb(part, part_len, 0, NULL);
            bool ok = json_is_array(j) && json_array_size(j) > 0;
            size_t i;
            json_t *o;
            json_array_foreach(j, i, o) ok = ok && call_from_json_object(o, d);
            json_decref(j);
            if (!ok) return false;
        }
        s = next;
    }
    return d->n_calls > before;
}

/* ==== Gemma 4: call:NAME{key:value,...} with its own value syntax ==== */

/* Nesting of Gemma 4 argument values parsed before giving up: the C stack, not a model, is
 * what deeper input would spend. */
#define GEMMA4_MAX_DEPTH 64

static void skip_ws(const char **s, const char *end) {
    while (*s < end && strchr(" \t\r\n", **s)) (*s)++;
}

static json_t *gemma4_value(const char **s, const char *end, int depth);

/* {key:value,...} (keys bare or quoted) or [value,...] from *s at its opening bracket. */
static json_t *gemma4_container(const char **s, const char *end, int depth) {
    const bool object = **s == '{';
    json_t *out = object ? json_object() : json_array();
    (*s)++;
    skip_ws(s, end);
    if (*s < end && **s == (object ? '}' : ']')) {
        (*s)++;
        return out;
    }
    while (*s < end) {
        char *key = NULL;
        if (object) {
            skip_ws(s, end);
            const char *k = *s, *kend;
            if (starts(k, (size_t)(end - k), GEMMA4_QUOTE)) {
                k += 5;
                kend = find(k, (size_t)(end - k), GEMMA4_QUOTE);
                if (!kend) break;
                *s = kend + 5;
                skip_ws(s, end);
            } else {
                kend = memchr(k, ':', (size_t)(end - k));
                if (!kend) break;
                *s = kend;
                while (kend > k && strchr(" \t\r\n", kend[-1])) kend--;
            }
            if (*s >= end || **s != ':' || kend == k) break;
            (*s)++;
            key = moe_xstrndup(k, (size_t)(kend - k));
        }
        json_t *v = gemma4_value(s, end, depth + 1);
        if (!v) {
            free(key);
            break;
        }
        if (object)
            json_object_set_new(out, key, v);
        else
            json_array_append_new(out, v);
        free(key);
        skip_ws(s, end);
        if (*s < end && **s == ',') {
            (*s)++;
            continue;
        }
        if (*s < end && **s == (object ? '}' : ']')) {
            (*s)++;
            return out;
        }
        break;
    }
    json_decref(out);
    return NULL;
}

/* One value at *s: a quoted string, an object, an array, or a bare scalar (true, false, null,
 * a number; anything else is kept as a string). NULL when malformed. */
static json_t *gemma4_value(const char **s, const char *end, int depth) {
    skip_ws(s, end);
    if (*s >= end || depth > GEMMA4_MAX_DEPTH) return NULL;
    if (starts(*s, (size_t)(end - *s), GEMMA4_QUOTE)) {
        const char *v = *s + 5, *vend = find(v, (size_t)(end - v), GEMMA4_QUOTE);
        if (!vend) return NULL;
        *s = vend + 5;
        return json_stringn(v, (size_t)(vend - v));
    }
    if (**s == '{' || **s == '[') return gemma4_container(s, end, depth);
    const char *v = *s;
    while (*s < end && !strchr(",}]", **s)) (*s)++;
    size_t vn = (size_t)(*s - v);
    trim(&v, &vn);
    if (!vn) return NULL;
    json_t *j = json_loadb(v, vn, JSON_DECODE_ANY, NULL);
    if (j && (json_is_number(j) || json_is_boolean(j) || json_is_null(j))) return j;
    json_decref(j);
    return json_stringn(v, vn);
}

/* <|tool_call>call:NAME{ARGS}<tool_call|> */
static bool parse_gemma4(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    (void)p;
    const char *end = s + n;
    if (starts(s, n, "<|tool_call>")) s += 12;
    const char *close = find(s, (size_t)(end - s), "<tool_call|>");
    if (close) end = close;
    skip_ws(&s, end);
    if (!starts(s, (size_t)(end - s), "call:")) return false;
    const char *name = s + 5, *brace = memchr(name, '{', (size_t)(end - name));
    if (!brace) return false;
    size_t name_len = (size_t)(brace - name);
    trim(&name, &name_len);
    const char *q = brace;
    json_t *args = name_len ? gemma4_value(&q, end, 0) : NULL;
    skip_ws(&q, end);
    const bool ok = json_is_object(args) && q == end;
    if (ok) emit_call(d, name, name_len, args);
    json_decref(args);
    return ok;
}

static block_parser format_block_parser(moe_chat_format f) {
    switch (f) {
    case MOE_CHAT_FORMAT_HERMES:
        return parse_hermes;
    case MOE_CHAT_FORMAT_QWEN3_CODER:
        return parse_qwen3_coder;
    case MOE_CHAT_FORMAT_GLM:
        return parse_glm;
    case MOE_CHAT_FORMAT_MINIMAX_M2:
        return parse_minimax;
    case MOE_CHAT_FORMAT_DEEPSEEK_V3:
    case MOE_CHAT_FORMAT_DEEPSEEK_V31:
        return parse_deepseek;
    case MOE_CHAT_FORMAT_DSML:
        return parse_dsml;
    case MOE_CHAT_FORMAT_KIMI_K2:
        return parse_kimi;
    case MOE_CHAT_FORMAT_LLAMA3:
        return parse_llama3;
    case MOE_CHAT_FORMAT_MISTRAL:
        return parse_mistral;
    case MOE_CHAT_FORMAT_GEMMA4:
        return parse_gemma4;
    default:
        return NULL;
    }
}

/* A finished block: its calls, or its raw text back to the content when it does not parse.
 * Calls already emitted by a parser that then failed are taken back. */
static void settle_block(moe_chat_parser *p, const char *s, size_t n, moe_chat_delta *d) {
    block_parser bp = format_block_parser(p->format);
    size_t before = d->n_calls;
    if (bp && bp(p, s, n, d)) return;
    while (d->n_calls > before) {
        d->n_calls--;
        free(d->calls[d->n_calls].name);
        free(d->calls[d->n_calls].arguments);
    }
    emit_content(p, d, s, n);
}

/* ==== Harmony (gpt-oss) ==== */

static const char *const harmony_ends[] = {"<|end|>", "<|call|>", "<|return|>", NULL};

/* header text: [<|start|>assistant][ to=functions.X]<|channel|>NAME[ to=functions.X][
 * <|constrain|>json] */
static void harmony_header(moe_chat_parser *p, const char *s, size_t n) {
    free(p->harmony_recipient);
    p->harmony_recipient = NULL;
    const char *to = find(s, n, "to=");
    if (to) {
        const char *name = to + 3, *e = name;
        while (e < s + n && !strchr(" <\t\n", *e)) e++;
        if (starts(name, (size_t)(e - name), "functions.")) name += 10;
        p->harmony_recipient = moe_xstrndup(name, (size_t)(e - name));
    }
    const char *ch = find(s, n, "<|channel|>");
    const char *chan = ch ? ch + 11 : "";
    size_t cn = ch ? (size_t)(s + n - chan) : 0;
    if (p->harmony_recipient)
        p->harmony_kind = 2;
    else if (starts(chan, cn, "analysis"))
        p->harmony_kind = 1;
    else
        p->harmony_kind = 0; /* final, commentary preambles, no channel */
}

static bool harmony_step(moe_chat_parser *p, moe_chat_delta *d, bool final) {
    if (p->mode == MODE_HARMONY_HEAD) {
        const char *m = find(p->in, p->len, "<|message|>");
        if (!m) {
            if (final) { /* no header at all: plain text */
                emit_content(p, d, p->in, p->len);
                consume(p, p->len);
            }
            return false;
        }
        harmony_header(p, p->in, (size_t)(m - p->in));
        consume(p, (size_t)(m - p->in) + 11);
        p->mode = MODE_HARMONY_BODY;
        return true;
    }
    /* body */
    const char *best = NULL;
    size_t best_len = 0;
    for (const char *const *e = harmony_ends; *e; e++) {
        const char *f = find(p->in, p->len, *e);
        if (f && (!best || f < best)) {
            best = f;
            best_len = strlen(*e);
        }
    }
    size_t upto = best ? (size_t)(best - p->in) : p->len;
    if (!best && !final) {
        if (p->harmony_kind == 2) return false; /* arguments settle whole */
        size_t hold = 0;
        for (const char *const *e = harmony_ends; *e; e++) {
            size_t h = partial_suffix(p->in, p->len, *e);
            if (h > hold) hold = h;
        }
        upto = p->len - hold;
    }
    if (p->harmony_kind == 2) {
        const char *a = p->in;
        size_t an = upto;
        trim(&a, &an);
        json_t *j = json_loadb(a, an, 0, NULL);
        json_t *args = j ? json_arguments(j) : NULL;
        json_decref(j);
        if (args)
            emit_call(d, p->harmony_recipient, strlen(p->harmony_recipient), args);
        else
            emit_content(p, d, p->in, upto);
        json_decref(args);
    } else if (p->harmony_kind == 1) {
        emit_reasoning(d, p->in, upto);
    } else {
        emit_content(p, d, p->in, upto);
    }
    consume(p, upto);
    if (best) {
        consume(p, best_len);
        p->mode = MODE_HARMONY_HEAD;
        return true;
    }
    return false;
}

/* ==== The engine ==== */

/* One step; true when it made progress and should be called again. */
static bool step(moe_chat_parser *p, moe_chat_delta *d, bool final) {
    if (!p->len && !final) return false;
    switch (p->mode) {
    case MODE_HARMONY_HEAD:
    case MODE_HARMONY_BODY:
        return harmony_step(p, d, final);
    case MODE_REASONING: {
        const char *c = find(p->in, p->len, p->think_close);
        if (c) {
            emit_reasoning(d, p->in, (size_t)(c - p->in));
            consume(p, (size_t)(c - p->in) + strlen(p->think_close));
            p->mode = MODE_CONTENT;
            return true;
        }
        size_t hold = final ? 0 : partial_suffix(p->in, p->len, p->think_close);
        emit_reasoning(d, p->in, p->len - hold);
        consume(p, p->len - hold);
        return false;
    }
    case MODE_BLOCK: {
        const char *close = p->block->close;
        const char *c = close ? find(p->in, p->len, close) : NULL;
        if (!c && !final) return false;
        size_t body = c ? (size_t)(c - p->in) : p->len;
        size_t total = c ? body + strlen(close) : p->len;
        /* the block's raw text: opener + body + closer */
        size_t on = strlen(p->block->open);
        char *raw = moe_xmalloc(on + total + 1);
        memcpy(raw, p->block->open, on);
        memcpy(raw + on, p->in, total);
        raw[on + total] = '\0';
        settle_block(p, raw, on + total, d);
        free(raw);
        consume(p, total);
        p->mode = MODE_CONTENT;
        return true;
    }
    case MODE_CONTENT:
        break;
    }
    /* content: look for the earliest opener */
    const char *best = NULL;
    const block_marker *best_block = NULL;
    size_t best_len = 0;
    if (p->think_open) {
        const char *f = find(p->in, p->len, p->think_open);
        if (f) {
            best = f;
            best_len = strlen(p->think_open);
        }
    }
    for (const block_marker *m = p->markers; m->open; m++) {
        const char *f = find(p->in, p->len, m->open);
        if (f && (!best || f < best)) {
            best = f;
            best_block = m;
            best_len = strlen(m->open);
        }
    }
    /* Llama 3: a reply that is a JSON object is a call */
    if (p->format == MOE_CHAT_FORMAT_LLAMA3 && p->markers != markers_none && !p->seen_text) {
        size_t i = 0;
        while (i < p->len && strchr(" \t\r\n", p->in[i])) i++;
        if (i < p->len && p->in[i] == '{' && (!best || p->in + i < best)) {
            emit_content(p, d, p->in, i);
            consume(p, i);
            p->block = &bare_json;
            p->mode = MODE_BLOCK;
            return true;
        }
        if (i == p->len && !final) return false; /* only whitespace so far: wait */
    }
    if (best) {
        emit_content(p, d, p->in, (size_t)(best - p->in));
        consume(p, (size_t)(best - p->in) + best_len);
        if (best_block) {
            p->block = best_block;
            p->mode = MODE_BLOCK;
        } else {
            p->mode = MODE_REASONING;
        }
        return true;
    }
    size_t hold = 0;
    if (!final) {
        if (p->think_open) hold = partial_suffix(p->in, p->len, p->think_open);
        for (const block_marker *m = p->markers; m->open; m++) {
            size_t h = partial_suffix(p->in, p->len, m->open);
            if (h > hold) hold = h;
        }
    }
    emit_content(p, d, p->in, p->len - hold);
    consume(p, p->len - hold);
    return false;
}

moe_status moe_chat_parser_feed(moe_chat_parser *p, const char *text, size_t len, moe_chat_delta *d,
                                moe_error *err) {
    (void)err;
    if (p->cap - p->len < len + 1) {
        size_t cap = p->cap ? p->cap : 256;
        while (cap - p->len < len + 1) cap *= 2;
        p->in = moe_xrealloc(p->in, cap);
        p->cap = cap;
    }
    memcpy(p->in + p->len, text, len);
    p->len += len;
    while (step(p, d, false)) {
    }
    return MOE_OK;
}

moe_status moe_chat_parser_finish(moe_chat_parser *p, moe_chat_delta *d, moe_error *err) {
    (void)err;
    while (step(p, d, true)) {
    }
    return MOE_OK;
}
