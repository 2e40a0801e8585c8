/* random.c: random valid rows of any type with a decoder -- what tests use to reach every bit
 * pattern a kernel must handle, and what benchmarks and synthetic models stream.
 *
 * Every index, sign and sub-block scale bit pattern of a block is valid (grids have exactly as
 * many entries as their index bits address), so random bytes are valid blocks once the float
 * fields are replaced: an fp16 d / dmin with random bits may be NaN or infinite. The trap:
 * IQ1_M keeps its fp16 d in the top nibbles of four scale words, and MXFP4 an e8m0 exponent;
 * both are set explicitly. */
#include "blocks.h"

#include <math.h>
#include <string.h>

/* A finite fp16 scale of either sign, 1e-4 .. 1e-1. */
static uint16_t random_scale(uint64_t *s) {
    const double v =
        pow(10.0, -4.0 + 3.0 * moe_rng_uniform(s)) * (moe_rng_uniform(s) < 0.5 ? -1 : 1);
    return moe_f32_to_fp16((float)v);
}

/* Offsets of a block's fp16 scale fields (-1: none). */
static void scale_fields(moe_type t, int off[2]) {
    off[0] = off[1] = -1;
    switch (t) {
    case MOE_TYPE_Q4_1:
    case MOE_TYPE_Q5_1:
    case MOE_TYPE_Q8_1:
        off[0] = 0, off[1] = 2;
        break;
    case MOE_TYPE_Q4_K:
    case MOE_TYPE_Q5_K:
        off[0] = offsetof(moe_block_q4_k, d), off[1] = offsetof(moe_block_q4_k, dmin);
        break;
    case MOE_TYPE_Q2_K:
        off[0] = offsetof(moe_block_q2_k, d), off[1] = offsetof(moe_block_q2_k, dmin);
        break;
    case MOE_TYPE_Q3_K:
        off[0] = offsetof(moe_block_q3_k, d);
        break;
    case MOE_TYPE_Q6_K:
        off[0] = offsetof(moe_block_q6_k, d);
        break;
    case MOE_TYPE_MXFP4:
    case MOE_TYPE_IQ1_M:
    case MOE_TYPE_Q8_K:
        break; /* set in moe_type_random_row */
    default:
        off[0] = 0; /* every other block type starts with its fp16 d */
        break;
    }
}

void moe_type_random_row(moe_type t, uint64_t *seed, void *out, int64_t n) {
    const moe_type_traits *tr = moe_type_traits_get(t);
    if (!tr || !tr->to_float || n % tr->block_values)
        moe_die("moe_type_random_row: no random rows of type %s, n = %lld", moe_type_name(t),
                (long long)n);
    uint8_t *w = out;
    if (!tr->is_quantized) {
        for (int64_t i = 0; i < n; i++) {
            const float v = (float)moe_rng_gaussian(seed);
            if (t == MOE_TYPE_F32)
                memcpy(w + 4 * i, &v, 4);
            else {
                uint16_t h = t == MOE_TYPE_F16 ? moe_f32_to_fp16(v) : moe_f32_to_bf16(v);
                memcpy(w + 2 * i, &h, 2);
            }
        }
        return;
    }
    const int64_t nb = n / tr->block_values;
    const size_t bytes = (size_t)nb * tr->block_bytes;
    for (size_t i = 0; i < bytes; i += 8) {
        const uint64_t r = moe_rng_u64(seed);
        memcpy(w + i, &r, bytes - i < 8 ? bytes - i : 8);
    }
    int off[2];
    scale_fields(t, off);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + (size_t)b * tr->block_bytes;
        for (int k = 0; k < 2; k++)
            if (off[k] >= 0) {
                const uint16_t h = random_scale(seed);
                memcpy(blk + off[k], &h, 2);
            }
        if (t == MOE_TYPE_MXFP4) blk[0] = (uint8_t)(110 + moe_rng_u64(seed) % 30);
        if (t == MOE_TYPE_IQ1_M) {
            const uint16_t h = (uint16_t)(random_scale(seed) & 0x7fff);
            moe_block_iq1_m *m = (moe_block_iq1_m *)blk;
            for (int k = 0; k < 4; k++)
                m->scales[2 * k + 1] =
                    (uint8_t)((m->scales[2 * k + 1] & 0x0f) | (((h >> (4 * k)) & 0xf) << 4));
        }
        if (t == MOE_TYPE_Q8_K) { /* a float d and consistent bsums */
            moe_block_q8_k *q = (moe_block_q8_k *)blk;
            q->d = moe_fp16_to_f32(random_scale(seed));
            for (int s = 0; s < 16; s++) {
                int sum = 0;
                for (int j = 0; j < 16; j++) sum += q->qs[16 * s + j];
                q->bsums[s] = (int16_t)sum;
            }
        }
    }
}

/* ==== Random rows at a chosen scale (synthetic models) ==== */

/* Multiply block b's float scale fields by f (MXFP4: by the nearest power of two). */
static void scale_block(moe_type t, uint8_t *blk, double f) {
    int off[2];
    scale_fields(t, off);
    for (int k = 0; k < 2; k++) {
        if (off[k] < 0) continue;
        uint16_t h;
        memcpy(&h, blk + off[k], 2);
        double v = moe_fp16_to_f32(h) * f;
        if (v > 65504.0) v = 65504.0;
        if (v < -65504.0) v = -65504.0;
        h = moe_f32_to_fp16((float)v);
        memcpy(blk + off[k], &h, 2);
    }
    if (t == MOE_TYPE_MXFP4) {
        const int e = (int)blk[0] + (int)lround(log2(f));
        blk[0] = (uint8_t)(e < 1 ? 1 : e > 254 ? 254 : e);
    }
    if (t == MOE_TYPE_IQ1_M) {
        moe_block_iq1_m *m = (moe_block_iq1_m *)blk;
        uint16_t h = 0;
        for (int k = 0; k < 4; k++) h |= (uint16_t)((m->scales[2 * k + 1] >> 4) << (4 * k));
        h = moe_f32_to_fp16((float)fmin(65504.0, moe_fp16_to_f32(h) * f));
        for (int k = 0; k < 4; k++)
            m->scales[2 * k + 1] =
                (uint8_t)((m->scales[2 * k + 1] & 0x0f) | (((h >> (4 * k)) & 0xf) << 4));
    }
}

void moe_type_random_row_rms(moe_type t, uint64_t *seed, void *out, int64_t n, float rms) {
    moe_type_random_row(t, seed, out, n);
    const moe_type_traits *tr = moe_type_traits_get(t);
    if (!tr->is_quantized) {
        for (int64_t i = 0; i < n; i++) {
            if (t == MOE_TYPE_F32) {
                float v;
                memcpy(&v, (uint8_t *)out + 4 * i, 4);
                v *= rms;
                memcpy((uint8_t *)out + 4 * i, &v, 4);
            } else {
                uint16_t h;
                memcpy(&h, (uint8_t *)out + 2 * i, 2);
                const float v = (t == MOE_TYPE_F16 ? moe_fp16_to_f32(h) : moe_bf16_to_f32(h)) * rms;
                h = t == MOE_TYPE_F16 ? moe_f32_to_fp16(v) : moe_f32_to_bf16(v);
                memcpy((uint8_t *)out + 2 * i, &h, 2);
            }
        }
        return;
    }
    float values[256];
    MOE_CHECK(tr->block_values <= 256);
    for (int64_t b = 0; b < n / tr->block_values; b++) {
        uint8_t *blk = (uint8_t *)out + (size_t)b * tr->block_bytes;
        tr->to_float(blk, values, tr->block_values);
        double sum = 0;
        for (int64_t i = 0; i < tr->block_values; i++) sum += (double)values[i] * values[i];
        const double block_rms = sqrt(sum / (double)tr->block_values);
        if (block_rms > 0 && isfinite(block_rms)) scale_block(t, blk, rms / block_rms);
    }
}
