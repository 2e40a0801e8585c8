/* Suite "synth": `moe synth` writes the model it was asked for -- the inventory `moe inspect`
 * reports matches the requested shape and type rules, `moe run` generates from it, a seed
 * gives the same bytes twice, types moe cannot quantize are refused by name, and
 * general.file_type is llama.cpp's number for the type holding the most bytes. */
#include "testutil.h"

#include "../src/format/format.h"

#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char *run_ok(const char *cmd) {
    char *out;
    int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("`%s` exited %d:\n%s", cmd, rc, out);
    return out;
}

static void synth_inventory_and_run(void **state) {
    (void)state;
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/synth-q3.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s synth -o %s --preset qwen3-30b-a3b --layers 3 --embd 256 --heads 4 --heads-kv 2 "
             "--head-dim 64 --experts 16 --experts-used 4 --expert-ff 256 --vocab 1000 "
             "--type 'ffn_(gate|up)_exps=Q4_K' --type 'blk\\.2\\.ffn_down_exps=IQ4_XS' "
             "--type 'ffn_down_exps=Q6_K' --type '.*=Q8_0'",
             moe_test_bin(), path);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    char *out = run_ok(cmd);
    /* 3 global tensors + 12 per qwen3moe layer */
    assert_non_null(strstr(out, "39 tensors"));
    assert_non_null(strstr(out, "routed experts: gate/up Q4_K, down Q6_K in layers 0-1 (2); "
                                "gate/up Q4_K, down IQ4_XS in layer 2 (1)"));
    assert_non_null(strstr(out, "attention: q/k/v/output Q8_0 in layers 0-2 (3)"));
    assert_non_null(strstr(out, "ffn_gate_inp F32")); /* routers stay float */
    assert_non_null(strstr(out, "reconciles:"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s -n 6 -p 'the model'", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "generated: 6 tokens"));
    free(out);
}

/* Llama with routed experts (Mixtral's layout): llama.cpp's llama loader sizes the experts by
 * feed_forward_length, so the file's expert tensors must be that wide whatever --expert-ff
 * says; and it loads and runs here, through the same architecture descriptor. */
static void synth_llama_experts(void **state) {
    (void)state;
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/synth-mixtral.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s synth -o %s --preset llama-tiny --layers 2 --ff 384 --experts 4 "
             "--experts-used 2 --expert-ff 128",
             moe_test_bin(), path);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    char *out = run_ok(cmd);
    assert_non_null(strstr(out, "llama.feed_forward_length (u32) = 384"));
    assert_non_null(strstr(out, "blk.1.ffn_gate_exps.weight F32      [256, 384, 4]"));
    assert_non_null(strstr(out, "blk.1.ffn_down_exps.weight F32      [384, 256, 4]"));
    assert_null(strstr(out, "blk.1.ffn_gate.weight")); /* no dense FFN beside them */
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s -n 4 -p 'the model'", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "generated: 4 tokens"));
    free(out);
}

static void synth_is_deterministic(void **state) {
    (void)state;
    char a[512], b[512], c[512], cmd[2048];
    const char *dir = moe_test_tmpdir();
    snprintf(a, sizeof a, "%s/det-a.gguf", dir);
    snprintf(b, sizeof b, "%s/det-b.gguf", dir);
    snprintf(c, sizeof c, "%s/det-c.gguf", dir);
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset llama-tiny --layers 2 --type '.*=Q4_0'",
             moe_test_bin(), a);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset llama-tiny --layers 2 --type '.*=Q4_0'",
             moe_test_bin(), b);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd,
             "%s synth -o %s --preset llama-tiny --layers 2 --type '.*=Q4_0' --seed 5",
             moe_test_bin(), c);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, b);
    assert_int_equal(moe_test_run(cmd, NULL), 0);
    snprintf(cmd, sizeof cmd, "cmp -s %s %s", a, c);
    assert_int_not_equal(moe_test_run(cmd, NULL), 0);
}

static void synth_refuses_clearly(void **state) {
    (void)state;
    char cmd[1024], *out;
    const char *dir = moe_test_tmpdir();
    snprintf(cmd, sizeof cmd, "%s synth -o %s/x.gguf --type 'exps=TQ1_0'", moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "'blk.0.ffn_gate_exps.weight': moe has no quantizer for TQ1_0"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s/x.gguf --type 'exps=Q9_X'", moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--type expects REGEX=TYPE"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s/x.gguf --type '(=Q8_0'", moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "not a valid regular expression"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s/x.gguf --preset nope", moe_test_bin(), dir);
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "unknown preset 'nope'"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s/x.gguf --experts 4 --experts-used 8", moe_test_bin(),
             dir);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "inconsistent shape"));
    free(out);
}

/* The IQ mix, quantized for real (every type has a quantizer) and, with --random-blocks,
 * as random valid blocks at the preset's weight scale (each row's RMS is 1/sqrt(n_in)); both
 * models run. */
static void synth_random_blocks(void **state) {
    (void)state;
    char path[512], f32[512], cmd[2048];
    snprintf(path, sizeof path, "%s/synth-iq.gguf", moe_test_tmpdir());
    snprintf(f32, sizeof f32, "%s/synth-iq.f32", moe_test_tmpdir());
    const char *types =
        "--type 'ffn_(gate|up)_exps=IQ2_S' --type 'ffn_down_exps=IQ3_S' "
        "--type 'attn_=Q8_0' --type 'output\\.weight=Q6_K' --type 'token_embd=Q4_K'";
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset tiny --layers 2 %s", moe_test_bin(), path,
             types);
    char *out = run_ok(cmd); /* the real quantizers (IQ2_S with an all-ones importance) */
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s -n 4 -p 'the model'", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "generated: 4 tokens"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset tiny --layers 2 --random-blocks %s",
             moe_test_bin(), path, types);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s inspect %s", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "routed experts: gate/up IQ2_S, down IQ3_S in layers 0-1 (2)"));
    assert_non_null(strstr(out, "embeddings/output: token_embd Q4_K, output Q6_K"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s dump %s blk.1.ffn_down_exps.weight --rows 0:8 --out %s",
             moe_test_bin(), path, f32);
    free(run_ok(cmd));
    size_t size;
    float *v = NULL;
    moe_error err = {0};
    assert_int_equal(moe_file_read(f32, (uint8_t **)&v, &size, &err), MOE_OK);
    assert_int_equal(size, 8 * 256 * sizeof(float)); /* down: rows of n_ff_exp = 256 */
    double sum = 0;
    for (size_t i = 0; i < size / sizeof(float); i++) sum += (double)v[i] * v[i];
    const double rms = sqrt(sum / (double)(size / sizeof(float)));
    assert_true(fabs(rms - 1.0 / 16.0) < 0.02 / 16.0); /* fp16 scales: within 2% */
    free(v);
    snprintf(cmd, sizeof cmd, "%s run %s -n 4 -p 'the model'", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "generated: 4 tokens"));
    free(out);
}

/* A --header-only file has no weights: run refuses it naming the file (it used to compute with
 * the hole's zeros), with or without an expert cache, while budget still reads it. */
static void header_only_is_refused_by_run(void **state) {
    (void)state;
    char path[512], cmd[2048], *out;
    snprintf(path, sizeof path, "%s/tiny-header.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset tiny --header-only", moe_test_bin(), path);
    free(run_ok(cmd));
    static const char *const extra[] = {"", "--expert-cache 1M"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "%s run %s --tokens 1,2 -n 2 %s", moe_test_bin(), path, extra[i]);
        assert_int_not_equal(moe_test_run(cmd, &out), 0);
        if (!strstr(out, path) || !strstr(out, "tensor data is a hole"))
            fail_msg("`%s`:\n%s", cmd, out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "%s budget %s", moe_test_bin(), path);
    free(run_ok(cmd));
}

/* ==== GLM-5.3-Flash's layout, header only ==== */

/* Bytes of n values of a type, from ggml's block layouts (values per block, bytes per block)
 * written out here, not taken from moe's type table. */
static uint64_t ggml_bytes(const char *type, uint64_t n) {
    static const struct {
        const char *name;
        uint64_t values, bytes;
    } blocks[] = {{"F32", 1, 4},
                  {"Q8_0", 32, 34},
                  {"IQ2_S", 256, 82},
                  {"IQ3_S", 256, 110},
                  {"IQ4_XS", 256, 136}};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
        if (!strcmp(type, blocks[i].name)) {
            if (n % blocks[i].values)
                fail_msg("%" PRIu64 " values are not whole %s blocks", n, type);
            return n / blocks[i].values * blocks[i].bytes;
        }
    fail_msg("type %s is not in the test's table", type);
    return 0;
}

/* UD-IQ3_XXS's routed experts (issue 14): layers 3-10 and 13-43 gate/up IQ2_S, down IQ3_S;
 * layer 11 IQ3_S / IQ3_S / IQ4_XS; layers 12 and 44 IQ2_S / IQ2_S / IQ4_XS. */
static const char *ud_expert_type(int64_t layer, bool down) {
    if (layer == 11) return down ? "IQ4_XS" : "IQ3_S";
    if (layer == 12 || layer == 44) return down ? "IQ4_XS" : "IQ2_S";
    return down ? "IQ3_S" : "IQ2_S";
}

/* `moe synth --preset glm53-flash --types ud-iq3_xxs --header-only`: a sparse file of the full
 * size whose tensors have the real model's names, shapes and the UD-IQ3_XXS expert formats; its
 * routed experts of blk.3-44 come to the 109,867,696,128 bytes, and `moe budget` splits
 * them into 13,733,462,016 per device of 8, with the KV, indexer and KDA state the real shapes
 * give at 262,144 and 1,048,576 tokens. */
static void synth_glm53_flash_header(void **state) {
    (void)state;
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/glm53-flash.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s synth -o %s --preset glm53-flash --types ud-iq3_xxs --header-only", moe_test_bin(),
             path);
    free(run_ok(cmd));
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_true((uint64_t)st.st_blocks * 512 < (64u << 20)); /* sparse: the data is a hole */

    snprintf(cmd, sizeof cmd, "%s inspect --json %s", moe_test_bin(), path);
    json_t *ins = moe_test_run_json(cmd);
    json_t *t;
    size_t i;
    uint64_t routed_trunk = 0, mtp = 0, hyper = 0, data_end = 0;
    bool mla[46] = {0}, kda[46] = {0}, eh_proj = false;
    json_array_foreach(json_object_get(ins, "tensors"), i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        const char *type = json_string_value(json_object_get(t, "type"));
        json_t *shape = json_object_get(t, "shape");
        uint64_t n = 1, bytes = moe_test_json_uint(t, "bytes");
        for (size_t d = 0; d < json_array_size(shape); d++)
            n *= (uint64_t)json_integer_value(json_array_get(shape, d));
        if (bytes != ggml_bytes(type, n)) fail_msg("%s: %" PRIu64 " bytes", name, bytes);
        const uint64_t end = moe_test_json_uint(t, "file_offset") + bytes;
        if (end > data_end) data_end = end;
        int layer = -1, at = 0;
        if (sscanf(name, "blk.%d.%n", &layer, &at) != 1 || layer < 0 || layer > 45) continue;
        const char *part = name + at;
        if (layer == 45) mtp += bytes;
        if (!strncmp(part, "hc_", 3)) hyper += bytes;
        mla[layer] |= !strcmp(part, "attn_kv_a_mqa.weight");
        kda[layer] |= !strcmp(part, "ssm_a");
        eh_proj |= layer == 45 && !strcmp(part, "nextn.eh_proj.weight") &&
                   json_integer_value(json_array_get(shape, 0)) == 8192;
        if (!strstr(part, "_exps.weight")) continue;
        const bool down = strstr(part, "down") != NULL;
        const int64_t want[3] = {down ? 2048 : 4096, down ? 4096 : 2048, 288};
        for (size_t d = 0; d < 3; d++)
            assert_int_equal(json_integer_value(json_array_get(shape, d)), want[d]);
        if (layer <= 44) {
            if (strcmp(type, ud_expert_type(layer, down)) != 0)
                fail_msg("%s is %s, UD-IQ3_XXS has %s", name, type, ud_expert_type(layer, down));
            routed_trunk += bytes;
        }
    }
    assert_int_equal(routed_trunk, 109867696128ull);
    assert_true(eh_proj);
    for (int l = 0; l <= 45; l++) /* (KDA, KDA, KDA, MLA) x 11 + KDA, then the MTP layer */
        if (mla[l] != (l % 4 == 3 || l == 45) || kda[l] != !mla[l])
            fail_msg("blk.%d: MLA %d, KDA %d", l, mla[l], kda[l]);
    assert_true(data_end <= (uint64_t)st.st_size && (uint64_t)st.st_size - data_end < 32);
    json_t *plan = json_object_get(ins, "plan");
    assert_int_equal(moe_test_json_uint(plan, "trunk_routed_bytes"), 109867696128ull);
    assert_int_equal(moe_test_json_uint(plan, "nextn_bytes"), mtp);
    json_decref(ins);

    /* per token: the latent (kv_lora_rank 512, f16) on the 11 MLA layers, and their indexer rows
     * (f32: the key, its pooling logits and the pooled key, 128 wide each); per sequence: the 34
     * KDA layers' conv tails (3 taps over q, k, v of 64 heads x 128) and 64 states of 128 x 128 */
    const uint64_t kv = 11 * 512 * 2, index = 11 * 3 * 128 * 4,
                   kda_state = 34ull * (3 * 3 * 64 * 128 + 64 * 128 * 128) * 4;
    const uint64_t ctxs[] = {262144, 1048576};
    for (size_t c = 0; c < 2; c++) {
        snprintf(cmd, sizeof cmd,
                 "%s budget %s --json --devices 8 --mem-per-device 64 --ctx %" PRIu64,
                 moe_test_bin(), path, ctxs[c]);
        json_t *b = moe_test_run_json(cmd);
        json_t *m = json_array_get(json_object_get(b, "models"), 0);
        json_t *w = json_object_get(m, "weights");
        assert_int_equal(moe_test_json_uint(w, "routed_experts"), 109867696128ull);
        assert_int_equal(moe_test_json_uint(w, "mtp_layers"), mtp);
        assert_int_equal(moe_test_json_uint(w, "hyper_connections"), hyper);
        assert_int_equal(moe_test_json_uint(m, "kv_bytes_per_token"), kv);
        assert_int_equal(moe_test_json_uint(m, "index_bytes_per_token"), index);
        assert_int_equal(moe_test_json_uint(m, "state_bytes_per_stream"), kda_state);
        json_t *devs = json_object_get(m, "devices");
        assert_int_equal(json_array_size(devs), 8);
        for (size_t d = 0; d < 8; d++) {
            json_t *parts = json_object_get(json_array_get(devs, d), "parts");
            assert_int_equal(moe_test_json_uint(parts, "routed_experts"), 13733462016ull);
            assert_int_equal(moe_test_json_uint(parts, "kv_cache"), ctxs[c] * kv);
            assert_int_equal(moe_test_json_uint(parts, "indexer_cache"), ctxs[c] * index);
            assert_int_equal(moe_test_json_uint(parts, "recurrent_state"), kda_state);
        }
        json_decref(b);
    }
}

/* glm53-flash's layout at toy size loads and generates, with the UD-IQ3_XXS rules as random
 * blocks; --types names only sets it knows. */
static void synth_glm5next_tiny_runs(void **state) {
    (void)state;
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/glm5next-tiny.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "%s synth -o %s --preset glm5next-tiny --types ud-iq3_xxs --random-blocks",
             moe_test_bin(), path);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s inspect --formats %s", moe_test_bin(), path);
    char *out = run_ok(cmd);
    assert_non_null(strstr(out, "routed experts: gate/up IQ2_S, down IQ3_S in layers 1-4 (4)"));
    assert_non_null(strstr(out, "hyper-connections: hc_attn_fn/hc_ffn_fn Q8_0"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s -n 6 -p 'the model'", moe_test_bin(), path);
    out = run_ok(cmd);
    assert_non_null(strstr(out, "generated: 6 tokens"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s --preset glm5next-tiny --layers 3", moe_test_bin(),
             path);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "3 layers: glm5next runs attention in every 4-th layer"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s synth -o %s --types nope", moe_test_bin(), path);
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "unknown --types 'nope' (known: ud-iq3_xxs)"));
    free(out);
}

static uint64_t file_type_of_file(const char *path) {
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) fail_msg("%s", err.msg);
    uint64_t ftype = UINT64_MAX;
    if (!moe_gguf_get_u64(g, "general.file_type", &ftype))
        fail_msg("%s: no general.file_type", path);
    moe_gguf_close(g);
    return ftype;
}

/* The numbers are llama.cpp's: files llama-quantize wrote carry the ftype of their type. */
static void file_type_numbers_are_llama_cpps(void **state) {
    (void)state;
    static const struct {
        const char *path;
        moe_type type; /* what the file was quantized to */
    } files[] = {
        {"parity/deepseek2-f32.gguf", MOE_TYPE_F32},
        {"parity/llama-q8_0.gguf", MOE_TYPE_Q8_0},
        {"parity/gemma4-moe-q4_0.gguf", MOE_TYPE_Q4_0},
        {"parity/gpt-oss-mxfp4.gguf", MOE_TYPE_MXFP4},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        const char *path = moe_test_shared(files[i].path);
        MOE_SKIP_IF_NULL(path);
        uint32_t ftype;
        assert_true(moe_gguf_file_type_of(files[i].type, &ftype));
        assert_int_equal(file_type_of_file(path), ftype);
    }
    uint32_t ftype;
    assert_false(moe_gguf_file_type_of(MOE_TYPE_Q8_K, &ftype)); /* an activation type */
}

/* synth names each file after the type holding the most bytes: pure files, the all-F32 default,
 * and mixes in which the most tensors and the most bytes are of different types. */
static void synth_writes_file_type(void **state) {
    (void)state;
    static const struct {
        const char *rules;
        uint64_t ftype;
    } cases[] = {
        {"", 0},                  /* LLAMA_FTYPE_ALL_F32 */
        {"--type '.*=F16'", 1},   /* MOSTLY_F16 */
        {"--type '.*=Q8_0'", 7},  /* MOSTLY_Q8_0 */
        {"--type '.*=Q4_K'", 15}, /* MOSTLY_Q4_K_M */
        {"--type '.*=BF16'", 32}, /* MOSTLY_BF16 */
        /* mixes: the routed experts hold most bytes though the other type has more tensors */
        {"--type 'exps=Q4_K' --type '.*=Q8_0'", 15},
        {"--type 'exps=Q8_0' --type '.*=Q4_K'", 7},
    };
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/file-type.gguf", moe_test_tmpdir());
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s synth -o %s --preset tiny --layers 2 %s", moe_test_bin(),
                 path, cases[i].rules);
        free(run_ok(cmd));
        if (file_type_of_file(path) != cases[i].ftype)
            fail_msg("synth %s: general.file_type %llu, expected %llu", cases[i].rules,
                     (unsigned long long)file_type_of_file(path),
                     (unsigned long long)cases[i].ftype);
    }
}

int moe_suite_synth(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(synth_inventory_and_run),
        cmocka_unit_test(synth_is_deterministic),
        cmocka_unit_test(synth_llama_experts),
        cmocka_unit_test(synth_refuses_clearly),
        cmocka_unit_test(synth_random_blocks),
        cmocka_unit_test(file_type_numbers_are_llama_cpps),
        cmocka_unit_test(synth_writes_file_type),
        cmocka_unit_test(header_only_is_refused_by_run),
        cmocka_unit_test(synth_glm53_flash_header),
        cmocka_unit_test(synth_glm5next_tiny_runs),
    };
    return cmocka_run_group_tests_name("synth", tests, NULL, NULL);
}
