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

bool moe_experts_forward(moe_pool *pool, const moe_expert_set *set, const float *x, int64_t n_rows,
                         const int32_t *ids, const float *weights, int n_used, float *out,
                         const moe_expert_scratch *s, moe_expert_stats *stats) {
    const moe_tensor *gate = set->gate_up ? set->gate_up : set->gate, *up = set->up;
    const moe_tensor *down = set->down;
    const bool fused = set->gate_up != NULL;
    const int64_t n_expert = gate->ne[2], n_in = gate->ne[0], n_ff = down->ne[0];
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
    /* counts[e] now ends e's run; its start is counts[e - 1] (0 for e = 0). Experts go in
     * groups whose pairs fit the scratch: each group's gate and up matmuls run as one parallel
     * pass, then its down matmuls as another (one pool hand-out each, not three per expert);
     * the weighted outputs are added back in expert order, so every row sums its experts in
     * the same order whatever else is in the batch. */
    moe_matmul_task tasks[MOE_MATMUL_MANY_MAX];
    int32_t group[MOE_MATMUL_MANY_MAX / 2];
    moe_tensor views[3 * (MOE_MATMUL_MANY_MAX / 2)]; /* a group's matrices from the source */
    const moe_expert_source *src = set->source;
    const int max_group =
        src && src->max_group < MOE_MATMUL_MANY_MAX / 2 ? src->max_group : MOE_MATMUL_MANY_MAX / 2;
    const uint64_t xq_in =
        fused || moe_matmul_scratch_bytes(gate, 1) > moe_matmul_scratch_bytes(up, 1)
            ? moe_matmul_scratch_bytes(gate, 1)
            : moe_matmul_scratch_bytes(up, 1);
    const uint64_t xq_ff = moe_matmul_scratch_bytes(down, 1);
    uint64_t touched = 0;
    for (int64_t e = 0; e < n_expert;) {
        int n_group = 0;
        int64_t rows = 0;
        for (; e < n_expert && n_group < max_group; e++) {
            const int64_t n = s->counts[e] - (e ? s->counts[e - 1] : 0);
            if (n == 0 || (set->n_shards > 1 && e % set->n_shards != set->shard)) continue;
            if (rows + n > s->max_rows) break; /* the next group starts with e */
            group[n_group++] = (int32_t)e;
            rows += n;
        }
        if (src && n_group && !src->acquire(src->ctx, group, n_group, views)) return false;
            /* an expert's matrices: its slice of the stacked tensors, or the source's views */
#define EXPERT_W(g, k, t) (src ? &views[3 * (g) + (k)] : (t))
#define EXPERT_I(g)       (src ? 0 : group[g])
        /* gather each expert's rows, then gate and up for the whole group (fused: one matmul
         * per expert into rows of [gate, up], split below) */
        int64_t off = 0, n_tasks = 0;
        for (int g = 0; g < n_group; g++) {
            const int64_t ge = group[g], begin = ge ? s->counts[ge - 1] : 0,
                          n = s->counts[ge] - begin;
            for (int64_t i = 0; i < n; i++)
                memcpy(s->x + (off + i) * n_in, x + (int64_t)s->pair_row[begin + i] * n_in,
                       sizeof(float) * (size_t)n_in);
            tasks[n_tasks++] = (moe_matmul_task){EXPERT_W(g, 0, gate),
                                                 EXPERT_I(g),
                                                 s->x + off * n_in,
                                                 n,
                                                 s->gate + off * (fused ? 2 : 1) * n_ff,
                                                 (uint8_t *)s->mm + (uint64_t)off * xq_in};
            if (!fused)
                tasks[n_tasks++] = (moe_matmul_task){
                    EXPERT_W(g, 1, up), EXPERT_I(g),
                    s->x + off * n_in,  n,
                    s->up + off * n_ff, (uint8_t *)s->mm_up + (uint64_t)off * xq_in};
            off += n;
        }
        moe_matmul_many(pool, tasks, (int)n_tasks);
        if (fused) /* rows [gate, up] -> gate rows and up rows (gate moves down in place) */
            for (int64_t i = 0; i < rows; i++) {
                memcpy(s->up + i * n_ff, s->gate + (2 * i + 1) * n_ff, sizeof(float) * n_ff);
                memmove(s->gate + i * n_ff, s->gate + 2 * i * n_ff, sizeof(float) * n_ff);
            }
        off = 0;
        for (int g = 0; g < n_group; g++) {
            const int64_t ge = group[g], n = s->counts[ge] - (ge ? s->counts[ge - 1] : 0);
            moe_add_bias(s->gate + off * n_ff, set->gate_b, ge, n, n_ff);
            moe_add_bias(s->up + off * n_ff, set->up_b, ge, n, n_ff);
            tasks[g] =
                (moe_matmul_task){EXPERT_W(g, 2, down), EXPERT_I(g),
                                  s->up + off * n_ff,   n,
                                  s->y + off * n_in,    (uint8_t *)s->mm + (uint64_t)off * xq_ff};
            off += n;
        }
        moe_glu(set->act, set->limit, s->up, s->gate, rows * n_ff);
        moe_matmul_many(pool, tasks, n_group);
        if (src && n_group) src->release(src->ctx, group, n_group);
#undef EXPERT_W
#undef EXPERT_I
        off = 0;
        for (int g = 0; g < n_group; g++) {
            const int64_t ge = group[g], begin = ge ? s->counts[ge - 1] : 0,
                          n = s->counts[ge] - begin;
            moe_add_bias(s->y + off * n_in, set->down_b, ge, n, n_in);
            for (int64_t i = 0; i < n; i++) {
                float *o = out + (int64_t)s->pair_row[begin + i] * n_in;
                const float w = s->pair_w[begin + i], *y = s->y + (off + i) * n_in;
                for (int64_t d = 0; d < n_in; d++) o[d] += w * y[d];
            }
            off += n;
        }
        touched += (uint64_t)n_group;
    }
    if (stats) {
        stats->rows += (uint64_t)n_rows;
        stats->pairs += (uint64_t)n_pairs;
        stats->experts += touched;
    }
    return true;
}
