/* base: what every layer may use -- errors, logging, checked arithmetic, allocation.
 *
 * Two tiers of failure (shared/CONVENTIONS.md): a broken invariant or a programmer error calls
 * moe_die() and the process ends with file:line; anything a user, a file or a request can cause
 * returns a moe_status and fills a moe_error that says what was wrong and where. Never use
 * assert() on input. The trap: moe_error keeps the FIRST error set on it, so a parser may keep
 * going after a failure and report the root cause, not the last symptom. */
#ifndef MOE_BASE_H
#define MOE_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

/* ==== Errors ==== */

/* Set the error if none is set yet; returns the status stored (the first one). The message is
 * one line: control characters in it become spaces (here and in moe_error_prefix). */
moe_status moe_error_set(moe_error *err, moe_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefix the existing message with context ("tensor blk.0.attn_q.weight: ..."). */
void moe_error_prefix(moe_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void moe_error_clear(moe_error *err);
const char *moe_status_name(moe_status code);

_Noreturn void moe_die_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define moe_die(...) moe_die_at(__FILE__, __LINE__, __VA_ARGS__)
/* An internal invariant; on failure the process ends with file:line. Not for input checks. */
#define MOE_CHECK(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) moe_die("check failed: %s", #cond);                                           \
    } while (0)

/* ==== Logging (stderr) ==== */

typedef enum { MOE_LOG_DEBUG, MOE_LOG_INFO, MOE_LOG_WARN, MOE_LOG_ERROR } moe_log_level;
void moe_log(moe_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void moe_log_set_level(moe_log_level level);

/* ==== Checked arithmetic: true when the result overflowed (and *out is unspecified) ==== */

static inline bool moe_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool moe_add_overflow(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_add_overflow(a, b, out);
}

/* ==== Allocation: the x-variants die on exhaustion (sizes must be checked before) ==== */

void *moe_xmalloc(size_t n);
void *moe_xcalloc(size_t count, size_t size);
void *moe_xrealloc(void *p, size_t n);
/* Zeroed anonymous memory of at least `bytes`, aligned to 2 MiB and rounded up to it (*size:
 * what moe_huge_free takes), with the kernel asked for huge pages (a hint: fewer TLB misses on
 * memory read end to end, such as weights and the KV cache). NULL when it cannot be had. */
void *moe_huge_alloc(size_t bytes, size_t *size);
/* The same for `bytes` (whole pages) placed where a huge page of it lines up with `like`'s: the
 * same offset past a 2 MiB boundary, so the pages can be moved over `like` (mremap) and stay
 * huge. Freed with moe_huge_free(p, bytes). */
void *moe_huge_alloc_like(const void *like, size_t bytes);
void moe_huge_free(void *p, size_t size);
char *moe_xstrdup(const char *s);
char *moe_xstrndup(const char *s, size_t n);

/* ==== Seeded random numbers: splitmix64, the same on every platform ==== */

uint64_t moe_rng_u64(uint64_t *state);
double moe_rng_uniform(uint64_t *state);  /* in (0, 1): never 0, never 1 */
double moe_rng_gaussian(uint64_t *state); /* N(0, 1) by Box-Muller (two uniforms per value) */

/* ==== A checksum: 64 bits over bytes, several GB/s; not cryptographic ====
 * Detects corrupted or mixed-up data (disk cache entries); moe_hash64(a ++ b) is not derived
 * from the hashes of a and b, so feed one buffer per call and chain through `seed`. */
uint64_t moe_hash64(const void *data, size_t n, uint64_t seed);

/* ==== A growable string ====
 *
 * Memory comes from malloc, or -- when `alloc` is set -- from an arena: the buffer then grows by
 * taking a fresh block from alloc(alloc_ctx, n), which never returns NULL (it may die or longjmp),
 * and copying; it frees nothing itself, the arena's owner frees everything at once. That is how
 * an interpreter that longjmps out of an error leaks nothing. */

typedef struct moe_strbuf {
    char *s; /* NUL-terminated once anything is written; NULL while empty */
    size_t len, cap;
    void *(*alloc)(void *ctx, size_t n); /* NULL: malloc */
    void *alloc_ctx;
} moe_strbuf;

void moe_strbuf_put(moe_strbuf *b, const char *s, size_t n);
void moe_strbuf_puts(moe_strbuf *b, const char *s);
void moe_strbuf_putc(moe_strbuf *b, char c);
void moe_strbuf_printf(moe_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Forget the text but keep the memory for the next use. */
void moe_strbuf_reset(moe_strbuf *b);
/* Free the memory (an arena's stays until the arena goes); b is empty, its allocator kept. */
void moe_strbuf_free(moe_strbuf *b);
/* The text ("" when nothing was written; malloc'd, the caller frees it); b is empty again. Only
 * for malloc buffers: an arena's text is b->s itself. */
char *moe_strbuf_take(moe_strbuf *b);

/* ==== Files ==== */

/* Whole file into memory, NUL-terminated (the NUL is not counted in *size). */
moe_status moe_file_read(const char *path, uint8_t **data, size_t *size, moe_error *err);
moe_status moe_file_write(const char *path, const void *data, size_t size, moe_error *err);
/* This process's resident set (VmRSS of /proc/self/status), 0 when unknown. */
uint64_t moe_rss_bytes(void);
/* n bytes at byte `at` of the open file fd (named path) into dst, however many reads it takes;
 * an error names the file, `what` was being read and the byte (a short file: "the file ends"). */
moe_status moe_file_pread(int fd, const char *path, uint64_t at, uint64_t n, void *dst,
                          const char *what, moe_error *err);

/* ==== Thread pool: persistent workers, one parallel-for at a time ==== */

typedef struct moe_pool moe_pool;
/* Process items [begin, end) on worker `thread` (0 = the calling thread). */
typedef void (*moe_pool_fn)(void *arg, int64_t begin, int64_t end, int thread);
moe_pool *moe_pool_new(int n_threads); /* n_threads includes the caller */
void moe_pool_free(moe_pool *p);
int moe_pool_n_threads(const moe_pool *p); /* 1 for a NULL pool */
/* Run fn over [0, n_items) in chunks of `chunk`, on all threads; returns when all are done.
 * A NULL pool runs everything on the caller. */
void moe_pool_for(moe_pool *p, int64_t n_items, int64_t chunk, moe_pool_fn fn, void *arg);

/* ==== Timing and the read-bandwidth probe (membw.c) ==== */

double moe_now(void);                /* seconds, CLOCK_MONOTONIC */
double moe_median(double *v, int n); /* sorts v in place; 0 for n <= 0 */

typedef struct moe_bandwidth {
    double median_gb_s, min_gb_s, max_gb_s; /* over the passes, 1e9 bytes per second */
    size_t bytes;                           /* buffer streamed per pass */
    int runs, threads, load_bytes;          /* passes; pool threads; widest load used */
} moe_bandwidth;

/* Stream-sum a fresh buffer of `bytes` (rounded up to 4 MiB slices) `runs` times on all of the
 * pool's threads (NULL: the caller alone), with the widest loads moe_cpu_isa() allows. */
moe_status moe_read_bandwidth(moe_pool *pool, size_t bytes, int runs, moe_bandwidth *out,
                              moe_error *err);

/* Per-op profile, on when the environment sets MOE_PROFILE (not "0"): time and bytes per kind
 * of operation summed over the run and printed to stderr at exit, per step of the kind
 * MOE_PROFILE_STEP (the whole forward), with what the other kinds leave of it. Only the thread
 * that runs the steps records. */
#define MOE_PROFILE_STEP "step"
bool moe_profile_on(void);
void moe_profile_add(const char *kind, size_t kind_len, double seconds, double bytes);
/* A named part of the step that is no matmul (norms, rope, attention, routing...), so the table
 * splits what the matmuls leave: start = moe_profile_start() before it, moe_profile_part(kind,
 * start) after (0 when the profile is off: nothing recorded). Parts never nest, nor contain a
 * matmul, or the table would count their time twice. */
static inline double moe_profile_start(void) {
    return moe_profile_on() ? moe_now() : 0;
}
void moe_profile_part(const char *kind, double start);

/* ==== Half-precision conversions (IEEE binary16 and bfloat16), exact and portable ==== */

float moe_fp16_to_f32(uint16_t h);
uint16_t moe_f32_to_fp16(float f); /* round to nearest even, like F16C */
float moe_bf16_to_f32(uint16_t h);
uint16_t moe_f32_to_bf16(float f); /* round to nearest even; NaN stays quiet NaN */

/* ==== JSON writer (json.c): streaming, into a growable buffer ====
 *
 * Calls nest like the document: object_begin, key, value, ..., object_end. Commas, escaping and
 * (optional) indentation are the writer's business. Strings: '"', '\\' and control characters
 * are escaped, non-ASCII passes through as UTF-8, and bytes that are not valid UTF-8 become
 * U+FFFD so the output always parses. Doubles print with %.17g (exact round trip); NaN and
 * infinities, which JSON cannot hold, print as null. The caller takes the text from `buf`
 * (`len` bytes, NUL-terminated) and may moe_json_reset() to reuse the buffer (SSE events). */
#define MOE_JSON_MAX_DEPTH 64 /* nesting of our own documents; deeper is a programmer error */

typedef struct moe_json {
    char *buf; /* the text so far, NUL-terminated */
    size_t len, cap;
    bool pretty; /* newline + two-space indent per level */
    uint32_t depth;
    bool after_key;                         /* a key was written: the next value needs no comma */
    bool has_items[MOE_JSON_MAX_DEPTH + 1]; /* per level: something written already */
} moe_json;

void moe_json_init(moe_json *j, bool pretty);
void moe_json_free(moe_json *j);
void moe_json_reset(moe_json *j); /* empty the text, keep the buffer */
void moe_json_object_begin(moe_json *j);
void moe_json_object_end(moe_json *j);
void moe_json_array_begin(moe_json *j);
void moe_json_array_end(moe_json *j);
void moe_json_key(moe_json *j, const char *key);
void moe_json_string(moe_json *j, const char *s);
void moe_json_string_n(moe_json *j, const char *s, size_t n); /* may hold NULs (as \u0000) */
void moe_json_int(moe_json *j, int64_t v);
void moe_json_uint(moe_json *j, uint64_t v);
void moe_json_double(moe_json *j, double v);
void moe_json_bool(moe_json *j, bool v);
void moe_json_null(moe_json *j);
/* A key and its value in one call. */
void moe_json_kv_string(moe_json *j, const char *key, const char *s);
void moe_json_kv_int(moe_json *j, const char *key, int64_t v);
void moe_json_kv_uint(moe_json *j, const char *key, uint64_t v);
void moe_json_kv_double(moe_json *j, const char *key, double v);
void moe_json_kv_bool(moe_json *j, const char *key, bool v);

/* ==== CPU features and the kernel ISA level (cpu.c) ====
 *
 * Detected once (CPUID + XGETBV: an instruction set counts only when the OS also saves its
 * registers). The ISA level names the kernel table quant/ uses; the levels are ordered, each
 * needs everything the one below needs, except avxvnni, a side branch off avx2 (AVX-512 CPUs
 * without AVX-VNNI exist): a CPU runs a set of levels (moe_cpu_isa_runs), its best one is the
 * highest. MOE_ISA=scalar|avx2|avxvnni|avx512|avx512vnni|amx in the environment picks another
 * level of the set (for tests and benchmarks); asking for one the CPU does not run logs an error
 * and keeps the best, so a forced level can never raise SIGILL. */

typedef enum moe_isa {
    MOE_ISA_SCALAR = 0, /* plain C: the reference kernels */
    MOE_ISA_AVX2,       /* AVX2 + FMA + F16C, OS saves YMM */
    MOE_ISA_AVXVNNI,    /* avx2 + AVX-VNNI (VEX vpdpbusd on ymm; Alder Lake on): not below avx512 */
    MOE_ISA_AVX512,     /* + AVX-512 F/BW/VL/DQ, OS saves ZMM and opmasks */
    MOE_ISA_AVX512VNNI, /* + AVX-512 VNNI and VBMI, GFNI and BMI2 (BF16 is reported, not
                         * required) */
    MOE_ISA_AMX,        /* + AMX tiles and int8 products, OS saves tile state, and Linux let this
                         * process use it (arch_prctl ARCH_REQ_XCOMP_PERM, asked once at detection) */
    MOE_ISA_COUNT
} moe_isa;

typedef struct moe_cpu_features {
    bool avx2, fma, f16c;
    bool avx512f, avx512bw, avx512vl, avx512dq;
    bool avx512vnni, avx512vbmi, avx512bf16;
    bool gfni, bmi2;         /* GF2P8AFFINEQB (any width), PEXT / PDEP */
    bool avxvnni;            /* AVX-VNNI: CPUID leaf 7 subleaf 1 EAX bit 4 */
    bool amx_tile, amx_int8; /* usable: CPUID, XCR0 tile state and the OS's permission */
    bool os_ymm, os_zmm;     /* XGETBV: the OS saves YMM (and opmask + ZMM) state */
    char vendor[13];         /* "AuthenticAMD", "" off x86 */
    char brand[49];          /* CPUID brand string, trimmed */
} moe_cpu_features;

/* What this CPU and OS offer (detected on first call; thread-safe). */
const moe_cpu_features *moe_cpu_features_get(void);
/* The best level the CPU can run. */
moe_isa moe_cpu_isa_supported(void);
/* The levels the CPU can run, as a set: bit i for level i. */
unsigned moe_cpu_isa_levels(void);
/* Whether the CPU runs `isa` (false for values out of range). */
bool moe_cpu_isa_runs(moe_isa isa);
/* The levels a feature set runs (what moe_cpu_isa_levels is for this CPU). Pure. */
unsigned moe_cpu_levels_of(const moe_cpu_features *f);
/* Physical cores this process may run on (online CPUs less SMT siblings; from sysfs topology,
 * else the online CPU count): the default thread count, as llama.cpp's. */
int moe_cpu_cores(void);
/* The level in use: the best supported one, lowered by MOE_ISA (read once, on first call). */
moe_isa moe_cpu_isa(void);
/* Resolve a MOE_ISA request (NULL or "" = none) against a set of levels (bit i: level i; the
 * scalar one always runs). A level not in `levels`, or an unknown name, writes why into `why`
 * and returns the set's best (highest) level; otherwise why[0] = 0. Pure: what moe_cpu_isa
 * applies to the environment. */
moe_isa moe_cpu_isa_resolve(const char *request, unsigned levels, char *why, size_t why_size);
/* MOE_EXACT=1 (any value but "" and "0"; read once, on first call): the kernels keep ggml's float
 * order so logits reproduce llama.cpp's bits; otherwise the fast paths may sum in their own
 * order within the parity rule (DESIGN.md). */
bool moe_exact(void);
/* Override it (tests run both paths in one process). */
void moe_exact_set(bool on);
/* "scalar", "avx2", "avx512", "avx512vnni", "amx" ("?" past the end). */
const char *moe_isa_name(moe_isa isa);
/* Parse a level name (case-sensitive, as moe_isa_name prints it); false if unknown. */
bool moe_isa_from_name(const char *name, moe_isa *out);
/* One line for --version and benchmarks: brand and the detected features. */
void moe_cpu_describe(char *buf, size_t size);

#endif
