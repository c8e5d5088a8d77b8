// The row kernel for AVX-512 (F, BW, VL) CPUs: 16 lanes (256 weights) per 512-bit group, 8 tokens per pass.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define MOET_NS avx512
#define MOET_WIDE 1
#include "rows_body.h"
