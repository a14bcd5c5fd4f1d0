#include "row_release.h"

namespace megamoe::testing {
namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void row_release_kernel(const uint4* src, uint4* dst, int64_t chunks_per_row, const int32_t* order,
                                   int tiles, uint32_t* counters, uint32_t ready_value, uint64_t delay_ns) {
  for (int i = 0; i < tiles; ++i) {
    const int m = order[i];
    if (threadIdx.x == 0) {
      const uint64_t until = now_ns() + delay_ns;
      while (now_ns() < until) {
      }
    }
    __syncthreads();
    const int64_t first = static_cast<int64_t>(m) * 128 * chunks_per_row, n = 128 * chunks_per_row;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) dst[first + c] = src[first + c];
    __syncthreads();  // the whole tile is written (CTA scope) ...
    if (threadIdx.x == 0) {
      __threadfence();  // ... and ordered at GPU scope before the counter
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(counters + m), "r"(ready_value) : "memory");
    }
  }
}

}  // namespace

cudaError_t launch_row_release(const void* src, void* dst, int64_t cols, const int32_t* order, int tiles,
                               uint32_t* counters, uint32_t ready_value, uint64_t delay_ns, cudaStream_t stream) {
  if ((cols * 2) % 16 != 0) return cudaErrorInvalidValue;
  row_release_kernel<<<1, 256, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), cols * 2 / 16,
                                            order, tiles, counters, ready_value, delay_ns);
  return cudaGetLastError();
}

}  // namespace megamoe::testing
