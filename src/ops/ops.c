/* ops.c: reference implementations of norms, activations, rope, matmul and attention.
 *
 * Plain C, float32 accumulation; matmuls go through the active ISA kernel table. These are the
 * semantics the fast kernels must reproduce; rope follows ggml's cache construction (theta
 * multiplied by theta_scale pair after pair) so positions produce the same angles as llama.cpp to
 * the last bit. */
#include "ops.h"

#include <math.h>
#include <string.h>

/* ==== Elementwise and norms ==== */

/* out = x * scale * w (w NULL: ggml_rms_norm without a weight, x * scale); out may alias x, so
 * each step's values are read into t before any is written. */
static void rmsnorm_apply(float *out, const float *x, const float *w, int64_t n, float scale) {
    int64_t i = 0;
    for (; i + MOE_VEC_STEP <= n; i += MOE_VEC_STEP) {
        float t[MOE_VEC_STEP];
        for (int k = 0; k < MOE_VEC_STEP; k++) t[k] = x[i + k] * scale;
        if (w)
            for (int k = 0; k < MOE_VEC_STEP; k++) t[k] *= w[i + k];
        memcpy(out + i, t, sizeof t);
    }
    for (; i < n; i++) out[i] = w ? x[i] * scale * w[i] : x[i] * scale;
}

/* ggml sums the squares in a wider type, one after the other, then divides. */
static float rmsnorm_scale(double sum_squares, int64_t n, float eps) {
    return 1.0f / sqrtf((float)(sum_squares / (double)n) + eps);
}

void moe_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    rmsnorm_apply(out, x, w, n, rmsnorm_scale(sum, n, eps));
}

void moe_layernorm(float *out, const float *x, const float *w, const float *b, int64_t n,
                   float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    const float mean = (float)(sum / (double)n);
    double var = 0.0;
    for (int64_t i = 0; i < n; i++) var += (double)((x[i] - mean) * (x[i] - mean));
    const float scale = 1.0f / sqrtf((float)(var / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * scale * w[i] + b[i];
}

int32_t moe_argmax(const float *v, uint32_t n) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return (int32_t)best;
}

void moe_swiglu(float *x, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        x[i] *= g / (1.0f + expf(-g));
    }
}

void moe_swiglu_oai(float *x, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) { /* ggml's order of operations, for its last bits */
        const float g = fminf(gate[i], MOE_SWIGLU_OAI_LIMIT);
        const float u = fminf(fmaxf(x[i], -MOE_SWIGLU_OAI_LIMIT), MOE_SWIGLU_OAI_LIMIT);
        const float out_glu = g / (1.0f + expf(MOE_SWIGLU_OAI_ALPHA * (-g)));
        x[i] = out_glu * (u + 1.0f);
    }
}

float moe_gelu(float x) {
    const float sqrt_2_over_pi = 0.79788456080286535588f, coef = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef * x * x)));
}

void moe_geglu(float *x, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= moe_gelu(gate[i]);
}

void moe_swiglu_clamped(float *x, const float *gate, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float g = fminf(gate[i], limit);
        x[i] = fminf(fmaxf(x[i], -limit), limit) * (g / (1.0f + expf(-g)));
    }
}

void moe_glu(moe_ffn_act act, float limit, float *x, const float *gate, int64_t n) {
    if (act == MOE_ACT_SILU && !moe_exact()) /* quant.h: moe_swiglu_fn */
        moe_kernels_get()->swiglu(x, gate, n, limit);
    else if (act == MOE_ACT_SWIGLU_OAI)
        moe_swiglu_oai(x, gate, n);
    else if (act == MOE_ACT_GELU)
        moe_geglu(x, gate, n);
    else if (limit > 0)
        moe_swiglu_clamped(x, gate, n, limit);
    else
        moe_swiglu(x, gate, n);
}

/* ==== The same on all of a pool's threads ====
 * Rows (or runs of values) are independent, so how they are shared out never changes a bit; under
 * PARALLEL_MIN_VALUES values the caller does it alone (a hand-out costs more). */
#define PARALLEL_MIN_VALUES (16 << 10)
#define PARALLEL_CHUNK      (4 << 10) /* values per work item */

typedef struct rmsnorm_job {
    float *out;
    const float *x, *w;
    int64_t n;
    float eps;
} rmsnorm_job;

/* Rows whose sums of squares run side by side: each row's sum is still one chain in ggml's
 * order (the same bits), but one chain waits on its add's latency at every value, and
 * RMSNORM_ROWS chains fill those waits. Zen 5, 8 rows of 2048 values (load 4-7): 1.3 -> 0.5 ns
 * a value. */
#define RMSNORM_ROWS 8

static void rmsnorm_items(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const rmsnorm_job *j = arg;
    const int64_t n = j->n;
    int64_t r = begin;
    for (; r + RMSNORM_ROWS <= end; r += RMSNORM_ROWS) {
        const float *x = j->x + r * n;
        double sum[RMSNORM_ROWS];
#pragma GCC unroll 8
        for (int k = 0; k < RMSNORM_ROWS; k++) sum[k] = 0.0;
        for (int64_t i = 0; i < n; i++)
#pragma GCC unroll 8
            for (int k = 0; k < RMSNORM_ROWS; k++) sum[k] += (double)(x[k * n + i] * x[k * n + i]);
        for (int k = 0; k < RMSNORM_ROWS; k++)
            rmsnorm_apply(j->out + (r + k) * n, x + k * n, j->w, n,
                          rmsnorm_scale(sum[k], n, j->eps));
    }
    for (; r < end; r++) moe_rmsnorm(j->out + r * n, j->x + r * n, j->w, n, j->eps);
}

void moe_rmsnorm_rows(moe_pool *pool, float *out, const float *x, const float *w, int64_t n_rows,
                      int64_t n, float eps) {
    rmsnorm_job j = {out, x, w, n, eps};
    const int64_t chunk = ((PARALLEL_CHUNK + n - 1) / n + RMSNORM_ROWS - 1) & ~(RMSNORM_ROWS - 1);
    if (n_rows * n < PARALLEL_MIN_VALUES)
        rmsnorm_items(&j, 0, n_rows, 0);
    else
        moe_pool_for(pool, n_rows, chunk, rmsnorm_items, &j);
}

/* An elementwise pass over n values: moe_glu with act and limit, or (add) x += gate. */
typedef struct elementwise_job {
    moe_ffn_act act;
    float limit;
    bool add;
    float *x;
    const float *gate;
} elementwise_job;

static void elementwise_items(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const elementwise_job *j = arg;
    if (!j->add) {
        moe_glu(j->act, j->limit, j->x + begin, j->gate + begin, end - begin);
        return;
    }
    int64_t i = begin;
    for (; i + MOE_VEC_STEP <= end; i += MOE_VEC_STEP) {
        float t[MOE_VEC_STEP]; /* x may alias gate */
        for (int k = 0; k < MOE_VEC_STEP; k++) t[k] = j->x[i + k] + j->gate[i + k];
        memcpy(j->x + i, t, sizeof t);
    }
    for (; i < end; i++) j->x[i] += j->gate[i];
}

static void elementwise_pool(moe_pool *pool, elementwise_job *j, int64_t n) {
    if (n < PARALLEL_MIN_VALUES)
        elementwise_items(j, 0, n, 0);
    else
        moe_pool_for(pool, n, PARALLEL_CHUNK, elementwise_items, j);
}

void moe_glu_pool(moe_pool *pool, moe_ffn_act act, float limit, float *x, const float *gate,
                  int64_t n) {
    elementwise_job j = {.act = act, .limit = limit, .x = x, .gate = gate};
    elementwise_pool(pool, &j, n);
}

void moe_add_pool(moe_pool *pool, float *x, const float *y, int64_t n) {
    elementwise_job j = {.add = true, .x = x, .gate = y};
    elementwise_pool(pool, &j, n);
}

void moe_add_bias(float *y, const moe_tensor *bias, int64_t index, int64_t n_rows, int64_t n) {
    if (!bias) return;
    const float *b = (const float *)bias->data + index * n;
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] += b[i];
}

/* Softmax with an optional sink logit that joins the denominator only (-INFINITY: none), as
 * ggml's soft_max with sinks: the max includes the sink, the sum adds exp(sink - max). */
static void softmax_sink(float *x, int64_t n, float sink) {
    float max = sink;
    for (int64_t i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - max);
        sum += x[i];
    }
    if (sink != -INFINITY) sum += (double)expf(sink - max);
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

void moe_softmax(float *x, int64_t n) {
    softmax_sink(x, n, -INFINITY);
}

/* ==== Rope ==== */

/* ggml_rope_yarn_corr_dim: the pair index whose wavelength makes n_rot turns over n_ctx_orig */
static float rope_yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2 * (float)M_PI)) / (2 * logf(base));
}

/* The config's rope kind and scaling over n_dims dims with theta base. */
static moe_rope_params rope_params(const moe_model_config *c, uint32_t n_dims, float base) {
    moe_rope_params p = {.n_dims = c->rope_kind == MOE_ROPE_NONE ? 0 : (int)n_dims,
                         .neox = c->rope_kind == MOE_ROPE_NEOX,
                         .base = base,
                         .freq_scale = c->rope_freq_scale,
                         .ext_factor = c->rope_ext_factor,
                         .attn_factor = c->rope_attn_factor};
    const int n_ctx_orig = (int)c->rope_n_ctx_orig;
    const float start = floorf(rope_yarn_corr_dim(p.n_dims, n_ctx_orig, c->rope_beta_fast, p.base));
    const float end = ceilf(rope_yarn_corr_dim(p.n_dims, n_ctx_orig, c->rope_beta_slow, p.base));
    p.corr_dims[0] = fmaxf(0.0f, start);
    p.corr_dims[1] = fminf((float)(p.n_dims - 1), end);
    return p;
}

moe_rope_params moe_rope_params_from_config(const moe_model_config *c) {
    return rope_params(c, c->rope_dims, c->rope_base);
}

moe_rope_params moe_rope_params_of_layer(const moe_model_config *c, const moe_layer_plan *p) {
    return rope_params(c, p->rope_dims, p->rope_base);
}

/* cos and sin of pair i0/2 at unscaled angle theta_extrap, as ggml's rope_yarn. */
static void rope_yarn(float theta_extrap, int i0, const moe_rope_params *p, float *c, float *s) {
    const float theta_interp = p->freq_scale * theta_extrap;
    float theta = theta_interp, mscale = p->attn_factor;
    if (p->ext_factor != 0.0f) {
        const float y =
            (float)(i0 / 2 - p->corr_dims[0]) / fmaxf(0.001f, p->corr_dims[1] - p->corr_dims[0]);
        const float ramp_mix = (1 - fminf(1, fmaxf(0, y))) * p->ext_factor;
        theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
        mscale *= 1.0f + 0.1f * logf(1.0f / p->freq_scale);
    }
    *c = cosf(theta) * mscale;
    *s = sinf(theta) * mscale;
}

/* Rotation pairs a head may have (rope dims / 2). */
#define ROPE_MAX_PAIRS 512

void moe_rope(float *x, int n_heads, int head_dim, int64_t pos, const moe_rope_params *p) {
    if (p->n_dims <= 0) return; /* MOE_ROPE_NONE */
    const float theta_scale = powf(p->base, -2.0f / (float)p->n_dims);
    const int half = p->n_dims / 2;
    MOE_CHECK(half <= ROPE_MAX_PAIRS);
    /* every head turns by the same angles: their cos and sin once for all */
    float cos_i[ROPE_MAX_PAIRS], sin_i[ROPE_MAX_PAIRS];
    float theta = (float)pos;
    for (int i = 0; i < half; i++) {
        rope_yarn(p->freq_factors ? theta / p->freq_factors[i] : theta, 2 * i, p, &cos_i[i],
                  &sin_i[i]);
        theta *= theta_scale;
    }
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const int a = p->neox ? i : 2 * i, b = p->neox ? i + half : 2 * i + 1;
            const float x0 = xh[a], x1 = xh[b], c = cos_i[i], s = sin_i[i];
            xh[a] = x0 * c - x1 * s;
            xh[b] = x0 * s + x1 * c;
        }
    }
}

/* ==== Matmul ==== */

uint64_t moe_matmul_scratch_bytes(const moe_tensor *w, int64_t n_rows) {
    const moe_type_traits *t = moe_type_traits_get(w->type);
    if (!t || t->dot_type == MOE_TYPE_F32) return 0;
    return moe_dot_row_bytes(w->type, w->ne[0]) * (uint64_t)n_rows;
}

typedef struct matmul_job {
    const moe_type_kernels *k; /* the active ISA table's entry for the weight type */
    bool rows16;               /* the weights are in MOE_LAYOUT_ROWS16 (whole groups of rows) */
    const uint8_t *wbase;
    uint64_t w_row_bytes, xq_row_bytes;
    const uint8_t *xq;
    int64_t n_in, n_out, n_rows;
    float *y;
} matmul_job;

/* Tiling of a many-row matmul. Weight rows are taken MATMUL_W_BLOCK at a time (a few KiB: they
 * stay in L1/L2 while reused); against them, the activation rows go by in tiles of about
 * MATMUL_X_TILE bytes (they stay in L2 while the block's rows pass over them), and each weight
 * row meets a tile through moe_dot_rows, which decodes each weight block once for up to
 * MOE_DOT_ROWS activation rows. Without the tiles a 512-row prefill streams all 512 activation
 * rows (over 1 MiB) from L3 once per weight row. One row (decode) is the plain matvec. */
#define MATMUL_W_BLOCK 16
_Static_assert(MOE_DOT_TILE_W == MOE_ROWS16, "a tile kernel's weight rows are a repacked group");
#define MATMUL_X_TILE (192u << 10)

/* The weight stream through a chunk of rows is one run of addresses, but the hardware
 * prefetcher starts over at every 4 KiB page and at the chunk's start; so while a block of rows
 * computes, the bytes MATMUL_PREFETCH ahead of it (up to the matrix's end) are requested in
 * software, and a chunk's first bytes before its first row. */
#define MATMUL_PREFETCH (4u << 10)

static inline void prefetch_bytes(const uint8_t *p, const uint8_t *end) {
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

/* Rows [o0, o1) are about to be read for the first time (the caller's chunk starts at begin). */
static void matmul_prefetch_ahead(const matmul_job *j, int64_t begin, int64_t o0, int64_t o1) {
    const uint8_t *w = j->wbase + (uint64_t)o0 * j->w_row_bytes,
                  *w_end = j->wbase + (uint64_t)o1 * j->w_row_bytes,
                  *m_end = j->wbase + (uint64_t)j->n_out * j->w_row_bytes;
    const uint8_t *from = o0 == begin ? w : w + MATMUL_PREFETCH,
                  *to = w_end + MATMUL_PREFETCH < m_end ? w_end + MATMUL_PREFETCH : m_end;
    prefetch_bytes(from, to);
}

static void matmul_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const matmul_job *j = arg;
    int64_t tile = (int64_t)(MATMUL_X_TILE / j->xq_row_bytes);
    tile = tile < 4 ? 4 : tile & ~(int64_t)3; /* whole groups of the 4-row kernels */
    if (j->k->dot_tile) { /* the fast path: MOE_DOT_TILE_W weight rows in the lanes at a time */
        /* whole groups of 16 rows (amx's tile multiply; 88 rows left 8 to the slower kernel) */
        if (tile >= 2 * MOE_ROWS16) tile &= ~(int64_t)(MOE_ROWS16 - 1);
        for (int64_t o0 = begin; o0 < end; o0 += MOE_DOT_TILE_W) {
            const int n_w = (int)(end - o0 < MOE_DOT_TILE_W ? end - o0 : MOE_DOT_TILE_W);
            matmul_prefetch_ahead(j, begin, o0, o0 + n_w);
            /* a repacked group (o0 is a multiple of 16: chunks are whole tiles); the last
             * rows % 16 rows of a repacked matrix are in the file's layout */
            const moe_dot_tile_fn dot_tile =
                j->rows16 && n_w == MOE_ROWS16 ? j->k->dot_tile_rows16 : j->k->dot_tile;
            for (int64_t r0 = 0; r0 < j->n_rows; r0 += tile)
                dot_tile(j->wbase + (uint64_t)o0 * j->w_row_bytes, j->w_row_bytes, n_w,
                         j->xq + (uint64_t)r0 * j->xq_row_bytes, j->xq_row_bytes,
                         j->n_rows - r0 < tile ? j->n_rows - r0 : tile, j->n_in,
                         j->y + r0 * j->n_out + o0, j->n_out);
        }
        return;
    }
    for (int64_t o0 = begin; o0 < end; o0 += MATMUL_W_BLOCK) {
        const int64_t o1 = o0 + MATMUL_W_BLOCK < end ? o0 + MATMUL_W_BLOCK : end;
        matmul_prefetch_ahead(j, begin, o0, o1);
        for (int64_t r0 = 0; r0 < j->n_rows; r0 += tile) {
            const int64_t nr = j->n_rows - r0 < tile ? j->n_rows - r0 : tile;
            const uint8_t *x = j->xq + (uint64_t)r0 * j->xq_row_bytes;
            /* Two weight rows share each activation load, but only once the block is in cache
             * (the tiles after the first): streamed from memory, two interleaved weight rows
             * measured up to 2x slower than one (Q8_0, 2..8 rows), in cache 12 % faster. */
            const bool pairs = j->k->dot_rows2 && r0 > 0 && nr > 1;
            for (int64_t o = o0; o < o1; o++) {
                const uint8_t *w = j->wbase + (uint64_t)o * j->w_row_bytes;
                float *y = j->y + r0 * j->n_out + o;
                if (pairs && o + 1 < o1)
                    j->k->dot_rows2(w, j->w_row_bytes, x, j->xq_row_bytes, nr, j->n_in, y,
                                    j->n_out),
                        o++;
                else
                    moe_dot_rows(j->k, w, x, j->xq_row_bytes, nr, j->n_in, y, j->n_out);
            }
        }
    }
}

void moe_matmul_prefetch(const moe_tensor *w, int64_t matrix, uint64_t bytes) {
    if (!w->data) return;
    const uint64_t m_bytes = (uint64_t)w->ne[1] * moe_type_row_bytes(w->type, w->ne[0]);
    const uint8_t *m = w->data + (uint64_t)matrix * m_bytes;
    prefetch_bytes(m, m + (bytes < m_bytes ? bytes : m_bytes));
}

/* One task made ready, but for its activation rows' conversion for the weight type's dot
 * (matmul_quantize: j->xq is where they go). */
static void matmul_prepare(const moe_matmul_task *t, matmul_job *j) {
    const moe_type_kernels *k = moe_kernels_type(t->w->type);
    const int64_t n_in = t->w->ne[0], n_out = t->w->ne[1];
    if (t->w->layout != MOE_LAYOUT_FILE &&
        (t->w->layout != MOE_LAYOUT_ROWS16 || !k->dot_tile_rows16))
        moe_die("%s: repacked for another kernel table than %s's %s path (the table changed after "
                "load: load with --no-repack)",
                t->w->name.ptr, moe_kernels_get()->name, moe_exact() ? "exact" : "fast");
    *j = (matmul_job){.k = k,
                      .rows16 = t->w->layout == MOE_LAYOUT_ROWS16,
                      .n_in = n_in,
                      .n_out = n_out,
                      .n_rows = t->n_rows,
                      .y = t->y,
                      .w_row_bytes = moe_type_row_bytes(t->w->type, n_in),
                      .xq = (const uint8_t *)t->x,
                      .xq_row_bytes = (uint64_t)n_in * sizeof(float)};
    j->wbase = t->w->data + (uint64_t)t->matrix * (uint64_t)n_out * j->w_row_bytes;
    if (k->dot_type != MOE_TYPE_F32) {
        j->xq_row_bytes = moe_dot_row_bytes(t->w->type, n_in);
        j->xq = t->scratch;
    }
}

/* Activation rows [r0, r1) of a prepared job converted (each row on its own: how the rows are
 * shared out never changes a byte). */
static void matmul_quantize(const moe_matmul_task *t, const matmul_job *j, int64_t r0, int64_t r1) {
    if (j->k->dot_type == MOE_TYPE_F32) return;
    for (int64_t r = r0; r < r1; r++)
        j->k->quantize_row_for_dot(t->x + r * j->n_in,
                                   (uint8_t *)j->xq + (uint64_t)r * j->xq_row_bytes, j->n_in);
}

typedef struct matmul_many {
    const moe_matmul_task *tasks;
    matmul_job jobs[MOE_MATMUL_MANY_MAX];
    int64_t row0[MOE_MATMUL_MANY_MAX + 1];  /* the activation rows to convert, end to end (none
                                             * for a task that shares the task before's) */
    int64_t chunk[MOE_MATMUL_MANY_MAX];     /* output units per work item */
    int64_t first[MOE_MATMUL_MANY_MAX + 1]; /* first work item of each job */
    int n;
} matmul_many;

/* Rows [begin, end) of all the tasks' activation rows converted. */
static void matmul_many_quantize(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const matmul_many *m = arg;
    for (int j = 0; j < m->n && begin < end; j++) {
        const int64_t r0 = begin > m->row0[j] ? begin : m->row0[j];
        const int64_t r1 = end < m->row0[j + 1] ? end : m->row0[j + 1];
        if (r0 < r1) matmul_quantize(&m->tasks[j], &m->jobs[j], r0 - m->row0[j], r1 - m->row0[j]);
    }
}

/* Activation rows a pass converts on all threads (fewer: on the caller, as a decode step's one
 * row is not worth a hand-out), and the rows per work item. */
#define MATMUL_QUANTIZE_SHARED 16
#define MATMUL_QUANTIZE_CHUNK  4

static void matmul_many_items(void *arg, int64_t begin, int64_t end, int thread) {
    const matmul_many *m = arg;
    int j = 0;
    for (int64_t item = begin; item < end; item++) {
        while (item >= m->first[j + 1]) j++;
        const int64_t o0 = (item - m->first[j]) * m->chunk[j];
        const int64_t o1 =
            o0 + m->chunk[j] < m->jobs[j].n_out ? o0 + m->chunk[j] : m->jobs[j].n_out;
        matmul_rows((void *)&m->jobs[j], o0, o1, thread); /* reads it only */
    }
}

static moe_matmul_observer_fn matmul_observer;
static void *matmul_observer_ctx;

void moe_matmul_set_observer(moe_matmul_observer_fn fn, void *ctx) {
    matmul_observer = fn;
    matmul_observer_ctx = ctx;
}

bool moe_matmul_observed(void) {
    return matmul_observer != NULL;
}

static const char PART_QUANTIZE[] = "activation quantize"; /* MOE_PROFILE's part */

/* The task converting x[0..n_rows) for w into out, prepared; false when w's dot takes floats. */
static bool convert_prepare(const moe_tensor *w, const float *x, int64_t n_rows, void *out,
                            moe_matmul_task *t, matmul_job *j) {
    *t = (moe_matmul_task){.w = w, .x = x, .n_rows = n_rows, .scratch = out};
    matmul_prepare(t, j);
    return j->k->dot_type != MOE_TYPE_F32;
}

bool moe_matmul_convert_rows(const moe_tensor *w, const float *x, int64_t n_rows, void *out) {
    moe_matmul_task t;
    matmul_job j;
    if (!convert_prepare(w, x, n_rows, out, &t, &j)) return false;
    matmul_quantize(&t, &j, 0, n_rows);
    return true;
}

typedef struct convert_job {
    const moe_matmul_task *t;
    const matmul_job *j;
} convert_job;

static void convert_items(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const convert_job *c = arg;
    matmul_quantize(c->t, c->j, begin, end);
}

bool moe_matmul_convert_pool(moe_pool *pool, const moe_tensor *w, const float *x, int64_t n_rows,
                             void *out) {
    moe_matmul_task t;
    matmul_job j;
    if (!convert_prepare(w, x, n_rows, out, &t, &j)) return false;
    const double start = moe_profile_on() ? moe_now() : 0;
    convert_job c = {&t, &j};
    if (n_rows < MATMUL_QUANTIZE_SHARED)
        convert_items(&c, 0, n_rows, 0);
    else
        moe_pool_for(pool, n_rows, MATMUL_QUANTIZE_CHUNK, convert_items, &c);
    if (start > 0) moe_profile_add(PART_QUANTIZE, sizeof PART_QUANTIZE - 1, moe_now() - start, 0);
    return true;
}

/* Whether rows of n_a values converted for a's dot serve b's of n_b values. */
static bool kernels_convert_alike(const moe_type_kernels *a, int64_t n_a, const moe_type_kernels *b,
                                  int64_t n_b) {
    return n_a == n_b && a->dot_type != MOE_TYPE_F32 &&
           a->quantize_row_for_dot == b->quantize_row_for_dot;
}

bool moe_matmul_converts_alike(const moe_tensor *a, const moe_tensor *b) {
    return kernels_convert_alike(moe_kernels_type(a->type), a->ne[0], moe_kernels_type(b->type),
                                 b->ne[0]);
}

/* MOE_PROFILE: a pass is recorded under its first tensor's name less the layer ("blk.N."), with
 * the weight bytes of all its tasks, less the activations' conversion (its own part, which took
 * quantize_s). */
static void matmul_profile(const moe_matmul_task *tasks, int n_tasks, double start,
                           double quantize_s) {
    moe_profile_add(PART_QUANTIZE, sizeof PART_QUANTIZE - 1, quantize_s, 0);
    const double seconds = moe_now() - start - quantize_s;
    double bytes = 0;
    for (int i = 0; i < n_tasks; i++)
        bytes +=
            (double)tasks[i].w->ne[1] * moe_type_row_bytes(tasks[i].w->type, tasks[i].w->ne[0]);
    const char *name = tasks[0].w->name.ptr;
    size_t len = tasks[0].w->name.len;
    if (len > 4 && !memcmp(name, "blk.", 4)) {
        size_t i = 4;
        while (i < len && name[i] != '.') i++;
        if (i < len) name += i + 1, len -= i + 1;
    }
    moe_profile_add(name, len, seconds, bytes);
}

void moe_matmul_many(moe_pool *pool, const moe_matmul_task *tasks, int n_tasks) {
    MOE_CHECK(n_tasks >= 0 && n_tasks <= MOE_MATMUL_MANY_MAX);
    const double start = n_tasks && moe_profile_on() ? moe_now() : 0;
    if (matmul_observer)
        for (int i = 0; i < n_tasks; i++)
            matmul_observer(matmul_observer_ctx, tasks[i].w, tasks[i].matrix, tasks[i].x,
                            tasks[i].n_rows);
    matmul_many m;
    m.tasks = tasks;
    m.n = n_tasks;
    m.first[0] = 0;
    m.row0[0] = 0;
    /* chunks of output units: enough per chunk to amortise the hand-out, many chunks per thread
     * over the whole set of tasks */
    int64_t total_out = 0;
    for (int i = 0; i < n_tasks; i++) total_out += tasks[i].w->ne[1];
    /* whole tiles of the fast path's tile kernels */
    const int64_t chunk = (total_out / (8 * moe_pool_n_threads(pool)) + MOE_DOT_TILE_W) &
                          ~(int64_t)(MOE_DOT_TILE_W - 1);
    for (int i = 0; i < n_tasks; i++) {
        matmul_prepare(&tasks[i], &m.jobs[i]);
        m.chunk[i] = chunk;
        m.first[i + 1] = m.first[i] + (m.jobs[i].n_out + chunk - 1) / chunk;
        /* the same rows converted the same way as the task before's (an expert's gate and
         * up): its converted rows serve both */
        const matmul_job *prev = i ? &m.jobs[i - 1] : NULL;
        const bool converted = !tasks[i].x;
        MOE_CHECK(!converted || (m.jobs[i].k->dot_type != MOE_TYPE_F32 && !matmul_observer));
        const bool shared = !converted && prev && tasks[i].x == tasks[i - 1].x &&
                            tasks[i].n_rows == tasks[i - 1].n_rows &&
                            kernels_convert_alike(prev->k, prev->n_in, m.jobs[i].k, m.jobs[i].n_in);
        if (shared) m.jobs[i].xq = prev->xq;
        m.row0[i + 1] = m.row0[i] + (shared || converted ? 0 : tasks[i].n_rows);
    }
    const double quantize = start > 0 ? moe_now() : 0;
    if (m.row0[n_tasks] < MATMUL_QUANTIZE_SHARED)
        matmul_many_quantize(&m, 0, m.row0[n_tasks], 0);
    else
        moe_pool_for(pool, m.row0[n_tasks], MATMUL_QUANTIZE_CHUNK, matmul_many_quantize, &m);
    const double quantize_s = start > 0 ? moe_now() - quantize : 0;
    moe_pool_for(pool, m.first[n_tasks], 1, matmul_many_items, &m);
    if (start > 0) matmul_profile(tasks, n_tasks, start, quantize_s);
}

void moe_matmul(moe_pool *pool, const moe_tensor *w, int64_t matrix, const float *x, int64_t n_rows,
                float *y, void *scratch) {
    const moe_matmul_task t = {w, matrix, x, n_rows, y, scratch};
    moe_matmul_many(pool, &t, 1);
}

void moe_tensor_row_f32(const moe_tensor *w, int64_t row, float *out) {
    MOE_CHECK(w->layout == MOE_LAYOUT_FILE); /* the loader never repacks embeddings */
    const moe_type_traits *t = moe_type_traits_get(w->type);
    const uint64_t row_bytes = moe_type_row_bytes(w->type, w->ne[0]);
    t->to_float(w->data + (uint64_t)row * row_bytes, out, w->ne[0]);
}

/* ==== Attention ==== */

void moe_attention_row(const moe_attn_shape *s, const float *q, const moe_attn_kv *kv, int64_t n_kv,
                       float *out, float *scores) {
    const moe_kernels *kern = moe_kernels_get(); /* the attention kernels of the ISA table */
    const int group = s->n_head / s->n_head_kv;
    for (int h = 0; h < s->n_head; h++) {
        const int hk = h / group;
        kern->attn_scores(q + (int64_t)h * s->head_dim_k, (const uint8_t *)kv->k + hk * kv->k_head,
                          kv->k_stride, n_kv, s->kv_type, s->head_dim_k, s->scale, scores);
        softmax_sink(scores, n_kv, s->sinks ? s->sinks[h] : -INFINITY);
        float *oh = out + (int64_t)h * s->head_dim_v;
        memset(oh, 0, sizeof(float) * (size_t)s->head_dim_v);
        kern->attn_mix(oh, scores, (const uint8_t *)kv->v + hk * kv->v_head, kv->v_stride, n_kv,
                       s->kv_type, s->head_dim_v);
    }
}

/* The tiles start on a cache line: a 64-byte load across two lines costs two. */
#define ATTN_SCRATCH_ALIGN 64

size_t moe_attention_tiled_scratch(int dim) {
    return (size_t)(MOE_ATTN_TILE_QV + MOE_ATTN_TILE_KEYS) * (size_t)((dim + 15) & ~15) +
           ATTN_SCRATCH_ALIGN / sizeof(float);
}

/* Query vectors g0..g0+nq-1 of the call (vector g is row g / nh, head h0 + g % nh) over every
 * tile their rows see, then each output divided by its sum. */
static void attn_tiled_vectors(const moe_kernels *kern, const moe_attn_shape *s,
                               const moe_attn_block *b, int h0, int nh, int g0, int nq) {
    const int64_t q_w = (int64_t)s->n_head * s->head_dim_k;
    const int64_t out_w = (int64_t)s->n_head * s->head_dim_v;
    const int group = s->n_head / s->n_head_kv, hk = h0 / group;
    /* [head_dim_k][MOE_ATTN_TILE_QV], then the K / V tile: both on a cache line */
    float *qt = (float *)(((uintptr_t)b->scratch + ATTN_SCRATCH_ALIGN - 1) &
                          ~(uintptr_t)(ATTN_SCRATCH_ALIGN - 1));
    float m[MOE_ATTN_TILE_QV], l[MOE_ATTN_TILE_QV], *out[MOE_ATTN_TILE_QV];
    int32_t lo[MOE_ATTN_TILE_QV], hi[MOE_ATTN_TILE_QV];
    int row[MOE_ATTN_TILE_QV];
    int64_t first = INT64_MAX, last = -1;
    /* a Q8_0 cache's queries in q8_0 instead, in qt's room: [dk / 4][QV][4] bytes, then
     * [dk / 32][QV] scales (dk a multiple of 32: 1.125 dk QV bytes of qt's 4 dk QV) */
    const bool q8 = s->kv_type == MOE_TYPE_Q8_0;
    int8_t *qq = (int8_t *)qt;
    float *qd = (float *)(qq + (int64_t)s->head_dim_k * MOE_ATTN_TILE_QV);
    if (q8 && nq < MOE_ATTN_TILE_QV) { /* the columns past nq stay zero */
        memset(qq, 0, (size_t)s->head_dim_k * MOE_ATTN_TILE_QV);
        memset(qd, 0, sizeof(float) * (size_t)(s->head_dim_k / 32) * MOE_ATTN_TILE_QV);
    } else if (!q8) /* to the register's end: the kernels read 16 columns at a time at most */
        for (int d = 0; d < s->head_dim_k; d++)
            for (int i = nq; i < ((nq + 15) & ~15); i++) qt[(int64_t)d * MOE_ATTN_TILE_QV + i] = 0;
    for (int i = 0; i < nq; i++) {
        const int r = (g0 + i) / nh, h = h0 + (g0 + i) % nh;
        const float *q = b->q + r * q_w + (int64_t)h * s->head_dim_k;
        if (q8)
            moe_attn_tile_quantize(q, s->head_dim_k, i, qq, qd);
        else
            for (int d = 0; d < s->head_dim_k; d++) qt[(int64_t)d * MOE_ATTN_TILE_QV + i] = q[d];
        const float sink = s->sinks ? s->sinks[h] : -INFINITY;
        m[i] = sink;
        l[i] = sink == -INFINITY ? 0.0f : 1.0f;
        out[i] = b->out + r * out_w + (int64_t)h * s->head_dim_v;
        memset(out[i], 0, sizeof(float) * (size_t)s->head_dim_v);
        row[i] = r;
        first = b->first[r] < first ? b->first[r] : first;
        last = b->last[r] > last ? b->last[r] : last;
    }
    moe_attn_tile_args t = {.k_stride = b->kv.k_stride,
                            .v_stride = b->kv.v_stride,
                            .kv_type = s->kv_type,
                            .dk = s->head_dim_k,
                            .dv = s->head_dim_v,
                            .scale = s->scale,
                            .nq = nq,
                            .qt = qt,
                            .qq = qq,
                            .qd = qd,
                            .lo = lo,
                            .hi = hi,
                            .m = m,
                            .l = l,
                            .out = out,
                            .scratch = qt + (int64_t)s->head_dim_k * MOE_ATTN_TILE_QV};
    const uint8_t *k = (const uint8_t *)b->kv.k + hk * b->kv.k_head;
    const uint8_t *v = (const uint8_t *)b->kv.v + hk * b->kv.v_head;
    /* tiles at fixed absolute positions: the same tiles for a row whatever its block */
    for (int64_t t0 = first / MOE_ATTN_TILE * MOE_ATTN_TILE; t0 <= last; t0 += MOE_ATTN_TILE) {
        const int64_t j0 = first > t0 ? first : t0;
        const int64_t j1 = last < t0 + MOE_ATTN_TILE - 1 ? last : t0 + MOE_ATTN_TILE - 1;
        for (int i = 0; i < nq; i++) { /* keys j0 + lo .. j0 + hi, none when hi < lo */
            lo[i] = (int32_t)((b->first[row[i]] > j0 ? b->first[row[i]] : j0) - j0);
            hi[i] = (int32_t)((b->last[row[i]] < j1 ? b->last[row[i]] : j1) - j0);
        }
        t.k = k + j0 * b->kv.k_stride;
        t.v = v + j0 * b->kv.v_stride;
        t.n_key = (int)(j1 - j0 + 1);
        kern->attn_tile(&t);
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < s->head_dim_v; d++) out[i][d] *= inv;
    }
}

void moe_attention_tiled(const moe_attn_shape *s, const moe_attn_block *b, int h0, int h1) {
    const moe_kernels *kern = moe_kernels_get();
    const int group = s->n_head / s->n_head_kv, hk = h0 / group, nh = h1 - h0;
    MOE_CHECK(h0 >= 0 && h0 < h1 && (h1 - 1) / group == hk && b->n_rows >= 1 &&
              b->n_rows <= MOE_ATTN_BLOCK_ROWS && b->scratch &&
              (s->kv_type != MOE_TYPE_Q8_0 || s->head_dim_k % 32 == 0));
    const int n_vec = b->n_rows * nh;
    for (int g0 = 0; g0 < n_vec; g0 += MOE_ATTN_TILE_QV)
        attn_tiled_vectors(kern, s, b, h0, nh, g0,
                           n_vec - g0 < MOE_ATTN_TILE_QV ? n_vec - g0 : MOE_ATTN_TILE_QV);
}
