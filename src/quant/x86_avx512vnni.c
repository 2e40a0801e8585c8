/* x86_avx512vnni.c: the AVX-512 VNNI (+VBMI) table: the kernels of x86_avx512.h with
 * vpdpbusd / vpdpwssd as their multiply-accumulates. */
#define MOE_AVX512_VNNI 1
#include "x86_avx512.h"
