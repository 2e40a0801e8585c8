/* quantize.c: the weight quantizer of every type moe can write, with an optional importance
 * vector, one row or many rows on the thread pool -- what `moe quantize`, `moe synth` and the
 * audit ladder call.
 *
 * A row of type T is quantized as ggml_quantize_chunk(T, ...) would: without an importance
 * vector the types' reference quantizers, with one their weighted searches. The trap: IQ1_S,
 * IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S are meant to be quantized with an importance vector
 * (llama.cpp refuses without one); asked to quantize them without, moe uses an all-ones vector
 * (what ggml does with a uniform importance matrix), so the call never fails. The tools refuse
 * those types without --imatrix before they get here. */
#include "blocks.h"
#include "quantize_internal.h"

#include <string.h>

static void quantize_f32(const float *x, void *y, int64_t n, const float *qw) {
    (void)qw;
    moe_ref_f32_from_float(x, y, n);
}
static void quantize_f16(const float *x, void *y, int64_t n, const float *qw) {
    (void)qw;
    moe_ref_f16_from_float(x, y, n);
}
static void quantize_bf16(const float *x, void *y, int64_t n, const float *qw) {
    (void)qw;
    moe_ref_bf16_from_float(x, y, n);
}
static void quantize_q8_0(const float *x, void *y, int64_t n, const float *qw) {
    (void)qw; /* ggml ignores the importance matrix for Q8_0 and MXFP4 */
    moe_ref_q8_0_from_float(x, y, n);
}
static void quantize_mxfp4(const float *x, void *y, int64_t n, const float *qw) {
    (void)qw;
    moe_ref_mxfp4_from_float(x, y, n);
}

static const moe_quantize_fn quantizers[MOE_TYPE_COUNT] = {
    [MOE_TYPE_F32] = quantize_f32,
    [MOE_TYPE_F16] = quantize_f16,
    [MOE_TYPE_BF16] = quantize_bf16,
    [MOE_TYPE_Q8_0] = quantize_q8_0,
    [MOE_TYPE_Q4_0] = moe_quantize_q4_0,
    [MOE_TYPE_Q4_1] = moe_quantize_q4_1,
    [MOE_TYPE_Q5_0] = moe_quantize_q5_0,
    [MOE_TYPE_Q5_1] = moe_quantize_q5_1,
    [MOE_TYPE_Q2_K] = moe_quantize_q2_k,
    [MOE_TYPE_Q3_K] = moe_quantize_q3_k,
    [MOE_TYPE_Q4_K] = moe_quantize_q4_k,
    [MOE_TYPE_Q5_K] = moe_quantize_q5_k,
    [MOE_TYPE_Q6_K] = moe_quantize_q6_k,
    [MOE_TYPE_IQ4_NL] = moe_quantize_iq4_nl,
    [MOE_TYPE_IQ4_XS] = moe_quantize_iq4_xs,
    [MOE_TYPE_IQ2_XXS] = moe_quantize_iq2_xxs,
    [MOE_TYPE_IQ2_XS] = moe_quantize_iq2_xs,
    [MOE_TYPE_IQ2_S] = moe_quantize_iq2_s,
    [MOE_TYPE_IQ3_XXS] = moe_quantize_iq3_xxs,
    [MOE_TYPE_IQ3_S] = moe_quantize_iq3_s,
    [MOE_TYPE_IQ1_S] = moe_quantize_iq1_s,
    [MOE_TYPE_IQ1_M] = moe_quantize_iq1_m,
    [MOE_TYPE_MXFP4] = quantize_mxfp4,
};

bool moe_type_can_quantize(moe_type t) {
    return (unsigned)t < MOE_TYPE_COUNT && quantizers[t];
}

bool moe_type_needs_imatrix(moe_type t) {
    return t == MOE_TYPE_IQ1_S || t == MOE_TYPE_IQ1_M || t == MOE_TYPE_IQ2_XXS ||
           t == MOE_TYPE_IQ2_XS || t == MOE_TYPE_IQ2_S;
}

void moe_quantize_row(moe_type t, const float *x, void *out, int64_t n, const float *imatrix) {
    if (!moe_type_can_quantize(t))
        moe_die("moe_quantize_row: no quantizer for %s", moe_type_name(t));
    const moe_type_traits *tr = moe_type_traits_get(t);
    if (n % tr->block_values)
        moe_die("moe_quantize_row: %lld values of %s", (long long)n, tr->name);
    if (!imatrix && moe_type_needs_imatrix(t)) {
        /* the all-ones importance vector, one super-block at a time (blocks are independent) */
        float ones[MOE_QK_K];
        for (int i = 0; i < MOE_QK_K; i++) ones[i] = 1.0f;
        uint8_t *o = out;
        for (int64_t i = 0; i < n / MOE_QK_K; i++)
            quantizers[t](x + MOE_QK_K * i, o + (size_t)i * tr->block_bytes, MOE_QK_K, ones);
        return;
    }
    quantizers[t](x, out, n, imatrix);
}

typedef struct {
    moe_type type;
    const float *x;
    uint8_t *out;
    int64_t n;
    size_t row_bytes;
    const float *imatrix;
} rows_job;

static void quantize_rows_range(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const rows_job *j = arg;
    for (int64_t r = begin; r < end; r++)
        moe_quantize_row(j->type, j->x + r * j->n, j->out + (size_t)r * j->row_bytes, j->n,
                         j->imatrix);
}

void moe_quantize_rows(moe_type t, const float *x, void *out, int64_t n_rows, int64_t n,
                       const float *imatrix, moe_pool *pool) {
    rows_job j = {t, x, out, n, (size_t)moe_type_row_bytes(t, n), imatrix};
    /* chunks of rows small enough to balance the threads, large enough to amortise a claim */
    const int threads = moe_pool_n_threads(pool);
    int64_t chunk = n_rows / (8 * threads);
    chunk = chunk < 1 ? 1 : chunk > 64 ? 64 : chunk;
    moe_pool_for(pool, n_rows, chunk, quantize_rows_range, &j);
}

/* The traits' from_float of the IQ1 / IQ2 / IQ3 types: no importance vector (all-ones for the
 * types that need one). */
#define IQ_FROM_FLOAT(t, T)                                                                        \
    MOE_REF_FROM_FLOAT(t) {                                                                        \
        moe_quantize_row(MOE_TYPE_##T, in, blocks, n, NULL);                                       \
    }
IQ_FROM_FLOAT(iq2_xxs, IQ2_XXS)
IQ_FROM_FLOAT(iq2_xs, IQ2_XS)
IQ_FROM_FLOAT(iq2_s, IQ2_S)
IQ_FROM_FLOAT(iq3_xxs, IQ3_XXS)
IQ_FROM_FLOAT(iq3_s, IQ3_S)
IQ_FROM_FLOAT(iq1_s, IQ1_S)
IQ_FROM_FLOAT(iq1_m, IQ1_M)
