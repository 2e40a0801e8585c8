/* Suite "inspect": `moe inspect` on every GGUF in ../shared (run as the built binary), its
 * reconciliation line and --json totals against the reader's own numbers (the JSON parsed by
 * Python's json module, which we did not write), the per-layer format grouping of a mixed
 * file, split models, tensor roles, and the streaming JSON writer's escaping. */
#include "testutil.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../src/format/format.h"
#include "../src/tools/tools.h"

static const char *const shared_ggufs[] = {
    "models/stories260K/stories260K.gguf", "parity/deepseek2-f32.gguf",
    "parity/deepseek2-q8_0-q4_k.gguf",     "parity/gpt-oss-mxfp4.gguf",
    "parity/kimi-linear-f32.gguf",         "parity/llama-q8_0.gguf",
    "parity/qwen3moe-mixed.gguf",          "parity/qwen3next-f32.gguf",
    "parity/gemma4-moe-q4_0.gguf",         "tokenizers/ggml-vocab-llama-spm.gguf",
};

static moe_gguf *open_ok(const char *path) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    return g;
}

/* The reconciliation line the reader's numbers imply, and the JSON totals line. */
static void expected_lines(const moe_gguf *g, char *text, size_t text_cap, char *json,
                           size_t json_cap) {
    uint64_t tensor = 0, header = 0, pad = 0, file = 0;
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(g, s);
        tensor += sh->tensor_bytes;
        header += sh->header_bytes;
        pad += sh->padding_bytes;
        file += sh->file_size;
    }
    snprintf(text, text_cap,
             "reconciles: tensor bytes %" PRIu64 " + header %" PRIu64 " + padding %" PRIu64
             " = file size %" PRIu64,
             tensor, header, pad, file);
    snprintf(json, json_cap,
             "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " True %" PRIu64,
             moe_gguf_n_tensors(g), tensor, header, pad, file, moe_gguf_n_kv(g));
}

static void check_inspect(const char *path) {
    moe_gguf *g = open_ok(path);
    char text[256], json[256], cmd[2048], *out;
    expected_lines(g, text, sizeof text, json, sizeof json);

    snprintf(cmd, sizeof cmd, "%s inspect '%s'", moe_test_bin(), path);
    int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("%s exited %d: %s", cmd, rc, out);
    if (!strstr(out, text)) fail_msg("%s: no line '%s' in:\n%s", path, text, out);
    char want[128];
    snprintf(want, sizeof want, "GGUF version %u, alignment %u, %" PRIu64 " tensors",
             moe_gguf_shard_get(g, 0)->version, moe_gguf_alignment(g), moe_gguf_n_tensors(g));
    if (!strstr(out, want)) fail_msg("%s: no '%s'", path, want);
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++)
        if (!strstr(out, moe_gguf_tensor_get(g, i)->name.ptr))
            fail_msg("%s: tensor %s not listed", path, moe_gguf_tensor_get(g, i)->name.ptr);
    free(out);

    snprintf(cmd, sizeof cmd,
             "%s inspect '%s' --json | python3 -c 'import json,sys\nd=json.load(sys.stdin)\n"
             "t=d[\"totals\"]\nassert len(d[\"tensors\"])==t[\"n_tensors\"]\n"
             "assert sum(x[\"bytes\"] for x in d[\"tensors\"])==t[\"tensor_bytes\"]\n"
             "assert sum(x[\"bytes\"] for x in d[\"types\"])==t[\"tensor_bytes\"]\n"
             "assert sum(r[\"bytes\"] for r in d[\"roles\"].values())==t[\"tensor_bytes\"]\n"
             "print(t[\"n_tensors\"],t[\"tensor_bytes\"],t[\"header_bytes\"],t[\"padding_bytes\"],"
             "t[\"file_bytes\"],t[\"reconciles\"],len(d[\"metadata\"]))'",
             moe_test_bin(), path);
    rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("%s exited %d: %s", cmd, rc, out);
    out[strcspn(out, "\n")] = '\0';
    assert_string_equal(out, json);
    free(out);
    moe_gguf_close(g);
}

static void inspect_shared_files(void **state) {
    (void)state;
    for (size_t f = 0; f < sizeof shared_ggufs / sizeof shared_ggufs[0]; f++) {
        const char *path = moe_test_shared(shared_ggufs[f]);
        MOE_SKIP_IF_NULL(path);
        check_inspect(path);
    }
    /* the mixed file's lines, as fixed facts from its generator's quantize command */
    const char *path = moe_test_shared("parity/qwen3moe-mixed.gguf");
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(
        strstr(out, "routed experts: down IQ3_S, gate IQ2_S, up IQ2_XXS in layers 0-1 (2)"));
    assert_non_null(strstr(out, "embeddings/output: output Q6_K, token_embd Q4_K"));
    assert_non_null(strstr(
        out, "tokenizer.ggml.tokens (array) = [string x 512] \"<unk>\", \"<s>\", \"</s>\", ..."));
    free(out);
}

/* Trunk layers (below n_layer: not the NextN ones) of a parity fixture whose tensor list (its
 * JSON, written by the fixture's generator) has a tensor whose name contains `what`. */
static uint32_t layers_with(json_t *tensors, const char *what, uint32_t n_layer) {
    uint64_t seen = 0; /* the fixtures have fewer than 64 layers */
    size_t i;
    json_t *t;
    json_array_foreach(tensors, i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        unsigned layer;
        if (name && strstr(name, what) && sscanf(name, "blk.%u.", &layer) == 1 && layer < n_layer &&
            layer < 64)
            seen |= 1ull << layer;
    }
    return (uint32_t)__builtin_popcountll(seen);
}

/* The plan `moe inspect --json` reads through the architecture's descriptor agrees with the
 * layer kinds the fixtures' own tensor lists show; an architecture moe does not run says so. */
static void inspect_plan(void **state) {
    (void)state;
    static const char *const models[] = {"llama-q8_0",     "qwen3moe-mixed", "deepseek2-f32",
                                         "gpt-oss-mxfp4",  "qwen3next-f32",  "kimi-linear-f32",
                                         "qwen35-mtp-f32", "glm5next-f32",   "gemma4-moe-q4_0"};
    MOE_SKIP_IF_NULL(moe_test_shared("parity/llama-q8_0.json"));
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char rel[256], cmd[1024], *out;
        snprintf(rel, sizeof rel, "parity/%s.json", models[i]);
        json_t *fixture = json_load_file(moe_test_shared(rel), 0, NULL);
        assert_non_null(fixture);
        json_t *tensors = json_object_get(fixture, "tensors");
        snprintf(cmd, sizeof cmd, "%s inspect ../shared/parity/%s.gguf --json", moe_test_bin(),
                 models[i]);
        assert_int_equal(moe_test_run(cmd, &out), 0);
        json_t *report = json_loads(out, 0, NULL);
        assert_non_null(report);
        json_t *plan = json_object_get(report, "plan"),
               *kinds = json_object_get(plan, "layers_by_kind");
        const uint32_t n_layer = (uint32_t)json_integer_value(
            json_object_get(json_object_get(fixture, "config"), "n_layer"));
        const uint32_t experts = layers_with(tensors, ".ffn_down_exps.", n_layer);
        const uint32_t linear = layers_with(tensors, ".ssm_", n_layer);
        const uint32_t mla = layers_with(tensors, ".attn_kv_a_mqa.", n_layer);
#define PLAN_INT(obj, key) ((uint32_t)json_integer_value(json_object_get(obj, key)))
        if (!json_is_true(json_object_get(plan, "known")) || PLAN_INT(plan, "n_layer") != n_layer ||
            PLAN_INT(plan, "expert_layers") != experts ||
            PLAN_INT(plan, "dense_ffn_layers") != n_layer - experts ||
            PLAN_INT(kinds, "linear attention") != linear || PLAN_INT(kinds, "MLA") != mla ||
            PLAN_INT(kinds, "full attention") + PLAN_INT(kinds, "sliding window") !=
                n_layer - linear - mla)
            fail_msg("%s: plan %s disagrees with the fixture: %u layers, %u expert, %u linear, "
                     "%u MLA",
                     models[i], json_dumps(plan, JSON_COMPACT), n_layer, experts, linear, mla);
        /* gemma4's config lists its sliding layers */
        json_t *swa = json_object_get(json_object_get(fixture, "config"), "swa_pattern");
        uint32_t sliding = 0;
        for (size_t l = 0; l < json_array_size(swa); l++)
            sliding += json_integer_value(json_array_get(swa, l)) != 0;
        if (swa && PLAN_INT(kinds, "sliding window") != sliding)
            fail_msg("%s: %u sliding layers, the fixture says %u", models[i],
                     PLAN_INT(kinds, "sliding window"), sliding);
#undef PLAN_INT
        json_decref(report);
        json_decref(fixture);
        free(out);
    }
    /* not (yet) an architecture moe runs: the plan says why */
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "mystery");
    static uint8_t data[64 * 4];
    const int64_t ne[3] = {64};
    moe_error err = {0};
    assert_int_equal(
        moe_gguf_writer_add_tensor(w, "output_norm.weight", MOE_TYPE_F32, 1, ne, data, true, &err),
        MOE_OK);
    char path[512], cmd[1024], *out;
    snprintf(path, sizeof path, "%s/mystery.gguf", moe_test_tmpdir());
    assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
    moe_gguf_writer_free(w);
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "plan: none: "));
    assert_non_null(strstr(out, "unknown architecture 'mystery'"));
    free(out);
}

/* A file whose routed experts change format in the last layer reads as two groups. */
static void inspect_mixed_layers_and_split(void **state) {
    (void)state;
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.architecture", "qwen3moe");
    moe_gguf_writer_set_str(w, "long.string",
                            "0123456789012345678901234567890123456789"
                            "0123456789012345678901234567890123456789\n");
    static uint8_t data[4 * 256];
    int64_t ne[3] = {256, 1, 2};
    moe_error err = {0};
    char name[64];
    for (int l = 0; l < 4; l++) {
        snprintf(name, sizeof name, "blk.%d.ffn_gate_exps.weight", l);
        assert_int_equal(
            moe_gguf_writer_add_tensor(w, name, MOE_TYPE_IQ2_S, 3, ne, data, true, &err), MOE_OK);
        snprintf(name, sizeof name, "blk.%d.ffn_up_exps.weight", l);
        assert_int_equal(
            moe_gguf_writer_add_tensor(w, name, MOE_TYPE_IQ2_S, 3, ne, data, true, &err), MOE_OK);
        snprintf(name, sizeof name, "blk.%d.ffn_down_exps.weight", l);
        assert_int_equal(moe_gguf_writer_add_tensor(w, name,
                                                    l < 3 ? MOE_TYPE_IQ3_S : MOE_TYPE_IQ4_XS, 3, ne,
                                                    data, true, &err),
                         MOE_OK);
        snprintf(name, sizeof name, "blk.%d.attn_kv_a_mqa.weight", l);
        assert_int_equal(
            moe_gguf_writer_add_tensor(w, name, MOE_TYPE_Q8_0, 1, ne, data, true, &err), MOE_OK);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/mixed.gguf", moe_test_tmpdir());
    assert_int_equal(moe_gguf_writer_write(w, path, 0, &err), MOE_OK);
    check_inspect(path);
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    const char *want = "routed experts: gate/up IQ2_S, down IQ3_S in layers 0-2 (3); gate/up "
                       "IQ2_S, down IQ4_XS in layer 3 (1)";
    if (!strstr(out, want)) fail_msg("no '%s' in:\n%s", want, out);
    assert_non_null(strstr(out, "attention: kv_a_mqa Q8_0 in layers 0-3 (4)"));
    assert_non_null(
        strstr(out, "\"01234567890123456789012345678901234567890123456789012345678901234567890"
                    "1...\" (81 bytes)"));
    free(out);

    /* the same model as a 3-shard split, inspected from its 2nd shard */
    char dir[600], base[700], shard[800];
    snprintf(dir, sizeof dir, "%s/isplit", moe_test_tmpdir());
    assert_int_equal(mkdir(dir, 0700), 0);
    snprintf(base, sizeof base, "%s/m.gguf", dir);
    assert_int_equal(moe_gguf_writer_write(w, base, 6, &err), MOE_OK);
    moe_gguf_writer_free(w);
    snprintf(shard, sizeof shard, "%s/m-00002-of-00003.gguf", dir);
    check_inspect(shard);
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), shard);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "shards: 3"));
    assert_non_null(strstr(out, "3/3 "));
    assert_non_null(strstr(out, "(all shards)"));
    if (!strstr(out, want)) fail_msg("split: no '%s' in:\n%s", want, out);
    free(out);
}

static void inspect_errors(void **state) {
    (void)state;
    char path[512], cmd[1024], *out;
    snprintf(path, sizeof path, "%s/notes.txt", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(path, "hello\n", 6, &err), MOE_OK);
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "not a GGUF file"));
    assert_non_null(strstr(out, path));
    assert_ptr_equal(strchr(out, '\n'), out + strlen(out) - 1); /* one line */
    free(out);
    snprintf(cmd, sizeof cmd, "%s inspect", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    free(out);
    snprintf(cmd, sizeof cmd, "%s inspect a b", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    free(out);
}

static void tensor_roles(void **state) {
    (void)state;
    static const struct {
        const char *name;
        moe_role role;
        int64_t layer;
    } cases[] = {
        {"blk.0.ffn_gate_exps.weight", MOE_ROLE_ROUTED_EXPERTS, 0},
        {"blk.12.ffn_down_exps.bias", MOE_ROLE_ROUTED_EXPERTS, 12},
        {"blk.3.ffn_up_shexp.weight", MOE_ROLE_SHARED_EXPERTS, 3},
        {"blk.1.attn_kv_a_mqa.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.1.attn_q_a.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.1.attn_q_b.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.1.attn_k_b.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.1.attn_v_b.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.1.attn_output.weight", MOE_ROLE_ATTENTION, 1},
        {"blk.0.ssm_out.weight", MOE_ROLE_ATTENTION, 0},
        {"blk.1.attn_kv_a_norm.weight", MOE_ROLE_OTHER, 1},
        {"blk.7.hc_attn_fn.weight", MOE_ROLE_HYPER, 7}, /* glm5next's hyper-connections */
        {"blk.7.hc_ffn_scale.weight", MOE_ROLE_HYPER, 7},
        {"blk.3.indexer.attn_q_b.weight", MOE_ROLE_ATTENTION, 3}, /* the lightning indexer */
        {"blk.3.indexer_compressor_gate.weight", MOE_ROLE_ATTENTION, 3},
        {"blk.3.indexer.k_norm.bias", MOE_ROLE_OTHER, 3},
        {"blk.0.ffn_gate.weight", MOE_ROLE_DENSE_FFN, 0},
        {"blk.0.ffn_gate_inp.weight", MOE_ROLE_OTHER, 0},
        {"blk.0.ffn_norm.weight", MOE_ROLE_OTHER, 0},
        {"token_embd.weight", MOE_ROLE_EMBEDDINGS, -1},
        {"output.weight", MOE_ROLE_EMBEDDINGS, -1},
        {"output_norm.weight", MOE_ROLE_OTHER, -1},
        {"blk.x.attn_q.weight", MOE_ROLE_OTHER, -1}, /* not a layer prefix: unknown */
        {"blkfoo", MOE_ROLE_OTHER, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (moe_tensor_role(cases[i].name) != cases[i].role)
            fail_msg("%s: role %s", cases[i].name, moe_role_name(moe_tensor_role(cases[i].name)));
        assert_int_equal(moe_tensor_layer(cases[i].name), cases[i].layer);
    }
}

static void json_writer(void **state) {
    (void)state;
    moe_json j;
    moe_json_init(&j, false);
    moe_json_object_begin(&j);
    moe_json_key(&j, "s");
    moe_json_string(&j, "q\"b\\n\n\t\x01\x1f\x7f h\xc3\xa9 \xe2\x96\x81");
    moe_json_key(&j, "bad");
    moe_json_string(&j, "a\xff"
                        "b\xc3");
    moe_json_key(&j, "nul");
    moe_json_string_n(&j, "a\0b", 3);
    moe_json_key(&j, "a");
    moe_json_array_begin(&j);
    moe_json_int(&j, INT64_MIN);
    moe_json_uint(&j, UINT64_MAX);
    moe_json_double(&j, 0.1);
    moe_json_double(&j, 1.0 / 0.0);
    moe_json_bool(&j, true);
    moe_json_null(&j);
    moe_json_array_begin(&j);
    moe_json_array_end(&j);
    moe_json_object_begin(&j);
    moe_json_object_end(&j);
    moe_json_array_end(&j);
    moe_json_object_end(&j);
    assert_string_equal(j.buf,
                        "{\"s\":\"q\\\"b\\\\n\\n\\t\\u0001\\u001f\x7f h\xc3\xa9 \xe2\x96\x81\","
                        "\"bad\":\"a\xef\xbf\xbd"
                        "b\xef\xbf\xbd\",\"nul\":\"a\\u0000b\","
                        "\"a\":[-9223372036854775808,18446744073709551615,"
                        "0.10000000000000001,null,true,null,[],{}]}");
    /* Python reads it back to the same values */
    char path[512], cmd[1024], *out;
    snprintf(path, sizeof path, "%s/w.json", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(path, j.buf, j.len, &err), MOE_OK);
    snprintf(cmd, sizeof cmd,
             "python3 -c 'import json\nd=json.load(open(\"%s\", encoding=\"utf-8\"))\n"
             "assert d[\"s\"]==\"q\\\"b\\\\n\\n\\t\\x01\\x1f\\x7f h\\xe9 \\u2581\"\n"
             "assert d[\"a\"][2]==0.1 and d[\"nul\"]==\"a\\x00b\"\nprint(\"ok\")'",
             path);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_string_equal(out, "ok\n");
    free(out);
    /* pretty output is the same document */
    moe_json_reset(&j);
    assert_int_equal(j.len, 0);
    j.pretty = true;
    moe_json_object_begin(&j);
    moe_json_key(&j, "k");
    moe_json_array_begin(&j);
    moe_json_int(&j, 1);
    moe_json_int(&j, 2);
    moe_json_array_end(&j);
    moe_json_object_end(&j);
    assert_string_equal(j.buf, "{\n  \"k\": [\n    1,\n    2\n  ]\n}");
    moe_json_free(&j);
}

int moe_suite_inspect(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(inspect_shared_files), cmocka_unit_test(inspect_mixed_layers_and_split),
        cmocka_unit_test(inspect_errors),       cmocka_unit_test(tensor_roles),
        cmocka_unit_test(json_writer),          cmocka_unit_test(inspect_plan),
    };
    return cmocka_run_group_tests_name("inspect", tests, NULL, NULL);
}
