// megamoe-gemm-bench: the layer's six grouped GEMMs on their own (forward
// kGateUp, kDown; backward kDownGrad, kGateUpGrad and the weight gradients
// dW2, dW13), bf16 (as the layer runs them) against FP8 (e4m3, the recipe's
// scales: the backward's weights as the block quantizer's transposed copy,
// the weight-gradient operands per 128 tokens of each channel, transposed),
// with the quantize passes that feed FP8 today, at a preset's shape with
// uniform random routing. CUDA-event
// medians after warm-up; TFLOP/s counts real routes only (2 * routes * N * K).
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
#include "cuda_check.h"
#include "cuda/common/device_errors.h"
#include "cuda/fp8/quantize.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/layer_kernels.h"
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
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

// Random bf16 values in [-scale, scale) (bits built on the host, one upload).
uint16_t* random_bf16(size_t n, float scale, uint32_t seed) {
  std::vector<uint16_t> h(n);
  uint32_t s = seed;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = scale * (static_cast<float>(s >> 8) / 8388608.0f - 1.0f);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    h[i] = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  auto* d = dev_alloc<uint16_t>(n);
  CHECK_CUDA(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
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
  const int64_t T = std::atoll(opt["tokens"].c_str()), H = shape->hidden, I = shape->intermediate;
  const int E = shape->num_experts, k = shape->top_k;
  const int iters = std::atoi(opt["iters"].c_str()), warmup = std::atoi(opt["warmup"].c_str());
  const int64_t C = (T * k + static_cast<int64_t>(E) * 127 + 127) / 128 * 128;

  // Uniform routing: k distinct experts per token.
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
  auto* d_idx = dev_alloc<int32_t>(idx.size());
  CHECK_CUDA(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> w(static_cast<size_t>(T * k), 1.0f / static_cast<float>(k));
  auto* d_w = dev_alloc<float>(w.size());
  CHECK_CUDA(cudaMemcpy(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));

  cuda::DevicePlanBuffers pb;
  pb.error_key = reinterpret_cast<unsigned long long*>(dev_alloc<int32_t>(4));
  pb.chunk_counts = dev_alloc<int32_t>(static_cast<size_t>(E) * (T / 256 + 1));
  pb.expert_rows = dev_alloc<int32_t>(E);
  pb.expert_offset = dev_alloc<int32_t>(E + 1);
  pb.tile_expert = dev_alloc<int32_t>(C / 128);
  pb.route_row = dev_alloc<int32_t>(T * k);
  pb.row_src = dev_alloc<int32_t>(C);
  CHECK_OK(cuda::build_device_plan(d_idx, T, k, E, pb, nullptr));
  cuda::DevicePlan plan;
  plan.pool_rows = pb.expert_offset + E;
  plan.tile_expert = pb.tile_expert, plan.expert_offset = pb.expert_offset, plan.expert_rows = pb.expert_rows;
  plan.row_src = pb.row_src;
  plan.num_tokens = static_cast<int>(T), plan.top_k = k, plan.num_experts = E;

  // Operands (bf16) and their FP8 forms.
  uint16_t* x = random_bf16(C * H, 1.0f, 1);
  uint16_t* w13 = random_bf16(E * 2 * I * H, 0.03f, 2);
  uint16_t* a = random_bf16(C * I, 1.0f, 3);
  uint16_t* w2 = random_bf16(E * H * I, 0.03f, 4);
  auto* qx = dev_alloc<uint8_t>(C * H);
  auto* sx = dev_alloc<float>(C * H / 128);
  auto* qw13 = dev_alloc<uint8_t>(E * 2 * I * H);
  auto* sw13 = dev_alloc<float>(E * 2 * I * H / (128 * 128));
  auto* qa = dev_alloc<uint8_t>(C * I);
  auto* sa = dev_alloc<float>(C * I / 128);
  auto* qw2 = dev_alloc<uint8_t>(E * H * I);
  auto* qw2_t = dev_alloc<uint8_t>(E * H * I);     // [E, I, H]: kDownGrad's K-major B
  auto* qw13_t = dev_alloc<uint8_t>(E * 2 * I * H);  // [E, H, 2I]: kGateUpGrad's K-major B
  auto* sw2 = dev_alloc<float>(E * H * I / (128 * 128));
  const auto kScale = cuda::Fp8Scale::kFloat32;
  CHECK_OK(cuda::quantize_e4m3_blocks(w13, E, 2 * I, H, kScale, qw13, qw13_t, sw13, nullptr));
  CHECK_OK(cuda::quantize_e4m3_blocks(w2, E, H, I, kScale, qw2, qw2_t, sw2, nullptr));
  CHECK_OK(cuda::quantize_e4m3_rows(x, C, H, kScale, qx, sx, nullptr));
  CHECK_OK(cuda::quantize_e4m3_rows(a, C, I, kScale, qa, sa, nullptr));
  auto* z = dev_alloc<uint16_t>(C * 2 * I);
  auto* a_out = dev_alloc<uint16_t>(C * I);
  auto* slots = dev_alloc<uint16_t>(static_cast<size_t>(k) * T * H);
  auto* y_pool = dev_alloc<uint16_t>(static_cast<size_t>(C) * H);  // kDown's rows in pool order (down_to_pool)
  // The backward's: dy pool (x's values stand in), the saved z, dz (kDownGrad's
  // output, kGateUpGrad's input: random here) and its FP8 rows.
  uint16_t* z_saved = random_bf16(C * 2 * I, 1.0f, 5);
  uint16_t* dz = random_bf16(C * 2 * I, 1.0f, 6);
  auto* dz_out = dev_alloc<uint16_t>(C * 2 * I);
  auto* wa = dev_alloc<uint16_t>(C * I);
  auto* dw_partial = dev_alloc<float>(C * (I / 128));
  auto* qdz = dev_alloc<uint8_t>(C * 2 * I);
  auto* sdz = dev_alloc<float>(C * 2 * I / 128);
  CHECK_OK(cuda::quantize_e4m3_rows(dz, C, 2 * I, kScale, qdz, sdz, nullptr));
  // The same scales by k-block ([K / 128, C]: GroupedGemmArgs::a_scales_by_k_block); the e4m3 bytes are the same.
  auto* sx_kb = dev_alloc<float>(C * H / 128);
  auto* sa_kb = dev_alloc<float>(C * I / 128);
  auto* sdz_kb = dev_alloc<float>(C * 2 * I / 128);
  const auto kByKBlock = cuda::RowScales::kByKBlock;
  CHECK_OK(cuda::quantize_e4m3_rows(x, C, H, kScale, qx, sx_kb, nullptr, kByKBlock));
  CHECK_OK(cuda::quantize_e4m3_rows(a, C, I, kScale, qa, sa_kb, nullptr, kByKBlock));
  CHECK_OK(cuda::quantize_e4m3_rows(dz, C, 2 * I, kScale, qdz, sdz_kb, nullptr, kByKBlock));
  // Weight gradients: dW2 = dy^T (w a) (x stands in for dy), dW13 = dz^T x; bf16 outputs.
  auto* dw_out = dev_alloc<uint16_t>(static_cast<size_t>(E) * 2 * I * H);
  auto* xq_t = dev_alloc<uint8_t>(C * H);
  auto* xs_t = dev_alloc<float>(C / 128 * H);
  auto* aq_t = dev_alloc<uint8_t>(C * I);
  auto* as_t = dev_alloc<float>(C / 128 * I);
  auto* dzq_t = dev_alloc<uint8_t>(C * 2 * I);
  auto* dzs_t = dev_alloc<float>(C / 128 * 2 * I);
  CHECK_OK(cuda::quantize_e4m3_cols_t(x, C, H, kScale, xq_t, xs_t, nullptr));
  CHECK_OK(cuda::quantize_e4m3_cols_t(a, C, I, kScale, aq_t, as_t, nullptr));
  CHECK_OK(cuda::quantize_e4m3_cols_t(dz, C, 2 * I, kScale, dzq_t, dzs_t, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());

  cuda::DeviceErrorSink errors;
  CHECK_OK(cuda::device_error_sink(0, &errors));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;

  auto gate_up = [&](bool fp8) {
    cuda::GroupedGemmArgs g;
    g.mode = cuda::GemmMode::kGateUp, g.plan = plan, g.n = I, g.k = H, g.intermediate = I, g.errors = errors;
    g.fp8 = fp8;
    g.a = fp8 ? static_cast<const void*>(qx) : x, g.a_rows = C, g.a_cols = H, g.a_scales = sx;
    g.b = fp8 ? static_cast<const void*>(qw13) : w13, g.b_rows = E * 2 * I, g.b_cols = H, g.b_scales = sw13;
    g.out0 = z, g.out1 = a_out;
    return g;
  };
  auto down = [&](bool fp8) {
    cuda::GroupedGemmArgs g;
    g.mode = cuda::GemmMode::kDown, g.plan = plan, g.n = H, g.k = I, g.intermediate = I, g.errors = errors;
    g.fp8 = fp8;
    g.a = fp8 ? static_cast<const void*>(qa) : a, g.a_rows = C, g.a_cols = I, g.a_scales = sa;
    g.b = fp8 ? static_cast<const void*>(qw2) : w2, g.b_rows = E * H, g.b_cols = I, g.b_scales = sw2;
    g.topk_weights = d_w, g.out0 = slots;
    return g;
  };
  auto down_grad = [&](bool fp8) {  // bf16: w2 MN-major as [E*H, I]; FP8: its transposed copy [E*I, H]
    cuda::GroupedGemmArgs g;
    g.mode = cuda::GemmMode::kDownGrad, g.plan = plan, g.n = I, g.k = H, g.intermediate = I, g.errors = errors;
    g.fp8 = fp8, g.b_k_major = fp8;
    g.a = fp8 ? static_cast<const void*>(qx) : x, g.a_rows = C, g.a_cols = H, g.a_scales = sx;
    g.b = fp8 ? static_cast<const void*>(qw2_t) : w2, g.b_scales = sw2;
    g.b_rows = fp8 ? E * I : E * H, g.b_cols = fp8 ? H : I;
    g.topk_weights = d_w, g.z_pool = z_saved, g.out0 = dz_out, g.out1 = wa, g.dw_partial = dw_partial;
    return g;
  };
  auto gate_up_grad = [&](bool fp8) {  // bf16: w13 MN-major as [E*2I, H]; FP8: its transposed copy [E*H, 2I]
    cuda::GroupedGemmArgs g;
    g.mode = cuda::GemmMode::kGateUpGrad, g.plan = plan, g.n = H, g.k = 2 * I, g.intermediate = I, g.errors = errors;
    g.fp8 = fp8, g.b_k_major = fp8;
    g.a = fp8 ? static_cast<const void*>(qdz) : dz, g.a_rows = C, g.a_cols = 2 * I, g.a_scales = sdz;
    g.b = fp8 ? static_cast<const void*>(qw13_t) : w13, g.b_scales = sw13;
    g.b_rows = fp8 ? E * H : E * 2 * I, g.b_cols = fp8 ? 2 * I : H;
    g.out0 = slots;
    return g;
  };
  // dW[e] = A^T B over the expert's pool rows: bf16 reads both pools MN-major,
  // FP8 their transposed column-quantised copies.
  auto wgrad = [&](bool fp8, int64_t m, int64_t n, const void* a16, const void* b16, const uint8_t* aq, const float* as,
                   const uint8_t* bq, const float* bs) {
    cuda::GroupedGemmArgs g;
    g.mode = cuda::GemmMode::kWeightGrad, g.plan = plan, g.m = m, g.n = n, g.errors = errors, g.fp8 = fp8;
    if (fp8) {
      g.a = aq, g.a_rows = m, g.a_cols = C, g.a_scales = as;
      g.b = bq, g.b_rows = n, g.b_cols = C, g.b_scales = bs;
    } else {
      g.a = a16, g.a_rows = C, g.a_cols = m;
      g.b = b16, g.b_rows = C, g.b_cols = n;
    }
    g.out0 = dw_out;
    return g;
  };
  auto scales_by_k_block = [](cuda::GroupedGemmArgs g, const float* by_k_block) {
    g.a_scales = by_k_block, g.a_scales_by_k_block = true;
    return g;
  };
  auto no_epilogue = [](cuda::GroupedGemmArgs g) {  // the main loops alone: what the epilogue costs
    g.debug_skip_epilogue = true;
    return g;
  };
  const double routes = static_cast<double>(T) * k, Hd = static_cast<double>(H), Id = static_cast<double>(I);
  struct Row {
    std::string name;
    double ms, flops;
  };
  std::vector<Row> rows;
  auto time_gemm = [&](const std::string& name, const cuda::GroupedGemmArgs& g, double flops) {
    const double ms = median_ms([&] { CHECK_OK(cuda::launch_grouped_gemm(g, sms, nullptr)); }, warmup, iters);
    CHECK_OK(cuda::sync_and_take_device_error(0, nullptr));
    rows.push_back({name, ms, flops});
  };
  time_gemm("kGateUp bf16", gate_up(false), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUp fp8", gate_up(true), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUp fp8 kbs", scales_by_k_block(gate_up(true), sx_kb), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUp fp8 noepi", no_epilogue(gate_up(true)), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUp bf16 noepi", no_epilogue(gate_up(false)), 2 * routes * 2 * Id * Hd);
  time_gemm("kDown bf16", down(false), 2 * routes * Hd * Id);
  time_gemm("kDown bf16 noepi", no_epilogue(down(false)), 2 * routes * Hd * Id);
  auto to_pool = [&](cuda::GroupedGemmArgs g) {
    g.out0 = y_pool, g.down_to_pool = true;
    return g;
  };
  if (H % 256 == 0) time_gemm("kDown bf16 pool", to_pool(down(false)), 2 * routes * Hd * Id);
  time_gemm("kDown fp8", down(true), 2 * routes * Hd * Id);
  time_gemm("kDown fp8 kbs", scales_by_k_block(down(true), sa_kb), 2 * routes * Hd * Id);
  time_gemm("kDown fp8 noepi", no_epilogue(down(true)), 2 * routes * Hd * Id);
  time_gemm("kDownGrad bf16", down_grad(false), 2 * routes * Hd * Id);
  time_gemm("kDownGrad fp8", down_grad(true), 2 * routes * Hd * Id);
  time_gemm("kDownGrad fp8 kbs", scales_by_k_block(down_grad(true), sx_kb), 2 * routes * Hd * Id);
  time_gemm("kDownGrad fp8 noepi", no_epilogue(down_grad(true)), 2 * routes * Hd * Id);
  // dz quantised in the epilogue (GroupedGemmArgs::dz_q), against the row above plus `quantize dz pool`.
  auto dz_in_epilogue = [&](cuda::GroupedGemmArgs g, cuda::Fp8Scale scale) {
    g.dz_q = qdz, g.dz_s = sdz, g.dz_scale = scale;
    return g;
  };
  time_gemm("kDownGrad fp8 +dz fp32", dz_in_epilogue(down_grad(true), cuda::Fp8Scale::kFloat32), 2 * routes * Hd * Id);
  time_gemm("kDownGrad fp8 +dz pow2", dz_in_epilogue(down_grad(true), cuda::Fp8Scale::kPowerOfTwo),
            2 * routes * Hd * Id);
  time_gemm("kGateUpGrad bf16", gate_up_grad(false), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUpGrad fp8", gate_up_grad(true), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUpGrad fp8 kbs", scales_by_k_block(gate_up_grad(true), sdz_kb), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUpGrad fp8 noepi", no_epilogue(gate_up_grad(true)), 2 * routes * 2 * Id * Hd);
  time_gemm("kGateUpGrad bf16 noepi", no_epilogue(gate_up_grad(false)), 2 * routes * 2 * Id * Hd);
  time_gemm("dW2 bf16", wgrad(false, H, I, x, a, nullptr, nullptr, nullptr, nullptr), 2 * routes * Hd * Id);
  time_gemm("dW2 fp8", wgrad(true, H, I, nullptr, nullptr, xq_t, xs_t, aq_t, as_t), 2 * routes * Hd * Id);
  time_gemm("dW2 fp8 noepi", no_epilogue(wgrad(true, H, I, nullptr, nullptr, xq_t, xs_t, aq_t, as_t)),
            2 * routes * Hd * Id);
  time_gemm("dW13 bf16", wgrad(false, 2 * I, H, dz, x, nullptr, nullptr, nullptr, nullptr), 2 * routes * 2 * Id * Hd);
  time_gemm("dW13 fp8", wgrad(true, 2 * I, H, nullptr, nullptr, dzq_t, dzs_t, xq_t, xs_t), 2 * routes * 2 * Id * Hd);
  // The bf16 rows above run in 128 x 256 tiles where they apply; the 128 x 128 tiles (kWeightGrad: CTA pairs).
  auto narrow = [](cuda::GroupedGemmArgs g) {
    g.narrow_tiles = true;
    return g;
  };
  time_gemm("kGateUpGrad bf16 narrow", narrow(gate_up_grad(false)), 2 * routes * 2 * Id * Hd);
  // kDownGrad in 128 x 256 tiles (wide_down_grad: the layer's only when it gathers dy), pooled and gathered.
  auto wide_down_grad = [](cuda::GroupedGemmArgs g) {
    g.wide_down_grad = true;
    return g;
  };
  time_gemm("kDownGrad bf16 wide", wide_down_grad(down_grad(false)), 2 * routes * Hd * Id);
  // Each expert's tiles rows first (rows_first): few large experts (--preset mixtral-8x7b) stream less of B.
  auto rows_first = [](cuda::GroupedGemmArgs g) {
    g.rows_first = true;
    return g;
  };
  time_gemm("kGateUp bf16 rows-first", rows_first(gate_up(false)), 2 * routes * 2 * Id * Hd);
  time_gemm("kDown bf16 rows-first", rows_first(down(false)), 2 * routes * Hd * Id);
  time_gemm("kDownGrad bf16 rows-first", rows_first(down_grad(false)), 2 * routes * Hd * Id);
  time_gemm("kGateUpGrad bf16 rows-first", rows_first(gate_up_grad(false)), 2 * routes * 2 * Id * Hd);
  time_gemm("dW2 bf16 narrow", narrow(wgrad(false, H, I, x, a, nullptr, nullptr, nullptr, nullptr)),
            2 * routes * Hd * Id);
  time_gemm("dW13 bf16 narrow", narrow(wgrad(false, 2 * I, H, dz, x, nullptr, nullptr, nullptr, nullptr)),
            2 * routes * 2 * Id * Hd);
  // Gathered token rows (GroupedGemmArgs::gather; not used by the layer: 1.14-1.37x the pooled kernels' time in
  // session 35), against the bf16 rows above plus `gather x pool` below. The gathering dW2 (A) and dW13 (B)
  // run the wide tiles, as the pooled rows do.
  uint16_t* tokens = random_bf16(T * H, 1.0f, 9);
  auto gathered = [&](cuda::GroupedGemmArgs g, cuda::GroupedGemmArgs::Gather which) {
    (which == cuda::GroupedGemmArgs::Gather::kA ? g.a : g.b) = tokens;
    g.gather = which, g.gather_tokens = T;
    return g;
  };
  const auto kGatherA = cuda::GroupedGemmArgs::Gather::kA, kGatherB = cuda::GroupedGemmArgs::Gather::kB;
  time_gemm("kGateUp bf16 gather", gathered(gate_up(false), kGatherA), 2 * routes * 2 * Id * Hd);
  time_gemm("kDownGrad bf16 gather", gathered(down_grad(false), kGatherA), 2 * routes * Hd * Id);
  time_gemm("kDownGrad bf16 wide gather", gathered(wide_down_grad(down_grad(false)), kGatherA), 2 * routes * Hd * Id);
  time_gemm("dW2 bf16 gather", gathered(wgrad(false, H, I, x, a, nullptr, nullptr, nullptr, nullptr), kGatherA),
            2 * routes * Hd * Id);
  time_gemm("dW13 bf16 gather", gathered(wgrad(false, 2 * I, H, dz, x, nullptr, nullptr, nullptr, nullptr), kGatherB),
            2 * routes * 2 * Id * Hd);
  rows.push_back({"quantize x pool", median_ms([&] { CHECK_OK(cuda::quantize_e4m3_rows(x, C, H, kScale, qx, sx, nullptr)); },
                                              warmup, iters), 0});
  // The pool's gather alone, and fused with the row quantizer (`dy`: with the bf16 pool too, as an EP owner's
  // backward keeps it).
  uint16_t* pool_copy = random_bf16(C * H, 1.0f, 10);
  rows.push_back({"gather x pool", median_ms([&] {
                    CHECK_OK(cuda::gather_rows(tokens, H, plan.row_src, k, plan.pool_rows, C, pool_copy, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"gather+quantize x", median_ms([&] {
                    CHECK_OK(cuda::gather_quantize_e4m3_rows(tokens, H, plan.row_src, k, plan.pool_rows, C, kScale,
                                                             qx, sx, nullptr, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"gather+quantize dy", median_ms([&] {
                    CHECK_OK(cuda::gather_quantize_e4m3_rows(tokens, H, plan.row_src, k, plan.pool_rows, C, kScale,
                                                             qx, sx, pool_copy, nullptr));
                  }, warmup, iters), 0});
  // The same two the other way round (the one-GPU layer's x and dy since session 26, without the bf16 pool since
  // 0352650): each token row read once, written to its k pool rows.
  rows.push_back({"scatter+quantize x", median_ms([&] {
                    CHECK_OK(cuda::scatter_quantize_e4m3_rows(tokens, T, H, pb.route_row, k, plan.row_src,
                                                              plan.pool_rows, C, kScale, qx, sx, nullptr, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"scatter+quantize dy", median_ms([&] {
                    CHECK_OK(cuda::scatter_quantize_e4m3_rows(tokens, T, H, pb.route_row, k, plan.row_src,
                                                              plan.pool_rows, C, kScale, qx, sx, pool_copy, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"quantize w13 q+t", median_ms([&] {
                    CHECK_OK(cuda::quantize_e4m3_blocks(w13, E, 2 * I, H, kScale, qw13, qw13_t, sw13, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"quantize a pool", median_ms([&] { CHECK_OK(cuda::quantize_e4m3_rows(a, C, I, kScale, qa, sa, nullptr)); },
                                              warmup, iters), 0});
  rows.push_back({"quantize x cols_t",
                  median_ms([&] { CHECK_OK(cuda::quantize_e4m3_cols_t(x, C, H, kScale, xq_t, xs_t, nullptr)); },
                            warmup, iters), 0});
  // The layer's dW13 operand x^T since session 23: gathered and quantised in one pass (the two rows above before).
  rows.push_back({"gather+quantize x cols_t", median_ms([&] {
                    CHECK_OK(cuda::gather_quantize_e4m3_cols_t(tokens, H, plan.row_src, k, plan.pool_rows, C, kScale,
                                                               xq_t, xs_t, nullptr));
                  }, warmup, iters), 0});
  rows.push_back({"quantize dz pool",
                  median_ms([&] { CHECK_OK(cuda::quantize_e4m3_rows(dz, C, 2 * I, kScale, qdz, sdz, nullptr)); },
                            warmup, iters), 0});
  std::printf("megamoe-gemm-bench: %s, %lld tokens (pool %lld rows), medians of %d after %d warm-ups\n", shape->name,
              static_cast<long long>(T), static_cast<long long>(C), iters, warmup);
  std::printf("%-30s %9s %9s\n", "kernel", "us", "TFLOP/s");
  for (const Row& r : rows) {
    if (r.flops > 0)
      std::printf("%-30s %9.1f %9.1f\n", r.name.c_str(), r.ms * 1e3, r.flops / (r.ms * 1e9));
    else
      std::printf("%-30s %9.1f %9s\n", r.name.c_str(), r.ms * 1e3, "-");
  }
  return 0;
}
