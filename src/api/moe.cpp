// Public entry points: validation, backend choice, dispatch.
#include "megamoe/moe.h"

#include <string>

#include "api/saved_state.h"
#include "core/tensor_check.h"
#include "cuda/device_query.h"
#include "megamoe/reference.h"

namespace megamoe {

MoeSaved::MoeSaved() = default;
MoeSaved::~MoeSaved() = default;
MoeSaved::MoeSaved(MoeSaved&&) noexcept = default;
MoeSaved& MoeSaved::operator=(MoeSaved&&) noexcept = default;
bool MoeSaved::valid() const { return impl_ != nullptr; }
void MoeSaved::reset(std::unique_ptr<Impl> impl) { impl_ = std::move(impl); }

namespace {

// The fused CUDA layer does not exist yet (issue #3); until it does, a request
// for it fails clearly instead of silently running something else.
constexpr bool kCudaLayerImplemented = false;

Status cuda_backend_status() {
  std::string why;
  if (cuda::device_count(&why) == 0) return unavailable("backend cuda: " + why);
  if (!kCudaLayerImplemented) return unimplemented("backend cuda: the CUDA MoE layer is not implemented yet");
  return Status::Ok();
}

Status check_call(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs, Backend* chosen) {
  MEGAMOE_RETURN_IF_ERROR(validate_problem(problem));
  std::string reason;
  MEGAMOE_RETURN_IF_ERROR(resolve_backend(options, chosen, &reason));
  if (*chosen == Backend::kCUDA) return cuda_backend_status();
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

}  // namespace

Status resolve_backend(const MoeOptions& options, Backend* chosen, std::string* reason) {
  switch (options.backend) {
    case Backend::kCPU:
      *chosen = Backend::kCPU;
      *reason = "cpu: requested";
      return Status::Ok();
    case Backend::kCUDA:
      if (options.precision == Precision::kMXFP8)
        return unimplemented("precision mxfp8 needs Blackwell tensor cores (1x32 E8M0 block scaling); "
                             "on Hopper only the CPU reference emulates it");
      *chosen = Backend::kCUDA;
      *reason = "cuda: requested";
      return Status::Ok();
    case Backend::kAuto: {
      const Status cuda = cuda_backend_status();
      if (cuda.ok() && options.precision != Precision::kMXFP8) {
        *chosen = Backend::kCUDA;
        *reason = "auto: CUDA device found, using cuda";
      } else {
        *chosen = Backend::kCPU;
        *reason = "auto: using cpu (" + (cuda.ok() ? std::string("mxfp8 has no Hopper kernel") : cuda.message()) + ")";
      }
      return Status::Ok();
    }
  }
  return invalid_argument("backend: unknown value");
}

Status moe_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                   const TensorView& y, MoeSaved* saved) {
  Backend backend;
  MEGAMOE_RETURN_IF_ERROR(check_call(problem, options, inputs, &backend));
  return reference::simulate_forward(problem, options, {inputs}, {y}, saved);
}

Status moe_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& dy, const MoeSaved& saved, const MoeGrads& grads) {
  Backend backend;
  MEGAMOE_RETURN_IF_ERROR(check_call(problem, options, inputs, &backend));
  if (saved.impl() != nullptr && saved.impl()->backend != backend)
    return invalid_argument(std::string("saved: produced by backend ") + to_string(saved.impl()->backend) +
                            ", backward runs on " + to_string(backend));
  return reference::simulate_backward(problem, options, {inputs}, {dy}, saved, {grads});
}

}  // namespace megamoe
