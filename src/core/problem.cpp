#include "megamoe/problem.h"

#include <string>

namespace megamoe {

Status validate_problem(const MoeProblem& p) {
  auto bad = [](const std::string& m) { return invalid_argument(m); };
  if (p.hidden <= 0 || p.hidden % kDimAlign != 0)
    return bad("hidden = " + std::to_string(p.hidden) + " must be a positive multiple of " +
               std::to_string(kDimAlign));
  if (p.intermediate <= 0 || p.intermediate % kDimAlign != 0)
    return bad("intermediate = " + std::to_string(p.intermediate) + " must be a positive multiple of " +
               std::to_string(kDimAlign));
  if (p.ep_size < 1) return bad("ep_size = " + std::to_string(p.ep_size) + " must be >= 1");
  if (p.ep_rank < 0 || p.ep_rank >= p.ep_size)
    return bad("ep_rank = " + std::to_string(p.ep_rank) + " is out of range [0, ep_size = " +
               std::to_string(p.ep_size) + ")");
  if (p.num_experts < 1) return bad("num_experts = " + std::to_string(p.num_experts) + " must be >= 1");
  if (p.num_experts % p.ep_size != 0)
    return bad("num_experts = " + std::to_string(p.num_experts) + " is not divisible by ep_size = " +
               std::to_string(p.ep_size));
  if (p.top_k < 1 || p.top_k > p.num_experts)
    return bad("top_k = " + std::to_string(p.top_k) + " must be in [1, num_experts = " +
               std::to_string(p.num_experts) + "]");
  if (p.num_tokens < 0) return bad("num_tokens = " + std::to_string(p.num_tokens) + " is negative");
  if (p.max_tokens_per_rank < 0)
    return bad("max_tokens_per_rank = " + std::to_string(p.max_tokens_per_rank) + " is negative");
  if (p.max_tokens_per_rank > 0 && p.num_tokens > p.max_tokens_per_rank)
    return capacity_error("num_tokens = " + std::to_string(p.num_tokens) + " exceeds max_tokens_per_rank = " +
                          std::to_string(p.max_tokens_per_rank) + " (the bound the caller set)");
  // Pool row indices and combine-slot indices are int32 on the device.
  int64_t worst_rows = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(p.ep_size), p.token_capacity(), &worst_rows) ||
      __builtin_mul_overflow(worst_rows, static_cast<int64_t>(p.top_k), &worst_rows) || worst_rows > (int64_t{1} << 30))
    return bad("ep_size * max_tokens_per_rank * top_k = " + std::to_string(p.ep_size) + " * " +
               std::to_string(p.token_capacity()) + " * " + std::to_string(p.top_k) +
               " exceeds 2^30 routed rows per rank");
  return Status::Ok();
}

double forward_flops(const MoeProblem& p) {
  return 6.0 * static_cast<double>(p.num_tokens) * p.top_k * static_cast<double>(p.hidden) *
         static_cast<double>(p.intermediate);
}

double backward_flops(const MoeProblem& p, SavePolicy policy) {
  const double base = static_cast<double>(p.num_tokens) * p.top_k * static_cast<double>(p.hidden) *
                      static_cast<double>(p.intermediate);
  return (policy == SavePolicy::kRecompute ? 16.0 : 12.0) * base;
}

}  // namespace megamoe
