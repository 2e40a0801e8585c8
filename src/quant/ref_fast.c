/* ref_fast.c: the scalar references of the fast path's float order, and the scalar level's fast
 * table.
 *
 * The order (quant.h, "The two paths"): per block, the exact int32 sum of the products of the
 * weight's and the activation's integers; then acc = fma(d_w * d_x, (float)sum, acc), blocks in
 * order, one accumulator. The SIMD fast kernels give these bits (test_kernels checks), so this
 * file is both the yardstick and the fast path at MOE_ISA=scalar. The trap: fmaf must stay a
 * fused multiply-add (one rounding); a separate multiply and add is another order. */
#include <math.h>

#include "blocks.h"
#include "kernels.h"

/* Q8_0 weights against Q8_0 activations. */
static float fast_ref_q8_0_dot(const void *w, const void *x, int64_t n) {
    const moe_block_q8_0 *a = w, *b = x;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / MOE_QK32; i++) {
        int32_t sum = 0;
        for (int j = 0; j < MOE_QK32; j++) sum += (int32_t)a[i].qs[j] * b[i].qs[j];
        acc = fmaf(moe_fp16_to_f32(a[i].d) * moe_fp16_to_f32(b[i].d), (float)sum, acc);
    }
    return acc;
}

/* The K and IQ types through their super-block decoders (blocks.h, the mold). */
float moe_kq_dot_fast(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack,
                      const void *x_q8_k, int64_t n) {
    const uint8_t *p = w;
    const moe_block_q8_k *x = x_q8_k;
    float acc = 0.0f;
    moe_kq_unpacked u;
    for (int64_t i = 0; i < n / MOE_QK_K; i++, p += block_bytes) {
        unpack(p, &u);
        const int groups = u.sub_values / 16; /* Q8_K bsums cover 16 values each */
        int32_t sum = 0, msum = 0;
        for (int s = 0; s < MOE_QK_K / u.sub_values; s++) {
            const int8_t *q = u.q + s * u.sub_values, *q8 = x[i].qs + s * u.sub_values;
            int32_t sub = 0;
            for (int j = 0; j < u.sub_values; j++) sub += (int32_t)q[j] * q8[j];
            sum += u.scale[s] * sub;
            if (u.has_min)
                for (int g = 0; g < groups; g++) msum += u.min[s] * x[i].bsums[s * groups + g];
        }
        acc = fmaf(u.d * x[i].d * u.mult, (float)sum, acc);
        if (u.has_min) acc = fmaf(-(u.dmin * x[i].d), (float)msum, acc);
    }
    return acc;
}

void moe_kernels_fill_fast_scalar(moe_kernels *k) {
    static const struct {
        moe_type type;
        moe_dot_fn dot;
    } dots[] = {
        {MOE_TYPE_Q8_0, fast_ref_q8_0_dot},           {MOE_TYPE_Q2_K, moe_fast_ref_q2_k_dot},
        {MOE_TYPE_Q3_K, moe_fast_ref_q3_k_dot},       {MOE_TYPE_Q4_K, moe_fast_ref_q4_k_dot},
        {MOE_TYPE_Q5_K, moe_fast_ref_q5_k_dot},       {MOE_TYPE_Q6_K, moe_fast_ref_q6_k_dot},
        {MOE_TYPE_IQ2_XXS, moe_fast_ref_iq2_xxs_dot}, {MOE_TYPE_IQ2_XS, moe_fast_ref_iq2_xs_dot},
        {MOE_TYPE_IQ2_S, moe_fast_ref_iq2_s_dot},     {MOE_TYPE_IQ3_XXS, moe_fast_ref_iq3_xxs_dot},
        {MOE_TYPE_IQ3_S, moe_fast_ref_iq3_s_dot},     {MOE_TYPE_IQ1_S, moe_fast_ref_iq1_s_dot},
        {MOE_TYPE_IQ1_M, moe_fast_ref_iq1_m_dot},     {MOE_TYPE_IQ4_XS, moe_fast_ref_iq4_xs_dot},
    };
    for (size_t i = 0; i < sizeof dots / sizeof dots[0]; i++)
        moe_kernels_set_fast_dot(k->types, dots[i].type, dots[i].dot, NULL, MOE_ISA_SCALAR);
}
