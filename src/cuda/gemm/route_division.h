// Division of a route index by top_k without a divide: the gathering
// producers turn pool rows' routes (token * top_k + slot) into token rows
// once per row, and an integer divide costs ~20 instructions of the
// producer warps' few issue slots. Host and device (the CPU test checks it
// against `/`).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace megamoe::cuda {

// n / d for every n < 2^31 and 1 <= d < 2^31 as (mulhi(n, m) + n) >> l, with
// l = ceil(log2 d) and m = 2^32 (2^l - d) / d + 1: the 33-bit magic 2^32 + m
// is floor(2^(32 + l) / d) + 1 (the round-up method; the sum stays below
// 2^32 because mulhi(n, m) <= n < 2^31).
struct RouteDivisor {
  uint32_t m = 1;
  int l = 0;

  MEGAMOE_HD static RouteDivisor of(uint32_t d) {
    RouteDivisor r;
    while ((uint64_t{1} << r.l) < d) ++r.l;
    r.m = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << r.l) - d) / d + 1);
    return r;
  }
  MEGAMOE_HD uint32_t divide(uint32_t n) const {
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * m) >> 32);
    return (hi + n) >> l;
  }
};

}  // namespace megamoe::cuda
