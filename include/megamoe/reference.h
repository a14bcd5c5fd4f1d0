// The CPU reference with P expert-parallel ranks simulated in one process:
// every rank's inputs at once, the same routing plan, pools and fixed-order
// combine the GPU kernels use. moe_forward/moe_backward with backend kCPU is
// the P = 1 case of this.
#pragma once

#include <vector>

#include "megamoe/moe.h"

namespace megamoe::reference {

// `problem` gives the shapes and P (= ranks.size()); ep_rank and num_tokens
// are ignored: each rank's T is its x.shape[0] (<= max_tokens_per_rank).
// per_rank_inputs[r].w13/w2 hold rank r's E/P local experts.
Status simulate_forward(const MoeProblem& problem, const MoeOptions& options,
                        const std::vector<MoeInputs>& per_rank_inputs,
                        const std::vector<TensorView>& per_rank_y, MoeSaved* saved);

Status simulate_backward(const MoeProblem& problem, const MoeOptions& options,
                         const std::vector<MoeInputs>& per_rank_inputs,
                         const std::vector<TensorView>& per_rank_dy, const MoeSaved& saved,
                         const std::vector<MoeGrads>& per_rank_grads);

}  // namespace megamoe::reference
