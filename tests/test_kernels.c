/* Suite "kernels": the per-ISA kernel tables against the scalar reference.
 *
 * Every table this CPU can run (scalar, avx2, avx512, avx512vnni; moe_kernels_for_isa) is
 * checked, whatever MOE_ISA says: activation conversions byte for byte, dots on ggml's fixtures
 * (../shared/quant: .blocks against .xq.blocks) and on random valid rows of odd lengths (one
 * block up to a few dozen), against the scalar table's dot on the same activation bytes. The
 * integer block sums of a fast dot are exact, only its float summation order differs, so the
 * budget is a few float roundings of the magnitude (DOT_BUDGET). The trap: the magnitude is
 * sum |w_i x_i| of the dequantized rows; for the types with a min (Q2_K, Q4_K, Q5_K, Q4_1,
 * Q5_1) the scale and min terms are summed separately and may be larger than that. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/ops/ops.h"
#include "../src/quant/blocks.h"

/* ==== Budgets (the only numbers the dot assertions use) ==== */

/* |fast - reference| <= DOT_BUDGET * sum |w_i x_i|. Float accumulation over n / 8 lanes of
 * per-block terms: ~1e-7 is typical; min types cancel (see above) and get more. */
#define DOT_BUDGET     5e-7
#define DOT_BUDGET_MIN 3e-6
static double dot_budget(moe_type t) {
    switch (t) {
    case MOE_TYPE_Q2_K:
    case MOE_TYPE_Q4_K:
    case MOE_TYPE_Q5_K:
    case MOE_TYPE_Q4_1:
    case MOE_TYPE_Q5_1:
        return DOT_BUDGET_MIN;
    default:
        return DOT_BUDGET;
    }
}

/* ==== Random rows ==== */

/* Gaussian activations with a random scale and ~1% outliers x 20. */
static void random_activations(uint64_t *s, float *x, int64_t n) {
    const double scale = pow(10.0, -2.0 + 3.0 * moe_rng_uniform(s));
    for (int64_t i = 0; i < n; i++) {
        double v = moe_rng_gaussian(s) * scale;
        if (moe_rng_uniform(s) < 0.01) v *= 20;
        x[i] = (float)v;
    }
}

/* sum |w_i x_i| over the dequantized weight and activation rows. */
static double abs_dot(moe_type t, const void *w, const void *xq, int64_t n) {
    const moe_type_traits *tw = moe_type_traits_get(t);
    const moe_type_traits *tx = moe_type_traits_get(tw->dot_type);
    float *a = moe_xmalloc((size_t)n * sizeof(float)), *b = moe_xmalloc((size_t)n * sizeof(float));
    tw->to_float(w, a, n);
    tx->to_float(xq, b, n);
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += fabs((double)a[i] * b[i]);
    free(a), free(b);
    return sum;
}

/* ==== Levels and tables ==== */

static void isa_levels_resolve(void **state) {
    (void)state;
    char why[200];
    for (int i = 0; i < MOE_ISA_COUNT; i++) {
        moe_isa back;
        assert_true(moe_isa_from_name(moe_isa_name((moe_isa)i), &back));
        assert_int_equal(back, i);
    }
    assert_false(moe_isa_from_name("avx", &(moe_isa){0}));
    const unsigned skx = 1u << MOE_ISA_AVX2 | 1u << MOE_ISA_AVX512,
                   adl = 1u << MOE_ISA_AVX2 | 1u << MOE_ISA_AVXVNNI,
                   all = (1u << MOE_ISA_COUNT) - 1;
    assert_int_equal(moe_cpu_isa_resolve(NULL, skx, why, sizeof why), MOE_ISA_AVX512);
    assert_string_equal(why, "");
    assert_int_equal(moe_cpu_isa_resolve("", 1u << MOE_ISA_AVX2, why, sizeof why), MOE_ISA_AVX2);
    assert_int_equal(moe_cpu_isa_resolve("scalar", all, why, sizeof why), MOE_ISA_SCALAR);
    assert_string_equal(why, "");
    assert_int_equal(moe_cpu_isa_resolve("avx2", skx, why, sizeof why), MOE_ISA_AVX2);
    assert_int_equal(moe_cpu_isa_resolve(NULL, adl, why, sizeof why), MOE_ISA_AVXVNNI);
    assert_int_equal(moe_cpu_isa_resolve("avxvnni", all, why, sizeof why), MOE_ISA_AVXVNNI);
    assert_int_equal(moe_cpu_isa_resolve(NULL, all, why, sizeof why), MOE_ISA_AMX);
    /* a level the CPU does not run: the best it has, and a reason */
    assert_int_equal(moe_cpu_isa_resolve("avx512vnni", 1u << MOE_ISA_AVX2, why, sizeof why),
                     MOE_ISA_AVX2);
    assert_non_null(strstr(why, "runs scalar, avx2)"));
    assert_int_equal(moe_cpu_isa_resolve("avxvnni", skx, why, sizeof why), MOE_ISA_AVX512);
    assert_non_null(strstr(why, "runs scalar, avx2, avx512)"));
    assert_int_equal(moe_cpu_isa_resolve("avx512", adl, why, sizeof why), MOE_ISA_AVXVNNI);
    assert_int_equal(moe_cpu_isa_resolve("sse9", skx, why, sizeof why), MOE_ISA_AVX512);
    assert_non_null(strstr(why, "sse9"));
    /* which CPUs run avxvnni: a branch off avx2, never implied by AVX-512 */
    moe_cpu_features f = {.avx2 = true, .fma = true, .f16c = true};
    assert_int_equal(moe_cpu_levels_of(&f), 1u | 1u << MOE_ISA_AVX2);
    f.avxvnni = true; /* Alder Lake */
    assert_int_equal(moe_cpu_levels_of(&f), 1u | adl);
    f.avxvnni = false, f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = true; /* Skylake-X */
    assert_int_equal(moe_cpu_levels_of(&f), 1u | skx);
    f.avx512vnni = f.avx512vbmi = true; /* without GFNI and BMI2 (no such CPU): not the level */
    assert_int_equal(moe_cpu_levels_of(&f), 1u | skx);
    f.gfni = f.bmi2 = true; /* Ice Lake */
    assert_int_equal(moe_cpu_levels_of(&f), 1u | skx | 1u << MOE_ISA_AVX512VNNI);
    f.avxvnni = f.amx_tile = f.amx_int8 = true; /* Sapphire Rapids: amx is still the best */
    assert_int_equal(moe_cpu_levels_of(&f), 1u | all);
    assert_int_equal(moe_cpu_isa_resolve(NULL, moe_cpu_levels_of(&f), why, sizeof why),
                     MOE_ISA_AMX);
    f.avx2 = false; /* no AVX2: nothing but scalar, whatever else is set */
    assert_int_equal(moe_cpu_levels_of(&f), 1u);
    /* the process's own level follows MOE_ISA when that is runnable */
    moe_isa want = moe_cpu_isa_supported();
    const char *env = getenv("MOE_ISA");
    moe_isa asked;
    if (env && moe_isa_from_name(env, &asked) && moe_cpu_isa_runs(asked)) want = asked;
    assert_int_equal(moe_cpu_isa(), want);
    assert_int_equal(moe_kernels_get()->isa, want);
    char desc[256];
    moe_cpu_describe(desc, sizeof desc);
    print_message("[ MEASURE  ] cpu: %s; supported %s, active %s\n", desc,
                  moe_isa_name(moe_cpu_isa_supported()), moe_isa_name(moe_cpu_isa()));
}

static void tables_cover_every_dot(void **state) {
    (void)state;
    for (int level = 0; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!moe_cpu_isa_runs((moe_isa)level)) {
            assert_null(k);
            continue;
        }
        assert_non_null(k);
        assert_int_equal(k->isa, level);
        assert_string_equal(k->name, moe_isa_name((moe_isa)level));
        char line[512] = "";
        for (int t = 0; t < MOE_TYPE_COUNT; t++) {
            const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
            const moe_type_kernels *e = &k->types[t];
            if (!tr || !tr->dot) {
                assert_null(e->dot);
                continue;
            }
            assert_non_null(e->dot);
            assert_non_null(e->quantize_row_for_dot);
            assert_int_equal(e->dot_type, tr->dot_type);
            assert_true(e->dot_isa <= k->isa && e->quantize_isa <= k->isa);
            /* avxvnni is no level below avx512: nothing of it reaches another table */
            if (level != MOE_ISA_AVXVNNI)
                assert_true(e->dot_isa != MOE_ISA_AVXVNNI && e->quantize_isa != MOE_ISA_AVXVNNI);
            if (level == MOE_ISA_SCALAR) assert_ptr_equal(e->dot, tr->dot);
            if (e->dot_isa == k->isa && level > 0)
                snprintf(line + strlen(line), sizeof line - strlen(line), " %s", tr->name);
        }
        if (level > 0) print_message("[ MEASURE  ] %s dots:%s\n", k->name, line);
    }
    assert_ptr_equal(moe_kernels_type(MOE_TYPE_Q4_K), &moe_kernels_get()->types[MOE_TYPE_Q4_K]);
    assert_null(moe_kernels_type((moe_type)MOE_TYPE_COUNT));
}

/* ==== Activation conversions: byte for byte with the reference ==== */

/* One weight type per activation type. */
static const moe_type ACT_TYPES[] = {MOE_TYPE_Q8_0, MOE_TYPE_Q4_1, MOE_TYPE_Q4_K,
                                     MOE_TYPE_F16,  MOE_TYPE_BF16, MOE_TYPE_F32};

static void check_conversion(const moe_kernels *k, moe_type wt, const float *x, int64_t n,
                             const char *what) {
    const moe_type_kernels *ref = &moe_kernels_for_isa(MOE_ISA_SCALAR)->types[wt];
    const size_t bytes = (size_t)moe_dot_row_bytes(wt, n);
    uint8_t *want = moe_xmalloc(bytes + 1), *got = moe_xmalloc(bytes + 1);
    got[bytes] = want[bytes] = 0xa5; /* a canary past the end */
    ref->quantize_row_for_dot(x, want, n);
    k->types[wt].quantize_row_for_dot(x, got, n);
    if (memcmp(got, want, bytes + 1) != 0) {
        size_t b = 0;
        while (got[b] == want[b]) b++;
        fail_msg("%s: %s activations (%s, n = %lld): byte %zu of %zu is 0x%02x, reference 0x%02x",
                 k->name, moe_type_name(moe_dot_type(wt)), what, (long long)n, b, bytes, got[b],
                 want[b]);
    }
    free(want), free(got);
}

static void activation_conversions_byte_exact(void **state) {
    (void)state;
    uint64_t seed = 11;
    const int64_t lens[] = {256, 512, 1024, 2816, 4096};
    float *x = moe_xmalloc(4096 * sizeof(float));
    for (int level = 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        for (size_t a = 0; a < sizeof ACT_TYPES / sizeof ACT_TYPES[0]; a++) {
            const moe_type wt = ACT_TYPES[a];
            const int64_t bv = moe_type_traits_get(moe_dot_type(wt))->block_values;
            for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
                random_activations(&seed, x, lens[l]);
                check_conversion(k, wt, x, lens[l], "gaussian");
            }
            /* odd lengths where the type allows them (F16 / BF16 / F32 tails) */
            if (bv == 1)
                for (int64_t n = 1; n < 40; n += 3) {
                    random_activations(&seed, x, n);
                    check_conversion(k, wt, x, n, "odd length");
                }
            /* specials: zeros (a zero block), ties, a negative max, subnormals, huge, NaN */
            memset(x, 0, 512 * sizeof(float));
            x[300] = -3.0f, x[301] = 3.0f, x[302] = 1.5f, x[303] = 2.5f, x[304] = -0.5f;
            x[305] = 1e-41f, x[306] = -7e-39f, x[307] = 6e-8f, x[308] = 65519.0f, x[309] = 7e4f;
            for (int i = 320; i < 352; i++) x[i] = (float)(i - 336) * 0.5f; /* ties at d = 1 */
            x[320] = 127.0f;
            if (bv == 1) x[310] = NAN;
            check_conversion(k, wt, x, 512, "special values");
        }
    }
    free(x);
}

/* ggml's activation bytes come out of every table too. */
static void activation_fixtures_byte_exact(void **state) {
    (void)state;
    const moe_test_quant_fixture *fx;
    const int nf = moe_test_quant_fixtures(&fx);
    for (int level = 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        for (int i = 0; i < nf; i++) {
            const moe_test_quant_fixture *f = &fx[i];
            const size_t xb = (size_t)moe_dot_row_bytes(f->type, f->row_len);
            float *x = (float *)moe_test_quant_read(
                f, "x.f32", MOE_TEST_QUANT_N_VEC * (size_t)f->row_len * sizeof(float));
            uint8_t *want = moe_test_quant_read(f, "xq.blocks", MOE_TEST_QUANT_N_VEC * xb);
            uint8_t *got = moe_xmalloc(xb);
            for (int j = 0; j < MOE_TEST_QUANT_N_VEC; j++) {
                k->types[f->type].quantize_row_for_dot(x + j * f->row_len, got, f->row_len);
                if (memcmp(got, want + j * xb, xb) != 0)
                    fail_msg("%s: %s activation row %d differs from ggml-cpu", k->name, f->name, j);
            }
            free(x), free(want), free(got);
        }
    }
}

/* ==== Dots against the reference ==== */

typedef struct {
    double worst[MOE_TYPE_COUNT]; /* max |err| / magnitude per type */
    char failed[512];
} dot_report;

static void check_dot(const moe_kernels *k, moe_type t, const uint8_t *w, const uint8_t *xq,
                      int64_t n, dot_report *r, const char *what) {
    const double want = moe_kernels_for_isa(MOE_ISA_SCALAR)->types[t].dot(w, xq, n);
    const double got = k->types[t].dot(w, xq, n);
    const double mag = abs_dot(t, w, xq, n);
    const double err = fabs(got - want);
    if (!(err <= dot_budget(t) * mag) && !(err == 0)) {
        print_error("%s %s (%s, n = %lld): %.9g, reference %.9g (%.2e x magnitude)\n", k->name,
                    moe_type_name(t), what, (long long)n, got, want, mag > 0 ? err / mag : err);
        if (!strstr(r->failed, moe_type_name(t)))
            strcat(r->failed, moe_type_name(t)), strcat(r->failed, " ");
    }
    if (mag > 0 && err / mag > r->worst[t]) r->worst[t] = err / mag;
}

static void report(const moe_kernels *k, const dot_report *r, const char *what) {
    char line[1024] = "";
    for (int t = 0; t < MOE_TYPE_COUNT; t++)
        if (k->types[t].dot && k->types[t].dot_isa > MOE_ISA_SCALAR)
            snprintf(line + strlen(line), sizeof line - strlen(line), " %s %.1e", moe_type_name(t),
                     r->worst[t]);
    print_message("[ MEASURE  ] %s dots vs reference (%s), max err / magnitude:%s\n", k->name, what,
                  line);
    if (r->failed[0]) fail_msg("%s dots off the reference for: %s", k->name, r->failed);
}

static void dots_match_reference_on_fixtures(void **state) {
    (void)state;
    const moe_test_quant_fixture *fx;
    const int nf = moe_test_quant_fixtures(&fx);
    for (int level = 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        dot_report r = {{0}, ""};
        for (int i = 0; i < nf; i++) {
            const moe_test_quant_fixture *f = &fx[i];
            const size_t rb = (size_t)moe_type_row_bytes(f->type, f->row_len);
            const size_t xb = (size_t)moe_dot_row_bytes(f->type, f->row_len);
            uint8_t *w = moe_test_quant_read(f, "blocks", rb * (size_t)f->n_rows);
            uint8_t *xq = moe_test_quant_read(f, "xq.blocks", MOE_TEST_QUANT_N_VEC * xb);
            for (int64_t row = 0; row < f->n_rows; row++)
                for (int j = 0; j < MOE_TEST_QUANT_N_VEC; j++) {
                    check_dot(k, f->type, w + row * rb, xq + j * xb, f->row_len, &r, "fixture");
                    /* the first block alone, and all but the last (odd block counts) */
                    const int64_t bv = f->block_values == 1 ? 1 : f->block_values;
                    const int64_t one = f->block_values == 1 ? 33 : bv;
                    check_dot(k, f->type, w + row * rb, xq + j * xb, one, &r, "first block");
                    check_dot(k, f->type, w + row * rb, xq + j * xb, f->row_len - bv, &r, "prefix");
                }
            free(w), free(xq);
        }
        report(k, &r, "ggml fixtures");
    }
}

static void dots_match_reference_on_random_rows(void **state) {
    (void)state;
    /* lengths in blocks (values for the plain float types) */
    static const int64_t blocks[] = {1, 2, 3, 5, 7, 13, 33};
    static const int64_t values[] = {1, 7, 8, 31, 33, 100, 257, 1056, 4099};
    const int64_t max_n = 33 * 256;
    uint8_t *w = moe_xmalloc((size_t)max_n * 4);
    uint8_t *xq = moe_xmalloc((size_t)max_n * 4);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float));
    for (int level = 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        dot_report r = {{0}, ""};
        uint64_t seed = 1234;
        for (int t = 0; t < MOE_TYPE_COUNT; t++) {
            const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
            if (!tr || !tr->dot || t == MOE_TYPE_Q8_1 || t == MOE_TYPE_Q8_K) continue;
            const bool plain = tr->block_values == 1;
            const size_t count =
                plain ? sizeof values / sizeof values[0] : sizeof blocks / sizeof blocks[0];
            for (size_t c = 0; c < count; c++)
                for (int rep = 0; rep < 4; rep++) {
                    const int64_t n = plain ? values[c] : blocks[c] * tr->block_values;
                    moe_type_random_row((moe_type)t, &seed, w, n);
                    random_activations(&seed, x, n);
                    moe_kernels_for_isa(MOE_ISA_SCALAR)->types[t].quantize_row_for_dot(x, xq, n);
                    check_dot(k, (moe_type)t, w, xq, n, &r, "random");
                }
        }
        report(k, &r, "random rows");
    }
    free(w), free(xq), free(x);
}

/* ==== Many-row dots (GEMM) against the single-row dot, bit for bit ==== */

/* For every level and every type with a dot: one weight row against 1..11 activation rows, and
 * 63..65 and 70 (past the 64-row groups a many-row kernel may decode a chunk of blocks for),
 * strided apart with padding, outputs strided too, through moe_dot_rows, each result equal to
 * the level's own dot on that row to the last bit (memcmp, so -0.0 and NaN payloads count).
 * This is what keeps a batch of streams giving each stream exactly what it gets alone. Also
 * asserts that the levels which claim a many-row kernel for the types the engine leans on
 * (IQ2_S, IQ3_S, Q4_K, Q6_K, Q8_0; IQ2_XXS, IQ2_XS, IQ3_XXS from avx512vnni) really install
 * one, so the test compares real kernels. */
static void dot_rows_equal_single_rows(void **state) {
    (void)state;
    static const int64_t blocks[] = {1, 3, 8, 25};
    static const int row_counts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 63, 64, 65, 70};
    enum { MAX_ROWS = 70, OUT_STRIDE = 3 };
    const int64_t max_n = 25 * 256;
    const size_t x_stride = (size_t)max_n * 4 + 64; /* room for any dot type, plus padding */
    uint8_t *w = moe_xmalloc((size_t)max_n * 8);    /* two rows of up to 4 bytes a value */
    uint8_t *xq = moe_xmalloc(x_stride * MAX_ROWS);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float));
    float out[MAX_ROWS * OUT_STRIDE];
    int checked_kernels = 0, checked_pairs = 0;
    for (int level = 0; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        uint64_t seed = 99 + (uint64_t)level;
        for (int t = 0; t < MOE_TYPE_COUNT; t++) {
            const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
            const moe_type_kernels *e = &k->types[t];
            if (!tr || !e->dot || t == MOE_TYPE_Q8_1 || t == MOE_TYPE_Q8_K) continue;
            if (e->dot_rows) checked_kernels++;
            if (e->dot_rows2) checked_pairs++;
            for (size_t c = 0; c < sizeof blocks / sizeof blocks[0]; c++) {
                const int64_t n = blocks[c] * (tr->block_values == 1 ? 37 : tr->block_values);
                const size_t w_bytes = moe_type_row_bytes((moe_type)t, n);
                moe_type_random_row((moe_type)t, &seed, w, n);
                moe_type_random_row((moe_type)t, &seed, w + w_bytes, n);
                for (int r = 0; r < MAX_ROWS; r++) {
                    random_activations(&seed, x, n);
                    e->quantize_row_for_dot(x, xq + (size_t)r * x_stride, n);
                }
                for (size_t rc = 0; rc < sizeof row_counts / sizeof row_counts[0]; rc++) {
                    const int rows = row_counts[rc];
                    memset(out, 0xff, sizeof out);
                    moe_dot_rows(e, w, xq, x_stride, rows, n, out, OUT_STRIDE);
                    for (int r = 0; r < rows; r++) {
                        const float one = e->dot(w, xq + (size_t)r * x_stride, n);
                        if (memcmp(&one, &out[r * OUT_STRIDE], sizeof one) != 0)
                            fail_msg("%s %s, n = %lld, %d rows: row %d is %.9g, alone %.9g",
                                     k->name, tr->name, (long long)n, rows, r, out[r * OUT_STRIDE],
                                     one);
                    }
                    if (!e->dot_rows2) continue;
                    /* two weight rows at once: the second one right after the first */
                    memset(out, 0xff, sizeof out);
                    e->dot_rows2(w, w_bytes, xq, x_stride, rows, n, out, OUT_STRIDE);
                    for (int r = 0; r < rows; r++)
                        for (int v = 0; v < 2; v++) {
                            const float one = e->dot(w + v * w_bytes, xq + (size_t)r * x_stride, n);
                            if (memcmp(&one, &out[r * OUT_STRIDE + v], sizeof one) != 0)
                                fail_msg("%s %s two weight rows, n = %lld, %d rows: weight row %d, "
                                         "row %d is %.9g, alone %.9g",
                                         k->name, tr->name, (long long)n, rows, v, r,
                                         out[r * OUT_STRIDE + v], one);
                        }
                }
            }
        }
        if (level >= MOE_ISA_AVX2) {
            static const moe_type gemm_types[] = {
                MOE_TYPE_IQ2_S, MOE_TYPE_IQ3_S,   MOE_TYPE_Q4_K,   MOE_TYPE_Q6_K,
                MOE_TYPE_Q8_0,  MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ2_XS, MOE_TYPE_IQ3_XXS};
            /* the last three from the VNNI+VBMI level on */
            const size_t n = level >= MOE_ISA_AVX512VNNI ? 8 : 5;
            for (size_t i = 0; i < n; i++)
                if (!k->types[gemm_types[i]].dot_rows)
                    fail_msg("%s: no many-row kernel for %s", k->name,
                             moe_type_name(gemm_types[i]));
        }
        if (level == MOE_ISA_AVX512VNNI) /* there, every weight type has one */
            for (int t = 0; t < MOE_TYPE_COUNT; t++)
                if (k->types[t].dot && t != MOE_TYPE_Q8_1 && t != MOE_TYPE_Q8_K &&
                    !k->types[t].dot_rows)
                    fail_msg("%s: no many-row kernel for %s", k->name, moe_type_name((moe_type)t));
    }
    printf("  dot_rows: %d many-row kernels and %d two-weight-row kernels (all levels) equal their "
           "single-row dots bit for bit\n",
           checked_kernels, checked_pairs);
    free(w), free(xq), free(x);
}

/* ==== The fast path (quant.h, "The two paths") ==== */

/* Where a block of type t keeps its float scales (at, bytes: left alone when a block is filled
 * with extreme integers); false: the test has no extreme blocks for the type. */
static bool block_float_head(moe_type t, size_t *at, size_t *bytes) {
    *at = 0, *bytes = 2; /* an f16 d first */
    switch (t) {
    case MOE_TYPE_Q4_0:
    case MOE_TYPE_Q5_0:
    case MOE_TYPE_Q8_0:
    case MOE_TYPE_IQ4_NL:
    case MOE_TYPE_IQ4_XS:
        return true;
    case MOE_TYPE_MXFP4: /* its e8m0 byte */
        *bytes = 1;
        return true;
    case MOE_TYPE_Q4_K: /* d, dmin */
    case MOE_TYPE_Q5_K:
        *bytes = 4;
        return true;
    case MOE_TYPE_Q6_K: /* d, last */
        *at = offsetof(moe_block_q6_k, d);
        return true;
    default:
        return false;
    }
}

/* Every block of a row of type t (n values) but its float scales set to byte `fill`: integer
 * values, scales and mins at their largest (0xff: Q4_K / Q5_K values 15 / 31 at scale and min
 * 63, Q6_K 31 at scale -1, Q8_0 -1), smallest (0x80: Q8_0 -128, Q6_K scale -128) or
 * mixed; false: block_float_head has none for t. */
static bool extreme_row(moe_type t, uint8_t *row, int64_t n, uint8_t fill) {
    size_t at, head;
    if (!block_float_head(t, &at, &head)) return false;
    const moe_type_traits *tr = moe_type_traits_get(t);
    for (int64_t b = 0; b < (int64_t)moe_type_row_bytes(t, n); b++) {
        const size_t k = (size_t)b % tr->block_bytes;
        if (k < at || k >= at + head) row[b] = fill;
    }
    return true;
}

/* Every level's fast table: where its dot is not the exact table's, it gives the scalar fast
 * table's bits (the reference of the fast order, ref_fast.c) on random rows of 1..40 blocks, and
 * on rows of extreme blocks (extreme_row) against activations at +-127, and that reference is
 * within DOT_BUDGET of the exact scalar dot (the same sum in another order); its tile kernel
 * gives each (weight row, activation row) the dot's bits at any tile width and row count.
 * Everything else on the fast table is the exact table's. */
static void fast_path_matches_its_reference(void **state) {
    (void)state;
    enum { MAX_W = MOE_DOT_TILE_W, MAX_X = 70, MAX_BLOCKS = 40 };
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    const moe_kernels *exact_ref = moe_kernels_for_isa(MOE_ISA_SCALAR);
    const int64_t max_n = MAX_BLOCKS * 256;
    const size_t w_stride = (size_t)max_n * 2, x_stride = (size_t)max_n * 2;
    uint8_t *w = moe_xmalloc(w_stride * MAX_W), *xq = moe_xmalloc(x_stride * MAX_X);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float));
    float *out = moe_xmalloc(sizeof(float) * MAX_X * MAX_W);
    int fast_kernels = 0;
    for (int level = 0; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_path((moe_isa)level, false);
        const moe_kernels *ex = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        assert_false(k->exact);
        assert_true(ex->exact);
        uint64_t seed = 5 + (uint64_t)level;
        for (int t = 0; t < MOE_TYPE_COUNT; t++) {
            const moe_type_kernels *e = &k->types[t];
            if (e->dot == ex->types[t].dot) { /* no fast kernel: the exact entry, untouched */
                assert_true(memcmp(e, &ex->types[t], sizeof *e) == 0);
                continue;
            }
            fast_kernels++;
            const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
            if (ref->types[t].dot == exact_ref->types[t].dot)
                fail_msg("%s: fast %s kernel without a scalar reference", k->name, tr->name);
            /* 1, 14, 27 and 40 blocks random; then 14 blocks extreme */
            for (int64_t blocks = 1; blocks <= MAX_BLOCKS + 14; blocks += 13) {
                const bool extreme = blocks > MAX_BLOCKS;
                const int64_t n = (extreme ? 14 : blocks) * tr->block_values;
                static const uint8_t fills[] = {0xff, 0x80, 0x7f, 0x81, 0x00};
                for (int v = 0; v < MAX_W; v++) {
                    moe_type_random_row((moe_type)t, &seed, w + (size_t)v * w_stride, n);
                    if (extreme && !extreme_row((moe_type)t, w + (size_t)v * w_stride, n,
                                                fills[v % sizeof fills]))
                        break;
                }
                if (extreme && !block_float_head((moe_type)t, &(size_t){0}, &(size_t){0})) continue;
                for (int r = 0; r < MAX_X; r++) {
                    if (extreme)
                        for (int64_t i = 0; i < n; i++) x[i] = (i + r) % 3 ? 1.0f : -1.0f;
                    else
                        random_activations(&seed, x, n);
                    e->quantize_row_for_dot(x, xq + (size_t)r * x_stride, n);
                }
                for (int r = 0; r < 4; r++) {
                    const uint8_t *xr = xq + (size_t)r * x_stride;
                    const float got = e->dot(w, xr, n), want = ref->types[t].dot(w, xr, n);
                    if (memcmp(&got, &want, sizeof got) != 0)
                        fail_msg("%s fast %s, n = %lld: %.9g, reference %.9g", k->name, tr->name,
                                 (long long)n, got, want);
                    const double exact = exact_ref->types[t].dot(w, xr, n);
                    const double mag = abs_dot((moe_type)t, w, xr, n);
                    if (!extreme && fabs(want - exact) > dot_budget((moe_type)t) * mag)
                        fail_msg("fast %s reference, n = %lld: %.9g, exact %.9g", tr->name,
                                 (long long)n, want, exact);
                }
                if (!e->dot_tile) continue;
                /* rows: both sides of the switch from the lanes to the tile (8; avx2's K quants
                 * 32), of the row groups (4; 8 in fast_avx512vnni.c's tiles) and of the amx level's
                 * 16-row tiles */
                static const int widths[] = {1, 5, 9, MAX_W},
                                 rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 31, 32, 64, MAX_X};
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < (int)(sizeof rows / sizeof rows[0]); b++) {
                        memset(out, 0xff, sizeof(float) * MAX_X * MAX_W);
                        e->dot_tile(w, w_stride, widths[a], xq, x_stride, rows[b], n, out, MAX_W);
                        for (int r = 0; r < rows[b]; r++)
                            for (int v = 0; v < widths[a]; v++) {
                                const float one =
                                    e->dot(w + (size_t)v * w_stride, xq + (size_t)r * x_stride, n);
                                if (memcmp(&one, &out[r * MAX_W + v], sizeof one) != 0)
                                    fail_msg("%s fast %s tile of %d x %d, n = %lld: weight row "
                                             "%d, row %d is %.9g, alone %.9g",
                                             k->name, tr->name, widths[a], rows[b], (long long)n, v,
                                             r, out[r * MAX_W + v], one);
                            }
                    }
            }
        }
    }
    print_message("[ MEASURE  ] %d fast kernels (all levels) give their reference's bits\n",
                  fast_kernels);
    assert_true(fast_kernels > 0);
    /* the levels with fast kernels of their own have them for the 32-value types against Q8_0,
     * the K quants of Q4_K_M-like builds and every codebook type */
    static const moe_type own[] = {
        MOE_TYPE_Q8_0,    MOE_TYPE_Q4_0,   MOE_TYPE_Q5_0,  MOE_TYPE_IQ4_NL,
        MOE_TYPE_MXFP4,   MOE_TYPE_Q4_K,   MOE_TYPE_Q5_K,  MOE_TYPE_Q6_K,
        MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ2_XS, MOE_TYPE_IQ2_S, MOE_TYPE_IQ3_XXS,
        MOE_TYPE_IQ3_S,   MOE_TYPE_IQ1_S,  MOE_TYPE_IQ1_M, MOE_TYPE_IQ4_XS};
    static const moe_isa levels[] = {MOE_ISA_AVX2, MOE_ISA_AVXVNNI, MOE_ISA_AVX512VNNI};
    for (size_t l = 0; l < sizeof levels / sizeof levels[0]; l++) {
        const moe_kernels *k = moe_kernels_for_path(levels[l], false);
        if (!k) continue;
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
            if (k->types[own[i]].dot_isa != levels[l] || !k->types[own[i]].dot_tile)
                fail_msg("%s fast table: no %s fast kernel of its own", k->name,
                         moe_type_name(own[i]));
    }
    free(w), free(xq), free(x), free(out);
}

/* ==== Repacked layouts (quant.h, "Weight layouts in memory") ==== */

/* MOE_LAYOUT_ROWS16, byte by byte as quant.h defines it (not through layout.c's own loop): 16
 * random rows of 1..40 blocks (32 or 256 values) packed, every head and body dword found where the
 * definition puts it (Q4_K, Q5_K: the head is d and dmin; Q6_K: the block's last 2 bytes, its d;
 * IQ4_XS: d, scales_h, scales_l), unpacked back to the same bytes; then at every level whose fast
 * table has a kernel on the layout, each (weight row, activation row) of the packed group gives
 * the scalar fast reference's bits on the file's row (1..70 activation rows: both sides of the row
 * groups). */
static void rows16_layout_and_kernels(void **state) {
    (void)state;
    enum { MAX_X = 70, MAX_BLOCKS = 40 };
    static const moe_type types[] = {MOE_TYPE_Q8_0,   MOE_TYPE_Q4_0,    MOE_TYPE_IQ4_NL,
                                     MOE_TYPE_MXFP4,  MOE_TYPE_Q6_K,    MOE_TYPE_Q4_K,
                                     MOE_TYPE_Q5_K,   MOE_TYPE_IQ3_XXS, MOE_TYPE_IQ2_XXS,
                                     MOE_TYPE_IQ4_XS, MOE_TYPE_IQ3_S};
    static const size_t heads[] = {2, 2, 2, 1, 2, 4, 4, 2, 2, 8, 2},
                        head_at[] = {0, 0, 0, 0, 208, 0, 0, 0, 0, 0, 0};
    enum { N_TYPES = sizeof types / sizeof types[0] };
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    const int64_t max_n = MAX_BLOCKS * MOE_QK_K;
    const size_t max_row = (size_t)moe_type_row_bytes(MOE_TYPE_Q8_K, max_n); /* > any type's */
    uint8_t *rows = moe_xmalloc(max_row * 16), *group = moe_xmalloc(max_row * 16),
            *back = moe_xmalloc(max_row * 16), *xq = moe_xmalloc(max_row * MAX_X);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float)),
          *out = moe_xmalloc(sizeof(float) * 16 * MAX_X);
    uint64_t seed = 18;
    int kernels = 0;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const moe_type t = types[ti];
        const moe_type_traits *tr = moe_type_traits_get(t);
        const size_t bb = tr->block_bytes, head = heads[ti], at = head_at[ti];
        assert_true(moe_layout_has_type(MOE_LAYOUT_ROWS16, t));
        for (int64_t blocks = 1; blocks <= MAX_BLOCKS; blocks += 13) {
            const int64_t n = blocks * tr->block_values;
            const size_t row_bytes = (size_t)moe_type_row_bytes(t, n);
            for (int v = 0; v < 16; v++) moe_type_random_row(t, &seed, rows + v * row_bytes, n);
            if (t == MOE_TYPE_MXFP4) /* the e8m0 exponents whose scales are subnormal */
                for (int v = 0; v < 4; v++) rows[v * row_bytes + bb * (size_t)(v % blocks)] = v % 2;
            moe_layout_rows16_pack(t, rows, group, n);
            for (int64_t i = 0; i < blocks; i++)
                for (int v = 0; v < 16; v++) {
                    const uint8_t *blk = rows + v * row_bytes + i * bb, *g = group + i * 16 * bb;
                    assert_memory_equal(g + v * head, blk + at, head);
                    for (size_t k = 0; k < (bb - head) / 4; k++) /* the body: around the head */
                        assert_memory_equal(g + 16 * head + 64 * k + 4 * v,
                                            blk + (4 * k < at ? 4 * k : 4 * k + head), 4);
                }
            moe_layout_rows16_unpack(t, group, back, n);
            assert_memory_equal(back, rows, 16 * row_bytes);
            const size_t xs = (size_t)moe_dot_row_bytes(t, n);
            for (int r = 0; r < MAX_X; r++) {
                random_activations(&seed, x, n);
                ref->types[t].quantize_row_for_dot(x, xq + (size_t)r * xs, n);
            }
            for (int level = 0; level < MOE_ISA_COUNT; level++) {
                const moe_kernels *k = moe_kernels_for_path((moe_isa)level, false);
                if (!k || !k->types[t].dot_tile_rows16) continue;
                kernels += blocks == 1;
                static const int counts[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 64, MAX_X};
                for (int c = 0; c < (int)(sizeof counts / sizeof counts[0]); c++) {
                    memset(out, 0xff, sizeof(float) * 16 * MAX_X);
                    k->types[t].dot_tile_rows16(group, 0, 16, xq, xs, counts[c], n, out, 16);
                    for (int r = 0; r < counts[c]; r++)
                        for (int v = 0; v < 16; v++) {
                            const float want =
                                ref->types[t].dot(rows + v * row_bytes, xq + (size_t)r * xs, n);
                            if (memcmp(&want, &out[r * 16 + v], sizeof want) != 0)
                                fail_msg("%s %s on ROWS16, %d rows, n = %lld: weight row %d, "
                                         "row %d is %.9g, the reference %.9g",
                                         k->name, moe_type_name(t), counts[c], (long long)n, v, r,
                                         out[r * 16 + v], want);
                        }
                }
            }
        }
    }
    print_message("[ MEASURE  ] %d kernels on MOE_LAYOUT_ROWS16 (all levels) give the reference's "
                  "bits\n",
                  kernels);
    /* the levels with the 16-lane tile (avx512vnni, amx) have all */
    const int tile_levels = (moe_kernels_for_path(MOE_ISA_AVX512VNNI, false) != NULL) +
                            (moe_kernels_for_path(MOE_ISA_AMX, false) != NULL);
    assert_int_equal(kernels, N_TYPES * tile_levels);
    assert_false(moe_layout_has_type(MOE_LAYOUT_ROWS16, MOE_TYPE_Q2_K));
    assert_false(moe_layout_has_type(MOE_LAYOUT_ROWS16, MOE_TYPE_IQ2_S)); /* fast_avx512vnni.c */
    free(rows), free(group), free(back), free(xq), free(x), free(out);
}

/* The avxvnni level: its exact table is avx2's, entry for entry; its fast table has a kernel of
 * its own where avx2's has one (avx2's fast kernels built with vpdpbusd), and each gives avx2's
 * fast bits, bit for bit, single rows and tiles of 1..70 activation rows (the int8 tile from 8),
 * on random rows and on activations at +-127 (with weights at their largest magnitudes too,
 * extreme_row: where a saturating multiply would part). Skipped where the CPU has no AVX-VNNI.
 */
static void avxvnni_is_avx2_with_vpdpbusd(void **state) {
    (void)state;
    const moe_kernels *vx = moe_kernels_for_isa(MOE_ISA_AVXVNNI),
                      *ax = moe_kernels_for_isa(MOE_ISA_AVX2),
                      *vf = moe_kernels_for_path(MOE_ISA_AVXVNNI, false),
                      *af = moe_kernels_for_path(MOE_ISA_AVX2, false);
    if (!vx) {
        print_message("[ SKIPPED  ] no AVX-VNNI here: %s is the best kernel table\n",
                      moe_isa_name(moe_cpu_isa_supported()));
        skip();
    }
    assert_memory_equal(vx->types, ax->types, sizeof vx->types);
    assert_true(vx->attn_scores == ax->attn_scores && vx->attn_mix == ax->attn_mix &&
                vx->attn_tile == ax->attn_tile);
    enum { MAX_W = MOE_DOT_TILE_W, MAX_X = 70, BLOCKS = 7, N = BLOCKS * 256 };
    const size_t w_stride = 2 * N, x_stride = 2 * N; /* bytes: more than any type's row */
    uint8_t *w = moe_xmalloc(w_stride * MAX_W + x_stride * MAX_X), *xq = w + w_stride * MAX_W;
    float *x = moe_xmalloc(sizeof(float) * (N + MAX_X * MAX_W)), *out = x + N;
    uint64_t seed = 44;
    int own = 0;
    for (int t = 0; t < MOE_TYPE_COUNT; t++) {
        const moe_type_kernels *v = &vf->types[t], *a = &af->types[t];
        if (!v->dot) continue;
        if ((v->dot_isa == MOE_ISA_AVXVNNI) !=
            (a->dot_isa == MOE_ISA_AVX2 && a->dot != ax->types[t].dot))
            fail_msg("avxvnni fast %s: %s", moe_type_name((moe_type)t),
                     v->dot_isa == MOE_ISA_AVXVNNI ? "a kernel avx2 has not" : "no twin of avx2's");
        if (v->dot_isa != MOE_ISA_AVXVNNI) {
            assert_memory_equal(v, &vx->types[t], sizeof *v);
            continue;
        }
        own++;
        assert_non_null(v->dot_tile);
        const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
        const int64_t n = N; /* Q8_0: 56 blocks, more than one chunk of its int8 tile */
        for (int pass = 0; pass < 2; pass++) {
            for (int j = 0; j < MAX_W; j++)
                moe_type_random_row((moe_type)t, &seed, w + (size_t)j * w_stride, n);
            /* then the largest magnitudes (extreme_row, the float scales kept): Q8_0's -128
             * and +-127, IQ4_XS's -127 at scale -32 and 113 at 31, the K quants' largest values
             * at their largest scales and mins */
            static const uint8_t fill[4] = {0x00, 0xff, 0x80, 0x81};
            if (pass)
                for (int j = 0; j < MAX_W; j++)
                    extreme_row((moe_type)t, w + (size_t)j * w_stride, n, fill[j % 4]);
            for (int r = 0; r < MAX_X; r++) {
                if (pass)
                    for (int64_t i = 0; i < n; i++) x[i] = (i + r) % 3 ? 1.0f : -1.0f;
                else
                    random_activations(&seed, x, n);
                v->quantize_row_for_dot(x, xq + (size_t)r * x_stride, n);
            }
            static const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 64, MAX_X};
            for (int b = 0; b < (int)(sizeof rows / sizeof rows[0]); b++) {
                memset(out, 0xff, sizeof(float) * MAX_X * MAX_W);
                v->dot_tile(w, w_stride, MAX_W, xq, x_stride, rows[b], n, out, MAX_W);
                for (int r = 0; r < rows[b]; r++)
                    for (int j = 0; j < MAX_W; j++) {
                        const uint8_t *wr = w + (size_t)j * w_stride,
                                      *xr = xq + (size_t)r * x_stride;
                        const float want = a->dot(wr, xr, n), one = v->dot(wr, xr, n);
                        if (memcmp(&want, &out[r * MAX_W + j], sizeof want) != 0 ||
                            memcmp(&want, &one, sizeof want) != 0)
                            fail_msg("avxvnni fast %s (%s), %d rows: weight row %d, row %d is "
                                     "%.9g (alone %.9g), avx2 %.9g",
                                     tr->name, pass ? "largest" : "random", rows[b], j, r,
                                     out[r * MAX_W + j], one, want);
                    }
            }
        }
    }
    print_message("[ MEASURE  ] avxvnni: %d fast kernels give avx2's fast bits\n", own);
    assert_true(own >= 16);
    free(w), free(x);
}

/* ==== The amx level (fast_amx.h) ====
 *
 * Its tile kernels give avx512vnni's bits, bit for bit, at 16, 17, 64 and 70 activation rows (the
 * tiles from 16 rows, Q4_K and Q5_K from 64, then fast_rows for the rows left over, or for the
 * super-block types without mins, on the scaled tiles, the last 16 rows again, reaching back) on
 * random rows of 1..40 blocks, for every type it has one for (all the fast path's types at least,
 * on the file's rows and on MOE_LAYOUT_ROWS16). Skipped where the CPU or the OS offers no AMX. */
static void amx_tiles_equal_avx512vnni(void **state) {
    (void)state;
    const moe_kernels *amx = moe_kernels_for_path(MOE_ISA_AMX, false),
                      *vnni = moe_kernels_for_path(MOE_ISA_AVX512VNNI, false);
    if (!amx) {
        print_message("[ SKIPPED  ] no AMX here (CPU or OS): %s is the best kernel table\n",
                      moe_isa_name(moe_cpu_isa_supported()));
        skip();
    }
    enum { MAX_X = 70, MAX_BLOCKS = 40 };
    static const moe_type must[] = {
        MOE_TYPE_Q8_0,    MOE_TYPE_Q4_0,    MOE_TYPE_IQ4_NL, MOE_TYPE_MXFP4, MOE_TYPE_Q4_K,
        MOE_TYPE_Q5_K,    MOE_TYPE_Q6_K,    MOE_TYPE_IQ3_S,  MOE_TYPE_IQ2_S, MOE_TYPE_IQ2_XS,
        MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ3_XXS, MOE_TYPE_IQ4_XS, MOE_TYPE_IQ1_S, MOE_TYPE_IQ1_M};
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (amx->types[must[i]].dot_isa != MOE_ISA_AMX || !amx->types[must[i]].dot_tile)
            fail_msg("amx fast table: no %s tile kernel of its own", moe_type_name(must[i]));
    const int64_t max_n = MAX_BLOCKS * 256;
    const size_t stride = (size_t)max_n * 2;
    uint8_t *w = moe_xmalloc(stride * 16), *group = moe_xmalloc(stride * 16),
            *xq = moe_xmalloc(stride * MAX_X);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float)),
          *got = moe_xmalloc(sizeof(float) * 16 * MAX_X),
          *want = moe_xmalloc(sizeof(float) * 16 * MAX_X);
    uint64_t seed = 27;
    int compared = 0;
    for (int t = 0; t < MOE_TYPE_COUNT; t++) {
        const moe_type_kernels *a = &amx->types[t], *v = &vnni->types[t];
        if (a->dot_isa != MOE_ISA_AMX) continue;
        const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
        for (int64_t blocks = 1; blocks <= MAX_BLOCKS; blocks += 13) {
            const int64_t n = blocks * tr->block_values;
            const size_t row_bytes = (size_t)moe_type_row_bytes((moe_type)t, n),
                         xs = (size_t)moe_dot_row_bytes((moe_type)t, n);
            for (int r = 0; r < 16; r++)
                moe_type_random_row((moe_type)t, &seed, w + r * row_bytes, n);
            for (int r = 0; r < MAX_X; r++) {
                random_activations(&seed, x, n);
                a->quantize_row_for_dot(x, xq + (size_t)r * xs, n);
            }
            const bool rows16 = a->dot_tile_rows16 != NULL;
            if (rows16) moe_layout_rows16_pack((moe_type)t, w, group, n);
            static const int counts[] = {16, 17, 64, MAX_X}, widths[] = {16, 9};
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < (rows16 ? 3 : 2); k++) {
                    const int n_w = k == 2 ? 16 : widths[k];
                    memset(got, 0xff, sizeof(float) * 16 * MAX_X);
                    memset(want, 0xfe, sizeof(float) * 16 * MAX_X);
                    if (k == 2) {
                        a->dot_tile_rows16(group, 0, 16, xq, xs, counts[c], n, got, 16);
                        v->dot_tile_rows16(group, 0, 16, xq, xs, counts[c], n, want, 16);
                    } else {
                        a->dot_tile(w, row_bytes, n_w, xq, xs, counts[c], n, got, 16);
                        v->dot_tile(w, row_bytes, n_w, xq, xs, counts[c], n, want, 16);
                    }
                    for (int r = 0; r < counts[c]; r++)
                        for (int o = 0; o < n_w; o++)
                            if (memcmp(&got[r * 16 + o], &want[r * 16 + o], sizeof(float)) != 0)
                                fail_msg("amx %s%s, %d rows, n = %lld: weight row %d, row %d is "
                                         "%.9g, avx512vnni %.9g",
                                         tr->name, k == 2 ? " on ROWS16" : "", counts[c],
                                         (long long)n, o, r, got[r * 16 + o], want[r * 16 + o]);
                    compared++;
                }
        }
    }
    print_message("[ MEASURE  ] %d amx tile runs give avx512vnni's bits\n", compared);
    free(w), free(group), free(xq), free(x), free(got), free(want);
}

/* ==== moe --version names the table ==== */

/* The types that carry the ../shared parity models give, at every level above AVX2, the AVX2
 * kernels' floats bit for bit: their 512-bit kernels do only the exact integer work differently
 * (x86_avx512.c says why). Random rows of 1..40 blocks; skipped where the CPU has no AVX-512. */
static void avx512_follows_avx2_floats(void **state) {
    (void)state;
    static const moe_type types[] = {MOE_TYPE_Q8_0,  MOE_TYPE_Q4_0, MOE_TYPE_Q5_0, MOE_TYPE_IQ4_NL,
                                     MOE_TYPE_MXFP4, MOE_TYPE_Q4_K, MOE_TYPE_Q5_K};
    const moe_kernels *base = moe_kernels_for_isa(MOE_ISA_AVX2);
    if (!base || !moe_kernels_for_isa(MOE_ISA_AVX512)) skip();
    const int64_t max_n = 40 * 256;
    uint8_t *w = moe_xmalloc((size_t)max_n * 2), *xq = moe_xmalloc((size_t)max_n * 2);
    float *x = moe_xmalloc((size_t)max_n * sizeof(float));
    uint64_t seed = 7;
    int compared = 0;
    for (int level = MOE_ISA_AVX512; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            const moe_type_traits *tr = moe_type_traits_get(types[t]);
            for (int64_t blocks = 1; blocks <= 40; blocks += 3) {
                const int64_t n = blocks * tr->block_values;
                moe_type_random_row(types[t], &seed, w, n);
                random_activations(&seed, x, n);
                k->types[types[t]].quantize_row_for_dot(x, xq, n);
                const float got = k->types[types[t]].dot(w, xq, n);
                const float want = base->types[types[t]].dot(w, xq, n);
                if (memcmp(&got, &want, sizeof got) != 0)
                    fail_msg("%s %s, n = %lld: %.9g, AVX2 %.9g", k->name, tr->name, (long long)n,
                             got, want);
                compared++;
            }
        }
    }
    printf("  %d dots of the parity-carrying types equal AVX2's bit for bit\n", compared);
    free(w), free(xq), free(x);
}

/* moe_matmul over many rows (several activation tiles, weight blocks of 16 with a remainder,
 * two threads: the two-weight-row tiles, the codebook records and their 64-row groups) gives
 * every output the active table's single-row dot of that weight row and activation row, bit
 * for bit. */
static void matmul_tiles_equal_single_dots(void **state) {
    (void)state;
    static const moe_type types[] = {MOE_TYPE_Q8_0, MOE_TYPE_IQ2_S, MOE_TYPE_IQ3_S, MOE_TYPE_Q4_K,
                                     MOE_TYPE_Q6_K};
    enum { N_IN = 2048, N_OUT = 40, N_ROWS = 200 }; /* ~2.2 KiB activation rows: 3 tiles */
    moe_pool *pool = moe_pool_new(2);
    float *x = moe_xmalloc(sizeof(float) * N_IN * N_ROWS);
    float *y = moe_xmalloc(sizeof(float) * N_OUT * N_ROWS);
    uint8_t *xq = moe_xmalloc((size_t)moe_dot_row_bytes(MOE_TYPE_Q8_0, N_IN) * 2);
    uint64_t seed = 5;
    for (int64_t i = 0; i < (int64_t)N_IN * N_ROWS; i++) x[i] = (float)moe_rng_gaussian(&seed);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const size_t rb = moe_type_row_bytes(types[t], N_IN);
        uint8_t *w = moe_xmalloc(rb * N_OUT);
        for (int o = 0; o < N_OUT; o++) moe_type_random_row(types[t], &seed, w + rb * o, N_IN);
        const moe_tensor wt = {.type = types[t],
                               .n_dims = 2,
                               .ne = {N_IN, N_OUT, 1, 1},
                               .n_values = (uint64_t)N_IN * N_OUT,
                               .n_bytes = rb * N_OUT,
                               .data = w};
        void *scratch = moe_xmalloc(moe_matmul_scratch_bytes(&wt, N_ROWS));
        moe_matmul(pool, &wt, 0, x, N_ROWS, y, scratch);
        const moe_type_kernels *k = moe_kernels_type(types[t]);
        for (int r = 0; r < N_ROWS; r++) {
            k->quantize_row_for_dot(x + (int64_t)r * N_IN, xq, N_IN);
            for (int o = 0; o < N_OUT; o++) {
                const float one = k->dot(w + rb * o, xq, N_IN);
                if (memcmp(&one, &y[r * N_OUT + o], sizeof one) != 0)
                    fail_msg("%s: matmul row %d, output %d is %.9g, the dot %.9g",
                             moe_type_name(types[t]), r, o, y[r * N_OUT + o], one);
            }
        }
        free(scratch), free(w);
    }
    free(xq), free(y), free(x);
    moe_pool_free(pool);
}

static void version_names_kernel_table(void **state) {
    (void)state;
    char cmd[512], *out;
    snprintf(cmd, sizeof cmd, "MOE_ISA=scalar %s --version", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "kernels: scalar"));
    assert_non_null(strstr(out, "fast path"));
    free(out);
    snprintf(cmd, sizeof cmd, "MOE_EXACT=1 %s --version", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "exact path"));
    free(out);
    /* an unknown or unavailable level: a message, and the best table */
    snprintf(cmd, sizeof cmd, "MOE_ISA=sse9 %s --version", moe_test_bin());
    assert_int_equal(moe_test_run(cmd, &out), 0);
    assert_non_null(strstr(out, "MOE_ISA=sse9"));
    char want[64];
    snprintf(want, sizeof want, "kernels: %s", moe_isa_name(moe_cpu_isa_supported()));
    assert_non_null(strstr(out, want));
    free(out);
}

/* The attention scores and mix of every level equal the reference bit for bit (they fix ggml's
 * summation order), over f32 and f16 cache rows 133 values apart at every head length 1..130
 * (tails), and q8_0 rows (whole blocks: 32..128 values, rows 160 values apart), at 1, 3, 5 keys. */
static void attention_kernels_bit_exact(void **state) {
    (void)state;
    enum { N = 130, KV = 5, STRIDE = N + 3, Q8_STRIDE = 160 };
    float q[N], kf[KV * Q8_STRIDE], y0[N], y1[N], s0[KV], s1[KV], p[KV];
    uint16_t kh[KV * STRIDE];
    uint8_t k8[KV * Q8_STRIDE / 32 * sizeof(moe_block_q8_0)];
    uint64_t rng = 77;
    for (int i = 0; i < N; i++) q[i] = (float)moe_rng_gaussian(&rng);
    for (int i = 0; i < KV * Q8_STRIDE; i++) kf[i] = (float)moe_rng_gaussian(&rng) * 3.0f;
    for (int i = 0; i < KV * STRIDE; i++) kh[i] = moe_f32_to_fp16(kf[i]);
    moe_type_traits_get(MOE_TYPE_Q8_0)->from_float(kf, k8, KV * Q8_STRIDE);
    for (int j = 0; j < KV; j++) p[j] = (float)moe_rng_uniform(&rng);
    const moe_kernels *ref = moe_kernels_for_isa(MOE_ISA_SCALAR);
    const moe_type types[] = {MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_Q8_0};
    const void *caches[] = {kf, kh, k8};
    int checked = 0;
    for (int level = MOE_ISA_SCALAR; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_isa((moe_isa)level);
        if (!k) continue;
        for (int t = 0; t < 3; t++) {
            const moe_type kv_type = types[t];
            const void *kv = caches[t];
            const int step = kv_type == MOE_TYPE_Q8_0 ? 32 : 1; /* whole blocks */
            const int64_t stride =
                (int64_t)moe_type_row_bytes(kv_type, kv_type == MOE_TYPE_Q8_0 ? Q8_STRIDE : STRIDE);
            for (int n = step; n <= N; n += step)
                for (int n_kv = 1; n_kv <= KV; n_kv += 2) {
                    ref->attn_scores(q, kv, stride, n_kv, kv_type, n, 0.3f, s0);
                    k->attn_scores(q, kv, stride, n_kv, kv_type, n, 0.3f, s1);
                    if (memcmp(s0, s1, sizeof(float) * (size_t)n_kv) != 0)
                        fail_msg("%s attn_scores %s n=%d n_kv=%d: %.9g vs reference %.9g", k->name,
                                 moe_type_name(kv_type), n, n_kv, s1[0], s0[0]);
                    memcpy(y0, q, sizeof q);
                    memcpy(y1, q, sizeof q);
                    ref->attn_mix(y0, p, kv, stride, n_kv, kv_type, n);
                    k->attn_mix(y1, p, kv, stride, n_kv, kv_type, n);
                    if (memcmp(y0, y1, sizeof y0) != 0)
                        fail_msg("%s attn_mix %s n=%d n_kv=%d differs from the reference", k->name,
                                 moe_type_name(kv_type), n, n_kv);
                    checked++;
                }
        }
    }
    assert_true(checked >= (2 * N + 4) * 3);
}

/* The fast attention's exp within 2 ulp of libm's double exp over [-86, 0] (ulp of the exact
 * value's float), exactly 1 at 0, and 0 below -86, at -inf and for NaN. */
static void attention_exp_within_2ulp(void **state) {
    (void)state;
    double worst = 0;
    float worst_x = 0;
    for (int i = 0; i <= 4000000; i++) {
        const float x = -86.0f * (float)i / 4000000.0f;
        const double want = exp((double)x);
        const double ulp = ldexp(1.0, ilogb(want) - 23);
        const double err = fabs((double)moe_attn_exp(x) - want) / ulp;
        if (err > worst) worst = err, worst_x = x;
    }
    print_message("moe_attn_exp: worst %.3f ulp at %.9g\n", worst, (double)worst_x);
    assert_true(worst <= 2.0);
    assert_true(moe_attn_exp(0.0f) == 1.0f && moe_attn_exp(-0.0f) == 1.0f);
    assert_true(moe_attn_exp(-86.5f) == 0.0f && moe_attn_exp(-INFINITY) == 0.0f &&
                moe_attn_exp(NAN) == 0.0f);
}

/* The fast path's SwiGLU, SiLU and sigmoid: every level equals the scalar reference bit for bit
 * (plain and clamped, lengths around the vector widths, NaN, infinities, signed zeros, gates far
 * past exp's range), and the reference is within 4 ulp of silu(g) worked out in double over gates
 * in [-80, 90] (under -86 it is 0 where silu is below 4e-36). */
static void swiglu_fast_equals_reference(void **state) {
    (void)state;
    enum { N = 203 };
    static float gate[N], x0[N], want[N], got[N];
    uint64_t rng = 0x5e1f0e5ull;
    for (int i = 0; i < N; i++) {
        gate[i] = 30.0f * (float)(moe_rng_uniform(&rng) - 0.5);
        x0[i] = 24.0f * (float)(moe_rng_uniform(&rng) - 0.5);
    }
    const float odd[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 200.0f, -200.0f, 10.0f, -10.0f};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++)
        gate[3 * i] = odd[i], x0[5 + 7 * i] = odd[i];
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    int checked = 0;
    for (int level = MOE_ISA_SCALAR + 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *k = moe_kernels_for_path((moe_isa)level, false);
        if (!k) continue;
        static const int ns[] = {1, 7, 8, 15, 16, 17, 64, N};
        for (size_t in = 0; in < sizeof ns / sizeof ns[0]; in++)
            for (int clamp = 0; clamp < 2; clamp++) {
                const float limit = clamp ? 7.0f : 0.0f;
                memcpy(want, x0, sizeof want), memcpy(got, x0, sizeof got);
                ref->swiglu(want, gate, ns[in], limit);
                k->swiglu(got, gate, ns[in], limit);
                if (memcmp(want, got, sizeof(float) * (size_t)ns[in]))
                    fail_msg("%s swiglu, %d values, limit %g: differs",
                             moe_isa_name((moe_isa)level), ns[in], (double)limit);
                memcpy(want, clamp ? x0 : gate, sizeof want), memcpy(got, want, sizeof got);
                ref->silu(want, ns[in]);
                k->silu(got, ns[in]);
                if (memcmp(want, got, sizeof(float) * (size_t)ns[in]))
                    fail_msg("%s silu, %d values: differs", moe_isa_name((moe_isa)level), ns[in]);
                memcpy(want, clamp ? x0 : gate, sizeof want), memcpy(got, want, sizeof got);
                ref->sigmoid(want, ns[in]);
                k->sigmoid(got, ns[in]);
                if (memcmp(want, got, sizeof(float) * (size_t)ns[in]))
                    fail_msg("%s sigmoid, %d values: differs", moe_isa_name((moe_isa)level),
                             ns[in]);
                checked++;
            }
    }
    double worst = 0;
    for (int i = 0; i <= 2000000; i++) {
        const float g = -80.0f + 170.0f * (float)i / 2000000.0f; /* e^-86 on: 0 (below 1e-35) */
        float y = 1.0f;
        ref->swiglu(&y, &g, 1, 0.0f);
        const double exact = (double)g / (1.0 + exp(-(double)g));
        if (exact == 0) continue;
        const double err = fabs((double)y - exact) / ldexp(1.0, ilogb(exact) - 23);
        worst = err > worst ? err : worst;
    }
    print_message(
        "swiglu, silu, sigmoid: %d shapes at the SIMD levels equal the reference; silu within %.2f "
        "ulp\n",
        checked, worst);
    assert_true(worst <= 4.0);
}

/* One attn_tile call from a start state (m, l, outputs y: nq rows DIM apart) into m, l, y. */
enum { AT_DIM = 160, AT_STRIDE = 3 * AT_DIM };
static void attn_tile_from(const moe_kernels *k, moe_attn_tile_args a, const float *m_start,
                           const float *l_start, const float *y_start, float *m, float *l,
                           float *y) {
    float *out[MOE_ATTN_TILE_QV];
    memcpy(m, m_start, sizeof(float) * (size_t)a.nq);
    memcpy(l, l_start, sizeof(float) * (size_t)a.nq);
    memcpy(y, y_start, sizeof(float) * (size_t)a.nq * AT_DIM);
    for (int i = 0; i < a.nq; i++) out[i] = y + i * AT_DIM;
    a.m = m, a.l = l, a.out = out;
    k->attn_tile(&a);
}

/* Every level's attn_tile equals the scalar reference bit for bit (quant.h fixes the order),
 * over f32 / f16 heads of 37 and 21 values (tails) and 160 / 64, q8_0 heads of 160 / 64 (160:
 * more values than a pass of the decode kernel's, which keeps its sums across passes), tiles of
 * 1, 5 and 64 keys (odd: half a pair), 1..128 query vectors (up to 8: two keys per register at
 * AVX-512) with their own visible ranges (some none), from running states with and without a
 * sink; and each vector's bits are the same through a call of its own (batch invariance at the
 * kernel). */
static void attention_tile_levels_equal_reference(void **state) {
    (void)state;
    enum { KEYS = MOE_ATTN_TILE_KEYS, QV = MOE_ATTN_TILE_QV };
    float *kf = moe_xmalloc(sizeof(float) * KEYS * AT_STRIDE);
    uint8_t *kc = moe_xmalloc(sizeof(float) * KEYS * AT_STRIDE);
    float *qt = moe_xmalloc(sizeof(float) * AT_DIM * QV),
          *q1 = moe_xmalloc(sizeof(float) * AT_DIM * QV);
    float *scratch = moe_xmalloc(sizeof(float) * KEYS * AT_DIM);
    /* a Q8_0 cache's queries: all QV vectors, and vector i alone in column 0 */
    int8_t *qq = moe_xmalloc((size_t)AT_DIM * QV), *qq1 = moe_xcalloc((size_t)AT_DIM * QV, 1);
    float *qd = moe_xmalloc(sizeof(float) * AT_DIM / 32 * QV),
          *qd1 = moe_xcalloc(AT_DIM / 32 * QV, sizeof(float)), col[AT_DIM];
    float *ys = moe_xmalloc(sizeof(float) * QV * AT_DIM),
          *y0 = moe_xmalloc(sizeof(float) * QV * AT_DIM),
          *y1 = moe_xmalloc(sizeof(float) * QV * AT_DIM);
    float ms[QV], ls[QV], m0[QV], l0[QV], m1[QV], l1[QV];
    int32_t lo[QV], hi[QV];
    uint64_t rng = 5;
    for (int i = 0; i < KEYS * AT_STRIDE; i++) kf[i] = 2.0f * (float)moe_rng_gaussian(&rng);
    for (int i = 0; i < AT_DIM * QV; i++) qt[i] = (float)moe_rng_gaussian(&rng);
    memset(q1, 0, sizeof(float) * AT_DIM * QV);
    for (int i = 0; i < QV; i++) {
        for (int d = 0; d < AT_DIM; d++) col[d] = qt[d * QV + i];
        moe_attn_tile_quantize(col, AT_DIM, i, qq, qd);
    }
    static const moe_type types[] = {MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_Q8_0};
    static const int dims[][2] = {{37, 21}, {AT_DIM, 64}};
    static const int n_keys[] = {1, 5, KEYS}, n_qvs[] = {1, 5, 8, 17, 70, QV};
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    int checked = 0;
    for (size_t t = 0; t < 3; t++) {
        const moe_type_traits *tr = moe_type_traits_get(types[t]);
        const int64_t stride = (int64_t)moe_type_row_bytes(types[t], AT_STRIDE);
        for (int j = 0; j < KEYS; j++)
            tr->from_float(kf + j * AT_STRIDE, kc + j * stride, AT_STRIDE);
        for (int dd = types[t] == MOE_TYPE_Q8_0; dd < 2; dd++)
            for (int nk = 0; nk < 3; nk++)
                for (int nqi = 0; nqi < 6; nqi++) {
                    const int nq = n_qvs[nqi], n_key = n_keys[nk];
                    for (int i = 0; i < nq; i++) {
                        lo[i] = (int32_t)(moe_rng_u64(&rng) % (uint64_t)n_key);
                        hi[i] =
                            i % 4 == 1 ? n_key - 1 : (int32_t)(moe_rng_u64(&rng) % (uint64_t)n_key);
                        if (i % 7 == 3) lo[i] = n_key, hi[i] = n_key - 1; /* sees none */
                        ms[i] = i % 2 ? -INFINITY : 1.5f * (float)moe_rng_gaussian(&rng);
                        ls[i] = i % 2 ? 0.0f : 1.0f;
                        for (int d = 0; d < AT_DIM; d++)
                            ys[i * AT_DIM + d] = i % 2 ? 0.0f : (float)moe_rng_gaussian(&rng);
                    }
                    const moe_attn_tile_args a = {.k = kc,
                                                  .v =
                                                      kc + moe_type_row_bytes(types[t], 2 * AT_DIM),
                                                  .k_stride = stride,
                                                  .v_stride = stride,
                                                  .kv_type = types[t],
                                                  .n_key = n_key,
                                                  .dk = dims[dd][0],
                                                  .dv = dims[dd][1],
                                                  .scale = 0.3f,
                                                  .nq = nq,
                                                  .qt = qt,
                                                  .qq = qq,
                                                  .qd = qd,
                                                  .lo = lo,
                                                  .hi = hi,
                                                  .scratch = scratch};
                    attn_tile_from(ref, a, ms, ls, ys, m0, l0, y0);
                    for (int level = MOE_ISA_SCALAR; level < MOE_ISA_COUNT; level++) {
                        const moe_kernels *k = moe_kernels_for_path((moe_isa)level, false);
                        if (!k) continue;
                        attn_tile_from(k, a, ms, ls, ys, m1, l1, y1);
                        if (memcmp(l0, l1, sizeof(float) * (size_t)nq) ||
                            memcmp(y0, y1, sizeof(float) * (size_t)nq * AT_DIM))
                            fail_msg("%s attn_tile %s dk=%d dv=%d keys=%d nq=%d differs from "
                                     "the reference",
                                     k->name, moe_type_name(types[t]), a.dk, a.dv, n_key, nq);
                        for (int i = 0; i < nq; i += 3) { /* vector i in a call of its own */
                            moe_attn_tile_args one = a;
                            for (int d = 0; d < a.dk; d++) q1[d * QV] = col[d] = qt[d * QV + i];
                            if (types[t] == MOE_TYPE_Q8_0)
                                moe_attn_tile_quantize(col, a.dk, 0, qq1, qd1);
                            one.nq = 1, one.qt = q1, one.qq = qq1, one.qd = qd1;
                            one.lo = lo + i, one.hi = hi + i;
                            attn_tile_from(k, one, ms + i, ls + i, ys + i * AT_DIM, m1, l1, y1);
                            if (l1[0] != l0[i] ||
                                memcmp(y1, y0 + i * AT_DIM, sizeof(float) * AT_DIM))
                                fail_msg("%s attn_tile %s keys=%d: vector %d of %d alone differs",
                                         k->name, moe_type_name(types[t]), n_key, i, nq);
                        }
                        checked++;
                    }
                }
    }
    assert_true(checked >= 5 * 3 * 6);
    free(kf), free(kc), free(qt), free(q1), free(scratch), free(ys), free(y0), free(y1);
    free(qq), free(qq1), free(qd), free(qd1);
}

/* ==== Tiled attention (ops) ==== */

/* The tiled attention's distance from the float64 formula, relative to the row's largest output:
 * f32 accumulation over a few hundred keys and the exp of f32 scores cost ~1e-7 each. */
#define TILED_ATTN_BUDGET 2e-6
/* A Q8_0 cache's mix takes 16-bit weights (quant.h): each weight x scale off by up to 2^-16 of
 * the tile's largest, ~1e-5 a key, in random directions; measured 1.4e-4 at worst over these rows
 * (the cache's own values are off by up to 2^-8 of their block's largest, which the float64
 * formula here does not count). */
#define TILED_ATTN_BUDGET_Q8_0 4e-4

enum { TA_HEAD = 8, TA_HEAD_KV = 2, TA_DK = 96, TA_DV = 64, TA_KEYS = 200, TA_ROWS = 9 };

/* One row, one head, in float64: softmax over keys first..last of scale * q.k (and the sink's
 * logit in the denominator), then the weighted sum of the values; K and V as the cache holds
 * them (decoded by the type's to_float). */
static void attention_f64(const float *q, const float *k, const float *v, int64_t first,
                          int64_t last, double scale, double sink, double *out) {
    double s[TA_KEYS], max = sink, sum = 0;
    for (int64_t j = first; j <= last; j++) {
        double d = 0;
        for (int i = 0; i < TA_DK; i++) d += (double)q[i] * k[j * TA_HEAD_KV * TA_DK + i];
        s[j] = d * scale;
        max = fmax(max, s[j]);
    }
    for (int64_t j = first; j <= last; j++) sum += exp(s[j] - max);
    if (sink != -INFINITY) sum += exp(sink - max);
    for (int i = 0; i < TA_DV; i++) out[i] = 0;
    for (int64_t j = first; j <= last; j++)
        for (int i = 0; i < TA_DV; i++)
            out[i] += exp(s[j] - max) / sum * v[j * TA_HEAD_KV * TA_DV + i];
}

/* moe_attention_tiled on f32, f16 and q8_0 caches of 200 keys (tiles end at 64, 128, 192), GQA
 * 8 heads over 2, with and without a 70-key window and sinks: every row within the budget of the
 * float64 formula, and each row's bits the same computed alone, in the block of nine, or with
 * its kv head's group split into single heads over the cache laid out per kv head (the engine's
 * layout) instead of per position. */
static void tiled_attention_matches_f64(void **state) {
    (void)state;
    static const int64_t pos[TA_ROWS] = {0, 1, 63, 64, 65, 127, 128, 150, 199};
    const int64_t kw = TA_HEAD_KV * TA_DK, vw = TA_HEAD_KV * TA_DV;
    float *kf = moe_xmalloc(sizeof(float) * TA_KEYS * kw);
    float *vf = moe_xmalloc(sizeof(float) * TA_KEYS * vw);
    float *kd = moe_xmalloc(sizeof(float) * TA_KEYS * kw);
    float *vd = moe_xmalloc(sizeof(float) * TA_KEYS * vw);
    float *q = moe_xmalloc(sizeof(float) * TA_ROWS * TA_HEAD * TA_DK);
    float block[TA_ROWS * TA_HEAD * TA_DV], alone[TA_HEAD * TA_DV],
        split[TA_ROWS * TA_HEAD * TA_DV];
    uint8_t *kc = moe_xmalloc(sizeof(float) * TA_KEYS * kw);
    uint8_t *vc = moe_xmalloc(sizeof(float) * TA_KEYS * vw);
    uint8_t *kh = moe_xmalloc(sizeof(float) * TA_KEYS * kw); /* the same per kv head */
    uint8_t *vh = moe_xmalloc(sizeof(float) * TA_KEYS * vw);
    float *scratch = moe_xmalloc(sizeof(float) * moe_attention_tiled_scratch(TA_DK));
    float sinks[TA_HEAD];
    uint64_t rng = 31;
    for (int64_t i = 0; i < TA_KEYS * kw; i++) kf[i] = 2.0f * (float)moe_rng_gaussian(&rng);
    for (int64_t i = 0; i < TA_KEYS * vw; i++) vf[i] = (float)moe_rng_gaussian(&rng);
    for (int64_t i = 0; i < TA_ROWS * TA_HEAD * TA_DK; i++) q[i] = (float)moe_rng_gaussian(&rng);
    for (int h = 0; h < TA_HEAD; h++) sinks[h] = 3.0f * (float)moe_rng_gaussian(&rng);
    static const moe_type types[] = {MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_Q8_0};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const moe_type_traits *tr = moe_type_traits_get(types[t]);
        const int64_t kb = (int64_t)moe_type_row_bytes(types[t], kw),
                      vb = (int64_t)moe_type_row_bytes(types[t], vw);
        const int64_t khb = (int64_t)moe_type_row_bytes(types[t], TA_DK),
                      vhb = (int64_t)moe_type_row_bytes(types[t], TA_DV);
        for (int j = 0; j < TA_KEYS; j++) { /* the cache, and the values it decodes to */
            tr->from_float(kf + j * kw, kc + j * kb, kw);
            tr->from_float(vf + j * vw, vc + j * vb, vw);
            tr->to_float(kc + j * kb, kd + j * kw, kw);
            tr->to_float(vc + j * vb, vd + j * vw, vw);
            for (int h = 0; h < TA_HEAD_KV; h++) {
                memcpy(kh + (h * TA_KEYS + j) * khb, kc + j * kb + h * khb, (size_t)khb);
                memcpy(vh + (h * TA_KEYS + j) * vhb, vc + j * vb + h * vhb, (size_t)vhb);
            }
        }
        const moe_attn_kv by_pos = {kc, vc, kb, vb, khb, vhb},
                          by_head = {kh, vh, khb, vhb, TA_KEYS * khb, TA_KEYS * vhb};
        for (int variant = 0; variant < 4; variant++) {
            const int64_t window = variant & 1 ? 70 : 0;
            const moe_attn_shape s = {.n_head = TA_HEAD,
                                      .n_head_kv = TA_HEAD_KV,
                                      .head_dim_k = TA_DK,
                                      .head_dim_v = TA_DV,
                                      .scale = 1.0f / sqrtf((float)TA_DK),
                                      .kv_type = types[t],
                                      .sinks = variant & 2 ? sinks : NULL};
            int64_t first[TA_ROWS], last[TA_ROWS];
            for (int r = 0; r < TA_ROWS; r++) {
                first[r] = window && pos[r] >= window ? pos[r] - window + 1 : 0;
                last[r] = pos[r];
            }
            moe_attn_block b = {.q = q,
                                .out = block,
                                .first = first,
                                .last = last,
                                .n_rows = TA_ROWS,
                                .kv = by_pos,
                                .scratch = scratch};
            const int group = TA_HEAD / TA_HEAD_KV;
            for (int hk = 0; hk < TA_HEAD_KV; hk++)
                moe_attention_tiled(&s, &b, hk * group, (hk + 1) * group);
            b.out = split;
            b.kv = by_head;
            for (int h = 0; h < TA_HEAD; h++) moe_attention_tiled(&s, &b, h, h + 1);
            if (memcmp(block, split, sizeof block) != 0)
                fail_msg("%s variant %d: heads one by one (per kv head) differ from whole groups",
                         moe_type_name(types[t]), variant);
            for (int r = 0; r < TA_ROWS; r++) {
                const moe_attn_block one = {.q = q + r * TA_HEAD * TA_DK,
                                            .out = alone,
                                            .first = &first[r],
                                            .last = &last[r],
                                            .n_rows = 1,
                                            .kv = by_pos,
                                            .scratch = scratch};
                for (int hk = 0; hk < TA_HEAD_KV; hk++)
                    moe_attention_tiled(&s, &one, hk * group, (hk + 1) * group);
                if (memcmp(alone, block + r * TA_HEAD * TA_DV, sizeof alone) != 0)
                    fail_msg("%s variant %d: row at %lld alone differs from the block",
                             moe_type_name(types[t]), variant, (long long)pos[r]);
                for (int h = 0; h < TA_HEAD; h++) {
                    double want[TA_DV], max = 0, err = 0;
                    const int hk = h / group;
                    float qh[TA_DK]; /* a Q8_0 cache sees the query through q8_0 (quant.h) */
                    const float *qr = q + (r * TA_HEAD + h) * TA_DK;
                    if (types[t] == MOE_TYPE_Q8_0) {
                        moe_block_q8_0 qb[TA_DK / 32];
                        moe_ref_q8_0_from_float_act(qr, qb, TA_DK);
                        tr->to_float(qb, qh, TA_DK);
                        qr = qh;
                    }
                    attention_f64(qr, kd + hk * TA_DK, vd + hk * TA_DV, first[r], last[r],
                                  1.0 / sqrt((double)TA_DK), s.sinks ? s.sinks[h] : -INFINITY,
                                  want);
                    for (int i = 0; i < TA_DV; i++) {
                        max = fmax(max, fabs(want[i]));
                        err = fmax(err, fabs(want[i] - alone[h * TA_DV + i]));
                    }
                    const double budget =
                        types[t] == MOE_TYPE_Q8_0 ? TILED_ATTN_BUDGET_Q8_0 : TILED_ATTN_BUDGET;
                    if (err > budget * max)
                        fail_msg("%s variant %d: row at %lld head %d: error %.3g of %.3g",
                                 moe_type_name(types[t]), variant, (long long)pos[r], h, err, max);
                }
            }
        }
    }
    free(kf), free(vf), free(kd), free(vd), free(q), free(kc), free(vc), free(kh), free(vh);
    free(scratch);
}

int moe_suite_kernels(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(isa_levels_resolve),
        cmocka_unit_test(tables_cover_every_dot),
        cmocka_unit_test(activation_conversions_byte_exact),
        cmocka_unit_test(activation_fixtures_byte_exact),
        cmocka_unit_test(dots_match_reference_on_fixtures),
        cmocka_unit_test(dots_match_reference_on_random_rows),
        cmocka_unit_test(dot_rows_equal_single_rows),
        cmocka_unit_test(avx512_follows_avx2_floats),
        cmocka_unit_test(matmul_tiles_equal_single_dots),
        cmocka_unit_test(fast_path_matches_its_reference),
        cmocka_unit_test(rows16_layout_and_kernels),
        cmocka_unit_test(avxvnni_is_avx2_with_vpdpbusd),
        cmocka_unit_test(amx_tiles_equal_avx512vnni),
        cmocka_unit_test(attention_kernels_bit_exact),
        cmocka_unit_test(attention_exp_within_2ulp),
        cmocka_unit_test(swiglu_fast_equals_reference),
        cmocka_unit_test(attention_tile_levels_equal_reference),
        cmocka_unit_test(tiled_attention_matches_f64),
        cmocka_unit_test(version_names_kernel_table),
    };
    return cmocka_run_group_tests_name("kernels", tests, NULL, NULL);
}
