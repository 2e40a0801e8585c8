/* Suite "repack": `moe repack` on synthetic QAT checkpoints written by tests/qat_checkpoint.py
 * (numpy): groups whose peak sits at every level 1..8 (and all-zero groups), groups moved off
 * the grid, non-quantized tensors. The Python script checks the outputs with its own readers:
 * every stored level equals the generating level, scale x level gives the source value, copies
 * are byte-identical, the W4A16 quantization_config, and for the Q4_0 GGUF the tensor names,
 * shapes, types and metadata of the llama.cpp-made gemma4 fixture. Here: the report's counts
 * against the generator's, `--verify` passing, a corrupted output byte making it fail naming
 * the tensor and group, the grid arithmetic on hand-made groups, and errors. */
#include "testutil.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/format/format.h"

#define PY "/usr/bin/python3 tests/qat_checkpoint.py"
/* The checkpoint's directory name is the fixture's general.name: the converter (and moe repack)
 * name the model after the directory. */
#define CKPT_NAME "synth-shared-gemma4-moe-f32"

static int run(const char *cmd, char **out) {
    return moe_test_run(cmd, out);
}

/* The QAT checkpoint with off-grid groups, made once per process. */
static const char *checkpoint(void) {
    static char dir[512];
    if (dir[0]) return dir;
    char cmd[1200];
    snprintf(dir, sizeof dir, "%s/qat/" CKPT_NAME, moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/qat' && " PY " qat '%s' --offgrid --seed 11",
             moe_test_tmpdir(), dir);
    moe_test_run_ok(cmd);
    return dir;
}

static json_t *load_json_text(const char *text) {
    json_error_t je;
    const char *brace = strchr(text, '{');
    json_t *j = brace ? json_loads(brace, 0, &je) : NULL;
    if (!j) fail_msg("not JSON: %s", text);
    return j;
}

static json_t *load_json_file(const char *path) {
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) fail_msg("%s: %s", path, je.text);
    return j;
}

/* moe repack's JSON report against the generator's expected.json. */
static void check_report(json_t *report, json_t *expect) {
    assert_int_equal(json_integer_value(json_object_get(report, "groups")),
                     json_integer_value(json_object_get(expect, "groups")));
    json_t *by_m = json_object_get(report, "groups_by_m"),
           *want = json_object_get(expect, "groups_by_m");
    for (int m = 0; m <= 8; m++) {
        char k[2] = {(char)('0' + m), 0};
        if (json_integer_value(json_object_get(by_m, k)) !=
            json_integer_value(json_array_get(want, (size_t)m)))
            fail_msg("groups recovered with m=%d: moe %lld, generated %lld", m,
                     (long long)json_integer_value(json_object_get(by_m, k)),
                     (long long)json_integer_value(json_array_get(want, (size_t)m)));
    }
    assert_int_equal(json_integer_value(json_object_get(report, "offgrid_groups")),
                     json_integer_value(json_object_get(expect, "offgrid_groups")));
    json_t *off = json_object_get(report, "offgrid_tensors");
    json_t *off_want = json_object_get(expect, "offgrid_tensors");
    assert_int_equal(json_array_size(off), json_object_size(off_want));
    for (size_t i = 0; i < json_array_size(off); i++) {
        json_t *o = json_array_get(off, i);
        json_t *groups = json_object_get(off_want, json_string_value(json_object_get(o, "name")));
        if (!groups)
            fail_msg("off-grid tensor %s not generated so",
                     json_string_value(json_object_get(o, "name")));
        assert_int_equal(json_integer_value(json_object_get(o, "groups")), json_array_size(groups));
        assert_int_equal(json_integer_value(json_object_get(o, "first_group")),
                         json_integer_value(json_array_get(groups, 0)));
    }
}

/* Flip bits of byte `at` of file `path` (xor mask), in place. */
static void flip_byte(const char *path, uint64_t at, uint8_t mask) {
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, (long)at, SEEK_SET), 0);
    int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, (long)at, SEEK_SET), 0);
    fputc(c ^ mask, f);
    fclose(f);
}

/* --verify fails on a corrupted byte, naming `expect`; passes again once restored. */
static void verify_catches(const char *src, const char *out, const char *file, uint64_t at,
                           uint8_t mask, const char *expect) {
    char cmd[2048];
    char *text = NULL;
    snprintf(cmd, sizeof cmd, "%s repack --verify '%s' '%s'", moe_test_bin(), src, out);
    flip_byte(file, at, mask);
    int rc = run(cmd, &text);
    flip_byte(file, at, mask);
    if (rc != 1) fail_msg("verify of a corrupted output exited %d: %s", rc, text);
    if (!strstr(text, expect)) fail_msg("verify output lacks \"%s\":\n%s", expect, text);
    free(text);
    moe_test_run_ok(cmd);
}

/* moe repack SRC <tmpdir>/qat/<name> --to <to>, its report checked against the generator's
 * counts; the output path into out. Returns the report (the caller decrefs). */
static json_t *repack_checked(const char *src, const char *name, const char *to, char *out,
                              size_t cap) {
    char cmd[2048], path[700];
    snprintf(out, cap, "%s/qat/%s", moe_test_tmpdir(), name);
    snprintf(cmd, sizeof cmd, "%s repack '%s' '%s' --to %s --workers 2 --json", moe_test_bin(), src,
             out, to);
    char *text = NULL;
    if (run(cmd, &text) != 0) fail_msg("%s", text);
    json_t *report = load_json_text(text);
    free(text);
    snprintf(path, sizeof path, "%s/expected.json", src);
    json_t *expect = load_json_file(path);
    check_report(report, expect);
    json_decref(expect);
    return report;
}

static void w4a16(void **state) {
    (void)state;
    const char *src = checkpoint();
    char out[600], cmd[8192], path[700];
    char *text = NULL;
    json_decref(repack_checked(src, "w4a16", "w4a16", out, sizeof out));

    snprintf(cmd, sizeof cmd, PY " check-w4a16 '%s' '%s'", src, out);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, "%s repack --verify '%s' '%s' --json", moe_test_bin(), src, out);
    assert_int_equal(run(cmd, &text), 0);
    json_t *v = load_json_text(text);
    free(text);
    assert_true(json_is_true(json_object_get(v, "ok")));
    assert_int_equal(json_integer_value(json_object_get(v, "bad_groups")), 0);
    json_decref(v);

    /* the same in shards of at most 100 kB, with model.safetensors.index.json */
    char sharded[700];
    snprintf(sharded, sizeof sharded, "%s/qat/w4a16-sharded", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s repack '%s' '%s' --to w4a16 --max-shard-size 100KB --no-progress && "
             "test -f '%s/model-00005-of-00005.safetensors' && " PY " check-w4a16 '%s' '%s' && "
             "%s repack --verify '%s' '%s'",
             moe_test_bin(), src, sharded, sharded, src, sharded, moe_test_bin(), src, sharded);
    moe_test_run_ok(cmd);

    /* moe dump of a module equals compressed-tensors' decompression (numpy) */
    const char *dmod = "model.language_model.layers.4.experts.6.gate_proj";
    char f_moe[700], f_py[700];
    snprintf(f_moe, sizeof f_moe, "%s/dump.moe.f32", moe_test_tmpdir());
    snprintf(f_py, sizeof f_py, "%s/dump.py.f32", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s dump '%s' %s.weight --out '%s'", moe_test_bin(), out, dmod,
             f_moe);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, PY " dequant-w4a16 '%s' %s '%s' && cmp '%s' '%s'", out, dmod, f_py,
             f_moe, f_py);
    moe_test_run_ok(cmd);
    moe_error cerr = {0};
    assert_int_equal(moe_w4a16_config_check(out, &cerr), MOE_OK);
    assert_int_equal(moe_w4a16_config_check(src, &cerr), MOE_ERR_UNSUPPORTED);
    assert_non_null(strstr(cerr.msg, "quantization_config is not compressed-tensors"));

    /* corrupt group 3 of one module's levels, then one byte of a copied tensor */
    moe_error err = {0};
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    moe_st *o = moe_st_open(path, &err);
    if (!o) fail_msg("%s", err.msg);
    const char *mod = "model.language_model.layers.3.experts.5.up_proj.weight_packed";
    const moe_st_tensor *t = moe_st_tensor_find(o, mod);
    assert_non_null(t);
    uint64_t packed_at = t->file_offset + 3 * 16 + 5;
    t = moe_st_tensor_find(o, "model.language_model.layers.2.router.proj.weight");
    assert_non_null(t);
    uint64_t copy_at = t->file_offset + 10;
    moe_st_close(o);
    char expect_msg[300];
    snprintf(expect_msg, sizeof expect_msg, "tensor '%s' group 3 ", mod);
    verify_catches(src, out, path, packed_at, 0x40, expect_msg);
    verify_catches(src, out, path, copy_at, 0x01,
                   "tensor 'model.language_model.layers.2.router.proj.weight' (copy of "
                   "'model.language_model.layers.2.router.proj.weight'): byte 10 (value 5)");
}

static void q4_0_gguf(void **state) {
    (void)state;
    const char *fixture = moe_test_shared("parity/gemma4-moe-q4_0.json");
    MOE_SKIP_IF_NULL(fixture);
    const char *src = checkpoint();
    char out[600], cmd[8192];
    json_t *report = repack_checked(src, "out.gguf", "q4_0-gguf", out, sizeof out);
    assert_int_equal(json_integer_value(json_object_get(report, "tensors_skipped")), 1);
    json_decref(report);

    snprintf(cmd, sizeof cmd, PY " check-gguf '%s' '%s' '%s'", src, out, fixture);
    moe_test_run_ok(cmd);
    /* with the fixture's tokenizer keys copied, every key and value is the fixture's */
    const char *fixture_gguf = moe_test_shared("parity/gemma4-moe-q4_0.gguf");
    char with_vocab[700];
    snprintf(with_vocab, sizeof with_vocab, "%s/qat/vocab.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s repack '%s' '%s' --to q4_0-gguf --vocab-from '%s' --no-progress && " PY
             " check-gguf '%s' '%s' '%s' --vocab",
             moe_test_bin(), src, with_vocab, fixture_gguf, src, with_vocab, fixture);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, "%s repack --verify '%s' '%s'", moe_test_bin(), src, out);
    moe_test_run_ok(cmd);

    /* the GGUF loads in our reader too, Q4_0 where the fixture has it */
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(out, &err);
    if (!g) fail_msg("%s", err.msg);
    const moe_tensor *t = moe_gguf_tensor_find(g, "blk.4.ffn_gate_up_exps.weight");
    assert_non_null(t);
    assert_int_equal(t->type, MOE_TYPE_Q4_0);
    uint64_t block_at = t->file_offset + 7 * 18 + 2 + 4; /* group 7, a byte of its levels */
    t = moe_gguf_tensor_find(g, "blk.0.attn_norm.weight");
    assert_int_equal(t->type, MOE_TYPE_F32);
    uint64_t norm_at = t->file_offset + 4 * 3 + 1; /* value 3 */
    moe_gguf_close(g);
    verify_catches(src, out, out, block_at, 0x10,
                   "tensor 'blk.4.ffn_gate_up_exps.weight' group 7 ");
    verify_catches(src, out, out, norm_at, 0x01,
                   "tensor 'blk.0.attn_norm.weight' (F32 of "
                   "'model.language_model.layers.0.input_layernorm."
                   "weight'): value 3");
}

/* With a tokenizer.json of 500 + 4 tokens, token_embd keeps its first 504 of 512 rows, as the
 * converter trims it; the rest of the file is unchanged (Python checks both against the
 * fixture), and verify accepts the trimmed copy. */
static void q4_0_gguf_trims_embeddings(void **state) {
    (void)state;
    const char *fixture = moe_test_shared("parity/gemma4-moe-q4_0.json");
    MOE_SKIP_IF_NULL(fixture);
    char src[600], out[700], cmd[4096];
    snprintf(src, sizeof src, "%s/qat-tok/" CKPT_NAME, moe_test_tmpdir());
    snprintf(out, sizeof out, "%s/qat-tok/out.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/qat-tok' && " PY " qat '%s' --tokenizer 500",
             moe_test_tmpdir(), src);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, "%s repack '%s' '%s' --to q4_0-gguf --json", moe_test_bin(), src,
             out);
    char *text = NULL;
    if (run(cmd, &text) != 0) fail_msg("%s", text);
    json_t *report = load_json_text(text);
    free(text);
    assert_int_equal(json_integer_value(json_object_get(report, "embd_rows_dropped")), 8);
    json_decref(report);
    snprintf(cmd, sizeof cmd, PY " check-gguf '%s' '%s' '%s' && %s repack --verify '%s' '%s'", src,
             out, fixture, moe_test_bin(), src, out);
    moe_test_run_ok(cmd);
}

/* The trap the recovery exists for, on hand-made groups: peak at level 5, step 0.25. */
static void grid_peak_not_at_8(void **state) {
    (void)state;
    int8_t lv[32], q[32];
    float w[32];
    for (int i = 0; i < 32; i++) {
        lv[i] = (int8_t)((i * 7) % 11 - 5); /* -5..5, peak 5 */
        w[i] = 0.25f * lv[i];
    }
    uint16_t scale;
    assert_int_equal(moe_grid_recover(w, 32, MOE_TYPE_F16, MOE_TYPE_BF16, &scale, q), 5);
    assert_int_equal(scale, 0x3400); /* 0.25 in f16 */
    assert_memory_equal(q, lv, 32);
    assert_int_equal(moe_grid_check(w, 32, MOE_TYPE_F16, MOE_TYPE_BF16, scale, q), -1);
    /* the textbook step max|w| / 8 = 0.15625 puts the values on a grid that does not hold them */
    uint16_t textbook = 0x3100; /* 0.15625 in f16 */
    int8_t tq[32];
    for (int i = 0; i < 32; i++) tq[i] = (int8_t)__builtin_roundf(w[i] / 0.15625f);
    assert_true(moe_grid_check(w, 32, MOE_TYPE_F16, MOE_TYPE_BF16, textbook, tq) >= 0);
    /* Q4_0 block and int4 packing round trips, in the documented bit layouts */
    uint8_t block[18], packed[16];
    moe_grid_q4_0_block(scale, q, block);
    assert_int_equal(block[0] | block[1] << 8, 0x3400);
    assert_int_equal(block[2], (uint8_t)((lv[0] + 8) | (lv[16] + 8) << 4));
    moe_grid_pack_int4(q, 32, packed);
    assert_int_equal(packed[0] & 15, lv[0] + 8); /* value 0 in the lowest nibble of word 0 */
    assert_int_equal(packed[3] >> 4, lv[7] + 8); /* value 7 in the highest */
    int8_t back[32];
    uint16_t s2;
    moe_grid_q4_0_levels(block, &s2, back);
    assert_memory_equal(back, lv, 32);
    moe_grid_unpack_int4(packed, 32, back);
    assert_memory_equal(back, lv, 32);
    /* off the grid: one value a third of a step away */
    w[9] = 0.25f * lv[9] + 0.0825f;
    assert_int_equal(moe_grid_recover(w, 32, MOE_TYPE_F16, MOE_TYPE_F32, &scale, q), -1);
    /* all zero: m = 0, scale 0 */
    float z[32] = {0};
    assert_int_equal(moe_grid_recover(z, 32, MOE_TYPE_BF16, MOE_TYPE_BF16, &scale, q), 0);
    assert_int_equal(scale, 0);
}

static void errors(void **state) {
    (void)state;
    char cmd[1400];
    char *text = NULL;
    snprintf(cmd, sizeof cmd, "%s repack '%s' /dev/null --to q8", moe_test_bin(), checkpoint());
    assert_int_equal(run(cmd, &text), 2);
    assert_non_null(strstr(text, "--to q8: q4_0-gguf or w4a16"));
    free(text);
    snprintf(cmd, sizeof cmd, "%s repack '%s/nothing' '%s/x.gguf' --to q4_0-gguf", moe_test_bin(),
             moe_test_tmpdir(), moe_test_tmpdir());
    assert_int_equal(run(cmd, &text), 1);
    assert_non_null(strstr(text, "nothing"));
    free(text);
    /* a vocabulary of another size than the embeddings */
    const char *spm = moe_test_shared("tokenizers/ggml-vocab-llama-spm.gguf");
    if (spm) {
        snprintf(cmd, sizeof cmd, "%s repack '%s' '%s/v.gguf' --to q4_0-gguf --vocab-from '%s'",
                 moe_test_bin(), checkpoint(), moe_test_tmpdir(), spm);
        assert_int_equal(run(cmd, &text), 1);
        assert_non_null(strstr(text, "32000 tokens, but token_embd has 512 rows"));
        free(text);
    }
    /* a llama checkpoint: GGUF names and metadata are mapped for gemma4 only */
    const char *tmp = moe_test_tmpdir();
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s/foreign' && " PY " dtypes '%s/foreign/model.safetensors' "
             "'%s/foreign/v.f32' && echo '{\"model_type\": \"llama\"}' > '%s/foreign/config.json'",
             tmp, tmp, tmp, tmp);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, "%s repack '%s/foreign' '%s/f.gguf' --to q4_0-gguf", moe_test_bin(),
             tmp, tmp);
    assert_int_equal(run(cmd, &text), 1);
    assert_non_null(strstr(text, "model_type 'llama': --to q4_0-gguf maps"));
    free(text);
    /* gemma4 by its config, with a tensor name the map does not know */
    snprintf(cmd, sizeof cmd, "echo '{\"model_type\": \"gemma4\"}' > '%s/foreign/config.json'",
             tmp);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, "%s repack '%s/foreign' '%s/f.gguf' --to q4_0-gguf", moe_test_bin(),
             tmp, tmp);
    assert_int_equal(run(cmd, &text), 1);
    assert_non_null(strstr(text, "tensor 'f32': no GGUF name for it"));
    free(text);
}

int moe_suite_repack(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(grid_peak_not_at_8),
        cmocka_unit_test(w4a16),
        cmocka_unit_test(q4_0_gguf),
        cmocka_unit_test(q4_0_gguf_trims_embeddings),
        cmocka_unit_test(errors),
    };
    return cmocka_run_group_tests_name("repack", tests, NULL, NULL);
}
