/* x86_avx512.c: the AVX-512 F/BW/VL/DQ table (8-bit dots with vpmaddubsw + vpmaddwd). The
 * kernels are in x86_avx512.h, shared with x86_avx512vnni.c; this file only picks the build. */
#define MOE_AVX512_VNNI 0
#include "x86_avx512.h"
