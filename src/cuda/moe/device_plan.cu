#include "cuda/moe/device_plan.h"
#include "cuda/common/cuda_status.h"

#include <string>

#include "core/routing_plan.h"

namespace megamoe::cuda {
namespace {

// Loads one chunk's topk_idx into shared memory; validates each route.
__device__ int load_chunk(const int32_t* topk_idx, int64_t num_tokens, int k, int E, int32_t* s_idx,
                          unsigned long long* error_key, bool validate) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kPlanChunk;
  const int64_t left = num_tokens - t0;
  const int n = static_cast<int>(left < kPlanChunk ? left : kPlanChunk);
  for (int i = threadIdx.x; i < n * k; i += blockDim.x) s_idx[i] = topk_idx[t0 * k + i];
  __syncthreads();
  if (validate) {
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
      const int32_t* row = s_idx + t * k;
      for (int j = 0; j < k; ++j) {
        const int32_t e = row[j];
        const unsigned long long route = static_cast<unsigned long long>(t0 + t) * k + j;
        if (e < -1 || e >= E) {
          atomicMin(error_key, route << 2 | kPlanErrorOutOfRange);
        } else if (e >= 0) {
          for (int j2 = 0; j2 < j; ++j2)
            if (row[j2] == e) atomicMin(error_key, route << 2 | kPlanErrorDuplicate);
        }
      }
    }
  }
  return n;
}

__global__ void plan_count_kernel(const int32_t* topk_idx, int64_t num_tokens, int k, int E, int32_t* chunk_counts,
                                  unsigned long long* error_key) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  const int n = load_chunk(topk_idx, num_tokens, k, E, s_idx, error_key, true);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int count = 0;
    for (int i = 0; i < n * k; ++i) count += s_idx[i] == e;
    chunk_counts[static_cast<int64_t>(blockIdx.x) * E + e] = count;
  }
}

__global__ void check_routing_kernel(const int32_t* topk_idx, int64_t num_tokens, int k, int E,
                                     unsigned long long* error_key) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  load_chunk(topk_idx, num_tokens, k, E, s_idx, error_key, true);
}

// One block: per-expert exclusive scan over chunks, then the pool layout.
__global__ void plan_scan_kernel(int num_chunks, int E, int32_t* chunk_counts, int32_t* expert_rows,
                                 int32_t* expert_offset, int32_t* tile_expert, int32_t* row_src) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int running = 0;
    for (int c = 0; c < num_chunks; ++c) {
      const int v = chunk_counts[static_cast<int64_t>(c) * E + e];
      chunk_counts[static_cast<int64_t>(c) * E + e] = running;
      running += v;
    }
    expert_rows[e] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0;
    for (int e = 0; e < E; ++e) {
      expert_offset[e] = off;
      off += static_cast<int>(align_pool_rows(expert_rows[e]));
    }
    expert_offset[E] = off;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int begin = expert_offset[e], rows = expert_rows[e], end = expert_offset[e + 1];
    for (int t = begin / kPoolRowAlign; t < end / kPoolRowAlign; ++t) tile_expert[t] = e;
    for (int r = begin + rows; r < end; ++r) row_src[r] = -1;  // padding rows have no source
  }
}

// Rows in (token, slot) order within each expert: the r-th route of this
// chunk to expert e gets expert_offset[e] + chunk_base[e] + r.
__global__ void plan_assign_kernel(const int32_t* topk_idx, int64_t num_tokens, int k, int E,
                                   const int32_t* chunk_base, const int32_t* expert_offset, int32_t* route_row,
                                   int32_t* row_src) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  const int n = load_chunk(topk_idx, num_tokens, k, E, s_idx, nullptr, false);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kPlanChunk * k;
  for (int i = threadIdx.x; i < n * k; i += blockDim.x)
    if (s_idx[i] < 0 || s_idx[i] >= E) route_row[r0 + i] = -1;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int row = expert_offset[e] + chunk_base[static_cast<int64_t>(blockIdx.x) * E + e];
    for (int i = 0; i < n * k; ++i)
      if (s_idx[i] == e) {
        route_row[r0 + i] = row;
        row_src[row] = static_cast<int32_t>(r0 + i);
        ++row;
      }
  }
}


}  // namespace

Status check_routing(const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                     unsigned long long* error_key, cudaStream_t stream) {
  if (top_k > kMaxTopK) return invalid_argument("top_k = " + std::to_string(top_k) + " exceeds the CUDA limit of 32");
  MEGAMOE_RETURN_IF_ERROR(
      cuda_status("routing check: reset error key", cudaMemsetAsync(error_key, 0xFF, sizeof(unsigned long long), stream)));
  const int64_t chunks = (num_tokens + kPlanChunk - 1) / kPlanChunk;
  if (chunks == 0) return Status::Ok();
  check_routing_kernel<<<static_cast<unsigned>(chunks), 256, 0, stream>>>(topk_idx, num_tokens, top_k, num_experts,
                                                                          error_key);
  return check_launch("check_routing_kernel");
}

Status build_device_plan(const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                         const DevicePlanBuffers& b, cudaStream_t stream) {
  if (top_k > kMaxTopK) return invalid_argument("top_k = " + std::to_string(top_k) + " exceeds the CUDA limit of 32");
  const int chunks = static_cast<int>((num_tokens + kPlanChunk - 1) / kPlanChunk);
  MEGAMOE_RETURN_IF_ERROR(
      cuda_status("plan: reset error key", cudaMemsetAsync(b.error_key, 0xFF, sizeof(unsigned long long), stream)));
  if (chunks > 0) {
    plan_count_kernel<<<chunks, 256, 0, stream>>>(topk_idx, num_tokens, top_k, num_experts, b.chunk_counts,
                                                  b.error_key);
    MEGAMOE_RETURN_IF_ERROR(check_launch("plan_count_kernel"));
  }
  plan_scan_kernel<<<1, 1024, 0, stream>>>(chunks, num_experts, b.chunk_counts, b.expert_rows, b.expert_offset,
                                           b.tile_expert, b.row_src);
  MEGAMOE_RETURN_IF_ERROR(check_launch("plan_scan_kernel"));
  if (chunks > 0) {
    plan_assign_kernel<<<chunks, 256, 0, stream>>>(topk_idx, num_tokens, top_k, num_experts, b.chunk_counts,
                                                   b.expert_offset, b.route_row, b.row_src);
    MEGAMOE_RETURN_IF_ERROR(check_launch("plan_assign_kernel"));
  }
  return Status::Ok();
}

}  // namespace megamoe::cuda
