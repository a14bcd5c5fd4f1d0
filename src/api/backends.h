// The backends behind moe_forward / moe_backward.
#pragma once

#include <string>

#include "megamoe/moe.h"

namespace megamoe::detail {

// Whether the CUDA layer can run here; *why says why not.
bool cuda_layer_available(std::string* why);

Status cuda_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& y, MoeSaved* saved, MoeWorkspace* workspace);
Status cuda_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                     const TensorView& dy, const MoeSaved& saved, const MoeGrads& grads, MoeWorkspace* workspace);

}  // namespace megamoe::detail
