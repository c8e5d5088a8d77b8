// One projection of the 2-bit experts as the row kernels read it, and the row kernels' entry points.
// Plain C types only: the ISA-specific translation units include this and nothing from torch or the
// standard library, so no inline function compiled for AVX-512 can be picked by the linker for others.
#pragma once
#include <stdint.h>

namespace moet_cpu {

// Stacked codes uint8 [E, rows, cols/4] (code of k at bits 2*(k%4)), block scales uint8
// [E, rows, cols/block] (e4m3 when block == 16, UE8M0 when block == 32), row scales float [E, rows].
struct Matrix {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* row_scale;
  int64_t rows, cols, block;
  // Elements from one expert to the next: rows are dense within an expert, but the experts of the
  // device cache are strided views over its slot buffer (one pack row per slot).
  int64_t codes_e, scales_e, row_scale_e;
  const uint8_t* codes_row(int64_t e, int64_t n) const { return codes + e * codes_e + n * (cols / 4); }
  const uint8_t* scales_row(int64_t e, int64_t n) const { return scales + e * scales_e + n * (cols / block); }
  float row_scale_of(int64_t e, int64_t n) const { return row_scale[e * row_scale_e + n]; }
};

// The inputs' order for a kernel of `lanes` 32-bit lanes: a lane holds 4 code bytes = 16 weights,
// a group `lanes` of them; element g*16*lanes + j*lanes + i of a row is x[g*16*lanes + 16*i + j]
// (zero past cols), so step j of a group reads one unit-stride vector. lanes == 1: natural order.
inline int64_t padded_cols(int64_t cols, int64_t lanes) { return (cols + 16 * lanes - 1) / (16 * lanes) * (16 * lanes); }

// out[t * ldo] = row n of expert e (decoded, both scales) · x[t * padded_cols(cols, lanes) ...] for
// t < m ≤ the ISA's token count per pass, x in that ISA's order.
using RowDot = void (*)(const Matrix& w, int64_t e, int64_t n, const float* x, int m, float* out, int64_t ldo);
// out[padded_cols(cols, lanes)] = row n of expert e, decoded with its block scales (and the row scale
// when `row_scale`), in the ISA's input order: for prefill, where one GEMM over many tokens beats
// decoding the row once per pass.
using RowDecode = void (*)(const Matrix& w, int64_t e, int64_t n, bool row_scale, float* out);

namespace avx512 {
constexpr int kLanes = 16, kTokens = 8;
void row_dot(const Matrix&, int64_t, int64_t, const float*, int, float*, int64_t);
void row_decode(const Matrix&, int64_t, int64_t, bool, float*);
}  // namespace avx512
// AVX-512 with AVX512-BF16 (bf16.cpp): the AVX-512 row kernels, and for bf16 inputs:
namespace avx512bf16 {
constexpr int kLanes = 16, kTokens = 8;
void row_dot(const Matrix&, int64_t, int64_t, const float*, int, float*, int64_t);
void row_decode(const Matrix&, int64_t, int64_t, bool, float*);
// out[t * ldo + n] = row n of expert e (decoded, both scales) · x[t * padded_cols(cols, 16) ...] for every row
// n and t < m ≤ kTokens, x bf16 in the bf16 row order: element g*256 + j*32 + 2*l + h of a row is
// x[g*256 + 16*l + j + 8*h] (zero past cols). One token takes four rows at a time.
void expert_rows_bf16(const Matrix& w, int64_t e, const uint16_t* x, int m, float* out, int64_t ldo);
// h[i] = act(gate_up[i]) * gate_up[inter + i], i < inter, in float32 vectors (act as for expert_gemm).
void gated_hidden(const float* gate_up, int64_t inter, int act, float* h);
// x [cols] float -> that order, rounded to bf16.
void permute_bf16(const float* x, int64_t cols, uint16_t* out);
// One expert's whole pipeline for `count` tokens: y[q * ldy + n] (q < count) = down(act(gate) * up) of
// bf16 row x[tokens[q] * cols] (natural order), before the routing weight. act: 0 silu, 1 gelu,
// 2 gelu_tanh. work: expert_gemm_work(...) uint16 of scratch.
void expert_gemm(const Matrix& w13, const Matrix& w2, int64_t e, const uint16_t* x, const int64_t* tokens, int64_t count,
                 int act, float* y, int64_t ldy, uint16_t* work);
// Rows n0 .. n0 + 15 (< rows) [16, cols] float as the panels hold them, times the row scales in float32,
// as the GEMM applies them: for the tests. work: 17 * cols uint16.
void panel_rows(const Matrix& w, int64_t e, int64_t n0, float* out, uint16_t* work);
inline int64_t expert_gemm_work(const Matrix& w13, const Matrix& w2, int64_t count) {
  const int64_t widest = w13.cols > w2.cols ? w13.cols : w2.cols;
  return 33 * widest + count * (w13.rows / 2);  // two panels (16 words per weight pair), scales; h
}
}  // namespace avx512bf16
namespace avx2 {
constexpr int kLanes = 8, kTokens = 4;
void row_dot(const Matrix&, int64_t, int64_t, const float*, int, float*, int64_t);
void row_decode(const Matrix&, int64_t, int64_t, bool, float*);
}  // namespace avx2

}  // namespace moet_cpu
