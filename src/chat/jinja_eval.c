/* jinja_eval: runs a parsed template -- statements, expressions, scopes, macros, recursive
 * loops, and the builtins as Jinja2 3.x and Python define them: filters, tests and the methods of
 * str (str.format with its mini-language included), dict, list and loop, each kind one table of
 * {name, function, mode} rows, and the globals.
 *
 * Owns no parsing. Scoping follows Jinja2: a for loop and a macro open a scope, `if` does not,
 * so `{% set %}` inside a loop does not leak out (templates use namespace() for that). The
 * sandbox of transformers (ImmutableSandboxedEnvironment) is kept: list.append, dict.update and
 * the other mutators answer with an Undefined that raises when called. The trap: Jinja2's
 * Undefined is not an error until it is used -- printing it gives "", iterating it gives
 * nothing, `is defined` is false -- but attribute access, calls and arithmetic on it raise. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_internal.h"

/* ==== Render state ==== */

typedef struct scope scope;
struct scope {
    jinja_dict *vars;
    scope *parent;
};

struct jinja_macro {
    const jinja_macro_def *def;
    scope *closure;
    jinja_value caller; /* for a macro called from a {% call %} block */
};

struct jinja_loop {
    jinja_list *items;
    size_t index0;
    int64_t depth0;         /* 0 for the loop itself, +1 per loop(...) call of a recursive one */
    const jinja_node *node; /* the for statement: loop(...) runs it again */
    scope *outer;           /* the scope the for statement runs in */
    jinja_value last_changed;
    bool changed_seen;
};

typedef struct render render;
typedef struct args {
    size_t n;
    jinja_value *v;
    const char **names; /* NULL entries: positional */
} args;

struct jinja_func {
    const char *name;
    jinja_value (*fn)(render *r, const args *a);
};

/* A filter, a test or a method: self is the filtered, tested or bound value. */
typedef jinja_value (*builtin_fn)(render *r, jinja_value self, const args *a,
                                  const jinja_builtin *b);
struct jinja_builtin {
    const char *name;
    builtin_fn fn; /* NULL: a filter moe does not run, or a method the sandbox forbids */
    int mode;      /* what a function that serves several names does for this one */
};

typedef enum flow { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE } flow;

struct render {
    jinja_ctx c;
    moe_strbuf *out;
    jinja_dict *globals;
    const jinja_render_opts *opts;
    size_t iterations;
    int call_depth;
    flow flow;
};

#define MISSING JV_KIND_COUNT /* an unbound parameter in bind() */
static bool missing(jinja_value v) {
    return v.kind == MISSING;
}

_Noreturn static void fail(render *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(render *r, const char *fmt, ...) {
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jinja_raise(&r->c, "%s", msg);
}

static void at(render *r, const jinja_node *n) {
    r->c.line = n->line;
    r->c.col = n->col;
}

static jinja_value str_of(render *r, const char *s, size_t n) {
    return jv_str(&r->c, s, n);
}
static jinja_value cstr(render *r, const char *s) {
    return jv_cstr(&r->c, s);
}

/* Undefined values remember why: .s is the name, .safe says which message to give. */
enum { UNDEF_NAME = 0, UNDEF_ATTR = 1, UNDEF_UNSAFE = 2, UNDEF_PLAIN = 3 };
static jinja_value undef(render *r, const char *name, int why, const char *type) {
    moe_strbuf b = jinja_strbuf(&r->c);
    switch (why) {
    case UNDEF_NAME:
        moe_strbuf_printf(&b, "'%s' is undefined", name);
        break;
    case UNDEF_ATTR:
        moe_strbuf_printf(&b, "'%s object' has no attribute '%s'", type, name);
        break;
    case UNDEF_UNSAFE:
        moe_strbuf_printf(&b, "access to attribute '%s' of '%s' object is unsafe.", name, type);
        break;
    default:
        moe_strbuf_puts(&b, name);
        break;
    }
    jinja_value v = jv_str_buf(&r->c, &b);
    v.kind = JV_UNDEF;
    v.safe = (uint8_t)why;
    return v;
}

_Noreturn static void undef_fail(render *r, jinja_value v) {
    fail(r, "%s", v.s ? v.s->data : "undefined value");
}

static void write_out(render *r, const char *s, size_t n) {
    if (r->out->len + n > JINJA_MAX_OUTPUT)
        fail(r, "output is over the %u MiB limit", JINJA_MAX_OUTPUT >> 20);
    moe_strbuf_put(r->out, s, n);
}

/* ==== Scopes ==== */

static scope *scope_new(render *r, scope *parent) {
    scope *s = jinja_alloc(&r->c, sizeof *s);
    s->vars = jv_dict(&r->c, 0).d;
    s->parent = parent;
    return s;
}

static bool lookup(render *r, scope *s, const char *name, jinja_value *out);

static void scope_set(render *r, scope *s, const char *name, jinja_value v) {
    jv_dict_set(&r->c, s->vars, cstr(r, name), v);
}

/* ==== Iteration ==== */

/* Python's iter(v) materialised: list items, dict keys, str characters; Undefined is empty. */
static jinja_list *iter_list(render *r, jinja_value v) {
    switch (v.kind) {
    case JV_LIST:
        if (v.l->lazy == JL_ITER) {
            if (v.l->consumed) return jv_list(&r->c, 0).l;
            v.l->consumed = true;
        }
        return v.l;
    case JV_UNDEF:
        return jv_list(&r->c, 0).l;
    case JV_DICT: {
        if (v.d->ns) break;
        jinja_list *l = jv_list(&r->c, v.d->n).l;
        for (size_t i = 0; i < v.d->n; i++) l->items[i] = v.d->keys[i];
        l->n = v.d->n;
        return l;
    }
    case JV_STR: {
        jinja_list *l = jv_list(&r->c, 0).l;
        for (size_t p = 0; p < v.s->len;) {
            size_t start = p;
            jinja_utf8_next(v.s->data, v.s->len, &p);
            jv_list_push(&r->c, l, str_of(r, v.s->data + start, p - start));
        }
        return l;
    }
    default:
        break;
    }
    fail(r, "'%s' object is not iterable", jv_type_name(v));
}

static jinja_value as_generator(jinja_value v) {
    v.l->lazy = JL_ITER;
    return v;
}

static void not_subscriptable(render *r, jinja_value v) {
    if (v.kind == JV_LIST && v.l->lazy)
        fail(r, "'%s' object is not subscriptable", jv_type_name(v));
}

static void count_iteration(render *r) {
    if (++r->iterations > JINJA_MAX_ITERATIONS)
        fail(r, "more than %u loop iterations", JINJA_MAX_ITERATIONS);
}

/* ==== Strings ==== */

static jinja_value html_escape(render *r, jinja_value v) {
    if (v.kind == JV_STR && v.safe) return v;
    v = jv_stringify(&r->c, v);
    moe_strbuf b = jinja_strbuf(&r->c);
    for (size_t i = 0; i < v.s->len; i++) {
        char ch = v.s->data[i];
        switch (ch) {
        case '&':
            moe_strbuf_puts(&b, "&amp;");
            break;
        case '<':
            moe_strbuf_puts(&b, "&lt;");
            break;
        case '>':
            moe_strbuf_puts(&b, "&gt;");
            break;
        case '"':
            moe_strbuf_puts(&b, "&#34;");
            break;
        case '\'':
            moe_strbuf_puts(&b, "&#39;");
            break;
        default:
            moe_strbuf_putc(&b, ch);
        }
    }
    jinja_value out = jv_str_buf(&r->c, &b);
    out.safe = 1;
    return out;
}

static uint32_t case_map(uint32_t cp, bool upper) {
    if (upper) {
        if (cp >= 'a' && cp <= 'z') return cp - 32;
        if ((cp >= 0xe0 && cp <= 0xfe && cp != 0xf7)) return cp - 32;
        if (cp >= 0x3b1 && cp <= 0x3c9 && cp != 0x3c2) return cp - 32;
        if (cp >= 0x430 && cp <= 0x44f) return cp - 32;
        if (cp >= 0x450 && cp <= 0x45f) return cp - 80;
    } else {
        if (cp >= 'A' && cp <= 'Z') return cp + 32;
        if ((cp >= 0xc0 && cp <= 0xde && cp != 0xd7)) return cp + 32;
        if (cp >= 0x391 && cp <= 0x3a9 && cp != 0x3a2) return cp + 32;
        if (cp >= 0x410 && cp <= 0x42f) return cp + 32;
        if (cp >= 0x400 && cp <= 0x40f) return cp + 80;
    }
    return cp;
}

static bool is_cased(uint32_t cp) {
    return case_map(cp, true) != cp || case_map(cp, false) != cp;
}
static bool is_upper_cp(uint32_t cp) {
    return case_map(cp, false) != cp;
}
static bool is_lower_cp(uint32_t cp) {
    return case_map(cp, true) != cp;
}

typedef enum { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_TITLE, CASE_SWAP } case_mode;

static jinja_value str_case(render *r, jinja_value v, case_mode mode) {
    moe_strbuf b = jinja_strbuf(&r->c);
    bool prev_cased = false, first = true;
    for (size_t p = 0; p < v.s->len;) {
        uint32_t cp = jinja_utf8_next(v.s->data, v.s->len, &p);
        uint32_t o = cp;
        switch (mode) {
        case CASE_UPPER:
            o = case_map(cp, true);
            break;
        case CASE_LOWER:
            o = case_map(cp, false);
            break;
        case CASE_CAPITALIZE:
            o = case_map(cp, first);
            break;
        case CASE_TITLE:
            o = case_map(cp, !prev_cased);
            break;
        case CASE_SWAP:
            o = is_upper_cp(cp) ? case_map(cp, false) : case_map(cp, true);
            break;
        }
        prev_cased = is_cased(cp);
        first = false;
        jinja_utf8_put(&b, o);
    }
    jinja_value out = jv_str_buf(&r->c, &b);
    out.safe = v.safe;
    return out;
}

/* strip(chars): which side 1 = left, 2 = right, 3 = both; chars NULL: whitespace. */
static jinja_value str_strip(render *r, jinja_value v, jinja_value chars, int side) {
    const char *s = v.s->data;
    size_t n = v.s->len, lo = 0, hi = n;
    bool ws = missing(chars) || chars.kind == JV_NONE;
    if (!ws && chars.kind != JV_STR) fail(r, "strip arg must be None or str");
    if (side & 1) {
        while (lo < hi) {
            size_t q = lo;
            uint32_t cp = jinja_utf8_next(s, n, &q);
            bool hit = ws ? jinja_py_space(cp) : false;
            if (!ws)
                for (size_t k = 0; k < chars.s->len;) {
                    if (jinja_utf8_next(chars.s->data, chars.s->len, &k) == cp) {
                        hit = true;
                        break;
                    }
                }
            if (!hit) break;
            lo = q;
        }
    }
    if (side & 2) {
        while (hi > lo) {
            size_t start = hi - 1;
            while (start > lo && ((unsigned char)s[start] & 0xc0) == 0x80) start--;
            size_t q = start;
            uint32_t cp = jinja_utf8_next(s, n, &q);
            bool hit = ws ? jinja_py_space(cp) : false;
            if (!ws)
                for (size_t k = 0; k < chars.s->len;) {
                    if (jinja_utf8_next(chars.s->data, chars.s->len, &k) == cp) {
                        hit = true;
                        break;
                    }
                }
            if (!hit) break;
            hi = start;
        }
    }
    jinja_value out = str_of(r, s + lo, hi - lo);
    out.safe = v.safe;
    return out;
}

static const char *memmem_at(const char *h, size_t hn, const char *n, size_t nn) {
    if (nn == 0) return h;
    if (hn < nn) return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == n[0] && memcmp(h + i, n, nn) == 0) return h + i;
    return NULL;
}

static size_t count_sub(const char *h, size_t hn, const char *n, size_t nn) {
    if (nn == 0) return jinja_utf8_count(h, hn) + 1;
    size_t c = 0;
    const char *p = h, *end = h + hn;
    const char *f;
    while ((f = memmem_at(p, (size_t)(end - p), n, nn))) {
        c++;
        p = f + nn;
    }
    return c;
}

static jinja_value str_replace(render *r, jinja_value v, jinja_value old, jinja_value new_,
                               int64_t count) {
    if (old.kind != JV_STR || new_.kind != JV_STR) fail(r, "replace() arguments must be str");
    moe_strbuf b = jinja_strbuf(&r->c);
    const char *s = v.s->data, *end = s + v.s->len;
    if (old.s->len == 0) { /* Python inserts between every character */
        int64_t done = 0;
        for (size_t p = 0;;) {
            if (count < 0 || done < count) {
                moe_strbuf_put(&b, new_.s->data, new_.s->len);
                done++;
            }
            if (p >= v.s->len) break;
            size_t q = p;
            jinja_utf8_next(s, v.s->len, &q);
            moe_strbuf_put(&b, s + p, q - p);
            p = q;
        }
        return jv_str_buf(&r->c, &b);
    }
    int64_t done = 0;
    for (;;) {
        const char *f = count >= 0 && done >= count
                            ? NULL
                            : memmem_at(s, (size_t)(end - s), old.s->data, old.s->len);
        if (!f) break;
        moe_strbuf_put(&b, s, (size_t)(f - s));
        moe_strbuf_put(&b, new_.s->data, new_.s->len);
        s = f + old.s->len;
        done++;
    }
    moe_strbuf_put(&b, s, (size_t)(end - s));
    return jv_str_buf(&r->c, &b);
}

/* str.split(sep=None, maxsplit=-1); from the right when rsplit (only with maxsplit it matters) */
static jinja_value str_split(render *r, jinja_value v, jinja_value sep, int64_t maxsplit,
                             bool rsplit) {
    jinja_list *l = jv_list(&r->c, 0).l;
    const char *s = v.s->data;
    size_t n = v.s->len;
    if (missing(sep) || sep.kind == JV_NONE) {
        /* runs of whitespace; leading/trailing ignored */
        typedef struct {
            size_t a, b;
        } span;
        size_t p = 0, cap = 8, ns = 0;
        span *spans = jinja_alloc(&r->c, cap * sizeof *spans);
        while (p < n) {
            size_t q = p;
            while (q < n) {
                size_t t = q;
                if (!jinja_py_space(jinja_utf8_next(s, n, &t))) break;
                q = t;
            }
            if (q >= n) break;
            size_t e = q;
            while (e < n) {
                size_t t = e;
                if (jinja_py_space(jinja_utf8_next(s, n, &t))) break;
                e = t;
            }
            if (ns == cap) {
                span *bigger = jinja_alloc(&r->c, cap * 2 * sizeof *spans);
                memcpy(bigger, spans, cap * sizeof *spans);
                spans = bigger;
                cap *= 2;
            }
            spans[ns++] = (span){q, e};
            p = e;
        }
        if (maxsplit < 0 || (size_t)maxsplit + 1 >= ns) {
            for (size_t i = 0; i < ns; i++)
                jv_list_push(&r->c, l, str_of(r, s + spans[i].a, spans[i].b - spans[i].a));
        } else if (!rsplit) {
            for (size_t i = 0; i < (size_t)maxsplit; i++)
                jv_list_push(&r->c, l, str_of(r, s + spans[i].a, spans[i].b - spans[i].a));
            size_t a = spans[maxsplit].a, e = n; /* the remainder keeps trailing space */
            jv_list_push(&r->c, l, str_of(r, s + a, e - a));
        } else {
            size_t k = ns - (size_t)maxsplit;
            size_t a = 0, e = spans[k - 1].b;
            jv_list_push(&r->c, l, str_of(r, s + a, e - a));
            for (size_t i = k; i < ns; i++)
                jv_list_push(&r->c, l, str_of(r, s + spans[i].a, spans[i].b - spans[i].a));
        }
        return (jinja_value){.kind = JV_LIST, .l = l};
    }
    if (sep.kind != JV_STR) fail(r, "must be str or None, not %s", jv_type_name(sep));
    if (sep.s->len == 0) fail(r, "empty separator");
    const char *d = sep.s->data;
    size_t dn = sep.s->len;
    if (!rsplit || maxsplit < 0) {
        const char *p = s, *end = s + n, *f;
        int64_t done = 0;
        while ((maxsplit < 0 || done < maxsplit) && (f = memmem_at(p, (size_t)(end - p), d, dn))) {
            jv_list_push(&r->c, l, str_of(r, p, (size_t)(f - p)));
            p = f + dn;
            done++;
        }
        jv_list_push(&r->c, l, str_of(r, p, (size_t)(end - p)));
        return (jinja_value){.kind = JV_LIST, .l = l};
    }
    /* rsplit with a limit: find separators from the right */
    size_t end = n;
    int64_t done = 0;
    jinja_list *rev = jv_list(&r->c, 0).l;
    while (done < maxsplit && end >= dn) {
        size_t i = end - dn;
        bool found = false;
        for (;; i--) {
            if (memcmp(s + i, d, dn) == 0) {
                found = true;
                break;
            }
            if (i == 0) break;
        }
        if (!found) break;
        jv_list_push(&r->c, rev, str_of(r, s + i + dn, end - i - dn));
        end = i;
        done++;
    }
    jv_list_push(&r->c, l, str_of(r, s, end));
    for (size_t i = rev->n; i > 0; i--) jv_list_push(&r->c, l, rev->items[i - 1]);
    return (jinja_value){.kind = JV_LIST, .l = l};
}

/* splitlines: \n \r \r\n \v \f \x1c \x1d \x1e \x85 \u2028 \u2029 */
static jinja_list *str_splitlines(render *r, const char *s, size_t n, bool keepends) {
    jinja_list *l = jv_list(&r->c, 0).l;
    size_t start = 0, p = 0;
    while (p < n) {
        size_t q = p;
        uint32_t cp = jinja_utf8_next(s, n, &q);
        bool brk = cp == '\n' || cp == '\r' || cp == '\v' || cp == '\f' || cp == 0x1c ||
                   cp == 0x1d || cp == 0x1e || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
        if (!brk) {
            p = q;
            continue;
        }
        size_t eol = q;
        if (cp == '\r' && q < n && s[q] == '\n') eol = q + 1;
        jv_list_push(&r->c, l, str_of(r, s + start, (keepends ? eol : p) - start));
        start = p = eol;
    }
    if (start < n) jv_list_push(&r->c, l, str_of(r, s + start, n - start));
    return l;
}

/* ==== Argument binding ==== */

static void bind(render *r, const char *what, const args *a, size_t skip, const char *const *params,
                 size_t np, jinja_value *out) {
    for (size_t i = 0; i < np; i++) out[i] = (jinja_value){.kind = MISSING};
    size_t pos = 0;
    for (size_t i = skip; i < a->n; i++) {
        if (a->names && a->names[i]) {
            size_t k = 0;
            while (k < np && strcmp(params[k], a->names[i])) k++;
            if (k == np) fail(r, "%s() got an unexpected keyword argument '%s'", what, a->names[i]);
            if (!missing(out[k]))
                fail(r, "%s() got multiple values for argument '%s'", what, a->names[i]);
            out[k] = a->v[i];
        } else {
            if (pos >= np) fail(r, "%s() takes at most %zu argument(s)", what, np);
            out[pos++] = a->v[i];
        }
    }
}

static int64_t as_int(render *r, jinja_value v, const char *what) {
    if (v.kind == JV_INT) return v.i;
    if (v.kind == JV_BOOL) return v.b;
    fail(r, "%s must be an integer, not %s", what, jv_type_name(v));
}

static jinja_value or_default(jinja_value v, jinja_value d) {
    return missing(v) ? d : v;
}

/* ==== Calls, attributes, items (forward) ==== */

static jinja_value call_value(render *r, jinja_value f, const args *a);
static jinja_value get_attr(render *r, jinja_value obj, const char *name);
static jinja_value get_item(render *r, jinja_value obj, jinja_value key);
/* f / t: the row when the parser found it, else NULL and the name is looked up now */
static jinja_value apply_filter(render *r, const jinja_builtin *f, const char *name, jinja_value v,
                                const args *a);
static bool apply_test(render *r, const jinja_builtin *t, const char *name, jinja_value v,
                       const args *a);

/* attribute path "a.b.c" as used by map/selectattr/sort(attribute=) */
static jinja_value get_attr_path(render *r, jinja_value v, jinja_value path) {
    if (path.kind == JV_INT) return get_item(r, v, path);
    if (path.kind != JV_STR) fail(r, "attribute must be a string");
    const char *p = path.s->data;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        char part[256];
        if (n >= sizeof part) fail(r, "attribute name too long");
        memcpy(part, p, n);
        part[n] = '\0';
        bool numeric = n > 0;
        for (size_t i = 0; i < n; i++)
            if (!isdigit((unsigned char)part[i])) numeric = false;
        if (numeric)
            v = get_item(r, v, jv_int(strtoll(part, NULL, 10)));
        else
            v = get_item(r, v, cstr(r, part));
        if (!dot) return v;
        p = dot + 1;
    }
}

/* ==== Sorting (stable merge sort with a raising comparator) ==== */

typedef struct sort_key {
    bool case_sensitive;
    jinja_value attribute; /* MISSING: the item itself */
    int by;                /* dictsort: 0 key, 1 value, -1 not a pair */
} sort_key;

static jinja_value key_of(render *r, jinja_value v, const sort_key *k) {
    if (k->by >= 0) v = v.l->items[k->by];
    if (!missing(k->attribute) && k->attribute.kind != JV_NONE)
        v = get_attr_path(r, v, k->attribute);
    if (!k->case_sensitive && v.kind == JV_STR) v = str_case(r, v, CASE_LOWER);
    return v;
}

static void merge_sort(render *r, jinja_value *items, jinja_value *keys, size_t n, jinja_value *tmp,
                       jinja_value *tmpk, bool reverse) {
    if (n < 2) return;
    size_t h = n / 2;
    merge_sort(r, items, keys, h, tmp, tmpk, reverse);
    merge_sort(r, items + h, keys + h, n - h, tmp, tmpk, reverse);
    size_t i = 0, j = h, o = 0;
    while (i < h && j < n) {
        int c = jv_compare(&r->c, keys[j], keys[i]);
        bool take_right = reverse ? c > 0 : c < 0;
        if (take_right) {
            tmp[o] = items[j];
            tmpk[o++] = keys[j++];
        } else {
            tmp[o] = items[i];
            tmpk[o++] = keys[i++];
        }
    }
    while (i < h) {
        tmp[o] = items[i];
        tmpk[o++] = keys[i++];
    }
    while (j < n) {
        tmp[o] = items[j];
        tmpk[o++] = keys[j++];
    }
    memcpy(items, tmp, n * sizeof *items);
    memcpy(keys, tmpk, n * sizeof *keys);
}

static jinja_value sorted(render *r, jinja_list *src, const sort_key *k, bool reverse) {
    size_t n = src->n;
    jinja_value out = jv_list(&r->c, n);
    out.l->n = n;
    if (!n) return out;
    jinja_value *keys = jinja_alloc(&r->c, n * sizeof *keys);
    jinja_value *tmp = jinja_alloc(&r->c, n * sizeof *tmp);
    jinja_value *tmpk = jinja_alloc(&r->c, n * sizeof *tmpk);
    for (size_t i = 0; i < n; i++) {
        out.l->items[i] = src->items[i];
        keys[i] = key_of(r, src->items[i], k);
    }
    merge_sort(r, out.l->items, keys, n, tmp, tmpk, reverse);
    return out;
}

static jinja_value make_pair(render *r, jinja_value a, jinja_value b) {
    jinja_value t = jv_list(&r->c, 2);
    t.l->items[0] = a;
    t.l->items[1] = b;
    t.l->n = 2;
    t.l->tuple = true;
    return t;
}

/* ==== Builtins: filters, tests and methods, each a {name, fn, mode} row ====
 *
 * One row per name Jinja2 or Python knows; rows that share a function say in `mode` what differs
 * (a case mapping, a side, a flag set). A row without a function is a filter Jinja2 has and moe
 * does not run, or a method the sandbox forbids. Tests return a bool value. */

static const jinja_builtin *builtin_find(const jinja_builtin *table, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(table[i].name, name)) return &table[i];
    return NULL;
}
#define BUILTIN_FIND(table, name) builtin_find(table, sizeof table / sizeof *table, name)

static void no_args(render *r, const args *a, const jinja_builtin *b) {
    bind(r, b->name, a, 0, NULL, 0, NULL);
}

/* ==== Filters ==== */

static jinja_value f_tojson(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"ensure_ascii", "indent", "separators", "sort_keys"};
    jinja_value p[4];
    bind(r, b->name, a, 0, P, 4, p);
    jinja_json_opts o = {.ensure_ascii = !missing(p[0]) && jv_truthy(p[0]),
                         .sort_keys = !missing(p[3]) && jv_truthy(p[3])};
    char spaces[256];
    if (!missing(p[1]) && p[1].kind != JV_NONE) {
        if (p[1].kind == JV_STR) {
            o.indent = p[1].s->data;
        } else {
            int64_t w = as_int(r, p[1], "indent");
            if (w > 200) w = 200;
            if (w < 0) w = 0;
            memset(spaces, ' ', (size_t)w);
            spaces[w] = '\0';
            o.indent = spaces;
        }
    }
    o.item_sep = o.indent ? "," : ", ";
    o.key_sep = ": ";
    if (!missing(p[2]) && p[2].kind != JV_NONE) {
        if (p[2].kind != JV_LIST || p[2].l->n != 2 || p[2].l->items[0].kind != JV_STR ||
            p[2].l->items[1].kind != JV_STR)
            fail(r, "separators must be a pair of strings");
        o.item_sep = p[2].l->items[0].s->data;
        o.key_sep = p[2].l->items[1].s->data;
    }
    moe_strbuf out = jinja_strbuf(&r->c);
    jv_to_json(&r->c, &out, v, &o, 0);
    return jv_str_buf(&r->c, &out);
}

/* length and count */
static jinja_value f_length(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    switch (v.kind) {
    case JV_STR:
        return jv_int((int64_t)jinja_utf8_count(v.s->data, v.s->len));
    case JV_LIST:
        if (v.l->lazy == JL_ITER) break;
        return jv_int((int64_t)v.l->n);
    case JV_DICT:
        if (!v.d->ns) return jv_int((int64_t)v.d->n);
        break;
    case JV_UNDEF:
        return jv_int(0);
    default:
        break;
    }
    fail(r, "object of type '%s' has no len()", jv_type_name(v));
}

static jinja_value f_indent(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"width", "first", "blank"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    moe_strbuf ind = jinja_strbuf(&r->c);
    jinja_value width = or_default(p[0], jv_int(4));
    if (width.kind == JV_STR) {
        moe_strbuf_put(&ind, width.s->data, width.s->len);
    } else {
        int64_t w = as_int(r, width, "width");
        for (int64_t i = 0; i < w && i < 4096; i++) moe_strbuf_putc(&ind, ' ');
    }
    if (!ind.s) moe_strbuf_puts(&ind, "");
    bool first = !missing(p[1]) && jv_truthy(p[1]), blank = !missing(p[2]) && jv_truthy(p[2]);
    jinja_value s = jv_stringify(&r->c, v);
    moe_strbuf text = jinja_strbuf(&r->c);
    moe_strbuf_put(&text, s.s->data, s.s->len);
    moe_strbuf_putc(&text, '\n');
    jinja_list *lines = str_splitlines(r, text.s, text.len, false);
    moe_strbuf_free(&text);
    moe_strbuf out = jinja_strbuf(&r->c);
    if (first) moe_strbuf_put(&out, ind.s, ind.len);
    for (size_t i = 0; i < lines->n; i++) {
        jinja_str *line = lines->items[i].s;
        if (i) {
            moe_strbuf_putc(&out, '\n');
            if (blank || line->len) moe_strbuf_put(&out, ind.s, ind.len);
        }
        moe_strbuf_put(&out, line->data, line->len);
    }
    moe_strbuf_free(&ind);
    jinja_value res = jv_str_buf(&r->c, &out);
    res.safe = s.safe;
    return res;
}

static jinja_value f_join(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"d", "attribute"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    jinja_value sep = or_default(p[0], cstr(r, ""));
    sep = jv_stringify(&r->c, sep);
    jinja_list *l = iter_list(r, v);
    moe_strbuf out = jinja_strbuf(&r->c);
    for (size_t i = 0; i < l->n; i++) {
        if (i) moe_strbuf_put(&out, sep.s->data, sep.s->len);
        jinja_value item = l->items[i];
        if (!missing(p[1]) && p[1].kind != JV_NONE) item = get_attr_path(r, item, p[1]);
        jv_to_str(&r->c, &out, item);
    }
    return jv_str_buf(&r->c, &out);
}

/* select/reject/selectattr/rejectattr: keep items where the test (or truthiness) == want */
enum { SELECT_KEEP = 1, SELECT_BY_ATTR = 2 };
static jinja_value f_select(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    bool want = b->mode & SELECT_KEEP, by_attr = b->mode & SELECT_BY_ATTR;
    jinja_value out = as_generator(jv_list(&r->c, 0));
    if (!jv_truthy(v)) return out; /* jinja2: `if value:` before iterating */
    jinja_list *l = iter_list(r, v);
    size_t first = 0;
    jinja_value attr = {.kind = MISSING};
    if (by_attr) {
        if (a->n < 1) fail(r, "missing attribute argument");
        attr = a->v[0];
        first = 1;
    }
    const char *test = NULL;
    if (a->n > first) {
        if (a->v[first].kind != JV_STR) fail(r, "test name must be a string");
        test = a->v[first].s->data;
    }
    args rest = {.n = a->n > first + 1 ? a->n - first - 1 : 0,
                 .v = a->v + first + 1,
                 .names = a->names ? a->names + first + 1 : NULL};
    for (size_t i = 0; i < l->n; i++) {
        jinja_value item = l->items[i];
        jinja_value x = by_attr ? get_attr_path(r, item, attr) : item;
        bool ok = test ? apply_test(r, NULL, test, x, &rest) : jv_truthy(x);
        if (ok == want) jv_list_push(&r->c, out.l, item);
    }
    return out;
}

static jinja_value f_map(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    if (!jv_truthy(v)) return as_generator(jv_list(&r->c, 0)); /* `if value:` as jinja2 */
    jinja_list *l = iter_list(r, v);
    jinja_value out = as_generator(jv_list(&r->c, l->n));
    jinja_value attribute = {.kind = MISSING}, dflt = {.kind = MISSING};
    for (size_t i = 0; i < a->n; i++) {
        if (!a->names || !a->names[i]) continue;
        if (!strcmp(a->names[i], "attribute"))
            attribute = a->v[i];
        else if (!strcmp(a->names[i], "default"))
            dflt = a->v[i];
        else
            fail(r, "%s() got an unexpected keyword argument '%s'", b->name, a->names[i]);
    }
    if (!missing(attribute)) {
        for (size_t i = 0; i < l->n; i++) {
            jinja_value x = get_attr_path(r, l->items[i], attribute);
            if (x.kind == JV_UNDEF && !missing(dflt)) x = dflt;
            jv_list_push(&r->c, out.l, x);
        }
        return out;
    }
    if (a->n < 1 || a->v[0].kind != JV_STR) fail(r, "map requires a filter argument");
    args rest = {.n = a->n - 1, .v = a->v + 1, .names = a->names ? a->names + 1 : NULL};
    for (size_t i = 0; i < l->n; i++)
        jv_list_push(&r->c, out.l, apply_filter(r, NULL, a->v[0].s->data, l->items[i], &rest));
    return out;
}

/* first (mode 0) and last (mode 1) */
static jinja_value f_first_last(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    bool last = b->mode;
    if (last && v.kind == JV_LIST && v.l->lazy == JL_ITER)
        fail(r, "'generator' object is not reversible");
    jinja_list *l = iter_list(r, v);
    if (!l->n)
        return undef(
            r, last ? "No last item, sequence was empty." : "No first item, sequence was empty.",
            UNDEF_PLAIN, NULL);
    return l->items[last ? l->n - 1 : 0];
}

static jinja_value parse_number_text(render *r, const char *s, bool want_float, int base,
                                     bool *ok) {
    /* Python int()/float() of a str: surrounding whitespace allowed, underscores between digits */
    size_t n = strlen(s), lo = 0, hi = n;
    while (lo < hi && isspace((unsigned char)s[lo])) lo++;
    while (hi > lo && isspace((unsigned char)s[hi - 1])) hi--;
    char buf[128];
    size_t k = 0;
    for (size_t i = lo; i < hi && k + 1 < sizeof buf; i++)
        if (s[i] != '_') buf[k++] = s[i];
    buf[k] = '\0';
    *ok = false;
    if (!k) return jv_none();
    char *end;
    if (!want_float) {
        errno = 0;
        long long x = strtoll(buf, &end, base);
        if (*end == '\0' && !errno) {
            *ok = true;
            return jv_int(x);
        }
        return jv_none();
    }
    double d = strtod(buf, &end);
    if (*end == '\0') {
        *ok = true;
        return jv_float(d);
    }
    (void)r;
    return jv_none();
}

static jinja_value f_int(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"default", "base"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    jinja_value dflt = or_default(p[0], jv_int(0));
    int base = missing(p[1]) ? 10 : (int)as_int(r, p[1], "base");
    switch (v.kind) {
    case JV_INT:
        return v;
    case JV_BOOL:
        return jv_int(v.b);
    case JV_FLOAT:
        if (isnan(v.f) || isinf(v.f) || fabs(v.f) > 9.2e18) return dflt;
        return jv_int((int64_t)v.f);
    case JV_STR: {
        bool ok;
        jinja_value x = parse_number_text(r, v.s->data, false, base, &ok);
        if (ok) return x;
        x = parse_number_text(r, v.s->data, true, 10, &ok);
        if (ok && !isnan(x.f) && !isinf(x.f) && fabs(x.f) < 9.2e18) return jv_int((int64_t)x.f);
        return dflt;
    }
    default:
        return dflt;
    }
}

static jinja_value f_float(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"default"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    jinja_value dflt = or_default(p[0], jv_float(0));
    if (jv_is_num(v)) return jv_float(jv_as_double(v));
    if (v.kind == JV_STR) {
        bool ok;
        jinja_value x = parse_number_text(r, v.s->data, true, 10, &ok);
        if (ok) return x;
    }
    return dflt;
}

static jinja_value f_dictsort(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"case_sensitive", "by", "reverse"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    if (v.kind != JV_DICT) fail(r, "You can only sort by either \"key\" or \"value\"");
    sort_key k = {.case_sensitive = !missing(p[0]) && jv_truthy(p[0]),
                  .attribute = {.kind = MISSING},
                  .by = 0};
    if (!missing(p[1])) {
        if (p[1].kind == JV_STR && !strcmp(p[1].s->data, "value"))
            k.by = 1;
        else if (!(p[1].kind == JV_STR && !strcmp(p[1].s->data, "key")))
            fail(r, "You can only sort by either \"key\" or \"value\"");
    }
    jinja_list *pairs = jv_list(&r->c, v.d->n).l;
    for (size_t i = 0; i < v.d->n; i++)
        jv_list_push(&r->c, pairs, make_pair(r, v.d->keys[i], v.d->vals[i]));
    return sorted(r, pairs, &k, !missing(p[2]) && jv_truthy(p[2]));
}

static jinja_value f_sort(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"reverse", "case_sensitive", "attribute"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    sort_key k = {.case_sensitive = !missing(p[1]) && jv_truthy(p[1]), .attribute = p[2], .by = -1};
    return sorted(r, iter_list(r, v), &k, !missing(p[0]) && jv_truthy(p[0]));
}

static jinja_value f_unique(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"case_sensitive", "attribute"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    sort_key k = {.case_sensitive = !missing(p[0]) && jv_truthy(p[0]), .attribute = p[1], .by = -1};
    jinja_list *l = iter_list(r, v);
    jinja_value out = jv_list(&r->c, 0), seen = jv_list(&r->c, 0);
    for (size_t i = 0; i < l->n; i++) {
        jinja_value key = key_of(r, l->items[i], &k);
        bool dup = false;
        for (size_t j = 0; j < seen.l->n && !dup; j++) dup = jv_equal(seen.l->items[j], key);
        if (dup) continue;
        jv_list_push(&r->c, seen.l, key);
        jv_list_push(&r->c, out.l, l->items[i]);
    }
    return as_generator(out);
}

/* min (mode 0) and max (mode 1) */
static jinja_value f_minmax(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    bool want_max = b->mode;
    static const char *const P[] = {"case_sensitive", "attribute"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    sort_key k = {.case_sensitive = !missing(p[0]) && jv_truthy(p[0]), .attribute = p[1], .by = -1};
    jinja_list *l = iter_list(r, v);
    if (!l->n) return undef(r, "No aggregated item, sequence was empty.", UNDEF_PLAIN, NULL);
    size_t best = 0;
    jinja_value bk = key_of(r, l->items[0], &k);
    for (size_t i = 1; i < l->n; i++) {
        jinja_value key = key_of(r, l->items[i], &k);
        int c = jv_compare(&r->c, key, bk);
        if (want_max ? c > 0 : c < 0) {
            best = i;
            bk = key;
        }
    }
    return l->items[best];
}

static jinja_value num_add(render *r, jinja_value x, jinja_value y);

static jinja_value f_sum(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"attribute", "start"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    jinja_value acc = or_default(p[1], jv_int(0));
    jinja_list *l = iter_list(r, v);
    for (size_t i = 0; i < l->n; i++) {
        jinja_value x = l->items[i];
        if (!missing(p[0]) && p[0].kind != JV_NONE) x = get_attr_path(r, x, p[0]);
        acc = num_add(r, acc, x);
    }
    return acc;
}

static jinja_value f_round(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"precision", "method"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    int64_t prec = missing(p[0]) ? 0 : as_int(r, p[0], "precision");
    const char *method = missing(p[1]) ? "common" : p[1].kind == JV_STR ? p[1].s->data : "";
    if (!jv_is_num(v)) fail(r, "round() of a %s", jv_type_name(v));
    double x = jv_as_double(v), m = pow(10, (double)prec);
    if (!strcmp(method, "common")) {
        /* Python's round(): half to even on the exact decimal value */
        char buf[64];
        snprintf(buf, sizeof buf, "%.*f", (int)(prec < 0 ? 0 : prec > 30 ? 30 : prec), x);
        double y = prec >= 0 ? strtod(buf, NULL) : nearbyint(x * m) / m;
        return jv_float(y);
    }
    if (!strcmp(method, "ceil")) return jv_float(ceil(x * m) / m);
    if (!strcmp(method, "floor")) return jv_float(floor(x * m) / m);
    fail(r, "method must be common, ceil or floor");
}

static jinja_value f_truncate(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"length", "killwords", "end", "leeway"};
    jinja_value p[4];
    bind(r, b->name, a, 0, P, 4, p);
    jinja_value s = jv_stringify(&r->c, v);
    int64_t length = missing(p[0]) ? 255 : as_int(r, p[0], "length");
    bool killwords = !missing(p[1]) && jv_truthy(p[1]);
    jinja_value end = missing(p[2]) ? cstr(r, "...") : jv_stringify(&r->c, p[2]);
    int64_t leeway = missing(p[3]) || p[3].kind == JV_NONE ? 5 : as_int(r, p[3], "leeway");
    int64_t endlen = (int64_t)jinja_utf8_count(end.s->data, end.s->len);
    if (length < endlen)
        fail(r, "expected length >= %lld, got %lld", (long long)endlen, (long long)length);
    int64_t slen = (int64_t)jinja_utf8_count(s.s->data, s.s->len);
    if (slen <= length + leeway) return s;
    size_t cut = jinja_utf8_offset(s.s->data, s.s->len, (size_t)(length - endlen));
    moe_strbuf out = jinja_strbuf(&r->c);
    if (killwords) {
        moe_strbuf_put(&out, s.s->data, cut);
    } else {
        size_t sp = cut;
        while (sp > 0 && s.s->data[sp - 1] != ' ') sp--;
        moe_strbuf_put(&out, s.s->data, sp ? sp - 1 : 0);
    }
    moe_strbuf_put(&out, end.s->data, end.s->len);
    return jv_str_buf(&r->c, &out);
}

static jinja_value f_center(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"width"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    jinja_value s = jv_stringify(&r->c, v);
    int64_t width = missing(p[0]) ? 80 : as_int(r, p[0], "width");
    int64_t len = (int64_t)jinja_utf8_count(s.s->data, s.s->len);
    if (width <= len) return s;
    int64_t marg = width - len, left = marg / 2 + (marg & width & 1);
    moe_strbuf out = jinja_strbuf(&r->c);
    for (int64_t i = 0; i < left; i++) moe_strbuf_putc(&out, ' ');
    moe_strbuf_put(&out, s.s->data, s.s->len);
    for (int64_t i = 0; i < marg - left; i++) moe_strbuf_putc(&out, ' ');
    return jv_str_buf(&r->c, &out);
}

static jinja_value f_title(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    /* jinja's title: words start after runs of [-\s({\[<] */
    jinja_value s = jv_stringify(&r->c, v);
    moe_strbuf out = jinja_strbuf(&r->c);
    bool start = true;
    for (size_t p = 0; p < s.s->len;) {
        uint32_t cp = jinja_utf8_next(s.s->data, s.s->len, &p);
        bool sep =
            cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || jinja_py_space(cp);
        jinja_utf8_put(&out, sep ? cp : case_map(cp, start));
        start = sep;
    }
    jinja_value res = jv_str_buf(&r->c, &out);
    res.safe = s.safe;
    return res;
}

/* batch (mode 0) and slice (mode 1) */
static jinja_value f_batch_slice(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    bool is_slice = b->mode;
    static const char *const P[] = {"n", "fill_with"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    if (missing(p[0])) fail(r, "missing argument");
    int64_t k = as_int(r, p[0], "count");
    if (k <= 0) fail(r, "count must be positive");
    jinja_list *l = iter_list(r, v);
    jinja_value out = jv_list(&r->c, 0);
    bool fill = !missing(p[1]) && p[1].kind != JV_NONE;
    if (!is_slice) {
        jinja_value cur_ = jv_list(&r->c, 0);
        for (size_t i = 0; i < l->n; i++) {
            if ((int64_t)cur_.l->n == k) {
                jv_list_push(&r->c, out.l, cur_);
                cur_ = jv_list(&r->c, 0);
            }
            jv_list_push(&r->c, cur_.l, l->items[i]);
        }
        if (cur_.l->n) {
            if (fill)
                while ((int64_t)cur_.l->n < k) jv_list_push(&r->c, cur_.l, p[1]);
            jv_list_push(&r->c, out.l, cur_);
        }
        return as_generator(out);
    }
    size_t per = l->n / (size_t)k, extra = l->n % (size_t)k, offset = 0;
    for (size_t s = 0; s < (size_t)k; s++) {
        size_t start = offset + s * per, end = offset + (s + 1) * per;
        if (s < extra) offset++;
        end = offset + (s + 1) * per;
        jinja_value part = jv_list(&r->c, 0);
        for (size_t i = start; i < end && i < l->n; i++) jv_list_push(&r->c, part.l, l->items[i]);
        if (fill && s >= extra) jv_list_push(&r->c, part.l, p[1]);
        jv_list_push(&r->c, out.l, part);
    }
    return as_generator(out);
}

static jinja_value f_trim(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"chars"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    return str_strip(r, jv_stringify(&r->c, v), p[0], 3);
}

/* default and d */
static jinja_value f_default(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"default_value", "boolean"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    bool use = v.kind == JV_UNDEF || (!missing(p[1]) && jv_truthy(p[1]) && !jv_truthy(v));
    return use ? or_default(p[0], cstr(r, "")) : v;
}

static jinja_value f_string(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    return jv_stringify(&r->c, v);
}

static jinja_value f_items(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    if (v.kind == JV_UNDEF) return as_generator(jv_list(&r->c, 0));
    if (v.kind != JV_DICT || v.d->ns) fail(r, "Can only get item pairs from a mapping.");
    jinja_value out = as_generator(jv_list(&r->c, v.d->n));
    for (size_t i = 0; i < v.d->n; i++)
        jv_list_push(&r->c, out.l, make_pair(r, v.d->keys[i], v.d->vals[i]));
    return out;
}

/* upper, lower, capitalize: mode is the case_mode */
static jinja_value f_case(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    return str_case(r, jv_stringify(&r->c, v), (case_mode)b->mode);
}

static jinja_value f_safe(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    jinja_value s = jv_stringify(&r->c, v);
    s.safe = 1;
    return s;
}

/* escape and e (mode 0); forceescape (mode 1) escapes a Markup string again */
static jinja_value f_escape(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    if (b->mode && v.kind == JV_STR) v.safe = 0;
    return html_escape(r, v);
}

static jinja_value f_list(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    jinja_list *l = iter_list(r, v);
    jinja_value out = jv_list(&r->c, l->n);
    for (size_t i = 0; i < l->n; i++) jv_list_push(&r->c, out.l, l->items[i]);
    return out;
}

static jinja_value f_replace(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"old", "new", "count"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    if (missing(p[0]) || missing(p[1])) fail(r, "replace() needs old and new");
    int64_t count = missing(p[2]) || p[2].kind == JV_NONE ? -1 : as_int(r, p[2], "count");
    jinja_value s = jv_stringify(&r->c, v);
    return str_replace(r, s, jv_stringify(&r->c, p[0]), jv_stringify(&r->c, p[1]), count);
}

static jinja_value f_abs(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    if (v.kind == JV_INT) return jv_int(v.i < 0 ? -v.i : v.i);
    if (v.kind == JV_BOOL) return jv_int(v.b);
    if (v.kind == JV_FLOAT) return jv_float(fabs(v.f));
    fail(r, "bad operand type for abs(): '%s'", jv_type_name(v));
}

static jinja_value f_reverse(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    if (v.kind == JV_STR) {
        jinja_list *chars = iter_list(r, v);
        moe_strbuf out = jinja_strbuf(&r->c);
        for (size_t i = chars->n; i > 0; i--)
            moe_strbuf_put(&out, chars->items[i - 1].s->data, chars->items[i - 1].s->len);
        return jv_str_buf(&r->c, &out);
    }
    jinja_list *l = iter_list(r, v);
    jinja_value out = jv_list(&r->c, l->n);
    for (size_t i = l->n; i > 0; i--) jv_list_push(&r->c, out.l, l->items[i - 1]);
    return as_generator(out); /* reversed(): an iterator */
}

static jinja_value f_wordcount(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    jinja_value s = jv_stringify(&r->c, v);
    int64_t words = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.s->len; i++) {
        unsigned char ch = (unsigned char)s.s->data[i];
        bool w = isalnum(ch) || ch == '_' || ch >= 0x80;
        if (w && !in_word) words++;
        in_word = w;
    }
    return jv_int(words);
}

static jinja_value f_attr(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"name"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0]) || p[0].kind != JV_STR) fail(r, "attr() needs a name");
    return get_attr(r, v, p[0].s->data);
}

static jinja_value f_pprint(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    moe_strbuf out = jinja_strbuf(&r->c);
    jv_to_repr(&r->c, &out, v);
    return jv_str_buf(&r->c, &out);
}

static jinja_value percent_format(render *r, jinja_value fmt, jinja_list *vals);

static jinja_value f_format(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    jinja_value s = jv_stringify(&r->c, v);
    jinja_list *vals = jv_list(&r->c, a->n).l;
    for (size_t i = 0; i < a->n; i++) {
        if (a->names && a->names[i])
            fail(r, "%s filter keyword arguments are not supported", b->name);
        jv_list_push(&r->c, vals, a->v[i]);
    }
    return percent_format(r, s, vals);
}

/* Every filter Jinja2 3.x has, with tojson as transformers defines it. */
static const jinja_builtin filters[] = {
    {"abs", f_abs, 0},
    {"attr", f_attr, 0},
    {"batch", f_batch_slice, 0},
    {"capitalize", f_case, CASE_CAPITALIZE},
    {"center", f_center, 0},
    {"count", f_length, 0},
    {"d", f_default, 0},
    {"default", f_default, 0},
    {"dictsort", f_dictsort, 0},
    {"e", f_escape, 0},
    {"escape", f_escape, 0},
    {"filesizeformat", NULL, 0},
    {"first", f_first_last, 0},
    {"float", f_float, 0},
    {"forceescape", f_escape, 1},
    {"format", f_format, 0},
    {"groupby", NULL, 0},
    {"indent", f_indent, 0},
    {"int", f_int, 0},
    {"items", f_items, 0},
    {"join", f_join, 0},
    {"last", f_first_last, 1},
    {"length", f_length, 0},
    {"list", f_list, 0},
    {"lower", f_case, CASE_LOWER},
    {"map", f_map, 0},
    {"max", f_minmax, 1},
    {"min", f_minmax, 0},
    {"pprint", f_pprint, 0},
    {"random", NULL, 0},
    {"reject", f_select, 0},
    {"rejectattr", f_select, SELECT_BY_ATTR},
    {"replace", f_replace, 0},
    {"reverse", f_reverse, 0},
    {"round", f_round, 0},
    {"safe", f_safe, 0},
    {"select", f_select, SELECT_KEEP},
    {"selectattr", f_select, SELECT_KEEP | SELECT_BY_ATTR},
    {"slice", f_batch_slice, 1},
    {"sort", f_sort, 0},
    {"string", f_string, 0},
    {"striptags", NULL, 0},
    {"sum", f_sum, 0},
    {"title", f_title, 0},
    {"tojson", f_tojson, 0},
    {"trim", f_trim, 0},
    {"truncate", f_truncate, 0},
    {"unique", f_unique, 0},
    {"upper", f_case, CASE_UPPER},
    {"urlencode", NULL, 0},
    {"urlize", NULL, 0},
    {"wordcount", f_wordcount, 0},
    {"wordwrap", NULL, 0},
    {"xmlattr", NULL, 0},
};

static jinja_value apply_filter(render *r, const jinja_builtin *f, const char *name, jinja_value v,
                                const args *a) {
    if (!f) f = jinja_filter_find(name);
    if (!f) fail(r, "No filter named '%s' found.", name);
    if (!f->fn) fail(r, "filter '%s' is not supported", name);
    return f->fn(r, v, a, f);
}

const jinja_builtin *jinja_filter_find(const char *name) {
    return BUILTIN_FIND(filters, name);
}

/* ==== Tests (each returns a bool value) ==== */

static jinja_value test_arg(render *r, const args *a, const jinja_builtin *b) {
    if (!a->n) fail(r, "test '%s' needs an argument", b->name);
    return a->v[0];
}

/* The tests that look at the value alone: mode says which. */
enum {
    TEST_UNDEFINED,
    TEST_DEFINED,
    TEST_NONE,
    TEST_BOOLEAN,
    TEST_TRUE,
    TEST_FALSE,
    TEST_INTEGER,
    TEST_FLOAT,
    TEST_NUMBER,
    TEST_STRING,
    TEST_MAPPING,
    TEST_ITERABLE, /* and sequence */
    TEST_CALLABLE,
    TEST_ESCAPED,
};
static jinja_value t_value(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    (void)r;
    (void)a;
    bool mapping = v.kind == JV_DICT && !v.d->ns;
    switch (b->mode) {
    case TEST_UNDEFINED:
        return jv_bool(v.kind == JV_UNDEF);
    case TEST_DEFINED:
        return jv_bool(v.kind != JV_UNDEF);
    case TEST_NONE:
        return jv_bool(v.kind == JV_NONE);
    case TEST_BOOLEAN:
        return jv_bool(v.kind == JV_BOOL);
    case TEST_TRUE:
        return jv_bool(v.kind == JV_BOOL && v.b);
    case TEST_FALSE:
        return jv_bool(v.kind == JV_BOOL && !v.b);
    case TEST_INTEGER:
        return jv_bool(v.kind == JV_INT);
    case TEST_FLOAT:
        return jv_bool(v.kind == JV_FLOAT);
    case TEST_NUMBER:
        return jv_bool(jv_is_num(v));
    case TEST_STRING:
        return jv_bool(v.kind == JV_STR);
    case TEST_MAPPING:
        return jv_bool(mapping);
    case TEST_ITERABLE:
        return jv_bool(v.kind == JV_STR || v.kind == JV_LIST || mapping || v.kind == JV_UNDEF);
    case TEST_CALLABLE:
        return jv_bool(v.kind == JV_MACRO || v.kind == JV_FUNC || v.kind == JV_METHOD ||
                       v.kind == JV_LOOP);
    default:
        return jv_bool(v.kind == JV_STR && v.safe);
    }
}

/* filter (mode 0) and test (mode 1): is the string the name of one */
static jinja_value t_named(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    (void)r;
    (void)a;
    return jv_bool(v.kind == JV_STR &&
                   (b->mode ? jinja_test_find(v.s->data) : jinja_filter_find(v.s->data)));
}

/* lower (mode 0) and upper (mode 1): some cased character and none of the other case */
static jinja_value t_case(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    (void)r;
    (void)a;
    if (v.kind != JV_STR) return jv_bool(false);
    bool any = false;
    for (size_t p = 0; p < v.s->len;) {
        uint32_t cp = jinja_utf8_next(v.s->data, v.s->len, &p);
        if (b->mode ? is_lower_cp(cp) : is_upper_cp(cp)) return jv_bool(false);
        if (is_cased(cp)) any = true;
    }
    return jv_bool(any);
}

/* even (mode 0) and odd (mode 1) */
static jinja_value t_parity(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    (void)a;
    int64_t x = as_int(r, v, b->name);
    return jv_bool(((x % 2) != 0) == (bool)b->mode);
}

static jinja_value t_divisibleby(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    int64_t d = as_int(r, test_arg(r, a, b), "divisor");
    if (!d) fail(r, "integer division or modulo by zero");
    return jv_bool(as_int(r, v, "value") % d == 0);
}

static jinja_value t_sameas(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    jinja_value arg = test_arg(r, a, b);
    if (v.kind != arg.kind) return jv_bool(false);
    switch (v.kind) {
    case JV_NONE:
    case JV_UNDEF:
        return jv_bool(true);
    case JV_BOOL:
        return jv_bool(v.b == arg.b);
    case JV_INT: /* CPython caches the small ints: only those are the same object */
        return jv_bool(v.i == arg.i && v.i >= -5 && v.i <= 256);
    case JV_LIST:
        return jv_bool(v.l == arg.l);
    case JV_DICT:
        return jv_bool(v.d == arg.d);
    default:
        return jv_bool(false);
    }
}

/* eq, ne, lt, le, gt, ge and their aliases: mode is the jinja_op */
static jinja_value binary(render *r, jinja_op op, jinja_value x, jinja_value y);
static jinja_value t_compare(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    return binary(r, (jinja_op)b->mode, v, test_arg(r, a, b));
}

/* Python's `v in container` */
static bool contains(render *r, jinja_value v, jinja_value container) {
    if (container.kind == JV_STR) {
        if (v.kind != JV_STR) fail(r, "'in <string>' requires string as left operand");
        return memmem_at(container.s->data, container.s->len, v.s->data, v.s->len) != NULL;
    }
    if (container.kind == JV_DICT) {
        jinja_value dummy;
        return jv_dict_get(container.d, v, &dummy);
    }
    jinja_list *l = iter_list(r, container);
    for (size_t i = 0; i < l->n; i++)
        if (jv_equal(l->items[i], v)) return true;
    return false;
}

static jinja_value t_in(render *r, jinja_value v, const args *a, const jinja_builtin *b) {
    return jv_bool(contains(r, v, test_arg(r, a, b)));
}

/* Every test Jinja2 3.x has. */
static const jinja_builtin tests[] = {
    {"!=", t_compare, JOP_NE},
    {"<", t_compare, JOP_LT},
    {"<=", t_compare, JOP_LE},
    {"==", t_compare, JOP_EQ},
    {">", t_compare, JOP_GT},
    {">=", t_compare, JOP_GE},
    {"boolean", t_value, TEST_BOOLEAN},
    {"callable", t_value, TEST_CALLABLE},
    {"defined", t_value, TEST_DEFINED},
    {"divisibleby", t_divisibleby, 0},
    {"eq", t_compare, JOP_EQ},
    {"equalto", t_compare, JOP_EQ},
    {"escaped", t_value, TEST_ESCAPED},
    {"even", t_parity, 0},
    {"false", t_value, TEST_FALSE},
    {"filter", t_named, 0},
    {"float", t_value, TEST_FLOAT},
    {"ge", t_compare, JOP_GE},
    {"greaterthan", t_compare, JOP_GT},
    {"gt", t_compare, JOP_GT},
    {"in", t_in, 0},
    {"integer", t_value, TEST_INTEGER},
    {"iterable", t_value, TEST_ITERABLE},
    {"le", t_compare, JOP_LE},
    {"lessthan", t_compare, JOP_LT},
    {"lower", t_case, 0},
    {"lt", t_compare, JOP_LT},
    {"mapping", t_value, TEST_MAPPING},
    {"ne", t_compare, JOP_NE},
    {"none", t_value, TEST_NONE},
    {"number", t_value, TEST_NUMBER},
    {"odd", t_parity, 1},
    {"sameas", t_sameas, 0},
    {"sequence", t_value, TEST_ITERABLE},
    {"string", t_value, TEST_STRING},
    {"test", t_named, 1},
    {"true", t_value, TEST_TRUE},
    {"undefined", t_value, TEST_UNDEFINED},
    {"upper", t_case, 1},
};

static bool apply_test(render *r, const jinja_builtin *t, const char *name, jinja_value v,
                       const args *a) {
    if (!t) t = jinja_test_find(name);
    if (!t) fail(r, "No test named '%s' found.", name);
    return jv_truthy(t->fn(r, v, a, t));
}

const jinja_builtin *jinja_test_find(const char *name) {
    return BUILTIN_FIND(tests, name);
}

/* ==== Python %-formatting (the `format` filter and str % args) ==== */

static jinja_value percent_format(render *r, jinja_value fmt, jinja_list *vals) {
    moe_strbuf b = jinja_strbuf(&r->c);
    size_t vi = 0;
    const char *s = fmt.s->data;
    size_t n = fmt.s->len;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') {
            moe_strbuf_putc(&b, s[i]);
            continue;
        }
        if (++i >= n) {
            moe_strbuf_free(&b);
            fail(r, "incomplete format");
        }
        if (s[i] == '%') {
            moe_strbuf_putc(&b, '%');
            continue;
        }
        char spec[32];
        size_t k = 0;
        spec[k++] = '%';
        while (i < n && strchr("-+ #0123456789.", s[i]) && k < 20) spec[k++] = s[i++];
        if (i >= n) {
            moe_strbuf_free(&b);
            fail(r, "incomplete format");
        }
        char conv = s[i];
        if (vi >= vals->n) {
            moe_strbuf_free(&b);
            fail(r, "not enough arguments for format string");
        }
        jinja_value v = vals->items[vi++];
        if (conv == 's' || conv == 'r') {
            moe_strbuf t = jinja_strbuf(&r->c);
            if (conv == 's')
                jv_to_str(&r->c, &t, v);
            else
                jv_to_repr(&r->c, &t, v);
            spec[k++] = 's';
            spec[k] = '\0';
            moe_strbuf_printf(&b, spec, t.s ? t.s : "");
            moe_strbuf_free(&t);
        } else if (conv == 'd' || conv == 'i') {
            if (!jv_is_num(v)) {
                moe_strbuf_free(&b);
                fail(r, "%%d format: a number is required, not %s", jv_type_name(v));
            }
            spec[k++] = 'l';
            spec[k++] = 'l';
            spec[k++] = 'd';
            spec[k] = '\0';
            moe_strbuf_printf(&b, spec,
                              (long long)(v.kind == JV_FLOAT  ? (int64_t)v.f
                                          : v.kind == JV_BOOL ? v.b
                                                              : v.i));
        } else if (strchr("feEgGxXo", conv)) {
            if (!jv_is_num(v)) {
                moe_strbuf_free(&b);
                fail(r, "format: a number is required, not %s", jv_type_name(v));
            }
            if (strchr("xXo", conv)) {
                spec[k++] = 'l';
                spec[k++] = 'l';
                spec[k++] = conv;
                spec[k] = '\0';
                moe_strbuf_printf(&b, spec, (long long)jv_as_double(v));
            } else {
                spec[k++] = conv;
                spec[k] = '\0';
                moe_strbuf_printf(&b, spec, jv_as_double(v));
            }
        } else {
            moe_strbuf_free(&b);
            fail(r, "unsupported format character '%c'", conv);
        }
    }
    if (vi < vals->n) {
        moe_strbuf_free(&b);
        fail(r, "not all arguments converted during string formatting");
    }
    return jv_str_buf(&r->c, &b);
}

/* ==== Python's str.format and its format mini-language ==== */

typedef struct format_spec {
    uint32_t fill;     /* a code point */
    char align;        /* '<', '>', '^', '=' or 0 (the type's default) */
    char sign;         /* '+', '-', ' ' or 0 */
    bool alt;          /* '#' */
    char grouping;     /* ',', '_' or 0 */
    bool zero_grouped; /* the '0' flag with grouping: the zeros are digits, separators go between */
    int64_t width, precision; /* -1: not given */
    char type;                /* 0: not given */
} format_spec;

static bool spec_char(char c, const char *set) {
    return c && strchr(set, c);
}

static int64_t spec_number(render *r, const char *s, size_t n, size_t *p) {
    int64_t v = 0;
    size_t start = *p;
    for (; *p < n && s[*p] >= '0' && s[*p] <= '9'; (*p)++) {
        v = v * 10 + (s[*p] - '0');
        if (v > JINJA_MAX_OUTPUT) fail(r, "Too many decimal digits in format string");
    }
    return *p > start ? v : -1;
}

/* [[fill]align][sign][z][#][0][width][grouping][.precision][type]; numbers says what '0' means */
static format_spec parse_spec(render *r, const char *s, size_t n, bool number) {
    format_spec f = {.fill = ' ', .width = -1, .precision = -1};
    size_t p = 0, q = 0;
    bool fill_given = false;
    uint32_t first = n ? jinja_utf8_next(s, n, &q) : 0;
    if (q < n && spec_char(s[q], "<>=^")) {
        f.fill = first;
        f.align = s[q];
        fill_given = true;
        p = q + 1;
    } else if (n && spec_char(s[0], "<>=^")) {
        f.align = s[0];
        p = 1;
    }
    if (p < n && spec_char(s[p], "+- ")) f.sign = s[p++];
    if (p < n && s[p] == 'z') p++; /* negative zero as zero: no value here differs */
    if (p < n && s[p] == '#') f.alt = s[p++] == '#';
    bool zero = p < n && s[p] == '0';
    if (zero) {
        p++;
        if (!fill_given) f.fill = '0';
        if (!f.align && number) f.align = '=';
    }
    f.width = spec_number(r, s, n, &p);
    if (p < n && spec_char(s[p], ",_")) f.grouping = s[p++];
    f.zero_grouped = zero && number && f.align == '=' && !fill_given && f.grouping;
    if (p < n && s[p] == '.') {
        p++;
        f.precision = spec_number(r, s, n, &p);
        if (f.precision < 0) fail(r, "Format specifier missing precision");
    }
    if (p < n) f.type = s[p++];
    if (p < n) fail(r, "Invalid format specifier");
    return f;
}

/* The integer part digits[0..n) with the grouping character every `every` digits, led by zeros
 * until it is at least min_len long (a separator is never first: it may overshoot by one). */
static void put_grouped(moe_strbuf *out, const char *digits, size_t n, char grouping, int every,
                        size_t min_len) {
    size_t k = n; /* digits to write, zeros included */
    while (k + (grouping ? (k - 1) / (size_t)every : 0) < min_len) k++;
    for (size_t i = 0; i < k; i++) {
        if (grouping && i && (k - i) % (size_t)every == 0) moe_strbuf_putc(out, grouping);
        moe_strbuf_putc(out, i < k - n ? '0' : digits[i - (k - n)]);
    }
}

/* How long the integer part must be for the '0' flag with grouping to fill the width, given
 * the other characters (sign aside) the number takes. */
static size_t zero_grouped_len(const format_spec *f, bool negative, size_t other) {
    if (!f->zero_grouped || f->width < 0) return 0;
    size_t used = other + (negative || f->sign == '+' || f->sign == ' ');
    return (size_t)f->width > used ? (size_t)f->width - used : 0;
}

/* The digits of a number (no sign): integers in their base, floats as printf or repr writes
 * them; grouping goes into the integer part. */
static void format_digits(render *r, moe_strbuf *out, jinja_value v, const format_spec *f,
                          bool *negative) {
    char tmp[400];
    char type = f->type;
    if (v.kind != JV_FLOAT && !spec_char(type, "eEfFgG%")) {
        int64_t i = v.kind == JV_BOOL ? v.b : v.i;
        *negative = i < 0;
        uint64_t u = i < 0 ? (uint64_t)0 - (uint64_t)i : (uint64_t)i;
        if (type == 'c') {
            if (i < 0 || u > 0x10ffff) fail(r, "%%c arg not in range(0x110000)");
            jinja_utf8_put(out, (uint32_t)u);
            return;
        }
        int base = type == 'b' ? 2 : type == 'o' ? 8 : spec_char(type, "xX") ? 16 : 10;
        const char *digit_set = type == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
        bool prefixed = f->alt && base != 10;
        if (prefixed)
            moe_strbuf_puts(out, base == 2 ? "0b" : base == 8 ? "0o" : type == 'X' ? "0X" : "0x");
        size_t n = 0;
        do {
            tmp[sizeof tmp - 1 - n++] = digit_set[u % (uint64_t)base];
            u /= (uint64_t)base;
        } while (u);
        if (f->grouping == ',' && base != 10) fail(r, "Cannot specify ',' with '%c'.", type);
        put_grouped(out, tmp + sizeof tmp - n, n, f->grouping, base == 10 ? 3 : 4,
                    zero_grouped_len(f, *negative, prefixed ? 2 : 0));
        return;
    }
    double x = jv_as_double(v);
    *negative = signbit(x);
    x = fabs(x);
    bool upper = spec_char(type, "EFG");
    if (isinf(x) || isnan(x)) {
        moe_strbuf_puts(out, isinf(x) ? (upper ? "INF" : "inf") : (upper ? "NAN" : "nan"));
        if (type == '%') moe_strbuf_putc(out, '%');
        return;
    }
    int prec = f->precision < 0 ? 6 : f->precision > 300 ? 300 : (int)f->precision;
    moe_strbuf body = jinja_strbuf(&r->c);
    switch (type) {
    case 'f':
    case 'F':
        moe_strbuf_printf(&body, f->alt ? "%#.*f" : "%.*f", prec, x);
        break;
    case '%':
        moe_strbuf_printf(&body, f->alt ? "%#.*f%%" : "%.*f%%", prec, x * 100);
        break;
    case 'e':
    case 'E':
        moe_strbuf_printf(&body, f->alt ? (upper ? "%#.*E" : "%#.*e") : (upper ? "%.*E" : "%.*e"),
                          prec, x);
        break;
    case 'g':
    case 'G':
    case 'n':
        moe_strbuf_printf(&body, f->alt ? (upper ? "%#.*G" : "%#.*g") : (upper ? "%.*G" : "%.*g"),
                          prec ? prec : 1, x);
        break;
    default: /* none: repr; with a precision, 'g' that switches to exponents at p - 1 and keeps
              * one decimal in fixed notation */
        if (f->precision < 0) {
            jinja_format_float(&body, x);
            break;
        }
        prec = prec ? prec : 1;
        moe_strbuf_printf(&body, "%.*e", prec - 1, x);
        char *e = strchr(body.s, 'e');
        int exp10 = atoi(e + 1);
        if (exp10 >= -4 && exp10 < prec - 1) {
            moe_strbuf_reset(&body);
            moe_strbuf_printf(&body, "%.*g", prec, x);
            if (!strchr(body.s, '.')) moe_strbuf_puts(&body, ".0");
        } else if (strchr(body.s, '.')) { /* drop the mantissa's trailing zeros, as 'g' does */
            char *m = e;
            while (m[-1] == '0') m--;
            if (m[-1] == '.') m--;
            memmove(m, e, strlen(e) + 1);
            body.len = strlen(body.s);
        }
        break;
    }
    size_t int_len = strspn(body.s, "0123456789");
    put_grouped(out, body.s, int_len, f->grouping, 3,
                zero_grouped_len(f, *negative, body.len - int_len));
    moe_strbuf_puts(out, body.s + int_len);
    moe_strbuf_free(&body);
}

/* format(v, spec) for the values templates have. */
static void format_value(render *r, moe_strbuf *out, jinja_value v, const char *spec, size_t n) {
    if (!n) {
        jv_to_str(&r->c, out, v);
        return;
    }
    bool number = jv_is_num(v);
    if (!number && v.kind != JV_STR)
        fail(r, "unsupported format string passed to %s.__format__", jv_type_name(v));
    format_spec f = parse_spec(r, spec, n, number);
    moe_strbuf body = jinja_strbuf(&r->c);
    const char *sign = "";
    size_t prefix = 0; /* bytes of body before the digits: the '=' padding goes there */
    if (v.kind == JV_STR) {
        if (f.type && f.type != 's')
            fail(r, "Unknown format code '%c' for object of type 'str'", f.type);
        if (f.sign) fail(r, "Sign not allowed in string format specifier");
        if (f.alt) fail(r, "Alternate form (#) not allowed in string format specifier");
        if (f.align == '=') fail(r, "'=' alignment not allowed in string format specifier");
        if (f.grouping) fail(r, "Cannot specify '%c' with 's'.", f.grouping);
        size_t len = v.s->len;
        if (f.precision >= 0) len = jinja_utf8_offset(v.s->data, v.s->len, (size_t)f.precision);
        moe_strbuf_put(&body, v.s->data, len);
        if (!f.align) f.align = '<';
    } else {
        const char *types = v.kind == JV_FLOAT ? "eEfFgGn%" : "bcdoxXneEfFgG%";
        if (f.type && !spec_char(f.type, types))
            fail(r, "Unknown format code '%c' for object of type '%s'", f.type, jv_type_name(v));
        if (f.precision >= 0 && v.kind != JV_FLOAT && !spec_char(f.type, "eEfFgG%"))
            fail(r, "Precision not allowed in integer format specifier");
        bool negative = false;
        format_digits(r, &body, v, &f, &negative);
        sign = negative ? "-" : f.sign == '+' ? "+" : f.sign == ' ' ? " " : "";
        if (f.alt && spec_char(f.type, "bBoxX")) prefix = 2;
        if (!f.align) f.align = '>';
    }
    size_t chars = strlen(sign) + jinja_utf8_count(body.s ? body.s : "", body.len);
    size_t pad = f.width > 0 && (size_t)f.width > chars ? (size_t)f.width - chars : 0;
    size_t left = f.align == '>' ? pad : f.align == '^' ? pad / 2 : 0;
    for (size_t i = 0; i < left; i++) jinja_utf8_put(out, f.fill);
    moe_strbuf_puts(out, sign);
    if (body.len) moe_strbuf_put(out, body.s, prefix);
    if (f.align == '=')
        for (size_t i = 0; i < pad; i++) jinja_utf8_put(out, f.fill);
    if (body.len) moe_strbuf_put(out, body.s + prefix, body.len - prefix);
    if (f.align == '<' || f.align == '^')
        for (size_t i = left; i < pad; i++) jinja_utf8_put(out, f.fill);
    moe_strbuf_free(&body);
}

typedef struct format_args {
    const args *a;
    size_t next;            /* the next automatic field number */
    bool manual, automatic; /* which numbering the string used (Python forbids mixing) */
} format_args;

/* The argument a field names: "" (the next one), a number or a keyword. */
static jinja_value format_arg(render *r, format_args *fa, const char *name, size_t n) {
    const args *a = fa->a;
    bool numeric = n > 0 && strspn(name, "0123456789") >= n;
    if (n && !numeric) {
        for (size_t i = 0; i < a->n; i++)
            if (a->names && a->names[i] && strlen(a->names[i]) == n &&
                !memcmp(a->names[i], name, n))
                return a->v[i];
        fail(r, "KeyError: '%.*s'", (int)n, name);
    }
    if (n ? fa->automatic : fa->manual)
        fail(r, "cannot switch from %s field specification to %s field numbering",
             n ? "automatic" : "manual", n ? "manual" : "automatic");
    *(n ? &fa->manual : &fa->automatic) = true;
    size_t want = n ? (size_t)strtoull(name, NULL, 10) : fa->next++, seen = 0;
    for (size_t i = 0; i < a->n; i++)
        if (!a->names || !a->names[i]) {
            if (seen++ == want) return a->v[i];
        }
    fail(r, "Replacement index %zu out of range for positional args tuple", want);
}

static void format_into(render *r, moe_strbuf *out, const char *s, size_t n, format_args *fa,
                        int depth);

/* One replacement field (between the braces): name, accessors, !conversion, :spec. */
static void format_field(render *r, moe_strbuf *out, const char *f, size_t n, format_args *fa,
                         int depth) {
    size_t k = 0; /* end of the name and its accessors */
    while (k < n && f[k] != '!' && f[k] != ':') {
        if (f[k] == '[')
            while (k < n && f[k] != ']') k++;
        if (k < n) k++;
    }
    size_t h = 0;
    while (h < k && f[h] != '.' && f[h] != '[') h++;
    jinja_value v = format_arg(r, fa, f, h);
    while (h < k) {
        bool item = f[h++] == '[';
        size_t e = h;
        while (e < k && (item ? f[e] != ']' : f[e] != '.' && f[e] != '[')) e++;
        if (e == h) fail(r, "Empty attribute in format string");
        if (item && e >= k) fail(r, "Missing ']' in format string");
        jinja_value key = str_of(r, f + h, e - h);
        if (item && strspn(key.s->data, "0123456789") == key.s->len)
            v = get_item(r, v, jv_int(strtoll(key.s->data, NULL, 10)));
        else
            v = item ? get_item(r, v, key) : get_attr(r, v, key.s->data);
        h = item ? e + 1 : e;
        if (item && h < k && f[h] != '.' && f[h] != '[')
            fail(r, "Only '.' or '[' may follow ']' in format field specifier");
    }
    size_t p = k;
    if (p < n && f[p] == '!') {
        if (p + 1 >= n) fail(r, "end of string while looking for conversion specifier");
        char conv = f[p + 1];
        p += 2;
        if (p < n && f[p] != ':') fail(r, "expected ':' after conversion specifier");
        if (conv != 'r' && conv != 's') fail(r, "Unknown conversion specifier %c", conv);
        moe_strbuf t = jinja_strbuf(&r->c);
        if (conv == 'r')
            jv_to_repr(&r->c, &t, v);
        else
            jv_to_str(&r->c, &t, v);
        v = jv_str_buf(&r->c, &t);
    }
    const char *spec = p < n ? f + p + 1 : "";
    size_t spec_len = p < n ? n - p - 1 : 0;
    if (memchr(spec, '{', spec_len)) { /* nested fields: {:{width}} */
        if (depth >= 1) fail(r, "Max string recursion exceeded");
        moe_strbuf t = jinja_strbuf(&r->c);
        format_into(r, &t, spec, spec_len, fa, depth + 1);
        jinja_value expanded = jv_str_buf(&r->c, &t);
        spec = expanded.s->data;
        spec_len = expanded.s->len;
    }
    format_value(r, out, v, spec, spec_len);
}

static void format_into(render *r, moe_strbuf *out, const char *s, size_t n, format_args *fa,
                        int depth) {
    for (size_t i = 0; i < n;) {
        if (s[i] != '{' && s[i] != '}') {
            size_t j = i;
            while (j < n && s[j] != '{' && s[j] != '}') j++;
            moe_strbuf_put(out, s + i, j - i);
            i = j;
            continue;
        }
        if (i + 1 < n && s[i + 1] == s[i]) { /* {{ and }} */
            moe_strbuf_putc(out, s[i]);
            i += 2;
            continue;
        }
        if (s[i] == '}') fail(r, "Single '}' encountered in format string");
        size_t start = ++i;
        int level = 1;
        for (; i < n; i++) {
            if (s[i] == '[') /* an item key may hold braces */
                while (i + 1 < n && s[i] != ']') i++;
            else if (s[i] == '{')
                level++;
            else if (s[i] == '}' && --level == 0)
                break;
        }
        if (i >= n) fail(r, "expected '}' before end of string");
        format_field(r, out, s + start, i - start, fa, depth);
        i++;
    }
}

/* ==== Methods of str, dict, list and loop ==== */

static jinja_value method_value(render *r, jinja_value self, const jinja_builtin *m) {
    jinja_method *bm = jinja_alloc(&r->c, sizeof *bm);
    bm->self = self;
    bm->def = m;
    return (jinja_value){.kind = JV_METHOD, .bm = bm};
}

static bool affix_match(render *r, jinja_value s, jinja_value affix, bool at_end) {
    if (affix.kind == JV_LIST && affix.l->tuple) {
        for (size_t i = 0; i < affix.l->n; i++)
            if (affix_match(r, s, affix.l->items[i], at_end)) return true;
        return false;
    }
    if (affix.kind != JV_STR)
        fail(r, "%s first arg must be str or a tuple of str, not %s",
             at_end ? "endswith" : "startswith", jv_type_name(affix));
    size_t n = affix.s->len;
    if (n > s.s->len) return false;
    return memcmp(s.s->data + (at_end ? s.s->len - n : 0), affix.s->data, n) == 0;
}

/* startswith (mode 0) and endswith (mode 1) */
static jinja_value m_affix(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"prefix", "start", "end"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    if (missing(p[0])) fail(r, "%s() takes at least 1 argument", b->name);
    jinja_value sub = s;
    if (!missing(p[1]) || !missing(p[2])) { /* with bounds: slice first */
        int64_t cnt = (int64_t)jinja_utf8_count(s.s->data, s.s->len);
        int64_t st = missing(p[1]) || p[1].kind == JV_NONE ? 0 : as_int(r, p[1], "start");
        int64_t en = missing(p[2]) || p[2].kind == JV_NONE ? cnt : as_int(r, p[2], "end");
        if (st < 0) st = st + cnt < 0 ? 0 : st + cnt;
        if (en < 0) en = en + cnt < 0 ? 0 : en + cnt;
        if (st > cnt) return jv_bool(false);
        if (en > cnt) en = cnt;
        if (en < st) en = st;
        size_t bs = jinja_utf8_offset(s.s->data, s.s->len, (size_t)st);
        size_t be = jinja_utf8_offset(s.s->data, s.s->len, (size_t)en);
        sub = str_of(r, s.s->data + bs, be - bs);
    }
    return jv_bool(affix_match(r, sub, p[0], b->mode));
}

/* split (mode 0) and rsplit (mode 1) */
static jinja_value m_split(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"sep", "maxsplit"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    int64_t maxsplit = missing(p[1]) ? -1 : as_int(r, p[1], "maxsplit");
    return str_split(r, s, p[0], maxsplit, b->mode);
}

static jinja_value m_splitlines(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"keepends"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    jinja_list *l = str_splitlines(r, s.s->data, s.s->len, !missing(p[0]) && jv_truthy(p[0]));
    return (jinja_value){.kind = JV_LIST, .l = l};
}

/* strip (mode 3), lstrip (1), rstrip (2) */
static jinja_value m_strip(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"chars"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    return str_strip(r, s, p[0], b->mode);
}

/* upper, lower, casefold, title, capitalize, swapcase: mode is the case_mode */
static jinja_value m_case(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    return str_case(r, s, (case_mode)b->mode);
}

static jinja_value m_replace(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"old", "new", "count"};
    jinja_value p[3];
    bind(r, b->name, a, 0, P, 3, p);
    if (missing(p[0]) || missing(p[1])) fail(r, "replace() takes at least 2 arguments");
    int64_t count = missing(p[2]) ? -1 : as_int(r, p[2], "count");
    jinja_value out = str_replace(r, s, p[0], p[1], count);
    out.safe = s.safe;
    return out;
}

/* find, rfind, index, rindex, count */
enum { FIND_FROM_RIGHT = 1, FIND_RAISES = 2, FIND_COUNT = 4 };
static jinja_value m_find(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"sub"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0]) || p[0].kind != JV_STR) fail(r, "%s() argument must be str", b->name);
    const jinja_str *sub = p[0].s;
    if (b->mode & FIND_COUNT)
        return jv_int((int64_t)count_sub(s.s->data, s.s->len, sub->data, sub->len));
    const char *f = NULL;
    if (b->mode & FIND_FROM_RIGHT) {
        for (size_t i = s.s->len + 1; i-- > 0;)
            if (i + sub->len <= s.s->len && !memcmp(s.s->data + i, sub->data, sub->len)) {
                f = s.s->data + i;
                break;
            }
    } else {
        f = memmem_at(s.s->data, s.s->len, sub->data, sub->len);
    }
    if (!f) {
        if (b->mode & FIND_RAISES) fail(r, "substring not found");
        return jv_int(-1);
    }
    return jv_int((int64_t)jinja_utf8_count(s.s->data, (size_t)(f - s.s->data)));
}

static jinja_value m_join(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"iterable"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0])) fail(r, "join() takes exactly one argument");
    jinja_list *l = iter_list(r, p[0]);
    moe_strbuf out = jinja_strbuf(&r->c);
    for (size_t i = 0; i < l->n; i++) {
        if (l->items[i].kind != JV_STR)
            fail(r, "sequence item %zu: expected str instance, %s found", i,
                 jv_type_name(l->items[i]));
        if (i) moe_strbuf_put(&out, s.s->data, s.s->len);
        moe_strbuf_put(&out, l->items[i].s->data, l->items[i].s->len);
    }
    return jv_str_buf(&r->c, &out);
}

/* isdigit & co: every character passes (and, for isupper/islower, one is cased) */
enum { IS_DIGIT, IS_ALPHA, IS_ALNUM, IS_SPACE, IS_UPPER, IS_LOWER };
static jinja_value m_is(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    if (!s.s->len) return jv_bool(false);
    bool any_cased = false;
    for (size_t q = 0; q < s.s->len;) {
        uint32_t cp = jinja_utf8_next(s.s->data, s.s->len, &q);
        bool ok = false;
        switch (b->mode) {
        case IS_DIGIT:
            ok = cp >= '0' && cp <= '9';
            break;
        case IS_ALPHA:
            ok = (cp < 0x80 && isalpha((int)cp)) || cp >= 0x80;
            break;
        case IS_ALNUM:
            ok = (cp < 0x80 && isalnum((int)cp)) || cp >= 0x80;
            break;
        case IS_SPACE:
            ok = jinja_py_space(cp);
            break;
        default:
            ok = b->mode == IS_UPPER ? !is_lower_cp(cp) : !is_upper_cp(cp);
            any_cased |= is_cased(cp);
            break;
        }
        if (!ok) return jv_bool(false);
    }
    return jv_bool(b->mode < IS_UPPER || any_cased);
}

/* removeprefix (mode 0) and removesuffix (mode 1) */
static jinja_value m_remove_affix(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"affix"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0]) || p[0].kind != JV_STR) fail(r, "%s() argument must be str", b->name);
    size_t n = p[0].s->len;
    if (!affix_match(r, s, p[0], b->mode)) return s;
    return str_of(r, s.s->data + (b->mode ? 0 : n), s.s->len - n);
}

/* ljust, rjust, center, zfill */
enum { PAD_LJUST, PAD_RJUST, PAD_CENTER, PAD_ZFILL };
static jinja_value m_pad(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"width", "fillchar"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, b->mode == PAD_ZFILL ? 1 : 2, p);
    if (missing(p[0])) fail(r, "%s() takes at least 1 argument", b->name);
    int64_t width = as_int(r, p[0], "width");
    const char *fill = b->mode == PAD_ZFILL                    ? "0"
                       : !missing(p[1]) && p[1].kind == JV_STR ? p[1].s->data
                                                               : " ";
    int64_t len = (int64_t)jinja_utf8_count(s.s->data, s.s->len);
    if (width <= len) return s;
    if (width > JINJA_MAX_OUTPUT) fail(r, "width too large");
    int64_t pad = width - len;
    int64_t left = b->mode == PAD_LJUST    ? 0
                   : b->mode == PAD_CENTER ? pad / 2 + (pad & width & 1)
                                           : pad;
    moe_strbuf out = jinja_strbuf(&r->c);
    size_t signlen =
        b->mode == PAD_ZFILL && s.s->len && (s.s->data[0] == '-' || s.s->data[0] == '+');
    moe_strbuf_put(&out, s.s->data, signlen);
    for (int64_t i = 0; i < left; i++) moe_strbuf_puts(&out, fill);
    moe_strbuf_put(&out, s.s->data + signlen, s.s->len - signlen);
    for (int64_t i = left; i < pad; i++) moe_strbuf_puts(&out, fill);
    return jv_str_buf(&r->c, &out);
}

/* partition (mode 0) and rpartition (mode 1) */
static jinja_value m_partition(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"sep"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0]) || p[0].kind != JV_STR || !p[0].s->len) fail(r, "bad separator");
    jinja_value parts = str_split(r, s, p[0], 1, b->mode);
    jinja_value empty = cstr(r, "");
    jinja_value t = jv_list(&r->c, 3);
    t.l->tuple = true;
    t.l->n = 3;
    if (parts.l->n == 2) {
        t.l->items[0] = parts.l->items[0];
        t.l->items[1] = p[0];
        t.l->items[2] = parts.l->items[1];
    } else {
        t.l->items[0] = b->mode ? empty : s;
        t.l->items[1] = empty;
        t.l->items[2] = b->mode ? s : empty;
    }
    return t;
}

static jinja_value m_format(render *r, jinja_value s, const args *a, const jinja_builtin *b) {
    (void)b;
    format_args fa = {.a = a};
    moe_strbuf out = jinja_strbuf(&r->c);
    format_into(r, &out, s.s->data, s.s->len, &fa, 0);
    return jv_str_buf(&r->c, &out);
}

static const jinja_builtin str_methods[] = {
    {"capitalize", m_case, CASE_CAPITALIZE},
    {"casefold", m_case, CASE_LOWER},
    {"center", m_pad, PAD_CENTER},
    {"count", m_find, FIND_COUNT},
    {"endswith", m_affix, 1},
    {"find", m_find, 0},
    {"format", m_format, 0},
    {"index", m_find, FIND_RAISES},
    {"isalnum", m_is, IS_ALNUM},
    {"isalpha", m_is, IS_ALPHA},
    {"isdecimal", m_is, IS_DIGIT},
    {"isdigit", m_is, IS_DIGIT},
    {"islower", m_is, IS_LOWER},
    {"isnumeric", m_is, IS_DIGIT},
    {"isspace", m_is, IS_SPACE},
    {"isupper", m_is, IS_UPPER},
    {"join", m_join, 0},
    {"ljust", m_pad, PAD_LJUST},
    {"lower", m_case, CASE_LOWER},
    {"lstrip", m_strip, 1},
    {"partition", m_partition, 0},
    {"removeprefix", m_remove_affix, 0},
    {"removesuffix", m_remove_affix, 1},
    {"replace", m_replace, 0},
    {"rfind", m_find, FIND_FROM_RIGHT},
    {"rindex", m_find, FIND_FROM_RIGHT | FIND_RAISES},
    {"rjust", m_pad, PAD_RJUST},
    {"rpartition", m_partition, 1},
    {"rsplit", m_split, 1},
    {"rstrip", m_strip, 2},
    {"split", m_split, 0},
    {"splitlines", m_splitlines, 0},
    {"startswith", m_affix, 0},
    {"strip", m_strip, 3},
    {"swapcase", m_case, CASE_SWAP},
    {"title", m_case, CASE_TITLE},
    {"upper", m_case, CASE_UPPER},
    {"zfill", m_pad, PAD_ZFILL},
};

static jinja_value m_dict_get(render *r, jinja_value d, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"key", "default"};
    jinja_value p[2];
    bind(r, b->name, a, 0, P, 2, p);
    if (missing(p[0])) fail(r, "get expected at least 1 argument");
    jinja_value v;
    if (jv_dict_get(d.d, p[0], &v)) return v;
    return missing(p[1]) ? jv_none() : p[1];
}

/* items (mode 0), keys (1), values (2): views */
static jinja_value m_dict_view(render *r, jinja_value d, const args *a, const jinja_builtin *b) {
    static const char *const view_names[] = {"dict_items", "dict_keys", "dict_values"};
    no_args(r, a, b);
    jinja_value out = jv_list(&r->c, d.d->n);
    out.l->lazy = JL_VIEW;
    out.l->view = view_names[b->mode];
    for (size_t i = 0; i < d.d->n; i++) {
        jinja_value x = b->mode == 0   ? make_pair(r, d.d->keys[i], d.d->vals[i])
                        : b->mode == 1 ? d.d->keys[i]
                                       : d.d->vals[i];
        jv_list_push(&r->c, out.l, x);
    }
    return out;
}

static jinja_value m_dict_copy(render *r, jinja_value d, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    jinja_value out = jv_dict(&r->c, d.d->n);
    for (size_t i = 0; i < d.d->n; i++) jv_dict_set(&r->c, out.d, d.d->keys[i], d.d->vals[i]);
    return out;
}

/* The sandbox's mutators (ImmutableSandboxedEnvironment) have no function. */
static const jinja_builtin dict_methods[] = {
    {"clear", NULL, 0},         {"copy", m_dict_copy, 0}, {"get", m_dict_get, 0},
    {"items", m_dict_view, 0},  {"keys", m_dict_view, 1}, {"pop", NULL, 0},
    {"popitem", NULL, 0},       {"setdefault", NULL, 0},  {"update", NULL, 0},
    {"values", m_dict_view, 2},
};

/* index (mode 0) and count (mode 1) */
static jinja_value m_list_find(render *r, jinja_value l, const args *a, const jinja_builtin *b) {
    static const char *const P[] = {"value"};
    jinja_value p[1];
    bind(r, b->name, a, 0, P, 1, p);
    if (missing(p[0])) fail(r, "%s() takes exactly one argument", b->name);
    int64_t count = 0;
    for (size_t i = 0; i < l.l->n; i++)
        if (jv_equal(l.l->items[i], p[0])) {
            if (!b->mode) return jv_int((int64_t)i);
            count++;
        }
    if (!b->mode) fail(r, "value is not in list");
    return jv_int(count);
}

static jinja_value m_list_copy(render *r, jinja_value l, const args *a, const jinja_builtin *b) {
    no_args(r, a, b);
    jinja_value out = jv_list(&r->c, l.l->n);
    for (size_t i = 0; i < l.l->n; i++) jv_list_push(&r->c, out.l, l.l->items[i]);
    return out;
}

static const jinja_builtin list_methods[] = {
    {"append", NULL, 0},       {"clear", NULL, 0},  {"copy", m_list_copy, 0},
    {"count", m_list_find, 1}, {"extend", NULL, 0}, {"index", m_list_find, 0},
    {"insert", NULL, 0},       {"pop", NULL, 0},    {"remove", NULL, 0},
    {"reverse", NULL, 0},      {"sort", NULL, 0},
};

static jinja_value m_loop_cycle(render *r, jinja_value loop, const args *a,
                                const jinja_builtin *b) {
    (void)b;
    if (!a->n) fail(r, "no items for cycling given");
    return a->v[loop.loop->index0 % a->n];
}

static jinja_value m_loop_changed(render *r, jinja_value loop, const args *a,
                                  const jinja_builtin *b) {
    (void)b;
    jinja_loop *l = loop.loop;
    jinja_value now = jv_list(&r->c, a->n);
    for (size_t i = 0; i < a->n; i++) jv_list_push(&r->c, now.l, a->v[i]);
    if (l->changed_seen && jv_equal(l->last_changed, now)) return jv_bool(false);
    l->changed_seen = true;
    l->last_changed = now;
    return jv_bool(true);
}

static const jinja_builtin loop_methods[] = {
    {"changed", m_loop_changed, 0},
    {"cycle", m_loop_cycle, 0},
};

/* The loop object's attributes: mode says which. */
enum {
    LOOP_INDEX,
    LOOP_INDEX0,
    LOOP_REVINDEX,
    LOOP_REVINDEX0,
    LOOP_FIRST,
    LOOP_LAST,
    LOOP_LENGTH,
    LOOP_DEPTH,
    LOOP_DEPTH0,
    LOOP_PREVITEM,
    LOOP_NEXTITEM
};
static jinja_value loop_attr(render *r, jinja_value loop, const args *a, const jinja_builtin *b) {
    (void)a;
    const jinja_loop *l = loop.loop;
    size_t n = l->items->n, i = l->index0;
    switch (b->mode) {
    case LOOP_INDEX:
        return jv_int((int64_t)i + 1);
    case LOOP_INDEX0:
        return jv_int((int64_t)i);
    case LOOP_REVINDEX:
        return jv_int((int64_t)(n - i));
    case LOOP_REVINDEX0:
        return jv_int((int64_t)(n - i - 1));
    case LOOP_FIRST:
        return jv_bool(i == 0);
    case LOOP_LAST:
        return jv_bool(i + 1 == n);
    case LOOP_LENGTH:
        return jv_int((int64_t)n);
    case LOOP_DEPTH:
        return jv_int(l->depth0 + 1);
    case LOOP_DEPTH0:
        return jv_int(l->depth0);
    case LOOP_PREVITEM:
        return i > 0 ? l->items->items[i - 1]
                     : undef(r, "there is no previous item", UNDEF_PLAIN, NULL);
    default:
        return i + 1 < n ? l->items->items[i + 1]
                         : undef(r, "there is no next item", UNDEF_PLAIN, NULL);
    }
}

static const jinja_builtin loop_attrs[] = {
    {"depth", loop_attr, LOOP_DEPTH},         {"depth0", loop_attr, LOOP_DEPTH0},
    {"first", loop_attr, LOOP_FIRST},         {"index", loop_attr, LOOP_INDEX},
    {"index0", loop_attr, LOOP_INDEX0},       {"last", loop_attr, LOOP_LAST},
    {"length", loop_attr, LOOP_LENGTH},       {"nextitem", loop_attr, LOOP_NEXTITEM},
    {"previtem", loop_attr, LOOP_PREVITEM},   {"revindex", loop_attr, LOOP_REVINDEX},
    {"revindex0", loop_attr, LOOP_REVINDEX0},
};

/* ==== Attribute and item access (the sandbox's getattr / getitem) ==== */

/* A method of obj's type by name: bound, unsafe (an Undefined that raises), or NULL. */
static bool find_method(render *r, jinja_value obj, const jinja_builtin *table, size_t n,
                        const char *name, jinja_value *out) {
    const jinja_builtin *m = builtin_find(table, n, name);
    if (!m) return false;
    *out = m->fn ? method_value(r, obj, m) : undef(r, name, UNDEF_UNSAFE, jv_type_name(obj));
    return true;
}
#define FIND_METHOD(obj, table, name, out)                                                         \
    find_method(r, obj, table, sizeof table / sizeof *table, name, out)

static jinja_value get_attr(render *r, jinja_value obj, const char *name) {
    jinja_value v;
    switch (obj.kind) {
    case JV_UNDEF:
        undef_fail(r, obj);
    case JV_DICT:
        if (obj.d->ns) {
            if (jv_dict_get_str(obj.d, name, &v)) return v;
            return undef(r, name, UNDEF_ATTR, "Namespace");
        }
        if (FIND_METHOD(obj, dict_methods, name, &v)) return v;
        if (jv_dict_get_str(obj.d, name, &v)) return v;
        break;
    case JV_LIST:
        if (FIND_METHOD(obj, list_methods, name, &v)) return v;
        break;
    case JV_STR:
        if (FIND_METHOD(obj, str_methods, name, &v)) return v;
        break;
    case JV_LOOP: {
        const jinja_builtin *attr = BUILTIN_FIND(loop_attrs, name);
        if (attr) return attr->fn(r, obj, NULL, attr);
        if (FIND_METHOD(obj, loop_methods, name, &v)) return v;
        break;
    }
    default:
        break;
    }
    return undef(r, name, UNDEF_ATTR, jv_type_name(obj));
}

static bool index_of(render *r, jinja_value key, size_t n, size_t *out) {
    if (key.kind != JV_INT && key.kind != JV_BOOL) return false;
    int64_t i = key.kind == JV_BOOL ? key.b : key.i;
    if (i < 0) i += (int64_t)n;
    (void)r;
    if (i < 0 || (uint64_t)i >= n) return false;
    *out = (size_t)i;
    return true;
}

static jinja_value get_item(render *r, jinja_value obj, jinja_value key) {
    switch (obj.kind) {
    case JV_UNDEF:
        undef_fail(r, obj);
    case JV_DICT: {
        jinja_value v;
        if (!obj.d->ns && jv_dict_get(obj.d, key, &v)) return v;
        break;
    }
    case JV_LIST: {
        size_t i;
        if (key.kind != JV_STR) not_subscriptable(r, obj);
        if (index_of(r, key, obj.l->n, &i)) return obj.l->items[i];
        if (key.kind == JV_INT || key.kind == JV_BOOL)
            return undef(r, "list index out of range", UNDEF_PLAIN, NULL);
        break;
    }
    case JV_STR: {
        if (key.kind == JV_INT || key.kind == JV_BOOL) {
            size_t n = jinja_utf8_count(obj.s->data, obj.s->len), i;
            if (!index_of(r, key, n, &i))
                return undef(r, "string index out of range", UNDEF_PLAIN, NULL);
            size_t a = jinja_utf8_offset(obj.s->data, obj.s->len, i);
            size_t b = a;
            jinja_utf8_next(obj.s->data, obj.s->len, &b);
            return str_of(r, obj.s->data + a, b - a);
        }
        break;
    }
    default:
        break;
    }
    if (key.kind == JV_STR) {
        jinja_value v = get_attr(r, obj, key.s->data);
        return v;
    }
    moe_strbuf b = jinja_strbuf(&r->c);
    jv_to_repr(&r->c, &b, key);
    jinja_value u = undef(r, b.s ? b.s : "", UNDEF_ATTR, jv_type_name(obj));
    moe_strbuf_free(&b);
    return u;
}

/* Python slice semantics over n elements: fills the index list */
static jinja_value do_slice(render *r, jinja_value obj, jinja_value start, jinja_value stop,
                            jinja_value step) {
    if (obj.kind == JV_UNDEF) undef_fail(r, obj);
    bool is_str = obj.kind == JV_STR;
    jinja_list *src = NULL;
    size_t n;
    if (is_str)
        n = jinja_utf8_count(obj.s->data, obj.s->len);
    else if (obj.kind == JV_LIST && !obj.l->lazy)
        n = (src = obj.l)->n;
    else
        fail(r, "'%s' object is not subscriptable", jv_type_name(obj));
    int64_t st = step.kind == JV_NONE ? 1 : as_int(r, step, "slice step");
    if (st == 0) fail(r, "slice step cannot be zero");
    int64_t len = (int64_t)n, lo, hi;
    if (start.kind == JV_NONE)
        lo = st < 0 ? len - 1 : 0;
    else {
        lo = as_int(r, start, "slice index");
        if (lo < 0) lo += len;
        if (lo < 0) lo = st < 0 ? -1 : 0;
        if (lo >= len) lo = st < 0 ? len - 1 : len;
    }
    if (stop.kind == JV_NONE)
        hi = st < 0 ? -1 : len;
    else {
        hi = as_int(r, stop, "slice index");
        if (hi < 0) hi += len;
        if (hi < 0) hi = st < 0 ? -1 : 0;
        if (hi >= len) hi = st < 0 ? len - 1 : len;
    }
    if (is_str) {
        /* code point offsets */
        size_t *offs = jinja_alloc(&r->c, (n + 1) * sizeof *offs);
        size_t p = 0;
        for (size_t i = 0; i < n; i++) {
            offs[i] = p;
            jinja_utf8_next(obj.s->data, obj.s->len, &p);
        }
        offs[n] = obj.s->len;
        moe_strbuf b = jinja_strbuf(&r->c);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st)
            moe_strbuf_put(&b, obj.s->data + offs[i], offs[i + 1] - offs[i]);
        if (!b.s) moe_strbuf_puts(&b, "");
        jinja_value out = jv_str_buf(&r->c, &b);
        out.safe = obj.safe;
        return out;
    }
    jinja_value out = jv_list(&r->c, 0);
    out.l->tuple = src->tuple;
    for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st)
        jv_list_push(&r->c, out.l, src->items[i]);
    return out;
}

/* ==== Arithmetic ==== */

static jinja_value num_add(render *r, jinja_value x, jinja_value y) {
    if (x.kind == JV_UNDEF) undef_fail(r, x);
    if (y.kind == JV_UNDEF) undef_fail(r, y);
    if (jv_is_num(x) && jv_is_num(y)) {
        if (x.kind != JV_FLOAT && y.kind != JV_FLOAT) {
            int64_t a = x.kind == JV_BOOL ? x.b : x.i, b = y.kind == JV_BOOL ? y.b : y.i, s;
            if (__builtin_add_overflow(a, b, &s)) fail(r, "integer overflow");
            return jv_int(s);
        }
        return jv_float(jv_as_double(x) + jv_as_double(y));
    }
    if (x.kind == JV_STR && y.kind == JV_STR) {
        if (x.safe != y.safe) { /* Markup + str escapes the plain side */
            if (x.safe)
                y = html_escape(r, y);
            else
                x = html_escape(r, x);
        }
        jinja_str *s = jinja_alloc(&r->c, sizeof *s + x.s->len + y.s->len + 1);
        s->len = x.s->len + y.s->len;
        memcpy(s->data, x.s->data, x.s->len);
        memcpy(s->data + x.s->len, y.s->data, y.s->len);
        s->data[s->len] = '\0';
        return (jinja_value){.kind = JV_STR, .safe = x.safe, .s = s};
    }
    if (x.kind == JV_LIST && y.kind == JV_LIST && x.l->tuple == y.l->tuple && !x.l->lazy &&
        !y.l->lazy) {
        jinja_value out = jv_list(&r->c, x.l->n + y.l->n);
        out.l->tuple = x.l->tuple;
        for (size_t i = 0; i < x.l->n; i++) jv_list_push(&r->c, out.l, x.l->items[i]);
        for (size_t i = 0; i < y.l->n; i++) jv_list_push(&r->c, out.l, y.l->items[i]);
        return out;
    }
    fail(r, "unsupported operand type(s) for +: '%s' and '%s'", jv_type_name(x), jv_type_name(y));
}

static jinja_value repeat(render *r, jinja_value seq, int64_t times) {
    if (times < 0) times = 0;
    if (seq.kind == JV_STR) {
        if (times && seq.s->len > JINJA_MAX_OUTPUT / (uint64_t)times)
            fail(r, "repeated string too long");
        moe_strbuf b = jinja_strbuf(&r->c);
        for (int64_t i = 0; i < times; i++) moe_strbuf_put(&b, seq.s->data, seq.s->len);
        if (!b.s) moe_strbuf_puts(&b, "");
        return jv_str_buf(&r->c, &b);
    }
    not_subscriptable(r, seq);
    if (times && seq.l->n > JINJA_MAX_RANGE / (uint64_t)times) fail(r, "repeated list too long");
    jinja_value out = jv_list(&r->c, 0);
    out.l->tuple = seq.l->tuple;
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.l->n; k++) jv_list_push(&r->c, out.l, seq.l->items[k]);
    return out;
}

static jinja_value binary(render *r, jinja_op op, jinja_value x, jinja_value y) {
    switch (op) {
    case JOP_ADD:
        return num_add(r, x, y);
    case JOP_EQ:
        return jv_bool(jv_equal(x, y));
    case JOP_NE:
        return jv_bool(!jv_equal(x, y));
    case JOP_LT:
    case JOP_LE:
    case JOP_GT:
    case JOP_GE: {
        if (x.kind == JV_UNDEF) undef_fail(r, x);
        if (y.kind == JV_UNDEF) undef_fail(r, y);
        int c = jv_compare(&r->c, x, y);
        return jv_bool(op == JOP_LT   ? c < 0
                       : op == JOP_LE ? c <= 0
                       : op == JOP_GT ? c > 0
                                      : c >= 0);
    }
    case JOP_IN:
    case JOP_NOTIN: {
        bool in = contains(r, x, y);
        return jv_bool(op == JOP_IN ? in : !in);
    }
    default:
        break;
    }
    if (x.kind == JV_UNDEF) undef_fail(r, x);
    if (y.kind == JV_UNDEF) undef_fail(r, y);
    if (op == JOP_MUL) {
        if ((x.kind == JV_STR || x.kind == JV_LIST) && (y.kind == JV_INT || y.kind == JV_BOOL))
            return repeat(r, x, y.kind == JV_BOOL ? y.b : y.i);
        if ((y.kind == JV_STR || y.kind == JV_LIST) && (x.kind == JV_INT || x.kind == JV_BOOL))
            return repeat(r, y, x.kind == JV_BOOL ? x.b : x.i);
    }
    if (op == JOP_MOD && x.kind == JV_STR) {
        jinja_list *vals;
        if (y.kind == JV_LIST && y.l->tuple)
            vals = y.l;
        else {
            vals = jv_list(&r->c, 1).l;
            jv_list_push(&r->c, vals, y);
        }
        return percent_format(r, x, vals);
    }
    if (!jv_is_num(x) || !jv_is_num(y))
        fail(r, "unsupported operand type(s) for arithmetic: '%s' and '%s'", jv_type_name(x),
             jv_type_name(y));
    bool ints = x.kind != JV_FLOAT && y.kind != JV_FLOAT;
    int64_t a = x.kind == JV_BOOL ? x.b : x.i, b = y.kind == JV_BOOL ? y.b : y.i, s;
    double fa = jv_as_double(x), fb = jv_as_double(y);
    switch (op) {
    case JOP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(a, b, &s)) fail(r, "integer overflow");
            return jv_int(s);
        }
        return jv_float(fa - fb);
    case JOP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(a, b, &s)) fail(r, "integer overflow");
            return jv_int(s);
        }
        return jv_float(fa * fb);
    case JOP_DIV:
        if (fb == 0) fail(r, "division by zero");
        return jv_float(fa / fb);
    case JOP_FLOORDIV:
    case JOP_MOD:
        if (ints) {
            if (b == 0) fail(r, "integer division or modulo by zero");
            if (a == INT64_MIN && b == -1) fail(r, "integer overflow");
            int64_t q = a / b, m = a % b;
            if (m != 0 && ((m < 0) != (b < 0))) {
                q--;
                m += b;
            }
            return jv_int(op == JOP_MOD ? m : q);
        }
        if (fb == 0) fail(r, "float division by zero");
        {
            double m = fmod(fa, fb);
            if (m != 0 && ((m < 0) != (fb < 0))) m += fb;
            if (op == JOP_MOD) return jv_float(m);
            return jv_float(floor((fa - m) / fb + 0.5) == (fa - m) / fb ? (fa - m) / fb
                                                                        : floor(fa / fb));
        }
    case JOP_POW:
        if (ints && b >= 0) {
            int64_t acc = 1;
            for (int64_t i = 0; i < b; i++) {
                if (__builtin_mul_overflow(acc, a, &acc)) fail(r, "integer overflow");
                if (acc == 0 || acc == 1) break;
            }
            return jv_int(acc);
        }
        return jv_float(pow(fa, fb));
    default:
        break;
    }
    fail(r, "bad operator");
}

/* ==== Expressions ==== */

static jinja_value eval(render *r, scope *s, const jinja_node *n);

static args eval_args(render *r, scope *s, const jinja_node *n, size_t skip) {
    args a = {.n = n->n_kids > skip ? n->n_kids - skip : 0};
    if (a.n) {
        a.v = jinja_alloc(&r->c, a.n * sizeof *a.v);
        for (size_t i = 0; i < a.n; i++) a.v[i] = eval(r, s, n->kids[i + skip]);
        a.names = n->kwnames ? (const char **)n->kwnames + skip : NULL;
    }
    return a;
}

static bool lookup(render *r, scope *s, const char *name, jinja_value *out) {
    for (; s; s = s->parent)
        if (jv_dict_get_str(s->vars, name, out)) return true;
    if (jv_dict_get_str(r->globals, name, out)) return true;
    return false;
}

static const jinja_func builtin_funcs[];

static jinja_value eval_name(render *r, scope *s, const jinja_node *n) {
    jinja_value v;
    if (lookup(r, s, n->name, &v)) return v;
    for (const jinja_func *f = builtin_funcs; f->name; f++)
        if (!strcmp(f->name, n->name)) return (jinja_value){.kind = JV_FUNC, .fn = f};
    return undef(r, n->name, UNDEF_NAME, NULL);
}

static jinja_value eval_filter(render *r, scope *s, const jinja_node *n, jinja_value input) {
    jinja_value v =
        n->a ? (n->a->kind == JN_FILTER ? eval_filter(r, s, n->a, input) : eval(r, s, n->a))
             : input;
    args a = eval_args(r, s, n, 0);
    at(r, n);
    return apply_filter(r, n->builtin, n->name, v, &a);
}

static jinja_value eval(render *r, scope *s, const jinja_node *n) {
    switch (n->kind) {
    case JN_CONST:
        return n->value;
    case JN_NAME:
        return eval_name(r, s, n);
    case JN_LIST:
    case JN_TUPLE: {
        jinja_value l = jv_list(&r->c, n->n_kids);
        for (size_t i = 0; i < n->n_kids; i++) l.l->items[i] = eval(r, s, n->kids[i]);
        l.l->n = n->n_kids;
        l.l->tuple = n->kind == JN_TUPLE;
        return l;
    }
    case JN_DICT: {
        jinja_value d = jv_dict(&r->c, n->n_kids / 2);
        for (size_t i = 0; i + 1 < n->n_kids; i += 2) {
            jinja_value k = eval(r, s, n->kids[i]);
            if (k.kind == JV_LIST && !k.l->tuple) {
                at(r, n->kids[i]);
                fail(r, "unhashable type: 'list'");
            }
            if (k.kind == JV_DICT || k.kind == JV_UNDEF) {
                at(r, n->kids[i]);
                fail(r, "unhashable type: '%s'", jv_type_name(k));
            }
            jv_dict_set(&r->c, d.d, k, eval(r, s, n->kids[i + 1]));
        }
        return d;
    }
    case JN_ATTR: {
        jinja_value obj = eval(r, s, n->a);
        at(r, n);
        return get_attr(r, obj, n->name);
    }
    case JN_ITEM: {
        jinja_value obj = eval(r, s, n->a);
        jinja_value key = eval(r, s, n->b);
        at(r, n);
        return get_item(r, obj, key);
    }
    case JN_SLICE: {
        jinja_value obj = eval(r, s, n->a);
        jinja_value b = n->b ? eval(r, s, n->b) : jv_none();
        jinja_value c = n->c ? eval(r, s, n->c) : jv_none();
        jinja_value d = n->d ? eval(r, s, n->d) : jv_none();
        at(r, n);
        return do_slice(r, obj, b, c, d);
    }
    case JN_CALL: {
        jinja_value f = eval(r, s, n->a);
        args a = eval_args(r, s, n, 0);
        at(r, n);
        return call_value(r, f, &a);
    }
    case JN_FILTER:
        return eval_filter(r, s, n, jv_undef());
    case JN_TEST: {
        jinja_value v = eval(r, s, n->a);
        args a = eval_args(r, s, n, 0);
        at(r, n);
        bool t = apply_test(r, n->builtin, n->name, v, &a);
        return jv_bool(n->op ? !t : t);
    }
    case JN_UNARY: {
        jinja_value v = eval(r, s, n->a);
        at(r, n);
        if (n->op == JOP_NOT) return jv_bool(!jv_truthy(v));
        if (v.kind == JV_UNDEF) undef_fail(r, v);
        if (v.kind == JV_BOOL) v = jv_int(v.b);
        if (v.kind == JV_INT) {
            if (n->op == JOP_NEG && v.i == INT64_MIN) fail(r, "integer overflow");
            return n->op == JOP_NEG ? jv_int(-v.i) : v;
        }
        if (v.kind == JV_FLOAT) return n->op == JOP_NEG ? jv_float(-v.f) : v;
        fail(r, "bad operand type for unary %s: '%s'", n->op == JOP_NEG ? "-" : "+",
             jv_type_name(v));
    }
    case JN_BINARY: {
        jinja_value x = eval(r, s, n->a);
        jinja_value y = eval(r, s, n->b);
        at(r, n);
        return binary(r, (jinja_op)n->op, x, y);
    }
    case JN_AND: {
        jinja_value x = eval(r, s, n->a);
        return jv_truthy(x) ? eval(r, s, n->b) : x;
    }
    case JN_OR: {
        jinja_value x = eval(r, s, n->a);
        return jv_truthy(x) ? x : eval(r, s, n->b);
    }
    case JN_COND:
        if (jv_truthy(eval(r, s, n->a))) return eval(r, s, n->b);
        if (n->c) return eval(r, s, n->c);
        return undef(
            r,
            "the inline if-expression on line evaluated to false and no else section was defined.",
            UNDEF_PLAIN, NULL);
    case JN_CONCAT: {
        jinja_value x = eval(r, s, n->a);
        jinja_value y = eval(r, s, n->b);
        at(r, n);
        moe_strbuf b = jinja_strbuf(&r->c);
        jv_to_str(&r->c, &b, x);
        jv_to_str(&r->c, &b, y);
        if (!b.s) moe_strbuf_puts(&b, "");
        return jv_str_buf(&r->c, &b);
    }
    default:
        break;
    }
    at(r, n);
    fail(r, "statement used as an expression");
}

/* ==== Statements ==== */

static void exec_body(render *r, scope *s, const jinja_node *n);

static void assign(render *r, scope *s, const jinja_node *target, jinja_value v) {
    if (target->kind == JN_NAME) {
        scope_set(r, s, target->name, v);
        return;
    }
    if (target->kind == JN_ATTR) {
        jinja_value ns;
        at(r, target);
        if (!lookup(r, s, target->a->name, &ns) || ns.kind != JV_DICT || !ns.d->ns)
            fail(r, "cannot assign attribute on non-namespace object");
        jv_dict_set(&r->c, ns.d, cstr(r, target->name), v);
        return;
    }
    /* tuple unpacking */
    jinja_list *l = iter_list(r, v);
    at(r, target);
    if (l->n != target->n_kids)
        fail(r, "%s values to unpack (expected %zu, got %zu)",
             l->n < target->n_kids ? "not enough" : "too many", target->n_kids, l->n);
    for (size_t i = 0; i < l->n; i++) assign(r, s, target->kids[i], l->items[i]);
}

static jinja_value capture(render *r, scope *s, const jinja_node *body) {
    moe_strbuf *saved = r->out, buf = jinja_strbuf(&r->c);
    r->out = &buf;
    exec_body(r, s, body);
    r->out = saved;
    if (!buf.s) moe_strbuf_puts(&buf, "");
    return jv_str_buf(&r->c, &buf);
}

/* A for statement over `it`: depth0 is 0 when the statement runs, one more per loop(...) call. */
static void run_loop(render *r, scope *s, const jinja_node *n, jinja_value it, int64_t depth0) {
    jinja_list *items = iter_list(r, it);
    scope *ls = scope_new(r, s);
    if (n->e) { /* loop filter: decided before the loop, so loop.length counts what is kept */
        jinja_list *src = items;
        items = jv_list(&r->c, 0).l;
        for (size_t i = 0; i < src->n; i++) {
            count_iteration(r);
            assign(r, ls, n->a, src->items[i]);
            if (jv_truthy(eval(r, ls, n->e))) jv_list_push(&r->c, items, src->items[i]);
        }
    }
    jinja_loop *loop = jinja_alloc(&r->c, sizeof *loop);
    *loop = (jinja_loop){.items = items, .depth0 = depth0, .node = n, .outer = s};
    jinja_value loopv = {.kind = JV_LOOP, .loop = loop};
    for (size_t i = 0; i < items->n; i++) {
        count_iteration(r);
        loop->index0 = i;
        assign(r, ls, n->a, items->items[i]);
        scope_set(r, ls, "loop", loopv);
        exec_body(r, ls, n->c);
        if (r->flow == FLOW_BREAK) {
            r->flow = FLOW_NORMAL;
            break;
        }
        r->flow = FLOW_NORMAL;
    }
    if (!items->n && n->d) exec_body(r, scope_new(r, s), n->d);
}

static void exec_node(render *r, scope *s, const jinja_node *n) {
    switch (n->kind) {
    case JN_DATA:
        write_out(r, n->value.s->data, n->value.s->len);
        return;
    case JN_OUTPUT: {
        jinja_value v = eval(r, s, n->a);
        at(r, n);
        if (v.kind == JV_STR) {
            write_out(r, v.s->data, v.s->len);
        } else {
            moe_strbuf b = jinja_strbuf(&r->c);
            jv_to_str(&r->c, &b, v);
            if (b.len) write_out(r, b.s, b.len);
            moe_strbuf_free(&b);
        }
        return;
    }
    case JN_BODY:
        exec_body(r, s, n);
        return;
    case JN_IF:
        for (const jinja_node *x = n; x;) {
            if (x->kind != JN_IF) {
                exec_body(r, s, x);
                return;
            }
            if (jv_truthy(eval(r, s, x->a))) {
                exec_body(r, s, x->b);
                return;
            }
            x = x->c;
        }
        return;
    case JN_FOR: {
        jinja_value it = eval(r, s, n->b);
        at(r, n);
        run_loop(r, s, n, it, 0);
        return;
    }
    case JN_SET:
        assign(r, s, n->a, eval(r, s, n->b));
        return;
    case JN_SET_BLOCK: {
        jinja_value v = capture(r, scope_new(r, s), n->b);
        if (n->c) v = eval_filter(r, s, n->c, v);
        assign(r, s, n->a, v);
        return;
    }
    case JN_MACRO: {
        jinja_macro *m = jinja_alloc(&r->c, sizeof *m);
        *m = (jinja_macro){.def = n->macro, .closure = s, .caller = jv_undef()};
        scope_set(r, s, n->name, (jinja_value){.kind = JV_MACRO, .m = m});
        return;
    }
    case JN_CALL_BLOCK: {
        jinja_macro *caller = jinja_alloc(&r->c, sizeof *caller);
        *caller = (jinja_macro){.def = n->macro, .closure = s, .caller = jv_undef()};
        const jinja_node *call = n->a;
        jinja_value f = eval(r, s, call->a);
        args a = eval_args(r, s, call, 0);
        /* pass caller= as an extra keyword argument */
        args b = {.n = a.n + 1};
        b.v = jinja_alloc(&r->c, b.n * sizeof *b.v);
        b.names = jinja_alloc(&r->c, b.n * sizeof *b.names);
        for (size_t i = 0; i < a.n; i++) {
            b.v[i] = a.v[i];
            b.names[i] = a.names ? a.names[i] : NULL;
        }
        b.v[a.n] = (jinja_value){.kind = JV_MACRO, .m = caller};
        b.names[a.n] = "caller";
        at(r, n);
        jinja_value v = call_value(r, f, &b);
        moe_strbuf t = jinja_strbuf(&r->c);
        jv_to_str(&r->c, &t, v);
        if (t.len) write_out(r, t.s, t.len);
        moe_strbuf_free(&t);
        return;
    }
    case JN_FILTER_BLOCK: {
        jinja_value v = capture(r, scope_new(r, s), n->b);
        if (n->a) v = eval_filter(r, s, n->a, v);
        moe_strbuf t = jinja_strbuf(&r->c);
        jv_to_str(&r->c, &t, v);
        if (t.len) write_out(r, t.s, t.len);
        moe_strbuf_free(&t);
        return;
    }
    case JN_BREAK:
        r->flow = FLOW_BREAK;
        return;
    case JN_CONTINUE:
        r->flow = FLOW_CONTINUE;
        return;
    default:
        at(r, n);
        fail(r, "expression used as a statement");
    }
}

static void exec_body(render *r, scope *s, const jinja_node *n) {
    if (n->kind != JN_BODY) {
        exec_node(r, s, n);
        return;
    }
    for (size_t i = 0; i < n->n_kids && r->flow == FLOW_NORMAL; i++) exec_node(r, s, n->kids[i]);
}

/* ==== Calls ==== */

static jinja_value call_macro(render *r, jinja_macro *m, const args *a) {
    const jinja_macro_def *d = m->def;
    if (r->call_depth >= JINJA_MAX_CALL_DEPTH)
        fail(r, "macro calls nested deeper than %d (runaway recursion?)", JINJA_MAX_CALL_DEPTH);
    scope *ms = scope_new(r, m->closure);
    jinja_value *vals = jinja_alloc(&r->c, (d->n_params + 1) * sizeof *vals);
    for (size_t i = 0; i < d->n_params; i++) vals[i] = (jinja_value){.kind = MISSING};
    jinja_value varargs = jv_list(&r->c, 0), kwargs = jv_dict(&r->c, 0);
    jinja_value caller = m->caller;
    size_t pos = 0;
    for (size_t i = 0; i < a->n; i++) {
        const char *kw = a->names ? a->names[i] : NULL;
        if (!kw) {
            if (pos < d->n_params)
                vals[pos++] = a->v[i];
            else if (d->uses_varargs)
                jv_list_push(&r->c, varargs.l, a->v[i]);
            else
                fail(r, "macro '%s' takes not more than %zu argument(s)", d->name, d->n_params);
            continue;
        }
        size_t k = 0;
        while (k < d->n_params && strcmp(d->params[k], kw)) k++;
        if (k < d->n_params) {
            if (!missing(vals[k]))
                fail(r, "macro '%s' got multiple values for argument '%s'", d->name, kw);
            vals[k] = a->v[i];
        } else if (!strcmp(kw, "caller") && d->uses_caller) {
            caller = a->v[i];
        } else if (d->uses_kwargs) {
            jv_dict_set(&r->c, kwargs.d, cstr(r, kw), a->v[i]);
        } else {
            fail(r, "macro '%s' takes no keyword argument '%s'", d->name, kw);
        }
    }
    r->call_depth++;
    for (size_t i = 0; i < d->n_params; i++) {
        jinja_value v = vals[i];
        if (missing(v))
            v = d->defaults[i] ? eval(r, ms, d->defaults[i])
                               : undef(r, d->params[i], UNDEF_NAME, NULL);
        scope_set(r, ms, d->params[i], v);
    }
    if (d->uses_varargs) scope_set(r, ms, "varargs", varargs);
    if (d->uses_kwargs) scope_set(r, ms, "kwargs", kwargs);
    if (d->uses_caller) scope_set(r, ms, "caller", caller);
    flow saved = r->flow;
    r->flow = FLOW_NORMAL;
    jinja_value out = capture(r, ms, d->body);
    r->flow = saved;
    r->call_depth--;
    return out;
}

/* loop(items) in a recursive for: the body again over items, one level deeper, as a string. */
static jinja_value call_loop(render *r, jinja_loop *l, const args *a) {
    if (!l->node->op)
        fail(r, "The loop must have the 'recursive' marker to be called recursively.");
    if (a->n != 1 || (a->names && a->names[0])) fail(r, "loop() takes exactly one argument");
    if (r->call_depth >= JINJA_MAX_CALL_DEPTH)
        fail(r, "recursive loop nested deeper than %d", JINJA_MAX_CALL_DEPTH);
    moe_strbuf *saved = r->out, buf = jinja_strbuf(&r->c);
    flow saved_flow = r->flow;
    r->out = &buf;
    r->flow = FLOW_NORMAL;
    r->call_depth++;
    run_loop(r, l->outer, l->node, a->v[0], l->depth0 + 1);
    r->call_depth--;
    r->flow = saved_flow;
    r->out = saved;
    return jv_str_buf(&r->c, &buf);
}

static jinja_value call_value(render *r, jinja_value f, const args *a) {
    switch (f.kind) {
    case JV_MACRO:
        return call_macro(r, f.m, a);
    case JV_FUNC:
        return f.fn->fn(r, a);
    case JV_METHOD:
        return f.bm->def->fn(r, f.bm->self, a, f.bm->def);
    case JV_LOOP:
        return call_loop(r, f.loop, a);
    case JV_UNDEF:
        undef_fail(r, f);
    default:
        fail(r, "'%s' object is not callable", jv_type_name(f));
    }
}

/* ==== Globals ==== */

static jinja_value g_range(render *r, const args *a) {
    int64_t v[3] = {0, 0, 1};
    if (a->n < 1 || a->n > 3) fail(r, "range expected 1 to 3 arguments, got %zu", a->n);
    for (size_t i = 0; i < a->n; i++) {
        if (a->names && a->names[i]) fail(r, "range() takes no keyword arguments");
        v[a->n == 1 ? 1 : i] = as_int(r, a->v[i], "range() argument");
    }
    if (v[2] == 0) fail(r, "range() arg 3 must not be zero");
    jinja_value out = jv_list(&r->c, 0);
    for (int64_t x = v[0]; v[2] > 0 ? x < v[1] : x > v[1]; x += v[2]) {
        if (out.l->n >= JINJA_MAX_RANGE) fail(r, "range() too large");
        jv_list_push(&r->c, out.l, jv_int(x));
    }
    return out;
}

static jinja_value g_dict_like(render *r, const args *a, bool ns) {
    jinja_value d = jv_dict(&r->c, a->n);
    d.d->ns = ns;
    for (size_t i = 0; i < a->n; i++) {
        if (a->names && a->names[i]) {
            jv_dict_set(&r->c, d.d, cstr(r, a->names[i]), a->v[i]);
        } else if (a->v[i].kind == JV_DICT && i == 0) {
            for (size_t k = 0; k < a->v[i].d->n; k++)
                jv_dict_set(&r->c, d.d, a->v[i].d->keys[k], a->v[i].d->vals[k]);
        } else {
            fail(r, "%s() positional argument must be a mapping", ns ? "namespace" : "dict");
        }
    }
    return d;
}
static jinja_value g_dict(render *r, const args *a) {
    return g_dict_like(r, a, false);
}
static jinja_value g_namespace(render *r, const args *a) {
    return g_dict_like(r, a, true);
}

static jinja_value g_raise_exception(render *r, const args *a) {
    moe_strbuf b = jinja_strbuf(&r->c);
    if (a->n) jv_to_str(&r->c, &b, a->v[0]);
    char msg[MOE_ERROR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", b.s ? b.s : "");
    moe_strbuf_free(&b);
    fail(r, "raise_exception: %s", msg);
}

static jinja_value g_strftime_now(render *r, const args *a) {
    if (a->n != 1 || a->v[0].kind != JV_STR) fail(r, "strftime_now() takes one format string");
    struct tm tm = {0};
    const char *fixed = r->opts ? r->opts->fixed_now : NULL;
    if (fixed) {
        int y = 0, mo = 0, d = 0, h = 0, mi = 0, se = 0;
        if (sscanf(fixed, "%d-%d-%dT%d:%d:%d", &y, &mo, &d, &h, &mi, &se) < 3)
            fail(r, "fixed date '%s' is not YYYY-MM-DD[THH:MM:SS]", fixed);
        tm.tm_year = y - 1900;
        tm.tm_mon = mo - 1;
        tm.tm_mday = d;
        tm.tm_hour = h;
        tm.tm_min = mi;
        tm.tm_sec = se;
        tm.tm_isdst = -1;
        time_t t = timegm(&tm);
        gmtime_r(&t, &tm); /* fills wday and yday */
    } else {
        time_t t = time(NULL);
        localtime_r(&t, &tm);
    }
    char buf[512];
    size_t n = strftime(buf, sizeof buf, a->v[0].s->data, &tm);
    return str_of(r, buf, n);
}

static const jinja_func builtin_funcs[] = {
    {"range", g_range},
    {"dict", g_dict},
    {"namespace", g_namespace},
    {"raise_exception", g_raise_exception},
    {"strftime_now", g_strftime_now},
    {NULL, NULL},
};

/* ==== Entry ==== */

bool jinja_render(const jinja_template *t, jinja_arena *arena, jinja_jump *jump, jinja_dict *vars,
                  const jinja_render_opts *opts, char **out, size_t *out_len, moe_error *err) {
    render *r = calloc(1, sizeof *r);
    if (!r) moe_die("out of memory");
    r->c = (jinja_ctx){.arena = arena, .jump = jump, .line = 1, .col = 1};
    moe_strbuf *buf = jinja_alloc(&r->c, sizeof *buf);
    *buf = jinja_strbuf(&r->c);
    r->globals = vars;
    r->opts = opts;
    r->out = buf;
    jump->err = err;
    if (setjmp(jump->env)) {
        free(r);
        return false;
    }
    scope *top = scope_new(r, NULL);
    exec_body(r, top, t->root);
    *out = moe_xmalloc(buf->len + 1);
    if (buf->len) memcpy(*out, buf->s, buf->len);
    (*out)[buf->len] = '\0';
    *out_len = buf->len;
    free(r);
    return true;
}
