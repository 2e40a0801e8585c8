/* gguf.c: the GGUF reader -- header, metadata, tensor directory, split models, mmap.
 *
 * Owns parsing and validation of GGUF v2/v3 files and the lifetime of their mappings; it does
 * not interpret metadata (model/ does) nor decode tensor data (quant/ does). Every byte read
 * goes through `cursor`, which checks `n <= size - pos` before reading and keeps the first
 * failure, so a hostile file can cost at most one error message and bounded memory: counts are
 * capped by the format.h limits AND by the bytes left (an element needs at least k bytes), so
 * no allocation exceeds a small multiple of the input size. The trap: strings, keys and tensor
 * names from the file go into error messages escaped (see put_escaped), because an error is one
 * line and a name may hold a newline or a terminal escape. */
#include "format_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
/* Longest file name or tensor name quoted in an error message (the rest is cut with "..."). */
#define ERR_NAME_MAX 96
/* Bytes a tensor directory entry needs at least: name length, n_dims, type, offset. Used to cap
 * the tensor count by the bytes left before anything is allocated. */
#define TENSOR_INFO_MIN_BYTES (8 + 4 + 4 + 8)
/* A key/value pair needs at least: key length, value type, one byte of value. */
#define KV_MIN_BYTES (8 + 4 + 1)

/* ==== Arena: every string and value of one model, freed at once ==== */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    _Alignas(16) uint8_t data[];
} arena_chunk;

typedef struct arena {
    arena_chunk *head;
} arena;

/* Chunk size for small allocations; larger requests get a chunk of their own. */
#define ARENA_CHUNK (1u << 20)

static void *arena_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        arena_chunk *c = moe_xmalloc(sizeof *c + cap);
        c->used = 0;
        c->cap = cap;
        if (a->head && n > ARENA_CHUNK) { /* keep filling the current chunk after a big one */
            c->next = a->head->next;
            a->head->next = c;
        } else {
            c->next = a->head;
            a->head = c;
        }
        c->used = n;
        return c->data;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void arena_free(arena *a) {
    for (arena_chunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
}

/* ==== The model ==== */

typedef struct shard_state {
    void *map; /* mmap of the whole file, or NULL (parsed from a caller's buffer) */
    size_t map_size;
    uint32_t alignment;
    moe_gguf_kv *kv; /* [n_kv], in file order */
    uint64_t n_kv;
    void *anon; /* the data section read into anonymous memory (moe_gguf_to_memory) */
    size_t anon_size;
    dev_t dev; /* the mapped file's identity, checked when it is opened again to be read */
    ino_t ino;
} shard_state;

struct moe_gguf {
    uint32_t n_shards;
    moe_gguf_shard *shards; /* [n_shards] public facts */
    shard_state *state;     /* [n_shards] */
    moe_tensor *tensors;    /* [n_tensors], shard 0 first, file order within a shard */
    uint64_t n_tensors;
    uint64_t *by_name; /* [n_tensors] tensor indices sorted by name, for lookup */
    arena arena;
    const char *progress_label; /* moe_gguf_set_progress: who reports reading the weights */
};

/* ==== Error messages ==== */

/* Copy s (len bytes) into out as printable ASCII: quotes, backslashes and control bytes become
 * escapes, bytes >= 0x80 pass through (UTF-8 names stay readable); cut at ERR_NAME_MAX. */
static const char *put_escaped(char *out, size_t cap, const char *s, uint64_t len) {
    size_t o = 0;
    for (uint64_t i = 0; i < len && o + 8 < cap; i++) {
        if (i >= ERR_NAME_MAX) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        unsigned char ch = (unsigned char)s[i];
        if (ch == '\\' || ch == '\'') {
            out[o++] = '\\';
            out[o++] = (char)ch;
        } else if (ch < 0x20 || ch == 0x7f) {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", ch);
        } else {
            out[o++] = (char)ch;
        }
    }
    out[o] = '\0';
    return out;
}

typedef struct esc_buf {
    char s[ERR_NAME_MAX * 4 + 16];
} esc_buf;
#define ESC(str) put_escaped((esc_buf){{0}}.s, sizeof(esc_buf), (str).ptr, (str).len)

/* ==== Cursor ==== */

typedef struct cursor {
    const uint8_t *buf;
    uint64_t size, pos;
    const char *label; /* file path (or "(buffer)") for messages */
    moe_error *err;
    bool failed;
    arena *arena;
} cursor;

static void fail_at(cursor *c, uint64_t offset, moe_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void fail_at(cursor *c, uint64_t offset, moe_status code, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = true;
    char msg[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    esc_buf lb;
    put_escaped(lb.s, sizeof lb.s, c->label, strlen(c->label));
    moe_error_set(c->err, code, "%s: byte %" PRIu64 ": %s", lb.s, offset, msg);
}

/* True when n more bytes are there; else fails naming what was being read. */
static bool need(cursor *c, uint64_t n, const char *what) {
    if (c->failed) return false;
    if (n > c->size - c->pos) {
        fail_at(c, c->pos, MOE_ERR_FORMAT,
                "expected %s (%" PRIu64 " bytes), found %" PRIu64 " bytes before the end of %s",
                what, n, c->size - c->pos, c->size == 0 ? "an empty file" : "the file");
        return false;
    }
    return true;
}

static uint64_t read_le(cursor *c, unsigned n, const char *what) {
    if (!need(c, n, what)) return 0;
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++) v |= (uint64_t)c->buf[c->pos + i] << (8 * i);
    c->pos += n;
    return v;
}
static uint32_t read_u32(cursor *c, const char *what) {
    return (uint32_t)read_le(c, 4, what);
}
static uint64_t read_u64(cursor *c, const char *what) {
    return read_le(c, 8, what);
}

/* A string: u64 length then bytes; stored NUL-terminated in the arena. */
static moe_str read_str(cursor *c, const char *what) {
    moe_str s = {"", 0};
    uint64_t at = c->pos;
    uint64_t len = read_u64(c, what);
    if (c->failed) return s;
    if (len > MOE_GGUF_MAX_STRING) {
        fail_at(c, at, MOE_ERR_RANGE, "%s has length %" PRIu64 ", more than the limit %u", what,
                len, MOE_GGUF_MAX_STRING);
        return s;
    }
    if (!need(c, len, what)) return s;
    char *p = arena_alloc(c->arena, (size_t)len + 1);
    memcpy(p, c->buf + c->pos, (size_t)len);
    p[len] = '\0';
    c->pos += len;
    s.ptr = p;
    s.len = len;
    return s;
}

/* ==== Metadata values ==== */

static const char *const vtype_names[MOE_GGUF_VTYPE_COUNT] = {
    [MOE_GGUF_U8] = "u8",       [MOE_GGUF_I8] = "i8",     [MOE_GGUF_U16] = "u16",
    [MOE_GGUF_I16] = "i16",     [MOE_GGUF_U32] = "u32",   [MOE_GGUF_I32] = "i32",
    [MOE_GGUF_F32] = "f32",     [MOE_GGUF_BOOL] = "bool", [MOE_GGUF_STRING] = "string",
    [MOE_GGUF_ARRAY] = "array", [MOE_GGUF_U64] = "u64",   [MOE_GGUF_I64] = "i64",
    [MOE_GGUF_F64] = "f64",
};

const char *moe_gguf_vtype_name(moe_gguf_vtype t) {
    return (unsigned)t < MOE_GGUF_VTYPE_COUNT ? vtype_names[t] : "unknown";
}

unsigned moe_gguf_vtype_size(uint32_t t) {
    switch (t) {
    case MOE_GGUF_U8:
    case MOE_GGUF_I8:
    case MOE_GGUF_BOOL:
        return 1;
    case MOE_GGUF_U16:
    case MOE_GGUF_I16:
        return 2;
    case MOE_GGUF_U32:
    case MOE_GGUF_I32:
    case MOE_GGUF_F32:
        return 4;
    case MOE_GGUF_U64:
    case MOE_GGUF_I64:
    case MOE_GGUF_F64:
        return 8;
    default:
        return 0;
    }
}

static int64_t sign_extend(uint64_t v, unsigned bytes) {
    if (bytes == 8) return (int64_t)v;
    unsigned shift = 64 - 8 * bytes;
    return (int64_t)(v << shift) >> shift;
}

static void read_value(cursor *c, uint32_t type, unsigned depth, moe_gguf_value *out,
                       const char *key_esc);

/* An array's body: element type, count, elements. `depth` counts array levels (top = 1). */
static void read_array(cursor *c, unsigned depth, moe_gguf_value *out, const char *key_esc) {
    uint64_t at = c->pos;
    uint32_t elem = read_u32(c, "array element type");
    uint64_t n_at = c->pos;
    uint64_t n = read_u64(c, "array length");
    if (c->failed) return;
    if (elem >= MOE_GGUF_VTYPE_COUNT) {
        fail_at(c, at, MOE_ERR_FORMAT,
                "key '%s': array element type %u is not a GGUF value type (0..%d)", key_esc, elem,
                MOE_GGUF_VTYPE_COUNT - 1);
        return;
    }
    if (elem == MOE_GGUF_ARRAY && depth + 1 > MOE_GGUF_MAX_NEST) {
        fail_at(c, at, MOE_ERR_RANGE, "key '%s': arrays nested deeper than the limit %d", key_esc,
                MOE_GGUF_MAX_NEST);
        return;
    }
    /* the least bytes one element can take: the count can never exceed what is left / that */
    uint64_t min_elem = moe_gguf_vtype_size(elem) ? moe_gguf_vtype_size(elem)
                        : elem == MOE_GGUF_STRING ? 8
                                                  : 4 + 8;
    if (n > MOE_GGUF_MAX_ARRAY || n > (c->size - c->pos) / min_elem) {
        fail_at(c, n_at, MOE_ERR_RANGE, "key '%s': array of %" PRIu64 " %s elements, but %s",
                key_esc, n, moe_gguf_vtype_name((moe_gguf_vtype)elem),
                n > MOE_GGUF_MAX_ARRAY ? "the limit is 67108864 elements"
                                       : "fewer bytes than that are left in the file");
        return;
    }
    out->type = MOE_GGUF_ARRAY;
    out->arr.elem_type = (moe_gguf_vtype)elem;
    out->arr.n = n;
    out->arr.data = NULL;
    if (moe_gguf_vtype_size(elem)) {
        size_t bytes = (size_t)(n * moe_gguf_vtype_size(elem));
        if (!need(c, bytes, "array data")) return;
        void *p = arena_alloc(c->arena, bytes);
        memcpy(p, c->buf + c->pos, bytes);
        c->pos += bytes;
        out->arr.data = p;
    } else if (elem == MOE_GGUF_STRING) {
        moe_str *s = arena_alloc(c->arena, (size_t)n * sizeof *s);
        for (uint64_t i = 0; i < n && !c->failed; i++) s[i] = read_str(c, "array string");
        out->arr.data = s;
    } else {
        moe_gguf_value *v = arena_alloc(c->arena, (size_t)n * sizeof *v);
        memset(v, 0, (size_t)n * sizeof *v);
        for (uint64_t i = 0; i < n && !c->failed; i++)
            read_value(c, MOE_GGUF_ARRAY, depth + 1, &v[i], key_esc);
        out->arr.data = v;
    }
}

static void read_value(cursor *c, uint32_t type, unsigned depth, moe_gguf_value *out,
                       const char *key_esc) {
    out->type = (moe_gguf_vtype)type;
    unsigned nb = moe_gguf_vtype_size(type);
    if (nb) {
        uint64_t raw = read_le(c, nb, "a metadata value");
        switch (type) {
        case MOE_GGUF_I8:
        case MOE_GGUF_I16:
        case MOE_GGUF_I32:
        case MOE_GGUF_I64:
            out->i = sign_extend(raw, nb);
            break;
        case MOE_GGUF_F32: {
            uint32_t u = (uint32_t)raw;
            float f;
            memcpy(&f, &u, 4);
            out->f = f;
            break;
        }
        case MOE_GGUF_F64:
            memcpy(&out->f, &raw, 8);
            break;
        case MOE_GGUF_BOOL:
            out->u = raw != 0;
            break;
        default:
            out->u = raw;
            break;
        }
    } else if (type == MOE_GGUF_STRING) {
        out->s = read_str(c, "a string value");
    } else {
        read_array(c, depth, out, key_esc);
    }
}

/* ==== One shard: header, metadata, tensor directory ==== */

typedef struct shard_parse {
    uint32_t version;
    uint32_t alignment;
    moe_gguf_kv *kv;
    uint64_t n_kv;
    moe_tensor *tensors; /* malloc'd [n_tensors] */
    uint64_t *entry_at;  /* malloc'd [n_tensors]: file offset of each directory entry */
    uint64_t n_tensors;
    uint64_t header_bytes, data_offset, tensor_bytes;
} shard_parse;

static int cmp_tensor_offset(const void *a, const void *b, void *ctx) {
    const moe_tensor *t = ctx;
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    if (t[x].offset != t[y].offset) return t[x].offset < t[y].offset ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int str_cmp(moe_str a, moe_str b) {
    uint64_t n = a.len < b.len ? a.len : b.len;
    int r = memcmp(a.ptr, b.ptr, (size_t)n);
    if (r) return r;
    return a.len < b.len ? -1 : a.len > b.len;
}

static int cmp_kv_key(const void *a, const void *b, void *ctx) {
    const moe_gguf_kv *kv = ctx;
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    int r = str_cmp(kv[x].key, kv[y].key);
    return r ? r : (x < y ? -1 : x > y);
}

static int cmp_tensor_name(const void *a, const void *b, void *ctx) {
    const moe_tensor *t = ctx;
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    int r = str_cmp(t[x].name, t[y].name);
    return r ? r : (x < y ? -1 : x > y);
}

static const moe_gguf_value *kv_find(const moe_gguf_kv *kv, uint64_t n, const char *key) {
    size_t klen = strlen(key);
    for (uint64_t i = 0; i < n; i++)
        if (kv[i].key.len == klen && memcmp(kv[i].key.ptr, key, klen) == 0) return &kv[i].value;
    return NULL;
}

static void parse_kvs(cursor *c, shard_parse *sp) {
    uint64_t at = c->pos;
    uint64_t n = sp->n_kv;
    if (n > MOE_GGUF_MAX_KV || n > (c->size - c->pos) / KV_MIN_BYTES) {
        fail_at(c, at - 8, MOE_ERR_RANGE, "metadata count %" PRIu64 " is more than %s", n,
                n > MOE_GGUF_MAX_KV ? "the limit 1048576" : "the bytes left in the file can hold");
        sp->n_kv = 0;
        return;
    }
    sp->kv = arena_alloc(c->arena, (size_t)(n ? n : 1) * sizeof *sp->kv);
    memset(sp->kv, 0, (size_t)(n ? n : 1) * sizeof *sp->kv);
    for (uint64_t i = 0; i < n && !c->failed; i++) {
        moe_gguf_kv *kv = &sp->kv[i];
        kv->file_offset = c->pos;
        kv->key = read_str(c, "a metadata key");
        esc_buf kb;
        put_escaped(kb.s, sizeof kb.s, kv->key.ptr, kv->key.len);
        uint64_t type_at = c->pos;
        uint32_t type = read_u32(c, "a metadata value type");
        if (c->failed) break;
        if (type >= MOE_GGUF_VTYPE_COUNT) {
            fail_at(c, type_at, MOE_ERR_FORMAT,
                    "key '%s': value type %u is not a GGUF value type (0..%d)", kb.s, type,
                    MOE_GGUF_VTYPE_COUNT - 1);
            break;
        }
        read_value(c, type, 1, &kv->value, kb.s);
    }
    if (c->failed || n < 2) return;
    /* duplicate keys: sort indices by key, compare neighbours; report the later pair */
    uint64_t *idx = moe_xmalloc((size_t)n * sizeof *idx);
    for (uint64_t i = 0; i < n; i++) idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof *idx, cmp_kv_key, sp->kv);
    for (uint64_t i = 1; i < n; i++) {
        const moe_gguf_kv *a = &sp->kv[idx[i - 1]], *b = &sp->kv[idx[i]];
        if (str_cmp(a->key, b->key) == 0) {
            fail_at(c, b->file_offset, MOE_ERR_FORMAT,
                    "duplicate metadata key '%s' (first at byte %" PRIu64 ")", ESC(b->key),
                    a->file_offset);
            break;
        }
    }
    free(idx);
}

static void parse_tensor_info(cursor *c, moe_tensor *t, uint64_t *entry_at) {
    *entry_at = c->pos;
    t->name = read_str(c, "a tensor name");
    uint64_t dims_at = c->pos;
    uint32_t n_dims = read_u32(c, "tensor n_dims");
    if (c->failed) return;
    esc_buf nb;
    put_escaped(nb.s, sizeof nb.s, t->name.ptr, t->name.len);
    if (n_dims > MOE_GGUF_MAX_DIMS) {
        fail_at(c, dims_at, MOE_ERR_FORMAT, "tensor '%s': n_dims is %u, expected at most %d", nb.s,
                n_dims, MOE_GGUF_MAX_DIMS);
        return;
    }
    t->n_dims = n_dims;
    uint64_t n_values = 1;
    for (uint32_t d = 0; d < MOE_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= n_dims) continue;
        uint64_t ne_at = c->pos;
        int64_t ne = (int64_t)read_u64(c, "a tensor dimension");
        if (c->failed) return;
        if (ne <= 0) {
            fail_at(c, ne_at, MOE_ERR_RANGE,
                    "tensor '%s': dimension %u is %" PRId64 ", expected > 0", nb.s, d, ne);
            return;
        }
        if (moe_mul_overflow(n_values, (uint64_t)ne, &n_values) || n_values > INT64_MAX) {
            fail_at(c, ne_at, MOE_ERR_RANGE,
                    "tensor '%s': dimensions multiply past the int64 range at dimension %u", nb.s,
                    d);
            return;
        }
        t->ne[d] = ne;
    }
    t->n_values = n_values;
    uint64_t type_at = c->pos;
    uint32_t type = read_u32(c, "a tensor type");
    t->offset = read_u64(c, "a tensor data offset");
    if (c->failed) return;
    const moe_type_traits *tr = moe_type_traits_get(type);
    if (!tr) {
        fail_at(c, type_at, MOE_ERR_FORMAT, "tensor '%s': type id %u is not a known ggml type",
                nb.s, type);
        return;
    }
    t->type = (moe_type)type;
    if (t->ne[0] % tr->block_values) {
        fail_at(c, dims_at, MOE_ERR_FORMAT,
                "tensor '%s': row length %" PRId64
                " is not a multiple of the %s block size %" PRId64,
                nb.s, t->ne[0], tr->name, tr->block_values);
        return;
    }
    uint64_t row = moe_type_row_bytes(type, t->ne[0]);
    if (row == 0 || moe_mul_overflow(row, n_values / (uint64_t)t->ne[0], &t->n_bytes) ||
        t->n_bytes > INT64_MAX) {
        fail_at(c, dims_at, MOE_ERR_RANGE, "tensor '%s': its byte size overflows 64 bits", nb.s);
        return;
    }
}

/* Checks that need the whole directory: alignment, bounds, overlaps, duplicate names. */
static void check_tensors(cursor *c, shard_parse *sp, bool whole) {
    uint64_t n = sp->n_tensors;
    moe_tensor *t = sp->tensors;
    for (uint64_t i = 0; i < n && !c->failed; i++) {
        uint64_t at = sp->entry_at[i];
        if (t[i].offset % sp->alignment) {
            fail_at(c, at, MOE_ERR_FORMAT,
                    "tensor '%s': data offset %" PRIu64 " is not a multiple of the alignment %u",
                    ESC(t[i].name), t[i].offset, sp->alignment);
            break;
        }
        uint64_t start, end;
        if (moe_add_overflow(sp->data_offset, t[i].offset, &start) ||
            moe_add_overflow(start, t[i].n_bytes, &end)) {
            fail_at(c, at, MOE_ERR_RANGE,
                    "tensor '%s': data offset %" PRIu64 " + %" PRIu64 " bytes overflows 64 bits",
                    ESC(t[i].name), t[i].offset, t[i].n_bytes);
            break;
        }
        t[i].file_offset = start;
        if (whole && end > c->size) {
            fail_at(c, at, MOE_ERR_RANGE,
                    "tensor '%s': data (bytes %" PRIu64 "..%" PRIu64 ") runs past the end of the "
                    "file (%" PRIu64 " bytes)",
                    ESC(t[i].name), start, end, c->size);
            break;
        }
        t[i].data = whole ? c->buf + start : NULL;
        sp->tensor_bytes += t[i].n_bytes; /* cannot overflow: disjoint ranges in < 2^64 */
    }
    if (c->failed || n < 2) return;
    uint64_t *idx = moe_xmalloc((size_t)n * sizeof *idx);
    for (uint64_t i = 0; i < n; i++) idx[i] = i;
    qsort_r(idx, (size_t)n, sizeof *idx, cmp_tensor_offset, t);
    for (uint64_t i = 1; i < n; i++) {
        const moe_tensor *a = &t[idx[i - 1]], *b = &t[idx[i]];
        if (b->offset < a->offset + a->n_bytes) {
            esc_buf an;
            put_escaped(an.s, sizeof an.s, a->name.ptr, a->name.len);
            fail_at(c, sp->entry_at[idx[i]], MOE_ERR_FORMAT,
                    "tensor '%s': data at offset %" PRIu64 " overlaps tensor '%s' (offset %" PRIu64
                    ", %" PRIu64 " bytes)",
                    ESC(b->name), b->offset, an.s, a->offset, a->n_bytes);
            break;
        }
    }
    if (!c->failed) {
        qsort_r(idx, (size_t)n, sizeof *idx, cmp_tensor_name, t);
        for (uint64_t i = 1; i < n; i++) {
            if (str_cmp(t[idx[i - 1]].name, t[idx[i]].name) == 0) {
                uint64_t first = idx[i - 1] < idx[i] ? idx[i - 1] : idx[i];
                uint64_t second = idx[i - 1] < idx[i] ? idx[i] : idx[i - 1];
                fail_at(c, sp->entry_at[second], MOE_ERR_FORMAT,
                        "duplicate tensor name '%s' (first at byte %" PRIu64 ")",
                        ESC(t[second].name), sp->entry_at[first]);
                break;
            }
        }
    }
    free(idx);
}

static void shard_parse_free(shard_parse *sp) {
    free(sp->tensors);
    free(sp->entry_at);
    sp->tensors = NULL;
    sp->entry_at = NULL;
}

/* Parse buf[0..size) as one GGUF shard; strings and values go into `a`. */
static moe_status parse_shard(const uint8_t *buf, uint64_t size, bool whole, const char *label,
                              arena *a, shard_parse *sp, moe_error *err) {
    memset(sp, 0, sizeof *sp);
    cursor c = {.buf = buf, .size = size, .label = label, .err = err, .arena = a};
    if (!need(&c, 4, "the GGUF magic")) return MOE_ERR_FORMAT;
    if (memcmp(buf, GGUF_MAGIC, 4) != 0) {
        char got[24];
        put_escaped(got, sizeof got, (const char *)buf, 4);
        fail_at(&c, 0, MOE_ERR_FORMAT,
                "expected the GGUF magic \"GGUF\", found \"%s\": not a "
                "GGUF file",
                got);
        return MOE_ERR_FORMAT;
    }
    c.pos = 4;
    sp->version = read_u32(&c, "the GGUF version");
    if (c.failed) return MOE_ERR_FORMAT;
    if (sp->version != 2 && sp->version != 3) {
        uint32_t v = sp->version;
        uint32_t swapped = __builtin_bswap32(v);
        fail_at(&c, 4, MOE_ERR_UNSUPPORTED, "GGUF version %u is not supported (expected 2 or 3)%s",
                v, (swapped == 2 || swapped == 3) ? "; this looks like a big-endian file" : "");
        return MOE_ERR_UNSUPPORTED;
    }
    uint64_t nt_at = c.pos;
    sp->n_tensors = read_u64(&c, "the tensor count");
    sp->n_kv = read_u64(&c, "the metadata count");
    if (c.failed) return MOE_ERR_FORMAT;
    if (sp->n_tensors > MOE_GGUF_MAX_TENSORS ||
        sp->n_tensors > (c.size - c.pos) / TENSOR_INFO_MIN_BYTES) {
        fail_at(&c, nt_at, MOE_ERR_RANGE, "tensor count %" PRIu64 " is more than %s", sp->n_tensors,
                sp->n_tensors > MOE_GGUF_MAX_TENSORS ? "the limit 1048576"
                                                     : "the bytes left in the file can hold");
        sp->n_tensors = 0;
        return MOE_ERR_RANGE;
    }
    parse_kvs(&c, sp);
    if (c.failed) return err ? err->code : MOE_ERR_FORMAT;

    sp->alignment = MOE_GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < sp->n_kv; i++) {
        const moe_gguf_kv *kv = &sp->kv[i];
        if (kv->key.len != 17 || memcmp(kv->key.ptr, "general.alignment", 17) != 0) continue;
        if (kv->value.type != MOE_GGUF_U32) {
            fail_at(&c, kv->file_offset, MOE_ERR_FORMAT,
                    "general.alignment has type %s, expected u32",
                    moe_gguf_vtype_name(kv->value.type));
        } else if (kv->value.u == 0 || (kv->value.u & (kv->value.u - 1))) {
            fail_at(&c, kv->file_offset, MOE_ERR_FORMAT,
                    "general.alignment is %" PRIu64 ", expected a power of two", kv->value.u);
        } else {
            sp->alignment = (uint32_t)kv->value.u;
        }
    }
    if (c.failed) return err ? err->code : MOE_ERR_FORMAT;

    uint64_t n = sp->n_tensors;
    sp->tensors = moe_xcalloc((size_t)(n ? n : 1), sizeof *sp->tensors);
    sp->entry_at = moe_xcalloc((size_t)(n ? n : 1), sizeof *sp->entry_at);
    for (uint64_t i = 0; i < n && !c.failed; i++)
        parse_tensor_info(&c, &sp->tensors[i], &sp->entry_at[i]);
    if (c.failed) return err ? err->code : MOE_ERR_FORMAT;
    sp->header_bytes = c.pos;
    uint64_t pad = (sp->alignment - sp->header_bytes % sp->alignment) % sp->alignment;
    if (moe_add_overflow(sp->header_bytes, pad, &sp->data_offset)) {
        fail_at(&c, c.pos, MOE_ERR_RANGE, "data section offset overflows");
        return MOE_ERR_RANGE;
    }
    check_tensors(&c, sp, whole);
    if (c.failed) return err ? err->code : MOE_ERR_FORMAT;
    return MOE_OK;
}

/* ==== Assembling a model from shards ==== */

static moe_gguf *gguf_new(uint32_t n_shards) {
    moe_gguf *g = moe_xcalloc(1, sizeof *g);
    g->n_shards = n_shards;
    g->shards = moe_xcalloc(n_shards, sizeof *g->shards);
    g->state = moe_xcalloc(n_shards, sizeof *g->state);
    return g;
}

void moe_gguf_close(moe_gguf *g) {
    if (!g) return;
    for (uint32_t i = 0; i < g->n_shards; i++) {
        if (g->state[i].map) munmap(g->state[i].map, g->state[i].map_size);
        if (g->state[i].anon) moe_huge_free(g->state[i].anon, g->state[i].anon_size);
        free(g->shards[i].path);
    }
    free(g->shards);
    free(g->state);
    free(g->tensors);
    free(g->by_name);
    arena_free(&g->arena);
    free(g);
}

/* Move a parsed shard into slot i of g. */
static void adopt_shard(moe_gguf *g, uint32_t i, shard_parse *sp, const char *path,
                        uint64_t file_size) {
    moe_gguf_shard *s = &g->shards[i];
    s->path = moe_xstrdup(path);
    s->version = sp->version;
    s->file_size = file_size;
    s->header_bytes = sp->header_bytes;
    s->data_offset = sp->data_offset;
    s->tensor_bytes = sp->tensor_bytes;
    s->padding_bytes = file_size >= sp->header_bytes + sp->tensor_bytes
                           ? file_size - sp->header_bytes - sp->tensor_bytes
                           : 0;
    s->n_tensors = (uint32_t)sp->n_tensors;
    s->n_kv = (uint32_t)sp->n_kv;
    g->state[i].alignment = sp->alignment;
    g->state[i].kv = sp->kv;
    g->state[i].n_kv = sp->n_kv;
    g->tensors =
        moe_xrealloc(g->tensors, (size_t)(g->n_tensors + sp->n_tensors + 1) * sizeof *g->tensors);
    for (uint64_t t = 0; t < sp->n_tensors; t++) {
        sp->tensors[t].shard = i;
        g->tensors[g->n_tensors++] = sp->tensors[t];
    }
    shard_parse_free(sp);
}

/* Sort the name index; across shards a repeated name is an error. */
static moe_status index_names(moe_gguf *g, moe_error *err) {
    uint64_t n = g->n_tensors;
    g->by_name = moe_xmalloc((size_t)(n ? n : 1) * sizeof *g->by_name);
    for (uint64_t i = 0; i < n; i++) g->by_name[i] = i;
    qsort_r(g->by_name, (size_t)n, sizeof *g->by_name, cmp_tensor_name, g->tensors);
    for (uint64_t i = 1; i < n; i++) {
        const moe_tensor *a = &g->tensors[g->by_name[i - 1]], *b = &g->tensors[g->by_name[i]];
        if (str_cmp(a->name, b->name) == 0) {
            esc_buf pa;
            put_escaped(pa.s, sizeof pa.s, g->shards[b->shard].path,
                        strlen(g->shards[b->shard].path));
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: byte %" PRIu64 ": duplicate tensor name '%s' (also in shard "
                                 "%s)",
                                 pa.s, b->file_offset, ESC(b->name), g->shards[a->shard].path);
        }
    }
    return MOE_OK;
}

moe_gguf *moe_gguf_parse_named(const void *buf, size_t size, bool buf_is_whole_file,
                               const char *name, moe_error *err) {
    moe_gguf *g = gguf_new(1);
    shard_parse sp;
    if (parse_shard(buf, size, buf_is_whole_file, name, &g->arena, &sp, err) != MOE_OK) {
        shard_parse_free(&sp);
        moe_gguf_close(g);
        return NULL;
    }
    adopt_shard(g, 0, &sp, name, buf_is_whole_file ? size : 0);
    if (index_names(g, err) != MOE_OK) {
        moe_gguf_close(g);
        return NULL;
    }
    return g;
}

moe_gguf *moe_gguf_join(moe_gguf **parts, const uint64_t *file_sizes, uint32_t n, moe_error *err) {
    MOE_CHECK(n >= 1);
    moe_gguf *m = gguf_new(n);
    moe_status bad = MOE_OK;
    for (uint32_t i = 0; i < n; i++) {
        moe_gguf *p = parts[i];
        parts[i] = NULL;
        MOE_CHECK(p && p->n_shards == 1);
        /* the part's strings and values move with its arena chunks */
        arena_chunk **tail = &m->arena.head;
        while (*tail) tail = &(*tail)->next;
        *tail = p->arena.head;
        p->arena.head = NULL;
        m->state[i] = p->state[0];
        p->state[0].map = NULL;
        moe_gguf_shard *s = &m->shards[i];
        *s = p->shards[0];
        p->shards[0].path = NULL;
        s->file_size = file_sizes[i];
        s->padding_bytes = s->file_size >= s->header_bytes + s->tensor_bytes
                               ? s->file_size - s->header_bytes - s->tensor_bytes
                               : 0;
        m->tensors = moe_xrealloc(m->tensors,
                                  (size_t)(m->n_tensors + p->n_tensors + 1) * sizeof *m->tensors);
        for (uint64_t t = 0; t < p->n_tensors; t++) {
            moe_tensor *dst = &m->tensors[m->n_tensors++];
            *dst = p->tensors[t];
            dst->shard = i;
            if (bad == MOE_OK && (dst->file_offset > s->file_size ||
                                  dst->n_bytes > s->file_size - dst->file_offset)) {
                esc_buf pa;
                put_escaped(pa.s, sizeof pa.s, s->path, strlen(s->path));
                bad = moe_error_set(err, MOE_ERR_RANGE,
                                    "%s: tensor '%s': data (bytes %" PRIu64 "..%" PRIu64
                                    ") runs past the end of the file (%" PRIu64 " bytes)",
                                    pa.s, ESC(dst->name), dst->file_offset,
                                    dst->file_offset + dst->n_bytes, s->file_size);
            }
        }
        moe_gguf_close(p);
    }
    if (bad != MOE_OK || index_names(m, err) != MOE_OK) {
        moe_gguf_close(m);
        return NULL;
    }
    return m;
}

moe_gguf *moe_gguf_parse(const void *buf, size_t size, bool buf_is_whole_file, moe_error *err) {
    return moe_gguf_parse_named(buf, size, buf_is_whole_file, "(buffer)", err);
}

/* Map and parse one file into slot i of g. */
static moe_status open_shard(moe_gguf *g, uint32_t i, const char *path, shard_parse *sp,
                             moe_error *err) {
    memset(sp, 0, sizeof *sp);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return moe_error_set(err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return moe_error_set(err, MOE_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return moe_error_set(err, MOE_ERR_IO, "%s: mmap of %zu bytes failed: %s", path, size,
                                 strerror(e));
        }
    }
    close(fd);
    g->state[i].map = map;
    g->state[i].map_size = size;
    g->state[i].dev = st.st_dev;
    g->state[i].ino = st.st_ino;
    static const uint8_t empty[1];
    moe_status s = parse_shard(map ? map : empty, size, true, path, &g->arena, sp, err);
    if (s != MOE_OK) shard_parse_free(sp);
    return s;
}

/* "<prefix>-NNNNN-of-MMMMM.gguf": fills prefix length, shard number (1-based) and count. */
static bool split_name(const char *path, size_t *prefix_len, unsigned *no, unsigned *count) {
    size_t len = strlen(path);
    const size_t tail = strlen("-00001-of-00001.gguf");
    if (len < tail) return false;
    const char *s = path + len - tail;
    unsigned a, b;
    char rest[8];
    if (s[0] != '-' || sscanf(s, "-%5u-of-%5u%7s", &a, &b, rest) != 3 || strcmp(rest, ".gguf"))
        return false;
    for (int k = 1; k <= 5; k++)
        if (s[k] < '0' || s[k] > '9' || s[k + 9] < '0' || s[k + 9] > '9') return false;
    *prefix_len = len - tail;
    *no = a;
    *count = b;
    return true;
}

/* Where key's pair starts in the shard (0 when absent), for error messages. */
static uint64_t key_at(const shard_parse *sp, const char *key) {
    size_t klen = strlen(key);
    for (uint64_t i = 0; i < sp->n_kv; i++)
        if (sp->kv[i].key.len == klen && memcmp(sp->kv[i].key.ptr, key, klen) == 0)
            return sp->kv[i].file_offset;
    return 0;
}

static bool split_keys(const shard_parse *sp, uint64_t *no, uint64_t *count, uint64_t *total) {
    moe_gguf tmp = {0};
    shard_state st = {.kv = sp->kv, .n_kv = sp->n_kv};
    tmp.n_shards = 1;
    tmp.state = &st;
    bool has_count = moe_gguf_get_u64(&tmp, "split.count", count);
    if (!has_count) return false;
    if (!moe_gguf_get_u64(&tmp, "split.no", no)) *no = UINT64_MAX;
    if (!moe_gguf_get_u64(&tmp, "split.tensors.count", total)) *total = UINT64_MAX;
    return true;
}

moe_gguf *moe_gguf_open(const char *path, moe_error *err) {
    moe_gguf *g = gguf_new(1);
    shard_parse sp;
    if (open_shard(g, 0, path, &sp, err) != MOE_OK) {
        moe_gguf_close(g);
        return NULL;
    }
    uint64_t no, count, total;
    if (!split_keys(&sp, &no, &count, &total) || count <= 1) {
        adopt_shard(g, 0, &sp, path, g->state[0].map_size);
        if (index_names(g, err) != MOE_OK) {
            moe_gguf_close(g);
            return NULL;
        }
        return g;
    }
    /* a split: find the siblings by name, parse each, check they agree */
    size_t prefix_len = 0;
    unsigned name_no = 0, name_count = 0;
    moe_status bad = MOE_OK;
    uint64_t count_at = key_at(&sp, "split.count");
    if (count > MOE_GGUF_MAX_SHARDS) {
        bad = moe_error_set(err, MOE_ERR_RANGE,
                            "%s: byte %" PRIu64 ": split.count is %" PRIu64
                            ", more than the limit %d",
                            path, count_at, count, MOE_GGUF_MAX_SHARDS);
    } else if (!split_name(path, &prefix_len, &name_no, &name_count)) {
        bad = moe_error_set(err, MOE_ERR_FORMAT,
                            "%s: byte %" PRIu64 ": split.count is %" PRIu64
                            " but the file name does not end in -NNNNN-of-MMMMM.gguf, so the "
                            "other shards cannot be found",
                            path, count_at, count);
    } else if (name_count != count || no != name_no - 1u) {
        bad = moe_error_set(err, MOE_ERR_FORMAT,
                            "%s: byte %" PRIu64 ": the name says shard %u "
                            "of %u but the metadata says split.no %" PRIu64 " (0-based) of "
                            "split.count %" PRIu64,
                            path, key_at(&sp, "split.no"), name_no, name_count, no, count);
    } else if (total == UINT64_MAX) {
        bad = moe_error_set(err, MOE_ERR_FORMAT,
                            "%s: byte %" PRIu64 ": split.tensors.count is "
                            "missing or negative (split.count is %" PRIu64 ")",
                            path, count_at, count);
    }
    if (bad != MOE_OK) {
        shard_parse_free(&sp);
        moe_gguf_close(g);
        return NULL;
    }
    /* reopen as an n-shard model; the shard we parsed first is kept in memory */
    moe_gguf *m = gguf_new((uint32_t)count);
    m->arena = g->arena;
    g->arena.head = NULL;
    uint32_t first = (uint32_t)no;
    m->state[first] = g->state[0];
    g->state[0].map = NULL;
    moe_gguf_close(g);
    shard_parse parsed_first = sp;
    char *sib = moe_xmalloc(prefix_len + 32);
    uint64_t sum = 0;
    for (uint32_t i = 0; i < count && bad == MOE_OK; i++) {
        snprintf(sib, prefix_len + 32, "%.*s-%05u-of-%05u.gguf", (int)prefix_len, path, i + 1,
                 (unsigned)count);
        shard_parse cur;
        if (i == first) {
            cur = parsed_first;
        } else {
            bad = open_shard(m, i, sib, &cur, err);
            if (bad != MOE_OK) {
                moe_error_prefix(err, "shard %u of %" PRIu64 " of %s", i + 1, count, path);
                break;
            }
            uint64_t sno, scount, stotal;
            bool has = split_keys(&cur, &sno, &scount, &stotal);
            if (!has || sno != i || scount != count || stotal != total) {
                bad =
                    moe_error_set(err, MOE_ERR_FORMAT,
                                  "%s: byte %" PRIu64 ": expected split.no %u, split.count %" PRIu64
                                  ", split.tensors.count %" PRIu64 " (as in %s), found "
                                  "%s",
                                  sib, has ? key_at(&cur, "split.no") : 0, i, count, total, path,
                                  has ? "" : "no split keys");
                if (has && err && err->code == MOE_ERR_FORMAT) {
                    size_t used = strlen(err->msg);
                    snprintf(err->msg + used, sizeof err->msg - used,
                             "split.no %" PRId64 ", split.count %" PRIu64
                             ", split.tensors.count %" PRId64,
                             sno == UINT64_MAX ? (int64_t)-1 : (int64_t)sno, scount,
                             stotal == UINT64_MAX ? (int64_t)-1 : (int64_t)stotal);
                }
                shard_parse_free(&cur);
                break;
            }
        }
        sum += cur.n_tensors;
        adopt_shard(m, i, &cur, sib, m->state[i].map_size);
    }
    free(sib);
    if (bad != MOE_OK) {
        /* the first-parsed shard may not have been adopted yet */
        if (m->shards[first].path == NULL) shard_parse_free(&parsed_first);
        moe_gguf_close(m);
        return NULL;
    }
    if (sum != total) {
        moe_error_set(err, MOE_ERR_FORMAT,
                      "%s: byte %" PRIu64 ": split.tensors.count is %" PRIu64 " but the %" PRIu64
                      " shards hold %" PRIu64 " tensors",
                      path, key_at(&parsed_first, "split.tensors.count"), total, count, sum);
        moe_gguf_close(m);
        return NULL;
    }
    if (index_names(m, err) != MOE_OK) {
        moe_gguf_close(m);
        return NULL;
    }
    return m;
}

/* ==== Accessors ==== */

uint32_t moe_gguf_alignment(const moe_gguf *g) {
    return g->state[0].alignment;
}
uint32_t moe_gguf_n_shards(const moe_gguf *g) {
    return g->n_shards;
}
const moe_gguf_shard *moe_gguf_shard_get(const moe_gguf *g, uint32_t i) {
    return i < g->n_shards ? &g->shards[i] : NULL;
}
uint32_t moe_gguf_shard_alignment(const moe_gguf *g, uint32_t i) {
    return i < g->n_shards ? g->state[i].alignment : 0;
}

uint64_t moe_gguf_n_kv(const moe_gguf *g) {
    return g->state[0].n_kv;
}
const moe_gguf_kv *moe_gguf_kv_get(const moe_gguf *g, uint64_t i) {
    return i < g->state[0].n_kv ? &g->state[0].kv[i] : NULL;
}
const moe_gguf_value *moe_gguf_find(const moe_gguf *g, const char *key) {
    return kv_find(g->state[0].kv, g->state[0].n_kv, key);
}

static bool value_as_i128(const moe_gguf_value *v, bool *neg, uint64_t *mag) {
    switch (v->type) {
    case MOE_GGUF_U8:
    case MOE_GGUF_U16:
    case MOE_GGUF_U32:
    case MOE_GGUF_U64:
        *neg = false;
        *mag = v->u;
        return true;
    case MOE_GGUF_I8:
    case MOE_GGUF_I16:
    case MOE_GGUF_I32:
    case MOE_GGUF_I64:
        *neg = v->i < 0;
        *mag = v->i < 0 ? (uint64_t)0 - (uint64_t)v->i : (uint64_t)v->i;
        return true;
    default:
        return false;
    }
}

bool moe_gguf_get_u64(const moe_gguf *g, const char *key, uint64_t *out) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    bool neg;
    uint64_t mag;
    if (!v || !value_as_i128(v, &neg, &mag) || neg) return false;
    *out = mag;
    return true;
}

bool moe_gguf_get_i64(const moe_gguf *g, const char *key, int64_t *out) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    bool neg;
    uint64_t mag;
    if (!v || !value_as_i128(v, &neg, &mag)) return false;
    if (!neg && mag > INT64_MAX) return false;
    *out = neg ? v->i : (int64_t)mag;
    return true;
}

bool moe_gguf_get_f64(const moe_gguf *g, const char *key, double *out) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    if (!v) return false;
    bool neg;
    uint64_t mag;
    if (v->type == MOE_GGUF_F32 || v->type == MOE_GGUF_F64) {
        *out = v->f;
    } else if (value_as_i128(v, &neg, &mag)) {
        *out = neg ? (double)v->i : (double)mag;
    } else {
        return false;
    }
    return true;
}

bool moe_gguf_get_bool(const moe_gguf *g, const char *key, bool *out) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    if (!v || v->type != MOE_GGUF_BOOL) return false;
    *out = v->u != 0;
    return true;
}

const char *moe_gguf_get_str(const moe_gguf *g, const char *key) {
    const moe_gguf_value *v = moe_gguf_find(g, key);
    return v && v->type == MOE_GGUF_STRING ? v->s.ptr : NULL;
}

uint64_t moe_gguf_n_tensors(const moe_gguf *g) {
    return g->n_tensors;
}
const moe_tensor *moe_gguf_tensor_get(const moe_gguf *g, uint64_t i) {
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

/* ==== Repacking a tensor in place (the loader's: quant.h, "Weight layouts in memory") ==== */

/* Whether [p, p + n) lies in [base, base + size). */
static bool inside(const uint8_t *p, uint64_t n, const void *base, size_t size) {
    const uint8_t *b = base;
    return base && p >= b && (uint64_t)(p - b) <= size && n <= size - (uint64_t)(p - b);
}

/* Groups of 16 rows of a tensor's matrices to pack, over the pool: item k is group k % per of
 * matrix k / per; each thread packs through its own scratch. */
typedef struct {
    moe_layout layout;
    moe_type type;
    uint8_t *data;
    int64_t n, rows, per;
    uint64_t row_bytes;
    uint8_t *scratch; /* a group's bytes per thread */
} repack_job;

static void repack_groups(void *arg, int64_t begin, int64_t end, int thread) {
    const repack_job *j = arg;
    const uint64_t group_bytes = MOE_ROWS16 * j->row_bytes;
    for (int64_t k = begin; k < end; k++) {
        uint8_t *at = j->data + (uint64_t)(k / j->per) * (uint64_t)j->rows * j->row_bytes +
                      (uint64_t)(k % j->per) * group_bytes;
        moe_layout_pack_matrix(j->layout, j->type, at, MOE_ROWS16, j->n,
                               j->scratch + (size_t)thread * group_bytes);
    }
}

/* Pieces of a mapped tensor's pages copied into fresh memory, over the pool's threads. */
#define COPY_CHUNK ((size_t)4 << 20)

typedef struct copy_job {
    uint8_t *to;
    const uint8_t *from;
    size_t n;
} copy_job;

static void copy_chunks(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const copy_job *j = arg;
    for (int64_t c = begin; c < end; c++) {
        const size_t at = (size_t)c * COPY_CHUNK;
        memcpy(j->to + at, j->from + at, j->n - at < COPY_CHUNK ? j->n - at : COPY_CHUNK);
    }
}

moe_status moe_gguf_tensor_repack(moe_gguf *g, const moe_tensor *t, moe_layout layout,
                                  moe_pool *pool, uint64_t *mapped_bytes, moe_error *err) {
    MOE_CHECK(t >= g->tensors && t < g->tensors + g->n_tensors && t->layout == MOE_LAYOUT_FILE);
    moe_tensor *own = &g->tensors[t - g->tensors];
    const shard_state *st = &g->state[t->shard];
    const char *path = g->shards[t->shard].path;
    const bool in_anon = t->data && inside(t->data, t->n_bytes, st->anon, st->anon_size);
    const bool in_map = t->data && !in_anon && inside(t->data, t->n_bytes, st->map, st->map_size);
    if (!in_anon && !in_map)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: tensor '%s' is neither in memory nor mapped: cannot repack it",
                             path, t->name.ptr);
    if (!moe_layout_has_type(layout, t->type) || t->n_dims < 2)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED, "%s: tensor '%s' (%s) has no layout %d",
                             path, t->name.ptr, moe_type_name(t->type), (int)layout);
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uint8_t *first = (uint8_t *)((uintptr_t)t->data & ~(page - 1));
    const size_t span =
        (size_t)(((uintptr_t)(t->data + t->n_bytes) + page - 1) / page * page - (uintptr_t)first);
    /* Rewritten in place, every page of a mapping would be a copy-on-write fault, one page at a
     * time: 2.2 GiB of Q4_0 took 50 s on this project's (paravirtualized) test machine, against
     * 0.4 s for the same bytes read. So a mapped tensor's pages are copied into fresh anonymous
     * memory (the neighbours' bytes on its first and last pages too), repacked there, and moved
     * over the mapping's range (mremap): the pointers into it stay valid. */
    uint8_t *fresh = NULL;
    if (in_map) {
        fresh = moe_huge_alloc_like(first, span);
        if (!fresh)
            return moe_error_set(err, MOE_ERR_NOMEM,
                                 "%s: tensor '%s': cannot allocate %.1f MiB to repack it: %s", path,
                                 t->name.ptr, (double)span / (1 << 20), strerror(errno));
        copy_job copy = {.to = fresh, .from = first, .n = span};
        moe_pool_for(pool, (int64_t)((span + COPY_CHUNK - 1) / COPY_CHUNK), 1, copy_chunks, &copy);
    } else if (mprotect(first, span, PROT_READ | PROT_WRITE) != 0) {
        return moe_error_set(err, MOE_ERR_IO, "%s: tensor '%s': cannot make it writable: %s", path,
                             t->name.ptr, strerror(errno));
    }
    const uint64_t row_bytes = moe_type_row_bytes(t->type, t->ne[0]);
    repack_job job = {.layout = layout,
                      .type = t->type,
                      .data = fresh ? fresh + (t->data - first) : (uint8_t *)t->data,
                      .n = t->ne[0],
                      .rows = t->ne[1],
                      .per = t->ne[1] / MOE_ROWS16,
                      .row_bytes = row_bytes};
    const int64_t n_matrices = (int64_t)(t->n_values / ((uint64_t)t->ne[0] * (uint64_t)t->ne[1]));
    job.scratch = moe_xmalloc((size_t)moe_pool_n_threads(pool) * MOE_ROWS16 * row_bytes);
    moe_pool_for(pool, n_matrices * job.per, 1, repack_groups, &job);
    free(job.scratch);
    if (fresh && mremap(fresh, span, span, MREMAP_MAYMOVE | MREMAP_FIXED, first) == MAP_FAILED) {
        const int e = errno;
        moe_huge_free(fresh, span);
        return moe_error_set(err, MOE_ERR_IO, "%s: tensor '%s': cannot move its repacked pages: %s",
                             path, t->name.ptr, strerror(e));
    }
    mprotect(first, span, PROT_READ); /* read-only again, as the weights were */
    own->layout = layout;
    if (in_map && mapped_bytes) *mapped_bytes += t->n_bytes;
    return MOE_OK;
}

const moe_tensor *moe_gguf_tensor_find(const moe_gguf *g, const char *name) {
    moe_str key = {name, strlen(name)};
    uint64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int r = str_cmp(g->tensors[g->by_name[mid]].name, key);
        if (r == 0) return &g->tensors[g->by_name[mid]];
        if (r < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

bool moe_gguf_shard_data_is_hole(const moe_gguf *g, uint32_t i) {
    const moe_gguf_shard *sh = moe_gguf_shard_get(g, i);
    const uint64_t block = 4096, from = (sh->data_offset + block - 1) / block * block;
    if (!sh->path || from >= sh->file_size) return false;
    const int fd = open(sh->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool hole = lseek(fd, (off_t)from, SEEK_DATA) < 0 && errno == ENXIO;
    close(fd);
    return hole;
}

/* ==== Tensor data in anonymous memory ==== */

/* Bytes per pread: large enough that system calls cost nothing beside the copy, small enough
 * that a shard splits into several for the pool's threads (and a read error names a place). */
#define LOAD_CHUNK ((uint64_t)64 << 20)

uint8_t *moe_gguf_alloc_data(moe_gguf *g, uint64_t bytes, moe_error *err) {
    MOE_CHECK(g->n_shards == 1 && !g->state[0].map && !g->state[0].anon);
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].offset > bytes || g->tensors[i].n_bytes > bytes - g->tensors[i].offset) {
            moe_error_set(err, MOE_ERR_RANGE, "%s: tensor '%s' lies outside the %llu-byte data",
                          g->shards[0].path, g->tensors[i].name.ptr, (unsigned long long)bytes);
            return NULL;
        }
    size_t size;
    uint8_t *base = moe_huge_alloc((size_t)bytes, &size);
    if (!base) {
        moe_error_set(err, MOE_ERR_NOMEM, "%s: cannot allocate %.1f MiB for the tensors",
                      g->shards[0].path, (double)bytes / (1 << 20));
        return NULL;
    }
    g->state[0].anon = base;
    g->state[0].anon_size = size;
    for (uint64_t i = 0; i < g->n_tensors; i++) g->tensors[i].data = base + g->tensors[i].offset;
    return base;
}

/* Where a chunk's reading stopped, if it did. */
typedef struct load_failure {
    int error;   /* of the failed pread; 0 when the file ended first */
    uint64_t at; /* file offset of the first byte not read; UINT64_MAX: the chunk was read whole */
} load_failure;

/* Byte ranges of a shard's data section to read (offsets from its start), at most LOAD_CHUNK
 * each: one item of the pool per range. */
typedef struct load_range {
    uint64_t at, size;
} load_range;

/* One shard's data section (or the ranges of it wanted) read into `dst`. */
typedef struct load_job {
    int fd;
    uint8_t *dst;         /* [size] the anonymous copy */
    uint64_t file_offset; /* where the data section starts in the file */
    const load_range *ranges;
    load_failure *failure;  /* [n_ranges] */
    _Atomic uint64_t *done; /* bytes read so far, for the progress reporter (may be NULL) */
} load_job;

static void load_chunks(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    load_job *j = arg;
    for (int64_t c = begin; c < end; c++) {
        uint64_t at = j->ranges[c].at;
        const uint64_t stop = at + j->ranges[c].size;
        j->failure[c].at = UINT64_MAX;
        while (at < stop) {
            const ssize_t n =
                pread(j->fd, j->dst + at, (size_t)(stop - at), (off_t)(j->file_offset + at));
            if (n > 0) {
                at += (uint64_t)n; /* a short read: ask again for the rest */
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else {
                j->failure[c].error = n < 0 ? errno : 0;
                j->failure[c].at = j->file_offset + at;
                break;
            }
        }
        if (j->done) atomic_fetch_add_explicit(j->done, j->ranges[c].size, memory_order_relaxed);
    }
}

static int cmp_range(const void *a, const void *b) {
    const load_range *x = a, *y = b;
    return x->at < y->at ? -1 : x->at > y->at;
}

/* The ranges of shard i to read: all of [0, size), or the tensors skip refuses, merged where
 * they touch (padding between them included), in LOAD_CHUNK pieces. *n set; the caller frees. */
static load_range *shard_ranges(const moe_gguf *g, uint32_t i, uint64_t size,
                                bool (*skip)(const moe_tensor *t, void *ctx), void *skip_ctx,
                                uint64_t *n) {
    load_range *want = moe_xcalloc(skip ? g->n_tensors + 1 : 1, sizeof *want);
    uint64_t n_want = 0;
    if (!skip) {
        want[n_want++] = (load_range){0, size};
    } else {
        for (uint64_t t = 0; t < g->n_tensors; t++)
            if (g->tensors[t].shard == i && !skip(&g->tensors[t], skip_ctx) &&
                g->tensors[t].n_bytes)
                want[n_want++] = (load_range){g->tensors[t].offset, g->tensors[t].n_bytes};
        qsort(want, (size_t)n_want, sizeof *want, cmp_range);
        uint64_t m = 0; /* merge what touches or nearly touches (alignment padding) */
        for (uint64_t k = 0; k < n_want; k++) {
            if (m && want[k].at <= want[m - 1].at + want[m - 1].size + g->state[i].alignment) {
                const uint64_t end = want[k].at + want[k].size;
                if (end > want[m - 1].at + want[m - 1].size)
                    want[m - 1].size = end - want[m - 1].at;
            } else {
                want[m++] = want[k];
            }
        }
        n_want = m;
    }
    uint64_t count = 0;
    for (uint64_t k = 0; k < n_want; k++) count += (want[k].size + LOAD_CHUNK - 1) / LOAD_CHUNK;
    load_range *out = moe_xcalloc(count + 1, sizeof *out);
    *n = 0;
    for (uint64_t k = 0; k < n_want; k++)
        for (uint64_t at = 0; at < want[k].size; at += LOAD_CHUNK)
            out[(*n)++] = (load_range){
                want[k].at + at, want[k].size - at < LOAD_CHUNK ? want[k].size - at : LOAD_CHUNK};
    free(want);
    return out;
}

/* Read shard i's data section [data_offset, file size) from its file into dst. The file is
 * opened again by path, so it must still be the file that was mapped (same device, inode and
 * size): a model replaced on disk since it was opened is refused, not mixed. */
static moe_status load_shard(const moe_gguf *g, uint32_t i, moe_pool *pool, uint8_t *dst,
                             bool (*skip)(const moe_tensor *t, void *ctx), void *skip_ctx,
                             _Atomic uint64_t *done, uint64_t *read, moe_error *err) {
    const shard_state *st = &g->state[i];
    const moe_gguf_shard *sh = &g->shards[i];
    int fd = open(sh->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot open again to read the weights: %s",
                             sh->path, strerror(errno));
    struct stat now;
    moe_status s = MOE_OK;
    if (fstat(fd, &now) != 0) {
        s = moe_error_set(err, MOE_ERR_IO, "%s: %s", sh->path, strerror(errno));
    } else if (now.st_dev != st->dev || now.st_ino != st->ino ||
               (uint64_t)now.st_size != sh->file_size) {
        s = moe_error_set(err, MOE_ERR_IO,
                          "%s: the file changed since it was opened (replaced, or %" PRIu64
                          " bytes instead of %" PRIu64 "); open the model again",
                          sh->path, (uint64_t)now.st_size, sh->file_size);
    }
    if (s != MOE_OK) {
        close(fd);
        return s;
    }
    const uint64_t size = sh->file_size - sh->data_offset;
    uint64_t n_chunks;
    load_range *ranges = shard_ranges(g, i, size, skip, skip_ctx, &n_chunks);
    load_job j = {
        .fd = fd, .dst = dst, .file_offset = sh->data_offset, .ranges = ranges, .done = done};
    j.failure = moe_xcalloc((size_t)n_chunks + 1, sizeof *j.failure);
    /* a wider readahead window: 1.76 GB read cold in 1.0 s instead of 1.7 s (2 threads) */
    posix_fadvise(fd, (off_t)j.file_offset, (off_t)size, POSIX_FADV_SEQUENTIAL);
    moe_pool_for(pool, (int64_t)n_chunks, 1, load_chunks, &j);
    *read = 0;
    for (uint64_t c = 0; c < n_chunks; c++) *read += ranges[c].size;
    free(ranges);
    close(fd);
    for (uint64_t c = 0; c < n_chunks && s == MOE_OK; c++) {
        if (j.failure[c].at == UINT64_MAX) continue;
        if (j.failure[c].error)
            s = moe_error_set(err, MOE_ERR_IO,
                              "%s: reading the weights failed at byte %" PRIu64 ": %s", sh->path,
                              j.failure[c].at, strerror(j.failure[c].error));
        else
            s = moe_error_set(err, MOE_ERR_IO,
                              "%s: the file ends at byte %" PRIu64 ", before its %" PRIu64
                              " bytes (truncated while loading?)",
                              sh->path, j.failure[c].at, sh->file_size);
    }
    free(j.failure);
    return s;
}

/* ==== Progress while reading the weights ==== */

#define PROGRESS_AFTER_S 1.0 /* a load quicker than this prints nothing */
#define PROGRESS_POLL_NS 100000000L

typedef struct progress {
    const char *label;
    uint64_t total;        /* bytes to read */
    _Atomic uint64_t done; /* bytes read (load_chunks adds) */
    _Atomic bool finished; /* the reader is done: the reporter prints its last line */
    double t0, after;      /* start (seconds); report only past t0 + after */
    bool shown, tty;
    int last_tenth; /* plain lines (not a terminal): one per tenth */
} progress;

static double progress_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void progress_line(progress *p, bool last) {
    const uint64_t done = atomic_load(&p->done);
    const double pct = p->total ? 100.0 * (double)done / (double)p->total : 100.0;
    const double mib = 1048576.0, dt = progress_now() - p->t0;
    if (last) {
        fprintf(stderr, "%s%s: weights read: %.1f MiB in %.2f s (%.0f MB/s)\n", p->tty ? "\r" : "",
                p->label, (double)done / mib, dt, dt > 0 ? (double)done / dt / 1e6 : 0.0);
        return;
    }
    const int tenth = (int)(pct / 10);
    if (!p->tty && tenth == p->last_tenth) return;
    p->last_tenth = tenth;
    fprintf(stderr, "%s%s: reading weights: %.1f of %.1f MiB (%.0f%%)%s", p->tty ? "\r" : "",
            p->label, (double)done / mib, (double)p->total / mib, pct, p->tty ? "" : "\n");
    fflush(stderr);
}

static void *progress_reporter(void *arg) {
    progress *p = arg;
    while (!atomic_load(&p->finished)) {
        struct timespec d = {0, PROGRESS_POLL_NS};
        nanosleep(&d, NULL);
        if (atomic_load(&p->finished) || progress_now() - p->t0 < p->after) continue;
        p->shown = true;
        progress_line(p, false);
    }
    if (p->shown) progress_line(p, true);
    return NULL;
}

void moe_gguf_set_progress(moe_gguf *g, const char *label) {
    g->progress_label = label;
}

moe_status moe_gguf_to_memory(moe_gguf *g, moe_pool *pool, uint64_t *bytes_read, moe_error *err) {
    return moe_gguf_to_memory_except(g, pool, NULL, NULL, bytes_read, err);
}

moe_status moe_gguf_to_memory_except(moe_gguf *g, moe_pool *pool,
                                     bool (*skip)(const moe_tensor *t, void *ctx), void *skip_ctx,
                                     uint64_t *bytes_read, moe_error *err) {
    uint64_t total = 0;
    if (bytes_read) *bytes_read = 0;
    /* with a label: a reporter thread prints progress once the read takes over a second
     * (MOE_PROGRESS_AFTER overrides the second, for tests) */
    progress prog = {.label = g->progress_label,
                     .t0 = progress_now(),
                     .after = PROGRESS_AFTER_S,
                     .tty = isatty(2),
                     .last_tenth = -1};
    const char *after = getenv("MOE_PROGRESS_AFTER");
    if (after) prog.after = atof(after);
    prog.shown = prog.after <= 0; /* 0: the last line even for a read quicker than a poll */
    pthread_t reporter;
    bool reporting = false;
    if (g->progress_label) {
        for (uint32_t i = 0; i < g->n_shards; i++) {
            const moe_gguf_shard *sh = &g->shards[i];
            if (!g->state[i].map || g->state[i].anon || sh->data_offset >= sh->file_size) continue;
            uint64_t n;
            load_range *r = shard_ranges(g, i, sh->file_size - sh->data_offset, skip, skip_ctx, &n);
            for (uint64_t c = 0; c < n; c++) prog.total += r[c].size;
            free(r);
        }
        reporting = pthread_create(&reporter, NULL, progress_reporter, &prog) == 0;
    }
    moe_status result = MOE_OK;
    for (uint32_t i = 0; i < g->n_shards && result == MOE_OK; i++) {
        shard_state *st = &g->state[i];
        const moe_gguf_shard *sh = &g->shards[i];
        if (!st->map || st->anon || sh->data_offset >= sh->file_size) continue;
        const size_t data = (size_t)(sh->file_size - sh->data_offset);
        size_t size;
        uint8_t *base = moe_huge_alloc(data, &size);
        if (!base) {
            result = moe_error_set(err, MOE_ERR_NOMEM,
                                   "%s: cannot allocate %.1f MiB of anonymous "
                                   "memory for the weights (--mmap keeps them mapped): %s",
                                   sh->path, (double)data / (1 << 20), strerror(errno));
            break;
        }
        uint64_t read = 0;
        result =
            load_shard(g, i, pool, base, skip, skip_ctx, reporting ? &prog.done : NULL, &read, err);
        if (result != MOE_OK) {
            moe_huge_free(base, size); /* the tensors still point into the mapping */
            break;
        }
        mprotect(base, size, PROT_READ);            /* weights are read-only, as they were mapped */
        for (uint64_t t = 0; t < g->n_tensors; t++) /* a skipped tensor has no data now */
            if (g->tensors[t].shard == i && g->tensors[t].data)
                g->tensors[t].data =
                    skip && skip(&g->tensors[t], skip_ctx) ? NULL : base + g->tensors[t].offset;
        /* Unmap the data section's whole pages (the header's keep the metadata's strings), so
         * a pointer kept from before faults instead of quietly reading the file again. */
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        const size_t keep = ((size_t)sh->data_offset + page - 1) / page * page;
        if (keep < st->map_size) {
            munmap((uint8_t *)st->map + keep, st->map_size - keep);
            st->map_size = keep;
        }
        st->anon = base;
        st->anon_size = size;
        total += read;
    }
    if (reporting) {
        atomic_store(&prog.finished, true);
        pthread_join(reporter, NULL);
    }
    if (bytes_read) *bytes_read = total;
    return result;
}
