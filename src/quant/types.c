/* types.c: the trait table -- one row per type id: name, block geometry, kernels -- and the
 * activation conversion the dots expect.
 *
 * Sizes are ggml's (GGUF files depend on them): sizeof the block structs, whose sizes blocks.h
 * asserts. Kernel pointers are the scalar reference (ref.c, ref_k.c, ref_iq.c); a NULL kernel
 * means moe cannot do that operation for the type. The trap: a type's from_float is the WEIGHT
 * quantizer (ggml's _ref, what GGUF files hold); activations must go through
 * moe_quantize_row_for_dot, whose Q8_0 / Q8_1 round differently. */
#include "blocks.h"

#include <ctype.h>
#include <string.h>

/* geometry: name, values per block, bytes per block (designated initializers, no braces); the
 * bytes are sizeof the C type of one value or block (moe_block_<t> of blocks.h, which asserts
 * ggml's size), so the table cannot drift from the layouts the kernels read */
#define PLAIN(T, ctype)                                                                            \
    .name = #T, .block_values = 1, .block_bytes = sizeof(ctype), .is_quantized = false
#define BLOCK(T, t, values)                                                                        \
    .name = #T, .block_values = values, .block_bytes = sizeof(moe_block_##t), .is_quantized = true
/* reference kernels of type t (lower case) whose dot takes activations of type dt */
#define KERNELS(t, dt)                                                                             \
    .to_float = moe_ref_##t##_to_float, .dot_type = MOE_TYPE_##dt, .dot = moe_ref_##t##_dot
#define QUANTIZER(t) .from_float = moe_ref_##t##_from_float

static const moe_type_traits traits[MOE_TYPE_COUNT] = {
    [MOE_TYPE_F32] = {PLAIN(F32, float), KERNELS(f32, F32), QUANTIZER(f32)},
    [MOE_TYPE_F16] = {PLAIN(F16, uint16_t), KERNELS(f16, F16), QUANTIZER(f16)},
    [MOE_TYPE_Q4_0] = {BLOCK(Q4_0, q4_0, MOE_QK32), KERNELS(q4_0, Q8_0), QUANTIZER(q4_0)},
    [MOE_TYPE_Q4_1] = {BLOCK(Q4_1, q4_1, MOE_QK32), KERNELS(q4_1, Q8_1), QUANTIZER(q4_1)},
    [MOE_TYPE_Q5_0] = {BLOCK(Q5_0, q5_0, MOE_QK32), KERNELS(q5_0, Q8_0), QUANTIZER(q5_0)},
    [MOE_TYPE_Q5_1] = {BLOCK(Q5_1, q5_1, MOE_QK32), KERNELS(q5_1, Q8_1), QUANTIZER(q5_1)},
    [MOE_TYPE_Q8_0] = {BLOCK(Q8_0, q8_0, MOE_QK32), KERNELS(q8_0, Q8_0), QUANTIZER(q8_0)},
    [MOE_TYPE_Q8_1] = {BLOCK(Q8_1, q8_1, MOE_QK32), KERNELS(q8_1, Q8_1), QUANTIZER(q8_1)},
    [MOE_TYPE_Q2_K] = {BLOCK(Q2_K, q2_k, MOE_QK_K), KERNELS(q2_k, Q8_K), QUANTIZER(q2_k)},
    [MOE_TYPE_Q3_K] = {BLOCK(Q3_K, q3_k, MOE_QK_K), KERNELS(q3_k, Q8_K), QUANTIZER(q3_k)},
    [MOE_TYPE_Q4_K] = {BLOCK(Q4_K, q4_k, MOE_QK_K), KERNELS(q4_k, Q8_K), QUANTIZER(q4_k)},
    [MOE_TYPE_Q5_K] = {BLOCK(Q5_K, q5_k, MOE_QK_K), KERNELS(q5_k, Q8_K), QUANTIZER(q5_k)},
    [MOE_TYPE_Q6_K] = {BLOCK(Q6_K, q6_k, MOE_QK_K), KERNELS(q6_k, Q8_K), QUANTIZER(q6_k)},
    [MOE_TYPE_Q8_K] = {BLOCK(Q8_K, q8_k, MOE_QK_K), KERNELS(q8_k, Q8_K), QUANTIZER(q8_k)},
    [MOE_TYPE_IQ2_XXS] = {BLOCK(IQ2_XXS, iq2_xxs, MOE_QK_K), KERNELS(iq2_xxs, Q8_K),
                          QUANTIZER(iq2_xxs)},
    [MOE_TYPE_IQ2_XS] = {BLOCK(IQ2_XS, iq2_xs, MOE_QK_K), KERNELS(iq2_xs, Q8_K), QUANTIZER(iq2_xs)},
    [MOE_TYPE_IQ3_XXS] = {BLOCK(IQ3_XXS, iq3_xxs, MOE_QK_K), KERNELS(iq3_xxs, Q8_K),
                          QUANTIZER(iq3_xxs)},
    [MOE_TYPE_IQ1_S] = {BLOCK(IQ1_S, iq1_s, MOE_QK_K), KERNELS(iq1_s, Q8_K), QUANTIZER(iq1_s)},
    [MOE_TYPE_IQ4_NL] = {BLOCK(IQ4_NL, iq4_nl, MOE_QK32), KERNELS(iq4_nl, Q8_0), QUANTIZER(iq4_nl)},
    [MOE_TYPE_IQ3_S] = {BLOCK(IQ3_S, iq3_s, MOE_QK_K), KERNELS(iq3_s, Q8_K), QUANTIZER(iq3_s)},
    [MOE_TYPE_IQ2_S] = {BLOCK(IQ2_S, iq2_s, MOE_QK_K), KERNELS(iq2_s, Q8_K), QUANTIZER(iq2_s)},
    [MOE_TYPE_IQ4_XS] = {BLOCK(IQ4_XS, iq4_xs, MOE_QK_K), KERNELS(iq4_xs, Q8_K), QUANTIZER(iq4_xs)},
    [MOE_TYPE_I8] = {PLAIN(I8, int8_t)},
    [MOE_TYPE_I16] = {PLAIN(I16, int16_t)},
    [MOE_TYPE_I32] = {PLAIN(I32, int32_t)},
    [MOE_TYPE_I64] = {PLAIN(I64, int64_t)},
    [MOE_TYPE_F64] = {PLAIN(F64, double)},
    [MOE_TYPE_IQ1_M] = {BLOCK(IQ1_M, iq1_m, MOE_QK_K), KERNELS(iq1_m, Q8_K), QUANTIZER(iq1_m)},
    [MOE_TYPE_BF16] = {PLAIN(BF16, uint16_t), KERNELS(bf16, BF16), QUANTIZER(bf16)},
    [MOE_TYPE_TQ1_0] = {BLOCK(TQ1_0, tq1_0, MOE_QK_K)},
    [MOE_TYPE_TQ2_0] = {BLOCK(TQ2_0, tq2_0, MOE_QK_K)},
    [MOE_TYPE_MXFP4] = {BLOCK(MXFP4, mxfp4, MOE_QK32), KERNELS(mxfp4, Q8_0), QUANTIZER(mxfp4)},
};

const moe_type_traits *moe_type_traits_get(uint32_t type) {
    if (type >= MOE_TYPE_COUNT || !traits[type].name) return NULL;
    return &traits[type];
}

const char *moe_type_name(uint32_t type) {
    const moe_type_traits *t = moe_type_traits_get(type);
    return t ? t->name : "unknown";
}

bool moe_type_from_name(const char *name, moe_type *out) {
    for (uint32_t i = 0; i < MOE_TYPE_COUNT; i++) {
        if (!traits[i].name) continue;
        const char *a = traits[i].name, *b = name;
        while (*a && *b && toupper((unsigned char)*b) == *a) a++, b++;
        if (!*a && !*b) {
            *out = (moe_type)i;
            return true;
        }
    }
    return false;
}

uint64_t moe_type_row_bytes(uint32_t type, int64_t n) {
    const moe_type_traits *t = moe_type_traits_get(type);
    if (!t || n < 0 || n % t->block_values) return 0;
    uint64_t bytes;
    if (moe_mul_overflow((uint64_t)(n / t->block_values), t->block_bytes, &bytes)) return 0;
    return bytes;
}

/* ==== Activations for the dots ==== */

moe_type moe_dot_type(moe_type wtype) {
    const moe_type_traits *t = moe_type_traits_get(wtype);
    return t && t->dot ? t->dot_type : MOE_TYPE_COUNT;
}

uint64_t moe_dot_row_bytes(moe_type wtype, int64_t n) {
    moe_type dt = moe_dot_type(wtype);
    return dt == MOE_TYPE_COUNT ? 0 : moe_type_row_bytes(dt, n);
}

void moe_quantize_row_for_dot(moe_type wtype, const float *x, void *out, int64_t n) {
    const moe_type dt = moe_dot_type(wtype);
    if (dt == MOE_TYPE_COUNT || n % traits[dt].block_values)
        moe_die("moe_quantize_row_for_dot: type %s has no dot for n = %lld", moe_type_name(wtype),
                (long long)n);
    switch (dt) {
    case MOE_TYPE_Q8_0:
        moe_ref_q8_0_from_float_act(x, out, n);
        break;
    case MOE_TYPE_Q8_1:
        moe_ref_q8_1_from_float_act(x, out, n);
        break;
    case MOE_TYPE_Q8_K:
        moe_ref_q8_k_from_float_act(x, out, n);
        break;
    default:
        traits[dt].from_float(x, out, n);
        break; /* F32 / F16 / BF16: one rounding only */
    }
}
