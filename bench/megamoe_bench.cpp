// megamoe-bench: forward, backward and forward+backward of the CUDA layer on
// one GPU, CUDA-event medians after warm-up, inputs rotated over two sets so
// that L2 (60 MB) does not serve repeated reads; TFLOPS, % of the measured
// bf16 peak, device memory; JSON out.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_options.h"
#include "megamoe/presets.h"
#include "testing/device_layer.h"

namespace {

using namespace megamoe;

constexpr double kPeakTflops = 797.0;  // measured bf16 dense GEMM on an H200 (docs/design.md, "Ceilings")

int fail(const Status& st) {
  std::fprintf(stderr, "megamoe-bench: %s\n", st.to_string().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> opt = {{"preset", "qwen3-30b-a3b"}, {"tokens", "16384"}, {"save", "keep"},
                                            {"iters", "20"},            {"warmup", "3"},      {"json", ""},
                                            {"wgrad", "f32"},           {"precision", "bf16"},
                                            {"fp8-weights", "step"},    {"scale", "fp32"},
                                            {"paths", "default"}};
  if (!bench::parse_options(argc, argv, &opt,
                            "megamoe-bench [--preset " + preset_names() +
                                "] [--tokens N] [--save keep|recompute] [--precision bf16|fp8|fp8_bwd] [--iters N] "
                                "[--warmup N] [--wgrad f32|bf16] [--fp8-weights step|cached] [--scale fp32|pow2] [--paths P] [--json PATH]\n"
                                "  --fp8-weights step: every forward quantises the weights (one optimizer step per "
                                "forward + backward); cached: the weights never change, quantised once\n"
                                "  --paths: default, or the other of two equal-result paths, comma-separated:\n"
                                "    no-side-jobs, no-rows-first, slots (megamoe::CudaPaths)"))
    return 2;
  const ModelPreset* shape = find_preset(opt["preset"]);
  if (shape == nullptr) return fail(invalid_argument("unknown preset '" + opt["preset"] + "'"));
  MoeOptions o;
  o.backend = Backend::kCUDA;
  Status st = parse_save_policy(opt["save"], &o.save_policy);
  if (!st.ok()) return fail(st);
  st = parse_precision(opt["precision"], &o.precision);
  if (!st.ok()) return fail(st);
  st = parse_scale_mode(opt["scale"], &o.fp8_scale_mode);
  if (!st.ok()) return fail(st);
  const int iters = std::atoi(opt["iters"].c_str()), warmup = std::atoi(opt["warmup"].c_str());
  const DType wgrad = opt["wgrad"] == "bf16" ? DType::kBF16 : DType::kF32;
  if (opt["fp8-weights"] != "step" && opt["fp8-weights"] != "cached")
    return fail(invalid_argument("--fp8-weights: expected step or cached, got '" + opt["fp8-weights"] + "'"));
  const bool weights_cached = opt["fp8-weights"] == "cached";
  for (size_t at = 0; opt["paths"] != "default" && at <= opt["paths"].size();) {
    const size_t end = std::min(opt["paths"].find(',', at), opt["paths"].size());
    const std::string path = opt["paths"].substr(at, end - at);
    if (path == "no-side-jobs") o.cuda_paths.side_jobs = false;
    else if (path == "no-rows-first") o.cuda_paths.rows_first = false;
    else if (path == "slots") o.cuda_paths.down_to_pool = false;
    else return fail(invalid_argument("--paths: '" + path + "' is not no-side-jobs, no-rows-first or slots"));
    at = end + 1;
  }

  MoeProblem p;
  p.num_tokens = std::atoll(opt["tokens"].c_str());
  p.hidden = shape->hidden, p.intermediate = shape->intermediate, p.num_experts = shape->num_experts,
  p.top_k = shape->top_k;
  p.max_tokens_per_rank = p.num_tokens;
  st = validate_problem(p);
  if (!st.ok()) return fail(st);

  size_t free0 = 0, total = 0;
  cudaMemGetInfo(&free0, &total);
  // One FP8 weight buffer per input set (their weights differ); scratch and saved shared.
  testing::DeviceBuffers buffers, second_weights;
  st = testing::make_device_buffers(p, o, true, 0, &buffers);
  if (!st.ok()) return fail(st);
  second_weights.fp8_weights = testing::DeviceTensor(DType::kI32, {buffers.fp8_weights.view().numel()}, 0);
  MoeBuffers bs[2] = {buffers.view(), buffers.view()};
  bs[1].fp8_weights = second_weights.fp8_weights.view().data;
  const MoeBuffers& b = bs[0];
  bool filled[2] = {false, false};
  testing::DeviceLayer sets[2];
  for (int s = 0; s < 2; ++s) {
    testing::LayerSpec spec;
    spec.problem = p;
    spec.seed = 100 + static_cast<uint64_t>(s);
    st = testing::make_device_layer(p, testing::make_layer_data(spec), wgrad, 0, &sets[s]);
    if (!st.ok()) return fail(st);
  }
  size_t free1 = 0;
  cudaMemGetInfo(&free1, &total);

  int cur = 0;
  MoeSaved saved;
  // FP8 weights: a forward quantises them unless they are cached and filled; a backward uses its forward's.
  auto fwd = [&] {
    testing::DeviceLayer& d = sets[cur];
    bs[cur].fp8_weights_ready = weights_cached && filled[cur];
    if (st.ok()) st = moe_forward(p, o, d.inputs(), d.y.view(), &saved, &bs[cur]);
    filled[cur] = true;
  };
  auto bwd = [&] {
    testing::DeviceLayer& d = sets[cur];
    bs[cur].fp8_weights_ready = filled[cur];
    if (st.ok()) st = moe_backward(p, o, d.inputs(), d.dy.view(), saved, d.grads(), &bs[cur]);
    filled[cur] = true;
  };
  auto rotate = [&] { cur ^= 1; };
  const double fwd_ms = testing::median_ms([&] { rotate(), fwd(); }, warmup, iters, nullptr);
  const double bwd_ms = testing::median_ms(bwd, warmup, iters, nullptr, [&] { rotate(), fwd(); });
  const double both_ms = testing::median_ms([&] { rotate(), fwd(), bwd(); }, warmup, iters, nullptr);
  // The outputs of one more forward + backward on input set 0, hashed (FNV-1a
  // of the bytes): runs that must agree bit for bit (two builds, or a path
  // and its replacement) compare these.
  cur = 1;
  rotate(), fwd(), bwd();
  if (st.ok()) st = check_device_errors(0, o.cuda_stream);
  if (!st.ok()) return fail(st);
  auto digest = [](const testing::DeviceTensor& t) {
    std::vector<unsigned char> h(static_cast<size_t>(t.view().size_bytes()));
    if (cudaMemcpy(h.data(), t.view().data, h.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return uint64_t{0};
    uint64_t v = 1469598103934665603ull;
    for (unsigned char c : h) v = (v ^ c) * 1099511628211ull;
    return v;
  };
  const testing::DeviceLayer& d0 = sets[0];
  const uint64_t dg[5] = {digest(d0.y), digest(d0.dx), digest(d0.d_topk_weights), digest(d0.dw13), digest(d0.dw2)};

  const double ff = forward_flops(p), bf = backward_flops(p, o.save_policy);
  const double tf_f = ff / (fwd_ms * 1e9), tf_b = bf / (bwd_ms * 1e9), tf_fb = (ff + bf) / (both_ms * 1e9);
  const double ws_gib = static_cast<double>(b.scratch_bytes + b.saved_bytes) / (1 << 30);
  const double fp8_gib = static_cast<double>(2 * b.fp8_weights_bytes) / (1 << 30);  // one buffer per set
  const double io_gib = (static_cast<double>(free0 - free1) / (1 << 30) - ws_gib - fp8_gib) / 2;  // one set
  const bool fp8 = b.fp8_weights_bytes > 0;
  std::printf("megamoe-bench: %s, %lld tokens, %s%s%s, save %s, wgrad %s (medians of %d after %d warm-ups)\n",
              shape->name, static_cast<long long>(p.num_tokens), to_string(o.precision),
              !fp8 ? "" : weights_cached ? " (weights quantised once, cached)" : " (weights quantised in each forward)",
              !fp8 ? "" : o.fp8_scale_mode == ScaleMode::kPowerOfTwo ? ", pow2 scales" : ", fp32 scales",
              to_string(o.save_policy), to_string(wgrad), iters, warmup);
  std::printf("%-10s %10s %9s %8s\n", "phase", "ms", "TFLOPS", "%peak");
  std::printf("%-10s %10.3f %9.1f %7.1f%%\n", "forward", fwd_ms, tf_f, 100 * tf_f / kPeakTflops);
  std::printf("%-10s %10.3f %9.1f %7.1f%%\n", "backward", bwd_ms, tf_b, 100 * tf_b / kPeakTflops);
  std::printf("%-10s %10.3f %9.1f %7.1f%%\n", "fwd+bwd", both_ms, tf_fb, 100 * tf_fb / kPeakTflops);
  std::printf("device memory: scratch + saved %.2f GiB + one set of inputs/outputs/grads ~%.2f GiB", ws_gib, io_gib);
  if (fp8) std::printf(" + the layer's fp8 weights %.2f GiB", static_cast<double>(b.fp8_weights_bytes) / (1 << 30));
  std::printf(" (allocation sizes)\n");
  std::printf("digest (y dx d_topk_weights dw13 dw2): %016llx %016llx %016llx %016llx %016llx\n",
              static_cast<unsigned long long>(dg[0]), static_cast<unsigned long long>(dg[1]),
              static_cast<unsigned long long>(dg[2]), static_cast<unsigned long long>(dg[3]),
              static_cast<unsigned long long>(dg[4]));
  if (!opt["json"].empty()) {
    FILE* f = std::fopen(opt["json"].c_str(), "w");
    if (f != nullptr) {
      std::fprintf(f,
                   "{\"preset\": \"%s\", \"tokens\": %lld, \"save\": \"%s\", \"forward_ms\": %.4f, "
                   "\"backward_ms\": %.4f, \"fwd_bwd_ms\": %.4f, \"forward_tflops\": %.2f, \"backward_tflops\": %.2f, "
                   "\"fwd_bwd_tflops\": %.2f, \"peak_tflops\": %.1f, \"scratch_bytes\": %zu, \"saved_bytes\": %zu, "
                   "\"precision\": \"%s\", \"fp8_weights\": \"%s\", \"fp8_scale\": \"%s\", \"fp8_weights_bytes\": %zu, "
                   "\"digest\": \"%016llx %016llx %016llx %016llx %016llx\"}\n",
                   shape->name, static_cast<long long>(p.num_tokens), to_string(o.save_policy), fwd_ms, bwd_ms,
                   both_ms, tf_f, tf_b, tf_fb, kPeakTflops, b.scratch_bytes, b.saved_bytes, to_string(o.precision),
                   weights_cached ? "cached" : "step", to_string(o.fp8_scale_mode), b.fp8_weights_bytes, static_cast<unsigned long long>(dg[0]),
                   static_cast<unsigned long long>(dg[1]), static_cast<unsigned long long>(dg[2]),
                   static_cast<unsigned long long>(dg[3]), static_cast<unsigned long long>(dg[4]));
      std::fclose(f);
    }
  }
  return 0;
}
