/* disk_cache.c: the disk prefix cache -- sequences saved as files, found again by their token
 * prefix, loaded back into a sequence (the rules are in engine.h).
 *
 * Owns the directory's index (every entry's name, size and last use; the token ids of this
 * context's own entries) and one thread for the disk. The engine thread finds entries and queues
 * loads and saves; the cache's thread does them, loads first: a save gathers straight from the
 * context's K/V rows and writes NAME.PID.tmp, renamed when complete (so an entry that exists is
 * whole unless the disk damaged it -- which the checksums catch); a load reads and checks each
 * chunk and puts its rows straight into the sequence. The scheduler leaves a sequence with a
 * queued job alone; the engine thread commits a finished load (length, token ids, recurrent
 * state) itself.
 *
 * An entry file (little-endian, this machine's layout; the identity pins the rest):
 *   entry_header                     fixed, below
 *   int32  tokens[n_tokens]
 *   uint64 chunk_sum[n_chunks]       moe_hash64 of each chunk of the payload
 *   payload: chunks of DISK_CHUNK_TOKENS positions; in a chunk of m positions, for each trunk
 *            attention layer in order, for each KV head its m K rows, for each its m V rows (the
 *            context's KV type, one head's values a row; MLA: the latent rows, no V) and its m
 *            indexer rows (sparse MLA; f32)
 *   state:   the recurrent state after n_tokens tokens (hybrids; state_sum)
 * header_sum covers the fixed header (header_sum itself as 0), the tokens and the chunk sums.
 * Chunks let a load read and check only the positions it needs.
 *
 * The trap: an entry's name (a hash) is not proof of its tokens. find() compares the token ids
 * read from the entry, and load() compares them again from the file it opened. */
#include "engine_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../format/format.h"
#include "../quant/quant.h"

#define DISK_MAGIC           "MOEPFX01"
#define DISK_VERSION         3 /* 3: K / V rows per KV head; 2: the delta rule's state [d_k][d_v] */
#define DISK_CHUNK_TOKENS    64     /* positions per checksummed chunk: the unit a load reads */
#define DISK_SUFFIX          ".kvc" /* entries; NAME.PID.tmp while being written */
#define DISK_TMP_STALE_S     600    /* a .tmp older than this is a crashed writer's: removed */
#define DISK_HEADER_HASH_MAX (256u << 20) /* GGUF header bytes hashed into the identity */

typedef struct entry_header {
    char magic[8];
    uint32_t version, chunk_tokens;
    uint32_t n_tokens, n_chunks;
    uint64_t identity, key;
    uint64_t pos_bytes;   /* payload bytes per position (all trunk attention layers, K + V) */
    uint64_t state_bytes; /* recurrent state bytes (0: no linear layers) */
    uint64_t header_bytes, file_bytes;
    uint64_t state_sum, header_sum;
} entry_header;
_Static_assert(sizeof(entry_header) == 88, "entry_header is a file layout");

typedef struct entry {
    char name[64];
    uint64_t identity, bytes;
    int64_t used;    /* last use, ns since the epoch (the file's mtime at start-up) */
    uint32_t n;      /* tokens (own entries) */
    int32_t *tokens; /* own entries only, else NULL */
} entry;

/* A save (seq's first n tokens to a new entry) or a load (entry `name` into seq, which holds
 * `have` tokens already, up to n). */
typedef struct job {
    struct job *next;
    bool load;
    int32_t seq;
    uint32_t n, have;
    uint64_t key;    /* save: the entry's key */
    int32_t *tokens; /* [n] the tokens saved, or the caller's (a load checks the entry's) */
    float *state;    /* hybrids: the recurrent state after n tokens (save: copied; load: read) */
    char name[64];   /* load: the entry */
    bool done;       /* load: finished (under mu); err says how */
    moe_error err;
} job;

typedef struct job_queue {
    job *head, *tail;
} job_queue;

static void queue_push(job_queue *q, job *j) {
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
}

static job *queue_pop(job_queue *q) {
    job *j = q->head;
    if (j) {
        q->head = j->next;
        if (!q->head) q->tail = NULL;
    }
    return j;
}

static void job_free(job *j) {
    free(j->tokens);
    free(j->state);
    free(j);
}

struct moe_disk_cache {
    moe_ctx *c;
    char *dir;
    uint64_t identity, max_bytes;
    uint32_t n_kv;       /* trunk attention layers */
    uint32_t *kv_layers; /* [n_kv] their layer indices */
    uint64_t *idx_bytes; /* [n_kv] bytes of a layer's indexer row per position (0: none) */
    uint64_t pos_bytes, state_bytes;
    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;  /* a job queued, a job done, stop */
    entry *entries;
    size_t n_entries, cap_entries;
    uint64_t total_bytes;
    job_queue loads, saves; /* loads go first: a request waits for them */
    uint32_t *busy;         /* [n_seq] queued jobs per sequence */
    job **loading;          /* [n_seq] the load into each sequence, until load_end takes it */
    void (*notify)(void *); /* called when a load is done */
    void *notify_arg;
    bool stop;
    moe_disk_cache_stats stats;
    pthread_t writer;
    bool writer_started;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void entry_path(const moe_disk_cache *d, const char *name, char *out, size_t size) {
    snprintf(out, size, "%s/%s", d->dir, name);
}

/* ==== Identity ==== */

/* The model file (every shard: size, mtime, GGUF header bytes) and the settings that change
 * what a row holds: KV type, context size, row layout, kernel table, MOE_EXACT. */
static moe_status identity_of(moe_disk_cache *d, moe_error *err) {
    const moe_ctx *c = d->c;
    uint64_t h = moe_hash64(DISK_MAGIC, 8, DISK_VERSION);
    const char *kernels = moe_kernels_get()->name;
    h = moe_hash64(kernels, strlen(kernels), h);
    const char *exact = getenv("MOE_EXACT");
    if (exact) h = moe_hash64(exact, strlen(exact), h ^ 1);
    const uint64_t settings[7] = {(uint64_t)c->p.kv_type, c->p.n_ctx, c->k_row_bytes,
                                  c->v_row_bytes,         d->n_kv,    d->pos_bytes,
                                  d->state_bytes};
    h = moe_hash64(settings, sizeof settings, h);
    const moe_gguf *g = c->m->gguf;
    for (uint32_t i = 0; i < moe_gguf_n_shards(g); i++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(g, i);
        if (moe_path_is_url(sh->path))
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "disk cache: %s is a URL; the cache needs a local model file",
                                 sh->path);
        struct stat st;
        const int fd = open(sh->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) != 0) {
            if (fd >= 0) close(fd);
            return moe_error_set(err, MOE_ERR_IO, "disk cache: %s: %s", sh->path, strerror(errno));
        }
        const uint64_t facts[3] = {(uint64_t)st.st_size, (uint64_t)st.st_mtim.tv_sec,
                                   (uint64_t)st.st_mtim.tv_nsec};
        h = moe_hash64(facts, sizeof facts, h);
        const size_t n = sh->header_bytes < DISK_HEADER_HASH_MAX ? (size_t)sh->header_bytes
                                                                 : DISK_HEADER_HASH_MAX;
        uint8_t *buf = moe_xmalloc(n ? n : 1);
        const ssize_t got = pread(fd, buf, n, 0);
        close(fd);
        if (got != (ssize_t)n) {
            free(buf);
            return moe_error_set(err, MOE_ERR_IO, "disk cache: cannot read the header of %s",
                                 sh->path);
        }
        h = moe_hash64(buf, n, h);
        free(buf);
    }
    d->identity = h;
    return MOE_OK;
}

static uint64_t key_of(const moe_disk_cache *d, const int32_t *tokens, uint32_t n) {
    return moe_hash64(tokens, (size_t)n * sizeof *tokens, d->identity);
}

/* ==== The index (under d->mu) ==== */

static entry *index_find(moe_disk_cache *d, const char *name) {
    for (size_t i = 0; i < d->n_entries; i++)
        if (strcmp(d->entries[i].name, name) == 0) return &d->entries[i];
    return NULL;
}

static entry *index_add(moe_disk_cache *d, const entry *e) {
    if (d->n_entries == d->cap_entries) {
        d->cap_entries = d->cap_entries ? 2 * d->cap_entries : 64;
        d->entries = moe_xrealloc(d->entries, d->cap_entries * sizeof *d->entries);
    }
    d->entries[d->n_entries] = *e;
    d->total_bytes += e->bytes;
    return &d->entries[d->n_entries++];
}

/* Drop entry e from the index (its file stays). */
static void index_forget(moe_disk_cache *d, entry *e) {
    d->total_bytes -= e->bytes;
    free(e->tokens);
    *e = d->entries[--d->n_entries];
}

/* Remove entry e from the index and its file from the directory. */
static void index_remove(moe_disk_cache *d, entry *e) {
    char path[4096];
    entry_path(d, e->name, path, sizeof path);
    unlink(path);
    index_forget(d, e);
}

static void index_remove_name(moe_disk_cache *d, const char *name) {
    entry *e = index_find(d, name);
    if (e) index_remove(d, e);
}

/* Least recently used first, until the directory fits. */
static void index_trim(moe_disk_cache *d) {
    while (d->total_bytes > d->max_bytes && d->n_entries) {
        size_t lru = 0;
        for (size_t i = 1; i < d->n_entries; i++)
            if (d->entries[i].used < d->entries[lru].used) lru = i;
        index_remove(d, &d->entries[lru]);
        d->stats.evicted++;
    }
}

static void touch(moe_disk_cache *d, entry *e) {
    e->used = now_ns();
    char path[4096];
    entry_path(d, e->name, path, sizeof path);
    utimensat(AT_FDCWD, path, NULL, 0); /* the order survives a restart */
}

/* ==== Reading an entry ==== */

static bool read_at(int fd, void *buf, size_t n, uint64_t off) {
    uint8_t *p = buf;
    while (n) {
        const ssize_t got = pread(fd, p, n, (off_t)off);
        if (got <= 0) return false;
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return true;
}

static uint32_t chunks_of(uint32_t n) {
    return (n + DISK_CHUNK_TOKENS - 1) / DISK_CHUNK_TOKENS;
}

static uint64_t header_bytes_of(uint32_t n) {
    return sizeof(entry_header) + (uint64_t)n * sizeof(int32_t) +
           (uint64_t)chunks_of(n) * sizeof(uint64_t);
}

static uint64_t header_sum_of(const entry_header *h, const int32_t *tokens, const uint64_t *sums) {
    entry_header z = *h;
    z.header_sum = 0;
    uint64_t s = moe_hash64(&z, sizeof z, 0);
    s = moe_hash64(tokens, (size_t)h->n_tokens * sizeof *tokens, s);
    return moe_hash64(sums, (size_t)h->n_chunks * sizeof *sums, s);
}

/* An own entry's header, token ids and chunk sums, every field checked against this context
 * and the file's real size (a truncated file fails here). */
static moe_status read_header(moe_disk_cache *d, int fd, const char *name, entry_header *h,
                              int32_t **tokens, uint64_t **sums, moe_error *err) {
    *tokens = NULL;
    *sums = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || !read_at(fd, h, sizeof *h, 0))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: shorter than its header", name);
    if (memcmp(h->magic, DISK_MAGIC, 8) != 0 || h->version != DISK_VERSION)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: not a moe cache entry of version %d", name,
                             DISK_VERSION);
    if (h->identity != d->identity || h->chunk_tokens != DISK_CHUNK_TOKENS || h->n_tokens == 0 ||
        h->n_tokens > d->c->p.n_ctx || h->n_chunks != chunks_of(h->n_tokens) ||
        h->pos_bytes != d->pos_bytes || h->state_bytes != d->state_bytes ||
        h->header_bytes != header_bytes_of(h->n_tokens) ||
        h->file_bytes != h->header_bytes + (uint64_t)h->n_tokens * d->pos_bytes + d->state_bytes)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: header fields do not fit this model", name);
    if ((uint64_t)st.st_size != h->file_bytes)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: %lld bytes, its header says %" PRIu64, name,
                             (long long)st.st_size, h->file_bytes);
    *tokens = moe_xmalloc((size_t)h->n_tokens * sizeof **tokens);
    *sums = moe_xmalloc((size_t)h->n_chunks * sizeof **sums);
    if (!read_at(fd, *tokens, (size_t)h->n_tokens * sizeof **tokens, sizeof *h) ||
        !read_at(fd, *sums, (size_t)h->n_chunks * sizeof **sums,
                 sizeof *h + (uint64_t)h->n_tokens * sizeof **tokens))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: cannot read its token ids", name);
    if (header_sum_of(h, *tokens, *sums) != h->header_sum)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: header checksum mismatch", name);
    if (key_of(d, *tokens, h->n_tokens) != h->key)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: its token ids do not match its key", name);
    char want[64];
    snprintf(want, sizeof want, "%016" PRIx64 "-%016" PRIx64 DISK_SUFFIX, h->identity, h->key);
    if (strcmp(want, name) != 0)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: named unlike its contents (%s)", name, want);
    return MOE_OK;
}

/* One directory entry at start-up: own entries checked and indexed with their tokens, other
 * identities' indexed by size only, damaged ones and stale temporaries removed. */
static void scan_one(moe_disk_cache *d, const char *name) {
    char path[4096];
    entry_path(d, name, path, sizeof path);
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) return;
    const size_t len = strlen(name);
    if (len > 4 && strcmp(name + len - 4, ".tmp") == 0) {
        if (time(NULL) - st.st_mtim.tv_sec > DISK_TMP_STALE_S) unlink(path);
        return;
    }
    uint64_t ident, key;
    char tail[8];
    if (len >= sizeof((entry *)0)->name ||
        sscanf(name, "%16" SCNx64 "-%16" SCNx64 "%7s", &ident, &key, tail) != 3 ||
        strcmp(tail, DISK_SUFFIX) != 0)
        return; /* not ours to judge */
    entry e = {.identity = ident,
               .bytes = (uint64_t)st.st_size,
               .used = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec};
    snprintf(e.name, sizeof e.name, "%s", name);
    if (ident == d->identity) {
        moe_error err = {0};
        entry_header h;
        uint64_t *sums = NULL;
        const int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return;
        const moe_status st2 = read_header(d, fd, name, &h, &e.tokens, &sums, &err);
        close(fd);
        free(sums);
        if (st2 != MOE_OK) {
            moe_log(MOE_LOG_WARN, "disk cache: removing %s", err.msg);
            free(e.tokens);
            unlink(path);
            d->stats.corrupt++;
            return;
        }
        e.n = h.n_tokens;
    }
    index_add(d, &e);
}

static moe_status scan(moe_disk_cache *d, moe_error *err) {
    DIR *dir = opendir(d->dir);
    if (!dir) return moe_error_set(err, MOE_ERR_IO, "disk cache: %s: %s", d->dir, strerror(errno));
    struct dirent *de;
    while ((de = readdir(dir)))
        if (de->d_name[0] != '.') scan_one(d, de->d_name);
    closedir(dir);
    index_trim(d);
    return MOE_OK;
}

/* ==== Rows: where a position's K/V lives, in the context and in a chunk ==== */

/* Copy positions [lo, hi) of seq between the context and a chunk that starts at position p0
 * and holds m positions; to_ctx: chunk -> context. A chunk holds, per trunk attention layer,
 * each KV head's m K rows, each one's m V rows and m indexer rows (sparse MLA), as the context
 * lays them out (moe_kv_span_of). */
static void chunk_rows(moe_disk_cache *d, int32_t seq, uint8_t *chunk, uint32_t p0, uint32_t m,
                       uint32_t lo, uint32_t hi, bool to_ctx) {
    moe_ctx *c = d->c;
    const uint64_t n = hi - lo, skip = lo - p0;
    uint8_t *run = chunk; /* the chunk's next run of m rows */
    for (uint32_t i = 0; i < d->n_kv; i++) {
        const uint32_t l = d->kv_layers[i];
        for (int v = 0; v < 2; v++) {
            const moe_kv_span s = moe_kv_span_of(c, v, seq, l);
            for (uint32_t h = 0; h < s.n_head; h++, run += m * s.stride) {
                uint8_t *at = run + skip * s.stride, *ctx = s.at + h * s.head + lo * s.stride;
                memcpy(to_ctx ? ctx : at, to_ctx ? at : ctx, n * s.stride);
            }
        }
        const uint64_t ib = d->idx_bytes[i];
        if (!ib) continue;
        uint8_t *at = run + skip * ib, *ctx = (uint8_t *)moe_indexer_row(c, seq, l, lo);
        memcpy(to_ctx ? ctx : at, to_ctx ? at : ctx, n * ib);
        run += m * ib;
    }
}

/* ==== Loading ==== */

uint32_t moe_disk_cache_find(moe_disk_cache *d, const int32_t *tokens, uint32_t n,
                             moe_disk_hit *hit) {
    memset(hit, 0, sizeof *hit);
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < d->n_entries; i++) {
        const entry *e = &d->entries[i];
        if (!e->tokens) continue;
        const uint32_t m = e->n < n ? e->n : n;
        uint32_t lcp = 0;
        while (lcp < m && e->tokens[lcp] == tokens[lcp]) lcp++;
        /* with linear layers the state exists only after all of the entry's tokens */
        const uint32_t usable = d->state_bytes ? (lcp == e->n ? lcp : 0) : lcp;
        if (usable > hit->n) {
            hit->n = usable;
            snprintf(hit->name, sizeof hit->name, "%s", e->name);
        }
    }
    pthread_mutex_unlock(&d->mu);
    return hit->n;
}

/* The entry's chunks from the one holding position `from` up to position `to`, each checked,
 * into seq's rows; then (hybrids) its recurrent state into *state (malloc'd). */
static moe_status load_rows(moe_disk_cache *d, int fd, const char *name, const entry_header *h,
                            const uint64_t *sums, int32_t seq, uint32_t from, uint32_t to,
                            float **state, moe_error *err) {
    uint8_t *buf = moe_xmalloc(DISK_CHUNK_TOKENS * d->pos_bytes + 1);
    moe_status st = MOE_OK;
    for (uint32_t k = from / DISK_CHUNK_TOKENS; k < chunks_of(to) && st == MOE_OK; k++) {
        const uint32_t p0 = k * DISK_CHUNK_TOKENS;
        const uint32_t m =
            h->n_tokens - p0 < DISK_CHUNK_TOKENS ? h->n_tokens - p0 : DISK_CHUNK_TOKENS;
        const uint64_t bytes = (uint64_t)m * d->pos_bytes;
        if (!read_at(fd, buf, bytes, h->header_bytes + (uint64_t)p0 * d->pos_bytes))
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: chunk %u cannot be read", name, k);
        else if (moe_hash64(buf, bytes, k) != sums[k])
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s: chunk %u checksum mismatch", name, k);
        else
            chunk_rows(d, seq, buf, p0, m, p0 > from ? p0 : from, p0 + m < to ? p0 + m : to, true);
    }
    free(buf);
    *state = NULL;
    if (st != MOE_OK || !d->state_bytes) return st;
    *state = moe_xmalloc(d->state_bytes);
    const uint64_t off = h->header_bytes + (uint64_t)h->n_tokens * d->pos_bytes;
    if (!read_at(fd, *state, d->state_bytes, off))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: its recurrent state cannot be read", name);
    if (moe_hash64(*state, d->state_bytes, h->n_tokens) != h->state_sum)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: recurrent state checksum mismatch", name);
    return MOE_OK;
}

/* A load job on the cache's thread: the entry's rows past what seq holds straight into seq's rows
 * (the scheduler leaves seq alone meanwhile), its recurrent state into j->state. A damaged entry
 * is removed. Nothing else of the context is touched: the engine thread commits. */
static void run_load(moe_disk_cache *d, job *j) {
    char path[4096];
    entry_path(d, j->name, path, sizeof path);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    bool gone = fd < 0, damaged = false;
    if (gone) {
        moe_error_set(&j->err, MOE_ERR_IO, "disk cache: %s: %s", j->name, strerror(errno));
    } else {
        entry_header h;
        int32_t *ftok = NULL;
        uint64_t *sums = NULL;
        damaged = read_header(d, fd, j->name, &h, &ftok, &sums, &j->err) != MOE_OK;
        if (!damaged && (h.n_tokens < j->n || (d->state_bytes && h.n_tokens != j->n) ||
                         memcmp(ftok, j->tokens, (size_t)j->n * sizeof *ftok) != 0))
            moe_error_set(&j->err, MOE_ERR_ARG,
                          "disk cache: %s holds other tokens than its index said (not used)",
                          j->name);
        else if (!damaged)
            damaged = load_rows(d, fd, j->name, &h, sums, j->seq, j->have, j->n, &j->state,
                                &j->err) != MOE_OK;
        close(fd);
        free(ftok);
        free(sums);
    }
    pthread_mutex_lock(&d->mu);
    if (gone || damaged) index_remove_name(d, j->name);
    if (damaged) {
        moe_error_prefix(&j->err, "disk cache: removed");
        d->stats.corrupt++;
    }
    j->done = true;
    d->busy[j->seq]--;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    if (d->notify) d->notify(d->notify_arg);
}

moe_status moe_disk_cache_load_begin(moe_disk_cache *d, int32_t seq, const moe_disk_hit *hit,
                                     const int32_t *tokens, uint32_t n, moe_error *err) {
    moe_ctx *c = d->c;
    if (seq < 0 || (uint32_t)seq >= c->p.n_seq)
        return moe_error_set(err, MOE_ERR_ARG, "disk cache: sequence %d out of range", seq);
    const uint32_t have = c->seq_len[seq];
    if (hit->n <= have || hit->n > n || d->loading[seq])
        return moe_error_set(err, MOE_ERR_ARG, "disk cache: %u tokens from %s do not extend %u",
                             hit->n, hit->name, have);
    job *j = moe_xcalloc(1, sizeof *j);
    j->load = true;
    j->seq = seq;
    j->n = hit->n;
    j->have = have;
    j->tokens = moe_xmalloc((size_t)hit->n * sizeof *tokens);
    memcpy(j->tokens, tokens, (size_t)hit->n * sizeof *tokens);
    snprintf(j->name, sizeof j->name, "%s", hit->name);
    pthread_mutex_lock(&d->mu);
    d->loading[seq] = j;
    d->busy[seq]++;
    queue_push(&d->loads, j);
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return MOE_OK;
}

bool moe_disk_cache_load_end(moe_disk_cache *d, int32_t seq, moe_error *err) {
    moe_ctx *c = d->c;
    pthread_mutex_lock(&d->mu);
    job *j = d->loading[seq];
    const bool done = j && j->done;
    if (done) d->loading[seq] = NULL;
    pthread_mutex_unlock(&d->mu);
    if (!done) return false;
    if (!j->err.code) {
        /* rows past `have` are in place: seq now holds the entry's first n tokens */
        memcpy(c->tokens + (uint64_t)seq * c->p.n_ctx + j->have, j->tokens + j->have,
               (size_t)(j->n - j->have) * sizeof *j->tokens);
        c->seq_len[seq] = j->n;
        c->verify_rows[seq] = 0;
        if (j->state) memcpy(moe_linear_seq_state(c, seq), j->state, d->state_bytes);
        pthread_mutex_lock(&d->mu);
        entry *e = index_find(d, j->name);
        if (e) touch(d, e);
        d->stats.hits++;
        d->stats.hit_tokens += j->n;
        pthread_mutex_unlock(&d->mu);
    } else {
        *err = j->err;
    }
    job_free(j);
    return true;
}

/* ==== Saving ==== */

/* The recurrent state of seq after its first n tokens: its live state, or a snapshot's. */
static const float *state_at(const moe_ctx *c, int32_t seq, uint32_t n) {
    if (n == c->seq_len[seq]) return moe_linear_seq_state(c, seq);
    for (uint32_t i = 0; i < c->p.n_snapshots; i++)
        if (c->snaps[i].seq == seq && c->snaps[i].pos == n)
            return c->snap_state + (uint64_t)i * c->lin.n_layer * c->lin.layer_floats;
    return NULL;
}

/* An own entry already gives these tokens (the same ones; without linear layers, any that
 * extend them). */
static entry *covering(moe_disk_cache *d, const int32_t *tokens, uint32_t n) {
    for (size_t i = 0; i < d->n_entries; i++) {
        entry *e = &d->entries[i];
        if (e->tokens && (e->n == n || (!d->state_bytes && e->n > n)) &&
            memcmp(e->tokens, tokens, (size_t)n * sizeof *tokens) == 0)
            return e;
    }
    return NULL;
}

bool moe_disk_cache_save(moe_disk_cache *d, int32_t seq, uint32_t n) {
    moe_ctx *c = d->c;
    if (seq < 0 || (uint32_t)seq >= c->p.n_seq || n == 0 || n > c->seq_len[seq]) return false;
    const float *state = d->state_bytes ? state_at(c, seq, n) : NULL;
    if (d->state_bytes && !state) return false;
    if (header_bytes_of(n) + (uint64_t)n * d->pos_bytes + d->state_bytes > d->max_bytes)
        return false;
    const int32_t *tokens = c->tokens + (uint64_t)seq * c->p.n_ctx;
    pthread_mutex_lock(&d->mu);
    entry *e = covering(d, tokens, n);
    if (e) {
        touch(d, e);
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    pthread_mutex_unlock(&d->mu);
    job *j = moe_xcalloc(1, sizeof *j);
    j->seq = seq;
    j->n = n;
    j->tokens = moe_xmalloc((size_t)n * sizeof *tokens);
    memcpy(j->tokens, tokens, (size_t)n * sizeof *tokens);
    j->key = key_of(d, tokens, n);
    if (state) {
        j->state = moe_xmalloc(d->state_bytes);
        memcpy(j->state, state, d->state_bytes);
    }
    pthread_mutex_lock(&d->mu);
    d->busy[seq]++;
    queue_push(&d->saves, j);
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return true;
}

/* Write the job's entry as NAME.PID.tmp and rename it; the writer thread, outside the lock.
 * The rows come straight from the context: the scheduler leaves the sequence alone. */
static moe_status write_entry(moe_disk_cache *d, const job *j, const char *name, uint64_t *bytes,
                              moe_error *err) {
    char path[4096], tmp[4200];
    entry_path(d, name, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return moe_error_set(err, MOE_ERR_IO, "%s: %s", tmp, strerror(errno));
    entry_header h = {.version = DISK_VERSION,
                      .chunk_tokens = DISK_CHUNK_TOKENS,
                      .n_tokens = j->n,
                      .n_chunks = chunks_of(j->n),
                      .identity = d->identity,
                      .key = j->key,
                      .pos_bytes = d->pos_bytes,
                      .state_bytes = d->state_bytes,
                      .header_bytes = header_bytes_of(j->n)};
    memcpy(h.magic, DISK_MAGIC, 8);
    h.file_bytes = h.header_bytes + (uint64_t)j->n * d->pos_bytes + d->state_bytes;
    uint64_t *sums = moe_xmalloc((size_t)h.n_chunks * sizeof *sums);
    uint8_t *buf = moe_xmalloc(DISK_CHUNK_TOKENS * d->pos_bytes + 1);
    bool ok = true;
    for (uint32_t k = 0; k < h.n_chunks && ok; k++) {
        const uint32_t p0 = k * DISK_CHUNK_TOKENS;
        const uint32_t m = j->n - p0 < DISK_CHUNK_TOKENS ? j->n - p0 : DISK_CHUNK_TOKENS;
        chunk_rows(d, j->seq, buf, p0, m, p0, p0 + m, false);
        const uint64_t nb = (uint64_t)m * d->pos_bytes;
        sums[k] = moe_hash64(buf, nb, k);
        ok = pwrite(fd, buf, nb, (off_t)(h.header_bytes + (uint64_t)p0 * d->pos_bytes)) ==
             (ssize_t)nb;
    }
    free(buf);
    if (ok && j->state) {
        h.state_sum = moe_hash64(j->state, d->state_bytes, j->n);
        ok = pwrite(fd, j->state, d->state_bytes,
                    (off_t)(h.header_bytes + (uint64_t)j->n * d->pos_bytes)) ==
             (ssize_t)d->state_bytes;
    }
    h.header_sum = header_sum_of(&h, j->tokens, sums);
    const uint64_t tok_bytes = (uint64_t)j->n * sizeof *j->tokens;
    ok = ok && pwrite(fd, &h, sizeof h, 0) == (ssize_t)sizeof h &&
         pwrite(fd, j->tokens, tok_bytes, sizeof h) == (ssize_t)tok_bytes &&
         pwrite(fd, sums, (size_t)h.n_chunks * sizeof *sums, (off_t)(sizeof h + tok_bytes)) ==
             (ssize_t)(h.n_chunks * sizeof *sums);
    free(sums);
    if (close(fd) != 0) ok = false;
    if (!ok || rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return moe_error_set(err, MOE_ERR_IO, "%s: %s", tmp, strerror(e));
    }
    *bytes = h.file_bytes;
    return MOE_OK;
}

/* After writing tokens[0..n): without linear layers, own entries that hold a shorter prefix of
 * them are superseded (the new entry gives all they could). */
static void drop_superseded(moe_disk_cache *d, const int32_t *tokens, uint32_t n,
                            const char *keep) {
    if (d->state_bytes) return;
    for (size_t i = 0; i < d->n_entries;) {
        entry *e = &d->entries[i];
        if (e->tokens && e->n < n && strcmp(e->name, keep) != 0 &&
            memcmp(e->tokens, tokens, (size_t)e->n * sizeof *tokens) == 0) {
            index_remove(d, e);
            d->stats.evicted++;
        } else {
            i++;
        }
    }
}

/* A save job on the cache's thread: the file, then the index. */
static void run_save(moe_disk_cache *d, job *j) {
    char name[64];
    snprintf(name, sizeof name, "%016" PRIx64 "-%016" PRIx64 DISK_SUFFIX, d->identity, j->key);
    moe_error err = {0};
    uint64_t bytes = 0;
    const moe_status st = write_entry(d, j, name, &bytes, &err);
    if (st != MOE_OK) moe_log(MOE_LOG_WARN, "disk cache: cannot save an entry: %s", err.msg);
    pthread_mutex_lock(&d->mu);
    d->busy[j->seq]--;
    if (st == MOE_OK) {
        entry *old = index_find(d, name); /* the same tokens again: the file was replaced */
        if (old) index_forget(d, old);
        entry e = {.identity = d->identity, .bytes = bytes, .used = now_ns(), .n = j->n};
        snprintf(e.name, sizeof e.name, "%s", name);
        e.tokens = j->tokens;
        j->tokens = NULL;
        index_add(d, &e);
        drop_superseded(d, e.tokens, e.n, name);
        index_trim(d);
        d->stats.writes++;
        d->stats.write_bytes += bytes;
    } else {
        d->stats.write_errors++;
    }
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    job_free(j);
}

/* The cache's thread: loads first (a request waits for each), then saves; at stop, whatever is
 * queued is still done. */
static void *worker_main(void *arg) {
    moe_disk_cache *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->loads.head && !d->saves.head && !d->stop) pthread_cond_wait(&d->cv, &d->mu);
        job *j = queue_pop(&d->loads);
        if (!j) j = queue_pop(&d->saves);
        if (!j) break; /* stopping, and nothing left */
        pthread_mutex_unlock(&d->mu);
        if (j->load)
            run_load(d, j); /* the job stays d->loading[seq]'s until load_end */
        else
            run_save(d, j);
        pthread_mutex_lock(&d->mu);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ==== Open, close, state ==== */

moe_disk_cache *moe_disk_cache_open(moe_ctx *c, const char *dir, uint64_t max_bytes,
                                    moe_error *err) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        moe_error_set(err, MOE_ERR_IO, "disk cache: cannot create %s: %s", dir, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || access(dir, W_OK | X_OK) != 0) {
        moe_error_set(err, MOE_ERR_IO, "disk cache: %s is not a writable directory", dir);
        return NULL;
    }
    moe_disk_cache *d = moe_xcalloc(1, sizeof *d);
    d->c = c;
    d->dir = moe_xstrdup(dir);
    d->max_bytes = max_bytes;
    d->kv_layers = moe_xcalloc(c->m->cfg.n_layer + 1, sizeof *d->kv_layers);
    d->idx_bytes = moe_xcalloc(c->m->cfg.n_layer + 1, sizeof *d->idx_bytes);
    for (uint32_t l = 0; l < c->m->cfg.n_layer; l++) {
        const moe_layer_state ls = moe_layer_state_of(&c->m->cfg, l);
        if (!ls.k_values) continue;
        d->idx_bytes[d->n_kv] = ls.index_values * sizeof(float);
        for (int v = 0; v < 2; v++) {
            const moe_kv_span s = moe_kv_span_of(c, v, 0, l);
            d->pos_bytes += s.n_head * s.stride;
        }
        d->pos_bytes += d->idx_bytes[d->n_kv];
        d->kv_layers[d->n_kv++] = l;
    }
    d->state_bytes = (uint64_t)c->lin.n_layer * c->lin.layer_floats * sizeof(float);
    d->busy = moe_xcalloc(c->p.n_seq, sizeof *d->busy);
    d->loading = moe_xcalloc(c->p.n_seq, sizeof *d->loading);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    if (identity_of(d, err) != MOE_OK || scan(d, err) != MOE_OK) {
        moe_disk_cache_close(d);
        return NULL;
    }
    if (pthread_create(&d->writer, NULL, worker_main, d) != 0)
        moe_die("cannot start the disk cache writer");
    d->writer_started = true;
    return d;
}

void moe_disk_cache_close(moe_disk_cache *d) {
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    if (d->writer_started) pthread_join(d->writer, NULL);
    for (size_t i = 0; i < d->n_entries; i++) free(d->entries[i].tokens);
    for (uint32_t i = 0; d->loading && i < d->c->p.n_seq; i++)
        if (d->loading[i]) job_free(d->loading[i]); /* finished, never taken */
    free(d->entries);
    free(d->busy);
    free(d->loading);
    free(d->kv_layers);
    free(d->idx_bytes);
    free(d->dir);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d);
}

void moe_disk_cache_on_load(moe_disk_cache *d, void (*fn)(void *arg), void *arg) {
    pthread_mutex_lock(&d->mu);
    d->notify = fn;
    d->notify_arg = arg;
    pthread_mutex_unlock(&d->mu);
}

bool moe_disk_cache_busy(moe_disk_cache *d, int32_t seq) {
    pthread_mutex_lock(&d->mu);
    const bool busy = d->busy[seq] != 0;
    pthread_mutex_unlock(&d->mu);
    return busy;
}

void moe_disk_cache_wait(moe_disk_cache *d, int32_t seq) {
    pthread_mutex_lock(&d->mu);
    while (d->busy[seq]) pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

void moe_disk_cache_get_stats(moe_disk_cache *d, moe_disk_cache_stats *out) {
    pthread_mutex_lock(&d->mu);
    *out = d->stats;
    out->entries = d->n_entries;
    out->bytes = d->total_bytes;
    out->max_bytes = d->max_bytes;
    pthread_mutex_unlock(&d->mu);
}
