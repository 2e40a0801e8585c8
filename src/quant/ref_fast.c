/* ref_fast.c: the scalar references of the fast path's float order, and the scalar level's fast
 * table.
 *
 * The order (quant.h, "The two paths"): per block, the exact int32 sum of the products of the
 * weight's and the activation's integers; then acc = fma(d_w * d_x, (float)sum, acc), blocks in
 * order, one accumulator. The SIMD fast kernels give these bits (test_kernels checks), so this
 * file is both the yardstick and the fast path at MOE_ISA=scalar. Q8_0 is here; the K and IQ
 * types' references are the super-block mold's fast order (ref_k.c, moe_kq_dot_fast). The trap:
 * fmaf must stay a fused multiply-add (one rounding); a separate multiply and add is another
 * order. */
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

void moe_kernels_fill_fast_scalar(moe_kernels *k) {
#define FAST_REF(T, t) moe_kernels_set_fast_dot(k->types, MOE_TYPE_##T, t, NULL, MOE_ISA_SCALAR)
    FAST_REF(Q8_0, fast_ref_q8_0_dot);
    FAST_REF(Q2_K, moe_fast_ref_q2_k_dot);
    FAST_REF(Q3_K, moe_fast_ref_q3_k_dot);
    FAST_REF(Q4_K, moe_fast_ref_q4_k_dot);
    FAST_REF(Q5_K, moe_fast_ref_q5_k_dot);
    FAST_REF(Q6_K, moe_fast_ref_q6_k_dot);
    FAST_REF(IQ2_XXS, moe_fast_ref_iq2_xxs_dot);
    FAST_REF(IQ2_XS, moe_fast_ref_iq2_xs_dot);
    FAST_REF(IQ2_S, moe_fast_ref_iq2_s_dot);
    FAST_REF(IQ3_XXS, moe_fast_ref_iq3_xxs_dot);
    FAST_REF(IQ3_S, moe_fast_ref_iq3_s_dot);
    FAST_REF(IQ1_S, moe_fast_ref_iq1_s_dot);
    FAST_REF(IQ1_M, moe_fast_ref_iq1_m_dot);
    FAST_REF(IQ4_XS, moe_fast_ref_iq4_xs_dot);
#undef FAST_REF
}
