/* Suite "gguf": the reader against every GGUF in ../shared (byte totals reconcile exactly with
 * the file size; tensor lists equal the fixture generator's json), writer round trips (every
 * value type, a real model, a 3-shard split opened from its 2nd shard), and malformed files --
 * each built with the writer or by patching a written file -- rejected with a one-line error
 * that names the problem. Files under tests/data/gguf/ (fuzzing regressions) must give a clean
 * error or success. */
#include "testutil.h"

#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../src/format/format.h"

/* ==== Helpers ==== */

static const char *const shared_ggufs[] = {
    "models/stories260K/stories260K.gguf", "parity/deepseek2-f32.gguf",
    "parity/deepseek2-q8_0-q4_k.gguf",     "parity/gpt-oss-mxfp4.gguf",
    "parity/kimi-linear-f32.gguf",         "parity/llama-q8_0.gguf",
    "parity/qwen3moe-mixed.gguf",          "parity/qwen3next-f32.gguf",
    "parity/gemma4-moe-q4_0.gguf",         "tokenizers/ggml-vocab-llama-spm.gguf",
};
#define N_SHARED (sizeof shared_ggufs / sizeof shared_ggufs[0])

static moe_gguf *open_ok(const char *path) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    return g;
}

static int cmp_by_offset(const void *a, const void *b) {
    const moe_tensor *x = *(const moe_tensor *const *)a, *y = *(const moe_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Per shard: header + tensors + padding == file size, where padding is recomputed here from the
 * gaps between tensors (not taken from the reader), and every gap is zero-or-padding sized. */
static void check_reconciles(const moe_gguf *g) {
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(g, s);
        const moe_tensor **list = moe_xcalloc(moe_gguf_n_tensors(g) + 1, sizeof *list);
        size_t n = 0;
        uint64_t bytes = 0;
        for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
            const moe_tensor *t = moe_gguf_tensor_get(g, i);
            if (t->shard != s) continue;
            list[n++] = t;
            bytes += t->n_bytes;
            assert_int_equal(t->file_offset, sh->data_offset + t->offset);
            assert_true(t->data != NULL);
        }
        qsort(list, n, sizeof *list, cmp_by_offset);
        uint64_t pos = sh->header_bytes, pad = 0;
        for (size_t i = 0; i < n; i++) {
            assert_true(list[i]->file_offset >= pos);
            pad += list[i]->file_offset - pos;
            pos = list[i]->file_offset + list[i]->n_bytes;
        }
        assert_true(sh->file_size >= pos);
        pad += sh->file_size - pos;
        assert_int_equal(n, sh->n_tensors);
        assert_int_equal(bytes, sh->tensor_bytes);
        assert_int_equal(pad, sh->padding_bytes);
        assert_int_equal(sh->header_bytes + sh->tensor_bytes + sh->padding_bytes, sh->file_size);
        free(list);
    }
}

static uint8_t *read_whole(const char *path, size_t *size) {
    uint8_t *d;
    moe_error err = {0};
    if (moe_file_read(path, &d, size, &err) != MOE_OK) fail_msg("%s", err.msg);
    return d;
}

static void write_bytes(const char *path, const void *d, size_t n) {
    moe_error err = {0};
    if (moe_file_write(path, d, n, &err) != MOE_OK) fail_msg("%s", err.msg);
}

static char *tmp_path(const char *name) {
    static char paths[8][512];
    static unsigned next;
    char *p = paths[next++ % 8];
    snprintf(p, sizeof paths[0], "%s/%s", moe_test_tmpdir(), name);
    return p;
}

/* Open must fail; the one-line message names the file, a byte offset and each `want`. */
static void expect_open_error(const char *path, const char *want1, const char *want2) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (g) {
        moe_gguf_close(g);
        fail_msg("%s opened, expected an error naming '%s'", path, want1);
    }
    assert_int_not_equal(err.code, MOE_OK);
    assert_null(strchr(err.msg, '\n'));
    if (!strstr(err.msg, path)) fail_msg("message does not name the file: %s", err.msg);
    if (!strstr(err.msg, "byte ")) fail_msg("message does not give a byte offset: %s", err.msg);
    if (want1 && !strstr(err.msg, want1)) fail_msg("expected '%s' in: %s", want1, err.msg);
    if (want2 && !strstr(err.msg, want2)) fail_msg("expected '%s' in: %s", want2, err.msg);
}

static uint64_t find_bytes(const uint8_t *d, size_t n, const char *s) {
    const uint8_t *p = memmem(d, n, s, strlen(s));
    if (!p) fail_msg("'%s' not found in the file", s);
    return (uint64_t)(p - d);
}

static void put_le(uint8_t *d, uint64_t v, unsigned bytes) {
    for (unsigned i = 0; i < bytes; i++) d[i] = (uint8_t)(v >> (8 * i));
}

/* ==== A small file with every kind of content ==== */

static const float small_f32[16] = {1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4, -5, -6, -7, -8};
static uint8_t small_q8[2 * 34];
static uint16_t small_f16[4] = {0x3c00, 0x4000, 0xbc00, 0};

/* Writes tests' small file: 3 tensors (F32 [8,2], Q8_0 [32,2], F16 [4]) and keys of every
 * value type; returns its bytes (caller frees). */
static uint8_t *write_small(const char *path, size_t *size) {
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_error err = {0};
    moe_gguf_writer_set_str(w, "general.architecture", "llama");
    moe_gguf_writer_set_u32(w, "key.u32", 7);
    moe_gguf_writer_set_value(w, "key.ab", &(moe_gguf_value){.type = MOE_GGUF_U8, .u = 1});
    moe_gguf_writer_set_value(w, "key.ac", &(moe_gguf_value){.type = MOE_GGUF_I8, .i = -2});
    const char *strs[] = {"a", "bc", "def"};
    moe_gguf_writer_set_arr(w, "key.strs", MOE_GGUF_STRING, strs, 3);
    for (size_t i = 0; i < sizeof small_q8; i++) small_q8[i] = (uint8_t)(i * 7);
    int64_t ne_a[2] = {8, 2}, ne_b[2] = {32, 2}, ne_c[1] = {4};
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "tensor.aa", MOE_TYPE_F32, 2, ne_a, small_f32, false, &err),
        MOE_OK);
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "tensor.ab", MOE_TYPE_Q8_0, 2, ne_b, small_q8, true, &err),
        MOE_OK);
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "tensor.ac", MOE_TYPE_F16, 1, ne_c, small_f16, false, &err),
        MOE_OK);
    if (moe_gguf_writer_write(w, path, 0, &err) != MOE_OK) fail_msg("%s", err.msg);
    moe_gguf_writer_free(w);
    return read_whole(path, size);
}

/* Where tensor `name`'s directory entry fields are in the small file. */
typedef struct entry_pos {
    uint64_t n_dims, ne0, type, offset;
} entry_pos;

static entry_pos small_entry(const uint8_t *d, size_t n, const char *name, uint32_t n_dims) {
    entry_pos e;
    e.n_dims = find_bytes(d, n, name) + strlen(name);
    e.ne0 = e.n_dims + 4;
    e.type = e.ne0 + 8 * n_dims;
    e.offset = e.type + 4;
    return e;
}

/* Patch `bytes` bytes at `at` with v, write to `name` in the tmp dir, expect an error. */
static void patched_error(const char *name, uint64_t at, uint64_t v, unsigned bytes,
                          const char *want1, const char *want2) {
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    assert_true(at + bytes <= n);
    put_le(d + at, v, bytes);
    const char *p = tmp_path(name);
    write_bytes(p, d, n);
    expect_open_error(p, want1, want2);
    free(d);
}

/* ==== Shared fixtures ==== */

static void shared_files_reconcile(void **state) {
    (void)state;
    for (size_t f = 0; f < N_SHARED; f++) {
        const char *path = moe_test_shared(shared_ggufs[f]);
        MOE_SKIP_IF_NULL(path);
        moe_gguf *g = open_ok(path);
        assert_int_equal(moe_gguf_n_shards(g), 1);
        assert_int_equal(moe_gguf_shard_get(g, 0)->version, 3);
        assert_int_equal(moe_gguf_alignment(g), 32);
        check_reconciles(g);
        for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
            const moe_tensor *t = moe_gguf_tensor_get(g, i);
            assert_ptr_equal(moe_gguf_tensor_find(g, t->name.ptr), t);
        }
        assert_null(moe_gguf_tensor_find(g, "no.such.tensor"));
        moe_gguf_close(g);
    }
}

/* The fixture generator's json lists every tensor (name, type, ne, n_bytes); ours must agree,
 * in the same order. python3 turns the json into lines so this test needs no JSON parser. */
static void parity_tensor_lists(void **state) {
    (void)state;
    static const char *const models[] = {"deepseek2-f32",   "deepseek2-q8_0-q4_k", "gpt-oss-mxfp4",
                                         "kimi-linear-f32", "llama-q8_0",          "qwen3moe-mixed",
                                         "qwen3next-f32",   "gemma4-moe-q4_0"};
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++) {
        char rel[256];
        snprintf(rel, sizeof rel, "parity/%s.json", models[m]);
        const char *json = moe_test_shared(rel);
        MOE_SKIP_IF_NULL(json);
        snprintf(rel, sizeof rel, "parity/%s.gguf", models[m]);
        moe_gguf *g = open_ok(moe_test_shared(rel));
        char cmd[1024], *out;
        snprintf(cmd, sizeof cmd,
                 "python3 -c 'import json,sys\nd=json.load(open(sys.argv[1]))\nfor t in "
                 "d[\"tensors\"]: print(t[\"name\"], t[\"type\"], t[\"n_bytes\"], "
                 "\",\".join(map(str, t[\"ne\"])))' %s",
                 json);
        assert_int_equal(moe_test_run(cmd, &out), 0);
        char *save = NULL;
        uint64_t i = 0;
        for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            const moe_tensor *t = moe_gguf_tensor_get(g, i++);
            if (!t) fail_msg("%s: json lists more tensors than the file has", models[m]);
            char mine[512];
            int k = snprintf(mine, sizeof mine, "%s %s %" PRIu64 " ", t->name.ptr,
                             moe_type_name(t->type), t->n_bytes);
            for (uint32_t d = 0; d < t->n_dims; d++)
                k += snprintf(mine + k, sizeof mine - (size_t)k, "%s%" PRId64, d ? "," : "",
                              t->ne[d]);
            assert_string_equal(mine, line);
        }
        assert_int_equal(i, moe_gguf_n_tensors(g));
        free(out);
        moe_gguf_close(g);
    }
}

/* ==== Round trips ==== */

static void value_equal(const moe_gguf_value *a, const moe_gguf_value *b) {
    assert_int_equal(a->type, b->type);
    switch (a->type) {
    case MOE_GGUF_STRING:
        assert_int_equal(a->s.len, b->s.len);
        assert_memory_equal(a->s.ptr, b->s.ptr, a->s.len);
        break;
    case MOE_GGUF_F32:
    case MOE_GGUF_F64:
        assert_true(a->f == b->f);
        break;
    case MOE_GGUF_I8:
    case MOE_GGUF_I16:
    case MOE_GGUF_I32:
    case MOE_GGUF_I64:
        assert_int_equal(a->i, b->i);
        break;
    case MOE_GGUF_ARRAY:
        assert_int_equal(a->arr.elem_type, b->arr.elem_type);
        assert_int_equal(a->arr.n, b->arr.n);
        for (uint64_t i = 0; i < a->arr.n; i++) {
            if (a->arr.elem_type == MOE_GGUF_STRING) {
                const moe_str *x = a->arr.data, *y = b->arr.data;
                assert_int_equal(x[i].len, y[i].len);
                assert_memory_equal(x[i].ptr, y[i].ptr, x[i].len);
            } else if (a->arr.elem_type == MOE_GGUF_ARRAY) {
                value_equal(&((const moe_gguf_value *)a->arr.data)[i],
                            &((const moe_gguf_value *)b->arr.data)[i]);
            }
        }
        if (a->arr.elem_type != MOE_GGUF_STRING && a->arr.elem_type != MOE_GGUF_ARRAY) {
            size_t es = a->arr.elem_type == MOE_GGUF_U8 || a->arr.elem_type == MOE_GGUF_I8 ||
                                a->arr.elem_type == MOE_GGUF_BOOL
                            ? 1
                        : a->arr.elem_type == MOE_GGUF_U16 || a->arr.elem_type == MOE_GGUF_I16 ? 2
                        : a->arr.elem_type == MOE_GGUF_U64 || a->arr.elem_type == MOE_GGUF_I64 ||
                                a->arr.elem_type == MOE_GGUF_F64
                            ? 8
                            : 4;
            if (a->arr.n) assert_memory_equal(a->arr.data, b->arr.data, a->arr.n * es);
        }
        break;
    default:
        assert_int_equal(a->u, b->u);
        break;
    }
}

/* Two models hold the same keys (ignoring split.*), tensors and data bytes. */
static void models_equal(const moe_gguf *a, const moe_gguf *b, bool ignore_split_keys) {
    uint64_t nb = 0;
    for (uint64_t i = 0; i < moe_gguf_n_kv(b); i++)
        if (!ignore_split_keys || strncmp(moe_gguf_kv_get(b, i)->key.ptr, "split.", 6)) nb++;
    assert_int_equal(moe_gguf_n_kv(a), nb);
    for (uint64_t i = 0; i < moe_gguf_n_kv(a); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(a, i);
        const moe_gguf_value *v = moe_gguf_find(b, kv->key.ptr);
        if (!v) fail_msg("key %s is missing", kv->key.ptr);
        value_equal(&kv->value, v);
    }
    assert_int_equal(moe_gguf_n_tensors(a), moe_gguf_n_tensors(b));
    for (uint64_t i = 0; i < moe_gguf_n_tensors(a); i++) {
        const moe_tensor *x = moe_gguf_tensor_get(a, i), *y = moe_gguf_tensor_get(b, i);
        assert_string_equal(x->name.ptr, y->name.ptr);
        assert_int_equal(x->type, y->type);
        assert_int_equal(x->n_dims, y->n_dims);
        assert_memory_equal(x->ne, y->ne, sizeof x->ne);
        assert_int_equal(x->n_bytes, y->n_bytes);
        assert_memory_equal(x->data, y->data, x->n_bytes);
    }
}

/* A writer holding every key and tensor of g. */
static moe_gguf_writer *writer_from(const moe_gguf *g) {
    moe_gguf_writer *w = moe_gguf_writer_new();
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        moe_gguf_writer_set_value(w, kv->key.ptr, &kv->value);
    }
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        moe_error err = {0};
        if (moe_gguf_writer_add_tensor(w, t->name.ptr, t->type, t->n_dims, t->ne, t->data, true,
                                       &err) != MOE_OK)
            fail_msg("%s", err.msg);
    }
    return w;
}

static void roundtrip_every_value_type(void **state) {
    (void)state;
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_value(w, "v.u8", &(moe_gguf_value){.type = MOE_GGUF_U8, .u = 255});
    moe_gguf_writer_set_value(w, "v.i8", &(moe_gguf_value){.type = MOE_GGUF_I8, .i = -128});
    moe_gguf_writer_set_value(w, "v.u16", &(moe_gguf_value){.type = MOE_GGUF_U16, .u = 65535});
    moe_gguf_writer_set_value(w, "v.i16", &(moe_gguf_value){.type = MOE_GGUF_I16, .i = -32768});
    moe_gguf_writer_set_u32(w, "v.u32", 4000000000u);
    moe_gguf_writer_set_i32(w, "v.i32", -2000000000);
    moe_gguf_writer_set_f32(w, "v.f32", 0.1f);
    moe_gguf_writer_set_bool(w, "v.bool", true);
    moe_gguf_writer_set_str(w, "v.str", "h\xc3\xa9llo\n\"world\"");
    moe_gguf_writer_set_u64(w, "v.u64", UINT64_MAX);
    moe_gguf_writer_set_value(w, "v.i64", &(moe_gguf_value){.type = MOE_GGUF_I64, .i = INT64_MIN});
    moe_gguf_writer_set_value(w, "v.f64", &(moe_gguf_value){.type = MOE_GGUF_F64, .f = 1e300});
    moe_gguf_writer_set_u32(w, "v.replaced", 1);
    moe_gguf_writer_set_str(w, "v.replaced", "second value wins, first position stays");
    int32_t ints[5] = {-1, 0, 1, INT32_MAX, INT32_MIN};
    moe_gguf_writer_set_arr(w, "a.i32", MOE_GGUF_I32, ints, 5);
    uint8_t bools[3] = {1, 0, 1};
    moe_gguf_writer_set_arr(w, "a.bool", MOE_GGUF_BOOL, bools, 3);
    const char *strs[] = {"", "x", "\xe2\x96\x81the"};
    moe_gguf_writer_set_arr(w, "a.str", MOE_GGUF_STRING, strs, 3);
    moe_gguf_writer_set_arr(w, "a.empty", MOE_GGUF_F32, NULL, 0);
    /* a string holding a NUL, through moe_str */
    moe_str with_nul[1] = {{"a\0b", 3}};
    moe_gguf_writer_set_value(
        w, "a.nul",
        &(moe_gguf_value){.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_STRING, 1, with_nul}});
    /* nested: [[1,2],[3]] of u16, and an array of arrays of arrays of strings */
    uint16_t n12[2] = {1, 2}, n3[1] = {3};
    moe_gguf_value inner[2] = {{.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_U16, 2, n12}},
                               {.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_U16, 1, n3}}};
    moe_gguf_writer_set_value(
        w, "a.nested",
        &(moe_gguf_value){.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_ARRAY, 2, inner}});
    moe_str deep_s[2] = {{"p", 1}, {"q", 1}};
    moe_gguf_value deep1 = {.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_STRING, 2, deep_s}};
    moe_gguf_value deep2 = {.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_ARRAY, 1, &deep1}};
    moe_gguf_writer_set_value(
        w, "a.deep", &(moe_gguf_value){.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_ARRAY, 1, &deep2}});
    moe_gguf_writer_set_alignment(w, 64);
    int64_t ne[3] = {32, 3, 2};
    uint8_t q4[6 * 18];
    for (size_t i = 0; i < sizeof q4; i++) q4[i] = (uint8_t)(i ^ 0x5a);
    moe_error err = {0};
    assert_int_equal(moe_gguf_writer_add_tensor(w, "t.q4", MOE_TYPE_Q4_0, 3, ne, q4, false, &err),
                     MOE_OK);
    float one = 1.0f;
    int64_t ne1 = 1;
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "t.scalar", MOE_TYPE_F32, 1, &ne1, &one, false, &err),
        MOE_OK);
    /* errors the writer refuses before writing anything */
    int64_t bad = 33;
    assert_int_equal(moe_gguf_writer_add_tensor(w, "t.bad", MOE_TYPE_Q8_0, 1, &bad, q4, true, &err),
                     MOE_ERR_ARG);
    assert_non_null(strstr(err.msg, "block size"));
    moe_error_clear(&err);
    assert_int_equal(moe_gguf_writer_add_tensor(w, "t.q4", MOE_TYPE_F32, 1, &ne1, &one, true, &err),
                     MOE_ERR_ARG);
    moe_error_clear(&err);
    const char *path = tmp_path("values.gguf");
    assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);

    moe_gguf *g = open_ok(path);
    check_reconciles(g);
    assert_int_equal(moe_gguf_alignment(g), 64);
    uint64_t u;
    int64_t i;
    double f;
    bool b;
    assert_true(moe_gguf_get_u64(g, "v.u8", &u) && u == 255);
    assert_true(moe_gguf_get_i64(g, "v.i8", &i) && i == -128);
    assert_false(moe_gguf_get_u64(g, "v.i8", &u)); /* negative does not fit */
    assert_true(moe_gguf_get_u64(g, "v.u16", &u) && u == 65535);
    assert_true(moe_gguf_get_i64(g, "v.i16", &i) && i == -32768);
    assert_true(moe_gguf_get_u64(g, "v.u32", &u) && u == 4000000000u);
    assert_true(moe_gguf_get_i64(g, "v.i32", &i) && i == -2000000000);
    assert_true(moe_gguf_get_f64(g, "v.f32", &f) && f == (double)0.1f);
    assert_true(moe_gguf_get_bool(g, "v.bool", &b) && b);
    assert_string_equal(moe_gguf_get_str(g, "v.str"), "h\xc3\xa9llo\n\"world\"");
    assert_true(moe_gguf_get_u64(g, "v.u64", &u) && u == UINT64_MAX);
    assert_false(moe_gguf_get_i64(g, "v.u64", &i)); /* does not fit */
    assert_true(moe_gguf_get_i64(g, "v.i64", &i) && i == INT64_MIN);
    assert_true(moe_gguf_get_f64(g, "v.f64", &f) && f == 1e300);
    assert_string_equal(moe_gguf_get_str(g, "v.replaced"),
                        "second value wins, first position stays");
    assert_string_equal(moe_gguf_kv_get(g, 12)->key.ptr, "v.replaced");
    assert_null(moe_gguf_get_str(g, "v.u8"));
    assert_false(moe_gguf_get_u64(g, "absent", &u));

    const moe_gguf_value *v = moe_gguf_find(g, "a.i32");
    assert_non_null(v);
    assert_int_equal(v->arr.n, 5);
    assert_memory_equal(v->arr.data, ints, sizeof ints);
    v = moe_gguf_find(g, "a.str");
    assert_int_equal(v->arr.elem_type, MOE_GGUF_STRING);
    assert_string_equal(((const moe_str *)v->arr.data)[2].ptr, "\xe2\x96\x81the");
    v = moe_gguf_find(g, "a.nul");
    assert_int_equal(((const moe_str *)v->arr.data)[0].len, 3);
    assert_memory_equal(((const moe_str *)v->arr.data)[0].ptr, "a\0b", 4);
    v = moe_gguf_find(g, "a.nested");
    assert_int_equal(v->arr.elem_type, MOE_GGUF_ARRAY);
    const moe_gguf_value *in = v->arr.data;
    assert_int_equal(in[0].arr.n, 2);
    assert_memory_equal(in[0].arr.data, n12, 4);
    assert_int_equal(in[1].arr.n, 1);
    v = moe_gguf_find(g, "a.deep");
    const moe_gguf_value *d2 = v->arr.data, *d1 = d2->arr.data;
    assert_string_equal(((const moe_str *)d1->arr.data)[1].ptr, "q");
    assert_int_equal(moe_gguf_find(g, "a.empty")->arr.n, 0);

    const moe_tensor *t = moe_gguf_tensor_find(g, "t.q4");
    assert_non_null(t);
    assert_int_equal(t->n_dims, 3);
    assert_int_equal(t->ne[2], 2);
    assert_int_equal(t->ne[3], 1);
    assert_int_equal(t->n_bytes, sizeof q4);
    assert_memory_equal(t->data, q4, sizeof q4);
    assert_int_equal(t->file_offset % 64, 0);
    t = moe_gguf_tensor_find(g, "t.scalar");
    assert_int_equal(t->offset % 64, 0);
    assert_true(*(const float *)t->data == 1.0f);

    /* copy everything through a second writer: the same model again */
    moe_gguf_writer *w2 = writer_from(g);
    const char *path2 = tmp_path("values2.gguf");
    assert_int_equal(moe_gguf_writer_write(w2, path2, 0, &err), MOE_OK);
    moe_gguf_writer_free(w2);
    moe_gguf *g2 = open_ok(path2);
    models_equal(g, g2, false);
    moe_gguf_close(g2);
    moe_gguf_close(g);

    /* a buffer parse of the header only sees the same directory, with no data */
    size_t n;
    uint8_t *bytes = read_whole(path, &n);
    g = moe_gguf_parse(bytes, n, false, &err);
    assert_non_null(g);
    assert_null(moe_gguf_tensor_find(g, "t.q4")->data);
    moe_gguf_close(g);
    free(bytes);
}

/* A real model copied key by key and tensor by tensor comes out byte-identical: our writer
 * lays a file out exactly as llama.cpp's did. */
static void roundtrip_shared_model_bytes(void **state) {
    (void)state;
    static const char *const files[] = {"models/stories260K/stories260K.gguf",
                                        "parity/qwen3moe-mixed.gguf",
                                        "tokenizers/ggml-vocab-llama-spm.gguf"};
    for (size_t f = 0; f < 3; f++) {
        const char *src = moe_test_shared(files[f]);
        MOE_SKIP_IF_NULL(src);
        moe_gguf *g = open_ok(src);
        moe_gguf_writer *w = writer_from(g);
        const char *out = tmp_path("copy.gguf");
        moe_error err = {0};
        assert_int_equal(moe_gguf_writer_write(w, out, 0, &err), MOE_OK);
        moe_gguf_writer_free(w);
        moe_gguf *g2 = open_ok(out);
        models_equal(g, g2, false);
        size_t na, nb;
        uint8_t *a = read_whole(src, &na), *b = read_whole(out, &nb);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, na);
        free(a);
        free(b);
        moe_gguf_close(g2);
        moe_gguf_close(g);
    }
}

/* ==== Split models ==== */

static void split_three_shards(void **state) {
    (void)state;
    const char *src = moe_test_shared("parity/qwen3moe-mixed.gguf");
    MOE_SKIP_IF_NULL(src);
    moe_gguf *g = open_ok(src);
    uint64_t n = moe_gguf_n_tensors(g);
    moe_gguf_writer *w = writer_from(g);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/split", moe_test_tmpdir());
    assert_int_equal(mkdir(dir, 0700), 0);
    char base[600];
    snprintf(base, sizeof base, "%s/model.gguf", dir);
    moe_error err = {0};
    uint32_t per = (uint32_t)((n + 2) / 3);
    assert_int_equal(moe_gguf_writer_write(w, base, per, &err), MOE_OK);
    moe_gguf_writer_free(w);

    char shard2[700];
    snprintf(shard2, sizeof shard2, "%s/model-00002-of-00003.gguf", dir);
    moe_gguf *s = open_ok(shard2);
    assert_int_equal(moe_gguf_n_shards(s), 3);
    uint64_t count, no, total, tensor_total = 0;
    assert_true(moe_gguf_get_u64(s, "split.count", &count) && count == 3);
    assert_true(moe_gguf_get_u64(s, "split.no", &no) && no == 0); /* metadata: shard 0's */
    assert_true(moe_gguf_get_u64(s, "split.tensors.count", &total) && total == n);
    assert_int_equal(moe_gguf_find(s, "split.count")->type, MOE_GGUF_U16);
    assert_int_equal(moe_gguf_find(s, "split.tensors.count")->type, MOE_GGUF_I32);
    for (uint32_t i = 0; i < 3; i++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(s, i);
        char want[32];
        snprintf(want, sizeof want, "-0000%u-of-00003.gguf", i + 1);
        assert_non_null(strstr(sh->path, want));
        tensor_total += sh->tensor_bytes;
        assert_int_equal(sh->n_tensors, i < 2 ? per : n - 2 * per);
    }
    check_reconciles(s);
    models_equal(g, s, true);
    assert_int_equal(tensor_total, moe_gguf_shard_get(g, 0)->tensor_bytes);
    /* read into memory on two threads: every shard's bytes, the same as mapped */
    moe_pool *pool = moe_pool_new(2);
    uint64_t read = 0, data_total = 0;
    assert_int_equal(moe_gguf_to_memory(s, pool, &read, &err), MOE_OK);
    moe_pool_free(pool);
    for (uint32_t i = 0; i < 3; i++)
        data_total += moe_gguf_shard_get(s, i)->file_size - moe_gguf_shard_get(s, i)->data_offset;
    assert_int_equal(read, data_total);
    models_equal(g, s, true);
    for (uint64_t i = 0; i < n; i++) assert_int_equal(moe_gguf_tensor_get(s, i)->shard, i / per);
    assert_ptr_equal(moe_gguf_tensor_find(s, moe_gguf_tensor_get(g, n - 1)->name.ptr),
                     moe_gguf_tensor_get(s, n - 1));
    moe_gguf_close(s);

    /* the same from the 1st and 3rd shard */
    snprintf(shard2, sizeof shard2, "%s/model-00003-of-00003.gguf", dir);
    s = open_ok(shard2);
    models_equal(g, s, true);
    moe_gguf_close(s);

    /* a shard that lies about its number */
    size_t len;
    uint8_t *d = read_whole(shard2, &len);
    uint64_t at = find_bytes(d, len, "split.no") + 8 + 4; /* key, then u16 type tag */
    put_le(d + at, 1, 2);
    write_bytes(shard2, d, len);
    snprintf(shard2, sizeof shard2, "%s/model-00001-of-00003.gguf", dir);
    moe_gguf *bad = moe_gguf_open(shard2, &err);
    assert_null(bad);
    assert_non_null(strstr(err.msg, "model-00003-of-00003.gguf"));
    assert_non_null(strstr(err.msg, "split.no 2"));
    /* a missing shard */
    moe_error_clear(&err);
    snprintf(shard2, sizeof shard2, "%s/model-00003-of-00003.gguf", dir);
    assert_int_equal(unlink(shard2), 0);
    snprintf(shard2, sizeof shard2, "%s/model-00002-of-00003.gguf", dir);
    assert_null(moe_gguf_open(shard2, &err));
    assert_non_null(strstr(err.msg, "model-00003-of-00003.gguf"));
    assert_non_null(strstr(err.msg, "No such file"));
    free(d);
    moe_gguf_close(g);
}

/* Shards that agree with each other but not with their totals, or lost their names. */
static void split_inconsistent(void **state) {
    (void)state;
    size_t small_size;
    free(write_small(tmp_path("small.gguf"), &small_size));
    moe_gguf *g = open_ok(tmp_path("small.gguf"));
    moe_gguf_writer *w = writer_from(g);
    char dir[512], base[600], p1[700], p2[700];
    snprintf(dir, sizeof dir, "%s/split2", moe_test_tmpdir());
    assert_int_equal(mkdir(dir, 0700), 0);
    snprintf(base, sizeof base, "%s/s.gguf", dir);
    moe_error err = {0};
    assert_int_equal(moe_gguf_writer_write(w, base, 2, &err), MOE_OK);
    moe_gguf_writer_free(w);
    moe_gguf_close(g);
    snprintf(p1, sizeof p1, "%s/s-00001-of-00002.gguf", dir);
    snprintf(p2, sizeof p2, "%s/s-00002-of-00002.gguf", dir);
    moe_gguf_close(open_ok(p2));
    const char *paths[2] = {p1, p2};
    for (int i = 0; i < 2; i++) {
        size_t n;
        uint8_t *d = read_whole(paths[i], &n);
        put_le(d + find_bytes(d, n, "split.tensors.count") + 19 + 4, 4, 4);
        write_bytes(paths[i], d, n);
        free(d);
    }
    expect_open_error(p2, "split.tensors.count is 4 but the 2 shards hold 3 tensors", NULL);
    char renamed[700];
    snprintf(renamed, sizeof renamed, "%s/renamed.gguf", dir);
    assert_int_equal(rename(p1, renamed), 0);
    expect_open_error(renamed, "does not end in -NNNNN-of-MMMMM.gguf", "split.count is 2");
}

/* A file replaced, or truncated in place, between open and moe_gguf_to_memory is refused with
 * its path, and the tensors still read the bytes that were mapped. */
static void to_memory_refuses_a_changed_file(void **state) {
    (void)state;
    size_t n;
    const char *path = tmp_path("changed.gguf"), *other = tmp_path("other.gguf");
    uint8_t *d = write_small(path, &n);
    moe_gguf *orig = open_ok(path), *g = open_ok(path);
    write_bytes(other, d, n);
    assert_int_equal(rename(other, path), 0); /* the same bytes under another inode */
    moe_error err = {0};
    assert_int_equal(moe_gguf_to_memory(g, NULL, NULL, &err), MOE_ERR_IO);
    assert_non_null(strstr(err.msg, path));
    assert_non_null(strstr(err.msg, "changed since it was opened"));
    models_equal(orig, g, false);
    moe_gguf_close(g);

    g = open_ok(path);
    assert_int_equal(truncate(path, (off_t)n - 1), 0);
    moe_error_clear(&err);
    assert_int_equal(moe_gguf_to_memory(g, NULL, NULL, &err), MOE_ERR_IO);
    assert_non_null(strstr(err.msg, "changed since it was opened"));
    moe_gguf_close(g);
    moe_gguf_close(orig);
    free(d);
}

/* ==== Malformed files ==== */

static void version_2_reads_version_1_refused(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    put_le(d + 4, 2, 4);
    const char *p = tmp_path("v2.gguf");
    write_bytes(p, d, n);
    moe_gguf *g = open_ok(p);
    assert_int_equal(moe_gguf_shard_get(g, 0)->version, 2);
    assert_int_equal(moe_gguf_n_tensors(g), 3);
    moe_gguf_close(g);
    free(d);
    patched_error("v1.gguf", 4, 1, 4, "GGUF version 1 is not supported", "byte 4");
    patched_error("vbig.gguf", 4, 0x03000000, 4, "big-endian", NULL);
}

static void truncated_at_every_byte(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    moe_gguf *whole = open_ok(tmp_path("small.gguf"));
    const uint64_t header_bytes = moe_gguf_shard_get(whole, 0)->header_bytes;
    /* the file is valid exactly from the end of the last tensor's data on */
    uint64_t valid_from = 0;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(whole); i++) {
        const moe_tensor *t = moe_gguf_tensor_get(whole, i);
        if (t->file_offset + t->n_bytes > valid_from) valid_from = t->file_offset + t->n_bytes;
    }
    for (size_t cut = 0; cut < n; cut++) {
        /* an exact-size copy so ASan sees any read past the cut */
        uint8_t *part = moe_xmalloc(cut ? cut : 1);
        memcpy(part, d, cut);
        moe_error err = {0};
        moe_gguf *g = moe_gguf_parse_named(part, cut, true, "cut.gguf", &err);
        if (cut >= valid_from) {
            if (!g) fail_msg("cut at %zu: %s", cut, err.msg);
        } else {
            if (g) fail_msg("cut at %zu of %zu parsed", cut, n);
            assert_non_null(strstr(err.msg, "cut.gguf: byte "));
            if (cut < header_bytes && !strstr(err.msg, "before the end of") &&
                !strstr(err.msg, "left in the file"))
                fail_msg("cut at %zu: %s", cut, err.msg);
            if (cut >= header_bytes && !strstr(err.msg, "runs past the end of the file"))
                fail_msg("cut at %zu: %s", cut, err.msg);
        }
        moe_gguf_close(g);
        free(part);
    }
    moe_gguf_close(whole);
    /* and as files, a few cut points */
    const size_t cuts[] = {0, 3, 4, 7, 8, 23, 24, 40, (size_t)header_bytes - 1};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        const char *p = tmp_path("cut.gguf");
        write_bytes(p, d, cuts[c]);
        expect_open_error(p, cuts[c] == 0 ? "empty file" : " the file", NULL);
    }
    free(d);
}

static void flipped_counts(void **state) {
    (void)state;
    patched_error("ntensors.gguf", 8, 1u << 30, 8, "tensor count 1073741824", "limit");
    patched_error("ntensors2.gguf", 8, 1000, 8, "tensor count 1000", "bytes left");
    patched_error("nkv.gguf", 16, UINT64_MAX, 8, "metadata count", "byte 16");
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    /* the length of the key "key.strs" and of the array behind it */
    uint64_t key = find_bytes(d, n, "key.strs");
    free(d);
    patched_error("keylen.gguf", key - 8, UINT64_MAX, 8, "metadata key has length", "limit");
    patched_error("keylen2.gguf", key - 8, 5000, 8, "expected a metadata key (5000 bytes)", NULL);
    patched_error("arrlen.gguf", key + 8 + 4 + 4, 1u << 27, 8, "key 'key.strs': array of 134217728",
                  "limit");
    patched_error("arrlen2.gguf", key + 8 + 4 + 4, 1000, 8, "array of 1000 string", "bytes");
}

static void absurd_dimensions(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    entry_pos e = small_entry(d, n, "tensor.aa", 2);
    free(d);
    patched_error("dim_huge.gguf", e.ne0, 1ull << 40, 8, "tensor 'tensor.aa'", "past the end");
    patched_error("dim_zero.gguf", e.ne0, 0, 8, "dimension 0 is 0", "tensor 'tensor.aa'");
    patched_error("dim_neg.gguf", e.ne0 + 8, (uint64_t)-5, 8, "dimension 1 is -5", NULL);
    patched_error("dim_overflow.gguf", e.ne0 + 8, 1ull << 62, 8, "int64 range", "tensor.aa");
    patched_error("ndims.gguf", e.n_dims, 5, 4, "n_dims is 5, expected at most 4", "tensor.aa");
    d = write_small(tmp_path("small.gguf"), &n);
    e = small_entry(d, n, "tensor.ab", 2);
    free(d);
    patched_error("rowlen.gguf", e.ne0, 33, 8, "row length 33 is not a multiple of the Q8_0 block",
                  "tensor.ab");
}

static void duplicates(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    uint64_t t = find_bytes(d, n, "tensor.ab");
    uint64_t k = find_bytes(d, n, "key.ac");
    free(d);
    patched_error("dup_tensor.gguf", t + 8, 'a', 1, "duplicate tensor name 'tensor.aa'", NULL);
    patched_error("dup_key.gguf", k + 5, 'b', 1, "duplicate metadata key 'key.ab'", NULL);
}

static void unknown_types(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    entry_pos e = small_entry(d, n, "tensor.ac", 1);
    uint64_t k = find_bytes(d, n, "key.u32") + 7;
    uint64_t arr = find_bytes(d, n, "key.strs") + 8 + 4;
    free(d);
    patched_error("ttype.gguf", e.type, 77, 4,
                  "tensor 'tensor.ac': type id 77 is not a known ggml type", NULL);
    patched_error("ttype_retired.gguf", e.type, 4, 4, "type id 4 is not a known ggml type", NULL);
    patched_error("vtype.gguf", k, 13, 4, "key 'key.u32': value type 13 is not a GGUF value type",
                  NULL);
    patched_error("etype.gguf", arr, 99, 4, "array element type 99", "key.strs");
}

static void bad_offsets(void **state) {
    (void)state;
    size_t n;
    uint8_t *d = write_small(tmp_path("small.gguf"), &n);
    entry_pos e = small_entry(d, n, "tensor.ab", 2);
    free(d);
    patched_error("misaligned.gguf", e.offset, 64 + 4, 8,
                  "tensor 'tensor.ab': data offset 68 is not a multiple of the alignment 32", NULL);
    patched_error("overlap.gguf", e.offset, 0, 8, "overlaps tensor 'tensor.aa'", "tensor.ab");
    patched_error("pasteof.gguf", e.offset, 1u << 20, 8, "tensor 'tensor.ab'",
                  "runs past the end of the file");
    patched_error("offset_overflow.gguf", e.offset, UINT64_MAX - 31, 8, "overflows", "tensor.ab");
}

static void bad_alignment(void **state) {
    (void)state;
    const uint32_t bad[] = {0, 3, 48};
    for (size_t i = 0; i < 3; i++) {
        moe_gguf_writer *w = moe_gguf_writer_new();
        moe_gguf_writer_set_alignment(w, bad[i]);
        const char *p = tmp_path("align.gguf");
        moe_error err = {0};
        assert_int_equal(moe_gguf_writer_write(w, p, 0, &err), MOE_OK);
        moe_gguf_writer_free(w);
        char want[64];
        snprintf(want, sizeof want, "general.alignment is %u, expected a power of two", bad[i]);
        expect_open_error(p, want, NULL);
    }
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.alignment", "32");
    const char *p = tmp_path("align_str.gguf");
    moe_error err = {0};
    assert_int_equal(moe_gguf_writer_write(w, p, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);
    expect_open_error(p, "general.alignment has type string, expected u32", NULL);
}

static void not_gguf(void **state) {
    (void)state;
    patched_error("magic.gguf", 0, 'G' | 'G' << 8 | 'M' << 16 | 'L' << 24, 4,
                  "expected the GGUF magic \"GGUF\", found \"GGML\"", "byte 0");
    const char *p = tmp_path("text.gguf");
    const char *text = "This is a text file.\nIt is not a model.\n";
    write_bytes(p, text, strlen(text));
    expect_open_error(p, "not a GGUF file", "found \"This\"");
    p = tmp_path("empty.gguf");
    write_bytes(p, "", 0);
    expect_open_error(p, "empty file", NULL);
    moe_error err = {0};
    assert_null(moe_gguf_open(tmp_path("absent.gguf"), &err));
    assert_int_equal(err.code, MOE_ERR_IO);
    moe_error_clear(&err);
    assert_null(moe_gguf_open(moe_test_tmpdir(), &err)); /* a directory */
    assert_int_equal(err.code, MOE_ERR_IO);
}

/* Names with newlines and quotes stay on one line in messages; nesting deeper than the cap
 * is refused before it can spend the stack. */
static void hostile_names_and_nesting(void **state) {
    (void)state;
    moe_gguf_writer *w = moe_gguf_writer_new();
    float x[1] = {0};
    int64_t ne = 1;
    moe_error err = {0};
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "evil\nname'", MOE_TYPE_F32, 1, &ne, x, true, &err), MOE_OK);
    const char *p = tmp_path("evil.gguf");
    assert_int_equal(moe_gguf_writer_write(w, p, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);
    size_t n;
    uint8_t *d = read_whole(p, &n);
    uint64_t type_at = find_bytes(d, n, "evil\nname'") + 10 + 4 + 8;
    put_le(d + type_at, 200, 4);
    write_bytes(p, d, n);
    free(d);
    expect_open_error(p, "tensor 'evil\\x0aname\\'': type id 200", NULL);

    /* arrays nested MOE_GGUF_MAX_NEST deep are fine, one more is not */
    for (int depth = MOE_GGUF_MAX_NEST; depth <= MOE_GGUF_MAX_NEST + 1; depth++) {
        moe_gguf_value levels[MOE_GGUF_MAX_NEST + 1];
        uint8_t leaf[1] = {42};
        levels[0] = (moe_gguf_value){.type = MOE_GGUF_ARRAY, .arr = {MOE_GGUF_U8, 1, leaf}};
        for (int i = 1; i < depth; i++)
            levels[i] = (moe_gguf_value){.type = MOE_GGUF_ARRAY,
                                         .arr = {MOE_GGUF_ARRAY, 1, &levels[i - 1]}};
        w = moe_gguf_writer_new();
        moe_gguf_writer_set_value(w, "deep", &levels[depth - 1]);
        p = tmp_path("deep.gguf");
        assert_int_equal(moe_gguf_writer_write(w, p, 0, &err), MOE_OK);
        moe_gguf_writer_free(w);
        if (depth == MOE_GGUF_MAX_NEST) {
            moe_gguf_close(open_ok(p));
        } else {
            expect_open_error(p, "key 'deep': arrays nested deeper than the limit 8", NULL);
        }
    }
}

/* Every regression input from fuzzing parses to a clean error or a model, never a crash. */
static void fuzz_regressions(void **state) {
    (void)state;
    const char *dir = "tests/data/gguf";
    DIR *dp = opendir(dir);
    if (!dp) fail_msg("%s is missing (run from the project root)", dir);
    struct dirent *de;
    int files = 0;
    while ((de = readdir(dp))) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "README") == 0 || strstr(de->d_name, ".md"))
            continue;
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        size_t n;
        uint8_t *d = read_whole(p, &n);
        uint8_t *exact = moe_xmalloc(n ? n : 1);
        memcpy(exact, d, n);
        moe_error err = {0};
        moe_gguf *g = moe_gguf_parse(exact, n, true, &err);
        if (!g) {
            assert_int_not_equal(err.code, MOE_OK);
            assert_null(strchr(err.msg, '\n'));
        }
        moe_gguf_close(g);
        moe_error_clear(&err);
        g = moe_gguf_open(p, &err);
        moe_gguf_close(g);
        free(exact);
        free(d);
        files++;
    }
    closedir(dp);
    print_message("[          ] %d regression inputs\n", files);
}

int moe_suite_gguf(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(shared_files_reconcile),
        cmocka_unit_test(parity_tensor_lists),
        cmocka_unit_test(roundtrip_every_value_type),
        cmocka_unit_test(roundtrip_shared_model_bytes),
        cmocka_unit_test(split_three_shards),
        cmocka_unit_test(split_inconsistent),
        cmocka_unit_test(to_memory_refuses_a_changed_file),
        cmocka_unit_test(version_2_reads_version_1_refused),
        cmocka_unit_test(truncated_at_every_byte),
        cmocka_unit_test(flipped_counts),
        cmocka_unit_test(absurd_dimensions),
        cmocka_unit_test(duplicates),
        cmocka_unit_test(unknown_types),
        cmocka_unit_test(bad_offsets),
        cmocka_unit_test(bad_alignment),
        cmocka_unit_test(not_gguf),
        cmocka_unit_test(hostile_names_and_nesting),
        cmocka_unit_test(fuzz_regressions),
    };
    return cmocka_run_group_tests_name("gguf", tests, NULL, NULL);
}
