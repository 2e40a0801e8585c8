/* Suite "spec": speculative decoding changes speed, never tokens. `moe run --spec ngram` (drafts
 * from the tokens so far, verified in one step, refused ones taken back -- the recurrent state
 * too) prints exactly what `--spec none` prints: on every hybrid fixture (Gated DeltaNet, KDA,
 * Qwen3.8's tiled GDN) and on stories260K, 12 prompts each, 128 tokens, greedy; and at
 * temperature 0.8 (a draft is kept only where the sampler, drawing as it would step by step,
 * picks it). The stats line shows drafts were accepted, so the verify path really ran. A drafter
 * that skipped the recurrent-state rollback fails here on the hybrids (and in the linear suite's
 * verify_accept_exact, which checks the rollback itself). */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    const char *stats = strstr(out, "spec ngram: ");
    if (stats && accepted) *accepted |= strtod(stats + 12, NULL) > 1.0;
    char *ids_end = strstr(out, "\nprompt: "); /* the ids, then the stats lines */
    if (ids_end) *ids_end = '\0';
    return out;
}

/* Both ways on 12 prompts; with must_accept, some draft was kept (the verify path ran). */
static void spec_model(const char *rel, float temp, bool must_accept) {
    const char *model = moe_test_shared(rel);
    if (!model) return;
    bool accepted = false;
    for (int i = 0; i < N_PROMPTS; i++) {
        char ids[256];
        prompt_ids(i, ids, sizeof ids);
        char *plain = run_ids(model, ids, "none", temp, NULL);
        char *spec = run_ids(model, ids, "ngram", temp, &accepted);
        if (strcmp(plain, spec) != 0)
            fail_msg("%s, prompt %s, temp %g: --spec ngram printed\n%s\nbut --spec none\n%s", rel,
                     ids, temp, spec, plain);
        free(plain);
        free(spec);
    }
    if (must_accept && !accepted)
        fail_msg("%s: no draft was ever accepted: the verify path did not run", rel);
}

static void spec_equals_plain_greedy(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen3next-f32.gguf"));
    spec_model("parity/qwen3next-f32.gguf", 0, true);
    spec_model("parity/kimi-linear-f32.gguf", 0, true);
    spec_model("parity/qwen35-mtp-f32.gguf", 0, true);
    spec_model("models/stories260K/stories260K.gguf", 0, true);
}

static void spec_equals_plain_sampled(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("models/stories260K/stories260K.gguf"));
    spec_model("models/stories260K/stories260K.gguf", 0.8f, true);
    /* a random model at 0.8 picks near-uniformly: drafts rarely survive, equality still holds */
    spec_model("parity/qwen3next-f32.gguf", 0.8f, false);
}

static void spec_option_errors(void **state) {
    (void)state;
    char cmd[512], *out;
    snprintf(cmd, sizeof cmd, "%s run --spec mtp2 -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--spec expects ngram or none"));
    free(out);
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
    };
    return cmocka_run_group_tests_name("spec", tests, NULL, NULL);
}
