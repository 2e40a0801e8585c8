/* Suite "linear": linear attention and the state of hybrid models.
 *
 * The delta rule's chunked form against its token-by-token form (both decays); then, on the
 * ../shared/parity qwen3next model (parity itself is in the model suite): a 300-token prompt
 * prefilled in one call equals it fed token by token, prefill split anywhere equals one shot,
 * interleaved sequences and a third that reuses the first's prefix through a snapshot each make
 * the tokens they make alone, truncation refuses what it cannot do, the memory plan counts
 * recurrent state per sequence, and a verify step's rows can be taken back exactly (on every
 * hybrid fixture). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/engine/engine.h"

#define TOL_FORMS 2e-5 /* chunked vs token by token, float32 (relative to the largest value) */

static uint64_t rng_state;
static float rng_uniform(void) { /* [0, 1), xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (float)((rng_state * 2685821657736338717ull) >> 40) / (float)(1u << 24);
}

/* max |a - b| / max |b| over n values */
static double max_rel_diff(const float *a, const float *b, size_t n) {
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return scale > 0 ? diff / scale : diff;
}

static int32_t top_token(const float *logits, uint32_t n_vocab) {
    int32_t best = 0;
    for (uint32_t i = 1; i < n_vocab; i++) best = logits[i] > logits[best] ? (int32_t)i : best;
    return best;
}

/* ==== Ops: the two forms of the delta rule ==== */

static void delta_forms_agree(int n_g) {
    enum { T = 300, DK = 32, DV = 24, H = 3 };
    rng_state = 0x9e3779b97f4a7c15ull + (uint64_t)n_g;
    float *q = malloc(sizeof(float) * T * H * DK), *k = malloc(sizeof(float) * T * H * DK);
    float *v = malloc(sizeof(float) * T * H * DV), *g = malloc(sizeof(float) * T * H * DK);
    float *beta = malloc(sizeof(float) * T * H);
    float *out[2] = {malloc(sizeof(float) * T * H * DV), malloc(sizeof(float) * T * H * DV)};
    float *state[2] = {malloc(sizeof(float) * H * DK * DV), malloc(sizeof(float) * H * DK * DV)};
    float *scratch = malloc(sizeof(float) * moe_delta_scratch_floats(DK, DV));
    for (int i = 0; i < T * H * DK; i++) {
        q[i] = rng_uniform() - 0.5f;
        k[i] = rng_uniform() - 0.5f;
        g[i] = -3.0f * rng_uniform() * rng_uniform(); /* some strong decays, most mild */
    }
    for (int i = 0; i < T * H; i++) {
        moe_l2norm(q + i * DK, DK, 1e-6f);
        moe_l2norm(k + i * DK, DK, 1e-6f);
        beta[i] = rng_uniform();
    }
    for (int i = 0; i < T * H * DV; i++) v[i] = 2.0f * rng_uniform() - 1.0f;
    for (int i = 0; i < H * DK * DV; i++) state[0][i] = state[1][i] = rng_uniform() - 0.5f;
    for (int form = 0; form < 2; form++) {
        for (int h = 0; h < H; h++) {
            const moe_delta_args a = {.d_k = DK,
                                      .d_v = DV,
                                      .n_g = n_g,
                                      .scale = 1.0f / sqrtf(DK),
                                      .q = q + h * DK,
                                      .k = k + h * DK,
                                      .v = v + h * DV,
                                      .g = g + h * n_g,
                                      .beta = beta + h,
                                      .out = out[form] + h * DV,
                                      .qk_stride = H * DK,
                                      .v_stride = H * DV,
                                      .g_stride = H * n_g,
                                      .beta_stride = H,
                                      .out_stride = H * DV};
            float *s = state[form] + h * DK * DV;
            if (form)
                moe_delta_rule_chunked(&a, T, s, scratch);
            else
                moe_delta_rule_recurrent(&a, T, s, scratch);
        }
    }
    const double e_out = max_rel_diff(out[1], out[0], (size_t)T * H * DV);
    const double e_state = max_rel_diff(state[1], state[0], (size_t)H * DK * DV);
    print_message("delta rule, %s decay: chunked vs token by token over %d tokens: outputs %.3g, "
                  "state %.3g\n",
                  n_g == 1 ? "per-head" : "per-channel", T, e_out, e_state);
    assert_true(e_out <= TOL_FORMS && e_state <= TOL_FORMS);
    free(q), free(k), free(v), free(g), free(beta), free(scratch);
    for (int i = 0; i < 2; i++) free(out[i]), free(state[i]);
}

/* The delta rule's f32 products (quant.h: rows_times, rows_update, delta_row) at every level the
 * CPU runs give the scalar reference's bits (the order is fixed element by element), on shapes that
 * leave partial vectors and blocks: so the rule's results do not depend on the level. */
/* The indexer's scores at every SIMD level equal the scalar reference bit for bit: head widths
 * with and without a tail past whole 32-value steps, key counts around the levels' key blocks,
 * keys that are zero (a dot of +-0), negative (ReLU's 0) and NaN (fmaxf's 0). */
static void index_scores_equal_reference(void **st) {
    (void)st;
    enum { HEADS = 5, MAX_N = 136, STRIDE = 2 * MAX_N + 3, KEYS = 71 };
    rng_state = 0x1de5c0e5ull;
    static float q[HEADS * MAX_N], keys[KEYS * STRIDE];
    float w[HEADS];
    for (int i = 0; i < HEADS * MAX_N; i++) q[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < KEYS * STRIDE; i++) keys[i] = rng_uniform() - 0.5f;
    for (int h = 0; h < HEADS; h++) w[h] = rng_uniform() - 0.25f;
    for (int d = 0; d < MAX_N; d++) {
        keys[3 * STRIDE + d] = 0.0f;                 /* a dot of zeros */
        keys[4 * STRIDE + d] = -q[d];                /* head 0's dot negative */
        keys[5 * STRIDE + d] = d % 7 ? 0.0f : -0.0f; /* signed zeros */
    }
    keys[6 * STRIDE + 9] = NAN;
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    int checked = 0;
    for (int level = MOE_ISA_SCALAR + 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *kern = moe_kernels_for_path((moe_isa)level, false);
        if (!kern) continue;
        static const int ns[] = {8, 32, 40, 128, 136};
        static const int counts[] = {1, 7, 16, 33, KEYS};
        for (size_t in = 0; in < sizeof ns / sizeof ns[0]; in++)
            for (size_t ic = 0; ic < sizeof counts / sizeof counts[0]; ic++) {
                float o0[KEYS], o1[KEYS];
                const int n = ns[in], nk = counts[ic];
                ref->index_scores(q, w, HEADS, n, keys, STRIDE, nk, o0);
                kern->index_scores(q, w, HEADS, n, keys, STRIDE, nk, o1);
                if (memcmp(o0, o1, sizeof(float) * (size_t)nk))
                    fail_msg("%s index_scores, heads of %d, %d keys: differs",
                             moe_isa_name((moe_isa)level), n, nk);
                checked++;
            }
    }
    print_message("the indexer's scores: %d shapes at the SIMD levels equal the scalar reference "
                  "bit for bit\n",
                  checked);
}

static void linear_products_equal_reference(void **st) {
    (void)st;
    enum { K = 37, N = 64, M = 7, XS = 67 };
    rng_state = 0x51ed2701ull;
    float a[M * XS], b[K * XS], c[N], e0[K * N], ka[K], kb[K], d[K];
    for (int i = 0; i < M * XS; i++) a[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < K * XS; i++) b[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < N; i++) c[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < K; i++) ka[i] = rng_uniform() - 0.5f, kb[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < K; i++) d[i] = expf(-3.0f * rng_uniform());
    for (int i = 0; i < K * N; i++) e0[i] = rng_uniform();
    const moe_kernels *ref = moe_kernels_for_path(MOE_ISA_SCALAR, false);
    int checked = 0;
    for (int level = MOE_ISA_SCALAR + 1; level < MOE_ISA_COUNT; level++) {
        const moe_kernels *kern = moe_kernels_for_path((moe_isa)level, false);
        if (!kern) continue;
        const char *name = moe_isa_name((moe_isa)level);
        static const int ns[] = {1, 7, 16, 24, 40, 64};
        for (size_t in = 0; in < sizeof ns / sizeof ns[0]; in++) {
            const int n = ns[in];
            float o0[M * XS], o1[M * XS], y0[M * XS], y1[M * XS], e1[K * N], ea[K * N];
            float ra0[N], rb0[N], ra1[N], rb1[N];
            for (int m = 1; m <= M; m += 3) { /* 1, 4, 7 rows */
                ref->rows_times(a, XS, b, XS, o0, XS, m, K, n);
                kern->rows_times(a, XS, b, XS, o1, XS, m, K, n);
                for (int r = 0; r < m; r++)
                    if (memcmp(o0 + r * XS, o1 + r * XS, sizeof(float) * (size_t)n))
                        fail_msg("%s rows_times %d x %d x %d: row %d differs", name, m, K, n, r);
            }
            for (int ns_ = 0; ns_ <= 5; ns_ += 5) /* none, then 5 rows, the last first */
                for (int sign = 1; sign >= -1; sign -= 2) {
                    const float *x = sign > 0 ? b : b + 4 * XS, *scale = sign > 0 ? NULL : d;
                    memcpy(y0, a, sizeof y0), memcpy(y1, a, sizeof y1);
                    ref->rows_update(y0, XS, M, scale, c, 3, x, sign * XS, ns_, n);
                    kern->rows_update(y1, XS, M, scale, c, 3, x, sign * XS, ns_, n);
                    for (int r = 0; r < M; r++)
                        if (memcmp(y0 + r * XS, y1 + r * XS, sizeof(float) * (size_t)n))
                            fail_msg("%s rows_update %d rows, stride %+d, %d columns: row %d "
                                     "differs",
                                     name, ns_, sign * XS, n, r);
                }
            for (int with_e = 0; with_e < 2; with_e++) {
                memcpy(e1, e0, sizeof e1), memcpy(ea, e0, sizeof ea);
                ref->delta_row(ka, kb, b, N, with_e ? e1 : NULL, N, d, K, n, ra0, rb0);
                kern->delta_row(ka, kb, b, N, with_e ? ea : NULL, N, d, K, n, ra1, rb1);
                bool same = !memcmp(ra0, ra1, sizeof(float) * (size_t)n) &&
                            !memcmp(rb0, rb1, sizeof(float) * (size_t)n);
                for (int i = 0; with_e && i < K; i++)
                    same = same && !memcmp(e1 + i * N, ea + i * N, sizeof(float) * (size_t)n);
                if (!same)
                    fail_msg("%s delta_row %d columns (%s e) differs", name, n,
                             with_e ? "with" : "without");
            }
            checked++;
        }
    }
    print_message("linear attention's f32 products: %d shapes x 3 kernels at the SIMD levels equal "
                  "the scalar reference bit for bit\n",
                  checked);
}

static void delta_chunked_equals_recurrent_gdn(void **st) {
    (void)st;
    delta_forms_agree(1);
}

static void delta_chunked_equals_recurrent_kda(void **st) {
    (void)st;
    delta_forms_agree(32);
}

/* The conv keeps its window across calls: one call over n tokens equals n calls of one. */
static void conv_state_rolls(void **st) {
    (void)st;
    enum { N = 9, CH = 5, TAPS = 4 };
    float x[2][N * CH], w[CH * TAPS], state[2][CH * (TAPS - 1)];
    rng_state = 42;
    for (int i = 0; i < N * CH; i++) x[0][i] = x[1][i] = rng_uniform() - 0.5f;
    for (int i = 0; i < CH * TAPS; i++) w[i] = rng_uniform() - 0.5f;
    for (int i = 0; i < CH * (TAPS - 1); i++) state[0][i] = state[1][i] = rng_uniform();
    moe_conv1d_silu(x[0], CH, N, CH, w, TAPS, state[0]);
    for (int t = 0; t < N; t++) moe_conv1d_silu(x[1] + t * CH, CH, 1, CH, w, TAPS, state[1]);
    assert_memory_equal(x[0], x[1], sizeof x[0]);
    assert_memory_equal(state[0], state[1], sizeof state[0]);
    /* channel 2, token 5: silu(sum_k in[t - 3 + k] w[k]) with in[] the raw inputs */
    float in[N * CH];
    rng_state = 42;
    for (int i = 0; i < N * CH; i++) in[i] = rng_uniform() - 0.5f;
    float y = 0;
    for (int k = 0; k < TAPS; k++) y += in[(5 - 3 + k) * CH + 2] * w[2 * TAPS + k];
    assert_float_equal(x[0][5 * CH + 2], y / (1 + expf(-y)), 1e-6);
}

/* ==== The engine on qwen3next ==== */

#define MODEL "parity/qwen3next-f32.gguf" /* the default hybrid; some tests run on each below */
#define GLM5NEXT                                                                                   \
    "parity/glm5next-f32.gguf" /* KDA with hyper-connections and the pooled indexer                \
                                */
enum { N_LONG = 300 };

/* The model a test's state names (NULL state: MODEL), or NULL without ../shared. */
static moe_model *load_model_at(void **st) {
    const char *path = moe_test_shared(st && *st ? (const char *)*st : MODEL);
    if (!path) return NULL;
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    if (!m) fail_msg("%s", err.msg);
    return m;
}

static moe_model *load_model(void) {
    return load_model_at(NULL);
}

/* Contexts of many sequences run on two threads: the heads of the delta rule and the matmuls
 * split between them must not change a bit. */
static moe_ctx *new_ctx(const moe_model *m, uint32_t n_seq, uint32_t max_rows) {
    moe_error err = {0};
    moe_ctx_params cp = {
        .n_ctx = 512, .n_seq = n_seq, .max_rows = max_rows, .n_threads = n_seq > 1 ? 2 : 1};
    moe_ctx *c = moe_ctx_new(m, &cp, &err);
    if (!c) fail_msg("%s", err.msg);
    return c;
}

static void long_prompt(int32_t *ids, uint32_t n) {
    rng_state = 7;
    ids[0] = 1;
    for (uint32_t i = 1; i < n; i++) ids[i] = 3 + (int32_t)(rng_uniform() * 500);
}

/* Feed ids[from..to) of sequence seq in calls of at most `step` rows, logits for every row. */
static void feed(moe_ctx *c, int32_t seq, const int32_t *ids, uint32_t from, uint32_t to,
                 uint32_t step, float *logits, uint32_t n_vocab) {
    moe_row rows[N_LONG];
    moe_error err = {0};
    for (uint32_t at = from; at < to;) {
        const uint32_t n = to - at < step ? to - at : step;
        for (uint32_t i = 0; i < n; i++)
            rows[i] = (moe_row){seq, (int32_t)(at + i), ids[at + i], true};
        if (moe_ctx_decode(c, rows, n, logits + (size_t)at * n_vocab, &err) != MOE_OK)
            fail_msg("%s", err.msg);
        at += n;
    }
}

/* One call of 300 rows (the chunked delta rule: 64 + 64 + 64 + 64 + 44) against 300 calls of
 * one row (token by token): every row's logits. */
static void prefill_chunked_equals_token_by_token(void **st) {
    moe_model *m = load_model_at(st);
    MOE_SKIP_IF_NULL(m);
    const uint32_t nv = m->cfg.n_vocab;
    int32_t ids[N_LONG];
    long_prompt(ids, N_LONG);
    float *one = malloc(sizeof(float) * N_LONG * nv), *each = malloc(sizeof(float) * N_LONG * nv);
    moe_ctx *a = new_ctx(m, 1, N_LONG), *b = new_ctx(m, 1, 1);
    feed(a, 0, ids, 0, N_LONG, N_LONG, one, nv);
    feed(b, 0, ids, 0, N_LONG, 1, each, nv);
    double worst = 0;
    for (uint32_t r = 0; r < N_LONG; r++) {
        worst = fmax(worst, max_rel_diff(one + (size_t)r * nv, each + (size_t)r * nv, nv));
        assert_int_equal(top_token(one + (size_t)r * nv, nv), top_token(each + (size_t)r * nv, nv));
    }
    print_message("300-token prefill in one call vs token by token: worst row %.3g\n", worst);
    assert_true(worst <= TOL_FORMS);
    moe_ctx_free(a), moe_ctx_free(b), free(one), free(each), moe_model_free(m);
}

/* The prompt in two calls split at 1, 63, 64, 65 and 200 gives one call's logits, and the
 * greedy continuation after it is the same. */
static void prefill_split_equals_one_shot(void **st) {
    moe_model *m = load_model_at(st);
    MOE_SKIP_IF_NULL(m);
    const uint32_t nv = m->cfg.n_vocab, splits[] = {1, 63, 64, 65, 200};
    enum { N_GEN = 8 };
    int32_t ids[N_LONG + N_GEN];
    long_prompt(ids, N_LONG);
    float *ref = malloc(sizeof(float) * (N_LONG + N_GEN) * nv),
          *got = malloc(sizeof(float) * (N_LONG + N_GEN) * nv);
    moe_ctx *c = new_ctx(m, 1, N_LONG);
    feed(c, 0, ids, 0, N_LONG, N_LONG, ref, nv);
    for (uint32_t t = 0; t < N_GEN; t++) { /* greedy from the one-shot prefill */
        ids[N_LONG + t] = top_token(ref + (size_t)(N_LONG - 1 + t) * nv, nv);
        feed(c, 0, ids, N_LONG + t, N_LONG + t + 1, 1, ref, nv);
    }
    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++) {
        moe_error err = {0};
        assert_int_equal(moe_ctx_seq_truncate(c, 0, 0, &err), MOE_OK);
        feed(c, 0, ids, 0, splits[s], N_LONG, got, nv);
        feed(c, 0, ids, splits[s], N_LONG, N_LONG, got, nv);
        for (uint32_t t = 0; t < N_GEN; t++) {
            assert_int_equal(top_token(got + (size_t)(N_LONG - 1 + t) * nv, nv), ids[N_LONG + t]);
            feed(c, 0, ids, N_LONG + t, N_LONG + t + 1, 1, got, nv);
        }
        const double e = max_rel_diff(got, ref, (size_t)(N_LONG + N_GEN) * nv);
        print_message("split at %3u: worst logit %.3g against one shot\n", splits[s], e);
        assert_true(e <= TOL_FORMS);
    }
    moe_ctx_free(c), free(ref), free(got), moe_model_free(m);
}

/* ==== Many sequences, snapshots and prefix reuse ==== */

enum { N_SEQ = 3, N_PROMPT = 12, N_STEPS = 10, EXT = 5 };

/* Greedy tokens of one prompt alone in a fresh context: prefill in one call, then N_STEPS. */
static void generate_alone(const moe_model *m, const int32_t *prompt, uint32_t n_prompt,
                           int32_t *out) {
    const uint32_t nv = m->cfg.n_vocab;
    moe_ctx *c = new_ctx(m, 1, n_prompt);
    float *logits = malloc(sizeof(float) * (n_prompt + N_STEPS) * nv);
    int32_t ids[64];
    memcpy(ids, prompt, sizeof(int32_t) * n_prompt);
    feed(c, 0, ids, 0, n_prompt, n_prompt, logits, nv);
    for (uint32_t t = 0; t < N_STEPS; t++) {
        out[t] = ids[n_prompt + t] = top_token(logits + (size_t)(n_prompt - 1 + t) * nv, nv);
        feed(c, 0, ids, n_prompt + t, n_prompt + t + 1, 1, logits, nv);
    }
    moe_ctx_free(c);
    free(logits);
}

/* Sequences 0 and 1 prefill together in one interleaved batch; 0 is snapshotted at the end of
 * its prompt; both decode a few steps together; then request 2 -- the first prompt plus EXT more
 * tokens -- asks for reuse in sequence 2, gets the snapshot (the first prompt, not sequence 0's
 * generated tokens), feeds only its extension and decodes with the others, one row per sequence
 * per step. Every sequence makes exactly the tokens it makes alone. */
static void interleaved_and_reused_match_alone(void **st) {
    moe_model *m = load_model_at(st);
    MOE_SKIP_IF_NULL(m);
    const uint32_t nv = m->cfg.n_vocab;
    int32_t prompt[N_SEQ][N_PROMPT + EXT] = {
        {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315},
        {1, 298, 315, 421, 395, 317, 426, 61, 62, 63, 64, 65},
    };
    memcpy(prompt[2], prompt[0], sizeof(int32_t) * N_PROMPT);
    const int32_t ext[EXT] = {300, 301, 261, 302, 303};
    memcpy(prompt[2] + N_PROMPT, ext, sizeof ext);
    const uint32_t n_prompt[N_SEQ] = {N_PROMPT, N_PROMPT, N_PROMPT + EXT};
    int32_t alone[N_SEQ][N_STEPS];
    for (int s = 0; s < N_SEQ; s++) generate_alone(m, prompt[s], n_prompt[s], alone[s]);

    moe_ctx *c = new_ctx(m, N_SEQ, 2 * N_PROMPT);
    moe_error err = {0};
    moe_row rows[2 * N_PROMPT];
    float *logits = malloc(sizeof(float) * 2 * N_PROMPT * nv);
    for (int i = 0; i < N_PROMPT; i++)
        for (int s = 0; s < 2; s++)
            rows[2 * i + s] = (moe_row){s, i, prompt[s][i], i == N_PROMPT - 1};
    assert_int_equal(moe_ctx_decode(c, rows, 2 * N_PROMPT, logits, &err), MOE_OK);
    const int32_t snap = moe_ctx_seq_snapshot(c, 0, &err);
    assert_true(snap >= 0);
    int32_t got[N_SEQ][N_STEPS], next[N_SEQ];
    uint32_t step[N_SEQ] = {0, 0, 0};
    for (int s = 0; s < 2; s++) next[s] = got[s][0] = top_token(logits + (size_t)s * nv, nv);
    for (int t = 0; t < 3; t++) { /* 0 and 1 decode together */
        for (int s = 0; s < 2; s++)
            rows[s] = (moe_row){s, (int32_t)(N_PROMPT + step[s]), next[s], true};
        assert_int_equal(moe_ctx_decode(c, rows, 2, logits, &err), MOE_OK);
        for (int s = 0; s < 2; s++)
            next[s] = got[s][++step[s]] = top_token(logits + (size_t)s * nv, nv);
    }
    /* request 2: reuse stops at the snapshot (sequence 0 has since moved on to other tokens);
     * sequence 0 alone offers that much, sequence 1 (a different prompt) nothing */
    assert_int_equal(moe_ctx_seq_prefix(c, 0, prompt[2], n_prompt[2] - 1), N_PROMPT);
    assert_int_equal(moe_ctx_seq_prefix(c, 1, prompt[2], n_prompt[2] - 1), 0);
    uint32_t reused = 0;
    assert_int_equal(moe_ctx_seq_reuse(c, 2, prompt[2], n_prompt[2] - 1, &reused, &err), MOE_OK);
    assert_int_equal(reused, N_PROMPT);
    assert_int_equal(moe_ctx_seq_len(c, 2), N_PROMPT);
    for (uint32_t i = 0; i < EXT; i++)
        rows[i] = (moe_row){2, (int32_t)(N_PROMPT + i), prompt[2][N_PROMPT + i], i == EXT - 1};
    assert_int_equal(moe_ctx_decode(c, rows, EXT, logits, &err), MOE_OK);
    next[2] = got[2][0] = top_token(logits, nv);
    while (step[2] + 1 < N_STEPS) { /* all three, one row each per step, until each is done */
        uint32_t n = 0;
        int32_t who[N_SEQ];
        for (int s = 0; s < N_SEQ; s++) {
            if (step[s] + 1 >= N_STEPS) continue;
            who[n] = s;
            rows[n++] = (moe_row){s, (int32_t)(n_prompt[s] + step[s]), next[s], true};
        }
        assert_int_equal(moe_ctx_decode(c, rows, n, logits, &err), MOE_OK);
        for (uint32_t i = 0; i < n; i++) {
            const int s = who[i];
            next[s] = got[s][++step[s]] = top_token(logits + (size_t)i * nv, nv);
        }
    }
    for (int s = 0; s < N_SEQ; s++)
        for (int t = 0; t < N_STEPS; t++)
            if (got[s][t] != alone[s][t])
                fail_msg("sequence %d, step %d: token %d, alone %d", s, t, got[s][t], alone[s][t]);
    moe_ctx_free(c);
    free(logits);
    moe_model_free(m);
}

/* A hybrid cannot cut its recurrent state back: truncation needs a snapshot at that exact
 * position, says so otherwise, and with one continues exactly as the first time. */
static void truncate_needs_snapshot(void **st) {
    (void)st;
    moe_model *m = load_model();
    MOE_SKIP_IF_NULL(m);
    const uint32_t nv = m->cfg.n_vocab;
    int32_t ids[40];
    long_prompt(ids, 40);
    float *first = malloc(sizeof(float) * 40 * nv), *again = malloc(sizeof(float) * 40 * nv);
    moe_ctx *c = new_ctx(m, 2, 40);
    moe_error err = {0};
    feed(c, 0, ids, 0, 20, 20, first, nv);
    const int32_t snap = moe_ctx_seq_snapshot(c, 0, &err);
    feed(c, 0, ids, 20, 40, 20, first, nv);
    assert_int_equal(moe_ctx_seq_truncate(c, 0, 30, &err), MOE_ERR_ARG);
    print_message("error: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "no snapshot at 30 (snapshots at: 20)"));
    assert_int_equal(moe_ctx_seq_len(c, 0), 40);
    moe_error_clear(&err);
    assert_int_equal(moe_ctx_seq_truncate(c, 0, 20, &err), MOE_OK);
    assert_int_equal(moe_ctx_seq_len(c, 0), 20);
    feed(c, 0, ids, 20, 40, 20, again, nv);
    assert_memory_equal(first + 20 * nv, again + 20 * nv, sizeof(float) * 20 * nv);
    /* the same snapshot, restored into another sequence, continues the same way */
    assert_int_equal(moe_ctx_seq_restore(c, 1, snap, &err), MOE_OK);
    feed(c, 1, ids, 20, 40, 20, again, nv);
    assert_memory_equal(first + 20 * nv, again + 20 * nv, sizeof(float) * 20 * nv);
    /* cutting sequence 0 below the snapshot drops it */
    assert_int_equal(moe_ctx_seq_truncate(c, 0, 0, &err), MOE_OK);
    assert_int_equal(moe_ctx_seq_restore(c, 1, snap, &err), MOE_ERR_ARG);
    moe_ctx_free(c), free(first), free(again), moe_model_free(m);
}

/* The plan counts KV per token over the one attention layer and the recurrent state per
 * sequence over the one GDN layer: conv [2K + V][3] + state [4 heads][32][32] floats. */
/* ==== Verify steps: taking drafts back ==== */

enum { N_VERIFY = 4, N_VPROMPT = 12 };

/* Prefill a fixed prompt into sequence 0 of a fresh context. */
static moe_ctx *verify_ctx(const moe_model *m, float *logits) {
    moe_error err = {0};
    moe_ctx_params cp = {.n_ctx = 64, .n_seq = 1, .max_rows = N_VPROMPT, .n_verify = N_VERIFY};
    moe_ctx *c = moe_ctx_new(m, &cp, &err);
    if (!c) fail_msg("%s", err.msg);
    int32_t ids[N_VPROMPT];
    long_prompt(ids, N_VPROMPT);
    feed(c, 0, ids, 0, N_VPROMPT, N_VPROMPT, logits, m->cfg.n_vocab);
    return c;
}

/* A verify step of 4 rows gives the logits 4 plain steps give; keeping the first k of its rows
 * (KV rows dropped, the recurrent state taken from the checkpoint after row k) and then
 * feeding a token gives, bit for bit, what feeding those k tokens and then that one gives. Not
 * rolling the recurrent state back would run on drafts that were refused: the last check says
 * the rollback is what makes the difference. */
static void verify_accept_model(const char *rel) {
    const char *path = moe_test_shared(rel);
    if (!path) return;
    moe_error err = {0};
    moe_model *m = moe_model_load(path, &err);
    if (!m) fail_msg("%s", err.msg);
    const uint32_t nv = m->cfg.n_vocab;
    const int32_t drafts[N_VERIFY] = {261, 378, 432, 383}, next = 77;
    float *scratch = moe_xmalloc(sizeof(float) * N_VPROMPT * nv);
    float *verified = moe_xmalloc(sizeof(float) * N_VERIFY * nv);
    float *plain = moe_xmalloc(sizeof(float) * N_VERIFY * nv);
    float a[512 * 4], b[512 * 4];
    assert_true(nv <= 512 * 4);
    bool rollback_mattered = false;
    for (uint32_t keep = 1; keep <= N_VERIFY; keep++) {
        moe_ctx *v = verify_ctx(m, scratch), *p = verify_ctx(m, scratch);
        moe_row rows[N_VERIFY];
        for (uint32_t i = 0; i < N_VERIFY; i++)
            rows[i] = (moe_row){0, (int32_t)(N_VPROMPT + i), drafts[i], true};
        assert_int_equal(moe_ctx_verify(v, rows, N_VERIFY, verified, &err), MOE_OK);
        for (uint32_t i = 0; i < keep; i++)
            assert_int_equal(moe_ctx_decode(p, &rows[i], 1, plain + i * nv, &err), MOE_OK);
        if (memcmp(verified, plain, sizeof(float) * keep * nv) != 0)
            fail_msg("%s: the verify step's logits differ from plain steps", rel);
        if (moe_ctx_seq_accept(v, 0, keep, &err) != MOE_OK) fail_msg("%s", err.msg);
        assert_int_equal(moe_ctx_seq_len(v, 0), N_VPROMPT + keep);
        const moe_row after = {0, (int32_t)(N_VPROMPT + keep), next, true};
        assert_int_equal(moe_ctx_decode(v, &after, 1, a, &err), MOE_OK);
        assert_int_equal(moe_ctx_decode(p, &after, 1, b, &err), MOE_OK);
        if (memcmp(a, b, sizeof(float) * nv) != 0)
            fail_msg("%s: keeping %u of %u rows differs from feeding them", rel, keep, N_VERIFY);
        moe_ctx_free(v);
        moe_ctx_free(p);
        /* without the checkpoint: truncating a hybrid after the verify step is refused (no
         * snapshot there), and continuing on the unrolled state gives other logits */
        if (keep < N_VERIFY && m->cfg.n_layer_linear) {
            moe_ctx *u = verify_ctx(m, scratch);
            assert_int_equal(moe_ctx_verify(u, rows, N_VERIFY, verified, &err), MOE_OK);
            assert_int_not_equal(moe_ctx_seq_truncate(u, 0, N_VPROMPT + keep, &err), MOE_OK);
            const moe_row unrolled = {0, N_VPROMPT + N_VERIFY, next, true};
            assert_int_equal(moe_ctx_decode(u, &unrolled, 1, a, &err), MOE_OK);
            rollback_mattered |= memcmp(a, b, sizeof(float) * nv) != 0;
            moe_ctx_free(u);
        }
    }
    if (m->cfg.n_layer_linear) assert_true(rollback_mattered);
    /* accepting what no verify step left, or more rows than it ran, is refused */
    moe_ctx *v = verify_ctx(m, scratch);
    assert_int_not_equal(moe_ctx_seq_accept(v, 0, 1, &err), MOE_OK);
    moe_ctx_free(v);
    free(scratch);
    free(verified);
    free(plain);
    moe_model_free(m);
}

static void verify_accept_exact(void **st) {
    (void)st;
    MOE_SKIP_IF_NULL(moe_test_shared(MODEL));
    verify_accept_model("parity/qwen3next-f32.gguf");
    verify_accept_model("parity/kimi-linear-f32.gguf");
    verify_accept_model("parity/qwen35-mtp-f32.gguf");
    verify_accept_model("parity/qwen3moe-mixed.gguf"); /* attention only: KV rows dropped */
}

static void memory_plan_counts_recurrent_state(void **st) {
    (void)st;
    moe_model *m = load_model();
    MOE_SKIP_IF_NULL(m);
    moe_ctx_params cp = {.n_ctx = 100, .n_seq = 3, .n_snapshots = 5};
    moe_ctx_memory plan;
    moe_error err = {0};
    assert_int_equal(moe_ctx_memory_plan(m, &cp, &plan, &err), MOE_OK);
    const uint64_t conv = (2 * 2 * 32 + 4 * 32) * 3, delta = 4 * 32 * 32;
    assert_int_equal(plan.recurrent_bytes_per_seq, (conv + delta) * 4);
    assert_int_equal(plan.recurrent_bytes, 3 * (conv + delta) * 4);
    assert_int_equal(plan.snapshot_bytes, 5 * (conv + delta) * 4);
    assert_int_equal(plan.kv_bytes_per_token, 1 * 1 * (64 + 64) * 4);
    assert_int_equal(plan.kv_bytes, 3 * 100 * plan.kv_bytes_per_token);
    moe_model_free(m);
}

int moe_suite_linear(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(linear_products_equal_reference),
        cmocka_unit_test(index_scores_equal_reference),
        cmocka_unit_test(delta_chunked_equals_recurrent_gdn),
        cmocka_unit_test(delta_chunked_equals_recurrent_kda),
        cmocka_unit_test(conv_state_rolls),
        cmocka_unit_test(prefill_chunked_equals_token_by_token),
        cmocka_unit_test_prestate(prefill_chunked_equals_token_by_token, GLM5NEXT),
        cmocka_unit_test(prefill_split_equals_one_shot),
        cmocka_unit_test_prestate(prefill_split_equals_one_shot, GLM5NEXT),
        cmocka_unit_test(interleaved_and_reused_match_alone),
        cmocka_unit_test_prestate(interleaved_and_reused_match_alone, GLM5NEXT),
        cmocka_unit_test(truncate_needs_snapshot),
        cmocka_unit_test(memory_plan_counts_recurrent_state),
        cmocka_unit_test(verify_accept_exact),
    };
    return cmocka_run_group_tests_name("linear", tests, NULL, NULL);
}
