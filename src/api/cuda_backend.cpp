// Backend cuda: validation of device tensors and buffers, then the one-GPU layer.
#include <cuda_runtime.h>

#include <string>

#include "api/backends.h"
#include "core/tensor_check.h"
#include "cuda/comm/peer_check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/device_query.h"
#include "cuda/moe/cuda_layer.h"

namespace megamoe::detail {
namespace {

Status check_cuda_problem(const MoeProblem& p, const MoeOptions& o) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(p));
  if (p.ep_size != 1)
    return unimplemented("ep_size = " + std::to_string(p.ep_size) +
                         ": backend cuda runs one GPU (EP size 1) so far; multi-GPU expert parallelism is not built");
  if (o.precision != Precision::kBF16)
    return unimplemented(std::string("precision ") + to_string(o.precision) +
                         " on backend cuda: only bf16 kernels exist so far (the CPU reference emulates the others)");
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

LayerDims dims_of(const MoeProblem& p) {
  return LayerDims{p.num_tokens, p.hidden, p.intermediate, p.num_experts, p.top_k};
}

cuda::LayerInputs layer_inputs(const MoeInputs& in) {
  return {in.x.data, static_cast<const int32_t*>(in.topk_idx.data), static_cast<const float*>(in.topk_weights.data),
          in.w13.data, in.w2.data};
}

// Common start of a call: a GPU, the problem, an earlier call's device error
// (reported here, no sync), the buffers.
Status begin_call(const MoeProblem& p, const MoeOptions& o, const MoeInputs& in, const MoeBuffers& b,
                  cuda::LayerCall* call) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(p, o));
  MEGAMOE_RETURN_IF_ERROR(check_device_inputs(p, in));
  const int device = in.x.device_index;
  const auto stream = static_cast<cudaStream_t>(o.cuda_stream);
  MEGAMOE_RETURN_IF_ERROR(cuda::take_device_error(device, stream));
  call->errors.timeout_ns = static_cast<uint64_t>(o.device_timeout_ms) * 1000000u;
  return cuda::prepare_layer_call(dims_of(p), device, stream, b, call);
}

Status end_call(const MoeOptions& o, const cuda::LayerCall& call, Status launched) {
  if (!launched.ok() || !o.validate) return launched;
  return cuda::sync_and_take_device_error(call.device, call.stream);
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
  const int64_t T = problem.num_tokens;
  MEGAMOE_RETURN_IF_ERROR(check_output("dy", dy, T, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_grads(problem, options, grads, T, FloatMode::kBF16, DeviceType::kCUDA));
  for (const auto& [name, v] : {std::pair<const char*, const TensorView*>{"dy", &dy}, {"dx", &grads.dx},
                                {"dw13", &grads.dw13}, {"dw2", &grads.dw2}})
    MEGAMOE_RETURN_IF_ERROR(check_aligned(name, *v));
  if (grads.dw13.dtype != grads.dw2.dtype) return invalid_argument("dw13, dw2: must have the same dtype");
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"dy", &dy}, {"dx", &grads.dx}, {"d_topk_weights", &grads.d_topk_weights},
                                             {"dw13", &grads.dw13}, {"dw2", &grads.dw2}},
                                            call.device));
  const cuda::LayerGrads g{grads.dx.data, static_cast<float*>(grads.d_topk_weights.data), grads.dw13.data,
                           grads.dw2.data, grads.dw13.dtype == DType::kF32, options.accumulate_weight_grads};
  return end_call(options, call,
                  cuda::layer_backward(call, layer_inputs(inputs), dy.data, g, buffers));
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
