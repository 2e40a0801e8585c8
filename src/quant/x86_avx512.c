/* x86_avx512.c: placeholder table (filled below). */
#include "kernels.h"

void moe_kernels_fill_avx512(moe_type_kernels types[MOE_TYPE_COUNT]) {
    (void)types;
}
