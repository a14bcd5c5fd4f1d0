// What the epilogues (and the main loops) share: where a consumer's
// accumulator elements sit in its tile, the SwiGLU arithmetic, the staged
// and boxed ways out of shared memory, and each consumer's EpilogueContext.
// Device code; included by the epilogue and main-loop files.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/tile_scheduler.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

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
//    staging tile of a row half (kRows 64: the FP8 epilogue buffer). No TMA:
//    one bulk copy per row segment (128 to 384 a tile) goes through the SM's
//    TMA unit, which the producer's stage loads need (FP8 kGateUp -9% at
//    235B with these stores).
//  - else (bf16) thread r's row r as bulk copies that run on while the
//    consumer goes on (faster than stores from registers for bf16: kDown 816
//    -> 702 us at 30B). Every thread first fences its staging writes toward
//    the async proxy.
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
// buffer (its SharedStorage::epilogue) is the staging tile, the z chunk
// (kDownGrad) or the wide tiles' boxes; `boxes` names the same bytes.
struct EpilogueContext {
  __nv_bfloat16* staging;  // staged modes: [128][kStagingLd] bf16 (FP8: [64][kStagingLd], a row half)
  __nv_bfloat16** row_dst;  // [128] ([64] wide) kDown, kGateUpGrad: where each tile row goes (its slot, this tile's columns; nullptr: nowhere)
  float* row_w;             // [128] ([64] wide) kDown: each tile row's routing weight (0 for a padding row)
  uint8_t* boxes;          // kDownGrad: the z chunk [g cols 0-63 | g 64-127 | u 0-63 | u 64-127]; wide: 64 x 64 boxes
  uint64_t* z_full;        // kDownGrad: completes when a z chunk has landed
  uint32_t z_waits;        // kDownGrad: chunks waited for so far (z_full's phase)
  // kDown, kGateUpGrad: row_src of this thread's tile row (thread r of the
  // warpgroup: row r), loaded before the tile's main loop, so that the
  // epilogue does not start by waiting for it.
  int32_t my_src;
  const BoundedWait* waits;
  const CUtensorMap* z_map;       // kDownGrad: the saved z [C, 2I]
  const CUtensorMap* out_map[2];  // kDownGrad: dz, wa; wide kGateUp: z, a; kDown: its pool-order rows
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
// chunk (the FP8 kernels' plain stores: kDown 2300 -> 2030 us at 235B). The
// row's source comes loaded (EpilogueContext::my_src); its weight's load
// overlaps the barrier (loading each accumulator row's source and weight in
// the staging loop put three dependent global loads a tile between main loop
// and stores).
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

// A consumer's 64 tile rows [row, row + 64) out in pool order through its
// buffer of 128B-swizzled 64 x 64 boxes (HalfTilePlaces) by TMA box stores,
// issued by thread 0 of the warpgroup: the wide epilogues of pool-order
// outputs (kGateUp's z and a, kDown's pool-order rows).
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

// kGateUp in 128 x 256 tiles (bf16): consumer cw
// holds rows [64 cw, 64 cw + 64) of the tile, acc[0] their 128 gate columns
// and acc[1] the matching 128 up columns (a-columns 128 n + c: register i of
// both is the same row and column). z's gate half, its up half and a = silu(g) u
// (the values and roundings of the 128 x 128 epilogue above) pass through the
// consumer's buffer of kWideBoxes 128B-swizzled 64 x 64 boxes (HalfTilePlaces:
// a 64-row x 128-column part in two boxes) and leave by TMA stores
// (out_map[0]: z [C, 2I], out_map[1]: a [C, I]): with two boxes the three
// parts one after another, with four z's two halves at once. One thread
// issues the stores and waits for their reads before the buffer is written

}  // namespace megamoe::cuda::engine
