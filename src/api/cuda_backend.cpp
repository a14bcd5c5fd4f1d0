// Backend cuda: validation of device tensors, then the one-GPU layer.
#include <cuda_runtime.h>

#include <string>

#include "api/backends.h"
#include "api/saved_state.h"
#include "core/tensor_check.h"
#include "cuda/device_query.h"
#include "cuda/moe/cuda_layer.h"

namespace megamoe {

struct MoeWorkspace::Impl {
  std::unique_ptr<cuda::LayerWorkspace> layer;
};

MoeWorkspace::MoeWorkspace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeWorkspace::~MoeWorkspace() = default;
size_t MoeWorkspace::size_bytes() const { return impl_->layer->bytes(); }
int64_t MoeWorkspace::max_tokens() const { return impl_->layer->shape().max_tokens; }

namespace {

cuda::LayerShape layer_shape(const MoeProblem& p) {
  return cuda::LayerShape{p.hidden, p.intermediate, p.num_experts, p.top_k, p.token_capacity()};
}

Status check_cuda_problem(const MoeProblem& p, const MoeOptions& o) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(p));
  if (p.ep_size != 1)
    return unimplemented("ep_size = " + std::to_string(p.ep_size) +
                         ": backend cuda runs one GPU (EP size 1) so far; multi-GPU expert parallelism is not built");
  if (o.precision != Precision::kBF16)
    return unimplemented(std::string("precision ") + to_string(o.precision) +
                         " on backend cuda: only bf16 kernels exist so far (the CPU reference emulates the others)");
  return Status::Ok();
}

struct CudaSaved : MoeSaved::Impl {
  CudaSaved() : Impl(Backend::kCUDA) {}
  const cuda::LayerWorkspace* layer = nullptr;
  uint64_t epoch = 0;
  int64_t tokens = 0;
  SavePolicy policy = SavePolicy::kKeep;
};

Status check_aligned(const char* name, const TensorView& v) {
  if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0)
    return invalid_argument(std::string(name) + ": data pointer must be 16-byte aligned for backend cuda");
  return Status::Ok();
}

// Every tensor on the workspace's GPU, and that GPU current (kernels launch on the current device).
Status check_same_device(std::initializer_list<std::pair<const char*, const TensorView*>> views,
                         const cuda::LayerWorkspace& ws) {
  for (const auto& [name, v] : views)
    if (v->device_index != ws.device())
      return invalid_argument(std::string(name) + ": on cuda:" + std::to_string(v->device_index) +
                              ", but the workspace lives on cuda:" + std::to_string(ws.device()));
  int current = -1;
  cudaGetDevice(&current);
  if (current != ws.device())
    return invalid_argument("the current CUDA device is cuda:" + std::to_string(current) +
                            ", the workspace lives on cuda:" + std::to_string(ws.device()) +
                            " (make it current: cudaSetDevice / torch.cuda.device)");
  return Status::Ok();
}

Status check_device_inputs(const MoeProblem& p, const MoeInputs& in, const cuda::LayerWorkspace& ws) {
  FloatMode mode;
  MEGAMOE_RETURN_IF_ERROR(check_inputs(p, in, DeviceType::kCUDA, &mode));
  if (mode != FloatMode::kBF16) return invalid_argument("x: backend cuda needs bf16 tensors (f64 is CPU-only)");
  if (in.x.shape[0] != p.num_tokens)
    return invalid_argument("x: expected " + std::to_string(p.num_tokens) + " tokens (problem.num_tokens), got " +
                            std::to_string(in.x.shape[0]));
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"x", &in.x}, {"topk_idx", &in.topk_idx},
                                             {"topk_weights", &in.topk_weights}, {"w13", &in.w13}, {"w2", &in.w2}},
                                            ws));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("x", in.x));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("w13", in.w13));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("w2", in.w2));
  const cuda::LayerShape& s = ws.shape();
  if (s.hidden != p.hidden || s.intermediate != p.intermediate || s.num_experts != p.num_experts ||
      s.top_k != p.top_k)
    return invalid_argument("workspace: created for another problem shape");
  return Status::Ok();
}

Status get_layer(MoeWorkspace* workspace, cuda::LayerWorkspace** layer) {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  if (workspace == nullptr || workspace->impl() == nullptr || !workspace->impl()->layer)
    return invalid_argument("workspace: backend cuda needs a MoeWorkspace (MoeWorkspace::create)");
  *layer = workspace->impl()->layer.get();
  return Status::Ok();
}

cuda::LayerInputs layer_inputs(const MoeInputs& in) {
  return {in.x.data, static_cast<const int32_t*>(in.topk_idx.data), static_cast<const float*>(in.topk_weights.data),
          in.w13.data, in.w2.data};
}

}  // namespace

size_t MoeWorkspace::bytes_for(const MoeProblem& problem) {
  return cuda::LayerWorkspace::bytes_for(layer_shape(problem));
}

Status MoeWorkspace::create(const MoeProblem& problem, const MoeOptions& options, int device,
                            std::unique_ptr<MoeWorkspace>* out) {
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(problem, options));
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  auto impl = std::make_unique<Impl>();
  MEGAMOE_RETURN_IF_ERROR(cuda::LayerWorkspace::create(layer_shape(problem), device, &impl->layer));
  out->reset(new MoeWorkspace(std::move(impl)));
  return Status::Ok();
}

Status MoeWorkspace::check_device_errors(const MoeOptions& options) const {
  return impl_->layer->check_device_errors(static_cast<cudaStream_t>(options.cuda_stream),
                                           impl_->layer->shape().top_k);
}

namespace detail {

bool cuda_layer_available(std::string* why) { return cuda::device_count(why) > 0; }

Status cuda_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& y, MoeSaved* saved, MoeWorkspace* workspace) {
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(problem, options));
  cuda::LayerWorkspace* layer;
  MEGAMOE_RETURN_IF_ERROR(get_layer(workspace, &layer));
  MEGAMOE_RETURN_IF_ERROR(check_device_inputs(problem, inputs, *layer));
  MEGAMOE_RETURN_IF_ERROR(check_output("y", y, problem.num_tokens, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_aligned("y", y));
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"y", &y}}, *layer));
  if (problem.num_tokens > layer->shape().max_tokens)
    return capacity_error("num_tokens = " + std::to_string(problem.num_tokens) +
                          " exceeds the workspace's max_tokens_per_rank = " + std::to_string(layer->shape().max_tokens));
  MEGAMOE_RETURN_IF_ERROR(layer->forward(problem.num_tokens, layer_inputs(inputs), y.data, options.save_policy,
                                         static_cast<cudaStream_t>(options.cuda_stream)));
  if (saved != nullptr) {
    auto s = std::make_unique<CudaSaved>();
    s->layer = layer;
    s->epoch = layer->epoch();
    s->tokens = problem.num_tokens;
    s->policy = options.save_policy;
    saved->reset(std::move(s));
  }
  return Status::Ok();
}

Status cuda_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                     const TensorView& dy, const MoeSaved& saved, const MoeGrads& grads, MoeWorkspace* workspace) {
  MEGAMOE_RETURN_IF_ERROR(check_cuda_problem(problem, options));
  cuda::LayerWorkspace* layer;
  MEGAMOE_RETURN_IF_ERROR(get_layer(workspace, &layer));
  MEGAMOE_RETURN_IF_ERROR(check_device_inputs(problem, inputs, *layer));
  const auto* s = dynamic_cast<const CudaSaved*>(saved.impl());
  if (s == nullptr) return invalid_argument("saved: empty, or not from a CUDA forward (run moe_forward first)");
  if (s->layer != layer) return invalid_argument("saved: the forward ran on another workspace");
  if (s->epoch != layer->epoch())
    return invalid_argument("saved: a later forward has reused the workspace; run the backward before the next forward "
                            "on it (or give each layer its own workspace)");
  if (s->tokens != problem.num_tokens || s->policy != options.save_policy)
    return invalid_argument("saved: the forward ran with other num_tokens or save policy");
  const int64_t T = problem.num_tokens;
  MEGAMOE_RETURN_IF_ERROR(check_output("dy", dy, T, problem.hidden, FloatMode::kBF16, DeviceType::kCUDA));
  MEGAMOE_RETURN_IF_ERROR(check_grads(problem, options, grads, T, FloatMode::kBF16, DeviceType::kCUDA));
  for (const auto& [name, v] : {std::pair<const char*, const TensorView*>{"dy", &dy}, {"dx", &grads.dx},
                                {"dw13", &grads.dw13}, {"dw2", &grads.dw2}})
    MEGAMOE_RETURN_IF_ERROR(check_aligned(name, *v));
  if (grads.dw13.dtype != grads.dw2.dtype) return invalid_argument("dw13, dw2: must have the same dtype");
  MEGAMOE_RETURN_IF_ERROR(check_same_device({{"dy", &dy}, {"dx", &grads.dx}, {"d_topk_weights", &grads.d_topk_weights},
                                             {"dw13", &grads.dw13}, {"dw2", &grads.dw2}},
                                            *layer));
  cuda::LayerGrads g{grads.dx.data, static_cast<float*>(grads.d_topk_weights.data), grads.dw13.data, grads.dw2.data,
                     grads.dw13.dtype == DType::kF32, options.accumulate_weight_grads};
  return layer->backward(T, layer_inputs(inputs), dy.data, g, options.save_policy,
                         static_cast<cudaStream_t>(options.cuda_stream));
}

}  // namespace detail
}  // namespace megamoe
