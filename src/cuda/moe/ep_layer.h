// The MoE layer's forward with expert parallelism inside one node
// (docs/ep-design.md), BF16. Rank r holds its own tokens and experts
// [r L, (r + 1) L) (L = E / world). Three phases, each async on the call's
// stream, no host synchronisation:
//   send     check this rank's routing; push each token row once to every
//            other rank that hosts one of its experts, and every rank the
//            routing and its weights (cuda/comm/dispatch.h);
//   experts  once every source's flag says its part is in: this rank's
//            virtual token list, its plan (the one-GPU plan over
//            V = world x max_tokens virtual tokens and L experts), the pool
//            gathered from x and the receive slots, GEMM1 + SwiGLU, GEMM2 x
//            routing weight into the slots [k][V][H], and each route's output
//            pushed back to its source (cuda/comm/combine.h);
//   combine  once every owner's flag says its part is in: this rank's k slots
//            summed in j order (the one-GPU combine_slots).
// Rows of an expert come in (source rank, token) order, as on one GPU, and
// each output element is the same dot product in the same order: y is
// bitwise the one-GPU layer's on the whole batch. layer_forward_ep runs the
// three phases in turn; one process driving several ranks on one GPU runs
// each phase for every rank before the next (a phase waits for the others').
//
// Reuse of the symmetric buffer from call to call needs no extra handshake as
// long as every rank runs send, experts, combine of a call in that order on
// one stream: a rank's send of call N + 1 follows its combine of call N, which
// has waited for every owner's return flag of call N, which each owner raises
// after its GEMMs have read the last of call N's rows and weights; and an
// owner can return call N + 1's outputs only after that source's send of call
// N + 1, i.e. after the source has summed call N's. A rank that never comes is
// named by the waiting ranks' errors (kBarrierPeer) within errors.timeout_ns,
// and their y is NaN, never stale.
// Not yet: the backward, and saving what it needs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/comm/dispatch.h"
#include "cuda/comm/peer_memory.h"
#include "cuda/moe/cuda_layer.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

// One rank's part of the group, for one call.
struct EpGroup {
  PeerView view;          // the group's symmetric buffer (layout below)
  DispatchLayout layout;  // world = view.world; max_tokens: the most tokens any rank brings
  int num_experts = 0;    // E over the whole group, a multiple of world
  uint32_t epoch = 0;     // > 0, growing from call to call, the same on every rank
  void* scratch = nullptr;  // ep_scratch_layout(layout).bytes, 256-byte aligned, zeroed once before first use
};

// This rank's small EP scratch (its own device memory, not shared):
//   dispatch_done  u32   the push's block counter (0 between calls)
//   combine_done   u32   the return push's block counter (0 between calls)
//   error_key      u64   the check of this rank's routing (device_plan.h's encoding)
//   source_counts  i64 [world]           each source's token count this call (-1: never came)
//   virtual_idx    i32 [world * max_tokens, top_k]  local expert ids or -1 (cuda/comm/ep_routing.h)
struct EpScratchLayout {
  size_t dispatch_done = 0, combine_done = 4, error_key = 8, source_counts = 256, virtual_idx = 0, bytes = 0;
};
EpScratchLayout ep_scratch_layout(const DispatchLayout& layout);

// The dims of this rank's expert work: V = world x max_tokens virtual tokens
// over L local experts. prepare_layer_call with these sizes the call's
// scratch (moe buffer layouts: core/layer_buffers.h; nothing is saved).
LayerDims ep_owner_dims(const EpGroup& ep, int64_t intermediate);

// `in`: this rank's x [tokens, H], topk_idx [tokens, k] (global ids),
// topk_weights [tokens, k], and its local w13 [L, 2I, H], w2 [L, H, I].
// owner_call from prepare_layer_call(ep_owner_dims(...)); y [tokens, H].
Status ep_forward_send(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens);
Status ep_forward_experts(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                          const LayerBuffers& owner_buffers);
Status ep_forward_combine(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                          void* y);
Status layer_forward_ep(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                        void* y, const LayerBuffers& owner_buffers);

}  // namespace megamoe::cuda
