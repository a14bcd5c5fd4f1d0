// The grouped GEMM engine's tile walks (cuda/gemm/tile_walk.h, the formulas
// the kernel runs): over random routing plans (empty experts, partial last
// tiles), grids and column counts, with and without rows_first, every
// M-grouped output tile is taken exactly once, by one walker, with its
// plan's expert: the shared ring's walk, the split rings' (every other tile
// a ring) and FP8 kGateUp's paired columns (both rings on every unit, ring c
// on column tile 2j + c).
#include "cuda/gemm/tile_walk.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace megamoe::cuda::engine {
namespace {

// A plan's tile arrays: expert e has rows[e] rows (0 allowed) from a 128-aligned offset.
struct Plan {
  std::vector<int32_t> expert_rows, expert_offset, tile_expert;
  int pool_tiles = 0;
};

Plan random_plan(std::mt19937& rng, int experts) {
  Plan p;
  std::uniform_int_distribution<int> rows(0, 600);
  for (int e = 0; e < experts; ++e) {
    const int r = rng() % 4 == 0 ? 0 : rows(rng);
    p.expert_rows.push_back(r);
    p.expert_offset.push_back(p.pool_tiles * kPoolTileRows);
    const int tiles = (r + kPoolTileRows - 1) / kPoolTileRows;
    for (int i = 0; i < tiles; ++i) p.tile_expert.push_back(e);
    p.pool_tiles += tiles;
  }
  return p;
}

enum class Kind { kSharedRing, kSplitRings, kPairedColumns };

// How many times each tile (m * n_tiles + n) is taken when every walker of
// every CTA runs `walk` (walk_of, or a broken one); a number past the walk's
// range, or a tile out of range or named with another expert than the
// plan's, makes every tile count as taken 100 times.
template <typename WalkOf>
std::vector<int> takes(const Plan& p, int n_tiles, bool rows_first, int grid, Kind kind, WalkOf walk) {
  const int tiles = p.pool_tiles * n_tiles;
  std::vector<int> taken(static_cast<size_t>(tiles), 0);
  const bool split = kind != Kind::kSharedRing, paired = kind == Kind::kPairedColumns;
  for (int cta = 0; cta < grid; ++cta)
    for (int ring = 0; ring < (split ? 2 : 1); ++ring) {
      const Walk w = walk(split, paired, cta, ring, grid, tiles);
      for (int t = w.first; t < w.end; t += w.step) {
        if (t < 0 || t >= (paired ? tiles / 2 : tiles)) return std::vector<int>(static_cast<size_t>(tiles), 100);
        const PoolTile x = paired ? paired_pool_tile(t, ring, n_tiles, rows_first, p.tile_expert.data(),
                                                     p.expert_offset.data(), p.expert_rows.data())
                                  : pool_tile(t, n_tiles, rows_first, p.tile_expert.data(), p.expert_offset.data(),
                                              p.expert_rows.data());
        const bool ok = x.m >= 0 && x.m < p.pool_tiles && x.n >= 0 && x.n < n_tiles &&
                        x.expert == p.tile_expert[static_cast<size_t>(x.m)];
        if (!ok) return std::vector<int>(static_cast<size_t>(tiles), 100);
        ++taken[static_cast<size_t>(x.m * n_tiles + x.n)];
      }
    }
  return taken;
}

bool each_once(const std::vector<int>& taken) {
  for (int v : taken)
    if (v != 1) return false;
  return true;
}

TEST(TileWalk, EveryTileOnceOnEveryWalk) {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 40; ++trial) {
    const Plan p = random_plan(rng, 1 + static_cast<int>(rng() % 16));
    for (const int n_tiles : {2, 4, 6, 12})
      for (const bool rows_first : {false, true})
        for (const int grid : {1, 2, 3, 7, 20, 132})
          for (const Kind kind : {Kind::kSharedRing, Kind::kSplitRings, Kind::kPairedColumns}) {
            const std::string what = "trial " + std::to_string(trial) + ", n_tiles " + std::to_string(n_tiles) +
                                     (rows_first ? ", rows first" : "") + ", grid " + std::to_string(grid) +
                                     ", walk " + std::to_string(static_cast<int>(kind));
            ASSERT_TRUE(each_once(takes(p, n_tiles, rows_first, grid, kind, walk_of))) << what;
          }
  }
}

// Paired columns: both rings of a CTA take the same pool tile and the two
// halves of one column pair at each step (what FP8 kGateUp's consumers rely on
// to read the same A rows at once).
TEST(TileWalk, PairedRingsTakeTheTwoHalvesOfOnePairTogether) {
  std::mt19937 rng(7);
  const Plan p = random_plan(rng, 9);
  for (const bool rows_first : {false, true})
    for (int u = 0; u < p.pool_tiles * 6 / 2; ++u) {
      const PoolTile a = paired_pool_tile(u, 0, 6, rows_first, p.tile_expert.data(), p.expert_offset.data(),
                                          p.expert_rows.data());
      const PoolTile b = paired_pool_tile(u, 1, 6, rows_first, p.tile_expert.data(), p.expert_offset.data(),
                                          p.expert_rows.data());
      EXPECT_EQ(a.m, b.m);
      EXPECT_EQ(a.n % 2, 0);
      EXPECT_EQ(b.n, a.n + 1);
    }
}

// Walks that each break one rule are caught by the same count: the split
// rings both on ring 0's tiles, the paired walk over every tile number
// instead of the units (tiles / 2), the paired walk with the split rings'
// stride (half its units skipped).
TEST(TileWalk, AWrongWalkIsCaught) {
  std::mt19937 rng(3);
  const Plan p = random_plan(rng, 6);
  ASSERT_GT(p.pool_tiles, 1);
  auto one_ring = [](bool split, bool paired, int cta, int, int grid, int tiles) {
    return walk_of(split, paired, cta, 0, grid, tiles);
  };
  auto every_number = [](bool split, bool paired, int cta, int ring, int grid, int tiles) {
    Walk w = walk_of(split, paired, cta, ring, grid, tiles);
    if (paired) w.end = tiles;
    return w;
  };
  auto split_stride = [](bool split, bool paired, int cta, int ring, int grid, int tiles) {
    Walk w = walk_of(split, paired, cta, ring, grid, tiles);
    if (paired) w.step = 2 * grid;
    return w;
  };
  for (const int grid : {1, 3}) {
    EXPECT_FALSE(each_once(takes(p, 4, false, grid, Kind::kSplitRings, one_ring))) << "grid " << grid;
    EXPECT_FALSE(each_once(takes(p, 4, true, grid, Kind::kPairedColumns, every_number))) << "grid " << grid;
    EXPECT_FALSE(each_once(takes(p, 4, false, grid, Kind::kPairedColumns, split_stride))) << "grid " << grid;
  }
}

}  // namespace
}  // namespace megamoe::cuda::engine
