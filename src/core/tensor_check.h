// Validation of TensorViews against a MoeProblem: every message names the
// tensor and says what was expected.
#pragma once

#include <initializer_list>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe {

// bf16 storage (what the GPU uses) or f64 (the reference's exact mode).
enum class FloatMode { kBF16, kF64 };

Status check_view(const char* name, const TensorView& v, std::initializer_list<int64_t> shape,
                  std::initializer_list<DType> dtypes, DeviceType device);

// Checks inputs of one rank; T is x.shape[0]. Sets *mode from x's dtype.
Status check_inputs(const MoeProblem& p, const MoeInputs& in, DeviceType device, FloatMode* mode);
Status check_output(const char* name, const TensorView& v, int64_t tokens, int64_t hidden, FloatMode mode,
                    DeviceType device);
Status check_grads(const MoeProblem& p, const MoeOptions& o, const MoeGrads& g, int64_t tokens, FloatMode mode,
                   DeviceType device);

}  // namespace megamoe
