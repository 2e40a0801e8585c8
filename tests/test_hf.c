/* Suite "hf": Hugging Face checkpoints served directly (format/hf.c). The model is a complete
 * small gemma4 written by tests/qat_checkpoint.py (numpy): bf16 weights on the 4-bit grid, off-
 * grid groups in two tensors, a working byte-level BPE tokenizer.json and a chat template. moe
 * repack makes its Q4_0 GGUF and its compressed-tensors W4A16 twins. Checked: the W4A16
 * checkpoint as the engine reads it equals compressed-tensors' decompression bit for bit under
 * llama.cpp's names (numpy reads it); it gives the Q4_0 GGUF's greedy tokens at every ISA level
 * (its prompt tokenized from tokenizer.json, the GGUF's from the keys repack built); the bf16
 * checkpoint run directly gives the Q4_0 GGUF's logits within the gemma4 Q4_0 fixture's
 * tolerance. And llama, qwen3moe, qwen35 (with its MTP head): their parity fixtures rewritten
 * as HF checkpoints give llama.cpp's logits. Errors name what is wrong. */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/base/base.h"

#define PY     "/usr/bin/python3 tests/qat_checkpoint.py"
#define PROMPT "Once upon a time there was a little model"
#define N_GEN  16

typedef struct hf_models {
    char src[256];  /* the bf16 QAT checkpoint */
    char q4_0[256]; /* moe repack --to q4_0-gguf */
    char w4[256];   /* moe repack --to w4a16 */
} hf_models;

/* The three models, made once per process. */
static const hf_models *models(void) {
    static hf_models m;
    if (m.src[0]) return &m;
    char cmd[4096];
    const char *tmp = moe_test_tmpdir();
    snprintf(m.src, sizeof m.src, "%s/hf/gemma4-qat", tmp);
    snprintf(m.q4_0, sizeof m.q4_0, "%s/hf/gemma4-qat-q4_0.gguf", tmp);
    snprintf(m.w4, sizeof m.w4, "%s/hf/gemma4-qat-w4a16", tmp);
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s/hf' && " PY " qat '%s' --offgrid --seed 5 --bpe-tokenizer 500 "
             "--embed-std 0.3 && %s repack '%s' '%s' --to q4_0-gguf && %s repack '%s' '%s' --to "
             "w4a16",
             tmp, m.src, moe_test_bin(), m.src, m.q4_0, moe_test_bin(), m.src, m.w4);
    moe_test_run_ok(cmd);
    return &m;
}

/* stdout of cmd (stderr dropped), which must succeed; the caller frees. */
static char *stdout_of(const char *cmd) {
    char full[8192], *out = NULL;
    snprintf(full, sizeof full, "{ { %s; } 2>/dev/null; }", cmd); /* moe_test_run adds 2>&1 */
    int rc = moe_test_run(full, &out);
    if (rc != 0) fail_msg("`%s` failed (%d): %s", cmd, rc, out ? out : "");
    return out;
}

/* The W4A16 checkpoint as the engine reads it, written at F32 by moe quantize, against numpy's
 * decompression of the checkpoint: names, shapes and every value. */
static void w4a16_view_is_exact(void **state) {
    (void)state;
    const hf_models *m = models();
    char cmd[4096], view[300];
    snprintf(view, sizeof view, "%s/hf/w4a16-view-f32.gguf", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s quantize '%s' '%s' --rule '.=F32'", moe_test_bin(), m->w4, view);
    moe_test_run_ok(cmd);
    snprintf(cmd, sizeof cmd, PY " check-view '%s' '%s' '%s'", m->src, m->w4, view);
    char *out = stdout_of(cmd);
    assert_string_equal(out, "ok\n");
    free(out);
}

/* Greedy generation from a text prompt: the W4A16 checkpoint served directly and its Q4_0 GGUF
 * twin give the same ids (prompt and generated) at every ISA level. */
static void w4a16_greedy_equals_q4_0_twin(void **state) {
    (void)state;
    const hf_models *m = models();
    for (int isa = MOE_ISA_SCALAR; isa < MOE_ISA_COUNT; isa++) {
        if (!moe_cpu_isa_runs((moe_isa)isa)) continue;
        char *ids[2];
        const char *paths[2] = {m->w4, m->q4_0};
        for (int k = 0; k < 2; k++) {
            char cmd[4096];
            snprintf(cmd, sizeof cmd,
                     "MOE_ISA=%s %s run '%s' -p '" PROMPT "' -n %d --temp 0 --print-ids",
                     moe_isa_name((moe_isa)isa), moe_test_bin(), paths[k], N_GEN);
            ids[k] = stdout_of(cmd);
        }
        int commas = 0;
        for (const char *p = ids[0]; *p; p++) commas += *p == ',';
        print_message("%s: %s", moe_isa_name((moe_isa)isa), ids[0]);
        assert_true(commas >= N_GEN); /* BOS, the prompt's tokens and N_GEN generated */
        assert_string_equal(ids[0], ids[1]);
        free(ids[0]);
        free(ids[1]);
    }
}

/* Worst row of llama.cpp's logits against the f32-activation reference on the gemma4 Q4_0
 * fixture, or -1 when the fixture is absent (skipped). */
static double gemma4_fixture_distance(void) {
    size_t a_size, b_size;
    float *a = (float *)moe_test_shared_read("parity/gemma4-moe-q4_0.logits.f32", &a_size);
    if (!a) return -1;
    float *b = (float *)moe_test_shared_read("parity/gemma4-moe-q4_0.logits_f32act.f32", &b_size);
    assert_non_null(b);
    assert_int_equal(a_size, b_size);
    const size_t n_vocab = 512; /* the fixture's logits_shape[1] */
    double worst = 0;
    for (size_t r = 0; r < a_size / sizeof(float) / n_vocab; r++)
        worst = fmax(worst, moe_test_row_rel_err(a + r * n_vocab, b + r * n_vocab, n_vocab));
    free(a);
    free(b);
    return worst;
}

/* The ids greedy generation from PROMPT gives on `model` ("1,2,..."), and their count. */
static char *greedy_ids(const char *model, size_t *n) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s run '%s' -p '" PROMPT "' -n %d --temp 0 --print-ids",
             moe_test_bin(), model, N_GEN);
    char *ids = stdout_of(cmd);
    ids[strcspn(ids, "\n")] = '\0';
    *n = 1;
    for (const char *p = ids; *p; p++) *n += *p == ',';
    return ids;
}

/* `moe logits` of model a and model b over the same ids: every row's argmax equal; returns the
 * worst row's max |b - a| over max |a|. */
static double compare_logits(const char *a, const char *b, const char *ids, size_t n_rows) {
    float *logits[2];
    const char *paths[2] = {a, b};
    size_t size = 0;
    for (int k = 0; k < 2; k++) {
        char out[300], cmd[4096];
        snprintf(out, sizeof out, "%s/hf/logits-%d.f32", moe_test_tmpdir(), k);
        snprintf(cmd, sizeof cmd, "%s logits '%s' --tokens %s --out '%s'", moe_test_bin(), paths[k],
                 ids, out);
        free(stdout_of(cmd));
        moe_error err = {0};
        assert_int_equal(moe_file_read(out, (uint8_t **)&logits[k], &size, &err), MOE_OK);
    }
    size_t n_vocab = size / sizeof(float) / n_rows;
    assert_int_equal(size, n_rows * n_vocab * sizeof(float));
    double worst = 0;
    for (size_t r = 0; r < n_rows; r++) {
        const float *x = logits[0] + r * n_vocab, *y = logits[1] + r * n_vocab;
        worst = fmax(worst, moe_test_row_rel_err(y, x, (uint32_t)n_vocab));
        size_t ax = 0, ay = 0;
        for (size_t i = 1; i < n_vocab; i++) {
            if (x[i] > x[ax]) ax = i;
            if (y[i] > y[ay]) ay = i;
        }
        if (ax != ay) fail_msg("%s vs %s: row %zu's argmax %zu vs %zu", a, b, r, ax, ay);
    }
    free(logits[0]);
    free(logits[1]);
    return worst;
}

/* The W4A16 checkpoint and its Q4_0 GGUF twin at every prompt position: the same argmax (their
 * scales differ below bf16's precision: repack fits Q4_0's f16 scale by least squares, W4A16's
 * bf16 one, both reproducing the source values). */
static void w4a16_argmax_equals_q4_0_twin(void **state) {
    (void)state;
    const hf_models *m = models();
    size_t n;
    char *ids = greedy_ids(m->q4_0, &n);
    double worst = compare_logits(m->q4_0, m->w4, ids, n);
    print_message("W4A16 vs Q4_0 GGUF over %zu rows: worst row %.3g of max|logit|\n", n, worst);
    free(ids);
}

/* The bf16 checkpoint run directly (BF16 weights) against the Q4_0 GGUF repack made of it:
 * every row within the Q4_0 fixture's tolerance of the bf16 run, and the same argmax. */
static void bf16_source_matches_q4_0(void **state) {
    (void)state;
    const double fixture = gemma4_fixture_distance();
    if (fixture < 0) return;
    const double tol = MOE_TEST_GEMMA4_Q8_ACT_SLACK * fixture;
    const hf_models *m = models();
    size_t n;
    char *ids = greedy_ids(m->src, &n);
    double worst = compare_logits(m->src, m->q4_0, ids, n);
    print_message("Q4_0 GGUF vs bf16 checkpoint over %zu rows: worst row %.3g of max|logit| "
                  "(limit %.3g = %.2f x llama.cpp's %.3g on the fixture)\n",
                  n, worst, tol, MOE_TEST_GEMMA4_Q8_ACT_SLACK, fixture);
    assert_true(worst <= tol);
    free(ids);
}

/* A parity fixture's weights written as a Hugging Face checkpoint by numpy (qat_checkpoint.py's
 * `py` command and options: HF names and layouts, every converter edit undone), run directly:
 * the worst row (max |diff| over max |ref|) of its logits against the fixture's <ref>.f32
 * (`mtp`: the MTP head's, through `moe logits --mtp`), or -1 when the fixture is absent (skip).
 * tag names the checkpoint's directory. numpy decodes Q8_0 itself; other types go through `moe
 * quantize --rule .=F32` first (dequantization is bit-exact, suite quant). */
static double checkpoint_distance(const char *name, bool through_f32, const char *py,
                                  const char *tag, const char *ref_kind) {
    char rel[256];
    snprintf(rel, sizeof rel, "parity/%s.gguf", name);
    const char *gguf = moe_test_shared(rel);
    if (!gguf) return -1;
    size_t ref_size, tok_size;
    snprintf(rel, sizeof rel, "parity/%s.%s.f32", name, ref_kind);
    float *ref = (float *)moe_test_shared_read(rel, &ref_size);
    snprintf(rel, sizeof rel, "parity/%s.tokens.json", name);
    char *tokens_json = (char *)moe_test_shared_read(rel, &tok_size);
    assert_non_null(ref);
    assert_non_null(tokens_json);
    json_error_t je;
    json_t *t = json_loadb(tokens_json, tok_size, 0, &je), *all = json_object_get(t, "all_tokens");
    char ids[2048] = "";
    for (size_t i = 0; i < json_array_size(all); i++)
        snprintf(ids + strlen(ids), sizeof ids - strlen(ids), i ? ",%lld" : "%lld",
                 (long long)json_integer_value(json_array_get(all, i)));
    const bool mtp = strcmp(ref_kind, "mtp") == 0;
    const size_t n_rows = json_array_size(all) - mtp, n_vocab = ref_size / sizeof(float) / n_rows;
    char dir[300], f32[300], out[300], cmd[4096];
    const char *tmp = moe_test_tmpdir();
    snprintf(dir, sizeof dir, "%s/hf/%s-%s", tmp, name, tag);
    snprintf(f32, sizeof f32, "%s/hf/%s-f32.gguf", tmp, name);
    snprintf(out, sizeof out, "%s/hf/%s-%s.%s", tmp, name, tag, ref_kind);
    if (through_f32) {
        snprintf(cmd, sizeof cmd, "mkdir -p '%s/hf' && %s quantize '%s' '%s' --rule '.=F32'", tmp,
                 moe_test_bin(), gguf, f32);
        moe_test_run_ok(cmd);
        gguf = f32;
    }
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s/hf' && rm -rf '%s' && " PY " %s '%s' "
             "'%s' && %s logits '%s' --tokens %s%s --out '%s'",
             tmp, dir, py, gguf, dir, moe_test_bin(), dir, ids, mtp ? " --mtp" : "", out);
    moe_test_run_ok(cmd);
    size_t size;
    float *got;
    moe_error err = {0};
    assert_int_equal(moe_file_read(out, (uint8_t **)&got, &size, &err), MOE_OK);
    assert_int_equal(size, ref_size);
    double worst = 0;
    for (size_t r = 0; r < n_rows; r++)
        worst = fmax(worst,
                     moe_test_row_rel_err(got + r * n_vocab, ref + r * n_vocab, (uint32_t)n_vocab));
    print_message("%s as an HF checkpoint (%s) vs %s: worst row %.3g\n", name, py, ref_kind, worst);
    json_decref(t);
    free(got);
    free(ref);
    free(tokens_json);
    return worst;
}

/* The fixture as an HF checkpoint within 1e-4 of llama.cpp's logits (f32-activation ones for a
 * quantized fixture), so the names, keys and the converter's edits are llama.cpp's. */
static void checkpoint_matches_fixture(const char *name, bool through_f32, const char *py,
                                       const char *ref_kind) {
    double worst = checkpoint_distance(name, through_f32, py, "hf", ref_kind);
    if (worst >= 0) assert_true(worst <= 1e-4);
}

static void llama_checkpoint_matches_fixture(void **state) {
    (void)state;
    checkpoint_matches_fixture("llama-q8_0", false, "hf-from-gguf", "logits_f32act");
}

static void qwen3moe_checkpoint_matches_fixture(void **state) {
    (void)state;
    checkpoint_matches_fixture("qwen3moe-mixed", true, "hf-from-gguf", "logits_f32act");
}

/* Qwen3.5 with its MTP head (model.language_model.* names, mtp.*, a vision tower left out):
 * the trunk's logits and the head's within 1e-4 of llama.cpp's. And each of the converter's
 * edits matters: a checkpoint written without undoing one (norms stored as w, not w - 1; A
 * stored as A_log; value heads in ggml's order) is read as the converter would read it and
 * lands far off (measured 1.06 to 2.25 of max|logit|). */
static void qwen35_checkpoint_matches_fixture(void **state) {
    (void)state;
    checkpoint_matches_fixture("qwen35-mtp-f32", false, "qwen35-from-gguf", "logits");
    checkpoint_matches_fixture("qwen35-mtp-f32", false, "qwen35-from-gguf", "mtp");
    static const char *const kept[] = {"norm", "a-log", "v-heads"};
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
        char py[64];
        snprintf(py, sizeof py, "qwen35-from-gguf --keep-%s", kept[i]);
        double worst = checkpoint_distance("qwen35-mtp-f32", false, py, kept[i], "logits");
        if (worst >= 0 && worst < 0.1) fail_msg("--keep-%s: %.3g, not far off", kept[i], worst);
    }
}

/* A W4A16 qwen35: the fixture's HF checkpoint with its 2-D weights as compressed-tensors
 * modules (numpy). Read through the same edits (Q4_0 rows reordered whole, ssm_out's value-head
 * columns moved as whole Q4_0 blocks) and dequantized by moe quantize, it equals value for value
 * the F32 checkpoint of the same values (numpy decodes both files); and it runs, MTP head too. */
static void qwen35_w4a16_equals_f32_twin(void **state) {
    (void)state;
    const char *gguf = moe_test_shared("parity/qwen35-mtp-f32.gguf");
    if (!gguf) return;
    char d[300], cmd[8192];
    snprintf(d, sizeof d, "%s/hf/qwen35-w4", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd,
             "rm -rf '%s' && mkdir -p '%s' && " PY " qwen35-from-gguf '%s' '%s/hf' && " PY
             " w4a16-twins '%s/hf' '%s/w4a16' '%s/f32' && %s quantize '%s/w4a16' '%s/a.gguf' "
             "--rule '.=F32' && %s quantize '%s/f32' '%s/b.gguf' --rule '.=F32' && %s logits "
             "'%s/w4a16' --tokens 1,403,407,261 --mtp --out '%s/mtp.f32'",
             d, d, gguf, d, d, d, d, moe_test_bin(), d, d, moe_test_bin(), d, d, moe_test_bin(), d,
             d);
    free(stdout_of(cmd));
    snprintf(cmd, sizeof cmd, PY " same-gguf '%s/a.gguf' '%s/b.gguf'", d, d);
    char *out = stdout_of(cmd);
    assert_string_equal(out, "ok\n");
    free(out);
}

/* The chat template of tokenizer_config.json, rendered from the checkpoint directory (moe
 * template renders bos_token only from a template's caller, so none here). */
static void chat_template_from_checkpoint(void **state) {
    (void)state;
    const hf_models *m = models();
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "echo '[{\"role\": \"user\", \"content\": \"hi\"}]' > '%s/hf/messages.json' && "
             "%s template '%s' --messages '%s/hf/messages.json'",
             moe_test_tmpdir(), moe_test_bin(), m->w4, moe_test_tmpdir());
    char *out = stdout_of(cmd);
    assert_string_equal(out, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n");
    /* the Q4_0 GGUF carries the same template (repack copies it) */
    snprintf(cmd, sizeof cmd, "%s template '%s' --messages '%s/hf/messages.json'", moe_test_bin(),
             m->q4_0, moe_test_tmpdir());
    char *gguf = stdout_of(cmd);
    assert_string_equal(out, gguf);
    free(gguf);
    free(out);
}

/* A checkpoint of an architecture moe does not map, and a W4A16 scale f16 cannot hold (that
 * module is served at F32, and says so). */
static void errors(void **state) {
    (void)state;
    const hf_models *m = models();
    char cmd[4096], *out = NULL;
    const char *tmp = moe_test_tmpdir();
    snprintf(cmd, sizeof cmd,
             "{ rm -rf '%s/hf/qwen2' && cp -r '%s' '%s/hf/qwen2' && sed -i 's/\"gemma4_text\"/"
             "\"qwen2\"/' '%s/hf/qwen2/config.json' && %s run '%s/hf/qwen2' -p hi -n 1; }",
             tmp, m->src, tmp, tmp, moe_test_bin(), tmp);
    assert_int_not_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "model_type 'qwen2': moe maps the HF names of gemma4, llama"));
    free(out);
    /* 2^20 as the first scale of a module: a bf16 number past f16's 65504 */
    snprintf(cmd, sizeof cmd,
             "{ rm -rf '%s/hf/big' && cp -r '%s' '%s/hf/big' && " PY
             " set-scale '%s/hf/big' model.language_model.layers.0.self_attn.q_proj 1048576 && "
             "%s quantize '%s/hf/big' '%s/hf/big.gguf' --rule '.=F32' && " PY
             " check-view '%s' '%s/hf/big' '%s/hf/big.gguf'; }",
             tmp, m->w4, tmp, tmp, moe_test_bin(), tmp, tmp, m->src, tmp, tmp);
    int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("`%s` failed (%d): %s", cmd, rc, out);
    assert_non_null(strstr(out, "model.language_model.layers.0.self_attn.q_proj.weight: a scale "
                                "outside f16's range: dequantized to F32"));
    free(out);
}

int moe_suite_hf(void) {
    if (!moe_test_python_numpy()) return 0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(w4a16_view_is_exact),
        cmocka_unit_test(w4a16_greedy_equals_q4_0_twin),
        cmocka_unit_test(w4a16_argmax_equals_q4_0_twin),
        cmocka_unit_test(bf16_source_matches_q4_0),
        cmocka_unit_test(llama_checkpoint_matches_fixture),
        cmocka_unit_test(qwen3moe_checkpoint_matches_fixture),
        cmocka_unit_test(qwen35_checkpoint_matches_fixture),
        cmocka_unit_test(qwen35_w4a16_equals_f32_twin),
        cmocka_unit_test(chat_template_from_checkpoint),
        cmocka_unit_test(errors),
    };
    return cmocka_run_group_tests_name("hf", tests, NULL, NULL);
}
