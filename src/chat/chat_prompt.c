/* chat_prompt: a client's conversation to prompt tokens -- the chat template rendered for one
 * tokenizer, then tokenized so that a client cannot write control tokens.
 *
 * Owns the guard against special-token injection. A rendered prompt is one string in which the
 * template's markers (`<|im_start|>`) and the client's words sit side by side; tokenizing it
 * with special-token parsing would also turn a client's "<|im_start|>" into the control token.
 * So before rendering, every control token's text inside a client string is replaced by a
 * marker -- OPEN, the token id in decimal, CLOSE, with OPEN and CLOSE two private-use code
 * points that occur in neither the inputs nor the template -- and after rendering each marker
 * is put back and its bytes noted as a plain span, where the tokenizer will not parse specials.
 * The trap: a template may cut or escape a marker (slicing, tojson with ensure_ascii); what is
 * left of it is dropped or stays escaped text, so the worst case is a changed string, never a
 * control token the client wrote. Also here: the built-in ChatML template. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"

/* ==== The built-in template ==== */

/* ChatML; tools in the system turn and calls in <tool_call> tags, in the Hermes convention
 * (the output parser's fallback format), consecutive tool results in one user turn. */
const char moe_chat_template_chatml[] =
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- m.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' }}{{- call.function.name | tojson }}"
    "{{- ', \"arguments\": ' }}{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/* ==== Markers ==== */

#define MARK_FIRST 0xE000u /* markers come from U+E000..U+E0FF (Unicode private use) */
#define MARK_COUNT 256u

typedef struct guard {
    const moe_tokenizer *tok;
    uint8_t used[MARK_COUNT / 8]; /* private-use code points seen in the inputs or template */
    char open[4], close[4];       /* the chosen markers, UTF-8 (3 bytes each) */
} guard;

static void utf8_3(uint32_t cp, char out[4]) {
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    out[3] = '\0';
}

/* Note every U+E000..U+E0FF in s (UTF-8 EE 80..83 xx). */
static void note_used(guard *g, const char *s, size_t n) {
    for (const char *p = s; (p = memchr(p, 0xEE, (size_t)(s + n - p))) && p + 2 < s + n; p++) {
        const uint8_t b1 = (uint8_t)p[1], b2 = (uint8_t)p[2];
        if (b1 < 0x80 || b1 > 0x83 || (b2 & 0xC0) != 0x80) continue;
        const unsigned k = ((b1 & 0x3Fu) << 6) | (b2 & 0x3Fu);
        g->used[k / 8] |= (uint8_t)(1u << (k % 8));
    }
}

static void note_used_json(guard *g, const json_t *v) {
    if (json_is_string(v)) {
        note_used(g, json_string_value(v), json_string_length(v));
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) note_used_json(g, json_array_get(v, i));
    } else if (json_is_object(v)) {
        const char *key;
        json_t *m;
        json_object_foreach((json_t *)v, key, m) {
            note_used(g, key, strlen(key));
            note_used_json(g, m);
        }
    }
}

static bool choose_markers(guard *g) {
    int found = 0;
    for (unsigned k = 0; k < MARK_COUNT && found < 2; k++) {
        if (g->used[k / 8] & (1u << (k % 8))) continue;
        utf8_3(MARK_FIRST + k, found ? g->close : g->open);
        found++;
    }
    return found == 2;
}

/* ==== Neutralising client strings ==== */

static bool parsed_as_special(const moe_tokenizer *tok, int32_t id) {
    /* what PARSE_SPECIAL adds: user-defined tokens are cut out in any case */
    return moe_tokenizer_token_type(tok, id) != MOE_TOKEN_USER_DEFINED;
}

/* s with every control token's text replaced by a marker; NULL when there is none. Longest
 * token first, as the tokenizer would cut them. */
static char *neutralise(const guard *g, const char *s, size_t n, size_t *out_len) {
    const moe_tokenizer *tok = g->tok;
    int32_t *at_id = NULL; /* [n]: the token starting at each byte, or -1 */
    uint8_t *taken = NULL; /* [n]: bytes already inside a replaced token */
    size_t grow = 0;       /* bytes the markers add over the texts they replace */
    for (uint32_t k = 0; k < moe_tokenizer_n_special(tok); k++) {
        const int32_t id = moe_tokenizer_special(tok, k);
        size_t text_len;
        const char *needle = moe_tokenizer_token_text(tok, id, &text_len);
        if (!parsed_as_special(tok, id) || text_len == 0 || text_len > n) continue;
        for (const char *p = s; (p = memmem(p, (size_t)(s + n - p), needle, text_len));) {
            const size_t at = (size_t)(p - s);
            if (!at_id) {
                at_id = moe_xmalloc(n * sizeof *at_id);
                taken = moe_xcalloc(n, 1);
                for (size_t i = 0; i < n; i++) at_id[i] = -1;
            }
            if (memchr(taken + at, 1, text_len)) {
                p++;
                continue;
            }
            memset(taken + at, 1, text_len);
            at_id[at] = id;
            char digits[16];
            const size_t marker = 6 + (size_t)snprintf(digits, sizeof digits, "%d", id);
            if (marker > text_len) grow += marker - text_len;
            p += text_len;
        }
    }
    if (!at_id) return NULL;
    char *out = moe_xmalloc(n + grow + 1);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (at_id[i] < 0) {
            out[o++] = s[i++];
            continue;
        }
        o += (size_t)sprintf(out + o, "%s%d%s", g->open, at_id[i], g->close);
        size_t text_len;
        moe_tokenizer_token_text(tok, at_id[i], &text_len);
        i += text_len;
    }
    out[o] = '\0';
    free(at_id);
    free(taken);
    *out_len = o;
    return out;
}

/* The same JSON with every string (values and keys) neutralised. */
static json_t *neutralise_json(const guard *g, json_t *v) {
    if (json_is_string(v)) {
        size_t len;
        char *s = neutralise(g, json_string_value(v), json_string_length(v), &len);
        if (!s) return json_incref(v);
        json_t *r = json_stringn_nocheck(s, len);
        free(s);
        return r;
    }
    if (json_is_array(v)) {
        json_t *r = json_array();
        for (size_t i = 0; i < json_array_size(v); i++)
            json_array_append_new(r, neutralise_json(g, json_array_get(v, i)));
        return r;
    }
    if (json_is_object(v)) {
        json_t *r = json_object();
        const char *key;
        json_t *m;
        json_object_foreach(v, key, m) {
            size_t len;
            char *k = neutralise(g, key, strlen(key), &len);
            json_object_set_new_nocheck(r, k ? k : key, neutralise_json(g, m));
            free(k);
        }
        return r;
    }
    return json_incref(v);
}

/* ==== Putting the markers back ==== */

typedef struct span_list {
    moe_text_span *v;
    size_t n, cap;
} span_list;

/* The rendered text with each whole marker replaced by its token's text, noted in *spans (in
 * order, so sorted and disjoint); the pieces of a cut marker are dropped. A token's text may be
 * longer than its marker, so the output grows as needed. */
static char *restore(const guard *g, const char *in, size_t n, span_list *spans, size_t *out_len) {
    const moe_tokenizer *tok = g->tok;
    size_t cap = n + 1, o = 0;
    char *out = moe_xmalloc(cap);
    for (size_t i = 0; i < n;) {
        const bool is_open = n - i >= 3 && memcmp(in + i, g->open, 3) == 0;
        const bool is_close = n - i >= 3 && memcmp(in + i, g->close, 3) == 0;
        if (is_close) { /* a close whose open was cut away */
            i += 3;
            continue;
        }
        if (!is_open) {
            out[o++] = in[i++];
            continue;
        }
        size_t d = i + 3;
        long id = 0;
        while (d < n && d - i < 3 + 9 && in[d] >= '0' && in[d] <= '9')
            id = id * 10 + (in[d++] - '0');
        const bool whole = d > i + 3 && n - d >= 3 && memcmp(in + d, g->close, 3) == 0 &&
                           id < (long)moe_tokenizer_n_vocab(tok);
        if (!whole) { /* a cut marker: drop the open, keep what followed as text */
            i += 3;
            continue;
        }
        size_t text_len;
        const char *text = moe_tokenizer_token_text(tok, (int32_t)id, &text_len);
        if (o + text_len + (n - i) + 1 > cap) {
            cap = o + text_len + (n - i) + 1;
            out = moe_xrealloc(out, cap);
        }
        memcpy(out + o, text, text_len);
        if (spans->n == spans->cap) {
            spans->cap = spans->cap ? 2 * spans->cap : 16;
            spans->v = moe_xrealloc(spans->v, spans->cap * sizeof *spans->v);
        }
        spans->v[spans->n++] = (moe_text_span){o, text_len};
        o += text_len;
        i = d + 3;
    }
    out[o] = '\0';
    *out_len = o;
    return out;
}

/* ==== Render and tokenize ==== */

static json_t *parse_or_null(const char *text, const char *what, json_t *dflt, moe_error *err) {
    if (!text) return dflt;
    json_error_t je;
    json_t *j = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!j)
        moe_error_set(err, MOE_ERR_ARG, "%s: invalid JSON at line %d column %d: %s", what, je.line,
                      je.column, je.text);
    json_decref(dflt);
    return j;
}

static char *dump(const json_t *v) {
    return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
}

moe_status moe_chat_render_tokens(const moe_chat_template *t, const moe_tokenizer *tok,
                                  const char *messages_json, const char *tools_json,
                                  const char *kwargs_json, char **text, size_t *text_len,
                                  int32_t **ids, size_t *n_ids, moe_error *err) {
    if (text) *text = NULL;
    if (text_len) *text_len = 0;
    *ids = NULL;
    *n_ids = 0;
    json_t *messages = parse_or_null(messages_json, "messages", json_array(), err);
    json_t *tools = parse_or_null(tools_json, "tools", json_null(), err);
    json_t *kwargs = parse_or_null(kwargs_json, "kwargs", json_object(), err);
    if (!messages || !tools || !kwargs) {
        json_decref(messages);
        json_decref(tools);
        json_decref(kwargs);
        return err->code;
    }
    if (!json_is_object(kwargs)) {
        json_decref(messages);
        json_decref(tools);
        json_decref(kwargs);
        return moe_error_set(err, MOE_ERR_ARG, "kwargs must be a JSON object");
    }
    guard g = {.tok = tok};
    const char *src = moe_chat_template_source(t);
    note_used(&g, src, strlen(src));
    note_used_json(&g, messages);
    note_used_json(&g, tools);
    note_used_json(&g, kwargs);
    moe_status st = MOE_OK;
    char *rendered = NULL;
    size_t rendered_len = 0;
    if (!choose_markers(&g)) {
        st = moe_error_set(err, MOE_ERR_ARG,
                           "the request uses every code point from U+E000 to U+E0FF: no marker "
                           "is left to guard special tokens with");
    } else {
        json_t *safe_messages = neutralise_json(&g, messages);
        json_t *safe_tools = neutralise_json(&g, tools);
        json_t *safe_kwargs = neutralise_json(&g, kwargs);
        /* the tokenizer's own strings are the template's to place: not neutralised */
        const int32_t special_ids[2] = {moe_tokenizer_bos(tok), moe_tokenizer_eos(tok)};
        const char *special_keys[2] = {"bos_token", "eos_token"};
        for (int k = 0; k < 2; k++) {
            size_t text_len;
            const char *text = moe_tokenizer_token_text(tok, special_ids[k], &text_len);
            if (text)
                json_object_set_new(safe_kwargs, special_keys[k],
                                    json_stringn_nocheck(text, text_len));
        }
        char *m = dump(safe_messages), *tl = json_is_null(safe_tools) ? NULL : dump(safe_tools),
             *kw = dump(safe_kwargs);
        st = moe_chat_render_n(t, m, tl, kw, &rendered, &rendered_len, err);
        free(m);
        free(tl);
        free(kw);
        json_decref(safe_messages);
        json_decref(safe_tools);
        json_decref(safe_kwargs);
    }
    json_decref(messages);
    json_decref(tools);
    json_decref(kwargs);
    if (st != MOE_OK) return st;

    span_list spans = {0};
    size_t len;
    char *prompt = restore(&g, rendered, rendered_len, &spans, &len);
    free(rendered);
    unsigned flags = MOE_ENCODE_PARSE_SPECIAL;
    size_t bos_len;
    const char *bos = moe_tokenizer_token_text(tok, moe_tokenizer_bos(tok), &bos_len);
    bool has_bos = bos && bos_len && len >= bos_len && memcmp(prompt, bos, bos_len) == 0 &&
                   !(spans.n && spans.v[0].off == 0);
    if (!has_bos) flags |= MOE_ENCODE_ADD_SPECIAL;
    st = moe_tokenizer_encode_spans(tok, prompt, len, flags, spans.v, spans.n, ids, n_ids, err);
    free(spans.v);
    if (st == MOE_OK && text_len) *text_len = len;
    if (st == MOE_OK && text)
        *text = prompt;
    else
        free(prompt);
    return st;
}
