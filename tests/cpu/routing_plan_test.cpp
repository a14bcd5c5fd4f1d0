// Tests of the routing plan: where each routed row lands in the owners'
// expert-major pools. Every plan is compared with one computed here
// independently (a direct scan in (owner, expert, source rank, token) order)
// and with a hand-worked example, besides check_plan_invariants; the
// validation tests check the status code and what the message names.
#include "core/routing_plan.h"
#include "testing/random_layer.h"

#include <gtest/gtest.h>

#include <ostream>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace megamoe {
namespace {

using Rng = megamoe::testing::SeededRng;

RoutingShape make_shape(int P, int E, int k, int64_t max_tokens) {
  RoutingShape s;
  s.num_ranks = P;
  s.num_experts = E;
  s.top_k = k;
  s.max_tokens_per_rank = max_tokens;
  return s;
}

// All ranks' topk_idx ([T_r, k] row-major each) and token counts.
struct Routing {
  RoutingShape shape;
  std::vector<std::vector<int32_t>> idx;
  std::vector<int64_t> tokens;

  std::vector<const int32_t*> ptrs() const {
    std::vector<const int32_t*> p;
    for (const auto& v : idx) p.push_back(v.empty() ? nullptr : v.data());
    return p;
  }
  Status build(RoutingPlan* plan) const { return build_routing_plan(shape, ptrs(), tokens, plan); }
  Status check(const RoutingPlan& plan) const { return check_plan_invariants(plan, ptrs(), tokens); }
  int32_t& at(int rank, int64_t t, int j) { return idx[rank][t * shape.top_k + j]; }
};

Routing empty_routing(const RoutingShape& shape, const std::vector<int64_t>& tokens) {
  Routing r;
  r.shape = shape;
  r.tokens = tokens;
  for (int64_t t : tokens) r.idx.emplace_back(static_cast<size_t>(t * shape.top_k), -1);
  return r;
}

// Each token picks min(k, used) distinct experts among experts [0, used), in
// random slots; each pick is then dropped to -1 with probability `drop`.
Routing random_routing(Rng& rng, const RoutingShape& shape, const std::vector<int64_t>& tokens, double drop,
                       int used) {
  Routing r = empty_routing(shape, tokens);
  const int k = shape.top_k;
  std::vector<int32_t> pool(used), slots(k);
  for (int p = 0; p < static_cast<int>(tokens.size()); ++p)
    for (int64_t t = 0; t < tokens[p]; ++t) {
      for (int i = 0; i < used; ++i) pool[i] = i;
      for (int j = 0; j < k; ++j) slots[j] = j;
      const int picks = std::min(k, used);
      for (int i = 0; i < picks; ++i) {  // partial Fisher-Yates on experts and on slots
        std::swap(pool[i], pool[rng.between(i, used - 1)]);
        std::swap(slots[i], slots[rng.between(i, k - 1)]);
        if (rng.unit() >= drop) r.at(p, t, slots[i]) = pool[i];
      }
    }
  return r;
}

std::vector<int64_t> same_tokens(int P, int64_t T) { return std::vector<int64_t>(P, T); }

// The plan computed directly from the layout rules, without the library's
// prefix-sum formulas: owners in order, their experts in order, and within an
// expert every (source rank, token, slot) routed to it in order.
struct ExpectedPlan {
  std::vector<int32_t> counts;
  std::vector<std::vector<int64_t>> route_row;        // [P][T * k]
  std::vector<std::vector<int64_t>> expert_rows;      // [P][L]
  std::vector<std::vector<int64_t>> expert_offset;    // [P][L + 1]
  std::vector<std::vector<RowSource>> row_source;     // [P][pool rows]
};

ExpectedPlan expected_plan(const Routing& r) {
  const int P = r.shape.num_ranks, E = r.shape.num_experts, k = r.shape.top_k, L = E / P;
  ExpectedPlan x;
  x.counts.assign(static_cast<size_t>(P) * E, 0);
  x.route_row.resize(P);
  x.expert_rows.resize(P);
  x.expert_offset.resize(P);
  x.row_source.resize(P);
  for (int s = 0; s < P; ++s) {
    x.route_row[s].assign(static_cast<size_t>(r.tokens[s] * k), -1);
    for (int32_t e : r.idx[s])
      if (e >= 0) ++x.counts[static_cast<size_t>(s) * E + e];
  }
  for (int d = 0; d < P; ++d) {
    x.expert_offset[d].push_back(0);
    for (int l = 0; l < L; ++l) {
      const int e = d * L + l;
      int64_t n = 0;
      for (int s = 0; s < P; ++s)
        for (int64_t t = 0; t < r.tokens[s]; ++t)
          for (int j = 0; j < k; ++j)
            if (r.idx[s][t * k + j] == e) {
              x.route_row[s][t * k + j] = x.expert_offset[d].back() + n++;
              x.row_source[d].push_back(RowSource{s, static_cast<int32_t>(t), j});
            }
      x.expert_rows[d].push_back(n);
      while (x.row_source[d].size() % 128 != 0) x.row_source[d].push_back(RowSource{});  // padding
      x.expert_offset[d].push_back(static_cast<int64_t>(x.row_source[d].size()));
    }
  }
  return x;
}

void expect_plan_is(const RoutingPlan& plan, const ExpectedPlan& x) {
  ASSERT_EQ(plan.counts, x.counts);
  ASSERT_EQ(plan.ranks.size(), x.route_row.size());
  for (size_t d = 0; d < plan.ranks.size(); ++d) {
    const RankPlan& rp = plan.ranks[d];
    ASSERT_EQ(rp.route_pool_row, x.route_row[d]) << "rank " << d;
    ASSERT_EQ(rp.expert_rows, x.expert_rows[d]) << "rank " << d;
    ASSERT_EQ(rp.expert_offset, x.expert_offset[d]) << "rank " << d;
    ASSERT_EQ(rp.pool_rows(), static_cast<int64_t>(x.row_source[d].size())) << "rank " << d;
    ASSERT_EQ(rp.row_source.size(), x.row_source[d].size()) << "rank " << d;
    for (size_t i = 0; i < rp.row_source.size(); ++i) {
      const RowSource &got = rp.row_source[i], &want = x.row_source[d][i];
      ASSERT_TRUE(got.rank == want.rank && got.token == want.token && got.slot == want.slot)
          << "rank " << d << " pool row " << i << ": got (" << got.rank << "," << got.token << "," << got.slot
          << ") want (" << want.rank << "," << want.token << "," << want.slot << ")";
    }
  }
}

int64_t round_up_128(int64_t n) { return n % 128 == 0 ? n : n + 128 - n % 128; }

// Builds, checks the invariants, compares with the expected plan and checks
// the facts that follow from the counts alone.
void build_and_verify(const Routing& r, RoutingPlan* out = nullptr) {
  RoutingPlan plan;
  const Status st = r.build(&plan);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const Status inv = r.check(plan);
  ASSERT_TRUE(inv.ok()) << inv.to_string();
  ASSERT_NO_FATAL_FAILURE(expect_plan_is(plan, expected_plan(r)));

  const int P = r.shape.num_ranks, E = r.shape.num_experts, L = E / P;
  int64_t routes = 0, counted = 0;
  for (const auto& v : r.idx) routes += std::count_if(v.begin(), v.end(), [](int32_t e) { return e >= 0; });
  for (int32_t c : plan.counts) counted += c;
  EXPECT_EQ(counted, routes);
  const int64_t capacity = round_up_128(static_cast<int64_t>(P) * r.shape.max_tokens_per_rank *
                                            std::min(r.shape.top_k, L) + static_cast<int64_t>(L) * 127);
  EXPECT_EQ(pool_capacity_rows(r.shape), capacity);
  for (int d = 0; d < P; ++d) {
    int64_t padded = 0;
    for (int l = 0; l < L; ++l) {
      int64_t n = 0;
      for (int s = 0; s < P; ++s) n += plan.counts[static_cast<size_t>(s) * E + d * L + l];
      padded += round_up_128(n);
    }
    EXPECT_EQ(plan.ranks[d].pool_rows(), padded) << "rank " << d;
    EXPECT_LE(plan.ranks[d].pool_rows(), capacity) << "rank " << d;
    EXPECT_EQ(plan.ranks[d].num_tokens, r.tokens[d]);
  }
  if (out) *out = plan;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Builds a routing that must be rejected; checks the code and message parts.
void expect_rejected(const Routing& r, StatusCode code, const std::vector<std::string>& parts) {
  RoutingPlan plan;
  const Status st = r.build(&plan);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), code) << st.to_string();
  for (const std::string& p : parts)
    EXPECT_TRUE(contains(st.message(), p)) << "'" << st.message() << "' lacks '" << p << "'";
}

// ---- a hand-worked example ------------------------------------------------

// P = 2, E = 4 (L = 2), k = 2, 3 tokens per rank.
//   rank 0: t0 -> {0, 2}, t1 -> {1, 0}, t2 -> {3, -1}
//   rank 1: t0 -> {2, 0}, t1 -> {-1, -1}, t2 -> {0, 3}
// Owner 0: expert 0 gets r0t0, r0t1, r1t0, r1t2 (rows 0..3); expert 1 gets r0t1
// at row 128. Owner 1: expert 2 gets r0t0, r1t0 (rows 0, 1); expert 3 gets
// r0t2, r1t2 (rows 128, 129).
Routing hand_routing() {
  Routing r;
  r.shape = make_shape(2, 4, 2, 3);
  r.tokens = {3, 3};
  r.idx = {{0, 2, 1, 0, 3, -1}, {2, 0, -1, -1, 0, 3}};
  return r;
}

TEST(RoutingPlanExample, HandWorkedPlan) {
  const Routing r = hand_routing();
  RoutingPlan plan;
  ASSERT_TRUE(r.build(&plan).ok());
  EXPECT_EQ(plan.counts, (std::vector<int32_t>{2, 1, 1, 1, 2, 0, 1, 1}));
  EXPECT_EQ(plan.ranks[0].route_pool_row, (std::vector<int64_t>{0, 0, 128, 1, 128, -1}));
  EXPECT_EQ(plan.ranks[1].route_pool_row, (std::vector<int64_t>{1, 2, -1, -1, 3, 129}));
  EXPECT_EQ(plan.ranks[0].expert_rows, (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(plan.ranks[1].expert_rows, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(plan.ranks[0].expert_offset, (std::vector<int64_t>{0, 128, 256}));
  EXPECT_EQ(plan.ranks[1].expert_offset, (std::vector<int64_t>{0, 128, 256}));
  EXPECT_EQ(plan.ranks[0].pool_rows(), 256);
  // (pool row, rank, token, slot) of every real row.
  const int64_t owner0[][4] = {{0, 0, 0, 0}, {1, 0, 1, 1}, {2, 1, 0, 1}, {3, 1, 2, 0}, {128, 0, 1, 0}};
  const int64_t owner1[][4] = {{0, 0, 0, 1}, {1, 1, 0, 0}, {128, 0, 2, 0}, {129, 1, 2, 1}};
  for (const auto& w : owner0) {
    const RowSource& s = plan.ranks[0].row_source[w[0]];
    EXPECT_TRUE(s.rank == w[1] && s.token == w[2] && s.slot == w[3]) << "owner 0 row " << w[0];
  }
  for (const auto& w : owner1) {
    const RowSource& s = plan.ranks[1].row_source[w[0]];
    EXPECT_TRUE(s.rank == w[1] && s.token == w[2] && s.slot == w[3]) << "owner 1 row " << w[0];
  }
  int real = 0;
  for (const RankPlan& rp : plan.ranks)
    for (const RowSource& s : rp.row_source) real += s.rank >= 0;
  EXPECT_EQ(real, 9);  // the 9 valid routes; every other row is padding
}

TEST(RoutingPlanExample, HostDeviceFormulasAgreeWithHandValues) {
  const Routing r = hand_routing();
  RoutingPlan plan;
  ASSERT_TRUE(r.build(&plan).ok());
  const int32_t* c = plan.counts.data();
  const RoutingShape& s = r.shape;
  EXPECT_EQ(s.experts_per_rank(), 2);
  EXPECT_EQ(expert_total_rows(c, s, 0, 0), 4);
  EXPECT_EQ(expert_total_rows(c, s, 0, 1), 1);
  EXPECT_EQ(expert_total_rows(c, s, 1, 0), 2);
  EXPECT_EQ(expert_total_rows(c, s, 1, 1), 2);
  EXPECT_EQ(expert_pool_offset(c, s, 0, 0), 0);
  EXPECT_EQ(expert_pool_offset(c, s, 0, 1), 128);
  EXPECT_EQ(expert_pool_offset(c, s, 1, 1), 128);
  EXPECT_EQ(source_offset_in_expert(c, s, 0, 0), 0);
  EXPECT_EQ(source_offset_in_expert(c, s, 0, 1), 2);  // rank 0 sent 2 rows to expert 0
  EXPECT_EQ(source_offset_in_expert(c, s, 1, 1), 1);
  EXPECT_EQ(source_offset_in_expert(c, s, 2, 1), 1);
  EXPECT_EQ(source_offset_in_expert(c, s, 3, 1), 1);
  EXPECT_EQ(owner_rank(3, 2), 1);
  EXPECT_EQ(local_expert(3, 2), 1);
  EXPECT_EQ(owner_rank(1, 2), 0);
  EXPECT_EQ(local_expert(2, 2), 0);
  // 2 ranks * 3 tokens * min(k, L) = 12 rows, + 2 * 127 padding = 266 -> 384.
  EXPECT_EQ(pool_capacity_rows(s), 384);
  // Every route's row is expert offset + source offset + its index among the
  // source's routes to that expert.
  for (int src = 0; src < 2; ++src) {
    std::vector<int64_t> seen(4, 0);
    for (int i = 0; i < 6; ++i) {
      const int e = r.idx[src][i];
      if (e < 0) continue;
      const int64_t want = expert_pool_offset(c, s, owner_rank(e, 2), local_expert(e, 2)) +
                           source_offset_in_expert(c, s, e, src) + seen[e]++;
      EXPECT_EQ(plan.ranks[src].route_pool_row[i], want) << "rank " << src << " route " << i;
    }
  }
}

TEST(RoutingPlanExample, AlignmentAndOwnershipHelpers) {
  EXPECT_EQ(align_pool_rows(0), 0);
  EXPECT_EQ(align_pool_rows(1), 128);
  EXPECT_EQ(align_pool_rows(127), 128);
  EXPECT_EQ(align_pool_rows(128), 128);
  EXPECT_EQ(align_pool_rows(129), 256);
  EXPECT_EQ(align_pool_rows(1000), 1024);
  for (int e = 0; e < 32; ++e) {
    EXPECT_EQ(owner_rank(e, 8), e / 8);
    EXPECT_EQ(local_expert(e, 8), e % 8);
    EXPECT_EQ(owner_rank(e, 8) * 8 + local_expert(e, 8), e);
  }
  // min(k, L) routes per token: k = 8 with L = 2 cannot put more than 2 rows per token on one owner.
  EXPECT_EQ(pool_capacity_rows(make_shape(4, 8, 8, 10)), align_pool_rows(4 * 10 * 2 + 2 * 127));
  EXPECT_EQ(pool_capacity_rows(make_shape(1, 8, 2, 0)), align_pool_rows(8 * 127));
}

// ---- random routings ----------------------------------------------------------

struct PlanParam {
  int P, E, k;
};
void PrintTo(const PlanParam& q, std::ostream* os) { *os << "P" << q.P << "_E" << q.E << "_k" << q.k; }

class RandomRoutingTest : public ::testing::TestWithParam<PlanParam> {};

TEST_P(RandomRoutingTest, PlanMatchesDirectLayout) {
  const PlanParam p = GetParam();
  Rng rng(static_cast<uint64_t>(p.P * 1000 + p.E * 10 + p.k));
  const int64_t max_tokens = 96;
  std::vector<std::vector<int64_t>> token_sets = {same_tokens(p.P, 96), same_tokens(p.P, 1), same_tokens(p.P, 37)};
  std::vector<int64_t> varied(p.P);
  for (int r = 0; r < p.P; ++r) varied[r] = (r * 29 + 5) % 97;  // a different T on every rank
  varied[0] = 0;  // and none on rank 0
  token_sets.push_back(varied);
  for (const auto& tokens : token_sets)
    for (double drop : {0.0, 0.1, 0.7}) {
      SCOPED_TRACE(::testing::Message() << "T[0]=" << tokens[0] << " T[last]=" << tokens.back() << " drop=" << drop);
      const Routing r = random_routing(rng, make_shape(p.P, p.E, p.k, max_tokens), tokens, drop, p.E);
      ASSERT_NO_FATAL_FAILURE(build_and_verify(r));
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RandomRoutingTest,
                         ::testing::Values(PlanParam{1, 8, 2}, PlanParam{2, 8, 2}, PlanParam{4, 16, 4},
                                           PlanParam{8, 128, 8}, PlanParam{8, 8, 8}, PlanParam{2, 4, 1},
                                           PlanParam{3, 6, 6}),
                         [](const ::testing::TestParamInfo<PlanParam>& param_info) {
                           const PlanParam& q = param_info.param;
                           return "P" + std::to_string(q.P) + "_E" + std::to_string(q.E) + "_k" + std::to_string(q.k);
                         });

// ---- adversarial routings -----------------------------------------------------

TEST(RoutingPlanAdversarial, EveryTokenToOneExpert) {
  for (int k : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "k=" << k);
    Rng rng(10 + static_cast<uint64_t>(k));
    // Slot 0 of every token of every rank goes to expert 5 (owner 1, local 1);
    // the other slots pick among the rest.
    Routing r = empty_routing(make_shape(4, 16, k, 300), same_tokens(4, 300));
    for (int p = 0; p < 4; ++p)
      for (int64_t t = 0; t < 300; ++t) {
        r.at(p, t, 0) = 5;
        for (int j = 1; j < k; ++j) {
          int32_t e;
          do e = rng.below(16);
          while (std::find(&r.at(p, t, 0), &r.at(p, t, 0) + j, e) != &r.at(p, t, 0) + j);
          r.at(p, t, j) = e;
        }
      }
    RoutingPlan plan;
    ASSERT_NO_FATAL_FAILURE(build_and_verify(r, &plan));
    EXPECT_EQ(plan.ranks[1].expert_rows[1], 4 * 300);  // no other slot can pick expert 5
    if (k == 1) {
      EXPECT_EQ(plan.ranks[1].expert_offset, (std::vector<int64_t>{0, 0, 1280, 1280, 1280}));
      EXPECT_EQ(plan.ranks[0].pool_rows(), 0);
    }
  }
}

TEST(RoutingPlanAdversarial, UnusedExpertsGetEmptySegments) {
  Rng rng(20);
  // Only experts 0..7 of 16 are used: owners 2 and 3 get nothing, and on
  // owners 0 and 1 the segments are the used experts' only.
  const Routing r = random_routing(rng, make_shape(4, 16, 3, 50), {50, 10, 0, 33}, 0.0, 8);
  RoutingPlan plan;
  ASSERT_NO_FATAL_FAILURE(build_and_verify(r, &plan));
  for (int d : {2, 3}) {
    EXPECT_EQ(plan.ranks[d].pool_rows(), 0);
    EXPECT_EQ(plan.ranks[d].expert_rows, (std::vector<int64_t>(4, 0)));
    EXPECT_EQ(plan.ranks[d].expert_offset, (std::vector<int64_t>(5, 0)));
    EXPECT_TRUE(plan.ranks[d].row_source.empty());
  }
  // Every expert on rank 0 or 1 that was used got at least one row.
  EXPECT_GT(plan.ranks[0].pool_rows(), 0);
  EXPECT_GT(plan.ranks[1].pool_rows(), 0);

  // Odd experts unused: each empty segment starts where the next one does.
  Routing odd = empty_routing(make_shape(2, 8, 2, 40), same_tokens(2, 40));
  for (int p = 0; p < 2; ++p)
    for (int64_t t = 0; t < 40; ++t) {
      odd.at(p, t, 0) = static_cast<int32_t>(2 * (t % 4));
      odd.at(p, t, 1) = static_cast<int32_t>(2 * ((t + 1) % 4));
    }
  ASSERT_NO_FATAL_FAILURE(build_and_verify(odd, &plan));
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(plan.ranks[d].expert_rows, (std::vector<int64_t>{40, 0, 40, 0}));
    EXPECT_EQ(plan.ranks[d].expert_offset, (std::vector<int64_t>{0, 128, 128, 256, 256}));
  }
}

TEST(RoutingPlanAdversarial, AllRoutesDropped) {
  const Routing r = empty_routing(make_shape(4, 8, 2, 20), {20, 5, 0, 1});  // all -1
  RoutingPlan plan;
  ASSERT_NO_FATAL_FAILURE(build_and_verify(r, &plan));
  for (const RankPlan& rp : plan.ranks) {
    EXPECT_EQ(rp.pool_rows(), 0);
    for (int64_t row : rp.route_pool_row) EXPECT_EQ(row, -1);
  }
  EXPECT_EQ(plan.ranks[0].route_pool_row.size(), 40u);
  for (int32_t c : plan.counts) EXPECT_EQ(c, 0);
}

TEST(RoutingPlanAdversarial, NoTokensOnAnyRank) {
  for (int P : {1, 3}) {
    Routing r = empty_routing(make_shape(P, 3 * P, 2, 0), same_tokens(P, 0));
    RoutingPlan plan;
    ASSERT_NO_FATAL_FAILURE(build_and_verify(r, &plan));  // ptrs() passes nullptr for empty ranks
    for (const RankPlan& rp : plan.ranks) {
      EXPECT_EQ(rp.pool_rows(), 0);
      EXPECT_TRUE(rp.route_pool_row.empty());
      EXPECT_EQ(rp.expert_offset.size(), 4u);
    }
  }
}

TEST(RoutingPlanAdversarial, NoTokensOnSomeRanksAndSingleTokens) {
  Rng rng(30);
  ASSERT_NO_FATAL_FAILURE(build_and_verify(random_routing(rng, make_shape(4, 8, 2, 64), {0, 64, 0, 7}, 0.2, 8)));
  ASSERT_NO_FATAL_FAILURE(build_and_verify(random_routing(rng, make_shape(4, 8, 2, 64), {64, 0, 0, 0}, 0.0, 8)));
  // T = 1 everywhere; and a single token on a single rank with k = E.
  ASSERT_NO_FATAL_FAILURE(build_and_verify(random_routing(rng, make_shape(4, 8, 2, 1), same_tokens(4, 1), 0.0, 8)));
  RoutingPlan plan;
  Routing one = empty_routing(make_shape(1, 4, 4, 1), {1});
  one.idx[0] = {3, 1, 0, 2};
  ASSERT_NO_FATAL_FAILURE(build_and_verify(one, &plan));
  EXPECT_EQ(plan.ranks[0].route_pool_row, (std::vector<int64_t>{384, 128, 0, 256}));
}

TEST(RoutingPlanAdversarial, TokensExactlyAtMaxTokensPerRank) {
  Rng rng(40);
  Routing r = random_routing(rng, make_shape(2, 8, 4, 200), {200, 200}, 0.0, 8);
  ASSERT_NO_FATAL_FAILURE(build_and_verify(r));
  r.shape.max_tokens_per_rank = 199;  // one token too many on both ranks
  expect_rejected(r, StatusCode::kCapacity, {"max_tokens_per_rank", "200", "199"});
}

TEST(RoutingPlanAdversarial, CapacityHoldsWhenOneOwnerTakesEverything) {
  // k = 8 and every token of every rank sends 4 of its routes to the 4 experts
  // of rank 0 (the most any token can put on one owner), at T = max_tokens.
  const int P = 4, E = 16, k = 8;
  const int64_t T = 100;
  Routing r = empty_routing(make_shape(P, E, k, T), same_tokens(P, T));
  for (int p = 0; p < P; ++p)
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) r.at(p, t, j) = static_cast<int32_t>(j < 4 ? j : 4 + (t + j) % 12);
  RoutingPlan plan;
  ASSERT_NO_FATAL_FAILURE(build_and_verify(r, &plan));
  // 400 rows per expert -> 512 each; capacity 4*100*4 + 4*127 = 2108 -> 2176.
  EXPECT_EQ(plan.ranks[0].pool_rows(), 2048);
  EXPECT_EQ(pool_capacity_rows(r.shape), 2176);
}

// ---- determinism and order -------------------------------------------------

TEST(RoutingPlanOrder, RebuildingGivesTheSamePlan) {
  Rng rng(50);
  const Routing r = random_routing(rng, make_shape(4, 32, 6, 120), {120, 77, 3, 100}, 0.15, 32);
  const Routing other = random_routing(rng, make_shape(2, 4, 2, 500), {500, 400}, 0.0, 4);
  RoutingPlan a, b;
  ASSERT_TRUE(r.build(&a).ok());
  // b first holds a bigger, different plan: building into it must replace it all.
  ASSERT_TRUE(other.build(&b).ok());
  ASSERT_TRUE(r.build(&b).ok());
  EXPECT_EQ(a.counts, b.counts);
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (size_t d = 0; d < a.ranks.size(); ++d) {
    EXPECT_EQ(a.ranks[d].route_pool_row, b.ranks[d].route_pool_row);
    EXPECT_EQ(a.ranks[d].expert_offset, b.ranks[d].expert_offset);
    EXPECT_EQ(a.ranks[d].expert_rows, b.ranks[d].expert_rows);
    ASSERT_EQ(a.ranks[d].row_source.size(), b.ranks[d].row_source.size());
    for (size_t i = 0; i < a.ranks[d].row_source.size(); ++i) {
      const RowSource &x = a.ranks[d].row_source[i], &y = b.ranks[d].row_source[i];
      ASSERT_TRUE(x.rank == y.rank && x.token == y.token && x.slot == y.slot) << d << " " << i;
    }
  }
  EXPECT_TRUE(r.check(b).ok());
}

TEST(RoutingPlanOrder, RowsOfAnExpertAreInSourceRankTokenOrder) {
  Rng rng(60);
  const Routing r = random_routing(rng, make_shape(4, 8, 3, 150), {150, 20, 149, 88}, 0.1, 8);
  RoutingPlan plan;
  ASSERT_TRUE(r.build(&plan).ok());
  const int L = 2, k = 3;
  for (int d = 0; d < 4; ++d)
    for (int l = 0; l < L; ++l) {
      const RankPlan& rp = plan.ranks[d];
      int prev_rank = -1, prev_token = -1;
      for (int64_t row = rp.expert_offset[l]; row < rp.expert_offset[l] + rp.expert_rows[l]; ++row) {
        const RowSource& s = rp.row_source[row];
        ASSERT_TRUE(s.rank > prev_rank || (s.rank == prev_rank && s.token > prev_token))
            << "owner " << d << " expert " << l << " row " << row;
        ASSERT_EQ(r.idx[s.rank][s.token * k + s.slot], d * L + l);  // and it belongs here
        prev_rank = s.rank;
        prev_token = s.token;
      }
    }
}

// ---- validation ----------------------------------------------------------------

TEST(RoutingPlanValidation, ExpertIdTooLarge) {
  Routing r = empty_routing(make_shape(1, 8, 2, 4), {4});
  r.idx[0] = {0, 1, 2, 3, 4, 5, 6, 7};
  r.at(0, 1, 1) = 8;
  expect_rejected(r, StatusCode::kInvalidArgument, {"topk_idx[1,1] = 8", "out of range"});
  r.at(0, 1, 1) = 1 << 30;
  expect_rejected(r, StatusCode::kInvalidArgument, {"topk_idx[1,1] = 1073741824", "out of range"});
}

TEST(RoutingPlanValidation, ExpertIdBelowMinusOne) {
  Routing r = empty_routing(make_shape(1, 8, 2, 4), {4});
  r.at(0, 2, 0) = -2;
  expect_rejected(r, StatusCode::kInvalidArgument, {"topk_idx[2,0] = -2", "out of range"});
  r.at(0, 2, 0) = INT32_MIN;
  expect_rejected(r, StatusCode::kInvalidArgument, {"topk_idx[2,0] = -2147483648"});
}

TEST(RoutingPlanValidation, TokenRoutedTwiceToTheSameExpert) {
  Routing r = empty_routing(make_shape(1, 8, 3, 4), {4});
  r.idx[0] = {0, 1, 2, 3, 4, 5, 6, -1, 6, 7, 0, 1};  // token 2: expert 6 in slots 0 and 2
  expect_rejected(r, StatusCode::kInvalidArgument, {"routed twice", "token 2", "expert 6"});
  r.idx[0] = {0, 1, 2, 3, 4, 5, 6, 7, 7, 1, 0, 2};  // token 2: expert 7 in adjacent slots 1 and 2
  expect_rejected(r, StatusCode::kInvalidArgument, {"routed twice", "token 2", "expert 7"});
  // Several -1 in one token are not duplicates.
  r.idx[0] = {0, -1, -1, 3, 4, 5, -1, -1, -1, 7, 0, 1};
  ASSERT_NO_FATAL_FAILURE(build_and_verify(r));
}

TEST(RoutingPlanValidation, MoreTokensThanMaxTokensPerRank) {
  Routing r = empty_routing(make_shape(2, 4, 1, 10), {10, 11});
  expect_rejected(r, StatusCode::kCapacity, {"max_tokens_per_rank", "11"});
  r.tokens = {-1, 0};
  expect_rejected(r, StatusCode::kInvalidArgument, {"num_tokens", "-1"});
}

TEST(RoutingPlanValidation, BadShapes) {
  expect_rejected(empty_routing(make_shape(3, 8, 2, 4), same_tokens(3, 4)), StatusCode::kInvalidArgument,
                  {"not divisible"});
  expect_rejected(empty_routing(make_shape(2, 4, 5, 4), same_tokens(2, 4)), StatusCode::kInvalidArgument,
                  {"top_k = 5"});
  expect_rejected(empty_routing(make_shape(2, 4, 0, 4), same_tokens(2, 0)), StatusCode::kInvalidArgument,
                  {"top_k = 0"});
  expect_rejected(empty_routing(make_shape(1, 0, 1, 4), same_tokens(1, 0)), StatusCode::kInvalidArgument,
                  {"num_experts = 0"});
  expect_rejected(empty_routing(make_shape(1, 4, 1, -1), same_tokens(1, 0)), StatusCode::kInvalidArgument,
                  {"max_tokens_per_rank"});
  Routing no_ranks = empty_routing(make_shape(1, 4, 1, 4), {});
  no_ranks.shape.num_ranks = 0;
  expect_rejected(no_ranks, StatusCode::kInvalidArgument, {"ep_size = 0"});
}

TEST(RoutingPlanValidation, WrongNumberOfRanksOrNullTopk) {
  const Routing r = empty_routing(make_shape(2, 4, 1, 4), same_tokens(2, 4));
  RoutingPlan plan;
  Status st = build_routing_plan(r.shape, {r.idx[0].data()}, r.tokens, &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(st.message(), "2 ranks")) << st.message();
  st = build_routing_plan(r.shape, r.ptrs(), {4, 4, 4}, &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  st = build_routing_plan(r.shape, {r.idx[0].data(), nullptr}, r.tokens, &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(st.message(), "rank 1") && contains(st.message(), "null")) << st.message();
}

TEST(RoutingPlanValidation, MessageNamesTheRank) {
  Rng rng(70);
  Routing r = random_routing(rng, make_shape(3, 6, 2, 8), same_tokens(3, 8), 0.0, 6);
  r.at(2, 5, 1) = 6;
  RoutingPlan plan;
  const Status st = r.build(&plan);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.message(), "rank 2")) << st.message();
  EXPECT_FALSE(contains(st.message(), "rank 0")) << st.message();
  EXPECT_TRUE(contains(st.message(), "topk_idx[5,1] = 6")) << st.message();
  // validate_routing directly, for a rank that is not the last one.
  const Status direct = validate_routing(r.shape, 1, 9, r.idx[1].data());
  EXPECT_EQ(direct.code(), StatusCode::kCapacity);
  EXPECT_TRUE(contains(direct.message(), "rank 1")) << direct.message();
}

// ---- check_plan_invariants must be able to fail ---------------------------------

TEST(RoutingPlanInvariants, DetectCorruptedPlans) {
  Rng rng(80);
  const Routing r = random_routing(rng, make_shape(2, 4, 2, 60), same_tokens(2, 60), 0.0, 4);
  RoutingPlan good;
  ASSERT_TRUE(r.build(&good).ok());
  ASSERT_TRUE(r.check(good).ok());
  const RankPlan& g0 = good.ranks[0];
  ASSERT_GE(g0.expert_rows[0], 2);
  ASSERT_LT(g0.expert_rows[0], 128);  // so expert 0's segment has padding

  auto expect_caught = [&](const char* what, const RoutingPlan& bad) {
    const Status st = r.check(bad);
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_EQ(st.code(), StatusCode::kInternal) << what;
  };
  {
    RoutingPlan bad = good;  // two rows of expert 0 swapped
    std::swap(bad.ranks[0].row_source[0], bad.ranks[0].row_source[1]);
    expect_caught("swapped row sources", bad);
  }
  {
    RoutingPlan bad = good;  // a route pointing at another real row
    int64_t& row = bad.ranks[1].route_pool_row[0];
    row = row == 0 ? 1 : 0;
    expect_caught("changed route_pool_row", bad);
  }
  {
    RoutingPlan bad = good;  // a count off by one
    ++bad.counts[3];
    expect_caught("changed count", bad);
  }
  {
    RoutingPlan bad = good;  // a real source copied into a padding row
    bad.ranks[0].row_source[g0.expert_rows[0]] = g0.row_source[0];
    expect_caught("source in padding", bad);
  }
  {
    RoutingPlan bad = good;  // a segment offset off the 128 grid
    bad.ranks[0].expert_offset[1] += 1;
    expect_caught("misaligned offset", bad);
  }
  {
    // Two rows swapped together with their routes: consistent both ways, only
    // the (source rank, token) order inside the segment is broken.
    RoutingPlan bad = good;
    RankPlan& o = bad.ranks[0];
    std::swap(o.row_source[0], o.row_source[1]);
    for (int64_t row : {0, 1}) {
      const RowSource& src = o.row_source[row];
      bad.ranks[src.rank].route_pool_row[src.token * r.shape.top_k + src.slot] = row;
    }
    expect_caught("order broken consistently", bad);
  }
  {
    RoutingPlan bad = good;  // a route dropped from the plan
    bad.ranks[0].route_pool_row[1] = -1;
    expect_caught("dropped route", bad);
  }
}

// ---- seeded fuzzing --------------------------------------------------------------

TEST(RoutingPlanFuzz, RandomShapesValidAndInvalid) {
  Rng rng(90);
  int valid = 0, invalid = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const int P = rng.between(1, 8);
    const int E = P * rng.between(1, 64 / P);
    const int k = rng.between(1, std::min(E, 8));
    std::vector<int64_t> tokens(P);
    int64_t max_t = 0;
    for (int64_t& t : tokens) max_t = std::max(max_t, t = rng.between(0, 200));
    const int64_t max_tokens = max_t + rng.between(0, 3) * rng.between(0, 50);
    const double drop = rng.below(4) == 0 ? 0.0 : rng.unit();
    const int used = rng.below(3) == 0 ? rng.between(1, E) : E;  // sometimes skewed to a few experts
    Routing r = random_routing(rng, make_shape(P, E, k, max_tokens), tokens, drop, used);
    SCOPED_TRACE(::testing::Message() << "iter " << iter << " P=" << P << " E=" << E << " k=" << k);

    const int mode = iter % 4 == 3 ? rng.below(4) : -1;  // every 4th routing is broken one way
    int rank = 0;
    while (rank < P && tokens[rank] == 0) ++rank;
    if (mode < 0 || rank == P) {
      ASSERT_NO_FATAL_FAILURE(build_and_verify(r));
      ++valid;
      continue;
    }
    const int64_t t = rng.between(0, static_cast<int>(tokens[rank]) - 1);
    const int j = rng.below(k);
    if (mode == 0) {
      r.at(rank, t, j) = E + rng.below(1000);
      expect_rejected(r, StatusCode::kInvalidArgument, {"out of range"});
    } else if (mode == 1) {
      r.at(rank, t, j) = -2 - rng.below(1000);
      expect_rejected(r, StatusCode::kInvalidArgument, {"out of range"});
    } else if (mode == 2 && k >= 2) {
      r.at(rank, t, 0) = static_cast<int32_t>(rng.below(E));
      r.at(rank, t, k - 1) = r.at(rank, t, 0);
      expect_rejected(r, StatusCode::kInvalidArgument, {"routed twice"});
    } else {
      r.shape.max_tokens_per_rank = tokens[rank] - 1;
      expect_rejected(r, StatusCode::kCapacity, {"max_tokens_per_rank"});
    }
    ++invalid;
  }
  EXPECT_GT(valid, 200);
  EXPECT_GT(invalid, 50);
}

}  // namespace
}  // namespace megamoe
