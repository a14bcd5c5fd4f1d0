#include "core/routing_plan.h"

#include <string>

namespace megamoe {
namespace {
std::string s(int64_t v) { return std::to_string(v); }
}  // namespace

Status validate_routing_shape(const RoutingShape& shape) {
  if (shape.num_ranks < 1) return invalid_argument("ep_size = " + s(shape.num_ranks) + " must be >= 1");
  if (shape.num_experts < 1) return invalid_argument("num_experts = " + s(shape.num_experts) + " must be >= 1");
  if (shape.num_experts % shape.num_ranks != 0)
    return invalid_argument("num_experts = " + s(shape.num_experts) + " is not divisible by ep_size = " +
                            s(shape.num_ranks));
  if (shape.top_k < 1 || shape.top_k > shape.num_experts)
    return invalid_argument("top_k = " + s(shape.top_k) + " must be in [1, num_experts = " +
                            s(shape.num_experts) + "]");
  if (shape.max_tokens_per_rank < 0)
    return invalid_argument("max_tokens_per_rank = " + s(shape.max_tokens_per_rank) + " is negative");
  return Status::Ok();
}

Status validate_routing(const RoutingShape& shape, int rank, int64_t num_tokens, const int32_t* topk_idx) {
  const std::string who = shape.num_ranks > 1 ? "rank " + s(rank) + ": " : "";
  if (num_tokens < 0) return invalid_argument(who + "num_tokens = " + s(num_tokens) + " is negative");
  if (num_tokens > shape.max_tokens_per_rank)
    return capacity_error(who + "num_tokens = " + s(num_tokens) + " exceeds max_tokens_per_rank = " +
                          s(shape.max_tokens_per_rank));
  if (num_tokens > 0 && topk_idx == nullptr) return invalid_argument(who + "topk_idx is null");
  const int k = shape.top_k;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* row = topk_idx + t * k;
    for (int j = 0; j < k; ++j) {
      const int32_t e = row[j];
      if (e < -1 || e >= shape.num_experts)
        return invalid_argument(who + "topk_idx[" + s(t) + "," + s(j) + "] = " + s(e) +
                                " is out of range [-1, num_experts = " + s(shape.num_experts) + ")");
      if (e < 0) continue;
      for (int j2 = 0; j2 < j; ++j2)
        if (row[j2] == e)
          return invalid_argument(who + "token " + s(t) + " is routed twice to expert " + s(e) + " (topk_idx[" +
                                  s(t) + "," + s(j2) + "] and topk_idx[" + s(t) + "," + s(j) + "])");
    }
  }
  return Status::Ok();
}

Status build_routing_plan(const RoutingShape& shape, const std::vector<const int32_t*>& topk_idx,
                          const std::vector<int64_t>& num_tokens, RoutingPlan* plan) {
  MEGAMOE_RETURN_IF_ERROR(validate_routing_shape(shape));
  const int P = shape.num_ranks, E = shape.num_experts, k = shape.top_k, L = shape.experts_per_rank();
  if (static_cast<int>(topk_idx.size()) != P || static_cast<int>(num_tokens.size()) != P)
    return invalid_argument("routing plan: expected topk_idx and num_tokens for " + s(P) + " ranks, got " +
                            s(static_cast<int64_t>(topk_idx.size())) + " and " +
                            s(static_cast<int64_t>(num_tokens.size())));
  for (int r = 0; r < P; ++r) MEGAMOE_RETURN_IF_ERROR(validate_routing(shape, r, num_tokens[r], topk_idx[r]));

  plan->shape = shape;
  plan->counts.assign(static_cast<size_t>(P) * E, 0);
  plan->ranks.assign(P, RankPlan{});

  // 1. Each source counts its routes per global expert (the exchange is implicit here).
  for (int src = 0; src < P; ++src)
    for (int64_t i = 0; i < num_tokens[src] * k; ++i)
      if (topk_idx[src][i] >= 0) ++plan->counts[static_cast<size_t>(src) * E + topk_idx[src][i]];
  const int32_t* counts = plan->counts.data();

  // 2. Owners lay out their pools.
  for (int d = 0; d < P; ++d) {
    RankPlan& rp = plan->ranks[d];
    rp.num_tokens = num_tokens[d];
    rp.expert_rows.resize(L);
    rp.expert_offset.resize(L + 1);
    for (int l = 0; l < L; ++l) {
      rp.expert_rows[l] = expert_total_rows(counts, shape, d, l);
      rp.expert_offset[l] = expert_pool_offset(counts, shape, d, l);
    }
    rp.expert_offset[L] = L == 0 ? 0 : rp.expert_offset[L - 1] + align_pool_rows(rp.expert_rows[L - 1]);
    rp.row_source.assign(static_cast<size_t>(rp.pool_rows()), RowSource{});
  }

  // 3. Sources give each route its row: a running count per expert over tokens
  //    in order (an exclusive prefix sum on the device).
  std::vector<int64_t> next(E);
  for (int src = 0; src < P; ++src) {
    RankPlan& sp = plan->ranks[src];
    sp.route_pool_row.assign(static_cast<size_t>(num_tokens[src]) * k, -1);
    for (int e = 0; e < E; ++e) {
      const int d = owner_rank(e, L), l = local_expert(e, L);
      next[e] = plan->ranks[d].expert_offset[l] + source_offset_in_expert(counts, shape, e, src);
    }
    for (int64_t t = 0; t < num_tokens[src]; ++t)
      for (int j = 0; j < k; ++j) {
        const int32_t e = topk_idx[src][t * k + j];
        if (e < 0) continue;
        const int64_t row = next[e]++;
        sp.route_pool_row[t * k + j] = row;
        plan->ranks[owner_rank(e, L)].row_source[row] =
            RowSource{src, static_cast<int32_t>(t), static_cast<int32_t>(j)};
      }
  }
  return Status::Ok();
}

Status check_plan_invariants(const RoutingPlan& plan, const std::vector<const int32_t*>& topk_idx,
                             const std::vector<int64_t>& num_tokens) {
  const RoutingShape& sh = plan.shape;
  const int P = sh.num_ranks, E = sh.num_experts, k = sh.top_k, L = sh.experts_per_rank();
  auto fail = [](const std::string& m) { return internal_error("plan invariant: " + m); };
  if (static_cast<int>(plan.ranks.size()) != P || static_cast<int>(topk_idx.size()) != P ||
      static_cast<int>(num_tokens.size()) != P || plan.counts.size() != static_cast<size_t>(P) * E)
    return fail("plan, topk_idx and num_tokens must all describe P ranks");
  for (int r = 0; r < P; ++r) {
    const RankPlan& rp = plan.ranks[r];
    if (rp.expert_rows.size() != static_cast<size_t>(L) || rp.expert_offset.size() != static_cast<size_t>(L + 1) ||
        rp.row_source.size() != static_cast<size_t>(rp.pool_rows()) ||
        rp.route_pool_row.size() != static_cast<size_t>(num_tokens[r] * k))
      return fail("rank " + s(r) + ": plan arrays have the wrong sizes");
  }
  const int64_t capacity = pool_capacity_rows(sh);

  // Counts equal the routes, and sum to the number of valid routes.
  std::vector<int32_t> counts(static_cast<size_t>(P) * E, 0);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < num_tokens[r] * k; ++i)
      if (topk_idx[r][i] >= 0) ++counts[static_cast<size_t>(r) * E + topk_idx[r][i]];
  if (counts != plan.counts) return fail("counts differ from a recount of topk_idx");

  for (int d = 0; d < P; ++d) {
    const RankPlan& rp = plan.ranks[d];
    if (rp.expert_offset.size() != static_cast<size_t>(L + 1) || rp.expert_offset[0] != 0)
      return fail("rank " + s(d) + ": expert_offset must have L+1 entries starting at 0");
    if (rp.pool_rows() > capacity)
      return fail("rank " + s(d) + ": pool rows " + s(rp.pool_rows()) + " exceed capacity " + s(capacity));
    for (int l = 0; l < L; ++l) {
      const int64_t b = rp.expert_offset[l], n = rp.expert_rows[l];
      if (b % kPoolRowAlign != 0) return fail("rank " + s(d) + ": expert " + s(l) + " offset not 128-aligned");
      if (rp.expert_offset[l + 1] != b + align_pool_rows(n))
        return fail("rank " + s(d) + ": expert " + s(l) + " segment is not its rows padded to 128");
      // Real rows first, in (source rank, token) order, all routed to this expert; padding after.
      int64_t prev_key = -1;
      for (int64_t row = b; row < rp.expert_offset[l + 1]; ++row) {
        const RowSource& src = rp.row_source[row];
        if (row >= b + n) {
          if (src.rank != -1) return fail("rank " + s(d) + ": padding row " + s(row) + " has a source");
          continue;
        }
        if (src.rank < 0 || src.rank >= P || src.token < 0 || src.token >= num_tokens[src.rank] ||
            src.slot < 0 || src.slot >= k)
          return fail("rank " + s(d) + ": row " + s(row) + " has no valid source");
        if (topk_idx[src.rank][src.token * k + src.slot] != d * L + l)
          return fail("rank " + s(d) + ": row " + s(row) + " is in the wrong expert segment");
        if (plan.ranks[src.rank].route_pool_row[src.token * k + src.slot] != row)
          return fail("rank " + s(d) + ": row " + s(row) + " and its route disagree");
        const int64_t key = static_cast<int64_t>(src.rank) * (sh.max_tokens_per_rank + 1) + src.token;
        if (key <= prev_key) return fail("rank " + s(d) + ": rows of expert " + s(l) + " not in (rank, token) order");
        prev_key = key;
      }
    }
  }
  // Every valid route has a row; -1 routes have none.
  for (int r = 0; r < P; ++r) {
    const RankPlan& sp = plan.ranks[r];
    for (int64_t i = 0; i < num_tokens[r] * k; ++i) {
      const int32_t e = topk_idx[r][i];
      const int64_t row = sp.route_pool_row[i];
      if (e < 0) {
        if (row != -1) return fail("rank " + s(r) + ": a -1 route got a pool row");
        continue;
      }
      const RankPlan& owner = plan.ranks[owner_rank(e, L)];
      if (row < 0 || row >= owner.pool_rows()) return fail("rank " + s(r) + ": route row out of the pool");
      const RowSource& back = owner.row_source[row];
      if (back.rank != r || back.token != i / k || back.slot != i % k)
        return fail("rank " + s(r) + ": route " + s(i) + " does not map back to itself");
    }
  }
  return Status::Ok();
}

}  // namespace megamoe
