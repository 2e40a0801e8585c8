/* dist.c: the ranks of an `mpirun -np K moe ...` job, over Open MPI: start and end, who we are,
 * the ordered sum of a float buffer across ranks and the broadcast of rank 0's bytes, and
 * whether the other ranks are still there. Everything the engine needs from MPI goes through
 * these few calls; a build without MOE_MPI (the default `make`) compiles them to one rank that
 * never communicates, so the engine calls them without #ifdefs.
 *
 * The trap: the sum must not depend on timing or on Open MPI's choice of reduction algorithm,
 * or two runs (and two ranks) could disagree in the last bit. So it is not MPI_Allreduce: every
 * rank's partial goes to rank 0 (a gather), rank 0 adds them in rank order 0, 1, ..., K-1 and
 * broadcasts the result, so every rank holds the same bits (a barrier first splits the time into
 * waiting for the slowest rank and the reduction proper, for `moe bench`). Only the thread that
 * called moe_dist_init makes MPI calls at a time (MPI_THREAD_SERIALIZED).
 *
 * A rank that dies must not leave the others waiting forever: every collective is nonblocking,
 * and its wait looks every LIVENESS_PERIOD_S whether the ranks it depends on (rank 0 every
 * other; rank 0 all of them) still exist -- a process on this machine, by its pid; ranks on
 * other machines are left to Open MPI. A rank that finds one gone ends the job naming it, unless
 * it is rank 0 told to outlive the loss (serve: it answers 503, then ends). */
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== What a rank holds ==== */

moe_split_range moe_split_rows_range(int64_t n_ff, int64_t block, int rank, int n_ranks) {
    if (n_ranks <= 1) return (moe_split_range){0, n_ff};
    const int64_t blocks = n_ff / block;
    return (moe_split_range){blocks * rank / n_ranks * block,
                             blocks * (rank + 1) / n_ranks * block};
}

uint64_t moe_split_expert_bytes(const moe_model *m, moe_split split, int rank, int n_ranks,
                                uint64_t *all) {
    uint64_t mine = 0, total = 0;
    for (uint32_t il = 0; il < m->cfg.n_layer; il++) { /* the trunk (MTP layers: the same split) */
        const moe_layer_weights *l = &m->layers[il];
        if (l->plan.ffn != MOE_FFN_EXPERTS) continue;
        const moe_tensor *down = l->experts.down;
        const moe_split_range ff =
            moe_split_rows_range(down->ne[0], moe_type_traits_get(down->type)->block_values,
                                 split == MOE_SPLIT_ROWS ? rank : 0, n_ranks);
        const uint64_t n_ff = (uint64_t)(ff.end - ff.begin);
        const moe_tensor *t[4] = {l->experts.gate, l->experts.up, l->experts.gate_up, down};
        for (int k = 0; k < 4; k++) {
            if (!t[k]) continue;
            const uint64_t n_expert = (uint64_t)t[k]->ne[2], per = t[k]->n_bytes / n_expert;
            uint64_t owned = n_expert * per;
            if (split == MOE_SPLIT_EXPERTS && n_ranks > 1) /* experts e with e % n_ranks == rank */
                owned = (n_expert / (uint64_t)n_ranks +
                         ((uint64_t)rank < n_expert % (uint64_t)n_ranks)) *
                        per;
            else if (split == MOE_SPLIT_ROWS && k < 3) /* rows: n_ff of gate / up, 2 n_ff fused */
                owned = n_expert * (k == 2 ? 2 : 1) * n_ff *
                        moe_type_row_bytes(t[k]->type, t[k]->ne[0]);
            else if (split == MOE_SPLIT_ROWS) /* down: n_ff input columns of every row */
                owned = n_expert * (uint64_t)t[k]->ne[1] *
                        moe_type_row_bytes(t[k]->type, (int64_t)n_ff);
            mine += owned;
            total += t[k]->n_bytes;
        }
        /* biases and scales: whole on every rank, but for rows the gate / up biases' slice */
        const moe_tensor *bias[4] = {l->experts.gate_b, l->experts.up_b, l->experts.down_b,
                                     l->experts.down_scale};
        for (int k = 0; k < 4; k++) {
            if (!bias[k]) continue;
            mine += split == MOE_SPLIT_ROWS && k < 2
                        ? sizeof(float) * n_ff * (uint64_t)bias[k]->ne[1]
                        : bias[k]->n_bytes;
            total += bias[k]->n_bytes;
        }
    }
    if (all) *all = total;
    return mine;
}

#ifdef MOE_MPI
#include <errno.h>
#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

/* A rank waiting for the others polls flat out this long, then sleeps between polls, up to
 * PAUSE_MAX_NS: a step's reductions come within microseconds, and a follower idle between rank
 * 0's calls (an idle server) then costs nothing. */
#define SPIN_S       0.01
#define PAUSE_MAX_NS 1000000L
/* How often a wait looks whether the ranks it depends on still exist. */
#define LIVENESS_PERIOD_S 0.1

/* A rank's process as every rank sees it (gathered at init). machine: the boot id and pid
 * namespace ("" if unknown): ranks with the same one can see each other's pids. */
typedef struct dist_peer {
    int32_t pid;
    char host[64];
    char machine[96];
} dist_peer;

static bool dist_started; /* we called MPI_Init_thread (and owe MPI_Finalize) */
static int dist_rank, dist_size = 1;
static moe_dist_times times; /* of moe_dist_sum, since the start */
static float *gather_buf;    /* [gather_cap] floats: the partials rank 0 adds in rank order, or the
                              * columns moe_dist_join gathers */
static size_t gather_cap;
static dist_peer *peers;  /* [size] */
static bool *watched;     /* [size] a pid this rank can see and depends on */
static int lost = -1;     /* a rank found gone, or -1 */
static bool outlive_loss; /* rank 0 goes on after a loss (moe_dist_outlive_loss) */

bool moe_dist_built(void) {
    return true;
}

/* The first line of a small file into buf ("" when unreadable). */
static void read_line(const char *path, char *buf, size_t size) {
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    if (!fgets(buf, (int)size, f)) buf[0] = 0;
    buf[strcspn(buf, "\n")] = 0;
    fclose(f);
}

/* Whether process pid is gone: no such process, or a zombie no one has reaped yet. */
static bool pid_gone(int32_t pid) {
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], stat[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    read_line(path, stat, sizeof stat);
    const char *state = strrchr(stat, ')'); /* "pid (comm) S ..." */
    return state && (state[2] == 'Z' || state[2] == 'X');
}

/* Every rank's pid, host and machine, and which of them this rank watches. */
static void peers_gather(void) {
    dist_peer mine = {.pid = (int32_t)getpid()};
    gethostname(mine.host, sizeof mine.host - 1);
    char boot[48], ns[48];
    read_line("/proc/sys/kernel/random/boot_id", boot, sizeof boot);
    const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    ns[n > 0 ? n : 0] = 0;
    if (boot[0] && n > 0) snprintf(mine.machine, sizeof mine.machine, "%s %s", boot, ns);
    peers = moe_xcalloc((size_t)dist_size, sizeof *peers);
    watched = moe_xcalloc((size_t)dist_size, sizeof *watched);
    MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, peers, (int)sizeof mine, MPI_BYTE,
                  MPI_COMM_WORLD);
    for (int r = 0; r < dist_size; r++)
        watched[r] = r != dist_rank && (dist_rank == 0 || r == 0) && mine.machine[0] &&
                     !strcmp(peers[r].machine, mine.machine) && !pid_gone(peers[r].pid);
}

/* Whether a rank this one depends on is gone (then `lost` names it). */
static bool peers_lost(void) {
    for (int r = 0; lost < 0 && r < dist_size; r++)
        if (watched[r] && pid_gone(peers[r].pid)) lost = r;
    return lost >= 0;
}

static void lost_message(char *buf, size_t size) {
    snprintf(buf, size, "rank %d of %d (pid %d on %s) is gone", lost, dist_size,
             (int)peers[lost].pid, peers[lost].host);
}

/* The job cannot go on: say which rank is gone and end every rank (rank 0 outliving the loss
 * carries on instead, its calls returning at once). */
static void on_lost(void) {
    if (dist_rank == 0 && outlive_loss) return;
    char what[160];
    lost_message(what, sizeof what);
    fprintf(stderr, "moe: rank %d: %s: ending the job\n", dist_rank, what);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Wait for req: polled flat out for SPIN_S (from the start when idle: sleeping between polls),
 * looking every LIVENESS_PERIOD_S whether the ranks this one depends on exist. false: one is
 * gone (the request is abandoned). */
static bool dist_wait(MPI_Request *req, bool idle) {
    const double start = moe_now();
    double check = start + LIVENESS_PERIOD_S;
    long pause_ns = 1000;
    for (;;) {
        int done = 0;
        MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (done) return true;
        const double now = moe_now();
        if (now >= check) {
            check = now + LIVENESS_PERIOD_S;
            if (peers_lost()) {
                on_lost();
                return false;
            }
        }
        if (idle || now - start > SPIN_S) {
            struct timespec d = {0, pause_ns};
            nanosleep(&d, NULL);
            if (pause_ns < PAUSE_MAX_NS) pause_ns *= 2;
        } else {
            sched_yield(); /* a rank sharing this core (oversubscribed) runs meanwhile */
        }
    }
}

moe_status moe_dist_init(moe_error *err) {
    if (dist_started) return MOE_OK;
    int inited = 0, provided = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
        return moe_error_set(err, MOE_ERR_IO, "MPI_Init_thread failed");
    if (!inited && provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "this Open MPI gives thread level %d, moe needs MPI_THREAD_SERIALIZED",
                             provided);
    }
    dist_started = !inited;
    MPI_Comm_rank(MPI_COMM_WORLD, &dist_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &dist_size);
    peers_gather();
    return MOE_OK;
}

void moe_dist_finalize(void) {
    if (!dist_started) return;
    if (lost >= 0) { /* MPI_Finalize would wait for the lost rank */
        char what[160];
        lost_message(what, sizeof what);
        fprintf(stderr, "moe: rank %d: %s: ending the job\n", dist_rank, what);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    free(gather_buf);
    free(peers);
    free(watched);
    gather_buf = NULL;
    peers = NULL;
    watched = NULL;
    gather_cap = 0;
    MPI_Finalize();
    dist_started = false;
    dist_rank = 0;
    dist_size = 1;
}

void moe_dist_abort(int code) {
    if (dist_size > 1) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
}

int moe_dist_rank(void) {
    return dist_rank;
}
int moe_dist_size(void) {
    return dist_size;
}

void moe_dist_outlive_loss(void) {
    outlive_loss = true;
}

int moe_dist_lost(bool look_now, moe_error *err) {
    if (dist_size <= 1 || (look_now ? !peers_lost() : lost < 0)) return -1;
    char what[160];
    lost_message(what, sizeof what);
    if (err) moe_error_set(err, MOE_ERR_IO, "%s", what);
    return lost;
}

/* gather_buf, at least n floats. */
static float *scratch(size_t n) {
    if (n > gather_cap) { /* grows to the largest step once, then stays */
        free(gather_buf);
        gather_buf = moe_xmalloc(sizeof(float) * n);
        gather_cap = n;
    }
    return gather_buf;
}

void moe_dist_sum(float *buf, size_t n) {
    if (dist_size <= 1 || n == 0 || lost >= 0) return;
    MOE_CHECK(n <= (size_t)INT32_MAX);
    /* the barrier splits the time into waiting for the slowest rank and the reduction itself */
    const double t0 = moe_now();
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    if (!dist_wait(&req, false)) return;
    const double t1 = moe_now();
    float *got = dist_rank == 0 ? scratch(n * (size_t)dist_size) : NULL;
    /* rank 0's partial stays in buf; the gather lands every rank's partial in rank order */
    MPI_Igather(buf, (int)n, MPI_FLOAT, got, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD, &req);
    if (!dist_wait(&req, false)) return;
    if (dist_rank == 0)
        for (int r = 1; r < dist_size; r++) {
            const float *p = got + (size_t)r * n;
            for (size_t i = 0; i < n; i++) buf[i] += p[i];
        }
    MPI_Ibcast(buf, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD, &req);
    if (!dist_wait(&req, false)) return;
    times.wait_seconds += t1 - t0;
    times.reduce_seconds += moe_now() - t1;
    times.sums++;
    times.bytes += sizeof(float) * n;
}

/* Rank 0's bytes to every rank; idle: a wait that may be long sleeps between polls. */
static void bcast(void *buf, size_t bytes, bool idle) {
    if (dist_size <= 1 || bytes == 0 || lost >= 0) return;
    MOE_CHECK(bytes <= (size_t)INT32_MAX);
    MPI_Request req;
    MPI_Ibcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    dist_wait(&req, idle);
}

void moe_dist_bcast(void *buf, size_t bytes) {
    bcast(buf, bytes, false);
}

void moe_dist_bcast_idle(void *buf, size_t bytes) {
    bcast(buf, bytes, true);
}

void moe_dist_gather(const void *mine, size_t bytes, void *all) {
    if (dist_size <= 1) {
        if (all) memcpy(all, mine, bytes);
        return;
    }
    if (lost >= 0) return;
    MOE_CHECK(bytes <= (size_t)INT32_MAX);
    MPI_Request req;
    MPI_Igather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    dist_wait(&req, false);
}

void moe_dist_join(float *all, const float *mine, uint32_t n_rows, int64_t width) {
    if (dist_size <= 1 || lost >= 0) {
        if (dist_size <= 1 && all != mine)
            memmove(all, mine, sizeof(float) * n_rows * (size_t)width);
        return;
    }
    MOE_CHECK((uint64_t)n_rows * (uint64_t)width <= (uint64_t)INT32_MAX);
    const double t0 = moe_now();
    int counts[dist_size], displs[dist_size];
    for (int r = 0, at = 0; r < dist_size; r++) {
        const moe_split_range cols = moe_split_rows_range(width, 1, r, dist_size);
        counts[r] = (int)(n_rows * (cols.end - cols.begin));
        displs[r] = at;
        at += counts[r];
    }
    float *got = scratch((size_t)n_rows * (size_t)width); /* rank after rank, each packed */
    MPI_Request req;
    MPI_Iallgatherv(mine, counts[dist_rank], MPI_FLOAT, got, counts, displs, MPI_FLOAT,
                    MPI_COMM_WORLD, &req);
    if (!dist_wait(&req, false)) return;
    for (int r = 0; r < dist_size; r++) {
        const moe_split_range cols = moe_split_rows_range(width, 1, r, dist_size);
        const int64_t n = cols.end - cols.begin;
        for (uint32_t i = 0; i < n_rows; i++)
            memcpy(all + i * width + cols.begin, got + displs[r] + i * n, sizeof(float) * n);
    }
    times.reduce_seconds += moe_now() - t0;
    times.sums++;
    times.bytes += sizeof(float) * n_rows * (size_t)width;
}

moe_dist_times moe_dist_timing(void) {
    return times;
}

const char *moe_dist_describe(void) {
    static char text[MPI_MAX_LIBRARY_VERSION_STRING + 16];
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(lib, &len);
    lib[strcspn(lib, ",\n")] = 0; /* "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4" */
    snprintf(text, sizeof text, "%s", lib);
    return text;
}

#else /* one rank, no MPI */

bool moe_dist_built(void) {
    return false;
}
moe_status moe_dist_init(moe_error *err) {
    return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                         "this moe was built without MPI: build it with `make MPI=1` "
                         "(Debian libopenmpi-dev) and start it with mpirun");
}
void moe_dist_finalize(void) {}
void moe_dist_abort(int code) {
    (void)code;
}
int moe_dist_rank(void) {
    return 0;
}
int moe_dist_size(void) {
    return 1;
}
void moe_dist_outlive_loss(void) {}
int moe_dist_lost(bool look_now, moe_error *err) {
    (void)look_now, (void)err;
    return -1;
}
void moe_dist_sum(float *buf, size_t n) {
    (void)buf, (void)n;
}
void moe_dist_bcast(void *buf, size_t bytes) {
    (void)buf, (void)bytes;
}
void moe_dist_bcast_idle(void *buf, size_t bytes) {
    (void)buf, (void)bytes;
}
void moe_dist_gather(const void *mine, size_t bytes, void *all) {
    if (all) memcpy(all, mine, bytes);
}
void moe_dist_join(float *all, const float *mine, uint32_t n_rows, int64_t width) {
    if (all != mine) memmove(all, mine, sizeof(float) * n_rows * (size_t)width);
}
moe_dist_times moe_dist_timing(void) {
    return (moe_dist_times){0};
}
const char *moe_dist_describe(void) {
    return "none (make MPI=1 to build with Open MPI)";
}

#endif
