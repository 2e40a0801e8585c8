/* ref.c: scalar reference kernels for the plain float types and the 32-value block types
 * (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 IQ4_NL MXFP4), the Q8_K activation type, and the float
 * reference dot. The K quants are in ref_k.c, the IQ codebook types in ref_iq.c.
 *
 * Everything here is plain C, bit-exact with ggml: to_float reproduces ggml's to_float, the
 * weight quantizers reproduce ggml's *_ref quantizers, and the activation quantizers reproduce
 * the bytes ggml-cpu feeds its dots. A dot is the integer dot per block times the float product
 * of the block scales (as ggml forms it), accumulated in double. No SIMD here: SIMD variants live
 * in their own files and are tested against these.
 *
 * The trap: ggml has two Q8_0 / Q8_1 quantizers that disagree on some bytes. The weight
 * ("_ref") one multiplies by 1/(amax/127) and rounds halves away from zero (roundf); the one
 * ggml-cpu applies to activations on x86 multiplies by 127/amax and rounds halves to even.
 * Using the wrong one moves dot parity tests by ~1e-3 relative. */
#include "blocks.h"

#include <math.h>
#include <string.h>

/* ==== Plain float types ==== */

MOE_REF_TO_FLOAT(f32) {
    memcpy(out, blocks, (size_t)n * sizeof(float));
}
MOE_REF_FROM_FLOAT(f32) {
    memcpy(blocks, in, (size_t)n * sizeof(float));
}

MOE_REF_TO_FLOAT(f16) {
    const uint16_t *h = blocks;
    for (int64_t i = 0; i < n; i++) out[i] = moe_fp16_to_f32(h[i]);
}
MOE_REF_FROM_FLOAT(f16) {
    uint16_t *h = blocks;
    for (int64_t i = 0; i < n; i++) h[i] = moe_f32_to_fp16(in[i]);
}

MOE_REF_TO_FLOAT(bf16) {
    const uint16_t *h = blocks;
    for (int64_t i = 0; i < n; i++) out[i] = moe_bf16_to_f32(h[i]);
}
MOE_REF_FROM_FLOAT(bf16) {
    uint16_t *h = blocks;
    for (int64_t i = 0; i < n; i++) h[i] = moe_f32_to_bf16(in[i]);
}

/* Float dots: a product of two halves (or bfloats) is exact in float; the sum is kept in
 * double, as ggml does for its f16 / bf16 dots' final reduction. */
MOE_REF_DOT(f32) {
    const float *a = w, *b = x;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(a[i] * b[i]);
    return (float)sum;
}
MOE_REF_DOT(f16) {
    const uint16_t *a = w, *b = x;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(moe_fp16_to_f32(a[i]) * moe_fp16_to_f32(b[i]));
    return (float)sum;
}
MOE_REF_DOT(bf16) {
    const uint16_t *a = w, *b = x;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(moe_bf16_to_f32(a[i]) * moe_bf16_to_f32(b[i]));
    return (float)sum;
}

/* ==== 32-value blocks: unpack to integers, then scale ==== */

/* One 32-value block decoded: x[j] = q[j] * d (+ m when has_min). The dot uses q and d (and
 * m against the Q8_1 s term), so to_float and dot share the bit decoding. */
typedef struct {
    int8_t q[MOE_QK32];
    float d, m;
    bool has_min;
} q32_unpacked;

typedef void (*q32_unpack_fn)(const void *block, q32_unpacked *u);

static const int8_t nibble_minus_8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const int8_t nibble_plain[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Q5_x: bit 4 of value j is bit j of the little-endian qh word; offset is 16 (Q5_0) or 0. */
static void unpack_fifth_bit(const uint8_t qh_bytes[4], int offset, int8_t q[32]) {
    const uint32_t qh = moe_load_le32(qh_bytes);
    for (int j = 0; j < 32; j++) q[j] = (int8_t)(q[j] + (int)(((qh >> j) & 1) << 4) - offset);
}

static void unpack_q4_0(const void *block, q32_unpacked *u) {
    const moe_block_q4_0 *b = block;
    moe_unpack_nibbles(b->qs, nibble_minus_8, u->q);
    u->d = moe_fp16_to_f32(b->d);
    u->has_min = false;
}
static void unpack_q4_1(const void *block, q32_unpacked *u) {
    const moe_block_q4_1 *b = block;
    moe_unpack_nibbles(b->qs, nibble_plain, u->q);
    u->d = moe_fp16_to_f32(b->d);
    u->m = moe_fp16_to_f32(b->m);
    u->has_min = true;
}
static void unpack_q5_0(const void *block, q32_unpacked *u) {
    const moe_block_q5_0 *b = block;
    moe_unpack_nibbles(b->qs, nibble_plain, u->q);
    unpack_fifth_bit(b->qh, 16, u->q);
    u->d = moe_fp16_to_f32(b->d);
    u->has_min = false;
}
static void unpack_q5_1(const void *block, q32_unpacked *u) {
    const moe_block_q5_1 *b = block;
    moe_unpack_nibbles(b->qs, nibble_plain, u->q);
    unpack_fifth_bit(b->qh, 0, u->q);
    u->d = moe_fp16_to_f32(b->d);
    u->m = moe_fp16_to_f32(b->m);
    u->has_min = true;
}
static void unpack_q8_0(const void *block, q32_unpacked *u) {
    const moe_block_q8_0 *b = block;
    memcpy(u->q, b->qs, 32);
    u->d = moe_fp16_to_f32(b->d);
    u->has_min = false;
}
static void unpack_q8_1(const void *block, q32_unpacked *u) {
    const moe_block_q8_1 *b = block;
    memcpy(u->q, b->qs, 32);
    u->d = moe_fp16_to_f32(b->d);
    u->has_min = false;
}
static void unpack_iq4_nl(const void *block, q32_unpacked *u) {
    const moe_block_iq4_nl *b = block;
    moe_unpack_nibbles(b->qs, moe_kvalues_iq4nl, u->q);
    u->d = moe_fp16_to_f32(b->d);
    u->has_min = false;
}

static void unpack_mxfp4(const void *block, q32_unpacked *u) {
    const moe_block_mxfp4 *b = block;
    moe_unpack_nibbles(b->qs, moe_kvalues_mxfp4, u->q);
    u->d = moe_e8m0_to_f32_half(b->e);
    u->has_min = false;
}

static void q32_to_float(const void *blocks, size_t block_bytes, q32_unpack_fn unpack, float *out,
                         int64_t n) {
    const uint8_t *p = blocks;
    q32_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK32; i++, p += block_bytes, out += MOE_QK32) {
        unpack(p, &u);
        /* ggml computes q*d (+ m); adding a zero m would turn -0 into +0 */
        if (u.has_min)
            for (int j = 0; j < MOE_QK32; j++) out[j] = (float)u.q[j] * u.d + u.m;
        else
            for (int j = 0; j < MOE_QK32; j++) out[j] = (float)u.q[j] * u.d;
    }
}

/* Dot against Q8_0 (x_is_q8_1 false) or Q8_1 blocks: per block the exact integer sum times
 * float(d_w * d_x), plus m_w * s_x for the types with a minimum (s is Q8_1's fp16 d*sum(q),
 * as ggml uses it: the exact sum of the q would land ~1e-3 away from ggml-cpu). With fast (the
 * types without a minimum, against Q8_0): the fast path's order instead (quant.h, "The two
 * paths"), acc = fma(d_w * d_x, (float)sum, acc), blocks in order. */
static float q32_dot(const void *w, size_t block_bytes, q32_unpack_fn unpack, const void *x,
                     bool x_is_q8_1, int64_t n, bool fast) {
    const uint8_t *p = w;
    double sum = 0;
    float acc = 0.0f;
    q32_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK32; i++, p += block_bytes) {
        const int8_t *xq;
        float dx, sx = 0;
        if (x_is_q8_1) {
            const moe_block_q8_1 *b = (const moe_block_q8_1 *)x + i;
            xq = b->qs, dx = moe_fp16_to_f32(b->d), sx = moe_fp16_to_f32(b->s);
        } else {
            const moe_block_q8_0 *b = (const moe_block_q8_0 *)x + i;
            xq = b->qs, dx = moe_fp16_to_f32(b->d);
        }
        unpack(p, &u);
        int32_t sumi = 0;
        for (int j = 0; j < MOE_QK32; j++) sumi += (int32_t)u.q[j] * xq[j];
        if (fast) {
            acc = fmaf(u.d * dx, (float)sumi, acc);
            continue;
        }
        /* the scale product is rounded to float as in ggml; the rest is exact in double */
        sum += (double)(u.d * dx) * sumi;
        if (u.has_min) sum += (double)u.m * sx;
    }
    return fast ? acc : (float)sum;
}

#define Q32_KERNELS(t, dot_q8_1)                                                                   \
    MOE_REF_TO_FLOAT(t) {                                                                          \
        q32_to_float(blocks, sizeof(moe_block_##t), unpack_##t, out, n);                           \
    }                                                                                              \
    MOE_REF_DOT(t) {                                                                               \
        return q32_dot(w, sizeof(moe_block_##t), unpack_##t, x, dot_q8_1, n, false);               \
    }
/* The same, with the fast path's order (the types without a minimum). */
#define Q32_FAST_KERNELS(t)                                                                        \
    Q32_KERNELS(t, false)                                                                          \
    MOE_FAST_REF_DOT(t) {                                                                          \
        return q32_dot(w, sizeof(moe_block_##t), unpack_##t, x, false, n, true);                   \
    }

Q32_FAST_KERNELS(q4_0)
Q32_KERNELS(q4_1, true)
Q32_FAST_KERNELS(q5_0)
Q32_KERNELS(q5_1, true)
Q32_FAST_KERNELS(q8_0)
Q32_KERNELS(q8_1, true)
Q32_FAST_KERNELS(iq4_nl)
Q32_FAST_KERNELS(mxfp4)

/* ==== 32-value weight quantizers (ggml's quantize_row_*_ref) ==== */

/* The value of largest magnitude, with its sign (the first one wins a tie). */
static float signed_absmax(const float *x, int n) {
    float amax = 0, max = 0;
    for (int j = 0; j < n; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]), max = x[j];
    return max;
}

static void min_max(const float *x, int n, float *min, float *max) {
    *min = INFINITY, *max = -INFINITY;
    for (int j = 0; j < n; j++) {
        if (x[j] < *min) *min = x[j];
        if (x[j] > *max) *max = x[j];
    }
}

/* Pack 32 values (each < 16 after masking) as nibbles, plus bit 4 into qh when qh != NULL. */
static void pack_nibbles(const uint8_t l[32], uint8_t qs[16], uint8_t qh_bytes[4]) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((l[j] & 0xF) | (l[j + 16] & 0xF) << 4);
        qh |= (uint32_t)((l[j] >> 4) & 1) << j | (uint32_t)((l[j + 16] >> 4) & 1) << (j + 16);
    }
    if (qh_bytes)
        for (int k = 0; k < 4; k++) qh_bytes[k] = (uint8_t)(qh >> 8 * k);
}

/* Symmetric: d = max / -(2^(bits-1)), l = min(2^bits - 1, trunc(x/d + 2^(bits-1) + 0.5)). */
static float quantize_symmetric(const float *x, int bits, uint8_t l[32]) {
    const int half = 1 << (bits - 1), top = (1 << bits) - 1;
    const float d = signed_absmax(x, 32) / (float)-half;
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        int v = (int8_t)(x[j] * id + ((float)half + 0.5f));
        l[j] = (uint8_t)(v < top ? v : top);
    }
    return d;
}

/* Affine: d = (max - min) / (2^bits - 1), l = min(2^bits - 1, trunc((x - min)/d + 0.5)). */
static float quantize_affine(const float *x, int bits, uint8_t l[32], float *min_out) {
    const int top = (1 << bits) - 1;
    float min, max;
    min_max(x, 32, &min, &max);
    const float d = (max - min) / (float)top;
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        int v = (int8_t)((x[j] - min) * id + 0.5f);
        l[j] = (uint8_t)(v < top ? v : top);
    }
    *min_out = min;
    return d;
}

MOE_REF_FROM_FLOAT(q4_0) {
    moe_block_q4_0 *b = blocks;
    uint8_t l[32];
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        b[i].d = moe_f32_to_fp16(quantize_symmetric(in, 4, l));
        pack_nibbles(l, b[i].qs, NULL);
    }
}
MOE_REF_FROM_FLOAT(q5_0) {
    moe_block_q5_0 *b = blocks;
    uint8_t l[32];
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        b[i].d = moe_f32_to_fp16(quantize_symmetric(in, 5, l));
        pack_nibbles(l, b[i].qs, b[i].qh);
    }
}
MOE_REF_FROM_FLOAT(q4_1) {
    moe_block_q4_1 *b = blocks;
    uint8_t l[32];
    float min;
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        b[i].d = moe_f32_to_fp16(quantize_affine(in, 4, l, &min));
        b[i].m = moe_f32_to_fp16(min);
        pack_nibbles(l, b[i].qs, NULL);
    }
}
MOE_REF_FROM_FLOAT(q5_1) {
    moe_block_q5_1 *b = blocks;
    uint8_t l[32];
    float min;
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        b[i].d = moe_f32_to_fp16(quantize_affine(in, 5, l, &min));
        b[i].m = moe_f32_to_fp16(min);
        pack_nibbles(l, b[i].qs, b[i].qh);
    }
}

/* ==== 8-bit quantizers: weights (ggml-base _ref) and activations (ggml-cpu) ==== */

static float absmax(const float *x, int n) {
    float amax = 0;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    return amax;
}

/* 32 values to int8 with d = amax/127. for_activation selects ggml-cpu's x86 rounding
 * (x * (127/amax), halves to even) over the _ref one (x * (1/d), halves away from zero).
 * Returns d (unrounded; the caller stores it as fp16) and the sum of the q. */
static float quantize_q8_32(const float *x, bool for_activation, int8_t q[32], int32_t *sum) {
    const float amax = absmax(x, 32);
    const float d = amax / 127.0f;
    *sum = 0;
    if (for_activation) {
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < 32; j++) q[j] = (int8_t)moe_nearest_int(x[j] * id);
    } else {
        const float id = d ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) q[j] = (int8_t)roundf(x[j] * id);
    }
    for (int j = 0; j < 32; j++) *sum += q[j];
    return d;
}

static void q8_0_row(const float *in, void *blocks, int64_t n, bool for_activation) {
    moe_block_q8_0 *b = blocks;
    int32_t sum;
    for (int64_t i = 0; i < n / 32; i++, in += 32)
        b[i].d = moe_f32_to_fp16(quantize_q8_32(in, for_activation, b[i].qs, &sum));
}
static void q8_1_row(const float *in, void *blocks, int64_t n, bool for_activation) {
    moe_block_q8_1 *b = blocks;
    int32_t sum;
    for (int64_t i = 0; i < n / 32; i++, in += 32) {
        float d = quantize_q8_32(in, for_activation, b[i].qs, &sum);
        b[i].d = moe_f32_to_fp16(d);
        b[i].s = moe_f32_to_fp16(d * (float)sum);
    }
}

MOE_REF_FROM_FLOAT(q8_0) {
    q8_0_row(in, blocks, n, false);
}
MOE_REF_FROM_FLOAT(q8_1) {
    q8_1_row(in, blocks, n, false);
}
void moe_ref_q8_0_from_float_act(const float *in, void *blocks, int64_t n) {
    q8_0_row(in, blocks, n, true);
}
void moe_ref_q8_1_from_float_act(const float *in, void *blocks, int64_t n) {
    q8_1_row(in, blocks, n, true);
}

/* Q8_K (activations of the K / IQ dots): scale by -127/max where max is the signed value of
 * largest magnitude, round halves to even, clamp at 127 (the value -max maps to -127 exactly,
 * so -128 never occurs); d = 1/iscale is stored as a float. bsums[s] = sum of 16 q. */
MOE_REF_FROM_FLOAT(q8_k) {
    moe_block_q8_k *b = blocks;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, in += MOE_QK_K) {
        const float max = signed_absmax(in, MOE_QK_K);
        if (max == 0.0f) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < MOE_QK_K; j++) {
            int v = moe_nearest_int(iscale * in[j]);
            b[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int s = 0; s < MOE_QK_K / 16; s++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += b[i].qs[16 * s + j];
            b[i].bsums[s] = (int16_t)sum;
        }
        b[i].d = 1 / iscale;
    }
}
void moe_ref_q8_k_from_float_act(const float *in, void *blocks, int64_t n) {
    moe_ref_q8_k_from_float(in, blocks, n);
}

MOE_REF_TO_FLOAT(q8_k) {
    const moe_block_q8_k *b = blocks;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, out += MOE_QK_K)
        for (int j = 0; j < MOE_QK_K; j++) out[j] = b[i].d * b[i].qs[j];
}
MOE_REF_DOT(q8_k) {
    const moe_block_q8_k *a = w, *b = x;
    double sum = 0;
    for (int64_t i = 0; i < n / MOE_QK_K; i++) {
        int32_t sumi = 0;
        for (int j = 0; j < MOE_QK_K; j++) sumi += (int32_t)a[i].qs[j] * b[i].qs[j];
        sum += (double)(a[i].d * b[i].d) * sumi;
    }
    return (float)sum;
}

/* ==== Float reference dot ==== */

float moe_dot_f32_ref(moe_type type, const void *w, const float *x, int64_t n) {
    const moe_type_traits *t = moe_type_traits_get(type);
    if (!t || !t->to_float || n % t->block_values)
        moe_die("moe_dot_f32_ref: bad type %d / n", type);
    /* decode one block (or 256 plain values) at a time: the largest block is 256 values */
    const int64_t chunk = t->block_values == 1 ? 256 : t->block_values;
    const size_t chunk_bytes = (size_t)(chunk / t->block_values) * t->block_bytes;
    const uint8_t *p = w;
    float buf[256], sum = 0;
    for (int64_t i = 0; i < n; i += chunk, p += chunk_bytes) {
        const int64_t m = n - i < chunk ? n - i : chunk;
        t->to_float(p, buf, m);
        for (int64_t j = 0; j < m; j++) sum += buf[j] * x[i + j];
    }
    return sum;
}

/* ==== Attention over the KV cache ==== */

/* Value i of a KV cache row: F32, F16, or Q8_0 (d * q, as its to_float gives it). */
static inline float kv_value(const void *base, moe_type kv_type, int64_t i) {
    if (kv_type == MOE_TYPE_Q8_0) {
        const moe_block_q8_0 *b = (const moe_block_q8_0 *)base + i / MOE_QK32;
        return (float)b->qs[i % MOE_QK32] * moe_fp16_to_f32(b->d);
    }
    return kv_type == MOE_TYPE_F16 ? moe_fp16_to_f32(((const uint16_t *)base)[i])
                                   : ((const float *)base)[i];
}

float moe_ref_kv_value(const void *base, moe_type kv_type, int64_t i) {
    return kv_value(base, kv_type, i);
}

static float attn_dot(const float *q, const void *k, moe_type kv_type, int n) {
    enum { LANES = 8, ACCS = 4, STEP = LANES * ACCS };
    const int whole = n & ~(STEP - 1);
    float acc[ACCS][LANES] = {{0}};
    for (int i = 0; i < whole; i += STEP)
        for (int a = 0; a < ACCS; a++)
            for (int l = 0; l < LANES; l++) {
                const int d = i + a * LANES + l;
                const float prod = q[d] * kv_value(k, kv_type, d);
                acc[a][l] += prod;
            }
    float lane[LANES], half[LANES / 2];
    for (int l = 0; l < LANES; l++) lane[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    for (int l = 0; l < LANES / 2; l++) half[l] = lane[l] + lane[l + LANES / 2];
    float sum = (half[0] + half[1]) + (half[2] + half[3]);
    for (int d = whole; d < n; d++) {
        const float prod = q[d] * kv_value(k, kv_type, d);
        sum += prod;
    }
    return sum;
}

void moe_ref_attn_scores(const float *q, const void *k, int64_t stride_bytes, int64_t n_kv,
                         moe_type kv_type, int n, float scale, float *out) {
    for (int64_t j = 0; j < n_kv; j++)
        out[j] = attn_dot(q, (const uint8_t *)k + j * stride_bytes, kv_type, n) * scale;
}

void moe_ref_attn_mix(float *y, const float *p, const void *v, int64_t stride_bytes, int64_t n_kv,
                      moe_type kv_type, int n) {
    for (int64_t j = 0; j < n_kv; j++) {
        const void *vj = (const uint8_t *)v + j * stride_bytes;
        for (int d = 0; d < n; d++) {
            const float prod = p[j] * kv_value(vj, kv_type, d);
            y[d] += prod;
        }
    }
}

/* sigmoid(g) = s = 1 / (1 + e) for g >= 0 and e / (1 + e) otherwise, e = e^-|g|; silu(g) = g s */
static float fast_sigmoid(float g) {
    const float e = moe_attn_exp(-fabsf(g)), d = 1.0f + e;
    return g >= 0 ? 1.0f / d : e / d;
}

static float fast_silu(float g) {
    return g * fast_sigmoid(g);
}

void moe_ref_swiglu(float *x, const float *gate, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i], u = x[i];
        if (limit > 0) g = fminf(g, limit), u = fminf(fmaxf(u, -limit), limit);
        x[i] = u * fast_silu(g);
    }
}

void moe_ref_silu(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = fast_silu(x[i]);
}

void moe_ref_sigmoid(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = fast_sigmoid(x[i]);
}

void moe_ref_index_scores(const float *q, const float *w, int n_head, int n, const float *keys,
                          int64_t key_stride, int64_t n_keys, float *out) {
    for (int64_t p = 0; p < n_keys; p++) {
        float score = 0.0f;
        for (int h = 0; h < n_head; h++) {
            const float relu =
                fmaxf(attn_dot(q + (int64_t)h * n, keys + p * key_stride, MOE_TYPE_F32, n), 0.0f);
            const float term = w[h] * relu;
            score += term;
        }
        out[p] = score;
    }
}

/* ==== Linear attention's products (quant.h: moe_rows_times_fn ..) ==== */

void moe_ref_rows_times(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                        int64_t os, int m, int k, int n) {
    for (int r = 0; r < m; r++)
        for (int j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int i = 0; i < k; i++) {
                const float p = a[r * as + i] * b[i * bs + j];
                sum += p;
            }
            out[r * os + j] = sum;
        }
}

void moe_ref_rows_update(float *y, int64_t ys, int m, const float *y_scale, const float *c,
                         int64_t cs, const float *x, int64_t xs, int n_s, int n) {
    for (int r = 0; r < m; r++)
        for (int j = 0; j < n; j++) {
            float acc = y_scale ? y[r * ys + j] * y_scale[r] : y[r * ys + j];
            for (int s = 0; s < n_s; s++) {
                const float p = c[r * cs + s] * x[s * xs + j];
                acc += p;
            }
            y[r * ys + j] = acc;
        }
}

void moe_ref_delta_row(const float *ka, const float *kb, const float *x, int64_t xs, float *e,
                       int64_t es, const float *d, int k, int n, float *a, float *b) {
    for (int s = 0; s < n; s++) {
        float sa = 0.0f, sb = 0.0f;
        for (int i = 0; i < k; i++) {
            float pa = x[i * xs + s] * ka[i], pb = x[i * xs + s] * kb[i];
            if (e) {
                float *ei = &e[i * es + s];
                *ei = s + 1 < n ? *ei * d[i] : 1.0f;
                pa *= *ei, pb *= *ei;
            }
            sa += pa, sb += pb;
        }
        a[s] = sa, b[s] = sb;
    }
}

/* ==== The fast path's attention tile (quant.h: moe_attn_tile_fn) ==== */

float moe_attn_exp(float x) {
    if (!(x >= MOE_ATTN_EXP_MIN)) return 0.0f;
    const float n = rintf(x * MOE_ATTN_EXP_LOG2E); /* nearest, ties to even */
    float r = fmaf(n, MOE_ATTN_EXP_LN2_A, x);
    r = fmaf(n, MOE_ATTN_EXP_LN2_B, r);
    float p = fmaf(MOE_ATTN_EXP_P0, r, MOE_ATTN_EXP_P1);
    p = fmaf(p, r, MOE_ATTN_EXP_P2);
    p = fmaf(p, r, MOE_ATTN_EXP_P3);
    p = fmaf(p, r, MOE_ATTN_EXP_P4);
    p = fmaf(p, r, MOE_ATTN_EXP_P5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    bits += (uint32_t)(int32_t)n << 23; /* n >= -124: the result stays normal */
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

void moe_attn_tile_quantize(const float *q, int dk, int i, int8_t *qq, float *qd) {
    moe_block_q8_0 b;
    for (int k = 0; k < dk / MOE_QK32; k++) {
        moe_ref_q8_0_from_float_act(q + k * MOE_QK32, &b, MOE_QK32);
        qd[k * MOE_ATTN_TILE_QV + i] = moe_fp16_to_f32(b.d);
        for (int e = 0; e < MOE_QK32; e++) {
            const int d = k * MOE_QK32 + e;
            qq[((d / 4) * MOE_ATTN_TILE_QV + i) * 4 + d % 4] = b.qs[e];
        }
    }
}

/* Query vector i's dot with key kj: an fma chain over values, or over q8_0 blocks (quant.h). */
static float attn_tile_dot(const moe_attn_tile_args *a, int i, const void *kj) {
    float dot = 0.0f;
    if (a->kv_type == MOE_TYPE_Q8_0) {
        const moe_block_q8_0 *kb = kj;
        for (int k = 0; k < a->dk / MOE_QK32; k++) {
            int32_t isum = 0;
            for (int e = 0; e < MOE_QK32; e++) {
                const int d = k * MOE_QK32 + e;
                isum += a->qq[((d / 4) * MOE_ATTN_TILE_QV + i) * 4 + d % 4] * kb[k].qs[e];
            }
            const float dd = a->qd[k * MOE_ATTN_TILE_QV + i] * moe_fp16_to_f32(kb[k].d);
            dot = fmaf(dd, (float)isum, dot);
        }
        return dot;
    }
    for (int d = 0; d < a->dk; d++)
        dot = fmaf(a->qt[d * MOE_ATTN_TILE_QV + i], kv_value(kj, a->kv_type, d), dot);
    return dot;
}

/* Key j's V block b as read from the tile. */
static const moe_block_q8_0 *attn_tile_v_block(const moe_attn_tile_args *a, int j, int b) {
    return (const moe_block_q8_0 *)((const uint8_t *)a->v + j * a->v_stride) + b;
}

/* Each key's largest |V block scale| (a NaN passed over); block b's scales (the pad key's 0). */
static void attn_tile_v_max(const moe_attn_tile_args *a, float *mk) {
    for (int j = 0; j < a->n_key; j++) {
        float m = 0.0f; /* a NaN scale is passed over */
        for (int b = 0; b < a->dv / MOE_QK32; b++) {
            const float d = fabsf(moe_fp16_to_f32(attn_tile_v_block(a, j, b)->d));
            m = d > m ? d : m;
        }
        mk[j] = m;
    }
}

static void attn_tile_v_scales(const moe_attn_tile_args *a, int b, float *d) {
    for (int j = 0; j < a->n_key; j++) d[j] = moe_fp16_to_f32(attn_tile_v_block(a, j, b)->d);
    if (a->n_key & 1) d[a->n_key] = 0.0f;
}

/* A weight as the integer mix takes it: the int32 nearest x (ties to even; INT32_MIN when x is
 * NaN or out of range, as cvtps2dq gives it), its low 16 bits. */
static int16_t attn_weight16(float x) {
    const int32_t w = fabsf(x) < 2147483648.0f ? (int32_t)rintf(x) : INT32_MIN;
    return (int16_t)(uint16_t)(uint32_t)w;
}

/* A Q8_0 cache's mix of one vector's weights p[0..n_key) into y (quant.h): integer sums. */
static void attn_tile_mix_q8(const moe_attn_tile_args *a, const float *p, float *y) {
    float mk[MOE_ATTN_TILE_KEYS], d[MOE_ATTN_TILE_KEYS + 1], top = 0.0f;
    attn_tile_v_max(a, mk);
    for (int j = 0; j < a->n_key; j++) {
        const float t = p[j] * mk[j];
        top = t > top ? t : top;
    }
    const bool ok = top > 0.0f && top < INFINITY;
    const float r = ok ? (float)MOE_ATTN_W16 / top : 0.0f, unit = ok ? top / MOE_ATTN_W16 : 0.0f;
    for (int b = 0; b < a->dv / MOE_QK32; b++) {
        attn_tile_v_scales(a, b, d);
        for (int e = 0; e < MOE_QK32; e++) {
            int32_t acc = 0;
            for (int j = 0; j < a->n_key; j++)
                acc += attn_weight16(p[j] * r * d[j]) * attn_tile_v_block(a, j, b)->qs[e];
            y[b * MOE_QK32 + e] = fmaf(unit, (float)acc, y[b * MOE_QK32 + e]);
        }
    }
}

void moe_ref_attn_tile(const moe_attn_tile_args *a) {
    for (int i = 0; i < a->nq; i++) {
        float s[MOE_ATTN_TILE_KEYS], m = a->m[i];
        for (int j = 0; j < a->n_key; j++) {
            s[j] = -INFINITY;
            if (j < a->lo[i] || j > a->hi[i]) continue;
            s[j] = attn_tile_dot(a, i, (const uint8_t *)a->k + j * a->k_stride) * a->scale;
            m = s[j] > m ? s[j] : m;
        }
        const float c = m > a->m[i] ? moe_attn_exp(a->m[i] - m) : 1.0f;
        float *y = a->out[i], l = a->l[i] * c;
        if (c != 1.0f)
            for (int d = 0; d < a->dv; d++) y[d] = y[d] * c + 0.0f;
        float p[MOE_ATTN_TILE_KEYS];
        for (int j = 0; j < a->n_key; j++) {
            p[j] = moe_attn_exp(s[j] - m);
            l += p[j];
        }
        if (a->kv_type == MOE_TYPE_Q8_0)
            attn_tile_mix_q8(a, p, y);
        else
            for (int j = 0; j < a->n_key; j++) {
                const void *vj = (const uint8_t *)a->v + j * a->v_stride;
                for (int d = 0; d < a->dv; d++)
                    y[d] = fmaf(p[j], kv_value(vj, a->kv_type, d), y[d]);
            }
        a->m[i] = m;
        a->l[i] = l;
    }
}
