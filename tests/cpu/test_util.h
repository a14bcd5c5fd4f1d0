// Helpers shared by the CPU tests: building problems, running the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/reference.h"
#include "testing/random_layer.h"

namespace megamoe::testing {

inline MoeProblem make_problem(int64_t T, int64_t H, int64_t I, int E, int k, int P = 1) {
  MoeProblem p;
  p.num_tokens = T;
  p.hidden = H;
  p.intermediate = I;
  p.num_experts = E;
  p.top_k = k;
  p.ep_size = P;
  p.max_tokens_per_rank = T;
  return p;
}

inline MoeOptions cpu_options(Precision precision = Precision::kBF16, SavePolicy save = SavePolicy::kKeep) {
  MoeOptions o;
  o.backend = Backend::kCPU;
  o.precision = precision;
  o.save_policy = save;
  return o;
}

// Forward + backward of one rank through the public API.
inline LayerOutputs run_layer(const MoeProblem& p, const MoeOptions& o, const LayerData& d,
                              DType wgrad = DType::kF32) {
  const DType fd = d.x.view.dtype;
  LayerOutputs out = make_layer_outputs(p, p.num_tokens, fd, fd == DType::kF64 ? DType::kF64 : wgrad, std::nan(""));
  MoeSaved saved;
  Status st = moe_forward(p, o, d.inputs(), out.y.view, &saved);
  EXPECT_TRUE(st.ok()) << st.to_string();
  st = moe_backward(p, o, d.inputs(), d.dy.view, saved, out.grads());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

// A copy of `d` with every float tensor converted to f64 (values unchanged).
inline LayerData to_f64(const LayerData& d) {
  auto conv = [](const HostTensor& t) {
    HostTensor o;
    o.storage.assign(static_cast<size_t>(t.view.numel()), 0);
    o.view = t.view;
    o.view.dtype = DType::kF64;
    o.view.data = o.storage.empty() ? nullptr : o.storage.data();
    const std::vector<double> v = t.to_f64();
    for (size_t i = 0; i < v.size(); ++i) o.set(static_cast<int64_t>(i), v[i]);
    return o;
  };
  LayerData o;
  o.x = conv(d.x);
  o.dy = conv(d.dy);
  o.w13 = conv(d.w13);
  o.w2 = conv(d.w2);
  o.topk_weights = conv(d.topk_weights);
  o.topk_idx = HostTensor(DType::kI32, {d.topk_idx.view.shape[0], d.topk_idx.view.shape[1]});
  for (int64_t i = 0; i < d.topk_idx.view.numel(); ++i) o.topk_idx.set(i, d.topk_idx.get(i));
  return o;
}

inline bool all_finite(const HostTensor& t) {
  for (double v : t.to_f64())
    if (!std::isfinite(v)) return false;
  return true;
}

inline double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  const std::vector<double> va = a.to_f64(), vb = b.to_f64();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, std::fabs(va[i] - vb[i]));
  return m;
}

}  // namespace megamoe::testing
