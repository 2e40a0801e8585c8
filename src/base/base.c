/* base.c: errors, logging, allocation, whole-file I/O and half-precision conversions.
 *
 * Owns nothing global except the log level. The fp16/bf16 conversions are bit-exact with the
 * hardware (F16C / AVX512-BF16 round-to-nearest-even) and are the scalar reference every
 * vectorised conversion is tested against. */
#include "base.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ==== Errors ==== */

static const char *const status_names[MOE_STATUS_COUNT] = {
    [MOE_OK] = "ok",
    [MOE_ERR_IO] = "i/o error",
    [MOE_ERR_FORMAT] = "format error",
    [MOE_ERR_RANGE] = "out of range",
    [MOE_ERR_NOMEM] = "out of memory",
    [MOE_ERR_ARG] = "bad argument",
    [MOE_ERR_UNSUPPORTED] = "unsupported",
    [MOE_ERR_NOT_FOUND] = "not found",
};

const char *moe_status_name(moe_status code) {
    return (unsigned)code < MOE_STATUS_COUNT ? status_names[code] : "unknown status";
}

const char *moe_version(void) {
    return MOE_VERSION_STRING;
}

/* Control characters (a parser's quote of its input: jansson's "near '...'") become spaces, so
 * a message stays one line in logs and in an HTTP error body. */
static void one_line(char *msg) {
    for (unsigned char *c = (unsigned char *)msg; *c; c++)
        if (*c < 0x20 || *c == 0x7f) *c = ' ';
}

moe_status moe_error_set(moe_error *err, moe_status code, const char *fmt, ...) {
    if (!err) return code;
    if (err->code != MOE_OK) return err->code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    one_line(err->msg);
    return code;
}

void moe_error_prefix(moe_error *err, const char *fmt, ...) {
    if (!err || err->code == MOE_OK) return;
    char joined[MOE_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(joined, sizeof joined, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof joined - 2) return; /* no room: keep the original */
    size_t used = (size_t)n;
    memcpy(joined + used, ": ", 2);
    used += 2;
    size_t rest = strnlen(err->msg, sizeof err->msg);
    if (rest > sizeof joined - 1 - used) rest = sizeof joined - 1 - used;
    memcpy(joined + used, err->msg, rest);
    joined[used + rest] = '\0';
    memcpy(err->msg, joined, sizeof joined);
    one_line(err->msg);
}

void moe_error_clear(moe_error *err) {
    err->code = MOE_OK;
    err->msg[0] = '\0';
}

_Noreturn void moe_die_at(const char *file, int line, const char *fmt, ...) {
    fflush(stdout);
    fprintf(stderr, "moe: fatal: %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

/* ==== Logging ==== */

static moe_log_level log_level = MOE_LOG_INFO;

void moe_log_set_level(moe_log_level level) {
    log_level = level;
}

void moe_log(moe_log_level level, const char *fmt, ...) {
    if (level < log_level) return;
    static const char *const tags[] = {"debug", "info", "warning", "error"};
    fprintf(stderr, "moe: %s: ", tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ==== Allocation ==== */

void *moe_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) moe_die("out of memory allocating %zu bytes", n);
    return p;
}

void *moe_xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) moe_die("out of memory allocating %zu x %zu bytes", count, size);
    return p;
}

void *moe_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) moe_die("out of memory reallocating to %zu bytes", n);
    return q;
}

#define HUGE_ALIGN ((size_t)2 << 20)

/* `size` bytes at an address `phase` bytes past a 2 MiB boundary, huge pages asked for. */
static void *huge_region(size_t size, size_t phase) {
    /* over-allocate by the alignment, then trim both ends */
    uint8_t *raw =
        mmap(NULL, size + HUGE_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uint8_t *base =
        (uint8_t *)((((uintptr_t)raw - phase + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1)) +
                    phase);
    if (base > raw) munmap(raw, (size_t)(base - raw));
    if (base + size < raw + size + HUGE_ALIGN)
        munmap(base + size, (size_t)(raw + size + HUGE_ALIGN - (base + size)));
#ifdef MADV_HUGEPAGE
    madvise(base, size, MADV_HUGEPAGE);
#endif
    return base;
}

void *moe_huge_alloc(size_t bytes, size_t *size) {
    if (bytes > SIZE_MAX / 2) return NULL;
    *size = (bytes + HUGE_ALIGN - 1) / HUGE_ALIGN * HUGE_ALIGN;
    if (!*size) *size = HUGE_ALIGN;
    return huge_region(*size, 0);
}

void *moe_huge_alloc_like(const void *like, size_t bytes) {
    return bytes && bytes <= SIZE_MAX / 2 ? huge_region(bytes, (uintptr_t)like & (HUGE_ALIGN - 1))
                                          : NULL;
}

void moe_huge_free(void *p, size_t size) {
    if (p) munmap(p, size);
}

char *moe_xstrdup(const char *s) {
    return moe_xstrndup(s, strlen(s));
}

char *moe_xstrndup(const char *s, size_t n) {
    char *d = moe_xmalloc(n + 1);
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

/* ==== Seeded random numbers ==== */

uint64_t moe_rng_u64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double moe_rng_uniform(uint64_t *state) {
    return ((double)(moe_rng_u64(state) >> 11) + 0.5) * 0x1p-53;
}

double moe_rng_gaussian(uint64_t *state) {
    const double u1 = moe_rng_uniform(state), u2 = moe_rng_uniform(state);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ==== A checksum ==== */

/* Four independent lanes take one 8-byte word each per round: xor it in, multiply by an odd
 * constant, fold the high bits down. Each round is a bijection of the lane for a fixed word, so
 * one changed word always changes its lane; the finish mixes lanes and length with splitmix64. */
#define HASH_K1 0xd6e8feb86659fd93ull
#define HASH_K2 0xa0761d6478bd642full

static inline uint64_t hash_round(uint64_t lane, uint64_t word) {
    lane = (lane ^ word) * HASH_K1;
    return lane ^ (lane >> 29);
}

uint64_t moe_hash64(const void *data, size_t n, uint64_t seed) {
    const uint8_t *p = data;
    uint64_t lane[4] = {seed, seed ^ HASH_K2, seed + HASH_K1, ~seed};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * k, 8);
            lane[k] = hash_round(lane[k], w);
        }
    uint64_t tail[4] = {0, 0, 0, 0};
    if (n > i) memcpy(tail, p + i, n - i);
    for (int k = 0; k < 4; k++) lane[k] = hash_round(lane[k], tail[k]);
    uint64_t state = n;
    for (int k = 0; k < 4; k++) state = moe_rng_u64(&state) ^ lane[k];
    return moe_rng_u64(&state);
}

/* ==== A growable string ==== */

/* Room for n more bytes and the NUL. */
/* Room for n more bytes and the NUL. */
static void strbuf_reserve(moe_strbuf *b, size_t n) {
    if (b->s && b->cap - b->len > n) return;
    if (n > SIZE_MAX / 4 - b->len) moe_die("string buffer size overflow");
    size_t cap = b->cap ? b->cap : 64;
    while (cap - b->len <= n) cap *= 2;
    if (b->alloc) {
        char *fresh = b->alloc(b->alloc_ctx, cap);
        if (b->len) memcpy(fresh, b->s, b->len);
        b->s = fresh;
    } else {
        b->s = moe_xrealloc(b->s, cap);
    }
    b->cap = cap;
}

void moe_strbuf_put(moe_strbuf *b, const char *s, size_t n) {
    strbuf_reserve(b, n);
    if (n) memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

void moe_strbuf_puts(moe_strbuf *b, const char *s) {
    moe_strbuf_put(b, s, strlen(s));
}

void moe_strbuf_putc(moe_strbuf *b, char c) {
    moe_strbuf_put(b, &c, 1);
}

void moe_strbuf_reset(moe_strbuf *b) {
    b->len = 0;
    if (b->s) b->s[0] = '\0';
}

void moe_strbuf_free(moe_strbuf *b) {
    if (!b->alloc) free(b->s);
    *b = (moe_strbuf){.alloc = b->alloc, .alloc_ctx = b->alloc_ctx};
}

void moe_strbuf_printf(moe_strbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) moe_die("vsnprintf failed");
        if (b->s && (size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        strbuf_reserve(b, (size_t)n);
    }
}

char *moe_strbuf_take(moe_strbuf *b) {
    MOE_CHECK(!b->alloc);
    char *s = b->s ? b->s : moe_xstrdup("");
    *b = (moe_strbuf){0};
    return s;
}

/* ==== Files ==== */

moe_status moe_file_read(const char *path, uint8_t **data, size_t *size, moe_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = moe_xmalloc(cap + 1);
    for (;;) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        cap *= 2;
        buf = moe_xrealloc(buf, cap + 1);
    }
    bool failed = ferror(f);
    fclose(f);
    if (failed) {
        free(buf);
        return moe_error_set(err, MOE_ERR_IO, "%s: read failed", path);
    }
    buf[n] = '\0';
    *data = buf;
    *size = n;
    return MOE_OK;
}

uint64_t moe_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %llu kB", &kib) == 1) break;
    if (f) fclose(f);
    return (uint64_t)kib * 1024;
}

moe_status moe_file_pread(int fd, const char *path, uint64_t at, uint64_t n, void *dst,
                          const char *what, moe_error *err) {
    for (uint64_t got = 0; got < n;) {
        const ssize_t r = pread(fd, (uint8_t *)dst + got, (size_t)(n - got), (off_t)(at + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return moe_error_set(err, MOE_ERR_IO, "%s: reading %s at byte %" PRIu64 " failed: %s",
                                 path, what, at + got, strerror(errno));
        if (r == 0)
            return moe_error_set(err, MOE_ERR_IO,
                                 "%s: the file ends at byte %" PRIu64 ", inside %s (truncated "
                                 "since it was loaded?)",
                                 path, at + got, what);
        got += (uint64_t)r;
    }
    return MOE_OK;
}

moe_status moe_file_write(const char *path, const void *data, size_t size, moe_error *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno));
    size_t put = fwrite(data, 1, size, f);
    int closed = fclose(f);
    if (put != size || closed != 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    return MOE_OK;
}

/* ==== Half precision ==== */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float moe_fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf / nan */
    if (exp == 0) {
        if (mant == 0) return bits_f32(sign);
        /* subnormal: mant * 2^-24, exact in float */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t moe_f32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or nan (nan keeps a quiet payload bit) */
        return sign | 0x7c00 | (ax > 0x7f800000u ? (0x200 | ((ax >> 13) & 0x3ff)) : 0);
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* rounds to >= 65520: infinity */
    if (ax < 0x38800000u) {                      /* below the smallest normal half: subnormal */
        /* value * 2^24 rounded to nearest even gives the subnormal mantissa */
        float v = bits_f32(ax) * 0x1p24f;
        /* float addition of 2^23 rounds to nearest even at integer granularity */
        float r = (v + 0x1p23f) - 0x1p23f;
        return sign | (uint16_t)r;
    }
    uint32_t mant_rounded = ax + 0xfffu + ((ax >> 13) & 1u); /* round to nearest even */
    return sign | (uint16_t)((mant_rounded - (112u << 23)) >> 13);
}

float moe_bf16_to_f32(uint16_t h) {
    return bits_f32((uint32_t)h << 16);
}

uint16_t moe_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
