/* linear_attn.c: the pieces of linear-attention layers (Gated DeltaNet, Kimi Delta Attention).
 *
 * Owns the short causal depthwise convolution with its rolling state, L2 normalisation, output
 * gates, and the gated delta rule over one head in two forms: token by token (decode) and
 * chunked (prefill: chunks of MOE_DELTA_CHUNK tokens, the intra-chunk dependencies solved as a
 * unit lower-triangular system by forward substitution, the WY form). Both read and write the
 * same state, [d_k][d_v] per head with the value index contiguous (ggml's transposed: the
 * vectors of the kernel table's products run along a row of it), so a sequence may switch
 * between them at any token. It does not own where states live (engine/).
 *
 * The trap: decays only ever enter as products of per-token factors exp(g) <= 1 taken forward
 * in time; dividing by an earlier product (exp(-gamma)) would overflow within a chunk when
 * decay is strong. */
#include "ops.h"

#include <math.h>
#include <string.h>

/* ==== Elementwise ==== */

#define MOE_GATE_STRETCH 256 /* gate values activated at a time on the fast path */

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
    if (!moe_exact() && act == MOE_GATE_SILU) { /* x silu(gate): the fast path's SwiGLU */
        moe_kernels_get()->swiglu(x, gate, n, 0.0f);
        return;
    }
    if (!moe_exact()) { /* the fast path's sigmoid (quant.h: moe_silu_fn), a stretch at a time */
        float s[MOE_GATE_STRETCH];
        for (int64_t i0 = 0; i0 < n; i0 += MOE_GATE_STRETCH) {
            const int64_t m = n - i0 < MOE_GATE_STRETCH ? n - i0 : MOE_GATE_STRETCH;
            memcpy(s, gate + i0, sizeof(float) * (size_t)m);
            moe_kernels_get()->sigmoid(s, m);
            for (int64_t i = 0; i < m; i++) x[i0 + i] *= s[i];
        }
        return;
    }
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
    const moe_silu_fn silu = moe_exact() ? NULL : moe_kernels_get()->silu;
    /* MOE_VEC_STEP channels side by side, token after token: each token's values of them are
     * one stretch of its row (where a channel at a time strides the rows), and their sums,
     * constant-count loops, are vectors (each channel's own in its order) */
    for (int64_t c0 = 0; c0 < n_ch; c0 += MOE_VEC_STEP) {
        const int nc = n_ch - c0 < MOE_VEC_STEP ? (int)(n_ch - c0) : MOE_VEC_STEP;
        float hist[MOE_CONV_MAX_TAPS][MOE_VEC_STEP] = {{0}}, wt[MOE_CONV_MAX_TAPS][MOE_VEC_STEP];
        float y[MOE_VEC_STEP], in[MOE_VEC_STEP];
        for (int c = 0; c < MOE_VEC_STEP; c++)
            for (int k = 0; k < d_conv; k++) wt[k][c] = c < nc ? w[(c0 + c) * d_conv + k] : 0.0f;
        for (int c = 0; c < nc; c++)
            for (int k = 0; k < n_hist; k++) hist[k][c] = state[(c0 + c) * n_hist + k];
        for (int64_t t = 0; t < n_tok; t++) {
            float *xt = x + t * x_stride + c0;
            for (int c = 0; c < MOE_VEC_STEP; c++) in[c] = c < nc ? xt[c] : 0.0f;
            for (int c = 0; c < MOE_VEC_STEP; c++) y[c] = 0.0f;
            for (int k = 0; k < n_hist; k++)
                for (int c = 0; c < MOE_VEC_STEP; c++) y[c] += hist[k][c] * wt[k][c];
            for (int c = 0; c < MOE_VEC_STEP; c++) y[c] += in[c] * wt[n_hist][c];
            for (int k = 0; k + 1 < n_hist; k++) memcpy(hist[k], hist[k + 1], sizeof hist[k]);
            if (n_hist) memcpy(hist[n_hist - 1], in, sizeof in);
            if (silu) { /* the fast path's (quant.h: moe_silu_fn) */
                silu(y, nc);
                memcpy(xt, y, sizeof(float) * (size_t)nc);
            } else {
                for (int c = 0; c < nc; c++) xt[c] = y[c] / (1.0f + expf(-y[c]));
            }
        }
        for (int c = 0; c < nc; c++)
            for (int k = 0; k < n_hist; k++) state[(c0 + c) * n_hist + k] = hist[k][c];
    }
}

/* ==== Gated delta rule ==== */

uint64_t moe_delta_scratch_floats(int d_k, int d_v) {
    const uint64_t C = MOE_DELTA_CHUNK, dk = (uint64_t)d_k, dv = (uint64_t)d_v;
    /* decays and their running products [C][d_k] each; the chunk's keys transposed, the running
     * decays by column and the state update's factors [d_k][C] each; A and B [C][C]; decayed
     * keys and queries [C][d_k] each; U [C][d_v]; a row of A, one of B and the columns' decays
     * (one per head) [C] each; a running decay [d_k] */
    return 2 * C * dk + 3 * dk * C + 2 * C * C + 2 * C * dk + C * dv + 3 * C + dk;
}

void moe_delta_rule_recurrent(const moe_delta_args *a, int64_t n_tok, float *state,
                              float *scratch) {
    const moe_kernels *kern = moe_kernels_get();
    const int dk = a->d_k, dv = a->d_v;
    float *decay = scratch, *delta = scratch + dk;
    for (int64_t t = 0; t < n_tok; t++) {
        const float *q = a->q + t * a->qk_stride, *k = a->k + t * a->qk_stride;
        const float *v = a->v + t * a->v_stride, *g = a->g + t * a->g_stride;
        const float beta = a->beta[t * a->beta_stride];
        float *out = a->out + t * a->out_stride;
        for (int i = 0; i < dk; i++) decay[i] = a->n_g == 1 && i ? decay[0] : expf(g[i]);
        kern->rows_update(state, dv, dk, decay, NULL, 0, NULL, 0, 0, dv); /* row i by its decay */
        kern->rows_times(k, 0, state, dv, delta, 0, 1, dk, dv);           /* S k */
        for (int j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * beta;
        kern->rows_update(state, dv, dk, NULL, k, 1, delta, 0, 1, dv); /* + k delta^T */
        kern->rows_times(q, 0, state, dv, out, 0, 1, dk, dv);          /* S q */
        for (int j = 0; j < dv; j++) out[j] *= a->scale;
    }
}

/* One chunk of C tokens from the state St ([d_k][d_v]; updated to the state after the
 * chunk). With a_t the decay of token t, P_t = a_0 ... a_t its running product, P_ts =
 * a_(s+1) ... a_t, and u_t = beta_t (v_t - S_{t-1} D_t k_t) the value each token writes:
 *   S_t = S0 diag(P_t) + sum_{s<=t} u_s (k_s P_ts)^T
 *   (I + diag(beta) A) U = diag(beta) (V - (K P) S0^T),  A_ts = k_s.(k_t P_ts), s < t
 *   O = (Q P) S0^T + B U,                                 B_ts = k_s.(q_t P_ts), s <= t
 * The solve is forward substitution over t (a unit lower-triangular system). Decays enter
 * only as products of factors <= 1 (exp of the log decays once per token and channel), so
 * strong decay underflows to 0 as it should instead of overflowing. The products run through
 * the kernel table's f32 kernels (quant.h), whose order is the scalar one element by element:
 * A and B row by row over t (P_ts for every s < t grown by one factor a_t, a column of e each),
 * (K P) S0^T and (Q P) S0^T as products of rows with the transposed state, the substitution and
 * the state update as chains of row updates. */
static void delta_chunk(const moe_kernels *kern, const moe_delta_args *a, int64_t t0, int C,
                        float *St, float *scratch) {
    enum { N = MOE_DELTA_CHUNK };
    const int dk = a->d_k, dv = a->d_v, ng = a->n_g;
    float *decay = scratch;                /* [N][ng] a_t */
    float *prod = decay + (int64_t)N * dk; /* [N][ng] P_t */
    float *kt = prod + (int64_t)N * dk;    /* [dk][N] the keys by column */
    float *e = kt + (int64_t)dk * N;       /* [dk][N] column s: P_ts of the row being made */
    float *fac = e + (int64_t)dk * N;      /* [dk][N] the state update's factors */
    float *A = fac + (int64_t)dk * N;      /* [N][N] */
    float *B = A + N * N;                  /* [N][N] */
    float *wk = B + N * N;                 /* [N][dk] k_t P_t */
    float *wq = wk + (int64_t)N * dk;      /* [N][dk] q_t P_t scale */
    float *U = wq + (int64_t)N * dk;       /* [N][dv] */
    float *ra = U + (int64_t)N * dv;       /* [N] a row of A */
    float *rb = ra + N;                    /* [N] a row of B */
    float *col = rb + N;                   /* [N] one decay per head: P_ts of column s */
    float *run = col + N;                  /* [dk] a running decay */
#define Q_(t)       (a->q + (t0 + (t)) * a->qk_stride)
#define K_(t)       (a->k + (t0 + (t)) * a->qk_stride)
#define G_(p, t, i) (p)[(t)*ng + (ng == 1 ? 0 : (i))]
    for (int t = 0; t < C; t++) {
        const float *g = a->g + (t0 + t) * a->g_stride;
        for (int i = 0; i < ng; i++) {
            decay[t * ng + i] = expf(g[i]);
            prod[t * ng + i] = (t ? prod[(t - 1) * ng + i] : 1.0f) * decay[t * ng + i];
        }
        for (int i = 0; i < dk; i++) {
            kt[(int64_t)i * N + t] = K_(t)[i];
            wk[(int64_t)t * dk + i] = K_(t)[i] * G_(prod, t, i);
            wq[(int64_t)t * dk + i] = Q_(t)[i] * G_(prod, t, i) * a->scale;
        }
    }
    /* intra-chunk coefficients, row by row: column s of e (or ra, rb times col[s], one decay
     * per head) is P_ts, one factor more each row. The columns past the chunk's are zero keys,
     * and e starts at 1: a level's vectors may run past the row's last column (quant.h), and
     * there stale values would decay into subnormals, which some CPUs take slowly. */
    for (int i = 0; i < dk; i++) {
        for (int t = C; t < N; t++) kt[(int64_t)i * N + t] = 0.0f;
        for (int t = 0; t < N; t++) e[(int64_t)i * N + t] = 1.0f;
    }
    for (int t = 0; t < C; t++) {
        kern->delta_row(K_(t), Q_(t), kt, N, ng == 1 ? NULL : e, N, decay + (int64_t)t * ng, dk,
                        t + 1, ra, rb);
        if (ng == 1) {
            for (int s = 0; s < t; s++) col[s] *= decay[t];
            col[t] = 1.0f;
            for (int s = 0; s <= t; s++) ra[s] *= col[s], rb[s] *= col[s];
        }
        for (int s = 0; s <= t; s++) { /* A's negated: the substitution adds -A_ts u_s */
            A[t * N + s] = -ra[s];
            B[t * N + s] = rb[s] * a->scale;
        }
    }
    /* forward substitution for U, and the outputs */
    kern->rows_times(wk, dk, St, dv, U, dv, C, dk, dv);
    kern->rows_times(wq, dk, St, dv, a->out + t0 * a->out_stride, a->out_stride, C, dk, dv);
    for (int t = 0; t < C; t++) {
        const float *v = a->v + (t0 + t) * a->v_stride;
        const float beta = a->beta[(t0 + t) * a->beta_stride];
        float *u = U + (int64_t)t * dv;
        for (int j = 0; j < dv; j++) u[j] = v[j] - u[j];
        kern->rows_update(u, 0, 1, NULL, A + t * N, 0, U, dv, t, dv);
        for (int j = 0; j < dv; j++) u[j] *= beta;
        kern->rows_update(a->out + (t0 + t) * a->out_stride, 0, 1, NULL, B + t * N, 0, U, dv, t + 1,
                          dv);
    }
    /* the state after the chunk: S0 P_last + sum_s u_s (k_s P_(last,s))^T, s from the last
     * token back, P built backwards: row i of St takes the factors k_s[i] P_(last,s)[i] */
    for (int i = 0; i < ng; i++) run[i] = 1.0f;
    for (int s = C - 1; s >= 0; s--) {
        for (int i = 0; i < dk; i++)
            fac[(int64_t)i * N + (C - 1 - s)] = K_(s)[i] * run[ng == 1 ? 0 : i];
        for (int i = 0; i < ng; i++) run[i] *= decay[s * ng + i];
    }
    const float *last = prod + (int64_t)(C - 1) * ng; /* row i's factor P_last */
    if (ng == 1) {
        for (int i = 0; i < dk; i++) run[i] = last[0];
        last = run;
    }
    kern->rows_update(St, dv, dk, last, fac, N, U + (int64_t)(C - 1) * dv, -(int64_t)dv, C, dv);
#undef Q_
#undef K_
#undef G_
}

void moe_delta_rule_chunked(const moe_delta_args *a, int64_t n_tok, float *state, float *scratch) {
    const moe_kernels *kern = moe_kernels_get();
    for (int64_t t0 = 0; t0 < n_tok; t0 += MOE_DELTA_CHUNK) {
        const int C = (int)(n_tok - t0 < MOE_DELTA_CHUNK ? n_tok - t0 : MOE_DELTA_CHUNK);
        delta_chunk(kern, a, t0, C, state, scratch);
    }
}
