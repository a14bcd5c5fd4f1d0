// Backend cuda: validation of device tensors and buffers, then the one-GPU layer.
#include <cuda_runtime.h>

#include <string>
#include <tuple>
#include <vector>

#include "api/backends.h"
#include "core/tensor_check.h"
#include "cuda/comm/dispatch.h"
#include "cuda/comm/peer_check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/device_query.h"
#include "cuda/layer/ep_layer.h"
#include "cuda/layer/fp8_weights.h"
#include "cuda/layer/one_gpu_layer.h"

namespace megamoe::detail {
namespace {

// expert_parallel: the megamoe_ep_* entries (ep_size from 1 to 8); the others run ep_size 1.
Status check_cuda_problem(const MoeProblem& p, const MoeOptions& o, bool expert_parallel = false) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(p));
  if (!expert_parallel && p.ep_size != 1)
    return unimplemented("ep_size = " + std::to_string(p.ep_size) +
                         ": the one-GPU entries run EP size 1; expert parallelism goes through megamoe_ep_forward");
  if (expert_parallel && p.ep_size > 8)
    return invalid_argument("ep_size = " + std::to_string(p.ep_size) + ": expert parallelism runs 1 to 8 ranks");
  if (expert_parallel && o.save_policy != SavePolicy::kKeep)
    return unimplemented("save policy recompute with expert parallelism: the backward needs the forward's plan");
  if (o.precision == Precision::kMXFP8)
    return unimplemented("precision mxfp8 needs Blackwell tensor cores (1x32 E8M0 block scaling); on Hopper only the "
                         "CPU reference emulates it");
  if (o.device_timeout_ms <= 0) return invalid_argument("device_timeout_ms: must be positive");
  return Status::Ok();
}

Status check_aligned(const char* name, const TensorView& v) {
  if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0)
    return invalid_argument(std::string(name) + ": data pointer must be 16-byte aligned for backend cuda");
  return Status::Ok();
}

// Every tensor on one GPU, and that GPU current (kernels launch on the current device).
Status check_same_device(std::initializer_list<std::pair<const char*, const TensorView*>> views, int device) {
  for (const auto& [name, v] : views)
    if (v->device_index != device)
      return invalid_argument(std::string(name) + ": on cuda:" + std::to_string(v->device_index) + ", x is on cuda:" +
                              std::to_string(device));
  int current = -1;
  cudaGetDevice(&current);
  if (current != device)
    return invalid_argument("the current CUDA device is cuda:" + std::to_string(current) + ", the tensors are on cuda:" +
                            std::to_string(device) + " (make it current: cudaSetDevice / torch.cuda.device)");
  return Status::Ok();
}

Status check_device_inputs(const MoeProblem& p, const MoeInputs& in) {
  FloatMode mode;
  MEGAMOE_RETURN_IF_ERROR(check_inputs(p, in, DeviceType::kCUDA, &mode));
  if (mode != FloatMode::kBF16) return invalid_argument("x: backend cuda needs bf16 tensors (f64 is CPU-only)");
  if (in.x.shape[0] != p.num_tokens)
    return invalid_argument("x: expected " + std::to_string(p.num_tokens) + " tokens (problem.num_tokens), got " +
                            std::to_string(in.x.shape[0]));
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"topk_idx", &in.topk_idx}, {"topk_weights", &in.topk_weights},
                                             {"w13", &in.w13}, {"w2", &in.w2}},
                                            in.x.device_index));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("x", in.x));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("w13", in.w13));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("w2", in.w2));
  return Status::Ok();
}

LayerDims dims_of(const MoeProblem& p, const MoeOptions& o) {
  LayerDims d{p.num_tokens, p.hidden, p.intermediate, p.num_experts, p.top_k};
  d.precision = o.precision, d.fp8_scale = o.fp8_scale_mode;
  return d;
}

cuda::LayerInputs layer_inputs(const MoeInputs& in) {
  return {in.x.data, static_cast<const int32_t*>(in.topk_idx.data), static_cast<const float*>(in.topk_weights.data),
          in.w13.data, in.w2.data};
}

// Common start of a call: a GPU, the problem, an earlier call's device error
// (reported here, no sync), the buffers. EP calls pass their owner dims.
Status begin_call(const MoeProblem& p, const MoeOptions& o, const MoeInputs& in, const MoeBuffers& b,
                  cuda::LayerCall* call, const LayerDims* ep_owner = nullptr) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(p, o, ep_owner != nullptr));
  MEGAMOE_RETURN_IF_ERROR(check_device_inputs(p, in));
  const int device = in.x.device_index;
  const auto stream = static_cast<cudaStream_t>(o.cuda_stream);
  MEGAMOE_RETURN_IF_ERROR(cuda::take_device_error(device, stream));
  call->errors.timeout_ns = static_cast<uint64_t>(o.device_timeout_ms) * 1000000u;
  call->paths = o.cuda_paths;
  return cuda::prepare_layer_call(ep_owner != nullptr ? *ep_owner : dims_of(p, o), device, stream, b, call,
                                  ep_owner != nullptr);
}

Status end_call(const MoeOptions& o, const cuda::LayerCall& call, Status launched) {
  if (!launched.ok() || !o.validate) return launched;
  return cuda::sync_and_take_device_error(call.device, call.stream);
}

// dy and the gradients of a backward: shapes, dtypes, alignment, device.
Status check_backward_outputs(const MoeProblem& problem, const MoeOptions& options, const TensorView& dy,
                              const MoeGrads& grads, int device, cuda::LayerGrads* out) {
  const int64_t T = problem.num_tokens;
  MEGAMOE_RETURN_IF_ERROR(check_output("dy", dy, T, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_grads(problem, options, grads, T, FloatMode::kBF16, DeviceType::kCUDA));
  for (const auto& [name, v] : {std::pair<const char*, const TensorView*>{"dy", &dy}, {"dx", &grads.dx},
                                {"dw13", &grads.dw13}, {"dw2", &grads.dw2}})
    MEGAMOE_RETURN_IF_ERROR(check_aligned(name, *v));
  if (grads.dw13.dtype != grads.dw2.dtype) return invalid_argument("dw13, dw2: must have the same dtype");
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"dy", &dy}, {"dx", &grads.dx}, {"d_topk_weights", &grads.d_topk_weights},
                                             {"dw13", &grads.dw13}, {"dw2", &grads.dw2}},
                                            device));
  *out = cuda::LayerGrads{grads.dx.data, static_cast<float*>(grads.d_topk_weights.data), grads.dw13.data,
                          grads.dw2.data, grads.dw13.dtype == DType::kF32, options.accumulate_weight_grads};
  return Status::Ok();
}

}  // namespace

bool cuda_layer_available(std::string* why) { return cuda::device_count(why) > 0; }

Status cuda_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& y, const MoeBuffers& buffers) {
  cuda::LayerCall call;
  MEGAMOE_RETURN_IF_ERROR(begin_call(problem, options, inputs, buffers, &call));
  MEGAMOE_RETURN_IF_ERROR(check_output("y", y, problem.num_tokens, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("y", y));
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"y", &y}}, call.device));
  return end_call(options, call,
                  cuda::layer_forward(call, layer_inputs(inputs), y.data, buffers));
}

Status cuda_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                     const TensorView& dy, const MoeGrads& grads, const MoeBuffers& buffers) {
  cuda::LayerCall call;
  MEGAMOE_RETURN_IF_ERROR(begin_call(problem, options, inputs, buffers, &call));
  cuda::LayerGrads g;
  MEGAMOE_RETURN_IF_ERROR(check_backward_outputs(problem, options, dy, grads, call.device, &g));
  return end_call(options, call,
                  cuda::layer_backward(call, layer_inputs(inputs), dy.data, g, buffers));
}

Status cuda_fill_fp8_weights(const MoeProblem& problem, const MoeOptions& options, const TensorView& w13,
                             const TensorView& w2, const MoeBuffers& buffers) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(problem, options));
  const int64_t E = problem.num_experts, H = problem.hidden, I = problem.intermediate;
  for (const auto& [name, v, want] :
       {std::tuple<const char*, const TensorView*, std::vector<int64_t>>{"w13", &w13, {E, 2 * I, H}},
        {"w2", &w2, {E, H, I}}}) {
    if (v->data == nullptr) return invalid_argument(std::string(name) + ": data pointer is null");
    if (v->device != DeviceType::kCUDA || v->dtype != DType::kBF16)
      return invalid_argument(std::string(name) + ": the FP8 weights are quantised from a bf16 CUDA tensor");
    if (v->rank != 3 || std::vector<int64_t>(v->shape, v->shape + 3) != want)
      return invalid_argument(std::string(name) + ": expected shape [" + std::to_string(want[0]) + ", " +
                              std::to_string(want[1]) + ", " + std::to_string(want[2]) + "], got " +
                              v->shape_string());
    MEGAMOE_RETURN_IF_ERROR(check_aligned(name, *v));
  }
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"w2", &w2}}, w13.device_index));
  return cuda::fill_layer_fp8_weights(dims_of(problem, options), w13.device_index,
                                      static_cast<cudaStream_t>(options.cuda_stream), w13.data, w2.data, buffers);
}

// ---- expert parallelism ----------------------------------------------------------

namespace {

size_t align_buffer(size_t n) { return (n + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

cuda::DispatchLayout ep_layout(const MoeProblem& p, int64_t max_tokens) {
  cuda::DispatchLayout l;
  l.world = p.ep_size, l.max_tokens = max_tokens, l.hidden = p.hidden, l.top_k = p.top_k;
  return l;
}

// The owner's dims: every rank's max_tokens as virtual tokens, its E / P
// experts, and the call's numerics (FP8: the owner's GEMMs, ep_layer.h).
LayerDims ep_owner(const MoeProblem& p, const MoeOptions& o, int64_t max_tokens) {
  cuda::EpGroup g;
  g.layout = ep_layout(p, max_tokens), g.num_experts = p.num_experts;
  LayerDims d = cuda::ep_owner_dims(g, p.intermediate);
  d.precision = o.precision, d.fp8_scale = o.fp8_scale_mode;
  return d;
}

// The group of one call; the saved buffer split into the owner's part (plan,
// z: saved_layout) and ep_saved (ep_saved_layout), each 256-byte aligned.
Status ep_call_parts(const MoeProblem& p, const MoeOptions& o, const EpArgs& a, const MoeBuffers& b,
                     cuda::EpGroup* g, MoeBuffers* owner_buffers, void** ep_saved) {
  if (a.max_tokens < p.num_tokens)
    return capacity_error("EP: " + std::to_string(p.num_tokens) + " tokens on rank " + std::to_string(p.ep_rank) +
                          ", but the group's buffers hold max_tokens = " + std::to_string(a.max_tokens));
  EpSizes need;
  MEGAMOE_RETURN_IF_ERROR(cuda_ep_sizes(p, o, a.max_tokens, b.saved != nullptr, &need));
  if (a.local == nullptr || a.peers == nullptr || a.bytes < need.symmetric_bytes)
    return invalid_argument("EP: the symmetric buffer is missing or smaller (" + std::to_string(a.bytes) +
                            " bytes) than the group needs (" + std::to_string(need.symmetric_bytes) + ")");
  if (a.ep_scratch == nullptr || a.ep_scratch_bytes < need.ep_scratch_bytes)
    return invalid_argument("EP: ep_scratch is missing or smaller than " + std::to_string(need.ep_scratch_bytes) +
                            " bytes");
  if (a.epoch == 0) return invalid_argument("EP: epoch 0 is the flags' initial value; start at 1");
  g->view.rank = p.ep_rank, g->view.world = p.ep_size, g->view.local = a.local, g->view.bytes = a.bytes;
  g->view.peers = const_cast<void**>(a.peers);
  g->layout = ep_layout(p, a.max_tokens);
  g->num_experts = p.num_experts, g->epoch = a.epoch, g->scratch = a.ep_scratch;
  *owner_buffers = b;
  *ep_saved = nullptr;
  if (b.saved != nullptr) {
    if (b.saved_bytes != need.saved_bytes)
      return invalid_argument("saved: " + std::to_string(b.saved_bytes) + " bytes given, an EP call saves exactly " +
                              std::to_string(need.saved_bytes) + " (megamoe_ep_sizes)");
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(ep_owner(p, o, a.max_tokens), &s));
    owner_buffers->saved_bytes = s.bytes;
    *ep_saved = static_cast<char*>(b.saved) + align_buffer(s.bytes);
  }
  return Status::Ok();
}

}  // namespace

Status cuda_ep_sizes(const MoeProblem& p, const MoeOptions& o, int64_t max_tokens, bool will_backward,
                     EpSizes* out) {
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(p, o, true));
  if (max_tokens < 0) return invalid_argument("EP: max_tokens must be >= 0");
  if (p.top_k > 32) return invalid_argument("top_k = " + std::to_string(p.top_k) + " exceeds the CUDA limit of 32");
  const cuda::DispatchLayout l = ep_layout(p, max_tokens);
  const LayerDims owner = ep_owner(p, o, max_tokens);
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(owner, !will_backward, &sl, true));
  out->symmetric_bytes = l.bytes();
  out->ep_scratch_bytes = cuda::ep_scratch_layout(l).bytes;
  out->scratch_bytes = sl.bytes_without_slots;  // the owner's slot rows go to the sources
  Fp8WeightLayout wl;
  MEGAMOE_RETURN_IF_ERROR(fp8_weight_layout(owner, &wl));  // its E / P experts' (0 for bf16)
  out->fp8_weights_bytes = wl.bytes;
  out->saved_bytes = 0;
  if (will_backward) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(owner, &s));
    out->saved_bytes = align_buffer(s.bytes) + cuda::ep_saved_layout(l).bytes;
  }
  return Status::Ok();
}

Status cuda_ep_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                       const TensorView& y, const EpArgs& ep, const MoeBuffers& buffers) {
  cuda::EpGroup g;
  MoeBuffers owner_buffers;
  void* ep_saved = nullptr;
  MEGAMOE_RETURN_IF_ERROR(validate_problem(problem));
  MEGAMOE_RETURN_IF_ERROR(ep_call_parts(problem, options, ep, buffers, &g, &owner_buffers, &ep_saved));
  const LayerDims owner = ep_owner(problem, options, ep.max_tokens);
  cuda::LayerCall call;
  MEGAMOE_RETURN_IF_ERROR(begin_call(problem, options, inputs, owner_buffers, &call, &owner));
  MEGAMOE_RETURN_IF_ERROR(check_output("y", y, problem.num_tokens, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("y", y));
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"y", &y}}, call.device));
  cuda::EpCall c;
  MEGAMOE_RETURN_IF_ERROR(
      cuda::make_ep_call(call, g, layer_inputs(inputs), problem.num_tokens, owner_buffers, ep_saved, &c));
  return end_call(options, call, cuda::layer_forward_ep(c, y.data));
}

Status cuda_ep_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                        const TensorView& dy, const MoeGrads& grads, const EpArgs& ep, const MoeBuffers& buffers) {
  cuda::EpGroup g;
  MoeBuffers owner_buffers;
  void* ep_saved = nullptr;
  MEGAMOE_RETURN_IF_ERROR(validate_problem(problem));
  if (buffers.saved == nullptr) return invalid_argument("EP backward: needs the saved buffer its forward wrote");
  MEGAMOE_RETURN_IF_ERROR(ep_call_parts(problem, options, ep, buffers, &g, &owner_buffers, &ep_saved));
  if (ep.epoch == ~uint32_t{0}) return invalid_argument("EP backward: needs epochs epoch and epoch + 1");
  const LayerDims owner = ep_owner(problem, options, ep.max_tokens);
  cuda::LayerCall call;
  MEGAMOE_RETURN_IF_ERROR(begin_call(problem, options, inputs, owner_buffers, &call, &owner));
  cuda::LayerGrads lg;
  MEGAMOE_RETURN_IF_ERROR(check_backward_outputs(problem, options, dy, grads, call.device, &lg));
  cuda::EpCall c;
  MEGAMOE_RETURN_IF_ERROR(
      cuda::make_ep_call(call, g, layer_inputs(inputs), problem.num_tokens, owner_buffers, ep_saved, &c));
  return end_call(options, call, cuda::layer_backward_ep(c, dy.data, lg));
}

Status cuda_check_device_errors(int device, void* stream) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  return cuda::sync_and_take_device_error(device, static_cast<cudaStream_t>(stream));
}

Status cuda_peer_check(int phase, const PeerViewArgs& a, void* stream, int64_t* wrong) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  cuda::PeerView v;
  v.rank = a.rank, v.world = a.world, v.local = a.local, v.peers = a.peers, v.bytes = a.bytes;
  auto* s = static_cast<cudaStream_t>(stream);
  if (phase == 0) return cuda::peer_check_write(v, s);
  if (phase != 1) return invalid_argument("peer check: phase " + std::to_string(phase) + " is not 0 or 1");
  if (wrong == nullptr) return invalid_argument("peer check: wrong is null");
  int64_t* count = nullptr;
  MEGAMOE_RETURN_IF_ERROR(cuda::cuda_status("peer check: allocate the count", cudaMallocAsync(&count, 8, s)));
  Status st = cuda::peer_check_count(v, count, s);
  if (st.ok())
    st = cuda::cuda_status("peer check: read the count",
                           cudaMemcpyAsync(wrong, count, sizeof(int64_t), cudaMemcpyDeviceToHost, s));
  const Status freed = cuda::cuda_status("peer check: free the count", cudaFreeAsync(count, s));
  const Status synced = cuda::cuda_status("peer check: synchronise", cudaStreamSynchronize(s));
  if (!st.ok()) return st;
  return freed.ok() ? synced : freed;
}

}  // namespace megamoe::detail
