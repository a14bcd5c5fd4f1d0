// Every bad input to the public entry points gives a clear error naming the
// problem, and no output is touched.
#include "cuda/device_query.h"
#include "test_util.h"

namespace megamoe::testing {
namespace {

class ApiValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    p_ = make_problem(10, 128, 128, 4, 2);
    LayerSpec s;
    s.problem = p_;
    d_ = make_layer_data(s);
    out_ = make_layer_outputs(p_, p_.num_tokens, DType::kBF16, DType::kF32, 7.0);
    y_ = out_.y.view;
  }

  Status forward(const MoeOptions& o = cpu_options()) { return moe_forward(p_, o, d_.inputs(), y_, &saved_); }

  void expect_forward_error(StatusCode code, const std::string& fragment, const MoeOptions& o = cpu_options()) {
    const Status st = forward(o);
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(fragment), std::string::npos) << "message: " << st.message();
    for (double v : out_.y.to_f64()) ASSERT_EQ(v, 7.0) << "output touched by a rejected call";
  }

  MoeProblem p_;
  LayerData d_;
  LayerOutputs out_;
  TensorView y_;  // the y passed to the call (out_.y stays intact for the poison check)
  MoeSaved saved_;
};

TEST_F(ApiValidation, ValidCallSucceeds) { EXPECT_TRUE(forward().ok()); }

TEST_F(ApiValidation, ExpertIdOutOfRange) {
  d_.topk_idx.set(3, 4);  // token 1, slot 1
  expect_forward_error(StatusCode::kInvalidArgument, "topk_idx[1,1] = 4 is out of range [-1, num_experts = 4)");
}

TEST_F(ApiValidation, NegativeExpertIdOtherThanMinusOne) {
  d_.topk_idx.set(0, -2);
  expect_forward_error(StatusCode::kInvalidArgument, "topk_idx[0,0] = -2");
}

TEST_F(ApiValidation, TokenRoutedTwiceToOneExpert) {
  d_.topk_idx.set(4, 3);
  d_.topk_idx.set(5, 3);
  expect_forward_error(StatusCode::kInvalidArgument, "token 2 is routed twice to expert 3");
}

TEST_F(ApiValidation, TooManyTokensForTheWorkspace) {
  p_.max_tokens_per_rank = 8;
  expect_forward_error(StatusCode::kCapacity, "num_tokens = 10 exceeds max_tokens_per_rank = 8");
}

TEST_F(ApiValidation, HiddenNotAligned) {
  p_.hidden = 100;
  expect_forward_error(StatusCode::kInvalidArgument, "hidden = 100");
}

TEST_F(ApiValidation, ExpertsNotDivisibleByRanks) {
  p_.ep_size = 3;
  expect_forward_error(StatusCode::kInvalidArgument, "not divisible by ep_size = 3");
}

TEST_F(ApiValidation, WrongInputDtype) {
  d_.x.view.dtype = DType::kF32;
  expect_forward_error(StatusCode::kInvalidArgument, "x: expected dtype bf16");
}

TEST_F(ApiValidation, MixedFloatDtypes) {
  d_.topk_weights.view.dtype = DType::kBF16;
  expect_forward_error(StatusCode::kInvalidArgument, "topk_weights: expected dtype f32, got bf16");
}

TEST_F(ApiValidation, WrongWeightShape) {
  d_.w13.view.shape[1] = 128;
  expect_forward_error(StatusCode::kInvalidArgument, "w13: expected shape [4, 256, 128], got [4, 128, 128]");
}

TEST_F(ApiValidation, TokenCountDisagreesWithProblem) {
  p_.num_tokens = 9;
  expect_forward_error(StatusCode::kInvalidArgument, "x: expected 9 tokens");
}

TEST_F(ApiValidation, WrongOutputShape) {
  y_.shape[1] = 256;
  expect_forward_error(StatusCode::kInvalidArgument, "y: expected shape [10, 128]");
}

TEST_F(ApiValidation, NullData) {
  d_.w2.view.data = nullptr;
  expect_forward_error(StatusCode::kInvalidArgument, "w2: data pointer is null");
}

TEST_F(ApiValidation, DeviceTensorsOnTheCpuBackend) {
  d_.x.view.device = DeviceType::kCUDA;
  expect_forward_error(StatusCode::kInvalidArgument, "backend cpu needs cpu tensors");
}

TEST_F(ApiValidation, MultiRankOnTheSingleRankEntryPoint) {
  p_.ep_size = 2;
  p_.num_experts = 4;
  expect_forward_error(StatusCode::kUnimplemented, "simulate_forward simulates P ranks");
}

// A call on backend cuda that must fail: without a GPU, "backend cuda: ..."
// (Unavailable); with one, an InvalidArgument whose message holds `with_gpu`.
void expect_cuda_refusal(const Status& st, const std::string& with_gpu) {
  std::string why;
  if (cuda::device_count(&why) == 0) {
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_EQ(st.message().rfind("backend cuda:", 0), 0u) << st.message();
  } else {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(with_gpu), std::string::npos) << st.message();
  }
}

TEST_F(ApiValidation, CudaBackendWithoutGpuOrBuffersIsAClearError) {
  MoeOptions o = cpu_options();
  o.backend = Backend::kCUDA;
  expect_cuda_refusal(forward(o), "backend cuda needs MoeBuffers");
}

// Filling a layer's FP8 weight buffer: host tensors (here) are refused with a
// clear error, never read as device memory; without a GPU the error says so.
TEST_F(ApiValidation, FillingFp8WeightsNeedsCudaBf16Weights) {
  MoeOptions o = cpu_options();
  o.backend = Backend::kCUDA, o.precision = Precision::kFP8;
  MoeBufferSizes sizes;
  ASSERT_TRUE(moe_buffer_sizes(p_, o, true, &sizes).ok());
  EXPECT_GT(sizes.fp8_weights_bytes, 0u);
  std::vector<uint8_t> host(sizes.fp8_weights_bytes + 256);
  MoeBuffers b;
  b.fp8_weights = host.data(), b.fp8_weights_bytes = sizes.fp8_weights_bytes;
  expect_cuda_refusal(moe_fill_fp8_weights(p_, o, d_.w13.view, d_.w2.view, b),
                      "w13: the FP8 weights are quantised from a bf16 CUDA tensor");
  o.precision = Precision::kBF16;
  ASSERT_TRUE(moe_buffer_sizes(p_, o, true, &sizes).ok());
  EXPECT_EQ(sizes.fp8_weights_bytes, 0u);  // bf16 has none
}

TEST_F(ApiValidation, Mxfp8OnCudaNamesBlackwell) {
  MoeOptions o = cpu_options(Precision::kMXFP8);
  o.backend = Backend::kCUDA;
  expect_forward_error(StatusCode::kUnimplemented, "mxfp8 needs Blackwell", o);
}

TEST_F(ApiValidation, AutoSaysWhichBackendAndWhy) {
  MoeOptions o;
  o.backend = Backend::kAuto;
  Backend chosen;
  std::string reason, why;
  ASSERT_TRUE(resolve_backend(o, &chosen, &reason).ok());
  if (cuda::device_count(&why) == 0) {
    EXPECT_EQ(chosen, Backend::kCPU);
    EXPECT_EQ(reason, "auto: using cpu (backend cuda: " + why + ")");
  } else {
    EXPECT_EQ(chosen, Backend::kCUDA);
    EXPECT_EQ(reason, "auto: CUDA device found, using cuda");
  }
  o.precision = Precision::kMXFP8;  // no Hopper kernels: cpu either way
  ASSERT_TRUE(resolve_backend(o, &chosen, &reason).ok());
  EXPECT_EQ(chosen, Backend::kCPU);
  // A call with auto follows its tensors: these are CPU tensors.
  EXPECT_TRUE(forward(o).ok());
}

TEST_F(ApiValidation, BackwardWithoutForward) {
  MoeSaved empty;
  const Status st = moe_backward(p_, cpu_options(), d_.inputs(), d_.dy.view, empty, out_.grads());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("saved: empty"), std::string::npos) << st.message();
}

TEST_F(ApiValidation, BackwardWithAnotherPrecision) {
  ASSERT_TRUE(forward(cpu_options(Precision::kBF16)).ok());
  const Status st = moe_backward(p_, cpu_options(Precision::kFP8), d_.inputs(), d_.dy.view, saved_, out_.grads());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("forward ran with precision bf16, the backward asks for fp8"), std::string::npos)
      << st.message();
}

TEST_F(ApiValidation, BackwardWithWrongGradDtypes) {
  ASSERT_TRUE(forward().ok());
  LayerOutputs g = make_layer_outputs(p_, p_.num_tokens, DType::kBF16, DType::kBF16, 0.0);
  MoeOptions o = cpu_options();
  o.accumulate_weight_grads = true;
  const Status st = moe_backward(p_, o, d_.inputs(), d_.dy.view, saved_, g.grads());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("dw13 (accumulate_weight_grads): expected dtype f32"), std::string::npos)
      << st.message();
  g.d_topk_weights.view.shape[1] = 3;
  const Status st2 = moe_backward(p_, cpu_options(), d_.inputs(), d_.dy.view, saved_, g.grads());
  EXPECT_NE(st2.message().find("d_topk_weights: expected shape [10, 2]"), std::string::npos) << st2.message();
}

TEST_F(ApiValidation, SimulateNeedsOneEntryPerRank) {
  MoeProblem p = p_;
  p.ep_size = 2;
  const Status st = reference::simulate_forward(p, cpu_options(), {d_.inputs()}, {out_.y.view}, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected one entry per rank (ep_size = 2), got 1"), std::string::npos)
      << st.message();
}

TEST_F(ApiValidation, SimulateNamesTheRank) {
  MoeProblem p = p_;
  p.ep_size = 2;
  LayerSpec s;
  s.problem = p;
  s.rank = 1;
  LayerData d1 = make_layer_data(s);
  LayerData d0 = make_layer_data(s);
  d1.topk_idx.set(0, 99);
  LayerOutputs o1 = make_layer_outputs(p, 10, DType::kBF16, DType::kF32, 0.0);
  const Status st = reference::simulate_forward(p, cpu_options(), {d0.inputs(), d1.inputs()},
                                                {out_.y.view, o1.y.view}, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("rank 1: topk_idx[0,0] = 99"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe::testing
