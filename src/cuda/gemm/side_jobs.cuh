// Side jobs: memory-bound layer steps run by the producer warpgroup's three
// idle warps (1-3) of every CTA while the consumers run a compute-bound
// GEMM, instead of taking the GPU for kernels of their own. Device code;
// included by kernel.cuh.
//
// GroupedGemmArgs::side_combine: a slot combine (combine_slots' sums, bit
// for bit: moe/slot_sums.cuh; dx's combine: 144 us at Qwen3-30B-A3B, 280 at
// 235B as a kernel).
//
// Warp w of the grid's 3 x gridDim.x takes tokens begin + w, + 3 gridDim.x, ...:
// lane j loads route j's expert id once a token, the warp's ballot of the
// valid ones is the same for all lanes, and the lanes walk the row's 16-byte
// chunks (32 a step), adding the routes' chunks in route order, kSideLoads
// loads in flight a lane (the bf16 producers' 56 registers hold four; in 40
// ptxas kept one, and the kernels hosting side jobs were 20-40% slower).
// So that those loads find L2, a token's start asks L2 (prefetch.global.L2)
// for every slot sector of the warp's next token (top_k rows, 32 bytes a
// prefetch, the lanes in turn): ~13 us of work a token at Qwen3-30B-A3B hides the
// DRAM latency, and no register stays live for it in the chunk loop.
#pragma once

#include <cstdint>

#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/layer/slot_sums.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

using ptx::prefetch_l2;

// Loads in flight a lane; the side jobs run in bf16 kernels only (RegisterSplit<false>).
inline constexpr int kSideLoads = 4;
static_assert(register_split(ElemType::kBF16).producer >= 56, "four side-job loads in flight need 56 producer registers");

__device__ __forceinline__ void run_side_combine(const SideCombine& s, const DeviceErrorSink& errors) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * 3 + (threadIdx.x / 32 - 1), warps = 3 * gridDim.x;
  const unsigned long long key = *s.error_key;
  const bool failed = key != kNoPlanError;
  if (failed && s.begin == 0 && blockIdx.x == 0 && threadIdx.x == 32)  // one report for the launches of a combine
    report_failed_plan(errors, key, s.topk_idx, s.tokens, s.top_k, s.num_experts);
  const int chunks = static_cast<int>(s.hidden / 8);  // 16-byte chunks a row
  const int64_t plane = s.slot_tokens * chunks;        // one route's slot rows, in chunks
  const uint4* slots = static_cast<const uint4*>(s.slots);
  uint4* out = static_cast<uint4*>(s.out);
  // The slot rows of token t (all top_k routes) into L2, one prefetch a
  // 32-byte sector (what L2 fills on a miss), the lanes in turn.
  auto prefetch_token = [&](int64_t t) {
    for (int j = 0; j < s.top_k; ++j)
      for (int c = lane * 2; c < chunks; c += 32 * 2) prefetch_l2(slots + j * plane + t * chunks + c);
  };
  if (s.begin + warp < s.end) prefetch_token(s.begin + warp);
  for (int64_t t = s.begin + warp; t < s.end; t += warps) {
    if (t + warps < s.end) prefetch_token(t + warps);
    const int32_t id = lane < s.top_k ? s.topk_idx[t * s.top_k + lane] : -1;
    const uint32_t valid = __ballot_sync(0xffffffffu, id >= 0 && id < s.num_experts);
    const uint4* row = slots + t * chunks;
    for (int c = lane; c < chunks; c += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (uint32_t left = valid; left != 0;) {  // up to kSideLoads routes at once, in j order
        uint4 v[kSideLoads];
        int n = 0;
#pragma unroll
        for (int q = 0; q < kSideLoads; ++q) {
          if (left == 0) break;
          const int j = __ffs(static_cast<int>(left)) - 1;
          left &= left - 1;
          v[q] = row[j * plane + c];
          n = q + 1;
        }
#pragma unroll
        for (int q = 0; q < kSideLoads; ++q)
          if (q < n) add_slot_chunk(acc, v[q]);
      }
      out[t * chunks + c] = finish_slot_chunk(acc, failed);
    }
  }
}

// Pool row r (chunks 16-byte chunks) as zeros, the warp's lanes in turn: a padding row.
__device__ __forceinline__ void zero_pool_row(void* pool, int r, int chunks, int lane) {
  uint4* to = static_cast<uint4*>(pool) + static_cast<int64_t>(r) * chunks;
  for (int c = lane; c < chunks; c += 32) to[c] = make_uint4(0, 0, 0, 0);
}

// SideGather::route_row: the scatter form, a warp a token row: lane j holds
// route j's pool row, the lanes load kSideLoads x 32 chunks of the token
// row and store them to each route's row in turn; then a warp a padding row.
__device__ __forceinline__ void run_side_scatter(const SideGather& s, int lane, int warp, int warps,
                                                 int chunks) {
  for (int t = warp; t < s.tokens; t += warps) {
    const int32_t mine = lane < s.top_k ? s.route_row[t * s.top_k + lane] : -1;
    const uint32_t routed = __ballot_sync(0xffffffffu, mine >= 0);
    const uint4* __restrict__ in = static_cast<const uint4*>(s.src) + static_cast<int64_t>(t) * chunks;
    // Every lane takes every step (the shuffles need the whole warp), its
    // chunks guarded: a row of fewer than 32 chunks, or a last step of
    // fewer, would otherwise leave lanes out of the shuffle.
    for (int c0 = 0; c0 < chunks; c0 += kSideLoads * 32) {
      uint4 v[kSideLoads];
#pragma unroll
      for (int q = 0; q < kSideLoads; ++q)
        if (c0 + lane + 32 * q < chunks) v[q] = __ldg(in + c0 + lane + 32 * q);
      for (uint32_t left = routed; left != 0; left &= left - 1) {
        const int row = __shfl_sync(0xffffffffu, mine, __ffs(static_cast<int>(left)) - 1);
        uint4* out = static_cast<uint4*>(s.pool) + static_cast<int64_t>(row) * chunks;
#pragma unroll
        for (int q = 0; q < kSideLoads; ++q)
          if (c0 + lane + 32 * q < chunks) out[c0 + lane + 32 * q] = v[q];
      }
    }
  }
  const int rows = *s.pool_rows;
  for (int r = warp; r < rows; r += warps) {
    if (s.row_src[r] < 0) zero_pool_row(s.pool, r, chunks, lane);  // (warp-uniform)
  }
}

// GroupedGemmArgs::side_gather: gather_rows' copy (pool row r = token row
// row_src[r] / top_k, zeros for a padding row, rows [0, *pool_rows)), a warp
// a pool row (x's pool for dW13: 255 us at 30B, 533 at 235B as a kernel).
// The warp looks the next row's source up a row ahead and asks L2 for its
// sectors, so that the copies' loads find L2. With rows_ready (kGateUp
// gathering its own A) each row is counted once in, and warp w's first row
// is row w: the first row tiles come in first, as the tiles want them.
__device__ __forceinline__ void run_side_gather(const SideGather& s) {
  // 32-bit rows (pool and token rows are ints): the producer warps have 56 registers.
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(blockIdx.x) * 3 + static_cast<int>(threadIdx.x / 32) - 1;
  const int warps = 3 * static_cast<int>(gridDim.x);
  const int chunks = static_cast<int>(s.width / 8);  // 16-byte chunks a row
  if (s.route_row != nullptr) return run_side_scatter(s, lane, warp, warps, chunks);
  const int rows = *s.pool_rows;
  auto source = [&](int r) {  // the token row of pool row r, -1 for padding
    const int32_t v = s.row_src[r];
    return v < 0 ? -1 : v / s.top_k;
  };
  auto token_row = [&](int v) { return static_cast<const uint4*>(s.src) + static_cast<int64_t>(v) * chunks; };
  int next = warp < rows ? source(warp) : -1;
  for (int r = warp; r < rows; r += warps) {
    const int from = next;
    next = r + warps < rows ? source(r + warps) : -1;
    if (next >= 0) {
      const uint4* ahead = token_row(next);
      for (int c = lane * 2; c < chunks; c += 64) prefetch_l2(ahead + c);
    }
    if (from < 0) {
      zero_pool_row(s.pool, r, chunks, lane);
    } else {
      const uint4* __restrict__ in = token_row(from);
      uint4* __restrict__ out = static_cast<uint4*>(s.pool) + static_cast<int64_t>(r) * chunks;
      for (int c0 = lane; c0 < chunks; c0 += kSideLoads * 32) {  // kSideLoads loads in flight, then their stores
        uint4 v[kSideLoads];
#pragma unroll
        for (int q = 0; q < kSideLoads; ++q)
          if (c0 + 32 * q < chunks) v[q] = __ldg(in + c0 + 32 * q);
#pragma unroll
        for (int q = 0; q < kSideLoads; ++q)
          if (c0 + 32 * q < chunks) out[c0 + 32 * q] = v[q];
      }
    }
    if (s.rows_ready != nullptr) {  // the row is in: every lane's stores fenced, then the count (a release)
      __threadfence();
      __syncwarp();
      if (lane == 0) atomicAdd(s.rows_ready + (r >> 7), 1u);
    }
  }
}

}  // namespace megamoe::cuda::engine
