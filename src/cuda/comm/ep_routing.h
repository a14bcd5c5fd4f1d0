// Expert parallelism, the owner's side of the routing: from the routing every
// source rank delivered with its dispatch (cuda/comm/dispatch.h) and this
// rank's own, the "virtual token list" that lets the one-GPU routing plan
// (cuda/plan/device_plan.h) build this rank's pool as docs/routing-plan.md
// orders it.
//
// Virtual token v = s * max_tokens + t is token t of source rank s (tokens
// at or past rank s's count are empty). Its k entries are the token's experts
// that live on this rank, as local ids (e - rank * experts_per_rank), and -1
// for the others. Planned over V = world * max_tokens virtual tokens and L =
// experts_per_rank experts, an expert's rows come in (source rank, token)
// order, exactly the EP plan's order; row_src = v * k + j names source s = v /
// max_tokens, token t = v % max_tokens and slot j.
//
// First one thread per source waits (bounded by errors.timeout_ns;
// system-scope acquire, with backoff) for that source's flag to reach `epoch`
// and records its token count, or -1 for a source that never came (reported:
// kBarrierPeer, naming the rank). Then the list is filled from those counts,
// with no further waiting: one decision per source. A missing source's
// virtual tokens are empty. No host synchronisation. Sizes stay within int32
// (row_src = v * k + j is int32 in the plan).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/comm/dispatch.h"
#include "cuda/common/device_errors.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

struct EpRoutingArgs {
  const void* buffer = nullptr;       // this rank's symmetric buffer (DispatchLayout)
  int rank = 0;
  const int32_t* own_topk_idx = nullptr;  // [own_tokens, top_k] global ids
  int64_t own_tokens = 0;
  int experts_per_rank = 0;
  uint32_t epoch = 0;
  DeviceErrorSink errors;
  int64_t* source_counts = nullptr;   // scratch [world] on the device
  int32_t* virtual_idx = nullptr;     // out: [world * max_tokens, top_k] local ids or -1
};

Status build_ep_virtual_routing(const DispatchLayout& layout, const EpRoutingArgs& args, cudaStream_t stream);

// The owner's pool [capacity, hidden] bf16 from where the rows are: pool row r
// with row_src[r] = v * k + j (v = s * max_tokens + t) is token t of rank s,
// read from own_x for this rank's own tokens, else from slot [s][t] of the
// receive area in `buffer`; padding rows (row_src -1) are zeros. Rows past
// *pool_rows (at most capacity) are not touched. It waits for nothing: run it
// after build_ep_virtual_routing and the plan, on the same stream. With
// source_counts (this epoch's, from build_ep_virtual_routing), a row of a token
// its source did not deliver this time (count -1, or t past it: a plan kept
// from an earlier epoch) is NaN, never the stale slot. (The backward's
// owners pool dy and x with it; the forward's pool comes from the receive
// area as a token matrix, the layer's gate/up step.)
Status gather_ep_rows(const DispatchLayout& layout, const void* buffer, int rank, const void* own_x,
                      const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, void* pool,
                      cudaStream_t stream, const int64_t* source_counts = nullptr);

// The FP8 forward's form: the pool's e4m3 rows q [capacity, hidden] and
// their row scales [capacity, hidden / 128] from the slots' e4m3 form
// (dispatch.h), this rank's own rows included (its own slots): bitwise what
// gather_quantize_e4m3_rows makes of x on one GPU. Padding rows get zeros and
// scale 1 (what the quantizer gives a zero tile); a row its source did not
// deliver, NaN bytes and a NaN scale. Rows past *pool_rows are not touched.
Status gather_ep_rows_e4m3(const DispatchLayout& layout, const void* buffer, const int32_t* row_src,
                           const int32_t* pool_rows, int64_t capacity, uint8_t* q, float* scales, cudaStream_t stream,
                           const int64_t* source_counts = nullptr);

}  // namespace megamoe::cuda
