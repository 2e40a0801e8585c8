/* jinja_value: the interpreter's values -- arena, strings, lists, ordered dicts, Python equality
 * and ordering, str()/repr() and json.dumps() exactly as Python prints them.
 *
 * Owns no evaluation. Everything allocated here comes from the render arena and is freed with it.
 * The trap: Python's float repr is the SHORTEST string that reads back to the same double, and
 * switches to exponent form below 1e-4 and from 1e16 on; printf's %g does neither. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_internal.h"

/* ==== Arena ==== */

struct jinja_chunk {
    jinja_chunk *next;
    size_t size, used;
    max_align_t data[];
};

#define JINJA_CHUNK_BYTES (64u << 10)

void jinja_arena_init(jinja_arena *a, size_t limit) {
    a->head = NULL;
    a->total = 0;
    a->limit = limit;
}

void jinja_arena_free(jinja_arena *a) {
    jinja_chunk *c = a->head;
    while (c) {
        jinja_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
    a->total = 0;
}

void *jinja_arena_alloc(jinja_arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    jinja_chunk *c = a->head;
    if (c && c->size - c->used >= n) {
        void *p = (char *)c->data + c->used;
        c->used += n;
        return p;
    }
    size_t size = n > JINJA_CHUNK_BYTES / 4 ? n : JINJA_CHUNK_BYTES;
    if (size > a->limit || a->total > a->limit - size) return NULL;
    jinja_chunk *fresh = moe_xmalloc(sizeof *fresh + size);
    fresh->size = size;
    fresh->used = n;
    a->total += size;
    if (size == n && c) { /* a big block: keep filling the current chunk */
        fresh->next = c->next;
        c->next = fresh;
    } else {
        fresh->next = c;
        a->head = fresh;
    }
    return fresh->data;
}

/* ==== Errors ==== */

void jinja_fail(jinja_jump *j, uint32_t line, uint32_t col, const char *fmt, ...) {
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_error_set(j->err, MOE_ERR_FORMAT, "template line %u column %u: %s", line, col, msg);
    longjmp(j->env, 1);
}

void jinja_raise(jinja_ctx *c, const char *fmt, ...) {
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jinja_fail(c->jump, c->line, c->col, "%s", msg);
}

void *jinja_alloc(jinja_ctx *c, size_t n) {
    void *p = jinja_arena_alloc(c->arena, n);
    if (!p) jinja_raise(c, "template needs more than %zu MiB of memory", c->arena->limit >> 20);
    return p;
}

/* ==== Strings built in the render arena ==== */

static void *strbuf_alloc(void *ctx, size_t n) {
    return jinja_alloc(ctx, n);
}

moe_strbuf jinja_strbuf(jinja_ctx *c) {
    return (moe_strbuf){.alloc = strbuf_alloc, .alloc_ctx = c};
}

/* ==== Constructors ==== */

jinja_value jv_str(jinja_ctx *c, const char *s, size_t n) {
    if (n > JINJA_MAX_MEMORY) jinja_raise(c, "string too long");
    jinja_str *str = jinja_alloc(c, sizeof *str + n + 1);
    str->len = n;
    if (n) memcpy(str->data, s, n);
    str->data[n] = '\0';
    return (jinja_value){.kind = JV_STR, .s = str};
}
jinja_value jv_cstr(jinja_ctx *c, const char *s) {
    return jv_str(c, s, strlen(s));
}
jinja_value jv_str_buf(jinja_ctx *c, moe_strbuf *b) {
    jinja_value v = jv_str(c, b->s ? b->s : "", b->len);
    moe_strbuf_free(b);
    return v;
}

jinja_value jv_list(jinja_ctx *c, size_t cap) {
    jinja_list *l = jinja_alloc(c, sizeof *l);
    *l = (jinja_list){0};
    if (cap) {
        l->items = jinja_alloc(c, cap * sizeof *l->items);
        l->cap = cap;
    }
    return (jinja_value){.kind = JV_LIST, .l = l};
}

jinja_value jv_dict(jinja_ctx *c, size_t cap) {
    jinja_dict *d = jinja_alloc(c, sizeof *d);
    *d = (jinja_dict){0};
    if (cap) {
        d->keys = jinja_alloc(c, cap * sizeof *d->keys);
        d->vals = jinja_alloc(c, cap * sizeof *d->vals);
        d->cap = cap;
    }
    return (jinja_value){.kind = JV_DICT, .d = d};
}

void jv_list_push(jinja_ctx *c, jinja_list *l, jinja_value v) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        jinja_value *items = jinja_alloc(c, cap * sizeof *items);
        if (l->n) memcpy(items, l->items, l->n * sizeof *items);
        l->items = items;
        l->cap = cap;
    }
    l->items[l->n++] = v;
}

static size_t dict_find(const jinja_dict *d, jinja_value key) {
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->keys[i], key)) return i;
    return SIZE_MAX;
}

void jv_dict_set(jinja_ctx *c, jinja_dict *d, jinja_value key, jinja_value v) {
    size_t i = dict_find(d, key);
    if (i != SIZE_MAX) {
        d->vals[i] = v;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        jinja_value *keys = jinja_alloc(c, cap * sizeof *keys);
        jinja_value *vals = jinja_alloc(c, cap * sizeof *vals);
        if (d->n) {
            memcpy(keys, d->keys, d->n * sizeof *keys);
            memcpy(vals, d->vals, d->n * sizeof *vals);
        }
        d->keys = keys;
        d->vals = vals;
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = v;
}

bool jv_dict_get(const jinja_dict *d, jinja_value key, jinja_value *out) {
    size_t i = dict_find(d, key);
    if (i == SIZE_MAX) return false;
    *out = d->vals[i];
    return true;
}

bool jv_dict_get_str(const jinja_dict *d, const char *key, jinja_value *out) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->n; i++) {
        const jinja_value *k = &d->keys[i];
        if (k->kind == JV_STR && k->s->len == n && memcmp(k->s->data, key, n) == 0) {
            *out = d->vals[i];
            return true;
        }
    }
    return false;
}

/* ==== Truth, equality, ordering ==== */

bool jv_truthy(jinja_value v) {
    switch (v.kind) {
    case JV_UNDEF:
    case JV_NONE:
        return false;
    case JV_BOOL:
        return v.b;
    case JV_INT:
        return v.i != 0;
    case JV_FLOAT:
        return v.f != 0.0;
    case JV_STR:
        return v.s->len != 0;
    case JV_LIST:
        return v.l->lazy == JL_ITER || v.l->n != 0;
    case JV_DICT:
        return v.d->ns || v.d->n != 0;
    default:
        return true;
    }
}

bool jv_is_num(jinja_value v) {
    return v.kind == JV_INT || v.kind == JV_FLOAT || v.kind == JV_BOOL;
}

double jv_as_double(jinja_value v) {
    switch (v.kind) {
    case JV_INT:
        return (double)v.i;
    case JV_FLOAT:
        return v.f;
    case JV_BOOL:
        return v.b;
    default:
        return 0;
    }
}

bool jv_equal(jinja_value a, jinja_value b) {
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a.kind != JV_FLOAT && b.kind != JV_FLOAT) {
            int64_t x = a.kind == JV_BOOL ? a.b : a.i, y = b.kind == JV_BOOL ? b.b : b.i;
            return x == y;
        }
        return jv_as_double(a) == jv_as_double(b);
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
    case JV_UNDEF:
    case JV_NONE:
        return true;
    case JV_STR:
        return a.s->len == b.s->len && memcmp(a.s->data, b.s->data, a.s->len) == 0;
    case JV_LIST:
        if (a.l == b.l) return true;
        if (a.l->lazy || b.l->lazy) return false;
        if (a.l->n != b.l->n || a.l->tuple != b.l->tuple) return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!jv_equal(a.l->items[i], b.l->items[i])) return false;
        return true;
    case JV_DICT:
        if (a.d == b.d) return true;
        if (a.d->n != b.d->n || a.d->ns || b.d->ns) return false;
        for (size_t i = 0; i < a.d->n; i++) {
            jinja_value other;
            if (!jv_dict_get(b.d, a.d->keys[i], &other) || !jv_equal(a.d->vals[i], other))
                return false;
        }
        return true;
    case JV_MACRO:
        return a.m == b.m;
    case JV_FUNC:
        return a.fn == b.fn;
    case JV_LOOP:
        return a.loop == b.loop;
    case JV_METHOD:
        return a.bm == b.bm;
    default:
        return false;
    }
}

const char *jv_type_name(jinja_value v) {
    switch (v.kind) {
    case JV_UNDEF:
        return "Undefined";
    case JV_NONE:
        return "NoneType";
    case JV_BOOL:
        return "bool";
    case JV_INT:
        return "int";
    case JV_FLOAT:
        return "float";
    case JV_STR:
        return "str";
    case JV_LIST:
        return v.l->lazy == JL_ITER   ? "generator"
               : v.l->lazy == JL_VIEW ? v.l->view
               : v.l->tuple           ? "tuple"
                                      : "list";
    case JV_DICT:
        return v.d->ns ? "Namespace" : "dict";
    case JV_MACRO:
        return "Macro";
    case JV_FUNC:
        return "function";
    case JV_METHOD:
        return "builtin_function_or_method";
    case JV_LOOP:
        return "LoopContext";
    default:
        return "object";
    }
}

int jv_compare(jinja_ctx *c, jinja_value a, jinja_value b) {
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a.kind != JV_FLOAT && b.kind != JV_FLOAT) {
            int64_t x = a.kind == JV_BOOL ? a.b : a.i, y = b.kind == JV_BOOL ? b.b : b.i;
            return (x > y) - (x < y);
        }
        double x = jv_as_double(a), y = jv_as_double(b);
        return (x > y) - (x < y);
    }
    if (a.kind == JV_STR && b.kind == JV_STR) {
        size_t n = a.s->len < b.s->len ? a.s->len : b.s->len;
        int r = memcmp(a.s->data, b.s->data, n); /* UTF-8 byte order is code point order */
        if (r) return r < 0 ? -1 : 1;
        return (a.s->len > b.s->len) - (a.s->len < b.s->len);
    }
    if (a.kind == JV_LIST && b.kind == JV_LIST && !a.l->lazy && !b.l->lazy) {
        size_t n = a.l->n < b.l->n ? a.l->n : b.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_equal(a.l->items[i], b.l->items[i])) continue;
            return jv_compare(c, a.l->items[i], b.l->items[i]);
        }
        return (a.l->n > b.l->n) - (a.l->n < b.l->n);
    }
    jinja_raise(c, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a),
                jv_type_name(b));
}

/* ==== UTF-8 ==== */

uint32_t jinja_utf8_next(const char *s, size_t n, size_t *pos) {
    const unsigned char *u = (const unsigned char *)s;
    size_t p = *pos;
    uint32_t c = u[p];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len <= 1 || n - p < len) {
        *pos = p + 1;
        return c;
    }
    uint32_t cp = c & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((u[p + i] & 0xc0) != 0x80) {
            *pos = p + 1;
            return c;
        }
        cp = (cp << 6) | (u[p + i] & 0x3f);
    }
    *pos = p + len;
    return cp;
}

size_t jinja_utf8_count(const char *s, size_t n) {
    size_t count = 0;
    for (size_t p = 0; p < n;) {
        jinja_utf8_next(s, n, &p);
        count++;
    }
    return count;
}

size_t jinja_utf8_offset(const char *s, size_t n, size_t i) {
    size_t p = 0;
    while (i-- > 0 && p < n) jinja_utf8_next(s, n, &p);
    return p;
}

void jinja_utf8_put(moe_strbuf *b, uint32_t cp) {
    char t[4];
    if (cp < 0x80) {
        moe_strbuf_putc(b, (char)cp);
    } else if (cp < 0x800) {
        t[0] = (char)(0xc0 | (cp >> 6));
        t[1] = (char)(0x80 | (cp & 0x3f));
        moe_strbuf_put(b, t, 2);
    } else if (cp < 0x10000) {
        t[0] = (char)(0xe0 | (cp >> 12));
        t[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        t[2] = (char)(0x80 | (cp & 0x3f));
        moe_strbuf_put(b, t, 3);
    } else {
        t[0] = (char)(0xf0 | (cp >> 18));
        t[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        t[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        t[3] = (char)(0x80 | (cp & 0x3f));
        moe_strbuf_put(b, t, 4);
    }
}

bool jinja_py_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* ==== Python float repr ==== */

void jinja_format_float(moe_strbuf *b, double f) {
    if (isnan(f)) {
        moe_strbuf_puts(b, "nan");
        return;
    }
    if (isinf(f)) {
        moe_strbuf_puts(b, f < 0 ? "-inf" : "inf");
        return;
    }
    if (f == 0) {
        moe_strbuf_puts(b, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp is [-]d[.ddd]e[+-]xx: collect the digits and the exponent */
    char digits[20];
    int nd = 0;
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    int decpt = exp10 + 1; /* value = 0.digits * 10^decpt */
    if (neg) moe_strbuf_putc(b, '-');
    if (decpt <= -4 || decpt > 16) {
        moe_strbuf_putc(b, digits[0]);
        if (nd > 1) {
            moe_strbuf_putc(b, '.');
            moe_strbuf_put(b, digits + 1, (size_t)nd - 1);
        }
        moe_strbuf_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    } else if (decpt <= 0) {
        moe_strbuf_puts(b, "0.");
        for (int i = 0; i < -decpt; i++) moe_strbuf_putc(b, '0');
        moe_strbuf_put(b, digits, (size_t)nd);
    } else if (nd <= decpt) {
        moe_strbuf_put(b, digits, (size_t)nd);
        for (int i = nd; i < decpt; i++) moe_strbuf_putc(b, '0');
        moe_strbuf_puts(b, ".0");
    } else {
        moe_strbuf_put(b, digits, (size_t)decpt);
        moe_strbuf_putc(b, '.');
        moe_strbuf_put(b, digits + decpt, (size_t)(nd - decpt));
    }
}

/* ==== str() and repr() ==== */

static bool py_printable(uint32_t cp) {
    if (cp < 0x20 || cp == 0x7f) return false;
    if (cp >= 0x80 && cp <= 0xa0) return false;
    if (cp == 0xad || (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
        (cp >= 0x205f && cp <= 0x206f) || cp == 0x3000 || cp == 0xfeff ||
        (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0xfff9 && cp <= 0xfffb))
        return false;
    return true;
}

static void repr_str(moe_strbuf *b, const char *s, size_t n) {
    bool has_single = memchr(s, '\'', n) != NULL, has_double = memchr(s, '"', n) != NULL;
    char q = has_single && !has_double ? '"' : '\'';
    moe_strbuf_putc(b, q);
    for (size_t p = 0; p < n;) {
        size_t start = p;
        uint32_t cp = jinja_utf8_next(s, n, &p);
        if (cp == (uint32_t)q || cp == '\\') {
            moe_strbuf_putc(b, '\\');
            moe_strbuf_putc(b, (char)cp);
        } else if (cp == '\n') {
            moe_strbuf_puts(b, "\\n");
        } else if (cp == '\r') {
            moe_strbuf_puts(b, "\\r");
        } else if (cp == '\t') {
            moe_strbuf_puts(b, "\\t");
        } else if (!py_printable(cp)) {
            if (cp < 0x100)
                moe_strbuf_printf(b, "\\x%02x", cp);
            else if (cp < 0x10000)
                moe_strbuf_printf(b, "\\u%04x", cp);
            else
                moe_strbuf_printf(b, "\\U%08x", cp);
        } else {
            moe_strbuf_put(b, s + start, p - start);
        }
    }
    moe_strbuf_putc(b, q);
}

static void to_text(jinja_ctx *c, moe_strbuf *b, jinja_value v, bool repr, int depth) {
    if (depth > JINJA_MAX_NEST) jinja_raise(c, "value nested too deeply to print");
    switch (v.kind) {
    case JV_UNDEF:
        if (repr) moe_strbuf_puts(b, "Undefined");
        return;
    case JV_NONE:
        moe_strbuf_puts(b, "None");
        return;
    case JV_BOOL:
        moe_strbuf_puts(b, v.b ? "True" : "False");
        return;
    case JV_INT:
        moe_strbuf_printf(b, "%lld", (long long)v.i);
        return;
    case JV_FLOAT:
        jinja_format_float(b, v.f);
        return;
    case JV_STR:
        if (repr) {
            if (v.safe) moe_strbuf_puts(b, "Markup(");
            repr_str(b, v.s->data, v.s->len);
            if (v.safe) moe_strbuf_puts(b, ")");
        } else {
            moe_strbuf_put(b, v.s->data, v.s->len);
        }
        return;
    case JV_LIST:
        if (v.l->lazy == JL_ITER) {
            moe_strbuf_puts(b, "<generator object>");
            return;
        }
        if (v.l->lazy == JL_VIEW) moe_strbuf_printf(b, "%s(", v.l->view);
        moe_strbuf_putc(b, v.l->tuple ? '(' : '[');
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) moe_strbuf_puts(b, ", ");
            to_text(c, b, v.l->items[i], true, depth + 1);
        }
        if (v.l->tuple && v.l->n == 1) moe_strbuf_putc(b, ',');
        moe_strbuf_putc(b, v.l->tuple ? ')' : ']');
        if (v.l->lazy == JL_VIEW) moe_strbuf_putc(b, ')');
        return;
    case JV_DICT:
        moe_strbuf_puts(b, v.d->ns ? "<Namespace {" : "{");
        for (size_t i = 0; i < v.d->n; i++) {
            if (i) moe_strbuf_puts(b, ", ");
            to_text(c, b, v.d->keys[i], true, depth + 1);
            moe_strbuf_puts(b, ": ");
            to_text(c, b, v.d->vals[i], true, depth + 1);
        }
        moe_strbuf_puts(b, v.d->ns ? "}>" : "}");
        return;
    default:
        moe_strbuf_printf(b, "<%s object>", jv_type_name(v));
        return;
    }
}

void jv_to_str(jinja_ctx *c, moe_strbuf *b, jinja_value v) {
    to_text(c, b, v, false, 0);
}
void jv_to_repr(jinja_ctx *c, moe_strbuf *b, jinja_value v) {
    to_text(c, b, v, true, 0);
}

jinja_value jv_stringify(jinja_ctx *c, jinja_value v) {
    if (v.kind == JV_STR) return v;
    moe_strbuf b = jinja_strbuf(c);
    jv_to_str(c, &b, v);
    return jv_str_buf(c, &b);
}

/* ==== json.dumps ==== */

static void json_str(moe_strbuf *b, const char *s, size_t n, bool ensure_ascii) {
    moe_strbuf_putc(b, '"');
    for (size_t p = 0; p < n;) {
        size_t start = p;
        uint32_t cp = jinja_utf8_next(s, n, &p);
        switch (cp) {
        case '"':
            moe_strbuf_puts(b, "\\\"");
            continue;
        case '\\':
            moe_strbuf_puts(b, "\\\\");
            continue;
        case '\n':
            moe_strbuf_puts(b, "\\n");
            continue;
        case '\r':
            moe_strbuf_puts(b, "\\r");
            continue;
        case '\t':
            moe_strbuf_puts(b, "\\t");
            continue;
        case '\b':
            moe_strbuf_puts(b, "\\b");
            continue;
        case '\f':
            moe_strbuf_puts(b, "\\f");
            continue;
        default:
            break;
        }
        if (cp < 0x20) {
            moe_strbuf_printf(b, "\\u%04x", cp);
        } else if (ensure_ascii && cp >= 0x7f) {
            if (cp >= 0x10000) {
                uint32_t v = cp - 0x10000;
                moe_strbuf_printf(b, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
            } else {
                moe_strbuf_printf(b, "\\u%04x", cp);
            }
        } else {
            moe_strbuf_put(b, s + start, p - start);
        }
    }
    moe_strbuf_putc(b, '"');
}

static void json_float(moe_strbuf *b, double f) {
    if (isnan(f))
        moe_strbuf_puts(b, "NaN");
    else if (isinf(f))
        moe_strbuf_puts(b, f < 0 ? "-Infinity" : "Infinity");
    else
        jinja_format_float(b, f);
}

static void json_newline(moe_strbuf *b, const jinja_json_opts *o, int level) {
    moe_strbuf_putc(b, '\n');
    for (int i = 0; i < level; i++) moe_strbuf_puts(b, o->indent);
}

static void json_key(jinja_ctx *c, moe_strbuf *b, jinja_value k, const jinja_json_opts *o) {
    switch (k.kind) {
    case JV_STR:
        json_str(b, k.s->data, k.s->len, o->ensure_ascii);
        return;
    case JV_INT:
        moe_strbuf_printf(b, "\"%lld\"", (long long)k.i);
        return;
    case JV_FLOAT:
        moe_strbuf_putc(b, '"');
        json_float(b, k.f);
        moe_strbuf_putc(b, '"');
        return;
    case JV_BOOL:
        moe_strbuf_puts(b, k.b ? "\"true\"" : "\"false\"");
        return;
    case JV_NONE:
        moe_strbuf_puts(b, "\"null\"");
        return;
    default:
        jinja_raise(c, "keys must be str, int, float, bool or None, not %s", jv_type_name(k));
    }
}

void jv_to_json(jinja_ctx *c, moe_strbuf *b, jinja_value v, const jinja_json_opts *o, int depth) {
    if (depth > JINJA_MAX_NEST) jinja_raise(c, "value nested too deeply for tojson");
    switch (v.kind) {
    case JV_NONE:
        moe_strbuf_puts(b, "null");
        return;
    case JV_BOOL:
        moe_strbuf_puts(b, v.b ? "true" : "false");
        return;
    case JV_INT:
        moe_strbuf_printf(b, "%lld", (long long)v.i);
        return;
    case JV_FLOAT:
        json_float(b, v.f);
        return;
    case JV_STR:
        json_str(b, v.s->data, v.s->len, o->ensure_ascii);
        return;
    case JV_LIST:
        if (v.l->lazy) break;
        if (v.l->n == 0) {
            moe_strbuf_puts(b, "[]");
            return;
        }
        moe_strbuf_putc(b, '[');
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) moe_strbuf_puts(b, o->item_sep);
            if (o->indent) json_newline(b, o, depth + 1);
            jv_to_json(c, b, v.l->items[i], o, depth + 1);
        }
        if (o->indent) json_newline(b, o, depth);
        moe_strbuf_putc(b, ']');
        return;
    case JV_DICT: {
        if (v.d->ns) break;
        if (v.d->n == 0) {
            moe_strbuf_puts(b, "{}");
            return;
        }
        size_t n = v.d->n;
        size_t *order = jinja_alloc(c, n * sizeof *order);
        for (size_t i = 0; i < n; i++) order[i] = i;
        if (o->sort_keys) { /* insertion sort: stable, and dicts in templates are small */
            for (size_t i = 1; i < n; i++) {
                size_t x = order[i], j = i;
                while (j > 0 && jv_compare(c, v.d->keys[order[j - 1]], v.d->keys[x]) > 0) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = x;
            }
        }
        moe_strbuf_putc(b, '{');
        for (size_t i = 0; i < n; i++) {
            if (i) moe_strbuf_puts(b, o->item_sep);
            if (o->indent) json_newline(b, o, depth + 1);
            json_key(c, b, v.d->keys[order[i]], o);
            moe_strbuf_puts(b, o->key_sep);
            jv_to_json(c, b, v.d->vals[order[i]], o, depth + 1);
        }
        if (o->indent) json_newline(b, o, depth);
        moe_strbuf_putc(b, '}');
        return;
    }
    default:
        break;
    }
    jinja_raise(c, "Object of type %s is not JSON serializable", jv_type_name(v));
}
