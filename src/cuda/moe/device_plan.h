// The routing plan built on the device for one rank (P = 1): the same layout
// and order as src/core/routing_plan.h (docs/routing-plan.md), computed with
// per-chunk counts and prefix sums, no atomics on positions, no host sync.
//
// Byte layout inside the workspace (see workspace.h for the carve-out):
//   error_key      u64  [1]              min over bad routes of ((t*k + j) << 2 | kind)
//   chunk_counts   i32  [chunks, E]       per 256-token chunk counts, then exclusive bases
//   expert_rows    i32  [E]
//   expert_offset  i32  [E + 1]           [E] = pool rows used (multiple of 128)
//   tile_expert    i32  [capacity / 128]
//   route_row      i32  [T_max, k]        pool row of route (t, j), -1 = none
//   row_src        i32  [capacity]        t * k + j of each pool row, -1 = padding
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/status.h"

namespace megamoe::cuda {

inline constexpr int kPlanChunk = 256;  // tokens per chunk of the count/assign kernels
inline constexpr int kMaxTopK = 32;

// Error kinds packed in the low 2 bits of error_key.
enum PlanErrorKind : uint32_t { kPlanErrorOutOfRange = 1, kPlanErrorDuplicate = 2 };
inline constexpr unsigned long long kNoPlanError = ~0ull;

struct DevicePlanBuffers {
  unsigned long long* error_key;
  int32_t* chunk_counts;
  int32_t* expert_rows;
  int32_t* expert_offset;
  int32_t* tile_expert;
  int32_t* route_row;
  int32_t* row_src;
};

// Builds the plan of `num_tokens` tokens on `stream` (4 launches + 1 memset).
Status build_device_plan(const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                         const DevicePlanBuffers& buffers, cudaStream_t stream);

}  // namespace megamoe::cuda
