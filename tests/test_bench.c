/* Suite "bench": `moe bench` on a tiny synthetic model -- the JSON object has every field the
 * issue names, each a positive number (timings are never compared with targets here: this
 * machine is shared and noisy); CSV has one row per test; every text line names the kernel
 * table and the thread count; bad arguments are usage errors. */
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *tiny_model(void) {
    static char path[512];
    if (!path[0])
        snprintf(path, sizeof path, "%s",
                 moe_test_synth("bench-tiny.gguf",
                                "--preset tiny --layers 2 --type 'ffn_down_exps=Q6_K' "
                                "--type 'exps=Q4_K' --type '.*=Q8_0'"));
    return path;
}

#define BENCH_SMALL "-t 2 --runs 2 --pp 16 --tg 4 --streams 1,2,4 --stream-steps 2 --probe-mib 16"

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
    assert_int_equal(lines, 1 + 2 + 3); /* header, pp, tg, three stream counts */
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

/* --depth: decode tests after that many tokens of context, on a hybrid model whose KDA state
 * goes back to the filled context by a snapshot before every run; past top_k the glm5next
 * layer attends sparsely. One JSON entry and one CSV row per depth; bad lists are refused. */
static void bench_depths(void **state) {
    (void)state;
    const char *model = moe_test_synth("bench-glm5next.gguf", "--preset glm5next-tiny");
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd,
             "%s bench %s -t 2 --runs 2 --pp 0 --tg 3 --streams 0 --probe-mib 16 --depth 20,90 "
             "--json",
             moe_test_bin(), model);
    json_t *j = moe_test_run_json(cmd);
    json_t *depths = json_object_get(j, "depths");
    assert_int_equal(json_array_size(depths), 2);
    const int want[] = {20, 90};
    for (size_t i = 0; i < 2; i++) {
        json_t *d = json_array_get(depths, i);
        assert_int_equal(json_integer_value(json_object_get(d, "depth")), want[i]);
        positive(d, "tg_tok_s");
        positive(d, "indexer_attend_ms_per_token"); /* the MLA layer attends at every depth */
    }
    /* at depth 90: 22 complete pools, more than the 4 it keeps, so it scores them */
    positive(json_array_get(depths, 1), "indexer_score_ms_per_token");
    positive(j, "fill_seconds");
    json_decref(j);
    snprintf(cmd, sizeof cmd,
             "(%s bench %s -t 2 --runs 1 --pp 0 --tg 2 --streams 0 --probe-mib 16 --depth 30 "
             "--csv 2>/dev/null)",
             moe_test_bin(), model);
    assert_int_equal(moe_test_run(cmd, &out), 0);
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

static void bench_usage_errors(void **state) {
    (void)state;
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s bench", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "a model file is required"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s bench %s --streams 1,x", moe_test_bin(), tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--streams expects"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s bench /nonexistent.gguf --runs 1", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "cannot open"));
    free(out);
}

int moe_suite_bench(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bench_json_fields),
        cmocka_unit_test(bench_csv_and_text),
        cmocka_unit_test(bench_depths),
        cmocka_unit_test(bench_usage_errors),
    };
    return cmocka_run_group_tests_name("bench", tests, NULL, NULL);
}
