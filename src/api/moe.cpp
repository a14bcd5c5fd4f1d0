// Public entry points: backend choice, CPU-side validation, dispatch.
#include "megamoe/moe.h"

#include <string>

#include "api/backends.h"
#include "core/saved_state.h"
#include "core/layer_buffers.h"
#include "megamoe/reference.h"

namespace megamoe {

MoeSaved::MoeSaved() = default;
MoeSaved::~MoeSaved() = default;
MoeSaved::MoeSaved(MoeSaved&&) noexcept = default;
MoeSaved& MoeSaved::operator=(MoeSaved&&) noexcept = default;
bool MoeSaved::valid() const { return impl_ != nullptr; }
void MoeSaved::reset(std::unique_ptr<Impl> impl) { impl_ = std::move(impl); }

namespace {

Status mxfp8_on_cuda() {
  return unimplemented("precision mxfp8 needs Blackwell tensor cores (1x32 E8M0 block scaling); "
                       "on Hopper only the CPU reference emulates it");
}

// Explicit backends are obeyed; auto follows the tensors' device.
Status choose_backend(const MoeOptions& options, const MoeInputs& inputs, Backend* chosen) {
  *chosen = options.backend == Backend::kAuto
                ? (inputs.x.device == DeviceType::kCUDA ? Backend::kCUDA : Backend::kCPU)
                : options.backend;
  if (*chosen == Backend::kCUDA && options.precision == Precision::kMXFP8) return mxfp8_on_cuda();
  return Status::Ok();
}

Status check_cpu_call(const MoeProblem& problem, const MoeInputs& inputs) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(problem));
  if (inputs.x.device != DeviceType::kCPU)
    return invalid_argument(std::string("x: backend cpu needs cpu tensors, got a ") + to_string(inputs.x.device) +
                            " tensor");
  if (problem.ep_size != 1)
    return unimplemented("ep_size = " + std::to_string(problem.ep_size) +
                         ": the CPU backend serves one rank (P = 1); reference::simulate_forward simulates P ranks");
  if (inputs.x.rank >= 1 && inputs.x.shape[0] != problem.num_tokens)
    return invalid_argument("x: expected " + std::to_string(problem.num_tokens) + " tokens (problem.num_tokens), got " +
                            std::to_string(inputs.x.shape[0]));
  return Status::Ok();
}

// The CUDA backend's note of what its forward saved (the data is in the caller's buffer).
struct CudaSaved : MoeSaved::Impl {
  CudaSaved() : Impl(Backend::kCUDA) {}
  const void* saved = nullptr;
  size_t saved_bytes = 0;
  int64_t tokens = 0;
};

}  // namespace

Status moe_buffer_sizes(const MoeProblem& problem, const MoeOptions& options, bool will_backward,
                        MoeBufferSizes* out) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(problem));
  if (problem.ep_size != 1)
    return unimplemented("moe_buffer_sizes: expert parallelism (ep_size > 1) has no CUDA layer yet");
  LayerDims d{problem.num_tokens, problem.hidden, problem.intermediate, problem.num_experts, problem.top_k};
  d.precision = options.precision, d.fp8_scale = options.fp8_scale_mode;  // FP8's operand regions
  const bool saves = will_backward && options.save_policy == SavePolicy::kKeep;
  MoeBufferSizes sizes;
  if (saves) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(d, &s));
    sizes.saved_bytes = s.bytes;
  }
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(d, !saves, &sl));
  sizes.scratch_bytes = sl.bytes;
  Fp8WeightLayout wl;
  MEGAMOE_RETURN_IF_ERROR(fp8_weight_layout(d, &wl));
  sizes.fp8_weights_bytes = wl.bytes;
  *out = sizes;
  return Status::Ok();
}

Status moe_fill_fp8_weights(const MoeProblem& problem, const MoeOptions& options, const TensorView& w13,
                            const TensorView& w2, const MoeBuffers& buffers) {
  return detail::cuda_fill_fp8_weights(problem, options, w13, w2, buffers);
}

Status check_device_errors(int device, void* cuda_stream) { return detail::cuda_check_device_errors(device, cuda_stream); }

Status resolve_backend(const MoeOptions& options, Backend* chosen, std::string* reason) {
  switch (options.backend) {
    case Backend::kCPU:
      *chosen = Backend::kCPU;
      *reason = "cpu: requested";
      return Status::Ok();
    case Backend::kCUDA:
      if (options.precision == Precision::kMXFP8) return mxfp8_on_cuda();
      *chosen = Backend::kCUDA;
      *reason = "cuda: requested";
      return Status::Ok();
    case Backend::kAuto: {
      std::string why;
      const bool gpu = detail::cuda_layer_available(&why);
      if (gpu && options.precision != Precision::kMXFP8) {
        *chosen = Backend::kCUDA;
        *reason = "auto: CUDA device found, using cuda";
      } else {
        *chosen = Backend::kCPU;
        const std::string cause = gpu ? std::string("precision ") + to_string(options.precision) +
                                            " needs Blackwell tensor cores"
                                      : "backend cuda: " + why;
        *reason = "auto: using cpu (" + cause + ")";
      }
      return Status::Ok();
    }
  }
  return invalid_argument("backend: unknown value");
}

Status moe_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                   const TensorView& y, MoeSaved* saved, const MoeBuffers* buffers) {
  Backend backend;
  MEGAMOE_RETURN_IF_ERROR(choose_backend(options, inputs, &backend));
  if (backend == Backend::kCUDA) {
    std::string why;
    if (!detail::cuda_layer_available(&why)) return unavailable("backend cuda: " + why);
    if (buffers == nullptr) return invalid_argument("buffers: backend cuda needs MoeBuffers (see moe_buffer_sizes)");
    MoeBuffers b = *buffers;
    if (saved == nullptr || options.save_policy == SavePolicy::kRecompute) b.saved = nullptr, b.saved_bytes = 0;
    if (saved != nullptr && options.save_policy == SavePolicy::kKeep && b.saved == nullptr)
      return invalid_argument("buffers.saved: a forward with a backward to follow and save policy keep needs the "
                              "saved buffer (moe_buffer_sizes(..., will_backward = true))");
    MEGAMOE_RETURN_IF_ERROR(detail::cuda_forward(problem, options, inputs, y, b));
    if (saved != nullptr) {
      auto note = std::make_unique<CudaSaved>();
      note->saved = b.saved;
      note->saved_bytes = b.saved_bytes;
      note->tokens = problem.num_tokens;
      saved->reset(std::move(note));
    }
    return Status::Ok();
  }
  MEGAMOE_RETURN_IF_ERROR(check_cpu_call(problem, inputs));
  return reference::simulate_forward(problem, options, {inputs}, {y}, saved);
}

Status moe_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& dy, const MoeSaved& saved, const MoeGrads& grads, const MoeBuffers* buffers) {
  Backend backend;
  MEGAMOE_RETURN_IF_ERROR(choose_backend(options, inputs, &backend));
  if (saved.impl() != nullptr && saved.impl()->backend != backend)
    return invalid_argument(std::string("saved: produced by backend ") + to_string(saved.impl()->backend) +
                            ", backward runs on " + to_string(backend));
  if (backend == Backend::kCUDA) {
    std::string why;
    if (!detail::cuda_layer_available(&why)) return unavailable("backend cuda: " + why);
    const auto* note = dynamic_cast<const CudaSaved*>(saved.impl());
    if (note == nullptr) return invalid_argument("saved: empty (run moe_forward with a MoeSaved first)");
    if (buffers == nullptr) return invalid_argument("buffers: backend cuda needs MoeBuffers (see moe_buffer_sizes)");
    if (note->tokens != problem.num_tokens)
      return invalid_argument("saved: the forward ran on " + std::to_string(note->tokens) + " tokens, this backward on " +
                              std::to_string(problem.num_tokens));
    if (note->saved != buffers->saved || note->saved_bytes != buffers->saved_bytes)
      return invalid_argument("buffers.saved: not the saved buffer its forward wrote");
    return detail::cuda_backward(problem, options, inputs, dy, grads, *buffers);
  }
  MEGAMOE_RETURN_IF_ERROR(check_cpu_call(problem, inputs));
  return reference::simulate_backward(problem, options, {inputs}, {dy}, saved, {grads});
}

}  // namespace megamoe
