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

void moe_kernels_fill_fast_scalar(moe_kernels *k) {
    moe_kernels_set_fast_dot(k->types, MOE_TYPE_Q8_0, fast_ref_q8_0_dot, NULL, MOE_ISA_SCALAR);
}
