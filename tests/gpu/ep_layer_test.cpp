// The expert-parallel layer (cuda/layer/ep_layer.h) against the one-GPU layer:
// P ranks, each with its own tokens (counts differ by rank) and E / P experts,
// must produce y, dx, d topk_w, dW13 and dW2 bitwise equal to the one-GPU
// layer's on the whole batch with all E experts (each rank its tokens' rows
// and its experts' weight gradients). P = 2, 4 and 8 ranks share one GPU (one process; each phase
// runs for every rank before the next, since a phase waits for the other
// ranks' previous one); P = 2 also on two GPUs (MultiGpu.*). Three calls per
// group, with different batches, exercise the epoch flags: two forward +
// backward, then a forward that keeps nothing (its plan in scratch). Outputs are
// poisoned with NaN first, so a rank that wrote nothing fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/comm/peer_memory.h"
#include "cuda/layer/ep_layer.h"
#include "cuda/layer/one_gpu_layer.h"
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
  bool last_rank_empty = false;  // the last rank brings no tokens (its experts still work for the others);
                                 // its token tensors are then null, as PyTorch's empty CUDA tensors are
  Precision precision = Precision::kBF16;  // FP8: against the one-GPU FP8 layer, bit for bit as well
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

// Rank r's slices of the whole batch's tensors: its tokens from t0, its experts from e0.
cuda::LayerInputs layer_inputs(const DeviceLayer& D, int64_t t0, int64_t e0, int, const MoeProblem& p) {
  const int64_t H = p.hidden, I = p.intermediate, k = p.top_k;
  return {offset<uint16_t>(D.x.view(), t0 * H), offset<int32_t>(D.topk_idx.view(), t0 * k),
          offset<float>(D.topk_weights.view(), t0 * k), offset<uint16_t>(D.w13.view(), e0 * 2 * I * H),
          offset<uint16_t>(D.w2.view(), e0 * H * I)};
}
cuda::LayerGrads layer_grads(const DeviceLayer& D, int64_t t0, int64_t e0, int, const MoeProblem& p) {
  const int64_t H = p.hidden, I = p.intermediate, k = p.top_k;
  cuda::LayerGrads g;
  g.dx = static_cast<uint16_t*>(D.dx.view().data) + t0 * H;
  g.d_topk_weights = static_cast<float*>(D.d_topk_weights.view().data) + t0 * k;
  g.dw13 = static_cast<float*>(D.dw13.view().data) + e0 * 2 * I * H;
  g.dw2 = static_cast<float*>(D.dw2.view().data) + e0 * H * I;
  g.wgrad_f32 = true, g.accumulate = false;
  return g;
}

// The layer's FP8 weight buffer for dims d (none for bf16), quantised by the call that first reads it.
std::unique_ptr<DeviceBytes> fp8_weight_buffer(const LayerDims& d, MoeBuffers* b) {
  Fp8WeightLayout wl;
  EXPECT_TRUE(fp8_weight_layout(d, &wl).ok());
  if (wl.bytes == 0) return nullptr;
  auto w = std::make_unique<DeviceBytes>(wl.bytes);
  b->fp8_weights = w->p, b->fp8_weights_bytes = wl.bytes, b->fp8_weights_ready = false;
  return w;
}

// The one-GPU layer's forward and backward on the whole batch (fp32 weight grads).
LayerOutputs one_gpu_layer(const MoeProblem& p, DeviceLayer& dev, Precision precision) {
  LayerOutputs out = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  LayerDims d;
  d.tokens = p.num_tokens, d.hidden = p.hidden, d.intermediate = p.intermediate, d.num_experts = p.num_experts;
  d.top_k = p.top_k, d.precision = precision;
  ScratchLayout sl;
  SavedLayout sv;
  EXPECT_TRUE(scratch_layout(d, false, &sl).ok());
  EXPECT_TRUE(saved_layout(d, &sv).ok());
  DeviceBytes scratch(sl.bytes), saved(sv.bytes);
  cuda::LayerCall call;
  call.errors.timeout_ns = test_wait_timeout_ns();
  MoeBuffers b;
  b.scratch = scratch.p, b.scratch_bytes = sl.bytes, b.saved = saved.p, b.saved_bytes = sv.bytes;
  const std::unique_ptr<DeviceBytes> fp8_weights = fp8_weight_buffer(d, &b);
  Status st = cuda::prepare_layer_call(d, 0, nullptr, b, &call);
  const cuda::LayerInputs in = layer_inputs(dev, 0, 0, 0, p);
  const cuda::LayerGrads g = layer_grads(dev, 0, 0, 0, p);
  if (st.ok()) st = poison_outputs(dev, nullptr);
  if (st.ok()) st = cuda::layer_forward(call, in, dev.y.view().data, b);
  if (st.ok()) st = cuda::layer_backward(call, in, dev.dy.view().data, g, b);
  if (st.ok()) st = check_device_errors(0, nullptr);
  if (st.ok()) st = download_outputs(dev, &out);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

// Bytes of rows [r0, r1) of `width` elements of `esize` bytes that differ.
int64_t rows_differing(const HostTensor& got, const HostTensor& want, int64_t r0, int64_t r1, int64_t width,
                       size_t esize) {
  const auto* g = static_cast<const char*>(got.view.data);
  const auto* w = static_cast<const char*>(want.view.data);
  int64_t n = 0;
  for (int64_t r = r0; r < r1; ++r)
    n += std::memcmp(g + r * width * esize, w + r * width * esize, static_cast<size_t>(width) * esize) != 0;
  return n;
}

// Phase `phase` of a call for one rank: the forward's three (fw's epoch),
// then the backward's six (bw's). Phase 1 keeps what a backward needs when
// ep_saved is given (buffers then with their saved buffer), else nothing.
Status run_rank_phase(int phase, const cuda::LayerCall& call, const cuda::EpGroup& fw, const cuda::EpGroup& bw,
                    const cuda::LayerInputs& in, const cuda::LayerGrads& g, int64_t n, void* y, const void* dy,
                    const MoeBuffers& buffers, void* ep_saved) {
  cuda::EpCall c;
  MEGAMOE_RETURN_IF_ERROR(cuda::make_ep_call(call, phase < 3 ? fw : bw, in, n, buffers, ep_saved, &c));
  return cuda::run_ep_phase(c, phase, y, dy, g);
}

// Ranks on `devices` (repeats: several ranks on one GPU), two calls (forward
// and backward each); every rank's outputs must equal the one-GPU layer's
// rows of its tokens and experts, bit for bit.
// rank_major: every rank enqueues all its phases on a stream of its own before
// the next rank starts (as separate processes would), so the device-side
// waits alone order the ranks (distinct GPUs only: ep_layer.h); otherwise phase-major on the default stream.
void expect_ep_equals_one_gpu(const EpCase& c, const std::vector<int>& devices, bool rank_major = false) {
  const int P = c.world, L = c.experts / P, k = c.top_k;
  const int64_t H = c.hidden, I = c.intermediate, base = 150;
  std::vector<int64_t> count(static_cast<size_t>(P)), first(static_cast<size_t>(P));
  int64_t total = 0;
  for (int r = 0; r < P; ++r) {
    count[static_cast<size_t>(r)] = base - 13 * (r % 5);  // differ by rank, all within max_tokens
    if (c.last_rank_empty && r == P - 1) count[static_cast<size_t>(r)] = 0;
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
    std::unique_ptr<DeviceBytes> ep_scratch, scratch, saved, ep_saved, fp8_weights;
    cudaStream_t stream = nullptr;  // rank_major: its own
    ~Rank() {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
    cuda::LayerCall call;
    MoeBuffers buffers, forward_only;  // with the saved buffer, and without
  };
  std::vector<Rank> ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    Rank& R = ranks[static_cast<size_t>(r)];
    cuda::EpGroup probe;
    probe.layout = layout, probe.num_experts = c.experts;
    LayerDims d = cuda::ep_owner_dims(probe, I);
    d.precision = c.precision;
    ScratchLayout sl, sl_alone;
    SavedLayout sv;
    MEGAMOE_ASSERT_OK(scratch_layout(d, false, &sl, true));
    MEGAMOE_ASSERT_OK(scratch_layout(d, true, &sl_alone, true));  // the plan in scratch too
    MEGAMOE_ASSERT_OK(saved_layout(d, &sv));
    sl.bytes = std::max(sl.bytes_without_slots, sl_alone.bytes_without_slots);  // slot rows go to the sources
    R.scratch = std::make_unique<DeviceBytes>(sl.bytes);
    R.saved = std::make_unique<DeviceBytes>(sv.bytes);
    R.ep_scratch = std::make_unique<DeviceBytes>(cuda::ep_scratch_layout(layout).bytes);
    R.ep_saved = std::make_unique<DeviceBytes>(cuda::ep_saved_layout(layout).bytes);
    for (const auto* b : {R.scratch.get(), R.saved.get(), R.ep_scratch.get(), R.ep_saved.get()}) ASSERT_NE(b->p, nullptr);
    R.buffers.scratch = R.scratch->p, R.buffers.scratch_bytes = sl.bytes;
    R.fp8_weights = fp8_weight_buffer(d, &R.buffers);  // its E / P experts'
    R.forward_only = R.buffers;
    R.buffers.saved = R.saved->p, R.buffers.saved_bytes = sv.bytes;
    R.call.errors.timeout_ns = test_wait_timeout_ns();
    if (rank_major) {
      ASSERT_EQ(cudaStreamCreate(&R.stream), cudaSuccess);
    }
    MEGAMOE_ASSERT_OK(cuda::prepare_layer_call(d, group->device(r), R.stream, R.buffers, &R.call, true));
  }

  for (uint32_t call = 1; call <= 3; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    const uint32_t epoch = 3 * call - 2;  // forward; the backward takes the next two
    const bool backward = call < 3;
    LayerSpec spec;
    spec.problem = p, spec.routing = c.routing, spec.seed = 90 + call;
    const LayerData data = make_layer_data(spec);
    // The whole batch on every device the ranks use (rank r reads and writes its slices).
    std::vector<std::unique_ptr<DeviceLayer>> dev(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      dev[static_cast<size_t>(r)] = std::make_unique<DeviceLayer>();
      MEGAMOE_ASSERT_OK(make_device_layer(p, data, DType::kF32, group->device(r), dev[static_cast<size_t>(r)].get()));
    }
    ASSERT_EQ(cudaSetDevice(group->device(0)), cudaSuccess);
    const LayerOutputs want = one_gpu_layer(p, *dev[0], c.precision);
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      MEGAMOE_ASSERT_OK(poison_outputs(*dev[static_cast<size_t>(r)], nullptr));
    }

    auto ep_of = [&](int r, uint32_t e) {
      cuda::EpGroup ep;
      ep.view = group->view(r), ep.layout = layout, ep.num_experts = c.experts, ep.epoch = e;
      ep.scratch = ranks[static_cast<size_t>(r)].ep_scratch->p;
      return ep;
    };
    // Forward (3 phases), then backward (6).
    auto run_phase = [&](int phase, int r) {
        ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
        const DeviceLayer& D = *dev[static_cast<size_t>(r)];
        const Rank& R = ranks[static_cast<size_t>(r)];
        const int64_t t0 = first[static_cast<size_t>(r)], n = count[static_cast<size_t>(r)], e0 = int64_t{r} * L;
        cuda::LayerInputs in = layer_inputs(D, t0, e0, 0, p);
        cuda::LayerGrads g = layer_grads(D, t0, e0, 0, p);
        const bool empty = n == 0;  // null token tensors, as PyTorch passes them
        if (empty) in.x = nullptr, in.topk_idx = nullptr, in.topk_weights = nullptr;
        if (empty) g.dx = nullptr, g.d_topk_weights = nullptr;
        const cuda::EpGroup fw = ep_of(r, epoch), bw = ep_of(r, epoch + 1);
        void* y = empty ? nullptr : static_cast<uint16_t*>(D.y.view().data) + t0 * H;
        const void* dy = empty ? nullptr : static_cast<const uint16_t*>(D.dy.view().data) + t0 * H;
        MEGAMOE_ASSERT_OK(run_rank_phase(phase, R.call, fw, bw, in, g, n, y, dy,
                                       backward ? R.buffers : R.forward_only, backward ? R.ep_saved->p : nullptr));
    };
    const int phases = backward ? 9 : 3;
    // The first call runs phase-major even in rank_major mode: it loads every
    // kernel (CUDA loads lazily, and a load may synchronise the context while
    // one rank's kernel spins for a rank the host has not enqueued yet).
    const bool rm = rank_major && call > 1;
    for (int a = 0; a < (rm ? P : phases); ++a)
      for (int b = 0; b < (rm ? phases : P); ++b) {
        rm ? run_phase(b, a) : run_phase(a, b);
        if (::testing::Test::HasFatalFailure()) return;
      }
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      MEGAMOE_ASSERT_OK(check_device_errors(group->device(r), ranks[static_cast<size_t>(r)].stream));
      LayerOutputs got = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
      MEGAMOE_ASSERT_OK(download_outputs(*dev[static_cast<size_t>(r)], &got));
      const int64_t t0 = first[static_cast<size_t>(r)], t1 = t0 + count[static_cast<size_t>(r)];
      const int64_t e0 = int64_t{r} * L, e1 = e0 + L;
      EXPECT_EQ(rows_differing(got.y, want.y, t0, t1, H, 2), 0) << "rank " << r << ": rows of y";
      if (!backward) continue;
      EXPECT_EQ(rows_differing(got.dx, want.dx, t0, t1, H, 2), 0) << "rank " << r << ": rows of dx";
      EXPECT_EQ(rows_differing(got.d_topk_weights, want.d_topk_weights, t0, t1, k, 4), 0)
          << "rank " << r << ": rows of d topk_w";
      EXPECT_EQ(rows_differing(got.dw13, want.dw13, e0 * 2 * I, e1 * 2 * I, H, 4), 0)
          << "rank " << r << ": rows of dW13 of its experts";
      EXPECT_EQ(rows_differing(got.dw2, want.dw2, e0 * H, e1 * H, I, 4), 0) << "rank " << r << ": rows of dW2";
    }
  }
}

class EpLayer : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpLayer, ForwardAndBackwardAreBitwiseTheOneGpuLayerOnTheWholeBatch) {
  MEGAMOE_REQUIRE_GPU();
  expect_ep_equals_one_gpu(GetParam(), std::vector<int>(static_cast<size_t>(GetParam().world), 0));
}

INSTANTIATE_TEST_SUITE_P(RanksOnOneGpu, EpLayer,
                         ::testing::Values(EpCase{"P2_E8_k2", 2, 256, 256, 8, 2, Routing::kUniform},
                                           EpCase{"P4_E8_k2_drops", 4, 256, 128, 8, 2, Routing::kWithDrops},
                                           EpCase{"P2_E8_k2_one_hot", 2, 128, 128, 8, 2, Routing::kOneExpert},
                                           EpCase{"P8_E16_k4", 8, 128, 128, 16, 4, Routing::kUniform},
                                           EpCase{"P3_E6_k2_last_rank_empty", 3, 128, 128, 6, 2, Routing::kUniform,
                                                  true},
                                           // FP8 owners (fp8: the forward's rows in e4m3 over the dispatch)
                                           EpCase{"P2_E8_k2_fp8", 2, 256, 256, 8, 2, Routing::kUniform, false,
                                                  Precision::kFP8},
                                           EpCase{"P8_E16_k4_fp8", 8, 128, 128, 16, 4, Routing::kUniform, false,
                                                  Precision::kFP8},
                                           EpCase{"P4_E8_k2_drops_fp8_bwd", 4, 256, 128, 8, 2, Routing::kWithDrops,
                                                  false, Precision::kFP8Bwd},
                                           EpCase{"P3_E6_k2_last_rank_empty_fp8", 3, 128, 128, 6, 2,
                                                  Routing::kUniform, true, Precision::kFP8}),
                         [](const ::testing::TestParamInfo<EpCase>& i) { return std::string(i.param.name); });

// Each rank on its own GPU and stream, enqueuing its whole call before the
// next rank starts: only the device-side flags order them. (Ranks sharing a
// GPU cannot be driven so: a rank's spin-wait may hold an SM that another
// rank's cooperative kGateUp needs; ep_layer.h.)
TEST(MultiGpu, EpLayerOverNvlinkIsBitwiseTheOneGpuLayer) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  expect_ep_equals_one_gpu(EpCase{"P2_two_gpus", 2, 256, 256, 8, 2, Routing::kUniform}, {0, 1}, true);
  expect_ep_equals_one_gpu(EpCase{"P2_two_gpus_fp8", 2, 256, 256, 8, 2, Routing::kWithDrops, false, Precision::kFP8},
                           {0, 1}, true);
}

TEST(MultiGpu, EightRanksOnEightGpusAreBitwiseTheOneGpuLayer) {  // on an 8-GPU machine
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 8) GTEST_SKIP() << "needs 8 GPUs, " << n << " visible";
  expect_ep_equals_one_gpu(EpCase{"P8_eight_gpus", 8, 256, 256, 16, 4, Routing::kUniform},
                           {0, 1, 2, 3, 4, 5, 6, 7}, true);
  expect_ep_equals_one_gpu(EpCase{"P8_eight_gpus_fp8", 8, 256, 256, 16, 4, Routing::kUniform, false, Precision::kFP8},
                           {0, 1, 2, 3, 4, 5, 6, 7}, true);
}

// A forward that cannot complete: ranks [0, present) call it. Every present
// rank's call must end (bounded waits),
// with an error of `code` whose message holds `named`; y must be NaN rather
// than stale, and the context must stay usable.
void expect_forward_fault_is_named(const std::vector<int>& devices, int present, StatusCode code,
                                   const std::string& named) {
  const int P = static_cast<int>(devices.size()), E = 2 * P, L = 2, k = 2;
  const int64_t H = 128, I = 128, T = 64;
  cuda::DispatchLayout layout;
  layout.world = P, layout.max_tokens = T, layout.hidden = H, layout.top_k = k;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group(devices, layout.bytes(), &group));
  MoeProblem p;
  p.num_tokens = T, p.hidden = H, p.intermediate = I, p.num_experts = E, p.top_k = k, p.max_tokens_per_rank = T;
  LayerSpec spec;
  spec.problem = p, spec.seed = 5;
  const LayerData data = make_layer_data(spec);
  struct Rank {
    std::unique_ptr<DeviceBytes> scratch, ep_scratch;
    std::unique_ptr<DeviceLayer> dev;
    cuda::LayerCall call;
    MoeBuffers buffers;
  };
  std::vector<Rank> ranks(static_cast<size_t>(present));
  cuda::EpGroup probe;
  probe.layout = layout, probe.num_experts = E;
  const LayerDims d = cuda::ep_owner_dims(probe, I);
  ScratchLayout sl;
  MEGAMOE_ASSERT_OK(scratch_layout(d, true, &sl, true));
  const uint64_t timeout = under_cuda_tool() ? 5'000'000'000ull : 100'000'000ull;  // 0.1 s
  for (int r = 0; r < present; ++r) {
    Rank& R = ranks[static_cast<size_t>(r)];
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    R.scratch = std::make_unique<DeviceBytes>(sl.bytes_without_slots);
    R.ep_scratch = std::make_unique<DeviceBytes>(cuda::ep_scratch_layout(layout).bytes);
    R.dev = std::make_unique<DeviceLayer>();
    MEGAMOE_ASSERT_OK(make_device_layer(p, data, DType::kF32, group->device(r), R.dev.get()));
    MEGAMOE_ASSERT_OK(R.dev->y.fill_bytes(0));  // finite: a NaN afterwards is the call's doing
    R.buffers.scratch = R.scratch->p, R.buffers.scratch_bytes = sl.bytes_without_slots;
    R.call.errors.timeout_ns = timeout;
    MEGAMOE_ASSERT_OK(cuda::prepare_layer_call(d, group->device(r), nullptr, R.buffers, &R.call, true));
  }
  for (int phase = 0; phase < 3; ++phase)
    for (int r = 0; r < present; ++r) {
      Rank& R = ranks[static_cast<size_t>(r)];
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      cuda::EpGroup ep;
      ep.view = group->view(r), ep.layout = layout, ep.num_experts = E, ep.epoch = 1, ep.scratch = R.ep_scratch->p;
      const cuda::LayerInputs in{R.dev->x.view().data, static_cast<const int32_t*>(R.dev->topk_idx.view().data),
                                 static_cast<const float*>(R.dev->topk_weights.view().data),
                                 static_cast<const uint16_t*>(R.dev->w13.view().data) + int64_t{r} * L * 2 * I * H,
                                 static_cast<const uint16_t*>(R.dev->w2.view().data) + int64_t{r} * L * H * I};
      cuda::EpCall c;
      MEGAMOE_ASSERT_OK(cuda::make_ep_call(R.call, ep, in, T, R.buffers, nullptr, &c));
      if (phase == 0) MEGAMOE_ASSERT_OK(cuda::ep_forward_send(c));
      if (phase == 1) MEGAMOE_ASSERT_OK(cuda::ep_forward_experts(c));
      if (phase == 2) MEGAMOE_ASSERT_OK(cuda::ep_forward_combine(c, R.dev->y.view().data));
    }
  for (int r = 0; r < present; ++r) {
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    const Status st = check_device_errors(group->device(r), nullptr);
    if (r == 0 || devices[static_cast<size_t>(r)] != devices[0]) {  // one report per device: the first wins
      EXPECT_EQ(st.code(), code) << "rank " << r << ": " << st.to_string();
      EXPECT_NE(st.message().find(named), std::string::npos) << st.message();
    }
    HostTensor y(DType::kBF16, {T, H});
    MEGAMOE_ASSERT_OK(ranks[static_cast<size_t>(r)].dev->y.download(&y));
    int64_t finite = 0;
    for (int64_t i = 0; i < T * H; ++i) finite += std::isfinite(y.get(i));
    EXPECT_EQ(finite, 0) << "rank " << r << ": y must be NaN when the forward cannot complete";
  }
  int32_t probe_word = 0;  // the context is still usable
  EXPECT_EQ(cudaMemcpy(&probe_word, ranks[0].ep_scratch->p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
}

// Every rank runs the forward; rank P-1 then dies before its backward. The
// present ranks' backward must end (bounded waits), name the missing rank,
// and leave dx and d topk_w NaN (their tokens' routes to its experts never
// came back), not stale: bf16 sums dx inside dW13, FP8 in the combine phase.
void expect_rank_missing_from_backward_is_named(int P, Precision precision) {
  const int E = 2 * P, L = 2, k = 2;
  const int64_t H = 128, I = 128, T = 64;
  cuda::DispatchLayout layout;
  layout.world = P, layout.max_tokens = T, layout.hidden = H, layout.top_k = k;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group(std::vector<int>(static_cast<size_t>(P), 0), layout.bytes(), &group));
  MoeProblem p;
  p.num_tokens = T, p.hidden = H, p.intermediate = I, p.num_experts = E, p.top_k = k, p.max_tokens_per_rank = T;
  LayerSpec spec;
  spec.problem = p, spec.seed = 6;
  const LayerData data = make_layer_data(spec);
  cuda::EpGroup probe;
  probe.layout = layout, probe.num_experts = E;
  LayerDims d = cuda::ep_owner_dims(probe, I);
  d.precision = precision;
  ScratchLayout sl;
  SavedLayout sv;
  MEGAMOE_ASSERT_OK(scratch_layout(d, false, &sl, true));
  MEGAMOE_ASSERT_OK(saved_layout(d, &sv));
  struct Rank {
    std::unique_ptr<DeviceBytes> scratch, saved, ep_scratch, ep_saved, fp8_weights;
    std::unique_ptr<DeviceLayer> dev;
    cuda::LayerCall call;
    MoeBuffers buffers;
  };
  std::vector<Rank> ranks(static_cast<size_t>(P));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (int r = 0; r < P; ++r) {
    Rank& R = ranks[static_cast<size_t>(r)];
    R.scratch = std::make_unique<DeviceBytes>(sl.bytes_without_slots);
    R.saved = std::make_unique<DeviceBytes>(sv.bytes);
    R.ep_scratch = std::make_unique<DeviceBytes>(cuda::ep_scratch_layout(layout).bytes);
    R.ep_saved = std::make_unique<DeviceBytes>(cuda::ep_saved_layout(layout).bytes);
    R.dev = std::make_unique<DeviceLayer>();
    MEGAMOE_ASSERT_OK(make_device_layer(p, data, DType::kF32, 0, R.dev.get()));
    MEGAMOE_ASSERT_OK(R.dev->dx.fill_bytes(0));  // finite: a NaN afterwards is the call's doing
    MEGAMOE_ASSERT_OK(R.dev->d_topk_weights.fill_bytes(0));
    R.buffers.scratch = R.scratch->p, R.buffers.scratch_bytes = sl.bytes_without_slots;
    R.buffers.saved = R.saved->p, R.buffers.saved_bytes = sv.bytes;
    R.fp8_weights = fp8_weight_buffer(d, &R.buffers);
    R.call.errors.timeout_ns = under_cuda_tool() ? 5'000'000'000ull : 100'000'000ull;  // 0.1 s
    MEGAMOE_ASSERT_OK(cuda::prepare_layer_call(d, 0, nullptr, R.buffers, &R.call, true));
  }
  for (int phase = 0; phase < 9; ++phase)
    for (int r = 0; r < (phase < 3 ? P : P - 1); ++r) {  // rank P-1: the forward only
      Rank& R = ranks[static_cast<size_t>(r)];
      cuda::EpGroup ep;
      ep.view = group->view(r), ep.layout = layout, ep.num_experts = E, ep.scratch = R.ep_scratch->p;
      ep.epoch = phase < 3 ? 1 : 2;
      const cuda::LayerInputs in = layer_inputs(*R.dev, 0, int64_t{r} * L, 0, p);
      const cuda::LayerGrads g = layer_grads(*R.dev, 0, int64_t{r} * L, 0, p);
      MEGAMOE_ASSERT_OK(run_rank_phase(phase, R.call, ep, ep, in, g, T, R.dev->y.view().data, R.dev->dy.view().data,
                                     R.buffers, R.ep_saved->p));
    }
  const Status st = check_device_errors(0, nullptr);  // one report per device: the first wins
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("rank " + std::to_string(P - 1) + " never delivered its part"), std::string::npos)
      << st.message();
  for (int r = 0; r < P - 1; ++r) {
    HostTensor dx(DType::kBF16, {T, H}), dw(DType::kF32, {T, static_cast<int64_t>(k)});
    MEGAMOE_ASSERT_OK(ranks[static_cast<size_t>(r)].dev->dx.download(&dx));
    MEGAMOE_ASSERT_OK(ranks[static_cast<size_t>(r)].dev->d_topk_weights.download(&dw));
    int64_t finite = 0;
    for (int64_t i = 0; i < T * H; ++i) finite += std::isfinite(dx.get(i));
    EXPECT_EQ(finite, 0) << "rank " << r << ": dx must be NaN when a rank died before its backward";
    finite = 0;
    for (int64_t i = 0; i < T * k; ++i) finite += std::isfinite(dw.get(i));
    EXPECT_EQ(finite, 0) << "rank " << r << ": d topk_w must be NaN when a rank died before its backward";
  }
  int32_t probe_word = 0;  // the context is still usable
  EXPECT_EQ(cudaMemcpy(&probe_word, ranks[0].ep_scratch->p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
}

TEST(EpLayerFaults, ARankThatDiesBeforeItsBackwardIsNamedAndDxIsNaN) {
  MEGAMOE_REQUIRE_GPU();
  expect_rank_missing_from_backward_is_named(3, Precision::kBF16);
  if (::testing::Test::HasFatalFailure()) return;
  expect_rank_missing_from_backward_is_named(3, Precision::kFP8);
}

// Ranks 0..P-2 call the forward; rank P-1 never comes.
void expect_missing_rank_is_named(const std::vector<int>& devices) {
  const int P = static_cast<int>(devices.size());
  expect_forward_fault_is_named(devices, P - 1, StatusCode::kTimeout,
                                "rank " + std::to_string(P - 1) + " never delivered its part");
}

TEST(EpLayerFaults, EightRanksOnOneGpuNameTheOneThatNeverCame) {  // the EP = 8 fault test, on one GPU
  MEGAMOE_REQUIRE_GPU();
  expect_missing_rank_is_named(std::vector<int>(8, 0));
}

TEST(MultiGpu, AMissingRankIsNamedAcrossGpus) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  std::vector<int> devices;
  for (int d = 0; d < std::min(n, 8); ++d) devices.push_back(d);
  expect_missing_rank_is_named(devices);
}

// No GPU needed: a call is checked before any phase launches anything.
TEST(EpLayerArgs, BadCallsAreErrorsBeforeAnyLaunch) {
  cuda::EpGroup ep;
  ep.layout.world = 2, ep.layout.max_tokens = 64, ep.layout.hidden = 128, ep.layout.top_k = 2;
  ep.view.world = 2, ep.view.rank = 0, ep.num_experts = 8, ep.epoch = 1;
  alignas(256) static char scratch[256];
  ep.scratch = scratch;
  cuda::LayerCall call;
  call.dims = cuda::ep_owner_dims(ep, 128);
  call.slots_at_sources = true;  // an owner's call
  const int32_t idx = 0;
  const float w = 1.0f;
  const uint16_t x = 0;
  const cuda::LayerInputs in{&x, &idx, &w, &x, &x};
  auto expect_error = [&](const cuda::EpGroup& g, int64_t tokens, const char* words) {
    cuda::EpCall c;
    const Status s = cuda::make_ep_call(call, g, in, tokens, MoeBuffers{}, nullptr, &c);
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
  call.slots_at_sources = false;  // a one-GPU call's scratch layout (no bf16 pool in fp8)
  expect_error(ep, 10, "slots_at_sources");
  call.slots_at_sources = true;
  call.dims.tokens = 64;
  expect_error(ep, 10, "not ep_owner_dims");
}

}  // namespace
}  // namespace megamoe::testing
