// The CUDA layer (one GPU, bf16) against the CPU reference: every output, on
// fresh random inputs, for shapes and routings that stress the plan; outputs
// poisoned first; bitwise determinism; CUDA-graph capture (which fails on any
// host synchronisation); the errors a user can hit.
#include <cmath>
#include <cstring>
#include <string>

#include "gpu_test_util.h"
#include "megamoe/reference.h"

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
// and flip an occasional bf16 rounding (2^-8 on that element): far below 1e-2.
// GPU vs fp64: the bf16 bound of the reference itself (docs/numerics.md).
constexpr double kVsReference = 1e-2, kVsFp64 = 1.5e-2;

class CudaLayer : public ::testing::TestWithParam<Case> {};

LayerData random_data(const MoeProblem& p, Routing routing, uint64_t seed) {
  LayerSpec spec;
  spec.problem = p;
  spec.routing = routing;
  spec.seed = seed;
  spec.hot_expert = p.num_experts / 3;
  return make_layer_data(spec);
}

LayerOutputs run_cpu(const MoeProblem& p, const LayerData& d, bool exact) {
  MoeOptions o;
  o.backend = Backend::kCPU;
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

LayerOutputs run_gpu(const MoeProblem& p, const MoeOptions& o, const LayerData& d, DType wgrad, MoeWorkspace* ws) {
  DeviceLayer dev;
  LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, wgrad, 0.0);
  Status st = make_device_layer(p, d, wgrad, 0, &dev);
  if (st.ok()) st = poison_outputs(dev, static_cast<cudaStream_t>(o.cuda_stream));
  MoeSaved saved;
  if (st.ok()) st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, ws);
  if (st.ok()) st = moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), ws);
  if (st.ok()) st = ws->check_device_errors(o);
  if (st.ok()) st = download_outputs(dev, &out);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

void expect_close(const LayerOutputs& got, const LayerOutputs& ref, double bound, const char* what) {
  const std::pair<const char*, std::pair<const HostTensor*, const HostTensor*>> outs[] = {
      {"y", {&got.y, &ref.y}},
      {"dx", {&got.dx, &ref.dx}},
      {"d_topk_weights", {&got.d_topk_weights, &ref.d_topk_weights}},
      {"dw13", {&got.dw13, &ref.dw13}},
      {"dw2", {&got.dw2, &ref.dw2}}};
  for (const auto& [name, pair] : outs) {
    const double e = relative_error(*pair.first, *pair.second);
    EXPECT_LT(e, bound) << name << " vs " << what;  // NaN (an unwritten element) fails too
  }
}

TEST_P(CudaLayer, MatchesTheCpuReference) {
  MEGAMOE_REQUIRE_GPU();
  const Case& c = GetParam();
  MoeProblem p;
  p.num_tokens = c.T, p.hidden = c.H, p.intermediate = c.I, p.num_experts = c.E, p.top_k = c.k;
  p.max_tokens_per_rank = c.T + 5;  // the workspace is sized above the call's T
  const LayerData d = random_data(p, c.routing, 11);
  const LayerOutputs ref = run_cpu(p, d, false);
  const LayerOutputs exact = run_cpu(p, d, true);
  for (SavePolicy save : {SavePolicy::kKeep, SavePolicy::kRecompute}) {
    for (DType wgrad : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string("save ") + to_string(save) + ", wgrad " + to_string(wgrad));
      const MoeOptions o = cuda_options(save);
      std::unique_ptr<MoeWorkspace> ws;
      MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, o, 0, &ws));
      const LayerOutputs got = run_gpu(p, o, d, wgrad, ws.get());
      expect_close(got, ref, kVsReference, "cpu reference");
      expect_close(got, exact, kVsFp64, "fp64");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLayer,
    ::testing::Values(Case{"T300_k2", 300, 256, 128, 8, 2, Routing::kUniform},
                      Case{"T257_k1", 257, 128, 256, 16, 1, Routing::kUniform},
                      Case{"k8_of_8", 200, 256, 256, 8, 8, Routing::kUniform},
                      Case{"E128_empty_experts", 384, 512, 256, 128, 8, Routing::kUniform},
                      Case{"one_hot_expert", 333, 256, 128, 16, 2, Routing::kOneExpert},
                      Case{"dropped_routes", 190, 256, 128, 32, 4, Routing::kWithDrops},
                      Case{"half_experts_empty", 130, 128, 128, 64, 4, Routing::kFirstHalf},
                      Case{"qwen3_30b_widths", 64, 2048, 768, 16, 8, Routing::kUniform}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

MoeProblem small_problem() {
  MoeProblem p;
  p.num_tokens = 200, p.hidden = 256, p.intermediate = 128, p.num_experts = 16, p.top_k = 4;
  p.max_tokens_per_rank = 256;
  return p;
}

TEST(CudaLayerRuns, AreBitwiseIdentical) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const LayerData d = random_data(p, Routing::kWithDrops, 5);
  std::unique_ptr<MoeWorkspace> ws;
  MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, cuda_options(), 0, &ws));
  const LayerOutputs a = run_gpu(p, cuda_options(), d, DType::kF32, ws.get());
  const LayerOutputs b = run_gpu(p, cuda_options(), d, DType::kF32, ws.get());
  EXPECT_TRUE(bitwise_equal(a.y, b.y));
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx));
  EXPECT_TRUE(bitwise_equal(a.d_topk_weights, b.d_topk_weights));
  EXPECT_TRUE(bitwise_equal(a.dw13, b.dw13));
  EXPECT_TRUE(bitwise_equal(a.dw2, b.dw2));
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
  std::unique_ptr<MoeWorkspace> ws;
  MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, o, 0, &ws));
  const LayerOutputs eager = run_gpu(p, o, d, DType::kF32, ws.get());

  DeviceLayer dev;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MEGAMOE_ASSERT_OK(poison_outputs(dev, stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  MoeSaved saved;
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status fs = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, ws.get());
  const Status bs = fs.ok() ? moe_backward(p, o, dev.inputs(), dev.dy.view(), saved, dev.grads(), ws.get()) : fs;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "capture broken (a host sync inside?)";
  MEGAMOE_ASSERT_OK(fs);
  MEGAMOE_ASSERT_OK(bs);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 2; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  LayerOutputs replay = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  MEGAMOE_ASSERT_OK(download_outputs(dev, &replay));
  EXPECT_TRUE(bitwise_equal(eager.y, replay.y));
  EXPECT_TRUE(bitwise_equal(eager.dx, replay.dx));
  EXPECT_TRUE(bitwise_equal(eager.d_topk_weights, replay.d_topk_weights));
  EXPECT_TRUE(bitwise_equal(eager.dw13, replay.dw13));
  EXPECT_TRUE(bitwise_equal(eager.dw2, replay.dw2));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaLayerErrors, TooManyTokensForTheWorkspace) {
  MEGAMOE_REQUIRE_GPU();
  MoeProblem p = small_problem();
  std::unique_ptr<MoeWorkspace> ws;
  MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, cuda_options(), 0, &ws));
  EXPECT_EQ(ws->max_tokens(), 256);
  EXPECT_EQ(ws->size_bytes(), MoeWorkspace::bytes_for(p));
  p.num_tokens = 300;
  p.max_tokens_per_rank = 300;  // a problem that claims more than the workspace holds
  const LayerData d = random_data(p, Routing::kUniform, 1);
  DeviceLayer dev;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MoeSaved saved;
  const Status st = moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &saved, ws.get());
  EXPECT_EQ(st.code(), StatusCode::kCapacity) << st.to_string();
  EXPECT_NE(st.message().find("exceeds the workspace's max_tokens_per_rank = 256"), std::string::npos) << st.message();
}

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
    std::unique_ptr<MoeWorkspace> ws;
    MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, cuda_options(), 0, &ws));
    DeviceLayer dev;
    MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
    MoeSaved saved;
    MEGAMOE_ASSERT_OK(moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &saved, ws.get()));
    const Status st = ws->check_device_errors(cuda_options());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(variant == 0 ? "topk_idx[7,2] is out of range" : "token 9 is routed twice"),
              std::string::npos)
        << st.message();
    LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
    MEGAMOE_ASSERT_OK(dev.y.download(&out.y));
    EXPECT_TRUE(std::isnan(out.y.get(0))) << "a failed call must not return plausible numbers";
  }
}

TEST(CudaLayerErrors, BackwardAfterTheWorkspaceWasReused) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  const LayerData d = random_data(p, Routing::kUniform, 3);
  std::unique_ptr<MoeWorkspace> ws;
  MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, cuda_options(), 0, &ws));
  DeviceLayer dev;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  MoeSaved first, second;
  MEGAMOE_ASSERT_OK(moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &first, ws.get()));
  MEGAMOE_ASSERT_OK(moe_forward(p, cuda_options(), dev.inputs(), dev.y.view(), &second, ws.get()));
  const Status st = moe_backward(p, cuda_options(), dev.inputs(), dev.dy.view(), first, dev.grads(), ws.get());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a later forward has reused the workspace"), std::string::npos) << st.message();
}

TEST(CudaLayerErrors, UnsupportedRequestsAreClear) {
  MEGAMOE_REQUIRE_GPU();
  const MoeProblem p = small_problem();
  std::unique_ptr<MoeWorkspace> ws;
  MoeOptions o = cuda_options();
  o.precision = Precision::kFP8;
  Status st = MoeWorkspace::create(p, o, 0, &ws);
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("precision fp8 on backend cuda"), std::string::npos) << st.message();
  o.precision = Precision::kBF16;
  MEGAMOE_ASSERT_OK(MoeWorkspace::create(p, o, 0, &ws));
  const LayerData d = random_data(p, Routing::kUniform, 4);
  // Host tensors handed to backend cuda.
  LayerOutputs host = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  MoeSaved saved;
  st = moe_forward(p, o, d.inputs(), host.y.view, &saved, ws.get());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected a cuda tensor"), std::string::npos) << st.message();
  // No workspace.
  DeviceLayer dev;
  MEGAMOE_ASSERT_OK(make_device_layer(p, d, DType::kF32, 0, &dev));
  st = moe_forward(p, o, dev.inputs(), dev.y.view(), &saved, nullptr);
  EXPECT_NE(st.message().find("needs a MoeWorkspace"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe::testing
