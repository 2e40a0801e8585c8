/* grid.c: recovering the 4-bit grid of a quantization-aware-trained (QAT) weight group, and the
 * two containers that store it: GGUF Q4_0 blocks and compressed-tensors W4A16 (pack-quantized).
 *
 * A QAT checkpoint stores each group of 32 weights as source-precision values (bf16) of
 * step x level, level in -8..7. Repacking it is a change of container when the step is found
 * exactly. The trap (the reason this file exists): the textbook step max|w| / 8 assumes the
 * group's peak sits at level +-8; a group whose peak sits at level 5 then gets 5/8 of its step
 * and every weight is re-rounded onto a grid that does not hold it. So the step is recovered:
 * for m = 1..8 try max|w| / m, keep the first m whose levels reproduce the whole group, refine
 * the step by least squares over the levels, and accept a stored scale (rounded to the
 * container's f16 / bf16) only if every level, re-derived on that stored grid, multiplied back
 * and rounded to the source dtype gives the source value exactly. A group nothing reproduces is
 * off the grid: the caller keeps its tensor at source precision. */
#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

/* Stored scales tried around the least-squares step: this many units in the last place either
 * side, nearest first. Values rounded to bf16 are off by up to 2^-9 relative each, and the
 * rounding of a group's largest values (which weigh most in least squares) can lean one way:
 * a real group put the least-squares step 3.5 f16 ulps from its true step. 8 f16 ulps is 2^-7
 * relative, the whole width of a bf16 rounding interval; 10 leaves a margin. */
#define GRID_ULPS 10

static float scale_decode(moe_type scale_type, uint16_t bits) {
    return scale_type == MOE_TYPE_F16 ? moe_fp16_to_f32(bits) : moe_bf16_to_f32(bits);
}
static uint16_t scale_encode(moe_type scale_type, float v) {
    return scale_type == MOE_TYPE_F16 ? moe_f32_to_fp16(v) : moe_f32_to_bf16(v);
}

/* v rounded to the source dtype, as a float. */
static float round_src(moe_type src, float v) {
    if (src == MOE_TYPE_BF16) return moe_bf16_to_f32(moe_f32_to_bf16(v));
    if (src == MOE_TYPE_F16) return moe_fp16_to_f32(moe_f32_to_fp16(v));
    return v;
}

/* The level of x = value / step: round half away from zero, and false unless it is in -8..7
 * (NaN fails too). Inline arithmetic, not roundf: this is the inner loop of a repack. */
static inline bool level_of(float x, int8_t *q) {
    if (!(x > -8.5f && x < 7.5f)) return false;
    *q = (int8_t)(int)(x < 0 ? x - 0.5f : x + 0.5f);
    return true;
}

/* Levels of w on the grid of step d; false when one falls outside -8..7. */
static bool levels_on(const float *w, int n, float d, int8_t *q) {
    for (int i = 0; i < n; i++)
        if (!level_of(w[i] / d, &q[i])) return false;
    return true;
}

int moe_grid_check(const float *w, int n, moe_type scale_type, moe_type src, uint16_t scale,
                   const int8_t *levels) {
    float d = scale_decode(scale_type, scale);
    for (int i = 0; i < n; i++) {
        if (d == 0.0f || !isfinite(d)) {
            if (w[i] != 0.0f) return i; /* a zero scale holds only zeros */
            continue;
        }
        int8_t l;
        if (!level_of(w[i] / d, &l) || levels[i] != l ||
            round_src(src, d * (float)levels[i]) != w[i])
            return i;
    }
    return -1;
}

/* True when the stored scale `bits` reproduces every value; fills q with the levels. */
static bool reproduces(const float *w, int n, moe_type scale_type, moe_type src, uint16_t bits,
                       int8_t *q) {
    float d = scale_decode(scale_type, bits);
    if (!(d != 0.0f) || !isfinite(d) || !levels_on(w, n, d, q)) return false;
    return moe_grid_check(w, n, scale_type, src, bits, q) < 0;
}

int moe_grid_recover(const float *w, int n, moe_type scale_type, moe_type src, uint16_t *scale,
                     int8_t *levels) {
    MOE_CHECK(n > 0 && n <= MOE_GRID_GROUP);
    MOE_CHECK(scale_type == MOE_TYPE_F16 || scale_type == MOE_TYPE_BF16);
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        if (!isfinite(w[i])) return -1;
        if (fabsf(w[i]) > amax) amax = fabsf(w[i]);
    }
    if (amax == 0.0f) { /* every grid holds an all-zero group */
        *scale = 0;
        memset(levels, 0, (size_t)n);
        return 0;
    }
    int8_t q[MOE_GRID_GROUP], near[MOE_GRID_GROUP];
    for (int m = 1; m <= 8; m++) {
        /* On the right grid every w / (max|w| / m) is within 8 x 2^-7 (two bf16 roundings of a
         * level <= 8) of an integer; a wrong m misses by far more on some value, found in the
         * first few: the cheap test that spares the search below for most m. */
        float inv = (float)m / amax;
        bool ok = true;
        for (int i = 0; i < n && ok; i++) {
            float x = w[i] * inv; /* |x| <= m <= 8: the conversion cannot overflow */
            near[i] = (int8_t)(int)(x < 0 ? x - 0.5f : x + 0.5f);
            ok = fabsf(x - (float)near[i]) <= 0.1f;
        }
        if (!ok) continue;
        for (int sign = 1; sign >= -1; sign -= 2) {
            bool in_range = true;
            for (int i = 0; i < n && in_range; i++) {
                int l = sign * near[i];
                in_range = l >= -8 && l <= 7;
                q[i] = (int8_t)l;
            }
            if (!in_range) continue;
            double num = 0, den = 0;
            for (int i = 0; i < n; i++) {
                num += (double)w[i] * q[i];
                den += (double)q[i] * q[i];
            }
            if (den == 0) continue;
            /* On the true grid every |w - step x level| is within 2^-8 of the value and the
             * least-squares step within 2^-8 of the step, so a residual past 2^-6 means this m
             * is wrong: skip the stored-scale search (most groups try several m first). */
            double d = num / den, tol = 0x1p-6 * fabs(d);
            bool near = true;
            for (int i = 0; i < n && near; i++)
                near = fabs(w[i] - d * q[i]) <= tol * (abs(q[i]) + 1);
            if (!near) continue;
            uint16_t ls = scale_encode(scale_type, (float)d);
            /* the least-squares step first, then its neighbours, nearest first */
            for (int k = 0; k <= 2 * GRID_ULPS; k++) {
                int off = (k + 1) / 2 * (k % 2 ? 1 : -1);
                uint16_t bits = (uint16_t)(ls + off);
                if ((bits ^ ls) & 0x8000) continue; /* stepped across the sign */
                if (reproduces(w, n, scale_type, src, bits, levels)) {
                    *scale = bits;
                    return m;
                }
            }
        }
    }
    return -1;
}

/* ==== Q4_0 ==== */

void moe_grid_q4_0_block(uint16_t scale, const int8_t *levels, void *out) {
    moe_block_q4_0 *b = out;
    b->d = scale;
    for (int j = 0; j < 16; j++) b->qs[j] = (uint8_t)((levels[j] + 8) | (levels[j + 16] + 8) << 4);
}

void moe_grid_q4_0_levels(const void *block, uint16_t *scale, int8_t *levels) {
    const moe_block_q4_0 *b = block;
    *scale = b->d;
    for (int j = 0; j < 16; j++) {
        levels[j] = (int8_t)((b->qs[j] & 15) - 8);
        levels[j + 16] = (int8_t)((b->qs[j] >> 4) - 8);
    }
}

/* ==== compressed-tensors pack-quantized (int4 in int32) ====
 *
 * compressed-tensors' pack_to_int32 (symmetric, num_bits 4): a level l is stored unsigned as
 * l + 8; value k of a row goes into int32 word k / 8 at bits 4 * (k % 8) -- the first value in
 * the lowest nibble. The words are little-endian in the file (torch int32). */

void moe_grid_pack_int4(const int8_t *levels, int64_t n, uint8_t *out) {
    for (int64_t w = 0; w < (n + 7) / 8; w++) {
        uint32_t word = 0;
        for (int k = 0; k < 8 && w * 8 + k < n; k++)
            word |= (uint32_t)(levels[w * 8 + k] + 8) << (4 * k);
        for (int b = 0; b < 4; b++) out[4 * w + b] = (uint8_t)(word >> (8 * b));
    }
}

void moe_grid_unpack_int4(const uint8_t *packed, int64_t n, int8_t *levels) {
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *p = packed + 4 * (k / 8);
        uint32_t word =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        levels[k] = (int8_t)((word >> (4 * (k % 8))) & 15) - 8;
    }
}
