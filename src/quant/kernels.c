/* kernels.c: builds the per-ISA kernel tables once and hands out the active one.
 *
 * Level by level: scalar = the trait table's reference dots and the reference activation
 * quantizers; every higher level starts as a copy of the one below and lets its ISA file
 * overwrite what it does faster. Only levels the CPU runs are built (moe_cpu_isa_supported), so
 * no ISA file runs on a CPU without its instructions. The trap: moe_kernels_get() follows
 * MOE_ISA, moe_kernels_for_isa() does not (tests walk every runnable level). */
#include "kernels.h"

#include <pthread.h>

#include "blocks.h"

static moe_kernels tables[MOE_ISA_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void reference_quantize_q8_0(const float *x, void *out, int64_t n) {
    moe_ref_q8_0_from_float_act(x, out, n);
}
static void reference_quantize_q8_1(const float *x, void *out, int64_t n) {
    moe_ref_q8_1_from_float_act(x, out, n);
}

static void build_scalar(moe_kernels *k) {
    for (int t = 0; t < MOE_TYPE_COUNT; t++) {
        const moe_type_traits *tr = moe_type_traits_get((uint32_t)t);
        moe_type_kernels *e = &k->types[t];
        e->dot_isa = e->quantize_isa = MOE_ISA_SCALAR;
        e->dot_type = tr ? tr->dot_type : MOE_TYPE_COUNT;
        if (!tr || !tr->dot) continue;
        e->dot = tr->dot;
        switch (tr->dot_type) {
        case MOE_TYPE_Q8_0:
            e->quantize_row_for_dot = reference_quantize_q8_0;
            break;
        case MOE_TYPE_Q8_1:
            e->quantize_row_for_dot = reference_quantize_q8_1;
            break;
        case MOE_TYPE_Q8_K:
            e->quantize_row_for_dot = moe_ref_q8_k_from_float_act;
            break;
        default: /* F32 / F16 / BF16: the type's own converter rounds as ggml-cpu does */
            e->quantize_row_for_dot = moe_type_traits_get(tr->dot_type)->from_float;
            break;
        }
    }
}

static void build(void) {
    const moe_isa top = moe_cpu_isa_supported();
    build_scalar(&tables[MOE_ISA_SCALAR]);
    tables[MOE_ISA_SCALAR].attn_scores = moe_ref_attn_scores;
    tables[MOE_ISA_SCALAR].attn_mix = moe_ref_attn_mix;
    for (int level = MOE_ISA_SCALAR + 1; level <= (int)top; level++) {
        tables[level] = tables[level - 1];
        switch ((moe_isa)level) {
        case MOE_ISA_AVX2:
            moe_kernels_fill_avx2(&tables[level]);
            break;
        case MOE_ISA_AVX512:
            moe_kernels_fill_avx512(&tables[level]);
            break;
        case MOE_ISA_AVX512VNNI:
            moe_kernels_fill_avx512vnni(&tables[level]);
            break;
        default:
            break;
        }
    }
    for (int level = 0; level <= (int)top; level++) {
        tables[level].isa = (moe_isa)level;
        tables[level].name = moe_isa_name((moe_isa)level);
    }
}

const moe_kernels *moe_kernels_for_isa(moe_isa isa) {
    pthread_once(&once, build);
    if ((unsigned)isa >= MOE_ISA_COUNT || isa > moe_cpu_isa_supported()) return NULL;
    return &tables[isa];
}

const moe_kernels *moe_kernels_get(void) {
    return moe_kernels_for_isa(moe_cpu_isa());
}

const moe_type_kernels *moe_kernels_type(moe_type wtype) {
    if ((unsigned)wtype >= MOE_TYPE_COUNT) return NULL;
    return &moe_kernels_get()->types[wtype];
}

void moe_dot_rows(const moe_type_kernels *k, const void *w, const void *x, size_t x_stride,
                  int64_t n_rows, int64_t n, float *out, int64_t out_stride) {
    if (k->dot_rows) {
        k->dot_rows(w, x, x_stride, n_rows, n, out, out_stride);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++)
        out[r * out_stride] = k->dot(w, (const uint8_t *)x + (size_t)r * x_stride, n);
}
