/* bench/kernels.c: kernel micro-benchmarks -- GB/s of weight bytes a single-threaded matvec
 * streams, per weight type and per ISA table, beside the measured read bandwidth.
 *
 * For each type the weight matrix is --mib MiB (default 256, larger than any L3 here) of random
 * valid blocks in anonymous memory, rows of --n values (default 4096); one activation row is
 * converted once (the table's quantize_row_for_dot, not timed) and every row is dotted against
 * it, as a decode step does. Each figure is the median of --runs passes (default 5). The read
 * bandwidth comes from the library's probe (moe_read_bandwidth: a streaming sum with the widest
 * loads of the active table), on one thread as the kernels run here, and on --threads threads
 * (default 2) for the ceiling `moe bench` compares against. --tile R,... measures the fast
 * path's tile kernels instead, against R activation rows, at each level --isa names (default:
 * the active one, which MOE_ISA sets), with the exact path's figures at the same R beside. The
 * trap: the first pass over fresh memory pays page faults, so every buffer is written before
 * timing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/quant/quant.h"

static volatile float sink_f32;

/* This thread's CPU seconds: a tile figure on a machine shared with other work (it counts the
 * time this thread ran, not the time it waited for a core). */
static double thread_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Median GB/s of weights for `rows` rows of `row_bytes` at w against n_x activation rows
 * (x_stride bytes apart): n_x = 1 is the matvec (k->dot), more is the GEMM (moe_dot_rows, as
 * moe_matmul calls it). GEMM figures count each weight byte once per pass over all n_x rows.
 * clock: moe_now, or thread_seconds beside the tile figures. */
static double matmul_gbs(const moe_type_kernels *k, const uint8_t *w, int64_t rows,
                         size_t row_bytes, const uint8_t *xq, size_t x_stride, int64_t n_x,
                         int64_t n, float *y, int runs, double (*clock)(void)) {
    double t[64];
    for (int r = 0; r < runs; r++) {
        const double t0 = clock();
        if (n_x == 1)
            for (int64_t i = 0; i < rows; i++) y[i] = k->dot(w + (size_t)i * row_bytes, xq, n);
        else
            for (int64_t i = 0; i < rows; i++)
                moe_dot_rows(k, w + (size_t)i * row_bytes, xq, x_stride, n_x, n, y + i * n_x, 1);
        t[r] = clock() - t0;
        sink_f32 = y[rows / 2];
    }
    return (double)rows * (double)row_bytes / moe_median(t, runs) / 1e9;
}

/* Median GB/s of weights (per second of this thread's CPU time) for the fast path's tile kernel
 * f, groups of 16 rows against n_x activation rows, as the matmul calls it (file layout: rows
 * row_bytes apart; ROWS16: w_stride unused), group after group through the whole buffer. */
static double tile_gbs(moe_dot_tile_fn f, const uint8_t *w, int64_t rows, size_t row_bytes,
                       const uint8_t *xq, size_t x_stride, int64_t n_x, int64_t n, float *y,
                       int runs) {
    double t[64];
    const size_t group = MOE_ROWS16 * row_bytes;
    for (int r = 0; r < runs; r++) {
        const double t0 = thread_seconds();
        for (int64_t g = 0; g < rows / MOE_ROWS16; g++)
            f(w + (size_t)g * group, row_bytes, MOE_ROWS16, xq, x_stride, n_x, n, y, MOE_ROWS16);
        t[r] = thread_seconds() - t0;
        sink_f32 = y[0];
    }
    return (double)rows * (double)row_bytes / moe_median(t, runs) / 1e9;
}

/* --tile: per type with a fast tile kernel at the level, GB/s of weights at each count of
 * activation rows on the file's layout, then on MOE_LAYOUT_ROWS16 (the buffer repacked in place)
 * where the level has a kernel on it; and below, the exact path's at the same counts (its dot,
 * or moe_dot_rows a weight row at a time, as moe_matmul runs a type without a tile kernel). */
static void tile_bench(moe_isa level, const moe_type *types, int n_types, const int *counts,
                       int n_counts, uint8_t *buf, size_t bytes, int64_t n, int runs, double bw) {
    const moe_kernels *k = moe_kernels_for_path(level, false), *kx = moe_kernels_for_isa(level);
    printf("fast path tiles (%s): GB/s of weights, 16 weight rows a call against R activation "
           "rows, per second of the thread's CPU time, file layout -> MOE_LAYOUT_ROWS16 (ratio); "
           "the exact path's below; 1-thread read bandwidth %.1f GB/s\n",
           k->name, bw);
    printf("%-8s", "type");
    for (int c = 0; c < n_counts; c++) printf("          R=%-3d        ", counts[c]);
    printf("\n");
    float *x = moe_xmalloc((size_t)n * sizeof(float));
    uint64_t seed = 7;
    int max_x = 1;
    for (int c = 0; c < n_counts; c++) max_x = counts[c] > max_x ? counts[c] : max_x;
    /* room for any dot_type's row: F32's (4 bytes a value) is the widest */
    const size_t xs = (size_t)moe_type_row_bytes(MOE_TYPE_F32, n) + (size_t)n;
    uint8_t *xq = moe_xmalloc(xs * (size_t)max_x);
    float *y = moe_xmalloc(sizeof(float) * MOE_ROWS16 * (size_t)max_x);
    void *scratch = moe_xmalloc(MOE_ROWS16 * (size_t)moe_type_row_bytes(MOE_TYPE_F32, n));
    for (int ti = 0; ti < n_types; ti++) {
        const moe_type t = types[ti];
        const moe_type_kernels *e = &k->types[t];
        const size_t row_bytes = (size_t)moe_type_row_bytes(t, n);
        if (!e->dot || !row_bytes) continue;
        const int64_t rows = (int64_t)(bytes / row_bytes) / MOE_ROWS16 * MOE_ROWS16;
        for (int64_t r = 0; r < rows; r++)
            moe_type_random_row(t, &seed, buf + (size_t)r * row_bytes, n);
        for (int r = 0; r < max_x; r++) {
            moe_type_random_row(MOE_TYPE_F32, &seed, x, n);
            e->quantize_row_for_dot(x, xq + (size_t)r * xs, n);
        }
        double file[16], exact[16];
        float *y_rows = moe_xmalloc(sizeof(float) * (size_t)rows * (size_t)max_x); /* matmul_gbs */
        for (int c = 0; c < n_counts; c++) {
            file[c] = e->dot_tile ? tile_gbs(e->dot_tile, buf, rows, row_bytes, xq, xs, counts[c],
                                             n, y, runs)
                                  : 0;
            exact[c] = matmul_gbs(&kx->types[t], buf, rows, row_bytes, xq, xs, counts[c], n, y_rows,
                                  runs, thread_seconds);
        }
        free(y_rows);
        if (e->dot_tile_rows16) moe_layout_pack_matrix(MOE_LAYOUT_ROWS16, t, buf, rows, n, scratch);
        printf("%-8s", moe_type_name(t));
        for (int c = 0; c < n_counts; c++) {
            if (!e->dot_tile) {
                printf("    -                   ");
                continue;
            }
            if (!e->dot_tile_rows16) {
                printf("  %6.2f ->   -          ", file[c]);
                continue;
            }
            const double r16 =
                tile_gbs(e->dot_tile_rows16, buf, rows, row_bytes, xq, xs, counts[c], n, y, runs);
            printf("  %6.2f -> %6.2f (%.2fx)", file[c], r16, r16 / file[c]);
        }
        printf("\n  exact ");
        for (int c = 0; c < n_counts; c++) printf("  %6.2f                ", exact[c]);
        printf("\n");
        fflush(stdout);
    }
    free(x), free(xq), free(y), free(scratch);
}

static const moe_type DEFAULT_TYPES[] = {
    MOE_TYPE_Q8_0,    MOE_TYPE_Q4_K,  MOE_TYPE_Q6_K,    MOE_TYPE_Q5_K,  MOE_TYPE_IQ4_XS,
    MOE_TYPE_IQ4_NL,  MOE_TYPE_IQ3_S, MOE_TYPE_IQ3_XXS, MOE_TYPE_IQ2_S, MOE_TYPE_IQ2_XS,
    MOE_TYPE_IQ2_XXS, MOE_TYPE_IQ1_S, MOE_TYPE_IQ1_M,   MOE_TYPE_MXFP4, MOE_TYPE_Q4_0,
    MOE_TYPE_Q5_0,    MOE_TYPE_Q2_K,  MOE_TYPE_Q3_K,    MOE_TYPE_Q4_1,  MOE_TYPE_Q5_1,
    MOE_TYPE_F16,     MOE_TYPE_BF16,  MOE_TYPE_F32,
};

static void usage(void) {
    fprintf(stderr,
            "usage: kernels [--mib N] [--n VALUES] [--runs N] [--threads N] [--gemm-rows N]\n"
            "               [--types q4_k,...] [--tile R,...]\n"
            "               [--isa scalar,avx2,...]\n"
            "--tile: the fast path's tile kernels against R activation rows (and the exact\n"
            "path's at the same R) at each --isa level (default: the active one)\n");
    exit(2);
}

int main(int argc, char **argv) {
    size_t mib = 256;
    int64_t n = 4096;
    int runs = 5, threads = 2, gemm_rows = 8;
    moe_type types[64];
    int n_types = 0, tile_counts[16], n_tile = 0;
    bool isa_on[MOE_ISA_COUNT], isa_named = false;
    for (int i = 0; i < MOE_ISA_COUNT; i++) isa_on[i] = true;
    for (int a = 1; a < argc; a++) {
        if (a + 1 >= argc) usage();
        const char *v = argv[++a];
        if (!strcmp(argv[a - 1], "--mib"))
            mib = (size_t)atol(v);
        else if (!strcmp(argv[a - 1], "--n"))
            n = atol(v);
        else if (!strcmp(argv[a - 1], "--runs"))
            runs = atoi(v);
        else if (!strcmp(argv[a - 1], "--threads"))
            threads = atoi(v);
        else if (!strcmp(argv[a - 1], "--gemm-rows"))
            gemm_rows = atoi(v);
        else if (!strcmp(argv[a - 1], "--types")) {
            char *list = moe_xstrdup(v), *save = NULL;
            for (char *t = strtok_r(list, ",", &save); t && n_types < 64;
                 t = strtok_r(NULL, ",", &save))
                if (!moe_type_from_name(t, &types[n_types++])) {
                    fprintf(stderr, "kernels: unknown type %s\n", t);
                    return 2;
                }
            free(list);
        } else if (!strcmp(argv[a - 1], "--tile")) {
            char *list = moe_xstrdup(v), *save = NULL;
            for (char *t = strtok_r(list, ",", &save); t && n_tile < 16;
                 t = strtok_r(NULL, ",", &save))
                if ((tile_counts[n_tile++] = atoi(t)) < 1 || tile_counts[n_tile - 1] > 256) usage();
            free(list);
        } else if (!strcmp(argv[a - 1], "--isa")) {
            isa_named = true;
            for (int i = 0; i < MOE_ISA_COUNT; i++) isa_on[i] = false;
            char *list = moe_xstrdup(v), *save = NULL;
            for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                moe_isa isa;
                if (!moe_isa_from_name(t, &isa)) {
                    fprintf(stderr, "kernels: unknown ISA table %s\n", t);
                    return 2;
                }
                isa_on[isa] = true;
            }
            free(list);
        } else
            usage();
    }
    if (runs < 1 || runs > 64 || threads < 1 || gemm_rows < 2 || gemm_rows > 64 || n < 256 ||
        n % 256 || mib < 1)
        usage();
    if (!n_types) {
        n_types = (int)(sizeof DEFAULT_TYPES / sizeof DEFAULT_TYPES[0]);
        memcpy(types, DEFAULT_TYPES, sizeof DEFAULT_TYPES);
    }

    const size_t bytes = mib << 20;
    uint8_t *buf = aligned_alloc(4096, bytes);
    if (!buf) moe_die("cannot allocate %zu MiB", mib);
    memset(buf, 1, bytes); /* fault every page in before timing */

    char cpu[256];
    moe_cpu_describe(cpu, sizeof cpu);
    moe_bandwidth one, many;
    moe_error err = {0};
    moe_pool *pool = moe_pool_new(threads);
    if (moe_read_bandwidth(NULL, bytes, runs, &one, &err) != MOE_OK ||
        moe_read_bandwidth(pool, bytes, runs, &many, &err) != MOE_OK)
        moe_die("%s", err.msg);
    moe_pool_free(pool);
    const double bw = one.median_gb_s;
    printf("moe kernel benchmark: single thread, %zu MiB of weights, rows of %lld, median of %d; "
           "matvec, and GEMM against %d activation rows\n",
           mib, (long long)n, runs, gemm_rows);
    printf("cpu: %s\nactive table: %s\n", cpu, moe_kernels_get()->name);
    printf(
        "read bandwidth (streaming sum, %d-byte loads, %zu MiB): 1 thread %.1f GB/s (%.1f-%.1f), "
        "%d threads %.1f GB/s (%.1f-%.1f)\n\n",
        one.load_bytes, mib, bw, one.min_gb_s, one.max_gb_s, many.threads, many.median_gb_s,
        many.min_gb_s, many.max_gb_s);

    if (n_tile) { /* at each level --isa names (default: the active one) the CPU runs */
        for (int i = 0; i < MOE_ISA_COUNT; i++)
            if (moe_kernels_for_isa((moe_isa)i) &&
                (isa_named ? isa_on[i] : i == (int)moe_kernels_get()->isa))
                tile_bench((moe_isa)i, types, n_types, tile_counts, n_tile, buf, bytes, n, runs,
                           bw);
        free(buf);
        return 0;
    }
    printf("%-8s %6s", "type", "bits/w");
    for (int i = 0; i < MOE_ISA_COUNT; i++)
        if (isa_on[i] && moe_kernels_for_isa((moe_isa)i)) printf(" %25s", moe_isa_name((moe_isa)i));
    printf("\n%15s", "");
    for (int i = 0; i < MOE_ISA_COUNT; i++)
        if (isa_on[i] && moe_kernels_for_isa((moe_isa)i)) printf(" %16s %6s  ", "matvec", "GEMM");
    printf("\n(GB/s of weights: matvec with %% of the 1-thread read bandwidth; GEMM per pass over "
           "%d rows; * = kernel of that level, g = its many-row kernel)\n",
           gemm_rows);

    float *x = moe_xmalloc((size_t)n * sizeof(float));
    uint64_t seed = 42;
    moe_type_random_row(MOE_TYPE_F32, &seed, x, n);
    const size_t x_stride = (size_t)n * 4 + 4096;
    uint8_t *xq = moe_xmalloc(x_stride * (size_t)gemm_rows);
    for (int ti = 0; ti < n_types; ti++) {
        const moe_type t = types[ti];
        const size_t row_bytes = (size_t)moe_type_row_bytes(t, n);
        if (!row_bytes || !moe_kernels_get()->types[t].dot) {
            fprintf(stderr, "kernels: no dot for %s at n = %lld\n", moe_type_name(t), (long long)n);
            continue;
        }
        const int64_t rows = (int64_t)(bytes / row_bytes);
        for (int64_t r = 0; r < rows; r++)
            moe_type_random_row(t, &seed, buf + (size_t)r * row_bytes, n);
        float *y = moe_xmalloc((size_t)rows * (size_t)gemm_rows * sizeof(float));
        printf("%-8s %6.2f", moe_type_name(t), 8.0 * (double)row_bytes / (double)n);
        fflush(stdout);
        for (int i = 0; i < MOE_ISA_COUNT; i++) {
            const moe_kernels *k = moe_kernels_for_isa((moe_isa)i);
            if (!isa_on[i] || !k) continue;
            const moe_type_kernels *e = &k->types[t];
            for (int r = 0; r < gemm_rows; r++)
                e->quantize_row_for_dot(x, xq + (size_t)r * x_stride, n);
            const double gbs =
                matmul_gbs(e, buf, rows, row_bytes, xq, x_stride, 1, n, y, runs, moe_now);
            const double gemm =
                matmul_gbs(e, buf, rows, row_bytes, xq, x_stride, gemm_rows, n, y, runs, moe_now);
            printf(" %6.1f (%4.0f%%) %c %6.1f %c", gbs, 100 * gbs / bw,
                   e->dot_isa == k->isa ? '*' : ' ', gemm, e->dot_rows ? 'g' : ' ');
            fflush(stdout);
        }
        printf("\n");
        free(y);
    }
    free(x), free(xq), free(buf);
    return 0;
}
