/* quantize_iq_avx2.c: the IQ quantizers' neighbour distances with AVX2, eight codebook entries
 * per step (built with -mavx2 -mfma -mf16c; quantize_iq.c calls it only on a CPU that runs it).
 *
 * Each lane is one entry and sums its dims terms in the reference's order with separate
 * multiplies and adds (no FMA: fused rounding would change which neighbour wins a near-tie),
 * so d2 is the scalar reference's bit for bit. The levels come transposed and padded to a
 * multiple of 8 (quantize_iq.c), so a step is plain loads, no gathers. The trap: the padding
 * lanes are computed but never stored. */
#include <immintrin.h>

#include "quantize_internal.h"

#include "blocks.h"

void moe_iq_neighbour_d2_avx2(const int8_t *soa, int count, int dims, const float *xval,
                              const float *w, float scale, float a, float b, float *d2) {
    const int padded = (count + 7) & ~7;
    const __m256 vs = _mm256_set1_ps(scale), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int j = 0; j < count; j += 8) {
        __m256 s = _mm256_setzero_ps();
        for (int i = 0; i < dims; ++i) {
            const __m128i l8 = _mm_loadl_epi64((const __m128i *)(soa + i * padded + j));
            const __m256 pg = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l8));
            const __m256 q = _mm256_add_ps(_mm256_mul_ps(pg, va), vb);
            const __m256 diff = _mm256_sub_ps(_mm256_mul_ps(vs, q), _mm256_set1_ps(xval[i]));
            const __m256 wd = _mm256_mul_ps(_mm256_set1_ps(w[i]), diff);
            s = _mm256_add_ps(s, _mm256_mul_ps(wd, diff));
        }
        if (j + 8 <= count) {
            _mm256_storeu_ps(d2 + j, s);
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, s);
            for (int l = 0; j + l < count; l++) d2[j + l] = lanes[l];
        }
    }
}

/* The IQ4 pass: nearest codebook entries for 8 values at a time, then the two sums in the
 * reference's order (the per-value products are the reference's, only the adds stay serial).
 * The nearest entry as the reference finds it: the largest lo with values[lo] <= x (values
 * 1..14 counted; a value below all or above all lands on 0 or 14), then lo or lo + 1 by
 * x - values[lo] < values[lo + 1] - x -- which also gives 0 below and 15 above. */
void moe_iq4_pass_avx2(const float *xb, const float *weight, float id, uint8_t *L, float *sumqx,
                       float *sumq2) {
    float tab[16], wqx[32], wqq[32];
    for (int k = 0; k < 16; k++) tab[k] = moe_kvalues_iq4nl[k];
    const __m256 t0 = _mm256_loadu_ps(tab), t1 = _mm256_loadu_ps(tab + 8);
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i seven = _mm256_set1_epi32(7), one = _mm256_set1_epi32(1);
    for (int j = 0; j < 32; j += 8) {
        const __m256 x = _mm256_loadu_ps(xb + j);
        const __m256 al = _mm256_mul_ps(vid, x);
        __m256i lo = _mm256_setzero_si256();
        for (int k = 1; k < 15; k++) /* count of values[1..14] <= al: compare masks are -1 */
            lo = _mm256_sub_epi32(
                lo, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(tab[k]), al, _CMP_LE_OQ)));
        const __m256i hi = _mm256_add_epi32(lo, one);
        /* tab[i] for 8 lane indices i < 16: two permutes and a blend on i > 7 */
#define IQ4_LOOKUP(i)                                                                              \
    _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i), _mm256_permutevar8x32_ps(t1, i),             \
                     _mm256_castsi256_ps(_mm256_cmpgt_epi32(i, seven)))
        const __m256 vlo = IQ4_LOOKUP(lo), vhi = IQ4_LOOKUP(hi);
#undef IQ4_LOOKUP
        const __m256 pick_lo =
            _mm256_cmp_ps(_mm256_sub_ps(al, vlo), _mm256_sub_ps(vhi, al), _CMP_LT_OQ);
        const __m256i l = _mm256_sub_epi32(hi, _mm256_and_si256(_mm256_castps_si256(pick_lo), one));
        const __m256 q = _mm256_blendv_ps(vhi, vlo, pick_lo);
        const __m256 wq = _mm256_mul_ps(_mm256_loadu_ps(weight + j), q);
        _mm256_storeu_ps(wqx + j, _mm256_mul_ps(wq, x));
        _mm256_storeu_ps(wqq + j, _mm256_mul_ps(wq, q));
        if (L) {
            int32_t li[8];
            _mm256_storeu_si256((__m256i *)li, l);
            for (int k = 0; k < 8; k++) L[j + k] = (uint8_t)li[k];
        }
    }
    float a = 0, b = 0;
    for (int j = 0; j < 32; j++) a += wqx[j], b += wqq[j];
    *sumqx = a, *sumq2 = b;
}
