/* quant: weight and activation block formats, their scalar reference kernels, and the trait
 * table the rest of the engine goes through.
 *
 * Type ids are ggml's (GGUF stores them as-is), so a gap in the numbering is a retired type and
 * moe_type_traits_get() returns NULL for it. Every matmul in the engine goes through the
 * traits: a weight row of type T is dotted against an activation row already converted to
 * traits(T)->dot_type (Q8_0 / Q8_1 / Q8_K blocks, F16, BF16 or F32). The trap: the 8-bit
 * activation blocks must be byte-identical to ggml's so integer dots reproduce its results;
 * change a rounding and the parity tests move by 1e-3. */
#ifndef MOE_QUANT_H
#define MOE_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

typedef enum moe_type {
    MOE_TYPE_F32 = 0,
    MOE_TYPE_F16 = 1,
    MOE_TYPE_Q4_0 = 2,
    MOE_TYPE_Q4_1 = 3,
    MOE_TYPE_Q5_0 = 6,
    MOE_TYPE_Q5_1 = 7,
    MOE_TYPE_Q8_0 = 8,
    MOE_TYPE_Q8_1 = 9,
    MOE_TYPE_Q2_K = 10,
    MOE_TYPE_Q3_K = 11,
    MOE_TYPE_Q4_K = 12,
    MOE_TYPE_Q5_K = 13,
    MOE_TYPE_Q6_K = 14,
    MOE_TYPE_Q8_K = 15,
    MOE_TYPE_IQ2_XXS = 16,
    MOE_TYPE_IQ2_XS = 17,
    MOE_TYPE_IQ3_XXS = 18,
    MOE_TYPE_IQ1_S = 19,
    MOE_TYPE_IQ4_NL = 20,
    MOE_TYPE_IQ3_S = 21,
    MOE_TYPE_IQ2_S = 22,
    MOE_TYPE_IQ4_XS = 23,
    MOE_TYPE_I8 = 24,
    MOE_TYPE_I16 = 25,
    MOE_TYPE_I32 = 26,
    MOE_TYPE_I64 = 27,
    MOE_TYPE_F64 = 28,
    MOE_TYPE_IQ1_M = 29,
    MOE_TYPE_BF16 = 30,
    MOE_TYPE_TQ1_0 = 34,
    MOE_TYPE_TQ2_0 = 35,
    MOE_TYPE_MXFP4 = 39,
    MOE_TYPE_COUNT = 40
} moe_type;

/* Dequantize n values (a multiple of block_values) from blocks to floats. */
typedef void (*moe_to_float_fn)(const void *blocks, float *out, int64_t n);
/* Quantize n floats (a multiple of block_values) into blocks. */
typedef void (*moe_from_float_fn)(const float *in, void *blocks, int64_t n);
/* Dot of n values: a weight row of this type against an activation row of dot_type. */
typedef float (*moe_dot_fn)(const void *w, const void *x, int64_t n);

typedef struct moe_type_traits {
    const char *name;             /* "Q4_K", as llama.cpp's tools print it */
    int64_t block_values;         /* values per block (1 for plain floats and ints) */
    size_t block_bytes;           /* bytes per block */
    bool is_quantized;            /* block-quantized (not a plain float/int type) */
    moe_to_float_fn to_float;     /* NULL where moe cannot decode the type */
    moe_from_float_fn from_float; /* NULL where moe has no quantizer for it */
    moe_type dot_type;            /* the activation type `dot` expects */
    moe_dot_fn dot;               /* NULL where there is no dot */
} moe_type_traits;

/* NULL for an id that is not a known type (a retired id or past the end). */
const moe_type_traits *moe_type_traits_get(uint32_t type);
/* Name for printing; "type#N" style names are not returned: unknown ids give "unknown". */
const char *moe_type_name(uint32_t type);
/* Parse a name like "q4_k" or "IQ2_S" (case-insensitive); false if unknown. */
bool moe_type_from_name(const char *name, moe_type *out);
/* Bytes of a row of n values; 0 if n is not a multiple of the block size or type unknown. */
uint64_t moe_type_row_bytes(uint32_t type, int64_t n);

/* ==== Activations for the dots ==== */

/* The activation type a weight row of type wtype is dotted against (its traits' dot_type);
 * MOE_TYPE_COUNT for an unknown type or one without a dot. */
moe_type moe_dot_type(moe_type wtype);
/* Bytes of one activation row of n values converted for wtype's dot (0 if n is not a multiple
 * of the dot type's block size, or wtype has no dot). Size the buffer for
 * moe_quantize_row_for_dot with it. */
uint64_t moe_dot_row_bytes(moe_type wtype, int64_t n);
/* Convert one float activation row x[n] to wtype's dot_type, byte-identical to what ggml-cpu
 * feeds its vec_dot (Q8_0 / Q8_1 round halves to even on x86, unlike the weight quantizers;
 * Q8_K; F16 / BF16 round to nearest even; F32 is copied). out holds moe_dot_row_bytes(wtype, n)
 * bytes. Call once per row, then traits(wtype)->dot(w_row, out, n) for every weight row. */
void moe_quantize_row_for_dot(moe_type wtype, const float *x, void *out, int64_t n);

/* Reference dot of a weight row against FLOAT activations (dequantize a block, multiply, add).
 * Slow but exact to float rounding; the quality yardstick for the integer paths. */
float moe_dot_f32_ref(moe_type type, const void *w, const float *x, int64_t n);

/* ==== Weight quantizers (quantize.c, quantize_k.c, quantize_iq.c) ====
 *
 * Every type moe writes, quantized as ggml_quantize_chunk does: without an importance vector the
 * type's reference fit, with one (imatrix[n], per column of the row, the same for every row) the
 * weighted fit ggml uses. Deterministic: the same floats give the same bytes on any thread count.
 */

/* One row of n values (a multiple of the block size) into blocks; imatrix may be NULL. */
typedef void (*moe_quantize_fn)(const float *x, void *blocks, int64_t n, const float *imatrix);
/* Whether moe has a quantizer for type t. */
bool moe_type_can_quantize(moe_type t);
/* IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S: llama.cpp refuses them without an importance matrix (too few
 * bits to spend on unimportant columns); given none, moe_quantize_row uses all-ones. */
bool moe_type_needs_imatrix(moe_type t);
/* Quantize one row; dies on a type without a quantizer or n not a multiple of the block. */
void moe_quantize_row(moe_type t, const float *x, void *out, int64_t n, const float *imatrix);
/* n_rows rows of n values, row r at x + r * n, written at out + r * moe_type_row_bytes(t, n), on
 * the pool's threads (NULL: the caller alone). */
void moe_quantize_rows(moe_type t, const float *x, void *out, int64_t n_rows, int64_t n,
                       const float *imatrix, moe_pool *pool);

/* ==== Random valid rows (random.c): for tests, benchmarks and synthetic models ==== */

/* Fill a row of n values of type t (n a multiple of the block size) with random valid data:
 * random index / sign / scale bits, float scales finite and of either sign (1e-4 .. 1e-1),
 * MXFP4 exponents 2^-18 .. 2^11; plain float types get N(0, 1). Deterministic in *seed, which
 * it advances. For speed, random valid blocks are as good as real ones. */
void moe_type_random_row(moe_type t, uint64_t *seed, void *out, int64_t n);
/* The same, then each block's float scales multiplied so that the block's decoded values have
 * root mean square `rms` (MXFP4: the nearest power of two; an all-zero block stays zero):
 * random valid blocks at a weight scale a forward pass keeps finite (moe synth --random-blocks). */
void moe_type_random_row_rms(moe_type t, uint64_t *seed, void *out, int64_t n, float rms);

/* ==== Weight layouts in memory (layout.c): what the loader may repack a matrix into ====
 *
 * A matrix is row after row in the file (MOE_LAYOUT_FILE). The loader may move its bytes into a
 * layout a fast kernel reads straight into its multiply (moe_model_repack); the tensor's
 * `layout` says which, and a matmul hands a repacked matrix only to the kernel of its layout
 * (moe_type_kernels.dot_tile_rows16). MOE_LAYOUT_ROWS16 (Q8_0, Q4_0, IQ4_NL, MXFP4, Q4_K, Q5_K,
 * Q6_K, IQ4_XS, IQ3_XXS, IQ2_XXS, IQ3_S): rows 16g .. 16g + 15 of a matrix (whole groups only:
 * the last rows % 16 rows stay as in the file) interleaved block by block, block i of the group
 * at 16 i block_bytes from the group's start: the 16 rows' block heads (the float scales: f16,
 * or MXFP4's e8m0 byte; Q4_K / Q5_K's d and dmin; Q6_K's d, the block's last 2 bytes; IQ4_XS's
 * d, scales_h and scales_l), row 0 first, then dword k of the 16 rows' block bodies (the rest of
 * the block in order: qs; the K quants' packed integer scales, qh, qs / ql; IQ3_S's qs, qh,
 * signs, scales) at 16 heads + 64 k + 4 v. The same bytes as the file's, moved: no memory cost,
 * and a group starts where the file's row 16g does. */
typedef enum moe_layout {
    MOE_LAYOUT_FILE = 0,   /* row after row, as the file has it */
    MOE_LAYOUT_ROWS16 = 1, /* 16 rows interleaved block by block (above) */
    MOE_LAYOUT_COUNT
} moe_layout;
#define MOE_ROWS16 16 /* rows per group of MOE_LAYOUT_ROWS16 */

/* Whether a matrix of type t can have the layout (MOE_LAYOUT_FILE: always). */
bool moe_layout_has_type(moe_layout layout, moe_type t);
/* 16 rows of n values of type t (file layout, one after another) to one group of
 * MOE_LAYOUT_ROWS16, and back. The buffers do not overlap. */
void moe_layout_rows16_pack(moe_type t, const void *rows, void *group, int64_t n);
void moe_layout_rows16_unpack(moe_type t, const void *group, void *rows, int64_t n);
/* A matrix of n_rows rows of n values (file layout) into `layout` in place, whole groups;
 * scratch holds MOE_ROWS16 rows. */
void moe_layout_pack_matrix(moe_layout layout, moe_type t, void *m, int64_t n_rows, int64_t n,
                            void *scratch);

/* ==== Kernel tables: the fast dots, one table per ISA level (kernels.c) ====
 *
 * The engine's matmul goes through the active table, never through traits->dot:
 *
 *     const moe_type_kernels *k = moe_kernels_type(wtype);   // once per matrix
 *     k->quantize_row_for_dot(x, xq, n);                     // once per activation row
 *     for (r = 0; r < rows; r++) y[r] = k->dot(w + r * row_bytes, xq, n);
 *
 * xq holds moe_dot_row_bytes(wtype, n) bytes and is byte-identical whichever table made it, so a
 * row quantized once may be dotted by any table. Each table is built once at start-up from the
 * one below it: a type without a kernel at some level keeps the lower level's, down to the
 * scalar reference (the traits). dot results equal the reference up to float summation order
 * (integer block sums are exact). Tables are immutable and safe to share between threads. */

/* One weight row against n_rows activation rows x_stride bytes apart (many-row matmuls:
 * prefill, batched decode, the rows routed to one expert): out[r * out_stride] is exactly
 * dot(w, x + r * x_stride, n), bit for bit -- the weight blocks are decoded once for several
 * rows, but each row's sums are formed in the single-row kernel's order. */
typedef void (*moe_dot_rows_fn)(const void *w, const void *x, size_t x_stride, int64_t n_rows,
                                int64_t n, float *out, int64_t out_stride);

/* Two weight rows, w and w + w_stride, against n_rows activation rows: out[r * out_stride + v]
 * is exactly dot(w + v * w_stride, x + r * x_stride, n). Each activation block is loaded and
 * scaled once for both weight rows. */
typedef void (*moe_dot_rows2_fn)(const void *w, size_t w_stride, const void *x, size_t x_stride,
                                 int64_t n_rows, int64_t n, float *out, int64_t out_stride);

/* The fast path's many-row matmul (NULL on the exact path and for types without one): n_w <=
 * MOE_DOT_TILE_W weight rows, w + v * w_stride, against n_rows activation rows x_stride bytes
 * apart: out[r * out_stride + v] is exactly dot(w + v * w_stride, x + r * x_stride, n), bit for
 * bit, whatever n_w and n_rows are -- each weight block is decoded once into an L1 tile for all
 * the rows, and every (weight row, activation row) pair keeps the per-row float order of dot. */
#define MOE_DOT_TILE_W 16
typedef void (*moe_dot_tile_fn)(const void *w, size_t w_stride, int n_w, const void *x,
                                size_t x_stride, int64_t n_rows, int64_t n, float *out,
                                int64_t out_stride);

typedef struct moe_type_kernels {
    moe_dot_fn dot;                         /* NULL where the type has no dot */
    moe_dot_tile_fn dot_tile;               /* fast path only; NULL: dot_rows / dot_rows2 */
    moe_dot_tile_fn dot_tile_rows16;        /* dot_tile on a MOE_LAYOUT_ROWS16 group: w its
                                             * start, n_w 16, w_stride unused; the same bits as
                                             * dot_tile on the rows unpacked (NULL: none) */
    moe_dot_rows_fn dot_rows;               /* NULL: moe_dot_rows loops over dot */
    moe_dot_rows2_fn dot_rows2;             /* NULL: weight rows one at a time */
    moe_from_float_fn quantize_row_for_dot; /* float activations -> dot_type; NULL with dot */
    moe_type dot_type;                      /* as traits->dot_type */
    moe_isa dot_isa, quantize_isa;          /* the level each function comes from */
} moe_type_kernels;

/* Attention of one query head over n_kv cached rows of kv_type values (MOE_TYPE_F32 or
 * MOE_TYPE_F16), row j at byte j * stride_bytes. Scores: out[j] = dot(q, k_j) * scale, the dot
 * summed in the order of ggml-cpu's x86 ggml_vec_dot_f32 (4 accumulators of 8 lanes over whole
 * 32-value steps, folded 0+2, 1+3, 0+1, the lanes as l + l+4 then pairs, then the tail one by one),
 * multiplying and adding separately. Mix: y[d] += p[j] * v_j[d] for j = 0, 1, .. in turn, element
 * by element. Every level gives the reference's bits. Why that order: the scores feed 8-bit
 * activation quantization later, where one ulp can flip a tie. One call covers all keys, so a level
 * can keep q, or a stretch of y, in registers across them. */
typedef void (*moe_attn_scores_fn)(const float *q, const void *k, int64_t stride_bytes,
                                   int64_t n_kv, moe_type kv_type, int n, float scale, float *out);
typedef void (*moe_attn_mix_fn)(float *y, const float *p, const void *v, int64_t stride_bytes,
                                int64_t n_kv, moe_type kv_type, int n);

/* The fast path's attention (ops' moe_attention_tiled): one tile of at most MOE_ATTN_TILE_KEYS
 * keys of one kv head against nq <= MOE_ATTN_TILE_QV query vectors, each with a running max m
 * and sum l of its softmax and its output row (the weighted values so far, not yet divided by l).
 * K and V are converted to f32 once per tile for all the query vectors. Query vector i sees keys
 * lo[i]..hi[i] of the tile (none when hi[i] < lo[i]); its float order, which the scalar
 * reference defines and every level gives bit for bit, depends on nothing else:
 *   s_j = (fma chain over d = 0.. of q_d k_jd, from 0) * scale, or -inf for a key it does not see;
 *   m' = max(m, s_j ...); c = m' > m ? exp(m - m') : 1; l = l c; y = y c + 0 (when c != 1);
 *   p_j = exp(s_j - m'); l += p_j key after key; y_d = fma(p_j, v_jd, y_d) key after key,
 * over every key of the tile (an unseen key's p_j = 0 adds an exact zero: y is never -0), exp
 * being moe_attn_exp. So a vector's bits never depend on which others share the call.
 * A Q8_0 cache (already lossy) takes the query vectors quantized as llama.cpp does for one:
 * q8_0 per 32 values (moe_attn_tile_quantize), and a score is integer work then one float step
 * per block b (32 values): s_j = (fma chain over b of (qd_b kd_b) x isum_b, from 0) * scale,
 * isum_b the exact int32 sum of the block's 32 products, qd_b and kd_b the query's and key's
 * block scales as f32; qt is not read then. Its mix is integer work too: with vd_jb key j's V
 * block scale as f32 and mk_j = the largest |vd_jb| over its blocks, top = the largest p_j mk_j
 * (keys unseen have p_j = 0), r = W16 / top and unit = top / W16 (both 0 unless 0 < top < inf),
 * w_jb = the low 16 bits of the int32 nearest (p_j r) vd_jb (ties to even; INT32_MIN when out of
 * range, as cvtps2dq), then y_d = fma(unit, (float) sum over j of w_jb x vq_jd, y_d) once per
 * tile, the sum exact in int32 (any order: 64 x 32767 x 128 < 2^31). Why: 4 vpdpwssd per key and
 * vector where the f32 mix takes 8 fmas (that mix was half of pp256's attention at depth 8192
 * on Zen 5). What it costs: a weight x scale is off by at most 2^-16 of the vector's largest in
 * the tile (the cache's values themselves are off by up to 2^-8 of their block's largest). */
#define MOE_ATTN_TILE_KEYS 64  /* keys per tile: fixed in absolute positions by the caller */
#define MOE_ATTN_TILE_QV   128 /* query vectors per call at most (16 rows x 8 heads) */
typedef struct moe_attn_tile_args {
    const void *k, *v;          /* the tile's first key: its kv head's K and V values */
    int64_t k_stride, v_stride; /* bytes between keys */
    moe_type kv_type;           /* MOE_TYPE_F32, F16 or Q8_0 */
    int n_key, dk, dv;          /* keys in the tile, K and V widths */
    float scale;
    int nq;
    const float *qt;        /* [dk][MOE_ATTN_TILE_QV]: query vector i in column i (columns nq..
                             * to the next multiple of 16 zero) */
    const int8_t *qq;       /* Q8_0 cache: [dk / 4][MOE_ATTN_TILE_QV][4] vector i's q8_0 values
                             * 4t..4t+3 at qq[(t * MOE_ATTN_TILE_QV + i) * 4], zero past nq */
    const float *qd;        /* Q8_0 cache: [dk / 32][MOE_ATTN_TILE_QV] their block scales */
    const int32_t *lo, *hi; /* [nq] the keys each query vector sees */
    float *m, *l;           /* [nq] running max of the scaled scores, running sum of weights */
    float *const *out;      /* [nq] output rows of dv floats */
    float *scratch;         /* MOE_ATTN_TILE_KEYS * max(dk, dv) floats, the width rounded up to a
                             * multiple of 16: the converted tile */
} moe_attn_tile_args;
typedef void (*moe_attn_tile_fn)(const moe_attn_tile_args *a);
#define MOE_ATTN_W16 32767 /* a Q8_0 cache's largest weight in the integer mix (W16 above) */
/* Query vector q (dk values, a multiple of 32) as column i of a Q8_0 tile's qq / qd, quantized
 * as the activations of a Q8_0 dot are (ggml-cpu's quantize_row_q8_0, the scale kept as f16). */
void moe_attn_tile_quantize(const float *q, int dk, int i, int8_t *qq, float *qd);
/* e^x for x <= 0 in float, the fast attention's softmax weights: Cephes' expf (x = n ln2 + r,
 * a degree-7 polynomial in r by fma, 2^n added to the exponent) within 2 ulp of e^x (measured in
 * the kernels suite), and 0 below -86 (e^-86 < 2^-124: nothing beside the maximum's weight 1)
 * and for -inf or NaN. The SIMD levels compute it lane by lane in the same operations. */
float moe_attn_exp(float x);

/* The fast path's SwiGLU (the exact path takes libm's expf, as ggml's scalar code): x[i] = u
 * (g s) with g = gate[i] and u = x[i], first clamped when limit > 0 (GLM's clamped SwiGLU: g to
 * at most limit, u to +-limit, fminf / fmaxf's NaN rules), s = 1 / (1 + e) for g >= 0 and
 * e / (1 + e) otherwise, e = moe_attn_exp(-|g|) (so the exponential never overflows). Every level
 * gives the reference's bits. Why: libm's expf value by value was the whole cost of the experts'
 * GLU (4 % of a q6-iq pp256 step, Zen 5). */
typedef void (*moe_swiglu_fn)(float *x, const float *gate, int64_t n, float limit);
/* The fast path's SiLU and sigmoid in place, x[i] = g s and x[i] = s as moe_swiglu_fn has them
 * (g = x[i], no clamp): the short convolutions' activation, the output gates and decays of
 * linear-attention layers. */
typedef void (*moe_silu_fn)(float *x, int64_t n);

/* ==== Linear attention's products (ops/linear_attn.c's delta rule, engine/hyper.c) ====
 * f32 work whose order the scalar reference fixes element by element: every product rounded,
 * then added (no fma), a sum from 0 over its index in order, so every level gives the same bits
 * (the vectors run across the output index, never along a sum). Why vectors at all: the chunked
 * delta rule, written as scalar dot products (each one add chain, ~4 cycles an add), took ~23 %
 * of perf's samples in a 5-layer GLM-5.3-Flash pp512 run on Zen 5, the model load included;
 * ~2.5 % after. */
/* out[r][j] = sum over i < k of a[r][i] x b[i][j] (rows as, bs, os floats apart), r < m, j < n. */
typedef void (*moe_rows_times_fn)(const float *a, int64_t as, const float *b, int64_t bs,
                                  float *out, int64_t os, int m, int k, int n);
/* Rows r < m of y (ys floats apart): y_r[j] = y_r[j] x y_scale[r] (y_scale NULL: as it is),
 * then y_r[j] = y_r[j] + c_r[s] x x_s[j] for s = 0 .. n_s - 1 in turn (c_r = c + r cs; rows of
 * x xs floats apart, xs may be negative or 0), j < n. */
typedef void (*moe_rows_update_fn)(float *y, int64_t ys, int m, const float *y_scale,
                                   const float *c, int64_t cs, const float *x, int64_t xs, int n_s,
                                   int n);
/* One row of the delta rule's intra-chunk coefficients, for columns s < n (x: [k][xs], column s
 * key s of the chunk; e: [k][es] running decays, or NULL): with e, e[i][s] = e[i][s] x d[i] for
 * s < n - 1 and e[i][n - 1] = 1, then a[s] = sum over i of (x[i][s] x ka[i]) x e[i][s] and b[s]
 * the same with kb; without, a[s] = sum over i of x[i][s] x ka[i], b[s] likewise. A level may
 * compute (and write) columns up to n rounded up to 16, so x, e, a and b hold that many. */
typedef void (*moe_delta_row_fn)(const float *ka, const float *kb, const float *x, int64_t xs,
                                 float *e, int64_t es, const float *d, int k, int n, float *a,
                                 float *b);

/* The lightning indexer's pool scores: out[p] = the sum over heads h = 0, 1, .. in turn, from 0,
 * of w[h] x fmaxf(dot(q + h n, keys + p key_stride), 0) for p < n_keys, each dot of n floats in
 * moe_attn_scores_fn's order (F32 keys, scale 1). Every level gives the reference's bits: a pool's
 * selection must not depend on the machine. Past MOE_INDEX_SCORES_MAX_N values a level may take
 * the reference. */
#define MOE_INDEX_SCORES_MAX_N 256 /* the widest head a level scores in its own way */
typedef void (*moe_index_scores_fn)(const float *q, const float *w, int n_head, int n,
                                    const float *keys, int64_t key_stride, int64_t n_keys,
                                    float *out);

typedef struct moe_kernels {
    moe_isa isa;      /* the level of this table */
    const char *name; /* moe_isa_name(isa) */
    bool exact;       /* the exact path (ggml's float order) rather than the fast one */
    moe_type_kernels types[MOE_TYPE_COUNT];
    moe_attn_scores_fn attn_scores;
    moe_attn_mix_fn attn_mix;
    moe_attn_tile_fn attn_tile; /* the fast path's; the exact path never calls it */
    moe_rows_times_fn rows_times;
    moe_rows_update_fn rows_update;
    moe_delta_row_fn delta_row;
    moe_index_scores_fn index_scores;
    moe_swiglu_fn swiglu; /* the fast path's */
    moe_silu_fn silu;     /* the fast path's */
    moe_silu_fn sigmoid;  /* the fast path's */
} moe_kernels;

/* ==== The two paths ====
 *
 * Every level has two tables. The exact path (moe_exact(): MOE_EXACT=1 in the environment,
 * read once, or moe_exact_set()) reproduces ggml-cpu's lane and float order, so logits match
 * llama.cpp's to 1e-3. The fast path (the default) may sum a dot's float block terms in another
 * order: for the types with a fast kernel (moe_kernels.types[t].dot_isa names its level; the others
 * run their exact kernel on the fast path too) a weight row's dot is exact int32 sums per block,
 * then one float multiply-add per block, acc = fma(d_w * d_x, (float)sum, acc), blocks in order, in
 * a single accumulator per (weight row, activation row); the scalar level's fast table holds the
 * reference of that order and the SIMD levels give its bits. Dequantization and the activation
 * bytes are the same on both paths. On both paths a row's result never depends on how many
 * rows share the call. */

/* The active table: moe_cpu_isa()'s level (the best the CPU runs, lowered by MOE_ISA), on the
 * path moe_exact() names (switch it between matmuls, never during one). */
const moe_kernels *moe_kernels_get(void);
/* The exact table of a given level; NULL when this CPU cannot run it (tests walk all levels). */
const moe_kernels *moe_kernels_for_isa(moe_isa isa);
/* The table of a level on either path; NULL when this CPU cannot run the level. */
const moe_kernels *moe_kernels_for_path(moe_isa isa, bool exact);
/* Shorthand: the active table's entry for a weight type (NULL for an unknown id). */
const moe_type_kernels *moe_kernels_type(moe_type wtype);
/* Through k->dot_rows where the level has a many-row kernel for the type, else k->dot row by
 * row: the same floats either way. */
void moe_dot_rows(const moe_type_kernels *k, const void *w, const void *x, size_t x_stride,
                  int64_t n_rows, int64_t n, float *out, int64_t out_stride);

/* ==== 4-bit QAT grids (grid.c): step recovery, Q4_0 blocks, compressed-tensors int4 ==== */

#define MOE_GRID_GROUP 32 /* weights per group: Q4_0's block, W4A16's group_size */

/* Recover the grid of one group w[n] (n <= 32) whose values are `src`-precision numbers
 * (MOE_TYPE_BF16, F16 or F32) of step x level, level in -8..7: for m = 1..8 the step max|w|/m
 * (either sign), refined by least squares and rounded to scale_type (MOE_TYPE_F16 for Q4_0,
 * MOE_TYPE_BF16 for W4A16; nearby stored values tried too) is kept when every level re-derived
 * on the stored grid, times the stored scale, rounded to `src`, is w[i] exactly. Returns the m
 * (1..8), 0 for an all-zero group (scale 0, levels 0), -1 when no grid reproduces the group
 * (off the grid). *scale gets the stored bits, levels[n] the levels. */
int moe_grid_recover(const float *w, int n, moe_type scale_type, moe_type src, uint16_t *scale,
                     int8_t *levels);
/* -1 when a stored group is w's grid: every levels[i] is round(w[i] / scale) in -8..7 (its rank
 * on the stored grid) and scale x level rounded to `src` is w[i] exactly (a zero scale holds
 * only zeros); else the first i that is not. What `moe repack --verify` checks. */
int moe_grid_check(const float *w, int n, moe_type scale_type, moe_type src, uint16_t scale,
                   const int8_t *levels);
/* One Q4_0 block (18 bytes) from an f16 scale and 32 levels in -8..7, and back. */
void moe_grid_q4_0_block(uint16_t scale, const int8_t *levels, void *out);
void moe_grid_q4_0_levels(const void *block, uint16_t *scale, int8_t *levels);
/* compressed-tensors pack_to_int32 of n levels in -8..7 (one row): 4 * ceil(n / 8) bytes,
 * value k in word k / 8 at bits 4 * (k % 8), stored as level + 8; and its inverse. */
void moe_grid_pack_int4(const int8_t *levels, int64_t n, uint8_t *out);
void moe_grid_unpack_int4(const uint8_t *packed, int64_t n, int8_t *levels);

#endif
