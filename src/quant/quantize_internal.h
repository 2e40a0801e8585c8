/* quantize_internal.h: quant's private interface between the weight quantizers (quantize_k.c,
 * quantize_iq.c) and the dispatcher (quantize.c). Not part of quant.h.
 *
 * Every moe_quantize_<t> quantizes one row of n values (n a multiple of the block size) with an
 * optional per-column importance vector qw[n] (NULL: none), as ggml's quantize_<t> does for one
 * row. The trap: qw is indexed by column within the row, the same vector for every row. */
#ifndef MOE_QUANT_QUANTIZE_INTERNAL_H
#define MOE_QUANT_QUANTIZE_INTERNAL_H

#include <stdint.h>

#define MOE_QUANTIZE_FN(t)                                                                         \
    void moe_quantize_##t(const float *x, void *y, int64_t n, const float *qw)

MOE_QUANTIZE_FN(q4_0);
MOE_QUANTIZE_FN(q4_1);
MOE_QUANTIZE_FN(q5_0);
MOE_QUANTIZE_FN(q5_1);
MOE_QUANTIZE_FN(q2_k);
MOE_QUANTIZE_FN(q3_k);
MOE_QUANTIZE_FN(q4_k);
MOE_QUANTIZE_FN(q5_k);
MOE_QUANTIZE_FN(q6_k);
MOE_QUANTIZE_FN(iq4_nl);
MOE_QUANTIZE_FN(iq4_xs);
MOE_QUANTIZE_FN(iq2_xxs);
MOE_QUANTIZE_FN(iq2_xs);
MOE_QUANTIZE_FN(iq2_s);
MOE_QUANTIZE_FN(iq3_xxs);
MOE_QUANTIZE_FN(iq3_s);
MOE_QUANTIZE_FN(iq1_s);
MOE_QUANTIZE_FN(iq1_m);

/* ggml's make_qx_quants with rmse_type 1 (quantize_k.c): symmetric fit of n values to
 * [-nmax, nmax-1], codes + nmax in L, weights qw or x^2. */
float moe_fit_symmetric(int n, int nmax, const float *x, int8_t *L, const float *qw);
/* ggml's make_qp_quants: fit of n non-negative values to [0, nmax] with weights w; levels in
 * L, returns the scale. */
float moe_fit_positive(int n, int nmax, const float *x, uint8_t *L, const float *w);
/* sum of x^2 over n values, accumulated in order (ggml's sigma2 sums). */
float moe_sum_sq(const float *x, int64_t n);

/* Weighted squared distances of xval[dims] to `count` codebook entries whose odd levels are in
 * soa, [dims][count rounded up to 8], the entry's values being level * a + b, times scale:
 * d2[j] = sum_i w[i] * (scale * q_i - xval[i])^2, summed over i in order. The AVX2 version
 * (quantize_iq_avx2.c) gives the reference's bits. */
typedef void (*moe_iq_neighbour_d2_fn)(const int8_t *soa, int count, int dims, const float *xval,
                                       const float *w, float scale, float a, float b, float *d2);
void moe_iq_neighbour_d2_ref(const int8_t *soa, int count, int dims, const float *xval,
                             const float *w, float scale, float a, float b, float *d2);
void moe_iq_neighbour_d2_avx2(const int8_t *soa, int count, int dims, const float *xval,
                              const float *w, float scale, float a, float b, float *d2);

/* One pass of the IQ4 scale search over a 32-value block: each value's nearest IQ4_NL codebook
 * entry at inverse scale id (codes to L unless NULL), and sum w q x and sum w q^2 in order. The
 * AVX2 version (quantize_iq_avx2.c) gives the reference's bits. */
typedef void (*moe_iq4_pass_fn)(const float *xb, const float *weight, float id, uint8_t *L,
                                float *sumqx, float *sumq2);
void moe_iq4_pass_ref(const float *xb, const float *weight, float id, uint8_t *L, float *sumqx,
                      float *sumq2);
void moe_iq4_pass_avx2(const float *xb, const float *weight, float id, uint8_t *L, float *sumqx,
                       float *sumq2);

#endif
