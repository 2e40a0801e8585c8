/* Suite "bench": `moe bench` on a tiny synthetic model -- the JSON object has every field the
 * issue names, each a positive number (timings are never compared with targets here: this
 * machine is shared and noisy); CSV has one row per test; every text line names the kernel
 * table and the thread count; bad arguments are usage errors. `moe bench --server` against
 * `moe serve` on stories260K: the counts of requests, tokens and latency samples, the server's
 * own token counter, the SVG (parsed by Python's XML parser), a server it starts itself
 * (--start-cmd: time to ready, stopped afterwards) and one that is not there (errors). */
#include "testutil.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char *tiny_model(void) {
    static char path[512];
    if (!path[0])
        snprintf(path, sizeof path, "%s",
                 moe_test_synth("bench-tiny.gguf",
                                "--preset tiny --layers 2 --type 'ffn_down_exps=Q6_K' "
                                "--type 'exps=Q4_K' --type '.*=Q8_0'"));
    return path;
}

#define BENCH_SMALL                                                                                \
    "-t 2 --runs 2 --pp 16 --tg 4 --streams 1,2,4 --stream-steps 2 --probe-mib 16 --verify 2 "     \
    "--accept 0.5"

static double positive(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    if (!json_is_number(v)) fail_msg("JSON field '%s' is missing or not a number", key);
    const double x = json_number_value(v);
    if (!(x > 0)) fail_msg("JSON field '%s' is %g, not positive", key, x);
    return x;
}

static void bench_json_fields(void **state) {
    (void)state;
    char cmd[2048], *out;
    /* stderr dropped: the object must parse from stdout alone */
    snprintf(cmd, sizeof cmd, "(%s bench %s " BENCH_SMALL " --json 2>/dev/null)", moe_test_bin(),
             tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    json_error_t e;
    json_t *j = json_loads(out, 0, &e);
    if (!j) fail_msg("not JSON (%s):\n%s", e.text, out);
    positive(j, "pp_tok_s");
    positive(j, "tg_tok_s");
    positive(j, "read_bw_gb_s");
    positive(j, "active_bytes_per_token");
    assert_int_equal(json_integer_value(json_object_get(j, "threads")), 2);
    const char *isa = json_string_value(json_object_get(j, "isa"));
    assert_non_null(isa);
    assert_string_equal(isa, moe_kernels_get()->name);
    json_t *streams = json_object_get(j, "streams");
    assert_true(json_is_array(streams));
    assert_int_equal(json_array_size(streams), 3);
    const int want[] = {1, 2, 4};
    for (size_t i = 0; i < 3; i++) {
        json_t *s = json_array_get(streams, i);
        assert_int_equal(json_integer_value(json_object_get(s, "n")), want[i]);
        const double agg = positive(s, "aggregate_tok_s"), per = positive(s, "per_stream_tok_s");
        assert_true(per * want[i] <= agg * 1.000001 && per * want[i] >= agg * 0.999999);
    }
    /* verify steps of 1 and 2 rows; the rate projected for one draft kept half the time is the
     * 1-row step rate x 1.5 tokens / the 2-row step's cost */
    json_t *verify = json_object_get(j, "verify"), *projected = json_object_get(j, "projected");
    assert_int_equal(json_array_size(verify), 2);
    assert_int_equal(json_array_size(projected), 1);
    const double base = positive(j, "decode1_steps_s");
    for (size_t i = 0; i < 2; i++) {
        json_t *v = json_array_get(verify, i);
        assert_int_equal(json_integer_value(json_object_get(v, "rows")), (int)i + 1);
        const double steps = positive(v, "steps_s"), ratio = positive(v, "cost_ratio");
        assert_true(fabs(ratio - base / steps) <= 1e-6 * ratio);
    }
    const double ratio2 = positive(json_array_get(verify, 1), "cost_ratio");
    const double tok_s = positive(json_array_get(projected, 0), "tok_s");
    assert_true(fabs(tok_s - base * 1.5 / ratio2) <= 1e-6 * tok_s);
    /* the tiny model's dense part alone (head 256 x 512 Q8_0) is 139 KB a token */
    assert_true(json_number_value(json_object_get(j, "active_bytes_per_token")) > 139000);
    json_decref(j);
    free(out);
}

static void bench_csv_and_text(void **state) {
    (void)state;
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "(%s bench %s " BENCH_SMALL " --csv 2>/dev/null)", moe_test_bin(),
             tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    int lines = 0;
    for (const char *c = out; *c; c++) lines += *c == '\n';
    assert_int_equal(lines, 1 + 2 + 3 + 3); /* header, pp, tg, 3 stream counts, 1-row, verify 1-2 */
    assert_non_null(strstr(out, "\nverify,2,"));
    assert_non_null(strstr(out, "test,streams,tok_s,"));
    assert_non_null(strstr(out, "\nstreams,4,"));
    free(out);
    snprintf(cmd, sizeof cmd, "(%s bench %s " BENCH_SMALL " --mmap 2>/dev/null)", moe_test_bin(),
             tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "mapped from the file"));
    char tag[64];
    snprintf(tag, sizeof tag, "%s, 2", moe_kernels_get()->name);
    int tagged = 0, text_lines = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), text_lines++)
        tagged += strstr(line, tag) || strstr(line, "2 threads");
    assert_int_equal(tagged, text_lines);
    free(out);
}

/* `moe bench ARGS` (printf-style) exits rc and says `want`. */
static void expect_bench(int rc, const char *want, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void expect_bench(int rc, const char *want, const char *fmt, ...) {
    char args[2048], cmd[2304], *out;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s bench %s", moe_test_bin(), args);
    const int got = moe_test_run(cmd, &out);
    if (got != rc || !strstr(out, want))
        fail_msg("`%s` exited %d (want %d), output lacks '%s':\n%s", cmd, got, rc, want, out);
    free(out);
}

/* --depth: prefill and decode tests after that many tokens of context, on a hybrid model whose
 * KDA state goes back to the filled context by a snapshot before every run; past top_k the
 * glm5next layer attends sparsely. One JSON entry and one CSV row per test and depth; bad lists
 * are refused. */
static void bench_depths(void **state) {
    (void)state;
    const char *model = moe_test_synth("bench-glm5next.gguf", "--preset glm5next-tiny");
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd,
             "%s bench %s -t 2 --runs 2 --pp 8 --tg 3 --streams 0 --probe-mib 16 --depth 20,90 "
             "--json",
             moe_test_bin(), model);
    json_t *j = moe_test_run_json(cmd);
    json_t *depths = json_object_get(j, "depths");
    assert_int_equal(json_array_size(depths), 2);
    const int want[] = {20, 90};
    for (size_t i = 0; i < 2; i++) {
        json_t *d = json_array_get(depths, i);
        assert_int_equal(json_integer_value(json_object_get(d, "depth")), want[i]);
        positive(d, "pp_tok_s");
        positive(d, "tg_tok_s");
        positive(d, "indexer_attend_ms_per_token"); /* the MLA layer attends at every depth */
    }
    /* at depth 90: 22 complete pools, more than the 4 it keeps, so it scores them */
    positive(json_array_get(depths, 1), "indexer_score_ms_per_token");
    positive(j, "fill_seconds");
    json_decref(j);
    snprintf(cmd, sizeof cmd,
             "(%s bench %s -t 2 --runs 1 --pp 4 --tg 2 --streams 0 --probe-mib 16 --depth 30 "
             "--csv 2>/dev/null)",
             moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "\npp4@d30,1,"));
    assert_non_null(strstr(out, "\ntg2@d30,1,"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s bench %s --depth 90,20", moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "depths ascend"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s bench %s --depth 1,x", moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--depth expects"));
    free(out);
}

/* --spec ngram --prompt-file: decode after the prompt measured with and without speculation.
 * The drafts verified and kept by position, and the steps, equal what prompt lookup gives on
 * the greedy tokens `moe run --spec none` prints, counted by tests/ngram_steps.py (the drafting
 * rule and the step loop written again in Python). */
static void bench_spec_measured(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    static const char text[] = "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom";
    char path[600], cmd[4096], *out;
    snprintf(path, sizeof path, "%s/bench-prompt.txt", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(path, text, strlen(text), &err), MOE_OK);
    snprintf(cmd, sizeof cmd,
             "(%s bench %s -t 1 --runs 1 --pp 0 --tg 48 --streams 0 --verify 0 --probe-mib 16 "
             "--spec ngram --draft 3 --prompt-file %s --json 2>/dev/null)",
             moe_test_bin(), model, path);
    json_t *j = moe_test_run_json(cmd), *spec = json_object_get(j, "spec");
    positive(spec, "plain_tok_s");
    positive(spec, "spec_tok_s");
    const double per_step = positive(spec, "tokens_per_step");
    const long long n_prompt = json_integer_value(json_object_get(spec, "prompt_tokens"));
    json_t *positions = json_object_get(spec, "positions");
    assert_int_equal(json_array_size(positions), 3);
    char got[256];
    size_t used = 0;
    for (size_t k = 0; k < 3; k++) {
        json_t *e = json_array_get(positions, k);
        used += (size_t)snprintf(got + used, sizeof got - used, "%lld %lld ",
                                 json_integer_value(json_object_get(e, "drafted")),
                                 json_integer_value(json_object_get(e, "accepted")));
    }
    snprintf(got + used, sizeof got - used, "%.4f", per_step);
    snprintf(cmd, sizeof cmd,
             "(%s run %s -p '%s' -n 48 --temp 0 --spec none --print-ids 2>/dev/null)",
             moe_test_bin(), model, text);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    out[strcspn(out, "\n")] = '\0';
    char *want;
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 tests/ngram_steps.py %s %lld 48 3", out, n_prompt);
    free(out);
    assert_int_equal(moe_test_run(cmd, &want), 0);
    want[strcspn(want, "\n")] = '\0';
    print_message("drafted, accepted by position, tokens per step: %s (python: %s)\n", got, want);
    if (strcmp(got, want) != 0)
        fail_msg("moe bench --spec ngram counted %s, prompt lookup on the greedy tokens gives %s",
                 got, want);
    free(want);
    json_decref(j);
}

static void bench_usage_errors(void **state) {
    (void)state;
    expect_bench(2, "a model file is required", "%s", "");
    expect_bench(2, "--streams expects", "%s --streams 1,x", tiny_model());
    expect_bench(1, "cannot open", "/nonexistent.gguf --runs 1");
    expect_bench(2, "--accept expects", "%s --accept 0.5,0.7", tiny_model());
    expect_bench(2, "needs --prompt-file", "%s --spec ngram", tiny_model());
    expect_bench(2, "--prompt-file is the prompt of", "%s --prompt-file x.txt", tiny_model());
    expect_bench(2, "--spec expects", "%s --spec bigram --prompt-file x.txt", tiny_model());
    expect_bench(1, "(--verify 3)",
                 "%s --runs 1 --pp 0 --tg 0 --streams 0 --verify 2 --accept 0.9,0.5", tiny_model());
}

/* ==== moe bench --server ==== */

static json_t *bench_server_json(const char *args, int want_rc) {
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "(%s bench %s --json 2>/dev/null)", moe_test_bin(), args);
    const int rc = moe_test_run(cmd, &out);
    json_error_t e;
    json_t *j = json_loads(out, 0, &e);
    if (rc != want_rc || !j) fail_msg("`%s` exited %d (want %d):\n%s", cmd, rc, want_rc, out);
    free(out);
    return j;
}

static long long int_field(json_t *j, const char *key) {
    json_t *v = json_object_get(j, key);
    if (!json_is_integer(v)) fail_msg("JSON field '%s' is missing or not an integer", key);
    return json_integer_value(v);
}

/* A port nothing listens on just now. */
static int free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void bench_server_counts(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    moe_test_server srv = {0};
    char *srv_args[] = {(char *)model, "--ctx", "256", "--parallel", "4", NULL};
    if (!moe_test_server_start(&srv, "bench-server", srv_args))
        fail_msg("moe serve did not start (log %s)", srv.log);
    char svg[600], args[2048];
    snprintf(svg, sizeof svg, "%s/latency.svg", moe_test_tmpdir());
    snprintf(args, sizeof args, "--server %s/ --concurrency 3 --tokens 8 --repeats 2 --svg %s",
             srv.url, svg);
    json_t *j = bench_server_json(args, 0);
    assert_int_equal(int_field(j, "requests"), 6);
    assert_int_equal(int_field(j, "errors"), 0);
    assert_int_equal(int_field(j, "output_tokens"), 48);
    assert_int_equal(int_field(j, "ttft_samples"), 6);
    assert_int_equal(int_field(j, "itl_samples"), 6 * 7); /* gaps between 8 tokens */
    positive(j, "output_tok_s");
    positive(j, "ttft_p50_ms");
    const char *ordered[][2] = {{"output_tok_s_min", "output_tok_s"},
                                {"output_tok_s", "output_tok_s_max"},
                                {"ttft_p50_ms", "ttft_p99_ms"},
                                {"itl_p50_ms", "itl_p99_ms"}};
    for (size_t i = 0; i < sizeof ordered / sizeof ordered[0]; i++) {
        const double a = json_number_value(json_object_get(j, ordered[i][0])),
                     b = json_number_value(json_object_get(j, ordered[i][1]));
        if (!(a >= 0 && a <= b)) fail_msg("%s %g > %s %g", ordered[i][0], a, ordered[i][1], b);
    }
    assert_true(json_is_null(json_object_get(j, "time_to_ready_s")));
    assert_true(json_is_null(json_object_get(j, "first_error")));
    json_decref(j);
    /* the server counted the same tokens */
    char url[256];
    snprintf(url, sizeof url, "%s/metrics", srv.url);
    long status;
    char *metrics = moe_test_http(url, NULL, &status);
    if (!strstr(metrics, "\nmoe_generated_tokens_total 48\n")) fail_msg("%s", metrics);
    free(metrics);
    assert_int_equal(moe_test_server_stop(&srv), 0);
    /* the SVG parses as XML; its bars count every sample */
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 -c \"import re,sys,xml.etree.ElementTree as E; "
             "r=E.parse(sys.argv[1]).getroot(); ns='{http://www.w3.org/2000/svg}'; "
             "assert r.tag==ns+'svg'; "
             "n=[int(re.search(r': (\\\\d+)$', t.text).group(1)) for t in r.iter(ns+'title') "
             "if ' ms: ' in (t.text or '')]; print(sum(n))\" %s",
             svg);
    assert_int_equal(moe_test_run(cmd, &out), 0);
    if (atoi(out) != 6 + 42) fail_msg("the SVG's bars hold %s samples, want 48", out);
    free(out);
}

static void bench_server_start_cmd(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    const int port = free_port();
    char args[4096];
    snprintf(args, sizeof args,
             "--server http://127.0.0.1:%d --concurrency 2 --tokens 4 --repeats 1 --ready-timeout "
             "60 --start-cmd "
             "'exec %s serve %s --port %d --ctx 256 2>/dev/null >/dev/null'",
             port, moe_test_bin(), model, port);
    json_t *j = bench_server_json(args, 0);
    positive(j, "time_to_ready_s");
    assert_int_equal(int_field(j, "requests"), 2);
    assert_int_equal(int_field(j, "errors"), 0);
    assert_int_equal(int_field(j, "output_tokens"), 8);
    json_decref(j);
    /* it stopped the server: the same port now refuses, every request an error */
    snprintf(args, sizeof args,
             "--server http://127.0.0.1:%d --concurrency 2 --tokens 4 --repeats 1", port);
    j = bench_server_json(args, 1);
    assert_int_equal(int_field(j, "requests"), 2);
    assert_int_equal(int_field(j, "errors"), 2);
    assert_int_equal(int_field(j, "output_tokens"), 0);
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%d/v1/completions", port);
    assert_non_null(strstr(json_string_value(json_object_get(j, "first_error")), want));
    json_decref(j);
    /* a start command that dies, and usage errors */
    expect_bench(1, "exited (status 3)", "--server http://127.0.0.1:%d --start-cmd 'exit 3'", port);
    expect_bench(2, "--server needs a value", "--server");
    expect_bench(1, "not an http(s):// URL", "--server ftp://x --concurrency 1");
}

int moe_suite_bench(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bench_json_fields),      cmocka_unit_test(bench_csv_and_text),
        cmocka_unit_test(bench_depths),           cmocka_unit_test(bench_usage_errors),
        cmocka_unit_test(bench_spec_measured),    cmocka_unit_test(bench_server_counts),
        cmocka_unit_test(bench_server_start_cmd),
    };
    return cmocka_run_group_tests_name("bench", tests, NULL, NULL);
}
