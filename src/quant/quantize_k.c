/* quantize_k.c: weight quantizers for the scale-and-offset types -- Q4_0 Q4_1 Q5_0 Q5_1 with an
 * importance matrix, Q2_K Q3_K Q4_K Q5_K Q6_K with and without one, and MXFP4 -- following
 * ggml's algorithms (ggml-quants.c) step for step, so that the same floats give the same bytes.
 *
 * Each type has two paths, chosen as ggml_quantize_chunk chooses them: without an importance
 * vector the "reference" fit (min/max start, a small scan of scales, 4- or 6-bit sub-block
 * scales relative to the largest); with one, the weighted fit (weights imatrix[col] *
 * sqrt(sigma2 + x^2)) whose sub-block scales are themselves fitted by weighted least squares.
 * The trap: byte-exactness hangs on float operation order. Every accumulation here runs in the
 * order ggml's does, one rounding per operation (no FMA: the file is built for baseline x86-64
 * under -std=c11, so nothing is contracted); "simplifying" an expression changes blocks. */
#include "blocks.h"
#include "quantize_internal.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define GROUP_MAX_EPS 1e-15f /* ggml: a group whose max |x| is below this is all zero */

static inline int clamp_int(int v, int lo, int hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

/* ==== Scalar fits shared by the types (ggml's make_*_quants) ==== */

/* Weight of x under ggml's rmse_type 1..4 when no explicit weights are given. */
static inline float implicit_weight(int rmse_type, float x) {
    return rmse_type == 1   ? x * x
           : rmse_type == 2 ? 1
           : rmse_type == 3 ? fabsf(x)
                            : sqrtf(fabsf(x));
}

/* Symmetric fit of n values to integers in [-nmax, nmax-1] (stored + nmax in L): starts from
 * -nmax / (signed max), refits by weighted least squares, then tries 18 neighbouring scales
 * -(nmax + 0.1 is)/max and keeps the best. Weights qw, or x^2 (rmse_type 1) when qw is NULL.
 * Returns the scale. ggml's make_qx_quants with rmse_type 1. */
/* The value of largest magnitude (the first of equals); false, with L zeroed, when every value
 * is below GROUP_MAX_EPS. */
static bool signed_max(int n, const float *x, int8_t *L, float *max) {
    float amax = 0;
    *max = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) amax = ax, *max = x[i];
    }
    if (amax >= GROUP_MAX_EPS) return true;
    memset(L, 0, (size_t)n);
    return false;
}

/* The first guess of both symmetric fits: levels at -nmax / (signed max), stored + bias in L,
 * and their weighted sums (weights qw, or x^2). False for an all-zero group (L zeroed). */
static bool symmetric_start(int n, int nmax, const float *x, const float *qw, int bias, int8_t *L,
                            float *max, float *sumlx, float *suml2) {
    if (!signed_max(n, x, L, max)) return false;
    const float iscale = -nmax / *max;
    float lx = 0, l2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = clamp_int(moe_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + bias);
        float w = qw ? qw[i] : implicit_weight(1, x[i]);
        lx += w * x[i] * l;
        l2 += w * l * l;
    }
    *sumlx = lx, *suml2 = l2;
    return true;
}

float moe_fit_symmetric(int n, int nmax, const float *x, int8_t *L, const float *qw) {
    float max, sumlx, suml2;
    if (!symmetric_start(n, nmax, x, qw, nmax, L, &max, &sumlx, &suml2)) return 0.f;
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        const float iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = clamp_int(moe_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = qw ? qw[i] : implicit_weight(1, x[i]);
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i)
                L[i] = (int8_t)(nmax + clamp_int(moe_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's symmetric fit without explicit weights: start at -nmax/max, then up to 5 sweeps that
 * move single values to the level that most improves the x^2-weighted fit. L gets l + nmax.
 * ggml's make_q3_quants with do_rmse. */
static float fit_symmetric_sweep(int n, int nmax, const float *x, int8_t *L) {
    float max, sumlx, suml2;
    if (!symmetric_start(n, nmax, x, NULL, 0, L, &max, &sumlx, &suml2)) return 0.f;
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = clamp_int(moe_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l, sumlx = slx, suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Affine fit of n values to [0, nmax] with weights: x ~ scale * L - the_min. Starts from the
 * min/max fit, then tries nstep + 1 scales (rmin + rdelta*is + nmax)/(max - min) and keeps the
 * weighted least-squares (scale, min) with the lowest weighted error (absolute error if
 * use_mad, else squared). weights NULL means x^2. ggml's make_qkx2_quants when `guarded` is
 * false and make_qkx3_quants when true (which also clamps the scan's levels before rounding and
 * treats max <= min as flat). */
static float fit_affine(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                        float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                        bool use_mad, bool guarded) {
    float min = x[0], max = x[0];
    float sum_w = weights ? weights[0] : x[0] * x[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights ? weights[i] : x[i] * x[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (guarded ? max <= min : max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = moe_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)clamp_int(l, 0, nmax);
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        float w = weights ? weights[i] : x[i] * x[i];
        best_error += w * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l;
            if (guarded) {
                const float v = iscale * (x[i] - min);
                l = v > 0 ? moe_nearest_int(v < nmax ? v : (float)nmax) : 0;
            } else {
                l = clamp_int(moe_nearest_int(iscale * (x[i] - min)), 0, nmax);
            }
            Laux[i] = (uint8_t)l;
            float w = weights ? weights[i] : x[i] * x[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                float w = weights ? weights[i] : x[i] * x[i];
                cur_error += w * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Fit of n non-negative values (sub-block scales or mins) to [0, nmax] with weights: the best of
 * 9 starting scales, then up to 5 sweeps of single-level moves. ggml's make_qp_quants. */
float moe_fit_positive(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0;
    for (int i = 0; i < n; ++i) max = x[i] > max ? x[i] : max;
    if (max < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; ++i) L[i] = (uint8_t)moe_nearest_int(iscale * x[i]);
    float scale = 1 / iscale;
    float best_mse = 0;
    for (int i = 0; i < n; ++i) {
        float diff = x[i] - scale * L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        float iscale_is = (0.1f * is + nmax) / max;
        float scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; ++i) {
            int l = moe_nearest_int(iscale_is * x[i]);
            l = l < nmax ? l : nmax;
            float diff = x[i] - scale_is * l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) best_mse = mse, iscale = iscale_is;
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = moe_nearest_int(iscale * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float slx = sumlx - w[i] * x[i] * L[i];
            float sl2 = suml2 - w[i] * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                int new_l = moe_nearest_int(x[i] * sl2 / slx);
                new_l = new_l < nmax ? new_l : nmax;
                if (new_l != L[i]) {
                    slx += w[i] * x[i] * new_l;
                    sl2 += w[i] * new_l * new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l, sumlx = slx, suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

float moe_sum_sq(const float *x, int64_t n) {
    float s = 0;
    for (int64_t j = 0; j < n; ++j) s += x[j] * x[j];
    return s;
}

/* The importance-weighted weights ggml uses everywhere: qw[j] * sqrt(sigma2 + x[j]^2). */
static void importance_weights(const float *qw, const float *x, int n, float sigma2, float *w) {
    for (int j = 0; j < n; ++j) w[j] = qw[j] * sqrtf(sigma2 + x[j] * x[j]);
}

/* ==== 32-value types with an importance matrix ==== */

/* Q4_0 / Q5_0 nibble and fifth-bit packing from codes 0..2^bits-1. */
static void pack_q_0(const int8_t L[32], uint8_t qs[16], uint8_t qh[4]) {
    uint32_t h = 0;
    for (int j = 0; j < 16; ++j) {
        const uint8_t a = (uint8_t)L[j], b = (uint8_t)L[j + 16];
        qs[j] = (uint8_t)((a & 0x0F) | ((b & 0x0F) << 4));
        h |= (uint32_t)((a & 0x10u) >> 4) << j;
        h |= (uint32_t)((b & 0x10u) >> 4) << (j + 16);
    }
    if (qh) memcpy(qh, &h, 4);
}

/* One row of Q4_0 (bits 4) or Q5_0 (bits 5) with importance weights. */
static void quantize_q_0_weighted(const float *x, void *blocks, int64_t n, const float *qw,
                                  int bits) {
    const float sigma2 = moe_sum_sq(x, n) / n;
    float weight[32];
    int8_t L[32];
    for (int64_t ib = 0; ib < n / 32; ++ib) {
        const float *xb = x + 32 * ib;
        importance_weights(qw + 32 * ib, xb, 32, sigma2, weight);
        const float d = moe_fit_symmetric(32, 1 << (bits - 1), xb, L, weight);
        if (bits == 4) {
            moe_block_q4_0 *y = (moe_block_q4_0 *)blocks + ib;
            y->d = moe_f32_to_fp16(d);
            pack_q_0(L, y->qs, NULL);
        } else {
            moe_block_q5_0 *y = (moe_block_q5_0 *)blocks + ib;
            y->d = moe_f32_to_fp16(d);
            pack_q_0(L, y->qs, y->qh);
        }
    }
}

/* One row of Q4_1 (bits 4) or Q5_1 (bits 5) with importance weights. */
static void quantize_q_1_weighted(const float *x, void *blocks, int64_t n, const float *qw,
                                  int bits) {
    const float sigma2 = moe_sum_sq(x, n) / n;
    float weight[32], min;
    uint8_t L[32], Laux[32];
    for (int64_t ib = 0; ib < n / 32; ++ib) {
        const float *xb = x + 32 * ib;
        importance_weights(qw + 32 * ib, xb, 32, sigma2, weight);
        const float d = fit_affine(32, (1 << bits) - 1, xb, weight, L, &min, Laux, -0.9f, 0.05f, 36,
                                   false, true);
        if (bits == 4) {
            moe_block_q4_1 *y = (moe_block_q4_1 *)blocks + ib;
            y->d = moe_f32_to_fp16(d), y->m = moe_f32_to_fp16(-min);
            pack_q_0((const int8_t *)L, y->qs, NULL);
        } else {
            moe_block_q5_1 *y = (moe_block_q5_1 *)blocks + ib;
            y->d = moe_f32_to_fp16(d), y->m = moe_f32_to_fp16(-min);
            pack_q_0((const int8_t *)L, y->qs, y->qh);
        }
    }
}

void moe_quantize_q4_0(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q_0_weighted(x, y, n, qw, 4) : moe_ref_q4_0_from_float(x, y, n);
}
void moe_quantize_q5_0(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q_0_weighted(x, y, n, qw, 5) : moe_ref_q5_0_from_float(x, y, n);
}
void moe_quantize_q4_1(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q_1_weighted(x, y, n, qw, 4) : moe_ref_q4_1_from_float(x, y, n);
}
void moe_quantize_q5_1(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q_1_weighted(x, y, n, qw, 5) : moe_ref_q5_1_from_float(x, y, n);
}

/* ==== MXFP4 (ggml's quantize_row_mxfp4_ref; ggml ignores an importance matrix) ==== */

static int nearest_mxfp4(float x, float e) {
    int best = 0;
    float best_err = fabsf(moe_kvalues_mxfp4[0] * e - x);
    for (int i = 1; i < 16; i++) {
        float err = fabsf(moe_kvalues_mxfp4[i] * e - x);
        if (err < best_err) best = i, best_err = err;
    }
    return best;
}

MOE_REF_FROM_FLOAT(mxfp4) {
    moe_block_mxfp4 *y = blocks;
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(in[j])) amax = fabsf(in[j]);
        /* the shared exponent puts amax in the top binade the e2m1 codes reach (4..6 x 2^e) */
        const int ie = amax > 0.0f ? (int)(floorf(log2f(amax)) - 2 + 127) : 0;
        const uint8_t e = (uint8_t)clamp_int(ie, 0, 255);
        const float d = moe_e8m0_to_f32_half(e);
        y[i].e = e;
        for (int j = 0; j < 16; ++j)
            y[i].qs[j] = (uint8_t)(nearest_mxfp4(in[j], d) | nearest_mxfp4(in[j + 16], d) << 4);
    }
}

/* ==== Q2_K ==== */

static void pack_q2_k_qs(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < MOE_QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* Codes 0..3 of every 16-value group against the block's rounded scales and mins. */
static void requantize_q2_k(const float *x, const moe_block_q2_k *y, uint8_t *L) {
    const float dall = moe_fp16_to_f32(y->d), mall = moe_fp16_to_f32(y->dmin);
    for (int j = 0; j < 16; ++j) {
        const float d = dall * (y->scales[j] & 0xF);
        if (!d) continue;
        const float dm = mall * (y->scales[j] >> 4);
        for (int ii = 0; ii < 16; ++ii)
            L[16 * j + ii] = (uint8_t)clamp_int(moe_nearest_int((x[16 * j + ii] + dm) / d), 0, 3);
    }
}

MOE_REF_FROM_FLOAT(q2_k) {
    moe_block_q2_k *y = blocks;
    uint8_t L[MOE_QK_K], Laux[16];
    float weights[16], mins[16], scales[16];
    const float q4scale = 15.f;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, in += MOE_QK_K) {
        const float *x = in;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; ++j) {
            for (int l = 0; l < 16; ++l) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = fit_affine(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f,
                                   0.1f, 15, true, false);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            float iscale = q4scale / max_scale;
            for (int j = 0; j < 16; ++j)
                y[i].scales[j] = (uint8_t)moe_nearest_int(iscale * scales[j]);
            y[i].d = moe_f32_to_fp16(max_scale / q4scale);
        } else {
            memset(y[i].scales, 0, 16);
            y[i].d = moe_f32_to_fp16(0.f);
        }
        if (max_min > 0) {
            float iscale = q4scale / max_min;
            for (int j = 0; j < 16; ++j)
                y[i].scales[j] |= (uint8_t)(moe_nearest_int(iscale * mins[j]) << 4);
            y[i].dmin = moe_f32_to_fp16(max_min / q4scale);
        } else {
            y[i].dmin = moe_f32_to_fp16(0.f);
        }
        requantize_q2_k(x, &y[i], L);
        pack_q2_k_qs(L, y[i].qs);
    }
}

static void quantize_q2_k_weighted(const float *x, moe_block_q2_k *y, int64_t n, const float *qw) {
    uint8_t L[MOE_QK_K], Laux[16], Ls[16], Lm[16];
    float mins[16], scales[16], sw[16], weight[16];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        const float sigma2 = moe_sum_sq(x, MOE_QK_K) / MOE_QK_K;
        for (int j = 0; j < 16; ++j) {
            importance_weights(qw + MOE_QK_K * i + 16 * j, x + 16 * j, 16, sigma2, weight);
            sw[j] = 0;
            for (int l = 0; l < 16; ++l) sw[j] += weight[l];
            scales[j] = fit_affine(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], Laux, -0.9f,
                                   0.05f, 36, false, true);
        }
        const float dm = moe_fit_positive(16, 15, scales, Ls, sw);
        const float mm = moe_fit_positive(16, 15, mins, Lm, sw);
        y[i].d = moe_f32_to_fp16(dm);
        y[i].dmin = moe_f32_to_fp16(mm);
        for (int j = 0; j < 16; ++j) y[i].scales[j] = (uint8_t)(Ls[j] | (Lm[j] << 4));
        requantize_q2_k(x, &y[i], L);
        pack_q2_k_qs(L, y[i].qs);
    }
}

void moe_quantize_q2_k(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q2_k_weighted(x, y, n, qw) : moe_ref_q2_k_from_float(x, y, n);
}

/* ==== Q3_K ==== */

/* Store 16 six-bit scales (already + 32) into Q3_K's 12 bytes. */
static void pack_q3_k_scales(const int *ls, uint8_t scales[12]) {
    memset(scales, 0, 12);
    for (int j = 0; j < 16; ++j) {
        int l = ls[j];
        if (j < 8)
            scales[j] = (uint8_t)(l & 0xF);
        else
            scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
        l >>= 4;
        scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
    }
}

/* Codes against the rounded scales, then the high-bit mask and the 2-bit planes. */
static void finish_q3_k(const float *x, moe_block_q3_k *y, int8_t *L) {
    for (int j = 0; j < 16; ++j) {
        int sc = j < 8 ? y->scales[j] & 0xF : y->scales[j - 8] >> 4;
        sc = (int8_t)(sc | (((y->scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        const float d = moe_fp16_to_f32(y->d) * sc;
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii)
            L[16 * j + ii] = (int8_t)(clamp_int(moe_nearest_int(x[16 * j + ii] / d), -4, 3) + 4);
    }
    /* the high bit of value j goes to bit j / 32 of hmask[j % 32] */
    memset(y->hmask, 0, 32);
    for (int j = 0; j < MOE_QK_K; ++j)
        if (L[j] > 3) {
            y->hmask[j % 32] |= (uint8_t)(1 << (j / 32));
            L[j] = (int8_t)(L[j] - 4);
        }
    pack_q2_k_qs((const uint8_t *)L, y->qs);
}

MOE_REF_FROM_FLOAT(q3_k) {
    moe_block_q3_k *y = blocks;
    int8_t L[MOE_QK_K];
    float scales[16];
    int ls[16];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, in += MOE_QK_K) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; ++j) {
            scales[j] = fit_symmetric_sweep(16, 4, in + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) amax = fabsf(scales[j]), max_scale = scales[j];
        }
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; ++j) {
                /* ggml stores the rounded value in an int8_t before clamping */
                int8_t l = (int8_t)moe_nearest_int(iscale * scales[j]);
                ls[j] = clamp_int(l, -32, 31) + 32;
            }
            pack_q3_k_scales(ls, y[i].scales);
            y[i].d = moe_f32_to_fp16(1 / iscale);
        } else {
            memset(y[i].scales, 0, 12);
            y[i].d = moe_f32_to_fp16(0.f);
        }
        finish_q3_k(in, &y[i], L);
    }
}

static void quantize_q3_k_weighted(const float *x, moe_block_q3_k *y, int64_t n, const float *qw) {
    int8_t L[MOE_QK_K], Ls[16];
    float scales[16], weight[16], sw[16];
    int ls[16];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        const float sigma2 = 2 * moe_sum_sq(x, MOE_QK_K) / MOE_QK_K;
        for (int j = 0; j < 16; ++j) {
            importance_weights(qw + MOE_QK_K * i + 16 * j, x + 16 * j, 16, sigma2, weight);
            float sumw = 0;
            for (int l = 0; l < 16; ++l) sumw += weight[l];
            sw[j] = sumw;
            scales[j] = moe_fit_symmetric(16, 4, x + 16 * j, L + 16 * j, weight);
        }
        const float d_block = moe_fit_symmetric(16, 32, scales, Ls, sw);
        for (int j = 0; j < 16; ++j) ls[j] = Ls[j];
        pack_q3_k_scales(ls, y[i].scales);
        y[i].d = moe_f32_to_fp16(d_block);
        finish_q3_k(x, &y[i], L);
    }
}

void moe_quantize_q3_k(const float *x, void *y, int64_t n, const float *qw) {
    qw ? quantize_q3_k_weighted(x, y, n, qw) : moe_ref_q3_k_from_float(x, y, n);
}

/* ==== Q4_K and Q5_K (8 sub-blocks of 32, 6-bit scales and mins) ==== */

static void pack_k4_scales(const uint8_t *ls, const uint8_t *lm, uint8_t scales[12]) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
            scales[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            scales[j - 0] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}

/* Codes 0..nmax of every 32-value group against the block's rounded scales and mins. */
static void requantize_k4(const float *x, const uint8_t scales[12], uint16_t d16, uint16_t dmin16,
                          int nmax, uint8_t *L) {
    for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        moe_k4_scale_min(j, scales, &sc, &m);
        const float d = moe_fp16_to_f32(d16) * sc;
        if (!d) continue;
        const float dm = moe_fp16_to_f32(dmin16) * m;
        for (int ii = 0; ii < 32; ++ii)
            L[32 * j + ii] =
                (uint8_t)clamp_int(moe_nearest_int((x[32 * j + ii] + dm) / d), 0, nmax);
    }
}

/* Scales and mins of a Q4_K / Q5_K block without an importance matrix: per 32 values an affine
 * fit weighted by rms + |x|, then 6-bit levels relative to the largest. */
static void k4_scales_ref(const float *x, int nmax, float rmin, int nstep, uint8_t *L,
                          uint8_t scales12[12], uint16_t *d, uint16_t *dmin) {
    uint8_t Laux[32], ls[8], lm[8];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = fit_affine(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin,
                               0.1f, nstep, false, false);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; ++j) {
        uint8_t a = (uint8_t)moe_nearest_int(inv_scale * scales[j]);
        uint8_t b = (uint8_t)moe_nearest_int(inv_min * mins[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    pack_k4_scales(ls, lm, scales12);
    *d = moe_f32_to_fp16(max_scale / 63.f);
    *dmin = moe_f32_to_fp16(max_min / 63.f);
}

/* The same with an importance matrix (or ggml's default weights when qw is NULL): fitted
 * scales and mins, then both sets fitted to 6 bits by weighted least squares. */
static void k4_scales_weighted(const float *x, const float *qw, int nmax, uint8_t *L,
                               uint8_t scales12[12], uint16_t *d, uint16_t *dmin) {
    uint8_t Laux[32], Ls[8], Lm[8];
    float weights[32], sw[8], mins[8], scales[8];
    const float sigma2 = 2 * moe_sum_sq(x, MOE_QK_K) / MOE_QK_K;
    const float av_x = sqrtf(sigma2);
    for (int j = 0; j < 8; ++j) {
        if (qw)
            importance_weights(qw + 32 * j, x + 32 * j, 32, sigma2, weights);
        else
            for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        float sumw = 0;
        for (int l = 0; l < 32; ++l) sumw += weights[l];
        sw[j] = sumw;
        scales[j] = fit_affine(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -0.9f,
                               0.05f, 36, false, true);
    }
    const float d_block = moe_fit_positive(8, 63, scales, Ls, sw);
    const float m_block = moe_fit_positive(8, 63, mins, Lm, sw);
    for (int j = 0; j < 8; ++j) {
        Ls[j] = Ls[j] < 63 ? Ls[j] : 63;
        Lm[j] = Lm[j] < 63 ? Lm[j] : 63;
    }
    memset(scales12, 0, 12);
    pack_k4_scales(Ls, Lm, scales12);
    *d = moe_f32_to_fp16(d_block);
    *dmin = moe_f32_to_fp16(m_block);
}

static void pack_q4_k(const uint8_t *L, moe_block_q4_k *y) {
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++)
            y->qs[32 * p + l] = (uint8_t)(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
}

static void pack_q5_k(const uint8_t *L, moe_block_q5_k *y) {
    memset(y->qh, 0, 32);
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 32; ++j) {
            int l1 = L[64 * p + j], l2 = L[64 * p + j + 32];
            if (l1 > 15) l1 -= 16, y->qh[j] |= (uint8_t)(1 << (2 * p));
            if (l2 > 15) l2 -= 16, y->qh[j] |= (uint8_t)(2 << (2 * p));
            y->qs[32 * p + j] = (uint8_t)(l1 | (l2 << 4));
        }
}

/* One row of Q4_K (q5 false: 4-bit codes) or Q5_K: without an importance vector ggml's
 * reference fit, with one its weighted fit; then codes against the rounded scales. */
static void quantize_k4_row(const float *x, void *blocks, int64_t n, const float *qw, bool q5) {
    const int nmax = q5 ? 31 : 15;
    uint8_t L[MOE_QK_K];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        moe_block_q4_k *b4 = (moe_block_q4_k *)blocks + i;
        moe_block_q5_k *b5 = (moe_block_q5_k *)blocks + i;
        uint8_t *scales = q5 ? b5->scales : b4->scales;
        uint16_t d, dmin;
        memset(scales, 0, 12);
        if (qw)
            k4_scales_weighted(x, qw + MOE_QK_K * i, nmax, L, scales, &d, &dmin);
        else
            k4_scales_ref(x, nmax, q5 ? -0.5f : -1.f, q5 ? 15 : 20, L, scales, &d, &dmin);
        requantize_k4(x, scales, d, dmin, nmax, L);
        if (q5) {
            b5->d = d, b5->dmin = dmin;
            pack_q5_k(L, b5);
        } else {
            b4->d = d, b4->dmin = dmin;
            pack_q4_k(L, b4);
        }
    }
}

MOE_REF_FROM_FLOAT(q4_k) {
    quantize_k4_row(in, blocks, n, NULL, false);
}

MOE_REF_FROM_FLOAT(q5_k) {
    quantize_k4_row(in, blocks, n, NULL, true);
}

void moe_quantize_q4_k(const float *x, void *blocks, int64_t n, const float *qw) {
    quantize_k4_row(x, blocks, n, qw, false);
}

void moe_quantize_q5_k(const float *x, void *blocks, int64_t n, const float *qw) {
    quantize_k4_row(x, blocks, n, qw, true);
}

/* ==== Q6_K ==== */

static void quantize_q6_k_row(const float *x, moe_block_q6_k *y, int64_t n, const float *qw) {
    int8_t L[MOE_QK_K];
    float scales[16];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        float max_scale = 0, max_abs_scale = 0;
        for (int s = 0; s < 16; s++) {
            scales[s] = moe_fit_symmetric(16, 32, x + 16 * s, L + 16 * s,
                                          qw ? qw + MOE_QK_K * i + 16 * s : NULL);
            float abs_scale = fabsf(scales[s]);
            if (abs_scale > max_abs_scale) max_abs_scale = abs_scale, max_scale = scales[s];
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -128.f / max_scale;
        y[i].d = moe_f32_to_fp16(1 / iscale);
        for (int s = 0; s < 16; s++) {
            int v = moe_nearest_int(iscale * scales[s]);
            y[i].scales[s] = (int8_t)(v < 127 ? v : 127);
        }
        /* requantize against the rounded scales, values stored with +32 bias */
        for (int s = 0; s < 16; s++) {
            const float d = moe_fp16_to_f32(y[i].d) * y[i].scales[s];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * s + ii] =
                    (int8_t)(clamp_int(moe_nearest_int(x[16 * s + ii] / d), -32, 31) + 32);
        }
        for (int h = 0; h < 2; h++) {
            uint8_t *ql = y[i].ql + 64 * h, *qh = y[i].qh + 32 * h;
            const int8_t *Lh = L + 128 * h;
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((Lh[l] & 0xF) | (Lh[l + 64] & 0xF) << 4);
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | (Lh[l + 96] & 0xF) << 4);
                qh[l] = (uint8_t)((Lh[l] >> 4) | (Lh[l + 32] >> 4) << 2 | (Lh[l + 64] >> 4) << 4 |
                                  (Lh[l + 96] >> 4) << 6);
            }
        }
    }
}

MOE_REF_FROM_FLOAT(q6_k) {
    quantize_q6_k_row(in, blocks, n, NULL);
}

void moe_quantize_q6_k(const float *x, void *y, int64_t n, const float *qw) {
    quantize_q6_k_row(x, y, n, qw);
}
