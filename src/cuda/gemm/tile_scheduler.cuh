// Which output tiles a CTA computes, and in what order. Device code; included
// by grouped_gemm.cu.
//
// Tiles are numbered on the device (their count depends on the routing, read
// from the plan, never from the host); CTA b takes t = b, b + grid, ... and
// its two consumers alternate over them. Order: M-grouped modes walk the
// experts in id order (pool order); within an expert, the column tiles of
// one row tile next to each other (the row tile's A rows read from L2 by
// consecutive tiles), or with GroupedGemmArgs::rows_first (held tiles too) the row tiles of
// one column tile (its B columns read from L2 by consecutive tiles). Either
// way expert e's tiles are numbers [first_e * n_tiles, (first_e + count_e) *
// n_tiles), first_e its first pool row tile: t / n_tiles names the expert.
// kWeightGrad walks (expert, m, n). FP8 kGateUp walks pairs of column
// tiles (pair_tile): its two consumers take n = 2j and 2j + 1 of one row tile.
// The M-grouped numbering and the walks are tile_walk.h's (CPU-tested).
// With rows_ready, the producer holds a tile until its rows have arrived.
#pragma once

#include "cuda/gemm/engine_config.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/tile_walk.h"
#include "megamoe/problem.h"

namespace megamoe::cuda::engine {

// Work of one output tile.
struct Tile {
  int expert, m, n;  // m: pool tile (M-grouped) or dW row tile (kWeightGrad)
  int k_begin;       // first K coordinate (pool row for kWeightGrad, else 0)
  int k_blocks;
  // M-grouped modes: rows 64..127 of the tile hold real rows. An expert's
  // last tile often holds 64 or fewer; its A box 1 is then zero-filled by
  // TMA instead of read (load_stage). The wgmmas stay the same: skipping
  // them on a runtime condition makes ptxas serialise every wgmma (C7520 /
  // C7515, checked). Always true for kWeightGrad.
  bool lower_half_used;
};

// kFp8: k-blocks of 128 elements (one 128-byte e4m3 box row), else 64 (bf16).
template <GemmMode M, bool kFp8 = false>
struct TileScheduler {
  const KernelParams& p;

  __device__ __forceinline__ int num_tiles() const {
    if constexpr (M == GemmMode::kWeightGrad) {
      return p.args.plan.num_experts * p.m_tiles * p.n_tiles;
    } else {
      return (*p.args.plan.pool_rows / kBlockM) * p.n_tiles;
    }
  }

  __device__ __forceinline__ Tile tile(int t) const {
    if constexpr (M == GemmMode::kWeightGrad) {
      return weight_grad_tile(t);
    } else {
      const DevicePlan& plan = p.args.plan;
      return pool_tile_work(pool_tile(t, p.n_tiles, p.args.rows_first, plan.tile_expert, plan.expert_offset,
                                      plan.expert_rows));
    }
  }

  // FP8 kGateUp (kPairedColumns): unit u of num_tiles() / 2, consumer c's
  // tile of it (tile_walk.h paired_pool_tile).
  __device__ __forceinline__ Tile pair_tile(int u, int c) const {
    const DevicePlan& plan = p.args.plan;
    return pool_tile_work(paired_pool_tile(u, c, p.n_tiles, p.args.rows_first, plan.tile_expert,
                                           plan.expert_offset, plan.expert_rows));
  }

  // kWeightGrad: tile t of the (expert, m, n) walk; K = the expert's pool rows.
  __device__ __forceinline__ Tile weight_grad_tile(int t) const {
    Tile tile;
    const int per_expert = p.m_tiles * p.n_tiles;
    tile.expert = t / per_expert;
    tile.m = (t % per_expert) / p.n_tiles;
    tile.n = t % p.n_tiles;
    const int rows = p.args.plan.expert_rows[tile.expert];
    tile.k_begin = p.args.plan.expert_offset[tile.expert];
    // K = the expert's rows, in 64-row (bf16) or 128-row (FP8) blocks: a
    // block of padding only (zeros) is skipped.
    constexpr int kb = kFp8 ? kBlockKFp8 : kBlockK;
    tile.k_blocks = (rows + kb - 1) / kb;
    tile.lower_half_used = true;
    return tile;
  }

  // The work of M-grouped tile x: all of K, and whether rows 64.. hold real rows.
  __device__ __forceinline__ Tile pool_tile_work(PoolTile x) const {
    static_assert(kPoolRowAlign == kBlockM && kPoolTileRows == kBlockM,
                  "experts start on row tiles (rows_first numbers an expert's tiles)");
    Tile tile;
    tile.m = x.m, tile.n = x.n, tile.expert = x.expert;
    tile.k_begin = 0;
    tile.k_blocks = p.k_blocks;
    const int begin = p.args.plan.expert_offset[tile.expert], rows = p.args.plan.expert_rows[tile.expert];
    tile.lower_half_used = begin + rows - tile.m * kBlockM > 64;
    return tile;
  }

  // Holds the tile until its pool rows are in (GroupedGemmArgs::rows_ready,
  // set: the kernel's kHoldRows instantiation calls this). The producer calls
  // it before the tile's first load; false: the wait gave up (reported).
  __device__ __forceinline__ bool wait_rows_in(const BoundedWait& waits, const Tile& tile) const {
    static_assert(M != GemmMode::kWeightGrad, "rows_ready holds pool tiles of the M-grouped modes");
    return waits.wait_counter(p.args.rows_ready + tile.m, p.args.ready_value, static_cast<uint32_t>(tile.m));
  }
};

}  // namespace megamoe::cuda::engine
