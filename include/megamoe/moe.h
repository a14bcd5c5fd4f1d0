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

#include <cstddef>
#include <memory>
#include <string>

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

// Device memory of the CUDA backend for one layer: sized once from
// problem.max_tokens_per_rank (the routing plan, the expert-major pools, the
// combine slots and the saved activations of the last forward) and reused by
// every call. A backward must follow its forward on the same workspace
// before the next forward on it (one workspace per layer).
class MoeWorkspace {
 public:
  struct Impl;
  // Allocates on options' CUDA device `device` (the only allocation).
  static Status create(const MoeProblem& problem, const MoeOptions& options, int device,
                       std::unique_ptr<MoeWorkspace>* out);
  // Bytes create() would allocate for this problem.
  static size_t bytes_for(const MoeProblem& problem);
  ~MoeWorkspace();
  size_t size_bytes() const;
  int64_t max_tokens() const;
  // Waits for `options.cuda_stream` and reports routing errors the device found
  // in the last call (ids out of range, duplicate experts); outputs of such a
  // call are NaN. The only call here that synchronises.
  Status check_device_errors(const MoeOptions& options) const;
  Impl* impl() const { return impl_.get(); }

 private:
  explicit MoeWorkspace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Which backend a call with `options.backend` would use on this machine, and
// why ("auto: no CUDA device found, using cpu"). For a call, auto follows
// the tensors: CUDA tensors run on cuda, CPU tensors on cpu.
Status resolve_backend(const MoeOptions& options, Backend* chosen, std::string* reason);

// y = sum_j topk_w[t,j] * w2[e] @ (silu(g) * u), (g, u) = w13[e] @ x[t].
// `saved` may be null when no backward will follow. Backend cuda needs
// `workspace` (and bf16 CUDA tensors); the CPU backend ignores it.
Status moe_forward(const MoeProblem& problem, const MoeOptions& options,
                   const MoeInputs& inputs, const TensorView& y, MoeSaved* saved,
                   MoeWorkspace* workspace = nullptr);

// Gradients of <y, dy> w.r.t. x, topk_weights, w13, w2. `saved` comes from
// moe_forward on the same inputs, options and workspace.
Status moe_backward(const MoeProblem& problem, const MoeOptions& options,
                    const MoeInputs& inputs, const TensorView& dy, const MoeSaved& saved,
                    const MoeGrads& grads, MoeWorkspace* workspace = nullptr);

}  // namespace megamoe
