// RouteDivisor (the gathering producers' route / top_k) against `/`.
#include "cuda/gemm/route_division.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace megamoe::cuda {
namespace {

int64_t wrong_quotients(uint32_t d, const std::vector<uint32_t>& ns) {
  const RouteDivisor div = RouteDivisor::of(d);
  int64_t wrong = 0;
  for (const uint32_t n : ns) wrong += div.divide(n) != n / d;
  return wrong;
}

TEST(RouteDivisor, EqualsDivisionForEveryRoute) {
  std::vector<uint32_t> ns;
  for (uint32_t n = 0; n < (1u << 20); ++n) ns.push_back(n);  // every small route
  for (uint32_t n = (1u << 31) - (1u << 16); n < (1u << 31); ++n) ns.push_back(n);  // the largest ones
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) ns.push_back(static_cast<uint32_t>(rng() >> 1));
  std::vector<uint32_t> ds;
  for (uint32_t d = 1; d <= 64; ++d) ds.push_back(d);
  for (const uint32_t d : {100u, 127u, 129u, 1000u, 65535u, 65537u, (1u << 30) + 1, (1u << 31) - 1}) ds.push_back(d);
  for (const uint32_t d : ds) EXPECT_EQ(wrong_quotients(d, ns), 0) << "top_k " << d;
}

// Multiples of d and their neighbours, where a magic number one off goes wrong first.
TEST(RouteDivisor, EqualsDivisionAtTheQuotientsEdges) {
  for (uint32_t d = 1; d <= 300; ++d) {
    std::vector<uint32_t> ns;
    for (uint64_t q = (uint64_t{1} << 31) / d - 2000; q <= (uint64_t{1} << 31) / d; ++q)
      for (const int64_t e : {-1, 0, 1}) {
        const int64_t n = static_cast<int64_t>(q * d) + e;
        if (n >= 0 && n < (int64_t{1} << 31)) ns.push_back(static_cast<uint32_t>(n));
      }
    EXPECT_EQ(wrong_quotients(d, ns), 0) << "top_k " << d;
  }
}

}  // namespace
}  // namespace megamoe::cuda
