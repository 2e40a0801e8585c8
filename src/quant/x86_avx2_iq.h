/* x86_avx2_iq.h: the codebook types' AVX2 decodes (a block's head and its 32-value chunks) and
 * the exact integer block sums built on them, shared by the files built with the AVX2 flags that
 * multiply codebook blocks: x86_avx2.c (the exact kernels) and fast_avx2.c (the fast path, at
 * avx2 and again at avxvnni).
 *
 * Everything is static inline: each file gets its own copy, compiled with its own flags. The
 * trap: the decodes hand out magnitudes and sign masks for maddubs (u <= 128, x86_avx2.h); a
 * caller that multiplies them some other way must keep that bound or say why it need not. */
#ifndef MOE_QUANT_X86_AVX2_IQ_H
#define MOE_QUANT_X86_AVX2_IQ_H

#include "x86_avx2.h"

/* sumi[r] += scale x (g times row r's 32 activations at byte `at` of its block, signs applied:
 * g is the unsigned magnitude, the signs move onto the activations). */
MOE_INLINE void rows_signed_madd(int R, __m256i g, __m256i signs, __m256i scale,
                                 const moe_block_q8_k *const *y, int at, __m256i *sumi) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256i p16 = avx2_mul_u8_i8(g, avx2_apply_signs(avx2_load(y[r]->qs + at), signs));
        sumi[r] = _mm256_add_epi32(sumi[r], avx2_scale16(p16, scale));
    }
}

/* ==== IQ types against Q8_K ==== */

/* Each codebook type is two decodes: its head (what the block keeps for all its values: the
 * sub-block scales as the type stores them, d_w) and its chunks (32 values: magnitudes u, the
 * sign mask, the int16 weight of each product pair's scale). Every use is a loop over a block's
 * 8 chunks: the exact path's multiply (iq_block: each row's integer sums in 8 lanes, turned to
 * float lanes at once, ggml's order) and the fast path's (fast_avx2.c). Magnitudes are <= 62 for
 * the grids (IQ2: 43, IQ3_XXS: 62, IQ3_S: 15, IQ1: 9) and <= 127 for IQ4_XS, so u x signed q8 fits
 * maddubs. */
typedef struct {
    __m128i sc; /* the block's scales as its chunk decode reads them (unused by some types) */
    float d;    /* d_w */
} iq_head;
typedef struct {
    __m256i u, neg, scale;
} iq_chunk;
typedef iq_head (*iq_head_fn)(const void *block);
typedef void (*iq_chunk_fn)(const void *block, const iq_head *h, int ib, iq_chunk *c);

MOE_INLINE iq_head iq_head_d(float d) {
    return (iq_head){_mm_setzero_si128(), d};
}
/* Signed q as magnitudes and a sign mask. */
MOE_INLINE void iq_chunk_signed(__m256i q, __m256i scale, iq_chunk *c) {
    c->u = _mm256_sign_epi8(q, q);
    c->neg = _mm256_cmpgt_epi8(_mm256_setzero_si256(), q);
    c->scale = scale;
}
/* The sign masks of four 7-bit ksigns indices (bits 0, 7, 14, 21 of aux). */
MOE_INLINE __m256i iq_ksigns(uint32_t aux) {
    return avx2_grid4(moe_ksigns64[aux & 127], moe_ksigns64[(aux >> 7) & 127],
                      moe_ksigns64[(aux >> 14) & 127], moe_ksigns64[(aux >> 21) & 127]);
}
/* 2s + 1 from a 4-bit scale s in the top bits of aux, for all 32 values. */
MOE_INLINE __m256i iq_top4_scale(uint32_t aux) {
    return _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
}

/* IQ2_XXS: per 32 values 4 grid bytes (8-value entries), then a word of 4 x 7-bit sign indices
 * and a 4-bit scale. */
MOE_INLINE iq_head iq2_xxs_head(const void *block) {
    return iq_head_d(avx2_fp16(((const moe_block_iq2_xxs *)block)->d));
}
MOE_INLINE void iq2_xxs_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    (void)h;
    const uint8_t *p = (const uint8_t *)((const moe_block_iq2_xxs *)block)->qs + 8 * ib;
    const uint32_t aux = moe_load_le32(p + 4);
    c->u = avx2_grid4(moe_iq2xxs_grid[p[0]], moe_iq2xxs_grid[p[1]], moe_iq2xxs_grid[p[2]],
                      moe_iq2xxs_grid[p[3]]);
    c->neg = iq_ksigns(aux);
    c->scale = iq_top4_scale(aux);
}

/* IQ2_XS: per 8 values a 9-bit grid index and a 7-bit sign index; a scale per 16 values. */
MOE_INLINE iq_head iq2_xs_head(const void *block) {
    const moe_block_iq2_xs *b = block;
    return (iq_head){avx2_iq2_scales16(b->scales), avx2_fp16(b->d)};
}
MOE_INLINE void iq2_xs_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    const uint16_t *q = ((const moe_block_iq2_xs *)block)->qs + 4 * ib;
    c->u = avx2_grid4(moe_iq2xs_grid[q[0] & 511], moe_iq2xs_grid[q[1] & 511],
                      moe_iq2xs_grid[q[2] & 511], moe_iq2xs_grid[q[3] & 511]);
    c->neg = avx2_grid4(moe_ksigns64[q[0] >> 9], moe_ksigns64[q[1] >> 9], moe_ksigns64[q[2] >> 9],
                        moe_ksigns64[q[3] >> 9]);
    c->scale = avx2_scale_pair16(h->sc, 2 * ib);
}

/* IQ2_S: 10-bit grid index (qs byte + 2 bits of qh), explicit sign bits, a scale per 16. */
MOE_INLINE iq_head iq2_s_head(const void *block) {
    const moe_block_iq2_s *b = block;
    return (iq_head){avx2_iq2_scales16(b->scales), avx2_fp16(b->d)};
}
MOE_INLINE void iq2_s_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    const moe_block_iq2_s *b = block;
    const uint8_t *qs = b->qs + 4 * ib;
    const unsigned qh = b->qh[ib];
    c->u = avx2_grid4(
        moe_iq2s_grid[qs[0] | ((qh << 8) & 0x300)], moe_iq2s_grid[qs[1] | ((qh << 6) & 0x300)],
        moe_iq2s_grid[qs[2] | ((qh << 4) & 0x300)], moe_iq2s_grid[qs[3] | ((qh << 2) & 0x300)]);
    c->neg = avx2_bits_to_mask(moe_load_le32(b->qs + 32 + 4 * ib));
    c->scale = avx2_scale_pair16(h->sc, 2 * ib);
}

/* IQ3_XXS: 4-value grid entries, sign indices and scale as IQ2_XXS. */
MOE_INLINE iq_head iq3_xxs_head(const void *block) {
    return iq_head_d(avx2_fp16(((const moe_block_iq3_xxs *)block)->d));
}
MOE_INLINE void iq3_xxs_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    (void)h;
    const uint8_t *p = ((const moe_block_iq3_xxs *)block)->qs + 8 * ib;
    const uint32_t aux = moe_load_le32(((const moe_block_iq3_xxs *)block)->qs + 64 + 4 * ib);
    c->u = _mm256_setr_epi32((int)moe_iq3xxs_grid[p[0]], (int)moe_iq3xxs_grid[p[1]],
                             (int)moe_iq3xxs_grid[p[2]], (int)moe_iq3xxs_grid[p[3]],
                             (int)moe_iq3xxs_grid[p[4]], (int)moe_iq3xxs_grid[p[5]],
                             (int)moe_iq3xxs_grid[p[6]], (int)moe_iq3xxs_grid[p[7]]);
    c->neg = iq_ksigns(aux);
    c->scale = iq_top4_scale(aux);
}

/* IQ3_S: 9-bit grid index (qs byte + a qh bit), explicit signs, a 4-bit scale per 32. The
 * grid entries come from scalar loads: an 8-lane vpgatherdd measured slower on Zen 5 (3.3 vs
 * 4.6 GB/s); MOE_IQ3S_GATHER=1 switches to it (tested either way). */
#ifndef MOE_IQ3S_GATHER
#define MOE_IQ3S_GATHER 0
#endif
MOE_INLINE iq_head iq3_s_head(const void *block) {
    const moe_block_iq3_s *b = block;
    return (iq_head){avx2_odd_scales8(b->scales), avx2_fp16(b->d)};
}
MOE_INLINE void iq3_s_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    const moe_block_iq3_s *b = block;
#if MOE_IQ3S_GATHER
    /* index k = qs[k] | bit k of qh << 8, one 8-lane gather */
    const __m256i idx = _mm256_or_si256(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * ib))),
        _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(b->qh[ib]),
                                           _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                         _mm256_set1_epi32(256)));
    c->u = _mm256_i32gather_epi32((const int *)moe_iq3s_grid, idx, 4);
#else
    const uint8_t *qs = b->qs + 8 * ib;
    const unsigned qh = b->qh[ib];
#define IQ3S(k) (int)moe_iq3s_grid[qs[k] | ((qh << (8 - (k))) & 256)]
    c->u =
        _mm256_setr_epi32(IQ3S(0), IQ3S(1), IQ3S(2), IQ3S(3), IQ3S(4), IQ3S(5), IQ3S(6), IQ3S(7));
#undef IQ3S
#endif
    c->neg = avx2_bits_to_mask(moe_load_le32(b->signs + 4 * ib));
    c->scale = avx2_splat_i16(h->sc, ib);
}

/* IQ1: q = 8 * grid (-1, 0, 1) + delta (+-1) per value, |q| <= 9. */
MOE_INLINE __m256i iq1_values(__m256i grid, __m256i delta) {
    return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), grid), delta);
}
MOE_INLINE uint64_t iq1_delta(bool negative) {
    return negative ? 0xffffffffffffffffull : 0x0101010101010101ull;
}

MOE_INLINE iq_head iq1_s_head(const void *block) {
    return iq_head_d(avx2_fp16(((const moe_block_iq1_s *)block)->d));
}
MOE_INLINE void iq1_s_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    (void)h;
    const moe_block_iq1_s *b = block;
    const unsigned qh = b->qh[ib];
    const uint8_t *qs = b->qs + 4 * ib;
    const __m256i g = avx2_grid4(
        moe_iq1s_grid[qs[0] | ((qh << 8) & 0x700)], moe_iq1s_grid[qs[1] | ((qh << 5) & 0x700)],
        moe_iq1s_grid[qs[2] | ((qh << 2) & 0x700)], moe_iq1s_grid[qs[3] | ((qh >> 1) & 0x700)]);
    iq_chunk_signed(iq1_values(g, _mm256_set1_epi64x((long long)iq1_delta(qh & 0x8000))),
                    _mm256_set1_epi16((short)(2 * ((qh >> 12) & 7) + 1)), c);
}

/* IQ1_M: 3-bit scales four to a word, the fp16 d in the words' top nibbles. */
MOE_INLINE iq_head iq1_m_head(const void *block) {
    const moe_block_iq1_m *b = block;
    uint16_t sw[4];
    memcpy(sw, b->scales, 8);
    const uint16_t d16 = (uint16_t)((sw[0] >> 12) | ((sw[1] >> 8) & 0x00f0) |
                                    ((sw[2] >> 4) & 0x0f00) | (sw[3] & 0xf000));
    int8_t scales[16];
    for (int s = 0; s < 16; s++) scales[s] = (int8_t)(2 * ((sw[s / 4] >> (3 * (s % 4))) & 7) + 1);
    return (iq_head){_mm_loadu_si128((const __m128i *)scales), avx2_fp16(d16)};
}
MOE_INLINE void iq1_m_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    const moe_block_iq1_m *b = block;
    const uint8_t *qs = b->qs + 4 * ib;
    const unsigned h0 = b->qh[2 * ib], h1 = b->qh[2 * ib + 1];
    const __m256i g = avx2_grid4(
        moe_iq1s_grid[qs[0] | ((h0 << 8) & 0x700)], moe_iq1s_grid[qs[1] | ((h0 << 4) & 0x700)],
        moe_iq1s_grid[qs[2] | ((h1 << 8) & 0x700)], moe_iq1s_grid[qs[3] | ((h1 << 4) & 0x700)]);
    const __m256i delta = avx2_grid4(iq1_delta(h0 & 0x08), iq1_delta(h0 & 0x80),
                                     iq1_delta(h1 & 0x08), iq1_delta(h1 & 0x80));
    iq_chunk_signed(iq1_values(g, delta), avx2_scale_pair16(h->sc, 2 * ib), c);
}

/* IQ4_XS: IQ4_NL codebook (signed, |v| <= 127) with a 6-bit scale per 32 values. */
MOE_INLINE iq_head iq4_xs_head(const void *block) {
    const moe_block_iq4_xs *b = block;
    return (iq_head){avx2_iq4xs_scales(b), avx2_fp16(b->d)};
}
MOE_INLINE void iq4_xs_chunk(const void *block, const iq_head *h, int ib, iq_chunk *c) {
    const __m256i book =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_kvalues_iq4nl));
    iq_chunk_signed(
        _mm256_shuffle_epi8(book, avx2_nibbles32(((const moe_block_iq4_xs *)block)->qs + 16 * ib)),
        avx2_splat_i16(h->sc, ib), c);
}

/* A block against R activation rows (y[r]: the row's Q8_K block): sumi[r] (zero on entry) gets
 * the exact integer sum of the block's scaled products in 8 int32 lanes; returns d_w. */
typedef float (*iq_block_fn)(int R, const void *block, const moe_block_q8_k *const *y,
                             __m256i *sumi);
MOE_INLINE float iq_block(int R, iq_head_fn head, iq_chunk_fn chunk, const void *block,
                          const moe_block_q8_k *const *y, __m256i *sumi) {
    const iq_head h = head(block);
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        iq_chunk c;
        chunk(block, &h, ib, &c);
        rows_signed_madd(R, c.u, c.neg, c.scale, y, 32 * ib, sumi);
    }
    return h.d;
}
#define IQ_BLOCK(t)                                                                                \
    MOE_INLINE float t##_block(int R, const void *block, const moe_block_q8_k *const *y,           \
                               __m256i *sumi) {                                                    \
        return iq_block(R, t##_head, t##_chunk, block, y, sumi);                                   \
    }
IQ_BLOCK(iq2_xxs)
IQ_BLOCK(iq2_xs)
IQ_BLOCK(iq2_s)
IQ_BLOCK(iq3_xxs)
IQ_BLOCK(iq3_s)
IQ_BLOCK(iq1_s)
IQ_BLOCK(iq1_m)
IQ_BLOCK(iq4_xs)
#undef IQ_BLOCK
#endif
