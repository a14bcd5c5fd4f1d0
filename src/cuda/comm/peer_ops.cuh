// Device pieces the NVLink pushes share (dispatch.cu, combine.cu): copying a
// row by 16-byte pieces across a warp, and the grid-wide "all my writes are
// out, now raise the flags" step. Device code.
#pragma once

#include <cstdint>

namespace megamoe::cuda::comm {

// One warp copies a row of `chunks` 16-byte pieces (lane-strided).
__device__ __forceinline__ void warp_copy_row(uint4* dst, const uint4* src, int64_t chunks, int lane) {
  for (int64_t c = lane; c < chunks; c += 32) dst[c] = src[c];
}

// Called by every thread once its peer writes are issued: true in exactly one
// thread of the grid, the first of the last block to finish, after every
// block's writes are visible system-wide; that thread then raises the flags.
// The block counter wraps to 0 in the same atomic step as the last block's
// increment, so the next launch finds it at 0 whatever came before.
__device__ __forceinline__ bool last_block_done(uint32_t* blocks_done) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return false;
  if (atomicInc(blocks_done, gridDim.x - 1) != gridDim.x - 1) return false;
  __threadfence_system();
  return true;
}

// A flag store that releases everything before it, to readers on any GPU.
__device__ __forceinline__ void store_release_sys(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

}  // namespace megamoe::cuda::comm
