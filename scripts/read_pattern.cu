// Plain reads in the decode kernels' access pattern (scripts/read_pattern.py, a device-visit tool): does DRAM serve
// ~3,000 warps that each stream their own few KB as fast as one dense front of reads (the bench's read kernel)?
//
// Warp w (4 per block, as in moet/kernels/src/moe_decode.cu) reads `chunks` chunks of 512 B (16 B a lane) through
// a register ring of RING chunks, with the decode's load (ld.global.nc.L1::no_allocate). GROUP warps hold their
// chunks interleaved: chunk c of warp w sits at chunk index (w / GROUP)·chunks·GROUP + c·GROUP + w % GROUP. GROUP 1
// is the decode layout (each warp's chunks contiguous); GROUP = all warps is a dense front (step c of every warp
// reads one contiguous run). WORK adds that many independent IMADs a lane per chunk, about the decode's 1.9
// instructions per weight at 120.
#include <stdint.h>

#include "../moet/kernels/src/load_stream.cuh"  // the decode's weight load

template <int RING, int WORK>
__device__ __forceinline__ void read_ring(const uint4* __restrict__ src, uint32_t* __restrict__ sink, int chunks,
                                          int group) {
  const int lane = threadIdx.x & 31, w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const size_t first = static_cast<size_t>(w / group) * chunks * group + w % group;
  const uint4* p = src + first * 32 + lane;
  const size_t stride = static_cast<size_t>(group) * 32;
  uint4 ring[RING];
#pragma unroll
  for (int d = 0; d < RING; ++d)
    if (d < chunks) ring[d] = load_stream(p + d * stride);
  uint32_t acc[4] = {0, 0, 0, 0};
  for (int c0 = 0; c0 < chunks; c0 += RING) {
#pragma unroll
    for (int d = 0; d < RING; ++d) {
      const int c = c0 + d;
      if (c >= chunks) break;
      uint4 v = ring[d];
      if (c + RING < chunks) ring[d] = load_stream(p + (c + RING) * stride);
#pragma unroll
      for (int i = 0; i < WORK / 4; ++i)  // PTX mad, which the compiler cannot fold into one multiply
        asm("mad.lo.u32 %0, %0, 0x01000193, %4; mad.lo.u32 %1, %1, 0x01000193, %4;"
            "mad.lo.u32 %2, %2, 0x01000193, %4; mad.lo.u32 %3, %3, 0x01000193, %4;"
            : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "r"(i));
      acc[0] ^= v.x, acc[1] ^= v.y, acc[2] ^= v.z, acc[3] ^= v.w;
    }
  }
  const uint32_t all = acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
  if (all == 0x9E3779B9u) sink[w] = all;  // never true for the bench's data; keeps the loads
}

#define READ_RING(RING, WORK)                                                                                      \
  extern "C" __global__ void __launch_bounds__(128, 6)                                                             \
      read_ring_r##RING##_w##WORK(const uint4* src, uint32_t* sink, int chunks, int group) {                       \
    read_ring<RING, WORK>(src, sink, chunks, group);                                                               \
  }
READ_RING(2, 0)
READ_RING(4, 0)
READ_RING(8, 0)
READ_RING(4, 120)
READ_RING(8, 120)
