#include "cuda/moe/layer_kernels.h"
#include "cuda/common/cuda_status.h"

#include <cuda_bf16.h>

#include <cmath>
#include <string>

#include "cuda/moe/device_plan.h"
#include "cuda/moe/slot_sums.cuh"

namespace megamoe::cuda {
namespace {

constexpr int kThreads = 256;

// Enough blocks to fill the GPU; the kernels stride over their work.
int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

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

// Route j of token t's rows: slot plane j (route_row null) or pool row route_row[t k + j].
__global__ void combine_slots_kernel(const uint4* slots, int64_t slot_plane, const int32_t* route_row,
                                     const int32_t* topk_idx, int64_t T, int k, int E, int64_t chunks_per_row,
                                     const unsigned long long* error_key, DeviceErrorSink errors, uint4* out) {
  const unsigned long long key = *error_key;
  const bool failed = key != kNoPlanError;
  if (failed && blockIdx.x == 0 && threadIdx.x == 0) report_failed_plan(errors, key, topk_idx, T, k, E);
  const int64_t total = T * chunks_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks_per_row;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk_idx[t * k + j];
      if (e < 0 || e >= E) continue;
      if (route_row == nullptr) {
        add_slot_chunk(acc, slots[j * slot_plane + i]);
      } else {
        const int32_t row = route_row[t * k + j];
        if (row >= 0) add_slot_chunk(acc, slots[row * chunks_per_row + (i - t * chunks_per_row)]);
      }
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

Status combine_slots(const void* slots, const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                     int64_t width, const unsigned long long* error_key, const DeviceErrorSink& errors, void* out,
                     cudaStream_t stream, int64_t slot_tokens) {
  if (num_tokens == 0) return Status::Ok();
  if (slot_tokens == 0) slot_tokens = num_tokens;
  if (slot_tokens < num_tokens) return internal_error("combine_slots: fewer slot rows than tokens");
  const int64_t chunks = width / 8;
  combine_slots_kernel<<<grid_for(num_tokens * chunks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(slots), slot_tokens * chunks, nullptr, topk_idx, num_tokens, top_k, num_experts, chunks,
      error_key, errors, static_cast<uint4*>(out));
  return check_launch("combine_slots_kernel");
}

Status combine_pool_rows(const void* rows, const int32_t* route_row, const int32_t* topk_idx, int64_t num_tokens,
                         int top_k, int num_experts, int64_t width, const unsigned long long* error_key,
                         const DeviceErrorSink& errors, void* out, cudaStream_t stream) {
  if (num_tokens == 0) return Status::Ok();
  const int64_t chunks = width / 8;
  combine_slots_kernel<<<grid_for(num_tokens * chunks), kThreads, 0, stream>>>(
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
