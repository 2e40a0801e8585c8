/* linear_avx2.c: linear attention's chunk products at the avx2 level (x86_linear.h, 8 lanes);
 * built with the avx2 flags (Makefile, isa_of), filled in by kernels.c for avx2 and the levels
 * over it until avx512's replace them. */
#include "kernels.h"

#define LIN_T      __m256
#define LIN_W      8
#define LIN_(op)   _mm256_##op
#define LIN_M      __m256
#define LIN_FN(nm) lin_avx2_##nm
/* lane l as an all-ones lane of a blend mask (no lane when l is outside 0 .. 7) */
#define LIN_MASK(l)                                                                                \
    _mm256_castsi256_ps(                                                                           \
        _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(l)))
#define LIN_ONE_WHERE(v, m) _mm256_blendv_ps(v, _mm256_set1_ps(1.0f), m)
#define LIN_GE(a, b)        _mm256_cmp_ps(a, b, _CMP_GE_OQ)
#define LIN_BLEND(m, a, b)  _mm256_blendv_ps(a, b, m)
#define LIN_EXP(x)          avx2_attn_exp(x)
#include "x86_linear.h"

void moe_kernels_fill_linear_avx2(moe_kernels *k) {
    LIN_FILL(k);
}
