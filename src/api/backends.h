// The backends behind moe_forward / moe_backward.
#pragma once

#include <string>

#include "megamoe/moe.h"

namespace megamoe::detail {

// Whether the CUDA layer can run here; *why says why not.
bool cuda_layer_available(std::string* why);

// The CUDA layer on caller-provided buffers. The forward writes the saved
// buffer when buffers.saved is set; the backward reads it, or recomputes when
// it is null. Pairing forward and backward is the caller's job (moe_forward /
// moe_backward check it through MoeSaved; the Python binding through autograd).
Status cuda_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& y, const MoeBuffers& buffers);
Status cuda_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                     const TensorView& dy, const MoeGrads& grads, const MoeBuffers& buffers);
Status cuda_check_device_errors(int device, void* stream);

}  // namespace megamoe::detail
