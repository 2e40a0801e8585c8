/* pool.c: a persistent thread pool with one operation, parallel-for over an index range.
 *
 * Threads are created once (moe_pool_new), so the token loop creates no threads and allocates
 * nothing. The caller's thread takes part in every job. Work is handed out in chunks from an
 * atomic counter, so uneven items (experts with different row counts) balance themselves, and a
 * worker that starts late simply finds fewer chunks left: the job is finished when its items
 * are, not when every worker has looked at it, so the caller never waits for a worker that is
 * descheduled before it claimed anything.
 *
 * A decode step is hundreds of short jobs (each expert's matrices, each projection), so the
 * hand-over is spun, not slept: a worker polls for the next job for a while (POOL_SPIN_S) before
 * it sleeps on the condition variable. A sleeping worker costs a futex wake (tens of
 * microseconds on a busy machine, as much as a small expert's matvec); a spinning one picks the
 * job up within a cache miss.
 *
 * Under contention (another process running on one of our cores) a spinner takes time from
 * whoever shares its core, so a worker that finds it was descheduled while polling sleeps at
 * once. A worker preempted while it holds a chunk still makes the caller wait for that chunk
 * (yielding its core meanwhile). Benching such a worker for a while, the others taking all the
 * chunks, was tried: on a machine oversubscribed by other processes it gave up the worker's
 * share of the CPU and prefill fell by a quarter, so it is not done.
 * Results never depend on which thread ran which chunk (jobs write disjoint outputs; per-thread
 * scratch is indexed by `thread`, which stays each thread's own).
 *
 * The trap: a job function must not call moe_pool_for on the same pool (no nesting). */
#include "base.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#define MOE_POOL_MAX_THREADS 512 /* far above any CPU socket; caps a typo'd -t */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define POOL_SPIN_S    300e-6 /* a worker polls this long for the next job before it sleeps */
#define POOL_GAP_S     50e-6  /* a pause between two clock reads this long: we were descheduled */
#define POOL_POLLS     64     /* polls between two clock reads (~2 us of pauses) */
#define POOL_WAIT_SPIN 20000  /* the caller's polls (a pause each, ~0.3 ms) before it yields */

struct moe_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake; /* a job is open, or the stop */
    /* even: job generation/2 is open (its fields are set); odd: the caller is writing the next */
    atomic_uint_fast64_t generation;
    atomic_int n_inside; /* workers that entered the open job and have not left it */
    atomic_bool stop;
    /* the current job */
    moe_pool_fn fn;
    void *arg;
    int64_t n_items, chunk;
    atomic_int_fast64_t next; /* first item not handed out */
    atomic_int_fast64_t done; /* items finished */
};

static void run_chunks(moe_pool *p, int thread) {
    for (;;) {
        const int64_t begin = atomic_fetch_add(&p->next, p->chunk);
        if (begin >= p->n_items) break;
        const int64_t end = begin + p->chunk < p->n_items ? begin + p->chunk : p->n_items;
        p->fn(p->arg, begin, end, thread);
        atomic_fetch_add_explicit(&p->done, end - begin, memory_order_release);
    }
}

typedef struct worker_arg {
    moe_pool *pool;
    int index;
} worker_arg;

/* Whether the worker has something to do: an open job it has not seen, or the stop. */
static bool worker_called(moe_pool *p, uint64_t seen) {
    const uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
    return (g != seen && !(g & 1)) || atomic_load_explicit(&p->stop, memory_order_relaxed);
}

static void *worker(void *varg) {
    worker_arg wa = *(worker_arg *)varg;
    free(varg);
    moe_pool *p = wa.pool;
    uint64_t seen = 0;
    for (;;) {
        /* poll while the jobs keep coming and nothing takes our core, else sleep */
        const double start = moe_now();
        double last = start;
        while (!worker_called(p, seen)) {
            for (int i = 0; i < POOL_POLLS && !worker_called(p, seen); i++) cpu_relax();
            const double now = moe_now();
            if (now - start > POOL_SPIN_S || now - last > POOL_GAP_S) break;
            last = now;
        }
        if (!worker_called(p, seen)) {
            pthread_mutex_lock(&p->mu);
            while (!worker_called(p, seen)) pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        const uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if ((g & 1) || g == seen) continue; /* the caller is between jobs */
        seen = g;
        /* enter, then check the job is still the one seen: the caller closes a job (odd
         * generation) before it waits for n_inside to drop, so one of the two sees the other */
        atomic_fetch_add(&p->n_inside, 1);
        if (atomic_load(&p->generation) == g) run_chunks(p, wa.index);
        atomic_fetch_sub_explicit(&p->n_inside, 1, memory_order_release);
    }
    return NULL;
}

moe_pool *moe_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MOE_POOL_MAX_THREADS) n_threads = MOE_POOL_MAX_THREADS;
    moe_pool *p = moe_xcalloc(1, sizeof *p);
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->n_inside, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->next, 0);
    atomic_init(&p->done, 0);
    p->threads = moe_xcalloc((size_t)n_threads, sizeof(pthread_t));
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = moe_xmalloc(sizeof *wa);
        *wa = (worker_arg){p, i};
        if (pthread_create(&p->threads[i], NULL, worker, wa) != 0)
            moe_die("cannot create thread %d of %d", i, n_threads);
    }
    return p;
}

void moe_pool_free(moe_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p);
}

int moe_pool_n_threads(const moe_pool *p) {
    return p ? p->n_threads : 1;
}

/* Spin a while, then give the core away (to a worker that shares it, say). */
static void pool_wait_poll(int polls) {
    if (polls < POOL_WAIT_SPIN)
        cpu_relax();
    else
        sched_yield();
}

void moe_pool_for(moe_pool *p, int64_t n_items, int64_t chunk, moe_pool_fn fn, void *arg) {
    if (n_items <= 0) return;
    if (chunk < 1) chunk = 1;
    if (!p || p->n_threads == 1 || n_items <= chunk) {
        fn(arg, 0, n_items, 0);
        return;
    }
    /* close the last job and wait until no worker is inside it (a worker there has no chunk
     * left: it is on its way out), then open this one */
    const uint64_t g = atomic_load_explicit(&p->generation, memory_order_relaxed);
    atomic_store(&p->generation, g + 1);
    for (int polls = 0; atomic_load(&p->n_inside) > 0; polls++) pool_wait_poll(polls);
    p->fn = fn;
    p->arg = arg;
    p->n_items = n_items;
    p->chunk = chunk;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->generation, g + 2, memory_order_release);
    /* sleepers re-check the generation under the mutex, so none misses this broadcast */
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, 0);
    /* only chunks still running are waited for, not workers that never took one */
    for (int polls = 0; atomic_load_explicit(&p->done, memory_order_acquire) < n_items; polls++)
        pool_wait_poll(polls);
}
