/* Suite "spec": speculative decoding changes speed, never tokens. `moe run --spec ngram` (drafts
 * from the tokens so far, verified in one step, refused ones taken back -- the recurrent state
 * too) prints exactly what `--spec none` prints: on every hybrid fixture (Gated DeltaNet, KDA,
 * Qwen3.8's tiled GDN, GLM-5.3's hyper-connected KDA + sparse MLA) and on stories260K, 12 prompts
 * each, 128 tokens, greedy; and at temperature 0.8 (a draft is kept only where the sampler,
 * drawing as it would step by step, picks it). The stats line shows drafts were accepted, so the
 * verify path really ran. A drafter that skipped the recurrent-state rollback fails here on the
 * hybrids (and in the linear suite's verify_accept_exact, which checks the rollback itself).
 * `--spec mtp` (drafts from the model's MTP head) likewise, on the two fixtures with one; their
 * random heads never agree with the trunk, so every draft is refused and rolled back. The
 * drafts themselves are the head's: the first one equals the argmax of the fixture's own MTP
 * logits at that position, after the head's cache caught up with the trunk. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/engine/engine.h"

enum { N_PROMPTS = 12 };

/* Prompt i: BOS then ids with repeats, so that prompt lookup finds matches. */
static void prompt_ids(int i, char *out, size_t cap) {
    static const int base[] = {403, 407, 261, 378, 432, 383, 286, 376, 298, 315, 421, 395};
    size_t used = (size_t)snprintf(out, cap, "1");
    for (int k = 0; k < 9; k++)
        used += (size_t)snprintf(out + used, cap - used, ",%d", base[(i + k % (2 + i % 4)) % 12]);
}

/* The ids `moe run` prints; accepted (tokens per step > 1) or'ed in from the stats line. */
static char *run_ids(const char *model, const char *ids, const char *spec, float temp,
                     bool *accepted) {
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd,
             "%s run %s --tokens %s -n 128 --temp %g --seed 11 --print-ids --spec %s --draft 4",
             moe_test_bin(), model, ids, temp, spec);
    if (moe_test_run(cmd, &out) != 0) fail_msg("`%s` failed:\n%s", cmd, out);
    const char *stats = strstr(out, "\nspec ");
    if (stats) stats = strchr(stats, ':');
    if (stats && accepted) *accepted |= strtod(stats + 1, NULL) > 1.0;
    char *ids_end = strstr(out, "\nprompt: "); /* the ids, then the stats lines */
    if (ids_end) *ids_end = '\0';
    return out;
}

/* Both ways on 12 prompts; with must_accept, some draft was kept (the verify path ran). */
static void spec_model(const char *rel, const char *kind, float temp, bool must_accept) {
    const char *model = moe_test_shared(rel);
    if (!model) return;
    bool accepted = false;
    for (int i = 0; i < N_PROMPTS; i++) {
        char ids[256];
        prompt_ids(i, ids, sizeof ids);
        char *plain = run_ids(model, ids, "none", temp, NULL);
        char *spec = run_ids(model, ids, kind, temp, &accepted);
        if (strcmp(plain, spec) != 0)
            fail_msg("%s, prompt %s, temp %g: --spec %s printed\n%s\nbut --spec none\n%s", rel, ids,
                     temp, kind, spec, plain);
        free(plain);
        free(spec);
    }
    if (must_accept && !accepted)
        fail_msg("%s: no draft was ever accepted: the verify path did not run", rel);
}

static void spec_equals_plain_greedy(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen3next-f32.gguf"));
    spec_model("parity/qwen3next-f32.gguf", "ngram", 0, true);
    spec_model("parity/kimi-linear-f32.gguf", "ngram", 0, true);
    spec_model("parity/qwen35-mtp-f32.gguf", "ngram", 0, true);
    spec_model("parity/glm5next-f32.gguf", "ngram", 0, true);
    spec_model("models/stories260K/stories260K.gguf", "ngram", 0, true);
    spec_model("parity/qwen35-mtp-f32.gguf", "mtp", 0, false);
    spec_model("parity/glm5next-f32.gguf", "mtp", 0, false);
}

static void spec_equals_plain_sampled(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("models/stories260K/stories260K.gguf"));
    spec_model("models/stories260K/stories260K.gguf", "ngram", 0.8f, true);
    /* a random model at 0.8 picks near-uniformly: drafts rarely survive, equality still holds */
    spec_model("parity/qwen3next-f32.gguf", "ngram", 0.8f, false);
    spec_model("parity/glm5next-f32.gguf", "mtp", 0.8f, false);
}

static int32_t argmax_of(const float *x, uint32_t n) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

/* The trunk runs the fixture's ids 0..16; the head catches up on entries 0..15 (hidden state t
 * with id t + 1) and drafts one token: the argmax of the fixture's MTP row 15. Then it takes the
 * entry of position 16 and drafts three: the first is row 16's argmax, and the chain's entries
 * are taken back (the cache holds 17), so drafting again from a cache rewound to 16 repeats
 * them. */
static void mtp_drafts_are_the_heads(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "parity/%s.gguf", name);
    const char *path = moe_test_shared(rel);
    if (!path) return;
    snprintf(rel, sizeof rel, "parity/%s.mtp.f32", name);
    size_t size;
    float *ref = (float *)moe_test_shared_read(rel, &size);
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    if (!m) fail_msg("%s", err.msg);
    const uint32_t nv = m->cfg.n_vocab, n_embd = m->cfg.n_embd;
    assert_int_equal(size, sizeof(float) * 31 * nv);
    snprintf(rel, sizeof rel, "parity/%s.tokens.json", name);
    char ids_text[1024];
    int32_t ids[32];
    { /* prompt then greedy: the ids the MTP rows were made from */
        char cmd[512], *out;
        snprintf(cmd, sizeof cmd,
                 "python3 -c \"import json;d=json.load(open('%s'));"
                 "print(','.join(map(str,d['prompt']+d['greedy'])))\"",
                 moe_test_shared(rel));
        assert_int_equal(moe_test_run(cmd, &out), 0);
        snprintf(ids_text, sizeof ids_text, "%s", out);
        free(out);
    }
    char *p = ids_text;
    for (int i = 0; i < 32; i++) ids[i] = (int32_t)strtol(p, &p, 10), p += *p == ',';
    moe_ctx_params cp = {.n_ctx = 64, .n_seq = 1, .max_rows = 32, .kv_type = MOE_TYPE_F32};
    moe_ctx *c = moe_ctx_new(m, &cp, &err);
    assert_non_null(c);
    moe_row rows[17];
    for (int i = 0; i < 17; i++) rows[i] = (moe_row){0, i, ids[i], i == 16};
    float *logits = malloc(sizeof(float) * nv), *h = malloc(sizeof(float) * 17 * n_embd);
    assert_int_equal(moe_ctx_decode(c, rows, 17, logits, &err), MOE_OK);
    uint32_t n_h;
    memcpy(h, moe_ctx_hidden(c, &n_h), sizeof(float) * 17 * n_embd);
    assert_int_equal(n_h, 17);
    int32_t drafts[3], again[3];
    assert_int_equal(moe_draft_mtp(c, 0, h, ids + 1, 16, 1, drafts, logits, &err), 1);
    assert_int_equal(drafts[0], argmax_of(ref + 15 * nv, nv));
    assert_int_equal(moe_ctx_mtp_len(c, 0), 16);
    assert_int_equal(moe_draft_mtp(c, 0, h + 16 * n_embd, ids + 17, 1, 3, drafts, logits, &err), 3);
    assert_int_equal(drafts[0], argmax_of(ref + 16 * nv, nv));
    assert_int_equal(moe_ctx_mtp_len(c, 0), 17);
    moe_ctx_mtp_rewind(c, 0, 16);
    assert_int_equal(moe_draft_mtp(c, 0, h + 16 * n_embd, ids + 17, 1, 3, again, logits, &err), 3);
    assert_memory_equal(drafts, again, sizeof drafts);
    free(logits);
    free(h);
    free(ref);
    moe_ctx_free(c);
    moe_model_free(m);
}

static void mtp_drafts(void **state) {
    (void)state;
    mtp_drafts_are_the_heads("qwen35-mtp-f32");
    mtp_drafts_are_the_heads("glm5next-f32");
}

static void spec_option_errors(void **state) {
    (void)state;
    char cmd[512], *out;
    snprintf(cmd, sizeof cmd, "%s run --spec mtp2 -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--spec expects none, ngram or mtp"));
    free(out);
    const char *stories = moe_test_shared("models/stories260K/stories260K.gguf");
    if (stories) { /* a model without an MTP layer */
        snprintf(cmd, sizeof cmd, "%s run %s --spec mtp -n 1", moe_test_bin(), stories);
        assert_int_not_equal(moe_test_run(cmd, &out), 0);
        assert_non_null(strstr(out, "has no multi-token-prediction layer"));
        free(out);
    }
    snprintf(cmd, sizeof cmd, "%s run --spec ngram --draft 99 -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--draft"));
    free(out);
}

int moe_suite_spec(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(spec_equals_plain_greedy),
        cmocka_unit_test(spec_equals_plain_sampled),
        cmocka_unit_test(spec_option_errors),
        cmocka_unit_test(mtp_drafts),
    };
    return cmocka_run_group_tests_name("spec", tests, NULL, NULL);
}
