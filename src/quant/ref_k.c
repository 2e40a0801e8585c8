/* ref_k.c: scalar reference for the K quants (Q2_K Q3_K Q4_K Q5_K Q6_K): the super-block mold
 * every K and IQ type decodes through (blocks.h) and one decoder per K type.
 *
 * A decoder only moves bits: it turns a block into integers q, integer sub-block scales/mins
 * and float super-block scales; moe_kq_to_float and moe_kq_dot do the arithmetic, once, for all
 * 256-value types. The quantizers live in quantize_k.c. The trap: the float operation order in
 * moe_kq_to_float is ggml's
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

/* One super-block's exact integer sums against a Q8_K block: *isum = sum_s scale[s] *
 * sum_{i in s} q[i] * q8[i], *msum = sum_s min[s] * bsum_s (0 without a min). */
static void kq_block_sums(const moe_kq_unpacked *u, const moe_block_q8_k *x, int64_t *isum,
                          int64_t *msum) {
    const int groups = u->sub_values / 16; /* Q8_K bsums cover 16 values each */
    *isum = *msum = 0;
    for (int s = 0; s < MOE_QK_K / u->sub_values; s++) {
        const int8_t *q = u->q + s * u->sub_values, *q8 = x->qs + s * u->sub_values;
        int32_t sumi = 0;
        for (int j = 0; j < u->sub_values; j++) sumi += (int32_t)q[j] * q8[j];
        *isum += (int64_t)u->scale[s] * sumi;
        if (u->has_min) {
            int32_t bsum = 0;
            for (int g = 0; g < groups; g++) bsum += x->bsums[s * groups + g];
            *msum += (int64_t)u->min[s] * bsum;
        }
    }
}

/* Both orders of the super-block dot: ggml's (a double sum of the block terms, as the
 * reference) or the fast path's (quant.h: one float fma per term, in order). */
static float kq_dot(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack, const void *x_q8_k,
                    int64_t n, bool fast) {
    const uint8_t *p = w;
    const moe_block_q8_k *x = x_q8_k;
    double sum = 0;
    float acc = 0.0f;
    moe_kq_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, p += block_bytes) {
        unpack(p, &u);
        int64_t isum, msum; /* both within int32 for every type, as the SIMD kernels keep them */
        kq_block_sums(&u, &x[i], &isum, &msum);
        if (fast) {
            acc = fmaf(u.d * x[i].d * u.mult, (float)(int32_t)isum, acc);
            if (u.has_min) acc = fmaf(-(u.dmin * x[i].d), (float)(int32_t)msum, acc);
            continue;
        }
        /* float scale products as ggml forms them; mult is a power of two; the rest is exact */
        sum += (double)(u.d * x[i].d) * u.mult * (double)isum;
        if (u.has_min) sum -= (double)(u.dmin * x[i].d) * (double)msum;
    }
    return fast ? acc : (float)sum;
}

float moe_kq_dot(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack, const void *x_q8_k,
                 int64_t n) {
    return kq_dot(w, block_bytes, unpack, x_q8_k, n, false);
}

float moe_kq_dot_fast(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack,
                      const void *x_q8_k, int64_t n) {
    return kq_dot(w, block_bytes, unpack, x_q8_k, n, true);
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
