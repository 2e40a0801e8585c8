/* Suite "eval": `moe eval labels | compare | kl` against computations we did not write -- numpy
 * over `moe logits` dumps and Python's own splitmix64 + numpy.percentile (tests/eval_ref.py).
 *
 *   labels: every label's summed log-probability and the choice equal numpy's log-softmax of
 *           the logits `moe logits` gives for prompt + label (text and chat records, on
 *           stories260K with ChatML control tokens and Qwen3's template);
 *   labels through `moe serve` (its /tokenize, /apply-template and /v1/completions echo)
 *           equal the direct engine path: the same ids, choices, and sums within float rounding;
 *   compare: accuracies, difference, interval and flipped records equal Python's on the same
 *           resampling indices;
 *   kl: a model against itself is 0 everywhere with equal perplexities; llama-q8_0 against an
 *           F32 copy of its dequantized weights equals numpy's KL over both models' logits;
 *   and malformed records end with an error naming the file, the line and the field. */
#include "testutil.h"

#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../src/format/format.h"

#define PY            "/usr/bin/python3 tests/eval_ref.py"
#define CHAT_TEMPLATE "templates/Qwen-Qwen3-0.6B.jinja"
#define N_VOCAB       512 /* the stories260K vocabulary every fixture model uses */

/* ==== Helpers ==== */

static char *run_ok(const char *cmd) {
    char *out;
    if (moe_test_run(cmd, &out) != 0) fail_msg("%s:\n%s", cmd, out);
    return out;
}

static json_t *run_json(const char *cmd) {
    char *out = run_ok(cmd);
    json_error_t jerr;
    /* the JSON is the last line (warnings may come before it) */
    char *last = out + strlen(out);
    while (last > out && last[-1] == '\n') *--last = '\0';
    while (last > out && last[-1] != '\n') last--;
    json_t *j = json_loads(last, 0, &jerr);
    if (!j) fail_msg("%s: not JSON: %s", cmd, out);
    free(out);
    return j;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static json_t *read_lines(const char *path) {
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    json_t *arr = json_array();
    char line[1 << 16];
    while (fgets(line, sizeof line, f)) {
        json_error_t jerr;
        json_t *j = json_loads(line, 0, &jerr);
        if (!j) fail_msg("%s: bad line: %s", path, line);
        json_array_append_new(arr, j);
    }
    fclose(f);
    return arr;
}

static double num(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    if (!json_is_number(v)) fail_msg("no number \"%s\"", key);
    return json_number_value(v);
}

static void assert_close(double got, double want, double tol, const char *what) {
    if (!(fabs(got - want) <= tol))
        fail_msg("%s: %.17g, expected %.17g (tolerance %g)", what, got, want, tol);
}

/* "1,2,3" of an array of ids, appended to b */
static void ids_text(moe_strbuf *b, json_t *arr) {
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v)
        moe_strbuf_printf(b, "%s%lld", b->len ? "," : "", (long long)json_integer_value(v));
}

/* The records every labels test scores: text, options (reversed with --reverse-options), chat. */
static const char *labels_records(void) {
    static char path[512];
    snprintf(path, sizeof path, "%s/records.jsonl", moe_test_tmpdir());
    write_text(path,
               "{\"id\": \"girl\", \"prompt\": \"Once upon a time, there was a little\", "
               "\"labels\": [\"girl\", \"dog\", \"car\"], \"answer\": 0}\n"
               "{\"id\": 7, \"prompt\": \"Lily and Tom went to the\", \"labels\": [\"park\", "
               "\"big red ball\", \"sea\"], \"answer\": \"park\"}\n"
               "{\"prompt\": \"Pick one:\\n{options}\\nAnswer:\", \"labels\": [\"A\", \"B\", "
               "\"C\"], \"options\": [\"red\", \"green\", \"blue\"], \"answer\": 2}\n"
               "{\"id\": \"chat\", \"messages\": [{\"role\": \"user\", \"content\": \"Is the sky "
               "blue? {options}\"}], \"labels\": [\"yes\", \"no\", \"maybe\"], \"options\": "
               "[\"it is\", \"it is not\", \"who knows\"], \"answer\": 0}\n"
               "{\"id\": \"noanswer\", \"prompt\": \"The cat sat on the\", \"labels\": [\"mat\", "
               "\"dog\"]}\n"
               /* more labels than are scored side by side (MOE_EVAL_LABEL_SEQS) */
               "{\"id\": \"many\", \"prompt\": \"She saw a\", \"labels\": [\"cat\", \"dog\", "
               "\"bird\", \"tree\", \"big dog\", \"ball\", \"car\", \"house\", \"red ball\", "
               "\"boy\"], \"answer\": 5}\n");
    return path;
}

/* ==== labels ==== */

static void labels_check(const char *model) {
    const char *tmp = moe_test_tmpdir();
    char cmd[8192], out[512];
    snprintf(out, sizeof out, "%s/labels-engine.jsonl", tmp);
    snprintf(cmd, sizeof cmd, "%s eval labels %s --records %s --reverse-options --ids -o %s",
             moe_test_bin(), model, labels_records(), out);
    free(run_ok(cmd));
    json_t *res = read_lines(out);
    assert_int_equal(json_array_size(res), 8); /* 6 records, 2 reversed copies */
    /* every label's logits from `moe logits`, then numpy's sums */
    size_t i;
    json_t *r;
    json_array_foreach(res, i, r) {
        json_t *label_ids = json_object_get(r, "label_ids");
        for (size_t k = 0; k < json_array_size(label_ids); k++) {
            moe_strbuf ids = {0};
            ids_text(&ids, json_object_get(r, "prompt_ids"));
            ids_text(&ids, json_array_get(label_ids, k));
            snprintf(cmd, sizeof cmd, "%s logits %s --tokens %s --out %s/r%zu_l%zu.f32",
                     moe_test_bin(), model, ids.s, tmp, i, k);
            free(run_ok(cmd));
            moe_strbuf_free(&ids);
        }
    }
    snprintf(cmd, sizeof cmd, PY " labels %s %s %d", out, tmp, N_VOCAB);
    json_t *ref = run_json(cmd);
    json_array_foreach(res, i, r) {
        json_t *want = json_array_get(json_object_get(ref, "logprobs"), i);
        json_t *got = json_object_get(r, "logprobs");
        assert_int_equal(json_array_size(got), json_array_size(want));
        for (size_t k = 0; k < json_array_size(got); k++) {
            char what[128];
            snprintf(what, sizeof what, "record %zu label %zu", i, k);
            assert_close(json_number_value(json_array_get(got, k)),
                         json_number_value(json_array_get(want, k)), 1e-4, what);
        }
        assert_int_equal(json_integer_value(json_object_get(r, "pred")),
                         json_integer_value(json_array_get(json_object_get(ref, "pred"), i)));
    }
    /* the reversed copy lists the options the other way round and mirrors the answer */
    json_t *orig = json_array_get(res, 2), *rev = json_array_get(res, 3);
    assert_true(json_is_true(json_object_get(rev, "reversed")));
    assert_int_equal(json_integer_value(json_object_get(orig, "answer")), 2);
    assert_int_equal(json_integer_value(json_object_get(rev, "answer")), 0);
    assert_int_not_equal(json_array_size(json_object_get(orig, "prompt_ids")), 0);
    json_decref(ref);
    json_decref(res);
}

static void labels_equal_numpy(void **state) {
    (void)state;
    const char *model = moe_test_chat_model("eval-chat", CHAT_TEMPLATE);
    MOE_SKIP_IF_NULL(model);
    labels_check(model);
}

/* a hybrid model: the labels copy the prompt's Gated DeltaNet state from a snapshot */
static void labels_equal_numpy_hybrid(void **state) {
    (void)state;
    const char *model = moe_test_shared("parity/qwen3next-f32.gguf");
    MOE_SKIP_IF_NULL(model);
    labels_check(model);
}

/* `moe serve MODEL --kv-type f32 --port 0 &`: its pid, and its URL once it is ready. */
static pid_t serve_start(const char *model, char *url, size_t url_size) {
    char cmd[2048], log[512];
    snprintf(log, sizeof log, "%s/eval-serve.log", moe_test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s serve %s --kv-type f32 --port 0 >%s 2>&1 & echo $!",
             moe_test_bin(), model, log);
    char *out = run_ok(cmd);
    const pid_t pid = (pid_t)atol(out);
    free(out);
    for (int tries = 0; tries < 600; tries++) { /* up to 60 s (ASan builds load slowly) */
        uint8_t *text;
        size_t len;
        moe_error err = {0};
        if (moe_file_read(log, &text, &len, &err) == MOE_OK) {
            const char *at = strstr((char *)text, "listening on ");
            const bool ready = strstr((char *)text, "moe serve: ready") != NULL;
            if (at && ready) sscanf(at + 13, "%255s", url);
            free(text);
            if (at && ready) return pid;
        }
        struct timespec d = {0, 100 * 1000000L};
        nanosleep(&d, NULL);
    }
    kill(pid, SIGTERM);
    fail_msg("moe serve did not start; its log: %s", log);
    (void)url_size;
    return -1;
}

/* POST an echo with max_tokens 0 (the reply, or NULL) */
static json_t *echo_request(const char *url) {
    char endpoint[300];
    snprintf(endpoint, sizeof endpoint, "%s/v1/completions", url);
    static const char body[] = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 0, \"echo\": "
                               "true, \"logprobs\": 2}";
    moe_http *h = moe_http_new();
    moe_strbuf reply = {0};
    long status = 0;
    moe_error err = {0};
    json_error_t jerr;
    json_t *j = NULL;
    if (moe_http_post_json(h, endpoint, body, strlen(body), NULL, &reply, &status, &err) ==
            MOE_OK &&
        status == 200)
        j = json_loads(reply.s, 0, &jerr);
    moe_strbuf_free(&reply);
    moe_http_free(h);
    return j;
}

/* echo with max_tokens 0: the prompt's text and its log-probabilities, nothing generated */
static void echo_check(json_t *j) {
    assert_non_null(j);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *lp = json_object_get(c, "logprobs"), *tl = json_object_get(lp, "token_logprobs");
    assert_string_equal(json_string_value(json_object_get(c, "text")), "Once upon a time");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    const size_t n =
        (size_t)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    assert_true(n >= 2);
    assert_int_equal(json_array_size(tl), n);
    assert_true(json_is_null(json_array_get(tl, 0)));
    assert_true(json_is_null(json_array_get(json_object_get(lp, "top_logprobs"), 0)));
    for (size_t i = 1; i < n; i++) {
        assert_true(json_number_value(json_array_get(tl, i)) < 0);
        assert_int_equal(json_object_size(json_array_get(json_object_get(lp, "top_logprobs"), i)),
                         2);
    }
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 0);
    json_decref(j);
}

static void labels_url_equal_engine(void **state) {
    (void)state;
    const char *model = moe_test_chat_model("eval-chat-url", CHAT_TEMPLATE);
    MOE_SKIP_IF_NULL(model);
    const char *tmp = moe_test_tmpdir();
    char url[256] = "", cmd[4096], a[512], b[512];
    const pid_t pid = serve_start(model, url, sizeof url);
    snprintf(a, sizeof a, "%s/labels-a.jsonl", tmp);
    snprintf(b, sizeof b, "%s/labels-b.jsonl", tmp);
    snprintf(cmd, sizeof cmd, "%s eval labels %s --records %s --reverse-options --ids -o %s",
             moe_test_bin(), model, labels_records(), a);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s eval labels %s/v1 --records %s --reverse-options --ids -o %s",
             moe_test_bin(), url, labels_records(), b);
    char *log;
    const int rc = moe_test_run(cmd, &log);
    json_t *echo = echo_request(url);
    kill(pid, SIGTERM);
    echo_check(echo);
    if (rc != 0) fail_msg("%s:\n%s", cmd, log);
    free(log);
    json_t *ra = read_lines(a), *rb = read_lines(b);
    assert_int_equal(json_array_size(ra), json_array_size(rb));
    for (size_t i = 0; i < json_array_size(ra); i++) {
        json_t *x = json_array_get(ra, i), *y = json_array_get(rb, i);
        assert_true(json_equal(json_object_get(x, "prompt_ids"), json_object_get(y, "prompt_ids")));
        assert_true(json_equal(json_object_get(x, "label_ids"), json_object_get(y, "label_ids")));
        assert_true(json_equal(json_object_get(x, "pred"), json_object_get(y, "pred")));
        json_t *lx = json_object_get(x, "logprobs"), *ly = json_object_get(y, "logprobs");
        for (size_t k = 0; k < json_array_size(lx); k++)
            assert_close(json_number_value(json_array_get(ly, k)),
                         json_number_value(json_array_get(lx, k)), 1e-4, "server vs engine");
    }
    json_decref(ra);
    json_decref(rb);
}

static void labels_bad_records(void **state) {
    (void)state;
    static const struct {
        const char *line2, *expect;
    } cases[] = {
        {"{\"prompt\": \"x\"}", "labels: expected an array"},
        {"{\"prompt\": \"x\", \"labels\": [\"a\", \"b\"], \"answer\": 5}", "answer: 5 is not"},
        {"{\"prompt\": \"x\", \"messages\": [], \"labels\": [\"a\", \"b\"]}", "not both"},
        {"{\"prompt\": \"x\", \"labels\": [\"a\", \"b\"], \"options\": [\"p\", \"q\"]}",
         "holds no {options}"},
        {"{\"prompt\": \"x\", \"labels\": [\"a\", 3]}", "labels[1]"},
        {"{\"prompt\": \"x\", \"labels\": [\"a\", \"b\"], \"answer\": \"c\"}", "\"c\" is not one"},
        {"{\"prompt\": \"x\", \"labels\": [\"a\", \"b\"]", "r.jsonl:2:"},
    };
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char path[512], cmd[2048], text[512];
        snprintf(path, sizeof path, "%s/r.jsonl", moe_test_tmpdir());
        snprintf(text, sizeof text, "{\"prompt\": \"ok\", \"labels\": [\"a\", \"b\"]}\n%s\n",
                 cases[c].line2);
        write_text(path, text);
        snprintf(cmd, sizeof cmd, "%s eval labels %s --records %s", moe_test_bin(), model, path);
        char *out;
        assert_int_equal(moe_test_run(cmd, &out), 1);
        if (!strstr(out, "r.jsonl:2") || !strstr(out, cases[c].expect))
            fail_msg("case %zu: expected '%s' at r.jsonl:2, got: %s", c, cases[c].expect, out);
        free(out);
    }
}

/* compare and kl refuse bad input with the place named, exit status 1 */
static void compare_kl_bad_input(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    char bad[512], dup_a[512], dup_b[512], cmd[4096];
    snprintf(bad, sizeof bad, "%s/bad-results.jsonl", moe_test_tmpdir());
    snprintf(dup_a, sizeof dup_a, "%s/dup-a.jsonl", moe_test_tmpdir());
    snprintf(dup_b, sizeof dup_b, "%s/dup-b.jsonl", moe_test_tmpdir());
    write_text(bad,
               "{\"id\": \"a\", \"pred\": 0, \"answer\": 0}\n{\"id\": \"b\", \"pred\": \"x\"}\n");
    write_text(dup_a, "{\"id\": \"dup\", \"pred\": 0, \"answer\": 0}\n");
    write_text(dup_b, "{\"id\": \"dup\", \"pred\": 0, \"answer\": 0}\n"
                      "{\"id\": \"dup\", \"pred\": 1, \"answer\": 0}\n");
    const struct {
        const char *args, *first, *second, *expect;
    } cases[] = {
        {"compare %s %s", bad, bad, "bad-results.jsonl:2: expected a result"},
        {"compare %s %s", dup_a, dup_b, "B: record dup appears twice"},
        {"kl %s --ref %s --tokens 1,2,3 --ctx 8", model, model,
         "3 tokens: fewer than one chunk of --ctx 8"},
        {"kl %s --ref %s --tokens 1,2,3,4,5,6,7,99999 --ctx 8", model, model,
         "token 7: id 99999 is not below 512"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int len = snprintf(cmd, sizeof cmd, "%s eval ", moe_test_bin());
        snprintf(cmd + len, sizeof cmd - (size_t)len, cases[c].args, cases[c].first,
                 cases[c].second);
        char *out;
        assert_int_equal(moe_test_run(cmd, &out), 1);
        if (!strstr(out, cases[c].expect))
            fail_msg("%s: expected '%s', got: %s", cmd, cases[c].expect, out);
        free(out);
    }
}

/* ==== compare ==== */

static void write_results(const char *path, uint64_t seed, double p_right, size_t n) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        const int answer = (int)(i % 3);
        const int pred = moe_rng_uniform(&s) < p_right ? answer : (answer + 1) % 3;
        fprintf(f, "{\"id\":\"r%zu\",\"reversed\":%s,\"pred\":%d,\"answer\":%d,\"correct\":%s}\n",
                i / 2, i % 2 ? "true" : "false", pred, answer, pred == answer ? "true" : "false");
    }
    /* a record only this file has, and one without an answer: neither is compared */
    fprintf(f, "{\"id\":\"only-%" PRIu64 "\",\"pred\":0,\"answer\":0}\n", seed);
    fprintf(f, "{\"id\":\"unknown\",\"pred\":1,\"answer\":null}\n");
    fclose(f);
}

static void compare_equals_python(void **state) {
    (void)state;
    char a[512], b[512], cmd[2048];
    snprintf(a, sizeof a, "%s/cmp-a.jsonl", moe_test_tmpdir());
    snprintf(b, sizeof b, "%s/cmp-b.jsonl", moe_test_tmpdir());
    write_results(a, 11, 0.6, 240);
    write_results(b, 12, 0.7, 240);
    snprintf(cmd, sizeof cmd, "%s eval compare %s %s --resamples 2000 --seed 42 --json",
             moe_test_bin(), a, b);
    json_t *got = run_json(cmd);
    snprintf(cmd, sizeof cmd, PY " compare %s %s 2000 42", a, b);
    json_t *want = run_json(cmd);
    assert_int_equal(num(got, "n"), 240);
    assert_int_equal(num(want, "n"), 240);
    assert_int_equal(num(got, "only_a"), 1);
    assert_int_equal(num(got, "only_b"), 1);
    assert_close(num(got, "accuracy_a"), num(want, "accuracy_a"), 1e-15, "accuracy A");
    assert_close(num(got, "accuracy_b"), num(want, "accuracy_b"), 1e-15, "accuracy B");
    assert_close(num(got, "diff"), num(want, "diff"), 1e-15, "difference");
    json_t *ci = json_object_get(got, "ci95");
    assert_close(json_number_value(json_array_get(ci, 0)), num(want, "lo"), 1e-12, "2.5 %");
    assert_close(json_number_value(json_array_get(ci, 1)), num(want, "hi"), 1e-12, "97.5 %");
    assert_true(json_number_value(json_array_get(ci, 0)) <
                json_number_value(json_array_get(ci, 1)));
    assert_true(json_equal(json_object_get(got, "flipped"), json_object_get(want, "flipped")));
    assert_int_equal(num(got, "a_right_b_wrong") + num(got, "a_wrong_b_right"),
                     json_array_size(json_object_get(want, "flipped")));
    json_decref(got);
    json_decref(want);
    /* another seed moves the interval; fewer than 2000 resamples are refused */
    snprintf(cmd, sizeof cmd, "%s eval compare %s %s --resamples 2000 --seed 43 --json",
             moe_test_bin(), a, b);
    json_t *other = run_json(cmd);
    snprintf(cmd, sizeof cmd, PY " compare %s %s 2000 43", a, b);
    want = run_json(cmd);
    assert_close(json_number_value(json_array_get(json_object_get(other, "ci95"), 0)),
                 num(want, "lo"), 1e-12, "2.5 % (seed 43)");
    json_decref(other);
    json_decref(want);
    snprintf(cmd, sizeof cmd, "%s eval compare %s %s --resamples 100", moe_test_bin(), a, b);
    char *out;
    assert_int_equal(moe_test_run(cmd, &out), 2);
    free(out);
}

/* ==== kl ==== */

static void kl_self_is_zero(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    char text[512], cmd[2048];
    snprintf(text, sizeof text, "%s/kl.txt", moe_test_tmpdir());
    write_text(text, "Once upon a time, there was a little girl named Lily. She loved to play "
                     "outside in the park with her dog. One day, she saw a big red ball under a "
                     "tree. Lily ran to the ball and picked it up. Her mom smiled at her.\n");
    snprintf(cmd, sizeof cmd, "%s eval kl %s --ref %s --text %s --ctx 16 --json", moe_test_bin(),
             model, model, text);
    json_t *j = run_json(cmd);
    assert_true(num(j, "chunks") >= 2);
    assert_int_equal(num(j, "scored"), num(j, "chunks") * 7); /* positions 8..14 of 16 */
    static const char *const zero[] = {"kl_mean", "kl_median", "kl_p99", "kl_max"};
    for (size_t i = 0; i < 4; i++) assert_true(num(j, zero[i]) == 0.0);
    assert_true(num(j, "top1_agreement") == 1.0);
    assert_true(num(j, "ppl") == num(j, "ppl_ref"));
    assert_true(num(j, "ppl") > 1.0);
    json_decref(j);
}

/* src with every tensor dequantized to F32 (the same weights, no quantized dots) */
static void write_f32_twin(const char *src, const char *dst) {
    static const char *const drop_keys[] = {"general.file_type", NULL};
    moe_test_copy_gguf(src, dst, drop_keys, NULL, true);
}

/* KL of quant against ref, both as `moe eval kl` and as numpy over `moe logits` dumps */
static void kl_check(const char *quant, const char *ref, const char *ids, bool twin) {
    const char *tmp = moe_test_tmpdir();
    char lq[512], lr[512], cmd[4096];
    snprintf(lq, sizeof lq, "%s/kl-q.f32", tmp);
    snprintf(lr, sizeof lr, "%s/kl-r.f32", tmp);
    snprintf(cmd, sizeof cmd, "%s logits %s --tokens %s --out %s", moe_test_bin(), quant, ids, lq);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s logits %s --tokens %s --out %s", moe_test_bin(), ref, ids, lr);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s eval kl %s --ref %s --tokens %s --ctx 32 --json", moe_test_bin(),
             quant, ref, ids);
    json_t *got = run_json(cmd);
    snprintf(cmd, sizeof cmd, PY " kl %s %s %s %d 32", lq, lr, ids, N_VOCAB);
    json_t *want = run_json(cmd);
    assert_int_equal(num(got, "scored"), 15);
    assert_int_equal(num(want, "scored"), 15);
    static const char *const keys[] = {"kl_mean",        "kl_median", "kl_p99", "kl_max",
                                       "top1_agreement", "ppl",       "ppl_ref"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        assert_close(num(got, keys[i]), num(want, keys[i]), 1e-12 + 1e-6 * fabs(num(want, keys[i])),
                     keys[i]);
    assert_true(num(got, "kl_mean") > 0.0); /* not the same model */
    assert_true(num(got, "ppl") != num(got, "ppl_ref"));
    /* the twin differs only by the activations' rounding; another model by far more */
    if (twin)
        assert_true(num(got, "kl_max") < 1e-2);
    else
        assert_true(num(got, "kl_mean") > 0.1);
    json_decref(got);
    json_decref(want);
}

static void kl_equals_numpy(void **state) {
    (void)state;
    const char *quant = moe_test_shared("parity/llama-q8_0.gguf");
    const char *tokens_path = moe_test_shared("parity/llama-q8_0.tokens.json");
    const char *other = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(quant);
    MOE_SKIP_IF_NULL(tokens_path);
    MOE_SKIP_IF_NULL(other);
    char f32[512];
    snprintf(f32, sizeof f32, "%s/llama-f32.gguf", moe_test_tmpdir());
    write_f32_twin(quant, f32);
    json_error_t jerr;
    json_t *tj = json_load_file(tokens_path, 0, &jerr);
    assert_non_null(tj);
    moe_strbuf ids = {0};
    ids_text(&ids, json_object_get(tj, "all_tokens"));
    assert_int_equal(json_array_size(json_object_get(tj, "all_tokens")), 32);
    json_decref(tj);
    kl_check(quant, f32, ids.s, true);    /* a Q8_0 build against its F32 source */
    kl_check(quant, other, ids.s, false); /* two models of one vocabulary: KL is not symmetric */
    moe_strbuf_free(&ids);
}

int moe_suite_eval(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(labels_bad_records),        cmocka_unit_test(labels_equal_numpy),
        cmocka_unit_test(labels_equal_numpy_hybrid), cmocka_unit_test(labels_url_equal_engine),
        cmocka_unit_test(compare_equals_python),     cmocka_unit_test(compare_kl_bad_input),
        cmocka_unit_test(kl_self_is_zero),           cmocka_unit_test(kl_equals_numpy),
    };
    return cmocka_run_group_tests_name("eval", tests, NULL, NULL);
}
