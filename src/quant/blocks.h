/* blocks.h: quant's internal header -- the on-disk block layouts, the IQ codebooks and the
 * scalar reference kernels the trait table in types.c points at.
 *
 * Every struct is byte-for-byte ggml's block of the same name (ggml-common.h): GGUF tensors are
 * arrays of them, so a size or a field order that drifts corrupts every file. Fields are laid out
 * so that no padding is possible (checked below with sizeof and offsetof); an "fp16" field is an
 * IEEE binary16 bit pattern (moe_fp16_to_f32). Nothing here is public: the rest of the engine
 * goes through quant.h. The trap: the bit layouts inside a block are not uniform -- K-quants
 * interleave low/high halves 32 or 64 values apart, not adjacently -- so read the comment on a
 * struct before indexing it. */
#ifndef MOE_QUANT_BLOCKS_H
#define MOE_QUANT_BLOCKS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

#define MOE_QK32      32     /* values per block of the legacy / IQ4_NL / MXFP4 types */
#define MOE_QK_K      256    /* values per K / IQ super-block */
#define MOE_IQ1_DELTA 0.125f /* IQ1S_DELTA == IQ1M_DELTA in ggml */

/* ==== 32-value blocks ==== */

/* Q4_0: x = d * (q - 8); qs[j] holds value j (low nibble) and value j+16 (high nibble). */
typedef struct {
    uint16_t d;     /* fp16 scale */
    uint8_t qs[16]; /* [32] 4-bit */
} moe_block_q4_0;

/* Q4_1: x = d * q + m. */
typedef struct {
    uint16_t d, m;  /* fp16 scale, fp16 minimum */
    uint8_t qs[16]; /* [32] 4-bit, as Q4_0 */
} moe_block_q4_1;

/* Q5_0: x = d * (q - 16); bit 4 of value j is bit j of the little-endian uint32 qh. */
typedef struct {
    uint16_t d;
    uint8_t qh[4];  /* [32] high bits */
    uint8_t qs[16]; /* [32] low nibbles, as Q4_0 */
} moe_block_q5_0;

/* Q5_1: x = d * q + m, bits as Q5_0. */
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[16];
} moe_block_q5_1;

/* Q8_0: x = d * q. Also the activation type of Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4 dots. */
typedef struct {
    uint16_t d;
    int8_t qs[32];
} moe_block_q8_0;

/* Q8_1: x = d * q, and s = fp16(d * sum(q)) so Q4_1 / Q5_1 dots get their min term for free. */
typedef struct {
    uint16_t d, s;
    int8_t qs[32];
} moe_block_q8_1;

/* IQ4_NL: x = d * kvalues_iq4nl[q]; nibbles as Q4_0. */
typedef struct {
    uint16_t d;
    uint8_t qs[16];
} moe_block_iq4_nl;

/* MXFP4: x = 2^(e-128) * kvalues_mxfp4[q] (e8m0 exponent, doubled e2m1 codebook). */
typedef struct {
    uint8_t e;      /* e8m0 shared exponent */
    uint8_t qs[16]; /* [32] e2m1 codes, nibbles as Q4_0 */
} moe_block_mxfp4;

/* ==== 256-value K super-blocks ==== */

/* Q2_K: 16 sub-blocks of 16; x = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4).
 * qs[32*h + l] holds values 128*h + 32*k + l in bits 2k..2k+1 (k = 0..3). */
typedef struct {
    uint8_t scales[16]; /* 4-bit scale | 4-bit min << 4 */
    uint8_t qs[64];     /* [256] 2-bit */
    uint16_t d, dmin;   /* fp16 super-block scales */
} moe_block_q2_k;

/* Q3_K: 16 sub-blocks of 16; x = d * (sc - 32) * (q - (hbit ? 0 : 4)); 6-bit scales packed in
 * 12 bytes; value 128*h + 32*k + l: low 2 bits as Q2_K, high bit = bit (4h + k) of hmask[l]. */
typedef struct {
    uint8_t hmask[32]; /* [256] high bits */
    uint8_t qs[64];    /* [256] low 2 bits */
    uint8_t scales[12];
    uint16_t d;
} moe_block_q3_k;

/* Q4_K: 8 sub-blocks of 32 with 6-bit scale and min (moe_k4_scale_min); x = d*sc*q - dmin*m.
 * qs[32*p + l] holds value 64*p + l (low nibble) and 64*p + 32 + l (high nibble). */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128]; /* [256] 4-bit */
} moe_block_q4_k;

/* Q5_K: as Q4_K plus a fifth bit: value 64*p + 32*h + l has it in bit 2p + h of qh[l]. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];  /* [256] high bits */
    uint8_t qs[128]; /* [256] low nibbles, as Q4_K */
} moe_block_q5_k;

/* Q6_K: 16 sub-blocks of 16; x = d * scales[s] * (q - 32). In each half of 128 values, ql[l] /
 * ql[l+32] hold values l, l+32 (low nibbles) and l+64, l+96 (high); qh[l] their top 2 bits. */
typedef struct {
    uint8_t ql[128];   /* [256] low 4 bits */
    uint8_t qh[64];    /* [256] high 2 bits */
    int8_t scales[16]; /* signed 8-bit sub-block scales */
    uint16_t d;
} moe_block_q6_k;

/* Q8_K: x = d * q, d a float32; bsums[s] = sum of qs[16s .. 16s+15]. Activation type only. */
typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} moe_block_q8_k;

/* ==== 256-value IQ super-blocks (codebook grids + sign bits) ==== */

/* IQ2_XXS: per 32 values two uint32: 4 grid bytes (iq2xxs_grid index each), then 4 x 7-bit
 * sign indices + a 4-bit scale s in the top bits; x = d * (0.5 + s) / 4 * grid * sign. */
typedef struct {
    uint16_t d;
    uint16_t qs[32];
} moe_block_iq2_xxs;

/* IQ2_XS: per 8 values a uint16: 9-bit iq2xs_grid index | 7-bit sign index << 9; one 4-bit
 * scale per 16 values. */
typedef struct {
    uint16_t d;
    uint16_t qs[32];
    uint8_t scales[8];
} moe_block_iq2_xs;

/* IQ2_S: 10-bit iq2s_grid index (qs byte + 2 bits of qh), explicit sign bytes in qs[32..63]. */
typedef struct {
    uint16_t d;
    uint8_t qs[64]; /* [32] grid index low bytes, then [32] sign bytes */
    uint8_t qh[8];  /* grid index high 2 bits, 4 per byte */
    uint8_t scales[8];
} moe_block_iq2_s;

/* IQ3_XXS: 64 iq3xxs_grid bytes (4 values each), then per 32 values a uint32 of 4 x 7-bit sign
 * indices + 4-bit scale s; x = d * (0.5 + s) / 2 * grid * sign. */
typedef struct {
    uint16_t d;
    uint8_t qs[96]; /* [64] grid indices, [8] x uint32 scales-and-signs */
} moe_block_iq3_xxs;

/* IQ3_S: 9-bit iq3s_grid index (qs byte + a qh bit), explicit signs, 4-bit scale per 32:
 * x = d * (1 + 2 s) * grid * sign. */
typedef struct {
    uint16_t d;
    uint8_t qs[64];
    uint8_t qh[8];
    uint8_t signs[32];
    uint8_t scales[4];
} moe_block_iq3_s;

/* IQ1_S: 11-bit iq1s_grid index (qs byte + 3 bits of qh); qh[s] for 32 values also holds a 3-bit
 * scale (bits 12..14) and the delta sign (bit 15): x = d * (2 s + 1) * (grid +- 1/8). */
typedef struct {
    uint16_t d;
    uint8_t qs[32];
    uint16_t qh[8];
} moe_block_iq1_s;

/* IQ1_M: as IQ1_S but 3-bit scales per 16 values and a delta sign per 8; the fp16 super-block
 * scale is scattered over the top nibbles of the four uint16 in scales. */
typedef struct {
    uint8_t qs[32];    /* grid index low bytes */
    uint8_t qh[16];    /* per 8 values: 3 index bits + delta sign bit (a nibble each) */
    uint8_t scales[8]; /* 4 x uint16: 4 x 3-bit scales | fp16 nibble << 12 */
} moe_block_iq1_m;

/* IQ4_XS: IQ4_NL codebook with a 6-bit scale per 32 values: x = d * (ls - 32) * kvalues[q]. */
typedef struct {
    uint16_t d;
    uint16_t scales_h;   /* 8 x 2 high bits of ls */
    uint8_t scales_l[4]; /* 8 x 4 low bits of ls */
    uint8_t qs[128];     /* [256] nibbles, as Q4_0 within each 32 */
} moe_block_iq4_xs;

/* ==== 256-value ternary super-blocks (no kernels yet: the type table sizes them) ==== */

/* TQ1_0: x = d * (t - 1), t in {0,1,2}; five trits per qs byte (base 3), four per qh byte. */
typedef struct {
    uint8_t qs[48]; /* [240] trits, 5 per byte */
    uint8_t qh[4];  /* [16] trits, 4 per byte */
    uint16_t d;
} moe_block_tq1_0;

/* TQ2_0: x = d * (q - 1), q a 2-bit code. */
typedef struct {
    uint8_t qs[64]; /* [256] 2-bit */
    uint16_t d;
} moe_block_tq2_0;

#define MOE_ASSERT_BLOCK(t, bytes)                                                                 \
    _Static_assert(sizeof(t) == (bytes), #t " size differs from ggml")
MOE_ASSERT_BLOCK(moe_block_q4_0, 18);
MOE_ASSERT_BLOCK(moe_block_q4_1, 20);
MOE_ASSERT_BLOCK(moe_block_q5_0, 22);
MOE_ASSERT_BLOCK(moe_block_q5_1, 24);
MOE_ASSERT_BLOCK(moe_block_q8_0, 34);
MOE_ASSERT_BLOCK(moe_block_q8_1, 36);
MOE_ASSERT_BLOCK(moe_block_iq4_nl, 18);
MOE_ASSERT_BLOCK(moe_block_mxfp4, 17);
MOE_ASSERT_BLOCK(moe_block_q2_k, 84);
MOE_ASSERT_BLOCK(moe_block_q3_k, 110);
MOE_ASSERT_BLOCK(moe_block_q4_k, 144);
MOE_ASSERT_BLOCK(moe_block_q5_k, 176);
MOE_ASSERT_BLOCK(moe_block_q6_k, 210);
MOE_ASSERT_BLOCK(moe_block_q8_k, 292);
MOE_ASSERT_BLOCK(moe_block_iq2_xxs, 66);
MOE_ASSERT_BLOCK(moe_block_iq2_xs, 74);
MOE_ASSERT_BLOCK(moe_block_iq2_s, 82);
MOE_ASSERT_BLOCK(moe_block_iq3_xxs, 98);
MOE_ASSERT_BLOCK(moe_block_iq3_s, 110);
MOE_ASSERT_BLOCK(moe_block_iq1_s, 50);
MOE_ASSERT_BLOCK(moe_block_iq1_m, 56);
MOE_ASSERT_BLOCK(moe_block_iq4_xs, 136);
MOE_ASSERT_BLOCK(moe_block_tq1_0, 54);
MOE_ASSERT_BLOCK(moe_block_tq2_0, 66);
/* the fields that follow a multi-byte field sit where ggml puts them */
_Static_assert(offsetof(moe_block_q2_k, d) == 80, "q2_k.d");
_Static_assert(offsetof(moe_block_q3_k, d) == 108, "q3_k.d");
_Static_assert(offsetof(moe_block_q6_k, d) == 208, "q6_k.d");
_Static_assert(offsetof(moe_block_q8_k, bsums) == 260, "q8_k.bsums");
_Static_assert(offsetof(moe_block_iq1_s, qh) == 34, "iq1_s.qh");
_Static_assert(offsetof(moe_block_iq4_xs, qs) == 8, "iq4_xs.qs");

/* ==== Codebooks (iq_tables.c, generated by scripts/gen_iq_tables.py) ==== */

extern const uint64_t moe_iq2xxs_grid[256];
extern const uint64_t moe_iq2xs_grid[512];
extern const uint64_t moe_iq2s_grid[1024];
extern const uint32_t moe_iq3xxs_grid[256];
extern const uint32_t moe_iq3s_grid[512];
extern const uint64_t moe_iq1s_grid[2048];
extern const int8_t moe_kvalues_iq4nl[16];
extern const int8_t moe_kvalues_mxfp4[16];
extern const uint8_t moe_ksigns_iq2xs[128];
extern const uint64_t moe_ksigns64[128];
extern const uint8_t moe_kmask_iq2xs[8];

/* ==== Shared helpers ==== */

/* Round to nearest, ties to even, for |f| < 2^22: ggml's nearest_int (the 1.5*2^23 trick),
 * which is what its K / IQ quantizers and the Q8_K activation quantizer round with. */
static inline int moe_nearest_int(float f) {
    float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* Scale and min of sub-block j (0..7) of a Q4_K / Q5_K block: 6 bits each, from 12 bytes. */
static inline void moe_k4_scale_min(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* Nibble layout shared by Q4_x, Q5_x, IQ4_NL, MXFP4 and IQ4_XS: value j of a 32-value group
 * is the low nibble of qs[j], value j+16 the high nibble; both go through a 16-entry map (an
 * offset like -8, or a codebook). */
static inline void moe_unpack_nibbles(const uint8_t qs[16], const int8_t map[16], int8_t q[32]) {
    for (int j = 0; j < 16; j++) {
        q[j] = map[qs[j] & 0xF];
        q[j + 16] = map[qs[j] >> 4];
    }
}

/* MXFP4's e8m0 exponent as a float, halved (the MXFP4 codebook is doubled): 2^(e - 128),
 * exact (e = 0 and 1 give float subnormals). */
static inline float moe_e8m0_to_f32_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A little-endian uint32 from 4 bytes of a block (blocks are byte arrays from a file). */
static inline uint32_t moe_load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ==== The 256-value super-block mold (ref_k.c) ====
 *
 * Every K and IQ type decodes to the same shape: 256 small integers q, an integer scale (and
 * for Q2_K / Q4_K / Q5_K an integer min) per sub-block of 16 or 32 values, and float super-block
 * scales. Then, with s the sub-block of value i,
 *     x[i] = (d * scale[s] * mult) * q[i]  -  dmin * min[s]           (min term if has_min)
 * which is bit-exact with ggml's to_float for each type (ref_iq.c says why for IQ1 / IQ2 /
 * IQ3, whose ggml formulas look different), and the dot against Q8_K is
 *     d * d_x * mult * sum_s scale[s] * sum_{i in s} q[i] * q8[i]  -  dmin * d_x * sum_s min[s] *
 * bsum_s. So to_float and dot share one decoder per type. */
typedef struct {
    int8_t q[MOE_QK_K]; /* [256] integer values (IQ grids with their signs applied) */
    int16_t scale[16];  /* [256 / sub_values] integer sub-block scales */
    int16_t min[16];    /* [256 / sub_values] integer sub-block mins (has_min) */
    int sub_values;     /* 16 or 32 */
    bool has_min;
    float d, dmin; /* super-block scale and min scale (decoded fp16) */
    float mult;    /* a power of two applied to d * scale (IQ1 / IQ2: 1/8, IQ3_XXS: 1/4) */
} moe_kq_unpacked;

typedef void (*moe_kq_unpack_fn)(const void *block, moe_kq_unpacked *u);
void moe_kq_to_float(const void *blocks, size_t block_bytes, moe_kq_unpack_fn unpack, float *out,
                     int64_t n);
float moe_kq_dot(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack, const void *x_q8_k,
                 int64_t n);
/* The same dot in the fast path's order (ref_fast.c): per super-block the int32 sum
 * sum_s scale[s] * sum_{i in s} q[i] * q8[i] (|sum| < 2^31 for every type), then
 * acc = fma(d * d_x * mult, (float)sum, acc), and with a min acc = fma(-(dmin * d_x),
 * (float)sum_s min[s] * bsum_s, acc). */
float moe_kq_dot_fast(const void *w, size_t block_bytes, moe_kq_unpack_fn unpack,
                      const void *x_q8_k, int64_t n);
/* to_float, dot and fast-order dot of type t from its decoder `static void unpack_<t>(block,
 * moe_kq_unpacked *)` */
#define MOE_KQ_KERNELS(t)                                                                          \
    MOE_REF_TO_FLOAT(t) {                                                                          \
        moe_kq_to_float(blocks, sizeof(moe_block_##t), unpack_##t, out, n);                        \
    }                                                                                              \
    MOE_REF_DOT(t) {                                                                               \
        return moe_kq_dot(w, sizeof(moe_block_##t), unpack_##t, x, n);                             \
    }                                                                                              \
    MOE_FAST_REF_DOT(t) {                                                                          \
        return moe_kq_dot_fast(w, sizeof(moe_block_##t), unpack_##t, x, n);                        \
    }

/* ==== Reference kernels (ref.c, ref_k.c, ref_iq.c) ==== */

/* Signatures follow quant.h: to_float(blocks, out, n), from_float(in, blocks, n),
 * dot(w, x, n) with x in the type's dot_type; n is a multiple of the block size. */
#define MOE_REF_TO_FLOAT(t) void moe_ref_##t##_to_float(const void *blocks, float *out, int64_t n)
#define MOE_REF_FROM_FLOAT(t)                                                                      \
    void moe_ref_##t##_from_float(const float *in, void *blocks, int64_t n)
#define MOE_REF_DOT(t) float moe_ref_##t##_dot(const void *w, const void *x, int64_t n)
/* The fast path's order (quant.h, "The two paths"), for the table at MOE_ISA=scalar. */
#define MOE_FAST_REF_DOT(t) float moe_fast_ref_##t##_dot(const void *w, const void *x, int64_t n)

MOE_REF_TO_FLOAT(f32);
MOE_REF_TO_FLOAT(f16);
MOE_REF_TO_FLOAT(bf16);
MOE_REF_TO_FLOAT(q4_0);
MOE_REF_TO_FLOAT(q4_1);
MOE_REF_TO_FLOAT(q5_0);
MOE_REF_TO_FLOAT(q5_1);
MOE_REF_TO_FLOAT(q8_0);
MOE_REF_TO_FLOAT(q8_1);
MOE_REF_TO_FLOAT(iq4_nl);
MOE_REF_TO_FLOAT(mxfp4);
MOE_REF_TO_FLOAT(q2_k);
MOE_REF_TO_FLOAT(q3_k);
MOE_REF_TO_FLOAT(q4_k);
MOE_REF_TO_FLOAT(q5_k);
MOE_REF_TO_FLOAT(q6_k);
MOE_REF_TO_FLOAT(q8_k);
MOE_REF_TO_FLOAT(iq2_xxs);
MOE_REF_TO_FLOAT(iq2_xs);
MOE_REF_TO_FLOAT(iq2_s);
MOE_REF_TO_FLOAT(iq3_xxs);
MOE_REF_TO_FLOAT(iq3_s);
MOE_REF_TO_FLOAT(iq1_s);
MOE_REF_TO_FLOAT(iq1_m);
MOE_REF_TO_FLOAT(iq4_xs);

/* Weight quantizers: ggml's quantizers with no importance matrix (IQ1 / IQ2: an all-ones one,
 * see quantize.c). */
MOE_REF_FROM_FLOAT(f32);
MOE_REF_FROM_FLOAT(f16);
MOE_REF_FROM_FLOAT(bf16);
MOE_REF_FROM_FLOAT(q4_0);
MOE_REF_FROM_FLOAT(q4_1);
MOE_REF_FROM_FLOAT(q5_0);
MOE_REF_FROM_FLOAT(q5_1);
MOE_REF_FROM_FLOAT(q8_0);
MOE_REF_FROM_FLOAT(q8_1);
MOE_REF_FROM_FLOAT(q8_k);
MOE_REF_FROM_FLOAT(iq4_nl);
MOE_REF_FROM_FLOAT(q2_k);
MOE_REF_FROM_FLOAT(q3_k);
MOE_REF_FROM_FLOAT(q4_k);
MOE_REF_FROM_FLOAT(q5_k);
MOE_REF_FROM_FLOAT(q6_k);
MOE_REF_FROM_FLOAT(iq4_xs);
MOE_REF_FROM_FLOAT(mxfp4);
MOE_REF_FROM_FLOAT(iq2_xxs);
MOE_REF_FROM_FLOAT(iq2_xs);
MOE_REF_FROM_FLOAT(iq2_s);
MOE_REF_FROM_FLOAT(iq3_xxs);
MOE_REF_FROM_FLOAT(iq3_s);
MOE_REF_FROM_FLOAT(iq1_s);
MOE_REF_FROM_FLOAT(iq1_m);

/* Activation quantizers: what ggml-cpu's from_float writes for its dots (ref.c says how they
 * differ from the weight quantizers of the same type). */
void moe_ref_q8_0_from_float_act(const float *in, void *blocks, int64_t n);
void moe_ref_q8_1_from_float_act(const float *in, void *blocks, int64_t n);
void moe_ref_q8_k_from_float_act(const float *in, void *blocks, int64_t n);

MOE_REF_DOT(f32);
MOE_REF_DOT(f16);
MOE_REF_DOT(bf16);
MOE_REF_DOT(q4_0);
MOE_REF_DOT(q4_1);
MOE_REF_DOT(q5_0);
MOE_REF_DOT(q5_1);
MOE_REF_DOT(q8_0);
MOE_REF_DOT(q8_1);
MOE_REF_DOT(iq4_nl);
MOE_REF_DOT(mxfp4);
MOE_REF_DOT(q2_k);
MOE_REF_DOT(q3_k);
MOE_REF_DOT(q4_k);
MOE_REF_DOT(q5_k);
MOE_REF_DOT(q6_k);
MOE_REF_DOT(q8_k);
MOE_REF_DOT(iq2_xxs);
MOE_REF_DOT(iq2_xs);
MOE_REF_DOT(iq2_s);
MOE_REF_DOT(iq3_xxs);
MOE_REF_DOT(iq3_s);
MOE_REF_DOT(iq1_s);
MOE_REF_DOT(iq1_m);
MOE_REF_DOT(iq4_xs);

MOE_FAST_REF_DOT(q4_0);
MOE_FAST_REF_DOT(q5_0);
MOE_FAST_REF_DOT(q8_0);
MOE_FAST_REF_DOT(iq4_nl);
MOE_FAST_REF_DOT(mxfp4);
MOE_FAST_REF_DOT(q2_k);
MOE_FAST_REF_DOT(q3_k);
MOE_FAST_REF_DOT(q4_k);
MOE_FAST_REF_DOT(q5_k);
MOE_FAST_REF_DOT(q6_k);
MOE_FAST_REF_DOT(iq2_xxs);
MOE_FAST_REF_DOT(iq2_xs);
MOE_FAST_REF_DOT(iq2_s);
MOE_FAST_REF_DOT(iq3_xxs);
MOE_FAST_REF_DOT(iq3_s);
MOE_FAST_REF_DOT(iq1_s);
MOE_FAST_REF_DOT(iq1_m);
MOE_FAST_REF_DOT(iq4_xs);

/* Scalar linear-attention products (quant.h: the reference every level reproduces bit for
 * bit). */
void moe_ref_swiglu(float *x, const float *gate, int64_t n, float limit);
void moe_ref_silu(float *x, int64_t n);
void moe_ref_sigmoid(float *x, int64_t n);
void moe_ref_index_scores(const float *q, const float *w, int n_head, int n, const float *keys,
                          int64_t key_stride, int64_t n_keys, float *out);
void moe_ref_rows_times(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                        int64_t os, int m, int k, int n);
void moe_ref_rows_update(float *y, int64_t ys, int m, const float *y_scale, const float *c,
                         int64_t cs, const float *x, int64_t xs, int n_s, int n);
void moe_ref_delta_row(const float *ka, const float *kb, const float *x, int64_t xs, float *e,
                       int64_t es, const float *d, int k, int n, float *a, float *b);

/* Scalar attention kernels (the reference every level reproduces bit for bit). */
/* Value i of a KV cache row of kv_type (F32, F16, Q8_0): the SIMD levels' scalar tails. */
float moe_ref_kv_value(const void *base, moe_type kv_type, int64_t i);
void moe_ref_attn_scores(const float *q, const void *k, int64_t stride_bytes, int64_t n_kv,
                         moe_type kv_type, int n, float scale, float *out);
void moe_ref_attn_mix(float *y, const float *p, const void *v, int64_t stride_bytes, int64_t n_kv,
                      moe_type kv_type, int n);
/* moe_attn_exp's constants (Cephes expf): below MIN the result is 0; x = n ln2 + r with n =
 * round(x LOG2E) and ln 2 in two parts; e^r = 1 + r + r^2 P(r), P of degree 5 from P0 down. */
#define MOE_ATTN_EXP_MIN   (-86.0f)
#define MOE_ATTN_EXP_LOG2E 1.44269504088896341f
#define MOE_ATTN_EXP_LN2_A (-0.693359375f)
#define MOE_ATTN_EXP_LN2_B 2.12194440e-4f
#define MOE_ATTN_EXP_P0    1.9875691500e-4f
#define MOE_ATTN_EXP_P1    1.3981999507e-3f
#define MOE_ATTN_EXP_P2    8.3334519073e-3f
#define MOE_ATTN_EXP_P3    4.1665795894e-2f
#define MOE_ATTN_EXP_P4    1.6666665459e-1f
#define MOE_ATTN_EXP_P5    5.0000001201e-1f
/* The fast path's attention tile in the order quant.h states, query vector by query vector. */
void moe_ref_attn_tile(const moe_attn_tile_args *a);

#endif
