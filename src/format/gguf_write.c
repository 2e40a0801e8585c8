/* gguf_write.c: the GGUF v3 writer -- metadata, tensors, alignment padding, split output.
 *
 * Owns building a file from keys and tensors held in memory, or produced one at a time while the
 * file is written (deferred tensors: a converter holds one tensor, not the model); it does not
 * quantize (quant/ does)
 * and never reads back what it wrote (tests do that with the reader); it names general.file_type
 * (llama.cpp's ftype numbers) from the tensors it holds when asked. Layout is llama.cpp's:
 * header, key/value pairs, tensor directory, zero padding to the alignment, then each tensor's
 * bytes followed by zero padding to the alignment (a file without tensors ends at its
 * directory, as llama.cpp's vocab files do). Splits follow llama.cpp's gguf-split: shard
 * i of N is "<base>-%05d-of-%05d.gguf"; every shard starts with split.no (u16, 0-based),
 * split.count (u16) and split.tensors.count (i32), and only the first carries the model's keys.
 * The trap: general.alignment is metadata AND layout -- the writer pads to the value of that key
 * (when it is a valid u32 power of two), so copying a model's keys keeps its layout readable. */
#include "format_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ==== The writer's state ==== */

typedef struct writer_kv {
    char *key;
    moe_gguf_value value; /* deep copy, owned (malloc) */
} writer_kv;

typedef struct writer_tensor {
    char *name;
    moe_type type;
    uint32_t n_dims;
    int64_t ne[MOE_GGUF_MAX_DIMS];
    uint64_t n_bytes;
    const void *data; /* owned unless borrowed; NULL for a deferred tensor */
    bool borrowed;
    moe_gguf_tensor_fill_fn fill; /* deferred: produces the bytes while the file is written */
    void *fill_ctx;
} writer_tensor;

typedef struct out_file {
    FILE *f;
    const char *path;
    uint64_t pos;
    bool failed;
    moe_error *fill_err; /* where a deferred tensor's producer reports (NULL: none allowed) */
    bool fill_failed;
} out_file;

struct moe_gguf_writer {
    writer_kv *kv;
    size_t n_kv, cap_kv;
    writer_tensor *tensors;
    size_t n_tensors, cap_tensors;
    out_file stream;    /* moe_gguf_writer_stream_*: the file being written */
    char *stream_path;  /* owned */
    size_t stream_next; /* the tensor whose bytes come next */
};

/* Keys the writer itself sets on every shard of a split (llama.cpp's names). */
#define KEY_SPLIT_NO      "split.no"
#define KEY_SPLIT_COUNT   "split.count"
#define KEY_SPLIT_TENSORS "split.tensors.count"
#define KEY_ALIGNMENT     "general.alignment"
#define KEY_FILE_TYPE     "general.file_type"

/* ==== Deep copies of values ==== */

static moe_str str_copy(const char *p, uint64_t len) {
    return (moe_str){moe_xstrndup(p ? p : "", (size_t)len), len};
}

static void value_copy(moe_gguf_value *dst, const moe_gguf_value *src) {
    *dst = *src;
    if (src->type == MOE_GGUF_STRING) {
        dst->s = str_copy(src->s.ptr, src->s.len);
    } else if (src->type == MOE_GGUF_ARRAY) {
        uint64_t n = src->arr.n;
        moe_gguf_vtype et = src->arr.elem_type;
        if (moe_gguf_vtype_size(et)) {
            size_t bytes = (size_t)n * moe_gguf_vtype_size(et);
            void *p = moe_xmalloc(bytes);
            if (bytes) memcpy(p, src->arr.data, bytes);
            dst->arr.data = p;
        } else if (et == MOE_GGUF_STRING) {
            const moe_str *s = src->arr.data;
            moe_str *d = moe_xmalloc((size_t)n * sizeof *d);
            for (uint64_t i = 0; i < n; i++) d[i] = str_copy(s[i].ptr, s[i].len);
            dst->arr.data = d;
        } else if (et == MOE_GGUF_ARRAY) {
            const moe_gguf_value *s = src->arr.data;
            moe_gguf_value *d = moe_xmalloc((size_t)n * sizeof *d);
            for (uint64_t i = 0; i < n; i++) value_copy(&d[i], &s[i]);
            dst->arr.data = d;
        } else {
            moe_die("array element type %d is not a GGUF value type", (int)et);
        }
    } else if (!moe_gguf_vtype_size(src->type)) {
        moe_die("value type %d is not a GGUF value type", (int)src->type);
    }
}

static void value_free(moe_gguf_value *v) {
    if (v->type == MOE_GGUF_STRING) {
        free((void *)v->s.ptr);
    } else if (v->type == MOE_GGUF_ARRAY) {
        if (v->arr.elem_type == MOE_GGUF_STRING) {
            moe_str *s = (moe_str *)v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) free((void *)s[i].ptr);
        } else if (v->arr.elem_type == MOE_GGUF_ARRAY) {
            moe_gguf_value *a = (moe_gguf_value *)v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) value_free(&a[i]);
        }
        free((void *)v->arr.data);
    }
}

/* ==== Building ==== */

moe_gguf_writer *moe_gguf_writer_new(void) {
    return moe_xcalloc(1, sizeof(moe_gguf_writer));
}

void moe_gguf_writer_free(moe_gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        value_free(&w->kv[i].value);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        if (!w->tensors[i].borrowed) free((void *)w->tensors[i].data);
    }
    free(w->kv);
    free(w->tensors);
    if (w->stream.f) fclose(w->stream.f);
    free(w->stream_path);
    free(w);
}

void moe_gguf_writer_set_value(moe_gguf_writer *w, const char *key, const moe_gguf_value *v) {
    moe_gguf_value copy;
    value_copy(&copy, v);
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, key) == 0) {
            value_free(&w->kv[i].value);
            w->kv[i].value = copy;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        w->cap_kv = w->cap_kv ? 2 * w->cap_kv : 16;
        w->kv = moe_xrealloc(w->kv, w->cap_kv * sizeof *w->kv);
    }
    w->kv[w->n_kv].key = moe_xstrdup(key);
    w->kv[w->n_kv].value = copy;
    w->n_kv++;
}

void moe_gguf_writer_set_u32(moe_gguf_writer *w, const char *key, uint32_t v) {
    moe_gguf_writer_set_value(w, key, &(moe_gguf_value){.type = MOE_GGUF_U32, .u = v});
}
void moe_gguf_writer_set_i32(moe_gguf_writer *w, const char *key, int32_t v) {
    moe_gguf_writer_set_value(w, key, &(moe_gguf_value){.type = MOE_GGUF_I32, .i = v});
}
void moe_gguf_writer_set_u64(moe_gguf_writer *w, const char *key, uint64_t v) {
    moe_gguf_writer_set_value(w, key, &(moe_gguf_value){.type = MOE_GGUF_U64, .u = v});
}
void moe_gguf_writer_set_f32(moe_gguf_writer *w, const char *key, float v) {
    moe_gguf_writer_set_value(w, key, &(moe_gguf_value){.type = MOE_GGUF_F32, .f = v});
}
void moe_gguf_writer_set_bool(moe_gguf_writer *w, const char *key, bool v) {
    moe_gguf_writer_set_value(w, key, &(moe_gguf_value){.type = MOE_GGUF_BOOL, .u = v});
}
void moe_gguf_writer_set_str(moe_gguf_writer *w, const char *key, const char *v) {
    moe_gguf_value val = {.type = MOE_GGUF_STRING, .s = {v, strlen(v)}};
    moe_gguf_writer_set_value(w, key, &val);
}

void moe_gguf_writer_set_alignment(moe_gguf_writer *w, uint32_t alignment) {
    moe_gguf_writer_set_u32(w, KEY_ALIGNMENT, alignment);
}

void moe_gguf_writer_set_arr(moe_gguf_writer *w, const char *key, moe_gguf_vtype elem_type,
                             const void *elems, uint64_t n) {
    moe_gguf_value v = {.type = MOE_GGUF_ARRAY, .arr = {elem_type, n, elems}};
    if (elem_type == MOE_GGUF_STRING) { /* char *[n] -> moe_str[n] for the deep copy */
        const char *const *cs = elems;
        moe_str *s = moe_xmalloc((size_t)(n ? n : 1) * sizeof *s);
        for (uint64_t i = 0; i < n; i++) s[i] = (moe_str){cs[i], strlen(cs[i])};
        v.arr.data = s;
        moe_gguf_writer_set_value(w, key, &v);
        free(s);
        return;
    }
    if (!moe_gguf_vtype_size(elem_type))
        moe_die("moe_gguf_writer_set_arr: element type %s needs moe_gguf_writer_set_value",
                moe_gguf_vtype_name(elem_type));
    moe_gguf_writer_set_value(w, key, &v);
}

static moe_status add_tensor(moe_gguf_writer *w, const char *name, moe_type type, uint32_t n_dims,
                             const int64_t *ne, const void *data, bool borrow,
                             moe_gguf_tensor_fill_fn fill, void *fill_ctx, moe_error *err) {
    const moe_type_traits *tr = moe_type_traits_get(type);
    if (!tr)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': type id %u is not known", name,
                             (unsigned)type);
    if (n_dims > MOE_GGUF_MAX_DIMS)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': %u dimensions, at most %d", name,
                             n_dims, MOE_GGUF_MAX_DIMS);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return moe_error_set(err, MOE_ERR_ARG, "tensor '%s' added twice", name);
    writer_tensor t = {.type = type, .n_dims = n_dims};
    uint64_t n_values = 1;
    for (uint32_t d = 0; d < MOE_GGUF_MAX_DIMS; d++) {
        t.ne[d] = d < n_dims ? ne[d] : 1;
        if (t.ne[d] <= 0 || moe_mul_overflow(n_values, (uint64_t)t.ne[d], &n_values) ||
            n_values > INT64_MAX)
            return moe_error_set(err, MOE_ERR_ARG,
                                 "tensor '%s': dimension %u (%lld) is out of "
                                 "range",
                                 name, d, (long long)t.ne[d]);
    }
    uint64_t row = moe_type_row_bytes(type, t.ne[0]);
    if (row == 0)
        return moe_error_set(err, MOE_ERR_ARG,
                             "tensor '%s': row length %lld is not a multiple "
                             "of the %s block size %lld",
                             name, (long long)t.ne[0], tr->name, (long long)tr->block_values);
    if (moe_mul_overflow(row, n_values / (uint64_t)t.ne[0], &t.n_bytes) || t.n_bytes > SIZE_MAX)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s' is too large", name);
    t.name = moe_xstrdup(name);
    t.borrowed = borrow;
    if (!data && fill) {
        t.fill = fill, t.fill_ctx = fill_ctx;
    } else if (borrow || !data) { /* NULL data: streamed later (moe_gguf_writer_stream_tensor) */
        t.borrowed = true;
        t.data = data;
    } else {
        void *p = moe_xmalloc((size_t)t.n_bytes);
        memcpy(p, data, (size_t)t.n_bytes);
        t.data = p;
    }
    if (w->n_tensors == w->cap_tensors) {
        w->cap_tensors = w->cap_tensors ? 2 * w->cap_tensors : 16;
        w->tensors = moe_xrealloc(w->tensors, w->cap_tensors * sizeof *w->tensors);
    }
    w->tensors[w->n_tensors++] = t;
    return MOE_OK;
}

moe_status moe_gguf_writer_add_tensor(moe_gguf_writer *w, const char *name, moe_type type,
                                      uint32_t n_dims, const int64_t *ne, const void *data,
                                      bool borrow, moe_error *err) {
    return add_tensor(w, name, type, n_dims, ne, data, borrow, NULL, NULL, err);
}

moe_status moe_gguf_writer_add_tensor_deferred(moe_gguf_writer *w, const char *name, moe_type type,
                                               uint32_t n_dims, const int64_t *ne,
                                               moe_gguf_tensor_fill_fn fill, void *ctx,
                                               moe_error *err) {
    if (!fill) return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': no producer", name);
    return add_tensor(w, name, type, n_dims, ne, NULL, false, fill, ctx, err);
}

/* ==== general.file_type ==== */

/* moe type -> llama_ftype; a K type takes its _M mix, the one llama-quantize makes by default */
static const struct {
    moe_type type;
    uint32_t ftype;
} llama_ftypes[] = {
    {MOE_TYPE_F32, 0},      {MOE_TYPE_F16, 1},     {MOE_TYPE_Q4_0, 2},     {MOE_TYPE_Q4_1, 3},
    {MOE_TYPE_Q8_0, 7},     {MOE_TYPE_Q5_0, 8},    {MOE_TYPE_Q5_1, 9},     {MOE_TYPE_Q2_K, 10},
    {MOE_TYPE_Q3_K, 12},    {MOE_TYPE_Q4_K, 15},   {MOE_TYPE_Q5_K, 17},    {MOE_TYPE_Q6_K, 18},
    {MOE_TYPE_IQ2_XXS, 19}, {MOE_TYPE_IQ2_XS, 20}, {MOE_TYPE_IQ3_XXS, 23}, {MOE_TYPE_IQ1_S, 24},
    {MOE_TYPE_IQ4_NL, 25},  {MOE_TYPE_IQ3_S, 26},  {MOE_TYPE_IQ2_S, 28},   {MOE_TYPE_IQ4_XS, 30},
    {MOE_TYPE_IQ1_M, 31},   {MOE_TYPE_BF16, 32},   {MOE_TYPE_TQ1_0, 36},   {MOE_TYPE_TQ2_0, 37},
    {MOE_TYPE_MXFP4, 38},
};

bool moe_gguf_file_type_of(moe_type type, uint32_t *ftype) {
    for (size_t i = 0; i < sizeof llama_ftypes / sizeof llama_ftypes[0]; i++) {
        if (llama_ftypes[i].type != type) continue;
        *ftype = llama_ftypes[i].ftype;
        return true;
    }
    return false;
}

bool moe_gguf_writer_set_file_type(moe_gguf_writer *w) {
    uint64_t bytes[MOE_TYPE_COUNT] = {0}; /* add_tensor admits only known type ids */
    for (size_t i = 0; i < w->n_tensors; i++) bytes[w->tensors[i].type] += w->tensors[i].n_bytes;
    moe_type top = MOE_TYPE_F32;
    for (int t = 1; t < MOE_TYPE_COUNT; t++)
        if (bytes[t] > bytes[top]) top = (moe_type)t;
    uint32_t ftype;
    if (!bytes[top] || !moe_gguf_file_type_of(top, &ftype)) return false;
    moe_gguf_writer_set_u32(w, KEY_FILE_TYPE, ftype);
    return true;
}

/* ==== Serialising ==== */

static void put(out_file *o, const void *p, size_t n) {
    if (o->failed || n == 0) return;
    if (fwrite(p, 1, n, o->f) != n) o->failed = true;
    o->pos += n;
}

static void put_le(out_file *o, uint64_t v, unsigned bytes) {
    uint8_t b[8];
    for (unsigned i = 0; i < bytes; i++) b[i] = (uint8_t)(v >> (8 * i));
    put(o, b, bytes);
}

static void put_str(out_file *o, const char *p, uint64_t len) {
    put_le(o, len, 8);
    put(o, p, (size_t)len);
}

static void put_zeros(out_file *o, uint64_t n) {
    static const uint8_t zeros[256];
    while (n > 0) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        put(o, zeros, k);
        n -= k;
    }
}

/* The value body (no type tag), as the reader expects it. */
static void put_value(out_file *o, const moe_gguf_value *v) {
    size_t nb = moe_gguf_vtype_size(v->type);
    if (nb) {
        uint64_t raw = v->u;
        if (v->type == MOE_GGUF_F32) {
            float f = (float)v->f;
            uint32_t u;
            memcpy(&u, &f, 4);
            raw = u;
        } else if (v->type == MOE_GGUF_F64) {
            memcpy(&raw, &v->f, 8);
        } else if (v->type == MOE_GGUF_BOOL) {
            raw = v->u != 0;
        }
        put_le(o, raw, (unsigned)nb);
    } else if (v->type == MOE_GGUF_STRING) {
        put_str(o, v->s.ptr, v->s.len);
    } else {
        put_le(o, v->arr.elem_type, 4);
        put_le(o, v->arr.n, 8);
        size_t es = moe_gguf_vtype_size(v->arr.elem_type);
        if (es) {
            put(o, v->arr.data, (size_t)v->arr.n * es);
        } else if (v->arr.elem_type == MOE_GGUF_STRING) {
            const moe_str *s = v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) put_str(o, s[i].ptr, s[i].len);
        } else {
            const moe_gguf_value *a = v->arr.data;
            for (uint64_t i = 0; i < v->arr.n; i++) put_value(o, &a[i]);
        }
    }
}

static void put_kv(out_file *o, const char *key, const moe_gguf_value *v) {
    put_str(o, key, strlen(key));
    put_le(o, v->type, 4);
    put_value(o, v);
}

static uint64_t pad_to(uint64_t n, uint32_t alignment) {
    return (alignment - n % alignment) % alignment;
}

static bool is_split_key(const char *key) {
    return strncmp(key, "split.", 6) == 0;
}

/* The alignment the writer pads to: general.alignment when it is a u32 power of two. */
static uint32_t writer_alignment(const moe_gguf_writer *w) {
    for (size_t i = 0; i < w->n_kv; i++) {
        const moe_gguf_value *v = &w->kv[i].value;
        if (strcmp(w->kv[i].key, KEY_ALIGNMENT) == 0 && v->type == MOE_GGUF_U32 && v->u &&
            !(v->u & (v->u - 1)))
            return (uint32_t)v->u;
    }
    return MOE_GGUF_DEFAULT_ALIGNMENT;
}

/* The header, keys and tensor directory of shard split_no of n_split (0 of 0: the whole file)
 * holding tensors [t0, t1), padded to where the data starts. */
static void write_header(const moe_gguf_writer *w, out_file *o, size_t t0, size_t t1,
                         uint32_t split_no, uint32_t n_split) {
    uint32_t alignment = writer_alignment(w);
    bool first = split_no == 0;
    uint64_t n_kv = 0;
    for (size_t i = 0; i < w->n_kv; i++) {
        bool split_key = n_split && is_split_key(w->kv[i].key);
        bool align_key = strcmp(w->kv[i].key, KEY_ALIGNMENT) == 0;
        if (!split_key && (first || (align_key && alignment != MOE_GGUF_DEFAULT_ALIGNMENT))) n_kv++;
    }
    if (n_split) n_kv += 3;

    put(o, "GGUF", 4);
    put_le(o, 3, 4);
    put_le(o, t1 - t0, 8);
    put_le(o, n_kv, 8);
    if (n_split) {
        put_kv(o, KEY_SPLIT_NO, &(moe_gguf_value){.type = MOE_GGUF_U16, .u = split_no});
        put_kv(o, KEY_SPLIT_COUNT, &(moe_gguf_value){.type = MOE_GGUF_U16, .u = n_split});
        put_kv(o, KEY_SPLIT_TENSORS,
               &(moe_gguf_value){.type = MOE_GGUF_I32, .i = (int64_t)w->n_tensors});
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        bool split_key = n_split && is_split_key(w->kv[i].key);
        bool align_key = strcmp(w->kv[i].key, KEY_ALIGNMENT) == 0;
        if (!split_key && (first || (align_key && alignment != MOE_GGUF_DEFAULT_ALIGNMENT)))
            put_kv(o, w->kv[i].key, &w->kv[i].value);
    }
    uint64_t offset = 0;
    for (size_t i = t0; i < t1; i++) {
        const writer_tensor *t = &w->tensors[i];
        put_str(o, t->name, strlen(t->name));
        put_le(o, t->n_dims, 4);
        for (uint32_t d = 0; d < t->n_dims; d++) put_le(o, (uint64_t)t->ne[d], 8);
        put_le(o, (uint64_t)t->type, 4);
        put_le(o, offset, 8);
        offset += t->n_bytes + pad_to(t->n_bytes, alignment);
    }
    if (t1 > t0) put_zeros(o, pad_to(o->pos, alignment)); /* no data section, no padding */
}

/* Shard split_no of n_split (0 of 0: the whole file) with tensors [t0, t1) into o. */
static void write_shard(const moe_gguf_writer *w, out_file *o, size_t t0, size_t t1,
                        uint32_t split_no, uint32_t n_split) {
    uint32_t alignment = writer_alignment(w);
    write_header(w, o, t0, t1, split_no, n_split);
    for (size_t i = t0; i < t1; i++) {
        const writer_tensor *t = &w->tensors[i];
        if (t->fill) {
            if (o->failed) return;
            void *buf = malloc((size_t)t->n_bytes);
            if (!buf || !o->fill_err ||
                t->fill(t->fill_ctx, t->name, buf, t->n_bytes, o->fill_err) != MOE_OK) {
                if (!buf && o->fill_err)
                    moe_error_set(o->fill_err, MOE_ERR_NOMEM,
                                  "tensor '%s': cannot allocate %llu bytes", t->name,
                                  (unsigned long long)t->n_bytes);
                free(buf);
                o->failed = o->fill_failed = true;
                return;
            }
            put(o, buf, (size_t)t->n_bytes);
            free(buf);
        } else {
            put(o, t->data, (size_t)t->n_bytes);
        }
        put_zeros(o, pad_to(t->n_bytes, alignment));
    }
}

static moe_status write_one(const moe_gguf_writer *w, const char *path, size_t t0, size_t t1,
                            uint32_t split_no, uint32_t n_split, moe_error *err) {
    for (size_t i = t0; i < t1; i++)
        if (!w->tensors[i].data && !w->tensors[i].fill)
            return moe_error_set(err, MOE_ERR_ARG,
                                 "tensor '%s' has no data: it was added to be streamed",
                                 w->tensors[i].name);
    out_file o = {.f = fopen(path, "wb"), .path = path, .fill_err = err};
    if (!o.f) return moe_error_set(err, MOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    write_shard(w, &o, t0, t1, split_no, n_split);
    int closed = fclose(o.f);
    if (o.fill_failed) return err->code;
    if (o.failed || closed != 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed at byte %llu: %s", path,
                             (unsigned long long)o.pos, strerror(errno));
    return MOE_OK;
}

moe_gguf *moe_gguf_writer_read_keys(const moe_gguf_writer *w, moe_error *err) {
    char *buf = NULL;
    size_t size = 0;
    out_file o = {.f = open_memstream(&buf, &size), .path = "(keys in memory)"};
    if (!o.f) moe_die("open_memstream failed");
    write_shard(w, &o, 0, 0, 0, 0);
    if (fclose(o.f) != 0 || o.failed) moe_die("writing keys to memory failed");
    moe_gguf *g = moe_gguf_parse_named(buf, size, false, "(keys being written)", err);
    free(buf);
    return g;
}

moe_gguf *moe_gguf_writer_to_memory(const moe_gguf_writer *w, const char *name, moe_error *err) {
    char *buf = NULL;
    size_t size = 0;
    out_file o = {.f = open_memstream(&buf, &size), .path = name};
    if (!o.f) moe_die("open_memstream failed");
    write_header(w, &o, 0, w->n_tensors, 0, 0);
    if (fclose(o.f) != 0 || o.failed) moe_die("writing a header to memory failed");
    moe_gguf *g = moe_gguf_parse_named(buf, size, false, name, err);
    free(buf);
    if (!g) return NULL;
    const uint32_t alignment = writer_alignment(w);
    uint64_t bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        bytes += w->tensors[i].n_bytes + pad_to(w->tensors[i].n_bytes, alignment);
    uint8_t *data = moe_gguf_alloc_data(g, bytes, err);
    for (size_t i = 0; data && i < w->n_tensors; i++) {
        const writer_tensor *t = &w->tensors[i];
        uint8_t *dst = (uint8_t *)moe_gguf_tensor_get(g, i)->data;
        if (t->fill) {
            if (t->fill(t->fill_ctx, t->name, dst, t->n_bytes, err) != MOE_OK) data = NULL;
        } else if (t->data) {
            memcpy(dst, t->data, (size_t)t->n_bytes);
        } else {
            moe_error_set(err, MOE_ERR_ARG, "tensor '%s' has no data: it was added to be streamed",
                          t->name);
            data = NULL;
        }
    }
    if (!data) {
        moe_gguf_close(g);
        return NULL;
    }
    return g;
}

moe_status moe_gguf_writer_write(moe_gguf_writer *w, const char *path,
                                 uint32_t max_tensors_per_shard, moe_error *err) {
    size_t n = w->n_tensors;
    if (max_tensors_per_shard == 0 || n <= max_tensors_per_shard)
        return write_one(w, path, 0, n, 0, 0, err);
    size_t n_split = (n + max_tensors_per_shard - 1) / max_tensors_per_shard;
    if (n_split > MOE_GGUF_MAX_SHARDS || n_split > UINT16_MAX)
        return moe_error_set(err, MOE_ERR_ARG, "%zu shards is more than the limit %d", n_split,
                             MOE_GGUF_MAX_SHARDS);
    size_t len = strlen(path);
    size_t base = len >= 5 && strcmp(path + len - 5, ".gguf") == 0 ? len - 5 : len;
    char *name = moe_xmalloc(base + 32);
    moe_status s = MOE_OK;
    for (size_t i = 0; i < n_split && s == MOE_OK; i++) {
        snprintf(name, base + 32, "%.*s-%05zu-of-%05zu.gguf", (int)base, path, i + 1, n_split);
        size_t t0 = i * max_tensors_per_shard;
        size_t t1 = t0 + max_tensors_per_shard < n ? t0 + max_tensors_per_shard : n;
        s = write_one(w, name, t0, t1, (uint32_t)i, (uint32_t)n_split, err);
    }
    free(name);
    return s;
}

moe_status moe_gguf_writer_write_header_only(const moe_gguf_writer *w, const char *path,
                                             moe_error *err) {
    out_file o = {.f = fopen(path, "wb"), .path = path};
    if (!o.f) return moe_error_set(err, MOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    write_header(w, &o, 0, w->n_tensors, 0, 0);
    const uint32_t alignment = writer_alignment(w);
    uint64_t size = o.pos; /* where the data section starts, then where the file ends */
    for (size_t i = 0; i < w->n_tensors; i++)
        size += w->tensors[i].n_bytes + pad_to(w->tensors[i].n_bytes, alignment);
    if (!o.failed &&
        (size > INT64_MAX || fflush(o.f) != 0 || ftruncate(fileno(o.f), (off_t)size) != 0))
        o.failed = true;
    const int closed = fclose(o.f);
    if (o.failed || closed != 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot write a %llu-byte header-only file: %s",
                             path, (unsigned long long)size, strerror(errno));
    return MOE_OK;
}

/* ==== Streaming: the header first, then each tensor's bytes as they are made ==== */

moe_status moe_gguf_writer_stream_begin(moe_gguf_writer *w, const char *path, moe_error *err) {
    if (w->stream.f) return moe_error_set(err, MOE_ERR_ARG, "%s: a stream is already open", path);
    w->stream = (out_file){.f = fopen(path, "wb")};
    if (!w->stream.f)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    free(w->stream_path);
    w->stream_path = moe_xstrdup(path);
    w->stream.path = w->stream_path;
    w->stream_next = 0;
    write_header(w, &w->stream, 0, w->n_tensors, 0, 0);
    if (w->stream.failed)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed at byte %llu: %s", path,
                             (unsigned long long)w->stream.pos, strerror(errno));
    return MOE_OK;
}

moe_status moe_gguf_writer_stream_tensor(moe_gguf_writer *w, const void *data, moe_error *err) {
    if (!w->stream.f) return moe_error_set(err, MOE_ERR_ARG, "GGUF writer: no stream open");
    if (w->stream_next >= w->n_tensors)
        return moe_error_set(err, MOE_ERR_ARG, "%s: more tensors than were added", w->stream_path);
    const writer_tensor *t = &w->tensors[w->stream_next++];
    put(&w->stream, data, (size_t)t->n_bytes);
    put_zeros(&w->stream, pad_to(t->n_bytes, writer_alignment(w)));
    if (w->stream.failed)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed at byte %llu (tensor '%s'): %s",
                             w->stream_path, (unsigned long long)w->stream.pos, t->name,
                             strerror(errno));
    return MOE_OK;
}

moe_status moe_gguf_writer_stream_finish(moe_gguf_writer *w, moe_error *err) {
    if (!w->stream.f) return moe_error_set(err, MOE_ERR_ARG, "GGUF writer: no stream open");
    int closed = fclose(w->stream.f);
    w->stream.f = NULL;
    if (w->stream_next != w->n_tensors)
        return moe_error_set(err, MOE_ERR_ARG, "%s: %zu of %zu tensors written", w->stream_path,
                             w->stream_next, w->n_tensors);
    if (w->stream.failed || closed != 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed at byte %llu: %s", w->stream_path,
                             (unsigned long long)w->stream.pos, strerror(errno));
    return MOE_OK;
}
