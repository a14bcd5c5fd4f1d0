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

// What a forward leaves for its backward. Opaque; owned by the caller between
// the two calls. CPU backend: the reference's intermediates. CUDA backend: a
// note of the saved buffer (MoeBuffers::saved) the forward wrote, checked by
// the backward; the data itself lives in that buffer.
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

// Device memory of the CUDA backend. The library allocates nothing per call
// or per layer; the caller passes two buffers, three with FP8 (byte layouts in
// src/core/layer_buffers.h, docs/routing-plan.md):
//  - scratch: needed during a call only. Give every layer on a device (and
//    stream) the same one, sized for the largest call; 256-byte aligned.
//  - saved: written by a forward, read by its backward (the routing plan and
//    z with SavePolicy::kKeep). Per call, from the caller's allocator; null
//    with kRecompute or when no backward follows (then saved_bytes is 0).
//  - fp8_weights (precision fp8 / fp8_bwd only): the layer's expert weights
//    in e4m3 with their block scales, in both orientations (layout:
//    Fp8WeightLayout). One per layer, kept by the caller across calls: a call
//    with fp8_weights_ready = false quantises w13 and w2 into it before its
//    GEMMs (both orientations, whatever the call); a call with true reads it
//    as it is. So a trainer passes false once per optimizer step (the first
//    call after the weights changed) and true until they change again; true
//    on a stale buffer computes with the old weights. 256-byte aligned.
//    Needed by every call that reads it (fp8: all; fp8_bwd: the backward);
//    an fp8_bwd forward given one fills it (when not ready) for its backward.
struct MoeBuffers {
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  void* saved = nullptr;
  size_t saved_bytes = 0;
  void* fp8_weights = nullptr;
  size_t fp8_weights_bytes = 0;
  bool fp8_weights_ready = false;
};

struct MoeBufferSizes {
  size_t scratch_bytes = 0;
  size_t saved_bytes = 0;        // 0 unless a backward follows and the policy is kKeep
  size_t fp8_weights_bytes = 0;  // 0 unless the precision is fp8 or fp8_bwd (per layer, not per call)
};

// Fills buffers.fp8_weights from w13 and w2 (backend cuda, precision fp8 or
// fp8_bwd; bf16 CUDA tensors), as a call with fp8_weights_ready = false does
// before its GEMMs; async on options.cuda_stream. For callers that refresh the
// buffer apart from the layer calls (the Python binding).
Status moe_fill_fp8_weights(const MoeProblem& problem, const MoeOptions& options, const TensorView& w13,
                            const TensorView& w2, const MoeBuffers& buffers);

// Sizes of both buffers for a call of problem.num_tokens tokens. A backward
// must get the same saved buffer as its forward and scratch of the size given
// here for the same `will_backward`. Fails (Capacity) when the sizes overflow.
Status moe_buffer_sizes(const MoeProblem& problem, const MoeOptions& options, bool will_backward,
                        MoeBufferSizes* out);

// Waits for `cuda_stream` and reports any error the kernels found on `device`
// (a routing error, a spin-wait that timed out), then clears it. Without this
// call such an error is returned by the next moe_forward / moe_backward on the
// device that starts after the failing kernel has run (no synchronisation);
// MoeOptions::validate makes every call check before it returns.
Status check_device_errors(int device, void* cuda_stream);

// Which backend a call with `options.backend` would use on this machine, and
// why ("auto: no CUDA device found, using cpu"). For a call, auto follows
// the tensors: CUDA tensors run on cuda, CPU tensors on cpu.
Status resolve_backend(const MoeOptions& options, Backend* chosen, std::string* reason);

// y = sum_j topk_w[t,j] * w2[e] @ (silu(g) * u), (g, u) = w13[e] @ x[t].
// `saved` may be null when no backward will follow. Backend cuda needs
// `buffers` (and bf16 CUDA tensors); the CPU backend ignores them.
Status moe_forward(const MoeProblem& problem, const MoeOptions& options,
                   const MoeInputs& inputs, const TensorView& y, MoeSaved* saved,
                   const MoeBuffers* buffers = nullptr);

// Gradients of <y, dy> w.r.t. x, topk_weights, w13, w2. `saved` comes from
// moe_forward on the same inputs and options; on CUDA `buffers` holds the
// same saved buffer as that forward's (scratch may be any large enough).
Status moe_backward(const MoeProblem& problem, const MoeOptions& options,
                    const MoeInputs& inputs, const TensorView& dy, const MoeSaved& saved,
                    const MoeGrads& grads, const MoeBuffers* buffers = nullptr);

}  // namespace megamoe
