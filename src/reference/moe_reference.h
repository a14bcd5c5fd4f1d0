// The CPU reference of one MoE layer with P expert-parallel ranks simulated
// in one process. It follows the data flow the GPU kernels use (routing plan
// -> expert-major pools -> GEMM1 -> SwiGLU -> GEMM2 -> weighted per-slot
// combine -> fixed-order sum; and the reverse in the backward), so every
// intermediate has a counterpart to compare against.
//
// Rounding points in the emulated (non-exact) mode, i.e. where the GPU stores
// a value in a narrower type (docs/numerics.md):
//   z = GEMM1 (fp32 accumulate) -> bf16;  a = silu(g) * u -> bf16
//   combine slot w * o -> bf16; y = fixed-order fp32 sum over j -> bf16
//   dz -> bf16; dx slot -> bf16; dx = fp32 sum over j -> bf16
//   w * a (dW2 operand) -> bf16; d topk_w, dW13, dW2 accumulate in fp32
// Quantised precisions additionally fake-quantise GEMM operands (numerics.h).
#pragma once

#include <vector>

#include "core/saved_state.h"
#include "core/routing_plan.h"
#include "megamoe/moe.h"

namespace megamoe::reference {

struct Numerics {
  bool exact = false;  // fp64 arithmetic with no storage rounding: the "fp64 path"
  Precision precision = Precision::kBF16;
  ScaleMode scale_mode = ScaleMode::kFloat32;
};

struct ReferenceSaved : MoeSaved::Impl {
  ReferenceSaved() : Impl(Backend::kCPU) {}
  MoeProblem problem;
  Numerics numerics;
  SavePolicy policy = SavePolicy::kKeep;
  RoutingPlan plan;
  // kKeep only, per owner rank: pooled x [pool_rows, H] and z [pool_rows, 2I].
  std::vector<std::vector<double>> pool_x, pool_z;
};

// The unvalidated core (callers check the views). Float tensors may be bf16,
// f32 or f64 in any mix; `numerics` alone decides the arithmetic. ranks[r]
// holds rank r's tokens and its E/P local experts; problem.ep_size == ranks.size().
// An output view with a null data pointer is not computed/stored (dw13 and
// dw2 both null: no weight gradients for that rank).
Status run_forward(const MoeProblem& problem, const Numerics& numerics, SavePolicy policy, int threads,
                   const std::vector<MoeInputs>& ranks, const std::vector<TensorView>& y, MoeSaved* saved);

Status run_backward(const MoeProblem& problem, const Numerics& numerics, int threads,
                    const std::vector<MoeInputs>& ranks, const std::vector<TensorView>& dy, const MoeSaved& saved,
                    const std::vector<MoeGrads>& grads, bool accumulate_weight_grads);

// Tensor element access for any float dtype (bf16 stores round to nearest even).
void load_elements(const TensorView& v, int64_t offset, int64_t count, double* out);
void store_elements(const TensorView& v, int64_t offset, int64_t count, const double* in, bool accumulate);

}  // namespace megamoe::reference
