// The MoE layer's forward with expert parallelism inside one node
// (docs/ep-design.md). BF16; with an FP8 precision in the owner's dims the
// owner's GEMMs run in FP8 (the layer's steps, layer_steps.h); fp8's forward sends its
// rows in e4m3 with their scales (quantised by the source into its own
// slots, gathered by the owner straight into its e4m3 pool), the backward
// and fp8_bwd's forward send bf16 rows;
// the owner's scratch must then be sized for its dims' precision and
// LayerBuffers::fp8_weights hold its L local experts. Rank r holds its own tokens and experts
// [r L, (r + 1) L) (L = E / world). Three phases, each async on the call's
// stream, no host synchronisation:
//   send     check this rank's routing; copy its rows into its own slots and
//            push each token row once to every other rank that hosts one of
//            its experts, and every rank the routing and its weights
//            (cuda/comm/dispatch.h);
//   experts  once every source's flag says its part is in: this rank's
//            virtual token list, its plan (the one-GPU plan over
//            V = world x max_tokens virtual tokens and L experts), GEMM1 +
//            SwiGLU gathering its pool from the receive slots in its idle
//            producer warps, GEMM2 x
//            routing weight, whose epilogue stores each route's row straight
//            into its source's return slot [j][t] (over NVLink: the transfer
//            overlaps the GEMM), then the owner's flags (cuda/comm/combine.h);
//   combine  once every owner's flag says its part is in: this rank's k slots
//            summed in j order (the one-GPU combine_slots).
// Rows of an expert come in (source rank, token) order, as on one GPU, and
// each output element is the same dot product in the same order: y is
// bitwise the one-GPU layer's on the whole batch. layer_forward_ep runs the
// three phases in turn (layer_backward_ep the backward's six); one process
// driving several ranks on one GPU runs
// each phase for every rank before the next, all on one stream (a phase
// waits for the others', and the forward's kGateUp is a cooperative launch
// that needs every SM: on streams of their own, one rank's spin-wait could
// hold an SM that another rank's kGateUp waits for, until the wait gives up
// and reports a rank that did nothing wrong).
//
// Epochs: a forward takes one (ep.epoch), a backward two (ep.epoch and
// ep.epoch + 1); every call on a symmetric buffer must start above the last
// epoch any earlier call on it used (forward e, its backward e + 1 and e + 2,
// the next call e + 3 or more). The waits pass on flag >= epoch, so an epoch
// reused or taken out of order reads another call's data: the caller keeps one
// counter per buffer, the same on every rank.
//
// Reuse of the symmetric buffer from call to call needs no extra handshake as
// long as every rank runs a call's phases in order on one stream: a rank's
// send of call N + 1 follows its last wait of call N (the forward's combine,
// the backward's finish), which has seen every owner's flag of call N, raised
// only after that owner's last read of the rank's data; and an owner can
// return call N + 1's outputs only after that source's send of call N + 1,
// i.e. after the source has summed call N's. A rank that never comes is named
// by the waiting ranks' errors (kBarrierPeer) within errors.timeout_ns; y, dx
// and d topk_w are then NaN, never stale, and so are the pool rows an owner
// would have gathered from it.
//
// Scratch: a backward's six phases share the owner's scratch (dz lives from
// its experts phase to its weight-gradient phase) and the EP scratch (the
// routing check from send to combine); nothing else may use either in between
// (a layer runs its phases back to back on its stream).
//
// The backward (its own six phases below) uses two epochs, ep.epoch for dy
// and the returns, ep.epoch + 1 for x: dy goes out like x did, each owner
// runs kDownGrad, the d topk_w reduction, kGateUpGrad and dW2 on its pool,
// and returns dx rows and d topk_w values as the forward returned y; then x
// goes out once more (nothing kept x's rows: the forward's receive area
// belongs to the next call) for dW13, and each owner says when it has read
// it. dx, d topk_w, dW13 and dW2 are each bitwise the one-GPU layer's: the
// same rows meet the same weights in the same order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/comm/dispatch.h"
#include "cuda/comm/peer_memory.h"
#include "cuda/layer/call_buffers.h"
#include "cuda/layer/layer_call.h"
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
//   route_values   f32 [world * max_tokens, top_k]  the backward's d topk_w per virtual route
struct EpScratchLayout {
  size_t dispatch_done = 0, combine_done = 4, error_key = 8, source_counts = 256, virtual_idx = 0, route_values = 0,
         bytes = 0;
};
EpScratchLayout ep_scratch_layout(const DispatchLayout& layout);

// What this rank's forward keeps for its backward, beside the owner's saved
// buffer (plan and z: core/layer_buffers.h's saved layout for ep_owner_dims):
// per call, through the caller's allocator, 256-byte aligned.
//   source_counts  i64 [world]
//   virtual_idx    i32 [world * max_tokens, top_k]
//   weights        f32 [world * max_tokens, top_k]  the routing weights of the routes it computed
struct EpSavedLayout {
  size_t source_counts = 0, virtual_idx = 0, weights = 0, bytes = 0;
};
EpSavedLayout ep_saved_layout(const DispatchLayout& layout);

// The dims of this rank's expert work: V = world x max_tokens virtual tokens
// over L local experts. prepare_layer_call with these sizes the call's
// scratch and saved buffers (their layouts: core/layer_buffers.h).
LayerDims ep_owner_dims(const EpGroup& ep, int64_t intermediate);

// Where the owner's slot-writing GEMMs (kDown, kGateUpGrad) store each
// route's row: straight into its source rank's return area (over NVLink for
// another GPU's), so no copy of the k x V x H slot rows follows the GEMM and
// the transfer overlaps the GEMM's own compute. source_counts: this call's
// counts (the backward's reconciled with its forward's).
PeerSlots ep_return_slots(const EpGroup& ep, const int64_t* source_counts);

// One rank's call, checked and its buffers carved once, for its phases.
// owner_call from prepare_layer_call(ep_owner_dims(...), ..., slots_at_sources
// = true) with the buffers it will get (scratch: bytes_without_slots: the
// owner's slot rows go to the sources). `in`: this rank's x [tokens, H],
// topk_idx [tokens, k] (global ids), topk_weights [tokens, k], and its local
// w13 [L, 2I, H], w2 [L, H, I]. With owner_buffers.saved (saved_layout(
// ep_owner_dims)) and ep_saved (ep_saved_layout) the forward keeps what the
// backward needs; without both, nothing (owner_buffers.scratch then holds
// the plan); a backward needs both, from its forward.
struct EpCall {
  LayerCall owner;
  EpGroup ep;
  LayerInputs in;
  int64_t tokens = 0;
  LayerBuffers buffers;
  void* ep_saved = nullptr;
  CallBuffers buf;
};
Status make_ep_call(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                    const LayerBuffers& owner_buffers, void* ep_saved, EpCall* out);

// The forward's phases, in this order on every rank; y [tokens, H].
Status ep_forward_send(const EpCall& c);
Status ep_forward_experts(const EpCall& c);
Status ep_forward_combine(const EpCall& c, void* y);
Status layer_forward_ep(const EpCall& c, void* y);

// The backward's phases, in this order on every rank (c from this call's
// forward buffers; grads: this rank's dx [tokens, H] and d_topk_weights
// [tokens, k], its local dw13 [L, 2I, H] and dw2 [L, H, I]). Epoch ep.epoch
// carries dy and the returns, ep.epoch + 1 x and the owners' "read it" flags.
Status ep_backward_send_dy(const EpCall& c, const void* dy);
Status ep_backward_experts(const EpCall& c, const void* dy, const LayerGrads& grads);
Status ep_backward_combine(const EpCall& c, const LayerGrads& grads);
Status ep_backward_send_x(const EpCall& c);
Status ep_backward_weight_grads(const EpCall& c, const LayerGrads& grads);
Status ep_backward_finish(const EpCall& c);
Status layer_backward_ep(const EpCall& c, const void* dy, const LayerGrads& grads);

// Phase `phase` of a forward (0-2) and its backward (3-8), in the order above:
// for callers that run each phase for every rank before the next (ranks
// sharing a GPU). y, dy and grads as the phases above take them.
inline constexpr int kEpForwardPhases = 3, kEpPhases = 9;
Status run_ep_phase(const EpCall& c, int phase, void* y, const void* dy, const LayerGrads& grads);

}  // namespace megamoe::cuda
