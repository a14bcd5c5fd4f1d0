// Checks a finished forward+backward against the fp64 path on a sample, so
// that a large run can be verified at a small fraction of its cost:
//   tokens: a spread of rank 0's tokens with all their routes (y, dx, d topk_w
//           depend on nothing else);
//   expert: rank 0's most loaded local expert, with only the routes to it
//           (dW13[e], dW2[e] depend on nothing else).
#pragma once

#include <vector>

#include "testing/random_layer.h"

namespace megamoe::testing {

struct SampleErrors {
  double y = 0, dx = 0, d_topk_weights = 0, dw13 = 0, dw2 = 0;
  int64_t sampled_tokens = 0;
  int sampled_expert = -1;  // local id on rank 0
  int64_t expert_rows = 0;
};

// `problem` is the per-rank problem (ep_size = data.size()); outputs hold the
// run's results (any float dtypes). The fp64 path runs on the CPU.
Status check_sample_against_fp64(const MoeProblem& problem, const std::vector<LayerData>& data,
                                 const std::vector<LayerOutputs>& outputs, int64_t sample_tokens, int threads,
                                 SampleErrors* errors);

}  // namespace megamoe::testing
