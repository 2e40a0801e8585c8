/* ref_k.c: scalar reference for the K quants (Q2_K Q3_K Q4_K Q5_K Q6_K): the super-block mold
 * every K and IQ type decodes through (blocks.h), one decoder per K type, and ggml's reference
 * quantizers for Q4_K and Q6_K (no importance matrix).
 *
 * A decoder only moves bits: it turns a block into integers q, integer sub-block scales/mins
 * and float super-block scales; moe_kq_to_float and moe_kq_dot do the arithmetic, once, for all
 * 256-value types. The trap: the float operation order in moe_kq_to_float is ggml's
 * ((d * scale) * q - dmin * min); reordering it (or letting the compiler contract it into an
 * FMA) breaks bit-exactness with ggml's to_float. */
#include "blocks.h"

#include <math.h>
#include <string.h>

/* ==== The mold: to_float and dot for every 256-value type ==== */

void moe_kq_to_float(const void *blocks, size_t block_bytes, moe_kq_unpack_fn unpack, float *out,
                     int64_t n) {
    const uint8_t *p = blocks;
    moe_kq_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, p += block_bytes, out += MOE_QK_K) {
        unpack(p, &u);
        for (int s = 0; s < MOE_QK_K / u.sub_values; s++) {
            const float dl = u.d * (float)u.scale[s] * u.mult;
            const int8_t *q = u.q + s * u.sub_values;
            float *y = out + s * u.sub_values;
            if (u.has_min) {
                const float ml = u.dmin * (float)u.min[s];
                for (int j = 0; j < u.sub_values; j++) y[j] = dl * (float)q[j] - ml;
            } else {
                for (int j = 0; j < u.sub_values; j++) y[j] = dl * (float)q[j];
            }
        }
    }
}

float moe_kq_dot(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack, const void *x_q8_k,
                 int64_t n) {
    const uint8_t *p = w;
    const moe_block_q8_k *x = x_q8_k;
    double sum = 0;
    moe_kq_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, p += block_bytes) {
        unpack(p, &u);
        const int groups = u.sub_values / 16; /* Q8_K bsums cover 16 values each */
        int64_t isum = 0, msum = 0;
        for (int s = 0; s < MOE_QK_K / u.sub_values; s++) {
            const int8_t *q = u.q + s * u.sub_values, *q8 = x[i].qs + s * u.sub_values;
            int32_t sumi = 0;
            for (int j = 0; j < u.sub_values; j++) sumi += (int32_t)q[j] * q8[j];
            isum += (int64_t)u.scale[s] * sumi;
            if (u.has_min) {
                int32_t bsum = 0;
                for (int g = 0; g < groups; g++) bsum += x[i].bsums[s * groups + g];
                msum += (int64_t)u.min[s] * bsum;
            }
        }
        /* float scale products as ggml forms them; mult is a power of two; the rest is exact */
        sum += (double)(u.d * x[i].d) * u.mult * (double)isum;
        if (u.has_min) sum -= (double)(u.dmin * x[i].d) * (double)msum;
    }
    return (float)sum;
}

/* ==== Decoders ==== */

static void unpack_q2_k(const void *block, moe_kq_unpacked *u) {
    const moe_block_q2_k *b = block;
    /* value 128h + 32k + l sits in bits 2k..2k+1 of qs[32h + l] */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++)
                u->q[128 * h + 32 * k + l] = (int8_t)((b->qs[32 * h + l] >> (2 * k)) & 3);
    for (int s = 0; s < 16; s++) {
        u->scale[s] = b->scales[s] & 0xF;
        u->min[s] = b->scales[s] >> 4;
    }
    u->sub_values = 16, u->has_min = true, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = moe_fp16_to_f32(b->dmin);
}

static void unpack_q3_k(const void *block, moe_kq_unpacked *u) {
    const moe_block_q3_k *b = block;
    /* low 2 bits as Q2_K; the third bit of value 128h + 32k + l is bit 4h + k of hmask[l], and a
     * clear bit means -4 */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int lo = (b->qs[32 * h + l] >> (2 * k)) & 3;
                int hi = (b->hmask[l] >> (4 * h + k)) & 1;
                u->q[128 * h + 32 * k + l] = (int8_t)(lo - (hi ? 0 : 4));
            }
    /* 16 six-bit scales in 12 bytes: low nibbles in bytes 0..7 (scales 0..7 low, 8..15 high
     * nibble), top 2 bits of scale s in bits 2*(s/4) of byte 8 + s%4; stored with +32 bias */
    for (int s = 0; s < 16; s++) {
        int lo = s < 8 ? b->scales[s] & 0xF : b->scales[s - 8] >> 4;
        int hi = (b->scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        u->scale[s] = (int16_t)((lo | hi << 4) - 32);
    }
    u->sub_values = 16, u->has_min = false, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

/* Scales, mins and super-block scales shared by Q4_K and Q5_K. */
static void unpack_k4_scales(const uint8_t scales[12], uint16_t d, uint16_t dmin,
                             moe_kq_unpacked *u) {
    for (int s = 0; s < 8; s++) {
        uint8_t sc, m;
        moe_k4_scale_min(s, scales, &sc, &m);
        u->scale[s] = sc, u->min[s] = m;
    }
    u->sub_values = 32, u->has_min = true, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(d), u->dmin = moe_fp16_to_f32(dmin);
}

/* Q4_K / Q5_K nibbles: qs[32p + l] holds value 64p + l (low) and 64p + 32 + l (high). */
static void unpack_k4_nibbles(const uint8_t qs[128], int8_t q[256]) {
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) {
            q[64 * p + l] = (int8_t)(qs[32 * p + l] & 0xF);
            q[64 * p + 32 + l] = (int8_t)(qs[32 * p + l] >> 4);
        }
}

static void unpack_q4_k(const void *block, moe_kq_unpacked *u) {
    const moe_block_q4_k *b = block;
    unpack_k4_nibbles(b->qs, u->q);
    unpack_k4_scales(b->scales, b->d, b->dmin, u);
}

static void unpack_q5_k(const void *block, moe_kq_unpacked *u) {
    const moe_block_q5_k *b = block;
    unpack_k4_nibbles(b->qs, u->q);
    /* the fifth bit of value 32c + l (c = 0..7) is bit c of qh[l] */
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 32; l++) u->q[32 * c + l] += (int8_t)(((b->qh[l] >> c) & 1) << 4);
    unpack_k4_scales(b->scales, b->d, b->dmin, u);
}

static void unpack_q6_k(const void *block, moe_kq_unpacked *u) {
    const moe_block_q6_k *b = block;
    /* per half of 128: ql[l] / ql[l+32] hold values l, l+32 (low nibble) and l+64, l+96 (high);
     * qh[l] holds their top 2 bits at bits 0, 2, 4, 6 */
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *q = u->q + 128 * h;
        for (int l = 0; l < 32; l++) {
            q[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32);
            q[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32);
            q[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
            q[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
        }
    }
    for (int s = 0; s < 16; s++) u->scale[s] = b->scales[s];
    u->sub_values = 16, u->has_min = false, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

MOE_KQ_KERNELS(q2_k)
MOE_KQ_KERNELS(q3_k)
MOE_KQ_KERNELS(q4_k)
MOE_KQ_KERNELS(q5_k)
MOE_KQ_KERNELS(q6_k)

/* ==== Quantizers (ggml's quantize_row_q4_K_ref / quantize_row_q6_K_ref) ==== */

#define GROUP_MAX_EPS 1e-15f /* ggml: below this a group counts as all zero */

/* Affine fit of n values to [0, nmax] with weights: x ~ scale * L - the_min. Starts from the
 * min/max fit, then tries nstep + 1 scales (rmin + rdelta*is + nmax)/(max - min) and keeps the
 * weighted least-squares (scale, min) with the lowest weighted squared error.
 * ggml's make_qkx2_quants with use_mad false. */
static float fit_affine(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                        float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = moe_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        float diff = scale * L[i] + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = moe_nearest_int(iscale * (x[i] - min));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            Laux[i] = (uint8_t)l;
            float w = weights[i];
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
                cur_error += weights[i] * (diff * diff);
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

MOE_REF_FROM_FLOAT(q4_k) {
    moe_block_q4_k *y = blocks;
    uint8_t L[MOE_QK_K], Laux[32];
    float weights[32], mins[8], scales[8];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, in += MOE_QK_K) {
        const float *x = in;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
            float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
            scales[j] =
                fit_affine(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        /* 6-bit scales and mins relative to the largest, packed as moe_k4_scale_min reads them */
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        memset(y[i].scales, 0, sizeof y[i].scales);
        for (int j = 0; j < 8; j++) {
            int ls = moe_nearest_int(inv_scale * scales[j]);
            int lm = moe_nearest_int(inv_min * mins[j]);
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
            if (j < 4) {
                y[i].scales[j] = (uint8_t)ls;
                y[i].scales[j + 4] = (uint8_t)lm;
            } else {
                y[i].scales[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
                y[i].scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
                y[i].scales[j - 0] |= (uint8_t)((lm >> 4) << 6);
            }
        }
        y[i].d = moe_f32_to_fp16(max_scale / 63.f);
        y[i].dmin = moe_f32_to_fp16(max_min / 63.f);
        /* requantize against the rounded scales */
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            moe_k4_scale_min(j, y[i].scales, &sc, &m);
            const float d = moe_fp16_to_f32(y[i].d) * sc;
            if (!d) continue;
            const float dm = moe_fp16_to_f32(y[i].dmin) * m;
            for (int ii = 0; ii < 32; ii++) {
                int l = moe_nearest_int((x[32 * j + ii] + dm) / d);
                L[32 * j + ii] = (uint8_t)(l < 0 ? 0 : l > 15 ? 15 : l);
            }
        }
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++)
                y[i].qs[32 * p + l] = (uint8_t)(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
    }
}

/* Symmetric fit of n values to [-nmax, nmax-1] weighted by x^2: tries scales -(nmax + 0.1 is)/max
 * for is = -9..9 and keeps the best least-squares one. ggml's make_qx_quants, rmse_type 1. */
static float fit_symmetric(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) amax = ax, max = x[i];
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = moe_nearest_int(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = moe_nearest_int(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = moe_nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + (l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

MOE_REF_FROM_FLOAT(q6_k) {
    moe_block_q6_k *y = blocks;
    int8_t L[MOE_QK_K];
    float scales[16];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, in += MOE_QK_K) {
        const float *x = in;
        float max_scale = 0, max_abs_scale = 0;
        for (int s = 0; s < 16; s++) {
            scales[s] = fit_symmetric(16, 32, x + 16 * s, L + 16 * s);
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
            for (int ii = 0; ii < 16; ii++) {
                int l = moe_nearest_int(x[16 * s + ii] / d);
                l = l < -32 ? -32 : l > 31 ? 31 : l;
                L[16 * s + ii] = (int8_t)(l + 32);
            }
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
