// The routing plan: where every routed row of every rank lands in the
// expert-major pool of the rank that owns the expert. Layout and ordering
// rules are in docs/routing-plan.md; the per-element formulas below are
// __host__ __device__ so the GPU plan kernels compute exactly the same plan.
//
// The only input the formulas need besides a rank's own topk_idx is the
// all-gathered count matrix
//   counts[s * E + e] = number of tokens of source rank s routed to global expert e
// (int32, [P, E]), which every rank holds after one exchange. From it:
//   expert e is owned by rank e / L, local id e % L (L = E / P);
//   owner d's pool: local expert l's segment starts at
//       expert_offset(d, l) = sum_{l' < l} align128(sum_s counts[s, d*L + l'])
//   and within the segment the rows of source s start at
//       source_offset(d, l, s) = sum_{s' < s} counts[s', d*L + l];
//   the r-th token (in token order) of source s routed to e gets pool row
//       expert_offset + source_offset + r.
// No atomics decide a row: the order is (source rank, token) and deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "core/host_device.h"
#include "megamoe/problem.h"
#include "megamoe/status.h"

namespace megamoe {

struct RoutingShape {
  int num_ranks = 1;               // P
  int num_experts = 0;             // E (global)
  int top_k = 0;                   // k
  int64_t max_tokens_per_rank = 0;

  MEGAMOE_HD int experts_per_rank() const { return num_experts / num_ranks; }
};

MEGAMOE_HD int64_t align_pool_rows(int64_t rows) {
  return (rows + kPoolRowAlign - 1) / kPoolRowAlign * kPoolRowAlign;
}
MEGAMOE_HD int owner_rank(int expert, int experts_per_rank) { return expert / experts_per_rank; }
MEGAMOE_HD int local_expert(int expert, int experts_per_rank) { return expert % experts_per_rank; }

// Rows a local expert receives from every source rank.
MEGAMOE_HD int64_t expert_total_rows(const int32_t* counts, const RoutingShape& s, int owner, int local) {
  const int e = owner * s.experts_per_rank() + local;
  int64_t n = 0;
  for (int src = 0; src < s.num_ranks; ++src) n += counts[src * s.num_experts + e];
  return n;
}

// First pool row of local expert `local` on rank `owner` (segments padded to 128).
MEGAMOE_HD int64_t expert_pool_offset(const int32_t* counts, const RoutingShape& s, int owner, int local) {
  int64_t off = 0;
  for (int l = 0; l < local; ++l) off += align_pool_rows(expert_total_rows(counts, s, owner, l));
  return off;
}

// Offset of source rank `src`'s rows inside expert e's segment.
MEGAMOE_HD int64_t source_offset_in_expert(const int32_t* counts, const RoutingShape& s, int expert, int src) {
  int64_t off = 0;
  for (int r = 0; r < src; ++r) off += counts[r * s.num_experts + expert];
  return off;
}

// Worst-case pool rows on one rank: every token of every rank routed to min(k, L)
// of this rank's experts, and up to 127 padding rows for each local expert.
MEGAMOE_HD int64_t pool_capacity_rows(const RoutingShape& s) {
  const int L = s.experts_per_rank();
  const int64_t per_token = s.top_k < L ? s.top_k : L;
  return align_pool_rows(static_cast<int64_t>(s.num_ranks) * s.max_tokens_per_rank * per_token +
                         static_cast<int64_t>(L) * (kPoolRowAlign - 1));
}

// Where a pool row came from; rank == -1 marks a padding row.
struct RowSource {
  int32_t rank = -1;
  int32_t token = -1;
  int32_t slot = -1;
};

// One rank's part of the plan, as a source of routes and as an owner of experts.
struct RankPlan {
  int64_t num_tokens = 0;
  // As a source: pool row (on the owner) of route (t, j), -1 when topk_idx is -1.  [T * k]
  std::vector<int64_t> route_pool_row;
  // As an owner, per local expert: real rows, and padded segment offsets  [L], [L + 1]
  std::vector<int64_t> expert_rows;
  std::vector<int64_t> expert_offset;
  // As an owner: the source of every pool row in [0, expert_offset[L]).
  std::vector<RowSource> row_source;
  int64_t pool_rows() const { return expert_offset.empty() ? 0 : expert_offset.back(); }
};

struct RoutingPlan {
  RoutingShape shape;
  std::vector<int32_t> counts;  // [P, E] as described above
  std::vector<RankPlan> ranks;  // [P]
};

// Checks one rank's routing: T <= max_tokens_per_rank, every id in [-1, E),
// no token routed twice to the same expert. Messages name rank, token and slot.
Status validate_routing(const RoutingShape& shape, int rank, int64_t num_tokens, const int32_t* topk_idx);
Status validate_routing_shape(const RoutingShape& shape);

// Builds the plan for all P ranks (validating every rank first).
// topk_idx[r] points to rank r's [num_tokens[r], k] int32 array.
Status build_routing_plan(const RoutingShape& shape, const std::vector<const int32_t*>& topk_idx,
                          const std::vector<int64_t>& num_tokens, RoutingPlan* plan);

// Checks every invariant of a plan against the routing it was built from;
// returns the first violated one. Used by tests and the fuzzer.
Status check_plan_invariants(const RoutingPlan& plan, const std::vector<const int32_t*>& topk_idx,
                             const std::vector<int64_t>& num_tokens);

}  // namespace megamoe
