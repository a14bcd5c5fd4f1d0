// Validation in front of the CPU reference: the public simulate_* entry points.
#include <string>

#include "core/tensor_check.h"
#include "megamoe/reference.h"
#include "reference/moe_reference.h"

namespace megamoe::reference {
namespace {

Status check_rank_count(const MoeProblem& p, size_t n, const char* what) {
  if (static_cast<int>(n) != p.ep_size)
    return invalid_argument(std::string(what) + ": expected one entry per rank (ep_size = " +
                            std::to_string(p.ep_size) + "), got " + std::to_string(n));
  return Status::Ok();
}

// Validates every rank's inputs; returns the shared float mode.
Status check_all_inputs(const MoeProblem& problem, const std::vector<MoeInputs>& ranks, FloatMode* mode) {
  MEGAMOE_RETURN_IF_ERROR(check_rank_count(problem, ranks.size(), "inputs"));
  for (int r = 0; r < problem.ep_size; ++r) {
    const std::string who = problem.ep_size > 1 ? "rank " + std::to_string(r) + ": " : "";
    MoeProblem pr = problem;
    pr.ep_rank = r;
    pr.num_tokens = ranks[r].x.rank >= 1 ? ranks[r].x.shape[0] : 0;
    Status st = validate_problem(pr);
    if (st.ok()) {
      FloatMode m;
      st = check_inputs(pr, ranks[r], DeviceType::kCPU, &m);
      if (st.ok() && r > 0 && m != *mode) st = invalid_argument("x: all ranks must use the same dtype");
      *mode = m;
    }
    if (!st.ok()) return Status(st.code(), who + st.message());
  }
  return Status::Ok();
}

Numerics numerics_for(const MoeOptions& o, FloatMode mode) {
  return Numerics{mode == FloatMode::kF64, o.precision, o.fp8_scale_mode};
}

}  // namespace

Status simulate_forward(const MoeProblem& problem, const MoeOptions& options,
                        const std::vector<MoeInputs>& per_rank_inputs, const std::vector<TensorView>& per_rank_y,
                        MoeSaved* saved) {
  FloatMode mode = FloatMode::kBF16;
  MEGAMOE_RETURN_IF_ERROR(check_all_inputs(problem, per_rank_inputs, &mode));
  MEGAMOE_RETURN_IF_ERROR(check_rank_count(problem, per_rank_y.size(), "y"));
  for (int r = 0; r < problem.ep_size; ++r)
    MEGAMOE_RETURN_IF_ERROR(
        check_output("y", per_rank_y[r], per_rank_inputs[r].x.shape[0], problem.hidden, mode, DeviceType::kCPU));
  return run_forward(problem, numerics_for(options, mode), options.save_policy, options.cpu_threads,
                     per_rank_inputs, per_rank_y, saved);
}

Status simulate_backward(const MoeProblem& problem, const MoeOptions& options,
                         const std::vector<MoeInputs>& per_rank_inputs, const std::vector<TensorView>& per_rank_dy,
                         const MoeSaved& saved, const std::vector<MoeGrads>& per_rank_grads) {
  FloatMode mode = FloatMode::kBF16;
  MEGAMOE_RETURN_IF_ERROR(check_all_inputs(problem, per_rank_inputs, &mode));
  MEGAMOE_RETURN_IF_ERROR(check_rank_count(problem, per_rank_dy.size(), "dy"));
  MEGAMOE_RETURN_IF_ERROR(check_rank_count(problem, per_rank_grads.size(), "grads"));
  for (int r = 0; r < problem.ep_size; ++r) {
    const int64_t T = per_rank_inputs[r].x.shape[0];
    MEGAMOE_RETURN_IF_ERROR(check_output("dy", per_rank_dy[r], T, problem.hidden, mode, DeviceType::kCPU));
    MEGAMOE_RETURN_IF_ERROR(check_grads(problem, options, per_rank_grads[r], T, mode, DeviceType::kCPU));
  }
  const auto* state = dynamic_cast<const ReferenceSaved*>(saved.impl());
  if (state == nullptr) return invalid_argument("saved: empty, or not from a CPU forward (run moe_forward first)");
  const MoeProblem& sp = state->problem;
  if (sp.hidden != problem.hidden || sp.intermediate != problem.intermediate ||
      sp.num_experts != problem.num_experts || sp.top_k != problem.top_k || sp.ep_size != problem.ep_size)
    return invalid_argument("saved: the forward was run for a different problem shape");
  const Numerics num = numerics_for(options, mode);
  if (state->numerics.precision != num.precision || state->numerics.exact != num.exact ||
      state->numerics.scale_mode != num.scale_mode)
    return invalid_argument(std::string("saved: the forward ran with precision ") +
                            to_string(state->numerics.precision) + ", the backward asks for " +
                            to_string(num.precision) + " (or a different dtype/scale mode)");
  for (int r = 0; r < problem.ep_size; ++r)
    if (state->plan.ranks[r].num_tokens != per_rank_inputs[r].x.shape[0])
      return invalid_argument("saved: the forward saw " + std::to_string(state->plan.ranks[r].num_tokens) +
                              " tokens on rank " + std::to_string(r) + ", the backward " +
                              std::to_string(per_rank_inputs[r].x.shape[0]));
  return run_backward(problem, num, options.cpu_threads, per_rank_inputs, per_rank_dy, saved, per_rank_grads,
                      options.accumulate_weight_grads);
}

}  // namespace megamoe::reference
