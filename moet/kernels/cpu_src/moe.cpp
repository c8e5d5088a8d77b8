// moet_cpu::moe_forward: the routed experts' gate_up -> activation -> down straight from the packed
// 2-bit codes and block scales, for the CPU serving path (moet/kernels/cpu.py).
//
// Pairs (token, slot) are grouped by expert with a counting sort; each expert's rows are computed
// in float32 for a few of its tokens per pass (one decode of a row in registers serves them all),
// the passes of all active experts spread over the intra-op threads; an expert with many tokens
// (prefill) is decoded once and multiplied in one GEMM (in bf16 when the activations are bf16).
// With AVX512-BF16 and bf16 activations both run on VDPBF16PS (bf16.cpp), the many-token experts as
// tasks that the threads take in turn, largest first, so a thread that lost its core delays no one.
// The combine sums the k slots of a token in slot order, so the result does not depend on how
// tokens were grouped or split over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "rows.h"
#include "scale.h"

namespace moet_cpu {
namespace {

// Portable row kernel over inputs in natural order (lanes == 1).
void scalar_row_dot(const Matrix& w, int64_t e, int64_t n, const float* x, int m, float* out, int64_t ldo) {
  static const float kValues[4] = {-4.0f, -1.0f, 1.0f, 4.0f};
  const int64_t nb = w.cols / w.block;
  const uint8_t* c = w.codes_row(e, n);
  const uint8_t* s = w.scales_row(e, n);
  for (int t = 0; t < m; ++t) {
    const float* xt = x + t * w.cols;
    float acc = 0.0f;
    for (int64_t blk = 0; blk < nb; ++blk) {
      float part = 0.0f;
      for (int64_t k = blk * w.block; k < (blk + 1) * w.block; ++k) part += kValues[(c[k / 4] >> (2 * (k % 4))) & 3] * xt[k];
      acc += part * scale_value(s[blk], w.block);
    }
    out[t * ldo] = acc * w.row_scale_of(e, n);
  }
}

void scalar_row_decode(const Matrix& w, int64_t e, int64_t n, bool row_scale, float* out) {
  static const float kValues[4] = {-4.0f, -1.0f, 1.0f, 4.0f};
  const uint8_t* c = w.codes_row(e, n);
  const uint8_t* s = w.scales_row(e, n);
  for (int64_t k = 0; k < w.cols; ++k)
    out[k] = kValues[(c[k / 4] >> (2 * (k % 4))) & 3] * (scale_value(s[k / w.block], w.block) * (row_scale ? w.row_scale_of(e, n) : 1.0f));
}

struct Isa {
  const char* name;
  RowDot row_dot;
  RowDecode row_decode;
  int64_t lanes;   // the input order (rows.h)
  int64_t tokens;  // tokens per pass
  bool bf16;       // has the bf16 paths (avx512bf16 in rows.h)
};

Isa pick_isa(const std::string& want) {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool has_bf16 = has512 && __builtin_cpu_supports("avx512bf16");
  if ((want == "auto" || want == "avx512bf16") && has_bf16)
    return {"avx512bf16", avx512bf16::row_dot, avx512bf16::row_decode, avx512bf16::kLanes, avx512bf16::kTokens, true};
  if ((want == "auto" || want == "avx512") && has512) return {"avx512", avx512::row_dot, avx512::row_decode, avx512::kLanes, avx512::kTokens, false};
  if ((want == "auto" || want == "avx2") && has2) return {"avx2", avx2::row_dot, avx2::row_decode, avx2::kLanes, avx2::kTokens, false};
  if (want == "auto" || want == "scalar") return {"scalar", scalar_row_dot, scalar_row_decode, 1, 8, false};
  TORCH_CHECK(false, "moet_cpu: ISA ", want, " is not available on this CPU");
}

// Where weight k sits in the order of rows.h for `lanes` lanes.
inline int64_t permuted_index(int64_t k, int64_t lanes) {
  const int64_t span = 16 * lanes, g = k / span * span, r = k - g;
  return g + (r % 16) * lanes + r / 16;
}

// x [cols] -> padded_cols(cols, lanes) floats in the order of rows.h (zeros past cols).
void permute_input(const float* x, int64_t cols, int64_t lanes, float* out) {
  const int64_t span = 16 * lanes;
  for (int64_t g = 0; g < padded_cols(cols, lanes); g += span)
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t i = 0; i < lanes; ++i) out[g + j * lanes + i] = g + 16 * i + j < cols ? x[g + 16 * i + j] : 0.0f;
}

float activate(float v, int kind) {
  switch (kind) {
    case 0: return v / (1.0f + std::exp(-v));                           // silu
    case 1: return 0.5f * v * (1.0f + std::erf(v * float(M_SQRT1_2)));  // gelu
    default: {                                                          // gelu_tanh
      const float inner = float(std::sqrt(2.0 / M_PI)) * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + std::tanh(inner));
    }
  }
}

int activation_kind(const std::string& name) {
  if (name == "silu") return 0;
  if (name == "gelu") return 1;
  if (name == "gelu_tanh") return 2;
  TORCH_CHECK(false, "moet_cpu: activation ", name, " is not supported");
}

Matrix matrix(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale, int64_t block) {
  TORCH_CHECK(codes.dtype() == at::kByte && scales.dtype() == at::kByte && row_scale.dtype() == at::kFloat,
              "moet_cpu: codes and scales must be uint8, row scales float32");
  TORCH_CHECK(codes.stride(2) == 1 && codes.stride(1) == codes.size(2) && scales.stride(2) == 1 &&
                  scales.stride(1) == scales.size(2) && row_scale.stride(1) == 1,
              "moet_cpu: each expert's rows must be dense (experts may be strided)");
  const int64_t cols = codes.size(2) * 4;
  TORCH_CHECK(block == 16 || block == 32, "moet_cpu: block must be 16 or 32");
  TORCH_CHECK(cols % block == 0 && scales.size(2) == cols / block,
              "moet_cpu: unsupported width ", cols);
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), row_scale.data_ptr<float>(), codes.size(1), cols, block,
          codes.stride(0), scales.stride(0), row_scale.stride(0)};
}

// A pass: up to the ISA's token count of consecutive grouped pairs of one expert, or (gemm) all of
// an expert's pairs when it has at least kGemmTokens of them.
struct Pass {
  int64_t expert, first;
  int count;
  bool gemm;
};
constexpr int64_t kGemmTokens = 16;
constexpr int64_t kGemmRows = 64;
// Weights a thread's share of a projection must reach before it is split over threads: below it waking
// the team costs more than it saves. The embedded model's decode (786 K weights a layer) is above it: with
// the model in vLLM's engine-core process (moet.serving.server_env) vLLM's own ops keep the team awake, and
// two threads took 23-26 vs 36 µs a layer, served decode 1.07-1.09× BF16 against 0.97-1.05× on one thread.
// (It was 2 M while a worker process busy-polled beside the model and a team member often waited for a time slice.)
constexpr int64_t kWeightsPerThread = 1 << 17;
constexpr int64_t kElementsPerThread = 1 << 18;  // the same for the elementwise steps (permute, activation, combine)
// The bf16 paths (bf16.cpp): an expert with at least kPanelTokens pairs is decoded once into panels,
// below it read by the row kernel (one core of a Zen 5, DeepSeek-like 2048 x 768 experts: 4 pairs an
// expert 19 vs 22 ms a layer for the row kernel, 8 pairs 59 vs 32 ms for the panels; at 256 x 256
// the panels win from 4). An expert with more than kTaskTokens is split into tasks of equal token
// counts, so that two threads share it.
constexpr int64_t kPanelTokens = 6;
constexpr int64_t kTaskTokens = 256;

std::vector<Pass> plan_passes(const std::vector<int64_t>& start, int64_t tokens_per_pass) {
  std::vector<Pass> passes;
  for (size_t e = 0; e + 1 < start.size(); ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count >= kGemmTokens) {
      passes.push_back({int64_t(e), start[e], int(count), true});
      continue;
    }
    for (int64_t first = start[e]; first < start[e + 1]; first += tokens_per_pass)
      passes.push_back({int64_t(e), first, int(std::min<int64_t>(tokens_per_pass, start[e + 1] - first)), false});
  }
  return passes;
}

// Grow-only buffers kept across calls: fresh large allocations are fresh pages, and their faults cost
// more than a decode step's arithmetic. One set per calling thread.
struct Workspace {
  std::vector<float> x13, gate_up, x2, y, decoded, h;
  std::vector<uint16_t> x13b, x2b, gemm;
};
thread_local Workspace workspace;

template <typename T>
T* grown(std::vector<T>& buffer, int64_t size) {
  if (int64_t(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// f(0) .. f(n - 1) over the intra-op threads, each taking the next index when done with one.
template <typename F>
void dynamic_for(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) f(i);
  });
}

// rows[p][n] = row n of the pass's expert · inputs[p] for every row pass and row, over all threads.
void project_rows(const Isa& isa, const Matrix& w, const std::vector<const Pass*>& passes, const float* inputs, float* rows) {
  const int64_t n_rows = w.rows, stride = padded_cols(w.cols, isa.lanes);
  const int64_t grain = std::max<int64_t>(16, kWeightsPerThread / w.cols);
  at::parallel_for(0, int64_t(passes.size()) * n_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Pass& p = *passes[i / n_rows];
      const int64_t n = i % n_rows;
      isa.row_dot(w, p.expert, n, inputs + p.first * stride, p.count, rows + p.first * n_rows + n, n_rows);
    }
  });
}

// The same for one gemm pass, in the calling thread: its expert decoded once, one GEMM, in bf16 when
// `bf16` (the activations are bf16: AMX / AVX512-BF16 through oneDNN, as vLLM's BF16 experts;
// products exact, the GEMM's output rounded to bf16), the row scales applied to its float32 result.
void project_gemm(const Isa& isa, const Matrix& w, const Pass& p, const float* inputs, float* rows, bool bf16) {
  const int64_t n_rows = w.rows, stride = padded_cols(w.cols, isa.lanes);
  float* d = grown(workspace.decoded, n_rows * stride);
  for (int64_t n = 0; n < n_rows; ++n) isa.row_decode(w, p.expert, n, !bf16, d + n * stride);
  const at::Tensor decoded = at::from_blob(d, {n_rows, stride}, at::kFloat);
  const at::Tensor x = at::from_blob(const_cast<float*>(inputs) + p.first * stride, {p.count, stride}, at::kFloat);
  at::Tensor y = at::from_blob(rows + p.first * n_rows, {p.count, n_rows}, at::kFloat);
  if (bf16) {
    // Token counts rounded up to kGemmRows: oneDNN JIT-compiles a kernel per GEMM shape, and
    // prefill chunks give every expert a different count (a compile is ~ms, the GEMM ~0.1 ms).
    const int64_t padded = (p.count + kGemmRows - 1) / kGemmRows * kGemmRows;
    at::Tensor xb = at::zeros({padded, stride}, at::kBFloat16);
    xb.narrow(0, 0, p.count).copy_(x);
    y.copy_(at::mm(xb, decoded.to(at::kBFloat16).t()).narrow(0, 0, p.count));
    y.mul_(at::from_blob(const_cast<float*>(w.row_scale) + p.expert * w.row_scale_e, {n_rows}, at::kFloat));
  } else {
    at::mm_out(y, x, decoded.t());
  }
}

// The experts' products y [pairs, hidden] in float32 row passes and GEMM passes (bf16 GEMMs through
// oneDNN when the activations are bf16): every ISA.
void fp32_experts(const Isa& isa, const Matrix& w13, const Matrix& w2, const std::vector<int64_t>& start,
                  const std::vector<int64_t>& token_of, const float* xs, bool bf16, int act, float* y) {
  const int64_t hidden = w13.cols, inter = w13.rows / 2, pairs = start.back();
  const std::vector<Pass> passes = plan_passes(start, isa.tokens);
  std::vector<const Pass*> row_passes, gemm_passes;
  for (const Pass& p : passes) (p.gemm ? gemm_passes : row_passes).push_back(&p);
  const int64_t s13 = padded_cols(hidden, isa.lanes), s2 = padded_cols(inter, isa.lanes);
  float* x13 = grown(workspace.x13, pairs * s13);
  float* gate_up = grown(workspace.gate_up, pairs * w13.rows);
  float* x2 = grown(workspace.x2, pairs * s2);
  const auto inputs = [&](const Pass& p) {
    for (int64_t q = p.first; q < p.first + p.count; ++q) permute_input(xs + token_of[q] * hidden, hidden, isa.lanes, x13 + q * s13);
  };
  const auto hidden_inputs = [&](const Pass& p) {
    std::vector<float> h(inter);
    for (int64_t q = p.first; q < p.first + p.count; ++q) {
      const float* gu = gate_up + q * w13.rows;
      for (int64_t i = 0; i < inter; ++i) h[i] = activate(gu[i], act) * gu[inter + i];
      permute_input(h.data(), inter, isa.lanes, x2 + q * s2);
    }
  };
  // Many-token experts (prefill): one task each, start to end, so the layer waits at one barrier;
  // ATen ops inside a parallel region run single-threaded. On shared cores every barrier can cost a
  // time slice, which is why the few-token passes below keep theirs to the two projections.
  at::parallel_for(0, int64_t(gemm_passes.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      inputs(*gemm_passes[g]);
      project_gemm(isa, w13, *gemm_passes[g], x13, gate_up, bf16);
      hidden_inputs(*gemm_passes[g]);
      project_gemm(isa, w2, *gemm_passes[g], x2, y, bf16);
    }
  });
  if (!row_passes.empty()) {
    const int64_t grain = std::max<int64_t>(1, kElementsPerThread / (isa.tokens * hidden));
    at::parallel_for(0, int64_t(row_passes.size()), grain, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) inputs(*row_passes[i]); });
    project_rows(isa, w13, row_passes, x13, gate_up);
    at::parallel_for(0, int64_t(row_passes.size()), grain, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) hidden_inputs(*row_passes[i]); });
    project_rows(isa, w2, row_passes, x2, y);
  }
}

// The same through the bf16 paths (bf16.cpp), one task per expert or expert chunk from start to end
// (panels for many tokens, the bf16 row kernel in passes of kTokens for few), taken by the threads in
// turn, largest first: the layer waits at one barrier before the combine. Below kWeightsPerThread
// of weights per thread (the embedded model's decode) the calling thread runs them all.
void bf16_experts(const Matrix& w13, const Matrix& w2, const std::vector<int64_t>& start, const std::vector<int64_t>& token_of,
                  const at::Tensor& x, const float* xs, int act, float* y) {
  const int64_t hidden = w13.cols, inter = w13.rows / 2;
  const at::Tensor xb = x.contiguous();
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(xb.data_ptr<c10::BFloat16>());
  std::vector<Pass> tasks;
  int64_t weights = 0;
  for (size_t e = 0; e + 1 < start.size(); ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    weights += (w13.rows * w13.cols + w2.rows * w2.cols) * ((count + avx512bf16::kTokens - 1) / avx512bf16::kTokens);
    const int64_t chunks = (count + kTaskTokens - 1) / kTaskTokens;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = start[e] + count * c / chunks, next = start[e] + count * (c + 1) / chunks;
      tasks.push_back({int64_t(e), first, int(next - first), count >= kPanelTokens});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Pass& a, const Pass& b) { return a.count > b.count; });
  const int64_t b13 = padded_cols(hidden, avx512bf16::kLanes), b2 = padded_cols(inter, avx512bf16::kLanes);
  const auto run = [&](int64_t i) {
    const Pass& p = tasks[i];
    if (p.gemm) {
      uint16_t* work = grown(workspace.gemm, avx512bf16::expert_gemm_work(w13, w2, p.count));
      avx512bf16::expert_gemm(w13, w2, p.expert, xh, token_of.data() + p.first, p.count, act, y + p.first * hidden, hidden, work);
      return;
    }
    uint16_t* x13 = grown(workspace.x13b, avx512bf16::kTokens * b13);
    uint16_t* x2 = grown(workspace.x2b, avx512bf16::kTokens * b2);
    float* gate_up = grown(workspace.gate_up, avx512bf16::kTokens * w13.rows);
    float* h = grown(workspace.h, inter);
    for (int64_t first = p.first; first < p.first + p.count; first += avx512bf16::kTokens) {
      const int m = int(std::min<int64_t>(avx512bf16::kTokens, p.first + p.count - first));
      for (int t = 0; t < m; ++t) avx512bf16::permute_bf16(xs + token_of[first + t] * hidden, hidden, x13 + t * b13);
      avx512bf16::expert_rows_bf16(w13, p.expert, x13, m, gate_up, w13.rows);
      for (int t = 0; t < m; ++t) {
        avx512bf16::gated_hidden(gate_up + t * w13.rows, inter, act, h);
        avx512bf16::permute_bf16(h, inter, x2 + t * b2);
      }
      avx512bf16::expert_rows_bf16(w2, p.expert, x2, m, y + first * hidden, hidden);
    }
  };
  if (weights < 2 * kWeightsPerThread || at::get_num_threads() == 1) {
    for (int64_t i = 0; i < int64_t(tasks.size()); ++i) run(i);
  } else {
    dynamic_for(int64_t(tasks.size()), run);
  }
}

at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       const std::optional<at::Tensor>& present, const at::Tensor& w13_codes, const at::Tensor& w13_scales,
                       const at::Tensor& w13_row_scale, const at::Tensor& w2_codes, const at::Tensor& w2_scales,
                       const at::Tensor& w2_row_scale, int64_t block, const std::string& activation, const std::string& isa_name) {
  const Isa isa = pick_isa(isa_name);
  const int act = activation_kind(activation);
  const Matrix w13 = matrix(w13_codes, w13_scales, w13_row_scale, block);
  const Matrix w2 = matrix(w2_codes, w2_scales, w2_row_scale, block);
  const int64_t tokens = x.size(0), hidden = x.size(1), k = topk_ids.size(1), experts = w13_codes.size(0);
  const int64_t inter = w13.rows / 2;
  TORCH_CHECK(w13.cols == hidden && w13.rows == 2 * inter && w2.rows == hidden && w2.cols == inter && w2_codes.size(0) == experts,
              "moet_cpu: weight shapes do not match x");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor here = present.has_value() ? present->to(at::kBool).contiguous() : at::Tensor();
  const int64_t* id = ids.data_ptr<int64_t>();
  const bool* ok = here.defined() ? here.data_ptr<bool>() : nullptr;

  // Counting sort of the valid pairs by expert, stable in pair order.
  std::vector<int64_t> start(experts + 1, 0), pos(tokens * k, -1);
  for (int64_t p = 0; p < tokens * k; ++p)
    if (id[p] >= 0 && id[p] < experts && (ok == nullptr || ok[id[p]])) ++start[id[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  const int64_t pairs = start[experts];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), token_of(pairs);
  for (int64_t p = 0; p < tokens * k; ++p)
    if (id[p] >= 0 && id[p] < experts && (ok == nullptr || ok[id[p]])) {
      pos[p] = fill[id[p]]++;
      token_of[pos[p]] = p / k;
    }
  const float* xs = xf.data_ptr<float>();
  float* y = grown(workspace.y, pairs * hidden);
  if (bf16 && isa.bf16) {
    bf16_experts(w13, w2, start, token_of, x, xs, act, y);
  } else {
    fp32_experts(isa, w13, w2, start, token_of, xs, bf16, act, y);
  }

  // Combine in slot order, written straight in x's dtype (no zero fill, no second pass to convert).
  at::Tensor out = at::empty({tokens, hidden}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* wt = wts.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kElementsPerThread / (k * hidden)), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t q = pos[t * k + j];
        if (q < 0) continue;
        for (int64_t c = 0; c < hidden; ++c) acc[c] += wt[t * k + j] * y[q * hidden + c];
      }
      if (bf16) {
        c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + t * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] = c10::BFloat16(acc[c]);
      } else {
        std::copy(acc.begin(), acc.end(), out.data_ptr<float>() + t * hidden);
      }
    }
  });
  return out.to(x.scalar_type());
}

std::string isa(const std::string& want) { return pick_isa(want).name; }

// float32 [E, rows, cols] of the 2-bit weights as the kernel decodes them (row_decode, natural order):
// what the tests compare bit for bit with the float64 definitions, for every scale byte and ISA.
at::Tensor decode(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale, int64_t block,
                  const std::string& isa_name) {
  const Isa isa = pick_isa(isa_name);
  const Matrix w = matrix(codes, scales, row_scale, block);
  const int64_t experts = codes.size(0), stride = padded_cols(w.cols, isa.lanes);
  at::Tensor out = at::empty({experts, w.rows, w.cols}, at::kFloat);
  float* o = out.data_ptr<float>();
  std::vector<float> row(stride);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t n = 0; n < w.rows; ++n) {
      isa.row_decode(w, e, n, true, row.data());
      for (int64_t k = 0; k < w.cols; ++k) o[(e * w.rows + n) * w.cols + k] = row[permuted_index(k, isa.lanes)];
    }
  return out;
}

// The same as the bf16 prefill panels hold them (AVX512-BF16 only): the tests' view of decode_panel.
at::Tensor decode_bf16(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale, int64_t block) {
  TORCH_CHECK(pick_isa("auto").bf16, "moet_cpu: this CPU has no AVX512-BF16");
  const Matrix w = matrix(codes, scales, row_scale, block);
  at::Tensor out = at::empty({codes.size(0), w.rows, w.cols}, at::kFloat);
  std::vector<uint16_t> work(17 * w.cols);
  for (int64_t e = 0; e < codes.size(0); ++e)
    for (int64_t n0 = 0; n0 < w.rows; n0 += 16) avx512bf16::panel_rows(w, e, n0, out.data_ptr<float>() + (e * w.rows + n0) * w.cols, work.data());
  return out;
}

}  // namespace
}  // namespace moet_cpu

TORCH_LIBRARY(moet_cpu, m) {
  m.def("moe_forward(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor? present, Tensor w13_codes, Tensor w13_scales, "
        "Tensor w13_row_scale, Tensor w2_codes, Tensor w2_scales, Tensor w2_row_scale, int block, str activation, "
        "str isa) -> Tensor");
  m.def("isa(str want) -> str", &moet_cpu::isa);
  m.def("decode(Tensor codes, Tensor scales, Tensor row_scale, int block, str isa) -> Tensor", &moet_cpu::decode);
  m.def("decode_bf16(Tensor codes, Tensor scales, Tensor row_scale, int block) -> Tensor", &moet_cpu::decode_bf16);
  m.impl("moe_forward", c10::DispatchKey::CPU, TORCH_FN(moet_cpu::moe_forward));
}
