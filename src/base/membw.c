/* membw.c: the read-bandwidth probe that benchmarks print beside their figures (`moe bench`,
 * `make bench`): how fast this machine streams memory that is not in any cache.
 *
 * A streaming sum over a buffer far larger than the last-level cache, split across a pool's
 * threads in slices handed out dynamically, with the widest loads the active ISA level allows
 * (64-byte under avx512*, 32-byte under avx2, 8-byte otherwise) and eight independent
 * accumulators so the loop waits on loads, not on an add chain. Each pass is timed; the result
 * is the median of the passes with their range. The trap: a fresh buffer's first pass pays
 * page faults, so the buffer is written before anything is timed. */
#include "base.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MEMBW_SLICE    (4u << 20) /* bytes a thread takes at a time: large, so hand-out is free */
#define MEMBW_MAX_RUNS 64

double moe_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double moe_median(double *v, int n) {
    if (n <= 0) return 0.0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ==== The sums: 8-byte, 32-byte and 64-byte loads, eight accumulators each ==== */

typedef uint64_t (*sum_fn)(const uint8_t *p, size_t bytes);

static uint64_t sum_u64(const uint8_t *p, size_t bytes) {
    const uint64_t *w = (const uint64_t *)p;
    uint64_t s[8] = {0};
    for (size_t i = 0; i + 8 <= bytes / 8; i += 8)
        for (int k = 0; k < 8; k++) s[k] += w[i + k];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, size_t bytes) {
    __m256i a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_si256();
    for (size_t i = 0; i + 256 <= bytes; i += 256)
        for (int k = 0; k < 8; k++)
            a[k] = _mm256_add_epi64(a[k], _mm256_load_si256((const __m256i *)(p + i + 32 * k)));
    for (int k = 1; k < 8; k++) a[0] = _mm256_add_epi64(a[0], a[k]);
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a[0]);
    return out[0] + out[1] + out[2] + out[3];
}

__attribute__((target("avx512f"))) static uint64_t sum_avx512(const uint8_t *p, size_t bytes) {
    __m512i a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_si512();
    for (size_t i = 0; i + 512 <= bytes; i += 512)
        for (int k = 0; k < 8; k++)
            a[k] = _mm512_add_epi64(a[k], _mm512_load_si512((const void *)(p + i + 64 * k)));
    for (int k = 1; k < 8; k++) a[0] = _mm512_add_epi64(a[0], a[k]);
    return (uint64_t)_mm512_reduce_add_epi64(a[0]);
}
#endif

/* ==== The probe ==== */

typedef struct probe_job {
    const uint8_t *buf;
    size_t bytes;
    sum_fn sum;
    uint64_t sinks[64]; /* one per thread (index capped), so nothing is optimised away */
} probe_job;

static void probe_slices(void *arg, int64_t begin, int64_t end, int thread) {
    probe_job *j = arg;
    uint64_t s = 0;
    for (int64_t i = begin; i < end; i++) {
        const size_t at = (size_t)i * MEMBW_SLICE;
        const size_t n = j->bytes - at < MEMBW_SLICE ? j->bytes - at : MEMBW_SLICE;
        s += j->sum(j->buf + at, n);
    }
    j->sinks[thread & 63] += s;
}

moe_status moe_read_bandwidth(moe_pool *pool, size_t bytes, int runs, moe_bandwidth *out,
                              moe_error *err) {
    memset(out, 0, sizeof *out);
    if (runs < 1) runs = 1;
    if (runs > MEMBW_MAX_RUNS) runs = MEMBW_MAX_RUNS;
    bytes = (bytes + MEMBW_SLICE - 1) / MEMBW_SLICE * MEMBW_SLICE;
    uint8_t *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED)
        return moe_error_set(err, MOE_ERR_NOMEM, "bandwidth probe: cannot map %zu MiB",
                             bytes >> 20);
    memset(buf, 1, bytes); /* every page faulted in before timing */
    probe_job j = {.buf = buf, .bytes = bytes, .sum = sum_u64};
    out->load_bytes = 8;
#if defined(__x86_64__)
    const moe_isa isa = moe_cpu_isa();
    if (isa >= MOE_ISA_AVX512)
        j.sum = sum_avx512, out->load_bytes = 64;
    else if (isa >= MOE_ISA_AVX2)
        j.sum = sum_avx2, out->load_bytes = 32;
#endif
    const int64_t slices = (int64_t)(bytes / MEMBW_SLICE);
    double gbs[MEMBW_MAX_RUNS];
    for (int r = 0; r < runs; r++) {
        const double t0 = moe_now();
        moe_pool_for(pool, slices, 1, probe_slices, &j);
        gbs[r] = (double)bytes / (moe_now() - t0) / 1e9;
    }
    out->runs = runs;
    out->min_gb_s = out->max_gb_s = gbs[0];
    for (int r = 1; r < runs; r++) {
        if (gbs[r] < out->min_gb_s) out->min_gb_s = gbs[r];
        if (gbs[r] > out->max_gb_s) out->max_gb_s = gbs[r];
    }
    out->median_gb_s = moe_median(gbs, runs);
    out->bytes = bytes;
    out->threads = moe_pool_n_threads(pool);
    munmap(buf, bytes);
    return MOE_OK;
}

/* ==== Profile (MOE_PROFILE=1) ==== */

/* Seconds and bytes summed per kind of operation, printed to stderr at exit. Kinds are few
 * (tensor names without their layer), so a linear search is enough; only the thread that owns
 * the model (the one that runs steps) records, so there is no lock. Off, a record costs the
 * test of one cached flag. */
#define PROFILE_MAX_KINDS 48
#define PROFILE_KIND_LEN  40

typedef struct profile_kind {
    char kind[PROFILE_KIND_LEN];
    uint64_t calls;
    double seconds, bytes;
} profile_kind;

static struct {
    int on; /* -1: MOE_PROFILE not read yet */
    int n;
    profile_kind k[PROFILE_MAX_KINDS];
} profile = {.on = -1};

static int profile_cmp(const void *a, const void *b) {
    const double x = ((const profile_kind *)a)->seconds, y = ((const profile_kind *)b)->seconds;
    return (x < y) - (x > y);
}

static void profile_print(void) {
    double step_s = 0;
    uint64_t steps = 0;
    double in_kinds = 0;
    for (int i = 0; i < profile.n; i++) {
        if (!strcmp(profile.k[i].kind, MOE_PROFILE_STEP))
            step_s = profile.k[i].seconds, steps = profile.k[i].calls;
        else
            in_kinds += profile.k[i].seconds;
    }
    qsort(profile.k, (size_t)profile.n, sizeof profile.k[0], profile_cmp);
    const double per = steps ? 1e3 / (double)steps : 0;
    fprintf(stderr,
            "moe profile (MOE_PROFILE=1): %llu steps, %.3f s in steps\n"
            "%-28s %9s %10s %7s %10s %8s\n",
            (unsigned long long)steps, step_s, "kind", "calls", "ms/step", "% step", "MB/step",
            "GB/s");
    for (int i = 0; i < profile.n; i++) {
        const profile_kind *k = &profile.k[i];
        if (!strcmp(k->kind, MOE_PROFILE_STEP)) continue;
        fprintf(stderr, "%-28s %9llu %10.3f %6.1f%%", k->kind, (unsigned long long)k->calls,
                k->seconds * per, step_s > 0 ? 100 * k->seconds / step_s : 0.0);
        if (k->bytes > 0) /* a part (moe_profile_part) reads no weights */
            fprintf(stderr, " %10.2f %8.2f", k->bytes * per / 1e9,
                    k->seconds > 0 ? k->bytes / k->seconds / 1e9 : 0.0);
        fputc('\n', stderr);
    }
    if (step_s > 0)
        fprintf(stderr, "%-28s %9s %10.3f %6.1f%%\n", "(rest of the step)", "",
                (step_s - in_kinds) * per, 100 * (step_s - in_kinds) / step_s);
}

bool moe_profile_on(void) {
    if (profile.on < 0) {
        const char *v = getenv("MOE_PROFILE");
        profile.on = v && *v && strcmp(v, "0") != 0;
        if (profile.on) atexit(profile_print);
    }
    return profile.on;
}

void moe_profile_add(const char *kind, size_t kind_len, double seconds, double bytes) {
    if (kind_len >= PROFILE_KIND_LEN) kind_len = PROFILE_KIND_LEN - 1;
    int i = 0;
    while (i < profile.n &&
           (strncmp(profile.k[i].kind, kind, kind_len) || profile.k[i].kind[kind_len]))
        i++;
    if (i == profile.n) {
        if (profile.n == PROFILE_MAX_KINDS) return; /* a kind past the table is not shown */
        memcpy(profile.k[i].kind, kind, kind_len);
        profile.k[i].kind[kind_len] = 0;
        profile.n++;
    }
    profile.k[i].calls++;
    profile.k[i].seconds += seconds;
    profile.k[i].bytes += bytes;
}

void moe_profile_part(const char *kind, double start) {
    if (start > 0) moe_profile_add(kind, strlen(kind), moe_now() - start, 0);
}
