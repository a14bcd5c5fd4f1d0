// A 4 x 4 transpose of 16-bit values across the 4 lanes of a quad, so that an
// epilogue can store e4m3 bytes as whole 32-byte sectors.
//
// In a wgmma accumulator the quad's lane l holds columns 8 j + 2 l and + 1 of
// a row for each 8-column group j. Turned into e4m3 that is 2 bytes per lane
// per group: stored as they stand, a warp's store writes 8 bytes into each of
// 8 sectors (kDownGrad's dz_q ran 3x slower so). Over 4 groups j = 0 .. 3 (32
// columns) lane l has m[l][j]; after the transpose it has m[0 .. 3][l], the 8
// bytes of group l in column order, one 8-byte store, and the quad together
// fills the row's 32-byte sector.
//
// Host and device: `exchange(v, mask)` returns lane (l ^ mask)'s v (on the
// device __shfl_xor_sync; the CPU test passes a simulated quad).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace megamoe::cuda {

// The low (hi = false) or high 16 bits of w.
MEGAMOE_HD uint32_t half16(uint32_t w, bool hi) { return hi ? w >> 16 : w & 0xFFFFu; }

// in_lo = m[l][0] | m[l][1] << 16, in_hi = m[l][2] | m[l][3] << 16 on lane l;
// returns m[0][l] | m[1][l] << 16 (.x) and m[2][l] | m[3][l] << 16 (.y).
template <typename Exchange>
MEGAMOE_HD void quad_transpose16(int lane, uint32_t in_lo, uint32_t in_hi, Exchange exchange, uint32_t& out_lo,
                                 uint32_t& out_hi) {
  const bool b1 = (lane & 2) != 0, b0 = (lane & 1) != 0;
  // Step 1, lanes l and l ^ 2: keep the word of groups {2 b1, 2 b1 + 1}, trade the other.
  const uint32_t own = b1 ? in_hi : in_lo;
  const uint32_t other = exchange(b1 ? in_lo : in_hi, 2);  // m[l ^ 2][2 b1], m[l ^ 2][2 b1 + 1]
  // Step 2, lanes l and l ^ 1: keep group 2 b1 + b0 (= l) of both words, trade the other group.
  const uint32_t keep = half16(own, b0) | half16(other, b0) << 16;   // m[l][l], m[l ^ 2][l]
  const uint32_t send = half16(own, !b0) | half16(other, !b0) << 16;
  const uint32_t got = exchange(send, 1);                            // m[l ^ 1][l], m[l ^ 3][l]
  // keep and got hold sources {l, l ^ 2} and {l ^ 1, l ^ 3}: the even pair
  // {0, 2} is keep's when b0 = 0, got's when b0 = 1, the odd pair the other;
  // source 0 (and 1) sits in the pair's low half when b1 = 0, high when 1.
  const uint32_t even = b0 ? got : keep, odd = b0 ? keep : got;
  out_lo = half16(even, b1) | half16(odd, b1) << 16;    // sources 0, 1
  out_hi = half16(even, !b1) | half16(odd, !b1) << 16;  // sources 2, 3
}

}  // namespace megamoe::cuda
