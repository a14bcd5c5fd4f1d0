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
#include "cuda/moe/device_plan.h"
#include "cuda/moe/layer_kernels.h"
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
  void run(cuda::GroupedGemmArgs a) {
    if (a.errors.claim == nullptr) a.errors = errors;
    ASSERT_TRUE(cuda::launch_grouped_gemm(a, sms, nullptr).ok());
    MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
  }
  double route_weight(int src) const { return data.topk_weights.get(src); }

  // A's row scales [rows, kbs] on the device, transposed into the by-k-block layout [kbs, rows].
  static DeviceTensor scales_by_k_block(const float* by_row, int64_t rows, int64_t kbs) {
    std::vector<float> s(static_cast<size_t>(rows * kbs)), t(s.size());
    EXPECT_EQ(cudaMemcpy(s.data(), by_row, s.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t kb = 0; kb < kbs; ++kb) t[static_cast<size_t>(kb * rows + r)] = s[static_cast<size_t>(r * kbs + kb)];
    DeviceTensor out(DType::kF32, {kbs, rows});
    EXPECT_EQ(cudaMemcpy(out.view().data, t.data(), t.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    return out;
  }

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

  // M-grouped FP8: g with A's scales by row, then by k-block (transposed here
  // from g's [a_rows, k / 128] into [k / 128, a_rows]): the same products in
  // the same order, so the same bytes.
  void expect_scales_by_k_block_bitwise(cuda::GroupedGemmArgs g, const Outputs& outs) {
    const DeviceTensor by_k_block = scales_by_k_block(g.a_scales, g.a_rows, g.k / 128);
    cuda::GroupedGemmArgs by_kb = g;
    by_kb.a_scales = static_cast<const float*>(by_k_block.view().data);
    by_kb.a_scales_by_k_block = true;
    expect_same_bytes(outs, [&] { run(g); }, [&] { run(by_kb); }, "with A's scales by k-block");
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
    g.a = x.dev.view().data, g.a_rows = C, g.a_cols = H;
    g.b = w13.dev.view().data, g.b_rows = E * 2 * I, g.b_cols = H;
    g.out0 = z.dev.view().data, g.out1 = a.dev.view().data;
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
    g.a = a.dev.view().data, g.a_rows = C, g.a_cols = I;
    g.b = w2.dev.view().data, g.b_rows = E * N, g.b_cols = I;
    g.topk_weights = static_cast<const float*>(weights.view().data);
    g.out0 = slots.dev.view().data;
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
    g.a = dz.dev.view().data, g.a_rows = C, g.a_cols = 2 * I;
    g.b = w13.dev.view().data, g.b_rows = E * 2 * I, g.b_cols = N;
    g.out0 = slots.dev.view().data;
    return g;
  }

  // A kWeightGrad launch: out [E, H, I] fp32 = per expert, pa [C, H]^T @ pb [C, I] over its pool rows.
  cuda::GroupedGemmArgs weight_grad_problem(const Mat& pa, const Mat& pb, DeviceTensor& out) {
    out = DeviceTensor(DType::kF32, {E, H, I});
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kWeightGrad, g.plan = plan, g.m = H, g.n = I;
    g.a = pa.dev.view().data, g.a_rows = C, g.a_cols = H;
    g.b = pb.dev.view().data, g.b_rows = C, g.b_cols = I;
    g.out0 = out.view().data, g.out_f32 = true;
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
    g.a = dy.dev.view().data, g.a_rows = C, g.a_cols = H;
    g.b = w2.dev.view().data, g.b_rows = E * H, g.b_cols = ii;
    g.topk_weights = static_cast<const float*>(weights.view().data);
    g.z_pool = z.dev.view().data;
    g.out0 = dz.dev.view().data, g.out1 = wa.dev.view().data;
    g.dw_partial = static_cast<float*>(dw_partial.view().data);
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

  // Gathered rows (GroupedGemmArgs::gather): random token rows [T, cols], and
  // the pool gather_rows makes of them (pool row r: token row row_src[r] / k;
  // padding rows zero).
  void token_rows_and_pool(Mat& tok, Mat& pool, int64_t cols, uint64_t stream) {
    random_mat(tok, T, cols, 1.0, stream);
    pool.make(C, cols);
    for (int64_t r = 0; r < pool_rows; ++r)
      if (row_src[r] >= 0) std::copy_n(&tok.host[row_src[r] / k * cols], cols, &pool.host[r * cols]);
    pool.upload();
  }
  // `g` gathering `tok`'s rows (the operand `which`), then reading the pool
  // instead: the same bytes.
  void expect_gathered_bitwise(cuda::GroupedGemmArgs g, cuda::GroupedGemmArgs::Gather which, const Mat& tok,
                               const Mat& pool, const Outputs& outs) {
    const bool a = which == cuda::GroupedGemmArgs::Gather::kA;
    cuda::GroupedGemmArgs gathered = g;
    (a ? gathered.a : gathered.b) = tok.dev.view().data;
    gathered.gather = which, gathered.gather_tokens = T;
    (a ? g.a : g.b) = pool.dev.view().data;
    expect_same_bytes(outs, [&] { run(gathered); }, [&] { run(g); }, "with gathered rows");
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
  g.out0 = z2.dev.view().data, g.out1 = nullptr;
  run(g);
  const auto z2g = z2.download();
  EXPECT_EQ(z2g, zg);
}

// bf16 kGateUp in 128 x 256 tiles (the default where I % 128 == 0, as here)
// against the 128 x 128 tiles (narrow_tiles): z and a bit for bit, with
// and without the a output. The wide tiles' two consumers share each stage
// and each computes 64 rows x 256 columns by one m64n256k16 a k-step; the
// narrow ones take turns, each 128 rows x 128 columns by two m64n128k16.
TEST_P(GroupedGemm, WideGateUpTilesAreBitwiseTheNarrowOnes) {
  ASSERT_EQ(I % 128, 0) << "the wide tiles need I % 128 == 0";
  Mat x, w13, z, a;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok());  // NaN wherever nothing is written
  ASSERT_TRUE(a.dev.fill_bytes(0xFF).ok());
  run(g);
  const auto z_wide = z.download(), a_wide = a.download();
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok());
  ASSERT_TRUE(a.dev.fill_bytes(0xFF).ok());
  g.narrow_tiles = true;
  run(g);
  auto used = [&](const std::vector<float>& v, int64_t cols) {
    return std::vector<float>(v.begin(), v.begin() + pool_rows * cols);
  };
  const auto z_narrow = z.download(), a_narrow = a.download();
  int64_t z_differ = 0, a_differ = 0;
  for (int64_t i = 0; i < pool_rows * 2 * I; ++i) z_differ += std::memcmp(&z_wide[i], &z_narrow[i], 4) != 0;
  for (int64_t i = 0; i < pool_rows * I; ++i) a_differ += std::memcmp(&a_wide[i], &a_narrow[i], 4) != 0;
  EXPECT_EQ(z_differ, 0) << "z elements that differ";
  EXPECT_EQ(a_differ, 0) << "a elements that differ";
  // z alone (a not asked for): the wide tiles write the same z and leave a as it was.
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok());
  ASSERT_TRUE(a.dev.fill_bytes(0xFF).ok());
  const auto a_before = a.download();
  g.narrow_tiles = false, g.out1 = nullptr;
  run(g);
  EXPECT_EQ(used(z.download(), 2 * I), used(z_wide, 2 * I));
  const auto a_after = a.download();
  EXPECT_EQ(std::memcmp(a_after.data(), a_before.data(), a_before.size() * sizeof(float)), 0)
      << "a written without out1";
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
    cuda::GroupedGemmArgs narrow = g;
    narrow.narrow_tiles = true;
    expect_same_bytes({slots.bytes()}, [&] { run(g); },
                      [&] { run(narrow); }, N == H ? "in the slots (N = 256)" : "in the slots (N = 512)");
  }
}

// kDown into pool order (GroupedGemmArgs::down_to_pool): pool row r holds,
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
    to_pool.out0 = pool.dev.view().data, to_pool.down_to_pool = true;
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
  Mat a, w2, slots;
  cuda::GroupedGemmArgs bad = down_problem(a, w2, slots);
  bad.down_to_pool = true, bad.narrow_tiles = true;
  const Status st = cuda::launch_grouped_gemm(bad, sms, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("down_to_pool"), std::string::npos) << st.to_string();
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
  g.fp8 = true;
  g.a = qx.q.view().data, g.a_rows = C, g.a_cols = H, g.a_scales = static_cast<const float*>(qx.s.view().data);
  g.b = qw.q.view().data, g.b_rows = E * 2 * I, g.b_cols = H, g.b_scales = static_cast<const float*>(qw.s.view().data);
  g.out0 = z.dev.view().data, g.out1 = a.dev.view().data;
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
  expect_scales_by_k_block_bitwise(g, {{z.dev.view().data, static_cast<size_t>(pool_rows * 2 * I * 2)},
                                       {a.dev.view().data, static_cast<size_t>(pool_rows * I * 2)}});
  const size_t zb = static_cast<size_t>(pool_rows * 2 * I * 2), ab = static_cast<size_t>(pool_rows * I * 2);
  std::vector<uint8_t> z1(zb), a1(ab);
  // Timing only: without the epilogue nothing is written.
  ASSERT_TRUE(z.dev.fill_bytes(0xFF).ok() && a.dev.fill_bytes(0xFF).ok());
  cuda::GroupedGemmArgs no_epilogue = g;
  no_epilogue.debug_skip_epilogue = true;
  run(no_epilogue);
  ASSERT_EQ(cudaMemcpy(z1.data(), z.dev.view().data, zb, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a1.data(), a.dev.view().data, ab, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::all_of(z1.begin(), z1.end(), [](uint8_t b) { return b == 0xFF; }) &&
              std::all_of(a1.begin(), a1.end(), [](uint8_t b) { return b == 0xFF; }))
      << "debug_skip_epilogue wrote outputs";
}

TEST_P(GroupedGemm, DownFp8MatchesTheDequantisedOperands) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  vary_block_magnitudes(a, 1);
  vary_block_magnitudes(w2, 128);
  const Fp8Operand qa = quantize_fp8(a, 0), qw = quantize_fp8(w2, H);
  g.fp8 = true;
  g.a = qa.q.view().data, g.a_scales = static_cast<const float*>(qa.s.view().data);
  g.b = qw.q.view().data, g.b_scales = static_cast<const float*>(qw.s.view().data);
  run(g);
  const auto ref = pool_gemm_values(qa.value, I, H, row_src, tile_expert, pool_rows,
                                    [&](int e, int64_t kk, int64_t n) { return qw.value[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
  expect_scales_by_k_block_bitwise(g, {slots.bytes()});
}

// Power-of-two scales make every dequantised value (an e4m3 value times 2^k)
// exact in bf16, so the bf16 engine on the dequantised operands multiplies the
// same numbers as FP8 on the quantised ones: the two may differ only by the
// order of accumulation (FP8 promotes every 128 K) and the bf16 rounding of
// the outputs. Used for the modes whose epilogues have no double reference here.
struct Pow2Fp8 {
  DeviceTensor q, s;
  Mat deq;  // bf16, exact
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
// cols / 128], deq the transposed values.
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
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t c = 0; c < Cc; ++c)
      for (int64_t r = 0; r < R; ++r) {
        const size_t i = static_cast<size_t>((e * Cc + c) * R + r);
        o.deq.host[i] = numerics::float_from_e4m3(qh[i]) * sh[(e * (R / 128) + r / 128) * (Cc / 128) + c / 128];
      }
  o.deq.upload();
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
  g.fp8 = true, g.pair_ctas = true;  // (pairs are bf16-only: FP8 must ignore the request)
  g.a = qa.q.view().data, g.a_rows = H, g.a_cols = C, g.a_scales = static_cast<const float*>(qa.s.view().data);
  g.b = qb.q.view().data, g.b_rows = I, g.b_cols = C, g.b_scales = static_cast<const float*>(qb.s.view().data);
  g.out0 = out8.view().data;
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
  g.a_rows = C;
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
  g.a = qdy.deq.dev.view().data;
  g.b = qw.deq.dev.view().data, g.b_rows = E * I, g.b_cols = H, g.b_k_major = true;
  run(g);
  Mat dz8, wa8;
  dz8.make(C, 2 * I), wa8.make(C, I);
  DeviceTensor dwp8(DType::kF32, {C, I / 128});
  ASSERT_TRUE(dz8.dev.fill_bytes(0xFF).ok() && wa8.dev.fill_bytes(0xFF).ok() && dwp8.fill_bytes(0xFF).ok());
  g.fp8 = true;
  g.a = qdy.q.view().data, g.a_scales = static_cast<const float*>(qdy.s.view().data);
  g.b = qw.q.view().data, g.b_scales = static_cast<const float*>(qw.s.view().data);
  g.out0 = dz8.dev.view().data, g.out1 = wa8.dev.view().data, g.dw_partial = static_cast<float*>(dwp8.view().data);
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
  expect_scales_by_k_block_bitwise(g, {{dz8.dev.view().data, static_cast<size_t>(pool_rows * 2 * I * 2)},
                                       {wa8.dev.view().data, static_cast<size_t>(pool_rows * I * 2)},
                                       {dwp8.view().data, static_cast<size_t>(pool_rows * (I / 128) * 4)}});

  // dz in e4m3 from the epilogue (dz_q): bitwise what the row quantizer makes
  // of the bf16 dz the same call writes, scales by row and by k-block, and
  // the epilogue's other outputs unchanged. Four rows of the saved z first
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
  // A's scales by k-block too in the by-k-block runs: the kernel the layer uses with both.
  const DeviceTensor a_scales_t = scales_by_k_block(g.a_scales, C, H / 128);
  for (const bool by_k_block : {false, true})
    for (const cuda::Fp8Scale kind : {cuda::Fp8Scale::kFloat32, cuda::Fp8Scale::kPowerOfTwo}) {
      const std::string what = std::string(by_k_block ? "by k-block" : "by row") +
                               (kind == cuda::Fp8Scale::kFloat32 ? ", fp32 scales" : ", pow2 scales");
      DeviceTensor fq(DType::kFP8E4M3, {C, 2 * I}), fs(DType::kF32, {C, groups});
      DeviceTensor rq(DType::kFP8E4M3, {C, 2 * I}), rs(DType::kF32, {C, groups});
      ASSERT_TRUE(fq.fill_bytes(0xAB).ok() && fs.fill_bytes(0xAB).ok());
      cuda::GroupedGemmArgs q = g;
      q.dz_q = static_cast<uint8_t*>(fq.view().data), q.dz_s = static_cast<float*>(fs.view().data);
      q.dz_scale = kind, q.dz_scales_by_k_block = by_k_block;
      if (by_k_block) q.a_scales = static_cast<const float*>(a_scales_t.view().data), q.a_scales_by_k_block = true;
      run(q);
      std::vector<uint8_t> dz_after(dz_bytes);
      ASSERT_EQ(cudaMemcpy(dz_after.data(), dz8.dev.view().data, dz_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_TRUE(dz_after == dz_before) << "dz changed with dz_q set, " << what;
      const auto layout = by_k_block ? cuda::RowScales::kByKBlock : cuda::RowScales::kByRow;
      MEGAMOE_ASSERT_OK(cuda::quantize_e4m3_rows(dz8.dev.view().data, C, 2 * I, kind,
                                                 static_cast<uint8_t*>(rq.view().data),
                                                 static_cast<float*>(rs.view().data), nullptr, layout));
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
          const size_t i = static_cast<size_t>(by_k_block ? gi * C + r : r * groups + gi);
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
  bad.dz_q = static_cast<uint8_t*>(spare_q.view().data), bad.dz_s = nullptr;
  const Status no_s = cuda::launch_grouped_gemm(bad, sms, nullptr);
  EXPECT_NE(no_s.to_string().find("dz_q"), std::string::npos) << no_s.to_string();
  cuda::GroupedGemmArgs other;
  other.mode = GemmMode::kDown, other.plan = plan, other.n = H, other.k = I, other.intermediate = I;
  other.dz_q = static_cast<uint8_t*>(spare_q.view().data), other.dz_s = static_cast<float*>(spare_s.view().data);
  const Status not_down_grad = cuda::launch_grouped_gemm(other, sms, nullptr);
  EXPECT_NE(not_down_grad.to_string().find("dz_q"), std::string::npos) << not_down_grad.to_string();
  cuda::GroupedGemmArgs unaligned = g;  // the epilogue stores 8 bytes at a time
  unaligned.dz_q = static_cast<uint8_t*>(spare_q.view().data) + 4, unaligned.dz_s = static_cast<float*>(spare_s.view().data);
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
  g.a = qdz.deq.dev.view().data, g.a_rows = C, g.a_cols = 2 * I;
  g.b = qw.deq.dev.view().data, g.b_rows = E * H, g.b_cols = 2 * I, g.b_k_major = true;
  g.out0 = slots.dev.view().data;
  run(g);
  g.fp8 = true;
  g.a = qdz.q.view().data, g.a_scales = static_cast<const float*>(qdz.s.view().data);
  g.b = qw.q.view().data, g.b_scales = static_cast<const float*>(qw.s.view().data);
  g.out0 = slots8.dev.view().data;
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
  expect_scales_by_k_block_bitwise(g, {slots8.bytes()});
}

TEST_P(GroupedGemm, Fp8IsRefusedWhereItIsNotBuilt) {
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUpGrad, g.plan = plan, g.n = H, g.k = 2 * I, g.fp8 = true;  // B not K-major
  const Status mn = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(mn.to_string().find("b_k_major"), std::string::npos) << mn.to_string();
  g.mode = GemmMode::kDownGrad, g.b_k_major = true, g.b_rows = 100, g.b_cols = 2 * I, g.n = 100;  // n not whole 128s
  const Status st = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(st.code(), StatusCode::kOk) << st.to_string();
  g.mode = GemmMode::kDown, g.b_k_major = false, g.n = H, g.k = 192, g.intermediate = 192;  // K not whole 128-blocks
  g.a_scales = g.b_scales = static_cast<const float*>(weights.view().data);  // (never read: refused first)
  const Status k192 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(k192.to_string().find("multiple of 128"), std::string::npos) << k192.to_string();
  // A's scales by k-block: M-grouped FP8 only, a_rows whole 16-byte runs of scales, a_scales 16-byte aligned.
  const auto* aligned = static_cast<const float*>(weights.view().data);
  auto expect_by_k_block_refused = [&](const cuda::GroupedGemmArgs& bad, const char* why) {
    const Status r = cuda::launch_grouped_gemm(bad, sms, nullptr);
    EXPECT_NE(r.to_string().find("a_scales_by_k_block"), std::string::npos) << why << ": " << r.to_string();
  };
  cuda::GroupedGemmArgs w;
  w.mode = GemmMode::kWeightGrad, w.plan = plan, w.m = H, w.n = I, w.k = 128, w.a_scales_by_k_block = true;
  expect_by_k_block_refused(w, "bf16");
  w.fp8 = true, w.a_rows = H, w.a_cols = C, w.b_rows = I, w.b_cols = C, w.a_scales = w.b_scales = aligned;
  expect_by_k_block_refused(w, "FP8 kWeightGrad");
  cuda::GroupedGemmArgs d;
  d.mode = GemmMode::kDown, d.plan = plan, d.n = H, d.k = I, d.intermediate = I, d.fp8 = true;
  d.a_rows = C - 2, d.a_cols = I, d.b_rows = E * H, d.b_cols = I, d.a_scales = d.b_scales = aligned;
  d.a_scales_by_k_block = true;
  expect_by_k_block_refused(d, "a_rows not a multiple of 4");
  d.a_rows = C, d.a_scales = aligned + 1;
  expect_by_k_block_refused(d, "a_scales not 16-byte aligned");
  // kGateUp's up columns start I / 128 scale blocks after the gate columns: I must be whole blocks.
  g.mode = GemmMode::kGateUp, g.n = 192, g.k = H, g.intermediate = 192, g.a_cols = g.b_cols = H, g.b_rows = E * 384;
  const Status i192 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(i192.to_string().find("I a multiple of 128"), std::string::npos) << i192.to_string();
  g.n = 128, g.intermediate = 256, g.b_rows = E * 512;  // n is not I: the paired column walk would drop a tile
  const Status n128 = cuda::launch_grouped_gemm(g, sms, nullptr);
  EXPECT_NE(n128.to_string().find("n = I"), std::string::npos) << n128.to_string();
}

TEST_P(GroupedGemm, GateUpGradMnMajorWeightsIntoSlots) {
  Mat dz, w13, slots;
  run(gate_up_grad_problem(dz, w13, slots, H));
  const auto ref = pool_gemm(dz, 2 * I, H, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + kk) * H + n]; });
  expect_slots_match(slots, ref, /*weighted=*/false);
}

// bf16 kGateUpGrad in 128 x 256 tiles (the default) against the 128 x 128
// tiles (GroupedGemmArgs::narrow_tiles): the dx slots bit for bit (NaN-filled first).
// N = 256 (one wide column tile) and 512 (two: tile.n > 0 reaches B's
// columns and the slot columns); the wide slots also against the CPU.
TEST_P(GroupedGemm, WideGateUpGradTilesAreBitwiseTheNarrowOnes) {
  for (const int64_t N : {H, int64_t{512}}) {
    Mat dz, w13, slots;
    const cuda::GroupedGemmArgs wide = gate_up_grad_problem(dz, w13, slots, N);
    cuda::GroupedGemmArgs narrow = wide;
    narrow.narrow_tiles = true;
    expect_same_bytes({slots.bytes()}, [&] { run(narrow); },
                      [&] { run(wide); }, N == H ? "in the dx slots (N = 256)" : "in the dx slots (N = 512)");
    // The wide run's slots against the CPU.
    const auto ref = pool_gemm(dz, 2 * I, N, row_src, tile_expert, pool_rows,
                               [&](int e, int64_t kk, int64_t n) { return w13.host[(e * 2 * I + kk) * N + n]; });
    expect_slots_match(slots, ref, /*weighted=*/false, N);
  }
}

// bf16 kDownGrad in 128 x 256 tiles (wide_down_grad) against the 128 x 128
// tiles: dz, w a and the d topk_w partials bit for bit, I = 256 (one wide
// column tile) and 512 (two: a tile's column halves are dz's 128-column
// blocks 2n and 2n + 1); with dz in e4m3 from the epilogue (dz_q, fp32 and
// pow2 scales); and with dy's rows gathered. The narrow tiles' results are
// checked against the CPU elsewhere (DownGradMnMajorFusedEpilogue).
TEST_P(GroupedGemm, WideDownGradTilesAreBitwiseTheNarrowOnes) {
  for (const int64_t ii : {I, int64_t{512}}) {
    Mat dy, w2, z, dz, wa, tok;
    DeviceTensor dw_partial;
    const cuda::GroupedGemmArgs narrow = down_grad_problem(dy, w2, z, dz, wa, dw_partial, ii);
    cuda::GroupedGemmArgs wide = narrow;
    wide.wide_down_grad = true;
    const std::string at = " (I = " + std::to_string(ii) + ")";
    Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (ii / 128) * 4)}};
    expect_same_bytes(outs, [&] { run(narrow); }, [&] { run(wide); }, ("in dz, w a, d topk_w" + at).c_str());
    // dz_q / dz_s: every row (the pool's used rows are written, the others keep the fill in both runs).
    DeviceTensor dq(DType::kFP8E4M3, {C, 2 * ii}), ds(DType::kF32, {C, 2 * ii / 128});
    for (const cuda::Fp8Scale kind : {cuda::Fp8Scale::kFloat32, cuda::Fp8Scale::kPowerOfTwo}) {
      cuda::GroupedGemmArgs nq = narrow, wq = wide;
      for (cuda::GroupedGemmArgs* q : {&nq, &wq})
        q->dz_q = static_cast<uint8_t*>(dq.view().data), q->dz_s = static_cast<float*>(ds.view().data),
        q->dz_scale = kind;
      Outputs with_q = outs;
      with_q.push_back({dq.view().data, static_cast<size_t>(C * 2 * ii)});
      with_q.push_back({ds.view().data, static_cast<size_t>(C * (2 * ii / 128) * 4)});
      expect_same_bytes(with_q, [&] { run(nq); }, [&] { run(wq); }, ("with dz_q" + at).c_str());
    }
    // dy's rows gathered by the wide kernel against the narrow pooled one.
    token_rows_and_pool(tok, dy, H, 22);  // dy: a new buffer
    cuda::GroupedGemmArgs pooled = narrow, gathered = wide;
    pooled.a = dy.dev.view().data;
    gathered.a = tok.dev.view().data, gathered.gather = cuda::GroupedGemmArgs::Gather::kA, gathered.gather_tokens = T;
    expect_same_bytes(outs, [&] { run(pooled); }, [&] { run(gathered); }, ("with dy gathered" + at).c_str());
  }
}

// rows_first (an expert's row tiles of one column tile next to each other)
// against the columns-first order: every output bit for bit, in each
// M-grouped mode, in 128 x 256 and 128 x 128 tiles, and kDownGrad with dy
// gathered. Here an expert holds 1-3 row tiles and 2-4 column tiles, so the
// orders differ in every expert; a tile numbered twice or left out shows.
TEST_P(GroupedGemm, RowsFirstTilesAreBitwiseTheColumnsFirstOnes) {
  auto both_orders = [&](const cuda::GroupedGemmArgs& g, const Outputs& outs, const char* what) {
    cuda::GroupedGemmArgs rows_first = g;
    rows_first.rows_first = true;
    expect_same_bytes(outs, [&] { run(g); }, [&] { run(rows_first); }, what);
  };
  {
    Mat x, w13, z, a;
    cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
    both_orders(g, {z.bytes(), a.bytes()}, "kGateUp (128 x 256)");
    g.narrow_tiles = true;
    both_orders(g, {z.bytes(), a.bytes()}, "kGateUp (128 x 128)");
  }
  {
    Mat a, w2, slots;
    cuda::GroupedGemmArgs g = down_problem(a, w2, slots, 512);
    both_orders(g, {slots.bytes()}, "kDown (128 x 256, N = 512)");
    g.narrow_tiles = true;
    both_orders(g, {slots.bytes()}, "kDown (128 x 128, N = 512)");
  }
  {
    Mat dy, w2, z, dz, wa, tok;
    DeviceTensor dw_partial;
    cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dw_partial, 512);
    const Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (512 / 128) * 4)}};
    both_orders(g, outs, "kDownGrad (128 x 128, I = 512)");
    g.wide_down_grad = true;
    both_orders(g, outs, "kDownGrad (128 x 256, I = 512)");
    token_rows_and_pool(tok, dy, H, 22);  // dy: a new buffer
    g.a = tok.dev.view().data, g.gather = cuda::GroupedGemmArgs::Gather::kA, g.gather_tokens = T;
    both_orders(g, outs, "kDownGrad (128 x 256, dy gathered)");
  }
  {
    Mat dz, w13, slots;
    cuda::GroupedGemmArgs g = gate_up_grad_problem(dz, w13, slots, 512);
    both_orders(g, {slots.bytes()}, "kGateUpGrad (128 x 256, N = 512)");
    g.narrow_tiles = true;
    both_orders(g, {slots.bytes()}, "kGateUpGrad (128 x 128, N = 512)");
  }
  // Not for kWeightGrad (its own order). (Held tiles: SideGatherIsBitwiseGatherRows.)
  Mat pa, pb;
  random_pool(pa, H, 1);
  random_pool(pb, I, 2);
  DeviceTensor out;
  cuda::GroupedGemmArgs wg = weight_grad_problem(pa, pb, out);
  wg.rows_first = true;
  const Status st = cuda::launch_grouped_gemm(wg, sms, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("rows_first"), std::string::npos) << st.to_string();
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

// GroupedGemmArgs::side_combine: a combine in a kWeightGrad launch's idle
// warps, in two launches splitting the tokens, gives combine_slots' bytes
// (with a dropped route in every fifth token), in the wide tiles and the CTA
// pairs, and leaves the GEMM's own output as it was; with a failed plan every
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
    cuda::GroupedGemmArgs::SideCombine& s = a.side_combine;
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
  for (const bool pairs : {false, true}) {
    cuda::GroupedGemmArgs host = g;
    host.narrow_tiles = pairs, host.pair_ctas = pairs;
    const char* form = pairs ? " (CTA pairs)" : " (128 x 256 tiles)";
    expect_same_bytes({dx.bytes()}, combine, [&] {
      run(with_side(host, 0, T / 3));
      run(with_side(host, T / 3, T));
    }, (std::string("dx") + form).c_str());
    const Outputs dw = {{out.view().data, static_cast<size_t>(E * H * I * 4)}};
    expect_same_bytes(dw, [&] { run(host); }, [&] { run(with_side(host, 0, T)); },
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
    cuda::GroupedGemmArgs::SideCombine& s = g8.side_combine;
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
    EXPECT_NE(r.message().find("side_combine"), std::string::npos) << what << ": " << r.to_string();
  }
}

// GroupedGemmArgs::side_gather: a pool gathered by a kGateUpGrad or
// kWeightGrad launch's idle warps has gather_rows' bytes (padding rows
// zero, rows past the plan's untouched), and the GEMM's own output is as
// without it; kGateUp and kDownGrad gathering their own A give the pooled
// results; kDown, and kGateUp without the holds, refuse it.
TEST_P(GroupedGemm, SideGatherIsBitwiseGatherRows) {
  Mat tok, pool;
  random_mat(tok, T, H, 1.0, 41);
  pool.make(C, H);
  auto with_side = [&](cuda::GroupedGemmArgs a) {
    cuda::GroupedGemmArgs::SideGather& s = a.side_gather;
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
  // rows are in shows), in 128 x 256 and 128 x 128 tiles.
  DeviceTensor counts(DType::kI32, {C / 128});
  auto* counts_p = static_cast<uint32_t*>(counts.view().data);
  // `pooled` reading a gather_rows pool against the same GEMM gathering its
  // own A (`pool`, NaN until gathered: a tile read before its rows are in shows).
  auto expect_own_gather_bitwise = [&](const cuda::GroupedGemmArgs& pooled, Mat& own_pool, const Outputs& outs,
                                       const char* what) {
    cuda::GroupedGemmArgs own = pooled;
    cuda::GroupedGemmArgs::SideGather& s = own.side_gather;
    s.src = tok.dev.view().data, s.width = H, s.row_src = plan.row_src, s.top_k = k;
    s.pool_rows = plan.pool_rows, s.pool = own_pool.dev.view().data, s.rows_ready = counts_p;
    own.rows_ready = counts_p, own.ready_value = 128;
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
    unheld.rows_ready = nullptr;
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
  expect_own_gather_bitwise(up, x, {z.bytes(), a.bytes()}, "kGateUp gathering its own A (128 x 256)");
  up.rows_first = true;  // held tiles walked rows first: an expert's rows still come in pool order
  expect_own_gather_bitwise(up, x, {z.bytes(), a.bytes()}, "kGateUp gathering its own A, rows first");
  up.rows_first = false, up.narrow_tiles = true;
  expect_own_gather_bitwise(up, x, {z.bytes(), a.bytes()}, "kGateUp gathering its own A (128 x 128)");
  Mat dy, w2g, zg, dz2, wa;  // kDownGrad's dy: dz, w a and the d topk_w partials
  DeviceTensor dw_partial;
  const cuda::GroupedGemmArgs down_grad = down_grad_problem(dy, w2g, zg, dz2, wa, dw_partial);
  expect_own_gather_bitwise(down_grad, dy,
                            {dz2.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (I / 128) * 4)}},
                            "kDownGrad gathering its own A");
  Mat a2, w2, slots2;
  const Status st = cuda::launch_grouped_gemm(with_side(down_problem(a2, w2, slots2)), sms, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("side_gather"), std::string::npos) << st.to_string();
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

// bf16 kWeightGrad in 128 x 256 tiles against the CTA pairs and one CTA a
// tile, N = 256 and 512, into fp32, fp32 += and bf16: every output bit for
// bit, and the wide result against the CPU.
TEST_P(GroupedGemm, WideWeightGradTilesAreBitwiseTheNarrowOnes) {
  Mat pa;
  random_pool(pa, H, 7);
  for (const int64_t N : {I, int64_t{512}}) {
    Mat pb;
    random_pool(pb, N, 8);
    DeviceTensor out;
    cuda::GroupedGemmArgs g = weight_grad_problem(pa, pb, out);
    g.n = N, g.b_cols = N;
    for (const int form : {0, 1, 2}) {  // fp32, fp32 +=, bf16
      const DType t = form == 2 ? DType::kBF16 : DType::kF32;
      out = DeviceTensor(t, {E, H, N});
      g.out0 = out.view().data, g.out_f32 = form < 2, g.accumulate = form == 1;
      HostTensor start(t, {E, H, N});  // what += adds to
      for (int64_t i = 0; i < E * H * N; ++i) start.set(i, form == 1 ? round_to_bf16(static_cast<float>(uniform_pm1(9, 1, i))) : 0.0);
      auto run_as = [&](bool wide, bool pairs) {
        if (form == 1) {
          EXPECT_TRUE(out.upload(start).ok());
        } else {
          EXPECT_TRUE(out.fill_bytes(0xFF).ok());
        }
        g.narrow_tiles = !wide, g.pair_ctas = pairs;
        run(g);
        HostTensor h(t, {E, H, N});
        EXPECT_TRUE(out.download(&h).ok());
        std::vector<double> v(static_cast<size_t>(E * H * N));
        for (int64_t i = 0; i < E * H * N; ++i) v[i] = h.get(i);
        return v;
      };
      const auto wide = run_as(true, true), pairs = run_as(false, true), one = run_as(false, false);
      int64_t differ_pairs = 0, differ_one = 0;
      for (size_t i = 0; i < wide.size(); ++i) {
        differ_pairs += std::memcmp(&wide[i], &pairs[i], sizeof(double)) != 0;
        differ_one += std::memcmp(&wide[i], &one[i], sizeof(double)) != 0;
      }
      EXPECT_EQ(differ_pairs, 0) << "elements that differ from the pairs, N = " << N << ", form " << form;
      EXPECT_EQ(differ_one, 0) << "elements that differ from one CTA a tile, N = " << N << ", form " << form;
      // The wide result against the CPU (+=: what it added to start).
      const double tol = form == 2 ? 1e-2 : 1e-4;
      EXPECT_LT(weight_grad_rel_err(pa, pb, N, [&](int64_t i) { return wide[i] - (form == 1 ? start.get(i) : 0.0); }),
                tol)
          << "N = " << N << ", form " << form;
    }
  }
}

// B transposed and K-major (GroupedGemmArgs::b_k_major, the layout FP8 needs)
// against the default MN-major B: the same products in the same order, so
// every output must be bitwise the same.
TEST_P(GroupedGemm, TransposedWeightsAreBitwiseTheMnMajorPath) {
  auto transposed = [](const Mat& w, int64_t experts, int64_t kdim, int64_t n) {  // [E*k, n] -> [E*n, k]
    Mat t;
    t.make(experts * n, kdim);
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = 0; r < kdim; ++r)
        for (int64_t c = 0; c < n; ++c) t.host[(e * n + c) * kdim + r] = w.host[(e * kdim + r) * n + c];
    t.upload();
    return t;
  };
  {  // kGateUpGrad: w13 as [E*2I, H] -> [E*H, 2I]
    Mat dz, w13, slots, slots_t;
    random_pool(dz, 2 * I, 5);
    random_mat(w13, E * 2 * I, H, 1.0 / 16, 6);
    slots.make(k * T, H), slots_t.make(k * T, H);
    ASSERT_TRUE(slots.dev.fill_bytes(0).ok() && slots_t.dev.fill_bytes(0xFF).ok());
    cuda::GroupedGemmArgs g;
    g.mode = GemmMode::kGateUpGrad, g.plan = plan, g.n = H, g.k = 2 * I, g.intermediate = I;
    g.a = dz.dev.view().data, g.a_rows = C, g.a_cols = 2 * I;
    g.b = w13.dev.view().data, g.b_rows = E * 2 * I, g.b_cols = H;
    g.out0 = slots.dev.view().data;
    run(g);
    const Mat w13_t = transposed(w13, E, 2 * I, H);
    g.b = w13_t.dev.view().data, g.b_rows = E * H, g.b_cols = 2 * I, g.b_k_major = true;
    g.out0 = slots_t.dev.view().data;
    run(g);
    // Untouched slots (dropped routes) differ by their fill; compare written rows only.
    const auto a = slots.download(), b = slots_t.download();
    int64_t bad = 0;
    for (int64_t r = 0; r < pool_rows; ++r) {
      const int src = row_src[r];
      if (src < 0) continue;
      const int64_t slot = (src % k) * T + src / k;
      bad += std::memcmp(&a[slot * H], &b[slot * H], H * sizeof(float)) != 0;
    }
    EXPECT_EQ(bad, 0) << "kGateUpGrad slot rows that differ";
  }
  {  // kDownGrad: w2 as [E*H, I] -> [E*I, H]
    Mat dy, w2, z, dz, wa, dz_t, wa_t;
    DeviceTensor dwp, dwp_t;
    cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dwp);
    run(g);
    const Mat w2_t = transposed(w2, E, H, I);
    dz_t.make(C, 2 * I), wa_t.make(C, I);
    dwp_t = DeviceTensor(DType::kF32, {C, I / 128});
    ASSERT_TRUE(dz_t.dev.fill_bytes(0xFF).ok() && wa_t.dev.fill_bytes(0xFF).ok() && dwp_t.fill_bytes(0xFF).ok());
    g.b = w2_t.dev.view().data, g.b_rows = E * I, g.b_cols = H, g.b_k_major = true;
    g.out0 = dz_t.dev.view().data, g.out1 = wa_t.dev.view().data;
    g.dw_partial = static_cast<float*>(dwp_t.view().data);
    run(g);
    // Both runs' outputs start from the same poison: unwritten places match too, bit for bit.
    auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same_bits(dz.download(), dz_t.download())) << "kDownGrad dz";
    EXPECT_TRUE(same_bits(wa.download(), wa_t.download())) << "kDownGrad wa";
    HostTensor p1(DType::kF32, {C, I / 128}), p2(DType::kF32, {C, I / 128});
    ASSERT_TRUE(dwp.download(&p1).ok() && dwp_t.download(&p2).ok());
    const int64_t bad = std::memcmp(p1.view.data, p2.view.data, static_cast<size_t>(C * (I / 128)) * 4) != 0;
    EXPECT_EQ(bad, 0) << "kDownGrad d topk_w partials";
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

// Pairs of CTAs sharing A by multicast (pair_ctas, the default where the mode
// uses them and n_tiles is even) against the one-CTA path: the same bits.
// kWeightGrad pairs; kDown and kDownGrad check that the flag changes nothing
// where a mode does not.
TEST_P(GroupedGemm, PairedCtasMatchOneCtaBitwise) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  run(g);
  const auto paired = slots.download();
  ASSERT_TRUE(slots.dev.fill_bytes(0xFF).ok());
  g.pair_ctas = false;
  run(g);
  EXPECT_EQ(slots.download(), paired) << "kDown";

  Mat dy, w2d, z, dz, wa;
  DeviceTensor dw_partial;
  cuda::GroupedGemmArgs d = down_grad_problem(dy, w2d, z, dz, wa, dw_partial);
  run(d);
  const auto dz1 = dz.download(), wa1 = wa.download();
  HostTensor dwp1(DType::kF32, {C, I / 128}), dwp2(DType::kF32, {C, I / 128});
  ASSERT_TRUE(dw_partial.download(&dwp1).ok());
  ASSERT_TRUE(dz.dev.fill_bytes(0xFF).ok());
  ASSERT_TRUE(wa.dev.fill_bytes(0xFF).ok());
  d.pair_ctas = false;
  run(d);
  ASSERT_TRUE(dw_partial.download(&dwp2).ok());
  // The pool's rows in use (those past pool_rows are never written).
  auto used = [&](const std::vector<float>& v, int64_t cols) {
    return std::vector<float>(v.begin(), v.begin() + pool_rows * cols);
  };
  EXPECT_EQ(used(dz.download(), 2 * I), used(dz1, 2 * I)) << "kDownGrad dz";
  EXPECT_EQ(used(wa.download(), I), used(wa1, I)) << "kDownGrad wa";
  int64_t dw_differ = 0;
  for (int64_t r = 0; r < pool_rows; ++r)
    for (int64_t n = 0; n < I / 128; ++n) dw_differ += dwp1.get(r * (I / 128) + n) != dwp2.get(r * (I / 128) + n);
  EXPECT_EQ(dw_differ, 0) << "kDownGrad d topk_w partials";

  DeviceTensor out;
  cuda::GroupedGemmArgs w = weight_grad_problem(dy, wa, out);
  w.narrow_tiles = true;  // (the 128 x 256 tiles, the default, replace the pairs)
  run(w);
  HostTensor w1(DType::kF32, {E, H, I}), w2h(DType::kF32, {E, H, I});
  ASSERT_TRUE(out.download(&w1).ok());
  ASSERT_TRUE(out.fill_bytes(0xFF).ok());
  w.pair_ctas = false;
  run(w);
  ASSERT_TRUE(out.download(&w2h).ok());
  int64_t w_differ = 0;
  for (int64_t i = 0; i < E * H * I; ++i) w_differ += w1.get(i) != w2h.get(i);
  EXPECT_EQ(w_differ, 0) << "kWeightGrad";
}

// Gathered rows against the pool gather_rows makes: kGateUp's x rows, in the
// 128 x 256 tiles and the 128 x 128 ones.
TEST_P(GroupedGemm, GatheredGateUpRowsAreBitwiseThePool) {
  Mat x, w13, z, a, tok;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  token_rows_and_pool(tok, x, H, 21);  // x: a new buffer
  g.a = x.dev.view().data;
  const Outputs outs = {z.bytes(), a.bytes()};
  expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kA, tok, x, outs);
  g.narrow_tiles = true;
  expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kA, tok, x, outs);
}

// kDownGrad's dy rows: dz, w a and the d topk_w partials, in 128 x 128
// tiles, and in 128 x 256 ones (N 512: two column tiles), rows first or not.
TEST_P(GroupedGemm, GatheredDownGradRowsAreBitwiseThePool) {
  Mat dy, w2, z, dz, wa, tok;
  DeviceTensor dw_partial;
  cuda::GroupedGemmArgs g = down_grad_problem(dy, w2, z, dz, wa, dw_partial);
  token_rows_and_pool(tok, dy, H, 22);  // dy: a new buffer
  g.a = dy.dev.view().data;
  const Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (I / 128) * 4)}};
  expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kA, tok, dy, outs);
  for (const bool rows_first : {false, true}) {
    Mat dy2, w2b, zb, dzb, wab, tok2;
    DeviceTensor partial;
    cuda::GroupedGemmArgs wide = down_grad_problem(dy2, w2b, zb, dzb, wab, partial, 512);
    token_rows_and_pool(tok2, dy2, H, 22);
    wide.a = dy2.dev.view().data;
    wide.wide_down_grad = true, wide.rows_first = rows_first;
    SCOPED_TRACE(rows_first ? "128 x 256, rows first" : "128 x 256");
    const Outputs wide_outs = {dzb.bytes(), wab.bytes(),
                               {partial.view().data, static_cast<size_t>(C * (512 / 128) * 4)}};
    expect_gathered_bitwise(wide, cuda::GroupedGemmArgs::Gather::kA, tok2, dy2, wide_outs);
  }
}

// kWeightGrad's A rows (dW2's dy) and B rows (dW13's x), each in the 128 x
// 256 tiles and in 128 x 128 ones (A: one CTA a tile; B: CTA pairs, then
// one CTA a tile). The other operand's padding rows are nonzero: a gathered
// padding row that is not zero shows.
TEST_P(GroupedGemm, GatheredWeightGradRowsAreBitwiseThePool) {
  Mat pa, pb, tok_a, tok_b, other_a, other_b;
  token_rows_and_pool(tok_a, pa, H, 23);
  token_rows_and_pool(tok_b, pb, I, 24);
  random_mat(other_a, C, H, 1.0, 25);  // every row random, padding included
  random_mat(other_b, C, I, 1.0, 26);
  for (const int form : {0, 1, 2}) {  // wide tiles; 128 x 128 in pairs; one CTA a 128 x 128 tile
    const bool pairs = form == 1, narrow = form > 0;
    DeviceTensor out_a, out_b;
    cuda::GroupedGemmArgs g = weight_grad_problem(pa, other_b, out_a);
    g.pair_ctas = pairs, g.narrow_tiles = narrow;  // (A gathered never pairs)
    expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kA, tok_a, pa,
                            {{out_a.view().data, static_cast<size_t>(E * H * I * 4)}});
    g = weight_grad_problem(other_a, pb, out_b);
    g.pair_ctas = pairs, g.narrow_tiles = narrow;
    expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kB, tok_b, pb,
                            {{out_b.view().data, static_cast<size_t>(E * H * I * 4)}});
  }
  // B with N = 512 in the wide tiles: two column tiles, the second reading token columns 256..511.
  Mat tok_wide, pb_wide;
  token_rows_and_pool(tok_wide, pb_wide, 512, 27);
  DeviceTensor out_wide;
  cuda::GroupedGemmArgs g = weight_grad_problem(other_a, pb_wide, out_wide);
  out_wide = DeviceTensor(DType::kF32, {E, H, 512});
  g.n = 512, g.b_cols = 512, g.out0 = out_wide.view().data;
  expect_gathered_bitwise(g, cuda::GroupedGemmArgs::Gather::kB, tok_wide, pb_wide,
                          {{out_wide.view().data, static_cast<size_t>(E * H * 512 * 4)}});
}

// What the gathering kernels do not cover is refused on the host.
TEST_P(GroupedGemm, GatheredRowsAreRefusedWhereTheyAreNotBuilt) {
  Mat x, w13, z, a, tok;
  cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
  token_rows_and_pool(tok, x, H, 21);
  g.a = tok.dev.view().data, g.gather = cuda::GroupedGemmArgs::Gather::kA, g.gather_tokens = T;
  auto expect_refused = [&](cuda::GroupedGemmArgs bad, const char* why) {
    const Status st = cuda::launch_grouped_gemm(bad, sms, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << why << ": " << st.to_string();
    EXPECT_NE(st.message().find("gathered rows"), std::string::npos) << why << ": " << st.to_string();
  };
  cuda::GroupedGemmArgs bad = g;
  bad.gather = cuda::GroupedGemmArgs::Gather::kB;
  expect_refused(bad, "B of kGateUp");
  bad = g, bad.gather_tokens = 0;
  expect_refused(bad, "no token count");
  bad = g, bad.gather_tokens = T - 1;
  expect_refused(bad, "fewer token rows than the plan's tokens");
  bad = g, bad.k = 2 * H;  // K past the token rows' H columns
  expect_refused(bad, "more columns than the token matrix has");
  bad = g, bad.plan.row_src = nullptr;
  expect_refused(bad, "no row_src");
  bad = g, bad.fp8 = true;
  expect_refused(bad, "FP8");
  Mat dy, w2, zz, dz, wa;
  DeviceTensor dw_partial;
  bad = down_grad_problem(dy, w2, zz, dz, wa, dw_partial);
  bad.gather = cuda::GroupedGemmArgs::Gather::kA, bad.gather_tokens = T, bad.b_k_major = true;
  bad.b_rows = E * I, bad.b_cols = H;
  expect_refused(bad, "kDownGrad with B K-major");
  MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(0, nullptr));
}

// Expert parallelism's ordering contract (GroupedGemmArgs::rows_ready): the x
// pool starts as NaN, and a kernel on another stream delivers its row tiles
// late (0.5 ms apart) and in reverse order, release-storing each tile's
// counter. kGateUp, launched right after on a stream of its own, must hold
// every tile until its rows are in: z and a equal, bit for bit, the run on
// the delivered pool with nothing to wait for. A GEMM that ignored the
// counters would read NaN rows (its first tiles arrive last).
TEST_P(GroupedGemm, TilesWaitForTheirRowsToArrive) {
  Mat x, w13, z_ref, a_ref, z, a;
  random_pool(x, H, 1);
  random_mat(w13, E * 2 * I, H, 1.0 / 16, 2);
  z_ref.make(C, 2 * I), a_ref.make(C, I), z.make(C, 2 * I), a.make(C, I);
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUp, g.plan = plan, g.n = I, g.k = H, g.intermediate = I;
  g.a = x.dev.view().data, g.a_rows = C, g.a_cols = H;
  g.b = w13.dev.view().data, g.b_rows = E * 2 * I, g.b_cols = H;
  g.out0 = z_ref.dev.view().data, g.out1 = a_ref.dev.view().data;
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
  g.a = late.view().data;
  g.out0 = z.dev.view().data, g.out1 = a.dev.view().data;
  g.rows_ready = ready, g.ready_value = 1u;
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
  random_pool(x, H, 1);
  random_mat(w13, E * 2 * I, H, 1.0 / 16, 2);
  z.make(C, 2 * I), a.make(C, I);
  const int tiles = static_cast<int>(pool_rows / 128), missing = tiles / 2;
  HostTensor ready_host(DType::kI32, {C / 128});
  for (int m = 0; m < C / 128; ++m) ready_host.set(m, m == missing ? 6 : 7);
  DeviceTensor counters(DType::kI32, {C / 128});
  ASSERT_TRUE(counters.upload(ready_host).ok());
  cuda::GroupedGemmArgs g;
  g.mode = GemmMode::kGateUp, g.plan = plan, g.n = I, g.k = H, g.intermediate = I;
  g.a = x.dev.view().data, g.a_rows = C, g.a_cols = H;
  g.b = w13.dev.view().data, g.b_rows = E * 2 * I, g.b_cols = H;
  g.out0 = z.dev.view().data, g.out1 = a.dev.view().data;
  g.rows_ready = static_cast<const uint32_t*>(counters.view().data), g.ready_value = 7u;
  g.errors = errors;
  g.errors.timeout_ns = under_cuda_tool() ? 5'000'000'000ull : 50'000'000ull;
  ASSERT_TRUE(cuda::launch_grouped_gemm(g, sms, nullptr).ok());
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  for (const std::string& want : std::vector<std::string>{
           "grouped GEMM kGateUp,", "the rows of pool tile " + std::to_string(missing) + " never arrived", "gave up"})
    EXPECT_NE(st.message().find(want), std::string::npos) << "missing \"" << want << "\" in: " << st.message();
  g.rows_ready = nullptr;
  g.errors = errors;
  run(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  // Counters hold pool tiles of the M-grouped modes; kWeightGrad is refused on the host.
  cuda::GroupedGemmArgs w;
  w.mode = GemmMode::kWeightGrad, w.plan = plan, w.m = H, w.n = I, w.k = 64;
  w.rows_ready = static_cast<const uint32_t*>(counters.view().data);
  const Status refused = cuda::launch_grouped_gemm(w, sms, nullptr);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("rows_ready"), std::string::npos) << refused.to_string();
}

// A producer that stops issuing loads (debug_stall_at) leaves a consumer
// waiting on a full barrier that never completes. The wait gives up after
// errors.timeout_ns, reports kernel, block, barrier and phase (the stage
// iteration), and the kernel exits: no trap, the stream synchronises. `g`
// runs with the stall, then (by the caller) again without it on the same context.
void expect_stall_reported(cuda::GroupedGemmArgs g, const cuda::DeviceErrorSink& errors, int sms, int64_t stall,
                           const std::vector<std::string>& want) {
  // 50 ms; 5 s under compute-sanitizer, where the first loads alone can take
  // longer than 50 ms.
  const bool slow = under_cuda_tool();
  g.errors = errors;
  g.errors.timeout_ns = slow ? 5'000'000'000ull : 50'000'000ull;
  g.debug_stall_at = stall;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cuda::launch_grouped_gemm(g, sms, nullptr).ok());
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
  g.narrow_tiles = true;  // the ping-pong consumers (the wide tiles: the next test)
  const int64_t stall = stall_iteration(pool_rows / 128 * (H / 128), I / 64);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kDown,", "block ", "full barrier", "phase " + std::to_string(stall) + " ",
                         "gave up"});

  // The context is still usable: the same problem, no stall, is right and reports nothing.
  g.errors = errors;
  run(g);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto ref = pool_gemm(a, I, H, row_src, tile_expert, pool_rows,
                             [&](int e, int64_t kk, int64_t n) { return w2.host[(e * H + n) * I + kk]; });
  expect_slots_match(slots, ref, /*weighted=*/true);
}

// The same for wide kGateUp tiles (both consumers on every stage): the
// producer stops, both consumers' full waits give up, one reports, naming
// the wide kernel (so this test also shows that the wide tiles ran). Then
// the same call without the stall equals the narrow tiles bit for bit. Also
// with gathered rows (GroupedGemmArgs::gather: all 128 producer threads,
// leaving together), against the narrow tiles on the pool.
TEST_P(GroupedGemm, StalledWideGateUpTimesOutAndReports) {
  for (const bool gathered : {false, true}) {
    Mat x, w13, z, a, tok;
    cuda::GroupedGemmArgs g = gate_up_problem(x, w13, z, a);
    if (gathered) {  // x becomes the pool of tok's rows (a new buffer)
      token_rows_and_pool(tok, x, H, 21);
      g.a = x.dev.view().data;
    }
    cuda::GroupedGemmArgs narrow = g;
    narrow.narrow_tiles = true;
    if (gathered) g.a = tok.dev.view().data, g.gather = cuda::GroupedGemmArgs::Gather::kA, g.gather_tokens = T;
    const int64_t stall = stall_iteration(pool_rows / 128 * (I / 128), H / 64);
    ASSERT_GE(stall, 0);
    expect_stall_reported(g, errors, sms, stall,
                          {"grouped GEMM kGateUp (128 x 256 tiles),", "block ", "full barrier",
                           "phase " + std::to_string(stall) + " ", "gave up"});
    g.errors = errors;
    expect_same_bytes({z.bytes(), a.bytes()},
                      [&] { run(g); }, [&] { run(narrow); }, gathered ? "(gathered, after a stall)" : "(after a stall)");
  }
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
  g.narrow_tiles = true;
  run(g);
  EXPECT_EQ(std::memcmp(slots.download().data(), wide.data(), wide.size() * sizeof(float)), 0);
}

// The same for wide kGateUpGrad tiles (the default): the
// report names the wide kernel (so the bitwise test above ran it); then the
// call without the stall equals the narrow tiles' slots bit for bit.
TEST_P(GroupedGemm, StalledWideGateUpGradTimesOutAndReports) {
  Mat dz, w13, slots;
  cuda::GroupedGemmArgs g = gate_up_grad_problem(dz, w13, slots, H);
  cuda::GroupedGemmArgs narrow = g;
  narrow.narrow_tiles = true;
  const int64_t stall = stall_iteration(pool_rows / 128 * (H / 256), 2 * I / 64);
  ASSERT_GE(stall, 0);
  expect_stall_reported(g, errors, sms, stall,
                        {"grouped GEMM kGateUpGrad (128 x 256 tiles),", "block ", "full barrier",
                         "phase " + std::to_string(stall) + " ", "gave up"});
  g.errors = errors;
  expect_same_bytes({slots.bytes()}, [&] { run(g); },
                    [&] { run(narrow); }, "in the dx slots after a stall");
}

// The same for wide kWeightGrad tiles, pooled, A's rows gathered and B's:
// the report names the wide kernel (so this test also shows that the wide
// tiles ran, gathering too); then the call without the stall equals the
// pairs bit for bit.
TEST_P(GroupedGemm, StalledWideWeightGradTimesOutAndReports) {
  Mat pa, pb, tok, tok_b;
  token_rows_and_pool(tok, pa, H, 7);  // pa: the pool of tok's rows
  token_rows_and_pool(tok_b, pb, I, 8);
  DeviceTensor out;
  cuda::GroupedGemmArgs g = weight_grad_problem(pa, pb, out);
  cuda::GroupedGemmArgs pairs = g;
  pairs.narrow_tiles = true;
  // CTA 0's stage iterations: its tiles t = 0, sms, ... (two a expert: H / 128 row tiles, one 256-column tile).
  int64_t cta0 = 0;
  for (int64_t t = 0; t < E * (H / 128); t += sms) cta0 += (rows[t / (H / 128)] + 63) / 64;
  const int64_t stall = std::min<int64_t>(9, cta0 - 1);
  ASSERT_GE(stall, 0);
  for (const int gathered : {0, 1, 2}) {  // none, A, B
    cuda::GroupedGemmArgs s = g;
    if (gathered == 1) s.a = tok.dev.view().data, s.gather = cuda::GroupedGemmArgs::Gather::kA, s.gather_tokens = T;
    if (gathered == 2) s.b = tok_b.dev.view().data, s.gather = cuda::GroupedGemmArgs::Gather::kB, s.gather_tokens = T;
    expect_stall_reported(s, errors, sms, stall,
                          {"grouped GEMM kWeightGrad (128 x 256 tiles),", "block ", "full barrier",
                           "phase " + std::to_string(stall) + " ", "gave up"});
    s.errors = errors;
    expect_same_bytes({{out.view().data, static_cast<size_t>(E * H * I * 4)}}, [&] { run(s); }, [&] { run(pairs); },
                      gathered == 0 ? "in dW after a stall" : gathered == 1 ? "in dW after a stall (A gathered)"
                                                                             : "in dW after a stall (B gathered)");
  }
}

// The same for wide kDownGrad tiles (wide_down_grad), pooled and gathered
// rows: the report names the wide kernel; then the call without the stall
// equals the narrow tiles' dz, w a and partials bit for bit.
TEST_P(GroupedGemm, StalledWideDownGradTimesOutAndReports) {
  Mat dy, w2, z, dz, wa, tok;
  DeviceTensor dw_partial;
  cuda::GroupedGemmArgs narrow = down_grad_problem(dy, w2, z, dz, wa, dw_partial);
  token_rows_and_pool(tok, dy, H, 22);
  narrow.a = dy.dev.view().data;
  const Outputs outs = {dz.bytes(), wa.bytes(), {dw_partial.view().data, static_cast<size_t>(C * (I / 128) * 4)}};
  const int64_t stall = stall_iteration(pool_rows / 128 * (I / 256), H / 64);
  ASSERT_GE(stall, 0);
  for (const bool gathered : {false, true}) {
    cuda::GroupedGemmArgs g = narrow;
    g.wide_down_grad = true;
    if (gathered) g.a = tok.dev.view().data, g.gather = cuda::GroupedGemmArgs::Gather::kA, g.gather_tokens = T;
    expect_stall_reported(g, errors, sms, stall,
                          {"grouped GEMM kDownGrad (128 x 256 tiles),", "block ", "full barrier",
                           "phase " + std::to_string(stall) + " ", "gave up"});
    g.errors = errors;
    expect_same_bytes(outs, [&] { run(g); }, [&] { run(narrow); },
                      gathered ? "(gathered, after a stall)" : "(after a stall)");
  }
}

// The same on split rings (the FP8 kernels: a ring per consumer, a producer
// thread per ring): ring 0's producer stops at the iteration, ring 1's runs
// on; the report's wait and phase are checked as loosely as when one
// producer served both rings.
TEST_P(GroupedGemm, StalledFp8PipelineTimesOutAndReports) {
  Mat a, w2, slots;
  cuda::GroupedGemmArgs g = down_problem(a, w2, slots);
  const Fp8Operand qa = quantize_fp8(a, 0), qw = quantize_fp8(w2, H);
  g.fp8 = true;
  g.a = qa.q.view().data, g.a_scales = static_cast<const float*>(qa.s.view().data);
  g.b = qw.q.view().data, g.b_scales = static_cast<const float*>(qw.s.view().data);
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
