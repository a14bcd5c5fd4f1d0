// The fused epilogue of each engine mode, one functor per mode:
// Epilogue<M>{}(params, tile, acc, smem) turns a consumer's finished 128 x 128
// fp32 tile (acc[h]: rows [64h, 64h + 64)) into the mode's outputs. Device
// code; included by grouped_gemm.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/fp8/e4m3.cuh"
#include "cuda/gemm/engine_config.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/quad_transpose.h"
#include "cuda/gemm/tile_scheduler.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

using namespace ptx;

// sigmoid through the approximate reciprocal (MUFU.RCP, ~1 ulp): the IEEE
// division put a branch and a call around every element, which kept the
// compiler from overlapping an epilogue's loads, math and stores. exp(-g)
// overflowing to inf gives rcp(inf) = 0, the right limit.
__device__ __forceinline__ float sigmoid_f(float g) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + __expf(-g)));
  return r;
}
__device__ __forceinline__ float silu_f(float g) { return g * sigmoid_f(g); }
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// A consumer's tile is two wgmma accumulators, acc[h] for rows [64h, 64h + 64).
// Row of the tile held by element i of acc[h] in this thread, and its column.
__device__ __forceinline__ int acc_row(int h, int i) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  return h * 64 + warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int acc_col(int i) { return 8 * (i >> 2) + 2 * (threadIdx.x & 3) + (i & 1); }

// Where this thread's accumulator pair (h, i) (elements i and i + 1 of acc[h]:
// row acc_row(h, i), columns acc_col(i) and + 1) sits in its row half of the
// tile, stored as two 128B-swizzled 64 x 64 boxes (column half ch at byte
// ch * 8 KB) as TMA lays out kDownGrad's z chunk. In a box, row r is the 128
// bytes at r * 128 and its 16-byte chunk j sits at chunk j ^ (r % 8). For
// the pair: ch = i / 32, r = 16 warp + lane / 4 + 8 ((i / 2) % 2), so
// r % 8 = lane / 4; j = (i / 4) % 8; byte 4 (lane % 4) of the chunk. The
// offset is thus a part fixed per thread, plus one fixed per i, plus the
// chunk XOR-ed with lane / 4: two registers, not one offset per pair. The
// lane id is read fresh (lane_id) so that two passes over a chunk do not
// share, and keep alive, each other's offsets.
struct HalfTilePlaces {
  uint32_t thread_part, chunk_xor;
  __device__ __forceinline__ HalfTilePlaces() {
    const uint32_t lane = lane_id(), warp = (threadIdx.x >> 5) & 3;
    thread_part = (warp * 16 + lane / 4) * 128 + 4 * (lane % 4);
    chunk_xor = (lane / 4) << 4;
  }
  __device__ __forceinline__ uint32_t operator()(int i) const {
    return thread_part + (i / 32) * kBoxBytes + ((i >> 1) & 1) * 8 * 128 + ((((i >> 2) & 7) << 4) ^ chunk_xor);
  }
};


// Accumulator elements i and i + 1 are adjacent columns of one row: stage them
// as one bf16x2 word.
__device__ __forceinline__ void stage_pair(__nv_bfloat16* staging, int h, int i, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(staging + acc_row(h, i) * kStagingLd + acc_col(i)) = __floats2bfloat162_rn(v0, v1);
}

// Barrier of one consumer warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { named_barrier(threadIdx.x >> 7, 128); }

// The consumer warpgroup's 128 threads store a staged [kRows][kCols] bf16 tile:
// dst(r, s) is the destination of row r's segment s of kSeg columns (nullptr:
// skip it). The warpgroup syncs first (every row staged); the staging tile may
// be written again after staging_free(). Two ways:
//  - kDirect (the FP8 kernels): 16-byte stores, consecutive lanes on
//    consecutive chunks of a row (whole 32-byte sectors per warp), from a
//    staging tile of a row half (kRows 64: kEpilogueBytesOf). No TMA:
//    one bulk copy per row segment (128 to 384 a tile) goes through the SM's
//    TMA unit, which the producer's stage loads need (FP8 kGateUp -9% at
//    235B with these stores, perf-log session 25).
//  - else (bf16) thread r's row r as bulk copies that run on while the
//    consumer goes on (faster than stores from registers for bf16: kDown 816
//    -> 702 us at 30B, session 18). Every thread first fences its staging
//    writes toward the async proxy.
template <int kRows, int kCols, int kSeg, bool kDirect, typename SegFn>
__device__ __forceinline__ void store_rows(const __nv_bfloat16* staging, SegFn dst) {
  static_assert(kCols % kSeg == 0 && kSeg % 8 == 0, "rows and segments are whole 16-byte chunks");
  static_assert(kRows == kBlockM || (kDirect && kRows == kBlockM / 2), "bulk copies: a thread a row");
  if constexpr (kDirect) {
    constexpr int kChunks = kCols / 8, kSegChunks = kSeg / 8;
    consumer_sync();
#pragma unroll 4
    for (int c = threadIdx.x & 127; c < kRows * kChunks; c += 128) {
      const int r = c / kChunks, k = c % kChunks;
      __nv_bfloat16* d = dst(r, k / kSegChunks);
      if (d != nullptr)
        *reinterpret_cast<uint4*>(d + (k % kSegChunks) * 8) =
            *reinterpret_cast<const uint4*>(staging + r * kStagingLd + k * 8);
    }
  } else {
    fence_proxy_async_shared();
    consumer_sync();
    const int r = threadIdx.x & 127;
#pragma unroll
    for (int s = 0; s < kCols / kSeg; ++s) {
      __nv_bfloat16* d = dst(r, s);
      if (d != nullptr) bulk_store(d, staging + r * kStagingLd + s * kSeg, static_cast<uint32_t>(kSeg * sizeof(__nv_bfloat16)));
    }
    bulk_commit_group();
  }
}

// The staging tile may be overwritten: every thread's stores or bulk copies have read it.
__device__ __forceinline__ void staging_free() {
  bulk_wait_group_read<0>();
  consumer_sync();
}


// What one consumer's epilogue works with besides the accumulators. Its own
// buffer (kEpilogueBytes) is the staging tile or, in kDownGrad, the z chunk.
struct EpilogueContext {
  __nv_bfloat16* staging;  // kStaged modes: [128][kStagingLd] bf16 (FP8: [64][kStagingLd], a row half)
  __nv_bfloat16** row_dst;  // [128] ([64] wide kDown) kDown, kGateUpGrad: where each tile row goes (its slot, this tile's columns; nullptr: nowhere)
  float* row_w;             // [128] ([64] wide kDown) kDown: each tile row's routing weight (0 for a padding row)
  uint8_t* z_chunk;        // kDownGrad: [g cols 0-63 | g 64-127 | u 0-63 | u 64-127], 64 x 64 swizzled boxes
  uint64_t* z_full;        // kDownGrad: completes when a z chunk has landed
  uint32_t z_waits;        // kDownGrad: chunks waited for so far (z_full's phase)
  // kDown, kGateUpGrad: row_src of this thread's tile row (thread r of the
  // warpgroup: row r), loaded before the tile's main loop, so that the
  // epilogue does not start by waiting for it (kHoldRows: loaded in the
  // epilogue, after the tile's rows are in).
  int32_t my_src;
  const BoundedWait* waits;
  const CUtensorMap* z_map;       // kDownGrad: the saved z [C, 2I]
  const CUtensorMap* out_map[2];  // kDownGrad: dz [C, 2I] and wa [C, I]
};

// What every epilogue starts with: the barrier after which the previous
// tile's stores have finished reading staging (staging_free).
__device__ __forceinline__ void begin_epilogue() { staging_free(); }

// The slot-writing modes' start (kDown, kGateUpGrad): after the barrier, which
// also frees row_dst, each row's destination dst_of(its row_src) goes to
// row_dst, a thread a row, with kDown's routing weight to row_w; kDown meets
// at the barrier once more, because the staging reads every row's weight.
// The stores read the destinations from shared memory, and the slot
// arithmetic (a 64-bit division by top_k) runs once a row, not once a 16-byte
// chunk (the FP8 kernels' plain stores: kDown 2030 -> 2300 us at 235B before,
// session 25). The row's source comes loaded (EpilogueContext::my_src); its
// weight's load overlaps the barrier. Until session 27 each thread loaded the
// sources and weights of its accumulator rows in the staging loop of each
// row half: three dependent global loads a tile between main loop and stores.
template <bool kWeights, typename DstOf>
__device__ __forceinline__ void begin_slot_epilogue(const float* topk_weights, const EpilogueContext& sm,
                                                    DstOf dst_of) {
  const int tid = threadIdx.x & 127;  // thread of this consumer warpgroup: one tile row
  float w = 0.0f;
  if constexpr (kWeights) w = sm.my_src >= 0 ? topk_weights[sm.my_src] : 0.0f;
  staging_free();
  sm.row_dst[tid] = dst_of(sm.my_src);
  if constexpr (kWeights) {
    sm.row_w[tid] = w;
    consumer_sync();
  }
}

// kDirect: the staged modes store with plain stores (store_rows; the FP8 kernels).
template <GemmMode M, bool kDirect>
struct Epilogue;

// kGateUp: z (keep) and a = silu(g) u, both bf16, to the pools.
template <bool kDirect>
struct Epilogue<GemmMode::kGateUp, kDirect> {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& sm) const {
    const GroupedGemmArgs& a = p.args;
    __nv_bfloat16* staging = sm.staging;
    const int64_t I = a.intermediate;
    const int64_t pool_row0 = static_cast<int64_t>(tile.m) * kBlockM;
    begin_epilogue();
    // acc columns [0, 64): gate g, [64, 128): up u, both for a-columns 64n + c.
    auto* z_pool = static_cast<__nv_bfloat16*>(a.out0);
    auto* a_pool = static_cast<__nv_bfloat16*>(a.out1);
    // Staged a row half at a time with kDirect (kRows 64), else the whole tile.
    constexpr int kParts = kDirect ? 2 : 1, kRows = kBlockM / kParts;
    if (z_pool != nullptr) {
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (kDirect && h != part) continue;
#pragma unroll
          for (int i = 0; i < 64; i += 2) stage_pair(staging, kDirect ? 0 : h, i, acc[h][i], acc[h][i + 1]);
        }
        store_rows<kRows, kBlockN, 64, kDirect>(staging, [&](int r, int s) {  // s = 0: gate columns, 1: up columns
          return z_pool + (pool_row0 + part * kRows + r) * 2 * I + s * I + tile.n * 64;
        });
        staging_free();
      }
    }
    if (a_pool != nullptr) {  // null when the backward recomputes z only
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (kDirect && h != part) continue;
#pragma unroll
          for (int i = 0; i < 32; i += 2) {  // elements i (gate) and i + 32 (up) share row and column
            const float g0 = round_bf16(acc[h][i]), u0 = round_bf16(acc[h][i + 32]);
            const float g1 = round_bf16(acc[h][i + 1]), u1 = round_bf16(acc[h][i + 33]);
            stage_pair(staging, kDirect ? 0 : h, i, silu_f(g0) * u0, silu_f(g1) * u1);
          }
        }
        store_rows<kRows, 64, 64, kDirect>(staging, [&](int r, int) {
          return a_pool + (pool_row0 + part * kRows + r) * I + tile.n * 64;
        });
        if (part + 1 < kParts) staging_free();
      }
    }
    return true;
  }
};

// A consumer's 64 tile rows [row, row + 64) out in pool order through its
// buffer of 128B-swizzled 64 x 64 boxes (HalfTilePlaces) by TMA box stores,
// issued by thread 0 of the warpgroup: the wide epilogues of pool-order
// outputs (kGateUp's z and a, kDown's rows with down_to_pool).
struct BoxStores {
  uint8_t* buffer;
  int row;
  __device__ __forceinline__ BoxStores(uint8_t* buf, int first_row) : buffer(buf), row(first_row) {}
  __device__ __forceinline__ static bool storer() { return (threadIdx.x & 127) == 0; }
  // The buffer's previous stores have read it (and every thread is past what it did before).
  __device__ __forceinline__ void begin() const {
    if (storer()) bulk_wait_group_read<0>();
    consumer_sync();
  }
  // value(i), value(i + 1) of every accumulator pair into boxes b, b + 1.
  template <typename Value>
  __device__ __forceinline__ void stage(int b, Value value) const {
    const uint32_t buf = smem_u32(buffer);
    const HalfTilePlaces place;
#pragma unroll
    for (int i = 0; i < 64; i += 2)
      *static_cast<__nv_bfloat162*>(__cvta_shared_to_generic(buf + b * kBoxBytes + place(i))) =
          __floats2bfloat162_rn(value(i), value(i + 1));
  }
  // Every thread's writes, before the TMA stores read them.
  __device__ __forceinline__ void publish() const {
    fence_proxy_async_shared();
    consumer_sync();
  }
  // Boxes b, b + 1 to columns c0, c0 + 64 of `map`.
  __device__ __forceinline__ void store(const CUtensorMap* map, int b, int c0) const {
    if (!storer()) return;
    tma_store_2d(map, buffer + b * kBoxBytes, c0, row);
    tma_store_2d(map, buffer + (b + 1) * kBoxBytes, c0 + 64, row);
    bulk_commit_group();
  }
};

// kGateUp in 128 x 256 tiles (grouped_gemm.cu's kWide, bf16): consumer cw
// holds rows [64 cw, 64 cw + 64) of the tile, acc[0] their 128 gate columns
// and acc[1] the matching 128 up columns (a-columns 128 n + c: register i of
// both is the same row and column). z's gate half, its up half and a = silu(g) u
// (the values and roundings of the 128 x 128 epilogue above) pass through the
// consumer's buffer of kWideBoxes 128B-swizzled 64 x 64 boxes (HalfTilePlaces:
// a 64-row x 128-column part in two boxes) and leave by TMA stores
// (out_map[0]: z [C, 2I], out_map[1]: a [C, I]): with two boxes the three
// parts one after another, with four z's two halves at once. One thread
// issues the stores and waits for their reads before the buffer is written
// again (the next part, or the next tile's epilogue).
struct WideGateUpEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    const GroupedGemmArgs& a = p.args;
    const int I = static_cast<int>(a.intermediate);
    const int col0 = tile.n * 128;
    const BoxStores out(ctx.z_chunk, tile.m * kBlockM + 64 * cw);
    auto gate = [&](int i) { return acc[0][i]; };
    auto up = [&](int i) { return acc[1][i]; };
    if (a.out0 != nullptr) {  // z: gate columns at 128 n, up columns I further on
      out.begin();
      out.stage(0, gate);
      if constexpr (kWideBoxes >= 4) {
        out.stage(2, up);
        out.publish();
        out.store(ctx.out_map[0], 0, col0);
        out.store(ctx.out_map[0], 2, I + col0);
      } else {
        out.publish();
        out.store(ctx.out_map[0], 0, col0);
        out.begin();
        out.stage(0, up);
        out.publish();
        out.store(ctx.out_map[0], 0, I + col0);
      }
    }
    if (a.out1 != nullptr) {  // null when the backward recomputes z only
      out.begin();
      out.stage(0, [&](int i) { return silu_f(round_bf16(acc[0][i])) * round_bf16(acc[1][i]); });
      out.publish();
      out.store(ctx.out_map[1], 0, col0);
    }
    return true;
  }
};

// kDown (weighted expert output) and kGateUpGrad (dx part): rows to the source token's slot [j, t].
template <GemmMode M, bool kDirect>
struct SlotEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& sm) const {
    const GroupedGemmArgs& a = p.args;
    const DevicePlan& plan = a.plan;
    __nv_bfloat16* staging = sm.staging;
    // Weighted (forward) or plain (dx) expert output rows go to the source's slot [j, t].
    const int k = plan.top_k;
    const int64_t T = plan.num_tokens, N = a.n;
    auto* slots = static_cast<__nv_bfloat16*>(a.out0);
    const GroupedGemmArgs::PeerSlots& peer = a.peer_slots;
    begin_slot_epilogue<M == GemmMode::kDown>(a.topk_weights, sm, [&](int32_t src) -> __nv_bfloat16* {
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
// kDown and kGateUpGrad in 128 x 256 tiles (grouped_gemm.cu's kWide, bf16):
// consumer c holds rows [64c, 64c + 64) of the tile, acc[h] their columns
// [128h, 128h + 128) of the tile's 256. Each row (kDown: its routing weight
// times it; rounded to bf16: the narrow epilogue's values) goes to its
// source's slot [j, t], columns 256n..: a 128-column half at a time through
// the consumer's buffer (two 128B-swizzled 64 x 64 boxes, HalfTilePlaces),
// then 16-byte stores, 16 lanes a row (whole 32-byte sectors). Threads 0-63
// write the 64 rows' destinations (and kDown's weights) first (row_dst /
// row_w: [64] a consumer). This GPU's slots only (no peer_slots).
template <GemmMode M>
struct WideSlotEpilogue {
  static_assert(M == GemmMode::kDown || M == GemmMode::kGateUpGrad, "the slot-writing modes");
  static constexpr bool kWeights = M == GemmMode::kDown;
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx) const {
    const GroupedGemmArgs& a = p.args;
    const int tid = static_cast<int>(threadIdx.x & 127);
    const int k = a.plan.top_k;
    const int64_t T = a.plan.num_tokens, N = a.n;
    auto* slots = static_cast<__nv_bfloat16*>(a.out0);
    const float w = kWeights && ctx.my_src >= 0 ? a.topk_weights[ctx.my_src] : 0.0f;
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
    const uint32_t buf = smem_u32(ctx.z_chunk);
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

// kDown in 128 x 256 tiles with GroupedGemmArgs::down_to_pool: consumer c's
// rows [64c, 64c + 64) of the tile, each times its routing weight (0 for a
// padding row), rounded to bf16 (the slot epilogues' values), go to the
// same rows of out0 [C, n] in pool order by TMA, a 128-column half (acc[h])
// at a time through the consumer's two 128B-swizzled boxes, as
// WideGateUpEpilogue stores z: two 64 x 64 box stores a half instead of 64
// row destinations and 16-byte stores. Threads 0-63 share the rows'
// weights through row_w first.
struct WidePoolDownEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    const GroupedGemmArgs& a = p.args;
    const int tid = static_cast<int>(threadIdx.x & 127);
    const BoxStores out(ctx.z_chunk, tile.m * kBlockM + 64 * cw);
    const float w = ctx.my_src >= 0 ? a.topk_weights[ctx.my_src] : 0.0f;  // (its load overlaps the barrier)
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

template <bool kDirect>
struct Epilogue<GemmMode::kDown, kDirect> : SlotEpilogue<GemmMode::kDown, kDirect> {};
template <bool kDirect>
struct Epilogue<GemmMode::kGateUpGrad, kDirect> : SlotEpilogue<GemmMode::kGateUpGrad, kDirect> {};

// kDownGrad: from ga and the saved z, the SwiGLU backward, the dW2 operand and d topk_w partials.
//   a = bf16(silu(g) u); d topk_w partial = sum_c ga a; da = w ga;
//   dz = [bf16(da u silu'(g)), bf16(da silu(g))]; wa = bf16(w a) (dW2 operand),
// with acc = ga for a-columns 128n + c. With GroupedGemmArgs::dz_q, dz also in
// e4m3: a row's 128 dz_g (and 128 dz_u) columns of the tile are one 1 x 128
// tile of the recipe, held by the 4 lanes of a quad, so its amax is theirs.
//
// The saved z comes through the consumer's own 32 KB buffer, not the ring (z
// in ring stages stalled the producer: the ring is FIFO, so while an
// epilogue held them the other consumer's main loop starved). A row half h
// of the tile at a time, "chunk" h: its g and u columns as four boxes. A TMA
// load brings the chunk, the thread overwrites each g and u element it reads
// with dz_g and dz_u at the same swizzled place, TMA stores send them out as
// whole lines, then wa (held in registers meanwhile) goes through the g part
// the same way. Chunk 1 comes in two parts: its u boxes as soon as chunk 0's
// dz has been read out (wa only goes through the g part), its g boxes once
// wa has left; z_full expects the whole chunk from the first part on, so it
// completes when both have landed. The next tile's chunk 0 loads after the
// epilogue (the kernel issues it), whole.
// kWide (128 x 256 tiles, GroupedGemmArgs::wide_down_grad): each consumer
// holds 64 rows and acc[h] their columns [128h, 128h + 128), so its chunk h
// is a column half of its rows instead of a row half: the same 32 KB, the
// same places (HalfTilePlaces), the same steps.
enum class ZParts { kAll, kU, kG };
// Where chunk h of a tile sits: its 64 pool rows from row64 on, and its
// 128-column block cb of the I columns (dz's g block cb and u block I / 128 + cb).
struct ZPiece {
  int64_t row64;
  int cb;
};
template <bool kWide>
__device__ __forceinline__ ZPiece z_piece(const Tile& tile, int h, int cw) {
  const int64_t row0 = static_cast<int64_t>(tile.m) * kBlockM;
  return kWide ? ZPiece{row0 + 64 * cw, 2 * tile.n + h} : ZPiece{row0 + 64 * h, tile.n};
}
__device__ __forceinline__ void load_z_chunk(const KernelParams& p, const EpilogueContext& ctx, ZPiece pc,
                                             ZParts parts = ZParts::kAll) {
  const int I = static_cast<int>(p.args.intermediate);
  const int row = static_cast<int>(pc.row64);
  if (parts != ZParts::kG) mbar_arrive_expect_tx(ctx.z_full, kZChunkBytes);
  for (int b = parts == ZParts::kU ? 2 : 0; b < (parts == ZParts::kG ? 2 : 4); ++b)  // b: g (0, 1) or u (2, 3), column half b % 2
    tma_load_2d(ctx.z_chunk + b * kBoxBytes, ctx.z_map, ctx.z_full, (b < 2 ? 0 : I) + pc.cb * 128 + (b & 1) * 64,
                row);
}

template <bool kWide>
struct DownGradEpilogue {
  // dz_q and dz_s of row half h from the bf16 dz this thread has just written
  // into the chunk (its own places: no barrier), with its pairs' maxima: the
  // quad's maximum is the row's over the tile's 128 g (u) columns. The same
  // amax and scale as quantize_e4m3_rows on those bf16 values, and the same
  // codes: the division with fp32 scales (the row quantizer's corrected
  // quotient gives the division's codes), with pow2 scales a multiply by the
  // exact reciprocal.
  static __device__ __forceinline__ void quantize_dz(const GroupedGemmArgs& a, ZPiece pc,
                                                     const __nv_bfloat162 (&dz_amax)[2][2], uint32_t z_g, uint32_t z_u) {
    const int64_t I = a.intermediate, groups = 2 * I / 128, rows = a.a_rows;
    float scale[2][2];  // [row q][g, u]
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int gu = 0; gu < 2; ++gu) {
        float amax = fp8::amax_of_pair(dz_amax[q][gu]);
        amax = fp8::fold_amax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fp8::fold_amax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        scale[q][gu] = fp8::tile_scale(amax, a.dz_scale);
        if ((threadIdx.x & 3) == 0) {
          const int64_t row = pc.row64 + acc_row(0, 2 * q);
          const int64_t group = gu * (I / 128) + pc.cb;  // dz's 128-column block: g's cb-th, or u's
          a.dz_s[a.dz_scales_by_k_block ? group * rows + row : row * groups + group] = scale[q][gu];
        }
      }
    if (a.dz_scale == Fp8Scale::kPowerOfTwo) {
      float inv[2][2];
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int gu = 0; gu < 2; ++gu) inv[q][gu] = __frcp_rn(scale[q][gu]);  // exact for powers of two
      store_dz_q<true>(a, pc, inv, z_g, z_u);
    } else {
      store_dz_q<false>(a, pc, scale, z_g, z_u);
    }
  }

  // The e4m3 bytes of the chunk's dz (by = the scales, or with kPow2 their
  // reciprocals), 32 columns (a 32-byte sector of each row) at a time: the
  // quad's 2-byte pieces of 4 8-column groups, transposed so that each lane
  // stores one group's 8 bytes. Not unrolled: fully unrolled (256 divisions)
  // the epilogue thrashed the instruction cache (ncu: 54% of stalls waiting
  // for an instruction; kDownGrad 3.2x slower) and its 2-byte stores wasted
  // 72% of the sectors written.
  template <bool kPow2>
  static __device__ __forceinline__ void store_dz_q(const GroupedGemmArgs& a, ZPiece pc, const float (&by)[2][2],
                                                    uint32_t z_g, uint32_t z_u) {
    const int64_t I = a.intermediate;
    const HalfTilePlaces place;
    const int quad_lane = static_cast<int>(threadIdx.x & 3);
    auto exchange = [](uint32_t v, int mask) { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); };
#pragma unroll 1
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t row = pc.row64 + acc_row(0, 2 * q);
#pragma unroll
        for (int gu = 0; gu < 2; ++gu) {
          uint32_t pieces[2] = {0u, 0u};  // groups 4c .. 4c + 3, two 16-bit pieces per word
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 v = __bfloat1622float2(*static_cast<const __nv_bfloat162*>(
                __cvta_shared_to_generic((gu == 0 ? z_g : z_u) + place(16 * c + 4 * j + 2 * q))));
            const uint32_t piece =
                kPow2 ? fp8::to_e4m3_pow2(v.x, by[q][gu]) | fp8::to_e4m3_pow2(v.y, by[q][gu]) << 8
                      : fp8::to_e4m3(v.x, by[q][gu]) | fp8::to_e4m3(v.y, by[q][gu]) << 8;
            pieces[j / 2] |= piece << (16 * (j % 2));
          }
          uint32_t lo, hi;
          quad_transpose16(quad_lane, pieces[0], pieces[1], exchange, lo, hi);
          const int64_t col = static_cast<int64_t>(pc.cb) * 128 + 32 * c + 8 * quad_lane;
          *reinterpret_cast<uint2*>(a.dz_q + row * 2 * I + gu * I + col) = make_uint2(lo, hi);
        }
      }
    }
  }

  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    const GroupedGemmArgs& a = p.args;
    const DevicePlan& plan = a.plan;
    const int I = static_cast<int>(a.intermediate);
    const uint32_t z_g = smem_u32(ctx.z_chunk), z_u = z_g + 2 * kBoxBytes;
    const bool storer = (threadIdx.x & 127) == 0;
    auto at = [](uint32_t addr) { return static_cast<__nv_bfloat162*>(__cvta_shared_to_generic(addr)); };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const ZPiece pc = z_piece<kWide>(tile, h, cw);
      const int row = static_cast<int>(pc.row64), col0 = pc.cb * 128;
      float w_row[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int src = plan.row_src[pc.row64 + acc_row(0, 2 * q)];
        w_row[q] = src >= 0 ? a.topk_weights[src] : 0.0f;
      }
      if (!ctx.waits->wait(ctx.z_full, ctx.z_waits & 1u, kBarrierFull, ctx.z_waits)) return false;
      ++ctx.z_waits;
      float dw[2] = {0.0f, 0.0f};
      uint32_t wa_held[32];  // bf16x2 of wa per accumulator pair (i, i + 1)
      // dz_q: running |dz| maxima of this thread's bf16 pairs, [row q][g, u].
      const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
      __nv_bfloat162 dz_amax[2][2] = {{zero2, zero2}, {zero2, zero2}};
      const HalfTilePlaces place;
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const int q = (i >> 1) & 1;
        const uint32_t off = place(i);
        const __nv_bfloat162 g2 = *at(z_g + off), u2 = *at(z_u + off);
        float out_wa[2], out_dg[2], out_du[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float g = __bfloat162float(e ? g2.y : g2.x), u = __bfloat162float(e ? u2.y : u2.x);
          const float sg = sigmoid_f(g), silu = g * sg;
          const float ga = acc[h][i + e], w = w_row[q];
          const float av = round_bf16(silu * u);
          dw[q] += ga * av;
          out_wa[e] = w * av;
          out_dg[e] = (w * ga) * u * (sg * (1.0f + g * (1.0f - sg)));
          out_du[e] = (w * ga) * silu;
        }
        const __nv_bfloat162 dg2 = __floats2bfloat162_rn(out_dg[0], out_dg[1]);
        const __nv_bfloat162 du2 = __floats2bfloat162_rn(out_du[0], out_du[1]);
        *at(z_g + off) = dg2;
        *at(z_u + off) = du2;
        dz_amax[q][0] = fp8::amax_pair(dz_amax[q][0], dg2);
        dz_amax[q][1] = fp8::amax_pair(dz_amax[q][1], du2);
        const __nv_bfloat162 wa2 = __floats2bfloat162_rn(out_wa[0], out_wa[1]);
        wa_held[i / 2] = *reinterpret_cast<const uint32_t*>(&wa2);
      }
      // Row sums over this thread's columns, then over the quad: fixed order.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 1);
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 2);
        if ((threadIdx.x & 3) == 0) a.dw_partial[(pc.row64 + acc_row(0, 2 * q)) * (I / 128) + pc.cb] = dw[q];
      }
      fence_proxy_async_shared();  // this thread's writes, before the TMA stores read them
      consumer_sync();
      if (storer) {
        for (int c = 0; c < 2; ++c) {
          tma_store_2d(ctx.out_map[0], ctx.z_chunk + c * kBoxBytes, col0 + c * 64, row);                // dz_g
          tma_store_2d(ctx.out_map[0], ctx.z_chunk + (2 + c) * kBoxBytes, I + col0 + c * 64, row);      // dz_u
        }
        bulk_commit_group();
      }
      // dz in e4m3 while the TMA stores read the same bf16 (reads only, on both sides).
      if (a.dz_q != nullptr) quantize_dz(a, pc, dz_amax, z_g, z_u);
      if (storer) bulk_wait_group_read<0>();
      // quantize_dz's reads of the u part, ordered before the TMA that overwrites it (proxy write-after-read).
      if (h == 0 && a.dz_q != nullptr) fence_proxy_async_shared();
      consumer_sync();  // dz has been read out: wa may overwrite the g part
      if (h == 0 && storer) load_z_chunk(p, ctx, z_piece<kWide>(tile, 1, cw), ZParts::kU);  // the u part is free now
      const HalfTilePlaces place2;  // the same places, offsets rebuilt (see HalfTilePlaces)
#pragma unroll
      for (int i = 0; i < 64; i += 2) *reinterpret_cast<uint32_t*>(at(z_g + place2(i))) = wa_held[i / 2];
      fence_proxy_async_shared();
      consumer_sync();
      if (storer) {
        for (int c = 0; c < 2; ++c) tma_store_2d(ctx.out_map[1], ctx.z_chunk + c * kBoxBytes, col0 + c * 64, row);
        bulk_commit_group();
        bulk_wait_group_read<0>();
        if (h == 0) load_z_chunk(p, ctx, z_piece<kWide>(tile, 1, cw), ZParts::kG);  // the g part is free: the rest of chunk 1
      }
    }
    return true;
  }
};
template <bool kDirect>
struct Epilogue<GemmMode::kDownGrad, kDirect> {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx) const {
    return DownGradEpilogue<false>{}(p, tile, acc, ctx, 0);
  }
};

// kWeightGrad: dW[e][128m + r][128n + c], straight from registers. kWide
// (128 x 256 tiles): consumer cw holds rows [64 cw, 64 cw + 64), acc[h]
// their columns [128h, 128h + 128) of dW[e][..][256n..]; else acc[h] holds
// rows [64h, 64h + 64) of the tile's 128 columns.
template <bool kWide>
struct WeightGradEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             int cw) const {
    const GroupedGemmArgs& a = p.args;
    begin_epilogue();
    // A quad's lane t holds columns 8j + 2t, + 1 of its rows (j = 0..15).
    // Lanes t and t ^ 1 swap one column pair, so that each holds four
    // adjacent columns: even t those of j = 2jj (its own pair, then its
    // partner's), odd t those of j = 2jj + 1 (its partner's, then its own).
    // A warp's store then covers whole 32-byte sectors: 8 bytes a lane in
    // bf16 (a pair a lane wrote half sectors: Nsight Compute, session 29,
    // 50% excess sectors in FP8 dW2) and 16 in fp32, with half the store
    // instructions (dW2's stores waited on the LSU queue, lg throttle).
    // Each of this thread's four rows (h, q) gets one pointer, its stores at
    // immediate offsets 16 jj from it. (With the address built per store, a
    // store took ~18 instructions: session 28's SASS.)
    const bool odd = (threadIdx.x & 1) != 0;
    const int64_t N = a.n;
    const int64_t base = static_cast<int64_t>(tile.expert) * a.m * N + static_cast<int64_t>(tile.m) * kBlockM * N +
                         static_cast<int64_t>(tile.n) * (kWide ? 256 : kBlockN) + acc_col(0) + (odd ? 6 : 0);
    // Accumulator half h's row q and first column in the tile.
    auto row_of = [&](int h, int q) { return kWide ? 64 * cw + acc_row(0, 2 * q) : acc_row(h, 2 * q); };
    auto col_of = [&](int h) { return kWide ? 128 * h : 0; };
    // store_quad(dst, lo, hi): lo = columns [c, c + 2), hi = [c + 2, c + 4) of dst's row.
    auto store_tile = [&](auto* out, auto pack, auto store_quad) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          auto* row = out + base + static_cast<int64_t>(row_of(h, q)) * N + col_of(h);
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int i0 = 8 * jj + 2 * q, i1 = i0 + 4;  // j = 2jj and 2jj + 1
            const auto v0 = pack(acc[h][i0], acc[h][i0 + 1]);
            const auto v1 = pack(acc[h][i1], acc[h][i1 + 1]);
            const auto got = shfl_xor1(odd ? v0 : v1);
            store_quad(row + 16 * jj, odd ? got : v0, odd ? v1 : got);
          }
        }
    };
    const auto pair_f32 = [](float x, float y) { return make_float2(x, y); };
    if (a.out_f32 && a.accumulate) {
      store_tile(static_cast<float*>(a.out0), pair_f32, [](float* d, float2 lo, float2 hi) {
        const float4 old = *reinterpret_cast<const float4*>(d);
        *reinterpret_cast<float4*>(d) = make_float4(lo.x + old.x, lo.y + old.y, hi.x + old.z, hi.y + old.w);
      });
    } else if (a.out_f32) {
      store_tile(static_cast<float*>(a.out0), pair_f32, [](float* d, float2 lo, float2 hi) {
        *reinterpret_cast<float4*>(d) = make_float4(lo.x, lo.y, hi.x, hi.y);
      });
    } else {
      store_tile(
          static_cast<__nv_bfloat16*>(a.out0),
          [](float x, float y) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(x, y);
            return *reinterpret_cast<const uint32_t*>(&b);
          },
          [](__nv_bfloat16* d, uint32_t lo, uint32_t hi) { *reinterpret_cast<uint2*>(d) = make_uint2(lo, hi); });
    }
    return true;
  }

 private:
  // The partner lane's value (t ^ 1 of the quad), the whole warp taking part.
  __device__ __forceinline__ static uint32_t shfl_xor1(uint32_t v) { return __shfl_xor_sync(0xFFFFFFFFu, v, 1); }
  __device__ __forceinline__ static float2 shfl_xor1(float2 v) {
    return make_float2(__shfl_xor_sync(0xFFFFFFFFu, v.x, 1), __shfl_xor_sync(0xFFFFFFFFu, v.y, 1));
  }
};
template <bool kDirect>
struct Epilogue<GemmMode::kWeightGrad, kDirect> {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext&) const {
    return WeightGradEpilogue<false>{}(p, tile, acc, 0);
  }
};

}  // namespace megamoe::cuda::engine
