#include "cuda/comm/dispatch.h"

#include <algorithm>
#include <string>

#include "cuda/comm/peer_ops.cuh"
#include "cuda/common/cuda_status.h"

namespace megamoe::cuda {
namespace {

constexpr int kWarps = 8;  // per block; one warp per token at a time

__global__ void push_rows_kernel(PeerView v, DispatchLayout layout, DispatchArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t chunks = (a.row_bytes > 0 ? a.row_bytes : layout.slot_bytes()) / 16;  // 16-byte pieces of a row
  const int k = layout.top_k;
  for (int64_t t = warp; t < a.tokens; t += warps) {
    // The ranks this token goes to: one bit per rank, from its k expert ids.
    // An id out of range sends nothing here (the routing plan reports it).
    const int e = lane < k ? a.topk_idx[t * k + lane] : -1;
    const int owner = e >= 0 ? e / a.experts_per_rank : -1;
    const uint32_t mine = owner >= 0 && owner < v.world ? 1u << owner : 0u;
    uint32_t ranks = __reduce_or_sync(0xFFFFFFFFu, mine) & ~(1u << v.rank);
    if (a.own_slot) ranks |= 1u << v.rank;  // v.peers[v.rank] is this rank's own buffer
    // Every other rank gets the token's routing, wherever its row goes.
    if (lane < k)
      for (int d = 0; d < v.world; ++d)
        if (d != v.rank)
          *reinterpret_cast<int32_t*>(static_cast<char*>(v.peers[d]) + layout.ids_offset(v.rank, t) + 4 * lane) = e;
    // And its routing weights, to this rank too: owners scale their outputs by them.
    if (a.topk_weights != nullptr && lane < k) {
      const float w = a.topk_weights[t * k + lane];
      for (int d = 0; d < v.world; ++d)
        *reinterpret_cast<float*>(static_cast<char*>(v.peers[d]) + layout.weights_offset(v.rank, t) + 4 * lane) = w;
    }
    const auto* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) + t * layout.slot_bytes());
    while (ranks != 0) {
      const int d = __ffs(ranks) - 1;
      ranks &= ranks - 1;
      comm::warp_copy_row(reinterpret_cast<uint4*>(static_cast<char*>(v.peers[d]) + layout.slot_offset(v.rank, t)),
                          src, chunks, lane);
    }
  }
  if (!comm::last_block_done(a.blocks_done)) return;
  for (int d = 0; d < v.world; ++d) {
    if (d == v.rank) continue;
    char* peer = static_cast<char*>(v.peers[d]);
    reinterpret_cast<uint32_t*>(peer + DispatchLayout::kTokensOffset)[v.rank] = static_cast<uint32_t>(a.tokens);
    comm::store_release_sys(reinterpret_cast<uint32_t*>(peer) + v.rank, a.epoch);
  }
}

}  // namespace

Status check_dispatch(const PeerView& v, const DispatchLayout& layout, const DispatchArgs& a) {
  if (v.world < 1 || v.world > 8 || v.rank < 0 || v.rank >= v.world || v.peers == nullptr)
    return invalid_argument("dispatch: a bad peer view (rank " + std::to_string(v.rank) + " of " +
                            std::to_string(v.world) + ")");
  if (layout.world != v.world) return invalid_argument("dispatch: the layout is for another world size");
  if (layout.hidden <= 0 || layout.slot_bytes() % 16 != 0)
    return invalid_argument("dispatch: hidden = " + std::to_string(layout.hidden) + " must be a positive multiple of 8");
  if (layout.bytes() > v.bytes)
    return invalid_argument("dispatch: the layout needs " + std::to_string(layout.bytes()) +
                            " bytes per rank; the symmetric buffer has " + std::to_string(v.bytes));
  if (a.tokens < 0 || a.tokens > layout.max_tokens)
    return invalid_argument("dispatch: " + std::to_string(a.tokens) + " tokens, but the receive area holds " +
                            std::to_string(layout.max_tokens) + " per source rank");
  if (layout.top_k < 1 || layout.top_k > 32)
    return invalid_argument("dispatch: top_k = " + std::to_string(layout.top_k) + " is not in [1, 32]");
  if (a.experts_per_rank < 1) return invalid_argument("dispatch: experts_per_rank must be >= 1");
  if (a.epoch == 0) return invalid_argument("dispatch: epoch 0 is the flags' initial value; start at 1");
  if (a.row_bytes < 0 || a.row_bytes % 16 != 0 || a.row_bytes > static_cast<int64_t>(layout.slot_bytes()))
    return invalid_argument("dispatch: row_bytes = " + std::to_string(a.row_bytes) +
                            " must be a multiple of 16 no larger than a slot (" + std::to_string(layout.slot_bytes()) +
                            " bytes)");
  // A rank without tokens still raises its flags (its empty tensors may be null).
  if ((a.tokens > 0 && (a.x == nullptr || a.topk_idx == nullptr)) || a.blocks_done == nullptr)
    return invalid_argument("dispatch: a pointer is null");
  // Rows move as 16-byte pieces.
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0 || reinterpret_cast<uintptr_t>(v.local) % 16 != 0)
    return invalid_argument("dispatch: x and the symmetric buffer must be 16-byte aligned");
  return Status::Ok();
}

Status dispatch_push(const PeerView& v, const DispatchLayout& layout, const DispatchArgs& a, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_dispatch(v, layout, a));
  const int64_t blocks = std::min<int64_t>((a.tokens + kWarps - 1) / kWarps, 1024);
  push_rows_kernel<<<static_cast<unsigned>(blocks < 1 ? 1 : blocks), kWarps * 32, 0, stream>>>(v, layout, a);
  return cuda_status("dispatch: push", cudaGetLastError());
}

}  // namespace megamoe::cuda
