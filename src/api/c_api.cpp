// The C ABI (include/megamoe/c_api.h): a thin, stateless shell over the core;
// errors become codes plus a thread-local message.
#include "megamoe/c_api.h"

#include <exception>
#include <string>

#include "api/backends.h"
#include "megamoe/moe.h"
#include "megamoe/presets.h"

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

Status to_problem(const megamoe_config* c, int64_t num_tokens, megamoe::MoeProblem* p, megamoe::MoeOptions* o) {
  using namespace megamoe;
  if (c == nullptr) return invalid_argument("config: null");
  if (c->precision < 0 || c->precision > 3)
    return invalid_argument("precision: expected 0..3, got " + std::to_string(c->precision));
  if (c->save_policy < 0 || c->save_policy > 1)
    return invalid_argument("save_policy: expected 0 (keep) or 1 (recompute), got " + std::to_string(c->save_policy));
  if (c->device_timeout_ms < 0) return invalid_argument("device_timeout_ms: must be >= 0 (0 = default)");
  if (c->fp8_scale < 0 || c->fp8_scale > 1)
    return invalid_argument("fp8_scale: expected 0 (fp32) or 1 (pow2), got " + std::to_string(c->fp8_scale));
  if (c->cuda_paths < 0 || c->cuda_paths > 7)
    return invalid_argument("cuda_paths: expected bits 0-2 (0 = the defaults), got " + std::to_string(c->cuda_paths));
  static const Precision kPrecisions[] = {Precision::kBF16, Precision::kFP8, Precision::kFP8Bwd, Precision::kMXFP8};
  p->hidden = c->hidden;
  p->intermediate = c->intermediate;
  p->num_experts = c->num_experts;
  p->top_k = c->top_k;
  p->ep_rank = c->ep_rank;
  p->ep_size = c->ep_size;
  p->num_tokens = num_tokens;
  p->max_tokens_per_rank = num_tokens;
  o->precision = kPrecisions[c->precision];
  o->save_policy = c->save_policy == 0 ? SavePolicy::kKeep : SavePolicy::kRecompute;
  o->backend = Backend::kAuto;  // follows the tensors
  o->validate = c->validate != 0;
  o->accumulate_weight_grads = c->accumulate_wgrad != 0;
  o->fp8_scale_mode = c->fp8_scale == 0 ? ScaleMode::kFloat32 : ScaleMode::kPowerOfTwo;
  if (c->device_timeout_ms > 0) o->device_timeout_ms = c->device_timeout_ms;
  o->cuda_paths.side_jobs = (c->cuda_paths & 1) == 0;
  o->cuda_paths.rows_first = (c->cuda_paths & 2) == 0;
  o->cuda_paths.down_to_pool = (c->cuda_paths & 4) == 0;
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

megamoe::MoeBuffers buffers_of(const megamoe_buffer* saved, const megamoe_buffer* scratch,
                               const megamoe_fp8_weights* fp8_weights = nullptr) {
  megamoe::MoeBuffers b;
  if (scratch != nullptr) b.scratch = scratch->data, b.scratch_bytes = scratch->bytes;
  if (saved != nullptr && saved->bytes > 0) b.saved = saved->data, b.saved_bytes = saved->bytes;
  if (fp8_weights != nullptr) {
    b.fp8_weights = fp8_weights->data, b.fp8_weights_bytes = fp8_weights->bytes;
    b.fp8_weights_ready = fp8_weights->ready != 0;
  }
  return b;
}

// A layer's FP8 weights with expert parallelism are those of one rank's
// E / P experts: the problem of that rank's experts on their own (ep_size 1).
megamoe::MoeProblem rank_experts(megamoe::MoeProblem p) {
  p.num_experts /= p.ep_size;  // validate_problem: divisible
  p.ep_rank = 0, p.ep_size = 1;
  p.top_k = 1;  // the weights do not depend on it, and it may exceed E / P
  return p;
}

// Problem and options of one call; the token count comes from x.
Status prepare_call(const megamoe_config* config, const TensorView& x, void* stream, megamoe::MoeProblem* p,
                    megamoe::MoeOptions* o) {
  if (x.data == nullptr && x.rank == 0) return megamoe::invalid_argument("x: null");
  if (x.rank != 2) return megamoe::invalid_argument("x: expected shape [T, H], got " + x.shape_string());
  MEGAMOE_RETURN_IF_ERROR(to_problem(config, x.shape[0], p, o));
  o->cuda_stream = stream;
  return Status::Ok();
}

// An expert-parallel call: as prepare_call, plus the group; CUDA tensors only.
Status prepare_ep_call(const megamoe_config* config, const megamoe_ep_group* g, const TensorView& x, void* stream,
                       megamoe::MoeProblem* p, megamoe::MoeOptions* o, megamoe::detail::EpArgs* a) {
  MEGAMOE_RETURN_IF_ERROR(prepare_call(config, x, stream, p, o));
  if (g == nullptr) return megamoe::invalid_argument("EP group: null");
  if (x.device != megamoe::DeviceType::kCUDA)
    return megamoe::unimplemented("EP: expert parallelism runs CUDA tensors only");
  *a = {g->local, g->peers, g->bytes, g->max_tokens, g->ep_scratch.data, g->ep_scratch.bytes, g->epoch};
  return Status::Ok();
}

}  // namespace

extern "C" {

int megamoe_buffer_sizes(const megamoe_config* config, int64_t num_tokens, int32_t will_backward,
                         uint64_t* scratch_bytes, uint64_t* saved_bytes) {
  return guarded([&] {
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    if (num_tokens < 0) return fail(megamoe::invalid_argument("num_tokens: must be >= 0"));
    Status st = to_problem(config, num_tokens, &p, &o);
    megamoe::MoeBufferSizes sizes;
    if (st.ok()) st = megamoe::moe_buffer_sizes(p, o, will_backward != 0, &sizes);
    if (!st.ok()) return fail(st);
    if (scratch_bytes != nullptr) *scratch_bytes = sizes.scratch_bytes;
    if (saved_bytes != nullptr) *saved_bytes = sizes.saved_bytes;
    return 0;
  });
}

int megamoe_fp8_weight_bytes(const megamoe_config* config, uint64_t* bytes) {
  return guarded([&] {
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    Status st = to_problem(config, 0, &p, &o);
    if (st.ok()) p = rank_experts(p);
    megamoe::MoeBufferSizes sizes;
    if (st.ok()) st = megamoe::moe_buffer_sizes(p, o, true, &sizes);
    if (!st.ok()) return fail(st);
    if (bytes != nullptr) *bytes = sizes.fp8_weights_bytes;
    return 0;
  });
}

int megamoe_fill_fp8_weights(const megamoe_config* config, const megamoe_tensor* w13, const megamoe_tensor* w2,
                             const megamoe_fp8_weights* fp8_weights, void* stream) {
  return guarded([&] {
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    Status st = to_problem(config, 0, &p, &o);
    if (!st.ok()) return fail(st);
    p = rank_experts(p);
    if (fp8_weights == nullptr) return fail(megamoe::invalid_argument("fp8_weights: null"));
    o.cuda_stream = stream;
    return fail(megamoe::moe_fill_fp8_weights(p, o, view_of(w13), view_of(w2), buffers_of(nullptr, nullptr, fp8_weights)));
  });
}

int megamoe_forward(const megamoe_config* config, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                    const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                    const megamoe_tensor* y, const megamoe_buffer* saved, const megamoe_buffer* scratch,
                    const megamoe_fp8_weights* fp8_weights, void* stream) {
  return guarded([&] {
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    Status st = prepare_call(config, in.x, stream, &p, &o);
    if (!st.ok()) return fail(st);
    if (in.x.device == megamoe::DeviceType::kCUDA)
      return fail(megamoe::detail::cuda_forward(p, o, in, view_of(y), buffers_of(saved, scratch, fp8_weights)));
    return fail(megamoe::moe_forward(p, o, in, view_of(y), nullptr));
  });
}

int megamoe_backward(const megamoe_config* config, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                     const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                     const megamoe_tensor* dy, const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights,
                     const megamoe_tensor* dw13, const megamoe_tensor* dw2, const megamoe_buffer* saved,
                     const megamoe_buffer* scratch, const megamoe_fp8_weights* fp8_weights, void* stream) {
  return guarded([&] {
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    const megamoe::MoeGrads g{view_of(dx), view_of(d_topk_weights), view_of(dw13), view_of(dw2)};
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    Status st = prepare_call(config, in.x, stream, &p, &o);
    if (!st.ok()) return fail(st);
    if (in.x.device == megamoe::DeviceType::kCUDA)
      return fail(megamoe::detail::cuda_backward(p, o, in, view_of(dy), g, buffers_of(saved, scratch, fp8_weights)));
    // CPU reference: the forward's intermediates are recomputed (dx is its scratch y).
    megamoe::MoeSaved cpu_saved;
    st = megamoe::moe_forward(p, o, in, g.dx, &cpu_saved);
    if (st.ok()) st = megamoe::moe_backward(p, o, in, view_of(dy), cpu_saved, g);
    return fail(st);
  });
}

int megamoe_check(int32_t device, void* stream) {
  return guarded([&] { return fail(megamoe::check_device_errors(device, stream)); });
}

int megamoe_ep_sizes(const megamoe_config* config, int64_t max_tokens, int32_t will_backward,
                     uint64_t* symmetric_bytes, uint64_t* ep_scratch_bytes, uint64_t* scratch_bytes,
                     uint64_t* saved_bytes) {
  return guarded([&] {
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    if (max_tokens < 0) return fail(megamoe::invalid_argument("max_tokens: must be >= 0"));
    Status st = to_problem(config, max_tokens, &p, &o);
    megamoe::detail::EpSizes sizes{};
    if (st.ok()) st = megamoe::detail::cuda_ep_sizes(p, o, max_tokens, will_backward != 0, &sizes);
    if (!st.ok()) return fail(st);
    if (symmetric_bytes != nullptr) *symmetric_bytes = sizes.symmetric_bytes;
    if (ep_scratch_bytes != nullptr) *ep_scratch_bytes = sizes.ep_scratch_bytes;
    if (scratch_bytes != nullptr) *scratch_bytes = sizes.scratch_bytes;
    if (saved_bytes != nullptr) *saved_bytes = sizes.saved_bytes;
    return 0;
  });
}

int megamoe_ep_forward(const megamoe_config* config, const megamoe_ep_group* group, const megamoe_tensor* x,
                       const megamoe_tensor* topk_idx, const megamoe_tensor* topk_weights, const megamoe_tensor* w13,
                       const megamoe_tensor* w2, const megamoe_tensor* y, const megamoe_buffer* saved,
                       const megamoe_buffer* scratch, const megamoe_fp8_weights* fp8_weights, void* stream) {
  return guarded([&] {
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    megamoe::detail::EpArgs a;
    const Status st = prepare_ep_call(config, group, in.x, stream, &p, &o, &a);
    if (!st.ok()) return fail(st);
    return fail(megamoe::detail::cuda_ep_forward(p, o, in, view_of(y), a, buffers_of(saved, scratch, fp8_weights)));
  });
}

int megamoe_ep_backward(const megamoe_config* config, const megamoe_ep_group* group, const megamoe_tensor* x,
                        const megamoe_tensor* topk_idx, const megamoe_tensor* topk_weights,
                        const megamoe_tensor* w13, const megamoe_tensor* w2, const megamoe_tensor* dy,
                        const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights, const megamoe_tensor* dw13,
                        const megamoe_tensor* dw2, const megamoe_buffer* saved, const megamoe_buffer* scratch,
                        const megamoe_fp8_weights* fp8_weights, void* stream) {
  return guarded([&] {
    const megamoe::MoeInputs in{view_of(x), view_of(topk_idx), view_of(topk_weights), view_of(w13), view_of(w2)};
    const megamoe::MoeGrads g{view_of(dx), view_of(d_topk_weights), view_of(dw13), view_of(dw2)};
    megamoe::MoeProblem p;
    megamoe::MoeOptions o;
    megamoe::detail::EpArgs a;
    const Status st = prepare_ep_call(config, group, in.x, stream, &p, &o, &a);
    if (!st.ok()) return fail(st);
    return fail(
        megamoe::detail::cuda_ep_backward(p, o, in, view_of(dy), g, a, buffers_of(saved, scratch, fp8_weights)));
  });
}

int megamoe_peer_check(int32_t phase, int32_t rank, int32_t world, void* local, void* const* peers, uint64_t bytes,
                       void* stream, int64_t* wrong) {
  return guarded([&] {
    return fail(megamoe::detail::cuda_peer_check(phase, {rank, world, local, peers, bytes}, stream, wrong));
  });
}

int megamoe_cuda_available(const char** why) {
  static thread_local std::string reason;
  const bool ok = megamoe::detail::cuda_layer_available(&reason);
  if (why != nullptr) *why = ok ? "" : reason.c_str();
  return ok ? 1 : 0;
}

int megamoe_preset(int32_t index, megamoe_preset_info* out, int32_t* count) {
  if (count != nullptr) *count = megamoe::preset_count();
  const megamoe::ModelPreset* p = megamoe::preset(index);
  if (p == nullptr)
    return fail(megamoe::invalid_argument("preset index " + std::to_string(index) + " is out of range [0, " +
                                          std::to_string(megamoe::preset_count()) + ")"));
  if (out == nullptr) return fail(megamoe::invalid_argument("preset: out is null"));
  *out = {p->name, p->hidden, p->intermediate, p->num_experts, p->top_k, p->attention_heads, p->kv_heads, p->head_dim};
  return 0;
}

const char* megamoe_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
