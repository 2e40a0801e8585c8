/* types.c: the trait table -- one row per type id: name, block geometry, kernels -- and the
 * activation conversion the dots expect.
 *
 * Sizes are ggml's (GGUF files depend on them). Kernel pointers are the scalar reference
 * (ref.c, ref_k.c, ref_iq.c); a NULL kernel means moe cannot do that operation for the type.
 * The trap: a type's from_float is the WEIGHT quantizer (ggml's _ref, what GGUF files hold);
 * activations must go through moe_quantize_row_for_dot, whose Q8_0 / Q8_1 round differently. */
#include "blocks.h"

#include <ctype.h>
#include <string.h>

/* geometry: name, values per block, bytes per block (designated initializers, no braces) */
#define PLAIN(nm, bytes) .name = nm, .block_values = 1, .block_bytes = bytes, .is_quantized = false
#define BLOCK(nm, values, bytes)                                                                   \
    .name = nm, .block_values = values, .block_bytes = bytes, .is_quantized = true
/* reference kernels of type t (lower case) whose dot takes activations of type dt */
#define KERNELS(t, dt)                                                                             \
    .to_float = moe_ref_##t##_to_float, .dot_type = MOE_TYPE_##dt, .dot = moe_ref_##t##_dot
#define QUANTIZER(t) .from_float = moe_ref_##t##_from_float

static const moe_type_traits traits[MOE_TYPE_COUNT] = {
    [MOE_TYPE_F32] = {PLAIN("F32", 4), KERNELS(f32, F32), QUANTIZER(f32)},
    [MOE_TYPE_F16] = {PLAIN("F16", 2), KERNELS(f16, F16), QUANTIZER(f16)},
    [MOE_TYPE_Q4_0] = {BLOCK("Q4_0", 32, 18), KERNELS(q4_0, Q8_0), QUANTIZER(q4_0)},
    [MOE_TYPE_Q4_1] = {BLOCK("Q4_1", 32, 20), KERNELS(q4_1, Q8_1), QUANTIZER(q4_1)},
    [MOE_TYPE_Q5_0] = {BLOCK("Q5_0", 32, 22), KERNELS(q5_0, Q8_0), QUANTIZER(q5_0)},
    [MOE_TYPE_Q5_1] = {BLOCK("Q5_1", 32, 24), KERNELS(q5_1, Q8_1), QUANTIZER(q5_1)},
    [MOE_TYPE_Q8_0] = {BLOCK("Q8_0", 32, 34), KERNELS(q8_0, Q8_0), QUANTIZER(q8_0)},
    [MOE_TYPE_Q8_1] = {BLOCK("Q8_1", 32, 36), KERNELS(q8_1, Q8_1), QUANTIZER(q8_1)},
    [MOE_TYPE_Q2_K] = {BLOCK("Q2_K", 256, 84), KERNELS(q2_k, Q8_K)},
    [MOE_TYPE_Q3_K] = {BLOCK("Q3_K", 256, 110), KERNELS(q3_k, Q8_K)},
    [MOE_TYPE_Q4_K] = {BLOCK("Q4_K", 256, 144), KERNELS(q4_k, Q8_K), QUANTIZER(q4_k)},
    [MOE_TYPE_Q5_K] = {BLOCK("Q5_K", 256, 176), KERNELS(q5_k, Q8_K)},
    [MOE_TYPE_Q6_K] = {BLOCK("Q6_K", 256, 210), KERNELS(q6_k, Q8_K), QUANTIZER(q6_k)},
    [MOE_TYPE_Q8_K] = {BLOCK("Q8_K", 256, 292), KERNELS(q8_k, Q8_K), QUANTIZER(q8_k)},
    [MOE_TYPE_IQ2_XXS] = {BLOCK("IQ2_XXS", 256, 66), KERNELS(iq2_xxs, Q8_K)},
    [MOE_TYPE_IQ2_XS] = {BLOCK("IQ2_XS", 256, 74), KERNELS(iq2_xs, Q8_K)},
    [MOE_TYPE_IQ3_XXS] = {BLOCK("IQ3_XXS", 256, 98), KERNELS(iq3_xxs, Q8_K)},
    [MOE_TYPE_IQ1_S] = {BLOCK("IQ1_S", 256, 50), KERNELS(iq1_s, Q8_K)},
    [MOE_TYPE_IQ4_NL] = {BLOCK("IQ4_NL", 32, 18), KERNELS(iq4_nl, Q8_0), QUANTIZER(iq4_nl)},
    [MOE_TYPE_IQ3_S] = {BLOCK("IQ3_S", 256, 110), KERNELS(iq3_s, Q8_K)},
    [MOE_TYPE_IQ2_S] = {BLOCK("IQ2_S", 256, 82), KERNELS(iq2_s, Q8_K)},
    [MOE_TYPE_IQ4_XS] = {BLOCK("IQ4_XS", 256, 136), KERNELS(iq4_xs, Q8_K), QUANTIZER(iq4_xs)},
    [MOE_TYPE_I8] = {PLAIN("I8", 1)},
    [MOE_TYPE_I16] = {PLAIN("I16", 2)},
    [MOE_TYPE_I32] = {PLAIN("I32", 4)},
    [MOE_TYPE_I64] = {PLAIN("I64", 8)},
    [MOE_TYPE_F64] = {PLAIN("F64", 8)},
    [MOE_TYPE_IQ1_M] = {BLOCK("IQ1_M", 256, 56), KERNELS(iq1_m, Q8_K)},
    [MOE_TYPE_BF16] = {PLAIN("BF16", 2), KERNELS(bf16, BF16), QUANTIZER(bf16)},
    [MOE_TYPE_TQ1_0] = {BLOCK("TQ1_0", 256, 54)},
    [MOE_TYPE_TQ2_0] = {BLOCK("TQ2_0", 256, 66)},
    [MOE_TYPE_MXFP4] = {BLOCK("MXFP4", 32, 17), KERNELS(mxfp4, Q8_0)},
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
