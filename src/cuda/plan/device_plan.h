// The routing plan built on the device for one rank (P = 1): the same layout
// and order as src/core/routing_plan.h (docs/routing-plan.md), computed with
// per-chunk counts and prefix sums, no atomics on positions, no host sync.
//
// The buffers live in the layer's saved or scratch buffer; their byte layout
// is in core/layer_buffers.h (chunk_counts: per 256-token chunk counts, then
// exclusive bases, [ceil(T / 256), E]).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/layer_buffers.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

inline constexpr int kMaxTopK = 32;

// Error kinds packed in the low 2 bits of error_key.
// kPlanErrorPeer (key 3, route 0): an expert-parallel peer never returned its
// part (combine_wait): the combine then poisons its output as for a bad id.
enum PlanErrorKind : uint32_t { kPlanErrorOutOfRange = 1, kPlanErrorDuplicate = 2, kPlanErrorPeer = 3 };
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

// Only the plan's checks (ids in [-1, E), no expert twice in a token) into
// *error_key (reset first; kNoPlanError: none). For a rank whose own tokens
// are planned by their owners (expert parallelism), so that its combine can
// refuse a bad routing as the one-GPU layer does.
Status check_routing(const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                     unsigned long long* error_key, cudaStream_t stream);

// Builds the plan of `num_tokens` tokens on `stream` (3 launches + 1 memset).
Status build_device_plan(const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                         const DevicePlanBuffers& buffers, cudaStream_t stream);

}  // namespace megamoe::cuda
