// The bf16 main loop of one tile: every k-block of the tile's stages through
// wgmma into the consumer's fp32 accumulators. Device code; included by
// kernel.cuh.
//
// 128 x 128 tiles: the consumer computes all 128 rows (acc[h]: rows
// [64h, 64h + 64)), two m64n128k16 wgmmas a k16 step. 128 x 256 tiles: both
// consumers on every tile, consumer cw on rows [64cw, 64cw + 64) with one
// m64n256k16 a k16 step (acc[h]: the tile's columns [128h, 128h + 128); the
// bare loop of this shape ran 9-13% faster than the 128 x 128 one).
// MN-major operands (kWeightGrad's A and B, kDownGrad's and kGateUpGrad's B):
// a k16 step is 16 box rows; B's 64-column boxes are kBoxBytes apart.
#pragma once

#include "cuda/gemm/epilogue_common.cuh"
#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/tile_scheduler.cuh"

namespace megamoe::cuda::engine {

// false: a wait gave up (reported); the previous k-block's wgmma group and
// the previous epilogue's stores are retired before returning.
template <typename Spec, typename Ring, typename State, typename Release>
__device__ __forceinline__ bool bf16_main_loop(const Tile& tile, const Ring& ring, const BoundedWait& waits,
                                               State& ps, float (&acc)[2][64], int cw, Release&& release) {
  constexpr bool kWide = Spec::kWide;
  constexpr bool kAMn = Spec::kAMnMajor, kBMn = Spec::kBMnMajor;
  for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
    if (!ring.consumer_wait(waits, ps)) {
      wgmma_wait<0>();       // retire the previous k-block's group before leaving
      bulk_wait_group<0>();  // and the previous epilogue's stores (they read shared memory)
      return false;
    }
    const uint8_t* sa = ring.stage(ps.stage());
    const uint8_t* sb = sa + kTileBytesA;
    // Between here and the wait<0> after the loop, nothing but wgmma touches
    // the accumulators (the fences are compiler-only: no instruction).
    fence_accumulators(acc[0]);
    fence_accumulators(acc[1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kWide && kk < kBlockK / 16; ++kk) {  // this consumer's A box, B's 256 rows at once
      const uint64_t da = kAMn ? smem_desc_sw128(sa + cw * kBoxBytes + kk * 16 * 128, kBoxBytes, 1024)
                               : smem_desc_sw128(sa + cw * kBoxBytes + kk * 32, 0, 1024);
      const uint64_t db =
          kBMn ? smem_desc_sw128(sb + kk * 16 * 128, kBoxBytes, 1024) : smem_desc_sw128(sb + kk * 32, 0, 1024);
      wgmma_m64n256k16_bf16<kAMn ? 1 : 0, kBMn ? 1 : 0>(acc[0], acc[1], da, db, 1);
    }
#pragma unroll
    for (int kk = 0; !kWide && kk < kBlockK / 16; ++kk) {
      uint64_t db;
      if constexpr (kBMn) {
        db = smem_desc_sw128(sb + kk * 16 * 128, kBoxBytes, 1024);
      } else {
        db = smem_desc_sw128(sb + kk * 32, 0, 1024);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // A box h holds tile rows [64h, 64h + 64)
        uint64_t da;
        if constexpr (kAMn) {
          da = smem_desc_sw128(sa + h * kBoxBytes + kk * 16 * 128, kBoxBytes, 1024);
        } else {
          da = smem_desc_sw128(sa + h * kBoxBytes + kk * 32, 0, 1024);
        }
        wgmma_m64n128k16_bf16<kAMn ? 1 : 0, kBMn ? 1 : 0>(acc[h], da, db, 1);
      }
    }
    wgmma_commit();
    // Keep this k-block's group in flight while the next one is waited for
    // and issued: retiring down to one pending group proves the previous
    // k-block's group done, so its stage (not this one) goes back.
    wgmma_wait<1>();
    if (kb > 0) release(ps.previous_stage());
  }
  wgmma_wait<0>();
  fence_accumulators(acc[0]);
  fence_accumulators(acc[1]);
  if (tile.k_blocks > 0) release(ps.previous_stage());
  return true;
}

}  // namespace megamoe::cuda::engine
