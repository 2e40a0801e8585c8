/* jinja_parse: template text to AST -- the lexer (with Jinja2's whitespace control) and a
 * recursive-descent parser for the statement and expression grammar of Jinja2 3.x.
 *
 * Owns nothing at run time: nodes live in the template's arena. The lexer follows Jinja2's
 * regex rules one for one, as Hugging Face configures them: trim_blocks drops the newline right
 * after `%}` and `#}`, lstrip_blocks drops spaces and tabs before `{%`/`{#` that start a line,
 * `-` strips all whitespace on its side, `+` turns both off. The trap: one trailing newline of
 * the source is removed before lexing (keep_trailing_newline=False), and all newlines become
 * "\n" -- also inside string literals. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

/* ==== Tokens ==== */

typedef enum tok_kind {
    T_EOF,
    T_DATA,
    T_VAR_BEGIN,
    T_VAR_END,
    T_BLOCK_BEGIN,
    T_BLOCK_END,
    T_NAME,
    T_STRING,
    T_INT,
    T_FLOAT,
    T_OP,
} tok_kind;

typedef struct tok {
    tok_kind kind;
    uint32_t line, col;
    const char *text; /* DATA, NAME, STRING (decoded), OP; arena-owned, NUL-terminated */
    size_t len;
    int64_t i;
    double f;
} tok;

typedef struct parser {
    jinja_template *t;
    jinja_jump jump;
    const char *src; /* normalised source */
    size_t n;
    tok *toks;
    size_t n_toks, cap_toks, pos;
    int depth;
} parser;

static void *palloc(parser *p, size_t n) {
    void *m = jinja_arena_alloc(&p->t->arena, n);
    if (!m) jinja_fail(&p->jump, 1, 1, "template too large");
    return m;
}

/* moe_strbuf's allocator for text that lives as long as the template. */
static void *parser_alloc(void *p, size_t n) {
    return palloc(p, n);
}

static char *pstrdup(parser *p, const char *s, size_t n) {
    char *d = palloc(p, n + 1);
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

/* ==== Lexer ==== */

typedef struct lexer {
    parser *p;
    const char *s;
    size_t n, pos;
    uint32_t line;
    size_t line_start; /* offset of the current line's first byte */
} lexer;

static void where(const lexer *lx, size_t off, uint32_t *line, uint32_t *col) {
    uint32_t l = 1;
    size_t ls = 0;
    for (size_t i = 0; i < off && i < lx->n; i++)
        if (lx->s[i] == '\n') {
            l++;
            ls = i + 1;
        }
    *line = l;
    *col = (uint32_t)(jinja_utf8_count(lx->s + ls, off - ls) + 1);
}

_Noreturn static void lex_fail(lexer *lx, size_t off, const char *msg) {
    uint32_t line, col;
    where(lx, off, &line, &col);
    jinja_fail(&lx->p->jump, line, col, "%s", msg);
}

static tok *push_tok(lexer *lx, tok_kind kind, size_t off) {
    parser *p = lx->p;
    if (p->n_toks == p->cap_toks) {
        size_t cap = p->cap_toks ? p->cap_toks * 2 : 256;
        tok *t = palloc(p, cap * sizeof *t);
        if (p->n_toks) memcpy(t, p->toks, p->n_toks * sizeof *t);
        p->toks = t;
        p->cap_toks = cap;
    }
    tok *t = &p->toks[p->n_toks++];
    *t = (tok){.kind = kind};
    /* line/col by incremental scan: tokens are pushed in source order */
    while (lx->pos < off && lx->pos < lx->n) {
        if (lx->s[lx->pos] == '\n') {
            lx->line++;
            lx->line_start = lx->pos + 1;
        }
        lx->pos++;
    }
    t->line = lx->line;
    t->col = (uint32_t)(jinja_utf8_count(lx->s + lx->line_start, off - lx->line_start) + 1);
    return t;
}

/* Length of the Python-whitespace run at s[i..n). */
static size_t space_run(const char *s, size_t n, size_t i) {
    size_t p = i;
    while (p < n) {
        size_t q = p;
        if (!jinja_py_space(jinja_utf8_next(s, n, &q))) break;
        p = q;
    }
    return p - i;
}

/* Length of s[0..n) without its trailing Python whitespace. */
static size_t rstrip_len(const char *s, size_t n) {
    size_t end = n;
    while (end > 0) {
        size_t start = end - 1;
        while (start > 0 && ((unsigned char)s[start] & 0xc0) == 0x80) start--;
        size_t q = start;
        if (!jinja_py_space(jinja_utf8_next(s, n, &q)) || q != end) break;
        end = start;
    }
    return end;
}

static bool only_py_space(const char *s, size_t n) {
    return space_run(s, n, 0) == n;
}

static void emit_data(lexer *lx, size_t off, size_t len) {
    if (!len) return;
    tok *t = push_tok(lx, T_DATA, off);
    t->text = pstrdup(lx->p, lx->s + off, len);
    t->len = len;
}

/* Data before a tag, with the tag's strip sign and lstrip_blocks applied. */
static void emit_text_before_tag(lexer *lx, size_t start, size_t tag, char sign, bool is_var,
                                 bool line_starting) {
    size_t len = tag - start;
    if (sign == '-') {
        len = rstrip_len(lx->s + start, len);
    } else if (sign != '+' && !is_var) {
        size_t l_pos = 0; /* relative: just after the last newline */
        for (size_t i = len; i > 0; i--)
            if (lx->s[start + i - 1] == '\n') {
                l_pos = i;
                break;
            }
        if ((l_pos > 0 || line_starting) && len > l_pos &&
            only_py_space(lx->s + start + l_pos, len - l_pos))
            len = l_pos;
    }
    emit_data(lx, start, len);
}

static bool is_name_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
static bool is_name_char(char c) {
    return is_name_start(c) || (c >= '0' && c <= '9');
}
static bool is_digit(char c) {
    return c >= '0' && c <= '9';
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string literal body with Python's unicode-escape rules; unknown escapes stay as written. */
static void lex_string(lexer *lx, size_t *pos) {
    const char *s = lx->s;
    size_t start = *pos;
    char q = s[start];
    size_t i = start + 1;
    moe_strbuf b = {.alloc = parser_alloc, .alloc_ctx = lx->p}; /* in the template's arena */
    for (;;) {
        if (i >= lx->n) {
            lex_fail(lx, start, "unexpected end of string literal");
        }
        char c = s[i];
        if (c == q) break;
        if (c != '\\') {
            moe_strbuf_putc(&b, c);
            i++;
            continue;
        }
        if (i + 1 >= lx->n) {
            i++;
            continue;
        }
        char e = s[i + 1];
        i += 2;
        switch (e) {
        case '\n':
            break;
        case '\\':
            moe_strbuf_putc(&b, '\\');
            break;
        case '\'':
            moe_strbuf_putc(&b, '\'');
            break;
        case '"':
            moe_strbuf_putc(&b, '"');
            break;
        case 'a':
            moe_strbuf_putc(&b, '\a');
            break;
        case 'b':
            moe_strbuf_putc(&b, '\b');
            break;
        case 'f':
            moe_strbuf_putc(&b, '\f');
            break;
        case 'n':
            moe_strbuf_putc(&b, '\n');
            break;
        case 'r':
            moe_strbuf_putc(&b, '\r');
            break;
        case 't':
            moe_strbuf_putc(&b, '\t');
            break;
        case 'v':
            moe_strbuf_putc(&b, '\v');
            break;
        case 'x':
        case 'u':
        case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < nd; k++) {
                int h = i + (size_t)k < lx->n ? hexval(s[i + (size_t)k]) : -1;
                if (h < 0) {
                    lex_fail(lx, i - 2, "truncated \\x, \\u or \\U escape in string literal");
                }
                cp = cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10ffff) {
                lex_fail(lx, i - 2, "illegal Unicode character in string literal");
            }
            i += (size_t)nd;
            jinja_utf8_put(&b, cp);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && i < lx->n && s[i] >= '0' && s[i] <= '7'; k++, i++)
                    cp = cp * 8 + (uint32_t)(s[i] - '0');
                jinja_utf8_put(&b, cp);
            } else {
                moe_strbuf_putc(&b, '\\');
                moe_strbuf_putc(&b, e);
            }
        }
    }
    tok *t = push_tok(lx, T_STRING, start);
    t->text = b.s ? b.s : "";
    t->len = b.len;
    *pos = i + 1;
}

/* Digits with optional single underscores between them; returns the end. */
static size_t digit_run(const char *s, size_t n, size_t i) {
    if (i >= n || !is_digit(s[i])) return i;
    while (i < n && is_digit(s[i])) {
        i++;
        if (i + 1 < n && s[i] == '_' && is_digit(s[i + 1])) i++;
    }
    return i;
}

static void lex_number(lexer *lx, size_t *pos) {
    const char *s = lx->s;
    size_t start = *pos, i = digit_run(s, lx->n, start);
    bool is_float = false;
    size_t j = i;
    if (j + 1 < lx->n && s[j] == '.' && is_digit(s[j + 1])) {
        j = digit_run(s, lx->n, j + 1);
        is_float = true;
    }
    if (j < lx->n && (s[j] == 'e' || s[j] == 'E')) {
        size_t k = j + 1;
        if (k < lx->n && (s[k] == '+' || s[k] == '-')) k++;
        if (k < lx->n && is_digit(s[k])) {
            j = digit_run(s, lx->n, k);
            is_float = true;
        }
    }
    char buf[128];
    size_t nb = 0;
    size_t end = is_float ? j : i;
    for (size_t k = start; k < end && nb + 1 < sizeof buf; k++)
        if (s[k] != '_') buf[nb++] = s[k];
    buf[nb] = '\0';
    tok *t = push_tok(lx, is_float ? T_FLOAT : T_INT, start);
    if (is_float) {
        t->f = strtod(buf, NULL);
    } else {
        errno = 0;
        unsigned long long v = strtoull(buf, NULL, 10);
        if (errno || v > INT64_MAX) lex_fail(lx, start, "integer literal too large");
        t->i = (int64_t)v;
    }
    *pos = end;
}

static const char *const two_char_ops[] = {"//", "**", "==", "!=", "<=", ">="};

/* Tokens inside {{ }} or {% %} up to the end marker; returns the offset after it. */
static size_t lex_tag(lexer *lx, size_t i, bool is_block, bool *line_starting) {
    const char *s = lx->s;
    size_t n = lx->n;
    int balance = 0;
    char stack[JINJA_MAX_NEST];
    size_t tag_start = i;
    for (;;) {
        if (i >= n)
            lex_fail(lx, tag_start,
                     is_block ? "unexpected end of template, expected '%}'"
                              : "unexpected end of template, expected '}}'");
        if (balance == 0) {
            const char *end = is_block ? "%}" : "}}";
            if (is_block && s[i] == '+' && i + 2 < n + 0 && strncmp(s + i + 1, end, 2) == 0) {
                push_tok(lx, T_BLOCK_END, i);
                *line_starting = false;
                return i + 3;
            }
            if (s[i] == '-' && n - i >= 3 && strncmp(s + i + 1, end, 2) == 0) {
                push_tok(lx, is_block ? T_BLOCK_END : T_VAR_END, i);
                size_t j = i + 3, ws = space_run(s, n, j);
                *line_starting = ws > 0 ? s[j + ws - 1] == '\n' : false;
                return j + ws;
            }
            if (n - i >= 2 && strncmp(s + i, end, 2) == 0) {
                push_tok(lx, is_block ? T_BLOCK_END : T_VAR_END, i);
                size_t j = i + 2;
                *line_starting = false;
                if (is_block && j < n && s[j] == '\n') {
                    j++;
                    *line_starting = true;
                }
                return j;
            }
        }
        char c = s[i];
        size_t ws = space_run(s, n, i);
        if (ws) {
            i += ws;
            continue;
        }
        if (is_name_start(c)) {
            size_t j = i;
            while (j < n && is_name_char(s[j])) j++;
            tok *t = push_tok(lx, T_NAME, i);
            t->text = pstrdup(lx->p, s + i, j - i);
            t->len = j - i;
            i = j;
            continue;
        }
        if (is_digit(c)) {
            lex_number(lx, &i);
            continue;
        }
        if (c == '\'' || c == '"') {
            lex_string(lx, &i);
            continue;
        }
        size_t oplen = 0;
        for (size_t k = 0; k < sizeof two_char_ops / sizeof *two_char_ops; k++)
            if (n - i >= 2 && strncmp(s + i, two_char_ops[k], 2) == 0) oplen = 2;
        if (!oplen && strchr("+-/*%~[](){}<>=.:|,;", c) && c) oplen = 1;
        if (!oplen) lex_fail(lx, i, "unexpected character in tag");
        if (oplen == 1 && (c == '(' || c == '[' || c == '{')) {
            if (balance >= JINJA_MAX_NEST) lex_fail(lx, i, "brackets nested too deeply");
            stack[balance++] = c == '(' ? ')' : c == '[' ? ']' : '}';
        } else if (oplen == 1 && (c == ')' || c == ']' || c == '}')) {
            if (!balance) lex_fail(lx, i, "unexpected closing bracket");
            if (stack[--balance] != c) lex_fail(lx, i, "mismatched closing bracket");
        }
        tok *t = push_tok(lx, T_OP, i);
        t->text = pstrdup(lx->p, s + i, oplen);
        t->len = oplen;
        i += oplen;
    }
}

/* `{%[-+]? raw [-]?%}`: returns the offset after the tag, or 0 when it is not a raw tag. */
static size_t match_raw(const char *s, size_t n, size_t i, const char *word, char *end_sign) {
    size_t j = i + 2;
    if (j < n && (s[j] == '-' || s[j] == '+')) j++;
    j += space_run(s, n, j);
    size_t wl = strlen(word);
    if (n - j < wl || strncmp(s + j, word, wl) != 0) return 0;
    j += wl;
    size_t ws = space_run(s, n, j);
    if (!ws && j < n && is_name_char(s[j])) return 0;
    j += ws;
    *end_sign = 0;
    if (j < n && (s[j] == '-' || s[j] == '+')) *end_sign = s[j++];
    if (n - j < 2 || strncmp(s + j, "%}", 2) != 0) return 0;
    return j + 2;
}

static void lex(lexer *lx) {
    const char *s = lx->s;
    size_t n = lx->n, i = 0;
    bool line_starting = true;
    while (i < n) {
        /* the next tag start */
        size_t t = i;
        while (t + 1 < n &&
               !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#')))
            t++;
        if (t + 1 >= n) {
            emit_data(lx, i, n - i);
            return;
        }
        char kind = s[t + 1];
        char sign = t + 2 < n && (s[t + 2] == '-' || s[t + 2] == '+') ? s[t + 2] : 0;
        char raw_sign;
        size_t raw_end = kind == '%' ? match_raw(s, n, t, "raw", &raw_sign) : 0;
        emit_text_before_tag(lx, i, t, sign, kind == '{', line_starting);
        if (raw_end) {
            size_t j = raw_end;
            if (raw_sign == '-') j += space_run(s, n, j);
            /* find {% endraw %} */
            size_t k = j, end_after = 0;
            char end_sign = 0;
            for (; k + 1 < n; k++) {
                if (s[k] == '{' && s[k + 1] == '%') {
                    end_after = match_raw(s, n, k, "endraw", &end_sign);
                    if (end_after) break;
                }
            }
            if (!end_after) lex_fail(lx, t, "missing end of raw directive");
            char inner_sign = k + 2 < n && (s[k + 2] == '-' || s[k + 2] == '+') ? s[k + 2] : 0;
            emit_text_before_tag(lx, j, k, inner_sign, false, false);
            line_starting = false;
            if (end_sign == '-') {
                size_t ws = space_run(s, n, end_after);
                line_starting = ws > 0 && s[end_after + ws - 1] == '\n';
                end_after += ws;
            } else if (end_sign != '+' && end_after < n && s[end_after] == '\n') {
                end_after++;
                line_starting = true;
            }
            i = end_after;
            continue;
        }
        size_t after = t + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            size_t k = after;
            while (k + 1 < n && !(s[k] == '#' && s[k + 1] == '}')) k++;
            if (k + 1 >= n) lex_fail(lx, t, "missing end of comment tag");
            char csign = k > after && (s[k - 1] == '-' || s[k - 1] == '+') ? s[k - 1] : 0;
            size_t j = k + 2;
            line_starting = false;
            if (csign == '-') {
                size_t ws = space_run(s, n, j);
                line_starting = ws > 0 && s[j + ws - 1] == '\n';
                j += ws;
            } else if (csign != '+' && j < n && s[j] == '\n') {
                j++;
                line_starting = true;
            }
            i = j;
            continue;
        }
        push_tok(lx, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, t);
        i = lex_tag(lx, after, kind == '%', &line_starting);
    }
}

/* ==== Parser helpers ==== */

static tok *cur(parser *p) {
    return &p->toks[p->pos];
}
static tok *peek(parser *p, size_t k) {
    size_t i = p->pos + k;
    return &p->toks[i < p->n_toks ? i : p->n_toks - 1];
}

_Noreturn static void perr(parser *p, const tok *t, const char *fmt, const char *arg) {
    jinja_fail(&p->jump, t->line, t->col, fmt, arg ? arg : "");
}

static bool is_op(const tok *t, const char *op) {
    return t->kind == T_OP && strcmp(t->text, op) == 0;
}
static bool is_name(const tok *t, const char *name) {
    return t->kind == T_NAME && strcmp(t->text, name) == 0;
}

static const char *tok_desc(const tok *t) {
    switch (t->kind) {
    case T_EOF:
        return "end of template";
    case T_DATA:
        return "template data";
    case T_VAR_BEGIN:
        return "'{{'";
    case T_VAR_END:
        return "'}}'";
    case T_BLOCK_BEGIN:
        return "'{%'";
    case T_BLOCK_END:
        return "'%}'";
    case T_NAME:
    case T_OP:
        return t->text;
    case T_STRING:
        return "string";
    default:
        return "number";
    }
}

static void expect_op(parser *p, const char *op) {
    tok *t = cur(p);
    if (!is_op(t, op)) {
        char msg[128];
        snprintf(msg, sizeof msg, "expected '%s', got '%s'", op, tok_desc(t));
        perr(p, t, "%s", msg);
    }
    p->pos++;
}

static const char *expect_name(parser *p) {
    tok *t = cur(p);
    if (t->kind != T_NAME) perr(p, t, "expected a name, got '%s'", tok_desc(t));
    p->pos++;
    return t->text;
}

static void expect_kind(parser *p, tok_kind k, const char *what) {
    tok *t = cur(p);
    if (t->kind != k) {
        char msg[160];
        snprintf(msg, sizeof msg, "expected %s, got '%s'", what, tok_desc(t));
        perr(p, t, "%s", msg);
    }
    p->pos++;
}

static jinja_node *node(parser *p, jinja_node_kind kind, const tok *at) {
    jinja_node *n = palloc(p, sizeof *n);
    *n = (jinja_node){.kind = (uint8_t)kind, .line = at->line, .col = at->col};
    return n;
}

/* A growable child list in the arena. */
typedef struct kidlist {
    jinja_node **items;
    const char **names;
    size_t n, cap;
} kidlist;

static void kid_push(parser *p, kidlist *k, jinja_node *n, const char *name) {
    if (k->n == k->cap) {
        size_t cap = k->cap ? k->cap * 2 : 4;
        jinja_node **items = palloc(p, cap * sizeof *items);
        const char **names = palloc(p, cap * sizeof *names);
        if (k->n) {
            memcpy(items, k->items, k->n * sizeof *items);
            memcpy(names, k->names, k->n * sizeof *names);
        }
        k->items = items;
        k->names = names;
        k->cap = cap;
    }
    k->items[k->n] = n;
    k->names[k->n++] = name;
}

static void set_kids(jinja_node *n, kidlist *k, bool with_names) {
    n->kids = k->items;
    n->n_kids = k->n;
    n->kwnames = with_names ? k->names : NULL;
}

static void enter(parser *p) {
    if (++p->depth > JINJA_MAX_NEST) perr(p, cur(p), "template nested too deeply%s", NULL);
}
static void leave(parser *p) {
    p->depth--;
}

/* ==== Expressions ==== */

static jinja_node *parse_expression(parser *p, bool with_condexpr);
static jinja_node *parse_unary(parser *p, bool with_filter);
static jinja_node *parse_primary(parser *p);
static jinja_node *parse_postfix(parser *p, jinja_node *n);
static jinja_node *parse_filter_expr(parser *p, jinja_node *n);

static bool ends_tuple(parser *p, const char *const *extra_end) {
    tok *t = cur(p);
    if (t->kind == T_VAR_END || t->kind == T_BLOCK_END || t->kind == T_EOF) return true;
    if (is_op(t, ")") || is_op(t, "]") || is_op(t, "}")) return true;
    if (extra_end)
        for (; *extra_end; extra_end++)
            if (is_name(t, *extra_end) || is_op(t, *extra_end)) return true;
    return false;
}

/* for/set targets: a name, ns.attr (set only), or a tuple of them */
static jinja_node *parse_assign_target(parser *p, bool allow_attr, bool allow_tuple,
                                       const char *const *extra_end) {
    tok *start = cur(p);
    kidlist k = {0};
    bool is_tuple = false;
    for (;;) {
        if (k.n && ends_tuple(p, extra_end)) break;
        tok *t = cur(p);
        const char *name = expect_name(p);
        jinja_node *n = node(p, JN_NAME, t);
        n->name = name;
        if (allow_attr && is_op(cur(p), ".")) {
            p->pos++;
            jinja_node *a = node(p, JN_ATTR, t);
            a->a = n;
            a->name = expect_name(p);
            n = a;
        }
        if (!strcmp(name, "true") || !strcmp(name, "false") || !strcmp(name, "none") ||
            !strcmp(name, "True") || !strcmp(name, "False") || !strcmp(name, "None"))
            perr(p, t, "cannot assign to '%s'", name);
        kid_push(p, &k, n, NULL);
        if (!allow_tuple || !is_op(cur(p), ",")) break;
        p->pos++;
        is_tuple = true;
    }
    if (!is_tuple) return k.items[0];
    jinja_node *tup = node(p, JN_TUPLE, start);
    set_kids(tup, &k, false);
    return tup;
}

/* a, b, c -> tuple (or the single expression) */
static jinja_node *parse_tuple(parser *p, bool with_condexpr, const char *const *extra_end,
                               bool explicit_parens) {
    tok *start = cur(p);
    kidlist k = {0};
    bool is_tuple = false;
    for (;;) {
        if (k.n) {
            if (!is_op(cur(p), ",")) break;
            p->pos++;
            is_tuple = true;
        }
        if (ends_tuple(p, extra_end)) break;
        jinja_node *e = parse_expression(p, with_condexpr);
        kid_push(p, &k, e, NULL);
    }
    if (!is_tuple) {
        if (k.n) return k.items[0];
        if (!explicit_parens) perr(p, cur(p), "expected an expression, got '%s'", tok_desc(cur(p)));
    }
    jinja_node *tup = node(p, JN_TUPLE, start);
    set_kids(tup, &k, false);
    return tup;
}

static jinja_node *parse_condexpr(parser *p) {
    tok *start = cur(p);
    jinja_node *expr1 = parse_expression(p, false);
    while (is_name(cur(p), "if")) {
        p->pos++;
        jinja_node *test = parse_expression(p, false);
        jinja_node *expr3 = NULL;
        if (is_name(cur(p), "else")) {
            p->pos++;
            expr3 = parse_condexpr(p);
        }
        jinja_node *n = node(p, JN_COND, start);
        n->a = test;
        n->b = expr1;
        n->c = expr3;
        expr1 = n;
    }
    return expr1;
}

static jinja_node *parse_or(parser *p);

static jinja_node *parse_expression(parser *p, bool with_condexpr) {
    enter(p);
    jinja_node *n = with_condexpr ? parse_condexpr(p) : parse_or(p);
    leave(p);
    return n;
}

static jinja_node *parse_not(parser *p);
static jinja_node *parse_and(parser *p) {
    jinja_node *left = parse_not(p);
    while (is_name(cur(p), "and")) {
        tok *t = cur(p);
        p->pos++;
        jinja_node *n = node(p, JN_AND, t);
        n->a = left;
        n->b = parse_not(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_or(parser *p) {
    jinja_node *left = parse_and(p);
    while (is_name(cur(p), "or")) {
        tok *t = cur(p);
        p->pos++;
        jinja_node *n = node(p, JN_OR, t);
        n->a = left;
        n->b = parse_and(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_compare(parser *p);
static jinja_node *parse_not(parser *p) {
    if (is_name(cur(p), "not")) {
        tok *t = cur(p);
        p->pos++;
        enter(p);
        jinja_node *n = node(p, JN_UNARY, t);
        n->op = JOP_NOT;
        n->a = parse_not(p);
        leave(p);
        return n;
    }
    return parse_compare(p);
}

static jinja_node *parse_math1(parser *p);
static jinja_node *parse_compare(parser *p) {
    jinja_node *left = parse_math1(p);
    for (;;) {
        tok *t = cur(p);
        jinja_op op = JOP_NONE;
        if (is_op(t, "=="))
            op = JOP_EQ;
        else if (is_op(t, "!="))
            op = JOP_NE;
        else if (is_op(t, "<"))
            op = JOP_LT;
        else if (is_op(t, "<="))
            op = JOP_LE;
        else if (is_op(t, ">"))
            op = JOP_GT;
        else if (is_op(t, ">="))
            op = JOP_GE;
        else if (is_name(t, "in"))
            op = JOP_IN;
        else if (is_name(t, "not") && is_name(peek(p, 1), "in"))
            op = JOP_NOTIN;
        if (op == JOP_NONE) break;
        p->pos += op == JOP_NOTIN ? 2 : 1;
        /* chained comparisons (a < b < c) evaluate as (a < b) and (b < c) in Python; templates
         * do not chain, so a chain is parsed left-associatively and evaluated that way */
        jinja_node *n = node(p, JN_BINARY, t);
        n->op = (uint8_t)op;
        n->a = left;
        n->b = parse_math1(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_concat(parser *p);
static jinja_node *parse_math1(parser *p) {
    jinja_node *left = parse_concat(p);
    while (is_op(cur(p), "+") || is_op(cur(p), "-")) {
        tok *t = cur(p);
        p->pos++;
        jinja_node *n = node(p, JN_BINARY, t);
        n->op = t->text[0] == '+' ? JOP_ADD : JOP_SUB;
        n->a = left;
        n->b = parse_concat(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_math2(parser *p);
static jinja_node *parse_concat(parser *p) {
    jinja_node *left = parse_math2(p);
    while (is_op(cur(p), "~")) {
        tok *t = cur(p);
        p->pos++;
        jinja_node *n = node(p, JN_CONCAT, t);
        n->a = left;
        n->b = parse_math2(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_pow(parser *p);
static jinja_node *parse_math2(parser *p) {
    jinja_node *left = parse_pow(p);
    for (;;) {
        tok *t = cur(p);
        jinja_op op = is_op(t, "*")    ? JOP_MUL
                      : is_op(t, "/")  ? JOP_DIV
                      : is_op(t, "//") ? JOP_FLOORDIV
                      : is_op(t, "%")  ? JOP_MOD
                                       : JOP_NONE;
        if (op == JOP_NONE) break;
        p->pos++;
        jinja_node *n = node(p, JN_BINARY, t);
        n->op = (uint8_t)op;
        n->a = left;
        n->b = parse_pow(p);
        left = n;
    }
    return left;
}

static jinja_node *parse_pow(parser *p) {
    jinja_node *left = parse_unary(p, true);
    while (is_op(cur(p), "**")) {
        tok *t = cur(p);
        p->pos++;
        jinja_node *n = node(p, JN_BINARY, t);
        n->op = JOP_POW;
        n->a = left;
        n->b = parse_unary(p, true);
        left = n;
    }
    return left;
}

static jinja_node *parse_unary(parser *p, bool with_filter) {
    tok *t = cur(p);
    jinja_node *n;
    enter(p);
    if (is_op(t, "-") || is_op(t, "+")) {
        p->pos++;
        n = node(p, JN_UNARY, t);
        n->op = t->text[0] == '-' ? JOP_NEG : JOP_POS;
        n->a = parse_unary(p, false);
    } else {
        n = parse_primary(p);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    leave(p);
    return n;
}

static jinja_node *parse_primary(parser *p) {
    tok *t = cur(p);
    jinja_node *n;
    switch (t->kind) {
    case T_NAME:
        p->pos++;
        if (!strcmp(t->text, "true") || !strcmp(t->text, "True")) {
            n = node(p, JN_CONST, t);
            n->value = jv_bool(true);
        } else if (!strcmp(t->text, "false") || !strcmp(t->text, "False")) {
            n = node(p, JN_CONST, t);
            n->value = jv_bool(false);
        } else if (!strcmp(t->text, "none") || !strcmp(t->text, "None")) {
            n = node(p, JN_CONST, t);
            n->value = jv_none();
        } else {
            n = node(p, JN_NAME, t);
            n->name = t->text;
        }
        return n;
    case T_STRING: {
        /* adjacent string literals concatenate */
        size_t total = 0, k = p->pos;
        while (k < p->n_toks && p->toks[k].kind == T_STRING) total += p->toks[k++].len;
        jinja_str *s = palloc(p, sizeof *s + total + 1);
        s->len = 0;
        while (cur(p)->kind == T_STRING) {
            memcpy(s->data + s->len, cur(p)->text, cur(p)->len);
            s->len += cur(p)->len;
            p->pos++;
        }
        s->data[s->len] = '\0';
        n = node(p, JN_CONST, t);
        n->value = (jinja_value){.kind = JV_STR, .s = s};
        return n;
    }
    case T_INT:
        p->pos++;
        n = node(p, JN_CONST, t);
        n->value = jv_int(t->i);
        return n;
    case T_FLOAT:
        p->pos++;
        n = node(p, JN_CONST, t);
        n->value = jv_float(t->f);
        return n;
    case T_OP:
        if (is_op(t, "(")) {
            p->pos++;
            n = parse_tuple(p, true, NULL, true);
            expect_op(p, ")");
            return n;
        }
        if (is_op(t, "[")) {
            p->pos++;
            kidlist k = {0};
            while (!is_op(cur(p), "]")) {
                if (k.n) expect_op(p, ",");
                if (is_op(cur(p), "]")) break;
                kid_push(p, &k, parse_expression(p, true), NULL);
            }
            expect_op(p, "]");
            n = node(p, JN_LIST, t);
            set_kids(n, &k, false);
            return n;
        }
        if (is_op(t, "{")) {
            p->pos++;
            kidlist k = {0};
            while (!is_op(cur(p), "}")) {
                if (k.n) expect_op(p, ",");
                if (is_op(cur(p), "}")) break;
                kid_push(p, &k, parse_expression(p, true), NULL);
                expect_op(p, ":");
                kid_push(p, &k, parse_expression(p, true), NULL);
            }
            expect_op(p, "}");
            n = node(p, JN_DICT, t);
            set_kids(n, &k, false);
            return n;
        }
        break;
    default:
        break;
    }
    perr(p, t, "unexpected '%s'", tok_desc(t));
}

/* (args, kw=args) after the opening parenthesis has been seen */
static void parse_call_args(parser *p, jinja_node *n) {
    expect_op(p, "(");
    kidlist k = {0};
    bool seen_kw = false;
    while (!is_op(cur(p), ")")) {
        if (k.n) expect_op(p, ",");
        if (is_op(cur(p), ")")) break;
        if (is_op(cur(p), "*") || is_op(cur(p), "**"))
            perr(p, cur(p), "*args and **kwargs in calls are not supported%s", NULL);
        if (cur(p)->kind == T_NAME && is_op(peek(p, 1), "=")) {
            const char *name = cur(p)->text;
            p->pos += 2;
            kid_push(p, &k, parse_expression(p, true), name);
            seen_kw = true;
        } else {
            if (seen_kw) perr(p, cur(p), "positional argument after keyword argument%s", NULL);
            kid_push(p, &k, parse_expression(p, true), NULL);
        }
    }
    expect_op(p, ")");
    set_kids(n, &k, true);
}

static jinja_node *parse_subscript(parser *p, jinja_node *target, tok *at) {
    /* [a] or [a:b:c] */
    jinja_node *parts[3] = {NULL, NULL, NULL};
    bool is_slice = false;
    if (!is_op(cur(p), ":")) parts[0] = parse_expression(p, true);
    if (is_op(cur(p), ":")) {
        is_slice = true;
        p->pos++;
        if (!is_op(cur(p), "]") && !is_op(cur(p), ":")) parts[1] = parse_expression(p, true);
        if (is_op(cur(p), ":")) {
            p->pos++;
            if (!is_op(cur(p), "]")) parts[2] = parse_expression(p, true);
        }
    }
    if (!is_slice && is_op(cur(p), ","))
        perr(p, cur(p), "tuple subscripts are not supported%s", NULL);
    expect_op(p, "]");
    jinja_node *n = node(p, is_slice ? JN_SLICE : JN_ITEM, at);
    n->a = target;
    if (is_slice) {
        n->b = parts[0];
        n->c = parts[1];
        n->d = parts[2];
    } else {
        n->b = parts[0];
    }
    return n;
}

static jinja_node *parse_postfix(parser *p, jinja_node *n) {
    for (;;) {
        tok *t = cur(p);
        if (is_op(t, ".")) {
            p->pos++;
            tok *a = cur(p);
            if (a->kind == T_NAME) {
                p->pos++;
                jinja_node *x = node(p, JN_ATTR, t);
                x->a = n;
                x->name = a->text;
                n = x;
            } else if (a->kind == T_INT) {
                p->pos++;
                jinja_node *x = node(p, JN_ITEM, t);
                x->a = n;
                x->b = node(p, JN_CONST, a);
                x->b->value = jv_int(a->i);
                n = x;
            } else {
                perr(p, a, "expected name or number after '.', got '%s'", tok_desc(a));
            }
        } else if (is_op(t, "[")) {
            p->pos++;
            enter(p);
            n = parse_subscript(p, n, t);
            leave(p);
        } else if (is_op(t, "(")) {
            jinja_node *x = node(p, JN_CALL, t);
            x->a = n;
            enter(p);
            parse_call_args(p, x);
            leave(p);
            n = x;
        } else {
            return n;
        }
    }
}

/* name(.name)* as one string; in the arena, so a syntax error midway leaks nothing */
static const char *parse_dotted_name(parser *p) {
    size_t first = p->pos;
    tok *t = cur(p);
    expect_name(p);
    size_t total = t->len;
    while (is_op(cur(p), ".")) {
        p->pos++;
        tok *n = cur(p);
        expect_name(p);
        total += 1 + n->len;
    }
    if (p->pos == first + 1) return t->text;
    char *r = palloc(p, total + 1);
    size_t o = 0;
    for (size_t i = first; i < p->pos; i++) {
        const tok *x = &p->toks[i];
        if (x->kind == T_NAME) {
            memcpy(r + o, x->text, x->len);
            o += x->len;
        } else {
            r[o++] = '.';
        }
    }
    r[o] = '\0';
    return r;
}

static jinja_node *parse_filter(parser *p, jinja_node *target, bool start_inline) {
    while (is_op(cur(p), "|") || start_inline) {
        if (!start_inline) p->pos++;
        start_inline = false;
        jinja_node *n = node(p, JN_FILTER, cur(p));
        n->name = parse_dotted_name(p);
        n->a = target;
        if (is_op(cur(p), "(")) parse_call_args(p, n);
        target = n;
    }
    return target;
}

static jinja_node *parse_test(parser *p, jinja_node *target) {
    tok *t = cur(p);
    p->pos++; /* is */
    bool negated = false;
    if (is_name(cur(p), "not")) {
        p->pos++;
        negated = true;
    }
    jinja_node *n = node(p, JN_TEST, t);
    n->name = parse_dotted_name(p);
    n->a = target;
    n->op = negated;
    tok *c = cur(p);
    if (is_op(c, "(")) {
        parse_call_args(p, n);
    } else if ((c->kind == T_NAME || c->kind == T_STRING || c->kind == T_INT ||
                c->kind == T_FLOAT || is_op(c, "[") || is_op(c, "{")) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) perr(p, c, "You cannot chain multiple tests with is%s", NULL);
        jinja_node *arg = parse_postfix(p, parse_primary(p));
        n->kids = palloc(p, sizeof *n->kids);
        n->kids[0] = arg;
        n->kwnames = palloc(p, sizeof *n->kwnames);
        n->kwnames[0] = NULL;
        n->n_kids = 1;
    }
    return n;
}

static jinja_node *parse_filter_expr(parser *p, jinja_node *n) {
    for (;;) {
        tok *t = cur(p);
        if (is_op(t, "|")) {
            n = parse_filter(p, n, false);
        } else if (is_name(t, "is")) {
            n = parse_test(p, n);
        } else if (is_op(t, "(")) {
            jinja_node *x = node(p, JN_CALL, t);
            x->a = n;
            parse_call_args(p, x);
            n = x;
        } else {
            return n;
        }
    }
}

/* ==== Statements ==== */

static jinja_node *subparse(parser *p, const char *const *end_tokens);

static void expect_block_end(parser *p) {
    expect_kind(p, T_BLOCK_END, "'%}'");
}

/* After a body: `{% name` where name is one of `ends`; consumes `{%` and returns the name. */
static const char *end_name(parser *p) {
    const char *n = cur(p)->text;
    p->pos++;
    return n;
}

static const char *const end_if[] = {"elif", "else", "endif", NULL};
static const char *const end_for[] = {"else", "endfor", NULL};
static const char *const end_endfor[] = {"endfor", NULL};

static jinja_node *parse_if(parser *p, tok *at) {
    jinja_node *n = node(p, JN_IF, at);
    n->a = parse_tuple(p, true, NULL, false);
    expect_block_end(p);
    n->b = subparse(p, end_if);
    const char *e = end_name(p);
    if (!strcmp(e, "elif")) {
        tok *t = &p->toks[p->pos - 1];
        enter(p);
        n->c = parse_if(p, t);
        leave(p);
        return n;
    }
    if (!strcmp(e, "else")) {
        expect_block_end(p);
        static const char *const end_endif[] = {"endif", NULL};
        n->c = subparse(p, end_endif);
        end_name(p);
    }
    expect_block_end(p);
    return n;
}

static jinja_node *parse_for(parser *p, tok *at) {
    jinja_node *n = node(p, JN_FOR, at);
    static const char *const target_end[] = {"in", NULL};
    n->a = parse_assign_target(p, false, true, target_end);
    if (!is_name(cur(p), "in")) perr(p, cur(p), "expected 'in', got '%s'", tok_desc(cur(p)));
    p->pos++;
    static const char *const iter_end[] = {"recursive", NULL};
    n->b = parse_tuple(p, false, iter_end, false);
    if (is_name(cur(p), "if")) {
        p->pos++;
        n->e = parse_expression(p, true);
    }
    if (is_name(cur(p), "recursive")) {
        p->pos++;
        n->op = 1;
    }
    expect_block_end(p);
    n->c = subparse(p, end_for);
    if (!strcmp(end_name(p), "else")) {
        expect_block_end(p);
        n->d = subparse(p, end_endfor);
        end_name(p);
    }
    expect_block_end(p);
    return n;
}

static jinja_node *parse_set(parser *p, tok *at) {
    jinja_node *target = parse_assign_target(p, true, true, NULL);
    if (is_op(cur(p), "=")) {
        p->pos++;
        jinja_node *n = node(p, JN_SET, at);
        n->a = target;
        n->b = parse_tuple(p, true, NULL, false);
        expect_block_end(p);
        return n;
    }
    jinja_node *n = node(p, JN_SET_BLOCK, at);
    n->a = target;
    if (is_op(cur(p), "|")) n->c = parse_filter(p, NULL, false);
    expect_block_end(p);
    static const char *const end_set[] = {"endset", NULL};
    n->b = subparse(p, end_set);
    end_name(p);
    expect_block_end(p);
    return n;
}

/* (a, b=1, ...) parameter list of a macro or a call block */
static jinja_macro_def *parse_signature(parser *p, const char *name) {
    jinja_macro_def *m = palloc(p, sizeof *m);
    *m = (jinja_macro_def){.name = name};
    kidlist k = {0};
    expect_op(p, "(");
    while (!is_op(cur(p), ")")) {
        if (k.n) expect_op(p, ",");
        tok *t = cur(p);
        const char *pn = expect_name(p);
        jinja_node *def = NULL;
        if (is_op(cur(p), "=")) {
            p->pos++;
            def = parse_expression(p, true);
        } else if (k.n && k.items[k.n - 1]) {
            perr(p, t, "non-default argument follows default argument%s", NULL);
        }
        kid_push(p, &k, def, pn);
    }
    expect_op(p, ")");
    m->n_params = k.n;
    m->params = k.names;
    m->defaults = k.items;
    return m;
}

/* Does the body refer to `name` (caller / varargs / kwargs)? */
static bool refers_to(const jinja_node *n, const char *name, int depth) {
    if (!n || depth > JINJA_MAX_NEST * 4) return false;
    if (n->kind == JN_NAME && !strcmp(n->name, name)) return true;
    if (n->kind == JN_MACRO) return false; /* a nested macro has its own */
    jinja_node *ch[] = {n->a, n->b, n->c, n->d, n->e};
    for (size_t i = 0; i < 5; i++)
        if (refers_to(ch[i], name, depth + 1)) return true;
    for (size_t i = 0; i < n->n_kids; i++)
        if (refers_to(n->kids[i], name, depth + 1)) return true;
    return false;
}

static void finish_macro(jinja_macro_def *m) {
    m->uses_caller = refers_to(m->body, "caller", 0);
    m->uses_varargs = refers_to(m->body, "varargs", 0);
    m->uses_kwargs = refers_to(m->body, "kwargs", 0);
}

static jinja_node *parse_macro(parser *p, tok *at) {
    jinja_node *n = node(p, JN_MACRO, at);
    const char *name = expect_name(p);
    n->name = name;
    n->macro = parse_signature(p, name);
    expect_block_end(p);
    static const char *const end_macro[] = {"endmacro", NULL};
    n->macro->body = subparse(p, end_macro);
    end_name(p);
    expect_block_end(p);
    finish_macro(n->macro);
    return n;
}

static jinja_node *parse_call_block(parser *p, tok *at) {
    jinja_node *n = node(p, JN_CALL_BLOCK, at);
    jinja_macro_def *m;
    if (is_op(cur(p), "(")) {
        m = parse_signature(p, "caller");
    } else {
        m = palloc(p, sizeof *m);
        *m = (jinja_macro_def){.name = "caller"};
    }
    n->a = parse_expression(p, true);
    if (n->a->kind != JN_CALL) perr(p, at, "expected a call after 'call'%s", NULL);
    expect_block_end(p);
    static const char *const end_call[] = {"endcall", NULL};
    m->body = subparse(p, end_call);
    end_name(p);
    expect_block_end(p);
    finish_macro(m);
    n->macro = m;
    return n;
}

static jinja_node *parse_filter_block(parser *p, tok *at) {
    jinja_node *n = node(p, JN_FILTER_BLOCK, at);
    n->a = parse_filter(p, NULL, true);
    expect_block_end(p);
    static const char *const end_filter[] = {"endfilter", NULL};
    n->b = subparse(p, end_filter);
    end_name(p);
    expect_block_end(p);
    return n;
}

static bool in_list(const char *name, const char *const *list) {
    if (!list) return false;
    for (; *list; list++)
        if (!strcmp(name, *list)) return true;
    return false;
}

/* Statements until `{% end %}` for an end in end_tokens (the `{%` and name are left for the
 * caller) or the end of the template (only when end_tokens is NULL). */
static jinja_node *subparse(parser *p, const char *const *end_tokens) {
    enter(p);
    tok *first = cur(p);
    kidlist k = {0};
    for (;;) {
        tok *t = cur(p);
        if (t->kind == T_EOF) {
            if (end_tokens) {
                char msg[200];
                snprintf(msg, sizeof msg, "unexpected end of template, expected '%s'",
                         end_tokens[0]);
                perr(p, t, "%s", msg);
            }
            break;
        }
        if (t->kind == T_DATA) {
            jinja_node *n = node(p, JN_DATA, t);
            jinja_str *s = palloc(p, sizeof *s + t->len + 1);
            s->len = t->len;
            memcpy(s->data, t->text, t->len + 1);
            n->value = (jinja_value){.kind = JV_STR, .s = s};
            kid_push(p, &k, n, NULL);
            p->pos++;
            continue;
        }
        if (t->kind == T_VAR_BEGIN) {
            p->pos++;
            jinja_node *n = node(p, JN_OUTPUT, t);
            n->a = parse_tuple(p, true, NULL, false);
            expect_kind(p, T_VAR_END, "'}}'");
            kid_push(p, &k, n, NULL);
            continue;
        }
        if (t->kind != T_BLOCK_BEGIN) perr(p, t, "unexpected '%s'", tok_desc(t));
        tok *kw = peek(p, 1);
        if (kw->kind != T_NAME) perr(p, kw, "tag name expected, got '%s'", tok_desc(kw));
        if (in_list(kw->text, end_tokens)) {
            p->pos++; /* leave the name for end_name() */
            break;
        }
        p->pos += 2;
        const char *w = kw->text;
        jinja_node *n = NULL;
        if (!strcmp(w, "if"))
            n = parse_if(p, kw);
        else if (!strcmp(w, "for"))
            n = parse_for(p, kw);
        else if (!strcmp(w, "set"))
            n = parse_set(p, kw);
        else if (!strcmp(w, "macro"))
            n = parse_macro(p, kw);
        else if (!strcmp(w, "call"))
            n = parse_call_block(p, kw);
        else if (!strcmp(w, "filter"))
            n = parse_filter_block(p, kw);
        else if (!strcmp(w, "break") || !strcmp(w, "continue")) {
            n = node(p, w[0] == 'b' ? JN_BREAK : JN_CONTINUE, kw);
            expect_block_end(p);
        } else if (!strcmp(w, "generation")) {
            /* transformers' AssistantTracker: a call block whose body renders as is (in its
             * own scope, like any caller) */
            expect_block_end(p);
            static const char *const end_gen[] = {"endgeneration", NULL};
            n = node(p, JN_FILTER_BLOCK, kw);
            n->b = subparse(p, end_gen);
            end_name(p);
            expect_block_end(p);
        } else {
            perr(p, kw, "Encountered unknown tag '%s'.", w);
        }
        kid_push(p, &k, n, NULL);
    }
    jinja_node *body = node(p, JN_BODY, first);
    set_kids(body, &k, false);
    leave(p);
    return body;
}

/* ==== Filter and test names: resolved once; unknown ones outside an `if` are errors ==== */

static void check_names(parser *p, jinja_node *n, bool soft, int depth) {
    if (!n || depth > JINJA_MAX_NEST * 8) return; /* deeper nodes look their names up when run */
    if (n->kind == JN_FILTER || n->kind == JN_TEST) {
        bool filter = n->kind == JN_FILTER;
        n->builtin = filter ? jinja_filter_find(n->name) : jinja_test_find(n->name);
        if (!n->builtin && !soft)
            jinja_fail(&p->jump, n->line, n->col, "No %s named '%s'.", filter ? "filter" : "test",
                       n->name);
    }
    bool inner = soft;
    switch (n->kind) {
    case JN_IF:
    case JN_COND:
        inner = true;
        break;
    case JN_FOR:
        check_names(p, n->b, soft, depth + 1);
        check_names(p, n->a, false, depth + 1);
        check_names(p, n->c, false, depth + 1);
        check_names(p, n->d, false, depth + 1);
        check_names(p, n->e, false, depth + 1);
        return;
    case JN_MACRO:
        for (size_t i = 0; i < n->macro->n_params; i++)
            check_names(p, n->macro->defaults[i], false, depth + 1);
        check_names(p, n->macro->body, false, depth + 1);
        return;
    case JN_CALL_BLOCK:
        check_names(p, n->a, soft, depth + 1);
        check_names(p, n->macro->body, false, depth + 1);
        return;
    case JN_SET_BLOCK:
    case JN_FILTER_BLOCK:
        inner = false;
        break;
    default:
        break;
    }
    jinja_node *ch[] = {n->a, n->b, n->c, n->d, n->e};
    for (size_t i = 0; i < 5; i++) check_names(p, ch[i], inner, depth + 1);
    for (size_t i = 0; i < n->n_kids; i++) check_names(p, n->kids[i], inner, depth + 1);
}

/* ==== Entry ==== */

bool jinja_parse(jinja_template *t, const char *src, size_t len, moe_error *err) {
    if (len > JINJA_MAX_SOURCE) {
        moe_error_set(err, MOE_ERR_RANGE, "template of %zu bytes is over the %u byte limit", len,
                      JINJA_MAX_SOURCE);
        return false;
    }
    parser *p = calloc(1, sizeof *p);
    if (!p) moe_die("out of memory");
    p->t = t;
    p->jump.err = err;
    if (setjmp(p->jump.env)) {
        free(p);
        return false;
    }
    /* newlines: \r\n and \r become \n; one trailing newline goes */
    char *norm = palloc(p, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = '\0';
    p->src = norm;
    p->n = n;
    lexer lx = {.p = p, .s = norm, .n = n, .line = 1};
    lex(&lx);
    push_tok(&lx, T_EOF, n);
    t->root = subparse(p, NULL);
    check_names(p, t->root, false, 0);
    free(p);
    return true;
}
