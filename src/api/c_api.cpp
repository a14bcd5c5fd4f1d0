// The C ABI (include/megamoe/c_api.h): a thin shell over moe_forward /
// moe_backward; errors become codes plus a thread-local message.
#include "megamoe/c_api.h"

#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "megamoe/moe.h"

struct megamoe_workspace {
  megamoe::MoeProblem problem;
  megamoe::MoeOptions options;
  int device = 0;
  std::unique_ptr<megamoe::MoeWorkspace> ws;  // null for a CPU-only handle
  megamoe::MoeSaved saved;
  uint64_t forwards = 0;     // forwards run on this handle
  uint64_t saved_epoch = 0;  // the forward `saved` belongs to
  std::mutex mutex;          // calls on one handle are serialised (callers release the GIL)
};

namespace {

using megamoe::DType;
using megamoe::Status;
using megamoe::TensorView;

thread_local std::string g_last_error;

int fail(const Status& st) {
  g_last_error = st.to_string();
  return st.ok() ? 0 : static_cast<int>(st.code());
}

// No C++ exception may cross the C ABI: out-of-memory or a failed thread start
// in the CPU reference becomes an error code like any other.
template <typename Fn>
int guarded(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return fail(megamoe::internal_error(std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return fail(megamoe::internal_error("unexpected exception"));
  }
}

Status config_to_problem(const megamoe_config& c, megamoe::MoeProblem* p, megamoe::MoeOptions* o) {
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
  if (c.precision < 0 || c.precision > 3)
    return invalid_argument("precision: expected 0..3, got " + std::to_string(c.precision));
  if (c.save_policy < 0 || c.save_policy > 1)
    return invalid_argument("save_policy: expected 0 (keep) or 1 (recompute)");
  if (c.backend < 0 || c.backend > 2) return invalid_argument("backend: expected 0 (cpu), 1 (cuda) or 2 (auto)");
  if (c.max_tokens_per_rank < 1) return invalid_argument("max_tokens_per_rank must be >= 1");
  o->precision = kPrecisions[c.precision];
  o->save_policy = c.save_policy == 0 ? SavePolicy::kKeep : SavePolicy::kRecompute;
  o->backend = kBackends[c.backend];
  return validate_problem(*p);
}

TensorView view_of(const megamoe_tensor* t) {
  TensorView v;
  if (t == nullptr) return v;
  v.data = t->data;
  v.dtype = static_cast<DType>(t->dtype);
  v.device = t->device == 1 ? megamoe::DeviceType::kCUDA : megamoe::DeviceType::kCPU;
  v.device_index = t->device_index;
  v.rank = t->rank < 0 ? 0 : (t->rank > TensorView::kMaxRank ? TensorView::kMaxRank : t->rank);
  for (int i = 0; i < v.rank; ++i) v.shape[i] = t->shape[i];
  return v;
}

megamoe_tensor desc(const void* p, DType t, std::initializer_list<int64_t> shape, int device) {
  megamoe_tensor d{const_cast<void*>(p), static_cast<int32_t>(t), 1, device, 0, {0, 0, 0, 0}};
  for (int64_t s : shape) d.shape[d.rank++] = s;
  return d;
}

// Per call: the token count comes from x; auto follows the tensors' device.
Status prepare_call(megamoe_workspace* w, const TensorView& x, void* stream) {
  if (x.rank != 2) return megamoe::invalid_argument("x: expected shape [T, H], got " + x.shape_string());
  w->problem.num_tokens = x.shape[0];
  w->options.cuda_stream = stream;
  w->options.backend = megamoe::Backend::kAuto;
  if (x.device == megamoe::DeviceType::kCUDA && !w->ws)
    return megamoe::invalid_argument(
        "x: a CUDA tensor, but this handle has no CUDA workspace (create it with backend 1 "
        "or 2 on a machine with a GPU)");
  return Status::Ok();
}

int workspace_create(const megamoe_config* config, megamoe_workspace** out);

}  // namespace

extern "C" {

int megamoe_workspace_create(const megamoe_config* config, megamoe_workspace** out) {
  return guarded([&] { return workspace_create(config, out); });
}

}  // extern "C"

namespace {
int workspace_create(const megamoe_config* config, megamoe_workspace** out) {
  if (config == nullptr || out == nullptr) return fail(megamoe::invalid_argument("config and out must not be null"));
  auto w = std::make_unique<megamoe_workspace>();
  Status st = config_to_problem(*config, &w->problem, &w->options);
  w->device = config->device;
  if (st.ok() && w->options.backend != megamoe::Backend::kCPU) {
    megamoe::Backend chosen;
    std::string reason;
    st = megamoe::resolve_backend(w->options, &chosen, &reason);
    if (st.ok() && (chosen == megamoe::Backend::kCUDA || w->options.backend == megamoe::Backend::kCUDA))
      st = megamoe::MoeWorkspace::create(w->problem, w->options, w->device, &w->ws);
  }
  if (!st.ok()) return fail(st);
  *out = w.release();
  return 0;
}
}  // namespace

extern "C" {

void megamoe_workspace_destroy(megamoe_workspace* ws) { delete ws; }

size_t megamoe_workspace_bytes(const megamoe_workspace* ws) { return ws && ws->ws ? ws->ws->size_bytes() : 0; }

int megamoe_forward_t(megamoe_workspace* w, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                      const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                      const megamoe_tensor* y, void* stream, uint64_t* epoch) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  return guarded([&] {
    std::lock_guard<std::mutex> lock(w->mutex);
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    Status st = prepare_call(w, in.x, stream);
    if (st.ok()) st = megamoe::moe_forward(w->problem, w->options, in, view_of(y), &w->saved, w->ws.get());
    if (!st.ok()) return fail(st);
    w->saved_epoch = ++w->forwards;
    if (epoch != nullptr) *epoch = w->saved_epoch;
    return 0;
  });
}

int megamoe_backward_t(megamoe_workspace* w, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                       const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                       const megamoe_tensor* dy, const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights,
                       const megamoe_tensor* dw13, const megamoe_tensor* dw2, void* stream, uint64_t epoch) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  return guarded([&] {
    std::lock_guard<std::mutex> lock(w->mutex);
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    Status st = prepare_call(w, in.x, stream);
    if (st.ok() && (epoch != w->saved_epoch || !w->saved.valid())) {
      // The handle's saved state belongs to another forward: recompute this one (dx is the scratch y).
      st = megamoe::moe_forward(w->problem, w->options, in, view_of(dx), &w->saved, w->ws.get());
      if (st.ok()) w->saved_epoch = ++w->forwards;
    }
    if (st.ok())
      st = megamoe::moe_backward(w->problem, w->options, in, view_of(dy), w->saved,
                                 {view_of(dx), view_of(d_topk_weights), view_of(dw13), view_of(dw2)}, w->ws.get());
    return fail(st);
  });
}

int megamoe_forward(megamoe_workspace* w, int64_t T, const void* x, const int32_t* topk_idx, const float* topk_weights,
                    const void* w13, const void* w2, void* y, void* stream) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  const auto& p = w->problem;
  const int64_t H = p.hidden, I = p.intermediate, L = p.experts_per_rank(), k = p.top_k;
  const int d = w->device;
  const megamoe_tensor tx = desc(x, DType::kBF16, {T, H}, d), ti = desc(topk_idx, DType::kI32, {T, k}, d),
                       tw = desc(topk_weights, DType::kF32, {T, k}, d), t13 = desc(w13, DType::kBF16, {L, 2 * I, H}, d),
                       t2 = desc(w2, DType::kBF16, {L, H, I}, d), ty = desc(y, DType::kBF16, {T, H}, d);
  return megamoe_forward_t(w, &tx, &ti, &tw, &t13, &t2, &ty, stream, nullptr);
}

int megamoe_backward(megamoe_workspace* w, int64_t T, const void* x, const int32_t* topk_idx, const float* topk_weights,
                     const void* w13, const void* w2, const void* dy, void* dx, float* d_topk_weights, void* dw13,
                     void* dw2, int32_t wgrad_dtype, void* stream) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  if (wgrad_dtype != 0 && wgrad_dtype != 1)
    return fail(megamoe::invalid_argument("wgrad_dtype: expected 0 (bf16) or 1 (f32)"));
  const auto& p = w->problem;
  const int64_t H = p.hidden, I = p.intermediate, L = p.experts_per_rank(), k = p.top_k;
  const int d = w->device;
  const DType wd = wgrad_dtype == 1 ? DType::kF32 : DType::kBF16;
  const megamoe_tensor tx = desc(x, DType::kBF16, {T, H}, d), ti = desc(topk_idx, DType::kI32, {T, k}, d),
                       tw = desc(topk_weights, DType::kF32, {T, k}, d), t13 = desc(w13, DType::kBF16, {L, 2 * I, H}, d),
                       t2 = desc(w2, DType::kBF16, {L, H, I}, d), tdy = desc(dy, DType::kBF16, {T, H}, d),
                       tdx = desc(dx, DType::kBF16, {T, H}, d), tdw = desc(d_topk_weights, DType::kF32, {T, k}, d),
                       td13 = desc(dw13, wd, {L, 2 * I, H}, d), td2 = desc(dw2, wd, {L, H, I}, d);
  return megamoe_backward_t(w, &tx, &ti, &tw, &t13, &t2, &tdy, &tdx, &tdw, &td13, &td2, stream, w->saved_epoch);
}

int megamoe_check_device_errors(megamoe_workspace* w, void* stream) {
  if (w == nullptr) return fail(megamoe::invalid_argument("workspace is null"));
  if (!w->ws) return 0;  // the CPU backend reports routing errors synchronously
  return guarded([&] {
    std::lock_guard<std::mutex> lock(w->mutex);
    megamoe::MoeOptions o = w->options;
    o.cuda_stream = stream;
    return fail(w->ws->check_device_errors(o));
  });
}

const char* megamoe_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
