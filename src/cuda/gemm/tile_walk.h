// Which output tiles a CTA of the grouped GEMM engine computes, as
// host-callable arithmetic, so that a CPU test (tests/cpu/tile_walk_test.cpp)
// checks that the walks the kernel runs cover every tile exactly once. No
// CUDA here; tile_scheduler.cuh builds its Tiles from these.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace megamoe::cuda::engine {

inline constexpr int kPoolTileRows = 128;  // a pool tile's rows (kBlockM; experts start on pool tiles)

// The numbers one walker takes: first, first + step, ... below end.
struct Walk {
  int first, step, end;
};
// CTA `cta` of `grid`, over `tiles` tile numbers. One shared ring: both
// consumers (and the producer) walk every tile of the CTA's. Split rings
// (the FP8 kernels): ring r (its producer thread and consumer r) every other
// one. Paired columns (FP8 kGateUp): both rings walk every unit of the
// CTA's, unit u naming a pair of column tiles (paired_pool_tile).
MEGAMOE_HD Walk walk_of(bool split_rings, bool paired_columns, int cta, int ring, int grid, int tiles) {
  if (paired_columns) return Walk{cta, grid, tiles / 2};
  if (split_rings) return Walk{cta + ring * grid, 2 * grid, tiles};
  return Walk{cta, grid, tiles};
}

// An M-grouped output tile: pool tile m (rows 128 m ..), column tile n, its expert.
struct PoolTile {
  int m, n, expert;
};
// Tile number t with n_cols column tiles a pool tile, from the plan's
// tile_expert, expert_offset and expert_rows: experts in pool order; within
// one, its pool tiles' column tiles next to each other, or with rows_first
// the pool tiles of one column tile. Either way expert e's tiles are numbers
// [first_e n_cols, (first_e + count_e) n_cols), first_e its first pool tile.
MEGAMOE_HD PoolTile pool_tile(int t, int n_cols, bool rows_first, const int32_t* tile_expert,
                              const int32_t* expert_offset, const int32_t* expert_rows) {
  PoolTile x{t / n_cols, t % n_cols, 0};
  x.expert = tile_expert[x.m];
  if (rows_first) {
    const int first = expert_offset[x.expert] / kPoolTileRows;
    const int count = (expert_rows[x.expert] + kPoolTileRows - 1) / kPoolTileRows;
    const int local = t - first * n_cols;
    x.m = first + local % count;
    x.n = local / count;
  }
  return x;
}
// Unit u of the paired walk (n_tiles even): column tiles 2j and 2j + 1 of one
// pool tile, in the order pool_tile walks tiles with half the columns;
// consumer c takes 2j + c.
MEGAMOE_HD PoolTile paired_pool_tile(int u, int c, int n_tiles, bool rows_first, const int32_t* tile_expert,
                                     const int32_t* expert_offset, const int32_t* expert_rows) {
  PoolTile x = pool_tile(u, n_tiles / 2, rows_first, tile_expert, expert_offset, expert_rows);
  x.n = 2 * x.n + c;
  return x;
}

}  // namespace megamoe::cuda::engine
