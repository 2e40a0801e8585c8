/* linear_attn.c: the pieces of linear-attention layers (Gated DeltaNet, Kimi Delta Attention).
 *
 * Owns the short causal depthwise convolution with its rolling state, L2 normalisation, output
 * gates, and the gated delta rule over one head in two forms: token by token (decode) and
 * chunked (prefill: chunks of MOE_DELTA_CHUNK tokens, the intra-chunk dependencies solved as a
 * unit lower-triangular system by forward substitution, the WY form). Both read and write the
 * same state, [d_v][d_k] per head with the key index contiguous (ggml's layout), so a sequence
 * may switch between them at any token. It does not own where states live (engine/).
 *
 * The trap: decays only ever enter as products of per-token factors exp(g) <= 1 taken forward
 * in time; dividing by an earlier product (exp(-gamma)) would overflow within a chunk when
 * decay is strong. */
#include "ops.h"

#include <math.h>
#include <string.h>

/* ==== Elementwise ==== */

float moe_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

void moe_l2norm(float *x, int64_t n, float eps) {
    double sum = 0.0; /* ggml sums squares in a wider type */
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float scale = 1.0f / fmaxf(sqrtf((float)sum), eps);
    for (int64_t i = 0; i < n; i++) x[i] *= scale;
}

void moe_gate_mul(float *x, const float *gate, int64_t n, moe_gate_act act) {
    for (int64_t i = 0; i < n; i++) {
        const float s = 1.0f / (1.0f + expf(-gate[i]));
        x[i] *= act == MOE_GATE_SILU ? gate[i] * s : s;
    }
}

/* ==== Short causal convolution ==== */

void moe_conv1d_silu(float *x, int64_t x_stride, int64_t n_tok, int64_t n_ch, const float *w,
                     int d_conv, float *state) {
    MOE_CHECK(d_conv >= 1 && d_conv <= MOE_CONV_MAX_TAPS);
    const int n_hist = d_conv - 1;
    for (int64_t ch = 0; ch < n_ch; ch++) {
        float hist[MOE_CONV_MAX_TAPS];
        float *st = state + ch * n_hist;
        const float *wc = w + ch * d_conv;
        memcpy(hist, st, sizeof(float) * (size_t)n_hist);
        for (int64_t t = 0; t < n_tok; t++) {
            float *xt = x + t * x_stride + ch;
            const float in = *xt;
            float y = 0.0f;
            for (int k = 0; k < n_hist; k++) y += hist[k] * wc[k];
            y += in * wc[n_hist];
            for (int k = 0; k + 1 < n_hist; k++) hist[k] = hist[k + 1];
            if (n_hist) hist[n_hist - 1] = in;
            *xt = y / (1.0f + expf(-y));
        }
        memcpy(st, hist, sizeof(float) * (size_t)n_hist);
    }
}

/* ==== Gated delta rule ==== */

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

uint64_t moe_delta_scratch_floats(int d_k, int d_v) {
    const uint64_t C = MOE_DELTA_CHUNK;
    /* decays and their running products [C][d_k] each, A and B [C][C], U [C][d_v], one
     * decayed row [d_k], one running decay [d_k], one state row product [d_v] */
    return 2 * C * (uint64_t)d_k + 2 * C * C + C * (uint64_t)d_v + 2 * (uint64_t)d_k +
           (uint64_t)d_v;
}

void moe_delta_rule_recurrent(const moe_delta_args *a, int64_t n_tok, float *state,
                              float *scratch) {
    const int dk = a->d_k, dv = a->d_v;
    float *decay = scratch, *delta = scratch + dk;
    for (int64_t t = 0; t < n_tok; t++) {
        const float *q = a->q + t * a->qk_stride, *k = a->k + t * a->qk_stride;
        const float *v = a->v + t * a->v_stride, *g = a->g + t * a->g_stride;
        const float beta = a->beta[t * a->beta_stride];
        float *out = a->out + t * a->out_stride;
        if (a->n_g == 1) {
            const float e = expf(g[0]);
            for (int64_t i = 0; i < (int64_t)dk * dv; i++) state[i] *= e;
        } else {
            for (int i = 0; i < dk; i++) decay[i] = expf(g[i]);
            for (int j = 0; j < dv; j++)
                for (int i = 0; i < dk; i++) state[j * dk + i] *= decay[i];
        }
        for (int j = 0; j < dv; j++) delta[j] = (v[j] - dot(state + j * dk, k, dk)) * beta;
        for (int j = 0; j < dv; j++)
            for (int i = 0; i < dk; i++) state[j * dk + i] += delta[j] * k[i];
        for (int j = 0; j < dv; j++) out[j] = dot(state + j * dk, q, dk) * a->scale;
    }
}

/* sum_i x[i] y[i] e[i] (e: n_g == 1 values broadcast) */
static float dot3(const float *x, const float *y, const float *e, int n, int n_g) {
    if (n_g == 1) return dot(x, y, n) * e[0];
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += x[i] * y[i] * e[i];
    return s;
}

/* One chunk of C tokens from state S0 (updated to the state after the chunk). With a_t the
 * decay of token t, P_t = a_0 ... a_t its running product, P_ts = a_(s+1) ... a_t, and
 * u_t = beta_t (v_t - S_{t-1} D_t k_t) the value each token writes:
 *   S_t = S0 diag(P_t) + sum_{s<=t} u_s (k_s P_ts)^T
 *   (I + diag(beta) A) U = diag(beta) (V - (K P) S0^T),  A_ts = k_s.(k_t P_ts), s < t
 *   O = (Q P) S0^T + B U,                                 B_ts = k_s.(q_t P_ts), s <= t
 * The solve is forward substitution over t (a unit lower-triangular system). Decays enter
 * only as products of factors <= 1 (exp of the log decays once per token and channel), so
 * strong decay underflows to 0 as it should instead of overflowing. */
static void delta_chunk(const moe_delta_args *a, int64_t t0, int C, float *S, float *scratch) {
    const int dk = a->d_k, dv = a->d_v, ng = a->n_g;
    float *decay = scratch;                              /* [C][ng] a_t */
    float *prod = decay + (int64_t)MOE_DELTA_CHUNK * dk; /* [C][ng] P_t */
    float *A = prod + (int64_t)MOE_DELTA_CHUNK * dk;     /* [C][C] */
    float *B = A + MOE_DELTA_CHUNK * MOE_DELTA_CHUNK;    /* [C][C] */
    float *U = B + MOE_DELTA_CHUNK * MOE_DELTA_CHUNK;    /* [C][dv] */
    float *w = U + (int64_t)MOE_DELTA_CHUNK * dv;        /* [dk] */
    float *e = w + dk;                                   /* [dk] */
    float *r = e + dk;                                   /* [dv] */
#define Q_(t)       (a->q + (t0 + (t)) * a->qk_stride)
#define K_(t)       (a->k + (t0 + (t)) * a->qk_stride)
#define G_(p, t, i) (p)[(t)*ng + (ng == 1 ? 0 : (i))]
    for (int t = 0; t < C; t++) {
        const float *g = a->g + (t0 + t) * a->g_stride;
        for (int i = 0; i < ng; i++) {
            decay[t * ng + i] = expf(g[i]);
            prod[t * ng + i] = (t ? prod[(t - 1) * ng + i] : 1.0f) * decay[t * ng + i];
        }
    }
    /* intra-chunk coefficients, column by column: e = P_ts grows one factor per row */
    for (int s = 0; s < C; s++) {
        for (int i = 0; i < ng; i++) e[i] = 1.0f;
        for (int t = s; t < C; t++) {
            if (t > s)
                for (int i = 0; i < ng; i++) e[i] *= decay[t * ng + i];
            A[t * C + s] = t > s ? dot3(K_(s), K_(t), e, dk, ng) : 0.0f;
            B[t * C + s] = dot3(K_(s), Q_(t), e, dk, ng) * a->scale;
        }
    }
    /* forward substitution for U, and the outputs */
    for (int t = 0; t < C; t++) {
        const float *v = a->v + (t0 + t) * a->v_stride;
        const float beta = a->beta[(t0 + t) * a->beta_stride];
        float *u = U + (int64_t)t * dv;
        for (int i = 0; i < dk; i++) w[i] = K_(t)[i] * G_(prod, t, i);
        for (int j = 0; j < dv; j++) u[j] = v[j] - dot(S + (int64_t)j * dk, w, dk);
        for (int s = 0; s < t; s++) {
            const float c = A[t * C + s];
            const float *us = U + (int64_t)s * dv;
            for (int j = 0; j < dv; j++) u[j] -= c * us[j];
        }
        for (int j = 0; j < dv; j++) u[j] *= beta;
        float *out = a->out + (t0 + t) * a->out_stride;
        for (int i = 0; i < dk; i++) w[i] = Q_(t)[i] * G_(prod, t, i) * a->scale;
        for (int j = 0; j < dv; j++) r[j] = dot(S + (int64_t)j * dk, w, dk);
        for (int s = 0; s <= t; s++) {
            const float c = B[t * C + s];
            const float *us = U + (int64_t)s * dv;
            for (int j = 0; j < dv; j++) r[j] += c * us[j];
        }
        memcpy(out, r, sizeof(float) * (size_t)dv);
    }
    /* the state after the chunk: S0 P_last + sum_s u_s (k_s P_(last,s))^T, P built backwards */
    for (int i = 0; i < dk; i++) w[i] = G_(prod, C - 1, i);
    for (int j = 0; j < dv; j++)
        for (int i = 0; i < dk; i++) S[(int64_t)j * dk + i] *= w[i];
    for (int i = 0; i < ng; i++) e[i] = 1.0f;
    for (int s = C - 1; s >= 0; s--) {
        for (int i = 0; i < dk; i++) w[i] = K_(s)[i] * e[ng == 1 ? 0 : i];
        const float *us = U + (int64_t)s * dv;
        for (int j = 0; j < dv; j++)
            for (int i = 0; i < dk; i++) S[(int64_t)j * dk + i] += us[j] * w[i];
        for (int i = 0; i < ng; i++) e[i] *= decay[s * ng + i];
    }
#undef Q_
#undef K_
#undef G_
}

void moe_delta_rule_chunked(const moe_delta_args *a, int64_t n_tok, float *state, float *scratch) {
    for (int64_t t0 = 0; t0 < n_tok; t0 += MOE_DELTA_CHUNK) {
        const int C = (int)(n_tok - t0 < MOE_DELTA_CHUNK ? n_tok - t0 : MOE_DELTA_CHUNK);
        delta_chunk(a, t0, C, state, scratch);
    }
}
