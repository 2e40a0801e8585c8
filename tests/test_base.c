/* Suite "base": the error struct keeps the first error, checked arithmetic catches overflow,
 * the fp16/bf16 conversions agree with the IEEE definitions on edge values, and the thread pool
 * runs every item of every job exactly once, also with more threads than cores and with a
 * worker that stalls while it holds a chunk. */
#include "testutil.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void error_keeps_first(void **state) {
    (void)state;
    moe_error err = {0};
    assert_int_equal(moe_error_set(&err, MOE_ERR_FORMAT, "first at %d", 7), MOE_ERR_FORMAT);
    assert_int_equal(moe_error_set(&err, MOE_ERR_IO, "second"), MOE_ERR_FORMAT);
    assert_string_equal(err.msg, "first at 7");
    moe_error_prefix(&err, "file %s", "x.gguf");
    assert_string_equal(err.msg, "file x.gguf: first at 7");
}

static void checked_arithmetic(void **state) {
    (void)state;
    uint64_t r;
    assert_false(moe_mul_overflow(1ull << 31, 1ull << 31, &r));
    assert_int_equal(r, 1ull << 62);
    assert_true(moe_mul_overflow(1ull << 32, 1ull << 32, &r));
    assert_true(moe_add_overflow(UINT64_MAX, 1, &r));
}

static void half_edges(void **state) {
    (void)state;
    /* IEEE binary16: 1.0 = 0x3c00, 65504 = max, 2^-24 smallest subnormal, -0 keeps its sign */
    assert_int_equal(moe_f32_to_fp16(1.0f), 0x3c00);
    assert_int_equal(moe_f32_to_fp16(65504.0f), 0x7bff);
    assert_int_equal(moe_f32_to_fp16(65520.0f), 0x7c00);
    assert_int_equal(moe_f32_to_fp16(0x1p-24f), 0x0001);
    assert_int_equal(moe_f32_to_fp16(0x1p-25f), 0x0000);   /* tie to even: 0 */
    assert_int_equal(moe_f32_to_fp16(0x1.8p-24f), 0x0002); /* tie to even: 2 */
    assert_int_equal(moe_f32_to_fp16(-0.0f), 0x8000);
    assert_true(moe_fp16_to_f32(0x0001) == 0x1p-24f);
    assert_true(moe_fp16_to_f32(0xfbff) == -65504.0f);
    assert_true(isinf(moe_fp16_to_f32(0x7c00)));
    assert_true(isnan(moe_fp16_to_f32(0x7e00)));
    /* every half survives a round trip through float */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue; /* nan payloads */
        assert_int_equal(moe_f32_to_fp16(moe_fp16_to_f32((uint16_t)h)), h);
    }
    assert_int_equal(moe_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(moe_f32_to_bf16(1.00390625f), 0x3f80); /* halfway, to even */
    assert_int_equal(moe_f32_to_bf16(1.01171875f), 0x3f82); /* halfway, to even (up) */
}

/* The disk cache's checksum: every single-bit flip of a buffer changes it (each lane round is a
 * bijection of its word), and so does a trailing zero byte, a swap of two words, or the seed. */
static void hash_detects_changes(void **state) {
    (void)state;
    uint8_t buf[131]; /* four 32-byte rounds and a tail */
    uint64_t rng = 42;
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)moe_rng_u64(&rng);
    const uint64_t h = moe_hash64(buf, sizeof buf, 7);
    assert_true(h == moe_hash64(buf, sizeof buf, 7));
    for (size_t bit = 0; bit < 8 * sizeof buf; bit++) {
        buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        assert_true(moe_hash64(buf, sizeof buf, 7) != h);
        buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    uint8_t longer[sizeof buf + 1] = {0};
    memcpy(longer, buf, sizeof buf);
    assert_true(moe_hash64(longer, sizeof longer, 7) != h);
    assert_true(moe_hash64(buf, sizeof buf, 8) != h);
    uint8_t swapped[sizeof buf];
    memcpy(swapped, buf, sizeof buf);
    memcpy(swapped, buf + 8, 8);
    memcpy(swapped + 8, buf, 8);
    assert_true(moe_hash64(swapped, sizeof swapped, 7) != h);
    assert_true(moe_hash64(NULL, 0, 7) != moe_hash64(NULL, 0, 8));
}

/* ==== Thread pool ==== */

#define POOL_ITEMS 3000

typedef struct pool_count {
    atomic_int hits[POOL_ITEMS];
    atomic_int bad_thread;
    int n_threads;
    /* the stall test: the first worker chunk sleeps while the caller waits for it to start */
    atomic_bool worker_started, stall;
} pool_count;

static void pool_count_items(void *arg, int64_t begin, int64_t end, int thread) {
    pool_count *c = arg;
    if (thread < 0 || thread >= c->n_threads) atomic_fetch_add(&c->bad_thread, 1);
    if (atomic_load(&c->stall)) {
        if (thread != 0 && !atomic_exchange(&c->worker_started, true)) {
            nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL); /* preempted, as it were */
        } else if (thread == 0) {
            const double until = moe_now() + 1.0; /* a worker is never this late to start */
            while (!atomic_load(&c->worker_started) && moe_now() < until) continue;
        }
    }
    for (int64_t i = begin; i < end; i++) atomic_fetch_add(&c->hits[i], 1);
}

/* Jobs of every size and chunk on pools of 2..5 threads (more than the cores here): each item
 * is run once per job, on a valid thread index. */
static void pool_runs_each_item_once(void **state) {
    (void)state;
    pool_count *c = moe_xcalloc(1, sizeof *c);
    for (int n_threads = 2; n_threads <= 5; n_threads++) {
        moe_pool *pool = moe_pool_new(n_threads);
        c->n_threads = n_threads;
        memset(c->hits, 0, sizeof c->hits);
        int jobs = 0;
        for (int64_t n = 1; n <= POOL_ITEMS; n = n * 3 + 1)
            for (int64_t chunk = 1; chunk <= 64; chunk *= 4)
                for (int rep = 0; rep < 20; rep++, jobs++) {
                    moe_pool_for(pool, n, chunk, pool_count_items, c);
                    for (int64_t i = 0; i < n; i++) {
                        assert_int_equal(atomic_load(&c->hits[i]), 1);
                        atomic_store(&c->hits[i], 0);
                    }
                }
        assert_true(jobs > 100);
        moe_pool_free(pool);
    }
    assert_int_equal(atomic_load(&c->bad_thread), 0);
    free(c);
}

/* A worker that sleeps 50 ms holding a chunk (as if preempted): the caller takes every other
 * chunk, waits for that one, and each item still runs once; the jobs after it too. */
static void pool_waits_for_a_stalled_chunk(void **state) {
    (void)state;
    pool_count *c = moe_xcalloc(1, sizeof *c);
    moe_pool *pool = moe_pool_new(2);
    c->n_threads = 2;
    atomic_store(&c->stall, true);
    moe_pool_for(pool, 64, 1, pool_count_items, c);
    atomic_store(&c->stall, false);
    assert_true(atomic_load(&c->worker_started));
    for (int i = 0; i < 64; i++) assert_int_equal(atomic_load(&c->hits[i]), 1);
    for (int jobs = 1; jobs <= 100; jobs++) {
        moe_pool_for(pool, 64, 1, pool_count_items, c);
        for (int i = 0; i < 64; i++) assert_int_equal(atomic_load(&c->hits[i]), 1 + jobs);
    }
    assert_int_equal(atomic_load(&c->bad_thread), 0);
    moe_pool_free(pool);
    free(c);
}

int moe_suite_base(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(error_keeps_first),
        cmocka_unit_test(checked_arithmetic),
        cmocka_unit_test(half_edges),
        cmocka_unit_test(hash_detects_changes),
        cmocka_unit_test(pool_runs_each_item_once),
        cmocka_unit_test(pool_waits_for_a_stalled_chunk),
    };
    return cmocka_run_group_tests_name("base", tests, NULL, NULL);
}
