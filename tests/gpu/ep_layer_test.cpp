// The expert-parallel forward (cuda/moe/ep_layer.h) against the one-GPU layer:
// P ranks, each with its own tokens (counts differ by rank) and E / P experts,
// must produce y bitwise equal to the one-GPU layer's on the whole batch with
// all E experts. P = 2, 4 and 8 ranks share one GPU (one process; each phase
// runs for every rank before the next, since a phase waits for the other
// ranks' previous one); P = 2 also on two GPUs (MultiGpu.*). Two calls per
// group, with different batches, exercise the epoch flags. y is poisoned with
// NaN first, so a rank that wrote nothing fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/comm/peer_memory.h"
#include "cuda/moe/cuda_layer.h"
#include "cuda/moe/ep_layer.h"
#include "gpu_test_util.h"
#include "megamoe/moe.h"
#include "testing/device_layer.h"
#include "testing/random_layer.h"

namespace megamoe::testing {
namespace {

struct EpCase {
  const char* name;
  int world;
  int64_t hidden, intermediate;
  int experts, top_k;
  Routing routing;
};
void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

// A device allocation that frees itself.
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(size_t n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
    if (p != nullptr) cudaMemset(p, 0, n);
  }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

template <typename T>
const T* offset(const TensorView& v, int64_t elements) {
  return static_cast<const T*>(v.data) + elements;
}

// The one-GPU layer's forward on the whole batch.
HostTensor one_gpu_forward(const MoeProblem& p, const DeviceLayer& dev) {
  HostTensor y(DType::kBF16, {p.num_tokens, p.hidden});
  LayerDims d;
  d.tokens = p.num_tokens, d.hidden = p.hidden, d.intermediate = p.intermediate, d.num_experts = p.num_experts;
  d.top_k = p.top_k;
  ScratchLayout sl;
  EXPECT_TRUE(scratch_layout(d, true, &sl).ok());
  DeviceBytes scratch(sl.bytes);
  cuda::LayerCall call;
  call.errors.timeout_ns = test_wait_timeout_ns();
  MoeBuffers b;
  b.scratch = scratch.p, b.scratch_bytes = sl.bytes;
  Status st = cuda::prepare_layer_call(d, 0, nullptr, b, &call);
  const cuda::LayerInputs in{dev.x.view().data, static_cast<const int32_t*>(dev.topk_idx.view().data),
                             static_cast<const float*>(dev.topk_weights.view().data), dev.w13.view().data,
                             dev.w2.view().data};
  if (st.ok()) st = cuda::layer_forward(call, in, dev.y.view().data, b);
  if (st.ok()) st = check_device_errors(0, nullptr);
  if (st.ok()) st = dev.y.download(&y);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return y;
}

// Ranks on `devices` (repeats: several ranks on one GPU), two calls; y of
// every rank must equal the one-GPU layer's rows of its tokens, bit for bit.
void expect_ep_equals_one_gpu(const EpCase& c, const std::vector<int>& devices) {
  const int P = c.world, L = c.experts / P, k = c.top_k;
  const int64_t H = c.hidden, I = c.intermediate, base = 150;
  std::vector<int64_t> count(static_cast<size_t>(P)), first(static_cast<size_t>(P));
  int64_t total = 0;
  for (int r = 0; r < P; ++r) {
    count[static_cast<size_t>(r)] = base - 13 * (r % 5);  // differ by rank, all within max_tokens
    first[static_cast<size_t>(r)] = total;
    total += count[static_cast<size_t>(r)];
  }
  MoeProblem p;
  p.num_tokens = total, p.hidden = H, p.intermediate = I, p.num_experts = c.experts, p.top_k = k;
  p.max_tokens_per_rank = total;

  cuda::DispatchLayout layout;
  layout.world = P, layout.max_tokens = base, layout.hidden = H, layout.top_k = k;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group(devices, layout.bytes(), &group));

  struct Rank {
    std::unique_ptr<DeviceBytes> ep_scratch, scratch;
    cuda::LayerCall call;
    MoeBuffers buffers;
  };
  std::vector<Rank> ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    Rank& R = ranks[static_cast<size_t>(r)];
    cuda::EpGroup probe;
    probe.layout = layout, probe.num_experts = c.experts;
    const LayerDims d = cuda::ep_owner_dims(probe, I);
    ScratchLayout sl;
    MEGAMOE_ASSERT_OK(scratch_layout(d, true, &sl));
    R.scratch = std::make_unique<DeviceBytes>(sl.bytes);
    R.ep_scratch = std::make_unique<DeviceBytes>(cuda::ep_scratch_layout(layout).bytes);
    ASSERT_NE(R.scratch->p, nullptr);
    ASSERT_NE(R.ep_scratch->p, nullptr);
    R.buffers.scratch = R.scratch->p, R.buffers.scratch_bytes = sl.bytes;
    R.call.errors.timeout_ns = test_wait_timeout_ns();
    MEGAMOE_ASSERT_OK(cuda::prepare_layer_call(d, group->device(r), nullptr, R.buffers, &R.call));
  }

  for (uint32_t epoch = 1; epoch <= 2; ++epoch) {
    SCOPED_TRACE("call " + std::to_string(epoch));
    LayerSpec spec;
    spec.problem = p, spec.routing = c.routing, spec.seed = 90 + epoch;
    const LayerData data = make_layer_data(spec);
    // The whole batch on every device the ranks use (rank r reads its slice).
    std::vector<std::unique_ptr<DeviceLayer>> dev(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      dev[static_cast<size_t>(r)] = std::make_unique<DeviceLayer>();
      MEGAMOE_ASSERT_OK(make_device_layer(p, data, DType::kF32, group->device(r), dev[static_cast<size_t>(r)].get()));
      MEGAMOE_ASSERT_OK(dev[static_cast<size_t>(r)]->y.fill_bytes(0xFF));
    }
    ASSERT_EQ(cudaSetDevice(group->device(0)), cudaSuccess);
    const HostTensor want = one_gpu_forward(p, *dev[0]);
    MEGAMOE_ASSERT_OK(dev[0]->y.fill_bytes(0xFF));

    auto rank_call = [&](int r) {
      const DeviceLayer& D = *dev[static_cast<size_t>(r)];
      const int64_t t0 = first[static_cast<size_t>(r)];
      cuda::EpGroup ep;
      ep.view = group->view(r), ep.layout = layout, ep.num_experts = c.experts, ep.epoch = epoch;
      ep.scratch = ranks[static_cast<size_t>(r)].ep_scratch->p;
      cuda::LayerInputs in{offset<uint16_t>(D.x.view(), t0 * H), offset<int32_t>(D.topk_idx.view(), t0 * k),
                           offset<float>(D.topk_weights.view(), t0 * k),
                           offset<uint16_t>(D.w13.view(), int64_t{r} * L * 2 * I * H),
                           offset<uint16_t>(D.w2.view(), int64_t{r} * L * H * I)};
      return std::make_pair(ep, in);
    };
    for (int phase = 0; phase < 3; ++phase)
      for (int r = 0; r < P; ++r) {
        ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
        const auto [ep, in] = rank_call(r);
        const Rank& R = ranks[static_cast<size_t>(r)];
        const int64_t n = count[static_cast<size_t>(r)];
        void* y = static_cast<uint16_t*>(dev[static_cast<size_t>(r)]->y.view().data) + first[static_cast<size_t>(r)] * H;
        if (phase == 0) MEGAMOE_ASSERT_OK(cuda::ep_forward_send(R.call, ep, in, n));
        if (phase == 1) MEGAMOE_ASSERT_OK(cuda::ep_forward_experts(R.call, ep, in, n, R.buffers));
        if (phase == 2) MEGAMOE_ASSERT_OK(cuda::ep_forward_combine(R.call, ep, in, n, y));
      }
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      MEGAMOE_ASSERT_OK(check_device_errors(group->device(r), nullptr));
      HostTensor got(DType::kBF16, {total, H});
      MEGAMOE_ASSERT_OK(dev[static_cast<size_t>(r)]->y.download(&got));
      const auto* g = static_cast<const uint16_t*>(got.view.data);
      const auto* w = static_cast<const uint16_t*>(want.view.data);
      int64_t wrong_rows = 0;
      for (int64_t t = first[static_cast<size_t>(r)]; t < first[static_cast<size_t>(r)] + count[static_cast<size_t>(r)]; ++t)
        wrong_rows += std::memcmp(g + t * H, w + t * H, static_cast<size_t>(H) * 2) != 0;
      EXPECT_EQ(wrong_rows, 0) << "rank " << r << ": rows of y not bitwise the one-GPU layer's";
    }
  }
}

class EpLayer : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpLayer, ForwardIsBitwiseTheOneGpuLayerOnTheWholeBatch) {
  MEGAMOE_REQUIRE_GPU();
  expect_ep_equals_one_gpu(GetParam(), std::vector<int>(static_cast<size_t>(GetParam().world), 0));
}

INSTANTIATE_TEST_SUITE_P(RanksOnOneGpu, EpLayer,
                         ::testing::Values(EpCase{"P2_E8_k2", 2, 256, 256, 8, 2, Routing::kUniform},
                                           EpCase{"P4_E8_k2_drops", 4, 256, 128, 8, 2, Routing::kWithDrops},
                                           EpCase{"P2_E8_k2_one_hot", 2, 128, 128, 8, 2, Routing::kOneExpert},
                                           EpCase{"P8_E16_k4", 8, 128, 128, 16, 4, Routing::kUniform}),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return std::string(i.param.name); });

TEST(MultiGpu, EpForwardOverNvlinkIsBitwiseTheOneGpuLayer) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  expect_ep_equals_one_gpu(EpCase{"P2_two_gpus", 2, 256, 256, 8, 2, Routing::kUniform}, {0, 1});
}

// No GPU needed: every phase checks its call before it launches anything.
TEST(EpLayerArgs, BadCallsAreErrorsBeforeAnyLaunch) {
  cuda::EpGroup ep;
  ep.layout.world = 2, ep.layout.max_tokens = 64, ep.layout.hidden = 128, ep.layout.top_k = 2;
  ep.view.world = 2, ep.view.rank = 0, ep.num_experts = 8, ep.epoch = 1;
  alignas(256) static char scratch[256];
  ep.scratch = scratch;
  cuda::LayerCall call;
  call.dims = cuda::ep_owner_dims(ep, 128);
  const int32_t idx = 0;
  const float w = 1.0f;
  const uint16_t x = 0;
  const cuda::LayerInputs in{&x, &idx, &w, &x, &x};
  auto expect_error = [&](const cuda::EpGroup& g, int64_t tokens, const char* words) {
    const Status s = cuda::ep_forward_send(call, g, in, tokens);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.to_string().find(words), std::string::npos) << s.to_string();
  };
  expect_error(ep, 65, "65 tokens on rank 0");
  cuda::EpGroup bad = ep;
  bad.num_experts = 7;
  expect_error(bad, 10, "do not split evenly");
  bad = ep;
  bad.epoch = 0;
  expect_error(bad, 10, "epoch 0");
  bad = ep;
  bad.layout.world = 3;
  expect_error(bad, 10, "world 2 (layout: 3)");
  bad = ep;
  bad.scratch = scratch + 8;
  expect_error(bad, 10, "not 256-byte aligned");
  call.dims.tokens = 64;
  expect_error(ep, 10, "not ep_owner_dims");
}

}  // namespace
}  // namespace megamoe::testing
