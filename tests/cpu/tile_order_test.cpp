// The engine's tile order (cuda/gemm/tile_order.h): every tile exactly once,
// bands of kRasterRows row tiles walked m-fastest.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/gemm/tile_order.h"

namespace {

using megamoe::cuda::engine::kRasterRows;
using megamoe::cuda::engine::raster_tile;

TEST(TileOrder, EveryTileExactlyOnce) {
  for (int m_tiles : {1, 2, 7, 8, 9, 17, 1088})
    for (int n_tiles : {1, 2, 6, 12, 224}) {
      std::vector<int> seen(static_cast<size_t>(m_tiles * n_tiles), 0);
      for (int t = 0; t < m_tiles * n_tiles; ++t) {
        const auto [m, n] = raster_tile(t, m_tiles, n_tiles);
        ASSERT_TRUE(m >= 0 && m < m_tiles && n >= 0 && n < n_tiles) << t << " -> " << m << ", " << n;
        ++seen[static_cast<size_t>(m * n_tiles + n)];
      }
      for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "tile " << i << " of " << m_tiles << " x " << n_tiles;
    }
}

TEST(TileOrder, BandsWalkRowsFastest) {
  // 20 row tiles, 5 column tiles: bands of 8, 8 and 4 rows.
  const auto at = [](int t) { return raster_tile(t, 20, 5); };
  EXPECT_EQ(at(0).m, 0);
  EXPECT_EQ(at(0).n, 0);
  EXPECT_EQ(at(kRasterRows - 1).m, kRasterRows - 1);
  EXPECT_EQ(at(kRasterRows).m, 0);
  EXPECT_EQ(at(kRasterRows).n, 1);
  EXPECT_EQ(at(kRasterRows * 5).m, kRasterRows);  // the second band starts
  EXPECT_EQ(at(2 * kRasterRows * 5).m, 2 * kRasterRows);
  EXPECT_EQ(at(2 * kRasterRows * 5 + 3).m, 2 * kRasterRows + 3);  // the last band has 4 rows
  EXPECT_EQ(at(2 * kRasterRows * 5 + 4).m, 2 * kRasterRows);
  EXPECT_EQ(at(2 * kRasterRows * 5 + 4).n, 1);
}

}  // namespace
