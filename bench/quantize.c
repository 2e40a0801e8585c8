/* bench/quantize.c: weight-quantizer throughput -- rows per second each type's quantizer turns
 * out, on one thread and on --threads threads (moe_quantize_rows on the pool), with and without
 * an importance vector.
 *
 * Rows are --n values (default 4096) of N(0, 0.02^2) with 1% outliers; the importance vector is
 * log-normal. Each figure is the median of --runs passes (default 3) over --rows rows (default
 * 256). The lattices of the IQ types are built before timing (their one-off cost is printed
 * separately). The trap: rows/s depends on the row length; compare at the same --n. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/quant/quant.h"

static const moe_type DEFAULT_TYPES[] = {
    MOE_TYPE_Q8_0,    MOE_TYPE_Q4_0,  MOE_TYPE_Q5_0,    MOE_TYPE_Q2_K,   MOE_TYPE_Q3_K,
    MOE_TYPE_Q4_K,    MOE_TYPE_Q5_K,  MOE_TYPE_Q6_K,    MOE_TYPE_IQ4_NL, MOE_TYPE_IQ4_XS,
    MOE_TYPE_MXFP4,   MOE_TYPE_IQ3_S, MOE_TYPE_IQ3_XXS, MOE_TYPE_IQ2_S,  MOE_TYPE_IQ2_XS,
    MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ1_M, MOE_TYPE_IQ1_S,
};

static double rows_per_s(moe_type t, const float *x, uint8_t *out, int64_t rows, int64_t n,
                         const float *imatrix, moe_pool *pool, int runs) {
    double times[32];
    for (int r = 0; r < runs; r++) {
        const double t0 = moe_now();
        moe_quantize_rows(t, x, out, rows, n, imatrix, pool);
        times[r] = moe_now() - t0;
    }
    return (double)rows / moe_median(times, runs);
}

static void usage(void) {
    fprintf(stderr, "usage: quantize [--n VALUES] [--rows N] [--runs N] [--threads N] "
                    "[--types q4_k,...]\n");
    exit(2);
}

int main(int argc, char **argv) {
    int64_t n = 4096, rows = 256;
    int runs = 3, threads = 2;
    moe_type types[64];
    int n_types = 0;
    for (int a = 1; a < argc; a++) {
        if (a + 1 >= argc) usage();
        const char *v = argv[++a];
        if (!strcmp(argv[a - 1], "--n"))
            n = atoll(v);
        else if (!strcmp(argv[a - 1], "--rows"))
            rows = atoll(v);
        else if (!strcmp(argv[a - 1], "--runs"))
            runs = atoi(v);
        else if (!strcmp(argv[a - 1], "--threads"))
            threads = atoi(v);
        else if (!strcmp(argv[a - 1], "--types")) {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", v);
            for (char *tok = strtok(buf, ","); tok && n_types < 64; tok = strtok(NULL, ","))
                if (!moe_type_from_name(tok, &types[n_types++])) {
                    fprintf(stderr, "unknown type %s\n", tok);
                    return 2;
                }
        } else
            usage();
    }
    if (n <= 0 || n % 256 || rows <= 0 || runs < 1 || runs > 32 || threads < 1) usage();
    if (!n_types) {
        n_types = (int)(sizeof DEFAULT_TYPES / sizeof DEFAULT_TYPES[0]);
        memcpy(types, DEFAULT_TYPES, sizeof DEFAULT_TYPES);
    }
    float *x = malloc((size_t)(n * rows) * sizeof(float)), *qw = malloc((size_t)n * 4);
    uint8_t *out = malloc((size_t)(n * rows) * 4);
    if (!x || !qw || !out) return 1;
    uint64_t seed = 1;
    for (int64_t i = 0; i < n * rows; i++) {
        double v = moe_rng_gaussian(&seed) * 0.02;
        if (moe_rng_uniform(&seed) < 0.01) v *= 20;
        x[i] = (float)v;
    }
    for (int64_t j = 0; j < n; j++) qw[j] = (float)exp(1.5 * moe_rng_gaussian(&seed));
    moe_pool *pool = moe_pool_new(threads);
    printf("quantize: rows of %lld values, %lld rows, median of %d; rows/s on 1 and %d threads\n",
           (long long)n, (long long)rows, runs, threads);
    printf("%-8s %12s %12s %12s %12s %10s\n", "type", "1t", "1t+imatrix", "Nt", "Nt+imatrix",
           "first use");
    for (int i = 0; i < n_types; i++) {
        if (!moe_type_can_quantize(types[i])) continue;
        const double t0 = moe_now(); /* the first row pays the lattice build of IQ1/IQ2/IQ3 */
        moe_quantize_row(types[i], x, out, n, qw);
        const double first = moe_now() - t0;
        const double a = rows_per_s(types[i], x, out, rows, n, NULL, NULL, runs);
        const double b = rows_per_s(types[i], x, out, rows, n, qw, NULL, runs);
        const double c = rows_per_s(types[i], x, out, rows, n, NULL, pool, runs);
        const double d = rows_per_s(types[i], x, out, rows, n, qw, pool, runs);
        printf("%-8s %12.0f %12.0f %12.0f %12.0f %8.1fms\n", moe_type_name(types[i]), a, b, c, d,
               first * 1e3);
        fflush(stdout);
    }
    moe_pool_free(pool);
    free(x), free(qw), free(out);
    return 0;
}
