// megamoe run: one MoE layer forward + backward on seeded random inputs,
// timed per phase and checked on a sample against the fp64 path.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device_query.h"
#include "megamoe/moe.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "testing/sample_check.h"
#ifdef MEGAMOE_WITH_CUDA
#include "testing/device_layer.h"
#endif

namespace {

using namespace megamoe;

// Tokens per rank on the CPU backend when --tokens is not given: about the
// same work (~0.8 GFLOP of k*H*I per token) for every preset, under a minute.
int64_t default_cpu_tokens(const ModelPreset& p) {
  const int64_t per_token = static_cast<int64_t>(p.top_k) * p.hidden * p.intermediate;
  return std::clamp<int64_t>((int64_t{3} << 28) / per_token, 16, 512);
}

// Relative-error bounds of the sample check, per precision (docs/numerics.md).
double error_bound(Precision p) {
  switch (p) {
    case Precision::kBF16: return 2e-2;
    case Precision::kFP8Bwd: return 1e-1;
    case Precision::kFP8: return 1e-1;
    case Precision::kMXFP8: return 1e-1;
  }
  return 0;
}

// Usage goes to stdout with exit 0 when asked for (--help), to stderr with exit 2 after a mistake.
int usage(const char* msg) {
  FILE* out = msg ? stderr : stdout;
  if (msg) std::fprintf(stderr, "megamoe: %s\n\n", msg);
  std::fprintf(out,
               "usage: megamoe run [--preset %s] [--tokens N]\n"
               "                   [--precision bf16|fp8|fp8_bwd|mxfp8] [--backend cpu|cuda|auto]\n"
               "                   [--ep-size P] [--save keep|recompute] [--scale fp32|pow2]\n"
               "                   [--seed S] [--threads N] [--sample-tokens N]\n"
               "       megamoe --help\n"
               "Runs one MoE layer forward + backward on seeded random inputs (N tokens per rank;\n"
               "default 16384 on cuda, a size that takes seconds on cpu), prints time per phase and\n"
               "TFLOPS, and checks a sample against the fp64 path.\n"
               "Exit status: 0 ok, 1 sample error above its bound, 2 bad usage or failed call.\n",
               preset_names().c_str());
  return msg ? 2 : 0;
}

int fail(const Status& st) {
  std::fprintf(stderr, "megamoe: %s\n", st.to_string().c_str());
  return 2;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One GPU: upload, then forward and backward timed as CUDA-event medians
// (2 warm-up runs, 5 timed; each backward after its own forward), outputs
// of the last run downloaded for the check.
Status run_cuda(const MoeProblem& problem, const MoeOptions& options, const testing::LayerData& data,
                testing::LayerOutputs* out, double* fwd_ms, double* bwd_ms) {
#ifdef MEGAMOE_WITH_CUDA
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  testing::DeviceBuffers buffers;
  MEGAMOE_RETURN_IF_ERROR(testing::make_device_buffers(problem, options, true, 0, &buffers));
  const MoeBuffers b = buffers.view();
  std::printf("device buffers: scratch %.1f MiB, saved %.1f MiB for %lld tokens\n",
              static_cast<double>(b.scratch_bytes) / (1 << 20), static_cast<double>(b.saved_bytes) / (1 << 20),
              static_cast<long long>(problem.num_tokens));
  testing::DeviceLayer d;
  MEGAMOE_RETURN_IF_ERROR(testing::make_device_layer(problem, data, DType::kF32, 0, &d));
  MEGAMOE_RETURN_IF_ERROR(testing::poison_outputs(d, nullptr));
  MoeSaved saved;
  Status st;
  auto fwd = [&] {
    if (st.ok()) st = moe_forward(problem, options, d.inputs(), d.y.view(), &saved, &b);
  };
  auto bwd = [&] {
    if (st.ok()) st = moe_backward(problem, options, d.inputs(), d.dy.view(), saved, d.grads(), &b);
  };
  *fwd_ms = testing::median_ms(fwd, 2, 5, nullptr);
  *bwd_ms = testing::median_ms(bwd, 2, 5, nullptr, fwd);
  MEGAMOE_RETURN_IF_ERROR(st);
  MEGAMOE_RETURN_IF_ERROR(check_device_errors(0, options.cuda_stream));
  return testing::download_outputs(d, out);
#else
  (void)problem, (void)options, (void)data, (void)out, (void)fwd_ms, (void)bwd_ms;
  return unavailable("backend cuda: megamoe was built without CUDA");
#endif
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> opt = {{"preset", "qwen3-30b-a3b"}, {"precision", "bf16"}, {"backend", "auto"},
                                            {"ep-size", "1"},  {"save", "keep"}, {"scale", "fp32"},
                                            {"seed", "1"},     {"threads", "0"}, {"sample-tokens", "8"},
                                            {"tokens", ""}};
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (a.rfind("--", 0) != 0 || !opt.count(a.substr(2))) return usage(("unknown option " + a).c_str());
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    opt[a.substr(2)] = argv[++i];
  }
  const ModelPreset* preset = find_preset(opt["preset"]);
  if (!preset) return usage(("unknown preset '" + opt["preset"] + "' (expected " + preset_names(", ") + ")").c_str());

  MoeOptions options;
  Status st = parse_precision(opt["precision"], &options.precision);
  if (st.ok()) st = parse_backend(opt["backend"], &options.backend);
  if (st.ok()) st = parse_save_policy(opt["save"], &options.save_policy);
  if (st.ok()) st = parse_scale_mode(opt["scale"], &options.fp8_scale_mode);
  if (!st.ok()) return fail(st);
  auto to_int = [&](const char* key, int64_t lo, int64_t* out) -> bool {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(opt[key].c_str(), &end, 10);
    if (opt[key].empty() || *end != '\0' || errno == ERANGE || v < lo) {
      std::fprintf(stderr, "megamoe: --%s must be an integer >= %lld, got '%s'\n", key, static_cast<long long>(lo),
                   opt[key].c_str());
      return false;
    }
    *out = v;
    return true;
  };
  int64_t ep = 1, seed = 1, threads = 0, sample = 8, tokens = 0;
  if (!to_int("ep-size", 1, &ep) || !to_int("seed", 0, &seed) || !to_int("threads", 0, &threads) ||
      !to_int("sample-tokens", 1, &sample))
    return 2;
  options.cpu_threads = static_cast<int>(threads);

  Backend backend;
  std::string reason;
  // The CLI runs expert parallelism as the CPU reference's P-rank simulation only: auto picks the CPU
  // for it, and an explicit --backend cuda is refused below with where the GPU path lives.
  if (ep > 1 && options.backend == Backend::kAuto) {
    backend = Backend::kCPU;
    reason = "auto: --ep-size > 1 is simulated on the cpu reference (the CLI does not drive several GPUs)";
  } else {
    st = resolve_backend(options, &backend, &reason);
    if (!st.ok()) return fail(st);
  }
  if (backend == Backend::kCUDA) {
    std::string why;
    if (cuda::device_count(&why) == 0) return fail(unavailable("backend cuda: " + why));
  }
  if (opt["tokens"].empty()) {
    tokens = backend == Backend::kCPU ? default_cpu_tokens(*preset) : 16384;
  } else if (!to_int("tokens", 1, &tokens)) {
    return 2;
  }

  MoeProblem problem;
  problem.num_tokens = tokens;
  problem.hidden = preset->hidden;
  problem.intermediate = preset->intermediate;
  problem.num_experts = preset->num_experts;
  problem.top_k = preset->top_k;
  problem.ep_size = static_cast<int>(ep);
  problem.max_tokens_per_rank = tokens;
  st = validate_problem(problem);
  if (!st.ok()) return fail(st);

  std::printf("megamoe run: preset %s (H %lld, I %lld, E %d, k %d), %lld tokens/rank, EP %lld, precision %s, save %s\n",
              preset->name, static_cast<long long>(problem.hidden), static_cast<long long>(problem.intermediate),
              problem.num_experts, problem.top_k, static_cast<long long>(tokens), static_cast<long long>(ep),
              to_string(options.precision), to_string(options.save_policy));
  std::printf("backend: %s\n", reason.c_str());
  if (backend == Backend::kCUDA && problem.ep_size > 1)
    return fail(unimplemented("--ep-size > 1 with backend cuda: the CLI simulates ranks on the cpu only; expert "
                              "parallelism on GPUs runs through megamoe-ep-bench (one process, several GPUs) or "
                              "torchrun -m megamoe.train with an ep config"));
  if (backend == Backend::kCUDA) std::printf("device: %s\n", cuda::device_description(0).c_str());

  // Host copies of every rank's inputs and outputs (bf16 activations, fp32 weight gradients) must fit
  // in this machine's memory: checked up front, so a size that cannot run is an error, not an OOM kill.
  const double L = static_cast<double>(problem.experts_per_rank()), H = static_cast<double>(problem.hidden);
  const double I = static_cast<double>(problem.intermediate);
  const double host_bytes = static_cast<double>(ep) * (static_cast<double>(tokens) * (8.0 * H + 12.0 * problem.top_k) +
                                                       L * 3.0 * I * H * 6.0);
  const double phys_bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (phys_bytes > 0 && host_bytes > phys_bytes)
    return fail(unavailable("out of host memory: the layer's inputs and outputs need at least " +
                            std::to_string(static_cast<long long>(host_bytes / (1 << 30))) + " GiB, this machine has " +
                            std::to_string(static_cast<long long>(phys_bytes / (1 << 30))) + " GiB; use fewer --tokens"));

  std::vector<testing::LayerData> data;
  std::vector<testing::LayerOutputs> outs;
  std::vector<MoeInputs> inputs;
  std::vector<TensorView> ys, dys;
  std::vector<MoeGrads> grads;
  for (int r = 0; r < problem.ep_size; ++r) {
    testing::LayerSpec spec;
    spec.problem = problem;
    spec.seed = static_cast<uint64_t>(seed);
    spec.rank = r;
    data.push_back(testing::make_layer_data(spec));
    outs.push_back(testing::make_layer_outputs(problem, tokens, DType::kBF16, DType::kF32, std::nan("")));
  }
  for (int r = 0; r < problem.ep_size; ++r) {
    inputs.push_back(data[r].inputs());
    ys.push_back(outs[r].y.view);
    dys.push_back(data[r].dy.view);
    grads.push_back(outs[r].grads());
  }

  double fwd_ms = 0, bwd_ms = 0;
  if (backend == Backend::kCUDA) {
    st = run_cuda(problem, options, data[0], &outs[0], &fwd_ms, &bwd_ms);
    if (!st.ok()) return fail(st);
  } else {
    MoeSaved saved;
    auto t0 = std::chrono::steady_clock::now();
    st = problem.ep_size == 1 ? moe_forward(problem, options, inputs[0], ys[0], &saved)
                              : reference::simulate_forward(problem, options, inputs, ys, &saved);
    if (!st.ok()) return fail(st);
    fwd_ms = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    st = problem.ep_size == 1 ? moe_backward(problem, options, inputs[0], dys[0], saved, grads[0])
                              : reference::simulate_backward(problem, options, inputs, dys, saved, grads);
    if (!st.ok()) return fail(st);
    bwd_ms = ms_since(t0);
  }

  // FLOPs over all simulated ranks (the CPU does all of them).
  const double fwd_flops = forward_flops(problem) * static_cast<double>(ep);
  const double bwd_flops = backward_flops(problem, options.save_policy) * static_cast<double>(ep);
  std::printf("\n%s\n", backend == Backend::kCUDA ? "times: CUDA-event medians of 5 runs after 2 warm-ups"
                                                 : "times: one run, wall clock");
  std::printf("%-10s %12s %10s\n", "phase", "time_ms", "TFLOPS");
  auto row = [](const char* n, double ms, double fl) {
    std::printf("%-10s %12.2f %10.4f\n", n, ms, ms > 0 ? fl / (ms * 1e9) : 0.0);
  };
  row("forward", fwd_ms, fwd_flops);
  row("backward", bwd_ms, bwd_flops);
  row("fwd+bwd", fwd_ms + bwd_ms, fwd_flops + bwd_flops);

  testing::SampleErrors err;
  st = testing::check_sample_against_fp64(problem, data, outs, sample, options.cpu_threads, &err);
  if (!st.ok()) return fail(st);
  const double bound = error_bound(options.precision);
  std::printf("\ncheck vs fp64 path: %lld tokens of rank 0 (y, dx, d_topk_w); local expert %d of rank 0, %lld rows (dW)\n",
              static_cast<long long>(err.sampled_tokens), err.sampled_expert, static_cast<long long>(err.expert_rows));
  std::printf("%-16s %12s %10s %6s\n", "output", "rel_err", "bound", "ok");
  bool all_ok = true;
  const std::pair<const char*, double> rows[] = {
      {"y", err.y}, {"dx", err.dx}, {"d_topk_weights", err.d_topk_weights}, {"dw13", err.dw13}, {"dw2", err.dw2}};
  for (const auto& [name, e] : rows) {
    const bool ok = e <= bound;  // NaN fails
    all_ok &= ok;
    std::printf("%-16s %12.3e %10.1e %6s\n", name, e, bound, ok ? "yes" : "NO");
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) return usage(nullptr);
  if (argc < 2) return usage("a command is needed");
  if (std::strcmp(argv[1], "run") != 0) return usage(("unknown command '" + std::string(argv[1]) + "'").c_str());
  // The host copies of inputs and outputs are plain vectors: a size the machine cannot hold is an error, not an abort.
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    return fail(unavailable("out of host memory for the layer's inputs and outputs at this --tokens / --ep-size"));
  } catch (const std::length_error&) {
    return fail(unavailable("out of host memory for the layer's inputs and outputs at this --tokens / --ep-size"));
  }
}
