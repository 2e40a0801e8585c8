/* json.c: the streaming JSON writer (moe inspect --json now, the server's SSE events later).
 *
 * Owns formatting only: it never parses (jansson does that) and never does I/O -- text goes
 * into a growable buffer the caller sends or prints. The trap: a string from a model file is
 * not guaranteed UTF-8; every invalid byte becomes U+FFFD here, or one bad token would make a
 * whole response unparseable. */
#include "base.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Buffer ==== */

static void reserve(moe_json *j, size_t n) {
    if (j->cap - j->len > n) return;
    size_t cap = j->cap ? j->cap : 256;
    while (cap - j->len <= n) cap *= 2;
    j->buf = moe_xrealloc(j->buf, cap);
    j->cap = cap;
}

static void put(moe_json *j, const char *s, size_t n) {
    reserve(j, n);
    memcpy(j->buf + j->len, s, n);
    j->len += n;
    j->buf[j->len] = '\0';
}

static void putc1(moe_json *j, char c) {
    put(j, &c, 1);
}

void moe_json_init(moe_json *j, bool pretty) {
    memset(j, 0, sizeof *j);
    j->pretty = pretty;
    reserve(j, 1);
    j->buf[0] = '\0';
}

void moe_json_free(moe_json *j) {
    free(j->buf);
    memset(j, 0, sizeof *j);
}

void moe_json_reset(moe_json *j) {
    bool pretty = j->pretty;
    char *buf = j->buf;
    size_t cap = j->cap;
    memset(j, 0, sizeof *j);
    j->buf = buf;
    j->cap = cap;
    j->pretty = pretty;
    if (j->buf) j->buf[0] = '\0';
}

/* ==== Structure ==== */

static void newline(moe_json *j) {
    if (!j->pretty) return;
    putc1(j, '\n');
    for (uint32_t i = 0; i < j->depth; i++) put(j, "  ", 2);
}

/* Before any value or key: the comma and indentation its position needs. */
static void before_item(moe_json *j) {
    if (j->after_key) {
        j->after_key = false;
        return;
    }
    if (j->depth > 0) {
        if (j->has_items[j->depth]) putc1(j, ',');
        newline(j);
    }
    j->has_items[j->depth] = true;
}

static void open_level(moe_json *j, char c) {
    before_item(j);
    putc1(j, c);
    if (j->depth >= MOE_JSON_MAX_DEPTH) moe_die("JSON nested deeper than %d", MOE_JSON_MAX_DEPTH);
    j->depth++;
    j->has_items[j->depth] = false;
}

static void close_level(moe_json *j, char c) {
    if (j->depth == 0) moe_die("JSON close without an open");
    bool had = j->has_items[j->depth];
    j->depth--;
    if (had) newline(j);
    putc1(j, c);
}

void moe_json_object_begin(moe_json *j) {
    open_level(j, '{');
}
void moe_json_object_end(moe_json *j) {
    close_level(j, '}');
}
void moe_json_array_begin(moe_json *j) {
    open_level(j, '[');
}
void moe_json_array_end(moe_json *j) {
    close_level(j, ']');
}

/* ==== Strings ==== */

/* Length of the valid UTF-8 sequence at s (n bytes left), or 0 if it is not valid. */
static size_t utf8_valid(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    size_t len;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        len = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        len = 4, cp = c & 0x07;
    else
        return 0;
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff))) return 0;
    if (cp >= 0xd800 && cp <= 0xdfff) return 0; /* surrogates are not characters */
    return len;
}

static void put_string(moe_json *j, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    putc1(j, '"');
    size_t run = 0; /* bytes copied verbatim in one go */
    for (size_t i = 0; i < n;) {
        unsigned char c = u[i];
        const char *esc = NULL;
        char hex[8];
        size_t len = 1;
        switch (c) {
        case '"':
            esc = "\\\"";
            break;
        case '\\':
            esc = "\\\\";
            break;
        case '\n':
            esc = "\\n";
            break;
        case '\r':
            esc = "\\r";
            break;
        case '\t':
            esc = "\\t";
            break;
        case '\b':
            esc = "\\b";
            break;
        case '\f':
            esc = "\\f";
            break;
        default:
            if (c < 0x20) {
                snprintf(hex, sizeof hex, "\\u%04x", c);
                esc = hex;
            } else if (c >= 0x80) {
                len = utf8_valid(u + i, n - i);
                if (len == 0) {
                    esc = "\xef\xbf\xbd"; /* U+FFFD for one bad byte */
                    len = 1;
                }
            }
        }
        if (esc) {
            put(j, s + i - run, run);
            run = 0;
            put(j, esc, strlen(esc));
        } else {
            run += len;
        }
        i += len;
    }
    put(j, s + n - run, run);
    putc1(j, '"');
}

void moe_json_key(moe_json *j, const char *key) {
    before_item(j);
    put_string(j, key, strlen(key));
    put(j, j->pretty ? ": " : ":", j->pretty ? 2 : 1);
    j->after_key = true;
}

void moe_json_string_n(moe_json *j, const char *s, size_t n) {
    before_item(j);
    put_string(j, s, n);
}

void moe_json_string(moe_json *j, const char *s) {
    moe_json_string_n(j, s, strlen(s));
}

/* ==== Scalars ==== */

static void put_scalar(moe_json *j, const char *text) {
    before_item(j);
    put(j, text, strlen(text));
}

void moe_json_int(moe_json *j, int64_t v) {
    char b[32];
    snprintf(b, sizeof b, "%" PRId64, v);
    put_scalar(j, b);
}

void moe_json_uint(moe_json *j, uint64_t v) {
    char b[32];
    snprintf(b, sizeof b, "%" PRIu64, v);
    put_scalar(j, b);
}

void moe_json_double(moe_json *j, double v) {
    if (!isfinite(v)) {
        put_scalar(j, "null");
        return;
    }
    char b[40];
    snprintf(b, sizeof b, "%.17g", v);
    put_scalar(j, b);
}

void moe_json_bool(moe_json *j, bool v) {
    put_scalar(j, v ? "true" : "false");
}
void moe_json_null(moe_json *j) {
    put_scalar(j, "null");
}

/* ==== Key and value together ==== */

void moe_json_kv_string(moe_json *j, const char *key, const char *s) {
    moe_json_key(j, key);
    moe_json_string(j, s);
}

void moe_json_kv_int(moe_json *j, const char *key, int64_t v) {
    moe_json_key(j, key);
    moe_json_int(j, v);
}

void moe_json_kv_uint(moe_json *j, const char *key, uint64_t v) {
    moe_json_key(j, key);
    moe_json_uint(j, v);
}

void moe_json_kv_double(moe_json *j, const char *key, double v) {
    moe_json_key(j, key);
    moe_json_double(j, v);
}

void moe_json_kv_bool(moe_json *j, const char *key, bool v) {
    moe_json_key(j, key);
    moe_json_bool(j, v);
}
