/* expert_cache.c: routed experts kept in a resident cache of fixed size and read from the model
 * file on demand, for models larger than memory.
 *
 * The unit is one expert of one layer: its gate, up and down matrices (three slices of the
 * stacked *_exps tensors) in one slot. Everything else the model has stays resident as before;
 * the experts' own bytes are never touched through the mapping. When the dispatch takes a group
 * of experts, the misses get slots (empty ones first, else the unpinned expert used least often,
 * the least recently among equals: routing is skewed and stable, so frequency beats recency) and
 * go to the front of the reader threads' queue, one reader per expert a token uses, so the disk
 * sees them at once; the dispatch computes the experts already resident meanwhile and waits only
 * for the rest. Reads use O_DIRECT through an aligned bounce buffer where the filesystem takes it
 * (else pread, then the page cache is told to drop what was read), so the page cache neither
 * doubles the memory nor evicts the wrong pages. Slots of the running group are pinned until the
 * group is done. Behind the misses, the readers read ahead the next MoE layer's experts used most
 * that are not resident (the ones routing is likely to pick), so the disk works while the CPU
 * does. The bytes read are the file's, so logits equal the fully resident run bit for bit. The
 * use counts can be kept in a file (--expert-stats) so a restart warms the cache with the experts
 * used most, and a list of experts can be pinned (--pin-experts): read at start, never evicted.
 * The trap: a read error cannot return through the matmuls; it is kept here and the step fails
 * with it. */
#include "engine_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define DIRECT_ALIGN 4096 /* O_DIRECT's offset, length and buffer alignment */

typedef struct slot {
    int32_t layer, expert; /* owner, or layer -1: empty */
    uint64_t last_use;
    int pinned;
    uint8_t loading; /* matrices the readers have still to fill (not usable, not evictable) */
    bool failed;     /* one of them could not be read (its error in slot_err) */
    bool wanted;     /* read because a step needs it (a miss), not ahead */
} slot;

#define READ_AHEAD_MAX 64 /* queued read-ahead experts */
/* queued matrices: of the experts read ahead and one group's misses */
#define QUEUE_MAX   (3 * (READ_AHEAD_MAX + MOE_MATMUL_MANY_MAX / 2))
#define READERS_MAX 16 /* reader threads: the disk's queue depth for one step's misses */

typedef struct layer_source {
    moe_expert_cache *cache;
    uint32_t layer;
    moe_expert_source source;
} layer_source;

struct moe_expert_cache {
    const moe_model *m;
    uint64_t slot_bytes;
    uint32_t n_slots;
    uint8_t *mem; /* [n_slots][slot_bytes] anonymous */
    size_t mem_size;
    slot *slots;
    int32_t *slot_of; /* [n_layer_run][n_expert]: the slot holding the expert, or -1 */
    uint32_t *uses;   /* [n_layer_run][n_expert] acquisitions */
    uint32_t n_layer; /* layers run (trunk + MTP) */
    int *fd;          /* [n_shards] O_DIRECT where the filesystem allows, else plain */
    bool *direct;     /* [n_shards] */
    uint8_t *bounce;  /* [n_readers][bounce_bytes], DIRECT_ALIGN-aligned */
    uint64_t bounce_bytes;
    layer_source *sources; /* [n_layer_run] */
    uint64_t clock;
    moe_expert_cache_stats stats;
    moe_error err;          /* the first read error */
    const char *stats_path; /* where the use counts are kept (NULL: nowhere) */
    /* the reader threads and the slots queued for them (slot states and counters under mu) */
    pthread_t readers[READERS_MAX];
    int n_readers, n_running; /* started; running (each takes the next bounce buffer) */
    bool stop;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int32_t queue[QUEUE_MAX]; /* 3 slot + k (matrix k of the slot's expert): misses at the
                               * front, read-ahead at the back */
    moe_error *slot_err;      /* [n_slots] why a failed slot's read failed */
    uint32_t q_head, q_len;
    uint32_t n_loading; /* slots queued or being read */
    int n_reading;      /* reads in flight, and since when there were any (stats.busy_seconds) */
    double busy_since;
};

/* Matrix k of a layer's experts: 0 gate (or the fused gate_up of Gemma 4: then a slot holds two
 * slices), 1 up (NULL when fused), 2 down; NULL for a layer without experts. */
static const moe_tensor *expert_tensor(const moe_model *m, uint32_t il, int k) {
    const moe_layer_weights *l = &m->layers[il];
    if (l->plan.ffn != MOE_FFN_EXPERTS) return NULL;
    const moe_expert_weights *w = &l->experts;
    return k == 0 ? (w->gate_up ? w->gate_up : w->gate) : k == 1 ? w->up : w->down;
}

static uint64_t slice_bytes(const moe_tensor *t) {
    return t ? t->n_bytes / (uint64_t)t->ne[2] : 0;
}

/* One expert of layer il: its gate, up and down slices. */
static uint64_t expert_bytes(const moe_model *m, uint32_t il) {
    uint64_t b = 0;
    for (int k = 0; k < 3; k++) b += slice_bytes(expert_tensor(m, il, k));
    return b;
}

/* ==== Reading ==== */

/* n bytes at file offset `at` of shard `shard` into dst; false with err set. */
static bool read_bytes(moe_expert_cache *c, uint32_t shard, uint64_t at, uint64_t n, uint8_t *dst,
                       int thread, const char *what, moe_error *err) {
    const moe_gguf_shard *sh = moe_gguf_shard_get(c->m->gguf, shard);
    const int fd = c->fd[shard];
    uint64_t head = 0, len = n, from = at;
    uint8_t *buf = dst;
    if (c->direct[shard]) { /* an aligned superset into the bounce buffer */
        from = at / DIRECT_ALIGN * DIRECT_ALIGN;
        head = at - from;
        len = (head + n + DIRECT_ALIGN - 1) / DIRECT_ALIGN * DIRECT_ALIGN;
        buf = c->bounce + (uint64_t)thread * c->bounce_bytes;
    }
    uint64_t got = 0;
    while (got < head + n) {
        const ssize_t r = pread(fd, buf + got, (size_t)(len - got), (off_t)(from + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (r < 0)
                moe_error_set(err, MOE_ERR_IO, "%s: reading %s at byte %" PRIu64 " failed: %s",
                              sh->path, what, from + got, strerror(errno));
            else
                moe_error_set(err, MOE_ERR_IO,
                              "%s: the file ends at byte %" PRIu64 ", inside %s (truncated since "
                              "it was loaded?)",
                              sh->path, from + got, what);
            return false;
        }
        got += (uint64_t)r;
    }
    if (c->direct[shard])
        memcpy(dst, buf + head, (size_t)n);
    else /* read once: the cache holds it now, the page cache need not */
        posix_fadvise(fd, (off_t)at, (off_t)n, POSIX_FADV_DONTNEED);
    return true;
}

/* Where matrix k of a layer's expert lies in its slot. */
static uint64_t slot_offset(const moe_model *m, uint32_t il, int k) {
    uint64_t at = 0;
    for (int j = 0; j < k; j++) at += slice_bytes(expert_tensor(m, il, j));
    return at;
}

/* A reader thread: queued matrices filled in order, so one expert's gate, up and down are read
 * at once by different readers. A slot whose every matrix has arrived is usable; one with a
 * failed read is emptied then, and when a step holds the slot (a miss, or a read-ahead it is
 * waiting for) the error is kept for the step, else the expert is simply read again, with its
 * error, if a step needs it. */
static void *reader_main(void *arg) {
    moe_expert_cache *c = arg;
    pthread_mutex_lock(&c->mu);
    const int bounce = c->n_running++;
    for (;;) {
        while (!c->stop && !c->q_len) pthread_cond_wait(&c->work, &c->mu);
        if (c->stop) break;
        const int32_t s = c->queue[c->q_head] / 3, k = c->queue[c->q_head] % 3;
        c->q_head = (c->q_head + 1) % QUEUE_MAX;
        c->q_len--;
        const slot job = c->slots[s];
        if (c->n_reading++ == 0) c->busy_since = moe_now();
        pthread_mutex_unlock(&c->mu);
        const moe_tensor *t = expert_tensor(c->m, (uint32_t)job.layer, k);
        const uint64_t n = slice_bytes(t);
        char what[160];
        snprintf(what, sizeof what, "expert %d of '%.*s'", job.expert, (int)t->name.len,
                 t->name.ptr);
        moe_error err = {0};
        const bool ok = read_bytes(c, t->shard, t->file_offset + (uint64_t)job.expert * n, n,
                                   c->mem + (uint64_t)s * c->slot_bytes +
                                       slot_offset(c->m, (uint32_t)job.layer, k),
                                   bounce, what, &err);
        pthread_mutex_lock(&c->mu);
        if (--c->n_reading == 0) c->stats.busy_seconds += moe_now() - c->busy_since;
        slot *v = &c->slots[s];
        if (!ok && !v->failed) {
            v->failed = true;
            c->slot_err[s] = err;
        }
        if (--v->loading == 0) {
            c->n_loading--;
            if (!v->failed) {
                c->stats.bytes_read += expert_bytes(c->m, (uint32_t)job.layer);
                if (!job.wanted) c->stats.read_ahead++;
            } else {
                if (v->pinned && !c->err.code) c->err = c->slot_err[s];
                c->slot_of[(uint64_t)job.layer * c->m->cfg.n_expert + (uint32_t)job.expert] = -1;
                *v = (slot){.layer = -1};
            }
            pthread_cond_broadcast(&c->done);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Slot s's matrices to the readers (under mu), its expert already set: a miss's before
 * everything read ahead, gate first. */
static void enqueue(moe_expert_cache *c, int32_t s, bool miss) {
    slot *v = &c->slots[s];
    for (int j = 0; j < 3; j++) {
        const int k = miss ? 2 - j : j; /* pushed at the front: last one first */
        if (!expert_tensor(c->m, (uint32_t)v->layer, k)) continue; /* up, fused into gate_up */
        MOE_CHECK(c->q_len < QUEUE_MAX);
        if (miss) c->q_head = (c->q_head + QUEUE_MAX - 1) % QUEUE_MAX;
        c->queue[miss ? c->q_head : (c->q_head + c->q_len) % QUEUE_MAX] = 3 * s + k;
        c->q_len++;
        v->loading++;
    }
    c->n_loading++;
    pthread_cond_broadcast(&c->work);
}

/* ==== Slots ==== */

/* A slot for a new expert: an empty one, else the unpinned one used least (least recently among
 * equals); -1 when every slot is pinned. */
static int32_t victim(const moe_expert_cache *c) {
    int32_t best = -1;
    uint64_t best_uses = UINT64_MAX, best_use = UINT64_MAX;
    for (uint32_t i = 0; i < c->n_slots; i++) {
        const slot *s = &c->slots[i];
        if (s->layer < 0) return (int32_t)i;
        if (s->pinned || s->loading) continue;
        const uint64_t uses =
            c->uses[(uint64_t)s->layer * c->m->cfg.n_expert + (uint32_t)s->expert];
        if (uses < best_uses || (uses == best_uses && s->last_use < best_use)) {
            best = (int32_t)i;
            best_uses = uses;
            best_use = s->last_use;
        }
    }
    return best;
}

static void view_of(const moe_expert_cache *c, uint32_t il, int32_t slot_id, moe_tensor *views) {
    const uint8_t *p = c->mem + (uint64_t)slot_id * c->slot_bytes;
    for (int k = 0; k < 3; k++) {
        const moe_tensor *t = expert_tensor(c->m, il, k);
        if (!t) { /* up, fused into gate_up: the dispatch does not read it */
            views[k] = (moe_tensor){0};
            continue;
        }
        views[k] = *t;
        views[k].ne[2] = 1;
        views[k].n_values = (uint64_t)t->ne[0] * (uint64_t)t->ne[1];
        views[k].n_bytes = slice_bytes(t);
        views[k].data = p;
        views[k].layout = MOE_LAYOUT_FILE; /* read from the file as it lies */
        p += views[k].n_bytes;
    }
}

/* Queue the next MoE layer's most used experts that are not resident, at most n_expert_used,
 * for the reader thread (under mu). */
static void read_ahead(moe_expert_cache *c, uint32_t il) {
    const uint32_t n_expert = c->m->cfg.n_expert;
    /* only in a cache with room to spare: a step's own experts must always find slots */
    if (c->n_slots < 4 * c->m->cfg.n_expert_used || c->n_loading >= c->n_slots / 4) return;
    uint32_t next = il + 1;
    while (next < c->n_layer && !expert_tensor(c->m, next, 0)) next++;
    if (next >= c->n_layer) return;
    const uint32_t *uses = c->uses + (uint64_t)next * n_expert;
    int32_t *slot_of = c->slot_of + (uint64_t)next * n_expert;
    for (uint32_t k = 0; k < c->m->cfg.n_expert_used && c->q_len < 3 * READ_AHEAD_MAX; k++) {
        int32_t best = -1; /* the most used not yet resident or queued */
        for (uint32_t e = 0; e < n_expert; e++)
            if (slot_of[e] < 0 && uses[e] && (best < 0 || uses[e] > uses[best])) best = (int32_t)e;
        if (best < 0) return;
        const int32_t s = victim(c);
        if (s < 0) return;
        slot *v = &c->slots[s];
        if (v->layer >= 0) { /* never throw out what is used as much for a guess */
            if (c->uses[(uint64_t)v->layer * n_expert + (uint32_t)v->expert] >= uses[best]) return;
            c->slot_of[(uint64_t)v->layer * n_expert + (uint32_t)v->expert] = -1;
            c->stats.evictions++;
        }
        *v = (slot){.layer = (int32_t)next, .expert = best, .last_use = ++c->clock};
        slot_of[best] = s;
        enqueue(c, s, false);
    }
}

/* Unpin the group's experts that still have their slots (under mu). */
static void unpin(moe_expert_cache *c, const int32_t *slot_of, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        if (slot_of[ids[i]] >= 0 && c->slots[slot_of[ids[i]]].pinned)
            c->slots[slot_of[ids[i]]].pinned--;
}

static bool acquire(void *arg, const int32_t *ids, int n, moe_tensor *views, bool *ready) {
    layer_source *ls = arg;
    moe_expert_cache *c = ls->cache;
    const uint32_t il = ls->layer, n_expert = c->m->cfg.n_expert;
    int32_t *slot_of = c->slot_of + (uint64_t)il * n_expert;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < n; i++) { /* hits first: pinned, so no miss evicts them */
        c->uses[(uint64_t)il * n_expert + (uint32_t)ids[i]]++;
        const int32_t s = slot_of[ids[i]]; /* perhaps read ahead and still arriving */
        if (s < 0) continue;
        c->slots[s].pinned++;
        c->slots[s].last_use = ++c->clock;
        c->stats.hits++;
    }
    for (int i = 0; i < n; i++) {
        if (slot_of[ids[i]] >= 0) continue;
        int32_t s = victim(c);
        while (s < 0 && c->n_loading > 0) { /* slots being read ahead: wait for one */
            const double t0 = moe_now();
            pthread_cond_wait(&c->done, &c->mu);
            c->stats.read_seconds += moe_now() - t0;
            s = victim(c);
        }
        if (s < 0) { /* cannot happen while n <= the unpinned slots (the source's max_group) */
            moe_error_set(&c->err, MOE_ERR_RANGE, "expert cache: all %u slots are in use",
                          c->n_slots);
            unpin(c, slot_of, ids, n);
            pthread_mutex_unlock(&c->mu);
            return false;
        }
        slot *v = &c->slots[s];
        if (v->layer >= 0) {
            c->slot_of[(uint64_t)v->layer * n_expert + (uint32_t)v->expert] = -1;
            c->stats.evictions++;
        }
        *v = (slot){.layer = (int32_t)il,
                    .expert = ids[i],
                    .last_use = ++c->clock,
                    .pinned = 1,
                    .wanted = true};
        slot_of[ids[i]] = s;
        enqueue(c, s, true);
        c->stats.misses++;
    }
    read_ahead(c, il);
    for (int i = 0; i < n; i++) ready[i] = !c->slots[slot_of[ids[i]]].loading;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n; i++) view_of(c, il, slot_of[ids[i]], views + 3 * i);
    return true;
}

/* Until every expert of the group has arrived; false (the error kept, the group let go) when a
 * read failed. */
static bool wait(void *arg, const int32_t *ids, int n) {
    layer_source *ls = arg;
    moe_expert_cache *c = ls->cache;
    const int32_t *slot_of = c->slot_of + (uint64_t)ls->layer * c->m->cfg.n_expert;
    pthread_mutex_lock(&c->mu);
    const double t0 = moe_now();
    for (int i = 0; i < n;) /* a failed read leaves the expert without a slot */
        if (slot_of[ids[i]] >= 0 && c->slots[slot_of[ids[i]]].loading)
            pthread_cond_wait(&c->done, &c->mu);
        else
            i++;
    c->stats.read_seconds += moe_now() - t0;
    bool ok = true;
    for (int i = 0; i < n; i++) ok = ok && slot_of[ids[i]] >= 0;
    if (!ok) unpin(c, slot_of, ids, n);
    pthread_mutex_unlock(&c->mu);
    return ok;
}

static void release(void *arg, const int32_t *ids, int n) {
    layer_source *ls = arg;
    moe_expert_cache *c = ls->cache;
    pthread_mutex_lock(&c->mu);
    unpin(c, c->slot_of + (uint64_t)ls->layer * c->m->cfg.n_expert, ids, n);
    pthread_mutex_unlock(&c->mu);
}

/* ==== Lifetime ==== */

uint64_t moe_expert_cache_slot_bytes(const moe_model *m, uint32_t n_layer_run) {
    uint64_t most = 0;
    for (uint32_t il = 0; il < n_layer_run; il++) {
        const uint64_t b = expert_bytes(m, il);
        if (b > most) most = b;
    }
    return most;
}

moe_expert_cache *moe_expert_cache_new(const moe_model *m, uint32_t n_layer_run, uint64_t bytes,
                                       moe_error *err) {
    const uint64_t slot_bytes = moe_expert_cache_slot_bytes(m, n_layer_run);
    if (!slot_bytes) {
        moe_error_set(err, MOE_ERR_ARG, "--expert-cache: %s has no routed experts",
                      m->path ? m->path : "the model");
        return NULL;
    }
    if (moe_gguf_shard_get(m->gguf, 0)->file_size == 0) { /* format/hf.c's view of a checkpoint */
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "--expert-cache: %s is converted in memory, with no file to read experts "
                      "from (moe repack makes a GGUF of it)",
                      m->path ? m->path : "the model");
        return NULL;
    }
    const uint64_t n_slots = bytes / slot_bytes;
    if (n_slots < 2 || n_slots > (uint64_t)m->cfg.n_expert * n_layer_run * 2) {
        if (n_slots < 2)
            moe_error_set(err, MOE_ERR_ARG,
                          "--expert-cache %.1f MiB holds %" PRIu64 " experts of %.2f MiB; give it "
                          "at least 2 (%.1f MiB)",
                          (double)bytes / 1048576.0, n_slots, (double)slot_bytes / 1048576.0,
                          2.0 * (double)slot_bytes / 1048576.0);
        else
            moe_error_set(err, MOE_ERR_ARG,
                          "--expert-cache %.1f MiB is more than the %u x %u experts take: load "
                          "the model whole instead",
                          (double)bytes / 1048576.0, n_layer_run, m->cfg.n_expert);
        return NULL;
    }
    moe_expert_cache *c = moe_xcalloc(1, sizeof *c);
    c->m = m;
    c->slot_bytes = slot_bytes;
    c->n_slots = (uint32_t)n_slots;
    c->n_layer = n_layer_run;
    c->mem_size = (size_t)(n_slots * slot_bytes);
    c->mem = mmap(NULL, c->mem_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (c->mem == MAP_FAILED) {
        c->mem = NULL;
        moe_error_set(err, MOE_ERR_NOMEM, "--expert-cache: cannot allocate %.1f MiB: %s",
                      (double)c->mem_size / 1048576.0, strerror(errno));
        moe_expert_cache_free(c);
        return NULL;
    }
    c->slots = moe_xcalloc(n_slots, sizeof *c->slots);
    c->slot_err = moe_xcalloc(n_slots, sizeof *c->slot_err);
    for (uint64_t i = 0; i < n_slots; i++) c->slots[i].layer = -1;
    const uint64_t n_ids = (uint64_t)n_layer_run * m->cfg.n_expert;
    c->slot_of = moe_xmalloc(n_ids * sizeof *c->slot_of);
    for (uint64_t i = 0; i < n_ids; i++) c->slot_of[i] = -1;
    c->uses = moe_xcalloc(n_ids, sizeof *c->uses);
    const uint32_t n_shards = moe_gguf_n_shards(m->gguf);
    c->fd = moe_xcalloc(n_shards, sizeof *c->fd);
    c->direct = moe_xcalloc(n_shards, sizeof *c->direct);
    for (uint32_t s = 0; s < n_shards; s++) {
        const char *path = moe_gguf_shard_get(m->gguf, s)->path;
        c->fd[s] = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        c->direct[s] = c->fd[s] >= 0;
        if (c->fd[s] < 0) c->fd[s] = open(path, O_RDONLY | O_CLOEXEC); /* e.g. tmpfs */
        if (c->fd[s] < 0) {
            moe_error_set(err, MOE_ERR_IO, "--expert-cache: cannot open %s: %s", path,
                          strerror(errno));
            moe_expert_cache_free(c);
            return NULL;
        }
    }
    uint64_t slice_max = 0;
    for (uint32_t il = 0; il < n_layer_run; il++)
        for (int k = 0; expert_tensor(m, il, 0) && k < 3; k++)
            if (slice_bytes(expert_tensor(m, il, k)) > slice_max)
                slice_max = slice_bytes(expert_tensor(m, il, k));
    c->bounce_bytes = (slice_max + 2 * DIRECT_ALIGN) / DIRECT_ALIGN * DIRECT_ALIGN;
    /* a reader per matrix of the experts a token uses (a layer's misses are read at once), 3
     * to READERS_MAX */
    const uint32_t n_used = m->cfg.n_expert_used;
    const int n_readers = 3 * n_used > READERS_MAX ? READERS_MAX : 3 * (int)n_used;
    c->bounce = aligned_alloc(DIRECT_ALIGN, (size_t)(c->bounce_bytes * (uint64_t)n_readers));
    if (!c->bounce) moe_die("out of memory (expert cache bounce buffers)");
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, NULL);
    for (; c->n_readers < n_readers; c->n_readers++)
        if (pthread_create(&c->readers[c->n_readers], NULL, reader_main, c) != 0)
            moe_die("cannot start the expert cache's reader threads");
    c->sources = moe_xcalloc(n_layer_run, sizeof *c->sources);
    for (uint32_t il = 0; il < n_layer_run; il++) {
        layer_source *ls = &c->sources[il];
        ls->cache = c;
        ls->layer = il;
        ls->source = (moe_expert_source){.acquire = acquire,
                                         .wait = wait,
                                         .release = release,
                                         .ctx = ls,
                                         .max_group = c->n_slots < MOE_MATMUL_MANY_MAX / 2
                                                          ? (int)c->n_slots
                                                          : MOE_MATMUL_MANY_MAX / 2};
    }
    return c;
}

void moe_expert_cache_free(moe_expert_cache *c) {
    if (!c) return;
    if (c->n_readers) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->work);
        pthread_mutex_unlock(&c->mu);
        for (int i = 0; i < c->n_readers; i++) pthread_join(c->readers[i], NULL);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->work);
        pthread_cond_destroy(&c->done);
    }
    if (c->mem) munmap(c->mem, c->mem_size);
    for (uint32_t s = 0; c->fd && s < moe_gguf_n_shards(c->m->gguf); s++)
        if (c->fd[s] > 0) close(c->fd[s]);
    free(c->fd);
    free(c->direct);
    free(c->bounce);
    free(c->slots);
    free(c->slot_err);
    free(c->slot_of);
    free(c->uses);
    free(c->sources);
    free(c);
}

/* ==== Use statistics and pins ==== */

#define STATS_MAGIC "moe-expert-stats 1"

/* Read (layer, expert) pairs into pairs[] (at most max): a stats file's lines "L E COUNT" after
 * its header (counts into uses), or a pin list's "L E" / "L:E" lines ('#' comments). */
static bool read_pairs(moe_expert_cache *c, const char *path, bool stats, uint32_t *pairs,
                       uint32_t max, uint32_t *n, moe_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) {
        if (stats && errno == ENOENT) return true; /* no statistics yet: a cold start */
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", path, strerror(errno)) == MOE_OK;
    }
    char line[256];
    uint32_t n_layer = 0, n_expert = 0, line_no = 0;
    bool ok = true;
    *n = 0;
    if (stats && (!fgets(line, sizeof line, f) || strncmp(line, STATS_MAGIC, strlen(STATS_MAGIC)) ||
                  sscanf(line + strlen(STATS_MAGIC), "%u %u", &n_layer, &n_expert) != 2 ||
                  n_layer != c->n_layer || n_expert != c->m->cfg.n_expert)) {
        moe_log(MOE_LOG_WARN,
                "%s: not expert statistics of this model (%u layers x %u experts); "
                "starting cold",
                path, c->n_layer, c->m->cfg.n_expert);
        fclose(f);
        return true;
    }
    while (ok && fgets(line, sizeof line, f)) {
        line_no++;
        char *p = line + strspn(line, " \t");
        if (*p == '#' || *p == '\n' || !*p) continue;
        unsigned layer, expert, count = 0;
        const int got = sscanf(p, stats ? "%u %u %u" : "%u%*[ :]%u", &layer, &expert, &count);
        if (got < 2 || layer >= c->n_layer || expert >= c->m->cfg.n_expert ||
            !expert_tensor(c->m, layer, 0)) {
            ok = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s:%u: expected 'LAYER EXPERT%s' of a MoE layer (< %u) and an "
                               "expert (< %u)",
                               path, stats ? line_no + 1 : line_no, stats ? " COUNT" : "",
                               c->n_layer, c->m->cfg.n_expert) == MOE_OK;
            break;
        }
        if (stats) c->uses[(uint64_t)layer * c->m->cfg.n_expert + expert] = count;
        if (*n < max) pairs[(*n)++] = layer * c->m->cfg.n_expert + expert;
    }
    fclose(f);
    return ok;
}

/* Read the experts ids[0..n) (layer * n_expert + expert, by layer) into free slots; pinned for
 * good when `pin`. */
static bool preload(moe_expert_cache *c, const uint32_t *ids, uint32_t n, bool pin,
                    moe_error *err) {
    const uint32_t n_expert = c->m->cfg.n_expert;
    for (uint32_t i = 0; i < n;) {
        /* one layer's run of experts at a time (acquire reads a layer's misses in parallel) */
        const uint32_t layer = ids[i] / n_expert;
        int32_t group[MOE_MATMUL_MANY_MAX / 2];
        int k = 0;
        for (; i < n && ids[i] / n_expert == layer && k < c->sources[layer].source.max_group; i++)
            if (c->slot_of[ids[i]] < 0) group[k++] = (int32_t)(ids[i] % n_expert);
        if (!k) continue;
        moe_tensor views[3 * (MOE_MATMUL_MANY_MAX / 2)];
        bool ready[MOE_MATMUL_MANY_MAX / 2];
        if (!acquire(&c->sources[layer], group, k, views, ready) ||
            !wait(&c->sources[layer], group, k)) {
            moe_expert_cache_take_error(c, err);
            return false;
        }
        release(&c->sources[layer], group, k);
        for (int g = 0; g < k; g++) c->uses[(uint64_t)layer * n_expert + (uint32_t)group[g]]--;
        for (int g = 0; pin && g < k; g++)
            c->slots[c->slot_of[(uint64_t)layer * n_expert + (uint32_t)group[g]]].pinned = 1 << 20;
    }
    return true;
}

static int cmp_uses_desc(const void *a, const void *b, void *uses) {
    const uint32_t *u = uses, x = u[*(const uint32_t *)a], y = u[*(const uint32_t *)b];
    return x > y ? -1 : x < y;
}

bool moe_expert_cache_prepare(moe_expert_cache *c, const char *stats_path, const char *pin_path,
                              moe_error *err) {
    const uint64_t n_ids = (uint64_t)c->n_layer * c->m->cfg.n_expert;
    uint32_t *ids = moe_xcalloc(n_ids + 1, sizeof *ids), n = 0;
    bool ok = true;
    if (pin_path) { /* pinned first: they take their slots for good */
        ok = read_pairs(c, pin_path, false, ids, (uint32_t)n_ids, &n, err);
        if (ok && n + 2 > c->n_slots)
            ok = moe_error_set(err, MOE_ERR_ARG,
                               "%s pins %u experts; the cache holds %u and needs 2 free", pin_path,
                               n, c->n_slots) == MOE_OK;
        if (ok) ok = preload(c, ids, n, true, err);
        uint32_t n_pinned = 0; /* a group must find its slots among the others */
        for (uint32_t i = 0; i < c->n_slots; i++) n_pinned += c->slots[i].pinned > 0;
        for (uint32_t il = 0; il < c->n_layer; il++)
            if (c->sources[il].source.max_group > (int)(c->n_slots - n_pinned))
                c->sources[il].source.max_group = (int)(c->n_slots - n_pinned);
    }
    if (ok && stats_path) { /* then the experts used most, while there is room */
        ok = read_pairs(c, stats_path, true, ids, (uint32_t)n_ids, &n, err);
        n = 0;
        for (uint64_t i = 0; ok && i < n_ids; i++)
            if (c->uses[i] && expert_tensor(c->m, (uint32_t)(i / c->m->cfg.n_expert), 0))
                ids[n++] = (uint32_t)i;
        qsort_r(ids, n, sizeof *ids, cmp_uses_desc, c->uses);
        uint32_t free_slots = 0;
        for (uint32_t i = 0; i < c->n_slots; i++) free_slots += c->slots[i].layer < 0;
        if (n > free_slots) n = free_slots;
        /* by layer, so each layer's experts are read together */
        for (uint32_t i = 1; i < n; i++)
            for (uint32_t k = i; k > 0 && ids[k - 1] > ids[k]; k--) {
                const uint32_t t = ids[k];
                ids[k] = ids[k - 1];
                ids[k - 1] = t;
            }
        if (ok) ok = preload(c, ids, n, false, err);
    }
    free(ids);
    if (ok) c->stats_path = stats_path; /* never overwrite a file that could not be read */
    pthread_mutex_lock(&c->mu);
    c->stats = (moe_expert_cache_stats){0}; /* count from the first step */
    pthread_mutex_unlock(&c->mu);
    return ok;
}

bool moe_expert_cache_save_stats(const moe_expert_cache *c, moe_error *err) {
    if (!c->stats_path) return true;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", c->stats_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return moe_error_set(err, MOE_ERR_IO, "%s: %s", tmp, strerror(errno)) == MOE_OK;
    fprintf(f, "%s %u %u\n", STATS_MAGIC, c->n_layer, c->m->cfg.n_expert);
    for (uint64_t i = 0; i < (uint64_t)c->n_layer * c->m->cfg.n_expert; i++)
        if (c->uses[i])
            fprintf(f, "%u %u %u\n", (unsigned)(i / c->m->cfg.n_expert),
                    (unsigned)(i % c->m->cfg.n_expert), c->uses[i]);
    const bool ok = fclose(f) == 0 && rename(tmp, c->stats_path) == 0;
    if (!ok) moe_error_set(err, MOE_ERR_IO, "%s: %s", c->stats_path, strerror(errno));
    return ok;
}

const moe_expert_source *moe_expert_cache_source(moe_expert_cache *c, uint32_t il) {
    return &c->sources[il].source;
}

bool moe_expert_cache_take_error(moe_expert_cache *c, moe_error *err) {
    if (!c->err.code) return false;
    *err = c->err;
    c->err = (moe_error){0};
    return true;
}

moe_expert_cache_stats moe_expert_cache_stats_of(moe_expert_cache *c) {
    pthread_mutex_lock(&c->mu);
    moe_expert_cache_stats s = c->stats;
    pthread_mutex_unlock(&c->mu);
    s.slots = c->n_slots;
    s.slot_bytes = c->slot_bytes;
    s.direct = c->direct[0];
    return s;
}
