// Which output tiles a CTA computes, and in what order. Device code; included
// by kernel.cuh.
//
// Tiles are numbered on the device (their count depends on the routing, read
// from the plan, never from the host). Every role of the kernel walks its
// tiles through walk(ring) and tile(t, ring): on one shared ring the producer
// and both consumers walk every tile of the CTA's (t = b, b + grid, ...) and
// the consumers take them in turn; on split rings (FP8) ring r's producer
// thread and consumer r walk every other one; FP8 kGateUp walks units of two
// column tiles of one row tile, consumer c taking tile 2j + c. Order:
// M-grouped modes walk the experts in id order (pool order); within an
// expert, the column tiles of one row tile next to each other (the row
// tile's A rows read from L2 by consecutive tiles), or rows first (its B
// columns read from L2 by consecutive tiles). Either way expert e's tiles
// are numbers [first_e * n_tiles, (first_e + count_e) * n_tiles), first_e its
// first pool row tile. kWeightGrad walks (expert, m, n). The M-grouped
// numbering and the walks are tile_walk.h's (CPU-tested). With held rows, the
// producer holds a tile until its rows have arrived.
#pragma once

#include "cuda/gemm/kernel_spec.h"
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

template <typename Spec>
struct TileScheduler {
  static constexpr GemmMode M = Spec::kMode;
  const KernelParams& p;

  __device__ __forceinline__ int num_tiles() const {
    if constexpr (M == GemmMode::kWeightGrad) {
      return p.args.plan.num_experts * p.m_tiles * p.n_tiles;
    } else {
      return (*p.args.plan.pool_rows / kBlockM) * p.n_tiles;
    }
  }

  // The tile numbers ring `ring` walks (a shared ring: every role walks all of the CTA's).
  __device__ __forceinline__ Walk walk(int ring, int tiles) const {
    return walk_of(Spec::kSplitRings, Spec::kPairedColumns, static_cast<int>(blockIdx.x), ring,
                   static_cast<int>(gridDim.x), tiles);
  }

  // Tile number t of ring `ring`'s walk (paired columns: unit t, the ring's tile of it).
  __device__ __forceinline__ Tile tile(int t, int ring) const {
    if constexpr (M == GemmMode::kWeightGrad) {
      return weight_grad_tile(t);
    } else if constexpr (Spec::kPairedColumns) {
      return pool_tile_work(paired_pool_tile(t, ring, p.n_tiles, rows_first(), p.args.plan.tile_expert,
                                             p.args.plan.expert_offset, p.args.plan.expert_rows));
    } else {
      return pool_tile_work(pool_tile(t, p.n_tiles, rows_first(), p.args.plan.tile_expert, p.args.plan.expert_offset,
                                      p.args.plan.expert_rows));
    }
  }

  // Holds the tile until its pool rows are in (GroupedGemmArgs::arrival; the
  // kernels with held rows). The producer calls it before the tile's first
  // load; false: the wait gave up (reported).
  __device__ __forceinline__ bool wait_rows_in(const BoundedWait& waits, const Tile& tile) const {
    static_assert(Spec::kHoldRows, "rows are held in the kernels built for it");
    return waits.wait_counter(p.args.arrival.rows_ready + tile.m, p.args.arrival.ready_value,
                              static_cast<uint32_t>(tile.m));
  }

 private:
  __device__ __forceinline__ bool rows_first() const { return p.args.tile_order == TileOrder::kRowsFirst; }

  // kWeightGrad: tile t of the (expert, m, n) walk; K = the expert's pool rows.
  __device__ __forceinline__ Tile weight_grad_tile(int t) const {
    Tile tile;
    const int per_expert = p.m_tiles * p.n_tiles;
    tile.expert = t / per_expert;
    tile.m = (t % per_expert) / p.n_tiles;
    tile.n = t % p.n_tiles;
    const int rows = p.args.plan.expert_rows[tile.expert];
    tile.k_begin = p.args.plan.expert_offset[tile.expert];
    // K = the expert's rows, in k-blocks of Spec::kKBlock rows: a block of padding only (zeros) is skipped.
    tile.k_blocks = (rows + Spec::kKBlock - 1) / Spec::kKBlock;
    tile.lower_half_used = true;
    return tile;
  }

  // The work of M-grouped tile x: all of K, and whether rows 64.. hold real rows.
  __device__ __forceinline__ Tile pool_tile_work(PoolTile x) const {
    static_assert(kPoolRowAlign == kBlockM && kPoolTileRows == kBlockM,
                  "experts start on row tiles (rows first numbers an expert's tiles)");
    Tile tile;
    tile.m = x.m, tile.n = x.n, tile.expert = x.expert;
    tile.k_begin = 0;
    tile.k_blocks = p.k_blocks;
    const int begin = p.args.plan.expert_offset[tile.expert], rows = p.args.plan.expert_rows[tile.expert];
    tile.lower_half_used = begin + rows - tile.m * kBlockM > 64;
    return tile;
  }
};

}  // namespace megamoe::cuda::engine
