// The row kernel for AVX2 + FMA CPUs: 8 lanes (128 weights) per 256-bit group, 4 tokens per pass.
#pragma GCC target("avx2,fma,f16c")
#define MOET_NS avx2
#define MOET_WIDE 0
#include "rows_body.h"
