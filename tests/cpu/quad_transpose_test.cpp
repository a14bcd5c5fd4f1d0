// quad_transpose16 (cuda/gemm/quad_transpose.h) on a simulated quad: every
// lane ends with the group of 16-bit values the 8-byte e4m3 stores need.
#include "cuda/gemm/quad_transpose.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>

namespace megamoe::cuda {
namespace {

// m[l][j] = 16-bit value of lane l, group j (distinct everywhere).
uint32_t value(int l, int j) { return 0x1000u * static_cast<uint32_t>(l + 1) + 0x11u * static_cast<uint32_t>(j + 3); }

TEST(QuadTranspose, EachLaneGetsItsGroupFromEveryLaneInOrder) {
  // The lanes run one after another; an exchange returns what the partner
  // sent at the same call in the previous round. A call's sent value depends
  // only on earlier calls, so after as many rounds as calls (2) plus one, all
  // exchanges are those of lanes running in step, as on the GPU.
  std::array<std::array<uint32_t, 2>, 4> sent{};  // [lane][call]
  std::array<uint32_t, 4> lo{}, hi{};
  for (int round = 0; round < 3; ++round) {
    auto next = sent;
    for (int l = 0; l < 4; ++l) {
      int call = 0;
      auto exchange = [&](uint32_t v, int mask) {
        EXPECT_TRUE(mask == 1 || mask == 2);
        next[l][call] = v;
        return sent[l ^ mask][call++];
      };
      quad_transpose16(l, value(l, 0) | value(l, 1) << 16, value(l, 2) | value(l, 3) << 16, exchange, lo[l], hi[l]);
      EXPECT_EQ(call, 2);
    }
    sent = next;
  }
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(lo[l], value(0, l) | value(1, l) << 16) << "lane " << l;
    EXPECT_EQ(hi[l], value(2, l) | value(3, l) << 16) << "lane " << l;
  }
}

}  // namespace
}  // namespace megamoe::cuda
