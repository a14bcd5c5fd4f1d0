// The layer's memory-bound kernels (cuda/layer/layer_kernels.h) against host
// sums, at shapes their unit walks must get right: rows of 300 chunks (a
// second 256-chunk segment, mostly idle), pool rows not a multiple of the
// gather's 4-row group, padding rows, dropped routes, and k = 11 (a second
// batch of combine loads, three of eight used).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/layer/layer_kernels.h"
#include "gpu_test_util.h"
#include "reference/numerics.h"

namespace megamoe::testing {
namespace {

uint16_t bf16_bits(float f) { return numerics::bf16_bits_from_float(f); }
float bf16_value(uint16_t u) { return numerics::float_from_bf16_bits(u); }

// A device copy of a host vector, freed on destruction.
template <class T>
struct DeviceVec {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceVec(const std::vector<T>& v) : n(v.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  ~DeviceVec() { cudaFree(p); }
  std::vector<T> download() const {
    std::vector<T> v(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }
};

std::vector<uint16_t> random_rows(int64_t rows, int64_t width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> v(static_cast<size_t>(rows * width));
  for (auto& x : v) x = bf16_bits(nd(rng));
  return v;
}

constexpr int64_t kWidth = 2400;  // 300 chunks of 8 bf16

// pool[r] = x[row_src[r] / k] for r < pool_rows (zeros where row_src is -1);
// rows from pool_rows on keep what they held.
TEST(LayerKernels, GatherRowsPutsEachPoolRowsTokenRow) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 37, capacity = 160;
  const int k = 3;
  for (const int32_t pool_rows : {0, 1, 4, 131, 160}) {
    std::vector<int32_t> row_src(capacity);
    std::mt19937 rng(pool_rows);
    for (auto& s : row_src) s = rng() % 7 == 0 ? -1 : static_cast<int32_t>(rng() % (T * k));
    const std::vector<uint16_t> x = random_rows(T, kWidth, 5);
    const std::vector<uint16_t> before = random_rows(capacity, kWidth, 6);  // what the pool held
    DeviceVec<uint16_t> d_x(x), d_pool(before);
    DeviceVec<int32_t> d_src(row_src), d_rows(std::vector<int32_t>{pool_rows});
    MEGAMOE_ASSERT_OK(cuda::gather_rows(d_x.p, kWidth, d_src.p, k, d_rows.p, capacity, d_pool.p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> pool = d_pool.download();
    int64_t wrong = 0;
    for (int64_t r = 0; r < capacity; ++r)
      for (int64_t c = 0; c < kWidth; ++c) {
        const size_t at = static_cast<size_t>(r * kWidth + c);
        const uint16_t want = r >= pool_rows ? before[at]
                              : row_src[r] < 0 ? uint16_t{0}
                                               : x[static_cast<size_t>(row_src[r] / k * kWidth + c)];
        wrong += pool[at] != want;
      }
    EXPECT_EQ(wrong, 0) << "pool_rows " << pool_rows;
  }
}

// scatter_rows makes gather_rows' pool from the plan's inverse maps: routes
// in a shuffled row order with padding rows between experts' runs, dropped
// routes (no row), rows from pool_rows on untouched; bit for bit.
TEST(LayerKernels, ScatterRowsMakesTheGatheredPool) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 53, capacity = 7 * T;
  const int k = 5;
  std::mt19937 rng(11);
  std::vector<int32_t> route_row(T * k, -1), row_src(capacity, -1), order;
  for (int32_t i = 0; i < T * k; ++i)
    if (rng() % 6 != 0) order.push_back(i);  // the others are dropped routes
  std::shuffle(order.begin(), order.end(), rng);
  int32_t used = 0;
  for (const int32_t i : order) {
    if (rng() % 4 == 0) used += static_cast<int32_t>(rng() % 3);  // padding rows (row_src -1) between
    route_row[i] = used, row_src[used] = i, ++used;
  }
  used += 2;  // padding at the end too
  ASSERT_LT(used, capacity);
  const std::vector<uint16_t> x = random_rows(T, kWidth, 12), before = random_rows(capacity, kWidth, 13);
  DeviceVec<uint16_t> d_x(x), d_gathered(before), d_scattered(before);
  DeviceVec<int32_t> d_route(route_row), d_src(row_src), d_used(std::vector<int32_t>{used});
  MEGAMOE_ASSERT_OK(cuda::gather_rows(d_x.p, kWidth, d_src.p, k, d_used.p, capacity, d_gathered.p, nullptr));
  MEGAMOE_ASSERT_OK(
      cuda::scatter_rows(d_x.p, T, kWidth, d_route.p, k, d_src.p, d_used.p, capacity, d_scattered.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> want = d_gathered.download(), got = d_scattered.download();
  int64_t wrong = 0, zeros = 0;
  for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
  for (int64_t r = 0; r < used; ++r) zeros += row_src[r] < 0;
  EXPECT_EQ(wrong, 0);
  EXPECT_GT(zeros, 2);  // the padding rows were exercised
  EXPECT_EQ(got[static_cast<size_t>(used * kWidth)], before[static_cast<size_t>(used * kWidth)]);
}

// out[t] = bf16(sum over j in order of the valid routes' rows) in fp32, by
// slot planes (combine_slots) and by pool rows (combine_pool_rows), bit for
// bit the host's sum; a route with an expert id out of range or -1, or a
// route_row of -1, adds nothing.
TEST(LayerKernels, CombinesSumTheRoutesRowsInRouteOrder) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 29, C = 7 * T;
  const int k = 11, E = 16;
  std::mt19937 rng(7);
  std::vector<int32_t> idx(T * k), route_row(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng() % 10);
    idx[i] = r == 0 ? -1 : r == 1 ? E + 3 : static_cast<int32_t>(rng() % E);
    route_row[i] = rng() % 9 == 0 ? -1 : static_cast<int32_t>(rng() % C);
  }
  const std::vector<uint16_t> slots = random_rows(k * T, kWidth, 8), rows = random_rows(C, kWidth, 9);
  DeviceVec<uint16_t> d_slots(slots), d_rows(rows), d_out(std::vector<uint16_t>(T * kWidth, 0xFFFF));
  DeviceVec<int32_t> d_idx(idx), d_route(route_row);
  DeviceVec<uint64_t> d_key(std::vector<uint64_t>{~0ull});  // kNoPlanError
  cuda::DeviceErrorSink errors;
  MEGAMOE_ASSERT_OK(cuda::device_error_sink(0, &errors));
  const auto* key = reinterpret_cast<const unsigned long long*>(d_key.p);
  for (const bool by_route : {false, true}) {
    if (by_route) {
      MEGAMOE_ASSERT_OK(cuda::combine_pool_rows(d_rows.p, d_route.p, d_idx.p, T, k, E, kWidth, key, errors,
                                                d_out.p, nullptr));
    } else {
      MEGAMOE_ASSERT_OK(cuda::combine_slots(d_slots.p, d_idx.p, T, k, E, kWidth, key, errors, d_out.p, nullptr));
    }
    MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
    const std::vector<uint16_t> out = d_out.download();
    int64_t wrong = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < kWidth; ++c) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
          const int32_t e = idx[t * k + j];
          if (e < 0 || e >= E) continue;
          if (!by_route) {
            acc += bf16_value(slots[static_cast<size_t>((j * T + t) * kWidth + c)]);
          } else if (route_row[t * k + j] >= 0) {
            acc += bf16_value(rows[static_cast<size_t>(route_row[t * k + j] * kWidth + c)]);
          }
        }
        wrong += out[static_cast<size_t>(t * kWidth + c)] != bf16_bits(acc);
      }
    EXPECT_EQ(wrong, 0) << (by_route ? "combine_pool_rows" : "combine_slots");
  }
}

}  // namespace
}  // namespace megamoe::testing
