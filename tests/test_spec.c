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
 * logits at that position, after the head's cache caught up with the trunk.
 * At temperature > 0 the accept/reject rule keeps the target distribution: requests with many
 * seeds through the server's scheduler (--spec ngram) at a context whose draft is known, the
 * token emitted where the draft is verified compared by chi-square with run.c's probabilities
 * there -- over all tokens, and over those emitted where the draft was refused (the target
 * conditioned on differing from the draft); critical values from Wilson-Hilferty.
 * `--spec mtp` inside the server's scheduler: 8 streams at once equal each alone without
 * speculation over three turns (a second that extends the first: the prefix from RAM; a third
 * after a restart: from the disk cache), greedy and seeded at 0.8; and, with each stream's
 * logits biased toward a token its head drafts after it (found by running the head directly),
 * the drafts kept by position among 8 streams equal those of each stream alone, and after a
 * prefix hit those of the whole prompt prefilled. A scheduler that skipped the rollback, or fed
 * a head another row's hidden states, or dropped the kept states at a prefix hit, fails here. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>
#include <unistd.h>

#include "../src/engine/engine.h"
#include "../src/serve/serve_internal.h"

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
    if (stories) { /* serve says so before it listens */
        snprintf(cmd, sizeof cmd, "%s serve %s --spec mtp --port 0", moe_test_bin(), stories);
        assert_int_not_equal(moe_test_run(cmd, &out), 0);
        if (strstr(out, "listening") || !strstr(out, "has no multi-token-prediction layer"))
            fail_msg("moe serve --spec mtp without an MTP layer:\n%s", out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "%s run --spec ngram --draft 99 -n 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--draft"));
    free(out);
}

/* The speculation `moe serve` says it runs (its ready line in the log), without --spec. */
static void serve_spec_default(const char *model, const char *want) {
    char *args[] = {(char *)model, "-t", "1", NULL}, *log;
    moe_test_server srv = {0};
    if (!moe_test_server_start(&srv, "spec-default", args)) fail_msg("no server: %s", srv.log);
    const int rc = moe_test_server_stop(&srv);
    size_t size;
    moe_error err = {0};
    if (moe_file_read(srv.log, (uint8_t **)&log, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
    if (rc != 0 || !memmem(log, size, want, strlen(want)))
        fail_msg("moe serve %s (exit %d) did not say '%s':\n%.*s", model, rc, want, (int)size, log);
    free(log);
}

/* Without --spec, a model with an MTP layer drafts with it (the stats line says so; moe serve
 * too), one without does not speculate. */
static void mtp_is_the_default(void **state) {
    (void)state;
    const char *mtp = moe_test_shared("parity/qwen35-mtp-f32.gguf");
    MOE_SKIP_IF_NULL(mtp);
    const char *plain = moe_test_shared("models/stories260K/stories260K.gguf");
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "%s run %s --tokens 1,403,407 -n 8 --temp 0", moe_test_bin(), mtp);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (!strstr(out, "\nspec mtp: ")) fail_msg("no MTP stats line:\n%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s run %s --tokens 1,403,407 -n 8 --temp 0", moe_test_bin(), plain);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (strstr(out, "\nspec ")) fail_msg("speculation without an MTP layer or --spec:\n%s", out);
    free(out);
    serve_spec_default(mtp, "speculation mtp");
    serve_spec_default(plain, "speculation none");
}

/* ==== The accept/reject rule keeps the target distribution ==== */

#define CHI_SEEDS 3000   /* requests per temperature */
#define CHI_Z     3.0902 /* the normal quantile of 1 - 0.001: the tests' false-alarm rate */

/* Pearson's statistic of counts against n x probs (categories expected below 5 pooled, and the
 * pool folded into the smallest category when it is still below 5); *df its degrees of freedom. */
static double chi_square(const uint32_t *counts, const double *probs, uint32_t n_cat, double n,
                         int *df) {
    double stat = 0, pool_o = 0, pool_e = 0, small_o = 0, small_e = INFINITY;
    int cats = 0;
    for (uint32_t x = 0; x < n_cat; x++) {
        const double e = n * probs[x];
        if (e < 5) {
            pool_o += counts[x];
            pool_e += e;
            continue;
        }
        stat += (counts[x] - e) * (counts[x] - e) / e;
        cats++;
        if (e < small_e) small_e = e, small_o = counts[x];
    }
    if (pool_e >= 5) {
        stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        cats++;
    } else if (pool_e > 0 && cats) { /* fold: the smallest category's term becomes the merged one */
        stat -= (small_o - small_e) * (small_o - small_e) / small_e;
        const double o = small_o + pool_o, e = small_e + pool_e;
        stat += (o - e) * (o - e) / e;
    }
    *df = cats - 1;
    return stat;
}

/* Wilson-Hilferty: the chi-square distribution's quantile at the normal quantile z. */
static double chi_square_critical(int df, double z) {
    const double k = df, a = 2.0 / (9.0 * k);
    return k * pow(1 - a + z * sqrt(a), 3);
}

/* The greedy tokens from BOS and run.c's logits after each of the first 32 (../shared). The
 * context is tokens[0..8]: its last token, 261, came before at position 3, so prompt lookup drafts
 * tokens[4] = 378 after it. The prompt is tokens[0..7] (the 8th, tokens[8], is sampled first with
 * probability 0.999; only requests that sampled it count); max_tokens 3 makes the second sampled
 * token the pick at the draft's row. A logit bias on the draft gives it the largest logit, so that
 * it is kept about half the time and refused the rest. */
static void chi_square_at(serve_sched *sched, serve_metrics *metrics, const int32_t *tokens,
                          const float *logits_runc, float temp) {
    const uint32_t nv = 512, k = 8;
    const int32_t draft = tokens[4];
    const float *row = logits_runc + (size_t)k * nv; /* after feeding tokens[8] */
    float top = row[0];
    for (uint32_t x = 1; x < nv; x++)
        if (row[x] > top) top = row[x];
    const float bias = top - row[draft];
    double probs[512], sum = 0; /* the target: softmax((logits + bias) / temp), in double */
    for (uint32_t x = 0; x < nv; x++)
        sum += probs[x] = exp(((double)row[x] + (x == (uint32_t)draft ? bias : 0) - top) / temp);
    for (uint32_t x = 0; x < nv; x++) probs[x] /= sum;
    uint32_t all[512] = {0}, refused[512] = {0}, n_ctx_ok = 0, n_refused = 0;
    pthread_mutex_lock(&metrics->mu);
    const uint64_t drafted_before = metrics->spec_drafted[0];
    pthread_mutex_unlock(&metrics->mu);
    enum { BATCH = 8 };
    for (uint32_t seed = 0; seed < CHI_SEEDS; seed += BATCH) {
        serve_req *reqs[BATCH];
        for (int b = 0; b < BATCH; b++) {
            serve_req *r = reqs[b] = serve_req_new();
            r->gen.prompt = moe_xmalloc(sizeof(int32_t) * k);
            memcpy(r->gen.prompt, tokens, sizeof(int32_t) * k);
            r->gen.n_prompt = k;
            r->gen.max_tokens = 3;
            r->gen.ignore_eos = true;
            r->gen.bias_tokens = moe_xmalloc(sizeof(int32_t));
            r->gen.bias_values = moe_xmalloc(sizeof(float));
            r->gen.bias_tokens[0] = draft;
            r->gen.bias_values[0] = bias;
            r->gen.sampling = (moe_sampler_params){.temperature = temp,
                                                   .top_p = 1,
                                                   .repeat_penalty = 1,
                                                   .seed = 1000003u * (seed + b) + 17,
                                                   .n_bias = 1};
            assert_int_equal(serve_sched_submit(sched, r), SERVE_SUBMIT_OK);
        }
        for (int b = 0; b < BATCH; b++) {
            serve_taken t = {0};
            int32_t got[3];
            uint32_t n_got = 0;
            while (!t.done) {
                serve_req_take(reqs[b], &t, 5.0);
                for (uint32_t e = 0; e < t.n_events; e++)
                    if (t.events[e].kind == SERVE_EV_TOKEN && n_got < 3)
                        got[n_got++] = t.events[e].sample.token;
            }
            serve_taken_free(&t);
            if (reqs[b]->finish == SERVE_FINISH_ERROR)
                fail_msg("request failed: %s", reqs[b]->error);
            serve_req_release(reqs[b]);
            if (n_got < 2 || got[0] != tokens[k]) continue; /* not at the context */
            n_ctx_ok++;
            all[got[1]]++;
            if (got[1] != draft) n_refused++, refused[got[1]]++;
        }
    }
    pthread_mutex_lock(&metrics->mu);
    const uint64_t drafted = metrics->spec_drafted[0] - drafted_before;
    pthread_mutex_unlock(&metrics->mu);
    if (drafted < n_ctx_ok)
        fail_msg("%u requests reached the context but only %llu drafts were verified", n_ctx_ok,
                 (unsigned long long)drafted);
    int df_all, df_ref;
    const double x_all = chi_square(all, probs, nv, n_ctx_ok, &df_all);
    double cond[512];
    for (uint32_t x = 0; x < nv; x++)
        cond[x] = x == (uint32_t)draft ? 0 : probs[x] / (1 - probs[draft]);
    const double x_ref = chi_square(refused, cond, nv, n_refused, &df_ref);
    const double c_all = chi_square_critical(df_all, CHI_Z),
                 c_ref = chi_square_critical(df_ref, CHI_Z);
    print_message("temperature %g: %u of %u requests at the context, draft kept %u times (target "
                  "%.3f); chi-square all %.2f (df %d, critical %.2f), refused %.2f (df %d, "
                  "critical %.2f)\n",
                  temp, n_ctx_ok, CHI_SEEDS, n_ctx_ok - n_refused, probs[draft], x_all, df_all,
                  c_all, x_ref, df_ref, c_ref);
    if (df_all < 2 || df_ref < 1 || x_all > c_all || x_ref > c_ref)
        fail_msg("temperature %g: the emitted tokens do not follow the target distribution", temp);
}

static void accept_reject_keeps_distribution(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    size_t size;
    float *logits = (float *)moe_test_shared_read(
        "models/stories260K/logits_greedy_bos_first32.runc.f32", &size);
    assert_int_equal(size, sizeof(float) * 32 * 512);
    int32_t tokens[16];
    { /* the greedy ids the logits were made from */
        char cmd[512], *out;
        snprintf(cmd, sizeof cmd,
                 "/usr/bin/python3 -c \"import json;d=json.load(open('%s'));"
                 "print(','.join(map(str,d['tokens'][:16])))\"",
                 moe_test_shared("models/stories260K/greedy_bos_tokens.json"));
        assert_int_equal(moe_test_run(cmd, &out), 0);
        char *p = out;
        for (int i = 0; i < 16; i++) tokens[i] = (int32_t)strtol(p, &p, 10), p += *p == ',';
        free(out);
    }
    moe_serve_params p;
    moe_serve_params_default(&p);
    p.model_path = model;
    p.n_ctx = 64;
    p.parallel = 8;
    p.cache_slots = 8;
    p.kv_type = MOE_TYPE_F32;
    p.spec = MOE_SPEC_NGRAM;
    p.n_draft = 4;
    serve_metrics metrics = {0};
    pthread_mutex_init(&metrics.mu, NULL);
    serve_sched *sched = serve_sched_start(&p, &metrics);
    char err[MOE_ERROR_MSG_MAX];
    if (!serve_sched_wait_loaded(sched, err, sizeof err)) fail_msg("%s", err);
    chi_square_at(sched, &metrics, tokens, logits, 1.0f);
    chi_square_at(sched, &metrics, tokens, logits, 0.7f);
    serve_sched_stop(sched);
    serve_sched_free(sched);
    pthread_mutex_destroy(&metrics.mu);
    free(logits);
}

/* ==== --spec mtp inside the server's scheduler ==== */

#define MTP_STREAMS 8
#define MTP_TOKENS  40
#define MTP_MAX_IDS 200

typedef struct mtp_prompt {
    int32_t ids[MTP_MAX_IDS];
    uint32_t n;
    bool
        prompt_logprobs; /* ask for them: the prompt runs whole, SERVE_PROMPT_LOGPROB_ROWS a step */
} mtp_prompt;

/* A scheduler on model: spec, parallel streams (as many resident), f32 KV, --draft 3, a disk
 * cache in cache_dir (or none). */
static serve_sched *mtp_sched(const char *model, moe_spec_kind spec, int parallel,
                              const char *cache_dir, serve_metrics *metrics) {
    moe_serve_params p;
    moe_serve_params_default(&p);
    p.model_path = model;
    p.n_ctx = 256;
    p.parallel = parallel;
    p.cache_slots = MTP_STREAMS;
    p.kv_type = MOE_TYPE_F32;
    p.spec = spec;
    p.spec_given = true;
    p.n_draft = 3;
    p.n_threads = 1;
    p.cache_dir = cache_dir;
    memset(metrics, 0, sizeof *metrics);
    pthread_mutex_init(&metrics->mu, NULL);
    serve_sched *s = serve_sched_start(&p, metrics);
    char err[MOE_ERROR_MSG_MAX];
    if (!serve_sched_wait_loaded(s, err, sizeof err)) fail_msg("%s", err);
    return s;
}

static void mtp_sched_close(serve_sched *s, serve_metrics *metrics) {
    serve_sched_stop(s);
    serve_sched_free(s);
    pthread_mutex_destroy(&metrics->mu);
}

/* Requests for prompts[0..n) submitted at once; request i samples at temp with seed
 * 7 + seed0 + i, MTP_TOKENS tokens, and with bias[i] >= 0 that token's logit raised by 100.
 * out[i] gets its tokens. */
static void mtp_generate(serve_sched *s, const mtp_prompt *prompts, int n, float temp,
                         const int32_t *bias, int seed0, mtp_prompt *out) {
    serve_req *reqs[MTP_STREAMS];
    for (int i = 0; i < n; i++) {
        serve_req *r = reqs[i] = serve_req_new();
        r->gen.prompt = moe_xmalloc(sizeof(int32_t) * prompts[i].n);
        memcpy(r->gen.prompt, prompts[i].ids, sizeof(int32_t) * prompts[i].n);
        r->gen.n_prompt = prompts[i].n;
        r->gen.max_tokens = MTP_TOKENS;
        r->gen.ignore_eos = true;
        r->gen.prompt_logprobs = prompts[i].prompt_logprobs;
        r->gen.sampling = (moe_sampler_params){.temperature = temp,
                                               .top_p = 1,
                                               .repeat_penalty = 1,
                                               .seed = 7 + (uint64_t)(seed0 + i)};
        if (bias && bias[i] >= 0) {
            r->gen.bias_tokens = moe_xmalloc(sizeof(int32_t));
            r->gen.bias_values = moe_xmalloc(sizeof(float));
            r->gen.bias_tokens[0] = bias[i];
            r->gen.bias_values[0] = 100;
            r->gen.sampling.n_bias = 1;
        }
        assert_int_equal(serve_sched_submit(s, r), SERVE_SUBMIT_OK);
    }
    for (int i = 0; i < n; i++) {
        serve_taken t = {0};
        out[i].n = 0;
        while (!t.done) {
            serve_req_take(reqs[i], &t, 5.0);
            for (uint32_t e = 0; e < t.n_events; e++)
                if (t.events[e].kind == SERVE_EV_TOKEN && out[i].n < MTP_MAX_IDS)
                    out[i].ids[out[i].n++] = t.events[e].sample.token;
        }
        serve_taken_free(&t);
        if (reqs[i]->finish == SERVE_FINISH_ERROR) fail_msg("request failed: %s", reqs[i]->error);
        serve_req_release(reqs[i]);
    }
}

/* The 8 prompts through `spec` at once and one at a time through `plain`: equal, token for
 * token (what: the turn, for the message). */
static void mtp_compare(serve_sched *spec, serve_sched *plain, const mtp_prompt *prompts,
                        float temp, const char *name, const char *what) {
    mtp_prompt got[MTP_STREAMS], alone[MTP_STREAMS];
    mtp_generate(spec, prompts, MTP_STREAMS, temp, NULL, 0, got);
    for (int i = 0; i < MTP_STREAMS; i++)
        mtp_generate(plain, prompts + i, 1, temp, NULL, i, alone + i);
    for (int i = 0; i < MTP_STREAMS; i++) {
        assert_int_equal(got[i].n, MTP_TOKENS);
        for (uint32_t k = 0; k < got[i].n; k++)
            if (got[i].ids[k] != alone[i].ids[k])
                fail_msg("%s, temperature %g, %s, stream %d: token %u is %d among 8 streams with "
                         "--spec mtp but %d alone without speculation",
                         name, temp, what, i, k, got[i].ids[k], alone[i].ids[k]);
    }
}

/* Turn t + 1 of stream i: its prompt, then what it got back, then 3 ids of the user's. */
static void mtp_next_turn(serve_sched *plain, mtp_prompt *prompts, float temp) {
    mtp_prompt out[MTP_STREAMS];
    for (int i = 0; i < MTP_STREAMS; i++)
        mtp_generate(plain, prompts + i, 1, temp, NULL, i, out + i);
    for (int i = 0; i < MTP_STREAMS; i++) {
        mtp_prompt *p = &prompts[i];
        MOE_CHECK(p->n + out[i].n + 3 <= MTP_MAX_IDS);
        memcpy(p->ids + p->n, out[i].ids, sizeof(int32_t) * out[i].n);
        p->n += out[i].n;
        for (int k = 0; k < 3; k++) p->ids[p->n++] = 300 + 17 * i + k;
    }
}

/* 8 streams through the scheduler with --spec mtp equal each one alone without speculation:
 * a first turn, a second that extends it (the prefix reused from RAM: the head goes on from
 * the hidden states its slot kept), and after a restart a third one whose prefix comes from the
 * disk cache (the head starts again after it). Greedy, and sampled with a seed per stream. */
static void mtp_turns(const char *name, float temp) {
    char rel[256], dir[700];
    snprintf(rel, sizeof rel, "parity/%s.gguf", name);
    const char *model = moe_test_shared(rel);
    if (!model) return;
    snprintf(dir, sizeof dir, "%s/mtp-cache-%s-%g", moe_test_tmpdir(), name, temp);
    serve_metrics mp, ms;
    serve_sched *plain = mtp_sched(model, MOE_SPEC_NONE, 1, NULL, &mp);
    serve_sched *spec = mtp_sched(model, MOE_SPEC_MTP, MTP_STREAMS, dir, &ms);
    mtp_prompt prompts[MTP_STREAMS] = {0};
    for (int i = 0; i < MTP_STREAMS; i++) {
        char ids[256];
        prompt_ids(i, ids, sizeof ids);
        char *p = ids;
        prompts[i].n = 0;
        while (*p) prompts[i].ids[prompts[i].n++] = (int32_t)strtol(p, &p, 10), p += *p == ',';
    }
    mtp_compare(spec, plain, prompts, temp, name, "first turn");
    mtp_next_turn(plain, prompts, temp);
    mtp_compare(spec, plain, prompts, temp, name, "second turn (prefix from RAM)");
    if (ms.prefix_hits < MTP_STREAMS || ms.spec_drafted[0] == 0)
        fail_msg("%s: %llu prefix hits, %llu drafts: the second turn reused no prefix or nothing "
                 "was drafted",
                 name, (unsigned long long)ms.prefix_hits, (unsigned long long)ms.spec_drafted[0]);
    mtp_sched_close(spec, &ms);
    spec = mtp_sched(model, MOE_SPEC_MTP, MTP_STREAMS, dir, &ms);
    mtp_next_turn(plain, prompts, temp);
    mtp_compare(spec, plain, prompts, temp, name, "third turn after a restart (prefix from disk)");
    if (ms.disk_hits < MTP_STREAMS)
        fail_msg("%s: %llu of 8 prefixes came from the disk cache after the restart", name,
                 (unsigned long long)ms.disk_hits);
    for (int i = 0; i < MTP_STREAMS; i++) prompts[i].prompt_logprobs = true;
    mtp_compare(spec, plain, prompts, temp, name, "the third turn's prompts with logprobs");
    print_message("%s, temperature %g: 3 turns of 8 streams equal alone without speculation "
                  "(after the restart: %llu prefixes from disk, %llu drafts verified)\n",
                  name, temp, (unsigned long long)ms.disk_hits,
                  (unsigned long long)ms.spec_drafted[0]);
    mtp_sched_close(spec, &ms);
    mtp_sched_close(plain, &mp);
}

static void mtp_in_the_scheduler(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen35-mtp-f32.gguf"));
    mtp_turns("qwen35-mtp-f32", 0);
    mtp_turns("qwen35-mtp-f32", 0.8f);
    mtp_turns("glm5next-f32", 0);
    mtp_turns("glm5next-f32", 0.8f);
}

/* A token d that the MTP head, having taken prompt p's entries and then (p's last position,
 * d), drafts again; false when there is none. The engine is run here directly (its drafts are
 * the fixture's MTP logits' argmax: mtp_drafts). */
static bool head_fixed_point(const moe_model *m, const mtp_prompt *p, int32_t *d) {
    const uint32_t nv = m->cfg.n_vocab, n_embd = m->cfg.n_embd;
    moe_error err = {0};
    moe_ctx_params cp = {.n_ctx = 256, .n_seq = 1, .max_rows = 256, .kv_type = MOE_TYPE_F32};
    moe_ctx *c = moe_ctx_new(m, &cp, &err);
    assert_non_null(c);
    float *logits = malloc(sizeof(float) * nv), *h = malloc(sizeof(float) * p->n * n_embd);
    moe_row rows[MTP_MAX_IDS];
    for (uint32_t k = 0; k < p->n; k++) rows[k] = (moe_row){0, (int32_t)k, p->ids[k], false};
    assert_int_equal(moe_ctx_decode(c, rows, p->n, logits, &err), MOE_OK);
    uint32_t n_h;
    memcpy(h, moe_ctx_hidden(c, &n_h), sizeof(float) * p->n * n_embd);
    moe_draft_mtp(c, 0, h, p->ids + 1, p->n - 1, 0, NULL, logits, &err);
    assert_int_equal(err.code, MOE_OK);
    const uint32_t base = moe_ctx_mtp_len(c, 0);
    bool found = false;
    for (int32_t x = 3; x < (int32_t)nv && !found; x++) {
        int32_t draft;
        assert_int_equal(
            moe_draft_mtp(c, 0, h + (size_t)(p->n - 1) * n_embd, &x, 1, 1, &draft, logits, &err),
            1);
        moe_ctx_mtp_rewind(c, 0, base);
        if (draft == x) found = true, *d = x;
    }
    free(logits);
    free(h);
    moe_ctx_free(c);
    return found;
}

/* A prompt of 12 ids (BOS, then a seeded walk over the vocabulary) with a fixed point d of its
 * head; false when none of 64 has one. */
static bool mtp_fixed_point(const moe_model *m, uint32_t *walk, mtp_prompt *p, int32_t *d) {
    for (int tries = 0; tries < 64; tries++) {
        p->n = 12;
        p->ids[0] = 1;
        for (uint32_t k = 1; k < p->n; k++) {
            *walk = *walk * 1103515245u + 12345u;
            p->ids[k] = 3 + (int32_t)((*walk >> 8) % (m->cfg.n_vocab - 3));
        }
        if (head_fixed_point(m, p, d)) return true;
    }
    return false;
}

/* Replies of the 8 prompts through `spec` at once equal `plain`'s alone; *drafted, *accepted
 * get what the step added to spec's counters by draft position. */
static void mtp_counted(serve_sched *spec, serve_metrics *ms, serve_sched *plain,
                        const mtp_prompt *prompts, const int32_t *bias, mtp_prompt *got,
                        uint64_t *drafted, uint64_t *accepted, const char *name) {
    uint64_t d0[MOE_SPEC_MAX_DRAFT], a0[MOE_SPEC_MAX_DRAFT];
    memcpy(d0, ms->spec_drafted, sizeof d0);
    memcpy(a0, ms->spec_accepted, sizeof a0);
    mtp_generate(spec, prompts, MTP_STREAMS, 0, bias, 0, got);
    for (int k = 0; k < MOE_SPEC_MAX_DRAFT; k++) {
        drafted[k] = ms->spec_drafted[k] - d0[k];
        accepted[k] = ms->spec_accepted[k] - a0[k];
    }
    for (int i = 0; i < MTP_STREAMS; i++) {
        mtp_prompt none;
        mtp_generate(plain, prompts + i, 1, 0, bias + i, i, &none);
        if (memcmp(got[i].ids, none.ids, sizeof(int32_t) * MTP_TOKENS) != 0)
            fail_msg("%s, stream %d: the reply with --spec mtp differs from the one without", name,
                     i);
    }
}

static bool counts_equal(const uint64_t *a, const uint64_t *b, const uint64_t *c,
                         const uint64_t *d) {
    return memcmp(a, b, sizeof(uint64_t) * MOE_SPEC_MAX_DRAFT) == 0 &&
           memcmp(c, d, sizeof(uint64_t) * MOE_SPEC_MAX_DRAFT) == 0;
}

/* Drafts accepted: each stream's logits biased toward a token its head drafts after it, so
 * that its first draft is kept (and later ones where the head drafts it again). Every stream's
 * head is fed its own hidden states, whatever shares its steps: the drafts kept and verified by
 * position over 8 streams at once equal the sum of each stream run alone. A second turn that
 * extends the first reuses the prefix and the head goes on from the hidden states its slot
 * kept: its counts equal those of the same prompts prefilled whole in a fresh scheduler. The
 * replies equal the ones without speculation. */
static void mtp_accepted(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "parity/%s.gguf", name);
    const char *model = moe_test_shared(rel);
    if (!model) return;
    moe_error err = {0};
    moe_model *m = moe_model_load(model, &err);
    if (!m) fail_msg("%s", err.msg);
    mtp_prompt prompts[MTP_STREAMS] = {0}, got[MTP_STREAMS], alone[MTP_STREAMS];
    int32_t bias[MTP_STREAMS];
    uint32_t walk = 2026;
    for (int i = 0; i < MTP_STREAMS; i++)
        if (!mtp_fixed_point(m, &walk, &prompts[i], &bias[i]))
            fail_msg("%s: no prompt of 64 whose MTP head drafts its own input token", name);
    serve_metrics ms, ma, mp;
    serve_sched *spec = mtp_sched(model, MOE_SPEC_MTP, MTP_STREAMS, NULL, &ms);
    serve_sched *one = mtp_sched(model, MOE_SPEC_MTP, 1, NULL, &ma);
    serve_sched *plain = mtp_sched(model, MOE_SPEC_NONE, 1, NULL, &mp);
    uint64_t drafted[MOE_SPEC_MAX_DRAFT], accepted[MOE_SPEC_MAX_DRAFT];
    mtp_counted(spec, &ms, plain, prompts, bias, got, drafted, accepted, name);
    for (int i = 0; i < MTP_STREAMS; i++)
        mtp_generate(one, prompts + i, 1, 0, bias + i, i, alone + i);
    print_message("%s: drafts kept by position, 8 streams / alone:", name);
    for (int k = 0; k < 3; k++)
        print_message(" %llu of %llu / %llu of %llu", (unsigned long long)accepted[k],
                      (unsigned long long)drafted[k], (unsigned long long)ma.spec_accepted[k],
                      (unsigned long long)ma.spec_drafted[k]);
    print_message("\n");
    if (accepted[0] < MTP_STREAMS)
        fail_msg("%s: %llu first drafts kept, not even each stream's first", name,
                 (unsigned long long)accepted[0]);
    if (!counts_equal(drafted, ma.spec_drafted, accepted, ma.spec_accepted))
        fail_msg("%s: the drafts among 8 streams are not the ones each stream makes alone", name);
    mtp_sched_close(one, &ma);
    int n_fixed = 0;
    for (int i = 0; i < MTP_STREAMS; i++) { /* the second turn: reply and 3 more ids */
        mtp_prompt *p = &prompts[i];
        memcpy(p->ids + p->n, got[i].ids, sizeof(int32_t) * got[i].n);
        p->n += got[i].n;
        for (int k = 0; k < 3; k++) p->ids[p->n++] = 300 + 17 * i + k;
        /* biased to the whole prompt's fixed point, where it has one */
        if (!head_fixed_point(m, p, &bias[i])) bias[i] = -1;
        n_fixed += bias[i] >= 0;
    }
    moe_model_free(m);
    const uint64_t hits = ms.prefix_hits;
    mtp_counted(spec, &ms, plain, prompts, bias, got, drafted, accepted, name);
    if (ms.prefix_hits - hits < MTP_STREAMS)
        fail_msg("%s: the second turn reused %llu prefixes", name,
                 (unsigned long long)(ms.prefix_hits - hits));
    serve_metrics mf;
    serve_sched *fresh = mtp_sched(model, MOE_SPEC_MTP, MTP_STREAMS, NULL, &mf);
    uint64_t fresh_drafted[MOE_SPEC_MAX_DRAFT], fresh_accepted[MOE_SPEC_MAX_DRAFT];
    mtp_counted(fresh, &mf, plain, prompts, bias, got, fresh_drafted, fresh_accepted, name);
    print_message("%s: second turn, kept at position 1: %llu of %llu after the prefix hit, %llu "
                  "of %llu prefilled whole\n",
                  name, (unsigned long long)accepted[0], (unsigned long long)drafted[0],
                  (unsigned long long)fresh_accepted[0], (unsigned long long)fresh_drafted[0]);
    if (accepted[0] < (uint64_t)n_fixed || !n_fixed)
        fail_msg("%s: %d second-turn prompts have a fixed point, %llu first drafts kept", name,
                 n_fixed, (unsigned long long)accepted[0]);
    if (!counts_equal(drafted, fresh_drafted, accepted, fresh_accepted))
        fail_msg("%s: after the prefix hit the head drafts otherwise than on the whole prompt",
                 name);
    mtp_sched_close(fresh, &mf);
    mtp_sched_close(spec, &ms);
    mtp_sched_close(plain, &mp);
}

static void mtp_drafts_accepted(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("parity/qwen35-mtp-f32.gguf"));
    mtp_accepted("qwen35-mtp-f32");
    mtp_accepted("glm5next-f32");
}

int moe_suite_spec(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(spec_equals_plain_greedy),
        cmocka_unit_test(spec_equals_plain_sampled),
        cmocka_unit_test(spec_option_errors),
        cmocka_unit_test(mtp_drafts),
        cmocka_unit_test(mtp_is_the_default),
        cmocka_unit_test(accept_reject_keeps_distribution),
        cmocka_unit_test(mtp_in_the_scheduler),
        cmocka_unit_test(mtp_drafts_accepted),
    };
    return cmocka_run_group_tests_name("spec", tests, NULL, NULL);
}
