/* types.c: the trait table -- one row per type id: name, block geometry, kernels.
 *
 * Sizes are ggml's (GGUF files depend on them). Kernel pointers are filled by the reference
 * implementation in ref.c; a NULL kernel means moe cannot do that operation for the type. */
#include "quant.h"

#include <ctype.h>
#include <string.h>

#define PLAIN(nm, bytes) {.name = nm, .block_values = 1, .block_bytes = bytes, .is_quantized = false}
#define BLOCK(nm, values, bytes)                                                                   \
    {.name = nm, .block_values = values, .block_bytes = bytes, .is_quantized = true}

static moe_type_traits traits[MOE_TYPE_COUNT] = {
    [MOE_TYPE_F32] = PLAIN("F32", 4),
    [MOE_TYPE_F16] = PLAIN("F16", 2),
    [MOE_TYPE_Q4_0] = BLOCK("Q4_0", 32, 18),
    [MOE_TYPE_Q4_1] = BLOCK("Q4_1", 32, 20),
    [MOE_TYPE_Q5_0] = BLOCK("Q5_0", 32, 22),
    [MOE_TYPE_Q5_1] = BLOCK("Q5_1", 32, 24),
    [MOE_TYPE_Q8_0] = BLOCK("Q8_0", 32, 34),
    [MOE_TYPE_Q8_1] = BLOCK("Q8_1", 32, 36),
    [MOE_TYPE_Q2_K] = BLOCK("Q2_K", 256, 84),
    [MOE_TYPE_Q3_K] = BLOCK("Q3_K", 256, 110),
    [MOE_TYPE_Q4_K] = BLOCK("Q4_K", 256, 144),
    [MOE_TYPE_Q5_K] = BLOCK("Q5_K", 256, 176),
    [MOE_TYPE_Q6_K] = BLOCK("Q6_K", 256, 210),
    [MOE_TYPE_Q8_K] = BLOCK("Q8_K", 256, 292),
    [MOE_TYPE_IQ2_XXS] = BLOCK("IQ2_XXS", 256, 66),
    [MOE_TYPE_IQ2_XS] = BLOCK("IQ2_XS", 256, 74),
    [MOE_TYPE_IQ3_XXS] = BLOCK("IQ3_XXS", 256, 98),
    [MOE_TYPE_IQ1_S] = BLOCK("IQ1_S", 256, 50),
    [MOE_TYPE_IQ4_NL] = BLOCK("IQ4_NL", 32, 18),
    [MOE_TYPE_IQ3_S] = BLOCK("IQ3_S", 256, 110),
    [MOE_TYPE_IQ2_S] = BLOCK("IQ2_S", 256, 82),
    [MOE_TYPE_IQ4_XS] = BLOCK("IQ4_XS", 256, 136),
    [MOE_TYPE_I8] = PLAIN("I8", 1),
    [MOE_TYPE_I16] = PLAIN("I16", 2),
    [MOE_TYPE_I32] = PLAIN("I32", 4),
    [MOE_TYPE_I64] = PLAIN("I64", 8),
    [MOE_TYPE_F64] = PLAIN("F64", 8),
    [MOE_TYPE_IQ1_M] = BLOCK("IQ1_M", 256, 56),
    [MOE_TYPE_BF16] = PLAIN("BF16", 2),
    [MOE_TYPE_TQ1_0] = BLOCK("TQ1_0", 256, 54),
    [MOE_TYPE_TQ2_0] = BLOCK("TQ2_0", 256, 66),
    [MOE_TYPE_MXFP4] = BLOCK("MXFP4", 32, 17),
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
