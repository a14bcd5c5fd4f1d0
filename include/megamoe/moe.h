// Entry points: one MoE layer, forward and backward, on one rank.
//
// Tensors (row-major; "bf16 | f64" means: bf16 for the real path, f64 for the
// CPU reference's exact mode used by gradient checks):
//   x            [T, H]        bf16 | f64
//   topk_idx     [T, k]        i32   global expert id, -1 = no route
//   topk_weights [T, k]        f32 | f64
//   w13          [E/P, 2I, H]  bf16 | f64   rows [0,I) gate, [I,2I) up
//   w2           [E/P, H, I]   bf16 | f64
//   y, dy, dx    [T, H]        bf16 | f64
//   d_topk_weights [T, k]      f32 | f64
//   dw13, dw2    like w13, w2: bf16 (overwritten) or f32 (overwritten, or
//                added to with MoeOptions::accumulate_weight_grads) | f64
#pragma once

#include <memory>

#include "megamoe/problem.h"
#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe {

struct MoeInputs {
  TensorView x, topk_idx, topk_weights, w13, w2;
};

struct MoeGrads {
  TensorView dx, d_topk_weights, dw13, dw2;
};

// What the forward leaves for the backward (pooled x and z with kKeep, the
// routing plan always). Opaque; owned by the caller between the two calls.
class MoeSaved {
 public:
  struct Impl;
  MoeSaved();
  ~MoeSaved();
  MoeSaved(MoeSaved&&) noexcept;
  MoeSaved& operator=(MoeSaved&&) noexcept;
  bool valid() const;
  Impl* impl() const { return impl_.get(); }
  void reset(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Which backend a call with `options.backend` would use on this machine, and
// why ("auto: no CUDA device found, using cpu").
Status resolve_backend(const MoeOptions& options, Backend* chosen, std::string* reason);

// y = sum_j topk_w[t,j] * w2[e] @ (silu(g) * u), (g, u) = w13[e] @ x[t].
// `saved` may be null when no backward will follow.
Status moe_forward(const MoeProblem& problem, const MoeOptions& options,
                   const MoeInputs& inputs, const TensorView& y, MoeSaved* saved);

// Gradients of <y, dy> w.r.t. x, topk_weights, w13, w2. `saved` comes from
// moe_forward on the same inputs and options.
Status moe_backward(const MoeProblem& problem, const MoeOptions& options,
                    const MoeInputs& inputs, const TensorView& dy, const MoeSaved& saved,
                    const MoeGrads& grads);

}  // namespace megamoe
