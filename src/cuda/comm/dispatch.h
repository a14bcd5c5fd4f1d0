// Expert-parallel dispatch, the push half (docs/ep-design.md): each source
// rank sends every token row once to each other rank that hosts at least one
// of the token's experts, into that rank's receive area at slot [source][token].
// It also sends every rank the routing of all its tokens (their k
// expert ids and its token count): from that each owner builds its plan on
// the device, with no host in between. Once everything for a rank is written
// it stores the call's epoch into that rank's flag [source] (release, system
// scope). The owner's GEMMs then read the rows where they landed; its own
// tokens from its own slots (own_slot, or an FP8 forward's e4m3 rows, which
// its send wrote earlier on the same stream) or from its own x.
//
// Each rank's symmetric buffer (one PeerView allocation, the same on every rank):
//   byte 0                  flags u32 [world]: flag[s] = epoch of the last call
//                           whose data from rank s has all landed here
//   byte 64                 combine flags u32 [world] (cuda/comm/combine.h)
//   byte 128                tokens u32 [world]: rank s's token count in that call
//   byte kRecvOffset (256)  recv bf16 [world][max_tokens][hidden]: slot [s][t] =
//                           token t of rank s (written only where it must go);
//                           in an FP8 forward, the slot's first
//                           e4m3_slot_bytes(hidden) bytes hold the row in e4m3
//                           and its hidden / 128 f32 scales after (fp8/quantize.h;
//                           the source quantises its rows into its own slots
//                           [own rank][t], unused otherwise, and pushes those bytes)
//   byte ids_offset()       ids i32 [world][max_tokens][top_k]: the routing of
//                           every token of rank s (-1 = no route)
//   byte weights_offset()   weights f32 [world][max_tokens][top_k]: their routing
//                           weights, own rank's included (sent when given), so
//                           that an owner reads route (v, j)'s weight at v * k + j
//   byte combine_slots_offset()  (128-aligned) bf16 [top_k][max_tokens][hidden]: the
//                           expert outputs of this rank's routes (slot [j][t],
//                           t < its token count), written by their owners: by
//                           the owner's GEMM epilogue straight over NVLink
//                           (GroupedGemmArgs::peer_slots), or copied
//                           (cuda/comm/combine.h)
//   byte route_values_offset()   (128-aligned) f32 [own tokens][top_k]: one value per
//                           route returned with them (the backward's d topk_w)
// Slots [own rank][...] hold this rank's own rows only when asked (DispatchArgs::own_slot)
// or as an FP8 forward's own e4m3 rows; otherwise they are unused. With own
// rows there and the others pushed, recv holds every row of the virtual token
// matrix [world * max_tokens][hidden] of cuda/comm/ep_routing.h that this
// rank's plan uses, and its GEMM gathers from it in place. Capacity: max_tokens slots per source and
// a token goes at most once to a rank, so nothing can overflow; tokens >
// max_tokens is an error before any write. Expert e lives on rank
// e / experts_per_rank.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/host_device.h"
#include "cuda/comm/peer_memory.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

struct DispatchLayout {
  static constexpr size_t kTokensOffset = 128, kRecvOffset = 256;
  int world = 1;
  int64_t max_tokens = 0, hidden = 0;
  int top_k = 0;

  MEGAMOE_HD size_t slot_bytes() const { return static_cast<size_t>(hidden) * 2; }
  MEGAMOE_HD size_t slot_offset(int src, int64_t token) const {
    return kRecvOffset + (static_cast<size_t>(src) * max_tokens + token) * slot_bytes();
  }
  MEGAMOE_HD size_t ids_offset(int src = 0, int64_t token = 0) const {
    return kRecvOffset + static_cast<size_t>(world) * max_tokens * slot_bytes() +
           (static_cast<size_t>(src) * max_tokens + token) * top_k * 4;
  }
  // The combine's return area (cuda/comm/combine.h): this rank's own routes'
  // expert outputs, slots [j][t] of [top_k][max_tokens] (combine_slots reads it
  // with slot_tokens = max_tokens), written by the owners. Its flags: combine
  // flag [owner] at byte 64.
  static constexpr size_t kCombineFlagsOffset = 64;
  MEGAMOE_HD size_t weights_offset(int src = 0, int64_t token = 0) const {
    return ids_offset(world, 0) + (static_cast<size_t>(src) * max_tokens + token) * top_k * 4;
  }
  // Rounded up to 128 bytes: rows move as 16-byte pieces whatever the ids' size.
  MEGAMOE_HD size_t combine_slots_offset() const { return (weights_offset(world, 0) + 127) & ~size_t{127}; }
  MEGAMOE_HD size_t combine_slot_offset(int j, int64_t token) const {
    return combine_slots_offset() + (static_cast<size_t>(j) * max_tokens + token) * slot_bytes();
  }
  MEGAMOE_HD size_t route_values_offset() const {
    return (combine_slots_offset() + static_cast<size_t>(top_k) * max_tokens * slot_bytes() + 127) & ~size_t{127};
  }
  // Rounded up to 256 bytes: peer memory is allocated in multiples of 256.
  MEGAMOE_HD size_t bytes() const {
    const size_t end = route_values_offset() + static_cast<size_t>(max_tokens) * top_k * 4;
    return (end + 255) & ~size_t{255};
  }
};

// The push does not wait for the receivers to be done with the slots, ids,
// weights and count of the previous call before it overwrites them: its
// caller orders that. The EP layer (cuda/layer/ep_layer.h) does so by
// construction: a rank sends call N + 1 only after its combine of call N has
// seen every owner's return flag, which each owner raises after its last
// read of call N's data.
struct DispatchArgs {
  const void* x = nullptr;            // bf16 [tokens, hidden], this rank's tokens (row stride slot_bytes())
  // Bytes of each row pushed (a multiple of 16, at most slot_bytes()); 0: the
  // whole row. An FP8 forward pushes its e4m3 slots (e4m3_slot_bytes(hidden)),
  // x then pointing at its own slots [own rank][0].
  int64_t row_bytes = 0;
  // Also store each row (all `tokens`, routed anywhere or not) into this
  // rank's own slot [rank][t]: a local write beside the push, which reads the
  // row anyway.
  bool own_slot = false;
  const int32_t* topk_idx = nullptr;  // [tokens, layout.top_k] global expert ids, -1 = no route
  const float* topk_weights = nullptr;  // [tokens, layout.top_k] or null: sent to every rank, this one too
  int64_t tokens = 0;
  int experts_per_rank = 0;
  uint32_t epoch = 0;                 // > 0, growing from call to call
  uint32_t* blocks_done = nullptr;    // device u32, 0 before the first call (the kernel leaves it 0);
                                      // one per stream: concurrent calls must not share it
};

// The push's argument checks alone (dispatch_push runs them first): for a
// caller that writes into its own slots before it pushes them.
Status check_dispatch(const PeerView& view, const DispatchLayout& layout, const DispatchArgs& args);

// Async on `stream`; the rows and flags land on the peers when it completes.
Status dispatch_push(const PeerView& view, const DispatchLayout& layout, const DispatchArgs& args,
                     cudaStream_t stream);

}  // namespace megamoe::cuda
