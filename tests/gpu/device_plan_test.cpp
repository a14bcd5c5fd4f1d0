// The routing plan built on the device (build_device_plan) against the host
// plan (core/routing_plan.h, P = 1): the same expert_rows, expert_offset,
// tile_expert, route_row and row_src, element for element, over routings
// with -1 routes, empty experts, every token on one expert, T = 0 and 1, T
// not a multiple of the 256-token chunk, k = 1, 2, 8 and E = 8 .. 256. And
// the error key of invalid routings.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/routing_plan.h"
#include "cuda/plan/device_plan.h"
#include "gpu_test_util.h"

namespace megamoe::testing {
namespace {

enum class Kind {
  kUniform,    // k distinct experts per token
  kDrops,      // uniform, then each route -1 with probability 1/4
  kAllDropped, // every route -1: an empty pool
  kHalfEmpty,  // only experts [0, E/2) receive routes
  kOneExpert,  // slot 0 of every token on expert E/3 (k = 1: every route there)
  kHotDrops,   // kOneExpert, then drops
};

struct Case {
  int64_t tokens;
  int top_k, experts;
  Kind kind;
  uint64_t seed;
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kUniform: return "uniform";
    case Kind::kDrops: return "drops";
    case Kind::kAllDropped: return "all_dropped";
    case Kind::kHalfEmpty: return "half_empty";
    case Kind::kOneExpert: return "one_expert";
    case Kind::kHotDrops: return "hot_drops";
  }
  return "unknown";
}

std::string case_name(const Case& c) {
  return "T" + std::to_string(c.tokens) + "_k" + std::to_string(c.top_k) + "_E" + std::to_string(c.experts) + "_" +
         kind_name(c.kind);
}
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }  // test names without hex dumps

// A valid routing (no token twice on one expert) of the given kind.
std::vector<int32_t> make_routing(const Case& c) {
  std::mt19937_64 rng(c.seed);
  const int E = c.experts, k = c.top_k;
  const int pool_experts = c.kind == Kind::kHalfEmpty ? E / 2 : E;
  const int hot = E / 3;
  std::vector<int32_t> idx(static_cast<size_t>(c.tokens * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    int first = 0;
    if (c.kind == Kind::kOneExpert || c.kind == Kind::kHotDrops) {  // slot 0 = hot, the rest from the others
      std::swap(perm[0], perm[hot]);
      first = 1;
    }
    for (int j = first; j < k; ++j) {  // partial Fisher-Yates over perm[j .. pool_experts)
      std::uniform_int_distribution<int> pick(j, pool_experts - 1);
      std::swap(perm[j], perm[pick(rng)]);
    }
    for (int j = 0; j < k; ++j) {
      int32_t e = perm[j];
      const bool drops = c.kind == Kind::kDrops || c.kind == Kind::kHotDrops;
      if (c.kind == Kind::kAllDropped || (drops && rng() % 4 == 0)) e = -1;
      idx[static_cast<size_t>(t * k + j)] = e;
    }
  }
  return idx;
}

// An int32 device array of n elements (at least one), freed on destruction.
struct DeviceI32 {
  DeviceTensor t;
  explicit DeviceI32(int64_t n) : t(DType::kI32, {std::max<int64_t>(n, 2)}) {}
  int32_t* get() const { return static_cast<int32_t*>(t.view().data); }
};

std::vector<int32_t> download(const int32_t* dev, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(v.data(), dev, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

// The device plan of `idx` (T x k routes over E experts), downloaded.
struct DevicePlanHost {
  unsigned long long error_key = 0;
  std::vector<int32_t> expert_rows, expert_offset, tile_expert, route_row, row_src;
};

void build_on_device(const std::vector<int32_t>& idx, int64_t T, int k, int E, int64_t capacity,
                     DevicePlanHost* out) {
  DeviceI32 d_idx(T * k), error_key(2), chunk_counts(static_cast<int64_t>(E) * (T + 1)), expert_rows(E),
      expert_offset(E + 1), tile_expert(capacity / 128), route_row(T * k), row_src(capacity);
  if (T > 0) {
    ASSERT_EQ(cudaMemcpy(d_idx.get(), idx.data(), idx.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  // Poison what the plan must write, so a row it forgets shows.
  for (DeviceI32* b : {&expert_rows, &expert_offset, &tile_expert, &route_row, &row_src})
    ASSERT_TRUE(b->t.fill_bytes(0x7F).ok());
  cuda::DevicePlanBuffers b;
  b.error_key = reinterpret_cast<unsigned long long*>(error_key.get());
  b.chunk_counts = chunk_counts.get();
  b.expert_rows = expert_rows.get();
  b.expert_offset = expert_offset.get();
  b.tile_expert = tile_expert.get();
  b.route_row = route_row.get();
  b.row_src = row_src.get();
  MEGAMOE_ASSERT_OK(cuda::build_device_plan(d_idx.get(), T, k, E, b, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&out->error_key, b.error_key, sizeof out->error_key, cudaMemcpyDeviceToHost), cudaSuccess);
  out->expert_rows = download(b.expert_rows, E);
  out->expert_offset = download(b.expert_offset, E + 1);
  const int64_t pool_rows = out->expert_offset[E];
  ASSERT_GE(pool_rows, 0);
  ASSERT_LE(pool_rows, capacity);
  out->tile_expert = download(b.tile_expert, pool_rows / 128);
  out->route_row = download(b.route_row, T * k);
  out->row_src = download(b.row_src, pool_rows);
}

class DevicePlanVsHost : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePlanVsHost, EqualsHostPlan) {
  MEGAMOE_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t T = c.tokens;
  const int k = c.top_k, E = c.experts;
  const std::vector<int32_t> idx = make_routing(c);

  RoutingShape shape;
  shape.num_ranks = 1, shape.num_experts = E, shape.top_k = k, shape.max_tokens_per_rank = T;
  RoutingPlan host;
  MEGAMOE_ASSERT_OK(build_routing_plan(shape, {idx.data()}, {T}, &host));
  MEGAMOE_ASSERT_OK(check_plan_invariants(host, {idx.data()}, {T}));
  const RankPlan& hp = host.ranks[0];
  const int64_t capacity = pool_capacity_rows(shape);

  DevicePlanHost dev;
  build_on_device(idx, T, k, E, capacity, &dev);
  if (HasFatalFailure()) return;

  EXPECT_EQ(dev.error_key, cuda::kNoPlanError);
  // expert_rows, expert_offset (with [E] = pool rows).
  ASSERT_EQ(static_cast<int64_t>(dev.expert_offset[E]), hp.pool_rows());
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(dev.expert_rows[e], hp.expert_rows[e]) << "expert " << e;
    EXPECT_EQ(dev.expert_offset[e], hp.expert_offset[e]) << "expert " << e;
  }
  // tile_expert: the host plan's segments, tile by tile.
  std::vector<int32_t> want_tiles;
  for (int e = 0; e < E; ++e)
    for (int64_t r = hp.expert_offset[e]; r < hp.expert_offset[e + 1]; r += 128) want_tiles.push_back(e);
  EXPECT_EQ(dev.tile_expert, want_tiles);
  // route_row: the pool row of every route, -1 for -1 routes.
  std::vector<int32_t> want_route(hp.route_pool_row.begin(), hp.route_pool_row.end());
  EXPECT_EQ(dev.route_row, want_route);
  // row_src: t * k + j of every pool row, -1 for padding.
  std::vector<int32_t> want_src(static_cast<size_t>(hp.pool_rows()));
  for (int64_t r = 0; r < hp.pool_rows(); ++r) {
    const RowSource& s = hp.row_source[r];
    want_src[r] = s.rank < 0 ? -1 : s.token * k + s.slot;
  }
  EXPECT_EQ(dev.row_src, want_src);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  uint64_t seed = 1;
  auto add = [&](int64_t T, int k, int E, Kind kind) { v.push_back(Case{T, k, E, kind, seed++}); };
  add(0, 2, 8, Kind::kUniform);      // no tokens: an empty pool
  add(1, 1, 8, Kind::kUniform);
  add(1, 2, 8, Kind::kUniform);
  add(1, 8, 8, Kind::kUniform);      // one token on every expert
  add(1, 8, 256, Kind::kDrops);
  add(255, 1, 8, Kind::kOneExpert);  // every route on one expert, one chunk short of full
  add(256, 2, 8, Kind::kAllDropped); // every route -1: every expert empty
  add(257, 2, 16, Kind::kDrops);     // one token into the second chunk
  add(300, 2, 8, Kind::kUniform);
  add(300, 8, 32, Kind::kHalfEmpty);
  add(777, 1, 64, Kind::kDrops);
  add(777, 2, 256, Kind::kHalfEmpty);  // 128 empty experts
  add(1000, 8, 64, Kind::kHotDrops);
  add(1024, 2, 128, Kind::kOneExpert);
  add(2049, 8, 256, Kind::kUniform);
  add(3000, 1, 16, Kind::kOneExpert);  // 3000 rows on one expert
  add(4095, 8, 8, Kind::kUniform);     // k = E: every token on every expert
  add(5000, 2, 32, Kind::kDrops);
  add(700, 4, 700, Kind::kDrops);      // E over 512: plan_assign_fast ranks in two passes
  add(600, 3, 3000, Kind::kUniform);   // E over 2048: plan_count_fast counts in two passes too
  add(256, 32, 64, Kind::kUniform);    // k = 32: 8192 routes a chunk
  return v;
}

INSTANTIATE_TEST_SUITE_P(Routings, DevicePlanVsHost, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return case_name(i.param); });

// check_routing's error key for `idx` (reset by the call itself).
unsigned long long check_only(const std::vector<int32_t>& idx, int64_t T, int k, int E) {
  DeviceI32 d_idx(T * k), key(2);
  EXPECT_EQ(cudaMemset(key.get(), 0, 8), cudaSuccess);  // not kNoPlanError: the reset must happen
  EXPECT_EQ(cudaMemcpy(d_idx.get(), idx.data(), idx.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  auto* key_ptr = reinterpret_cast<unsigned long long*>(key.get());
  const Status st = cuda::check_routing(d_idx.get(), T, k, E, key_ptr, nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  unsigned long long out = 0;
  EXPECT_EQ(cudaMemcpy(&out, key_ptr, sizeof out, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Invalid routes: error_key is the minimum over bad routes of
// ((t * k + j) << 2 | kind), whichever 256-token chunk they fall in.
TEST(DevicePlanErrors, KeyIsTheFirstBadRoute) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 600;
  const int k = 2, E = 16;
  std::vector<int32_t> idx = make_routing(Case{T, k, E, Kind::kUniform, 99});
  const int64_t C = align_pool_rows(T * k + static_cast<int64_t>(E) * 127);
  struct Bad {
    int64_t t;
    int j;
    int32_t value;  // out of range, or (j = 1) the expert of slot 0: a duplicate
    uint32_t kind;
  };
  for (const std::vector<Bad>& bads : std::vector<std::vector<Bad>>{
           {{599, 1, E, cuda::kPlanErrorOutOfRange}},
           {{420, 1, -2, cuda::kPlanErrorOutOfRange}, {300, 1, -1, cuda::kPlanErrorDuplicate}},
           {{513, 0, 1 << 30, cuda::kPlanErrorOutOfRange}, {7, 1, -1, cuda::kPlanErrorDuplicate}}}) {
    std::vector<int32_t> bad_idx = idx;
    unsigned long long want = cuda::kNoPlanError;
    for (const Bad& b : bads) {
      const size_t at = static_cast<size_t>(b.t * k + b.j);
      bad_idx[at] = b.kind == cuda::kPlanErrorDuplicate ? bad_idx[static_cast<size_t>(b.t * k)] : b.value;
      want = std::min(want, static_cast<unsigned long long>(at) << 2 | b.kind);
    }
    DevicePlanHost dev;
    build_on_device(bad_idx, T, k, E, C, &dev);
    if (HasFatalFailure()) return;
    EXPECT_EQ(dev.error_key, want) << "route " << (dev.error_key >> 2) << ", kind " << (dev.error_key & 3);
    // The check alone (an EP rank's own routing) finds the same route.
    const unsigned long long checked = check_only(bad_idx, T, k, E);
    EXPECT_EQ(checked, want) << "check_routing: route " << (checked >> 2) << ", kind " << (checked & 3);
  }
  EXPECT_EQ(check_only(idx, T, k, E), cuda::kNoPlanError) << "check_routing on a good routing";
}

}  // namespace
}  // namespace megamoe::testing
