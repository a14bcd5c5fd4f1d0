// The grouped GEMM engine on its own: each mode against a plain CPU GEMM on
// random pools laid out by a real device routing plan; and its bounded waits
// (a stalled pipeline times out, reports and leaves the context usable).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/common/device_errors.h"
#include "cuda/fp8/quantize.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/plan/device_plan.h"
#include "cuda/layer/layer_kernels.h"
#include "gpu_test_util.h"
#include "reference/numerics.h"
#include "row_release.h"

namespace megamoe::testing {
namespace {

using cuda::GemmMode;
using numerics::round_to_bf16;

// A device buffer of bf16 values mirrored on the host (as floats).
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<float> host;
  DeviceTensor dev;
  void make(int64_t r, int64_t c) {
    rows = r, cols = c;
    host.assign(static_cast<size_t>(r * c), 0.0f);
    dev = DeviceTensor(DType::kBF16, {r, c});
  }
  void upload() {
    HostTensor h(DType::kBF16, {rows, cols});
    for (int64_t i = 0; i < rows * cols; ++i) h.set(i, host[i]);
    ASSERT_TRUE(dev.upload(h).ok());
  }
  // The device buffer and its bytes (bf16), as an output of expect_same_bytes.
  std::pair<void*, size_t> bytes() const { return {dev.view().data, static_cast<size_t>(rows * cols * 2)}; }
  std::vector<float> download(DType t = DType::kBF16) const {
    HostTensor h(t, {rows, cols});
    EXPECT_TRUE(dev.download(&h).ok());
    std::vector<float> v(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows * cols; ++i) v[i] = static_cast<float>(h.get(i));
    return v;
  }
};

// On a mismatch, where the wrong elements are: helps tell a layout bug from a race.
void describe_mismatch(const std::vector<float>& got, const std::vector<double>& ref, int64_t cols) {
  int64_t bad = 0, shown = 0;
  std::vector<int64_t> by_col8(static_cast<size_t>(cols / 8), 0), by_row16(8, 0);
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::fabs(got[i] - ref[i]) <= 0.05 * std::fabs(ref[i]) + 0.05) continue;
    ++bad;
    const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
    ++by_col8[c / 8];
    ++by_row16[(r % 128) / 16];
    if (shown++ < 4) std::printf("  bad (%lld, %lld): got %g ref %g\n", (long long)r, (long long)c, got[i], ref[i]);
  }
  std::printf("  %lld of %zu elements off; by 8-column group:", (long long)bad, ref.size());
  for (int64_t v : by_col8) std::printf(" %lld", (long long)v);
  std::printf("\n  by 16-row group of the tile:");
  for (int64_t v : by_row16) std::printf(" %lld", (long long)v);
  std::printf("\n");
}

double rel_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Parameter: the grid (0 = one CTA per SM, as the layer launches it). Small
// grids make every CTA walk many tiles, so the two consumers alternate and
// skip each other's stages: the ping-pong ordering is exercised even at
// these small shapes. Outputs must not depend on the grid.
class GroupedGemm : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device visible";
    MoeProblem p;
    p.num_tokens = T, p.hidden = H, p.intermediate = I, p.num_experts = E, p.top_k = k, p.max_tokens_per_rank = T;
    LayerSpec spec;
    spec.problem = p;
    spec.seed = 77;
    data = make_layer_data(spec);
    C = align_rows(T * k + E * 127);
    idx = DeviceTensor(DType::kI32, {T, k});
    ASSERT_TRUE(idx.upload(data.topk_idx).ok());
    weights = DeviceTensor(DType::kF32, {T, k});
    ASSERT_TRUE(weights.upload(data.topk_weights).ok());
    auto alloc = [&](int64_t n) {
      bufs.emplace_back(DType::kI32, std::initializer_list<int64_t>{n + 2});  // +2: room for a u64
      return static_cast<int32_t*>(bufs.back().view().data);
    };
    cuda::DevicePlanBuffers b;
    b.error_key = reinterpret_cast<unsigned long long*>(alloc(2));
    b.chunk_counts = alloc(E * (T / 256 + 1));
    b.expert_rows = alloc(E);
    b.expert_offset = alloc(E + 1);
    b.tile_expert = alloc(C / 128);
    b.route_row = alloc(T * k);
    b.row_src = alloc(C);
    ASSERT_TRUE(cuda::build_device_plan(static_cast<const int32_t*>(idx.view().data), T, k, E, b, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    route_row_dev = b.route_row, error_key_dev = b.error_key;
    plan.pool_rows = b.expert_offset + E;
    plan.tile_expert = b.tile_expert;
    plan.expert_offset = b.expert_offset;
    plan.expert_rows = b.expert_rows;
    plan.row_src = b.row_src;
    plan.num_tokens = static_cast<int>(T), plan.top_k = k, plan.num_experts = E;
    row_src.resize(static_cast<size_t>(C));
    tile_expert.resize(static_cast<size_t>(C / 128));
    offsets.resize(E + 1);
    rows.resize(E);
    cudaMemcpy(row_src.data(), b.row_src, C * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(tile_expert.data(), b.tile_expert, C / 128 * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(offsets.data(), b.expert_offset, (E + 1) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(rows.data(), b.expert_rows, E * 4, cudaMemcpyDeviceToHost);
    pool_rows = offsets[E];
    ASSERT_GT(pool_rows, 0);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    device_sms = prop.multiProcessorCount;
    sms = GetParam() == 0 ? device_sms : GetParam();
    ASSERT_TRUE(cuda::device_error_sink(0, &errors).ok());
    errors.timeout_ns = test_wait_timeout_ns();
    MEGAMOE_ASSERT_OK(cuda::take_device_error(0, nullptr));  // nothing pending from before
  }

  static int64_t align_rows(int64_t r) { return (r + 127) / 128 * 128; }

  // A pool of random values in real rows, zeros in padding rows.
  void random_pool(Mat& m, int64_t cols, uint64_t stream) {
    m.make(C, cols);
    for (int64_t r = 0; r < pool_rows; ++r)
      if (row_src[r] >= 0)
        for (int64_t c = 0; c < cols; ++c)
          m.host[r * cols + c] = round_to_bf16(static_cast<float>(uniform_pm1(5, stream, r * cols + c)));
    m.upload();
  }
  void random_mat(Mat& m, int64_t r, int64_t c, double scale, uint64_t stream) {
    m.make(r, c);
    for (int64_t i = 0; i < r * c; ++i)
      m.host[i] = round_to_bf16(static_cast<float>(scale * uniform_pm1(6, stream, i)));
    m.upload();
  }
  // Launches on the legacy stream and waits; no wait may have given up.
  void run(cuda::GroupedGemmArgs a, const cuda::GemmOverrides& o = {}) {
    if (a.errors.claim == nullptr) a.errors = errors;
    MEGAMOE_ASSERT_OK(cuda::launch_grouped_gemm(a, sms, nullptr, o));
    MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
  }
  void run_narrow(const cuda::GroupedGemmArgs& a) {
    cuda::GemmOverrides o;
    o.narrow_tiles = true;
    run(a, o);
  }
  double route_weight(int src) const { return data.topk_weights.get(src); }

  // Outputs (device pointer, bytes) filled with 0xFF before `first()` and
  // again before `second()` (each launches): every byte must come out the
  // same, and the first run must have written some.
  using Outputs = std::vector<std::pair<void*, size_t>>;
  template <typename First, typename Second>
  void expect_same_bytes(const Outputs& outs, First first, Second second, const char* what) {
    auto fill = [&] {
      for (const auto& o : outs) EXPECT_EQ(cudaMemset(o.first, 0xFF, o.second), cudaSuccess);
    };
    auto snapshot = [&] {
      std::vector<std::vector<uint8_t>> v;
      for (const auto& o : outs) {
        v.emplace_back(o.second);
        EXPECT_EQ(cudaMemcpy(v.back().data(), o.first, o.second, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      return v;
    };
    fill();
    first();
    const auto one = snapshot();
    fill();
    second();
    const auto two = snapshot();
    for (size_t i = 0; i < outs.size(); ++i) {
      int64_t differ = 0;
      for (size_t b = 0; b < outs[i].second; ++b) differ += one[i][b] != two[i][b];
      EXPECT_EQ(differ, 0) << "output " << i << ": bytes that differ " << what;
      EXPECT_TRUE(std::any_of(one[i].begin(), one[i].end(), [](uint8_t b) { return b != 0xFF; }))
          << "output " << i << " was not written";
    }
  }

  // A stage iteration CTA 0 reaches in an M-grouped launch of `tiles` tiles
  // of `k_blocks` each (past the first ring wrap when it has that many): at
  // least one CTA stalls there, and every CTA that stalls does so at it.
  int64_t stall_iteration(int64_t tiles, int64_t k_blocks) const {
    return std::min<int64_t>(9, (tiles + sms - 1) / sms * k_blocks - 1);
  }

  // A kGateUp launch: random x pool [C, H] and w13 [E*2I, H], z [C, 2I] and a [C, I] out.
  cuda::GroupedGemmArgs gate_up_problem(Mat& x, Mat& w13, Mat& z, Mat& a) {
    random_pool(x, H, 1);
    random_mat(w13, E * 2 * I, H, 1.0 / 16, 2);
    z.make(C, 2 * I);
    a.make(C, I);
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kGateUp, g.plan = plan, g.n = I, g.k = H, g.intermediate = I;
    g.a = {x.dev.view().data, C, H, nullptr};
    g.b = {w13.dev.view().data, E * 2 * I, H, nullptr};
    g.out.z = z.dev.view().data, g.out.a = a.dev.view().data;
    return g;
  }

  // A kDown launch: random a pool [C, I] and w2 [E*N, I], weighted rows into slots [k*T, N] (N = H by default).
  cuda::GroupedGemmArgs down_problem(Mat& a, Mat& w2, Mat& slots) { return down_problem(a, w2, slots, H); }
  cuda::GroupedGemmArgs down_problem(Mat& a, Mat& w2, Mat& slots, int64_t N) {
    random_pool(a, I, 3);
    random_mat(w2, E * N, I, 1.0 / 11, 4);
    slots.make(k * T, N);
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kDown, g.plan = plan, g.n = N, g.k = I, g.intermediate = I;
    g.a = {a.dev.view().data, C, I, nullptr};
    g.b = {w2.dev.view().data, E * N, I, nullptr};
    g.out.topk_weights = static_cast<const float*>(weights.view().data);
    g.out.slots = slots.dev.view().data;
    return g;
  }

  // dW [E, H, N] (got(i): element i) against the CPU's pa[rows of e]^T pb[rows of e]: the relative error.
  template <typename Got>
  double weight_grad_rel_err(const Mat& pa, const Mat& pb, int64_t N, Got got) const {
    std::vector<float> gv;
    std::vector<double> rv;
    for (int e = 0; e < E; ++e)
      for (int64_t m = 0; m < H; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0;
          for (int64_t r = offsets[e]; r < offsets[e] + rows[e]; ++r)
            s += static_cast<double>(pa.host[r * H + m]) * pb.host[r * N + n];
          rv.push_back(s);
          gv.push_back(static_cast<float>(got((e * H + m) * N + n)));
        }
    return rel_err(gv, rv);
  }

  // A kGateUpGrad launch: random dz pool [C, 2I] and w13 [E*2I, N] (MN-major B), dx rows into slots [k*T, N].
  cuda::GroupedGemmArgs gate_up_grad_problem(Mat& dz, Mat& w13, Mat& slots, int64_t N) {
    random_pool(dz, 2 * I, 5);
    random_mat(w13, E * 2 * I, N, 1.0 / 16, 6);
    slots.make(k * T, N);
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kGateUpGrad, g.plan = plan, g.n = N, g.k = 2 * I, g.intermediate = I;
    g.a = {dz.dev.view().data, C, 2 * I, nullptr};
    g.b = {w13.dev.view().data, E * 2 * I, N, nullptr};
    g.out.slots = slots.dev.view().data;
    return g;
  }

  // A kWeightGrad launch: out [E, H, I] fp32 = per expert, pa [C, H]^T @ pb [C, I] over its pool rows.
  cuda::GroupedGemmArgs weight_grad_problem(const Mat& pa, const Mat& pb, DeviceTensor& out) {
    out = DeviceTensor(DType::kF32, {E, H, I});
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kWeightGrad, g.plan = plan, g.m = H, g.n = I;
    g.a = {pa.dev.view().data, C, H, nullptr};
    g.b = {pb.dev.view().data, C, I, nullptr};
    g.out.dw = out.view().data, g.out.dw_f32 = true;
    return g;
  }

  // A kDownGrad launch: random dy pool [C, H], w2 [E*H, I] and z pool [C, 2I];
  // outputs dz [C, 2I], wa [C, I] and the d topk_w partials [C, I / 128],
  // NaN first, so that an element the epilogue does not write fails a comparison.
  // (ii: the intermediate size, I unless given.)
  cuda::GroupedGemmArgs down_grad_problem(Mat& dy, Mat& w2, Mat& z, Mat& dz, Mat& wa, DeviceTensor& dw_partial,
                                          int64_t ii = 0) {
    if (ii == 0) ii = I;
    random_pool(dy, H, 9);
    random_mat(w2, E * H, ii, 1.0 / 11, 10);
    random_pool(z, 2 * ii, 11);
    dz.make(C, 2 * ii);
    wa.make(C, ii);
    dw_partial = DeviceTensor(DType::kF32, {C, ii / 128});
    EXPECT_TRUE(dz.dev.fill_bytes(0xFF).ok());
    EXPECT_TRUE(wa.dev.fill_bytes(0xFF).ok());
    EXPECT_TRUE(dw_partial.fill_bytes(0xFF).ok());
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kDownGrad, g.plan = plan, g.n = ii, g.k = H, g.intermediate = ii;
    g.a = {dy.dev.view().data, C, H, nullptr};
    g.b = {w2.dev.view().data, E * H, ii, nullptr};
    g.out.topk_weights = static_cast<const float*>(weights.view().data);
    g.out.z_in = z.dev.view().data;
    g.out.dz = dz.dev.view().data, g.out.wa = wa.dev.view().data;
    g.out.dw_partial = static_cast<float*>(dw_partial.view().data);
    return g;
  }

  // Slot row j*T + t of every real pool row r (routed from (t, j)) against ref[r] (times its weight).
  // (cols: the slots' and ref's row length; 0: H.)
  void expect_slots_match(const Mat& slots, const std::vector<double>& ref, bool weighted, int64_t cols = 0) {
    const int64_t n = cols > 0 ? cols : H;
    const auto got = slots.download();
    std::vector<float> g_rows;
    std::vector<double> r_rows;
    for (int64_t r = 0; r < pool_rows; ++r) {
      const int s = row_src[r];
      if (s < 0) continue;
      const int64_t slot = (s % k) * T + s / k;
      for (int64_t h = 0; h < n; ++h) {
        g_rows.push_back(got[slot * n + h]);
        r_rows.push_back((weighted ? route_weight(s) : 1.0) * ref[r * n + h]);
      }
    }
    EXPECT_LT(rel_err(g_rows, r_rows), 1e-2);
    if (rel_err(g_rows, r_rows) > 1e-2) describe_mismatch(g_rows, r_rows, n);
  }

  // I = 256: kDownGrad and kWeightGrad (N = I) get two column tiles.
  const int64_t T = 300, H = 256, I = 256;
  const int E = 4, k = 2;
  int64_t C = 0, pool_rows = 0;
  int sms = 0, device_sms = 0;  // the grid the tests launch (the parameter), the GPU's SMs
  LayerData data;
  DeviceTensor idx, weights;
  std::vector<DeviceTensor> bufs;
  cuda::DevicePlan plan;
  const int32_t* route_row_dev = nullptr;  // the plan's, [T k]
  const unsigned long long* error_key_dev = nullptr;
  cuda::DeviceErrorSink errors;  // device 0's, with the test bound (test_wait_timeout_ns)
  std::vector<int32_t> row_src, tile_expert, offsets, rows;
};

// C[r, n] = sum_k A[r, k] B_e(k, n) over every real pool row, A and B given as values.
template <typename BAt>
std::vector<double> pool_gemm_values(const std::vector<double>& a, int64_t K, int64_t N,
                                     const std::vector<int32_t>& row_src, const std::vector<int32_t>& tile_expert,
                                     int64_t pool_rows, BAt b_at) {
  std::vector<double> c(static_cast<size_t>(pool_rows * N), 0.0);
  for (int64_t r = 0; r < pool_rows; ++r) {
    if (row_src[r] < 0) continue;
    const int e = tile_expert[r / 128];
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t kk = 0; kk < K; ++kk) acc += a[r * K + kk] * b_at(e, kk, n);
      c[r * N + n] = acc;
    }
  }
  return c;
}

// The same with A a bf16 pool mirrored on the host.
template <typename BAt>
std::vector<double> pool_gemm(const Mat& a, int64_t K, int64_t N, const std::vector<int32_t>& row_src,
                              const std::vector<int32_t>& tile_expert, int64_t pool_rows, BAt b_at) {
  return pool_gemm_values(std::vector<double>(a.host.begin(), a.host.end()), K, N, row_src, tile_expert, pool_rows,
                          b_at);
}

TEST_P(GroupedGemm, GateUpKMajorWritesZAndSwiglu) {
  Mat x, w13, z, a;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  run(g);
  const auto ref = pool_gemm(x, H, 2 * I, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + n) * H + kk]; });
  const auto zg = z.download(), ag = a.download();
  std::vector<float> zg_used(zg.begin(), zg.begin() + pool_rows * 2 * I);
  EXPECT_LT(rel_err(zg_used, ref), 1e-2);
  if (rel_err(zg_used, ref) > 1e-2) describe_mismatch(zg_used, ref, 2 * I);
  std::vector<double> aref(static_cast<size_t>(pool_rows * I));
  std::vector<float> ag_used(ag.begin(), ag.begin() + pool_rows * I);
  for (int64_t r = 0; r < pool_rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const double gg = ref[r * 2 * I + i], u = ref[r * 2 * I + I + i];
      aref[r * I + i] = gg / (1 + std::exp(-gg)) * u;
    }
  EXPECT_LT(rel_err(ag_used, aref), 1.5e-2);
  // z alone (no a output) is the same z.
  Mat z2;
  z2.make(C, 2 * I);
  g.out.z = z2.dev.view().data, g.out.a = nullptr;
  run(g);
  const auto z2g = z2.download();
  EXPECT_EQ(z2g, zg);
}

// bf16 kDown in 128 x 256 tiles (the default where N % 256 == 0, as here)
// against the 128 x 128 tiles: the slots bit for bit (NaN-filled first, so
// a row written by one path only shows).
// N = 256 (the fixture's H: one wide column tile) and 512 (two: tile.n > 0
// reaches the B rows and the slot columns).
TEST_P(GroupedGemm, WideDownTilesAreBitwiseTheNarrowOnes) {
  for (const int64_t N : {H, int64_t{512}}) {
    ASSERT_EQ(N % 256, 0) << "the wide kDown tiles need N % 256 == 0";
    Mat a, w2, slots;
    const cuda::GroupedGemmArgs g = down_problem(a, w2, slots, N);
    expect_same_bytes({slots.bytes()}, [&] { run(g); },
                      [&] { run_narrow(g); }, N == H ? "in the slots (N = 256)" : "in the slots (N = 512)");
  }
}

// kDown into pool order (GemmOutputs::pool_rows): pool row r holds,
// bit for bit, the slot row of its route (row_src[r] = t k + j: slot [j, t])
// and padding rows hold zeros (the pool starts as 0xFF bytes: a row not
// stored shows); the combine by route (combine_pool_rows) gives the slot
// combine's bytes. Refused where the pool order does not apply.
TEST_P(GroupedGemm, DownToPoolRowsAreTheSlotRows) {
  // Some expert's last tile holds at most 64 rows (Tile::lower_half_used unset: consumer 1 stores padding).
  ASSERT_TRUE(std::any_of(rows.begin(), rows.end(), [](int32_t r) { return r % 128 != 0 && r % 128 <= 64; }));
  for (const int64_t N : {H, int64_t{512}}) {
    SCOPED_TRACE("N " + std::to_string(N));
    Mat a, w2, slots, pool, y;
    const cuda::GroupedGemmArgs g = down_problem(a, w2, slots, N);
    pool.make(C, N);
    y.make(T, N);
    cuda::GroupedGemmArgs to_pool = g;
    to_pool.out.slots = nullptr, to_pool.out.pool_rows = pool.dev.view().data;
    ASSERT_EQ(cudaMemset(pool.dev.view().data, 0xFF, static_cast<size_t>(C * N * 2)), cudaSuccess);
    run(g);
    run(to_pool);
    const std::vector<float> in_slots = slots.download(), in_pool = pool.download();
    int64_t wrong = 0, real = 0;
    for (int64_t r = 0; r < pool_rows; ++r) {
      const int32_t s = row_src[r];
      real += s >= 0;
      for (int64_t c = 0; c < N; ++c) {
        const float got = in_pool[r * N + c];
        const float want = s < 0 ? 0.0f : in_slots[((s % k) * T + s / k) * N + c];
        wrong += !(got == want);  // (NaN: the 0xFF fill, never stored)
      }
    }
    EXPECT_EQ(wrong, 0) << "pool elements unlike their slot's (of " << pool_rows * N << ")";
    int64_t past = 0;  // rows past the last tile: never stored (still the fill)
    for (int64_t i = pool_rows * N; i < C * N; ++i) past += !std::isnan(in_pool[i]);
    EXPECT_EQ(past, 0) << "elements written past the pool's " << pool_rows << " rows";
    int64_t routes = 0;  // the valid ones
    for (int64_t i = 0; i < T * k; ++i) {
      const auto e = static_cast<int64_t>(data.topk_idx.get(i));
      routes += e >= 0 && e < E;
    }
    EXPECT_EQ(real, routes) << "every valid route has its pool row";
    const auto* idx_dev = static_cast<const int32_t*>(idx.view().data);
    expect_same_bytes({y.bytes()}, [&] {
      MEGAMOE_ASSERT_OK(cuda::combine_slots(slots.dev.view().data, idx_dev, T, k, E, N, error_key_dev, errors,
                                            y.dev.view().data, nullptr));
    }, [&] {
      MEGAMOE_ASSERT_OK(cuda::combine_pool_rows(pool.dev.view().data, route_row_dev, idx_dev, T, k, E, N,
                                                error_key_dev, errors, y.dev.view().data, nullptr));
    }, "combined from the pool by route");
  }
  Mat a, w2, slots, pool;
  pool.make(C, H);
  cuda::GroupedGemmArgs bad = down_problem(a, w2, slots);
  bad.out.slots = nullptr, bad.out.pool_rows = pool.dev.view().data;
  cuda::GemmOverrides narrow;
  narrow.narrow_tiles = true;
  const Status st = cuda::launch_grouped_gemm(bad, sms, nullptr, narrow);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("pool-order rows"), std::string::npos) << st.to_string();
  bad.out.slots = slots.dev.view().data;  // both ways at once
  const Status both = cuda::launch_grouped_gemm(bad, sms, nullptr);
  EXPECT_EQ(both.code(), StatusCode::kInvalidArgument) << both.to_string();
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

TEST_P(GroupedGemm, DownKMajorWeightsIntoSlots) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  run(g);
  const auto ref = pool_gemm(a, I, H, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w2.host[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
}

// FP8 operands, quantised on the GPU by the recipe's quantizers (1 x 128 rows
// for pools, 128 x 128 blocks for weights, fp32 scales), and the values they
// stand for (q * s, in double) for the reference GEMM: the engine's result
// may differ from it only by fp32 accumulation and the bf16 output.
struct Fp8Operand {
  DeviceTensor q, s;
  std::vector<double> value;  // [rows, cols], dequantised
};

// Scales 2^-2 .. 2^2 by 128-column block and by `rows_per_block` rows, so that
// a scale read for the wrong row or block changes the result.
void vary_block_magnitudes(Mat& m, int64_t rows_per_block) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const int step = static_cast<int>(((r / rows_per_block) * 3 + c / 128) % 5) - 2;
      m.host[r * m.cols + c] = round_to_bf16(std::ldexp(m.host[r * m.cols + c], step));
    }
  m.upload();
}

// rows_per_expert = 0: quantised by rows (1 x 128); else by 128 x 128 blocks of each expert's rows.
Fp8Operand quantize_fp8(const Mat& m, int64_t rows_per_expert) {
  Fp8Operand o;
  const int64_t sr = rows_per_expert == 0 ? m.rows : m.rows / 128;
  o.q = DeviceTensor(DType::kFP8E4M3, {m.rows, m.cols});
  o.s = DeviceTensor(DType::kF32, {sr, m.cols / 128});
  auto* q = static_cast<uint8_t*>(o.q.view().data);
  auto* s = static_cast<float*>(o.s.view().data);
  if (rows_per_expert == 0) {
    const Status st = cuda::quantize_e4m3_rows(m.dev.view().data, m.rows, m.cols, cuda::Fp8Scale::kFloat32, q, s,
                                               nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
  } else {
    const Status st = cuda::quantize_e4m3_blocks(m.dev.view().data, m.rows / rows_per_expert, rows_per_expert,
                                                 m.cols, cuda::Fp8Scale::kFloat32, q, nullptr, s, nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
  std::vector<uint8_t> qh(static_cast<size_t>(m.rows * m.cols));
  std::vector<float> sh(static_cast<size_t>(sr * m.cols / 128));
  EXPECT_EQ(cudaMemcpy(qh.data(), q, qh.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), s, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  o.value.resize(qh.size());
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const int64_t srow = rows_per_expert == 0 ? r : r / 128;
      o.value[r * m.cols + c] = static_cast<double>(numerics::float_from_e4m3(qh[r * m.cols + c])) *
                                sh[srow * (m.cols / 128) + c / 128];
    }
  return o;
}

TEST_P(GroupedGemm, GateUpFp8MatchesTheDequantisedOperands) {
  Mat x, w13, z, a;
  random_pool(x, H, 1);
  vary_block_magnitudes(x, 1);
  random_mat(w13, E * 2 * I, H, 1.0 / 16, 2);
  vary_block_magnitudes(w13, 128);
  const Fp8Operand qx = quantize_fp8(x, 0), qw = quantize_fp8(w13, 2 * I);
  z.make(C, 2 * I);
  a.make(C, I);
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok());
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUp, g.plan = plan, g.n = I, g.k = H, g.intermediate = I;
  g.elem = cuda::ElemType::kE4M3;
  g.a = {qx.q.view().data, C, H, static_cast<const float*>(qx.s.view().data)};
  g.b = {qw.q.view().data, E * 2 * I, H, static_cast<const float*>(qw.s.view().data)};
  g.out.z = z.dev.view().data, g.out.a = a.dev.view().data;
  run(g);
  const auto ref = pool_gemm_values(qx.value, H, 2 * I, row_src, tile_expert, pool_rows,
                                    [&](int e, int64_t kk, int64_t n) { return qw.value[(e * 2 * I + n) * H + kk]; });
  const auto zg = z.download();
  std::vector<float> zg_used(zg.begin(), zg.begin() + pool_rows * 2 * I);
  const double err = rel_err(zg_used, ref);
  // bf16 output rounding alone is ~2e-3 (rms, relative); a wrong scale is ~1.
  EXPECT_LT(err, 4e-3);
  if (err > 4e-3) describe_mismatch(zg_used, ref, 2 * I);
  // The quantisation itself, against the unquantised bf16 operands: e4m3's 3
  // mantissa bits give a few percent, and that is what the recipe costs.
  const auto exact = pool_gemm(x, H, 2 * I, row_src, tile_expert, pool_rows,
                               [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + n) * H + kk]; });
  const double q_err = rel_err(zg_used, exact);
  std::printf("  FP8 kGateUp z: rel. error %.2e vs the dequantised operands, %.2e vs bf16's\n", err, q_err);
  EXPECT_LT(q_err, 0.08);
  std::vector<double> aref(static_cast<size_t>(pool_rows * I));
  const auto ag = a.download();
  std::vector<float> ag_used(ag.begin(), ag.begin() + pool_rows * I);
  for (int64_t r = 0; r < pool_rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const double gg = ref[r * 2 * I + i], u = ref[r * 2 * I + I + i];
      aref[r * I + i] = gg / (1 + std::exp(-gg)) * u;
    }
  EXPECT_LT(rel_err(ag_used, aref), 1.5e-2);  // as the bf16 test's bound for a
  const size_t zb = static_cast<size_t>(pool_rows * 2 * I * 2), ab = static_cast<size_t>(pool_rows * I * 2);
  std::vector<uint8_t> z1(zb), a1(ab);
  // Timing only: without the epilogue nothing is written.
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok() && a.dev.fill_bytes(0xFF).ok());
  cuda::GemmOverrides no_epilogue;
  no_epilogue.skip_epilogue = true;
  run(g, no_epilogue);
  ASSERT_EQ(cudaMemcpy(z1.data(), z.dev.view().data, zb, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a1.data(), a.dev.view().data, ab, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::all_of(z1.begin(), z1.end(), [](uint8_t b) { return b == 0xFF; }) &&
              std::all_of(a1.begin(), a1.end(), [](uint8_t b) { return b == 0xFF; }))
      << "skip_epilogue wrote outputs";
}

TEST_P(GroupedGemm, DownFp8MatchesTheDequantisedOperands) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  vary_block_magnitudes(a, 1);
  vary_block_magnitudes(w2, 128);
  const Fp8Operand qa = quantize_fp8(a, 0), qw = quantize_fp8(w2, H);
  g.elem = cuda::ElemType::kE4M3;
  g.a.data = qa.q.view().data, g.a.scales = static_cast<const float*>(qa.s.view().data);
  g.b.data = qw.q.view().data, g.b.scales = static_cast<const float*>(qw.s.view().data);
  run(g);
  const auto ref = pool_gemm_values(qa.value, I, H, row_src, tile_expert, pool_rows,
                                    [&](int e, int64_t kk, int64_t n) { return qw.value[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
}

// Power-of-two scales make every dequantised value (an e4m3 value times 2^k)
// exact in bf16, so the bf16 engine on the dequantised operands multiplies the
// same numbers as FP8 on the quantised ones: the two may differ only by the
// order of accumulation (FP8 promotes every 128 K) and the bf16 rounding of
// the outputs. Used for the modes whose epilogues have no double reference here.
struct Pow2Fp8 {
  DeviceTensor q, s;
  Mat deq;           // bf16, exact
  Mat deq_as_given;  // pow2_blocks_transposed: the same values untransposed (the bf16 kernels' MN-major B)
};

// 1 x 128 row tiles: q [rows, cols], s [rows, cols / 128], deq [rows, cols].
Pow2Fp8 pow2_rows(const Mat& m) {
  Pow2Fp8 o;
  o.q = DeviceTensor(DType::kFP8E4M3, {m.rows, m.cols});
  o.s = DeviceTensor(DType::kF32, {m.rows, m.cols / 128});
  auto* q = static_cast<uint8_t*>(o.q.view().data);
  auto* s = static_cast<float*>(o.s.view().data);
  const Status st = cuda::quantize_e4m3_rows(m.dev.view().data, m.rows, m.cols, cuda::Fp8Scale::kPowerOfTwo, q, s,
                                             nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<uint8_t> qh(static_cast<size_t>(m.rows * m.cols));
  std::vector<float> sh(static_cast<size_t>(m.rows * (m.cols / 128)));
  EXPECT_EQ(cudaMemcpy(qh.data(), q, qh.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), s, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  o.deq.make(m.rows, m.cols);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      o.deq.host[r * m.cols + c] = numerics::float_from_e4m3(qh[r * m.cols + c]) * sh[r * (m.cols / 128) + c / 128];
  o.deq.upload();
  return o;
}

// 128 x 128 blocks of each of `experts` matrices [rows / experts, cols], and
// their transposed copy, which is the K-major B of kDownGrad / kGateUpGrad:
// q = q_t [experts * cols, rows / experts], s [experts, rows / experts / 128,
// cols / 128], deq the transposed values, deq_as_given the values as m lays them out.
Pow2Fp8 pow2_blocks_transposed(const Mat& m, int64_t experts) {
  Pow2Fp8 o;
  const int64_t R = m.rows / experts, Cc = m.cols;
  DeviceTensor q_plain(DType::kFP8E4M3, {m.rows, Cc});
  o.q = DeviceTensor(DType::kFP8E4M3, {experts * Cc, R});
  o.s = DeviceTensor(DType::kF32, {experts, R / 128, Cc / 128});
  auto* qt = static_cast<uint8_t*>(o.q.view().data);
  auto* s = static_cast<float*>(o.s.view().data);
  const Status st = cuda::quantize_e4m3_blocks(m.dev.view().data, experts, R, Cc, cuda::Fp8Scale::kPowerOfTwo,
                                               static_cast<uint8_t*>(q_plain.view().data), qt, s, nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<uint8_t> qh(static_cast<size_t>(m.rows * Cc));
  std::vector<float> sh(static_cast<size_t>(experts * (R / 128) * (Cc / 128)));
  EXPECT_EQ(cudaMemcpy(qh.data(), qt, qh.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), s, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  o.deq.make(experts * Cc, R);
  o.deq_as_given.make(m.rows, Cc);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t c = 0; c < Cc; ++c)
      for (int64_t r = 0; r < R; ++r) {
        const size_t i = static_cast<size_t>((e * Cc + c) * R + r);
        o.deq.host[i] = numerics::float_from_e4m3(qh[i]) * sh[(e * (R / 128) + r / 128) * (Cc / 128) + c / 128];
        o.deq_as_given.host[static_cast<size_t>((e * R + r) * Cc + c)] = o.deq.host[i];
      }
  o.deq.upload();
  o.deq_as_given.upload();
  return o;
}

std::vector<double> as_double(const std::vector<float>& v, size_t n) { return {v.begin(), v.begin() + n}; }

// 128 x 1 column tiles of a pool [C, cols] (K = pool rows), written transposed:
// q [cols, C], s [C / 128, cols], deq [C, cols] (the pool layout bf16 reads).
Pow2Fp8 pow2_cols_t(const Mat& m) {
  Pow2Fp8 o;
  o.q = DeviceTensor(DType::kFP8E4M3, {m.cols, m.rows});
  o.s = DeviceTensor(DType::kF32, {m.rows / 128, m.cols});
  auto* q = static_cast<uint8_t*>(o.q.view().data);
  auto* s = static_cast<float*>(o.s.view().data);
  const Status st = cuda::quantize_e4m3_cols_t(m.dev.view().data, m.rows, m.cols, cuda::Fp8Scale::kPowerOfTwo, q, s,
                                               nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<uint8_t> qh(static_cast<size_t>(m.rows * m.cols));
  std::vector<float> sh(static_cast<size_t>((m.rows / 128) * m.cols));
  EXPECT_EQ(cudaMemcpy(qh.data(), q, qh.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), s, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  o.deq.make(m.rows, m.cols);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      o.deq.host[r * m.cols + c] = numerics::float_from_e4m3(qh[c * m.rows + r]) * sh[(r / 128) * m.cols + c];
  o.deq.upload();
  return o;
}

// Scales 2^-2 .. 2^2 by 128-row block and by single column, so that a column
// tile's scale read for a neighbouring column or block changes the result.
void vary_column_magnitudes(Mat& m) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const int step = static_cast<int>(((r / 128) * 3 + c * 7) % 5) - 2;
      m.host[r * m.cols + c] = round_to_bf16(std::ldexp(m.host[r * m.cols + c], step));
    }
  m.upload();
}

TEST_P(GroupedGemm, WeightGradFp8IsBf16OnTheDequantisedOperands) {
  Mat pa, pb;
  random_pool(pa, H, 7);
  random_pool(pb, I, 8);
  vary_column_magnitudes(pa);
  vary_column_magnitudes(pb);
  const Pow2Fp8 qa = pow2_cols_t(pa), qb = pow2_cols_t(pb);
  DeviceTensor out16, out8;
  cuda::GroupedGemmArgs g = weight_grad_problem(qa.deq, qb.deq, out16);
  run(g);
  out8 = DeviceTensor(DType::kF32, {E, H, I});
  ASSERT_TRUE(out8.fill_bytes(0xFF).ok());
  g.elem = cuda::ElemType::kE4M3;
  g.a = {qa.q.view().data, H, C, static_cast<const float*>(qa.s.view().data)};
  g.b = {qb.q.view().data, I, C, static_cast<const float*>(qb.s.view().data)};
  g.out.dw = out8.view().data;
  run(g);
  HostTensor h16(DType::kF32, {E, H, I}), h8(DType::kF32, {E, H, I});
  ASSERT_TRUE(out16.download(&h16).ok() && out8.download(&h8).ok());
  std::vector<float> got;
  std::vector<double> ref;
  for (int64_t i = 0; i < E * H * I; ++i) got.push_back(static_cast<float>(h8.get(i))), ref.push_back(h16.get(i));
  const double err = rel_err(got, ref);
  std::printf("  FP8 kWeightGrad vs bf16 on the same values: %.2e\n", err);
  EXPECT_LT(err, 1e-3);  // fp32 outputs: only the accumulation order differs; a wrong scale is O(1)
  // A misshapen call is refused by name.
  g.a.rows = C;
  const Status bad = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(bad.to_string().find("A^T [m, C]"), std::string::npos) << bad.to_string();
}

TEST_P(GroupedGemm, DownGradFp8IsBf16OnTheDequantisedOperands) {
  Mat dy, w2, z, dz, wa;
  DeviceTensor dwp;
  cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dwp);
  vary_block_magnitudes(dy, 1);
  vary_block_magnitudes(w2, 128);
  const Pow2Fp8 qdy = pow2_rows(dy), qw = pow2_blocks_transposed(w2, E);  // w2 [E*H, I] -> [E*I, H]
  g.a.data = qdy.deq.dev.view().data;
  g.b.data = qw.deq_as_given.dev.view().data;  // bf16 reads B as given, MN-major
  run(g);
  Mat dz8, wa8;
  dz8.make(C, 2 * I), wa8.make(C, I);
  DeviceTensor dwp8(DType::kF32, {C, I / 128});
  ASSERT_TRUE(dz8.dev.fill_bytes(0xFF).ok() && wa8.dev.fill_bytes(0xFF).ok() && dwp8.fill_bytes(0xFF).ok());
  g.elem = cuda::ElemType::kE4M3;
  g.a.data = qdy.q.view().data, g.a.scales = static_cast<const float*>(qdy.s.view().data);
  g.b = {qw.q.view().data, E * I, H, static_cast<const float*>(qw.s.view().data)};
  g.b_transposed = true;
  g.out.dz = dz8.dev.view().data, g.out.wa = wa8.dev.view().data;
  g.out.dw_partial = static_cast<float*>(dwp8.view().data);
  run(g);
  const size_t dz_n = static_cast<size_t>(pool_rows * 2 * I), wa_n = static_cast<size_t>(pool_rows * I);
  const double e_dz = rel_err(dz8.download(), as_double(dz.download(), dz_n));
  const double e_wa = rel_err(wa8.download(), as_double(wa.download(), wa_n));
  HostTensor p16(DType::kF32, {C, I / 128}), p8(DType::kF32, {C, I / 128});
  ASSERT_TRUE(dwp.download(&p16).ok() && dwp8.download(&p8).ok());
  std::vector<float> v8;
  std::vector<double> v16;
  for (int64_t i = 0; i < pool_rows * (I / 128); ++i) v8.push_back(static_cast<float>(p8.get(i))), v16.push_back(p16.get(i));
  const double e_p = rel_err(v8, v16);
  std::printf("  FP8 kDownGrad vs bf16 on the same values: dz %.2e, wa %.2e, d topk_w partials %.2e\n", e_dz, e_wa, e_p);
  // A wrong scale (2^-2 .. 2^2 apart by block) would be O(1); accumulation order and bf16 rounding ~1e-3.
  EXPECT_LT(e_dz, 4e-3);
  EXPECT_LT(e_wa, 4e-3);
  EXPECT_LT(e_p, 1e-3);

  // dz in e4m3 from the epilogue (dz_q): bitwise what the row quantizer makes
  // of the bf16 dz the same call writes, and the epilogue's other outputs
  // unchanged. Four rows of the saved z first
  // get values the recipe must survive: u = inf in one column (that dz_g
  // group's amax and scale are inf: pow2's reciprocal is 0), g = inf (NaN in
  // the row), every z 1e30 (huge dz), every z 1e-37 (dz near the bottom of
  // the normal range: the fp32 scale clamps to FLT_MIN).
  {
    const uint16_t kInf = 0x7F80, kHuge = 0x714A, kTiny = 0x0208;  // bf16 bits
    std::vector<uint16_t> row(static_cast<size_t>(2 * I));
    auto* z_bits = static_cast<uint16_t*>(z.dev.view().data);
    for (int64_t r = 0; r < 4; ++r) {
      ASSERT_EQ(cudaMemcpy(row.data(), z_bits + r * 2 * I, row.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      if (r == 0) row[static_cast<size_t>(I + 5)] = kInf;
      if (r == 1) row[7] = kInf;
      if (r >= 2) std::fill(row.begin(), row.end(), r == 2 ? kHuge : kTiny);
      ASSERT_EQ(cudaMemcpy(z_bits + r * 2 * I, row.data(), row.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    run(g);  // dz8 (and wa8, the partials) again, from the changed z
  }
  const size_t dz_bytes = static_cast<size_t>(pool_rows * 2 * I * 2);
  std::vector<uint8_t> dz_before(dz_bytes);
  ASSERT_EQ(cudaMemcpy(dz_before.data(), dz8.dev.view().data, dz_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  const int64_t groups = 2 * I / 128;
  for (const cuda::Fp8Scale kind : {cuda::Fp8Scale::kFloat32, cuda::Fp8Scale::kPowerOfTwo}) {
      const std::string what = kind == cuda::Fp8Scale::kFloat32 ? "fp32 scales" : "pow2 scales";
      DeviceTensor fq(DType::kFP8E4M3, {C, 2 * I}), fs(DType::kF32, {C, groups});
      DeviceTensor rq(DType::kFP8E4M3, {C, 2 * I}), rs(DType::kF32, {C, groups});
      ASSERT_TRUE(fq.fill_bytes(0xAB).ok() && fs.fill_bytes(0xAB).ok());
      cuda::GroupedGemmArgs q = g;
      q.out.dz_q = static_cast<uint8_t*>(fq.view().data), q.out.dz_s = static_cast<float*>(fs.view().data);
      q.out.dz_scale = kind;
      run(q);
      std::vector<uint8_t> dz_after(dz_bytes);
      ASSERT_EQ(cudaMemcpy(dz_after.data(), dz8.dev.view().data, dz_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_TRUE(dz_after == dz_before) << "dz changed with dz_q set, " << what;
      MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(dz8.dev.view().data, C, 2 * I, kind,
                                                 static_cast<uint8_t*>(rq.view().data),
                                                 static_cast<float*>(rs.view().data), nullptr));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint8_t> got_q(static_cast<size_t>(C * 2 * I)), want_q(got_q.size());
      std::vector<uint32_t> got_s(static_cast<size_t>(C * groups)), want_s(got_s.size());
      ASSERT_EQ(cudaMemcpy(got_q.data(), fq.view().data, got_q.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(want_q.data(), rq.view().data, want_q.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got_s.data(), fs.view().data, got_s.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(want_s.data(), rs.view().data, want_s.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t q_differ = 0, s_differ = 0, written_past = 0;
      for (int64_t r = 0; r < C; ++r) {
        for (int64_t c = 0; c < 2 * I; ++c) {
          const size_t i = static_cast<size_t>(r * 2 * I + c);
          if (r < pool_rows)
            q_differ += got_q[i] != want_q[i];
          else
            written_past += got_q[i] != 0xAB;
        }
        for (int64_t gi = 0; gi < groups; ++gi) {
          const size_t i = static_cast<size_t>(r * groups + gi);
          if (r < pool_rows)
            s_differ += got_s[i] != want_s[i];
          else
            written_past += got_s[i] != 0xABABABABu;
        }
      }
      EXPECT_EQ(q_differ, 0) << what;
      EXPECT_EQ(s_differ, 0) << what;
      EXPECT_EQ(written_past, 0) << "dz_q / dz_s written past the pool's used rows, " << what;
    }
  // Refused where it does not exist: no scales, another mode (buffers of the right size, never written).
  DeviceTensor spare_q(DType::kFP8E4M3, {C, 2 * I}), spare_s(DType::kF32, {C, groups});
  cuda::GroupedGemmArgs bad = g;
  bad.out.dz_q = static_cast<uint8_t*>(spare_q.view().data), bad.out.dz_s = nullptr;
  const Status no_s = cuda::launch_grouped_gemm(bad, sms, nullptr);
  EXPECT_NE(no_s.to_string().find("dz in e4m3"), std::string::npos) << no_s.to_string();
  cuda::GroupedGemmArgs other;
  other.mode = GemmMode::kDown, other.plan = plan, other.n = H, other.k = I, other.intermediate = I;
  other.out.dz_q = static_cast<uint8_t*>(spare_q.view().data);
  other.out.dz_s = static_cast<float*>(spare_s.view().data);
  const Status not_down_grad = cuda::launch_grouped_gemm(other, sms, nullptr);
  EXPECT_NE(not_down_grad.to_string().find("dz in e4m3"), std::string::npos) << not_down_grad.to_string();
  cuda::GroupedGemmArgs unaligned = g;  // the epilogue stores 8 bytes at a time
  unaligned.out.dz_q = static_cast<uint8_t*>(spare_q.view().data) + 4;
  unaligned.out.dz_s = static_cast<float*>(spare_s.view().data);
  const Status misaligned = cuda::launch_grouped_gemm(unaligned, sms, nullptr);
  EXPECT_NE(misaligned.to_string().find("dz_q 8-byte"), std::string::npos) << misaligned.to_string();
}

TEST_P(GroupedGemm, GateUpGradFp8IsBf16OnTheDequantisedOperands) {
  Mat dz, w13, slots, slots8;
  random_pool(dz, 2 * I, 5);
  vary_block_magnitudes(dz, 1);
  random_mat(w13, E * 2 * I, H, 1.0 / 16, 6);
  vary_block_magnitudes(w13, 128);
  const Pow2Fp8 qdz = pow2_rows(dz), qw = pow2_blocks_transposed(w13, E);  // w13 [E*2I, H] -> [E*H, 2I]
  slots.make(k * T, H), slots8.make(k * T, H);
  ASSERT_TRUE(slots.dev.fill_bytes(0).ok() && slots8.dev.fill_bytes(0).ok());
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUpGrad, g.plan = plan, g.n = H, g.k = 2 * I, g.intermediate = I;
  g.a = {qdz.deq.dev.view().data, C, 2 * I, nullptr};
  g.b = {qw.deq_as_given.dev.view().data, E * 2 * I, H, nullptr};  // bf16 reads B as given, MN-major
  g.out.slots = slots.dev.view().data;
  run(g);
  g.elem = cuda::ElemType::kE4M3;
  g.a.data = qdz.q.view().data, g.a.scales = static_cast<const float*>(qdz.s.view().data);
  g.b = {qw.q.view().data, E * H, 2 * I, static_cast<const float*>(qw.s.view().data)};
  g.b_transposed = true;
  g.out.slots = slots8.dev.view().data;
  run(g);
  const auto a = slots.download(), b = slots8.download();
  std::vector<float> got;
  std::vector<double> ref;
  for (int64_t r = 0; r < pool_rows; ++r) {
    const int src = row_src[r];
    if (src < 0) continue;
    const int64_t slot = (src % k) * T + src / k;
    got.insert(got.end(), b.begin() + slot * H, b.begin() + (slot + 1) * H);
    ref.insert(ref.end(), a.begin() + slot * H, a.begin() + (slot + 1) * H);
  }
  const double err = rel_err(got, ref);
  std::printf("  FP8 kGateUpGrad dx slots vs bf16 on the same values: %.2e\n", err);
  EXPECT_LT(err, 4e-3);
}

TEST_P(GroupedGemm, Fp8IsRefusedWhereItIsNotBuilt) {
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUpGrad, g.plan = plan, g.n = H, g.k = 2 * I, g.elem = cuda::ElemType::kE4M3;  // B not transposed
  const Status mn = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(mn.to_string().find("give B transposed"), std::string::npos) << mn.to_string();
  g.mode = GemmMode::kDownGrad, g.b_transposed = true, g.b.rows = 100, g.b.cols = 2 * I, g.n = 100;  // n not whole 128s
  const Status st = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(st.code(), StatusCode::kOk) << st.to_string();
  g.mode = GemmMode::kDown, g.b_transposed = false, g.n = H, g.k = 192, g.intermediate = 192;  // K not whole 128-blocks
  g.a.scales = g.b.scales = static_cast<const float*>(weights.view().data);  // (never read: refused first)
  const Status k192 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(k192.to_string().find("multiple of 128"), std::string::npos) << k192.to_string();
  // kGateUp's up columns start I / 128 scale blocks after the gate columns: I must be whole blocks.
  g.mode = GemmMode::kGateUp, g.n = 192, g.k = H, g.intermediate = 192, g.a.cols = g.b.cols = H, g.b.rows = E * 384;
  const Status i192 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(i192.to_string().find("I a multiple of 128"), std::string::npos) << i192.to_string();
  g.n = 128, g.intermediate = 256, g.b.rows = E * 512;  // n is not I: the paired column walk would drop a tile
  const Status n128 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(n128.to_string().find("n = I"), std::string::npos) << n128.to_string();
}

// What no layer call selects is not built, and asking for it is refused by
// name (kernel_spec.h's kBuiltKernels): bf16 kGateUp in 128 x 128 tiles,
// held rows outside bf16 kGateUp, bf16 with B transposed.
TEST_P(GroupedGemm, KernelsThatAreNotBuiltAreRefused) {
  auto expect_refused = [&](const cuda::GroupedGemmArgs& bad, const cuda::GemmOverrides& o, const char* want) {
    const Status st = cuda::launch_grouped_gemm(bad, sms, nullptr, o);
    EXPECT_EQ(st.code(), StatusCode::kUnimplemented) << want << ": " << st.to_string();
    EXPECT_NE(st.message().find(want), std::string::npos) << st.to_string();
  };
  cuda::GemmOverrides narrow;
  narrow.narrow_tiles = true;
  Mat x, w13, z, a;
  expect_refused(gate_up_problem(x, w13, z, a), narrow, "kGateUp bf16 128x128 is not built");
  DeviceTensor counters(DType::kI32, {C / 128});
  Mat a2, w2, slots;
  cuda::GroupedGemmArgs held = down_problem(a2, w2, slots);
  held.arrival.rows_ready = static_cast<const uint32_t*>(counters.view().data), held.arrival.ready_value = 1;
  expect_refused(held, {}, "held rows are built for bf16 kGateUp only, not kDown");
  Mat dz, w13g, slots2;
  cuda::GroupedGemmArgs transposed = gate_up_grad_problem(dz, w13g, slots2, H);
  transposed.b_transposed = true, transposed.b.rows = E * H, transposed.b.cols = 2 * I;
  expect_refused(transposed, {}, "bf16 reads B as given");
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

TEST_P(GroupedGemm, GateUpGradMnMajorWeightsIntoSlots) {
  Mat dz, w13, slots;
  run(gate_up_grad_problem(dz, w13, slots, H));
  const auto ref = pool_gemm(dz, 2 * I, H, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + kk) * H + n]; });
  expect_slots_match(slots, ref, /*weighted=*/false);
}

// bf16 kGateUpGrad in 128 x 256 tiles (the default) against the 128 x 128
// tiles (GemmOverrides::narrow_tiles): the dx slots bit for bit (NaN-filled first).
// N = 256 (one wide column tile) and 512 (two: tile.n > 0 reaches B's
// columns and the slot columns); the wide slots also against the CPU.
TEST_P(GroupedGemm, WideGateUpGradTilesAreBitwiseTheNarrowOnes) {
  for (const int64_t N : {H, int64_t{512}}) {
    Mat dz, w13, slots;
    const cuda::GroupedGemmArgs wide = gate_up_grad_problem(dz, w13, slots, N);
    expect_same_bytes({slots.bytes()}, [&] { run_narrow(wide); },
                      [&] { run(wide); }, N == H ? "in the dx slots (N = 256)" : "in the dx slots (N = 512)");
    // The wide run's slots against the CPU.
    const auto ref = pool_gemm(dz, 2 * I, N, row_src, tile_expert, pool_rows,
                               [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + kk) * N + n]; });
    expect_slots_match(slots, ref, /*weighted=*/false, N);
  }
}

// Rows first (an expert's row tiles of one column tile next to each other)
// against the columns-first order: every output bit for bit, in each
// M-grouped mode and tile shape it is built for. Here an expert holds 1-3
// row tiles and 2-4 column tiles, so the orders differ in every expert; a
// tile numbered twice or left out shows.
TEST_P(GroupedGemm, RowsFirstTilesAreBitwiseTheColumnsFirstOnes) {
  auto both_orders = [&](const cuda::GroupedGemmArgs& g, const Outputs& outs, const char* what, bool narrow = false) {
    cuda::GroupedGemmArgs rows_first = g;
    rows_first.tile_order = cuda::TileOrder::kRowsFirst;
    cuda::GemmOverrides o;
    o.narrow_tiles = narrow;
    expect_same_bytes(outs, [&] { run(g, o); }, [&] { run(rows_first, o); }, what);
  };
  {
    Mat x, w13, z, a;
    const cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
    both_orders(g, {z.bytes(), a.bytes()}, "kGateUp (128 x 256)");
  }
  {
    Mat a, w2, slots;
    const cuda::GroupedGemmArgs g = down_problem(a, w2, slots, 512);
    both_orders(g, {slots.bytes()}, "kDown (128 x 256, N = 512)");
    both_orders(g, {slots.bytes()}, "kDown (128 x 128, N = 512)", true);
  }
  {
    Mat dy, w2, z, dz, wa;
    DeviceTensor dw_partial;
    const cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dw_partial, 512);
    const Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (512 / 128) * 4)}};
    both_orders(g, outs, "kDownGrad (128 x 128, I = 512)");
  }
  {
    Mat dz, w13, slots;
    const cuda::GroupedGemmArgs g = gate_up_grad_problem(dz, w13, slots, 512);
    both_orders(g, {slots.bytes()}, "kGateUpGrad (128 x 256, N = 512)");
    both_orders(g, {slots.bytes()}, "kGateUpGrad (128 x 128, N = 512)", true);
  }
  // Not for kWeightGrad (its own order). (Held tiles: SideGatherIsBitwiseGatherRows.)
  Mat pa, pb;
  random_pool(pa, H, 1);
  random_pool(pb, I, 2);
  DeviceTensor out;
  cuda::GroupedGemmArgs wg = weight_grad_problem(pa, pb, out);
  wg.tile_order = cuda::TileOrder::kRowsFirst;
  const Status st = cuda::launch_grouped_gemm(wg, sms, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("rows-first"), std::string::npos) << st.to_string();
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

// GroupedGemmArgs::side_combine: a combine in a kWeightGrad launch's idle
// warps, in two launches splitting the tokens, gives combine_slots' bytes
// (with a dropped route in every fifth token), in the wide tiles and the
// 128 x 128 ones, and leaves the GEMM's own output as it was; with a failed plan every
// combined row is NaN and the plan's error is reported.
TEST_P(GroupedGemm, SideCombineIsBitwiseCombineSlots) {
  HostTensor ids(DType::kI32, {T, k});
  for (int64_t i = 0; i < T * k; ++i) ids.set(i, data.topk_idx.get(i));
  for (int64_t t = 0; t < T; t += 5) ids.set(t * k + 1, -1);
  DeviceTensor d_ids(DType::kI32, {T, k});
  ASSERT_TRUE(d_ids.upload(ids).ok());
  const auto* ids_p = static_cast<const int32_t*>(d_ids.view().data);
  Mat slots, dx;
  random_mat(slots, k * T, H, 1.0, 31);
  dx.make(T, H);
  DeviceTensor key(DType::kI32, {2});
  ASSERT_TRUE(key.fill_bytes(0xFF).ok());  // kNoPlanError
  const auto* key_p = static_cast<const unsigned long long*>(key.view().data);
  Mat pa, pb;
  random_pool(pa, H, 1);
  random_pool(pb, I, 2);
  DeviceTensor out;
  const cuda::GroupedGemmArgs g = weight_grad_problem(pa, pb, out);
  auto with_side = [&](cuda::GroupedGemmArgs a, int64_t begin, int64_t end) {
    cuda::SideCombine& s = a.side_combine;
    s.slots = slots.dev.view().data, s.slot_tokens = T;
    s.topk_idx = ids_p, s.tokens = T, s.begin = begin, s.end = end;
    s.top_k = k, s.num_experts = E, s.hidden = H;
    s.error_key = key_p, s.out = dx.dev.view().data;
    return a;
  };
  auto combine = [&] {
    MEGAMOE_ASSERT_OK(cuda::combine_slots(slots.dev.view().data, ids_p, T, k, E, H, key_p, errors,
                                          dx.dev.view().data, nullptr));
  };
  for (const bool narrow : {false, true}) {
    cuda::GemmOverrides o;
    o.narrow_tiles = narrow;
    const char* form = narrow ? " (128 x 128 tiles)" : " (128 x 256 tiles)";
    expect_same_bytes({dx.bytes()}, combine, [&] {
      run(with_side(g, 0, T / 3), o);
      run(with_side(g, T / 3, T), o);
    }, (std::string("dx") + form).c_str());
    const Outputs dw = {{out.view().data, static_cast<size_t>(E * H * I * 4)}};
    expect_same_bytes(dw, [&] { run(g, o); }, [&] { run(with_side(g, 0, T), o); },
                      (std::string("dW beside the side job") + form).c_str());
  }
  // Eight routes a token (some dropped) and rows of 45 chunks (lanes idle in
  // the second step), a combine of its own beside the same GEMM.
  {
    const int64_t T8 = 97, H8 = 8 * 45;
    const int k8 = 8;
    HostTensor ids8(DType::kI32, {T8, k8});
    for (int64_t i = 0; i < T8 * k8; ++i)
      ids8.set(i, (i * 7 + i / k8) % 11 == 0 ? -1.0 : static_cast<double>((i * 5 + 3) % E));
    DeviceTensor d_ids8(DType::kI32, {T8, k8});
    ASSERT_TRUE(d_ids8.upload(ids8).ok());
    Mat slots8, dx8;
    random_mat(slots8, k8 * T8, H8, 1.0, 32);
    dx8.make(T8, H8);
    cuda::GroupedGemmArgs g8 = g;
    cuda::SideCombine& s = g8.side_combine;
    s.slots = slots8.dev.view().data, s.slot_tokens = T8;
    s.topk_idx = static_cast<const int32_t*>(d_ids8.view().data), s.tokens = T8, s.begin = 0, s.end = T8;
    s.top_k = k8, s.num_experts = E, s.hidden = H8, s.error_key = key_p, s.out = dx8.dev.view().data;
    expect_same_bytes({dx8.bytes()}, [&] {
      MEGAMOE_ASSERT_OK(cuda::combine_slots(slots8.dev.view().data, s.topk_idx, T8, k8, E, H8, key_p, errors,
                                            dx8.dev.view().data, nullptr));
    }, [&] { run(g8); }, "dx, eight routes a token, 45 chunks a row");
  }
  // A failed plan (route 5's id out of range): every row NaN, the error reported once.
  const unsigned long long failed = (5ull << 2) | cuda::kPlanErrorOutOfRange;
  ASSERT_EQ(cudaMemcpy(key.view().data, &failed, sizeof failed, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(dx.dev.fill_bytes(0).ok());
  cuda::GroupedGemmArgs bad = with_side(g, 0, T);
  bad.errors = errors;
  ASSERT_TRUE(cuda::launch_grouped_gemm(bad, sms, nullptr).ok());
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("out of range"), std::string::npos) << st.to_string();
  const std::vector<float> got = dx.download();
  EXPECT_EQ(std::count_if(got.begin(), got.end(), [](float v) { return !std::isnan(v); }), 0);
  // Refused where it does not run: a kernel other than bf16 kWeightGrad, a range past the tokens.
  for (const auto& [what, refused] : std::vector<std::pair<const char*, cuda::GroupedGemmArgs>>{
           {"kGateUp", [&] {
              Mat x, w13, z, a;
              cuda::GroupedGemmArgs r = gate_up_problem(x, w13, z, a);
              r.side_combine = with_side(g, 0, T).side_combine;
              return r;
            }()},
           {"end past tokens", with_side(g, 0, T + 1)}}) {
    const Status r = cuda::launch_grouped_gemm(refused, sms, nullptr);
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << what << ": " << r.to_string();
    EXPECT_NE(r.message().find("side combine"), std::string::npos) << what << ": " << r.to_string();
  }
}

// GroupedGemmArgs::side_gather: a pool gathered by a kGateUpGrad or
// kWeightGrad launch's idle warps has gather_rows' bytes (padding rows
// zero, rows past the plan's untouched), and the GEMM's own output is as
// without it; kGateUp gathering its own A gives the pooled results; kDown,
// kDownGrad, and kGateUp without the holds, refuse it.
TEST_P(GroupedGemm, SideGatherIsBitwiseGatherRows) {
  Mat tok, pool;
  random_mat(tok, T, H, 1.0, 41);
  pool.make(C, H);
  auto with_side = [&](cuda::GroupedGemmArgs a) {
    cuda::SideGather& s = a.side_gather;
    s.src = tok.dev.view().data, s.width = H, s.row_src = plan.row_src, s.top_k = k;
    s.pool_rows = plan.pool_rows, s.pool = pool.dev.view().data;
    return a;
  };
  auto gather = [&] {
    MEGAMOE_ASSERT_OK(cuda::gather_rows(tok.dev.view().data, H, plan.row_src, k, plan.pool_rows, C,
                                        pool.dev.view().data, nullptr));
  };
  Mat dz, w13, slots;
  const cuda::GroupedGemmArgs gx = gate_up_grad_problem(dz, w13, slots, H);
  Mat pa, pb;
  random_pool(pa, H, 1);
  random_pool(pb, I, 2);
  DeviceTensor out;
  const cuda::GroupedGemmArgs gw = weight_grad_problem(pa, pb, out);
  const Outputs gx_out = {slots.bytes()}, gw_out = {{out.view().data, static_cast<size_t>(E * H * I * 4)}};
  for (const bool wgrad : {false, true}) {
    const cuda::GroupedGemmArgs host = wgrad ? gw : gx;
    const std::string what = wgrad ? "kWeightGrad" : "kGateUpGrad";
    expect_same_bytes({pool.bytes()}, gather, [&] { run(with_side(host)); }, ("the pool, in " + what).c_str());
    expect_same_bytes(wgrad ? gw_out : gx_out, [&] { run(host); }, [&] { run(with_side(host)); },
                      ("the GEMM's output beside the side job, " + what).c_str());
    // The scatter form (SideGather::route_row): the same pool from each token row read once.
    cuda::GroupedGemmArgs scatter = with_side(host);
    scatter.side_gather.route_row = route_row_dev, scatter.side_gather.tokens = T;
    expect_same_bytes({pool.bytes()}, gather, [&] { run(scatter); }, ("the pool scattered, in " + what).c_str());
    expect_same_bytes(wgrad ? gw_out : gx_out, [&] { run(host); }, [&] { run(scatter); },
                      ("the GEMM's output beside the side scatter, " + what).c_str());
    // Rows of 17 and 145 16-byte chunks: fewer lanes than a warp in a row or in
    // the last step of one (the scatter's shuffles still need the whole warp).
    for (const int64_t width : {int64_t{136}, int64_t{1160}}) {
      Mat narrow, narrow_pool;
      random_mat(narrow, T, width, 1.0, 43);
      narrow_pool.make(C, width);
      cuda::GroupedGemmArgs odd = scatter;
      odd.side_gather.src = narrow.dev.view().data, odd.side_gather.width = width;
      odd.side_gather.pool = narrow_pool.dev.view().data;
      expect_same_bytes({narrow_pool.bytes()}, [&] {
        MEGAMOE_ASSERT_OK(cuda::gather_rows(narrow.dev.view().data, width, plan.row_src, k, plan.pool_rows, C,
                                            narrow_pool.dev.view().data, nullptr));
      }, [&] { run(odd); }, ("the pool scattered, " + std::to_string(width) + " columns, in " + what).c_str());
    }
  }
  // kGateUp gathering its own A, its tiles held on the rows' counts: z and a
  // as from gather_rows' pool (the pool starts as NaN: a tile read before its
  // rows are in shows), columns first and rows first.
  DeviceTensor counts(DType::kI32, {C / 128});
  auto* counts_p = static_cast<uint32_t*>(counts.view().data);
  // `pooled` reading a gather_rows pool against the same GEMM gathering its
  // own A (`pool`, NaN until gathered: a tile read before its rows are in shows).
  auto expect_own_gather_bitwise = [&](const cuda::GroupedGemmArgs& pooled, Mat& own_pool, const Outputs& outs,
                                       const char* what) {
    cuda::GroupedGemmArgs own = pooled;
    cuda::SideGather& s = own.side_gather;
    s.src = tok.dev.view().data, s.width = H, s.row_src = plan.row_src, s.top_k = k;
    s.pool_rows = plan.pool_rows, s.pool = own_pool.dev.view().data, s.rows_ready = counts_p;
    own.arrival.rows_ready = counts_p, own.arrival.ready_value = 128;
    expect_same_bytes(outs, [&] {
      MEGAMOE_ASSERT_OK(cuda::gather_rows(tok.dev.view().data, H, plan.row_src, k, plan.pool_rows, C,
                                          own_pool.dev.view().data, nullptr));
      run(pooled);
    }, [&] {
      ASSERT_TRUE(own_pool.dev.fill_bytes(0xFF).ok());
      ASSERT_TRUE(counts.fill_bytes(0).ok());
      run(own);
    }, what);
    cuda::GroupedGemmArgs unheld = own;  // the counts without the holds: refused
    unheld.arrival.rows_ready = nullptr;
    const Status r = cuda::launch_grouped_gemm(unheld, sms, nullptr);
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << what << ": " << r.to_string();
    // More CTAs than the GPU holds at once (as on an MPS share of its SMs):
    // the cooperative launch is refused with kUnavailable (the layer then
    // gathers with gather_rows), nothing runs, and no error stays behind.
    const Status big = cuda::launch_grouped_gemm(own, 2 * device_sms, nullptr);
    EXPECT_EQ(big.code(), StatusCode::kUnavailable) << what << ": " << big.to_string();
    EXPECT_NE(big.message().find("resident at once"), std::string::npos) << big.to_string();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what;
  };
  Mat x, w13_up, z, a;
  cuda::GroupedGemmArgs up = gate_up_problem(x, w13_up, z, a);  // x: the pool the gather fills
  expect_own_gather_bitwise(up, x, {z.bytes(), a.bytes()}, "kGateUp gathering its own A");
  up.tile_order = cuda::TileOrder::kRowsFirst;  // held tiles walked rows first: an expert's rows still come in pool order
  expect_own_gather_bitwise(up, x, {z.bytes(), a.bytes()}, "kGateUp gathering its own A, rows first");
  Mat a2, w2, slots2, dy, w2g, zg, dz2, wa;
  DeviceTensor dw_partial;
  for (const cuda::GroupedGemmArgs& refused :
       {with_side(down_problem(a2, w2, slots2)), with_side(down_grad_problem(dy, w2g, zg, dz2, wa, dw_partial))}) {
    const Status st = cuda::launch_grouped_gemm(refused, sms, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("side gather"), std::string::npos) << st.to_string();
  }
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

// bf16 kWeightGrad in 128 x 256 tiles against 128 x 128 ones, N = 256 and
// 512, into fp32, fp32 += and bf16: every output bit for bit, and the wide
// result against the CPU.
TEST_P(GroupedGemm, WideWeightGradTilesAreBitwiseTheNarrowOnes) {
  Mat pa;
  random_pool(pa, H, 7);
  for (const int64_t N : {I, int64_t{512}}) {
    Mat pb;
    random_pool(pb, N, 8);
    DeviceTensor out;
    cuda::GroupedGemmArgs g = weight_grad_problem(pa, pb, out);
    g.n = N, g.b.cols = N;
    for (const int form : {0, 1, 2}) {  // fp32, fp32 +=, bf16
      const DType t = form == 2 ? DType::kBF16 : DType::kF32;
      out = DeviceTensor(t, {E, H, N});
      g.out.dw = out.view().data, g.out.dw_f32 = form < 2, g.out.accumulate = form == 1;
      HostTensor start(t, {E, H, N});  // what += adds to
      for (int64_t i = 0; i < E * H * N; ++i) start.set(i, form == 1 ? round_to_bf16(static_cast<float>(uniform_pm1(9, 1, i))) : 0.0);
      auto run_as = [&](bool wide) {
        if (form == 1) {
          EXPECT_TRUE(out.upload(start).ok());
        } else {
          EXPECT_TRUE(out.fill_bytes(0xFF).ok());
        }
        cuda::GemmOverrides o;
        o.narrow_tiles = !wide;
        run(g, o);
        HostTensor h(t, {E, H, N});
        EXPECT_TRUE(out.download(&h).ok());
        std::vector<double> v(static_cast<size_t>(E * H * N));
        for (int64_t i = 0; i < E * H * N; ++i) v[i] = h.get(i);
        return v;
      };
      const auto wide = run_as(true), one = run_as(false);
      int64_t differ_one = 0;
      for (size_t i = 0; i < wide.size(); ++i) differ_one += std::memcmp(&wide[i], &one[i], sizeof(double)) != 0;
      EXPECT_EQ(differ_one, 0) << "elements that differ from the 128 x 128 tiles, N = " << N << ", form " << form;
      // The wide result against the CPU (+=: what it added to start).
      const double tol = form == 2 ? 1e-2 : 1e-4;
      EXPECT_LT(weight_grad_rel_err(pa, pb, N, [&](int64_t i) { return wide[i] - (form == 1 ? start.get(i) : 0.0); }),
                tol)
          << "N = " << N << ", form " << form;
    }
  }
}

TEST_P(GroupedGemm, WeightGradMnMajorBothOperands) {
  Mat pa, pb;
  random_pool(pa, H, 7);
  random_pool(pb, I, 8);
  DeviceTensor out;
  run(weight_grad_problem(pa, pb, out));
  HostTensor got(DType::kF32, {E, H, I});
  ASSERT_TRUE(out.download(&got).ok());
  EXPECT_LT(weight_grad_rel_err(pa, pb, I, [&](int64_t i) { return got.get(i); }), 1e-4);
}

// Error of `got` against `ref` (one output of the kDownGrad epilogue): the
// relative L2 error, the largest |got - ref| over the largest |ref|, and how
// many elements differ at all.
struct ErrStats {
  double rel = 0, max_rel = 0;
  int64_t differ = 0;
};
ErrStats err_stats(const std::vector<float>& got, const std::vector<double>& ref) {
  ErrStats st;
  double max_abs = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_abs = std::max(max_abs, std::fabs(got[i] - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    st.differ += static_cast<double>(got[i]) != ref[i];
  }
  st.rel = rel_err(got, ref);
  st.max_rel = max_abs / std::max(max_ref, 1e-30);
  return st;
}

// ga = dy_pool @ w2[e] (K = H, w2 as [E*H, I]: B is MN-major) and the fused
// epilogue, against the same formulas on the CPU (double, rounded to bf16
// where the kernel rounds): wa = bf16(w bf16(silu(g) u)), dz = [bf16(w ga u
// silu'(g)), bf16(w ga silu(g))], and the per-(row, column tile) partial
// sums sum_c ga a of d topk_w. Padding rows (zero dy and z) must come out 0.
TEST_P(GroupedGemm, DownGradMnMajorFusedEpilogue) {
  Mat dy, w2, z, dz, wa;
  DeviceTensor dw_partial;
  run(down_grad_problem(dy, w2, z, dz, wa, dw_partial));
  const int64_t n_tiles = I / 128;
  const auto ga = pool_gemm(dy, H, I, row_src, tile_expert, pool_rows,
                            [&](int e, int64_t kk, int64_t n) { return w2.host[(e * H + kk) * I + n]; });
  const auto dz_got = dz.download(), wa_got = wa.download();
  HostTensor dwp_host(DType::kF32, {C, n_tiles});
  ASSERT_TRUE(dw_partial.download(&dwp_host).ok());

  std::vector<float> wa_g, dg_g, du_g, dw_g;
  std::vector<double> wa_r, dg_r, du_r, dw_r;
  int64_t padding_nonzero = 0;
  for (int64_t r = 0; r < pool_rows; ++r) {
    const int src = row_src[r];
    if (src < 0) {  // padding: every output of the row is 0
      for (int64_t c = 0; c < I; ++c)
        padding_nonzero += wa_got[r * I + c] != 0.0f || dz_got[r * 2 * I + c] != 0.0f ||
                           dz_got[r * 2 * I + I + c] != 0.0f;
      for (int64_t n = 0; n < n_tiles; ++n) padding_nonzero += dwp_host.get(r * n_tiles + n) != 0.0;
      continue;
    }
    const double w = route_weight(src);
    for (int64_t n = 0; n < n_tiles; ++n) {
      double dw = 0;
      for (int64_t c = n * 128; c < (n + 1) * 128; ++c) {
        const double gv = z.host[r * 2 * I + c], u = z.host[r * 2 * I + I + c];
        const double sg = 1.0 / (1.0 + std::exp(-gv)), silu = gv * sg;
        const double av = round_to_bf16(static_cast<float>(silu * u));
        const double gad = ga[r * I + c];
        dw += gad * av;
        wa_r.push_back(round_to_bf16(static_cast<float>(w * av)));
        dg_r.push_back(round_to_bf16(static_cast<float>(w * gad * u * (sg * (1.0 + gv * (1.0 - sg))))));
        du_r.push_back(round_to_bf16(static_cast<float>(w * gad * silu)));
        wa_g.push_back(wa_got[r * I + c]);
        dg_g.push_back(dz_got[r * 2 * I + c]);
        du_g.push_back(dz_got[r * 2 * I + I + c]);
      }
      dw_r.push_back(dw);
      dw_g.push_back(static_cast<float>(dwp_host.get(r * n_tiles + n)));
    }
  }
  EXPECT_EQ(padding_nonzero, 0);
  const ErrStats e_wa = err_stats(wa_g, wa_r), e_dg = err_stats(dg_g, dg_r), e_du = err_stats(du_g, du_r),
                 e_dw = err_stats(dw_g, dw_r);
  std::printf("  kDownGrad vs CPU (rel L2 / max rel / elements differing of %zu, %zu partials):\n"
              "    wa %.3g / %.3g / %lld   dg %.3g / %.3g / %lld   du %.3g / %.3g / %lld   dw %.3g / %.3g / %lld\n",
              wa_r.size(), dw_r.size(), e_wa.rel, e_wa.max_rel, (long long)e_wa.differ, e_dg.rel, e_dg.max_rel,
              (long long)e_dg.differ, e_du.rel, e_du.max_rel, (long long)e_du.differ, e_dw.rel, e_dw.max_rel,
              (long long)e_dw.differ);
  // Bounds: about 3x what an H200 measured (rel L2 / max rel): wa 5.5e-5 /
  // 3.6e-3 (two elements one bf16 step off: __expf against exp), dg and du
  // 1e-5 / 2.7e-4, dw 1.8e-5 / 1.2e-4 (fp32 against double sums). wa's max
  // allows two bf16 steps of the largest value.
  constexpr double kWaRel = 2e-4, kWaMax = 8e-3, kDzRel = 4e-5, kDzMax = 1e-3, kDwRel = 6e-5, kDwMax = 4e-4;
  EXPECT_LT(e_wa.rel, kWaRel);
  EXPECT_LT(e_wa.max_rel, kWaMax);
  EXPECT_LT(e_dg.rel, kDzRel);
  EXPECT_LT(e_du.rel, kDzRel);
  EXPECT_LT(e_dg.max_rel, kDzMax);
  EXPECT_LT(e_du.max_rel, kDzMax);
  EXPECT_LT(e_dw.rel, kDwRel);
  EXPECT_LT(e_dw.max_rel, kDwMax);
  if (e_dg.rel > kDzRel) describe_mismatch(dg_g, dg_r, I);
}

// The held rows' ordering contract (GroupedGemmArgs::arrival): the x
// pool starts as NaN, and a kernel on another stream delivers its row tiles
// late (0.5 ms apart) and in reverse order, release-storing each tile's
// counter. kGateUp, launched right after on a stream of its own, must hold
// every tile until its rows are in: z and a equal, bit for bit, the run on
// the delivered pool with nothing to wait for. A GEMM that ignored the
// counters would read NaN rows (its first tiles arrive last).
TEST_P(GroupedGemm, TilesWaitForTheirRowsToArrive) {
  Mat x, w13, z_ref, a_ref, z, a;
  z.make(C, 2 * I), a.make(C, I);
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z_ref, a_ref);
  run(g);

  const int tiles = static_cast<int>(pool_rows / 128);
  HostTensor order_host(DType::kI32, {tiles});
  for (int i = 0; i < tiles; ++i) order_host.set(i, tiles - 1 - i);
  DeviceTensor order(DType::kI32, {tiles}), counters(DType::kI32, {C / 128}), late(DType::kBF16, {C, H});
  ASSERT_TRUE(order.upload(order_host).ok());
  ASSERT_TRUE(counters.fill_bytes(0).ok());
  ASSERT_TRUE(late.fill_bytes(0xFF).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t deliver = nullptr, compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&deliver, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  auto* ready = static_cast<uint32_t*>(counters.view().data);
  ASSERT_EQ(launch_row_release(x.dev.view().data, late.view().data, H, static_cast<const int32_t*>(order.view().data),
                               tiles, ready, 1u, 500'000, deliver),
            cudaSuccess);
  g.a.data = late.view().data;
  g.out.z = z.dev.view().data, g.out.a = a.dev.view().data;
  g.arrival.rows_ready = ready, g.arrival.ready_value = 1u;
  g.errors = errors;
  ASSERT_TRUE(cuda::launch_grouped_gemm(g, sms, compute).ok());
  const Status st = cuda::sync_and_take_device_error(0, compute);
  ASSERT_EQ(cudaStreamSynchronize(deliver), cudaSuccess);  // before anything it writes is freed
  cudaStreamDestroy(deliver);
  cudaStreamDestroy(compute);
  MEGAMOE_ASSERT_OK(st);
  auto used = [&](const std::vector<float>& v, int64_t cols) {
    return std::vector<float>(v.begin(), v.begin() + pool_rows * cols);
  };
  EXPECT_EQ(used(z.download(), 2 * I), used(z_ref.download(), 2 * I)) << "z";
  EXPECT_EQ(used(a.download(), I), used(a_ref.download(), I)) << "a";
}

// A tile whose rows never arrive: the wait gives up, the report names the
// kernel and the pool tile, and the context stays usable.
TEST_P(GroupedGemm, RowsThatNeverArriveTimeOutNamingTheTile) {
  Mat x, w13, z, a;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  const int tiles = static_cast<int>(pool_rows / 128), missing = tiles / 2;
  HostTensor ready_host(DType::kI32, {C / 128});
  for (int m = 0; m < C / 128; ++m) ready_host.set(m, m == missing ? 6 : 7);
  DeviceTensor counters(DType::kI32, {C / 128});
  ASSERT_TRUE(counters.upload(ready_host).ok());
  g.arrival.rows_ready = static_cast<const uint32_t*>(counters.view().data), g.arrival.ready_value = 7u;
  g.errors = errors;
  g.errors.timeout_ns = under_cuda_tool() ? 5'000'000'000ull : 50'000'000ull;
  ASSERT_TRUE(cuda::launch_grouped_gemm(g, sms, nullptr).ok());
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  for (const std::string& want : std::vector<std::string>{
           "grouped GEMM kGateUp (128 x 256 tiles),", "the rows of pool tile " + std::to_string(missing) + " never arrived",
           "gave up"})
    EXPECT_NE(st.message().find(want), std::string::npos) << "missing \"" << want << "\" in: " << st.message();
  g.arrival.rows_ready = nullptr;
  g.errors = errors;
  run(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  // Held rows are bf16 kGateUp's; kWeightGrad is refused on the host.
  cuda::GroupedGemmArgs w;
  w.mode = GemmMode::kWeightGrad, w.plan = plan, w.m = H, w.n = I, w.k = 64;
  w.arrival.rows_ready = static_cast<const uint32_t*>(counters.view().data);
  const Status refused = cuda::launch_grouped_gemm(w, sms, nullptr);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("held rows"), std::string::npos) << refused.to_string();
}

// A producer that stops issuing loads (GemmOverrides::stall_at) leaves a
// consumer waiting on a full barrier that never completes. The wait gives up
// after errors.timeout_ns, reports kernel, block, barrier and phase (the
// stage iteration), and the kernel exits: no trap, the stream synchronises.
// `g` runs with the stall, then (by the caller) again without it on the same
// context. `narrow`: in 128 x 128 tiles.
void expect_stall_reported(cuda::GroupedGemmArgs g, const cuda::DeviceErrorSink& errors, int sms, int64_t stall,
                           const std::vector<std::string>& want, bool narrow = false) {
  // 50 ms; 5 s under compute-sanitizer, where the first loads alone can take
  // longer than 50 ms.
  const bool slow = under_cuda_tool();
  g.errors = errors;
  g.errors.timeout_ns = slow ? 5'000'000'000ull : 50'000'000ull;
  cuda::GemmOverrides o;
  o.stall_at = stall, o.narrow_tiles = narrow;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cuda::launch_grouped_gemm(g, sms, nullptr, o).ok());
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // no trap, no sticky error
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  const std::string& msg = st.message();
  for (const std::string& w : want) EXPECT_NE(msg.find(w), std::string::npos) << "missing \"" << w << "\" in: " << msg;
  // The other waiters left through the CTA's abort flag, not after their own
  // (2 x) bound, and nothing waited for the default 10 s.
  EXPECT_LT(seconds, slow ? 120.0 : 5.0);
  std::printf("  stalled at stage iteration %lld: %s (%.0f ms)\n", (long long)stall, msg.c_str(), seconds * 1e3);
}

TEST_P(GroupedGemm, StalledPipelineTimesOutAndReports) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  const int64_t stall = stall_iteration(pool_rows / 128 * (H / 128), I / 64);
  ASSERT_GE(stall, 0);
  // The ping-pong consumers (128 x 128 tiles; the wide tiles: the next tests).
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kDown,", "block ", "full barrier", "phase " + std::to_string(stall) + " ",
                         "gave up"},
                        true);

  // The context is still usable: the same problem, no stall, is right and reports nothing.
  g.errors = errors;
  run_narrow(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto ref = pool_gemm(a, I, H, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w2.host[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
}

// The same for wide kGateUp tiles (both consumers on every stage): the
// producer stops, both consumers' full waits give up, one reports, naming
// the wide kernel. Then the same call without the stall equals, bit for
// bit, a run before the stall.
TEST_P(GroupedGemm, StalledWideGateUpTimesOutAndReports) {
  Mat x, w13, z, a;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok() && a.dev.fill_bytes(0xFF).ok());
  run(g);
  const std::vector<float> z_before = z.download(), a_before = a.download();
  const int64_t stall = stall_iteration(pool_rows / 128 * (I / 128), H / 64);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kGateUp (128 x 256 tiles),", "block ", "full barrier",
                         "phase " + std::to_string(stall) + " ", "gave up"});
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok() && a.dev.fill_bytes(0xFF).ok());
  g.errors = errors;
  run(g);
  const std::vector<float> z_after = z.download(), a_after = a.download();
  EXPECT_EQ(std::memcmp(z_after.data(), z_before.data(), z_before.size() * sizeof(float)), 0) << "z after a stall";
  EXPECT_EQ(std::memcmp(a_after.data(), a_before.data(), a_before.size() * sizeof(float)), 0) << "a after a stall";
}

// The same for wide kDown tiles; the report names the wide kernel, and the
// call without the stall writes the narrow tiles' slots.
TEST_P(GroupedGemm, StalledWideDownTimesOutAndReports) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  const int64_t stall = stall_iteration(pool_rows / 128 * (H / 256), I / 64);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kDown (128 x 256 tiles),", "block ", "full barrier",
                         "phase " + std::to_string(stall) + " ", "gave up"});
  g.errors = errors;
  ASSERT_TRUE(slots.dev.fill_bytes(0xFF).ok());
  run(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto wide = slots.download();
  ASSERT_TRUE(slots.dev.fill_bytes(0xFF).ok());
  run_narrow(g);
  EXPECT_EQ(std::memcmp(slots.download().data(), wide.data(), wide.size() * sizeof(float)), 0);
}

// The same for wide kGateUpGrad tiles (the default): the report names the
// wide kernel; then the call without the stall equals the narrow tiles'
// slots bit for bit.
TEST_P(GroupedGemm, StalledWideGateUpGradTimesOutAndReports) {
  Mat dz, w13, slots;
  cuda::GroupedGemmArgs g = gate_up_grad_problem(dz, w13, slots, H);
  const int64_t stall = stall_iteration(pool_rows / 128 * (H / 256), 2 * I / 64);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kGateUpGrad (128 x 256 tiles),", "block ", "full barrier",
                         "phase " + std::to_string(stall) + " ", "gave up"});
  g.errors = errors;
  expect_same_bytes({slots.bytes()}, [&] { run(g); },
                    [&] { run_narrow(g); }, "in the dx slots after a stall");
}

// The same for wide kWeightGrad tiles: the report names the wide kernel;
// then the call without the stall equals the 128 x 128 tiles bit for bit.
TEST_P(GroupedGemm, StalledWideWeightGradTimesOutAndReports) {
  Mat pa, pb;
  random_pool(pa, H, 7);
  random_pool(pb, I, 8);
  DeviceTensor out;
  cuda::GroupedGemmArgs g = weight_grad_problem(pa, pb, out);
  // CTA 0's stage iterations: its tiles t = 0, sms, ... (two a expert: H / 128 row tiles, one 256-column tile).
  int64_t cta0 = 0;
  for (int64_t t = 0; t < E * (H / 128); t += sms) cta0 += (rows[t / (H / 128)] + 63) / 64;
  const int64_t stall = std::min<int64_t>(9, cta0 - 1);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kWeightGrad (128 x 256 tiles),", "block ", "full barrier",
                         "phase " + std::to_string(stall) + " ", "gave up"});
  g.errors = errors;
  expect_same_bytes({{out.view().data, static_cast<size_t>(E * H * I * 4)}}, [&] { run(g); },
                    [&] { run_narrow(g); }, "in dW after a stall");
}

// The same for kDownGrad (its z chunks load beside the ring): the report
// names it; then the call without the stall equals a run before the stall in
// dz, w a and the partials, bit for bit.
TEST_P(GroupedGemm, StalledDownGradTimesOutAndReports) {
  Mat dy, w2, z, dz, wa;
  DeviceTensor dw_partial;
  cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dw_partial);
  const Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (I / 128) * 4)}};
  const int64_t stall = stall_iteration(pool_rows / 128 * (I / 128), H / 64);
  ASSERT_GE(stall, 0);
  auto stalled_then_run = [&] {
    expect_stall_reported(g, errors, sms, stall,
                          {"grouped GEMM kDownGrad,", "block ", "full barrier", "gave up"});
    for (const auto& o : outs) EXPECT_EQ(cudaMemset(o.first, 0xFF, o.second), cudaSuccess);
    g.errors = errors;
    run(g);
  };
  expect_same_bytes(outs, [&] { run(g); }, stalled_then_run, "(after a stall)");
}

// The same on split rings (the FP8 kernels: a ring per consumer, a producer
// thread per ring): ring 0's producer stops at the iteration, ring 1's runs
// on; the report's wait and phase are checked as loosely as when one
// producer served both rings.
TEST_P(GroupedGemm, StalledFp8PipelineTimesOutAndReports) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  const Fp8Operand qa = quantize_fp8(a, 0), qw = quantize_fp8(w2, H);
  g.elem = cuda::ElemType::kE4M3;
  g.a.data = qa.q.view().data, g.a.scales = static_cast<const float*>(qa.s.view().data);
  g.b.data = qw.q.view().data, g.b.scales = static_cast<const float*>(qw.s.view().data);
  // Ring 0 of CTA 0 serves its even tiles: stall where it still has loads.
  const int64_t tiles = pool_rows / 128 * (H / 128), k_blocks = I / 128;
  const int64_t ring0_iterations = ((tiles + sms - 1) / sms + 1) / 2 * k_blocks;
  const int64_t stall = std::min<int64_t>(3, ring0_iterations - 1);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall, {"grouped GEMM kDown,", "block ", "full barrier", "gave up"});

  g.errors = errors;
  run(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto ref = pool_gemm_values(qa.value, I, H, row_src, tile_expert, pool_rows,
                                    [&](int e, int64_t kk, int64_t n) { return qw.value[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
}

INSTANTIATE_TEST_SUITE_P(Grids, GroupedGemm, ::testing::Values(0, 1, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return i.param == 0 ? std::string("one_cta_per_sm") : "ctas_" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace megamoe::testing
