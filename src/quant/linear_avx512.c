/* linear_avx512.c: linear attention's chunk products at the avx512 level (x86_linear.h, 16
 * lanes); built with the avx512 flags (Makefile, isa_of), filled in by kernels.c for avx512 and
 * the levels over it. */
#include "kernels.h"

#define LIN_T      __m512
#define LIN_W      16
#define LIN_(op)   _mm512_##op
#define LIN_M      __mmask16
#define LIN_FN(nm) lin_avx512_##nm
/* lane l's bit (none when l is outside 0 .. 15) */
#define LIN_MASK(l)         ((l) >= 0 && (l) < 16 ? (__mmask16)(1u << (l)) : (__mmask16)0)
#define LIN_ONE_WHERE(v, m) _mm512_mask_mov_ps(v, m, _mm512_set1_ps(1.0f))
#define LIN_GE(a, b)        _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)
#define LIN_BLEND(m, a, b)  _mm512_mask_blend_ps(m, a, b)
#define LIN_EXP(x)          z_attn_exp(x)
#include "x86_linear.h"

void moe_kernels_fill_linear_avx512(moe_kernels *k) {
    LIN_FILL(k);
}
