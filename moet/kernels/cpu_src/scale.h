// Block-scale bytes to float, by the formats' definitions (moet/quant/scales.py): e4m3 (bias 7,
// subnormals at e = 0) for 16-weight blocks, UE8M0 2^(b-127) for 32-weight blocks. NaN patterns are
// refused when a checkpoint loads, so they are not special-cased. static: each translation unit keeps
// its own copy, compiled for its own ISA.
#pragma once
#include <math.h>
#include <stdint.h>

namespace moet_cpu {

static inline float scale_value(uint8_t b, int64_t block) {
  if (block == 32) return ldexpf(1.0f, int(b) - 127);
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int e = (b >> 3) & 0xF, m = b & 7;
  return e == 0 ? sign * ldexpf(float(m), -9) : sign * ldexpf(1.0f + m / 8.0f, e - 7);
}

}  // namespace moet_cpu
