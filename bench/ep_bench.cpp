// megamoe-ep-bench: the expert-parallel forward (cuda/layer/ep_layer.h) of P
// ranks in one process, one GPU each when there are enough (else ranks share
// GPUs: a smoke run, not a measurement), against the same per-GPU expert work
// without communication: the one-GPU layer over T tokens and E / P experts.
// Also the dispatch push alone, as GB/s per rank of rows sent to other ranks,
// and the combine's return alone (the copy kernel, combine_push, moving every
// route's row to its source: in the layer the GEMM epilogue stores them
// instead, overlapped), as GB/s of rows rank 0 returns to other ranks (the
// kernel also copies the routes of its own tokens, locally, in that time).
// Each timing: per rank, CUDA events around its part; the slowest rank's
// time; the median over iterations after warm-up. Table and JSON.
// Forward + backward too (the nine EP phases against the one-GPU layer's
// forward and backward on the same per-GPU work, fp32 weight gradients):
// with --world 1 that ratio is the EP path's own cost, no NVLink involved.
// bench/ep_compare.py times forward + backward through PyTorch.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/layer_buffers.h"
#include "cuda/comm/combine.h"
#include "cuda/comm/dispatch.h"
#include "cuda/comm/peer_memory.h"
#include "cuda/layer/ep_layer.h"
#include "cuda/layer/one_gpu_layer.h"
#include "bench_options.h"
#include "megamoe/presets.h"
#include "testing/device_layer.h"
#include "testing/random_layer.h"

namespace {

using namespace megamoe;

int fail(const Status& st) {
  std::fprintf(stderr, "megamoe-ep-bench: %s\n", st.to_string().c_str());
  return 2;
}

#define BENCH_CHECK(expr)             \
  do {                                \
    const ::megamoe::Status s_ = (expr); \
    if (!s_.ok()) return fail(s_);    \
  } while (0)

Status cuda_ok(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::Ok() : internal_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct Bytes {  // a device allocation, zeroed, freed on its device
  void* p = nullptr;
  int device = 0;
  Status make(size_t n, int dev) {
    device = dev;
    MEGAMOE_RETURN_IF_ERROR(cuda_ok(cudaSetDevice(dev), "cudaSetDevice"));
    MEGAMOE_RETURN_IF_ERROR(cuda_ok(cudaMalloc(&p, n), "cudaMalloc"));
    return cuda_ok(cudaMemset(p, 0, n), "cudaMemset");
  }
  ~Bytes() {
    if (p != nullptr) cudaSetDevice(device), cudaFree(p);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> opt = {{"preset", "qwen3-30b-a3b"}, {"tokens", "16384"}, {"world", "2"},
                                            {"routing", "uniform"},      {"iters", "20"},      {"warmup", "3"},
                                            {"json", ""}};
  if (!bench::parse_options(argc, argv, &opt,
                            "megamoe-ep-bench [--preset " + preset_names() +
                                "] [--tokens N per rank] [--world P] [--routing uniform|skewed] [--iters N] "
                                "[--warmup N] [--json PATH]"))
    return 2;
  const ModelPreset* shape = find_preset(opt["preset"]);
  if (shape == nullptr) return fail(invalid_argument("unknown preset '" + opt["preset"] + "'"));
  const int P = std::atoi(opt["world"].c_str()), iters = std::atoi(opt["iters"].c_str()),
            warmup = std::atoi(opt["warmup"].c_str());
  const int64_t T = std::atoll(opt["tokens"].c_str());
  if (P < 1 || P > 8 || shape->num_experts % P != 0)
    return fail(invalid_argument("--world " + opt["world"] + ": 1 to 8, dividing the preset's experts"));
  if (opt["routing"] != "uniform" && opt["routing"] != "skewed")
    return fail(invalid_argument("--routing " + opt["routing"] + ": uniform or skewed"));
  const int E = shape->num_experts, L = E / P, k = shape->top_k;
  const int64_t H = shape->hidden, I = shape->intermediate;
  int gpus = 0;
  BENCH_CHECK(cuda_ok(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount"));
  std::vector<int> devices(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devices[static_cast<size_t>(r)] = gpus >= P ? r : r % std::max(gpus, 1);
  const bool shared = gpus < P;

  cuda::DispatchLayout layout;
  layout.world = P, layout.max_tokens = T, layout.hidden = H, layout.top_k = k;
  std::unique_ptr<cuda::PeerGroup> group;
  BENCH_CHECK(cuda::make_one_process_group(devices, layout.bytes(), &group));

  // Per rank: its batch (T tokens routed over all E experts; its own expert
  // weights are rows [r L, (r + 1) L) of a full set), buffers and calls.
  MoeProblem p;
  p.num_tokens = T, p.hidden = H, p.intermediate = I, p.num_experts = E, p.top_k = k, p.max_tokens_per_rank = T;
  MoeProblem pa = p;  // the no-communication baseline's problem: the rank's experts only
  pa.num_experts = L;
  struct Rank {
    testing::DeviceLayer dev, alone_dev;
    Bytes scratch, ep_scratch, alone_scratch, return_rows, saved, ep_saved, alone_saved;
    cuda::LayerCall call, alone_call;
    MoeBuffers buffers, alone_buffers;            // with their saved buffers: forward + backward
    MoeBuffers forward_only, alone_forward_only;  // without: the forward alone
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  std::vector<std::unique_ptr<Rank>> ranks;
  cuda::EpGroup probe;
  probe.layout = layout, probe.num_experts = E;
  const LayerDims owner = cuda::ep_owner_dims(probe, I);
  LayerDims alone;  // the same per-GPU expert work, no communication
  alone.tokens = T, alone.hidden = H, alone.intermediate = I, alone.num_experts = L, alone.top_k = k;
  for (int r = 0; r < P; ++r) {
    auto R = std::make_unique<Rank>();
    const int d = devices[static_cast<size_t>(r)];
    testing::LayerSpec spec;
    spec.problem = p, spec.seed = 500 + static_cast<uint64_t>(r), spec.rank = r;
    spec.routing = opt["routing"] == "skewed" ? testing::Routing::kOneExpert : testing::Routing::kUniform;
    BENCH_CHECK(testing::make_device_layer(p, testing::make_layer_data(spec), DType::kF32, d, &R->dev));
    spec.problem = pa;  // T tokens routed the same way over this rank's L experts alone
    BENCH_CHECK(testing::make_device_layer(pa, testing::make_layer_data(spec), DType::kF32, d, &R->alone_dev));
    // Scratch for either use: holding the plan (forward alone) or not (its saved buffer does).
    ScratchLayout sl, sl_saved, sa, sa_saved;
    SavedLayout sv, sva;
    BENCH_CHECK(scratch_layout(owner, true, &sl, true));
    BENCH_CHECK(scratch_layout(owner, false, &sl_saved, true));
    BENCH_CHECK(scratch_layout(alone, true, &sa));
    BENCH_CHECK(scratch_layout(alone, false, &sa_saved));
    BENCH_CHECK(saved_layout(owner, &sv));
    BENCH_CHECK(saved_layout(alone, &sva));
    sl.bytes_without_slots = std::max(sl.bytes_without_slots, sl_saved.bytes_without_slots);
    sa.bytes = std::max(sa.bytes, sa_saved.bytes);
    BENCH_CHECK(R->scratch.make(sl.bytes_without_slots, d));
    BENCH_CHECK(R->saved.make(sv.bytes, d));
    BENCH_CHECK(R->ep_saved.make(cuda::ep_saved_layout(layout).bytes, d));
    BENCH_CHECK(R->alone_saved.make(sva.bytes, d));
    BENCH_CHECK(R->ep_scratch.make(cuda::ep_scratch_layout(layout).bytes, d));
    BENCH_CHECK(R->return_rows.make(static_cast<size_t>(k) * P * T * H * 2, d));  // combine_push's source [k][V][H]
    BENCH_CHECK(R->alone_scratch.make(sa.bytes, d));
    R->buffers.scratch = R->scratch.p, R->buffers.scratch_bytes = sl.bytes_without_slots;
    R->alone_buffers.scratch = R->alone_scratch.p, R->alone_buffers.scratch_bytes = sa.bytes;
    R->forward_only = R->buffers, R->alone_forward_only = R->alone_buffers;
    R->buffers.saved = R->saved.p, R->buffers.saved_bytes = sv.bytes;
    R->alone_buffers.saved = R->alone_saved.p, R->alone_buffers.saved_bytes = sva.bytes;
    BENCH_CHECK(cuda::prepare_layer_call(owner, d, nullptr, R->buffers, &R->call, true));
    BENCH_CHECK(cuda::prepare_layer_call(alone, d, nullptr, R->alone_buffers, &R->alone_call));
    BENCH_CHECK(cuda_ok(cudaEventCreate(&R->start), "cudaEventCreate"));
    BENCH_CHECK(cuda_ok(cudaEventCreate(&R->stop), "cudaEventCreate"));
    ranks.push_back(std::move(R));
  }
  auto grads = [&](int r, bool alone_work) {
    const testing::DeviceLayer& D = alone_work ? ranks[static_cast<size_t>(r)]->alone_dev : ranks[static_cast<size_t>(r)]->dev;
    const int64_t e0 = alone_work ? 0 : int64_t{r} * L;
    cuda::LayerGrads g;
    g.dx = D.dx.view().data, g.d_topk_weights = static_cast<float*>(D.d_topk_weights.view().data);
    g.dw13 = static_cast<float*>(D.dw13.view().data) + e0 * 2 * I * H;
    g.dw2 = static_cast<float*>(D.dw2.view().data) + e0 * H * I;
    g.wgrad_f32 = true, g.accumulate = false;
    return g;
  };
  auto inputs = [&](int r, bool alone_work) {
    const testing::DeviceLayer& D = alone_work ? ranks[static_cast<size_t>(r)]->alone_dev : ranks[static_cast<size_t>(r)]->dev;
    const int64_t e0 = alone_work ? 0 : int64_t{r} * L;
    return cuda::LayerInputs{D.x.view().data, static_cast<const int32_t*>(D.topk_idx.view().data),
                             static_cast<const float*>(D.topk_weights.view().data),
                             static_cast<const uint16_t*>(D.w13.view().data) + e0 * 2 * I * H,
                             static_cast<const uint16_t*>(D.w2.view().data) + e0 * H * I};
  };

  // Times `phases` (each enqueues one phase for one rank) run phase-major;
  // returns the slowest rank's milliseconds per iteration, median.
  uint32_t epoch = 0;
  Status st;
  // epochs: a forward takes one, a forward + backward three.
  auto timed = [&](int n_phases, const std::function<Status(int phase, int r)>& phase, uint32_t epochs = 1) {
    std::vector<double> samples;
    for (int it = 0; it < warmup + iters && st.ok(); ++it) {
      epoch += epochs;
      for (int r = 0; r < P && st.ok(); ++r) {
        st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
        if (st.ok()) st = cuda_ok(cudaEventRecord(ranks[static_cast<size_t>(r)]->start, nullptr), "record");
      }
      for (int ph = 0; ph < n_phases && st.ok(); ++ph)
        for (int r = 0; r < P && st.ok(); ++r) {
          st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
          if (st.ok()) st = phase(ph, r);
        }
      double worst = 0;
      for (int r = 0; r < P && st.ok(); ++r) {
        Rank& R = *ranks[static_cast<size_t>(r)];
        st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
        if (st.ok()) st = cuda_ok(cudaEventRecord(R.stop, nullptr), "record");
        if (st.ok()) st = cuda_ok(cudaEventSynchronize(R.stop), "sync");
        float ms = 0;
        if (st.ok()) st = cuda_ok(cudaEventElapsedTime(&ms, R.start, R.stop), "elapsed");
        worst = std::max(worst, static_cast<double>(ms));
      }
      if (it >= warmup) samples.push_back(worst);
    }
    return median(samples);
  };
  auto ep_of = [&](int r) {
    cuda::EpGroup ep;
    ep.view = group->view(r), ep.layout = layout, ep.num_experts = E, ep.epoch = epoch;
    ep.scratch = ranks[static_cast<size_t>(r)]->ep_scratch.p;
    return ep;
  };
  // Rank r's forward phase ph (1: experts, 2: combine) of a call that keeps nothing.
  auto forward_phase = [&](int ph, int r) {
    Rank& R = *ranks[static_cast<size_t>(r)];
    cuda::EpCall c;
    MEGAMOE_RETURN_IF_ERROR(cuda::make_ep_call(R.call, ep_of(r), inputs(r, false), T, R.forward_only, nullptr, &c));
    if (ph == 0) return cuda::ep_forward_send(c);
    if (ph == 1) return cuda::ep_forward_experts(c);
    return cuda::ep_forward_combine(c, R.dev.y.view().data);
  };
  auto ep_forward_ms = [&] { return timed(3, forward_phase); };
  // Forward + backward: epochs e (forward), e + 1 (dy, the returns) and e + 2 (x again).
  auto ep_fwd_bwd_ms = [&] {
    return timed(
        9,
        [&](int ph, int r) {
          Rank& R = *ranks[static_cast<size_t>(r)];
          const cuda::LayerInputs in = inputs(r, false);
          const cuda::LayerGrads g = grads(r, false);
          cuda::EpGroup ep = ep_of(r);  // `epoch` is the last of the three
          ep.epoch = ph < 3 ? epoch - 2 : epoch - 1;
          cuda::EpCall c;
          MEGAMOE_RETURN_IF_ERROR(cuda::make_ep_call(R.call, ep, in, T, R.buffers, R.ep_saved.p, &c));
          return cuda::run_ep_phase(c, ph, R.dev.y.view().data, R.dev.dy.view().data, g);
        },
        3);
  };
  const double ep_ms = ep_forward_ms(), ep_fb_ms = ep_fwd_bwd_ms();
  // Waits for every rank's stop event; the slowest rank's start-to-stop ms.
  auto slowest_rank_ms = [&] {
    double worst = 0;
    for (int r = 0; r < P && st.ok(); ++r) {
      Rank& R = *ranks[static_cast<size_t>(r)];
      st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
      float ms = 0;
      if (st.ok()) st = cuda_ok(cudaEventSynchronize(R.stop), "sync");
      if (st.ok()) st = cuda_ok(cudaEventElapsedTime(&ms, R.start, R.stop), "elapsed");
      worst = std::max(worst, static_cast<double>(ms));
    }
    return worst;
  };
  // The dispatch alone (the NVLink push and the routing, without the send's
  // routing check and own-slot copy: the rows' y is not looked at here),
  // then the rest of the forward so that the buffer's protocol stays in step
  // (only the push is inside the events).
  std::vector<double> push_ms;
  {
    const cuda::EpScratchLayout esl = cuda::ep_scratch_layout(layout);
    std::vector<double> samples;
    for (int it = 0; it < warmup + iters && st.ok(); ++it) {
      ++epoch;
      for (int r = 0; r < P && st.ok(); ++r) {
        Rank& R = *ranks[static_cast<size_t>(r)];
        const cuda::LayerInputs in = inputs(r, false);
        cuda::DispatchArgs a;
        a.x = in.x, a.topk_idx = in.topk_idx, a.topk_weights = in.topk_weights, a.tokens = T;
        a.experts_per_rank = L, a.epoch = epoch;
        a.blocks_done = reinterpret_cast<uint32_t*>(static_cast<char*>(R.ep_scratch.p) + esl.dispatch_done);
        st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
        if (st.ok()) st = cuda_ok(cudaEventRecord(R.start, nullptr), "record");
        if (st.ok()) st = cuda::dispatch_push(group->view(r), layout, a, nullptr);
        if (st.ok()) st = cuda_ok(cudaEventRecord(R.stop, nullptr), "record");
      }
      for (int ph = 1; ph < 3 && st.ok(); ++ph)
        for (int r = 0; r < P && st.ok(); ++r) {
          st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
          if (st.ok()) st = forward_phase(ph, r);
        }
      if (it >= warmup) samples.push_back(slowest_rank_ms());
    }
    push_ms.push_back(median(samples));
  }
  // The return alone: the rows of every route each owner computed in the last
  // forward (its routing is still in the EP scratch) copied to their sources.
  double return_ms = 0;
  {
    const cuda::EpScratchLayout sl = cuda::ep_scratch_layout(layout);
    std::vector<double> samples;
    for (int it = 0; it < warmup + iters && st.ok(); ++it) {
      for (int r = 0; r < P && st.ok(); ++r) {
        Rank& R = *ranks[static_cast<size_t>(r)];
        auto* base = static_cast<char*>(R.ep_scratch.p);
        cuda::CombineArgs ca;
        ca.outputs = R.return_rows.p;
        ca.virtual_idx = reinterpret_cast<const int32_t*>(base + sl.virtual_idx);
        ca.source_counts = reinterpret_cast<const int64_t*>(base + sl.source_counts);
        ca.epoch = epoch, ca.blocks_done = reinterpret_cast<uint32_t*>(base + sl.combine_done);
        st = cuda_ok(cudaSetDevice(devices[static_cast<size_t>(r)]), "cudaSetDevice");
        if (st.ok()) st = cuda_ok(cudaEventRecord(R.start, nullptr), "record");
        if (st.ok()) st = cuda::combine_push(group->view(r), layout, ca, nullptr);
        if (st.ok()) st = cuda_ok(cudaEventRecord(R.stop, nullptr), "record");
      }
      if (it >= warmup) samples.push_back(slowest_rank_ms());
    }
    return_ms = median(samples);
  }
  // The same expert work per GPU without communication: T tokens, k routes
  // each, over L experts (uniform, or slot 0 on one hot expert when skewed).
  const double alone_ms = timed(1, [&](int, int r) {
    Rank& R = *ranks[static_cast<size_t>(r)];
    return cuda::layer_forward(R.alone_call, inputs(r, true), R.alone_dev.y.view().data, R.alone_forward_only);
  });
  const double alone_fb_ms = timed(2, [&](int ph, int r) {
    Rank& R = *ranks[static_cast<size_t>(r)];
    if (ph == 0) return cuda::layer_forward(R.alone_call, inputs(r, true), R.alone_dev.y.view().data, R.alone_buffers);
    return cuda::layer_backward(R.alone_call, inputs(r, true), R.alone_dev.dy.view().data, grads(r, true),
                                R.alone_buffers);
  });
  for (int r = 0; r < P && st.ok(); ++r) st = check_device_errors(devices[static_cast<size_t>(r)], nullptr);
  if (!st.ok()) return fail(st);

  // Rows each rank sends to other ranks (once per token and destination).
  double sent_rows = 0;
  {
    testing::HostTensor idx(DType::kI32, {T, static_cast<int64_t>(k)});
    BENCH_CHECK(cuda_ok(cudaSetDevice(devices[0]), "cudaSetDevice"));
    BENCH_CHECK(ranks[0]->dev.topk_idx.download(&idx));
    const auto* ids = static_cast<const int32_t*>(idx.view.data);
    for (int64_t t = 0; t < T; ++t) {
      uint32_t to = 0;
      for (int j = 0; j < k; ++j)
        if (ids[t * k + j] >= 0) to |= 1u << (ids[t * k + j] / L);
      to &= ~1u;  // rank 0 itself
      sent_rows += __builtin_popcount(to);
    }
  }
  const double sent_gb = sent_rows * static_cast<double>(H) * 2 / 1e9;
  // Rows rank 0 returns to other ranks: the routes of their tokens to its experts [0, L).
  double returned_rows = 0;
  for (int s = 1; s < P; ++s) {
    testing::HostTensor idx(DType::kI32, {T, static_cast<int64_t>(k)});
    BENCH_CHECK(cuda_ok(cudaSetDevice(devices[static_cast<size_t>(s)]), "cudaSetDevice"));
    BENCH_CHECK(ranks[static_cast<size_t>(s)]->dev.topk_idx.download(&idx));
    const auto* ids = static_cast<const int32_t*>(idx.view.data);
    for (int64_t i = 0; i < T * k; ++i) returned_rows += ids[i] >= 0 && ids[i] < L;
  }
  const double returned_gb = returned_rows * static_cast<double>(H) * 2 / 1e9;
  std::printf("megamoe-ep-bench: %s, %d ranks on GPUs%s, %lld tokens per rank, %s routing (medians of %d after %d)\n",
              shape->name, P, shared ? " SHARED (not a measurement)" : "", static_cast<long long>(T),
              opt["routing"].c_str(), iters, warmup);
  std::printf("%-34s %10s\n", "", "ms");
  std::printf("%-34s %10.3f\n", "EP forward (slowest rank)", ep_ms);
  std::printf("%-34s %10.3f\n", "no communication, T tokens, E/P", alone_ms);
  std::printf("%-34s %10.3f  (%.3f)\n", "ratio EP / no communication", ep_ms / alone_ms, ep_ms / alone_ms);
  std::printf("%-34s %10.3f\n", "EP forward+backward", ep_fb_ms);
  std::printf("%-34s %10.3f\n", "no communication, fwd+bwd", alone_fb_ms);
  std::printf("%-34s %10.3f\n", "ratio EP / no comm., fwd+bwd", ep_fb_ms / alone_fb_ms);
  std::printf("%-34s %10.3f  %.1f GB/s (rank 0 sends %.3f GB)\n", "dispatch push alone", push_ms[0],
              sent_gb / (push_ms[0] / 1e3), sent_gb);
  std::printf("%-34s %10.3f  %.1f GB/s (rank 0 returns %.3f GB)\n", "combine return alone (copy)", return_ms,
              returned_gb / (return_ms / 1e3), returned_gb);
  if (!opt["json"].empty()) {
    FILE* f = std::fopen(opt["json"].c_str(), "w");
    if (f != nullptr) {
      std::fprintf(f,
                   "{\"preset\": \"%s\", \"world\": %d, \"shared_gpus\": %s, \"tokens_per_rank\": %lld, "
                   "\"routing\": \"%s\", \"ep_forward_ms\": %.4f, \"no_comm_forward_ms\": %.4f, "
                   "\"ep_fwd_bwd_ms\": %.4f, \"no_comm_fwd_bwd_ms\": %.4f, "
                   "\"dispatch_ms\": %.4f, \"dispatch_gb\": %.4f, \"return_ms\": %.4f, \"return_gb\": %.4f}\n",
                   shape->name, P, shared ? "true" : "false", static_cast<long long>(T), opt["routing"].c_str(), ep_ms,
                   alone_ms, ep_fb_ms, alone_fb_ms, push_ms[0], sent_gb, return_ms, returned_gb);
      std::fclose(f);
    }
  }
  return 0;
}
