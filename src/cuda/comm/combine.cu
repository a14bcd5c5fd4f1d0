#include "cuda/comm/combine.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/comm/peer_ops.cuh"
#include "cuda/common/cuda_status.h"
#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {
namespace {

constexpr int kWarps = 8;

__global__ void combine_push_kernel(PeerView v, DispatchLayout layout, CombineArgs a) {
  const int lane = threadIdx.x & 31;
  const int k = layout.top_k;
  const int64_t V = static_cast<int64_t>(layout.world) * layout.max_tokens;
  const int64_t chunks = layout.slot_bytes() / 16;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t vt = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; vt < V; vt += warps) {
    const int s = static_cast<int>(vt / layout.max_tokens);
    const int64_t t = vt % layout.max_tokens, n = a.source_counts[s];
    if (t >= n) continue;  // past the source's tokens (or a source that never came: n = -1)
    for (int j = 0; j < k; ++j) {
      if (a.virtual_idx[vt * k + j] < 0) continue;  // not a route of this owner
      if (a.outputs != nullptr) {
        const auto* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.outputs) +
                                                         (static_cast<size_t>(j) * V + vt) * layout.slot_bytes());
        comm::warp_copy_row(reinterpret_cast<uint4*>(static_cast<char*>(v.peers[s]) + layout.combine_slot_offset(j, t)),
                            src, chunks, lane);
      }
      if (a.route_values != nullptr && lane == 0)
        reinterpret_cast<float*>(static_cast<char*>(v.peers[s]) + layout.route_values_offset())[t * k + j] =
            a.route_values[vt * k + j];
    }
  }
  if (!comm::last_block_done(a.blocks_done)) return;
  for (int s = 0; s < v.world; ++s) {
    // A source whose routing never came got nothing from this owner: no flag,
    // so its own wait times out and names this owner rather than summing stale slots.
    if (a.source_counts[s] < 0) continue;
    comm::store_release_sys(
        reinterpret_cast<uint32_t*>(static_cast<char*>(v.peers[s]) + DispatchLayout::kCombineFlagsOffset) + v.rank,
        a.epoch);
  }
}

__global__ void combine_signal_kernel(PeerView v, const int64_t* source_counts, uint32_t epoch) {
  const int s = threadIdx.x;
  if (s >= v.world || source_counts[s] < 0) return;
  comm::store_release_sys(
      reinterpret_cast<uint32_t*>(static_cast<char*>(v.peers[s]) + DispatchLayout::kCombineFlagsOffset) + v.rank,
      epoch);
}

__global__ void combine_route_values_kernel(const float* values, const int32_t* topk_idx, int64_t n, int E,
                                            const unsigned long long* error_key, float* out) {
  const bool failed = *error_key != kNoPlanError;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = topk_idx[i];
    out[i] = failed ? NAN : (e >= 0 && e < E ? values[i] : 0.0f);
  }
}

// One lane per owner rank.
__global__ void combine_wait_kernel(const uint32_t* flags, int world, uint32_t epoch, DeviceErrorSink errors,
                                    unsigned long long* poison_key) {
  const int owner = threadIdx.x;
  if (owner >= world) return;
  const uint64_t start = global_timer_ns();
  uint32_t sleep_ns = 32;
  for (;;) {
    uint32_t seen;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(flags + owner) : "memory");
    if (seen >= epoch) return;
    const uint64_t waited = global_timer_ns() - start;
    if (waited >= errors.timeout_ns) {
      report_timeout(errors, kKernelEpCombine, kBarrierPeer, static_cast<uint32_t>(owner), waited);
      if (poison_key != nullptr) atomicMin(poison_key, static_cast<unsigned long long>(kPlanErrorPeer));
      return;
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 4096) sleep_ns *= 2;
  }
}

}  // namespace

Status combine_push(const PeerView& v, const DispatchLayout& layout, const CombineArgs& a, cudaStream_t stream) {
  if (v.world < 1 || v.world > 8 || v.rank < 0 || v.rank >= v.world || v.peers == nullptr || layout.world != v.world)
    return invalid_argument("combine: a bad peer view or layout (rank " + std::to_string(v.rank) + " of " +
                            std::to_string(v.world) + ")");
  if (layout.bytes() > v.bytes)
    return invalid_argument("combine: the layout needs " + std::to_string(layout.bytes()) +
                            " bytes per rank; the symmetric buffer has " + std::to_string(v.bytes));
  if (layout.top_k < 1 || layout.top_k > 32 || layout.slot_bytes() % 16 != 0)
    return invalid_argument("combine: top_k must be in [1, 32] and hidden a multiple of 8");
  if (a.epoch == 0) return invalid_argument("combine: epoch 0 is the flags' initial value; start at 1");
  if (a.virtual_idx == nullptr || a.source_counts == nullptr || a.blocks_done == nullptr)
    return invalid_argument("combine: a pointer is null");
  if (reinterpret_cast<uintptr_t>(a.outputs) % 16 != 0 || reinterpret_cast<uintptr_t>(v.local) % 16 != 0)
    return invalid_argument("combine: the outputs and the symmetric buffer must be 16-byte aligned");
  const int64_t V = static_cast<int64_t>(layout.world) * layout.max_tokens;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((V + kWarps - 1) / kWarps, 1024));
  combine_push_kernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(v, layout, a);
  return cuda_status("combine: push", cudaGetLastError());
}

Status combine_signal(const PeerView& v, const DispatchLayout& layout, const int64_t* source_counts, uint32_t epoch,
                      cudaStream_t stream) {
  if (v.world < 1 || v.world > 8 || v.peers == nullptr || layout.world != v.world)
    return invalid_argument("combine: a bad peer view or layout");
  if (epoch == 0) return invalid_argument("combine: epoch 0 is the flags' initial value; start at 1");
  if (source_counts == nullptr) return invalid_argument("combine: source_counts is null");
  combine_signal_kernel<<<1, 32, 0, stream>>>(v, source_counts, epoch);
  return cuda_status("combine: signal", cudaGetLastError());
}

Status combine_route_values(const DispatchLayout& layout, const void* buffer, const int32_t* topk_idx,
                            int64_t tokens, int num_experts, const unsigned long long* error_key, float* out,
                            cudaStream_t stream) {
  if (buffer == nullptr || error_key == nullptr || (tokens > 0 && (topk_idx == nullptr || out == nullptr)))
    return invalid_argument("combine: a pointer is null");
  if (tokens < 0 || tokens > layout.max_tokens)
    return invalid_argument("combine: " + std::to_string(tokens) + " tokens, the layout holds " +
                            std::to_string(layout.max_tokens));
  const int64_t n = tokens * layout.top_k;
  if (n == 0) return Status::Ok();
  const auto* values =
      reinterpret_cast<const float*>(static_cast<const char*>(buffer) + layout.route_values_offset());
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  combine_route_values_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(values, topk_idx, n, num_experts,
                                                                                 error_key, out);
  return cuda_status("combine: route values", cudaGetLastError());
}

Status combine_wait(const DispatchLayout& layout, const void* buffer, uint32_t epoch, const DeviceErrorSink& errors,
                    cudaStream_t stream, unsigned long long* poison_key) {
  if (layout.world < 1 || layout.world > 8) return invalid_argument("combine: world not in [1, 8]");
  if (buffer == nullptr) return invalid_argument("combine: the buffer is null");
  if (epoch == 0) return invalid_argument("combine: epoch 0 is the flags' initial value; start at 1");
  const auto* flags = reinterpret_cast<const uint32_t*>(static_cast<const char*>(buffer) +
                                                       DispatchLayout::kCombineFlagsOffset);
  combine_wait_kernel<<<1, 32, 0, stream>>>(flags, layout.world, epoch, errors, poison_key);
  return cuda_status("combine: wait", cudaGetLastError());
}

}  // namespace megamoe::cuda
