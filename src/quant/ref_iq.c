/* ref_iq.c: scalar reference for the codebook ("IQ") types: decoders for IQ1_S IQ1_M IQ2_XXS
 * IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_XS into the super-block mold of blocks.h, and ggml's IQ4_NL /
 * IQ4_XS quantizer (with or without an importance vector). The IQ1 / IQ2 / IQ3 quantizers, with
 * their lattice searches, are in quantize_iq.c.
 *
 * Grids come from iq_tables.c; value k of a grid entry is bits 8k..8k+7 of the integer, so the
 * decoders do not depend on the host's byte order. The trap: ggml writes these dequantizers as
 * d * (0.5 + s) * 0.25 * grid * sign (IQ2), d * (0.5 + s) * 0.5 * ... (IQ3_XXS) and
 * d * (2s + 1) * (grid +- 1/8) (IQ1). The mold computes (d * (2s + 1) * 2^-k) * q with an
 * integer q (8 grid +- 1 for IQ1), which rounds identically: d * (2s + 1) is 2 d (0.5 + s)
 * rounded once, and every other factor is a power of two or an exact small integer, while the
 * fp16 d keeps all intermediate values far from float subnormals. */
#include "blocks.h"
#include "quantize_internal.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

/* ==== Grid and sign decoding, shared by IQ2_* and IQ3_* ==== */

/* 8 grid magnitudes (one per byte of `grid`) with the signs whose bits are set in `signs`. */
static void grid_signed(uint64_t grid, uint8_t signs, int8_t out[8]) {
    for (int j = 0; j < 8; j++) {
        int v = (int)((grid >> (8 * j)) & 0xff);
        out[j] = (int8_t)(signs & moe_kmask_iq2xs[j] ? -v : v);
    }
}

/* Two 4-value IQ3 grid entries as one 8-value grid. */
static uint64_t grid_pair(uint32_t lo, uint32_t hi) {
    return (uint64_t)lo | (uint64_t)hi << 32;
}

/* A 4-bit scale s as the odd integer 2s + 1 the IQ1/IQ2/IQ3 formats use. */
static int16_t odd_scale(unsigned s) {
    return (int16_t)(2 * s + 1);
}

/* ==== Decoders ==== */

static void unpack_iq2_xxs(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq2_xxs *b = block;
    const uint8_t *qs = (const uint8_t *)b->qs;
    /* per 32 values: 4 grid index bytes, then a uint32 of 4 x 7-bit sign indices | scale << 28 */
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *p = qs + 8 * ib;
        const uint32_t aux = moe_load_le32(p + 4);
        for (int l = 0; l < 4; l++)
            grid_signed(moe_iq2xxs_grid[p[l]], moe_ksigns_iq2xs[(aux >> (7 * l)) & 127],
                        u->q + 32 * ib + 8 * l);
        u->scale[ib] = odd_scale(aux >> 28);
    }
    u->sub_values = 32, u->has_min = false, u->mult = 0.125f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

static void unpack_iq2_xs(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq2_xs *b = block;
    /* per 8 values a uint16: 9-bit grid index | 7-bit sign index << 9 */
    for (int g = 0; g < 32; g++)
        grid_signed(moe_iq2xs_grid[b->qs[g] & 511], moe_ksigns_iq2xs[b->qs[g] >> 9], u->q + 8 * g);
    for (int ib = 0; ib < 8; ib++) {
        u->scale[2 * ib] = odd_scale(b->scales[ib] & 0xF);
        u->scale[2 * ib + 1] = odd_scale(b->scales[ib] >> 4);
    }
    u->sub_values = 16, u->has_min = false, u->mult = 0.125f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

static void unpack_iq2_s(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq2_s *b = block;
    const uint8_t *signs = b->qs + 32;
    /* grid index of group g (8 values) = qs[g] | 2 bits of qh[g/4] at bits 2*(g%4) as bits 8-9 */
    for (int g = 0; g < 32; g++) {
        int idx = b->qs[g] | ((b->qh[g / 4] << (8 - 2 * (g % 4))) & 0x300);
        grid_signed(moe_iq2s_grid[idx], signs[g], u->q + 8 * g);
    }
    for (int ib = 0; ib < 8; ib++) {
        u->scale[2 * ib] = odd_scale(b->scales[ib] & 0xF);
        u->scale[2 * ib + 1] = odd_scale(b->scales[ib] >> 4);
    }
    u->sub_values = 16, u->has_min = false, u->mult = 0.125f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

static void unpack_iq3_xxs(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq3_xxs *b = block;
    const uint8_t *grid_idx = b->qs, *scales_signs = b->qs + 64;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = moe_load_le32(scales_signs + 4 * ib);
        const uint8_t *p = grid_idx + 8 * ib;
        for (int l = 0; l < 4; l++)
            grid_signed(grid_pair(moe_iq3xxs_grid[p[2 * l]], moe_iq3xxs_grid[p[2 * l + 1]]),
                        moe_ksigns_iq2xs[(aux >> (7 * l)) & 127], u->q + 32 * ib + 8 * l);
        u->scale[ib] = odd_scale(aux >> 28);
    }
    u->sub_values = 32, u->has_min = false, u->mult = 0.25f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

static void unpack_iq3_s(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq3_s *b = block;
    /* per 32 values (ib): 8 index bytes, one qh byte holding bit 8 of each index, 4 sign bytes */
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *qs = b->qs + 8 * ib;
        const int qh = b->qh[ib];
        for (int l = 0; l < 4; l++) {
            int i1 = qs[2 * l] | ((qh << (8 - 2 * l)) & 256);
            int i2 = qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256);
            grid_signed(grid_pair(moe_iq3s_grid[i1], moe_iq3s_grid[i2]), b->signs[4 * ib + l],
                        u->q + 32 * ib + 8 * l);
        }
        u->scale[ib] = odd_scale((b->scales[ib / 2] >> (4 * (ib % 2))) & 0xF);
    }
    u->sub_values = 32, u->has_min = false, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

/* IQ1 values are grid (-1, 0, +1) + delta (+-1/8); q holds 8 * value, mult brings back 1/8. */
static void iq1_group(int idx, bool negative_delta, int8_t q[8]) {
    const uint64_t grid = moe_iq1s_grid[idx];
    for (int j = 0; j < 8; j++)
        q[j] = (int8_t)(8 * (int8_t)((grid >> (8 * j)) & 0xff) + (negative_delta ? -1 : 1));
}

static void unpack_iq1_s(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq1_s *b = block;
    /* qh[ib]: 4 x 3 index bits, bits 12..14 scale, bit 15 delta sign */
    for (int ib = 0; ib < 8; ib++) {
        const unsigned qh = b->qh[ib];
        for (int l = 0; l < 4; l++)
            iq1_group(b->qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8), qh & 0x8000,
                      u->q + 32 * ib + 8 * l);
        u->scale[ib] = odd_scale((qh >> 12) & 7);
    }
    u->sub_values = 32, u->has_min = false, u->mult = 0.125f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

static void unpack_iq1_m(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq1_m *b = block;
    uint16_t sc[4];
    for (int k = 0; k < 4; k++) sc[k] = (uint16_t)(b->scales[2 * k] | b->scales[2 * k + 1] << 8);
    /* the fp16 super-block scale is the top nibbles of the 4 scale words */
    const uint16_t d16 = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) |
                                    ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    /* per 8 values (g): index = qs[g] | 3 bits of qh[g/2] (low nibble for even g, high for
     * odd) as bits 8-10; bit 3 of that nibble is the delta sign */
    for (int g = 0; g < 32; g++) {
        const int nib = (b->qh[g / 2] >> (4 * (g % 2))) & 0xF;
        iq1_group(b->qs[g] | ((nib & 7) << 8), nib & 8, u->q + 8 * g);
    }
    /* per 16 values a 3-bit scale: 4 per scale word, 3 bits apart */
    for (int s = 0; s < 16; s++) u->scale[s] = odd_scale((sc[s / 4] >> (3 * (s % 4))) & 7);
    u->sub_values = 16, u->has_min = false, u->mult = 0.125f;
    u->d = moe_fp16_to_f32(d16), u->dmin = 0;
}

static void unpack_iq4_xs(const void *block, moe_kq_unpacked *u) {
    const moe_block_iq4_xs *b = block;
    for (int ib = 0; ib < 8; ib++) {
        moe_unpack_nibbles(b->qs + 16 * ib, moe_kvalues_iq4nl, u->q + 32 * ib);
        int ls = ((b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) |
                 (((b->scales_h >> (2 * ib)) & 3) << 4);
        u->scale[ib] = (int16_t)(ls - 32);
    }
    u->sub_values = 32, u->has_min = false, u->mult = 1.0f;
    u->d = moe_fp16_to_f32(b->d), u->dmin = 0;
}

MOE_KQ_KERNELS(iq2_xxs)
MOE_KQ_KERNELS(iq2_xs)
MOE_KQ_KERNELS(iq2_s)
MOE_KQ_KERNELS(iq3_xxs)
MOE_KQ_KERNELS(iq3_s)
MOE_KQ_KERNELS(iq1_s)
MOE_KQ_KERNELS(iq1_m)
MOE_KQ_KERNELS(iq4_xs)

/* ==== IQ4_NL / IQ4_XS quantizer (ggml's quantize_row_iq4_nl_impl, ntry 7) ==== */

#define GROUP_MAX_EPS 1e-15f

/* Index of the codebook value nearest to x (16 values sorted ascending; ties go up), as ggml's
 * best_index_int8 decides it: the bracketing pair, then x - lo < hi - x in float. The bracket is
 * found without branches (the largest i with values[i] <= x), which is the same pair ggml's
 * bisection ends on, for speed: this runs 16 times per value in the IQ4 scale search. */
static int nearest_codebook(const int8_t *values, float x) {
    if (x <= values[0]) return 0;
    if (x >= values[15]) return 15;
    int lo = 0;
    for (int step = 8; step > 0; step >>= 1) lo = x >= values[lo + step] ? lo + step : lo;
    return x - values[lo] < values[lo + 1] - x ? lo : lo + 1;
}

/* Best scale for one 32-value block: starts at d = -max/values[0], refits by weighted least
 * squares (weights: qw[j] * sqrt(sigma2 + x^2) with an importance vector, else x^2), then tries
 * 15 scales (itry + values[0])/max and keeps the best. Leaves the block's codes in L; returns the
 * scale (0 for an all-zero block, L then untouched). */
void moe_iq4_pass_ref(const float *xb, const float *weight, float id, uint8_t *L, float *sumqx,
                      float *sumq2) {
    const int8_t *values = moe_kvalues_iq4nl;
    float a = 0, b = 0;
    for (int j = 0; j < 32; j++) {
        int l = nearest_codebook(values, id * xb[j]);
        if (L) L[j] = (uint8_t)l;
        float q = values[l], w = weight[j];
        a += w * q * xb[j];
        b += w * q * q;
    }
    *sumqx = a, *sumq2 = b;
}

static moe_iq4_pass_fn iq4_pass = moe_iq4_pass_ref;
static pthread_once_t iq4_pass_once = PTHREAD_ONCE_INIT;
static void iq4_pass_choose(void) {
    if (moe_cpu_isa() >= MOE_ISA_AVX2) iq4_pass = moe_iq4_pass_avx2;
}

static float iq4_fit_block(const float *xb, const float *qw, float sigma2, uint8_t *L) {
    const int8_t *values = moe_kvalues_iq4nl;
    const int ntry = 7;
    float weight[32];
    pthread_once(&iq4_pass_once, iq4_pass_choose);
    for (int j = 0; j < 32; j++)
        weight[j] = qw ? qw[j] * sqrtf(sigma2 + xb[j] * xb[j]) : xb[j] * xb[j];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        float ax = fabsf(xb[j]);
        if (ax > amax) amax = ax, max = xb[j];
    }
    if (amax < GROUP_MAX_EPS) return 0;
    float d = -max / values[0];
    float id = 1 / d;
    float sumqx, sumq2;
    iq4_pass(xb, weight, id, L, &sumqx, &sumq2);
    d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    float best = d * sumqx;
    for (int itry = -ntry; itry <= ntry; ++itry) {
        id = (itry + values[0]) / max;
        iq4_pass(xb, weight, id, NULL, &sumqx, &sumq2);
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

static void iq4_codes(const float *xb, float scale, uint8_t L[32]) {
    const float id = scale ? 1 / scale : 0.f;
    for (int j = 0; j < 32; j++) L[j] = (uint8_t)nearest_codebook(moe_kvalues_iq4nl, id * xb[j]);
}

static void iq4_pack(const uint8_t L[32], uint8_t qs[16]) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(L[j] | L[16 + j] << 4);
}

/* sigma2 of ggml's quantize_row_iq4_nl_impl: 2/n times the sum of squares of n values */
static float iq4_sigma2(const float *x, int n) {
    float s = 0;
    for (int j = 0; j < n; ++j) s += x[j] * x[j];
    return s * (2.f / n);
}

MOE_QUANTIZE_FN(iq4_nl) {
    moe_block_iq4_nl *b = y;
    uint8_t L[32];
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        /* the fitted codes are recomputed from the fp32 scale (ggml does the same) */
        const float d = iq4_fit_block(x, qw ? qw + 32 * i : NULL, qw ? iq4_sigma2(x, 32) : 0, L);
        b[i].d = moe_f32_to_fp16(d);
        iq4_codes(x, d, L);
        iq4_pack(L, b[i].qs);
    }
}

MOE_QUANTIZE_FN(iq4_xs) {
    moe_block_iq4_xs *b = y;
    uint8_t L[32];
    float scales[8];
    for (int64_t i = 0; i < n / MOE_QK_K; i++, x += MOE_QK_K) {
        const float sigma2 = qw ? iq4_sigma2(x, MOE_QK_K) : 0;
        float max_scale = 0, amax_scale = 0;
        for (int ib = 0; ib < 8; ib++) {
            scales[ib] =
                iq4_fit_block(x + 32 * ib, qw ? qw + MOE_QK_K * i + 32 * ib : NULL, sigma2, L);
            if (fabsf(scales[ib]) > amax_scale)
                amax_scale = fabsf(scales[ib]), max_scale = scales[ib];
        }
        /* 6-bit sub-block scales ls - 32 relative to d = -max_scale/32 */
        const float d = -max_scale / 32;
        const float id = d ? 1 / d : 0.f;
        b[i].d = moe_f32_to_fp16(d);
        b[i].scales_h = 0;
        memset(b[i].scales_l, 0, sizeof b[i].scales_l);
        for (int ib = 0; ib < 8; ib++) {
            int l = moe_nearest_int(id * scales[ib]);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            iq4_codes(x + 32 * ib, d * l, L);
            iq4_pack(L, b[i].qs + 16 * ib);
            l += 32;
            b[i].scales_l[ib / 2] |= (uint8_t)((l & 0xF) << (4 * (ib % 2)));
            b[i].scales_h |= (uint16_t)((l >> 4) << (2 * ib));
        }
    }
}

MOE_REF_FROM_FLOAT(iq4_nl) {
    moe_quantize_iq4_nl(in, blocks, n, NULL);
}

MOE_REF_FROM_FLOAT(iq4_xs) {
    moe_quantize_iq4_xs(in, blocks, n, NULL);
}
