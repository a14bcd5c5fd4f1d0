// The order in which the engine's M-grouped modes walk their output tiles,
// host-callable so that a CPU test (tests/cpu/tile_order_test.cpp) checks the
// very formula the kernel runs. No CUDA here.
//
// Tiles are (m, n): m a 128-row pool tile (one expert's rows), n a column
// tile. The CTAs of a wave run consecutive tile numbers, in k-block lockstep
// more or less, so what they share is read from L2 once per k-block. Walking
// n fastest puts one m and up to 132 n in a wave: one A tile and 132 B tiles
// per k-block, 2.1 MB from DRAM per k-block when the expert's weights are
// wider than L2 can keep (few large experts: Mixtral's w13 has 224 column
// tiles). Walking a band of kRasterRows row tiles m-fastest, column after
// column, puts about kRasterRows x (132 / kRasterRows) tiles in a wave: 8 A
// and 17 B tiles per k-block. For the Qwen3 shapes (12-24 column tiles) a
// wave held 6-11 row tiles either way.
#pragma once

#include "core/host_device.h"

namespace megamoe::cuda::engine {

inline constexpr int kRasterRows = 8;

struct TileMN {
  int m, n;
};

// Tile number t in [0, m_tiles * n_tiles) -> (m, n): bands of kRasterRows row
// tiles (the last band may be narrower), each walked m-fastest. A bijection.
MEGAMOE_HD TileMN raster_tile(int t, int m_tiles, int n_tiles) {
  const int band_tiles = kRasterRows * n_tiles;
  const int band = t / band_tiles, in_band = t % band_tiles;
  const int m0 = band * kRasterRows;
  const int rows = m_tiles - m0 < kRasterRows ? m_tiles - m0 : kRasterRows;
  return {m0 + in_band % rows, in_band / rows};
}

}  // namespace megamoe::cuda::engine
