#include "cuda/comm/ep_routing.h"

#include <algorithm>
#include <climits>
#include <string>

#include "cuda/common/cuda_status.h"

namespace megamoe::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread per source rank: its token count once its flag says its routing
// is in, or -1 when the wait gives up (reported, the first report wins).
__global__ void source_counts_kernel(DispatchLayout layout, EpRoutingArgs a) {
  const int s = blockIdx.x;
  if (threadIdx.x != 0) return;
  const auto* base = static_cast<const char*>(a.buffer);
  int64_t n = a.own_tokens;
  if (s != a.rank) {
    const auto* flag = reinterpret_cast<const uint32_t*>(base) + s;
    const uint64_t start = global_timer_ns();
    uint32_t sleep_ns = 32;
    for (n = -1;;) {
      if (load_acquire_sys(flag) >= a.epoch) {
        n = reinterpret_cast<const uint32_t*>(base + DispatchLayout::kTokensOffset)[s];
        break;
      }
      const uint64_t waited = global_timer_ns() - start;
      if (waited >= a.errors.timeout_ns) {
        report_timeout(a.errors, kKernelEpRouting, kBarrierPeer, static_cast<uint32_t>(s), waited);
        break;
      }
      __nanosleep(sleep_ns);
      if (sleep_ns < 4096) sleep_ns *= 2;
    }
    if (n > layout.max_tokens) n = -1;  // a corrupt count: nothing past the receive area is read
  }
  a.source_counts[s] = n;
}

// Grid (blocks per source, world): blockIdx.y is the source rank. The counts
// were written by the previous kernel on this stream (the kernel boundary
// orders them, and the acquires behind them, before these reads).
__global__ void virtual_routing_kernel(DispatchLayout layout, EpRoutingArgs a) {
  const int s = blockIdx.y;
  const int k = layout.top_k;
  const int64_t n = a.source_counts[s];
  const auto* base = static_cast<const char*>(a.buffer);
  const int32_t* ids = s == a.rank ? a.own_topk_idx
                                   : reinterpret_cast<const int32_t*>(base + layout.ids_offset(s, 0));
  int32_t* out = a.virtual_idx + static_cast<int64_t>(s) * layout.max_tokens * k;
  const int64_t entries = layout.max_tokens * k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < entries;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int32_t e = i / k < n ? ids[i] : -1;
    out[i] = e >= 0 && e / a.experts_per_rank == a.rank ? e % a.experts_per_rank : -1;
  }
}

// Where a pool row with source v = (s max_tokens + t) k + j (>= 0) comes
// from: token t of rank s, and whether s did not deliver it this time (its
// count this epoch -1, or t past it; no counts given: delivered).
struct RowOrigin {
  int s;
  int64_t t;
  bool missing;
};
__device__ __forceinline__ RowOrigin row_origin(const DispatchLayout& layout, int32_t v, const int64_t* source_counts) {
  const int s = static_cast<int>(v / layout.top_k / layout.max_tokens);
  const int64_t t = v / layout.top_k % layout.max_tokens;
  return {s, t, source_counts != nullptr && t >= source_counts[s]};
}

__global__ void gather_ep_rows_kernel(DispatchLayout layout, const char* buffer, int rank, const uint4* own_x,
                                      const int32_t* row_src, const int32_t* pool_rows, int64_t capacity,
                                      const int64_t* source_counts, uint4* pool) {
  const int64_t chunks = layout.slot_bytes() / 16;
  const int64_t rows = *pool_rows < capacity ? *pool_rows : capacity;
  const int64_t total = rows * chunks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / chunks, c = i % chunks;
    const int32_t v = row_src[r];
    uint4 value = make_uint4(0, 0, 0, 0);
    if (v >= 0) {
      const RowOrigin o = row_origin(layout, v, source_counts);
      if (o.missing) {
        value = make_uint4(~0u, ~0u, ~0u, ~0u);  // NaN: that source did not deliver this row this time
      } else {
        value = o.s == rank ? own_x[o.t * chunks + c]
                            : reinterpret_cast<const uint4*>(buffer + layout.slot_offset(o.s, o.t))[c];
      }
    }
    pool[i] = value;
  }
}

// The e4m3 form: a warp per pool row (its source looked up once), its lanes
// over the row's hidden / 16 pieces of bytes and its hidden / 128 scales.
__global__ void gather_ep_rows_e4m3_kernel(DispatchLayout layout, const char* buffer, const int32_t* row_src,
                                           const int32_t* pool_rows, int64_t capacity, const int64_t* source_counts,
                                           uint4* q, float* scales) {
  const int lane = threadIdx.x & 31;
  const int64_t pieces = layout.hidden / 16, groups = layout.hidden / 128;
  const int64_t rows = *pool_rows < capacity ? *pool_rows : capacity;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const int32_t v = row_src[r];
    const char* slot = nullptr;  // null: a padding row (zeros, scale 1: a zero tile's) or a missing one (NaN)
    bool missing = false;
    if (v >= 0) {
      const RowOrigin o = row_origin(layout, v, source_counts);
      missing = o.missing;
      if (!missing) slot = buffer + layout.slot_offset(o.s, o.t);
    }
    const uint4 fill = missing ? make_uint4(~0u, ~0u, ~0u, ~0u) : make_uint4(0, 0, 0, 0);
    for (int64_t c = lane; c < pieces; c += 32)
      q[r * pieces + c] = slot != nullptr ? reinterpret_cast<const uint4*>(slot)[c] : fill;
    for (int64_t g = lane; g < groups; g += 32)
      scales[r * groups + g] = slot != nullptr ? reinterpret_cast<const float*>(slot + layout.hidden)[g]
                                               : missing ? __int_as_float(-1) : 1.0f;
  }
}

}  // namespace

Status gather_ep_rows_e4m3(const DispatchLayout& layout, const void* buffer, const int32_t* row_src,
                           const int32_t* pool_rows, int64_t capacity, uint8_t* q, float* scales, cudaStream_t stream,
                           const int64_t* source_counts) {
  if (layout.hidden <= 0 || layout.hidden % 128 != 0 || layout.top_k < 1)
    return invalid_argument("EP e4m3 gather: hidden must be a positive multiple of 128 and top_k >= 1");
  if (buffer == nullptr || row_src == nullptr || pool_rows == nullptr || q == nullptr || scales == nullptr)
    return invalid_argument("EP e4m3 gather: a pointer is null");
  if (reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(buffer) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(scales) % 4 != 0)
    return invalid_argument("EP e4m3 gather: the pool and the symmetric buffer must be 16-byte aligned");
  const int64_t warps_per_block = kThreads / 32;  // a warp per pool row
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((capacity + warps_per_block - 1) / warps_per_block, 4096));
  gather_ep_rows_e4m3_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      layout, static_cast<const char*>(buffer), row_src, pool_rows, capacity, source_counts,
      reinterpret_cast<uint4*>(q), scales);
  return cuda_status("EP e4m3 gather", cudaGetLastError());
}

Status gather_ep_rows(const DispatchLayout& layout, const void* buffer, int rank, const void* own_x,
                      const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, void* pool,
                      cudaStream_t stream, const int64_t* source_counts) {
  if (layout.slot_bytes() % 16 != 0 || layout.top_k < 1)
    return invalid_argument("EP gather: hidden must be a multiple of 8 and top_k >= 1");
  // own_x may be null on a rank without tokens: no pool row then comes from it.
  if (buffer == nullptr || row_src == nullptr || pool_rows == nullptr || pool == nullptr)
    return invalid_argument("EP gather: a pointer is null");
  if (reinterpret_cast<uintptr_t>(own_x) % 16 != 0 || reinterpret_cast<uintptr_t>(pool) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(buffer) % 16 != 0)
    return invalid_argument("EP gather: x, the pool and the symmetric buffer must be 16-byte aligned");
  const int64_t work = capacity * static_cast<int64_t>(layout.slot_bytes() / 16);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 4096));
  gather_ep_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      layout, static_cast<const char*>(buffer), rank, static_cast<const uint4*>(own_x), row_src, pool_rows, capacity,
      source_counts, static_cast<uint4*>(pool));
  return cuda_status("EP gather", cudaGetLastError());
}

Status build_ep_virtual_routing(const DispatchLayout& layout, const EpRoutingArgs& a, cudaStream_t stream) {
  if (layout.world < 1 || layout.world > 8 || a.rank < 0 || a.rank >= layout.world)
    return invalid_argument("EP routing: rank " + std::to_string(a.rank) + " of " + std::to_string(layout.world));
  if (layout.top_k < 1 || layout.top_k > 32 || layout.max_tokens < 0)
    return invalid_argument("EP routing: a bad layout (top_k " + std::to_string(layout.top_k) + ")");
  if (a.own_tokens < 0 || a.own_tokens > layout.max_tokens)
    return invalid_argument("EP routing: " + std::to_string(a.own_tokens) + " own tokens, more than max_tokens = " +
                            std::to_string(layout.max_tokens));
  if (a.experts_per_rank < 1) return invalid_argument("EP routing: experts_per_rank must be >= 1");
  if (a.epoch == 0) return invalid_argument("EP routing: epoch 0 is the flags' initial value; start at 1");
  if (a.buffer == nullptr || a.virtual_idx == nullptr || a.source_counts == nullptr ||
      (a.own_tokens > 0 && a.own_topk_idx == nullptr))
    return invalid_argument("EP routing: a pointer is null");
  const int64_t entries = layout.max_tokens * layout.top_k;
  // The plan numbers routes v * k + j and pool rows in int32.
  if (static_cast<int64_t>(layout.world) * entries > INT32_MAX / 2)
    return invalid_argument("EP routing: world x max_tokens x top_k = " +
                            std::to_string(static_cast<int64_t>(layout.world) * entries) +
                            " routes exceed what the plan numbers in int32");
  source_counts_kernel<<<static_cast<unsigned>(layout.world), 32, 0, stream>>>(layout, a);
  MEGAMOE_RETURN_IF_ERROR(cuda_status("EP routing: wait for the sources", cudaGetLastError()));
  const int64_t per_source = std::max<int64_t>(1, std::min<int64_t>((entries + kThreads - 1) / kThreads, 256));
  virtual_routing_kernel<<<dim3(static_cast<unsigned>(per_source), static_cast<unsigned>(layout.world)), kThreads, 0,
                           stream>>>(layout, a);
  return cuda_status("EP routing", cudaGetLastError());
}

}  // namespace megamoe::cuda
