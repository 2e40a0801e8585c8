/* x86_avx512vnni.c: placeholder table (filled below). */
#include "kernels.h"

void moe_kernels_fill_avx512vnni(moe_type_kernels types[MOE_TYPE_COUNT]) {
    (void)types;
}
