/* Suite "dump": `moe dump` writes ggml's own dequantized floats. Every type's blocks from
 * ../shared/quant go into a GGUF through our writer; the command's float32 output must equal
 * <TYPE>.f32 (ggml's to_float) bit for bit, for all rows and for a row range. */
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/format/format.h"

static void dump_one(const char *type_name, int64_t row_len, int64_t n_rows) {
    char rel[128], gguf[512], out[512], cmd[2048];
    size_t n_blocks, n_ref;
    snprintf(rel, sizeof rel, "quant/%s.blocks", type_name);
    uint8_t *blocks = moe_test_shared_read(rel, &n_blocks);
    snprintf(rel, sizeof rel, "quant/%s.f32", type_name);
    uint8_t *ref = moe_test_shared_read(rel, &n_ref);
    moe_type type;
    assert_true(moe_type_from_name(type_name, &type));
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "none");
    const int64_t ne[2] = {row_len, n_rows};
    moe_error err = {0};
    assert_int_equal(moe_gguf_writer_add_tensor(w, "weights", type, 2, ne, blocks, true, &err),
                     MOE_OK);
    snprintf(gguf, sizeof gguf, "%s/dump-%s.gguf", moe_test_tmpdir(), type_name);
    assert_int_equal(moe_gguf_writer_write(w, gguf, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);

    /* all rows, then rows 3..5 */
    for (int part = 0; part < 2; part++) {
        snprintf(out, sizeof out, "%s/dump-%s-%d.f32", moe_test_tmpdir(), type_name, part);
        snprintf(cmd, sizeof cmd, "%s dump %s weights %s --out %s", moe_test_bin(), gguf,
                 part ? "--rows 3:6" : "", out);
        char *log;
        if (moe_test_run(cmd, &log) != 0) fail_msg("%s: %s", cmd, log);
        free(log);
        uint8_t *got;
        size_t n_got;
        assert_int_equal(moe_file_read(out, &got, &n_got, &err), MOE_OK);
        const size_t row_bytes = sizeof(float) * (size_t)row_len;
        const size_t offset = part ? 3 * row_bytes : 0, want = part ? 3 * row_bytes : n_ref;
        assert_int_equal(n_got, want);
        if (memcmp(got, ref + offset, want) != 0)
            fail_msg("%s: dump differs from ggml's floats", type_name);
        free(got);
    }
    free(blocks);
    free(ref);
}

static void dump_is_ggml_exact(void **state) {
    (void)state;
    const char *manifest = moe_test_shared("quant/MANIFEST.json");
    MOE_SKIP_IF_NULL(manifest);
    json_error_t jerr;
    json_t *root = json_load_file(manifest, 0, &jerr);
    assert_non_null(root);
    json_t *types = json_object_get(root, "types"), *t;
    size_t i, n = 0;
    json_array_foreach(types, i, t) {
        dump_one(json_string_value(json_object_get(t, "type")),
                 json_integer_value(json_object_get(t, "row_len")),
                 json_integer_value(json_object_get(t, "n_rows")));
        n++;
    }
    print_message("dump: %zu types bit-exact with ggml\n", n);
    assert_true(n >= 22);
    json_decref(root);
}

static void dump_errors(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s dump %s no.such.tensor", moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "no tensor named 'no.such.tensor'"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s dump %s token_embd.weight --rows 500:600", moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--rows expects"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s dump %s output_norm.weight", moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "row 0:"));
    free(out);
}

int moe_suite_dump(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(dump_is_ggml_exact),
        cmocka_unit_test(dump_errors),
    };
    return cmocka_run_group_tests_name("dump", tests, NULL, NULL);
}
