#include "cuda/plan/device_plan.h"
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

__global__ void check_routing_kernel(const int32_t* topk_idx, int64_t num_tokens, int k, int E,
                                     unsigned long long* error_key) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  load_chunk(topk_idx, num_tokens, k, E, s_idx, error_key, true);
}

// The plan's three kernels (count, scan, assign) avoid a thread per expert
// walking the whole chunk (the first version's O(E x 256 k) compares and a
// 1024-thread block scanning each expert's chunks one by one: 20 + 24 + 45
// us at Qwen3-30B-A3B, 16384 tokens; these: 7 + 26 + 9 us, compare_torch
// --kernels, sessions 36-37). Rows in (token, slot) order within each expert.
constexpr int kPlanThreads = 256, kPlanWarps = kPlanThreads / 32;
constexpr int kCountGroup = 2048;  // experts one pass of plan_count counts (8 KB of shared counters)
constexpr int kRankGroup = 512;    // experts one pass of plan_assign ranks (a warp's 2 KB row)
static_assert(kPlanChunk * kMaxTopK * 4 + kPlanWarps * kRankGroup * 4 <= 48 * 1024,
              "plan_assign's routes and bases must fit the 48 KB of static shared memory");

// A chunk's per-expert route counts: shared counters, kCountGroup experts a pass.
__global__ void __launch_bounds__(kPlanThreads) plan_count_kernel(const int32_t* topk_idx, int64_t num_tokens,
                                                                   int k, int E, int32_t* chunk_counts,
                                                                   unsigned long long* error_key) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  __shared__ int32_t counts[kCountGroup];
  const int entries = load_chunk(topk_idx, num_tokens, k, E, s_idx, error_key, true) * k;
  for (int e0 = 0; e0 < E; e0 += kCountGroup) {
    const int g = min(kCountGroup, E - e0);
    for (int e = threadIdx.x; e < g; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < entries; i += blockDim.x) {
      // (ids out of [0, E) fall outside every group; unsigned: no overflow near INT_MIN)
      const unsigned e = static_cast<unsigned>(s_idx[i]) - static_cast<unsigned>(e0);
      if (e < static_cast<unsigned>(g)) atomicAdd(&counts[e], 1);  // integer counts: the same whatever the order
    }
    __syncthreads();
    for (int e = threadIdx.x; e < g; e += blockDim.x)
      chunk_counts[static_cast<int64_t>(blockIdx.x) * E + e0 + e] = counts[e];
    __syncthreads();  // read before the next group zeroes them
  }
}

// Inclusive warp scan of v.
__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = static_cast<int>(threadIdx.x & 31);
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// One block. Each expert's chunk counts become exclusive bases: thread
// (g, e) of G chunk groups sums expert e's counts over its group's chunks
// (reads coalesced over e), the group sums turn into bases in g order, and
// each thread rewrites its chunks. (A warp an expert, lanes 32 chunks apart,
// read E x 4 bytes apart and took 27 us at Qwen3-30B-A3B, 16384 tokens.)
// Then the block scans the experts' aligned row counts into expert_offset;
// then tile_expert and the padding rows.
__global__ void __launch_bounds__(1024) plan_scan_kernel(int num_chunks, int E, int32_t* chunk_counts,
                                                         int32_t* expert_rows, int32_t* expert_offset,
                                                         int32_t* tile_expert, int32_t* row_src) {
  __shared__ int32_t warp_sums[32];
  __shared__ int32_t block_total;
  __shared__ int32_t group_sums[1024];
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int per_pass = min(E, static_cast<int>(blockDim.x));  // experts a pass
  const int groups = static_cast<int>(blockDim.x) / per_pass;
  const int span = (num_chunks + groups - 1) / groups;       // chunks a group
  const int le = static_cast<int>(threadIdx.x) % per_pass, g = static_cast<int>(threadIdx.x) / per_pass;
  const int c0 = g * span, c1 = min(num_chunks, c0 + span);
  for (int e0 = 0; e0 < E; e0 += per_pass) {
    const int e = e0 + le;
    const bool active = g < groups && e < E;
    int sum = 0;
    if (active)
      for (int c = c0; c < c1; ++c) sum += chunk_counts[static_cast<int64_t>(c) * E + e];
    if (g < groups) group_sums[threadIdx.x] = sum;
    __syncthreads();
    if (active) {
      int run = 0;
      for (int h = 0; h < g; ++h) run += group_sums[h * per_pass + le];
      for (int c = c0; c < c1; ++c) {
        int32_t* at = chunk_counts + static_cast<int64_t>(c) * E + e;
        const int v = *at;
        *at = run;
        run += v;
      }
      if (g == groups - 1) expert_rows[e] = run;
    }
    __syncthreads();  // group_sums read before the next pass writes them
  }
  int base = 0;  // the aligned rows of the experts before this pass
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + static_cast<int>(threadIdx.x);
    const int v = e < E ? static_cast<int>(align_pool_rows(expert_rows[e])) : 0;
    const int incl = warp_inclusive_scan(v);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int w = lane < warps ? warp_sums[lane] : 0;
      const int w_incl = warp_inclusive_scan(w);
      if (lane < warps) warp_sums[lane] = w_incl - w;  // the warps before this one
      if (lane == 31) block_total = w_incl;
    }
    __syncthreads();
    if (e < E) expert_offset[e] = base + warp_sums[warp] + incl - v;
    base += block_total;
    __syncthreads();  // warp_sums and block_total read before the next pass writes them
  }
  if (threadIdx.x == 0) expert_offset[E] = base;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int begin = expert_offset[e], rows = expert_rows[e], end = expert_offset[e + 1];
    for (int t = begin / kPoolRowAlign; t < end / kPoolRowAlign; ++t) tile_expert[t] = e;
    for (int r = begin + rows; r < end; ++r) row_src[r] = -1;  // padding rows have no source
  }
}

// The r-th route of this chunk to expert e gets row expert_offset[e] +
// chunk_base[e] + r: warp w takes a contiguous segment of the
// chunk's routes, counts them per expert (__match_any_sync: the lowest lane
// of each expert's lanes adds them up), the warps' counts become exclusive
// bases in warp order (= route order), and each warp walks its segment
// again, a route's row its expert's base plus its rank among the same
// expert's lanes. kRankGroup experts a pass.
__global__ void __launch_bounds__(kPlanThreads) plan_assign_kernel(const int32_t* topk_idx, int64_t num_tokens,
                                                                    int k, int E, const int32_t* chunk_base,
                                                                    const int32_t* expert_offset,
                                                                    int32_t* route_row, int32_t* row_src) {
  __shared__ int32_t s_idx[kPlanChunk * kMaxTopK];
  __shared__ int32_t bases[kPlanWarps][kRankGroup];
  const int entries = load_chunk(topk_idx, num_tokens, k, E, s_idx, nullptr, false) * k;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kPlanChunk * k;
  for (int i = threadIdx.x; i < entries; i += blockDim.x)
    if (s_idx[i] < 0 || s_idx[i] >= E) route_row[r0 + i] = -1;
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const unsigned before = (1u << lane) - 1u;  // the lanes below this one
  const int per = (entries + kPlanThreads - 1) / kPlanThreads * 32;  // a warp's routes, whole rounds of 32
  const int begin = warp * per, end = min(entries, begin + per);   // (warp-uniform: every lane in every round)
  int32_t* mine = bases[warp];
  for (int e0 = 0; e0 < E; e0 += kRankGroup) {
    const int g = min(kRankGroup, E - e0);
    auto expert_of = [&](int i) {  // the route's expert in this group, else -1
      const unsigned e = i < end ? static_cast<unsigned>(s_idx[i]) - static_cast<unsigned>(e0) : ~0u;
      return e < static_cast<unsigned>(g) ? static_cast<int>(e) : -1;
    };
    for (int e = lane; e < g; e += 32) mine[e] = 0;
    __syncwarp();
    for (int i0 = begin; i0 < end; i0 += 32) {
      const int e = expert_of(i0 + lane);
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      if (e >= 0 && (peers & before) == 0) mine[e] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < g; e += blockDim.x) {
      int run = 0;
      for (int w = 0; w < kPlanWarps; ++w) {
        const int v = bases[w][e];
        bases[w][e] = run;
        run += v;
      }
    }
    __syncthreads();
    for (int i0 = begin; i0 < end; i0 += 32) {
      const int i = i0 + lane, e = expert_of(i);
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int base = e >= 0 ? mine[e] : 0;
      __syncwarp();  // every lane has its base before the lowest lane moves it on
      if (e >= 0) {
        const int row = expert_offset[e0 + e] + chunk_base[static_cast<int64_t>(blockIdx.x) * E + e0 + e] + base +
                        __popc(peers & before);
        route_row[r0 + i] = row;
        row_src[row] = static_cast<int32_t>(r0 + i);
        if ((peers & before) == 0) mine[e] = base + __popc(peers);
      }
      __syncwarp();
    }
    __syncthreads();  // the bases read before the next group's zeroing
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
    plan_count_kernel<<<chunks, kPlanThreads, 0, stream>>>(
        topk_idx, num_tokens, top_k, num_experts, b.chunk_counts, b.error_key);
    MEGAMOE_RETURN_IF_ERROR(check_launch("plan_count_kernel"));
  }
  plan_scan_kernel<<<1, 1024, 0, stream>>>(
      chunks, num_experts, b.chunk_counts, b.expert_rows, b.expert_offset, b.tile_expert, b.row_src);
  MEGAMOE_RETURN_IF_ERROR(check_launch("plan_scan_kernel"));
  if (chunks > 0) {
    plan_assign_kernel<<<chunks, kPlanThreads, 0, stream>>>(
        topk_idx, num_tokens, top_k, num_experts, b.chunk_counts, b.expert_offset, b.route_row, b.row_src);
    MEGAMOE_RETURN_IF_ERROR(check_launch("plan_assign_kernel"));
  }
  return Status::Ok();
}

}  // namespace megamoe::cuda
