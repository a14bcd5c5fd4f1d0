// Expert-parallel combine, the return half (docs/ep-design.md): every owner
// sends the expert output of each route it computed back to the route's
// source rank, into the source's combine slot [j][t] (DispatchLayout's return
// area), then raises its combine flag [owner] on every rank (release, system
// scope). The source waits for every owner's flag (combine_wait, bounded),
// then sums its k slots in j order with the one-GPU combine_slots: the same
// bf16 rows summed in the same order as with EP = 1, so y is bitwise EP = 1's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/comm/dispatch.h"
#include "cuda/comm/peer_memory.h"
#include "cuda/common/device_errors.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

struct CombineArgs {
  // bf16 [top_k][world * max_tokens][hidden]: this owner's output of route
  // (virtual token v, slot j) at [j][v] (virtual tokens: cuda/comm/ep_routing.h).
  // Null when the rows are already in the sources' slots (the GEMM epilogue
  // wrote them there: GroupedGemmArgs::peer_slots): then only route_values,
  // if given, and the flags go out, after the writes on `stream`.
  const void* outputs = nullptr;
  const int32_t* virtual_idx = nullptr;    // [world * max_tokens, top_k]: >= 0 where this owner computed the route
  const int64_t* source_counts = nullptr;  // [world]: each source's token count (-1: a source that never came)
  // Or null. f32 [world * max_tokens * top_k]: a value per route (v, j) at
  // v * k + j, sent with its row to the source's route_values [t][j] (the
  // backward returns d topk_w this way).
  const float* route_values = nullptr;
  uint32_t epoch = 0;
  uint32_t* blocks_done = nullptr;  // device u32, 0 before the first call; one per stream
};

// The owner's side: async on `stream`.
Status combine_push(const PeerView& view, const DispatchLayout& layout, const CombineArgs& args,
                    cudaStream_t stream);

// The owner raises its combine flag on every source whose routing came
// (source_counts >= 0) and returns nothing: "I am done reading your data of
// this epoch". After whatever read it on `stream`.
Status combine_signal(const PeerView& view, const DispatchLayout& layout, const int64_t* source_counts,
                      uint32_t epoch, cudaStream_t stream);

// The source's route values after combine_wait: out[t, j] = route_values[t, j]
// for routes with 0 <= topk_idx[t, j] < num_experts, 0 for the others; all
// NaN when error_key says the routing (or a peer) failed, as combine_slots.
Status combine_route_values(const DispatchLayout& layout, const void* buffer, const int32_t* topk_idx,
                            int64_t tokens, int num_experts, const unsigned long long* error_key, float* out,
                            cudaStream_t stream);

// The source's side: until every owner's combine flag in `buffer` (this
// rank's symmetric buffer) reaches `epoch`; an owner that never comes is
// reported by rank (kBarrierPeer) and, when `poison_key` is given (the
// routing check's error key that combine_slots reads), marks it failed
// (kPlanErrorPeer), so that the sum comes out NaN instead of stale slots.
// Async on `stream`: run combine_slots after it.
Status combine_wait(const DispatchLayout& layout, const void* buffer, uint32_t epoch, const DeviceErrorSink& errors,
                    cudaStream_t stream, unsigned long long* poison_key = nullptr);

}  // namespace megamoe::cuda
