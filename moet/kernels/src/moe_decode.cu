// moet decode MoE GEMMs (few tokens per expert) over the 2-bit base and FP4 copies, mixed per expert, CUDA C++.
//
// Why not Triton: decode is the cost of reading the experts' bytes, and a read-speed kernel must
// keep its decoded weights in registers in the tensor-core operand layout, with no shared-memory
// trip or barrier per K step. Triton cannot place a decoded tensor in a chosen register layout.
//
// Tiers: FMT 0 the 2-bit base, 1 an FP4 copy. A per-expert slot table (or none: all base) names, for
// each expert, the pool slot holding its FP4 copy (-1: none); each block reads its expert's table entry
// and runs the base or the FP4 body, with its own tuning, in the same launch.
// One warp owns 16 weight rows (the MMA's M side) for the whole K of one expert and streams their
// bytes through a register ring of RING chunks (128 k each, 512 B per warp for the 2-bit base);
// tokens are the MMA's N side (8 per n-tile), so one decode token still runs on mma.sync with f32
// accumulation. The k order inside a chunk is permuted (docs/KERNELS.md, "Decode layout"): lane
// (g, t) holds rows g and g+8 for the 32 consecutive k 32t..32t+31 of the chunk, so its B operand
// is one contiguous 64-byte run of the token's activation row, and its mx32 block scale is one per
// row per chunk. Scales are applied to the decoded bf16 pairs (exact: the codes are ±1/±4 and
// e2m1, the scales powers of two or e4m3), the row scale in f32 in the epilogue.
//
// STAGE 13 rows come in 16-row blocks of 8 gate rows + the matching 8 up rows, so SiLU(gate)·up is
// computed in registers and written as bf16 activations per (token, slot) pair. STAGE 2 writes f32
// rows per pair times the routing weight; the combine adds the k slots in a fixed order.
//
// Grid: (T·k pairs, row blocks / WARPS) for a decode step's few tokens: a block whose pair's expert was named by an
// earlier pair exits; the others serve every token routed to their expert. Past that (many tokens), one block per
// pass: the pairs sorted by expert in runs padded to PASS_ROWS (moe_pass_grid, below), so an expert that takes
// many tokens spreads its passes over as many blocks. The GEMMs use no atomics; nothing synchronises with the host.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "load_stream.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int MAX_ROWS = 128;  // pairs of its expert a block gathers at a time (an expert with more takes more segments)
// Pairs a pass holds: one n-tile (the MMA's 8 columns) at every token count; an expert with more takes more passes.
// The layer took 0.79-0.98 of the time of two n-tiles at 9-64 tokens and 0.52-0.87 of four at 128-2,048 (H100
// 2026-12-06, docs/KERNELS.md "Decode: one n-tile at every token count"): a pass's MMAs and activation loads scale with
// its n-tiles, the tokens per expert rarely fill them, and four cost registers (two blocks per SM).
constexpr int PASS_ROWS = 8;

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;  // fma with -0 keeps an exact product's sign of zero; subnormal inputs are kept
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// e4m3 block scale byte (16-weight blocks) → f32.
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

// f32 (exactly representable in bf16) → the bf16 pair (f, f).
__device__ __forceinline__ uint32_t bf16_pair(float f) {
  uint32_t hi = __float_as_uint(f) >> 16;
  return hi | (hi << 16);
}

// Pair P of a 2-bit base word as bf16 bits, plus `e`: a bf16 pair holding only an exponent field E in each half.
// Weight 2P+h keeps its "big" bit at P+1 and its sign at P+8 (+16h) for P < 7, at bits 0 and 15 (+16h) for P = 7
// (moet.kernels.layout), so a mask and one multiply-add move them to bits 8 and 15 of its half: the product is
// ±2^(E-127) or, with the big bit carried into the exponent, ±2^(E-125). The multiply-add is written as PTX mad
// so that ptxas can keep it on the FMA pipe (an IMAD) and off the ALU pipe, which the rotate-and-mask decode of the
// earlier layout filled (docs/KERNELS.md, "Decode: the bit layout").
template <int P>
__device__ __forceinline__ uint32_t base_pair(uint32_t w, uint32_t e) {
  uint32_t v;
  if constexpr (P < 7) {
    constexpr uint32_t MASK = ((1u << (P + 1)) | (1u << (P + 8))) * 0x00010001u;
    asm("{ .reg .b32 t; and.b32 t, %1, %2; mad.lo.u32 %0, t, %3, %4; }"
        : "=r"(v) : "r"(w), "n"(MASK), "n"(1u << (7 - P)), "r"(e));
  } else {
    asm("{ .reg .b32 t, u; and.b32 t, %1, 0x00010001; lop3.b32 u, %1, 0x80008000, %2, 0xEA; mad.lo.u32 %0, t, 256, u; }"
        : "=r"(v) : "r"(w), "r"(e));
  }
  return v;
}

// 2-bit base word → 8 bf16 pairs, ±2/±8 times the pair's scale (pair p = 4·s + r of the word's two k16 steps s;
// r & 1 selects row g+8). UE8M0 scales are added as exponent fields (scale pairs with PRE = 1: ×2), e4m3 ones
// multiply pairs decoded at ±2/±8.
template <int SCALE_B>
__device__ __forceinline__ void decode_base(uint32_t w, uint32_t s_lo, uint32_t s_hi, uint32_t (&a)[8]) {
  const uint32_t e_lo = SCALE_B == 32 ? s_lo : 0x40004000u, e_hi = SCALE_B == 32 ? s_hi : 0x40004000u;
  a[0] = base_pair<0>(w, e_lo);
  a[1] = base_pair<1>(w, e_hi);
  a[2] = base_pair<2>(w, e_lo);
  a[3] = base_pair<3>(w, e_hi);
  a[4] = base_pair<4>(w, e_lo);
  a[5] = base_pair<5>(w, e_hi);
  a[6] = base_pair<6>(w, e_lo);
  a[7] = base_pair<7>(w, e_hi);
  if constexpr (SCALE_B != 32) {
#pragma unroll
    for (int p = 0; p < 8; ++p) a[p] = mul_bf16x2(a[p], (p & 1) ? s_hi : s_lo);
  }
}

// FP4 word (one k16 step: 4 pairs) → 4 bf16 pairs. Pair r's e2m1 exponent+mantissa fields sit at bits
// 3r..3r+2 (+16 for the high half) and its signs at 12+r (+16); the pair's bf16 bits are then
// e2m1·2^-126 (sign 15, fields 8..6), and the scale carries 2^63 so that products are normal.
__device__ __forceinline__ void decode_fp4(uint32_t q, uint32_t s_lo, uint32_t s_hi, uint32_t* a) {
  const uint32_t F = 0x01C001C0u, S = 0x80008000u;
  uint32_t q3 = q << 3;
  a[0] = mul_bf16x2(((q << 6) & F) | (q3 & S), s_lo);
  a[1] = mul_bf16x2((q3 & F) | ((q << 2) & S), s_hi);
  a[2] = mul_bf16x2((q & F) | ((q << 1) & S), s_lo);
  a[3] = mul_bf16x2(((q >> 3) & F) | (q & S), s_hi);
}

// Per-chunk bytes of one lane: base 16 B (4 words), FP4 32 B (8 words).
template <int FMT> struct Chunk;
template <> struct Chunk<0> { uint4 w; };
template <> struct Chunk<1> { uint4 w0, w1; };

// p: this lane's words of the chunk.
template <int FMT>
__device__ __forceinline__ Chunk<FMT> load_chunk(const uint4* p) {
  Chunk<FMT> c;
  if constexpr (FMT == 0) {
    c.w = load_stream(p);
  } else {
    c.w0 = load_stream(p);
    c.w1 = load_stream(p + 1);
  }
  return c;
}

}  // namespace

template <int SCALE_B>
__device__ __forceinline__ uint32_t load_scale(const uint8_t* p) {
  return SCALE_B == 32 ? *reinterpret_cast<const uint16_t*>(p) : *reinterpret_cast<const uint32_t*>(p);
}

// Scale pairs of one chunk × 2^PRE: rows g (lo) and g+8 (hi); with 16-blocks, k16 steps 0-3 and 4-7 differ.
// A UE8M0 byte b is already bf16's exponent field (both biased by 127), so its pair is (b + PRE)·0x00800080: an
// IMAD instead of the shifts and masks of a float conversion, off the integer pipe that the decode fills. Exact
// while b + PRE ≤ 254 (b + 3 for the base's big weights); b = 0 gives 0 with PRE = 0 (and, with PRE = 63, products
// below bf16's smallest subnormal: 0 too).
template <int SCALE_B, int PRE>
__device__ __forceinline__ void scale_pairs(uint32_t sc, uint32_t (&s_lo)[2], uint32_t (&s_hi)[2]) {
  if constexpr (SCALE_B == 32) {
    s_lo[0] = s_lo[1] = ((sc & 0xFF) + PRE) * 0x00800080u;
    s_hi[0] = s_hi[1] = ((sc >> 8) + PRE) * 0x00800080u;
  } else {
    const float pre = __uint_as_float((127u + PRE) << 23);
    s_lo[0] = bf16_pair(e4m3_value(sc & 0xFF) * pre);
    s_lo[1] = bf16_pair(e4m3_value((sc >> 8) & 0xFF) * pre);
    s_hi[0] = bf16_pair(e4m3_value((sc >> 16) & 0xFF) * pre);
    s_hi[1] = bf16_pair(e4m3_value(sc >> 24) * pre);
  }
}

// The pairs this block's expert serves, from its `skip`-th on, at most MAX_ROWS: every (token, slot) pair
// routed to it, in pair order, into s_rows (activation row) and s_pairs. One load per lane reads 32 pairs, and
// LOADS such loads are in flight before the first is tested, so a decode step's few pairs take one round trip
// (a loop over the k slots took k dependent ones) and, with LOADS 4, T = 64's 512 pairs four, not sixteen (one
// load in flight made T = 64 4-8% slower; four made T = 1 and 4 1-2% slower; H100 2026-12-06, docs/KERNELS.md
// "Decode: the gather's loads in flight"). -1 when an earlier pair named the same expert (that block serves them).
// A token naming the expert twice is served twice: callers map cache misses and other ranks' experts to a
// zero-weight pair on a valid expert, often the same one. Warp 0 only.
template <int STAGE, int LOADS>
__device__ __forceinline__ int gather_served(const int* __restrict__ topk_ids, int expert, int T, int TOPK, int skip,
                                             int* s_rows, int* s_pairs) {
  const int lane = threadIdx.x & 31, pair0 = blockIdx.x, pairs = T * TOPK;
  int count = 0;
  for (int r0 = 0; r0 < pairs; r0 += 32 * LOADS) {
    int ids[LOADS];  // loaded before any is tested
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      const int j = r0 + 32 * u + lane;
      ids[u] = j < pairs ? topk_ids[j] : -1;
    }
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      const int j0 = r0 + 32 * u, j = j0 + lane;
      const bool mine = ids[u] == expert;
      const unsigned hit = __ballot_sync(0xffffffffu, mine);
      if (j0 < pair0 && (hit & (pair0 - j0 >= 32 ? ~0u : (1u << (pair0 - j0)) - 1))) return -1;
      const int pos = count + __popc(hit & ((1u << lane) - 1)) - skip;
      if (mine && pos >= 0 && pos < MAX_ROWS) {
        s_pairs[pos] = j;
        s_rows[pos] = STAGE == 13 ? j / TOPK : j;
      }
      count += __popc(hit);
    }
  }
  return max(0, min(count - skip, MAX_ROWS));
}

// The pairs of this block's pass in the pass grid: pass_ids (PASS_ROWS of align's sorted pair ids) holds its expert's
// pairs, then pairs ≥ T·k (padding), into s_rows and s_pairs as gather_served. Warp 0 only.
template <int STAGE>
__device__ __forceinline__ int gather_pass(const int* __restrict__ pass_ids, int T, int TOPK, int* s_rows,
                                           int* s_pairs) {
  const int lane = threadIdx.x & 31;
  const int j = lane < PASS_ROWS ? pass_ids[lane] : T * TOPK;
  const bool mine = j < T * TOPK;
  if (mine) {
    s_pairs[lane] = j;
    s_rows[lane] = STAGE == 13 ? j / TOPK : j;
  }
  return __popc(__ballot_sync(0xffffffffu, mine));
}

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// x: bf16 activations, row stride K (STAGE 13: [T, K] tokens; STAGE 2: [T·k, K] pairs).
// words: the chunks [N/16][K/128] of 32 lanes × (16 B base | 32 B FP4) of this block's expert (base)
// or of its FP4 slot. scales: the expert's [N/16][K/128][32 lanes] of 2 bytes (rows g, g+8; SCALE_B 32)
// or 4 bytes (SCALE_B 16: row g blocks 2t, 2t+1, then row g+8); rs: its f32 row scales [N] in checkpoint
// row order (both tiers share them). out: STAGE 13 bf16 [T·k, N/2]; STAGE 2 f32 [T·k, N].
// pass_grid 0: topk_ids is the routing and the block gathers its expert's pairs from it (gather_served); 1: topk_ids
// points at the block's pass in align's sorted pair ids (gather_pass). One pointer for both, so the pass grid adds no
// register to the loop.
// Tuning: RING chunks in flight per row block and warp; BLOCKS 16-row blocks per warp (they share the
// activation loads); KSPLIT warps of the block share one row block, each a contiguous K range, and
// add their sums through shared memory in a fixed order; XAHEAD (the activations) 0: loaded per chunk,
// 1: loaded a chunk early, 2: copied (cp.async) into shared memory for the whole K at the start of a
// pass, so that the only register loads of the loop are the weights' (waiting on a younger activation
// load would also wait on the older weight loads in flight), 3: staged as 2, and a 2-bit ring refilled by
// halves (H, below) from a prologue that requests only its first half. Modes 2 and 3 take dynamic shared memory
// of min(T, cap) · (2K + 16) bytes, cap ≤ PASS_ROWS the host's (moet.kernels.cuda.pass_cap). The k16 step pairs q
// of a chunk go to 4 / BLOCKS accumulators, so that consecutive MMAs rarely wait on each other. In the pair grid a
// block serves its expert's tokens PASS_ROWS (staged: cap) at a time (several passes only past that many); in the
// pass grid it runs one pass (staged: cut into passes of cap).
// Not inlined: each body then gets its own register allocation (inlined side by side in one kernel, the
// default pair spilled 8 bytes at 128 registers).
template <int FMT, int SCALE_B, int STAGE, int RING, int BLOCKS, int KSPLIT, int XAHEAD, bool STREAM>
__device__ __noinline__ void moe_decode(const __nv_bfloat16* __restrict__ x, void* __restrict__ out,
                                           const uint4* __restrict__ words, const uint8_t* __restrict__ scales,
                                           const float* __restrict__ rs, const float* __restrict__ topk_w, int N,
                                           int K, const int* __restrict__ topk_ids, int expert, int T, int TOPK,
                                           int pass_grid, int seq, int cap, int* s_rows, int* s_pairs,
                                           int* s_count, uint8_t* s_x) {
  static_assert(!STREAM || (BLOCKS == 1 && KSPLIT == 1), "a warp's row blocks in sequence stream one K range each");
  constexpr int CHAINS = 4 / BLOCKS;  // independent accumulators per row block (by k16 step pair q)
  constexpr int ACC = BLOCKS * 4;  // accumulator floats per lane after adding the chains
  __shared__ float s_partial[KSPLIT > 1 ? WARPS : 1][ACC][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int KC = K / 128;
  const int ks = warp % KSPLIT;  // this warp's K range: chunks [c_begin, c_end)
  const int c_begin = ks * KC / KSPLIT, c_end = (ks + 1) * KC / KSPLIT, chunks = c_end - c_begin;
  constexpr int CHUNK_U4 = FMT == 1 ? 64 : 32;  // uint4 of words per chunk per warp
  constexpr int LANE_U4 = CHUNK_U4 / 32;
  constexpr int SCALE_BYTES = SCALE_B == 32 ? 2 : 4;
  // the FP4 pairs' scales carry 2^63 (see decode_fp4); UE8M0 base pairs take the scale's exponent + 1 (decode_base)
  constexpr int PRE = FMT == 1 ? 63 : SCALE_B == 32 ? 1 : 0;
  const float post = FMT == 0 ? 0.5f : 9.223372036854775808e18f;
  // STREAM: this warp's row blocks block[0] .. + `rows` - 1 (at most seq; none past the expert's N / 16), one after
  // another, whose chunks follow each other in words
  if (!STREAM) seq = 1;
  int block[BLOCKS];
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) block[b] = ((blockIdx.y * (WARPS / KSPLIT) + warp / KSPLIT) * BLOCKS + b) * seq;
  const int rows = STREAM ? max(0, min(seq, N / 16 - block[0])) : 1;
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
    // the epilogue's row scales, fetched now: they are the stage's last DRAM read, after its one wave's loop
    for (int s = 0; s < rows; ++s) {
      const int row = STAGE == 13 ? (block[b] + s) * 8 + g : (block[b] + s) * 16 + g, other = STAGE == 13 ? N / 2 : 8;
      prefetch_l1(rs + row);
      prefetch_l1(rs + row + other);
    }
  }
  constexpr bool STAGED = XAHEAD >= 2;
  // With activations staged in shared memory a 2-bit ring of eight (or any ring with XAHEAD 3) refills a half at a
  // time, after the first chunk of each half (whose decode has waited for its words): every ring load shares one
  // scoreboard (the SASS), so a wait is a wait for all loads in flight, and a slot refilled right after its decode
  // made the next chunk wait for that youngest load. The half refilled there (free: decoded in the previous half) is
  // first read at the next half. Measured on an H100 (2026-12-05 16:26, docs/KERNELS.md): 5-6% faster for the ring of
  // eight; 3-7% slower with activations loaded from global memory (their own scoreboards wait too), for a ring of
  // four and for FP4, which keep refilling each slot right after its decode. XAHEAD 3's prologue (FILL, the first
  // half) lets every warp of a one-wave grid start decoding after half the bytes (H100 2026-12-07, docs/KERNELS.md
  // "Decode: a ring of six by halves in the one-wave grid": the six-blocks-per-SM pick 7% faster; the staged pick's
  // ring of eight at T = 4, several waves, 12-13% slower that way).
  constexpr int H = FMT == 0 && (XAHEAD == 3 || (XAHEAD == 2 && RING >= 8)) ? RING / 2 : 1;
  constexpr int FILL = XAHEAD == 3 && H > 1 ? H : RING;  // chunks the prologue requests
  static_assert(H == 1 || RING == 2 * H, "a ring refilled by halves has an even depth");
  // The ring streams the warp's row blocks as one run of rows · chunks chunks (the host asks chunks % RING == 0, so
  // that chunk c of the run sits in slot c % RING).
  const int stream = rows * chunks;
  Chunk<FMT> ring[RING][BLOCKS];
  uint32_t sring[RING][BLOCKS];
  const uint4* wnext[BLOCKS];  // this lane's words (scales) of chunk c + RING, at chunk c
  const uint8_t* snext[BLOCKS];
  auto fill_ring = [&]() {  // chunks c_begin .. c_begin + FILL - 1
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
      const size_t chunk0 = static_cast<size_t>(block[b]) * KC + c_begin;
      const uint4* wp = words + chunk0 * CHUNK_U4 + lane * LANE_U4;
      const uint8_t* sp = scales + (chunk0 * 32 + lane) * SCALE_BYTES;
#pragma unroll
      for (int d = 0; d < FILL; ++d)
        if (d < stream) {
          ring[d][b] = load_chunk<FMT>(wp + d * CHUNK_U4);
          sring[d][b] = load_scale<SCALE_B>(sp + d * 32 * SCALE_BYTES);
        }
      wnext[b] = wp + RING * CHUNK_U4;
      snext[b] = sp + RING * 32 * SCALE_BYTES;
    }
  };
  // A decode step's few pairs (one gather round, so few duplicate blocks) with staged activations: the ring fills
  // while warp 0 gathers them. Not for the other tunings: with a ring held across the gather, the six-blocks-per-SM
  // pick at 80 registers, then activations from global memory and a ring of four, ran 4-10% slower at T = 1 (H100,
  // 2026-12-06, docs/KERNELS.md "Decode: the prologue"); staged (XAHEAD 3) it holds the first half of its ring.
  bool ring_full = STAGED && !pass_grid && T * TOPK <= 32;
  if (ring_full) fill_ring();

  for (int skip = 0;; skip += MAX_ROWS) {  // the expert's pairs, MAX_ROWS at a time
    if (threadIdx.x < 32) {
      // loads in flight (see gather_served): one where one load covers every pair (a decode step's few)
      const int count = pass_grid          ? gather_pass<STAGE>(topk_ids, T, TOPK, s_rows, s_pairs)
                        : T * TOPK <= 32 ? gather_served<STAGE, 1>(topk_ids, expert, T, TOPK, skip, s_rows, s_pairs)
                                         : gather_served<STAGE, 4>(topk_ids, expert, T, TOPK, skip, s_rows, s_pairs);
      if (threadIdx.x == 0) *s_count = count;
    }
    __syncthreads();
    const int served = *s_count;
    if (served <= 0) return;
    // Staged rows fill the min(T, cap) the host sized (moet.kernels.cuda.staged_bytes): more pairs than that (more of
    // the step's tokens than cap, or a token naming the expert in several slots) take more passes, each reading the
    // expert's rows again.
    const int pass_rows = STAGED ? min(T, max(1, min(cap, PASS_ROWS))) : PASS_ROWS;
    for (int first = 0; first < served; first += pass_rows) {
      const int count = min(served - first, pass_rows);
      if (!ring_full) fill_ring();
      ring_full = false;
      // Stage 2 may start while stage 13 drains (programmatic dependent launch, moet.kernels.cuda): its weights
      // are in flight before it waits for stage 13's activations.
      if constexpr (STAGE == 2) asm volatile("griddepcontrol.wait;" ::: "memory");
      const int x_stride = 2 * K + 16;  // bytes per staged row (the 16 spread the rows over the banks)
      if (STAGED) {
        if (first > 0) __syncthreads();  // every warp is done with the previous pass's rows
        // In the pair grid every block stages the same few rows (a decode step's tokens), so they come through L1
        // (.ca), shared by the SM's blocks, and L2 serves each of their lines once an SM, not once a block; in the pass
        // grid each block stages its own pass's rows, through L2 only (.cg). H100 2026-12-07 (docs/KERNELS.md, "Decode:
        // the staged rows through L1"): Kimi-K2 T = 1 5-6% faster, DeepSeek-V4-Flash T = 4 1-2%; at T = 64 .ca was
        // 0-4% slower.
        for (int v = threadIdx.x; v < count * (K / 8); v += WARPS * 32) {
          const int i = v / (K / 8), k8 = v % (K / 8);
          const __nv_bfloat16* src = x + static_cast<size_t>(s_rows[first + i]) * K + 8 * k8;
          const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(s_x + i * x_stride + 16 * k8));
          if (pass_grid)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
          else
            asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
      }
      // This lane's activations of chunk c_begin as the n-tile's column g; a padding column reads the last served
      // token again (its products are never stored).
      const int x_row = min(g, count - 1);
      const uint4* const x_first =
          STAGED ? reinterpret_cast<const uint4*>(s_x + x_row * x_stride) + (c_begin * 128 + 32 * t) / 8
                 : reinterpret_cast<const uint4*>(x + static_cast<size_t>(s_rows[first + x_row]) * K + c_begin * 128 + 32 * t);

      if (STAGED) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
      }
#pragma unroll 1
      for (int s = 0; s < rows; ++s) {  // row block block[b] + s: chunks s · chunks .. of the stream
        const uint4* xp = x_first;
        float acc[BLOCKS * CHAINS][4];
    #pragma unroll
        for (int a = 0; a < BLOCKS * CHAINS; ++a) acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = 0.f;
        uint4 xa[4];
        if (XAHEAD == 1) {
    #pragma unroll
          for (int q = 0; q < 4; ++q) xa[q] = __ldg(xp + q);
        }

        for (int c0 = 0; c0 < chunks; c0 += RING) {
    #pragma unroll
          for (int d = 0; d < RING; ++d) {
            const int c = s * chunks + c0 + d;  // in the stream
            if (c0 + d >= chunks) break;
            uint4 xc[4];
    #pragma unroll
            for (int q = 0; q < 4; ++q) {
              if (XAHEAD == 1) {
                xc[q] = xa[q];
                if (c0 + d + 1 < chunks) xa[q] = __ldg(xp + 16 + q);
              } else if (STAGED) {
                xc[q] = xp[q];
              } else {
                xc[q] = __ldg(xp + q);
              }
            }
            xp += 16;
    #pragma unroll
            for (int b = 0; b < BLOCKS; ++b) {
              uint32_t s_lo[2], s_hi[2];
              scale_pairs<SCALE_B, PRE>(sring[d][b], s_lo, s_hi);
              // MMAs of k16 step pair q: pairs a[0..3] (step 2q) and a[4..7] (step 2q+1) against its activations
              auto multiply = [&](int q, const uint32_t (&a)[8]) {
                float (&ac)[4] = acc[b * CHAINS + q % CHAINS];
                mma_bf16(ac, a[0], a[1], a[2], a[3], xc[q].x, xc[q].y);
                mma_bf16(ac, a[4], a[5], a[6], a[7], xc[q].z, xc[q].w);
              };
              auto refill = [&](int slot, int ahead) {  // slot takes the chunk `ahead` chunks past c + RING
                if (c + RING + ahead < stream) {
                  ring[slot][b] = load_chunk<FMT>(wnext[b] + ahead * CHUNK_U4);
                  sring[slot][b] = load_scale<SCALE_B>(snext[b] + ahead * 32 * SCALE_BYTES);
                }
              };
              auto refill_half = [&]() {
                if (H > 1 && d % H == 0 && (d > 0 || c >= H || FILL < RING)) {
    #pragma unroll
                  for (int e = 0; e < H; ++e) refill((d + RING - H + e) % RING, e - H);
                }
              };
              {
                uint32_t a[4][8];  // decode the whole chunk, refill its slot (H = 1), multiply, refill a half (H > 1)
                if constexpr (FMT == 0) {
                  const uint4 w = ring[d][b].w;
                  decode_base<SCALE_B>(w.x, s_lo[0], s_hi[0], a[0]);
                  decode_base<SCALE_B>(w.y, s_lo[0], s_hi[0], a[1]);
                  decode_base<SCALE_B>(w.z, s_lo[1], s_hi[1], a[2]);
                  decode_base<SCALE_B>(w.w, s_lo[1], s_hi[1], a[3]);
                } else {  // FP4: word s is k16 step s
                  const uint4 w0 = ring[d][b].w0, w1 = ring[d][b].w1;
                  decode_fp4(w0.x, s_lo[0], s_hi[0], a[0]);
                  decode_fp4(w0.y, s_lo[0], s_hi[0], a[0] + 4);
                  decode_fp4(w0.z, s_lo[0], s_hi[0], a[1]);
                  decode_fp4(w0.w, s_lo[0], s_hi[0], a[1] + 4);
                  decode_fp4(w1.x, s_lo[1], s_hi[1], a[2]);
                  decode_fp4(w1.y, s_lo[1], s_hi[1], a[2] + 4);
                  decode_fp4(w1.z, s_lo[1], s_hi[1], a[3]);
                  decode_fp4(w1.w, s_lo[1], s_hi[1], a[3] + 4);
                }
                if constexpr (H <= 1) refill(d, 0);
    #pragma unroll
                for (int q = 0; q < 4; ++q) multiply(q, a[q]);
              }
              refill_half();
              wnext[b] += CHUNK_U4;
              snext[b] += 32 * SCALE_BYTES;
            }
          }
        }

        // This warp's sums (the chains added), then the K slices of the row block added in order.
        float sum[BLOCKS][4];
    #pragma unroll
        for (int b = 0; b < BLOCKS; ++b)
    #pragma unroll
          for (int e = 0; e < 4; ++e) {
            sum[b][e] = acc[b * CHAINS][e];
    #pragma unroll
            for (int j = 1; j < CHAINS; ++j) sum[b][e] += acc[b * CHAINS + j][e];
          }
        bool writer = true;
        if constexpr (KSPLIT > 1) {
          float* mine = &s_partial[warp][0][lane];
    #pragma unroll
          for (int b = 0; b < BLOCKS; ++b)
    #pragma unroll
            for (int e = 0; e < 4; ++e) mine[(b * 4 + e) * 32] = sum[b][e];
          __syncthreads();
          writer = ks == 0;
          if (writer) {
    #pragma unroll
            for (int j = 1; j < KSPLIT; ++j) {
              const float* theirs = &s_partial[warp + j][0][lane];
    #pragma unroll
              for (int b = 0; b < BLOCKS; ++b)
    #pragma unroll
                for (int e = 0; e < 4; ++e) sum[b][e] += theirs[(b * 4 + e) * 32];
            }
          }
          __syncthreads();  // s_partial is reused by the next pass
        }

        // Epilogue. sum[b][0..1]: row g, the pass's tokens 2t, 2t+1; sum[b][2..3]: row g+8.
        if (writer) {
    #pragma unroll
          for (int b = 0; b < BLOCKS; ++b) {
            if constexpr (STAGE == 13) {
              const int inter = N / 2, col = (block[b] + s) * 8 + g;  // gate row col, up row inter + col
              const float gate_scale = rs[col] * post, up_scale = rs[inter + col] * post;
              __nv_bfloat16* act = static_cast<__nv_bfloat16*>(out);
    #pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int r = 2 * t + h;
                if (r < count) {
                  float gate = sum[b][h] * gate_scale, up = sum[b][2 + h] * up_scale;
                  act[static_cast<size_t>(s_pairs[first + r]) * inter + col] =
                      __float2bfloat16(gate / (1.f + __expf(-gate)) * up);
                }
              }
            } else {
              const int row = (block[b] + s) * 16 + g;
              const float lo_scale = rs[row] * post, hi_scale = rs[row + 8] * post;
              float* o = static_cast<float*>(out);
    #pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int r = 2 * t + h;
                if (r < count) {
                  int pair = s_pairs[first + r];
                  float w = topk_w[pair];
                  float* dst = o + static_cast<size_t>(pair) * N + row;
                  dst[0] = sum[b][h] * lo_scale * w;
                  dst[8] = sum[b][2 + h] * hi_scale * w;
                }
              }
            }
          }
        }
      }
    }
    if (served < MAX_ROWS) return;
    __syncthreads();  // every warp is done with this segment's rows (and staged activations)
  }
}

// extern "C" entry points, one per specialisation, each with both bodies:
// moe_decode_b<scale block>_w<stage>_<base tuning>_<FP4 tuning>[_o<OCC>][_s], a tuning
// r<RING>b<BLOCKS>k<KSPLIT>x<XAHEAD>. The two tunings cover the same rows per block (16·BLOCKS·WARPS/KSPLIT), so the
// grid fits both. OCC: blocks per SM asked of ptxas (4 when the name has no _o part), which caps the registers per
// thread at 65536 / (128 · OCC). seq: row blocks a warp of an _s entry point streams (ignored by the others). cap:
// the activation rows a staged pass holds (1 to PASS_ROWS; the halves that load from global memory ignore it).
// slots: int32 [E] (the expert's FP4 slot or -1), or null for the base everywhere; fp4: the pool's slots.
// sorted_ids, block_expert, n_padded: moet.kernels.glue.align's with PASS_ROWS-pair blocks (the pass grid), or null
// (the pair grid).
template <int SB, int STAGE, int BR, int BB, int BK, int BX, int FR, int FB, int FK, int FX, bool STREAM>
__device__ __forceinline__ void moe_decode_mixed(const __nv_bfloat16* x, void* out, const uint4* words,
                                                 const uint4* fp4, const int* slots, const uint8_t* scales,
                                                 const float* row_scale, const int* topk_ids, const float* topk_w,
                                                 const int* sorted_ids, const int* block_expert, const int* n_padded,
                                                 int T, int TOPK, int N, int K, int seq, int cap) {
  static_assert(BB * WARPS / BK == FB * WARPS / FK, "both tunings must cover the same rows per block");
  __shared__ int s_rows[MAX_ROWS];   // activation row of each served token
  __shared__ int s_pairs[MAX_ROWS];  // its (token, slot) pair
  __shared__ int s_count;
  extern __shared__ __align__(16) uint8_t s_x[];  // XAHEAD 2, 3: the pass's activation rows, stride 2K + 16
  asm volatile("griddepcontrol.launch_dependents;");  // the next launch (stage 2, the combine) may start its prologue
  const int pass_grid = sorted_ids != nullptr;
  if (pass_grid && static_cast<int>(blockIdx.x) * PASS_ROWS >= *n_padded) return;  // an idle pass
  const int expert = pass_grid ? block_expert[blockIdx.x] : topk_ids[blockIdx.x];
  const int* ids = pass_grid ? sorted_ids + blockIdx.x * PASS_ROWS : topk_ids;  // what the block gathers from
  const int slot = slots == nullptr ? -1 : slots[expert];
  const size_t chunks = static_cast<size_t>(N / 16) * (K / 128);  // per expert
  const uint8_t* sc = scales + static_cast<size_t>(expert) * chunks * 32 * (SB == 32 ? 2 : 4);
  const float* rs = row_scale + static_cast<size_t>(expert) * N;
  if (slot >= 0)
    moe_decode<1, SB, STAGE, FR, FB, FK, FX, STREAM>(x, out, fp4 + static_cast<size_t>(slot) * chunks * 64, sc, rs,
                                                     topk_w, N, K, ids, expert, T, TOPK, pass_grid, seq, cap,
                                                     s_rows, s_pairs, &s_count, s_x);
  else
    moe_decode<0, SB, STAGE, BR, BB, BK, BX, STREAM>(x, out, words + static_cast<size_t>(expert) * chunks * 32, sc, rs,
                                                     topk_w, N, K, ids, expert, T, TOPK, pass_grid, seq, cap,
                                                     s_rows, s_pairs, &s_count, s_x);
}

#define MOET_DECODE(SB, STAGE, BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX)                               \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, OCC)                                                   \
      moe_decode_b##SB##_w##STAGE##_r##BR##b##BB##k##BK##x##BX##_r##FR##b##FB##k##FK##x##FX##SUFFIX(               \
          const __nv_bfloat16* x, void* out, const uint4* words, const uint4* fp4, const int* slots,               \
          const uint8_t* scales, const float* row_scale, const int* topk_ids, const float* topk_w,                 \
          const int* sorted_ids, const int* block_expert, const int* n_padded, int T, int TOPK, int N, int K,      \
          int seq, int cap) {                                                                                      \
    moe_decode_mixed<SB, STAGE, BR, BB, BK, BX, FR, FB, FK, FX, STREAM>(                                          \
        x, out, words, fp4, slots, scales, row_scale, topk_ids, topk_w, sorted_ids, block_expert, n_padded, T,    \
        TOPK, N, K, seq, cap);                                                                                     \
  }
#define MOET_DECODE_ALL_OCC(BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX) \
  MOET_DECODE(32, 13, BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX)       \
  MOET_DECODE(32, 2, BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX)        \
  MOET_DECODE(16, 13, BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX)       \
  MOET_DECODE(16, 2, BR, BB, BK, BX, FR, FB, FK, FX, OCC, STREAM, SUFFIX)
#define MOET_DECODE_ALL(BR, BB, BK, BX, FR, FB, FK, FX) MOET_DECODE_ALL_OCC(BR, BB, BK, BX, FR, FB, FK, FX, 4, false, )

// The pairs moet.kernels.cuda.TUNINGS names: the default (the fastest measured per tier on the H200,
// 2026-12-02), then each sweep tuning for both tiers with the same bytes in flight (an FP4 chunk is
// twice a base chunk: half the ring).
MOET_DECODE_ALL(8, 1, 1, 0, 2, 2, 2, 1)
MOET_DECODE_ALL(8, 1, 1, 0, 4, 1, 1, 0)
MOET_DECODE_ALL(8, 1, 1, 1, 4, 1, 1, 1)
MOET_DECODE_ALL(8, 1, 2, 0, 4, 1, 2, 0)
MOET_DECODE_ALL(4, 1, 1, 1, 2, 1, 1, 1)
MOET_DECODE_ALL(4, 2, 1, 1, 2, 2, 1, 1)
MOET_DECODE_ALL(4, 2, 2, 1, 2, 2, 2, 1)
MOET_DECODE_ALL(8, 1, 1, 2, 4, 1, 1, 2)
MOET_DECODE_ALL(4, 2, 2, 2, 2, 2, 2, 2)
// More resident warps where a stage's grid fits one wave of them (moet.kernels.cuda.WIDE_TUNING): K split over
// two warps at 80 registers, six blocks per SM, the 2-bit body's activations staged and its ring of six refilled by
// halves from a half-filled prologue (XAHEAD 3), the FP4 body's activations from global memory. Measured and dropped
// (H100, 2026-12-05, docs/KERNELS.md): ring 6 at six blocks, activations staged at six blocks (both with a full
// prologue and a slot refilled after each decode), K split over two or four warps at eight blocks, ring 4 at eight;
// 2026-12-07: rings of four and eight by halves (1-2% and 20% slower: eight spill at 80 registers), the FP4 body
// staged (1.5-2% slower).
MOET_DECODE_ALL_OCC(6, 1, 2, 3, 2, 1, 2, 0, 6, false, _o6)
// The staged pair with each warp streaming `seq` row blocks (STREAM, the _s suffix; moet.kernels.cuda.STREAMED_TUNING):
// the host's pick in the pair grid for a stage whose row block is at most 16 chunks (w2), so that one wave holds the
// grid and a ring fill is paid once a warp, not once a row block (H100, 2026-12-07 15:34 and 16:09, docs/KERNELS.md
// "Decode: streamed row blocks in w2"; 13-32% slower in the pass grid at T = 64). Measured and dropped there: the
// 2-bit body x3 (its prologue half the ring), 0-2% on one row block.
MOET_DECODE_ALL_OCC(8, 1, 1, 2, 4, 1, 1, 2, 4, true, _s)

// out[t, h] = the sum over slots 0..k-1, in order, of pair_out[t·k + slot, h] (f32 [T·k, H]), as bf16 [T, H].
// Launched right after stage 2 (programmatic dependent launch): it waits for stage 2's rows. H % 4 == 0.
// COMBINE_GROUP slots' rows are loaded before any of them is added, so up to that many slots cost one round trip
// (a loop that adds as it loads took two at k = 6); the sum starts from -0, which adds nothing to any value.
constexpr int COMBINE_GROUP = 8;
extern "C" __global__ void __launch_bounds__(128) moe_combine_bf16(const float* __restrict__ pair_out,
                                                                   __nv_bfloat16* __restrict__ out, int T, int TOPK, int H) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int t = blockIdx.y, h = 4 * (blockIdx.x * 128 + threadIdx.x);
  if (h >= H) return;
  const float* p = pair_out + static_cast<size_t>(t) * TOPK * H + h;
  float4 s = make_float4(-0.f, -0.f, -0.f, -0.f);
  for (int first = 0; first < TOPK; first += COMBINE_GROUP) {
    float4 v[COMBINE_GROUP];
#pragma unroll
    for (int j = 0; j < COMBINE_GROUP; ++j)
      if (first + j < TOPK) v[j] = __ldg(reinterpret_cast<const float4*>(p + static_cast<size_t>(first + j) * H));
#pragma unroll
    for (int j = 0; j < COMBINE_GROUP; ++j)
      if (first + j < TOPK) s.x += v[j].x, s.y += v[j].y, s.z += v[j].z, s.w += v[j].w;
  }
  __nv_bfloat162 lo = __floats2bfloat162_rn(s.x, s.y), hi = __floats2bfloat162_rn(s.z, s.w);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&lo), packed.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(out + static_cast<size_t>(t) * H + h) = packed;
}

// The pass grid of many tokens (moet.kernels.glue.align's output, on the GPU in one launch): the T·k pairs sorted by
// expert, each expert's run padded to a multiple of `block` with PAD; block_expert[b] the expert of block b (the last
// expert past the padded end, n_padded[0], as align's); sorted_ids past n_padded[0] PAD too. One thread block of
// 1,024 threads, E ≤ MAX_EXPERTS. An expert's pairs are placed by shared-memory atomics, so their order inside its
// run may differ from align's pair order: each pair is one MMA column, computed alone, so no output bit depends on it.
constexpr int MAX_EXPERTS = 1024;
constexpr int PAD = 1 << 30;  // moet.kernels.glue.PAD

__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

extern "C" __global__ void __launch_bounds__(1024) moe_pass_grid(const int* __restrict__ topk_ids, int pairs, int E,
                                                                 int block, int blocks, int* __restrict__ sorted_ids,
                                                                 int* __restrict__ block_expert,
                                                                 int* __restrict__ n_padded) {
  __shared__ int s_count[MAX_EXPERTS];  // pairs per expert, then the next free place of its run
  __shared__ int s_end[MAX_EXPERTS];    // inclusive prefix of blocks per expert
  __shared__ int s_warp[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  s_count[tid] = 0;
  __syncthreads();
  for (int j = tid; j < pairs; j += 1024) atomicAdd(&s_count[topk_ids[j]], 1);
  __syncthreads();
  const int count = tid < E ? s_count[tid] : 0;
  const int own = (count + block - 1) / block;  // this expert's blocks
  int end = warp_inclusive_sum(own);  // scanned to the end of its run: first within the warp, then across warps
  if (lane == 31) s_warp[warp] = end;
  __syncthreads();
  if (warp == 0) s_warp[lane] = warp_inclusive_sum(s_warp[lane]);
  __syncthreads();
  if (warp > 0) end += s_warp[warp - 1];
  s_end[tid] = end;
  const int total = s_warp[31];  // blocks in use
  if (tid < E) {
    const int first = (end - own) * block;  // the run's first place
    for (int i = count; i < own * block; ++i) sorted_ids[first + i] = PAD;
    s_count[tid] = first;
  }
  __syncthreads();
  for (int j = tid; j < pairs; j += 1024) sorted_ids[atomicAdd(&s_count[topk_ids[j]], 1)] = j;
  for (int i = total * block + tid; i < blocks * block; i += 1024) sorted_ids[i] = PAD;
  for (int b = tid; b < blocks; b += 1024) {
    int lo = 0, hi = E - 1;  // the first expert whose run ends past block b (the last one past them all)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (s_end[mid] > b) hi = mid; else lo = mid + 1;
    }
    block_expert[b] = lo;
  }
  if (tid == 0) *n_padded = total * block;
}
