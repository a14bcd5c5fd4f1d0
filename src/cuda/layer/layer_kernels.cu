#include "cuda/layer/layer_kernels.h"
#include "cuda/common/cuda_status.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/plan/device_plan.h"
#include "cuda/layer/slot_sums.cuh"

namespace megamoe::cuda {
namespace {

constexpr int kThreads = 256;

// Enough blocks to fill the GPU; the kernels stride over their work
// (grid_for: threads' items; blocks_for: blocks' units).
int blocks_for(int64_t units) { return static_cast<int>(units < 4096 ? (units > 0 ? units : 1) : 4096); }
int grid_for(int64_t work) { return blocks_for((work + kThreads - 1) / kThreads); }

// One thread a 16-byte chunk. Walking (4-row group, 256-chunk segment)
// units with all loads first measured the same 253 us at Qwen3-30B-A3B
// (16384 tokens), so the simple form stays.
__global__ void gather_rows_kernel(const uint4* src, int64_t chunks_per_row, const int32_t* row_src, int k,
                                   const int32_t* pool_rows, uint4* pool) {
  const int64_t total = static_cast<int64_t>(*pool_rows) * chunks_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, c = i % chunks_per_row;
    const int32_t s = row_src[r];
    pool[i] = s >= 0 ? src[(s / k) * chunks_per_row + c] : make_uint4(0, 0, 0, 0);
  }
}

// gather_rows the other way round: a thread reads chunk c of token t once
// and stores it to each of the token's routes' pool rows; then the padding
// rows (row_src < 0 below *pool_rows) get zeros, a warp a row. Walking pool
// rows reads each token row k times at random moments (x or dy: 64 MB at
// Qwen3-30B-A3B, more than L2 keeps), so the gather moved ~1.07 GB through
// DRAM for 0.54 GB of pool rows; this moves ~0.6 GB. (The FP8 row quantizer
// measured the same change 285 -> 127 us.)
__global__ void scatter_rows_kernel(const uint4* src, int64_t tokens, int64_t chunks_per_row, const int32_t* route_row,
                                    int k, const int32_t* row_src, const int32_t* pool_rows, uint4* pool) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < tokens * chunks_per_row; i += stride) {
    const int64_t t = i / chunks_per_row, c = i % chunks_per_row;
    const uint4 v = src[i];
    for (int j = 0; j < k; ++j) {
      const int32_t row = __ldg(route_row + t * k + j);
      if (row >= 0) pool[row * chunks_per_row + c] = v;
    }
  }
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int32_t used = *pool_rows;
  for (int64_t r = first / 32; r < used; r += stride / 32) {
    if (__ldg(row_src + r) >= 0) continue;  // warp-uniform: one row a warp
    for (int64_t c = lane; c < chunks_per_row; c += 32) pool[r * chunks_per_row + c] = make_uint4(0, 0, 0, 0);
  }
}

// Route j of token t's rows: slot plane j (route_row null) or pool row
// route_row[t k + j]. A block a (token, 256-chunk segment) unit (one
// block-uniform division, not a 64-bit one a chunk); a thread loads up to
// kCombineBatch of its chunk's rows at once, then adds them in j order (the
// sum's order, so its bits, stay). One load in flight a thread, behind a
// dependent index load, took 172 us at Qwen3-30B-A3B, 16384 tokens (pool
// rows; 155 this way, 604 MB: ~3.9 TB/s).
constexpr int kCombineBatch = 8;

__global__ void combine_slots_kernel(const uint4* slots, int64_t slot_plane, const int32_t* route_row,
                                     const int32_t* topk_idx, int64_t T, int k, int E, int chunks_per_row,
                                     const unsigned long long* error_key, DeviceErrorSink errors, uint4* out) {
  const unsigned long long key = *error_key;
  const bool failed = key != kNoPlanError;
  if (failed && blockIdx.x == 0 && threadIdx.x == 0) report_failed_plan(errors, key, topk_idx, T, k, E);
  const int segs = (chunks_per_row + kThreads - 1) / kThreads;
  const int64_t units = T * segs;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t t = u / segs;
    const int c = static_cast<int>(u % segs) * kThreads + static_cast<int>(threadIdx.x);
    if (c >= chunks_per_row) continue;
    const int64_t i = t * chunks_per_row + c;  // the token's chunk (slot planes are token-major too)
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j0 = 0; j0 < k; j0 += kCombineBatch) {
      int64_t at[kCombineBatch];  // the route's chunk, or -1: no route
#pragma unroll
      for (int q = 0; q < kCombineBatch; ++q) {
        const int j = j0 + q;
        at[q] = -1;
        if (j >= k) continue;
        const int32_t e = topk_idx[t * k + j];
        if (e < 0 || e >= E) continue;
        if (route_row == nullptr) {
          at[q] = j * slot_plane + i;
        } else {
          const int32_t row = route_row[t * k + j];
          if (row >= 0) at[q] = static_cast<int64_t>(row) * chunks_per_row + c;
        }
      }
      uint4 v[kCombineBatch];
#pragma unroll
      for (int q = 0; q < kCombineBatch; ++q) v[q] = at[q] >= 0 ? slots[at[q]] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int q = 0; q < kCombineBatch; ++q)
        if (at[q] >= 0) add_slot_chunk(acc, v[q]);
    }
    out[i] = finish_slot_chunk(acc, failed);
  }
}

__global__ void reduce_route_partials_kernel(const float* partial, int n_parts, const int32_t* route_row,
                                             int64_t num_routes, const unsigned long long* error_key, float* out) {
  const bool failed = *error_key != kNoPlanError;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_routes;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t row = route_row[i];
    float s = 0.0f;
    if (row >= 0)
      for (int n = 0; n < n_parts; ++n) s += partial[static_cast<int64_t>(row) * n_parts + n];
    out[i] = failed ? NAN : s;
  }
}


}  // namespace

Status gather_rows(const void* src, int64_t width, const int32_t* row_src, int top_k, const int32_t* pool_rows,
                   int64_t capacity, void* pool, cudaStream_t stream) {
  const int64_t chunks = width / 8;  // 16-byte chunks of bf16
  gather_rows_kernel<<<grid_for(capacity * chunks / 4), kThreads, 0, stream>>>(
      static_cast<const uint4*>(src), chunks, row_src, top_k, pool_rows, static_cast<uint4*>(pool));
  return check_launch("gather_rows_kernel");
}

Status scatter_rows(const void* src, int64_t tokens, int64_t width, const int32_t* route_row, int top_k,
                    const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, void* pool,
                    cudaStream_t stream) {
  const int64_t chunks = width / 8;  // 16-byte chunks of bf16
  const int64_t work = std::max(tokens * chunks, capacity * 32);  // the padding pass: a warp a row
  scatter_rows_kernel<<<grid_for(work / 4), kThreads, 0, stream>>>(static_cast<const uint4*>(src), tokens, chunks,
                                                                   route_row, top_k, row_src, pool_rows,
                                                                   static_cast<uint4*>(pool));
  return check_launch("scatter_rows_kernel");
}

Status combine_slots(const void* slots, const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                     int64_t width, const unsigned long long* error_key, const DeviceErrorSink& errors, void* out,
                     cudaStream_t stream, int64_t slot_tokens) {
  if (num_tokens == 0) return Status::Ok();
  if (slot_tokens == 0) slot_tokens = num_tokens;
  if (slot_tokens < num_tokens) return internal_error("combine_slots: fewer slot rows than tokens");
  const int chunks = static_cast<int>(width / 8);
  combine_slots_kernel<<<blocks_for(num_tokens * ((chunks + kThreads - 1) / kThreads)), kThreads, 0, stream>>>(
      static_cast<const uint4*>(slots), slot_tokens * chunks, nullptr, topk_idx, num_tokens, top_k, num_experts, chunks,
      error_key, errors, static_cast<uint4*>(out));
  return check_launch("combine_slots_kernel");
}

Status combine_pool_rows(const void* rows, const int32_t* route_row, const int32_t* topk_idx, int64_t num_tokens,
                         int top_k, int num_experts, int64_t width, const unsigned long long* error_key,
                         const DeviceErrorSink& errors, void* out, cudaStream_t stream) {
  if (num_tokens == 0) return Status::Ok();
  const int chunks = static_cast<int>(width / 8);
  combine_slots_kernel<<<blocks_for(num_tokens * ((chunks + kThreads - 1) / kThreads)), kThreads, 0, stream>>>(
      static_cast<const uint4*>(rows), 0, route_row, topk_idx, num_tokens, top_k, num_experts, chunks, error_key,
      errors, static_cast<uint4*>(out));
  return check_launch("combine_slots_kernel (pool rows)");
}

Status reduce_route_partials(const float* partial, int n_parts, const int32_t* route_row, int64_t num_routes,
                             const unsigned long long* error_key, float* out, cudaStream_t stream) {
  if (num_routes == 0) return Status::Ok();
  reduce_route_partials_kernel<<<grid_for(num_routes), kThreads, 0, stream>>>(partial, n_parts, route_row,
                                                                             num_routes, error_key, out);
  return check_launch("reduce_route_partials_kernel");
}

}  // namespace megamoe::cuda
