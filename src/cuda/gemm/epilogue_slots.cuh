// The slot-writing epilogues (kDown: the weighted expert output; kGateUpGrad:
// dx's part): each tile row goes to its source token's slot [j, t] (or an
// expert-parallel source rank's return area), or, kDown in 128 x 256 tiles,
// to its own row in pool order. Device code; included by epilogues.cuh.
#pragma once

#include "cuda/gemm/epilogue_common.cuh"

namespace megamoe::cuda::engine {

// 128 x 128 tiles. kDirect: the FP8 kernels' 16-byte stores from a row-half
// staging tile; else (bf16) bulk copies of whole staged rows.
template <GemmMode M, bool kDirect>
struct SlotEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& sm, int /*cw*/) const {
    const GroupedGemmArgs& a = p.args;
    const DevicePlan& plan = a.plan;
    __nv_bfloat16* staging = sm.staging;
    // Weighted (forward) or plain (dx) expert output rows go to the source's slot [j, t].
    const int k = plan.top_k;
    const int64_t T = plan.num_tokens, N = a.n;
    auto* slots = static_cast<__nv_bfloat16*>(a.out.slots);
    const PeerSlots& peer = a.out.peer_slots;
    begin_slot_epilogue<M == GemmMode::kDown>(a.out.topk_weights, sm, [&](int32_t src) -> __nv_bfloat16* {
      if (src < 0) return nullptr;
      const int64_t v = src / k, j = src % k;
      if (peer.rank_buffers != nullptr) {  // the source rank's return area [k][tokens_per_rank][n]
        const int64_t rank = v / peer.tokens_per_rank, t = v - rank * peer.tokens_per_rank;
        if (t >= peer.source_counts[rank]) return nullptr;  // a missing (-1) or inconsistent source gets nothing
        auto* rank_slots = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(peer.rank_buffers[rank]) + peer.offset);
        return rank_slots + (j * peer.tokens_per_rank + t) * N + tile.n * kBlockN;
      }
      return slots + (j * T + v) * N + tile.n * kBlockN;
    });
    // Staged a row half at a time with kDirect (kRows 64), else the whole tile.
    constexpr int kParts = kDirect ? 2 : 1, kRows = kBlockM / kParts;
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (kDirect && h != part) continue;
        float w_row[2] = {1.0f, 1.0f};
        if constexpr (M == GemmMode::kDown) {
#pragma unroll
          for (int q = 0; q < 2; ++q) w_row[q] = sm.row_w[acc_row(h, 2 * q)];
        }
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
          const float w = w_row[(i >> 1) & 1];
          stage_pair(staging, kDirect ? 0 : h, i, w * acc[h][i], w * acc[h][i + 1]);
        }
      }
      store_rows<kRows, kBlockN, kBlockN, kDirect>(
          staging, [&](int r, int) -> __nv_bfloat16* { return sm.row_dst[part * kRows + r]; });
      if (part + 1 < kParts) staging_free();
    }
    return true;
  }
};
// kDown and kGateUpGrad in 128 x 256 tiles (bf16):
// consumer c holds rows [64c, 64c + 64) of the tile, acc[h] their columns
// [128h, 128h + 128) of the tile's 256. Each row (kDown: its routing weight
// times it; rounded to bf16: the narrow epilogue's values) goes to its
// source's slot [j, t], columns 256n..: a 128-column half at a time through
// the consumer's buffer (two 128B-swizzled 64 x 64 boxes, HalfTilePlaces),
// then 16-byte stores, 16 lanes a row (whole 32-byte sectors). Threads 0-63
// write the 64 rows' destinations (and kDown's weights) first (row_dst /
// row_w: [64] a consumer). This GPU's slots only (no peer slots).
template <GemmMode M>
struct WideSlotEpilogue {
  static_assert(M == GemmMode::kDown || M == GemmMode::kGateUpGrad, "the slot-writing modes");
  static constexpr bool kWeights = M == GemmMode::kDown;
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int /*cw*/) const {
    const GroupedGemmArgs& a = p.args;
    const int tid = static_cast<int>(threadIdx.x & 127);
    const int k = a.plan.top_k;
    const int64_t T = a.plan.num_tokens, N = a.n;
    auto* slots = static_cast<__nv_bfloat16*>(a.out.slots);
    const float w = kWeights && ctx.my_src >= 0 ? a.out.topk_weights[ctx.my_src] : 0.0f;
    consumer_sync();  // every thread is done with the previous tile's row_dst, row_w and buffer
    if (tid < 64) {
      const int32_t src = ctx.my_src;
      ctx.row_dst[tid] = src < 0 ? nullptr : slots + ((src % k) * T + src / k) * N + tile.n * 256;
      if constexpr (kWeights) ctx.row_w[tid] = w;  // (kGateUpGrad's row destinations have no room for weights)
    }
    consumer_sync();
    float w_row[2] = {1.0f, 1.0f};
#pragma unroll
    for (int q = 0; kWeights && q < 2; ++q) w_row[q] = ctx.row_w[acc_row(0, 2 * q)];
    const uint32_t buf = smem_u32(ctx.boxes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h > 0) consumer_sync();  // every thread has read the first half out of the buffer
      const HalfTilePlaces place;
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const float wq = w_row[(i >> 1) & 1];
        *static_cast<__nv_bfloat162*>(__cvta_shared_to_generic(buf + place(i))) =
            __floats2bfloat162_rn(wq * acc[h][i], wq * acc[h][i + 1]);
      }
      consumer_sync();
#pragma unroll 4
      for (int c = tid; c < 64 * 16; c += 128) {  // 16-byte chunk c % 16 of row c / 16
        const int r = c >> 4, chunk = c & 15;
        __nv_bfloat16* dst = ctx.row_dst[r];
        if (dst == nullptr) continue;
        const uint32_t at = buf + (chunk >> 3) * kBoxBytes + r * 128 + (((chunk & 7) ^ (r & 7)) << 4);
        *reinterpret_cast<uint4*>(dst + 128 * h + 8 * chunk) =
            *static_cast<const uint4*>(__cvta_shared_to_generic(at));
      }
    }
    return true;
  }
};

// kDown in 128 x 256 tiles into pool-order rows (GemmOutputs::pool_rows): consumer c's
// rows [64c, 64c + 64) of the tile, each times its routing weight (0 for a
// padding row), rounded to bf16 (the slot epilogues' values), go to the
// same rows of pool_rows [C, n] in pool order by TMA, a 128-column half (acc[h])
// at a time through the consumer's two 128B-swizzled boxes, as
// WideGateUpEpilogue stores z: two 64 x 64 box stores a half instead of 64
// row destinations and 16-byte stores. Threads 0-63 share the rows'
// weights through row_w first.
struct WidePoolDownEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    const GroupedGemmArgs& a = p.args;
    const int tid = static_cast<int>(threadIdx.x & 127);
    const BoxStores out(ctx.boxes, tile.m * kBlockM + 64 * cw);
    const float w = ctx.my_src >= 0 ? a.out.topk_weights[ctx.my_src] : 0.0f;  // (its load overlaps the barrier)
    out.begin();  // (also: every thread is done with the previous tile's row_w)
    if (tid < 64) ctx.row_w[tid] = w;
    consumer_sync();
    float w_row[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) w_row[q] = ctx.row_w[acc_row(0, 2 * q)];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h > 0) out.begin();
      out.stage(0, [&](int i) { return w_row[(i >> 1) & 1] * acc[h][i]; });  // (i, i + 1: one row, one weight)
      out.publish();
      out.store(ctx.out_map[0], 0, tile.n * 256 + 128 * h);
    }
    return true;
  }
};

// kDown in 128 x 256 tiles: pool-order rows when asked for (GemmOutputs::pool_rows), else slots.
struct WideDownEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    return p.args.out.pool_rows != nullptr ? WidePoolDownEpilogue{}(p, tile, acc, ctx, cw)
                                           : WideSlotEpilogue<GemmMode::kDown>{}(p, tile, acc, ctx, cw);
  }
};

}  // namespace megamoe::cuda::engine
