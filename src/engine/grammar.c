/* grammar.c: constrained decoding -- a GBNF grammar (llama.cpp's grammar language), the token
 * trie of a vocabulary, and the per-sequence state that says which tokens may come next.
 *
 * The parser turns the text into rules: each rule is its alternatives, each alternative a
 * sequence of elements (a character class or a reference to a rule); repetition operators are
 * rewritten into generated rules, as llama.cpp does (x* is R ::= x R | empty). At run time a
 * sequence's position in the grammar is a set of stacks. A stack is a chain of nodes (element
 * position, parent) that are hash-consed, so equal stacks are one node id and a set of stacks
 * is a sorted array of ids, itself interned: a state is one integer. Transitions (state, code
 * point) and whole token masks (state) are cached, so a step in a state seen before costs one
 * lookup; a new state walks the vocabulary's byte trie once, pruning every subtree whose bytes
 * the grammar cannot take (never a scan of every token's text).
 *
 * The grammar matches code points; tokens are bytes, so a state also carries an unfinished
 * UTF-8 sequence left by the last token. The engine sees token ids only: the caller gives the
 * bytes each token decodes to (moe_grammar_vocab_new). The trap: the tables grow with what a
 * generation explores (they are per sequence, and the token loop allocates here: the one place
 * it does); the mask cache is bounded and emptied when full. */
#include "engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GRAMMAR_MAX_RULES      100000 /* generated rules included: a hostile grammar stops here */
#define GRAMMAR_MAX_ELEMENTS   (1u << 22)
#define GRAMMAR_MAX_REPEAT     10000 /* {m,n} bounds: each repetition is a copy of the item */
#define GRAMMAR_MAX_NESTING    256   /* ( ) groups inside each other: each level is a C frame */
#define GRAMMAR_MAX_EXPAND     4096  /* rule references followed without consuming a character */
#define GRAMMAR_MAX_STACKS     1024  /* live parses of one text: an ambiguous grammar is cut here */
#define GRAMMAR_MASK_CACHE_MAX (8u << 20) /* bytes of cached token masks per sequence */

/* ==== Growable arrays ==== */

#define GROW(arr, n, cap, need)                                                                    \
    do {                                                                                           \
        if ((size_t)(n) + (need) > (size_t)(cap)) {                                                \
            size_t c_ = (cap) ? (size_t)(cap)*2 : 16;                                              \
            while (c_ < (size_t)(n) + (need)) c_ *= 2;                                             \
            (arr) = moe_xrealloc((arr), c_ * sizeof *(arr));                                       \
            (cap) = c_;                                                                            \
        }                                                                                          \
    } while (0)

/* ==== The grammar ==== */

typedef enum gtype { G_END, G_ALT, G_REF, G_CHARS } gtype;

typedef struct gelem {
    uint32_t type;  /* gtype */
    uint32_t value; /* REF: rule id; CHARS: class id */
} gelem;

typedef struct grange {
    uint32_t lo, hi; /* code points, inclusive */
} grange;

typedef struct gclass {
    uint32_t off, n; /* ranges[off..off+n), sorted, disjoint, not adjacent */
    bool negate;
} gclass;

struct moe_grammar {
    gelem *el; /* every rule's alternatives, END-terminated, ALT between them */
    uint32_t n_el;
    uint32_t *rule_start; /* [n_rules] first element of each rule */
    uint32_t n_rules;
    grange *ranges;
    gclass *classes;
    uint32_t n_classes;
    uint32_t root;
};

void moe_grammar_free(moe_grammar *g) {
    if (!g) return;
    free(g->el);
    free(g->rule_start);
    free(g->ranges);
    free(g->classes);
    free(g);
}

/* ==== Parsing ==== */

typedef struct prule {
    char *name;
    gelem *el; /* alternatives separated by ALT; END appended at flattening */
    uint32_t n, cap;
    bool defined;
    size_t first_use; /* where it was first referenced (for "undefined rule") */
} prule;

typedef struct parser {
    const char *src;
    size_t len, pos;
    moe_error *err;
    bool failed;
    prule *rules;
    uint32_t n_rules, cap_rules;
    grange *ranges;
    uint32_t n_ranges, cap_ranges;
    gclass *classes;
    uint32_t n_classes, cap_classes;
    size_t n_elements;
    int depth;
} parser;

static void where(const parser *p, size_t at, int *line, int *col) {
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < at && i < p->len; i++) {
        if (p->src[i] == '\n') {
            ++*line;
            *col = 1;
        } else if (((unsigned char)p->src[i] & 0xC0) != 0x80) {
            ++*col;
        }
    }
}

static bool fail_at(parser *p, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool fail_at(parser *p, size_t at, const char *fmt, ...) {
    if (p->failed) return false;
    p->failed = true;
    char msg[MOE_ERROR_MSG_MAX - 32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    where(p, at, &line, &col);
    moe_error_set(p->err, MOE_ERR_FORMAT, "grammar:%d:%d: %s", line, col, msg);
    return false;
}

static int peek(const parser *p) {
    return p->pos < p->len ? (unsigned char)p->src[p->pos] : -1;
}

static bool is_word_char(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

/* Spaces, tabs, comments; newlines too when newline_ok. */
static void skip_space(parser *p, bool newline_ok) {
    while (p->pos < p->len) {
        const char c = p->src[p->pos];
        if (c == ' ' || c == '\t') {
            p->pos++;
        } else if (c == '#') {
            while (p->pos < p->len && p->src[p->pos] != '\n' && p->src[p->pos] != '\r') p->pos++;
        } else if (newline_ok && (c == '\n' || c == '\r')) {
            p->pos++;
        } else {
            break;
        }
    }
}

static uint32_t rule_id(parser *p, const char *name, size_t n, size_t at) {
    for (uint32_t i = 0; i < p->n_rules; i++)
        if (strlen(p->rules[i].name) == n && memcmp(p->rules[i].name, name, n) == 0) return i;
    if (p->n_rules >= GRAMMAR_MAX_RULES) {
        fail_at(p, at, "more than %d rules", GRAMMAR_MAX_RULES);
        return 0;
    }
    GROW(p->rules, p->n_rules, p->cap_rules, 1);
    p->rules[p->n_rules] = (prule){.name = moe_xstrndup(name, n), .first_use = at};
    return p->n_rules++;
}

/* A rule for a group or a repetition: "<parent>_<k>". */
static uint32_t new_rule(parser *p, uint32_t parent, size_t at) {
    char name[160];
    snprintf(name, sizeof name, "%.120s_%u", p->rules[parent].name, p->n_rules);
    const uint32_t id = rule_id(p, name, strlen(name), at);
    if (!p->failed) p->rules[id].defined = true;
    return id;
}

static void push(parser *p, uint32_t rule, gtype type, uint32_t value) {
    if (p->failed) return;
    if (++p->n_elements > GRAMMAR_MAX_ELEMENTS) {
        fail_at(p, p->pos, "the grammar expands to more than %u elements", GRAMMAR_MAX_ELEMENTS);
        return;
    }
    prule *r = &p->rules[rule];
    GROW(r->el, r->n, r->cap, 1);
    r->el[r->n++] = (gelem){type, value};
}

/* One UTF-8 code point from the source; -1 (error set) when the bytes are not UTF-8. */
static int32_t utf8_char(parser *p) {
    const unsigned char *s = (const unsigned char *)p->src + p->pos;
    const size_t left = p->len - p->pos;
    const unsigned c = s[0];
    int n = c < 0x80             ? 1
            : (c & 0xE0) == 0xC0 ? 2
            : (c & 0xF0) == 0xE0 ? 3
            : (c & 0xF8) == 0xF0 ? 4
                                 : 0;
    if (!n || (size_t)n > left) {
        fail_at(p, p->pos, "invalid UTF-8 in the grammar");
        return -1;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) {
            fail_at(p, p->pos, "invalid UTF-8 in the grammar");
            return -1;
        }
        cp = cp << 6 | (s[i] & 0x3F);
    }
    p->pos += (size_t)n;
    return (int32_t)cp;
}

static int hexval(int c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* A character of a literal or a class, escapes included; -1 on error. */
static int32_t parse_char(parser *p) {
    if (p->pos >= p->len) {
        fail_at(p, p->pos, "unexpected end of the grammar");
        return -1;
    }
    if (p->src[p->pos] != '\\') return utf8_char(p);
    const size_t at = p->pos++;
    const int c = peek(p);
    p->pos++;
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            const int h = hexval(peek(p));
            if (h < 0) {
                fail_at(p, at, "escape \\%c needs %d hex digits", c, digits);
                return -1;
            }
            v = v << 4 | (uint32_t)h;
            p->pos++;
        }
        if (v > 0x10FFFF) {
            fail_at(p, at, "escape \\%c: U+%X is not a code point", c, v);
            return -1;
        }
        return (int32_t)v;
    }
    switch (c) {
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    case '\\':
    case '"':
    case '[':
    case ']':
    case '-':
    case '^':
        return c;
    default:
        fail_at(p, at, "unknown escape \\%c", c < 0x20 || c > 0x7e ? '?' : c);
        return -1;
    }
}

static int by_lo(const void *a, const void *b) {
    const grange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sort and merge ranges[first..] into a class; returns its id. */
static uint32_t make_class(parser *p, uint32_t first, bool negate) {
    uint32_t n = p->n_ranges - first, k = 0;
    grange *r = n ? p->ranges + first : NULL;
    if (n) qsort(r, n, sizeof *r, by_lo);
    for (uint32_t i = 0; i < n; i++) {
        if (k && r[i].lo <= r[k - 1].hi + 1) {
            if (r[i].hi > r[k - 1].hi) r[k - 1].hi = r[i].hi;
        } else {
            r[k++] = r[i];
        }
    }
    p->n_ranges = first + k;
    GROW(p->classes, p->n_classes, p->cap_classes, 1);
    p->classes[p->n_classes] = (gclass){first, k, negate};
    return p->n_classes++;
}

static void add_range(parser *p, uint32_t lo, uint32_t hi) {
    GROW(p->ranges, p->n_ranges, p->cap_ranges, 1);
    p->ranges[p->n_ranges++] = (grange){lo, hi};
}

static void push_char(parser *p, uint32_t rule, uint32_t cp) {
    const uint32_t first = p->n_ranges;
    add_range(p, cp, cp);
    push(p, rule, G_CHARS, make_class(p, first, false));
}

static bool parse_alternates(parser *p, uint32_t rule, bool nested);

/* Replace the last item (elements [start, n) of the rule) by min..max (max UINT32_MAX:
 * unbounded) repetitions of it. */
static void repeat_last(parser *p, uint32_t rule, uint32_t start, uint32_t min, uint32_t max,
                        size_t at) {
    prule *r = &p->rules[rule];
    const uint32_t n_item = r->n - start;
    gelem *item = moe_xmalloc(sizeof(gelem) * (n_item ? n_item : 1));
    if (n_item) memcpy(item, r->el + start, sizeof(gelem) * n_item);
    p->rules[rule].n = start;
    for (uint32_t k = 0; k < min && !p->failed; k++)
        for (uint32_t i = 0; i < n_item; i++) push(p, rule, item[i].type, item[i].value);
    if (max == UINT32_MAX) { /* R ::= item R | empty */
        const uint32_t rr = new_rule(p, rule, at);
        for (uint32_t i = 0; i < n_item && !p->failed; i++)
            push(p, rr, item[i].type, item[i].value);
        push(p, rr, G_REF, rr);
        push(p, rr, G_ALT, 0);
        push(p, rule, G_REF, rr);
    } else if (max > min) { /* R_k ::= item R_{k-1} | empty, innermost first */
        uint32_t last = UINT32_MAX;
        for (uint32_t k = min; k < max && !p->failed; k++) {
            const uint32_t rr = new_rule(p, rule, at);
            for (uint32_t i = 0; i < n_item && !p->failed; i++)
                push(p, rr, item[i].type, item[i].value);
            if (last != UINT32_MAX) push(p, rr, G_REF, last);
            push(p, rr, G_ALT, 0);
            last = rr;
        }
        if (!p->failed) push(p, rule, G_REF, last);
    }
    free(item);
}

static bool parse_count(parser *p, uint32_t *out) {
    const size_t at = p->pos;
    uint64_t v = 0;
    if (peek(p) < '0' || peek(p) > '9') return fail_at(p, at, "expected a number in { }");
    while (peek(p) >= '0' && peek(p) <= '9') {
        v = v * 10 + (uint64_t)(peek(p) - '0');
        if (v > GRAMMAR_MAX_REPEAT)
            return fail_at(p, at, "repetition count above %d", GRAMMAR_MAX_REPEAT);
        p->pos++;
    }
    *out = (uint32_t)v;
    return true;
}

/* {m}, {m,}, {m,n}, {,n} after the '{'. */
static bool parse_braces(parser *p, uint32_t *min, uint32_t *max) {
    const size_t at = p->pos - 1;
    skip_space(p, false);
    *min = 0;
    if (peek(p) != ',' && !parse_count(p, min)) return false;
    skip_space(p, false);
    if (peek(p) == ',') {
        p->pos++;
        skip_space(p, false);
        if (peek(p) == '}') {
            *max = UINT32_MAX;
        } else if (!parse_count(p, max)) {
            return false;
        }
        skip_space(p, false);
    } else {
        *max = *min;
    }
    if (peek(p) != '}') return fail_at(p, p->pos, "expected '}' to close the repetition");
    p->pos++;
    if (*max < *min)
        return fail_at(p, at, "repetition {%u,%u}: the maximum is below the minimum", *min, *max);
    return true;
}

/* One sequence: items with their repetition operators, until '|', ')' or the end of the rule. */
static bool parse_sequence(parser *p, uint32_t rule, bool nested) {
    uint32_t last_start = UINT32_MAX;
    while (!p->failed && p->pos < p->len) {
        const size_t at = p->pos;
        const int c = peek(p);
        const uint32_t start = p->rules[rule].n;
        if (c == '"') {
            p->pos++;
            while (p->pos < p->len && p->src[p->pos] != '"' && p->src[p->pos] != '\n') {
                const int32_t cp = parse_char(p);
                if (cp < 0) return false;
                push_char(p, rule, (uint32_t)cp);
            }
            if (p->pos >= p->len || p->src[p->pos] == '\n')
                return fail_at(p, at, "unterminated string literal");
            p->pos++;
            last_start = start;
        } else if (c == '[') {
            p->pos++;
            bool negate = false;
            if (peek(p) == '^') {
                negate = true;
                p->pos++;
            }
            const uint32_t first = p->n_ranges;
            while (p->pos < p->len && p->src[p->pos] != ']' && p->src[p->pos] != '\n') {
                const int32_t lo = parse_char(p);
                if (lo < 0) return false;
                int32_t hi = lo;
                if (peek(p) == '-' && p->pos + 1 < p->len && p->src[p->pos + 1] != ']' &&
                    p->src[p->pos + 1] != '\n') {
                    const size_t dash = p->pos++;
                    hi = parse_char(p);
                    if (hi < 0) return false;
                    if (hi < lo) return fail_at(p, dash, "character range ends below its start");
                }
                add_range(p, (uint32_t)lo, (uint32_t)hi);
            }
            if (p->pos >= p->len || p->src[p->pos] == '\n')
                return fail_at(p, at, "unterminated character class");
            p->pos++;
            push(p, rule, G_CHARS, make_class(p, first, negate));
            last_start = start;
        } else if (c == '.') {
            p->pos++;
            push(p, rule, G_CHARS, make_class(p, p->n_ranges, true));
            last_start = start;
        } else if (c == '(') {
            p->pos++;
            if (++p->depth > GRAMMAR_MAX_NESTING)
                return fail_at(p, at, "groups nested deeper than %d", GRAMMAR_MAX_NESTING);
            const uint32_t sub = new_rule(p, rule, at);
            skip_space(p, true);
            if (!parse_alternates(p, sub, true)) return false;
            if (peek(p) != ')') return fail_at(p, at, "'(' is never closed");
            p->pos++;
            p->depth--;
            push(p, rule, G_REF, sub);
            last_start = start;
        } else if (is_word_char(c)) {
            size_t e = p->pos;
            while (e < p->len && is_word_char((unsigned char)p->src[e])) e++;
            const uint32_t ref = rule_id(p, p->src + p->pos, e - p->pos, at);
            p->pos = e;
            push(p, rule, G_REF, ref);
            last_start = start;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last_start == UINT32_MAX)
                return fail_at(p, at, "'%c' must follow something to repeat", c);
            p->pos++;
            uint32_t min = 0, max = UINT32_MAX;
            if (c == '+') min = 1;
            if (c == '?') max = 1;
            if (c == '{' && !parse_braces(p, &min, &max)) return false;
            repeat_last(p, rule, last_start, min, max, at);
            last_start = UINT32_MAX;
        } else if (c == '<') {
            return fail_at(p, at, "token references (<...>) are not supported; write the text");
        } else if (c == '|' || c == ')' || c == '\n' || c == '\r') {
            break;
        } else {
            return fail_at(p, at, "unexpected '%c'", c < 0x20 || c > 0x7e ? '?' : c);
        }
        skip_space(p, nested);
    }
    return !p->failed;
}

static bool parse_alternates(parser *p, uint32_t rule, bool nested) {
    if (!parse_sequence(p, rule, nested)) return false;
    while (peek(p) == '|') {
        p->pos++;
        push(p, rule, G_ALT, 0);
        skip_space(p, true);
        if (!parse_sequence(p, rule, nested)) return false;
    }
    return !p->failed;
}

static bool parse_rule(parser *p) {
    const size_t at = p->pos;
    size_t e = p->pos;
    while (e < p->len && is_word_char((unsigned char)p->src[e])) e++;
    if (e == p->pos)
        return fail_at(p, at, "expected a rule name, found '%c'",
                       peek(p) < 0x20 || peek(p) > 0x7e ? '?' : peek(p));
    const uint32_t id = rule_id(p, p->src + at, e - at, at);
    if (p->failed) return false;
    if (p->rules[id].defined)
        return fail_at(p, at, "rule '%s' is defined twice", p->rules[id].name);
    p->rules[id].defined = true;
    p->pos = e;
    skip_space(p, false);
    if (p->len - p->pos < 3 || memcmp(p->src + p->pos, "::=", 3) != 0)
        return fail_at(p, p->pos, "expected '::=' after rule name '%s'", p->rules[id].name);
    p->pos += 3;
    skip_space(p, true);
    if (!parse_alternates(p, id, false)) return false;
    if (peek(p) == ')') return fail_at(p, p->pos, "')' without a matching '('");
    if (p->pos < p->len && peek(p) != '\n' && peek(p) != '\r')
        return fail_at(p, p->pos, "expected the end of the line after rule '%s'",
                       p->rules[id].name);
    return true;
}

/* ==== Checks and flattening ==== */

/* Rules that can match the empty string (fixpoint). */
static void find_nullable(const parser *p, bool *nullable) {
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t r = 0; r < p->n_rules; r++) {
            if (nullable[r]) continue;
            const prule *ru = &p->rules[r];
            bool all = true;
            for (uint32_t i = 0; i <= ru->n; i++) {
                if (i == ru->n || ru->el[i].type == G_ALT) {
                    if (all) {
                        nullable[r] = changed = true;
                        break;
                    }
                    all = true;
                } else if (ru->el[i].type == G_CHARS ||
                           (ru->el[i].type == G_REF && !nullable[ru->el[i].value])) {
                    all = false;
                }
            }
        }
    }
}

/* Depth-first over "r can start with rule x" edges; a back edge is left recursion. */
static bool left_recursive(const parser *p, const bool *nullable, uint32_t r, uint8_t *color,
                           uint32_t *culprit, int depth) {
    if (color[r] == 1) {
        *culprit = r;
        return true;
    }
    if (color[r] == 2 || depth > GRAMMAR_MAX_RULES) return false;
    color[r] = 1;
    const prule *ru = &p->rules[r];
    bool at_start = true;
    for (uint32_t i = 0; i < ru->n; i++) {
        const gelem e = ru->el[i];
        if (e.type == G_ALT) {
            at_start = true;
        } else if (at_start && e.type == G_REF) {
            if (left_recursive(p, nullable, e.value, color, culprit, depth + 1)) return true;
            at_start = nullable[e.value];
        } else {
            at_start = false;
        }
    }
    color[r] = 2;
    return false;
}

static bool check_rules(parser *p) {
    for (uint32_t r = 0; r < p->n_rules; r++)
        if (!p->rules[r].defined)
            return fail_at(p, p->rules[r].first_use, "undefined rule '%s'", p->rules[r].name);
    bool *nullable = moe_xcalloc(p->n_rules, sizeof(bool));
    uint8_t *color = moe_xcalloc(p->n_rules, 1);
    find_nullable(p, nullable);
    uint32_t culprit = 0;
    bool bad = false;
    for (uint32_t r = 0; r < p->n_rules && !bad; r++)
        bad = left_recursive(p, nullable, r, color, &culprit, 0);
    free(nullable);
    free(color);
    if (bad)
        return fail_at(p, p->rules[culprit].first_use,
                       "rule '%s' is left-recursive (it can reach itself before reading a "
                       "character)",
                       p->rules[culprit].name);
    return true;
}

static moe_grammar *flatten(parser *p, uint32_t root) {
    moe_grammar *g = moe_xcalloc(1, sizeof *g);
    size_t total = 0;
    for (uint32_t r = 0; r < p->n_rules; r++) total += p->rules[r].n + 1;
    g->el = moe_xmalloc(sizeof(gelem) * total);
    g->rule_start = moe_xmalloc(sizeof(uint32_t) * p->n_rules);
    for (uint32_t r = 0; r < p->n_rules; r++) {
        g->rule_start[r] = g->n_el;
        if (p->rules[r].n) memcpy(g->el + g->n_el, p->rules[r].el, sizeof(gelem) * p->rules[r].n);
        g->n_el += p->rules[r].n;
        g->el[g->n_el++] = (gelem){G_END, 0};
    }
    g->n_rules = p->n_rules;
    g->ranges = p->ranges;
    g->classes = p->classes;
    g->n_classes = p->n_classes;
    p->ranges = NULL;
    p->classes = NULL;
    g->root = root;
    return g;
}

moe_grammar *moe_grammar_parse(const char *src, size_t len, const char *root, moe_error *err) {
    parser p = {.src = src, .len = len, .err = err};
    if (!root) root = "root";
    skip_space(&p, true);
    while (!p.failed && p.pos < p.len) {
        if (!parse_rule(&p)) break;
        skip_space(&p, true);
    }
    uint32_t root_id = 0;
    if (!p.failed) {
        bool found = false;
        for (uint32_t r = 0; r < p.n_rules && !found; r++)
            if (strcmp(p.rules[r].name, root) == 0 && p.rules[r].defined) {
                root_id = r;
                found = true;
            }
        if (!found) fail_at(&p, p.len, "no rule named '%s' (the start rule)", root);
    }
    if (!p.failed) check_rules(&p);
    moe_grammar *g = p.failed ? NULL : flatten(&p, root_id);
    for (uint32_t r = 0; r < p.n_rules; r++) {
        free(p.rules[r].name);
        free(p.rules[r].el);
    }
    free(p.rules);
    free(p.ranges);
    free(p.classes);
    return g;
}

/* ==== The vocabulary's byte trie ==== */

typedef struct tnode {
    uint32_t first_child, next_sibling; /* 0: none (node 0 is the root) */
    uint32_t first_token;               /* tokens whose bytes end here: chain via token_next */
    uint8_t byte;
} tnode;

struct moe_grammar_vocab {
    uint32_t n_vocab;
    tnode *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *token_next; /* [n_vocab] next token ending at the same node (UINT32_MAX: none) */
    uint8_t *bytes;       /* every token's bytes */
    uint32_t *off;        /* [n_vocab + 1] */
    uint8_t *eog;         /* [n_vocab] */
    bool strip_first_space;
};

static uint32_t trie_child(moe_grammar_vocab *v, uint32_t node, uint8_t b) {
    for (uint32_t c = v->nodes[node].first_child; c; c = v->nodes[c].next_sibling)
        if (v->nodes[c].byte == b) return c;
    GROW(v->nodes, v->n_nodes, v->cap_nodes, 1);
    const uint32_t c = v->n_nodes++;
    v->nodes[c] = (tnode){0, v->nodes[node].first_child, UINT32_MAX, b};
    v->nodes[node].first_child = c;
    return c;
}

moe_grammar_vocab *moe_grammar_vocab_new(uint32_t n_vocab, moe_grammar_piece_fn piece, void *ud,
                                         bool strip_first_space) {
    moe_grammar_vocab *v = moe_xcalloc(1, sizeof *v);
    v->n_vocab = n_vocab;
    v->off = moe_xmalloc(sizeof(uint32_t) * (n_vocab + 1));
    v->eog = moe_xcalloc(n_vocab ? n_vocab : 1, 1);
    v->token_next = moe_xmalloc(sizeof(uint32_t) * (n_vocab ? n_vocab : 1));
    v->strip_first_space = strip_first_space;
    size_t n_bytes = 0, cap_bytes = 0;
    GROW(v->nodes, v->n_nodes, v->cap_nodes, 1);
    v->nodes[v->n_nodes++] = (tnode){0, 0, UINT32_MAX, 0};
    for (uint32_t t = 0; t < n_vocab; t++) {
        size_t len = 0;
        bool eog = false;
        const char *s = piece(ud, (int32_t)t, &len, &eog);
        v->eog[t] = eog;
        v->off[t] = (uint32_t)n_bytes;
        v->token_next[t] = UINT32_MAX;
        if (eog) len = 0; /* an end of generation is allowed by completion, never by its text */
        GROW(v->bytes, n_bytes, cap_bytes, len + 1);
        memcpy(v->bytes + n_bytes, s, len);
        n_bytes += len;
        if (!len) continue; /* empty pieces (control tokens) never advance a grammar */
        uint32_t node = 0;
        for (size_t i = 0; i < len; i++) node = trie_child(v, node, (uint8_t)s[i]);
        v->token_next[t] = v->nodes[node].first_token;
        v->nodes[node].first_token = t;
    }
    v->off[n_vocab] = (uint32_t)n_bytes;
    return v;
}

void moe_grammar_vocab_free(moe_grammar_vocab *v) {
    if (!v) return;
    free(v->nodes);
    free(v->token_next);
    free(v->bytes);
    free(v->off);
    free(v->eog);
    free(v);
}

/* ==== Hash maps: 64-bit key -> 32-bit value, open addressing ==== */

#define MAP_EMPTY UINT64_MAX

typedef struct umap {
    uint64_t *keys;
    uint32_t *vals;
    uint32_t cap, n; /* cap a power of two */
} umap;

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static bool umap_get(const umap *m, uint64_t key, uint32_t *val) {
    if (!m->cap) return false;
    for (uint32_t i = (uint32_t)mix64(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) {
            *val = m->vals[i];
            return true;
        }
        if (m->keys[i] == MAP_EMPTY) return false;
    }
}

static void umap_put(umap *m, uint64_t key, uint32_t val) {
    if (2 * (m->n + 1) > m->cap) {
        umap old = *m;
        m->cap = old.cap ? old.cap * 2 : 256;
        m->keys = moe_xmalloc(sizeof(uint64_t) * m->cap);
        m->vals = moe_xmalloc(sizeof(uint32_t) * m->cap);
        memset(m->keys, 0xff, sizeof(uint64_t) * m->cap);
        m->n = 0;
        for (uint32_t i = 0; i < old.cap; i++)
            if (old.keys[i] != MAP_EMPTY) umap_put(m, old.keys[i], old.vals[i]);
        free(old.keys);
        free(old.vals);
    }
    uint32_t i = (uint32_t)mix64(key) & (m->cap - 1);
    while (m->keys[i] != MAP_EMPTY && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    if (m->keys[i] == MAP_EMPTY) m->n++;
    m->keys[i] = key;
    m->vals[i] = val;
}

/* The value slot of key, inserted (value 0) when absent. */
static uint32_t *umap_slot(umap *m, uint64_t key) {
    if (2 * (m->n + 1) > m->cap) {
        uint32_t v = 0;
        if (!umap_get(m, key, &v)) umap_put(m, key, 0); /* grows the table */
    }
    uint32_t i = (uint32_t)mix64(key) & (m->cap - 1);
    while (m->keys[i] != MAP_EMPTY && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    if (m->keys[i] == MAP_EMPTY) {
        m->keys[i] = key;
        m->vals[i] = 0;
        m->n++;
    }
    return &m->vals[i];
}

static void umap_free(umap *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ==== The state of one sequence ==== */

#define DEAD UINT32_MAX /* no stack survives */

/* An unfinished UTF-8 sequence: the bits so far and how many continuation bytes are missing. */
typedef struct partial {
    uint32_t value, missing;
    uint32_t min; /* the smallest code point of this length: shorter forms are overlong */
} partial;

typedef struct gnode {
    uint32_t pos;    /* element index: a CHARS element (top) or a return position (below) */
    uint32_t parent; /* node id; 0: the bottom */
} gnode;

struct moe_grammar_state {
    const moe_grammar *g;
    const moe_grammar_vocab *v;
    /* stacks: node 0 is "nothing left" (the grammar is complete on that stack) */
    gnode *nodes;
    uint32_t n_nodes, cap_nodes;
    umap node_ids; /* (pos, parent) -> node */
    /* sets of stack tops, sorted: set k is tops[set_off[k] .. set_off[k+1]) */
    uint32_t *tops;
    uint32_t n_tops, cap_tops;
    uint32_t *set_off;
    uint32_t n_sets, cap_sets;
    umap set_ids;    /* hash of the tops -> set (collisions chained by rehash below) */
    umap trans;      /* (set, code point >= 128) -> set or DEAD */
    uint32_t *ascii; /* [n_ascii_sets][128] transitions on ASCII, TRANS_UNKNOWN until known */
    uint32_t n_ascii_sets;
    umap seen; /* (pos, parent) -> the closure that expanded it (each once per closure) */
    uint32_t closure;
    umap mask_ids;   /* state key -> mask slot */
    uint64_t *masks; /* [n_masks][words] allowed tokens */
    uint32_t n_masks, cap_masks, words;
    uint32_t *scratch; /* tops being built */
    uint32_t n_scratch, cap_scratch;
    /* where the sequence is */
    uint32_t set;
    partial part;
    bool strip_pending; /* the first non-empty piece loses one leading space (SPM) */
    bool ended;         /* an end-of-generation token was accepted */
    uint32_t initial_set;
};

static uint32_t node_get(moe_grammar_state *st, uint32_t pos, uint32_t parent) {
    const uint64_t key = (uint64_t)pos << 32 | parent;
    uint32_t id;
    if (umap_get(&st->node_ids, key, &id)) return id;
    GROW(st->nodes, st->n_nodes, st->cap_nodes, 1);
    id = st->n_nodes++;
    st->nodes[id] = (gnode){pos, parent};
    umap_put(&st->node_ids, key, id);
    return id;
}

static void scratch_push(moe_grammar_state *st, uint32_t top) {
    GROW(st->scratch, st->n_scratch, st->cap_scratch, 1);
    st->scratch[st->n_scratch++] = top;
}

static bool is_end(gelem e) {
    return e.type == G_END || e.type == G_ALT;
}

static void expand_rule(moe_grammar_state *st, uint32_t rule, uint32_t parent, int depth);

/* Every stack top reachable from element pos (under parent) without reading a character. */
static void expand(moe_grammar_state *st, uint32_t pos, uint32_t parent, int depth) {
    const gelem *el = st->g->el;
    while (is_end(el[pos])) { /* this sequence is done: continue where its rule was called */
        if (!parent) {
            scratch_push(st, 0);
            return;
        }
        pos = st->nodes[parent].pos;
        parent = st->nodes[parent].parent;
    }
    if (el[pos].type == G_CHARS) {
        scratch_push(st, node_get(st, pos, parent));
        return;
    }
    /* a rule call. What (pos, parent) reaches does not depend on how we got here: once per
     * closure, or nullable alternatives would be followed exponentially often */
    uint32_t *when = umap_slot(&st->seen, (uint64_t)pos << 32 | parent);
    if (*when == st->closure) return;
    *when = st->closure;
    if (depth > GRAMMAR_MAX_EXPAND) return; /* unreachable for a checked grammar */
    /* return to pos + 1, or straight to the parent when nothing follows */
    const uint32_t ret = is_end(el[pos + 1]) ? parent : node_get(st, pos + 1, parent);
    expand_rule(st, el[pos].value, ret, depth + 1);
}

static void expand_rule(moe_grammar_state *st, uint32_t rule, uint32_t parent, int depth) {
    const gelem *el = st->g->el;
    uint32_t pos = st->g->rule_start[rule];
    for (;;) {
        expand(st, pos, parent, depth);
        while (!is_end(el[pos])) pos++;
        if (el[pos].type == G_END) return;
        pos++; /* past ALT: the next alternative */
    }
}

static int cmp_u32(const void *a, const void *b) {
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The scratch tops as an interned set (DEAD when empty). */
static uint32_t intern_scratch(moe_grammar_state *st) {
    uint32_t n = st->n_scratch;
    st->n_scratch = 0;
    if (!n) return DEAD;
    uint32_t *t = st->scratch;
    qsort(t, n, sizeof *t, cmp_u32);
    uint32_t k = 0;
    for (uint32_t i = 0; i < n && k < GRAMMAR_MAX_STACKS; i++)
        if (!k || t[i] != t[k - 1]) t[k++] = t[i];
    uint64_t h = 0x9e3779b97f4a7c15ull ^ k;
    for (uint32_t i = 0; i < k; i++) h = mix64(h ^ t[i]);
    /* probe h, h+1, ... until the set or a free key: equal hashes of different sets chain */
    for (uint64_t key = h & ~(1ull << 63);; key = (key + 1) & ~(1ull << 63)) {
        uint32_t id;
        if (!umap_get(&st->set_ids, key, &id)) break;
        const uint32_t o = st->set_off[id], len = st->set_off[id + 1] - o;
        if (len == k && memcmp(st->tops + o, t, sizeof(uint32_t) * k) == 0) return id;
        h = key + 1;
    }
    GROW(st->tops, st->n_tops, st->cap_tops, k);
    memcpy(st->tops + st->n_tops, t, sizeof(uint32_t) * k);
    st->n_tops += k;
    GROW(st->set_off, st->n_sets, st->cap_sets, 2);
    const uint32_t id = st->n_sets++;
    st->set_off[id + 1] = st->n_tops;
    umap_put(&st->set_ids, h & ~(1ull << 63), id);
    return id;
}

static bool class_match(const moe_grammar *g, uint32_t cls, uint32_t cp) {
    const gclass *c = &g->classes[cls];
    bool in = false;
    for (uint32_t i = 0; i < c->n && !in; i++)
        in = cp >= g->ranges[c->off + i].lo && cp <= g->ranges[c->off + i].hi;
    return in != c->negate;
}

/* Can the class hold some code point in [lo, hi]? */
static bool class_overlaps(const moe_grammar *g, uint32_t cls, uint32_t lo, uint32_t hi) {
    const gclass *c = &g->classes[cls];
    for (uint32_t i = 0; i < c->n; i++) {
        const grange r = g->ranges[c->off + i];
        if (c->negate && r.lo <= lo && r.hi >= hi) return false; /* merged: one range covers */
        if (!c->negate && r.lo <= hi && r.hi >= lo) return true;
    }
    return c->negate;
}

#define TRANS_UNKNOWN (UINT32_MAX - 1) /* ascii[] entry not computed yet */

static uint32_t transition(moe_grammar_state *st, uint32_t set, uint32_t cp) {
    const uint64_t key = (uint64_t)set << 21 | cp;
    uint32_t out;
    if (cp < 128) { /* most bytes of most texts: a direct table, no hashing */
        if (set >= st->n_ascii_sets) {
            const uint32_t n = st->n_sets > set + 1 ? st->n_sets : set + 1;
            st->ascii = moe_xrealloc(st->ascii, sizeof(uint32_t) * 128 * (size_t)n);
            for (size_t i = (size_t)st->n_ascii_sets * 128; i < (size_t)n * 128; i++)
                st->ascii[i] = TRANS_UNKNOWN;
            st->n_ascii_sets = n;
        }
        out = st->ascii[(size_t)set * 128 + cp];
        if (out != TRANS_UNKNOWN) return out;
    } else if (umap_get(&st->trans, key, &out)) {
        return out;
    }
    const uint32_t o = st->set_off[set], n = st->set_off[set + 1] - o;
    st->closure++;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t top = st->tops[o + i];
        if (!top) continue;
        const gnode nd = st->nodes[top];
        if (class_match(st->g, st->g->el[nd.pos].value, cp)) expand(st, nd.pos + 1, nd.parent, 0);
    }
    out = intern_scratch(st);
    if (cp < 128)
        st->ascii[(size_t)set * 128 + cp] = out;
    else
        umap_put(&st->trans, key, out);
    return out;
}

static bool partial_possible(const moe_grammar_state *st, uint32_t set, partial p) {
    uint32_t lo = p.value << (6 * p.missing), hi = lo | ((1u << (6 * p.missing)) - 1);
    if (lo < p.min) lo = p.min;
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    /* the code points this could still become, surrogates (never valid UTF-8) left out */
    uint32_t span[2][2] = {{lo, hi}, {1, 0}};
    if (lo <= 0xDFFF && hi >= 0xD800) {
        span[0][1] = 0xD7FF;
        span[1][0] = 0xE000;
        span[1][1] = hi;
    }
    const uint32_t o = st->set_off[set], n = st->set_off[set + 1] - o;
    for (int k = 0; k < 2; k++) {
        if (span[k][0] > span[k][1]) continue;
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t top = st->tops[o + i];
            if (top &&
                class_overlaps(st->g, st->g->el[st->nodes[top].pos].value, span[k][0], span[k][1]))
                return true;
        }
    }
    return false;
}

/* One byte: the new set (DEAD: impossible), *p updated. */
static uint32_t step_byte(moe_grammar_state *st, uint32_t set, partial *p, uint8_t b) {
    if (p->missing) {
        if ((b & 0xC0) != 0x80) return DEAD;
        p->value = p->value << 6 | (b & 0x3F);
        if (--p->missing) return partial_possible(st, set, *p) ? set : DEAD;
        const uint32_t cp = p->value;
        const bool valid = cp >= p->min && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF);
        *p = (partial){0, 0, 0};
        return valid ? transition(st, set, cp) : DEAD;
    }
    if (b < 0x80) return transition(st, set, b);
    const uint32_t missing = (b & 0xE0) == 0xC0   ? 1
                             : (b & 0xF0) == 0xE0 ? 2
                             : (b & 0xF8) == 0xF0 ? 3
                                                  : 0;
    if (!missing) return DEAD; /* a stray continuation byte or not UTF-8 at all */
    static const uint32_t min_of[4] = {0, 0x80, 0x800, 0x10000};
    *p = (partial){b & (0x3Fu >> missing), missing, min_of[missing]};
    return partial_possible(st, set, *p) ? set : DEAD;
}

moe_grammar_state *moe_grammar_state_new(const moe_grammar *g, const moe_grammar_vocab *v) {
    moe_grammar_state *st = moe_xcalloc(1, sizeof *st);
    st->g = g;
    st->v = v;
    st->words = v ? (v->n_vocab + 63) / 64 : 0;
    GROW(st->nodes, st->n_nodes, st->cap_nodes, 1);
    st->nodes[st->n_nodes++] = (gnode){0, 0};
    GROW(st->set_off, st->n_sets, st->cap_sets, 1);
    st->set_off[0] = 0;
    st->closure = 1;
    expand_rule(st, g->root, 0, 0);
    st->initial_set = intern_scratch(st);
    moe_grammar_state_reset(st);
    return st;
}

void moe_grammar_state_reset(moe_grammar_state *st) {
    st->set = st->initial_set;
    st->part = (partial){0, 0, 0};
    st->strip_pending = st->v && st->v->strip_first_space;
    st->ended = false;
}

void moe_grammar_state_free(moe_grammar_state *st) {
    if (!st) return;
    free(st->nodes);
    umap_free(&st->node_ids);
    free(st->tops);
    free(st->set_off);
    umap_free(&st->set_ids);
    umap_free(&st->trans);
    free(st->ascii);
    umap_free(&st->seen);
    umap_free(&st->mask_ids);
    free(st->masks);
    free(st->scratch);
    free(st);
}

bool moe_grammar_state_complete(const moe_grammar_state *st) {
    if (st->set == DEAD || st->part.missing) return false;
    return st->tops[st->set_off[st->set]] == 0; /* sorted: node 0 comes first */
}

bool moe_grammar_state_accept_bytes(moe_grammar_state *st, const char *s, size_t len) {
    if (st->set == DEAD || st->ended) return false;
    if (len && st->strip_pending) {
        st->strip_pending = false;
        if (s[0] == ' ') {
            s++;
            len--;
        }
    }
    for (size_t i = 0; i < len && st->set != DEAD; i++)
        st->set = step_byte(st, st->set, &st->part, (uint8_t)s[i]);
    return st->set != DEAD;
}

bool moe_grammar_state_accept(moe_grammar_state *st, int32_t token) {
    const moe_grammar_vocab *v = st->v;
    if (!v || token < 0 || (uint32_t)token >= v->n_vocab) return false;
    if (v->eog[token]) {
        if (!moe_grammar_state_complete(st)) return false;
        st->ended = true;
        return true;
    }
    const uint32_t len = v->off[token + 1] - v->off[token];
    if (!len) return false;
    return moe_grammar_state_accept_bytes(st, (const char *)v->bytes + v->off[token], len);
}

bool moe_grammar_state_can_take(moe_grammar_state *st, int32_t token) {
    const moe_grammar_vocab *v = st->v;
    if (!v || token < 0 || (uint32_t)token >= v->n_vocab || st->set == DEAD || st->ended)
        return false;
    if (v->eog[token]) return moe_grammar_state_complete(st);
    const uint8_t *b = v->bytes + v->off[token];
    uint32_t len = v->off[token + 1] - v->off[token];
    if (!len) return false;
    if (st->strip_pending && b[0] == ' ') {
        b++;
        len--;
    }
    uint32_t set = st->set;
    partial p = st->part;
    for (uint32_t i = 0; i < len && set != DEAD; i++) set = step_byte(st, set, &p, b[i]);
    return set != DEAD;
}

/* Depth-first over the trie below node: every token whose bytes the grammar can take. */
static void walk(moe_grammar_state *st, uint32_t node, uint32_t set, partial p, uint64_t *mask) {
    const moe_grammar_vocab *v = st->v;
    for (uint32_t c = v->nodes[node].first_child; c; c = v->nodes[c].next_sibling) {
        partial q = p;
        const uint32_t next = step_byte(st, set, &q, v->nodes[c].byte);
        if (next == DEAD) continue;
        for (uint32_t t = v->nodes[c].first_token; t != UINT32_MAX; t = v->token_next[t])
            mask[t / 64] |= 1ull << (t % 64);
        walk(st, c, next, q, mask);
    }
}

/* The mask of the current state: from the cache, or walked and cached. */
static const uint64_t *current_mask(moe_grammar_state *st) {
    const moe_grammar_vocab *v = st->v;
    const uint32_t len_code = st->part.min >= 0x10000 ? 3
                              : st->part.min >= 0x800 ? 2
                              : st->part.min          ? 1
                                                      : 0;
    const uint64_t key = (uint64_t)st->set << 32 | (uint64_t)st->part.value << 5 | len_code << 3 |
                         st->part.missing << 1 | (uint64_t)st->strip_pending;
    uint32_t slot;
    if (umap_get(&st->mask_ids, key, &slot)) return st->masks + (size_t)slot * st->words;
    if ((size_t)(st->n_masks + 1) * st->words * 8 > GRAMMAR_MASK_CACHE_MAX) {
        umap_free(&st->mask_ids); /* full: start over */
        st->n_masks = 0;
    }
    GROW(st->masks, (size_t)st->n_masks * st->words, st->cap_masks, st->words);
    slot = st->n_masks++;
    uint64_t *mask = st->masks + (size_t)slot * st->words;
    memset(mask, 0, sizeof(uint64_t) * st->words);
    if (st->set != DEAD && !st->ended) {
        walk(st, 0, st->set, st->part, mask);
        if (st->strip_pending) { /* " x" as the first piece reads as "x" */
            uint32_t c = v->nodes[0].first_child;
            while (c && v->nodes[c].byte != ' ') c = v->nodes[c].next_sibling;
            if (c) {
                for (uint32_t t = v->nodes[c].first_token; t != UINT32_MAX; t = v->token_next[t])
                    mask[t / 64] |= 1ull << (t % 64);
                walk(st, c, st->set, st->part, mask);
            }
        }
        if (moe_grammar_state_complete(st))
            for (uint32_t t = 0; t < v->n_vocab; t++)
                if (v->eog[t]) mask[t / 64] |= 1ull << (t % 64);
    }
    umap_put(&st->mask_ids, key, slot);
    return mask;
}

uint32_t moe_grammar_state_apply(moe_grammar_state *st, float *logits) {
    const uint64_t *mask = current_mask(st);
    uint32_t allowed = 0;
    for (uint32_t w = 0; w < st->words; w++) {
        const uint64_t m = mask[w];
        allowed += (uint32_t)__builtin_popcountll(m);
        if (m == ~0ull) continue;
        const uint32_t end = (w + 1) * 64 < st->v->n_vocab ? (w + 1) * 64 : st->v->n_vocab;
        for (uint32_t t = w * 64; t < end; t++)
            if (!(m >> (t % 64) & 1)) logits[t] = -INFINITY;
    }
    return allowed;
}

bool moe_grammar_state_allows(moe_grammar_state *st, int32_t token) {
    if (token < 0 || !st->v || (uint32_t)token >= st->v->n_vocab) return false;
    return current_mask(st)[token / 64] >> (token % 64) & 1;
}

int32_t moe_grammar_vocab_eog(const moe_grammar_vocab *v) {
    for (uint32_t t = 0; t < v->n_vocab; t++)
        if (v->eog[t]) return (int32_t)t;
    return -1;
}
