// The C ABI (include/megamoe/c_api.h): a thin shell over moe_forward /
// moe_backward with device tensors; errors become codes plus a message.
#include "megamoe/c_api.h"

#include <memory>
#include <string>

#include "megamoe/moe.h"

struct megamoe_workspace {
  megamoe::MoeProblem problem;
  megamoe::MoeOptions options;
  int device = 0;
  std::unique_ptr<megamoe::MoeWorkspace> ws;
  megamoe::MoeSaved saved;
};

namespace {

thread_local std::string g_last_error;

int fail(const megamoe::Status& st) {
  g_last_error = st.to_string();
  return st.ok() ? 0 : static_cast<int>(st.code());
}

megamoe::Status config_to_problem(const megamoe_config& c, megamoe::MoeProblem* p, megamoe::MoeOptions* o) {
  using namespace megamoe;
  p->hidden = c.hidden;
  p->intermediate = c.intermediate;
  p->num_experts = c.num_experts;
  p->top_k = c.top_k;
  p->ep_rank = c.ep_rank;
  p->ep_size = c.ep_size;
  p->max_tokens_per_rank = c.max_tokens_per_rank;
  p->num_tokens = c.max_tokens_per_rank;
  static const Precision kPrecisions[] = {Precision::kBF16, Precision::kFP8, Precision::kFP8Bwd, Precision::kMXFP8};
  static const Backend kBackends[] = {Backend::kCPU, Backend::kCUDA, Backend::kAuto};
  if (c.precision < 0 || c.precision > 3) return invalid_argument("precision: expected 0..3, got " + std::to_string(c.precision));
  if (c.save_policy < 0 || c.save_policy > 1) return invalid_argument("save_policy: expected 0 or 1");
  if (c.backend < 0 || c.backend > 2) return invalid_argument("backend: expected 0..2");
  o->precision = kPrecisions[c.precision];
  o->save_policy = c.save_policy == 0 ? SavePolicy::kKeep : SavePolicy::kRecompute;
  o->backend = kBackends[c.backend];
  if (o->backend != Backend::kCUDA)
    return unimplemented("the C ABI drives backend cuda only (device tensors); use the C++ API for the CPU reference");
  return validate_problem(*p);
}

megamoe::TensorView dev(const void* p, megamoe::DType t, std::initializer_list<int64_t> shape, int device) {
  return megamoe::make_view(const_cast<void*>(p), t, shape, megamoe::DeviceType::kCUDA, device);
}

megamoe::MoeInputs inputs_of(const megamoe_workspace* w, int64_t T, const void* x, const int32_t* idx,
                             const float* tw, const void* w13, const void* w2) {
  using megamoe::DType;
  const auto& p = w->problem;
  const int64_t H = p.hidden, I = p.intermediate, L = p.experts_per_rank(), k = p.top_k;
  return {dev(x, DType::kBF16, {T, H}, w->device), dev(idx, DType::kI32, {T, k}, w->device),
          dev(tw, DType::kF32, {T, k}, w->device), dev(w13, DType::kBF16, {L, 2 * I, H}, w->device),
          dev(w2, DType::kBF16, {L, H, I}, w->device)};
}

}  // namespace

extern "C" {

int megamoe_workspace_create(const megamoe_config* config, megamoe_workspace** out) {
  if (config == nullptr || out == nullptr) return fail(megamoe::invalid_argument("config and out must not be null"));
  auto w = std::make_unique<megamoe_workspace>();
  megamoe::Status st = config_to_problem(*config, &w->problem, &w->options);
  w->device = config->device;
  if (st.ok()) st = megamoe::MoeWorkspace::create(w->problem, w->options, w->device, &w->ws);
  if (!st.ok()) return fail(st);
  *out = w.release();
  return 0;
}

void megamoe_workspace_destroy(megamoe_workspace* ws) { delete ws; }

size_t megamoe_workspace_bytes(const megamoe_workspace* ws) { return ws ? ws->ws->size_bytes() : 0; }

int megamoe_forward(megamoe_workspace* w, int64_t num_tokens, const void* x, const int32_t* topk_idx,
                    const float* topk_weights, const void* w13, const void* w2, void* y, void* stream) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  w->problem.num_tokens = num_tokens;
  w->options.cuda_stream = stream;
  const auto in = inputs_of(w, num_tokens, x, topk_idx, topk_weights, w13, w2);
  return fail(megamoe::moe_forward(w->problem, w->options, in,
                                   dev(y, megamoe::DType::kBF16, {num_tokens, w->problem.hidden}, w->device), &w->saved,
                                   w->ws.get()));
}

int megamoe_backward(megamoe_workspace* w, int64_t num_tokens, const void* x, const int32_t* topk_idx,
                     const float* topk_weights, const void* w13, const void* w2, const void* dy, void* dx,
                     float* d_topk_weights, void* dw13, void* dw2, int32_t wgrad_dtype, void* stream) {
  using megamoe::DType;
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  if (wgrad_dtype != 0 && wgrad_dtype != 1) return fail(megamoe::invalid_argument("wgrad_dtype: expected 0 (bf16) or 1 (f32)"));
  w->problem.num_tokens = num_tokens;
  w->options.cuda_stream = stream;
  const auto& p = w->problem;
  const int64_t H = p.hidden, I = p.intermediate, L = p.experts_per_rank(), k = p.top_k;
  const DType wd = wgrad_dtype == 1 ? DType::kF32 : DType::kBF16;
  const megamoe::MoeGrads g{dev(dx, DType::kBF16, {num_tokens, H}, w->device),
                            dev(d_topk_weights, DType::kF32, {num_tokens, k}, w->device),
                            dev(dw13, wd, {L, 2 * I, H}, w->device), dev(dw2, wd, {L, H, I}, w->device)};
  const auto in = inputs_of(w, num_tokens, x, topk_idx, topk_weights, w13, w2);
  return fail(megamoe::moe_backward(p, w->options, in, dev(dy, DType::kBF16, {num_tokens, H}, w->device), w->saved, g,
                                    w->ws.get()));
}

int megamoe_check_device_errors(megamoe_workspace* w, void* stream) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  megamoe::MoeOptions o = w->options;
  o.cuda_stream = stream;
  return fail(w->ws->check_device_errors(o));
}

const char* megamoe_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
