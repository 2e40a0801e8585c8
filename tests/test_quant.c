/* Suite "quant": the scalar reference against ggml's own output (../shared/quant, made with
 * llama.cpp 3f545becc; ../shared/iq-tables for the codebooks).
 *
 * What must be exact: block geometry, the embedded codebooks, to_float (bit for bit, every type
 * in MANIFEST.json), the weight quantizers where ggml's source rows are stored (byte for byte),
 * and the activation rows the integer dots consume (byte for byte with ggml-cpu's from_float).
 * What has a tolerance: dots (relative to abs_sum = sum |w_i x_i|, see DOT_TOL_*) and the
 * quantize -> dequantize round trip of every quantizer (relative RMS error, budgets in
 * QUANT_BUDGETS -- the one table of them). The trap: fixtures are read from ../shared; without
 * it these tests skip (fail under CI=true). */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/quant/blocks.h"
#include "../src/quant/quantize_internal.h"

/* ==== Tolerances and budgets (the only numbers the assertions use) ==== */

/* traits->dot on ggml's activation bytes vs ggml-cpu's vec_dot, times abs_sum. Both form the
 * same per-block integer dots and float scale products; moe then sums exactly (double), ggml
 * in 8 float lanes. Two types need more than 5e-7 on these fixtures, both on the all-positive
 * activation row (x = N(0.05, 0.01^2)), where the scale and min terms are large and cancel:
 * Q5_1 (measured 7.4e-7) and Q4_K (5.8e-7). That is ggml's rounding, not ours: replaying
 * ggml-cpu's AVX2/VNNI lane order (fma per 4-value lane, hsum_float_8, + summs) reproduces all
 * 64 Q5_1 dot_ggml_cpu values bit for bit, while moe's value is the exact sum. Q4_1 reaches
 * 4.9e-7 the same way and stays inside 5e-7. */
#define DOT_TOL_GGML_CPU 5e-7
static double dot_tol_ggml_cpu(moe_type type) {
    return type == MOE_TYPE_Q5_1 || type == MOE_TYPE_Q4_K ? 1e-6 : DOT_TOL_GGML_CPU;
}
/* moe_dot_f32_ref (float accumulation) vs the float64 dot of the same dequantized row. */
#define DOT_TOL_F32_REF 1e-5

/* Quantize -> dequantize error of every quantizer: RMS(deq - x) / RMS(x) on seeded gaussian
 * rows (1% outliers x U(20,50) in half of them), n = BUDGET_ROW_LEN. Budgets are ~1.3x what the
 * reference measured when this table was written, so a regression in a fit shows up. */
static const struct {
    moe_type type;
    double budget;
} QUANT_BUDGETS[] = {
    {MOE_TYPE_F16, 2.8e-4},     {MOE_TYPE_BF16, 2.2e-3},    {MOE_TYPE_Q8_0, 1.2e-2},
    {MOE_TYPE_Q8_1, 1.2e-2},    {MOE_TYPE_Q8_K, 2.8e-2},    {MOE_TYPE_Q4_0, 1.25e-1},
    {MOE_TYPE_Q4_1, 1.3e-1},    {MOE_TYPE_Q5_0, 8.2e-2},    {MOE_TYPE_Q5_1, 6.0e-2},
    {MOE_TYPE_Q4_K, 1.04e-1},   {MOE_TYPE_Q6_K, 3.4e-2},    {MOE_TYPE_IQ4_NL, 1.14e-1},
    {MOE_TYPE_IQ4_XS, 1.15e-1}, {MOE_TYPE_Q2_K, 3.4e-1},    {MOE_TYPE_Q3_K, 1.7e-1},
    {MOE_TYPE_Q5_K, 5.7e-2},    {MOE_TYPE_MXFP4, 1.75e-1},  {MOE_TYPE_IQ3_XXS, 4.0e-1},
    {MOE_TYPE_IQ3_S, 3.2e-1},   {MOE_TYPE_IQ2_XXS, 8.6e-1}, {MOE_TYPE_IQ2_XS, 6.6e-1},
    {MOE_TYPE_IQ2_S, 6.2e-1},   {MOE_TYPE_IQ1_S, 8.1e-1},   {MOE_TYPE_IQ1_M, 6.8e-1},
};
#define BUDGET_ROW_LEN 4096
#define BUDGET_ROWS    8

/* ==== Fixtures (MANIFEST.json, through testutil) ==== */

static size_t row_bytes(const moe_test_quant_fixture *f) {
    return (size_t)moe_type_row_bytes(f->type, f->row_len);
}

/* A [rows][cols] float64 matrix from dot.json. */
static void read_matrix(json_t *root, const char *key, int64_t rows, int cols, double *out) {
    json_t *m = json_object_get(root, key);
    if (!json_is_array(m) || (int64_t)json_array_size(m) != rows) fail_msg("dot.json: bad %s", key);
    for (int64_t r = 0; r < rows; r++) {
        json_t *row = json_array_get(m, (size_t)r);
        if (!json_is_array(row) || (int)json_array_size(row) != cols)
            fail_msg("dot.json: bad %s[%lld]", key, (long long)r);
        for (int c = 0; c < cols; c++)
            out[r * cols + c] = json_number_value(json_array_get(row, c));
    }
}

#define N_VEC 4 /* activation rows per type in <TYPE>.x.f32 */

typedef struct {
    double dot_ref[64 * N_VEC], abs_sum[64 * N_VEC], dot_ggml_cpu[64 * N_VEC];
} dot_fixture;

static void read_dots(const moe_test_quant_fixture *f, dot_fixture *d) {
    char rel[128];
    snprintf(rel, sizeof rel, "quant/%s.dot.json", f->name);
    const char *path = moe_test_shared(rel);
    if (!path) fail_msg("fixture %s vanished", rel);
    assert_true(f->n_rows <= 64);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) fail_msg("%s:%d: %s", path, jerr.line, jerr.text);
    read_matrix(root, "dot_ref", f->n_rows, N_VEC, d->dot_ref);
    read_matrix(root, "abs_sum", f->n_rows, N_VEC, d->abs_sum);
    read_matrix(root, "dot_ggml_cpu", f->n_rows, N_VEC, d->dot_ggml_cpu);
    json_decref(root);
}

static const char *moe_dot_type_ggml_name(moe_type t) {
    switch (t) {
    case MOE_TYPE_Q8_0:
        return "q8_0";
    case MOE_TYPE_Q8_1:
        return "q8_1";
    case MOE_TYPE_Q8_K:
        return "q8_K";
    case MOE_TYPE_F16:
        return "f16";
    case MOE_TYPE_BF16:
        return "bf16";
    case MOE_TYPE_F32:
        return "f32";
    default:
        return "?";
    }
}

/* ==== Geometry ==== */

static void block_geometry_matches_manifest(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        const moe_type_traits *t = moe_type_traits_get(f->type);
        assert_non_null(t);
        assert_string_equal(t->name, f->name);
        assert_int_equal(t->block_values, f->block_values);
        assert_int_equal(t->block_bytes, f->block_bytes);
        assert_non_null(t->to_float);
        assert_non_null(t->dot);
        /* the activation type is ggml-cpu's vec_dot_type */
        assert_string_equal(moe_dot_type_ggml_name(t->dot_type), f->dot_type);
        assert_int_equal(moe_dot_type(f->type), t->dot_type);
    }
    /* the activation-only types */
    assert_int_equal(moe_type_traits_get(MOE_TYPE_Q8_1)->block_bytes, sizeof(moe_block_q8_1));
    assert_int_equal(moe_type_traits_get(MOE_TYPE_Q8_K)->block_bytes, sizeof(moe_block_q8_k));
    assert_int_equal(moe_dot_row_bytes(MOE_TYPE_Q4_K, 512), 2 * sizeof(moe_block_q8_k));
    assert_int_equal(moe_dot_row_bytes(MOE_TYPE_Q4_K, 100), 0);
    assert_int_equal(moe_dot_row_bytes(MOE_TYPE_I32, 64), 0);
}

/* ==== Codebooks ==== */

static void iq_tables_match_shared(void **state) {
    (void)state;
    static const struct {
        const char *file;
        const void *table;
        size_t elem_bytes, count;
        bool is_signed;
    } tables[] = {
        {"iq2xxs_grid", moe_iq2xxs_grid, 8, 256, false},
        {"iq2xs_grid", moe_iq2xs_grid, 8, 512, false},
        {"iq2s_grid", moe_iq2s_grid, 8, 1024, false},
        {"iq3xxs_grid", moe_iq3xxs_grid, 4, 256, false},
        {"iq3s_grid", moe_iq3s_grid, 4, 512, false},
        {"iq1s_grid", moe_iq1s_grid, 8, 2048, false},
        {"kvalues_iq4nl", moe_kvalues_iq4nl, 1, 16, true},
        {"kvalues_fp4", moe_kvalues_mxfp4, 1, 16, true},
        {"ksigns_iq2xs", moe_ksigns_iq2xs, 1, 128, false},
        {"ksigns64", moe_ksigns64, 8, 128, false},
        {"kmask_iq2xs", moe_kmask_iq2xs, 1, 8, false},
    };
    for (size_t t = 0; t < sizeof tables / sizeof tables[0]; t++) {
        char rel[96];
        snprintf(rel, sizeof rel, "iq-tables/%s.txt", tables[t].file);
        size_t size;
        char *text = (char *)moe_test_shared_read(rel, &size);
        MOE_SKIP_IF_NULL(text);
        size_t count = 0;
        char *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            if (count >= tables[t].count)
                fail_msg("%s: more than %zu entries", rel, tables[t].count);
            unsigned long long want = strtoull(line, NULL, 16), got = 0;
            const uint8_t *p = (const uint8_t *)tables[t].table + count * tables[t].elem_bytes;
            switch (tables[t].elem_bytes) {
            case 1:
                got = *p;
                break;
            case 4:
                got = *(const uint32_t *)p;
                break;
            case 8:
                got = *(const uint64_t *)p;
                break;
            }
            if (got != want) fail_msg("%s[%zu]: embedded 0x%llx, file %s", rel, count, got, line);
            count++;
        }
        assert_int_equal(count, tables[t].count);
        free(text);
        if (tables[t].is_signed) { /* the signed decimal rendering agrees too */
            snprintf(rel, sizeof rel, "iq-tables/%s.dec.txt", tables[t].file);
            text = (char *)moe_test_shared_read(rel, &size);
            MOE_SKIP_IF_NULL(text);
            count = 0;
            for (char *line = strtok_r(text, "\n", &save); line;
                 line = strtok_r(NULL, "\n", &save), count++)
                assert_int_equal(((const int8_t *)tables[t].table)[count], atoi(line));
            assert_int_equal(count, tables[t].count);
            free(text);
        }
    }
}

/* ==== Dequantization: bit for bit ==== */

static void dequantize_bit_exact(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    char failed[512] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        const int64_t n = f->row_len * f->n_rows;
        uint8_t *blocks = moe_test_quant_read(f, "blocks", row_bytes(f) * (size_t)f->n_rows);
        uint8_t *want = moe_test_quant_read(f, "f32", (size_t)n * sizeof(float));
        float *got = moe_xmalloc((size_t)n * sizeof(float));
        /* row by row, as the engine calls it */
        for (int64_t r = 0; r < f->n_rows; r++)
            moe_type_traits_get(f->type)->to_float(blocks + r * row_bytes(f), got + r * f->row_len,
                                                   f->row_len);
        if (memcmp(got, want, (size_t)n * sizeof(float)) != 0) {
            int64_t k = 0;
            while (memcmp(&got[k], want + 4 * k, 4) == 0) k++;
            float w;
            memcpy(&w, want + 4 * k, 4);
            print_error("%s: value %lld is %.9g, ggml has %.9g\n", f->name, (long long)k,
                        (double)got[k], (double)w);
            strcat(failed, f->name), strcat(failed, " ");
        }
        free(blocks), free(want), free(got);
    }
    if (failed[0]) fail_msg("to_float differs from ggml for: %s", failed);
}

/* ==== Weight quantizers: byte for byte where ggml's source rows are stored ==== */

static void quantize_matches_ggml(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    int checked = 0;
    char failed[256] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        if (!f->has_src) continue;
        const size_t rb = row_bytes(f), n = (size_t)(f->row_len * f->n_rows);
        const moe_type_traits *t = moe_type_traits_get(f->type);
        assert_non_null(t->from_float);
        float *src = (float *)moe_test_quant_read(f, "src.f32", n * sizeof(float));
        uint8_t *want = moe_test_quant_read(f, "blocks", rb * (size_t)f->n_rows);
        uint8_t *got = moe_xmalloc(rb * (size_t)f->n_rows);
        for (int64_t r = 0; r < f->n_rows; r++)
            t->from_float(src + r * f->row_len, got + r * rb, f->row_len);
        if (memcmp(got, want, rb * (size_t)f->n_rows) != 0) {
            size_t k = 0;
            while (got[k] == want[k]) k++;
            print_error("%s: byte %zu (row %zu, block %zu) is 0x%02x, ggml has 0x%02x\n", f->name,
                        k, k / rb, (k % rb) / f->block_bytes, got[k], want[k]);
            strcat(failed, f->name), strcat(failed, " ");
        }
        checked++;
        free(src), free(want), free(got);
    }
    if (failed[0]) fail_msg("from_float differs from ggml for: %s", failed);
    assert_int_equal(checked, 8); /* Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL F16 BF16 */
}

/* The base layer's half conversions are the F16 / BF16 quantizers: check them directly. */
static void half_conversions_match_ggml(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        if (f->type != MOE_TYPE_F16 && f->type != MOE_TYPE_BF16) continue;
        const size_t n = (size_t)(f->row_len * f->n_rows);
        float *src = (float *)moe_test_quant_read(f, "src.f32", n * sizeof(float));
        uint16_t *want = (uint16_t *)moe_test_quant_read(f, "blocks", n * 2);
        for (size_t k = 0; k < n; k++) {
            uint16_t got =
                f->type == MOE_TYPE_F16 ? moe_f32_to_fp16(src[k]) : moe_f32_to_bf16(src[k]);
            if (got != want[k])
                fail_msg("%s: value %zu (%.9g) -> 0x%04x, ggml has 0x%04x", f->name, k,
                         (double)src[k], got, want[k]);
        }
        free(src), free(want);
    }
}

/* ==== Activation rows: byte for byte with ggml-cpu ==== */

static void activation_rows_match_ggml_cpu(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    char failed[512] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        const size_t xb = (size_t)moe_dot_row_bytes(f->type, f->row_len);
        assert_true(xb > 0);
        float *x =
            (float *)moe_test_quant_read(f, "x.f32", N_VEC * (size_t)f->row_len * sizeof(float));
        uint8_t *want = moe_test_quant_read(f, "xq.blocks", N_VEC * xb);
        uint8_t *got = moe_xmalloc(N_VEC * xb);
        for (int j = 0; j < N_VEC; j++)
            moe_quantize_row_for_dot(f->type, x + j * f->row_len, got + j * xb, f->row_len);
        if (memcmp(got, want, N_VEC * xb) != 0) {
            size_t k = 0;
            while (got[k] == want[k]) k++;
            print_error("%s (%s): byte %zu of %zu is 0x%02x, ggml-cpu has 0x%02x\n", f->name,
                        f->dot_type, k, N_VEC * xb, got[k], want[k]);
            strcat(failed, f->name), strcat(failed, " ");
        }
        free(x), free(want), free(got);
    }
    if (failed[0]) fail_msg("activation rows differ from ggml-cpu for: %s", failed);
}

/* The activation-only types decode too: a Q8_K / Q8_1 row is within half a step of its input. */
static void activation_types_round_trip(void **state) {
    (void)state;
    float x[512], y[512];
    uint8_t buf[2 * sizeof(moe_block_q8_k)];
    uint64_t rng = 7;
    for (int i = 0; i < 512; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(rng >> 11) / 9007199254740992.0 * 6.0 - 3.0);
    }
    moe_quantize_row_for_dot(MOE_TYPE_Q4_K, x, buf, 512); /* Q8_K */
    moe_ref_q8_k_to_float(buf, y, 512);
    const moe_block_q8_k *k = (const moe_block_q8_k *)buf;
    for (int i = 0; i < 512; i++)
        assert_true(fabsf(y[i] - x[i]) <= 0.5f * fabsf(k[i / 256].d) * 1.0001f);
    for (int b = 0; b < 2; b++)
        for (int s = 0; s < 16; s++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += k[b].qs[16 * s + j];
            assert_int_equal(k[b].bsums[s], sum);
        }
    moe_quantize_row_for_dot(MOE_TYPE_Q4_1, x, buf, 512); /* Q8_1 */
    moe_ref_q8_1_to_float(buf, y, 512);
    const moe_block_q8_1 *q = (const moe_block_q8_1 *)buf;
    /* q was rounded with the unrounded d, so add 127 fp16 roundings of d to half a step */
    for (int i = 0; i < 512; i++)
        assert_true(fabsf(y[i] - x[i]) <= (0.5f + 127.0f / 2048) * moe_fp16_to_f32(q[i / 32].d));
    for (int b = 0; b < 16; b++) {
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += q[b].qs[j];
        /* s is fp16(d * sum) with the unrounded d: within fp16 rounding of the decoded d */
        float s = moe_fp16_to_f32(q[b].s), ds = moe_fp16_to_f32(q[b].d) * (float)sum;
        assert_true(fabsf(s - ds) <= 2e-3f * fabsf(ds) + 1e-6f);
    }
}

/* The fixtures' activations contain no exact ties, so both Q8_0 quantizers reproduce them;
 * this block does: amax = 127 makes d = 1, and x.5 values round to even for activations (as
 * ggml-cpu's _mm256_round_ps) but away from zero for weights (ggml's roundf in _ref). */
static void q8_rounding_ties(void **state) {
    (void)state;
    float x[32] = {127.0f, 2.5f, -2.5f, 0.5f, 1.5f, -0.5f, 3.5f, 126.5f};
    static const int8_t act[8] = {127, 2, -2, 0, 2, 0, 4, 126};
    static const int8_t weight[8] = {127, 3, -3, 1, 2, -1, 4, 127};
    moe_block_q8_0 a, w;
    moe_block_q8_1 a1;
    moe_quantize_row_for_dot(MOE_TYPE_Q4_0, x, &a, 32);
    moe_type_traits_get(MOE_TYPE_Q8_0)->from_float(x, &w, 32);
    moe_quantize_row_for_dot(MOE_TYPE_Q4_1, x, &a1, 32);
    assert_memory_equal(a.qs, act, 8);
    assert_memory_equal(a1.qs, act, 8);
    assert_memory_equal(w.qs, weight, 8);
    assert_int_equal(a.d, 0x3c00); /* 1.0 */
    assert_int_equal(a1.s, moe_f32_to_fp16(127 + 2 - 2 + 0 + 2 + 0 + 4 + 126));
}

/* ==== Dots ==== */

static void dot_matches_ggml_cpu(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    dot_fixture *d = moe_xmalloc(sizeof *d);
    char failed[512] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        const moe_type_traits *t = moe_type_traits_get(f->type);
        const size_t rb = row_bytes(f), xb = (size_t)moe_dot_row_bytes(f->type, f->row_len);
        uint8_t *w = moe_test_quant_read(f, "blocks", rb * (size_t)f->n_rows);
        uint8_t *xq = moe_test_quant_read(f, "xq.blocks", N_VEC * xb);
        read_dots(f, d);
        double worst = 0;
        for (int64_t r = 0; r < f->n_rows; r++)
            for (int j = 0; j < N_VEC; j++) {
                const double got = t->dot(w + r * rb, xq + j * xb, f->row_len);
                const double want = d->dot_ggml_cpu[r * N_VEC + j],
                             abs_sum = d->abs_sum[r * N_VEC + j];
                const double err = fabs(got - want);
                if (err > dot_tol_ggml_cpu(f->type) * abs_sum) {
                    print_error("%s row %lld x %d: dot %.9g, ggml-cpu %.9g (%.3g x abs_sum)\n",
                                f->name, (long long)r, j, got, want, err / abs_sum);
                    if (!strstr(failed, f->name)) strcat(failed, f->name), strcat(failed, " ");
                }
                if (abs_sum > 0 && err / abs_sum > worst) worst = err / abs_sum;
            }
        print_message("[ MEASURE  ] dot %-8s vs ggml-cpu: max |err| = %.2e x abs_sum (tol %.0e)\n",
                      f->name, worst, dot_tol_ggml_cpu(f->type));
        free(w), free(xq);
    }
    free(d);
    if (failed[0]) fail_msg("dot differs from ggml-cpu for: %s", failed);
}

static void dot_f32_ref_matches_float64(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    dot_fixture *d = moe_xmalloc(sizeof *d);
    char failed[512] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        const size_t rb = row_bytes(f);
        uint8_t *w = moe_test_quant_read(f, "blocks", rb * (size_t)f->n_rows);
        float *x =
            (float *)moe_test_quant_read(f, "x.f32", N_VEC * (size_t)f->row_len * sizeof(float));
        read_dots(f, d);
        double worst = 0;
        for (int64_t r = 0; r < f->n_rows; r++)
            for (int j = 0; j < N_VEC; j++) {
                const double got =
                    moe_dot_f32_ref(f->type, w + r * rb, x + j * f->row_len, f->row_len);
                const double want = d->dot_ref[r * N_VEC + j], abs_sum = d->abs_sum[r * N_VEC + j];
                const double err = fabs(got - want);
                if (err > DOT_TOL_F32_REF * abs_sum) {
                    print_error("%s row %lld x %d: %.9g, float64 %.9g\n", f->name, (long long)r, j,
                                got, want);
                    if (!strstr(failed, f->name)) strcat(failed, f->name), strcat(failed, " ");
                }
                if (abs_sum > 0 && err / abs_sum > worst) worst = err / abs_sum;
            }
        print_message("[ MEASURE  ] dot_f32_ref %-8s vs float64: max |err| = %.2e x abs_sum\n",
                      f->name, worst);
        free(w), free(x);
    }
    free(d);
    if (failed[0]) fail_msg("moe_dot_f32_ref off for: %s", failed);
}

/* ==== Round-trip error budgets ==== */

/* Seeded gaussian rows (splitmix64 + Box-Muller); odd rows get ~1% outliers x U(20,50). */
static void quantize_error_budgets(void **state) {
    (void)state;
    const int64_t n = BUDGET_ROW_LEN;
    float *x = moe_xmalloc((size_t)n * sizeof(float)), *y = moe_xmalloc((size_t)n * sizeof(float));
    uint8_t *q = moe_xmalloc((size_t)n * 8);
    char failed[256] = "";
    for (size_t b = 0; b < sizeof QUANT_BUDGETS / sizeof QUANT_BUDGETS[0]; b++) {
        const moe_type_traits *t = moe_type_traits_get(QUANT_BUDGETS[b].type);
        assert_non_null(t->from_float);
        uint64_t seed = 42;
        double err2 = 0, ref2 = 0;
        for (int r = 0; r < BUDGET_ROWS; r++) {
            const double scale = pow(10.0, -3.0 + 4.0 * moe_rng_uniform(&seed));
            for (int64_t i = 0; i < n; i++) {
                double v = moe_rng_gaussian(&seed) * scale;
                if ((r & 1) && moe_rng_uniform(&seed) < 0.01)
                    v *= (20.0 + 30.0 * moe_rng_uniform(&seed)) *
                         (moe_rng_uniform(&seed) < 0.5 ? -1 : 1);
                x[i] = (float)v;
            }
            t->from_float(x, q, n);
            t->to_float(q, y, n);
            double e2 = 0, x2 = 0;
            for (int64_t i = 0; i < n; i++) {
                e2 += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
                x2 += (double)x[i] * x[i];
            }
            err2 += e2 / x2, ref2 += 1; /* mean over rows of the per-row relative MSE */
        }
        const double rel = sqrt(err2 / ref2);
        print_message("[ MEASURE  ] quantize %-7s relative RMS error %.3e (budget %.1e)\n", t->name,
                      rel, QUANT_BUDGETS[b].budget);
        if (!(rel <= QUANT_BUDGETS[b].budget)) strcat(failed, t->name), strcat(failed, " ");
        /* a zero row stays exactly zero */
        memset(x, 0, (size_t)n * sizeof(float));
        t->from_float(x, q, n);
        t->to_float(q, y, n);
        for (int64_t i = 0; i < n; i++) assert_true(y[i] == 0.0f);
    }
    free(x), free(y), free(q);
    if (failed[0]) fail_msg("round-trip error over budget for: %s", failed);
}

/* ==== Weight quantizers against ggml's blocks (the rows regenerated) ====
 *
 * ../shared/quant stores ggml's source rows only for eight types; for the others
 * tests/quant_sources.py regenerates them from the manifest's seeds and recipes (it checks
 * itself: its rows equal every stored .src.f32 bit for bit, and its RMS against ggml's dequantized
 * rows equals the manifest's figure for every type). Those rows are quantized here as ggml
 * quantized them (no importance matrix; all-ones for IQ1 / IQ2, as the fixtures were made) and
 * must give ggml's bytes.
 *
 * The one exception is IQ3_S on a super-block with an all-zero 32-value sub-block: ggml then
 * writes the following sub-blocks' codes one slot early (its qs / signs pointers skip the
 * advance), which decodes to wrong values; moe keeps every sub-block in its slot. Such rows must
 * instead decode at least as close to the source as ggml's. */

static const char *regenerated_sources(void) {
    static char dir[512];
    if (dir[0]) return dir;
    const char *quant_dir = moe_test_shared("quant/MANIFEST.json");
    if (!quant_dir) skip();
    char shared[400];
    snprintf(shared, sizeof shared, "%s", quant_dir);
    *strrchr(shared, '/') = '\0';
    snprintf(dir, sizeof dir, "%s/quant-src", moe_test_tmpdir());
    char cmd[2048], *log;
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && /usr/bin/python3 tests/quant_sources.py '%s' '%s'",
             dir, shared, dir);
    const int rc = moe_test_run(cmd, &log);
    if (rc != 0) {
        dir[0] = '\0';
        fail_msg("tests/quant_sources.py (needs /usr/bin/python3 with numpy) failed (%d): %s", rc,
                 log);
    }
    free(log);
    return dir;
}

static float *read_source_rows(const moe_test_quant_fixture *f) {
    char path[640];
    snprintf(path, sizeof path, "%s/%s.src.f32", regenerated_sources(), f->name);
    const size_t n = (size_t)(f->row_len * f->n_rows);
    uint8_t *data;
    size_t size;
    moe_error err = {0};
    if (moe_file_read(path, &data, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
    if (size != n * sizeof(float)) fail_msg("%s: %zu bytes", path, size);
    return (float *)data;
}

/* Whether a row has a 256-value super-block with an all-zero 32-value sub-block beside nonzero
 * ones (where ggml's IQ3_S misplaces codes). */
static bool has_zero_sub_block(const float *x, int64_t n) {
    for (int64_t b = 0; b < n; b += MOE_QK_K) {
        int zero = 0;
        for (int s = 0; s < 8; s++) {
            bool z = true;
            for (int j = 0; j < 32; j++) z = z && x[b + 32 * s + j] == 0.0f;
            zero += z;
        }
        if (zero > 0 && zero < 8) return true;
    }
    return false;
}

static double sq_err(const float *a, const float *b, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++) e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return e;
}

static void quantizers_match_ggml_blocks(void **state) {
    (void)state;
    const moe_test_quant_fixture *fixtures;
    const int n_fixtures = moe_test_quant_fixtures(&fixtures);
    char exact[256] = "", failed[256] = "";
    for (int i = 0; i < n_fixtures; i++) {
        const moe_test_quant_fixture *f = &fixtures[i];
        if (f->has_src || !moe_type_can_quantize(f->type)) continue;
        const size_t rb = row_bytes(f), n = (size_t)f->row_len;
        float *src = read_source_rows(f);
        uint8_t *want = moe_test_quant_read(f, "blocks", rb * (size_t)f->n_rows);
        float *want_deq = (float *)moe_test_quant_read(f, "f32", n * f->n_rows * sizeof(float));
        uint8_t *got = moe_xmalloc(rb);
        float *got_deq = moe_xmalloc(n * sizeof(float));
        bool ok = true, all_exact = true;
        for (int64_t r = 0; r < f->n_rows; r++) {
            const float *x = src + r * n;
            moe_quantize_row(f->type, x, got, (int64_t)n, NULL);
            if (memcmp(got, want + r * rb, rb) == 0) continue;
            all_exact = false;
            if (f->type == MOE_TYPE_IQ3_S && has_zero_sub_block(x, (int64_t)n)) {
                moe_type_traits_get(f->type)->to_float(got, got_deq, (int64_t)n);
                const double e_moe = sq_err(got_deq, x, (int64_t)n);
                const double e_ggml = sq_err(want_deq + r * n, x, (int64_t)n);
                print_message("[ MEASURE  ] IQ3_S row %lld (zero sub-blocks): squared error moe "
                              "%.4g, ggml %.4g\n",
                              (long long)r, e_moe, e_ggml);
                if (e_moe <= e_ggml) continue;
            }
            size_t k = 0;
            while (got[k] == want[r * rb + k]) k++;
            print_error("%s: row %lld byte %zu (block %zu) is 0x%02x, ggml has 0x%02x\n", f->name,
                        (long long)r, k, k / f->block_bytes, got[k], want[r * rb + k]);
            ok = false;
            break;
        }
        if (!ok) strcat(failed, f->name), strcat(failed, " ");
        if (all_exact) strcat(exact, f->name), strcat(exact, " ");
        free(src), free(want), free(want_deq), free(got), free(got_deq);
    }
    print_message("[ MEASURE  ] byte-identical with ggml on every row: %s\n", exact);
    if (failed[0]) fail_msg("quantizer differs from ggml for: %s", failed);
}

/* The same rows on 1 and 3 threads give the same bytes (rows are independent). */
static void quantize_rows_threads_agree(void **state) {
    (void)state;
    const int64_t n = 1024, rows = 24;
    float *x = moe_xmalloc((size_t)(n * rows) * sizeof(float));
    uint64_t seed = 7;
    for (int64_t i = 0; i < n * rows; i++) x[i] = (float)moe_rng_gaussian(&seed);
    moe_pool *pool = moe_pool_new(3);
    const moe_type types[] = {MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ3_S, MOE_TYPE_IQ1_M, MOE_TYPE_Q3_K};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const size_t bytes = (size_t)moe_type_row_bytes(types[t], n) * rows;
        uint8_t *a = moe_xmalloc(bytes), *b = moe_xmalloc(bytes);
        moe_quantize_rows(types[t], x, a, rows, n, NULL, NULL);
        moe_quantize_rows(types[t], x, b, rows, n, NULL, pool);
        assert_memory_equal(a, b, bytes);
        free(a), free(b);
    }
    moe_pool_free(pool);
    free(x);
}

/* With an importance vector, every quantizer that uses one must lower the error weighted by it:
 * sum_j imatrix[j] (x_j - deq_j)^2 over rows, compared with the same type quantized without
 * (IQ1 / IQ2: with all-ones). Importances are log-normal (a few columns matter a lot). */
static void imatrix_lowers_weighted_error(void **state) {
    (void)state;
    const int64_t n = 2048, rows = 16;
    float *x = moe_xmalloc((size_t)(n * rows) * sizeof(float)), *qw = moe_xmalloc(n * 4);
    float *deq = moe_xmalloc(n * sizeof(float));
    uint8_t *q = moe_xmalloc((size_t)n * 8);
    uint64_t seed = 11;
    for (int64_t i = 0; i < n * rows; i++) x[i] = (float)moe_rng_gaussian(&seed) * 0.02f;
    for (int64_t j = 0; j < n; j++) qw[j] = (float)exp(1.5 * moe_rng_gaussian(&seed));
    const moe_type types[] = {MOE_TYPE_Q4_0,  MOE_TYPE_Q4_1,    MOE_TYPE_Q5_0,   MOE_TYPE_Q5_1,
                              MOE_TYPE_Q2_K,  MOE_TYPE_Q3_K,    MOE_TYPE_Q4_K,   MOE_TYPE_Q5_K,
                              MOE_TYPE_Q6_K,  MOE_TYPE_IQ4_NL,  MOE_TYPE_IQ4_XS, MOE_TYPE_IQ3_XXS,
                              MOE_TYPE_IQ3_S, MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ2_XS, MOE_TYPE_IQ2_S,
                              MOE_TYPE_IQ1_S, MOE_TYPE_IQ1_M};
    char failed[256] = "";
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        double e[2] = {0, 0}, ref = 0;
        for (int with = 0; with < 2; with++)
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * n;
                moe_quantize_row(types[t], xr, q, n, with ? qw : NULL);
                moe_type_traits_get(types[t])->to_float(q, deq, n);
                for (int64_t j = 0; j < n; j++) {
                    const double d = (double)xr[j] - deq[j];
                    e[with] += qw[j] * d * d;
                    if (!with) ref += qw[j] * (double)xr[j] * xr[j];
                }
            }
        print_message("[ MEASURE  ] %-8s weighted rel. error: %.4f without, %.4f with imatrix\n",
                      moe_type_name(types[t]), sqrt(e[0] / ref), sqrt(e[1] / ref));
        if (!(e[1] < e[0])) strcat(failed, moe_type_name(types[t])), strcat(failed, " ");
    }
    free(x), free(qw), free(deq), free(q);
    if (failed[0]) fail_msg("importance vector did not lower the weighted error for: %s", failed);
}

/* The quantizers' AVX2 helpers give the scalar reference's bits (the byte-exact test above runs
 * whichever level the CPU picks; this pins the other one too), on values around the codebook
 * midpoints, ties, and out of range. */
static void quantizer_kernels_match_scalar(void **state) {
    (void)state;
    if (moe_cpu_isa_supported() < MOE_ISA_AVX2) skip();
    uint64_t seed = 3;
    float x[32], w[32], sa[2], sb[2];
    uint8_t la[32], lb[32];
    for (int t = 0; t < 2000; t++) {
        for (int j = 0; j < 32; j++) {
            x[j] = (float)moe_rng_gaussian(&seed) * (t % 3 ? 1.0f : 1e-3f);
            w[j] = (float)moe_rng_uniform(&seed);
        }
        if (t % 5 == 0) x[t % 32] = 0.0f;
        const float id = t % 7 == 0 ? 0.0f : (float)(moe_rng_gaussian(&seed) * 80.0);
        moe_iq4_pass_ref(x, w, id, la, &sa[0], &sa[1]);
        moe_iq4_pass_avx2(x, w, id, lb, &sb[0], &sb[1]);
        assert_memory_equal(la, lb, sizeof la);
        assert_memory_equal(sa, sb, sizeof sa);
    }
    int8_t soa[8 * 40];
    float d2a[40], d2b[40];
    for (int t = 0; t < 500; t++) {
        const int dims = t % 2 ? 8 : 4, count = 1 + t % 37, padded = (count + 7) & ~7;
        for (int k = 0; k < dims * padded; k++) soa[k] = (int8_t)(1 + 2 * (moe_rng_u64(&seed) % 8));
        for (int j = 0; j < dims; j++) x[j] = (float)moe_rng_uniform(&seed) * 15, w[j] = x[j] + 1;
        const float scale = (float)moe_rng_uniform(&seed), a = t % 3 ? 1.0f : 0.5f;
        moe_iq_neighbour_d2_ref(soa, count, dims, x, w, scale, a, a == 1 ? 0 : -1.375f, d2a);
        moe_iq_neighbour_d2_avx2(soa, count, dims, x, w, scale, a, a == 1 ? 0 : -1.375f, d2b);
        assert_memory_equal(d2a, d2b, (size_t)count * sizeof(float));
    }
}

int moe_suite_quant(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(block_geometry_matches_manifest),
        cmocka_unit_test(iq_tables_match_shared),
        cmocka_unit_test(dequantize_bit_exact),
        cmocka_unit_test(quantize_matches_ggml),
        cmocka_unit_test(half_conversions_match_ggml),
        cmocka_unit_test(activation_rows_match_ggml_cpu),
        cmocka_unit_test(activation_types_round_trip),
        cmocka_unit_test(q8_rounding_ties),
        cmocka_unit_test(dot_matches_ggml_cpu),
        cmocka_unit_test(dot_f32_ref_matches_float64),
        cmocka_unit_test(quantize_error_budgets),
        cmocka_unit_test(quantizers_match_ggml_blocks),
        cmocka_unit_test(quantize_rows_threads_agree),
        cmocka_unit_test(imatrix_lowers_weighted_error),
        cmocka_unit_test(quantizer_kernels_match_scalar),
    };
    return cmocka_run_group_tests_name("quant", tests, NULL, NULL);
}
