/* dist.c: the ranks of an `mpirun -np K moe ...` job, over Open MPI: start and end, who we are,
 * the ordered sum of a float buffer across ranks and the broadcast of rank 0's bytes. Everything
 * the engine needs from MPI goes through these few calls; a build without MOE_MPI (the default
 * `make`) compiles them to one rank that never communicates, so the engine calls them without
 * #ifdefs.
 *
 * The trap: the sum must not depend on timing or on Open MPI's choice of reduction algorithm,
 * or two runs (and two ranks) could disagree in the last bit. So it is not MPI_Allreduce: every
 * rank's partial goes to rank 0 (MPI_Gather), rank 0 adds them in rank order 0, 1, ..., K-1 and
 * broadcasts the result, so every rank holds the same bits (a barrier first splits the time into
 * waiting for the slowest rank and the reduction proper, for `moe bench`). Only the thread that
 * called moe_dist_init makes MPI calls at a time (MPI_THREAD_SERIALIZED). */
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
#include <mpi.h>
#include <time.h>

/* A follower waiting for rank 0's next call sleeps between polls, up to this long: an idle
 * server's other ranks then cost nothing, and a call waits at most this much longer. */
#define IDLE_PAUSE_MAX_NS 1000000L

static bool dist_started; /* we called MPI_Init_thread (and owe MPI_Finalize) */
static int dist_rank, dist_size = 1;
static moe_dist_times times; /* of moe_dist_sum, since the start */
static float *gather_buf;    /* [size][gather_cap] floats: the partials rank 0 adds in rank order */
static size_t gather_cap;

bool moe_dist_built(void) {
    return true;
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
    return MOE_OK;
}

void moe_dist_finalize(void) {
    if (!dist_started) return;
    free(gather_buf);
    gather_buf = NULL;
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

void moe_dist_sum(float *buf, size_t n) {
    if (dist_size <= 1 || n == 0) return;
    MOE_CHECK(n <= (size_t)INT32_MAX);
    /* the barrier splits the time into waiting for the slowest rank and the reduction itself */
    const double t0 = moe_now();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t1 = moe_now();
    if (dist_rank == 0 && n > gather_cap) { /* grows to the largest step once, then stays */
        free(gather_buf);
        gather_buf = moe_xmalloc(sizeof(float) * n * (size_t)dist_size);
        gather_cap = n;
    }
    /* rank 0's partial stays in buf; the gather lands every rank's partial in rank order */
    MPI_Gather(buf, (int)n, MPI_FLOAT, gather_buf, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (dist_rank == 0)
        for (int r = 1; r < dist_size; r++) {
            const float *p = gather_buf + (size_t)r * n;
            for (size_t i = 0; i < n; i++) buf[i] += p[i];
        }
    MPI_Bcast(buf, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    times.wait_seconds += t1 - t0;
    times.reduce_seconds += moe_now() - t1;
    times.sums++;
    times.bytes += sizeof(float) * n;
}

void moe_dist_bcast(void *buf, size_t bytes) {
    if (dist_size <= 1 || bytes == 0) return;
    MOE_CHECK(bytes <= (size_t)INT32_MAX);
    MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
}

void moe_dist_bcast_idle(void *buf, size_t bytes) {
    if (dist_size <= 1 || bytes == 0) return;
    MOE_CHECK(bytes <= (size_t)INT32_MAX);
    MPI_Request req;
    MPI_Ibcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    /* a blocking MPI_Bcast polls a core flat out for as long as rank 0 has nothing to send */
    for (long pause_ns = 1000;; pause_ns = pause_ns < IDLE_PAUSE_MAX_NS ? pause_ns * 2 : pause_ns) {
        int done = 0;
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (done) return;
        struct timespec d = {0, pause_ns};
        nanosleep(&d, NULL);
    }
}

void moe_dist_gather(const void *mine, size_t bytes, void *all) {
    if (dist_size <= 1) {
        if (all) memcpy(all, mine, bytes);
        return;
    }
    MOE_CHECK(bytes <= (size_t)INT32_MAX);
    MPI_Gather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
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
moe_dist_times moe_dist_timing(void) {
    return (moe_dist_times){0};
}
const char *moe_dist_describe(void) {
    return "none (make MPI=1 to build with Open MPI)";
}

#endif
