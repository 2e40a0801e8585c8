/* ref_fast.c: the scalar level's fast table, made of the scalar references of the fast path's
 * float order.
 *
 * The order (quant.h, "The two paths"): per block, the exact int32 sum of the products of the
 * weight's and the activation's integers; then acc = fma(d_w * d_x, (float)sum, acc), blocks in
 * order, one accumulator. The SIMD fast kernels give these bits (test_kernels checks), so the
 * references are both the yardstick and the fast path at MOE_ISA=scalar. They live beside the
 * exact references, sharing their decoders: the 32-value types' in ref.c (q32_dot), the K and IQ
 * types' in the super-block mold (ref_k.c, moe_kq_dot_fast). The trap: fmaf must stay a fused
 * multiply-add (one rounding); a separate multiply and add is another order. */
#include "blocks.h"
#include "kernels.h"

void moe_kernels_fill_fast_scalar(moe_kernels *k) {
#define FAST_REF(T, t) moe_kernels_set_fast_dot(k->types, MOE_TYPE_##T, t, NULL, MOE_ISA_SCALAR)
    FAST_REF(Q4_0, moe_fast_ref_q4_0_dot);
    FAST_REF(Q5_0, moe_fast_ref_q5_0_dot);
    FAST_REF(Q8_0, moe_fast_ref_q8_0_dot);
    FAST_REF(IQ4_NL, moe_fast_ref_iq4_nl_dot);
    FAST_REF(MXFP4, moe_fast_ref_mxfp4_dot);
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
