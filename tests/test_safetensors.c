/* Suite "safetensors": the reader against numpy's reading of the same file (tests/
 * qat_checkpoint.py writes a tensor of every dtype and their values as float32, converted by
 * numpy or, for bf16 and F8_E4M3, decoded in Python from the bit layouts), FP8 with block
 * scales, sharded checkpoints through model.safetensors.index.json, malformed files refused with
 * a message naming what and where, the writer read back by the Python reader, and `moe inspect`
 * on a checkpoint (its reconciliation line; --json parsed by Python's json module). */
#include "testutil.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/format/format.h"

#define PY "/usr/bin/python3 tests/qat_checkpoint.py"

static moe_st *open_ok(const char *path) {
    moe_error err = {0};
    moe_st *s = moe_st_open(path, &err);
    if (!s) fail_msg("%s", err.msg);
    return s;
}

/* ==== Values of every dtype against numpy ==== */

static void dtypes_match_numpy(void **state) {
    (void)state;
    char path[512], f32[512], cmd[1200];
    snprintf(path, sizeof path, "%s/dtypes.safetensors", moe_test_tmpdir());
    snprintf(f32, sizeof f32, "%s/dtypes.f32", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, PY " dtypes '%s' '%s'", path, f32);
    moe_test_run_ok(cmd);
    moe_st *s = open_ok(path);
    uint8_t *expect;
    size_t size;
    moe_error err = {0};
    assert_int_equal(moe_file_read(f32, &expect, &size, &err), MOE_OK);
    /* the Python writer's order is the data order, which the reader keeps */
    static const char *const names[] = {"f32", "f16", "bf16", "f64", "f8_e4m3", "i8",
                                        "u8",  "i16", "i32",  "i64", "scalar",  "empty"};
    static const moe_st_dtype dtypes[] = {MOE_ST_F32,     MOE_ST_F16, MOE_ST_BF16, MOE_ST_F64,
                                          MOE_ST_F8_E4M3, MOE_ST_I8,  MOE_ST_U8,   MOE_ST_I16,
                                          MOE_ST_I32,     MOE_ST_I64, MOE_ST_F32,  MOE_ST_F32};
    assert_int_equal(moe_st_n_tensors(s), 12);
    size_t at = 0;
    for (size_t i = 0; i < 12; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        assert_string_equal(t->name, names[i]);
        assert_ptr_equal(moe_st_tensor_find(s, names[i]), t);
        assert_int_equal(t->dtype, dtypes[i]);
        float *v = malloc(t->n_values * sizeof *v + 4);
        assert_int_equal(moe_st_to_f32(t, 0, t->n_values, v, &err), MOE_OK);
        assert_true((at + t->n_values) * 4 <= size);
        for (uint64_t k = 0; k < t->n_values; k++) {
            float e;
            memcpy(&e, expect + 4 * (at + k), 4);
            if (memcmp(&e, &v[k], 4) != 0)
                fail_msg("%s[%" PRIu64 "]: moe %g, numpy %g", names[i], k, (double)v[k], (double)e);
        }
        at += t->n_values;
        free(v);
    }
    assert_int_equal(at * 4, size);
    const moe_st_tensor *f16 = moe_st_tensor_find(s, "f16");
    assert_int_equal(f16->n_dims, 3);
    assert_int_equal(f16->shape[0], 2);
    assert_int_equal(f16->shape[2], 4);
    assert_int_equal(moe_st_tensor_find(s, "scalar")->n_dims, 0);
    assert_int_equal(moe_st_tensor_find(s, "empty")->n_bytes, 0);
    assert_string_equal(moe_st_meta_find(s, "note"), "dtypes");
    assert_null(moe_st_tensor_find(s, "__metadata__"));
    /* a range past the end is refused, not read */
    float x;
    assert_int_equal(moe_st_to_f32(f16, 24, 1, &x, &err), MOE_ERR_ARG);
    free(expect);
    moe_st_close(s);
}

/* FP8 with block scales: w [5, 6] E4M3 and scale_inv [3, 2] for 2 x 4 blocks (partial blocks at
 * both edges), against values worked out by hand from the E4M3 table. */
static void fp8_block_scales(void **state) {
    (void)state;
    /* 0x38 = 1.0, 0x40 = 2.0, 0xb8 = -1.0, 0x01 = 2^-9 (subnormal), 0x7e = 448 (largest) */
    static const uint8_t codes[5] = {0x38, 0x40, 0xb8, 0x01, 0x7e};
    static const float values[5] = {1.0f, 2.0f, -1.0f, 0x1p-9f, 448.0f};
    for (int i = 0; i < 5; i++) assert_true(moe_f8_e4m3_to_f32(codes[i]) == values[i]);
    assert_true(isnan(moe_f8_e4m3_to_f32(0x7f)));
    uint8_t w[30];
    float scale[6] = {1, 2, 3, 4, 5, 6}, out[30];
    for (int i = 0; i < 30; i++) w[i] = codes[i % 5];
    moe_st_tensor tw = {.name = "w",
                        .dtype = MOE_ST_F8_E4M3,
                        .n_dims = 2,
                        .shape = {5, 6},
                        .n_values = 30,
                        .n_bytes = 30,
                        .data = w};
    moe_st_tensor ts = {.name = "w_scale_inv",
                        .dtype = MOE_ST_F32,
                        .n_dims = 2,
                        .shape = {3, 2},
                        .n_values = 6,
                        .n_bytes = 24,
                        .data = (const uint8_t *)scale};
    moe_error err = {0};
    assert_int_equal(moe_st_dequant_fp8_blocks(&tw, &ts, 2, 4, out, &err), MOE_OK);
    for (int r = 0; r < 5; r++)
        for (int c = 0; c < 6; c++)
            assert_true(out[r * 6 + c] == values[(r * 6 + c) % 5] * scale[(r / 2) * 2 + c / 4]);
    ts.shape[0] = 2; /* a scale grid that does not fit the blocks */
    assert_int_equal(moe_st_dequant_fp8_blocks(&tw, &ts, 2, 4, out, &err), MOE_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "should be [3, 2]"));
}

/* ==== Malformed files ==== */

/* A file from a header text (length prefix added) and n_data zero bytes after it. */
static moe_st *parse_text(const char *header, size_t n_data, uint64_t claimed_len, moe_error *err) {
    size_t hl = strlen(header);
    uint8_t *buf = calloc(1, 8 + hl + n_data + 1);
    uint64_t len = claimed_len ? claimed_len : hl;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(len >> (8 * i));
    memcpy(buf + 8, header, hl);
    moe_st *s = moe_st_parse(buf, 8 + hl + n_data, "bad.safetensors", err);
    /* tensors point into buf: a test that keeps s must not free it first */
    if (s) moe_st_close(s);
    free(buf);
    return s;
}

static void malformed_refused(void **state) {
    (void)state;
    static const struct {
        const char *header;
        size_t data;
        uint64_t claimed;
        const char *msg;
    } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1u << 30,
         "more than the limit"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1000,
         "runs past the end of the file"},
        {"[1, 2]", 0, 0, "not a JSON object"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2], ", 0, 0, "header JSON at byte"},
        {"{\"a\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 0,
         "unknown dtype 'F31'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, 0,
         "hold 8 bytes, shape x F32 needs 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, 0,
         "0 <= begin <= end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, 0,
         "dimension 0 is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, 0, "overlaps the tensor before it"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
         20, 0, "leaving a gap after byte 8"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, 0,
         "runs past the end of the file (data section 4 bytes)"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, 0,
         "cover 8 data bytes but the file holds 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8, 0, "duplicate"},
        {"{\"__metadata__\":{\"k\":1}}", 0, 0, "__metadata__ 'k' is not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 0, 0, "needs \"dtype\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, 0,
         "expected exactly dtype, shape, data_offsets"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,4294967296],"
         "\"data_offsets\":[0,8]}}",
         8, 0, "shape overflows"},
        {"{\"a\\u0001b\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 0,
         "tensor 'a\\x01b': unknown dtype 'F31'"},
        {"{\"a_long_tensor_name_that_fills_more_of_the_message_buffer_than_one_hundred_and_four_"
         "bytes_0123456789\":{\"dtype\":\"Q9\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8, 0,
         "tensor 'a_long_tensor_name_that_fills_more_of_the_message_buffer_than_one_hundred_"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_error err = {0};
        moe_st *s = parse_text(cases[i].header, cases[i].data, cases[i].claimed, &err);
        if (s) fail_msg("case %zu accepted: %s", i, cases[i].header);
        assert_int_not_equal(err.code, MOE_OK);
        if (!strstr(err.msg, cases[i].msg))
            fail_msg("case %zu: message '%s' lacks '%s'", i, err.msg, cases[i].msg);
        assert_non_null(strstr(err.msg, "bad.safetensors"));
        assert_null(strchr(err.msg, '\n'));
    }
    moe_error err = {0};
    assert_null(moe_st_parse("\x02\0\0", 3, "tiny", &err));
    assert_non_null(strstr(err.msg, "too short for the 8-byte header length"));
    /* a well-formed file with two tensors parses */
    moe_error ok = {0};
    static const char good[] = "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                               "\"a\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8]}}";
    size_t hl = strlen(good);
    uint8_t *buf = calloc(1, 8 + hl + 16);
    buf[0] = (uint8_t)hl;
    memcpy(buf + 8, good, hl);
    moe_st *s = moe_st_parse(buf, 8 + hl + 16, "good", &ok);
    assert_non_null(s);
    assert_string_equal(moe_st_tensor_get(s, 0)->name, "a"); /* data order */
    assert_int_equal(moe_st_tensor_get(s, 1)->file_offset, 8 + hl + 8);
    moe_st_close(s);
    free(buf);
}

/* ==== Sharded checkpoints ==== */

/* A fresh QAT checkpoint (two shards and an index) at <tmpdir>/<name>; its path into dir. */
static void make_checkpoint(const char *name, char *dir, size_t cap) {
    char cmd[1200];
    snprintf(dir, cap, "%s/%s", moe_test_tmpdir(), name);
    snprintf(cmd, sizeof cmd, PY " qat '%s'", dir);
    moe_test_run_ok(cmd);
}

static void sharded_checkpoint(void **state) {
    (void)state;
    char dir[512], cmd[4096];
    make_checkpoint("shards", dir, sizeof dir);
    moe_st *s = open_ok(dir);
    assert_int_equal(moe_st_n_files(s), 2);
    assert_int_equal(moe_st_n_tensors(s), 134);
    const moe_st_tensor *t =
        moe_st_tensor_find(s, "model.language_model.layers.5.experts.down_proj");
    assert_non_null(t);
    assert_int_equal(t->file, 1);
    assert_int_equal(t->shape[0], 8);
    assert_int_equal(t->dtype, MOE_ST_BF16);
    moe_st_close(s);
    /* the index by its own path opens the same checkpoint */
    snprintf(cmd, sizeof cmd, "%s/model.safetensors.index.json", dir);
    s = open_ok(cmd);
    assert_int_equal(moe_st_n_tensors(s), 134);
    moe_st_close(s);
    /* an index naming a tensor no shard holds */
    char bad[512], idx[600];
    snprintf(bad, sizeof bad, "%s/badindex", moe_test_tmpdir());
    snprintf(
        cmd, sizeof cmd,
        "mkdir -p '%s' && cp '%s'/*.safetensors '%s'/ && /usr/bin/python3 -c 'import json,sys\n"
        "d=json.load(open(sys.argv[1]))\nd[\"weight_map\"][\"ghost.weight\"]=\"model-00001-of-"
        "00002.safetensors\"\n"
        "json.dump(d,open(sys.argv[2],\"w\"))' '%s/model.safetensors.index.json' "
        "'%s/model.safetensors.index.json'",
        bad, dir, bad, dir, bad);
    moe_test_run_ok(cmd);
    moe_error err = {0};
    assert_null(moe_st_open(bad, &err));
    assert_non_null(strstr(err.msg, "weight_map['ghost.weight']"));
    assert_non_null(strstr(err.msg, "no shard holds that tensor"));
    /* a directory without a checkpoint */
    snprintf(idx, sizeof idx, "%s", moe_test_tmpdir());
    moe_error e2 = {0};
    assert_null(moe_st_open(idx, &e2));
    assert_non_null(strstr(e2.msg, "without model.safetensors.index.json"));
}

/* ==== The writer, read back by Python ==== */

static void writer_read_by_python(void **state) {
    (void)state;
    char path[512], cmd[1200];
    snprintf(path, sizeof path, "%s/written.safetensors", moe_test_tmpdir());
    moe_st_writer *w = moe_st_writer_new();
    moe_error err = {0};
    moe_st_writer_set_meta(w, "format", "pt");
    moe_st_writer_set_meta(w, "made_by", "moe test");
    assert_int_equal(moe_st_writer_declare(w, "w.f32", MOE_ST_F32, 2, (int64_t[]){4, 6}, &err),
                     MOE_OK);
    assert_int_equal(moe_st_writer_declare(w, "w.bf16", MOE_ST_BF16, 1, (int64_t[]){3}, &err),
                     MOE_OK);
    assert_int_equal(moe_st_writer_declare(w, "w.i32", MOE_ST_I32, 1, (int64_t[]){5}, &err),
                     MOE_OK);
    assert_int_equal(moe_st_writer_declare(w, "w.i32", MOE_ST_I32, 1, (int64_t[]){5}, &err),
                     MOE_ERR_ARG);
    assert_int_equal(moe_st_writer_begin(w, path, &err), MOE_OK);
    float f[24];
    for (int i = 0; i < 24; i++) f[i] = (float)i;                  /* sum 276 */
    uint16_t b[3] = {0x3f80, 0x4000, 0xc040};                      /* 1, 2, -3 */
    int32_t k[5] = {-7, 100, 1 << 20, 3, 0};                       /* sum 1048672 */
    assert_int_equal(moe_st_writer_write(w, f, 40, &err), MOE_OK); /* any chunks */
    assert_int_equal(moe_st_writer_write(w, (uint8_t *)f + 40, 56, &err), MOE_OK);
    assert_int_equal(moe_st_writer_write(w, b, 6, &err), MOE_OK);
    assert_int_equal(moe_st_writer_write(w, k, 20, &err), MOE_OK);
    assert_int_equal(moe_st_writer_write(w, k, 1, &err), MOE_ERR_ARG); /* more than declared */
    assert_int_equal(moe_st_writer_finish(w, &err), MOE_OK);
    moe_st_writer_free(w);
    snprintf(cmd, sizeof cmd, PY " read '%s'", path);
    char *out = NULL;
    assert_int_equal(moe_test_run(cmd, &out), 0);
    const char *want = "{\"format\": \"pt\", \"made_by\": \"moe test\"}\n"
                       "w.bf16 BF16 [3] 0.0\n"
                       "w.f32 F32 [4, 6] 276.0\n"
                       "w.i32 I32 [5] 1048672.0\nok\n";
    assert_string_equal(out, want);
    free(out);
    /* and our reader agrees with the header's padding and offsets */
    moe_st *s = open_ok(path);
    assert_int_equal((moe_st_file_get(s, 0)->header_bytes - 8) % 8, 0);
    assert_int_equal(moe_st_n_tensors(s), 3);
    moe_st_close(s);
}

/* ==== moe inspect on a checkpoint ==== */

static void inspect_checkpoint(void **state) {
    (void)state;
    char dir[512], cmd[1400];
    make_checkpoint("inspect-ckpt", dir, sizeof dir);
    moe_st *s = open_ok(dir);
    uint64_t tensor = 0, header = 0, file = 0;
    for (uint32_t i = 0; i < moe_st_n_files(s); i++) {
        const moe_st_file *f = moe_st_file_get(s, i);
        tensor += f->tensor_bytes;
        header += f->header_bytes;
        file += f->file_size;
    }
    moe_st_close(s);
    char *out = NULL;
    snprintf(cmd, sizeof cmd, "%s inspect '%s'", moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    char line[256];
    snprintf(line, sizeof line,
             "reconciles: tensor bytes %" PRIu64 " + header %" PRIu64
             " + padding 0 = file size %" PRIu64 " (all shards)",
             tensor, header, file);
    if (!strstr(out, line)) fail_msg("no '%s' in:\n%s", line, out);
    assert_non_null(strstr(out, "routed experts: experts.gate_up_proj/experts.down_proj BF16 in "
                                "layers 0-5 (6)"));
    free(out);
    /* --json: Python's json module counts the tensors and checks the totals */
    snprintf(
        cmd, sizeof cmd,
        "%s inspect '%s' --json | python3 -c 'import json,sys\nd=json.load(sys.stdin)\n"
        "t=d[\"totals\"]\nassert d[\"format\"]==\"safetensors\" and len(d[\"tensors\"])==134\n"
        "assert t[\"reconciles\"] and t[\"tensor_bytes\"]+t[\"header_bytes\"]==t[\"file_bytes\"]\n"
        "assert sum(x[\"bytes\"] for x in d[\"tensors\"])==t[\"tensor_bytes\"]\nprint(\"ok\")'",
        moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_string_equal(out, "ok\n");
    free(out);
}

/* Files under tests/data/safetensors (fuzz seeds and past crashes) parse or fail cleanly. */
static void replay_data_files(void **state) {
    (void)state;
    char *out = NULL;
    assert_int_equal(moe_test_run("ls tests/data/safetensors", &out), 0);
    int n = 0;
    for (char *name = strtok(out, "\n"); name; name = strtok(NULL, "\n"), n++) {
        char path[512];
        snprintf(path, sizeof path, "tests/data/safetensors/%s", name);
        uint8_t *data;
        size_t size;
        moe_error err = {0};
        assert_int_equal(moe_file_read(path, &data, &size, &err), MOE_OK);
        moe_st *s = moe_st_parse(data, size, path, &err);
        if (s)
            moe_st_close(s);
        else
            assert_null(strchr(err.msg, '\n'));
        free(data);
    }
    assert_true(n >= 1);
    free(out);
}

int moe_suite_safetensors(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(dtypes_match_numpy),    cmocka_unit_test(fp8_block_scales),
        cmocka_unit_test(malformed_refused),     cmocka_unit_test(sharded_checkpoint),
        cmocka_unit_test(writer_read_by_python), cmocka_unit_test(inspect_checkpoint),
        cmocka_unit_test(replay_data_files),
    };
    return cmocka_run_group_tests_name("safetensors", tests, NULL, NULL);
}
