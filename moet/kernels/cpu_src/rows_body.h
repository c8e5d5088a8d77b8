// The row kernel, compiled once per ISA (avx512.cpp, avx2.cpp set the target, MOET_NS, MOET_WIDE).
//
// Decode in registers: a 32-bit lane holds 4 code bytes, 16 weights of one 16-weight span (so one
// block scale per lane: nv16 blocks are one lane, mx32 blocks two). Step j shifts the lanes by 2
// and looks their low bits up in {-4, -1, +1, +4} with one permute (it reads only the low index
// bits, so the table repeats every 4 entries and no mask is needed); the values meet the inputs,
// pre-permuted to match (rows.h), in FMAs per token, and each token's per-lane sum is multiplied
// by the lane's block scale once per group. The row scale (and e4m3's 2^8, below) comes last.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "rows.h"
#include "scale.h"

namespace moet_cpu {
namespace MOET_NS {
namespace {

#if MOET_WIDE
using F = __m512;
using I = __m512i;
inline F fzero() { return _mm512_setzero_ps(); }
inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F loadf_broadcast(float v) { return _mm512_set1_ps(v); }
inline void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F lookup(I idx, F table) { return _mm512_permutexvar_ps(idx, table); }
inline I shr2(I v) { return _mm512_srli_epi32(v, 2); }
inline F values() { return _mm512_setr_ps(-4, -1, 1, 4, -4, -1, 1, 4, -4, -1, 1, 4, -4, -1, 1, 4); }
inline I load_lanes(const uint8_t* p, int64_t valid) {
  if (valid == kLanes) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi32(__mmask16((1u << valid) - 1), p);
}
inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
// 16 lane scales from 16 e4m3 bytes: as fp16 bit patterns (exponent bias 15 = 7 + 8), so 2^-8 too small.
inline F e4m3_lanes(const uint8_t* s) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}
// 16 lane scales from 8 UE8M0 bytes (each block spans two lanes): 2^(b-127) as float bits, b = 0 subnormal.
inline F ue8m0_lanes(const uint8_t* s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512()), _mm512_slli_epi32(v, 23),
                                                     _mm512_set1_epi32(0x00400000)));
}
#else
using F = __m256;
using I = __m256i;
inline F fzero() { return _mm256_setzero_ps(); }
inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F loadf_broadcast(float v) { return _mm256_set1_ps(v); }
inline void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F lookup(I idx, F table) { return _mm256_permutevar8x32_ps(table, idx); }
inline I shr2(I v) { return _mm256_srli_epi32(v, 2); }
inline F values() { return _mm256_setr_ps(-4, -1, 1, 4, -4, -1, 1, 4); }
inline I load_lanes(const uint8_t* p, int64_t valid) {
  if (valid == kLanes) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), _mm256_cmpgt_epi32(_mm256_set1_epi32(int(valid)), lane));
}
inline float hsum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline F e4m3_lanes(const uint8_t* s) {
  const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}
inline F ue8m0_lanes(const uint8_t* s) {
  int32_t word;
  memcpy(&word, s, 4);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), _mm_cvtsi32_si128(word)));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(v, 23), _mm256_set1_epi32(0x00400000),
                                                _mm256_cmpeq_epi32(v, _mm256_setzero_si256())));
}
#endif

// The scales of the kLanes lanes from lane l of a row of `lanes` (zero past the row), converted in
// registers as the group is read; e4m3 comes out 2^-8 small. Whole groups read exactly their bytes.
inline F group_scales(const uint8_t* s, int64_t l, int64_t lanes, int64_t block) {
  const int halves = block == 32;  // an mx32 block spans two lanes
  const int64_t count = ((lanes - l < kLanes ? lanes - l : kLanes) + halves) >> halves;
  const uint8_t* p = s + (l >> halves);
  uint8_t tail[kLanes];
  if (count < (kLanes >> halves)) {
    memset(tail, 0, kLanes);
    memcpy(tail, p, count);
    p = tail;
  }
  return block == 16 ? e4m3_lanes(p) : ue8m0_lanes(p);
}

template <int M>
void row_m(const Matrix& w, int64_t e, int64_t n, const float* x, float* out, int64_t ldo) {
  const int64_t lanes = w.cols / 16, stride = padded_cols(w.cols, kLanes);
  const uint8_t* c = w.codes_row(e, n);
  const uint8_t* sb = w.scales_row(e, n);
  constexpr int kChains = M == 1 ? 4 : M < 4 ? 2 : 1;  // independent FMA chains: hide the FMA latency
  const F table = values();
  F acc[M];
  for (int t = 0; t < M; ++t) acc[t] = fzero();
  for (int64_t l = 0; l < lanes; l += kLanes) {
    I v = load_lanes(c + 4 * l, lanes - l < kLanes ? lanes - l : kLanes);
    const float* xg = x + 16 * l;
    F part[kChains][M];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const F wj = lookup(v, table);
      v = shr2(v);
      F* p = part[j % kChains];
#pragma GCC unroll 8
      for (int t = 0; t < M; ++t) p[t] = j < kChains ? mul(wj, loadf(xg + t * stride + j * kLanes))
                                                     : fma(wj, loadf(xg + t * stride + j * kLanes), p[t]);
    }
    for (int c = 1; c < kChains; ++c)
      for (int t = 0; t < M; ++t) part[0][t] = add(part[0][t], part[c][t]);
    const F s = group_scales(sb, l, lanes, w.block);
    for (int t = 0; t < M; ++t) acc[t] = fma(part[0][t], s, acc[t]);
  }
  const float r = w.row_scale_of(e, n) * (w.block == 16 ? 256.0f : 1.0f);
  for (int t = 0; t < M; ++t) out[t * ldo] = hsum(acc[t]) * r;
}

}  // namespace

void row_decode(const Matrix& w, int64_t e, int64_t n, bool row_scale, float* out) {
  const int64_t lanes = w.cols / 16;
  const uint8_t* c = w.codes_row(e, n);
  const uint8_t* sb = w.scales_row(e, n);
  const F r = loadf_broadcast((row_scale ? w.row_scale_of(e, n) : 1.0f) * (w.block == 16 ? 256.0f : 1.0f));
  const F table = values();
  for (int64_t l = 0; l < lanes; l += kLanes) {
    I v = load_lanes(c + 4 * l, lanes - l < kLanes ? lanes - l : kLanes);
    const F s = mul(group_scales(sb, l, lanes, w.block), r);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      storef(out + 16 * l + j * kLanes, mul(lookup(v, table), s));
      v = shr2(v);
    }
  }
}

void row_dot(const Matrix& w, int64_t e, int64_t n, const float* x, int m, float* out, int64_t ldo) {
  switch (m) {
    case 1: return row_m<1>(w, e, n, x, out, ldo);
    case 2: return row_m<2>(w, e, n, x, out, ldo);
    case 3: return row_m<3>(w, e, n, x, out, ldo);
#if MOET_WIDE
    case 4: return row_m<4>(w, e, n, x, out, ldo);
    case 5: return row_m<5>(w, e, n, x, out, ldo);
    case 6: return row_m<6>(w, e, n, x, out, ldo);
    case 7: return row_m<7>(w, e, n, x, out, ldo);
#endif
    default: return row_m<kTokens>(w, e, n, x, out, ldo);
  }
}

}  // namespace MOET_NS
}  // namespace moet_cpu
