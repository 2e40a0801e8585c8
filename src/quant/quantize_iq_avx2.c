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
