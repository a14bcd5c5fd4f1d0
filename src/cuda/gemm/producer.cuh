// The producer role of the grouped GEMM kernel: one thread (on split rings
// one per ring) issues the TMA loads of every stage, tile after tile, in the
// order the consumers take them. Device code; included by kernel.cuh.
#pragma once

#include <cuda.h>

#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/tile_scheduler.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

// The TMA descriptors of a launch (each a __grid_constant__ kernel parameter).
struct TensorMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* z;     // kDownGrad: the saved z [C, 2I]
  const CUtensorMap* out0;  // kDownGrad: dz [C, 2I]; wide kGateUp: z; kDown: pool-order rows [C, n]
  const CUtensorMap* out1;  // kDownGrad: wa [C, I]; wide kGateUp: a [C, I]
};

// TMA loads of one k-block of a tile: A and B, each as two 64 x 64 boxes
// (wide tiles: B as four). e4m3 k-blocks are 128 elements long (the same
// 128-byte box rows). Wide tiles (bf16): kGateUp's 128 gate rows into B boxes
// 0-1 and the matching 128 up rows into boxes 2-3; kDown's 256 rows of expert
// e's w2 (output columns 256n..) into boxes 0-3; kGateUpGrad's and
// kWeightGrad's B (MN-major) as four 64-column boxes of the tile's 256.
template <typename Spec>
__device__ __forceinline__ void load_stage(const KernelParams& p, const TensorMaps& maps, const Tile& tile, int kb,
                                           uint8_t* smem_a, uint8_t* smem_b, uint64_t* full) {
  constexpr GemmMode M = Spec::kMode;
  constexpr bool kWide = Spec::kWide;
  const int k0 = tile.k_begin + kb * Spec::kKBlock;
  const int e = tile.expert;
  const int I = static_cast<int>(p.args.intermediate);
  const CUtensorMap* map_a = maps.a;
  const CUtensorMap* map_b = maps.b;
  for (int box = 0; box < 2; ++box) {
    // A. Rows 64..127 of an expert's last tile are often padding (zeros in the
    // pool): box 1 is then asked for past the tensor's end, which TMA fills
    // with zeros without reading memory (Tile::lower_half_used).
    const int a_row = box == 1 && !tile.lower_half_used ? static_cast<int>(p.args.a.rows) : tile.m * kBlockM + box * 64;
    constexpr bool kAMn = Spec::kAMnMajor;  // (FP8 kWeightGrad reads A^T, K-major)
    const int c0 = kAMn ? a_row : k0, c1 = kAMn ? k0 : a_row;
    tma_load_2d(smem_a + box * kBoxBytes, map_a, full, c0, c1);
    // B
    if constexpr (M == GemmMode::kGateUp && kWide) {  // gate rows 128n + 64 box, and their up rows
      const int row = e * 2 * I + tile.n * 128 + box * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, k0, row + I);
    } else if constexpr (M == GemmMode::kGateUp) {  // gate rows and the matching up rows
      const int row = e * 2 * I + (box == 0 ? 0 : I) + tile.n * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
    } else if constexpr (M == GemmMode::kDown && kWide) {
      const int row = e * static_cast<int>(p.args.n) + tile.n * 256 + box * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, k0, row + 128);
    } else if constexpr (M == GemmMode::kDown) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, e * static_cast<int>(p.args.n) + tile.n * kBlockN + box * 64);
    } else if constexpr (M == GemmMode::kWeightGrad && Spec::kFp8) {  // B^T [n, pool rows], K-major
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, tile.n * kBlockN + box * 64);
    } else if constexpr (M == GemmMode::kWeightGrad && kWide) {  // B's 256 columns: boxes 0-3, 64 columns each
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * 256 + box * 64, k0);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, tile.n * 256 + (2 + box) * 64, k0);
    } else if constexpr (M == GemmMode::kWeightGrad) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64, k0);
    } else if constexpr (M == GemmMode::kGateUpGrad && kWide) {
      // w13[e]'s 256 columns as four boxes, K rows
      const int row = e * static_cast<int>(p.args.k) + k0;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * 256 + box * 64, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, tile.n * 256 + (2 + box) * 64, row);
    } else if constexpr (Spec::kBTransposed) {  // [E * n, k]: expert e's output columns are rows, K inner
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0,
                  e * static_cast<int>(p.args.n) + tile.n * kBlockN + box * 64);
    } else {  // kDownGrad (w2 as [E*H, I]) and kGateUpGrad (w13 as [E*2I, H]): K = rows of expert e
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64,
                  e * static_cast<int>(p.args.k) + k0);
    }
  }
}

// The producer thread of ring `ring` (a shared ring: thread 0 for both
// consumers; split rings: warp r's first lane fills ring r with consumer r's
// tiles, so that neither ring waits for the other's loads or tile look-ups).
// It returns early when a wait gives up or at the fault-injection point
// (stall_at, counted on ring 0).
template <typename Spec, typename Ring>
__device__ __forceinline__ void run_producer(const KernelParams& p, const TensorMaps& maps, const Ring& ring,
                                             const BoundedWait& waits, const TileScheduler<Spec>& scheduler,
                                             int tiles) {
  constexpr int R = Spec::kRingStages;
  const int r = Spec::kSplitRings ? static_cast<int>(threadIdx.x / 32) : 0;
  const int64_t stall_at = p.stall_at;
  tma_prefetch_descriptor(maps.a);
  tma_prefetch_descriptor(maps.b);
  // One k-block of `tile` into slot `slot`, with its scales when the kernel has a scale ring.
  auto load = [&](const Tile& tile, int kb, int slot) {
    constexpr int kScaleBytes = Spec::kScaleRing ? kScaleStageBytes : 0;
    uint64_t* full = ring.producer_commit(slot, Spec::kStageBytes + kScaleBytes);
    uint8_t* stage = ring.stage(slot);
    load_stage<Spec>(p, maps, tile, kb, stage, stage + kTileBytesA, full);
    if constexpr (Spec::kScaleRing) {  // this k-block's 128 row and 128 column scales
      float* dst = ring.stage_scales(slot);
      const int64_t rb = tile.k_begin / kBlockKFp8 + kb;
      bulk_load(dst, p.args.a.scales + rb * p.args.m + tile.m * kBlockM, 512, full);
      bulk_load(dst + 128, p.args.b.scales + rb * p.args.n + tile.n * kBlockN, 512, full);
    }
  };
  const auto mine = ring.template slice<R>(r * R);
  PipelineState<R> ps;
  const Walk w = scheduler.walk(r, tiles);
  for (int t = w.first; t < w.end; t += w.step) {
    const Tile tile = scheduler.tile(t, r);
    if constexpr (Spec::kHoldRows)
      if (!scheduler.wait_rows_in(waits, tile)) return;
    for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
      if (r == 0 && static_cast<int64_t>(ps.it) == stall_at) return;
      if (!mine.producer_acquire(waits, ps)) return;
      load(tile, kb, r * R + ps.stage());
    }
  }
}

}  // namespace megamoe::cuda::engine
