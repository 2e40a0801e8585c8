/* hyper.c: the residual stream of a model with hyper-connections (GLM-5.3's mHC): n_hc streams
 * per token instead of one.
 *
 * Around every block: the mixing logits come from the RMS-normed (unweighted) concatenation of a
 * row's streams through the site's hc_*_fn; the block's input is the pre-weighted sum of the
 * streams, and its output is added to each stream with the post weights after the streams are
 * mixed by the Sinkhorn-balanced combination matrix (ops/hyper.c). The embedding starts every
 * stream; the head reads their plain mean. Rows are independent, so the row loops run on the
 * pool and a row's result never depends on the others in its batch. The weighted sums over
 * streams are the kernel table's row updates (moe_rows_update_fn: vectors across the row, each
 * value the scalar loop's products and adds in its order). */
#include "engine_internal.h"

#include <stdlib.h>
#include <string.h>

#include "../ops/ops.h"

void moe_hc_alloc(moe_ctx *c) {
    const moe_model_config *cfg = &c->m->cfg;
    moe_hc_ctx *hc = &c->hc;
    const uint64_t rows = c->p.max_rows, n = cfg->n_hc;
    hc->wide = moe_xcalloc(rows * n * cfg->n_embd, sizeof(float));
    hc->mix = moe_xcalloc(rows * (2 + n) * n, sizeof(float));
    hc->in = moe_xcalloc(rows * cfg->n_embd, sizeof(float));
    hc->post = moe_xcalloc(rows * n, sizeof(float));
    hc->comb = moe_xcalloc(rows * n * n, sizeof(float));
}

void moe_hc_free(moe_ctx *c) {
    moe_hc_ctx *hc = &c->hc;
    free(hc->wide);
    free(hc->mix);
    free(hc->in);
    free(hc->post);
    free(hc->comb);
    memset(hc, 0, sizeof *hc);
}

typedef struct hc_job {
    moe_ctx *c;
    const moe_hc_weights *w;
} hc_job;

static void hc_begin(moe_ctx *c, const float *embd, uint32_t n_rows) {
    const int64_t n_embd = c->m->cfg.n_embd, n = c->m->cfg.n_hc;
    for (uint32_t r = 0; r < n_rows; r++)
        for (int64_t s = 0; s < n; s++)
            memcpy(c->x + (r * n + s) * n_embd, embd + r * n_embd, sizeof(float) * (size_t)n_embd);
}

/* Rows [begin, end): pre / post / combination weights from the mixing logits, and the block
 * input = sum of the streams by their pre weights. */
static void pre_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const hc_job *j = arg;
    moe_ctx *c = j->c;
    const moe_model_config *cfg = &c->m->cfg;
    moe_hc_ctx *hc = &c->hc;
    const int64_t n_embd = cfg->n_embd, n = cfg->n_hc, n_mix = (2 + n) * n;
    const moe_kernels *kern = moe_kernels_get();
    float pre[MOE_MAX_HC];
    for (int64_t r = begin; r < end; r++) {
        moe_hc_mix_weights(hc->mix + r * n_mix, (const float *)j->w->base->data,
                           (const float *)j->w->scale->data, (int)n, (int)cfg->hc_sinkhorn_iters,
                           cfg->hc_eps, pre, hc->post + r * n, hc->comb + r * n * n);
        float *in = hc->in + r * n_embd; /* sum over s of pre[s] x stream s, from 0 */
        memset(in, 0, sizeof(float) * (size_t)n_embd);
        kern->rows_update(in, 0, 1, NULL, pre, 0, c->x + r * n * n_embd, n_embd, (int)n,
                          (int)n_embd);
    }
}

static const float *hc_pre(moe_ctx *c, const moe_layer_weights *l, moe_site site, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    moe_hc_ctx *hc = &c->hc;
    const int64_t wide = (int64_t)cfg->n_hc * cfg->n_embd;
    hc_job job = {.c = c, .w = site == MOE_SITE_MIXER ? &l->hc_attn : &l->hc_ffn};
    moe_rmsnorm_rows(c->pool, hc->wide, c->x, NULL, n_rows, wide, cfg->rms_eps);
    moe_matmul(c->pool, job.w->fn, 0, hc->wide, n_rows, hc->mix, c->mm_scratch);
    moe_pool_for(c->pool, n_rows, 1, pre_rows, &job);
    return hc->in;
}

/* Rows [begin, end): stream dst = post[dst] * y + sum over src of comb[src][dst] * stream src,
 * into hc->wide (the streams read stay in c->x until every row is done). */
static void post_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const hc_job *j = arg;
    moe_ctx *c = j->c;
    const moe_model_config *cfg = &c->m->cfg;
    moe_hc_ctx *hc = &c->hc;
    const int64_t n_embd = cfg->n_embd, n = cfg->n_hc;
    const moe_kernels *kern = moe_kernels_get();
    for (int64_t r = begin; r < end; r++) {
        float *x = c->x + r * n * n_embd, *out = hc->wide + r * n * n_embd;
        const float *y = c->y + r * n_embd, *post = hc->post + r * n, *comb = hc->comb + r * n * n;
        float into[MOE_MAX_HC * MOE_MAX_HC]; /* into[dst][src] = comb[src][dst] */
        for (int64_t dst = 0; dst < n; dst++) {
            for (int64_t src = 0; src < n; src++) into[dst * n + src] = comb[src * n + dst];
            memcpy(out + dst * n_embd, y, sizeof(float) * (size_t)n_embd);
        }
        /* stream dst: post[dst] y, then comb[src][dst] x stream src for each src */
        kern->rows_update(out, n_embd, (int)n, post, into, n, x, n_embd, (int)n, (int)n_embd);
    }
}

static void hc_post(moe_ctx *c, const moe_layer_weights *l, moe_site site, uint32_t n_rows) {
    (void)l, (void)site;
    hc_job job = {.c = c};
    moe_pool_for(c->pool, n_rows, 1, post_rows, &job);
    float *streams = c->hc.wide; /* the new streams: the buffers trade places, no copy back */
    c->hc.wide = c->x;
    c->x = streams;
}

static const float *hc_final(moe_ctx *c, uint32_t r) {
    const int64_t n_embd = c->m->cfg.n_embd, n = c->m->cfg.n_hc;
    const float *x = c->x + (int64_t)r * n * n_embd;
    float *mean = c->hc.in + (int64_t)r * n_embd;
    for (int64_t i = 0; i < n_embd; i++) {
        float sum = 0.0f;
        for (int64_t s = 0; s < n; s++) sum += x[s * n_embd + i];
        mean[i] = sum / (float)n;
    }
    return mean;
}

const moe_stream_ops moe_stream_hc = {
    .begin = hc_begin,
    .pre = hc_pre,
    .post = hc_post,
    .final = hc_final,
};
