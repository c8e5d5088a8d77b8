// The decode kernels' weight load (moe_decode.cu), shared with the read-pattern tool (scripts/read_pattern.cu), which
// times plain reads made with it: 16 bytes a lane, through the read-only path, not kept in L1.
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
