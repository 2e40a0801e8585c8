/* linear.c: the linear-attention block of hybrid models -- Gated DeltaNet (qwen3next) and Kimi
 * Delta Attention (kimi-linear) -- and the recurrent state it reads and writes.
 *
 * A batch may interleave rows of many sequences; the block groups them by sequence (keeping each
 * sequence's rows in position order), runs the projections over all rows at once, then per
 * sequence the short conv and the delta rule on that sequence's own state, per head in
 * parallel, and scatters the output back to the batch rows. The two architectures differ only in
 * how q|k|v, the decay g, beta and the output gate are projected; the recurrence and the gated
 * norm are shared (ops/linear_attn.c). The trap: state is updated in place, so a failed call
 * must not get here (rows are validated first), and a sequence's rows must all be in one call's
 * order for the chunked form to see them consecutively. */
#include "engine_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Runs of at least this many tokens of one sequence use the chunked delta rule. */
#define LINEAR_CHUNKED_MIN 8

/* ==== State and scratch ==== */

typedef struct linear_dims {
    int64_t hd, nk, nv, K, V, conv_ch, n_g;
} linear_dims;

static linear_dims dims_of(const moe_model_config *c, moe_mixer mixer) {
    linear_dims d = {.hd = c->ssm_head_dim, .nk = c->ssm_n_k_heads, .nv = c->ssm_n_v_heads};
    d.K = d.nk * d.hd;
    d.V = d.nv * d.hd;
    d.conv_ch = 2 * d.K + d.V;
    d.n_g = mixer == MOE_MIXER_KDA ? d.hd : 1;
    return d;
}

/* The mixer of a hybrid's linear layers (ATTENTION: none). */
static moe_mixer linear_mixer(const moe_model *m) {
    for (uint32_t il = 0; il < m->cfg.n_layer; il++)
        if (moe_layer_state_of(&m->cfg, il).state_values) return m->cfg.layer[il].mixer;
    return MOE_MIXER_ATTENTION;
}

void moe_linear_plan(const moe_model *m, moe_linear_ctx *lin) {
    memset(lin, 0, sizeof *lin);
    const moe_model_config *c = &m->cfg;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const uint64_t floats = moe_layer_state_of(c, il).state_values;
        if (!floats) continue;
        lin->n_layer++;
        lin->layer_floats = floats;
    }
    const uint64_t conv_ch = (2ull * c->ssm_n_k_heads + c->ssm_n_v_heads) * c->ssm_head_dim;
    if (lin->n_layer) lin->conv_floats = conv_ch * (c->ssm_d_conv - 1);
}

void moe_linear_alloc(moe_ctx *c) {
    const moe_model *m = c->m;
    const moe_model_config *cfg = &m->cfg;
    moe_linear_ctx *lin = &c->lin;
    const int n_threads = moe_pool_n_threads(c->pool);
    moe_linear_plan(m, lin);
    if (!lin->n_layer) return;
    const linear_dims d = dims_of(cfg, linear_mixer(m));
    const uint64_t rows = c->p.max_rows;
    lin->state = moe_xcalloc((size_t)c->p.n_seq * lin->n_layer * lin->layer_floats, sizeof(float));
    lin->order = moe_xcalloc(rows, sizeof(int32_t));
    lin->seq_count = moe_xcalloc(c->p.n_seq + 1, sizeof(int32_t));
    lin->segs = moe_xcalloc(rows, sizeof *lin->segs);
    lin->x = moe_xcalloc(rows * cfg->n_embd, sizeof(float));
    lin->qkv = moe_xcalloc(rows * d.conv_ch, sizeof(float));
    lin->z = moe_xcalloc(rows * d.V, sizeof(float));
    lin->g = moe_xcalloc(rows * d.nv * d.n_g, sizeof(float));
    lin->beta = moe_xcalloc(rows * d.nv, sizeof(float));
    lin->tmp = moe_xcalloc(rows * (2 * d.nv > d.hd ? 2 * d.nv : d.hd), sizeof(float));
    lin->out = moe_xcalloc(rows * d.V, sizeof(float));
    lin->y = moe_xcalloc(rows * cfg->n_embd, sizeof(float));
    lin->delta_scratch = moe_xcalloc(
        (size_t)n_threads * moe_delta_scratch_floats((int)d.hd, (int)d.hd), sizeof(float));
}

void moe_linear_free(moe_ctx *c) {
    moe_linear_ctx *lin = &c->lin;
    free(lin->state);
    free(lin->order);
    free(lin->seq_count);
    free(lin->segs);
    free(lin->x);
    free(lin->qkv);
    free(lin->z);
    free(lin->g);
    free(lin->beta);
    free(lin->tmp);
    free(lin->out);
    free(lin->y);
    free(lin->delta_scratch);
    memset(lin, 0, sizeof *lin);
}

float *moe_linear_seq_state(const moe_ctx *c, int32_t seq) {
    return c->lin.state + (uint64_t)seq * c->lin.n_layer * c->lin.layer_floats;
}

uint32_t moe_verify_checkpoints(const moe_ctx_params *p) {
    return p->n_verify ? p->n_verify - 1 : 0;
}

float *moe_linear_checkpoint(const moe_ctx *c, int32_t seq, uint32_t row) {
    return c->ckpt + ((uint64_t)seq * moe_verify_checkpoints(&c->p) + row) * c->lin.n_layer *
                         c->lin.layer_floats;
}

/* ==== Grouping rows by sequence ==== */

/* Counting sort of the rows by sequence (stable: each sequence keeps its position order);
 * returns the number of segments. */
static uint32_t group_rows(moe_ctx *c, const moe_row *rows, uint32_t n_rows) {
    moe_linear_ctx *lin = &c->lin;
    int32_t *count = lin->seq_count;
    memset(count, 0, sizeof(int32_t) * (c->p.n_seq + 1));
    for (uint32_t r = 0; r < n_rows; r++) count[rows[r].seq + 1]++;
    uint32_t n_seg = 0;
    for (uint32_t s = 0; s < c->p.n_seq; s++) {
        if (count[s + 1]) lin->segs[n_seg++] = (moe_linear_seg){(int32_t)s, count[s], count[s + 1]};
        count[s + 1] += count[s];
    }
    for (uint32_t r = 0; r < n_rows; r++) lin->order[count[rows[r].seq]++] = (int32_t)r;
    return n_seg;
}

/* ==== Per-architecture projections: q|k|v (pre-conv), z, g, beta ==== */

static void project_gdn(moe_ctx *c, const moe_linear_weights *w, const linear_dims *d,
                        uint32_t n_rows) {
    moe_linear_ctx *lin = &c->lin;
    moe_matmul(c->pool, w->qkv, 0, lin->x, n_rows, lin->qkv, c->mm_scratch);
    moe_matmul(c->pool, w->gate, 0, lin->x, n_rows, lin->z, c->mm_scratch);
    const float *a_log = (const float *)w->a->data, *dt_b = (const float *)w->dt_b->data;
    const int64_t nv = d->nv, rf = nv / d->nk;
    if (!w->ba) { /* beta and alpha from their own projections: alpha becomes g in place */
        moe_matmul(c->pool, w->beta, 0, lin->x, n_rows, lin->beta, c->mm_scratch);
        moe_matmul(c->pool, w->alpha, 0, lin->x, n_rows, lin->g, c->mm_scratch);
        for (int64_t i = 0; i < (int64_t)n_rows * nv; i++) {
            lin->beta[i] = 1.0f / (1.0f + expf(-lin->beta[i]));
            lin->g[i] = a_log[i % nv] * moe_softplus(lin->g[i] + dt_b[i % nv]);
        }
        return;
    }
    /* per k head: [beta x rf, alpha x rf]; v head h = k head * rf + i */
    moe_matmul(c->pool, w->ba, 0, lin->x, n_rows, lin->tmp, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) {
        const float *ba = lin->tmp + (int64_t)r * 2 * nv;
        for (int64_t h = 0; h < nv; h++) {
            const float *grp = ba + (h / rf) * 2 * rf;
            lin->beta[r * nv + h] = 1.0f / (1.0f + expf(-grp[h % rf]));
            lin->g[r * nv + h] = a_log[h] * moe_softplus(grp[rf + h % rf] + dt_b[h]);
        }
    }
}

/* A layer's work on the pool: by rows, LINEAR_ROWS a work item (each row its own), or the short
 * conv's channels over one sequence's n rows from x, its state conv. */
#define LINEAR_ROWS 4

typedef struct linear_job {
    moe_ctx *c;
    const linear_dims *d;
    const moe_layer_weights *l;
    float *x, *conv; /* the conv's */
    int64_t n;
} linear_job;

/* KDA's per-channel log decays and per-head betas from their projections (d_v exps a row). */
static void kda_gates_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const linear_dims *d = j->d;
    moe_linear_ctx *lin = &j->c->lin;
    const float *a_log = (const float *)j->l->linear.a->data;
    const float *dt_b = (const float *)j->l->linear.dt_b->data;
    const float bound = j->c->m->cfg.kda_gate_bound;
    /* the fast path's sigmoid (quant.h: moe_silu_fn); libm's expf on the exact one */
    const moe_silu_fn sigmoid = moe_exact() ? NULL : moe_kernels_get()->sigmoid;
    for (int64_t r = begin; r < end; r++) {
        float *g = lin->g + r * d->V, *beta = lin->beta + r * d->nv;
        /* a = -exp(A_log): Kimi's unbounded decay, or GLM-5.3's bound * sigmoid(-a t) */
        if (bound < 0 && sigmoid) {
            for (int64_t i = 0; i < d->V; i++) g[i] = -(a_log[i / d->hd] * (g[i] + dt_b[i]));
            sigmoid(g, d->V);
            for (int64_t i = 0; i < d->V; i++) g[i] *= bound;
        } else {
            for (int64_t i = 0; i < d->V; i++) {
                const float a = a_log[i / d->hd], t = g[i] + dt_b[i];
                g[i] = bound < 0 ? bound / (1.0f + expf(a * t)) : a * moe_softplus(t);
            }
        }
        if (sigmoid)
            sigmoid(beta, d->nv);
        else
            for (int64_t h = 0; h < d->nv; h++) beta[h] = 1.0f / (1.0f + expf(-beta[h]));
    }
}

static void project_kda(moe_ctx *c, const moe_layer_weights *l, const linear_dims *d,
                        uint32_t n_rows) {
    moe_linear_ctx *lin = &c->lin;
    const moe_linear_weights *w = &l->linear;
    /* q, k and v land side by side in qkv's rows: project each into out, then place it */
    const moe_tensor *qkv[3] = {w->wq, w->wk, w->wv};
    const int64_t ofs[3] = {0, d->K, 2 * d->K}, width[3] = {d->K, d->K, d->V};
    for (int i = 0; i < 3; i++) {
        moe_matmul(c->pool, qkv[i], 0, lin->x, n_rows, lin->out, c->mm_scratch);
        for (uint32_t r = 0; r < n_rows; r++)
            memcpy(lin->qkv + r * d->conv_ch + ofs[i], lin->out + r * width[i],
                   sizeof(float) * (size_t)width[i]);
    }
    moe_matmul(c->pool, w->f_a, 0, lin->x, n_rows, lin->tmp, c->mm_scratch);
    moe_matmul(c->pool, w->f_b, 0, lin->tmp, n_rows, lin->g, c->mm_scratch);
    moe_matmul(c->pool, w->g_a, 0, lin->x, n_rows, lin->tmp, c->mm_scratch);
    moe_matmul(c->pool, w->g_b, 0, lin->tmp, n_rows, lin->z, c->mm_scratch);
    moe_matmul(c->pool, w->beta, 0, lin->x, n_rows, lin->beta, c->mm_scratch);
    const double start = moe_profile_start();
    linear_job job = {.c = c, .d = d, .l = l};
    moe_pool_for(c->pool, n_rows, LINEAR_ROWS, kda_gates_rows, &job);
    moe_profile_part("linear attention: gates + output norms", start);
}

/* ==== The recurrence, one (segment, v head) per item ==== */

typedef struct delta_job {
    moe_ctx *c;
    const linear_dims *d;
    uint32_t slot; /* linear layer index */
} delta_job;

static void delta_heads(void *arg, int64_t begin, int64_t end, int thread) {
    const delta_job *j = arg;
    const moe_linear_ctx *lin = &j->c->lin;
    const linear_dims *d = j->d;
    float *scratch =
        lin->delta_scratch + (uint64_t)thread * moe_delta_scratch_floats((int)d->hd, (int)d->hd);
    for (int64_t item = begin; item < end; item++) {
        const moe_linear_seg *seg = &lin->segs[item / d->nv];
        const int64_t h = item % d->nv, r0 = seg->begin;
        const int64_t hk = j->c->m->cfg.ssm_tiled_heads ? h % d->nk : h / (d->nv / d->nk);
        float *state = moe_linear_seq_state(j->c, seg->seq) + j->slot * lin->layer_floats +
                       lin->conv_floats + (uint64_t)h * d->hd * d->hd;
        const float *row = lin->qkv + r0 * d->conv_ch;
        const moe_delta_args a = {.d_k = (int)d->hd,
                                  .d_v = (int)d->hd,
                                  .n_g = (int)d->n_g,
                                  .scale = 1.0f / sqrtf((float)d->hd),
                                  .q = row + hk * d->hd,
                                  .k = row + d->K + hk * d->hd,
                                  .v = row + 2 * d->K + h * d->hd,
                                  .g = lin->g + r0 * d->nv * d->n_g + h * d->n_g,
                                  .beta = lin->beta + r0 * d->nv + h,
                                  .out = lin->out + r0 * d->V + h * d->hd,
                                  .qk_stride = d->conv_ch,
                                  .v_stride = d->conv_ch,
                                  .g_stride = d->nv * d->n_g,
                                  .beta_stride = d->nv,
                                  .out_stride = d->V};
        if (j->c->verifying) { /* row by row, the head's state kept after each but the last */
            const uint64_t at =
                j->slot * lin->layer_floats + lin->conv_floats + (uint64_t)h * d->hd * d->hd;
            for (int32_t i = 0; i < seg->n; i++) {
                moe_delta_args ai = a;
                ai.q += i * a.qk_stride, ai.k += i * a.qk_stride, ai.v += i * a.v_stride;
                ai.g += i * a.g_stride, ai.beta += i * a.beta_stride, ai.out += i * a.out_stride;
                moe_delta_rule_recurrent(&ai, 1, state, scratch);
                if (i + 1 < seg->n)
                    memcpy(moe_linear_checkpoint(j->c, seg->seq, (uint32_t)i) + at, state,
                           sizeof(float) * (size_t)(d->hd * d->hd));
            }
        } else if (seg->n >= LINEAR_CHUNKED_MIN) {
            moe_delta_rule_chunked(&a, seg->n, state, scratch);
        } else {
            moe_delta_rule_recurrent(&a, seg->n, state, scratch);
        }
    }
}

/* The short conv over n consecutive rows of one sequence, from and into its conv state: ranges
 * of channels on the pool (each channel is its own, so how they are split changes nothing). */
#define CONV_CHANNELS 512 /* channels per work item */

static void conv_channels(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const linear_dims *d = j->d;
    const moe_linear_weights *w = &j->l->linear;
    const int n_taps = (int)j->c->m->cfg.ssm_d_conv;
    /* one kernel over every channel, or separate q, k, v kernels over consecutive ranges */
    const bool one = !w->conv1d[1];
    const int64_t ofs[4] = {0, one ? d->conv_ch : d->K, 2 * d->K, d->conv_ch};
    for (int i = 0; i < (one ? 1 : 3); i++) {
        const int64_t lo = begin > ofs[i] ? begin : ofs[i],
                      hi = end < ofs[i + 1] ? end : ofs[i + 1];
        if (lo >= hi) continue;
        moe_conv1d_silu(j->x + lo, d->conv_ch, j->n, hi - lo,
                        (const float *)w->conv1d[i]->data + (lo - ofs[i]) * n_taps, n_taps,
                        j->conv + lo * (n_taps - 1));
    }
}

static void conv_rows(moe_ctx *c, const moe_layer_weights *l, const linear_dims *d, float *x,
                      int64_t n, float *conv) {
    linear_job job = {.c = c, .d = d, .l = l, .x = x, .conv = conv, .n = n};
    moe_pool_for(c->pool, d->conv_ch, CONV_CHANNELS, conv_channels, &job);
}

/* ==== The per-head norms ==== */

/* q and k heads L2-normalised (after the conv, before the recurrence) */
static void l2norm_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const linear_dims *d = j->d;
    for (int64_t r = begin; r < end; r++)
        for (int64_t h = 0; h < 2 * d->nk; h++)
            moe_l2norm(j->c->lin.qkv + r * d->conv_ch + h * d->hd, d->hd, j->c->m->cfg.l2_eps);
}

/* the outputs' gated RMSNorm per head: silu(z) for GDN, sigmoid(g_b(g_a x)) for KDA */
static void gated_norm_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const linear_dims *d = j->d;
    moe_linear_ctx *lin = &j->c->lin;
    const float *ssm_norm = (const float *)j->l->linear.norm->data;
    const moe_gate_act act = j->l->plan.mixer == MOE_MIXER_GDN ? MOE_GATE_SILU : MOE_GATE_SIGMOID;
    for (int64_t h = begin * d->nv; h < end * d->nv; h++) {
        float *o = lin->out + h * d->hd;
        moe_rmsnorm(o, o, ssm_norm, d->hd, j->c->m->cfg.rms_eps);
        moe_gate_mul(o, lin->z + h * d->hd, d->hd, act);
    }
}

/* ==== The block ==== */

void moe_block_linear(moe_ctx *c, const moe_layer_weights *l, uint32_t il, const moe_row *rows,
                      uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_linear_weights *w = &l->linear;
    moe_linear_ctx *lin = &c->lin;
    const linear_dims d = dims_of(cfg, l->plan.mixer);
    const int64_t n_embd = cfg->n_embd;
    const uint32_t slot = c->layer_slot[il];
    const uint32_t n_seg = group_rows(c, rows, n_rows);

    for (uint32_t i = 0; i < n_rows; i++)
        memcpy(lin->x + i * n_embd, c->xn + (int64_t)lin->order[i] * n_embd,
               sizeof(float) * (size_t)n_embd);
    if (l->plan.mixer == MOE_MIXER_GDN)
        project_gdn(c, w, &d, n_rows);
    else
        project_kda(c, l, &d, n_rows);

    /* the short conv runs along each sequence's rows, from that sequence's conv state (in a
     * verify step one row at a time, the conv state kept after each but the last) */
    double start = moe_profile_start();
    for (uint32_t s = 0; s < n_seg; s++) {
        const moe_linear_seg *seg = &lin->segs[s];
        float *conv = moe_linear_seq_state(c, seg->seq) + slot * lin->layer_floats;
        float *x = lin->qkv + (int64_t)seg->begin * d.conv_ch;
        if (!c->verifying) {
            conv_rows(c, l, &d, x, seg->n, conv);
            continue;
        }
        for (int32_t i = 0; i < seg->n; i++) {
            conv_rows(c, l, &d, x + (int64_t)i * d.conv_ch, 1, conv);
            if (i + 1 < seg->n)
                memcpy(moe_linear_checkpoint(c, seg->seq, (uint32_t)i) + slot * lin->layer_floats,
                       conv, sizeof(float) * lin->conv_floats);
        }
    }
    linear_job nj = {.c = c, .d = &d, .l = l};
    moe_pool_for(c->pool, n_rows, LINEAR_ROWS, l2norm_rows, &nj);
    moe_profile_part("linear attention: conv + L2 norms", start);

    start = moe_profile_start();
    delta_job job = {.c = c, .d = &d, .slot = slot};
    moe_pool_for(c->pool, (int64_t)n_seg * d.nv, 1, delta_heads, &job);
    moe_profile_part("linear attention: delta rule", start);

    start = moe_profile_start();
    moe_pool_for(c->pool, n_rows, LINEAR_ROWS, gated_norm_rows, &nj);
    moe_profile_part("linear attention: gates + output norms", start);
    moe_matmul(c->pool, w->out, 0, lin->out, n_rows, lin->y, c->mm_scratch);
    for (uint32_t i = 0; i < n_rows; i++)
        memcpy(c->y + (int64_t)lin->order[i] * n_embd, lin->y + i * n_embd,
               sizeof(float) * (size_t)n_embd);
}
