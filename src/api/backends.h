// The backends behind moe_forward / moe_backward.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/moe.h"

namespace megamoe::detail {

// Whether the CUDA layer can run here; *why says why not.
bool cuda_layer_available(std::string* why);

// The CUDA layer on caller-provided buffers. The forward writes the saved
// buffer when buffers.saved is set; the backward reads it, or recomputes when
// it is null. Pairing forward and backward is the caller's job (moe_forward /
// moe_backward check it through MoeSaved; the Python binding through autograd).
Status cuda_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                    const TensorView& y, const MoeBuffers& buffers);
Status cuda_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                     const TensorView& dy, const MoeGrads& grads, const MoeBuffers& buffers);
Status cuda_check_device_errors(int device, void* stream);
Status cuda_fill_fp8_weights(const MoeProblem& problem, const MoeOptions& options, const TensorView& w13,
                             const TensorView& w2, const MoeBuffers& buffers);

// Peer-memory self-check (cuda/comm/peer_check.h) on one rank's view, for
// views a caller built (PyTorch symmetric memory). phase 0: write this rank's
// payload into every rank's buffer (async). phase 1, after every rank's phase
// 0 completed: count this rank's wrong words into *wrong (synchronises stream).
struct PeerViewArgs {
  int rank, world;
  void* local;
  void* const* peers;  // device array [world]
  uint64_t bytes;
};
Status cuda_peer_check(int phase, const PeerViewArgs& view, void* stream, int64_t* wrong);

// Expert parallelism (c_api.h's megamoe_ep_*): the group's memory and this call's epoch.
struct EpArgs {
  void* local;
  void* const* peers;  // device array [ep_size]
  uint64_t bytes;
  int64_t max_tokens;
  void* ep_scratch;
  uint64_t ep_scratch_bytes;
  uint32_t epoch;
};
struct EpSizes {
  uint64_t symmetric_bytes, ep_scratch_bytes, scratch_bytes, saved_bytes;
  uint64_t fp8_weights_bytes;  // this rank's E / P experts' FP8 weight buffer (0 for bf16)
};
Status cuda_ep_sizes(const MoeProblem& problem, const MoeOptions& options, int64_t max_tokens, bool will_backward,
                     EpSizes* out);
Status cuda_ep_forward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                       const TensorView& y, const EpArgs& ep, const MoeBuffers& buffers);
Status cuda_ep_backward(const MoeProblem& problem, const MoeOptions& options, const MoeInputs& inputs,
                        const TensorView& dy, const MoeGrads& grads, const EpArgs& ep, const MoeBuffers& buffers);

}  // namespace megamoe::detail
