// The bf16 paths for AVX-512 CPUs with AVX512-BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later),
// taken when x is bf16 (the served dtype): the 2-bit weights, decoded to bf16, meet the bf16 inputs in
// VDPBF16PS, 32 products per instruction, summed in float32. The decoded values (±1/±4 × the block
// scale) are exact in bf16 and so are the products: against the float32 kernel only the hidden
// activations entering the down projection are rounded (to bf16, as vLLM's BF16 experts round them).
//
// Decode (few tokens per expert): the row kernel of rows_body.h with step j pairing weights j and j+8
// of each lane's 16-weight span, looked up from the codes by one word permute.
// Prefill (many tokens per expert): each 16-row block of an expert is decoded once into a VNNI panel
// (weight pairs of 16 rows per 64 bytes, block scales folded in by exponent arithmetic) and
// multiplied with up to 12 tokens at a time, their input pairs broadcast: no horizontal sums, and the
// gate and up blocks of the same rows meet in one tile, so the activation is applied in registers.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define MOET_NS avx512bf16
#define MOET_WIDE 1
#include "rows_body.h"

namespace moet_cpu {
namespace avx512bf16 {
namespace {

// bf16 of −4, −1, +1, +4 by code, repeated over the 32 words a word permute indexes with 5 bits.
inline __m512i code_values() { return _mm512_set1_epi64(0x40803F80BF80C080LL); }
// What adding to a bf16 scale's bits multiplies it by, by code: −4 (sign, exponent + 2), −1, +1, +4.
inline __m512i code_deltas() { return _mm512_set1_epi64(0x0100000080008100LL); }

inline uint16_t bf16_bits(float v) {  // round to nearest even (NaN is never fed)
  uint32_t u;
  memcpy(&u, &v, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// A block scale as bf16 bits (exact: e4m3 and UE8M0 values have at most 4 significant bits), by the
// definitions of scale.h; zero, −0 and the subnormal UE8M0 2^-127 become 0, so that the exponent
// arithmetic of decode_panel holds.
inline uint16_t scale_bits(uint8_t b, int64_t block) {
  if (block == 32) return uint16_t(b << 7);
  const int e = (b >> 3) & 0xF, m = b & 7;
  const uint16_t sign = uint16_t((b & 0x80) << 8);
  if (e != 0) return uint16_t(sign | (e + 120) << 7 | m << 4);
  return m == 0 ? 0 : uint16_t(sign | bf16_bits(float(m) * (1.0f / 512)));
}

// Rows n .. n + R - 1 of expert e · M tokens (x rows padded_cols apart; out[t * ldo + r]). The rows share each
// input load, two accumulator chains per product hide VDPBF16PS's latency while there are at most four
// products a step, and each row's codes and scales are prefetched at the same place of the next R rows.
// Decode takes four rows × one token: one core, T = 1, 4.25 vs 4.5 ms a Qwen3-235B-shaped layer (one row at a
// time, prefetching along the row), 35 vs 47 µs an embedded-model layer; a few tokens take one row × M.
template <int R, int M>
void rows_bf16(const Matrix& w, int64_t e, int64_t n, const uint16_t* x, float* out, int64_t ldo) {
  constexpr int kChains = R * M <= 4 ? 2 : 1;
  const int64_t lanes = w.cols / 16, stride = padded_cols(w.cols, kLanes);
  const uint8_t* c[R];
  const uint8_t* sb[R];
  for (int r = 0; r < R; ++r) c[r] = w.codes_row(e, n + r), sb[r] = w.scales_row(e, n + r);
  const __m512i table = code_values();
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < M; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t l = 0; l < lanes; l += kLanes) {
    const int64_t valid = lanes - l < kLanes ? lanes - l : kLanes;
    __m512i v[R];
    __m512 part[R][M][kChains];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c[r] + 4 * l + R * (w.cols / 4)), _MM_HINT_T0);
      if (l % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(sb[r] + (l >> (w.block == 32)) + R * (w.cols / w.block)), _MM_HINT_T0);
      v[r] = load_lanes(c[r] + 4 * l, valid);
      for (int t = 0; t < M; ++t)
        for (int ch = 0; ch < kChains; ++ch) part[r][t][ch] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512bh xv[M];
#pragma GCC unroll 8
      for (int t = 0; t < M; ++t) xv[t] = (__m512bh)_mm512_loadu_si512(x + t * stride + 16 * l + j * 32);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh wj = (__m512bh)_mm512_permutexvar_epi16(v[r], table);
        v[r] = _mm512_srli_epi16(v[r], 2);
#pragma GCC unroll 8
        for (int t = 0; t < M; ++t) part[r][t][j % kChains] = _mm512_dpbf16_ps(part[r][t][j % kChains], wj, xv[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = group_scales(sb[r], l, lanes, w.block);
      for (int t = 0; t < M; ++t) {
        for (int ch = 1; ch < kChains; ++ch) part[r][t][0] = _mm512_add_ps(part[r][t][0], part[r][t][ch]);
        acc[r][t] = _mm512_fmadd_ps(part[r][t][0], s, acc[r][t]);
      }
    }
  }
  const float e4m3 = w.block == 16 ? 256.0f : 1.0f;
  for (int r = 0; r < R; ++r) {
    const float rs = w.row_scale_of(e, n + r) * e4m3;
    for (int t = 0; t < M; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]) * rs;
  }
}

// panel[p * 16 + r] = the bf16 pair (w[n0 + r][2p], w[n0 + r][2p + 1]) with its block scale; rows at
// or past `limit` are zeros. One gather takes a 16-weight span of codes from each of the 16 rows; the
// rows' scales (bf16 bits from `table`, by byte) are first laid side by side in scales_t.
void decode_panel(const Matrix& w, int64_t e, int64_t n0, int64_t limit, const uint16_t* table, uint32_t* panel, uint16_t* scales_t) {
  const int64_t spans = w.cols / 16, blocks = w.cols / w.block, shift = w.block == 32 ? 1 : 0;
  const __mmask16 rows = limit - n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (limit - n0)) - 1);
  for (int64_t r = 0; r < 16; ++r) {
    if (n0 + r < limit) {
      const uint8_t* s = w.scales_row(e, n0 + r);
      for (int64_t b = 0; b < blocks; ++b) scales_t[b * 16 + r] = table[s[b]];
    } else {
      for (int64_t b = 0; b < blocks; ++b) scales_t[b * 16 + r] = 0;
    }
  }
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(int(w.cols / 4)));
  const uint8_t* codes = w.codes_row(e, n0);
  const __m512i deltas = code_deltas();
  for (int64_t q = 0; q < spans; ++q) {
    if (q % 16 == 0)  // the next line of each row: 16 rows 16 lines apart defeat the hardware prefetchers
      for (int64_t r = 0; r < 16 && n0 + r < limit; ++r) _mm_prefetch(reinterpret_cast<const char*>(codes + r * (w.cols / 4) + 4 * q + 64), _MM_HINT_T0);
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, offsets, codes + 4 * q, 1);
    const __m512i s16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales_t + (q >> shift) * 16)));
    const __m512i s = _mm512_or_si512(s16, _mm512_slli_epi32(s16, 16));
    const __mmask32 nonzero = _mm512_test_epi16_mask(s, s);
    // Word pairs (code 2j, code 2j+1) of each lane at the low bits after a shift by 4j: weights 0-7
    // from the low code word, 8-15 from the high one.
    const __m512i lo = _mm512_mask_blend_epi16(0xAAAAAAAAu, v, _mm512_slli_epi32(v, 14));
    const __m512i hi = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(v, 16), _mm512_srli_epi32(v, 2));
    uint32_t* out = panel + q * 8 * 16;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_si512(out + j * 16, _mm512_maskz_add_epi16(nonzero, s, _mm512_permutexvar_epi16(_mm512_srli_epi16(lo, 4 * j), deltas)));
      _mm512_storeu_si512(out + (j + 4) * 16, _mm512_maskz_add_epi16(nonzero, s, _mm512_permutexvar_epi16(_mm512_srli_epi16(hi, 4 * j), deltas)));
    }
  }
}

constexpr int kTile = 12;  // tokens per tile: 2 × 12 accumulators + 2 weight vectors + 1 broadcast of 32 registers

// a[t] = panel_a · x_t, b[t] = panel_b · x_t over `pairs` input pairs, 16 rows each.
template <int M>
void tile(const uint32_t* pa, const uint32_t* pb, int64_t pairs, const uint16_t* const* xs, __m512* a_out, __m512* b_out) {
  __m512 a[M], b[M];
  for (int t = 0; t < M; ++t) a[t] = b[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh wa = (__m512bh)_mm512_loadu_si512(pa + 16 * p);
    const __m512bh wb = (__m512bh)_mm512_loadu_si512(pb + 16 * p);
#pragma GCC unroll 12
    for (int t = 0; t < M; ++t) {
      int32_t pair;
      memcpy(&pair, xs[t] + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      a[t] = _mm512_dpbf16_ps(a[t], wa, xv);
      b[t] = _mm512_dpbf16_ps(b[t], wb, xv);
    }
  }
  for (int t = 0; t < M; ++t) a_out[t] = a[t], b_out[t] = b[t];
}

void tile_any(int m, const uint32_t* pa, const uint32_t* pb, int64_t pairs, const uint16_t* const* xs, __m512* a, __m512* b) {
  switch (m) {
    case 1: return tile<1>(pa, pb, pairs, xs, a, b);
    case 2: return tile<2>(pa, pb, pairs, xs, a, b);
    case 3: return tile<3>(pa, pb, pairs, xs, a, b);
    case 4: return tile<4>(pa, pb, pairs, xs, a, b);
    case 5: return tile<5>(pa, pb, pairs, xs, a, b);
    case 6: return tile<6>(pa, pb, pairs, xs, a, b);
    case 7: return tile<7>(pa, pb, pairs, xs, a, b);
    case 8: return tile<8>(pa, pb, pairs, xs, a, b);
    case 9: return tile<9>(pa, pb, pairs, xs, a, b);
    case 10: return tile<10>(pa, pb, pairs, xs, a, b);
    case 11: return tile<11>(pa, pb, pairs, xs, a, b);
    default: return tile<kTile>(pa, pb, pairs, xs, a, b);
  }
}

// e^x to ~2 ulp for silu: x = n ln2 + r, |r| ≤ ln2 / 2, degree-6 Taylor polynomial, scaled by 2^n.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 gated(__m512 g, __m512 u, int act) {
  if (act == 0) return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
  float gs[16], us[16];
  _mm512_storeu_ps(gs, g);
  _mm512_storeu_ps(us, u);
  for (int i = 0; i < 16; ++i) {
    const float v = gs[i];
    gs[i] = act == 1 ? 0.5f * v * (1.0f + erff(v * 0.70710678f)) : 0.5f * v * (1.0f + tanhf(0.79788456f * (v + 0.044715f * v * v * v)));
    gs[i] *= us[i];
  }
  return _mm512_loadu_ps(gs);
}

inline __mmask16 rows_mask(int64_t n0, int64_t limit) {
  const int64_t valid = limit - n0;
  return valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
}

}  // namespace

void expert_rows_bf16(const Matrix& w, int64_t e, const uint16_t* x, int m, float* out, int64_t ldo) {
  if (m == 1) {  // rows come in 16s: the hidden size and twice the expert width are both whole blocks of columns
    for (int64_t n = 0; n < w.rows; n += 4) rows_bf16<4, 1>(w, e, n, x, out + n, ldo);
    return;
  }
  for (int64_t n = 0; n < w.rows; ++n) {
    switch (m) {
      case 2: rows_bf16<1, 2>(w, e, n, x, out + n, ldo); break;
      case 3: rows_bf16<1, 3>(w, e, n, x, out + n, ldo); break;
      case 4: rows_bf16<1, 4>(w, e, n, x, out + n, ldo); break;
      case 5: rows_bf16<1, 5>(w, e, n, x, out + n, ldo); break;
      case 6: rows_bf16<1, 6>(w, e, n, x, out + n, ldo); break;
      case 7: rows_bf16<1, 7>(w, e, n, x, out + n, ldo); break;
      default: rows_bf16<1, kTokens>(w, e, n, x, out + n, ldo);
    }
  }
}

void gated_hidden(const float* gate_up, int64_t inter, int act, float* h) {
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = rows_mask(i, inter);
    _mm512_mask_storeu_ps(h + i, m, gated(_mm512_maskz_loadu_ps(m, gate_up + i), _mm512_maskz_loadu_ps(m, gate_up + inter + i), act));
  }
}

void permute_bf16(const float* x, int64_t cols, uint16_t* out) {
  for (int64_t g = 0; g < padded_cols(cols, kLanes); g += 256)
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t l = 0; l < 16; ++l)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t k = g + 16 * l + j + 8 * h;
          out[g + j * 32 + 2 * l + h] = k < cols ? bf16_bits(x[k]) : 0;
        }
}

void panel_rows(const Matrix& w, int64_t e, int64_t n0, float* out, uint16_t* work) {
  uint16_t table[256];
  for (int b = 0; b < 256; ++b) table[b] = scale_bits(uint8_t(b), w.block);
  uint32_t* panel = reinterpret_cast<uint32_t*>(work);
  decode_panel(w, e, n0, w.rows, table, panel, work + w.cols * 16);
  for (int64_t r = 0; r < 16 && n0 + r < w.rows; ++r)
    for (int64_t k = 0; k < w.cols; ++k) {
      const uint32_t bits = uint32_t(reinterpret_cast<const uint16_t*>(panel + k / 2 * 16 + r)[k % 2]) << 16;
      float v;
      memcpy(&v, &bits, 4);
      out[r * w.cols + k] = v * w.row_scale_of(e, n0 + r);
    }
}

void expert_gemm(const Matrix& w13, const Matrix& w2, int64_t e, const uint16_t* x, const int64_t* tokens, int64_t count,
                 int act, float* y, int64_t ldy, uint16_t* work) {
  const int64_t hidden = w13.cols, inter = w13.rows / 2;
  const int64_t widest = w13.cols > w2.cols ? w13.cols : w2.cols;
  uint32_t* pa = reinterpret_cast<uint32_t*>(work);
  uint32_t* pb = pa + widest / 2 * 16;
  uint16_t* scales_t = reinterpret_cast<uint16_t*>(pb + widest / 2 * 16);
  uint16_t* h = scales_t + widest;
  uint16_t table13[256], table2[256];
  for (int b = 0; b < 256; ++b) table13[b] = scale_bits(uint8_t(b), w13.block), table2[b] = scale_bits(uint8_t(b), w2.block);
  const uint16_t* xs[kTile];
  __m512 a[kTile], b[kTile];
  // gate rows i0.. and up rows inter + i0.. in one tile; h = act(gate) · up, in bf16 for the down GEMM.
  for (int64_t i0 = 0; i0 < inter; i0 += 16) {
    decode_panel(w13, e, i0, inter, table13, pa, scales_t);
    decode_panel(w13, e, inter + i0, 2 * inter, table13, pb, scales_t);
    const __mmask16 mask = rows_mask(i0, inter);
    const __m512 rg = _mm512_maskz_loadu_ps(mask, w13.row_scale + e * w13.row_scale_e + i0);
    const __m512 ru = _mm512_maskz_loadu_ps(mask, w13.row_scale + e * w13.row_scale_e + inter + i0);
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
      const int m = count - t0 < kTile ? int(count - t0) : kTile;
      for (int t = 0; t < m; ++t) xs[t] = x + tokens[t0 + t] * hidden;
      tile_any(m, pa, pb, hidden / 2, xs, a, b);
      for (int t = 0; t < m; ++t) {
        const __m512 hv = gated(_mm512_mul_ps(a[t], rg), _mm512_mul_ps(b[t], ru), act);
        _mm256_mask_storeu_epi16(h + (t0 + t) * inter + i0, mask, (__m256i)_mm512_cvtneps_pbh(hv));
      }
    }
  }
  for (int64_t n0 = 0; n0 < w2.rows; n0 += 32) {
    decode_panel(w2, e, n0, w2.rows, table2, pa, scales_t);
    decode_panel(w2, e, n0 + 16, w2.rows, table2, pb, scales_t);
    const __mmask16 ma = rows_mask(n0, w2.rows), mb = n0 + 16 < w2.rows ? rows_mask(n0 + 16, w2.rows) : __mmask16(0);
    const __m512 ra = _mm512_maskz_loadu_ps(ma, w2.row_scale + e * w2.row_scale_e + n0);
    const __m512 rb = _mm512_maskz_loadu_ps(mb, w2.row_scale + e * w2.row_scale_e + n0 + 16);
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
      const int m = count - t0 < kTile ? int(count - t0) : kTile;
      for (int t = 0; t < m; ++t) xs[t] = h + (t0 + t) * inter;
      tile_any(m, pa, pb, inter / 2, xs, a, b);
      for (int t = 0; t < m; ++t) {
        float* yt = y + (t0 + t) * ldy + n0;
        _mm512_mask_storeu_ps(yt, ma, _mm512_mul_ps(a[t], ra));
        _mm512_mask_storeu_ps(yt + 16, mb, _mm512_mul_ps(b[t], rb));
      }
    }
  }
}

}  // namespace avx512bf16
}  // namespace moet_cpu
