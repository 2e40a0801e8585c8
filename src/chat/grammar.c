/* grammar.c (chat): grammars for structured output -- JSON Schema to GBNF, any JSON object, a
 * forced tool call in the model's own call format -- and the token trie of a tokenizer.
 *
 * The output is GBNF text for the engine's grammar parser (src/engine/grammar.c), so a client's
 * own grammar and ours take the same path. Every JSON value is followed by `ws`, a bounded run
 * of whitespace (a model must not be able to write spaces forever), and numbers have bounded
 * digits. A schema feature we cannot express is an error that names its JSON path, except
 * `pattern` (plain string when the regex is beyond what we translate) and `format` (ignored).
 * The trap: the rules constrain generation, they do not validate it -- they must never allow
 * text that the schema rejects, but they may allow less than the schema does (object
 * properties come in the schema's order; additional properties are not generated). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine/engine.h"
#include "chat.h"

#define SCHEMA_MAX_DEPTH  64    /* nested schemas: each level is a C frame */
#define SCHEMA_MAX_RULES  10000 /* rules generated for one schema */
#define SCHEMA_INT_DIGITS 15    /* integers without bounds: at most this many digits */

typedef struct conv {
    json_t *root;     /* the whole schema ($ref targets) */
    moe_strbuf rules; /* GBNF rules written so far */
    uint32_t n_rules;
    json_t *defined; /* rule name -> true: written (or being written) */
    moe_error *err;
    bool failed;
    uint32_t root_tag; /* which schema root: $ref rules of different roots never mix */
} conv;

static bool conv_fail(conv *c, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool conv_fail(conv *c, const char *path, const char *fmt, ...) {
    if (c->failed) return false;
    c->failed = true;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_error_set(c->err, MOE_ERR_ARG, "schema %s: %s", path[0] ? path : "(root)", msg);
    return false;
}

/* A GBNF string literal of these bytes. */
static void put_literal(moe_strbuf *b, const char *s, size_t n) {
    moe_strbuf_putc(b, '"');
    for (size_t i = 0; i < n; i++) {
        const unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            moe_strbuf_putc(b, '\\');
            moe_strbuf_putc(b, (char)ch);
        } else if (ch < 0x20 || ch == 0x7f) {
            moe_strbuf_printf(b, "\\x%02X", ch);
        } else {
            moe_strbuf_putc(b, (char)ch);
        }
    }
    moe_strbuf_putc(b, '"');
}

/* A JSON value written compactly, as a GBNF literal followed by ws. */
static void put_json_literal(moe_strbuf *b, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    put_literal(b, s, strlen(s));
    moe_strbuf_puts(b, " ws");
    free(s);
}

/* The primitives, each written once when first used. */
static const struct {
    const char *name, *body;
} primitives[] = {
    {"ws", "| \" \" | \"\\n\" [ \\t]{0,20}"},
    /* \u escapes: no lone surrogates and no NUL (parsers refuse them) */
    {"char", "[^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" hex-escape)"},
    {"hex-escape", "[1-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2} | \"0\" "
                   "[1-9a-fA-F] [0-9a-fA-F]{2} | \"00\" [1-9a-fA-F] [0-9a-fA-F] | \"000\" "
                   "[1-9a-fA-F]"},
    {"string", "\"\\\"\" char* \"\\\"\" ws"},
    {"integer", "\"-\"? ([0-9] | [1-9] [0-9]{0,14}) ws"},
    {"number",
     "\"-\"? ([0-9] | [1-9] [0-9]{0,14}) (\".\" [0-9]{1,15})? ([eE] [-+]? [0-9]{1,2})? ws"},
    {"boolean", "(\"true\" | \"false\") ws"},
    {"null", "\"null\" ws"},
    {"value", "object | array | string | number | boolean | null"},
    {"object", "\"{\" ws (string \":\" ws value (\",\" ws string \":\" ws value)*)? \"}\" ws"},
    {"array", "\"[\" ws (value (\",\" ws value)*)? \"]\" ws"},
};

static const char *use(conv *c, const char *name);

static void define(conv *c, const char *name, const char *body) {
    json_object_set_new(c->defined, name, json_true());
    moe_strbuf_printf(&c->rules, "%s ::= %s\n", name, body);
}

/* The primitive's name, its rule (and those it needs) written on first use. */
static const char *use(conv *c, const char *name) {
    if (json_object_get(c->defined, name)) return name;
    for (size_t i = 0; i < sizeof primitives / sizeof *primitives; i++)
        if (strcmp(primitives[i].name, name) == 0) {
            define(c, name, primitives[i].body);
            static const char *const needs[] = {"ws",      "char", "hex-escape", "string", "number",
                                                "boolean", "null", "object",     "array",  "value"};
            for (size_t k = 0; k < sizeof needs / sizeof *needs; k++)
                if (strstr(primitives[i].body, needs[k])) use(c, needs[k]);
            return name;
        }
    moe_die("no primitive %s", name);
}

static char *new_rule_name(conv *c, const char *hint) {
    char name[96];
    size_t k = 0;
    for (const char *s = hint; *s && k < 48; s++)
        name[k++] =
            (char)((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9')
                       ? *s
                       : '-');
    snprintf(name + k, sizeof name - k, "-%u", c->n_rules++);
    return moe_xstrdup(name);
}

static void visit(conv *c, json_t *s, const char *path, int depth, moe_strbuf *out);

/* A rule whose body is the schema's grammar; returns its name (caller frees). */
static char *visit_rule(conv *c, json_t *s, const char *path, const char *hint, int depth) {
    char *name = new_rule_name(c, hint);
    if (c->n_rules > SCHEMA_MAX_RULES) {
        conv_fail(c, path, "more than %d rules", SCHEMA_MAX_RULES);
        return name;
    }
    moe_strbuf body = {0};
    visit(c, s, path, depth + 1, &body);
    define(c, name, body.s ? body.s : "\"\"");
    moe_strbuf_free(&body);
    return name;
}

/* ==== Integers in a range: digit-by-digit alternatives ==== */

/* Non-negative a..b with exactly n digits each (leading zeros part of the width). */
static void digits_range(moe_strbuf *b, const char *lo, const char *hi, size_t n) {
    if (n == 0) {
        moe_strbuf_puts(b, "\"\"");
        return;
    }
    if (strspn(lo, "0") >= n && strspn(hi, "9") >= n) { /* every n-digit string */
        moe_strbuf_printf(b, "[0-9]{%zu}", n);
        return;
    }
    if (lo[0] == hi[0]) {
        moe_strbuf_printf(b, "\"%c\" (", lo[0]);
        digits_range(b, lo + 1, hi + 1, n - 1);
        moe_strbuf_puts(b, ")");
        return;
    }
    char nines[32], zeros[32];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    nines[n - 1] = zeros[n - 1] = 0;
    moe_strbuf_printf(b, "(\"%c\" (", lo[0]);
    digits_range(b, lo + 1, nines, n - 1);
    moe_strbuf_puts(b, ")");
    if (hi[0] - lo[0] >= 2) {
        moe_strbuf_printf(b, " | [%c-%c]", lo[0] + 1, hi[0] - 1);
        if (n > 1) moe_strbuf_printf(b, " [0-9]{%zu}", n - 1);
    }
    moe_strbuf_printf(b, " | \"%c\" (", hi[0]);
    digits_range(b, zeros, hi + 1, n - 1);
    moe_strbuf_puts(b, "))");
}

/* Non-negative lo..hi written without leading zeros. */
static void natural_range(moe_strbuf *b, uint64_t lo, uint64_t hi) {
    char l[24], h[24];
    snprintf(l, sizeof l, "%llu", (unsigned long long)lo);
    snprintf(h, sizeof h, "%llu", (unsigned long long)hi);
    const size_t nl = strlen(l), nh = strlen(h);
    moe_strbuf_puts(b, "(");
    for (size_t n = nl; n <= nh; n++) {
        char a[24], z[24];
        if (n == nl) {
            memcpy(a, l, nl + 1);
        } else {
            memset(a, '0', n);
            a[0] = '1';
            a[n] = 0;
        }
        if (n == nh) {
            memcpy(z, h, nh + 1);
        } else {
            memset(z, '9', n);
            z[n] = 0;
        }
        if (n > nl) moe_strbuf_puts(b, " | ");
        digits_range(b, a, z, n);
    }
    moe_strbuf_puts(b, ")");
}

static bool int_bound(json_t *s, const char *key, const char *ex_key, bool upper, int64_t *out) {
    json_t *v = json_object_get(s, key), *x = json_object_get(s, ex_key);
    bool have = false;
    double best = 0;
    if (json_is_number(v)) {
        best = upper ? floor(json_number_value(v)) : ceil(json_number_value(v));
        have = true;
    }
    if (json_is_number(x)) {
        const double e = json_number_value(x);
        const double d = upper ? ceil(e) - 1 : floor(e) + 1;
        if (!have || (upper ? d < best : d > best)) best = d;
        have = true;
    }
    if (have) *out = best > 9e15 ? (int64_t)9e15 : best < -9e15 ? (int64_t)-9e15 : (int64_t)best;
    return have;
}

static void visit_integer(conv *c, json_t *s, const char *path, moe_strbuf *out) {
    int64_t lo = 0, hi = 0;
    const bool has_lo = int_bound(s, "minimum", "exclusiveMinimum", false, &lo);
    const bool has_hi = int_bound(s, "maximum", "exclusiveMaximum", true, &hi);
    if (!has_lo && !has_hi) {
        moe_strbuf_puts(out, use(c, "integer"));
        return;
    }
    const int64_t big = 999999999999999; /* SCHEMA_INT_DIGITS nines */
    if (!has_lo) lo = -big;
    if (!has_hi) hi = big;
    if (lo > hi) {
        conv_fail(c, path, "no integer lies between the minimum and the maximum");
        return;
    }
    moe_strbuf_puts(out, "(");
    bool any = false;
    if (lo < 0) { /* the negative part: -(min(-1, hi))..-lo */
        moe_strbuf_puts(out, "\"-\" ");
        natural_range(out, (uint64_t)(hi < 0 ? -hi : 1), (uint64_t)-lo);
        any = true;
    }
    if (hi >= 0) {
        if (any) moe_strbuf_puts(out, " | ");
        natural_range(out, (uint64_t)(lo > 0 ? lo : 0), (uint64_t)hi);
    }
    moe_strbuf_printf(out, ") %s", use(c, "ws"));
}

/* ==== Strings and patterns ==== */

typedef struct rx {
    const char *s;
    size_t pos, len;
    bool bad;
    int depth;
} rx;

static void rx_alt(rx *r, moe_strbuf *out);

/* One escaped character of a regex class or atom, as a GBNF class fragment; false if not one. */
static bool rx_escape(rx *r, moe_strbuf *out, bool in_class) {
    const char e = r->s[r->pos++];
    const char *cls = e == 'd' ? "0-9" : e == 'w' ? "a-zA-Z0-9_" : e == 's' ? " \\t\\n\\r" : NULL;
    if (cls) {
        moe_strbuf_printf(out, in_class ? "%s" : "[%s]", cls);
        return true;
    }
    if (e == 'D' || e == 'W' || e == 'S' || e == 'b' || e == 'B' || (e >= '1' && e <= '9'))
        return false;
    const char lit = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
    if (in_class) {
        if (lit == ']' || lit == '\\' || lit == '-' || lit == '^' || lit == '"')
            moe_strbuf_putc(out, '\\');
        if (lit == '\n' || lit == '\t' || lit == '\r')
            moe_strbuf_printf(out, "\\x%02X", lit);
        else
            moe_strbuf_putc(out, lit);
    } else {
        put_literal(out, &lit, 1);
    }
    return true;
}

/* A regex atom: literal, ., class, group, escape. */
static void rx_atom(rx *r, moe_strbuf *out) {
    const char ch = r->s[r->pos];
    if (ch == '(') {
        r->pos++;
        if (r->pos + 1 < r->len && r->s[r->pos] == '?') {
            if (r->s[r->pos + 1] != ':') {
                r->bad = true; /* lookarounds, named groups */
                return;
            }
            r->pos += 2;
        }
        if (++r->depth > 32) {
            r->bad = true;
            return;
        }
        moe_strbuf_puts(out, "(");
        rx_alt(r, out);
        moe_strbuf_puts(out, ")");
        r->depth--;
        if (r->pos >= r->len || r->s[r->pos] != ')') r->bad = true;
        r->pos++;
    } else if (ch == '[') {
        r->pos++;
        moe_strbuf_puts(out, "[");
        if (r->pos < r->len && r->s[r->pos] == '^') {
            moe_strbuf_puts(out, "^\"\\\\\\x00-\\x1F");
            r->pos++;
        }
        while (r->pos < r->len && r->s[r->pos] != ']' && !r->bad) {
            if (r->s[r->pos] == '\\' && r->pos + 1 < r->len) {
                r->pos++;
                if (!rx_escape(r, out, true)) r->bad = true;
            } else {
                const char lit = r->s[r->pos++];
                if (lit == '"' || lit == '\\' || lit == '[') r->bad = true; /* keep JSON simple */
                moe_strbuf_putc(out, lit);
            }
        }
        if (r->pos >= r->len) r->bad = true;
        r->pos++;
        moe_strbuf_puts(out, "]");
    } else if (ch == '.') {
        r->pos++;
        moe_strbuf_puts(out, "[^\"\\\\\\x00-\\x1F\\n]");
    } else if (ch == '\\' && r->pos + 1 < r->len) {
        r->pos++;
        if (!rx_escape(r, out, false)) r->bad = true;
    } else if (ch == '"') {
        r->pos++;
        moe_strbuf_puts(out, "\"\\\\\\\"\""); /* a quote inside a JSON string is \" */
    } else if (ch == '^' || ch == '$' || ch == ')' || ch == '|' || ch == '*' || ch == '+' ||
               ch == '?' || ch == '{' || (unsigned char)ch < 0x20) {
        r->bad = true;
    } else {
        size_t n = 1; /* one UTF-8 character */
        while (r->pos + n < r->len && ((unsigned char)r->s[r->pos + n] & 0xC0) == 0x80) n++;
        put_literal(out, r->s + r->pos, n);
        r->pos += n;
    }
}

static void rx_seq(rx *r, moe_strbuf *out) {
    while (r->pos < r->len && !r->bad && r->s[r->pos] != '|' && r->s[r->pos] != ')') {
        if (r->s[r->pos] == '$' && r->pos + 1 == r->len) {
            r->pos++;
            break;
        }
        moe_strbuf_puts(out, " (");
        rx_atom(r, out);
        moe_strbuf_puts(out, ")");
        if (r->pos < r->len && strchr("*+?", r->s[r->pos])) {
            moe_strbuf_putc(out, r->s[r->pos++]);
        } else if (r->pos < r->len && r->s[r->pos] == '{') {
            const char *close = memchr(r->s + r->pos, '}', r->len - r->pos);
            if (!close || close - (r->s + r->pos) > 24) {
                r->bad = true;
                return;
            }
            unsigned m = 0, n = 0;
            char tail;
            const int got = sscanf(r->s + r->pos, "{%u,%u%c", &m, &n, &tail);
            if (got == 3 && tail == '}' && n >= m && n <= 1000)
                moe_strbuf_printf(out, "{%u,%u}", m, n);
            else if (sscanf(r->s + r->pos, "{%u%c", &m, &tail) == 2 && m <= 1000)
                moe_strbuf_printf(out, tail == '}' ? "{%u}" : "{%u,}", m);
            else
                r->bad = true;
            r->pos = (size_t)(close - r->s) + 1;
        }
        if (r->pos < r->len && r->s[r->pos] == '?') r->bad = true; /* lazy quantifiers */
    }
}

static void rx_alt(rx *r, moe_strbuf *out) {
    rx_seq(r, out);
    while (!r->bad && r->pos < r->len && r->s[r->pos] == '|') {
        r->pos++;
        moe_strbuf_puts(out, " |");
        rx_seq(r, out);
    }
}

/* The pattern as the inside of a JSON string; false when it uses what we do not translate. */
static bool pattern_grammar(const char *pat, moe_strbuf *out) {
    rx r = {.s = pat, .len = strlen(pat)};
    if (r.len && pat[0] == '^') r.pos++;
    moe_strbuf_puts(out, "(");
    rx_alt(&r, out);
    moe_strbuf_puts(out, ")");
    return !r.bad && r.pos == r.len;
}

/* The translated pattern is GBNF the engine takes (a reversed range would not be). */
static bool gbnf_parses(const char *expr) {
    moe_strbuf b = {0};
    moe_strbuf_printf(&b, "root ::= %s\n", expr);
    moe_error err = {0};
    moe_grammar *g = moe_grammar_parse(b.s, b.len, NULL, &err);
    moe_strbuf_free(&b);
    moe_grammar_free(g);
    return g != NULL;
}

static void visit_string(conv *c, json_t *s, moe_strbuf *out) {
    const char *pattern = json_string_value(json_object_get(s, "pattern"));
    if (pattern) {
        moe_strbuf inner = {0};
        if (pattern_grammar(pattern, &inner) && gbnf_parses(inner.s)) {
            moe_strbuf_printf(out, "\"\\\"\" %s \"\\\"\" %s", inner.s, use(c, "ws"));
            moe_strbuf_free(&inner);
            return;
        }
        moe_strbuf_free(&inner); /* beyond us: any string */
    }
    json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
    if (!json_is_integer(mn) && !json_is_integer(mx)) {
        moe_strbuf_puts(out, use(c, "string"));
        return;
    }
    json_int_t lo = json_is_integer(mn) ? json_integer_value(mn) : 0;
    if (lo < 0) lo = 0;
    use(c, "char");
    if (json_is_integer(mx))
        moe_strbuf_printf(out, "\"\\\"\" char{%lld,%lld} \"\\\"\" %s", (long long)lo,
                          (long long)json_integer_value(mx), use(c, "ws"));
    else
        moe_strbuf_printf(out, "\"\\\"\" char{%lld,} \"\\\"\" %s", (long long)lo, use(c, "ws"));
}

/* ==== Objects and arrays ==== */

/* A rule for items[0..n) in order, each written when required[i] and optional otherwise, with
 * the GBNF expression sep (may be "") between two written ones; returns its name (free it).
 * rest_i: items i.. after one was written (each behind sep); first_i: none written yet. */
static char *sequence_rule(conv *c, char *const *items, const bool *required, size_t n,
                           const char *sep) {
    char **rest = moe_xcalloc(n + 1, sizeof *rest), **first = moe_xcalloc(n + 1, sizeof *first);
    rest[n] = moe_xstrdup("\"\"");
    first[n] = moe_xstrdup("\"\"");
    for (size_t k = n; k-- > 0;) {
        moe_strbuf b = {0};
        if (required[k])
            moe_strbuf_printf(&b, "%s %s %s", sep, items[k], rest[k + 1]);
        else
            moe_strbuf_printf(&b, "(%s %s)? %s", sep, items[k], rest[k + 1]);
        rest[k] = new_rule_name(c, "rest");
        define(c, rest[k], b.s);
        moe_strbuf_reset(&b);
        if (required[k])
            moe_strbuf_printf(&b, "%s %s", items[k], rest[k + 1]);
        else
            moe_strbuf_printf(&b, "%s %s | %s", items[k], rest[k + 1], first[k + 1]);
        first[k] = new_rule_name(c, "props");
        define(c, first[k], b.s);
        moe_strbuf_free(&b);
    }
    char *out = first[0];
    for (size_t k = 0; k <= n; k++) {
        free(rest[k]);
        if (k) free(first[k]);
    }
    free(rest);
    free(first);
    return out;
}

static void visit_object(conv *c, json_t *s, const char *path, int depth, moe_strbuf *out) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    if (!json_is_object(props) || !json_object_size(props)) {
        json_t *ap = json_object_get(s, "additionalProperties");
        if (json_is_object(ap)) { /* a map: any keys, values of that schema */
            char p2[512];
            snprintf(p2, sizeof p2, "%s/additionalProperties", path);
            char *v = visit_rule(c, ap, p2, "map-value", depth);
            const char *str = use(c, "string");
            moe_strbuf_printf(out, "\"{\" %s (%s \":\" %s %s (\",\" %s %s \":\" %s %s)*)? \"}\" %s",
                              use(c, "ws"), str, "ws", v, "ws", str, "ws", v, "ws");
            free(v);
        } else if (json_is_false(ap)) {
            moe_strbuf_printf(out, "\"{\" %s \"}\" %s", use(c, "ws"), "ws");
        } else {
            moe_strbuf_puts(out, use(c, "object"));
        }
        return;
    }
    const size_t n = json_object_size(props);
    char **kv = moe_xcalloc(n, sizeof *kv);
    bool *required = moe_xcalloc(n, sizeof *required);
    const char *key;
    json_t *ps;
    size_t i = 0;
    use(c, "ws");
    json_object_foreach(props, key, ps) {
        char p2[512];
        snprintf(p2, sizeof p2, "%s/properties/%s", path, key);
        char *v = visit_rule(c, ps, p2, key, depth);
        moe_strbuf b = {0};
        json_t *k = json_string(key);
        put_json_literal(&b, k);
        json_decref(k);
        moe_strbuf_printf(&b, " \":\" ws %s", v);
        free(v);
        kv[i] = moe_strbuf_take(&b);
        size_t r;
        json_t *rv;
        json_array_foreach(req, r, rv) if (json_is_string(rv) &&
                                           !strcmp(json_string_value(rv), key)) required[i] = true;
        i++;
    }
    char *seq = sequence_rule(c, kv, required, n, "\",\" ws");
    moe_strbuf_printf(out, "\"{\" ws %s \"}\" ws", seq);
    free(seq);
    for (size_t k = 0; k < n; k++) free(kv[k]);
    free(kv);
    free(required);
}

static void visit_array(conv *c, json_t *s, const char *path, int depth, moe_strbuf *out) {
    json_t *items = json_object_get(s, "items");
    if (json_object_get(s, "prefixItems") || json_is_array(items)) {
        conv_fail(c, path, "tuples (prefixItems, items as an array) are not supported");
        return;
    }
    char p2[512];
    snprintf(p2, sizeof p2, "%s/items", path);
    char *item = items ? visit_rule(c, items, p2, "item", depth) : moe_xstrdup(use(c, "value"));
    json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    long long lo = json_is_integer(mn) ? json_integer_value(mn) : 0;
    long long hi = json_is_integer(mx) ? json_integer_value(mx) : -1;
    if (lo < 0) lo = 0;
    if (lo > 1000 || hi > 1000) {
        free(item);
        conv_fail(c, path, "minItems / maxItems above 1000 are not supported");
        return;
    }
    if (hi >= 0 && hi < lo) {
        free(item);
        conv_fail(c, path, "maxItems is below minItems");
        return;
    }
    use(c, "ws");
    moe_strbuf_puts(out, "\"[\" ws ");
    if (hi != 0) {
        moe_strbuf_printf(out, "(%s (\",\" ws %s){%lld,", item, item, lo ? lo - 1 : 0);
        if (hi > 0) moe_strbuf_printf(out, "%lld", hi - 1);
        moe_strbuf_printf(out, "})%s", lo ? "" : "?");
    }
    moe_strbuf_puts(out, " \"]\" ws");
    free(item);
}

/* ==== Schemas ==== */

static void visit_ref(conv *c, const char *ref, const char *path, int depth, moe_strbuf *out) {
    const char *name = NULL;
    json_t *defs = NULL;
    if (!strncmp(ref, "#/$defs/", 8)) {
        defs = json_object_get(c->root, "$defs");
        name = ref + 8;
    } else if (!strncmp(ref, "#/definitions/", 14)) {
        defs = json_object_get(c->root, "definitions");
        name = ref + 14;
    }
    if (!strcmp(ref, "#")) {
        defs = NULL;
        name = "";
    } else if (!name || strchr(name, '/')) {
        conv_fail(c, path, "$ref '%s': only #, #/$defs/NAME and #/definitions/NAME are supported",
                  ref);
        return;
    }
    json_t *target = defs ? json_object_get(defs, name) : (name ? c->root : NULL);
    if (!target) {
        conv_fail(c, path, "$ref '%s' points at nothing", ref);
        return;
    }
    char key[300], hint[128];
    snprintf(key, sizeof key, "%u#ref#%s", c->root_tag, name); /* rule names never hold '#' */
    snprintf(hint, sizeof hint, "ref-%s", name);
    json_t *known = json_object_get(c->defined, key);
    if (known) {
        moe_strbuf_puts(out, json_string_value(known));
        return;
    }
    char *rn = new_rule_name(c, hint);
    json_object_set_new(c->defined, key, json_string(rn)); /* before: recursion refers to it */
    moe_strbuf body = {0};
    visit(c, target, ref, depth + 1, &body);
    define(c, rn, body.s ? body.s : "\"\"");
    moe_strbuf_free(&body);
    moe_strbuf_puts(out, rn);
    free(rn);
}

static void visit_alternatives(conv *c, json_t *list, const char *path, const char *what, int depth,
                               moe_strbuf *out) {
    if (!json_is_array(list) || !json_array_size(list)) {
        conv_fail(c, path, "%s: expected a non-empty array", what);
        return;
    }
    size_t i;
    json_t *v;
    moe_strbuf_puts(out, "(");
    json_array_foreach(list, i, v) {
        char p2[512];
        snprintf(p2, sizeof p2, "%s/%s/%zu", path, what, i);
        char *r = visit_rule(c, v, p2, what, depth);
        moe_strbuf_printf(out, "%s%s", i ? " | " : "", r);
        free(r);
    }
    moe_strbuf_puts(out, ")");
}

static void visit_type(conv *c, json_t *s, const char *type, const char *path, int depth,
                       moe_strbuf *out) {
    if (!strcmp(type, "object"))
        visit_object(c, s, path, depth, out);
    else if (!strcmp(type, "array"))
        visit_array(c, s, path, depth, out);
    else if (!strcmp(type, "string"))
        visit_string(c, s, out);
    else if (!strcmp(type, "integer"))
        visit_integer(c, s, path, out);
    else if (!strcmp(type, "number"))
        moe_strbuf_puts(out, use(c, "number"));
    else if (!strcmp(type, "boolean"))
        moe_strbuf_puts(out, use(c, "boolean"));
    else if (!strcmp(type, "null"))
        moe_strbuf_puts(out, use(c, "null"));
    else
        conv_fail(c, path, "unknown type '%s'", type);
}

static void visit(conv *c, json_t *s, const char *path, int depth, moe_strbuf *out) {
    if (c->failed) return;
    if (depth > SCHEMA_MAX_DEPTH) {
        conv_fail(c, path, "nested deeper than %d", SCHEMA_MAX_DEPTH);
        return;
    }
    if (json_is_true(s) || (json_is_object(s) && !json_object_size(s))) {
        moe_strbuf_puts(out, use(c, "value"));
        return;
    }
    if (!json_is_object(s)) {
        conv_fail(c, path, "expected a schema (an object or true)");
        return;
    }
    json_t *v;
    if ((v = json_object_get(s, "$ref"))) {
        if (!json_is_string(v)) {
            conv_fail(c, path, "$ref: expected a string");
            return;
        }
        visit_ref(c, json_string_value(v), path, depth, out);
    } else if ((v = json_object_get(s, "const"))) {
        use(c, "ws");
        put_json_literal(out, v);
    } else if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v)) {
            conv_fail(c, path, "enum: expected a non-empty array");
            return;
        }
        use(c, "ws");
        size_t i;
        json_t *e;
        moe_strbuf_puts(out, "(");
        json_array_foreach(v, i, e) {
            if (i) moe_strbuf_puts(out, " | ");
            put_json_literal(out, e);
        }
        moe_strbuf_puts(out, ")");
    } else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        visit_alternatives(c, v, path, json_object_get(s, "anyOf") ? "anyOf" : "oneOf", depth, out);
    } else if ((v = json_object_get(s, "allOf"))) {
        if (json_is_array(v) && json_array_size(v) == 1)
            visit(c, json_array_get(v, 0), path, depth + 1, out);
        else
            conv_fail(c, path, "allOf with more than one schema is not supported");
    } else if ((v = json_object_get(s, "type"))) {
        if (json_is_string(v)) {
            visit_type(c, s, json_string_value(v), path, depth, out);
        } else if (json_is_array(v) && json_array_size(v)) {
            size_t i;
            json_t *t;
            moe_strbuf_puts(out, "(");
            json_array_foreach(v, i, t) {
                if (!json_is_string(t)) {
                    conv_fail(c, path, "type: expected a string or an array of strings");
                    return;
                }
                if (i) moe_strbuf_puts(out, " | ");
                visit_type(c, s, json_string_value(t), path, depth, out);
            }
            moe_strbuf_puts(out, ")");
        } else {
            conv_fail(c, path, "type: expected a string or an array of strings");
        }
    } else if (json_object_get(s, "properties")) {
        visit_object(c, s, path, depth, out);
    } else if (json_object_get(s, "items")) {
        visit_array(c, s, path, depth, out);
    } else {
        moe_strbuf_puts(out, use(c, "value"));
    }
}

char *moe_chat_schema_grammar(const char *schema_json, const char *prefix, moe_error *err) {
    json_error_t je;
    json_t *schema = json_loads(schema_json, JSON_DECODE_ANY, &je);
    if (!schema) {
        moe_error_set(err, MOE_ERR_ARG, "schema: not JSON (%s at %d:%d)", je.text, je.line,
                      je.column);
        return NULL;
    }
    conv c = {.root = schema, .defined = json_object(), .err = err};
    char *r = visit_rule(&c, schema, "", "schema", 0);
    moe_strbuf_printf(&c.rules, "root ::= %s%s\n", prefix ? prefix : "", r);
    free(r);
    json_decref(c.defined);
    json_decref(schema);
    if (c.failed) {
        moe_strbuf_free(&c.rules);
        return NULL;
    }
    return moe_strbuf_take(&c.rules);
}

/* ==== Forced tool calls ==== */

/* A string parameter written raw (the XML-ish formats, Gemma 4): an enum's values, text of a
 * bounded length without '<', or any text in which '<' is never followed by the shape's
 * raw_stop (nor ends it), so the value cannot close its tag early; never a NUL. */
static void raw_string(conv *c, const moe_chat_call_shape *sh, json_t *s, moe_strbuf *out) {
    put_literal(out, sh->str_open, strlen(sh->str_open));
    json_t *en = json_object_get(s, "enum"), *mn = json_object_get(s, "minLength"),
           *mx = json_object_get(s, "maxLength");
    if (json_is_array(en) && json_array_size(en)) {
        moe_strbuf_puts(out, " (");
        size_t i;
        json_t *v;
        json_array_foreach(en, i, v) {
            if (!json_is_string(v)) continue; /* not a string: never valid here */
            moe_strbuf_puts(out, i ? " | " : "");
            put_literal(out, json_string_value(v), json_string_length(v));
        }
        moe_strbuf_puts(out, ")");
    } else if (json_is_integer(mn) || json_is_integer(mx)) {
        const long long lo = json_is_integer(mn) && json_integer_value(mn) > 0
                                 ? (long long)json_integer_value(mn)
                                 : 0;
        if (json_is_integer(mx))
            moe_strbuf_printf(out, " [^<\\x00]{%lld,%lld}", lo, (long long)json_integer_value(mx));
        else
            moe_strbuf_printf(out, " [^<\\x00]{%lld,}", lo);
    } else {
        char name[32];
        snprintf(name, sizeof name, "raw-text-%02x", (unsigned)(unsigned char)sh->raw_stop);
        if (!json_object_get(c->defined, name)) {
            char body[64];
            snprintf(body, sizeof body, "([^<\\x00] | \"<\"+ [^<\\x00\\x%02X])*",
                     (unsigned)(unsigned char)sh->raw_stop);
            define(c, name, body);
        }
        moe_strbuf_printf(out, " %s", name);
    }
    moe_strbuf_putc(out, ' ');
    put_literal(out, sh->str_close, strlen(sh->str_close));
}

/* A tool's arguments as the shape's parameter entries (key_open set), in the schema's order,
 * the required ones always. */
static void param_entries(conv *c, const moe_chat_call_shape *sh, json_t *schema, const char *path,
                          int depth, moe_strbuf *out) {
    json_t *props = json_object_get(schema, "properties"),
           *req = json_object_get(schema, "required");
    const size_t n = json_object_size(props);
    char **items = moe_xcalloc(n + 1, sizeof *items);
    bool *required = moe_xcalloc(n + 1, sizeof *required);
    const char *key;
    json_t *ps;
    size_t i = 0;
    json_object_foreach(props, key, ps) {
        char p2[512];
        snprintf(p2, sizeof p2, "%s/properties/%s", path, key);
        const char *type = moe_chat_schema_type(ps);
        bool is_string = type && !strcmp(type, "string");
        if (!type && !sh->nested_json) { /* an enum of strings only: written as a string */
            json_t *en = json_object_get(ps, "enum"), *v;
            size_t k;
            is_string = json_array_size(en) > 0;
            json_array_foreach(en, k, v) is_string = is_string && json_is_string(v);
        }
        moe_strbuf b = {0};
        put_literal(&b, sh->key_open, strlen(sh->key_open));
        moe_strbuf_putc(&b, ' ');
        put_literal(&b, key, strlen(key));
        moe_strbuf_putc(&b, ' ');
        const char *mid = is_string && sh->key_mid_string ? sh->key_mid_string : sh->key_mid;
        put_literal(&b, mid, strlen(mid));
        moe_strbuf_putc(&b, ' ');
        if (is_string) {
            raw_string(c, sh, ps, &b);
        } else if (!sh->nested_json &&
                   !(type && (!strcmp(type, "integer") || !strcmp(type, "number") ||
                              !strcmp(type, "boolean") || !strcmp(type, "null")))) {
            conv_fail(c, p2, "this call format writes only strings, numbers, booleans and null");
        } else {
            char *v = visit_rule(c, ps, p2, key, depth);
            moe_strbuf_puts(&b, v);
            free(v);
        }
        moe_strbuf_putc(&b, ' ');
        put_literal(&b, sh->key_close, strlen(sh->key_close));
        items[i] = moe_strbuf_take(&b);
        size_t r;
        json_t *rv;
        json_array_foreach(req, r, rv) if (json_is_string(rv) &&
                                           !strcmp(json_string_value(rv), key)) required[i] = true;
        i++;
    }
    moe_strbuf sep = {0};
    put_literal(&sep, sh->sep, strlen(sh->sep));
    char *seq = sequence_rule(c, items, required, n, sep.s);
    moe_strbuf_puts(out, seq);
    free(seq);
    moe_strbuf_free(&sep);
    for (size_t k = 0; k < n; k++) free(items[k]);
    free(items);
    free(required);
}

char *moe_chat_tool_grammar(const moe_chat_parse_options *o, const char *tools_json,
                            const char *only, const char *prefix, moe_error *err) {
    moe_chat_call_shape shape;
    if (!moe_chat_call_shape_of(o->format, &shape)) {
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "forcing a tool call is not supported for the %s tool-call format",
                      moe_chat_format_name(o->format));
        return NULL;
    }
    json_t *tools = json_loads(tools_json ? tools_json : "[]", 0, NULL);
    conv c = {.defined = json_object(), .err = err};
    moe_strbuf calls = {0};
    size_t i, n = 0;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (only && strcmp(only, name))) continue;
        json_t *params = json_object_get(fn, "parameters");
        json_t *schema = params ? json_incref(params) : json_pack("{s:s}", "type", "object");
        c.root = schema;
        c.root_tag = (uint32_t)i;
        char path[300];
        snprintf(path, sizeof path, "tools[%zu].function.parameters", i);
        char *value;
        if (shape.key_open) {
            moe_strbuf b = {0};
            param_entries(&c, &shape, schema, path, 0, &b);
            value = moe_strbuf_take(&b);
        } else {
            value = visit_rule(&c, schema, path, "args", 0);
        }
        json_decref(schema);
        char *call = new_rule_name(&c, "call");
        moe_strbuf_printf(&calls, "%s%s", n ? " | " : "", call);
        moe_strbuf_printf(&c.rules, "%s ::= ", call);
        put_literal(&c.rules, shape.open, strlen(shape.open));
        json_t *js = json_string(name);
        char *quoted = shape.name_json ? json_dumps(js, JSON_ENCODE_ANY) : moe_xstrdup(name);
        json_decref(js);
        moe_strbuf_putc(&c.rules, ' ');
        put_literal(&c.rules, quoted, strlen(quoted));
        moe_strbuf_putc(&c.rules, ' ');
        put_literal(&c.rules, shape.mid, strlen(shape.mid));
        moe_strbuf_printf(&c.rules, " %s ", value);
        put_literal(&c.rules, shape.close, strlen(shape.close));
        moe_strbuf_putc(&c.rules, '\n');
        free(quoted);
        free(value);
        free(call);
        n++;
    }
    json_decref(tools);
    json_decref(c.defined);
    if (!n && !c.failed) {
        if (only)
            moe_error_set(err, MOE_ERR_NOT_FOUND, "no tool named '%s'", only);
        else
            moe_error_set(err, MOE_ERR_NOT_FOUND, "no tools to call");
    }
    if (!n || c.failed) {
        moe_strbuf_free(&c.rules);
        moe_strbuf_free(&calls);
        return NULL;
    }
    moe_strbuf out = {0};
    moe_strbuf_printf(&out, "root ::= %s(%s)\n%s", prefix ? prefix : "", calls.s, c.rules.s);
    moe_strbuf_free(&c.rules);
    moe_strbuf_free(&calls);
    return moe_strbuf_take(&out);
}

/* ==== The tokenizer's trie ==== */

static const char *token_piece(void *ud, int32_t id, size_t *len, bool *eog) {
    const moe_tokenizer *tok = ud;
    *eog = moe_tokenizer_is_eog(tok, id);
    return moe_tokenizer_token_piece(tok, id, false, len);
}

moe_grammar_vocab *moe_chat_grammar_vocab(const moe_tokenizer *tok, bool strip_first_space) {
    return moe_grammar_vocab_new(moe_tokenizer_n_vocab(tok), token_piece, (void *)tok,
                                 strip_first_space && moe_tokenizer_adds_space_prefix(tok));
}
