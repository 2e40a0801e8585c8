/* ops.c: reference implementations of norms, activations, rope, matmul and attention.
 *
 * Plain C, float32 accumulation. These are the semantics the fast kernels must reproduce;
 * rope follows ggml's cache construction (theta multiplied by theta_scale pair after pair)
 * so positions produce the same angles as llama.cpp to the last bit. */
#include "ops.h"

#include <math.h>
#include <string.h>

/* ==== Elementwise and norms ==== */

void moe_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    double sum = 0.0; /* ggml sums squares in a wider type, then divides */
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

void moe_swiglu(float *x, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        x[i] *= g / (1.0f + expf(-g));
    }
}

void moe_softmax(float *x, int64_t n) {
    float max = -INFINITY;
    for (int64_t i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - max);
        sum += x[i];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

/* ==== Rope ==== */

void moe_rope(float *x, int n_heads, int head_dim, int64_t pos, const moe_rope_params *p) {
    const float theta_scale = powf(p->base, -2.0f / (float)p->n_dims);
    const int half = p->n_dims / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (int64_t)h * head_dim;
        float theta = (float)pos;
        for (int i = 0; i < half; i++) {
            const float angle = theta * p->freq_scale;
            const float c = cosf(angle), s = sinf(angle);
            const int a = p->neox ? i : 2 * i, b = p->neox ? i + half : 2 * i + 1;
            const float x0 = xh[a], x1 = xh[b];
            xh[a] = x0 * c - x1 * s;
            xh[b] = x0 * s + x1 * c;
            theta *= theta_scale;
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
    const moe_type_traits *t;
    const uint8_t *wbase;
    uint64_t w_row_bytes, xq_row_bytes;
    const uint8_t *xq;
    int64_t n_in, n_out, n_rows;
    float *y;
} matmul_job;

/* weight rows outermost: each row is decoded once for all activation rows */
static void matmul_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const matmul_job *j = arg;
    for (int64_t o = begin; o < end; o++) {
        const uint8_t *wrow = j->wbase + (uint64_t)o * j->w_row_bytes;
        for (int64_t r = 0; r < j->n_rows; r++)
            j->y[r * j->n_out + o] = j->t->dot(wrow, j->xq + (uint64_t)r * j->xq_row_bytes, j->n_in);
    }
}

void moe_matmul(moe_pool *pool, const moe_tensor *w, int64_t matrix, const float *x,
                int64_t n_rows, float *y, void *scratch) {
    const moe_type_traits *t = moe_type_traits_get(w->type);
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    matmul_job j = {.t = t, .n_in = n_in, .n_out = n_out, .n_rows = n_rows, .y = y,
                    .w_row_bytes = moe_type_row_bytes(w->type, n_in),
                    .xq = (const uint8_t *)x, .xq_row_bytes = (uint64_t)n_in * sizeof(float)};
    j.wbase = w->data + (uint64_t)matrix * (uint64_t)n_out * j.w_row_bytes;
    if (t->dot_type != MOE_TYPE_F32) {
        j.xq_row_bytes = moe_dot_row_bytes(w->type, n_in);
        for (int64_t r = 0; r < n_rows; r++)
            moe_quantize_row_for_dot(w->type, x + r * n_in,
                                     (uint8_t *)scratch + (uint64_t)r * j.xq_row_bytes, n_in);
        j.xq = scratch;
    }
    /* chunks of output units: enough per chunk to amortise the hand-out, many chunks per thread */
    const int64_t chunk = n_out / (8 * moe_pool_n_threads(pool)) + 1;
    moe_pool_for(pool, n_out, chunk, matmul_rows, &j);
}

void moe_tensor_row_f32(const moe_tensor *w, int64_t row, float *out) {
    const moe_type_traits *t = moe_type_traits_get(w->type);
    const uint64_t row_bytes = moe_type_row_bytes(w->type, w->ne[0]);
    t->to_float(w->data + (uint64_t)row * row_bytes, out, w->ne[0]);
}

/* ==== Attention ==== */

static inline float kv_at(const void *base, int kv_f16, int64_t i) {
    return kv_f16 ? moe_fp16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* q . k[ofs..ofs+n) summed in the order of ggml's x86 ggml_vec_dot_f32 (AVX2 shape): 4
 * accumulators of 8 lanes over whole 32-value steps, folded 0+2, 1+3, 0+1, the 8 lanes as
 * (l + l+4) then pairs, then the tail one by one. Why: these scores feed the 8-bit activation
 * quantization of later matmuls, where a 1-ulp difference can flip a rounding tie; a plain
 * sequential sum flipped one at position 8 of deepseek2-q8_0-q4_k and moved every later row
 * by 2e-2, while this order keeps all five parity models within 3e-7 of llama.cpp. */
static float attn_dot(const float *q, const void *k, int kv_f16, int64_t ofs, int n) {
    enum { LANES = 8, ACCS = 4, STEP = LANES * ACCS };
    const int whole = n & ~(STEP - 1);
    float acc[ACCS][LANES] = {{0}};
    for (int i = 0; i < whole; i += STEP)
        for (int a = 0; a < ACCS; a++)
            for (int l = 0; l < LANES; l++) {
                const int d = i + a * LANES + l;
                acc[a][l] += q[d] * kv_at(k, kv_f16, ofs + d);
            }
    float lane[LANES], half[LANES / 2];
    for (int l = 0; l < LANES; l++) lane[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    for (int l = 0; l < LANES / 2; l++) half[l] = lane[l] + lane[l + LANES / 2];
    float sum = (half[0] + half[1]) + (half[2] + half[3]);
    for (int d = whole; d < n; d++) sum += q[d] * kv_at(k, kv_f16, ofs + d);
    return sum;
}

void moe_attention_row(const moe_attn_shape *s, const float *q, const void *k, const void *v,
                       int64_t k_stride, int64_t v_stride, int64_t n_kv, float *out,
                       float *scores) {
    const int group = s->n_head / s->n_head_kv;
    for (int h = 0; h < s->n_head; h++) {
        const int hk = h / group;
        const float *qh = q + (int64_t)h * s->head_dim_k;
        for (int64_t j = 0; j < n_kv; j++) {
            const int64_t kofs = j * k_stride + (int64_t)hk * s->head_dim_k;
            const float dot = attn_dot(qh, k, s->kv_f16, kofs, s->head_dim_k);
            scores[j] = dot * s->scale;
        }
        moe_softmax(scores, n_kv);
        float *oh = out + (int64_t)h * s->head_dim_v;
        memset(oh, 0, sizeof(float) * (size_t)s->head_dim_v);
        for (int64_t j = 0; j < n_kv; j++) {
            const int64_t vofs = j * v_stride + (int64_t)hk * s->head_dim_v;
            const float p = scores[j];
            for (int d = 0; d < s->head_dim_v; d++) oh[d] += p * kv_at(v, s->kv_f16, vofs + d);
        }
    }
}
