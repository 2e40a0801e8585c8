/* pool.c: a persistent thread pool with one operation, parallel-for over an index range.
 *
 * Threads are created once (moe_pool_new), so the token loop creates no threads and allocates
 * nothing. The caller's thread takes part in every job. Work is handed out in chunks from an
 * atomic counter, so uneven items (experts with different row counts) balance themselves.
 * A decode step is hundreds of short jobs (each expert's matrices, each projection), so the
 * hand-over is spun, not slept: a worker polls the job counter for a while (POOL_SPIN) after
 * each job before it sleeps on the condition variable, and the caller polls for the workers to
 * finish. A sleeping worker costs a futex wake (tens of microseconds on a busy machine, as
 * much as a small expert's matvec); a spinning one picks the job up within a cache miss. The
 * trap: a job function must not call moe_pool_for on the same pool (no nesting). */
#include "base.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define MOE_POOL_MAX_THREADS 512 /* far above any CPU socket; caps a typo'd -t */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif
#include <sched.h>

#define POOL_SPIN 20000 /* polls (a pause each, ~0.5 ms) before a worker sleeps between jobs */

struct moe_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint_fast64_t generation; /* bumped per job (after its fields are set) */
    atomic_int n_busy;               /* workers still inside the current job */
    atomic_bool stop;
    /* the current job */
    moe_pool_fn fn;
    void *arg;
    int64_t n_items, chunk;
    atomic_int_fast64_t next;
};

static void run_chunks(moe_pool *p, int thread) {
    for (;;) {
        const int64_t begin = atomic_fetch_add(&p->next, p->chunk);
        if (begin >= p->n_items) break;
        const int64_t end = begin + p->chunk < p->n_items ? begin + p->chunk : p->n_items;
        p->fn(p->arg, begin, end, thread);
    }
}

typedef struct worker_arg {
    moe_pool *pool;
    int index;
} worker_arg;

static void *worker(void *varg) {
    worker_arg wa = *(worker_arg *)varg;
    free(varg);
    moe_pool *p = wa.pool;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen &&
               !atomic_load(&p->stop) && spins < POOL_SPIN)
            cpu_relax(), spins++;
        if (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        run_chunks(p, wa.index);
        atomic_fetch_sub_explicit(&p->n_busy, 1, memory_order_release);
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
    atomic_init(&p->n_busy, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->next, 0);
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

void moe_pool_for(moe_pool *p, int64_t n_items, int64_t chunk, moe_pool_fn fn, void *arg) {
    if (n_items <= 0) return;
    if (chunk < 1) chunk = 1;
    if (!p || p->n_threads == 1 || n_items <= chunk) {
        fn(arg, 0, n_items, 0);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n_items = n_items;
    p->chunk = chunk;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->n_busy, p->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    /* sleepers re-check the generation under the mutex, so none misses this broadcast */
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, 0);
    for (int spins = 0; atomic_load_explicit(&p->n_busy, memory_order_acquire) > 0; spins++) {
        if (spins < POOL_SPIN)
            cpu_relax();
        else
            sched_yield(); /* a worker was descheduled: give it the core */
    }
}
