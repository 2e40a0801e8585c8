/* moe.c: expert routing and the grouped expert dispatch.
 *
 * Routing turns router logits into (expert, weight) pairs per row: softmax / sigmoid /
 * softmax-over-the-chosen gating, an optional selection-only bias, grouped top-k, optional
 * renormalisation and a scale. The dispatch groups the pairs by expert and runs each chosen
 * expert once over all of its rows: in decode of many streams that is what reads an expert's
 * weights once per step however many streams chose it, and in prefill it makes each expert a
 * small GEMM. The trap: the selection bias picks experts but never enters their weights. */
#include "ops.h"

#include <math.h>
#include <string.h>

/* ==== Routing ==== */

/* Index of the largest score[i] among i with !taken[i] (ties: lowest index). */
static int best_untaken(const float *score, const unsigned char *taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || score[i] > score[best])) best = i;
    return best;
}

void moe_route(const moe_route_params *p, const float *logits, int64_t n_rows, int32_t *ids,
               float *weights, float *scratch) {
    const int E = p->n_expert, K = p->n_used;
    float *prob = scratch, *select = scratch + E;
    unsigned char taken[1024], group_off[256];
    MOE_CHECK(E <= 1024 && (p->n_group <= 1 || p->n_group <= 256));
    for (int64_t r = 0; r < n_rows; r++) {
        const float *l = logits + r * E;
        if (p->gating == MOE_GATING_SIGMOID) {
            for (int i = 0; i < E; i++) prob[i] = 1.0f / (1.0f + expf(-l[i]));
        } else if (p->gating == MOE_GATING_SOFTMAX) {
            memcpy(prob, l, sizeof(float) * (size_t)E);
            moe_softmax(prob, E);
        } else { /* softmax over the chosen: select on the raw logits */
            memcpy(prob, l, sizeof(float) * (size_t)E);
        }
        for (int i = 0; i < E; i++) select[i] = prob[i] + (p->sel_bias ? p->sel_bias[i] : 0.0f);
        memset(taken, 0, (size_t)E);
        if (p->n_group > 1) {
            /* a group scores the sum of its two best selection scores; keep topk_group groups */
            const int per = E / p->n_group;
            float group_score[256];
            for (int g = 0; g < p->n_group; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int i = g * per; i < (g + 1) * per; i++) {
                    if (select[i] > a)
                        b = a, a = select[i];
                    else if (select[i] > b)
                        b = select[i];
                }
                group_score[g] = a + (per > 1 ? b : 0.0f);
            }
            memset(group_off, 1, (size_t)p->n_group);
            unsigned char group_taken[256] = {0};
            for (int k = 0; k < p->topk_group; k++) {
                const int g = best_untaken(group_score, group_taken, p->n_group);
                group_taken[g] = 1;
                group_off[g] = 0;
            }
            for (int i = 0; i < E; i++) taken[i] = group_off[i / per];
        }
        int32_t *id = ids + r * K;
        float *w = weights + r * K;
        for (int k = 0; k < K; k++) {
            id[k] = best_untaken(select, taken, E);
            taken[id[k]] = 1;
            w[k] = prob[id[k]];
        }
        if (p->gating == MOE_GATING_SOFTMAX_WEIGHT) moe_softmax(w, K);
        if (p->norm) { /* llama.cpp clamps the sum to the smallest normal f16 */
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += w[k];
            sum = fmaxf(sum, 6.103515625e-5f);
            for (int k = 0; k < K; k++) w[k] /= sum;
        }
        if (p->scale != 1.0f)
            for (int k = 0; k < K; k++) w[k] *= p->scale;
        if (p->expert_scale)
            for (int k = 0; k < K; k++) w[k] *= p->expert_scale[id[k]];
    }
}

/* ==== Grouped expert dispatch ==== */

/* The routed experts' first bytes are requested as soon as the routing is known, while the rows
 * are gathered and converted for the first pass: a few lines per matrix (the kernels' own
 * look-ahead takes over from there), for the first experts only (a prefill routes to all). */
#define EXPERT_PREFETCH_BYTES   1024
#define EXPERT_PREFETCH_EXPERTS 32

static void prefetch_routed(const moe_expert_set *set, const int32_t *starts, int64_t n_expert) {
    const moe_tensor *m[3] = {set->gate_up ? set->gate_up : set->gate, set->up, set->down};
    int n = 0;
    for (int64_t e = 0; e < n_expert && n < EXPERT_PREFETCH_EXPERTS; e++) {
        if (starts[e + 1] == starts[e] || (set->n_shards > 1 && e % set->n_shards != set->shard))
            continue;
        for (int k = 0; k < 3; k++)
            if (m[k]) moe_matmul_prefetch(m[k], e, EXPERT_PREFETCH_BYTES);
        n++;
    }
}

/* MOE_PROFILE's part for the pairs' sort by expert and the gather of their rows. */
#define PART_SORT "experts sort + gather"

/* What one group of experts shares while it runs: its experts (in expert order), where their
 * pairs start in the sorted pairs, the row offset of each one's rows in the scratch and its
 * matrices (the stacked tensors', or a source's views). */
typedef struct expert_group {
    const moe_expert_set *set;
    const float *x;
    const moe_expert_scratch *s;
    int32_t expert[MOE_MATMUL_MANY_MAX / 2];
    int64_t begin[MOE_MATMUL_MANY_MAX / 2], n[MOE_MATMUL_MANY_MAX / 2];
    int64_t at[MOE_MATMUL_MANY_MAX / 2];             /* first scratch row */
    moe_tensor views[3 * (MOE_MATMUL_MANY_MAX / 2)]; /* from the source */
    uint64_t xq_in, xq_ff;                           /* matmul scratch bytes per row */
    bool in_converted; /* s->x holds the input rows converted for gate and up (row r at r x
                        * xq_in bytes): a row is converted once, not once per expert, and its
                        * expert rows are gathered converted */
    bool ff_converted; /* the GLU converts its rows for down as it makes them */
} expert_group;

/* Matrix k (0 gate or gate_up, 1 up, 2 down) of the group's expert g, and its index in it. */
static const moe_tensor *group_matrix(const expert_group *eg, int g, int k) {
    const moe_expert_set *set = eg->set;
    if (set->source) return &eg->views[3 * g + k];
    return k == 0 ? (set->gate_up ? set->gate_up : set->gate) : k == 1 ? set->up : set->down;
}

static int64_t group_index(const expert_group *eg, int g) {
    return eg->set->source ? 0 : eg->expert[g];
}

/* The rows of experts part[begin, end) of a group gathered into the scratch (each expert's rows
 * to their own place), and the weighted sum below: shared out on all threads from
 * GATHER_MIN_VALUES values. */
#define GATHER_MIN_VALUES (64 << 10)
#define SCATTER_VALUES    256 /* values of every row per work item */

typedef struct rows_job {
    const expert_group *eg;
    const int *part; /* the gather's experts */
    int n_group;     /* the weighted sum's */
    float *out;
} rows_job;

static void gather_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const rows_job *j = arg;
    const expert_group *eg = j->eg;
    const uint64_t bytes = eg->in_converted ? eg->xq_in : sizeof(float) * eg->set->down->ne[1];
    const uint8_t *from = eg->in_converted ? (const uint8_t *)eg->s->x : (const uint8_t *)eg->x;
    uint8_t *to = eg->in_converted ? eg->s->mm : (uint8_t *)eg->s->x;
    for (int64_t p = begin; p < end; p++)
        for (int64_t g = j->part[p], i = 0; i < eg->n[g]; i++)
            memcpy(to + (uint64_t)(eg->at[g] + i) * bytes,
                   from + (uint64_t)eg->s->pair_row[eg->begin[g] + i] * bytes, bytes);
}

/* o[d] += w * y[d] for d < n, MOE_VEC_STEP values at a time where it can: a constant trip count is
 * what GCC -O2 vectorises (a multiply, then an add: the same two roundings as one at a time). */
static void add_weighted(float *restrict o, const float *restrict y, float w, int64_t n) {
    int64_t d = 0;
    for (; d + MOE_VEC_STEP <= n; d += MOE_VEC_STEP)
        for (int k = 0; k < MOE_VEC_STEP; k++) o[d + k] += w * y[d + k];
    for (; d < n; d++) o[d] += w * y[d];
}

/* The group's weighted outputs added to their rows' outputs, values [begin, end) of every row:
 * each row's experts in expert order, whatever thread adds which values. */
static void scatter_values(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const rows_job *j = arg;
    const moe_expert_scratch *s = j->eg->s;
    const int64_t n_in = j->eg->set->down->ne[1];
    for (int g = 0; g < j->n_group; g++)
        for (int64_t i = 0, at = j->eg->begin[g]; i < j->eg->n[g]; i++)
            add_weighted(j->out + (int64_t)s->pair_row[at + i] * n_in + begin,
                         s->y + (j->eg->at[g] + i) * n_in + begin, s->pair_w[at + i], end - begin);
}

/* Values from which the GLU's rows are shared out on all threads, and values per work item
 * (moe_glu_pool's). */
#define GLU_MIN_VALUES   (16 << 10)
#define GLU_CHUNK_VALUES (4 << 10)

typedef struct glu_job {
    const expert_group *eg;
    const int *part;
    int n_part;
    int64_t r0;
} glu_job;

/* Scratch rows r0 + [begin, end) of the part: each row's gate and up get their expert's biases,
 * then up = act(gate) * up in s->up's row, the down matmul's input. With gate_up a row's gate
 * and up are the halves of its [gate, up] row: the up half is copied to s->up's row (in L1 for
 * the GLU that follows), the gate half is read where it is. */
static void glu_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const glu_job *j = arg;
    const expert_group *eg = j->eg;
    const moe_expert_set *set = eg->set;
    const int64_t n_ff = set->down->ne[0], gate_w = (set->gate_up ? 2 : 1) * n_ff;
    for (int p = 0; p < j->n_part; p++) {
        const int g = j->part[p];
        const int64_t a = eg->at[g] > j->r0 + begin ? eg->at[g] : j->r0 + begin;
        const int64_t b = eg->at[g] + eg->n[g] < j->r0 + end ? eg->at[g] + eg->n[g] : j->r0 + end;
        for (int64_t i = a; i < b; i++) {
            float *gate = eg->s->gate + i * gate_w, *up = eg->s->up + i * n_ff;
            if (set->gate_up) memcpy(up, gate + n_ff, sizeof(float) * (size_t)n_ff);
            moe_add_bias(gate, set->gate_b, eg->expert[g], 1, n_ff);
            moe_add_bias(up, set->up_b, eg->expert[g], 1, n_ff);
            moe_glu(set->act, set->limit, up, gate, n_ff);
            if (eg->ff_converted)
                moe_matmul_convert_rows(group_matrix(eg, g, 2), up, 1,
                                        (uint8_t *)eg->s->mm + (uint64_t)i * eg->xq_ff);
        }
    }
}

/* The experts part[0..n_part) of the group, whose rows lie together from scratch row r0 (in
 * part order): gather their rows, gate and up as one parallel pass (fused: one matmul per expert
 * into rows of [gate, up], split below), the GLU, then down as another pass into s->y. Every
 * expert's output depends only on its own rows and matrices, so the order in which parts run
 * changes nothing. */
static void group_compute(moe_pool *pool, const expert_group *eg, const int *part, int n_part) {
    if (n_part <= 0) return;
    const moe_expert_set *set = eg->set;
    const moe_expert_scratch *s = eg->s;
    const bool fused = set->gate_up != NULL;
    const int64_t n_in = set->down->ne[1], n_ff = set->down->ne[0];
    const int64_t r0 = eg->at[part[0]];
    moe_matmul_task tasks[MOE_MATMUL_MANY_MAX];
    int64_t rows = 0, n_tasks = 0;
    double start = moe_profile_start();
    rows_job gj = {.eg = eg, .part = part};
    for (int p = 0; p < n_part; p++) rows += eg->n[part[p]];
    moe_pool_for(pool, n_part, rows * n_in < GATHER_MIN_VALUES ? n_part : 1, gather_rows, &gj);
    for (int p = 0; p < n_part; p++) {
        const int g = part[p];
        const int64_t at = eg->at[g], n = eg->n[g];
        const float *x = eg->in_converted ? NULL : s->x + at * n_in;
        uint8_t *xq = (uint8_t *)s->mm + (uint64_t)at * eg->xq_in;
        tasks[n_tasks++] = (moe_matmul_task){.w = group_matrix(eg, g, 0),
                                             .matrix = group_index(eg, g),
                                             .x = x,
                                             .n_rows = n,
                                             .y = s->gate + at * (fused ? 2 : 1) * n_ff,
                                             .scratch = xq};
        if (!fused) /* up shares gate's converted rows, or converts its own */
            tasks[n_tasks++] = (moe_matmul_task){
                .w = group_matrix(eg, g, 1),
                .matrix = group_index(eg, g),
                .x = x,
                .n_rows = n,
                .y = s->up + at * n_ff,
                .scratch = eg->in_converted ? xq : (uint8_t *)s->mm_up + (uint64_t)at * eg->xq_in};
    }
    moe_profile_part(PART_SORT, start);
    moe_matmul_many(pool, tasks, (int)n_tasks);
    start = moe_profile_start();
    glu_job glu = {eg, part, n_part, r0};
    if (rows * n_ff < GLU_MIN_VALUES)
        glu_rows(&glu, 0, rows, 0);
    else
        moe_pool_for(pool, rows, (GLU_CHUNK_VALUES + n_ff - 1) / n_ff, glu_rows, &glu);
    for (int p = 0; p < n_part; p++) {
        const int g = part[p];
        const int64_t at = eg->at[g], n = eg->n[g];
        tasks[p] = (moe_matmul_task){.w = group_matrix(eg, g, 2),
                                     .matrix = group_index(eg, g),
                                     .x = eg->ff_converted ? NULL : s->up + at * n_ff,
                                     .n_rows = n,
                                     .y = s->y + at * n_in,
                                     .scratch = (uint8_t *)s->mm + (uint64_t)at * eg->xq_ff};
    }
    moe_profile_part("experts GLU", start);
    moe_matmul_many(pool, tasks, n_part);
}

bool moe_experts_forward(moe_pool *pool, const moe_expert_set *set, const float *x, int64_t n_rows,
                         const int32_t *ids, const float *weights, int n_used, float *out,
                         const moe_expert_scratch *s, moe_expert_stats *stats) {
    const moe_tensor *gate = set->gate_up ? set->gate_up : set->gate, *up = set->up;
    const moe_tensor *down = set->down;
    const int64_t n_expert = gate->ne[2], n_in = gate->ne[0];
    double start = moe_profile_start();
    /* counting sort of the pairs by expert: counts[e] becomes the start of e's run */
    memset(s->counts, 0, sizeof(int32_t) * (size_t)(n_expert + 1));
    const int64_t n_pairs = n_rows * n_used;
    for (int64_t i = 0; i < n_pairs; i++) s->counts[ids[i] + 1]++;
    for (int64_t e = 0; e < n_expert; e++) s->counts[e + 1] += s->counts[e];
    if (!set->source) prefetch_routed(set, s->counts, n_expert);
    for (int64_t i = 0; i < n_pairs; i++) {
        const int32_t slot = s->counts[ids[i]]++;
        s->pair_row[slot] = (int32_t)(i / n_used);
        s->pair_w[slot] = weights[i];
    }
    moe_profile_part(PART_SORT, start);
    /* counts[e] now ends e's run; its start is counts[e - 1] (0 for e = 0). Experts go in
     * groups whose pairs fit the scratch: each group's gate and up matmuls run as one parallel
     * pass, then its down matmuls as another (one pool hand-out each, not three per expert).
     * From a source, the experts already resident run first while the rest are read, then the
     * rest. The weighted outputs are added back in expert order once the group is done, so
     * every row sums its experts in the same order whatever else is in the batch and whatever
     * was resident. */
    expert_group eg = {.set = set, .x = x, .s = s};
    const moe_expert_source *src = set->source;
    const int max_group =
        src && src->max_group < MOE_MATMUL_MANY_MAX / 2 ? src->max_group : MOE_MATMUL_MANY_MAX / 2;
    eg.xq_in = set->gate_up || moe_matmul_scratch_bytes(gate, 1) > moe_matmul_scratch_bytes(up, 1)
                   ? moe_matmul_scratch_bytes(gate, 1)
                   : moe_matmul_scratch_bytes(up, 1);
    eg.xq_ff = moe_matmul_scratch_bytes(down, 1);
    /* An observer reads every task's float rows, which converted tasks do not pass. */
    eg.in_converted = !moe_matmul_observed() &&
                      (set->gate_up || moe_matmul_converts_alike(gate, up)) &&
                      moe_matmul_convert_pool(pool, gate, x, n_rows, s->x);
    eg.ff_converted = !moe_matmul_observed() && eg.xq_ff > 0;
    uint64_t touched = 0;
    for (int64_t e = 0; e < n_expert;) {
        int n_group = 0;
        int64_t rows = 0;
        for (; e < n_expert && n_group < max_group; e++) {
            const int64_t n = s->counts[e] - (e ? s->counts[e - 1] : 0);
            if (n == 0 || (set->n_shards > 1 && e % set->n_shards != set->shard)) continue;
            if (rows + n > s->max_rows) break; /* the next group starts with e */
            eg.expert[n_group] = (int32_t)e;
            eg.begin[n_group] = e ? s->counts[e - 1] : 0;
            eg.n[n_group++] = n;
            rows += n;
        }
        if (!n_group) continue;
        bool ready[MOE_MATMUL_MANY_MAX / 2];
        if (src && !src->acquire(src->ctx, eg.expert, n_group, eg.views, ready)) return false;
        /* the ready experts' rows first, then the others' */
        int order[MOE_MATMUL_MANY_MAX / 2], n_ready = 0;
        for (int g = 0; g < n_group; g++)
            if (!src || ready[g]) order[n_ready++] = g;
        for (int g = 0, k = n_ready; g < n_group; g++)
            if (src && !ready[g]) order[k++] = g;
        for (int k = 0, at = 0; k < n_group; at += (int)eg.n[order[k]], k++) eg.at[order[k]] = at;
        group_compute(pool, &eg, order, n_ready);
        if (n_ready < n_group) {
            if (!src->wait(src->ctx, eg.expert, n_group)) return false;
            group_compute(pool, &eg, order + n_ready, n_group - n_ready);
        }
        if (src) src->release(src->ctx, eg.expert, n_group);
        start = moe_profile_start();
        for (int g = 0; g < n_group; g++)
            moe_add_bias(s->y + eg.at[g] * n_in, set->down_b, eg.expert[g], eg.n[g], n_in);
        rows_job sj = {.eg = &eg, .n_group = n_group, .out = out};
        moe_pool_for(pool, n_in, rows * n_in < GATHER_MIN_VALUES ? n_in : SCATTER_VALUES,
                     scatter_values, &sj);
        moe_profile_part("experts weighted sum", start);
        touched += (uint64_t)n_group;
    }
    if (stats) {
        stats->rows += (uint64_t)n_rows;
        stats->pairs += (uint64_t)n_pairs;
        stats->experts += touched;
    }
    return true;
}
