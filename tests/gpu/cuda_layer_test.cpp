// The CUDA layer (one GPU, bf16) against the CPU reference: every output, on
// fresh random inputs, for shapes and routings that stress the plan; outputs
// poisoned first; bitwise determinism; CUDA-graph capture (which fails on any
// host synchronisation); the buffers the caller owns; the errors a user can hit.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "testing/sample_check.h"

namespace megamoe::testing {
namespace {

struct Case {
  const char* name;
  int64_t T, H, I;
  int E, k;
  Routing routing;
};

// GPU vs the CPU reference in the same (bf16-emulated) numerics: both round at
// the same points; fp32 summation order and __expf move values by an fp32 ulp
// and flip an occasional bf16 rounding (2^-8 = 3.9e-3 on that element). So the
// whole-tensor relative error is a small fraction of 2^-8 (measured on the
// H200: see docs/numerics.md), and no row may be off by more than a few such
// flips (a missing or doubled route moves its row by O(1)).
// GPU vs fp64: the bf16 bound of the reference itself (docs/numerics.md).
constexpr double kVsReference = 4e-3, kRowVsReference = 3e-2, kVsFp64 = 1e-2;

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }  // test names without hex dumps

class CudaLayer : public ::testing::TestWithParam<Case> {};

LayerData random_data(const MoeProblem& p, Routing routing, uint64_t seed) {
  LayerSpec spec;
  spec.problem = p;
  spec.routing = routing;
  spec.seed = seed;
  spec.hot_expert = p.num_experts / 3;
  return make_layer_data(spec);
}

LayerOutputs run_cpu(const MoeProblem& p, const LayerData& d, bool exact, Precision precision = Precision::kBF16,
                     ScaleMode scale = ScaleMode::kFloat32) {
  MoeOptions o;
  o.backend = Backend::kCPU;
  o.precision = precision, o.fp8_scale_mode = scale;
  LayerOutputs out;
  if (!exact) {
    out = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    MoeSaved saved;
    EXPECT_TRUE(moe_forward(p, o, d.inputs(), out.y.view, &saved).ok());
    EXPECT_TRUE(moe_backward(p, o, d.inputs(), d.dy.view, saved, out.grads()).ok());
    return out;
  }
  // fp64 path on the same values.
  LayerData e;
  auto conv = [](const HostTensor& t) {
    HostTensor o2(DType::kF64, {t.view.numel()});
    const std::vector<double> v = t.to_f64();
    std::memcpy(o2.view.data, v.data(), v.size() * sizeof(double));
    o2.view.rank = t.view.rank;
    for (int i = 0; i < t.view.rank; ++i) o2.view.shape[i] = t.view.shape[i];
    return o2;
  };
  e.x = conv(d.x), e.dy = conv(d.dy), e.w13 = conv(d.w13), e.w2 = conv(d.w2), e.topk_weights = conv(d.topk_weights);
  e.topk_idx = HostTensor(DType::kI32, {p.num_tokens, p.top_k});
  std::memcpy(e.topk_idx.view.data, d.topk_idx.view.data, static_cast<size_t>(d.topk_idx.view.size_bytes()));
  out = make_layer_outputs(p, p.num_tokens, DType::kF64, DType::kF64, 0.0);
  MoeSaved saved;
  EXPECT_TRUE(moe_forward(p, o, e.inputs(), out.y.view, &saved).ok());
  EXPECT_TRUE(moe_backward(p, o, e.inputs(), e.dy.view, saved, out.grads()).ok());
  return out;
}

// Forward + backward on fresh buffers of exactly the queried sizes.
LayerOutputs run_gpu(const MoeProblem& p, const MoeOptions& o, const LayerData& d, DType wgrad) {
  DeviceLayer dev;
  DeviceBuffers buffers;
  LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, wgrad, 0.0);
  Status st = make_device_layer(p, d, wgrad, 0, &dev);
  if (st.ok()) st = make_device_buffers(p, o, true, 0, &buffers);
  if (st.ok()) st = poison_outputs(dev, static_cast<cudaStream_t>(o.cuda_stream));
  const MoeBuffers b = buffers.view();
  MoeSaved saved;
  if (st.ok()) st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  if (st.ok()) st = moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), &b);
  if (st.ok()) st = check_device_errors(0, o.cuda_stream);
  if (st.ok()) st = download_outputs(dev, &out);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

// Largest relative error of one row (last dimension) over rows whose reference is not ~0.
double row_max_relative_error(const HostTensor& got, const HostTensor& ref) {
  const std::vector<double> a = got.to_f64(), b = ref.to_f64();
  const int64_t width = ref.view.shape[ref.view.rank - 1];
  double worst = 0;
  for (int64_t r = 0; r * width < static_cast<int64_t>(b.size()); ++r) {
    double num = 0, den = 0;
    for (int64_t c = r * width; c < (r + 1) * width; ++c) {
      num += (a[c] - b[c]) * (a[c] - b[c]);
      den += b[c] * b[c];
    }
    if (std::isnan(num)) return num;
    if (den > 1e-12) worst = std::max(worst, std::sqrt(num / den));
  }
  return worst;
}

void expect_close(const LayerOutputs& got, const LayerOutputs& ref, double bound, double row_bound,
                  const char* what) {
  const std::pair<const char*, std::pair<const HostTensor*, const HostTensor*>> outs[] = {
      {"y", {&got.y, &ref.y}},
      {"dx", {&got.dx, &ref.dx}},
      {"d_topk_weights", {&got.d_topk_weights, &ref.d_topk_weights}},
      {"dw13", {&got.dw13, &ref.dw13}},
      {"dw2", {&got.dw2, &ref.dw2}}};
  for (const auto& [name, pair] : outs) {
    const double e = relative_error(*pair.first, *pair.second);
    const double row = row_max_relative_error(*pair.first, *pair.second);
    std::printf("  %-15s vs %-13s relative %.2e, worst row %.2e\n", name, what, e, row);  // the measured values
    EXPECT_LT(e, bound) << name << " vs " << what;  // NaN (an unwritten element) fails too
    if (row_bound > 0) {
      EXPECT_LT(row, row_bound) << name << " vs " << what << ": worst row";
    }
  }
}

TEST_P(CudaLayer, MatchesTheCpuReference) {
  MEGAMOE_REQUIRE_GPU();
  const Case& c = GetParam();
  MoeProblem p;
  p.num_tokens = c.T, p.hidden = c.H, p.intermediate = c.I, p.num_experts = c.E, p.top_k = c.k;
  const LayerData d = random_data(p, c.routing, 11);
  const LayerOutputs ref = run_cpu(p, d, false);
  const LayerOutputs exact = run_cpu(p, d, true);
  for (SavePolicy save : {SavePolicy::kKeep, SavePolicy::kRecompute}) {
    for (DType wgrad : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string("save ") + to_string(save) + ", wgrad " + to_string(wgrad));
      const MoeOptions o = cuda_options(save);
      const LayerOutputs got = run_gpu(p, o, d, wgrad);
      expect_close(got, ref, kVsReference, kRowVsReference, "cpu reference");
      expect_close(got, exact, kVsFp64, 0, "fp64");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLayer,
    ::testing::Values(Case{"T300_k2", 300, 256, 128, 8, 2, Routing::kUniform},
                      Case{"T257_k1", 257, 128, 256, 16, 1, Routing::kUniform},
                      Case{"k8_of_8", 200, 256, 256, 8, 8, Routing::kUniform},
                      Case{"T200_k3", 200, 256, 256, 8, 3, Routing::kUniform},  // top_k not a power of two
                      Case{"E128_empty_experts", 384, 512, 256, 128, 8, Routing::kUniform},
                      Case{"one_hot_expert", 333, 256, 128, 16, 2, Routing::kOneExpert},
                      Case{"dropped_routes", 190, 256, 128, 32, 4, Routing::kWithDrops},
                      Case{"half_experts_empty", 130, 128, 128, 64, 4, Routing::kFirstHalf},
                      Case{"qwen3_30b_widths", 64, 2048, 768, 16, 8, Routing::kUniform}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// FP8 (fp8: both ways; fp8_bwd: BF16 forward, FP8 backward) against the CPU
// reference's emulation of the same recipe, and against fp64 (unquantised)
// beside BF16's error on the same data. Both sides quantise bitwise-equal
// inputs (x, dy, the weights) with the same rule; they part where an operand
// the GPU computed (a, dz, w a) differs from the CPU's by a bf16 rounding
// flip, and a tile whose amax moves re-rounds its whole tile. Bounds: the
// measured errors (docs/numerics.md, printed below) with a margin.
constexpr double kFp8VsReference = 3e-2, kFp8VsFp64 = 1e-1;

void check_fp8(const Case& c, const std::vector<Precision>& precisions, const std::vector<ScaleMode>& scales,
               const std::vector<SavePolicy>& saves, const std::vector<DType>& wgrads = {DType::kF32, DType::kBF16}) {
  MoeProblem p;
  p.num_tokens = c.T, p.hidden = c.H, p.intermediate = c.I, p.num_experts = c.E, p.top_k = c.k;
  const LayerData d = random_data(p, c.routing, 23);
  const LayerOutputs exact = run_cpu(p, d, true);
  for (Precision prec : precisions)
    for (ScaleMode scale : scales) {
      const char* sname = scale == ScaleMode::kFloat32 ? "fp32" : "pow2";
      SCOPED_TRACE(std::string(c.name) + ", " + to_string(prec) + ", " + sname + " scales");
      std::printf(" %s %s %s scales\n", c.name, to_string(prec), sname);
      const LayerOutputs ref = run_cpu(p, d, false, prec, scale);
      for (SavePolicy save : saves)
        for (DType wgrad : wgrads) {  // the weight-gradient epilogue's fp32 and bf16 stores
          SCOPED_TRACE(std::string("save ") + to_string(save) + ", wgrad " + to_string(wgrad));
          MoeOptions o = cuda_options(save);
          o.precision = prec, o.fp8_scale_mode = scale;
          const LayerOutputs got = run_gpu(p, o, d, wgrad);
          expect_close(got, ref, kFp8VsReference, 0, "cpu emulation");
          expect_close(got, exact, kFp8VsFp64, 0, "fp64");
        }
    }
}

TEST(CudaLayerFp8, MatchesTheCpuEmulation) {
  MEGAMOE_REQUIRE_GPU();
  for (const Case& c : {Case{"T300_k2", 300, 256, 128, 8, 2, Routing::kUniform},
                        Case{"dropped_routes", 190, 256, 128, 32, 4, Routing::kWithDrops},
                        Case{"qwen3_30b_widths", 64, 2048, 768, 16, 8, Routing::kUniform}})
    check_fp8(c, {Precision::kFP8, Precision::kFP8Bwd}, {ScaleMode::kFloat32, ScaleMode::kPowerOfTwo},
              {SavePolicy::kKeep, SavePolicy::kRecompute});
}

// One small case of each precision: what device-test runs under compute-sanitizer.
TEST(CudaLayerFp8, SmallCase) {
  MEGAMOE_REQUIRE_GPU();
  check_fp8(Case{"T300_k2", 300, 256, 128, 8, 2, Routing::kUniform}, {Precision::kFP8, Precision::kFP8Bwd},
            {ScaleMode::kFloat32}, {SavePolicy::kRecompute});
}

MoeProblem small_problem() {
  MoeProblem p;
  p.num_tokens = 200, p.hidden = 256, p.intermediate = 128, p.num_experts = 16, p.top_k = 4;
  return p;
}

void expect_bitwise(const LayerOutputs& a, const LayerOutputs& b) {
  EXPECT_TRUE(bitwise_equal(a.y, b.y));
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx));
  EXPECT_TRUE(bitwise_equal(a.d_topk_weights, b.d_topk_weights));
  EXPECT_TRUE(bitwise_equal(a.dw13, b.dw13));
  EXPECT_TRUE(bitwise_equal(a.dw2, b.dw2));
}

// The FP8 weight buffer (MoeBuffers::fp8_weights): a call marked ready reads
// it as it is, one not marked quantises w13 and w2 into it first.
TEST(CudaLayerFp8, WeightBufferIsReadWhenReadyAndRefilledWhenNot) {
  MEGAMOE_REQUIRE_GPU();
  MoeProblem p;
  p.num_tokens = 300, p.hidden = 256, p.intermediate = 128, p.num_experts = 8, p.top_k = 2;
  const LayerData d = random_data(p, Routing::kUniform, 23), other = random_data(p, Routing::kUniform, 24);
  MoeOptions o = cuda_options(SavePolicy::kKeep);
  o.precision = Precision::kFP8;
  DeviceLayer dev;
  DeviceBuffers buffers;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MEGAMOE_ASSERT_OK(make_device_buffers(p, o, true, 0, &buffers));
  MoeBufferSizes sizes;
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(p, o, true, &sizes));
  EXPECT_EQ(buffers.view().fp8_weights_bytes, sizes.fp8_weights_bytes);
  auto run = [&](bool ready) {
    LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    MoeBuffers b = buffers.view();
    b.fp8_weights_ready = ready;
    MoeSaved saved;
    Status st = poison_outputs(dev, nullptr);
    if (st.ok()) st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
    b.fp8_weights_ready = true;  // the backward reads what its forward left
    if (st.ok()) st = moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), &b);
    if (st.ok()) st = check_device_errors(0, nullptr);
    if (st.ok()) st = download_outputs(dev, &out);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  };
  MEGAMOE_ASSERT_OK(buffers.fp8_weights.fill_bytes(0x7F));  // garbage: the first call must overwrite it all
  const LayerOutputs fresh = run(false);
  expect_close(fresh, run_cpu(p, d, false, Precision::kFP8), kFp8VsReference, 0, "cpu emulation");
  expect_bitwise(run(true), fresh);  // read back as filled
  // New bf16 weights, buffer still marked ready: y and dx come from the old e4m3 weights.
  MEGAMOE_ASSERT_OK(dev.w13.upload(other.w13));
  MEGAMOE_ASSERT_OK(dev.w2.upload(other.w2));
  const LayerOutputs stale = run(true);
  EXPECT_TRUE(bitwise_equal(stale.y, fresh.y));
  EXPECT_TRUE(bitwise_equal(stale.dx, fresh.dx));
  // Not ready: quantised again from the new weights.
  const LayerOutputs refilled = run(false);
  EXPECT_FALSE(bitwise_equal(refilled.y, fresh.y));
  LayerData mixed = random_data(p, Routing::kUniform, 23);
  mixed.w13 = random_data(p, Routing::kUniform, 24).w13;
  mixed.w2 = random_data(p, Routing::kUniform, 24).w2;
  expect_close(refilled, run_cpu(p, mixed, false, Precision::kFP8), kFp8VsReference, 0, "cpu emulation");
  // No buffer, or one too small: a clear error before any work.
  MoeBuffers b = buffers.view();
  b.fp8_weights = nullptr;
  MoeSaved saved;
  Status st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("fp8_weights"), std::string::npos) << st.message();
  b = buffers.view();
  b.fp8_weights_bytes -= 256;
  st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_NE(st.message().find("fp8_weights"), std::string::npos) << st.message();
}

TEST(CudaLayerRuns, AreBitwiseIdentical) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const LayerData d = random_data(p, Routing::kWithDrops, 5);
  expect_bitwise(run_gpu(p, cuda_options(), d, DType::kF32), run_gpu(p, cuda_options(), d, DType::kF32));
}

// The Qwen3-30B-A3B layer at the full 16384 tokens, checked on a sample
// against the fp64 path (the whole CPU reference would take an hour).
TEST(CudaLayerRuns, FullQwen3_30bShapeOnASample) {
  MEGAMOE_REQUIRE_GPU();
  MoeProblem p;
  p.num_tokens = 16384, p.hidden = 2048, p.intermediate = 768, p.num_experts = 128, p.top_k = 8;
  std::vector<LayerData> d;
  d.push_back(random_data(p, Routing::kUniform, 21));
  std::vector<LayerOutputs> got;
  got.push_back(run_gpu(p, cuda_options(), d[0], DType::kF32));
  SampleErrors err;
  MEGAMOE_ASSERT_OK(check_sample_against_fp64(p, d, got, 8, 0, &err));
  std::printf("  16384 tokens vs fp64 on %lld tokens + expert %d (%lld rows): y %.2e dx %.2e dtw %.2e dw13 %.2e "
              "dw2 %.2e\n",
              static_cast<long long>(err.sampled_tokens), err.sampled_expert, static_cast<long long>(err.expert_rows),
              err.y, err.dx, err.d_topk_weights, err.dw13, err.dw2);
  for (double e : {err.y, err.dx, err.d_topk_weights, err.dw13, err.dw2}) EXPECT_LT(e, kVsFp64);
}

// accumulate_weight_grads: dw13/dw2 are fp32 accumulators; the call adds its
// gradient in place (what a trainer with gradient accumulation relies on).
// bf16 and FP8: the weight-gradient epilogue is one code path, instantiated
// in both engines.
TEST(CudaLayerRuns, AccumulatesWeightGradsInFp32) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const LayerData d = random_data(p, Routing::kWithDrops, 6);
  for (Precision precision : {Precision::kBF16, Precision::kFP8}) {
    SCOPED_TRACE(precision == Precision::kFP8 ? "fp8" : "bf16");
    MoeOptions o = cuda_options();
    o.precision = precision;
    const LayerOutputs plain = run_gpu(p, o, d, DType::kF32);

    o.accumulate_weight_grads = true;
    DeviceLayer dev;
    DeviceBuffers buffers;
    MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
    MEGAMOE_ASSERT_OK(make_device_buffers(p, o, true, 0, &buffers));
    // Start the accumulators at a known, non-zero value.
    LayerOutputs start = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    for (int64_t i = 0; i < start.dw13.view.numel(); ++i) start.dw13.set(i, 0.25 * static_cast<double>(i % 7) - 0.5);
    for (int64_t i = 0; i < start.dw2.view.numel(); ++i) start.dw2.set(i, 0.125 * static_cast<double>(i % 5) + 1.0);
    MEGAMOE_ASSERT_OK(dev.dw13.upload(start.dw13));
    MEGAMOE_ASSERT_OK(dev.dw2.upload(start.dw2));
    const MoeBuffers b = buffers.view();
    MoeSaved saved;
    MEGAMOE_ASSERT_OK(moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b));
    MEGAMOE_ASSERT_OK(moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), &b));
    MEGAMOE_ASSERT_OK(check_device_errors(0, nullptr));
    LayerOutputs got = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    MEGAMOE_ASSERT_OK(download_outputs(dev, &got));
    for (auto [acc, base, grad] : {std::tuple{&got.dw13, &start.dw13, &plain.dw13},
                                   std::tuple{&got.dw2, &start.dw2, &plain.dw2}}) {
      int64_t wrong = 0;
      for (int64_t i = 0; i < acc->view.numel(); ++i) {
        const float want = static_cast<float>(base->get(i)) + static_cast<float>(grad->get(i));
        wrong += static_cast<float>(acc->get(i)) != want;  // one fp32 add: exact
      }
      EXPECT_EQ(wrong, 0) << "accumulated elements that are not start + gradient";
    }
  }
}

// Capturing forward + backward into a graph fails on any host synchronisation
// or device-to-host copy inside them; the replay must equal the eager run.
TEST(CudaLayerGraph, CapturesAndReplays) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const LayerData d = random_data(p, Routing::kUniform, 8);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const MoeOptions o = cuda_options(SavePolicy::kKeep, stream);
  const LayerOutputs eager = run_gpu(p, o, d, DType::kF32);

  DeviceLayer dev;
  DeviceBuffers buffers;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MEGAMOE_ASSERT_OK(make_device_buffers(p, o, true, 0, &buffers));
  MEGAMOE_ASSERT_OK(poison_outputs(dev, stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const MoeBuffers b = buffers.view();
  MoeSaved saved;
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status fs = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  const Status bs = fs.ok() ? moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), &b) : fs;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "capture broken (a host sync inside?)";
  MEGAMOE_ASSERT_OK(fs);
  MEGAMOE_ASSERT_OK(bs);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 2; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  LayerOutputs replay = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  MEGAMOE_ASSERT_OK(download_outputs(dev, &replay));
  expect_bitwise(eager, replay);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The saved buffer is the only state between a forward and its backward: two
// layers (different shapes, one shared scratch) run forward, forward,
// backward, backward, and each gradient equals the isolated run's bitwise.
TEST(CudaLayerBuffers, SharedScratchAndPerCallSavedState) {
  MEGAMOE_REQUIRE_GPU();
  MoeProblem pa = small_problem(), pb = small_problem();
  pb.num_tokens = 333, pb.num_experts = 32, pb.top_k = 2;
  const LayerData da = random_data(pa, Routing::kUniform, 31), db = random_data(pb, Routing::kWithDrops, 32);
  const MoeOptions o = cuda_options();
  const LayerOutputs alone_a = run_gpu(pa, o, da, DType::kF32), alone_b = run_gpu(pb, o, db, DType::kF32);

  MoeBufferSizes sa, sb;
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(pa, o, true, &sa));
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(pb, o, true, &sb));
  const size_t scratch_bytes = std::max(sa.scratch_bytes, sb.scratch_bytes);
  DeviceTensor scratch(DType::kI32, {static_cast<int64_t>(scratch_bytes / 4)});
  DeviceTensor saved_a(DType::kI32, {static_cast<int64_t>(sa.saved_bytes / 4)});
  DeviceTensor saved_b(DType::kI32, {static_cast<int64_t>(sb.saved_bytes / 4)});
  const MoeBuffers ba{scratch.view().data, scratch_bytes, saved_a.view().data, sa.saved_bytes};
  const MoeBuffers bb{scratch.view().data, scratch_bytes, saved_b.view().data, sb.saved_bytes};
  DeviceLayer la, lb;
  MEGAMOE_ASSERT_OK(make_device_layer(pa, da, DType::kF32, 0, &la));
  MEGAMOE_ASSERT_OK(make_device_layer(pb, db, DType::kF32, 0, &lb));
  MoeSaved note_a, note_b;
  MEGAMOE_ASSERT_OK(moe_forward(pa, o, la.inputs(), la.y.view(), &note_a, &ba));
  MEGAMOE_ASSERT_OK(moe_forward(pb, o, lb.inputs(), lb.y.view(), &note_b, &bb));
  MEGAMOE_ASSERT_OK(moe_backward(pb, o, lb.inputs(), lb.dy.view(), note_b, lb.grads(), &bb));
  MEGAMOE_ASSERT_OK(moe_backward(pa, o, la.inputs(), la.dy.view(), note_a, la.grads(), &ba));
  MEGAMOE_ASSERT_OK(check_device_errors(0, nullptr));
  LayerOutputs got_a = make_layer_outputs(pa, pa.num_tokens, DType::kBF16, DType::kF32, 0.0);
  LayerOutputs got_b = make_layer_outputs(pb, pb.num_tokens, DType::kBF16, DType::kF32, 0.0);
  MEGAMOE_ASSERT_OK(download_outputs(la, &got_a));
  MEGAMOE_ASSERT_OK(download_outputs(lb, &got_b));
  expect_bitwise(alone_a, got_a);
  expect_bitwise(alone_b, got_b);

  // A backward handed another forward's saved buffer is refused.
  const Status st = moe_backward(pa, o, la.inputs(), la.dy.view(), note_a, la.grads(), &bb);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not the saved buffer its forward wrote"), std::string::npos) << st.message();
}

// Recompute saves nothing (saved_bytes 0) and gives the keep policy's gradients.
TEST(CudaLayerBuffers, RecomputeSavesNothing) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  MoeBufferSizes keep, rec, inference;
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(p, cuda_options(SavePolicy::kKeep), true, &keep));
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(p, cuda_options(SavePolicy::kRecompute), true, &rec));
  MEGAMOE_ASSERT_OK(moe_buffer_sizes(p, cuda_options(SavePolicy::kKeep), false, &inference));
  EXPECT_GT(keep.saved_bytes, 0u);
  EXPECT_EQ(rec.saved_bytes, 0u);
  EXPECT_EQ(inference.saved_bytes, 0u);
  const LayerData d = random_data(p, Routing::kUniform, 9);
  expect_bitwise(run_gpu(p, cuda_options(SavePolicy::kKeep), d, DType::kF32),
                 run_gpu(p, cuda_options(SavePolicy::kRecompute), d, DType::kF32));
}

TEST(CudaLayerErrors, BuffersTooSmallOrMissing) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const MoeOptions o = cuda_options();
  DeviceLayer dev;
  DeviceBuffers buffers;
  MEGAMOE_ASSERT_OK(make_device_layer(p, random_data(p, Routing::kUniform, 1), DType::kF32, 0, &dev));
  MEGAMOE_ASSERT_OK(make_device_buffers(p, o, true, 0, &buffers));
  MoeSaved saved;
  MoeBuffers b = buffers.view();
  b.scratch_bytes -= 256;
  Status st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kCapacity) << st.to_string();
  EXPECT_NE(st.message().find("scratch:"), std::string::npos) << st.message();
  b = buffers.view();
  b.saved_bytes -= 256;
  st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("saved:"), std::string::npos) << st.message();
  st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, nullptr);
  EXPECT_NE(st.message().find("needs MoeBuffers"), std::string::npos) << st.message();
}

// A bad id found on the device: NaN outputs, and the error comes back (naming
// the route and the user's value) from check_device_errors, from the next call
// once the failing one has run, and from the call itself with validate.
TEST(CudaLayerErrors, BadExpertIdsAreReportedAndPoisonTheOutput) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  for (int variant = 0; variant < 2; ++variant) {
    LayerData d = random_data(p, Routing::kUniform, 2);
    if (variant == 0) {
      d.topk_idx.set(7 * 4 + 2, 16);  // out of range
    } else {
      d.topk_idx.set(9 * 4 + 3, d.topk_idx.get(9 * 4 + 1));  // duplicate expert
    }
    const std::string expected =
        variant == 0 ? "topk_idx[7,2] = 16 is out of range [-1, num_experts = 16)" : "token 9 is routed twice";
    DeviceLayer dev;
    DeviceBuffers buffers;
    MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
    MEGAMOE_ASSERT_OK(make_device_buffers(p, cuda_options(), true, 0, &buffers));
    const MoeBuffers b = buffers.view();
    MoeSaved saved;
    // 1. Explicit check.
    MEGAMOE_ASSERT_OK(moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &saved, &b));
    Status st = check_device_errors(0, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(expected), std::string::npos) << st.message();
    EXPECT_TRUE(check_device_errors(0, nullptr).ok()) << "a report is taken once";
    LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    MEGAMOE_ASSERT_OK(dev.y.download(&out.y));
    EXPECT_TRUE(std::isnan(out.y.get(0))) << "a failed call must not return plausible numbers";
    // 2. The next call, started after the failing one ran.
    MEGAMOE_ASSERT_OK(moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &saved, &b));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    st = moe_backward(p, cuda_options(), dev.inputs(), dev.dy.view(), saved, dev.grads(), &b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(expected), std::string::npos) << st.message();
    // 3. validate: the call itself.
    MoeOptions v = cuda_options();
    v.validate = true;
    st = moe_forward(p, v, dev.inputs(), dev.y.view(), &saved, &b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(expected), std::string::npos) << st.message();
    EXPECT_TRUE(check_device_errors(0, nullptr).ok());
  }
}

TEST(CudaLayerErrors, UnsupportedRequestsAreClear) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  MoeOptions o = cuda_options();
  const LayerData d = random_data(p, Routing::kUniform, 4);
  DeviceLayer dev;
  DeviceBuffers buffers;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MEGAMOE_ASSERT_OK(make_device_buffers(p, o, true, 0, &buffers));
  const MoeBuffers b = buffers.view();
  MoeSaved saved;
  o.precision = Precision::kMXFP8;
  Status st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("needs Blackwell"), std::string::npos) << st.message();
  o.precision = Precision::kFP8;  // FP8's operand regions are not in a bf16-sized scratch
  st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kCapacity) << st.to_string();
  o.precision = Precision::kBF16;
  // Host tensors handed to backend cuda.
  LayerOutputs host = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  st = moe_forward(p, o, d.inputs(), host.y.view, &saved, &b);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected a cuda tensor"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe::testing
