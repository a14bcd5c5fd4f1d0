// megamoe-gemm-bench: the layer's six grouped GEMMs on their own (forward
// kGateUp, kDown; backward kDownGrad, kGateUpGrad and the weight gradients
// dW2, dW13), each built exactly as the layer builds it (cuda/layer/
// layer_gemms.h: the same operands, epilogues, tile order and side jobs), in
// bf16 and in FP8 (e4m3 with the recipe's scales, quantised beforehand by the
// layer's quantizers), plus the quantize and pool passes that feed them, at a
// preset's shape with uniform random routing. CUDA-event medians after
// warm-up; TFLOP/s counts real routes only (2 * routes * N * K).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench_options.h"
#include "cuda/common/cuda_status.h"
#include "cuda/fp8/quantize.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/layer/call_buffers.h"
#include "cuda/layer/fp8_weights.h"
#include "cuda/layer/layer_gemms.h"
#include "cuda/layer/layer_kernels.h"
#include "cuda/plan/device_plan.h"
#include "cuda_check.h"
#include "megamoe/presets.h"

namespace {

using namespace megamoe;

#define CHECK_CUDA(x) MEGAMOE_BENCH_CHECK_CUDA("megamoe-gemm-bench", x)
#define CHECK_OK(x)                                                                    \
  do {                                                                                 \
    const Status s_ = (x);                                                             \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "megamoe-gemm-bench: %s: %s\n", #x, s_.to_string().c_str()); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Random bf16 values in [-scale, scale) into `d` (bits built on the host, one upload).
void fill_bf16(void* d, size_t n, float scale, uint32_t seed) {
  std::vector<uint16_t> h(n);
  uint32_t s = seed;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = scale * (static_cast<float>(s >> 8) / 8388608.0f - 1.0f);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    h[i] = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  CHECK_CUDA(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}
void* random_bf16(size_t n, float scale, uint32_t seed) {
  void* d = dev_alloc<uint16_t>(n);
  fill_bf16(d, n, scale, seed);
  return d;
}

double median_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// k distinct experts per token, uniformly.
std::vector<int32_t> uniform_routing(int64_t T, int k, int E) {
  std::vector<int32_t> idx(static_cast<size_t>(T * k));
  uint32_t s = 12345;
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      int32_t e;
      bool again;
      do {
        s = s * 1664525u + 1013904223u;
        e = static_cast<int32_t>((s >> 8) % static_cast<uint32_t>(E));
        again = false;
        for (int q = 0; q < j; ++q) again |= idx[t * k + q] == e;
      } while (again);
      idx[t * k + j] = e;
    }
  return idx;
}

// One layer call's buffers, carved as the layer carves them, with random
// pools (the GEMMs' inputs) and, for an FP8 precision, the e4m3 operands
// and weights the layer's quantizers make of them.
struct Layer {
  cuda::LayerCall call;
  cuda::CallBuffers buf;
  void *x, *dy, *w13, *w2, *dx;
  float* topk_w;
  int32_t* topk_idx;
  cuda::LayerGrads grads;
};

Layer make_layer(const LayerDims& d, const std::vector<int32_t>& idx) {
  Layer L;
  const int64_t T = d.tokens, H = d.hidden, I = d.intermediate, E = d.num_experts;
  ScratchLayout sl;
  SavedLayout saved;
  Fp8WeightLayout wl;
  CHECK_OK(scratch_layout(d, false, &sl));
  CHECK_OK(saved_layout(d, &saved));
  CHECK_OK(fp8_weight_layout(d, &wl));
  MoeBuffers b;
  b.scratch = dev_alloc<uint8_t>(sl.bytes), b.scratch_bytes = sl.bytes;
  b.saved = dev_alloc<uint8_t>(saved.bytes), b.saved_bytes = saved.bytes;
  if (wl.bytes > 0) b.fp8_weights = dev_alloc<uint8_t>(wl.bytes), b.fp8_weights_bytes = wl.bytes;
  CHECK_OK(cuda::prepare_layer_call(d, 0, nullptr, b, &L.call));
  CHECK_OK(cuda::carve_call_buffers(L.call, b, &L.buf));
  L.topk_idx = dev_alloc<int32_t>(idx.size());
  CHECK_CUDA(cudaMemcpy(L.topk_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> w(idx.size(), 1.0f / static_cast<float>(d.top_k));
  L.topk_w = dev_alloc<float>(w.size());
  CHECK_CUDA(cudaMemcpy(L.topk_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CHECK_OK(cuda::build_device_plan(L.topk_idx, T, d.top_k, d.num_experts, L.buf.plan, nullptr));
  L.x = random_bf16(T * H, 1.0f, 1), L.dy = random_bf16(T * H, 1.0f, 9), L.dx = dev_alloc<uint16_t>(T * H);
  L.w13 = random_bf16(E * 2 * I * H, 0.03f, 2), L.w2 = random_bf16(E * H * I, 0.03f, 4);
  const int64_t C = L.buf.capacity;
  // The pools the GEMMs read: random where the layer's earlier steps would have written them.
  if (L.buf.hidden_pool != nullptr) fill_bf16(L.buf.hidden_pool, C * H, 1.0f, 3);
  fill_bf16(L.buf.a_pool, C * I, 1.0f, 5);
  fill_bf16(L.buf.z_pool, C * 2 * I, 1.0f, 6);
  fill_bf16(L.buf.dz_pool, C * 2 * I, 1.0f, 7);
  L.grads = cuda::LayerGrads{L.dx, dev_alloc<float>(idx.size()), dev_alloc<uint16_t>(E * 2 * I * H),
                             dev_alloc<uint16_t>(E * H * I), false, false};
  if (cuda::fp8_backward(d)) {
    const cuda::Fp8Scale sc = cuda::fp8_scale_of(d);
    const cuda::Fp8Operands& f = L.buf.fp8;
    const cuda::DevicePlan& p = L.buf.gemm_plan;
    CHECK_OK(cuda::fill_fp8_weights(L.call, L.buf.fp8_weights, L.w13, L.w2));
    // Each set in the layer's order would overwrite the last (they share an area); the GEMMs are
    // timed on whatever bytes are there, which is the same work.
    CHECK_OK(cuda::scatter_quantize_e4m3_rows(L.x, T, H, p.route_row, d.top_k, p.row_src, p.pool_rows, C, sc, f.x_q,
                                              f.x_s, nullptr, nullptr));
    CHECK_OK(cuda::quantize_e4m3_rows(L.buf.a_pool, C, I, sc, f.a_q, f.a_s, nullptr));
    CHECK_OK(cuda::scatter_quantize_e4m3_rows(L.dy, T, H, p.route_row, d.top_k, p.row_src, p.pool_rows, C, sc,
                                              f.dy_q, f.dy_s, nullptr, nullptr));
    CHECK_OK(cuda::quantize_e4m3_rows(L.buf.dz_pool, C, 2 * I, sc, f.dz_q, f.dz_s, nullptr));
    CHECK_OK(cuda::gather_quantize_e4m3_cols_t(L.dy, H, p.row_src, d.top_k, p.pool_rows, C, sc, f.dy_t, f.dy_ts,
                                               nullptr));
    CHECK_OK(cuda::quantize_e4m3_cols_t(L.buf.a_pool, C, I, sc, f.wa_t, f.wa_ts, nullptr));
    CHECK_OK(cuda::quantize_e4m3_cols_t(L.buf.dz_pool, C, 2 * I, sc, f.dz_t, f.dz_ts, nullptr));
    CHECK_OK(cuda::gather_quantize_e4m3_cols_t(L.x, H, p.row_src, d.top_k, p.pool_rows, C, sc, f.x_t, f.x_ts,
                                               nullptr));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return L;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> opt = {{"preset", "qwen3-30b-a3b"}, {"tokens", "16384"}, {"iters", "20"},
                                            {"warmup", "3"}};
  if (!bench::parse_options(argc, argv, &opt,
                            "megamoe-gemm-bench [--preset " + preset_names() + "] [--tokens N] [--iters N] [--warmup N]"))
    return 2;
  const ModelPreset* shape = find_preset(opt["preset"]);
  if (shape == nullptr) {
    std::fprintf(stderr, "megamoe-gemm-bench: unknown preset '%s'\n", opt["preset"].c_str());
    return 2;
  }
  LayerDims d;
  d.tokens = std::atoll(opt["tokens"].c_str()), d.hidden = shape->hidden, d.intermediate = shape->intermediate;
  d.num_experts = shape->num_experts, d.top_k = shape->top_k;
  const int iters = std::atoi(opt["iters"].c_str()), warmup = std::atoi(opt["warmup"].c_str());
  const std::vector<int32_t> idx = uniform_routing(d.tokens, d.top_k, d.num_experts);
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const double routes = static_cast<double>(d.tokens) * d.top_k, Hd = static_cast<double>(d.hidden),
               Id = static_cast<double>(d.intermediate);
  struct Row {
    std::string name;
    double ms, flops;
  };
  std::vector<Row> rows;
  auto time_gemm = [&](const std::string& name, const cuda::GroupedGemmArgs& g, double flops,
                       const cuda::GemmOverrides& o = {}) {
    const double ms = median_ms([&] { CHECK_OK(cuda::launch_grouped_gemm(g, sms, nullptr, o)); }, warmup, iters);
    CHECK_OK(cuda::sync_and_take_device_error(0, nullptr));
    rows.push_back({name, ms, flops});
  };
  auto time_pass = [&](const std::string& name, const std::function<Status()>& pass) {
    rows.push_back({name, median_ms([&] { CHECK_OK(pass()); }, warmup, iters), 0});
  };
  cuda::GemmOverrides no_epilogue;  // the main loops alone: what the epilogue costs
  no_epilogue.skip_epilogue = true;
  const double f13 = 2 * routes * 2 * Id * Hd, f2 = 2 * routes * Hd * Id;
  for (const Precision precision : {Precision::kBF16, Precision::kFP8}) {
    d.precision = precision;
    Layer L = make_layer(d, idx);
    const cuda::LayerCall& c = L.call;
    const cuda::CallBuffers& b = L.buf;
    const std::string p = precision == Precision::kFP8 ? " fp8" : " bf16";
    time_gemm("kGateUp" + p, cuda::gate_up_gemm(c, b, L.w13, b.z_pool, b.a_pool), f13);
    time_gemm("kGateUp" + p + " noepi", cuda::gate_up_gemm(c, b, L.w13, b.z_pool, b.a_pool), f13, no_epilogue);
    time_gemm("kDown" + p, cuda::down_gemm(c, b, L.w2, L.topk_w), f2);
    time_gemm("kDown" + p + " noepi", cuda::down_gemm(c, b, L.w2, L.topk_w), f2, no_epilogue);
    time_gemm("kDownGrad" + p, cuda::down_grad_gemm(c, b, L.w2, L.topk_w), f2);
    time_gemm("kDownGrad" + p + " noepi", cuda::down_grad_gemm(c, b, L.w2, L.topk_w), f2, no_epilogue);
    time_gemm("kGateUpGrad" + p, cuda::gate_up_grad_gemm(c, b, L.w13), f13);
    time_gemm("kGateUpGrad" + p + " noepi", cuda::gate_up_grad_gemm(c, b, L.w13), f13, no_epilogue);
    time_gemm("dW2" + p, cuda::down_weight_grad_gemm(c, b, L.grads), f2);
    time_gemm("dW13" + p, cuda::gate_up_weight_grad_gemm(c, b, L.grads), f13);
    if (precision == Precision::kBF16) {  // with the side jobs the layer puts in them
      // Its own A gathered, every tile held until its rows are counted in (the counts zeroed first, as the layer does).
      const cuda::GroupedGemmArgs own = cuda::gate_up_gemm(c, b, L.w13, b.z_pool, b.a_pool, L.x);
      rows.push_back({"kGateUp bf16 +gather x", median_ms([&] {
                        CHECK_CUDA(cudaMemsetAsync(own.side_gather.rows_ready, 0, b.capacity / 128 * 4, nullptr));
                        CHECK_OK(cuda::launch_grouped_gemm(own, sms, nullptr));
                      }, warmup, iters), f13});
      time_gemm("kGateUpGrad bf16 +scatter x", cuda::gate_up_grad_gemm(c, b, L.w13, nullptr, L.x), f13);
      const cuda::SideCombine dx = cuda::dx_side_combine(c, b, L.topk_idx, L.dx);
      time_gemm("dW13 bf16 +combine dx", cuda::gate_up_weight_grad_gemm(c, b, L.grads, &dx), f13);
      const cuda::DevicePlan& pl = b.gemm_plan;
      time_pass("scatter x pool", [&] {
        return cuda::scatter_rows(L.x, d.tokens, d.hidden, pl.route_row, d.top_k, pl.row_src, pl.pool_rows,
                                  b.capacity, b.hidden_pool, nullptr);
      });
      time_pass("combine dx", [&] {
        return cuda::combine_slots(b.slots, L.topk_idx, d.tokens, d.top_k, d.num_experts, d.hidden, b.plan.error_key,
                                   c.errors, L.dx, nullptr);
      });
    } else {  // the quantize passes that feed the FP8 GEMMs
      const cuda::Fp8Scale sc = cuda::fp8_scale_of(d);
      const cuda::Fp8Operands& f = b.fp8;
      const cuda::DevicePlan& pl = b.gemm_plan;
      const int64_t C = b.capacity, H = d.hidden, I = d.intermediate;
      time_pass("scatter+quantize x", [&] {
        return cuda::scatter_quantize_e4m3_rows(L.x, d.tokens, H, pl.route_row, d.top_k, pl.row_src, pl.pool_rows,
                                                C, sc, f.x_q, f.x_s, nullptr, nullptr);
      });
      time_pass("quantize a pool", [&] { return cuda::quantize_e4m3_rows(b.a_pool, C, I, sc, f.a_q, f.a_s, nullptr); });
      time_pass("quantize dz pool",
                [&] { return cuda::quantize_e4m3_rows(b.dz_pool, C, 2 * I, sc, f.dz_q, f.dz_s, nullptr); });
      time_pass("gather+quantize x cols_t", [&] {
        return cuda::gather_quantize_e4m3_cols_t(L.x, H, pl.row_src, d.top_k, pl.pool_rows, C, sc, f.x_t, f.x_ts,
                                                 nullptr);
      });
      time_pass("quantize a cols_t",
                [&] { return cuda::quantize_e4m3_cols_t(b.a_pool, C, I, sc, f.wa_t, f.wa_ts, nullptr); });
      time_pass("quantize w13 + w2", [&] { return cuda::fill_fp8_weights(c, b.fp8_weights, L.w13, L.w2); });
    }
  }
  std::printf("megamoe-gemm-bench: %s, %lld tokens, medians of %d after %d warm-ups\n", shape->name,
              static_cast<long long>(d.tokens), iters, warmup);
  std::printf("%-30s %9s %9s\n", "kernel", "us", "TFLOP/s");
  for (const Row& r : rows) {
    if (r.flops > 0)
      std::printf("%-30s %9.1f %9.1f\n", r.name.c_str(), r.ms * 1e3, r.flops / (r.ms * 1e9));
    else
      std::printf("%-30s %9.1f %9s\n", r.name.c_str(), r.ms * 1e3, "-");
  }
  return 0;
}
