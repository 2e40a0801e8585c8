/* Suite "bench": `moe bench` on a tiny synthetic model -- the JSON object has every field the
 * issue names, each a positive number (timings are never compared with targets here: this
 * machine is shared and noisy); CSV has one row per test; every text line names the kernel
 * table and the thread count; bad arguments are usage errors. */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
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
    snprintf(cmd, sizeof cmd, "%s bench %s --accept 0.5,0.7", moe_test_bin(), tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 2);
    assert_non_null(strstr(out, "--accept expects"));
    free(out);
    snprintf(cmd, sizeof cmd,
             "%s bench %s --runs 1 --pp 0 --tg 0 --streams 0 --verify 2 --accept 0.9,0.5",
             moe_test_bin(), tiny_model());
    assert_int_equal(moe_test_run(cmd, &out), 1);
    assert_non_null(strstr(out, "(--verify 3)"));
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
        cmocka_unit_test(bench_usage_errors),
    };
    return cmocka_run_group_tests_name("bench", tests, NULL, NULL);
}
