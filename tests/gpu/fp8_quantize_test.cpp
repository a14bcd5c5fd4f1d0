// The GPU FP8 quantizers (cuda/fp8/quantize.h) against the CPU reference's
// rule: s = numerics::block_scale(amax of the tile), q = e4m3_from_float(v / s).
// The same bytes and the same scale bits, for both scale kinds, on data whose
// tiles span 2^-40 .. 2^40 and include an all-zero tile, a tile of tiny values
// and a tile holding a NaN. The shape checks need no GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cuda/fp8/quantize.h"
#include "cuda/layer/layer_kernels.h"
#include "gpu_test_util.h"
#include "reference/numerics.h"

namespace megamoe::numerics {
// Test names and parameters print as words, not hex dumps (scripts/run-tests checks).
void PrintTo(ScaleKind k, std::ostream* os) { *os << (k == ScaleKind::kFloat32 ? "fp32" : "pow2"); }
}  // namespace megamoe::numerics

namespace megamoe::testing {
namespace {

using numerics::ScaleKind;

// bf16 bits of tile-varied data: element i of tile `tile` is sign * 2^(tile % 11 * 8 - 40) * (0.5 + frac).
std::vector<uint16_t> make_data(int64_t n, int64_t tile_of_stride, uint32_t seed) {
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  uint32_t state = seed;
  for (int64_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    const double frac = (state >> 8) / double(1u << 24);
    const int64_t tile = i / tile_of_stride;
    const double mag = std::ldexp(0.5 + frac, static_cast<int>(tile % 11) * 8 - 40);
    bits[static_cast<size_t>(i)] = numerics::bf16_bits_from_float(static_cast<float>((state & 1) ? -mag : mag));
  }
  return bits;
}

float bf16(uint16_t b) { return numerics::float_from_bf16_bits(b); }

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The reference's quantization of one tile given its element values.
void reference_tile(const std::vector<float>& v, ScaleKind kind, std::vector<uint8_t>* q, float* scale) {
  float amax = 0.0f;
  for (float e : v) {
    const float a = std::fabs(e);
    amax = std::isnan(a) || std::isnan(amax) ? std::nanf("") : std::max(amax, a);
  }
  *scale = numerics::block_scale(amax, kind);
  q->resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) (*q)[i] = numerics::e4m3_from_float(v[i] / *scale);
}

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
};

uint32_t bits(uint8_t v) { return v; }
uint32_t bits(float v) { return float_bits(v); }
// Element i of v as bits (a uint8 as its value, a float as its bit pattern).
template <typename T>
auto bits_of(const std::vector<T>& v) {
  return [&v](int64_t i) { return bits(v[static_cast<size_t>(i)]); };
}

// Outputs filled with 0xAB and a device-side used-row count, for the quantizers' used_rows runs.
struct UsedRowsRun {
  Dev<int32_t> used{1};
  Dev<uint8_t> q;
  Dev<float> s;
  UsedRowsRun(int32_t used_rows, size_t q_n, size_t s_n) : q(q_n), s(s_n) {
    EXPECT_EQ(cudaMemcpy(used.p, &used_rows, 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(q.p, 0xAB, q_n), cudaSuccess);
    EXPECT_EQ(cudaMemset(s.p, 0xAB, s_n * 4), cudaSuccess);
  }
};

// Over indices [0, n): those with used(i) must have got(i) == want(i), the
// others must still hold `fill` (values as bits). Returns {differ, written past}.
template <typename Used, typename Got, typename Want>
std::pair<int64_t, int64_t> used_and_past(int64_t n, Used used, Got got, Want want, uint32_t fill) {
  std::pair<int64_t, int64_t> counts{0, 0};
  for (int64_t i = 0; i < n; ++i) {
    if (used(i))
      counts.first += got(i) != want(i);
    else
      counts.second += got(i) != fill;
  }
  return counts;
}

class Fp8Quantize : public ::testing::TestWithParam<ScaleKind> {
 protected:
  cuda::Fp8Scale kind() const {
    return GetParam() == ScaleKind::kFloat32 ? cuda::Fp8Scale::kFloat32 : cuda::Fp8Scale::kPowerOfTwo;
  }
};

// rows x cols quantised by 1 x 128 row tiles on the GPU, against the CPU
// reference tile by tile; the first rows carry the special cases.
void expect_row_tiles_match(int64_t rows, int64_t cols, ScaleKind kind, cuda::Fp8Scale gpu_kind) {
  const int64_t tiles = cols / 128;
  std::vector<uint16_t> x = make_data(rows * cols, 128, 11);
  const uint16_t tiny = numerics::bf16_bits_from_float(1e-39f);  // a bf16 subnormal
  for (int64_t c = 0; c < 128; ++c) {
    x[static_cast<size_t>(c)] = 0;                  // row 0, tile 0: all zero
    x[static_cast<size_t>(cols + 128 + c)] = tiny;  // row 1, tile 1: tiny values
    // row 4, tile 1: varied tiny values of both signs, subnormals and the smallest normals (amax < 2^-96:
    // the quantizers divide there)
    x[static_cast<size_t>(4 * cols + 128 + c)] = static_cast<uint16_t>((c % 2 ? 0x8000u : 0u) | (1u + 3u * c));
  }
  x[static_cast<size_t>(2 * cols + 256 + 5)] = 0x7FC0;  // row 2, tile 2: a NaN
  x[static_cast<size_t>(3 * cols + 9)] = 0xFF80;        // row 3, tile 0: -inf
  Dev<uint16_t> dx(x.size());
  Dev<uint8_t> dq(x.size());
  Dev<float> ds(static_cast<size_t>(rows * tiles));
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(dx.p, rows, cols, gpu_kind, dq.p, ds.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto q = dq.get(x.size());
  const auto s = ds.get(static_cast<size_t>(rows * tiles));
  int64_t bytes_differ = 0, scales_differ = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      std::vector<float> v(128);
      for (int64_t c = 0; c < 128; ++c) v[c] = bf16(x[static_cast<size_t>(r * cols + t * 128 + c)]);
      std::vector<uint8_t> want;
      float scale;
      reference_tile(v, kind, &want, &scale);
      scales_differ += float_bits(scale) != float_bits(s[static_cast<size_t>(r * tiles + t)]);
      for (int64_t c = 0; c < 128; ++c) bytes_differ += want[c] != q[static_cast<size_t>(r * cols + t * 128 + c)];
    }
  EXPECT_EQ(scales_differ, 0) << rows << " x " << cols;
  EXPECT_EQ(bytes_differ, 0) << rows << " x " << cols;
  EXPECT_TRUE(std::isnan(s[static_cast<size_t>(2 * tiles + 2)])) << "the NaN tile's scale";
  EXPECT_TRUE(std::isinf(s[static_cast<size_t>(3 * tiles)])) << "the inf tile's scale";
  EXPECT_EQ(s[0], 1.0f) << "the zero tile's scale";
  // The same values with the scales by k-block ([tiles, rows]): the same bytes, the scales transposed.
  Dev<uint8_t> dq_kb(x.size());
  Dev<float> ds_kb(static_cast<size_t>(rows * tiles));
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(dx.p, rows, cols, gpu_kind, dq_kb.p, ds_kb.p, nullptr,
                                             cuda::RowScales::kByKBlock));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dq_kb.get(x.size()), q);
  const auto s_kb = ds_kb.get(static_cast<size_t>(rows * tiles));
  int64_t by_k_block_differ = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t)
      by_k_block_differ += float_bits(s_kb[static_cast<size_t>(t * rows + r)]) != float_bits(s[static_cast<size_t>(r * tiles + t)]);
  EXPECT_EQ(by_k_block_differ, 0) << rows << " x " << cols << ", scales by k-block";
  // Into a dispatch's slots (expert parallelism's e4m3 rows): row r's bytes at r * slot_bytes, its
  // scales right after them, the rest of the slot untouched.
  const int64_t slot_bytes = 2 * cols;  // a bf16 row's slot
  Dev<uint8_t> slots(static_cast<size_t>(rows * slot_bytes));
  ASSERT_EQ(cudaMemset(slots.p, 0xAB, static_cast<size_t>(rows * slot_bytes)), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows_to_slots(dx.p, rows, cols, gpu_kind, slots.p, slot_bytes, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto sl = slots.get(static_cast<size_t>(rows * slot_bytes));
  int64_t slot_bytes_differ = 0, slot_scales_differ = 0, slot_rest_written = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = sl.data() + r * slot_bytes;
    for (int64_t c = 0; c < cols; ++c) slot_bytes_differ += row[c] != q[static_cast<size_t>(r * cols + c)];
    for (int64_t t = 0; t < tiles; ++t) {
      float v;
      std::memcpy(&v, row + cols + 4 * t, 4);
      slot_scales_differ += float_bits(v) != float_bits(s[static_cast<size_t>(r * tiles + t)]);
    }
    for (int64_t b = cols + 4 * tiles; b < slot_bytes; ++b) slot_rest_written += row[b] != 0xAB;
  }
  EXPECT_EQ(slot_bytes_differ, 0) << rows << " x " << cols << ", into slots";
  EXPECT_EQ(slot_scales_differ, 0) << rows << " x " << cols << ", into slots: the scales";
  EXPECT_EQ(slot_rest_written, 0) << rows << " x " << cols << ", into slots: written past a row's scales";
  // Only the first used rows (a pool's, read on the device): the same bytes and scales there, nothing past.
  const int32_t used = static_cast<int32_t>(rows / 2);
  const UsedRowsRun run(used, x.size(), static_cast<size_t>(rows * tiles));
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(dx.p, rows, cols, gpu_kind, run.q.p, run.s.p, nullptr,
                                             cuda::RowScales::kByRow, run.used.p));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto q_used = run.q.get(x.size());
  const auto s_used = run.s.get(static_cast<size_t>(rows * tiles));
  const auto [q_differ, q_past] =
      used_and_past(rows * cols, [&](int64_t i) { return i < used * cols; }, bits_of(q_used), bits_of(q), 0xABu);
  const auto [s_differ, s_past] =
      used_and_past(rows * tiles, [&](int64_t i) { return i < used * tiles; }, bits_of(s_used), bits_of(s), 0xABABABABu);
  const int64_t used_differ = q_differ + s_differ, written_past = q_past + s_past;
  EXPECT_EQ(used_differ, 0) << rows << " x " << cols << ", the used rows";
  EXPECT_EQ(written_past, 0) << rows << " x " << cols << ", written past the used rows";
}

TEST_P(Fp8Quantize, RowTilesMatchTheReferenceBitwise) {
  MEGAMOE_REQUIRE_GPU();
  expect_row_tiles_match(37, 384, GetParam(), kind());  // rows need not be a multiple of 128; 111 tiles: a ragged last step
}

// More tiles than one pass of the grid holds (8 blocks per SM x 64 tiles per
// block), an odd count: the grid-stride loop and the last half-warp's tail.
TEST_P(Fp8Quantize, ManyRowTilesStrideOverTheGrid) {
  MEGAMOE_REQUIRE_GPU();
  expect_row_tiles_match(2731, 4096 + 128, GetParam(), kind());
}

// Pool rows' sources for `used` of `capacity` rows: routes of T * k, one in
// `pad_every` a padding row (-1); the rows past `used` are -1 too.
std::vector<int32_t> random_row_src(int64_t capacity, int32_t used, int64_t routes, uint32_t seed, uint32_t pad_every) {
  std::vector<int32_t> row_src(static_cast<size_t>(capacity), -1);
  uint32_t state = seed;
  for (int32_t r = 0; r < used; ++r) {
    state = state * 1664525u + 1013904223u;
    row_src[static_cast<size_t>(r)] = (state >> 8) % pad_every == 0 ? -1 : static_cast<int32_t>((state >> 8) % routes);
  }
  return row_src;
}

// The row quantizer fused with the pool gather: for the pool's used rows, the
// same bytes and scales as gather_rows followed by quantize_e4m3_rows (whose
// own match with the reference is above), the same bf16 pool when asked for,
// and nothing written past the used rows. Padding rows (row_src -1) are zeros.
void expect_gather_matches(int64_t T, int64_t cols, int k, int64_t capacity, int32_t used, cuda::Fp8Scale gpu_kind) {
  const int64_t tiles = cols / 128;
  const std::vector<uint16_t> x = make_data(T * cols, 128, 5);
  const std::vector<int32_t> row_src = random_row_src(capacity, used, T * k, 7, 5);
  Dev<uint16_t> dx(x.size()), pool_ref(static_cast<size_t>(capacity * cols)), pool(static_cast<size_t>(capacity * cols));
  Dev<int32_t> dsrc(row_src.size()), dused(1);
  Dev<uint8_t> q_ref(static_cast<size_t>(capacity * cols)), q(static_cast<size_t>(capacity * cols));
  Dev<float> s_ref(static_cast<size_t>(capacity * tiles)), s(static_cast<size_t>(capacity * tiles));
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dsrc.p, row_src.data(), row_src.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dused.p, &used, 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(q.p, 0xAB, static_cast<size_t>(capacity * cols)), cudaSuccess);  // past `used`: must stay
  ASSERT_EQ(cudaMemset(pool.p, 0xAB, static_cast<size_t>(capacity * cols) * 2), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::gather_rows(dx.p, cols, dsrc.p, k, dused.p, capacity, pool_ref.p, nullptr));
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(pool_ref.p, used, cols, gpu_kind, q_ref.p, s_ref.p, nullptr));
  MEGAMOE_ASSERT_OK(
      cuda::gather_quantize_e4m3_rows(dx.p, cols, dsrc.p, k, dused.p, capacity, gpu_kind, q.p, s.p, pool.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t n = static_cast<size_t>(used * cols), all = static_cast<size_t>(capacity * cols);
  const auto qg = q.get(all), qr = q_ref.get(n);
  const auto sg = s.get(static_cast<size_t>(used * tiles)), sr = s_ref.get(static_cast<size_t>(used * tiles));
  const auto pg = pool.get(all), pr = pool_ref.get(n);
  int64_t q_differ = 0, s_differ = 0, pool_differ = 0, written_past = 0;
  for (size_t i = 0; i < n; ++i) q_differ += qg[i] != qr[i], pool_differ += pg[i] != pr[i];
  for (size_t i = 0; i < sg.size(); ++i) s_differ += float_bits(sg[i]) != float_bits(sr[i]);
  for (size_t i = n; i < all; ++i) written_past += qg[i] != 0xAB || pg[i] != 0xABAB;
  EXPECT_EQ(q_differ, 0);
  EXPECT_EQ(s_differ, 0);
  EXPECT_EQ(pool_differ, 0);
  EXPECT_EQ(written_past, 0);
  // Without the bf16 copy: the same e4m3 rows.
  ASSERT_EQ(cudaMemset(q.p, 0, all), cudaSuccess);
  MEGAMOE_ASSERT_OK(
      cuda::gather_quantize_e4m3_rows(dx.p, cols, dsrc.p, k, dused.p, capacity, gpu_kind, q.p, s.p, nullptr, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(q.get(n), qr);
  // Scales by k-block, [tiles, capacity]: the used rows' scales, transposed; the other rows' untouched.
  ASSERT_EQ(cudaMemset(q.p, 0, all), cudaSuccess);
  ASSERT_EQ(cudaMemset(s.p, 0xFF, static_cast<size_t>(capacity * tiles) * 4), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::gather_quantize_e4m3_rows(dx.p, cols, dsrc.p, k, dused.p, capacity, gpu_kind, q.p, s.p,
                                                    nullptr, nullptr, cuda::RowScales::kByKBlock));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(q.get(n), qr);
  const auto s_kb = s.get(static_cast<size_t>(capacity * tiles));
  int64_t by_k_block_differ = 0, by_k_block_past = 0;
  for (int64_t r = 0; r < capacity; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint32_t got = float_bits(s_kb[static_cast<size_t>(t * capacity + r)]);
      if (r < used)
        by_k_block_differ += got != float_bits(sr[static_cast<size_t>(r * tiles + t)]);
      else
        by_k_block_past += got != 0xFFFFFFFFu;
    }
  EXPECT_EQ(by_k_block_differ, 0) << "scales by k-block";
  EXPECT_EQ(by_k_block_past, 0) << "scales by k-block written past the used rows";
}

TEST_P(Fp8Quantize, GatheredRowTilesAreTheGatheredPoolQuantised) {
  MEGAMOE_REQUIRE_GPU();
  expect_gather_matches(300, 384, 3, 1024, 900, kind());
  expect_gather_matches(2000, 2048, 8, 9000, 8837, kind());  // more tiles than one pass of the grid
}

// A device plan's two maps, made on the host: the T * k routes in a random
// order, one in `drop_every` without a row (route_row -1), the others in pool
// rows with one padding row (row_src -1) in `pad_every`; *used rows in all,
// the rest of the capacity -1.
void random_route_maps(int64_t T, int k, int64_t capacity, uint32_t seed, uint32_t drop_every, uint32_t pad_every,
                       std::vector<int32_t>* route_row, std::vector<int32_t>* row_src, int32_t* used) {
  const int64_t routes = T * k;
  std::vector<int32_t> order(static_cast<size_t>(routes));
  for (int64_t i = 0; i < routes; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  uint32_t state = seed;
  auto next = [&] { return (state = state * 1664525u + 1013904223u) >> 8; };
  for (int64_t i = routes - 1; i > 0; --i) std::swap(order[static_cast<size_t>(i)], order[next() % (i + 1)]);
  route_row->assign(static_cast<size_t>(routes), -1);
  row_src->assign(static_cast<size_t>(capacity), -1);
  int32_t r = 0;
  for (int32_t route : order) {
    if (next() % drop_every == 0) continue;
    while (next() % pad_every == 0 && r < capacity) ++r;  // padding rows
    ASSERT_LT(r, capacity) << "the test's capacity is too small";
    (*route_row)[static_cast<size_t>(route)] = r;
    (*row_src)[static_cast<size_t>(r++)] = route;
  }
  *used = r;
}

// The scattering row quantizer writes what the gathering one writes, for the
// used rows (padding rows included), with and without the bf16 copy and with
// both scale layouts, and nothing past the used rows.
void expect_scatter_matches(int64_t T, int64_t cols, int k, int64_t capacity, cuda::Fp8Scale gpu_kind) {
  const int64_t tiles = cols / 128;
  std::vector<int32_t> route_row, row_src;
  int32_t used = 0;
  random_route_maps(T, k, capacity, 31, 7, 5, &route_row, &row_src, &used);
  std::vector<uint16_t> x = make_data(T * cols, 128, 11);
  if (T >= 5 && cols >= 384) {  // the special tiles of expect_row_tiles_match, in token rows
    for (int64_t c = 0; c < 128; ++c) {
      x[static_cast<size_t>(c)] = 0;                                                     // all zero
      x[static_cast<size_t>(cols + 128 + c)] = numerics::bf16_bits_from_float(1e-39f);  // tiny
      x[static_cast<size_t>(4 * cols + 128 + c)] = static_cast<uint16_t>((c % 2 ? 0x8000u : 0u) | (1u + 3u * c));
    }
    x[static_cast<size_t>(2 * cols + 256 + 5)] = 0x7FC0;  // a NaN
    x[static_cast<size_t>(3 * cols + 9)] = 0xFF80;        // -inf
  }
  const size_t all = static_cast<size_t>(capacity * cols), n = static_cast<size_t>(used * cols);
  const size_t all_s = static_cast<size_t>(capacity * tiles);
  Dev<uint16_t> dx(x.size()), pool_ref(all), pool(all);
  Dev<int32_t> droute(route_row.size()), dsrc(row_src.size()), dused(1);
  Dev<uint8_t> q_ref(all), q(all);
  Dev<float> s_ref(all_s), s(all_s);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(droute.p, route_row.data(), route_row.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dsrc.p, row_src.data(), row_src.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dused.p, &used, 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (const auto layout : {cuda::RowScales::kByRow, cuda::RowScales::kByKBlock}) {
    for (const bool with_pool : {true, false}) {
      SCOPED_TRACE(std::string(layout == cuda::RowScales::kByRow ? "by row" : "by k-block") +
                   (with_pool ? ", with the bf16 pool" : ""));
      for (auto* d : {&q_ref, &q}) ASSERT_EQ(cudaMemset(d->p, 0xAB, all), cudaSuccess);
      for (auto* d : {&s_ref, &s}) ASSERT_EQ(cudaMemset(d->p, 0xAB, all_s * 4), cudaSuccess);
      for (auto* d : {&pool_ref, &pool}) ASSERT_EQ(cudaMemset(d->p, 0xAB, all * 2), cudaSuccess);
      MEGAMOE_ASSERT_OK(cuda::gather_quantize_e4m3_rows(dx.p, cols, dsrc.p, k, dused.p, capacity, gpu_kind, q_ref.p,
                                                        s_ref.p, with_pool ? pool_ref.p : nullptr, nullptr, layout));
      MEGAMOE_ASSERT_OK(cuda::scatter_quantize_e4m3_rows(dx.p, T, cols, droute.p, k, dsrc.p, dused.p, capacity,
                                                         gpu_kind, q.p, s.p, with_pool ? pool.p : nullptr, nullptr,
                                                         layout));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      // Everything, the untouched bytes past the used rows included, as the gather left it.
      const auto qg = q.get(all), qr = q_ref.get(all);
      const auto sg = s.get(all_s), sr = s_ref.get(all_s);
      const auto pg = pool.get(all), pr = pool_ref.get(all);
      int64_t q_differ = 0, s_differ = 0, pool_differ = 0, q_written = 0;
      for (size_t i = 0; i < all; ++i) q_differ += qg[i] != qr[i], pool_differ += pg[i] != pr[i];
      for (size_t i = 0; i < all_s; ++i) s_differ += float_bits(sg[i]) != float_bits(sr[i]);
      for (size_t i = 0; i < n; ++i) q_written += qg[i] != 0xAB;
      EXPECT_EQ(q_differ, 0);
      EXPECT_EQ(s_differ, 0);
      EXPECT_EQ(pool_differ, 0);
      EXPECT_GT(q_written, static_cast<int64_t>(n / 2)) << "the used rows were hardly written: the test proves nothing";
    }
  }
}

TEST_P(Fp8Quantize, ScatteredRowTilesAreWhatTheGatherWrites) {
  MEGAMOE_REQUIRE_GPU();
  expect_scatter_matches(300, 384, 3, 1400, kind());
  expect_scatter_matches(2000, 2048, 8, 20500, kind());
  expect_scatter_matches(6000, 2048, 2, 16000, kind());  // 96000 token tiles: more than one pass of the grid (67584)
  expect_scatter_matches(40, 128, 1, 128, kind());
}

TEST_P(Fp8Quantize, BlockTilesAndTheirTransposeMatchTheReferenceBitwise) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t batch = 2, rows = 256, cols = 384, tr = rows / 128, tc = cols / 128;
  const int64_t n = batch * rows * cols;
  // Each 128 x 128 tile its own magnitude (2^-40 .. 2^40), then: batch 0 tile (0, 1) all zero, tile (1, 2)
  // tiny (bf16 subnormals), batch 1 tile (1, 1) a NaN, tile (0, 2) an inf.
  std::vector<uint16_t> w(static_cast<size_t>(n));
  uint32_t state = 23;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        state = state * 1664525u + 1013904223u;
        const int64_t tile = (b * tr + r / 128) * tc + c / 128;
        const double mag = std::ldexp(0.5 + (state >> 8) / double(1u << 24), static_cast<int>(tile * 7 % 81) - 40);
        w[static_cast<size_t>((b * rows + r) * cols + c)] =
            numerics::bf16_bits_from_float(static_cast<float>((state & 1) ? -mag : mag));
      }
  for (int64_t r = 0; r < 128; ++r)
    for (int64_t c = 0; c < 128; ++c) {
      w[static_cast<size_t>(r * cols + 128 + c)] = 0;
      w[static_cast<size_t>((128 + r) * cols + 256 + c)] = numerics::bf16_bits_from_float(1e-39f);
    }
  w[static_cast<size_t>(rows * cols + 130 * cols + 200)] = 0x7FC0;  // batch 1, tile (1, 1): a NaN
  w[static_cast<size_t>(rows * cols + 5 * cols + 300)] = 0x7F80;    // batch 1, tile (0, 2): +inf
  Dev<uint16_t> dw(static_cast<size_t>(n));
  Dev<uint8_t> dq(static_cast<size_t>(n)), dqt(static_cast<size_t>(n));
  Dev<float> ds(static_cast<size_t>(batch * tr * tc));
  ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_blocks(dw.p, batch, rows, cols, kind(), dq.p, dqt.p, ds.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto q = dq.get(static_cast<size_t>(n)), qt = dqt.get(static_cast<size_t>(n));
  const auto s = ds.get(static_cast<size_t>(batch * tr * tc));
  int64_t bytes_differ = 0, transposed_differ = 0, scales_differ = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < tr; ++i)
      for (int64_t j = 0; j < tc; ++j) {
        std::vector<float> v(128 * 128);
        auto at = [&](int64_t r, int64_t c) { return b * rows * cols + (i * 128 + r) * cols + j * 128 + c; };
        for (int64_t r = 0; r < 128; ++r)
          for (int64_t c = 0; c < 128; ++c) v[r * 128 + c] = bf16(w[static_cast<size_t>(at(r, c))]);
        std::vector<uint8_t> want;
        float scale;
        reference_tile(v, GetParam(), &want, &scale);
        scales_differ += float_bits(scale) != float_bits(s[static_cast<size_t>((b * tr + i) * tc + j)]);
        for (int64_t r = 0; r < 128; ++r)
          for (int64_t c = 0; c < 128; ++c) {
            bytes_differ += want[r * 128 + c] != q[static_cast<size_t>(at(r, c))];
            const int64_t t_at = b * cols * rows + (j * 128 + c) * rows + i * 128 + r;  // q_t [batch, cols, rows]
            transposed_differ += want[r * 128 + c] != qt[static_cast<size_t>(t_at)];
          }
      }
  EXPECT_EQ(scales_differ, 0);
  EXPECT_EQ(bytes_differ, 0);
  EXPECT_EQ(transposed_differ, 0);
  EXPECT_TRUE(std::isnan(s[static_cast<size_t>((1 * tr + 1) * tc + 1)])) << "the NaN tile's scale";
  EXPECT_TRUE(std::isinf(s[static_cast<size_t>((1 * tr + 0) * tc + 2)])) << "the inf tile's scale";
  EXPECT_EQ(s[1], 1.0f) << "the zero tile's scale";
}

// 128 x 1 tiles (a weight-gradient operand, K = rows) with the bytes written
// transposed: q_t [cols, rows], scales [rows / 128, cols].
TEST_P(Fp8Quantize, ColumnTilesTransposedMatchTheReferenceBitwise) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t rows = 384, cols = 256, tr = rows / 128;
  const std::vector<uint16_t> xt = make_data(rows * cols, 128, 17);  // [cols, rows]: a magnitude per column tile
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(r * cols + c)] = xt[static_cast<size_t>(c * rows + r)];
  for (int64_t r = 0; r < 128; ++r) x[static_cast<size_t>(r * cols)] = 0;  // column 0, row tile 0: all zero
  x[static_cast<size_t>((128 + 7) * cols + 5)] = 0x7FC0;                   // column 5, row tile 1: a NaN
  x[static_cast<size_t>((256 + 3) * cols + 200)] = 0xFF80;                 // column 200, row tile 2: -inf
  for (int64_t r = 0; r < 128; ++r)  // column 7, row tile 0: varied tiny values (amax < 2^-96: divided)
    x[static_cast<size_t>(r * cols + 7)] = static_cast<uint16_t>((r % 2 ? 0x8000u : 0u) | (1u + 3u * r));
  Dev<uint16_t> dx(x.size());
  Dev<uint8_t> dqt(x.size());
  Dev<float> ds(static_cast<size_t>(tr * cols));
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_cols_t(dx.p, rows, cols, kind(), dqt.p, ds.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto qt = dqt.get(x.size());
  const auto s = ds.get(static_cast<size_t>(tr * cols));
  int64_t bytes_differ = 0, scales_differ = 0;
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t i = 0; i < tr; ++i) {
      std::vector<float> v(128);
      for (int64_t r = 0; r < 128; ++r) v[r] = bf16(x[static_cast<size_t>((i * 128 + r) * cols + c)]);
      std::vector<uint8_t> want;
      float scale;
      reference_tile(v, GetParam(), &want, &scale);
      scales_differ += float_bits(scale) != float_bits(s[static_cast<size_t>(i * cols + c)]);
      for (int64_t r = 0; r < 128; ++r) bytes_differ += want[r] != qt[static_cast<size_t>(c * rows + i * 128 + r)];
    }
  EXPECT_EQ(scales_differ, 0);
  EXPECT_EQ(bytes_differ, 0);
  EXPECT_EQ(s[0], 1.0f) << "the zero tile's scale";
  EXPECT_TRUE(std::isnan(s[static_cast<size_t>(1 * cols + 5)])) << "the NaN tile's scale";
  EXPECT_TRUE(std::isinf(s[static_cast<size_t>(2 * cols + 200)])) << "the inf tile's scale";
  // Only the first 256 rows (a pool's used rows, read on the device): the same there, the last block untouched.
  const int32_t used = 256;
  const UsedRowsRun run(used, x.size(), static_cast<size_t>(tr * cols));
  MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_cols_t(dx.p, rows, cols, kind(), run.q.p, run.s.p, nullptr, run.used.p));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto qt_used = run.q.get(x.size());
  const auto s_used = run.s.get(static_cast<size_t>(tr * cols));
  // q_t [cols, rows]: element i is row i % rows.
  const auto [q_differ, q_past] =
      used_and_past(rows * cols, [&](int64_t i) { return i % rows < used; }, bits_of(qt_used), bits_of(qt), 0xABu);
  const auto [s_differ, s_past] = used_and_past(
      tr * cols, [&](int64_t i) { return i < used / 128 * cols; }, bits_of(s_used), bits_of(s), 0xABABABABu);
  const int64_t used_differ = q_differ + s_differ, written_past = q_past + s_past;
  EXPECT_EQ(used_differ, 0) << "the used rows";
  EXPECT_EQ(written_past, 0) << "written past the used rows";
}

// The column quantizer fused with the pool gather: for the pool's used row
// blocks, the same bytes and scales as gather_rows followed by
// quantize_e4m3_cols_t (matched with the reference above); nothing written
// for the row blocks past the used rows. Padding rows (row_src -1) are zeros.
void expect_gather_cols_t_matches(int64_t T, int64_t cols, int k, int64_t capacity, int32_t used,
                                  cuda::Fp8Scale gpu_kind) {
  const std::vector<uint16_t> x = make_data(T * cols, 128, 23);
  const std::vector<int32_t> row_src = random_row_src(capacity, used, T * k, 11, 7);
  const size_t all = static_cast<size_t>(capacity * cols), n = static_cast<size_t>(used * cols);
  const size_t n_ref = std::max<size_t>(n, 1);  // (used = 0: no reference pass, a 1-element placeholder)
  Dev<uint16_t> dx(x.size()), pool(n_ref);
  Dev<int32_t> dsrc(row_src.size()), dused(1);
  Dev<uint8_t> q_ref(n_ref), q(all);
  Dev<float> s_ref(std::max<size_t>(static_cast<size_t>(used / 128 * cols), 1)), s(static_cast<size_t>(capacity / 128 * cols));
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dsrc.p, row_src.data(), row_src.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dused.p, &used, 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(q.p, 0xAB, all), cudaSuccess);  // past `used`: must stay
  ASSERT_EQ(cudaMemset(s.p, 0xAB, static_cast<size_t>(capacity / 128 * cols) * 4), cudaSuccess);
  if (used > 0) {
    MEGAMOE_ASSERT_OK(cuda::gather_rows(dx.p, cols, dsrc.p, k, dused.p, used, pool.p, nullptr));
    MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_cols_t(pool.p, used, cols, gpu_kind, q_ref.p, s_ref.p, nullptr));
  }
  MEGAMOE_ASSERT_OK(
      cuda::gather_quantize_e4m3_cols_t(dx.p, cols, dsrc.p, k, dused.p, capacity, gpu_kind, q.p, s.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto qg = q.get(all), qr = q_ref.get(n);  // q_t [cols, capacity] against [cols, used]
  const auto sg = s.get(static_cast<size_t>(capacity / 128 * cols));
  const auto sr = s_ref.get(static_cast<size_t>(used / 128 * cols));
  int64_t q_differ = 0, s_differ = 0, written_past = 0;
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < capacity; ++r) {
      const uint8_t got = qg[static_cast<size_t>(c * capacity + r)];
      if (r < used)
        q_differ += got != qr[static_cast<size_t>(c * used + r)];
      else
        written_past += got != 0xAB;
    }
  for (size_t i = 0; i < sg.size(); ++i) {
    if (i < sr.size())
      s_differ += float_bits(sg[i]) != float_bits(sr[i]);
    else
      written_past += float_bits(sg[i]) != 0xABABABABu;
  }
  EXPECT_EQ(q_differ, 0);
  EXPECT_EQ(s_differ, 0);
  EXPECT_EQ(written_past, 0) << "written for the row blocks past the used rows";
}

TEST_P(Fp8Quantize, GatheredColumnTilesAreTheGatheredPoolQuantised) {
  MEGAMOE_REQUIRE_GPU();
  expect_gather_cols_t_matches(300, 384, 3, 1024, 896, kind());
  expect_gather_cols_t_matches(2000, 2048, 8, 9088, 8832, kind());
  expect_gather_cols_t_matches(50, 256, 2, 256, 0, kind());  // no used rows: nothing written
}

std::string scale_name(const ::testing::TestParamInfo<ScaleKind>& p) {
  return p.param == ScaleKind::kFloat32 ? "fp32" : "pow2";
}
INSTANTIATE_TEST_SUITE_P(Scales, Fp8Quantize, ::testing::Values(ScaleKind::kFloat32, ScaleKind::kPowerOfTwo),
                         scale_name);

// No GPU needed: shapes are checked before anything is launched.
TEST(Fp8QuantizeShapes, ColumnsThatAreNotMultiplesOf128AreErrors) {
  uint8_t q;
  float s;
  const uint16_t x = 0;
  const Status rows = cuda::quantize_e4m3_rows(&x, 4, 100, cuda::Fp8Scale::kFloat32, &q, &s, nullptr);
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("cols = 100 a positive multiple of 128"), std::string::npos) << rows.message();
  const Status blocks = cuda::quantize_e4m3_blocks(&x, 1, 200, 128, cuda::Fp8Scale::kFloat32, &q, nullptr, &s, nullptr);
  EXPECT_EQ(blocks.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(blocks.message().find("rows = 200"), std::string::npos) << blocks.message();
  alignas(16) uint16_t row[130] = {};
  alignas(16) uint8_t out[128];
  const Status misaligned = cuda::quantize_e4m3_rows(row + 1, 1, 128, cuda::Fp8Scale::kFloat32, out, &s, nullptr);
  EXPECT_NE(misaligned.message().find("x must be 16-byte"), std::string::npos) << misaligned.message();
  const Status cols_t = cuda::quantize_e4m3_cols_t(&x, 100, 128, cuda::Fp8Scale::kFloat32, &q, &s, nullptr);
  EXPECT_NE(cols_t.message().find("rows = 100"), std::string::npos) << cols_t.message();
  const int32_t src = 0, used = 0;
  const Status gather_cols_t =
      cuda::gather_quantize_e4m3_cols_t(&x, 128, &src, 1, &used, 200, cuda::Fp8Scale::kFloat32, &q, &s, nullptr);
  EXPECT_NE(gather_cols_t.message().find("rows = 200"), std::string::npos) << gather_cols_t.message();
  const Status no_k =
      cuda::gather_quantize_e4m3_cols_t(&x, 128, &src, 0, &used, 128, cuda::Fp8Scale::kFloat32, &q, &s, nullptr);
  EXPECT_NE(no_k.message().find("top_k = 0"), std::string::npos) << no_k.message();
  const Status scatter_null = cuda::scatter_quantize_e4m3_rows(&x, 1, 128, nullptr, 1, &src, &used, 128,
                                                               cuda::Fp8Scale::kFloat32, &q, &s, nullptr, nullptr);
  EXPECT_NE(scatter_null.message().find("a pointer is null"), std::string::npos) << scatter_null.message();
  const Status scatter_cols = cuda::scatter_quantize_e4m3_rows(&x, 1, 100, &src, 1, &src, &used, 128,
                                                               cuda::Fp8Scale::kFloat32, &q, &s, nullptr, nullptr);
  EXPECT_NE(scatter_cols.message().find("cols = 100"), std::string::npos) << scatter_cols.message();
  // A slot must hold a row's bytes and scales (e4m3_slot_bytes), in 16-byte pieces.
  EXPECT_EQ(cuda::e4m3_slot_bytes(2048), 2048 + 64);
  EXPECT_EQ(cuda::e4m3_slot_bytes(128), 144);
  const Status small_slot = cuda::quantize_e4m3_rows_to_slots(&x, 1, 256, cuda::Fp8Scale::kFloat32, &q, 256, nullptr);
  EXPECT_NE(small_slot.message().find("slot_bytes = 256 must be a multiple of 16 holding 272"), std::string::npos)
      << small_slot.message();
  const Status no_rows = cuda::quantize_e4m3_rows_to_slots(nullptr, 0, 256, cuda::Fp8Scale::kFloat32, nullptr, 512,
                                                           nullptr);  // no rows: nothing to do
  EXPECT_TRUE(no_rows.ok()) << no_rows.message();
}

}  // namespace
}  // namespace megamoe::testing
